//! Burn's CubeCL tensors as device buffers, for the code outside Burn's kernels that works on
//! them directly: NCCL's collectives ([`crate::comm::nccl`]) and cuBLASLt's products (the
//! `cuda` part of [`crate::kernels::cube`]). It sits below both, so that neither reaches into
//! the other.
//!
//! - [`to_cube`] and [`from_cube`]: a tensor of Burn's fused `Cube` backend (a lazy handle) as
//!   the resolved `CubeTensor`, and back;
//! - [`bind`] (feature `cuda`): the raw device pointers of CubeCL buffers, kept in place while
//!   bound;
//! - [`order`] (feature `cuda`): a CUDA stream of our own ordered with the work Burn queued on
//!   CubeCL's, without waiting on the host.

#[cfg(feature = "cuda")]
pub(crate) mod order;

use burn::backend::Cube;
use burn::backend::fusion::NoOp;
use burn::backend::fusion::custom::{OperationIr, StreamId};
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use burn_ir::{BackendIr, InitOperationIr};
#[cfg(feature = "cuda")]
use cubecl::cuda::CudaRuntime;
#[cfg(feature = "cuda")]
use cubecl_runtime::runtime::Runtime;

#[cfg(feature = "cuda")]
type CudaServer = <CudaRuntime as Runtime>::Server;

/// The resolved device tensor of a lazy one (flushes the work that produces it): for code
/// that needs device buffers, such as NCCL or a kernel of the user's.
pub fn to_cube(t: FloatTensor<Cube>) -> CubeTensor {
    let client = t.client.clone();
    client.resolve_tensor_float::<CubeBackend>(t)
}

/// A resolved device tensor as a lazy one (registered with the fusion stream of its device),
/// the way back from [`to_cube`].
pub fn from_cube(t: CubeTensor) -> FloatTensor<Cube> {
    let client = burn::backend::fusion::get_client::<CubeBackend>(&t.device);
    let (shape, dtype) = (t.meta.shape().clone(), t.dtype);
    let handle = <CubeBackend as BackendIr>::float_tensor_handle(t);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            StreamId::current(),
            OperationIr::Init(desc),
            NoOp::<CubeBackend>::new(),
        )
        .into_iter()
        .next()
        .expect("an init operation has one output")
}

/// The CUDA device index of a CubeCL device, if it is a CUDA device.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_index(device: &cubecl::Device) -> Option<usize> {
    match device {
        cubecl::Device::Cuda(cuda) => Some(cuda.index),
        _ => None,
    }
}

/// What keeps a set of device buffers bound: dropping it releases them.
#[cfg(feature = "cuda")]
pub(crate) type Held = Vec<Box<dyn std::any::Any>>;

/// Binds `tensors`' device buffers: CubeCL neither frees nor moves a bound allocation, and
/// binding orders it after the writes of other CubeCL streams (it does not wait for the
/// device). Returns what keeps them bound (drop it when done) and their addresses.
#[cfg(feature = "cuda")]
pub(crate) fn bind(tensors: &[&CubeTensor]) -> Result<(Held, Vec<u64>), String> {
    let mut held: Held = Vec::with_capacity(tensors.len());
    let mut addresses = Vec::with_capacity(tensors.len());
    for t in tensors {
        let resource = t
            .client
            .get_resource::<CudaServer>(t.handle.clone())
            .map_err(|e| format!("{e:?}"))?;
        addresses.push(resource.resource().ptr);
        held.push(Box::new(resource));
    }
    Ok((held, addresses))
}
