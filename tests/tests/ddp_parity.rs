//! Data parallelism reproduces single-device training: GPT trained 20 steps on 2 and 4 thread
//! ranks, with and without gradient accumulation, and on 2 processes over TCP through
//! `burnrun`, gives the losses of 1 rank on the same global batch (relative difference <= 1e-5).

use std::process::Command;

use burn_parallel::run_local;
use examples::data::Corpus;
use examples::train::{TrainConfig, train_gpt};
use tests::{assert_same_losses, tiny_gpt_run, workspace_binary};

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

fn losses(ranks: usize, config: &TrainConfig) -> Vec<f64> {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = run_local(ranks, |group| {
        train_gpt(&group, config, &corpus, &mut |_| {})
    })
    .expect("training");
    // Every rank reports the same global losses.
    for r in &reports[1..] {
        assert_eq!(r.losses, reports[0].losses);
    }
    reports[0].losses.clone()
}

#[test]
fn ddp_matches_single_device_on_2_and_4_ranks() {
    let config = tiny_gpt_run(STEPS);
    let reference = losses(1, &config);
    assert!(
        reference[STEPS - 1] < reference[0] - 0.5,
        "the model must learn: {reference:?}"
    );
    assert_same_losses(&reference, &losses(2, &config), TOL, "2 ranks");
    assert_same_losses(&reference, &losses(4, &config), TOL, "4 ranks");
}

#[test]
fn ddp_with_gradient_accumulation_matches_single_device() {
    let config = tiny_gpt_run(STEPS);
    let reference = losses(1, &config);
    let accumulated = TrainConfig {
        grad_accum: 2,
        ..config.clone()
    };
    assert_same_losses(
        &reference,
        &losses(1, &accumulated),
        TOL,
        "1 rank x 2 micro-steps",
    );
    assert_same_losses(
        &reference,
        &losses(2, &accumulated),
        TOL,
        "2 ranks x 2 micro-steps",
    );
}

#[test]
fn ddp_over_tcp_processes_through_burnrun_matches_single_device() {
    let config = tiny_gpt_run(STEPS);
    let reference = losses(1, &config);
    let dir = std::env::temp_dir().join(format!("burn-parallel-ddp-tcp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("run.toml");
    std::fs::write(&config_path, toml::to_string(&config).unwrap()).unwrap();
    let losses_path = dir.join("losses.json");

    let output = Command::new(workspace_binary("burn-parallel", "burnrun"))
        .args(["--nproc-per-node", "2", "--"])
        .arg(workspace_binary("examples", "gpt"))
        .args(["--backend", "tcp", "--config"])
        .arg(&config_path)
        .arg("--losses-out")
        .arg(&losses_path)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .output()
        .expect("running burnrun");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "burnrun failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("[rank 0]"),
        "output is prefixed by rank: {stdout}"
    );
    let tcp: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(&losses_path).unwrap()).unwrap();
    assert_same_losses(&reference, &tcp, TOL, "2 tcp processes");
    std::fs::remove_dir_all(&dir).ok();
}
