//! The GPT training loop, shared by the `gpt` binary and the parity tests.
//!
//! One function, [`train_gpt`], runs on every rank of a data-parallel group: each rank builds
//! the same model from the seed, takes its rows of the step's global batch, and averages its
//! gradients with [`DistributedDataParallel`] before the AdamW step. Whatever the number of
//! ranks, the losses are those of single-device training on the same global batch.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData, activation};
use burn_parallel::{CollectiveError, DistributedDataParallel, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::data::{Corpus, Split};
use crate::gpt::{Gpt, GptConfig};
use crate::init::splitmix64;

/// Everything that defines a training run (the model included).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
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
}

/// The device of a training run.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TrainDevice {
    /// Burn's pure-Rust CPU backend.
    #[default]
    Flex,
    /// Burn's WGPU backend (needs the `wgpu` feature and an adapter), where
    /// `GptConfig::fused` runs the CubeCL kernels.
    Wgpu,
}

impl TrainDevice {
    /// The (plain, non-autodiff) Burn device.
    ///
    /// # Errors
    /// For `Wgpu` without the `wgpu` feature or without an adapter.
    pub fn device(self) -> Result<Device, String> {
        match self {
            TrainDevice::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            TrainDevice::Wgpu => burn_parallel::kernels::wgpu_device().map_err(|e| e.to_string()),
            #[cfg(not(feature = "wgpu"))]
            TrainDevice::Wgpu => {
                Err("this build has no WGPU backend: rebuild with --features wgpu".into())
            }
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        let mut model = GptConfig::new(256, 2, 4, 128, 64);
        model.seed = 42;
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
        }
    }
}

impl TrainConfig {
    /// Checks that the run can be split over `ranks` data-parallel ranks.
    ///
    /// # Errors
    /// A message saying which setting to change.
    pub fn validate(&self, ranks: usize) -> Result<(), String> {
        self.model.validate().map_err(|e| e.to_string())?;
        if ranks == 0 || self.grad_accum == 0 || self.steps == 0 || self.seq_len == 0 {
            return Err("ranks, grad_accum, steps and seq_len must be at least 1".into());
        }
        if !self.batch_size.is_multiple_of(ranks * self.grad_accum) {
            return Err(format!(
                "the global batch of {} sequences cannot be split evenly over {ranks} ranks x {} \
                 micro-steps; use a multiple of {}",
                self.batch_size,
                self.grad_accum,
                ranks * self.grad_accum
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
        Ok(())
    }

    /// Learning rate at `step`: linear warm-up, then cosine decay to 10% of the peak.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = (self.steps - self.warmup_steps).max(1) as f64;
        let progress = (step - self.warmup_steps) as f64 / span;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.lr * (0.1 + 0.9 * cosine)
    }
}

/// What one optimizer step did (global figures, the same on every rank).
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    /// Step index, from 0.
    pub step: usize,
    /// Mean loss over the global batch.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Tokens of the global batch per second of this step.
    pub tokens_per_sec: f64,
    /// Seconds since training started.
    pub elapsed: f64,
}

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
}

/// Trains the GPT of `config` with data parallelism over `group` (a group of one rank is
/// single-device training) and calls `on_step` after every step.
///
/// # Errors
/// When a collective fails; an invalid config is reported as
/// [`CollectiveError::InvalidArgument`] (check it first with [`TrainConfig::validate`]).
pub fn train_gpt(
    group: &ProcessGroup,
    config: &TrainConfig,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> burn_parallel::Result<TrainReport> {
    train_gpt_on(group, config, TrainDevice::Flex, corpus, on_step)
}

/// [`train_gpt`] on `device` (the `gpt --device` flag): with [`TrainDevice::Wgpu`] and
/// `config.model.fused`, the norms, SwiGLU, RoPE and the cross-entropy run as CubeCL kernels.
///
/// # Errors
/// As [`train_gpt`]; a device that cannot be initialised is reported as
/// [`CollectiveError::InvalidArgument`].
pub fn train_gpt_on(
    group: &ProcessGroup,
    config: &TrainConfig,
    device: TrainDevice,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> burn_parallel::Result<TrainReport> {
    let plain = device;
    config
        .validate(group.size())
        .map_err(|reason| CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: "train_gpt".into(),
            reason,
        })?;
    let device = device
        .device()
        .map_err(|reason| CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: "train_gpt".into(),
            reason,
        })?
        .autodiff();
    let ddp = data_parallel(group, config);
    // Seeded init already gives identical replicas; the broadcast makes that a guarantee.
    let model = ddp.broadcast_module(Gpt::new(&config.model, &device), 0)?;
    let loss_of = |m: &Gpt, inputs, targets| Ok(m.loss(inputs, targets));
    let (model, run) = fit(model, &ddp, config, corpus, &device, &loss_of, on_step)?;
    let eval_model = model.valid();
    let val_loss = validation_loss(group, config, plain, corpus, &|inputs, targets| {
        Ok(eval_model.loss(inputs, targets))
    })?;
    let sample = if group.rank() == 0 {
        generate(&eval_model, &config.prompt, config, &device.inner())
    } else {
        String::new()
    };
    Ok(run.report(config, val_loss, sample, named_params(&eval_model)))
}

