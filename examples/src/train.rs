//! The GPT training loop, shared by the `gpt` binary and the parity tests.
//!
//! One function, [`train_gpt`], runs on every rank under any [`Layout`]: each rank builds its
//! part of the same model from the seed, takes its rows of the step's global batch, and the
//! library's builder and loop ([`burn_parallel_train::build_from`], [`fit_with`]) train it.
//! Whatever the layout, the losses are those of single-device training on the same global
//! batch.
//!
//! **Checkpoints** (`config.save`, `config.resume`; `gpt --save D --save-every N`, `--resume D`)
//! hold the logical (single-device) parameters and optimizer state, each rank saving the part
//! it holds, and the run's losses and settings ([`SavedConfig`]). The learning-rate schedule
//! and the data are functions of the step, so the step is their position: a resumed run
//! continues the saving run's loss curve, bit for bit under the same layout and within the
//! rounding of the other reduction order under another.
//!
//! **Dropout.** A mask is a function of the seed, the layer, the data-parallel stream, the
//! layer's call counter and the element's position in the rank's micro-batch
//! ([`SeededDropout`](burn_parallel::tensor_parallel::SeededDropout)). The counters are saved
//! and restored, so a resumed run draws the masks the saving run would have drawn: bit for bit
//! at the same layout, within 1e-5 at another tensor-parallel, sequence-parallel or ZeRO layout
//! with the same data-parallel size and accumulation. At another data-parallel size each
//! replica draws its own stream over its own rows: a valid continuation with other masks.

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData, activation};
use burn_moe::MoeStats;
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::precision::LossScaler;
use burn_parallel::{ProcessGroup, ReduceOp};
use burn_parallel_train::{
    Built, CheckpointPolicy, FitConfig, Fitted, Layout, MicroBatch, ParallelModel, Resumed,
    SavedConfig, StepLog, StepSettings, StopFlag, Trainee, build_from, fit_with, open_checkpoint,
};
use burn_zero::memory::Category;
use serde::{Deserialize, Serialize};

use crate::data::{Corpus, Split};
use crate::gpt::{Gpt, GptConfig};
use crate::init::splitmix64;

/// Everything that defines a training run (the model included). A key it does not know is an
/// error, not a silent default ([`TrainConfig::from_toml`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// The model.
    pub model: GptConfig,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per optimizer step, over all ranks and micro-steps (the global batch).
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Micro-steps per optimizer step (gradient accumulation); communication happens once.
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps, then cosine decay to 10% of `lr`.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Gradient bucket size of the data-parallel all-reduce, in MB.
    pub bucket_mb: f64,
    /// Validation batches (of `batch_size` sequences) evaluated at the end.
    pub eval_batches: usize,
    /// Bytes generated at the end.
    pub sample_len: usize,
    /// Prompt of the generated sample.
    pub prompt: String,
    /// Clips the global norm of the averaged gradient to this value (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    /// The arithmetic of the forward and backward (`gpt --precision`): fp32, or bf16/fp16 with
    /// fp32 master weights and optimizer state.
    pub precision: Precision,
    /// Average the gradients in fp32 under bf16 compute (`gpt --reduce-fp32`; torch FSDP's
    /// `MixedPrecision(reduce_dtype=torch.float32)`, Megatron-LM's
    /// `--accumulate-allreduce-grads-in-fp32`): twice the reduction's bytes for the rounding of
    /// bf16 sums. fp16 already reduces in fp32; fp32 runs are unaffected.
    pub reduce_fp32: bool,
    /// Dynamic loss scaling (`gpt --loss-scale S --loss-scale-window N`). `None`: fp16 runs
    /// scale from 65536, doubling after 2000 clean steps; bf16 and fp32 runs are not scaled.
    /// `Some`: a run of any precision scales this way (under fp32 it only exercises the
    /// machinery: power-of-two scales change no bit).
    pub loss_scale: Option<LossScale>,
    /// The device the run trains on: the `--device` flag's (not a key of the config file, nor
    /// saved with checkpoints: a run resumes on any device).
    #[serde(skip)]
    pub device: TrainDevice,
    /// Saving (`gpt --save D --save-every N`; `None`: never). Like the two fields below, not a
    /// key of the config file nor saved with checkpoints: where a run saves and starts from is
    /// not what it trains.
    #[serde(skip)]
    pub save: Option<CheckpointPolicy>,
    /// Resume from this checkpoint, or the newest complete one under this directory, saved
    /// under any layout (`gpt --resume D`); the run continues its losses and its masks.
    #[serde(skip)]
    pub resume: Option<PathBuf>,
    /// Start (at step 0) from the weights of this Hugging Face checkpoint directory
    /// ([`crate::hf::gpt_tensors_for`]; `gpt --init-from-hf D`): the run's model must be the one
    /// its `config.json` describes, up to seed, dropout and fused kernels.
    #[serde(skip)]
    pub init_from_hf: Option<PathBuf>,
    /// Stops every rank after the same step, saving first when `save` is set (`gpt` sets it on
    /// Ctrl-C and SIGTERM).
    #[serde(skip)]
    pub stop: Option<StopFlag>,
}

