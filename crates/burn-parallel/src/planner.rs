//! Memory and FLOPs planner: which layouts of a transformer fit a device's memory, and how fast
//! each is predicted to train.
//!
//! Give it the model ([`ModelShape`], built from numbers, with [`count_params`] to check it
//! against a Burn module), the job ([`Training`]) and the device ([`Hardware`]); [`plan`] walks
//! every layout `pp x dp_replicate x dp_shard x cp x tp` of the world (with the ZeRO stage,
//! sequence parallelism, expert parallelism, the pipeline schedule and activation
//! checkpointing) and returns a [`Plan`]: the layouts that fit, fastest first, and for every
//! other one the reason ([`Rejection`]).
//!
//! # The model of memory (per rank, the worst pipeline stage)
//!
//! - **Model state**, with `P` the parameters the rank holds (its stage, `1/tp` of the split
//!   layers, `1/ep` of the experts): parameters, gradients and optimizer state take 2 + 2 + 12
//!   bytes per parameter in mixed precision (16-bit weights and gradients, fp32 master weights
//!   and the optimizer's state: [`Training::optimizer_bytes`], 8 for Adam) and 4 + 4 + 8 in
//!   fp32. ZeRO over the `dp_shard x cp` ranks divides the optimizer state (stage 1), the
//!   gradients too (stage 2) and the parameters too (stage 3).
//! - **Activations**, two models ([`activation`]). Mixed precision: the Korthikanti et al.
//!   formulas (16-bit, masks when [`Training::dropout`], the `5 a s / h` scores unless
//!   [`Attention::Flash`]), plus the fp32 logits and softmax of the loss on the last stage.
//!   fp32 ([`Training::mixed_precision`] `false`): what this implementation keeps, derived
//!   tensor by tensor from what each op of the block hands Burn's autodiff
//!   ([`activation::fp32_layer_bytes`]: the norms keep their inputs (fused) or centred and
//!   normalised inputs (composed), the column-parallel matmuls their whole input, flash
//!   attention copies of `Q`, `K`, `V`, its output and a log-sum-exp, materialised attention
//!   three `b a s^2` fp32 tensors), plus the output layer, the logits and the token ids. Both
//!   are multiplied by the micro-batches the schedule keeps in flight on the stage (GPipe: all
//!   `m`; 1F1B and ZB-H1: `p - stage`; interleaved with `v` chunks: that times
//!   `1 + (p - 1) / (p v)`; ZB-V: `p`); with recomputation per block, the inputs of the blocks
//!   plus one block's activations; per stage, the stage's inputs plus one stage's activations.
//! - **Communication buffers**: two gradient buckets (DDP, ZeRO-1/2), or the largest gathered
//!   unit and its gradient (ZeRO-3); a gathered activation (tp); the ring's key/value blocks
//!   (cp); the send and receive boundary activations (pp); the all-to-all buffers (ep).
//!
//! # Where this implementation differs from the textbook (the fp32 model)
//!
//! Checked against the measured per-rank peak of the GPT trainer with a counting allocator
//! (`cargo run -p examples --example planner_check`, 12 layouts, within ±10%):
//! - **The peak is phased** ([`Memory::phased`]): Burn's engines run the whole backward,
//!   then reduce and step, so the gradients and buckets exist only after the activations are
//!   gone. The peak is at the start of the backward: parameters, optimizer state, every
//!   activation and the logits' gradient ([`Memory::transient`]).
//! - **FSDP keeps its gathered units**: autodiff keeps the gathered parameters each unit's
//!   matmuls saved until that unit's backward, so at the peak a ZeRO-3 rank holds its shards
//!   *and* the whole stage's parameters ([`Memory::gathered`]); ZeRO-3 saves optimizer
//!   state, not parameter memory at the peak.
//! - **Sequence parallelism keeps the gathered inputs**: each column-parallel projection
//!   all-gathers its input itself and keeps the whole-sequence copy, so sp saves only the
//!   norms' share and, at tp 2, keeps more than tp alone.
//!
//! The mixed-precision model keeps the paper's accounting (everything summed, no gathered
//! units), as a plan for a GPU run of a framework that frees as Megatron does.
//! # The model of time
//!
//! FLOPs per step are `6 N` per token (`N` the active parameters) plus `12 s h` per token and
//! layer for the attention matrix, plus one more forward with recomputation. A rank's compute
//! time is its stage's FLOPs over [`Hardware::flops_per_s`]; communication volumes (ring
//! all-reduce `2 (n - 1) / n` of the buffer, all-gather and reduce-scatter `(n - 1) / n`, tensor
//! parallelism's four collectives per layer, the ring's `3 (cp - 1)` key/value blocks per
//! layer, pipeline sends, expert all-to-alls) go over [`Hardware::link_bytes_per_s`] and are
//! not overlapped with compute, so the prediction leans pessimistic for data parallelism. The
//! pipeline adds its bubble: `(p - 1)` micro-batch times for GPipe and 1F1B, `(p - 1) / v` for
//! interleaved, a third of that for ZB-H1 and none for ZB-V (with equal forward, input-grad and
//! weight-grad times).
//!
//! # Example
//! ```
//! use burn_parallel::planner::{Hardware, ModelShape, Training, plan};
//!
//! // A 12-layer GPT-2 small on 8 devices of 16 GiB.
//! let shape = ModelShape::gpt(12, 768, 12, 50304, 1024);
//! let training = Training::new(8, 64, 1024);
//! let hw = Hardware::from_units(16.0, 100.0, 25.0);
//! let plan = plan(&shape, &training, &hw).unwrap();
//! let best = plan.best().expect("something fits");
//! assert!(best.memory.total() <= hw.memory_bytes as f64);
//! println!("{} predicted {:.3} s/step", best.layout, best.step_seconds);
//! ```

