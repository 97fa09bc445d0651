//! Data parallelism with the gradient all-reduce overlapped with backward.
//!
//! [`DistributedDataParallel::all_reduce_grads`](crate::ddp::DistributedDataParallel) starts
//! communicating when `loss.backward()` has returned. [`OverlappedDdp`] starts while it runs,
//! as PyTorch DDP does: every parameter passes through a *gradient hook* (an identity whose
//! backward step sees the parameter's final gradient) before the forward uses it; the hook
//! copies the gradient into a flat bucket, and a bucket whose gradients have all arrived is
//! all-reduced (averaged) by a communication thread while backward goes on. [`OverlapStep::finish`]
//! sends what is left, waits, and returns the averaged gradients.
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{Optimizer, SgdConfig};
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::overlap::OverlappedDdp;
//! use burn_parallel::run_local;
//!
//! run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     let ddp = OverlappedDdp::new(group.clone());
//!     let mut model: Linear = ddp.broadcast_module(LinearConfig::new(4, 1).init(&device), 0)?;
//!     let mut optim = SgdConfig::new().init();
//!     let x = Tensor::<2>::ones([8, 4], &device) * (group.rank() as f32 + 1.0);
//!     let step = ddp.start(&model)?;
//!     let hooked = step.hook(model.clone()); // same parameters (the graph's leaves), hooked
//!     let loss = hooked.forward(x).powf_scalar(2.0).mean();
//!     step.backward(loss)?; // buckets are all-reduced while this runs
//!     let grads = step.finish(&model)?; // averaged over the ranks
//!     model = optim.step(0.1, model, grads);
//!     Ok(())
//! })
//! .unwrap();
//! ```
//!
//! # Where the buckets live
//!
//! - **On the device** when the group's collectives run there (NCCL with CUDA tensors, or a
//!   group made with [`ProcessGroup::with_tensor_path`]) and on any CubeCL device (a GPU over
//!   TCP too): a hook keeps its gradient on the device (nothing waits for the GPU in the
//!   backward), a complete bucket is concatenated there and started as an asynchronous
//!   all-reduce ([`ProcessGroup::all_reduce_async`]: on NCCL, launched on the communicator's
//!   stream behind a device-side wait for the bucket's kernels; elsewhere, on the group's
//!   communication thread, one copy to the host per bucket). The presence flags stay on the
//!   host: [`OverlapStep::finish`] reduces them (a few bytes, while the device finishes the
//!   backward), then waits for each bucket with [`Work::wait_on_device`] (on NCCL, the
//!   device's stream waits, not the host). Nothing in the step waits for the device.
//! - **In host memory** on the CPU backends (Flex, NdArray): each hook reads its gradient into
//!   a pooled flat buffer, and each complete buffer is reduced by a job on the group's
//!   communication thread (its lane, [`crate::work`]; a failed bucket's successors are
//!   skipped, not left to wait for a dead peer).
//!
//! Both give the same buckets, order, flags and averages; `tests/overlap.rs` runs every check
//! on both.
//!
//! # Why a hook, and not Burn's own gradient sync
//!
//! Burn 0.22.1's autodiff calls `DistributedOps::submit_gradient_sync` for parameters marked
//! with `Tensor::set_distributed`. That route is closed to this crate: the backends are the
//! fixed variants of Burn's `Dispatch` enum, so no decorator backend can be plugged in; marking a
//! Flex (or NdArray) parameter panics in `Dispatch::set_distributed_params` because only the
//! Cube and Remote backends are listed as distributed in burn-backend-extension's catalog; and
//! the sync server that would run the reduction calls the backend's in-process
//! `DistributedOps::all_reduce`, which Flex does not implement (Burn's default panics) and has no notion of a
//! process group. `tests/overlap.rs` checks the panic.
//!
//! # When the hooks run
//!
//! Burn runs a backward pass level by level, deepest node first, where a node's depth is one
//! more than its deepest input's. A hook on a parameter (depth 0) would have depth 1 and run at
//! the very end, after every other step: no overlap. So each hook gets a second, untracked input
//! (an *anchor*) whose depth places the hook just below the operation that uses the parameter:
//! hooks are created at the parameter's first use in the forward (the hooked module's
//! parameters are lazy), the `k`-th of `K` gets depth `k · D / K`, with `D` the depth of the loss
//! measured once, by [`OverlapStep::backward`] on the first step. The depth only decides *when*
//! a hook runs; it always runs after every use of its parameter (those depend on it), so the
//! gradient it sees is final whatever the estimate.
//!
//! # Guarantees
//!
//! - Buckets hold the gradients in reverse order of the module's parameters, decided from the
//!   module (never from which gradients arrived), and are sent in that order on every rank.
//! - A parameter used several times (tied weights) has one hook node, whose gradient Burn sums
//!   over the uses before the hook runs.
//! - A parameter without a gradient on this rank contributes zeros; one that no rank has a
//!   gradient for gets none (as with [`DistributedDataParallel`]).
//!   Each bucket carries a presence flag per parameter for that. Frozen parameters take no part.
//! - Gradient accumulation: [`OverlapStep::accumulate`] adds a micro-step's gradients to the
//!   buckets without communicating; the hooked last micro-step completes them.
//! - A failed all-reduce ends [`OverlapStep::finish`] with its typed error (never a hang: every
//!   collective has the group's timeout). Backward itself never fails because of communication.
//!
//! Not for the flat shards of FSDP units (their gradients arrive averaged over the shard group
//! from the units' own backward); `TrainStep::with_overlap` refuses that combination.

#![cfg_attr(feature = "ndarray", allow(deprecated))]

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, Flex, backend_extension, try_read_sync};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};
use half::{bf16, f16};

use crate::autograd::GradDispatch;
use crate::comm::host::ReduceOp;
use crate::ddp::{
    DEFAULT_BUCKET_BYTES, DistributedDataParallel, first_device, in_dtype_of, numel_of,
    plan_buckets, reduced_params,
};
use crate::error::{CollectiveError, Result};
use crate::group::{ProcessGroup, tensor_from_data};
use crate::work::Work;

