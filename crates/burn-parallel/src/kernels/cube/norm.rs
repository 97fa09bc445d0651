//! RMSNorm / LayerNorm kernels: one cube per row.
//!
//! Forward: each unit runs Welford's algorithm over its strided share of the row (one read of
//! the row for the statistics), the cube combines the partial `(count, mean, M2)` in shared
//! memory (Chan's formula), then writes `y`. Backward: one cube per row for `dx` (two sums per
//! row), and a 2-D grid of column blocks x row groups for the parameter gradients, each unit
//! summing its column over a contiguous group of rows into a partial buffer that is then summed
//! over the groups: deterministic, no atomics. The saved statistics (mean, 1/std) are fp32
//! whatever the storage dtype: rounded to bf16 they would make the backward's `xhat` disagree
//! with the forward's.

// Kernel signatures are launch ABIs: every tensor, scalar and comptime switch is a parameter.
#![allow(clippy::too_many_arguments)]

use cubecl::prelude::*;

/// `row` of a 2-D grid of cubes (rows can exceed the 65,535 cubes of one grid axis).
#[cube]
pub(crate) fn grid_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

#[cube(launch)]
pub(crate) fn norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    bias: &Tensor<F>,
    y: &mut Tensor<F>,
    mean_out: &mut Tensor<f32>,
    rstd_out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    eps: f32,
    #[comptime] rms: bool,
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

    let mut count = 0.0f32;
    let mut mean = 0.0f32;
    let mut m2 = 0.0f32;
    let mut j = tid;
    while j < cols {
        let v = f32::cast_from(x[base + j]);
        count += 1.0f32;
        if rms {
            m2 += v * v;
        } else {
            let d = v - mean;
            mean += d / count;
            m2 += d * (v - mean);
        }
        j += bs;
    }

    let mut sh_count = Shared::<[f32]>::new_slice(shared);
    let mut sh_mean = Shared::<[f32]>::new_slice(shared);
    let mut sh_m2 = Shared::<[f32]>::new_slice(shared);
    sh_count[tid] = count;
    sh_mean[tid] = mean;
    sh_m2[tid] = m2;
    sync_cube();

    let mut s = bs / 2;
    while s > 0 {
        if tid < s {
            let na = sh_count[tid];
            let nb = sh_count[tid + s];
            let n = na + nb;
            if nb > 0.0f32 {
                let ma = sh_mean[tid];
                let d = sh_mean[tid + s] - ma;
                sh_mean[tid] = ma + d * nb / n;
                sh_m2[tid] = sh_m2[tid] + sh_m2[tid + s] + d * d * na * nb / n;
                sh_count[tid] = n;
            }
        }
        sync_cube();
        s /= 2;
    }

    let total = sh_count[0];
    let mean = sh_mean[0];
    let rstd = 1.0f32 / (sh_m2[0] / total + eps).sqrt();

    j = tid;
    while j < cols {
        let v = (f32::cast_from(x[base + j]) - mean) * rstd;
        let mut out = v * f32::cast_from(weight[j]);
        if !rms {
            out += f32::cast_from(bias[j]);
        }
        y[base + j] = F::cast_from(out);
        j += bs;
    }
    if tid == 0 {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

#[cube(launch)]
pub(crate) fn norm_backward_dx_kernel<F: Float>(
    dy: &Tensor<F>,
    x: &Tensor<F>,
    weight: &Tensor<F>,
    mean_in: &Tensor<f32>,
    rstd_in: &Tensor<f32>,
    dx: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] rms: bool,
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
    let mean = mean_in[row];
    let rstd = rstd_in[row];

    // Partial sums of g = dy * w and g * xhat.
    let mut sum_g = 0.0f32;
    let mut sum_gx = 0.0f32;
    let mut j = tid;
    while j < cols {
        let g = f32::cast_from(dy[base + j]) * f32::cast_from(weight[j]);
        let xhat = (f32::cast_from(x[base + j]) - mean) * rstd;
        sum_g += g;
        sum_gx += g * xhat;
        j += bs;
    }
    let mut sh_g = Shared::<[f32]>::new_slice(shared);
    let mut sh_gx = Shared::<[f32]>::new_slice(shared);
    sh_g[tid] = sum_g;
    sh_gx[tid] = sum_gx;
    sync_cube();
    let mut s = bs / 2;
    while s > 0 {
        if tid < s {
            sh_g[tid] += sh_g[tid + s];
            sh_gx[tid] += sh_gx[tid + s];
        }
        sync_cube();
        s /= 2;
    }
    let inv_cols = 1.0f32 / f32::cast_from(cols as u32);
    let c1 = sh_g[0] * inv_cols;
    let c2 = sh_gx[0] * inv_cols;

    j = tid;
    while j < cols {
        let g = f32::cast_from(dy[base + j]) * f32::cast_from(weight[j]);
        let xhat = (f32::cast_from(x[base + j]) - mean) * rstd;
        let mut inner = g - xhat * c2;
        if !rms {
            inner -= c1;
        }
        dx[base + j] = F::cast_from(inner * rstd);
        j += bs;
    }
}

/// Partial parameter gradients: unit `(column, group)` sums `dy * xhat` and `dy` over the rows
/// `group * rows_per_group ..` of its column into `partial_w[group, column]`,
/// `partial_b[group, column]` (fp32).
#[cube(launch)]
pub(crate) fn norm_backward_params_kernel<F: Float>(
    dy: &Tensor<F>,
    x: &Tensor<F>,
    mean_in: &Tensor<f32>,
    rstd_in: &Tensor<f32>,
    partial_w: &mut Tensor<f32>,
    partial_b: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    rows_per_group: u32,
    #[define(F)] _dtype: ElemType,
) {
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let group = CUBE_POS_Y as usize;
    let cols = cols as usize;
    if col >= cols {
        terminate!();
    }
    let start = group * rows_per_group as usize;
    let mut end = start + rows_per_group as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    let mut acc_w = 0.0f32;
    let mut acc_b = 0.0f32;
    let mut r = start;
    while r < end {
        let d = f32::cast_from(dy[r * cols + col]);
        let xhat = (f32::cast_from(x[r * cols + col]) - mean_in[r]) * rstd_in[r];
        acc_w += d * xhat;
        acc_b += d;
        r += 1;
    }
    partial_w[group * cols + col] = acc_w;
    partial_b[group * cols + col] = acc_b;
}
