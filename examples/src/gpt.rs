//! A GPT: decoder-only, pre-norm transformer language model.
//!
//! The model knows nothing of parallelism (torchtitan style). Every linear map is its own named
//! field (`attn.q`, `attn.k`, `attn.v`, `attn.o`, `mlp.up`, `mlp.gate`, `mlp.down`, `lm_head`)
//! so that a parallelisation plan can swap or shard them one by one, and [`Attention`] derives
//! its number of heads from the width of `q`'s output (`width / head_dim`), so column-sharding
//! `q`, `k`, `v` by whole heads needs no change here.
//!
//! Every parameter is initialised by [`crate::init`] from `(config.seed, module path)`:
//!
//! | parameter | init |
//! |---|---|
//! | `wte.weight`, `wpe.weight`, `*.weight` of `q`, `k`, `v`, `mlp.up`, `mlp.gate`, `lm_head` | Normal(0, 0.02) |
//! | `attn.o.weight`, `mlp.down.weight` (residual projections) | Normal(0, 0.02 / sqrt(2 n_layers)) |
//! | norm `weight` / every `bias` | ones / zeros |
//!
//! Linear weights use Burn's layout `[d_input, d_output]` (the transpose of PyTorch's).
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use examples::gpt::{Gpt, GptConfig};
//!
//! let device = Device::flex();
//! let config = GptConfig { d_ff: 32, ..GptConfig::new(256, 1, 2, 8, 16) };
//! let model = Gpt::new(&config, &device);
//! let tokens = Tensor::<2, Int>::zeros([2, 5], &device);
//! assert_eq!(model.forward(tokens).unwrap().dims(), [2, 5, 256]);
//! ```
//!
//! The same type split over two ranks by its tensor-parallel plan (each rank builds only its
//! shards); the loss is the single-device one:
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use burn_parallel::init::Init;
//! use burn_parallel::run_local;
//! use examples::gpt::{Gpt, GptConfig};
//!
//! let config = GptConfig { d_ff: 32, ..GptConfig::new(256, 1, 2, 8, 16) };
//! let device = Device::flex();
//! let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3, 4]], &device);
//! let single = Gpt::new(&config, &device).loss(tokens.clone(), tokens.clone()).unwrap();
//! let losses = run_local(2, |tp| {
//!     let plan = Gpt::tp_plan(&config, true); // sequence parallel too
//!     let init = Init::new(config.seed, &device).with_tp(&tp, plan).unwrap();
//!     let model = Gpt::build(&config, &init, None).unwrap();
//!     let loss = model.loss(tokens.clone(), tokens.clone()).unwrap();
//!     Ok(loss.into_scalar::<f32>())
//! })
//! .unwrap();
//! assert!((losses[0] - single.into_scalar::<f32>()).abs() < 1e-5);
//! ```

use burn::module::Module;
use burn::tensor::activation::{gelu, gelu_approximate, log_softmax, silu, softmax};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_moe::{MoeConfig, MoeLayer, MoeParallel, MoeStats};
use burn_parallel::ProcessGroup;
use burn_parallel::autograd::WeightGradSink;
use burn_parallel::context_parallel::{ContextParallel, SeqLayout};
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::kernels;
use burn_parallel::nn::{Embedding, Linear, LinearSplit, TpContext};
/// The norms and rotary tables of the blocks (the library's layers).
pub use burn_parallel::nn::{Norm, NormKind, Rope};
use burn_parallel::plan::TpPlan;
use burn_parallel::tensor_parallel::{DropoutSite, SeededDropout, TpError, TpResult, sp_param};
use burn_zero::{Fsdp, FsdpPlan, Result as ZeroResult, ZeroError};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Standard deviation of the GPT-2 initialisation.
pub const INIT_STD: f64 = 0.02;

/// Errors of an inconsistent model configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// `d_model` is not a multiple of `n_heads`.
    #[error("d_model ({d_model}) must be a multiple of n_heads ({n_heads})")]
    HeadsDoNotDivide {
        /// The model width.
        d_model: usize,
        /// The number of heads.
        n_heads: usize,
    },
    /// Rotary embeddings rotate pairs, so the head dimension must be even.
    #[error("rotary positions need an even head dimension, got {head_dim}")]
    OddHeadDim {
        /// `d_model / n_heads`.
        head_dim: usize,
    },
    /// A size that must be positive is zero, or the dropout is outside `[0, 1)`.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The feed-forward network of each block (`gpt --mlp gelu|swiglu`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum MlpKind {
    /// `down(gelu(up(x)))` (GPT-2).
    #[default]
    Gelu,
    /// `down(silu(gate(x)) * up(x))` (LLaMA).
    #[value(name = "swiglu")]
    SwiGlu,
}

/// Which GELU the [`MlpKind::Gelu`] feed-forward network applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GeluKind {
    /// The exact `x Φ(x)` (with `erf`).
    #[default]
    Erf,
    /// The tanh approximation `x/2 (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`, GPT-2's
    /// `gelu_new`.
    Tanh,
}

/// How token positions are encoded (`gpt --positions learned|rotary`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum PositionKind {
    /// A learned table `wpe` added to the token embeddings (GPT-2).
    #[default]
    Learned,
    /// Rotary position embeddings applied to `q` and `k` in every attention layer.
    Rotary,
}

fn default_true() -> bool {
    true
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_norm_eps() -> f64 {
    1e-5
}

fn default_moe_every() -> usize {
    1
}

/// Hyper-parameters of [`Gpt`]. Serialisable; optional fields have serde defaults, and a key
/// it does not know is refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Number of token ids (256 for byte-level text).
    pub vocab_size: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Number of attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Hidden width of the feed-forward network.
    pub d_ff: usize,
    /// Longest sequence (size of the learned position table).
    pub max_seq_len: usize,
    /// Feed-forward kind.
    #[serde(default)]
    pub mlp: MlpKind,
    /// The GELU of a [`MlpKind::Gelu`] feed-forward network (exact by default; GPT-2
    /// checkpoints use [`GeluKind::Tanh`]).
    #[serde(default)]
    pub gelu: GeluKind,
    /// Position encoding.
    #[serde(default)]
    pub positions: PositionKind,
    /// Use the token embedding as the output projection (no `lm_head`).
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Normalisation layer.
    #[serde(default)]
    pub norm: NormKind,
    /// Dropout probability. The masks are a function of (seed, layer, call, global position)
    /// ([`SeededDropout`]), so tensor and sequence parallelism draw the single-device masks;
    /// data-parallel replicas draw their own (see [`Gpt::with_dropout_stream`]).
    #[serde(default)]
    pub dropout: f64,
    /// Biases in the linear layers.
    #[serde(default = "default_true")]
    pub bias: bool,
    /// Base of the rotary frequencies.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Epsilon of the norms.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Seed of the initialisation.
    #[serde(default)]
    pub seed: u64,
    /// Run norms, attention, GELU/SwiGLU, RoPE and the cross-entropy through the fused kernels
    /// of [`burn_parallel::kernels`] (one-pass CPU kernels and blockwise attention on Flex,
    /// CubeCL kernels on WGPU, composed references elsewhere).
    #[serde(default)]
    pub fused: bool,
    /// Mixture of experts (GPT-MoE): the MLP of every `moe_every`-th block is this
    /// [`MoeLayer`] (its `d_model` must equal the model's; an unset `residual_std` takes the
    /// blocks' residual std). `None`: a dense GPT.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// With `moe`: blocks `moe_every - 1`, `2 moe_every - 1`, ... are MoE blocks (1: every
    /// block, 2: every second block starting with block 1).
    #[serde(default = "default_moe_every")]
    pub moe_every: usize,
}

impl GptConfig {
    /// Rotary tables for `seq_len` positions starting at `offset`, or `None` for learned
    /// positions.
    pub fn rope(&self, seq_len: usize, offset: usize, device: &Device) -> Option<Rope> {
        match self.positions {
            PositionKind::Rotary => Some(
                Rope::new(self.head_dim(), seq_len, offset, self.rope_theta, device)
                    .with_fused(self.fused),
            ),
            PositionKind::Learned => None,
        }
    }