/// What a gradient hook is told when its backward step runs.
#[derive(Debug)]
pub struct HookEvent {
    /// The autodiff depth (Burn's `order`) of the hook's node: backward runs deeper steps first.
    pub order: usize,
    /// The gradient on the host, for a hook made with [`GradHook::take`].
    pub grad: Option<TensorData>,
    /// The gradient on its device, flattened, for a hook made with [`GradHook::take_on_device`].
    pub tensor: Option<Tensor<1>>,
}

/// A callback run by the backward step of [`grad_hook`].
#[derive(Clone)]
pub struct GradHook {
    name: &'static str,
    take: Take,
    f: Arc<dyn Fn(HookEvent) + Send + Sync>,
}

/// What a [`GradHook`] does with the gradient.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Take {
    /// Passes it on.
    No,
    /// Takes it, read to the host.
    Host,
    /// Takes it, on its device.
    Device,
}

impl GradHook {
    /// A hook that sees when backward reaches it (and its depth); the gradient goes on to the
    /// input unchanged.
    ///
    /// # Arguments
    /// * `name` - for debugging output.
    /// * `f` - called once, in backward, with the hook's depth (`grad` is `None`).
    pub fn observe(name: &'static str, f: impl Fn(HookEvent) + Send + Sync + 'static) -> Self {
        Self {
            name,
            take: Take::No,
            f: Arc::new(f),
        }
    }

    /// A hook that takes the gradient: `f` receives it on the host, and the input gets no
    /// gradient through this path (nothing is kept twice). [`OverlappedDdp`]'s hooks are these.
    ///
    /// # Arguments
    /// * `name` - for debugging output.
    /// * `f` - called once, in backward, with the gradient.
    pub fn take(name: &'static str, f: impl Fn(HookEvent) + Send + Sync + 'static) -> Self {
        Self {
            name,
            take: Take::Host,
            f: Arc::new(f),
        }
    }

    /// A hook that takes the gradient and leaves it on its device: `f` receives it flattened
    /// (`HookEvent::tensor`, a tensor of the inner backend, outside the graph), and the input
    /// gets no gradient through this path. Nothing waits for the device: a GPU gradient is
    /// handed over as soon as backward has queued its kernels.
    ///
    /// # Arguments
    /// * `name` - for debugging output.
    /// * `f` - called once, in backward, with the gradient.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::overlap::{GradHook, grad_hook};
    ///
    /// let device = Device::flex().autodiff();
    /// let w = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device).require_grad();
    /// let seen = Arc::new(Mutex::new(None));
    /// let hook = {
    ///     let seen = seen.clone();
    ///     GradHook::take_on_device("w", move |event| *seen.lock().unwrap() = event.tensor)
    /// };
    /// let hooked = grad_hook(w, &Tensor::zeros([1], &device), hook);
    /// let _ = (hooked * 2.0).sum().backward();
    /// let grad = seen.lock().unwrap().take().unwrap();
    /// assert_eq!(grad.into_data().to_vec::<f32>().unwrap(), vec![2.0; 4]);
    /// ```
    pub fn take_on_device(
        name: &'static str,
        f: impl Fn(HookEvent) + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            take: Take::Device,
            f: Arc::new(f),
        }
    }
}

impl fmt::Debug for GradHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GradHook({})", self.name)
    }
}

/// The backend extension of the gradient hook: an identity whose backward step calls a hook,
/// and either passes the gradient on unchanged ([`GradHook::observe`]) or hands it to the hook
/// ([`GradHook::take`]). The `anchor` is an untracked
/// tensor whose autodiff depth sets the hook's own depth (depth = anchor's + 1): Burn runs the
/// backward by depth, deepest first, so the anchor decides when the hook runs.
#[backend_extension(
    Flex,
    Autodiff,
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "cube")
)]
pub trait HookBackend: burn::backend::Backend {
    /// Returns `x`; under autodiff, records `hook` to run in backward.
    fn grad_hook(
        x: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        hook: GradHook,
    ) -> FloatTensor<Self> {
        let _ = (anchor, hook);
        x
    }
}

impl HookBackend for Flex {}
#[cfg(feature = "ndarray")]
impl HookBackend for burn::backend::NdArray {}
#[cfg(feature = "cube")]
impl HookBackend for burn::backend::Cube {}

#[derive(Debug)]
struct HookBackward;

impl<B: HookBackend + GradDispatch> Backward<B, 2> for HookBackward {
    type State = GradHook;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent, _anchor] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let order = ops.node.order;
        let event = |grad, tensor| HookEvent {
            order,
            grad,
            tensor,
        };
        match ops.state.take {
            Take::Host => {
                // Moved, not cloned: on host backends the gradient's storage becomes the data.
                let host = try_read_sync(B::float_into_data(grad)).and_then(|r| r.ok());
                (ops.state.f)(event(host, None));
            }
            Take::Device => {
                let tensor = Tensor::<1>::from_dispatch(B::grad_to_dispatch(grad));
                let numel = tensor.shape().num_elements();
                (ops.state.f)(event(None, Some(tensor.reshape([numel]))));
            }
            Take::No => {
                (ops.state.f)(event(None, None));
                if let Some(parent) = parent {
                    grads.register::<B>(parent.id, grad);
                }
            }
        }
    }
}

