//! `burnrun`: starts the processes of a distributed job on one node, like `torchrun`, and
//! supervises them.
//!
//! Each process gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and `BURN_PARALLEL_JOB_TOKEN` (the job's secret: burnrun's own when set, else
//! a fresh random one), which `burn_parallel::init_from_env` reads. Every line a process prints is
//! prefixed with `[rank R] `. When a process fails, the others are stopped and `burnrun` exits
//! with the failed process's status.
//!
//! Supervision (the help's EXAMPLES text says more):
//! - heartbeats: every rank gets `BURN_PARALLEL_HEARTBEAT_DIR` (in a temporary directory of the
//!   job, removed at exit), where `burn_parallel::heartbeat::Heartbeat::beat` writes the rank's
//!   last step; a monitor thread reads it twice a second;
//! - stragglers: a rank whose steps compute much slower than the others' is named once;
//! - a no-progress watchdog (`--no-progress-timeout SECS`): when no rank finished a step for
//!   that long, burnrun collects the flight records, prints the diagnosis and stops the job;
//! - restarts (`--max-restarts N`): a failed rank other than rank 0 is started again while the
//!   others keep running (`BURN_PARALLEL_FAULT_TOLERANT=1`); once no restart is left, a failed
//!   rank is lost and the others keep running.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use burn_parallel::comm::tcp::{FAULT_TOLERANT_ENV, JOB_TOKEN_ENV, JobToken};
use burn_parallel::flight;
use burn_parallel::heartbeat::{self, Beat, Stragglers, read_beats};
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

  # Restart up to 3 failed ranks, and stop the job when no step finished for 10 minutes:
  burnrun --nproc-per-node 4 --max-restarts 3 --no-progress-timeout 600 -- ./train --fault-tolerant

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
  BURN_PARALLEL_HEARTBEAT_DIR
                    where the ranks' heartbeats go: DIR/heartbeat, DIR being a temporary
                    directory burnrun makes for the job and removes when it exits
  BURN_PARALLEL_FLIGHT_DIR
                    where the flight recorder writes: burnrun's own when set (kept), else
                    DIR/flight (removed at exit)
  BURN_PARALLEL_FAULT_TOLERANT
                    1 with --max-restarts > 0: the ranks' TCP worlds accept a restarted rank

Output: every line of a process's stdout (stderr) goes to burnrun's stdout (stderr),
prefixed with \"[rank R] \". Standard input is closed.

