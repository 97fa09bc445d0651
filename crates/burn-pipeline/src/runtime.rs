//! The runtime: runs this rank's program of a validated [`Schedule`] on Burn stages over a
//! pipeline [`ProcessGroup`].
//!
//! | action | what [`Executor::step`] does |
//! |---|---|
//! | `F` | makes the received (or handed-over) boundary tensors leaves that require a gradient, runs [`Stage::forward`], keeps `(leaves, outputs)` under `(stage, micro-batch)` |
//! | `SEND_F` / `RECV_F` | one header (shapes, metadata, step: a small host message) then the tensors ([`ProcessGroup::send`]/[`ProcessGroup::recv`]: in device memory on NCCL), under [`Transfer::tag`], to and from the rank owning the peer stage; each rank's receives run in the order their sender sends them (see "Transfers" below) |
//! | `B` | backward of the surrogate `Σ sum(output ⊙ dY)` (of `loss / m` on the last stage), whose gradients are those of the loss; reads the leaves' gradients (the input gradient, sent back) and accumulates the stage's parameter gradients ([`GradientsAccumulator`]) |
//! | `I` | the same backward; the weight gradients of the stage's [`crate::deferred::DeferredLinear`]s are not computed, their `(X, dY)` are recorded (see "Split backward" below) |
//! | `W` | computes those weight gradients (`dW = Xᵀ dY`) and adds them to the stage's accumulated gradients; nothing for a stage without deferred weights |
//! | `SEND_B` / `RECV_B` | as `SEND_F` / `RECV_F`, for input gradients |
//! | `REDUCE(s)` | hands stage `s` and its accumulated gradients to the caller's `update` (data-parallel reduction, clipping, the optimizer step) and keeps the module it returns |
//!
//! Adjacent stages on the same rank (the turn of ZBV's V) hand their tensors over in memory:
//! the schedule has no send or receive for them, and the runtime detaches the output and makes
//! it the next stage's leaf, exactly as a transfer would.
//!
//! *Transfers.* Sends never wait for their receiver, on every backend: on an NCCL group with
//! CUDA stages the tensors go through NCCL in device memory, on a channel per direction
//! between two ranks (connected by [`Executor::new`], all pairs together), launched after the
//! kernels that produce them; Burn's stream waits for a receive on the device, not the host.
//! NCCL matches a direction's messages in the order they were sent, and a schedule may want
//! them in another order (ZBV and DualPipeV do): each rank runs its program with its
//! receives in its peers' send order ([`Schedule::with_receives_in_send_order`], validated
//! again), a transfer received ahead waiting in the inbox. Before each `REDUCE` and at the end
//! of the step the rank waits for its transfers to have arrived ([`ProcessGroup::wait_p2p`]),
//! so that a failed device transfer is an error before its gradients reach the optimizer.
//!
//! *Loss scaling.* The last stage returns the mean loss of its micro-batch; its backward is
//! seeded with `loss / m`, so the accumulated gradients are those of the mean over the whole
//! batch (micro-batches of equal size). [`StepReport::loss`] is the mean over micro-batches,
//! the same on every rank.
//!
//! *Mixed precision.* Under [`Executor::with_precision`] each forward runs on the stage's
//! compute copy (its parameters cast to the compute dtype, their gradients landing on the fp32
//! master weights), so the boundary tensors travel in the compute dtype, and the seed of each
//! backward is multiplied by the loss scale; the [`crate::update::StageUpdater`] unscales,
//! checks every stage for an overflow and skips or applies the step everywhere.
//!
//! *Shapes.* The first transfer over each boundary (per payload) fixes its spec: the number of
//! tensors, their dtypes and shapes. Every later transfer is checked against it on both sides,
//! except along the dimensions given to [`Executor::with_variable_dims`] (for example the
//! sequence dimension, so that micro-batches may have different lengths). A gradient must have
//! exactly the shape of the activation it belongs to. A mismatch is a
//! [`PipelineError::ShapeMismatch`] naming the transfer.
//!
//! *Never a hang.* Before the first step, ranks compare [`Schedule::fingerprint`]s. Every
//! receive has the group's timeout, so a dead peer is a [`PipelineError::Collective`]. A stage
//! that fails or panics is an error on its rank, and the rank aborts the group so that its
//! peers fail at once rather than at their timeout.
//!
//! *Split backward.* Burn computes every gradient of a graph in one `backward()`. A stage whose
//! linears are [`crate::deferred::DeferredLinear`]s returns their shared store from
//! [`Stage::deferred_weights`]: the runtime scopes each backward to its micro-batch, `I`
//! leaves the weights' gradients out (only `(X, dY)` is kept), `W` computes them, and a full
//! `B` does both. For any other stage (the bundled GPT's Burn linears), `I` runs the full
//! backward and `W` does nothing: correct, with the timing of a schedule whose `W` is free.

