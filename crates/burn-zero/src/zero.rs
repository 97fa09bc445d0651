//! ZeRO stages 1 and 2 over a data-parallel group, and the configuration shared by all stages.
//!
//! Every rank holds the whole model (a plain Burn module). After the backward:
//!
//! - stage 1: the flat gradient is all-reduced (every rank holds all of it), each rank updates
//!   only its shard of the flat parameter space with its shard of the optimizer state, and the
//!   updated shards are all-gathered back into the module;
//! - stage 2: the flat gradient is reduce-scattered instead, so a rank keeps only its gradient
//!   shard; the update and the all-gather are the same.
//!
//! With gradient accumulation, micro-step gradients are summed locally in one flat buffer and
//! communicated once, at [`ZeroOptimizer::step`].
//!
//! Hybrid sharding ([`ShardGroups::hybrid`]): shard inside `dp_shard`, replicate across
//! `dp_replicate`; gradient shards are averaged across replicas with one more all-reduce.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, Optimizer};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::{DeviceMesh, ProcessGroup, ReduceOp};

use crate::clip::{clip_coefficient, global_norm, sum_of_squares};
use crate::error::{Result, ZeroError};
use crate::flat::{FlatLayout, host_f32, shard_range, shard_sizes, tensor_1d};
use crate::memory::{Category, MemoryReport, MemoryTracker};
use crate::optim::ShardedOptimizer;
use crate::precision::MixedPrecision;

/// Which ZeRO stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
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

/// Options of every stage.
#[derive(Debug, Clone)]
pub struct ZeroConfig {
    /// The stage.
    pub stage: Stage,
    /// Clip the global gradient norm to this value (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    /// Keep the optimizer state on the host and update there.
    pub offload_optimizer: bool,
    /// Stage 3: release a unit's gathered parameters as soon as its guard is dropped (after its
    /// forward) rather than at the end of the step.
    pub reshard_after_forward: bool,
    /// Stage 3: dtypes of compute and reduction.
    pub precision: MixedPrecision,
}

impl ZeroConfig {
    /// Defaults for `stage`: no clipping, no offload, reshard after forward, fp32.
    pub fn new(stage: Stage) -> Self {
        Self {
            stage,
            max_grad_norm: None,
            offload_optimizer: false,
            reshard_after_forward: true,
            precision: MixedPrecision::full(),
        }
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
    /// data-parallel ranks and `micro_steps`, averaging across replicas.
    pub(crate) fn finish_shard_grad(
        &self,
        mut shard: Vec<f32>,
        micro_steps: usize,
    ) -> Result<Vec<f32>> {
        let scale = 1.0 / (micro_steps * self.shard.size()) as f32;
        shard.iter_mut().for_each(|g| *g *= scale);
        if let Some(r) = &self.replicate
            && r.size() > 1
        {
            let len = shard.len();
            let data = r.all_reduce_data(TensorData::new(shard, [len]), ReduceOp::Avg)?;
            shard = data.try_into_vec::<f32>().expect("f32 in, f32 out");
        }
        Ok(shard)
    }

    /// Clips `shards` (this rank's disjoint gradient shards) by the global norm; returns the
    /// norm before clipping.
    pub(crate) fn clip(
        &self,
        shards: &mut [Vec<f32>],
        max_norm: Option<f64>,
    ) -> Result<Option<f64>> {
        let Some(max_norm) = max_norm else {
            return Ok(None);
        };
        let local: f64 = shards.iter().map(|s| sum_of_squares(s)).sum();
        let norm = global_norm(local, &self.shard)?;
        let coef = clip_coefficient(norm, max_norm);
        if coef < 1.0 {
            let coef = coef as f32;
            for s in shards.iter_mut() {
                s.iter_mut().for_each(|g| *g *= coef);
            }
        }
        Ok(Some(norm))
    }
}

/// What a step did.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepInfo {
    /// The global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
}

