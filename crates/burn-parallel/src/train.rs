//! One training step for every data × tensor-parallel layout: backward, the gradient
//! reductions the layout needs, global-norm clipping, the optimizer step.
//!
//! | stage | what [`TrainStep::step`] does |
//! |---|---|
//! | backward | `loss.backward()`, gradients of this rank's parameters |
//! | sequence parallelism | sums the gradients of the norms used on sequence shards over `tp` ([`TpContext::sync_gradients`]) |
//! | data parallelism | averages every gradient over `dp` (bucketed, [`DistributedDataParallel`]); the flat shards of FSDP units ([`DataShards`]) arrive averaged over their shard group and are averaged over the replicate group only (HSDP) |
//! | clipping | scales all gradients by `min(1, max_norm / ‖g‖)`, with `‖g‖` the norm of the whole model's gradient: tensor-parallel shards summed over `tp` once, replicated parameters counted once |
//! | step | the Burn optimizer, on this rank's parameters |
//!
//! FSDP units (`burn_zero::Fsdp`) train with this step too: their parameters are flat shards,
//! so a plain Burn optimizer keeps sharded state. ZeRO-1/2 (`burn_zero::ZeroOptimizer`) has its
//! own step; [`StepEngine`] lets one training loop drive either.
//!
//! # Example
//! ```
//! use burn::module::Module;
//! use burn::optim::AdamWConfig;
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::init::{Init, LinearInit};
//! use burn_parallel::nn::Linear;
//! use burn_parallel::train::TrainStep;
//! use burn_parallel::run_local;
//!
//! let losses = run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     let init = Init::new(1, &device);
//!     let mut model = init.linear("fc", LinearInit::new(4, 1)).unwrap();
//!     let mut optim = AdamWConfig::new().init();
//!     let step = TrainStep::new(init.context()).with_data_parallel(group.clone()).with_clip(Some(1.0));
//!     let x = Tensor::<2>::ones([2, 4], &device) * (group.rank() as f32 + 1.0);
//!     let loss = model.forward(x).unwrap().powf_scalar(2.0).mean();
//!     let (next, out) = step.step(model, loss, &mut optim, 1e-2).unwrap();
//!     model = next;
//!     let _ = model;
//!     Ok(out.loss)
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]); // the loss averaged over the data-parallel ranks
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};

use serde_json::Value;

use crate::checkpoint::{
    self, Checkpoint, CheckpointError, Checkpointer, FlatParts, ParamKind, ParamMap, merged_scalars,
};
use crate::comm::host::ReduceOp;
use crate::ddp::DistributedDataParallel;
use crate::error::Result;
use crate::fault::{Replicas, average_gradients};
use crate::group::ProcessGroup;
use crate::muon::MatrixStep;
use crate::nn::TpContext;
use crate::overlap::OverlappedDdp;
use crate::precision::{LossScaler, LossScalerState, MixedPrecision};

/// What a step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutput {
    /// The loss, averaged over the data-parallel ranks (the loss of the global batch).
    pub loss: f32,
    /// The global gradient norm before clipping (computed on every applied step: the NaN check
    /// reads it); `None` for a skipped step.
    pub grad_norm: Option<f64>,
    /// Whether the step was skipped because the loss-scaled gradients overflowed (the model
    /// and the optimizer state are untouched; see [`TrainStep::with_loss_scaler`]).
    pub skipped: bool,
    /// Where the step's time went on this rank.
    pub phases: StepPhases,
}

/// The micro-batch loop of a [`StepEngine`]'s step: for each micro-batch `k`, the forward
/// (`forward(module, k)`, the mean loss of micro-batch `k`) timed as [`StepPhases::forward`],
/// then `backward(k, loss)` (scale, backward, accumulate) timed as [`StepPhases::backward`].
/// The forward runs on `model` in fp32, and on a fresh compute copy of it under a
/// low-precision `precision` ([`MixedPrecision::compute_copy`]): the copy's casts belong to
/// that micro-batch's graph, which its backward consumes (Burn keeps no graph for a second
/// backward), and their gradients land on `model`'s fp32 parameters.
///
/// # Returns
/// The mean of the micro-batches' losses on this rank.
///
/// # Errors
/// The first error of `forward` or `backward`.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::precision::MixedPrecision;
/// use burn_parallel::train::{StepPhases, run_micro_batches};
///
/// let device = Device::flex();
/// let mut phases = StepPhases::default();
/// let mut forward = |x: &Tensor<1>, k: usize| Ok::<_, String>(x.clone() * (k as f32 + 1.0));
/// let mut seen = Vec::new();
/// let mean = run_micro_batches(2, &Tensor::<1>::ones([1], &device), MixedPrecision::full(),
///     &mut forward, &mut phases, |k, _loss| { seen.push(k); Ok(()) }).unwrap();
/// assert_eq!((mean, seen), (1.5, vec![0, 1]));
/// ```
pub fn run_micro_batches<M: Module, E>(
    micro_batches: usize,
    model: &M,
    precision: MixedPrecision,
    forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
    phases: &mut StepPhases,
    mut backward: impl FnMut(usize, Tensor<1>) -> std::result::Result<(), E>,
) -> std::result::Result<f32, E> {
    let mut local = 0.0f64;
    for k in 0..micro_batches {
        let loss = phases.time(
            |p| &mut p.forward,
            || {
                // In fp32 the model itself (no copy: state a forward updates stays with it).
                let copy = (!precision.is_full()).then(|| precision.compute_copy(model));
                let loss = forward(copy.as_ref().unwrap_or(model), k)?;
                local += f64::from(loss.clone().into_scalar::<f32>());
                Ok::<_, E>(loss)
            },
        )?;
        phases.time(|p| &mut p.backward, || backward(k, loss))?;
    }
    Ok((local / micro_batches.max(1) as f64) as f32)
}

/// Seconds of one step on this rank by phase, as a [`StepEngine`] measures them on the host
/// (Flex and NdArray run synchronously, so these are the phases' real costs; on a GPU backend
/// they measure what the host waited for).
///
/// ```
/// use burn_parallel::train::StepPhases;
///
/// let mut total = StepPhases { forward: 1.0, backward: 2.0, ..StepPhases::default() };
/// total.add(&StepPhases { optimizer: 0.5, ..StepPhases::default() });
/// assert_eq!(total.total(), 3.5);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepPhases {
    /// Forward passes and losses of every micro-batch.
    pub forward: f64,
    /// Backward passes and the gradient accumulation (with overlapped data parallelism or
    /// ZeRO-2, the communication issued during the backward too).
    pub backward: f64,
    /// Gradient communication after the backward, unscaling and clipping.
    pub reduce: f64,
    /// The optimizer update (with ZeRO, its reduce-scatter and gathers too).
    pub optimizer: f64,
}

impl StepPhases {
    /// The sum of the phases.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.reduce + self.optimizer
    }

    /// Adds `other` phase by phase.
    pub fn add(&mut self, other: &StepPhases) {
        self.forward += other.forward;
        self.backward += other.backward;
        self.reduce += other.reduce;
        self.optimizer += other.optimizer;
    }

    /// Runs `f`, adding its seconds to the phase `phase` picks.
    pub fn time<T>(&mut self, phase: fn(&mut Self) -> &mut f64, f: impl FnOnce() -> T) -> T {
        let start = std::time::Instant::now();
        let out = f();
        *phase(self) += start.elapsed().as_secs_f64();
        out
    }
}

/// Gradients ready for the optimizer ([`TrainStep::reduce_scaled`]).
#[derive(Debug)]
pub struct Reduced {
    /// Reduced, unscaled and clipped gradients.
    pub grads: GradientsParams,
    /// The global norm before clipping (every step that applies; `None` after an overflow).
    pub grad_norm: Option<f64>,
    /// Whether the loss-scaled gradients overflowed somewhere (then the step must be skipped;
    /// the loss scaler has already backed off).
    pub overflow: bool,
}

impl Reduced {
    /// Gradients that overflowed: the step is skipped ([`TrainStep::apply`] does nothing).
    pub fn overflowed(grads: GradientsParams) -> Self {
        Self {
            grads,
            grad_norm: None,
            overflow: true,
        }
    }
}

/// Every parameter of this process that is a flat shard over more than one rank (registered
/// with [`DataShards::register`]): what [`TrainStep`] checks that it was told about.
static SHARDED: std::sync::LazyLock<Mutex<std::collections::HashSet<ParamId>>> =
    std::sync::LazyLock::new(Mutex::default);

/// The parameters that are flat shards of FSDP units over a data-parallel *shard* group: for
/// each, the ranges of its elements that come from tensor-parallel shards (their squares are
/// summed over `tp` as well as over the shard group). Filled by whoever shards a unit (for
/// example `burn_zero::FsdpPlan`), read by [`TrainStep`]. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct DataShards {
    group: ProcessGroup,
    /// In registration (model construction) order: the same on every rank, unlike ids.
    params: Arc<Mutex<Vec<ShardEntry>>>,
    /// What each flat shard holds, for checkpoints ([`crate::checkpoint::ParamMap`]).
    flats: Arc<Mutex<HashMap<ParamId, FlatParts>>>,
    sync: GradientSync,
}

