//! The bundled GPT under context parallelism reproduces single-device training: 20 steps at
//! cp = 2 and 4, ring and Ulysses, with and without head-tail balancing, cp x dp, cp x tp and
//! FSDP over dp_shard x cp, give the losses of the independent plain-Burn
//! [`tests::reference_run`] on the same global batch (relative difference <= 1e-5) and its final
//! parameters. The LLaMA-like variant checks rotary positions at global, not local, positions.
//! Impossible splits are clear errors.

use std::collections::HashMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::context_parallel::{ContextParallel, CpBalance, CpKind, CpSettings};
use burn_parallel::run_local;
use burn_parallel_train::load_named;
use burn_zero::Stage;
use examples::gpt::{Gpt, MlpKind, NormKind, PositionKind};
use examples::train::{Parallelism, TrainConfig};
use tests::{
    Reference, assert_matches_reference, gpt_through_burnrun, params_of, reference_run,
    tiny_gpt_run,
};

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

/// The tiny GPT with 4 heads (Ulysses at cp 4, and cp 2 x tp 2) over 16 tokens.
fn config() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.n_heads = 4;
    c
}

/// Rotary positions, SwiGLU, RMSNorm, tied embeddings, no biases.
fn llama_like() -> TrainConfig {
    let mut c = config();
    c.model.positions = PositionKind::Rotary;
    c.model.mlp = MlpKind::SwiGlu;
    c.model.norm = NormKind::RmsNorm;
    c.model.tied_embeddings = true;
    c.model.bias = false;
    c
}

fn cp(cp: usize, kind: CpKind, balance: CpBalance) -> Parallelism {
    Parallelism {
        cp,
        cp_kind: kind,
        cp_balance: balance,
        ..Parallelism::default()
    }
}

fn check(reference: &Reference, world: usize, p: Parallelism, config: &TrainConfig, what: &str) {
    tests::check_layout(reference, world, p, config, TOL, what);
}

#[test]
fn gpt_ring_attention_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0] - 0.5,
        "the model must learn: {:?}",
        reference.losses
    );
    let ring = |n, balance| cp(n, CpKind::Ring, balance);
    check(
        &reference,
        2,
        ring(2, CpBalance::HeadTail),
        &config,
        "ring cp 2 headtail",
    );
    check(
        &reference,
        4,
        ring(4, CpBalance::HeadTail),
        &config,
        "ring cp 4 headtail",
    );
    check(
        &reference,
        2,
        ring(2, CpBalance::None),
        &config,
        "ring cp 2 none",
    );
    check(
        &reference,
        4,
        ring(4, CpBalance::None),
        &config,
        "ring cp 4 none",
    );
}

#[test]
fn gpt_ulysses_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    let ulysses = |n, balance| cp(n, CpKind::Ulysses, balance);
    check(
        &reference,
        2,
        ulysses(2, CpBalance::HeadTail),
        &config,
        "ulysses cp 2 headtail",
    );
    check(
        &reference,
        4,
        ulysses(4, CpBalance::HeadTail),
        &config,
        "ulysses cp 4 headtail",
    );
    check(
        &reference,
        4,
        ulysses(4, CpBalance::None),
        &config,
        "ulysses cp 4 none",
    );
}

/// The path an NCCL job takes on CUDA (`ProcessGroup::with_tensor_path`; here each collective
/// stages through host memory): the ring's rotations as `ProcessGroup::send_recv` exchanges and
/// its backward on the gradient tensor, Ulysses' all-to-alls on tensors, against single-device
/// training.
#[test]
fn gpt_cp_on_the_tensor_path_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    let cases = [
        (
            cp(4, CpKind::Ring, CpBalance::HeadTail),
            "ring cp 4 headtail, tensor path",
        ),
        (
            cp(2, CpKind::Ring, CpBalance::None),
            "ring cp 2, tensor path",
        ),
        (
            cp(4, CpKind::Ulysses, CpBalance::None),
            "ulysses cp 4, tensor path",
        ),
    ];
    for (p, what) in cases {
        let world = p.cp;
        tests::check_layout_on(&reference, world, p, &config, TOL, what, true);
    }
}

#[test]
fn gpt_cp_x_dp_and_cp_x_tp_match_single_device() {
    let config = config();
    let reference = reference_run(&config);
    for kind in [CpKind::Ring, CpKind::Ulysses] {
        let p = cp(2, kind, CpBalance::HeadTail);
        check(&reference, 4, p, &config, &format!("dp 2 x {kind} cp 2"));
        let tp = Parallelism { tp: 2, ..p };
        check(&reference, 4, tp, &config, &format!("{kind} cp 2 x tp 2"));
        let sp = Parallelism { sp: true, ..tp };
        check(
            &reference,
            4,
            sp,
            &config,
            &format!("{kind} cp 2 x tp 2 + sp"),
        );
    }
    let fsdp = Parallelism {
        zero: Some(Stage::Three),
        ..cp(2, CpKind::Ring, CpBalance::HeadTail)
    };
    check(
        &reference,
        4,
        fsdp,
        &config,
        "FSDP over dp_shard 2 x ring cp 2",
    );
}

