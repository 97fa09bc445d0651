//! [`FusedKernels`] on Burn's `Fusion<CubeBackend>`: the `Cube` backend of every build with
//! our `wgpu`, `cuda` or `cpu` feature, which turns on Burn's kernel fusion and autotune.
//!
//! Under fusion a tensor primitive is a lazy handle: Burn records operations on a stream and
//! compiles runs of element-wise work into one kernel when the stream is flushed. Each method
//! here does one of two things:
//!
//! - **A kernel of ours** (norms, SwiGLU, RoPE, AdamW, attention, the cross-entropy pieces) is
//!   queued as one opaque custom operation ([`custom`]): its output shapes and dtypes are known
//!   now, the launch (the functions of [`super`] and [`super::attention`], on the resolved
//!   `CubeTensor`s) runs when the stream executes. Nothing waits, nothing is read back.
//!   Attention is the flash kernels of [`super::attention`]: never a `tq x tk` buffer.
//! - **A composed method** (the linear layer, GELU; attention past the flash kernels' widest
//!   head) is written with Burn's tensor operations on the lazy tensors themselves
//!   ([`reference`]), so fusion sees each operation: GELU's element-wise chain becomes one
//!   kernel and the linear layer's product takes Burn's autotuned matmul.
//!
//! [`to_cube`] and [`from_cube`] move a tensor between the lazy and the resolved form, for the
//! code (NCCL) that needs device buffers.

use burn::backend::Cube;
use burn::backend::fusion::custom::{
    CustomOpIr, HandleContainer, OperationFn, OperationIr, StreamId, TensorIr, TensorSpec,
};
use burn::backend::fusion::{ExecutionError, FusionBackend, FusionRuntime, FusionTensor};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

pub use crate::device::{from_cube, to_cube};
use crate::kernels::{AdamWHyper, FusedKernels, composed, reference};

type Runtime = <CubeBackend as FusionBackend>::FusionRuntime;
type Handles = HandleContainer<<Runtime as FusionRuntime>::FusionHandle>;
type Lazy = FusionTensor<Runtime>;

/// An input of a custom operation.
enum Input {
    Float(Lazy),
    Int(Lazy),
}

/// Queues `run` as one custom operation `id` over `inputs`, with outputs described by
/// `outputs`, and returns the outputs as lazy tensors.
fn custom<const O: usize>(
    id: &'static str,
    inputs: Vec<Input>,
    outputs: [TensorSpec; O],
    run: impl Fn(Vec<CubeTensor>) -> [CubeTensor; O] + Send + Sync + 'static,
) -> [FloatTensor<Cube>; O] {
    let client = match &inputs[0] {
        Input::Float(t) | Input::Int(t) => t.client.clone(),
    };
    let mut irs = Vec::with_capacity(inputs.len());
    let mut ints = Vec::with_capacity(inputs.len());
    for input in inputs {
        let (t, int) = match input {
            Input::Float(t) => (t, false),
            Input::Int(t) => (t, true),
        };
        irs.push(t.into_ir());
        ints.push(int);
    }
    let outs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|s| TensorIr::uninit(client.create_empty_handle(), s.shape, s.dtype))
        .collect();
    let desc = CustomOpIr {
        id: id.into(),
        inputs: irs.clone(),
        outputs: outs.clone(),
        scalars: Vec::new(),
    };
    let ids: Vec<_> = outs.iter().map(|o| o.id).collect();
    let op = OperationFn(move |handles: &mut Handles| {
        let tensors = irs
            .iter()
            .zip(&ints)
            .map(|(ir, &int)| match int {
                true => handles.get_int_tensor::<CubeBackend>(ir),
                false => handles.get_float_tensor::<CubeBackend>(ir),
            })
            .collect();
        for (id, t) in ids.iter().zip(run(tensors)) {
            handles.register_float_tensor::<CubeBackend>(id, t);
        }
        Ok::<(), ExecutionError>(())
    });
    client
        .register(StreamId::current(), OperationIr::Custom(desc), op)
        .try_into()
        .unwrap_or_else(|v: Vec<Lazy>| panic!("{id}: {} outputs, expected {O}", v.len()))
}

/// The inputs of a custom operation, in order, as an array.
/// Whether the linear layer `x [rows, k] w [k, n]` takes cuBLASLt (a CUDA device, a dtype it
/// multiplies, no empty dimension).
#[cfg(feature = "cuda")]
fn cublas_routes(x: &Lazy, w: &Lazy) -> bool {
    let nonempty = x.shape.iter().chain(w.shape.iter()).all(|&d| d > 0);
    nonempty && x.dtype == w.dtype && super::cublas::routes(x.client.device(), x.dtype)
}

