//! Every `burn-parallel` layout as a strategy of `burn-train`'s `Learner`: a Burn user keeps
//! `SupervisedTraining`, its metrics, its renderer and its interrupter, and trains under DDP,
//! FSDP/HSDP, ZeRO-1/2, tensor and sequence parallelism or their combinations by handing it a
//! [`LayoutStrategy`] (`TrainingStrategy::Custom`) built from a [`Layout`].
//!
//! What the strategy does, on every rank (thread ranks of [`burn_parallel_train::run_local`] or
//! processes started by `burnrun`, torchrun's or SLURM's variables):
//!
//! - places the layout ([`Placed`]): this rank's part of the model, built through the model's
//!   [`ParallelModel`] plans, loaded with the `Learner`'s starting weights;
//! - at every step, takes this data-parallel rank's rows of the global batch ([`Rows`]), runs
//!   the model's training forward ([`TrainForward`]), and steps the layout's engine at the
//!   learning rate of the `Learner`'s scheduler: gradients reduced, sharded, clipped and
//!   applied as the layout does;
//! - gathers each step's output over the data-parallel ranks ([`GatherOutput`]) so that rank 0's
//!   event processor (metrics, renderer) sees the global batch, as on one device; the other
//!   ranks send no events;
//! - validates every epoch over each rank's rows of the validation batches;
//! - saves a checkpoint at the end of every epoch under its directory (parameters and optimizer
//!   state, reshardable: `SupervisedTraining::checkpoint(epoch)` resumes it under any layout);
//! - agrees on every stop (the interrupter of any rank, early stopping on rank 0) so that no
//!   rank waits for a collective the others left;
//! - returns the whole trained model on every rank.
//!
//! `burn-train`'s own checkpointers are refused: their optimizer record holds one device's
//! state, not a sharded optimizer's.

#![warn(missing_docs)]

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::ReduceOp;
use burn_parallel::checkpoint::{Checkpoint, Checkpointer, ParamMap};
use burn_parallel::nn::TpContext;
use burn_parallel::train::SaveState;
use burn_parallel::{Error, ProcessGroup};
use burn_parallel_train::build::Trainee;
use burn_parallel_train::{Built, Layout, ModelParts, ParallelModel, Placed, StepSettings};
use burn_train::metric::store::EventStoreClient;
use burn_train::train::WorkerFailure;
use burn_train::{
    ClassificationOutput, EventProcessorTraining, InferenceStep, Learner, LearnerEvent,
    LearnerModel, RegressionOutput, SupervisedLearningStrategy, SupervisedTrainingEventProcessor,
    TrainLoader, TrainStep, TrainingComponents, TrainingError, TrainingItem, ValidLoader,
};
use serde_json::json;

/// The training forward of a `Learner` model: what its `TrainStep::step` computes before it
/// backpropagates, the output with its loss. The strategy backpropagates it itself (the
/// layout's engine reduces the gradients).
pub trait TrainForward: TrainStep {
    /// The forward of `item` (this rank's rows of a batch).
    fn forward_train(&self, item: <Self as TrainStep>::Input) -> <Self as TrainStep>::Output;
}

/// A batch that can be cut into rows: each data-parallel rank trains on its rows of every
/// batch the loader gives.
pub trait Rows: Sized {
    /// The rows of the batch.
    fn num_rows(&self) -> usize;

    /// Rows `range` of the batch.
    fn rows(self, range: Range<usize>) -> Self;
}

/// A step's output whose loss the strategy backpropagates and whose rows it gathers over the
/// data-parallel ranks, so that the metrics on rank 0 see the global batch.
pub trait GatherOutput: Sized {
    /// The loss (the mean over the output's rows).
    fn loss(&self) -> Tensor<1>;

    /// The output of the global batch, from this rank's output over `rows` of its `total`
    /// rows: every row in rank order, the loss the mean over all rows. Collective over
    /// `group`.
    ///
    /// # Errors
    /// Collective failures.
    fn gather(self, group: &ProcessGroup, rows: usize, total: usize) -> Result<Self, Error>;
}