    /// A GPT-2 style configuration: GELU MLP with `d_ff = 4 d_model`, learned positions,
    /// untied embeddings, LayerNorm, no dropout, biases, seed 0.
    ///
    /// # Arguments
    ///
    /// - `vocab_size`, `n_layers`, `n_heads`, `d_model`, `max_seq_len`: see the fields.
    pub fn new(
        vocab_size: usize,
        n_layers: usize,
        n_heads: usize,
        d_model: usize,
        max_seq_len: usize,
    ) -> Self {
        Self {
            vocab_size,
            n_layers,
            n_heads,
            d_model,
            d_ff: 4 * d_model,
            max_seq_len,
            mlp: MlpKind::Gelu,
            gelu: GeluKind::Erf,
            positions: PositionKind::Learned,
            tied_embeddings: false,
            norm: NormKind::LayerNorm,
            dropout: 0.0,
            bias: true,
            rope_theta: default_rope_theta(),
            norm_eps: default_norm_eps(),
            seed: 0,
            fused: false,
            moe: None,
            moe_every: 1,
        }
    }

    /// `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Checks that the sizes are consistent.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the first inconsistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
            ("max_seq_len", self.max_seq_len),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be positive")));
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ConfigError::HeadsDoNotDivide {
                d_model: self.d_model,
                n_heads: self.n_heads,
            });
        }
        if self.positions == PositionKind::Rotary && !self.head_dim().is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim {
                head_dim: self.head_dim(),
            });
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::Invalid(format!(
                "dropout must be in [0, 1), got {}",
                self.dropout
            )));
        }
        if let Some(moe) = &self.moe {
            if self.moe_every == 0 {
                return Err(ConfigError::Invalid(
                    "moe_every must be at least 1 (1: every block is an MoE block)".into(),
                ));
            }
            if moe.d_model != self.d_model {
                return Err(ConfigError::Invalid(format!(
                    "moe.d_model ({}) must equal d_model ({})",
                    moe.d_model, self.d_model
                )));
            }
            moe.validate()
                .map_err(|e| ConfigError::Invalid(format!("moe: {e}")))?;
        }
        Ok(())
    }

    /// Whether block `i` is an MoE block: `moe` is set and `(i + 1) % moe_every == 0`.
    pub fn is_moe_block(&self, i: usize) -> bool {
        self.moe.is_some() && (i + 1).is_multiple_of(self.moe_every.max(1))
    }

    /// Number of MoE blocks.
    pub fn n_moe_blocks(&self) -> usize {
        (0..self.n_layers).filter(|&i| self.is_moe_block(i)).count()
    }

    /// The configuration of block `i`: [`Self::block`], with the MoE layer when
    /// [`Self::is_moe_block`] (its `residual_std` defaults to the blocks' one).
    pub fn block_at(&self, i: usize) -> BlockConfig {
        let mut block = self.block();
        if self.is_moe_block(i) {
            block.moe = self.moe.clone().map(|m| MoeConfig {
                residual_std: m.residual_std.or(Some(block.residual_std)),
                ..m
            });
        }
        block
    }

    /// Parameters one token uses (the active parameters): [`Self::num_params`] with each MoE
    /// layer counted by [`MoeConfig::active_params`] (router, `top_k` experts, shared experts).
    pub fn active_params(&self) -> usize {
        let moe_blocks = self.n_moe_blocks();
        match (&self.moe, moe_blocks) {
            (Some(moe), n) if n > 0 => {
                let moe = self.block_at(self.moe_every - 1).moe.unwrap_or(moe.clone());
                self.num_params() - n * moe.num_params() + n * moe.active_params()
            }
            _ => self.num_params(),
        }
    }

    /// The configuration of each dense block (every block of a GPT without MoE).
    pub fn block(&self) -> BlockConfig {
        BlockConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_ff: self.d_ff,
            mlp: self.mlp,
            gelu: self.gelu,
            norm: self.norm,
            norm_eps: self.norm_eps,
            bias: self.bias,
            dropout: self.dropout,
            causal: true,
            residual_std: INIT_STD / (2.0 * self.n_layers as f64).sqrt(),
            fused: self.fused,
            moe: None,
        }
    }

    /// The shape the memory and FLOPs planner ([`burn_parallel::planner`]) works with.
    pub fn planner_shape(&self) -> burn_parallel::planner::ModelShape {
        use burn_parallel::planner::{ModelShape, MoeShape, NormShape};
        ModelShape {
            layers: self.n_layers,
            d_model: self.d_model,
            heads: self.n_heads,
            kv_heads: self.n_heads,
            d_ff: self.d_ff,
            vocab: self.vocab_size,
            position_table: match self.positions {
                PositionKind::Learned => self.max_seq_len,
                PositionKind::Rotary => 0,
            },
            gated_mlp: self.mlp == MlpKind::SwiGlu,
            bias: self.bias,
            norm: match self.norm {
                NormKind::LayerNorm => NormShape::LayerNorm,
                NormKind::RmsNorm => NormShape::RmsNorm,
            },
            tied_embeddings: self.tied_embeddings,
            moe: self.moe.as_ref().map(|m| MoeShape {
                experts: m.n_experts,
                top_k: m.top_k,
                d_ff: m.d_ff,
                shared: m.n_shared,
                gated: m.expert == burn_moe::ExpertKind::SwiGlu,
                bias: m.bias,
                every: self.moe_every,
            }),
            measured_params: None,
        }
    }

    /// Number of parameters, computed from the configuration without building the model.
    /// Equals [`Gpt::num_params`].
    pub fn num_params(&self) -> usize {
        let (d, v) = (self.d_model, self.vocab_size);
        let wpe = match self.positions {
            PositionKind::Learned => self.max_seq_len * d,
            PositionKind::Rotary => 0,
        };
        let head = if self.tied_embeddings {
            0
        } else {
            d * v + usize::from(self.bias) * v
        };
        let blocks: usize = (0..self.n_layers)
            .map(|i| self.block_at(i).num_params())
            .sum();
        v * d + wpe + blocks + self.norm.num_params(d) + head
    }
}

impl Default for GptConfig {
    /// A small byte-level model: vocab 256, 4 layers, 4 heads, width 128, context 128.
    fn default() -> Self {
        Self::new(256, 4, 4, 128, 128)
    }
}

/// Hyper-parameters of one [`Block`] (shared by GPT and ViT).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockConfig {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of attention heads.
    pub n_heads: usize,
    /// Hidden width of the MLP.
    pub d_ff: usize,
    /// MLP kind.
    pub mlp: MlpKind,
    /// The GELU of a [`MlpKind::Gelu`] MLP.
    pub gelu: GeluKind,
    /// Norm kind.
    pub norm: NormKind,
    /// Norm epsilon.
    pub norm_eps: f64,
    /// Biases in the linear layers.
    pub bias: bool,
    /// Dropout probability.
    pub dropout: f64,
    /// Causal (decoder) or bidirectional (encoder) attention.
    pub causal: bool,
    /// Std of the residual projections `attn.o` and `mlp.down`.
    pub residual_std: f64,
    /// Norms, attention, GELU/SwiGLU through the fused kernels.
    pub fused: bool,
    /// The block's feed-forward network is this mixture of experts instead of the MLP.
    pub moe: Option<MoeConfig>,
}

impl BlockConfig {
    /// Number of parameters of one block (every expert of an MoE block).
    pub fn num_params(&self) -> usize {
        let (d, f, b) = (self.d_model, self.d_ff, usize::from(self.bias));
        let attn = 4 * (d * d + b * d);
        let n_in = match self.mlp {
            MlpKind::Gelu => 1,
            MlpKind::SwiGlu => 2,
        };
        let mlp = match &self.moe {
            Some(moe) => moe.num_params(),
            None => n_in * (d * f + b * f) + f * d + b * d,
        };
        attn + mlp + 2 * self.norm.num_params(d)
    }
}

