//! Differentiable collectives: the conjugate pairs every parallelism is built from.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to_group`] (Megatron's *f*) | identity | all-reduce (sum) |
//! | [`reduce_from_group`] (Megatron's *g*) | all-reduce (sum) | identity |
//! | [`scatter_to_group`] | keep this rank's slice along `dim` | all-gather along `dim` |
//! | [`gather_from_group`] | all-gather along `dim` | keep this rank's slice |
//! | [`gather_from_sequence`] | all-gather along `dim` | reduce-scatter (sum) along `dim` |
//! | [`reduce_scatter_to_sequence`] | reduce-scatter (sum) along `dim` | all-gather along `dim` |
//! | [`all_to_all`] | all-to-all (split one dim, concat another) | the inverse all-to-all |
//! | [`send`] / [`recv`] | point-to-point | the gradient travels back |
//! | [`ring_shift`] | send to `rank + k`, receive from `rank - k` | the opposite shift |
//!
//! How it works: the forward communication is an ordinary (fallible) collective on
//! [`ProcessGroup`]; its result is then attached to the autodiff graph of the input by one
//! backend-extension operation ([`CommBackend::attach_backward`]) whose backward step runs the
//! conjugate collective on the incoming gradient.
//!
//! Burn's backward pass cannot return errors, so a collective that fails *during backward*
//! records its [`CollectiveError`] for the calling thread (the one running the backward) and
//! gives its input a zero gradient; the collectives later in the same backward then skip their
//! communication (the step is lost anyway, and the peers must not wait for this rank).
//! [`backward`] runs `loss.backward()` and returns that error: every step of this crate and of
//! its sibling crates goes through it, and a loop of your own should too (or call
//! [`take_backward_error`] after `loss.backward()`): the gradients of a failed backward are not
//! to be applied.
//!
//! Every rank must own its parameters (no autodiff node shared between thread ranks).

// Burn 0.22 deprecates its NdArray backend; supporting it (feature `ndarray`) is deliberate.
#![cfg_attr(feature = "ndarray", allow(deprecated))]

use std::fmt;
use std::sync::Arc;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, Flex, TensorMetadata, backend_extension, try_read_sync};
use burn::tensor::{DispatchTensor, Tensor, TensorData};

use crate::comm::host::ReduceOp;
use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;

/// The backward step of a differentiable collective: maps the output gradient (host data) to
/// the input gradient.
#[derive(Clone)]
pub struct BackwardFn {
    name: &'static str,
    /// The forward input's shape and dtype (set by [`attach`]): a failed backward gives it a
    /// zero gradient of that shape.
    input: Option<(burn::tensor::Shape, burn::tensor::DType)>,
    f: Arc<dyn Fn(TensorData) -> Result<TensorData> + Send + Sync>,
    /// The same map on the gradient as a tensor on its device, when given
    /// ([`BackwardFn::on_device`]): used instead of `f`, so the gradient stays on the device.
    device: Option<Arc<dyn Fn(DispatchTensor) -> Result<DispatchTensor> + Send + Sync>>,
}

impl BackwardFn {
    /// Wraps a closure on the gradient's host data; `name` appears in panic messages.
    pub fn new(
        name: &'static str,
        f: impl Fn(TensorData) -> Result<TensorData> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            input: None,
            f: Arc::new(f),
            device: None,
        }
    }

    /// Also gives the map on the gradient as a tensor of rank `D` on its (non-autodiff)
    /// device, used instead of the host closure: for collectives that run in device memory
    /// (NCCL), so the gradient never leaves the device. Both must compute the same thing.
    pub fn on_device<const D: usize>(
        mut self,
        f: impl Fn(Tensor<D>) -> Result<Tensor<D>> + Send + Sync + 'static,
    ) -> Self {
        self.device = Some(Arc::new(move |grad| {
            f(Tensor::<D>::from_dispatch(grad)).map(Tensor::into_dispatch)
        }));
        self
    }

    /// A backward made of tensor operations (and tensor-level collectives), run on the
    /// gradient where it lives, never read to the host: `f` maps the gradient, a tensor of rank
    /// `D` on the (non-autodiff) `device` of the forward's input. Should Burn hand the step a
    /// gradient as host data, it is put on `device` first.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::autograd::{BackwardFn, attach};
    ///
    /// let device = Device::flex().autodiff();
    /// let x = Tensor::<1>::from_floats([1.0, 2.0], &device).require_grad();
    /// // y = x, but the backward doubles the gradient.
    /// let double = BackwardFn::on_tensors::<1>("double", device.clone().inner(), |g| Ok(g * 2.0));
    /// let y = attach(x.clone(), x.clone().detach(), double);
    /// let grads = y.sum().backward();
    /// assert_eq!(x.grad(&grads).unwrap().to_data().to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
    /// ```
    pub fn on_tensors<const D: usize>(
        name: &'static str,
        device: burn::tensor::Device,
        f: impl Fn(Tensor<D>) -> Result<Tensor<D>> + Send + Sync + 'static,
    ) -> Self {
        let f = Arc::new(f);
        let on_host = f.clone();
        Self::new(name, move |grad| {
            Ok(on_host(crate::group::tensor_from_data(grad, &device))?.into_data())
        })
        .on_device::<D>(move |grad| f(grad))
    }

    /// [`BackwardFn::on_device`] when `on`, else `self`: pass
    /// [`ProcessGroup::collects_on_device`] of the gradient's device, so the gradient stays on
    /// the device exactly when the group's collectives run there.
    pub fn on_device_if<const D: usize>(
        self,
        on: bool,
        f: impl Fn(Tensor<D>) -> Result<Tensor<D>> + Send + Sync + 'static,
    ) -> Self {
        if on { self.on_device(f) } else { self }
    }
}

