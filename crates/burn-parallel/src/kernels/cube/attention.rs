//! Flash attention (FlashAttention-2 style) for the CubeCL backends: forward and backward
//! without ever materialising the `tq x tk` score matrix of a head.
//!
//! Layout: **one unit owns one row**. A cube of [`UNITS`] units takes [`UNITS`] consecutive
//! query rows of one `(batch, head)` (forward and `dq`) or key rows (`dk`/`dv`); the unit keeps
//! its row's operands and accumulators as `dim` fp32 values in local arrays whose length is the
//! head width, a comptime parameter (one compiled kernel per width, every loop over the width
//! unrolled so that they live in registers). The cube streams the other side through shared
//! memory in tiles of `tile` rows, converted to fp32 once on load. Why this layout: it needs no
//! reductions across units (no plane ops, no atomics), each output element is written by
//! exactly one unit (deterministic), and it runs unchanged on WGPU (whose shared memory is
//! guaranteed only 16 KiB, see [`SHARED_BUDGET`]), CUDA and ROCm. Its cost is registers:
//! `2 dim` floats in the forward, `3 dim` in `dq`, `4 dim` in `dk`/`dv`, so widths past 128
//! spill to local memory; widths above [`MAX_DIM`] use the composed reference.
//!
//! - forward: grid (query blocks, heads); key/value tiles in shared memory, online softmax
//!   (running max `m`, sum `l`, accumulator `o` in fp32) over each tile's scores kept in a local
//!   array, key tiles wholly above the causal diagonal skipped; writes `o / l` and
//!   `lse = m + ln l`;
//! - backward: `delta_i = dout_i . out_i` (one unit per query row, fp32), then `dq` (grid over
//!   query blocks, key/value tiles streamed: `p = exp(s - lse)`, `ds = p (dout . v - delta)`,
//!   `dq += scale ds k`) and `dk`, `dv` (grid over key blocks, query/`dout` tiles streamed with
//!   their `lse` and `delta`, query tiles wholly above the diagonal skipped: `dv += p dout`,
//!   `dk += scale ds q`).
//!
//! Causal masking is bottom-right aligned: query `i` sees keys `0..visible(i)`,
//! `visible(i) = min(i + 1 + tk - min(tq, tk), tk)`, as in the CPU kernel. For `tq <= tk` (the
//! only causal case [`crate::kernels::attention`] admits) this is `0..=i + tk - tq`, exactly the
//! reference's mask; no row is ever fully masked (key 0 is visible to every row), so there is
//! no `-inf` and no NaN. Inputs are made contiguous first; outputs are contiguous
//! `[batch, heads, rows, dim]`, `lse` `[batch * heads, tq]` in the input dtype (as the
//! reference), arithmetic fp32 for every storage dtype.

// Kernel signatures are launch ABIs: every tensor, scalar and comptime switch is a parameter.
#![allow(clippy::too_many_arguments)]

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::norm::grid_row;
use super::{empty_like, row_grid};
use burn::backend::cubecl::dtype_to_storage_type;

/// Rows (one per unit) per cube: query rows in the forward and `dq`, key rows in `dk`/`dv`.
pub const UNITS: u32 = 64;

/// Widest head handled by the kernels (their per-unit arrays are `dim` floats each); wider
/// heads fall back to the composed reference.
pub const MAX_DIM: usize = 256;

/// Rows per shared-memory tile at most (each unit also keeps a tile of scores locally).
const MAX_TILE: usize = 64;

/// Bytes of shared memory a cube may use: WebGPU guarantees 16 KiB per workgroup; a device
/// that reports less gets less.
const SHARED_BUDGET: usize = 16 * 1024;

/// Whether the kernels take attention with head width `dim` over `tq` queries and `tk` keys
/// (else the caller runs the reference): `0 < dim <= MAX_DIM` and no empty side.
pub fn supported(dim: usize, tq: usize, tk: usize) -> bool {
    dim > 0 && dim <= MAX_DIM && tq > 0 && tk > 0
}

/// `(batch * heads, rows, dim)` of a `[batch, heads, rows, dim]` tensor.
fn dims(t: &CubeTensor) -> (usize, usize, usize) {
    let s = t.meta.shape();
    (s[0] * s[1], s[2], s[3])
}

