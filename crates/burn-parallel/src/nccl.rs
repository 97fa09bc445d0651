//! NCCL for a [`ProcessGroup`]: [`attach`] it to a group (or [`init_from_env`] for the world
//! of a launcher), [`connect`] a group's communicator early. The backend itself (loading,
//! communicators, the device collectives, how they are ordered with Burn's work) is
//! [`crate::comm::nccl`], below the group: it reaches the group only through what it needs of
//! it, so the transports import nothing above them.

pub use crate::comm::nccl::{BACKEND, BUILT, DEVICE_TENSORS, NcclInfo, probe};
use crate::comm::nccl::{DeviceComm, not_built};
use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;

/// Forms the world from the environment of `burnrun`, torchrun or SLURM (as
/// [`crate::world::init_from_env`]) and attaches NCCL to it on this process's CUDA device
/// ([`crate::cuda::local_device_index`]: `LOCAL_RANK` or `SLURM_LOCALID`, renumbered by
/// `CUDA_VISIBLE_DEVICES`; the device the trainers put their tensors on).
///
/// # Returns
/// The world group: host frames over `tcp`, CUDA tensors through NCCL.
///
/// # Errors
/// Those of [`crate::world::init_from_env`] and of [`attach`].
pub fn init_from_env() -> Result<ProcessGroup> {
    if !BUILT {
        return Err(not_built());
    }
    // The device the trainers take too (`LOCAL_RANK`, `SLURM_LOCALID`, `CUDA_VISIBLE_DEVICES`).
    let (device, _) =
        crate::cuda::local_device_index().map_err(|e| CollectiveError::BackendUnavailable {
            backend: BACKEND.into(),
            reason: e.to_string(),
        })?;
    let world = crate::world::init_from_env()?;
    attach(world, device)
}

/// Attaches NCCL to `group`: every member checks that NCCL can run on its CUDA device, the
/// members agree on the outcome (so that every rank reports the same failure instead of some
/// hanging), and the returned group runs its tensor-level collectives on CUDA tensors through
/// NCCL. Every member of `group` must call it.
///
/// # Arguments
/// - `group`: a group of any host backend (`tcp`, or `local` for thread ranks on several GPUs).
/// - `cuda_device`: this rank's CUDA device index.
///
/// # Returns
/// The same group with NCCL attached; its sub-groups ([`ProcessGroup::split`]) get their own
/// communicators.
///
/// # Errors
/// [`CollectiveError::BackendUnavailable`] when this build has no `nccl` feature or when any
/// member lacks the driver, the device or `libnccl` (the message names the rank); host-transport
/// errors of the agreement.
///
/// # Example
/// ```
/// use burn_parallel::{nccl, run_local};
///
/// // Two thread ranks, rank r on CUDA device r. Without the `nccl` feature, a GPU per rank or
/// // libnccl, every rank gets the same typed error, at once.
/// let outcomes = run_local(2, |group| {
///     let rank = group.rank();
///     Ok(nccl::attach(group, rank).map(|g| g.backend()))
/// })
/// .unwrap();
/// for outcome in outcomes {
///     match outcome {
///         Ok(backend) => assert_eq!(backend, "nccl"),
///         Err(e) => println!("{e}"),
///     }
/// }
/// ```
pub fn attach(group: ProcessGroup, cuda_device: usize) -> Result<ProcessGroup> {
    if !BUILT {
        return Err(not_built());
    }
    let local = probe(cuda_device);
    let reasons: Vec<Option<String>> =
        group.all_gather_object(&local.as_ref().err().map(|e| e.to_string()))?;
    local?;
    if let Some((rank, Some(reason))) = reasons
        .into_iter()
        .enumerate()
        .find(|(_, reason)| reason.is_some())
    {
        return Err(CollectiveError::BackendUnavailable {
            backend: BACKEND.into(),
            reason: format!("group rank {rank} cannot run NCCL: {reason}"),
        });
    }
    Ok(group.with_nccl(DeviceComm::new(cuda_device)))
}

/// Creates `group`'s NCCL communicator now instead of at its first device collective. Every
/// member must call it (it is a collective). Useful before the first device operation of a
/// group is a point-to-point one: creating a communicator needs every member, and a send
/// between two of them would otherwise wait for the others.
///
/// # Errors
/// [`CollectiveError::InvalidArgument`] when NCCL is not attached to `group` (see [`attach`]);
/// [`CollectiveError::Nccl`] when NCCL fails to create the communicator or times out.
pub fn connect(group: &ProcessGroup) -> Result<()> {
    crate::comm::nccl::connect(group)
}
