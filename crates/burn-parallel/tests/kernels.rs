//! Fused kernels against references.
//!
//! - `flex_*` (always run): the fused ops on `flex` (the composed references with hand-written
//!   backward steps) against autodiff of the naive math.
//! - `wgpu::*` (feature `wgpu`): the CubeCL kernels on WGPU against the naive math on `flex`,
//!   forward and every gradient, on shapes that are not multiples of the workgroup size. Without
//!   an adapter each prints `SKIPPED <test>: no WGPU adapter ...` past libtest's output capture
//!   (so that it shows in `cargo test` output) and returns; with `BURN_PARALLEL_REQUIRE_WGPU=1`
//!   it fails instead.
//!
//! Errors are "relative": `max |a - b| / max |b|` over the tensor (stated per test).

use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::module::layer_norm;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_parallel::kernels::{self, AdamWHyper, KernelError};

mod common;

/// Deterministic values in `[-scale, scale)` (a 64-bit LCG).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: u64, scale: f32, device: &Device) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed, scale), shape), device)
}

fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone().into_data().try_into_vec_as::<f32>().unwrap()
}

/// `max |a - b| / max(max |b|, floor)`.
fn rel_err(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(floor);
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff.is_finite(), "non-finite difference");
    diff / scale
}

/// Relative error `max |a - b| / max |b|` at most `tol`.
fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_close_floor(what, a, b, tol, 1e-30);
}

/// Relative error with the scale floored at `floor`, for gradients that are (nearly) zero in
/// exact arithmetic, such as the input gradient of a width-1 RMSNorm, `w eps / (x^2 + eps)^1.5`,
/// whose fp32 value is cancellation noise in any formula.
fn assert_close_floor(what: &str, a: &[f32], b: &[f32], tol: f32, floor: f32) {
    let err = rel_err(a, b, floor);
    assert!(err <= tol, "{what}: relative error {err:e} > {tol:e}");
}

fn targets(
    rows: usize,
    vocab: usize,
    seed: u64,
    ignore: Option<i64>,
    device: &Device,
) -> Tensor<1, Int> {
    let ids: Vec<i64> = values(rows, seed, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| match ignore {
            Some(ig) if i % 4 == 1 => ig,
            _ => (((v + 1.0) * 0.5 * vocab as f32) as i64).clamp(0, vocab as i64 - 1),
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows]), device)
}

// ---------------------------------------------------------------------------------------------
// Naive math (autodiff of composed ops): the oracle.

fn naive_rms(x: Tensor<2>, w: Tensor<1>, eps: f64) -> Tensor<2> {
    let rms = (x.clone().square().mean_dim(1) + eps).sqrt();
    x / rms * w.unsqueeze()
}

fn naive_rope(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    let half = x.dims()[3] / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x2 * cos + x1 * sin;
    Tensor::cat(vec![r1, r2], 3)
}

fn naive_ce(logits: Tensor<2>, targets: Tensor<1, Int>, ignore: Option<i64>) -> Tensor<1> {
    let [n, _] = logits.dims();
    let ids: Vec<i64> = targets
        .clone()
        .into_data()
        .try_into_vec_as::<i64>()
        .unwrap();
    let keep: Vec<f32> = ids
        .iter()
        .map(|&t| if Some(t) == ignore { 0.0 } else { 1.0 })
        .collect();
    let counted = keep.iter().sum::<f32>().max(1.0);
    let safe: Vec<i64> = ids
        .iter()
        .map(|&t| if Some(t) == ignore { 0 } else { t })
        .collect();
    let device = logits.device();
    let safe = Tensor::<1, Int>::from_data(TensorData::new(safe, [n]), &device);
    let keep = Tensor::<1>::from_data(TensorData::new(keep, [n]), &device);
    let picked = log_softmax(logits, 1)
        .gather(1, safe.reshape([n, 1]))
        .reshape([n]);
    (picked * keep).sum().neg() / counted as f64
}

/// Tables of `examples::gpt::Rope` for `seq` positions.
fn rope_tables(seq: usize, head_dim: usize, device: &Device) -> (Tensor<4>, Tensor<4>) {
    let half = head_dim / 2;
    let (mut c, mut s) = (vec![], vec![]);
    for p in 0..seq {
        for i in 0..half {
            let a = p as f64 * 10_000f64.powf(-2.0 * i as f64 / head_dim as f64);
            c.push(a.cos() as f32);
            s.push(a.sin() as f32);
        }
    }
    (
        Tensor::from_data(TensorData::new(c, [1, 1, seq, half]), device),
        Tensor::from_data(TensorData::new(s, [1, 1, seq, half]), device),
    )
}

// ---------------------------------------------------------------------------------------------
// Checks shared by flex and wgpu: run the fused op on `dev` (autodiff), the naive math on
// autodiff flex, compare forward and gradients with tolerance `tol`.

fn check_norm(dev: &Device, rows: usize, cols: usize, rms: bool, tol: f32) {
    check_norm_in(dev, rows, cols, rms, DType::F32, tol);
}

