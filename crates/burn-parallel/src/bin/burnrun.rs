//! `burnrun`: starts the processes of a distributed job on one node, like `torchrun`.
//!
//! Each process gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and `BURN_PARALLEL_JOB_TOKEN` (the job's secret: burnrun's own when set, else
//! a fresh random one), which `burn_parallel::init_from_env` reads. Every line a process prints is
//! prefixed with `[rank R] `. When a process fails, the others are stopped and `burnrun` exits
//! with the failed process's status.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use burn_parallel::comm::tcp::{JOB_TOKEN_ENV, JobToken};
use clap::Parser;
use signal_hook::consts::{SIGHUP, SIGINT, SIGKILL, SIGTERM};
use signal_hook::iterator::Signals;

const EXAMPLES: &str = "\
Examples:
  # 4 processes on this machine (a free port is picked for the rendezvous):
  burnrun --nproc-per-node 4 -- ./target/release/train --epochs 3

  # 2 machines with 8 processes each; run on both, with --node-rank 0 and 1:
  burnrun --nproc-per-node 8 --nnodes 2 --node-rank 0 \\
          --master-addr 10.0.0.1 --master-port 29500 -- ./train

Environment of each process:
  RANK              global rank: node_rank * nproc_per_node + LOCAL_RANK
  WORLD_SIZE        nnodes * nproc_per_node
  LOCAL_RANK        rank on this node (use it to pick a device)
  LOCAL_WORLD_SIZE  nproc_per_node
  MASTER_ADDR       where rank 0 serves the rendezvous
  MASTER_PORT       its port
  BURN_PARALLEL_JOB_TOKEN
                    the job's secret, which authenticates the rendezvous and every connection
                    between ranks: burnrun's own BURN_PARALLEL_JOB_TOKEN when set, else a fresh
                    random one (with --nnodes > 1, set the same one on every node)

Output: every line of a process's stdout (stderr) goes to burnrun's stdout (stderr),
prefixed with \"[rank R] \". Standard input is closed.

Failures: when a process exits with a non-zero status or is killed by a signal, burnrun
names it, sends SIGTERM to the other processes (SIGKILL after the grace period), and exits
with the status of the rank that failed first (128 + the signal number for a signal). A rank
that printed that it failed because another rank did (burn-parallel's \"aborted because rank N
failed\") is not blamed when rank N failed too: a crash is reported, not the peers it took down.
SIGINT, SIGTERM and SIGHUP sent to burnrun are forwarded to every process, which then get the
same grace period.

Hangs: with BURN_PARALLEL_FLIGHT_DIR=DIR set, every rank writes its last collectives to
DIR/flight-rank<R>.json when one fails and on SIGUSR1. When a rank fails, burnrun first sends
SIGUSR1 to the others (up to 2 s for their records), then stops them, and prints which rank
the others waited for; `burnrun diagnose DIR` prints it again.";

/// Launch the processes of a distributed burn-parallel job on this node.
#[derive(Parser, Debug)]
#[command(name = "burnrun", version, after_help = EXAMPLES)]
struct Args {
    /// Number of processes to start on this node (typically one per device).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    nproc_per_node: u32,

    /// Number of nodes (machines) in the job; run burnrun once on each.
    #[arg(long, value_name = "M", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    nnodes: u32,

    /// Index of this node, in 0..nnodes; node 0 runs rank 0.
    #[arg(long, value_name = "R", default_value_t = 0)]
    node_rank: u32,

    /// Address of the node that runs rank 0, reachable from every node.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    master_addr: String,

    /// Port of rank 0's rendezvous [default: a free port when --nnodes is 1, else 29500].
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,

    /// Seconds the other processes get to exit after SIGTERM before SIGKILL.
    #[arg(long, value_name = "SECS", default_value_t = 3.0)]
    grace_period: f64,

    /// The program to run, and its arguments (put them after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]"
    )]
    command: Vec<OsString>,
}

/// A started process of the job. Its `Child` is owned by the thread that waits for it.
struct Rank {
    rank: u32,
    pid: u32,
    status: Option<ExitStatus>,
}

/// What the supervisor reacts to, in the order it happened.
enum Event {
    /// burnrun received this signal.
    Signal(i32),
    /// A rank's process ended (or could not be waited for).
    Exited(u32, io::Result<ExitStatus>),
}

