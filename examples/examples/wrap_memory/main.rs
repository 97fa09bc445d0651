//! Peak memory of building ("wrapping") the bring-your-own-model decoder under each layout at
//! N = 4 thread ranks, measured with a counting allocator, beside the single-device model size.
//! With seeded sharded initialisation a rank creates only its shards: tensor parallelism and
//! FSDP never hold the whole model.
//!
//! ```text
//! cargo run --release -p examples --example wrap_memory
//! ```
//!
//! Ranks are threads of one process, so the allocator counts all of them together: the per-rank
//! figure is the process peak divided by 4 (the ranks are symmetric).

#[path = "../byo_model/model.rs"]
#[allow(dead_code)]
mod model;

use burn::module::Module;
use burn::tensor::Device;
use burn_parallel::init::Init;
use burn_parallel::{ParallelDims, run_local};
use burn_zero::memory::CountingAllocator;
use model::{Config, Decoder, fsdp_plan, tp_plan};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

fn config() -> Config {
    Config {
        vocab: 8192,
        d_model: 256,
        n_heads: 8,
        d_ff: 1024,
        n_layers: 4,
        seed: 1,
    }
}

/// Process peak (bytes) while every rank builds the model under `dims`, and the parameters a
/// rank holds.
fn wrap_peak(dims: ParallelDims) -> (usize, usize) {
    let before = ALLOC.reset_peak();
    let params = run_local(dims.world_size(), move |world| {
        let mesh = dims.build(&world).expect("mesh");
        let init = Init::new(config().seed, &Device::flex())
            .with_tp(mesh.group("tp").expect("tp"), tp_plan(false))
            .expect("plan");
        let fsdp = fsdp_plan(mesh.group("dp_shard").expect("dp_shard"));
        let model = Decoder::new(&init, Some(&fsdp), &config()).expect("model");
        world.barrier()?;
        Ok(model.num_params())
    })
    .expect("ranks");
    (ALLOC.peak() - before, params[0])
}

fn main() {
    let full = Decoder::new(&Init::new(config().seed, &Device::flex()), None, &config())
        .expect("model")
        .num_params();
    let full_bytes = full as f64 * 4.0;
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let unit = {
        let c = config();
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
        tp,
    };
    let embed_head = 2.0 * (config().vocab * config().d_model) as f64 * 4.0;
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
        let (peak, params) = wrap_peak(d);
        let per_rank = peak as f64 / 4.0;
        println!(
            "{name:<14} {params:>12} {:>16.2} {:>18.2} {:>16.2}",
            mib(per_rank),
            per_rank / full_bytes,
            mib(formula)
        );
    }
}
