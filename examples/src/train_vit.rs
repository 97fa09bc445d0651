//! The ViT training loop on the bundled 8x8 digits, shared by the `vit` binary and the tests.
//!
//! [`train_vit`] runs on every rank of a world arranged as `dp x tp` ([`ParallelDims`]); the
//! model is one type under every layout:
//!
//! | layout | model | gradient reduction and step |
//! |---|---|---|
//! | single device, DDP | [`Vit`] | [`TrainStep`]: averaged over `dp`, global-norm clipping |
//! | TP (+ SP), DP x TP | [`Vit`] built with [`Vit::tp_plan`] | [`TrainStep`]: averaged over `dp`, clipping with the shards summed over `tp` |
//! | FSDP (× TP) | [`Vit`] built with [`Vit::fsdp_plan`] | [`TrainStep`] with the units' flat shards |
//! | ZeRO-1/2 (× TP) | [`Vit`] | [`ZeroOptimizer`] over `dp` (optimizer state, and gradients at stage 2, sharded) |
//!
//! Every data-parallel rank takes its rows of the step's global batch (a pure function of the
//! seed and the step, drawn from the training split), so every layout reproduces single-device
//! training on the same global batch. The test accuracy is measured on the held-out split of
//! [`Digits::split`] (20 %, 359 images), each data-parallel rank classifying its part of it.
//!
//! [`run_vit_local`] runs the ranks as threads of this process and keeps the typed error of the
//! rank that failed.
//!
//! ```
//! use examples::data::Digits;
//! use examples::train_vit::{VitLayout, VitTrainConfig, run_vit_local};
//! use examples::vit::VitConfig;
//!
//! let digits = Digits::load_default().unwrap();
//! let config = VitTrainConfig {
//!     model: VitConfig { n_layers: 1, d_model: 16, d_ff: 32, n_heads: 2, ..VitConfig::digits() },
//!     steps: 3,
//!     batch_size: 8,
//!     ..VitTrainConfig::default()
//! };
//! let report = run_vit_local(2, &config, &VitLayout::default(), &digits, &mut |_| {}).unwrap();
//! assert_eq!(report.losses.len(), 3);
//! assert!((0.0..=1.0).contains(&report.test_accuracy));
//! ```

use std::sync::Mutex;
use std::time::Instant;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor};
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::{ParallelDims, ProcessGroup, ReduceOp};
use burn_parallel_train::{
    Built, FitConfig, Layout, MicroBatch, StepLog, StepSettings, build, fit,
};
use burn_zero::Stage;
use serde::{Deserialize, Serialize};

use crate::data::{Digits, DigitsBatch};
use crate::vit::{Vit, VitConfig};

/// Errors of a ViT training run: the suite's [`burn_parallel::Error`]; a configuration or a
/// layout that cannot run is [`burn_parallel::Error::Invalid`] naming the setting.
pub type VitTrainError = burn_parallel::Error;

/// A setting of the ViT run that cannot work.
fn config_error(reason: impl std::fmt::Display) -> VitTrainError {
    VitTrainError::invalid("ViT training setup", reason)
}

/// Everything that defines a ViT training run on the digits (the model included).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct VitTrainConfig {
    /// The model.
    pub model: VitConfig,
    /// Optimizer steps.
    pub steps: usize,
    /// Images per optimizer step over all data-parallel ranks (the global batch).
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps, then cosine decay to 10 % of `lr`.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Clips the global norm of the averaged gradient to this value (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    /// Seed of the order of the training batches.
    pub data_seed: u64,
    /// Fraction of the digits held out as the test set ([`Digits::split`]).
    pub test_fraction: f64,
    /// Seed of the train/test split (keep it fixed to compare runs).
    pub split_seed: u64,
    /// Measure the test accuracy every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Images per forward pass of the evaluation.
    pub eval_batch: usize,
}

impl Default for VitTrainConfig {
    /// The `vit` binary's defaults: a 2-layer, width-64 ViT on 4x4 patches (4 tokens and the
    /// class token), 600 steps of 64 images; about 97 % test accuracy in well under two
    /// minutes on two CPU cores (release build).
    fn default() -> Self {
        Self {
            model: VitConfig {
                patch_size: 4,
                n_layers: 2,
                n_heads: 4,
                d_model: 64,
                d_ff: 128,
                seed: 0,
                ..VitConfig::digits()
            },
            steps: 600,
            batch_size: 64,
            lr: 3e-3,
            warmup_steps: 30,
            weight_decay: 0.01,
            max_grad_norm: None,
            data_seed: 0,
            test_fraction: 0.2,
            split_seed: 0,
            eval_every: 0,
            eval_batch: 128,
        }
    }
}

