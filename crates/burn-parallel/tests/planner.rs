//! The memory and FLOPs planner: activation formulas against hand computations, the
//! feasibility reasons, typed errors for impossible inputs, and the ranking.
//!
//! (The model-state prediction against burn-zero's measured memory, and the parameter count
//! against the GPT of `examples`, are in the workspace's `tests/tests/planner.rs`.)

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::Device;
use burn_parallel::ParallelDims;
use burn_parallel::planner::activation::{self, MicroBatch};
use burn_parallel::planner::{
    Checkpoint, Hardware, Layout, ModelShape, NormShape, PlanError, Rejection, Schedule, Training,
    count_params, evaluate, plan,
};

/// h = 1024, a = 16, s = 2048, b = 2: `s b h = 4,194,304`, `5 a s / h = 160`.
fn shape_1024() -> ModelShape {
    ModelShape::gpt(2, 1024, 16, 1000, 2048)
}

fn micro(tp: usize, sp: bool) -> MicroBatch {
    MicroBatch {
        sequences: 2,
        local_tokens: 2048,
        key_tokens: 2048,
        tp,
        sp,
    }
}

const SBH: f64 = 2048.0 * 2.0 * 1024.0;

#[test]
fn layer_activations_match_korthikanti_by_hand() {
    let shape = shape_1024();
    // No parallelism: s b h (34 + 5 a s / h) = 4,194,304 x 194.
    assert_eq!(
        activation::layer_bytes(&shape, None, &micro(1, false)),
        813_694_976.0
    );
    // tp 4: s b h (10 + 24 / 4 + 160 / 4) = 4,194,304 x 56.
    assert_eq!(
        activation::layer_bytes(&shape, None, &micro(4, false)),
        234_881_024.0
    );
    // tp 4 + sp: s b h (34 + 160) / 4.
    assert_eq!(
        activation::layer_bytes(&shape, None, &micro(4, true)),
        203_423_744.0
    );
    // Recomputation keeps the block input: 2 s b h, divided by t under sp only.
    assert_eq!(
        activation::checkpoint_bytes(&shape, &micro(4, false)),
        8_388_608.0
    );
    assert_eq!(
        activation::checkpoint_bytes(&shape, &micro(4, true)),
        2_097_152.0
    );
    // Grouped-query attention, 4 key/value heads of 16: K and V shrink from 4 to 1 per h,
    // 31 + 160 instead of 34 + 160.
    let gqa = ModelShape {
        kv_heads: 4,
        ..shape_1024()
    };
    assert_eq!(
        activation::layer_bytes(&gqa, None, &micro(1, false)),
        SBH * 191.0
    );
    // SwiGLU with d_ff = 4h: the MLP's inner term is 8 f / h = 32 instead of 16.
    let swiglu = ModelShape {
        gated_mlp: true,
        ..shape_1024()
    };
    assert_eq!(
        activation::layer_bytes(&swiglu, None, &micro(1, false)),
        SBH * (34.0 + 16.0 + 160.0)
    );
}

fn one_rank(layers: usize) -> (ModelShape, Training, Hardware) {
    let shape = ModelShape::gpt(layers, 1024, 16, 1000, 2048);
    let training = Training {
        micro_batch: 2,
        ..Training::new(1, 2, 2048)
    };
    (shape, training, Hardware::from_units(1000.0, 100.0, 10.0))
}

fn layout(dims: ParallelDims, schedule: Schedule, m: usize, checkpoint: Checkpoint) -> Layout {
    Layout {
        dims,
        zero: 0,
        sp: false,
        schedule,
        micro_batches: m,
        checkpoint,
    }
}