impl<B: HookBackend + GradDispatch, C: CheckpointStrategy> HookBackend for Autodiff<B, C> {
    fn grad_hook(
        x: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        hook: GradHook,
    ) -> FloatTensor<Self> {
        let anchor_node = anchor.node();
        let (y, node) = x.into_parts();
        match HookBackward
            .prepare::<C>([node, anchor_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(hook, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// `x` unchanged, with `hook` run in backward once the gradient of the returned tensor is
/// complete (after the backward of every use of it).
///
/// # Arguments
/// * `x` - the tensor to watch (returned as is when it is not tracked by autodiff).
/// * `anchor` - an untracked tensor on `x`'s device: the hook's autodiff depth is one more than
///   the larger of `x`'s and `anchor`'s, and Burn's backward runs deeper steps first, so a
///   deeper anchor runs the hook earlier (`Tensor::zeros([1], &device)` has depth 0).
/// * `hook` - [`GradHook::observe`] or [`GradHook::take`].
///
/// # Returns
/// `x`, as a new node of the graph.
///
/// # Example
/// ```
/// use std::sync::{Arc, Mutex};
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::overlap::{GradHook, grad_hook};
///
/// let device = Device::flex().autodiff();
/// let w = Tensor::<1>::from_floats([1.0, 2.0], &device).require_grad();
/// let seen = Arc::new(Mutex::new(None));
/// let hook = {
///     let seen = seen.clone();
///     GradHook::take("w", move |event| *seen.lock().unwrap() = event.grad)
/// };
/// let hooked = grad_hook(w.clone(), &Tensor::zeros([1], &device), hook);
/// // Used twice: the hook runs once, with the sum of both uses' gradients.
/// let _ = (hooked.clone() * 3.0 + hooked).sum().backward();
/// let grad = seen.lock().unwrap().take().unwrap();
/// assert_eq!(grad.to_vec::<f32>().unwrap(), vec![4.0, 4.0]);
/// ```
pub fn grad_hook<const D: usize>(x: Tensor<D>, anchor: &Tensor<1>, hook: GradHook) -> Tensor<D> {
    if !x.is_tracked() {
        return x;
    }
    Tensor::from_dispatch(Dispatch::grad_hook(
        x.into_dispatch(),
        anchor.clone().into_dispatch(),
        hook,
    ))
}

/// Data parallelism whose gradient all-reduce runs during backward. See the module docs.
///
/// Cheap to clone; clones share the depth calibration (see the module docs), so keep one per
/// rank and model.
#[derive(Clone)]
pub struct OverlappedDdp {
    ddp: DistributedDataParallel,
    /// A dedicated group over the same ranks: the buckets' collectives never interleave with
    /// collectives the caller runs on `group` meanwhile.
    comm: ProcessGroup,
    bucket_bytes: usize,
    /// The dtype the buckets carry (`None`: each parameter's own).
    reduce_dtype: Option<DType>,
    depth: Arc<Mutex<DepthState>>,
}

impl fmt::Debug for OverlappedDdp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OverlappedDdp")
            .field("group", self.ddp.group())
            .field("bucket_bytes", &self.bucket_bytes)
            .finish()
    }
}

impl OverlappedDdp {
    /// Overlapped data parallelism over `group`, with 25 MB buckets (PyTorch DDP's default).
    ///
    /// The buckets travel on a sub-group of all the ranks of `group` (made here with
    /// [`ProcessGroup::split`], without communication), so the caller may run other collectives
    /// on `group` (such as averaging the loss) while buckets are in flight. As with every
    /// `split`, all ranks must create their `OverlappedDdp`s and other sub-groups of `group`
    /// in the same order.
    ///
    /// # Arguments
    /// * `group` - the data-parallel group; gradients are averaged over its ranks.
    pub fn new(group: ProcessGroup) -> Self {
        let all: Vec<usize> = (0..group.size()).collect();
        let comm = group
            .split(&all)
            .expect("every rank of a group, once each, is a valid sub-group");
        Self {
            comm,
            ddp: DistributedDataParallel::new(group),
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            reduce_dtype: None,
            depth: Arc::new(Mutex::new(DepthState::default())),
        }
    }

    /// Sets the size from which a bucket is closed (a bucket holds at least one parameter).
    /// Smaller buckets start communicating earlier, at the cost of more, smaller collectives.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }

    /// Averages the gradients in `dtype` (for example bf16 gradients of fp32 master weights,
    /// or fp32 for bf16 gradients): the buckets accumulate (over micro-steps) in the
    /// parameters' dtype and are cast to `dtype` for the all-reduce only; the averaged
    /// gradients come back in each parameter's own dtype. [`TrainStep`](crate::train::TrainStep) sets its precision policy's
    /// `reduce_dtype` here.
    pub fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = Some(dtype);
        self
    }

    /// The data-parallel group.
    pub fn group(&self) -> &ProcessGroup {
        self.ddp.group()
    }

    /// Replaces every float parameter of `module` with `root`'s value (identical replicas), as
    /// [`DistributedDataParallel::broadcast_module`].
    ///
    /// # Errors
    /// When a broadcast fails.
    pub fn broadcast_module<M: Module>(&self, module: M, root: usize) -> Result<M> {
        self.ddp.broadcast_module(module, root)
    }

    /// Starts one optimizer step of `module`: plans the buckets (from the module, the same on
    /// every rank).
    ///
    /// # Arguments
    /// * `module` - the model whose parameters are trained (not a hooked copy).
    ///
    /// # Returns
    /// The step: [`OverlapStep::accumulate`] for micro-steps without communication, then
    /// [`OverlapStep::hook`], [`OverlapStep::backward`] and [`OverlapStep::finish`].
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when a parameter has a dtype the buckets cannot
    /// carry (only f32, f64, f16 and bf16 parameters are trained).
    pub fn start<M: Module>(&self, module: &M) -> Result<OverlapStep> {
        let rank = self.group().global_rank();
        let index = crate::index::ParamIndex::with_state(module);
        let mut params = reduced_params(&index);
        params.reverse();
        // Buckets accumulate in the parameters' dtype; `reduce_dtype` is what travels.
        let dtypes = params.iter().map(|p| p.2).chain(self.reduce_dtype);
        if let Some(dtype) = dtypes.into_iter().find(|d| elem_kind(*d).is_none()) {
            return Err(invalid(
                rank,
                format!(
                    "parameters of dtype {dtype:?} cannot be averaged (f32, f64, f16, bf16 only)"
                ),
            ));
        }
        let plan = Plan::new(params, self.bucket_bytes);
        // Device buckets where the collective runs on the device, and on accelerators
        // whatever the transport (one copy to the host per bucket, on the lane's thread,
        // instead of a read per gradient in the backward).
        let device = first_device(&index)
            .filter(|device| self.comm.collects_on_device(device) || on_accelerator(device));
        // Device buckets are started as asynchronous collectives
        // ([`ProcessGroup::all_reduce_async`]); host buckets as jobs on the same communication
        // thread of the group (its lane), which outlives the step.
        let fill = Fill {
            parts: plan
                .buckets
                .iter()
                .map(|b| vec![None; b.params.len()])
                .collect(),
            works: Vec::new(),
            host_works: Vec::new(),
            failed: Arc::new(AtomicBool::new(false)),
            device,
            group: self.comm.clone(),
            reduce_dtype: self.reduce_dtype,
            buffers: (0..plan.buckets.len()).map(|_| None).collect(),
            pending: plan.buckets.iter().map(|b| b.params.len()).collect(),
            has_value: vec![false; plan.params.len()],
            fired: vec![false; plan.params.len()],
            next_launch: 0,
            sent: Arc::new(AtomicUsize::new(0)),
            error: None,
            hooked: HashMap::new(),
            hooks_created: 0,
            micro_steps: 0,
            hooked_step: false,
            plan,
        };
        Ok(OverlapStep {
            rank,
            fill: Arc::new(Mutex::new(fill)),
            depth: self.depth.clone(),
        })
    }
}

fn invalid(rank: usize, reason: String) -> CollectiveError {
    CollectiveError::InvalidArgument {
        rank,
        op: "overlapped all-reduce of gradients".into(),
        reason,
    }
}

/// Anchors (untracked tensors of every depth up to the deepest asked for) and the measured
/// depth of the loss, shared by the steps of one [`OverlappedDdp`].
#[derive(Default)]
struct DepthState {
    /// `anchors[i]` has autodiff depth `i`.
    anchors: Vec<Tensor<1>>,
    /// Depth of the loss and number of hooks, measured once.
    calibration: Option<(usize, usize)>,
}

impl DepthState {
    /// The anchor for the `k`-th hook of a step (its depth is the hook's minus one).
    fn anchor_for(&mut self, k: usize, device: &Device) -> Tensor<1> {
        let depth = match self.calibration {
            None => 1,
            Some((loss_depth, hooks)) => (k * loss_depth / hooks.max(1)).max(1),
        };
        if self.anchors.is_empty() {
            self.anchors.push(Tensor::zeros([1], device));
        }
        while self.anchors.len() < depth {
            let deeper = self.anchors.last().expect("not empty").clone().neg();
            self.anchors.push(deeper);
        }
        self.anchors[depth - 1].clone()
    }
}

/// The bucket layout of a step, from the module.
struct Plan {
    /// Trainable parameters in reverse visiting order: (id, shape, dtype).
    params: Vec<(ParamId, Vec<usize>, DType)>,
    /// Where each parameter lives: (bucket, element offset in the bucket).
    slots: Vec<(usize, usize)>,
    index: HashMap<ParamId, usize>,
    buckets: Vec<BucketSpec>,
}

struct BucketSpec {
    /// Indices into `Plan::params`, consecutive.
    params: Vec<usize>,
    dtype: DType,
    /// Elements of gradients; one presence flag per parameter follows them.
    grad_numel: usize,
}

impl BucketSpec {
    fn numel(&self) -> usize {
        self.grad_numel + self.params.len()
    }
}

impl Plan {
    fn new(params: Vec<(ParamId, Vec<usize>, DType)>, bucket_bytes: usize) -> Self {
        let mut slots = vec![(0, 0); params.len()];
        let buckets = plan_buckets(&params, bucket_bytes)
            .into_iter()
            .enumerate()
            .map(|(b, members)| {
                let mut at = 0;
                for &i in &members {
                    slots[i] = (b, at);
                    at += numel_of(&params[i].1);
                }
                BucketSpec {
                    dtype: params[members[0]].2,
                    params: members,
                    grad_numel: at,
                }
            })
            .collect();
        let index = params.iter().enumerate().map(|(i, p)| (p.0, i)).collect();
        Self {
            params,
            slots,
            index,
            buckets,
        }
    }
}

/// What backward (the hooks) and the step share.
struct Fill {
    plan: Plan,
    /// Where the buckets are formed: `Some(device)` when the group collects on the
    /// parameters' device (NCCL with CUDA, or [`ProcessGroup::with_tensor_path`]): gradients
    /// stay there and each bucket is an asynchronous all-reduce; `None`: host buckets.
    device: Option<Device>,
    /// Device buckets: per bucket, each member's flat gradient so far.
    parts: Vec<Vec<Option<Tensor<1>>>>,
    /// Device buckets started so far, in bucket order.
    works: Vec<Work<Tensor<1>>>,
    /// The buckets' group.
    group: ProcessGroup,
    /// The dtype the buckets travel in, when not the parameters' (they accumulate in theirs).
    reduce_dtype: Option<DType>,
    /// Bucket storage, allocated (zeroed) at the first gradient written into it; `None` again
    /// once sent.
    buffers: Vec<Option<burn::tensor::Bytes>>,
    /// Per bucket: parameters whose hook has not run yet.
    pending: Vec<usize>,
    /// Per parameter: the bucket holds a gradient for it (this micro-step or an earlier one).
    has_value: Vec<bool>,
    /// Per parameter: its hook ran.
    fired: Vec<bool>,
    /// Buckets before this one have been handed to the communication thread.
    next_launch: usize,
    /// Host buckets started so far, in bucket order (jobs on the group's lane).
    host_works: Vec<Work<TensorData>>,
    /// A host bucket's all-reduce failed: the later ones are not attempted (each would wait
    /// for a dead peer until the timeout); `finish` reports the first failure.
    failed: Arc<AtomicBool>,
    /// Buckets handed to the communication thread so far (readable during backward).
    sent: Arc<AtomicUsize>,
    /// The first misuse seen in backward (reported by `finish`).
    error: Option<String>,
    /// The hooked value of each parameter in this step (one hook node per parameter).
    hooked: HashMap<ParamId, Box<dyn Any + Send + Sync>>,
    hooks_created: usize,
    micro_steps: usize,
    hooked_step: bool,
}

impl Fill {
    fn buffer(&mut self, bucket: usize) -> &mut burn::tensor::Bytes {
        let spec = &self.plan.buckets[bucket];
        let (numel, dtype) = (spec.numel(), spec.dtype);
        self.buffers[bucket].get_or_insert_with(|| crate::comm::pool::tensor_storage(numel, dtype))
    }

    /// Adds (or copies, for the first value) `grad` into parameter `i`'s place.
    fn write(&mut self, i: usize, grad: Grad) -> std::result::Result<(), String> {
        let (id, shape, dtype) = &self.plan.params[i];
        let (dtype, numel) = (*dtype, numel_of(shape));
        let got = match &grad {
            Grad::Host(data) => data.num_elements(),
            Grad::Device(tensor) => tensor.shape().num_elements(),
        };
        if got != numel {
            return Err(format!(
                "the gradient of parameter {id} has {got} elements, the parameter {numel}"
            ));
        }
        let (bucket, offset) = self.plan.slots[i];
        if bucket < self.next_launch {
            return Err(format!(
                "a gradient of parameter {id} arrived after its bucket was sent (a second \
                 backward through the same hooked module?); hook the module again for each step"
            ));
        }
        let grad = match grad {
            Grad::Host(data) => data,
            Grad::Device(tensor) => {
                let tensor = if tensor.dtype() == dtype {
                    tensor
                } else {
                    tensor.cast(dtype)
                };
                let at = i - self.plan.buckets[bucket].params[0];
                let slot = &mut self.parts[bucket][at];
                *slot = Some(match slot.take() {
                    Some(sum) => sum + tensor,
                    None => tensor,
                });
                self.has_value[i] = true;
                return Ok(());
            }
        };
        let grad = if grad.dtype() == dtype {
            grad
        } else {
            grad.convert_dtype(dtype)
        };
        let size = dtype.size();
        let first = !self.has_value[i];
        let buffer = self.buffer(bucket);
        let dst = &mut buffer[offset * size..(offset + numel) * size];
        if first {
            dst.copy_from_slice(grad.as_bytes());
        } else {
            add_into(dst, grad.as_bytes(), dtype);
        }
        self.has_value[i] = true;
        Ok(())
    }

    /// Hands every complete bucket to the communication thread, in bucket order.
    fn launch_ready(&mut self) {
        while self.next_launch < self.plan.buckets.len() && self.pending[self.next_launch] == 0 {
            self.launch_next();
        }
    }

    /// Hands bucket `next_launch` to the communication thread, complete or not.
    fn launch_next(&mut self) {
        let b = self.next_launch;
        self.next_launch += 1;
        self.sent.store(self.next_launch, Ordering::Release);
        let spec = &self.plan.buckets[b];
        let (numel, dtype, grad_numel) = (spec.numel(), spec.dtype, spec.grad_numel);
        let flags: Vec<bool> = spec.params.iter().map(|&i| self.has_value[i]).collect();
        if let Some(device) = &self.device {
            // The bucket is one flat tensor on the device: the gradients (zeros for those
            // this rank has none of). The presence flags go through the host at `finish`:
            // uploading them here would make the host wait for the device (a copy from
            // pageable memory synchronises the stream) in the middle of the backward.
            let parts = std::mem::take(&mut self.parts[b]);
            let pieces: Vec<Tensor<1>> = parts
                .into_iter()
                .zip(&spec.params)
                .map(|(part, &i)| {
                    part.unwrap_or_else(|| {
                        Tensor::zeros([numel_of(&self.plan.params[i].1)], (device, dtype))
                    })
                })
                .collect();
            let bucket = Tensor::cat(pieces, 0);
            let bucket = match self.reduce_dtype {
                Some(reduce) if reduce != dtype => bucket.cast(reduce),
                _ => bucket,
            };
            self.works
                .push(self.group.all_reduce_async(bucket, ReduceOp::Avg));
            return;
        }
        let mut buffer = self.buffers[b]
            .take()
            .unwrap_or_else(|| crate::comm::pool::tensor_storage(numel, dtype));
        for (j, present) in flags.into_iter().enumerate() {
            set_flag(&mut buffer, dtype, grad_numel + j, present);
        }
        let data = TensorData::from_bytes(buffer, [numel], dtype);
        let data = match self.reduce_dtype {
            Some(reduce) if reduce != dtype => data.convert_dtype(reduce),
            _ => data,
        };
        let failed = self.failed.clone();
        let work = self
            .group
            .on_lane("overlapped all-reduce of gradients", move |group| {
                if failed.load(Ordering::Acquire) {
                    return Err(CollectiveError::InvalidArgument {
                        rank: group.global_rank(),
                        op: "overlapped all-reduce of gradients".into(),
                        reason: "skipped: an earlier bucket's all-reduce failed".into(),
                    });
                }
                let result = group.all_reduce_data(data, ReduceOp::Avg);
                if result.is_err() {
                    failed.store(true, Ordering::Release);
                }
                result
            });
        self.host_works.push(work);
    }

    /// The hook of parameter `i` ran with `grad`.
    fn on_grad(&mut self, i: usize, grad: Option<Grad>) {
        if self.fired[i] {
            let id = self.plan.params[i].0;
            self.error.get_or_insert(format!(
                "the hook of parameter {id} ran twice (a second backward through the same \
                 hooked module?); hook the module again for each step"
            ));
            return;
        }
        self.fired[i] = true;
        let result = match grad {
            Some(grad) => self.write(i, grad),
            None => Err("the gradient could not be read to the host".into()),
        };
        if let Err(e) = result {
            self.error.get_or_insert(e);
        }
        let bucket = self.plan.slots[i].0;
        self.pending[bucket] -= 1;
        self.launch_ready();
    }
}

/// One step of [`OverlappedDdp`]: see [`OverlappedDdp::start`].
pub struct OverlapStep {
    rank: usize,
    fill: Arc<Mutex<Fill>>,
    depth: Arc<Mutex<DepthState>>,
}

impl fmt::Debug for OverlapStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OverlapStep(rank {})", self.rank)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OverlapStep {
    /// Adds one micro-step's gradients (computed on the un-hooked module) to the buckets,
    /// without communicating: gradient accumulation. The last micro-step goes through
    /// [`Self::hook`]; [`Self::finish`] averages over the micro-steps and the ranks.
    ///
    /// # Arguments
    /// * `module` - the model (the same as for [`OverlappedDdp::start`]).
    /// * `grads` - this micro-step's gradients, e.g. `GradientsParams::from_grads(loss.backward(), &module)`.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when called after the hooked backward has started
    /// sending buckets, or when a gradient does not match its parameter.
    pub fn accumulate<M: Module>(&mut self, module: &M, mut grads: GradientsParams) -> Result<()> {
        let mut fill = lock(&self.fill);
        if fill.hooked_step {
            return Err(invalid(
                self.rank,
                "accumulate was called after hook: micro-steps without communication come \
                 first, the hooked one last"
                    .into(),
            ));
        }
        fill.micro_steps += 1;
        struct Take<'a> {
            grads: &'a mut GradientsParams,
            fill: &'a mut Fill,
            error: Option<String>,
        }
        impl ModuleVisitor for Take<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let grad = self.grads.remove::<D>(param.id);
                let Some(&i) = self.fill.plan.index.get(&param.id) else {
                    return; // frozen (or seen already through a shared parameter)
                };
                let grad = grad.map(|g| match self.fill.device {
                    Some(_) => {
                        let numel = g.shape().num_elements();
                        Grad::Device(g.reshape([numel]))
                    }
                    None => Grad::Host(g.into_data()),
                });
                if let Some(grad) = grad
                    && let Err(e) = self.fill.write(i, grad)
                {
                    self.error.get_or_insert(e);
                }
            }
        }
        let mut take = Take {
            grads: &mut grads,
            fill: &mut fill,
            error: None,
        };
        module.visit(&mut take);
        match take.error {
            Some(e) => Err(invalid(self.rank, e)),
            None => Ok(()),
        }
    }

    /// The number of buckets of this step (the same on every rank).
    pub fn bucket_count(&self) -> usize {
        lock(&self.fill).plan.buckets.len()
    }

    /// A counter of the buckets handed to the communication thread so far, readable while
    /// backward runs (from another thread, or from a hook of your own): measurements and tests
    /// use it to see how much communication started before backward ended.
    pub fn buckets_sent(&self) -> Arc<AtomicUsize> {
        lock(&self.fill).sent.clone()
    }

    /// `module` with each trainable parameter behind a gradient hook, for the forward of the
    /// (last) micro-step. The hooked module shares the parameters of `module` (the graph's
    /// leaves are `module`'s own, so the optimizer steps `module`), but the hooks take their
    /// gradients: Burn's `Gradients` hold none for them, [`Self::finish`] returns the averaged
    /// ones. Use the hooked module for one forward, in place of `module` (a parameter used
    /// through `module` directly in the same forward would miss that use's gradient), and drop
    /// it.
    ///
    /// # Arguments
    /// * `module` - usually `model.clone()`.
    ///
    /// # Returns
    /// The hooked module.
    pub fn hook<M: Module>(&self, module: M) -> M {
        lock(&self.fill).hooked_step = true;
        let mut mapper = Hooker {
            fill: &self.fill,
            depth: &self.depth,
        };
        module.map(&mut mapper)
    }

    /// Runs `loss.backward()`, during which the buckets are all-reduced. On the first step of
    /// an [`OverlappedDdp`] it also measures the depth of the loss, which places the hooks of
    /// later steps (see the module docs); `loss.backward()` works too but does not measure it,
    /// so without one call of this method the hooks run at the end of backward.
    ///
    /// # Arguments
    /// * `loss` - computed with the module from [`Self::hook`].
    ///
    /// # Returns
    /// Burn's gradients (of tracked tensors other than the hooked parameters, whose gradients
    /// went to the buckets).
    ///
    /// # Errors
    /// A collective of the model's own (tensor or sequence parallelism) that failed inside the
    /// backward ([`crate::autograd::backward`]). The buckets' all-reduces report theirs from
    /// [`Self::finish`].
    pub fn backward(&self, loss: Tensor<1>) -> Result<burn::tensor::Gradients> {
        {
            // Parameters the forward never touched have no hook: they will get no gradient
            // on this rank, so their buckets need not wait for them.
            let mut fill = lock(&self.fill);
            let fill = &mut *fill;
            for (i, (id, _, _)) in fill.plan.params.iter().enumerate() {
                if !fill.hooked.contains_key(id) && !fill.fired[i] {
                    fill.fired[i] = true;
                    fill.pending[fill.plan.slots[i].0] -= 1;
                }
            }
            fill.launch_ready();
        }
        let hooks = lock(&self.fill).hooks_created;
        let mut depth = lock(&self.depth);
        if depth.calibration.is_some() || !loss.is_tracked() {
            drop(depth);
            return crate::autograd::backward(loss);
        }
        let anchor = depth.anchor_for(0, &loss.device());
        drop(depth);
        let measured = Arc::new(Mutex::new(None));
        let probe = {
            let measured = measured.clone();
            GradHook::observe("loss depth", move |event| {
                *lock(&measured) = Some(event.order);
            })
        };
        let grads = crate::autograd::backward(grad_hook(loss, &anchor, probe))?;
        if let Some(order) = *lock(&measured) {
            // The probe sits one level above the loss.
            lock(&self.depth).calibration = Some((order.saturating_sub(1), hooks));
        }
        Ok(grads)
    }

    /// Sends the buckets not sent yet (in bucket order; missing gradients are zeros), waits
    /// for every all-reduce and returns the gradients averaged over the ranks (and over the
    /// micro-steps, with [`Self::accumulate`]), on each parameter's device, ready for
    /// `optim.step`. Parameters that no rank has a gradient for get none; frozen ones get none.
    ///
    /// # Arguments
    /// * `module` - the model (the same as for [`OverlappedDdp::start`]).
    ///
    /// # Errors
    /// The all-reduce's error (a dead peer, a rank with another model: a mismatch), or
    /// [`CollectiveError::InvalidArgument`] for misuse seen during backward (a hook that ran
    /// twice, a gradient of the wrong size) or when nothing was accumulated nor hooked. Every
    /// bucket is still sent before a misuse is reported, so that the other ranks do not wait.
    pub fn finish<M: Module>(self, module: &M) -> Result<GradientsParams> {
        self.finish_averaged(module, true)
    }

    /// [`Self::finish`] without the average over the micro-steps: the gradients summed over
    /// them (and averaged over the ranks), for losses already divided by the number of
    /// micro-steps (as `TrainStep`'s accumulation divides them, so that low-precision
    /// backward passes round alike with and without overlap).
    ///
    /// # Errors
    /// As [`Self::finish`].
    pub fn finish_summed<M: Module>(self, module: &M) -> Result<GradientsParams> {
        self.finish_averaged(module, false)
    }

    fn finish_averaged<M: Module>(self, module: &M, average: bool) -> Result<GradientsParams> {
        let (buckets, misuse, scale) = {
            let mut fill = lock(&self.fill);
            while fill.next_launch < fill.plan.buckets.len() {
                fill.launch_next();
            }
            fill.hooked.clear();
            let steps = fill.micro_steps + usize::from(fill.hooked_step);
            let misuse = match (fill.error.take(), steps) {
                (Some(e), _) => Some(e),
                (None, 0) => Some(
                    "nothing to reduce: call hook (and backward) or accumulate before finish"
                        .into(),
                ),
                (None, _) => None,
            };
            let scale = match average {
                true => 1.0 / steps.max(1) as f32,
                false => 1.0,
            };
            (fill.plan.buckets.len(), misuse, scale)
        };
        let (works, group, present) = {
            let mut fill = lock(&self.fill);
            let present: Vec<f32> = fill
                .has_value
                .iter()
                .map(|&p| f32::from(u8::from(p)))
                .collect();
            (std::mem::take(&mut fill.works), fill.group.clone(), present)
        };
        if !works.is_empty() {
            // Device buckets: which parameters some rank has a gradient for, through the host
            // (while the device finishes the backward), then each bucket's all-reduce.
            let n = present.len();
            let used = group.all_reduce_data(TensorData::new(present, [n]), ReduceOp::Max);
            // Waited for on the device: the host goes on to the optimizer step without
            // draining the device (see `Work::wait_on_device` for how failures surface).
            let reduced: Vec<Tensor<1>> = works
                .into_iter()
                .map(Work::wait_on_device)
                .collect::<Result<_>>()?;
            let used = used?.try_to_vec::<f32>().map_err(|e| {
                invalid(
                    self.rank,
                    format!("presence flags came back malformed: {e:?}"),
                )
            })?;
            if let Some(e) = misuse {
                return Err(invalid(self.rank, e));
            }
            return Ok(self.register_device(module, reduced, &used, scale));
        }
        // Host buckets, in order: the first failure is the step's error (later buckets were
        // skipped after it).
        let host_works = std::mem::take(&mut lock(&self.fill).host_works);
        debug_assert_eq!(host_works.len(), buckets);
        let reduced: Vec<TensorData> = host_works
            .into_iter()
            .map(Work::wait)
            .collect::<Result<_>>()?;
        if let Some(e) = misuse {
            return Err(invalid(self.rank, e));
        }
        let fill = lock(&self.fill);
        let mut grads: HashMap<ParamId, Reduced> = HashMap::new();
        for (spec, data) in fill.plan.buckets.iter().zip(reduced) {
            // Back from the reduce dtype to the buckets' own.
            let data = match data.dtype() == spec.dtype {
                true => data,
                false => data.convert_dtype(spec.dtype),
            };
            let bytes = data.as_bytes();
            let size = spec.dtype.size();
            for (j, &i) in spec.params.iter().enumerate() {
                if !flag(bytes, spec.dtype, spec.grad_numel + j) {
                    continue; // no rank had a gradient for it
                }
                let (id, shape, dtype) = &fill.plan.params[i];
                let offset = fill.plan.slots[i].1 * size;
                let len = numel_of(shape) * size;
                let grad = crate::comm::pool::tensor_data(shape.clone(), *dtype, |out| {
                    out.copy_from_slice(&bytes[offset..offset + len])
                });
                grads.insert(*id, Reduced::Host(grad));
            }
        }
        let mut register = Register {
            grads: GradientsParams::new(),
            reduced: grads,
            scale,
        };
        module.visit(&mut register);
        Ok(register.grads)
    }
}

