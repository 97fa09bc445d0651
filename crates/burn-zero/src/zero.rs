//! ZeRO stages 1 and 2 over a data-parallel group, and the configuration shared by all stages.
//!
//! Every rank holds the whole model (a plain Burn module). After the backward:
//!
//! - stage 1: every rank sums its micro-steps' gradients in one full flat buffer, which is
//!   reduce-scattered once per step (each rank receives the sum of its own shard only: half the
//!   traffic of an all-reduce, which would hand every rank the whole sum to use a slice of it);
//!   each rank updates only its shard of the flat parameter space with its shard of the
//!   optimizer state, and the updated shards are all-gathered back into the module;
//! - stage 2: the gradient is reduce-scattered instead, bucket by bucket, at every
//!   [`ZeroOptimizer::accumulate`]: the parameters are cut, in flat order, into buckets of about
//!   [`ZeroConfig::bucket_bytes`]; a bucket's gradients are laid end to end in one tensor, and
//!   its reduce-scatter gives each rank the part of the bucket's flat range that falls in its
//!   shard, summed into the rank's gradient shard. Each bucket's reduce-scatter is started as
//!   soon as the bucket is built ([`ProcessGroup::reduce_scatter_async`]) and runs while the
//!   next is built. No rank ever holds the full flat gradient: the staging is at most three
//!   buckets (two in flight, one being built; a parameter larger than a bucket is a bucket of
//!   its own), and the gradients Burn's backward produced are released bucket by bucket as
//!   they are laid out. The update and the all-gather are the same as stage 1.
//!
//! Everything stays on the parameters' device: the flat gradient or its shard, the norm and
//! the finiteness check (one number read each), the optimizer's update (unless offloaded) and
//! the all-gather's input and output. Where the group's backend collects on the device (NCCL
//! with CUDA tensors) no gradient or parameter passes through host memory, and the collectives
//! run on the communicator's stream, ordered after the kernels that made their inputs; on the
//! other backends the tensor collectives copy through the host as they always do.
//!
//! With gradient accumulation, stage 1 sums micro-step gradients locally in one flat buffer and
//! communicates once, at [`ZeroOptimizer::step`]; stage 2 reduce-scatters every micro-step into
//! the shard (as DeepSpeed's ZeRO-2 does), so accumulation costs no full-size buffer.
//!
//! Frozen parameters (`require_grad` false on an autodiff device, e.g. after Burn's
//! `Module::no_grad`) are not part of the flat space at all ([`FlatLayout::trainable`]): they get
//! no gradient, no optimizer state and no communication, and are never rewritten, so their value
//! and their flag are kept exactly. (Leaving them in the flat space and masking the update would
//! still cost optimizer state, reduction traffic and a mask for every step, for nothing.)
//! Limitation: a *trainable* parameter that no rank used in a step gets a zero gradient here (its
//! AdamW decay and momentum still move it), where Burn's optimizer on one device, and DDP, skip
//! it: the flat shard has one optimizer state, which cannot skip some elements exactly.
//!
//! Replicas: [`ZeroOptimizer::new`] checks that the module is identical on every rank
//! ([`burn_parallel::replica::verify_replicas`]) and refuses it otherwise.
//!
//! Hybrid sharding ([`ShardGroups::hybrid`]): shard inside `dp_shard`, replicate across
//! `dp_replicate`; gradient shards are averaged across replicas with one more all-reduce.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate};
use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_parallel::checkpoint::{self, Checkpoint, CheckpointError, Checkpointer};
use burn_parallel::ddp::DEFAULT_BUCKET_BYTES;
use burn_parallel::muon::{Held, MatrixStep};
use burn_parallel::nn::TpContext;
use burn_parallel::replica::verify_replicas_in;
use burn_parallel::train::{
    SaveState, StepEngine, StepOutput, StepPhases, engine_states, run_micro_batches,
    saved_engine_states,
};
use burn_parallel::{DeviceMesh, ProcessGroup, ReduceOp};

use crate::clip::clip_coefficient;
use crate::error::{Result, ZeroError};
use crate::flat::{
    FlatLayout, as_f32, cast_frozen, concat_1d, host_f32, shard_range, shard_sizes, tensor_1d,
    tracked_as,
};
use crate::memory::{Category, MemoryReport, MemoryTracker};
use crate::optim::{ElementWise, ShardedOptimizer};
use crate::precision::{LossScaler, LossScalerState, MixedPrecision};

/// Which ZeRO stage. In a config file it is its number (`zero = 2`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "usize", into = "usize")]
pub enum Stage {
    /// Optimizer state sharded.
    One,
    /// Optimizer state and gradients sharded.
    Two,
    /// Optimizer state, gradients and parameters sharded (FSDP).
    Three,
}

impl Stage {
    /// The stage numbered `n` (1, 2 or 3).
    ///
    /// # Errors
    /// [`ZeroError::Config`] for another number.
    pub fn from_number(n: usize) -> Result<Self> {
        match n {
            1 => Ok(Stage::One),
            2 => Ok(Stage::Two),
            3 => Ok(Stage::Three),
            other => Err(ZeroError::Config(format!(
                "ZeRO stage {other} does not exist; use 1 (optimizer state), 2 (+ gradients) or \
                 3 (+ parameters, FSDP)"
            ))),
        }
    }

    /// 1, 2 or 3.
    pub fn number(self) -> usize {
        match self {
            Stage::One => 1,
            Stage::Two => 2,
            Stage::Three => 3,
        }
    }
}

impl TryFrom<usize> for Stage {
    type Error = ZeroError;

    fn try_from(n: usize) -> Result<Self> {
        Self::from_number(n)
    }
}

impl From<Stage> for usize {
    fn from(stage: Stage) -> usize {
        stage.number()
    }
}

/// Options of every stage.
#[derive(Debug, Clone)]
pub struct ZeroConfig {
    /// The stage.
    pub stage: Stage,
    /// Clip the global gradient norm to this value (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    /// Keep the optimizer state on the host and update there.
    pub offload_optimizer: bool,
    /// Dtypes of compute and reduction (every stage); master weights and optimizer state stay
    /// fp32.
    pub precision: MixedPrecision,
    /// Dynamic loss scaling (for f16; any policy accepts it). `None`: gradients are used as
    /// they come.
    pub loss_scaler: Option<LossScaler>,
    /// Stage 2: size of the gradient buckets reduce-scattered one at a time (whole parameters
    /// in flat order; a parameter larger than this is a bucket of its own).
    pub bucket_bytes: usize,
}

impl ZeroConfig {
    /// Defaults for `stage`: no clipping, no offload, fp32, no loss scaling.
    pub fn new(stage: Stage) -> Self {
        Self {
            stage,
            max_grad_norm: None,
            offload_optimizer: false,
            precision: MixedPrecision::full(),
            loss_scaler: None,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        }
    }

    /// Sets the stage-2 gradient bucket size (at least one parameter per bucket).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }

    /// Sets the global gradient-norm clipping.
    pub fn with_max_grad_norm(mut self, norm: Option<f64>) -> Self {
        self.max_grad_norm = norm;
        self
    }

    /// Sets optimizer-state offload.
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload_optimizer = offload;
        self
    }

    /// Sets the mixed-precision policy.
    pub fn with_precision(mut self, precision: MixedPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// Sets dynamic loss scaling.
    pub fn with_loss_scaler(mut self, scaler: Option<LossScaler>) -> Self {
        self.loss_scaler = scaler;
        self
    }

    /// Checks the parts of the configuration that do not depend on the model.
    ///
    /// # Errors
    /// [`ZeroError::Config`] for a non-positive clipping norm or an invalid loss scaler;
    /// [`ZeroError::UnsupportedDType`] when `device` lacks a dtype of the policy.
    pub fn validate(&self, device: &Device) -> Result<()> {
        if let Some(norm) = self.max_grad_norm
            && !(norm.is_finite() && norm > 0.0)
        {
            return Err(ZeroError::Config(format!(
                "max_grad_norm must be positive and finite, not {norm}"
            )));
        }
        if let Some(scaler) = &self.loss_scaler {
            scaler.validate()?;
        }
        Ok(self.precision.validate(device)?)
    }
}

/// The groups a sharded wrapper works over: `shard` (the ranks a flat space is split across)
/// and optionally `replicate` (the ranks holding the same shard, for hybrid sharding).
///
/// ```
/// use burn_parallel::run_local;
/// use burn_zero::ShardGroups;
/// let sizes = run_local(2, |g| Ok(ShardGroups::flat(g).data_size())).unwrap();
/// assert_eq!(sizes, vec![2, 2]);
/// ```
#[derive(Debug, Clone)]
pub struct ShardGroups {
    shard: ProcessGroup,
    replicate: Option<ProcessGroup>,
}

impl ShardGroups {
    /// Shard over the whole `group` (plain ZeRO / FSDP).
    pub fn flat(group: ProcessGroup) -> Self {
        Self {
            shard: group,
            replicate: None,
        }
    }

