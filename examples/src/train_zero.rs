//! GPT training with ZeRO stages 1 and 2 (and hybrid sharding) from `burn-zero`.
//!
//! [`train_gpt_zero`] is the training loop of [`crate::train::train_gpt`] with the gradient
//! reduction and optimizer step done by [`ZeroOptimizer`], plus sharded checkpoints. Stage 3
//! is FSDP ([`burn_zero::Fsdp`]): the layout-generic trainer runs it
//! ([`crate::train::train_gpt_parallel`] with `Parallelism { zero: Some(Stage::Three), .. }`,
//! `gpt --zero 3`), composed with tensor, context and expert parallelism.
//!
//! Mixed precision ([`ZeroConfig::precision`]) works at both stages: the model computes in bf16
//! or f16, the loss is taken in fp32 (the logits are cast up before the cross-entropy, as
//! autocast does), master weights and AdamW state stay fp32 in `burn-zero`. With a
//! [`burn_zero::LossScaler`] in the config (f16), the loss is multiplied by the wrapper's
//! current scale before `backward` and overflowing steps are skipped by the wrapper (counted in
//! [`ZeroReport::skipped_steps`]).
//!
//! Checkpoints ([`ZeroRunOptions::checkpoints`]) are the distributed checkpoints of
//! [`burn_parallel::checkpoint`], as the other trainers write them
//! ([`crate::train_checkpoint`]): the logical parameters (the fp32 master weights, whatever the
//! compute dtype) and AdamW state, each rank writing its flat shard's segments of them
//! ([`burn_zero::dcp`]); the losses so far, the configuration and the loss scaler's state in
//! the trainer state. So a checkpoint saved at one stage and shard count resumes at any other,
//! in fp32 or mixed precision, and in `train_gpt_checkpointed`'s layouts (DDP, tp, `Fsdp<M>`).

use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use burn_parallel::checkpoint::{Checkpoint, Checkpointer, OPTIM, Piece, merged_scalars};
use burn_parallel::nn::TpContext;
use burn_zero::{MemoryReport, ShardGroups, Stage, ZeroConfig, ZeroError, ZeroOptimizer};

use crate::data::{Corpus, Split};
use crate::gpt::{Gpt, GptConfig};
use crate::train::{NamedParam, TrainConfig, TrainDevice};
use crate::train_checkpoint::{self, CheckpointOptions, LOSS_SCALER, OPTIM_SCALARS, TrainerState};

/// The device, checkpointing and resuming of a ZeRO run.
#[derive(Debug, Clone, Default)]
pub struct ZeroRunOptions {
    /// Where and how often to save, and what to resume from (a checkpoint directory, or the
    /// newest complete one under a directory): the options of `gpt --save-every N
    /// --checkpoint-dir D [--keep-checkpoints K] [--async-checkpoint] | --resume D`.
    /// `init_from_hf` is refused here (the trainer of [`crate::train`] takes it). With hybrid
    /// sharding, replica 0 writes; every rank reads what it needs.
    pub checkpoints: CheckpointOptions,
    /// Gather the trained parameters whole into [`ZeroReport::final_params`] at the end (one
    /// all-gather per unit on every rank; off by default, as it holds the full model).
    pub final_params: bool,
    /// Where the engine trains (`gpt --device`): the model, its shards and the batches live
    /// there. A device this build or machine cannot open is an error, never a silent fallback.
    pub device: TrainDevice,
}

/// The outcome of a ZeRO run.
#[derive(Debug, Clone)]
pub struct ZeroReport {
    /// Global mean loss of every step (a resumed run: those of the checkpoint, then its own).
    pub losses: Vec<f64>,
    /// Global gradient norms before clipping (when clipping is on).
    pub grad_norms: Vec<f64>,
    /// This rank's memory accounting (peaks over the last step).
    pub memory: MemoryReport,
    /// Number of parameters of the model.
    pub num_params: usize,
    /// Mean seconds per step, the first step excluded.
    pub step_seconds: f64,
    /// Steps skipped because the gradients overflowed under loss scaling (a resumed run counts
    /// those before the checkpoint too).
    pub skipped_steps: usize,
    /// The loss scale after the last step (1 without loss scaling).
    pub loss_scale: f64,
    /// The trained fp32 (master) parameters, whole, by path, when
    /// [`ZeroRunOptions::final_params`] asked for them; empty otherwise.
    pub final_params: Vec<NamedParam>,
}

/// The model and ZeRO's optimizer of a run.
struct Engine {
    model: Gpt,
    zero: ZeroOptimizer<burn::optim::AdamW>,
}