impl OverlapStep {
    /// The gradients of the reduced device buckets, registered on each parameter's device.
    fn register_device<M: Module>(
        &self,
        module: &M,
        reduced: Vec<Tensor<1>>,
        used: &[f32],
        scale: f32,
    ) -> GradientsParams {
        let fill = lock(&self.fill);
        let mut grads: HashMap<ParamId, Reduced> = HashMap::new();
        for (spec, bucket) in fill.plan.buckets.iter().zip(reduced) {
            for &i in &spec.params {
                if !used.get(i).is_some_and(|&f| f > 0.0) {
                    continue; // no rank had a gradient for it
                }
                let (id, shape, _) = &fill.plan.params[i];
                let at = fill.plan.slots[i].1;
                let grad = bucket.clone().slice(at..at + numel_of(shape));
                grads.insert(*id, Reduced::Device(grad, shape.clone()));
            }
        }
        let mut register = Register {
            grads: GradientsParams::new(),
            reduced: grads,
            scale,
        };
        module.visit(&mut register);
        register.grads
    }
}

/// Whether `device` is a CubeCL device (a GPU, or CubeCL's CPU runtime), not host memory.
fn on_accelerator(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        matches!(
            device.as_dispatch().clone().inner(),
            burn::backend::DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// A gradient handed to a bucket.
enum Grad {
    Host(TensorData),
    /// Flat, on the device.
    Device(Tensor<1>),
}

impl Drop for OverlapStep {
    fn drop(&mut self) {
        // Without `finish` (an error path): free the hooked values. Buckets already started
        // finish on the group's communication thread (or fail at the group's timeout), and
        // nobody reads their results.
        let mut fill = lock(&self.fill);
        fill.host_works.clear();
        fill.hooked.clear();
    }
}

/// Puts every trainable parameter behind a hook, created lazily at its first use.
struct Hooker<'a> {
    fill: &'a Arc<Mutex<Fill>>,
    depth: &'a Arc<Mutex<DepthState>>,
}

impl ModuleMapper for Hooker<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(&index) = lock(self.fill).plan.index.get(&param.id) else {
            return param; // frozen: no gradient, no hook
        };
        let id = param.id;
        let value = param.val();
        if !value.is_tracked() {
            return param;
        }
        let device = value.device();
        let shape = value.shape();
        let fill = self.fill.clone();
        let depth = self.depth.clone();
        Param::uninitialized(
            id,
            move |_, _| hooked_value(&fill, &depth, index, id, value),
            device,
            true,
            shape,
        )
    }
}

