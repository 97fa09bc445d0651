//! Data parallelism: every rank holds the whole model, trains on its slice of the global batch,
//! and averages gradients with bucketed, flat all-reduces before the optimizer step.
//!
//! The usual loop:
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{GradientsParams, Optimizer, SgdConfig};
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::{DistributedDataParallel, run_local};
//!
//! run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     let ddp = DistributedDataParallel::new(group.clone());
//!     // Identical replicas: broadcast rank 0's initial weights.
//!     let mut model: Linear = ddp.broadcast_module(LinearConfig::new(4, 1).init(&device), 0)?;
//!     let mut optim = SgdConfig::new().init();
//!     let x = Tensor::<2>::ones([8, 4], &device) * (group.rank() as f32 + 1.0);
//!     let loss = model.forward(x).powf_scalar(2.0).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     let grads = ddp.all_reduce_grads(&model, grads)?; // averaged over ranks
//!     model = optim.step(0.1, model, grads);
//!     Ok(())
//! })
//! .unwrap();
//! ```
//!
//! With gradient accumulation, scale each micro-batch's loss by `1 / k`, sum the gradients
//! locally with Burn's [`GradientsAccumulator`](burn::optim::GradientsAccumulator) and call
//! [`DistributedDataParallel::all_reduce_grads`] once, after the last micro-batch:
//! [`TrainStep::step_accumulated`](crate::train::TrainStep::step_accumulated) does exactly that.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};

use crate::comm::host::ReduceOp;
use crate::comm::pool;
use crate::error::{CollectiveError, Result};
use crate::group::{ProcessGroup, tensor_from_data};
use crate::index::{ParamEntry, ParamIndex};
use crate::replica::ReplicaError;

/// Default bucket size of the gradient all-reduce: 25 MB, as in PyTorch DDP.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// Where [`DistributedDataParallel`] forms and reduces its gradient buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BucketPlace {
    /// On the device when the group collects there ([`ProcessGroup::collects_on_device`]:
    /// NCCL with CUDA gradients), else in host memory.
    #[default]
    Auto,
    /// In host memory: gradients are copied into pooled flat buffers, and a communication
    /// thread reduces each bucket while the next is packed. The fastest on CPU backends.
    Host,
    /// As tensors on the gradients' device: each bucket is concatenated there, reduced with
    /// the group's tensor collective ([`ProcessGroup::all_reduce`]) and sliced back. With NCCL
    /// the gradients never leave the GPU; elsewhere the collective stages the bucket through
    /// host memory, with the same result as [`BucketPlace::Host`].
    Device,
}

/// Data-parallel training over a process group.
#[derive(Debug, Clone)]
pub struct DistributedDataParallel {
    group: ProcessGroup,
    bucket_bytes: usize,
    place: BucketPlace,
    /// The dtype gradients travel and are averaged in (`None`: each parameter's own).
    reduce_dtype: Option<DType>,
}

impl DistributedDataParallel {
    /// Data parallelism over `group` with the default bucket size.
    pub fn new(group: ProcessGroup) -> Self {
        Self {
            group,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            place: BucketPlace::Auto,
            reduce_dtype: None,
        }
    }