impl fmt::Debug for BackwardFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BackwardFn({})", self.name)
    }
}

/// The backend extension behind the differentiable collectives.
///
/// `attach_backward(x, y, f)` returns `y`; under autodiff it records a step whose backward
/// turns the gradient of `y` into the gradient of `x` with `f`. On non-autodiff backends it is
/// the identity on `y`.
///
/// It is declared for every backend this crate can be built with: Flex always, NdArray with the
/// `ndarray` feature, and the CubeCL backend (WGPU, CUDA, the LLVM CPU runtime) with `wgpu`,
/// `cuda` or `cpu`. [`check_device`] tells at run time, with a typed error, whether a device's
/// backend is among them.
#[backend_extension(
    Flex,
    Autodiff,
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "cube")
)]
pub trait CommBackend: burn::backend::Backend {
    /// Returns `y`, recording `backward` as the gradient map from `y` to `x`.
    fn attach_backward(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        backward: BackwardFn,
    ) -> FloatTensor<Self> {
        let _ = (x, backward);
        y
    }
}

impl CommBackend for Flex {}
#[cfg(feature = "ndarray")]
impl CommBackend for burn::backend::NdArray {}
#[cfg(feature = "cube")]
impl CommBackend for burn::backend::Cube {}

/// Moves a gradient between a backend's primitive and Burn's dispatch tensor, so that a
/// [`BackwardFn::on_device`] map can run tensor operations (and device collectives) on it.
pub trait GradDispatch: burn::backend::Backend {
    /// The gradient as a dispatch tensor (no copy).
    fn grad_to_dispatch(grad: FloatTensor<Self>) -> DispatchTensor;
    /// The dispatch tensor's primitive on this backend.
    ///
    /// # Panics
    /// When the tensor lives on another backend (a map that moved it).
    fn grad_from_dispatch(grad: DispatchTensor) -> FloatTensor<Self>;
}

macro_rules! grad_dispatch {
    ($backend:ty) => {
        impl GradDispatch for $backend {
            fn grad_to_dispatch(grad: FloatTensor<Self>) -> DispatchTensor {
                Tensor::<1>::from_primitive::<$backend>(grad).into_dispatch()
            }
            fn grad_from_dispatch(grad: DispatchTensor) -> FloatTensor<Self> {
                Tensor::<1>::from_dispatch(grad)
                    .try_into_primitive::<$backend>()
                    .expect("a device map returns its gradient on the backend it received it")
            }
        }
    };
}

grad_dispatch!(Flex);
#[cfg(feature = "ndarray")]
grad_dispatch!(burn::backend::NdArray);
#[cfg(feature = "cube")]
grad_dispatch!(burn::backend::Cube);

/// Checks that the differentiable collectives (and so every technique built on them) can run on
/// `device`'s backend in this build.
///
/// # Errors
/// [`CollectiveError::UnsupportedBackend`] naming the device and the cargo feature of
/// `burn-parallel` that adds its backend.
///
/// # Example
/// ```
/// use burn::tensor::Device;
/// burn_parallel::autograd::check_device(&Device::flex().autodiff()).unwrap();
/// ```
pub fn check_device(device: &burn::tensor::Device) -> Result<()> {
    use burn::backend::DispatchDevice;
    let inner = device.as_dispatch().clone().inner();
    match inner {
        DispatchDevice::Flex(_) => Ok(()),
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => Ok(()),
        #[cfg(feature = "cube")]
        DispatchDevice::Cube(_) => Ok(()),
        #[allow(unreachable_patterns)]
        other => Err(CollectiveError::UnsupportedBackend {
            device: format!("{other:?}"),
            hint: "build burn-parallel with the feature of that backend: `ndarray` for NdArray, \
                   `wgpu`, `cuda` or `cpu` for the CubeCL backends (LibTorch and Remote are not \
                   supported)"
                .into(),
        }),
    }
}