/// Trains the GPT of `config` with ZeRO (`zero.stage`) over `groups` (use
/// [`ShardGroups::flat`] for plain ZeRO, [`ShardGroups::hybrid`] for HSDP), with Burn's AdamW.
/// Runs steps `start..config.steps`, where `start` is 0 or the resumed checkpoint's step.
///
/// # Errors
/// Invalid config or checkpoint options, collective failures, checkpoint errors (a checkpoint
/// of another model or run configuration is refused, naming what differs).
pub fn train_gpt_zero(
    groups: &ShardGroups,
    config: &TrainConfig,
    zero: &ZeroConfig,
    corpus: &Corpus,
    options: &ZeroRunOptions,
) -> Result<ZeroReport, ZeroError> {
    config
        .validate(groups.data_size())
        .map_err(ZeroError::Config)?;
    let device = options
        .device
        .device()
        .map_err(|e| ZeroError::Config(format!("--device {:?}: {e}", options.device)))?
        .autodiff();
    let adamw = AdamWConfig::new()
        .with_weight_decay(config.weight_decay as f32)
        .build();
    let num_params = config.model.num_params();
    if zero.stage == Stage::Three {
        return Err(ZeroError::Config(
            "stage 3 is FSDP (burn_zero::Fsdp): train it with train::train_gpt_parallel and \
             Parallelism { zero: Some(Stage::Three), .. } (gpt --zero 3)"
                .into(),
        ));
    }
    let model = Gpt::new(&config.model, &device);
    let zero = ZeroOptimizer::new(&model, groups.clone(), zero.clone(), adamw)?;
    let model = zero.prepare_module(model)?;
    let mut engine = Engine { model, zero };
    let checkpoints = &options.checkpoints;
    checkpoints.validate().map_err(ZeroError::Config)?;
    if checkpoints.init_from_hf.is_some() {
        return Err(ZeroError::Config(
            "train_gpt_zero does not start from Hugging Face weights: use \
             train::train_gpt_checkpointed (gpt --init-from-hf), which runs ZeRO too"
                .into(),
        ));
    }
    if checkpoints.active() {
        train_checkpoint::check_layout(&config.model).map_err(ZeroError::Config)?;
    }
    let mut losses = Vec::new();
    let mut skipped_steps = 0;
    let start = match &checkpoints.resume {
        Some(path) => {
            let resumed = load(&mut engine, path, config, &device.clone().inner())?;
            losses = resumed.losses;
            skipped_steps = resumed.skipped;
            resumed.step
        }
        None => 0,
    };
    // Replica 0 writes (with hybrid sharding the other replicas hold the same shards).
    let writer = groups.replicate().is_none_or(|r| r.rank() == 0);
    let mut saver = match (&checkpoints.dir, checkpoints.save_every) {
        (Some(dir), every) if every > 0 && writer => {
            Some(Checkpointer::new(dir, checkpoints.keep, groups.shard())?)
        }
        _ => None,
    };

    let rows_per_rank = config.batch_size / groups.data_size();
    let micro_rows = rows_per_rank / config.grad_accum;
    let mut grad_norms = Vec::new();
    let mut timed = 0.0;
    for step in start..config.steps {
        let t0 = Instant::now();
        let mut local_loss = 0.0;
        for micro in 0..config.grad_accum {
            let first = groups.data_rank() * rows_per_rank + micro * micro_rows;
            let batch = corpus.batch_rows(
                step as u64,
                first..first + micro_rows,
                config.seq_len,
                Split::Train,
            );
            let (inputs, targets) = batch.to_tensors(&device);
            let Engine { model, zero } = &mut engine;
            let loss = model.loss(inputs, targets)?;
            local_loss += scalar(&loss) / config.grad_accum as f64;
            let grads = zero.scaled_loss(loss).backward();
            let grads = GradientsParams::from_grads(grads, model);
            zero.accumulate(model, grads)?;
        }
        let lr = config.lr_at(step);
        let Engine { model, zero } = &mut engine;
        let taken = std::mem::replace(
            model,
            Gpt::new(&tiny_placeholder(), &device.clone().inner()),
        );
        let (next, info) = zero.step(lr, taken)?;
        *model = next;
        grad_norms.extend(info.grad_norm);
        skipped_steps += usize::from(info.skipped);
        losses.push(f64::from(groups.mean(local_loss as f32)?));
        if step > start {
            timed += t0.elapsed().as_secs_f64();
        }
        if let Some(saver) = saver.as_mut().filter(|_| checkpoints.saves_after(step)) {
            let (pieces, state, rank_state) = checkpoint_of(&engine, config, &losses)?;
            train_checkpoint::save_after(saver, checkpoints, step, pieces, (state, rank_state))?;
        }
    }
    if let Some(saver) = saver.as_mut() {
        saver.wait()?;
    }
    let (memory, loss_scale) = (engine.zero.memory(), engine.zero.loss_scale());
    let final_params = if options.final_params {
        gather_final_params(&engine, groups)?
    } else {
        Vec::new()
    };
    Ok(ZeroReport {
        final_params,
        losses,
        grad_norms,
        memory,
        num_params,
        step_seconds: timed / (config.steps.saturating_sub(start + 1)).max(1) as f64,
        skipped_steps,
        loss_scale,
    })
}