impl VitTrainConfig {
    /// Checks the settings that do not depend on the layout.
    ///
    /// # Errors
    /// [`VitTrainError::Invalid`] naming the first setting to change.
    pub fn validate(&self) -> Result<(), VitTrainError> {
        self.model.validate().map_err(config_error)?;
        let config = |m: String| Err(config_error(m));
        if self.model.image_size != Digits::SIDE || self.model.channels != 1 {
            return config(format!(
                "the digits are {0}x{0} pixels with 1 channel; the model expects {1}x{1} with {2}",
                Digits::SIDE,
                self.model.image_size,
                self.model.channels
            ));
        }
        if self.model.n_classes != Digits::N_CLASSES {
            return config(format!(
                "the digits have {} classes; set n_classes to {}, not {}",
                Digits::N_CLASSES,
                Digits::N_CLASSES,
                self.model.n_classes
            ));
        }
        if self.steps == 0 || self.batch_size == 0 || self.eval_batch == 0 {
            return config("steps, batch_size and eval_batch must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return config(format!(
                "the learning rate must be positive, not {}",
                self.lr
            ));
        }
        if !(self.test_fraction > 0.0 && self.test_fraction < 1.0) {
            return config(format!(
                "test_fraction must lie strictly between 0 and 1, not {}",
                self.test_fraction
            ));
        }
        if let Some(max) = self.max_grad_norm
            && !(max.is_finite() && max > 0.0)
        {
            return config(format!("the clipping norm must be positive, not {max}"));
        }
        Ok(())
    }

    /// Learning rate at `step`: linear warm-up, then cosine decay to 10 % of the peak.
    pub fn lr_at(&self, step: usize) -> f64 {
        burn_parallel_train::LrSchedule {
            peak: self.lr,
            warmup: self.warmup_steps,
            steps: self.steps,
            floor: 0.1,
        }
        .at(step)
    }

    /// The AdamW every layout uses.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig::new().with_weight_decay(self.weight_decay as f32)
    }
}

/// How the world is split: `world / tp` data-parallel replicas of a model split over `tp`
/// ranks, or ZeRO over all ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VitLayout {
    /// Tensor-parallel size (0 or 1: none).
    pub tp: usize,
    /// Sequence parallelism inside each tensor-parallel group (the 17 tokens split).
    pub sp: bool,
    /// ZeRO over the data-parallel ranks instead of plain DDP: stage 1 or 2 shard the
    /// optimizer state (and gradients), stage 3 is FSDP with every encoder block a unit.
    pub zero: Option<Stage>,
}

impl VitLayout {
    /// The library's [`Layout`] of this split.
    pub fn layout(&self) -> Layout {
        Layout {
            tp: self.tp_size(),
            sp: self.sp,
            zero: self.zero,
            ..Layout::default()
        }
    }

    /// The tensor-parallel size (at least 1).
    pub fn tp_size(&self) -> usize {
        self.tp.max(1)
    }

    /// The parallel dimensions of this layout on `world` ranks: ZeRO and FSDP shard over every
    /// data-parallel rank, DDP replicates.
    pub fn dims(&self, world: usize) -> ParallelDims {
        let dp = world / self.tp_size();
        let (dp_replicate, dp_shard) = match self.zero {
            None => (dp, 1),
            Some(_) => (1, dp),
        };
        ParallelDims {
            dp_replicate,
            dp_shard,
            pp: 1,
            cp: 1,
            tp: self.tp_size(),
            ep: 1,
        }
    }

    /// Checks that `world` ranks can train `config` with this layout.
    ///
    /// # Errors
    /// [`VitTrainError::Invalid`] naming the setting to change.
    pub fn validate(&self, config: &VitTrainConfig, world: usize) -> Result<(), VitTrainError> {
        config.validate()?;
        let config_err = |m: String| Err(config_error(m));
        let tp = self.tp_size();
        if world == 0 {
            return config_err("at least one rank is needed".into());
        }
        if !world.is_multiple_of(tp) {
            return config_err(format!(
                "{world} ranks cannot be split into tensor-parallel groups of {tp}; use a --tp \
                 that divides the number of ranks"
            ));
        }
        if self.sp && tp == 1 {
            return config_err("sequence parallelism (--sp) needs --tp 2 or more".into());
        }
        if !config.model.n_heads.is_multiple_of(tp) {
            return config_err(format!(
                "n_heads ({}) is not divisible by the tensor-parallel size {tp}: attention is \
                 split by whole heads",
                config.model.n_heads
            ));
        }
        let dp = world / tp;
        if !config.batch_size.is_multiple_of(dp) {
            return config_err(format!(
                "the global batch of {} images cannot be split evenly over {dp} data-parallel \
                 ranks; use a multiple of {dp}",
                config.batch_size
            ));
        }
        Ok(())
    }
}