    /// Hybrid sharding (HSDP): shard inside the mesh dimension `dp_shard`, replicate across
    /// `dp_replicate`.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when the mesh lacks one of the two dimensions.
    pub fn hybrid(mesh: &DeviceMesh) -> Result<Self> {
        let get = |name: &str| {
            mesh.group(name).cloned().map_err(|e| {
                ZeroError::Config(format!(
                    "hybrid sharding needs mesh dimensions \"dp_replicate\" and \"dp_shard\": {e}"
                ))
            })
        };
        Ok(Self {
            shard: get("dp_shard")?,
            replicate: Some(get("dp_replicate")?),
        })
    }

    /// The group a flat space is sharded over.
    pub fn shard(&self) -> &ProcessGroup {
        &self.shard
    }

    /// The replica group (hybrid sharding only).
    pub fn replicate(&self) -> Option<&ProcessGroup> {
        self.replicate.as_ref()
    }

    /// Checks that the parameters of `module` whose path passes `keep` are identical on every
    /// data-parallel rank (shard and replica groups), with the same verdict on every rank.
    ///
    /// # Errors
    /// [`ZeroError::Replica`] naming the first differing parameter and the ranks that disagree.
    pub fn verify_replicas<M: Module>(
        &self,
        module: &M,
        keep: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let mut groups = vec![&self.shard];
        groups.extend(self.replicate.as_ref());
        Ok(verify_replicas_in(module, &groups, keep)?)
    }

    /// This rank's index among all data-parallel ranks (which rows of the batch it takes).
    pub fn data_rank(&self) -> usize {
        let r = self.replicate.as_ref().map_or(0, |g| g.rank());
        r * self.shard.size() + self.shard.rank()
    }

    /// Number of data-parallel ranks.
    pub fn data_size(&self) -> usize {
        self.shard.size() * self.replicate.as_ref().map_or(1, |g| g.size())
    }

    /// Averages a metric over all data-parallel ranks.
    ///
    /// # Errors
    /// When an all-reduce fails.
    pub fn mean(&self, value: f32) -> Result<f32> {
        let mut v = self.shard.all_reduce_f32(vec![value], ReduceOp::Avg)?;
        if let Some(r) = &self.replicate {
            v = r.all_reduce_f32(v, ReduceOp::Avg)?;
        }
        Ok(v[0])
    }

    /// Turns this rank's reduced-and-summed gradient shard into the average over all
    /// data-parallel ranks and `micro_steps`, divided by the loss scale, averaging across
    /// replicas.
    pub(crate) fn finish_shard_grad(
        &self,
        shard: Tensor<1>,
        micro_steps: usize,
        loss_scale: f64,
    ) -> Result<Tensor<1>> {
        let mut scale = 1.0 / (micro_steps * self.shard.size()) as f32;
        if loss_scale != 1.0 {
            // Exact for a power-of-two scale: the product only shifts the exponent.
            scale *= (1.0 / loss_scale) as f32;
        }
        let mut shard = shard * scale;
        if let Some(r) = &self.replicate
            && r.size() > 1
        {
            shard = r.all_reduce_async(shard, ReduceOp::Avg).wait_on_device()?;
        }
        Ok(shard)
    }

    /// Whether `flag` is true on any data-parallel rank.
    ///
    /// # Errors
    /// When an all-reduce fails.
    pub fn any(&self, flag: bool) -> Result<bool> {
        let mut v = self
            .shard
            .all_reduce_f32(vec![f32::from(u8::from(flag))], ReduceOp::Max)?;
        if let Some(r) = &self.replicate {
            v = r.all_reduce_f32(v, ReduceOp::Max)?;
        }
        Ok(v[0] > 0.0)
    }
}

/// What a step did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepInfo {
    /// The global gradient norm before clipping (every applied step: it is checked for NaN).
    pub grad_norm: Option<f64>,
    /// The gradients overflowed (inf/NaN on some rank) under loss scaling: weights and
    /// optimizer state were left untouched and the scale lowered.
    pub skipped: bool,
    /// The loss scale the step's gradients were unscaled by (1 without a scaler).
    pub loss_scale: f64,
}

/// Turns an overflow under loss scaling into a skipped step: updates `scaler` (when there is
/// one) and returns whether the step must be skipped. Without a scaler, non-finite gradients
/// are not checked (as in plain fp32 training).
pub(crate) fn check_overflow(
    groups: &ShardGroups,
    scaler: Option<&mut LossScaler>,
    shard: &Tensor<1>,
) -> Result<bool> {
    let Some(scaler) = scaler else {
        return Ok(false);
    };
    let local = !all_finite(shard)?;
    let overflow = groups.any(local)?;
    Ok(!scaler.update(overflow))
}

/// Whether every element of `t` is finite (no infinity, no NaN), summed on `t`'s device: one
/// number read.
fn all_finite(t: &Tensor<1>) -> Result<bool> {
    // `0 * x` is NaN exactly for an infinite or NaN `x`; the sum of zeros stays zero.
    Ok(read_scalars((t.clone() * 0.0).sum())?[0].is_finite())
}

/// The values of a small tensor, read to the host in f32.
fn read_scalars(t: Tensor<1>) -> Result<Vec<f32>> {
    as_f32(t)
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| ZeroError::Config(format!("reading a reduced value from the device: {e:?}")))
}

/// ZeRO stage 1 or 2 around any element-wise Burn [`Optimizer`](burn::optim::Optimizer).
///
/// Mixed precision ([`ZeroConfig::precision`] other than fp32): the module computes in the
/// policy's `param_dtype` (call [`ZeroOptimizer::prepare_module`] once before the first
/// forward), the wrapper keeps the fp32 master copy of this rank's shard and the optimizer state
/// in fp32, and gradients are reduced in `reduce_dtype` (see [`crate::precision`]). With a
/// [`LossScaler`] in the config, scale the loss by [`ZeroOptimizer::loss_scale`] before
/// `backward`; a step whose gradients overflow is skipped ([`StepInfo::skipped`]).
///
/// # Example
/// ```
/// use burn::module::Module;
/// use burn::nn::LinearConfig;
/// use burn::optim::{AdamWConfig, GradientsParams};
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{DistributedDataParallel, run_local};
/// use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
///
/// run_local(2, |group| {
///     let device = Device::flex().autodiff();
///     // Identical replicas: rank 0's random initialisation, broadcast.
///     let model = LinearConfig::new(4, 3).init(&device);
///     let mut model = DistributedDataParallel::new(group.clone()).broadcast_module(model, 0)?;
///     let groups = ShardGroups::flat(group);
///     let mut zero = ZeroOptimizer::new(&model, groups, ZeroConfig::new(Stage::Two),
///         AdamWConfig::new().build()).unwrap();
///     model = zero.prepare_module(model).unwrap(); // a no-op in fp32
///     let x = Tensor::<2>::ones([2, 4], &device);
///     let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
///     zero.accumulate(&model, grads).unwrap();
///     model = zero.step(1e-3, model).unwrap().0;
///     Ok(())
/// })
/// .unwrap();
/// ```
pub struct ZeroOptimizer<O: ElementWise> {
    groups: ShardGroups,
    config: ZeroConfig,
    layout: FlatLayout,
    range: Range<usize>,
    optim: ShardedOptimizer<O>,
    tracker: MemoryTracker,
    /// The summed gradient, in f32 on the parameters' device (without autodiff): the full flat
    /// space at stage 1, this rank's shard at stage 2.
    acc: Option<Tensor<1>>,
    micro: usize,
    device: Device,
    /// The fp32 master copy of this rank's shard (mixed precision only: in fp32 the module's
    /// own parameters are the master weights).
    master: Option<Tensor<1>>,
    scaler: Option<LossScaler>,
    /// Tensor parallelism: the model's context and the ranges of the flat space that hold
    /// tensor-parallel shards (their squares are summed over the group in the global norm).
    tp: Option<(TpContext, Vec<Range<usize>>)>,
    /// The checkpoint name of each parameter path ([`Self::with_logical_names`]).
    logical_names: Option<LogicalNames>,
    /// The coming step's gradient shard, reduced ahead of it ([`Self::gradient_squares`]).
    reduced: Option<ReducedShard>,
    /// The optimizer of the hidden matrices (Muon), when they are not `optim`'s
    /// ([`Self::with_matrix_step`]).
    matrix: Option<MatrixStep>,
}

/// This rank's gradient shard of a step, reduced over the data-parallel ranks and unscaled.
struct ReducedShard {
    /// f32, on the parameters' device.
    shard: Tensor<1>,
    /// Bytes of the gradient buffer the step releases.
    grad_bytes: usize,
    loss_scale: f64,
    /// Non-finite somewhere under loss scaling: the step is skipped.
    overflow: bool,
}

/// Renames a module's parameter paths to the whole model's names in checkpoints.
type LogicalNames = std::sync::Arc<dyn Fn(&str) -> String + Send + Sync>;

