//! Shared helpers of the cross-crate integration tests: small training configurations, the
//! parity check against single-device training, and locating the binaries that multi-process
//! tests run through `burnrun`.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use examples::gpt::GptConfig;
use examples::train::TrainConfig;

/// A GPT run small enough for CI: 2 layers, width 32, global batch 8 x 16 tokens.
pub fn tiny_gpt_run(steps: usize) -> TrainConfig {
    let mut model = GptConfig::new(256, 2, 2, 32, 16);
    model.seed = 7;
    TrainConfig {
        model,
        steps,
        batch_size: 8,
        seq_len: 16,
        grad_accum: 1,
        lr: 3e-3,
        warmup_steps: 5,
        weight_decay: 0.01,
        bucket_mb: 0.01, // several buckets even for a tiny model
        eval_batches: 1,
        sample_len: 0,
        prompt: String::new(),
        max_grad_norm: None,
    }
}

/// Asserts that two loss curves agree within `tol` relative difference, step by step.
///
/// # Panics
/// With the first step that differs, both values and the whole curves.
pub fn assert_same_losses(reference: &[f64], other: &[f64], tol: f64, what: &str) {
    assert_eq!(reference.len(), other.len(), "{what}: number of steps");
    for (step, (a, b)) in reference.iter().zip(other).enumerate() {
        let rel = (a - b).abs() / a.abs().max(1e-12);
        assert!(
            rel <= tol,
            "{what}: step {step} loss {b} vs single-device {a} (relative difference {rel:.2e} > \
             {tol:.0e})\nreference {reference:?}\nother     {other:?}"
        );
    }
}

/// Path of a workspace binary (`gpt`, `burnrun`), built with cargo if it is not there yet.
///
/// Integration tests run from `<target>/<profile>/deps/`, so binaries of the same build live
/// two levels up; `cargo test --workspace` builds them before any test runs.
pub fn workspace_binary(package: &str, name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from <target>/<profile>/deps")
        .to_path_buf();
    let path = dir.join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let profile = dir.file_name().and_then(|p| p.to_str()).unwrap_or("debug");
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", package, "--bin", name]);
        if profile == "release" {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(
            status.success(),
            "cargo build -p {package} --bin {name} failed"
        );
    }
    path
}

/// Runs the `gpt` binary as `processes` processes over TCP through `burnrun`, with `config`
/// (passed as a TOML file) and extra `flags`; returns the per-step losses rank 0 wrote and the
/// launcher's output (every line prefixed by its rank).
///
/// # Panics
/// When the run fails, with its whole output.
pub fn gpt_through_burnrun(
    processes: usize,
    config: &TrainConfig,
    flags: &[&str],
) -> (Vec<f64>, String) {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "burn-parallel-burnrun-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let config_path = dir.join("run.toml");
    std::fs::write(
        &config_path,
        toml::to_string(config).expect("a TOML config"),
    )
    .expect("writing the config");
    let losses_path = dir.join("losses.json");
    let output = Command::new(workspace_binary("burn-parallel", "burnrun"))
        .args(["--nproc-per-node", &processes.to_string(), "--"])
        .arg(workspace_binary("examples", "gpt"))
        .args(["--backend", "tcp"])
        .args(flags)
        .arg("--config")
        .arg(&config_path)
        .arg("--losses-out")
        .arg(&losses_path)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .output()
        .expect("running burnrun");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "burnrun {flags:?} failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let losses = serde_json::from_str(
        &std::fs::read_to_string(&losses_path).expect("rank 0 wrote its losses"),
    )
    .expect("a JSON list of losses");
    std::fs::remove_dir_all(&dir).ok();
    (losses, stdout)
}