/// Whether the FSDP units of a [`DataShards`] reduce their gradients in the backward being run
/// (torch's `set_requires_gradient_sync`). Off, a unit adds its whole (unsharded) gradient to
/// a buffer it keeps, communicates nothing and gives its shard a zero gradient; the next
/// backward with the switch on adds the buffer to its gradient and reduce-scatters the sum. So
/// `k` micro-batches cost one reduce-scatter per unit instead of `k`, for one unit-sized
/// buffer per unit. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct GradientSync {
    on: Arc<AtomicBool>,
    accumulation: Arc<AtomicU64>,
}

impl GradientSync {
    /// Whether the units reduce their gradients now.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// The number of accumulations begun ([`DataShards::begin_accumulation`]): a unit drops
    /// what it holds from an earlier one (an abandoned step) instead of adding it.
    pub fn accumulation(&self) -> u64 {
        self.accumulation.load(Ordering::SeqCst)
    }
}

/// A flat shard and the ranges of its elements that belong to tensor-parallel shards.
type ShardEntry = (ParamId, Vec<Range<usize>>);

impl DataShards {
    /// No parameter yet, sharded over `group`.
    pub fn new(group: &ProcessGroup) -> Self {
        Self {
            group: group.clone(),
            params: Arc::new(Mutex::new(Vec::new())),
            flats: Arc::new(Mutex::new(HashMap::new())),
            sync: GradientSync {
                on: Arc::new(AtomicBool::new(true)),
                accumulation: Arc::new(AtomicU64::new(0)),
            },
        }
    }

    /// The switch the units read in their backward (see [`GradientSync`]).
    pub fn gradient_sync(&self) -> &GradientSync {
        &self.sync
    }

    /// Turns the units' gradient reduction on or off for the backward passes that follow (see
    /// [`GradientSync`]): off for every micro-batch but the last of an accumulation, on for
    /// the last. [`TrainStep::with_fsdp_no_sync`] does it in
    /// [`TrainStep::step_accumulated`].
    ///
    /// (`burn_zero::FsdpPlan::shards` shows a whole accumulation.)
    ///
    /// ```
    /// use burn_parallel::run_local;
    /// use burn_parallel::train::DataShards;
    ///
    /// run_local(2, |group| {
    ///     let shards = DataShards::new(&group);
    ///     shards.begin_accumulation();
    ///     shards.set_gradient_sync(false); // micro-batches 0..k-1
    ///     assert!(!shards.gradient_sync().is_on());
    ///     shards.set_gradient_sync(true); // the last one reduces what was held
    ///     Ok(shards.gradient_sync().accumulation())
    /// })
    /// .unwrap();
    /// ```
    pub fn set_gradient_sync(&self, on: bool) {
        self.sync.on.store(on, Ordering::SeqCst);
    }

    /// Starts an accumulation: the units drop what they hold from an earlier, unfinished one
    /// (a step that failed between its micro-batches), and the switch is on.
    pub fn begin_accumulation(&self) {
        self.sync.accumulation.fetch_add(1, Ordering::SeqCst);
        self.set_gradient_sync(true);
    }

    /// The switch for micro-batch `k` of `n` of a no-sync accumulation: at `k = 0` it begins
    /// the accumulation ([`Self::begin_accumulation`]); the units reduce in the last one's
    /// backward only. What [`TrainStep::with_fsdp_no_sync`] does before each backward.
    pub fn sync_micro_batch(&self, k: usize, n: usize) {
        if k == 0 {
            self.begin_accumulation();
        }
        self.set_gradient_sync(k + 1 == n);
    }

    /// The shard group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Registers the 1-D flat shard `id`, whose elements in `tp_ranges` belong to
    /// tensor-parallel shards.
    pub fn register(&self, id: ParamId, tp_ranges: Vec<Range<usize>>) {
        if self.group.size() > 1 {
            SHARDED.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
        }
        self.params
            .lock()
            .expect("shard bookkeeping")
            .push((id, tp_ranges));
    }

    /// Whether `id` is registered here.
    fn holds(&self, id: ParamId) -> bool {
        let params = self.params.lock().expect("shard bookkeeping");
        params.iter().any(|(p, _)| *p == id)
    }

    /// Records which parameters of its unit the flat shard `id` holds (for checkpoints that
    /// load under another layout).
    pub fn register_flat(&self, id: ParamId, parts: FlatParts) {
        self.flats
            .lock()
            .expect("shard bookkeeping")
            .insert(id, parts);
    }

    /// What the flat shard `id` holds, if it was registered with [`Self::register_flat`].
    pub fn flat_parts(&self, id: ParamId) -> Option<FlatParts> {
        self.flats
            .lock()
            .expect("shard bookkeeping")
            .get(&id)
            .cloned()
    }

    /// The ids of the registered flat shards, in registration order.
    pub fn ids(&self) -> Vec<ParamId> {
        self.snapshot().into_iter().map(|(id, _)| id).collect()
    }

    /// The registered shards, in registration order.
    fn snapshot(&self) -> Vec<ShardEntry> {
        self.params.lock().expect("shard bookkeeping").clone()
    }
}

// The checkpoint's map of a module, from the registry of its FSDP units: defined here, with
// `DataShards`, since `crate::checkpoint` sits below the training step.
impl ParamMap {
    /// The map of `module` on this rank.
    ///
    /// # Arguments
    /// * `module` - the module as this rank holds it.
    /// * `tp` - the tensor-parallel context it was built with (`TpContext::single()` for none).
    /// * `shards` - the registry its FSDP units registered their flat shards in, if any.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] naming a parameter whose layout cannot be described.
    pub fn new<M: Module>(
        module: &M,
        tp: &TpContext,
        shards: Option<&DataShards>,
    ) -> checkpoint::Result<Self> {
        Self::with_flat_parts(module, tp, |id| shards.and_then(|s| s.flat_parts(id)))
    }
}

/// One optimizer step of a model over micro-batches, whatever reduces the gradients and updates
/// the parameters: the seam between a training loop and the engines, so that one loop serves
/// every layout. [`Trainer`] (the library's [`TrainStep`] with a Burn optimizer: DDP, FSDP,
/// HSDP, TP/SP, CP, mixed precision, clipping, overlap, no-sync accumulation) and
/// `burn_zero::ZeroOptimizer` (ZeRO-1/2, with its own precision and clipping) implement it.
///
/// `E` is the loop's error type: what `forward` returns, and what the engine's own errors
/// convert into (`TpError` takes collective, ZeRO and MoE errors).
///
/// ```
/// use burn::optim::AdamWConfig;
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::init::{Init, LinearInit};
/// use burn_parallel::nn::Linear;
/// use burn_parallel::run_local;
/// use burn_parallel::tensor_parallel::TpError;
/// use burn_parallel::train::{StepEngine, TrainStep, Trainer};
///
/// let losses = run_local(2, |group| {
///     let device = Device::flex().autodiff();
///     let init = Init::new(1, &device);
///     let mut model = init.linear("fc", LinearInit::new(4, 1)).unwrap();
///     let step = TrainStep::new(init.context()).with_data_parallel(group.clone());
///     // Any engine: a `burn_zero::ZeroOptimizer` drops in here for ZeRO-1/2.
///     let mut engine: Box<dyn StepEngine<Linear, TpError>> =
///         Box::new(Trainer::new(step, AdamWConfig::new().init()));
///     let x = Tensor::<2>::ones([4, 4], &device) * (group.rank() as f32 + 1.0);
///     let mut forward = |m: &Linear, k: usize| {
///         let rows = x.clone().narrow(0, 2 * k, 2); // micro-batch k: two of the four rows
///         Ok(m.forward(rows)?.powf_scalar(2.0).mean())
///     };
///     let (next, out) = engine.step_accumulated(model, 2, &mut forward, 1e-2).unwrap();
///     model = next;
///     let _ = model;
///     Ok(out.loss)
/// })
/// .unwrap();
/// assert_eq!(losses[0], losses[1]); // the loss of the global batch, on every rank
/// ```
pub trait StepEngine<M, E> {
    /// One optimizer step over `micro_batches` micro-batches: `forward(model, k)` computes the
    /// mean loss of micro-batch `k` on the module it receives (the compute copy under a
    /// [`Trainer`]'s mixed precision); the gradients are accumulated, reduced as the layout
    /// needs, clipped and applied once, as for one batch of all the micro-batches' rows (see
    /// [`TrainStep::step_accumulated`]).
    ///
    /// # Returns
    /// The updated model and the step's [`StepOutput`] (the loss of the global batch).
    ///
    /// # Errors
    /// `forward`'s error; the engine's (collective failures, a bad argument), converted into
    /// `E`.
    fn step_accumulated(
        &mut self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E>;

    /// Saves `model`'s parameters (fp32: the master weights under mixed precision) and the
    /// engine's optimizer state as checkpoint `step` of `saver` ([`Checkpointer::submit`]: now,
    /// or in the background), each rank writing its share under the logical names, with the
    /// loss scaler's state and `state` (the caller's: data position, losses..., and each
    /// rank's own; a [`serde_json::Value`] converts into it). Any engine under any layout loads
    /// it ([`Self::load`]). Collective over `saver`'s group, which must be every rank of the
    /// layout.
    ///
    /// # Errors
    /// [`CheckpointError`] for a parameter or state that cannot be described, I/O and
    /// collective failures.
    fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        state: SaveState,
    ) -> checkpoint::Result<()>;