#[derive(Debug)]
struct CommBackward;

impl<B: CommBackend + GradDispatch> Backward<B, 1> for CommBackward {
    type State = BackwardFn;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(parent) = parent else { return };
        let device = grad.device();
        let state = &ops.state;
        // After a failure in this backward: no more communication, zero gradients.
        let grad_in = if failed() {
            None
        } else if let Some(f) = &state.device {
            f(B::grad_to_dispatch(grad))
                .map(B::grad_from_dispatch)
                .map_err(fail)
                .ok()
        } else {
            match try_read_sync(B::float_into_data(grad)) {
                Some(Ok(data)) => (state.f)(data)
                    .map(|g| B::float_from_data(g, &device))
                    .map_err(fail)
                    .ok(),
                _ => {
                    fail(CollectiveError::InvalidArgument {
                        rank: 0,
                        op: state.name.into(),
                        reason: "this rank could not read the gradient to the host".into(),
                    });
                    None
                }
            }
        };
        let grad_in = grad_in.unwrap_or_else(|| {
            let (shape, dtype) = state
                .input
                .clone()
                .expect("attach records the input's shape and dtype");
            B::float_zeros(shape, &device, dtype.into())
        });
        grads.register::<B>(parent.id, grad_in);
    }
}

impl<B: CommBackend + GradDispatch, C: CheckpointStrategy> CommBackend for Autodiff<B, C> {
    fn attach_backward(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        mut backward: BackwardFn,
    ) -> FloatTensor<Self> {
        backward.input = Some((x.shape(), x.dtype()));
        let y = y.into_primitive();
        match CommBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(backward, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

std::thread_local! {
    /// The first collective error of the backward pass running on this thread.
    static BACKWARD_ERROR: std::cell::RefCell<Option<CollectiveError>> =
        const { std::cell::RefCell::new(None) };
}

/// Whether a collective already failed in this thread's backward.
fn failed() -> bool {
    BACKWARD_ERROR.with(|e| e.borrow().is_some())
}

/// Records the error of a backward step (the first one is kept).
fn fail(error: CollectiveError) {
    BACKWARD_ERROR.with(|e| {
        e.borrow_mut().get_or_insert(error);
    });
}

/// Takes the error of a collective that failed in a backward pass run on this thread since
/// the last call (see the [module docs](self)); `None` when none failed.
pub fn take_backward_error() -> Option<CollectiveError> {
    BACKWARD_ERROR.with(|e| e.borrow_mut().take())
}

/// `loss.backward()`, with the error of a collective that failed inside it.
///
/// # Errors
/// The first [`CollectiveError`] of a collective in the backward (a dead peer, a timeout, a
/// mismatch); the gradients are then not returned, since some are zeros.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{autograd, run_local};
///
/// run_local(2, |group| {
///     let device = Device::flex().autodiff();
///     let x = Tensor::<1>::from_floats([1.0, 2.0], &device).require_grad();
///     let y = autograd::copy_to_group(x.clone(), &group);
///     let grads = autograd::backward(y.sum())?; // all-reduce of the gradient inside
///     assert_eq!(x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
///     Ok(())
/// })
/// .unwrap();
/// ```
pub fn backward(loss: Tensor<1>) -> Result<burn::tensor::Gradients> {
    // A stale error of an earlier backward whose caller did not check belongs to that step.
    let _ = take_backward_error();
    let grads = loss.backward();
    match take_backward_error() {
        Some(e) => Err(e),
        None => Ok(grads),
    }
}

/// Returns `y` with `backward` as the gradient map from `y` to `x`: the building block of every
/// function of this module, public so that other crates can split a collective into an
/// asynchronous communication (for example an FSDP prefetch) and the later attachment of its
/// backward.
///
/// `y` must not depend on `x` through the autodiff graph (compute it from `x`'s host data);
/// `backward` receives the gradient of `y` and returns the gradient of `x`, with `x`'s shape.
pub fn attach<const D: usize, const E: usize>(
    x: Tensor<D>,
    y: Tensor<E>,
    backward: BackwardFn,
) -> Tensor<E> {
    if !x.is_tracked() {
        return y;
    }
    Tensor::from_dispatch(Dispatch::attach_backward(
        x.into_dispatch(),
        y.into_dispatch(),
        backward,
    ))
}

/// The host data of a tensor, detached from any graph.
fn host<const D: usize>(x: &Tensor<D>) -> TensorData {
    x.clone().into_data()
}

fn to_device<const D: usize>(data: TensorData, like: &Tensor<D>) -> Tensor<D> {
    crate::group::tensor_from_data(data, &like.device())
}

/// Sizes of `total` units split over `n` ranks as evenly as possible (the first ranks get one
/// more), the split used by [`scatter_to_group`] and [`gather_from_group`].
pub fn even_split(total: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|k| total / n + usize::from(k < total % n))
        .collect()
}

/// Megatron's *f*: identity forward, gradient all-reduced (summed) over `group` in backward.
/// Put it where a replicated activation enters a tensor-parallel region.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{autograd::copy_to_group, run_local};
///
/// let grads = run_local(2, |group| {
///     let device = Device::flex().autodiff();
///     let x = Tensor::<1>::from_floats([1.0, 2.0], &device).require_grad();
///     let y = copy_to_group(x.clone(), &group);
///     let grads = (y * (group.rank() as f32 + 1.0)).sum().backward();
///     Ok(x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap())
/// })
/// .unwrap();
/// assert_eq!(grads[0], vec![3.0, 3.0]); // 1 + 2 from the two ranks
/// ```
pub fn copy_to_group<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    let (g, gd) = (group.clone(), group.clone());
    let on_device = group.collects_on_device(&x.device());
    let y = x.clone().detach();
    attach(
        x,
        y,
        BackwardFn::new("copy_to_group", move |grad| {
            g.all_reduce_data(grad, ReduceOp::Sum)
        })
        .on_device_if::<D>(on_device, move |grad| gd.all_reduce(grad, ReduceOp::Sum)),
    )
}

/// The all-gather of `x`'s value along `dim` ([`forward_collective`]).
fn gather_forward<const D: usize>(
    group: &ProcessGroup,
    x: &Tensor<D>,
    dim: usize,
) -> Result<Tensor<D>> {
    forward_collective(
        group,
        x,
        |t| group.all_gather(t, dim),
        |d| group.all_gather_data(d, dim),
    )
}

/// A collective on `x`'s value, detached from its graph: with the group's tensor-level
/// collective `on_device` when the group collects on `x`'s device
/// ([`ProcessGroup::collects_on_device`]), else on its host data.
fn forward_collective<const D: usize>(
    group: &ProcessGroup,
    x: &Tensor<D>,
    on_device: impl FnOnce(Tensor<D>) -> Result<Tensor<D>>,
    on_host: impl FnOnce(TensorData) -> Result<TensorData>,
) -> Result<Tensor<D>> {
    if group.collects_on_device(&x.device()) {
        on_device(x.clone().detach())
    } else {
        Ok(to_device(on_host(host(x))?, x))
    }
}

/// Megatron's *g*: all-reduce (sum) forward, identity backward. Put it where the partial
/// outputs of a row-parallel layer leave a tensor-parallel region.
///
/// # Errors
/// When the forward all-reduce fails (see [`CollectiveError`]).
pub fn reduce_from_group<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Result<Tensor<D>> {
    let y = forward_collective(
        group,
        &x,
        |t| group.all_reduce(t, ReduceOp::Sum),
        |d| group.all_reduce_data(d, ReduceOp::Sum),
    )?;
    let on_device = group.collects_on_device(&x.device());
    let backward = BackwardFn::new("reduce_from_group", Ok).on_device_if::<D>(on_device, Ok);
    Ok(attach(x, y, backward))
}

fn check_dim<const D: usize>(group: &ProcessGroup, op: &str, dim: usize) -> Result<()> {
    if dim < D {
        Ok(())
    } else {
        Err(CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: op.into(),
            reason: format!("dim {dim} is out of range for a tensor of rank {D}"),
        })
    }
}

