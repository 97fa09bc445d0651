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
use std::time::Instant;

use burn::module::{Module, ParamId};
use burn::optim::AdamW;
use burn::tensor::{Device, TensorData};
use burn_parallel::checkpoint::{Checkpoint, Checkpointer};
use burn_parallel::index::ParamIndex;
use burn_parallel::init::Init;
use burn_parallel::muon::MatrixStep;
use burn_parallel::nn::TpContext;
use burn_parallel::replica::verify_replicas_in;
use burn_parallel::tensor_parallel::SeededDropout;
use burn_parallel::train::{SaveState, StepOutput, StepPhases, TrainStep};
use burn_parallel::{DistributedDataParallel, Error, ProcessGroup, ReduceOp};
use burn_pipeline::runtime::{Checkpointing, Executor, StepReport};
use burn_pipeline::simulate::{Costs, simulate};
use burn_pipeline::stage::{Boundary, BoundaryTensor, Stage, StageError, StageOutput};
use burn_pipeline::trace::Timeline;
use burn_pipeline::update::{StageOptimizer, StageUpdater};
use burn_pipeline::{ActionKind, generators, partition};
use burn_zero::{ShardGroups, ZeroConfig, ZeroOptimizer};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::build::mesh_group;
use crate::layout::{Layout, Optim, Recompute};
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
    /// stages one more). A model balances its stages otherwise by returning
    /// [`split_layers`]`(self, num_stages, &balance, device)` with a [`Balance`] of its
    /// settings (by parameters, explicit boundaries, measured times); `device` is where the
    /// stages will live (the builder's), on which [`Balance::Params`] builds its probes.
    ///
    /// # Errors
    /// More stages than layers, or the model's own split refused.
    fn split(&self, num_stages: usize, device: &Device) -> Result<Vec<Range<usize>>, Error> {
        split_layers(self, num_stages, &Balance::Count, device)
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

/// How a [`StagedModel`]'s layers are split among the stages ([`split_layers`]): the first
/// stage also holds the model's input part and the last its output part, so a balanced split
/// may give them fewer layers.
///
/// # Example
/// ```
/// use burn_parallel_train::pipeline::{Balance, LayerTimes};
///
/// assert_eq!(Balance::default(), Balance::Count);
/// let times = Balance::Times(LayerTimes { first: 1.0, layer: 2.0, last: 4.0 });
/// let json = r#"{"times":{"first":1.0,"layer":2.0,"last":4.0}}"#;
/// assert_eq!(serde_json::to_string(&times).unwrap(), json);
/// assert_eq!(serde_json::from_str::<Balance>(r#""params""#).unwrap(), Balance::Params);
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// The same number of layers per stage (the first stages take one more).
    #[default]
    Count,
    /// Balanced by parameter count: the input part counted on the first stage, the output
    /// part on the last (a weight tied to the input part's, counted there, not twice).
    Params,
    /// Stage `i + 1` starts at layer `boundaries[i]`.
    Explicit(Vec<usize>),
    /// Balanced by given costs per micro-batch (seconds, or any unit), as
    /// [`measure_layer_times`] measures them.
    Times(LayerTimes),
}

/// The cost of each part of a [`StagedModel`] for one micro-batch (forward + backward time in
/// seconds from [`measure_layer_times`], or any unit): what [`Balance::Times`] splits by.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerTimes {
    /// The input part (first stage only).
    pub first: f64,
    /// One layer.
    pub layer: f64,
    /// The output part with the loss (last stage only).
    pub last: f64,
}