/// ZeRO stage 1 or 2 around any element-wise Burn [`Optimizer`].
///
/// # Example
/// ```
/// use burn::module::Module;
/// use burn::nn::LinearConfig;
/// use burn::optim::{AdamWConfig, GradientsParams};
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::run_local;
/// use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
///
/// run_local(2, |group| {
///     let device = Device::flex().autodiff();
///     let mut model = LinearConfig::new(4, 3).init(&device);
///     let groups = ShardGroups::flat(group);
///     let mut zero = ZeroOptimizer::new(&model, groups, ZeroConfig::new(Stage::Two),
///         AdamWConfig::new().build()).unwrap();
///     let x = Tensor::<2>::ones([2, 4], &device);
///     let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
///     zero.accumulate(&model, grads).unwrap();
///     model = zero.step(1e-3, model).unwrap().0;
///     Ok(())
/// })
/// .unwrap();
/// ```
pub struct ZeroOptimizer<O: Optimizer> {
    groups: ShardGroups,
    config: ZeroConfig,
    layout: FlatLayout,
    range: Range<usize>,
    optim: ShardedOptimizer<O>,
    tracker: MemoryTracker,
    acc: Option<Vec<f32>>,
    micro: usize,
    device: Device,
}

impl<O: Optimizer> ZeroOptimizer<O> {
    /// Wraps `optim` for `module` (whose parameters must already be identical on every rank:
    /// build them from the same seed).
    ///
    /// # Errors
    /// [`ZeroError::Config`] for stage 3 (use [`crate::fsdp`]), a mixed-precision policy (stage 3
    /// only), or a module without parameters.
    pub fn new<M: Module>(
        module: &M,
        groups: ShardGroups,
        config: ZeroConfig,
        optim: O,
    ) -> Result<Self> {
        if config.stage == Stage::Three {
            return Err(ZeroError::Config(
                "ZeroOptimizer runs stages 1 and 2; for stage 3 wrap the model's units with \
                 burn_zero::fsdp::FsdpUnit and step them with FsdpOptimizer"
                    .into(),
            ));
        }
        if !config.precision.is_full() {
            return Err(ZeroError::Config(
                "mixed precision is implemented for stage 3 (FsdpUnit); use MixedPrecision::full() \
                 with stages 1 and 2"
                    .into(),
            ));
        }
        let layout = FlatLayout::of(module, |_| true);
        let Some(device) = module.devices().into_iter().next() else {
            return Err(ZeroError::Config("the module has no parameters".into()));
        };
        let range = shard_range(layout.numel(), groups.shard.rank(), groups.shard.size());
        let tracker = MemoryTracker::default();
        tracker.set(Category::Params, layout.numel() * 4);
        Ok(Self {
            optim: ShardedOptimizer::new(optim, 1).with_offload(config.offload_optimizer),
            groups,
            config,
            layout,
            range,
            tracker,
            acc: None,
            micro: 0,
            device,
        })
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

    /// The sharded optimizer (for checkpoints).
    pub fn optimizer(&self) -> &ShardedOptimizer<O> {
        &self.optim
    }

    /// The sharded optimizer, mutable (for checkpoints).
    pub fn optimizer_mut(&mut self) -> &mut ShardedOptimizer<O> {
        &mut self.optim
    }

    /// Adds one micro-step's gradients, locally (no communication).
    ///
    /// # Errors
    /// Never at present; kept fallible for bucketed overlap.
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: GradientsParams) -> Result<()> {
        let flat = flatten_grads(&self.layout, module, &grads);
        let bytes = flat.len() * 4;
        match &mut self.acc {
            None => {
                self.acc = Some(flat);
                // Stage 1 keeps the full flat gradient; for stage 2 it is the reduce-scatter's
                // staging input unless it has to live across micro-steps.
                let c = if self.config.stage == Stage::One {
                    Category::Grads
                } else {
                    Category::Buffers
                };
                self.tracker.add(c, bytes);
            }
            Some(acc) => {
                acc.iter_mut().zip(&flat).for_each(|(a, g)| *a += g);
                if self.config.stage == Stage::Two && self.micro == 1 {
                    self.tracker.sub(Category::Buffers, bytes);
                    self.tracker.add(Category::Grads, bytes);
                }
                self.tracker.add(Category::Buffers, bytes);
                self.tracker.sub(Category::Buffers, bytes);
            }
        }
        self.micro += 1;
        Ok(())
    }

