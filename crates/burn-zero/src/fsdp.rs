//! ZeRO stage 3 / FSDP: parameters sharded per unit, all-gathered just before the unit's forward.
//!
//! A model is wrapped per *unit* (for a GPT: each transformer block, the embeddings, the head).
//! A unit ([`FsdpUnit`]) keeps only this rank's shard of its flat parameter space, as an fp32
//! leaf tensor ([`FlatShard`]), plus a *template*: the sub-module with its parameters replaced by
//! one-element placeholders. [`FsdpUnit::gather`] all-gathers the shard with the differentiable
//! [`gather_from_sequence`] (all-gather forward, reduce-scatter backward) and maps the slices into
//! a copy of the template: the returned module computes exactly like the original one, and when
//! backward reaches the gather, the unit's gradient is reduce-scattered onto the shard at once,
//! while earlier units are still running backward.
//!
//! Resharding: the guard [`Gathered`] releases the wrapper's reference when dropped (reshard
//! after forward, the default), or the unit keeps it until [`FsdpUnit::reshard`] (reshard after
//! backward). Burn's autodiff keeps the slices its backward needs (as it keeps activations), so
//! no second gather is needed for the backward.
//!
//! Where the bytes travel: the gathers and the gradient reduce-scatters are the shard group's
//! tensor-level collectives, so on NCCL with CUDA tensors they run in device memory; on the
//! other transports they stage through host memory. The optimizer side ([`FsdpOptimizer`])
//! reads each rank's gradient *shard* on the host (1/N of the unit) for its clipping and
//! loss-scale checks.
//!
//! Prefetch ([`ZeroConfig::prefetch`], [`FsdpUnit::prefetch`]): the forward all-gather of a unit
//! is split in two halves. [`FsdpUnit::prefetch`] starts the all-gather of the shard on a
//! background thread and returns at once; the plan then runs the current unit's forward while
//! the bytes travel; the next [`FsdpUnit::gather`] joins the thread and attaches the gathered
//! tensor to the shard's autodiff graph with [`burn_parallel::autograd::attach`], whose
//! backward reduce-scatters the gradient exactly as the synchronous path does (so losses are
//! identical with prefetch on or off). A plan prefetches unit `i + 1` right after gathering unit
//! `i` (see `examples::train_zero::FsdpGpt::loss`). Rules: every prefetch must be consumed by a
//! gather of the same unit before the rank issues any other collective on the shard group (only
//! one collective is ever in flight, in the same order on every rank), and a prefetched unit
//! counts as gathered memory from the moment it is issued (peak: two units instead of one).
//!
//! Frozen parameters (`require_grad` false on an autodiff device, e.g. after Burn's
//! `Module::no_grad`) are sharded and gathered like the others, so they cost `1/N` of their
//! size per rank, but in a second flat space of the unit, kept in the compute dtype (they are
//! never updated, so no fp32 master copy): their gather has no backward, they get no gradient
//! and no optimizer state, and the gathered module gives them back as frozen tensors. Keeping
//! them out of the trainable flat space, rather than masking them out of its update, spares the
//! optimizer state, the gradient reduce-scatter and the mask; a unit with frozen parameters pays
//! one more all-gather (no extra round trip with prefetch, which fetches both). They are not
//! part of the checkpoints of [`crate::dcp`] (which hold what training changes): restore them
//! as they were first loaded.
//!
//! Replicas: [`FsdpUnit::new`] checks that the unit's parameters are identical on every rank
//! ([`burn_parallel::replica::verify_replicas`]) before keeping this rank's slice.
//!
//! Gradient accumulation ([`FsdpContext`] with `accumulate_unsharded`): on every micro-step the
//! unit is gathered without a backward collective into a fresh leaf, whose full local gradient is
//! summed on this rank; [`FsdpOptimizer::step`] reduce-scatters it once (FSDP's `no_sync`:
//! communication only at the optimizer step, at the cost of unsharded gradients in between).

use std::ops::{Deref, Range};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use burn::module::Module;
use burn::optim::LearningRate;
use burn::tensor::Gradients;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::autograd::{BackwardFn, attach};
use burn_parallel::checkpoint::{Checkpoint, Piece, ScalarsByLogical};
use burn_parallel::nn::TpContext;
use burn_parallel::{ProcessGroup, ReduceOp};