impl<O: ElementWise> ZeroOptimizer<O> {
    /// Wraps `optim` for the trainable parameters of `module`, whose parameters must already be
    /// identical on every rank (build them from the same seed, or broadcast rank 0's with
    /// `DistributedDataParallel::broadcast_module`), in fp32: with mixed precision they become
    /// the fp32 master weights. Frozen parameters are left out of the flat space (see the
    /// [module documentation](self)). Collective: checks the replicas.
    ///
    /// # Errors
    /// [`ZeroError::Replica`] when the replicas differ (on every rank);
    /// [`ZeroError::Config`] for stage 3 (use [`crate::Fsdp`]), an invalid config or a module
    /// without trainable parameters; [`ZeroError::UnsupportedDType`] when the module's device
    /// lacks a dtype of the precision policy.
    pub fn new<M: Module>(
        module: &M,
        groups: ShardGroups,
        config: ZeroConfig,
        optim: O,
    ) -> Result<Self> {
        Self::new_excluding(module, groups, config, optim, |_| false)
    }

    /// [`Self::new`] for the trainable parameters of `module` except those `exclude` selects,
    /// which stay out of the flat space, like frozen ones: no gradient reduction, no optimizer
    /// state, no update here, and no replica check (they may differ between the ranks). For
    /// parameters a caller trains its own way, such as the experts of an expert-parallel MoE
    /// layer (reduced over the ranks holding the same experts); put their share of the global
    /// gradient norm in [`Self::step_with_outside`].
    ///
    /// # Arguments
    /// * `module` - the model, identical on every rank for the parameters in the flat space.
    /// * `groups` - the shard (and replica) groups.
    /// * `config` - the stage and options.
    /// * `optim` - the element-wise optimizer of the flat space.
    /// * `exclude` - which parameters (by id) to leave out.
    ///
    /// # Returns
    /// The optimizer wrapper.
    ///
    /// # Errors
    /// As [`Self::new`].
    ///
    /// # Example
    /// ```
    /// use burn::module::Module;
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::Device;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::run_local;
    /// use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
    ///
    /// let sizes = run_local(2, |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     let fc = init.linear("fc", LinearInit::new(4, 4).with_bias(true)).unwrap();
    ///     let bias = fc.bias.as_ref().unwrap().id;
    ///     let zero = ZeroOptimizer::new_excluding(&fc, ShardGroups::flat(group),
    ///         ZeroConfig::new(Stage::One), AdamWConfig::new().build(), |id| id == bias).unwrap();
    ///     Ok(zero.layout().numel())
    /// })
    /// .unwrap();
    /// assert_eq!(sizes, vec![16, 16]); // the weight only
    /// ```
    pub fn new_excluding<M: Module>(
        module: &M,
        groups: ShardGroups,
        config: ZeroConfig,
        optim: O,
        exclude: impl Fn(ParamId) -> bool,
    ) -> Result<Self> {
        if config.stage == Stage::Three {
            return Err(ZeroError::Config(
                "ZeroOptimizer runs stages 1 and 2; for stage 3 declare the model's units as \
                 burn_zero::Fsdp<Layer>, build them with an FsdpPlan and train with \
                 burn_parallel::train::TrainStep::with_fsdp"
                    .into(),
            ));
        }
        let excluded = paths_where(module, exclude);
        let keep = |path: &str| !excluded.contains(path);
        groups.verify_replicas(module, keep)?;
        let layout = FlatLayout::trainable(module, keep);
        let Some(device) = module.devices().into_iter().next() else {
            return Err(ZeroError::Config("the module has no parameters".into()));
        };
        if layout.numel() == 0 {
            return Err(ZeroError::Config(
                "the module has no trainable parameter (all are frozen or excluded): nothing \
                 to optimize"
                    .into(),
            ));
        }
        config.validate(&device)?;
        let range = shard_range(layout.numel(), groups.shard.rank(), groups.shard.size());
        let master = if config.precision.is_full() {
            None
        } else {
            let full = layout.flatten(module)?;
            Some(tensor_1d(
                full[range.clone()].to_vec(),
                &device.clone().inner(),
            ))
        };
        let tracker = MemoryTracker::default();
        tracker.set(
            Category::Params,
            layout.numel() * config.precision.param_dtype.size()
                + master.as_ref().map_or(0, |_| range.len() * 4),
        );
        Ok(Self {
            optim: ShardedOptimizer::new(optim, 1).with_offload(config.offload_optimizer),
            scaler: config.loss_scaler.clone(),
            groups,
            config,
            layout,
            range,
            tracker,
            acc: None,
            micro: 0,
            device,
            master,
            tp: None,
            logical_names: None,
            reduced: None,
            matrix: None,
        })
    }

    /// Trains a tensor-parallel model (ZeRO over the data-parallel ranks, tensor parallelism
    /// inside; the 2-D layout) built with the context `tp`
    /// ([`Init::context`](burn_parallel::init::Init::context)): the gradients of the
    /// sequence-parallel norms are summed over the tensor-parallel group before they are
    /// reduced, and the global norm of clipping counts every tensor-parallel shard once and the
    /// replicated parameters once.
    pub fn with_tensor_parallel(mut self, tp: &TpContext) -> Self {
        let sharded = tp.sharded_ids();
        let ranges = self
            .layout
            .ids()
            .iter()
            .zip(self.layout.entries())
            .filter(|(id, _)| sharded.contains(id))
            .map(|(_, e)| e.offset..e.offset + e.numel)
            .collect();
        self.tp = Some((tp.clone(), ranges));
        self
    }

    /// The norm the step clips the gradients to ([`ZeroConfig::with_max_grad_norm`]).
    pub fn max_grad_norm(&self) -> Option<f64> {
        self.config.max_grad_norm
    }

    /// Names the parameters in checkpoints by the whole model's names when the wrapped module
    /// is a part of it: `rename` maps a parameter path of the module (after tensor-parallel
    /// logical naming) to its name in the whole model. A pipeline stage holding blocks 4..8 of
    /// a GPT as its local blocks 0..4, say, renames `blocks.0.*` to `blocks.4.*`, so that its
    /// optimizer state loads under any other pipeline split and without one. Used by
    /// [`Self::checkpoint_state`], [`Self::load_checkpoint_state`],
    /// [`Self::checkpoint_params`] and [`Self::load_checkpoint_params`].
    ///
    /// # Example
    /// ```
    /// use burn::nn::LinearConfig;
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::Device;
    /// use burn_parallel::nn::TpContext;
    /// use burn_parallel::run_local;
    /// use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
    ///
    /// run_local(1, |group| {
    ///     let model = LinearConfig::new(4, 3).init(&Device::flex().autodiff());
    ///     let zero = ZeroOptimizer::new(&model, ShardGroups::flat(group.clone()),
    ///         ZeroConfig::new(Stage::One), AdamWConfig::new().build()).unwrap()
    ///         .with_logical_names(|path| format!("blocks.7.mlp.{path}"));
    ///     let pieces = zero.checkpoint_params(&model, &TpContext::single(), (1, 0)).unwrap();
    ///     assert_eq!(pieces[0].name, "blocks.7.mlp.weight");
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn with_logical_names(
        mut self,
        rename: impl Fn(&str) -> String + Send + Sync + 'static,
    ) -> Self {
        self.logical_names = Some(std::sync::Arc::new(rename));
        self
    }

    /// The logical segments of `range` of the flat space, under the checkpoint names.
    fn segments(
        &self,
        tp: &TpContext,
        range: Range<usize>,
    ) -> Result<Vec<burn_parallel::checkpoint::Segment>> {
        let mut segments = crate::dcp::segments(tp, "", &self.layout, range)?;
        if let Some(rename) = &self.logical_names {
            for s in &mut segments {
                s.logical = rename(&s.logical);
            }
        }
        Ok(segments)
    }

    /// Returns `module` with its parameters in the policy's compute dtype, the trainable ones as
    /// fresh leaves, the frozen ones still frozen (fp32: `module` unchanged). Call it once,
    /// before the first forward.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `module` is not the module the wrapper was built from.
    pub fn prepare_module<M: Module>(&self, module: M) -> Result<M> {
        let Some(master) = &self.master else {
            return Ok(module);
        };
        // Every rank holds the same full parameters: cast them locally, no gather needed.
        let full = self.layout.flatten(&module)?;
        if full[self.range.clone()] != host_f32(master.clone())[..] {
            return Err(ZeroError::Config(
                "prepare_module got parameters other than those the wrapper was built from".into(),
            ));
        }
        let dtype = self.config.precision.param_dtype;
        let low = tensor_1d(full, &self.device).cast(dtype);
        Ok(cast_frozen(
            self.layout.unflatten(module, low, true)?,
            dtype,
        ))
    }

    /// The tensor-parallel context of the model ([`Self::with_tensor_parallel`]; a single rank
    /// without).
    pub fn tp_context(&self) -> TpContext {
        self.tp
            .as_ref()
            .map_or_else(TpContext::single, |(tp, _)| tp.clone())
    }

    /// `(ranks holding this same shard, this rank's index among them)`: the replicas of hybrid
    /// sharding, `(1, 0)` otherwise.
    fn copies(&self) -> (usize, usize) {
        self.groups
            .replicate()
            .map_or((1, 0), |r| (r.size(), r.rank()))
    }