/// This rank's slice of `x` along `dim` (sizes from [`even_split`]).
fn local_slice<const D: usize>(x: Tensor<D>, group: &ProcessGroup, dim: usize) -> Tensor<D> {
    let sizes = even_split(x.dims()[dim], group.size());
    let start: usize = sizes[..group.rank()].iter().sum();
    x.narrow(dim, start, sizes[group.rank()])
}

/// Keeps this rank's slice of a replicated `x` along `dim` (an even split, the first ranks one
/// larger when it does not divide); the backward all-gathers the gradient.
///
/// # Errors
/// When `dim` is out of range.
pub fn scatter_to_group<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(group, "scatter_to_group", dim)?;
    let y = local_slice(x.clone().detach(), group, dim);
    let (g, gd) = (group.clone(), group.clone());
    let on_device = group.collects_on_device(&x.device());
    Ok(attach(
        x,
        y,
        BackwardFn::new("scatter_to_group", move |grad| g.all_gather_data(grad, dim))
            .on_device_if::<D>(on_device, move |grad| gd.all_gather(grad, dim)),
    ))
}

/// All-gathers `x` along `dim` (shards may differ in size); the backward keeps this rank's
/// slice of the gradient.
///
/// # Errors
/// When the forward all-gather fails.
pub fn gather_from_group<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(group, "gather_from_group", dim)?;
    let y = gather_forward(group, &x, dim)?;
    let (start, len) = shard_range(group, &x, dim)?;
    let device = x.device();
    let on_device = group.collects_on_device(&device);
    Ok(attach(
        x,
        y,
        BackwardFn::new("gather_from_group", move |grad| {
            let g = crate::group::tensor_from_data::<D>(grad, &device);
            Ok(g.narrow(dim, start, len).into_data())
        })
        .on_device_if::<D>(on_device, move |grad| Ok(grad.narrow(dim, start, len))),
    ))
}

