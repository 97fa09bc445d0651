//! Activation memory of a transformer layer: the formulas of Korthikanti et al. 2022,
//! "Reducing Activation Recomputation in Large Transformer Models", generalised to any MLP
//! width, gated MLPs, grouped-query attention, mixture-of-experts layers and context
//! parallelism.
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
//! the two block inputs and the two masks; sequence parallelism splits those too.
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

use super::{ModelShape, MoeShape};

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
fn linear_terms(shape: &ModelShape, moe: Option<&MoeShape>) -> (f64, f64) {
    let h = shape.d_model as f64;
    let kv_ratio = shape.kv_heads as f64 / shape.heads as f64;
    // Norm inputs 4, attention input 2 and mask 1, MLP input 2 and mask 1.
    let unsplit = 10.0;
    // Q 2, K and V 4 kv/a, input of the output projection 2.
    let attention = 4.0 + 4.0 * kv_ratio;
    let inner = |gated: bool, f: usize| {
        let per = if gated { 8.0 } else { 4.0 };
        per * f as f64 / h
    };
    let mlp = match moe {
        None => inner(shape.gated_mlp, shape.d_ff),
        Some(m) => {
            m.top_k as f64 * inner(m.gated, m.d_ff)
                + if m.shared > 0 {
                    inner(m.gated, m.shared * m.d_ff)
                } else {
                    0.0
                }
                + 4.0 * m.experts as f64 / h
        }
    };
    (unsplit, attention + mlp)
}

/// Bytes one layer keeps for its backward for one micro-batch, 16-bit activations, without
/// recomputation (the Korthikanti et al. formula, generalised as the module docs say).
///
/// # Arguments
/// - `shape`: the model; `moe`: the layer's mixture of experts, if it is an MoE layer.
/// - `mb`: the micro-batch geometry on this rank.
///
/// # Returns
/// Bytes, as `f64` (fractions of a byte appear when `t` does not divide a term).
pub fn layer_bytes(shape: &ModelShape, moe: Option<&MoeShape>, mb: &MicroBatch) -> f64 {
    let (unsplit, split) = linear_terms(shape, moe);
    let t = mb.tp as f64;
    let sbh = (mb.local_tokens * mb.sequences * shape.d_model) as f64;
    let unsplit = if mb.sp { unsplit / t } else { unsplit };
    let attention_matrix =
        5.0 * (shape.heads * mb.local_tokens * mb.key_tokens * mb.sequences) as f64 / t;
    sbh * (unsplit + split / t) + attention_matrix
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
