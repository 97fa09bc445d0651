//! `burnrun` as a supervisor, with small shell scripts as the ranks (no training):
//!
//! - `--max-restarts 1`: a rank that fails once is restarted and rejoins, and the job succeeds;
//!   a rank that fails twice is lost, and the job succeeds when the others do;
//! - rank 0 is never restarted;
//! - `--no-progress-timeout`: ranks that beat once and then hang are stopped, status 124;
//! - stragglers: a rank whose beats say it computes twice as long is named.
//!
//! The scripts write their beats themselves, in the format of `burn_parallel::heartbeat`.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The shell function `beat STEP COMPUTE_S` that the scripts call: writes this rank's beat
/// file atomically, like `Heartbeat::beat`.
const BEAT: &str = r#"
beat() {
    printf '{"rank":%s,"step":%s,"compute_s":%s,"step_s":%s,"unix_ms":%s,"pid":%s}' \
        "$RANK" "$1" "$2" 1.0 "$(date +%s%3N)" "$$" > "$BURN_PARALLEL_HEARTBEAT_DIR/.tmp$RANK" &&
    mv "$BURN_PARALLEL_HEARTBEAT_DIR/.tmp$RANK" "$BURN_PARALLEL_HEARTBEAT_DIR/rank$RANK.beat"
}
"#;

/// A fresh scratch directory for one test (the scripts' marker files).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burnrun-sup-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `burnrun FLAGS -- sh -c BEAT+SCRIPT` with `SCRATCH` set to `scratch`; returns its
/// output, its stderr and how long it took.
fn burnrun(flags: &[&str], script: &str, scratch: &PathBuf) -> (Output, String, Duration) {
    let burnrun = tests::workspace_binary("burn-parallel", "burnrun");
    let start = Instant::now();
    let out = Command::new(burnrun)
        .args(flags)
        .args(["--", "sh", "-c"])
        .arg(format!("{BEAT}\n{script}"))
        .env("SCRATCH", scratch)
        .env_remove("BURN_PARALLEL_FLIGHT_DIR")
        .output()
        .expect("burnrun runs");
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    println!(
        "took {took:?}, {}\n{}{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    (out, stderr, took)
}

#[test]
fn a_rank_that_fails_once_is_restarted_and_rejoins() {
    let dir = scratch("restart");
    let script = r#"
        echo "dirs $BURN_PARALLEL_HEARTBEAT_DIR $BURN_PARALLEL_FLIGHT_DIR" \
            "tolerant=$BURN_PARALLEL_FAULT_TOLERANT"
        if [ "$RANK" = 1 ] && [ ! -e "$SCRATCH/failed" ]; then
            touch "$SCRATCH/failed"
            exit 3
        fi
        if [ "$RANK" = 1 ]; then
            beat 5 0.1
            sleep 1.5
        else
            sleep 3
        fi
    "#;
    let (out, stderr, _) = burnrun(
        &["--nproc-per-node", "2", "--max-restarts", "1"],
        script,
        &dir,
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "burnrun: rank 1 failed (exited with status 3); restarting it (restart 1 of 1)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("burnrun: rank 1 rejoined at step 5"),
        "{stderr}"
    );
    assert!(!stderr.contains("lost rank"), "{stderr}");

    // Every rank (the restarted one too) got the same directories, which are gone now.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("] dirs ")).collect();
    assert_eq!(lines.len(), 3, "two ranks and a restart: {stdout}");
    let words: Vec<&str> = lines[0].split_whitespace().collect();
    let (heartbeat, flight) = (PathBuf::from(words[3]), PathBuf::from(words[4]));
    assert!(heartbeat.ends_with("heartbeat"), "{stdout}");
    assert!(flight.ends_with("flight"), "{stdout}");
    assert_eq!(heartbeat.parent(), flight.parent(), "{stdout}");
    assert_eq!(words[5], "tolerant=1", "{stdout}");
    for line in &lines {
        assert!(line.ends_with(&lines[0][lines[0].find(" dirs ").unwrap()..]));
    }
    assert!(
        !heartbeat.parent().unwrap().exists(),
        "the job's temporary directory is removed at exit"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_fails_twice_is_lost_and_the_others_go_on() {
    let dir = scratch("lost");
    let script = r#"
        if [ "$RANK" = 1 ]; then exit 3; fi
        sleep 2
        echo "rank 0 finished"
    "#;
    let (out, stderr, _) = burnrun(
        &["--nproc-per-node", "2", "--max-restarts", "1"],
        script,
        &dir,
    );
    assert!(
        stderr.contains("burnrun: rank 1 failed (exited with status 3); restarting it"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "burnrun: rank 1 failed (exited with status 3); no restart left (1 used); the other \
             running rank keeps running"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("burnrun: lost rank(s) [1] (not restarted)"),
        "{stderr}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("[rank 0] rank 0 finished"),
        "rank 0 was left running"
    );
    assert_eq!(out.status.code(), Some(0), "rank 0 survived the loss");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rank_0_is_not_restarted() {
    let dir = scratch("rank0");
    let script = r#"
        if [ "$RANK" = 0 ]; then exit 4; fi
        sleep 1
        exit 5
    "#;
    let (out, stderr, _) = burnrun(
        &["--nproc-per-node", "2", "--max-restarts", "2"],
        script,
        &dir,
    );
    assert!(
        stderr.contains(
            "burnrun: rank 0 failed (exited with status 4); rank 0 serves the rendezvous"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("restarting"), "{stderr}");
    assert!(
        stderr.contains("burnrun: lost rank(s) [0, 1] (not restarted)"),
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(4), "the first failure's status");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_that_stop_finishing_steps_are_stopped_by_the_watchdog() {
    let dir = scratch("watchdog");
    let script = r#"
        beat 0 0.1
        sleep 60
    "#;
    let flags = [
        "--nproc-per-node",
        "2",
        "--no-progress-timeout",
        "2",
        "--grace-period",
        "1",
    ];
    let (out, stderr, took) = burnrun(&flags, script, &dir);
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        stderr.contains("burnrun: no rank finished a step for 2 s (last step 0)"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_computes_twice_as_long_is_named_a_straggler() {
    let dir = scratch("straggler");
    let script = r#"
        compute=0.2
        if [ "$RANK" = 1 ]; then compute=0.4; fi
        i=0
        while [ $i -lt 30 ]; do
            beat $i $compute
            sleep 0.3
            i=$((i + 1))
        done
    "#;
    let (out, stderr, _) = burnrun(&["--nproc-per-node", "3"], script, &dir);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "burnrun: rank 1 is a straggler: its steps compute in 0.40 s, the other ranks' in \
             0.20 s (median over the last "
        ),
        "{stderr}"
    );
    assert_eq!(stderr.matches("is a straggler").count(), 1, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