    /// Averages the gradients in `dtype` (bf16 or f16 halve the bytes on the wire; `F32` for
    /// exact fp32 sums of low-precision gradients): each gradient is cast to it before its
    /// bucket is reduced and back to its parameter's dtype after. By default every gradient
    /// is reduced in its parameter's dtype.
    pub fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = Some(dtype);
        self
    }

    /// Sets where the gradient buckets are formed and reduced ([`BucketPlace::Auto`] by
    /// default).
    pub fn with_buckets(mut self, place: BucketPlace) -> Self {
        self.place = place;
        self
    }

    /// Sets the size at which a gradient bucket is sent (at least one parameter per bucket).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }

    /// The data-parallel group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Replaces every float parameter of `module` with `root`'s value, so that all replicas
    /// start identical. Whether a parameter requires a gradient is kept.
    ///
    /// # Errors
    /// When a broadcast fails; the module is then lost (the job cannot go on anyway).
    pub fn broadcast_module<M: Module>(&self, module: M, root: usize) -> Result<M> {
        struct Broadcaster<'a> {
            group: &'a ProcessGroup,
            root: usize,
            error: Option<CollectiveError>,
        }
        impl ModuleMapper for Broadcaster<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                if self.error.is_some() {
                    return param;
                }
                let (group, root) = (self.group, self.root);
                let mut error = None;
                let param = param.map(|tensor| {
                    let device = tensor.device();
                    let require_grad = tensor.is_require_grad();
                    match group.broadcast_data(tensor.clone().into_data(), root) {
                        Ok(data) => {
                            let t = tensor_from_data(data, &device);
                            if require_grad { t.require_grad() } else { t }
                        }
                        Err(e) => {
                            error = Some(e);
                            tensor
                        }
                    }
                });
                self.error = error;
                param
            }
        }
        let mut mapper = Broadcaster {
            group: &self.group,
            root,
            error: None,
        };
        let module = module.map(&mut mapper);
        match mapper.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }

    /// Averages `grads` over the group: gradients are packed, in reverse order of the
    /// module's parameters (the order backward produces them), into flat buckets of about
    /// `bucket_bytes`, each all-reduced by a communication thread while the next is packed.
    ///
    /// - A *frozen* parameter (on an autodiff device, not requiring a gradient: see
    ///   [`Module::no_grad`]) takes no part: it is not communicated and gets no gradient, so an
    ///   optimizer neither moves it (weight decay) nor creates state for it.
    /// - A trainable parameter without a gradient on this rank (unused here) contributes zeros,
    ///   so ranks that use different parameters still agree on the bucket layout and the
    ///   average is over all ranks.
    /// - A trainable parameter that no rank has a gradient for gets no gradient at all (as on a
    ///   single device): one small all-reduce of per-parameter presence flags, sent ahead of the
    ///   buckets, tells every rank which parameters were used somewhere.
    ///
    /// Every rank must freeze the same parameters (the bucket shapes would differ otherwise,
    /// which the all-reduce reports as a mismatch).
    ///
    /// # Errors
    /// When an all-reduce fails (a dead peer, a rank with another model...).
    pub fn all_reduce_grads<M: Module>(
        &self,
        module: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        self.reduce_grads(module, grads, 1.0)
    }

    fn reduce_grads<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
        local_scale: f32,
    ) -> Result<GradientsParams> {
        if self.group.size() == 1 && local_scale == 1.0 {
            return Ok(grads);
        }
        // Parameters in reverse visiting order, cut into buckets of one dtype.
        let index = ParamIndex::with_state(module);
        let mut params = reduced_params(&index);
        params.reverse();
        if let Some(dtype) = self.reduce_dtype {
            params.iter_mut().for_each(|p| p.2 = dtype);
        }
        let buckets = plan_buckets(&params, self.bucket_bytes);
        let on_device = match self.place {
            BucketPlace::Host => false,
            BucketPlace::Device => true,
            BucketPlace::Auto => {
                first_device(&index).is_some_and(|device| self.group.collects_on_device(&device))
            }
        };
        if on_device {
            return self.reduce_on_device(module, grads, local_scale, &params, &buckets);
        }
        // This rank's gradients as host data (whatever the parameters' ranks).
        let mut taker = TakeGrads {
            grads: &mut grads,
            scale: local_scale,
            dtype: self.reduce_dtype,
            taken: HashMap::with_capacity(params.len()),
        };
        module.visit(&mut taker);
        let mut local = taker.taken;
        // Which parameters have a gradient on this rank (1) or not (0), in `params` order; the
        // maximum over ranks says which were used anywhere.
        let present: Vec<f32> = params
            .iter()
            .map(|(id, _, _)| f32::from(u8::from(local.contains_key(id))))
            .collect();

        let (to_comm, from_main) = mpsc::channel::<(TensorData, ReduceOp)>();
        let (to_main, reduced) = mpsc::channel::<Result<TensorData>>();
        let group = self.group.clone();
        thread::scope(|scope| {
            scope.spawn(move || {
                for (bucket, op) in from_main {
                    let result = group.all_reduce_data(bucket, op);
                    let failed = result.is_err();
                    let _ = to_main.send(result);
                    if failed {
                        break;
                    }
                }
            });
            let count = present.len();
            // The presence flags go first: they are tiny, and the buckets follow at once.
            let _ = to_comm.send((TensorData::new(present, [count]), ReduceOp::Max));
            // Pack each bucket straight into tensor storage; the communication thread reduces
            // it while the next one is packed.
            for bucket in &buckets {
                let numel: usize = bucket.iter().map(|&i| numel_of(&params[i].1)).sum();
                let dtype = params[bucket[0]].2;
                let data = pool::tensor_data(vec![numel], dtype, |out| {
                    let mut at = 0;
                    for &i in bucket {
                        let (id, shape, dtype) = &params[i];
                        let len = numel_of(shape) * dtype.size();
                        match local.remove(id) {
                            Some(grad) => out[at..at + len].copy_from_slice(grad.as_bytes()),
                            // No gradient on this rank (parameter unused): contribute zeros.
                            None => out[at..at + len].fill(0),
                        }
                        at += len;
                    }
                });
                if to_comm.send((data, ReduceOp::Avg)).is_err() {
                    break; // the communication thread failed; its error is received below
                }
            }
            drop(to_comm);
            let receive = || {
                reduced
                    .recv()
                    .map_err(|_| CollectiveError::InvalidArgument {
                        rank: self.group.global_rank(),
                        op: "all_reduce_grads".into(),
                        reason: "the communication thread stopped".into(),
                    })
            };
            let used = self.presence(receive()??)?;
            let mut reduced_grads = HashMap::with_capacity(params.len());
            for bucket in &buckets {
                let data = receive()??;
                let bytes = data.as_bytes();
                let mut at = 0;
                for &i in bucket {
                    let (id, shape, dtype) = &params[i];
                    let len = numel_of(shape) * dtype.size();
                    // A parameter no rank has a gradient for stays without one.
                    if used[i] > 0.0 {
                        let grad = pool::tensor_data(shape.clone(), *dtype, |out| {
                            out.copy_from_slice(&bytes[at..at + len])
                        });
                        reduced_grads.insert(*id, grad);
                    }
                    at += len;
                }
            }
            module.visit(&mut Register {
                grads: &mut grads,
                reduced: reduced_grads,
            });
            Ok(grads)
        })
    }

    /// The all-reduced presence flags (one per parameter: used on some rank when positive).
    fn presence(&self, flags: TensorData) -> Result<Vec<f32>> {
        flags
            .try_to_vec::<f32>()
            .map_err(|e| CollectiveError::InvalidArgument {
                rank: self.group.global_rank(),
                op: "all_reduce_grads".into(),
                reason: format!("presence flags came back malformed: {e:?}"),
            })
    }

    /// [`Self::reduce_grads`] with buckets formed and reduced as tensors on the gradients'
    /// device ([`BucketPlace::Device`]): the same buckets, order, presence flags and averages.
    fn reduce_on_device<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
        local_scale: f32,
        params: &[(ParamId, Vec<usize>, DType)],
        buckets: &[Vec<usize>],
    ) -> Result<GradientsParams> {
        let mut taker = TakeFlat {
            grads: &mut grads,
            scale: local_scale,
            dtype: self.reduce_dtype,
            taken: HashMap::with_capacity(params.len()),
            devices: HashMap::with_capacity(params.len()),
        };
        module.visit(&mut taker);
        let (mut local, devices) = (taker.taken, taker.devices);
        let present: Vec<f32> = params
            .iter()
            .map(|(id, _, _)| f32::from(u8::from(local.contains_key(id))))
            .collect();
        let count = present.len();
        let used = self.presence(
            self.group
                .all_reduce_data(TensorData::new(present, [count]), ReduceOp::Max)?,
        )?;
        let mut reduced_grads = HashMap::with_capacity(params.len());
        for bucket in buckets {
            let parts: Vec<Tensor<1>> = bucket
                .iter()
                .map(|&i| {
                    let (id, shape, dtype) = &params[i];
                    // No gradient on this rank (parameter unused): contribute zeros.
                    local.remove(id).unwrap_or_else(|| {
                        Tensor::<1>::zeros([numel_of(shape)], (&devices[id], *dtype))
                    })
                })
                .collect();
            let reduced = self
                .group
                .all_reduce(Tensor::cat(parts, 0), ReduceOp::Avg)?;
            let mut at = 0;
            for &i in bucket {
                let (id, shape, _) = &params[i];
                let n = numel_of(shape);
                // A parameter no rank has a gradient for stays without one.
                if used[i] > 0.0 {
                    reduced_grads.insert(*id, reduced.clone().slice(at..at + n));
                }
                at += n;
            }
        }
        module.visit(&mut RegisterFlat {
            grads: &mut grads,
            reduced: reduced_grads,
        });
        Ok(grads)
    }

    /// Checks that `module` is identical on every rank of the group (a hash of every parameter,
    /// compared across ranks): call it after building or broadcasting the model, before
    /// training. See [`crate::replica::verify_replicas`].
    ///
    /// # Errors
    /// [`ReplicaError::Mismatch`] naming the first differing parameter and the ranks that
    /// disagree (the same error on every rank); [`ReplicaError::Collective`] when the exchange
    /// fails.
    pub fn verify_replicas<M: Module>(&self, module: &M) -> std::result::Result<(), ReplicaError> {
        crate::replica::verify_replicas(module, &self.group)
    }
}