/// What a block's forward pass needs to know about the whole sequence: the rotary tables (for
/// every position of the sequence), the sequence length, and which tokens this rank holds
/// between the sub-layers (all of them unless sequence parallelism splits them).
///
/// Under context parallelism (`cp`), the rank holds only its tokens of the sequence: `seq` is
/// their number, the rotary tables are those of their global positions, and attention runs
/// through the context-parallel group.
#[derive(Clone, Debug)]
pub struct Pass {
    /// Rotary tables for the tokens of the pass, or `None` (learned positions, or ViT).
    pub rope: Option<Rope>,
    /// The sequence length (this rank's tokens under context parallelism).
    pub seq: usize,
    /// This rank's first token and token count between the sub-layers.
    pub tokens: (usize, usize),
    /// The data-parallel stream of the dropout masks.
    pub stream: u64,
    /// The context-parallel group and the layout of the whole sequence over it, or `None`.
    pub cp: Option<CpPass>,
}

/// The context-parallel part of a [`Pass`].
#[derive(Clone, Debug)]
pub struct CpPass {
    /// The group and its settings (ring or Ulysses).
    pub ctx: ContextParallel,
    /// Which tokens of the whole sequence this rank holds.
    pub layout: SeqLayout,
}

impl Pass {
    /// A pass over `seq` tokens under the tensor-parallel context `tp`.
    pub fn new(seq: usize, rope: Option<Rope>, tp: &TpContext) -> Self {
        Self {
            rope,
            seq,
            tokens: tp.sequence_range(seq),
            stream: 0,
            cp: None,
        }
    }
}

/// Position-keyed dropout of a layer (see [`SeededDropout`]): the same mask for a layout split
/// any way, `None` for probability 0.
fn dropout(p: f64, init: &Init, site: &str) -> Option<SeededDropout> {
    (p > 0.0).then(|| SeededDropout::new(p, init.seed(), &init.path(site)))
}

/// Applies `drop` to a residual-branch output `[batch, tokens, d]` holding `pass.tokens`.
fn residual_dropout(drop: &Option<SeededDropout>, x: Tensor<3>, pass: &Pass) -> Tensor<3> {
    match drop {
        None => x,
        Some(drop) => {
            let [b, _, d] = x.dims();
            let drop = drop.clone().with_stream(pass.stream);
            drop.forward(
                x,
                &DropoutSite::new(&[b, pass.seq, d], &[0, pass.tokens.0, 0]),
            )
        }
    }
}

/// The first output feature of this rank's part of a (column-split) layer.
fn first_output(l: &Linear) -> usize {
    match &l.split {
        LinearSplit::Column { shard, .. } => shard.start,
        _ => 0,
    }
}

/// Multi-head self-attention with separate `q`, `k`, `v`, `o` projections. Under tensor
/// parallelism `q`, `k`, `v` are split by whole heads (colwise) and `o` by the same heads
/// (rowwise): the number of local heads is `q`'s output width over `head_dim`.
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection `[d_model, n_heads * head_dim]`.
    pub q: Linear,
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// Output projection `[n_heads * head_dim, d_model]` (a residual projection).
    pub o: Linear,
    /// Dropout on the attention probabilities.
    #[module(skip)]
    pub attn_drop: Option<SeededDropout>,
    /// Dropout on the output.
    #[module(skip)]
    pub resid_drop: Option<SeededDropout>,
    /// Width of one head.
    #[module(skip)]
    pub head_dim: usize,
    /// Heads of the whole layer (all ranks).
    #[module(skip)]
    pub n_heads: usize,
    /// Mask future positions.
    #[module(skip)]
    pub causal: bool,
    /// Attend through the blockwise kernel ([`kernels::attention`]) when there is no attention
    /// dropout.
    #[module(skip)]
    pub fused: bool,
}

impl Attention {
    /// Builds the layer; parameters are named `q.weight`, ... under `init`.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] when the plan splits the heads over more ranks than there are
    /// heads; plan errors.
    pub fn new(config: &BlockConfig, init: &Init) -> TpResult<Self> {
        let d = config.d_model;
        let head_dim = d / config.n_heads;
        let proj = LinearInit::new(d, d)
            .with_bias(config.bias)
            .with_std(INIT_STD)
            .with_block(head_dim);
        Ok(Self {
            q: init.linear("q", proj)?,
            k: init.linear("k", proj)?,
            v: init.linear("v", proj)?,
            o: init.linear("o", proj.with_std(config.residual_std))?,
            attn_drop: dropout(config.dropout, init, "attn_drop"),
            resid_drop: dropout(config.dropout, init, "resid_drop"),
            head_dim,
            n_heads: config.n_heads,
            causal: config.causal,
            fused: config.fused,
        })
    }

    /// Splits `[batch, seq, heads * head_dim]` into `[batch, heads, seq, head_dim]`.
    fn split_heads(&self, x: Tensor<3>) -> Tensor<4> {
        let [b, s, width] = x.dims();
        x.reshape([b, s, width / self.head_dim, self.head_dim])
            .swap_dims(1, 2)
    }

    /// Attends over the sequence.
    ///
    /// # Arguments
    /// - `x`: `[batch, tokens, d_model]` (already normalised; this rank's tokens under sequence
    ///   parallelism).
    /// - `pass`: the sequence this pass runs over.
    ///
    /// # Returns
    /// `[batch, tokens, d_model]`.
    ///
    /// # Errors
    /// Shape and collective errors of the tensor-parallel layers.
    pub fn forward(&self, x: Tensor<3>, pass: &Pass) -> TpResult<Tensor<3>> {
        // One entry into the tensor-parallel region for the three projections: under sequence
        // parallelism one all-gather of `x`, and only this rank's shard kept for the backward.
        let [q, k, v] = Linear::forward_shared([&self.q, &self.k, &self.v], x)?;
        let (mut q, mut k, v) = (
            self.split_heads(q),
            self.split_heads(k),
            self.split_heads(v),
        );
        if let Some(rope) = &pass.rope {
            q = rope.apply(q);
            k = rope.apply(k);
        }
        let [b, heads, s, _] = q.dims();
        if let Some(cp) = &pass.cp {
            // Dropout is refused with context parallelism (`Gpt::with_context_parallel`).
            let y = cp
                .ctx
                .attention(q, k, v, self.causal)?
                .swap_dims(1, 2)
                .reshape([b, s, heads * self.head_dim]);
            return Ok(residual_dropout(&self.resid_drop, self.o.forward(y)?, pass));
        }
        if self.fused && self.attn_drop.is_none() {
            let y = kernels::attention(q, k, v, self.causal)
                .unwrap_or_else(|e| panic!("fused attention: {e}"))
                .swap_dims(1, 2)
                .reshape([b, s, heads * self.head_dim]);
            return Ok(residual_dropout(&self.resid_drop, self.o.forward(y)?, pass));
        }
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mut scores = q.matmul(k.swap_dims(2, 3)) * scale; // [b, h, s, s]
        if self.causal {
            let mask = kernels::causal_mask(0..s, 0..s, &scores.device())
                .reshape([1, 1, s, s])
                .expand([b, heads, s, s]);
            scores = scores.mask_fill(mask, f32::NEG_INFINITY);
        }
        let mut probs = softmax(scores, 3);
        if let Some(drop) = &self.attn_drop {
            let first = first_output(&self.q) / self.head_dim;
            let site = DropoutSite::new(&[b, self.n_heads, s, s], &[0, first, 0, 0]);
            probs = drop.clone().with_stream(pass.stream).forward(probs, &site);
        }
        let y = probs
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, s, heads * self.head_dim]);
        Ok(residual_dropout(&self.resid_drop, self.o.forward(y)?, pass))
    }
}

/// Feed-forward network: `down(gelu(up(x)))`, or `down(silu(gate(x)) * up(x))` when `gate` is
/// present (SwiGLU). Under tensor parallelism `up` and `gate` are split colwise, `down` rowwise.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Up projection `[d_model, d_ff]`.
    pub up: Linear,
    /// Gate projection `[d_model, d_ff]` (SwiGLU only).
    pub gate: Option<Linear>,
    /// Down projection `[d_ff, d_model]` (a residual projection).
    pub down: Linear,
    /// Dropout on the output.
    #[module(skip)]
    pub drop: Option<SeededDropout>,
    /// SwiGLU's gating through the fused kernel.
    #[module(skip)]
    pub fused: bool,
    /// The GELU of a gate-less MLP.
    #[module(skip)]
    pub gelu: GeluKind,
}

