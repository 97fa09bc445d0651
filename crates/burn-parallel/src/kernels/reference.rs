//! Composed references of the fused kernels, built from Burn tensor operations.
//!
//! Every function here computes exactly what the matching CubeCL kernel computes (forward
//! *and* the hand-derived backward), on any backend. They serve three purposes:
//!
//! - the implementation of [`FusedKernels`](super::FusedKernels) on `flex` and on every backend
//!   without a CubeCL kernel;
//! - the "unfused" side of the benchmark (`examples/kernel_bench.rs`);
//! - the oracle of the tests (themselves checked against plain autodiff of the naive math).
//!
//! Shapes: rows are the leading dimension (`[rows, cols]`); the public wrappers in
//! [`super`] reshape arbitrary ranks into this form.

use std::fmt;

use burn::tensor::activation::sigmoid;
use burn::tensor::{Int, Tensor};

/// Hyper-parameters of one fused AdamW step (Burn's `AdamW` semantics).
#[derive(Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate of this step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to `sqrt(v_hat)`.
    pub eps: f32,
    /// Decoupled weight decay (the parameter is scaled by `1 - lr * weight_decay`).
    pub weight_decay: f32,
    /// 1-based step number (for the bias corrections).
    pub step: u32,
}

impl fmt::Debug for AdamWHyper {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AdamWHyper(lr={}, betas=({}, {}), eps={}, wd={}, step={})",
            self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.step
        )
    }
}

impl AdamWHyper {
    /// The bias corrections `(1 - beta1^step, 1 - beta2^step)`, computed as Burn does.
    pub fn bias_corrections(&self) -> (f32, f32) {
        let t = self.step as i32;
        (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
    }
}

/// The causal mask of queries at positions `queries` over keys at positions `keys` (global
/// positions in one sequence): `[queries.len(), keys.len()]`, `true` where the key comes after
/// the query (`key > query`: hidden), built on `device` without a host copy. The whole
/// sequence is `causal_mask(0..s, 0..s, ..)`; [`attention`](super::attention)'s `tq` queries
/// over `tk` keys are `causal_mask(tk - tq..tk, 0..tk, ..)`; a context-parallel block pairs two
/// segments. The one mask every composed attention of the suite uses (with `mask_fill` of
/// `-inf`).
///
/// ```
/// use burn::tensor::Device;
/// use burn_parallel::kernels::causal_mask;
///
/// let hidden = causal_mask(0..3, 0..3, &Device::flex());
/// let rows = hidden.into_data().to_vec::<bool>().unwrap();
/// assert_eq!(rows, [false, true, true, false, false, true, false, false, false]);
/// // the last query of a block over the keys of an earlier one sees them all
/// let block = causal_mask(4..6, 0..2, &Device::flex());
/// assert!(block.into_data().to_vec::<bool>().unwrap().iter().all(|h| !h));
/// ```
pub fn causal_mask(
    queries: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
    device: &burn::tensor::Device,
) -> Tensor<2, burn::tensor::Bool> {
    let (lq, lk) = (queries.len(), keys.len());
    let positions =
        |r: std::ops::Range<usize>| Tensor::<1, Int>::arange(r.start as i64..r.end as i64, device);
    let rows = positions(queries).reshape([lq, 1]).expand([lq, lk]);
    let cols = positions(keys).reshape([1, lk]).expand([lq, lk]);
    cols.greater(rows)
}

/// Row statistics and output of LayerNorm (`rms == false`) or RMSNorm (`rms == true`).
///
/// # Arguments
/// - `x`: `[rows, cols]` input; `weight`, `bias`: `[cols]` (the bias is ignored by RMSNorm).
/// - `eps`: added to the (mean-square or) variance.
///
/// # Returns
/// `(y, mean, rstd)`: the output `[rows, cols]`, the row mean `[rows]` (zeros for RMSNorm) and
/// the reciprocal standard deviation (or RMS) `[rows]`.
pub fn norm_forward(
    x: Tensor<2>,
    weight: Tensor<1>,
    bias: Tensor<1>,
    eps: f64,
    rms: bool,
) -> (Tensor<2>, Tensor<1>, Tensor<1>) {
    let [rows, _] = x.dims();
    let (centred, mean) = if rms {
        (x.clone(), Tensor::<2>::zeros([rows, 1], &x.device()))
    } else {
        let mean = x.clone().mean_dim(1);
        (x - mean.clone(), mean)
    };
    let rstd = (centred.clone().square().mean_dim(1) + eps).sqrt().recip();
    let xhat = centred * rstd.clone();
    let mut y = xhat * weight.unsqueeze::<2>();
    if !rms {
        y = y + bias.unsqueeze::<2>();
    }
    (y, mean.reshape([rows]), rstd.reshape([rows]))
}

/// Gradients of [`norm_forward`] given the output gradient `dy` and the saved `mean`, `rstd`.
///
/// # Returns
/// `(dx [rows, cols], dweight [cols], dbias [cols])` (`dbias` is zeros for RMSNorm).
pub fn norm_backward(
    dy: Tensor<2>,
    x: Tensor<2>,
    weight: Tensor<1>,
    mean: Tensor<1>,
    rstd: Tensor<1>,
    rms: bool,
) -> (Tensor<2>, Tensor<1>, Tensor<1>) {
    let [rows, cols] = x.dims();
    let mean = mean.reshape([rows, 1]);
    let rstd = rstd.reshape([rows, 1]);
    let xhat = (x - mean) * rstd.clone();
    let g = dy.clone() * weight.unsqueeze::<2>();
    let c2 = (g.clone() * xhat.clone()).mean_dim(1);
    let mut inner = g - xhat.clone() * c2;
    if !rms {
        inner = inner.clone() - inner.mean_dim(1);
    }
    let dx = inner * rstd;
    let dweight = (dy.clone() * xhat).sum_dim(0).reshape([cols]);
    let dbias = if rms {
        Tensor::<1>::zeros([cols], &dy.device())
    } else {
        dy.sum_dim(0).reshape([cols])
    };
    (dx, dweight, dbias)
}

/// `silu(a) * b`, element-wise.
pub fn swiglu_forward<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    a.clone() * sigmoid(a) * b
}