use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Instant, SystemTime};

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::train::TrainStep;
use burn_parallel::{CollectiveError, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::schedule::{Action, Payload, Schedule, Transfer};
use crate::stage::{Boundary, BoundaryTensor, Stage, StageOutput};
use crate::trace::{Span, StepTrack};
use crate::validate::ValidationError;

/// A boxed error from the caller's `update` callback.
pub type UpdateError = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can stop a pipeline step. Each names the rank, the action or the stage,
/// and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The schedule does not pass the validator.
    #[error("the pipeline schedule is invalid: {0}")]
    Invalid(#[from] ValidationError),
    /// The group does not have one rank per schedule rank.
    #[error(
        "the schedule has {schedule} pipeline ranks but the pipeline group has {group}; launch \
         one rank per pipeline rank (--pp) or generate the schedule for {group}"
    )]
    GroupSize {
        /// Ranks in the schedule.
        schedule: usize,
        /// Ranks in the group.
        group: usize,
    },
    /// Ranks hold different schedules.
    #[error(
        "pipeline rank {other} holds a different schedule (fingerprint {theirs:#018x}) than \
         rank {rank} ({ours:#018x}); every rank must generate or load the same schedule"
    )]
    ScheduleMismatch {
        /// This rank.
        rank: usize,
        /// The rank that differs.
        other: usize,
        /// This rank's fingerprint.
        ours: u64,
        /// The other rank's.
        theirs: u64,
    },
    /// The stages given to a step are not those the schedule places on the rank.
    #[error(
        "pipeline rank {rank} was given stages {given:?}, but the schedule places stages \
         {expected:?} on it; build exactly those"
    )]
    StagesMismatch {
        /// This rank.
        rank: usize,
        /// The stages the schedule places here.
        expected: Vec<usize>,
        /// The stages given.
        given: Vec<usize>,
    },
    /// The step was given another number of micro-batches than the schedule runs.
    #[error(
        "the step was given {given} micro-batches but the schedule runs {expected}; split the \
         batch into {expected}"
    )]
    MicrobatchCount {
        /// Micro-batches in the schedule.
        expected: usize,
        /// Micro-batches given.
        given: usize,
    },
    /// A stage's forward returned an error.
    #[error("stage {stage} failed on micro-batch {microbatch} (pipeline rank {rank}): {message}")]
    Stage {
        /// This rank.
        rank: usize,
        /// The stage.
        stage: usize,
        /// The micro-batch.
        microbatch: usize,
        /// The stage's message.
        message: String,
    },
    /// A stage's forward or backward panicked.
    #[error(
        "stage {stage} panicked in {action} on pipeline rank {rank}: {message}; the rank \
         aborted the pipeline group"
    )]
    StagePanicked {
        /// This rank.
        rank: usize,
        /// The stage.
        stage: usize,
        /// The action (`0F3`, `1B2`).
        action: String,
        /// The panic message.
        message: String,
    },
    /// The last stage did not return a loss, or another stage did.
    #[error(
        "stage {stage} of {stages} returned {got}; the last stage must return \
         StageOutput::Loss and every other stage StageOutput::Boundary"
    )]
    WrongOutput {
        /// The stage.
        stage: usize,
        /// Number of stages.
        stages: usize,
        /// What it returned.
        got: &'static str,
    },
    /// A tensor crossing a boundary does not match the negotiated shape.
    #[error(
        "the {transfer} (step {step}) does not match the boundary's negotiated spec: expected \
         {expected}, got {got}; a stage must keep the number, dtypes and shapes of the tensors \
         it passes on (declare the dimensions that may vary with Executor::with_variable_dims)"
    )]
    ShapeMismatch {
        /// The transfer, in words.
        transfer: String,
        /// The step.
        step: u64,
        /// The spec, printed.
        expected: String,
        /// What came, printed.
        got: String,
    },
    /// A send or receive failed: a peer died, timed out, or aborted.
    #[error("{action} on pipeline rank {rank} failed: {source}")]
    Collective {
        /// This rank.
        rank: usize,
        /// The action.
        action: String,
        /// The communication error.
        #[source]
        source: CollectiveError,
    },
    /// The caller's `update` failed at `REDUCE(stage)`.
    #[error("reducing and applying the gradients of stage {stage} failed: {source}")]
    Update {
        /// The stage.
        stage: usize,
        /// The caller's error.
        #[source]
        source: UpdateError,
    },
    /// The executor and the [`crate::update::StageUpdater`] disagree on the precision policy
    /// or the loss scaler, or the policy cannot be composed with the stages' optimizers.
    #[error("pipeline rank {rank}: {reason}")]
    Precision {
        /// This rank.
        rank: usize,
        /// What disagrees, and what to do.
        reason: String,
    },
    /// The runtime found its state inconsistent with the program (a message from another
    /// step, a missing activation). A validated schedule never does this.
    #[error("pipeline rank {rank}, {action}: {reason}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The action.
        action: String,
        /// What was inconsistent.
        reason: String,
    },
}

/// The result type of the runtime.
pub type Result<T> = std::result::Result<T, PipelineError>;

/// What one step did on this rank.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The mean loss over the micro-batches, the same on every pipeline rank.
    pub loss: f32,
    /// The loss of each micro-batch, on the rank holding the last stage (empty elsewhere).
    pub microbatch_losses: Vec<f32>,
    /// Every action of this rank's program with its start and end, seconds since `began`
    /// (see [`crate::trace`] for a trace file and the measured bubble).
    pub timeline: Vec<Span>,
    /// When the step began (wall clock), to place ranks' timelines on one axis.
    pub began: SystemTime,
    /// The most micro-batches whose forward state (inputs and outputs) this rank held at once,
    /// per local stage.
    pub peak_held: BTreeMap<usize, usize>,
}

// The runtime's side of `crate::trace` (defined here, with `StepReport`: the timeline types sit
// below the runtime and the simulator).
impl StepTrack {
    /// This rank's step under the label `name`.
    pub fn new(name: impl Into<String>, report: &StepReport) -> Self {
        Self::from_spans(name.into(), report.began, &report.timeline)
    }
}

/// The message header sent before a boundary's tensors.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    step: u64,
    shapes: Vec<Vec<usize>>,
    meta: serde_json::Value,
}

/// The negotiated spec of one tensor crossing a boundary.
#[derive(Debug, Clone, PartialEq)]
struct TensorSpec {
    dtype: String,
    shape: Vec<usize>,
}