/// Where this rank's shard starts in the gathered tensor, and its length (one small
/// all-gather of the shard sizes).
fn shard_range<const D: usize>(
    group: &ProcessGroup,
    x: &Tensor<D>,
    dim: usize,
) -> Result<(usize, usize)> {
    let len = x.dims()[dim];
    let sizes = group.all_gather_object(&len)?;
    Ok((sizes[..group.rank()].iter().sum(), len))
}

/// Sequence parallelism's entry: all-gathers `x` along `dim` forward; the backward
/// reduce-scatters (sums) the gradient back to the shards.
///
/// # Errors
/// When the forward all-gather fails.
pub fn gather_from_sequence<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(group, "gather_from_sequence", dim)?;
    let sizes = group.all_gather_object(&x.dims()[dim])?;
    let y = gather_forward(group, &x, dim)?;
    let (g, gd) = (group.clone(), group.clone());
    let on_device = group.collects_on_device(&x.device());
    let device_sizes = sizes.clone();
    Ok(attach(
        x,
        y,
        BackwardFn::new("gather_from_sequence", move |grad| {
            g.reduce_scatter_data(grad, dim, ReduceOp::Sum, Some(&sizes))
        })
        .on_device_if::<D>(on_device, move |grad| {
            gd.reduce_scatter(grad, dim, ReduceOp::Sum, Some(&device_sizes))
        }),
    ))
}

/// Sequence parallelism's exit: reduce-scatters (sums) `x` along `dim` forward (an even split,
/// or `sizes` per rank); the backward all-gathers the gradient.
///
/// # Errors
/// When the forward reduce-scatter fails (for example a dimension not divisible by the group
/// size without `sizes`).
pub fn reduce_scatter_to_sequence<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Tensor<D>> {
    check_dim::<D>(group, "reduce_scatter_to_sequence", dim)?;
    let y = forward_collective(
        group,
        &x,
        |t| group.reduce_scatter(t, dim, ReduceOp::Sum, sizes),
        |d| group.reduce_scatter_data(d, dim, ReduceOp::Sum, sizes),
    )?;
    let (g, gd) = (group.clone(), group.clone());
    let on_device = group.collects_on_device(&x.device());
    Ok(attach(
        x,
        y,
        BackwardFn::new("reduce_scatter_to_sequence", move |grad| {
            g.all_gather_data(grad, dim)
        })
        .on_device_if::<D>(on_device, move |grad| gd.all_gather(grad, dim)),
    ))
}

/// All-to-all: splits `x` along `split_dim` into `send_sizes[k]` slices, sends slice `k` to rank
/// `k`, and concatenates what arrives along `concat_dim` in rank order (expert parallelism's
/// dispatch when both dims are the token dim; Ulysses' head/sequence swap when they differ).
/// The backward is the inverse all-to-all.
///
/// # Errors
/// When the sizes do not add up, or the forward all-to-all fails.
pub fn all_to_all<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    split_dim: usize,
    send_sizes: &[usize],
    concat_dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(group, "all_to_all", split_dim)?;
    check_dim::<D>(group, "all_to_all", concat_dim)?;
    if split_dim == concat_dim && group.collects_on_device(&x.device()) {
        // Expert parallelism's exchange on the device. What each rank receives is what the
        // others send it: one small exchange of the send sizes gives the backward's sizes.
        let dim = split_dim;
        let sent: Vec<Vec<usize>> = group.all_gather_object(&send_sizes.to_vec())?;
        let recv_sizes: Vec<usize> = sent.iter().map(|s| s[group.rank()]).collect();
        let y = group.all_to_all(x.clone().detach(), dim, send_sizes)?;
        let (g, gd, host_sizes) = (group.clone(), group.clone(), recv_sizes.clone());
        return Ok(attach(
            x,
            y,
            BackwardFn::new("all_to_all", move |grad| {
                g.all_to_all_data(grad, dim, &host_sizes)
            })
            .on_device::<D>(move |grad| gd.all_to_all(grad, dim, &recv_sizes)),
        ));
    }
    let n = group.size();
    let piece = x.dims()[split_dim] / n.max(1);
    if group.collects_on_device(&x.device())
        && send_sizes.len() == n
        && send_sizes.iter().all(|&s| s == piece)
        && piece * n == x.dims()[split_dim]
    {
        // Ulysses' swap on the device, with even pieces: laid side by side along `concat_dim`,
        // the pieces make it one all-to-all along that dim; the backward is the same swap back.
        let y = swap_dims_all_to_all(group, x.clone().detach(), split_dim, concat_dim)?;
        let (g, gd) = (group.clone(), group.clone());
        let width = x.dims()[concat_dim];
        let recv_sizes = vec![width; n];
        return Ok(attach(
            x,
            y,
            BackwardFn::new("all_to_all", move |grad| {
                g.all_to_all_dims_data(grad, concat_dim, &recv_sizes, split_dim)
                    .map(|(data, _)| data)
            })
            .on_device::<D>(move |grad| swap_dims_all_to_all(&gd, grad, concat_dim, split_dim)),
        ));
    }
    let (out, recv_sizes) =
        group.all_to_all_dims_data(host(&x), split_dim, send_sizes, concat_dim)?;
    let y = to_device(out, &x);
    let g = group.clone();
    Ok(attach(
        x,
        y,
        BackwardFn::new("all_to_all", move |grad| {
            g.all_to_all_dims_data(grad, concat_dim, &recv_sizes, split_dim)
                .map(|(data, _)| data)
        }),
    ))
}

