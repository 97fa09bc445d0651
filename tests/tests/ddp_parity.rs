//! Data parallelism reproduces single-device training: GPT trained 20 steps on 2 and 4 thread
//! ranks, with and without gradient accumulation, and on 2 processes over TCP through
//! `burnrun`, gives the losses and the final parameters of the independent single-device
//! reference run ([`tests::reference_run`]) on the same global batch (relative difference
//! <= 1e-5). The reference itself reproduces the shared training loop on one rank, and the
//! parameter check fails on a parameter off by 1e-4.

use burn_parallel_train::run_local;
use examples::data::Corpus;
use examples::train::{TrainConfig, TrainReport, train_gpt};
use tests::{
    Reference, assert_matches_reference, assert_same_params, compare_params, gpt_through_burnrun,
    reference_run, tiny_gpt_run,
};

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

fn run(ranks: usize, config: &TrainConfig) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = run_local(ranks, |group| {
        train_gpt(&group, config, &Default::default(), &corpus, &mut |_| {})
    })
    .expect("training");
    // Every rank reports the same global losses and the same parameters.
    for r in &reports[1..] {
        assert_eq!(r.losses, reports[0].losses);
        assert_eq!(r.final_params, reports[0].final_params);
    }
    reports.into_iter().next().expect("rank 0")
}

fn check(reference: &Reference, ranks: usize, config: &TrainConfig, what: &str) {
    let r = run(ranks, config);
    assert_matches_reference(reference, &r.losses, &r.final_params, TOL, what);
}

/// The independent reference and the shared loop (`train::fit`) on one rank agree to 1e-6,
/// without and with clipping.
#[test]
fn reference_reproduces_the_training_loop_on_one_rank() {
    for clip in [None, Some(0.5)] {
        let config = TrainConfig {
            max_grad_norm: clip,
            ..tiny_gpt_run(STEPS)
        };
        let reference = reference_run(&config);
        assert!(
            reference.losses[STEPS - 1] < reference.losses[0] - 0.5,
            "the model must learn: {:?}",
            reference.losses
        );
        let fit = run(1, &config);
        let diff = reference
            .losses
            .iter()
            .zip(&fit.losses)
            .map(|(a, b)| (a - b).abs() / a.abs())
            .fold(0.0, f64::max);
        println!("clip {clip:?}: reference vs fit loop, max relative loss difference {diff:.2e}");
        assert_matches_reference(
            &reference,
            &fit.losses,
            &fit.final_params,
            1e-6,
            &format!("fit loop on 1 rank, clip {clip:?}"),
        );
    }
}

/// The parameter check is not vacuous: one parameter off by 1e-4 fails it.
#[test]
fn a_parameter_off_by_1e_4_fails_the_check() {
    let config = tiny_gpt_run(3);
    let reference = reference_run(&config);
    let mut params = run(1, &config).final_params;
    assert_same_params(&reference.params, &params, TOL, "unperturbed");
    let p = params
        .iter_mut()
        .find(|p| p.path.starts_with("blocks.1."))
        .expect("a parameter of block 1");
    p.values[3] += 1e-4;
    let path = p.path.clone();
    let message = compare_params(&reference.params, &params, TOL)
        .expect_err("a parameter off by 1e-4 must fail the check");
    assert!(message.contains(&path), "{message}");
    println!("perturbed by 1e-4: {message}");
}

#[test]
fn ddp_matches_single_device_on_2_and_4_ranks() {
    let config = tiny_gpt_run(STEPS);
    let reference = reference_run(&config);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0] - 0.5,
        "the model must learn: {:?}",
        reference.losses
    );
    check(&reference, 2, &config, "2 ranks");
    check(&reference, 4, &config, "4 ranks");
}

#[test]
fn ddp_with_gradient_accumulation_matches_single_device() {
    let config = tiny_gpt_run(STEPS);
    let reference = reference_run(&config);
    let accumulated = TrainConfig {
        grad_accum: 2,
        ..config.clone()
    };
    check(&reference, 1, &accumulated, "1 rank x 2 micro-steps");
    check(&reference, 2, &accumulated, "2 ranks x 2 micro-steps");
}

#[test]
fn ddp_over_tcp_processes_through_burnrun_matches_single_device() {
    let config = tiny_gpt_run(STEPS);
    let reference = reference_run(&config);
    let tcp = gpt_through_burnrun(2, &config, &[]);
    assert!(
        tcp.stdout.contains("[rank 0]"),
        "output is prefixed by rank: {}",
        tcp.stdout
    );
    assert_matches_reference(&reference, &tcp.losses, &tcp.params, TOL, "2 tcp processes");
}
