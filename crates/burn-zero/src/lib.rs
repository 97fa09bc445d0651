//! # burn-zero
//!
//! Train models whose weights, gradients and optimizer state do not fit on one device, as
//! DeepSpeed ZeRO and PyTorch FSDP do, on any Burn backend, over the process groups of
//! [`burn_parallel`].
//!
//! | piece | file |
//! |---|---|
//! | flat parameter spaces and their shards | [`flat`] |
//! | a Burn optimizer over flat shards, optional host offload | [`optim`] |
//! | ZeRO stages 1 and 2, hybrid groups, shared config | [`zero`] |
//! | ZeRO stage 3 / FSDP: any module's units, sharded as Burn modules | [`fully_shard`] |
//! | global-norm clipping over shards | [`clip`] |
//! | mixed precision, loss scaling | [`precision`] |
//! | memory accounting | [`memory`] |
//! | the engines' state in distributed checkpoints ([`burn_parallel::checkpoint`]) | [`dcp`] |
//!
//! With fp32 Adam (16 bytes per parameter) and `N` ranks, a rank holds `8P + 8P/N` bytes at
//! stage 1, `4P + 12P/N` at stage 2 and `16P/N` plus the largest gathered unit at stage 3; the
//! [`memory`] figures measure it.
//!
//! # Example: ZeRO-2 on two thread ranks
//! ```
//! use burn::nn::LinearConfig;
//! use burn::optim::{AdamWConfig, GradientsParams};
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::{DistributedDataParallel, run_local};
//! use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};
//!
//! let norms = run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     // A random initialisation differs on every rank: make the replicas identical by
//!     // broadcasting rank 0's weights (or build the model from the same seed everywhere).
//!     // `ZeroOptimizer::new` checks it and refuses differing replicas.
//!     let model = LinearConfig::new(8, 8).init(&device);
//!     let mut model = DistributedDataParallel::new(group.clone()).broadcast_module(model, 0)?;
//!     let config = ZeroConfig::new(Stage::Two).with_max_grad_norm(Some(1.0));
//!     let mut zero = ZeroOptimizer::new(&model, ShardGroups::flat(group),
//!         config, AdamWConfig::new().build()).unwrap();
//!     let loss = model.forward(Tensor::<2>::ones([4, 8], &device)).sum();
//!     zero.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model)).unwrap();
//!     let (next, info) = zero.step(1e-3, model).unwrap();
//!     model = next;
//!     let _ = model;
//!     Ok(info.grad_norm.unwrap())
//! })
//! .unwrap();
//! assert_eq!(norms[0], norms[1]); // the norm of the full gradient, on every rank
//! ```

#![warn(missing_docs)]

pub mod clip;
pub mod dcp;
pub mod error;
pub mod flat;
pub mod fully_shard;
pub mod memory;
pub mod optim;
/// The mixed-precision policy and loss scaler, shared with every layout of burn-parallel.
pub use burn_parallel::precision;
pub mod zero;

pub use error::{Result, ZeroError};
pub use fully_shard::{Fsdp, FsdpPlan, Unit};
pub use memory::{MemoryReport, MemoryTracker};
pub use optim::ElementWise;
pub use precision::{LossScaler, LossScalerState, MixedPrecision};
pub use zero::{ShardGroups, Stage, StepInfo, ZeroConfig, ZeroOptimizer};