    /// The flat layout of the model.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// This rank's range of the flat space.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The groups.
    pub fn groups(&self) -> &ShardGroups {
        &self.groups
    }

    /// `local_loss` averaged over the data-parallel ranks, refused when it is NaN or infinite
    /// and no loss scaler would skip the step (call it before [`Self::step`], so that nothing
    /// is written into the weights; every rank refuses alike, the average being global).
    ///
    /// # Errors
    /// The all-reduce's error; [`CollectiveError::NonFinite`](burn_parallel::CollectiveError)
    /// for a non-finite loss without a loss scaler.
    pub fn mean_loss(&self, local_loss: f32) -> Result<f32> {
        let loss = self.groups.mean(local_loss)?;
        if self.scaler.is_none() {
            let rank = self.groups.shard.global_rank();
            burn_parallel::CollectiveError::ensure_finite(rank, "loss", loss.into())?;
        }
        Ok(loss)
    }

    /// The sharded optimizer (for checkpoints).
    pub fn optimizer(&self) -> &ShardedOptimizer<O> {
        &self.optim
    }

    /// The sharded optimizer, mutable (for checkpoints).
    pub fn optimizer_mut(&mut self) -> &mut ShardedOptimizer<O> {
        &mut self.optim
    }

    /// The fp32 master shard under mixed precision (`None` in fp32, where the module's
    /// parameters are the master weights).
    pub fn master(&self) -> Option<&Tensor<1>> {
        self.master.as_ref()
    }

    /// The scale to multiply the loss by before `backward` (1 without a loss scaler).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// `loss` as backward should see it: multiplied by the loss scale (unchanged without a
    /// scaler), as `TrainStep::scaled_loss` gives it.
    pub fn scaled_loss(&self, loss: Tensor<1>) -> Tensor<1> {
        let scale = self.loss_scale();
        if scale == 1.0 { loss } else { loss * scale }
    }

    /// Restores the loss scaler from a checkpoint's state ([`LossScaler::state`]). Returns
    /// `false`, restoring nothing, without a scaler: a run that does not scale ignores a saved
    /// scale (as `TrainStep::restore_loss_scaler`).
    ///
    /// # Errors
    /// A state the scaler refuses ([`LossScaler::restore`]).
    pub fn restore_loss_scaler(&mut self, saved: &LossScalerState) -> Result<bool> {
        let Some(scaler) = &mut self.scaler else {
            return Ok(false);
        };
        scaler.restore(saved)?;
        Ok(true)
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

    /// This rank's optimizer state as pieces of a distributed checkpoint
    /// ([`burn_parallel::checkpoint`]), named `optim/<state>/<logical parameter>` as Burn's
    /// own optimizers' are by [`ParamMap::optimizer_pieces`](burn_parallel::checkpoint::ParamMap),
    /// so that any layout (DDP, another ZeRO stage, FSDP, another tensor-parallel size) loads
    /// it; and its scalars (step counters) by logical parameter, for the rank state. The state
    /// is fp32 under every precision policy. Under mixed precision, save the parameters with
    /// [`Self::checkpoint_params`] (the fp32 master weights), not from the module, which holds
    /// only their low-precision copy.
    ///
    /// # Arguments
    /// * `tp` - the tensor-parallel context the model was built with.
    /// * `copies` - `(ranks holding this same shard, this rank's index among them)`: under
    ///   hybrid sharding the replicas share the writing; `(1, 0)` otherwise.
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] when a parameter cannot be described.
    pub fn checkpoint_state(
        &self,
        tp: &TpContext,
        copies: (usize, usize),
    ) -> Result<(
        Vec<burn_parallel::checkpoint::Piece>,
        burn_parallel::checkpoint::ScalarsByLogical,
    )> {
        let segments = self.elementwise(self.segments(tp, self.range.clone())?);
        let (mut pieces, scalars) = crate::dcp::state_pieces(&self.optim, 0, &segments, copies)?;
        if let Some(matrix) = &self.matrix {
            pieces.extend(matrix.state_pieces()?);
        }
        Ok((pieces, scalars))
    }

