//! What happens to a stage's gradients at `REDUCE` and after the step: [`StageUpdater`], the
//! `update` callback of [`crate::runtime::Executor::step`] for the usual training setups.
//!
//! Per stage, the gradients are reduced over the stage's data-parallel replicas and stepped:
//! - with a Burn optimizer ([`StageOptimizer::Module`]): the stage's [`TrainStep`] (tensor
//!   parallel fix-ups, then DDP) reduces them at once, overlapping the rest of the pipeline;
//! - with ZeRO-1/2 ([`StageOptimizer::Zero`]): the stage's [`ZeroOptimizer`] reduces (stage 1)
//!   or reduce-scatters (stage 2) them and steps its shard; under clipping it gives the squares
//!   of its reduced gradients ([`ZeroOptimizer::gradient_squares`]) to the norm over every
//!   stage and clips by it (build it with the same `max_grad_norm`).
//!
//! Three things need more than one stage, so those stages' gradients are held until the step's
//! programme has ended ([`StageUpdater::finish`]):
//! - **dynamic loss scaling** (a [`TrainStep`] with a loss scaler, given to the executor too,
//!   [`crate::runtime::Executor::with_precision`]): each stage's gradients are unscaled and
//!   checked for inf/NaN; when any stage on any pipeline rank overflowed, no stage steps, and
//!   the scaler backs off once for the whole step, as on one device;
//! - **global-norm clipping**: the norm is summed over every stage (over the pipeline group),
//!   then every stage is clipped by the same factor, as on one device;
//! - **tied weights** ([`StageUpdater::with_tied`], a token table tied to the head): the first
//!   and the last stage each hold a copy; their gradients are summed (over the pair of ranks
//!   holding them, or in memory when one rank holds both, as ZBV's V does) before either
//!   steps, and the norm counts the weight once.
//!
//! ```
//! use std::collections::BTreeMap;
//! use burn::module::{Module, Param};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::nn::TpContext;
//! use burn_parallel::run_local;
//! use burn_parallel::train::TrainStep;
//! use burn_pipeline::generators::one_f_one_b;
//! use burn_pipeline::runtime::Executor;
//! use burn_pipeline::stage::{Boundary, Stage, StageError, StageOutput};
//! use burn_pipeline::update::{StageOptimizer, StageUpdater};
//!
//! #[derive(Module, Debug)]
//! struct Affine {
//!     w: Param<Tensor<1>>,
//!     #[module(skip)]
//!     last: bool,
//! }
//!
//! impl Stage<f32> for Affine {
//!     fn forward(&self, input: Boundary, x: &f32) -> Result<StageOutput, StageError> {
//!         let w = self.w.val();
//!         let x = match input.is_empty() {
//!             true => Tensor::<1>::from_floats([*x], &w.device()),
//!             false => input.get::<1>(0)?,
//!         };
//!         let y = x * w;
//!         Ok(match self.last {
//!             true => StageOutput::Loss(y.powf_scalar(2.0)),
//!             false => StageOutput::Boundary(Boundary::new().with(y)),
//!         })
//!     }
//! }
//!
//! let norms = run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     let mut exec = Executor::new(one_f_one_b(2, 4).unwrap(), group.clone(), device.clone())
//!         .unwrap();
//!     let w = Param::from_tensor(Tensor::from_floats([0.5], &device));
//!     let mut stages = BTreeMap::from([(group.rank(), Affine { w, last: group.rank() == 1 })]);
//!     let optimizers = BTreeMap::from([(group.rank(), StageOptimizer::module(SgdConfig::new().init()))]);
//!     let mut updater = StageUpdater::new(&exec, optimizers, TrainStep::new(TpContext::single()))
//!         .unwrap()
//!         .with_clip(Some(0.01)); // the norm over both stages
//!     updater.set_lr(0.1);
//!     let report = exec
//!         .step(&mut stages, &[1.0, 2.0, 3.0, 4.0], &mut |s, stage, g| updater.at_reduce(s, stage, g))
//!         .unwrap();
//!     Ok(updater.finish(&mut stages, &report).unwrap())
//! })
//! .unwrap();
//! assert!(norms[0].unwrap() > 0.01);
//! assert_eq!(norms[0], norms[1]); // one norm for the whole model
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::TensorData;
use burn_parallel::checkpoint::{
    self, Checkpoint, CheckpointError, Checkpointer, ParamMap, TensorSource,
};
use burn_parallel::muon::MatrixStep;
use burn_parallel::train::{
    SaveState, TrainStep, clip_to_norm, engine_states, gradient_sum, saved_engine_states,
};
use burn_parallel::{CollectiveError, ProcessGroup, ReduceOp};
use burn_zero::{ElementWise, ZeroOptimizer};
use serde_json::Value;