/// The all-to-all that cuts `x` into `group.size()` even pieces along `split_dim` and
/// concatenates what arrives along `concat_dim`, as the group's tensor-level all-to-all along
/// `concat_dim` (on the device where the group collects there): the pieces are laid side by
/// side along `concat_dim` first. Every rank's `x` has the same shape.
fn swap_dims_all_to_all<const D: usize>(
    group: &ProcessGroup,
    x: Tensor<D>,
    split_dim: usize,
    concat_dim: usize,
) -> Result<Tensor<D>> {
    let n = group.size();
    let piece = x.dims()[split_dim] / n;
    let width = x.dims()[concat_dim];
    let pieces = (0..n)
        .map(|k| x.clone().narrow(split_dim, k * piece, piece))
        .collect();
    group.all_to_all(Tensor::cat(pieces, concat_dim), concat_dim, &vec![width; n])
}

/// Sends `x` to group rank `peer` under `tag` and returns a one-element zero tensor that
/// depends on `x`: calling `backward` on it (or on a loss that includes it) receives the
/// gradient of `x` from `peer`, where the matching [`recv`] output was used.
///
/// # Errors
/// When the send fails.
pub fn send<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    peer: usize,
    tag: u64,
) -> Result<Tensor<1>> {
    group.send_data(host(&x), peer, tag)?;
    let token = Tensor::<1>::zeros([1], &x.device());
    let g = group.clone();
    Ok(attach(
        x,
        token,
        BackwardFn::new("send", move |_| g.recv_data(peer, tag)),
    ))
}

/// Receives a tensor of rank `D` from group rank `peer` under `tag`. `anchor` is any tensor of
/// the receiving rank's graph (its value is ignored): it carries the autodiff graph, so that
/// the backward of a loss using the output sends the output's gradient back to `peer`.
///
/// # Errors
/// When the receive fails or the tensor is not of rank `D`.
pub fn recv<const D: usize>(
    anchor: Tensor<1>,
    group: &ProcessGroup,
    peer: usize,
    tag: u64,
) -> Result<Tensor<D>> {
    let y: Tensor<D> = group.recv(peer, tag, &anchor.device())?;
    let g = group.clone();
    let anchor_len = anchor.dims()[0];
    Ok(attach(
        anchor,
        y,
        BackwardFn::new("recv", move |grad| {
            g.send_data(grad, peer, tag)?;
            Ok(TensorData::new(vec![0f32; anchor_len], [anchor_len]))
        }),
    ))
}

/// Ring shift: sends `x` to rank `rank + offset` and returns the tensor received from rank
/// `rank - offset` (modulo the group size); the backward shifts the gradient the other way.
/// Ring attention passes key/value blocks around with it.
///
/// # Errors
/// When a send or receive fails.
pub fn ring_shift<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    offset: usize,
    tag: u64,
) -> Result<Tensor<D>> {
    let n = group.size();
    let offset = offset % n;
    if offset == 0 {
        return Ok(x);
    }
    let to = (group.rank() + offset) % n;
    let from = (group.rank() + n - offset) % n;
    group.send_data(host(&x), to, tag)?;
    let y = to_device(group.recv_data(from, tag)?, &x);
    let g = group.clone();
    Ok(attach(
        x,
        y,
        BackwardFn::new("ring_shift", move |grad| {
            g.send_data(grad, from, tag)?;
            g.recv_data(to, tag)
        }),
    ))
}

/// Where a layer's deferred weight gradients go: the pipeline's store of a zero-bubble
/// schedule's `W` step (`burn_pipeline::deferred::WeightGradStore`).
pub trait WeightGradSink: Send + Sync + fmt::Debug {
    /// Records `compute`, one contribution to `param`'s gradient, for later.
    fn defer(&self, param: burn::module::ParamId, compute: Box<dyn FnOnce() -> Tensor<2> + Send>);
}

