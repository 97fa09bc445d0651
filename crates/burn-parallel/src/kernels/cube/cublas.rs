//! The linear layer's products through cuBLASLt on CUDA devices (feature `cuda`).
//!
//! CubeCL's GEMM reaches a fraction of cuBLAS on NVIDIA GPUs (measured on an H200: bf16 141
//! TFLOP/s against cuBLAS's 798 at 8192), and a transformer's step is mostly products. So on a
//! CUDA device the three products of a linear layer, the forward `y = x w + b` (the bias added
//! by cuBLASLt's epilogue) and the backward's `dx = dy w^T` and `dw = x^T dy`, are cuBLASLt
//! calls on the raw device pointers of CubeCL's buffers: bf16 and fp16 with fp32
//! accumulation, fp32 exact or, where the user allows it ([`super::super::allow_tf32`]), in
//! TF32. The bias gradient stays a Burn reduction (fused with its neighbours).
//!
//! - **Row-major through column-major.** Burn's `[rows, cols]` row-major matrix is cuBLAS's
//!   column-major `[cols, rows]`, its transpose; each product is written as the transposed one
//!   (`y^T = w^T x^T` and so on), so nothing is copied.
//! - **Ordering with Burn's queued work.** CubeCL does not expose the CUDA stream of its
//!   server, so cuBLASLt runs on this module's own stream, and each call binds the buffers it
//!   reads and writes (CubeCL neither frees nor moves a bound allocation). The stream waits for
//!   Burn's queued work, and Burn's later work for the product, on the device through the
//!   ordering words of [`crate::device::order`] (`BURN_PARALLEL_STREAM_ORDER=sync` waits on the host
//!   instead: two host round trips per call).
//!   The backward's two products share one call.
//! - **Plans.** A product's descriptors, layouts and the algorithm cuBLASLt's heuristic picks
//!   (with a 32 MiB workspace) are made once per shape, dtype and transposition and kept.
//! - **Choice.** `BURN_PARALLEL_MATMUL=cube` keeps every product on CubeCL's autotuned matmul;
//!   without a loadable `libcublasLt.so` the same happens, with one warning.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as ltsys;
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use crate::device::{bind, cuda_index, order};

/// Bytes of cuBLASLt's workspace per device (NVIDIA's recommendation for Hopper).
const WORKSPACE: usize = 32 << 20;

/// Whether the linear products on `device` in `dtype` go through cuBLASLt.
pub(crate) fn routes(device: &cubecl::Device, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        && cuda_index(device).is_some()
        && enabled()
}

/// `BURN_PARALLEL_MATMUL` (`cublas`, the default, or `cube`) and the library's presence, read
/// once.
fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        let choice = std::env::var("BURN_PARALLEL_MATMUL").unwrap_or_default();
        match choice.trim() {
            "" | "cublas" | "cublaslt" => {}
            "cube" | "cubecl" => return false,
            other => {
                eprintln!(
                    "warning: BURN_PARALLEL_MATMUL={other:?} is neither `cublas` nor `cube`; \
                     using cuBLASLt"
                );
            }
        }
        // SAFETY: only tries to open the library by its names; nothing is called in it.
        let present = unsafe { ltsys::is_culib_present() };
        if !present {
            eprintln!(
                "warning: libcublasLt.so (CUDA's cuBLASLt) cannot be loaded: the linear layers \
                 use CubeCL's matmul, which is several times slower on NVIDIA GPUs; add CUDA's \
                 lib64 (or the nvidia-cublas wheel's lib folder) to LD_LIBRARY_PATH"
            );
        }
        present
    })
}

/// A product's shape in cuBLAS's column-major terms: `d [m, n] = op(a) op(b)`, `k` the inner
/// dimension, each operand transposed or not.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Gemm {
    m: u64,
    n: u64,
    k: u64,
    trans_a: bool,
    trans_b: bool,
    dtype: DType,
    bias: bool,
    tf32: bool,
    /// The alignment, in bytes, of the operands' addresses (at most 256): cuBLASLt's heuristic
    /// assumes 256 unless told, and a kernel that needs more than an address has fails.
    align: u32,
}

/// The largest power of two (at most 256) dividing every address.
fn alignment(addresses: &[u64]) -> u32 {
    addresses
        .iter()
        .map(|a| 1u32 << a.trailing_zeros().min(8))
        .min()
        .unwrap_or(256)
}