/// The layers of each of `num_stages` stages of `model`, split as `balance` says. Explicit
/// boundaries and given times need no model build; [`Balance::Params`] builds three probe
/// stages on `device` (the input part alone, one layer, the output part alone: stages of a
/// three-stage pipeline, from the model's seed) and counts their parameters, a weight the
/// output part ties to the input part's ([`StagedModel::tied_weight`]) counted once.
///
/// A model that balances its stages overrides [`StagedModel::split`] with
/// `split_layers(self, num_stages, &self.balance, device)`.
///
/// # Errors
/// [`Error::Invalid`] for `--pp` when the layers do not split: more stages than layers,
/// explicit boundaries that are not `num_stages - 1` increasing layers inside the model,
/// negative or non-finite times; a probe stage the model cannot build.
pub fn split_layers<M: StagedModel + ?Sized>(
    model: &M,
    num_stages: usize,
    balance: &Balance,
    device: &Device,
) -> Result<Vec<Range<usize>>, Error> {
    let n = model.n_layers();
    let pp = |e: partition::PartitionError| Error::invalid("--pp", e);
    let times = match balance {
        Balance::Count => return partition::by_count(n, num_stages).map_err(pp),
        Balance::Explicit(b) => return partition::explicit(n, num_stages, b).map_err(pp),
        Balance::Params => {
            // The feasibility first: no probe is built for a split that cannot be made.
            partition::by_count(n, num_stages).map_err(pp)?;
            param_counts(model, device)?
        }
        Balance::Times(t) => *t,
    };
    partition::balanced(&vec![times.layer; n], num_stages, times.first, times.last).map_err(pp)
}

/// The three probe stages of `model` on `device`: stage 0 of 3 without layers (the input
/// part), stage 1 of 3 with one layer, stage 2 of 3 without layers (the output part).
fn probes<M: StagedModel + ?Sized>(model: &M, device: &Device) -> Result<[M::Stage; 3], Error> {
    let init = Init::new(model.seed(), device);
    let probe = |index: usize, layers: Range<usize>| {
        model.stage(&StageParts {
            init: &init,
            index,
            num_stages: 3,
            layers,
            data_rank: 0,
            defer_weights: false,
            recompute_layers: false,
        })
    };
    Ok([probe(0, 0..0)?, probe(1, 0..1)?, probe(2, 0..0)?])
}

/// The parameters of `model`'s input part, of one layer and of its output part (less a weight
/// tied to the input part's), from its [`probes`].
fn param_counts<M: StagedModel + ?Sized>(model: &M, device: &Device) -> Result<LayerTimes, Error> {
    let [first, layer, last] = probes(model, device)?;
    let count = |stage: &M::Stage| ParamIndex::of(stage).numel() as f64;
    let index = ParamIndex::of(&last);
    let tied = M::tied_weight(&last)
        .and_then(|id| index.get(id))
        .map_or(0, |entry| entry.numel());
    Ok(LayerTimes {
        first: count(&first),
        layer: count(&layer),
        last: (index.numel() - tied) as f64,
    })
}