/// Rows per shared tile when each row takes `per_row` fp32 values: as many as fit in
/// [`SHARED_BUDGET`] (or the device's smaller limit), at most [`MAX_TILE`].
fn tile_rows(client_max: usize, per_row: usize) -> usize {
    let floats = client_max.min(SHARED_BUDGET) / 4;
    (floats / per_row).clamp(1, MAX_TILE)
}

/// Grid of `blocks` cubes along x for each of `heads` heads (y, spilling into z past 65,535).
fn head_grid(blocks: usize, heads: usize) -> CubeCount {
    let y = heads.clamp(1, 65_535);
    let z = heads.div_ceil(y).max(1);
    CubeCount::Static(blocks.max(1) as u32, y as u32, z as u32)
}

/// `tk - min(tq, tk)`: how far the causal diagonal is shifted right.
fn diagonal_offset(tq: usize, tk: usize) -> u32 {
    (tk - tq.min(tk)) as u32
}

/// `t` contiguous and in `dtype` (the kernels read every operand as the dtype of `q`).
fn prepare(t: CubeTensor, dtype: DType) -> CubeTensor {
    let t = if t.dtype == dtype {
        t
    } else {
        CubeBackend::float_cast(t, dtype.into())
    };
    into_contiguous(t)
}

fn max_shared(t: &CubeTensor) -> usize {
    t.client.properties().hardware.max_shared_memory_size
}

/// Flash attention forward on `q` `[b, h, tq, d]`, `k`, `v` `[b, h, tk, d]` (any strides; `k`,
/// `v` cast to the dtype of `q` if they differ): `(out [b, h, tq, d], lse [b * h, tq])`, `out`
/// in the dtype of `q`, `lse` in fp32 (rounded to bf16 it would skew the backward's
/// probabilities). Requires [`supported`].
pub fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    causal: bool,
    scale: f64,
) -> (CubeTensor, CubeTensor) {
    let dtype = q.dtype;
    let (q, k, v) = (prepare(q, dtype), prepare(k, dtype), prepare(v, dtype));
    let (heads, tq, dim) = dims(&q);
    let tk = dims(&k).1;
    let out = empty_like(&q, q.meta.shape().clone(), dtype);
    let lse = empty_like(&q, Shape::new([heads, tq]), DType::F32);
    let tile = tile_rows(max_shared(&q), 2 * dim);
    attention_forward_kernel::launch(
        &q.client.clone(),
        head_grid(tq.div_ceil(UNITS as usize), heads),
        CubeDim::new_1d(UNITS),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        heads as u32,
        tq as u32,
        tk as u32,
        diagonal_offset(tq, tk),
        scale as f32,
        dim as u32,
        tile as u32,
        causal,
        dtype_to_storage_type(dtype),
    );
    (out, lse)
}

/// Flash attention backward: `(dq, dk, dv)` (contiguous, the shapes of `q`, `k`, `v`, the dtype
/// of `q`) from the forward's `out` and `lse` (any strides and float dtypes). Requires
/// [`supported`].
pub fn backward(
    dout: CubeTensor,
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    causal: bool,
    scale: f64,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let dtype = q.dtype;
    let (dout, out) = (prepare(dout, dtype), prepare(out, dtype));
    // `lse` is read in its own dtype (an fp32 one keeps its precision).
    let lse = into_contiguous(lse);
    let lse_dtype = lse.dtype;
    let (q, k, v) = (prepare(q, dtype), prepare(k, dtype), prepare(v, dtype));
    let (heads, tq, dim) = dims(&q);
    let tk = dims(&k).1;
    let client = q.client.clone();
    let offset = diagonal_offset(tq, tk);

    // delta_i = dout_i . out_i, fp32, one unit per query row.
    let rows = heads * tq;
    let delta = empty_like(&q, Shape::new([rows]), DType::F32);
    let per_cube = 256usize;
    attention_delta_kernel::launch(
        &client,
        row_grid(rows.div_ceil(per_cube)),
        CubeDim::new_1d(per_cube as u32),
        dout.clone().into_tensor_arg(),
        out.into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        rows as u32,
        dim as u32,
        dtype_to_storage_type(dtype),
    );

    let dq = empty_like(&q, q.meta.shape().clone(), dtype);
    let dk = empty_like(&k, k.meta.shape().clone(), dtype);
    let dv = empty_like(&k, k.meta.shape().clone(), dtype);
    let tile = tile_rows(max_shared(&q), 2 * dim);
    attention_dq_kernel::launch(
        &client,
        head_grid(tq.div_ceil(UNITS as usize), heads),
        CubeDim::new_1d(UNITS),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        dout.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        heads as u32,
        tq as u32,
        tk as u32,
        offset,
        scale as f32,
        dim as u32,
        tile as u32,
        causal,
        [
            dtype_to_storage_type(dtype),
            dtype_to_storage_type(lse_dtype),
        ],
    );

    let tile = tile_rows(max_shared(&q), 2 * dim + 2);
    attention_dkdv_kernel::launch(
        &client,
        head_grid(tk.div_ceil(UNITS as usize), heads),
        CubeDim::new_1d(UNITS),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        dout.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        heads as u32,
        tq as u32,
        tk as u32,
        offset,
        scale as f32,
        dim as u32,
        tile as u32,
        causal,
        [
            dtype_to_storage_type(dtype),
            dtype_to_storage_type(lse_dtype),
        ],
    );
    (dq, dk, dv)
}

