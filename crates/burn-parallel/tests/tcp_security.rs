//! The hardened `tcp` rendezvous: job-token authentication, the store bound to `MASTER_ADDR`,
//! and timeout settings that cannot be represented.
//!
//! Some tests re-execute this test executable with a launcher's environment to run only the
//! ignored `env_worker` test, as `tests/burnrun.rs` does: the environment is then the
//! process's own, with no `set_var` racing other tests.

use std::io::{Read, Write};
use std::net::{TcpStream, UdpSocket};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use burn_parallel::comm::tcp::{JobToken, TcpTransport};
use burn_parallel::world::{connect_tcp, connect_tcp_with_rendezvous};
use burn_parallel::{
    CollectiveError, ProcessGroup, ReduceOp, Result, TcpConfig, TcpRendezvous, run_local,
};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

const TOKEN: &str = "the right token of this job";
const TIMEOUT: Duration = Duration::from_secs(10);

fn config(rank: usize, world_size: usize, port: u16, token: Option<&str>) -> TcpConfig {
    let config = TcpConfig::new(rank, world_size, "127.0.0.1", port).with_timeout(TIMEOUT);
    match token {
        Some(t) => config.with_job_token(JobToken::new(t).unwrap()),
        None => config,
    }
}

// ----------------------------------------------------------------------------------------
// A forger who speaks the store's protocol: the message format of the rendezvous, written
// independently here from its documentation in `comm/tcp/rendezvous.rs`.

fn store_message(value: &Value) -> Vec<u8> {
    let body = serde_json::to_vec(value).unwrap();
    let mut buf = b"BPRV".to_vec();
    buf.push(2);
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    buf
}

fn read_store_message(stream: &mut TcpStream) -> std::io::Result<Value> {
    let mut head = [0u8; 9];
    stream.read_exact(&mut head)?;
    assert_eq!(&head[..5], b"BPRV\x02", "not a store message");
    let len = u32::from_le_bytes(head[5..9].try_into().unwrap()) as usize;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body).unwrap())
}

fn hmac(token: &str, label: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes()).unwrap();
    for part in std::iter::once(label.as_bytes()).chain(parts.iter().copied()) {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

fn nonce_of(value: &Value) -> Vec<u8> {
    value["nonce"]
        .as_array()
        .expect("a challenge carries a nonce")
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect()
}

/// A registration of `rank` in a world of `world_size`, with the HMAC of `token` over
/// `challenge` (the store's challenge on some connection).
fn forged_registration(rank: usize, world_size: usize, token: &str, challenge: &[u8]) -> Value {
    let (pid, nonce, data_addr) = (4242u32, [7u8; 32], "127.0.0.1:9");
    let mut fields = Vec::new();
    fields.extend_from_slice(&(rank as u64).to_le_bytes());
    fields.extend_from_slice(&(world_size as u64).to_le_bytes());
    fields.extend_from_slice(&pid.to_le_bytes());
    fields.extend_from_slice(&nonce);
    fields.extend_from_slice(data_addr.as_bytes());
    let tag = hmac(
        token,
        "burn-parallel/rendezvous/v2/register",
        &[challenge, &fields],
    );
    json!({
        "rank": rank, "world_size": world_size, "data_addr": data_addr, "pid": pid,
        "nonce": nonce.to_vec(), "tag": tag,
    })
}

/// Connects to the store and returns the connection and its challenge.
fn challenged(port: u16) -> (TcpStream, Value) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let challenge = read_store_message(&mut stream).unwrap();
    (stream, challenge)
}

/// Sends `registration` on `stream` and returns the store's reply.
fn reply_to(stream: &mut TcpStream, registration: &Value) -> Value {
    stream.write_all(&store_message(registration)).unwrap();
    read_store_message(stream).unwrap()
}

#[test]
fn the_forgers_message_format_is_the_stores() {
    // The forger of the next test is only convincing if a registration it signs with the
    // right token on the right challenge is accepted: here it is, as rank 1.
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let short = config(0, 2, port, Some(TOKEN)).with_timeout(Duration::from_secs(2));
    let rank0 = thread::spawn(move || connect_tcp_with_rendezvous(&short, rendezvous).map(|_| ()));
    let (mut stream, challenge) = challenged(port);
    assert_eq!(challenge["authenticated"], json!(true), "{challenge}");
    let reply = reply_to(
        &mut stream,
        &forged_registration(1, 2, TOKEN, &nonce_of(&challenge)),
    );
    assert!(reply.get("Accepted").is_some(), "{reply}");
    // Rank 0 then cannot reach the forged data address: its rendezvous fails, bounded.
    drop(stream);
    assert!(rank0.join().unwrap().is_err());
}