    /// Reduces the accumulated gradients, clips, updates this rank's shard and all-gathers the
    /// new parameters into `module`.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when nothing was accumulated; collective failures.
    pub fn step<M: Module>(&mut self, lr: LearningRate, module: M) -> Result<(M, StepInfo)> {
        let Some(acc) = self.acc.take() else {
            return Err(ZeroError::Config(
                "step called without gradients; call accumulate after each backward".into(),
            ));
        };
        let micro = std::mem::take(&mut self.micro);
        let numel = self.layout.numel();
        let n = self.groups.shard.size();
        let shard_bytes = self.range.len() * 4;
        let held = if self.config.stage == Stage::One || micro > 1 {
            Category::Grads
        } else {
            Category::Buffers
        };
        let shard = match self.config.stage {
            Stage::One => {
                let reduced = self
                    .groups
                    .shard
                    .all_reduce_data(TensorData::new(acc, [numel]), ReduceOp::Sum)?;
                let all = reduced.try_into_vec::<f32>().expect("f32");
                all[self.range.clone()].to_vec()
            }
            _ => {
                let sizes = shard_sizes(numel, n);
                let out = self.groups.shard.reduce_scatter_data(
                    TensorData::new(acc, [numel]),
                    0,
                    ReduceOp::Sum,
                    Some(&sizes),
                )?;
                self.tracker.add(Category::Grads, shard_bytes);
                out.try_into_vec::<f32>().expect("f32")
            }
        };
        let mut shards = vec![self.groups.finish_shard_grad(shard, micro)?];
        let grad_norm = self.groups.clip(&mut shards, self.config.max_grad_norm)?;
        let grad = shards.pop().expect("one shard");

        // The parameter shard, read from the module (staging: one flat copy).
        self.tracker.add(Category::Buffers, numel * 4);
        let params = self.layout.flatten(&module)?;
        let inner = self.device.clone().inner();
        let param_shard = tensor_1d(params[self.range.clone()].to_vec(), &inner);
        drop(params);
        self.tracker.sub(Category::Buffers, numel * 4);
        let new_shard = self.optim.step(0, lr, param_shard, tensor_1d(grad, &inner));
        self.tracker
            .set(Category::Optimizer, self.optim.state_bytes());

        self.tracker.add(Category::Buffers, numel * 4);
        let full = self
            .groups
            .shard
            .all_gather_data(new_shard.into_data(), 0)?;
        let full = Tensor::<1>::from_data(full, (&self.device, DType::F32));
        let module = self.layout.unflatten(module, full, true)?;
        self.tracker.sub(Category::Buffers, numel * 4);
        // Gradients are released after the step.
        self.tracker.sub(held, numel * 4);
        if self.config.stage == Stage::Two {
            self.tracker.sub(Category::Grads, shard_bytes);
        }
        self.tracker.finish_step();
        Ok((module, StepInfo { grad_norm }))
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

/// The gradients of `layout`'s parameters as one flat host buffer (zeros where absent).
pub(crate) fn flatten_grads<M: Module>(
    layout: &FlatLayout,
    module: &M,
    grads: &GradientsParams,
) -> Vec<f32> {
    struct Collector<'a> {
        layout: &'a FlatLayout,
        index: std::collections::HashMap<ParamId, usize>,
        grads: &'a GradientsParams,
        out: Vec<f32>,
    }
    impl ModuleVisitor for Collector<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(&i) = self.index.get(&param.id) else {
                return;
            };
            if let Some(g) = self.grads.get::<D>(param.id) {
                let e = &self.layout.entries()[i];
                self.out[e.offset..e.offset + e.numel].copy_from_slice(&host_f32(g));
            }
        }
    }
    let mut c = Collector {
        layout,
        index: layout
            .ids()
            .iter()
            .enumerate()
            .map(|(i, id)| (*id, i))
            .collect(),
        grads,
        out: vec![0.0; layout.numel()],
    };
    module.visit(&mut c);
    c.out
}
