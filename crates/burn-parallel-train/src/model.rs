//! What the builder needs of a user's model ([`ParallelModel`]: its plans, its build, its
//! batch and loss, its pipeline form through [`Stager`]), what the layout gives its build
//! ([`ModelParts`]), how the engine steps ([`StepSettings`]), the groups of a placed layout
//! ([`Groups`]), and a pipeline rank's side of training ([`PipelineSteps`]): the vocabulary the
//! builder ([`crate::build()`]), the pipeline ([`crate::pipeline`]) and the loop share.

use std::any::Any;
use std::ops::Range;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor, TensorData};
use burn_moe::MoeParallel;
use burn_parallel::checkpoint::{Checkpoint, Checkpointer};
use burn_parallel::context_parallel::ContextParallel;
use burn_parallel::init::Init;
use burn_parallel::muon::MuonConfig;
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::plan::TpPlan;
use burn_parallel::precision::{LossScaler, MixedPrecision};
use burn_parallel::tensor_parallel::SeededDropout;
use burn_parallel::train::{SaveState, StepOutput};
use burn_parallel::{DeviceMesh, Error, ParallelDims, ProcessGroup};
use burn_pipeline::runtime::StepReport;
use burn_zero::FsdpPlan;
use serde_json::Value;
use std::collections::BTreeMap;

use crate::layout::{Layout, Workload};

/// What the builder needs of a user's model: how to split it and how to build it. Implement it
/// on the model's config (the model does not exist before the layout places it).
///
/// # Example
/// A one-layer model trained by data parallelism over two ranks: the same code runs any
/// layout the model's plans allow.
/// ```
/// use burn::module::Module;
/// use burn::tensor::{Device, Tensor};
/// use burn_moe::MoeParallel;
/// use burn_parallel::init::LinearInit;
/// use burn_parallel::nn::Linear;
/// use burn_parallel::plan::TpPlan;
/// use burn_parallel::{Error, ProcessGroup};
/// use burn_parallel_train::{Layout, ModelParts, ParallelModel, StepSettings, build, run_local};
/// use burn_zero::FsdpPlan;
///
/// #[derive(Module, Debug)]
/// struct Tiny {
///     fc: Linear,
/// }
///
/// struct TinyConfig;
///
/// impl ParallelModel for TinyConfig {
///     type Model = Tiny;
///     /// A micro-batch: the value of every input.
///     type Batch = f32;
///     fn loss(m: &Tiny, x: &f32) -> Result<Tensor<1>, Error> {
///         let x = Tensor::<2>::full([1, 4], *x, &m.fc.weight.device());
///         Ok(m.fc.forward(x)?.powi_scalar(2).mean())
///     }
///     fn n_heads(&self) -> usize { 1 }
///     fn seed(&self) -> u64 { 7 }
///     fn tp_plan(&self, _sp: bool) -> TpPlan { TpPlan::new() }
///     fn fsdp_plan(&self, shard: &ProcessGroup, _experts: &MoeParallel) -> FsdpPlan {
///         FsdpPlan::new(shard)
///     }
///     fn build(&self, parts: &ModelParts) -> Result<Tiny, Error> {
///         Ok(Tiny { fc: parts.init.linear("fc", LinearInit::new(4, 1))? })
///     }
/// }
///
/// let losses = run_local(2, |world| {
///     let device = Device::flex().autodiff();
///     let settings = StepSettings { batch_size: 2, ..StepSettings::default() };
///     let mut run = build(&world, &Layout::default(), &TinyConfig, &device, &settings)?;
///     // Each data-parallel rank's micro-batch is its rank.
///     let rank = run.groups.data.rank() as f32;
///     let out = run.step(1, &mut |_micro| Ok(rank), 1e-2)?;
///     Ok(out.loss)
/// })
/// .unwrap();
/// // The loss is the mean over the data-parallel ranks: every rank reports the same.
/// assert_eq!(losses[0], losses[1]);
/// ```
pub trait ParallelModel {
    /// The model on one rank (its parameters on an autodiff device).
    type Model: Module + 'static;

    /// One micro-batch of this rank's rows, as [`Self::loss`] (and a pipeline's stages)
    /// take it.
    type Batch: 'static;

    /// The mean loss of `batch` on `model`, a one-element tensor.
    ///
    /// # Errors
    /// Whatever the model's forward refuses.
    fn loss(model: &Self::Model, batch: &Self::Batch) -> Result<Tensor<1>, Error>;

    /// The model's dropout layers by name (`blocks.3.attn.drop`), whose positions [`crate::fit()`]
    /// saves with its checkpoints and restores on resume ([`crate::streams`]); default none.
    fn dropout_layers(_model: &Self::Model) -> Vec<(String, SeededDropout)> {
        Vec::new()
    }

    /// The model's pipeline form (`Some(self)` for a [`crate::StagedModel`]); `None`, the default,
    /// refuses `pp > 1`.
    fn stages(&self) -> Option<&dyn Stager<Self>>
    where
        Self: Sized,
    {
        None
    }