use crate::error::{Result, ZeroError};
use crate::flat::{FlatLayout, host_f32, shard_range, shard_sizes, strip_params, tensor_1d};
use crate::memory::{Category, MemoryReport, MemoryTracker};
use crate::optim::{ElementWise, ShardedOptimizer};
use crate::precision::{LossScaler, MixedPrecision};
use crate::zero::{ShardGroups, StepInfo, ZeroConfig, check_overflow};

/// What every unit of one model shares: groups, device, policy and the memory tracker.
#[derive(Debug, Clone)]
pub struct FsdpContext {
    groups: ShardGroups,
    device: Device,
    precision: MixedPrecision,
    reshard_after_forward: bool,
    prefetch: bool,
    accumulate_unsharded: bool,
    tracker: MemoryTracker,
}

impl FsdpContext {
    /// A context on `device` (an autodiff device) for `config`; `grad_accum > 1` selects
    /// communication-free micro-steps (see the module doc).
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `device` is not an autodiff device or the config is invalid;
    /// [`ZeroError::UnsupportedDType`] when the precision policy does not fit the device.
    pub fn new(
        groups: ShardGroups,
        device: &Device,
        config: &ZeroConfig,
        grad_accum: usize,
    ) -> Result<Arc<Self>> {
        if !device.is_autodiff() {
            return Err(ZeroError::Config(
                "FSDP units train: pass an autodiff device (device.autodiff())".into(),
            ));
        }
        config.validate(device)?;
        Ok(Arc::new(Self {
            groups,
            device: device.clone(),
            precision: config.precision,
            reshard_after_forward: config.reshard_after_forward,
            prefetch: config.prefetch,
            accumulate_unsharded: grad_accum > 1,
            tracker: MemoryTracker::default(),
        }))
    }

    /// The groups.
    pub fn groups(&self) -> &ShardGroups {
        &self.groups
    }

    /// The memory tracker of all units.
    pub fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }

    /// The compute device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether plans should prefetch the next unit ([`ZeroConfig::prefetch`]).
    pub fn prefetch(&self) -> bool {
        self.prefetch
    }

    /// The mixed-precision policy.
    pub fn precision(&self) -> MixedPrecision {
        self.precision
    }
}

/// This rank's shard of one unit's flat parameter space, with its gradient.
#[derive(Debug)]
pub struct FlatShard {
    name: String,
    layout: FlatLayout,
    range: Range<usize>,
    param: Tensor<1>,
    grad: Option<Vec<f32>>,
    unsharded: Option<Vec<f32>>,
    pending: Mutex<Vec<Tensor<1>>>,
}

impl FlatShard {
    /// The unit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The unit's flat layout (all of it, not only this shard).
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// This rank's range of the unit's flat space.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The dtype of the master shard (always `F32`, whatever the compute dtype).
    pub fn dtype(&self) -> DType {
        self.param.dtype()
    }

    /// The fp32 master shard (host copy).
    pub fn values(&self) -> Vec<f32> {
        host_f32(self.param.clone())
    }

    /// Replaces the master shard (for checkpoint loading).
    ///
    /// # Errors
    /// [`ZeroError::Config`] on a length mismatch.
    pub fn set_values(&mut self, values: Vec<f32>) -> Result<()> {
        if values.len() != self.range.len() {
            return Err(ZeroError::Config(format!(
                "unit {}: {} values for a shard of {}",
                self.name,
                values.len(),
                self.range.len()
            )));
        }
        let device = self.param.device();
        self.param = tensor_1d(values, &device).require_grad();
        Ok(())
    }