/// [`check_norm`] computing in `dtype` (inputs cast from the fp32 leaves, output cast back).
fn check_norm_in(dev: &Device, rows: usize, cols: usize, rms: bool, dtype: DType, tol: f32) {
    let oracle = Device::flex().autodiff();
    let seed = (rows * 31 + cols) as u64;
    let make = |d: &Device| {
        (
            tensor([rows, cols], seed, 2.0, d)
                .add_scalar(0.5)
                .require_grad(),
            tensor([cols], seed + 1, 1.0, d)
                .add_scalar(1.0)
                .require_grad(),
            tensor([cols], seed + 2, 0.5, d).require_grad(),
            tensor([rows, cols], seed + 3, 1.0, d),
        )
    };
    let (x, w, b, r) = make(dev);
    let (xc, wc, bc) = (
        x.clone().cast(dtype),
        w.clone().cast(dtype),
        b.clone().cast(dtype),
    );
    let y = if rms {
        kernels::rms_norm(xc, wc, 1e-5).unwrap()
    } else {
        kernels::layer_norm(xc, wc, Some(bc), 1e-5).unwrap()
    }
    .cast(DType::F32);
    let g = (y.clone() * r).sum().backward();

    let (xo, wo, bo, ro) = make(&oracle);
    let yo = if rms {
        naive_rms(xo.clone(), wo.clone(), 1e-5)
    } else {
        layer_norm(xo.clone(), wo.clone(), Some(bo.clone()), 1e-5)
    };
    let go = (yo.clone() * ro).sum().backward();
    let name = format!(
        "{} {dtype:?} [{rows}, {cols}]",
        if rms { "rms_norm" } else { "layer_norm" }
    );
    assert_close(&format!("{name} y"), &host(&y), &host(&yo), tol);
    // dx relative to max(max |dx|, 0.01): see `assert_close_floor`.
    assert_close_floor(
        &format!("{name} dx"),
        &host(&x.grad(&g).unwrap()),
        &host(&xo.grad(&go).unwrap()),
        tol,
        1e-2,
    );
    assert_close(
        &format!("{name} dw"),
        &host(&w.grad(&g).unwrap()),
        &host(&wo.grad(&go).unwrap()),
        tol,
    );
    if !rms {
        assert_close(
            &format!("{name} db"),
            &host(&b.grad(&g).unwrap()),
            &host(&bo.grad(&go).unwrap()),
            tol,
        );
    }
}

fn check_swiglu(dev: &Device, shape: [usize; 3], tol: f32) {
    let oracle = Device::flex().autodiff();
    let n: usize = shape.iter().product();
    let make = |d: &Device| {
        (
            tensor(shape, n as u64, 4.0, d).require_grad(),
            tensor(shape, n as u64 + 1, 2.0, d).require_grad(),
            tensor(shape, n as u64 + 2, 1.0, d),
        )
    };
    let (a, b, r) = make(dev);
    let y = kernels::swiglu(a.clone(), b.clone()).unwrap();
    let g = (y.clone() * r).sum().backward();
    let (ao, bo, ro) = make(&oracle);
    let yo = silu(ao.clone()) * bo.clone();
    let go = (yo.clone() * ro).sum().backward();
    assert_close("swiglu y", &host(&y), &host(&yo), tol);
    assert_close(
        "swiglu da",
        &host(&a.grad(&g).unwrap()),
        &host(&ao.grad(&go).unwrap()),
        tol,
    );
    assert_close(
        "swiglu db",
        &host(&b.grad(&g).unwrap()),
        &host(&bo.grad(&go).unwrap()),
        tol,
    );
}

/// How an attention operand `[b, h, t, d]` is laid out in memory.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Contiguous `[b, h, t, d]`.
    Heads,
    /// The `swap_dims(1, 2)` view of a contiguous `[b, t, h, d]` (a model's projections with
    /// the heads split off): read in place.
    Rows,
    /// The `swap_dims(2, 3)` view of a contiguous `[b, h, d, t]`: columns not contiguous,
    /// made contiguous first.
    Cols,
}

/// A random leaf in `layout` and its `[b, h, t, d]` view.
fn operand(
    [b, h, t, d]: [usize; 4],
    seed: u64,
    scale: f32,
    layout: Layout,
    dev: &Device,
) -> (Tensor<4>, Tensor<4>) {
    let leaf = match layout {
        Layout::Heads => tensor([b, h, t, d], seed, scale, dev),
        Layout::Rows => tensor([b, t, h, d], seed, scale, dev),
        Layout::Cols => tensor([b, h, d, t], seed, scale, dev),
    }
    .require_grad();
    let view = as_heads(leaf.clone(), layout);
    (leaf, view)
}

/// `x` (laid out as `layout`) seen as `[b, h, t, d]`.
fn as_heads(x: Tensor<4>, layout: Layout) -> Tensor<4> {
    match layout {
        Layout::Heads => x,
        Layout::Rows => x.swap_dims(1, 2),
        Layout::Cols => x.swap_dims(2, 3),
    }
}

/// Attention of `q` `[b, h, tq, d]` over `k`, `v` `[b, h, tk, d]` against softmax of the
/// masked scores composed from Burn ops.
fn check_attention(dev: &Device, q_shape: [usize; 4], tk: usize, causal: bool, tol: f32) {
    check_attention_in(dev, q_shape, tk, causal, [Layout::Heads; 3], tol);
}

