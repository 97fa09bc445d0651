//! The book's "by hand" program (`book/src/by-hand.md` includes it): the layers underneath
//! `burn_parallel_train::build`, used directly. A model written once with
//! `burn_parallel::nn` layers trains under DDP driven by hand (`DistributedDataParallel` around
//! Burn's own optimizer) and under dp 2 x tp 2 with the library's `TrainStep`; both match one
//! device. A test target without the harness: `cargo test -p tests --test book_by_hand` runs
//! `main`.

// ANCHOR: model
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::Linear;
use burn_parallel::plan::TpPlan;
use burn_parallel::train::TrainStep;
use burn_parallel::{DistributedDataParallel, Error, ParallelDims, ProcessGroup};
use burn_parallel_train::run_local;

#[derive(Module, Debug)]
struct Mlp {
    up: Linear,
    down: Linear,
}

impl Mlp {
    /// Every value a pure function of the seed, the parameter's path and shape: one device,
    /// every replica and every tensor-parallel shard start from the same weights.
    fn new(init: &Init) -> Result<Self, Error> {
        let up = init.linear("up", LinearInit::new(4, 16))?;
        let down = init.linear("down", LinearInit::new(16, 1))?;
        init.finish()?; // a plan rule that matched no layer is an error
        Ok(Self { up, down })
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Result<Tensor<1>, Error> {
        let out = self.down.forward(self.up.forward(x)?.tanh())?;
        Ok((out - y).powi_scalar(2).mean())
    }
}

/// Rows `rows` of step `step`'s global batch of 8: inputs `[rows, 4]`, targets `[rows, 1]`.
fn batch(step: usize, rows: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = rows.len();
    let x: Vec<f32> = rows
        .flat_map(|r| (0..4).map(move |j| ((step * 31 + r * 4 + j) as f32 * 0.37).sin()))
        .collect();
    let y: Vec<f32> = x
        .chunks(4)
        .map(|v| v[0] * v[1] - 0.5 * v[2] + v[3])
        .collect();
    let x = Tensor::from_data(TensorData::new(x, [n, 4]), device);
    (x, Tensor::from_data(TensorData::new(y, [n, 1]), device))
}
// ANCHOR_END: model

// ANCHOR: plan
/// A LLaMA-style decoder's plan (torchtitan's `parallelize_llama`), by module path with globs.
fn llama_plan() -> TpPlan {
    TpPlan::new()
        .vocab("{embed,head}") // vocabulary-parallel embedding and output head
        .colwise("layers.*.attn.{q,k,v}") // heads split over tp
        .rowwise("layers.*.attn.o")
        .colwise("layers.*.mlp.{gate,up}")
        .rowwise("layers.*.mlp.down")
        .sequence_norm("**.norm*") // norm gradients summed over tp under SP
        .with_sequence_parallel(true)
}
// ANCHOR_END: plan

// ANCHOR: ddp
/// DDP by hand: identical replicas, each rank its rows, gradients averaged over the ranks,
/// then Burn's own AdamW. Returns this rank's loss of each step.
fn ddp(world: ProcessGroup) -> Result<Vec<f32>, Error> {
    let device = Device::flex().autodiff();
    let ddp = DistributedDataParallel::new(world.clone());
    let mut model = ddp.broadcast_module(Mlp::new(&Init::new(42, &device))?, 0)?;
    let mut optim = AdamWConfig::new().init();
    let rows = 8 / world.size();
    let mut losses = Vec::new();
    for step in 0..10 {
        let first = world.rank() * rows;
        let (x, y) = batch(step, first..first + rows, &device);
        let loss = model.loss(x, y)?;
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = ddp.all_reduce_grads(&model, grads)?; // averaged over the ranks
        model = optim.step(1e-2, model, grads);
    }
    Ok(losses)
}
// ANCHOR_END: ddp

// ANCHOR: mesh
/// The layout `dims` (`dp_replicate` x `tp` ranks) of the world: the mesh, the plan, and the
/// library's step (the tensor-parallel gradient syncs, DDP over `dp`, global-norm clipping).
/// Returns the loss of the global batch at each step.
fn train(world: ProcessGroup, dims: ParallelDims) -> Result<Vec<f32>, Error> {
    let device = Device::flex().autodiff();
    let mesh = dims.build(&world)?; // the product of the sizes must be the world's
    let plan = TpPlan::new().colwise("up").rowwise("down"); // Megatron's MLP split
    let init = Init::new(42, &device).with_tp(mesh.group("tp")?, plan)?; // each rank: its shards
    let mut model = Mlp::new(&init)?;
    let dp = dims.data_parallel(&mesh)?;
    let step = TrainStep::new(init.context())
        .with_data_parallel(dp.clone())
        .with_clip(Some(1.0));
    let mut optim = AdamWConfig::new().init();
    let rows = 8 / dp.size();
    let mut losses = Vec::new();
    for s in 0..10 {
        let (x, y) = batch(s, dp.rank() * rows..(dp.rank() + 1) * rows, &device);
        let loss = model.loss(x, y)?;
        let (next, out) = step.step(model, loss, &mut optim, 1e-2)?; // out.loss: averaged over dp
        model = next;
        losses.push(out.loss);
    }
    Ok(losses)
}
// ANCHOR_END: mesh

/// The mean over the ranks of each step's loss (every rank holds as many rows).
fn mean(per_rank: Vec<Vec<f32>>) -> Vec<f32> {
    let n = per_rank.len() as f32;
    (0..per_rank[0].len())
        .map(|s| per_rank.iter().map(|l| l[s]).sum::<f32>() / n)
        .collect()
}

/// `a` and `b` agree to `tol` relative to each loss.
fn check(name: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{name}");
    for (a, b) in a.iter().zip(b) {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{name}: {a} against {b}"
        );
    }
    println!("{name}: {a:?}");
}

fn main() -> Result<(), Error> {
    // The decoder's plan (`examples/examples/byo_model/model.rs` trains a decoder with it) is
    // only built here: it needs a model with those paths.
    let _ = llama_plan();
    let one_device = mean(run_local(1, ddp)?);
    check(
        "DDP by hand, 2 ranks",
        &mean(run_local(2, ddp)?),
        &one_device,
        1e-5,
    );
    // The library's step clips at 1: its single-device run is the oracle of its layouts.
    let one_device = run_local(1, |w| train(w, ParallelDims::default()))?.remove(0);
    // ANCHOR: layout
    let dims = ParallelDims {
        dp_replicate: 2,
        tp: 2,
        ..Default::default()
    };
    let losses = run_local(4, |world| train(world, dims))?;
    // ANCHOR_END: layout
    check("dp 2 x tp 2", &losses[0], &one_device, 1e-5);
    Ok(())
}