fn print_specs(specs: &[TensorSpec], variable: &[usize]) -> String {
    let parts: Vec<String> = specs
        .iter()
        .map(|s| {
            let dims: Vec<String> = s
                .shape
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    if variable.contains(&i) {
                        "*".to_string()
                    } else {
                        d.to_string()
                    }
                })
                .collect();
            format!("{}[{}]", s.dtype, dims.join(", "))
        })
        .collect();
    format!("{} tensor(s) {}", specs.len(), parts.join(" "))
}

/// The forward state of one stage and micro-batch, kept until its backward.
struct Saved {
    /// Leaves of the input tensors (flattened) and their shapes. Under activation
    /// checkpointing they are plain detached tensors, made leaves at the recomputation.
    leaves: Vec<(Tensor<1>, Vec<usize>)>,
    /// The input boundary's metadata (kept for the recomputation).
    meta: serde_json::Value,
    output: SavedOutput,
}

// A Burn tensor is an enum over the backends of the build (640 bytes with WGPU): one value per
// micro-batch in flight, so boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
enum SavedOutput {
    Boundary(Boundary),
    Loss(Tensor<1>),
    /// Activation checkpointing: the forward ran without a graph and its output was sent (or
    /// handed over); the backward runs the forward again.
    Recompute,
}

/// Which stages run their forward without keeping the autodiff graph and run it again in the
/// backward (activation checkpointing, also called rematerialisation).
///
/// A checkpointed stage holds only its input boundary per micro-batch in flight instead of
/// every intermediate activation of its layers, for one more forward per micro-batch. The
/// stage's forward must be deterministic given its input and batch: random ops (dropout)
/// must draw the same values when run again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Checkpointing {
    /// Every stage keeps its graph from forward to backward (the default).
    #[default]
    Off,
    /// Every stage recomputes.
    All,
    /// These stages recompute (global stage indices); the others keep their graph.
    Stages(Vec<usize>),
}

impl Checkpointing {
    /// Whether `stage` recomputes its forward in the backward.
    pub fn covers(&self, stage: usize) -> bool {
        match self {
            Self::Off => false,
            Self::All => true,
            Self::Stages(stages) => stages.contains(&stage),
        }
    }
}

/// Runs pipeline steps on one rank. Build it once (it checks the schedule and compares it with
/// the other ranks), then call [`Executor::step`] for every optimizer step.
///
/// # Example
/// Two ranks, one linear stage each, 1F1B over 4 micro-batches:
/// ```
/// use std::collections::BTreeMap;
/// use burn::module::{Module, Param};
/// use burn::optim::{GradientsParams, Optimizer, SgdConfig};
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::run_local;
/// use burn_pipeline::generators::one_f_one_b;
/// use burn_pipeline::runtime::Executor;
/// use burn_pipeline::stage::{Boundary, Stage, StageError, StageOutput};
///
/// #[derive(Module, Debug)]
/// struct Affine {
///     w: Param<Tensor<1>>,
///     #[module(skip)]
///     last: bool,
/// }
///
/// impl Stage<f32> for Affine {
///     fn forward(&self, input: Boundary, x: &f32) -> Result<StageOutput, StageError> {
///         let w = self.w.val();
///         let x = if input.is_empty() {
///             Tensor::<1>::from_floats([*x], &w.device())
///         } else {
///             input.get::<1>(0)?
///         };
///         let y = x * w;
///         Ok(if self.last {
///             StageOutput::Loss(y.powf_scalar(2.0))
///         } else {
///             StageOutput::Boundary(Boundary::new().with(y))
///         })
///     }
/// }
///
/// let losses = run_local(2, |group| {
///     let device = Device::flex().autodiff();
///     let schedule = one_f_one_b(2, 4).unwrap();
///     let mut executor = Executor::new(schedule, group.clone(), device.clone()).unwrap();
///     let w = Param::from_tensor(Tensor::from_floats([0.5], &device));
///     let stage = Affine { w, last: group.rank() == 1 };
///     let mut stages = BTreeMap::from([(group.rank(), stage)]);
///     let mut optim = SgdConfig::new().init();
///     let batches = [1.0f32, 2.0, 3.0, 4.0];
///     let report = executor
///         .step(&mut stages, &batches, &mut |_, stage, grads: GradientsParams| {
///             Ok(optim.step(0.01, stage, grads))
///         })
///         .unwrap();
///     Ok(report.loss)
/// })
/// .unwrap();
/// // mean over x of (x * 0.5 * 0.5)^2 = 30 / 16 / 4
/// assert!((losses[0] - 30.0 / 64.0).abs() < 1e-6);
/// assert_eq!(losses[0], losses[1]);
/// ```
pub struct Executor {
    schedule: Schedule,
    group: ProcessGroup,
    rank: usize,
    device: Device,
    variable_dims: Vec<usize>,
    checkpointing: Checkpointing,
    specs: HashMap<(Payload, usize, usize), Vec<TensorSpec>>,
    step: u64,
    /// The precision policy and loss scaler of the forward and the backward's seed.
    precision: Option<TrainStep>,
    /// This rank's program as it runs: the schedule's, with its receives in the order their
    /// senders send them ([`Schedule::with_receives_in_send_order`]).
    program: Vec<Action>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("schedule", &self.schedule.kind())
            .field("rank", &self.rank)
            .field("step", &self.step)
            .finish()
    }
}

