//! A Vision Transformer for small images.
//!
//! Images are cut into `patch_size x patch_size` patches, each flattened and projected by a
//! linear layer (`patch_embed`); a learned class token is prepended, a learned position
//! embedding added, and the sequence goes through pre-norm encoder blocks (the GPT's
//! [`Block`] with bidirectional attention). The classifier reads the class token after the final
//! norm.
//!
//! Initialisation follows the GPT's rules ([`crate::gpt`]): Normal(0, 0.02) for `patch_embed`,
//! `cls_token`, `pos_embed`, `q`, `k`, `v`, `mlp.up` and `head`, 0.02 / sqrt(2 n_layers) for
//! the residual projections, ones / zeros for norm weights and biases, all keyed by
//! `(seed, module path)`.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use examples::vit::{Vit, VitConfig};
//!
//! let device = Device::flex();
//! let config = VitConfig::digits();
//! let model = Vit::new(&config, &device);
//! let images = Tensor::<4>::zeros([2, 1, 8, 8], &device);
//! assert_eq!(model.forward(images).unwrap().dims(), [2, 10]);
//! ```

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};
use burn_parallel::ProcessGroup;
use burn_parallel::nn::{Linear, TpContext};
use burn_parallel::plan::TpPlan;
use burn_parallel::tensor_parallel::TpResult;
use burn_zero::{Fsdp, FsdpPlan, Result as ZeroResult, ZeroError};
use serde::{Deserialize, Serialize};

use crate::gpt::{
    Block, BlockConfig, ConfigError, GeluKind, INIT_STD, MlpKind, Norm, NormKind, Pass,
    build_blocks, cross_entropy, gather_blocks,
};
use crate::init::{Init, LinearInit};
use burn_parallel_train::load_named;

/// Hyper-parameters of [`Vit`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VitConfig {
    /// Side of the (square) input images in pixels.
    pub image_size: usize,
    /// Side of a patch; must divide `image_size`.
    pub patch_size: usize,
    /// Colour channels.
    pub channels: usize,
    /// Number of classes.
    pub n_classes: usize,
    /// Number of encoder blocks.
    pub n_layers: usize,
    /// Attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Hidden width of the MLP.
    pub d_ff: usize,
    /// Seed of the initialisation.
    #[serde(default)]
    pub seed: u64,
}

impl VitConfig {
    /// A small model for the 8x8 digits: 2x2 patches, 1 channel, 10 classes, 2 layers,
    /// 4 heads, width 32, MLP 128.
    pub fn digits() -> Self {
        Self {
            image_size: 8,
            patch_size: 2,
            channels: 1,
            n_classes: 10,
            n_layers: 2,
            n_heads: 4,
            d_model: 32,
            d_ff: 128,
            seed: 0,
        }
    }

    /// Patches per image.
    pub fn n_patches(&self) -> usize {
        let side = self.image_size / self.patch_size.max(1);
        side * side
    }

    /// Values in one flattened patch (`channels * patch_size^2`).
    pub fn patch_dim(&self) -> usize {
        self.channels * self.patch_size * self.patch_size
    }

    /// Checks that the sizes are consistent.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the first inconsistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("image_size", self.image_size),
            ("patch_size", self.patch_size),
            ("channels", self.channels),
            ("n_classes", self.n_classes),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be positive")));
            }
        }
        if !self.image_size.is_multiple_of(self.patch_size) {
            return Err(ConfigError::Invalid(format!(
                "patch_size ({}) must divide image_size ({})",
                self.patch_size, self.image_size
            )));
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ConfigError::HeadsDoNotDivide {
                d_model: self.d_model,
                n_heads: self.n_heads,
            });
        }
        Ok(())
    }

    /// The configuration of each encoder block (GELU, LayerNorm, biases, bidirectional).
    pub fn block(&self) -> BlockConfig {
        BlockConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_ff: self.d_ff,
            mlp: MlpKind::Gelu,
            gelu: GeluKind::Erf,
            norm: NormKind::LayerNorm,
            norm_eps: 1e-5,
            bias: true,
            dropout: 0.0,
            causal: false,
            residual_std: INIT_STD / (2.0 * self.n_layers as f64).sqrt(),
            fused: false,
            moe: None,
        }
    }

    /// Number of parameters, computed from the configuration. Equals [`Vit::num_params`].
    pub fn num_params(&self) -> usize {
        let d = self.d_model;
        let embed = self.patch_dim() * d + d + d + (self.n_patches() + 1) * d;
        let head = d * self.n_classes + self.n_classes;
        embed + self.n_layers * self.block().num_params() + 2 * d + head
    }
}