/// [`check_attention`] with `q`, `k`, `v` laid out as `layouts`.
fn check_attention_in(
    dev: &Device,
    q_shape: [usize; 4],
    tk: usize,
    causal: bool,
    layouts: [Layout; 3],
    tol: f32,
) {
    let oracle = Device::flex().autodiff();
    let [b, h, tq, d] = q_shape;
    let kv_shape = [b, h, tk, d];
    let seed = (b * 1000 + h * 100 + tq * 10 + tk + d) as u64;
    let make = |dev: &Device| {
        (
            operand(q_shape, seed, 2.0, layouts[0], dev),
            operand(kv_shape, seed + 1, 2.0, layouts[1], dev),
            operand(kv_shape, seed + 2, 1.0, layouts[2], dev),
            tensor(q_shape, seed + 3, 1.0, dev),
        )
    };
    let ((q, qv), (k, kv), (v, vv), r) = make(dev);
    let y = kernels::attention(qv, kv, vv, causal).unwrap();
    let g = (y.clone() * r).sum().backward();

    let ((qo, qov), (ko, kov), (vo, vov), ro) = make(&oracle);
    let mut scores = qov.matmul(kov.swap_dims(2, 3)) / (d as f64).sqrt();
    if causal {
        let ids = |n: usize| Tensor::<1, Int>::arange(0..n as i64, &oracle);
        let hidden = ids(tk)
            .reshape([1, tk])
            .expand([tq, tk])
            .greater(ids(tq).reshape([tq, 1]).expand([tq, tk]) + (tk - tq) as i64);
        scores = scores.mask_fill(
            hidden.unsqueeze::<4>().expand([b, h, tq, tk]),
            f32::NEG_INFINITY,
        );
    }
    let yo = burn::tensor::activation::softmax(scores, 3).matmul(vov);
    let go = (yo.clone() * ro).sum().backward();
    let name = format!("attention q {q_shape:?} tk {tk} causal {causal} {layouts:?}");
    assert_close(&format!("{name} y"), &host(&y), &host(&yo), tol);
    for (i, (what, t, o)) in [("dq", &q, &qo), ("dk", &k, &ko), ("dv", &v, &vo)]
        .into_iter()
        .enumerate()
    {
        assert_close(
            &format!("{name} {what}"),
            &host(&as_heads(t.grad(&g).unwrap(), layouts[i])),
            &host(&as_heads(o.grad(&go).unwrap(), layouts[i])),
            tol,
        );
    }
}

/// `x w (+ b)` against Burn's matmul and add under autodiff, with and without a bias.
fn check_linear(dev: &Device, x_shape: [usize; 3], out: usize, tol: f32) {
    check_linear_in(dev, x_shape, out, DType::F32, tol);
}

/// [`check_linear`] with the layer computing in `dtype` (its inputs cast from the fp32 leaves,
/// its output cast back), against the fp32 oracle.
fn check_linear_in(dev: &Device, x_shape: [usize; 3], out: usize, dtype: DType, tol: f32) {
    let oracle = Device::flex().autodiff();
    let k = x_shape[2];
    let seed = (x_shape.iter().product::<usize>() + out) as u64;
    for with_bias in [true, false] {
        let make = |d: &Device| {
            (
                tensor(x_shape, seed, 2.0, d).require_grad(),
                tensor([k, out], seed + 1, 1.0, d).require_grad(),
                tensor([out], seed + 2, 1.0, d).require_grad(),
                tensor([x_shape[0], x_shape[1], out], seed + 3, 1.0, d),
            )
        };
        let (x, w, b, r) = make(dev);
        let bias = with_bias.then(|| b.clone().cast(dtype));
        let y = kernels::linear(x.clone().cast(dtype), w.clone().cast(dtype), bias)
            .unwrap()
            .cast(DType::F32);
        let g = (y.clone() * r).sum().backward();
        let (xo, wo, bo, ro) = make(&oracle);
        let mut yo = xo.clone().matmul(wo.clone().unsqueeze::<3>());
        if with_bias {
            yo = yo + bo.clone().unsqueeze::<3>();
        }
        let go = (yo.clone() * ro).sum().backward();
        let name = format!("linear {dtype:?} {x_shape:?} x [{k}, {out}] bias {with_bias}");
        assert_close(&format!("{name} y"), &host(&y), &host(&yo), tol);
        assert_close(
            &format!("{name} dx"),
            &host(&x.grad(&g).unwrap()),
            &host(&xo.grad(&go).unwrap()),
            tol,
        );
        assert_close(
            &format!("{name} dw"),
            &host(&w.grad(&g).unwrap()),
            &host(&wo.grad(&go).unwrap()),
            tol,
        );
        match with_bias {
            true => assert_close(
                &format!("{name} db"),
                &host(&b.grad(&g).unwrap()),
                &host(&bo.grad(&go).unwrap()),
                tol,
            ),
            false => assert!(
                b.grad(&g).is_none(),
                "{name}: an absent bias got a gradient"
            ),
        }
    }
}

/// Exact and tanh GELU against Burn's `gelu` / `gelu_approximate` under autodiff.
fn check_gelu(dev: &Device, shape: [usize; 3], tol: f32) {
    let oracle = Device::flex().autodiff();
    let n: usize = shape.iter().product();
    for approximate in [false, true] {
        let make = |d: &Device| {
            (
                tensor(shape, n as u64 + 7, 5.0, d).require_grad(),
                tensor(shape, n as u64 + 8, 1.0, d),
            )
        };
        let (x, r) = make(dev);
        let y = kernels::gelu(x.clone(), approximate);
        let g = (y.clone() * r).sum().backward();
        let (xo, ro) = make(&oracle);
        let yo = if approximate {
            burn::tensor::activation::gelu_approximate(xo.clone())
        } else {
            burn::tensor::activation::gelu(xo.clone())
        };
        let go = (yo.clone() * ro).sum().backward();
        let name = format!("gelu {shape:?} approximate {approximate}");
        assert_close(&format!("{name} y"), &host(&y), &host(&yo), tol);
        assert_close(
            &format!("{name} dx"),
            &host(&x.grad(&g).unwrap()),
            &host(&xo.grad(&go).unwrap()),
            tol,
        );
    }
}