impl Executor {
    /// Checks `schedule` and prepares this rank (`group.rank()`) to run its program.
    ///
    /// # Arguments
    /// * `schedule` - the schedule, the same on every rank.
    /// * `group` - the pipeline group: group rank `r` runs program `r`.
    /// * `device` - an autodiff device; received tensors are created there.
    ///
    /// # Errors
    /// [`PipelineError::Invalid`] when the schedule fails the validator;
    /// [`PipelineError::GroupSize`]; [`PipelineError::ScheduleMismatch`] when ranks hold
    /// different schedules (compared by one all-gather over `group`);
    /// [`PipelineError::Collective`] when that all-gather fails, or connecting to the ranks
    /// this one exchanges tensors with ([`ProcessGroup::connect_peers`]: on NCCL the channels,
    /// which wait for the peers).
    ///
    /// Each rank runs its program with its receives in the order their senders send them
    /// ([`Schedule::with_receives_in_send_order`], validated again): NCCL matches the device
    /// messages of one direction in that order.
    pub fn new(schedule: Schedule, group: ProcessGroup, device: Device) -> Result<Self> {
        schedule.validate()?;
        if schedule.num_ranks() != group.size() {
            return Err(PipelineError::GroupSize {
                schedule: schedule.num_ranks(),
                group: group.size(),
            });
        }
        let rank = group.rank();
        let ours = schedule.fingerprint();
        let all = group
            .all_gather_object(&ours)
            .map_err(|source| PipelineError::Collective {
                rank,
                action: "comparing schedule fingerprints".into(),
                source,
            })?;
        if let Some((other, &theirs)) = all.iter().enumerate().find(|(_, f)| **f != ours) {
            return Err(PipelineError::ScheduleMismatch {
                rank,
                other,
                ours,
                theirs,
            });
        }
        // NCCL matches a direction's device messages in the order they were sent.
        let in_order = schedule.with_receives_in_send_order();
        in_order.validate()?;
        let program = in_order.program(rank).to_vec();
        // Every pair of ranks that exchange tensors connects now, together (on NCCL: the
        // channels of both directions; a send never waits for its receiver after this).
        let placement = schedule.placement();
        let mut peers: Vec<usize> = program
            .iter()
            .filter_map(|a| placement.rank_of(a.peer_stage()?))
            .filter(|&p| p != rank)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        group
            .connect_peers(&peers, &device)
            .map_err(|source| PipelineError::Collective {
                rank,
                action: format!("connecting to pipeline ranks {peers:?}"),
                source,
            })?;
        Ok(Self {
            schedule,
            group,
            rank,
            device,
            variable_dims: Vec::new(),
            checkpointing: Checkpointing::Off,
            specs: HashMap::new(),
            step: 0,
            precision: None,
            program,
        })
    }

    /// Lets boundary tensors vary along these dimensions from one micro-batch to the next
    /// (for example `[1]`, the sequence of `[batch, seq, d]`); every other dimension is
    /// checked against the first transfer.
    pub fn with_variable_dims(mut self, dims: &[usize]) -> Self {
        self.variable_dims = dims.to_vec();
        self
    }

