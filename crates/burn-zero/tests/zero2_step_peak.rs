//! The peak memory of a whole ZeRO-2 step (forward, backward, accumulate, step; staging
//! buffers, pools and Burn's own tensors included), measured with the counting allocator.
//!
//! The only test of this binary (the allocator counts the whole process, so no other test may
//! run beside it). Two thread ranks run in lockstep (every phase ends in a collective), so the
//! process-wide figure is the sum of two symmetric ranks: half of it is one rank's.
//!
//! The model is an MLP of `LAYERS` square layers of width `WIDTH` with a batch of one row, so
//! that activations are negligible beside the parameters (`P` elements, `4P` bytes in fp32).
//! Burn's backward returns every gradient at once (`4P`), which no wrapper can avoid; on top of
//! that, a ZeRO-2 step that reduce-scatters bucket by bucket holds only its gradient shard
//! (`4P/N`), a few buckets of staging, and the all-gather of the new parameters (`4P`, once
//! the gradients are gone). Building the full flat gradient instead costs another `4P` (and
//! `4P` more for its host copy per parameter) while Burn's gradients are still alive.
//!
//! Run with `--nocapture` to see the figures:
//! `cargo test -p burn-zero --test zero2_step_peak -- --nocapture`.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use burn_parallel::{DistributedDataParallel, run_local};
use burn_zero::memory::CountingAllocator;
use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

const WIDTH: usize = 256;
const LAYERS: usize = 8;
const RANKS: usize = 2;
const BUCKET_BYTES: usize = 64 * 1024;

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        for l in &self.layers {
            x = l.forward(x).tanh();
        }
        x
    }
}

#[test]
fn zero2_step_peak_stays_below_a_full_flat_gradient() {
    let params = LAYERS * (WIDTH * WIDTH + WIDTH);
    let p_bytes = 4 * params;
    let peaks = run_local(RANKS, |group| {
        let device = Device::flex().autodiff();
        // What the process holds before any model exists: the zero of the measurement.
        group.barrier()?;
        let base = ALLOC.current();
        group.barrier()?;
        let ddp = DistributedDataParallel::new(group.clone());
        let model = Mlp {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(&device))
                .collect(),
        };
        let mut model = ddp.broadcast_module(model, 0)?;
        let config = ZeroConfig::new(Stage::Two).with_bucket_bytes(BUCKET_BYTES);
        let mut zero = ZeroOptimizer::new(
            &model,
            ShardGroups::flat(group.clone()),
            config,
            AdamWConfig::new().build(),
        )
        .unwrap();
        let mut peaks = Vec::new();
        for step in 0..3 {
            // Step 0 allocates the optimizer state and fills the buffer pool; steps 1 and 2
            // are measured.
            group.barrier()?;
            if group.rank() == 0 {
                ALLOC.reset_peak();
            }
            group.barrier()?;
            let x = Tensor::<2>::ones([1, WIDTH], &device) * (group.rank() as f32 + 1.0);
            let loss = model.forward(x).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            zero.accumulate(&model, grads).unwrap();
            model = zero.step(1e-3, model).unwrap().0;
            group.barrier()?;
            if group.rank() == 0 && step > 0 {
                peaks.push((base, ALLOC.peak()));
            }
        }
        Ok(peaks)
    })
    .unwrap();
    for (base, peak) in &peaks[0] {
        let per_rank = (peak - base) / RANKS;
        // ZeRO-2's model state (4P + 12P/N), plus the gradients Burn's backward returns all at
        // once (4P) before the wrapper takes them.
        let expected = p_bytes + 3 * p_bytes / RANKS + p_bytes;
        println!(
            "ZeRO-2 step, {RANKS} thread ranks, P = {params} ({:.2} MiB fp32), buckets of {} KiB: \
             per-rank peak over the step {:.2} MiB = {:.2} x 4P; model state + Burn's gradients \
             {:.2} MiB (process peak {:.2} MiB above {:.2} MiB before the model)",
            p_bytes as f64 / 1048576.0,
            BUCKET_BYTES / 1024,
            per_rank as f64 / 1048576.0,
            per_rank as f64 / p_bytes as f64,
            expected as f64 / 1048576.0,
            (peak - base) as f64 / 1048576.0,
            *base as f64 / 1048576.0,
        );
        // Slack, three quarters of 4P: a few buckets of staging (one reduced, one queued, one
        // packed, plus its wire copy and the collective's own chunk buffers) and what stays
        // resident besides the model state (buffers kept by burn-parallel's pool, autodiff
        // bookkeeping: measured 0.44 MiB per rank after a step). The two thread ranks share
        // the process allocator, so the peak depends on how their transient buffers overlap:
        // 40 runs measured 7.43 to 8.06 MiB per rank (half of 4P of slack failed 1 run in 20).
        // A full flat gradient adds 4P (measured before the bucketed reduce-scatter: 9.18 MiB
        // per rank), above this bound.
        assert!(
            per_rank < expected + 3 * p_bytes / 4,
            "{per_rank} bytes per rank over the step, expected about {expected}"
        );
    }
}