/// Gradients of [`swiglu_forward`]: `(da, db)`.
pub fn swiglu_backward<const D: usize>(
    dy: Tensor<D>,
    a: Tensor<D>,
    b: Tensor<D>,
) -> (Tensor<D>, Tensor<D>) {
    let s = sigmoid(a.clone());
    let silu = a.clone() * s.clone();
    let dsilu = s.clone() + silu.clone() * (s.neg() + 1.0);
    let da = dy.clone() * b * dsilu;
    let db = dy * silu;
    (da, db)
}

/// Rotary embedding (half-split form) of `x` `[n, seq, head_dim]` with tables `cos`, `sin`
/// `[seq, head_dim / 2]`: `[x1 cos - x2 sin, x2 cos + x1 sin]`. With `inverse` the rotation is
/// by the opposite angle, which is also the backward of the forward rotation.
pub fn rope(x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>, inverse: bool) -> Tensor<3> {
    let half = x.dims()[2] / 2;
    let sin = if inverse { sin.neg() } else { sin };
    let cos = cos.unsqueeze::<3>();
    let sin = sin.unsqueeze::<3>();
    let x1 = x.clone().narrow(2, 0, half);
    let x2 = x.narrow(2, half, half);
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x2 * cos + x1 * sin;
    Tensor::cat(vec![r1, r2], 2)
}

/// One AdamW step with Burn's semantics (`AdamWConfig`): decoupled weight decay
/// `p (1 - lr wd)`, bias-corrected moments, `eps` added to `sqrt(v_hat)`.
///
/// # Returns
/// `(param, m, v)` after the step; `m` and `v` keep their dtype (fp32 state), `param` keeps its.
pub fn adamw_step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    m: Tensor<D>,
    v: Tensor<D>,
    h: &AdamWHyper,
) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
    let pdtype = param.dtype();
    let sdtype = m.dtype();
    let grad = grad.cast(sdtype);
    let m = m * h.beta1 as f64 + grad.clone() * (1.0 - h.beta1 as f64);
    let v = v * h.beta2 as f64 + grad.square() * (1.0 - h.beta2 as f64);
    let (bc1, bc2) = h.bias_corrections();
    let update = (m.clone() / bc1 as f64) / ((v.clone() / bc2 as f64).sqrt() + h.eps as f64);
    let param = param.cast(sdtype) * (1.0 - h.lr * h.weight_decay as f64) - update * h.lr;
    (param.cast(pdtype), m, v)
}