    /// Turns activation checkpointing on for some or all stages (see [`Checkpointing`]): their
    /// `F` runs the stage on a copy of the module without autodiff (`Module::valid`), keeps
    /// only the input boundary, and their `B`/`I` run the forward again with the graph before
    /// the backward. Gradients are unchanged.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self
    }

    /// Trains under `step`'s precision policy and loss scaler: each forward runs on the stage's
    /// compute copy ([`TrainStep::compute_model`]: parameters cast to the compute dtype, their
    /// gradients landing on the fp32 master weights; boundary tensors then travel in the
    /// compute dtype), and each backward's seed is multiplied by the loss scale of the step's
    /// start. Give it the [`TrainStep`] the [`crate::update::StageUpdater`] reduces with (a
    /// clone shares its loss scaler): the updater unscales the gradients, and skips the step on
    /// every stage when any overflowed (it refuses a step of another policy or scaler).
    ///
    /// ```
    /// use burn::tensor::Device;
    /// use burn_parallel::nn::TpContext;
    /// use burn_parallel::precision::MixedPrecision;
    /// use burn_parallel::train::TrainStep;
    /// use burn_pipeline::generators::one_f_one_b;
    /// use burn_pipeline::runtime::Executor;
    ///
    /// let group = burn_parallel::world::local_world(1).remove(0);
    /// let step = TrainStep::new(TpContext::single()).with_precision(MixedPrecision::bf16());
    /// let exec = Executor::new(one_f_one_b(1, 2).unwrap(), group, Device::flex().autodiff())
    ///     .unwrap()
    ///     .with_precision(&step);
    /// assert!(exec.precision().unwrap().same_precision(&step));
    /// ```
    pub fn with_precision(mut self, step: &TrainStep) -> Self {
        self.precision = Some(step.clone());
        self
    }

    /// The step whose precision policy and loss scale the stages run under
    /// ([`Self::with_precision`]).
    pub fn precision(&self) -> Option<&TrainStep> {
        self.precision.as_ref()
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The stages this rank holds, in increasing order.
    pub fn local_stages(&self) -> Vec<usize> {
        self.schedule.placement().stages_of(self.rank)
    }

    /// The pipeline group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Runs one step: this rank's program over `batches`, one per micro-batch.
    ///
    /// # Arguments
    /// * `stages` - this rank's stages by stage index (exactly [`Self::local_stages`]).
    /// * `batches` - the data of each micro-batch (every stage sees it; see [`Stage`]).
    /// * `update` - called at `REDUCE(s)` with the stage index, the stage and its gradients
    ///   summed over the micro-batches (of the mean loss); returns the updated stage (reduce
    ///   over data parallelism, clip, step the optimizer there).
    ///
    /// # Returns
    /// The [`StepReport`]: the mean loss (the same on every rank), the timeline.
    ///
    /// # Errors
    /// Every [`PipelineError`]; on an error the rank aborts the group, so that its peers fail
    /// promptly, and a stage being updated when `update` fails is lost.
    pub fn step<M, B>(
        &mut self,
        stages: &mut BTreeMap<usize, M>,
        batches: &[B],
        update: &mut dyn FnMut(usize, M, GradientsParams) -> std::result::Result<M, UpdateError>,
    ) -> Result<StepReport>
    where
        M: Stage<B>,
    {
        let out = self.run(stages, batches, update);
        if let Err(e) = &out {
            // Peers blocked on this rank fail now rather than at their timeout.
            self.group.abort(&e.to_string());
        }
        self.step += 1;
        out
    }

    fn run<M, B>(
        &mut self,
        stages: &mut BTreeMap<usize, M>,
        batches: &[B],
        update: &mut dyn FnMut(usize, M, GradientsParams) -> std::result::Result<M, UpdateError>,
    ) -> Result<StepReport>
    where
        M: Stage<B>,
    {
        let expected = self.local_stages();
        let given: Vec<usize> = stages.keys().copied().collect();
        if given != expected {
            return Err(PipelineError::StagesMismatch {
                rank: self.rank,
                expected,
                given,
            });
        }
        let m = self.schedule.num_microbatches();
        if batches.len() != m {
            return Err(PipelineError::MicrobatchCount {
                expected: m,
                given: batches.len(),
            });
        }
        let num_stages = self.schedule.num_stages();
        let program = self.program.clone();
        let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
        let mut inbox_act: HashMap<(usize, usize), Boundary> = HashMap::new();
        let mut inbox_grad: HashMap<(usize, usize), Vec<Tensor<1>>> = HashMap::new();
        let mut outbox_grad: HashMap<(usize, usize), Vec<BoundaryTensor>> = HashMap::new();
        let mut accumulators: BTreeMap<usize, GradientsAccumulator<M>> = expected
            .iter()
            .map(|&s| (s, GradientsAccumulator::new()))
            .collect();
        let mut losses = Vec::new();
        let mut held: BTreeMap<usize, usize> = expected.iter().map(|&s| (s, 0)).collect();
        let mut peak_held = held.clone();
        let mut timeline = Vec::with_capacity(program.len());
        let began = SystemTime::now();
        let start = Instant::now();
        let scale = 1.0 / m as f32;
        // Loss scaling: the scale of the step's start (the updater changes it after the step).
        let seed_scale = scale
            * self
                .precision
                .as_ref()
                .map_or(1.0, |p| p.loss_scale() as f32);

        for action in program {
            let t0 = start.elapsed().as_secs_f64();
            match action {
                Action::Forward { stage, microbatch } => {
                    let input = if stage == 0 {
                        Boundary::new()
                    } else {
                        inbox_act
                            .remove(&(stage, microbatch))
                            .ok_or_else(|| self.protocol(&action, "no input activation"))?
                    };
                    let (tensors, meta) = input.into_parts();
                    let recompute = self.checkpointing.covers(stage);
                    let leaves: Vec<(Tensor<1>, Vec<usize>)> = tensors
                        .into_iter()
                        .map(|t| {
                            let leaf = t.flat().clone().detach();
                            let leaf = if recompute { leaf } else { leaf.require_grad() };
                            (leaf, t.shape().to_vec())
                        })
                        .collect();
                    let input = boundary_of(&leaves, meta.clone());
                    let batch = &batches[microbatch];
                    let out = if recompute {
                        // No graph: parameters off autodiff, the input a plain tensor.
                        self.call_stage(&stages[&stage].valid(), &action, input, batch)?
                    } else {
                        self.call_stage(&stages[&stage], &action, input, batch)?
                    };
                    let last = stage + 1 == num_stages;
                    let output = match (out, last) {
                        (StageOutput::Loss(loss), true) => {
                            let value = loss
                                .clone()
                                .into_data()
                                .convert::<f32>()
                                .try_to_vec::<f32>()
                                .map_err(|e| self.protocol(&action, &format!("loss: {e:?}")))?;
                            losses.push(value.first().copied().unwrap_or(f32::NAN));
                            SavedOutput::Loss(loss)
                        }
                        (StageOutput::Boundary(b), false) => {
                            let transfer = Transfer {
                                payload: Payload::Activation,
                                from: stage,
                                to: stage + 1,
                                microbatch,
                            };
                            self.check_spec(&transfer, b.tensors())?;
                            if self.schedule.placement().rank_of(stage + 1) == Some(self.rank) {
                                inbox_act.insert((stage + 1, microbatch), detached(&b));
                            }
                            SavedOutput::Boundary(b)
                        }
                        (StageOutput::Loss(_), false) => {
                            return Err(PipelineError::WrongOutput {
                                stage,
                                stages: num_stages,
                                got: "a loss",
                            });
                        }
                        (StageOutput::Boundary(_), true) => {
                            return Err(PipelineError::WrongOutput {
                                stage,
                                stages: num_stages,
                                got: "a boundary",
                            });
                        }
                    };
                    let handed_over =
                        last || self.schedule.placement().rank_of(stage + 1) == Some(self.rank);
                    let output = if recompute && handed_over {
                        // The backward computes it again; a remote output stays until it is sent.
                        SavedOutput::Recompute
                    } else {
                        output
                    };
                    saved.insert(
                        (stage, microbatch),
                        Saved {
                            leaves,
                            meta,
                            output,
                        },
                    );
                    let h = held.get_mut(&stage).expect("a local stage");
                    *h += 1;
                    let p = peak_held.get_mut(&stage).expect("a local stage");
                    *p = (*p).max(*h);
                }
                Action::SendActivation {
                    stage,
                    to,
                    microbatch,
                } => {
                    let transfer = action.transfer().expect("a send");
                    let recompute = self.checkpointing.covers(stage);
                    let boundary = match saved.get_mut(&(stage, microbatch)).map(|s| &mut s.output)
                    {
                        Some(out @ SavedOutput::Boundary(_)) if recompute => {
                            match std::mem::replace(out, SavedOutput::Recompute) {
                                SavedOutput::Boundary(b) => b,
                                _ => unreachable!("matched a boundary"),
                            }
                        }
                        Some(SavedOutput::Boundary(b)) => detached(b),
                        _ => return Err(self.protocol(&action, "no output to send")),
                    };
                    let (tensors, meta) = boundary.into_parts();
                    self.send(&action, &transfer, to, &tensors, meta)?;
                }
                Action::RecvActivation {
                    stage,
                    from,
                    microbatch,
                } => {
                    let transfer = action.transfer().expect("a receive");
                    let (tensors, meta) = self.recv(&action, &transfer, from)?;
                    self.check_spec(&transfer, &tensors)?;
                    inbox_act.insert((stage, microbatch), Boundary::from_parts(tensors, meta));
                }
                Action::Backward { stage, microbatch }
                | Action::BackwardInput { stage, microbatch } => {
                    let mut s = saved
                        .remove(&(stage, microbatch))
                        .ok_or_else(|| self.protocol(&action, "no forward state"))?;
                    *held.get_mut(&stage).expect("a local stage") -= 1;
                    if let SavedOutput::Recompute = s.output {
                        // Activation checkpointing: the forward again, with the graph.
                        for (leaf, _) in &mut s.leaves {
                            *leaf = leaf.clone().require_grad();
                        }
                        let input = boundary_of(&s.leaves, s.meta.clone());
                        s.output = match self.call_stage(
                            &stages[&stage],
                            &action,
                            input,
                            &batches[microbatch],
                        )? {
                            StageOutput::Loss(loss) => SavedOutput::Loss(loss),
                            StageOutput::Boundary(b) => SavedOutput::Boundary(b),
                        };
                    }
                    let seed = match s.output {
                        SavedOutput::Recompute => unreachable!("recomputed above"),
                        // A half-precision loss is scaled in f32 (a large scale overflows f16).
                        SavedOutput::Loss(loss) if loss.dtype() != DType::F32 => {
                            Some(loss.cast(DType::F32).mul_scalar(seed_scale).sum())
                        }
                        SavedOutput::Loss(loss) => Some(loss.mul_scalar(seed_scale).sum()),
                        SavedOutput::Boundary(out) => {
                            let grads = inbox_grad
                                .remove(&(stage, microbatch))
                                .ok_or_else(|| self.protocol(&action, "no output gradient"))?;
                            self.check_grads(stage, microbatch, out.tensors(), &grads)?;
                            surrogate(out.tensors(), grads)
                        }
                    };
                    let module = &stages[&stage];
                    let store = module.deferred_weights();
                    if let Some(store) = store {
                        store.begin(microbatch);
                    }
                    let input_grads = match seed {
                        Some(seed) => {
                            let (param_grads, input_grads) = catch_unwind(AssertUnwindSafe(|| {
                                // A collective inside the stage (TP, SP, CP) that fails in
                                // this backward: `take_backward_error` below.
                                let _ = burn_parallel::autograd::take_backward_error();
                                let mut grads = seed.backward();
                                let inputs: Vec<Tensor<1>> = s
                                    .leaves
                                    .iter()
                                    .map(|(leaf, _)| {
                                        leaf.grad_remove(&mut grads)
                                            .unwrap_or_else(|| leaf.zeros_like().detach())
                                    })
                                    .collect();
                                (GradientsParams::from_grads(grads, module), inputs)
                            }))
                            .map_err(|p| self.panicked(stage, &action, p))?;
                            if let Some(source) = burn_parallel::autograd::take_backward_error() {
                                return Err(PipelineError::Collective {
                                    rank: self.rank,
                                    action: format!("{action:?}"),
                                    source,
                                });
                            }
                            accumulators
                                .get_mut(&stage)
                                .expect("a local stage")
                                .accumulate(module, param_grads);
                            input_grads
                        }
                        // Nothing tracked: no parameter gradient, zero input gradients.
                        None => s
                            .leaves
                            .iter()
                            .map(|(leaf, _)| leaf.zeros_like().detach())
                            .collect(),
                    };
                    // A full backward computes the deferred weight gradients at once.
                    if let (Action::Backward { .. }, Some(store)) = (action, store) {
                        accumulators
                            .get_mut(&stage)
                            .expect("a local stage")
                            .accumulate(module, store.take(microbatch, module));
                    }
                    if stage > 0 {
                        let grads: Vec<BoundaryTensor> = input_grads
                            .into_iter()
                            .zip(&s.leaves)
                            .map(|(g, (_, shape))| BoundaryTensor::from_flat(g, shape.clone()))
                            .collect();
                        if self.schedule.placement().rank_of(stage - 1) == Some(self.rank) {
                            inbox_grad.insert(
                                (stage - 1, microbatch),
                                grads.into_iter().map(|g| g.flat().clone()).collect(),
                            );
                        } else {
                            outbox_grad.insert((stage, microbatch), grads);
                        }
                    }
                }
                Action::BackwardWeight { stage, microbatch } => {
                    // Stages without deferred weights computed everything in `I`.
                    let module = &stages[&stage];
                    if let Some(store) = module.deferred_weights() {
                        let grads = store.take(microbatch, module);
                        accumulators
                            .get_mut(&stage)
                            .expect("a local stage")
                            .accumulate(module, grads);
                    }
                }
                Action::SendGrad {
                    stage,
                    to,
                    microbatch,
                } => {
                    let transfer = action.transfer().expect("a send");
                    let grads = outbox_grad
                        .remove(&(stage, microbatch))
                        .ok_or_else(|| self.protocol(&action, "no input gradient to send"))?;
                    self.send(&action, &transfer, to, &grads, serde_json::Value::Null)?;
                }
                Action::RecvGrad {
                    stage,
                    from,
                    microbatch,
                } => {
                    let transfer = action.transfer().expect("a receive");
                    let (tensors, _) = self.recv(&action, &transfer, from)?;
                    inbox_grad.insert(
                        (stage, microbatch),
                        tensors.into_iter().map(|t| t.flat().clone()).collect(),
                    );
                }
                Action::ReduceGrads { stage } => {
                    if let Some(store) = stages[&stage].deferred_weights() {
                        let left = store.pending_microbatches();
                        if !left.is_empty() {
                            return Err(self.protocol(
                                &action,
                                &format!(
                                    "the weight gradients of micro-batches {left:?} never ran"
                                ),
                            ));
                        }
                    }
                    // Every tensor received so far arrived (on NCCL a failed receive is found
                    // here, before its gradients reach the optimizer).
                    self.group
                        .wait_p2p()
                        .map_err(|e| self.collective(&action, e))?;
                    let grads = accumulators.get_mut(&stage).expect("a local stage").grads();
                    let module = stages
                        .remove(&stage)
                        .ok_or_else(|| self.protocol(&action, "the stage is gone"))?;
                    let module = update(stage, module, grads)
                        .map_err(|source| PipelineError::Update { stage, source })?;
                    stages.insert(stage, module);
                }
            }
            timeline.push(Span {
                action,
                start: t0,
                end: start.elapsed().as_secs_f64(),
            });
        }
        if !saved.is_empty() || !inbox_act.is_empty() || !inbox_grad.is_empty() {
            return Err(PipelineError::Protocol {
                rank: self.rank,
                action: "end of step".into(),
                reason: format!(
                    "{} forward states, {} activations and {} gradients left over",
                    saved.len(),
                    inbox_act.len(),
                    inbox_grad.len()
                ),
            });
        }
        // This step's sends have arrived (or failed): nothing of it is left in flight.
        self.group
            .wait_p2p()
            .map_err(|source| PipelineError::Collective {
                rank: self.rank,
                action: "end of step".into(),
                source,
            })?;
        let sum: f32 = losses.iter().sum();
        let total = self
            .group
            .all_reduce_f32(vec![sum], ReduceOp::Sum)
            .map_err(|source| PipelineError::Collective {
                rank: self.rank,
                action: "sharing the loss".into(),
                source,
            })?[0];
        Ok(StepReport {
            loss: total / m as f32,
            microbatch_losses: losses,
            timeline,
            began,
            peak_held,
        })
    }

    /// Runs a stage's forward, turning its error or panic into a [`PipelineError`].
    fn call_stage<M: Stage<B>, B>(
        &self,
        module: &M,
        action: &Action,
        input: Boundary,
        batch: &B,
    ) -> Result<StageOutput> {
        let (stage, microbatch) = (action.stage(), action.microbatch().unwrap_or(0));
        // Mixed precision: the forward on the compute copy, cast for each forward. One copy per
        // step (as `TrainStep` keeps over sequential micro-batches) fails here: the forwards of
        // several micro-batches are in flight, and the first backward consumes the casts' tape
        // that the others still need (Burn has no retain_graph).
        let copy = self
            .precision
            .as_ref()
            .filter(|p| !p.precision().is_full())
            .map(|p| p.compute_model(module));
        let module = copy.as_ref().unwrap_or(module);
        catch_unwind(AssertUnwindSafe(|| module.forward(input, batch)))
            .map_err(|p| self.panicked(stage, action, p))?
            .map_err(|e| PipelineError::Stage {
                rank: self.rank,
                stage,
                microbatch,
                message: e.message,
            })
    }

    fn protocol(&self, action: &Action, reason: &str) -> PipelineError {
        PipelineError::Protocol {
            rank: self.rank,
            action: action.to_string(),
            reason: format!("step {}: {reason}", self.step),
        }
    }

    fn panicked(
        &self,
        stage: usize,
        action: &Action,
        payload: Box<dyn std::any::Any + Send>,
    ) -> PipelineError {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        PipelineError::StagePanicked {
            rank: self.rank,
            stage,
            action: action.to_string(),
            message,
        }
    }

    fn collective(&self, action: &Action, source: CollectiveError) -> PipelineError {
        PipelineError::Collective {
            rank: self.rank,
            action: action.to_string(),
            source,
        }
    }

    fn peer(&self, action: &Action, stage: usize) -> Result<usize> {
        self.schedule
            .placement()
            .rank_of(stage)
            .ok_or_else(|| self.protocol(action, &format!("stage {stage} has no rank")))
    }

    fn tag(&self, transfer: &Transfer) -> u64 {
        transfer.tag(self.schedule.num_stages(), self.schedule.num_microbatches())
    }

    /// Sends a header (a small host message) and the tensors ([`ProcessGroup::send`]: through
    /// NCCL in device memory on CUDA), all under the transfer's tag. Neither waits for the
    /// receiver.
    fn send(
        &self,
        action: &Action,
        transfer: &Transfer,
        to: usize,
        tensors: &[BoundaryTensor],
        meta: serde_json::Value,
    ) -> Result<()> {
        let peer = self.peer(action, to)?;
        let tag = self.tag(transfer);
        let header = Header {
            step: self.step,
            shapes: tensors.iter().map(|t| t.shape().to_vec()).collect(),
            meta,
        };
        let bytes = serde_json::to_vec(&header)
            .map_err(|e| self.protocol(action, &format!("header does not serialise: {e}")))?;
        let len = bytes.len();
        self.group
            .send_data(TensorData::new(bytes, [len]), peer, tag)
            .map_err(|e| self.collective(action, e))?;
        for t in tensors {
            self.group
                .send(t.flat().clone(), peer, tag)
                .map_err(|e| self.collective(action, e))?;
        }
        Ok(())
    }

    /// Receives the header and the tensors of `transfer` from the rank of stage `from`.
    fn recv(
        &self,
        action: &Action,
        transfer: &Transfer,
        from: usize,
    ) -> Result<(Vec<BoundaryTensor>, serde_json::Value)> {
        let peer = self.peer(action, from)?;
        let tag = self.tag(transfer);
        let header = self
            .group
            .recv_data(peer, tag)
            .map_err(|e| self.collective(action, e))?;
        let bytes = header
            .try_to_vec::<u8>()
            .map_err(|e| self.protocol(action, &format!("a header that is not bytes: {e:?}")))?;
        let header: Header = serde_json::from_slice(&bytes)
            .map_err(|e| self.protocol(action, &format!("a malformed header: {e}")))?;
        if header.step != self.step {
            return Err(self.protocol(
                action,
                &format!("a message of step {} arrived", header.step),
            ));
        }
        let mut tensors = Vec::with_capacity(header.shapes.len());
        for (i, shape) in header.shapes.iter().enumerate() {
            let flat: Tensor<1> = self
                .group
                .recv(peer, tag, &self.device)
                .map_err(|e| self.collective(action, e))?;
            let n = shape.iter().product::<usize>();
            if flat.dims()[0] != n {
                return Err(self.protocol(
                    action,
                    &format!(
                        "tensor {i} of {transfer} has {} elements, its header says shape \
                         {shape:?}",
                        flat.dims()[0]
                    ),
                ));
            }
            tensors.push(BoundaryTensor::from_flat(flat, shape.clone()));
        }
        Ok((tensors, header.meta))
    }

    /// Checks tensors crossing `transfer`'s boundary against the spec its first transfer set.
    fn check_spec(&mut self, transfer: &Transfer, tensors: &[BoundaryTensor]) -> Result<()> {
        let got: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec {
                dtype: format!("{:?}", t.dtype()),
                shape: t.shape().to_vec(),
            })
            .collect();
        let key = (transfer.payload, transfer.from, transfer.to);
        let Some(spec) = self.specs.get(&key) else {
            self.specs.insert(key, got);
            return Ok(());
        };
        let variable = &self.variable_dims;
        let matches = spec.len() == got.len()
            && spec.iter().zip(&got).all(|(a, b)| {
                a.dtype == b.dtype
                    && a.shape.len() == b.shape.len()
                    && a.shape
                        .iter()
                        .zip(&b.shape)
                        .enumerate()
                        .all(|(i, (x, y))| x == y || variable.contains(&i))
            });
        if matches {
            return Ok(());
        }
        Err(PipelineError::ShapeMismatch {
            transfer: transfer.to_string(),
            step: self.step,
            expected: print_specs(spec, variable),
            got: print_specs(&got, &[]),
        })
    }

    /// A received output gradient must have the shapes of the outputs it belongs to.
    fn check_grads(
        &self,
        stage: usize,
        microbatch: usize,
        outputs: &[BoundaryTensor],
        grads: &[Tensor<1>],
    ) -> Result<()> {
        let numel: Vec<usize> = outputs.iter().map(|t| t.shape().iter().product()).collect();
        let got: Vec<usize> = grads.iter().map(|g| g.dims()[0]).collect();
        if numel == got {
            return Ok(());
        }
        let transfer = Transfer {
            payload: Payload::Grad,
            from: stage + 1,
            to: stage,
            microbatch,
        };
        Err(PipelineError::ShapeMismatch {
            transfer: transfer.to_string(),
            step: self.step,
            expected: format!("element counts {numel:?} (the activations' shapes)"),
            got: format!("element counts {got:?}"),
        })
    }
}

