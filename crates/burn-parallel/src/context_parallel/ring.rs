//! Ring attention.
//!
//! **Forward.** Each rank starts with its own K/V block. For `cp` steps it posts the block it
//! holds to the next rank (`rank + 1`) *before* computing on it (the send does not wait, on
//! every backend, so the transfer overlaps the block's compute; on NCCL it runs on the
//! direction's channel in device memory, see [`ProcessGroup::send_recv`]), attends its
//! queries to the block, merges the
//! partial result into its running output with the log-sum-exp rule, and receives the next
//! block from `rank - 1`: `cp - 1` rotations. Only one `[local_seq, block]` score matrix per
//! (query segment, key segment) pair exists at a time; no rank builds the full attention
//! matrix, and nothing of the blocks is kept for backward but the output, the log-sum-exp of
//! each row and the last block received.
//!
//! **Backward**, one custom autodiff step on `cat([q, k, v])`: a second ring pass in the
//! opposite direction, starting from the last block of the forward (that of `rank + 1`) and
//! ending with the rank's own block. Each step posts the K/V block to `rank - 1` before
//! computing, recomputes the block's probabilities from the saved log-sum-exp, accumulates
//! `dQ` locally, and adds its `dK`/`dV` contribution to the partial sums that travel with the
//! block; after `cp - 1` rotations of K/V and `cp - 1` of the `dK`/`dV` partial sums, every
//! block's gradient is back on the rank that owns it.
//!
//! **Causal mask** on global positions ([`SeqLayout`]): each rank's tokens are one segment
//! (contiguous) or two (head-tail); a (query segment, key segment) pair wholly in the future is
//! skipped, one wholly in the past needs no mask, only the diagonal ones are masked.

use std::ops::Range;

use burn::tensor::{Bool, Tensor};

use super::{CpError, CpResult, SeqLayout, check_qkv};
use crate::autograd::{BackwardFn, attach};
use crate::error::CollectiveError;
use crate::group::{ProcessGroup, SendRecv};
use crate::kernels::causal_mask;

/// Point-to-point tag of the forward K/V rotation.
pub const TAG_KV_FORWARD: u64 = 0x6370_0001;
/// Point-to-point tag of the backward K/V rotation.
pub const TAG_KV_BACKWARD: u64 = 0x6370_0002;
/// Point-to-point tag of the backward rotation of the `dK`/`dV` partial sums.
pub const TAG_DKV_BACKWARD: u64 = 0x6370_0003;

/// The value masked scores take: finite, so that a row with every key masked in one block
/// gives a block log-sum-exp far below any real one (weight `exp(-1e30) = 0` in the merge)
/// instead of NaN.
const MASKED: f32 = -1.0e30;

/// How a block of keys relates to a block of queries under the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Visibility {
    /// Every key is in the future of every query: nothing to compute.
    Skip,
    /// Every key is visible.
    Full,
    /// Some are: mask by position.
    Partial,
}

fn visibility(q: &Range<usize>, k: &Range<usize>, causal: bool) -> Visibility {
    if !causal || k.end <= q.start + 1 {
        Visibility::Full
    } else if k.start >= q.end {
        Visibility::Skip
    } else {
        Visibility::Partial
    }
}

/// A segment of a rank's tokens: where it sits locally and globally.
#[derive(Debug, Clone)]
struct Segment {
    local: Range<usize>,
    global: Range<usize>,
}

fn segments(layout: &SeqLayout, rank: usize) -> Vec<Segment> {
    let mut offset = 0;
    layout
        .segments_of(rank)
        .into_iter()
        .map(|global| {
            let local = offset..offset + global.len();
            offset = local.end;
            Segment { local, global }
        })
        .collect()
}

/// Scores of one (query segment, key segment) pair, scaled and masked.
fn scores(q: Tensor<4>, k: Tensor<4>, scale: f64, mask: Option<Tensor<4, Bool>>) -> Tensor<4> {
    let s = q.matmul(k.swap_dims(2, 3)) * scale;
    match mask {
        Some(mask) => s.mask_fill(mask, MASKED),
        None => s,
    }
}