    /// Loads a checkpoint saved by any engine under any layout into `model` (this rank's part of
    /// each parameter, in the engine's compute dtype) and the engine (optimizer state, loss
    /// scaler).
    ///
    /// # Returns
    /// The model and the caller's state given to [`Self::save`].
    ///
    /// # Errors
    /// [`CheckpointError::Mismatch`] for a checkpoint of another model;
    /// [`CheckpointError::Corrupt`] for altered or truncated files.
    fn load(&mut self, checkpoint: &Checkpoint, model: M) -> checkpoint::Result<(M, Value)>;

    /// The current loss scale (1 without a loss scaler): for logs and reports.
    fn loss_scale(&self) -> f64 {
        1.0
    }

    /// `model` with its fp32 master weights, to evaluate or export: `model` itself unless the
    /// engine keeps the master weights apart (ZeRO under mixed precision, whose model holds
    /// their compute-dtype copy).
    ///
    /// # Errors
    /// The engine's, converted into `E`.
    fn master_model(&self, model: M) -> std::result::Result<M, E> {
        Ok(model)
    }

    /// The Burn optimizer holding the state, when the engine steps with one (not ZeRO, whose
    /// state is its shard's): for memory reports.
    fn optimizer(&self) -> Option<&ModuleOptimizer> {
        None
    }

    /// The optimizer of the hidden matrices beside [`Self::optimizer`], when the engine has one
    /// (Muon; see [`crate::muon`]): for memory reports.
    fn matrix_step(&self) -> Option<&MatrixStep> {
        None
    }
}

/// A [`TrainStep`] with its Burn optimizer: the [`StepEngine`] of every layout but ZeRO-1/2.
#[derive(Clone)]
pub struct Trainer {
    /// The step (layout, precision, clipping).
    pub step: TrainStep,
    /// The optimizer and its state.
    pub optim: ModuleOptimizer,
}

impl Trainer {
    /// `step` with `optim`.
    pub fn new(step: TrainStep, optim: ModuleOptimizer) -> Self {
        Self { step, optim }
    }
}

impl<M: Module, E: From<crate::CollectiveError>> StepEngine<M, E> for Trainer {
    fn step_accumulated(
        &mut self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        self.step
            .step_accumulated(model, micro_batches, forward, &mut self.optim, lr)
    }

    fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        state: SaveState,
    ) -> checkpoint::Result<()> {
        self.step.save(saver, step, model, &self.optim, state)
    }

    fn load(&mut self, checkpoint: &Checkpoint, model: M) -> checkpoint::Result<(M, Value)> {
        let (model, optim, state) = self.step.load(checkpoint, model, self.optim.clone())?;
        self.optim = optim;
        Ok((model, state))
    }

    fn loss_scale(&self) -> f64 {
        self.step.loss_scale()
    }

    fn optimizer(&self) -> Option<&ModuleOptimizer> {
        Some(&self.optim)
    }

    fn matrix_step(&self) -> Option<&MatrixStep> {
        self.step.matrix_step()
    }
}

/// Turns the FSDP units' gradient reduction back on when dropped.
struct NoSync<'a>(Option<&'a DataShards>);

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        if let Some(shards) = self.0 {
            shards.set_gradient_sync(true);
        }
    }
}

/// The training step of a data × tensor-parallel layout. See the module docs.
#[derive(Debug, Clone)]
pub struct TrainStep {
    tp: TpContext,
    ddp: Option<DistributedDataParallel>,
    fsdp: Option<(DataShards, Option<ProcessGroup>)>,
    /// Accumulation reduces the FSDP units' gradients once, on the last micro-batch.
    fsdp_no_sync: bool,
    max_grad_norm: Option<f64>,
    overlap: Option<OverlappedDdp>,
    precision: MixedPrecision,
    /// Shared by the clones of this step: the scale changes as training goes.
    scaler: Option<Arc<Mutex<LossScaler>>>,
    /// The optimizer of the hidden matrices (Muon), when they are not `optim`'s.
    matrix: Option<MatrixStep>,
    /// Fault-tolerant data parallelism: the replicas this one averages with
    /// ([`Self::with_replicas`]).
    replicas: Option<Replicas>,
}

impl TrainStep {
    /// A step for a model built with the tensor-parallel context `tp` (from
    /// [`Init::context`](crate::init::Init::context); [`TpContext::single`] for none).
    pub fn new(tp: TpContext) -> Self {
        Self {
            tp,
            ddp: None,
            fsdp: None,
            fsdp_no_sync: false,
            max_grad_norm: None,
            overlap: None,
            precision: MixedPrecision::full(),
            scaler: None,
            matrix: None,
            replicas: None,
        }
    }

    /// Averages the gradients and the loss over the live `replicas` once this replica's own
    /// reductions ran (fault-tolerant data parallelism, see [`crate::fault`]): the step is
    /// built on one replica's ranks (no data-parallel group across replicas), and each step's
    /// exchange survives a lost replica. Not with [`Self::with_overlap`].
    ///
    /// ```
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::fault::Replicas;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::run_local;
    /// use burn_parallel::tensor_parallel::TpError;
    /// use burn_parallel::train::TrainStep;
    ///
    /// let losses = run_local(2, |world| {
    ///     let device = Device::flex().autodiff();
    ///     let model = Init::new(1, &device).linear("fc", LinearInit::new(4, 1)).unwrap();
    ///     let step = TrainStep::new(Init::new(1, &device).context())
    ///         .with_replicas(Replicas::new(&world, 2)?);
    ///     let x = Tensor::<2>::ones([2, 4], &device) * (world.rank() as f32 + 1.0);
    ///     let mut optim = AdamWConfig::new().init();
    ///     let (_, out) = step
    ///         .step_with(model, |m| Ok::<_, TpError>(m.forward(x.clone())?.mean()), &mut optim, 1e-2)
    ///         .unwrap();
    ///     Ok(out.loss)
    /// })
    /// .unwrap();
    /// assert_eq!(losses[0], losses[1]); // the loss averaged over both replicas
    /// ```
    pub fn with_replicas(mut self, replicas: Replicas) -> Self {
        self.replicas = Some(replicas);
        self
    }

    /// The replicas of fault-tolerant data parallelism, if the step has them
    /// ([`Self::with_replicas`]).
    pub fn replicas(&self) -> Option<&Replicas> {
        self.replicas.as_ref()
    }

    /// Steps the hidden matrices with `matrix` (Muon, or any [`crate::muon::WholeMatrix`]
    /// optimizer; see [`crate::muon`]) and leaves the rest of the parameters to the
    /// elementwise optimizer the step is given. `matrix`'s holders must be the ranks among
    /// which this layout splits the matrices (the tensor-parallel group, the FSDP shard group,
    /// or their product) and its replicas the data-parallel ranks that hold the same pieces.
    /// The clones of this step share `matrix`'s state.
    ///
    /// ```
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::muon::{MatrixStep, MuonConfig};
    /// use burn_parallel::nn::TpContext;
    /// use burn_parallel::train::TrainStep;
    ///
    /// let device = Device::flex().autodiff();
    /// let model = Init::new(1, &device).linear("fc", LinearInit::new(4, 2)).unwrap();
    /// let step = TrainStep::new(TpContext::single())
    ///     .with_matrix_step(MatrixStep::new(MuonConfig::new().build()));
    /// let mut adamw = AdamWConfig::new().init(); // the bias's optimizer
    /// let x = Tensor::<2>::ones([3, 4], &device);
    /// let before = model.weight.val();
    /// let (model, _) = step
    ///     .step_with(model, |m| m.forward(x.clone()).map(|y| y.sum()), &mut adamw, 1e-2)
    ///     .unwrap();
    /// assert!(model.weight.val().not_equal(before).any().into_scalar::<bool>());
    /// ```
    pub fn with_matrix_step(mut self, matrix: MatrixStep) -> Self {
        self.matrix = Some(matrix);
        self
    }

    /// What the elementwise optimizer steps of `map`: all of it, or what the matrix optimizer
    /// leaves ([`Self::with_matrix_step`]).
    fn elementwise_map(&self, map: &ParamMap) -> ParamMap {
        match &self.matrix {
            None => map.clone(),
            Some(matrix) => matrix.elementwise_map(map),
        }
    }

    /// The optimizer of the hidden matrices, if the step has one ([`Self::with_matrix_step`]).
    pub fn matrix_step(&self) -> Option<&MatrixStep> {
        self.matrix.as_ref()
    }