/// The rows of `t` from every rank of `group`, concatenated in rank order.
fn gather_float<const D: usize>(t: Tensor<D>, group: &ProcessGroup) -> Result<Tensor<D>, Error> {
    let device = t.device();
    let parts = group.all_gather_object(&t.into_data())?;
    let parts = parts.into_iter().map(|d| Tensor::from_data(d, &device));
    Ok(Tensor::cat(parts.collect(), 0))
}

/// [`gather_float`] for integer tensors (class targets).
fn gather_int<const D: usize>(
    t: Tensor<D, Int>,
    group: &ProcessGroup,
) -> Result<Tensor<D, Int>, Error> {
    let device = t.device();
    let parts = group.all_gather_object(&t.into_data())?;
    let parts = parts.into_iter().map(|d| Tensor::from_data(d, &device));
    Ok(Tensor::cat(parts.collect(), 0))
}

/// The mean loss over every rank's rows: each rank's mean weighted by its rows.
fn gather_loss(
    loss: Tensor<1>,
    group: &ProcessGroup,
    rows: usize,
    total: usize,
) -> Result<Tensor<1>, Error> {
    let device = loss.device();
    let weighted = loss.into_data().convert::<f32>();
    let local = weighted
        .as_slice::<f32>()
        .map_err(|e| Error::invalid("loss", format!("the loss is not a float tensor: {e:?}")))?[0]
        * rows as f32
        / total as f32;
    let sum = group.all_reduce_data(TensorData::new(vec![local], [1]), ReduceOp::Sum)?;
    Ok(Tensor::from_data(sum, &device))
}

impl GatherOutput for ClassificationOutput {
    fn loss(&self) -> Tensor<1> {
        self.loss.clone()
    }

    fn gather(self, group: &ProcessGroup, rows: usize, total: usize) -> Result<Self, Error> {
        if group.size() == 1 {
            return Ok(self);
        }
        Ok(ClassificationOutput {
            loss: gather_loss(self.loss, group, rows, total)?,
            output: gather_float(self.output, group)?,
            targets: gather_int(self.targets, group)?,
        })
    }
}

impl GatherOutput for RegressionOutput {
    fn loss(&self) -> Tensor<1> {
        self.loss.clone()
    }

    fn gather(self, group: &ProcessGroup, rows: usize, total: usize) -> Result<Self, Error> {
        if group.size() == 1 {
            return Ok(self);
        }
        Ok(RegressionOutput {
            loss: gather_loss(self.loss, group, rows, total)?,
            output: gather_float(self.output, group)?,
            targets: gather_float(self.targets, group)?,
        })
    }
}

/// `config`'s model built whole on `device`, with no layout: the model a `Learner` starts
/// from, and the single-device oracle of a parity test.
///
/// # Errors
/// The model's build errors.
pub fn single_device<P: ParallelModel>(config: &P, device: &Device) -> Result<P::Model, Error> {
    let parts = ModelParts {
        init: burn_parallel::init::Init::new(config.seed(), device),
        fsdp: None,
        experts: burn_moe::MoeParallel::default(),
        context_parallel: None,
        data_rank: 0,
    };
    config.build(&parts)
}