/// The local address of this machine on its default route, if it has one besides loopback.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let probe = UdpSocket::bind("0.0.0.0:0").ok()?;
    probe.connect("203.0.113.1:9").ok()?;
    let ip = probe.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn forged_stray_and_silent_connections_neither_join_nor_fail_the_job() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let start = Instant::now();

    // Before the rendezvous is served: a connection that stays silent, one that sends
    // garbage, and a forged registration of rank 1 (right format, wrong token). They wait in
    // the listener's backlog.
    let silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff\xfe")
        .unwrap();
    // The forger connects now (into the backlog, before the store serves anyone) and speaks
    // once rank 0 serves it, below: a thread spawned here could be scheduled only after the
    // rendezvous had ended on a loaded machine, and find the port closed.
    let mut forger_stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    forger_stream.set_read_timeout(Some(TIMEOUT)).unwrap();

    let groups = thread::scope(|scope| {
        let rank0 = scope.spawn(|| {
            let group = connect_tcp_with_rendezvous(&config(0, 2, port, Some(TOKEN)), rendezvous)?;
            Ok::<_, CollectiveError>((group, start.elapsed()))
        });
        // The forger of the backlog: right format, wrong token.
        let challenge = read_store_message(&mut forger_stream).unwrap();
        let forged = forged_registration(1, 2, "a wrong token", &nonce_of(&challenge));
        let forged = reply_to(&mut forger_stream, &forged);
        // During the rendezvous: a replayed registration (signed with the right token, but
        // for the challenge of another connection), a registration claiming rank 0 with a
        // wrong token, and one with no token at all.
        let (first, challenge) = challenged(port);
        let genuine = forged_registration(1, 2, TOKEN, &nonce_of(&challenge));
        drop(first);
        let (mut second, _) = challenged(port);
        let replayed = reply_to(&mut second, &genuine);
        let (mut third, challenge) = challenged(port);
        let rank0_claim = reply_to(
            &mut third,
            &forged_registration(0, 2, "wrong", &nonce_of(&challenge)),
        );
        let (mut fourth, _) = challenged(port);
        let mut untagged = forged_registration(1, 2, TOKEN, &[0; 32]);
        untagged["tag"] = Value::Null;
        let untagged = reply_to(&mut fourth, &untagged);

        // Now the real rank 1.
        let rank1 = connect_tcp(&config(1, 2, port, Some(TOKEN)))?;
        let (rank0, formed) = rank0.join().unwrap()?;
        for (what, reply) in [
            ("forged", &forged),
            ("replayed", &replayed),
            ("rank-0 claim", &rank0_claim),
            ("untagged", &untagged),
        ] {
            assert!(
                reply.get("Rejected").is_some(),
                "the {what} registration got {reply}"
            );
        }
        Ok::<_, CollectiveError>((vec![rank0, rank1], formed, forged))
    });
    let (groups, formed, forged) = groups.unwrap();
    // A silent connection delays nobody: the store serves connections at once, not one by one
    // with a wait of seconds for each.
    assert!(
        formed < Duration::from_secs(4),
        "the world formed after {formed:?}"
    );

    // The forger got a rejection, never the address table.
    assert!(forged.get("Rejected").is_some(), "{forged}");
    assert!(forged.to_string().contains("wrong job token"), "{forged}");
    // The silent connection got its challenge, then was closed: nothing else.
    let mut silent = silent;
    silent.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut heard = Vec::new();
    silent.read_to_end(&mut heard).unwrap();
    let challenge: Value = serde_json::from_slice(&heard[9..]).unwrap();
    assert!(challenge.get("nonce").is_some(), "{challenge}");
    assert_eq!(
        heard.len(),
        9 + serde_json::to_vec(&challenge).unwrap().len()
    );

    // The job works, with the right results.
    let results = thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                scope.spawn(move || {
                    let rank = group.rank() as f32;
                    let sum = group.all_reduce_f32(vec![rank + 1.0, 10.0 * rank], ReduceOp::Sum)?;
                    let max = group.all_reduce_f32(vec![rank], ReduceOp::Max)?;
                    let root: u32 =
                        group.broadcast_object((group.rank() == 0).then_some(&7u32), 0)?;
                    group.barrier()?;
                    Ok::<_, CollectiveError>((sum, max, root))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect::<Vec<_>>()
    });
    for (sum, max, root) in results {
        assert_eq!(sum, vec![3.0, 10.0]);
        assert_eq!(max, vec![1.0]);
        assert_eq!(root, 7);
    }
}

