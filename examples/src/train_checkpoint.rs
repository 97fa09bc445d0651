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
//!
//! **Dropout.** A mask is a function of the seed, the layer, the data-parallel stream (the
//! data-parallel rank), the layer's call counter and the element's position in the rank's
//! micro-batch ([`SeededDropout`]). The counters are saved (each rank's, by logical layer name)
//! and restored, so a resumed run draws the masks the saving run would have drawn: bit for bit
//! at the same layout, and within 1e-5 at another tensor-parallel, sequence-parallel or ZeRO
//! layout with the *same data-parallel size and gradient accumulation* (their masks do not
//! depend on those). The masks do depend on the data-parallel size (each replica draws its own
//! stream over its own rows), so at another data-parallel size a resumed run trains on, as
//! that layout always does, other masks: a valid continuation, not the saving run's curve.

use std::path::PathBuf;

use burn_parallel::checkpoint::Checkpoint;
use burn_parallel::precision::LossScalerState;
use burn_parallel::tensor_parallel::SeededDropout;
use burn_parallel::train::SaveState;
use serde::{Deserialize, Serialize};

use crate::gpt::{Block, Gpt};
use crate::train::TrainConfig;
use burn_parallel_train::{Built, ParallelModel};

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
}

/// The trainer's state besides tensors, kept by rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TrainerState {
    /// The loss of every step done.
    pub losses: Vec<f64>,
    /// The run's configuration (the model must match on resume).
    pub config: TrainConfig,
}

impl TrainerState {
    /// The state of a run of `config` after `losses`, as saved.
    pub(crate) fn json(losses: &[f64], config: &TrainConfig) -> serde_json::Value {
        let state = TrainerState {
            losses: losses.to_vec(),
            config: config.clone(),
        };
        serde_json::to_value(state).expect("the trainer state serialises")
    }
}

/// The dropout layers of a block whose logical path is `prefix` (`blocks.3`).
pub(crate) fn block_dropouts(prefix: &str, block: &Block, out: &mut Vec<(String, SeededDropout)>) {
    let mut add = |name: &str, drop: &Option<SeededDropout>| {
        if let Some(drop) = drop {
            out.push((format!("{prefix}.{name}"), drop.clone()));
        }
    };
    add("attn.attn_drop", &block.attn.attn_drop);
    add("attn.resid_drop", &block.attn.resid_drop);
    if let Some(mlp) = &block.mlp {
        add("mlp.drop", &mlp.drop);
    }
    add("moe_drop", &block.moe_drop);
}

/// The dropout layers of `model` by logical name (`drop`, `blocks.3.attn.attn_drop`, ...):
/// clones that share the model's call counters ([`SeededDropout::calls`]). Empty without
/// dropout.
pub(crate) fn dropout_layers(model: &Gpt) -> Vec<(String, SeededDropout)> {
    let mut out = Vec::new();
    if let Some(drop) = &model.drop {
        out.push(("drop".to_string(), drop.clone()));
    }
    for (i, block) in model.blocks.iter().enumerate() {
        block_dropouts(&format!("blocks.{i}"), block.skeleton(), &mut out);
    }
    out
}

/// Key of the loss scaler's state ([`LossScalerState`], `null` without a scaler) in the trainer
/// state, whichever engine saved it.
pub use burn_parallel::train::LOSS_SCALER;

/// The loss scaler's state saved in `checkpoint`'s trainer state (`None`: saved without one).
///
/// # Errors
/// A state that does not read as [`LossScalerState`], naming the checkpoint.
pub(crate) fn saved_loss_scaler(
    checkpoint: &Checkpoint,
) -> Result<Option<LossScalerState>, String> {
    burn_parallel::train::saved_loss_scaler(checkpoint)
        .map_err(|e| format!("{}: {e}", checkpoint.dir().display()))
}

/// The trainer state of `checkpoint`, checked against the run that resumes from it.
///
/// # Errors
/// A sentence naming what differs.
pub(crate) fn resume_state(
    checkpoint: &Checkpoint,
    config: &TrainConfig,
) -> Result<TrainerState, String> {
    let state: TrainerState = serde_json::from_value(
        burn_parallel_train::saved_state(checkpoint).clone(),
    )
    .map_err(|e| {
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

/// What the GPT trainer saves with its checkpoints besides parameters and optimizer state, and
/// restores from them ([`burn_parallel_train::RunState`]): the losses and the run's
/// configuration (a resumed run must have the same model and batch), each rank's dropout
/// positions, and the steps the loss scaler skipped.
pub(crate) struct GptRunState<'a> {
    config: &'a TrainConfig,
    /// Print which checkpoint a resume loads (rank 0).
    announce: bool,
    /// Steps the saved run skipped on a loss-scaling overflow (when this run scales too).
    pub(crate) skipped: usize,
}

impl<'a> GptRunState<'a> {
    pub(crate) fn new(config: &'a TrainConfig, announce: bool) -> Self {
        Self {
            config,
            announce,
            skipped: 0,
        }
    }
}

impl<P: ParallelModel> burn_parallel_train::RunState<P> for GptRunState<'_> {
    fn save(&self, losses: &[f32], _: &Built<P>) -> SaveState {
        let losses: Vec<f64> = losses.iter().map(|&l| f64::from(l)).collect();
        SaveState::from(TrainerState::json(&losses, self.config))
    }

    fn restore(
        &mut self,
        checkpoint: &Checkpoint,
        _: &Built<P>,
    ) -> Result<Vec<f32>, burn_parallel::Error> {
        let fail = |e: String| burn_parallel::Error::invalid("checkpoint", e);
        let state = resume_state(checkpoint, self.config).map_err(fail)?;
        // The steps the saved run skipped count when this run scales its loss too.
        if self.config.loss_scaler().is_some()
            && let Some(saved) = saved_loss_scaler(checkpoint).map_err(fail)?
        {
            self.skipped = saved.skipped;
        }
        if self.announce {
            println!(
                "resuming from {}",
                burn_parallel_train::Resumed::of(checkpoint)
            );
        }
        // The losses were f32 before they were saved as f64.
        Ok(state.losses.iter().map(|&l| l as f32).collect())
    }
}