/// The run settings of the library the config names: its arithmetic, loss scaling and device.
pub use burn_parallel_train::{LossScale, Precision, TrainDevice};

impl Default for TrainConfig {
    fn default() -> Self {
        let mut model = GptConfig::new(256, 2, 4, 128, 64);
        model.seed = 42;
        // The fastest correct path: the fused kernels (CPU kernels on Flex, CubeCL on WGPU).
        model.fused = true;
        Self {
            model,
            steps: 600,
            batch_size: 32,
            seq_len: 64,
            grad_accum: 1,
            lr: 3e-3,
            warmup_steps: 20,
            weight_decay: 0.0,
            bucket_mb: 25.0,
            eval_batches: 8,
            sample_len: 200,
            prompt: "And God said, ".into(),
            max_grad_norm: None,
            precision: Precision::F32,
            reduce_fp32: false,
            loss_scale: None,
            device: TrainDevice::Flex,
            save: None,
            resume: None,
            init_from_hf: None,
            stop: None,
        }
    }
}

impl TrainConfig {
    /// The library's precision policy of the run: [`Self::precision`]'s, reducing in fp32 with
    /// [`Self::reduce_fp32`].
    pub fn precision_policy(&self) -> burn_parallel::precision::MixedPrecision {
        let policy = self.precision.policy();
        match self.reduce_fp32 {
            true => policy.with_reduce_dtype(burn::tensor::DType::F32),
            false => policy,
        }
    }

    /// The dynamic loss scaler of the run ([`Self::loss_scale`]; `None`: the loss is not
    /// scaled).
    pub fn loss_scaler(&self) -> Option<LossScaler> {
        match self.loss_scale {
            Some(s) => Some(s.scaler()),
            None => self.precision.scaler(),
        }
    }

    /// Reads a run from TOML (`gpt --config`): the fields it omits keep their defaults, and a
    /// key it does not know (a misspelling, another trainer's name) is refused with the nearest
    /// known key when one is close.
    ///
    /// # Errors
    /// The TOML error, with the suggestion.
    ///
    /// # Example
    /// ```
    /// use examples::train::TrainConfig;
    ///
    /// assert_eq!(TrainConfig::from_toml("lr = 0.01").unwrap().lr, 0.01);
    /// let err = TrainConfig::from_toml("stpes = 10").unwrap_err();
    /// assert!(err.contains("did you mean `steps`"), "{err}");
    /// ```
    pub fn from_toml(text: &str) -> Result<Self, String> {
        burn_parallel_train::from_toml(text)
    }

