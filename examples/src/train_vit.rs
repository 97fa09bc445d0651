//! The ViT training loop on the bundled 8x8 digits, shared by the `vit` binary and the tests.
//!
//! [`train_vit`] runs on every rank of a world under any library [`Layout`]: the library's
//! builder places the ViT ([`VitConfig`]'s `ParallelModel` form) and its loop trains it, so the
//! layout's rules are [`Layout::validate`]'s, each refusal naming its flag; the ViT's own
//! settings are checked by [`VitTrainConfig::validate`].
//!
//! | layout | what each rank trains | gradient reduction and step |
//! |---|---|---|
//! | single device, DDP | [`Vit`] | averaged over `dp`, global-norm clipping |
//! | TP (+ SP), DP x TP | [`Vit`] built with [`Vit::tp_plan`] | averaged over `dp`, clipping with the shards summed over `tp` |
//! | FSDP (× TP) | [`Vit`] built with [`Vit::fsdp_plan`] | the units' flat shards |
//! | ZeRO-1/2 (× TP) | [`Vit`] | ZeRO's optimizer over `dp` (optimizer state, and gradients at stage 2, sharded) |
//! | pipeline (`pp > 1`, × DP) | its stages ([`crate::vit_pipeline`]) | per stage over its replicas, clipping by the norm over every stage |
//!
//! Every data-parallel rank takes its rows of the step's global batch (a pure function of the
//! seed and the step, drawn from the training split) in [`VitTrainConfig::grad_accum`]
//! micro-batches (a pipeline's micro-batches), so every layout reproduces single-device
//! training on the same global batch. The test accuracy is measured on the held-out split of
//! [`Digits::split`] (20 %, 359 images), each data-parallel rank classifying its part of it.
//!
//! [`run_vit_local`] runs the ranks as threads of this process and keeps the typed error of the
//! rank that failed.
//!
//! ```
//! use burn_parallel_train::Layout;
//! use examples::data::Digits;
//! use examples::train_vit::{VitTrainConfig, VitTrainError, run_vit_local};
//! use examples::vit::VitConfig;
//!
//! let digits = Digits::load_default().unwrap();
//! let config = VitTrainConfig {
//!     model: VitConfig { n_layers: 1, d_model: 16, d_ff: 32, n_heads: 2, ..VitConfig::digits() },
//!     steps: 3,
//!     batch_size: 8,
//!     ..VitTrainConfig::default()
//! };
//! let report = run_vit_local(2, &config, &Layout::default(), &digits, &mut |_| {}).unwrap();
//! assert_eq!(report.losses.len(), 3);
//! assert!((0.0..=1.0).contains(&report.test_accuracy));
//! // A layout that cannot run is refused before any rank starts, naming its flag.
//! let sp_alone = Layout { sp: true, ..Layout::default() };
//! match run_vit_local(2, &config, &sp_alone, &digits, &mut |_| {}) {
//!     Err(VitTrainError::Invalid { what, .. }) => assert_eq!(what, "--sp"),
//!     other => panic!("expected --sp to be refused, got {:?}", other.map(|r| r.losses)),
//! }
//! ```

use std::sync::Mutex;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor};
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::{ProcessGroup, ReduceOp};
use burn_parallel_train::{
    Built, FitConfig, Layout, LrSchedule, MicroBatch, Precision, StepLog, StepSettings, build, fit,
};
use serde::{Deserialize, Serialize};

use crate::data::{Digits, DigitsBatch};
use crate::vit::{Vit, VitConfig};

/// Errors of a ViT training run: the suite's [`burn_parallel::Error`]; a configuration or a
/// layout that cannot run is [`burn_parallel::Error::Invalid`] naming the setting (a layout's
/// refusal names its flag, as [`Layout::validate`] does).
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
    /// Micro-batches per optimizer step (default 1): each data-parallel rank's rows of a step
    /// split between them, their gradients accumulated; under a pipeline layout they are the
    /// schedule's micro-batches ([`StepSettings::grad_accum`]).
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps, then cosine decay to 10 % of `lr`.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Clips the global norm of the averaged gradient to this value (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    /// The arithmetic of the forward and backward (bf16 or fp16 with fp32 master weights and
    /// optimizer state; fp16 scales the loss).
    pub precision: Precision,
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
            grad_accum: 1,
            lr: 3e-3,
            warmup_steps: 30,
            weight_decay: 0.01,
            max_grad_norm: None,
            precision: Precision::F32,
            data_seed: 0,
            test_fraction: 0.2,
            split_seed: 0,
            eval_every: 0,
            eval_batch: 128,
        }
    }
}

