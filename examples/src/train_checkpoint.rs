//! Distributed checkpoints of the GPT trainer: `gpt --save-every N --checkpoint-dir D` and
//! `gpt --resume D`.
//!
//! A checkpoint holds the logical (single-device) parameters and AdamW state, saved by each rank
//! for the part it holds ([`burn_parallel::checkpoint::ParamMap`], ZeRO's
//! [`ZeroOptimizer::checkpoint_state`](burn_zero::ZeroOptimizer::checkpoint_state)), and the
//! trainer's own state: the losses so far and the configuration. The learning-rate schedule and
//! the data are pure functions of the step, so the step is their position. A run resumed from
//! it continues the loss curve of the run that saved it: bit for bit under the same layout, and
//! under another layout (other dp, tp, ZeRO stage) within the rounding of the other reduction
//! order.

use std::path::{Path, PathBuf};

use burn_parallel::checkpoint::{Checkpoint, CheckpointError, Checkpointer};
use serde::{Deserialize, Serialize};

use crate::gpt::GptConfig;
use crate::train::TrainConfig;

/// Where and how often a run saves, and where it resumes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// The directory the checkpoints go under (`D/step-00000100/`, ...).
    pub dir: Option<PathBuf>,
    /// Save after every `save_every` steps (0: never).
    pub save_every: usize,
    /// Complete checkpoints kept (older ones are deleted).
    pub keep: usize,
    /// Write on a background thread while training goes on (the tensors are first copied to
    /// host memory).
    pub asynchronous: bool,
    /// Resume from this checkpoint: a checkpoint directory, or a directory of them (the newest
    /// complete one is taken).
    pub resume: Option<PathBuf>,
    /// Start (at step 0) from the weights of this Hugging Face checkpoint directory
    /// ([`crate::hf::gpt_tensors`]); the run's model must be the one its `config.json` describes
    /// ([`crate::hf::HfConfig`]), up to seed, dropout and fused kernels.
    pub init_from_hf: Option<PathBuf>,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        Self {
            dir: None,
            save_every: 0,
            keep: 3,
            asynchronous: false,
            resume: None,
            init_from_hf: None,
        }
    }
}

impl CheckpointOptions {
    /// Whether the run saves or resumes at all.
    pub fn active(&self) -> bool {
        self.save_every > 0 || self.resume.is_some()
    }

    /// Checks the options.
    ///
    /// # Errors
    /// A sentence naming the flag to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.save_every > 0 && self.dir.is_none() {
            return Err("--save-every needs --checkpoint-dir D (where to write)".into());
        }
        if self.keep == 0 {
            return Err("--keep-checkpoints must be at least 1".into());
        }
        if self.resume.is_some() && self.init_from_hf.is_some() {
            return Err(
                "--resume and --init-from-hf both say where the weights come from: \
                        give one (a resumed run already holds the weights it started from)"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether to save after step `step` (counted from 0).
    pub(crate) fn saves_after(&self, step: usize) -> bool {
        self.save_every > 0 && (step + 1).is_multiple_of(self.save_every)
    }
}

/// The trainer's state besides tensors, kept by rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TrainerState {
    /// The loss of every step done.
    pub losses: Vec<f64>,
    /// The run's configuration (the model must match on resume).
    pub config: TrainConfig,
}

/// Name of the optimizer scalars in each rank's state.
pub(crate) const OPTIM_SCALARS: &str = "optim_scalars";

/// Opens the checkpoint to resume from: `path` itself, or the newest complete one under it.
///
/// # Errors
/// [`CheckpointError::Corrupt`] naming `path` when it holds no complete checkpoint; the errors
/// of [`Checkpoint::open`].
pub fn open_resume(path: &Path) -> Result<Checkpoint, CheckpointError> {
    if path.join("manifest.json").exists() {
        return Checkpoint::open(path);
    }
    Checkpointer::latest(path)?.ok_or_else(|| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        reason: "no complete checkpoint here (no manifest.json in it or in a step-* \
                 directory under it); check the path, or start without --resume"
            .into(),
    })
}

/// The trainer state of `checkpoint`, checked against the run that resumes from it.
///
/// # Errors
/// A sentence naming what differs.
pub(crate) fn resume_state(
    checkpoint: &Checkpoint,
    config: &TrainConfig,
) -> Result<TrainerState, String> {
    let state: TrainerState = serde_json::from_value(checkpoint.state().clone()).map_err(|e| {
        format!(
            "{} was not saved by the GPT trainer ({e})",
            checkpoint.dir().display()
        )
    })?;
    let differs = |what: &str, saved: String, now: String| {
        format!(
            "{} was saved with {what} {saved}, this run has {now}: resume with the same {what}",
            checkpoint.dir().display()
        )
    };
    if state.config.model != config.model {
        return Err(differs(
            "model",
            format!("{:?}", state.config.model),
            format!("{:?}", config.model),
        ));
    }
    let step = checkpoint.step();
    if step > config.steps || state.losses.len() != step {
        return Err(format!(
            "{} holds step {step} ({} losses) but this run has {} steps",
            checkpoint.dir().display(),
            state.losses.len(),
            config.steps
        ));
    }
    for (what, saved, now) in [
        ("batch_size", state.config.batch_size, config.batch_size),
        ("seq_len", state.config.seq_len, config.seq_len),
        ("grad_accum", state.config.grad_accum, config.grad_accum),
    ] {
        if saved != now {
            return Err(differs(what, saved.to_string(), now.to_string()));
        }
    }
    Ok(state)
}

/// Refuses the layouts whose checkpoints are not supported yet.
///
/// # Errors
/// A sentence naming the flag to drop.
pub(crate) fn check_layout(model: &GptConfig) -> Result<(), String> {
    if model.moe.is_some() {
        return Err(
            "checkpoints of a GPT-MoE are not supported yet (expert-parallel ranks hold \
                    other experts under the same local names): drop --save-every/--resume"
                .into(),
        );
    }
    if model.dropout > 0.0 {
        return Err(
            "checkpoints with dropout are not supported yet (the masks' call counters \
                    are not saved, so a resumed run would draw other masks): use --dropout 0"
                .into(),
        );
    }
    Ok(())
}

/// The `gpt` binary's checkpoint flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckpointArgs {
    /// Save a distributed checkpoint after every N steps (under --checkpoint-dir).
    #[arg(long, requires = "checkpoint_dir")]
    pub save_every: Option<usize>,
    /// Where checkpoints go (`D/step-00000100/`, ...).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Complete checkpoints kept; older ones are deleted.
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Write checkpoints on a background thread while training goes on.
    #[arg(long)]
    pub async_checkpoint: bool,
    /// Resume from a checkpoint directory, or from the newest complete one under a directory,
    /// under any layout.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from the weights of a Hugging Face GPT-2 or LLaMA checkpoint directory
    /// (`config.json` + safetensors), under any layout; the model is the one its config.json
    /// describes (the model-shape flags are ignored).
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub init_from_hf: Option<PathBuf>,
}

impl CheckpointArgs {
    /// The options of these flags.
    pub fn options(&self) -> CheckpointOptions {
        CheckpointOptions {
            dir: self.checkpoint_dir.clone(),
            save_every: self.save_every.unwrap_or(0),
            keep: self.keep_checkpoints,
            asynchronous: self.async_checkpoint,
            resume: self.resume.clone(),
            init_from_hf: self.init_from_hf.clone(),
        }
    }
}