    /// This rank's fp32 master shard as pieces of a distributed checkpoint, named by logical
    /// parameter (see [`crate::dcp`]), so that a checkpoint saved by any number of ranks loads
    /// at any other, at any stage.
    ///
    /// # Arguments
    /// * `tp` - the tensor-parallel context the unit's module was built with
    ///   (`TpContext::single()` for none).
    /// * `prefix` - the unit's path in the whole model (`"blocks.3"`; `""` when its layout's
    ///   paths already are whole-model paths).
    /// * `copies` - `(ranks holding this same shard, this rank's index among them)`: under
    ///   hybrid sharding the replicas share the writing; `(1, 0)` otherwise.
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] when a parameter cannot be described.
    pub fn checkpoint_params(
        &self,
        tp: &TpContext,
        prefix: &str,
        copies: (usize, usize),
    ) -> Result<Vec<Piece>> {
        let segments = crate::dcp::segments(tp, prefix, &self.layout, self.range.clone())?;
        crate::dcp::param_pieces(self.values(), &segments, copies)
    }

    /// Replaces the master shard by this rank's range read from a distributed checkpoint saved
    /// under any layout (see [`Self::checkpoint_params`]).
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] when a parameter is missing or cannot be read.
    pub fn load_checkpoint_params(
        &mut self,
        checkpoint: &Checkpoint,
        tp: &TpContext,
        prefix: &str,
    ) -> Result<()> {
        let segments = crate::dcp::segments(tp, prefix, &self.layout, self.range.clone())?;
        let values = crate::dcp::read_params(checkpoint, &segments, self.range.len())?;
        self.set_values(values)
    }
}

/// One FSDP unit: a sub-module of type `M` whose parameters are sharded.
///
/// See the [module documentation](self) and `examples::train_zero::FsdpGpt` for a whole model.
pub struct FsdpUnit<M: Module> {
    template: M,
    shard: FlatShard,
    /// The frozen parameters' flat space and this rank's slice of it (compute dtype, no
    /// autodiff); `None` when the unit has no frozen parameter.
    frozen: Option<(FlatLayout, Tensor<1>)>,
    ctx: Arc<FsdpContext>,
    cached: Mutex<Option<M>>,
    inflight: Mutex<Option<JoinHandle<Result<Fetched>>>>,
}

/// What a unit's all-gathers bring: the trainable flat space (when the unit has trainable
/// parameters) and the frozen one (when it has frozen parameters), on the device of the slices
/// they were gathered from (in device memory when the shard group collects there: NCCL).
type Fetched = (Option<Tensor<1>>, Option<Tensor<1>>);

/// How a unit's shard travels in the all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GatherMode {
    /// Gradient accumulation: gather fp32 values into a fresh leaf (no backward collective).
    Unsharded,
    /// Cast the fp32 shard to the compute dtype, gather and reduce-scatter in it.
    Low,
    /// Gather and reduce-scatter in fp32; cast to the compute dtype after the gather.
    Full,
}

impl<M: Module> FsdpUnit<M> {
    /// Shards the parameters of `module` whose path passes `keep` (all: `|_| true`) over the
    /// context's shard group, keeping only this rank's slice. `module` must be identical on
    /// every rank (build it from the same seed, or broadcast rank 0's); this is checked (a
    /// collective over the shard and replica groups). It is consumed, and its full parameters
    /// freed. Frozen parameters are sharded apart and never updated (see the
    /// [module documentation](self)).
    ///
    /// # Errors
    /// [`ZeroError::Replica`] when the replicas differ (on every rank); [`ZeroError::Config`]
    /// when no parameter passes `keep`.
    pub fn new(
        name: &str,
        module: M,
        keep: impl Fn(&str) -> bool + Copy,
        ctx: &Arc<FsdpContext>,
    ) -> Result<Self> {
        ctx.groups.verify_replicas(&module, keep)?;
        let layout = FlatLayout::trainable(&module, keep);
        let frozen_layout = FlatLayout::frozen(&module, keep);
        if layout.numel() == 0 && frozen_layout.numel() == 0 {
            return Err(ZeroError::Config(format!(
                "unit {name} has no parameters to shard"
            )));
        }
        let shard_group = ctx.groups.shard();
        let (rank, n) = (shard_group.rank(), shard_group.size());
        let range = shard_range(layout.numel(), rank, n);
        let param =
            tensor_1d(layout.flatten_range(&module, range.clone())?, &ctx.device).require_grad();
        ctx.tracker.add(Category::Params, range.len() * 4);
        let frozen = if frozen_layout.numel() == 0 {
            None
        } else {
            let range = shard_range(frozen_layout.numel(), rank, n);
            let dtype = ctx.precision.param_dtype;
            let values = frozen_layout.flatten_range(&module, range.clone())?;
            let inner = ctx.device.clone().inner();
            ctx.tracker
                .add(Category::Params, range.len() * dtype.size());
            Some((frozen_layout, tensor_1d(values, &inner).cast(dtype)))
        };
        Ok(Self {
            frozen,
            template: strip_params(module, |_| true),
            shard: FlatShard {
                name: name.to_string(),
                layout,
                range,
                param,
                grad: None,
                unsharded: None,
                pending: Mutex::new(Vec::new()),
            },
            ctx: ctx.clone(),
            cached: Mutex::new(None),
            inflight: Mutex::new(None),
        })
    }

