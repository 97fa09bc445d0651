//! Rejoining a running `tcp` world ([`TcpConfig::rejoin`]): every rank is a thread of this
//! test process talking over loopback TCP. A rank that crashes (its connections cut without a
//! goodbye) is replaced by a new `TcpTransport::connect` for the same rank, and messages flow
//! again between it and every other rank, while the ranks that never failed keep talking
//! (they isolate each other's failures, as DiLoCo does).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel::comm::tcp::{JobToken, TcpTransport};
use burn_parallel::{CollectiveError, ProcessGroup, TcpConfig, TcpRendezvous, Transport};

/// Bound on every rendezvous and wait: the tests must end well before it.
const TIMEOUT: Duration = Duration::from_secs(5);

fn config(rank: usize, world_size: usize, port: u16) -> TcpConfig {
    TcpConfig::new(rank, world_size, "127.0.0.1", port)
        .with_timeout(TIMEOUT)
        .with_rejoin(true)
        .with_job_token(JobToken::new("the rejoin tests' shared secret, long enough").unwrap())
}

/// A rank of the test world: its transport and a group over it.
struct Rank {
    transport: Arc<TcpTransport>,
    group: ProcessGroup,
}

impl Rank {
    fn new(transport: Arc<TcpTransport>) -> Self {
        // Every rank may lose any other one without ending its other waits.
        let others: Vec<usize> = (0..transport.world_size())
            .filter(|&p| p != transport.rank())
            .collect();
        transport.mailbox().isolate_failures_of(&others);
        let group = ProcessGroup::world(transport.clone()).with_timeout(TIMEOUT);
        Self { transport, group }
    }

    /// Crashes this rank: cuts its connections without a goodbye and drops it.
    fn crash(self) {
        self.transport.disconnect_abruptly();
    }
}

/// Forms a world of `world_size` ranks with rejoining on; returns the store's port.
fn form(world_size: usize) -> (u16, Vec<Option<Rank>>) {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let mut rendezvous = Some(rendezvous);
    let ranks = thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let rendezvous = if rank == 0 { rendezvous.take() } else { None };
                scope.spawn(move || {
                    TcpTransport::connect(&config(rank, world_size, port), rendezvous).unwrap()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| Some(Rank::new(h.join().unwrap())))
            .collect()
    });
    (port, ranks)
}

/// Drops every rank at once, as processes exiting together would (each drop waits for the
/// peers to close their side).
fn finish(ranks: Vec<Option<Rank>>) {
    thread::scope(|scope| {
        for rank in ranks.into_iter().flatten() {
            scope.spawn(move || drop(rank));
        }
    });
}

fn rank(ranks: &[Option<Rank>], r: usize) -> &Rank {
    ranks[r].as_ref().expect("a live rank")
}

/// `a` and `b` send each other a message on `tag` and check what they receive.
fn ping(ranks: &[Option<Rank>], a: usize, b: usize, tag: u64) {
    let message = |from: usize, to: usize| TensorData::new(vec![from as f32, to as f32], [2]);
    rank(ranks, a)
        .group
        .send_data(message(a, b), b, tag)
        .unwrap_or_else(|e| panic!("rank {a} sending to {b}: {e}"));
    rank(ranks, b)
        .group
        .send_data(message(b, a), a, tag)
        .unwrap_or_else(|e| panic!("rank {b} sending to {a}: {e}"));
    for (me, from) in [(a, b), (b, a)] {
        let got = rank(ranks, me)
            .group
            .recv_data(from, tag)
            .unwrap_or_else(|e| panic!("rank {me} receiving from {from}: {e}"));
        assert_eq!(
            got.as_slice::<f32>().unwrap().to_vec(),
            vec![from as f32, me as f32]
        );
    }
}

/// Every pair of `ranks` pings on `tag`.
fn ping_all(ranks: &[Option<Rank>], tag: u64) {
    let live: Vec<usize> = (0..ranks.len()).filter(|&r| ranks[r].is_some()).collect();
    for (i, &a) in live.iter().enumerate() {
        for &b in &live[i + 1..] {
            ping(ranks, a, b, tag);
        }
    }
}

/// `me` sees `dead` failed on a receive, promptly.
fn sees_failed(ranks: &[Option<Rank>], me: usize, dead: usize, tag: u64) {
    let start = Instant::now();
    match rank(ranks, me).group.recv_data(dead, tag) {
        Err(CollectiveError::PeerFailed { peer, .. }) => assert_eq!(peer, dead),
        other => panic!("rank {me} receiving from the crashed rank {dead}: {other:?}"),
    }
    assert!(
        start.elapsed() < TIMEOUT,
        "the failure was not seen promptly"
    );
}

