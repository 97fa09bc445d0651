//! The CubeCL implementation of [`FusedKernels`](super::FusedKernels) (features `wgpu`, `cuda`,
//! `cpu`): the functions of this module launch the kernels of [`norm`], [`elementwise`] and
//! [`cross_entropy`] on `burn_cubecl::CubeBackend` primitives, the backend behind every CubeCL
//! runtime; [`fusion`] implements the trait for Burn's `Fusion<CubeBackend>` (the `Cube`
//! backend of a build with Burn's `fusion` feature) by queueing them as custom operations.
//!
//! Every launch makes its inputs contiguous first and allocates contiguous outputs, so kernels
//! index with plain row-major offsets. Arithmetic is fp32 for every storage dtype, and so is
//! what a forward saves for its backward (norm statistics, attention's and the cross-entropy's
//! log-sum-exp) and the cross-entropy's per-row loss.

pub mod attention;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub(crate) mod cublas;
pub mod elementwise;
pub mod fusion;
pub mod norm;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

use super::AdamWHyper;

/// Units per cube of the row kernels: a power of two (the tree reductions need one), 32 (one
/// warp on NVIDIA) for every width. Measured on llvmpipe (`kernel_bench`): 256 units per row
/// made RMSNorm 6x slower than the composed ops (barriers dominate), 32 made it faster.
const ROW_BLOCK: u32 = 32;

/// A 2-D grid holding `rows` cubes (each axis at most 65,535); see [`norm::grid_row`].
fn row_grid(rows: usize) -> CubeCount {
    let x = rows.clamp(1, 65_535);
    let y = rows.div_ceil(x).max(1);
    CubeCount::Static(x as u32, y as u32, 1)
}

/// `t` contiguous and fp32 (statistics and loss values are kept in fp32 for every storage
/// dtype; a caller may still hand them over in another).
fn f32_contiguous(t: CubeTensor) -> CubeTensor {
    let t = if t.dtype == DType::F32 {
        t
    } else {
        CubeBackend::float_cast(t, DType::F32.into())
    };
    into_contiguous(t)
}

fn empty_like(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

fn elemwise(like: &CubeTensor, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&like.client, n.max(1));
    (
        calculate_cube_count_elemwise(&like.client, n.max(1), dim),
        dim,
    )
}

fn dims2(t: &CubeTensor) -> (usize, usize) {
    let shape = t.meta.shape();
    let n = shape.len();
    let cols = shape[n - 1];
    (shape.num_elements() / cols.max(1), cols)
}

/// A tensor this launch may write in place: `t` itself when its buffer is not shared, a copy
/// otherwise.
fn owned(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    if t.can_mut() { t } else { t.copy() }
}

/// The ignore index as the kernels take it: `(value, enabled)`. Targets are compared as `i32`
/// on the device; an ignore index outside `i32` can match no target id of a `< 2^31`
/// vocabulary, so it is disabled.
fn ignore_arg(ignore_index: i64) -> (i32, bool) {
    match i32::try_from(ignore_index) {
        Ok(v) => (v, true),
        Err(_) => (0, false),
    }
}

/// `FusedKernels::fused_norm_forward` on CubeCL primitives.
pub(crate) fn norm_forward(
    x: CubeTensor,
    weight: CubeTensor,
    bias: CubeTensor,
    eps: f64,
    rms: bool,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let (weight, bias) = (into_contiguous(weight), into_contiguous(bias));
    let (rows, cols) = dims2(&x);
    let dtype = x.dtype;
    let y = empty_like(&x, x.meta.shape().clone(), dtype);
    let mean = empty_like(&x, Shape::new([rows]), DType::F32);
    let rstd = empty_like(&x, Shape::new([rows]), DType::F32);
    let block = ROW_BLOCK;
    norm::norm_forward_kernel::launch(
        &x.client,
        row_grid(rows),
        CubeDim::new_1d(block),
        x.clone().into_tensor_arg(),
        weight.into_tensor_arg(),
        bias.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        eps as f32,
        rms,
        block,
        dtype_to_storage_type(dtype),
    );
    (y, mean, rstd)
}