pub(crate) fn numel_of(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Groups parameter indices into consecutive buckets of one dtype of at least `bucket_bytes`
/// (the last one may be smaller).
pub(crate) fn plan_buckets(
    params: &[(ParamId, Vec<usize>, DType)],
    bucket_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, (_, shape, dtype)) in params.iter().enumerate() {
        let same_dtype = buckets.last().is_some_and(|b| params[b[0]].2 == *dtype);
        if !same_dtype || bytes >= bucket_bytes {
            buckets.push(Vec::new());
            bytes = 0;
        }
        buckets.last_mut().expect("pushed above").push(i);
        bytes += numel_of(shape) * dtype.size();
    }
    buckets
}

/// The parameters whose gradients are averaged, in `index`'s order (built by
/// [`ParamIndex::with_state`]): each trainable one once (a parameter reachable twice, shared
/// between layers, is reduced once; a frozen one is not reduced at all), with its shape and
/// dtype.
pub(crate) fn reduced_params(index: &ParamIndex) -> Vec<(ParamId, Vec<usize>, DType)> {
    let state = |e: &ParamEntry| e.state.as_ref().expect("an index with_state").dtype;
    let trainable = index.trainable();
    trainable
        .map(|e| (e.id, e.shape.clone(), state(e)))
        .collect()
}

