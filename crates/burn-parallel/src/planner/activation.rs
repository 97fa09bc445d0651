//! Activation memory of a transformer layer, in two models.
//!
//! # Mixed precision: Korthikanti et al.
//!
//! The formulas of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
//! Transformer Models", generalised to any MLP width, gated MLPs, grouped-query attention,
//! mixture-of-experts layers and context parallelism ([`layer_bytes`], [`paper_layer_bytes`]).
//!
//! The paper counts the bytes one layer keeps for its backward, per micro-batch of `b`
//! sequences of `s` tokens, hidden size `h`, `a` heads, with 16-bit activations and 1-byte
//! dropout masks:
//!
//! ```text
//! s b h (34 + 5 a s / h)                      no parallelism
//! s b h (10 + 24 / t + 5 a s / (h t))         tensor parallel over t ranks
//! s b h (34 + 5 a s / h) / t                  tensor + sequence parallel
//! ```
//!
//! Per token and per `h`, the 34 is: the two norms' inputs (4); attention: its input (2), `Q`
//! and `K` (4), `V` (2), the input of the output projection (2), its dropout mask (1); the MLP:
//! its input (2), the activation's input and output at width `4h` (16), its dropout mask (1).
//! The `5 a s / h` is the attention matrix: scores before and after the softmax (2 + 2 bytes)
//! and its dropout mask (1). Tensor parallelism splits everything but the 10 of the norms,
//! the two block inputs and the two masks; sequence parallelism splits those too. Without
//! dropout the three masks go (32 and `4 a s / h`); with [`Attention::Flash`] the attention
//! matrix is replaced by an fp32 log-sum-exp per query and head (`4 a / h` per token).
//!
//! Generalisations (each reduces to the paper's 34 for `d_ff = 4h`, `kv_heads = heads`, GELU):
//! `K` and `V` are `4 kv / a` (grouped-query attention); the MLP inner term is `4 f / h` for
//! GELU and `8 f / h` for a gated MLP (gate, up, the activation of the gate and the product
//! feeding `down`); a mixture-of-experts layer keeps `top_k` experts' inner terms per token,
//! the shared experts' and the router's scores (`4 E / h`). Context parallelism over `c` ranks
//! gives each rank `s / c` query tokens attending to all `s` keys (ring attention), so the
//! linear terms use `s / c` and the attention matrix `(s / c) x s`.
//!
//! Recomputation ("activation checkpointing"): a checkpointed block keeps only its input,
//! `2 s b h` bytes (divided by `t` under sequence parallelism), and recomputes the rest during
//! its backward, when one block's full activations exist again.
//!
//! # fp32: what this implementation keeps, tensor by tensor
//!
//! [`fp32_layer_bytes`] counts, op by op of the GPT block of `examples` (pre-norm, `x + attn(ln_1
//! x)`, then `x + mlp(ln_2 x)`), the tensors Burn's autodiff (burn-autodiff 0.22.1, no
//! checkpointing strategy) keeps for the backward, at 4 bytes. A kept tensor is a reference to
//! a buffer (Flex tensors are reference-counted; a view shares its buffer), so a buffer counts
//! once however many ops keep it, and a tensor no op keeps is freed after the forward. With
//! `N = b s` tokens of the micro-batch on this rank, `d = h`, `f` the MLP width, `t` the
//! tensor-parallel ranks and `kv = kv_heads / heads`:
//!
//! | op | kept for the backward | elements |
//! |---|---|---|
//! | `ln_1`, `ln_2`, fused | the input (the block input, then the residual after attention), mean and 1/std | `2 N d + 4 N` |
//! | `ln_1`, `ln_2`, composed | centred input (kept by `x * x` and the division), normalised input (kept by `* weight`) | `4 N d + 4 N` |
//! | `q`, `k`, `v` (column-parallel) | their common input, `ln_1`'s output, whole on every rank; under sp only its sequence shard (Megatron's) | `N d`; sp: `N d / t` |
//! | `up` (and `gate`) | `ln_2`'s output, whole; under sp its shard | `N d`; sp: `N d / t` |
//! | flash attention | contiguous copies of `Q`, `K`, `V` (the `[b, s, a, hd] -> [b a, s, hd]` reshape copies), the output, the log-sum-exp | `N d (2 + 2 kv) / t + b a s / t` |
//! | materialised attention | the `q`, `k`, `v` outputs (the matmuls keep views of them), the shifted scores (`exp` keeps its input), `exp` (the division keeps it), the probabilities (the product with `V` keeps them); with dropout also its fp32 mask | `N d (1 + 2 kv) / t + (3 or 4) b a s^2 / t`, and the causal mask's `s^2` bytes |
//! | `o` (row-parallel) | its input, the `[b, s, a hd]` copy of the attention output | `N d / t` |
//! | GELU MLP | `up`'s output (kept by the GELU), the GELU's (kept by `down`) | `2 N f / t` |
//! | SwiGLU MLP | `gate`'s and `up`'s outputs, their product | `3 N f / t` |
//! | residual dropout (p > 0) | the two fp32 masks | `2 N d` |
//!
//! Adds, residual additions, reshapes and the all-reduces of tensor parallelism keep nothing.
//! Sequence parallelism: the norms run on `N / t` tokens, so their inputs and masks are
//! split by `t`; the projections of a sub-layer all-gather their common input once
//! (`nn::Linear::forward_shared`) and keep only the sequence shard, as Megatron does
//! (`autograd::GatheredSequence`: the backward gathers it again for the weight gradients and
//! reduce-scatters the input gradient). Everything a layer keeps is then split by `t` but the
//! attention's and the MLP's inner terms, which tensor parallelism splits already. (Before,
//! each column-parallel layer gathered for itself and kept its gathered copy: `3 N d + N d`
//! per layer, more than tp alone.)
//!
//! Outside the blocks ([`fp32_head_bytes`], [`fp32_embedding_bytes`]): `ln_f` as a norm, the
//! output layer's input `N d` (whole), the logits `N V / t` (the fused cross-entropy keeps
//! them; Burn's composed `log_softmax` keeps the shifted logits instead, the same size), a
//! log-sum-exp `N`; the token ids and targets (8 bytes each); the embedding's dropout mask.
//! The backward then starts with every activation live: the fused cross-entropy allocates the
//! logits' gradient (`N V / t`), the composed one the gradient and `exp` of the shifted logits
//! (`2 N V / t`) before the logits are released: that is the transient of the peak.
//!
//! Checked with a counting allocator (`cargo run -p examples --example planner_check --
//! --probe`): the slope between 2 and 4 layers of the d128 GPT (batch 16, seq 128) is
//! 17,910,568 bytes per layer against 17,891,328 derived (flash, fused norms), and 31,569,824
//! against 31,539,200 (materialised, composed); the rest is autodiff's graph bookkeeping.
//!
//! MoE layers keep the paper's generalisation at 4 bytes; context parallelism uses `s / c`
//! local tokens against `s` keys, and its ring attention is counted as flash attention (it
//! keeps no scores; measured within 2% at cp 2 with either kernel setting).