/// Measures the forward + backward time of `model`'s input part, of one layer and of its
/// output part (with the loss) on the micro-batch `batch`, on `device` (an autodiff device):
/// the median of `repeats` runs of each after a warm-up, each part timed alone on its probe
/// stage (stages 0, 1 and 2 of a three-stage pipeline with no layer, one layer and no layer,
/// built from the model's seed). The layer and the output part take the input part's output
/// on `batch` (as fresh leaves), so their inputs have the real boundary's shapes. The result
/// is this rank's: average it over the ranks before splitting, so that every rank splits alike.
///
/// # Errors
/// A probe stage the model cannot build or run ([`Error::Invalid`] for `measuring layer
/// times`, naming the probe).
pub fn measure_layer_times<M: StagedModel + ?Sized>(
    model: &M,
    batch: &M::Batch,
    device: &Device,
    repeats: usize,
) -> Result<LayerTimes, Error> {
    let [first, layer, last] = probes(model, device)?;
    let fail = |probe: &str, e: &dyn std::fmt::Display| {
        Error::invalid("measuring layer times", format!("the {probe} probe: {e}"))
    };
    // What the input part hands on, detached: each run of the others takes it as new leaves.
    let handed = match first.forward(Boundary::new(), batch) {
        Ok(StageOutput::Boundary(b)) => Boundary::from_parts(
            b.tensors()
                .iter()
                .map(|t| detached(t, false))
                .collect::<Result<_, _>>()
                .map_err(|e| fail("input", &e))?,
            b.meta_value().clone(),
        ),
        Ok(StageOutput::Loss(_)) => {
            return Err(fail(
                "input",
                &"stage 0 of 3 returned a loss, not a boundary",
            ));
        }
        Err(e) => return Err(fail("input", &e)),
    };
    let leaves = || -> Result<Boundary, StageError> {
        let tensors = handed.tensors().iter().map(|t| detached(t, true));
        let tensors = tensors.collect::<Result<_, StageError>>()?;
        Ok(Boundary::from_parts(tensors, handed.meta_value().clone()))
    };
    let time = |probe: &str, stage: &M::Stage, input: &dyn Fn() -> Result<Boundary, StageError>| {
        let sync = || device.sync().map_err(|e| fail(probe, &format!("{e:?}")));
        let mut runs = Vec::with_capacity(repeats.max(1) + 1);
        for _ in 0..=repeats.max(1) {
            let input = input().map_err(|e| fail(probe, &e))?;
            sync()?;
            let t0 = Instant::now();
            let seed = match stage.forward(input, batch).map_err(|e| fail(probe, &e))? {
                StageOutput::Loss(loss) => Some(loss),
                StageOutput::Boundary(b) => b
                    .tensors()
                    .iter()
                    .map(|t| t.flat().clone().sum())
                    .reduce(|a, b| a + b),
            };
            if let Some(seed) = seed {
                let _grads = seed.backward();
            }
            sync()?;
            runs.push(t0.elapsed().as_secs_f64());
        }
        runs.remove(0); // the warm-up
        runs.sort_by(f64::total_cmp);
        Ok::<_, Error>(runs[runs.len() / 2])
    };
    Ok(LayerTimes {
        first: time("input", &first, &|| Ok(Boundary::new()))?,
        layer: time("layer", &layer, &leaves)?,
        last: time("output", &last, &leaves)?,
    })
}