use crate::runtime::{Executor, PipelineError, Result, StepReport, UpdateError};

/// The optimizer of one stage.
// One per local stage, built once: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum StageOptimizer<O: ElementWise> {
    /// A Burn optimizer; the gradients are averaged over the replicas by the updater's
    /// [`TrainStep`] (DDP) first.
    Module(ModuleOptimizer),
    /// ZeRO-1/2 over the stage's replicas (it reduces the gradients itself).
    Zero(Box<ZeroOptimizer<O>>),
}

impl StageOptimizer<burn::optim::AdamW> {
    /// A Burn optimizer (`AdamWConfig::new().init()`, `SgdConfig::new().init()`, ...).
    pub fn module(optim: ModuleOptimizer) -> Self {
        Self::Module(optim)
    }
}

impl<O: ElementWise> std::fmt::Debug for StageOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Module(_) => "StageOptimizer::Module",
            Self::Zero(_) => "StageOptimizer::Zero",
        })
    }
}

/// Reduces and applies each local stage's gradients (see the [module docs](self)).
pub struct StageUpdater<O: ElementWise> {
    optims: BTreeMap<usize, StageOptimizer<O>>,
    reduce: TrainStep,
    max_norm: Option<f64>,
    pp: ProcessGroup,
    rank: usize,
    num_stages: usize,
    /// Pipeline ranks of the first and the last stage.
    ends: [usize; 2],
    /// The local copies of a tied weight, by stage.
    tied: BTreeMap<usize, ParamId>,
    /// The pair of ranks holding the two copies of a tied weight, when they differ.
    tied_pair: Option<ProcessGroup>,
    held: BTreeMap<usize, GradientsParams>,
    lr: f64,
    /// Whether `reduce` scales the loss (then every stage is held until the step's decision).
    scaled: bool,
    /// Whether a gradient of this rank's stages overflowed in the current step.
    overflow: bool,
    /// Whether the last step was skipped (its gradients overflowed).
    skipped: bool,
    /// The matrix optimizer (Muon) of each local stage with a Burn optimizer, and the stage's
    /// names in the whole model ([`Self::with_matrix_step`]).
    matrices: BTreeMap<usize, (MatrixStep, StageNames)>,
}

/// A stage's local parameter path to its name in the whole model.
pub type StageNames = Arc<dyn Fn(&str) -> String + Send + Sync>;

