//! # burn-moe
//!
//! Mixture-of-experts layers and expert parallelism for Burn, in the style of Megatron-Core
//! MoE and torchtitan (DeepSeek-V3 and Qwen3-MoE routers):
//!
//! - [`MoeLayer`]: `E` GELU or SwiGLU experts, optional shared experts, a token-choice top-k
//!   router (softmax or sigmoid scores in fp32, renormalised over the chosen experts, optional
//!   scale, optional group-limited routing), capacity mode (drop by position or by gate weight,
//!   per capacity group) or dropless mode, the Switch load-balancing loss, the router z-loss
//!   and auxiliary-loss-free bias balancing; experts compute on contiguous expert-major blocks.
//! - [`router`]: the routing decisions as pure host functions.
//! - [`dispatch`]: expert parallelism's token exchange (counts, uneven all-to-all, expert-major
//!   permutation) and its inverse, each the other's backward.
//! - [`MoeStep`]: the training step: expert gradients reduced over the ranks holding the same
//!   experts, every other gradient over the data-parallel group (or by tensor parallelism and
//!   FSDP through `TrainStep`), global-norm clipping over both; [`MoeStep::reduce_experts`]
//!   ([`ExpertGradients`]) for steps that reduce the rest their own way (ZeRO-1/2).
//! - [`MoeTrainer`] and [`MoeZero`]: the [`burn_parallel::train::StepEngine`]s of an MoE model
//!   (the step with its optimizer; ZeRO-1/2 with the experts outside its flat space), whose
//!   checkpoints name each expert by its global index: any expert-parallel layout resumes what
//!   another saved.
//! - [`MoeStats`]: tokens per expert, drop rate, load imbalance, the auxiliary losses.

#![warn(missing_docs)]

pub mod config;
pub mod dispatch;
pub mod layer;
pub mod router;
pub mod step;

pub use config::{Capacity, DropPolicy, ExpertKind, MoeConfig, MoeError, Result, ScoreFn};
pub use layer::{Expert, ExpertParams, MoeLayer, MoeParallel, MoeStats, Routing};
pub mod engine;
pub use engine::{MoeTrainer, MoeZero};
pub use step::{ExpertGradients, MoeStep};