/// `tensor` detached from its graph, with its shape: a leaf that requires a gradient when
/// `grad`.
fn detached(tensor: &BoundaryTensor, grad: bool) -> Result<BoundaryTensor, StageError> {
    macro_rules! of_rank {
        ($($rank:literal)*) => {
            match tensor.shape().len() {
                $($rank => {
                    let t = tensor.get::<$rank>()?.detach();
                    Ok(BoundaryTensor::new(if grad { t.require_grad() } else { t }))
                })*
                rank => Err(StageError::new(format!(
                    "a boundary tensor of rank {rank}: the probes take ranks 1 to 6"
                ))),
            }
        };
    }
    of_rank!(1 2 3 4 5 6)
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
        let split = model.split(num_stages, device)?;
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
        // Muon: a ZeRO stage's matrices are split over its data-parallel ranks and tp, a
        // Burn-optimized stage's over tp only (its data-parallel ranks are replicas).
        let muon = layout.optim == Optim::Muon;
        let data_tp = match (muon, layout.zero) {
            (true, Some(_)) => Some(
                mesh_group(&mesh, &["dp_replicate", "dp_shard", "tp"])?
                    .unwrap_or_else(|| data.clone()),
            ),
            _ => None,
        };
        let tp_holders = match (muon, layout.zero) {
            (true, None) => mesh_group(&mesh, &["tp"])?,
            _ => None,
        };
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
                    let zero = match &data_tp {
                        Some(holders) => zero.with_matrix_step(
                            MatrixStep::new(settings.muon.build()).with_holders(holders.clone()),
                        ),
                        None => zero,
                    };
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
        if muon && layout.zero.is_none() {
            for (&s, stage) in &stages {
                let mut matrix = MatrixStep::new(settings.muon.build()).with_replicas(data.clone());
                if let Some(holders) = &tp_holders {
                    matrix = matrix.with_holders(holders.clone());
                }
                updater = updater.with_matrix_step(s, matrix, P::model_paths(stage))?;
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

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::tensor::Tensor;
    use burn_moe::MoeParallel;
    use burn_parallel::plan::TpPlan;
    use burn_pipeline::sequential::{InputLayer, Layer, OutputLayer, Sequential};
    use burn_zero::FsdpPlan;

    use super::*;
    use crate::model::ModelParts;

    const VOCAB: usize = 16;
    const WIDTH: usize = 4;

    /// A token table: rows of ones times the table (`[rows, 3, WIDTH]`); the batch is the rows.
    #[derive(Module, Debug)]
    struct Embed {
        table: Param<Tensor<2>>,
    }
    impl InputLayer<usize> for Embed {
        fn forward(&self, rows: &usize) -> Result<Tensor<3>, StageError> {
            let x = Tensor::<2>::ones([rows * 3, VOCAB], &self.table.device());
            Ok(x.matmul(self.table.val()).reshape([*rows, 3, WIDTH]))
        }
    }

    #[derive(Module, Debug)]
    struct Mix {
        w: Param<Tensor<2>>,
    }
    impl Layer<usize> for Mix {
        fn forward(&self, x: Tensor<3>, rows: &usize) -> Result<Tensor<3>, StageError> {
            let y = x.reshape([rows * 3, WIDTH]).matmul(self.w.val()).tanh();
            Ok(y.reshape([*rows, 3, WIDTH]))
        }
    }

    /// A head tied to the token table (its own copy, summed with the first stage's), and a
    /// scale per token.
    #[derive(Module, Debug)]
    struct Head {
        table: Param<Tensor<2>>,
        scale: Param<Tensor<1>>,
    }
    impl OutputLayer<usize> for Head {
        fn loss(&self, x: Tensor<3>, rows: &usize) -> Result<Tensor<1>, StageError> {
            let logits = x
                .reshape([rows * 3, WIDTH])
                .matmul(self.table.val().transpose());
            let scaled = logits * self.scale.val().unsqueeze::<2>();
            Ok(scaled.powi_scalar(2).mean())
        }
    }

    type Toy = Sequential<Embed, Mix, Head>;

    struct ToyConfig {
        n_layers: usize,
    }

    impl ParallelModel for ToyConfig {
        type Model = Toy;
        type Batch = usize;
        fn loss(model: &Toy, rows: &usize) -> Result<burn::tensor::Tensor<1>, Error> {
            match model.forward(Boundary::new(), rows) {
                Ok(StageOutput::Loss(loss)) => Ok(loss),
                _ => Err(Error::invalid("toy", "no loss")),
            }
        }
        fn n_heads(&self) -> usize {
            1
        }
        fn seed(&self) -> u64 {
            7
        }
        fn tp_plan(&self, _: bool) -> TpPlan {
            TpPlan::new()
        }
        fn fsdp_plan(&self, shard: &ProcessGroup, _: &MoeParallel) -> FsdpPlan {
            FsdpPlan::new(shard)
        }
        fn build(&self, parts: &ModelParts) -> Result<Toy, Error> {
            let stage = StageParts {
                init: &parts.init,
                index: 0,
                num_stages: 1,
                layers: 0..self.n_layers,
                data_rank: 0,
                defer_weights: false,
                recompute_layers: false,
            };
            self.stage(&stage)
        }
    }

    impl StagedModel for ToyConfig {
        type Stage = Toy;
        fn n_layers(&self) -> usize {
            self.n_layers
        }
        fn stage(&self, parts: &StageParts<'_>) -> Result<Toy, Error> {
            let init = parts.init;
            let table = || init.normal("table", [VOCAB, WIDTH], 0.1);
            Sequential::build(
                parts.index,
                parts.num_stages,
                parts.layers.clone(),
                || Ok(Embed { table: table() }),
                |i| {
                    Ok(Mix {
                        w: init.at("layers").at(i).normal("w", [WIDTH, WIDTH], 0.1),
                    })
                },
                || {
                    Ok(Head {
                        table: table(),
                        scale: init.ones([VOCAB]),
                    })
                },
            )
        }
        fn model_paths(_: &Toy) -> PathMap {
            Arc::new(str::to_string)
        }
        fn tied_weight(stage: &Toy) -> Option<ParamId> {
            let first = stage.input.as_ref().map(|i| i.table.id);
            first.or_else(|| stage.output.as_ref().map(|o| o.table.id))
        }
    }

    fn split(
        n_layers: usize,
        stages: usize,
        balance: &Balance,
    ) -> Result<Vec<Range<usize>>, Error> {
        split_layers(&ToyConfig { n_layers }, stages, balance, &Device::flex())
    }

    #[test]
    fn count_and_explicit_splits() {
        let by_count = split(8, 3, &Balance::Count).unwrap();
        assert_eq!(by_count, vec![0..3, 3..6, 6..8]);
        // The trait's default split is the count.
        let toy = ToyConfig { n_layers: 8 };
        assert_eq!(toy.split(3, &Device::flex()).unwrap(), by_count);
        let explicit = split(8, 3, &Balance::Explicit(vec![1, 6])).unwrap();
        assert_eq!(explicit, vec![0..1, 1..6, 6..8]);
        for bad in [Balance::Explicit(vec![6, 1]), Balance::Explicit(vec![1])] {
            let e = split(8, 3, &bad).unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { what, .. } if what == "--pp"),
                "{e}"
            );
        }
        assert!(split(2, 3, &Balance::Count).is_err());
        assert!(split(2, 3, &Balance::Params).is_err());
    }

    /// The parameters: the table (64) on the first stage, 16 per layer, and on the last the
    /// scale (16) but not the tied copy of the table.
    #[test]
    fn params_count_the_probes_and_a_tied_weight_once() {
        let counts = param_counts(&ToyConfig { n_layers: 8 }, &Device::flex()).unwrap();
        let (table, layer) = ((VOCAB * WIDTH) as f64, (WIDTH * WIDTH) as f64);
        let expected = LayerTimes {
            first: table,
            layer,
            last: VOCAB as f64,
        };
        assert_eq!(counts, expected);
        let by_params = split(8, 4, &Balance::Params).unwrap();
        assert_eq!(by_params, split(8, 4, &Balance::Times(expected)).unwrap());
        let balanced = partition::balanced(&[layer; 8], 4, table, VOCAB as f64).unwrap();
        assert_eq!(by_params, balanced);
        // The heavy table leaves the first stage fewer layers than by count.
        assert!(by_params[0].len() < 2, "{by_params:?}");
    }

    #[test]
    fn times_split_and_refuse_bad_times() {
        let heavy_head = LayerTimes {
            first: 0.5,
            layer: 1.0,
            last: 4.0,
        };
        let split_by = |t| split(8, 4, &Balance::Times(t));
        assert_eq!(split_by(heavy_head).unwrap()[3].len(), 1);
        let negative = LayerTimes {
            layer: -1.0,
            ..heavy_head
        };
        assert!(split_by(negative).is_err());
    }

    #[test]
    fn measured_times_are_positive_and_split() {
        let device = Device::flex().autodiff();
        let toy = ToyConfig { n_layers: 4 };
        let t = measure_layer_times(&toy, &2, &device, 2).unwrap();
        for v in [t.first, t.layer, t.last] {
            assert!(v.is_finite() && v > 0.0, "{t:?}");
        }
        let s = split_layers(&toy, 2, &Balance::Times(t), &device).unwrap();
        assert_eq!((s.len(), s[0].start, s[1].end), (2, 0, 4));
    }

    #[test]
    fn balance_round_trips_through_json() {
        let times = Balance::Times(LayerTimes {
            first: 1.0,
            layer: 2.0,
            last: 3.0,
        });
        for b in [
            Balance::Count,
            Balance::Params,
            Balance::Explicit(vec![2, 5]),
            times,
        ] {
            let text = serde_json::to_string(&b).unwrap();
            assert_eq!(serde_json::from_str::<Balance>(&text).unwrap(), b, "{text}");
        }
        assert_eq!(Balance::default(), Balance::Count);
    }
}