    /// Restores this rank's optimizer state from a distributed checkpoint saved under any
    /// layout (see [`Self::checkpoint_state`]); `scalars` are the saving ranks' scalars by
    /// logical parameter ([`burn_parallel::checkpoint::merged_scalars`]). A checkpoint without
    /// optimizer state for these parameters leaves the state empty (as before a first step).
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] on a read error; [`ZeroError::Config`] when the state of the
    /// shard's parameters is only partly there or does not fit this optimizer.
    pub fn load_checkpoint_state(
        &mut self,
        checkpoint: &burn_parallel::checkpoint::Checkpoint,
        tp: &TpContext,
        scalars: &burn_parallel::checkpoint::ScalarsByLogical,
    ) -> Result<()> {
        let segments = self.elementwise(self.segments(tp, self.range.clone())?);
        crate::dcp::load_state(
            &mut self.optim,
            (0, self.range.len()),
            checkpoint,
            &segments,
            scalars,
            &self.device.clone().inner(),
        )?;
        if let Some(matrix) = &self.matrix {
            let all = self.segments(tp, 0..self.layout.numel())?;
            let shapes = burn_parallel::muon::matrices_of(&all);
            matrix.load_state(checkpoint, &shapes, &self.device.clone().inner())?;
        }
        Ok(())
    }

    /// This rank's share of a checkpoint of the flat space, under the tensor-parallel context
    /// and the replicas the optimizer was built with: [`Self::checkpoint_params`] and
    /// [`Self::checkpoint_state`] together, and the state's scalars (what its
    /// [`StepEngine::save`] writes).
    ///
    /// # Errors
    /// As [`Self::checkpoint_params`] and [`Self::checkpoint_state`].
    pub fn checkpoint_pieces<M: Module>(
        &self,
        module: &M,
    ) -> Result<(
        Vec<burn_parallel::checkpoint::Piece>,
        burn_parallel::checkpoint::ScalarsByLogical,
    )> {
        let (tp, copies) = (self.tp_context(), self.copies());
        let mut pieces = self.checkpoint_params(module, &tp, copies)?;
        let (state, scalars) = self.checkpoint_state(&tp, copies)?;
        pieces.extend(state);
        Ok((pieces, scalars))
    }

    /// This rank's shard of the parameters, in fp32, as pieces of a distributed checkpoint
    /// named by logical parameter (see [`crate::dcp`]): the master shard under mixed
    /// precision, the module's own values in fp32. The shard ranks together write every
    /// element once (`copies` shares the writing among replicas, as in
    /// [`Self::checkpoint_state`]).
    ///
    /// # Arguments
    /// * `module` - the wrapped module.
    /// * `tp` - the tensor-parallel context the model was built with.
    /// * `copies` - `(ranks holding this same shard, this rank's index among them)`.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `module` is not the wrapped module; [`ZeroError::Checkpoint`]
    /// when a parameter cannot be described.
    ///
    /// # Example
    /// ```
    /// use burn::nn::LinearConfig;
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::Device;
    /// use burn_parallel::checkpoint::Checkpointer;
    /// use burn_parallel::nn::TpContext;
    /// use burn_parallel::{DistributedDataParallel, run_local};
    /// use burn_zero::{MixedPrecision, ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
    ///
    /// let root = std::env::temp_dir().join(format!("zero-params-doc-{}", std::process::id()));
    /// run_local(2, |group| {
    ///     let device = Device::flex().autodiff();
    ///     let model = LinearConfig::new(4, 3).init(&device);
    ///     let model = DistributedDataParallel::new(group.clone()).broadcast_module(model, 0)?;
    ///     let config = ZeroConfig::new(Stage::One).with_precision(MixedPrecision::bf16());
    ///     let zero = ZeroOptimizer::new(&model, ShardGroups::flat(group.clone()), config,
    ///         AdamWConfig::new().build()).unwrap();
    ///     let model = zero.prepare_module(model).unwrap(); // bf16 from here on
    ///     let tp = TpContext::single();
    ///     let pieces = zero.checkpoint_params(&model, &tp, (1, 0)).unwrap();
    ///     Checkpointer::new(&root, 1, &group).unwrap()
    ///         .save(0, pieces, serde_json::Value::Null, serde_json::Value::Null).unwrap();
    ///     Ok(())
    /// })
    /// .unwrap();
    /// let ckpt = Checkpointer::latest(&root).unwrap().unwrap();
    /// // The fp32 master weights, whole, under the logical names.
    /// assert_eq!(ckpt.manifest().tensors["weight"].dtype, "F32");
    /// assert_eq!(ckpt.shape("weight"), Some(&[4usize, 3][..]));
    /// # std::fs::remove_dir_all(&root).unwrap();
    /// ```
    pub fn checkpoint_params<M: Module>(
        &self,
        module: &M,
        tp: &TpContext,
        copies: (usize, usize),
    ) -> Result<Vec<burn_parallel::checkpoint::Piece>> {
        let segments = self.segments(tp, self.range.clone())?;
        crate::dcp::param_pieces(self.param_shard(module)?, &segments, copies)
    }

    /// `module` with its parameters read from a distributed checkpoint saved under any layout
    /// (the logical parameters, in whatever dtype they were saved: converted to fp32, they
    /// become the master shard, and the module gets them in the compute dtype). Every rank
    /// reads the whole model, which ZeRO-1/2 replicates. Frozen parameters are not read.
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] when a parameter is missing or cannot be read;
    /// [`ZeroError::Config`] for a foreign module.
    pub fn load_checkpoint_params<M: Module>(
        &mut self,
        module: M,
        checkpoint: &burn_parallel::checkpoint::Checkpoint,
        tp: &TpContext,
    ) -> Result<M> {
        let numel = self.layout.numel();
        let segments = self.segments(tp, 0..numel)?;
        let full = crate::dcp::read_params(checkpoint, &segments, numel)?;
        self.set_params(module, full)
    }

    /// The fp32 values of this rank's shard of the parameters (for checkpoints): the master
    /// shard, or the module's parameters in fp32.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `module` is not the wrapped module.
    pub fn param_shard<M: Module>(&self, module: &M) -> Result<Vec<f32>> {
        match &self.master {
            Some(master) => Ok(host_f32(master.clone())),
            None => self.layout.flatten_range(module, self.range.clone()),
        }
    }

    /// Replaces every parameter by `full` (the whole flat space in fp32, e.g. from a
    /// checkpoint): the master shard takes this rank's range, the module the values in the
    /// compute dtype, as fresh leaves.
    ///
    /// # Errors
    /// [`ZeroError::Config`] on a length mismatch or a foreign module.
    pub fn set_params<M: Module>(&mut self, module: M, full: Vec<f32>) -> Result<M> {
        if full.len() != self.layout.numel() {
            return Err(ZeroError::Config(format!(
                "{} values for a flat space of {}",
                full.len(),
                self.layout.numel()
            )));
        }
        if let Some(master) = &mut self.master {
            *master = tensor_1d(full[self.range.clone()].to_vec(), &master.device());
        }
        let flat = tensor_1d(full, &self.device).cast(self.config.precision.param_dtype);
        self.layout.unflatten(module, flat, true)
    }

    /// The whole flat space of the parameters in fp32 (the master weights under mixed
    /// precision), gathered over the shard group: every shard rank calls it and gets the same
    /// values, in [`Self::layout`]'s order.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `module` is not the wrapped module; collective failures.
    pub fn gather_params<M: Module>(&self, module: &M) -> Result<Vec<f32>> {
        let shard = self.param_shard(module)?;
        let len = shard.len();
        let full = self
            .groups
            .shard()
            .all_gather_data(TensorData::new(shard, [len]), 0)?
            .try_into_vec::<f32>()
            .map_err(|e| ZeroError::Config(format!("gathered parameters: {e:?}")))?;
        if full.len() != self.layout.numel() {
            return Err(ZeroError::Config(format!(
                "gathered {} parameter values for a flat space of {}",
                full.len(),
                self.layout.numel()
            )));
        }
        Ok(full)
    }

    /// `module` with its trainable parameters set to the fp32 master weights, whole (gathered
    /// over the shard group: every shard rank calls it): the model to evaluate or export after
    /// mixed-precision training. Frozen parameters go back to fp32 (with the values
    /// [`Self::prepare_module`] rounded). In fp32, `module` unchanged, with no communication.
    /// The result no longer computes in the policy's dtype: do not step it again.
    ///
    /// # Errors
    /// As [`Self::gather_params`].
    ///
    /// # Example
    /// ```
    /// use burn::nn::LinearConfig;
    /// use burn::optim::AdamWConfig;
    /// use burn::tensor::{DType, Device};
    /// use burn_parallel::{DistributedDataParallel, run_local};
    /// use burn_zero::{MixedPrecision, ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
    ///
    /// run_local(2, |group| {
    ///     let device = Device::flex().autodiff();
    ///     let model = LinearConfig::new(4, 3).init(&device);
    ///     let model = DistributedDataParallel::new(group.clone()).broadcast_module(model, 0)?;
    ///     let config = ZeroConfig::new(Stage::Two).with_precision(MixedPrecision::bf16());
    ///     let zero = ZeroOptimizer::new(&model, ShardGroups::flat(group), config,
    ///         AdamWConfig::new().build()).unwrap();
    ///     let model = zero.prepare_module(model).unwrap();
    ///     assert_eq!(model.weight.val().dtype(), DType::BF16);
    ///     let model = zero.master_module(model).unwrap();
    ///     assert_eq!(model.weight.val().dtype(), DType::F32);
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn master_module<M: Module>(&self, module: M) -> Result<M> {
        if self.master.is_none() {
            return Ok(module);
        }
        let full = tensor_1d(self.gather_params(&module)?, &self.device);
        Ok(cast_frozen(
            self.layout.unflatten(module, full, true)?,
            DType::F32,
        ))
    }

    /// Adds one micro-step's gradients, summed in fp32: locally into the full flat gradient at
    /// stage 1 (no communication); at stage 2, reduce-scattered bucket by bucket into this
    /// rank's gradient shard (see the [module documentation](self)). Gradients of frozen
    /// parameters are ignored.
    ///
    /// # Errors
    /// [`ZeroError::Config`] under mixed precision when the module still computes in another
    /// dtype than the policy's (call [`ZeroOptimizer::prepare_module`]); collective failures at
    /// stage 2.
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: GradientsParams) -> Result<()> {
        if self.reduced.is_some() {
            return Err(ZeroError::Config(
                "accumulate called after gradient_squares reduced the step's gradients: step \
                 first (gradient_squares ends the accumulation)"
                    .into(),
            ));
        }
        let want = self.config.precision.param_dtype;
        if self.master.is_some()
            && let Some(found) = first_param_dtype(module)
            && found != want
        {
            return Err(ZeroError::Config(format!(
                "the module computes in {found:?} but the precision policy says {want:?}: pass \
                 it through ZeroOptimizer::prepare_module before the first forward"
            )));
        }
        let grads = match &self.tp {
            Some((tp, _)) => tp.sync_gradients(grads)?,
            None => grads,
        };
        let inner = self.device.clone().inner();
        // This micro-step's part: the whole flat gradient at stage 1, this rank's shard of its
        // reduction at stage 2.
        let part = if self.config.stage == Stage::One {
            flatten_grads(&self.layout, module, grads, &inner)
        } else {
            reduce_scatter_buckets(
                &self.layout,
                module,
                grads,
                &BucketPlan {
                    group: &self.groups.shard,
                    range: self.range.clone(),
                    bucket_bytes: self.config.bucket_bytes,
                    wire: self.config.precision.reduce_dtype,
                    tracker: &self.tracker,
                },
                &inner,
            )?
        };
        let bytes = part.dims()[0] * 4;
        self.acc = Some(match self.acc.take() {
            None => {
                self.tracker.add(Category::Grads, bytes);
                part
            }
            Some(acc) => {
                // The micro-step's part is a buffer next to the sum until it is added.
                self.tracker.add(Category::Buffers, bytes);
                let sum = acc + part;
                self.tracker.sub(Category::Buffers, bytes);
                sum
            }
        });
        self.micro += 1;
        Ok(())
    }

    /// Reduces the accumulated gradients (in the policy's reduction dtype) at stage 1,
    /// unscales them, skips the step on an overflow (loss scaling), clips, updates this rank's
    /// shard and all-gathers the new parameters (in the compute dtype) into `module`.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when nothing was accumulated; collective failures.
    pub fn step<M: Module>(&mut self, lr: LearningRate, module: M) -> Result<(M, StepInfo)> {
        self.step_with_outside(lr, module, 0.0)
    }

    /// [`Self::step`] when some trainable parameters are outside the flat space
    /// ([`Self::new_excluding`]) and clipping must see them: `outside_sq` is the sum of the
    /// squares of their (reduced) gradients, the same value on every rank, added to the
    /// flat space's in the global norm. Scale those gradients yourself by the same factor,
    /// `clip::clip_coefficient(info.grad_norm, max_norm)`.
    ///
    /// # Arguments
    /// * `lr` - the learning rate.
    /// * `module` - the model.
    /// * `outside_sq` - the squared norm of the gradients outside the flat space.
    ///
    /// # Returns
    /// The updated model and what the step did (the norm counts `outside_sq`).
    ///
    /// # Errors
    /// As [`Self::step`].
    pub fn step_with_outside<M: Module>(
        &mut self,
        lr: LearningRate,
        module: M,
        outside_sq: f64,
    ) -> Result<(M, StepInfo)> {
        let ReducedShard {
            shard,
            grad_bytes,
            loss_scale,
            overflow,
        } = match self.reduced.take() {
            Some(reduced) => reduced,
            None => self.reduce_shard()?,
        };
        let numel = self.layout.numel();
        let mut grad = shard;
        if overflow {
            self.tracker.sub(Category::Grads, grad_bytes);
            self.tracker.finish_step();
            let info = StepInfo {
                grad_norm: None,
                skipped: true,
                loss_scale,
            };
            return Ok((module, info));
        }
        // Clipped by the global norm: this flat space's (over the shard group, and the
        // tensor-parallel group for its shards) and what lies outside it.
        // The global norm every applied step: checked before anything is written (a NaN or
        // infinite gradient refuses the step on every rank alike, the norm being global), then
        // clipped by when asked.
        let norm = (self.squares_of(&grad, |_| true)? + outside_sq).sqrt();
        burn_parallel::CollectiveError::ensure_finite(
            self.groups.shard.global_rank(),
            "gradient norm",
            norm,
        )?;
        if let Some(max_norm) = self.config.max_grad_norm {
            let coef = clip_coefficient(norm, max_norm);
            if coef < 1.0 {
                grad = grad * coef as f32;
            }
        }
        let grad_norm = Some(norm);
        self.apply_shard(lr, module, grad, (numel, grad_bytes))
            .map(|module| {
                let info = StepInfo {
                    grad_norm,
                    skipped: false,
                    loss_scale,
                };
                (module, info)
            })
    }

    /// The squared norm of the coming step's reduced gradients of the parameters `select`
    /// picks, over the whole flat space (every shard rank's part; a tensor-parallel shard once
    /// per shard, a replicated parameter once): for a caller that clips by a norm over more
    /// than this flat space, such as the stages of a pipeline (sum the stages' squares, then
    /// pass each stage the rest as [`Self::step_with_outside`]'s `outside_sq`). The first call
    /// after the accumulation reduces the gradients (the collective of the step, which then
    /// reuses them); every shard rank calls it alike.
    ///
    /// # Errors
    /// [`ZeroError::Config`] without accumulated gradients; collective errors.
    ///
    /// # Example
    /// ```
    /// use burn::nn::{Initializer, LinearConfig};
    /// use burn::optim::{AdamWConfig, GradientsParams};
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::run_local;
    /// use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
    ///
    /// run_local(2, |group| {
    ///     let device = Device::flex().autodiff();
    ///     // The same weights on every rank.
    ///     let model = LinearConfig::new(4, 3)
    ///         .with_initializer(Initializer::Constant { value: 0.1 })
    ///         .init(&device);
    ///     let config = ZeroConfig::new(Stage::Two).with_max_grad_norm(Some(0.1));
    ///     let mut zero = ZeroOptimizer::new(&model, ShardGroups::flat(group.clone()), config,
    ///         AdamWConfig::new().build()).unwrap();
    ///     let loss = model.forward(Tensor::<2>::ones([2, 4], &device)).sum();
    ///     zero.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model)).unwrap();
    ///     let weight = model.weight.id;
    ///     let all = zero.gradient_squares(|_| true).unwrap();
    ///     let of_weight = zero.gradient_squares(|id| id == weight).unwrap();
    ///     assert!(of_weight > 0.0 && of_weight < all);
    ///     // Another part of the model holds gradients of squared norm 3.0: one norm for both.
    ///     let (_model, info) = zero.step_with_outside(1e-3, model, 3.0).unwrap();
    ///     assert!((info.grad_norm.unwrap() - (all + 3.0).sqrt()).abs() < 1e-6);
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn gradient_squares(&mut self, select: impl Fn(ParamId) -> bool) -> Result<f64> {
        if self.reduced.is_none() {
            self.reduced = Some(self.reduce_shard()?);
        }
        let reduced = self.reduced.as_ref().expect("reduced just now");
        if reduced.overflow {
            return Ok(f64::NAN);
        }
        self.squares_of(&reduced.shard, select)
    }

    /// The squared norm of the parameters `select` picks in the gradient shard `grad` (at
    /// `self.range` of the flat space), over every shard rank and, for tensor-parallel shards,
    /// every tensor-parallel rank (a replicated parameter counts once).
    fn squares_of(&self, grad: &Tensor<1>, select: impl Fn(ParamId) -> bool) -> Result<f64> {
        let tp_ranges = self
            .tp
            .as_ref()
            .map_or(&[][..], |(_, ranges)| ranges.as_slice());
        // The selected runs of this rank's range, by kind ([replicated, tensor-parallel shard]),
        // adjacent runs of one kind merged: one slice each, squared and summed on the device.
        let mut runs: [Vec<Range<usize>>; 2] = Default::default();
        for (id, e) in self.layout.ids().iter().zip(self.layout.entries()) {
            let (a, b) = (
                e.offset.max(self.range.start),
                (e.offset + e.numel).min(self.range.end),
            );
            if a >= b || !select(*id) {
                continue;
            }
            let kind = &mut runs[usize::from(tp_ranges.iter().any(|r| r.start == e.offset))];
            let (a, b) = (a - self.range.start, b - self.range.start);
            match kind.last_mut() {
                Some(last) if last.end == a => last.end = b,
                _ => kind.push(a..b),
            }
        }
        let device = grad.device();
        let per_kind = runs.map(|runs| {
            let squares = runs
                .into_iter()
                .map(|r| grad.clone().slice(r).powi_scalar(2).sum())
                .collect();
            concat_1d(squares, &device).sum()
        });
        let local: Vec<f64> = read_scalars(Tensor::cat(per_kind.to_vec(), 0))?
            .into_iter()
            .map(f64::from)
            .collect();
        let sums = self
            .groups
            .shard
            .all_reduce_data(TensorData::new(local, [2]), ReduceOp::Sum)?
            .try_to_vec::<f64>()
            .expect("f64 in, f64 out");
        let tp_sum = match self.tp.as_ref().and_then(|(tp, _)| tp.group().cloned()) {
            Some(tp) if tp.size() > 1 => tp
                .all_reduce_data(TensorData::new(vec![sums[1]], [1]), ReduceOp::Sum)?
                .try_to_vec::<f64>()
                .expect("f64 in, f64 out")[0],
            _ => sums[1],
        };
        Ok(sums[0] + tp_sum)
    }

    /// This rank's reduced and unscaled gradient shard of the step (the accumulated
    /// gradients are taken).
    fn reduce_shard(&mut self) -> Result<ReducedShard> {
        let Some(acc) = self.acc.take() else {
            return Err(ZeroError::Config(
                "step called without gradients; call accumulate after each backward".into(),
            ));
        };
        let micro = std::mem::take(&mut self.micro);
        let grad_bytes = acc.dims()[0] * 4;
        let shard = match self.config.stage {
            Stage::One => {
                // This rank's shard of the sum, on the device where the group's backend
                // reduces there (NCCL), through the host elsewhere; only device work consumes
                // it, so the host does not wait for it (on NCCL, the stream does).
                let wire = self.config.precision.reduce_dtype;
                let acc = if wire == DType::F32 {
                    acc
                } else {
                    acc.cast(wire)
                };
                let group = &self.groups.shard;
                let sizes = shard_sizes(self.layout.numel(), group.size());
                let reduced = group
                    .reduce_scatter_async(acc, 0, ReduceOp::Sum, Some(&sizes))
                    .wait_on_device()?;
                as_f32(reduced)
            }
            // Stage 2: already reduce-scattered, bucket by bucket, at each accumulate.
            _ => acc,
        };
        let loss_scale = self.loss_scale();
        let shard = self.groups.finish_shard_grad(shard, micro, loss_scale)?;
        let overflow = check_overflow(&self.groups, self.scaler.as_mut(), &shard)?;
        Ok(ReducedShard {
            shard,
            grad_bytes,
            loss_scale,
            overflow,
        })
    }

    /// Steps this rank's shard with gradient `grad` and all-gathers the new parameters into
    /// `module`; `(numel, grad_bytes)`: the flat space's size and the gradient bytes released.
    fn apply_shard<M: Module>(
        &mut self,
        lr: LearningRate,
        module: M,
        grad: Tensor<1>,
        (numel, grad_bytes): (usize, usize),
    ) -> Result<M> {
        let inner = self.device.clone().inner();
        let param_shard = match &self.master {
            Some(master) => master.clone(),
            // This rank's range of the parameters, cut from the module on its device (no full
            // flat copy).
            None => self
                .layout
                .flatten_range_on(&module, self.range.clone(), &inner)?,
        };
        let new_shard = match self.matrix.clone() {
            None => self.optim.step(0, lr, param_shard, grad),
            Some(matrix) => self.step_with_matrices(&matrix, lr, param_shard, grad)?,
        };
        let matrices = self.matrix.as_ref().map_or(0, MatrixStep::state_bytes);
        self.tracker
            .set(Category::Optimizer, self.optim.state_bytes() + matrices);

        let low = self.config.precision.param_dtype;
        let gathered_bytes = numel * low.size();
        self.tracker.add(Category::Buffers, gathered_bytes);
        let outgoing = if self.master.is_some() {
            let low_shard = new_shard.clone().cast(low);
            self.master = Some(new_shard);
            low_shard
        } else {
            new_shard
        };
        // Gathered where the shards are (the device on NCCL), as tensors the module's device
        // tracks; the next forward's kernels wait for it on the device, not the host.
        let full = self
            .groups
            .shard
            .all_gather_async(outgoing, 0)
            .wait_on_device()?;
        let full = tracked_as(full, &self.device);
        let module = self.layout.unflatten(module, full, true)?;
        self.tracker.sub(Category::Buffers, gathered_bytes);
        // Gradients are released after the step.
        self.tracker.sub(Category::Grads, grad_bytes);
        self.tracker.finish_step();
        Ok(module)
    }

    /// The step of the shard when a matrix optimizer steps the hidden matrices: their pieces
    /// in this shard get its update ([`MatrixStep::updates`] over the shard group and `tp`),
    /// the rest the elementwise optimizer's (which sees a zero gradient at the matrices'
    /// elements, then overwritten: it keeps state there, the price of one flat state per
    /// shard).
    fn step_with_matrices(
        &mut self,
        matrix: &MatrixStep,
        lr: LearningRate,
        param_shard: Tensor<1>,
        grad: Tensor<1>,
    ) -> Result<Tensor<1>> {
        let segments = self.segments(&self.tp_context(), self.range.clone())?;
        let device = param_shard.device();
        let held = Held {
            segments,
            grad: host_f32(grad.clone()),
        };
        let update = matrix
            .updates(std::slice::from_ref(&held), &device)?
            .pop()
            .expect("one buffer in, one out");
        let n = update.mask.len();
        let mask = Tensor::<1, Bool>::from_data(TensorData::new(update.mask, [n]), &device);
        let grad = grad.mask_fill(mask.clone(), 0.0);
        let stepped = self.optim.step(0, lr, param_shard.clone(), grad);
        let direction = Tensor::<1>::from_data(TensorData::new(update.update, [n]), &device);
        let decay = 1.0 - lr * matrix.weight_decay();
        let matrices = param_shard.mul_scalar(decay) - direction.mul_scalar(lr);
        Ok(stepped.mask_where(mask, matrices))
    }

    /// The segments of `segments` the elementwise optimizer steps: all, or those the matrix
    /// optimizer leaves (its own state is saved apart; the elementwise state at the matrices'
    /// elements is never read).
    fn elementwise(
        &self,
        segments: Vec<burn_parallel::checkpoint::Segment>,
    ) -> Vec<burn_parallel::checkpoint::Segment> {
        match &self.matrix {
            None => segments,
            Some(matrix) => matrix.elementwise_segments(segments),
        }
    }

    /// Steps the hidden matrices with `matrix` (Muon; see [`burn_parallel::muon`]) and the
    /// rest of the flat space with the elementwise optimizer. `matrix`'s holders must be the
    /// shard group together with the tensor-parallel group (the ranks whose shards make the
    /// matrices whole), its replicas the hybrid sharding's replicate group. Its state is
    /// saved with the engine's checkpoints, whole by matrix, and resumes under any layout.
    pub fn with_matrix_step(mut self, matrix: MatrixStep) -> Self {
        self.matrix = Some(matrix);
        self
    }

    /// The memory this wrapper held over the last step (see [`crate::memory`]).
    pub fn memory(&self) -> MemoryReport {
        self.tracker.last_step()
    }

    /// The tracker (to add the figures of other wrappers).
    pub fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }
}