#[test]
fn a_rank_with_a_wrong_token_fails_with_a_job_token_error_and_disturbs_nobody() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let short = Duration::from_millis(1500);
    thread::scope(|scope| {
        // The impostor starts first, and keeps trying during the whole rendezvous.
        let impostor = scope.spawn(|| {
            let start = Instant::now();
            let result =
                connect_tcp(&config(1, 2, port, Some("not the token")).with_timeout(short));
            (result.map(|_| ()), start.elapsed())
        });
        thread::sleep(Duration::from_millis(200));
        let rank0 = scope
            .spawn(|| connect_tcp_with_rendezvous(&config(0, 2, port, Some(TOKEN)), rendezvous));
        thread::sleep(Duration::from_millis(200));
        let rank1 = connect_tcp(&config(1, 2, port, Some(TOKEN))).unwrap();
        let rank0 = rank0.join().unwrap().unwrap();
        let (result, elapsed) = impostor.join().unwrap();
        match result {
            Err(CollectiveError::JobToken { rank: 1, reason }) => {
                assert!(reason.contains("BURN_PARALLEL_JOB_TOKEN"), "{reason}");
                assert!(reason.contains("rejected"), "{reason}");
            }
            other => panic!("the impostor got {other:?}"),
        }
        // It failed after its rendezvous timeout, not before, and did not hang.
        assert!(
            elapsed >= short && elapsed < short + Duration::from_secs(3),
            "{elapsed:?}"
        );
        let sums = thread::scope(|s| {
            let a = s.spawn(|| rank0.all_reduce_f32(vec![1.0], ReduceOp::Sum));
            let b = rank1.all_reduce_f32(vec![2.0], ReduceOp::Sum);
            (a.join().unwrap().unwrap(), b.unwrap())
        });
        assert_eq!(sums, (vec![3.0], vec![3.0]));
    });
}

#[test]
fn rank_0_reports_the_token_rejections_when_a_rank_never_joins() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let short = Duration::from_millis(800);
    let (rank0, rank1) = thread::scope(|scope| {
        let rank1 =
            scope.spawn(|| connect_tcp(&config(1, 2, port, Some("other")).with_timeout(short)));
        let rank0 = connect_tcp_with_rendezvous(
            &config(0, 2, port, Some(TOKEN)).with_timeout(short),
            rendezvous,
        );
        (rank0.map(|_| ()), rank1.join().unwrap().map(|_| ()))
    });
    match rank0 {
        Err(CollectiveError::Rendezvous(m)) => {
            assert!(m.contains("waiting for rank(s) [1]"), "{m}");
            assert!(m.contains("failed the job-token check"), "{m}");
        }
        other => panic!("rank 0 got {other:?}"),
    }
    assert!(
        matches!(rank1, Err(CollectiveError::JobToken { rank: 1, .. })),
        "{rank1:?}"
    );
}

#[test]
fn a_token_on_one_side_only_is_a_job_token_error_at_once() {
    for (token0, token1) in [(Some(TOKEN), None), (None, Some(TOKEN))] {
        let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
        let port = rendezvous.port();
        let short = Duration::from_millis(1500);
        let start = Instant::now();
        let rank1 = thread::scope(|scope| {
            let rank0 = scope.spawn(|| {
                connect_tcp_with_rendezvous(
                    &config(0, 2, port, token0).with_timeout(short),
                    rendezvous,
                )
            });
            let rank1 = connect_tcp(&config(1, 2, port, token1).with_timeout(short));
            let elapsed = start.elapsed();
            assert!(rank0.join().unwrap().is_err());
            (rank1.map(|_| ()), elapsed)
        });
        match rank1 {
            (Err(CollectiveError::JobToken { rank: 1, reason }), elapsed) => {
                assert!(reason.contains("BURN_PARALLEL_JOB_TOKEN"), "{reason}");
                assert!(elapsed < short, "not at once: {elapsed:?}");
            }
            other => panic!("rank 0 {token0:?}, rank 1 {token1:?}: {other:?}"),
        }
    }
}