/// Cuts `images` `[batch, channels, H, W]` into non-overlapping `patch x patch` patches.
///
/// # Returns
///
/// `[batch, (H / patch) * (W / patch), channels * patch * patch]`, patches in row-major order,
/// each flattened as `(channel, row, column)`.
pub fn patchify(images: Tensor<4>, patch: usize) -> Tensor<3> {
    let [b, c, h, w] = images.dims();
    let (gh, gw) = (h / patch, w / patch);
    images
        .reshape([b, c, gh, patch, gw, patch])
        .permute([0, 2, 4, 1, 3, 5])
        .reshape([b, gh * gw, c * patch * patch])
}

/// The Vision Transformer: one type for one device and every layout. Build it with
/// [`Vit::new`] (one device) or [`Vit::build`] (any layout).
#[derive(Module, Debug)]
pub struct Vit {
    /// Patch projection `[patch_dim, d_model]` (replicated).
    pub patch_embed: Linear,
    /// Class token `[1, 1, d_model]`.
    pub cls_token: Param<Tensor<3>>,
    /// Position embedding `[1, n_patches + 1, d_model]` (class token first).
    pub pos_embed: Param<Tensor<3>>,
    /// Encoder blocks, each an FSDP unit under a sharded layout.
    pub blocks: Vec<Fsdp<Block>>,
    /// Final norm.
    pub ln_f: Norm,
    /// Classifier `[d_model, n_classes]` (replicated).
    pub head: Linear,
    /// The configuration the model was built from.
    #[module(skip)]
    pub config: VitConfig,
    /// The tensor-parallel context (single-device when not split).
    #[module(skip)]
    pub tp: TpContext,
}

/// The ViT under any [`burn_parallel_train::Layout`] (data, tensor and sequence parallel, ZeRO,
/// FSDP): its plans and its build are all the builder needs.
impl burn_parallel_train::ParallelModel for VitConfig {
    type Model = Vit;
    type Batch = crate::data::DigitsBatch;

    /// The ViT staged ([`crate::vit_pipeline`]): `--pp` trains it through the same builder.
    fn stages(&self) -> Option<&dyn burn_parallel_train::pipeline::Stager<Self>> {
        Some(self)
    }

    fn loss(model: &Vit, batch: &Self::Batch) -> Result<Tensor<1>, burn_parallel::Error> {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let (images, labels) = batch.to_tensors(&device);
        Ok(model.loss(images, labels)?)
    }

    fn n_heads(&self) -> usize {
        self.n_heads
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        Vit::tp_plan(sequence_parallel)
    }

    fn fsdp_plan(&self, shard: &ProcessGroup, _experts: &burn_moe::MoeParallel) -> FsdpPlan {
        Vit::fsdp_plan(shard)
    }

    fn build(&self, parts: &burn_parallel_train::ModelParts) -> Result<Vit, burn_parallel::Error> {
        if parts.context_parallel.is_some() {
            return Err(burn_parallel::Error::invalid(
                "--cp",
                "the ViT does not split its tokens over context-parallel ranks: drop --cp",
            ));
        }
        Ok(Vit::build(self, &parts.init, parts.fsdp.as_ref())?)
    }
}

impl Vit {
    /// Builds and initialises the model on one device, deterministically from `config.seed`.
    ///
    /// # Panics
    ///
    /// If [`VitConfig::validate`] fails.
    pub fn new(config: &VitConfig, device: &Device) -> Self {
        if let Err(e) = config.validate() {
            panic!("invalid VitConfig: {e}");
        }
        Self::build(config, &Init::new(config.seed, device), None)
            .unwrap_or_else(|e| panic!("a single-device ViT always builds: {e}"))
    }

    /// The tensor-parallel plan of the ViT: the encoder blocks split as the GPT's, the patch
    /// embedding and classifier replicated (they are small), the norms sequence-parallel.
    pub fn tp_plan(sequence_parallel: bool) -> TpPlan {
        TpPlan::new()
            .colwise("blocks.*.attn.{q,k,v}")
            .rowwise("blocks.*.attn.o")
            .colwise("blocks.*.mlp.up")
            .rowwise("blocks.*.mlp.down")
            .sequence_norm("{blocks.*.ln_1,blocks.*.ln_2,ln_f}")
            .with_sequence_parallel(sequence_parallel)
    }

