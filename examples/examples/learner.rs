//! A stock `burn-train` training (`SupervisedTraining`, a `Learner`, the loss and accuracy
//! metrics, the renderer) of a small classifier on the bundled hand-written digits, under any
//! layout of burn-parallel: the one line that differs from a single-device training is the
//! `with_training_strategy(...)` below.
//!
//! ```text
//! cargo run --release -p examples --example learner                       # DDP over 2 thread ranks
//! cargo run --release -p examples --example learner -- --ranks 4 --zero 3 --tp 2
//! cargo run --release -p examples --example learner -- --single           # burn-train alone
//! cargo build --release -p examples --example learner -p burn-parallel --bin burnrun
//! target/release/burnrun --nproc-per-node 2 -- target/release/examples/learner --zero 2
//! ```
//!
//! burn-train's terminal dashboard is its `tui` feature; this workspace builds burn-train
//! without its default features (no TUI, no system metrics), so the example prints with
//! burn-train's plain renderer. In your own project keep burn-train's defaults for the
//! dashboard.

use std::ops::Range;
use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_moe::MoeParallel;
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::Linear;
use burn_parallel::plan::TpPlan;
use burn_parallel::{Error, ProcessGroup};
use burn_parallel_learner::{LayoutStrategy, Rows, TrainForward, single_device};
use burn_parallel_train::cli::LayoutArgs;
use burn_parallel_train::{ModelParts, ParallelModel, StepSettings};
use burn_train::metric::{AccuracyMetric, LossMetric};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use burn_zero::{Fsdp, FsdpPlan};
use clap::Parser;
use examples::data::Digits;

/// The classifier: a residual MLP block (an FSDP unit; its two layers split by tensor
/// parallelism, column- then row-wise) and a head, over the 64 pixels.
#[derive(Module, Debug)]
struct Classifier {
    block: Fsdp<Block>,
    head: Linear,
}

#[derive(Module, Debug)]
struct Block {
    up: Linear,
    down: Linear,
}

impl Classifier {
    fn forward(&self, batch: DigitsBatch) -> ClassificationOutput {
        let block = self.block.get().expect("the block's shards gathered");
        let x = batch.images;
        let hidden = relu(block.up.forward(x.clone()).expect("up"));
        let x = x + block.down.forward(hidden).expect("down");
        let logits = self.head.forward(x).expect("head");
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels)
    }
}