#[test]
fn a_layout_holds_the_layers_the_schedule_keeps() {
    // One rank, 2 layers, one micro-batch of 2 x 2048 tokens, mixed precision: two layers of
    // 813,694,976 bytes plus the fp32 logits and softmax, 8 s b V = 32,768,000.
    let (shape, training, hw) = one_rank(2);
    let single = layout(ParallelDims::default(), Schedule::None, 1, Checkpoint::None);
    let c = evaluate(&shape, &training, &hw, &single).unwrap();
    assert_eq!(c.memory.activations, 2.0 * 813_694_976.0 + 32_768_000.0);
    // Block recomputation: two block inputs, plus one block during its backward.
    let block = Layout {
        checkpoint: Checkpoint::Block,
        ..single
    };
    let c = evaluate(&shape, &training, &hw, &block).unwrap();
    assert_eq!(
        c.memory.activations,
        2.0 * 8_388_608.0 + 813_694_976.0 + 32_768_000.0
    );
    // fp32: the tensors this implementation keeps (`activation::fp32_*`, pinned by hand in
    // the workspace's `tests/tests/planner.rs`), not the 16-bit formula doubled.
    let fp32 = Training {
        mixed_precision: false,
        ..training
    };
    let c = evaluate(&shape, &fp32, &hw, &single).unwrap();
    let k = activation::Kernels {
        attention: fp32.attention,
        fused: fp32.fused,
        dropout: fp32.dropout,
    };
    let mb = micro(1, false);
    assert_eq!(
        c.memory.activations,
        2.0 * activation::fp32_layer_bytes(&shape, None, &mb, &k)
            + activation::fp32_head_bytes(&shape, &mb, &k, false).0
            + activation::fp32_embedding_bytes(&shape, &mb, &k)
    );

    // Pipeline of 2 stages of 2 layers, 4 micro-batches of 2 sequences. 1F1B: stage 0 holds
    // p - 0 = 2 micro-batches of its 2 layers; GPipe: all 4.
    let (shape, _, hw) = one_rank(4);
    let training = Training {
        micro_batch: 2,
        ..Training::new(2, 8, 2048)
    };
    let dims = ParallelDims {
        pp: 2,
        ..ParallelDims::default()
    };
    let layer = 813_694_976.0;
    let c = evaluate(
        &shape,
        &training,
        &hw,
        &layout(dims, Schedule::OneFOneB, 4, Checkpoint::None),
    )
    .unwrap();
    assert_eq!(c.memory.stage, 0);
    assert_eq!(c.memory.activations, 2.0 * 2.0 * layer);
    let c = evaluate(
        &shape,
        &training,
        &hw,
        &layout(dims, Schedule::GPipe, 4, Checkpoint::None),
    )
    .unwrap();
    // GPipe: the last stage holds 4 micro-batches of its 2 layers and of the logits.
    assert_eq!(c.memory.stage, 1);
    assert_eq!(c.memory.activations, 4.0 * (2.0 * layer + 32_768_000.0));
}

fn reasons(shape: &ModelShape, training: &Training, hw: &Hardware) -> Vec<String> {
    plan(shape, training, hw)
        .unwrap()
        .rejected
        .iter()
        .map(|r| r.reason.to_string())
        .collect()
}

#[test]
fn infeasible_layouts_say_which_constraint_failed() {
    let hw = Hardware::from_units(64.0, 100.0, 25.0);
    // World 6, 16 heads: tp 3 and tp 6 cannot split the heads.
    let shape = ModelShape::gpt(12, 1024, 16, 1024, 512);
    let r = reasons(&shape, &Training::new(6, 12, 512), &hw);
    assert!(
        r.contains(&"tp 3 does not divide 16 heads".to_string()),
        "{r:#?}"
    );
    assert!(
        r.contains(&"tp 6 does not divide 16 heads".to_string()),
        "{r:#?}"
    );
    // 12 layers cannot be cut into 4 pipeline stages of 2 chunks.
    let r = reasons(&shape, &Training::new(4, 8, 512), &hw);
    assert!(
        r.contains(&"pp 4 x 2 chunks of zbv does not divide 12 layers".to_string()),
        "{r:#?}"
    );
    // A global batch of 6 sequences cannot be split over 4 data-parallel ranks.
    let r = reasons(&shape, &Training::new(4, 6, 512), &hw);
    assert!(
        r.contains(
            &"dp 4 (replicate 4 x shard 1) does not divide the global batch of 6 sequences"
                .to_string()
        ),
        "{r:#?}"
    );
    // Memory too small: 1.3 B parameters on one 8 GiB device, mixed precision: the optimizer
    // state alone (12 bytes per parameter) is 14.7 GiB.
    let big = ModelShape::gpt(24, 2048, 16, 50304, 2048);
    let p = plan(
        &big,
        &Training::new(1, 1, 2048),
        &Hardware::from_units(8.0, 100.0, 25.0),
    )
    .unwrap();
    assert!(p.fitting.is_empty());
    let optimizer_gib = 12.0 * big.num_params() as f64 / (1u64 << 30) as f64;
    let first = &p.rejected[0];
    assert!(matches!(first.reason, Rejection::Memory { .. }));
    let text = first.reason.to_string();
    assert!(
        text.starts_with("needs ")
            && text.contains(&format!("optimizer state {optimizer_gib:.2} GiB (ZeRO 0)"))
            && text.contains("> 8.00 GiB"),
        "{text}"
    );
}