/// A stage's input: the leaves, reshaped, and the metadata.
fn boundary_of(leaves: &[(Tensor<1>, Vec<usize>)], meta: serde_json::Value) -> Boundary {
    Boundary::from_parts(
        leaves
            .iter()
            .map(|(l, s)| BoundaryTensor::from_flat(l.clone(), s.clone()))
            .collect(),
        meta,
    )
}

/// The boundary with every tensor detached (what crosses to the next stage).
fn detached(b: &Boundary) -> Boundary {
    Boundary::from_parts(
        b.tensors()
            .iter()
            .map(|t| BoundaryTensor::from_flat(t.flat().clone().detach(), t.shape().to_vec()))
            .collect(),
        b.meta_value().clone(),
    )
}

/// `Σ sum(output ⊙ dY)` over the outputs that are tracked: its gradient with respect to
/// anything upstream is the vector-Jacobian product with the output gradients `dY`. `None`
/// when no output is tracked.
fn surrogate(outputs: &[BoundaryTensor], grads: Vec<Tensor<1>>) -> Option<Tensor<1>> {
    outputs
        .iter()
        .zip(grads)
        .filter(|(out, _)| out.flat().is_tracked())
        .map(|(out, dy)| (out.flat().clone() * dy.detach()).sum())
        .reduce(|a, b| a + b)
}

/// The pipeline's error at the suite's surface: a failed send or receive as
/// [`burn_parallel::Error::Collective`] (the collective error names the rank and the call), the
/// rest as [`burn_parallel::Error::Technique`].
impl From<PipelineError> for burn_parallel::Error {
    fn from(e: PipelineError) -> Self {
        match e {
            PipelineError::Collective { source, .. } => source.into(),
            e => Self::Technique(Box::new(e)),
        }
    }
}