    /// Checks the settings' ranges (each named as its flag or TOML key) and that the run can be
    /// split over `ranks` data-parallel ranks.
    ///
    /// # Errors
    /// A message saying which setting to change.
    pub fn validate(&self, ranks: usize) -> Result<(), String> {
        self.model.validate().map_err(|e| e.to_string())?;
        if ranks == 0 || self.grad_accum == 0 || self.steps == 0 || self.seq_len == 0 {
            return Err("ranks, grad_accum, steps and seq_len must be at least 1".into());
        }
        if self.batch_size == 0 {
            return Err("batch_size (--batch-size) must be at least 1".into());
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            let mb = self.bucket_mb;
            return Err(format!(
                "bucket_mb (--bucket-mb) must be a finite number above 0, got {mb}"
            ));
        }
        // The library's ranges: the learning rate, clipping, weight decay, loss scaling.
        self.lr_schedule().validate().map_err(|e| e.to_string())?;
        self.step_settings().validate().map_err(|e| e.to_string())?;
        let split = ranks.checked_mul(self.grad_accum);
        if split.is_none_or(|n| !self.batch_size.is_multiple_of(n)) {
            let multiple = split.map_or_else(|| "their product".to_string(), |n| n.to_string());
            return Err(format!(
                "the global batch of {} sequences cannot be split evenly over {ranks} ranks x {} \
                 micro-steps; use a multiple of {multiple}",
                self.batch_size, self.grad_accum,
            ));
        }
        if self.seq_len > self.model.max_seq_len {
            return Err(format!(
                "seq_len {} exceeds the model's max_seq_len {}",
                self.seq_len, self.model.max_seq_len
            ));
        }
        if self.model.vocab_size < 256 {
            return Err("byte-level tokens need vocab_size >= 256".into());
        }
        if self.resume.is_some() && self.init_from_hf.is_some() {
            return Err(
                "--resume and --init-from-hf both say where the weights come from: give \
                        one (a resumed run already holds the weights it started from)"
                    .into(),
            );
        }
        Ok(())
    }

    /// Checks that `world` ranks can run this config under `layout`, before any rank builds
    /// anything: the layout's rules ([`Layout::validate`]) and the config's.
    ///
    /// # Errors
    /// A message saying which setting to change.
    pub fn validate_layout(&self, layout: &Layout, world: usize) -> Result<(), String> {
        layout
            .validate(world, &self.step_settings().workload(&self.model))
            .map_err(|e| e.to_string())?;
        self.validate(layout.data_parallel_size(world))
    }

    /// What a run checks before it builds anything on `world` ranks under `layout`,
    /// `ranks_here` of them in this process: the layout against the config
    /// ([`Self::validate_layout`]), then the memory a rank needs ([`Self::check_memory`]).
    ///
    /// # Errors
    /// The first refusal, naming its setting.
    pub fn check(&self, layout: &Layout, world: usize, ranks_here: usize) -> Result<(), String> {
        self.validate_layout(layout, world)?;
        self.check_memory(layout, world, ranks_here)
    }

    /// The run as the memory planner sees it on `world` ranks under `layout`: the global
    /// batch, each data-parallel rank's micro-batch, the precision, the attention the kernels
    /// keep.
    pub fn planner_training(
        &self,
        layout: &Layout,
        world: usize,
    ) -> burn_parallel::planner::Training {
        use burn_parallel::planner::{Attention, Training};
        let dims = layout.dims(world);
        let dp = dims.dp_replicate * dims.dp_shard;
        Training {
            micro_batch: (self.batch_size / (dp * self.grad_accum).max(1)).max(1),
            mixed_precision: self.precision != Precision::F32,
            bucket_bytes: (self.bucket_mb * 1024.0 * 1024.0) as usize,
            attention: match self.model.fused {
                true => Attention::Flash,
                false => Attention::Materialized,
            },
            dropout: self.model.dropout > 0.0,
            fused: self.model.fused,
            ..Training::new(world, self.batch_size, self.seq_len)
        }
    }

    /// Refuses, before anything is allocated, a run that cannot fit under `layout` on `world`
    /// ranks, `ranks_here` of them in this process ([`burn_parallel_train::check_memory`]).
    ///
    /// # Errors
    /// A message with the figures and the settings to change.
    pub fn check_memory(
        &self,
        layout: &Layout,
        world: usize,
        ranks_here: usize,
    ) -> Result<(), String> {
        let training = self.planner_training(layout, world);
        let shape = self.model.planner_shape();
        burn_parallel_train::check_memory(&shape, &training, layout, ranks_here, self.device)
            .map_err(|e| e.to_string())
    }