use super::{Attention, ModelShape, MoeShape};

/// Geometry of one micro-batch on one rank: what the activation formulas need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatch {
    /// Sequences in the micro-batch (`b`).
    pub sequences: usize,
    /// Tokens of each sequence this rank holds (`s / cp`).
    pub local_tokens: usize,
    /// Tokens each query attends to (`s`).
    pub key_tokens: usize,
    /// Tensor-parallel ranks (`t`).
    pub tp: usize,
    /// Sequence parallelism on (the norms and block inputs are split by `t` too).
    pub sp: bool,
}

/// Per-token bytes of one layer, divided by `h`, 16-bit: the part tensor parallelism does not
/// split (norm inputs, block inputs, dropout masks) and the part it splits.
fn linear_terms(shape: &ModelShape, moe: Option<&MoeShape>, dropout: bool) -> (f64, f64) {
    let h = shape.d_model as f64;
    let kv_ratio = shape.kv_heads as f64 / shape.heads as f64;
    // Norm inputs 4, attention input 2 and mask 1, MLP input 2 and mask 1.
    let unsplit = if dropout { 10.0 } else { 8.0 };
    // Q 2, K and V 4 kv/a, input of the output projection 2.
    let attention = 4.0 + 4.0 * kv_ratio;
    let inner = |gated: bool, f: usize| {
        let per = if gated { 8.0 } else { 4.0 };
        per * f as f64 / h
    };
    (
        unsplit,
        attention + ffn_terms(moe, shape.gated_mlp, shape.d_ff, h, &inner),
    )
}

/// The feed-forward network's per-token term (the inner activations), by `inner`.
fn ffn_terms(
    moe: Option<&MoeShape>,
    gated: bool,
    d_ff: usize,
    h: f64,
    inner: &dyn Fn(bool, usize) -> f64,
) -> f64 {
    match moe {
        None => inner(gated, d_ff),
        Some(m) => {
            m.top_k as f64 * inner(m.gated, m.d_ff)
                + if m.shared > 0 {
                    inner(m.gated, m.shared * m.d_ff)
                } else {
                    0.0
                }
                + 4.0 * m.experts as f64 / h
        }
    }
}