/// The running output of one query segment: normalised output and log-sum-exp per row.
type Partial = (Tensor<4>, Tensor<4>);

/// Merges a block's (output, lse) into the running ones (online softmax).
fn merge(acc: Option<Partial>, block: Partial) -> Partial {
    let Some((out, lse)) = acc else {
        return block;
    };
    let (b_out, b_lse) = block;
    let max = lse.clone().max_pair(b_lse.clone());
    let new_lse =
        max.clone() + ((lse.clone() - max.clone()).exp() + (b_lse.clone() - max).exp()).log();
    let out = out * (lse - new_lse.clone()).exp() + b_out * (b_lse - new_lse.clone()).exp();
    (out, new_lse)
}

/// What one rank needs to know to run the ring.
#[derive(Debug, Clone)]
struct Ring {
    group: ProcessGroup,
    layout: SeqLayout,
    causal: bool,
    scale: f64,
    /// `[b, h, n, d]` of the local q (and of every K/V block).
    dims: [usize; 4],
}

/// A rotation of the ring in flight.
struct Shift {
    exchange: SendRecv<4>,
    /// The rank the block comes from.
    from: usize,
}

impl Ring {
    fn next(&self) -> usize {
        (self.group.rank() + 1) % self.group.size()
    }

    fn prev(&self) -> usize {
        (self.group.rank() + self.group.size() - 1) % self.group.size()
    }

    /// Starts one rotation of the ring: sends `x` to `to`, receives from `from`
    /// ([`ProcessGroup::send_recv`]: the send leaves now on every backend, the receive
    /// completes at [`Ring::finish`]).
    fn shift(&self, x: &Tensor<4>, to: usize, from: usize, tag: u64) -> CpResult<Shift> {
        Ok(Shift {
            exchange: self.group.send_recv(x.clone(), to, from, tag)?,
            from,
        })
    }

    /// Completes a rotation: the `[2 * b, h, n, d]` block received, its shape checked.
    fn finish(&self, shift: Shift) -> CpResult<Tensor<4>> {
        let block = shift.exchange.wait()?;
        let [b, h, n, d] = self.dims;
        let want = [2 * b, h, n, d];
        if block.dims() != want {
            return Err(CpError::Shape {
                op: "ring_attention".into(),
                reason: format!(
                    "rank {} sent a block of shape {:?}, this rank expected {want:?}: every rank \
                     must pass q, k, v of the same shape",
                    self.group.members()[shift.from],
                    block.dims()
                ),
            });
        }
        Ok(block)
    }

    /// The (query segment, key segment) pairs to compute with a block from `src`, with their
    /// masks.
    fn pairs(
        &self,
        src: usize,
        device: &burn::tensor::Device,
    ) -> Vec<(usize, Segment, Segment, Option<Tensor<4, Bool>>)> {
        let [b, h, _, _] = self.dims;
        let mut out = Vec::new();
        for (qi, qs) in segments(&self.layout, self.group.rank())
            .into_iter()
            .enumerate()
        {
            for ks in segments(&self.layout, src) {
                let mask = match visibility(&qs.global, &ks.global, self.causal) {
                    Visibility::Skip => continue,
                    Visibility::Full => None,
                    Visibility::Partial => {
                        let (lq, lk) = (qs.global.len(), ks.global.len());
                        Some(
                            causal_mask(qs.global.clone(), ks.global.clone(), device)
                                .reshape([1, 1, lq, lk])
                                .expand([b, h, lq, lk]),
                        )
                    }
                };
                out.push((qi, qs.clone(), ks, mask));
            }
        }
        out
    }