/// The `(batch, head)` problem of this cube ([`head_grid`]).
#[cube]
fn grid_head() -> usize {
    (CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y) as usize
}

/// Keys visible to query row `i`: `0..visible(i)` (all `tk` without the causal mask).
#[cube]
fn visible(i: usize, tk: usize, offset: usize, #[comptime] causal: bool) -> usize {
    let mut end = tk;
    if causal {
        end = i + 1 + offset;
        if end > tk {
            end = tk;
        }
    }
    end
}

/// Stages rows `from .. from + tile` of `src` (`[rows, dim]` at element `base`, `rows` valid)
/// into `dst` as fp32, zeros past the last row; every unit of the cube takes part.
#[cube]
fn load_tile<F: Float>(
    src: &Tensor<F>,
    dst: &mut Shared<[f32]>,
    base: usize,
    from: usize,
    rows: usize,
    #[comptime] tile: usize,
    #[comptime] dim: usize,
) {
    let units = CUBE_DIM_X as usize;
    let start = base + from * dim;
    let mut valid = (rows - from) * dim;
    if valid > tile * dim {
        valid = tile * dim;
    }
    let mut e = UNIT_POS_X as usize;
    while e < tile * dim {
        let mut x = 0.0f32;
        if e < valid {
            x = f32::cast_from(src[start + e]);
        }
        dst[e] = x;
        e += units;
    }
}

/// Forward: unit `tid` of cube `(x, head)` owns query row `x * UNITS + tid`.
#[cube(launch)]
pub(crate) fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    heads: u32,
    tq: u32,
    tk: u32,
    offset: u32,
    scale: f32,
    #[comptime] dim: u32,
    #[comptime] tile: u32,
    #[comptime] causal: bool,
    #[define(F)] _dtype: ElemType,
) {
    let head = grid_head();
    if head >= heads as usize {
        terminate!();
    }
    let d = dim as usize;
    let t = tile as usize;
    let tq = tq as usize;
    let tk = tk as usize;
    let offset = offset as usize;
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
    let row = first + UNIT_POS_X as usize;
    let valid = row < tq;
    let q_at = (head * tq + row) * d;
    let kv_at = head * tk * d;

    let mut qr = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    #[unroll]
    for c in 0..d {
        let mut x = 0.0f32;
        if valid {
            x = f32::cast_from(q[q_at + c]);
        }
        qr[c] = x;
        acc[c] = 0.0f32;
    }
    let mut scores = Array::<f32>::new(t);
    let mut sh_k = Shared::<[f32]>::new_slice(t * d);
    let mut sh_v = Shared::<[f32]>::new_slice(t * d);

    // Keys any row of this cube sees: tiles past them are above the diagonal for all rows.
    let mut last_row = first + CUBE_DIM_X as usize - 1;
    if last_row >= tq {
        last_row = tq - 1;
    }
    let keys = visible(last_row, tk, offset, causal);
    let mine = visible(row, tk, offset, causal);

    let mut m = f32::new(-3.0e38);
    let mut l = 0.0f32;
    let mut j0 = 0usize;
    while j0 < keys {
        load_tile::<F>(k, &mut sh_k, kv_at, j0, tk, t, d);
        load_tile::<F>(v, &mut sh_v, kv_at, j0, tk, t, d);
        sync_cube();
        if valid && mine > j0 {
            let mut n = mine - j0;
            if n > t {
                n = t;
            }
            let mut tile_max = m;
            for j in 0..n {
                let mut s = 0.0f32;
                #[unroll]
                for c in 0..d {
                    s += qr[c] * sh_k[j * d + c];
                }
                s *= scale;
                scores[j] = s;
                tile_max = tile_max.max(s);
            }
            let alpha = (m - tile_max).exp();
            l *= alpha;
            #[unroll]
            for c in 0..d {
                acc[c] *= alpha;
            }
            for j in 0..n {
                let p = (scores[j] - tile_max).exp();
                l += p;
                #[unroll]
                for c in 0..d {
                    acc[c] += p * sh_v[j * d + c];
                }
            }
            m = tile_max;
        }
        sync_cube();
        j0 += t;
    }

    if valid {
        let inv = 1.0f32 / l;
        #[unroll]
        for c in 0..d {
            out[q_at + c] = F::cast_from(acc[c] * inv);
        }
        lse[head * tq + row] = m + l.ln();
    }
}

