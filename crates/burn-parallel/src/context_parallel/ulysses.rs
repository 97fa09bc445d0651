//! Ulysses (DeepSpeed's all-to-all sequence parallelism for attention).
//!
//! Before attention, one all-to-all turns this rank's tokens of every head into every token of
//! `heads / cp` heads (`q`, `k` and `v` travel in one call); attention then runs locally over
//! the whole sequence for those heads, with the causal mask on global positions (after the
//! all-to-all the sequence is in rank order, so head-tail balancing only reorders the mask);
//! a second all-to-all brings the output back to sequence-sharded. The backward of each
//! all-to-all is the other one ([`crate::autograd::all_to_all`]): 2 all-to-alls forward, 2
//! backward.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};

use super::{CpError, CpResult, SeqLayout, check_qkv};
use crate::autograd::all_to_all;
use crate::group::ProcessGroup;

/// Ulysses attention over the context-parallel `group`: same contract as
/// [`super::ring_attention`].
///
/// # Arguments
/// - `q`, `k`, `v`: this rank's `[batch, heads, local_seq, head_dim]` blocks, heads a multiple
///   of the group size.
/// - `group`, `layout`, `causal`: as for [`super::ring_attention`].
///
/// # Returns
/// `[batch, heads, local_seq, head_dim]`, differentiable.
///
/// # Errors
/// [`CpError::HeadsNotDivisible`]; [`CpError::GroupedQuery`] and [`CpError::Shape`] for
/// inconsistent shapes; collective errors.
pub fn ulysses_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    layout: &SeqLayout,
    causal: bool,
) -> CpResult<Tensor<4>> {
    check_qkv("ulysses_attention", &q, &k, &v, group, layout)?;
    let [b, h, n, d] = q.dims();
    let cp = group.size();
    if !h.is_multiple_of(cp) {
        return Err(CpError::HeadsNotDivisible { heads: h, cp });
    }
    let heads = vec![h / cp; cp];
    let tokens = vec![n; cp];
    // [3b, h, n, d] -> [3b, h / cp, n cp, d]: heads scattered, tokens gathered in rank order.
    let qkv = all_to_all(Tensor::cat(vec![q, k, v], 0), group, 1, &heads, 2)?;
    let (q, k, v) = (
        qkv.clone().narrow(0, 0, b),
        qkv.clone().narrow(0, b, b),
        qkv.narrow(0, 2 * b, b),
    );
    let s = layout.seq();
    let scale = 1.0 / (d as f64).sqrt();
    let mut scores = q.matmul(k.swap_dims(2, 3)) * scale;
    if causal {
        let positions: Vec<usize> = (0..cp).flat_map(|r| layout.positions_of(r)).collect();
        let mask: Vec<bool> = positions
            .iter()
            .flat_map(|&i| positions.iter().map(move |&j| j > i))
            .collect();
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(mask, [s, s]), &scores.device())
            .reshape([1, 1, s, s])
            .expand([b, h / cp, s, s]);
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    let out = softmax(scores, 3).matmul(v);
    // [b, h / cp, n cp, d] -> [b, h, n, d].
    Ok(all_to_all(out, group, 2, &tokens, 1)?)
}
