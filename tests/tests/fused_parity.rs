//! The fused kernels inside the reference GPT.
//!
//! - Always: GPT with `fused` on flex (the composed references with hand-written backward
//!   steps) reproduces the unfused GPT on flex over 10 steps (relative difference <= 1e-5).
//! - Feature `wgpu`: GPT with `fused` on WGPU (the CubeCL kernels) reproduces the unfused GPT on
//!   flex over 10 steps within 1e-4 relative, for the GPT-2 style model (LayerNorm, GELU,
//!   learned positions) and the LLaMA style one (RMSNorm, SwiGLU, rotary). Skipped with a
//!   notice when no adapter exists, unless `BURN_PARALLEL_REQUIRE_WGPU=1`.

use burn_parallel::run_local;
use examples::data::Corpus;
use examples::gpt::{MlpKind, NormKind, PositionKind};
use examples::train::{TrainConfig, TrainDevice, train_gpt_on};
use tests::{assert_same_losses, tiny_gpt_run};

const STEPS: usize = 10;

fn llama_like() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.positions = PositionKind::Rotary;
    c.model.mlp = MlpKind::SwiGlu;
    c.model.norm = NormKind::RmsNorm;
    c.model.bias = false;
    c
}

fn losses(config: &TrainConfig, fused: bool, device: TrainDevice) -> Vec<f64> {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let mut config = config.clone();
    config.model.fused = fused;
    run_local(1, |g| {
        train_gpt_on(&g, &config, device, &corpus, &mut |_| {})
    })
    .expect("training")
    .swap_remove(0)
    .losses
}

#[test]
fn fused_gpt_on_flex_matches_unfused() {
    for (name, config) in [
        ("gpt2-like", tiny_gpt_run(STEPS)),
        ("llama-like", llama_like()),
    ] {
        let reference = losses(&config, false, TrainDevice::Flex);
        let fused = losses(&config, true, TrainDevice::Flex);
        assert_same_losses(&reference, &fused, 1e-5, &format!("{name} fused on flex"));
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn fused_gpt_on_wgpu_matches_unfused_on_flex() {
    if let Err(e) = burn_parallel::kernels::wgpu_device() {
        if std::env::var("BURN_PARALLEL_REQUIRE_WGPU").as_deref() == Ok("1") {
            panic!("BURN_PARALLEL_REQUIRE_WGPU=1 but {e}");
        }
        eprintln!("SKIPPED: {e} (set BURN_PARALLEL_REQUIRE_WGPU=1 to fail instead)");
        return;
    }
    for (name, config) in [
        ("gpt2-like", tiny_gpt_run(STEPS)),
        ("llama-like", llama_like()),
    ] {
        let reference = losses(&config, false, TrainDevice::Flex);
        let fused = losses(&config, true, TrainDevice::Wgpu);
        assert_same_losses(&reference, &fused, 1e-4, &format!("{name} fused on wgpu"));
    }
}