impl<O: ElementWise> std::fmt::Debug for StageUpdater<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageUpdater")
            .field("optims", &self.optims)
            .field("max_norm", &self.max_norm)
            .field("held", &self.held.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<O: ElementWise> StageUpdater<O> {
    /// An updater for `executor`'s local stages, each with its optimizer in `optims`;
    /// `reduce` does the tensor-parallel fix-ups and the data-parallel average of the stages
    /// stepped by a Burn optimizer (`TrainStep::new(tp).with_ddp(..)`), and, under mixed
    /// precision, the reduction dtype and the loss scaling: give the executor the same step
    /// ([`Executor::with_precision`]).
    ///
    /// # Errors
    /// [`PipelineError::StagesMismatch`] when `optims` does not hold exactly the local stages;
    /// [`PipelineError::Precision`] when `reduce` and the executor differ in precision policy
    /// or loss scaler, or a loss scaler meets a ZeRO stage optimizer (ZeRO scales on its own).
    pub fn new(
        executor: &Executor,
        optims: BTreeMap<usize, StageOptimizer<O>>,
        reduce: TrainStep,
    ) -> Result<Self> {
        let pp = executor.group().clone();
        let rank = pp.rank();
        let expected = executor.local_stages();
        let given: Vec<usize> = optims.keys().copied().collect();
        if given != expected {
            return Err(PipelineError::StagesMismatch {
                rank,
                expected,
                given,
            });
        }
        let scaled = reduce.loss_scaler().is_some();
        let precision = |reason: String| Err(PipelineError::Precision { rank, reason });
        match executor.precision() {
            Some(step) if !step.same_precision(&reduce) => {
                return precision(format!(
                    "the executor computes under {:?} (loss scale {}) but the updater reduces \
                     under {:?} (loss scale {}){}; give Executor::with_precision the step the \
                     updater reduces with (a clone shares its loss scaler)",
                    step.precision(),
                    step.loss_scale(),
                    reduce.precision(),
                    reduce.loss_scale(),
                    if step.precision() == reduce.precision() {
                        ", with another loss scaler"
                    } else {
                        ""
                    }
                ));
            }
            None if !reduce.precision().is_full() || scaled => {
                return precision(format!(
                    "the updater's step computes under {:?} with loss scale {}, but the \
                     executor runs the stages in their own dtype without scaling; call \
                     Executor::with_precision with that step",
                    reduce.precision(),
                    reduce.loss_scale()
                ));
            }
            _ => {}
        }
        if scaled
            && optims
                .values()
                .any(|o| matches!(o, StageOptimizer::Zero(_)))
        {
            return precision(
                "a loss scaler with ZeRO stage optimizers: ZeRO scales and skips on its own, \
                 one stage at a time, but a pipeline step must skip on every stage at once; use \
                 bf16 (no loss scaler) with ZeRO, or Burn optimizers with f16"
                    .into(),
            );
        }
        let placement = executor.schedule().placement();
        let num_stages = executor.schedule().num_stages();
        let owner = |s: usize| placement.rank_of(s).unwrap_or(0);
        Ok(Self {
            optims,
            reduce,
            max_norm: None,
            pp,
            rank,
            num_stages,
            ends: [owner(0), owner(num_stages - 1)],
            tied: BTreeMap::new(),
            tied_pair: None,
            held: BTreeMap::new(),
            lr: 0.0,
            scaled,
            overflow: false,
            skipped: false,
            matrices: BTreeMap::new(),
        })
    }

    /// Steps the hidden matrices of local stage `stage` (whose optimizer must be a
    /// [`StageOptimizer::Module`]: a ZeRO stage optimizer takes its own,
    /// `ZeroOptimizer::with_matrix_step`) with `matrix` (Muon; see [`burn_parallel::muon`]),
    /// its state kept and saved under `names` (the stage's paths in the whole model), so that
    /// each stage's matrices are its own and a checkpoint resumes under any split or layout.
    /// `matrix`'s holders are the stage's tensor-parallel group, its replicas the stage's
    /// data-parallel ranks.
    ///
    /// # Errors
    /// [`PipelineError::Protocol`] when `stage` is not a local stage with a Burn optimizer.
    pub fn with_matrix_step(
        mut self,
        stage: usize,
        matrix: MatrixStep,
        names: StageNames,
    ) -> Result<Self> {
        if !matches!(self.optims.get(&stage), Some(StageOptimizer::Module(_))) {
            return Err(PipelineError::Protocol {
                rank: self.rank,
                action: format!("a matrix optimizer for stage {stage}"),
                reason: "only a local stage stepped by a Burn optimizer takes one here (a ZeRO \
                         stage optimizer takes it itself)"
                    .into(),
            });
        }
        self.matrices.insert(stage, (matrix, names));
        Ok(self)
    }

    /// Clips by the global norm over every stage at `max_norm` (`None`: no clipping). Every
    /// stage then steps after the step's programme ([`Self::finish`]). Not with ZeRO stage
    /// optimizers: [`Self::at_reduce`] then fails with an error saying so.
    pub fn with_clip(mut self, max_norm: Option<f64>) -> Self {
        self.max_norm = max_norm;
        self
    }

    /// Declares `id`, a 2-D weight of local stage `stage` (the first or the last), as one copy
    /// of a weight tied between the first and the last stage (a token table tied to the head):
    /// its gradient is summed with the other copy's before either steps. Call it on the ranks
    /// of both copies, for each copy.
    ///
    /// # Errors
    /// [`PipelineError::Protocol`] when `stage` is not a local first or last stage; a
    /// collective error creating the group of the two owners.
    pub fn with_tied(mut self, stage: usize, id: ParamId) -> Result<Self> {
        let end = stage == 0 || stage + 1 == self.num_stages;
        if !end || !self.optims.contains_key(&stage) || self.num_stages < 2 {
            return Err(PipelineError::Protocol {
                rank: self.rank,
                action: format!("tying a weight of stage {stage}"),
                reason: format!(
                    "only the first and the last of {} stages can hold a tied weight, and only \
                     on their own rank",
                    self.num_stages
                ),
            });
        }
        if self.ends[0] != self.ends[1] && self.tied_pair.is_none() {
            let pair = self
                .pp
                .split(&self.ends)
                .map_err(|source| PipelineError::Collective {
                    rank: self.rank,
                    action: "the group of the tied weight's owners".into(),
                    source,
                })?;
            self.tied_pair = Some(pair);
        }
        self.tied.insert(stage, id);
        Ok(self)
    }

    /// The optimizer of each local stage, by stage index (to save its state in a checkpoint).
    pub fn optimizers(&self) -> &BTreeMap<usize, StageOptimizer<O>> {
        &self.optims
    }

    /// The step that reduces the stages' gradients (its precision policy and loss scaler: the
    /// scaler's state for a checkpoint, [`TrainStep::restore_loss_scaler`] on resume).
    pub fn train_step(&self) -> &TrainStep {
        &self.reduce
    }

    /// Whether the last step was skipped ([`Self::finish`]): the loss-scaled gradients
    /// overflowed on some stage, so no stage stepped and the loss scale backed off.
    pub fn skipped(&self) -> bool {
        self.skipped
    }

    /// The learning rate of the coming step.
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// The `update` of [`Executor::step`]: reduces and steps stage `s` now, or holds its
    /// gradients for [`Self::finish`] (clipping, tied weights).
    ///
    /// # Errors
    /// The reduction's or the optimizer's error.
    pub fn at_reduce<M: Module>(
        &mut self,
        s: usize,
        stage: M,
        grads: GradientsParams,
    ) -> std::result::Result<M, UpdateError> {
        let hold = self.max_norm.is_some() || self.tied.contains_key(&s) || self.scaled;
        let grads = match self.optims.get(&s) {
            // DDP now, overlapping the rest of the pipeline; ZeRO reduces in its own step. The
            // reductions only: the norm is the whole pipeline's, taken in `finish` (a stage's
            // own would be a collective for nothing).
            Some(StageOptimizer::Module(_)) => {
                let (grads, overflow) = self.reduce.reduce_unscaled(&stage, grads)?;
                self.overflow |= overflow;
                grads
            }
            _ => grads,
        };
        if hold {
            self.held.insert(s, grads);
            return Ok(stage);
        }
        // Stepped now, before the step's loss is known: its own gradients are checked first,
        // so that a NaN never reaches the weights (the loss and the norm are checked in
        // `finish` on the held paths).
        let sum = gradient_sum(&stage, &grads);
        CollectiveError::ensure_finite(self.pp.global_rank(), "sum of a stage's gradients", sum)
            .map_err(|e| -> UpdateError { Box::new(e) })?;
        self.apply(s, stage, grads)
    }

    fn apply<M: Module>(
        &mut self,
        s: usize,
        stage: M,
        grads: GradientsParams,
    ) -> std::result::Result<M, UpdateError> {
        let lr = self.lr;
        match self.optims.get_mut(&s) {
            Some(StageOptimizer::Module(optim)) => match self.matrices.get(&s) {
                None => Ok(optim.step(lr, stage, grads)),
                Some((matrix, names)) => {
                    let map = self
                        .reduce
                        .param_map(&stage)?
                        .with_logical_names(|path| names(path));
                    if let Some(id) = self.tied.get(&s)
                        && let Some(p) = map.params().iter().find(|p| p.id == *id)
                        && p.segments
                            .iter()
                            .any(|seg| matrix.takes(&seg.logical, &seg.region.shape))
                    {
                        return Err(format!(
                            "`{}` is tied between the first and the last stage, and the matrix \
                             optimizer would step its two copies apart: leave it to AdamW (its \
                             exclude rule)",
                            p.segments[0].logical
                        )
                        .into());
                    }
                    Ok(matrix.step_module(&map, stage, grads, optim, lr)?)
                }
            },
            Some(StageOptimizer::Zero(zero)) => {
                zero.accumulate(&stage, grads)?;
                Ok(zero.step(lr, stage)?.0)
            }
            None => Err(format!("no optimizer for stage {s}").into()),
        }
    }

    /// After [`Executor::step`], with its `report`: under loss scaling, skips the step on every
    /// stage when any stage's gradients overflowed ([`Self::skipped`]) and updates the scale;
    /// then sums the tied copies' gradients, clips by the norm over every stage (a tied weight
    /// counted once), and steps the held stages. Returns the global norm when clipping (`None`
    /// for a skipped step).
    ///
    /// Without a loss scaler, a NaN or infinite loss (the report's, the same on every pipeline
    /// rank) or global norm stops the step on every rank before a held stage is written, as
    /// the other step engines do; a stage stepped during the schedule checked its own
    /// gradients first ([`Self::at_reduce`]).
    ///
    /// # Errors
    /// Collective errors (the norm, the tied sum) as [`PipelineError::Collective`], a
    /// non-finite loss or norm as one whose source is [`CollectiveError::NonFinite`]; the
    /// optimizer's as [`PipelineError::Update`].
    pub fn finish<M: Module>(
        &mut self,
        stages: &mut BTreeMap<usize, M>,
        report: &StepReport,
    ) -> Result<Option<f64>> {
        let rank = self.rank;
        let collective = |action: &str, source: CollectiveError| PipelineError::Collective {
            rank,
            action: action.into(),
            source,
        };
        let global = self.pp.global_rank();
        let finite = |what: &'static str, value: f64| {
            CollectiveError::ensure_finite(global, what, value)
                .map_err(|e| collective("checking the step before its update", e))
        };
        if !self.scaled {
            finite("loss", report.loss.into())?;
        }
        let mut held: Vec<(usize, GradientsParams)> =
            std::mem::take(&mut self.held).into_iter().collect();
        // ---- loss scaling: one decision for the whole pipeline ----
        if self.scaled {
            let local = f32::from(u8::from(std::mem::take(&mut self.overflow)));
            let any = self
                .pp
                .all_reduce_f32(vec![local], ReduceOp::Max)
                .map_err(|e| collective("agreeing on an overflow over the stages", e))?[0];
            self.skipped = !self.reduce.update_loss_scale(any > 0.0);
            if self.skipped {
                return Ok(None);
            }
        }
        // ---- held without a norm (tied weights, no clipping): each stage's own gradients ----
        if !self.scaled && self.max_norm.is_none() {
            for (s, grads) in &held {
                let stage = stages.get(s).expect("a held stage is local");
                if let Err(e) = finite("sum of a stage's gradients", gradient_sum(stage, grads)) {
                    // The other stages' ranks stop at once rather than at their next receive.
                    self.pp.abort(&e.to_string());
                    return Err(e);
                }
            }
        }
        // ---- tied weights ----
        let mut tied = Vec::new();
        for (s, grads) in &mut held {
            if let Some(&id) = self.tied.get(s) {
                let g = grads
                    .remove::<2>(id)
                    .ok_or_else(|| PipelineError::Protocol {
                        rank,
                        action: format!("REDUCE({s})"),
                        reason: "no gradient for the tied weight".into(),
                    })?;
                tied.push((*s, id, g));
            }
        }
        let sum = match (tied.len(), &self.tied_pair) {
            (0, _) => None,
            (1, Some(pair)) => Some(
                pair.all_reduce(tied[0].2.clone(), ReduceOp::Sum)
                    .map_err(|e| collective("summing the tied weight's gradients", e))?,
            ),
            (2, None) => Some(tied[0].2.clone() + tied[1].2.clone()),
            (n, _) => {
                return Err(PipelineError::Protocol {
                    rank,
                    action: "tied weights".into(),
                    reason: format!(
                        "{n} local copies of the tied weight, with the other on {}",
                        if self.tied_pair.is_some() {
                            "another rank"
                        } else {
                            "no rank"
                        }
                    ),
                });
            }
        };
        // ---- global-norm clipping over every stage ----
        let last = self.num_stages - 1;
        // A ZeRO stage's squared norm, tied weight included: the step's own part of the norm.
        let mut zero_squares = BTreeMap::new();
        let norm = match self.max_norm {
            None => None,
            Some(_) => {
                let mut squares = 0.0;
                for (s, grads) in &mut held {
                    let stage = stages.get(s).expect("a held stage is local");
                    let tied_here = tied.iter().find(|t| t.0 == *s).map(|t| t.1);
                    if let Some(StageOptimizer::Zero(zero)) = self.optims.get_mut(s) {
                        // ZeRO reduces the gradients itself: it takes them now (both copies of
                        // a tied weight get the sum) and gives the squares of its reduced ones.
                        if let (Some(id), Some(g)) = (tied_here, &sum) {
                            grads.register::<2>(id, g.clone());
                        }
                        let update = |source: burn_zero::ZeroError| PipelineError::Update {
                            stage: *s,
                            source: source.into(),
                        };
                        if zero.max_grad_norm() != self.max_norm {
                            return Err(PipelineError::Update {
                                stage: *s,
                                source: format!(
                                    "the updater clips to the norm {:?} but the stage's ZeRO \
                                     optimizer to {:?}: build it with \
                                     ZeroConfig::with_max_grad_norm({:?})",
                                    self.max_norm,
                                    zero.max_grad_norm(),
                                    self.max_norm
                                )
                                .into(),
                            });
                        }
                        let grads = std::mem::replace(grads, GradientsParams::new());
                        zero.accumulate(stage, grads).map_err(update)?;
                        let all = zero.gradient_squares(|_| true).map_err(update)?;
                        // The tied weight counts once: with the first stage.
                        let counted = match tied_here.filter(|_| *s == last) {
                            Some(id) => all - zero.gradient_squares(|p| p == id).map_err(update)?,
                            None => all,
                        };
                        zero_squares.insert(*s, all);
                        squares += counted;
                        continue;
                    }
                    // The tied weight counts once: with the first stage.
                    if let (Some(id), Some(g)) = (tied_here.filter(|_| *s != last), &sum) {
                        grads.register::<2>(id, g.clone());
                    }
                    let norm = self
                        .reduce
                        .global_norm(stage, grads)
                        .map_err(|e| collective("the gradient norm", e))?;
                    squares += norm * norm;
                }
                let total = self
                    .pp
                    .all_reduce_data(TensorData::new(vec![squares], [1]), ReduceOp::Sum)
                    .map_err(|e| collective("summing the norm over the stages", e))?
                    .try_to_vec::<f64>()
                    .map_err(|e| PipelineError::Protocol {
                        rank,
                        action: "summing the norm over the stages".into(),
                        reason: format!("{e:?}"),
                    })?;
                let norm = total[0].sqrt();
                finite("gradient norm", norm)?;
                Some(norm)
            }
        };
        for (s, mut grads) in held {
            let stage = stages.remove(&s).expect("a held stage is local");
            if let (Some(StageOptimizer::Zero(zero)), Some(own), Some(norm)) =
                (self.optims.get_mut(&s), zero_squares.get(&s), norm)
            {
                // Clipped by the norm over every stage: the other stages' part is "outside".
                let (stage, _) = zero
                    .step_with_outside(self.lr, stage, (norm * norm - own).max(0.0))
                    .map_err(|source| PipelineError::Update {
                        stage: s,
                        source: source.into(),
                    })?;
                stages.insert(s, stage);
                continue;
            }
            if let (Some((_, id, _)), Some(g)) = (tied.iter().find(|t| t.0 == s), &sum) {
                grads.register::<2>(*id, g.clone());
            }
            let grads = match (norm, self.max_norm) {
                (Some(norm), Some(max)) => clip_to_norm(&stage, grads, norm, max),
                _ => grads,
            };
            let stage = self
                .apply(s, stage, grads)
                .map_err(|source| PipelineError::Update { stage: s, source })?;
            stages.insert(s, stage);
        }
        Ok(norm)
    }
}