#[test]
fn impossible_inputs_are_typed_errors() {
    let hw = Hardware::from_units(16.0, 100.0, 25.0);
    let training = Training::new(4, 8, 128);
    let bad_heads = ModelShape::gpt(2, 100, 3, 256, 128);
    assert!(matches!(
        plan(&bad_heads, &training, &hw),
        Err(PlanError::Shape { field: "heads", .. })
    ));
    let bad_kv = ModelShape {
        kv_heads: 3,
        ..ModelShape::gpt(2, 128, 4, 256, 128)
    };
    assert!(matches!(
        plan(&bad_kv, &training, &hw),
        Err(PlanError::Shape {
            field: "kv_heads",
            ..
        })
    ));
    let shape = ModelShape::gpt(2, 128, 4, 256, 128);
    assert!(matches!(
        plan(&shape, &Training::new(0, 8, 128), &hw),
        Err(PlanError::Training { field: "world", .. })
    ));
    let no_memory = Hardware {
        memory_bytes: 0,
        ..hw
    };
    assert!(matches!(
        plan(&shape, &training, &no_memory),
        Err(PlanError::Hardware {
            field: "memory_bytes",
            ..
        })
    ));
    let nan = Hardware {
        flops_per_s: f64::NAN,
        ..hw
    };
    assert!(matches!(
        plan(&shape, &training, &nan),
        Err(PlanError::Hardware {
            field: "flops_per_s",
            ..
        })
    ));
    // A layout that does not suit the model, asked for by hand.
    let tp3 = Layout {
        dims: ParallelDims {
            dp_replicate: 1,
            tp: 3,
            ..ParallelDims::default()
        },
        zero: 0,
        sp: false,
        schedule: Schedule::None,
        micro_batches: 8,
        checkpoint: Checkpoint::None,
    };
    let err = evaluate(&shape, &Training::new(3, 8, 128), &hw, &tp3).unwrap_err();
    assert_eq!(
        err.to_string(),
        "training: layout tp 3 does not divide 4 heads"
    );
}

#[test]
fn zero3_ranks_first_when_only_it_fits() {
    // 7 layers (no pipeline split of 4 ranks divides them), 1 head (no tensor parallelism),
    // mixed precision: DDP needs 16 P, ZeRO-1 7 P, ZeRO-2 5.5 P plus two 25 MB buckets, ZeRO-3
    // 4 P + a gathered block and its gradient (about 0.6 P here) per rank. Give 5 P. (In the
    // fp32 model of this implementation ZeRO-3 keeps every gathered unit for the backward, so
    // it would not win there.)
    let shape = ModelShape {
        d_ff: 2048,
        ..ModelShape::gpt(7, 512, 1, 256, 8)
    };
    let training = Training::new(4, 4, 8);
    let p = shape.num_params() as f64;
    let hw = Hardware {
        memory_bytes: (5.0 * p) as u64,
        flops_per_s: 1e12,
        link_bytes_per_s: 1e9,
    };
    let result = plan(&shape, &training, &hw).unwrap();
    let best = result.best().expect("ZeRO-3 fits");
    assert_eq!(best.layout.zero, 3, "{}", best.layout);
    assert!(result.fitting.iter().all(|c| c.layout.zero == 3));
    for zero in 0..3 {
        assert!(
            result.rejected.iter().any(|r| matches!(
                r.reason,
                Rejection::Memory { zero: z, .. } if z == zero
            )),
            "ZeRO {zero} should be rejected for memory"
        );
    }
    // Ranked by predicted step time.
    assert!(
        result
            .fitting
            .windows(2)
            .all(|w| w[0].step_seconds <= w[1].step_seconds)
    );
    // With ample memory, a faster layout than every ZeRO-3 one wins.
    let roomy = Hardware {
        memory_bytes: 1 << 40,
        ..hw
    };
    let result = plan(&shape, &training, &roomy).unwrap();
    assert_ne!(result.best().unwrap().layout.zero, 3);
}

#[test]
fn shape_counts_parameters_like_a_module_built_from_it() {
    // A one-block GPT built from Burn's own layers: embeddings, q/k/v/o, a GELU MLP, two
    // LayerNorms, the final norm and the head.
    #[derive(Module, Debug)]
    struct Tiny {
        wte: Embedding,
        wpe: Embedding,
        attn: Vec<Linear>,
        up: Linear,
        down: Linear,
        ln: Vec<LayerNorm>,
        head: Linear,
    }
    let (v, d, s) = (50, 16, 12);
    let device = Device::flex();
    let tiny = Tiny {
        wte: EmbeddingConfig::new(v, d).init(&device),
        wpe: EmbeddingConfig::new(s, d).init(&device),
        attn: (0..4)
            .map(|_| LinearConfig::new(d, d).init(&device))
            .collect(),
        up: LinearConfig::new(d, 4 * d).init(&device),
        down: LinearConfig::new(4 * d, d).init(&device),
        ln: (0..3)
            .map(|_| LayerNormConfig::new(d).init(&device))
            .collect(),
        head: LinearConfig::new(d, v).init(&device),
    };
    let shape = ModelShape::gpt(1, d, 2, v, s);
    let count = count_params(&tiny);
    assert_eq!(count.total, shape.num_params());
    assert_eq!(count.total, tiny.num_params());
    assert_eq!(count.largest, ("up.weight".to_string(), 4 * d * d));
    // RMSNorm, no biases, rotary, tied: the formula follows.
    let lean = ModelShape {
        norm: NormShape::RmsNorm,
        bias: false,
        position_table: 0,
        tied_embeddings: true,
        ..shape
    };
    assert_eq!(lean.num_params(), v * d + 12 * d * d + 3 * d);
}