impl TrainStep for Classifier {
    type Input = DigitsBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: DigitsBatch) -> TrainOutput<ClassificationOutput> {
        let output = self.forward(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Classifier {
    type Input = DigitsBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: DigitsBatch) -> ClassificationOutput {
        self.forward(batch)
    }
}

// ANCHOR: forward
/// What the layouts need beyond burn-train's steps: the forward before backpropagation.
impl TrainForward for Classifier {
    fn forward_train(&self, batch: DigitsBatch) -> ClassificationOutput {
        self.forward(batch)
    }
}
// ANCHOR_END: forward

/// How the layouts build the classifier: its plans and its build.
struct ClassifierConfig {
    hidden: usize,
}

impl ParallelModel for ClassifierConfig {
    type Model = Classifier;
    type Batch = DigitsBatch;
    fn loss(model: &Classifier, batch: &DigitsBatch) -> Result<Tensor<1>, Error> {
        Ok(model.forward(batch.clone()).loss)
    }
    /// No attention: any `--tp` dividing the hidden width.
    fn n_heads(&self) -> usize {
        self.hidden
    }
    fn seed(&self) -> u64 {
        1
    }
    fn tp_plan(&self, _sequence_parallel: bool) -> TpPlan {
        TpPlan::new().colwise("block.up").rowwise("block.down")
    }
    fn fsdp_plan(&self, shard: &ProcessGroup, _experts: &MoeParallel) -> FsdpPlan {
        FsdpPlan::new(shard).unit("block")
    }
    fn build(&self, parts: &ModelParts) -> Result<Classifier, Error> {
        let (init, pixels) = (&parts.init, Digits::PIXELS);
        let block = |init: &Init| -> burn_zero::Result<Block> {
            Ok(Block {
                up: init.linear("up", LinearInit::burn(pixels, self.hidden))?,
                down: init.linear("down", LinearInit::burn(self.hidden, pixels))?,
            })
        };
        let block = match &parts.fsdp {
            Some(plan) => plan.wrap(&init.at("block"), block)?,
            None => Fsdp::new(block(&init.at("block"))?),
        };
        let head = init.linear("head", LinearInit::burn(pixels, Digits::N_CLASSES))?;
        init.finish()?;
        if let Some(plan) = &parts.fsdp {
            plan.finish()?;
        }
        Ok(Classifier { block, head })
    }
}

// ANCHOR: rows
/// A batch: images `[batch, 64]` and labels `[batch]`; each data-parallel rank takes its rows.
#[derive(Clone, Debug)]
struct DigitsBatch {
    images: Tensor<2>,
    labels: Tensor<1, Int>,
}

impl Rows for DigitsBatch {
    fn num_rows(&self) -> usize {
        self.labels.dims()[0]
    }
    fn rows(self, range: Range<usize>) -> Self {
        let (start, len) = (range.start, range.len());
        DigitsBatch {
            images: self.images.narrow(0, start, len),
            labels: self.labels.narrow(0, start, len),
        }
    }
}
// ANCHOR_END: rows

#[derive(Clone, Debug)]
struct Digit {
    pixels: Vec<f32>,
    label: i64,
}

struct DigitBatcher;

impl Batcher<Digit, DigitsBatch> for DigitBatcher {
    fn batch(&self, items: Vec<Digit>, device: &Device) -> DigitsBatch {
        let n = items.len();
        let pixels: Vec<f32> = items.iter().flat_map(|d| d.pixels.clone()).collect();
        let labels: Vec<i64> = items.iter().map(|d| d.label).collect();
        DigitsBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, Digits::PIXELS]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

fn dataset(digits: &Digits) -> InMemDataset<Digit> {
    let all: Vec<usize> = (0..digits.len()).collect();
    let batch = digits.select(&all);
    let items = batch.images.chunks(Digits::PIXELS).zip(batch.labels);
    let items = items.map(|(pixels, label)| Digit {
        pixels: pixels.to_vec(),
        label,
    });
    InMemDataset::new(items.collect())
}

#[derive(Parser, Debug)]
#[command(about = "A burn-train Learner on the bundled digits, under any burn-parallel layout")]
struct Args {
    /// Thread ranks when not started by burnrun (its variables select the TCP world).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// burn-train's own single-device training, for comparison.
    #[arg(long)]
    single: bool,
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Where burn-train writes its logs and the strategy its checkpoints.
    #[arg(long, default_value = "target/learner")]
    dir: std::path::PathBuf,
    #[command(flatten)]
    layout: LayoutArgs,
}

fn train(args: &Args, world: Option<ProcessGroup>) -> Result<(), Error> {
    let digits = Digits::load_default().map_err(|e| Error::invalid("--data-dir", e))?;
    let (train, test) = digits.split(0.2, 0);
    let loader = |digits: &Digits, shuffle: bool| {
        let builder = DataLoaderBuilder::new(DigitBatcher).batch_size(args.batch_size);
        let builder = if shuffle { builder.shuffle(7) } else { builder };
        builder.build(dataset(digits))
    };
    let config = ClassifierConfig { hidden: 256 };
    let model = single_device(&config, &Device::flex().autodiff())?;
    let rank = world.as_ref().map_or(0, ProcessGroup::rank);
    // ANCHOR: training
    let training = SupervisedTraining::new(
        args.dir.join(format!("rank{rank}")),
        loader(&train, true),
        loader(&test, false),
    )
    .metrics((AccuracyMetric::new(), LossMetric::new()))
    .num_epochs(args.epochs);
    let training = match world {
        None => training,
        Some(world) => {
            let layout = args.layout.layout().map_err(Error::from)?;
            let settings = StepSettings {
                max_grad_norm: None,
                ..StepSettings::default()
            };
            let strategy = LayoutStrategy::new(world, layout, config, args.dir.join("checkpoints"));
            // The one line that trains under a layout:
            training.with_training_strategy(TrainingStrategy::Custom(Arc::new(
                strategy.with_settings(settings),
            )))
        }
    };
    let result = training.launch(Learner::new(model, AdamWConfig::new().init(), args.lr));
    // ANCHOR_END: training
    match result.error {
        Some(error) => Err(Error::invalid("training", error.to_string())),
        None => Ok(()),
    }
}

fn main() {
    let args = Args::parse();
    let run = if args.single {
        train(&args, None)
    } else if std::env::var_os("WORLD_SIZE").is_some() {
        burn_parallel::init_from_env()
            .map_err(Error::from)
            .and_then(|world| train(&args, Some(world)))
    } else {
        burn_parallel_train::run_local(args.ranks, |world| train(&args, Some(world))).map(|_| ())
    };
    if let Err(e) = run {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
