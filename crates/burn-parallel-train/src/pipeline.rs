//! Pipeline parallelism through the builder: a model that can be cut into stages
//! ([`StagedModel`]) trains under a layout with `pp > 1` by the same [`crate::build()`] and
//! [`crate::fit()`] as under any other layout.
//!
//! The pieces, and who owns what:
//!
//! - the user's [`StagedModel`] says how to build stage `i` of `n` (its layers, from the same
//!   seeded [`Init`] as the whole model, so that each rank holds exactly its stages'
//!   single-device parameters) and the whole model's path of each stage parameter;
//! - [`PipelineEngine`] owns this rank's stages, burn-pipeline's [`Executor`] (the schedule of
//!   the layout over the pipeline group, its activation checkpointing and precision), and its
//!   [`StageUpdater`] (tensor-parallel fix-ups, data-parallel reduction or a ZeRO-1/2 optimizer
//!   per stage over the stage's replicas, the clipping norm over every stage, tied weights);
//! - [`crate::fit()`] gives it each step's micro-batches (the step's micro-steps are the
//!   pipeline's micro-batches) and saves and resumes it under the whole model's names, so that
//!   a pipelined checkpoint loads under any other layout and the other way round.
//!
//! Why the pipeline is not a [`burn_parallel::train::StepEngine`]: that trait's step takes a
//! closure from the whole model to a loss, and a pipeline rank holds neither the whole model
//! nor, except on the last stage, a loss; the executor needs each micro-batch's *inputs* at
//! the times its schedule says. So the builder holds either a whole model and its engine or a
//! pipeline ([`crate::Trainee`]), and [`crate::fit()`] drives both from the same micro-batches.

use std::any::Any;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::AdamW;
use burn::tensor::{Device, TensorData};
use burn_parallel::checkpoint::{Checkpoint, Checkpointer};
use burn_parallel::init::Init;
use burn_parallel::nn::TpContext;
use burn_parallel::replica::verify_replicas_in;
use burn_parallel::tensor_parallel::SeededDropout;
use burn_parallel::train::{SaveState, StepOutput, StepPhases, TrainStep};
use burn_parallel::{DistributedDataParallel, Error, ProcessGroup, ReduceOp};
use burn_pipeline::runtime::{Checkpointing, Executor, StepReport};
use burn_pipeline::simulate::{Costs, simulate};
use burn_pipeline::stage::Stage;
use burn_pipeline::trace::Timeline;
use burn_pipeline::update::{StageOptimizer, StageUpdater};
use burn_pipeline::{ActionKind, generators, partition};
use burn_zero::{ShardGroups, ZeroConfig, ZeroOptimizer};
use serde_json::Value;

use crate::layout::{Layout, Recompute};
use crate::model::{Groups, ParallelModel, StepSettings};
pub use crate::model::{PipelineSteps, Stager};

/// A parameter's path, shape and values, as the stages gather them.
type NamedValues = (String, Vec<usize>, Vec<f32>);

/// The whole model's path of a stage parameter's local path (`layers.0.attn.q.weight` of a
/// stage whose first layer is 4 is `layers.4.attn.q.weight`).
pub type PathMap = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// A [`ParallelModel`] that can be cut into pipeline stages: an input part (first stage), a
/// sequence of layers split among the stages, an output part with the loss (last stage).
/// burn-pipeline's `Sequential` is such a stage; implement [`ParallelModel::stages`] as
/// `Some(self)` to train under `pp > 1`.
pub trait StagedModel: ParallelModel {
    /// One stage of the model on this rank.
    type Stage: Stage<Self::Batch> + 'static;

    /// The layers the stages split (the blocks between the input and the output parts).
    fn n_layers(&self) -> usize;

    /// The layers of each of `num_stages` stages (default: the same count each, the first
    /// stages one more).
    ///
    /// # Errors
    /// More stages than layers, or the model's own split refused.
    fn split(&self, num_stages: usize) -> Result<Vec<Range<usize>>, Error> {
        partition::by_count(self.n_layers(), num_stages).map_err(|e| Error::invalid("--pp", e))
    }

