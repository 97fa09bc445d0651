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

use burn_parallel::tensor_parallel::SeededDropout;

use crate::gpt::{Block, Gpt};
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

/// Whether a run of `now` can continue a checkpoint saved by a run of `saved`: the same model,
/// batch, sequence length and accumulation, and no more steps saved than this run has.
///
/// # Errors
/// A sentence naming what differs.
pub(crate) fn resumable(saved: &TrainConfig, now: &TrainConfig) -> Result<(), String> {
    let differs = |what: &str, saved: String, now: String| {
        format!("saved with {what} {saved}, this run has {now}: resume with the same {what}")
    };
    if saved.model != now.model {
        let (s, n) = (format!("{:?}", saved.model), format!("{:?}", now.model));
        return Err(differs("model", s, n));
    }
    for (what, s, n) in [
        ("batch_size", saved.batch_size, now.batch_size),
        ("seq_len", saved.seq_len, now.seq_len),
        ("grad_accum", saved.grad_accum, now.grad_accum),
    ] {
        if s != n {
            return Err(differs(what, s.to_string(), n.to_string()));
        }
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
