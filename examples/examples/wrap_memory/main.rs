//! Peak memory of building ("wrapping") the bring-your-own-model decoder under each layout at
//! N = 4 thread ranks, and of a training step (AdamW) under DDP, ZeRO-2, FSDP and FSDP x TP,
//! measured with a counting allocator, beside the single-device model size and the formulas.
//! With seeded sharded initialisation a rank creates only its shards: tensor parallelism and
//! FSDP never hold the whole model.
//!
//! ```text
//! cargo run --release -p examples --example wrap_memory
//! cargo run --release -p examples --example wrap_memory -- --quick   # a smaller decoder
//! ```
//!
//! The decoder has 4 layers of width 256 and a vocabulary of 8192; `--quick` measures one of 2
//! layers of width 64 and a vocabulary of 1024 instead.
//!
//! Ranks are threads of one process, so the allocator counts all of them together: the per-rank
//! figure is the process peak divided by 4 (the ranks are symmetric).

#[path = "../byo_model/model.rs"]
#[allow(dead_code)]
mod model;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::init::Init;
use burn_parallel::train::TrainStep;
use burn_parallel::{ParallelDims, run_local};
use burn_zero::memory::CountingAllocator;
use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
use model::{Config, Decoder, fsdp_plan, tp_plan};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// The measured decoder: the full one, or the small one of `--quick`.
fn decoder_config(quick: bool) -> Config {
    if quick {
        Config {
            vocab: 1024,
            d_model: 64,
            n_heads: 4,
            d_ff: 256,
            n_layers: 2,
            seed: 1,
        }
    } else {
        Config {
            vocab: 8192,
            d_model: 256,
            n_heads: 8,
            d_ff: 1024,
            n_layers: 4,
            seed: 1,
        }
    }
}

/// Process peak (bytes) while every rank builds the model `config` under `dims`, and the
/// parameters a rank holds.
fn wrap_peak(dims: ParallelDims, config: Config) -> (usize, usize) {
    let before = ALLOC.reset_peak();
    let params = run_local(dims.world_size(), move |world| {
        let mesh = dims.build(&world).expect("mesh");
        let init = Init::new(config.seed, &Device::flex())
            .with_tp(mesh.group("tp").expect("tp"), tp_plan(false))
            .expect("plan");
        let fsdp = fsdp_plan(mesh.group("dp_shard").expect("dp_shard"));
        let model = Decoder::new(&init, Some(&fsdp), &config).expect("model");
        world.barrier()?;
        Ok(model.num_params())
    })
    .expect("ranks");
    (ALLOC.peak() - before, params[0])
}

/// Sequences per rank and tokens per sequence of the measured steps.
const BATCH: usize = 2;
const SEQ: usize = 32;

/// How the step's gradients are reduced and the optimizer stepped.
#[derive(Clone, Copy)]
enum Step {
    /// The library's `TrainStep` (DDP, FSDP, FSDP x TP).
    Library,
    /// ZeRO-2's sharded optimizer over the data-parallel ranks.
    Zero2,
}

/// Process peak (bytes) over two training steps of the model `config` under `dims` (the model
/// built and the peak reset before the first step; AdamW's state exists from the first step on).
fn step_peak(dims: ParallelDims, kind: Step, config: Config) -> usize {
    let start = std::sync::Barrier::new(dims.world_size());
    let before = std::sync::Mutex::new(0usize);
    run_local(dims.world_size(), |world| {
        let device = Device::flex().autodiff();
        let mesh = dims.build(&world).expect("mesh");
        let tp = mesh.group("tp").expect("tp");
        let init = Init::new(config.seed, &device)
            .with_tp(tp, tp_plan(tp.size() > 1))
            .expect("plan");
        let sharded = matches!(kind, Step::Library);
        let fsdp = fsdp_plan(mesh.group("dp_shard").expect("dp_shard"));
        let mut model = Decoder::new(&init, sharded.then_some(&fsdp), &config).expect("model");
        let dp = dims.data_parallel(&mesh).expect("dp");
        let tokens = |salt: usize| {
            let ids: Vec<i64> = (0..BATCH * SEQ)
                .map(|i| ((i * 31 + salt * 7 + dp.rank() * 13) % config.vocab) as i64)
                .collect();
            Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ]), &device)
        };
        let mut optim = AdamWConfig::new().init();
        let step = TrainStep::new(init.context())
            .with_data_parallel(dp.clone())
            .with_fsdp(fsdp.shards().clone(), None);
        let mut zero = match kind {
            Step::Zero2 => Some(
                ZeroOptimizer::new(
                    &model,
                    ShardGroups::flat(dp.clone()),
                    ZeroConfig::new(Stage::Two),
                    AdamWConfig::new().build(),
                )
                .expect("zero"),
            ),
            Step::Library => None,
        };
        world.barrier()?;
        if start.wait().is_leader() {
            *before.lock().expect("peak") = ALLOC.reset_peak();
        }
        world.barrier()?;
        for s in 0..2 {
            let loss = model.loss(tokens(s), tokens(s + 1)).expect("loss");
            model = match zero.as_mut() {
                Some(zero) => {
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    zero.accumulate(&model, grads).expect("accumulate");
                    zero.step(1e-3, model).expect("step").0
                }
                None => step.step(model, loss, &mut optim, 1e-3)?.0,
            };
        }
        world.barrier()?;
        Ok(())
    })
    .expect("ranks");
    ALLOC.peak() - *before.lock().expect("peak")
}