/// The dtype of `module`'s first float parameter.
fn first_param_dtype<M: Module>(module: &M) -> Option<DType> {
    let index = burn_parallel::index::ParamIndex::with_state(module);
    let first = index.entries().first()?;
    first.state.as_ref().map(|s| s.dtype)
}

/// The gradients of `layout`'s parameters as one flat f32 tensor on `device` (zeros where
/// absent), each taken out of `grads`, and so released, as it is copied.
pub(crate) fn flatten_grads<M: Module>(
    layout: &FlatLayout,
    module: &M,
    mut grads: GradientsParams,
    device: &Device,
) -> Tensor<1> {
    let mut parts: Vec<Option<Tensor<1>>> = vec![None; layout.entries().len()];
    let index = layout.entry_index();
    visit_grads(module, &mut grads, |id, g| {
        if let (Some(&i), Some(g)) = (index.get(&id), g) {
            parts[i] = Some(as_f32(g));
        }
    });
    let parts = parts
        .into_iter()
        .zip(layout.entries())
        .map(|(part, e)| part.unwrap_or_else(|| Tensor::zeros([e.numel], device)))
        .collect();
    concat_1d(parts, device)
}

/// Calls `f` with the id and the flattened gradient (if any) of each float parameter of
/// `module`, in visiting order, taking the gradients out of `grads` (a parameter reached twice
/// has no gradient left the second time).
fn visit_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    f: impl FnMut(ParamId, Option<Tensor<1>>),
) {
    struct Take<'a, F> {
        grads: &'a mut GradientsParams,
        f: F,
    }
    impl<F: FnMut(ParamId, Option<Tensor<1>>)> ModuleVisitor for Take<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = self.grads.remove::<D>(param.id);
            (self.f)(param.id, grad.map(|g| g.flatten(0, D - 1)));
        }
    }
    module.visit(&mut Take { grads, f });
}

