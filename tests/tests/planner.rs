//! The memory planner (`burn_parallel::planner`) against the real engines and models:
//!
//! - the model state it predicts per rank (parameters + gradients + optimizer state) for the
//!   bundled tiny GPT under DDP and ZeRO-1/2/3 at N = 2 and 4, against what burn-zero holds
//!   while it trains that GPT (its [`burn_zero::MemoryReport`], the accounting that
//!   `burn-zero/tests/memory.rs` checks against a counting allocator);
//! - the parameter count of a [`ModelShape`] against `GptConfig::num_params` and against a
//!   module visitor over the built GPT, for dense, tied, SwiGLU/rotary/RMSNorm and MoE
//!   configurations.

use burn::tensor::Device;
use burn_moe::{ExpertKind, MoeConfig};
use burn_parallel::ParallelDims;
use burn_parallel::planner::{
    Checkpoint, Hardware, Layout, ModelShape, Schedule, Training, count_params, evaluate,
};
use burn_parallel_train::run_local;
use burn_zero::Stage;
use examples::data::Corpus;
use examples::gpt::{Gpt, GptConfig, MlpKind, NormKind, PositionKind};
use examples::train::{Parallelism, train_gpt};
use tests::tiny_gpt_run;

/// The planner's shape of a GPT configuration of `examples`.
fn shape_of(c: &GptConfig) -> ModelShape {
    c.planner_shape()
}

#[test]
fn shape_counts_the_parameters_of_the_gpt() {
    let dense = GptConfig::new(256, 3, 4, 64, 32);
    let tied = GptConfig {
        tied_embeddings: true,
        ..dense.clone()
    };
    let llama = GptConfig {
        mlp: MlpKind::SwiGlu,
        positions: PositionKind::Rotary,
        norm: NormKind::RmsNorm,
        bias: false,
        d_ff: 96,
        ..dense.clone()
    };
    let moe = GptConfig {
        n_layers: 4,
        moe: Some(MoeConfig {
            expert: ExpertKind::SwiGlu,
            n_shared: 1,
            ..MoeConfig::new(64, 48, 8, 2)
        }),
        moe_every: 2,
        ..dense.clone()
    };
    let device = Device::flex();
    for (name, config) in [
        ("dense", dense),
        ("tied", tied),
        ("swiglu", llama),
        ("moe", moe),
    ] {
        let shape = shape_of(&config);
        let gpt = Gpt::new(&config, &device);
        let visited = count_params(&gpt).total;
        println!(
            "{name}: shape {} config {} module {visited}",
            shape.num_params(),
            config.num_params()
        );
        assert_eq!(shape.num_params(), config.num_params(), "{name}");
        assert_eq!(shape.num_params(), visited, "{name}");
        assert_eq!(shape.active_params(), config.active_params(), "{name}");
    }
}

/// Which data-parallel layout a row measures.
#[derive(Debug, Clone, Copy)]
enum Dp {
    /// DDP: `dp_replicate = N`, no sharding (burn-zero with a shard group of one rank keeps
    /// full parameters, gradients and optimizer state, as DDP does).
    Ddp,
    /// ZeRO stage over `dp_shard = N`.
    Zero(Stage),
}

/// Largest per-rank `(params, grads, optimizer)` peak over the last of 2 training steps.
fn measured(dp: Dp, n: usize) -> (usize, usize, usize) {
    let config = tiny_gpt_run(2);
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = run_local(n, |world| {
        // DDP's footprint: ZeRO-1 over shard groups of one rank (no sharding), replicated
        // across every rank.
        let (zero, replicate) = match dp {
            Dp::Ddp => (Stage::One, n),
            Dp::Zero(stage) => (stage, 1),
        };
        let parallel = Parallelism {
            zero: Some(zero),
            replicate,
            ..Parallelism::default()
        };
        let report = train_gpt(&world, &config, &parallel, &corpus, &mut |_| {})?;
        Ok(report.memory.expect("ZeRO and FSDP report their memory"))
    })
    .expect("training");
    let peak = |f: fn(&burn_zero::MemoryReport) -> usize| reports.iter().map(f).max().unwrap_or(0);
    (
        peak(|m| m.peak.params),
        peak(|m| m.peak.grads),
        peak(|m| m.peak.optimizer),
    )
}