Failures: when a process exits with a non-zero status or is killed by a signal, burnrun
names it, sends SIGTERM to the other processes (SIGKILL after the grace period), and exits
with the status of the rank that failed first (128 + the signal number for a signal). A rank
that printed that it failed because another rank did (burn-parallel's \"aborted because rank N
failed\") is not blamed when rank N failed too: a crash is reported, not the peers it took down.
SIGINT, SIGTERM and SIGHUP sent to burnrun are forwarded to every process, which then get the
same grace period.

Hangs: every rank writes its last collectives to BURN_PARALLEL_FLIGHT_DIR/flight-rank<R>.json
when one fails and on SIGUSR1. When a rank fails, burnrun first sends SIGUSR1 to the others (up
to 2 s for their records), then stops them, and prints which rank the others waited for. Set
BURN_PARALLEL_FLIGHT_DIR=DIR yourself to keep the records: `burnrun diagnose DIR` prints the
diagnosis again.

Heartbeats: a training loop that calls burn_parallel::heartbeat::Heartbeat::beat after each
optimizer step replaces BURN_PARALLEL_HEARTBEAT_DIR/rank<R>.beat with its step and the seconds
it spent computing; burnrun reads these files twice a second.

Stragglers: when a rank's median compute time over the last 20 of its steps that burnrun saw
is more than 1.3 times the median of the other ranks' (those of this node), burnrun prints
\"burnrun: rank R is a straggler: ...\" (once per rank). Compute times, not step times: in
synchronous training every rank's step lasts as long as the slowest's.

Watchdog: with --no-progress-timeout SECS, when no rank's step advanced for SECS seconds,
burnrun sends SIGUSR1 to every rank, prints \"no rank finished a step for N s (last step S)\"
and the flight records' diagnosis, stops the ranks as after a failure and exits with status
124. It starts counting at the first beat of any rank: a job whose ranks never beat (they do
not call Heartbeat::beat) is never stopped by it, however long it takes to start.

Restarts: with --max-restarts N (N > 0), every rank gets BURN_PARALLEL_FAULT_TOLERANT=1, and
a rank that fails is started again with the same command and environment while the others
keep running (\"rank R failed (...); restarting it (restart k of N)\", then \"rank R rejoined
at step S\" at its first beat). N counts the restarts of all the ranks of this node together.
Rank 0 serves the rendezvous and cannot rejoin: it is never restarted. Once no restart is
left (or rank 0 failed), a failed rank is lost and the others still keep running: burnrun
prints \"lost rank(s) [..] (not restarted)\" and exits with 0 when every rank running at the
first loss ends with status 0, else with the first failure's status. A signal to burnrun
ends the restarts: a rank that fails afterwards is not restarted, and one restarted before
the signal arrived is sent the signal like every other rank.";

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

    /// Stop the job (status 124) when no rank finished a step for SECS seconds, counted from
    /// the first heartbeat; 0: never.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    no_progress_timeout: f64,

    /// Restart failed ranks (not rank 0) up to N times in all, leaving the others running;
    /// 0: a failure stops the job.
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: u32,

    /// The program to run, and its arguments (put them after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]"
    )]
    command: Vec<OsString>,
}

/// burnrun's exit status when the no-progress watchdog stopped the job (`timeout`'s).
const NO_PROGRESS_STATUS: i32 = 124;

/// How often the monitor reads the heartbeat directory.
const BEAT_POLL: Duration = Duration::from_millis(500);

/// A started process of the job. Its `Child` is owned by the thread that waits for it.
struct Rank {
    rank: u32,
    /// Its rank on this node.
    local: u32,
    pid: u32,
    status: Option<ExitStatus>,
    /// When its process was started, in ms since the Unix epoch: an older beat in its file is
    /// a previous process's.
    started_ms: u64,
    /// Restarted, and no beat of the new process seen yet.
    rejoining: bool,
}