impl VitTrainConfig {
    /// Checks the ViT's own settings: the model, and that it fits the digits, and the run's
    /// steps, rate, split and clipping. What depends on the layout (the batch split over the
    /// data-parallel ranks and the micro-batches, the heads over `--tp`, ...) is
    /// [`Layout::validate`]'s, which the builder applies to [`Self::settings`].
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
        if self.steps == 0 || self.eval_batch == 0 {
            return config("steps and eval_batch must be at least 1".into());
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

    /// The learning rate of every step: linear warm-up, then cosine decay to 10 % of the peak.
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            peak: self.lr,
            warmup: self.warmup_steps,
            steps: self.steps,
            floor: 0.1,
        }
    }

    /// Learning rate at `step` ([`Self::lr_schedule`]).
    pub fn lr_at(&self, step: usize) -> f64 {
        self.lr_schedule().at(step)
    }

    /// The AdamW every layout uses.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig::new().with_weight_decay(self.weight_decay as f32)
    }

    /// How the library's engine steps this run (and what [`Layout::validate`] checks through
    /// [`StepSettings::workload`]): the global batch, its micro-batches, clipping and AdamW's
    /// weight decay; a sequence is one image, so tokens per second are images per second.
    pub fn settings(&self) -> StepSettings {
        StepSettings {
            precision: self.precision.policy(),
            loss_scaler: self.precision.scaler(),
            max_grad_norm: self.max_grad_norm,
            adamw: FusedAdamWConfig::new().with_weight_decay(self.weight_decay as f32),
            batch_size: self.batch_size,
            seq_len: 1,
            grad_accum: self.grad_accum,
            ..StepSettings::default()
        }
    }
}

/// What one optimizer step did (global figures, the same on every rank).
#[derive(Debug, Clone, PartialEq)]
pub struct VitStepStats {
    /// The library loop's figures: step (from 0), global mean loss, learning rate, seconds,
    /// images of the global batch per second (`tokens_per_sec`), the gradient norm when clipping.
    pub log: StepLog,
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
    /// Images of the global batch per second over the steps, the first (a warm-up) excluded
    /// ([`burn_parallel_train::Fitted::tokens_per_sec`]); 0 for a run of one step.
    pub images_per_sec: f64,
    /// The trained model, whole (gathered from the tensor-parallel shards or the pipeline's
    /// stages), on a plain [`Device::flex`].
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

/// Trains the ViT of `config` on the digits under `layout` over `world` (every rank calls it),
/// calling `on_step` after every step: the library builds what this rank trains (the whole
/// ViT or, under `pp > 1`, its pipeline stages) and fits it.
///
/// # Arguments
/// - `world`: all ranks of the job (thread ranks from [`run_vit_local`], or processes).
/// - `config`: the model and the run (its micro-batches per step: `config.grad_accum`).
/// - `layout`: any layout the ViT supports: data, tensor (+ sequence) and pipeline
///   parallelism, ZeRO-1/2 and FSDP.
/// - `digits`: the whole data set (split into train and test with `config.split_seed`).
/// - `on_step`: called on every rank after every step with the global figures.
///
/// # Returns
/// The report, the same on every rank.
///
/// # Errors
/// [`VitTrainError::Invalid`] for a setup that cannot run (checked before any communication:
/// the ViT's settings by [`VitTrainConfig::validate`], the layout by [`Layout::validate`],
/// naming its flag); collective, tensor-parallel, pipeline and ZeRO errors.
pub fn train_vit(
    world: &ProcessGroup,
    config: &VitTrainConfig,
    layout: &Layout,
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

    // ---- what this rank trains and the engine that steps it: the library's builder ----
    let built = build(world, layout, &config.model, &device, &config.settings())?;
    let dp = built.groups.data.clone();
    let fit_config = FitConfig {
        check_replicas_every: 0,
        lr: config.lr_schedule(),
        ..FitConfig::new(config.steps, config.lr)
    };
    let mut batch = |micro: &MicroBatch| {
        let global = train.batch(micro.step as u64, config.batch_size, config.data_seed);
        Ok(batch_rows(&global, micro.rows.clone()))
    };
    let mut evals = Vec::new();
    let mut train_seconds = 0.0;
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
            log: log.clone(),
            test_accuracy,
        });
        Ok(())
    };
    let fitted = fit(built, &fit_config, &mut batch, &mut on_step, None)?;
    let losses = fitted.losses.iter().map(|&l| f64::from(l)).collect();
    let images_per_sec = fitted.tokens_per_sec();
    let model = fitted.built.trained(&config.model)?.valid();
    let (test_correct, test_images) = evaluate(&model, &test, &dp, config.eval_batch, &plain)?;
    let test_accuracy = test_correct as f64 / test_images as f64;
    evals.push((config.steps - 1, test_accuracy));
    let model = model.to_single(&plain)?;
    Ok(VitReport {
        losses,
        evals,
        test_accuracy,
        test_correct,
        test_images,
        train_seconds,
        images_per_sec,
        model,
    })
}

/// Runs [`train_vit`] on `ranks` thread ranks of this process, calling `on_step` with rank 0's
/// step figures, and returns rank 0's report.
///
/// # Errors
/// A [`VitTrainError::Invalid`] before any thread starts for settings or a layout that cannot
/// run ([`VitTrainConfig::validate`], [`Layout::validate`]); else the typed error of the rank
/// that failed first; [`VitTrainError::Collective`] when a rank panicked or a collective
/// failed.
pub fn run_vit_local(
    ranks: usize,
    config: &VitTrainConfig,
    layout: &Layout,
    digits: &Digits,
    on_step: &mut (dyn FnMut(&VitStepStats) + Send),
) -> Result<VitReport, VitTrainError> {
    config.validate()?;
    layout.validate(ranks, &config.settings().workload(&config.model))?;
    let on_step = Mutex::new(on_step);
    let mut reports = burn_parallel_train::run_local(ranks, |world| {
        let lead = world.rank() == 0;
        let mut report = |s: &VitStepStats| {
            if lead {
                (on_step.lock().expect("the step callback"))(s);
            }
        };
        train_vit(&world, config, layout, digits, &mut report)
    })?;
    Ok(reports.swap_remove(0))
}