/// Per-row partial softmax statistics of a (shard of) logits `[rows, vocab]`.
///
/// # Returns
/// `[rows, 2]`: the row maximum and `sum_j exp(x_j - max)`.
pub fn ce_stats(logits: Tensor<2>) -> Tensor<2> {
    let max = logits.clone().max_dim(1);
    let sum = (logits - max.clone()).exp().sum_dim(1);
    Tensor::cat(vec![max, sum], 1)
}

/// `(valid, in_shard, local_index)` masks of `targets` against a shard of `vocab` columns
/// starting at global id `vocab_start`.
fn target_masks(
    targets: Tensor<1, Int>,
    vocab: usize,
    vocab_start: usize,
    ignore_index: i64,
) -> (Tensor<1>, Tensor<1>, Tensor<1, Int>) {
    let valid = targets.clone().not_equal_elem(ignore_index);
    let local = targets - vocab_start as i64;
    let in_shard = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(vocab as i64))
        .bool_and(valid.clone());
    let index = local.clamp(0, vocab as i64 - 1);
    (valid.float(), in_shard.float(), index)
}

/// Per-row negative log-likelihood contribution of a shard: `lse - x[target]`, where the
/// `lse` term is counted only when `count_lse` (one shard of a vocabulary-parallel group) and
/// `x[target]` only when the target lies in this shard. Ignored rows give 0.
pub fn ce_nll(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    lse: Tensor<1>,
    vocab_start: usize,
    count_lse: bool,
    ignore_index: i64,
) -> Tensor<1> {
    let [rows, vocab] = logits.dims();
    let (valid, in_shard, index) = target_masks(targets, vocab, vocab_start, ignore_index);
    let picked = logits.gather(1, index.reshape([rows, 1])).reshape([rows]) * in_shard;
    if count_lse {
        lse * valid - picked
    } else {
        picked.neg()
    }
}

/// Gradient of the (global) cross-entropy with respect to a shard of logits:
/// `dnll * (exp(x - lse) - onehot(target))`, zero on ignored rows. Never materialises more
/// than the output itself in the fused kernel; here it is composed.
pub fn ce_backward(
    dnll: Tensor<1>,
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    lse: Tensor<1>,
    vocab_start: usize,
    ignore_index: i64,
) -> Tensor<2> {
    let [rows, vocab] = logits.dims();
    let device = logits.device();
    let (valid, _, _) = target_masks(targets.clone(), vocab, vocab_start, ignore_index);
    let probs = (logits - lse.reshape([rows, 1])).exp();
    let ids = Tensor::<1, Int>::arange(vocab_start as i64..(vocab_start + vocab) as i64, &device)
        .reshape([1, vocab])
        .expand([rows, vocab]);
    let onehot = ids
        .equal(targets.reshape([rows, 1]).expand([rows, vocab]))
        .float();
    (probs - onehot) * (dnll * valid).reshape([rows, 1])
}

/// Scaled (and masked) scores `[heads, tq, tk]`; hidden entries are `-inf`.
fn attention_scores(q: Tensor<3>, k: Tensor<3>, causal: bool, scale: f64) -> Tensor<3> {
    let [heads, tq, _] = q.dims();
    let tk = k.dims()[1];
    let device = q.device();
    let scores = q.matmul(k.swap_dims(1, 2)) * scale;
    if causal {
        let hidden = causal_mask(tk - tq..tk, 0..tk, &device)
            .unsqueeze::<3>()
            .expand([heads, tq, tk]);
        scores.mask_fill(hidden, f32::NEG_INFINITY)
    } else {
        scores
    }
}

/// Attention forward (the composed form of the blockwise kernel): `(out [heads, tq, dim],
/// lse [heads, tq])` for `q` `[heads, tq, dim]` and `k`, `v` `[heads, tk, dim]`.
pub fn attention_forward(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    causal: bool,
    scale: f64,
) -> (Tensor<3>, Tensor<2>) {
    let [heads, tq, _] = q.dims();
    let scores = attention_scores(q, k, causal, scale);
    let max = scores.clone().max_dim(2);
    let lse = (scores.clone() - max.clone()).exp().sum_dim(2).log() + max;
    let probs = (scores - lse.clone()).exp();
    (probs.matmul(v), lse.reshape([heads, tq]))
}