    /// Builds stage `parts.index` (see [`StageParts`]).
    ///
    /// # Errors
    /// Whatever the model's build refuses.
    fn stage(&self, parts: &StageParts<'_>) -> Result<Self::Stage, Error>;

    /// The whole model's path of each local path of `stage`: the names its checkpoints are
    /// saved under, so that the single-device model and every other layout load them.
    fn model_paths(stage: &Self::Stage) -> PathMap;

    /// The stage's copy of a weight tied between the first and the last stage (a tied token
    /// table), if any: its gradients are summed over the two copies.
    fn tied_weight(_stage: &Self::Stage) -> Option<ParamId> {
        None
    }

    /// The stage's dropout layers by the whole model's names (`blocks.3.attn.drop`), whose
    /// positions [`crate::fit()`] saves and restores; default none.
    fn stage_dropout_layers(_stage: &Self::Stage) -> Vec<(String, SeededDropout)> {
        Vec::new()
    }

    /// Dimensions of the boundary tensors that may differ between micro-batches (`[1]`, the
    /// sequence, for micro-batches of other lengths); default none.
    fn variable_dims(&self) -> Vec<usize> {
        Vec::new()
    }
}

/// What the builder gives [`StagedModel::stage`].
pub struct StageParts<'a> {
    /// The seed, the device and the tensor-parallel plan (the same as the whole model's).
    pub init: &'a Init,
    /// The stage's index.
    pub index: usize,
    /// Stages in the pipeline.
    pub num_stages: usize,
    /// The model's layers this stage holds.
    pub layers: Range<usize>,
    /// This rank's data-parallel index: the stream of its dropout masks.
    pub data_rank: usize,
    /// The schedule splits the backward (zero-bubble schedules): the stage's linears defer
    /// their weight gradients (`Sequential::with_deferred_weights` and
    /// `burn_parallel::nn::Linear::with_deferred_weight`).
    pub defer_weights: bool,
    /// Recompute each layer in the backward (`Sequential::with_checkpointed_layers`).
    pub recompute_layers: bool,
}

impl<T: StagedModel + 'static> Stager<T> for T {
    fn place(
        &self,
        world: &ProcessGroup,
        layout: &Layout,
        device: &Device,
        settings: &StepSettings,
    ) -> Result<(Groups, Box<dyn PipelineSteps<T>>), Error> {
        let (groups, engine) = PipelineEngine::new(self, world, layout, device, settings)?;
        Ok((groups, Box::new(engine)))
    }
}

/// This rank's stages of a [`StagedModel`] under a pipeline layout, with the executor and the
/// updater that step them.
pub struct PipelineEngine<P: StagedModel> {
    stages: BTreeMap<usize, P::Stage>,
    executor: Executor,
    updater: StageUpdater<AdamW>,
    data: ProcessGroup,
    pp: ProcessGroup,
    tp: TpContext,
    split: Vec<Range<usize>>,
    device: Device,
    last: Option<StepReport>,
}