/// The hooked value of parameter `index`: created at its first use, shared by later ones.
fn hooked_value<const D: usize>(
    fill: &Arc<Mutex<Fill>>,
    depth: &Arc<Mutex<DepthState>>,
    index: usize,
    id: ParamId,
    value: Tensor<D>,
) -> Tensor<D> {
    let mut guard = lock(fill);
    if let Some(hooked) = guard
        .hooked
        .get(&id)
        .and_then(|h| h.downcast_ref::<Tensor<D>>())
    {
        return hooked.clone();
    }
    let k = guard.hooks_created;
    guard.hooks_created += 1;
    let anchor = lock(depth).anchor_for(k, &value.device());
    let weak: Weak<Mutex<Fill>> = Arc::downgrade(fill);
    let on_device = guard.device.is_some();
    let deliver = move |event: HookEvent| {
        if let Some(fill) = weak.upgrade() {
            let grad = match event.tensor {
                Some(tensor) => Some(Grad::Device(tensor)),
                None => event.grad.map(Grad::Host),
            };
            lock(&fill).on_grad(index, grad);
        }
    };
    let hook = if on_device {
        GradHook::take_on_device("overlap", deliver)
    } else {
        GradHook::take("overlap", deliver)
    };
    let hooked = grad_hook(value, &anchor, hook);
    guard.hooked.insert(id, Box::new(hooked.clone()));
    hooked
}