/// Where and how a stage-2 micro-step's gradients are reduce-scattered.
struct BucketPlan<'a> {
    group: &'a ProcessGroup,
    /// This rank's range of the flat space.
    range: Range<usize>,
    bucket_bytes: usize,
    /// The dtype on the wire.
    wire: DType,
    tracker: &'a MemoryTracker,
}

/// Consecutive entries of `layout` cut into buckets of at least one parameter and at most
/// `bucket_bytes` of f32 (a larger parameter is a bucket of its own); returns, per bucket, its
/// range of entries.
fn plan_buckets(layout: &FlatLayout, bucket_bytes: usize) -> Vec<Range<usize>> {
    let mut buckets: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, e) in layout.entries().iter().enumerate() {
        let size = e.numel * 4;
        match buckets.last_mut() {
            Some(b) if bytes + size <= bucket_bytes => {
                b.end = i + 1;
                bytes += size;
            }
            _ => {
                buckets.push(i..i + 1);
                bytes = size;
            }
        }
    }
    buckets
}

/// Sizes of the pieces of flat range `bucket` that fall in each rank's shard (the shards
/// partition the flat space contiguously in rank order, so these pieces partition the bucket).
fn bucket_pieces(bucket: &Range<usize>, numel: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|r| {
            let s = shard_range(numel, r, n);
            s.end
                .min(bucket.end)
                .saturating_sub(s.start.max(bucket.start))
        })
        .collect()
}

/// How many stage-2 buckets may be in flight at once: one reduced while the next is built.
const BUCKETS_IN_FLIGHT: usize = 2;

/// Stage 2: gathers `grads` bucket by bucket in flat order (zeros for a parameter without a
/// gradient on this rank) on `device`, starts each bucket's reduce-scatter as soon as it is
/// complete ([`ProcessGroup::reduce_scatter_async`]: on the communicator's stream under NCCL,
/// on the group's communication thread elsewhere) while the next is built, and returns this
/// rank's pieces laid end to end: its shard of the micro-step's summed gradient, in f32. Each
/// parameter's gradient is taken out of `grads`, and so released, as its bucket is built.
fn reduce_scatter_buckets<M: Module>(
    layout: &FlatLayout,
    module: &M,
    mut grads: GradientsParams,
    plan: &BucketPlan<'_>,
    device: &Device,
) -> Result<Tensor<1>> {
    let buckets = plan_buckets(layout, plan.bucket_bytes);
    let bucket_of: Vec<usize> = buckets
        .iter()
        .enumerate()
        .flat_map(|(b, r)| r.clone().map(move |_| b))
        .collect();
    let index = layout.entry_index();
    let mut found = 0;
    let mut sender = BucketSender {
        layout,
        buckets: &buckets,
        plan,
        device,
        parts: Vec::new(),
        next: 0,
        flight: std::collections::VecDeque::new(),
        pieces: Vec::new(),
        error: None,
    };
    visit_grads(module, &mut grads, |id, g| {
        let Some(&i) = index.get(&id) else {
            return;
        };
        found += 1;
        let b = bucket_of[i];
        if b < sender.next {
            return; // already sent (a parameter reached twice)
        }
        sender.flush_until(b);
        if let Some(g) = g {
            sender.parts.push((i, g));
        }
        if i + 1 == buckets[b].end {
            sender.flush_until(b + 1);
        }
    });
    // Every rank sends every bucket, whatever this module held, so that the collectives stay
    // in step; a foreign module is reported after.
    sender.flush_until(buckets.len());
    let shard = sender.finish()?;
    if found != layout.entries().len() {
        return Err(ZeroError::Config(format!(
            "the module has {found} of the {} trainable parameters of the wrapper's layout; \
             pass the module the wrapper was built from (parameter ids must not change)",
            layout.entries().len()
        )));
    }
    Ok(shard)
}