    /// The shard.
    pub fn shard(&self) -> &FlatShard {
        &self.shard
    }

    /// The shard, mutable.
    pub fn shard_mut(&mut self) -> &mut FlatShard {
        &mut self.shard
    }

    fn mode(&self) -> GatherMode {
        let p = self.ctx.precision;
        if self.ctx.accumulate_unsharded {
            GatherMode::Unsharded
        } else if p.param_dtype != DType::F32 && p.reduce_dtype == p.param_dtype {
            GatherMode::Low
        } else {
            GatherMode::Full
        }
    }

    /// The tensor whose values travel in the all-gather, attached to the shard's graph unless
    /// `detached` (for a prefetch, which only reads its values).
    fn gather_input(&self, detached: bool) -> Tensor<1> {
        let param = if detached {
            self.shard.param.clone().detach()
        } else {
            self.shard.param.clone()
        };
        match self.mode() {
            GatherMode::Low => param.cast(self.ctx.precision.param_dtype),
            GatherMode::Unsharded | GatherMode::Full => param,
        }
    }

    fn gathered_bytes(&self) -> usize {
        let frozen = self.frozen.as_ref().map_or(0, |(l, _)| l.numel());
        (self.shard.layout.numel() + frozen) * self.ctx.precision.param_dtype.size()
    }

    /// Whether the unit has trainable parameters (a flat space to gather with a backward).
    fn trainable(&self) -> bool {
        self.shard.layout.numel() > 0
    }

    /// This rank's frozen slice (compute dtype, no autodiff), when there is one.
    fn frozen_input(&self) -> Option<Tensor<1>> {
        self.frozen.as_ref().map(|(_, t)| t.clone())
    }

    /// The all-gathers of the unit's slices (`trainable`: the detached trainable slice, when
    /// the unit has one), tensor-level so that they run in device memory where the shard group
    /// collects there.
    fn all_gather(
        group: &ProcessGroup,
        trainable: Option<Tensor<1>>,
        frozen: Option<Tensor<1>>,
    ) -> Result<Fetched> {
        let data = trainable.map(|t| group.all_gather(t, 0)).transpose()?;
        let frozen = frozen.map(|t| group.all_gather(t, 0)).transpose()?;
        Ok((data, frozen))
    }

