//! Fused training kernels: RMSNorm/LayerNorm, SwiGLU, rotary embedding, softmax
//! cross-entropy and AdamW, each with its backward.
//!
//! # Layers
//!
//! - [`FusedKernels`] is a Burn backend extension (`#[backend_extension]`) over primitive
//!   tensors. On CubeCL backends (feature `wgpu`: WGPU, and with it any CubeCL runtime Burn was
//!   built with) every method is one or two CubeCL kernels (`cube` module); on `flex` it runs
//!   the composed [`reference`](mod@reference) built from Burn tensor operations. Its `Autodiff<B, C>`
//!   implementation records hand-written backward steps that call the backward methods of
//!   the inner backend, so gradients are fused too.
//! - The functions of this module ([`rms_norm`], [`layer_norm`], [`swiglu`], [`rope`],
//!   [`cross_entropy`], [`adamw_step`]) take ordinary
//!   `Tensor`s of any rank, validate them and return typed [`KernelError`]s.
//!
//! # Memory of the cross-entropy
//!
//! The forward computes per-row `(max, sum exp)` in one pass over the logits and keeps only
//! the row log-sum-exp (`[rows]`) for backward; the backward recomputes `softmax - onehot`
//! from the logits in one pass. The `tokens x vocab` probability (or log-probability) matrix
//! that `log_softmax` + `gather` keeps for backward is never stored.
//!
//! # Vocabulary parallelism
//!
//! The cross-entropy of vocabulary-sharded logits is
//! [`crate::tensor_parallel::vocab_parallel_cross_entropy`] (what the `nn` output layers use):
//! one implementation, with padding, label smoothing and collectives on the device.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{AutodiffBackend, Dispatch, Flex, backend_extension};
use burn::tensor::{DType, Int, Tensor, TensorData};

pub mod cpu;
#[cfg(feature = "cube")]
pub mod cube;
pub mod reference;

pub use reference::{AdamWHyper, causal_mask};

/// What can go wrong when calling a fused kernel.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KernelError {
    /// Shapes that do not fit together.
    #[error("{op}: {reason}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What did not fit, with the shapes.
        reason: String,
    },
    /// Tensors of different dtypes where the kernel needs one (or an unsupported dtype).
    #[error("{op}: {reason}")]
    DType {
        /// The operation.
        op: &'static str,
        /// The dtypes involved.
        reason: String,
    },
    /// An invalid scalar argument (epsilon, betas, learning rate, ...).
    #[error("{op}: invalid argument: {reason}")]
    Argument {
        /// The operation.
        op: &'static str,
        /// Which argument and why.
        reason: String,
    },
    /// No WGPU adapter could be initialised.
    #[error("no WGPU adapter: {0}")]
    NoAdapter(String),
}

/// Result of the fused-kernel functions.
pub type KernelResult<T> = std::result::Result<T, KernelError>;

// `AdamWHyper` itself is the reference's (`reference.rs`, below this module); its check,
// which reports a `KernelError`, is here.
impl AdamWHyper {
    /// Checks the hyper-parameters as [`adamw_step`] does.
    ///
    /// # Errors
    /// [`KernelError::Argument`] for step 0, betas outside `[0, 1)`, a non-positive epsilon or
    /// a learning rate or weight decay that is not finite.
    pub fn validate(&self) -> KernelResult<()> {
        let bad = |reason: String| {
            Err(KernelError::Argument {
                op: "adamw_step",
                reason,
            })
        };
        if self.step == 0 {
            return bad("step is 1-based, got 0".into());
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad(format!(
                "betas must be in [0, 1), got ({}, {})",
                self.beta1, self.beta2
            ));
        }
        if self.eps.is_nan()
            || self.eps <= 0.0
            || !self.lr.is_finite()
            || !self.weight_decay.is_finite()
        {
            return bad(format!("{self:?}"));
        }
        Ok(())
    }
}

/// The backend extension of the fused kernels, over primitive tensors.
///
/// Layout conventions (the public functions of [`kernels`](self) reshape into them): norms on
/// `[rows, cols]` with `[cols]` parameters and `[rows]` statistics; SwiGLU element-wise on any
/// shape; RoPE on `[n, seq, head_dim]` with `[seq, head_dim / 2]` tables; AdamW on flat
/// tensors; cross-entropy on `[rows, vocab]` logits with `[rows]` targets.
#[backend_extension(Flex, Autodiff, Cube: cfg(feature = "cube"))]
pub trait FusedKernels: burn::backend::Backend {
    /// LayerNorm (`rms == false`) or RMSNorm forward, one pass over each row for the
    /// statistics. Returns `(y, mean, rstd)` (`mean` is zeros for RMSNorm; the bias is ignored).
    fn fused_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Norm backward: `(dx, dweight, dbias)`; the parameter gradients are reduced across rows
    /// deterministically (per-block partial sums, then a sum), without atomics.
    fn fused_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// `silu(a) * b`.
    fn fused_swiglu_forward(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Gradients `(da, db)` of `silu(a) * b`.
    fn fused_swiglu_backward(
        dy: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Rotary embedding of `x` `[n, seq, head_dim]`; `inverse` rotates by the opposite angle
    /// (the backward).
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self>;

    /// One AdamW step over flat `param` (fp32 or bf16/f16), `grad` (param's dtype) and fp32
    /// moments `m`, `v`. Returns the updated `(param, m, v)`.
    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Attention over `batch x heads` independent problems: `q` `[batch, heads, tq, dim]`,
    /// `k`, `v` `[batch, heads, tk, dim]` (any strides: a `[batch, seq, heads, dim]` tensor
    /// seen through `swap_dims(1, 2)` may be read in place), scores scaled by `scale`, causal
    /// (query `i` sees keys `0..=i + tk - tq`) when `causal`. Returns
    /// `(out [batch, heads, tq, dim], lse [batch * heads, tq])`, the row log-sum-exp of the
    /// scaled scores being all the backward keeps.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Attention backward `(dq, dk, dv)` (the shapes of `q`, `k`, `v`) from the forward's
    /// output and log-sum-exp.
    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        dout: FloatTensor<Self>,
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// A linear layer `x [rows, k] w [k, n] (+ b [n] when has_bias)`.
    fn fused_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        has_bias: bool,
    ) -> FloatTensor<Self>;

    /// `(dx, dw, db)` of a linear layer (`db` zeros without a bias).
    fn fused_linear_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        has_bias: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// GELU, exact (`erf`) or, with `approximate`, GPT-2's tanh form.
    fn fused_gelu_forward(x: FloatTensor<Self>, approximate: bool) -> FloatTensor<Self>;

    /// `dy * gelu'(x)`.
    fn fused_gelu_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        approximate: bool,
    ) -> FloatTensor<Self>;