/// Bytes one layer keeps for its backward for one micro-batch, 16-bit activations, without
/// recomputation: [`paper_layer_bytes`] with materialised attention and dropout, the setting
/// of Korthikanti et al.
///
/// # Arguments
/// - `shape`: the model; `moe`: the layer's mixture of experts, if it is an MoE layer.
/// - `mb`: the micro-batch geometry on this rank.
///
/// # Returns
/// Bytes, as `f64` (fractions of a byte appear when `t` does not divide a term).
pub fn layer_bytes(shape: &ModelShape, moe: Option<&MoeShape>, mb: &MicroBatch) -> f64 {
    paper_layer_bytes(shape, moe, mb, Attention::Materialized, true)
}

/// Bytes one layer keeps for its backward for one micro-batch, 16-bit activations, without
/// recomputation (the Korthikanti et al. formula, generalised as the module docs say).
///
/// # Arguments
/// - `shape`, `moe`, `mb`: as for [`layer_bytes`].
/// - `attention`: [`Attention::Materialized`] keeps the `5 a s / h` term (4 without dropout);
///   [`Attention::Flash`] an fp32 log-sum-exp per query and head instead.
/// - `dropout`: whether the dropout masks (1 byte each) are kept.
///
/// # Returns
/// Bytes.
///
/// # Example
/// ```
/// use burn_parallel::planner::{Attention, ModelShape};
/// use burn_parallel::planner::activation::{MicroBatch, paper_layer_bytes};
///
/// let shape = ModelShape::gpt(1, 1024, 16, 1000, 2048);
/// let mb = MicroBatch { sequences: 1, local_tokens: 2048, key_tokens: 2048, tp: 1, sp: false };
/// let sbh = 2048.0 * 1024.0;
/// // Flash, no dropout: 32 bytes per token and h, plus 4 bytes per token and head.
/// assert_eq!(
///     paper_layer_bytes(&shape, None, &mb, Attention::Flash, false),
///     sbh * 32.0 + 4.0 * 16.0 * 2048.0
/// );
/// ```
pub fn paper_layer_bytes(
    shape: &ModelShape,
    moe: Option<&MoeShape>,
    mb: &MicroBatch,
    attention: Attention,
    dropout: bool,
) -> f64 {
    let (unsplit, split) = linear_terms(shape, moe, dropout);
    let t = mb.tp as f64;
    let sbh = (mb.local_tokens * mb.sequences * shape.d_model) as f64;
    let unsplit = if mb.sp { unsplit / t } else { unsplit };
    let queries = (shape.heads * mb.local_tokens * mb.sequences) as f64;
    let attention_term = match attention {
        Attention::Materialized => {
            let per = if dropout { 5.0 } else { 4.0 };
            per * queries * mb.key_tokens as f64 / t
        }
        Attention::Flash => 4.0 * queries / t,
    };
    sbh * (unsplit + split / t) + attention_term
}

/// What decides which tensors the fp32 backward keeps (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// How attention is computed (attention dropout materialises it whatever this says).
    pub attention: Attention,
    /// The fused norms and cross-entropy of [`crate::kernels`]; `false`: Burn's composed ones.
    pub fused: bool,
    /// Dropout probability above 0.
    pub dropout: bool,
}

/// Bytes one layer keeps for its backward for one micro-batch in fp32, tensor by tensor as
/// this implementation runs it (the table of the module docs).
///
/// # Arguments
/// - `shape`, `moe`, `mb`: as for [`layer_bytes`]; `kernels`: the kernels the layer runs.
///
/// # Returns
/// Bytes.
///
/// # Example
/// ```
/// use burn_parallel::planner::{Attention, ModelShape};
/// use burn_parallel::planner::activation::{Kernels, MicroBatch, fp32_layer_bytes};
///
/// // d 128, 4 heads, f 512, 16 sequences of 128 tokens: N = 2048.
/// let shape = ModelShape::gpt(1, 128, 4, 256, 128);
/// let mb = MicroBatch { sequences: 16, local_tokens: 128, key_tokens: 128, tp: 1, sp: false };
/// let k = Kernels { attention: Attention::Flash, fused: true, dropout: false };
/// let (n, d, f) = (2048.0, 128.0, 512.0);
/// // 9 N d + 2 N f + 4 N + the log-sum-exp b a s, 4 bytes each.
/// let elements = 9.0 * n * d + 2.0 * n * f + 4.0 * n + 16.0 * 4.0 * 128.0;
/// assert_eq!(fp32_layer_bytes(&shape, None, &mb, &k), 4.0 * elements);
/// ```
pub fn fp32_layer_bytes(
    shape: &ModelShape,
    moe: Option<&MoeShape>,
    mb: &MicroBatch,
    kernels: &Kernels,
) -> f64 {
    let t = mb.tp as f64;
    let seq = if mb.sp { t } else { 1.0 };
    let n = (mb.local_tokens * mb.sequences) as f64;
    let (h, a) = (shape.d_model as f64, shape.heads as f64);
    let kv = shape.kv_heads as f64 / a;
    let nd = n * h;
    // The two norms: inputs (fused) or centred and normalised inputs (composed), and the
    // per-row statistics; split by t under sequence parallelism.
    let norms = if kernels.fused { 2.0 * nd } else { 4.0 * nd } / seq + 4.0 * n / seq;
    // The inputs of the column-parallel q/k/v and up/gate: one shared norm output per
    // sub-layer, whole, or under sp its sequence shard (gathered again in the backward).
    let matmul_inputs = 2.0 * nd / seq;
    // Context parallelism (fewer local queries than keys) runs ring attention, which keeps
    // per-block statistics rather than scores, whatever the kernels.
    let ring = mb.local_tokens < mb.key_tokens;
    let materialized = (kernels.attention == Attention::Materialized && !ring) || kernels.dropout;
    let key_tokens = mb.key_tokens as f64;
    let queries = mb.sequences as f64 * a * mb.local_tokens as f64;
    let (attention, mask_bytes) = if materialized {
        let scores = if kernels.dropout { 4.0 } else { 3.0 };
        (
            nd * (1.0 + 2.0 * kv) / t + scores * queries * key_tokens / t,
            (mb.local_tokens * mb.key_tokens) as f64,
        )
    } else {
        (nd * (2.0 + 2.0 * kv) / t + queries / t, 0.0)
    };
    let out_proj = nd / t;
    let inner = |gated: bool, f: usize| if gated { 3.0 } else { 2.0 } * f as f64 / h;
    let ffn = nd * ffn_terms(moe, shape.gated_mlp, shape.d_ff, h, &inner) / t;
    let masks = if kernels.dropout { 2.0 * nd / seq } else { 0.0 };
    4.0 * (norms + matmul_inputs + attention + out_proj + ffn + masks) + mask_bytes
}

