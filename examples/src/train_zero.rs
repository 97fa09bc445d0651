//! GPT training with ZeRO stages 1-3 (and hybrid sharding) from `burn-zero`.
//!
//! [`FsdpGpt`] is the stage-3 wrapping plan of the GPT (torchtitan's `apply_fsdp`): one unit per
//! transformer block, one for the embeddings, one for the final norm and head; the model code
//! is untouched. [`train_gpt_zero`] is the training loop of [`crate::train::train_gpt`] with the
//! gradient reduction and optimizer step done by `burn-zero`, plus sharded checkpoints;
//! [`train_gpt_reference`] is single-device training with global-norm clipping, the oracle of
//! the clipping tests.
//!
//! Mixed precision ([`ZeroConfig::precision`]) works at every stage: the model computes in bf16
//! or f16, the loss is taken in fp32 (the logits are cast up before the cross-entropy, as
//! autocast does), master weights and AdamW state stay fp32 in `burn-zero`. With a
//! [`burn_zero::LossScaler`] in the config (f16), the loss is multiplied by the wrapper's
//! current scale before `backward` and overflowing steps are skipped by the wrapper (counted in
//! [`ZeroReport::skipped_steps`]). Stage-3 prefetch ([`ZeroConfig::prefetch`]) gathers the next
//! unit on a background thread while the current one computes ([`FsdpGpt::loss`]).

use std::path::PathBuf;
use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor};
use burn_parallel::ProcessGroup;
use burn_zero::checkpoint::{self, CheckpointReader, UnitShard};
use burn_zero::{
    FlatShard, FsdpContext, FsdpOptimizer, FsdpUnit, MemoryReport, ShardGroups, Stage, ZeroConfig,
    ZeroError, ZeroOptimizer,
};

use crate::data::{Corpus, Split};
use crate::gpt::{Block, Gpt, GptConfig};
use crate::train::{NamedParam, TrainConfig};

/// The GPT wrapped for ZeRO stage 3: embeddings, each block, and the head are FSDP units.
pub struct FsdpGpt {
    embed: FsdpUnit<Gpt>,
    blocks: Vec<FsdpUnit<Block>>,
    head: FsdpUnit<Gpt>,
    prefetch: bool,
}

impl FsdpGpt {
    /// Builds the GPT of `config` (identically on every rank, from its seed) and shards it.
    ///
    /// # Errors
    /// [`ZeroError::Config`] for tied embeddings (the embedding would belong to two units; wrap
    /// embeddings and head as one unit instead).
    pub fn new(config: &GptConfig, ctx: &std::sync::Arc<FsdpContext>) -> Result<Self, ZeroError> {
        if config.tied_embeddings {
            return Err(ZeroError::Config(
                "FsdpGpt shards embeddings and head as separate units; tied embeddings need them \
                 in one unit"
                    .into(),
            ));
        }
        let mut shell = Gpt::new(config, ctx.device());
        let blocks = std::mem::take(&mut shell.blocks)
            .into_iter()
            .map(|b| b.full())
            .collect::<Result<Vec<Block>, _>>()?;
        let embed = FsdpUnit::new(
            "embed",
            shell.clone(),
            |p| p.starts_with("wte.") || p.starts_with("wpe."),
            ctx,
        )?;
        let head = FsdpUnit::new(
            "head",
            shell,
            |p| p.starts_with("ln_f.") || p.starts_with("lm_head."),
            ctx,
        )?;
        let blocks = blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| FsdpUnit::new(&format!("blocks.{i}"), b, |_| true, ctx))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            embed,
            blocks,
            head,
            prefetch: ctx.prefetch(),
        })
    }

    /// Starts the background gather of the unit after block `i` (`None`: after the
    /// embeddings), when prefetch is on.
    fn prefetch_after(&self, i: Option<usize>) -> Result<(), ZeroError> {
        if !self.prefetch {
            return Ok(());
        }
        let next = i.map_or(0, |i| i + 1);
        match self.blocks.get(next) {
            Some(block) => block.prefetch(),
            None => self.head.prefetch(),
        }
    }

    /// Mean cross-entropy (fp32, whatever the compute dtype), gathering each unit just before
    /// its forward and releasing it after; with prefetch, unit `i + 1`'s gather runs in the
    /// background while unit `i` computes.
    ///
    /// # Errors
    /// When a gather fails.
    pub fn loss(
        &self,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
    ) -> Result<Tensor<1>, ZeroError> {
        let (mut x, pass) = {
            let embed = self.embed.gather()?;
            self.prefetch_after(None)?;
            let pass = embed.pass(&tokens, 0);
            (embed.embed(tokens, 0, &pass)?, pass)
        };
        for (i, unit) in self.blocks.iter().enumerate() {
            let block = unit.gather()?;
            self.prefetch_after(Some(i))?;
            x = block.forward(x, &pass)?;
        }
        let head = self.head.gather()?;
        Ok(head.head_loss(head.head(x)?, targets)?)
    }

    /// The shards, in unit order (embed, blocks, head).
    pub fn shards(&self) -> Vec<&FlatShard> {
        let mut v = vec![self.embed.shard()];
        v.extend(self.blocks.iter().map(|b| b.shard()));
        v.push(self.head.shard());
        v
    }

    /// The shards, mutable, in unit order.
    pub fn shards_mut(&mut self) -> Vec<&mut FlatShard> {
        let mut v = vec![self.embed.shard_mut()];
        v.extend(self.blocks.iter_mut().map(|b| b.shard_mut()));
        v.push(self.head.shard_mut());
        v
    }

    /// Releases units kept gathered (reshard-after-backward policy).
    pub fn reshard(&self) {
        self.embed.reshard();
        self.blocks.iter().for_each(|b| b.reshard());
        self.head.reshard();
    }
}