/// `FusedKernels::fused_norm_backward` on CubeCL primitives.
pub(crate) fn norm_backward(
    dy: CubeTensor,
    x: CubeTensor,
    weight: CubeTensor,
    mean: CubeTensor,
    rstd: CubeTensor,
    rms: bool,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (dy, x) = (into_contiguous(dy), into_contiguous(x));
    let weight = into_contiguous(weight);
    let (mean, rstd) = (f32_contiguous(mean), f32_contiguous(rstd));
    let (rows, cols) = dims2(&x);
    let dtype = x.dtype;
    let dx = empty_like(&x, x.meta.shape().clone(), dtype);
    let block = ROW_BLOCK;
    norm::norm_backward_dx_kernel::launch(
        &x.client,
        row_grid(rows),
        CubeDim::new_1d(block),
        dy.clone().into_tensor_arg(),
        x.clone().into_tensor_arg(),
        weight.into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        rms,
        block,
        dtype_to_storage_type(dtype),
    );

    // Parameter gradients: groups of rows, then a deterministic sum over the groups.
    let groups = rows.div_ceil(64).clamp(1, 256);
    let rows_per_group = rows.div_ceil(groups);
    let groups = rows.div_ceil(rows_per_group).max(1);
    let partial_w = empty_like(&x, Shape::new([groups, cols]), DType::F32);
    let partial_b = empty_like(&x, Shape::new([groups, cols]), DType::F32);
    let unit = 64u32;
    norm::norm_backward_params_kernel::launch(
        &x.client.clone(),
        CubeCount::Static(cols.div_ceil(unit as usize) as u32, groups as u32, 1),
        CubeDim::new_1d(unit),
        dy.into_tensor_arg(),
        x.into_tensor_arg(),
        mean.into_tensor_arg(),
        rstd.into_tensor_arg(),
        partial_w.clone().into_tensor_arg(),
        partial_b.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        rows_per_group as u32,
        dtype_to_storage_type(dtype),
    );
    let reduce = |p: CubeTensor| {
        let summed = CubeBackend::float_sum_dim(p, 0);
        let summed = CubeBackend::float_reshape(summed, Shape::new([cols]));
        if dtype == DType::F32 {
            summed
        } else {
            CubeBackend::float_cast(summed, dtype.into())
        }
    };
    let dw = reduce(partial_w);
    let db = match rms {
        true => CubeBackend::float_zeros(Shape::new([cols]), &dx.device, dtype.into()),
        false => reduce(partial_b),
    };
    (dx, dw, db)
}