pub mod activation;
mod predict;
mod search;

use std::fmt;

use burn::module::Module;
use serde::Serialize;

use crate::mesh::ParallelDims;
pub use search::{evaluate, plan};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// An input the planner cannot work with. Each variant names the field and what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The model shape is inconsistent.
    #[error("model shape: {field} {reason}")]
    Shape {
        /// The field at fault.
        field: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The training setup is inconsistent.
    #[error("training: {field} {reason}")]
    Training {
        /// The field at fault.
        field: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The hardware figures are unusable.
    #[error("hardware: {field} {reason}")]
    Hardware {
        /// The field at fault.
        field: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
}

/// The largest world the planner lays out: 2^20 devices, beyond any job of today.
pub const MAX_WORLD: usize = 1 << 20;
/// The most layers the planner models (its prediction walks them).
pub const MAX_LAYERS: usize = 1 << 16;
/// The widest `d_model` or MLP the planner models.
pub const MAX_WIDTH: usize = 1 << 20;
/// The largest vocabulary the planner models.
pub const MAX_VOCAB: usize = 1 << 24;
/// The longest sequence (and position table) the planner models.
pub const MAX_TOKENS: usize = 1 << 26;
/// The most experts per MoE layer the planner models.
pub const MAX_EXPERTS: usize = 1 << 12;

/// Normalisation layers of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum NormShape {
    /// LayerNorm: weight and bias.
    LayerNorm,
    /// RMSNorm: weight only.
    RmsNorm,
}

impl NormShape {
    fn params(self, d: usize) -> usize {
        match self {
            NormShape::LayerNorm => 2 * d,
            NormShape::RmsNorm => d,
        }
    }
}

/// The mixture-of-experts layers of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MoeShape {
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts each token uses.
    pub top_k: usize,
    /// Hidden width of each expert.
    pub d_ff: usize,
    /// Shared experts (one MLP of width `shared x d_ff` every token uses; 0: none).
    pub shared: usize,
    /// Gated (SwiGLU) experts.
    pub gated: bool,
    /// Biases in the experts.
    pub bias: bool,
    /// Blocks `every - 1`, `2 every - 1`, ... are MoE blocks (1: all of them).
    pub every: usize,
}

/// The shape of a decoder transformer (GPT, LLaMA, MoE variants): everything the planner
/// needs, as numbers. Fields are public; [`ModelShape::gpt`] gives GPT-2 defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream (`h`).
    pub d_model: usize,
    /// Attention heads (`a`).
    pub heads: usize,
    /// Key/value heads (grouped-query attention; `heads` for multi-head attention).
    pub kv_heads: usize,
    /// Hidden width of the dense MLP.
    pub d_ff: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Rows of a learned position table (0 for rotary positions).
    pub position_table: usize,
    /// Gated MLP (SwiGLU: two input projections).
    pub gated_mlp: bool,
    /// Biases in the linear layers.
    pub bias: bool,
    /// The norms.
    pub norm: NormShape,
    /// The output projection is the token embedding.
    pub tied_embeddings: bool,
    /// Mixture-of-experts layers, if any.
    pub moe: Option<MoeShape>,
    /// The exact parameter count, when measured from a module ([`count_params`]): the
    /// per-rank figures are scaled by `measured / formula`. `None`: the formula's count.
    pub measured_params: Option<usize>,
}