    /// Attention heads: tensor parallelism splits whole heads, so [`Layout::validate`] refuses a
    /// `tp` that does not divide them. A model without attention returns a number every `tp` it
    /// may run under divides (its hidden width, say): 1 would refuse `tp > 1`.
    fn n_heads(&self) -> usize;

    /// Experts per MoE layer; `None` (the default) for a dense model.
    fn n_experts(&self) -> Option<usize> {
        None
    }

    /// Whether the model applies dropout (refused under context parallelism).
    fn has_dropout(&self) -> bool {
        false
    }

    /// The seed of [`Init`]: every rank builds the same parameters from it.
    fn seed(&self) -> u64;

    /// The tensor-parallel plan (with sequence parallelism when `sequence_parallel`).
    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan;

    /// The FSDP plan over `shard`: which sub-modules are units; the experts of `experts` stay
    /// whole (they differ between expert-parallel ranks).
    fn fsdp_plan(&self, shard: &ProcessGroup, experts: &MoeParallel) -> FsdpPlan;

    /// Builds this rank's model from the layout's parts.
    ///
    /// # Errors
    /// Whatever the model's build refuses.
    fn build(&self, parts: &ModelParts) -> Result<Self::Model, Error>;
}

/// What the layout gives a model's [`ParallelModel::build`].
pub struct ModelParts {
    /// The seed, the device and the tensor-parallel plan.
    pub init: Init,
    /// FSDP's plan (`zero` stage 3), or `None`.
    pub fsdp: Option<FsdpPlan>,
    /// The expert-parallel groups and the registry of expert parameters.
    pub experts: MoeParallel,
    /// The context-parallel group and settings (`cp > 1`), or `None`.
    pub context_parallel: Option<ContextParallel>,
    /// This rank's data-parallel index: the stream of its dropout masks.
    pub data_rank: usize,
}

/// How the engine steps: what is not the layout's split.
#[derive(Debug, Clone)]
pub struct StepSettings {
    /// Compute and reduction dtypes, fp32 master weights ([`MixedPrecision::full`]: fp32).
    pub precision: MixedPrecision,
    /// Dynamic loss scaling (fp16).
    pub loss_scaler: Option<LossScaler>,
    /// Global gradient-norm clipping.
    pub max_grad_norm: Option<f64>,
    /// AdamW's hyper-parameters (betas, epsilon, decoupled weight decay), for Burn's AdamW or
    /// the fused kernel alike.
    pub adamw: FusedAdamWConfig,
    /// Bytes per gradient bucket of DDP and ZeRO.
    pub bucket_bytes: usize,
    /// One fused AdamW kernel per parameter (the CubeCL path) instead of Burn's composed AdamW.
    pub fused_adamw: bool,
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Micro-steps per optimizer step.
    pub grad_accum: usize,
    /// Muon's settings and the rule that picks the hidden matrices, for a layout that trains
    /// with it ([`crate::Optim::Muon`]; see [`burn_parallel::muon`]); AdamW (with
    /// [`Self::adamw`]) steps the rest. Default: [`MuonConfig::transformer`].
    pub muon: MuonConfig,
}

impl Default for StepSettings {
    fn default() -> Self {
        Self {
            precision: MixedPrecision::full(),
            loss_scaler: None,
            max_grad_norm: Some(1.0),
            adamw: FusedAdamWConfig::new(),
            bucket_bytes: 25 << 20,
            fused_adamw: false,
            batch_size: 1,
            seq_len: 1,
            grad_accum: 1,
            muon: MuonConfig::transformer(),
        }
    }
}

impl StepSettings {
    /// Burn's AdamW with these settings' hyper-parameters (betas, epsilon, weight decay).
    pub fn adamw_config(&self) -> AdamWConfig {
        let hyper = self.adamw;
        AdamWConfig::new()
            .with_beta_1(hyper.beta_1)
            .with_beta_2(hyper.beta_2)
            .with_epsilon(hyper.epsilon)
            .with_weight_decay(hyper.weight_decay)
    }

    /// Checks the settings' ranges, each named by its flag: clipping (`--clip`: a norm of 0, a
    /// negative or a NaN one freezes, reverses or silently disables the update), the buckets
    /// (`--bucket-mb`), the weight decay (`--weight-decay`), the loss scaler (`--loss-scale`).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the flag.
    ///
    /// ```
    /// use burn_parallel_train::StepSettings;
    ///
    /// assert!(StepSettings::default().validate().is_ok());
    /// let clip = StepSettings { max_grad_norm: Some(f64::NAN), ..StepSettings::default() };
    /// assert!(clip.validate().unwrap_err().to_string().contains("--clip"));
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        if let Some(norm) = self.max_grad_norm.filter(|n| !(n.is_finite() && *n > 0.0)) {
            let reason = format!("the clipping norm must be a finite number above 0, got {norm}");
            return Err(Error::invalid("--clip", reason));
        }
        if self.bucket_bytes == 0 {
            return Err(Error::invalid(
                "--bucket-mb",
                "the gradient buckets must hold at least a byte",
            ));
        }
        let decay = self.adamw.weight_decay;
        if !(decay.is_finite() && decay >= 0.0) {
            let reason = format!("weight_decay must be a finite number, 0 or above, got {decay}");
            return Err(Error::invalid("--weight-decay", reason));
        }
        if let Some(scaler) = &self.loss_scaler {
            scaler
                .validate()
                .map_err(|e| Error::invalid("--loss-scale", e))?;
        }
        self.muon
            .validate()
            .map_err(|e| Error::invalid("--optim muon", e.to_string()))?;
        Ok(())
    }

    /// The layout rules' view of `model` trained with these settings.
    pub fn workload<P: ParallelModel>(&self, model: &P) -> Workload {
        Workload {
            n_heads: model.n_heads(),
            n_experts: model.n_experts(),
            dropout: model.has_dropout(),
            seq_len: self.seq_len,
            batch_size: self.batch_size,
            grad_accum: self.grad_accum,
            mixed_precision: !self.precision.is_full() || self.loss_scaler.is_some(),
            loss_scaling: self.loss_scaler.is_some(),
        }
    }
}