/// Checkpointing and resuming of a ZeRO run.
#[derive(Debug, Clone, Default)]
pub struct ZeroRunOptions {
    /// Resume from this checkpoint (its step becomes the first step).
    pub resume: Option<PathBuf>,
    /// Save a checkpoint after this many steps into this directory.
    pub save: Option<(usize, PathBuf)>,
    /// Gather the trained parameters whole into [`ZeroReport::final_params`] at the end (one
    /// all-gather per unit on every rank; off by default, as it holds the full model).
    pub final_params: bool,
}

/// The outcome of a ZeRO run.
#[derive(Debug, Clone)]
pub struct ZeroReport {
    /// Global mean loss of every step run.
    pub losses: Vec<f64>,
    /// Global gradient norms before clipping (when clipping is on).
    pub grad_norms: Vec<f64>,
    /// This rank's memory accounting (peaks over the last step).
    pub memory: MemoryReport,
    /// Number of parameters of the model.
    pub num_params: usize,
    /// Mean seconds per step, the first step excluded.
    pub step_seconds: f64,
    /// Steps skipped because the gradients overflowed under loss scaling.
    pub skipped_steps: usize,
    /// The loss scale after the last step (1 without loss scaling).
    pub loss_scale: f64,
    /// The trained fp32 (master) parameters, whole, by path, when
    /// [`ZeroRunOptions::final_params`] asked for them; empty otherwise.
    pub final_params: Vec<NamedParam>,
}

/// `loss * scale` for the backward (the loss itself when `scale` is 1).
fn scaled(loss: Tensor<1>, scale: f64) -> Tensor<1> {
    if scale == 1.0 { loss } else { loss * scale }
}

/// The engine of a run (one per stage family; a run holds exactly one, so the size difference
/// between the variants does not matter).
#[allow(clippy::large_enum_variant)]
enum Engine {
    Zero12 {
        model: Gpt,
        zero: ZeroOptimizer<burn::optim::AdamW>,
    },
    Zero3 {
        model: FsdpGpt,
        fsdp: FsdpOptimizer<burn::optim::AdamW>,
    },
}