/// The data-parallel group's gradient averaging, with the run's bucket size.
fn data_parallel(group: &ProcessGroup, config: &TrainConfig) -> DistributedDataParallel {
    DistributedDataParallel::new(group.clone())
        .with_bucket_bytes((config.bucket_mb * 1024.0 * 1024.0) as usize)
}

/// Computes a model's mean loss on `(inputs, targets)`, with the layout's own errors mapped.
type LossFn<'a, M> =
    dyn Fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> burn_parallel::Result<Tensor<1>> + 'a;

/// What [`fit`] measured.
struct Run {
    losses: Vec<f64>,
    /// Seconds of all steps but the first.
    timed: f64,
}

impl Run {
    fn report(
        self,
        config: &TrainConfig,
        val_loss: f64,
        sample: String,
        final_params: Vec<NamedParam>,
    ) -> TrainReport {
        let tokens_per_step = (config.batch_size * config.seq_len) as f64;
        let timed_steps = (config.steps - 1).max(1) as f64;
        TrainReport {
            losses: self.losses,
            val_loss,
            sample,
            step_seconds: self.timed / timed_steps,
            tokens_per_sec: tokens_per_step * timed_steps / self.timed.max(1e-9),
            final_params,
        }
    }
}

/// The training loop every layout shares: each data-parallel rank (of `ddp`'s group) takes its
/// rows of the step's global batch, in `grad_accum` micro-steps, computes the loss with
/// `loss_of`, and steps AdamW on gradients averaged once per step.
fn fit<M: Module>(
    mut model: M,
    ddp: &DistributedDataParallel,
    config: &TrainConfig,
    corpus: &Corpus,
    device: &Device,
    loss_of: &LossFn<'_, M>,
    on_step: &mut dyn FnMut(&StepStats),
) -> burn_parallel::Result<(M, Run)> {
    let group = ddp.group();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(config.weight_decay as f32)
        .init();
    let rows_per_rank = config.batch_size / group.size();
    let micro_rows = rows_per_rank / config.grad_accum;
    let tokens_per_step = (config.batch_size * config.seq_len) as f64;
    let start = Instant::now();
    let mut run = Run {
        losses: Vec::with_capacity(config.steps),
        timed: 0.0,
    };
    for step in 0..config.steps {
        let step_start = Instant::now();
        let mut accumulator = ddp.accumulator();
        let mut local_loss = 0.0;
        for micro in 0..config.grad_accum {
            let first = group.rank() * rows_per_rank + micro * micro_rows;
            let batch = corpus.batch_rows(
                step as u64,
                first..first + micro_rows,
                config.seq_len,
                Split::Train,
            );
            let (inputs, targets) = batch.to_tensors(device);
            let loss = loss_of(&model, inputs, targets)?;
            local_loss += scalar(&loss) / config.grad_accum as f64;
            accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        let mut grads = accumulator.finish(&model)?;
        if let Some(max) = config.max_grad_norm {
            // The averaged gradients are whole on every data-parallel rank, so the local norm
            // is the global one (layouts that shard gradients refuse clipping here).
            grads = burn_zero::clip::clip_grads_global_norm(&model, grads, max).0;
        }
        let lr = config.lr_at(step);
        model = optim.step(lr, model, grads);
        let loss = group.all_reduce_f32(vec![local_loss as f32], ReduceOp::Avg)?[0] as f64;
        run.losses.push(loss);
        let seconds = step_start.elapsed().as_secs_f64();
        if step > 0 {
            run.timed += seconds;
        }
        on_step(&StepStats {
            step,
            loss,
            lr,
            tokens_per_sec: tokens_per_step / seconds,
            elapsed: start.elapsed().as_secs_f64(),
        });
    }
    Ok((model, run))
}

fn scalar(t: &Tensor<1>) -> f64 {
    t.clone()
        .into_data()
        .try_into_vec_as::<f64>()
        .expect("a float")[0]
}

/// Mean validation loss over `eval_batches` global batches, each data-parallel rank of `group`
/// evaluating its rows with `loss_of` (on a plain device).
fn validation_loss(
    group: &ProcessGroup,
    config: &TrainConfig,
    device: TrainDevice,
    corpus: &Corpus,
    loss_of: &dyn Fn(Tensor<2, Int>, Tensor<2, Int>) -> burn_parallel::Result<Tensor<1>>,
) -> burn_parallel::Result<f64> {
    let device = device
        .device()
        .map_err(|reason| CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: "validation_loss".into(),
            reason,
        })?;
    let rows = config.batch_size / group.size();
    let mut total = 0.0;
    for b in 0..config.eval_batches {
        let first = group.rank() * rows;
        let batch = corpus.batch_rows(
            b as u64,
            first..first + rows,
            config.seq_len,
            Split::Validation,
        );
        let (inputs, targets) = batch.to_tensors(&device);
        total += scalar(&loss_of(inputs, targets)?);
    }
    let local = (total / config.eval_batches.max(1) as f64) as f32;
    Ok(group.all_reduce_f32(vec![local], ReduceOp::Avg)?[0] as f64)
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
        let logits = model.forward(input); // [1, t, vocab]
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

/// How the world is split for [`train_gpt_parallel`]: `world / tp` data-parallel replicas of a
/// model split over `tp` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallelism {
    /// Tensor-parallel size (1: data parallelism only).
    pub tp: usize,
    /// Sequence parallelism inside each tensor-parallel group.
    pub sp: bool,
}