    fn is_cached(&self) -> bool {
        self.cached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Starts this unit's all-gather on a background thread and returns at once; the next
    /// [`FsdpUnit::gather`] waits for it. A no-op when the unit is kept gathered or a prefetch
    /// is already in flight. The gathered bytes are counted from now on.
    ///
    /// The caller must call [`FsdpUnit::gather`] on this unit before issuing any other
    /// collective on the shard group (see the [module documentation](self)).
    ///
    /// # Errors
    /// [`ZeroError::Prefetch`] when the thread cannot be started.
    pub fn prefetch(&self) -> Result<()> {
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        if inflight.is_some() || self.is_cached() {
            return Ok(());
        }
        // Only the communication runs in the background.
        let data = self.trainable().then(|| self.gather_input(true));
        let frozen = self.frozen_input();
        let group = self.ctx.groups.shard().clone();
        let handle = std::thread::Builder::new()
            .name(format!("fsdp-prefetch-{}", self.shard.name))
            .spawn(move || Self::all_gather(&group, data, frozen))
            .map_err(|e| ZeroError::Prefetch {
                unit: self.shard.name.clone(),
                reason: format!("cannot start the prefetch thread: {e}"),
            })?;
        self.ctx
            .tracker
            .add(Category::Gathered, self.gathered_bytes());
        *inflight = Some(handle);
        Ok(())
    }

    /// Waits for an in-flight prefetch; `None` when there is none.
    fn join_prefetch(&self) -> Option<Result<Fetched>> {
        let handle = self
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        Some(handle.join().unwrap_or_else(|panic| {
            let reason = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the prefetch thread panicked".into());
            Err(ZeroError::Prefetch {
                unit: self.shard.name.clone(),
                reason,
            })
        }))
    }

    /// All-gathers the unit (or takes the result of its [`FsdpUnit::prefetch`]): returns the
    /// sub-module with its full parameters, in the policy's compute dtype, differentiable back
    /// to the shard (the backward reduce-scatters the gradient onto it).
    ///
    /// # Errors
    /// When the all-gather (or the prefetch) fails.
    pub fn gather(&self) -> Result<Gathered<M>> {
        if let Some(m) = self
            .cached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            return Ok(Gathered {
                module: m.clone(),
                release: None,
            });
        }
        let bytes = self.gathered_bytes();
        let input = self.gather_input(false);
        let (data, frozen) = match self.join_prefetch() {
            Some(result) => result.inspect_err(|_| {
                self.ctx.tracker.sub(Category::Gathered, bytes);
            })?,
            None => {
                let trainable = self.trainable().then(|| input.clone().detach());
                let fetched =
                    Self::all_gather(self.ctx.groups.shard(), trainable, self.frozen_input())?;
                self.ctx.tracker.add(Category::Gathered, bytes);
                fetched
            }
        };
        let low = self.ctx.precision.param_dtype;
        let mut module = self.template.clone();
        if let (Some((layout, _)), Some(frozen)) = (&self.frozen, frozen) {
            // No backward, no gradient: the frozen parameters come back frozen.
            let full = if self.ctx.device.is_autodiff() {
                frozen.autodiff()
            } else {
                frozen
            };
            module = layout.unflatten(module, full, false)?;
        }
        let Some(data) = data else {
            return Ok(self.keep_gathered(module, bytes));
        };
        let numel = self.shard.layout.numel();
        let full = match self.mode() {
            GatherMode::Unsharded => {
                // No backward collective: a fresh leaf whose local gradient is kept unsharded.
                let leaf = data.require_grad();
                self.shard
                    .pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(leaf.clone());
                leaf
            }
            GatherMode::Low | GatherMode::Full => {
                let group = self.ctx.groups.shard().clone();
                let on_device = group.collects_on_device(&data.device());
                let sizes = shard_sizes(numel, group.size());
                let (group_d, sizes_d) = (group.clone(), sizes.clone());
                attach(
                    input,
                    data,
                    BackwardFn::new("fsdp_gather", move |grad| {
                        group.reduce_scatter_data(grad, 0, ReduceOp::Sum, Some(&sizes))
                    })
                    .on_device_if::<1>(on_device, move |grad| {
                        group_d.reduce_scatter(grad, 0, ReduceOp::Sum, Some(&sizes_d))
                    }),
                )
            }
        };
        let full = if full.dtype() == low {
            full
        } else {
            full.cast(low)
        };
        let module = self.shard.layout.unflatten(module, full, false)?;
        Ok(self.keep_gathered(module, bytes))
    }

    /// The guard of a gathered module, caching it under the reshard-after-backward policy.
    fn keep_gathered(&self, module: M, bytes: usize) -> Gathered<M> {
        if self.ctx.reshard_after_forward {
            Gathered {
                module,
                release: Some((self.ctx.tracker.clone(), bytes)),
            }
        } else {
            *self.cached.lock().unwrap_or_else(|e| e.into_inner()) = Some(module.clone());
            Gathered {
                module,
                release: None,
            }
        }
    }

    /// Releases a unit kept gathered (reshard-after-backward policy); a no-op otherwise.
    pub fn reshard(&self) {
        if self
            .cached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .is_some()
        {
            self.ctx
                .tracker
                .sub(Category::Gathered, self.gathered_bytes());
        }
    }
}

impl<M: Module> Drop for FsdpUnit<M> {
    fn drop(&mut self) {
        // Never leave a collective running detached: wait for an unconsumed prefetch.
        if let Some(Ok(_)) = self.join_prefetch() {
            self.ctx
                .tracker
                .sub(Category::Gathered, self.gathered_bytes());
        }
    }
}

