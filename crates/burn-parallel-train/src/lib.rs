//! The trainer of the `burn-parallel` suite: what every user of the technique crates would
//! otherwise write again around their model.
//!
//! - [`Layout`]: the whole parallel layout in one value (data parallel replicate and shard,
//!   tensor and sequence, context, pipeline, expert parallel, the ZeRO stage and its options),
//!   built in code or read from TOML, with **one** [`Layout::validate`] that holds every rule of
//!   which techniques compose and names, in its [`LayoutError`], the flag to change;
//! - [`build()`]: from a `Layout`, the world and a [`ParallelModel`] (the user's model, its batch
//!   and loss, and how to build it), what this rank trains ([`Trainee`]): its model and a
//!   `Box<dyn StepEngine>` that steps it, or under `pp > 1` its pipeline stages
//!   ([`StagedModel`], [`pipeline`]), or DiLoCo's islands ([`diloco`]): a user switches layout
//!   by changing the `Layout`, not the loop;
//! - [`fit()`]: the loop over it: each data-parallel rank its rows of every micro-batch, a
//!   learning-rate schedule, checkpoints every N steps and at the end, resuming from the newest
//!   one (saved under any layout, dropout positions included), and a clean stop on a flag
//!   (Ctrl-C) that saves first.
//!
//! With the `cli` feature, `cli` gives a training binary its flags (`LayoutArgs`, `StepArgs`,
//! `CheckpointArgs`, `MetricsArgs`), the Ctrl-C flag and a progress display. [`metrics`] writes
//! and reads a run's per-step metrics as JSON lines; with the `plot` feature (on with `cli`),
//! `plot` draws their loss and throughput chart as SVG.
//!
//! Errors are [`burn_parallel::Error`], into which every crate of the suite converts its own.
//!
//! This crate sits above `burn-parallel`, `burn-zero`, `burn-moe` and `burn-pipeline` (it
//! assembles them); none of them depends on it.

#![warn(missing_docs)]

pub mod build;
#[cfg(feature = "cli")]
pub mod cli;
mod config;
pub mod diloco;
mod fault;
pub mod fit;
pub mod layout;
mod local;
mod memory;
pub mod metrics;
pub mod model;
#[cfg(feature = "cli")]
mod moe_args;
mod params;
pub mod pipeline;
#[cfg(feature = "cli")]
mod plan_args;
#[cfg(feature = "plot")]
pub mod plot;
#[cfg(feature = "cli")]
mod progress;
mod saved;
pub mod settings;
pub mod streams;

pub use build::{Built, Placed, Trainee, build, build_from, verify_replicas};
pub use config::from_toml;
pub use diloco::{DiLoCoFigures, DiLoCoHandle};
pub use fit::{
    BatchFn, CheckpointPolicy, FitConfig, Fitted, LossHistory, LrSchedule, MicroBatch, OnStep,
    Resumed, RunState, SavedConfig, StepLog, StopFlag, fit, fit_with, open_checkpoint,
};
pub use layout::{DiLoCoLayout, Layout, LayoutError, Optim, PipelineLayout, Recompute, Workload};
pub use local::run_local;
pub use memory::check_memory;
pub use model::{Groups, ModelParts, ParallelModel, StepSettings};
pub use params::{NamedParam, load_named, named_params};
pub use pipeline::{PipelineEngine, PipelineSteps, StageParts, StagedModel};
pub use saved::saved_state;
pub use settings::{LossScale, Precision, TrainDevice, available_memory};
