//! A user's own model: a small LLaMA-style decoder (RMSNorm, SwiGLU, causal attention, untied
//! output head) written once with `burn_parallel::nn` layers. The same type trains on one device
//! and under every layout; nothing here knows the layout except the plan in [`tp_plan`] and,
//! for context parallelism, the two places where the sequence is split (the loss's tokens) and
//! attended across ranks (`Attention::forward`).

use burn::module::{Module, Param};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Int, Tensor};
use burn_moe::{MoeConfig, MoeLayer, MoeParallel};
use burn_parallel::context_parallel::ContextParallel;
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::kernels::causal_mask;
use burn_parallel::nn::{Embedding, Linear, TpContext};
use burn_parallel::plan::TpPlan;
use burn_parallel::tensor_parallel::{TpError, TpResult};
use burn_pipeline::sequential as seq;
use burn_pipeline::stage::StageError;
use burn_zero::{Fsdp, FsdpPlan};
use examples::data::Batch;

/// The model's shape.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub vocab: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub d_ff: usize,
    pub n_layers: usize,
    pub seed: u64,
}

impl Config {
    /// A small decoder: 2 layers of width 128 over bytes.
    pub fn small() -> Self {
        Self {
            vocab: 256,
            d_model: 128,
            n_heads: 4,
            d_ff: 344,
            n_layers: 2,
            seed: 1,
        }
    }
}

/// The mixture of experts of the MoE variant ([`Decoder::with_experts`]) of the model `c`:
/// `n_experts` SwiGLU experts of half the MLP's hidden width, `top_k` per token, dropless,
/// with the Switch load-balancing loss and the router z-loss.
pub fn moe_config(c: &Config, n_experts: usize, top_k: usize) -> MoeConfig {
    let mut moe = MoeConfig::new(c.d_model, c.d_ff.div_ceil(2), n_experts, top_k);
    moe.expert = burn_moe::ExpertKind::SwiGlu;
    moe.aux_loss = 0.01;
    moe.z_loss = 0.001;
    moe
}

/// The decoder (and, for the MoE variant, its experts) as `burn_parallel_train::build` lays it
/// out under any `Layout`: its plans and its build.
pub struct Recipe {
    /// The decoder's shape.
    pub config: Config,
    /// The MoE variant's experts (`None`: the dense decoder).
    pub moe: Option<MoeConfig>,
}

impl burn_parallel_train::ParallelModel for Recipe {
    type Model = Decoder;
    type Batch = Batch;

    fn loss(model: &Decoder, batch: &Batch) -> Result<Tensor<1>, burn_parallel::Error> {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let (tokens, targets) = batch.to_tensors(&device);
        Ok(model.loss(tokens, targets)?)
    }

    /// The decoder stages (below): `--pp` trains it through the same `build` and `fit`.
    fn stages(&self) -> Option<&dyn burn_parallel_train::pipeline::Stager<Self>> {
        self.moe.is_none().then_some(self as _)
    }

    fn n_heads(&self) -> usize {
        self.config.n_heads
    }

    fn n_experts(&self) -> Option<usize> {
        self.moe.as_ref().map(|moe| moe.n_experts)
    }

    fn seed(&self) -> u64 {
        self.config.seed
    }

    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        match self.moe {
            Some(_) => moe_tp_plan(sequence_parallel),
            None => tp_plan(sequence_parallel),
        }
    }

    fn fsdp_plan(&self, shard: &burn_parallel::ProcessGroup, experts: &MoeParallel) -> FsdpPlan {
        let experts = experts.experts.clone();
        fsdp_plan(shard).keep_whole(move |id| experts.contains(&id))
    }

    fn build(
        &self,
        parts: &burn_parallel_train::ModelParts,
    ) -> Result<Decoder, burn_parallel::Error> {
        let experts = self.moe.as_ref().map(|moe| (moe, &parts.experts));
        let model = Decoder::build(&parts.init, parts.fsdp.as_ref(), &self.config, experts)?;
        Ok(model.with_context_parallel(parts.context_parallel.clone()))
    }
}

/// The decoder cut into pipeline stages: an embedding, layers, the norm and head with the loss.
impl burn_parallel_train::StagedModel for Recipe {
    type Stage = Stage;

    fn n_layers(&self) -> usize {
        self.config.n_layers
    }