/// What one optimizer step did (global figures, the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VitStepStats {
    /// Step index, from 0.
    pub step: usize,
    /// Mean loss over the global batch.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// The global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// Images of the global batch per second of this step.
    pub images_per_sec: f64,
    /// Seconds since training started.
    pub elapsed: f64,
    /// The test accuracy after this step, when it was measured (every `eval_every` steps).
    pub test_accuracy: Option<f64>,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct VitReport {
    /// Global mean loss of every step.
    pub losses: Vec<f64>,
    /// `(step, accuracy)` of every evaluation during training (`eval_every`).
    pub evals: Vec<(usize, f64)>,
    /// Test accuracy of the final model, in `[0, 1]`.
    pub test_accuracy: f64,
    /// Correctly classified test images (of `test_images`).
    pub test_correct: usize,
    /// Size of the test set.
    pub test_images: usize,
    /// Seconds of the training steps (evaluations excluded).
    pub train_seconds: f64,
    /// The trained model, whole (gathered from the tensor-parallel shards), on a plain
    /// [`Device::flex`].
    pub model: Vit,
}

fn predict(model: &Vit, images: Tensor<4>) -> Result<Vec<i64>, VitTrainError> {
    Ok(model
        .predict(images)?
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("class ids"))
}

/// The rows `rows` of a host batch.
pub(crate) fn batch_rows(batch: &DigitsBatch, rows: std::ops::Range<usize>) -> DigitsBatch {
    DigitsBatch {
        images: batch.images[rows.start * Digits::PIXELS..rows.end * Digits::PIXELS].to_vec(),
        labels: batch.labels[rows].to_vec(),
    }
}