/// The cuBLASLt objects of one [`Gemm`], made once.
struct Plan {
    desc: ltsys::cublasLtMatmulDesc_t,
    a: ltsys::cublasLtMatrixLayout_t,
    b: ltsys::cublasLtMatrixLayout_t,
    d: ltsys::cublasLtMatrixLayout_t,
    algo: ltsys::cublasLtMatmulAlgo_t,
}

/// One device's cuBLASLt handle, stream, workspace and plans.
struct DeviceLt {
    context: cusys::CUcontext,
    handle: ltsys::cublasLtHandle_t,
    stream: cusys::CUstream,
    workspace: cusys::CUdeviceptr,
    plans: HashMap<Gemm, Plan>,
}

// SAFETY: the raw handles are used only under the `DEVICES` mutex, after making their context
// current on the calling thread; CUDA and cuBLASLt objects may be used from any thread that
// way.
unsafe impl Send for DeviceLt {}

/// The state of each (CUDA device, thread) pair. Per thread because CubeCL queues a thread's
/// work on a stream of that thread's own: each gets its own cuBLASLt stream and ordering
/// words, so one thread's products never wait behind another's (which, with buffers passed
/// between threads, could wait in a circle).
static DEVICES: Mutex<Vec<((usize, std::thread::ThreadId), DeviceLt)>> = Mutex::new(Vec::new());

fn cuda_type(dtype: DType) -> ltsys::cudaDataType {
    match dtype {
        DType::BF16 => ltsys::cudaDataType::CUDA_R_16BF,
        DType::F16 => ltsys::cudaDataType::CUDA_R_16F,
        DType::F32 => ltsys::cudaDataType::CUDA_R_32F,
        other => unreachable!("`routes` admits no {other:?} product"),
    }
}

fn fail(what: &str, e: impl std::fmt::Debug) -> ! {
    panic!(
        "cuBLASLt linear layer: {what} failed: {e:?} (set BURN_PARALLEL_MATMUL=cube to use CubeCL's matmul instead)"
    )
}

impl DeviceLt {
    fn new(ordinal: usize) -> Self {
        cu::init().unwrap_or_else(|e| fail("cuInit", e));
        let device =
            cu::device::get(ordinal as i32).unwrap_or_else(|e| fail("opening the device", e));
        // SAFETY: `device` is a valid device; the primary context is the one CubeCL's CUDA
        // runtime uses, so its buffers' pointers are valid in it. Retaining adds a reference.
        let context = unsafe { cu::primary_ctx::retain(device) }
            .unwrap_or_else(|e| fail("retaining the CUDA context", e));
        // SAFETY: `context` is live (retained above).
        unsafe { cu::ctx::set_current(context) }
            .unwrap_or_else(|e| fail("making the CUDA context current", e));
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .unwrap_or_else(|e| fail("creating a stream", e));
        // SAFETY: the context is current; the allocation lives as long as the process.
        let workspace =
            unsafe { cu::malloc_sync(WORKSPACE) }.unwrap_or_else(|e| fail("the workspace", e));
        let handle = lt::create_handle().unwrap_or_else(|e| fail("cublasLtCreate", e));
        Self {
            context,
            handle,
            stream,
            workspace,
            plans: HashMap::new(),
        }
    }