/// A parameter's averaged gradient: host data (host buckets), or a flat slice of a device
/// bucket and the parameter's shape.
enum Reduced {
    Host(TensorData),
    Device(Tensor<1>, Vec<usize>),
}

/// Registers the reduced gradients on each parameter's (inner) device, in its dtype, scaled.
struct Register {
    grads: GradientsParams,
    reduced: HashMap<ParamId, Reduced>,
    scale: f32,
}

impl ModuleVisitor for Register {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let grad: Tensor<D> = match self.reduced.remove(&param.id) {
            None => return,
            Some(Reduced::Host(data)) => tensor_from_data(data, &param.lazy_device().inner()),
            Some(Reduced::Device(flat, shape)) => flat.reshape(burn::tensor::Shape::from(shape)),
        };
        let grad = in_dtype_of(grad, param);
        let grad = if self.scale == 1.0 {
            grad
        } else {
            grad * self.scale
        };
        self.grads.register(param.id, grad);
    }
}

/// The element types a bucket can hold.
#[derive(Clone, Copy)]
enum Elem {
    F32,
    F64,
    F16,
    Bf16,
}

fn elem_kind(dtype: DType) -> Option<Elem> {
    match dtype {
        DType::F32 | DType::Flex32 => Some(Elem::F32),
        DType::F64 => Some(Elem::F64),
        DType::F16 => Some(Elem::F16),
        DType::BF16 => Some(Elem::Bf16),
        DType::I64
        | DType::I32
        | DType::I16
        | DType::I8
        | DType::U64
        | DType::U32
        | DType::U16
        | DType::U8
        | DType::Bool(_)
        | DType::QFloat(_) => None,
    }
}