/// A gathered unit: derefs to the module; dropping it reshards (releases the wrapper's copy).
pub struct Gathered<M> {
    module: M,
    release: Option<(MemoryTracker, usize)>,
}

impl<M> Deref for Gathered<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.module
    }
}

impl<M> Drop for Gathered<M> {
    fn drop(&mut self) {
        if let Some((tracker, bytes)) = self.release.take() {
            tracker.sub(Category::Gathered, bytes);
        }
    }
}

/// The optimizer side of stage 3: collects shard gradients after each backward, then reduces
/// (when accumulating), clips by the global norm and updates every shard.
///
/// With a [`LossScaler`] in the config, scale the loss by [`FsdpOptimizer::loss_scale`] before
/// `backward`; a step whose gradients overflow on any rank is skipped ([`StepInfo::skipped`]):
/// shards and optimizer state stay untouched and the scale is lowered.
pub struct FsdpOptimizer<O: ElementWise> {
    ctx: Arc<FsdpContext>,
    optim: ShardedOptimizer<O>,
    max_grad_norm: Option<f64>,
    scaler: Option<LossScaler>,
    micro: usize,
}

impl<O: ElementWise> FsdpOptimizer<O> {
    /// `optim` over `units` shards.
    pub fn new(ctx: &Arc<FsdpContext>, config: &ZeroConfig, optim: O, units: usize) -> Self {
        Self {
            ctx: ctx.clone(),
            optim: ShardedOptimizer::new(optim, units).with_offload(config.offload_optimizer),
            max_grad_norm: config.max_grad_norm,
            scaler: config.loss_scaler.clone(),
            micro: 0,
        }
    }

    /// The scale to multiply the loss by before `backward` (1 without a loss scaler).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The loss scaler, when the config has one.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The loss scaler, mutable (to restore its state from a checkpoint with
    /// [`LossScaler::restore`]).
    pub fn scaler_mut(&mut self) -> Option<&mut LossScaler> {
        self.scaler.as_mut()
    }