    /// Trains under the mixed-precision policy `precision` (see [`crate::precision`]): the
    /// forward of [`Self::step_with`] runs on [`MixedPrecision::compute_copy`] of the model
    /// (parameters cast to `param_dtype`, the fp32 ones being the master weights the optimizer
    /// updates), and the data-parallel average runs in `reduce_dtype`. Check the policy against
    /// the device with [`MixedPrecision::validate`] first.
    ///
    /// ```
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::{DType, Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::precision::{LossScaler, MixedPrecision};
    /// use burn_parallel::train::TrainStep;
    /// use burn_parallel::nn::TpContext;
    ///
    /// let device = Device::flex().autodiff();
    /// let model = Init::new(1, &device).linear("fc", LinearInit::new(4, 2)).unwrap();
    /// let step = TrainStep::new(TpContext::single())
    ///     .with_precision(MixedPrecision::f16())
    ///     .with_loss_scaler(LossScaler::new(1024.0));
    /// let mut optim = AdamWConfig::new().init();
    /// let x = Tensor::<2>::ones([3, 4], &device);
    /// let (model, out) = step
    ///     .step_with(model, |m| m.forward(x.clone().cast(DType::F16)).map(|y| y.sum()),
    ///                &mut optim, 1e-3)
    ///     .unwrap();
    /// assert!(!out.skipped);
    /// assert_eq!(model.weight.val().dtype(), DType::F32); // fp32 master weights
    /// ```
    pub fn with_precision(mut self, precision: MixedPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// Scales the loss by `scaler`'s scale before backward, unscales the gradients after their
    /// reduction, and skips the step (backing the scale off) when they overflowed on any rank:
    /// dynamic loss scaling for f16 (see [`LossScaler`]).
    pub fn with_loss_scaler(mut self, scaler: LossScaler) -> Self {
        self.scaler = Some(Arc::new(Mutex::new(scaler)));
        self
    }

    /// The tensor-parallel context the step was built with.
    pub fn tp_context(&self) -> &TpContext {
        &self.tp
    }

    /// The precision policy.
    pub fn precision(&self) -> MixedPrecision {
        self.precision
    }

    /// The loss scaler's state, for a checkpoint (`None` without a scaler).
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        self.scaler
            .as_ref()
            .map(|s| s.lock().expect("loss scaler").clone())
    }

    /// The current loss scale (1 without a scaler).
    pub fn loss_scale(&self) -> f64 {
        self.loss_scaler().map_or(1.0, |s| s.scale())
    }

    /// Restores the loss scaler from a checkpoint's state ([`LossScaler::state`]). Returns
    /// `false`, restoring nothing, for a step without a scaler: a run that does not scale
    /// ignores a saved scale.
    ///
    /// # Errors
    /// A state the scaler refuses ([`LossScaler::restore`]).
    pub fn restore_loss_scaler(&self, saved: &LossScalerState) -> crate::precision::Result<bool> {
        let Some(scaler) = &self.scaler else {
            return Ok(false);
        };
        scaler.lock().expect("loss scaler").restore(saved)?;
        Ok(true)
    }

    /// What the forward should run on: `model` itself in fp32, its compute copy under a
    /// low-precision policy ([`MixedPrecision::compute_copy`]).
    pub fn compute_model<M: Module>(&self, model: &M) -> M {
        self.precision.compute_copy(model)
    }

    /// `loss` as backward should see it: multiplied by the loss scale (unchanged without a
    /// scaler).
    pub fn scaled_loss(&self, loss: Tensor<1>) -> Tensor<1> {
        let scale = self.loss_scale();
        if scale == 1.0 { loss } else { loss * scale }
    }

    /// Trains FSDP units whose flat shards are registered in `shards`: their gradients come
    /// averaged over the shard group from the backward of the units' all-gather, and are then
    /// averaged over `replicate` (HSDP; `None` or a group of one for plain FSDP). Set
    /// [`Self::with_data_parallel`] to the whole data-parallel group (replicate x shard) for the
    /// parameters outside the units.
    /// A shard group of one rank shards nothing: the step is then the plain one (so the same
    /// lines serve every layout, and [`Self::with_overlap`] composes with them).
    pub fn with_fsdp(mut self, shards: DataShards, replicate: Option<ProcessGroup>) -> Self {
        self.fsdp =
            (shards.group().size() > 1).then(|| (shards, replicate.filter(|g| g.size() > 1)));
        self
    }

    /// In [`Self::step_accumulated`], lets the FSDP units of [`Self::with_fsdp`] keep their
    /// whole gradient over the micro-batches and reduce-scatter it once, on the last one
    /// ([`DataShards::set_gradient_sync`]): `k` micro-batches cost one reduce-scatter per unit
    /// instead of `k`, for one unit-sized gradient buffer per unit (torch FSDP's `no_sync`).
    /// The result is the same up to the order of floating-point sums.
    pub fn with_fsdp_no_sync(mut self, on: bool) -> Self {
        self.fsdp_no_sync = on;
        self
    }

    /// Averages gradients over the data-parallel group `dp` (each rank trains on its part of
    /// the global batch).
    pub fn with_data_parallel(mut self, dp: ProcessGroup) -> Self {
        self.ddp = (dp.size() > 1).then(|| DistributedDataParallel::new(dp));
        self
    }

    /// Uses `ddp` (for its bucket size) for the data-parallel reduction.
    pub fn with_ddp(mut self, ddp: DistributedDataParallel) -> Self {
        self.ddp = Some(ddp);
        self
    }

    /// Averages gradients over `overlap`'s group *during* backward (see [`crate::overlap`]) in
    /// [`Self::step_with`], in place of [`Self::with_data_parallel`]'s reduction after it.
    /// Not with [`Self::with_fsdp`] (its units reduce in their own backward).
    pub fn with_overlap(mut self, overlap: OverlappedDdp) -> Self {
        self.overlap = Some(overlap);
        self
    }

    /// Clips the global gradient norm to `max_norm` (`None`: no clipping).
    pub fn with_clip(mut self, max_norm: Option<f64>) -> Self {
        self.max_grad_norm = max_norm;
        self
    }

    /// The gradients of `loss` for `model`, reduced as the layout needs and clipped: what the
    /// optimizer takes. Also returns the global norm before clipping (when clipping is on).
    ///
    /// # Errors
    /// Collective errors.
    pub fn gradients<M: Module>(
        &self,
        model: &M,
        loss: Tensor<1>,
    ) -> Result<(GradientsParams, Option<f64>)> {
        let grads = crate::autograd::backward(loss)?;
        self.reduce(model, GradientsParams::from_grads(grads, model))
    }

    /// [`Self::reduce`] for gradients of a loss scaled by [`Self::scaled_loss`]: also unscales
    /// them and checks them for overflow (before clipping), updating the loss scaler.
    ///
    /// # Errors
    /// Collective errors.
    pub fn reduce_scaled<M: Module>(&self, model: &M, grads: GradientsParams) -> Result<Reduced> {
        self.reduce_all(model, grads, true)
    }

    /// The optimizer step on reduced gradients (`reduced`), or none when they overflowed: the
    /// hidden matrices by the step's matrix optimizer, if it has one
    /// ([`Self::with_matrix_step`]), the rest by `optim`.
    ///
    /// # Returns
    /// The model and whether the step was skipped.
    ///
    /// # Errors
    /// The matrix optimizer's collective errors, or a model its map cannot describe.
    pub fn apply<M: Module>(
        &self,
        model: M,
        reduced: Reduced,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<(M, bool)> {
        if reduced.overflow {
            return Ok((model, true));
        }
        match &self.matrix {
            None => Ok((optim.step(lr, model, reduced.grads), false)),
            Some(matrix) => {
                let shards = self.fsdp.as_ref().map(|(shards, _)| shards);
                let map = ParamMap::new(&model, &self.tp, shards).map_err(|e| {
                    crate::CollectiveError::InvalidArgument {
                        rank: self.tp.group().map_or(0, |g| g.global_rank()),
                        op: "TrainStep::apply".into(),
                        reason: e.to_string(),
                    }
                })?;
                let model = matrix.step_module(&map, model, reduced.grads, optim, lr)?;
                Ok((model, false))
            }
        }
    }

    /// [`Self::gradients`] for gradients already computed, such as the sum of several
    /// micro-batches' gradients (gradient accumulation: scale each micro-batch's loss by
    /// `1 / micro-batches` and sum their gradients with Burn's `GradientsAccumulator`; the
    /// collectives then run once per step, except FSDP's reduce-scatter, which runs in each
    /// backward).
    ///
    /// # Errors
    /// Collective errors.
    pub fn reduce<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(GradientsParams, Option<f64>)> {
        if let Some(scaler) = &self.scaler {
            let scale = scaler.lock().expect("loss scaler").scale();
            return Err(crate::CollectiveError::InvalidArgument {
                rank: self.tp.group().map_or(0, |g| g.global_rank()),
                op: "TrainStep::reduce".into(),
                reason: format!(
                    "this step has a loss scaler (scale {scale}): an overflow must skip the \
                     step, which `reduce` cannot say; call `reduce_scaled` and `apply`"
                ),
            });
        }
        let reduced = self.reduce_all(model, grads, true)?;
        Ok((reduced.grads, reduced.grad_norm))
    }

    /// The reductions, with the data-parallel average left out (`data_parallel: false`) for
    /// gradients that arrive averaged already, then the unscaling and overflow check, then
    /// clipping.
    fn reduce_all<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        data_parallel: bool,
    ) -> Result<Reduced> {
        let (mut grads, overflow) = self.reduce_and_unscale(model, grads, data_parallel)?;
        if !self.update_loss_scale(overflow) {
            return Ok(Reduced::overflowed(grads));
        }
        // The global norm every applied step (what the NaN check of `finish_with` reads, and
        // a figure worth logging), clipped by when asked.
        let norm = self.global_norm(model, &grads)?;
        if let Some(max_norm) = self.max_grad_norm {
            grads = clip_to_norm(model, grads, norm, max_norm);
        }
        Ok(Reduced {
            grads,
            grad_norm: Some(norm),
            overflow: false,
        })
    }

    /// The reductions of [`Self::reduce`] and the unscaling, with the overflow check over the
    /// ranks that hold different gradients, but neither the loss scaler's update nor clipping:
    /// for a caller that decides one step over several models (a pipeline's stages, see
    /// `burn_pipeline::update::StageUpdater`) and then calls [`Self::update_loss_scale`] once
    /// with the decision of all of them.
    ///
    /// # Returns
    /// The reduced, unscaled gradients and whether they overflowed on any rank of the layout
    /// (always `false` without a loss scaler).
    ///
    /// # Errors
    /// Collective errors.
    pub fn reduce_unscaled<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(GradientsParams, bool)> {
        self.reduce_and_unscale(model, grads, true)
    }

    /// Updates the loss scaler with the step's overflow decision (see
    /// [`Self::reduce_unscaled`]): backs the scale off after an overflow, grows it after enough
    /// clean steps.
    ///
    /// # Returns
    /// Whether the step applies: `false` when the gradients overflowed (the step must be
    /// skipped); always `true` without a loss scaler.
    pub fn update_loss_scale(&self, overflow: bool) -> bool {
        match &self.scaler {
            Some(scaler) => scaler.lock().expect("loss scaler").update(overflow),
            None => true,
        }
    }

    /// The norm the step clips the global gradient norm to (`None`: no clipping).
    pub fn max_grad_norm(&self) -> Option<f64> {
        self.max_grad_norm
    }

    /// Whether `other` computes under the same precision policy with the same loss scaler (a
    /// clone of this step, or a step given the same settings and no scaler): what two parts of
    /// one training step that scale and unscale separately must share.
    pub fn same_precision(&self, other: &TrainStep) -> bool {
        let scalers = match (&self.scaler, &other.scaler) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.precision == other.precision && scalers
    }

    fn reduce_and_unscale<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        data_parallel: bool,
    ) -> Result<(GradientsParams, bool)> {
        let mut grads = self.tp.sync_gradients(grads)?;
        // FSDP shards leave the data-parallel all-reduce: they are averaged over their shard
        // group already, and only over the replicate group here.
        // In registration order, the same on every rank (collectives follow it).
        let mut sharded = Vec::new();
        if let Some((shards, _)) = &self.fsdp {
            for (id, _) in shards.snapshot() {
                if let Some(g) = grads.remove::<1>(id) {
                    sharded.push((id, g));
                }
            }
        }
        let mut grads = match &self.ddp {
            Some(ddp) if data_parallel && !self.precision.is_full() => ddp
                .clone()
                .with_reduce_dtype(self.precision.reduce_dtype)
                .all_reduce_grads(model, grads)?,
            Some(ddp) if data_parallel => ddp.all_reduce_grads(model, grads)?,
            _ => grads,
        };
        // HSDP: every unit's shard averaged over the replicas in one collective.
        let (ids, shards): (Vec<ParamId>, Vec<Tensor<1>>) = sharded.into_iter().unzip();
        let shards = match self.fsdp.as_ref().and_then(|(_, r)| r.as_ref()) {
            Some(replicate) => replicate.all_reduce_coalesced(shards, ReduceOp::Avg)?,
            None => shards,
        };
        for (id, g) in ids.into_iter().zip(shards) {
            grads.register::<1>(id, g);
        }
        // Fault-tolerant data parallelism: one exchange over the live replicas, the loss
        // riding along (staged by `finish_with`).
        if let Some(replicas) = self.replicas.as_ref().filter(|_| data_parallel) {
            if replicas.digest_due() {
                replicas.note_digest(Replicas::digest_of(model));
            }
            let loss = replicas.take_loss().unwrap_or(0.0);
            let (averaged, loss) = average_gradients(replicas, model, grads, loss)?;
            replicas.stage_loss(loss);
            grads = averaged;
        }
        let mut overflow = false;
        if let Some(scaler) = &self.scaler {
            let scale = scaler.lock().expect("loss scaler").scale();
            if scale != 1.0 {
                grads = scale_grads(model, grads, (1.0 / scale) as f32);
            }
            overflow = self.overflowed(model, &grads)?;
        }
        Ok((grads, overflow))
    }