fn main() {
    let config = decoder_config(std::env::args().any(|a| a == "--quick"));
    let full = Decoder::new(&Init::new(config.seed, &Device::flex()), None, &config)
        .expect("model")
        .num_params();
    let full_bytes = full as f64 * 4.0;
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let unit = {
        let c = config;
        (4 * c.d_model * c.d_model + 3 * c.d_model * c.d_ff + 2 * c.d_model) as f64 * 4.0
    };
    println!(
        "model: {full} parameters, {:.1} MiB fp32; one layer (FSDP unit) {:.2} MiB",
        mib(full_bytes),
        mib(unit)
    );
    println!(
        "{:<14} {:>12} {:>16} {:>18} {:>16}",
        "layout (N=4)", "params/rank", "peak/rank (MiB)", "peak / full model", "formula (MiB)"
    );
    let dims = |dp_replicate, dp_shard, tp| ParallelDims {
        dp_replicate,
        dp_shard,
        pp: 1,
        cp: 1,
        tp,
        ep: 1,
    };
    let embed_head = 2.0 * (config.vocab * config.d_model) as f64 * 4.0;
    let layers = full_bytes - embed_head;
    // FSDP wraps the layers (the embedding and head stay replicated over dp_shard). The layers
    // are built first, one at a time: while a layer is built and flattened, its whole (tensor-
    // parallel local) parameters exist twice beside the shards made so far; the embedding and
    // head come after, so the peak is the larger of the two phases.
    let fsdp = |shard: f64, tp: f64| {
        let built = embed_head / tp + layers / (shard * tp);
        let while_wrapping = layers / (shard * tp) + 2.0 * unit / tp;
        built.max(while_wrapping)
    };
    let rows: [(&str, ParallelDims, f64); 4] = [
        ("DDP", dims(4, 1, 1), full_bytes),
        ("TP 4", dims(1, 1, 4), full_bytes / 4.0),
        ("FSDP 4", dims(1, 4, 1), fsdp(4.0, 1.0)),
        ("FSDP 2 x TP 2", dims(1, 2, 2), fsdp(2.0, 2.0)),
    ];
    for (name, d, formula) in rows {
        let (peak, params) = wrap_peak(d, config);
        let per_rank = peak as f64 / 4.0;
        println!(
            "{name:<14} {params:>12} {:>16.2} {:>18.2} {:>16.2}",
            mib(per_rank),
            per_rank / full_bytes,
            mib(formula)
        );
    }

    // Model state over a step (fp32 parameters P, gradients, AdamW's two moments), per rank:
    // DDP 4P; ZeRO-2 P + 3P/N (its reduce-scatter runs bucket by bucket, but Burn's backward
    // returns every gradient at once, so up to P of whole gradients exists transiently before
    // it); FSDP 4P/N for the units (+ the replicated embedding and head, 4x) + one gathered
    // unit; FSDP x TP the same with P/tp. Activations of a {BATCH} x {SEQ}-token batch, the
    // gathered units autodiff keeps until backward, ZeRO-2's transient whole gradients and
    // staging buffers come on top: the "measured - state" column.
    println!(
        "\nover two AdamW steps, batch {BATCH} x {SEQ} tokens per data-parallel rank:\n{:<14} {:>16} {:>16} {:>18}",
        "layout (N=4)", "peak/rank (MiB)", "state (MiB)", "measured - state"
    );
    let n = 4.0;
    let state =
        |shard: f64, tp: f64| 4.0 * embed_head / tp + 4.0 * layers / (shard * tp) + unit / tp;
    let steps: [(&str, ParallelDims, Step, f64); 4] = [
        ("DDP", dims(4, 1, 1), Step::Library, 4.0 * full_bytes),
        (
            "ZeRO-2",
            dims(1, 4, 1),
            Step::Zero2,
            full_bytes + 3.0 * full_bytes / n,
        ),
        ("FSDP 4", dims(1, 4, 1), Step::Library, state(4.0, 1.0)),
        (
            "FSDP 2 x TP 2",
            dims(1, 2, 2),
            Step::Library,
            state(2.0, 2.0),
        ),
    ];
    for (name, d, kind, formula) in steps {
        let per_rank = step_peak(d, kind, config) as f64 / n;
        println!(
            "{name:<14} {:>16.2} {:>16.2} {:>18.2}",
            mib(per_rank),
            mib(formula),
            mib(per_rank - formula)
        );
    }
}