fn check_rope(dev: &Device, shape: [usize; 4], tol: f32) {
    let oracle = Device::flex().autodiff();
    let [_, _, seq, hd] = shape;
    let make = |d: &Device| {
        (
            tensor(shape, seq as u64 * 7 + hd as u64, 1.0, d).require_grad(),
            tensor(shape, 99, 1.0, d),
        )
    };
    let (x, r) = make(dev);
    let (c, s) = rope_tables(seq, hd, dev);
    let y = kernels::rope(x.clone(), c, s).unwrap();
    let g = (y.clone() * r).sum().backward();
    let (xo, ro) = make(&oracle);
    let (co, so) = rope_tables(seq, hd, &oracle);
    let yo = naive_rope(xo.clone(), co, so);
    let go = (yo.clone() * ro).sum().backward();
    assert_close("rope y", &host(&y), &host(&yo), tol);
    assert_close(
        "rope dx",
        &host(&x.grad(&g).unwrap()),
        &host(&xo.grad(&go).unwrap()),
        tol,
    );
}

fn check_ce(dev: &Device, rows: usize, vocab: usize, ignore: Option<i64>, tol: f32) {
    check_ce_in(dev, rows, vocab, ignore, DType::F32, tol);
}

/// [`check_ce`] on logits cast to `dtype` (the loss cast back to fp32).
fn check_ce_in(
    dev: &Device,
    rows: usize,
    vocab: usize,
    ignore: Option<i64>,
    dtype: DType,
    tol: f32,
) {
    let oracle = Device::flex().autodiff();
    let seed = (rows * 13 + vocab) as u64;
    let x = tensor([rows, vocab], seed, 8.0, dev).require_grad();
    let t = targets(rows, vocab, seed, ignore, dev);
    let loss = kernels::cross_entropy(x.clone().cast(dtype), t, ignore)
        .unwrap()
        .cast(DType::F32);
    let g = (loss.clone() * 1.5).backward();
    let xo = tensor([rows, vocab], seed, 8.0, &oracle).require_grad();
    let to = targets(rows, vocab, seed, ignore, &oracle);
    let lo = naive_ce(xo.clone(), to, ignore);
    let go = (lo.clone() * 1.5).backward();
    let what = format!("cross_entropy {dtype:?} [{rows}, {vocab}] ignore {ignore:?}");
    assert_close(&format!("{what} loss"), &host(&loss), &host(&lo), tol);
    assert_close(
        &format!("{what} dlogits"),
        &host(&x.grad(&g).unwrap()),
        &host(&xo.grad(&go).unwrap()),
        tol,
    );
}

/// AdamW against Burn-semantics host math in f64 over 3 steps.
fn check_adamw(dev: &Device, n: usize, param_dtype: DType, tol: f32) {
    let h0 = AdamWHyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    let mut p = tensor([n], 5, 1.0, dev).cast(param_dtype);
    let mut m = Tensor::<1>::zeros([n], dev);
    let mut v = Tensor::<1>::zeros([n], dev);
    let mut hp: Vec<f64> = host(&p).iter().map(|&x| x as f64).collect();
    let (mut hm, mut hv) = (vec![0f64; n], vec![0f64; n]);
    for step in 1..=3u32 {
        let h = AdamWHyper { step, ..h0 };
        let gv = values(n, 100 + step as u64, 1.0);
        let g = Tensor::<1>::from_data(TensorData::new(gv.clone(), [n]), dev).cast(param_dtype);
        let gv: Vec<f64> = host(&g).iter().map(|&x| x as f64).collect();
        (p, m, v) = kernels::adamw_step(p, g, m, v, h).unwrap();
        let (bc1, bc2) = h.bias_corrections();
        for (((p, m), v), g) in hp.iter_mut().zip(&mut hm).zip(&mut hv).zip(&gv) {
            *m = *m * 0.9f32 as f64 + g * (1.0 - 0.9f32 as f64);
            *v = *v * 0.95f32 as f64 + g * g * (1.0 - 0.95f32 as f64);
            let upd = (*m / bc1 as f64) / ((*v / bc2 as f64).sqrt() + 1e-8f32 as f64);
            *p = *p * (1.0 - 1e-2 * 0.1f32 as f64) - 1e-2 * upd;
        }
    }
    let as32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    assert_close("adamw m", &host(&m), &as32(&hm), tol);
    assert_close("adamw v", &host(&v), &as32(&hv), tol);
    assert_close("adamw param", &host(&p), &as32(&hp), tol);
    assert_eq!(p.dtype(), param_dtype);
    assert_eq!(m.dtype(), DType::F32);
}

// ---------------------------------------------------------------------------------------------
// flex: references with hand-written backward vs autodiff of the naive math (tolerance 1e-5).

#[test]
fn flex_norms_match_naive_math() {
    let dev = Device::flex().autodiff();
    for (rows, cols) in [(37, 19), (1, 64), (5, 1), (3, 300)] {
        check_norm(&dev, rows, cols, true, 1e-5);
        check_norm(&dev, rows, cols, false, 1e-5);
    }
}