    /// Whether any gradient holds an inf or NaN on any rank: one sum of absolute values per
    /// gradient on its device, one scalar read, then a max over the groups whose ranks hold
    /// different gradients (tensor-parallel shards, FSDP shards; data-parallel ranks hold the
    /// same averaged gradients, and an inf or NaN survives the average).
    fn overflowed<M: Module>(&self, model: &M, grads: &GradientsParams) -> Result<bool> {
        struct Total<'a> {
            grads: &'a GradientsParams,
            total: Option<Tensor<1>>,
        }
        impl ModuleVisitor for Total<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.grads.get::<D>(param.id) {
                    let s = g.abs().sum().cast(burn::tensor::DType::F32);
                    // Sums on one device: a model spread over devices adds on the first.
                    self.total = Some(match self.total.take() {
                        None => s,
                        Some(t) => {
                            let device = t.device();
                            t + s.to_device(&device)
                        }
                    });
                }
            }
        }
        let mut visit = Total { grads, total: None };
        model.visit(&mut visit);
        let local = visit
            .total
            .map_or(0.0, |t| t.into_scalar::<f32>())
            .is_finite();
        let mut bad = f32::from(u8::from(!local));
        let shard_group = self.fsdp.as_ref().map(|(shards, _)| shards.group().clone());
        for group in [self.tp.group().cloned(), shard_group]
            .into_iter()
            .flatten()
        {
            if group.size() > 1 {
                bad = group.all_reduce_f32(vec![bad], ReduceOp::Max)?[0];
            }
        }
        Ok(bad > 0.0)
    }

    /// One step: backward of `loss`, reductions, clipping, `optim.step(lr, ..)`.
    ///
    /// # Errors
    /// Collective errors (the model is then lost: the job cannot go on).
    pub fn step<M: Module>(
        &self,
        model: M,
        loss: Tensor<1>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<(M, StepOutput)> {
        self.check_shards(&model)?;
        let local = loss.clone().into_scalar::<f32>();
        let mut phases = StepPhases::default();
        let grads = phases.time(
            |p| &mut p.backward,
            || {
                crate::autograd::backward(self.scaled_loss(loss))
                    .map(|g| GradientsParams::from_grads(g, &model))
            },
        )?;
        self.finish(model, local, grads, optim, lr, phases)
    }

    /// Refuses a model with FSDP shards this step was not given ([`Self::with_fsdp`]): their
    /// gradients would reach the optimizer unreduced and the ranks would train apart.
    fn check_shards<M: Module>(&self, model: &M) -> Result<()> {
        let sharded = SHARDED.lock().unwrap_or_else(|p| p.into_inner());
        if sharded.is_empty() {
            return Ok(());
        }
        let shards = self.fsdp.as_ref().map(|(shards, _)| shards);
        let unknown = burn::module::list_param_ids(model)
            .into_iter()
            .filter(|id| sharded.contains(id))
            .find(|id| !shards.is_some_and(|s| s.holds(*id)));
        match unknown {
            None => Ok(()),
            Some(id) => Err(crate::CollectiveError::InvalidArgument {
                rank: self.tp.group().map_or(0, |g| g.global_rank()),
                op: "TrainStep".into(),
                reason: format!(
                    "the model holds FSDP units (parameter {id} is a shard over several ranks) \
                     that this step does not reduce: build the step with \
                     .with_fsdp(plan.shards().clone(), ..) of the plan the model was built \
                     with, or build the model without FSDP units"
                ),
            }),
        }
    }

    /// The end of every step but the overlapped one: the loss averaged over the data-parallel
    /// ranks, then the reductions, unscaling, overflow check, clipping and the update.
    fn finish<M: Module>(
        &self,
        model: M,
        local_loss: f32,
        grads: GradientsParams,
        optim: &mut ModuleOptimizer,
        lr: f64,
        phases: StepPhases,
    ) -> Result<(M, StepOutput)> {
        let group = self.ddp.as_ref().map(DistributedDataParallel::group);
        let reduce = |m: &M| self.reduce_scaled(m, grads);
        self.finish_with(model, (local_loss, group), reduce, optim, lr, phases)
    }

    /// The end of a step once its backward ran, shared by every step built on this one
    /// (`burn_moe::MoeStep` too): `local_loss` averaged over `loss_group` (`None`: one rank)
    /// and `reduce` (the gradients reduced, unscaled, checked and clipped), timed as
    /// [`StepPhases::reduce`]; then [`Self::apply`], timed as [`StepPhases::optimizer`].
    ///
    /// # Errors
    /// The loss average's collective error; `reduce`'s error;
    /// [`crate::CollectiveError::NonFinite`] when the averaged loss or the gradient norm is NaN
    /// or infinite and no loss scaler skipped the step (the model is not updated).
    pub fn finish_with<M: Module, E: From<crate::CollectiveError>>(
        &self,
        model: M,
        (local_loss, loss_group): (f32, Option<&ProcessGroup>),
        reduce: impl FnOnce(&M) -> std::result::Result<Reduced, E>,
        optim: &mut ModuleOptimizer,
        lr: f64,
        mut phases: StepPhases,
    ) -> std::result::Result<(M, StepOutput), E> {
        let reduced = phases.time(
            |p| &mut p.reduce,
            || -> std::result::Result<(f32, Reduced), E> {
                let loss_avg = match loss_group {
                    Some(group) => group.all_reduce_f32(vec![local_loss], ReduceOp::Avg)?[0],
                    None => local_loss,
                };
                let Some(replicas) = &self.replicas else {
                    return Ok((loss_avg, reduce(&model)?));
                };
                // The gradient exchange averages the loss over the replicas too.
                replicas.stage_loss(loss_avg);
                let reduced = reduce(&model)?;
                Ok((replicas.take_loss().unwrap_or(loss_avg), reduced))
            },
        );
        let (loss, reduced) = reduced?;
        // Megatron-LM's check: a NaN or infinite loss or gradient norm (computed every step)
        // stops training rather than writing NaN into the weights. Both figures are global,
        // so every rank refuses the same step. A loss scaler's overflow skips the step instead.
        if !reduced.overflow {
            let rank = loss_group
                .or(self.tp.group())
                .map_or(0, |g| g.global_rank());
            crate::CollectiveError::ensure_finite(rank, "loss", loss.into())?;
            if let Some(norm) = reduced.grad_norm {
                crate::CollectiveError::ensure_finite(rank, "gradient norm", norm)?;
            }
        }
        let grad_norm = reduced.grad_norm;
        let (model, skipped) = phases.time(
            |p| &mut p.optimizer,
            || self.apply(model, reduced, optim, lr),
        )?;
        let out = StepOutput {
            loss,
            grad_norm,
            skipped,
            phases,
        };
        Ok((model, out))
    }

    /// One step whose forward is `forward`, run on the model it is given: with
    /// [`Self::with_overlap`], a hooked copy of `model` whose gradients are averaged over the
    /// data-parallel group while backward runs; otherwise `model` itself, then as
    /// [`Self::step`].
    ///
    /// # Arguments
    /// * `model` - the model to train.
    /// * `forward` - computes this rank's loss with the module it receives.
    /// * `optim`, `lr` - the optimizer and learning rate.
    ///
    /// # Returns
    /// The updated model and the step's [`StepOutput`].
    ///
    /// # Errors
    /// `forward`'s error, collective errors (converted into `E`, for example
    /// [`crate::TpError`]), and [`crate::CollectiveError::InvalidArgument`] for overlap together
    /// with FSDP units.
    pub fn step_with<M: Module, E: From<crate::CollectiveError>>(
        &self,
        model: M,
        forward: impl FnOnce(&M) -> std::result::Result<Tensor<1>, E>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        let mut forward = Some(forward);
        self.step_accumulated(
            model,
            1,
            |m, _| (forward.take().expect("one micro-batch"))(m),
            optim,
            lr,
        )
    }

    /// One micro-batch's gradients for `model`: the backward of its loss divided by the number
    /// of micro-batches and multiplied by the loss scale (with a collective's error from inside
    /// the backward).
    fn micro_batch_grads<M: Module, E: From<crate::CollectiveError>>(
        &self,
        model: &M,
        loss: Tensor<1>,
        micro_batches: usize,
    ) -> std::result::Result<GradientsParams, E> {
        let loss = self.scaled_loss(loss / micro_batches as f32);
        let grads = crate::autograd::backward(loss).map_err(E::from)?;
        Ok(GradientsParams::from_grads(grads, model))
    }

    /// [`Self::step_with`] under [`Self::with_overlap`].
    ///
    /// With several micro-batches, all but the last are accumulated into the buckets without
    /// communication ([`crate::overlap::OverlapStep::accumulate`]); the last one's backward
    /// reduces them. Each loss is divided by the number of micro-batches, as without overlap
    /// (so half-precision backward passes round alike), and the buckets are summed
    /// ([`crate::overlap::OverlapStep::finish_summed`]).
    fn step_overlapped<M: Module, E: From<crate::CollectiveError>>(
        &self,
        overlap: &OverlappedDdp,
        model: M,
        micro_batches: usize,
        mut forward: impl FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        if self.replicas.is_some() {
            return Err(E::from(crate::CollectiveError::InvalidArgument {
                rank: overlap.group().global_rank(),
                op: "TrainStep::step_with".into(),
                reason: "overlapped data parallelism averages over a fixed group while backward \
                         runs; fault-tolerant replicas average after it: drop with_overlap or \
                         with_replicas"
                    .into(),
            }));
        }
        if self.fsdp.is_some() {
            return Err(E::from(crate::CollectiveError::InvalidArgument {
                rank: overlap.group().global_rank(),
                op: "TrainStep::step_with".into(),
                reason: "overlapped data parallelism does not combine with FSDP units; drop \
                         with_overlap or with_fsdp"
                    .into(),
            }));
        }
        let mut phases = StepPhases::default();
        let mut pending = match self.precision.is_full() {
            true => overlap.start(&model)?,
            false => overlap
                .clone()
                .with_reduce_dtype(self.precision.reduce_dtype)
                .start(&model)?,
        };
        let earlier = micro_batches.saturating_sub(1);
        let earlier_mean = run_micro_batches(
            earlier,
            &model,
            self.precision,
            &mut forward,
            &mut phases,
            |_, loss| {
                let grads = self.micro_batch_grads(&model, loss, micro_batches)?;
                pending.accumulate(&model, grads).map_err(E::from)
            },
        )?;
        // Under mixed precision the compute copy casts the hooked master weights: the hooks
        // see the master weights' gradients, as the plain path does.
        let hooked = self.precision.compute_copy(&pending.hook(model.clone()));
        let (loss, local) = phases.time(
            |p| &mut p.forward,
            || {
                let loss = forward(&hooked, earlier)?;
                let last = loss.clone().into_scalar::<f32>();
                let local = (earlier_mean * earlier as f32 + last) / (earlier + 1) as f32;
                Ok::<_, E>((loss, local))
            },
        )?;
        // One micro-batch: the loss as it is (a division would deepen the graph the hooks'
        // depths were calibrated on).
        let loss = match micro_batches {
            1 => loss,
            n => loss / n as f32,
        };
        phases.time(
            |p| &mut p.backward,
            || pending.backward(self.scaled_loss(loss)),
        )?;
        drop(hooked);
        // The loss on the group itself: the buckets travel on a sub-group of their own
        // meanwhile.
        let reduce = |m: &M| -> std::result::Result<Reduced, E> {
            let grads = pending.finish_summed(m)?;
            Ok(self.reduce_all(m, grads, false)?)
        };
        let loss = (local, Some(overlap.group()));
        self.finish_with(model, loss, reduce, optim, lr, phases)
    }

    /// One optimizer step over `micro_batches` micro-batches (gradient accumulation):
    /// `forward(model, k)` computes the mean loss of micro-batch `k` on the module it receives
    /// (the compute copy under mixed precision, `model` itself in fp32); each loss is divided
    /// by `micro_batches` (and multiplied by the loss scale) before its backward, the
    /// gradients are summed locally, and the layout's reductions, unscaling, overflow check,
    /// clipping and the optimizer run once, as for one batch of all the micro-batches' rows
    /// (FSDP units still reduce-scatter in each backward). With equal micro-batches this is
    /// the step of the whole batch, as Megatron's and torchtitan's accumulation are.
    ///
    /// ```
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::train::TrainStep;
    ///
    /// let device = Device::flex().autodiff();
    /// let init = Init::new(1, &device);
    /// let model = init.linear("fc", LinearInit::new(4, 1)).unwrap();
    /// let rows = Tensor::<2>::ones([4, 4], &device);
    /// let mut optim = AdamWConfig::new().init();
    /// let step = TrainStep::new(init.context());
    /// // two micro-batches of two rows each
    /// let (model, out) = step
    ///     .step_accumulated(
    ///         model,
    ///         2,
    ///         |m, k| m.forward(rows.clone().narrow(0, 2 * k, 2)).map(|y| y.powi_scalar(2).mean()),
    ///         &mut optim,
    ///         1e-2,
    ///     )
    ///     .unwrap();
    /// assert!(!out.skipped);
    /// # let _ = model;
    /// ```
    ///
    /// # Returns
    /// The updated model and the step's [`StepOutput`] (its loss: the mean over the
    /// micro-batches and the data-parallel ranks).
    ///
    /// # Errors
    /// `forward`'s error; collective errors (converted into `E`);
    /// [`crate::CollectiveError::InvalidArgument`] for zero micro-batches. With
    /// [`Self::with_overlap`], the micro-batches before the last are accumulated into the
    /// buckets and the last one's backward reduces them.
    pub fn step_accumulated<M: Module, E: From<crate::CollectiveError>>(
        &self,
        model: M,
        micro_batches: usize,
        mut forward: impl FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        let invalid = |reason: &str| {
            E::from(crate::CollectiveError::InvalidArgument {
                rank: self.tp.group().map_or(0, |g| g.global_rank()),
                op: "TrainStep::step_accumulated".into(),
                reason: reason.into(),
            })
        };
        if micro_batches == 0 {
            return Err(invalid("zero micro-batches: give at least one"));
        }
        self.check_shards(&model)?;
        if let Some(overlap) = &self.overlap {
            // The overlapped step: its hooks are the data-parallel reduction.
            return self.step_overlapped(overlap, model, micro_batches, forward, optim, lr);
        }
        let mut acc = GradientsAccumulator::<M>::new();
        // No-sync FSDP: the units communicate in the last micro-batch's backward only (and the
        // switch is back on however the loop ends).
        let no_sync = NoSync(
            self.fsdp
                .as_ref()
                .filter(|_| self.fsdp_no_sync && micro_batches > 1)
                .map(|(shards, _)| shards),
        );
        let mut phases = StepPhases::default();
        let mut forward = |m: &M, k: usize| {
            if let Some(shards) = no_sync.0 {
                shards.sync_micro_batch(k, micro_batches);
            }
            forward(m, k)
        };
        let local = run_micro_batches(
            micro_batches,
            &model,
            self.precision,
            &mut forward,
            &mut phases,
            |_, loss| {
                acc.accumulate(&model, self.micro_batch_grads(&model, loss, micro_batches)?);
                Ok(())
            },
        )?;
        drop(no_sync);
        Ok(self.finish(model, local, acc.grads(), optim, lr, phases)?)
    }

    /// The norm of the whole model's gradient: the squares of tensor-parallel shards summed over
    /// the `tp` group, those of replicated parameters counted once. Gradients are already
    /// averaged over `dp`, so they are the same on every data-parallel rank.
    ///
    /// # Errors
    /// Collective errors.
    pub fn global_norm<M: Module>(&self, model: &M, grads: &GradientsParams) -> Result<f64> {
        let tp_sharded = self.tp.sharded_ids();
        let fsdp: HashMap<ParamId, Vec<Range<usize>>> = self
            .fsdp
            .as_ref()
            .map(|(shards, _)| shards.snapshot().into_iter().collect())
            .unwrap_or_default();
        // Squares by where the elements live: [replicated, tp shards, fsdp shards of replicated
        // parameters, fsdp shards of tp shards], summed on the gradients' device (fp32) and
        // read to the host once: four numbers, not the gradients.
        let mut parts: [Vec<Tensor<1>>; 4] = Default::default();
        let mut device = None;
        for_each_grad(model, grads, |id, g| {
            let sq = |t: Tensor<1>| t.powi_scalar(2).sum();
            let device = device.get_or_insert_with(|| g.device());
            let g = g.to_device(device);
            match fsdp.get(&id) {
                Some(tp_ranges) => {
                    // The tp-sharded ranges and the rest, each summed on its own (not the whole
                    // minus the tp part: in fp32 that difference would round differently on
                    // the tp ranks, whose tp parts differ, and the norm must agree bit for bit).
                    let mut ranges = tp_ranges.clone();
                    ranges.sort_by_key(|r| r.start);
                    let len = g.dims()[0];
                    let mut at = 0;
                    for r in ranges {
                        if r.start > at {
                            parts[2].push(sq(g.clone().slice(at..r.start)));
                        }
                        if r.end > r.start {
                            parts[3].push(sq(g.clone().slice(r.clone())));
                        }
                        at = at.max(r.end);
                    }
                    if at < len {
                        parts[2].push(sq(g.clone().slice(at..len)));
                    }
                }
                None => parts[usize::from(tp_sharded.contains(&id))].push(sq(g)),
            }
        });
        let sums: [f64; 4] = match device {
            None => [0.0; 4],
            Some(device) => {
                let per_kind: Vec<Tensor<1>> = parts
                    .into_iter()
                    .map(|p| match p.is_empty() {
                        true => Tensor::zeros([1], &device),
                        false => Tensor::cat(p, 0).sum(),
                    })
                    .collect();
                let host = Tensor::cat(per_kind, 0)
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .expect("converted to f32");
                [0, 1, 2, 3].map(|k| f64::from(host[k]))
            }
        };
        let reduce = |group: Option<&ProcessGroup>, values: Vec<f64>| -> Result<Vec<f64>> {
            match group.filter(|g| g.size() > 1) {
                Some(group) => {
                    let n = values.len();
                    let total =
                        group.all_reduce_data(TensorData::new(values, [n]), ReduceOp::Sum)?;
                    Ok(total.try_to_vec::<f64>().expect("f64 in, f64 out"))
                }
                None => Ok(values),
            }
        };
        let shard_group = self.fsdp.as_ref().map(|(shards, _)| shards.group());
        let fsdp_sums = reduce(shard_group, vec![sums[2], sums[3]])?;
        let tp_sums = reduce(self.tp.group(), vec![sums[1], fsdp_sums[1]])?;
        Ok((sums[0] + fsdp_sums[0] + tp_sums[0] + tp_sums[1]).sqrt())
    }
}