/// What the supervisor reacts to, in the order it happened.
enum Event {
    /// burnrun received this signal.
    Signal(i32),
    /// A rank's process ended (or could not be waited for).
    Exited(u32, io::Result<ExitStatus>),
    /// The beats the monitor read from the heartbeat directory (every [`BEAT_POLL`]).
    Beats(Vec<Beat>),
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
    let secs = args.no_progress_timeout;
    let no_progress = if secs == 0.0 {
        None
    } else if let Some(limit) = (secs > 0.0)
        .then(|| Duration::try_from_secs_f64(secs).ok())
        .flatten()
    {
        Some(limit)
    } else {
        eprint_line(&format!(
            "--no-progress-timeout {secs} is not usable: give a positive number of seconds, or \
             0 to turn the watchdog off"
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

    // The job's temporary directory: the heartbeats, and the flight records unless the user
    // names a directory for them (which is then theirs: kept).
    let job_dir = match JobDir::create() {
        Ok(dir) => dir,
        Err(e) => {
            eprint_line(&format!(
                "cannot create a temporary directory in {}: {e}; set TMPDIR to a writable \
                 directory",
                std::env::temp_dir().display()
            ));
            return 1;
        }
    };
    let heartbeat_dir = job_dir.path.join("heartbeat");
    let user_flight_dir = std::env::var_os(flight::DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from);
    let flight_dir = user_flight_dir
        .clone()
        .unwrap_or_else(|| job_dir.path.join("flight"));
    for dir in [
        Some(&heartbeat_dir),
        user_flight_dir.is_none().then_some(&flight_dir),
    ]
    .into_iter()
    .flatten()
    {
        if let Err(e) = std::fs::create_dir(dir) {
            eprint_line(&format!("cannot create {}: {e}", dir.display()));
            return 1;
        }
    }
    let mut env: Vec<(OsString, OsString)> = vec![
        ("WORLD_SIZE".into(), world_size.to_string().into()),
        (
            "LOCAL_WORLD_SIZE".into(),
            args.nproc_per_node.to_string().into(),
        ),
        ("MASTER_ADDR".into(), args.master_addr.clone().into()),
        ("MASTER_PORT".into(), master_port.to_string().into()),
        (JOB_TOKEN_ENV.into(), token.as_str().into()),
        (heartbeat::DIR_ENV.into(), heartbeat_dir.clone().into()),
        (flight::DIR_ENV.into(), flight_dir.clone().into()),
    ];
    if args.max_restarts > 0 {
        env.push((FAULT_TOLERANT_ENV.into(), "1".into()));
    }

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
    let mut launcher = Launcher {
        command: args.command.clone(),
        env,
        node_rank: args.node_rank,
        nproc_per_node: args.nproc_per_node,
        events,
        output_done,
        outputs: 0,
        causes: Causes::default(),
    };
    let mut ranks: Vec<Rank> = Vec::new();
    for local in 0..args.nproc_per_node {
        match launcher.start(local) {
            Ok(rank) => ranks.push(rank),
            Err(e) => {
                let rank = args.node_rank * args.nproc_per_node + local;
                eprint_line(&format!(
                    "cannot start {:?} for rank {rank}: {e}",
                    args.command[0]
                ));
                signal_all(&ranks, SIGKILL);
                let mut started = ranks.len();
                while started > 0 {
                    match receiver.recv() {
                        Ok(Event::Exited(..)) => started -= 1,
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                return match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
            }
        }
    }
    spawn_monitor(heartbeat_dir.clone(), launcher.events.clone());

    let policy = Policy {
        grace,
        flight_dir: &flight_dir,
        flight_dir_kept: user_flight_dir.is_some(),
        no_progress,
        max_restarts: args.max_restarts,
        heartbeat_dir: &heartbeat_dir,
    };
    let outcome = supervise(&mut ranks, &receiver, &mut launcher, &policy);
    signal_handle.close();

    // Let the forwarders print the last lines, but do not wait on a pipe that a leftover
    // grandchild keeps open.
    let deadline = Instant::now() + Duration::from_secs(1);
    for _ in 0..launcher.outputs {
        if output_finished
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    let _ = io::stdout().flush();
    if outcome.wants_diagnosis() {
        print_diagnosis(&policy, false);
    }
    let causes = launcher.causes.lock().unwrap_or_else(|e| e.into_inner());
    let code = outcome.exit_code(&causes);
    drop(job_dir);
    code
}

/// Starts (and restarts) the processes of this node's ranks.
struct Launcher {
    /// The program and its arguments.
    command: Vec<OsString>,
    /// The environment every rank gets (`RANK` and `LOCAL_RANK` are added per rank).
    env: Vec<(OsString, OsString)>,
    node_rank: u32,
    nproc_per_node: u32,
    /// Where each rank's waiter reports its exit.
    events: mpsc::Sender<Event>,
    /// Where each output forwarder reports that its pipe closed.
    output_done: mpsc::Sender<()>,
    /// How many output pipes were forwarded (over restarts too).
    outputs: usize,
    causes: Causes,
}

impl Launcher {
    /// Starts the process of local rank `local`, the threads that forward its output and the
    /// one that waits for it.
    fn start(&mut self, local: u32) -> io::Result<Rank> {
        let rank = self.node_rank * self.nproc_per_node + local;
        let mut command = Command::new(&self.command[0]);
        command
            .args(&self.command[1..])
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: terminal signals reach burnrun only (which forwards
            // them), and stopping a rank also stops the processes it started.
            .process_group(0);
        die_with_parent(&mut command);
        let started_ms = unix_ms();
        let mut child = command.spawn()?;
        let prefix = format!("[rank {rank}] ");
        if let Some(stdout) = child.stdout.take() {
            self.outputs += 1;
            let to = (rank, prefix.clone());
            spawn_forwarder(
                stdout,
                to,
                false,
                self.causes.clone(),
                self.output_done.clone(),
            );
        }
        if let Some(stderr) = child.stderr.take() {
            self.outputs += 1;
            spawn_forwarder(
                stderr,
                (rank, prefix),
                true,
                self.causes.clone(),
                self.output_done.clone(),
            );
        }
        let pid = child.id();
        spawn_waiter(child, rank, self.events.clone());
        Ok(Rank {
            rank,
            local,
            pid,
            status: None,
            started_ms,
            rejoining: false,
        })
    }
}

/// The job's temporary directory (mode 0700), removed with everything in it when dropped.
struct JobDir {
    path: PathBuf,
}

impl JobDir {
    fn create() -> io::Result<JobDir> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut last = None;
        for attempt in 0..64u32 {
            let path = base.join(format!(
                "burnrun-{}-{nanos:08x}-{attempt}",
                std::process::id()
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(JobDir { path }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free name")))
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Reads the heartbeat directory every [`BEAT_POLL`] and sends what it found, until the
/// supervisor is gone.
fn spawn_monitor(dir: PathBuf, events: mpsc::Sender<Event>) {
    thread::Builder::new()
        .name("heartbeats".into())
        .spawn(move || {
            loop {
                thread::sleep(BEAT_POLL);
                if events.send(Event::Beats(read_beats(&dir))).is_err() {
                    break;
                }
            }
        })
        .expect("spawning the heartbeat monitor");
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Prints the diagnosis of the flight records in the job's flight directory, if there are
/// any; `always` also says when there are none.
fn print_diagnosis(policy: &Policy, always: bool) {
    let dir = policy.flight_dir;
    match flight::read_dir(dir) {
        Ok(records) if !records.is_empty() => {
            let place = if policy.flight_dir_kept {
                format!("in {}", dir.display())
            } else {
                format!(
                    "(set {}=DIR to keep them for `burnrun diagnose DIR`)",
                    flight::DIR_ENV
                )
            };
            eprint_line(&format!(
                "flight records of {} rank(s) {place}: {}",
                records.len(),
                flight::diagnose(&records)
            ));
        }
        _ if always => eprint_line(
            "no flight record came back: the ranks write one on SIGUSR1 once their \
             burn-parallel world exists",
        ),
        _ => {}
    }
}

/// Asks the running ranks to write their flight records (SIGUSR1) and gives them up to two
/// seconds to do it, before they are stopped, so that a rank stuck outside a collective is
/// seen where it is. A rank whose process is gone (a program without burn-parallel's world,
/// which SIGUSR1 ends) is not waited for.
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
    let done = |r: &&Rank| {
        let written = std::fs::metadata(dir.join(format!("flight-rank{}.json", r.rank)))
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= since);
        // SAFETY: kill(2) with signal 0 only checks that the process exists; its waiter
        // thread reaps it as soon as it ends.
        let gone = libc::pid_t::try_from(r.pid).is_ok_and(|pid| unsafe { libc::kill(pid, 0) } != 0);
        written || gone
    };
    while Instant::now() < deadline && !running.iter().all(done) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What [`supervise`] is told to do: the flags and the job's directories.
struct Policy<'a> {
    /// How long the ranks get between SIGTERM and SIGKILL.
    grace: Duration,
    /// The flight recorder's directory.
    flight_dir: &'a Path,
    /// Whether it is the user's (kept), not burnrun's temporary one.
    flight_dir_kept: bool,
    /// `--no-progress-timeout` (`None`: off).
    no_progress: Option<Duration>,
    /// `--max-restarts`.
    max_restarts: u32,
    /// Where the ranks' heartbeats go (read once more when a rejoining rank exits).
    heartbeat_dir: &'a Path,
}

/// The progress the beats show.
#[derive(Default)]
struct Progress {
    /// Each rank's last step seen.
    last_step: BTreeMap<usize, usize>,
    /// The highest step seen.
    highest: Option<usize>,
    /// When a rank's step last changed (its first beat included): `None` before any beat.
    since: Option<Instant>,
}

impl Progress {
    fn observe(&mut self, beat: &Beat) {
        if self.last_step.insert(beat.rank, beat.step) != Some(beat.step) {
            self.since = Some(Instant::now());
        }
        self.highest = self.highest.max(Some(beat.step));
    }
}

/// Waits for every rank; stops the others when one fails (or restarts it, or leaves it lost,
/// with `--max-restarts`), when a signal arrives or when no step was finished for
/// `--no-progress-timeout`; reads the beats for stragglers, progress and rejoins.
///
/// Each process is waited for by its own thread ([`spawn_waiter`]), which reports the exit as
/// soon as the kernel does, so failures are listed in the order they were seen. That order
/// alone cannot be trusted to name the crash: the peers it takes down fail milliseconds later,
/// and on a busy machine their exits can be seen first. [`Outcome::exit_code`] settles it with
/// what the ranks printed.
///
/// Events are handled one at a time, so a signal is seen either before a restart (which then
/// is not made: restarts end with the first signal) or after it (and is then forwarded to the
/// restarted process with the others: `spawn` returns once the new process is in its own
/// process group).
fn supervise(
    ranks: &mut [Rank],
    events: &mpsc::Receiver<Event>,
    launcher: &mut Launcher,
    policy: &Policy,
) -> Outcome {
    let mut outcome = Outcome::default();
    // When the other ranks were asked to stop (SIGTERM), and whether SIGKILL was sent.
    let mut stopping: Option<(Instant, bool)> = None;
    let mut restarts = 0;
    // No rank can rejoin once rank 0, which serves the rendezvous, is gone.
    let mut rendezvous_lost = false;
    let mut progress = Progress::default();
    let mut stragglers = Stragglers::default();
    let mut named: BTreeSet<usize> = BTreeSet::new();
    while ranks.iter().any(|r| r.status.is_none()) {
        let wait = match stopping {
            Some((since, false)) => policy.grace.saturating_sub(since.elapsed()),
            // The monitor's beats wake this loop every BEAT_POLL: the watchdog is checked then.
            _ => Duration::from_secs(3600),
        };
        match events.recv_timeout(wait) {
            Ok(Event::Exited(rank, result)) => {
                let status = result.unwrap_or_else(|e| {
                    eprint_line(&format!("cannot wait for rank {rank}: {e}"));
                    ExitStatus::from_raw(1 << 8)
                });
                let Some(index) = ranks.iter().position(|r| r.rank == rank) else {
                    continue;
                };
                ranks[index].status = Some(status);
                // A restarted rank that finished before the monitor's next read still says it
                // rejoined (a short run's last steps can take less than BEAT_POLL).
                let r = &mut ranks[index];
                if r.rejoining
                    && let Some(beat) = read_beats(policy.heartbeat_dir)
                        .into_iter()
                        .find(|b| b.rank == r.rank as usize && b.unix_ms >= r.started_ms)
                {
                    r.rejoining = false;
                    eprint_line(&format!("rank {} rejoined at step {}", r.rank, beat.step));
                }
                let alive = ranks.iter().filter(|r| r.status.is_none()).count();
                let how = describe(status);
                if status.success() {
                    // Nothing to do.
                } else if stopping.is_some() || outcome.received.is_some() {
                    outcome.failures.push((rank, status));
                } else if policy.max_restarts == 0 {
                    outcome.failures.push((rank, status));
                    eprint_line(&format!(
                        "rank {rank} failed ({how}); stopping the {alive} other running rank(s)"
                    ));
                    collect_flight_records(ranks, policy.flight_dir);
                    signal_all(ranks, SIGTERM);
                    stopping = Some((Instant::now(), false));
                } else if rank == 0 || rendezvous_lost || restarts >= policy.max_restarts {
                    let why = if rank == 0 {
                        rendezvous_lost = true;
                        "rank 0 serves the rendezvous and cannot rejoin, so it is not restarted \
                         (and no other rank can be restarted any more)"
                            .to_string()
                    } else if rendezvous_lost {
                        "it cannot rejoin without rank 0, which is lost".to_string()
                    } else {
                        format!("no restart left ({} used)", policy.max_restarts)
                    };
                    eprint_line(&format!(
                        "rank {rank} failed ({how}); {why}; {}",
                        left_running(alive)
                    ));
                    outcome.lose(rank, status, alive);
                } else {
                    restarts += 1;
                    eprint_line(&format!(
                        "rank {rank} failed ({how}); restarting it (restart {restarts} of {})",
                        policy.max_restarts
                    ));
                    // Whatever the failed process left in its group (its workers) goes first.
                    signal_all(&ranks[index..=index], SIGKILL);
                    match launcher.start(ranks[index].local) {
                        Ok(restarted) => {
                            ranks[index] = Rank {
                                rejoining: true,
                                ..restarted
                            };
                            stragglers.forget(rank as usize);
                        }
                        Err(e) => {
                            eprint_line(&format!(
                                "cannot restart rank {rank}: {e}; {}",
                                left_running(alive)
                            ));
                            outcome.lose(rank, status, alive);
                        }
                    }
                }
            }
            Ok(Event::Signal(signal)) => {
                if outcome.received.is_none() {
                    eprint_line(&format!(
                        "received {}; forwarding it to the ranks",
                        signal_name(signal)
                    ));
                }
                outcome.received.get_or_insert(signal);
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
            Ok(Event::Beats(beats)) => {
                for beat in &beats {
                    let Some(r) = ranks.iter_mut().find(|r| r.rank as usize == beat.rank) else {
                        continue;
                    };
                    if beat.unix_ms < r.started_ms {
                        continue; // a previous process's
                    }
                    if r.rejoining {
                        r.rejoining = false;
                        eprint_line(&format!("rank {} rejoined at step {}", r.rank, beat.step));
                    }
                    stragglers.observe(beat);
                    progress.observe(beat);
                }
                for straggler in stragglers.all() {
                    if named.insert(straggler.rank) {
                        eprint_line(&straggler.to_string());
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // Every waiter and the signal thread are gone: nothing more can be learnt.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let (Some(limit), None, None, Some(since)) = (
            policy.no_progress,
            stopping,
            outcome.received,
            progress.since,
        ) && since.elapsed() >= limit
        {
            let idle = match since.elapsed() {
                idle if limit >= Duration::from_secs(1) => idle.as_secs().to_string(),
                idle => format!("{:.1}", idle.as_secs_f64()),
            };
            let last = progress.highest.unwrap_or_default();
            collect_flight_records(ranks, policy.flight_dir);
            let alive = ranks.iter().filter(|r| r.status.is_none()).count();
            eprint_line(&format!(
                "no rank finished a step for {idle} s (last step {last}); stopping the \
                 {alive} running rank(s)"
            ));
            print_diagnosis(policy, true);
            signal_all(ranks, SIGTERM);
            stopping = Some((Instant::now(), false));
            outcome.no_progress = true;
        }
        if let Some((since, false)) = stopping
            && since.elapsed() >= policy.grace
        {
            let left: Vec<u32> = ranks
                .iter()
                .filter(|r| r.status.is_none())
                .map(|r| r.rank)
                .collect();
            if !left.is_empty() {
                eprint_line(&format!(
                    "rank(s) {left:?} still running after {:?}; sending SIGKILL",
                    policy.grace
                ));
            }
            signal_all(ranks, SIGKILL);
            stopping = Some((since, true));
        }
    }
    outcome
}

/// What becomes of the `alive` ranks still running when one is lost.
fn left_running(alive: usize) -> String {
    match alive {
        0 => "no other rank is running".to_string(),
        1 => "the other running rank keeps running".to_string(),
        n => format!("the {n} other running ranks keep running"),
    }
}

/// How the job ended, as [`supervise`] saw it.
#[derive(Default)]
struct Outcome {
    /// The ranks that failed and were not restarted, in the order their exits were seen
    /// (before any was stopped).
    failures: Vec<(u32, ExitStatus)>,
    /// The first signal burnrun received.
    received: Option<i32>,
    /// The ranks that failed and were left out, the others running on (`--max-restarts`).
    lost: Vec<u32>,
    /// How many other ranks were running when the first rank was lost.
    running_at_first_loss: usize,
    /// Whether the no-progress watchdog stopped the job.
    no_progress: bool,
}

impl Outcome {
    /// Records that `rank` failed with `status` and is not restarted, `running` others going on.
    fn lose(&mut self, rank: u32, status: ExitStatus, running: usize) {
        if self.lost.is_empty() {
            self.running_at_first_loss = running;
        }
        self.lost.push(rank);
        self.failures.push((rank, status));
    }

    /// Whether the job succeeds despite a lost rank: one rank was lost, and every rank that
    /// was running then (one at least) ended with status 0.
    fn loss_tolerated(&self) -> bool {
        self.received.is_none()
            && !self.no_progress
            && self.running_at_first_loss > 0
            && self.lost.len() == 1
            && self.failures.len() == 1
    }

    /// Whether the flight records are worth a diagnosis at the end: the job failed (the
    /// watchdog prints its own as it fires).
    fn wants_diagnosis(&self) -> bool {
        !self.failures.is_empty() && !self.no_progress && !self.loss_tolerated()
    }

    /// burnrun's exit status: [`NO_PROGRESS_STATUS`] when the watchdog stopped the job, 0 when
    /// the loss of a rank was survived ([`Outcome::loss_tolerated`]), else that of the rank that
    /// failed first, else 128 + the signal received, else 0. A rank that said it failed
    /// because another failed rank did (its `PeerFailed` error, in `causes`) is passed over for
    /// that rank, so a crash is blamed rather than the peers it took down, even when their
    /// exits were seen first.
    fn exit_code(&self, causes: &BTreeMap<u32, u32>) -> i32 {
        if !self.lost.is_empty() {
            let survived = if self.loss_tolerated() {
                "; the other ranks ended with status 0"
            } else {
                ""
            };
            eprint_line(&format!(
                "lost rank(s) {:?} (not restarted){survived}",
                self.lost
            ));
        }
        if self.no_progress {
            return NO_PROGRESS_STATUS;
        }
        if self.loss_tolerated() {
            return 0;
        }
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
            ..Outcome::default()
        };
        let causes = BTreeMap::from([(0, 1), (2, 0)]);
        assert_eq!(outcome.exit_code(&causes), 3);
        // Without what the ranks printed, the order seen decides.
        assert_eq!(outcome.exit_code(&BTreeMap::new()), 1);
        // A blamed rank that did not fail (it was stopped by burnrun) does not count.
        let outcome = Outcome {
            failures: vec![(0, status(4))],
            ..Outcome::default()
        };
        assert_eq!(outcome.exit_code(&BTreeMap::from([(0, 1)])), 4);
    }
}