#[test]
fn an_authenticated_world_of_4_computes_like_an_unauthenticated_one() {
    for token in [Some(TOKEN), None] {
        let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
        let port = rendezvous.port();
        let mut rendezvous = Some(rendezvous);
        let sums = thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|rank| {
                    let rendezvous = if rank == 0 { rendezvous.take() } else { None };
                    scope.spawn(move || {
                        let t = TcpTransport::connect(&config(rank, 4, port, token), rendezvous)?;
                        let group = ProcessGroup::world(t);
                        group.all_reduce_f32(vec![rank as f32, 1.0], ReduceOp::Sum)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect::<Vec<_>>()
        });
        assert!(sums.iter().all(|s| s == &[6.0, 4.0]), "{token:?}: {sums:?}");
    }
}

// ----------------------------------------------------------------------------------------
// Where the store listens.

#[test]
fn the_store_listens_on_master_addr_only() {
    // A MASTER_ADDR that is not an address of this machine: a typed error, not a store on
    // every interface.
    let config = TcpConfig::new(0, 2, "203.0.113.7", 29999).with_timeout(Duration::from_secs(1));
    match connect_tcp(&config) {
        Err(CollectiveError::Rendezvous(m)) => {
            assert!(m.contains("not an address of this machine"), "{m}")
        }
        other => panic!("{other:?}"),
    }

    let Some(ip) = non_loopback_ip() else {
        println!("NOTICE: this machine has no address besides loopback; binding check skipped");
        return;
    };
    // Rank 0 on this machine's network address: the store is not reachable through loopback.
    // The port is one free on the address whose loopback twin this test holds, bound but not
    // listening: no other test's listener can answer on 127.0.0.1:port (which once made this
    // test fail), a connection there is refused unless the store listens on loopback, and a
    // store bound to every interface could not bind the port at all.
    let (port, _loopback) = port_free_on_both(ip);
    let short = Duration::from_secs(3);
    let rank0 = thread::spawn(move || {
        connect_tcp(&TcpConfig::new(0, 2, ip.to_string(), port).with_timeout(short)).map(|_| ())
    });
    // Wait until it listens on its address.
    let deadline = Instant::now() + short;
    while TcpStream::connect((ip, port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "rank 0 never listened on {ip}:{port}"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let through_loopback = TcpStream::connect(("127.0.0.1", port));
    assert!(
        through_loopback.is_err(),
        "the store at {ip}:{port} is also reachable through 127.0.0.1"
    );
    // The job itself forms through MASTER_ADDR.
    let rank1 = connect_tcp(&TcpConfig::new(1, 2, ip.to_string(), port).with_timeout(short));
    assert!(rank1.is_ok(), "{rank1:?}");
    assert!(rank0.join().unwrap().is_ok());
}

/// A port free on `ip`, and a socket bound (not listening) to `127.0.0.1` on that port.
fn port_free_on_both(ip: std::net::IpAddr) -> (u16, socket2::Socket) {
    use socket2::{Domain, Socket, Type};
    for _ in 0..100 {
        let port = std::net::TcpListener::bind((ip, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let loopback = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        if loopback.bind(&addr.into()).is_ok() {
            return (port, loopback);
        }
    }
    panic!("no port free on both {ip} and 127.0.0.1 in 100 tries");
}

// ----------------------------------------------------------------------------------------
// Timeouts that cannot be represented.

#[test]
fn a_timeout_too_long_to_represent_is_a_typed_error() {
    for timeout in [
        Duration::MAX,
        Duration::from_secs(u64::MAX / 2),
        Duration::ZERO,
    ] {
        let config = TcpConfig::new(1, 2, "127.0.0.1", 1).with_timeout(timeout);
        match connect_tcp(&config) {
            Err(CollectiveError::InvalidTimeout { setting, .. }) => {
                assert_eq!(setting, "TcpConfig::timeout")
            }
            other => panic!("{timeout:?}: {other:?}"),
        }
    }
    // A group's timeout: every wait fails with the error, no rank panics.
    let out = run_local(2, |group| {
        group
            .with_timeout(Duration::MAX)
            .all_reduce_f32(vec![1.0], ReduceOp::Sum)
    });
    match out {
        Err(CollectiveError::InvalidTimeout { setting, .. }) => {
            assert_eq!(setting, "ProcessGroup::with_timeout")
        }
        other => panic!("{other:?}"),
    }
    // The longest accepted timeout works.
    let out = run_local(2, |group| {
        group
            .with_timeout(burn_parallel::comm::tcp::MAX_TIMEOUT)
            .all_reduce_f32(vec![1.0], ReduceOp::Sum)
    });
    assert_eq!(out.unwrap(), vec![vec![2.0], vec![2.0]]);
}

/// Arguments of `env_worker` in a re-executed process; unset in the test process itself.
const WORKER: &str = "BURN_PARALLEL_TCP_SECURITY_WORKER";

/// Not a test: the body of the processes started by the tests below. Joins the world of its
/// environment, all-reduces its rank + 1, and prints the outcome.
#[test]
#[ignore = "run by the tcp_security tests inside the processes they start"]
fn env_worker() {
    if std::env::var(WORKER).is_err() {
        return;
    }
    let outcome: Result<Vec<f32>> = burn_parallel::init_from_env()
        .and_then(|group| group.all_reduce_f32(vec![group.rank() as f32 + 1.0], ReduceOp::Sum));
    match outcome {
        Ok(sum) => println!("WORKER OK {sum:?}"),
        Err(e) => {
            println!("WORKER ERR {e:?}");
            std::process::exit(3);
        }
    }
}

/// This test executable, re-executed to run `env_worker` with `vars` (and no inherited token).
fn worker(vars: &[(&str, &str)]) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "env_worker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--quiet",
        ])
        .args(["--test-threads", "1"])
        .env(WORKER, "1")
        .env_remove("BURN_PARALLEL_JOB_TOKEN")
        .env_remove("BURN_PARALLEL_TIMEOUT_SECS")
        .env_remove("BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS")
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn text(output: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn unusable_timeout_variables_are_typed_errors_not_panics() {
    let world_of_one = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ];
    for variable in [
        "BURN_PARALLEL_TIMEOUT_SECS",
        "BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS",
    ] {
        for value in ["inf", "NaN", "-1", "1e30", "0"] {
            let mut vars = world_of_one.to_vec();
            vars.push((variable, value));
            let output = worker(&vars).output().unwrap();
            let all = text(&output);
            assert_eq!(output.status.code(), Some(3), "{variable}={value}: {all}");
            assert!(
                all.contains("WORKER ERR InvalidTimeout") && all.contains(variable),
                "{variable}={value}: {all}"
            );
        }
        let mut vars = world_of_one.to_vec();
        vars.push((variable, "2.5"));
        let output = worker(&vars).output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
    }
}

#[test]
fn processes_with_different_tokens_fail_with_the_job_token_error() {
    let port = TcpRendezvous::bind("127.0.0.1:0")
        .unwrap()
        .port()
        .to_string();
    let vars = |rank: &'static str| {
        vec![
            ("RANK", rank),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS", "2"),
        ]
    };
    let mut rank0 = worker(&vars("0"));
    rank0
        .env("MASTER_PORT", &port)
        .env("BURN_PARALLEL_JOB_TOKEN", "token-a");
    let mut rank1 = worker(&vars("1"));
    rank1
        .env("MASTER_PORT", &port)
        .env("BURN_PARALLEL_JOB_TOKEN", "token-b");
    let (rank0, rank1) = (rank0.spawn().unwrap(), rank1.spawn().unwrap());
    let (rank0, rank1) = (
        rank0.wait_with_output().unwrap(),
        rank1.wait_with_output().unwrap(),
    );
    let out1 = text(&rank1);
    assert_eq!(rank1.status.code(), Some(3), "{out1}");
    assert!(out1.contains("WORKER ERR JobToken { rank: 1"), "{out1}");
    assert!(out1.contains("BURN_PARALLEL_JOB_TOKEN"), "{out1}");
    for secret in ["token-a", "token-b"] {
        assert!(!out1.contains(secret), "a token leaked: {out1}");
    }
    let out0 = text(&rank0);
    assert_eq!(rank0.status.code(), Some(3), "{out0}");
    assert!(out0.contains("failed the job-token check"), "{out0}");
    // Rank 0 logged the rejected registrations.
    assert!(
        out0.contains("dropped a connection to the rendezvous store"),
        "{out0}"
    );

    // The same processes with the same token form the job.
    let port = TcpRendezvous::bind("127.0.0.1:0")
        .unwrap()
        .port()
        .to_string();
    let children: Vec<_> = ["0", "1"]
        .into_iter()
        .map(|rank| {
            let mut c = worker(&vars(rank));
            c.env("MASTER_PORT", &port)
                .env("BURN_PARALLEL_JOB_TOKEN", "token-a");
            c.spawn().unwrap()
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
        assert!(
            text(&output).contains("WORKER OK [3.0]"),
            "{}",
            text(&output)
        );
    }
}

// ----------------------------------------------------------------------------------------
// burnrun.

fn burnrun() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_burnrun"));
    command.env_remove("BURN_PARALLEL_JOB_TOKEN");
    command
}

#[test]
fn burnrun_gives_its_ranks_a_token() {
    // A fresh random one per job, the same for every rank of the job.
    let tokens = |out: &Output| -> Vec<String> {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut lines: Vec<String> = stdout
            .lines()
            .map(|l| l.split_once("] ").unwrap().1.to_string())
            .collect();
        lines.sort();
        lines
    };
    let run = || {
        burnrun()
            .args([
                "--nproc-per-node",
                "2",
                "--",
                "sh",
                "-c",
                "echo $BURN_PARALLEL_JOB_TOKEN",
            ])
            .output()
            .unwrap()
    };
    let (a, b) = (run(), run());
    assert!(a.status.success() && b.status.success());
    let (a, b) = (tokens(&a), tokens(&b));
    assert_eq!(a.len(), 2);
    assert_eq!(a[0], a[1], "the ranks of one job share the token");
    assert_eq!(a[0].len(), 64);
    assert!(a[0].chars().all(|c| c.is_ascii_hexdigit()), "{}", a[0]);
    assert_ne!(a[0], b[0], "two jobs got the same token");

    // burnrun's own token is passed on.
    let out = burnrun()
        .env("BURN_PARALLEL_JOB_TOKEN", "shared-by-the-nodes")
        .args(["--", "sh", "-c", "echo $BURN_PARALLEL_JOB_TOKEN"])
        .output()
        .unwrap();
    assert_eq!(tokens(&out), vec!["shared-by-the-nodes".to_string()]);

    // Several nodes need a shared token: without one, burnrun says so.
    let out = burnrun()
        .args(["--nnodes", "2", "--node-rank", "1", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("BURN_PARALLEL_JOB_TOKEN is not set"),
        "{stderr}"
    );
    // An empty token is a mistake, not "no token".
    let out = burnrun()
        .env("BURN_PARALLEL_JOB_TOKEN", "")
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("the job token is empty"), "{stderr}");
}

#[test]
fn burnrun_runs_an_authenticated_job() {
    let me = std::env::current_exe().unwrap();
    let out = burnrun()
        .args(["--nproc-per-node", "3", "--"])
        .arg(me)
        .args([
            "env_worker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--quiet",
        ])
        .env(WORKER, "1")
        .env("BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS", "20")
        .output()
        .unwrap();
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    for rank in 0..3 {
        assert!(
            all.contains(&format!("[rank {rank}] WORKER OK [6.0]")),
            "{all}"
        );
    }
    // A token was set: no warning about an unauthenticated rendezvous.
    assert!(
        !all.contains("is not set, so the rendezvous is not authenticated"),
        "{all}"
    );
}

#[test]
fn burnrun_refuses_an_unusable_grace_period() {
    for value in ["1e30", "inf", "-1", "NaN"] {
        let out = burnrun()
            .args(["--grace-period", value, "--", "true"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {stderr}");
        assert!(stderr.contains("--grace-period"), "{value}: {stderr}");
    }
}
