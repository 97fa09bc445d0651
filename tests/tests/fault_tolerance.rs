//! Fault-tolerant data parallelism (`--fault-tolerant`, `burn_parallel::fault`) with real
//! processes over TCP: `gpt` ranks killed with SIGKILL mid-run, the survivors finishing every
//! step without a restart, a restarted rank (by hand, or by `burnrun --max-restarts`) rejoining
//! from a live replica. The replicas compare their parameters' digests at every step
//! (`BURN_PARALLEL_VERIFY_REPLICAS_EVERY=1`): any difference would end the run with an error
//! naming them, so a run that finishes had identical replicas at every step.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use examples::train::TrainConfig;
use tests::{gpt_rank, tiny_gpt_run, workspace_binary};

const STEPS: usize = 40;

/// A scratch directory with the run's config.
fn scratch(name: &str, config: &TrainConfig) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("burn-parallel-ft-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("run.toml");
    std::fs::write(&config_path, toml::to_string(config).unwrap()).unwrap();
    (dir, config_path)
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// The `gpt` command of one rank of a 4-rank fault-tolerant job.
fn gpt(rank: usize, port: u16, config: &Path, dir: &Path, flags: &[&str]) -> Command {
    let mut c = gpt_rank(rank, 4, port, "fault-tolerance-test");
    c.args(["--backend", "tcp", "--fault-tolerant", "--log-every", "1"])
        .args(flags)
        .arg("--config")
        .arg(config)
        .arg("--losses-out")
        .arg(dir.join(format!("losses-{rank}.json")))
        .env("BURN_PARALLEL_FAULT_TOLERANT", "1")
        .env("BURN_PARALLEL_VERIFY_REPLICAS_EVERY", "1");
    c
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(e) = child.stderr.as_mut() {
        e.read_to_string(&mut s).unwrap();
    }
    s
}

/// What one job did: rank 0's stdout, every process's status and stderr (a restarted rank's
/// second process last), and rank 0's losses.
struct Job {
    out: String,
    ok: Vec<bool>,
    errs: Vec<String>,
    losses: Vec<f32>,
}

/// Runs 4 ranks for `steps` steps; `at(step, children)` runs after rank 0 logs each step (to
/// kill or restart).
fn job(
    name: &str,
    steps: usize,
    flags: &[&str],
    mut at: impl FnMut(usize, &mut Vec<Child>, &dyn Fn(usize) -> Command),
) -> Job {
    let config = TrainConfig {
        batch_size: 8, // 2 rows per data-parallel rank
        ..tiny_gpt_run(steps)
    };
    let (dir, config_path) = scratch(name, &config);
    let port = free_port();
    let command = |rank: usize| gpt(rank, port, &config_path, &dir, flags);
    let mut children: Vec<Child> = (0..4).map(|r| command(r).spawn().unwrap()).collect();
    let stdout = children[0].stdout.take().unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(step) = line
            .strip_prefix("step")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|s| s.parse::<usize>().ok())
        {
            at(step, &mut children, &command);
        }
        lines.push(line);
    }
    let ok: Vec<bool> = children
        .iter_mut()
        .map(|c| c.wait().unwrap().success())
        .collect();
    let errs: Vec<String> = children.iter_mut().map(stderr_of).collect();
    let losses = std::fs::read_to_string(dir.join("losses-0.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    std::fs::remove_dir_all(&dir).ok();
    Job {
        out: lines.join("\n"),
        ok,
        errs,
        losses,
    }
}

fn explain(job: &Job) -> String {
    format!("{}\n{}", job.out, job.errs.join("\n----\n"))
}

/// The uninterrupted run's losses (computed once per test binary).
fn uninterrupted(flags: &[&str]) -> Vec<f32> {
    let run = job("whole", STEPS, flags, |_, _, _| {});
    assert!(run.ok.iter().all(|&ok| ok), "{}", explain(&run));
    assert_eq!(run.losses.len(), STEPS, "{}", explain(&run));
    run.losses
}

/// The largest difference between the two loss curves from `from` on.
fn max_gap(a: &[f32], b: &[f32], from: usize) -> f32 {
    a.iter()
        .zip(b)
        .skip(from)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The losses' tolerance after a replica is lost: the survivors average 3/4 (or 1/2) of the
/// batch from then on, so the curves part, but within this of each other.
const LOSS_GAP: f32 = 0.25;

#[test]
fn a_killed_replica_costs_a_step_not_the_job() {
    let whole = uninterrupted(&[]);
    let start = Instant::now();
    let mut killed = false;
    let run = job("kill", STEPS, &[], |step, children, _| {
        if step == 10 && !killed {
            children[3].kill().unwrap();
            killed = true;
        }
    });
    let why = explain(&run);
    assert!(killed, "{why}");
    assert!(!run.ok[3], "rank 3 was killed: {why}");
    assert!(
        run.ok[..3].iter().all(|&ok| ok),
        "the survivors finish: {why}"
    );
    assert!(run.errs[0].contains("lost replica(s) [3]"), "{why}");
    assert_eq!(run.losses.len(), STEPS, "{why}");
    assert_eq!(
        run.losses[..10],
        whole[..10],
        "bit-identical before the loss"
    );
    let gap = max_gap(&run.losses, &whole, 10);
    assert!(gap < LOSS_GAP, "loss gap {gap} after the loss: {why}");
    assert!(
        start.elapsed() < Duration::from_secs(120),
        "no timeout wait"
    );
    println!("killed at step 10: largest loss gap to the uninterrupted run {gap:.4}");
}

#[test]
fn hsdp_survives_the_loss_of_a_whole_replica_group() {
    let flags = ["--zero", "3", "--hybrid", "2"];
    let whole = uninterrupted(&flags);
    let mut killed = false;
    let run = job("hsdp", STEPS, &flags, |step, children, _| {
        if step == 10 && !killed {
            children[3].kill().unwrap();
            killed = true;
        }
    });
    let why = explain(&run);
    assert!(
        !run.ok[3] && !run.ok[2],
        "replica 1 (ranks 2, 3) is lost: {why}"
    );
    assert!(run.ok[0] && run.ok[1], "replica 0 finishes: {why}");
    assert!(run.errs[0].contains("lost replica(s) [1]"), "{why}");
    assert_eq!(run.losses.len(), STEPS, "{why}");
    assert_eq!(run.losses[..10], whole[..10]);
    let gap = max_gap(&run.losses, &whole, 10);
    assert!(gap < LOSS_GAP, "loss gap {gap}: {why}");
    println!("HSDP lost replica 1 at step 10: largest loss gap {gap:.4}");
}

#[test]
fn a_restarted_rank_rejoins_from_a_live_replica() {
    let mut restarted = None;
    let mut killed = false;
    // Long enough that the restarted process (about 0.3 s to start, connect and build) joins
    // well before the end: the tiny model takes about 10 ms a step.
    let steps = 200;
    let run = job("rejoin", steps, &[], |step, children, command| {
        if step == 10 && !killed {
            children[3].kill().unwrap();
            children[3].wait().unwrap();
            killed = true;
        }
        if step == 20 && restarted.is_none() {
            let mut c = command(3);
            c.stdout(Stdio::piped());
            let mut child = c.spawn().unwrap();
            let out = child.stdout.take().unwrap();
            restarted = Some(std::thread::spawn(move || {
                let mut s = String::new();
                BufReader::new(out).read_to_string(&mut s).unwrap();
                s
            }));
            children.push(child);
        }
    });
    let why = explain(&run);
    assert_eq!(run.ok.len(), 5, "{why}");
    assert!(run.ok[..3].iter().all(|&ok| ok), "{why}");
    assert!(run.ok[4], "the restarted rank 3 finishes: {why}");
    assert!(run.errs[0].contains("replica(s) [3] rejoined"), "{why}");
    assert_eq!(run.losses.len(), steps, "{why}");
    // The rejoined rank trained to the end with the others (its losses are the job's: the
    // digests compared at every step after it joined say its weights were the others').
    let _ = restarted.map(|t| t.join().unwrap());
}

#[test]
fn burnrun_restarts_a_killed_rank_and_it_rejoins() {
    // Long enough that the kill (when burnrun has forwarded step 10) and the restart land well
    // before the end: the tiny model takes about 10 ms a step.
    let config = TrainConfig {
        batch_size: 8,
        ..tiny_gpt_run(300)
    };
    let (dir, config_path) = scratch("burnrun", &config);
    let mut child = Command::new(workspace_binary("burn-parallel", "burnrun"))
        .args(["--nproc-per-node", "4", "--max-restarts", "1", "--"])
        .arg(workspace_binary("examples", "gpt"))
        .args(["--backend", "tcp", "--fault-tolerant", "--log-every", "1"])
        .arg("--config")
        .arg(&config_path)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .env("BURN_PARALLEL_VERIFY_REPLICAS_EVERY", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = Vec::new();
    let mut killed = false;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if !killed && line.starts_with("[rank 0] step") && line.contains("   10 ") {
            // Rank 3's pid: the newest gpt process of this burnrun with RANK=3.
            let pid = pid_of_rank(child.id(), 3).expect("rank 3's process");
            let killed_it = Command::new("kill").args(["-9", &pid.to_string()]).status();
            assert!(killed_it.is_ok_and(|s| s.success()), "kill -9 {pid}");
            killed = true;
        }
        lines.push(line);
    }
    let status = child.wait().unwrap();
    let err = stderr_of(&mut child);
    let out = lines.join("\n");
    std::fs::remove_dir_all(&dir).ok();
    let why = format!("{out}\n{err}");
    assert!(killed, "{why}");
    assert!(status.success(), "{status}: {why}");
    assert!(err.contains("lost replica(s) [3]"), "killed mid-run: {why}");
    assert!(err.contains("restarting it (restart 1 of 1)"), "{why}");
    assert!(err.contains("burnrun: rank 3 rejoined at step"), "{why}");
    assert!(err.contains("replica(s) [3] rejoined"), "{why}");
}

/// The pid of the child of `parent` whose environment has `RANK=rank`.
fn pid_of_rank(parent: u32, rank: usize) -> Option<i32> {
    let want = format!("RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let ppid: u32 = stat
            .rsplit(')')
            .next()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        let has = env.split(|&b| b == 0).any(|v| v == want.as_bytes());
        (ppid == parent && has).then_some(pid)
    })
}