/// Checkpoints of a pipelined model, in the step engines' format
/// ([`burn_parallel::train::engine_states`]): each stage's parameters and optimizer state are
/// saved under the single-device model's names, so that another pipeline split, another
/// schedule, or a layout without a pipeline ([`burn_parallel::train::StepEngine::load`]) loads
/// them, and the other way round.
impl<O: ElementWise> StageUpdater<O> {
    /// Saves the local stages' parameters and optimizer state as checkpoint `step` of `saver`
    /// ([`Checkpointer::submit`]: now or in the background), each tensor under `names(stage,
    /// local path)`, its name in the single-device model, and each element written once over
    /// the ranks holding the same copy (the stage's data- and tensor-parallel replicas; the two
    /// copies of a tied weight together, [`Self::with_tied`]); with the loss scaler's state and
    /// `state`. A ZeRO stage optimizer writes its shard's state under the logical names it was
    /// given (`ZeroOptimizer::with_logical_names`, the same `names`). Collective over `saver`'s
    /// group, which must be every rank of the pipeline and its replicas.
    ///
    /// # Errors
    /// [`CheckpointError`] for a parameter or state that cannot be described, I/O and
    /// collective failures.
    pub fn save<M: Module>(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        stages: &BTreeMap<usize, M>,
        names: &dyn Fn(&M, &str) -> String,
        state: SaveState,
    ) -> checkpoint::Result<()> {
        let both_ends = self.ends[0] == self.ends[1];
        let mut pieces = Vec::new();
        let mut scalars = serde_json::Map::new();
        for (&s, stage) in stages {
            let map = self.stage_map(s, stage, names)?;
            let mut params = map.param_pieces(stage)?;
            // The last stage's copy of a tied weight steps as the first's: when this rank holds
            // both, the first's is written (the map gives the last's no share), and a ZeRO
            // state is the first's.
            let tied_copy = match self.tied.get(&s) {
                Some(id) if s != 0 => map
                    .params()
                    .iter()
                    .find(|p| p.id == *id)
                    .and_then(|p| p.segments.first())
                    .map(|seg| seg.logical.clone()),
                _ => None,
            };
            let (mut state, more, sharded) = match self.optims.get(&s) {
                Some(StageOptimizer::Module(optim)) => {
                    let elementwise = self.elementwise_map(s, &map);
                    let (mut state, more) = elementwise.optimizer_pieces(optim.to_record())?;
                    if let Some((matrix, _)) = self.matrices.get(&s) {
                        state.extend(matrix.state_pieces()?);
                    }
                    (state, more, false)
                }
                Some(StageOptimizer::Zero(zero)) => {
                    let (state, more) = zero
                        .checkpoint_state(self.reduce.tp_context(), (1, 0))
                        .map_err(|e| CheckpointError::piece("zero", e.to_string()))?;
                    let more = serde_json::to_value(more).unwrap_or(Value::Null);
                    (state, more, true)
                }
                None => {
                    return Err(CheckpointError::piece(
                        "stage optimizer",
                        format!("stage {s} has no optimizer whose state could be saved"),
                    ));
                }
            };
            if let Some(name) = &tied_copy {
                let suffix = format!("/{name}");
                if both_ends || sharded {
                    state.retain(|p| !p.name.ends_with(&suffix));
                }
                if both_ends {
                    params.retain(|p| p.name != *name);
                }
            }
            pieces.extend(params);
            pieces.extend(state);
            if let Value::Object(more) = more {
                scalars.extend(more);
            }
        }
        let scaler = self.reduce.loss_scaler().map(|s| s.state());
        let (trainer, rank) = engine_states(state, scaler, &Value::Object(scalars));
        saver.submit(step, pieces, trainer, rank)
    }