/// Trains the GPT of `config` with ZeRO (`zero.stage`) over `groups` (use
/// [`ShardGroups::flat`] for plain ZeRO, [`ShardGroups::hybrid`] for HSDP), with Burn's AdamW.
/// Runs steps `start..config.steps`, where `start` is 0 or the resumed checkpoint's step.
///
/// # Errors
/// Invalid config, collective failures, checkpoint errors.
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
    let device = Device::flex().autodiff();
    let adamw = AdamWConfig::new()
        .with_weight_decay(config.weight_decay as f32)
        .build();
    let num_params = config.model.num_params();
    let mut engine = if zero.stage == Stage::Three {
        let ctx = FsdpContext::new(groups.clone(), &device, zero, config.grad_accum)?;
        let model = FsdpGpt::new(&config.model, &ctx)?;
        let units = model.shards().len();
        Engine::Zero3 {
            fsdp: FsdpOptimizer::new(&ctx, zero, adamw, units),
            model,
        }
    } else {
        let model = Gpt::new(&config.model, &device);
        let zero = ZeroOptimizer::new(&model, groups.clone(), zero.clone(), adamw)?;
        let model = zero.prepare_module(model)?;
        Engine::Zero12 { model, zero }
    };
    let start = match &options.resume {
        Some(dir) => load(&mut engine, dir, groups, &device)?,
        None => 0,
    };

    let rows_per_rank = config.batch_size / groups.data_size();
    let micro_rows = rows_per_rank / config.grad_accum;
    let mut losses = Vec::new();
    let mut grad_norms = Vec::new();
    let mut skipped_steps = 0;
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
            match &mut engine {
                Engine::Zero12 { model, zero } => {
                    let loss = model.loss(inputs, targets)?;
                    local_loss += scalar(&loss) / config.grad_accum as f64;
                    let grads = scaled(loss, zero.loss_scale()).backward();
                    let grads = GradientsParams::from_grads(grads, model);
                    zero.accumulate(model, grads)?;
                }
                Engine::Zero3 { model, fsdp } => {
                    let loss = model.loss(inputs, targets)?;
                    local_loss += scalar(&loss) / config.grad_accum as f64;
                    let grads = scaled(loss, fsdp.loss_scale()).backward();
                    fsdp.accumulate(model.shards_mut(), &grads)?;
                }
            }
        }
        let lr = config.lr_at(step);
        let info = match &mut engine {
            Engine::Zero12 { model, zero } => {
                let taken = std::mem::replace(
                    model,
                    Gpt::new(&tiny_placeholder(), &device.clone().inner()),
                );
                let (next, info) = zero.step(lr, taken)?;
                *model = next;
                info
            }
            Engine::Zero3 { model, fsdp } => {
                let info = fsdp.step(lr, model.shards_mut())?;
                model.reshard();
                info
            }
        };
        grad_norms.extend(info.grad_norm);
        skipped_steps += usize::from(info.skipped);
        losses.push(f64::from(groups.mean(local_loss as f32)?));
        if step > start {
            timed += t0.elapsed().as_secs_f64();
        }
        if let Some((at, dir)) = &options.save
            && step + 1 == *at
        {
            save(&engine, dir, groups, step + 1)?;
        }
    }
    let (memory, loss_scale) = match &engine {
        Engine::Zero12 { zero, .. } => (zero.memory(), zero.loss_scale()),
        Engine::Zero3 { fsdp, .. } => (fsdp.memory(), fsdp.loss_scale()),
    };
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

/// The whole fp32 parameters of a run, by path: every unit's shard (the master shard under
/// mixed precision) all-gathered over the shard group and cut along the unit's flat layout.
/// Every rank takes part and gets the same values.
fn gather_final_params(
    engine: &Engine,
    groups: &ShardGroups,
) -> Result<Vec<NamedParam>, ZeroError> {
    // (path prefix of the unit's layout, layout, this rank's shard)
    let units: Vec<(String, &burn_zero::flat::FlatLayout, Vec<f32>)> = match engine {
        Engine::Zero12 { model, zero } => {
            vec![(String::new(), zero.layout(), zero.param_shard(model)?)]
        }
        Engine::Zero3 { model, .. } => model
            .shards()
            .into_iter()
            .map(|s| {
                // The embedding and head units wrap a whole-GPT shell: their paths are already
                // full; a block unit is named by its path in the GPT.
                let prefix = match s.name() {
                    "embed" | "head" => String::new(),
                    block => format!("{block}."),
                };
                (prefix, s.layout(), s.values())
            })
            .collect(),
    };
    let mut params = Vec::new();
    for (prefix, layout, shard) in units {
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
        for entry in layout.entries() {
            params.push(NamedParam {
                path: format!("{prefix}{}", entry.path),
                shape: entry.shape.clone(),
                values: full[entry.offset..entry.offset + entry.numel].to_vec(),
            });
        }
    }
    Ok(params)
}