    /// The forward ring; returns the output, the log-sum-exp `[b, h, n, 1]` and the last block
    /// held (`cat([k, v])` of rank `rank + 1`).
    fn forward(&self, q: &Tensor<4>, kv: Tensor<4>) -> CpResult<(Tensor<4>, Tensor<4>, Tensor<4>)> {
        let (cp, rank) = (self.group.size(), self.group.rank());
        let [b, _, _, _] = self.dims;
        let device = q.device();
        let q_segs = segments(&self.layout, rank);
        let mut acc: Vec<Option<Partial>> = vec![None; q_segs.len()];
        let mut kv = kv;
        for step in 0..cp {
            let src = (rank + cp - step) % cp;
            let shift = (step + 1 < cp)
                .then(|| self.shift(&kv, self.next(), self.prev(), TAG_KV_FORWARD))
                .transpose()?;
            let k = kv.clone().narrow(0, 0, b);
            let v = kv.clone().narrow(0, b, b);
            for (qi, qs, ks, mask) in self.pairs(src, &device) {
                let s = scores(
                    q.clone().narrow(2, qs.local.start, qs.local.len()),
                    k.clone().narrow(2, ks.local.start, ks.local.len()),
                    self.scale,
                    mask,
                );
                let max = s.clone().max_dim(3);
                let p = (s - max.clone()).exp();
                let sum = p.clone().sum_dim(3);
                let out =
                    p.matmul(v.clone().narrow(2, ks.local.start, ks.local.len())) / sum.clone();
                acc[qi] = Some(merge(acc[qi].take(), (out, max + sum.log())));
            }
            if let Some(shift) = shift {
                kv = self.finish(shift)?;
            }
        }
        let (outs, lses): (Vec<_>, Vec<_>) = acc
            .into_iter()
            .map(|a| a.expect("every query segment sees its own keys"))
            .unzip();
        Ok((Tensor::cat(outs, 2), Tensor::cat(lses, 2), kv))
    }

    /// The backward ring: `dQ`, `dK`, `dV` of this rank's tokens.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        q: &Tensor<4>,
        out: &Tensor<4>,
        lse: &Tensor<4>,
        last_kv: &Tensor<4>,
        dout: Tensor<4>,
    ) -> CpResult<(Tensor<4>, Tensor<4>, Tensor<4>)> {
        let (cp, rank) = (self.group.size(), self.group.rank());
        let [b, _, _, _] = self.dims;
        let device = q.device();
        let delta = (dout.clone() * out.clone()).sum_dim(3); // [b, h, n, 1]
        let q_segs = segments(&self.layout, rank);
        let mut dq: Vec<Option<Tensor<4>>> = vec![None; q_segs.len()];
        let mut kv = last_kv.clone();
        // The partial `dK`/`dV` sums of the block held, as received from `rank + 1`.
        let mut incoming: Option<Tensor<4>> = None;
        let mut dkv = None;
        for step in 0..cp {
            let src = (rank + 1 + step) % cp;
            let shift = (step + 1 < cp)
                .then(|| self.shift(&kv, self.prev(), self.next(), TAG_KV_BACKWARD))
                .transpose()?;
            let k = kv.clone().narrow(0, 0, b);
            let v = kv.clone().narrow(0, b, b);
            let mut dk = k.zeros_like();
            let mut dv = v.zeros_like();
            for (qi, qs, ks, mask) in self.pairs(src, &device) {
                let (ql, kl) = (qs.local.clone(), ks.local.clone());
                let q_s = q.clone().narrow(2, ql.start, ql.len());
                let k_s = k.clone().narrow(2, kl.start, kl.len());
                let v_s = v.clone().narrow(2, kl.start, kl.len());
                let do_s = dout.clone().narrow(2, ql.start, ql.len());
                let p = (scores(q_s.clone(), k_s.clone(), self.scale, mask)
                    - lse.clone().narrow(2, ql.start, ql.len()))
                .exp();
                let dv_s = p.clone().swap_dims(2, 3).matmul(do_s.clone());
                let dp = do_s.matmul(v_s.swap_dims(2, 3));
                let ds = p * (dp - delta.clone().narrow(2, ql.start, ql.len()));
                let dq_s = ds.clone().matmul(k_s) * self.scale;
                let dk_s = ds.swap_dims(2, 3).matmul(q_s) * self.scale;
                dq[qi] = Some(match dq[qi].take() {
                    Some(acc) => acc + dq_s,
                    None => dq_s,
                });
                let range = [0..b, 0..self.dims[1], kl.clone(), 0..self.dims[3]];
                dk = dk
                    .clone()
                    .slice_assign(range.clone(), dk.slice(range.clone()) + dk_s);
                dv = dv
                    .clone()
                    .slice_assign(range.clone(), dv.slice(range) + dv_s);
            }
            let contribution = Tensor::cat(vec![dk, dv], 0);
            let total = match incoming.take() {
                Some(partial) => partial + contribution,
                None => contribution,
            };
            if let Some(shift) = shift {
                // The sums travel with their block: to `rank - 1`, as the block did. Both are
                // received in the order they were sent (the block first): NCCL matches the
                // messages between two ranks in that order, whatever their tags.
                let sums = self.shift(&total, self.prev(), self.next(), TAG_DKV_BACKWARD)?;
                kv = self.finish(shift)?;
                incoming = Some(self.finish(sums)?);
            }
            dkv = Some(total);
        }
        let dkv = dkv.expect("at least one step");
        let dq = dq
            .into_iter()
            .zip(&q_segs)
            .map(|(g, seg)| {
                g.unwrap_or_else(|| {
                    q.clone()
                        .narrow(2, seg.local.start, seg.local.len())
                        .zeros_like()
                })
            })
            .collect();
        Ok((
            Tensor::cat(dq, 2),
            dkv.clone().narrow(0, 0, b),
            dkv.narrow(0, b, b),
        ))
    }
}