    /// Per-row partial softmax statistics `[rows, 2]` (max, sum of `exp(x - max)`).
    fn fused_ce_stats(logits: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Per-row NLL contribution of a vocabulary shard (see [`reference::ce_nll`]).
    fn fused_ce_nll(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        count_lse: bool,
        ignore_index: i64,
    ) -> FloatTensor<Self>;

    /// Gradient of the cross-entropy with respect to a shard of logits
    /// (see [`reference::ce_backward`]).
    fn fused_ce_backward(
        dnll: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        ignore_index: i64,
    ) -> FloatTensor<Self>;
}

// ---------------------------------------------------------------------------------------------
// Flex: the CPU kernels of `cpu` for fp32, the composed reference for other dtypes.

fn fx<const D: usize>(t: FloatTensor<Flex>) -> Tensor<D> {
    Tensor::from_primitive::<Flex>(t)
}

fn fi(t: IntTensor<Flex>) -> Tensor<1, Int> {
    Tensor::from_primitive::<Flex>(t)
}

fn fp<const D: usize>(t: Tensor<D>) -> FloatTensor<Flex> {
    t.try_into_primitive::<Flex>()
        .expect("a reference on flex tensors stays on flex")
}

/// `t` as a contiguous fp32 Flex tensor, or `None` when it is not fp32 (the reference runs).
fn f32_flex(t: &FlexTensor) -> Option<FlexTensor> {
    if t.dtype() != DType::F32 {
        return None;
    }
    Some(match t.as_slice::<f32>() {
        Some(_) => t.clone(),
        None => t.to_contiguous(),
    })
}

/// All of `ts` as contiguous fp32 Flex tensors, or `None` when one is not fp32.
fn all_f32<const N: usize>(ts: [&FlexTensor; N]) -> Option<[FlexTensor; N]> {
    let mut out = Vec::with_capacity(N);
    for t in ts {
        out.push(f32_flex(t)?);
    }
    out.try_into().ok()
}

/// The values of a contiguous fp32 Flex tensor (see [`f32_flex`]).
fn vals(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("f32_flex returns contiguous fp32 tensors")
}

fn dims_of(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

fn flex_from(values: Vec<f32>, dims: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, dims))
}

fn last_dim(t: &FlexTensor) -> usize {
    dims_of(t).last().copied().unwrap_or(1).max(1)
}

fn flex_targets(t: IntTensor<Flex>) -> Vec<i64> {
    fi(t)
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("targets converted to i64")
}

fn attention_shape(
    q: &FlexTensor,
    k: &FlexTensor,
    causal: bool,
    scale: f64,
) -> cpu::AttentionShape {
    let (qd, kd) = (dims_of(q), dims_of(k));
    cpu::AttentionShape {
        batch: qd[0],
        heads: qd[1],
        tq: qd[2],
        tk: kd[2],
        dim: qd[3],
        causal,
        scale: scale as f32,
    }
}

/// An fp32 attention operand `[batch, heads, rows, dim]` and where its heads lie in its
/// storage: read in place when its columns are contiguous and its strides positive (the
/// `swap_dims(1, 2)` view of a `[batch, rows, heads, dim]` tensor is), made contiguous
/// otherwise. `None` when it is not fp32 (the reference runs).
fn heads_of(t: &FlexTensor) -> Option<(FlexTensor, cpu::HeadLayout)> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let layout = t.layout();
    if let [b, h, r, 1] = *layout.strides()
        && b >= 0
        && h >= 0
        && r >= 0
    {
        let heads = cpu::HeadLayout {
            offset: layout.start_offset(),
            batch: b as usize,
            head: h as usize,
            row: r as usize,
        };
        return Some((t.clone(), heads));
    }
    let dims = dims_of(t);
    let heads = cpu::HeadLayout::heads_major(dims[1], dims[2], dims[3]);
    Some((t.to_contiguous(), heads))
}

/// Whether the attention operand `t` (`[batch, heads, rows, dim]`) is the `swap_dims(1, 2)`
/// view of a contiguous `[batch, rows, heads, dim]` tensor: then the kernels write its
/// gradient (and `q`'s output) in that layout too, so that the caller's swap back is free.
fn is_rows_major(t: &FlexTensor, heads: cpu::HeadLayout) -> bool {
    let dims = dims_of(t);
    heads == cpu::HeadLayout::rows_major(dims[1], dims[2], dims[3])
}

/// `q`, `k`, `v` as [`heads_of`] reads them, and whether all three are rows-major (then the
/// kernels write their outputs rows-major too); `None` when one is not fp32.
fn qkv_heads(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
) -> Option<([(FlexTensor, cpu::HeadLayout); 3], bool)> {
    let operands = [heads_of(q)?, heads_of(k)?, heads_of(v)?];
    let rows_major = operands.iter().all(|(t, l)| is_rows_major(t, *l));
    Some((operands, rows_major))
}

/// A kernel output in the layout [`is_rows_major`] chose: `values` holds `[batch, rows,
/// heads, dim]` (returned as its `[batch, heads, rows, dim]` view) when `rows_major`, else
/// `[batch, heads, rows, dim]`.
fn heads_output(values: Vec<f32>, dims: Vec<usize>, rows_major: bool) -> FlexTensor {
    if rows_major {
        flex_from(values, vec![dims[0], dims[2], dims[1], dims[3]]).transpose(1, 2)
    } else {
        flex_from(values, dims)
    }
}