    /// The FSDP plan of the ViT over `group`: every encoder block is a unit.
    pub fn fsdp_plan(group: &ProcessGroup) -> FsdpPlan {
        FsdpPlan::new(group).unit("blocks.*")
    }

    /// Builds the model for any layout (see [`crate::gpt::Gpt::build`]).
    ///
    /// # Errors
    /// [`ZeroError::Config`] for an invalid configuration; plan and collective errors.
    pub fn build(config: &VitConfig, init: &Init, fsdp: Option<&FsdpPlan>) -> ZeroResult<Self> {
        config
            .validate()
            .map_err(|e| ZeroError::Config(format!("invalid VitConfig: {e}")))?;
        let d = config.d_model;
        let block = config.block();
        let blocks = build_blocks(&block, config.n_layers, init, fsdp)?;
        let linear = |d_in, d_out| {
            LinearInit::new(d_in, d_out)
                .with_bias(true)
                .with_std(INIT_STD)
        };
        let model = Self {
            patch_embed: init.linear("patch_embed", linear(config.patch_dim(), d))?,
            cls_token: init.normal("cls_token", [1, 1, d], INIT_STD),
            pos_embed: init.normal("pos_embed", [1, config.n_patches() + 1, d], INIT_STD),
            blocks,
            ln_f: Norm::new(NormKind::LayerNorm, d, block.norm_eps, &init.at("ln_f")),
            head: init.linear("head", linear(d, config.n_classes))?,
            config: config.clone(),
            tp: init.context(),
        };
        init.finish()?;
        if let Some(plan) = fsdp {
            plan.finish()?;
        }
        Ok(model)
    }

    /// Number of float parameters this rank holds (the whole model's on one device, same as
    /// [`VitConfig::num_params`]).
    pub fn num_params(&self) -> usize {
        Module::num_params(self)
    }

    /// Class logits `[batch, n_classes]` of `images` `[batch, channels, size, size]`, the same
    /// on every rank of a tensor-parallel group.
    ///
    /// # Errors
    /// Shape and collective errors of the layout.
    pub fn forward(&self, images: Tensor<4>) -> TpResult<Tensor<2>> {
        let [b, _, _, _] = images.dims();
        let d = self.config.d_model;
        // The pixels in the parameters' dtype (bf16 or f16 under mixed precision).
        let images = images.cast(self.cls_token.val().dtype());
        let x = self
            .patch_embed
            .forward(patchify(images, self.config.patch_size))?;
        let cls = self.cls_token.val().expand([b, 1, d]);
        let x = Tensor::cat(vec![cls, x], 1) + self.pos_embed.val();
        let pass = Pass::new(x.dims()[1], None, &self.tp);
        let mut x = self.tp.scatter_sequence(x)?;
        for block in &self.blocks {
            x = block.get()?.forward(x, &pass)?;
        }
        // The norm runs on this rank's tokens; the class token is then read whole.
        let x = self.tp.gather_sequence(self.ln_f.forward(x))?;
        let cls = x.narrow(1, 0, 1).reshape([b, d]);
        self.head.forward(cls)
    }

    /// Mean cross-entropy (nats) of the predictions for `images` against `labels` `[batch]`;
    /// a one-element tensor.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn loss(&self, images: Tensor<4>, labels: Tensor<1, Int>) -> TpResult<Tensor<1>> {
        Ok(cross_entropy(self.forward(images)?, labels))
    }

    /// Predicted class ids `[batch]`.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn predict(&self, images: Tensor<4>) -> TpResult<Tensor<1, Int>> {
        let [b, _, _, _] = images.dims();
        Ok(self.forward(images)?.argmax(1).reshape([b]))
    }

    /// The same model with every FSDP unit and tensor-parallel shard gathered, as a
    /// single-device ViT on `device` (a collective over the layout's groups).
    ///
    /// # Errors
    /// Collective errors.
    pub fn to_single(&self, device: &Device) -> ZeroResult<Vit> {
        let whole = Vit {
            blocks: gather_blocks(&self.blocks)?,
            ..self.clone()
        };
        let params: std::collections::HashMap<String, burn::tensor::TensorData> =
            self.tp.full_params(&whole)?.into_iter().collect();
        Ok(load_named(Vit::new(&self.config, device), &params))
    }
}
