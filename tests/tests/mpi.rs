//! The `mpi` backend under a real `mpirun` (Open MPI or MPICH; run as root in CI, hence
//! `--allow-run-as-root`): every collective against direct computation at 2 and 3 ranks, on
//! the world and on sub-groups, with MPI calls limited to a few elements so that the chunked
//! and multi-round paths run too; typed errors for mismatched calls, a late rank and a mesh
//! that does not fit the world; and GPT DDP over 2 MPI processes against single-device
//! training (losses and final parameters within 1e-5).
#![cfg(feature = "mpi")]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tests::{assert_matches_reference, reference_run, tiny_gpt_run, workspace_binary};

/// `mpirun` with the flags every run needs: as many ranks as asked on whatever cores there
/// are, and permission to run as root (CI containers).
fn mpirun(np: usize) -> Command {
    // A session directory of this job's own: Open MPI creates `$TMPDIR/ompi.<host>.<uid>`, and
    // jobs started at once by parallel tests raced on creating the same one ("mkdir ... File
    // exists": the job failed before any rank ran).
    static JOBS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let job = JOBS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let tmp = std::env::temp_dir().join(format!("bp-mpi-{}-{job}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("a session directory for mpirun");
    let mut cmd = Command::new("mpirun");
    cmd.env("TMPDIR", &tmp);
    cmd.args([
        "--oversubscribe",
        "--allow-run-as-root",
        "-np",
        &np.to_string(),
    ])
    .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
    // Open MPI: loopback TCP and shared memory only, no probing of other transports.
    .env("OMPI_MCA_btl", "self,vader,tcp")
    .env("OMPI_MCA_btl_tcp_if_include", "lo")
    .env("OMPI_MCA_oob_tcp_if_include", "lo");
    cmd
}

fn collectives_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mpi_collectives"))
}

fn text(output: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn run_collectives(np: usize, mode: &str, max_count: Option<usize>) -> (Output, Duration) {
    let mut cmd = mpirun(np);
    cmd.arg(collectives_binary()).arg(mode);
    if let Some(max) = max_count {
        cmd.env("BURN_PARALLEL_MPI_MAX_COUNT", max.to_string());
    }
    let started = Instant::now();
    let output = cmd
        .output()
        .expect("running mpirun (is Open MPI installed?)");
    (output, started.elapsed())
}

/// Every rank finished and printed the main checks (and the large-buffer ones unless MPI
/// calls were `limited`).
fn assert_all_ranks_ok(np: usize, output: &Output, limited: bool) {
    let all = text(output);
    assert!(output.status.success(), "mpirun failed:\n{all}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    for r in 0..np {
        assert!(
            stdout.contains(&format!("rank {r}: ok all")),
            "rank {r} did not finish:\n{all}"
        );
        assert!(
            stdout.contains(&format!("rank {r}: ok threads")),
            "rank {r} did not check its thread policy:\n{all}"
        );
        for check in [
            "world all_reduce avg BF16 [1000]",
            "world all_gather dim 1",
            "world reduce_scatter max dim 1",
            "world all_to_all split 1 concat 0",
            "reversed all_to_all dim 0",
            "reversed send/recv [1000]",
            "world objects",
        ]
        .into_iter()
        .chain(if limited {
            vec![]
        } else {
            vec![
                "world all_reduce sum F16 [70001]",
                "world send/recv [100000]",
            ]
        }) {
            assert!(
                stdout.contains(&format!("rank {r}: ok {check}")),
                "rank {r} did not check {check}:\n{all}"
            );
        }
    }
    assert!(
        stdout.contains("rank 0: ok evens all_reduce sum F32 [1000]"),
        "{all}"
    );
}

#[test]
fn collectives_match_direct_computation_at_2_ranks() {
    let (output, _) = run_collectives(2, "collectives", None);
    assert_all_ranks_ok(2, &output, false);
    assert!(String::from_utf8_lossy(&output.stdout).contains("rank 1: ok mesh tp all_reduce"));
}

#[test]
fn collectives_match_direct_computation_at_3_ranks() {
    let (output, _) = run_collectives(3, "collectives", None);
    assert_all_ranks_ok(3, &output, false);
}

/// Every MPI call limited to 7 units: all-reduce and broadcast in chunks, the variable-count
/// collectives in rounds through staging buffers, frames in several messages.
#[test]
fn collectives_in_chunks_and_rounds_match_at_3_ranks() {
    let (output, _) = run_collectives(3, "collectives", Some(7));
    assert_all_ranks_ok(3, &output, true);
}

#[test]
fn a_bad_max_count_setting_is_a_typed_error() {
    let mut cmd = mpirun(1);
    cmd.arg(collectives_binary())
        .env("BURN_PARALLEL_MPI_MAX_COUNT", "0");
    let output = cmd.output().expect("running mpirun");
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(all.contains("BURN_PARALLEL_MPI_MAX_COUNT"), "{all}");
}

#[test]
fn ranks_calling_different_shapes_get_a_mismatch_and_go_on() {
    let (output, _) = run_collectives(2, "mismatch", None);
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    for r in 0..2 {
        assert!(all.contains(&format!("rank {r}: ok mismatch")), "{all}");
    }
    assert!(all.contains("collective mismatch with rank"), "{all}");
}

#[test]
fn a_late_rank_is_a_typed_timeout_that_ends_the_job() {
    let (output, elapsed) = run_collectives(3, "timeout", None);
    let all = text(&output);
    assert!(!output.status.success(), "the job must fail:\n{all}");
    // Ranks 0 and 1 time out together; the first to abort may end the other before it prints,
    // so either one's report will do.
    assert!(
        (0..2).any(|r| all.contains(&format!(
            "rank {r}: timeout error: rank {r}: barrier(#1 ) on the mpi backend did not complete \
             within 2s"
        ))),
        "{all}"
    );
    // Ended by MPI_Abort from the ranks that timed out, not by the late rank's 60 s sleep.
    assert!(
        elapsed < Duration::from_secs(40),
        "took {elapsed:?}:\n{all}"
    );
}

#[test]
fn a_mesh_that_does_not_fit_the_mpi_world_is_a_typed_error() {
    let (output, _) = run_collectives(3, "mesh", None);
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    assert!(all.contains("rank 2: mesh error: mesh"), "{all}");
    assert!(all.contains("but the world has 3"), "{all}");
}

/// `gpt --backend mpi` under `mpirun`: rank 0 writes its losses and parameters.
fn gpt_through_mpirun(
    np: usize,
    config: &examples::train::TrainConfig,
) -> (Vec<f64>, Vec<examples::train::NamedParam>) {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "burn-parallel-mpirun-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let config_path = dir.join("run.toml");
    std::fs::write(&config_path, toml::to_string(config).expect("TOML")).expect("config");
    let losses = dir.join("losses.json");
    let params = dir.join("params.json");
    let output = mpirun(np)
        .arg(workspace_binary("examples", "gpt"))
        .args(["--backend", "mpi", "--config"])
        .arg(&config_path)
        .arg("--losses-out")
        .arg(&losses)
        .arg("--params-out")
        .arg(&params)
        .output()
        .expect("running mpirun");
    let all = text(&output);
    assert!(output.status.success(), "gpt under mpirun failed:\n{all}");
    assert!(
        all.contains("(mpi)"),
        "the header names the backend:\n{all}"
    );
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{e}\n{all}"));
    let out = (
        serde_json::from_str(&read(&losses)).expect("losses"),
        serde_json::from_str(&read(&params)).expect("params"),
    );
    std::fs::remove_dir_all(&dir).ok();
    out
}

#[test]
fn gpt_ddp_over_2_mpi_processes_matches_single_device() {
    let config = tiny_gpt_run(20);
    let reference = reference_run(&config);
    let (losses, params) = gpt_through_mpirun(2, &config);
    assert_matches_reference(&reference, &losses, &params, 1e-5, "2 MPI processes");
}