    /// The builder's settings of this run ([`burn_parallel_train::build`]).
    pub fn step_settings(&self) -> StepSettings {
        StepSettings {
            precision: self.precision_policy(),
            loss_scaler: self.loss_scaler(),
            max_grad_norm: self.max_grad_norm,
            adamw: FusedAdamWConfig::new().with_weight_decay(self.weight_decay as f32),
            bucket_bytes: (self.bucket_mb * 1024.0 * 1024.0) as usize,
            fused_adamw: self.model.fused,
            batch_size: self.batch_size,
            seq_len: self.seq_len,
            grad_accum: self.grad_accum,
            ..StepSettings::default()
        }
    }

    /// Learning rate at `step`: linear warm-up, then cosine decay to 10% of the peak.
    pub fn lr_at(&self, step: usize) -> f64 {
        self.lr_schedule().at(step)
    }

    /// The learning-rate schedule: linear warm-up, then cosine decay to 10% of the peak.
    pub fn lr_schedule(&self) -> burn_parallel_train::LrSchedule {
        burn_parallel_train::LrSchedule {
            peak: self.lr,
            warmup: self.warmup_steps,
            steps: self.steps,
            floor: 0.1,
        }
    }
}

/// What one optimizer step did (global figures, the same on every rank).
#[derive(Debug, Clone)]
pub struct StepStats {
    /// The library loop's figures: step (from 0), global mean loss, learning rate, seconds,
    /// tokens of the global batch per second, where this rank's time went.
    pub log: StepLog,
    /// GPT-MoE: the routing figures of each MoE layer on the step's last micro-batch (token
    /// counts over the data-parallel ranks; the auxiliary losses averaged over them). Empty
    /// for a dense GPT.
    pub moe: Vec<MoeStats>,
}

/// Seconds of one step on this rank by phase (the library's).
pub use burn_parallel::train::StepPhases;

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// Global mean loss of every step.
    pub losses: Vec<f64>,
    /// Mean validation loss at the end.
    pub val_loss: f64,
    /// Generated text (on group rank 0; empty elsewhere).
    pub sample: String,
    /// Mean seconds per step, the first step excluded.
    pub step_seconds: f64,
    /// Mean global tokens per second, the first step excluded.
    pub tokens_per_sec: f64,
    /// The trained model's parameters, whole (gathered from the shards under tensor
    /// parallelism), by path: what the parity tests compare with single-device training.
    pub final_params: Vec<NamedParam>,
    /// Steps skipped because the loss-scaled gradients overflowed (fp16; a resumed run counts
    /// those before the checkpoint too).
    pub skipped_steps: usize,
    /// The loss scale after the last step (1 without loss scaling).
    pub loss_scale: f64,
    /// Under FSDP (`zero` stage 3), this rank's memory of the units
    /// ([`burn_zero::FsdpPlan::memory`]): shards, gradients and AdamW state of the shards,
    /// and the units gathered at a time; under ZeRO-1/2, the sharded optimizer's
    /// ([`ZeroOptimizer::memory`]).
    pub memory: Option<burn_zero::MemoryReport>,
}

/// How the world is split for [`train_gpt`]: the library's [`Layout`] (tensor, sequence,
/// context and expert parallelism, and across them DDP, ZeRO-1/2, FSDP or HSDP).
pub type Parallelism = Layout;