/// Rotary tables at each token's global position (head-tail chunks are not contiguous).
#[test]
fn llama_like_gpt_with_rotary_positions_matches_single_device() {
    let config = llama_like();
    let reference = reference_run(&config);
    check(
        &reference,
        4,
        cp(4, CpKind::Ring, CpBalance::HeadTail),
        &config,
        "rotary, ring cp 4 headtail",
    );
    check(
        &reference,
        2,
        cp(2, CpKind::Ulysses, CpBalance::HeadTail),
        &config,
        "rotary, ulysses cp 2 headtail",
    );
}

#[test]
fn impossible_context_parallel_splits_are_clear_errors() {
    let config = config();
    let validate =
        |p: Parallelism, c: &TrainConfig, world| c.validate_layout(&p, world).unwrap_err();
    // 16 tokens over 2 x 3 head-tail chunks.
    let e = validate(cp(3, CpKind::Ring, CpBalance::HeadTail), &config, 3);
    assert!(e.contains("multiple of 6"), "{e}");
    // 4 heads over 3 Ulysses ranks (and 16 tokens over 3 contiguous chunks).
    let mut c48 = config.clone();
    c48.seq_len = 12;
    let e = validate(cp(3, CpKind::Ulysses, CpBalance::None), &c48, 3);
    assert!(e.contains("Ulysses"), "{e}");
    let mut dropout = config.clone();
    dropout.model.dropout = 0.1;
    let e = validate(cp(2, CpKind::Ring, CpBalance::HeadTail), &dropout, 2);
    assert!(e.contains("dropout"), "{e}");
    let e = validate(cp(2, CpKind::Ring, CpBalance::HeadTail), &config, 3);
    assert!(e.contains("cp 2"), "{e}");
}

/// With the query and key weights scaled up, attention is sharp, so that positions (and the
/// mask) change the logits a lot: each rank's logits under context parallelism equal the rows
/// of its tokens in the single-device logits, for learned and rotary positions.
#[test]
fn sharp_attention_logits_match_single_device() {
    for base in [config(), llama_like()] {
        let model_config = base.model.clone();
        let device = Device::flex();
        let single = Gpt::new(&model_config, &device);
        let params: HashMap<String, TensorData> = params_of(&single)
            .into_iter()
            .map(|(path, (shape, values))| {
                let sharp = path.ends_with("attn.q.weight") || path.ends_with("attn.k.weight");
                let scale = if sharp { 40.0 } else { 1.0 };
                let values: Vec<f32> = values.iter().map(|v| v * scale).collect();
                (path, TensorData::new(values, shape))
            })
            .collect();
        let single = load_named(single, &params);
        let (b, s) = (2, 16);
        let ids: Vec<i64> = (0..(b * s) as i64).map(|i| (i * 53 + 7) % 256).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, s]), &device);
        let expected = single.forward(tokens.clone()).unwrap();
        for kind in [CpKind::Ring, CpKind::Ulysses] {
            for balance in [CpBalance::HeadTail, CpBalance::None] {
                run_local(4, |group| {
                    let ctx = ContextParallel::new(&group, CpSettings { kind, balance }).unwrap();
                    let layout = ctx.layout(s).unwrap();
                    let model = load_named(Gpt::new(&model_config, &device), &params)
                        .with_context_parallel(ctx)
                        .unwrap();
                    let got = model.forward(tokens.clone()).unwrap();
                    let want = layout.local(expected.clone(), 1).unwrap();
                    let (got, want) = (
                        got.into_data().try_to_vec::<f32>().unwrap(),
                        want.into_data().try_to_vec::<f32>().unwrap(),
                    );
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                        .fold(0.0f32, f32::max);
                    assert!(
                        worst < 1e-5,
                        "{:?} {kind} {balance}: worst logit error {worst:.2e}",
                        model_config.positions
                    );
                    Ok(())
                })
                .unwrap();
            }
        }
    }
}

/// `gpt --cp 2` (ring, head-tail) and `gpt --cp 2 --cp-kind ulysses` as 2 TCP processes through
/// `burnrun` match single-device training.
#[test]
fn gpt_binary_cp_over_tcp_processes_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    for flags in [
        &["--cp", "2"][..],
        &["--cp", "2", "--cp-kind", "ulysses", "--cp-balance", "none"][..],
    ] {
        let tcp = gpt_through_burnrun(2, &config, flags);
        let what = format!("gpt {}, 2 tcp processes", flags.join(" "));
        assert_matches_reference(&reference, &tcp.losses, &tcp.params, 1e-5, &what);
    }
}

/// Ring (head-tail) and Ulysses at cp 2 on WGPU (Mesa's software Vulkan driver in CI) match
/// single-device training on WGPU. Skipped, visibly, without an adapter.
#[cfg(feature = "wgpu")]
#[test]
fn gpt_cp_on_wgpu_matches_single_device() {
    use examples::train::TrainDevice;
    if tests::wgpu_or_skip("gpt_cp_on_wgpu_matches_single_device").is_none() {
        return;
    }
    let config = TrainConfig {
        device: TrainDevice::Wgpu,
        ..config()
    };
    let reference = Reference::of_run(tests::train_layout(1, &Parallelism::default(), &config));
    let ring = cp(2, CpKind::Ring, CpBalance::HeadTail);
    check(&reference, 2, ring, &config, "wgpu ring cp 2, head-tail");
    let ulysses = cp(2, CpKind::Ulysses, CpBalance::None);
    check(&reference, 2, ulysses, &config, "wgpu Ulysses cp 2");
}