/// `x W` for `x` `[rows, d_in]` and `weight` `[d_in, d_out]` whose backward computes the input
/// gradient `dX = dY Wᵀ` at once and defers the weight gradient `dW = Xᵀ dY` to `sink`: the
/// weight gets no gradient from `backward()` (the split backward of zero-bubble schedules).
/// When the weight does not require a gradient (a module in `valid()` mode, a frozen weight),
/// this is the plain product.
///
/// The product and the gradients go through host data ([`attach`]'s backward is host data).
pub fn deferred_matmul(
    x: Tensor<2>,
    weight: &burn::module::Param<Tensor<2>>,
    sink: Arc<dyn WeightGradSink>,
) -> Tensor<2> {
    let w = weight.val();
    if !w.is_require_grad() {
        return x.matmul(w);
    }
    let w = w.without_autodiff();
    let device = w.device();
    let x_inner = x.clone().without_autodiff();
    let y = x_inner.clone().matmul(w.clone());
    let y = crate::group::tensor_from_data::<2>(y.into_data(), &x.device());
    let param = weight.id;
    // The backward step must run even when the input needs no gradient (the first layer of
    // the first stage): it then hangs off a fresh one-element leaf, whose gradient (zero)
    // nobody reads.
    let needs_dx = x.is_tracked();
    let record = move |dy| {
        let dy: Tensor<2> = crate::group::tensor_from_data(dy, &device);
        let dx = needs_dx.then(|| dy.clone().matmul(w.clone().transpose()));
        let x = x_inner.clone();
        sink.defer(param, Box::new(move || x.transpose().matmul(dy)));
        dx
    };
    if needs_dx {
        attach(
            x,
            y,
            BackwardFn::new("deferred_matmul", move |dy| {
                Ok(record(dy).expect("dX is computed").into_data())
            }),
        )
    } else {
        let anchor = Tensor::<1>::zeros([1], &x.device()).require_grad();
        attach(
            anchor,
            y,
            BackwardFn::new("deferred_matmul", move |dy| {
                record(dy);
                Ok(TensorData::new(vec![0f32], [1]))
            }),
        )
    }
}

/// Sequence parallelism's entry for column-parallel products that keep only the sequence
/// shard (Megatron's saving): the shard `x` is all-gathered once along `dim` for the forward
/// products, but the autodiff graph keeps only `x`; each product's backward all-gathers the
/// shard again for its weight gradient and reduce-scatters its input gradient back to the
/// shard. Use it for the projections that share one input (attention's `q`, `k`, `v`).
///
/// Every rank must apply the same products in the same order (the backward collectives then
/// match, as the autodiff graph's order is the same on every rank).
#[derive(Debug, Clone)]
pub struct GatheredSequence<const D: usize> {
    /// This rank's shard, in the autodiff graph.
    shard: Tensor<D>,
    /// The whole sequence, detached: only the forward products read it.
    full: Tensor<D>,
    /// Every rank's shard length along `dim`.
    sizes: Vec<usize>,
    group: ProcessGroup,
    dim: usize,
}

impl<const D: usize> GatheredSequence<D> {
    /// All-gathers the sequence shard `x` along `dim` over `group`, once.
    ///
    /// # Arguments
    /// - `x`: this rank's shard of the sequence (for example `[batch, tokens, features]`).
    /// - `group`: the sequence-parallel group; `dim`: the sequence dimension.
    ///
    /// # Returns
    /// The gathered sequence, ready for [`Self::linear`].
    ///
    /// # Errors
    /// When `dim` is out of range or the all-gather fails.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::autograd::GatheredSequence;
    /// use burn_parallel::run_local;
    ///
    /// let out = run_local(2, |group| {
    ///     let device = Device::flex().autodiff();
    ///     let x = Tensor::<3>::ones([1, 2, 3], &device).require_grad();
    ///     let w = Tensor::<2>::ones([3, 4], &device).require_grad();
    ///     let gathered = GatheredSequence::new(x.clone(), &group, 1)?;
    ///     let y = gathered.linear(w.clone(), None); // [1, 4, 4]: the whole sequence
    ///     let grads = y.sum().backward();
    ///     Ok((
    ///         x.grad(&grads).unwrap().dims(),
    ///         w.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap()[0],
    ///     ))
    /// })
    /// .unwrap();
    /// assert_eq!(out[0].0, [1, 2, 3]); // the shard's gradient
    /// assert_eq!(out[0].1, 4.0); // the 4 tokens of the whole sequence
    /// ```
    pub fn new(x: Tensor<D>, group: &ProcessGroup, dim: usize) -> Result<Self> {
        check_dim::<D>(group, "GatheredSequence", dim)?;
        let sizes = group.all_gather_object(&x.dims()[dim])?;
        let full = gather_forward(group, &x, dim)?
            // Off the autodiff backend: an untracked autodiff operation reading it would keep it
            // alive with the graph (burn-autodiff registers untracked steps too).
            .without_autodiff();
        Ok(Self {
            shard: x,
            full,
            sizes,
            group: group.clone(),
            dim,
        })
    }