impl Mlp {
    /// Builds the layer; parameters are named `up.weight`, ... under `init`.
    ///
    /// # Errors
    /// Plan errors.
    pub fn new(config: &BlockConfig, init: &Init) -> TpResult<Self> {
        let (d, f) = (config.d_model, config.d_ff);
        let spec = |d_in, d_out, std| {
            LinearInit::new(d_in, d_out)
                .with_bias(config.bias)
                .with_std(std)
        };
        Ok(Self {
            up: init.linear("up", spec(d, f, INIT_STD))?,
            gate: match config.mlp {
                MlpKind::Gelu => None,
                MlpKind::SwiGlu => Some(init.linear("gate", spec(d, f, INIT_STD))?),
            },
            down: init.linear("down", spec(f, d, config.residual_std))?,
            drop: dropout(config.dropout, init, "drop"),
            fused: config.fused,
            gelu: config.gelu,
        })
    }

    /// `[batch, tokens, d_model] -> [batch, tokens, d_model]`.
    ///
    /// # Errors
    /// Shape and collective errors of the tensor-parallel layers.
    pub fn forward(&self, x: Tensor<3>, pass: &Pass) -> TpResult<Tensor<3>> {
        let hidden = match &self.gate {
            None if self.fused => kernels::gelu(self.up.forward(x)?, self.gelu == GeluKind::Tanh),
            None => match self.gelu {
                GeluKind::Erf => gelu(self.up.forward(x)?),
                GeluKind::Tanh => gelu_approximate(self.up.forward(x)?),
            },
            Some(gate) => {
                // `gate` and `up` share one entry into the tensor-parallel region (one
                // all-gather under sequence parallelism).
                let [g, u] = Linear::forward_shared([gate, &self.up], x)?;
                if self.fused {
                    kernels::swiglu(g, u).unwrap_or_else(|e| panic!("fused swiglu: {e}"))
                } else {
                    silu(g) * u
                }
            }
        };
        Ok(residual_dropout(
            &self.drop,
            self.down.forward(hidden)?,
            pass,
        ))
    }
}

/// Pre-norm transformer block: `x + attn(ln_1(x))`, then `x + ffn(ln_2(x))`, where the
/// feed-forward network is the MLP (`mlp`) or, in an MoE block, the mixture of experts (`moe`).
#[derive(Module, Debug)]
pub struct Block {
    /// Norm before attention.
    pub ln_1: Norm,
    /// Self-attention.
    pub attn: Attention,
    /// Norm before the feed-forward network.
    pub ln_2: Norm,
    /// Feed-forward network of a dense block (`None` in an MoE block).
    pub mlp: Option<Mlp>,
    /// Mixture of experts of an MoE block (`None` in a dense block).
    pub moe: Option<MoeLayer>,
    /// Dropout on the MoE layer's output.
    #[module(skip)]
    pub moe_drop: Option<SeededDropout>,
    /// Norms through the fused kernels.
    #[module(skip)]
    pub fused: bool,
    /// The tensor-parallel context the block was built with: under sequence parallelism an MoE
    /// layer routes the whole sequence (gathered over the group), as on one device.
    #[module(skip)]
    pub tp: TpContext,
}

impl Block {
    /// The dropout layers of the block under its path `prefix` (`blocks.3`), appended to
    /// `out`: clones that share the block's call counters ([`SeededDropout::calls`]), which
    /// checkpoints save and restore so that a resumed run draws the saving run's masks.
    pub fn dropout_layers(&self, prefix: &str, out: &mut Vec<(String, SeededDropout)>) {
        let mlp_drop = self.mlp.as_ref().and_then(|m| m.drop.as_ref());
        for (name, drop) in [
            ("attn.attn_drop", self.attn.attn_drop.as_ref()),
            ("attn.resid_drop", self.attn.resid_drop.as_ref()),
            ("mlp.drop", mlp_drop),
            ("moe_drop", self.moe_drop.as_ref()),
        ] {
            if let Some(drop) = drop {
                out.push((format!("{prefix}.{name}"), drop.clone()));
            }
        }
    }

    /// Defers the weight gradients of the block's linear layers (attention and dense MLP; an
    /// MoE's experts keep theirs) to `sink`, for a zero-bubble pipeline schedule's `W` step
    /// (see [`burn_parallel::nn::Linear::with_deferred_weight`]); `None` turns it off.
    pub fn with_deferred_weights(self, sink: Option<Arc<dyn WeightGradSink>>) -> Self {
        let defer = |l: Linear| l.with_deferred_weight(sink.clone());
        let Attention { q, k, v, o, .. } = self.attn;
        let attn = Attention {
            q: defer(q),
            k: defer(k),
            v: defer(v),
            o: defer(o),
            ..self.attn
        };
        let mlp = self.mlp.map(|m| Mlp {
            up: defer(m.up),
            gate: m.gate.map(defer),
            down: defer(m.down),
            ..m
        });
        Self { attn, mlp, ..self }
    }

    /// Builds the block on one device; parameters are named `ln_1.weight`, `attn.q.weight`,
    /// ... under `init`.
    ///
    /// # Errors
    /// Plan errors; an invalid MoE configuration.
    pub fn new(config: &BlockConfig, init: &Init) -> TpResult<Self> {
        Self::build(config, init, &MoeParallel::default())
    }

    /// Builds the block with the MoE layer (if any) split over the groups of `experts`: this
    /// rank builds only its share of the experts (`moe.experts.{j}` holds global expert
    /// `moe.first_expert + j`).
    ///
    /// # Errors
    /// Plan errors; MoE errors (invalid configuration, experts not divisible by the
    /// expert-parallel size, ranks that disagree) as [`TpError::Shape`] or collective errors.
    pub fn build(config: &BlockConfig, init: &Init, experts: &MoeParallel) -> TpResult<Self> {
        let d = config.d_model;
        let (mlp, moe) = match &config.moe {
            None => (Some(Mlp::new(config, &init.at("mlp"))?), None),
            Some(moe) => (None, Some(MoeLayer::build(moe, &init.at("moe"), experts)?)),
        };
        Ok(Self {
            ln_1: Norm::new(config.norm, d, config.norm_eps, &init.at("ln_1")),
            attn: Attention::new(config, &init.at("attn"))?,
            ln_2: Norm::new(config.norm, d, config.norm_eps, &init.at("ln_2")),
            mlp,
            moe_drop: moe
                .as_ref()
                .and_then(|_| dropout(config.dropout, &init.at("moe"), "drop")),
            moe,
            fused: config.fused,
            tp: init.context(),
        })
    }

    fn norm(&self, norm: &Norm, x: Tensor<3>) -> Tensor<3> {
        if self.fused {
            norm.forward_fused(x)
        } else {
            norm.forward(x)
        }
    }

    /// `[batch, tokens, d_model] -> [batch, tokens, d_model]`.
    ///
    /// # Errors
    /// Shape and collective errors of the tensor-parallel layers.
    pub fn forward(&self, x: Tensor<3>, pass: &Pass) -> TpResult<Tensor<3>> {
        let x = x.clone() + self.attn.forward(self.norm(&self.ln_1, x), pass)?;
        let h = self.norm(&self.ln_2, x.clone());
        let y = match (&self.mlp, &self.moe) {
            (Some(mlp), _) => mlp.forward(h, pass)?,
            (None, Some(moe)) => {
                // Every tensor-parallel rank runs the whole layer on the replicated tokens.
                // Under sequence parallelism each holds a part of the sequence: the router
                // must see all of it (the load-balancing loss, the token counts and the
                // capacity groups are over the whole batch), so the layer runs on the gathered
                // sequence and each rank keeps its part of the output. The gather's backward
                // keeps this rank's part of the (replicated) input gradient, the split's
                // all-gathers the output gradient: expert gradients are those of one device.
                let h = self.tp.gather_sequence(h)?;
                let y = moe.forward(h)?;
                let y = self.tp.scatter_sequence(y)?;
                residual_dropout(&self.moe_drop, y, pass)
            }
            (None, None) => {
                return Err(TpError::Shape {
                    layer: "block".into(),
                    reason: "the block has neither an MLP nor an MoE layer".into(),
                });
            }
        };
        Ok(x + y)
    }
}