/// Parameters of one block, by how the layouts split them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct LayerParams {
    /// Split by tensor parallelism (weights and column-parallel biases).
    tp_split: f64,
    /// Replicated over tensor-parallel ranks (norms, row-parallel biases, router, shared
    /// experts).
    replicated: f64,
    /// Routed experts (split by expert parallelism).
    experts: f64,
    /// Weights one token uses (for FLOPs).
    active: f64,
}

impl ModelShape {
    /// A GPT-2 style shape: GELU MLP of width `4 d_model`, learned positions for `seq` tokens,
    /// LayerNorm, biases, untied embeddings, multi-head attention, no experts.
    ///
    /// # Arguments
    /// `layers`, `d_model`, `heads`, `vocab`; `seq`: the position table's rows.
    ///
    /// # Returns
    /// The shape (check it with [`ModelShape::validate`], which [`plan`] does).
    pub fn gpt(layers: usize, d_model: usize, heads: usize, vocab: usize, seq: usize) -> Self {
        Self {
            layers,
            d_model,
            heads,
            kv_heads: heads,
            d_ff: 4 * d_model,
            vocab,
            position_table: seq,
            gated_mlp: false,
            bias: true,
            norm: NormShape::LayerNorm,
            tied_embeddings: false,
            moe: None,
            measured_params: None,
        }
    }