impl FusedKernels for Flex {
    fn fused_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([xc, wc, bc]) = all_f32([&x, &weight, &bias]) {
            let (dims, cols) = (dims_of(&x), last_dim(&x));
            let (y, mean, rstd) =
                cpu::norm_forward(vals(&xc), cols, vals(&wc), vals(&bc), eps, rms);
            let rows = mean.len();
            return (
                flex_from(y, dims),
                flex_from(mean, vec![rows]),
                flex_from(rstd, vec![rows]),
            );
        }
        let (y, mean, rstd) = reference::norm_forward(fx(x), fx(weight), fx(bias), eps, rms);
        (fp(y), fp(mean), fp(rstd))
    }

    fn fused_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([dyc, xc, wc, mc, rc]) = all_f32([&dy, &x, &weight, &mean, &rstd]) {
            let (dims, cols) = (dims_of(&x), last_dim(&x));
            let (dx, dw, db) = cpu::norm_backward(
                vals(&dyc),
                vals(&xc),
                cols,
                vals(&wc),
                vals(&mc),
                vals(&rc),
                rms,
            );
            return (
                flex_from(dx, dims),
                flex_from(dw, vec![cols]),
                flex_from(db, vec![cols]),
            );
        }
        let (dx, dw, db) =
            reference::norm_backward(fx(dy), fx(x), fx(weight), fx(mean), fx(rstd), rms);
        (fp(dx), fp(dw), fp(db))
    }

    fn fused_swiglu_forward(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        if let Some([ac, bc]) = all_f32([&a, &b]) {
            return flex_from(cpu::swiglu_forward(vals(&ac), vals(&bc)), dims_of(&a));
        }
        fp(reference::swiglu_forward::<1>(fx(a), fx(b)))
    }

    fn fused_swiglu_backward(
        dy: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([dyc, ac, bc]) = all_f32([&dy, &a, &b]) {
            let (da, db) = cpu::swiglu_backward(vals(&dyc), vals(&ac), vals(&bc));
            return (flex_from(da, dims_of(&a)), flex_from(db, dims_of(&a)));
        }
        let (da, db) = reference::swiglu_backward::<1>(fx(dy), fx(a), fx(b));
        (fp(da), fp(db))
    }

    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        fp(reference::rope(fx(x), fx(cos), fx(sin), inverse))
    }

    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([pc, gc, mc, vc]) = all_f32([&param, &grad, &m, &v]) {
            let dims = dims_of(&param);
            let (mut p, mut m, mut v) =
                (vals(&pc).to_vec(), vals(&mc).to_vec(), vals(&vc).to_vec());
            cpu::adamw_step(&mut p, vals(&gc), &mut m, &mut v, &hyper);
            return (
                flex_from(p, dims.clone()),
                flex_from(m, dims.clone()),
                flex_from(v, dims),
            );
        }
        let (p, m, v) = reference::adamw_step::<1>(fx(param), fx(grad), fx(m), fx(v), &hyper);
        (fp(p), fp(m), fp(v))
    }

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if let Some(([(qc, ql), (kc, kl), (vc, vl)], rows_major)) = qkv_heads(&q, &k, &v) {
            let shape = attention_shape(&q, &k, causal, scale);
            let (out, lse) = cpu::attention_forward(
                (qc.storage(), ql),
                (kc.storage(), kl),
                (vc.storage(), vl),
                rows_major,
                shape,
            );
            return (
                heads_output(out, dims_of(&q), rows_major),
                flex_from(lse, vec![shape.batch * shape.heads, shape.tq]),
            );
        }
        let (out, lse) = reference::attention_forward_4d(fx(q), fx(k), fx(v), causal, scale);
        (fp(out), fp(lse))
    }

    fn fused_attention_backward(
        dout: FloatTensor<Self>,
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if let (Some(([(qc, ql), (kc, kl), (vc, vl)], rows_major)), Some((dc, dl)), Some((oc, ol))) =
            (qkv_heads(&q, &k, &v), heads_of(&dout), heads_of(&out))
            && let Some([lc]) = all_f32([&lse])
        {
            let shape = attention_shape(&q, &k, causal, scale);
            let (dq, dk, dv) = cpu::attention_backward(
                (dc.storage(), dl),
                (qc.storage(), ql),
                (kc.storage(), kl),
                (vc.storage(), vl),
                (oc.storage(), ol),
                vals(&lc),
                rows_major,
                shape,
            );
            return (
                heads_output(dq, dims_of(&q), rows_major),
                heads_output(dk, dims_of(&k), rows_major),
                heads_output(dv, dims_of(&v), rows_major),
            );
        }
        let (dq, dk, dv) = reference::attention_backward_4d(
            fx(dout),
            fx(q),
            fx(k),
            fx(v),
            fx(out),
            fx(lse),
            causal,
            scale,
        );
        (fp(dq), fp(dk), fp(dv))
    }

    fn fused_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        has_bias: bool,
    ) -> FloatTensor<Self> {
        if let Some([xc, wc, bc]) = all_f32([&x, &w, &b]) {
            let (wd, rows) = (dims_of(&w), dims_of(&x)[0]);
            let bias = has_bias.then(|| vals(&bc));
            let y = cpu::linear_forward(vals(&xc), vals(&wc), bias, wd[0], wd[1]);
            return flex_from(y, vec![rows, wd[1]]);
        }
        fp(reference::linear_forward(fx(x), fx(w), fx(b), has_bias))
    }

    fn fused_linear_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        has_bias: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if let Some([dyc, xc, wc]) = all_f32([&dy, &x, &w]) {
            let wd = dims_of(&w);
            let (dx, dw, mut db) =
                cpu::linear_backward(vals(&dyc), vals(&xc), vals(&wc), wd[0], wd[1]);
            if !has_bias {
                db.fill(0.0);
            }
            return (
                flex_from(dx, dims_of(&x)),
                flex_from(dw, wd.clone()),
                flex_from(db, vec![wd[1]]),
            );
        }
        let (dx, dw, db) = reference::linear_backward(fx(dy), fx(x), fx(w), has_bias);
        (fp(dx), fp(dw), fp(db))
    }

    fn fused_gelu_forward(x: FloatTensor<Self>, approximate: bool) -> FloatTensor<Self> {
        if let Some([xc]) = all_f32([&x]) {
            return flex_from(cpu::gelu_forward(vals(&xc), approximate), dims_of(&x));
        }
        fp(reference::gelu_forward::<1>(fx(x), approximate))
    }

    fn fused_gelu_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        approximate: bool,
    ) -> FloatTensor<Self> {
        if let Some([dyc, xc]) = all_f32([&dy, &x]) {
            return flex_from(
                cpu::gelu_backward(vals(&dyc), vals(&xc), approximate),
                dims_of(&x),
            );
        }
        fp(reference::gelu_backward::<1>(fx(dy), fx(x), approximate))
    }

    fn fused_ce_stats(logits: FloatTensor<Self>) -> FloatTensor<Self> {
        if let Some([lc]) = all_f32([&logits]) {
            let vocab = last_dim(&logits);
            let stats = cpu::ce_stats(vals(&lc), vocab);
            let rows = stats.len() / 2;
            return flex_from(stats, vec![rows, 2]);
        }
        fp(reference::ce_stats(fx(logits)))
    }

    fn fused_ce_nll(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        count_lse: bool,
        ignore_index: i64,
    ) -> FloatTensor<Self> {
        if let Some([lc, sc]) = all_f32([&logits, &lse]) {
            let vocab = last_dim(&logits);
            let targets = flex_targets(targets);
            let rows = targets.len();
            let nll = cpu::ce_nll(
                vals(&lc),
                vocab,
                &targets,
                vals(&sc),
                vocab_start,
                count_lse,
                ignore_index,
            );
            return flex_from(nll, vec![rows]);
        }
        fp(reference::ce_nll(
            fx(logits),
            fi(targets),
            fx(lse),
            vocab_start,
            count_lse,
            ignore_index,
        ))
    }

    fn fused_ce_backward(
        dnll: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        ignore_index: i64,
    ) -> FloatTensor<Self> {
        if let Some([dc, lc, sc]) = all_f32([&dnll, &logits, &lse]) {
            let vocab = last_dim(&logits);
            let targets = flex_targets(targets);
            let grad = cpu::ce_backward(
                vals(&dc),
                vals(&lc),
                vocab,
                &targets,
                vals(&sc),
                vocab_start,
                ignore_index,
            );
            return flex_from(grad, dims_of(&logits));
        }
        fp(reference::ce_backward(
            fx(dnll),
            fx(logits),
            fi(targets),
            fx(lse),
            vocab_start,
            ignore_index,
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Autodiff: hand-written backward steps calling the inner backend's backward kernels.

#[derive(Debug)]
struct NormBackward;

impl<B: FusedKernels> Backward<B, 3> for NormBackward {
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        bool,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, mean, rstd, rms) = ops.state;
        let (dx, dw, db) = B::fused_norm_backward(dy, x, w, mean, rstd, rms);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw);
        }
        if let Some(node) = node_b {
            grads.register::<B>(node.id, db);
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: FusedKernels> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_a, node_b] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let (da, db) = B::fused_swiglu_backward(dy, a, b);
        if let Some(node) = node_a {
            grads.register::<B>(node.id, da);
        }
        if let Some(node) = node_b {
            grads.register::<B>(node.id, db);
        }
    }
}