/// `delta[r] = dout[r] . out[r]` (fp32) for each of `rows` rows of width `dim`.
#[cube(launch)]
pub(crate) fn attention_delta_kernel<F: Float>(
    dout: &Tensor<F>,
    out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    rows: u32,
    dim: u32,
    #[define(F)] _dtype: ElemType,
) {
    let row = grid_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if row >= rows as usize {
        terminate!();
    }
    let d = dim as usize;
    let at = row * d;
    let mut s = 0.0f32;
    for c in 0..d {
        s += f32::cast_from(dout[at + c]) * f32::cast_from(out[at + c]);
    }
    delta[row] = s;
}

/// `dq`: unit `tid` of cube `(x, head)` owns query row `x * UNITS + tid`; key/value tiles are
/// streamed.
#[cube(launch)]
pub(crate) fn attention_dq_kernel<F: Float, L: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<L>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    heads: u32,
    tq: u32,
    tk: u32,
    offset: u32,
    scale: f32,
    #[comptime] dim: u32,
    #[comptime] tile: u32,
    #[comptime] causal: bool,
    #[define(F, L)] _dtypes: [ElemType; 2],
) {
    let head = grid_head();
    if head >= heads as usize {
        terminate!();
    }
    let d = dim as usize;
    let t = tile as usize;
    let tq = tq as usize;
    let tk = tk as usize;
    let offset = offset as usize;
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
    let row = first + UNIT_POS_X as usize;
    let valid = row < tq;
    let q_at = (head * tq + row) * d;
    let kv_at = head * tk * d;

    let mut qr = Array::<f32>::new(d);
    let mut dor = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    #[unroll]
    for c in 0..d {
        let mut x = 0.0f32;
        let mut g = 0.0f32;
        if valid {
            x = f32::cast_from(q[q_at + c]);
            g = f32::cast_from(dout[q_at + c]);
        }
        qr[c] = x;
        dor[c] = g;
        acc[c] = 0.0f32;
    }
    if valid {
        row_lse = f32::cast_from(lse[head * tq + row]);
        row_delta = delta[head * tq + row];
    }
    let mut sh_k = Shared::<[f32]>::new_slice(t * d);
    let mut sh_v = Shared::<[f32]>::new_slice(t * d);

    let mut last_row = first + CUBE_DIM_X as usize - 1;
    if last_row >= tq {
        last_row = tq - 1;
    }
    let keys = visible(last_row, tk, offset, causal);
    let mine = visible(row, tk, offset, causal);

    let mut j0 = 0usize;
    while j0 < keys {
        load_tile::<F>(k, &mut sh_k, kv_at, j0, tk, t, d);
        load_tile::<F>(v, &mut sh_v, kv_at, j0, tk, t, d);
        sync_cube();
        if valid && mine > j0 {
            let mut n = mine - j0;
            if n > t {
                n = t;
            }
            for j in 0..n {
                let mut s = 0.0f32;
                let mut dp = 0.0f32;
                #[unroll]
                for c in 0..d {
                    s += qr[c] * sh_k[j * d + c];
                    dp += dor[c] * sh_v[j * d + c];
                }
                let p = (s * scale - row_lse).exp();
                let ds = p * (dp - row_delta);
                #[unroll]
                for c in 0..d {
                    acc[c] += ds * sh_k[j * d + c];
                }
            }
        }
        sync_cube();
        j0 += t;
    }

    if valid {
        #[unroll]
        for c in 0..d {
            dq[q_at + c] = F::cast_from(acc[c] * scale);
        }
    }
}