    /// Checks the sizes.
    ///
    /// # Errors
    /// [`PlanError::Shape`] for a zero size, heads that do not divide `d_model`, key/value
    /// heads that do not divide the heads, or an MoE with `top_k` outside `1..=experts`.
    pub fn validate(&self) -> Result<(), PlanError> {
        let err = |field, reason: String| Err(PlanError::Shape { field, reason });
        for (field, v) in [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("d_ff", self.d_ff),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return err(field, "is 0; give a positive size".into());
            }
        }
        // Bounds beyond any model of today, under which no size product of the prediction
        // overflows (a 2^20 width, 2^12 experts of it, a 2^24 vocabulary, 2^16 layers).
        for (field, v, max) in [
            ("layers", self.layers, MAX_LAYERS),
            ("d_model", self.d_model, MAX_WIDTH),
            ("d_ff", self.d_ff, MAX_WIDTH),
            ("vocab", self.vocab, MAX_VOCAB),
            ("position_table", self.position_table, MAX_TOKENS),
        ] {
            if v > max {
                return err(field, format!("{v} is beyond the planner's {max}"));
            }
        }
        if !self.d_model.is_multiple_of(self.heads) {
            return err(
                "heads",
                format!("{} do not divide d_model {}", self.heads, self.d_model),
            );
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return err(
                "kv_heads",
                format!("{} do not divide the {} heads", self.kv_heads, self.heads),
            );
        }
        if let Some(m) = &self.moe {
            if m.experts == 0 || m.d_ff == 0 || m.every == 0 {
                return err("moe", "experts, d_ff and every must be positive".into());
            }
            for (field, v, max) in [
                ("moe.experts", m.experts, MAX_EXPERTS),
                ("moe.d_ff", m.d_ff, MAX_WIDTH),
                ("moe.shared", m.shared, MAX_EXPERTS),
            ] {
                if v > max {
                    return err(field, format!("{v} is beyond the planner's {max}"));
                }
            }
            if m.top_k == 0 || m.top_k > m.experts {
                return err(
                    "moe.top_k",
                    format!("{} must lie in 1..={} (the experts)", m.top_k, m.experts),
                );
            }
        }
        Ok(())
    }

    /// Whether block `i` is a mixture-of-experts block.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| (i + 1).is_multiple_of(m.every.max(1)))
    }

    fn mlp_params(&self, gated: bool, bias: bool, f: usize) -> usize {
        let (d, b) = (self.d_model, usize::from(bias));
        let inputs = if gated { 2 } else { 1 };
        inputs * (d * f + b * f) + f * d + b * d
    }

    fn layer(&self, moe: bool) -> LayerParams {
        let (d, b) = (self.d_model, usize::from(self.bias));
        let kv = self.kv_heads * (d / self.heads);
        // q and o are d x d, k and v d x kv; the output projection's bias is replicated.
        let attn_weights = 2 * d * d + 2 * d * kv;
        let attn_split = attn_weights + b * (d + 2 * kv);
        let norms = 2 * self.norm.params(d);
        let mut p = LayerParams {
            tp_split: attn_split as f64,
            replicated: (b * d + norms) as f64,
            experts: 0.0,
            active: attn_weights as f64,
        };
        match (&self.moe, moe) {
            (Some(m), true) => {
                let expert = self.mlp_params(m.gated, m.bias, m.d_ff);
                let shared = if m.shared > 0 {
                    self.mlp_params(m.gated, m.bias, m.shared * m.d_ff)
                } else {
                    0
                };
                let router = d * m.experts;
                p.replicated += (router + shared) as f64;
                p.experts = (m.experts * expert) as f64;
                p.active += (router + shared + m.top_k * expert) as f64;
            }
            _ => {
                let mlp = self.mlp_params(self.gated_mlp, self.bias, self.d_ff);
                p.tp_split += (mlp - b * d) as f64;
                p.replicated += (b * d) as f64;
                p.active += mlp as f64;
            }
        }
        p
    }

    /// Token embedding and learned position table.
    fn embedding_params(&self) -> usize {
        (self.vocab + self.position_table) * self.d_model
    }

    /// Untied output projection (0 when tied).
    fn head_params(&self) -> usize {
        if self.tied_embeddings {
            0
        } else {
            self.d_model * self.vocab + usize::from(self.bias) * self.vocab
        }
    }

    /// Parameters by the formula (ignores [`ModelShape::measured_params`]): embeddings,
    /// blocks, final norm and head.
    pub fn num_params(&self) -> usize {
        let blocks: f64 = (0..self.layers)
            .map(|i| {
                let l = self.layer(self.is_moe_layer(i));
                l.tp_split + l.replicated + l.experts
            })
            .sum();
        self.embedding_params()
            + blocks as usize
            + self.norm.params(self.d_model)
            + self.head_params()
    }

    /// Parameters one token uses: [`ModelShape::num_params`] with each MoE layer counting its
    /// router, shared experts and `top_k` routed experts.
    pub fn active_params(&self) -> usize {
        let moe_layers = (0..self.layers).filter(|&i| self.is_moe_layer(i)).count();
        match &self.moe {
            Some(m) if moe_layers > 0 => {
                let expert = self.mlp_params(m.gated, m.bias, m.d_ff);
                self.num_params() - moe_layers * (m.experts - m.top_k) * expert
            }
            _ => self.num_params(),
        }
    }

    /// Weights each token is multiplied by: every block's projections (under MoE its router,
    /// shared experts and `top_k` routed experts) and the output projection (tied or not).
    /// Embedding lookups and norms are not products and are not counted.
    pub fn matmul_params(&self) -> usize {
        let blocks: f64 = (0..self.layers)
            .map(|i| self.layer(self.is_moe_layer(i)).active)
            .sum();
        blocks as usize + self.d_model * self.vocab
    }

    /// Training FLOPs per token at sequence length `seq` (forward and backward, no
    /// recomputation), the count MFU is quoted against (PaLM's appendix B, Megatron-LM):
    /// `6 * matmul_params + 12 * layers * seq * d_model`. The first term is a multiply-add per
    /// weight, three times (forward, and the input and weight gradients); the second is the
    /// attention scores and their weighting of the values, which grow with `seq`. Causal
    /// masking is not discounted.
    ///
    /// ```
    /// use burn_parallel::planner::ModelShape;
    ///
    /// // GPT-2 small's body at seq 1024: 85.0M weights in the blocks, 0.2M in the byte head.
    /// let shape = ModelShape::gpt(12, 768, 12, 256, 1024);
    /// let per_token = shape.train_flops_per_token(1024);
    /// assert!((per_token / 1e6 - 624.3).abs() < 0.1, "{per_token}");
    /// ```
    pub fn train_flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.matmul_params() as f64 + 12.0 * (self.layers * seq * self.d_model) as f64
    }

    fn scale(&self) -> f64 {
        match self.measured_params {
            Some(n) => n as f64 / self.num_params().max(1) as f64,
            None => 1.0,
        }
    }
}

/// Parameters of a Burn module, counted from its [`ParamIndex`](crate::index::ParamIndex).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ParamCount {
    /// Float parameters, in elements.
    pub total: usize,
    /// Number of parameter tensors.
    pub tensors: usize,
    /// The largest tensor: its path (`blocks.0.mlp.up.weight`) and elements.
    pub largest: (String, usize),
}