/// Calls `f` with the id and the gradient (flattened, in fp32, on its device) of every gradient
/// `grads` holds for `model`.
fn for_each_grad<M: Module>(model: &M, grads: &GradientsParams, f: impl FnMut(ParamId, Tensor<1>)) {
    struct Visit<'a, F> {
        grads: &'a GradientsParams,
        f: F,
    }
    impl<F: FnMut(ParamId, Tensor<1>)> ModuleVisitor for Visit<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let g: Tensor<1> = g.flatten(0, D - 1);
                let g = match g.dtype() {
                    burn::tensor::DType::F32 => g,
                    _ => g.cast(burn::tensor::DType::F32),
                };
                (self.f)(param.id, g);
            }
        }
    }
    model.visit(&mut Visit { grads, f });
}

/// The sum of every gradient `grads` holds for `model`'s parameters, in fp32, read to the host
/// once: NaN or infinite exactly when some gradient element is (or when the sum overflows,
/// which only gradients near `f32::MAX` do). The local finiteness check for a step that
/// computes no norm (a pipeline stage updated as soon as its backward ends).
///
/// ```
/// use burn::module::Param;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::GradientsParams;
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::train::gradient_sum;
///
/// let device = Device::flex().autodiff();
/// let layer: Linear = LinearConfig::new(2, 1).init(&device);
/// let x = Tensor::<2>::from_floats([[1.0, f32::NAN]], &device);
/// let grads = GradientsParams::from_grads(layer.forward(x).sum().backward(), &layer);
/// assert!(gradient_sum(&layer, &grads).is_nan());
/// ```
pub fn gradient_sum<M: Module>(model: &M, grads: &GradientsParams) -> f64 {
    let mut sums = Vec::new();
    for_each_grad(model, grads, |_, g| {
        let device = sums.first().map(|s: &Tensor<1>| s.device());
        sums.push(match device {
            Some(device) => g.sum().to_device(&device),
            None => g.sum(),
        });
    });
    match sums.is_empty() {
        true => 0.0,
        false => f64::from(Tensor::cat(sums, 0).sum().into_scalar::<f32>()),
    }
}