/// A one-layer, width-8 GPT: the placeholder left in the engine while the model is moved
/// through [`ZeroOptimizer::step`].
fn tiny_placeholder() -> GptConfig {
    GptConfig {
        d_ff: 8,
        ..GptConfig::new(1, 1, 1, 1, 1)
    }
}

fn save(
    engine: &Engine,
    dir: &std::path::Path,
    groups: &ShardGroups,
    step: usize,
) -> Result<(), ZeroError> {
    let meta = serde_json::json!({ "optimizer": "AdamW", "saved_by": "examples::train_zero" });
    match engine {
        Engine::Zero12 { model, zero } => {
            let range = zero.range();
            let params = zero.param_shard(model)?;
            let (state, scalars) = zero.optimizer().export(0);
            let unit = UnitShard {
                name: "model",
                layout: zero.layout(),
                range,
                params,
                state,
                scalars,
            };
            checkpoint::save(dir, groups, step, &[unit], meta)
        }
        Engine::Zero3 { model, fsdp } => {
            let units: Vec<UnitShard<'_>> = model
                .shards()
                .into_iter()
                .enumerate()
                .map(|(i, s)| {
                    let (state, scalars) = fsdp.optimizer().export(i);
                    UnitShard {
                        name: s.name(),
                        layout: s.layout(),
                        range: s.range(),
                        params: s.values(),
                        state,
                        scalars,
                    }
                })
                .collect();
            checkpoint::save(dir, groups, step, &units, meta)
        }
    }
}

fn load(
    engine: &mut Engine,
    dir: &std::path::Path,
    _groups: &ShardGroups,
    device: &Device,
) -> Result<usize, ZeroError> {
    let reader = CheckpointReader::open(dir)?;
    let inner = device.clone().inner();
    match engine {
        Engine::Zero12 { model, zero } => {
            reader.check_units(&[("model", zero.layout())])?;
            let numel = zero.layout().numel();
            let full = reader.read("model", "param", 0..numel)?;
            let taken = std::mem::replace(model, Gpt::new(&tiny_placeholder(), &inner));
            *model = zero.set_params(taken, full)?;
            let range = zero.range();
            let state = reader.state("model", range.clone())?;
            let scalars = reader.scalars("model")?;
            zero.optimizer_mut()
                .import(0, state, &scalars, range.len(), &inner)?;
        }
        Engine::Zero3 { model, fsdp } => {
            let names: Vec<(String, burn_zero::flat::FlatLayout)> = model
                .shards()
                .iter()
                .map(|s| (s.name().to_string(), s.layout().clone()))
                .collect();
            let refs: Vec<(&str, &burn_zero::flat::FlatLayout)> =
                names.iter().map(|(n, l)| (n.as_str(), l)).collect();
            reader.check_units(&refs)?;
            for (i, shard) in model.shards_mut().into_iter().enumerate() {
                let range = shard.range();
                shard.set_values(reader.read(shard.name(), "param", range.clone())?)?;
                let state = reader.state(shard.name(), range.clone())?;
                let scalars = reader.scalars(shard.name())?;
                fsdp.optimizer_mut()
                    .import(i, state, &scalars, range.len(), &inner)?;
            }
        }
    }
    Ok(reader.manifest().step)
}

fn scalar(t: &Tensor<1>) -> f64 {
    t.clone()
        .into_data()
        .try_into_vec_as::<f64>()
        .expect("a float")[0]
}

/// Single-device (or DDP) training with Burn's AdamW and global-norm clipping of the averaged
/// gradient: the oracle of the sharded clipping. Returns the losses.
///
/// # Errors
/// When a collective fails.
pub fn train_gpt_reference(
    group: &ProcessGroup,
    config: &TrainConfig,
    corpus: &Corpus,
    max_grad_norm: Option<f64>,
) -> burn_parallel::Result<Vec<f64>> {
    let config = TrainConfig {
        max_grad_norm,
        eval_batches: 0,
        sample_len: 0,
        ..config.clone()
    };
    Ok(crate::train::train_gpt(group, &config, corpus, &mut |_| {})?.losses)
}

/// Prints (or returns) a one-line memory summary for the `gpt` binary.
pub fn memory_line(rank: usize, report: &MemoryReport) -> String {
    format!("[rank {rank}] zero memory: {}", report.summary())
}