impl Default for Parallelism {
    fn default() -> Self {
        Self { tp: 1, sp: false }
    }
}

impl Parallelism {
    /// Checks that `world` ranks can run `config` with this split.
    ///
    /// # Errors
    /// A message saying which setting to change.
    pub fn validate(&self, config: &TrainConfig, world: usize) -> Result<(), String> {
        if self.tp == 0 || !world.is_multiple_of(self.tp) {
            return Err(format!(
                "the world of {world} ranks cannot be split into tensor-parallel groups of {}; \
                 use a --tp that divides the number of ranks",
                self.tp
            ));
        }
        if self.tp > 1 && config.max_grad_norm.is_some() {
            return Err(
                "gradient clipping does not support tensor parallelism yet (the norm of sharded \
                 gradients needs a reduction over the tensor-parallel group); drop --clip or --tp"
                    .into(),
            );
        }
        if self.sp && self.tp == 1 {
            return Err("sequence parallelism (--sp) needs --tp 2 or more".into());
        }
        crate::parallelize::check_gpt_tp(&config.model, self.tp).map_err(|e| e.to_string())?;
        config.validate(world / self.tp)
    }
}

fn tp_error(group: &ProcessGroup, e: burn_parallel::TpError) -> CollectiveError {
    match e {
        burn_parallel::TpError::Collective(e) => e,
        other => CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: "tensor parallel".into(),
            reason: other.to_string(),
        },
    }
}