/// `n` blocks at `blocks.{i}` under `init`, each an FSDP unit when `fsdp` selects its path
/// (the plain block otherwise): the encoder or decoder stack of the GPT and the ViT.
///
/// # Errors
/// Plan errors; collective errors of the FSDP plan.
pub fn build_blocks(
    config: &BlockConfig,
    n: usize,
    init: &Init,
    fsdp: Option<&FsdpPlan>,
) -> ZeroResult<Vec<Fsdp<Block>>> {
    build_blocks_at(&|_| config.clone(), n, init, fsdp, &MoeParallel::default())
}

/// [`build_blocks`] with block `i` built from `config(i)` (dense or MoE), the MoE layers split
/// over the groups of `experts`.
///
/// # Errors
/// As [`build_blocks`]; MoE errors (see [`Block::build`]).
pub fn build_blocks_at(
    config: &dyn Fn(usize) -> BlockConfig,
    n: usize,
    init: &Init,
    fsdp: Option<&FsdpPlan>,
    experts: &MoeParallel,
) -> ZeroResult<Vec<Fsdp<Block>>> {
    (0..n)
        .map(|i| {
            let blocks = init.at("blocks");
            let config = config(i);
            unit(&blocks, &i.to_string(), fsdp, || {
                Ok(Block::build(&config, &blocks.at(i), experts)?)
            })
        })
        .collect()
}

/// The sub-module `name` of the model being built at `init`, built by `build`: an FSDP unit
/// when `fsdp` selects its path, the module itself otherwise.
///
/// # Errors
/// `build`'s; the FSDP plan's.
fn unit<M: Module>(
    init: &Init,
    name: &str,
    fsdp: Option<&FsdpPlan>,
    build: impl FnOnce() -> ZeroResult<M>,
) -> ZeroResult<Fsdp<M>> {
    match fsdp {
        Some(plan) => plan.wrap(&init.at(name), |_| build()),
        None => Ok(Fsdp::new(build()?)),
    }
}

/// `blocks` with every FSDP unit gathered whole, detached (a collective over the shard group
/// when sharded).
///
/// # Errors
/// Collective errors.
pub fn gather_blocks(blocks: &[Fsdp<Block>]) -> ZeroResult<Vec<Fsdp<Block>>> {
    blocks.iter().map(|b| Ok(Fsdp::new(b.full()?))).collect()
}

/// The embedding sub-layers of a GPT (token table, learned positions, dropout) under a
/// tensor-parallel context, borrowed from a [`Gpt`] or from the first stage of a pipeline
/// (`examples::pipeline::GptInput`), so that both embed tokens the same way.
#[derive(Clone, Copy, Debug)]
pub struct Embeddings<'a> {
    /// Token table (split by vocabulary under tensor parallelism).
    pub wte: &'a Embedding,
    /// Learned positions, when the model uses them.
    pub wpe: Option<&'a burn::nn::Embedding>,
    /// Embedding dropout.
    pub drop: Option<&'a SeededDropout>,
    /// The tensor-parallel context (sequence parallelism scatters the output).
    pub tp: &'a TpContext,
    /// The model's configuration.
    pub config: &'a GptConfig,
}

