//! Element-wise kernels: SwiGLU forward/backward, rotary embedding, AdamW. One unit per
//! element (per rotated pair for RoPE); arithmetic in fp32 whatever the storage dtype.

// Kernel signatures are launch ABIs: every tensor, scalar and comptime switch is a parameter.
#![allow(clippy::too_many_arguments)]

use cubecl::prelude::*;

#[cube]
fn sigmoid(a: f32) -> f32 {
    1.0f32 / (1.0f32 + (0.0f32 - a).exp())
}

#[cube(launch)]
pub(crate) fn swiglu_forward_kernel<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    y: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= y.len() {
        terminate!();
    }
    let av = f32::cast_from(a[i]);
    y[i] = F::cast_from(av * sigmoid(av) * f32::cast_from(b[i]));
}

#[cube(launch)]
pub(crate) fn swiglu_backward_kernel<F: Float>(
    dy: &Tensor<F>,
    a: &Tensor<F>,
    b: &Tensor<F>,
    da: &mut Tensor<F>,
    db: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= da.len() {
        terminate!();
    }
    let av = f32::cast_from(a[i]);
    let g = f32::cast_from(dy[i]);
    let s = sigmoid(av);
    let silu = av * s;
    da[i] = F::cast_from(g * f32::cast_from(b[i]) * (s + silu * (1.0f32 - s)));
    db[i] = F::cast_from(g * silu);
}

/// `x` `[n, seq, 2 * half]` contiguous, tables `[seq, half]`; one unit per `(n, seq, i < half)`.
#[cube(launch)]
pub(crate) fn rope_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    y: &mut Tensor<F>,
    seq: u32,
    half: u32,
    #[comptime] inverse: bool,
    #[define(F)] _dtype: ElemType,
) {
    let idx = ABSOLUTE_POS;
    let half = half as usize;
    if idx >= y.len() / 2 {
        terminate!();
    }
    let i = idx % half;
    let ns = idx / half;
    let s = ns % seq as usize;
    let base = ns * 2 * half;
    let c = f32::cast_from(cos[s * half + i]);
    let mut sn = f32::cast_from(sin[s * half + i]);
    if inverse {
        sn = 0.0f32 - sn;
    }
    let x1 = f32::cast_from(x[base + i]);
    let x2 = f32::cast_from(x[base + half + i]);
    y[base + i] = F::cast_from(x1 * c - x2 * sn);
    y[base + half + i] = F::cast_from(x2 * c + x1 * sn);
}

/// In-place AdamW: `param` (F), `grad` (F), fp32 `m`, `v`.
#[cube(launch)]
pub(crate) fn adamw_kernel<F: Float>(
    param: &mut Tensor<F>,
    grad: &Tensor<F>,
    m: &mut Tensor<f32>,
    v: &mut Tensor<f32>,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    decay: f32,
    bc1: f32,
    bc2: f32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= param.len() {
        terminate!();
    }
    let g = f32::cast_from(grad[i]);
    let mi = m[i] * beta1 + g * (1.0f32 - beta1);
    let vi = v[i] * beta2 + g * g * (1.0f32 - beta2);
    m[i] = mi;
    v[i] = vi;
    let update = (mi / bc1) / ((vi / bc2).sqrt() + eps);
    param[i] = F::cast_from(f32::cast_from(param[i]) * decay - update * lr);
}