    fn stage(
        &self,
        parts: &burn_parallel_train::StageParts<'_>,
    ) -> Result<Stage, burn_parallel::Error> {
        let (index, stages, layers) = (parts.index, parts.num_stages, parts.layers.clone());
        let stage = stage(parts.init, &self.config, index, stages, layers)?;
        Ok(stage.with_checkpointed_layers(parts.recompute_layers))
    }

    fn model_paths(stage: &Stage) -> burn_parallel_train::pipeline::PathMap {
        std::sync::Arc::new(stage.flat_paths())
    }
}

/// Each layer is an FSDP unit under a sharded layout.
pub fn fsdp_plan(group: &burn_parallel::ProcessGroup) -> FsdpPlan {
    FsdpPlan::new(group).unit("layers.*")
}

/// The tensor-parallel plan of this model (torchtitan's `parallelize_llama`): the attention,
/// vocabulary and norm rules of [`moe_tp_plan`] and the MLP's two.
pub fn tp_plan(sequence_parallel: bool) -> TpPlan {
    moe_tp_plan(sequence_parallel)
        .colwise("layers.*.mlp.{gate,up}")
        .rowwise("layers.*.mlp.down")
}

/// [`tp_plan`] for the MoE variant ([`Decoder::with_experts`]), whose layers hold experts in
/// place of the MLP: the experts are split by expert parallelism, not by these rules (a rule
/// that matches no layer is an error, so the MLP's rules cannot stay).
pub fn moe_tp_plan(sequence_parallel: bool) -> TpPlan {
    TpPlan::new()
        .vocab("{embed,head}")
        .colwise("layers.*.attn.{q,k,v}")
        .rowwise("layers.*.attn.o")
        .sequence_norm("**.norm*")
        .with_sequence_parallel(sequence_parallel)
}

#[derive(Module, Debug)]
pub struct RmsNorm {
    pub weight: Param<Tensor<1>>,
}

impl RmsNorm {
    fn new(init: &Init, d: usize) -> Self {
        Self {
            weight: init.ones([d]),
        }
    }
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let rms = (x.clone().square().mean_dim(2) + 1e-5).sqrt();
        x / rms * self.weight.val().unsqueeze()
    }
}

#[derive(Module, Debug)]
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    #[module(skip)]
    pub head_dim: usize,
}

impl Attention {
    fn new(init: &Init, c: &Config) -> TpResult<Self> {
        let hd = c.d_model / c.n_heads;
        let proj = LinearInit::new(c.d_model, c.d_model).with_block(hd);
        Ok(Self {
            q: init.linear("q", proj)?,
            k: init.linear("k", proj)?,
            v: init.linear("v", proj)?,
            o: init.linear("o", proj.with_std(0.02 / (2.0 * c.n_layers as f64).sqrt()))?,
            head_dim: hd,
        })
    }

    /// `cp`: the context-parallel group when the sequence is split over ranks (`x` holds this
    /// rank's tokens; the attention runs over the whole sequence, ring or Ulysses).
    fn forward(&self, x: Tensor<3>, cp: Option<&ContextParallel>) -> TpResult<Tensor<3>> {
        // Local heads: all of them on one device, this rank's share under tensor parallelism.
        let heads = |t: Tensor<3>| {
            let [b, s, w] = t.dims();
            t.reshape([b, s, w / self.head_dim, self.head_dim])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (
            heads(self.q.forward(x.clone())?),
            heads(self.k.forward(x.clone())?),
            heads(self.v.forward(x)?),
        );
        let [b, h, s, _] = q.dims();
        let y = match cp {
            Some(cp) => cp.attention(q, k, v, true)?,
            None => {
                let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f32).sqrt();
                let mask = causal_mask(0..s, 0..s, &scores.device())
                    .reshape([1, 1, s, s])
                    .expand([b, h, s, s]);
                softmax(scores.mask_fill(mask, -1e9), 3).matmul(v)
            }
        };
        self.o
            .forward(y.swap_dims(1, 2).reshape([b, s, h * self.head_dim]))
    }
}

#[derive(Module, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    fn new(init: &Init, c: &Config) -> TpResult<Self> {
        Ok(Self {
            gate: init.linear("gate", LinearInit::new(c.d_model, c.d_ff))?,
            up: init.linear("up", LinearInit::new(c.d_model, c.d_ff))?,
            down: init.linear("down", LinearInit::new(c.d_ff, c.d_model))?,
        })
    }

    fn forward(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        let hidden = silu(self.gate.forward(x.clone())?) * self.up.forward(x)?;
        self.down.forward(hidden)
    }
}