impl Embeddings<'_> {
    /// Token (+ learned position) embedding of `tokens` `[batch, seq]` whose first token sits
    /// at position `offset`: the residual stream `[batch, tokens, d_model]` (this rank's tokens
    /// under sequence parallelism, see `pass.tokens`).
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`]; [`TpError::Shape`] when `offset + seq` exceeds
    /// `max_seq_len` with learned positions; collective errors.
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        offset: usize,
        pass: &Pass,
    ) -> TpResult<Tensor<3>> {
        let [b, s] = tokens.dims();
        let x = self.tp.scatter_sequence(self.wte.forward(tokens)?)?;
        let (first, len) = pass.tokens;
        let x = match self.wpe {
            None => x,
            Some(wpe) => {
                let whole = pass.cp.as_ref().map_or(s, |cp| cp.layout.seq());
                if offset + whole > self.config.max_seq_len {
                    return Err(TpError::Shape {
                        layer: "wpe".into(),
                        reason: format!(
                            "a sequence of {whole} tokens at offset {offset} exceeds max_seq_len {}",
                            self.config.max_seq_len
                        ),
                    });
                }
                // Under sequence parallelism each rank adds its own rows: the table's gradient
                // is summed over the group.
                let table = match (self.tp.group(), self.tp.sequence_parallel()) {
                    (Some(group), true) => sp_param(wpe.weight.val(), group, true),
                    _ => wpe.weight.val(),
                };
                let rows = match &pass.cp {
                    None => table.narrow(0, offset + first, len),
                    Some(cp) => {
                        let positions: Vec<i64> = cp.layout.positions()[first..first + len]
                            .iter()
                            .map(|&p| (p + offset) as i64)
                            .collect();
                        let index = Tensor::<1, Int>::from_data(
                            TensorData::new(positions, [len]),
                            &table.device(),
                        );
                        table.select(0, index)
                    }
                };
                x + rows.unsqueeze::<3>()
            }
        };
        Ok(match self.drop {
            None => x,
            Some(drop) => {
                let d = self.config.d_model;
                let site = DropoutSite::new(&[b, s, d], &[0, first, 0]);
                drop.clone().with_stream(pass.stream).forward(x, &site)
            }
        })
    }
}

/// The GPT model: one type for one device and every layout. Build it with [`Gpt::new`] (one
/// device) or [`Gpt::build`] (any layout).
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding `[vocab_size, d_model]` (split by vocabulary under tensor parallelism),
    /// an FSDP unit under a sharded layout (as every sub-module below).
    pub wte: Fsdp<Embedding>,
    /// Learned position embedding `[max_seq_len, d_model]` (learned positions only).
    pub wpe: Option<Fsdp<burn::nn::Embedding>>,
    /// The transformer blocks, each an FSDP unit under a sharded layout.
    pub blocks: Vec<Fsdp<Block>>,
    /// Final norm.
    pub ln_f: Fsdp<Norm>,
    /// Output projection `[d_model, vocab_size]` (split by vocabulary under tensor
    /// parallelism); `None` when tied to `wte`.
    pub lm_head: Option<Fsdp<Linear>>,
    /// Dropout on the embeddings.
    #[module(skip)]
    pub drop: Option<SeededDropout>,
    /// The configuration the model was built from.
    #[module(skip)]
    pub config: GptConfig,
    /// The tensor-parallel context (single-device when not split).
    #[module(skip)]
    pub tp: TpContext,
    /// The data-parallel stream of the dropout masks ([`Self::with_dropout_stream`]).
    #[module(skip)]
    pub dropout_stream: u64,
    /// Context parallelism ([`Self::with_context_parallel`]): each sequence split over a group.
    #[module(skip)]
    pub cp: Option<ContextParallel>,
}

/// The GPT under any [`burn_parallel_train::Layout`]: its plans and its build are all the
/// builder needs ([`burn_parallel_train::build`]).
impl burn_parallel_train::ParallelModel for GptConfig {
    type Model = Gpt;
    type Batch = crate::data::Batch;

    fn loss(model: &Gpt, batch: &crate::data::Batch) -> Result<Tensor<1>, burn_parallel::Error> {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let (inputs, targets) = batch.to_tensors(&device);
        Ok(model.loss(inputs, targets)?)
    }

    fn dropout_layers(model: &Gpt) -> Vec<(String, SeededDropout)> {
        let mut out: Vec<_> = model
            .drop
            .iter()
            .map(|d| ("drop".into(), d.clone()))
            .collect();
        for (i, block) in model.blocks.iter().enumerate() {
            block
                .skeleton()
                .dropout_layers(&format!("blocks.{i}"), &mut out);
        }
        out
    }

    fn n_heads(&self) -> usize {
        self.n_heads
    }

    fn n_experts(&self) -> Option<usize> {
        self.moe.as_ref().map(|moe| moe.n_experts)
    }

    fn has_dropout(&self) -> bool {
        self.dropout > 0.0
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        Gpt::tp_plan(self, sequence_parallel)
    }

    fn fsdp_plan(&self, shard: &ProcessGroup, experts: &MoeParallel) -> FsdpPlan {
        Gpt::fsdp_plan(shard, experts)
    }

    fn build(&self, parts: &burn_parallel_train::ModelParts) -> Result<Gpt, burn_parallel::Error> {
        let model =
            Gpt::build_with_experts(self, &parts.init, parts.fsdp.as_ref(), &parts.experts)?
                .with_dropout_stream(parts.data_rank as u64);
        Ok(match &parts.context_parallel {
            Some(cp) => model.with_context_parallel(cp.clone())?,
            None => model,
        })
    }
}

impl Gpt {
    /// Builds and initialises the model on one device, deterministically from `config.seed`.
    /// Build it directly on `device.autodiff()` to train it.
    ///
    /// # Panics
    ///
    /// If [`GptConfig::validate`] fails.
    pub fn new(config: &GptConfig, device: &Device) -> Self {
        if let Err(e) = config.validate() {
            panic!("invalid GptConfig: {e}");
        }
        Self::build(config, &Init::new(config.seed, device), None)
            .unwrap_or_else(|e| panic!("a single-device GPT always builds: {e}"))
    }

    /// The tensor-parallel plan of the GPT (Megatron's split): vocabulary-parallel `wte` and
    /// `lm_head`, colwise `q`, `k`, `v`, `up`, `gate`, rowwise `o` and `down`, every norm a
    /// sequence-parallel norm.
    ///
    /// ```
    /// use examples::gpt::{Gpt, GptConfig};
    ///
    /// let plan = Gpt::tp_plan(&GptConfig::default(), true);
    /// assert!(plan.sequence_parallel);
    /// ```
    pub fn tp_plan(config: &GptConfig, sequence_parallel: bool) -> TpPlan {
        let head = if config.tied_embeddings {
            "wte"
        } else {
            "{wte,lm_head}"
        };
        let plan = TpPlan::new()
            .vocab(head)
            .colwise("blocks.*.attn.{q,k,v}")
            .rowwise("blocks.*.attn.o");
        // A GPT-MoE whose every block is an MoE block has no MLP (and a plan's rule must match
        // a layer).
        let dense = (0..config.n_layers).any(|i| !config.is_moe_block(i));
        let plan = match dense {
            true => plan
                .colwise("blocks.*.mlp.{up,gate}")
                .rowwise("blocks.*.mlp.down"),
            false => plan,
        };
        plan.sequence_norm("{blocks.*.ln_1,blocks.*.ln_2,ln_f}")
            .with_sequence_parallel(sequence_parallel)
    }

    /// The FSDP plan of the GPT over `group`: every block is a unit (torchtitan's
    /// `apply_fsdp`); embeddings, final norm and head stay replicated over the data-parallel
    /// ranks. In a GPT-MoE built with `experts`, the expert parameters stay whole
    /// ([`FsdpPlan::keep_whole`]) and [`burn_moe::MoeStep`] reduces their gradients over the
    /// ranks holding the same experts: under expert parallelism each rank holds other experts
    /// than its expert-parallel peers, and with or without it an expert that no token chose in
    /// a step must get no gradient (and no AdamW update), as on one device, where a flat shard
    /// would give it a zero gradient. For a dense GPT (`MoeParallel::default()`) every
    /// parameter of a block is sharded.
    ///
    /// # Arguments
    /// * `group` - the shard group (`dp_shard`, or `dp_shard x cp`).
    /// * `experts` - the groups the MoE layers are built with.
    ///
    /// # Returns
    /// The plan, for [`Self::build_with_experts`].
    ///
    /// # Example
    /// ```
    /// use burn::module::Module;
    /// use burn::tensor::Device;
    /// use burn_moe::{MoeConfig, MoeParallel};
    /// use burn_parallel::init::Init;
    /// use burn_parallel::{ParallelDims, run_local};
    /// use examples::gpt::{Gpt, GptConfig};
    ///
    /// let base = GptConfig { d_ff: 32, ..GptConfig::new(256, 1, 2, 8, 16) };
    /// let config = GptConfig { moe: Some(MoeConfig::new(8, 16, 4, 2)), ..base };
    /// run_local(2, |world| {
    ///     let dims = ParallelDims { dp_shard: 2, ep: 2, ..ParallelDims::default() };
    ///     let mesh = dims.build(&world).unwrap();
    ///     let experts = MoeParallel::from_mesh(&dims, &mesh).unwrap();
    ///     let plan = Gpt::fsdp_plan(mesh.group("dp_shard").unwrap(), &experts);
    ///     let init = Init::new(config.seed, &Device::flex().autodiff());
    ///     let model = Gpt::build_with_experts(&config, &init, Some(&plan), &experts).unwrap();
    ///     assert!(model.blocks[0].is_sharded());
    ///     // The embeddings, the final norm and the head are units too.
    ///     assert!(model.wte.is_sharded() && model.wpe.as_ref().unwrap().is_sharded());
    ///     assert!(model.ln_f.is_sharded() && model.lm_head.as_ref().unwrap().is_sharded());
    ///     // This rank's 2 experts are whole; the rest of the block is a flat shard.
    ///     let mut held = 0;
    ///     model.for_each_moe(&mut |_, moe| held += moe.experts.len()).unwrap();
    ///     assert_eq!(held, 2);
    ///     assert_eq!(experts.experts.len(), 2 * 2); // up and down weights of each
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn fsdp_plan(group: &ProcessGroup, experts: &MoeParallel) -> FsdpPlan {
        let experts = experts.experts.clone();
        // Every block a unit, and each of the other sub-modules (torchtitan also shards the
        // embeddings and the head): no parameter stays whole on every rank.
        FsdpPlan::new(group)
            .unit("blocks.*")
            .unit_if(|path| matches!(path, "wte" | "wpe" | "ln_f" | "lm_head"))
            .keep_whole(move |id| experts.contains(&id))
    }

    /// Builds the model for any layout: `init` carries the seed, the device and the
    /// tensor-parallel plan (`Init::new(seed, device).with_tp(group, Gpt::tp_plan(..))`), and
    /// `fsdp` makes each block an FSDP unit whose parameters this rank holds a slice of. A rank
    /// never builds more than one whole block.
    ///
    /// # Errors
    /// [`ZeroError::Config`] for an invalid configuration; [`ZeroError::Tp`] when the plan
    /// cannot split the model (heads not divisible by the tensor-parallel size, a rule naming
    /// no layer); collective errors of the FSDP plan.
    pub fn build(config: &GptConfig, init: &Init, fsdp: Option<&FsdpPlan>) -> ZeroResult<Self> {
        Self::build_with_experts(config, init, fsdp, &MoeParallel::default())
    }

    /// [`Self::build`] with the MoE layers of a GPT-MoE split over the groups of `experts`
    /// (expert parallelism: each rank of `experts.ep` builds `n_experts / ep` experts of each
    /// MoE layer, and the expert parameters are recorded in `experts.experts` for
    /// [`burn_moe::MoeStep`]).
    ///
    /// # Errors
    /// As [`Self::build`]; MoE errors (experts not divisible by the expert-parallel size, ranks
    /// that disagree on the settings) as [`ZeroError::Tp`].
    ///
    /// # Example
    /// ```
    /// use burn::tensor::Device;
    /// use burn_moe::{MoeConfig, MoeParallel};
    /// use burn_parallel::init::Init;
    /// use burn_parallel::{ParallelDims, run_local};
    /// use examples::gpt::{Gpt, GptConfig};
    ///
    /// let base = GptConfig { d_ff: 32, ..GptConfig::new(256, 2, 2, 8, 16) };
    /// let config = GptConfig { moe: Some(MoeConfig::new(8, 16, 4, 2)), ..base };
    /// run_local(2, |world| {
    ///     let dims = ParallelDims { dp_replicate: 2, ep: 2, ..ParallelDims::default() };
    ///     let mesh = dims.build(&world).unwrap();
    ///     let experts = MoeParallel::from_mesh(&dims, &mesh).unwrap();
    ///     let init = Init::new(config.seed, &Device::flex());
    ///     let model = Gpt::build_with_experts(&config, &init, None, &experts).unwrap();
    ///     let mut held = 0;
    ///     model.for_each_moe(&mut |_, moe| held += moe.experts.len()).unwrap();
    ///     assert_eq!(held, 2 * 2); // 2 of the 4 experts of each of the 2 MoE blocks
    ///     // Gathered whole: every expert, the single-device parameter count.
    ///     let whole = model.to_single(&Device::flex()).unwrap();
    ///     assert_eq!(whole.num_params(), config.num_params());
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn build_with_experts(
        config: &GptConfig,
        init: &Init,
        fsdp: Option<&FsdpPlan>,
        experts: &MoeParallel,
    ) -> ZeroResult<Self> {
        config
            .validate()
            .map_err(|e| ZeroError::Config(format!("invalid GptConfig: {e}")))?;
        let (d, v) = (config.d_model, config.vocab_size);
        let blocks = build_blocks_at(
            &|i| config.block_at(i),
            config.n_layers,
            init,
            fsdp,
            experts,
        )?;
        let model = Self {
            wte: unit(init, "wte", fsdp, || {
                Ok(init.embedding("wte", v, d, INIT_STD)?)
            })?,
            wpe: match config.positions {
                PositionKind::Learned => Some(unit(init, "wpe", fsdp, || {
                    Ok(burn::nn::Embedding {
                        weight: init
                            .at("wpe")
                            .normal("weight", [config.max_seq_len, d], INIT_STD),
                    })
                })?),
                PositionKind::Rotary => None,
            },
            blocks,
            ln_f: unit(init, "ln_f", fsdp, || {
                Ok(Norm::new(config.norm, d, config.norm_eps, &init.at("ln_f")))
            })?,
            lm_head: match config.tied_embeddings {
                true => None,
                false => Some(unit(init, "lm_head", fsdp, || {
                    Ok(init.linear(
                        "lm_head",
                        LinearInit::new(d, v)
                            .with_bias(config.bias)
                            .with_std(INIT_STD),
                    )?)
                })?),
            },
            drop: dropout(config.dropout, init, "drop"),
            config: config.clone(),
            tp: init.context(),
            dropout_stream: 0,
            cp: None,
        };
        init.finish()?;
        if let Some(plan) = fsdp {
            plan.finish()?;
        }
        Ok(model)
    }

    /// Separates the dropout masks of data-parallel replicas (use the data-parallel rank); a
    /// no-op without dropout.
    pub fn with_dropout_stream(self, stream: u64) -> Self {
        Self {
            dropout_stream: stream,
            ..self
        }
    }

    /// Splits every sequence over the context-parallel group `cp` (ring or Ulysses attention,
    /// per its settings): [`Self::forward`] and [`Self::loss`] then take the whole sequence,
    /// keep this rank's tokens ([`SeqLayout::local`]), embed them at their global positions
    /// (rotary tables or learned rows), attend through `cp`, and return this rank's logits, or
    /// the mean loss over its tokens. Averaging that loss's gradients over the context-parallel
    /// ranks (with the data ranks: [`burn_parallel::ParallelDims::gradient_reduction`]) gives
    /// the single-device gradients.
    ///
    /// # Errors
    /// [`ZeroError::Config`] for a dropout probability above 0 (its masks are keyed by
    /// contiguous positions; not supported with context parallelism).
    pub fn with_context_parallel(self, cp: ContextParallel) -> ZeroResult<Self> {
        if self.config.dropout > 0.0 {
            return Err(ZeroError::Config(format!(
                "dropout {} is not supported with context parallelism; set it to 0",
                self.config.dropout
            )));
        }
        Ok(Self {
            cp: Some(cp),
            ..self
        })
    }

    /// This rank's tokens of `tokens` `[batch, seq]` under context parallelism (all of them
    /// otherwise), and the layout of the sequence.
    ///
    /// # Errors
    /// [`TpError::Shape`] when the sequence does not split over the group.
    pub fn local_tokens(
        &self,
        tokens: Tensor<2, Int>,
    ) -> TpResult<(Tensor<2, Int>, Option<SeqLayout>)> {
        match &self.cp {
            None => Ok((tokens, None)),
            Some(cp) => {
                let layout = cp.layout(tokens.dims()[1])?;
                Ok((layout.local(tokens, 1)?, Some(layout)))
            }
        }
    }

    /// Number of float parameters this rank holds ([`Module::num_params`]); the whole model's
    /// count ([`GptConfig::num_params`]) on one device.
    pub fn num_params(&self) -> usize {
        Module::num_params(self)
    }

    /// Rotary tables for `seq_len` positions starting at `offset`, or `None` for learned
    /// positions.
    pub fn rope(&self, seq_len: usize, offset: usize, device: &Device) -> Option<Rope> {
        self.config.rope(seq_len, offset, device)
    }

    /// The pass over `tokens` `[batch, seq]` whose first token sits at position `offset`.
    pub fn pass(&self, tokens: &Tensor<2, Int>, offset: usize) -> Pass {
        let [_, s] = tokens.dims();
        Pass {
            stream: self.dropout_stream,
            ..Pass::new(s, self.rope(s, offset, &tokens.device()), &self.tp)
        }
    }

    /// The pass over this rank's tokens `tokens` `[batch, local_seq]` of a sequence split by
    /// `layout` over the context-parallel group (the sequence's first token at `offset`):
    /// rotary tables at the tokens' global positions.
    fn cp_pass(&self, tokens: &Tensor<2, Int>, offset: usize, layout: SeqLayout) -> Pass {
        let [_, s] = tokens.dims();
        let rope = match self.config.positions {
            PositionKind::Rotary => {
                let positions: Vec<usize> = layout.positions().iter().map(|p| p + offset).collect();
                Some(
                    Rope::at_positions(
                        self.config.head_dim(),
                        &positions,
                        self.config.rope_theta,
                        &tokens.device(),
                    )
                    .with_fused(self.config.fused),
                )
            }
            PositionKind::Learned => None,
        };
        let ctx = self.cp.clone().expect("a layout comes from the context");
        Pass {
            stream: self.dropout_stream,
            cp: Some(CpPass { ctx, layout }),
            ..Pass::new(s, rope, &self.tp)
        }
    }

    /// Token (+ learned position) embedding of `tokens` `[batch, seq]` whose first token sits
    /// at position `offset`: the residual stream `[batch, tokens, d_model]` (this rank's tokens
    /// under sequence parallelism, see `pass.tokens`).
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`]; [`TpError::Shape`] when `offset + seq` exceeds
    /// `max_seq_len` with learned positions; collective errors.
    pub fn embed(&self, tokens: Tensor<2, Int>, offset: usize, pass: &Pass) -> TpResult<Tensor<3>> {
        let wte = self.wte.get()?;
        let wpe = self.wpe.as_ref().map(Fsdp::get).transpose()?;
        Embeddings {
            wte: &wte,
            wpe: wpe.as_deref(),
            drop: self.drop.as_ref(),
            tp: &self.tp,
            config: &self.config,
        }
        .forward(tokens, offset, pass)
    }

    /// Final norm and output projection: `[batch, tokens, d_model] -> [batch, seq, vocab]`
    /// (this rank's vocabulary shard under tensor parallelism).
    ///
    /// # Errors
    /// Collective errors.
    pub fn head(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        let ln_f = self.ln_f.get()?;
        let x = if self.config.fused {
            ln_f.forward_fused(x)
        } else {
            ln_f.forward(x)
        };
        drop(ln_f);
        match &self.lm_head {
            Some(lm_head) => lm_head.get()?.forward(x),
            // Tied: the token table's unit gathered a second time.
            None => self.wte.get()?.attend(x, &self.tp),
        }
    }

    /// Mean cross-entropy (fp32) of the logits from [`Self::head`] against `targets`
    /// `[batch, seq]`: vocabulary-parallel when the head is split, through the fused kernel
    /// when `config.fused` and it is not. Low-precision logits are cast up first, as autocast
    /// does.
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`]; collective errors.
    pub fn head_loss(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        // The split, not the weights: the units' skeletons say it without a gather.
        let output = match &self.lm_head {
            Some(head) => OutputLayer::Head(head.skeleton()),
            None => OutputLayer::Tied(self.wte.skeleton()),
        };
        output.loss(self.config.fused, logits, targets)
    }

    /// Logits `[batch, seq, vocab]` of `tokens` `[batch, seq]`, the first token at position
    /// `offset` (0 for a whole sequence); this rank's vocabulary shard under tensor parallelism,
    /// this rank's tokens (`[batch, seq / cp, vocab]`, local order) under context parallelism.
    ///
    /// # Errors
    /// As [`Self::embed`]; collective errors (an FSDP unit's gather).
    pub fn forward_with_offset(
        &self,
        tokens: Tensor<2, Int>,
        offset: usize,
    ) -> TpResult<Tensor<3>> {
        let (tokens, layout) = self.local_tokens(tokens)?;
        let pass = match layout {
            None => self.pass(&tokens, offset),
            Some(layout) => self.cp_pass(&tokens, offset, layout),
        };
        let mut x = self.embed(tokens, offset, &pass)?;
        for (i, block) in self.blocks.iter().enumerate() {
            let block = block.get()?; // all-gathers an FSDP unit (or takes its prefetch)
            if let Some(next) = self.blocks.get(i + 1) {
                next.prefetch()?; // with FsdpPlan::with_prefetch: travels while `block` computes
            }
            x = block.forward(x, &pass)?;
        }
        self.head(x)
    }

    /// Logits `[batch, seq, vocab]` of `tokens` `[batch, seq]`.
    ///
    /// # Errors
    /// As [`Self::forward_with_offset`].
    pub fn forward(&self, tokens: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        self.forward_with_offset(tokens, 0)
    }

    /// Mean next-token cross-entropy (nats) of `tokens` `[batch, seq]` against `targets`
    /// `[batch, seq]`; a one-element fp32 tensor, the same on every rank of a tensor-parallel
    /// group. Under context parallelism, the mean over this rank's tokens (average it over the
    /// context-parallel group for the whole sequence's).
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        let logits = self.forward(tokens)?;
        let (targets, _) = self.local_tokens(targets)?;
        self.head_loss(logits, targets)
    }

    /// The same model with every FSDP unit gathered whole, every tensor-parallel shard
    /// gathered and, in a GPT-MoE, every expert gathered from the expert-parallel ranks (with
    /// the expert biases of bias balancing), as a single-device GPT on `device` (a collective
    /// over the layout's groups).
    ///
    /// # Errors
    /// Collective errors.
    pub fn to_single(&self, device: &Device) -> ZeroResult<Gpt> {
        // Every FSDP unit gathered whole (a collective over its shard group when sharded).
        fn whole<M: Module>(unit: &Fsdp<M>) -> ZeroResult<Fsdp<M>> {
            Ok(Fsdp::new(unit.full()?))
        }
        let whole = Gpt {
            wte: whole(&self.wte)?,
            wpe: self.wpe.as_ref().map(whole).transpose()?,
            blocks: gather_blocks(&self.blocks)?,
            ln_f: whole(&self.ln_f)?,
            lm_head: self.lm_head.as_ref().map(whole).transpose()?,
            ..self.clone()
        };
        let mut params: std::collections::HashMap<String, TensorData> =
            self.tp.full_params(&whole)?.into_iter().collect();
        // Experts: local index -> global index, then every expert from the expert-parallel
        // group.
        let mut local = Vec::new();
        let mut ep_group = None;
        self.for_each_moe(&mut |i, moe| {
            let prefix = format!("blocks.{i}.moe.experts.");
            let keys: Vec<String> = params
                .keys()
                .filter(|k| k.starts_with(&prefix))
                .cloned()
                .collect();
            for key in keys {
                let data = params.remove(&key).expect("a listed key");
                let rest = &key[prefix.len()..];
                let (j, tail) = rest.split_once('.').unwrap_or((rest, ""));
                let j: usize = j.parse().expect("an expert index");
                let path = format!("{prefix}{}.{tail}", j + moe.first_expert);
                let shape = data.shape().as_slice().to_vec();
                let values = data
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .expect("f32 values");
                local.push((path, shape, values));
            }
            if ep_group.is_none() {
                ep_group = moe.parallel.ep.clone();
            }
        })?;
        let gathered = match &ep_group {
            Some(ep) => ep
                .all_gather_object(&local)?
                .into_iter()
                .flatten()
                .collect(),
            None => local,
        };
        for (path, shape, values) in gathered {
            params.insert(path, TensorData::new(values, shape));
        }
        let single = burn_parallel_train::load_named(Gpt::new(&self.config, device), &params);
        // The biases of auxiliary-loss-free balancing take part in routing.
        let mut biases = Vec::new();
        self.for_each_moe(&mut |_, moe| biases.push(moe.expert_bias()))?;
        let mut biases = biases.into_iter();
        single.for_each_moe(&mut |_, moe| {
            if let Some(bias) = biases.next() {
                moe.set_expert_bias(&bias)
                    .expect("the same configuration, the same number of experts");
            }
        })?;
        Ok(single)
    }

    /// Calls `f(block index, layer)` for each MoE layer, in block order, without a collective:
    /// in a sharded FSDP unit the layer is that of the unit's skeleton ([`Fsdp::skeleton`]):
    /// its configuration, routing state and expert biases are there, and its experts when
    /// they are kept whole (expert parallelism, [`Self::fsdp_plan`]), but its other parameters
    /// (the router) are placeholders.
    ///
    /// # Errors
    /// None today (kept for callers that propagate collective errors).
    pub fn for_each_moe(
        &self,
        f: &mut dyn FnMut(usize, &MoeLayer),
    ) -> Result<(), burn_parallel::CollectiveError> {
        for (i, block) in self.blocks.iter().enumerate() {
            if !self.config.is_moe_block(i) {
                continue;
            }
            if let Some(moe) = &block.skeleton().moe {
                f(i, moe);
            }
        }
        Ok(())
    }

    /// The routing figures of each MoE layer's last forward call (empty for a dense GPT).
    pub fn moe_stats(&self) -> Vec<MoeStats> {
        let mut stats = Vec::new();
        let _ = self.for_each_moe(&mut |_, moe| stats.extend(moe.last_stats()));
        stats
    }
}