fn main() {
    let mut argv = std::env::args_os().skip(1);
    if argv.next().is_some_and(|a| a == "diagnose") {
        std::process::exit(diagnose(argv.collect()));
    }
    let args = Args::parse();
    std::process::exit(run(args));
}

/// `burnrun diagnose DIR`: reads the flight recorder's files (`flight-rank<R>.json`, written
/// where `BURN_PARALLEL_FLIGHT_DIR` pointed) and prints which rank the others wait for.
fn diagnose(args: Vec<OsString>) -> i32 {
    let [dir] = &args[..] else {
        eprint_line("usage: burnrun diagnose DIR (the job's BURN_PARALLEL_FLIGHT_DIR)");
        return 2;
    };
    match burn_parallel::flight::read_dir(std::path::Path::new(dir)) {
        Ok(records) if records.is_empty() => {
            eprint_line(&format!("no flight-rank<R>.json in {}", dir.display()));
            1
        }
        Ok(records) => {
            let ranks: Vec<String> = records.iter().map(|r| r.rank.to_string()).collect();
            println!("records of ranks {}", ranks.join(", "));
            println!("{}", burn_parallel::flight::diagnose(&records));
            0
        }
        Err(e) => {
            eprint_line(&e.to_string());
            1
        }
    }
}

fn eprint_line(message: &str) {
    let _ = writeln!(io::stderr().lock(), "burnrun: {message}");
}

fn run(args: Args) -> i32 {
    if args.node_rank >= args.nnodes {
        eprint_line(&format!(
            "--node-rank {} is out of range for --nnodes {}; node ranks are 0..{}",
            args.node_rank, args.nnodes, args.nnodes
        ));
        return 2;
    }
    let Some(grace) = (args.grace_period >= 0.0)
        .then(|| Duration::try_from_secs_f64(args.grace_period).ok())
        .flatten()
        .filter(|g| *g <= burn_parallel::comm::tcp::MAX_TIMEOUT)
    else {
        eprint_line(&format!(
            "--grace-period {} is not usable: give a non-negative number of seconds, at most {}",
            args.grace_period,
            burn_parallel::comm::tcp::MAX_TIMEOUT.as_secs()
        ));
        return 2;
    };
    // The job's secret: ours when set (so that the nodes of a job share it), else a new one.
    let token = match JobToken::from_env() {
        Ok(Some(token)) => token,
        Ok(None) if args.nnodes > 1 => {
            eprint_line(&format!(
                "{JOB_TOKEN_ENV} is not set: with --nnodes > 1, set it to the same secret on \
                 every node (for example `export {JOB_TOKEN_ENV}=$(openssl rand -hex 32)` on one \
                 and copy it to the others), so that the ranks can authenticate each other"
            ));
            return 2;
        }
        Ok(None) => match JobToken::generate() {
            Ok(token) => token,
            Err(e) => {
                eprint_line(&format!("cannot generate a job token: {e}"));
                return 1;
            }
        },
        Err(burn_parallel::CollectiveError::JobToken { reason, .. }) => {
            eprint_line(&reason);
            return 2;
        }
        Err(e) => {
            eprint_line(&e.to_string());
            return 2;
        }
    };
    let Some(world_size) = args.nnodes.checked_mul(args.nproc_per_node) else {
        eprint_line("--nnodes times --nproc-per-node is too large");
        return 2;
    };
    let master_port = match (args.master_port, args.nnodes) {
        (Some(port), _) => port,
        (None, 1) => match free_port(&args.master_addr) {
            Ok(port) => port,
            Err(e) => {
                eprint_line(&format!(
                    "cannot find a free port on {}: {e}; pass --master-port",
                    args.master_addr
                ));
                return 1;
            }
        },
        (None, _) => 29500,
    };

    // Handle signals before any process exists, so none is missed.
    let (events, receiver) = mpsc::channel::<Event>();
    let mut signals = match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(signals) => signals,
        Err(e) => {
            eprint_line(&format!("cannot install signal handlers: {e}"));
            return 1;
        }
    };
    let signal_handle = signals.handle();
    let signal_events = events.clone();
    thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal_events.send(Event::Signal(signal)).is_err() {
                    break;
                }
            }
        })
        .expect("spawning the signal thread");

    let (output_done, output_finished) = mpsc::channel::<()>();
    let causes = Causes::default();
    let mut ranks: Vec<Rank> = Vec::new();
    let mut outputs = 0;
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut command = Command::new(&args.command[0]);
        command
            .args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .env(JOB_TOKEN_ENV, token.as_str())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: terminal signals reach burnrun only (which forwards
            // them), and stopping a rank also stops the processes it started.
            .process_group(0);
        die_with_parent(&mut command);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                eprint_line(&format!(
                    "cannot start {:?} for rank {rank}: {e}",
                    args.command[0]
                ));
                signal_all(&ranks, SIGKILL);
                let mut started = ranks.len();
                while started > 0 {
                    match receiver.recv() {
                        Ok(Event::Exited(..)) => started -= 1,
                        Ok(Event::Signal(_)) => {}
                        Err(_) => break,
                    }
                }
                return match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(stdout) = child.stdout.take() {
            outputs += 1;
            let to = (rank, prefix.clone());
            spawn_forwarder(stdout, to, false, causes.clone(), output_done.clone());
        }
        if let Some(stderr) = child.stderr.take() {
            outputs += 1;
            spawn_forwarder(
                stderr,
                (rank, prefix),
                true,
                causes.clone(),
                output_done.clone(),
            );
        }
        ranks.push(Rank {
            rank,
            pid: child.id(),
            status: None,
        });
        spawn_waiter(child, rank, events.clone());
    }
    drop(output_done);
    drop(events);

    let flight_dir = std::env::var_os(burn_parallel::flight::DIR_ENV).map(PathBuf::from);
    let outcome = supervise(&mut ranks, &receiver, grace, flight_dir.as_deref());
    signal_handle.close();

    // Let the forwarders print the last lines, but do not wait on a pipe that a leftover
    // grandchild keeps open.
    let deadline = Instant::now() + Duration::from_secs(1);
    for _ in 0..outputs {
        if output_finished
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    let _ = io::stdout().flush();
    if let (false, Some(dir)) = (outcome.failures.is_empty(), &flight_dir)
        && let Ok(records) = burn_parallel::flight::read_dir(dir)
        && !records.is_empty()
    {
        eprint_line(&format!(
            "flight records of {} rank(s) in {}: {}",
            records.len(),
            dir.display(),
            burn_parallel::flight::diagnose(&records)
        ));
    }
    let causes = causes.lock().unwrap_or_else(|e| e.into_inner());
    outcome.exit_code(&causes)
}

