//! Pipeline parallelism for the bundled ViT, through the library's generic stage
//! ([`burn_pipeline::sequential::Sequential`]): the ViT is an input layer (patch projection,
//! class token, positions), a sequence of encoder blocks, and an output layer (final norm,
//! classifier on the class token, cross-entropy). Three small trait implementations stage it;
//! [`train_vit_pipeline`] trains it over a `pp x dp` mesh with any schedule of
//! `burn-pipeline`, reducing and stepping each stage with
//! [`burn_pipeline::update::StageUpdater`].
//!
//! ```text
//! vit --ranks 2 --pp 2 --schedule 1f1b --microbatches 4
//! vit --ranks 4 --pp 2 --schedule zbv --microbatches 4 --checkpoint-blocks
//! ```

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::time::Instant;

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::init::Init;
use burn_parallel::nn::{Linear, TpContext};
use burn_parallel::train::TrainStep;
use burn_parallel::{DistributedDataParallel, ParallelDims, ProcessGroup, ReduceOp};
use burn_pipeline::ScheduleKind;
use burn_pipeline::generators;
use burn_pipeline::partition;
use burn_pipeline::runtime::Executor;
use burn_pipeline::sequential::{InputLayer, Layer, OutputLayer, Sequential};
use burn_pipeline::stage::StageError;
use burn_pipeline::update::{StageOptimizer, StageUpdater};

use crate::data::{Digits, DigitsBatch};
use crate::gpt::{Block, INIT_STD, Norm, NormKind, Pass, cross_entropy, load_params};
use crate::init::LinearInit;
use crate::train::named_params;
use crate::train_vit::{
    VitReport, VitStepStats, VitTrainConfig, VitTrainError, batch_rows, evaluate,
};
use crate::vit::{Vit, VitConfig, patchify};

/// Patch projection, class token and positions: images to the token sequence.
#[derive(Module, Debug)]
pub struct VitInput {
    /// Patch projection `[patch_dim, d_model]`.
    pub patch_embed: Linear,
    /// Class token `[1, 1, d_model]`.
    pub cls_token: Param<Tensor<3>>,
    /// Positions `[1, n_patches + 1, d_model]`.
    pub pos_embed: Param<Tensor<3>>,
    /// The configuration.
    #[module(skip)]
    pub config: VitConfig,
}

impl InputLayer<DigitsBatch> for VitInput {
    fn forward(&self, batch: &DigitsBatch) -> Result<Tensor<3>, StageError> {
        let (images, _) = batch.to_tensors(&self.cls_token.val().device());
        let [b, _, _, _] = images.dims();
        let d = self.config.d_model;
        let x = self
            .patch_embed
            .forward(patchify(images, self.config.patch_size))
            .map_err(StageError::new)?;
        let cls = self.cls_token.val().expand([b, 1, d]);
        Ok(Tensor::cat(vec![cls, x], 1) + self.pos_embed.val())
    }
}

/// One encoder block.
#[derive(Module, Debug)]
pub struct VitLayer {
    /// The block (the ViT's own).
    pub block: Block,
}

impl Layer<DigitsBatch> for VitLayer {
    fn forward(&self, x: Tensor<3>, _: &DigitsBatch) -> Result<Tensor<3>, StageError> {
        let pass = Pass::new(x.dims()[1], None, &TpContext::single());
        self.block.forward(x, &pass).map_err(StageError::new)
    }
}

/// Final norm, classifier on the class token, cross-entropy against the labels.
#[derive(Module, Debug)]
pub struct VitOutput {
    /// Final norm.
    pub ln_f: Norm,
    /// Classifier `[d_model, n_classes]`.
    pub head: Linear,
}

impl OutputLayer<DigitsBatch> for VitOutput {
    fn loss(&self, x: Tensor<3>, batch: &DigitsBatch) -> Result<Tensor<1>, StageError> {
        let [b, _, d] = x.dims();
        let device = x.device();
        let cls = self.ln_f.forward(x).narrow(1, 0, 1).reshape([b, d]);
        let logits = self.head.forward(cls).map_err(StageError::new)?;
        let (_, labels) = batch.to_tensors(&device);
        Ok(cross_entropy(logits, labels))
    }
}

/// One stage of the ViT.
pub type VitStage = Sequential<VitInput, VitLayer, VitOutput>;