    fn plan(&mut self, g: Gemm) -> &Plan {
        let handle = self.handle;
        self.plans.entry(g).or_insert_with(|| {
            use ltsys::cublasLtMatmulDescAttributes_t as A;
            let compute = if g.tf32 && g.dtype == DType::F32 {
                ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F
            };
            let scale = ltsys::cudaDataType::CUDA_R_32F;
            let desc =
                lt::create_matmul_desc(compute, scale).unwrap_or_else(|e| fail("a descriptor", e));
            // cuBLAS's `cublasOperation_t` (an `int32`): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (the
            // enum lives in cuBLAS's header, which cudarc's cuBLASLt bindings do not include).
            let op = |t: bool| -> i32 { i32::from(t) };
            let set = |attr: A, value: *const c_void, size: usize| {
                // SAFETY: `desc` is live and `value` points at `size` bytes of the attribute's
                // type.
                unsafe { lt::set_matmul_desc_attribute(desc, attr, value, size) }
                    .unwrap_or_else(|e| fail("setting a descriptor attribute", e));
            };
            let (ta, tb) = (op(g.trans_a), op(g.trans_b));
            set(
                A::CUBLASLT_MATMUL_DESC_TRANSA,
                (&raw const ta).cast(),
                size_of_val(&ta),
            );
            set(
                A::CUBLASLT_MATMUL_DESC_TRANSB,
                (&raw const tb).cast(),
                size_of_val(&tb),
            );
            if g.bias {
                let epilogue = ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set(
                    A::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&raw const epilogue).cast(),
                    size_of_val(&epilogue),
                );
            }
            let ty = cuda_type(g.dtype);
            let layout = |rows: u64, cols: u64| {
                lt::create_matrix_layout(ty, rows, cols, rows as i64)
                    .unwrap_or_else(|e| fail("a matrix layout", e))
            };
            // Column-major storage: `op(a)` is `[m, k]`, so `a` is `[k, m]` when transposed.
            let a = if g.trans_a {
                layout(g.k, g.m)
            } else {
                layout(g.m, g.k)
            };
            let b = if g.trans_b {
                layout(g.n, g.k)
            } else {
                layout(g.k, g.n)
            };
            let d = layout(g.m, g.n);
            let pref = lt::create_matmul_pref().unwrap_or_else(|e| fail("a preference", e));
            use ltsys::cublasLtMatmulPreferenceAttributes_t as P;
            let bytes = WORKSPACE as u64;
            let prefer = |attr: P, value: *const c_void, size: usize| {
                // SAFETY: `pref` is live and `value` points at `size` bytes of the attribute's
                // type.
                unsafe { lt::set_matmul_pref_attribute(pref, attr, value, size) }
                    .unwrap_or_else(|e| fail("setting a preference", e));
            };
            let workspace = P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
            prefer(workspace, (&raw const bytes).cast(), size_of_val(&bytes));
            for attr in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ] {
                prefer(attr, (&raw const g.align).cast(), size_of_val(&g.align));
            }
            // SAFETY: every descriptor is live.
            let heuristic =
                unsafe { lt::get_matmul_algo_heuristic(handle, desc, a, b, d, d, pref) }
                    .unwrap_or_else(|e| fail(&format!("choosing an algorithm for {g:?}"), e));
            // SAFETY: `pref` is not used again.
            let _ = unsafe { lt::destroy_matmul_pref(pref) };
            Plan {
                desc,
                a,
                b,
                d,
                algo: heuristic.algo,
            }
        })
    }

    /// Queues `d = op(a) op(b) (+ bias)` on this device's stream.
    fn gemm(&mut self, g: Gemm, a: u64, b: u64, d: u64, bias: Option<u64>) {
        let g = Gemm {
            align: alignment(&[a, b, d]),
            ..g
        };
        let (handle, stream, workspace) = (self.handle, self.stream, self.workspace);
        let plan = self.plan(g);
        if let Some(bias) = bias {
            let ptr = bias as usize as *const c_void;
            // SAFETY: the descriptor is live; the attribute is a device pointer.
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&raw const ptr).cast(),
                    size_of_val(&ptr),
                )
            }
            .unwrap_or_else(|e| fail("setting the bias", e));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ptr = |p: u64| p as usize as *mut c_void;
        // SAFETY: `a`, `b`, `d` (and the bias) are bound device buffers holding the plan's
        // shapes in its dtype, in the current context; `d` is written only here (beta 0, so
        // `c = d` is not read); the workspace is this device's and used by this stream only.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&raw const alpha).cast(),
                (&raw const beta).cast(),
                ptr(a),
                plan.a,
                ptr(b),
                plan.b,
                ptr(d),
                plan.d,
                ptr(d),
                plan.d,
                &raw const plan.algo,
                ptr(workspace),
                WORKSPACE,
                stream.cast(),
            )
        }
        .unwrap_or_else(|e| fail(&format!("cublasLtMatmul {g:?}"), e));
    }
}

