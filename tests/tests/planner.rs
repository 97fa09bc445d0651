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
use burn_parallel::planner::{
    Checkpoint, Hardware, Layout, ModelShape, Schedule, Training, count_params, evaluate,
};
use burn_parallel::{DeviceMesh, ParallelDims, run_local};
use burn_zero::{ShardGroups, Stage, ZeroConfig};
use examples::data::Corpus;
use examples::gpt::{Gpt, GptConfig, MlpKind, NormKind, PositionKind};
use examples::train_zero::{ZeroRunOptions, train_gpt_zero};
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
        let (groups, stage) = match dp {
            Dp::Ddp => {
                let mesh =
                    DeviceMesh::new(&world, &[("dp_replicate", n), ("dp_shard", 1)]).expect("mesh");
                (ShardGroups::hybrid(&mesh).expect("groups"), Stage::One)
            }
            Dp::Zero(stage) => (ShardGroups::flat(world), stage),
        };
        train_gpt_zero(
            &groups,
            &config,
            &ZeroConfig::new(stage),
            &corpus,
            &ZeroRunOptions::default(),
        )
        .map_err(|e| burn_parallel::CollectiveError::InvalidArgument {
            rank: 0,
            op: "train_gpt_zero".into(),
            reason: e.to_string(),
        })
    })
    .expect("training");
    let peak = |f: fn(&burn_zero::MemoryReport) -> usize| {
        reports.iter().map(|r| f(&r.memory)).max().unwrap_or(0)
    };
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