/// Builds stage `index` of `num_stages` with encoder blocks `blocks`, from `init` (the
/// single-device seed: each part gets the single-device values, at the same paths).
///
/// # Errors
/// [`VitTrainError::Invalid`] when a layer cannot be built.
pub fn vit_stage(
    config: &VitConfig,
    init: &Init,
    index: usize,
    num_stages: usize,
    blocks: Range<usize>,
) -> Result<VitStage, VitTrainError> {
    let d = config.d_model;
    let linear = |d_in, d_out| {
        LinearInit::new(d_in, d_out)
            .with_bias(true)
            .with_std(INIT_STD)
    };
    let error = |e: &dyn std::fmt::Display| VitTrainError::invalid(format!("stage {index}"), e);
    Sequential::build(
        index,
        num_stages,
        blocks,
        || {
            Ok(VitInput {
                patch_embed: init
                    .linear("patch_embed", linear(config.patch_dim(), d))
                    .map_err(|e| error(&e))?,
                cls_token: init.normal("cls_token", [1, 1, d], INIT_STD),
                pos_embed: init.normal("pos_embed", [1, config.n_patches() + 1, d], INIT_STD),
                config: config.clone(),
            })
        },
        |i| {
            Ok(VitLayer {
                block: Block::new(&config.block(), &init.at("blocks").at(i))
                    .map_err(|e| error(&e))?,
            })
        },
        || {
            Ok(VitOutput {
                ln_f: Norm::new(
                    NormKind::LayerNorm,
                    d,
                    config.block().norm_eps,
                    &init.at("ln_f"),
                ),
                head: init
                    .linear("head", linear(d, config.n_classes))
                    .map_err(|e| error(&e))?,
            })
        },
    )
}

/// The single-device ViT path of a stage's parameter: `input.x` and `output.x` are `x`,
/// `layers.{i}.block.x` is `blocks.{first + i}.x`.
pub fn vit_path(stage: &VitStage, path: &str) -> String {
    let path = stage.global_path(path);
    if let Some(rest) = path.strip_prefix("layers.") {
        return format!("blocks.{}", rest.replacen(".block", "", 1));
    }
    path.strip_prefix("input.")
        .or_else(|| path.strip_prefix("output."))
        .unwrap_or(&path)
        .to_string()
}

/// The pipeline settings of [`train_vit_pipeline`].
#[derive(Debug, Clone, PartialEq)]
pub struct VitPipeline {
    /// Pipeline ranks; the world is `pp x dp`.
    pub pp: usize,
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Micro-batches per step (per data-parallel rank).
    pub microbatches: usize,
    /// Stages per rank of the interleaved schedule.
    pub virtual_stages: Option<usize>,
    /// Recompute every block in the backward.
    pub checkpoint_blocks: bool,
}

impl Default for VitPipeline {
    fn default() -> Self {
        Self {
            pp: 2,
            schedule: ScheduleKind::OneFOneB,
            microbatches: 4,
            virtual_stages: None,
            checkpoint_blocks: false,
        }
    }
}