impl<P: StagedModel> PipelineEngine<P> {
    /// Places `model`'s pipeline of `layout` on this rank of `world` (mesh `pp x dp x tp`):
    /// the schedule over `settings.grad_accum` micro-batches, the split, this rank's stages,
    /// an AdamW (or ZeRO-1/2 over the stage's replicas) per stage, and the check that the
    /// replicas agree. Every rank calls it.
    ///
    /// # Errors
    /// A schedule or split that cannot be made (naming its flag), a stage that cannot be
    /// built, collective failures, replicas that differ.
    pub fn new(
        model: &P,
        world: &ProcessGroup,
        layout: &Layout,
        device: &Device,
        settings: &StepSettings,
    ) -> Result<(Groups, Self), Error> {
        let dims = layout.dims(world.size());
        let mesh = dims.build(world)?;
        let pp = mesh.group("pp")?.clone();
        let data = dims.data_parallel(&mesh)?;
        let p = layout.pipeline;
        let micro = settings.grad_accum.max(1);
        let schedule = generators::generate(p.schedule, layout.pp, micro, p.virtual_stages)
            .map_err(|e| Error::invalid("--schedule", e))?;
        let num_stages = schedule.num_stages();
        let split = model.split(num_stages)?;
        let mut executor = Executor::new(schedule, pp.clone(), device.clone())?
            .with_variable_dims(&model.variable_dims())
            .with_checkpointing(match p.recompute {
                Recompute::Stages => Checkpointing::All,
                Recompute::Off | Recompute::Blocks => Checkpointing::Off,
            });
        let init =
            Init::new(model.seed(), device).with_tp(mesh.group("tp")?, model.tp_plan(layout.sp))?;
        let tp = init.context();
        // Zero-bubble schedules split the backward: the linears defer their weight gradients.
        let defer_weights = executor
            .schedule()
            .programs()
            .iter()
            .flatten()
            .any(|a| a.kind() == ActionKind::BackwardWeight);
        let mut stages = BTreeMap::new();
        for index in executor.local_stages() {
            let parts = StageParts {
                init: &init,
                index,
                num_stages,
                layers: split[index].clone(),
                data_rank: data.rank(),
                defer_weights,
                recompute_layers: p.recompute == Recompute::Blocks,
            };
            stages.insert(index, model.stage(&parts)?);
        }
        verify_stages::<P>(&stages, &data)?;
        let adamw = settings.adamw_config();
        let mut optims = BTreeMap::new();
        for (&s, stage) in &stages {
            let optim = match layout.zero {
                None => StageOptimizer::Module(adamw.init()),
                Some(kind) => {
                    // Clipped by the norm over every stage (`StageUpdater::finish`).
                    let config = ZeroConfig::new(kind)
                        .with_bucket_bytes(settings.bucket_bytes)
                        .with_max_grad_norm(settings.max_grad_norm);
                    let paths = P::model_paths(stage);
                    let zero = ZeroOptimizer::new(
                        stage,
                        ShardGroups::flat(data.clone()),
                        config,
                        adamw.build(),
                    )?
                    .with_tensor_parallel(&tp)
                    .with_logical_names(move |path| paths(path));
                    StageOptimizer::Zero(Box::new(zero))
                }
            };
            optims.insert(s, optim);
        }
        // Tensor-parallel fix-ups, then data parallelism, under the precision policy: the
        // executor runs the stages' compute copies and scales the loss; the updater reduces,
        // unscales, and skips a step that overflowed on any stage.
        let mut reduce = TrainStep::new(tp.clone()).with_precision(settings.precision);
        if let Some(scaler) = &settings.loss_scaler {
            reduce = reduce.with_loss_scaler(scaler.clone());
        }
        executor = executor.with_precision(&reduce);
        if data.size() > 1 {
            reduce = reduce.with_ddp(
                DistributedDataParallel::new(data.clone()).with_bucket_bytes(settings.bucket_bytes),
            );
        }
        let mut updater =
            StageUpdater::new(&executor, optims, reduce)?.with_clip(settings.max_grad_norm);
        for (&s, stage) in &stages {
            if let Some(id) = P::tied_weight(stage) {
                updater = updater.with_tied(s, id)?;
            }
        }
        let groups = Groups {
            world: world.clone(),
            dims,
            data: data.clone(),
            reduce: data.clone(),
            replicate: data.clone(),
            shard: data.clone(),
            mesh,
        };
        let engine = Self {
            stages,
            executor,
            updater,
            data,
            pp,
            tp,
            split,
            device: device.clone(),
            last: None,
        };
        Ok((groups, engine))
    }

    /// This rank's stages, by index.
    pub fn stages(&self) -> &BTreeMap<usize, P::Stage> {
        &self.stages
    }

    /// The executor (its schedule, its group).
    pub fn executor(&self) -> &Executor {
        &self.executor
    }

    /// The whole model's name of a stage's local path.
    fn name(stage: &P::Stage, path: &str) -> String {
        P::model_paths(stage)(path)
    }
}

/// Checks that each of `stages` agrees with its replicas over `data` (naming the first
/// parameter that differs).
fn verify_stages<P: StagedModel>(
    stages: &BTreeMap<usize, P::Stage>,
    data: &ProcessGroup,
) -> Result<(), Error> {
    for stage in stages.values() {
        verify_replicas_in(stage, &[data], |_| true)?;
    }
    Ok(())
}

