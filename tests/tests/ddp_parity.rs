//! Data parallelism reproduces single-device training: GPT trained 20 steps on 2 and 4 thread
//! ranks, with and without gradient accumulation, and on 2 processes over TCP through
//! `burnrun`, gives the losses of 1 rank on the same global batch (relative difference <= 1e-5).

use burn_parallel::run_local;
use examples::data::Corpus;
use examples::train::{TrainConfig, train_gpt};
use tests::{assert_same_losses, gpt_through_burnrun, tiny_gpt_run};

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
    let (tcp, stdout) = gpt_through_burnrun(2, &config, &[]);
    assert!(
        stdout.contains("[rank 0]"),
        "output is prefixed by rank: {stdout}"
    );
    assert_same_losses(&reference, &tcp, TOL, "2 tcp processes");
}