/// Counts the float parameters of any Burn module without initialising lazy ones: for users
/// who have a module rather than its shape (put the count in
/// [`ModelShape::measured_params`]).
///
/// # Arguments
/// - `module`: any module.
///
/// # Returns
/// The total, the number of tensors and the largest tensor with its path.
///
/// # Example
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_parallel::planner::count_params;
///
/// let linear = LinearConfig::new(8, 4).init(&Device::flex());
/// let count = count_params(&linear);
/// assert_eq!(count.total, 8 * 4 + 4);
/// assert_eq!(count.largest, ("weight".to_string(), 32));
/// ```
pub fn count_params<M: Module>(module: &M) -> ParamCount {
    let index = crate::index::ParamIndex::of(module);
    let mut count = ParamCount::default();
    for entry in index.entries() {
        let n = entry.numel();
        count.total += n;
        count.tensors += 1;
        if n > count.largest.1 {
            count.largest = (entry.path.clone(), n);
        }
    }
    count
}

/// One device: its memory, its sustained compute and its link to the others.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Hardware {
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Sustained FLOP/s of a device on the model's matrix products.
    pub flops_per_s: f64,
    /// Bandwidth of a device's link to the others, bytes per second (per direction).
    pub link_bytes_per_s: f64,
}

impl Hardware {
    /// A device of `memory_gib` GiB, `tflops` TFLOP/s and a link of `link_gb_per_s` GB/s.
    ///
    /// # Arguments
    /// `memory_gib` (GiB = 2^30 bytes), `tflops` (10^12 FLOP/s), `link_gb_per_s` (10^9 B/s).
    ///
    /// # Returns
    /// The hardware ([`plan`] checks that the figures are positive).
    pub fn from_units(memory_gib: f64, tflops: f64, link_gb_per_s: f64) -> Self {
        Self {
            memory_bytes: (memory_gib * GIB) as u64,
            flops_per_s: tflops * 1e12,
            link_bytes_per_s: link_gb_per_s * 1e9,
        }
    }

    /// [`Self::from_units`] for figures a user typed: each must be finite and above 0 (the
    /// memory below 2^64 bytes), and an error names the figure as it was given, where
    /// `from_units` would turn a negative or NaN memory into 0 bytes and an infinite one into
    /// 16 EiB.
    ///
    /// # Errors
    /// [`PlanError::Hardware`] naming `memory_gib`, `tflops` or `link_gb_per_s` and its value.
    ///
    /// # Example
    /// ```
    /// use burn_parallel::planner::Hardware;
    ///
    /// assert_eq!(Hardware::try_from_units(1.0, 2.0, 3.0).unwrap(), Hardware::from_units(1.0, 2.0, 3.0));
    /// let err = Hardware::try_from_units(-16.0, 100.0, 25.0).unwrap_err().to_string();
    /// assert!(err.contains("memory_gib") && err.contains("-16"), "{err}");
    /// assert!(Hardware::try_from_units(f64::INFINITY, 100.0, 25.0).is_err());
    /// assert!(Hardware::try_from_units(16.0, f64::NAN, 25.0).is_err());
    /// ```
    pub fn try_from_units(
        memory_gib: f64,
        tflops: f64,
        link_gb_per_s: f64,
    ) -> Result<Self, PlanError> {
        let figures = [
            ("memory_gib", memory_gib, u64::MAX as f64 / GIB),
            ("tflops", tflops, f64::MAX),
            ("link_gb_per_s", link_gb_per_s, f64::MAX),
        ];
        for (field, value, max) in figures {
            if !(value.is_finite() && value > 0.0 && value < max) {
                return Err(PlanError::Hardware {
                    field,
                    reason: format!("is {value}; give a positive, finite figure"),
                });
            }
        }
        Ok(Self::from_units(memory_gib, tflops, link_gb_per_s))
    }

    fn validate(&self) -> Result<(), PlanError> {
        let err = |field, v: f64| PlanError::Hardware {
            field,
            reason: format!("is {v}; give a positive, finite figure"),
        };
        if self.memory_bytes == 0 {
            return Err(err("memory_bytes", 0.0));
        }
        for (field, v) in [
            ("flops_per_s", self.flops_per_s),
            ("link_bytes_per_s", self.link_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(err(field, v));
            }
        }
        Ok(())
    }
}