#[test]
fn flex_swiglu_rope_match_naive_math() {
    let dev = Device::flex().autodiff();
    check_swiglu(&dev, [3, 5, 7], 1e-6);
    check_rope(&dev, [2, 3, 5, 6], 1e-6);
}

#[test]
fn flex_attention_matches_naive_math() {
    let dev = Device::flex().autodiff();
    // Odd sizes: partial query blocks and key tiles, a single row, more keys than queries.
    for (q_shape, tk, causal) in [
        ([2, 3, 5, 4], 5, true),
        ([1, 2, 70, 8], 70, true),
        ([1, 1, 1, 3], 1, true),
        ([2, 2, 37, 6], 130, false),
        ([1, 2, 33, 5], 100, true),
        ([1, 1, 129, 16], 129, true),
    ] {
        check_attention(&dev, q_shape, tk, causal, 1e-5);
    }
}

/// The layout a model hands attention (`[b, s, h, d]` projections seen as `[b, h, s, d]`),
/// which the kernel reads and writes in place, mixed layouts, and columns that are not
/// contiguous, all against the naive math, on one thread and split over three.
#[test]
fn flex_attention_reads_strided_layouts() {
    use Layout::{Cols, Heads, Rows};
    let dev = Device::flex().autodiff();
    for threads in [1, 3] {
        burn_parallel::threads::set_intra_op_threads(Some(threads));
        for (q_shape, tk, causal, layouts) in [
            ([2, 3, 70, 8], 70, true, [Rows; 3]),
            ([3, 2, 37, 6], 37, false, [Rows; 3]),
            ([2, 2, 33, 5], 100, true, [Rows; 3]),
            ([2, 3, 21, 4], 21, true, [Rows, Heads, Rows]),
            ([1, 2, 9, 4], 30, false, [Cols, Rows, Heads]),
        ] {
            check_attention_in(&dev, q_shape, tk, causal, layouts, 1e-5);
        }
    }
    burn_parallel::threads::set_intra_op_threads(None);
}

#[test]
fn flex_attention_threads_give_the_same_result() {
    // Large enough to be split over threads; the result must not depend on the split.
    let dev = Device::flex().autodiff();
    burn_parallel::threads::set_intra_op_threads(Some(3));
    check_attention(&dev, [2, 3, 150, 16], 150, true, 1e-5);
    check_norm(&dev, 301, 64, false, 1e-5);
    check_gelu(&dev, [3, 101, 257], 1e-5);
    // 512 rows x 150 outputs: the bias rows and the bias gradient's columns are split too.
    check_linear(&dev, [4, 128, 160], 150, 1e-5);
    burn_parallel::threads::set_intra_op_threads(None);
}

#[test]
fn flex_linear_matches_naive_math() {
    let dev = Device::flex().autodiff();
    check_linear(&dev, [2, 5, 7], 3, 1e-5);
    check_linear(&dev, [1, 1, 1], 1, 1e-5);
    check_linear(&dev, [3, 67, 130], 129, 1e-5);
}

/// On a backend without the fused kernels (NdArray), `linear`, `attention` and `gelu` run as
/// Burn's composed operations instead of failing (the plan-aware `Linear` calls `linear` on
/// every backend).
#[cfg(feature = "ndarray")]
#[test]
#[allow(deprecated)] // Burn 0.22 deprecates NdArray; users still run it.
fn ndarray_falls_back_to_composed_operations() {
    let dev = Device::ndarray().autodiff();
    assert!(!kernels::supported(&dev));
    check_linear(&dev, [2, 5, 7], 3, 1e-5);
    check_attention(&dev, [1, 2, 9, 4], 9, true, 1e-5);
    // Burn's own GELU gradient on NdArray differs from Flex's by ~8e-4 (its `erf`), not ours.
    check_gelu(&dev, [3, 5, 7], 2e-3);
}

#[test]
fn flex_gelu_matches_naive_math() {
    let dev = Device::flex().autodiff();
    check_gelu(&dev, [3, 5, 7], 1e-5);
    check_gelu(&dev, [1, 1, 1], 1e-5);
}

#[test]
fn flex_cross_entropy_matches_naive_math() {
    let dev = Device::flex().autodiff();
    check_ce(&dev, 7, 11, None, 1e-5);
    check_ce(&dev, 9, 13, Some(-100), 1e-5);
    check_ce(&dev, 1, 5, None, 1e-5);
}

#[test]
fn flex_cross_entropy_all_ignored_is_zero() {
    let dev = Device::flex().autodiff();
    let x = tensor([2, 4], 1, 1.0, &dev).require_grad();
    let t = Tensor::<1, Int>::from_data([-100i64, -100], &dev);
    let loss = kernels::cross_entropy(x.clone(), t, Some(-100)).unwrap();
    let g = loss.clone().backward();
    assert_eq!(host(&loss), vec![0.0]);
    assert!(host(&x.grad(&g).unwrap()).iter().all(|&v| v == 0.0));
}

#[test]
fn flex_adamw_matches_host_math() {
    check_adamw(&Device::flex(), 1001, DType::F32, 1e-5);
}