/// `dk`, `dv`: unit `tid` of cube `(x, head)` owns key row `x * UNITS + tid`; query, `dout`,
/// `lse` and `delta` tiles are streamed, starting at the first query row that sees any key of
/// the cube.
#[cube(launch)]
pub(crate) fn attention_dkdv_kernel<F: Float, L: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<L>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    heads: u32,
    tq: u32,
    tk: u32,
    offset: u32,
    scale: f32,
    #[comptime] dim: u32,
    #[comptime] tile: u32,
    #[comptime] causal: bool,
    #[define(F, L)] _dtypes: [ElemType; 2],
) {
    let head = grid_head();
    if head >= heads as usize {
        terminate!();
    }
    let units = CUBE_DIM_X as usize;
    let tid = UNIT_POS_X as usize;
    let d = dim as usize;
    let t = tile as usize;
    let tq = tq as usize;
    let tk = tk as usize;
    let offset = offset as usize;
    let first = CUBE_POS_X as usize * units;
    let key = first + tid;
    let valid = key < tk;
    let kv_at = (head * tk + key) * d;
    let q_at = head * tq * d;

    let mut kr = Array::<f32>::new(d);
    let mut vr = Array::<f32>::new(d);
    let mut dk_acc = Array::<f32>::new(d);
    let mut dv_acc = Array::<f32>::new(d);
    #[unroll]
    for c in 0..d {
        let mut a = 0.0f32;
        let mut b = 0.0f32;
        if valid {
            a = f32::cast_from(k[kv_at + c]);
            b = f32::cast_from(v[kv_at + c]);
        }
        kr[c] = a;
        vr[c] = b;
        dk_acc[c] = 0.0f32;
        dv_acc[c] = 0.0f32;
    }
    let mut sh_q = Shared::<[f32]>::new_slice(t * d);
    let mut sh_do = Shared::<[f32]>::new_slice(t * d);
    let mut sh_lse = Shared::<[f32]>::new_slice(t);
    let mut sh_delta = Shared::<[f32]>::new_slice(t);

    // Query row `i` sees key `j` iff `j < i + 1 + offset` (causal): the first row that sees
    // this cube's first key is `first - offset`; the first that sees this unit's key,
    // `key - offset`.
    let mut i0 = 0usize;
    let mut mine = 0usize;
    if causal {
        if first > offset {
            i0 = first - offset;
        }
        if key > offset {
            mine = key - offset;
        }
    }

    while i0 < tq {
        load_tile::<F>(q, &mut sh_q, q_at, i0, tq, t, d);
        load_tile::<F>(dout, &mut sh_do, q_at, i0, tq, t, d);
        let mut e = tid;
        while e < t {
            let i = i0 + e;
            let mut a = 0.0f32;
            let mut b = 0.0f32;
            if i < tq {
                a = f32::cast_from(lse[head * tq + i]);
                b = delta[head * tq + i];
            }
            sh_lse[e] = a;
            sh_delta[e] = b;
            e += units;
        }
        sync_cube();
        let mut end = tq - i0;
        if end > t {
            end = t;
        }
        // Rows of the tile before `mine` do not see this unit's key.
        let mut start = 0usize;
        if mine > i0 {
            start = mine - i0;
        }
        if valid && start < end {
            for i in start..end {
                let mut s = 0.0f32;
                let mut dp = 0.0f32;
                #[unroll]
                for c in 0..d {
                    s += sh_q[i * d + c] * kr[c];
                    dp += sh_do[i * d + c] * vr[c];
                }
                let p = (s * scale - sh_lse[i]).exp();
                let ds = p * (dp - sh_delta[i]);
                #[unroll]
                for c in 0..d {
                    dv_acc[c] += p * sh_do[i * d + c];
                    dk_acc[c] += ds * sh_q[i * d + c];
                }
            }
        }
        sync_cube();
        i0 += t;
    }

    if valid {
        #[unroll]
        for c in 0..d {
            dk[kv_at + c] = F::cast_from(dk_acc[c] * scale);
            dv[kv_at + c] = F::cast_from(dv_acc[c]);
        }
    }
}