/// The training job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Training {
    /// Devices (ranks).
    pub world: usize,
    /// Sequences per optimizer step, over all ranks.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per micro-batch on one data-parallel replica.
    pub micro_batch: usize,
    /// 16-bit compute with fp32 master weights (2 + 2 + 12 bytes per parameter with Adam);
    /// `false`: fp32 everywhere (4 + 4 + 8).
    pub mixed_precision: bool,
    /// Optimizer state per parameter, bytes, without the master copy (Adam: 8).
    pub optimizer_bytes: usize,
    /// Gradient bucket of DDP and ZeRO-1/2, bytes.
    pub bucket_bytes: usize,
    /// How attention is computed: the `b a s^2` scores kept for the backward
    /// ([`Attention::Materialized`]) or only a log-sum-exp per query ([`Attention::Flash`]).
    pub attention: Attention,
    /// Dropout probability above 0: its masks are kept for the backward (and, in the
    /// fp32 model, attention dropout materialises the scores whatever [`Training::attention`]
    /// says, as the GPT of `examples` does).
    pub dropout: bool,
    /// The fused kernels of [`crate::kernels`] (norms that keep their input, a cross-entropy
    /// that keeps the logits and a log-sum-exp); `false`: Burn's composed norms and
    /// cross-entropy. Only the fp32 model (`mixed_precision: false`) looks at it.
    pub fused: bool,
}

/// How the attention of a layer is computed, which decides what its backward keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Attention {
    /// Scores, probabilities (and the dropout mask) `[b, a, s, s]` are kept: Korthikanti's
    /// `5 a s / h` term in 16 bits; Burn's composed softmax keeps three fp32 `[b, a, s, s]`
    /// tensors (the shifted scores the `exp` saves, its output the division saves, the
    /// probabilities the product with `V` saves).
    Materialized,
    /// Blockwise (flash) attention: only the output and a `[b, a, s]` log-sum-exp are kept;
    /// the backward recomputes the probabilities tile by tile
    /// ([`crate::kernels::attention`]).
    Flash,
}

impl Training {
    /// `world` ranks, `global_batch` sequences of `seq_len` tokens per step, micro-batches of
    /// one sequence, mixed precision, Adam, 25 MB buckets, materialised attention with dropout
    /// (the setting of Korthikanti et al.), Burn's composed kernels.
    ///
    /// # Arguments
    /// See the fields.
    ///
    /// # Returns
    /// The setup ([`plan`] checks it).
    pub fn new(world: usize, global_batch: usize, seq_len: usize) -> Self {
        Self {
            world,
            global_batch,
            seq_len,
            micro_batch: 1,
            mixed_precision: true,
            optimizer_bytes: 8,
            bucket_bytes: 25 * 1024 * 1024,
            attention: Attention::Materialized,
            dropout: true,
            fused: false,
        }
    }

    fn validate(&self) -> Result<(), PlanError> {
        for (field, v) in [
            ("world", self.world),
            ("global_batch", self.global_batch),
            ("seq_len", self.seq_len),
            ("micro_batch", self.micro_batch),
        ] {
            if v == 0 {
                return Err(PlanError::Training {
                    field,
                    reason: "is 0; give a positive number".into(),
                });
            }
        }
        if self.seq_len > MAX_TOKENS {
            return Err(PlanError::Training {
                field: "seq_len",
                reason: format!(
                    "{} is beyond the planner's {MAX_TOKENS} tokens",
                    self.seq_len
                ),
            });
        }
        if self.world > MAX_WORLD {
            return Err(PlanError::Training {
                field: "world",
                reason: format!(
                    "{} is more devices than the planner lays out (at most {MAX_WORLD})",
                    self.world
                ),
            });
        }
        Ok(())
    }

    /// Bytes per parameter of (parameters, gradients, optimizer state incl. master weights).
    pub fn bytes_per_param(&self) -> (f64, f64, f64) {
        let o = self.optimizer_bytes as f64;
        if self.mixed_precision {
            (2.0, 2.0, o + 4.0)
        } else {
            (4.0, 4.0, o)
        }
    }

    fn activation_bytes(&self) -> f64 {
        if self.mixed_precision { 2.0 } else { 4.0 }
    }
}

