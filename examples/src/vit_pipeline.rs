//! Pipeline parallelism for the bundled ViT, through the library's generic stage
//! ([`burn_pipeline::sequential::Sequential`]): the ViT is an input layer (patch projection,
//! class token, positions), a sequence of encoder blocks, and an output layer (final norm,
//! classifier on the class token, cross-entropy). Three small trait implementations stage it,
//! and [`StagedModel`] for [`VitConfig`] gives the stages to the library's builder: under a
//! layout with `pp > 1`, [`crate::train_vit::train_vit`] trains it over a `pp x dp` mesh with
//! any schedule of `burn-pipeline`, through the same builder and loop as every other layout,
//! the run's micro-batches ([`crate::train_vit::VitTrainConfig::grad_accum`]) flowing through
//! the schedule.
//!
//! ```text
//! vit --ranks 2 --pp 2 --schedule 1f1b --grad-accum 4
//! vit --ranks 4 --pp 2 --schedule zbv --grad-accum 2 --checkpoint-blocks --layers 4
//! ```

use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn_parallel::init::Init;
use burn_parallel::nn::{Linear, TpContext};
use burn_parallel_train::pipeline::PathMap;
use burn_parallel_train::{StageParts, StagedModel};
use burn_pipeline::sequential::{InputLayer, Layer, OutputLayer, Sequential};
use burn_pipeline::stage::StageError;

use crate::data::DigitsBatch;
use crate::gpt::{Block, INIT_STD, Norm, NormKind, Pass, cross_entropy};
use crate::init::LinearInit;
use crate::train_vit::VitTrainError;
use crate::vit::{VitConfig, patchify};

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
        let cls_token = self.cls_token.val();
        let (images, _) = batch.to_tensors(&cls_token.device());
        // The pixels in the parameters' dtype (bf16 or f16 under mixed precision).
        let images = images.cast(cls_token.dtype());
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
    vit_path_at(stage.first_layer, path)
}

/// [`vit_path`] of a stage whose first block is `first`.
fn vit_path_at(first: usize, path: &str) -> String {
    let rest = path.strip_prefix("layers.").and_then(|rest| {
        let (local, tail) = rest.split_once('.')?;
        let tail = tail.strip_prefix("block.")?;
        Some(format!(
            "blocks.{}.{tail}",
            first + local.parse::<usize>().ok()?
        ))
    });
    match rest {
        Some(path) => path,
        None => path
            .strip_prefix("input.")
            .or_else(|| path.strip_prefix("output."))
            .unwrap_or(path)
            .to_string(),
    }
}

/// The ViT cut into pipeline stages for the library's builder: its blocks split by count.
impl StagedModel for VitConfig {
    type Stage = VitStage;

    fn n_layers(&self) -> usize {
        self.n_layers
    }

    fn stage(&self, parts: &StageParts<'_>) -> Result<VitStage, burn_parallel::Error> {
        if parts.init.context().group().is_some_and(|g| g.size() > 1) {
            return Err(burn_parallel::Error::invalid(
                "--tp",
                "the ViT's pipeline stages are not split by tensor parallelism: drop --tp",
            ));
        }
        let (index, stages, blocks) = (parts.index, parts.num_stages, parts.layers.clone());
        let stage = vit_stage(self, parts.init, index, stages, blocks)?;
        Ok(stage.with_checkpointed_layers(parts.recompute_layers))
    }

    fn model_paths(stage: &VitStage) -> PathMap {
        let first = stage.first_layer;
        Arc::new(move |path| vit_path_at(first, path))
    }
}