/// Ring attention over the context-parallel `group`: this rank holds `q`, `k`, `v`
/// `[batch, heads, local_seq, head_dim]` for its tokens of `layout` (local order), and gets
/// the attention output for them over the whole sequence (scale `1/sqrt(head_dim)`, keys at
/// later global positions masked when `causal`).
///
/// # Arguments
/// - `q`, `k`, `v`: this rank's blocks, all of the same shape.
/// - `group`: the context-parallel group (`layout.cp()` ranks, this rank `layout.rank()`).
/// - `layout`: which tokens each rank holds.
/// - `causal`: mask the future.
///
/// # Returns
/// `[batch, heads, local_seq, head_dim]`; under autodiff its backward is the second ring pass
/// (see the module documentation), which panics with the collective error if a peer fails.
///
/// # Errors
/// [`CpError::GroupedQuery`] and [`CpError::Shape`] for inconsistent shapes (also a block of
/// another shape arriving from a peer); collective errors (a peer that died, a timeout).
pub fn ring_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    layout: &SeqLayout,
    causal: bool,
) -> CpResult<Tensor<4>> {
    check_qkv("ring_attention", &q, &k, &v, group, layout)?;
    let dims = q.dims();
    let ring = Ring {
        group: group.clone(),
        layout: layout.clone(),
        causal,
        scale: 1.0 / (dims[3] as f64).sqrt(),
        dims,
    };
    // The ring computes off the autodiff graph, on the inner backend: nothing of its blocks is
    // recorded, and the backward below recomputes what it needs.
    let (qd, kd, vd) = (q.clone().inner(), k.clone().inner(), v.clone().inner());
    let (out, lse, last_kv) = ring.forward(&qd, Tensor::cat(vec![kd, vd], 0))?;
    if !(q.is_tracked() || k.is_tracked() || v.is_tracked()) {
        return Ok(if q.is_autodiff() { out.autodiff() } else { out });
    }
    let x = Tensor::cat(vec![q, k, v], 0);
    let inner_device = qd.device();
    let saved_out = out.clone();
    Ok(attach(
        x,
        out.autodiff(),
        // The second ring pass, on the gradient where it lives (it never needs the host).
        BackwardFn::on_tensors::<4>("ring_attention", inner_device, move |dout| {
            let (dq, dk, dv) = ring
                .backward(&qd, &saved_out, &lse, &last_kv, dout)
                .map_err(|e| match e {
                    CpError::Collective(c) => c,
                    other => CollectiveError::InvalidArgument {
                        rank: ring.group.global_rank(),
                        op: "ring_attention backward".into(),
                        reason: other.to_string(),
                    },
                })?;
            Ok(Tensor::cat(vec![dq, dk, dv], 0))
        }),
    ))
}