/// A pipeline schedule (see `burn-pipeline`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Schedule {
    /// No pipeline (`pp = 1`): micro-batches are gradient accumulation.
    None,
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward (PipeDream-flush).
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per rank.
    Interleaved {
        /// Chunks per rank (`v`).
        virtual_stages: usize,
    },
    /// Zero bubble H1: the weight gradients fill the 1F1B bubble.
    ZbH1,
    /// Zero bubble V: two chunks per rank in a V shape.
    Zbv,
}

impl Schedule {
    fn chunks(self) -> usize {
        match self {
            Schedule::Interleaved { virtual_stages } => virtual_stages,
            Schedule::Zbv => 2,
            _ => 1,
        }
    }

    /// Micro-batch times of bubble per `p - 1`.
    fn bubble_factor(self) -> f64 {
        match self {
            Schedule::None => 0.0,
            Schedule::GPipe | Schedule::OneFOneB => 1.0,
            Schedule::Interleaved { virtual_stages } => 1.0 / virtual_stages as f64,
            Schedule::ZbH1 => 1.0 / 3.0,
            Schedule::Zbv => 0.0,
        }
    }

    /// Micro-batches of stage activations held on `stage` of `p` with `m` micro-batches.
    fn held(self, stage: usize, p: usize, m: usize) -> f64 {
        let in_flight = (p - stage).min(m) as f64;
        match self {
            Schedule::None => 1.0,
            Schedule::GPipe => m as f64,
            Schedule::OneFOneB | Schedule::ZbH1 => in_flight,
            Schedule::Interleaved { virtual_stages } => {
                in_flight * (1.0 + (p - 1) as f64 / (p * virtual_stages) as f64)
            }
            Schedule::Zbv => p.min(m) as f64,
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::None => f.write_str("accum"),
            Schedule::GPipe => f.write_str("gpipe"),
            Schedule::OneFOneB => f.write_str("1f1b"),
            Schedule::Interleaved { virtual_stages } => write!(f, "interleaved{virtual_stages}"),
            Schedule::ZbH1 => f.write_str("zb-h1"),
            Schedule::Zbv => f.write_str("zbv"),
        }
    }
}

/// Activation checkpointing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Checkpoint {
    /// Keep every activation.
    None,
    /// Keep each block's input; recompute the block in its backward.
    Block,
    /// Keep each pipeline stage's input; recompute the stage in its backward.
    Stage,
}

/// One layout: the mesh, the ZeRO stage and the per-technique choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// The mesh dimensions.
    pub dims: ParallelDims,
    /// ZeRO stage over the `dp_shard x cp` ranks: 0 (DDP, `dp_shard = 1`) to 3 (FSDP).
    pub zero: u8,
    /// Sequence parallelism (with `tp > 1`).
    pub sp: bool,
    /// The pipeline schedule ([`Schedule::None`] with `pp = 1`).
    pub schedule: Schedule,
    /// Micro-batches per step on each data-parallel replica.
    pub micro_batches: usize,
    /// Activation checkpointing.
    pub checkpoint: Checkpoint,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.dims;
        match (self.zero, d.dp_replicate) {
            (0, r) => write!(f, "ddp{r}")?,
            (z, 1) => write!(f, "zero{z}x{}", d.dp_shard)?,
            (z, r) => write!(f, "rep{r}.zero{z}x{}", d.dp_shard)?,
        }
        if d.tp > 1 {
            write!(f, " tp{}{}", d.tp, if self.sp { "+sp" } else { "" })?;
        }
        if d.cp > 1 {
            write!(f, " cp{}", d.cp)?;
        }
        if d.ep > 1 {
            write!(f, " ep{}", d.ep)?;
        }
        if d.pp > 1 {
            write!(f, " pp{} {}", d.pp, self.schedule)?;
        }
        write!(f, " m{}", self.micro_batches)?;
        match self.checkpoint {
            Checkpoint::None => Ok(()),
            Checkpoint::Block => f.write_str(" ckpt:block"),
            Checkpoint::Stage => f.write_str(" ckpt:stage"),
        }
    }
}