/// Global-norm clipping once the norm is known: scales every gradient `grads` holds for
/// `model` by `max_norm / (norm + 1e-6)` when that is below 1 (PyTorch's `clip_grad_norm_`),
/// and returns `grads` untouched otherwise. For steps that compute the global norm their own
/// way (expert parallelism adds the experts' squares over the ep group).
pub fn clip_to_norm<M: Module>(
    model: &M,
    grads: GradientsParams,
    norm: f64,
    max_norm: f64,
) -> GradientsParams {
    let scale = max_norm / (norm + 1e-6);
    if scale < 1.0 {
        scale_grads(model, grads, scale as f32)
    } else {
        grads
    }
}

/// Multiplies every gradient `grads` holds for `model` by `scale`.
fn scale_grads<M: Module>(model: &M, grads: GradientsParams, scale: f32) -> GradientsParams {
    struct Scale {
        grads: GradientsParams,
        scale: f32,
    }
    impl ModuleVisitor for Scale {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register::<D>(param.id, g * self.scale);
            }
        }
    }
    let mut visitor = Scale { grads, scale };
    model.visit(&mut visitor);
    visitor.grads
}

// ---- checkpoints that outlive the layout ----

/// The rank-state key under which an engine's checkpoint keeps each rank's optimizer scalars.
pub const OPTIM_SCALARS: &str = "optim_scalars";

/// The trainer-state key of the loss scaler's state ([`LossScalerState`], `null` without a
/// scaler) in an engine's checkpoint.
pub const LOSS_SCALER: &str = "loss_scaler";

/// The loss scaler's state saved in `checkpoint`'s trainer state under [`LOSS_SCALER`]
/// (`None`: the saving run had no scaler).
///
/// # Errors
/// [`CheckpointError::Piece`] naming `loss_scaler` when the state does not parse.
pub fn saved_loss_scaler(checkpoint: &Checkpoint) -> checkpoint::Result<Option<LossScalerState>> {
    match checkpoint.state().get(LOSS_SCALER) {
        None | Some(Value::Null) => Ok(None),
        Some(saved) => serde_json::from_value(saved.clone())
            .map(Some)
            .map_err(|e| CheckpointError::piece(LOSS_SCALER, e.to_string())),
    }
}

/// The manifest's trainer state and this rank's state of an engine's checkpoint
/// ([`StepEngine::save`]): the caller's `state`, the loss scaler's (`None`: the run has no
/// scaler) and the optimizer's scalars (step counters) by logical parameter
/// ([`checkpoint::ScalarsByLogical`], or the JSON value [`ParamMap::optimizer_pieces`] gives).
/// One format for
/// every engine ([`TrainStep::save`], `burn_zero::ZeroOptimizer`), so that each loads what
/// another saved; read it back with [`saved_engine_states`].
///
/// # Returns
/// `(trainer state, rank state)`, as [`Checkpointer::save`] takes them.
///
/// # Example
/// ```
/// use burn_parallel::checkpoint::ScalarsByLogical;
/// use burn_parallel::train::engine_states;
///
/// let (trainer, rank) = engine_states(serde_json::json!({"epoch": 2}), None,
///     &ScalarsByLogical::default());
/// assert_eq!(trainer["state"]["epoch"], 2);
/// assert!(trainer["loss_scaler"].is_null() && rank.is_object());
/// ```
pub fn engine_states(
    state: impl Into<SaveState>,
    scaler: Option<LossScalerState>,
    scalars: &impl serde::Serialize,
) -> (Value, Value) {
    let state = state.into();
    let trainer = serde_json::json!({ "state": state.trainer, LOSS_SCALER: scaler });
    let mut rank = state.rank;
    rank.insert(
        OPTIM_SCALARS.into(),
        serde_json::to_value(scalars).unwrap_or(Value::Null),
    );
    (trainer, Value::Object(rank))
}