/// `dst += src`, element-wise, both holding `dtype` elements (checked by `start`).
fn add_into(dst: &mut [u8], src: &[u8], dtype: DType) {
    fn add<T: bytemuck::Pod + std::ops::AddAssign>(dst: &mut [u8], src: &[u8]) {
        let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(size_of::<T>())) {
            *d += bytemuck::pod_read_unaligned::<T>(s);
        }
    }
    match elem_kind(dtype) {
        Some(Elem::F32) => add::<f32>(dst, src),
        Some(Elem::F64) => add::<f64>(dst, src),
        Some(Elem::F16) => add::<f16>(dst, src),
        Some(Elem::Bf16) => add::<bf16>(dst, src),
        None => unreachable!("start rejects {dtype:?} parameters"),
    }
}

/// Writes the presence flag `index` (1 or 0) of a bucket of `dtype`.
fn set_flag(buffer: &mut [u8], dtype: DType, index: usize, present: bool) {
    let v: f64 = if present { 1.0 } else { 0.0 };
    let size = dtype.size();
    let dst = &mut buffer[index * size..(index + 1) * size];
    match elem_kind(dtype) {
        Some(Elem::F32) => dst.copy_from_slice(&(v as f32).to_ne_bytes()),
        Some(Elem::F64) => dst.copy_from_slice(&v.to_ne_bytes()),
        Some(Elem::F16) => dst.copy_from_slice(&f16::from_f64(v).to_ne_bytes()),
        Some(Elem::Bf16) => dst.copy_from_slice(&bf16::from_f64(v).to_ne_bytes()),
        None => unreachable!("start rejects {dtype:?} parameters"),
    }
}

/// Whether the averaged presence flag `index` is positive (some rank had the gradient).
fn flag(buffer: &[u8], dtype: DType, index: usize) -> bool {
    let size = dtype.size();
    let src = &buffer[index * size..(index + 1) * size];
    match elem_kind(dtype) {
        Some(Elem::F32) => bytemuck::pod_read_unaligned::<f32>(src) > 0.0,
        Some(Elem::F64) => bytemuck::pod_read_unaligned::<f64>(src) > 0.0,
        Some(Elem::F16) => bytemuck::pod_read_unaligned::<f16>(src).to_f64() > 0.0,
        Some(Elem::Bf16) => bytemuck::pod_read_unaligned::<bf16>(src).to_f64() > 0.0,
        None => unreachable!("start rejects {dtype:?} parameters"),
    }
}