/// Mean cross-entropy of `logits` `[n, classes]` against class ids `targets` `[n]`, computed
/// exactly as `-mean(gather(log_softmax(logits), targets))`.
///
/// # Returns
///
/// A one-element tensor (nats).
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n] = targets.dims();
    let log_probs = log_softmax(logits, 1);
    log_probs.gather(1, targets.reshape([n, 1])).mean().neg()
}

/// The layer that gives the GPT its logits: the output head, or the token embedding tied to
/// it. Its shape or split (only the skeleton of an FSDP unit is needed) chooses the loss.
#[derive(Debug, Clone, Copy)]
pub enum OutputLayer<'a> {
    /// An untied head (`lm_head`).
    Head(&'a Linear),
    /// The token embedding (tied weights).
    Tied(&'a Embedding),
}

impl OutputLayer<'_> {
    /// Mean cross-entropy of `logits` `[batch, seq, vocab]` (from this layer) against `targets`
    /// `[batch, seq]`: through the fused kernel ([`burn_parallel::kernels::cross_entropy`],
    /// which keeps no `tokens x vocab` probabilities for backward) when `fused` and the
    /// vocabulary is whole on this rank, else the layer's own (vocabulary-parallel when it is
    /// split). The one loss of the GPT and of its pipeline's last stage.
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`] (split or composed) or [`TpError::Kernel`] (fused) for a
    /// target outside the vocabulary; collective errors.
    pub fn loss(
        self,
        fused: bool,
        logits: Tensor<3>,
        targets: Tensor<2, Int>,
    ) -> TpResult<Tensor<1>> {
        // Mixed precision: the softmax and the loss in f32 (the logits of a compute copy are in
        // its dtype; a bf16 loss would keep 8 bits of it).
        let logits = if logits.dtype() == DType::F32 {
            logits
        } else {
            logits.cast(DType::F32)
        };
        let split = match self {
            OutputLayer::Head(head) => !matches!(head.split, LinearSplit::Replicated),
            OutputLayer::Tied(wte) => wte.split.is_some(),
        };
        if fused && !split {
            let [b, s, v] = logits.dims();
            let (logits, targets) = (logits.reshape([b * s, v]), targets.reshape([b * s]));
            return Ok(kernels::cross_entropy(logits, targets, None)?);
        }
        match self {
            OutputLayer::Head(head) => head.cross_entropy(logits, targets),
            OutputLayer::Tied(wte) => wte.cross_entropy(logits, targets),
        }
    }
}