/// With the flight recorder's directory set: asks the running ranks to write their records
/// (SIGUSR1) and gives them up to two seconds to do it, before they are stopped, so that a rank
/// stuck outside a collective is seen where it is.
fn collect_flight_records(ranks: &[Rank], dir: &Path) {
    let since = std::time::SystemTime::now();
    let running: Vec<&Rank> = ranks.iter().filter(|r| r.status.is_none()).collect();
    for r in &running {
        if let Ok(pid) = libc::pid_t::try_from(r.pid) {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is this child's.
            unsafe {
                libc::kill(pid, libc::SIGUSR1);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    let written = |r: &&Rank| {
        std::fs::metadata(dir.join(format!("flight-rank{}.json", r.rank)))
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= since)
    };
    while Instant::now() < deadline && !running.iter().all(written) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for every rank; stops the others when one fails or a signal arrives.
///
/// Each process is waited for by its own thread ([`spawn_waiter`]), which reports the exit as
/// soon as the kernel does, so failures are listed in the order they were seen. That order
/// alone cannot be trusted to name the crash: the peers it takes down fail milliseconds later,
/// and on a busy machine their exits can be seen first. [`Outcome::exit_code`] settles it with
/// what the ranks printed.
fn supervise(
    ranks: &mut [Rank],
    events: &mpsc::Receiver<Event>,
    grace: Duration,
    flight_dir: Option<&Path>,
) -> Outcome {
    let mut failures: Vec<(u32, ExitStatus)> = Vec::new();
    let mut received: Option<i32> = None;
    // When the other ranks were asked to stop (SIGTERM), and whether SIGKILL was sent.
    let mut stopping: Option<(Instant, bool)> = None;
    while ranks.iter().any(|r| r.status.is_none()) {
        let wait = match stopping {
            Some((since, false)) => grace.saturating_sub(since.elapsed()),
            _ => Duration::from_secs(3600),
        };
        match events.recv_timeout(wait) {
            Ok(Event::Exited(rank, result)) => {
                let status = result.unwrap_or_else(|e| {
                    eprint_line(&format!("cannot wait for rank {rank}: {e}"));
                    ExitStatus::from_raw(1 << 8)
                });
                if let Some(r) = ranks.iter_mut().find(|r| r.rank == rank) {
                    r.status = Some(status);
                }
                if !status.success() {
                    failures.push((rank, status));
                    if stopping.is_none() {
                        let alive = ranks.iter().filter(|r| r.status.is_none()).count();
                        eprint_line(&format!(
                            "rank {rank} failed ({}); stopping the {alive} other running rank(s)",
                            describe(status)
                        ));
                        if let Some(dir) = flight_dir {
                            collect_flight_records(ranks, dir);
                        }
                        signal_all(ranks, SIGTERM);
                        stopping = Some((Instant::now(), false));
                    }
                }
            }
            Ok(Event::Signal(signal)) => {
                if received.is_none() {
                    eprint_line(&format!(
                        "received {}; forwarding it to the ranks",
                        signal_name(signal)
                    ));
                }
                received.get_or_insert(signal);
                match stopping {
                    // A second signal: no more grace.
                    Some((_, false)) => {
                        signal_all(ranks, SIGKILL);
                        stopping = Some((Instant::now(), true));
                    }
                    Some((_, true)) => {}
                    None => {
                        signal_all(ranks, signal);
                        stopping = Some((Instant::now(), false));
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // Every waiter and the signal thread are gone: nothing more can be learnt.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let Some((since, false)) = stopping
            && since.elapsed() >= grace
        {
            let left: Vec<u32> = ranks
                .iter()
                .filter(|r| r.status.is_none())
                .map(|r| r.rank)
                .collect();
            if !left.is_empty() {
                eprint_line(&format!(
                    "rank(s) {left:?} still running after {grace:?}; sending SIGKILL"
                ));
            }
            signal_all(ranks, SIGKILL);
            stopping = Some((since, true));
        }
    }
    Outcome { failures, received }
}

/// How the job ended, as [`supervise`] saw it.
struct Outcome {
    /// The ranks that failed, in the order their exits were seen (before any was stopped).
    failures: Vec<(u32, ExitStatus)>,
    /// The first signal burnrun received.
    received: Option<i32>,
}

impl Outcome {
    /// burnrun's exit status: that of the rank that failed first, else 128 + the signal
    /// received, else 0. A rank that said it failed because another failed rank did (its
    /// `PeerFailed` error, in `causes`) is passed over for that rank, so a crash is blamed
    /// rather than the peers it took down, even when their exits were seen first.
    fn exit_code(&self, causes: &BTreeMap<u32, u32>) -> i32 {
        let failed = |rank: u32| self.failures.iter().any(|&(r, _)| r == rank);
        let root = self
            .failures
            .iter()
            .find(|(rank, _)| !causes.get(rank).is_some_and(|&peer| failed(peer)))
            .or(self.failures.first());
        match (root, self.received) {
            (Some(&(rank, status)), received) => {
                let code = exit_code(status);
                if received.is_none() {
                    eprint_line(&format!(
                        "rank {rank} failed first ({}); exiting with status {code}",
                        describe(status)
                    ));
                }
                code
            }
            (None, Some(signal)) => 128 + signal,
            (None, None) => 0,
        }
    }
}

/// Waits for `child` on a thread of its own and reports its exit as soon as it happens.
fn spawn_waiter(mut child: Child, rank: u32, events: mpsc::Sender<Event>) {
    thread::Builder::new()
        .name(format!("wait-rank-{rank}"))
        .spawn(move || {
            let status = child.wait();
            let _ = events.send(Event::Exited(rank, status));
        })
        .expect("spawning a waiter thread");
}

/// Sends `signal` to the process group of every rank (including the processes it started).
/// A group whose leader was reaped keeps its id while members remain, so it cannot name an
/// unrelated process; an empty group is simply not found.
fn signal_all(ranks: &[Rank], signal: i32) {
    for r in ranks {
        let Ok(pid) = libc::pid_t::try_from(r.pid) else {
            continue;
        };
        // SAFETY: kill(2) has no memory-safety preconditions; a negative pid addresses the
        // process group that `process_group(0)` gave this child.
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}

/// Makes the child receive SIGKILL when burnrun dies without cleaning up (Linux).
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    // SAFETY: getpid(2) has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
    // functions (prctl, getppid), allocating nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() != parent {
                return Err(io::Error::other("burnrun exited while starting the rank"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

/// Which rank each rank said it failed because of, from the
/// [`CollectiveError::PeerFailed`](burn_parallel::CollectiveError::PeerFailed) lines it printed.
type Causes = Arc<Mutex<BTreeMap<u32, u32>>>;

/// The rank that `line` says its operation failed because of (the text of
/// [`CollectiveError::PeerFailed`](burn_parallel::CollectiveError::PeerFailed):
/// `... aborted because rank N failed: ...`).
fn blamed_peer(line: &[u8]) -> Option<u32> {
    const MARK: &[u8] = b"aborted because rank ";
    let at = line.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    let digits = line[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    let rest = &line[at + digits..];
    if digits == 0 || !rest.starts_with(b" failed") {
        return None;
    }
    std::str::from_utf8(&line[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// Copies the lines of `from` to burnrun's stdout or stderr, each prefixed. The first peer a
/// line of rank `rank` blames for its failure goes into `causes`.
fn spawn_forwarder(
    from: impl Read + Send + 'static,
    (rank, prefix): (u32, String),
    to_stderr: bool,
    causes: Causes,
    done: mpsc::Sender<()>,
) {
    thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::with_capacity(256);
        let mut out = Vec::with_capacity(256);
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            if let Some(peer) = blamed_peer(&line).filter(|&p| p != rank) {
                let mut causes = causes.lock().unwrap_or_else(|e| e.into_inner());
                causes.entry(rank).or_insert(peer);
            }
            out.clear();
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            // Write errors (a closed pipe) are ignored: keep draining so the rank never blocks.
            if to_stderr {
                let _ = io::stderr().lock().write_all(&out);
            } else {
                let mut stdout = io::stdout().lock();
                let _ = stdout.write_all(&out).and_then(|()| stdout.flush());
            }
        }
        let _ = done.send(());
    });
}

/// A port that is free now on `addr` (the usual race applies: another process may take it
/// before rank 0 binds it).
fn free_port(addr: &str) -> io::Result<u16> {
    TcpListener::bind((addr, 0))
        .or_else(|_| TcpListener::bind(("127.0.0.1", 0)))?
        .local_addr()
        .map(|a| a.port())
}

fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by {}", signal_name(signal)),
        (None, None) => format!("{status}"),
    }
}

fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        other => return format!("signal {other}"),
    };
    format!("{name} (signal {signal})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_blamed_peer_is_read_from_a_peer_failed_error() {
        let line =
            b"error: rank 2: all_reduce(#3 sum f32[1]) aborted because rank 10 failed: lost\n";
        assert_eq!(blamed_peer(line), Some(10));
        assert_eq!(blamed_peer(b"aborted because rank failed"), None);
        assert_eq!(blamed_peer(b"aborted because rank 3 was slow"), None);
        assert_eq!(blamed_peer(b"rank 3 failed"), None);
    }

    #[test]
    fn a_crash_is_blamed_rather_than_the_failures_it_caused() {
        let status = |code: i32| ExitStatus::from_raw(code << 8);
        // Rank 0 (status 1, blaming rank 1) was seen before rank 1 (status 3).
        let outcome = Outcome {
            failures: vec![(0, status(1)), (2, status(1)), (1, status(3))],
            received: None,
        };
        let causes = BTreeMap::from([(0, 1), (2, 0)]);
        assert_eq!(outcome.exit_code(&causes), 3);
        // Without what the ranks printed, the order seen decides.
        assert_eq!(outcome.exit_code(&BTreeMap::new()), 1);
        // A blamed rank that did not fail (it was stopped by burnrun) does not count.
        let outcome = Outcome {
            failures: vec![(0, status(4))],
            received: None,
        };
        assert_eq!(outcome.exit_code(&BTreeMap::from([(0, 1)])), 4);
    }
}