/// The groups of a placed layout.
#[derive(Debug, Clone)]
pub struct Groups {
    /// Every rank.
    pub world: ProcessGroup,
    /// The mesh of the layout.
    pub mesh: DeviceMesh,
    /// Its dimensions.
    pub dims: ParallelDims,
    /// The data-parallel ranks: each takes its rows of the global batch.
    pub data: ProcessGroup,
    /// The ranks that average gradients and the loss: the data-parallel ranks and the
    /// context-parallel ones (which hold other tokens of the same rows).
    pub reduce: ProcessGroup,
    /// The ranks that hold identical copies of the same parameters (every data rank under
    /// DDP; the ranks of one shard position under FSDP).
    pub replicate: ProcessGroup,
    /// The FSDP shard group (the data ranks, with the context-parallel ones).
    pub shard: ProcessGroup,
}

/// A model's pipeline form as the builder reaches it through [`ParallelModel::stages`]:
/// implemented for every [`crate::StagedModel`].
pub trait Stager<P: ParallelModel> {
    /// Places the pipeline of `layout` on this rank of `world`.
    ///
    /// # Errors
    /// As [`crate::PipelineEngine::new`].
    fn place(
        &self,
        world: &ProcessGroup,
        layout: &Layout,
        device: &Device,
        settings: &StepSettings,
    ) -> Result<(Groups, Box<dyn PipelineSteps<P>>), Error>;
}

/// A pipeline rank's side of training, as [`crate::fit()`] and a user's own loop drive it.
pub trait PipelineSteps<P: ParallelModel> {
    /// One optimizer step over this data-parallel rank's micro-batches, at rate `lr`.
    ///
    /// # Returns
    /// The loss of the global batch (the same on every rank), the global gradient norm, and
    /// whether a loss-scaling overflow skipped the update.
    ///
    /// # Errors
    /// The pipeline's errors (a failed peer, a non-finite loss or norm).
    fn step(&mut self, batches: &[P::Batch], lr: f64) -> Result<StepOutput, Error>;

    /// Saves the stages' parameters and optimizer state under the whole model's names, with
    /// `state`, as checkpoint `step` of `saver` (collective over every rank).
    ///
    /// # Errors
    /// I/O and collective failures.
    fn save(&self, saver: &mut Checkpointer, step: usize, state: SaveState) -> Result<(), Error>;

    /// Loads a checkpoint saved under any layout into the stages and their optimizers.
    ///
    /// # Returns
    /// The caller's state given to the save.
    ///
    /// # Errors
    /// A checkpoint of another model, or damaged.
    fn load(&mut self, checkpoint: &Checkpoint) -> Result<Value, Error>;

    /// Loads the stages' parameters from tensors under the whole model's names (a Hugging Face
    /// checkpoint mapped onto the model's names).
    ///
    /// # Errors
    /// Tensors of another model.
    fn load_params(&mut self, tensors: &BTreeMap<String, TensorData>) -> Result<(), Error>;

    /// Checks that the stages' replicas (the data-parallel ranks of each stage) agree.
    ///
    /// # Errors
    /// [`Error::Replica`] naming the first parameter that differs.
    fn verify_replicas(&self) -> Result<(), Error>;

    /// Every parameter of the whole model under its path, in fp32, tensor-parallel shards
    /// gathered, on every rank (collective over the world).
    ///
    /// # Errors
    /// Collective failures.
    fn whole_params(&self) -> Result<BTreeMap<String, TensorData>, Error>;

    /// The dropout layers of this rank's stages ([`crate::StagedModel::stage_dropout_layers`]).
    fn dropout_layers(&self) -> Vec<(String, SeededDropout)>;

    /// The device the stages live on.
    fn device(&self) -> &Device;

    /// Parameters held by this rank's stages.
    fn held_params(&self) -> usize;

    /// The layers of each stage.
    fn split(&self) -> &[Range<usize>];

    /// The report of the last step (its timeline, for a trace and the bubble).
    fn last_step(&self) -> Option<&StepReport>;

    /// The loss scale (1 without a loss scaler).
    fn loss_scale(&self) -> f64;

    /// The engine itself, for a caller that knows its model ([`crate::PipelineEngine::stages`]).
    fn as_any(&self) -> &dyn Any;
}