/// A decoder layer; its feed-forward network is the dense SwiGLU `mlp`, or in the MoE variant
/// ([`Decoder::with_experts`]) the mixture of experts `moe`.
#[derive(Module, Debug)]
pub struct Layer {
    pub norm1: RmsNorm,
    pub attn: Attention,
    pub norm2: RmsNorm,
    pub mlp: Option<Mlp>,
    pub moe: Option<MoeLayer>,
}

impl Layer {
    pub fn new(init: &Init, c: &Config) -> burn_zero::Result<Self> {
        Self::build(init, c, None)
    }

    /// With `experts`, a mixture of experts split over its groups in place of the MLP.
    pub fn build(
        init: &Init,
        c: &Config,
        experts: Option<(&MoeConfig, &MoeParallel)>,
    ) -> burn_zero::Result<Self> {
        let (mlp, moe) = match experts {
            None => (Some(Mlp::new(&init.at("mlp"), c)?), None),
            Some((config, parallel)) => {
                let moe = MoeLayer::build(config, &init.at("moe"), parallel);
                (None, Some(moe.map_err(TpError::from)?))
            }
        };
        Ok(Self {
            norm1: RmsNorm::new(&init.at("norm1"), c.d_model),
            attn: Attention::new(&init.at("attn"), c)?,
            norm2: RmsNorm::new(&init.at("norm2"), c.d_model),
            mlp,
            moe,
        })
    }

    pub fn forward(&self, x: Tensor<3>, cp: Option<&ContextParallel>) -> TpResult<Tensor<3>> {
        let x = x.clone() + self.attn.forward(self.norm1.forward(x), cp)?;
        let h = self.norm2.forward(x.clone());
        let y = match (&self.mlp, &self.moe) {
            (Some(mlp), _) => mlp.forward(h)?,
            (None, Some(moe)) => moe.forward(h)?,
            (None, None) => unreachable!("a layer has an MLP or experts"),
        };
        Ok(x + y)
    }
}

#[derive(Module, Debug)]
pub struct Decoder {
    pub embed: Embedding,
    pub layers: Vec<Fsdp<Layer>>,
    pub norm: RmsNorm,
    pub head: Linear,
    #[module(skip)]
    pub tp: TpContext,
    /// The context-parallel group, when the sequence is split over ranks.
    #[module(skip)]
    pub cp: Option<ContextParallel>,
}

impl Decoder {
    /// Builds the model from `init` (single device: `Init::new(seed, device)`; tensor-parallel:
    /// `Init::new(..).with_tp(group, tp_plan(sp))`), each layer an FSDP unit when `fsdp` says so.
    // The single-device constructors: the parity tests (which include this file) build the
    // oracle with them; the example builds through `Recipe`.
    #[allow(dead_code)]
    pub fn new(init: &Init, fsdp: Option<&FsdpPlan>, c: &Config) -> burn_zero::Result<Self> {
        Self::build(init, fsdp, c, None)
    }

    /// The MoE variant: every layer's feed-forward network a mixture of experts (`experts`),
    /// split over the groups of `parallel` (expert parallelism: each rank builds its share of
    /// the experts; [`MoeParallel::default`] on one device). Train it with
    /// `burn_moe::MoeStep`, which reduces the expert gradients over the ranks holding the same
    /// experts.
    #[allow(dead_code)]
    pub fn with_experts(
        init: &Init,
        c: &Config,
        experts: &MoeConfig,
        parallel: &MoeParallel,
    ) -> burn_zero::Result<Self> {
        Self::build(init, None, c, Some((experts, parallel)))
    }

    fn build(
        init: &Init,
        fsdp: Option<&FsdpPlan>,
        c: &Config,
        experts: Option<(&MoeConfig, &MoeParallel)>,
    ) -> burn_zero::Result<Self> {
        let layer = |init: &Init| Layer::build(init, c, experts);
        let layers = (0..c.n_layers)
            .map(|i| {
                let init = init.at("layers").at(i);
                match fsdp {
                    Some(plan) => plan.wrap(&init, layer),
                    None => Ok(Fsdp::new(layer(&init)?)),
                }
            })
            .collect::<burn_zero::Result<Vec<_>>>()?;
        let model = Self {
            embed: init.embedding("embed", c.vocab, c.d_model, 0.02)?,
            layers,
            norm: RmsNorm::new(&init.at("norm"), c.d_model),
            head: init.linear("head", LinearInit::new(c.d_model, c.vocab))?,
            tp: init.context(),
            cp: None,
        };
        init.finish()?;
        if let Some(plan) = fsdp {
            plan.finish()?;
        }
        Ok(model)
    }