/// The share of `test` this data-parallel rank classifies: `[start, end)` of an even split.
fn eval_share(len: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let base = len / size;
    let extra = len % size;
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Test accuracy: each data-parallel rank classifies its share of `test` in chunks of
/// `eval_batch`, the counts are summed over `dp`. Returns `(correct, total)`.
pub(crate) fn evaluate(
    model: &Vit,
    test: &Digits,
    dp: &ProcessGroup,
    eval_batch: usize,
    device: &Device,
) -> Result<(usize, usize), VitTrainError> {
    let share = eval_share(test.len(), dp.rank(), dp.size());
    let indices: Vec<usize> = share.collect();
    let mut correct = 0usize;
    for chunk in indices.chunks(eval_batch) {
        let batch = test.select(chunk);
        let (x, _) = batch.to_tensors(device);
        let predicted = predict(model, x)?;
        correct += predicted
            .iter()
            .zip(&batch.labels)
            .filter(|(p, l)| p == l)
            .count();
    }
    // Counts below 2^24 are exact in f32.
    let total = dp.all_reduce_f32(vec![correct as f32], ReduceOp::Sum)?[0];
    Ok((total as usize, test.len()))
}

/// Trains the ViT of `config` on the digits with `layout` over `world` (every rank calls it),
/// calling `on_step` after every step.
///
/// # Arguments
/// - `world`: all ranks of the job (thread ranks from [`run_local`], or processes).
/// - `config`: the model and the run.
/// - `layout`: tensor parallelism, sequence parallelism, ZeRO.
/// - `digits`: the whole data set (split into train and test with `config.split_seed`).
/// - `on_step`: called on every rank after every step with the global figures.
///
/// # Returns
/// The report, the same on every rank.
///
/// # Errors
/// [`VitTrainError::Invalid`] for a setup that cannot run (checked before any communication);
/// collective, tensor-parallel and ZeRO errors.
pub fn train_vit(
    world: &ProcessGroup,
    config: &VitTrainConfig,
    layout: &VitLayout,
    digits: &Digits,
    on_step: &mut dyn FnMut(&VitStepStats),
) -> Result<VitReport, VitTrainError> {
    layout.validate(config, world.size())?;
    train_vit_under(world, config, &layout.layout(), 1, digits, on_step)
}

/// [`train_vit`] under the library's `layout` (a pipeline's included), each data-parallel
/// rank's rows of a step in `micro_batches` micro-batches (the pipeline's).
///
/// # Errors
/// As [`train_vit`]; the layout's refusals ([`Layout::validate`]).
pub fn train_vit_under(
    world: &ProcessGroup,
    config: &VitTrainConfig,
    layout: &Layout,
    micro_batches: usize,
    digits: &Digits,
    on_step: &mut dyn FnMut(&VitStepStats),
) -> Result<VitReport, VitTrainError> {
    config.validate()?;
    let device = Device::flex().autodiff();
    let plain = Device::flex();
    let (train, test) = digits.split(config.test_fraction, config.split_seed);
    if train.is_empty() || test.is_empty() {
        return Err(config_error(format!(
            "the split of {} images at test_fraction {} leaves an empty train or test set",
            digits.len(),
            config.test_fraction
        )));
    }

    // ---- the model and its engine: the library's builder for the layout ----
    let settings = StepSettings {
        max_grad_norm: config.max_grad_norm,
        adamw: FusedAdamWConfig::new().with_weight_decay(config.weight_decay as f32),
        batch_size: config.batch_size,
        // Tokens per second are images per second.
        seq_len: 1,
        grad_accum: micro_batches,
        ..StepSettings::default()
    };
    let built = build(world, layout, &config.model, &device, &settings)?;
    let dp = built.groups.data.clone();
    let fit_config = FitConfig {
        steps: config.steps,
        lr: burn_parallel_train::LrSchedule {
            peak: config.lr,
            warmup: config.warmup_steps,
            steps: config.steps,
            floor: 0.1,
        },
        checkpoint: None,
        resume: None,
        check_replicas_every: 0,
    };
    let mut batch = |micro: &MicroBatch| {
        let global = train.batch(micro.step as u64, config.batch_size, config.data_seed);
        Ok(batch_rows(&global, micro.rows.clone()))
    };
    let mut evals = Vec::new();
    let mut train_seconds = 0.0;
    let start = Instant::now();
    let mut on_step = |log: &StepLog, built: &Built<VitConfig>| {
        train_seconds += log.seconds;
        let (step, every) = (log.step, config.eval_every);
        let test_accuracy = match built.model() {
            // A pipeline's stages are gathered into the whole model at the end only.
            Some(model)
                if every > 0 && (step + 1).is_multiple_of(every) && step + 1 < config.steps =>
            {
                let (correct, total) =
                    evaluate(&model.valid(), &test, &dp, config.eval_batch, &plain)?;
                let accuracy = correct as f64 / total as f64;
                evals.push((step, accuracy));
                Some(accuracy)
            }
            _ => None,
        };
        on_step(&VitStepStats {
            step,
            loss: f64::from(log.loss),
            lr: log.lr,
            grad_norm: log.grad_norm,
            images_per_sec: log.tokens_per_sec,
            elapsed: start.elapsed().as_secs_f64(),
            test_accuracy,
        });
        Ok(())
    };
    let fitted = fit(built, &fit_config, &mut batch, &mut on_step, None)?;
    let losses = fitted.losses.clone();
    let model = fitted.built.trained(&config.model)?.valid();
    let (test_correct, test_images) = evaluate(&model, &test, &dp, config.eval_batch, &plain)?;
    let test_accuracy = test_correct as f64 / test_images as f64;
    evals.push((config.steps - 1, test_accuracy));
    let model = model.to_single(&plain)?;
    Ok(VitReport {
        losses: losses.iter().map(|&l| f64::from(l)).collect(),
        evals,
        test_accuracy,
        test_correct,
        test_images,
        train_seconds,
        model,
    })
}

/// Runs [`train_vit`] on `ranks` thread ranks of this process and returns rank 0's report.
///
/// # Errors
/// The typed error of the rank that failed first (a [`VitTrainError::Invalid`] before any
/// thread starts); [`VitTrainError::Collective`] when a rank panicked or a collective failed.
pub fn run_vit_local(
    ranks: usize,
    config: &VitTrainConfig,
    layout: &VitLayout,
    digits: &Digits,
    on_step: &mut (dyn FnMut(&VitStepStats) + Send),
) -> Result<VitReport, VitTrainError> {
    layout.validate(config, ranks)?;
    run_local_ranks(ranks, on_step, &|world, report| {
        train_vit(world, config, layout, digits, report)
    })
}

/// A trainer of the ViT on one rank of a world ([`train_vit`], or the pipeline's), reporting
/// each step to its callback.
pub type VitTrainer<'a> = dyn Fn(&ProcessGroup, &mut dyn FnMut(&VitStepStats)) -> Result<VitReport, VitTrainError>
    + Sync
    + 'a;

/// Runs `train` (a trainer of the ViT) on `ranks` thread ranks of this process, calling
/// `on_step` with rank 0's step figures, and returns rank 0's report.
///
/// # Errors
/// The typed error of the rank that failed first; [`VitTrainError::Collective`] when a rank
/// panicked or a collective failed.
pub fn run_local_ranks(
    ranks: usize,
    on_step: &mut (dyn FnMut(&VitStepStats) + Send),
    train: &VitTrainer<'_>,
) -> Result<VitReport, VitTrainError> {
    let on_step = Mutex::new(on_step);
    let mut reports = burn_parallel_train::run_local(ranks, |world| {
        let lead = world.rank() == 0;
        let mut report = |s: &VitStepStats| {
            if lead {
                (on_step.lock().expect("the step callback"))(s);
            }
        };
        train(&world, &mut report)
    })?;
    Ok(reports.swap_remove(0))
}