/// This rank's rows of a batch of `n` rows over `parts` data-parallel ranks: the first
/// `n % parts` ranks take one row more.
fn rows_of(n: usize, parts: usize, index: usize) -> Range<usize> {
    let base = n / parts;
    let extra = n % parts;
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

/// The layouts of `burn-parallel` as a `burn-train` strategy; see the crate's documentation.
///
/// # Example
/// A one-layer regression trained by burn-train's `SupervisedTraining` under DDP over two
/// thread ranks, ending where burn-train's own single-device training ends.
/// ```
/// use std::ops::Range;
/// use std::path::Path;
/// use std::sync::Arc;
/// use burn::data::dataloader::{DataLoaderBuilder, batcher::Batcher};
/// use burn::data::dataset::InMemDataset;
/// use burn::module::Module;
/// use burn::nn::loss::{MseLoss, Reduction};
/// use burn::optim::AdamWConfig;
/// use burn::tensor::{Device, Tensor, TensorData};
/// use burn_parallel::init::LinearInit;
/// use burn_parallel::{Error, ProcessGroup, nn::Linear, plan::TpPlan};
/// use burn_parallel_learner::{LayoutStrategy, Rows, TrainForward, single_device};
/// use burn_parallel_train::{Layout, ModelParts, ParallelModel, StepSettings};
/// use burn_train::{InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput};
/// use burn_train::{TrainStep, TrainingStrategy};
///
/// #[derive(Module, Debug)]
/// struct Fit { fc: Linear }
///
/// #[derive(Clone, Debug)]
/// struct Xy { x: Tensor<2>, y: Tensor<2> }
///
/// impl Rows for Xy {
///     fn num_rows(&self) -> usize { self.x.dims()[0] }
///     fn rows(self, r: Range<usize>) -> Self {
///         Xy { x: self.x.narrow(0, r.start, r.len()), y: self.y.narrow(0, r.start, r.len()) }
///     }
/// }
///
/// impl Fit {
///     fn forward(&self, b: Xy) -> RegressionOutput {
///         let out = self.fc.forward(b.x).unwrap();
///         let loss = MseLoss::new().forward(out.clone(), b.y.clone(), Reduction::Mean);
///         RegressionOutput::new(loss, out, b.y)
///     }
/// }
/// impl TrainStep for Fit {
///     type Input = Xy;
///     type Output = RegressionOutput;
///     fn step(&self, b: Xy) -> TrainOutput<RegressionOutput> {
///         let out = self.forward(b);
///         TrainOutput::new(self, out.loss.backward(), out)
///     }
/// }
/// impl InferenceStep for Fit {
///     type Input = Xy;
///     type Output = RegressionOutput;
///     fn step(&self, b: Xy) -> RegressionOutput { self.forward(b) }
/// }
/// impl TrainForward for Fit {
///     fn forward_train(&self, b: Xy) -> RegressionOutput { self.forward(b) }
/// }
///
/// struct FitConfig;
/// impl ParallelModel for FitConfig {
///     type Model = Fit;
///     type Batch = Xy;
///     fn loss(m: &Fit, b: &Xy) -> Result<Tensor<1>, Error> { Ok(m.forward(b.clone()).loss) }
///     fn n_heads(&self) -> usize { 1 }
///     fn seed(&self) -> u64 { 3 }
///     fn tp_plan(&self, _sp: bool) -> TpPlan { TpPlan::new() }
///     fn fsdp_plan(&self, g: &ProcessGroup, _: &burn_moe::MoeParallel) -> burn_zero::FsdpPlan {
///         burn_zero::FsdpPlan::new(g)
///     }
///     fn build(&self, parts: &ModelParts) -> Result<Fit, Error> {
///         Ok(Fit { fc: parts.init.linear("fc", LinearInit::burn(2, 1))? })
///     }
/// }
///
/// struct XyBatcher;
/// impl Batcher<[f32; 3], Xy> for XyBatcher {
///     fn batch(&self, items: Vec<[f32; 3]>, device: &Device) -> Xy {
///         let n = items.len();
///         let x: Vec<f32> = items.iter().flat_map(|i| [i[0], i[1]]).collect();
///         let y: Vec<f32> = items.iter().map(|i| i[2]).collect();
///         Xy {
///             x: Tensor::from_data(TensorData::new(x, [n, 2]), device),
///             y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
///         }
///     }
/// }
///
/// /// Four epochs of 4 batches; `world` trains under DDP over its ranks, `None` on one device.
/// /// Checkpoints under `checkpoints`, one directory for every rank.
/// fn train(world: Option<ProcessGroup>, dir: &Path, checkpoints: &Path) -> Vec<f32> {
///     let rows: Vec<[f32; 3]> = (0..32)
///         .map(|i| { let (a, b) = (i as f32 / 32.0, (i % 5) as f32 / 5.0); [a, b, 2.0 * a - b] })
///         .collect();
///     let loader = |rows: Vec<[f32; 3]>| {
///         DataLoaderBuilder::new(XyBatcher).batch_size(8).build(InMemDataset::new(rows))
///     };
///     let mut training = SupervisedTraining::new(dir, loader(rows.clone()), loader(rows))
///         .num_epochs(4);
///     if let Some(world) = world {
///         let settings = StepSettings { max_grad_norm: None, ..StepSettings::default() };
///         let strategy = LayoutStrategy::new(world, Layout::default(), FitConfig, checkpoints)
///             .with_settings(settings);
///         training = training.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
///     }
///     let model = single_device(&FitConfig, &Device::flex().autodiff()).unwrap();
///     let result = training.launch(Learner::new(model, AdamWConfig::new().init(), 1e-2));
///     assert!(result.error.is_none());
///     result.model.fc.weight.val().into_data().to_vec().unwrap()
/// }
///
/// let dir = std::env::temp_dir().join(format!("learner-doc-{}", std::process::id()));
/// let single = train(None, &dir.join("single"), &dir.join("unused"));
/// let ddp = burn_parallel_train::run_local(2, |world| {
///     let logs = dir.join(format!("rank-{}", world.rank()));
///     Ok(train(Some(world), &logs, &dir.join("checkpoints")))
/// })
/// .unwrap();
/// for (a, b) in ddp[0].iter().zip(&single) {
///     assert!((a - b).abs() < 1e-5, "{a} against {b}");
/// }
/// # std::fs::remove_dir_all(&dir).ok();
/// ```
pub struct LayoutStrategy<P: ParallelModel> {
    world: ProcessGroup,
    layout: Layout,
    config: P,
    settings: StepSettings,
    device: Device,
    dir: PathBuf,
    keep: usize,
}

impl<P: ParallelModel> LayoutStrategy<P> {
    /// The strategy of `layout` on this rank of `world` for the model of `config`, saving its
    /// checkpoints under `dir` (one directory every rank reaches: a shared file system across
    /// hosts). Defaults: [`StepSettings::default`] (AdamW's hyper-parameters, clipping at 1),
    /// the Flex CPU device, the last 2 checkpoints kept.
    pub fn new(world: ProcessGroup, layout: Layout, config: P, dir: impl Into<PathBuf>) -> Self {
        Self {
            world,
            layout,
            config,
            settings: StepSettings::default(),
            device: Device::flex(),
            dir: dir.into(),
            keep: 2,
        }
    }

    /// The step's settings: AdamW's hyper-parameters (the `Learner`'s optimizer is not used:
    /// the layout's engine keeps the optimizer state, sharded as the layout shards it), the
    /// clipping norm, the precision, the bucket size.
    pub fn with_settings(mut self, settings: StepSettings) -> Self {
        self.settings = settings;
        self
    }

    /// The device this rank trains on (its autodiff form is taken).
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// How many epoch checkpoints to keep (at least 1).
    pub fn with_keep(mut self, keep: usize) -> Self {
        self.keep = keep.max(1);
        self
    }
}

/// What one rank's run needs of the `Learner`'s components.
struct Run<'a, M: LearnerModel> {
    processor: &'a mut SupervisedTrainingEventProcessor<M>,
    interrupter: &'a burn_train::Interrupter,
    event_store: &'a Arc<EventStoreClient>,
    early_stopping: &'a mut Option<Box<dyn burn_train::CloneEarlyStoppingStrategy>>,
    rank0: bool,
}

