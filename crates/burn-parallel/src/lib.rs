//! # burn-parallel
//!
//! Distributed training for [Burn](https://burn.dev): process groups and collectives that work
//! on every Burn backend, a launcher (`burnrun`), an N-dimensional device mesh, differentiable
//! collectives and data parallelism.
//!
//! The pieces, bottom up:
//!
//! - [`comm::transport`]: how frames move between ranks ([`Transport`]); backends are
//!   [`comm::local`] (ranks are threads) and `comm::tcp` (ranks are processes).
//! - [`ProcessGroup`]: the collectives, written once over any transport.
//!
//! # Example
//! ```
//! use burn_parallel::{ReduceOp, run_local};
//!
//! // Four ranks as threads; each contributes its rank.
//! let totals = run_local(4, |group| group.all_reduce_f32(vec![group.rank() as f32], ReduceOp::Sum))
//!     .unwrap();
//! assert!(totals.iter().all(|t| t == &vec![6.0]));
//! ```

#![warn(missing_docs)]

pub mod comm;
pub mod error;
pub mod flight;
pub mod group;
pub mod heartbeat;

pub use comm::host::ReduceOp;
pub use comm::tcp::{TcpConfig, TcpRendezvous};
pub use comm::transport::Transport;
pub use error::{CollectiveError, Result};
pub mod surface;
pub use group::{ProcessGroup, SendRecv};
pub use surface::Error;
pub mod nccl;
pub mod world;
pub use world::{init_from_env, local_world, run_local};
pub mod autograd;
pub mod calls;
pub mod checkpoint;
pub mod context_parallel;
pub mod cuda;
#[cfg(feature = "cube")]
pub(crate) mod device;
pub mod mesh;
pub mod muon;

pub use mesh::{DeviceMesh, MeshError, ParallelDims};
pub mod ddp;
pub mod diloco;
pub mod fault;

pub use ddp::{BucketPlace, DistributedDataParallel};
pub use diloco::{DiLoCo, DiLoCoConfig, DiLoCoError, Islands};
pub mod replica;
pub use replica::{ReplicaError, verify_replicas};
pub mod tensor_parallel;

pub use tensor_parallel::{Placement, TpError, TpTensor, vocab_parallel_cross_entropy};
pub mod index;
pub mod init;
pub mod kernels;
pub mod malloc;
pub mod mfu;
pub mod nn;
pub mod optim;
pub mod overlap;
pub mod plan;
pub mod planner;
pub mod precision;
pub mod threads;
pub mod train;
pub mod work;
pub use work::Work;
