//! The user's side of a `burn-train` training under `burn-parallel-learner`: a sequence
//! classifier written with `burn_parallel::nn` (a `Learner` model and a `ParallelModel`), its
//! dataset and batcher, a metric that records the losses the event processor sees, and the
//! training itself, on one device (burn-train's own strategy) or under a layout. Used by
//! `tests/learner.rs` and by the `learner_process` binary it starts under `burnrun`.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData, TensorReadError};
use burn_moe::MoeParallel;
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::{Embedding, Linear, TpContext};
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::plan::TpPlan;
use burn_parallel::{Error, ProcessGroup};
use burn_parallel_learner::{LayoutStrategy, Rows, TrainForward, single_device};
use burn_parallel_train::{Layout, ModelParts, ParallelModel, StepSettings};
use burn_train::metric::{Adaptor, Metric, MetricMetadata, MetricName, SerializedEntry};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use burn_zero::{Fsdp, FsdpPlan};

pub const VOCAB: usize = 13;
pub const SEQ: usize = 4;
pub const CLASSES: usize = 3;
pub const BATCH: usize = 8;
pub const ITEMS: usize = 48;
pub const EPOCHS: usize = 2;
pub const LR: f64 = 5e-2;
/// AdamW's epsilon, in the oracle and the layouts: see `byo_parity.rs` (at Burn's 1e-5 a
/// near-zero gradient component's sign decides its step, and the CPU's reduction order decides
/// that sign).
pub const EPSILON: f32 = 1e-3;

// ---- the user's model: a sequence classifier written with burn_parallel::nn ----

#[derive(Module, Debug)]
pub struct Mlp {
    up: Linear,
    down: Linear,
}

#[derive(Module, Debug)]
pub struct Classifier {
    embed: Embedding,
    norm: Param<Tensor<1>>,
    mlp: Fsdp<Mlp>,
    head: Linear,
    #[module(skip)]
    tp: TpContext,
}

/// A batch: token ids `[batch, SEQ]` and a class per row.
#[derive(Clone, Debug)]
pub struct SeqBatch {
    tokens: Tensor<2, Int>,
    labels: Tensor<1, Int>,
}

impl Rows for SeqBatch {
    fn num_rows(&self) -> usize {
        self.labels.dims()[0]
    }

    fn rows(self, range: Range<usize>) -> Self {
        let (start, len) = (range.start, range.len());
        SeqBatch {
            tokens: self.tokens.narrow(0, start, len),
            labels: self.labels.narrow(0, start, len),
        }
    }
}