    /// The whole sequence, on the inner (non-autodiff) backend: what the products read.
    pub fn full(&self) -> Tensor<D> {
        self.full.clone()
    }

    /// `x_full W (+ b)` over the whole sequence, `weight` `[d_in, d_out]`, keeping only the
    /// shard for the backward: the weight's gradient is `x_fullᵀ dY` with `x_full` all-gathered
    /// again, the shard's the reduce-scatter (sum) of `dY Wᵀ`; the bias's is autodiff's.
    ///
    /// # Panics
    /// When `weight` does not take the input's features (callers check the shapes); during the
    /// backward, when a collective fails (see the module docs).
    pub fn linear(&self, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<D> {
        // The product off the autodiff backend (nothing of it is kept), then back on it.
        let y = crate::kernels::linear(self.full.clone(), weight.clone().without_autodiff(), None)
            .unwrap_or_else(|e| panic!("sequence-parallel linear: {e}"));
        let y = if self.shard.is_autodiff() {
            y.autodiff()
        } else {
            y
        };
        let dims = y.dims();
        let n = dims[D - 1];
        let k = self.full.dims()[D - 1];
        let rows = |t: &Tensor<D>| t.dims()[..D - 1].iter().product::<usize>();
        let (dim, group) = (self.dim, self.group.clone());
        let on_device = group.collects_on_device(&self.shard.device());
        let mut y = y;
        if weight.is_tracked() {
            // dW = x_fullᵀ dY, the shard all-gathered again.
            let shard = self.shard.clone().without_autodiff();
            let w_device = weight.device().without_autodiff();
            let g = group.clone();
            let d_weight = move |dy: Tensor<D>| -> Result<Tensor<2>> {
                let full = if on_device {
                    g.all_gather(shard.clone(), dim)?
                } else {
                    to_device(g.all_gather_data(host(&shard), dim)?, &shard)
                };
                let r = rows(&full);
                let dy = dy.reshape([r, n]);
                Ok(full.reshape([r, k]).transpose().matmul(dy))
            };
            let d_weight = Arc::new(d_weight);
            let host_fn = d_weight.clone();
            let device_fn = d_weight;
            let backward = BackwardFn {
                name: "sequence-parallel linear (weight)",
                input: None,
                f: Arc::new(move |dy: TensorData| {
                    let dy = crate::group::tensor_from_data::<D>(dy, &w_device);
                    host_fn(dy).map(|dw| dw.into_data())
                }),
                device: on_device.then(|| {
                    Arc::new(move |dy: DispatchTensor| {
                        device_fn(Tensor::<D>::from_dispatch(dy)).map(Tensor::into_dispatch)
                    })
                        as Arc<dyn Fn(DispatchTensor) -> Result<DispatchTensor> + Send + Sync>
                }),
            };
            y = attach(weight.clone(), y, backward);
        }
        if self.shard.is_tracked() {
            // dX = reduce-scatter(dY Wᵀ) back to the shard.
            let w = weight.without_autodiff();
            let sizes = self.sizes.clone();
            let full_dims = self.full.dims();
            let g = group.clone();
            let d_input = move |dy: Tensor<D>| -> Result<Tensor<D>> {
                let r = rows(&dy);
                let dx = dy
                    .reshape([r, n])
                    .matmul(w.clone().transpose())
                    .reshape(full_dims);
                if on_device {
                    g.reduce_scatter(dx, dim, ReduceOp::Sum, Some(&sizes))
                } else {
                    let out = g.reduce_scatter_data(host(&dx), dim, ReduceOp::Sum, Some(&sizes))?;
                    Ok(to_device(out, &dx))
                }
            };
            let d_input = Arc::new(d_input);
            let (host_fn, device_fn) = (d_input.clone(), d_input);
            let device = self.shard.device().without_autodiff();
            let backward = BackwardFn::new("sequence-parallel linear (input)", move |dy| {
                let dy = crate::group::tensor_from_data::<D>(dy, &device);
                host_fn(dy).map(|dx| dx.into_data())
            })
            .on_device_if::<D>(on_device, move |dy| device_fn(dy));
            // The input's gradient hangs off a zero added to the product (a transient).
            let zero = Tensor::<D>::zeros(dims, (&y.device(), y.dtype()));
            y = y + attach(self.shard.clone(), zero, backward);
        }
        match bias {
            Some(b) => y + b.unsqueeze(),
            None => y,
        }
    }
}
