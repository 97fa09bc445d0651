//! Softmax cross-entropy kernels on a (shard of) logits `[rows, vocab]`.
//!
//! - statistics: one cube per row; each unit keeps an online `(max, sum exp)` over its strided
//!   share of the row (one read of the row), the cube merges them in shared memory;
//! - NLL: one unit per row (`lse - x[target]`, shard and ignore aware);
//! - backward: one unit per logit, `dnll * (exp(x - lse) - onehot)`: the probabilities are
//!   recomputed, never stored.
//!
//! The statistics, the log-sum-exp, the NLL and its gradient are fp32 whatever the logits'
//! dtype: bf16 logits keep an fp32 loss.

// Kernel signatures are launch ABIs: every tensor, scalar and comptime switch is a parameter.
#![allow(clippy::too_many_arguments)]

use cubecl::prelude::*;

use super::norm::grid_row;

#[cube(launch)]
pub(crate) fn ce_stats_kernel<F: Float>(
    logits: &Tensor<F>,
    stats: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: ElemType,
) {
    let row = grid_row();
    if row >= rows as usize {
        terminate!();
    }
    let cols = cols as usize;
    let bs = CUBE_DIM_X as usize;
    let shared = block as usize;
    let tid = UNIT_POS_X as usize;
    let base = row * cols;

    let mut m = f32::new(-3.0e38);
    let mut s = 0.0f32;
    let mut j = tid;
    while j < cols {
        let v = f32::cast_from(logits[base + j]);
        if v > m {
            s = s * (m - v).exp() + 1.0f32;
            m = v;
        } else {
            s += (v - m).exp();
        }
        j += bs;
    }
    let mut sh_m = Shared::<[f32]>::new_slice(shared);
    let mut sh_s = Shared::<[f32]>::new_slice(shared);
    sh_m[tid] = m;
    sh_s[tid] = s;
    sync_cube();
    let mut stride = bs / 2;
    while stride > 0 {
        if tid < stride {
            let ma = sh_m[tid];
            let mb = sh_m[tid + stride];
            let mx = ma.max(mb);
            sh_s[tid] = sh_s[tid] * (ma - mx).exp() + sh_s[tid + stride] * (mb - mx).exp();
            sh_m[tid] = mx;
        }
        sync_cube();
        stride /= 2;
    }
    if tid == 0 {
        stats[2 * row] = sh_m[0];
        stats[2 * row + 1] = sh_s[0];
    }
}

#[cube(launch)]
pub(crate) fn ce_nll_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<f32>,
    nll: &mut Tensor<f32>,
    cols: u32,
    vocab_start: i32,
    ignore_index: i32,
    #[comptime] has_ignore: bool,
    #[comptime] count_lse: bool,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= nll.len() {
        terminate!();
    }
    let t = i32::cast_from(targets[row]);
    let mut valid = true;
    if has_ignore {
        valid = t != ignore_index;
    }
    let local = t - vocab_start;
    let mut out = 0.0f32;
    if valid {
        if count_lse {
            out = lse[row];
        }
        if local >= 0 && local < cols as i32 {
            out -= f32::cast_from(logits[row * cols as usize + local as usize]);
        }
    }
    nll[row] = out;
}

#[cube(launch)]
pub(crate) fn ce_backward_kernel<F: Float, I: Numeric>(
    dnll: &Tensor<f32>,
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<f32>,
    dlogits: &mut Tensor<F>,
    cols: u32,
    vocab_start: i32,
    ignore_index: i32,
    #[comptime] has_ignore: bool,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= dlogits.len() {
        terminate!();
    }
    let cols = cols as usize;
    let row = idx / cols;
    let j = idx % cols;
    let t = i32::cast_from(targets[row]);
    let mut g = dnll[row];
    // `has_ignore` is a comptime switch (resolved when the kernel is expanded), `t` a runtime
    // value: two `if`s on purpose.
    #[allow(clippy::collapsible_if)]
    if has_ignore {
        if t == ignore_index {
            g = 0.0f32;
        }
    }
    let mut p = (f32::cast_from(logits[idx]) - lse[row]).exp();
    if j as i32 + vocab_start == t {
        p -= 1.0f32;
    }
    dlogits[idx] = F::cast_from(g * p);
}