    /// Every parameter whole, by path: the FSDP units all-gathered, then the tensor-parallel
    /// shards gathered (what the parity tests compare with one device). Collective.
    #[allow(dead_code)]
    pub fn whole_params(&self) -> burn_parallel::Result<Vec<(String, burn::tensor::TensorData)>> {
        let mut whole = self.clone();
        whole.layers = self
            .layers
            .iter()
            .map(|unit| Ok(Fsdp::new(unit.full()?)))
            .collect::<burn_parallel::Result<Vec<_>>>()?;
        self.tp.full_params(&whole.valid())
    }

    /// Splits every sequence over the context-parallel group `cp` (`None`: whole sequences).
    pub fn with_context_parallel(mut self, cp: Option<ContextParallel>) -> Self {
        self.cp = cp.filter(|cp| cp.size() > 1);
        self
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (both `[batch, seq]`, whole
    /// sequences; under context parallelism the mean over this rank's tokens, which the
    /// gradient reduction over the context-parallel ranks averages).
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        let (tokens, targets) = match &self.cp {
            Some(cp) => {
                let layout = cp.layout(tokens.dims()[1])?;
                (layout.local(tokens, 1)?, layout.local(targets, 1)?)
            }
            None => (tokens, targets),
        };
        let mut x = self.tp.scatter_sequence(self.embed.forward(tokens)?)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let layer = layer.get()?; // all-gathers an FSDP unit (or takes its prefetch)
            if let Some(next) = self.layers.get(i + 1) {
                next.prefetch()?; // with FsdpPlan::with_prefetch: travels while `layer` computes
            }
            x = layer.forward(x, self.cp.as_ref())?;
        }
        let logits = self.head.forward(self.norm.forward(x))?;
        self.head.cross_entropy(logits, targets)
    }
}

// ---- pipeline parallelism: the same parts, staged by burn_pipeline::sequential ----

/// The embedding, the input layer of a pipeline's first stage.
#[derive(Module, Debug)]
pub struct PipeEmbed {
    pub embed: Embedding,
    #[module(skip)]
    pub tp: TpContext,
}

impl seq::InputLayer<Batch> for PipeEmbed {
    fn forward(&self, batch: &Batch) -> Result<Tensor<3>, StageError> {
        let (tokens, _) = batch.to_tensors(&self.embed.weight.device());
        let x = self.embed.forward(tokens).map_err(StageError::new)?;
        self.tp.scatter_sequence(x).map_err(StageError::new)
    }
}

impl seq::Layer<Batch> for Layer {
    fn forward(&self, x: Tensor<3>, _: &Batch) -> Result<Tensor<3>, StageError> {
        Layer::forward(self, x, None).map_err(StageError::new)
    }
}

/// The final norm, head and loss, the output layer of a pipeline's last stage.
#[derive(Module, Debug)]
pub struct PipeHead {
    pub norm: RmsNorm,
    pub head: Linear,
}

impl seq::OutputLayer<Batch> for PipeHead {
    fn loss(&self, x: Tensor<3>, batch: &Batch) -> Result<Tensor<1>, StageError> {
        let (_, targets) = batch.to_tensors(&x.device());
        let logits = self
            .head
            .forward(self.norm.forward(x))
            .map_err(StageError::new)?;
        self.head
            .cross_entropy(logits, targets)
            .map_err(StageError::new)
    }
}

/// One pipeline stage of the decoder.
pub type Stage = seq::Sequential<PipeEmbed, Layer, PipeHead>;

/// Stage `index` of `num_stages`, holding `layers`, from `init` (the same seeded values and
/// plan paths as [`Decoder::new`], so a rank builds exactly its stage's share).
pub fn stage(
    init: &Init,
    c: &Config,
    index: usize,
    num_stages: usize,
    layers: std::ops::Range<usize>,
) -> burn_zero::Result<Stage> {
    seq::Sequential::build(
        index,
        num_stages,
        layers,
        || {
            Ok(PipeEmbed {
                embed: init.embedding("embed", c.vocab, c.d_model, 0.02)?,
                tp: init.context(),
            })
        },
        |i| Layer::new(&init.at("layers").at(i), c),
        || {
            Ok(PipeHead {
                norm: RmsNorm::new(&init.at("norm"), c.d_model),
                head: init.linear("head", LinearInit::new(c.d_model, c.vocab))?,
            })
        },
    )
}
