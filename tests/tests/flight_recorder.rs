//! The flight recorder of collectives (`burn_parallel::flight`, issue 47): each rank's last
//! calls, dumped when a call fails or on SIGUSR1, and a diagnosis that names the rank the
//! others wait for.
//!
//! - a rank that stops calling collectives while the others all-reduce: named, with the op and
//!   call number they wait in (thread ranks; the same dump `burnrun diagnose DIR` reads);
//! - a rank that all-gathers where the others all-reduce: named, with both ops and the number;
//! - `diagnose` on hand-made records (behind, mismatch, dead rank, a stuck receive, healthy);
//! - the ring keeps the newest calls when it wraps; SIGUSR1 dumps every rank;
//! - `flight_overhead` (ignored) prints the per-call cost of recording:
//!   `cargo test -p tests --features tests/portable --test flight_recorder -- --ignored flight_overhead --nocapture`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};
use burn_parallel::flight::{
    self, CallState, DEFAULT_ENTRIES, ENTRIES_ENV, Entry, Finding, GroupInfo, RankRecord,
};
use burn_parallel::{ProcessGroup, ReduceOp, run_local};

/// A fresh directory for one test's dumps.
fn dump_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flight-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The group with its recorder writing to `dir` and a short timeout.
fn recorded(group: ProcessGroup, dir: &Path, timeout: Duration) -> ProcessGroup {
    group
        .flight()
        .expect("the recorder is on by default")
        .set_dir(Some(dir.to_path_buf()));
    group.with_timeout(timeout)
}