impl<M: LearnerModel> Run<'_, M> {
    fn train_event(&mut self, event: LearnerEvent<<M as TrainStep>::Output>) {
        if self.rank0 {
            self.interrupter
                .fail_on_error(self.processor.process_train(event));
        }
    }

    fn valid_event(&mut self, event: LearnerEvent<<M as InferenceStep>::Output>) {
        if self.rank0 {
            self.interrupter
                .fail_on_error(self.processor.process_valid(event));
        }
    }
}

/// Whether any rank of `world` wants to stop (`stop` on this one).
fn any_stops(world: &ProcessGroup, stop: bool) -> Result<bool, Error> {
    let flag = TensorData::new(vec![f32::from(u8::from(stop))], [1]);
    let all = world.all_reduce_data(flag, ReduceOp::Max)?;
    Ok(all.as_slice::<f32>().map(|s| s[0] > 0.0).unwrap_or(true))
}

impl<P> LayoutStrategy<P>
where
    P: ParallelModel,
    P::Model: LearnerModel + TrainForward,
    <P::Model as TrainStep>::Input: Rows,
    <P::Model as InferenceStep>::Input: Rows,
    <P::Model as TrainStep>::Output: GatherOutput,
    <P::Model as InferenceStep>::Output: GatherOutput,
{
    /// Places the layout with the `Learner`'s model as its starting weights.
    fn place(&self, start: &P::Model) -> Result<Built<P>, Error> {
        let device = self.device.clone().autodiff();
        let whole: BTreeMap<String, TensorData> = burn_parallel_train::named_params(start)
            .into_iter()
            .map(|p| (p.path, TensorData::new(p.values, p.shape)))
            .collect();
        // The layout's rules check a batch and a sequence against the ranks; here the
        // Learner's loader decides them, and each step splits whatever rows it gives (a
        // sequence the tensor-parallel ranks cannot split fails in the model's forward, named).
        let mut settings = self.settings.clone();
        let ranks = self.world.size();
        settings.batch_size = ranks * settings.grad_accum.max(1);
        settings.seq_len = settings.seq_len.max(1) * ranks;
        Placed::new(&self.world, &self.layout, &self.config, &device, &settings)?
            .load_params(&whole)?
            .into_engine(&settings)
    }

    /// `template` loaded with the parameters of `checkpoint` (saved under any layout).
    fn whole_from(template: P::Model, checkpoint: &Checkpoint) -> Result<P::Model, Error> {
        let map = ParamMap::new(&template, &TpContext::single(), None)?;
        Ok(map.load_params(template, checkpoint)?)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        run: &mut Run<'_, P::Model>,
        learner: &mut Learner<P::Model>,
        train: TrainLoader<P::Model>,
        valid: ValidLoader<P::Model>,
        epochs: Range<usize>,
        resume: Option<usize>,
        grad_accumulation: usize,
    ) -> Result<P::Model, Error> {
        let template = learner.model().fork(&self.device.clone().autodiff());
        let mut built = self.place(&template)?;
        let data = built.groups.data.clone();
        let dirs = self.world.all_gather_object(&self.dir)?;
        if let Some(other) = dirs.iter().position(|d| *d != dirs[0]) {
            let reason = format!(
                "the ranks were given different checkpoint directories (rank 0: {}, rank {other}: \
                 {}); give every rank the same one (on a file system every host reaches)",
                dirs[0].display(),
                dirs[other].display()
            );
            return Err(Error::invalid("LayoutStrategy::new(dir)", reason));
        }
        let mut saver = Checkpointer::new(&self.dir, self.keep, &self.world)?;
        let mut iterations = 0usize;
        if let Some(epoch) = resume {
            let checkpoint = Checkpoint::open(&saver.dir_of(epoch))?;
            let state = built.load(&checkpoint)?;
            iterations = state["iterations"].as_u64().unwrap_or(0) as usize;
            // The schedulers of burn-train are functions of their step count.
            for _ in 0..iterations {
                learner.lr_step();
            }
        }
        let device = self.device.clone().autodiff();
        let train = train.to_device(&device);
        let valid = valid.to_device(&self.device);
        let (train_items, valid_items) = (train.num_items(), valid.num_items());
        // A shuffling loader draws a new order at every pass: skip the passes of the epochs
        // the checkpoint holds, so that a resumed run sees the batches of an uninterrupted one.
        for _ in 0..resume.unwrap_or(0) {
            drop(train.iter());
        }
        let mut last = None;
        for epoch in epochs {
            run.train_event(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: train_items,
            });
            let mut iterator = train.iter();
            let mut iteration = 0;
            let mut stop = false;
            while !stop {
                // Up to `grad_accumulation` batches, one optimizer step.
                let mut batches = Vec::new();
                let mut progress = None;
                while batches.len() < grad_accumulation {
                    match iterator.next() {
                        Some(Ok(item)) => {
                            batches.push(item);
                            progress = Some(iterator.progress());
                        }
                        Some(Err(e)) => return Err(Error::invalid("dataset", e.to_string())),
                        None => break,
                    }
                }
                if batches.is_empty() {
                    break;
                }
                learner.lr_step();
                let lr = learner.lr_current().base();
                let outputs = self.step(&mut built, &data, batches, lr)?;
                iterations += 1;
                let progress = progress.expect("a batch was taken");
                for output in outputs {
                    iteration += 1;
                    let item = TrainingItem::new(
                        output,
                        progress.clone(),
                        Some(iteration),
                        Some(learner.lr_current()),
                    );
                    run.train_event(LearnerEvent::ProcessedItem(item));
                }
                stop = any_stops(&self.world, run.interrupter.should_stop())?;
            }
            run.train_event(LearnerEvent::EndSplit(epoch));
            if stop {
                break;
            }
            run.valid_event(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: valid_items,
            });
            self.validate(&built, &data, &valid, run)?;
            run.valid_event(LearnerEvent::EndSplit(epoch));
            run.train_event(LearnerEvent::EndEpoch(epoch));
            let state = json!({ "epoch": epoch, "iterations": iterations });
            built.save(&mut saver, epoch, SaveState::from(state))?;
            last = Some(epoch);
            let mut halt = run.interrupter.should_stop();
            if run.rank0 {
                run.interrupter.fail_on_error(run.processor.flush());
                if let Some(early) = run.early_stopping.as_mut() {
                    halt |= early.should_stop(epoch, run.event_store);
                }
            }
            if any_stops(&self.world, halt)? {
                break;
            }
        }
        // Every rank's files are written once the collective save returns everywhere.
        self.world.barrier()?;
        match last.or(resume) {
            Some(epoch) => Self::whole_from(template, &Checkpoint::open(&saver.dir_of(epoch))?),
            None => Ok(template),
        }
    }

    /// One optimizer step over `batches` (this rank's rows of each): the outputs, gathered.
    fn step(
        &self,
        built: &mut Built<P>,
        data: &ProcessGroup,
        batches: Vec<<P::Model as TrainStep>::Input>,
        lr: f64,
    ) -> Result<Vec<<P::Model as TrainStep>::Output>, Error> {
        let micro = batches.len();
        let mut rows = Vec::with_capacity(micro);
        let mut items: Vec<Option<_>> = Vec::with_capacity(micro);
        for batch in batches {
            let total = batch.num_rows();
            let mine = rows_of(total, data.size(), data.rank());
            if mine.is_empty() {
                return Err(Error::invalid(
                    "batch_size",
                    format!(
                        "a batch of {total} rows leaves data-parallel rank {} of {} without \
                         rows; use batches of at least {} rows",
                        data.rank(),
                        data.size(),
                        data.size()
                    ),
                ));
            }
            rows.push((mine.len(), total));
            items.push(Some(batch.rows(mine)));
        }
        let mut outputs = Vec::with_capacity(micro);
        let Trainee::Whole { model, mut engine } =
            std::mem::replace(&mut built.trainee, Trainee::Lost)
        else {
            return Err(Error::invalid(
                "layout",
                "the burn-train strategy trains whole models; pipeline layouts are not supported",
            ));
        };
        let mut forward = |m: &P::Model, k: usize| {
            let item = items[k].take().ok_or_else(|| {
                Error::invalid(
                    "micro-batch",
                    format!("micro-batch {k} was asked for twice"),
                )
            })?;
            let output = m.forward_train(item);
            // Each rank's mean weighted by its share of the rows: the engine's average over
            // the ranks is then the mean over the global batch, even when the rows do not
            // split evenly. burn-train sums the gradients of accumulated batches where the
            // engine averages its micro-batches: scaled by their number to match.
            let (mine, total) = rows[k];
            let scale = (mine * data.size() * micro) as f32 / total as f32;
            let loss = output.loss() * scale;
            outputs.push(output);
            Ok(loss)
        };
        let (model, _) = engine.step_accumulated(model, micro, &mut forward, lr)?;
        built.trainee = Trainee::Whole { model, engine };
        outputs
            .into_iter()
            .zip(rows)
            .map(|(output, (mine, total))| output.gather(data, mine, total))
            .collect()
    }

    /// The validation split: each rank's rows of every batch, the outputs gathered to rank 0's
    /// processor.
    fn validate(
        &self,
        built: &Built<P>,
        data: &ProcessGroup,
        valid: &ValidLoader<P::Model>,
        run: &mut Run<'_, P::Model>,
    ) -> Result<(), Error> {
        let Some(model) = built.model() else {
            return Err(Error::invalid("layout", "no whole model to validate"));
        };
        let model = model.valid();
        let mut iterator = valid.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let item = item.map_err(|e| Error::invalid("dataset", e.to_string()))?;
            let total = item.num_rows();
            let mine = rows_of(total, data.size(), data.rank());
            let rows = mine.len();
            let output = InferenceStep::step(&model, item.rows(mine));
            let output = output.gather(data, rows, total)?;
            iteration += 1;
            let item = TrainingItem::new(output, iterator.progress(), Some(iteration), None);
            run.valid_event(LearnerEvent::ProcessedItem(item));
        }
        Ok(())
    }
}