/// Trains the GPT of `config` on `world` under `layout` (every rank calls it; a world of one
/// rank and the default layout is single-device training) and calls `on_step` after every
/// step: one model type ([`Gpt::build`]) under every layout, the tensor-parallel plan
/// [`Gpt::tp_plan`], the FSDP plan [`Gpt::fsdp_plan`], the library's builder and loop. Each
/// data-parallel rank takes its rows of the step's global batch in `grad_accum` micro-steps.
/// Whatever the layout, the losses and final parameters are those of single-device training on
/// the same global batch. It saves and resumes as `config.save` and `config.resume` say: any
/// layout loads what any other saved, and a resumed run continues the saving run's losses (its
/// [`TrainReport::losses`] include the steps done before the checkpoint). Pipelines are
/// [`crate::pipeline::train_gpt_pipeline`]'s, DiLoCo [`crate::train_diloco::train_gpt_diloco`]'s.
///
/// # Errors
/// An invalid config or layout as [`burn_parallel::Error::Invalid`] naming the setting, before
/// any communication (check it first with [`TrainConfig::check`]); a checkpoint that cannot be
/// read or is of another model ([`burn_parallel::Error::Resume`]); the run's failures (a
/// collective, a non-finite step, a failed save) typed ([`burn_parallel::Error::collective`]
/// reads a dead peer's).
pub fn train_gpt(
    world: &ProcessGroup,
    config: &TrainConfig,
    parallel: &Layout,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<TrainReport, burn_parallel::Error> {
    // Thread ranks share this process's memory.
    let ranks_here = match world.backend() {
        "local" => world.size(),
        _ => 1,
    };
    config
        .check(parallel, world.size(), ranks_here)
        .map_err(|e| burn_parallel::Error::invalid("train_gpt", e))?;
    // FSDP: the shards' gradients, held between the backward and the optimizer, in the
    // memory account; the MoE layers' routing figures on the log lines.
    let mut extra = |_: &StepLog, built: &Built<GptConfig>| {
        let m = built
            .model()
            .expect("a whole model: the pipeline is StagedGpt's");
        if let Some(plan) = &built.fsdp {
            let bytes = plan.shard_gradient_bytes(m);
            plan.memory().add(Category::Grads, bytes);
            plan.memory().sub(Category::Grads, bytes);
        }
        Ok(moe_figures(m, &built.groups.reduce)?)
    };
    // The memory account of the sharded optimizer (ZeRO-1/2) or of FSDP's units.
    let mut memory = None;
    let mut account = |built: &Built<GptConfig>| {
        memory = match (&built.fsdp, &built.zero_memory, &built.trainee) {
            (_, Some(zero), _) => Some(zero.last_step()),
            (Some(plan), None, Trainee::Whole { engine, .. }) => {
                if let Some(optim) = engine.optimizer() {
                    let muon = engine.matrix_step().map_or(0, |m| m.state_bytes());
                    let bytes = plan.optimizer_bytes(optim)? + muon;
                    plan.memory().set(Category::Optimizer, bytes);
                }
                Some(plan.memory().report())
            }
            _ => None,
        };
        Ok(())
    };
    let settings = config.step_settings();
    let run = (parallel, &config.model, &settings);
    let report = train_layout(
        world,
        config,
        run,
        corpus,
        on_step,
        (&mut extra, &mut account),
    )?;
    Ok(TrainReport { memory, ..report })
}

/// What [`train_layout`] calls on the way: after each step for the MoE layers' routing
/// figures (and any bookkeeping), and once after the last step, before the model is gathered.
type Hooks<'a, 'b, P> = (
    &'a mut MoeFigures<'b, P>,
    &'a mut dyn FnMut(&Built<P>) -> Result<(), burn_parallel::Error>,
);

/// Trains the GPT under any layout (whole, pipelined as `P` = [`crate::pipeline::StagedGpt`],
/// DiLoCo) on `world`: the device, the start (a Hugging Face checkpoint, or a resume), the
/// library's builder and loop, then the validation loss (each data-parallel rank its rows, or
/// each island's under DiLoCo), the sample and the whole model's parameters.
///
/// # Errors
/// Invalid options, the builder's, the loop's, the evaluation's.
pub(crate) fn train_layout<P: ParallelModel<Model = Gpt, Batch = crate::data::Batch>>(
    world: &ProcessGroup,
    config: &TrainConfig,
    (layout, model, settings): (&Layout, &P, &StepSettings),
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
    (extra, finish): Hooks<'_, '_, P>,
) -> Result<TrainReport, burn_parallel::Error> {
    corpus
        .check_windows(config.seq_len, config.eval_batches)
        .map_err(|e| burn_parallel::Error::invalid("--seq-len", e))?;
    let plain = config.device.device()?;
    // A compute dtype the device lacks (f16/bf16 on some WGPU adapters) is a clear error.
    settings
        .precision
        .validate(&plain)
        .map_err(|e| burn_parallel::Error::invalid("--precision", e))?;
    // A run starts from Hugging Face's parameters, or a checkpoint's (loaded in `fit`).
    let start = match (&config.resume, &config.init_from_hf) {
        (None, Some(dir)) => Some(
            crate::hf::gpt_tensors_for(dir, &config.model)
                .map_err(|e| burn_parallel::Error::invalid("init_from_hf", e))?,
        ),
        _ => None,
    };
    let device = plain.clone().autodiff();
    let built = build_from(world, layout, model, &device, settings, start.as_ref())?;
    let fitted = fit_gpt(world, built, config, corpus, on_step, extra)?;
    finish(&fitted.built)?;
    let tokens_per_sec = fitted.tokens_per_sec();
    let built = fitted.built;
    let loss_scale = built.loss_scale();
    // The validation loss: each data-parallel rank its rows (each island's under DiLoCo,
    // which may have lost others), averaged with the context-parallel ranks.
    let (group, average) = match &built.diloco {
        Some(d) => (d.loss_group().clone(), d.loss_group().clone()),
        None => (built.groups.data.clone(), built.groups.reduce.clone()),
    };
    // The fp32 master weights (ZeRO under mixed precision), this rank's part of them; a
    // pipeline's stages gathered; DiLoCo's outer model.
    let trained = built.trained(model)?.valid();
    let loss = |inputs, targets| Ok(trained.loss(inputs, targets)?);
    let val_loss = validation_loss(&group, &average, config, corpus, &plain, &loss)?;
    let full = trained.to_single(&plain)?;
    let sample = match config.sample_len > 0 && world.rank() == 0 {
        true => generate(&full, &config.prompt, config, &plain),
        false => String::new(),
    };
    Ok(TrainReport {
        losses: fitted.losses.iter().map(|&l| f64::from(l)).collect(),
        val_loss,
        sample,
        step_seconds: fitted.step_seconds,
        tokens_per_sec,
        final_params: named_params(&full),
        skipped_steps: fitted.skipped_steps,
        loss_scale,
        memory: None,
    })
}

/// What [`fit_gpt`] calls after each step for the MoE layers' routing figures.
type MoeFigures<'a, P> =
    dyn FnMut(&StepLog, &Built<P>) -> Result<Vec<MoeStats>, burn_parallel::Error> + 'a;

/// Trains `built` (any GPT layout: whole, pipelined or DiLoCo) with the library's loop: each
/// rank's rows of the corpus, saving and resuming as `config` says with the GPT's run state,
/// `on_step` fed every step's figures and `extra(log, built)`'s MoE routing figures (where
/// `extra` may also do its own bookkeeping), stopping early on `config.stop`.
///
/// # Errors
/// The loop's.
fn fit_gpt<P: burn_parallel_train::ParallelModel<Batch = crate::data::Batch>>(
    world: &ProcessGroup,
    built: Built<P>,
    config: &TrainConfig,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
    extra: &mut MoeFigures<'_, P>,
) -> Result<Fitted<P>, burn_parallel::Error> {
    let mut batch = |micro: &MicroBatch| {
        let rows = micro.rows.clone();
        Ok(corpus.batch_rows(micro.step as u64, rows, config.seq_len, Split::Train))
    };
    let mut after_step = |log: &StepLog, built: &Built<P>| {
        let moe = extra(log, built)?;
        on_step(&StepStats {
            log: log.clone(),
            moe,
        });
        Ok(())
    };
    // Which checkpoint a resume loads, before it loads: rank 0 reads its manifest to say so.
    let opened = (world.rank() == 0).then(|| config.resume.as_deref().map(open_checkpoint));
    if let Some(Some(Ok(checkpoint))) = opened {
        println!("resuming from {}", Resumed::of(&checkpoint));
    }
    // The losses and the run's settings go with each checkpoint; a resume must be the same run.
    let mut state = SavedConfig::new(config, resumable);
    let fit_config = FitConfig {
        steps: config.steps,
        lr: config.lr_schedule(),
        checkpoint: config.save.clone(),
        resume: config.resume.clone(),
        check_replicas_every: 0,
    };
    let stop = config.stop.as_ref().map(StopFlag::flag);
    fit_with(
        built,
        &fit_config,
        &mut batch,
        &mut after_step,
        stop,
        &mut state,
    )
}

/// The MoE layers' routing figures of the last forward call, with the auxiliary losses
/// averaged over `average` (each rank's value is that of its tokens against the global token
/// shares; their mean is the global loss). Empty for a dense GPT.
fn moe_figures(model: &Gpt, average: &ProcessGroup) -> burn_parallel::Result<Vec<MoeStats>> {
    let mut stats = model.moe_stats();
    if stats.is_empty() || average.size() == 1 {
        return Ok(stats);
    }
    let losses: Vec<f32> = stats
        .iter()
        .flat_map(|s| [s.aux_loss as f32, s.z_loss as f32])
        .collect();
    let losses = average.all_reduce_f32(losses, ReduceOp::Avg)?;
    for (s, l) in stats.iter_mut().zip(losses.chunks(2)) {
        s.aux_loss = f64::from(l[0]);
        s.z_loss = f64::from(l[1]);
    }
    Ok(stats)
}

/// Mean validation loss over `eval_batches` global batches, each data-parallel rank of `group`
/// evaluating its rows with `loss_of` on `device`, averaged over `average` (the data ranks and
/// any context-parallel ranks, which evaluate other tokens of the same rows).
///
/// # Errors
/// `loss_of`'s; collective failures.
fn validation_loss(
    group: &ProcessGroup,
    average: &ProcessGroup,
    config: &TrainConfig,
    corpus: &Corpus,
    device: &Device,
    loss_of: &dyn Fn(Tensor<2, Int>, Tensor<2, Int>) -> Result<Tensor<1>, burn_parallel::Error>,
) -> Result<f64, burn_parallel::Error> {
    let rows = config.batch_size / group.size();
    let mut total = 0.0;
    for b in 0..config.eval_batches {
        let first = group.rank() * rows;
        let rows = first..first + rows;
        let batch = corpus.batch_rows(b as u64, rows, config.seq_len, Split::Validation);
        let (inputs, targets) = batch.to_tensors(device);
        // The loss is f32 under every precision (the head's cross-entropy is).
        total += f64::from(loss_of(inputs, targets)?.into_scalar::<f32>());
    }
    let local = (total / config.eval_batches.max(1) as f64) as f32;
    Ok(average.all_reduce_f32(vec![local], ReduceOp::Avg)?[0] as f64)
}

/// Samples `sample_len` bytes after `prompt` with temperature 0.8 (seeded, deterministic).
pub fn generate(model: &Gpt, prompt: &str, config: &TrainConfig, device: &Device) -> String {
    let mut tokens: Vec<i64> = prompt.bytes().map(i64::from).collect();
    let context = config.seq_len.min(config.model.max_seq_len);
    let mut state = config.model.seed ^ 0x5EED;
    for _ in 0..config.sample_len {
        let window = &tokens[tokens.len().saturating_sub(context)..];
        let input = Tensor::<2, Int>::from_data(
            TensorData::new(window.to_vec(), [1, window.len()]),
            device,
        );
        let logits = model
            .forward(input)
            .expect("a single-device GPT on byte tokens"); // [1, t, vocab]
        let vocab = logits.dims()[2];
        let last = logits.narrow(1, window.len() - 1, 1).reshape([vocab]);
        let probs = activation::softmax(last / 0.8, 0)
            .into_data()
            .try_into_vec_as::<f64>()
            .expect("probabilities");
        state = splitmix64(state);
        let u = (state >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        let mut choice = probs.len() - 1;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if u < acc {
                choice = i;
                break;
            }
        }
        tokens.push(choice as i64);
    }
    String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<u8>>()).into_owned()
}

/// Whether a run of `now` can continue a checkpoint saved by a run of `saved`: the same model,
/// batch and sequence length. Another layout, data-parallel size or accumulation is a valid
/// continuation (with dropout, one that draws that layout's masks).
///
/// # Errors
/// A sentence naming what differs.
fn resumable(saved: &TrainConfig, now: &TrainConfig) -> Result<(), String> {
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
    ] {
        if s != n {
            return Err(differs(what, s.to_string(), n.to_string()));
        }
    }
    Ok(())
}

/// The trained parameters the reports carry, by path (the library's).
pub use burn_parallel_train::{NamedParam, named_params};