fn take<const N: usize>(ts: Vec<CubeTensor>) -> [CubeTensor; N] {
    ts.try_into()
        .unwrap_or_else(|v: Vec<CubeTensor>| panic!("{} inputs, expected {N}", v.len()))
}

fn spec(t: &Lazy) -> TensorSpec {
    TensorSpec::new(t.shape.clone(), t.dtype)
}

fn spec_of(shape: impl Into<Shape>, dtype: DType) -> TensorSpec {
    TensorSpec::new(shape.into(), dtype)
}

/// `(rows, cols)` of a tensor seen as 2-D over its last dimension.
fn rows_cols(t: &Lazy) -> (usize, usize) {
    let cols = t.shape.last().copied().unwrap_or(1);
    (t.shape.num_elements() / cols.max(1), cols)
}

/// A lazy primitive as a tensor, for the composed methods.
fn ct<const D: usize>(t: FloatTensor<Cube>) -> Tensor<D> {
    Tensor::from_primitive::<Cube>(t)
}

/// A composed result back as a lazy primitive.
fn cp<const D: usize>(t: Tensor<D>) -> FloatTensor<Cube> {
    t.try_into_primitive::<Cube>()
        .expect("operations on Cube tensors stay on Cube")
}

impl FusedKernels for Cube {
    fn fused_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if composed("norm") {
            let (y, mean, rstd) = reference::norm_forward(ct(x), ct(weight), ct(bias), eps, rms);
            return (cp(y), cp(mean), cp(rstd));
        }
        let (rows, _) = rows_cols(&x);
        let stats = spec_of([rows], DType::F32);
        let out = spec(&x);
        let [y, mean, rstd] = custom(
            "fused_norm_forward",
            vec![Input::Float(x), Input::Float(weight), Input::Float(bias)],
            [out, stats.clone(), stats],
            move |t| {
                let [x, w, b] = take(t);
                let (y, mean, rstd) = super::norm_forward(x, w, b, eps, rms);
                [y, mean, rstd]
            },
        );
        (y, mean, rstd)
    }

    fn fused_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if composed("norm") {
            let (dx, dw, db) =
                reference::norm_backward(ct(dy), ct(x), ct(weight), ct(mean), ct(rstd), rms);
            return (cp(dx), cp(dw), cp(db));
        }
        let (_, cols) = rows_cols(&x);
        let param = spec_of([cols], x.dtype);
        let out = spec(&x);
        let inputs = [dy, x, weight, mean, rstd].map(Input::Float);
        let [dx, dw, db] = custom(
            "fused_norm_backward",
            inputs.into(),
            [out, param.clone(), param],
            move |t| {
                let [dy, x, w, mean, rstd] = take(t);
                let (dx, dw, db) = super::norm_backward(dy, x, w, mean, rstd, rms);
                [dx, dw, db]
            },
        );
        (dx, dw, db)
    }

    fn fused_swiglu_forward(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = spec(&a);
        let [y] = custom(
            "fused_swiglu_forward",
            vec![Input::Float(a), Input::Float(b)],
            [out],
            |t| {
                let [a, b] = take(t);
                [super::swiglu_forward(a, b)]
            },
        );
        y
    }

    fn fused_swiglu_backward(
        dy: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let out = spec(&a);
        let [da, db] = custom(
            "fused_swiglu_backward",
            [dy, a, b].map(Input::Float).into(),
            [out.clone(), out],
            |t| {
                let [dy, a, b] = take(t);
                let (da, db) = super::swiglu_backward(dy, a, b);
                [da, db]
            },
        );
        (da, db)
    }

    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        let out = spec(&x);
        let [y] = custom(
            "fused_rope",
            [x, cos, sin].map(Input::Float).into(),
            [out],
            move |t| {
                let [x, cos, sin] = take(t);
                [super::rope(x, cos, sin, inverse)]
            },
        );
        y
    }

    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hyper: AdamWHyper,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let outs = [spec(&param), spec(&m), spec(&v)];
        let [param, m, v] = custom(
            "fused_adamw_step",
            [param, grad, m, v].map(Input::Float).into(),
            outs,
            move |t| {
                let [param, grad, m, v] = take(t);
                let (param, m, v) = super::adamw_step(param, grad, m, v, hyper);
                [param, m, v]
            },
        );
        (param, m, v)
    }

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
        if composed("attention") || !super::attention::supported(qs[3], qs[2], ks[2]) {
            let (out, lse) = reference::attention_forward_4d(ct(q), ct(k), ct(v), causal, scale);
            return (cp(out), cp(lse));
        }
        let out = spec_of([qs[0], qs[1], qs[2], vs[3]], q.dtype);
        let lse = spec_of([qs[0] * qs[1], qs[2]], DType::F32);
        let [out, lse] = custom(
            "fused_attention_forward",
            [q, k, v].map(Input::Float).into(),
            [out, lse],
            move |t| {
                let [q, k, v] = take(t);
                let (out, lse) = super::attention::forward(q, k, v, causal, scale);
                [out, lse]
            },
        );
        (out, lse)
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
        if composed("attention") || !super::attention::supported(q.shape[3], q.shape[2], k.shape[2])
        {
            let (dq, dk, dv) = reference::attention_backward_4d(
                ct(dout),
                ct(q),
                ct(k),
                ct(v),
                ct(out),
                ct(lse),
                causal,
                scale,
            );
            return (cp(dq), cp(dk), cp(dv));
        }
        // The kernels compute in, and return, `q`'s dtype.
        let specs = [&q, &k, &v].map(|t| spec_of(t.shape.clone(), q.dtype));
        let [dq, dk, dv] = custom(
            "fused_attention_backward",
            [dout, q, k, v, out, lse].map(Input::Float).into(),
            specs,
            move |t| {
                let [dout, q, k, v, out, lse] = take(t);
                let (dq, dk, dv) =
                    super::attention::backward(dout, q, k, v, out, lse, causal, scale);
                [dq, dk, dv]
            },
        );
        (dq, dk, dv)
    }

    fn fused_linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        has_bias: bool,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if cublas_routes(&x, &w) {
            let (rows, n) = (x.shape[0], w.shape[1]);
            let out = spec_of([rows, n], x.dtype);
            let [y] = custom(
                "cublas_linear_forward",
                [x, w, b].map(Input::Float).into(),
                [out],
                move |t| {
                    let [x, w, b] = take(t);
                    [super::cublas::forward(x, w, has_bias.then_some(b))]
                },
            );
            return y;
        }
        cp(reference::linear_forward(ct(x), ct(w), ct(b), has_bias))
    }

    fn fused_linear_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        has_bias: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        #[cfg(feature = "cuda")]
        if cublas_routes(&x, &w) {
            let n = w.shape[1];
            let db = if has_bias {
                ct::<2>(dy.clone()).sum_dim(0).reshape([n])
            } else {
                Tensor::<1>::zeros([n], &ct::<2>(dy.clone()).device()).cast(dy.dtype)
            };
            let specs = [spec(&x), spec(&w)];
            let [dx, dw] = custom(
                "cublas_linear_backward",
                [dy, x, w].map(Input::Float).into(),
                specs,
                |t| {
                    let [dy, x, w] = take(t);
                    let (dx, dw) = super::cublas::backward(dy, x, w);
                    [dx, dw]
                },
            );
            return (dx, dw, cp(db));
        }
        let (dx, dw, db) = reference::linear_backward(ct(dy), ct(x), ct(w), has_bias);
        (cp(dx), cp(dw), cp(db))
    }

    fn fused_gelu_forward(x: FloatTensor<Self>, approximate: bool) -> FloatTensor<Self> {
        cp(reference::gelu_forward::<1>(ct(x), approximate))
    }

    fn fused_gelu_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        approximate: bool,
    ) -> FloatTensor<Self> {
        cp(reference::gelu_backward::<1>(ct(dy), ct(x), approximate))
    }

    fn fused_ce_stats(logits: FloatTensor<Self>) -> FloatTensor<Self> {
        let (rows, _) = rows_cols(&logits);
        let out = spec_of([rows, 2], DType::F32);
        let [stats] = custom("fused_ce_stats", vec![Input::Float(logits)], [out], |t| {
            let [logits] = take(t);
            [super::ce_stats(logits)]
        });
        stats
    }

    fn fused_ce_nll(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        count_lse: bool,
        ignore_index: i64,
    ) -> FloatTensor<Self> {
        let (rows, _) = rows_cols(&logits);
        let out = spec_of([rows], DType::F32);
        let [nll] = custom(
            "fused_ce_nll",
            vec![Input::Float(logits), Input::Int(targets), Input::Float(lse)],
            [out],
            move |t| {
                let [logits, targets, lse] = take(t);
                [super::ce_nll(
                    logits,
                    targets,
                    lse,
                    vocab_start,
                    count_lse,
                    ignore_index,
                )]
            },
        );
        nll
    }

    fn fused_ce_backward(
        dnll: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        vocab_start: usize,
        ignore_index: i64,
    ) -> FloatTensor<Self> {
        let out = spec(&logits);
        let [dlogits] = custom(
            "fused_ce_backward",
            vec![
                Input::Float(dnll),
                Input::Float(logits),
                Input::Int(targets),
                Input::Float(lse),
            ],
            [out],
            move |t| {
                let [dnll, logits, targets, lse] = take(t);
                [super::ce_backward(
                    dnll,
                    logits,
                    targets,
                    lse,
                    vocab_start,
                    ignore_index,
                )]
            },
        );
        dlogits
    }
}
