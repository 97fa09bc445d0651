//! Muon (hidden matrices) with AdamW (the rest) under every layout reproduces single-device
//! Muon: 20 steps of the bundled GPT under DDP, TP 2 + SP, ZeRO-1/2 (alone and x TP 2),
//! FSDP 2, FSDP 2 x TP 2, HSDP and pp 2 (alone, x tp 2, x ZeRO-1) give the single-device
//! run's losses (relative difference <= 1e-5) and, gathered whole, its final parameters. The
//! single-device run is checked to differ from AdamW's (Muon does step the matrices) and to
//! train; a layout Muon does not serve yet (experts) is refused by name. Checkpoints:
//! `resume.rs`; the update against an independent PyTorch reference:
//! `crates/burn-parallel/tests/muon_reference.rs`.

use burn_parallel_train::Optim;
use burn_zero::Stage;
use examples::data::Corpus;
use examples::pipeline::{StageSplit, train_gpt_pipeline};
use examples::train::{Parallelism, TrainConfig, TrainReport};
use tests::{Reference, assert_matches_reference, check_layout, tiny_gpt_run, train_layout};

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

fn config() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.n_heads = 4;
    c.max_grad_norm = Some(1.0);
    c
}

fn muon(p: Parallelism) -> Parallelism {
    Parallelism {
        optim: Optim::Muon,
        ..p
    }
}

fn single() -> Reference {
    Reference::of_run(train_layout(1, &muon(Parallelism::default()), &config()))
}

#[test]
fn muon_single_device_steps_the_matrices_unlike_adamw() {
    let m = train_layout(1, &muon(Parallelism::default()), &config());
    let a = train_layout(1, &Parallelism::default(), &config());
    assert!(m.losses.iter().all(|l| l.is_finite()));
    assert_ne!(m.losses, a.losses, "Muon and AdamW trained the same");
    assert!(
        m.losses.last() < m.losses.first(),
        "Muon does not train: {:?}",
        m.losses
    );
}

#[test]
fn muon_under_ddp_and_tensor_parallelism_matches_single_device() {
    let reference = single();
    let c = config();
    let ddp = Parallelism::default();
    check_layout(&reference, 2, muon(ddp), &c, TOL, "Muon DDP 2");
    let tp = Parallelism {
        tp: 2,
        sp: true,
        ..Parallelism::default()
    };
    check_layout(&reference, 2, muon(tp), &c, TOL, "Muon TP 2 + SP");
    check_layout(&reference, 4, muon(tp), &c, TOL, "Muon DP 2 x TP 2 + SP");
}

#[test]
fn muon_under_fsdp_matches_single_device() {
    let reference = single();
    let c = config();
    let fsdp = Parallelism {
        zero: Some(Stage::Three),
        ..Parallelism::default()
    };
    check_layout(&reference, 2, muon(fsdp), &c, TOL, "Muon FSDP 2");
    let fsdp_tp = Parallelism { tp: 2, ..fsdp };
    check_layout(&reference, 4, muon(fsdp_tp), &c, TOL, "Muon FSDP 2 x TP 2");
    let hsdp = Parallelism {
        replicate: 2,
        ..fsdp
    };
    check_layout(&reference, 4, muon(hsdp), &c, TOL, "Muon HSDP 2 x 2");
}

#[test]
fn muon_under_zero_matches_single_device() {
    let reference = single();
    let c = config();
    for stage in [Stage::One, Stage::Two] {
        let zero = Parallelism {
            zero: Some(stage),
            ..Parallelism::default()
        };
        let what = format!("Muon ZeRO-{}", stage.number());
        check_layout(&reference, 2, muon(zero), &c, TOL, &what);
        let zero_tp = Parallelism { tp: 2, ..zero };
        check_layout(
            &reference,
            4,
            muon(zero_tp),
            &c,
            TOL,
            &format!("{what} x TP 2"),
        );
    }
}

/// Trains the pipelined GPT of `layout` on `world` thread ranks; rank 0's report.
fn pipelined(world: usize, layout: &Parallelism, c: &TrainConfig) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let split = StageSplit::default();
    let reports = burn_parallel_train::run_local(world, |g| {
        train_gpt_pipeline(&g, c, layout, &split, &corpus, &mut |_| {})
    })
    .unwrap_or_else(|e| panic!("{layout:?} on {world} ranks: {e}"));
    tests::rank0_if_ranks_agree(reports, |r| (&r.train.losses, &r.train.final_params)).train
}

#[test]
fn muon_under_pipeline_parallelism_matches_single_device() {
    // Four micro-batches: the pipeline's, and the single device's accumulation.
    let c = TrainConfig {
        grad_accum: 4,
        ..config()
    };
    let reference = Reference::of_run(train_layout(1, &muon(Parallelism::default()), &c));
    let pp = Parallelism {
        pp: 2,
        ..Parallelism::default()
    };
    let cases = [
        (2, muon(pp), "Muon pp 2"),
        (4, muon(Parallelism { tp: 2, ..pp }), "Muon pp 2 x tp 2"),
        (
            4,
            muon(Parallelism {
                zero: Some(Stage::One),
                ..pp
            }),
            "Muon pp 2 x ZeRO-1 (dp 2)",
        ),
    ];
    for (world, layout, what) in cases {
        let r = pipelined(world, &layout, &c);
        assert_matches_reference(&reference, &r.losses, &r.final_params, TOL, what);
    }
}

/// A layout Muon does not serve yet is refused before training, naming the flag.
#[test]
fn muon_with_experts_is_a_clear_error() {
    let mut c = config();
    c.model.moe = Some(burn_moe::MoeConfig::new(c.model.d_model, 48, 4, 2));
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let err = burn_parallel_train::run_local(1, |g| {
        examples::train::train_gpt(&g, &c, &muon(Parallelism::default()), &corpus, &mut |_| {})
    })
    .expect_err("Muon with experts");
    let text = err.to_string();
    assert!(
        text.contains("--optim") && text.contains("mixture-of-experts"),
        "{text}"
    );
}