/// Builds stage 2's buckets from gradients given in flat order and keeps their
/// reduce-scatters in flight.
struct BucketSender<'a> {
    layout: &'a FlatLayout,
    buckets: &'a [Range<usize>],
    plan: &'a BucketPlan<'a>,
    device: &'a Device,
    /// The gradients of the bucket being built: (entry, flat gradient).
    parts: Vec<(usize, Tensor<1>)>,
    /// The first bucket not sent yet.
    next: usize,
    /// Reduce-scatters in flight, oldest first, with the bytes of their bucket.
    flight: std::collections::VecDeque<(burn_parallel::Work<Tensor<1>>, usize)>,
    /// This rank's pieces of the buckets reduced so far, in order.
    pieces: Vec<Tensor<1>>,
    /// The first failure; later buckets are not sent.
    error: Option<ZeroError>,
}

impl BucketSender<'_> {
    /// Sends every bucket before `end`: the one being built with its gradients, the others
    /// (and the gaps of the one being built) as zeros.
    fn flush_until(&mut self, end: usize) {
        while self.next < end {
            let b = self.next;
            let entries = &self.layout.entries()[self.buckets[b].clone()];
            let mut given: std::collections::HashMap<usize, Tensor<1>> =
                std::mem::take(&mut self.parts).into_iter().collect();
            let wire = self.plan.wire;
            let parts = (self.buckets[b].clone())
                .zip(entries)
                .map(|(i, e)| match given.remove(&i) {
                    Some(g) if g.dtype() == wire => g,
                    Some(g) => g.cast(wire),
                    None => Tensor::zeros([e.numel], (self.device, wire)),
                })
                .collect();
            let bucket = concat_1d(parts, self.device);
            self.next += 1;
            if self.error.is_some() {
                continue;
            }
            let first = &entries[0];
            let last = &entries[entries.len() - 1];
            let flat = first.offset..last.offset + last.numel;
            let sizes = bucket_pieces(&flat, self.layout.numel(), self.plan.group.size());
            let bytes = flat.len() * wire.size();
            self.plan.tracker.add(Category::Buffers, bytes);
            let work = self
                .plan
                .group
                .reduce_scatter_async(bucket, 0, ReduceOp::Sum, Some(&sizes));
            self.flight.push_back((work, bytes));
            if self.flight.len() > BUCKETS_IN_FLIGHT {
                self.wait_oldest();
            }
        }
    }

    /// Waits for the oldest reduce-scatter in flight and keeps this rank's piece.
    fn wait_oldest(&mut self) {
        let Some((work, bytes)) = self.flight.pop_front() else {
            return;
        };
        // The piece is only consumed by device work (the concatenation below), so under NCCL
        // the caller's stream waits for it and the host goes on building buckets.
        let piece = work.wait_on_device();
        self.plan.tracker.sub(Category::Buffers, bytes);
        match piece {
            Ok(piece) if piece.dims()[0] > 0 => self.pieces.push(as_f32(piece)),
            Ok(_) => {}
            Err(e) => {
                self.error.get_or_insert(e.into());
            }
        }
    }

    /// Waits for every bucket in flight and returns this rank's shard, or the first failure.
    fn finish(mut self) -> Result<Tensor<1>> {
        while !self.flight.is_empty() {
            self.wait_oldest();
        }
        match self.error {
            Some(e) => Err(e),
            None => {
                let shard = concat_1d(self.pieces, self.device);
                debug_assert_eq!(shard.dims()[0], self.plan.range.len());
                Ok(shard)
            }
        }
    }
}

/// Module paths of the parameters of `module` whose id passes `select`.
pub(crate) fn paths_where<M: Module>(
    module: &M,
    select: impl Fn(ParamId) -> bool,
) -> std::collections::HashSet<String> {
    let index = burn_parallel::index::ParamIndex::of(module);
    let paths = index.paths_where(select).into_iter().map(String::from);
    paths.collect()
}

/// ZeRO-1/2 as the loop's [`StepEngine`]: each micro-batch's loss, times the loss scale, is
/// backpropagated and its gradients [accumulated](ZeroOptimizer::accumulate) (ZeRO averages
/// the micro-batches itself), then [`ZeroOptimizer::step`] reduces, clips and updates. Call
/// [`ZeroOptimizer::prepare_module`] on the model first (it casts the model to the compute
/// dtype of the precision policy). Its checkpoints ([`StepEngine::save`]) hold the flat
/// space's parameters and state under the logical names, which any engine and layout load;
/// parameters outside the flat space (frozen, or left out by [`ZeroOptimizer::new_excluding`])
/// are neither saved nor loaded here: the model's build gives them.
impl<M, O, E> StepEngine<M, E> for ZeroOptimizer<O>
where
    M: Module,
    O: ElementWise,
    E: From<ZeroError>,
{
    fn step_accumulated(
        &mut self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        if micro_batches == 0 {
            return Err(E::from(ZeroError::Config(
                "zero micro-batches: give at least one".into(),
            )));
        }
        let mut phases = StepPhases::default();
        let local = run_micro_batches(
            micro_batches,
            &model,
            MixedPrecision::full(),
            forward,
            &mut phases,
            |_, loss| {
                let grads = burn_parallel::autograd::backward(self.scaled_loss(loss))
                    .map_err(|e| E::from(ZeroError::from(e)))?;
                let grads = GradientsParams::from_grads(grads, &model);
                Ok(self.accumulate(&model, grads)?)
            },
        )?;
        let loss = self.mean_loss(local)?;
        let (model, info) = phases.time(|p| &mut p.optimizer, || self.step(lr, model))?;
        Ok((
            model,
            StepOutput {
                loss,
                grad_norm: info.grad_norm,
                skipped: info.skipped,
                phases,
            },
        ))
    }

    /// The shard's fp32 parameters (the master weights under mixed precision) and AdamW state
    /// as [`Self::checkpoint_params`] and [`Self::checkpoint_state`] give them, the replicas of
    /// hybrid sharding sharing the writing; the loss scaler and `state` as every engine saves
    /// them ([`burn_parallel::train::engine_states`]).
    fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        state: SaveState,
    ) -> checkpoint::Result<()> {
        let (pieces, scalars) = self.checkpoint_pieces(model).map_err(into_checkpoint)?;
        let scaler = self.scaler().map(LossScaler::state);
        let (trainer, rank) = engine_states(state, scaler, &scalars);
        saver.submit(step, pieces, trainer, rank)
    }

    /// The whole model's fp32 parameters into the master shard and `model` (in the compute
    /// dtype), this shard's optimizer state, and the loss scaler, from a checkpoint of any
    /// engine and layout; the checkpoint must hold the model's logical parameters
    /// ([`CheckpointError::Mismatch`] lists what differs).
    fn load(
        &mut self,
        checkpoint: &Checkpoint,
        model: M,
    ) -> checkpoint::Result<(M, serde_json::Value)> {
        let tp = self.tp_context();
        // The flat space's logical parameters, under their checkpoint names
        // ([`ZeroOptimizer::with_logical_names`]) and full shapes.
        let mut expected: Vec<(String, Vec<usize>)> = Vec::new();
        for segment in self
            .segments(&tp, 0..self.layout.numel())
            .map_err(into_checkpoint)?
        {
            if !expected.iter().any(|(name, _)| *name == segment.logical) {
                expected.push((segment.logical, segment.region.shape));
            }
        }
        // Missing and reshaped parameters are refused; what else the checkpoint holds
        // (optimizer state, checked as it is read; parameters outside the flat space) is not
        // this engine's.
        let known: std::collections::HashSet<String> =
            expected.iter().map(|(n, _)| n.clone()).collect();
        for (name, t) in &checkpoint.manifest().tensors {
            if !known.contains(name) {
                expected.push((name.clone(), t.shape.clone()));
            }
        }
        checkpoint.check(expected.iter().map(|(n, s)| (n.as_str(), s.as_slice())))?;
        let model = self
            .load_checkpoint_params(model, checkpoint, &tp)
            .map_err(into_checkpoint)?;
        let (state, scaler, scalars) = saved_engine_states(checkpoint)?;
        self.load_checkpoint_state(checkpoint, &tp, &scalars)
            .map_err(into_checkpoint)?;

        if let Some(saved) = scaler {
            self.restore_loss_scaler(&saved)
                .map_err(|e| CheckpointError::piece("loss_scaler", e.to_string()))?;
        }
        Ok((model, state))
    }

    fn loss_scale(&self) -> f64 {
        ZeroOptimizer::loss_scale(self)
    }

    /// [`ZeroOptimizer::master_module`].
    fn master_model(&self, model: M) -> std::result::Result<M, E> {
        Ok(self.master_module(model)?)
    }
}

/// A ZeRO error met while saving or loading a checkpoint, as the checkpoint error it is: the
/// checkpoint's and collective errors as they are, the others (a foreign module, a state that
/// does not fit) naming the flat space.
fn into_checkpoint(e: ZeroError) -> CheckpointError {
    match e {
        ZeroError::Checkpoint(e) => e,
        ZeroError::Collective(e) => CheckpointError::Collective(e),
        other => CheckpointError::piece("the ZeRO flat space", other.to_string()),
    }
}
