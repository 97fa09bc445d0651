//! The fused kernels inside the reference GPT.
//!
//! - Always: GPT with `fused` on flex (the CPU kernels: blockwise attention, one-pass norms,
//!   GELU/SwiGLU and cross-entropy, with their backward steps) reproduces the independent single-device reference run of the unfused GPT
//!   ([`tests::reference_run`]) over 10 steps: losses and final parameters, relative difference
//!   <= 1e-5; so does the fused GPT under dp 2, dp 2 x tp 2 + sp and FSDP x tp 2 + sp.
//! - Feature `wgpu`: GPT with `fused` on WGPU (the CubeCL kernels) reproduces the same reference
//!   over 10 steps within 1e-4 relative (losses and final parameters), for the GPT-2 style model
//!   (LayerNorm, GELU, learned positions) and the LLaMA style one (RMSNorm, SwiGLU, rotary);
//!   with `--precision fp16` (f16 compute copy, fp32 master weights, loss scaling) it tracks
//!   the fp32 reference over 20 steps within a measured tolerance.
//!   Without an adapter the test prints `SKIPPED ...` past the output capture (so that it shows
//!   in `cargo test` output) and fails instead when `BURN_PARALLEL_REQUIRE_WGPU=1`.

use burn_parallel_train::run_local;
use examples::data::Corpus;
use examples::gpt::{MlpKind, NormKind, PositionKind};
use examples::train::{TrainConfig, TrainDevice, TrainReport, train_gpt};
use tests::{assert_matches_reference, reference_run, tiny_gpt_run};

const STEPS: usize = 10;
/// fp16 (fused, WGPU) against fp32, worst relative loss difference over 20 steps: 4.5 times
/// the measured 2.2e-5.
#[cfg(feature = "wgpu")]
const FP16_LOSS_TOL: f64 = 1e-4;
/// fp16 (fused, WGPU) against fp32, final parameters ([`tests::compare_params`]'s measure):
/// 3.7 times the measured 5.4e-4 (at `wte.weight`).
#[cfg(feature = "wgpu")]
const FP16_PARAM_TOL: f64 = 2e-3;

fn llama_like() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.positions = PositionKind::Rotary;
    c.model.mlp = MlpKind::SwiGlu;
    c.model.norm = NormKind::RmsNorm;
    c.model.bias = false;
    c
}

/// The GPT of `config` with the fused kernels, trained on one rank on `device`.
fn train_fused(config: &TrainConfig, device: TrainDevice) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let mut config = config.clone();
    config.model.fused = true;
    config.device = device;
    run_local(1, |g| {
        train_gpt(&g, &config, &Default::default(), &corpus, &mut |_| {})
    })
    .expect("training")
    .swap_remove(0)
}

#[test]
fn fused_gpt_on_flex_matches_unfused() {
    for (name, config) in [
        ("gpt2-like", tiny_gpt_run(STEPS)),
        ("llama-like", llama_like()),
    ] {
        let reference = reference_run(&config);
        let fused = train_fused(&config, TrainDevice::Flex);
        assert_matches_reference(
            &reference,
            &fused.losses,
            &fused.final_params,
            1e-5,
            &format!("{name} fused on flex"),
        );
    }
}

/// The fused CPU kernels (blockwise attention on the local heads, one-pass norms and GELU)
/// under tensor, sequence and data parallelism and FSDP: the same single-device reference.
#[test]
fn fused_gpt_under_layouts_matches_unfused_single_device() {
    use burn_zero::Stage;
    use examples::train::Parallelism;
    let mut config = tiny_gpt_run(STEPS);
    let reference = reference_run(&config);
    config.model.fused = true;
    let tp = |tp, sp| Parallelism {
        tp,
        sp,
        ..Parallelism::default()
    };
    for (world, p, what) in [
        (2, Parallelism::default(), "fused dp 2"),
        (4, tp(2, true), "fused dp 2 x tp 2 + sp"),
        (
            4,
            Parallelism {
                zero: Some(Stage::Three),
                ..tp(2, true)
            },
            "fused FSDP 2 x tp 2 + sp",
        ),
    ] {
        tests::check_layout(&reference, world, p, &config, 1e-5, what);
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn fused_gpt_on_wgpu_matches_unfused_on_flex() {
    if tests::wgpu_or_skip("fused_gpt_on_wgpu_matches_unfused_on_flex").is_none() {
        return;
    }
    for (name, config) in [
        ("gpt2-like", tiny_gpt_run(STEPS)),
        ("llama-like", llama_like()),
    ] {
        let reference = reference_run(&config);
        let fused = train_fused(&config, TrainDevice::Wgpu);
        assert_matches_reference(
            &reference,
            &fused.losses,
            &fused.final_params,
            1e-4,
            &format!("{name} fused on wgpu"),
        );
    }
}

/// `gpt --device wgpu --precision fp16` with the fused kernels (f16 storage and products,
/// fp32 statistics, fp32 master weights, loss scaling) against the fp32 single-device
/// reference over 20 steps: losses and final parameters within [`FP16_LOSS_TOL`] and
/// [`FP16_PARAM_TOL`], and not equal to fp32's (the f16 compute copy really ran).
#[cfg(feature = "wgpu")]
#[test]
fn fused_fp16_on_wgpu_tracks_fp32() {
    if tests::wgpu_or_skip("fused_fp16_on_wgpu_tracks_fp32").is_none() {
        return;
    }
    let reference = reference_run(&tiny_gpt_run(20));
    let config = TrainConfig {
        precision: examples::train::Precision::Fp16,
        ..tiny_gpt_run(20)
    };
    let fp16 = train_fused(&config, TrainDevice::Wgpu);
    let loss_err = tests::max_relative_loss_diff(&fp16.losses, &reference.losses);
    let (param_err, worst) =
        tests::compare_params(&reference.params, &fp16.final_params, f64::INFINITY)
            .expect("the same parameters");
    assert!(
        loss_err < FP16_LOSS_TOL && param_err < FP16_PARAM_TOL,
        "fused fp16 on wgpu drifts from fp32: losses {loss_err:.2e} (tolerance \
         {FP16_LOSS_TOL:.0e}), parameters {param_err:.2e} at {worst} (tolerance \
         {FP16_PARAM_TOL:.0e}); losses {:?} against {:?}",
        fp16.losses,
        reference.losses
    );
    assert!(
        loss_err > 0.0,
        "fp16 gave fp32's losses: the compute copy was not used"
    );
}
