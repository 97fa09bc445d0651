//! The book's quick start (`book/src/quickstart.md` includes this file) and the README's
//! bring-your-own-model example (the anchored region `byo`, which `tests/tests/book.rs` checks
//! the README repeats byte for byte): a model of the user's own, trained under DDP, then FSDP,
//! then tensor parallelism by changing only the `Layout`. A test target without the test
//! harness: `cargo test -p tests --test book_quickstart` runs `main`, which fails unless every
//! layout's losses match one device's.

// ANCHOR: program
// ANCHOR: model
use burn::module::Module;
use burn::tensor::Tensor;
use burn_moe::MoeParallel;
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::Linear;
use burn_parallel::{Error, ProcessGroup, plan::TpPlan};
use burn_parallel_train::{ModelParts, ParallelModel};
use burn_zero::{Fsdp, FsdpPlan};

// ANCHOR: byo
#[derive(Module, Debug)]
pub struct Mlp {
    up: Linear,
    down: Linear,
}

#[derive(Module, Debug)]
pub struct Model {
    mlp: Fsdp<Mlp>, // one FSDP unit under `zero: Some(Stage::Three)`, plain otherwise
}

pub struct Recipe; // how to build the model and split it, for every layout

#[rustfmt::skip]
impl ParallelModel for Recipe {
    type Model = Model;
    type Batch = (Tensor<2>, Tensor<2>); // this rank's rows: inputs [rows, 4], targets [rows, 1]
    fn n_heads(&self) -> usize { 16 } // no attention: tp splits the 16 hidden units whole
    fn seed(&self) -> u64 { 42 }
    fn tp_plan(&self, _sp: bool) -> TpPlan { TpPlan::new().colwise("mlp.up").rowwise("mlp.down") }
    fn fsdp_plan(&self, shard: &ProcessGroup, _: &MoeParallel) -> FsdpPlan {
        FsdpPlan::new(shard).unit("mlp")
    }
    fn build(&self, parts: &ModelParts) -> Result<Model, Error> {
        let (init, fsdp) = (parts.init.at("mlp"), parts.fsdp.as_ref());
        let mlp = |init: &Init| -> Result<Mlp, Error> {
            let up = init.linear("up", LinearInit::new(4, 16))?;
            Ok(Mlp { up, down: init.linear("down", LinearInit::new(16, 1))? })
        };
        let mlp = match fsdp {
            Some(plan) => plan.wrap(&init, mlp)?, // one unit, sharded over the FSDP ranks
            None => Fsdp::new(mlp(&init)?),
        };
        parts.init.finish()?; // a plan rule that matched no layer is an error
        Ok(Model { mlp })
    }
    fn loss(model: &Model, (x, y): &Self::Batch) -> Result<Tensor<1>, Error> {
        let mlp = model.mlp.get()?; // all-gathers the unit under FSDP
        let out = mlp.down.forward(mlp.up.forward(x.clone())?.tanh())?;
        Ok((out - y.clone()).powi_scalar(2).mean())
    }
}
// ANCHOR_END: byo
// ANCHOR_END: model

// ANCHOR: train
use burn::tensor::{Device, TensorData};
use burn_parallel_train::{FitConfig, Layout, MicroBatch, StepSettings, build, fit, run_local};
use burn_zero::Stage;

/// Rows `rows` of step `step`'s global batch: a pure function of both, so that every layout
/// sees the same data.
fn rows(step: usize, rows: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
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

/// 10 AdamW steps of a global batch of 8 rows on `ranks` thread ranks under `layout`.
fn train(ranks: usize, layout: Layout) -> Result<Vec<f32>, Error> {
    let settings = StepSettings {
        batch_size: 8,
        ..StepSettings::default()
    };
    let per_rank = run_local(ranks, |world| {
        let device = Device::flex().autodiff();
        let built = build(&world, &layout, &Recipe, &device, &settings)?;
        let mut batch = |micro: &MicroBatch| Ok(rows(micro.step, micro.rows.clone(), &device));
        let config = FitConfig::new(10, 1e-2);
        Ok(fit(built, &config, &mut batch, &mut |_, _| Ok(()), None)?.losses)
    })?;
    Ok(per_rank[0].clone()) // the loss of the global batch: the same on every rank
}

fn main() -> Result<(), Error> {
    let one_device = train(1, Layout::default())?;
    let ddp = Layout::default(); // on 2 ranks: 2 replicas, half the rows each
    let fsdp = Layout {
        zero: Some(Stage::Three),
        ..ddp
    };
    let tp = Layout { tp: 2, ..ddp };
    for (name, layout) in [("DDP", ddp), ("FSDP", fsdp), ("TP", tp)] {
        let losses = train(2, layout)?;
        for (a, b) in losses.iter().zip(&one_device) {
            let close = (a - b).abs() <= 1e-5 * b.abs().max(1.0);
            assert!(close, "{name}: {a} against one device's {b}");
        }
        println!("{name} on 2 ranks: {losses:?}");
    }
    println!("one device:      {one_device:?}");
    Ok(())
}
// ANCHOR_END: train
// ANCHOR_END: program