#[derive(Debug)]
struct RopeBackward;

impl<B: FusedKernels> Backward<B, 1> for RopeBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (cos, sin, inverse) = ops.state;
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::fused_rope(dy, cos, sin, !inverse));
        }
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: FusedKernels> Backward<B, 1> for CrossEntropyBackward {
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>, usize, i64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let dnll = grads.consume::<B>(&ops.node);
        let (logits, targets, lse, vocab_start, ignore_index) = ops.state;
        if let Some(node) = node_logits {
            let dlogits =
                B::fused_ce_backward(dnll, logits, targets, lse, vocab_start, ignore_index);
            grads.register::<B>(node.id, dlogits);
        }
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: FusedKernels> Backward<B, 3> for AttentionBackward {
    #[allow(clippy::type_complexity)]
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        bool,
        f64,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, causal, scale) = ops.state;
        let (dq, dk, dv) = B::fused_attention_backward(dout, q, k, v, out, lse, causal, scale);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct LinearBackward;

impl<B: FusedKernels> Backward<B, 3> for LinearBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, has_bias) = ops.state;
        let (dx, dw, db) = B::fused_linear_backward(dy, x, w, has_bias);
        for (node, grad) in [(node_x, dx), (node_w, dw), (node_b, db)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct GeluBackward;

impl<B: FusedKernels> Backward<B, 1> for GeluBackward {
    type State = (FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, approximate) = ops.state;
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::fused_gelu_backward(dy, x, approximate));
        }
    }
}

/// A result of the inner backend as an untracked autodiff tensor.
fn untracked<B: FusedKernels, C: CheckpointStrategy>(
    t: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    Autodiff::<B, C>::from_inner(t)
}

impl<B: FusedKernels, C: CheckpointStrategy> FusedKernels for Autodiff<B, C> {
    fn fused_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [x.node(), weight.node(), bias.node()];
        let (xp, wp, bp) = (
            x.into_primitive(),
            weight.into_primitive(),
            bias.into_primitive(),
        );
        let (y, mean, rstd) = B::fused_norm_forward(xp.clone(), wp.clone(), bp, eps, rms);
        let y = match NormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((xp, wp, mean.clone(), rstd.clone(), rms), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        (y, untracked::<B, C>(mean), untracked::<B, C>(rstd))
    }