/// Gradients `(dq, dk, dv)` of [`attention_forward`] from its output and log-sum-exp.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dout: Tensor<3>,
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    out: Tensor<3>,
    lse: Tensor<2>,
    causal: bool,
    scale: f64,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let [heads, tq, _] = q.dims();
    let probs =
        (attention_scores(q.clone(), k.clone(), causal, scale) - lse.reshape([heads, tq, 1])).exp();
    let dv = probs.clone().swap_dims(1, 2).matmul(dout.clone());
    let dprobs = dout.clone().matmul(v.swap_dims(1, 2));
    let delta = (dout * out).sum_dim(2);
    let dscores = probs * (dprobs - delta) * scale;
    let dq = dscores.clone().matmul(k);
    let dk = dscores.swap_dims(1, 2).matmul(q);
    (dq, dk, dv)
}

/// [`attention_forward`] on `[batch, heads, rows, dim]` tensors (the fused kernels' contract):
/// `(out [batch, heads, tq, dim], lse [batch * heads, tq])`.
pub fn attention_forward_4d(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
    scale: f64,
) -> (Tensor<4>, Tensor<2>) {
    let dims = q.dims();
    let (out, lse) = attention_forward(flat(q), flat(k), flat(v), causal, scale);
    (out.reshape(dims), lse)
}

/// [`attention_backward`] on `[batch, heads, rows, dim]` tensors, `lse` `[batch * heads, tq]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_4d(
    dout: Tensor<4>,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    out: Tensor<4>,
    lse: Tensor<2>,
    causal: bool,
    scale: f64,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let (qd, kd) = (q.dims(), k.dims());
    let (dq, dk, dv) = attention_backward(
        flat(dout),
        flat(q),
        flat(k),
        flat(v),
        flat(out),
        lse,
        causal,
        scale,
    );
    (dq.reshape(qd), dk.reshape(kd), dv.reshape(kd))
}

/// `[batch, heads, rows, dim]` as `[batch * heads, rows, dim]`.
fn flat(t: Tensor<4>) -> Tensor<3> {
    let [b, h, r, d] = t.dims();
    t.reshape([b * h, r, d])
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_CUBIC: f64 = 0.044_715;

/// GELU: exact (`x/2 (1 + erf(x / sqrt 2))`) or the tanh approximation.
pub fn gelu_forward<const D: usize>(x: Tensor<D>, approximate: bool) -> Tensor<D> {
    if approximate {
        burn::tensor::activation::gelu_approximate(x)
    } else {
        burn::tensor::activation::gelu(x)
    }
}

/// `dy * gelu'(x)`.
pub fn gelu_backward<const D: usize>(dy: Tensor<D>, x: Tensor<D>, approximate: bool) -> Tensor<D> {
    let grad = if approximate {
        let cube = x.clone().powf_scalar(3.0) * GELU_CUBIC;
        let t = ((x.clone() + cube) * SQRT_2_OVER_PI).tanh();
        let slope = (x.clone().square() * (3.0 * GELU_CUBIC) + 1.0) * SQRT_2_OVER_PI;
        (t.clone() + 1.0) * 0.5 + x * (t.square().neg() + 1.0) * slope * 0.5
    } else {
        let cdf = ((x.clone() * std::f64::consts::FRAC_1_SQRT_2).erf() + 1.0) * 0.5;
        let pdf = (x.clone().square() * -0.5).exp()
            * (0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);
        cdf + x * pdf
    };
    dy * grad
}

/// `x [rows, k] w [k, n] (+ b [n] when has_bias)`.
pub fn linear_forward(x: Tensor<2>, w: Tensor<2>, b: Tensor<1>, has_bias: bool) -> Tensor<2> {
    let y = x.matmul(w);
    if has_bias { y + b.unsqueeze::<2>() } else { y }
}

/// `(dx, dw, db)` of [`linear_forward`] (`db` is zeros without a bias).
pub fn linear_backward(
    dy: Tensor<2>,
    x: Tensor<2>,
    w: Tensor<2>,
    has_bias: bool,
) -> (Tensor<2>, Tensor<2>, Tensor<1>) {
    let n = w.dims()[1];
    let dx = dy.clone().matmul(w.transpose());
    let dw = x.transpose().matmul(dy.clone());
    let db = if has_bias {
        dy.sum_dim(0).reshape([n])
    } else {
        Tensor::<1>::zeros([n], &dy.device())
    };
    (dx, dw, db)
}