/// Bytes the output layer keeps in fp32 for one micro-batch on the last stage, and the
/// transient its backward adds at the start (module docs).
///
/// # Arguments
/// - `shape`, `mb`: as for [`layer_bytes`]; `kernels`: the kernels; `fused_loss`: the fused
///   cross-entropy runs (it does on one tensor-parallel rank with fused kernels; a split
///   head uses the composed vocabulary-parallel loss).
///
/// # Returns
/// `(kept, transient)` bytes.
pub fn fp32_head_bytes(
    shape: &ModelShape,
    mb: &MicroBatch,
    kernels: &Kernels,
    fused_loss: bool,
) -> (f64, f64) {
    let t = mb.tp as f64;
    let seq = if mb.sp { t } else { 1.0 };
    let n = (mb.local_tokens * mb.sequences) as f64;
    let nd = n * shape.d_model as f64;
    let norm = if kernels.fused { nd } else { 2.0 * nd } / seq + 2.0 * n / seq;
    let logits = n * shape.vocab as f64 / t;
    let kept = 4.0 * (norm + nd + logits + n) + 8.0 * n;
    let transient = if fused_loss {
        4.0 * logits
    } else {
        8.0 * logits
    };
    (kept, transient)
}

/// Bytes the embedding keeps in fp32 for one micro-batch on the first stage: the token ids
/// (8 bytes each) and, with dropout, its mask.
///
/// # Arguments
/// - `shape`, `mb`: as for [`layer_bytes`]; `kernels`: the kernels.
///
/// # Returns
/// Bytes.
pub fn fp32_embedding_bytes(shape: &ModelShape, mb: &MicroBatch, kernels: &Kernels) -> f64 {
    let n = (mb.local_tokens * mb.sequences) as f64;
    let seq = if mb.sp { mb.tp as f64 } else { 1.0 };
    let mask = if kernels.dropout {
        4.0 * n * shape.d_model as f64 / seq
    } else {
        0.0
    };
    8.0 * n + mask
}

/// Bytes a checkpointed layer keeps: its input, `2 s b h` (divided by `t` under sequence
/// parallelism), 16-bit.
///
/// # Arguments
/// - `shape`: the model; `mb`: the micro-batch geometry on this rank.
///
/// # Returns
/// Bytes.
pub fn checkpoint_bytes(shape: &ModelShape, mb: &MicroBatch) -> f64 {
    let sbh = (mb.local_tokens * mb.sequences * shape.d_model) as f64;
    let t = if mb.sp { mb.tp as f64 } else { 1.0 };
    2.0 * sbh / t
}

/// Bytes of the output layer kept for the backward on the last pipeline stage: fp32 logits and
/// the softmax the cross-entropy saves, `8 s b V / t` (vocabulary-parallel head).
///
/// # Arguments
/// - `shape`: the model; `mb`: the micro-batch geometry on this rank.
///
/// # Returns
/// Bytes.
pub fn logits_bytes(shape: &ModelShape, mb: &MicroBatch) -> f64 {
    8.0 * (mb.local_tokens * mb.sequences * shape.vocab) as f64 / mb.tp as f64
}