    fn fused_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw, db) = B::fused_norm_backward(
            dy.into_primitive(),
            x.into_primitive(),
            weight.into_primitive(),
            mean.into_primitive(),
            rstd.into_primitive(),
            rms,
        );
        (
            untracked::<B, C>(dx),
            untracked::<B, C>(dw),
            untracked::<B, C>(db),
        )
    }

    fn fused_swiglu_forward(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [a.node(), b.node()];
        let (ap, bp) = (a.into_primitive(), b.into_primitive());
        let y = B::fused_swiglu_forward(ap.clone(), bp.clone());
        match SwigluBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((ap, bp), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_swiglu_backward(
        dy: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (da, db) =
            B::fused_swiglu_backward(dy.into_primitive(), a.into_primitive(), b.into_primitive());
        (untracked::<B, C>(da), untracked::<B, C>(db))
    }

    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        let nodes = [x.node()];
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        let y = B::fused_rope(x.into_primitive(), cos.clone(), sin.clone(), inverse);
        match RopeBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((cos, sin, inverse), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, m, v) = B::fused_adamw_step(
            param.into_primitive(),
            grad.into_primitive(),
            m.into_primitive(),
            v.into_primitive(),
            hyper,
        );
        (
            untracked::<B, C>(p),
            untracked::<B, C>(m),
            untracked::<B, C>(v),
        )
    }

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [q.node(), k.node(), v.node()];
        let (qp, kp, vp) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let (out, lse) =
            B::fused_attention_forward(qp.clone(), kp.clone(), vp.clone(), causal, scale);
        let y = match AttentionBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (qp, kp, vp, out.clone(), lse.clone(), causal, scale);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (y, untracked::<B, C>(lse))
    }

    fn fused_attention_backward(
        dout: FloatTensor<Self>,
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::fused_attention_backward(
            dout.into_primitive(),
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            out.into_primitive(),
            lse.into_primitive(),
            causal,
            scale,
        );
        (
            untracked::<B, C>(dq),
            untracked::<B, C>(dk),
            untracked::<B, C>(dv),
        )
    }

    fn fused_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        has_bias: bool,
    ) -> FloatTensor<Self> {
        // Without a bias, `b` is an untracked placeholder: it gets no gradient.
        let nodes = [x.node(), w.node(), b.node()];
        let (xp, wp, bp) = (x.into_primitive(), w.into_primitive(), b.into_primitive());
        let y = B::fused_linear_forward(xp.clone(), wp.clone(), bp, has_bias);
        match LinearBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xp, wp, has_bias), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_linear_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        has_bias: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw, db) = B::fused_linear_backward(
            dy.into_primitive(),
            x.into_primitive(),
            w.into_primitive(),
            has_bias,
        );
        (
            untracked::<B, C>(dx),
            untracked::<B, C>(dw),
            untracked::<B, C>(db),
        )
    }

    fn fused_gelu_forward(x: FloatTensor<Self>, approximate: bool) -> FloatTensor<Self> {
        let nodes = [x.node()];
        let xp = x.into_primitive();
        let y = B::fused_gelu_forward(xp.clone(), approximate);
        match GeluBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((xp, approximate), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_gelu_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        approximate: bool,
    ) -> FloatTensor<Self> {
        untracked::<B, C>(B::fused_gelu_backward(
            dy.into_primitive(),
            x.into_primitive(),
            approximate,
        ))
    }

    fn fused_ce_stats(logits: FloatTensor<Self>) -> FloatTensor<Self> {
        untracked::<B, C>(B::fused_ce_stats(logits.into_primitive()))
    }

    fn fused_ce_nll(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        count_lse: bool,
        ignore_index: i64,
    ) -> FloatTensor<Self> {
        let nodes = [logits.node()];
        let (lp, lse) = (logits.into_primitive(), lse.into_primitive());
        let y = B::fused_ce_nll(
            lp.clone(),
            targets.clone(),
            lse.clone(),
            vocab_start,
            count_lse,
            ignore_index,
        );
        match CrossEntropyBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((lp, targets, lse, vocab_start, ignore_index), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_ce_backward(
        dnll: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        ignore_index: i64,
    ) -> FloatTensor<Self> {
        untracked::<B, C>(B::fused_ce_backward(
            dnll.into_primitive(),
            logits.into_primitive(),
            targets,
            lse.into_primitive(),
            vocab_start,
            ignore_index,
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Public tensor-level API.

fn same_dtype(op: &'static str, tensors: &[(&str, DType)]) -> KernelResult<()> {
    let (first_name, first) = tensors[0];
    for (name, dtype) in &tensors[1..] {
        if *dtype != first {
            return Err(KernelError::DType {
                op,
                reason: format!("{first_name} is {first:?} but {name} is {dtype:?}"),
            });
        }
    }
    Ok(())
}

fn check_eps(op: &'static str, eps: f64) -> KernelResult<()> {
    if eps > 0.0 && eps.is_finite() {
        Ok(())
    } else {
        Err(KernelError::Argument {
            op,
            reason: format!("eps must be positive and finite, got {eps}"),
        })
    }
}

fn norm<const D: usize>(
    op: &'static str,
    x: Tensor<D>,
    weight: Tensor<1>,
    bias: Option<Tensor<1>>,
    eps: f64,
    rms: bool,
) -> KernelResult<Tensor<D>> {
    check_eps(op, eps)?;
    let dims = x.dims();
    let cols = *dims.last().ok_or(KernelError::Shape {
        op,
        reason: "a rank-0 input has no row to normalise".into(),
    })?;
    let [w] = weight.dims();
    let b = bias.as_ref().map(|b| b.dims()[0]).unwrap_or(w);
    if w != cols || b != cols || cols == 0 {
        return Err(KernelError::Shape {
            op,
            reason: format!("input {dims:?} needs weight/bias of [{cols}], got [{w}] / [{b}]"),
        });
    }
    let mut dtypes = vec![("x", x.dtype()), ("weight", weight.dtype())];
    if let Some(b) = &bias {
        dtypes.push(("bias", b.dtype()));
    }
    same_dtype(op, &dtypes)?;
    let rows = x.shape().num_elements() / cols;
    // RMSNorm has no bias: pass the (detached) weight, which the kernel ignores.
    let bias = bias.unwrap_or_else(|| weight.clone().detach());
    let (y, _, _) = Dispatch::fused_norm_forward(
        x.reshape([rows, cols]).into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        eps,
        rms,
    );
    Ok(Tensor::<2>::from_dispatch(y).reshape(dims))
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * weight`, fused (one kernel
/// forward, two backward) on CubeCL backends.
///
/// # Errors
/// [`KernelError::Shape`] when `weight` is not `[x.dims()[D - 1]]`; [`KernelError::DType`]
/// when dtypes differ; [`KernelError::Argument`] for a non-positive `eps`.
pub fn rms_norm<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    eps: f64,
) -> KernelResult<Tensor<D>> {
    norm("rms_norm", x, weight, None, eps, true)
}

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`, fused.
///
/// # Errors
/// As [`rms_norm`], also for a bias of the wrong shape or dtype.
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> KernelResult<Tensor<D>> {
    match bias {
        Some(bias) => norm("layer_norm", x, weight, Some(bias), eps, false),
        None => {
            let zeros = Tensor::<1>::zeros(weight.dims(), &weight.device()).cast(weight.dtype());
            norm("layer_norm", x, weight, Some(zeros), eps, false)
        }
    }
}

/// SwiGLU's gating `silu(a) * b`, element-wise, fused forward and backward.
///
/// # Errors
/// [`KernelError::Shape`] / [`KernelError::DType`] when `a` and `b` differ in shape or dtype.
pub fn swiglu<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> KernelResult<Tensor<D>> {
    let dims = a.dims();
    if dims != b.dims() {
        return Err(KernelError::Shape {
            op: "swiglu",
            reason: format!("a is {dims:?} but b is {:?}", b.dims()),
        });
    }
    same_dtype("swiglu", &[("a", a.dtype()), ("b", b.dtype())])?;
    let n = a.shape().num_elements();
    let y = Dispatch::fused_swiglu_forward(
        a.reshape([n]).into_dispatch(),
        b.reshape([n]).into_dispatch(),
    );
    Ok(Tensor::<1>::from_dispatch(y).reshape(dims))
}

/// Whether `BURN_PARALLEL_COMPOSED` (a comma-separated list of `attention`, `norm`, `linear`,
/// `gelu`, `adamw`) asks for Burn's composed operations instead of our kernel for `op`: for
/// comparisons and bisecting, read once. `linear` and `gelu` take Burn's own operations and
/// autodiff on every backend, `adamw` Burn's AdamW inside `FusedAdamW`; `attention` and `norm` take the composed reference inside the CubeCL
/// kernels' place. Unset: every kernel of ours runs. (The cross-entropy has no such switch:
/// the composed reference's ignore-index masking does not run on WGPU's 32-bit integers.)
pub(crate) fn composed(op: &str) -> bool {
    static LIST: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    LIST.get_or_init(|| {
        let list = std::env::var("BURN_PARALLEL_COMPOSED").unwrap_or_default();
        list.split(',').map(|s| s.trim().to_string()).collect()
    })
    .iter()
    .any(|s| s == op)
}

static TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets fp32 matrix products of [`linear`] run in TF32 (10-bit mantissa inputs, fp32
/// accumulation) where the device has it: on CUDA, cuBLASLt's `CUBLAS_COMPUTE_32F_FAST_TF32`,
/// several times faster than exact fp32 on Ampere and later. Off by default, as PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32`; bf16 and fp16 products are not affected, and
/// neither is Flex (exact fp32 always). Process-wide; takes effect at the next product.
///
/// ```
/// use burn_parallel::kernels::{allow_tf32, tf32_allowed};
/// allow_tf32(true);
/// assert!(tf32_allowed());
/// allow_tf32(false);
/// ```
pub fn allow_tf32(allow: bool) {
    TF32.store(allow, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`allow_tf32`] turned TF32 products on.
pub fn tf32_allowed() -> bool {
    TF32.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `device`'s backend implements [`FusedKernels`] in this build: Flex, and the CubeCL
/// backends with the `wgpu`/`cuda`/`cpu` features (autodiff or not). [`linear`], [`attention`]
/// and [`gelu`] run as Burn's composed operations elsewhere (NdArray, for instance).
///
/// ```
/// use burn::tensor::Device;
/// assert!(burn_parallel::kernels::supported(&Device::flex().autodiff()));
/// ```
pub fn supported(device: &burn::tensor::Device) -> bool {
    use burn::backend::DispatchDevice;
    #[allow(unreachable_patterns)]
    match device.as_dispatch().clone().inner() {
        DispatchDevice::Flex(_) => true,
        #[cfg(feature = "cube")]
        DispatchDevice::Cube(_) => true,
        _ => false,
    }
}

/// GELU, element-wise, fused forward and backward: exact (`x/2 (1 + erf(x / sqrt 2))`, Burn's
/// `gelu`) or, with `approximate`, GPT-2's tanh form (Burn's `gelu_approximate`). On Flex the
/// forward is one pass and the backward one pass, where the composed form runs a dozen.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::kernels::gelu;
///
/// let x = Tensor::<2>::from_floats([[-1.0, 0.0, 2.0]], &Device::flex());
/// let y = gelu(x.clone(), false);
/// let expected = burn::tensor::activation::gelu(x);
/// y.into_data().assert_approx_eq::<f32>(&expected.into_data(), Default::default());
/// ```
pub fn gelu<const D: usize>(x: Tensor<D>, approximate: bool) -> Tensor<D> {
    if !supported(&x.device()) || composed("gelu") {
        return reference::gelu_forward(x, approximate);
    }
    let dims = x.dims();
    let n = x.shape().num_elements();
    let y = Dispatch::fused_gelu_forward(x.reshape([n]).into_dispatch(), approximate);
    Tensor::<1>::from_dispatch(y).reshape(dims)
}

/// A linear layer `x w (+ b)` over the last dimension of `x` (`w` `[in, out]`, Burn's
/// layout), fused: on Flex (fp32) the bias is written first and the product accumulated onto
/// it, and the backward's `dy w^T` and `x^T dy` read the transposes as strides, with no copy,
/// zeroing or separate bias pass; the products use the rank's intra-op threads
/// ([`crate::threads`]). Elsewhere it is Burn's `linear`.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::kernels::linear;
///
/// let device = Device::flex();
/// let x = Tensor::<3>::ones([2, 3, 4], &device);
/// let w = Tensor::<2>::ones([4, 5], &device);
/// let y = linear(x, w, Some(Tensor::<1>::ones([5], &device))).unwrap();
/// assert_eq!(y.dims(), [2, 3, 5]);
/// assert_eq!(y.into_data().to_vec::<f32>().unwrap()[0], 5.0);
/// ```
///
/// # Errors
/// [`KernelError::Shape`] when `x`'s last dimension is not `w`'s first, or the bias is not
/// `[out]`; [`KernelError::DType`] when dtypes differ.
pub fn linear<const D: usize>(
    x: Tensor<D>,
    w: Tensor<2>,
    b: Option<Tensor<1>>,
) -> KernelResult<Tensor<D>> {
    let op = "linear";
    let dims = x.dims();
    let [k, n] = w.dims();
    let bias_ok = b.as_ref().is_none_or(|b| b.dims() == [n]);
    if dims[D - 1] != k || !bias_ok {
        return Err(KernelError::Shape {
            op,
            reason: format!(
                "input {dims:?} and weight [{k}, {n}] need the input's last dimension {k} and a \
                 bias of [{n}], got bias {:?}",
                b.as_ref().map(|b| b.dims())
            ),
        });
    }
    let mut dtypes = vec![("x", x.dtype()), ("weight", w.dtype())];
    if let Some(b) = &b {
        dtypes.push(("bias", b.dtype()));
    }
    same_dtype(op, &dtypes)?;
    if !supported(&x.device()) || composed("linear") {
        return Ok(burn::tensor::module::linear(x, w, b));
    }
    let rows = dims[..D - 1].iter().product::<usize>();
    let has_bias = b.is_some();
    let b = b.unwrap_or_else(|| Tensor::<1>::zeros([n], &w.device()).cast(w.dtype()));
    let y = Dispatch::fused_linear_forward(
        x.reshape([rows, k]).into_dispatch(),
        w.into_dispatch(),
        b.into_dispatch(),
        has_bias,
    );
    let mut out = dims;
    out[D - 1] = n;
    Ok(Tensor::<2>::from_dispatch(y).reshape(out))
}

/// Scaled dot-product attention `softmax(q k^T / sqrt(head_dim)) v` of `q` `[batch, heads,
/// tq, head_dim]` over `k`, `v` `[batch, heads, tk, head_dim]`, causal (query `i` sees keys
/// `0..=i + tk - tq`) when `causal`.
///
/// On Flex (fp32) this is the blockwise kernel of [`cpu`]: online softmax over key tiles,
/// tiles above the causal diagonal skipped, and only the output and a `[batch, heads, tq]`
/// log-sum-exp kept for the backward, which recomputes each tile's probabilities; the
/// `batch x heads x tq x tk` probabilities are never stored. `q`, `k`, `v` may be the
/// `swap_dims(1, 2)` views of `[batch, seq, heads, head_dim]` tensors (a model's projections
/// with the heads split off): Flex reads them in place and returns the output as the same kind
/// of view, so no permute is copied either way. Elsewhere it is the composed
/// [`reference::attention_forward`].
///
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use burn_parallel::kernels::attention;
///
/// let device = Device::flex();
/// let q = Tensor::<4>::random([2, 4, 10, 8], Distribution::Default, &device);
/// let y = attention(q.clone(), q.clone(), q, true).unwrap();
/// assert_eq!(y.dims(), [2, 4, 10, 8]);
/// ```
///
/// # Errors
/// [`KernelError::Shape`] when batch, heads or head width differ between `q`, `k` and `v`,
/// when `k` and `v` differ in length, or when a causal call has fewer keys than queries;
/// [`KernelError::DType`] when dtypes differ.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
) -> KernelResult<Tensor<4>> {
    let op = "attention";
    let [b, h, tq, d] = q.dims();
    let [kb, kh, tk, kd] = k.dims();
    if [kb, kh, kd] != [b, h, d] || v.dims() != k.dims() || d == 0 {
        return Err(KernelError::Shape {
            op,
            reason: format!(
                "q {:?}, k {:?} and v {:?} must share batch, heads and a positive head width, \
                 and k and v must have the same shape",
                q.dims(),
                k.dims(),
                v.dims()
            ),
        });
    }
    if causal && tk < tq {
        return Err(KernelError::Shape {
            op,
            reason: format!(
                "causal attention needs at least as many keys ({tk}) as queries ({tq})"
            ),
        });
    }
    same_dtype(op, &[("q", q.dtype()), ("k", k.dtype()), ("v", v.dtype())])?;
    let scale = 1.0 / (d as f64).sqrt();
    if !supported(&q.device()) {
        let (out, _) = reference::attention_forward_4d(q, k, v, causal, scale);
        return Ok(out);
    }
    // The 4-D tensors go as they are: on Flex, the `swap_dims(1, 2)` view of a
    // `[batch, seq, heads, head_dim]` tensor is read in place and the output (and, in the
    // backward, the gradients) come back in that layout, so the caller's swap back is free.
    let (out, _lse) = Dispatch::fused_attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        causal,
        scale,
    );
    Ok(Tensor::<4>::from_dispatch(out))
}

/// Rotary position embedding (half-split form, as `examples::gpt::Rope`) of `x`
/// `[batch, heads, seq, head_dim]` with tables `cos`, `sin` of `seq x head_dim / 2` elements
/// (any rank, e.g. `[1, 1, seq, head_dim / 2]`). One kernel forward, one backward (the
/// inverse rotation).
///
/// # Errors
/// [`KernelError::Shape`] for an odd `head_dim` or tables of the wrong size;
/// [`KernelError::DType`] when dtypes differ.
pub fn rope<const D: usize>(
    x: Tensor<4>,
    cos: Tensor<D>,
    sin: Tensor<D>,
) -> KernelResult<Tensor<4>> {
    let dims = x.dims();
    let [b, h, s, hd] = dims;
    if hd % 2 != 0 || hd == 0 {
        return Err(KernelError::Shape {
            op: "rope",
            reason: format!("head_dim must be even and positive, got {hd}"),
        });
    }
    let half = hd / 2;
    for (name, t) in [("cos", &cos), ("sin", &sin)] {
        if t.shape().num_elements() != s * half {
            return Err(KernelError::Shape {
                op: "rope",
                reason: format!(
                    "{name} must hold seq x head_dim/2 = {s} x {half} values, got {:?}",
                    t.dims()
                ),
            });
        }
    }
    same_dtype(
        "rope",
        &[("x", x.dtype()), ("cos", cos.dtype()), ("sin", sin.dtype())],
    )?;
    let y = Dispatch::fused_rope(
        x.reshape([b * h, s, hd]).into_dispatch(),
        cos.reshape([s, half]).detach().into_dispatch(),
        sin.reshape([s, half]).detach().into_dispatch(),
        false,
    );
    Ok(Tensor::<3>::from_dispatch(y).reshape(dims))
}

/// Per-row softmax statistics `[rows, 2]` (max, `sum exp(x - max)`) of logits `[rows, vocab]`,
/// from which [`cross_entropy`] takes the log-sum-exp. Detached.
fn ce_partial_stats(logits: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(Dispatch::fused_ce_stats(logits.detach().into_dispatch()))
}

fn check_ce(
    op: &'static str,
    logits: &Tensor<2>,
    targets: &Tensor<1, Int>,
) -> KernelResult<(usize, usize)> {
    let [rows, vocab] = logits.dims();
    let [n] = targets.dims();
    if n != rows || vocab == 0 {
        return Err(KernelError::Shape {
            op,
            reason: format!("logits [{rows}, {vocab}] need targets [{rows}], got [{n}]"),
        });
    }
    Ok((rows, vocab))
}

/// Host check that every target is in `[0, vocab)` or equal to `ignore_index`; returns the
/// number of counted (non-ignored) rows.
fn count_targets(
    op: &'static str,
    targets: &Tensor<1, Int>,
    vocab: usize,
    ignore_index: Option<i64>,
) -> KernelResult<usize> {
    let ids: Vec<i64> = targets
        .clone()
        .into_data()
        .try_into_vec_as::<i64>()
        .map_err(|e| KernelError::DType {
            op,
            reason: format!("targets: {e:?}"),
        })?;
    let mut counted = 0;
    for (row, &t) in ids.iter().enumerate() {
        if Some(t) == ignore_index {
            continue;
        }
        if t < 0 || t as usize >= vocab {
            return Err(KernelError::Argument {
                op,
                reason: format!("target {t} of row {row} is outside the vocabulary [0, {vocab})"),
            });
        }
        counted += 1;
    }
    Ok(counted)
}

fn mean_over(nll: Tensor<1>, counted: usize) -> Tensor<1> {
    // Every target ignored: the mean is 0 (and so is the gradient), as PyTorch's sum/0 is not.
    nll.sum() / counted.max(1) as f64
}

/// The sentinel passed to the kernels when no target is ignored (no valid id equals it).
const NO_IGNORE: i64 = i64::MIN;

/// Mean softmax cross-entropy of `logits` `[rows, vocab]` against class ids `targets` `[rows]`,
/// targets equal to `ignore_index` excluded from the mean (0 when all are ignored).
///
/// Fused: one pass for the row statistics (`max`, `sum exp`), one for the NLL; backward is
/// one pass computing `softmax - onehot` from the logits and the saved `[rows]` log-sum-exp.
///
/// # Errors
/// [`KernelError::Shape`] for mismatched shapes; [`KernelError::Argument`] for a target outside
/// the vocabulary that is not `ignore_index`.
pub fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    ignore_index: Option<i64>,
) -> KernelResult<Tensor<1>> {
    let (rows, vocab) = check_ce("cross_entropy", &logits, &targets)?;
    let counted = count_targets("cross_entropy", &targets, vocab, ignore_index)?;
    let stats = ce_partial_stats(logits.clone());
    let lse = stats.clone().narrow(1, 0, 1) + stats.narrow(1, 1, 1).log();
    let nll = Dispatch::fused_ce_nll(
        logits.into_dispatch(),
        targets.into_dispatch(),
        lse.reshape([rows]).into_dispatch(),
        0,
        true,
        ignore_index.unwrap_or(NO_IGNORE),
    );
    Ok(mean_over(Tensor::from_dispatch(nll), counted))
}

/// One fused AdamW step on (flat or any-rank) `param`, `grad`, and fp32 moments `m`, `v`,
/// with Burn's `AdamW` semantics: a drop-in for the update of a flat optimizer shard (the ZeRO
/// sharded optimizer keeps exactly these four tensors per shard). `param`/`grad` may be bf16 or
/// f16 on backends that support them; the arithmetic is fp32. Detached from any graph.
///
/// # Returns
/// `(param, m, v)` after the step.
///
/// # Errors
/// [`KernelError::Shape`] when the four tensors differ in shape; [`KernelError::DType`] when
/// `grad` differs from `param` or the moments are not fp32; [`KernelError::Argument`] for bad
/// hyper-parameters (step 0, betas outside `[0, 1)`, non-positive eps).
pub fn adamw_step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    m: Tensor<D>,
    v: Tensor<D>,
    hyper: AdamWHyper,
) -> KernelResult<(Tensor<D>, Tensor<D>, Tensor<D>)> {
    let op = "adamw_step";
    hyper.validate()?;
    let dims = param.dims();
    for (name, d) in [("grad", grad.dims()), ("m", m.dims()), ("v", v.dims())] {
        if d != dims {
            return Err(KernelError::Shape {
                op,
                reason: format!("param is {dims:?} but {name} is {d:?}"),
            });
        }
    }
    same_dtype(op, &[("param", param.dtype()), ("grad", grad.dtype())])?;
    same_dtype(
        op,
        &[("f32", DType::F32), ("m", m.dtype()), ("v", v.dtype())],
    )?;
    let n = param.shape().num_elements();
    let flat = |t: Tensor<D>| t.detach().reshape([n]).into_dispatch();
    let (p, m, v) = Dispatch::fused_adamw_step(flat(param), flat(grad), flat(m), flat(v), hyper);
    let back = |t| Tensor::<1>::from_dispatch(t).reshape(dims);
    Ok((back(p), back(m), back(v)))
}

/// Burn's WGPU device on the first adapter found, initialised once per process (later calls
/// return the same device). Used by the tests and the benchmark.
///
/// # Errors
/// [`KernelError::NoAdapter`] when wgpu finds no adapter (no GPU and no software Vulkan driver:
/// install `mesa-vulkan-drivers`).
#[cfg(feature = "wgpu")]
pub fn wgpu_device() -> KernelResult<burn::tensor::Device> {
    use std::sync::OnceLock;
    static DEVICE: OnceLock<Result<burn::tensor::Device, String>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let device = burn::tensor::Device::wgpu_options()
                .init()
                .map_err(|e| e.to_string())?;
            // Probe: a first kernel fails here rather than in the middle of a test.
            let probe = Tensor::<1>::ones([4], &device).sum().into_scalar::<f32>();
            if probe == 4.0 {
                Ok(device)
            } else {
                Err(format!("probe kernel returned {probe} instead of 4"))
            }
        })
        .clone()
        .map_err(KernelError::NoAdapter)
}