/// The fused AdamW is a drop-in for Burn's `AdamW` on a flat shard (as the ZeRO sharded
/// optimizer runs it): 3 steps, tolerance 1e-6 relative.
#[test]
fn flex_adamw_matches_burn_adamw_on_a_flat_shard() {
    use burn::optim::{AdamWConfig, Optimizer};
    let dev = Device::flex();
    let config = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.98)
        .with_epsilon(1e-7)
        .with_weight_decay(0.05);
    let burn_adamw = config.build();
    let n = 513;
    let mut p_burn = tensor([n], 1, 1.0, &dev);
    let mut state = None;
    let mut p = p_burn.clone();
    let mut m = Tensor::<1>::zeros([n], &dev);
    let mut v = Tensor::<1>::zeros([n], &dev);
    for step in 1..=3u32 {
        let lr = 1e-2 / step as f64;
        let g = tensor([n], 10 + step as u64, 1.0, &dev);
        (p_burn, state) = burn_adamw.step(lr, p_burn, g.clone(), state);
        let h = AdamWHyper {
            lr,
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-7,
            weight_decay: 0.05,
            step,
        };
        (p, m, v) = kernels::adamw_step(p, g, m, v, h).unwrap();
    }
    assert_close("adamw vs burn", &host(&p), &host(&p_burn), 1e-6);
}