    /// Loads a checkpoint saved under any layout of the model (by [`Self::save`] or a
    /// [`burn_parallel::train::StepEngine`]) into the local stages (each tensor read under
    /// `names(stage, local path)`) and their optimizers, and restores the loss scaler. The
    /// checkpoint is checked against the whole model (every stage's tensors, gathered over the
    /// pipeline group). Collective over the pipeline group.
    ///
    /// # Returns
    /// The caller's state given to the save.
    ///
    /// # Errors
    /// [`CheckpointError::Mismatch`] for a checkpoint of another model;
    /// [`CheckpointError::Corrupt`] for altered or truncated files; collective failures.
    pub fn load<M: Module>(
        &mut self,
        checkpoint: &Checkpoint,
        stages: &mut BTreeMap<usize, M>,
        names: &dyn Fn(&M, &str) -> String,
    ) -> checkpoint::Result<Value> {
        let (state, scaler, scalars) = saved_engine_states(checkpoint)?;
        for (s, map) in self.whole_maps(stages, names)? {
            let stage = stages.remove(&s).expect("a map per local stage");
            stages.insert(s, map.load_params(stage, checkpoint)?);
            let elementwise = self.elementwise_map(s, &map);
            match self.optims.get_mut(&s) {
                Some(StageOptimizer::Module(optim)) => {
                    if let Some(record) = elementwise.load_optimizer(checkpoint, &scalars)? {
                        *optim = optim.clone().load_record(record);
                    }
                    let stage = &stages[&s];
                    if let (Some((matrix, _)), Some(device)) =
                        (self.matrices.get(&s), stage.devices().first())
                    {
                        let own = map.params().iter().flat_map(|p| p.segments.iter());
                        let shapes = burn_parallel::muon::matrices_of(own);
                        matrix.load_state(checkpoint, &shapes, device)?;
                    }
                }
                Some(StageOptimizer::Zero(zero)) => zero
                    .load_checkpoint_state(checkpoint, self.reduce.tp_context(), &scalars)
                    .map_err(|e| CheckpointError::piece("zero", e.to_string()))?,
                None => {}
            }
        }
        if let Some(saved) = scaler {
            self.reduce
                .restore_loss_scaler(&saved)
                .map_err(|e| CheckpointError::piece("loss_scaler", e.to_string()))?;
        }
        Ok(state)
    }