/// Predicted per-rank `(params, grads, optimizer)` bytes of `dp` at `n` ranks, fp32 AdamW.
fn predicted(dp: Dp, n: usize) -> (f64, f64, f64) {
    let run = tiny_gpt_run(2);
    let shape = shape_of(&run.model);
    let training = Training {
        micro_batch: run.batch_size / n,
        mixed_precision: false,
        optimizer_bytes: 8,
        ..Training::new(n, run.batch_size, run.seq_len)
    };
    let (dims, zero) = match dp {
        Dp::Ddp => (
            ParallelDims {
                dp_replicate: n,
                ..ParallelDims::default()
            },
            0,
        ),
        Dp::Zero(stage) => (
            ParallelDims {
                dp_shard: n,
                ..ParallelDims::default()
            },
            stage.number() as u8,
        ),
    };
    let layout = Layout {
        dims,
        zero,
        sp: false,
        schedule: Schedule::None,
        micro_batches: 1,
        checkpoint: Checkpoint::None,
    };
    let hw = Hardware::from_units(1.0, 1.0, 1.0);
    let c = evaluate(&shape, &training, &hw, &layout).expect("a valid layout");
    (c.memory.params, c.memory.grads, c.memory.optimizer)
}

/// Tolerance 1% on each part and on the sum. The prediction is `P / N` per shard; burn-zero
/// shards each flat unit (stage 3: the embeddings, each block, the head) and gives the first
/// ranks one element more when `N` does not divide the unit, so the largest rank holds at
/// most one element per unit more than `P / N` (a few bytes against tens of kilobytes here).
/// Any real modelling error is far outside it: a full gradient kept at stage 2 is `+4P`, an
/// unsharded optimizer state `+8P (N - 1) / N`, parameters kept whole at stage 3 `+4P (N - 1)
/// / N` (each at least +25% of the model state at N = 2).
#[test]
fn predicted_model_state_matches_burn_zero_under_ddp_and_zero() {
    let mut failures = Vec::new();
    println!("| layout | N | part | predicted (B) | measured (B) | ratio |");
    println!("|---|---|---|---|---|---|");
    for n in [2usize, 4] {
        for dp in [
            Dp::Ddp,
            Dp::Zero(Stage::One),
            Dp::Zero(Stage::Two),
            Dp::Zero(Stage::Three),
        ] {
            let (mp, mg, mo) = measured(dp, n);
            let (pp, pg, po) = predicted(dp, n);
            let parts = [
                ("params", pp, mp),
                ("grads", pg, mg),
                ("optimizer", po, mo),
                ("model state", pp + pg + po, mp + mg + mo),
            ];
            for (part, p, m) in parts {
                let ratio = m as f64 / p;
                println!("| {dp:?} | {n} | {part} | {p:.0} | {m} | {ratio:.4} |");
                if (ratio - 1.0).abs() > 0.01 {
                    failures.push(format!(
                        "{dp:?} N={n} {part}: predicted {p:.0} bytes, measured {m}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The fp32 per-tensor derivation of `burn_parallel::planner::activation` for the GPT of
/// `examples` (d 128, 4 heads, f 512, vocabulary 256, 16 sequences of 128 tokens), counted by
/// hand, tensor by tensor, from what each op of the block keeps for Burn's backward; and the
/// peak `evaluate` builds from it on one rank.
#[test]
fn fp32_activations_follow_the_tensors_autodiff_keeps() {
    use burn_parallel::planner::Attention;
    use burn_parallel::planner::activation::{self, Kernels, MicroBatch};

    let model = GptConfig::new(256, 4, 4, 128, 128);
    let shape = shape_of(&model);
    let (b, s, d, f, a, v) = (16.0, 128.0, 128.0, 512.0, 4.0, 256.0);
    let n = b * s;
    let mb = |tp, sp| MicroBatch {
        sequences: 16,
        local_tokens: 128,
        key_tokens: 128,
        tp,
        sp,
    };
    let flash = Kernels {
        attention: Attention::Flash,
        fused: true,
        dropout: false,
    };
    // Fused norms keep their inputs x and x + attn (2 N d) and mean, 1/std (4 N); q/k/v keep
    // ln_1's output, up keeps ln_2's (2 N d); flash attention keeps copies of Q, K, V, its
    // output (4 N d) and the log-sum-exp (b a s); o keeps its input (N d); the MLP keeps up's
    // and the GELU's outputs (2 N f).
    let by_hand =
        4.0 * (2.0 * n * d + 4.0 * n + 2.0 * n * d + 4.0 * n * d + b * a * s + n * d + 2.0 * n * f);
    assert_eq!(
        activation::fp32_layer_bytes(&shape, None, &mb(1, false), &flash),
        by_hand
    );

    // Tensor parallel over 2: the norms and the matmul inputs stay whole, the rest halves.
    let tp2 = 4.0
        * (2.0 * n * d
            + 4.0 * n
            + 2.0 * n * d
            + (4.0 * n * d + b * a * s + n * d + 2.0 * n * f) / 2.0);
    assert_eq!(
        activation::fp32_layer_bytes(&shape, None, &mb(2, false), &flash),
        tp2
    );
    // Sequence parallelism: the norms' part halves, and q/k/v and up keep only the sequence
    // shard of their input (gathered once per sub-layer, again in the backward): everything
    // halves.
    let sp2 = 4.0
        * ((2.0 * n * d + 4.0 * n) / 2.0
            + 2.0 * n * d / 2.0
            + (4.0 * n * d + b * a * s + n * d + 2.0 * n * f) / 2.0);
    assert_eq!(sp2, by_hand / 2.0);
    assert_eq!(
        activation::fp32_layer_bytes(&shape, None, &mb(2, true), &flash),
        sp2
    );

    // Burn's composed norms keep the centred and the normalised input (4 N d); materialised
    // attention keeps the q, k, v outputs (3 N d) and three b a s^2 tensors (shifted scores,
    // exp, probabilities), plus the causal mask's s^2 bytes.
    let composed = Kernels {
        attention: Attention::Materialized,
        fused: false,
        dropout: false,
    };
    let materialized = 4.0
        * (4.0 * n * d
            + 4.0 * n
            + 2.0 * n * d
            + 3.0 * n * d
            + 3.0 * b * a * s * s
            + n * d
            + 2.0 * n * f)
        + s * s;
    assert_eq!(
        activation::fp32_layer_bytes(&shape, None, &mb(1, false), &composed),
        materialized
    );
    // Dropout adds the fp32 masks of the probabilities and of the two residual branches.
    let dropout = Kernels {
        dropout: true,
        ..composed
    };
    assert_eq!(
        activation::fp32_layer_bytes(&shape, None, &mb(1, false), &dropout),
        materialized + 4.0 * (b * a * s * s + 2.0 * n * d)
    );

    // One rank, the whole model: parameters and AdamW's two moments (12 bytes per parameter)
    // stay; at the start of the backward every activation is live (4 layers, ln_f's input and
    // output, the logits and their log-sum-exp, token ids and targets at 8 bytes) and the
    // fused cross-entropy allocates the logits' gradient. The gradients come after the
    // activations are released, so they are not part of the peak.
    let training = Training {
        micro_batch: 16,
        mixed_precision: false,
        attention: Attention::Flash,
        dropout: false,
        fused: true,
        ..Training::new(1, 16, 128)
    };
    let single = Layout {
        dims: ParallelDims::default(),
        zero: 0,
        sp: false,
        schedule: Schedule::None,
        micro_batches: 1,
        checkpoint: Checkpoint::None,
    };
    let c = evaluate(
        &shape,
        &training,
        &Hardware::from_units(1.0, 1.0, 1.0),
        &single,
    )
    .expect("a valid layout");
    let p = model.num_params() as f64;
    let head = 4.0 * (n * d + 2.0 * n + n * d + n * v + n) + 8.0 * n;
    let embedding = 8.0 * n;
    assert_eq!(c.memory.activations, 4.0 * by_hand + head + embedding);
    assert_eq!(c.memory.transient, 4.0 * n * v);
    assert_eq!(
        c.memory.total(),
        12.0 * p + 4.0 * by_hand + head + embedding + 4.0 * n * v
    );
}