#[test]
fn typed_errors() {
    let dev = Device::flex();
    let x = Tensor::<2>::zeros([2, 3], &dev);
    assert!(matches!(
        kernels::rms_norm(x.clone(), Tensor::zeros([4], &dev), 1e-5),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        kernels::rms_norm(x.clone(), Tensor::ones([3], &dev), 0.0),
        Err(KernelError::Argument { .. })
    ));
    assert!(matches!(
        kernels::swiglu(x.clone(), Tensor::zeros([3, 2], &dev)),
        Err(KernelError::Shape { .. })
    ));
    let t = Tensor::<1, Int>::from_data([0i64, 3], &dev);
    assert!(matches!(
        kernels::cross_entropy(x.clone(), t, None),
        Err(KernelError::Argument { .. })
    ));
    let (c, s) = rope_tables(2, 4, &dev);
    assert!(matches!(
        kernels::rope(Tensor::<4>::zeros([1, 1, 3, 4], &dev), c, s),
        Err(KernelError::Shape { .. })
    ));
    let h = AdamWHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 0,
    };
    let z = Tensor::<1>::zeros([3], &dev);
    assert!(matches!(
        kernels::adamw_step(z.clone(), z.clone(), z.clone(), z, h),
        Err(KernelError::Argument { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// WGPU: the CubeCL kernels.

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;

    fn device(test: &str) -> Option<Device> {
        common::wgpu_device(&format!("wgpu::{test}"))
    }

    fn f16_device(test: &str) -> Option<Device> {
        common::wgpu_f16_device(&format!("wgpu::{test}"))
    }

    /// fp32, tolerance 1e-5 relative: odd rows and widths, a single row, width 1, rows wider
    /// than a cube (300 > 256), and more rows than 64 (several row groups in the weight grad).
    #[test]
    fn norms_fp32() {
        let Some(dev) = device("norms_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        for (rows, cols) in [(37, 19), (1, 64), (5, 1), (3, 300), (131, 33), (1, 1)] {
            check_norm(&dev, rows, cols, true, 1e-5);
            check_norm(&dev, rows, cols, false, 1e-5);
        }
    }

    /// fp32, tolerance 1e-6 relative, 105 and 2,049 elements (not multiples of a cube).
    #[test]
    fn swiglu_fp32() {
        let Some(dev) = device("swiglu_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        check_swiglu(&dev, [3, 5, 7], 1e-6);
        check_swiglu(&dev, [1, 1, 2049], 1e-6);
    }

    /// fp32, tolerance 1e-6 relative; head_dim 6 and 2, odd sequence lengths.
    #[test]
    fn rope_fp32() {
        let Some(dev) = device("rope_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        check_rope(&dev, [2, 3, 5, 6], 1e-6);
        check_rope(&dev, [1, 1, 1, 2], 1e-6);
        check_rope(&dev, [3, 2, 17, 16], 1e-6);
    }

    /// fp32, tolerance 1e-5 relative: GPT-2's vocabulary of 50,257, a single row, an ignored
    /// index, odd widths.
    #[test]
    fn cross_entropy_fp32() {
        let Some(dev) = device("cross_entropy_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        check_ce(&dev, 3, 50_257, None, 1e-5);
        check_ce(&dev, 1, 50_257, None, 1e-5);
        check_ce(&dev, 9, 13, Some(-100), 1e-5);
        check_ce(&dev, 5, 1, None, 1e-5);
    }

    /// fp32 parameters, tolerance 1e-5 relative; 1,001 elements.
    #[test]
    fn adamw_fp32() {
        let Some(dev) = device("adamw_fp32") else {
            return;
        };
        check_adamw(&dev, 1001, DType::F32, 1e-5);
    }

    /// f16 parameters (fp32 state), tolerance 2e-3 relative (f16 rounding of the parameter),
    /// when the adapter supports f16.
    #[test]
    fn adamw_f16_params() {
        let Some(dev) = f16_device("adamw_f16_params") else {
            return;
        };
        check_adamw(&dev, 1001, DType::F16, 2e-3);
    }

    /// f16 norm/SwiGLU forward against the fp32 oracle, tolerance 5e-3 relative, when the
    /// adapter supports f16.
    #[test]
    fn norms_swiglu_f16_forward() {
        let Some(dev) = f16_device("norms_swiglu_f16_forward") else {
            return;
        };
        let x = tensor([37, 19], 1, 2.0, &dev);
        let w = tensor([19], 2, 1.0, &dev).add_scalar(1.0);
        let y = kernels::rms_norm(x.clone().cast(DType::F16), w.clone().cast(DType::F16), 1e-5)
            .unwrap();
        let yo = naive_rms(x.clone(), w, 1e-5);
        assert_close("rms_norm f16", &host(&y), &host(&yo), 5e-3);
        let a = tensor([3, 5, 7], 3, 3.0, &dev);
        let b = tensor([3, 5, 7], 4, 3.0, &dev);
        let y = kernels::swiglu(a.clone().cast(DType::F16), b.clone().cast(DType::F16)).unwrap();
        assert_close("swiglu f16", &host(&y), &host(&(silu(a) * b)), 5e-3);
    }

    /// Norms and the cross-entropy in f16, forward and every gradient, against the fp32 naive
    /// math (2e-2 relative: f16 inputs and outputs, fp32 statistics); then the same shapes in
    /// fp32 in the same thread (1e-5), so an fp32 call after an f16 one of the same kernel
    /// must get the fp32 kernel, as a mixed-precision run's fp32 evaluation does.
    #[test]
    fn norms_and_cross_entropy_f16_then_fp32() {
        let Some(dev) = f16_device("norms_and_cross_entropy_f16_then_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        for dtype in [DType::F16, DType::F32] {
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            check_norm_in(&dev, 37, 19, false, dtype, tol);
            check_norm_in(&dev, 37, 19, true, dtype, tol);
            check_norm_in(&dev, 64, 128, false, dtype, tol);
            check_ce_in(&dev, 29, 67, Some(3), dtype, tol);
            check_ce_in(&dev, 64, 256, None, dtype, tol);
        }
    }

    /// Flash attention, fp32, tolerance 1e-4 relative, forward and every gradient against the
    /// naive math: causal and not, odd head widths (3, 5, 24), fewer queries than keys, a single
    /// row, and rows past one cube (64) and one shared tile (32 keys at width 64, 16 at 128).
    #[test]
    fn attention_fp32() {
        let Some(dev) = device("attention_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        for (q_shape, tk, causal) in [
            ([2, 3, 37, 24], 37, true),
            ([2, 3, 37, 24], 37, false),
            ([1, 2, 19, 8], 45, true),
            ([1, 2, 19, 8], 45, false),
            ([1, 2, 130, 64], 130, true),
            ([1, 1, 130, 64], 130, false),
            ([1, 1, 1, 3], 1, true),
            ([2, 1, 70, 5], 200, true),
            ([1, 1, 40, 128], 75, true),
        ] {
            check_attention(&dev, q_shape, tk, causal, 1e-4);
        }
    }

    /// Flash attention forward and backward give bit-identical results run after run (each
    /// output element is written by one unit; no atomics).
    #[test]
    fn attention_is_deterministic() {
        let Some(dev) = device("attention_is_deterministic") else {
            return;
        };
        let dev = dev.autodiff();
        let run = || {
            let q = tensor([1, 2, 130, 64], 1, 2.0, &dev).require_grad();
            let k = tensor([1, 2, 150, 64], 2, 2.0, &dev).require_grad();
            let v = tensor([1, 2, 150, 64], 3, 1.0, &dev).require_grad();
            let y = kernels::attention(q.clone(), k.clone(), v.clone(), true).unwrap();
            let g = (y.clone() * tensor([1, 2, 130, 64], 4, 1.0, &dev))
                .sum()
                .backward();
            [
                host(&y),
                host(&q.grad(&g).unwrap()),
                host(&k.grad(&g).unwrap()),
                host(&v.grad(&g).unwrap()),
            ]
        };
        let (a, b) = (run(), run());
        for (what, (x, y)) in ["y", "dq", "dk", "dv"].iter().zip(a.iter().zip(&b)) {
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "attention {what} differs between runs"
            );
        }
    }

    /// Flash attention on strided operands (`[b, s, h, d]` projections seen as `[b, h, s, d]`,
    /// mixed layouts, non-contiguous columns), fp32, tolerance 1e-4 relative.
    #[test]
    fn attention_strided_fp32() {
        use Layout::{Cols, Heads, Rows};
        let Some(dev) = device("attention_strided_fp32") else {
            return;
        };
        let dev = dev.autodiff();
        for (q_shape, tk, causal, layouts) in [
            ([2, 3, 70, 8], 70, true, [Rows; 3]),
            ([2, 2, 33, 5], 100, true, [Rows; 3]),
            ([2, 3, 21, 4], 21, false, [Rows, Heads, Rows]),
            ([1, 2, 9, 4], 30, false, [Cols, Rows, Heads]),
        ] {
            check_attention_in(&dev, q_shape, tk, causal, layouts, 1e-4);
        }
    }

    /// Flash attention with f16 inputs (fp32 arithmetic) against the fp32 naive math, forward
    /// and gradients (through casts), tolerance 1e-2 relative, when the adapter supports f16.
    #[test]
    fn attention_f16() {
        let Some(dev) = f16_device("attention_f16") else {
            return;
        };
        let dev = dev.autodiff();
        let oracle = Device::flex().autodiff();
        let (q_shape, tk) = ([2, 2, 37, 24], 45);
        let kv_shape = [2, 2, tk, 24];
        for causal in [true, false] {
            let make = |d: &Device| {
                (
                    tensor(q_shape, 1, 2.0, d).require_grad(),
                    tensor(kv_shape, 2, 2.0, d).require_grad(),
                    tensor(kv_shape, 3, 1.0, d).require_grad(),
                    tensor(q_shape, 4, 1.0, d),
                )
            };
            let (q, k, v, r) = make(&dev);
            let half = |t: &Tensor<4>| t.clone().cast(DType::F16);
            let y = kernels::attention(half(&q), half(&k), half(&v), causal)
                .unwrap()
                .cast(DType::F32);
            let g = (y.clone() * r).sum().backward();
            let (qo, ko, vo, ro) = make(&oracle);
            let mut scores = qo.clone().matmul(ko.clone().swap_dims(2, 3)) / (24f64).sqrt();
            if causal {
                let ids = |n: usize| Tensor::<1, Int>::arange(0..n as i64, &oracle);
                let tq = q_shape[2];
                let hidden = ids(tk)
                    .reshape([1, tk])
                    .expand([tq, tk])
                    .greater(ids(tq).reshape([tq, 1]).expand([tq, tk]) + (tk - tq) as i64);
                scores = scores.mask_fill(
                    hidden.unsqueeze::<4>().expand([2, 2, tq, tk]),
                    f32::NEG_INFINITY,
                );
            }
            let yo = burn::tensor::activation::softmax(scores, 3).matmul(vo.clone());
            let go = (yo.clone() * ro).sum().backward();
            let name = format!("attention f16 causal {causal}");
            assert_close(&format!("{name} y"), &host(&y), &host(&yo), 1e-2);
            for (what, t, o) in [("dq", &q, &qo), ("dk", &k, &ko), ("dv", &v, &vo)] {
                assert_close(
                    &format!("{name} {what}"),
                    &host(&t.grad(&g).unwrap()),
                    &host(&o.grad(&go).unwrap()),
                    1e-2,
                );
            }
        }
    }

    /// Fused AdamW on WGPU equals the flex reference bit-for-bit up to fp32 rounding (1e-6).
    #[test]
    fn adamw_matches_flex_reference() {
        let Some(dev) = device("adamw_matches_flex_reference") else {
            return;
        };
        let h = AdamWHyper {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 4,
        };
        let run = |d: &Device| {
            let p = tensor([257], 1, 1.0, d);
            let g = tensor([257], 2, 1.0, d);
            let m = tensor([257], 3, 0.1, d);
            let v = tensor([257], 4, 0.1, d).abs();
            let (p, m, v) = kernels::adamw_step(p, g, m, v, h).unwrap();
            (host(&p), host(&m), host(&v))
        };
        let (a, b) = (run(&dev), run(&Device::flex()));
        assert_close("p", &a.0, &b.0, 1e-6);
        assert_close("m", &a.1, &b.1, 1e-6);
        assert_close("v", &a.2, &b.2, 1e-6);
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA: the linear layer's products through cuBLASLt (they run only where a GPU is).

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn device(test: &str) -> Option<Device> {
        common::cuda_device(&format!("cuda::{test}"))
    }

    /// fp32 (exact: no TF32 unless allowed), 1e-5 relative: odd widths, one row, more rows
    /// than a tile, a 256-wide output; an input that starts inside its buffer (a row slice:
    /// an address 4-byte aligned only), for which the plan must follow the real alignment;
    /// then TF32 once allowed, 5e-3 relative (10-bit mantissa inputs). One test: TF32 is a
    /// process-wide switch, and the fp32 checks must not run while it is on.
    #[test]
    fn linear_fp32_offsets_and_tf32() {
        let Some(dev) = device("linear_fp32_offsets_and_tf32") else {
            return;
        };
        let ad = dev.clone().autodiff();
        for (x, out) in [
            ([2, 5, 7], 3),
            ([1, 1, 1], 1),
            ([3, 67, 130], 129),
            ([2, 64, 96], 256),
        ] {
            check_linear_in(&ad, x, out, DType::F32, 1e-5);
        }
        let make = |d: &Device| {
            let x = tensor([9, 7], 11, 1.0, d).slice([1..9, 0..7]);
            (x, tensor([7, 5], 12, 1.0, d), tensor([5], 13, 1.0, d))
        };
        let (x, w, b) = make(&dev);
        let y = kernels::linear(x, w, Some(b)).unwrap();
        let (xo, wo, bo) = make(&Device::flex());
        let yo = xo.matmul(wo) + bo.unsqueeze::<2>();
        assert_close("linear on a row slice", &host(&y), &host(&yo), 1e-5);
        kernels::allow_tf32(true);
        check_linear_in(&ad, [2, 65, 128], 96, DType::F32, 5e-3);
        kernels::allow_tf32(false);
    }

    /// bf16 and fp16 inputs with fp32 accumulation, against the fp32 oracle: 2e-2 relative
    /// (bf16's 8-bit mantissa on inputs and output).
    #[test]
    fn linear_half() {
        let Some(dev) = device("linear_half") else {
            return;
        };
        let dev = dev.autodiff();
        for dtype in [DType::BF16, DType::F16] {
            check_linear_in(&dev, [2, 37, 64], 48, dtype, 2e-2);
            check_linear_in(&dev, [1, 3, 5], 7, dtype, 2e-2);
        }
    }
}