/// The device of the first trainable parameter of `index` (built by
/// [`ParamIndex::with_state`]), where its gradient lives.
pub(crate) fn first_device(index: &ParamIndex) -> Option<burn::tensor::Device> {
    let first = index.trainable().next()?;
    Some(first.state.as_ref()?.device.clone().inner())
}

/// Whether `param` is frozen: on an autodiff device but not requiring a gradient. (On a device
/// without autodiff no tensor tracks gradients, so nothing is considered frozen there.)
pub(crate) fn is_frozen<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    let value = param.val();
    value.is_autodiff() && !value.is_require_grad()
}

/// Removes every parameter's gradient from `grads` as host data, scaled by `scale`.
struct TakeGrads<'a> {
    grads: &'a mut GradientsParams,
    scale: f32,
    /// The reduction dtype, when not the parameter's.
    dtype: Option<DType>,
    taken: HashMap<ParamId, TensorData>,
}

impl ModuleVisitor for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_frozen(param) {
            // Whatever was registered for a frozen parameter must not reach the optimizer.
            let _ = self.grads.remove::<D>(param.id);
            return;
        }
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            let grad = if self.scale == 1.0 {
                grad
            } else {
                grad * self.scale
            };
            let data = grad.into_data();
            let dtype = self.dtype.unwrap_or_else(|| param.val().dtype());
            let data = if data.dtype() == dtype {
                data
            } else {
                data.convert_dtype(dtype)
            };
            self.taken.insert(param.id, data);
        }
    }
}

/// Registers reduced host gradients on each parameter's (non-autodiff) device.
struct Register<'a> {
    grads: &'a mut GradientsParams,
    reduced: HashMap<ParamId, TensorData>,
}

impl ModuleVisitor for Register<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(data) = self.reduced.remove(&param.id) {
            let device = param.lazy_device().inner();
            let grad = tensor_from_data::<D>(data, &device);
            self.grads.register(param.id, in_dtype_of(grad, param));
        }
    }
}

/// Removes every parameter's gradient from `grads` as a flat tensor on its device, scaled by
/// `scale`, in the parameter's dtype; records every trainable parameter's device.
struct TakeFlat<'a> {
    grads: &'a mut GradientsParams,
    scale: f32,
    /// The reduction dtype, when not the parameter's.
    dtype: Option<DType>,
    taken: HashMap<ParamId, Tensor<1>>,
    devices: HashMap<ParamId, burn::tensor::Device>,
}

impl ModuleVisitor for TakeFlat<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_frozen(param) {
            let _ = self.grads.remove::<D>(param.id);
            return;
        }
        self.devices.insert(param.id, param.lazy_device().inner());
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            let grad = if self.scale == 1.0 {
                grad
            } else {
                grad * self.scale
            };
            let dtype = self.dtype.unwrap_or_else(|| param.val().dtype());
            let grad = if grad.dtype() == dtype {
                grad
            } else {
                grad.cast(dtype)
            };
            let n = grad.shape().num_elements();
            self.taken.insert(param.id, grad.reshape([n]));
        }
    }
}

/// Registers reduced flat gradients in each parameter's shape.
struct RegisterFlat<'a> {
    grads: &'a mut GradientsParams,
    reduced: HashMap<ParamId, Tensor<1>>,
}

impl ModuleVisitor for RegisterFlat<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(flat) = self.reduced.remove(&param.id) {
            let shape: [usize; D] = param.val().dims();
            self.grads
                .register(param.id, in_dtype_of(flat.reshape(shape), param));
        }
    }
}

/// `grad` in `param`'s dtype (a gradient reduced in another dtype comes back to it).
pub(crate) fn in_dtype_of<const D: usize>(grad: Tensor<D>, param: &Param<Tensor<D>>) -> Tensor<D> {
    let dtype = param.val().dtype();
    if grad.dtype() == dtype {
        grad
    } else {
        grad.cast(dtype)
    }
}