/// A new process for `r` joins the running world.
fn restart(world_size: usize, port: u16, r: usize) -> Rank {
    let transport = TcpTransport::connect(&config(r, world_size, port), None)
        .unwrap_or_else(|e| panic!("rank {r} rejoining: {e}"));
    assert!(transport.rejoined(), "rank {r} joined a running world");
    let rank = Rank::new(transport);
    assert!(rank.group.rejoined());
    rank
}

#[test]
fn a_crashed_rank_rejoins_and_talks_to_everyone_again() {
    let start = Instant::now();
    let (port, mut ranks) = form(3);
    for r in &ranks {
        assert!(!r.as_ref().unwrap().transport.rejoined());
    }
    ping_all(&ranks, 1);
    ranks[2].take().unwrap().crash();
    sees_failed(&ranks, 0, 2, 2);
    sees_failed(&ranks, 1, 2, 2);
    // The survivors go on without it.
    ping(&ranks, 0, 1, 3);

    let joined = Instant::now();
    ranks[2] = Some(restart(3, port, 2));
    eprintln!("rank 2 rejoined in {:?}", joined.elapsed());
    ping(&ranks, 0, 2, 4);
    ping(&ranks, 1, 2, 4);
    ping(&ranks, 0, 1, 4);
    // And once more: a second crash of the same rank, a second restart.
    ranks[2].take().unwrap().crash();
    sees_failed(&ranks, 0, 2, 5);
    sees_failed(&ranks, 1, 2, 5);
    ranks[2] = Some(restart(3, port, 2));
    ping_all(&ranks, 6);
    finish(ranks);
    eprintln!("rejoin test took {:?}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn two_ranks_that_crash_together_rejoin_together() {
    let start = Instant::now();
    let (port, mut ranks) = form(4);
    ping_all(&ranks, 1);
    ranks[2].take().unwrap().crash();
    ranks[3].take().unwrap().crash();
    for me in [0, 1] {
        sees_failed(&ranks, me, 2, 2);
        sees_failed(&ranks, me, 3, 2);
    }
    ping(&ranks, 0, 1, 3);

    let (two, three) = thread::scope(|scope| {
        let two = scope.spawn(|| restart(4, port, 2));
        let three = scope.spawn(|| restart(4, port, 3));
        (two.join().unwrap(), three.join().unwrap())
    });
    ranks[2] = Some(two);
    ranks[3] = Some(three);
    ping_all(&ranks, 4);
    finish(ranks);
    eprintln!("concurrent rejoin test took {:?}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_healthy_rank_or_rank_0_cannot_be_claimed() {
    let start = Instant::now();
    let (port, ranks) = form(3);
    ping_all(&ranks, 1);
    for claimed in [1, 0] {
        // A process for rank 0 tries to serve the store, which the running rank 0 holds.
        let attempt = Instant::now();
        let err = TcpTransport::connect(&config(claimed, 3, port), None)
            .expect_err("a healthy rank cannot be replaced");
        assert!(attempt.elapsed() < TIMEOUT, "refused promptly: {err}");
        let message = err.to_string();
        assert!(matches!(err, CollectiveError::Rendezvous(_)), "{message}");
        if claimed == 1 {
            assert!(
                message.contains("rank 1 is still running in this job"),
                "{message}"
            );
        } else {
            assert!(message.contains("rank 0 cannot be replaced"), "{message}");
        }
    }
    // A registration without rejoining is refused too, naming the setting.
    let err = TcpTransport::connect(&config(2, 3, port).with_rejoin(false), None)
        .expect_err("a process without rejoining cannot join a running world");
    assert!(
        err.to_string().contains("BURN_PARALLEL_FAULT_TOLERANT"),
        "{err}"
    );
    // The job did not notice.
    ping_all(&ranks, 2);
    finish(ranks);
    eprintln!("refusal test took {:?}", start.elapsed());
}

#[test]
fn ranks_that_disagree_on_rejoining_fail_the_rendezvous() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let start = Instant::now();
    let (zero, one) = thread::scope(|scope| {
        let zero =
            scope.spawn(move || TcpTransport::connect(&config(0, 2, port), Some(rendezvous)));
        let one = scope
            .spawn(move || TcpTransport::connect(&config(1, 2, port).with_rejoin(false), None));
        (zero.join().unwrap(), one.join().unwrap())
    });
    for outcome in [zero, one] {
        let err = outcome.expect_err("the rejoin flags differ");
        assert!(
            err.to_string().contains("BURN_PARALLEL_FAULT_TOLERANT"),
            "{err}"
        );
    }
    eprintln!("disagreement test took {:?}", start.elapsed());
    assert!(start.elapsed() < TIMEOUT);
}