/// Runs `f` (cuBLASLt calls on this device's stream, given the state and the buffers'
/// addresses) ordered after Burn's queued work on `tensors` and before Burn's later work, the
/// buffers bound meanwhile (see [`crate::device::order`]).
fn with_bound(tensors: &[&CubeTensor], f: impl FnOnce(&mut DeviceLt, &[u64])) {
    let first = tensors[0];
    let ordinal = cuda_index(&first.device).expect("`routes` admits CUDA devices only");
    let key = (ordinal, std::thread::current().id());
    let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    let at = match devices.iter().position(|(k, _)| *k == key) {
        Some(at) => at,
        None => {
            devices.push((key, DeviceLt::new(ordinal)));
            devices.len() - 1
        }
    };
    let lt = &mut devices[at].1;
    // Marked before the buffers are bound: binding only orders across CubeCL streams, it never
    // waits for the device.
    let mark = order::mark(first);
    let (held, addresses) = bind(tensors).unwrap_or_else(|e| fail("binding a device buffer", e));
    // SAFETY: the context is live (retained by `DeviceLt::new`).
    unsafe { cu::ctx::set_current(lt.context) }
        .unwrap_or_else(|e| fail("making the CUDA context current", e));
    let waited = mark.wait_on(lt.stream);
    if !waited {
        cubecl::future::block_on(first.client.sync())
            .unwrap_or_else(|e| fail("waiting for Burn's queued work", e));
    }
    f(lt, &addresses);
    if !(waited && mark.signal(lt.stream)) {
        // SAFETY: the stream is live and belongs to the current context.
        unsafe { cu::stream::synchronize(lt.stream) }
            .unwrap_or_else(|e| fail("waiting for cuBLASLt", e));
    }
    drop(held);
}

fn empty(like: &CubeTensor, shape: [usize; 2]) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        like.dtype,
    )
}

fn dims(t: &CubeTensor) -> [usize; 2] {
    let s = t.meta.shape();
    [s[0], s[1]]
}

/// `x [rows, k] w [k, n] (+ b [n])`.
pub(crate) fn forward(x: CubeTensor, w: CubeTensor, b: Option<CubeTensor>) -> CubeTensor {
    let (x, w) = (into_contiguous(x), into_contiguous(w));
    let b = b.map(into_contiguous);
    let ([rows, k], [_, n]) = (dims(&x), dims(&w));
    let y = empty(&x, [rows, n]);
    // y^T [n, rows] = w^T [n, k] x^T [k, rows]: the row-major `w` and `x` are those
    // transposes in column-major storage.
    let g = Gemm {
        m: n as u64,
        n: rows as u64,
        k: k as u64,
        trans_a: false,
        trans_b: false,
        dtype: x.dtype,
        bias: b.is_some(),
        tf32: super::super::tf32_allowed(),
        align: 0,
    };
    let mut bound = vec![&w, &x, &y];
    bound.extend(b.as_ref());
    with_bound(&bound, |lt, p| {
        lt.gemm(g, p[0], p[1], p[2], p.get(3).copied())
    });
    y
}

/// `(dx, dw)` of [`forward`]: `dx = dy w^T`, `dw = x^T dy`.
pub(crate) fn backward(dy: CubeTensor, x: CubeTensor, w: CubeTensor) -> (CubeTensor, CubeTensor) {
    let (dy, x, w) = (into_contiguous(dy), into_contiguous(x), into_contiguous(w));
    let ([rows, k], [_, n]) = (dims(&x), dims(&w));
    let (dx, dw) = (empty(&x, [rows, k]), empty(&w, [k, n]));
    let tf32 = super::super::tf32_allowed();
    let base = Gemm {
        m: 0,
        n: 0,
        k: 0,
        trans_a: false,
        trans_b: false,
        dtype: x.dtype,
        bias: false,
        tf32,
        align: 0,
    };
    // dx^T [k, rows] = w [k, n] dy^T [n, rows]: `w`'s storage is `w^T` [n, k], transposed.
    let gx = Gemm {
        m: k as u64,
        n: rows as u64,
        k: n as u64,
        trans_a: true,
        ..base
    };
    // dw^T [n, k] = dy^T [n, rows] x [rows, k]: `x`'s storage is `x^T` [k, rows], transposed.
    let gw = Gemm {
        m: n as u64,
        n: k as u64,
        k: rows as u64,
        trans_b: true,
        ..base
    };
    with_bound(&[&dy, &x, &w, &dx, &dw], |lt, p| {
        let [dy, x, w, dx, dw] = [p[0], p[1], p[2], p[3], p[4]];
        lt.gemm(gx, w, dy, dx, None);
        lt.gemm(gw, dy, x, dw, None);
    });
    (dx, dw)
}
