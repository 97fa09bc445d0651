//! Communication backends and the host arithmetic the collectives share.

pub mod host;
pub mod local;
pub mod mpi;
pub mod nccl;
#[cfg(feature = "nccl")]
pub(crate) mod nccl_lib;
pub mod pool;
pub mod shm;
pub mod tcp;
pub mod transport;