/// `FusedKernels::fused_swiglu_forward` on CubeCL primitives.
pub(crate) fn swiglu_forward(a: CubeTensor, b: CubeTensor) -> CubeTensor {
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let n = a.meta.shape().num_elements();
    let y = empty_like(&a, a.meta.shape().clone(), a.dtype);
    let (count, dim) = elemwise(&a, n);
    let dtype = a.dtype;
    elementwise::swiglu_forward_kernel::launch(
        &a.client.clone(),
        count,
        dim,
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    y
}

/// `FusedKernels::fused_swiglu_backward` on CubeCL primitives.
pub(crate) fn swiglu_backward(
    dy: CubeTensor,
    a: CubeTensor,
    b: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let (dy, a, b) = (into_contiguous(dy), into_contiguous(a), into_contiguous(b));
    let n = a.meta.shape().num_elements();
    let da = empty_like(&a, a.meta.shape().clone(), a.dtype);
    let db = empty_like(&a, a.meta.shape().clone(), a.dtype);
    let (count, dim) = elemwise(&a, n);
    let dtype = a.dtype;
    elementwise::swiglu_backward_kernel::launch(
        &a.client.clone(),
        count,
        dim,
        dy.into_tensor_arg(),
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        da.clone().into_tensor_arg(),
        db.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    (da, db)
}

/// `FusedKernels::fused_rope` on CubeCL primitives.
pub(crate) fn rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, inverse: bool) -> CubeTensor {
    let (x, cos, sin) = (
        into_contiguous(x),
        into_contiguous(cos),
        into_contiguous(sin),
    );
    let shape = x.meta.shape().clone();
    let (seq, half) = (shape[1], shape[2] / 2);
    let y = empty_like(&x, shape.clone(), x.dtype);
    let (count, dim) = elemwise(&x, shape.num_elements() / 2);
    let dtype = x.dtype;
    elementwise::rope_kernel::launch(
        &x.client.clone(),
        count,
        dim,
        x.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        seq as u32,
        half as u32,
        inverse,
        dtype_to_storage_type(dtype),
    );
    y
}

/// `FusedKernels::fused_adamw_step` on CubeCL primitives.
pub(crate) fn adamw_step(
    param: CubeTensor,
    grad: CubeTensor,
    m: CubeTensor,
    v: CubeTensor,
    hyper: AdamWHyper,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (param, m, v) = (owned(param), owned(m), owned(v));
    let grad = into_contiguous(grad);
    let n = param.meta.shape().num_elements();
    let (count, dim) = elemwise(&param, n);
    let (bc1, bc2) = hyper.bias_corrections();
    let dtype = param.dtype;
    elementwise::adamw_kernel::launch(
        &param.client.clone(),
        count,
        dim,
        param.clone().into_tensor_arg(),
        grad.into_tensor_arg(),
        m.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        hyper.lr as f32,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        (1.0 - hyper.lr * hyper.weight_decay as f64) as f32,
        bc1,
        bc2,
        dtype_to_storage_type(dtype),
    );
    (param, m, v)
}

/// `FusedKernels::fused_ce_stats` on CubeCL primitives.
pub(crate) fn ce_stats(logits: CubeTensor) -> CubeTensor {
    let logits = into_contiguous(logits);
    let (rows, cols) = dims2(&logits);
    let dtype = logits.dtype;
    let stats = empty_like(&logits, Shape::new([rows, 2]), DType::F32);
    let block = ROW_BLOCK;
    cross_entropy::ce_stats_kernel::launch(
        &logits.client.clone(),
        row_grid(rows),
        CubeDim::new_1d(block),
        logits.into_tensor_arg(),
        stats.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        block,
        dtype_to_storage_type(dtype),
    );
    stats
}

/// `FusedKernels::fused_ce_nll` on CubeCL primitives.
pub(crate) fn ce_nll(
    logits: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
    vocab_start: usize,
    count_lse: bool,
    ignore_index: i64,
) -> CubeTensor {
    let (logits, targets, lse) = (
        into_contiguous(logits),
        into_contiguous(targets),
        f32_contiguous(lse),
    );
    let (rows, cols) = dims2(&logits);
    let (fdtype, idtype) = (logits.dtype, targets.dtype);
    let nll = empty_like(&logits, Shape::new([rows]), DType::F32);
    let (count, dim) = elemwise(&logits, rows);
    let (ignore, has_ignore) = ignore_arg(ignore_index);
    cross_entropy::ce_nll_kernel::launch(
        &logits.client.clone(),
        count,
        dim,
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        lse.into_tensor_arg(),
        nll.clone().into_tensor_arg(),
        cols as u32,
        vocab_start as i32,
        ignore,
        has_ignore,
        count_lse,
        [dtype_to_storage_type(fdtype), dtype_to_storage_type(idtype)],
    );
    nll
}

/// `FusedKernels::fused_ce_backward` on CubeCL primitives.
pub(crate) fn ce_backward(
    dnll: CubeTensor,
    logits: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
    vocab_start: usize,
    ignore_index: i64,
) -> CubeTensor {
    let (dnll, logits) = (f32_contiguous(dnll), into_contiguous(logits));
    let (targets, lse) = (into_contiguous(targets), f32_contiguous(lse));
    let (_, cols) = dims2(&logits);
    let (fdtype, idtype) = (logits.dtype, targets.dtype);
    let shape = logits.meta.shape().clone();
    let dlogits = empty_like(&logits, shape.clone(), fdtype);
    let (count, dim) = elemwise(&logits, shape.num_elements());
    let (ignore, has_ignore) = ignore_arg(ignore_index);
    cross_entropy::ce_backward_kernel::launch(
        &logits.client.clone(),
        count,
        dim,
        dnll.into_tensor_arg(),
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        lse.into_tensor_arg(),
        dlogits.clone().into_tensor_arg(),
        cols as u32,
        vocab_start as i32,
        ignore,
        has_ignore,
        [dtype_to_storage_type(fdtype), dtype_to_storage_type(idtype)],
    );
    dlogits
}