    /// Unit `unit`'s optimizer state (`shard` is that unit's shard) as pieces of a distributed
    /// checkpoint, named `optim/<state>/<logical parameter>` like every other layout's, and its
    /// scalars by logical parameter, for the rank state (see [`FlatShard::checkpoint_params`]
    /// for `tp`, `prefix` and `copies`).
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] when a parameter cannot be described.
    pub fn checkpoint_state(
        &self,
        unit: usize,
        shard: &FlatShard,
        tp: &TpContext,
        prefix: &str,
        copies: (usize, usize),
    ) -> Result<(Vec<Piece>, ScalarsByLogical)> {
        let segments = crate::dcp::segments(tp, prefix, &shard.layout, shard.range.clone())?;
        crate::dcp::state_pieces(&self.optim, unit, &segments, copies)
    }

    /// Restores unit `unit`'s optimizer state from a distributed checkpoint saved under any
    /// layout; `scalars` are the saving ranks' scalars by logical parameter
    /// ([`burn_parallel::checkpoint::merged_scalars`]). No state there leaves it empty, as
    /// before a first step.
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] on a read error; [`ZeroError::Config`] when the state of the
    /// shard's parameters is only partly there or does not fit this optimizer.
    pub fn load_checkpoint_state(
        &mut self,
        unit: usize,
        shard: &FlatShard,
        checkpoint: &Checkpoint,
        (tp, prefix): (&TpContext, &str),
        scalars: &ScalarsByLogical,
    ) -> Result<()> {
        let segments = crate::dcp::segments(tp, prefix, &shard.layout, shard.range.clone())?;
        crate::dcp::load_state(
            &mut self.optim,
            (unit, shard.range.len()),
            checkpoint,
            &segments,
            scalars,
            &self.ctx.device.clone().inner(),
        )
    }

    /// The sharded optimizer (for checkpoints).
    pub fn optimizer(&self) -> &ShardedOptimizer<O> {
        &self.optim
    }

    /// The sharded optimizer, mutable (for checkpoints).
    pub fn optimizer_mut(&mut self) -> &mut ShardedOptimizer<O> {
        &mut self.optim
    }

    /// Takes this micro-step's gradients of every shard from `grads` (the result of
    /// `loss.backward()`). Shards must be passed in the same order at every call.
    ///
    /// # Errors
    /// Never at present (kept fallible for asynchronous reductions).
    pub fn accumulate(&mut self, shards: Vec<&mut FlatShard>, grads: &Gradients) -> Result<()> {
        let tracker = &self.ctx.tracker;
        for shard in shards {
            let pending =
                std::mem::take(&mut *shard.pending.lock().unwrap_or_else(|e| e.into_inner()));
            if self.ctx.accumulate_unsharded {
                for leaf in pending {
                    let Some(g) = leaf.grad(grads) else { continue };
                    let g = host_f32(g);
                    match &mut shard.unsharded {
                        Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                        None => {
                            tracker.add(Category::Grads, g.len() * 4);
                            shard.unsharded = Some(g);
                        }
                    }
                }
            } else if let Some(g) = shard.param.grad(grads) {
                let g = host_f32(g);
                match &mut shard.grad {
                    Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                    None => {
                        tracker.add(Category::Grads, g.len() * 4);
                        shard.grad = Some(g);
                    }
                }
            }
        }
        self.micro += 1;
        Ok(())
    }

    /// Reduces (when accumulating), averages and unscales, skips the step on an overflow (loss
    /// scaling), clips and applies the optimizer to every shard.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when no gradients were accumulated; collective failures.
    pub fn step(&mut self, lr: LearningRate, mut shards: Vec<&mut FlatShard>) -> Result<StepInfo> {
        let micro = std::mem::take(&mut self.micro);
        if micro == 0 {
            return Err(ZeroError::Config(
                "step called without gradients; call accumulate after each backward".into(),
            ));
        }
        let groups = self.ctx.groups.clone();
        let tracker = self.ctx.tracker.clone();
        let n = groups.shard().size();
        let loss_scale = self.loss_scale();
        let mut grads = Vec::with_capacity(shards.len());
        for shard in shards.iter_mut() {
            if shard.layout.numel() == 0 {
                grads.push(Vec::new()); // a unit of frozen parameters only: nothing to step
                continue;
            }
            let summed = if let Some(full) = shard.unsharded.take() {
                let numel = full.len();
                let out = groups.shard().reduce_scatter_data(
                    TensorData::new(full, [numel]),
                    0,
                    ReduceOp::Sum,
                    Some(&shard_sizes(numel, n)),
                )?;
                tracker.sub(Category::Grads, numel * 4);
                tracker.add(Category::Grads, shard.range.len() * 4);
                out.try_into_vec::<f32>().expect("f32")
            } else if let Some(g) = shard.grad.take() {
                g
            } else {
                // A unit unused in this step: its gradient is zero on every rank.
                tracker.add(Category::Grads, shard.range.len() * 4);
                vec![0.0; shard.range.len()]
            };
            grads.push(groups.finish_shard_grad(summed, micro, loss_scale)?);
        }
        if check_overflow(&groups, self.scaler.as_mut(), &grads)? {
            for g in &grads {
                tracker.sub(Category::Grads, g.len() * 4);
            }
            tracker.finish_step();
            return Ok(StepInfo {
                grad_norm: None,
                skipped: true,
                loss_scale,
            });
        }
        let grad_norm = groups.clip(&mut grads, self.max_grad_norm)?;
        let inner = self.ctx.device.clone().inner();
        for (i, (shard, grad)) in shards.into_iter().zip(grads).enumerate() {
            if shard.layout.numel() == 0 {
                continue;
            }
            let len = grad.len();
            let param = shard.param.clone().detach().inner();
            let new = self.optim.step(i, lr, param, tensor_1d(grad, &inner));
            shard.param = Tensor::from_inner(new).require_grad();
            tracker.sub(Category::Grads, len * 4);
        }
        tracker.set(Category::Optimizer, self.optim.state_bytes());
        tracker.finish_step();
        Ok(StepInfo {
            grad_norm,
            skipped: false,
            loss_scale,
        })
    }

    /// The memory held by all units and this optimizer over the last step (see
    /// [`crate::memory`]).
    pub fn memory(&self) -> MemoryReport {
        self.ctx.tracker.last_step()
    }
}