/// Trains the ViT of `config` with pipeline parallelism over `pipeline.pp` ranks and data
/// parallelism over the other `world / pp` (mesh `[pp, dp]`), the same run as single-device
/// training on the same global batches: each data-parallel rank takes its rows, splits them
/// into micro-batches, and each stage's gradients are averaged over its replicas and stepped
/// by AdamW (clipped by the norm over every stage when `config.max_grad_norm` is set). At the
/// end the stages are gathered into a whole [`Vit`] for the test accuracy and the report.
///
/// # Errors
/// [`VitTrainError::Invalid`] for settings that cannot work (checked before any communication);
/// pipeline and collective errors.
pub fn train_vit_pipeline(
    world: &ProcessGroup,
    config: &VitTrainConfig,
    pipeline: &VitPipeline,
    digits: &Digits,
    on_step: &mut dyn FnMut(&VitStepStats),
) -> Result<VitReport, VitTrainError> {
    config.validate()?;
    let bad = |m: String| Err(VitTrainError::invalid("ViT pipeline", m));
    if pipeline.pp < 2 || !world.size().is_multiple_of(pipeline.pp) {
        return bad(format!(
            "{} ranks cannot be split into pipelines of {} (at least 2) ranks; use a --pp that \
             divides the number of ranks",
            world.size(),
            pipeline.pp
        ));
    }
    let dp_size = world.size() / pipeline.pp;
    let m = pipeline.microbatches.max(1);
    if !config.batch_size.is_multiple_of(dp_size * m) {
        return bad(format!(
            "the global batch of {} images cannot be split over {dp_size} data-parallel ranks \
             x {m} micro-batches; use a multiple of {}",
            config.batch_size,
            dp_size * m
        ));
    }
    let pipe = |e: &dyn std::fmt::Display| VitTrainError::invalid("ViT pipeline", e);
    let schedule = generators::generate(pipeline.schedule, pipeline.pp, m, pipeline.virtual_stages)
        .map_err(|e| pipe(&e))?;
    let num_stages = schedule.num_stages();
    let split = partition::by_count(config.model.n_layers, num_stages).map_err(|e| pipe(&e))?;
    let dims = ParallelDims {
        pp: pipeline.pp,
        dp_replicate: dp_size,
        ..ParallelDims::default()
    };
    let mesh = dims.build(world)?;
    let pp = mesh.group("pp")?.clone();
    let dp = dims.data_parallel(&mesh)?;
    let device = Device::flex().autodiff();
    let plain = Device::flex();
    let (train, test) = digits.split(config.test_fraction, config.split_seed);

    let mut executor = Executor::new(schedule, pp.clone(), device.clone()).map_err(|e| pipe(&e))?;
    let init = Init::new(config.model.seed, &device);
    let mut stages: BTreeMap<usize, VitStage> = BTreeMap::new();
    let mut optims = BTreeMap::new();
    for s in executor.local_stages() {
        let stage = vit_stage(&config.model, &init, s, num_stages, split[s].clone())?
            .with_checkpointed_layers(pipeline.checkpoint_blocks);
        stages.insert(s, stage);
        optims.insert(s, StageOptimizer::module(config.adamw().init()));
    }
    let mut reduce = TrainStep::new(TpContext::single());
    if dp.size() > 1 {
        reduce = reduce.with_ddp(DistributedDataParallel::new(dp.clone()));
    }
    let mut updater = StageUpdater::new(&executor, optims, reduce)
        .map_err(|e| pipe(&e))?
        .with_clip(config.max_grad_norm);

    let rows = config.batch_size / dp.size();
    let micro = rows / m;
    let mut losses = Vec::with_capacity(config.steps);
    let mut train_seconds = 0.0;
    let start = Instant::now();
    for step in 0..config.steps {
        let t0 = Instant::now();
        let global = train.batch(step as u64, config.batch_size, config.data_seed);
        let first = dp.rank() * rows;
        let batches: Vec<DigitsBatch> = (0..m)
            .map(|k| batch_rows(&global, first + k * micro..first + (k + 1) * micro))
            .collect();
        let lr = config.lr_at(step);
        updater.set_lr(lr);
        let report = executor
            .step(&mut stages, &batches, &mut |s, stage, grads| {
                updater.at_reduce(s, stage, grads)
            })
            .map_err(|e| pipe(&e))?;
        let grad_norm = updater.finish(&mut stages, &report).map_err(|e| pipe(&e))?;
        let loss = f64::from(dp.all_reduce_f32(vec![report.loss], ReduceOp::Avg)?[0]);
        losses.push(loss);
        let seconds = t0.elapsed().as_secs_f64();
        train_seconds += seconds;
        on_step(&VitStepStats {
            step,
            loss,
            lr,
            grad_norm,
            images_per_sec: config.batch_size as f64 / seconds.max(1e-9),
            elapsed: start.elapsed().as_secs_f64(),
            test_accuracy: None,
        });
    }

    // ---- the whole model on every rank ----
    let mine: Vec<(String, Vec<usize>, Vec<f32>)> = stages
        .values()
        .flat_map(|stage| {
            named_params(stage)
                .into_iter()
                .map(|p| (vit_path(stage, &p.path), p.shape, p.values))
        })
        .collect();
    let all = pp.all_gather_object(&mine)?;
    let values: HashMap<String, TensorData> = all
        .into_iter()
        .flatten()
        .map(|(path, shape, values)| (path, TensorData::new(values, shape)))
        .collect();
    let model = load_params(Vit::new(&config.model, &plain), &values);
    let (test_correct, test_images) = evaluate(&model, &test, &dp, config.eval_batch, &plain)?;
    let test_accuracy = test_correct as f64 / test_images as f64;
    Ok(VitReport {
        losses,
        evals: vec![(config.steps.saturating_sub(1), test_accuracy)],
        test_accuracy,
        test_correct,
        test_images,
        train_seconds,
        model,
    })
}