/// Trains the GPT of `config` on `world` arranged as a `dp x tp` mesh: each tensor-parallel
/// group holds one model split by [`crate::parallelize::parallelize_gpt`] (with sequence
/// parallelism if asked), the data-parallel groups average the gradients of matching shards
/// (replicated parameters included) with [`DistributedDataParallel`]. With `tp == 1` this is
/// [`train_gpt`]. The losses are those of single-device training on the same global batch.
///
/// # Errors
/// An invalid split or config as [`CollectiveError::InvalidArgument`]; collective errors.
pub fn train_gpt_parallel(
    world: &ProcessGroup,
    config: &TrainConfig,
    parallel: &Parallelism,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> burn_parallel::Result<TrainReport> {
    let invalid = |reason: String| CollectiveError::InvalidArgument {
        rank: world.global_rank(),
        op: "train_gpt_parallel".into(),
        reason,
    };
    parallel.validate(config, world.size()).map_err(invalid)?;
    if parallel.tp == 1 {
        return train_gpt(world, config, corpus, on_step);
    }
    let dp = world.size() / parallel.tp;
    let mesh = burn_parallel::DeviceMesh::new(world, &[("dp", dp), ("tp", parallel.tp)])
        .map_err(|e| invalid(e.to_string()))?;
    let dp_group = mesh
        .group("dp")
        .map_err(|e| invalid(e.to_string()))?
        .clone();
    let device = Device::flex().autodiff();
    let options = crate::parallelize::TpOptions {
        sequence_parallel: parallel.sp,
        ..Default::default()
    };
    // The full model is built from the seed on a plain device; each rank keeps its shards.
    let reference = Gpt::new(&config.model, &Device::flex());
    let model = crate::parallelize::parallelize_gpt(&reference, &mesh, &options, &device)
        .map_err(|e| tp_error(world, e))?;
    drop(reference);
    let ddp = data_parallel(&dp_group, config);
    let model = ddp.broadcast_module(model, 0)?;
    let loss_of = |m: &crate::parallelize::TpGpt, inputs, targets| {
        m.loss(inputs, targets).map_err(|e| tp_error(world, e))
    };
    let (model, run) = fit(model, &ddp, config, corpus, &device, &loss_of, on_step)?;
    // Evaluation with the sharded model, each data-parallel replica on its rows (every rank of
    // a tensor-parallel group holds the same loss).
    let eval_model = model.valid();
    let val_loss = validation_loss(
        &dp_group,
        config,
        TrainDevice::Flex,
        corpus,
        &|inputs, targets| {
            eval_model
                .loss(inputs, targets)
                .map_err(|e| tp_error(world, e))
        },
    )?;
    // Sampling and the report's final parameters need the whole model: gather it (every rank
    // takes part), rank 0 generates.
    let plain = Device::flex();
    let full = eval_model.to_full(&plain).map_err(|e| tp_error(world, e))?;
    let sample = if config.sample_len > 0 && world.rank() == 0 {
        generate(&full, &config.prompt, config, &plain)
    } else {
        String::new()
    };
    Ok(run.report(config, val_loss, sample, named_params(&full)))
}

/// One parameter of a trained model: its module path, shape and values (fp32, on the host).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedParam {
    /// Module path, as Burn's module visitor names it (`"blocks.0.attn.q.weight"`).
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values in row-major order, converted to fp32.
    pub values: Vec<f32>,
}

/// Every float parameter of `module`, in visiting order, with its path, as fp32 host values.
///
/// # Arguments
/// * `module` - any Burn module.
///
/// # Returns
/// One [`NamedParam`] per float parameter.
///
/// # Example
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use examples::train::named_params;
///
/// let params = named_params(&LinearConfig::new(3, 2).init(&Device::flex()));
/// assert_eq!(params[0].path, "weight");
/// assert_eq!(params[0].shape, vec![3, 2]);
/// assert_eq!(params[1].values.len(), 2);
/// ```
pub fn named_params<M: Module>(module: &M) -> Vec<NamedParam> {
    struct Collect {
        stack: Vec<String>,
        out: Vec<NamedParam>,
    }
    impl burn::module::ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let value = param.val();
            self.out.push(NamedParam {
                path: self.stack.join("."),
                shape: value.dims().to_vec(),
                values: value
                    .try_into_vec_as::<f32>()
                    .expect("a float parameter reads as f32"),
            });
        }
    }
    let mut collect = Collect {
        stack: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut collect);
    collect.out
}