/// Per-rank bytes of a layout, on its worst pipeline stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Memory {
    /// Parameters (16-bit in mixed precision).
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state, with the fp32 master weights in mixed precision.
    pub optimizer: f64,
    /// Activations kept for the backward.
    pub activations: f64,
    /// Communication buffers.
    pub buffers: f64,
    /// ZeRO-3/FSDP parameters gathered in the forward and kept alive by autodiff until the
    /// unit's backward (the fp32 model of this implementation: every unit of the stage at the
    /// start of the backward); 0 in the mixed-precision model.
    pub gathered: f64,
    /// What the backward allocates in its first steps, while every activation is still live
    /// (the gradient of the logits), plus the tensor-, context- and pipeline-parallel
    /// buffers of the forward and backward (fp32 model; 0 in the mixed-precision model).
    pub transient: f64,
    /// `true` (fp32 model): the gradients and the gradient buckets exist only once the backward
    /// has released the activations (Burn's engines run the whole backward, then reduce and
    /// step), so [`Memory::total`] takes the larger of the two phases; `false`
    /// (mixed-precision model): everything is summed, as the usual accounting does.
    pub phased: bool,
    /// The pipeline stage these figures are for (the one needing the most).
    pub stage: usize,
}

impl Memory {
    /// Parameters + gradients + optimizer state.
    pub fn model_state(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }

    /// The per-rank peak: parameters and optimizer state, plus, when [`Memory::phased`],
    /// the larger of the forward/backward phase (activations, gathered parameters, the
    /// backward's transient) and the update phase (gradients, buckets); otherwise the sum
    /// of every part.
    pub fn total(&self) -> f64 {
        let forward = self.activations + self.gathered + self.transient;
        let update = self.grads + self.buffers;
        if self.phased {
            self.params + self.optimizer + forward.max(update)
        } else {
            self.params + self.optimizer + forward + update
        }
    }

    /// The largest part, named.
    fn largest(&self) -> (&'static str, f64) {
        [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer),
            ("activations", self.activations),
            ("communication buffers", self.buffers),
            ("gathered parameters", self.gathered),
            ("backward transient", self.transient),
        ]
        .into_iter()
        .fold(("", -1.0), |a, b| if b.1 > a.1 { b } else { a })
    }
}

/// A layout with its predicted memory and speed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// The layout.
    pub layout: Layout,
    /// Per-rank memory (worst stage).
    pub memory: Memory,
    /// FLOPs of one step over the whole job (recomputation included).
    pub flops_per_step: f64,
    /// FLOPs of one step on the busiest rank.
    pub flops_per_rank: f64,
    /// Bytes one rank sends per step (all collectives).
    pub comm_bytes_per_rank: f64,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// Part of the step that is pipeline bubble.
    pub bubble_fraction: f64,
    /// Predicted tokens per second.
    pub tokens_per_s: f64,
}

/// Why a layout was not kept.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Rejection {
    /// A size does not divide another (heads by tp, layers by pp, batch by dp...).
    Constraint(String),
    /// The layout is valid but does not fit.
    Memory {
        /// Bytes per rank needed.
        needed: f64,
        /// Bytes per rank available.
        available: f64,
        /// The largest part and its bytes.
        largest: (&'static str, f64),
        /// ZeRO stage of the layout.
        zero: u8,
    },
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Constraint(reason) => f.write_str(reason),
            Rejection::Memory {
                needed,
                available,
                largest,
                zero,
            } => write!(
                f,
                "needs {} per rank > {}: {} {} (ZeRO {zero})",
                human_bytes(*needed),
                human_bytes(*available),
                largest.0,
                human_bytes(largest.1)
            ),
        }
    }
}

/// `bytes` with two decimals in GiB, MiB or KiB, whichever is the largest below it.
///
/// # Example
/// ```
/// assert_eq!(burn_parallel::planner::human_bytes(1.5 * 1024.0 * 1024.0), "1.50 MiB");
/// ```
pub fn human_bytes(bytes: f64) -> String {
    if bytes >= GIB {
        format!("{:.2} GiB", bytes / GIB)
    } else if bytes >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", bytes / (1024.0 * 1024.0))
    } else {
        format!("{:.2} KiB", bytes / 1024.0)
    }
}

/// A layout that was not kept, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejected {
    /// The layout, printed (partial when a mesh dimension already failed).
    pub layout: String,
    /// The evaluated layout when it failed only on memory.
    pub candidate: Option<Candidate>,
    /// Why.
    pub reason: Rejection,
}

/// The outcome of [`plan`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Layouts that fit, fastest first (ties: least memory first).
    pub fitting: Vec<Candidate>,
    /// Layouts that do not: the constraint failures (one per distinct reason) first, then
    /// the memory failures, closest to fitting first.
    pub rejected: Vec<Rejected>,
}

impl Plan {
    /// The fastest layout that fits.
    pub fn best(&self) -> Option<&Candidate> {
        self.fitting.first()
    }
}
