//! Self-test of the `tcp` backend across real processes, run through `burnrun`:
//!
//! ```text
//! cargo build -p burn-parallel --example tcp_selftest --bin burnrun
//! target/debug/burnrun --nproc-per-node 3 -- target/debug/examples/tcp_selftest
//! ```
//!
//! Every rank joins the world with `init_from_env`, runs a few collectives, checks the results
//! against a direct computation and prints `OK`. Arguments select a failure instead:
//!
//! - `exit RANK [CODE]`: rank `RANK` exits with status `CODE` (default 3) without closing its
//!   group, as a crash would; the other ranks report the failure they see, then sleep (as if
//!   stuck elsewhere) until `burnrun` stops them.
//! - `crash RANK [CODE]`: rank `RANK` exits with status `CODE` (default 3); the others exit
//!   with status 1 as soon as their collective reports the failure, as a program that passes
//!   the error up with `?` does. The job's status must still be `CODE`.
//! - `panic RANK`: rank `RANK` panics; the others report the failure, then sleep.
//! - `sleep`: every rank sleeps for a minute after joining (to test signal forwarding).
//!
//! The same code runs in the `burnrun` integration test (`tests/burnrun.rs` includes this file).

use std::time::Duration;

use burn::tensor::TensorData;
use burn_parallel::{ProcessGroup, ReduceOp, init_from_env};

/// What the ranks do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Run the checks and print `OK`.
    Check,
    /// Rank `rank` exits with `code`; the others sleep after seeing it.
    Exit { rank: usize, code: i32 },
    /// Rank `rank` exits with `code`; the others exit with 1 right after seeing it.
    Crash { rank: usize, code: i32 },
    /// Rank `rank` panics.
    Panic { rank: usize },
    /// Every rank sleeps.
    Sleep,
}

/// Reads the plan from the command-line arguments (without the program name).
///
/// # Errors
/// A usage message.
pub fn parse(args: &[String]) -> Result<Plan, String> {
    let usage = "usage: tcp_selftest [exit RANK [CODE] | crash RANK [CODE] | panic RANK | sleep]";
    let number = |s: Option<&String>| -> Result<i64, String> {
        s.ok_or_else(|| usage.to_string())?
            .parse()
            .map_err(|_| usage.to_string())
    };
    match args.first().map(String::as_str) {
        None => Ok(Plan::Check),
        Some(kind @ ("exit" | "crash")) => {
            let rank = number(args.get(1))? as usize;
            let code = args.get(2).map_or(Ok(3), |_| number(args.get(2)))? as i32;
            Ok(if kind == "exit" {
                Plan::Exit { rank, code }
            } else {
                Plan::Crash { rank, code }
            })
        }
        Some("panic") => Ok(Plan::Panic {
            rank: number(args.get(1))? as usize,
        }),
        Some("sleep") => Ok(Plan::Sleep),
        Some(_) => Err(usage.to_string()),
    }
}

/// Runs the self-test with `args`; returns the process's exit status.
pub fn run(args: &[String]) -> i32 {
    let plan = match parse(args) {
        Ok(plan) => plan,
        Err(usage) => {
            eprintln!("{usage}");
            return 2;
        }
    };
    let group = match init_from_env() {
        Ok(group) => group,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    println!(
        "pid {} is rank {} of {} ({})",
        std::process::id(),
        group.rank(),
        group.size(),
        group.backend()
    );
    match plan {
        Plan::Check => match checks(&group) {
            Ok(()) => {
                println!("OK");
                0
            }
            Err(e) => {
                eprintln!("FAILED: {e}");
                group.abort(&e);
                1
            }
        },
        Plan::Exit { rank, .. } | Plan::Crash { rank, .. } | Plan::Panic { rank } => {
            if let Err(e) = group.barrier() {
                eprintln!("error: {e}");
                return 1;
            }
            if group.rank() == rank {
                if let Plan::Exit { code, .. } | Plan::Crash { code, .. } = plan {
                    eprintln!("exiting with status {code} on purpose");
                    std::process::exit(code);
                }
                panic!("rank {rank} panics on purpose");
            }
            match group.all_reduce_f32(vec![1.0], ReduceOp::Sum) {
                Ok(_) => eprintln!("the failure of rank {rank} went unnoticed"),
                Err(e) => eprintln!("saw the failure: {e}"),
            }
            if !matches!(plan, Plan::Crash { .. }) {
                std::thread::sleep(Duration::from_secs(60));
            }
            1
        }
        Plan::Sleep => {
            std::thread::sleep(Duration::from_secs(60));
            0
        }
    }
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what()) }
}

/// A few collectives, checked against a direct computation.
fn checks(group: &ProcessGroup) -> Result<(), String> {
    let (rank, n) = (group.rank(), group.size());
    let err = |e: burn_parallel::CollectiveError| e.to_string();

    let sum = group
        .all_reduce_f32(vec![rank as f32 + 1.0; 3], ReduceOp::Sum)
        .map_err(err)?;
    let want = (n * (n + 1) / 2) as f32;
    check(sum == vec![want; 3], || format!("all_reduce sum: {sum:?}"))?;

    // A few MiB, so that frames span many reads and writes.
    let len = (1 << 20) + 3;
    let big = TensorData::new(vec![rank as f32; len], [len]);
    let max = group.all_reduce_data(big, ReduceOp::Max).map_err(err)?;
    let max = max.as_slice::<f32>().map_err(|e| format!("{e:?}"))?;
    check(max.iter().all(|&v| v == (n - 1) as f32), || {
        "all_reduce max of a large tensor".to_string()
    })?;

    // Uneven shards: rank r holds r + 1 rows of 2.
    let shard = TensorData::new(vec![rank as i32; 2 * (rank + 1)], [rank + 1, 2]);
    let gathered = group.all_gather_data(shard, 0).map_err(err)?;
    let want: Vec<i32> = (0..n).flat_map(|r| vec![r as i32; 2 * (r + 1)]).collect();
    check(
        gathered.as_slice::<i32>().map_err(|e| format!("{e:?}"))? == want.as_slice(),
        || "all_gather of uneven shards".to_string(),
    )?;

    let root = n - 1;
    let value = (rank == root).then(|| format!("hello from rank {root}"));
    let got: String = group.broadcast_object(value.as_ref(), root).map_err(err)?;
    check(got == format!("hello from rank {root}"), || {
        format!("broadcast_object: {got:?}")
    })?;

    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    group
        .send_data(TensorData::new(vec![rank as u32], [1]), next, 7)
        .map_err(err)?;
    let got = group.recv_data(prev, 7).map_err(err)?;
    check(
        got.as_slice::<u32>().map_err(|e| format!("{e:?}"))? == [prev as u32],
        || "send/recv around the ring".to_string(),
    )?;

    group.barrier().map_err(err)
}

#[allow(dead_code)]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(run(&args));
}