/// The whole fp32 parameters of a run, by path: the flat shard (the master shard under mixed
/// precision) all-gathered over the shard group and cut along the flat layout. Every rank takes
/// part and gets the same values.
fn gather_final_params(
    engine: &Engine,
    groups: &ShardGroups,
) -> Result<Vec<NamedParam>, ZeroError> {
    let (layout, shard) = (
        engine.zero.layout(),
        engine.zero.param_shard(&engine.model)?,
    );
    let len = shard.len();
    let full = groups
        .shard()
        .all_gather_data(burn::tensor::TensorData::new(shard, [len]), 0)?
        .try_into_vec::<f32>()
        .map_err(|e| ZeroError::Config(format!("gathered parameters: {e:?}")))?;
    if full.len() != layout.numel() {
        return Err(ZeroError::Config(format!(
            "gathered {} parameter values for a flat space of {}",
            full.len(),
            layout.numel()
        )));
    }
    Ok(layout
        .entries()
        .iter()
        .map(|entry| NamedParam {
            path: entry.path.clone(),
            shape: entry.shape.clone(),
            values: full[entry.offset..entry.offset + entry.numel].to_vec(),
        })
        .collect())
}

/// A one-layer, width-8 GPT: the placeholder left in the engine while the model is moved
/// through [`ZeroOptimizer::step`].
fn tiny_placeholder() -> GptConfig {
    GptConfig {
        d_ff: 8,
        ..GptConfig::new(1, 1, 1, 1, 1)
    }
}

/// The tensor-parallel context of the engines' models (none: `train_gpt_zero` is pure data
/// parallelism).
fn no_tp() -> TpContext {
    TpContext::single()
}

/// What this rank saves: its pieces of the parameters (fp32 masters) and AdamW state, the
/// trainer state (losses so far, configuration, loss scaler) and its rank state (the
/// optimizer's scalars by logical parameter).
fn checkpoint_of(
    engine: &Engine,
    config: &TrainConfig,
    losses: &[f64],
) -> Result<(Vec<Piece>, serde_json::Value, serde_json::Value), ZeroError> {
    let tp = no_tp();
    // Plain ZeRO and replica 0 of hybrid sharding write whole shards.
    let copies = (1, 0);
    let Engine { model, zero } = engine;
    let mut pieces = zero.checkpoint_params(model, &tp, copies)?;
    let (state, scalars) = zero.checkpoint_state(&tp, copies)?;
    pieces.extend(state);
    let scaler = zero.scaler().map(|s| s.state());
    let mut state = TrainerState::json(losses, config);
    state[LOSS_SCALER] = serde_json::to_value(scaler).expect("the scaler state serialises");
    let rank_state = serde_json::json!({ OPTIM_SCALARS: scalars });
    Ok((pieces, state, rank_state))
}

/// What a resume restored besides tensors.
struct Resumed {
    step: usize,
    losses: Vec<f64>,
    skipped: usize,
}

/// Restores the engine from the checkpoint at `path` (or the newest complete one under it),
/// saved under any layout, stage, shard count or precision.
fn load(
    engine: &mut Engine,
    path: &std::path::Path,
    config: &TrainConfig,
    device: &Device,
) -> Result<Resumed, ZeroError> {
    let checkpoint = train_checkpoint::open_resume(path)?;
    let trainer = train_checkpoint::resume_state(&checkpoint, config).map_err(ZeroError::Config)?;
    let saved_scaler =
        train_checkpoint::saved_loss_scaler(&checkpoint).map_err(ZeroError::Config)?;
    let tp = no_tp();
    let scalars = merged_scalars(&checkpoint, OPTIM_SCALARS);
    let Engine { model, zero } = engine;
    let expected = burn_zero::dcp::logical_shapes(&tp, "", zero.layout())?;
    check_model(&checkpoint, &expected)?;
    let taken = std::mem::replace(model, Gpt::new(&tiny_placeholder(), device));
    *model = zero.load_checkpoint_params(taken, &checkpoint, &tp)?;
    zero.load_checkpoint_state(&checkpoint, &tp, &scalars)?;
    // A run without a scaler ignores a saved one; a run with one whose checkpoint has none
    // (an fp32 run's) starts from its configured scale.
    let mut skipped = 0;
    if let Some(saved) = saved_scaler
        && zero.restore_loss_scaler(&saved)?
    {
        skipped = saved.skipped;
    }
    Ok(Resumed {
        step: checkpoint.step(),
        losses: trainer.losses,
        skipped,
    })
}

/// Refuses a checkpoint of another model: its parameters must be `expected` (name, shape);
/// optimizer state is checked as it is read.
fn check_model(
    checkpoint: &Checkpoint,
    expected: &[(String, Vec<usize>)],
) -> Result<(), ZeroError> {
    let mut names: Vec<(&str, &[usize])> = expected
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    names.extend(
        checkpoint
            .manifest()
            .tensors
            .iter()
            .filter(|(k, _)| k.starts_with(OPTIM))
            .map(|(k, t)| (k.as_str(), t.shape.as_slice())),
    );
    Ok(checkpoint.check(names)?)
}

fn scalar(t: &Tensor<1>) -> f64 {
    t.clone()
        .into_data()
        .try_into_vec_as::<f64>()
        .expect("a float")[0]
}

/// Prints (or returns) a one-line memory summary for the `gpt` binary.
pub fn memory_line(rank: usize, report: &MemoryReport) -> String {
    format!("[rank {rank}] zero memory: {}", report.summary())
}