impl<P: StagedModel + 'static> PipelineSteps<P> for PipelineEngine<P> {
    fn step(&mut self, batches: &[P::Batch], lr: f64) -> Result<StepOutput, Error> {
        self.updater.set_lr(lr);
        let updater = &mut self.updater;
        let report = self
            .executor
            .step(&mut self.stages, batches, &mut |s, stage, grads| {
                updater.at_reduce(s, stage, grads)
            })?;
        let grad_norm = self.updater.finish(&mut self.stages, &report)?;
        let skipped = self.updater.skipped();
        let loss = self.data.all_reduce_f32(vec![report.loss], ReduceOp::Avg)?[0];
        self.last = Some(report);
        Ok(StepOutput {
            loss,
            grad_norm,
            skipped,
            phases: StepPhases::default(),
        })
    }

    fn save(&self, saver: &mut Checkpointer, step: usize, state: SaveState) -> Result<(), Error> {
        Ok(self
            .updater
            .save(saver, step, &self.stages, &Self::name, state)?)
    }

    fn load(&mut self, checkpoint: &Checkpoint) -> Result<Value, Error> {
        Ok(self
            .updater
            .load(checkpoint, &mut self.stages, &Self::name)?)
    }

    fn load_params(&mut self, tensors: &BTreeMap<String, TensorData>) -> Result<(), Error> {
        Ok(self
            .updater
            .load_params(tensors, &mut self.stages, &Self::name)?)
    }

    fn verify_replicas(&self) -> Result<(), Error> {
        verify_stages::<P>(&self.stages, &self.data)
    }

    fn whole_params(&self) -> Result<BTreeMap<String, TensorData>, Error> {
        let mut mine = Vec::new();
        for stage in self.stages.values() {
            for (path, data) in self.tp.full_params(&stage.valid())? {
                let shape = data.shape().to_vec();
                let values = data
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .map_err(|e| Error::invalid("parameters", format!("{path}: {e:?}")))?;
                mine.push((Self::name(stage, &path), shape, values));
            }
        }
        let all: Vec<Vec<NamedValues>> = self.pp.all_gather_object(&mine)?;
        Ok(all
            .into_iter()
            .flatten()
            .map(|(path, shape, values)| (path, TensorData::new(values, shape)))
            .collect())
    }

    fn dropout_layers(&self) -> Vec<(String, SeededDropout)> {
        self.stages
            .values()
            .flat_map(P::stage_dropout_layers)
            .collect()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn held_params(&self) -> usize {
        self.stages.values().map(Module::num_params).sum()
    }

    fn split(&self) -> &[Range<usize>] {
        &self.split
    }

    fn last_step(&self) -> Option<&StepReport> {
        self.last.as_ref()
    }

    fn loss_scale(&self) -> f64 {
        self.updater.train_step().loss_scale()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The last step's bubble measured on `timeline` (every rank's track) beside the simulator's
/// prediction for `layout`'s schedule of `micro_batches` from the step's own action times, in
/// one line: how much of the pipeline idled, and whether the schedule explains it.
pub fn bubble_summary(layout: &Layout, micro_batches: usize, timeline: &Timeline) -> String {
    let costs = Costs::from_timeline(timeline);
    let p = layout.pipeline;
    let predicted = generators::generate(p.schedule, layout.pp, micro_batches, p.virtual_stages)
        .ok()
        .and_then(|schedule| simulate(&schedule, &costs).ok());
    let ms = |t: f64| 1000.0 * t;
    format!(
        "last step: bubble {:.1}% measured over {} ranks, {} predicted from its action times \
         (F {:.1} ms, B {:.1} ms, I {:.1} ms, W {:.1} ms)",
        100.0 * timeline.bubble_fraction(),
        timeline.tracks.len(),
        predicted.map_or("-".into(), |r| format!("{:.1}%", 100.0 * r.bubble_fraction)),
        ms(costs.forward),
        ms(costs.backward),
        ms(costs.backward_input),
        ms(costs.backward_weight),
    )
}