    /// Loads the local stages' parameters only from `source` (a checkpoint, or the tensors of
    /// a Hugging Face checkpoint), each read under `names(stage, local path)` and checked
    /// against the whole model. Collective over the pipeline group.
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_params<M: Module, S: TensorSource + ?Sized>(
        &self,
        source: &S,
        stages: &mut BTreeMap<usize, M>,
        names: &dyn Fn(&M, &str) -> String,
    ) -> checkpoint::Result<()> {
        for (s, map) in self.whole_maps(stages, names)? {
            let stage = stages.remove(&s).expect("a map per local stage");
            stages.insert(s, map.load_params(stage, source)?);
        }
        Ok(())
    }

    /// What stage `s`'s Burn optimizer steps of `map`: all of it, or what its matrix optimizer
    /// leaves ([`Self::with_matrix_step`]).
    fn elementwise_map(&self, s: usize, map: &ParamMap) -> ParamMap {
        match self.matrices.get(&s) {
            None => map.clone(),
            Some((matrix, _)) => matrix.elementwise_map(map),
        }
    }

    /// The maps of the local stages, each knowing the whole model's tensors (those of the
    /// other stages, gathered over the pipeline group), so that a checkpoint of another model
    /// is refused with its differences.
    fn whole_maps<M: Module>(
        &self,
        stages: &BTreeMap<usize, M>,
        names: &dyn Fn(&M, &str) -> String,
    ) -> checkpoint::Result<Vec<(usize, ParamMap)>> {
        let mut maps = Vec::new();
        let mut mine = BTreeMap::new();
        for (&s, stage) in stages {
            let map = self.stage_map(s, stage, names)?;
            mine.extend(map.logical_shapes());
            maps.push((s, map));
        }
        let all = self.pp.all_gather_object(&mine)?;
        maps.into_iter()
            .map(|(s, map)| {
                let map = all
                    .iter()
                    .enumerate()
                    .try_fold(map, |map, (rank, theirs)| {
                        map.with_logical_shapes(theirs.clone(), &format!("pipeline rank {rank}"))
                    })?;
                Ok((s, map))
            })
            .collect()
    }

    /// What this rank holds of local stage `s` (`stage`) under the model's names, and which
    /// part of it this rank writes.
    fn stage_map<M: Module>(
        &self,
        s: usize,
        stage: &M,
        names: &dyn Fn(&M, &str) -> String,
    ) -> checkpoint::Result<ParamMap> {
        let tied = self.tied.get(&s).copied();
        // The two copies of a tied weight share the writing; both on one rank: the first's
        // copy writes it all.
        let pair = match self.ends[0] == self.ends[1] {
            true => (1, 0),
            false => (2, usize::from(s != 0)),
        };
        let map = self.reduce.param_map(stage)?.with_replicas_where(|p| {
            (tied == Some(p.id)).then(|| {
                let (copies, index) = self.reduce.copies(p.kind);
                (copies * pair.0, pair.1 * copies + index)
            })
        });
        Ok(map.with_logical_names(|path| names(stage, path)))
    }
}