impl Classifier {
    fn forward(&self, batch: SeqBatch) -> ClassificationOutput {
        self.try_forward(batch).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_forward(&self, batch: SeqBatch) -> Result<ClassificationOutput, Error> {
        let x = self
            .tp
            .scatter_sequence(self.embed.forward(batch.tokens)?)?;
        let rms = (x.clone().square().mean_dim(2) + 1e-5).sqrt();
        let h = x.clone() / rms * self.norm.val().unsqueeze();
        let mlp = self.mlp.get()?;
        let x = x + mlp.down.forward(mlp.up.forward(h)?.tanh())?;
        let x = self.tp.gather_sequence(x)?;
        let [b, _, d] = x.dims();
        let pooled = x.mean_dim(1).reshape([b, d]);
        let logits = self.head.forward(pooled)?;
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        Ok(ClassificationOutput::new(loss, logits, batch.labels))
    }
}

impl TrainStep for Classifier {
    type Input = SeqBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: SeqBatch) -> TrainOutput<ClassificationOutput> {
        let output = self.forward(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Classifier {
    type Input = SeqBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: SeqBatch) -> ClassificationOutput {
        self.forward(batch)
    }
}

impl TrainForward for Classifier {
    fn forward_train(&self, batch: SeqBatch) -> ClassificationOutput {
        self.forward(batch)
    }
}

/// How the layouts build the classifier.
#[derive(Clone, Copy)]
pub struct ClassifierConfig {
    d_model: usize,
    d_ff: usize,
}

impl ParallelModel for ClassifierConfig {
    type Model = Classifier;
    type Batch = SeqBatch;

    fn loss(model: &Classifier, batch: &SeqBatch) -> Result<Tensor<1>, Error> {
        Ok(model.try_forward(batch.clone())?.loss)
    }

    /// No attention: the layout's rule that tensor parallelism splits whole heads does not
    /// bind; 4 lets `tp` be 1, 2 or 4.
    fn n_heads(&self) -> usize {
        4
    }

    fn seed(&self) -> u64 {
        5
    }

    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        TpPlan::new()
            .colwise("mlp.up")
            .rowwise("mlp.down")
            .sequence_norm("norm")
            .with_sequence_parallel(sequence_parallel)
    }

    fn fsdp_plan(&self, shard: &ProcessGroup, _experts: &MoeParallel) -> FsdpPlan {
        FsdpPlan::new(shard).unit("mlp")
    }

    fn build(&self, parts: &ModelParts) -> Result<Classifier, Error> {
        let init = &parts.init;
        let mlp = |init: &Init| -> burn_zero::Result<Mlp> {
            Ok(Mlp {
                up: init.linear("up", LinearInit::new(self.d_model, self.d_ff))?,
                down: init.linear("down", LinearInit::new(self.d_ff, self.d_model))?,
            })
        };
        let mlp = match &parts.fsdp {
            Some(plan) => plan.wrap(&init.at("mlp"), mlp)?,
            None => Fsdp::new(mlp(&init.at("mlp"))?),
        };
        let model = Classifier {
            embed: init.embedding("embed", VOCAB, self.d_model, 0.5)?,
            norm: init.at("norm").ones([self.d_model]),
            mlp,
            head: init.linear("head", LinearInit::new(self.d_model, CLASSES).with_std(0.2))?,
            tp: init.context(),
        };
        init.finish()?;
        if let Some(plan) = &parts.fsdp {
            plan.finish()?;
        }
        Ok(model)
    }
}

pub const CONFIG: ClassifierConfig = ClassifierConfig {
    d_model: 8,
    d_ff: 12,
};

// ---- the data: a dataset of rows and its batcher, as a burn-train user writes them ----

#[derive(Clone, Debug)]
pub struct Row {
    tokens: Vec<i64>,
    label: i64,
}

/// Rows whose class is a function of their tokens (learnable).
pub fn rows(n: usize, salt: u64) -> Vec<Row> {
    (0..n)
        .map(|i| {
            let tokens: Vec<i64> = (0..SEQ)
                .map(|t| (splitmix((i * SEQ + t) as u64 ^ salt) % VOCAB as u64) as i64)
                .collect();
            let label = (tokens[0] + 2 * tokens[SEQ - 1]) % CLASSES as i64;
            Row { tokens, label }
        })
        .collect()
}

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[derive(Clone)]
pub struct RowBatcher;

impl Batcher<Row, SeqBatch> for RowBatcher {
    fn batch(&self, items: Vec<Row>, device: &Device) -> SeqBatch {
        let n = items.len();
        let tokens: Vec<i64> = items.iter().flat_map(|r| r.tokens.clone()).collect();
        let labels: Vec<i64> = items.iter().map(|r| r.label).collect();
        SeqBatch {
            tokens: Tensor::from_data(TensorData::new(tokens, [n, SEQ]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

pub type Loader = Arc<dyn DataLoader<SeqBatch>>;

/// The training loader (shuffled: every rank builds the same one) and the validation loader
/// (its last batch short).
pub fn loaders() -> (Loader, Loader) {
    loaders_of(ITEMS)
}

/// [`loaders`] with `items` training rows.
pub fn loaders_of(items: usize) -> (Loader, Loader) {
    let train = DataLoaderBuilder::new(RowBatcher)
        .batch_size(BATCH)
        .shuffle(17)
        .build(InMemDataset::new(rows(items, 0)));
    let valid = DataLoaderBuilder::new(RowBatcher)
        .batch_size(BATCH)
        .build(InMemDataset::new(rows(BATCH + 4, 99)));
    (train, valid)
}

// ---- a metric that records what the event processor sees ----

/// Every training and validation loss the metrics are given, in order.
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<f64>>>);

pub struct RecordedLoss(Tensor<1>);

impl Adaptor<RecordedLoss> for ClassificationOutput {
    fn adapt(&self) -> RecordedLoss {
        RecordedLoss(self.loss.clone())
    }
}

impl Metric for Recorder {
    type Input = RecordedLoss;

    fn name(&self) -> MetricName {
        Arc::new("recorded loss".to_string())
    }

    fn update(
        &mut self,
        item: &RecordedLoss,
        _: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let loss = item.0.clone().try_into_scalar::<f64>()?;
        self.0.lock().unwrap().push(loss);
        Ok(SerializedEntry::new(loss.to_string(), loss.to_string()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(SerializedEntry::not_available(None))
    }

    fn clear(&mut self) {}
}

pub fn adamw() -> AdamWConfig {
    AdamWConfig::new()
        .with_weight_decay(0.01)
        .with_epsilon(EPSILON)
}

pub fn settings() -> StepSettings {
    StepSettings {
        max_grad_norm: None,
        adamw: FusedAdamWConfig::new()
            .with_weight_decay(0.01)
            .with_epsilon(EPSILON),
        ..StepSettings::default()
    }
}

pub type Params = BTreeMap<String, Vec<f32>>;

pub fn params_of(model: &Classifier) -> Params {
    burn_parallel_train::named_params(model)
        .into_iter()
        .map(|p| (p.path, p.values))
        .collect()
}

/// What one training gives: the train losses the metrics saw, the validation losses, the
/// final parameters.
pub struct Outcome {
    /// The training losses, one per iteration.
    pub train: Vec<f64>,
    /// The validation losses, one per batch.
    pub valid: Vec<f64>,
    /// The final parameters by path.
    pub params: Params,
}

/// A stock `SupervisedTraining` of the classifier for `epochs` (resuming at `resume`), with
/// `strategy` (`None`: burn-train's own single device).
pub fn train(
    dir: &Path,
    strategy: Option<LayoutStrategy<ClassifierConfig>>,
    epochs: usize,
    resume: Option<usize>,
) -> Outcome {
    let device = Device::flex().autodiff();
    let model = single_device(&CONFIG, &device).unwrap();
    let (train, valid) = loaders();
    let (train_rec, valid_rec) = (Recorder::default(), Recorder::default());
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metric_train(train_rec.clone())
        .metric_valid(valid_rec.clone())
        .num_epochs(epochs);
    if let Some(strategy) = strategy {
        training = training.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    }
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    let learner = Learner::new(model, adamw().init(), LR);
    let result = training.launch(learner);
    if let Some(error) = result.error {
        panic!("training failed: {error}");
    }
    let train = train_rec.0.lock().unwrap().clone();
    let valid = valid_rec.0.lock().unwrap().clone();
    Outcome {
        train,
        valid,
        params: params_of(&result.model),
    }
}

/// The same training under `layout` on `world` thread ranks: rank 0's outcome.
pub fn under(
    layout: Layout,
    world: usize,
    dir: &Path,
    epochs: usize,
    resume: Option<usize>,
) -> Outcome {
    let dir = dir.to_path_buf();
    let mut out = burn_parallel_train::run_local(world, move |group| {
        let strategy = LayoutStrategy::new(group.clone(), layout, CONFIG, dir.join("checkpoints"))
            .with_settings(settings());
        let outcome = train(
            &dir.join(format!("rank{}", group.rank())),
            Some(strategy),
            epochs,
            resume,
        );
        Ok(outcome)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let rank0 = out.remove(0);
    for other in &out {
        assert_eq!(
            other.params, rank0.params,
            "every rank returns the same whole model"
        );
    }
    rank0
}