impl<P> SupervisedLearningStrategy<P::Model> for LayoutStrategy<P>
where
    P: ParallelModel,
    P::Model: LearnerModel + TrainForward,
    <P::Model as TrainStep>::Input: Rows,
    <P::Model as InferenceStep>::Input: Rows,
    <P::Model as TrainStep>::Output: GatherOutput,
    <P::Model as InferenceStep>::Output: GatherOutput,
{
    fn fit(
        &self,
        components: TrainingComponents<P::Model>,
        mut learner: Learner<P::Model>,
        train: TrainLoader<P::Model>,
        valid: ValidLoader<P::Model>,
        starting_epoch: usize,
    ) -> (P::Model, SupervisedTrainingEventProcessor<P::Model>) {
        let TrainingComponents {
            num_epochs,
            checkpoint,
            checkpointer,
            grad_accumulation,
            interrupter,
            mut early_stopping,
            mut event_processor,
            event_store,
            ..
        } = components;
        let mut run = Run {
            processor: &mut event_processor,
            interrupter: &interrupter,
            event_store: &event_store,
            early_stopping: &mut early_stopping,
            rank0: self.world.rank() == 0,
        };
        let result = match checkpointer {
            Some(_) => Err(Error::invalid(
                "checkpointers",
                "burn-train's checkpointers hold one device's optimizer state, not a sharded \
                 one: remove with_default_checkpointers/with_custom_checkpointers; \
                 LayoutStrategy saves reshardable checkpoints under its directory at the end \
                 of every epoch, and SupervisedTraining::checkpoint(epoch) resumes them",
            )),
            None => self.run(
                &mut run,
                &mut learner,
                train,
                valid,
                starting_epoch..num_epochs + 1,
                checkpoint,
                grad_accumulation.unwrap_or(1).max(1),
            ),
        };
        let model = match result {
            Ok(model) => model,
            Err(error) => {
                // The other ranks may wait in a collective this rank will not call: they fail
                // at once, naming this rank's error, instead of at the timeout.
                self.world.abort(&error.to_string());
                interrupter.fail(TrainingError::Workers(vec![WorkerFailure {
                    device_id: self.world.rank(),
                    message: error.to_string(),
                }]));
                learner.model()
            }
        };
        (model, event_processor)
    }
}