/// The caller's part of a checkpoint a [`StepEngine`] saves: the trainer's state (rank 0's is
/// kept; [`saved_engine_states`] gives it back) and this rank's own values (dropout positions,
/// data-loader state...), kept per rank beside the optimizer's scalars under the keys given
/// (read them from [`checkpoint::Manifest::rank_states`]).
///
/// ```
/// use burn_parallel::train::SaveState;
///
/// let state = SaveState::from(serde_json::json!({"epoch": 2}))
///     .with_rank("dropout_calls", serde_json::json!({"drop": 7}));
/// assert_eq!(state.trainer["epoch"], 2);
/// assert_eq!(state.rank["dropout_calls"]["drop"], 7);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SaveState {
    /// The trainer's state (the same on every rank).
    pub trainer: Value,
    /// This rank's values, by key.
    pub rank: serde_json::Map<String, Value>,
}

impl SaveState {
    /// Adds this rank's `value` under `key`.
    pub fn with_rank(mut self, key: &str, value: Value) -> Self {
        self.rank.insert(key.to_string(), value);
        self
    }
}

impl From<Value> for SaveState {
    fn from(trainer: Value) -> Self {
        Self {
            trainer,
            rank: serde_json::Map::new(),
        }
    }
}

/// What [`engine_states`] wrote into `checkpoint`: the caller's state (`Null` when none), the
/// loss scaler's (`None` when the saving run had no scaler), and the optimizer's scalars merged
/// over the saving ranks.
///
/// # Errors
/// [`CheckpointError::Piece`] naming `loss_scaler` when its saved state does not parse.
pub fn saved_engine_states(
    checkpoint: &Checkpoint,
) -> checkpoint::Result<(Value, Option<LossScalerState>, checkpoint::ScalarsByLogical)> {
    let scaler = saved_loss_scaler(checkpoint)?;
    let state = checkpoint
        .state()
        .get("state")
        .cloned()
        .unwrap_or(Value::Null);
    Ok((state, scaler, merged_scalars(checkpoint, OPTIM_SCALARS)))
}

impl TrainStep {
    /// The data-parallel group the step averages over (`None` for one data-parallel rank).
    fn data_parallel_group(&self) -> Option<&ProcessGroup> {
        match (&self.overlap, &self.ddp) {
            (Some(overlap), _) => Some(overlap.group()),
            (None, Some(ddp)) => Some(ddp.group()),
            (None, None) => None,
        }
    }

    /// How many ranks hold the same copy of a parameter of `kind`, and this rank's index among
    /// them: a replicated parameter is on every rank (data x tensor parallel), a
    /// tensor-parallel shard on the data-parallel ranks of its tensor-parallel rank, an FSDP
    /// flat shard on its replicas (HSDP).
    pub fn copies(&self, kind: ParamKind) -> (usize, usize) {
        let of = |g: Option<&ProcessGroup>| g.map_or((1, 0), |g| (g.size(), g.rank()));
        let (dp, dp_rank) = of(self.data_parallel_group());
        let (tp, tp_rank) = of(self.tp.group());
        match kind {
            ParamKind::Replicated => (dp * tp, dp_rank * tp + tp_rank),
            ParamKind::TpSharded => (dp, dp_rank),
            ParamKind::Flat => of(self.fsdp.as_ref().and_then(|(_, r)| r.as_ref())),
        }
    }

    /// What this rank holds of `model`'s logical parameters under this step's layout, and which
    /// part of it this rank writes (each element once over the ranks holding the same copy).
    ///
    /// # Errors
    /// As [`ParamMap::new`].
    pub fn param_map<M: Module>(&self, model: &M) -> checkpoint::Result<ParamMap> {
        let shards = self.fsdp.as_ref().map(|(shards, _)| shards);
        Ok(ParamMap::new(model, &self.tp, shards)?.with_replicas(|p| self.copies(p.kind)))
    }

    /// Saves `model`'s parameters and `optim`'s state as checkpoint `step` of `saver`: every
    /// rank writes its share of each logical tensor (parameters, `optim/<state>/<parameter>`),
    /// so that any layout loads it ([`Self::load`]); the loss scaler's state and `state` (the
    /// caller's: data position, schedule, losses...) go into the manifest. Collective over the
    /// ranks of `saver`'s group, which must be every rank of the layout.
    ///
    /// ```
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::Device;
    /// use burn_parallel::checkpoint::Checkpointer;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::run_local;
    /// use burn_parallel::train::TrainStep;
    ///
    /// let root = std::env::temp_dir().join(format!("train-step-doc-{}", std::process::id()));
    /// let step = |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     let model = init.linear("fc", LinearInit::new(4, 2)).unwrap();
    ///     (model, TrainStep::new(init.context()).with_data_parallel(group))
    /// };
    /// // Saved by two data-parallel ranks...
    /// run_local(2, |group| {
    ///     let (model, train) = step(group.clone());
    ///     let mut saver = Checkpointer::new(&root, 1, &group).unwrap();
    ///     let optim = AdamWConfig::new().init();
    ///     train.save(&mut saver, 7, &model, &optim, serde_json::json!({"epoch": 1})).unwrap();
    ///     Ok(())
    /// })
    /// .unwrap();
    /// // ...loaded on one device.
    /// let checkpoint = Checkpointer::latest(&root).unwrap().expect("a complete checkpoint");
    /// run_local(1, |group| {
    ///     let (model, train) = step(group);
    ///     let (_, _, state) = train.load(&checkpoint, model, AdamWConfig::new().init()).unwrap();
    ///     assert_eq!((checkpoint.step(), state["epoch"].as_u64()), (7, Some(1)));
    ///     Ok(())
    /// })
    /// .unwrap();
    /// # std::fs::remove_dir_all(&root).unwrap();
    /// ```
    ///
    /// # Errors
    /// [`CheckpointError`] for a parameter or state the map cannot describe, I/O and collective
    /// failures.
    pub fn save<M: Module>(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        optim: &ModuleOptimizer,
        state: impl Into<SaveState>,
    ) -> checkpoint::Result<()> {
        self.save_mapped(saver, step, model, optim, &self.param_map(model)?, state)
    }

    /// [`Self::save`] under `map`, the step's [`Self::param_map`] with what the caller changed
    /// (other replicas or logical names for some parameters: an MoE model's experts).
    ///
    /// # Errors
    /// As [`Self::save`].
    pub fn save_mapped<M: Module>(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        optim: &ModuleOptimizer,
        map: &ParamMap,
        state: impl Into<SaveState>,
    ) -> checkpoint::Result<()> {
        let mut pieces = map.param_pieces(model)?;
        let (optim_pieces, scalars) = self
            .elementwise_map(map)
            .optimizer_pieces(optim.to_record())?;
        pieces.extend(optim_pieces);
        if let Some(matrix) = &self.matrix {
            pieces.extend(matrix.state_pieces()?);
        }
        let scaler = self.loss_scaler().map(|s| s.state());
        let (trainer, rank) = engine_states(state, scaler, &scalars);
        saver.submit(step, pieces, trainer, rank)
    }

    /// Loads a checkpoint of [`Self::save`], saved under any layout, into `model` (this rank's
    /// part of each parameter) and `optim` (its state for those parts: moments and step
    /// counters), and restores the loss scaler.
    ///
    /// # Returns
    /// The model, the optimizer, and the caller's state given to [`Self::save`].
    ///
    /// # Errors
    /// [`CheckpointError::Mismatch`] when the checkpoint is of another model (names, shapes);
    /// [`CheckpointError::Corrupt`] for altered or truncated files; a loss scaler state that
    /// does not restore.
    pub fn load<M: Module>(
        &self,
        checkpoint: &Checkpoint,
        model: M,
        optim: ModuleOptimizer,
    ) -> checkpoint::Result<(M, ModuleOptimizer, Value)> {
        let map = self.param_map(&model)?;
        self.load_mapped(checkpoint, model, optim, &map)
    }

    /// [`Self::load`] under `map` (see [`Self::save_mapped`]).
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_mapped<M: Module>(
        &self,
        checkpoint: &Checkpoint,
        model: M,
        optim: ModuleOptimizer,
        map: &ParamMap,
    ) -> checkpoint::Result<(M, ModuleOptimizer, Value)> {
        let model = map.load_params(model, checkpoint)?;
        let (state, scaler, scalars) = saved_engine_states(checkpoint)?;
        let optim = match self
            .elementwise_map(map)
            .load_optimizer(checkpoint, &scalars)?
        {
            Some(record) => optim.load_record(record),
            None => optim,
        };
        if let (Some(matrix), Some(device)) = (&self.matrix, model.devices().first()) {
            matrix.load_state(checkpoint, &map.logical_shapes(), device)?;
        }
        if let Some(saved) = scaler {
            self.restore_loss_scaler(&saved)
                .map_err(|e| CheckpointError::piece("loss_scaler", e.to_string()))?;
        }
        Ok((model, optim, state))
    }
}