#[test]
fn a_rank_that_stops_calling_is_named_with_the_call_the_others_wait_in() {
    let dir = dump_dir("sleeper");
    let outcome = run_local(3, |group| {
        let group = recorded(group, &dir, Duration::from_secs(1));
        for _ in 0..3 {
            group.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum)?;
        }
        if group.rank() == 2 {
            // Stuck in its own work, past the others' timeout; it calls nothing more.
            std::thread::sleep(Duration::from_secs(3));
            return Ok(());
        }
        group
            .all_reduce_f32(vec![1.0; 4], ReduceOp::Sum)
            .map(|_| ())
    });
    assert!(outcome.is_err(), "the others time out");
    let records = flight::read_dir(&dir).expect("every rank dumped");
    assert_eq!(
        records.len(),
        3,
        "the sleeping rank is dumped with the others"
    );
    let diagnosis = flight::diagnose(&records);
    let text = diagnosis.to_string();
    println!("{text}");
    assert_eq!(diagnosis.culprits(), vec![2], "{text}");
    match &diagnosis.findings[..] {
        [
            Finding::Behind {
                ranks,
                waiting,
                call,
                doing,
                ..
            },
        ] => {
            assert_eq!(
                (ranks.as_slice(), waiting.as_slice()),
                (&[2][..], &[0, 1][..])
            );
            assert_eq!((call.op.as_str(), call.seq), ("all_reduce", 4));
            let (last, _) = doing[0].1.as_ref().expect("rank 2 recorded calls");
            assert_eq!((last.seq, last.state), (3, CallState::Done));
        }
        other => panic!("expected one Behind finding, got {other:?}"),
    }
    assert!(
        text.contains("rank 2 behind on group world (ranks 0-2)"),
        "{text}"
    );
    assert!(
        text.contains("ranks 0-1 wait in all_reduce #4 (sum f32[4]"),
        "{text}"
    );

    // The same files through the command a user runs.
    let burnrun = tests::workspace_binary("burn-parallel", "burnrun");
    let out = Command::new(burnrun)
        .arg("diagnose")
        .arg(&dir)
        .output()
        .expect("burnrun runs");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(printed.contains("records of ranks 0, 1, 2"), "{printed}");
    assert!(printed.contains(&text), "{printed}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_calls_another_collective_is_named_with_both_ops() {
    let dir = dump_dir("mismatch");
    let outcome = run_local(3, |group| {
        let group = recorded(group, &dir, Duration::from_secs(5));
        for _ in 0..3 {
            group.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum)?;
        }
        if group.rank() == 2 {
            let x = TensorData::new(vec![1.0f32; 4], [4]);
            group.all_gather_data(x, 0).map(|_| ())
        } else {
            group
                .all_reduce_f32(vec![1.0; 4], ReduceOp::Sum)
                .map(|_| ())
        }
    });
    assert!(outcome.is_err(), "the mismatch is an error");
    let records = flight::read_dir(&dir).expect("every rank dumped");
    assert_eq!(records.len(), 3);
    let diagnosis = flight::diagnose(&records);
    let text = diagnosis.to_string();
    println!("{text}");
    assert_eq!(diagnosis.culprits(), vec![2], "{text}");
    let Some(Finding::Mismatch { seq, sides, .. }) = diagnosis.findings.first() else {
        panic!("expected a mismatch first: {text}");
    };
    assert_eq!(*seq, 4);
    assert_eq!(sides[0].0, vec![0, 1]);
    assert_eq!(sides[0].1.op, "all_reduce");
    assert_eq!(
        (sides[1].0.as_slice(), sides[1].1.op.as_str()),
        (&[2][..], "all_gather")
    );
    assert!(
        text.contains("mismatch at call #4 on group world (ranks 0-2): ranks 0-1 called all_reduce #4 (sum f32[4]")
            && text.contains("rank 2 called all_gather #4 (dim 0 f32[*]"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ring_keeps_the_newest_calls_when_it_wraps() {
    let capacity = std::env::var(ENTRIES_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ENTRIES);
    if capacity == 0 {
        return;
    }
    let calls = capacity as u64 + 100;
    let records = run_local(2, |group| {
        let sub = group.split(&[1, 0])?;
        for _ in 0..calls {
            group.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
        }
        sub.barrier()?;
        Ok(group.flight().expect("on").snapshot("test"))
    })
    .unwrap();
    for record in &records {
        let entries = &record.entries;
        assert_eq!(entries.len(), capacity, "a full ring");
        let last = entries.last().unwrap();
        assert_eq!(
            (last.op.as_str(), last.seq, last.state),
            ("barrier", 1, CallState::Done)
        );
        let seqs: Vec<u64> = entries[..capacity - 1].iter().map(|e| e.seq).collect();
        let expected: Vec<u64> = (calls - capacity as u64 + 2..=calls).collect();
        assert_eq!(seqs, expected, "the oldest calls went first");
        let e = &entries[0];
        assert_eq!((e.dtype, e.bytes, e.group), (Some(DType::F32), 4, 0));
        assert!(e.finished_us.unwrap() >= e.issued_us);
        assert_eq!(record.groups.len(), 2, "the world and the sub-group");
        assert_eq!(record.groups[1].members, vec![1, 0]);
    }
}

#[test]
fn sigusr1_dumps_every_rank() {
    let dir = dump_dir("sigusr1");
    run_local(2, |group| {
        let group = recorded(group, &dir, Duration::from_secs(30));
        group.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
        if group.rank() == 0 {
            let pid = std::process::id().to_string();
            let sent = Command::new("kill").args(["-USR1", &pid]).status();
            assert!(sent.expect("kill runs").success());
            let deadline = Instant::now() + Duration::from_secs(20);
            while flight::read_dir(&dir).map_or(0, |r| r.len()) < 2 {
                assert!(Instant::now() < deadline, "no dump after SIGUSR1");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        group.barrier()
    })
    .unwrap();
    let records = flight::read_dir(&dir).unwrap();
    assert_eq!(
        records.iter().map(|r| r.rank).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(records.iter().all(|r| r.reason == "SIGUSR1"));
    for r in &records {
        let first = &r.entries[0];
        assert_eq!((first.op.as_str(), first.seq), ("all_reduce", 1));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One rank of [`tcp_processes_through_burnrun_name_the_rank_that_stopped`] (run by burnrun).
#[test]
#[ignore = "a rank of a burnrun job"]
fn flight_tcp_rank() {
    if std::env::var("RANK").is_err() {
        return;
    }
    let group = burn_parallel::init_from_env().expect("the job's world");
    for _ in 0..3 {
        group.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum).unwrap();
    }
    if group.rank() == 2 {
        std::thread::sleep(Duration::from_secs(60)); // until burnrun stops it
    }
    group.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum).unwrap();
}

/// Three TCP processes through `burnrun`; rank 2 stops calling collectives. Ranks 0 and 1
/// time out and dump; burnrun then asks rank 2 for its record (SIGUSR1) before stopping it,
/// and prints the diagnosis: rank 2 last finished call #3, the others wait in #4.
#[test]
fn tcp_processes_through_burnrun_name_the_rank_that_stopped() {
    let dir = dump_dir("tcp");
    let burnrun = tests::workspace_binary("burn-parallel", "burnrun");
    let out = Command::new(burnrun)
        .args(["--nproc-per-node", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "flight_tcp_rank", "--nocapture"])
        .env(flight::DIR_ENV, &dir)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "2")
        .output()
        .expect("burnrun runs");
    assert!(!out.status.success(), "the job fails");
    let records = flight::read_dir(&dir).expect("the failed ranks dumped");
    let ranks: Vec<usize> = records.iter().map(|r| r.rank).collect();
    assert_eq!(ranks, vec![0, 1, 2], "every rank's record");
    let diagnosis = flight::diagnose(&records);
    let text = diagnosis.to_string();
    println!("{text}");
    assert_eq!(diagnosis.culprits(), vec![2], "{text}");
    assert!(text.contains("wait in all_reduce #4 (sum f32[4]"), "{text}");
    assert!(
        text.contains("rank 2 last finished all_reduce #3"),
        "{text}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("burnrun: flight records of 3 rank(s)") && stderr.contains(&text),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A mesh names its groups in the records (and so in the diagnosis): `dp`, `tp`, and a
/// flattened group by its dimensions.
#[test]
fn mesh_groups_carry_their_names() {
    let names = run_local(4, |world| {
        let mesh = burn_parallel::DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)]).unwrap();
        let both = mesh.flattened(&["dp", "tp"]).unwrap();
        // A record lists the groups its calls were made on.
        for g in [mesh.group("dp").unwrap(), mesh.group("tp").unwrap(), &both] {
            g.barrier()?;
        }
        let record = world.flight().expect("on by default").snapshot("test");
        let name = |g: &ProcessGroup| {
            record
                .groups
                .iter()
                .find(|i| i.id == g.flight_id())
                .and_then(|i| i.name.clone())
        };
        Ok((
            name(mesh.group("dp").unwrap()),
            name(mesh.group("tp").unwrap()),
            name(&both),
        ))
    })
    .unwrap();
    let expected = (Some("dp".into()), Some("tp".into()), Some("dp x tp".into()));
    assert!(names.iter().all(|n| *n == expected), "{names:?}");
}

// ---- diagnose on hand-made records ----------------------------------------------------------

fn entry(seq: u64, group: u64, op: &str, args: &str, state: CallState) -> Entry {
    Entry {
        seq,
        group,
        op: op.into(),
        signature: format!("{op}(#{seq} {args})"),
        dtype: Some(DType::F32),
        bytes: 16,
        peer: None,
        state,
        error: (state == CallState::Failed).then(|| "timed out".into()),
        issued_us: seq * 10,
        finished_us: (state != CallState::Waiting).then_some(seq * 10 + 5),
    }
}

fn record(rank: usize, groups: &[GroupInfo], entries: Vec<Entry>) -> RankRecord {
    let world_size = groups
        .iter()
        .flat_map(|g| &g.members)
        .max()
        .map_or(1, |m| m + 1);
    RankRecord {
        rank,
        world_size,
        pid: 1,
        start_unix_us: 0,
        taken_us: 1_000_000,
        reason: "test".into(),
        groups: groups.to_vec(),
        entries,
    }
}

fn group(id: u64, members: &[usize], name: &str) -> GroupInfo {
    GroupInfo {
        id,
        members: members.to_vec(),
        name: Some(name.into()),
    }
}

use CallState::{Done, Failed, Waiting};

#[test]
fn diagnose_names_the_rank_behind_and_what_it_is_in() {
    // tp = ranks 0-3; dp = ranks 2-3. Rank 3 is stuck in dp's all_reduce #1452 (rank 2 never
    // joined it); ranks 0-2 wait in tp's all_gather #1453.
    let tp = group(7, &[0, 1, 2, 3], "tp");
    let dp = group(9, &[2, 3], "dp");
    let gather = |s| entry(1453, 7, "all_gather", "dim 0 f32[*, 8]", s);
    let mut records: Vec<RankRecord> = (0..3)
        .map(|r| {
            let mut entries = vec![entry(1452, 7, "all_gather", "dim 0 f32[*, 8]", Done)];
            if r == 2 {
                entries.push(entry(1451, 9, "all_reduce", "sum f32[4]", Done));
            }
            entries.push(gather(Waiting));
            record(r, &[tp.clone(), dp.clone()], entries)
        })
        .collect();
    records.push(record(
        3,
        &[tp.clone(), dp.clone()],
        vec![
            entry(1452, 7, "all_gather", "dim 0 f32[*, 8]", Done),
            entry(1451, 9, "all_reduce", "sum f32[4]", Done),
            entry(1452, 9, "all_reduce", "sum f32[4]", Waiting),
        ],
    ));
    let d = flight::diagnose(&records);
    let text = d.to_string();
    assert!(
        text.contains(
            "rank 3 behind on group tp (ranks 0-3): rank 3 is in all_reduce #1452 (sum f32[4], \
             waiting) on group dp (ranks 2-3); ranks 0-2 wait in all_gather #1453 (dim 0 \
             f32[*, 8], waiting)"
        ),
        "{text}"
    );
    // On dp, rank 2 is the one behind (it waits in tp); both are named.
    assert_eq!(d.culprits(), vec![2, 3], "{text}");
}

#[test]
fn diagnose_names_a_mismatch_a_dead_rank_a_stuck_receive_and_a_healthy_job() {
    let world = [group(0, &[0, 1, 2], "world")];
    let at = |op: &str, args: &str, s| vec![entry(4, 0, op, args, s)];
    // Mismatch: rank 1 gathers where 0 and 2 reduce.
    let records = vec![
        record(0, &world, at("all_reduce", "sum f32[4]", Failed)),
        record(1, &world, at("all_gather", "dim 0 f32[*]", Failed)),
        record(2, &world, at("all_reduce", "sum f32[4]", Failed)),
    ];
    let d = flight::diagnose(&records);
    assert_eq!(d.culprits(), vec![1], "{d}");
    assert!(
        matches!(&d.findings[0], Finding::Mismatch { seq: 4, .. }),
        "{d}"
    );

    // Dead: rank 2 left no record while 0 and 1 wait.
    let records = vec![
        record(0, &world, at("all_reduce", "sum f32[4]", Waiting)),
        record(1, &world, at("all_reduce", "sum f32[4]", Waiting)),
    ];
    let d = flight::diagnose(&records);
    assert_eq!(d.culprits(), vec![2], "{d}");
    assert!(
        d.to_string()
            .starts_with("rank 2 of group world (ranks 0-2) left no record (dead?); ranks 0-1 wait in all_reduce #4"),
        "{d}"
    );

    // Dead, though nobody was seen waiting: still named.
    let records = vec![
        record(0, &world, at("all_reduce", "sum f32[4]", Done)),
        record(1, &world, at("all_reduce", "sum f32[4]", Done)),
    ];
    let d = flight::diagnose(&records);
    assert_eq!(d.culprits(), vec![2], "{d}");
    assert_eq!(
        d.to_string(),
        "rank 2 of group world (ranks 0-2) left no record (dead?)"
    );

    // A receive that waits for a peer busy elsewhere.
    let mut recv = entry(0, 0, "recv", "", Waiting);
    recv.signature = "recv(tag 3)".into();
    recv.peer = Some((1, 3));
    let records = vec![
        record(0, &world, vec![recv]),
        record(1, &world, at("all_reduce", "sum f32[4]", Done)),
    ];
    let d = flight::diagnose(&records);
    assert!(d.culprits().contains(&1), "{d}");
    assert!(
        d.to_string()
            .contains("rank 0 waits in recv with rank 1 (tag 3, waiting)"),
        "{d}"
    );

    // Healthy: everyone finished the same calls.
    let records: Vec<RankRecord> = (0..3)
        .map(|r| record(r, &world, at("all_reduce", "sum f32[4]", Done)))
        .collect();
    let d = flight::diagnose(&records);
    assert!(d.findings.is_empty() && d.culprits().is_empty(), "{d}");
    assert_eq!(d.to_string(), "no culprit: no rank waits for another");
}

// ---- overhead ----------------------------------------------------------------------------------

const CALLS: usize = 10_000;

/// One child run: prints the ns per `all_reduce_f32` of 2 thread ranks.
#[test]
#[ignore = "a child of flight_overhead"]
fn flight_overhead_child() {
    let per_call = run_local(2, |group| {
        for _ in 0..500 {
            group.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum)?;
        }
        let start = Instant::now();
        for _ in 0..CALLS {
            group.all_reduce_f32(vec![1.0; 4], ReduceOp::Sum)?;
        }
        Ok(start.elapsed().as_nanos() as f64 / CALLS as f64)
    })
    .unwrap()[0];
    println!("FLIGHT_NS_PER_CALL {per_call}");
}

/// Recording on against off (`BURN_PARALLEL_FLIGHT_ENTRIES=0`), whole processes, alternating.
#[test]
#[ignore = "a benchmark: prints figures"]
fn flight_overhead() {
    let exe = std::env::current_exe().unwrap();
    let run = |entries: &str| -> f64 {
        let out = Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "flight_overhead_child",
                "--nocapture",
            ])
            .env(ENTRIES_ENV, entries)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix("FLIGHT_NS_PER_CALL "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no figure: {text}"))
    };
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        on.push(run(&DEFAULT_ENTRIES.to_string()));
        off.push(run("0"));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (on_m, off_m) = (median(&mut on), median(&mut off));
    println!(
        "all_reduce_f32 of 4 floats, 2 thread ranks, {CALLS} calls, 7 runs each, alternating:"
    );
    println!("  recorder on  ({DEFAULT_ENTRIES} entries): median {on_m:.0} ns/call  {on:.0?}");
    println!("  recorder off (0 entries):    median {off_m:.0} ns/call  {off:.0?}");
    println!(
        "  on/off = {:.3} ({:+.0} ns/call)",
        on_m / off_m,
        on_m - off_m
    );
}
