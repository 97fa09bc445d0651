//! The CPU implementation of [`FusedKernels`](super::FusedKernels) on Flex: each method is
//! one pass (or one blockwise sweep) over contiguous `f32` slices, split over the intra-op
//! threads of [`crate::threads`].
//!
//! - **Attention**: blockwise over query blocks of [`BLOCK_Q`] rows and key/value tiles of
//!   [`BLOCK_KV`] rows, online softmax (running max and sum), tiles above the causal diagonal
//!   skipped. The forward keeps only the output and the per-row log-sum-exp; the backward
//!   recomputes each tile's probabilities from it. Scratch is one `BLOCK_Q x BLOCK_KV` tile
//!   per thread: the `batch x heads x seq x seq` probabilities are never stored. The tile
//!   products go through the `gemm` crate (the one Flex's matmul uses).
//! - **Norms**: one pass per row for the statistics and the output; the backward's
//!   parameter gradients are per-thread partial sums added in thread order (deterministic for
//!   a given thread count).
//! - **Cross-entropy**, **AdamW**, **GELU**, **SwiGLU**: one pass each.
//!
//! `exp` and `erf` are branch-free polynomial approximations ([`exp`], [`erf`]) that the
//! compiler vectorises, accurate to a few `f32` ulps (`exp`) and `1.5e-7` absolute (`erf`,
//! Abramowitz and Stegun 7.1.26); the tests compare every kernel against the composed
//! [`reference`](super::reference).

use std::mem::MaybeUninit;
use std::ops::Range;

use crate::threads::intra_op_threads;

/// Query rows per block of the blockwise attention.
pub const BLOCK_Q: usize = 64;
/// Key/value rows per tile of the blockwise attention.
pub const BLOCK_KV: usize = 64;

/// Below this many multiply-adds (or element visits) a kernel runs on the calling thread:
/// spawning threads costs tens of microseconds.
const PARALLEL_WORK: usize = 1 << 16;

// ---------------------------------------------------------------------------------------------
// Splitting work over threads.

/// The mutable outputs of a kernel, each cut into `units` equal parts of `per_unit` elements:
/// `f32`s to update, or `MaybeUninit<f32>`s of a new vector to write ([`uninit`]).
pub(crate) struct Outs<'a, T = f32> {
    slices: Vec<(&'a mut [T], usize)>,
}

impl<'a, T> Outs<'a, T> {
    pub(crate) fn new(slices: Vec<(&'a mut [T], usize)>) -> Self {
        Self { slices }
    }
}

/// The first `len` elements of `v`'s spare capacity (reserved here), for a kernel to write.
/// Once every one is written, `v.set_len(len)` takes them: outputs are never zeroed first (a
/// serial pass over memory the kernel overwrites anyway).
fn uninit(v: &mut Vec<f32>, len: usize) -> &mut [MaybeUninit<f32>] {
    v.reserve_exact(len);
    &mut v.spare_capacity_mut()[..len]
}

/// A new vector of `units * per_unit` elements, each unit's part written by `f` on the
/// intra-op threads ([`par_units`] over one [`uninit`] output).
///
/// # Safety
/// `f` must write every element of the part it is given.
unsafe fn par_new(
    units: usize,
    per_unit: usize,
    work: usize,
    f: impl Fn(Range<usize>, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let len = units * per_unit;
    let mut v = Vec::new();
    par_units(
        units,
        work,
        Outs::new(vec![(uninit(&mut v, len), per_unit)]),
        |r, out| f(r, out[0]),
    );
    // SAFETY: `par_units` hands out every unit, and `f` wrote each element of its part (the
    // caller's contract).
    unsafe { v.set_len(len) };
    v
}

/// Runs `f(units, outputs)` over `units` split into contiguous ranges, one per intra-op thread
/// (inline when `work` is small or one thread is configured). Each call receives the parts of
/// every output that belong to its units, in the order given.
pub(crate) fn par_units<T: Send>(
    units: usize,
    work: usize,
    outs: Outs<'_, T>,
    f: impl Fn(Range<usize>, &mut [&mut [T]]) + Sync,
) {
    let threads = intra_op_threads().min(units).max(1);
    if threads == 1 || work < PARALLEL_WORK {
        let mut parts: Vec<&mut [T]> = outs.slices.into_iter().map(|(s, _)| s).collect();
        f(0..units, &mut parts);
        return;
    }
    let per = units.div_ceil(threads);
    let mut chunks: Vec<(Range<usize>, Vec<&mut [T]>)> = Vec::with_capacity(threads);
    let mut rest: Vec<(&mut [T], usize)> = outs.slices;
    let mut start = 0;
    while start < units {
        let end = (start + per).min(units);
        let mut parts = Vec::with_capacity(rest.len());
        let mut next = Vec::with_capacity(rest.len());
        for (slice, per_unit) in rest {
            let (head, tail) = slice.split_at_mut((end - start) * per_unit);
            parts.push(head);
            next.push((tail, per_unit));
        }
        rest = next;
        chunks.push((start..end, parts));
        start = end;
    }
    // The caller's rayon pool (a thread rank's own, see `crate::threads::in_rank_pool`): its
    // threads are already running, where a scoped thread per part would cost a spawn (a
    // `clone`, a fresh stack) per kernel call.
    rayon::scope(|s| {
        let f = &f;
        let mut chunks = chunks.into_iter();
        let first = chunks.next();
        for (range, mut parts) in chunks {
            s.spawn(move |_| f(range, &mut parts));
        }
        if let Some((range, mut parts)) = first {
            f(range, &mut parts);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Vectorisable math.

/// `a b + c`: one fused multiply-add (one rounding) with `FMA`, else a product and a sum.
///
/// The math below takes `FMA` as a parameter because Rust never contracts `a * b + c` by
/// itself, and `mul_add` on a CPU without FMA is a call to a software `fmaf` per operation:
/// the [`hot_loop!`] versions for AVX2 and AVX-512 pass `true` (half the instructions of
/// separate products and sums), the baseline passes `false`.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `c[0] + x (c[1] + x (c[2] + ...))` by Horner's rule, one [`madd`] per coefficient.
#[inline(always)]
fn horner<const FMA: bool>(x: f32, c: &[f32]) -> f32 {
    let (&last, rest) = c.split_last().expect("at least one coefficient");
    rest.iter()
        .rev()
        .fold(last, |acc, &ci| madd::<FMA>(acc, x, ci))
}

/// `e^x` for `f32`: `x = n ln 2 + r`, `|r| <= ln 2 / 2`, a degree-6 polynomial for `e^r` and
/// `2^n` built in the exponent bits. Relative error below `2e-7` on `[-87, 88]`; inputs are
/// clamped to that range (so `exp(-inf)` is `~1e-38`, not 0: callers mask explicitly).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Scalar callers are compiled without FMA, where `mul_add` would be a call per operation.
    exp_with::<false>(x)
}

/// [`exp`], its polynomial in [`madd`]s of the given kind.
#[inline(always)]
fn exp_with<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer without a branch.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    // `t`'s low mantissa bits hold `n` (two's complement): the exponent of `2^n` comes from
    // integer operations on the bits. A float-to-int `as` cast would not do: its saturating
    // semantics keep the loop scalar.
    let t = madd::<FMA>(x, LOG2E, ROUND);
    let n = t - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, x));
    let p = horner::<FMA>(
        r,
        &[
            1.0,
            1.0,
            0.5,
            1.0 / 6.0,
            1.0 / 24.0,
            1.0 / 120.0,
            1.0 / 720.0,
        ],
    );
    // (n + 127) << 23 from the low 9 bits of t's representation.
    let scale = f32::from_bits(t.to_bits().wrapping_add(127) << 23);
    p * scale
}

/// The error function, Abramowitz and Stegun 7.1.26 (absolute error below `1.5e-7`).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    erf_and_gauss::<false>(x).0
}

/// `(erf(x), e^(-x²))`: A&S 7.1.26 computes `e^(-x²)` anyway, and GELU's derivative needs it
/// too (one `exp` instead of two).
#[inline(always)]
fn erf_and_gauss<const FMA: bool>(x: f32) -> (f32, f32) {
    let a = x.abs();
    let t = 1.0 / madd::<FMA>(a, 0.327_591_1, 1.0);
    let poly = t * horner::<FMA>(
        t,
        &[
            0.254_829_6,
            -0.284_496_74,
            1.421_413_8,
            -1.453_152,
            1.061_405_4,
        ],
    );
    let gauss = exp_with::<FMA>(-a * a);
    let y = madd::<FMA>(-poly, gauss, 1.0);
    (y.copysign(x), gauss)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
const GELU_CUBIC: f32 = 0.044_715;

/// `tanh` through [`exp`].
#[inline(always)]
fn tanh<const FMA: bool>(u: f32) -> f32 {
    1.0 - 2.0 / (exp_with::<FMA>(2.0 * u) + 1.0)
}

/// GELU of one value: exact (`erf`) or GPT-2's tanh approximation.
#[inline(always)]
fn gelu_one<const FMA: bool>(x: f32, approximate: bool) -> f32 {
    if approximate {
        0.5 * x * (1.0 + tanh::<FMA>(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)))
    } else {
        0.5 * x * (1.0 + erf_and_gauss::<FMA>(x * FRAC_1_SQRT_2).0)
    }
}

/// Derivative of [`gelu_one`].
#[inline(always)]
fn gelu_grad_one<const FMA: bool>(x: f32, approximate: bool) -> f32 {
    if approximate {
        let t = tanh::<FMA>(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x));
        0.5 * (1.0 + t)
            + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x)
    } else {
        // e^(-(x/√2)²) = e^(-x²/2): the Gaussian density's exponential.
        let (erf, gauss) = erf_and_gauss::<FMA>(x * FRAC_1_SQRT_2);
        0.5 * (1.0 + erf) + x * FRAC_1_SQRT_2PI * gauss
    }
}

/// The vector instructions the CPU kernels' `hot_loop!`s use, narrowest first.
///
/// AVX2 and AVX-512 give bit-identical results: the reductions keep eight partial sums
/// whatever the vector width, and the polynomials are fused multiply-adds in both. The
/// baseline evaluates them as separate products and sums (a software `fmaf` per operation
/// would be far slower), so its results differ in the last bits.
///
/// ```
/// use burn_parallel::kernels::cpu::{limit_simd, simd, Simd};
///
/// limit_simd(Simd::Avx2); // e.g. to keep a machine that throttles under AVX-512 off it
/// assert!(simd() <= Simd::Avx2);
/// limit_simd(Simd::Avx512); // back to the widest the CPU has
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// The target's baseline (x86-64: SSE2, 4 lanes), or any CPU that is not x86-64.
    Baseline,
    /// AVX2 and FMA: 8 lanes.
    Avx2,
    /// AVX-512F (with AVX2 and FMA): 16 lanes and 32 vector registers.
    Avx512,
}

/// The widest tier allowed ([`limit_simd`]), as `Simd as u8`.
static SIMD_LIMIT: std::sync::atomic::AtomicU8 =
    std::sync::atomic::AtomicU8::new(Simd::Avx512 as u8);

/// Caps the tier of the CPU kernels at `limit` (process-wide; the default is no cap).
pub fn limit_simd(limit: Simd) {
    SIMD_LIMIT.store(limit as u8, std::sync::atomic::Ordering::Relaxed);
}

/// The tier the CPU kernels use now: the widest this CPU runs, within [`limit_simd`]'s cap.
pub fn simd() -> Simd {
    let limit = SIMD_LIMIT.load(std::sync::atomic::Ordering::Relaxed);
    detected_simd().min(match limit {
        0 => Simd::Baseline,
        1 => Simd::Avx2,
        _ => Simd::Avx512,
    })
}

/// The widest tier this CPU runs (std caches the feature checks).
fn detected_simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            return if has!("avx512f") {
                Simd::Avx512
            } else {
                Simd::Avx2
            };
        }
    }
    Simd::Baseline
}

/// Defines a hot loop three times: for the x86-64 baseline (4 lanes), for AVX2 and FMA (8
/// lanes, fused multiply-adds) and for AVX-512F (16 lanes and 32 vector registers, so the
/// polynomials' constants stay in registers), the widest this CPU runs picked at run time.
/// The math it calls is `#[inline(always)]` so that it is compiled into each version. On
/// Zen 4 the AVX-512 version runs GELU in 0.50 ns per element against 0.84 (one thread).
macro_rules! hot_loop {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            // The baseline's math: separate products and sums (see `madd`).
            #[allow(dead_code)]
            const FMA: bool = false;
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide16($($arg: $ty),*) $(-> $ret)? {
                    #[allow(dead_code)]
                    const FMA: bool = true;
                    $body
                }
                let tier = simd();
                if tier == Simd::Avx512 {
                    // SAFETY: `wide16` only uses AVX-512F, AVX2 and FMA, which `simd` found on
                    // this CPU.
                    return unsafe { wide16($($arg),*) };
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    #[allow(dead_code)]
                    const FMA: bool = true;
                    $body
                }
                if tier == Simd::Avx2 {
                    // SAFETY: `wide` only uses AVX2 and FMA, which `simd` found on this CPU.
                    return unsafe { wide($($arg),*) };
                }
            }
            $body
        }
    };
}

/// Elements per block of the element-wise loops: the compiler lays a block out as several
/// independent vectors, whose long polynomial chains then overlap.
const CHUNK: usize = 32;

hot_loop! {
    /// `out[i] = gelu(x[i])`.
    fn gelu_slice(out: &mut [MaybeUninit<f32>], x: &[f32], approximate: bool) {
        let mut oc = out.chunks_exact_mut(CHUNK);
        let mut xc = x.chunks_exact(CHUNK);
        for (o, x) in (&mut oc).zip(&mut xc) {
            for i in 0..CHUNK {
                o[i].write(gelu_one::<FMA>(x[i], approximate));
            }
        }
        for (o, &v) in oc.into_remainder().iter_mut().zip(xc.remainder()) {
            o.write(gelu_one::<FMA>(v, approximate));
        }
    }
}

hot_loop! {
    /// `out[i] = dy[i] gelu'(x[i])`.
    fn gelu_grad_slice(out: &mut [MaybeUninit<f32>], dy: &[f32], x: &[f32], approximate: bool) {
        for ((o, &g), &v) in out.iter_mut().zip(dy).zip(x) {
            o.write(g * gelu_grad_one::<FMA>(v, approximate));
        }
    }
}

/// Lanes of the manual reductions below. A float sum is not associative, so the compiler
/// keeps `sum += x` sequential (and with it the whole loop scalar); eight independent partial
/// sums let it vectorise, and are added in a fixed order (deterministic).
const LANES: usize = 8;

#[inline(always)]
fn fold_lanes(acc: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let a = [
        op(acc[0], acc[4]),
        op(acc[1], acc[5]),
        op(acc[2], acc[6]),
        op(acc[3], acc[7]),
    ];
    op(op(a[0], a[2]), op(a[1], a[3]))
}

/// Folds `x` with `step` into [`LANES`] independent accumulators (then the remainder into
/// their combination): the shape of every reduction here. `#[inline(always)]`, so that it and
/// its closures are compiled into each [`hot_loop!`] version.
#[inline(always)]
fn fold_lanes8(
    x: &[f32],
    init: f32,
    step: impl Fn(f32, f32) -> f32,
    combine: impl Fn(f32, f32) -> f32,
) -> f32 {
    let mut acc = [init; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (&v, a) in c.iter().zip(acc.iter_mut()) {
            *a = step(*a, v);
        }
    }
    let folded = fold_lanes(acc, combine);
    chunks.remainder().iter().fold(folded, |a, &v| step(a, v))
}

hot_loop! {
    /// `row[i] = exp(row[i] - shift)` in place; returns the sum.
    fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
        // Two simple loops: the map vectorises to full-width registers, which a loop that
        // also carries the sum's lanes did not.
        for x in row.iter_mut() {
            *x = exp_with::<FMA>(*x - shift);
        }
        fold_lanes8(row, 0.0, |a, v| a + v, |a, b| a + b)
    }
}

hot_loop! {
    /// `out[i] = scale exp(x[i] - shift)`.
    fn scaled_exp(out: &mut [f32], x: &[f32], shift: f32, scale: f32) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = scale * exp_with::<FMA>(v - shift);
        }
    }
}

hot_loop! {
    /// `sum exp(x[i] - shift)`.
    fn sum_exp(x: &[f32], shift: f32) -> f32 {
        fold_lanes8(x, 0.0, |a, v| a + exp_with::<FMA>(v - shift), |a, b| a + b)
    }
}

hot_loop! {
    /// The largest element (`-inf` for an empty slice).
    fn max_of(x: &[f32]) -> f32 {
        fold_lanes8(x, f32::NEG_INFINITY, |a, v| if v > a { v } else { a }, f32::max)
    }
}

hot_loop! {
    /// `sum a[i] (b[i] - shift)`.
    fn dot_shifted(a: &[f32], b: &[f32], shift: f32) -> f32 {
        let mut acc = [0.0f32; LANES];
        let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        for (x, y) in (&mut ca).zip(&mut cb) {
            for ((&u, &v), s) in x.iter().zip(y).zip(acc.iter_mut()) {
                *s += u * (v - shift);
            }
        }
        let mut sum = fold_lanes(acc, |p, q| p + q);
        for (&u, &v) in ca.remainder().iter().zip(cb.remainder()) {
            sum += u * (v - shift);
        }
        sum
    }
}

hot_loop! {
    /// `sum x[i]`.
    fn sum_of(x: &[f32]) -> f32 {
        fold_lanes8(x, 0.0, |a, v| a + v, |a, b| a + b)
    }
}

hot_loop! {
    /// `sum (x[i] - shift)^2`.
    fn squared_deviation(x: &[f32], shift: f32) -> f32 {
        fold_lanes8(x, 0.0, |a, v| a + (v - shift) * (v - shift), |a, b| a + b)
    }
}

hot_loop! {
    /// AdamW over one chunk (see [`adamw_step`]): `(b1, b2, eps, bc1, bc2, decay, lr)`.
    fn adamw_slice(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: [f32; 7]) {
        let [b1, b2, eps, bc1, bc2, decay, lr] = k;
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let mi = *m * b1 + g * (1.0 - b1);
            let vi = *v * b2 + g * g * (1.0 - b2);
            *m = mi;
            *v = vi;
            *p = *p * decay - (mi / bc1) / ((vi / bc2).sqrt() + eps) * lr;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise kernels.

/// GELU of `x`.
pub fn gelu_forward(x: &[f32], approximate: bool) -> Vec<f32> {
    let n = x.len();
    // SAFETY: `gelu_slice` writes each element of its part.
    unsafe { par_new(n, 1, n * 16, |r, out| gelu_slice(out, &x[r], approximate)) }
}

/// `dy * gelu'(x)`.
pub fn gelu_backward(dy: &[f32], x: &[f32], approximate: bool) -> Vec<f32> {
    let n = x.len();
    assert_eq!(dy.len(), n, "gelu_backward: dy and x differ in length");
    // SAFETY: `gelu_grad_slice` writes each element of its part (`dy` is as long as `x`,
    // checked above).
    unsafe {
        par_new(n, 1, n * 16, |r, out| {
            gelu_grad_slice(out, &dy[r.clone()], &x[r], approximate)
        })
    }
}

hot_loop! {
    /// `out[i] = silu(a[i]) b[i]`.
    fn swiglu_slice(out: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32]) {
        for ((o, &x), &g) in out.iter_mut().zip(a).zip(b) {
            o.write(x / (1.0 + exp_with::<FMA>(-x)) * g);
        }
    }
}

hot_loop! {
    /// `(da[i], db[i])` of `silu(a[i]) b[i]` under `dy[i]`.
    fn swiglu_grad_slice(
        da: &mut [MaybeUninit<f32>],
        db: &mut [MaybeUninit<f32>],
        dy: &[f32],
        a: &[f32],
        b: &[f32],
    ) {
        for ((((da, db), &g), &x), &bj) in da.iter_mut().zip(db.iter_mut()).zip(dy).zip(a).zip(b) {
            let s = 1.0 / (1.0 + exp_with::<FMA>(-x));
            let silu = x * s;
            da.write(g * bj * (s + silu * (1.0 - s)));
            db.write(g * silu);
        }
    }
}

/// `silu(a) * b`.
pub fn swiglu_forward(a: &[f32], b: &[f32]) -> Vec<f32> {
    let n = a.len();
    assert_eq!(b.len(), n, "swiglu_forward: a and b differ in length");
    // SAFETY: `swiglu_slice` writes each element of its part (`a` and `b` have `n` elements:
    // asserted).
    unsafe {
        par_new(n, 1, n * 8, |r, out| {
            swiglu_slice(out, &a[r.clone()], &b[r])
        })
    }
}

/// `(da, db)` of `silu(a) * b`.
pub fn swiglu_backward(dy: &[f32], a: &[f32], b: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let n = a.len();
    assert!(
        b.len() == n && dy.len() == n,
        "swiglu_backward: dy, a and b differ in length"
    );
    let (mut da, mut db) = (Vec::new(), Vec::new());
    par_units(
        n,
        n * 8,
        Outs::new(vec![(uninit(&mut da, n), 1), (uninit(&mut db, n), 1)]),
        |r, out| {
            let [da, db] = out else {
                unreachable!("two outputs")
            };
            swiglu_grad_slice(da, db, &dy[r.clone()], &a[r.clone()], &b[r]);
        },
    );
    // SAFETY: `par_units` hands out every unit, and the loop writes `da` and `db` at each.
    unsafe {
        da.set_len(n);
        db.set_len(n);
    }
    (da, db)
}

/// One AdamW step over flat fp32 slices, in place (Burn's `AdamW` semantics, as
/// [`reference::adamw_step`](super::reference::adamw_step)).
pub fn adamw_step(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: &super::reference::AdamWHyper,
) {
    let (bc1, bc2) = h.bias_corrections();
    let decay = (1.0 - h.lr * h.weight_decay as f64) as f32;
    let k = [h.beta1, h.beta2, h.eps, bc1, bc2, decay, h.lr as f32];
    let n = param.len();
    par_units(
        n,
        n * 8,
        Outs::new(vec![(param, 1), (m, 1), (v, 1)]),
        |r, out| {
            let [p, m, v] = out else {
                unreachable!("three outputs")
            };
            adamw_slice(p, &grad[r], m, v, k);
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Norms.

/// LayerNorm (`rms == false`) or RMSNorm of `x` `[rows, cols]`: `(y, mean, rstd)`.
pub fn norm_forward(
    x: &[f32],
    cols: usize,
    weight: &[f32],
    bias: &[f32],
    eps: f64,
    rms: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / cols.max(1);
    assert_eq!(
        rows * cols,
        x.len(),
        "norm_forward: {} values are not rows of {cols}",
        x.len()
    );
    assert!(
        weight.len() == cols && (rms || bias.len() == cols),
        "norm_forward: {cols} columns but weight {} and bias {}",
        weight.len(),
        bias.len()
    );
    let (mut y, mut mean, mut rstd) = (Vec::new(), Vec::new(), Vec::new());
    let outs = Outs::new(vec![
        (uninit(&mut y, rows * cols), cols),
        (uninit(&mut mean, rows), 1),
        (uninit(&mut rstd, rows), 1),
    ]);
    par_units(rows, x.len() * 4, outs, |r, out| {
        let [y, mean, rstd] = out else {
            unreachable!("three outputs")
        };
        for (i, row) in r.enumerate() {
            let xr = &x[row * cols..(row + 1) * cols];
            let mu = if rms { 0.0 } else { sum_of(xr) / cols as f32 };
            let var = squared_deviation(xr, mu) / cols as f32;
            let rs = 1.0 / (var as f64 + eps).sqrt() as f32;
            mean[i].write(mu);
            rstd[i].write(rs);
            let yr = &mut y[i * cols..(i + 1) * cols];
            if rms {
                for ((o, &v), &w) in yr.iter_mut().zip(xr).zip(weight) {
                    o.write(v * rs * w);
                }
            } else {
                for (((o, &v), &w), &b) in yr.iter_mut().zip(xr).zip(weight).zip(bias) {
                    o.write((v - mu) * rs * w + b);
                }
            }
        }
    });
    // SAFETY: `par_units` hands out every row, and the loop above writes each row's `cols`
    // outputs (`weight` and, for LayerNorm, `bias` have `cols` elements: asserted), its
    // mean and its rstd.
    unsafe {
        y.set_len(rows * cols);
        mean.set_len(rows);
        rstd.set_len(rows);
    }
    (y, mean, rstd)
}

/// Backward of [`norm_forward`]: `(dx, dweight, dbias)` (`dbias` zeros for RMSNorm).
pub fn norm_backward(
    dy: &[f32],
    x: &[f32],
    cols: usize,
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    rms: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / cols.max(1);
    let threads = intra_op_threads().min(rows).max(1);
    // Per-chunk partial sums of dweight and dbias, one row of 2 * cols per thread chunk.
    let per = rows.div_ceil(threads.max(1)).max(1);
    let chunks = rows.div_ceil(per);
    let mut partial = vec![0.0f32; chunks * 2 * cols];
    // Whole chunks (the last one padded), truncated after.
    let mut dx = vec![0.0; chunks * per * cols];
    // One unit = `per` rows, so that each chunk owns one partial row.
    let outs = Outs::new(vec![(&mut dx, per * cols), (&mut partial, 2 * cols)]);
    let dx_len = x.len();
    par_units(chunks, x.len() * 6, outs, |units, out| {
        let [dx, partial] = out else {
            unreachable!("two outputs")
        };
        let mut g = vec![0.0f32; cols];
        let first_unit = units.start;
        for (u_local, unit) in units.enumerate() {
            let (dw, db) = partial[u_local * 2 * cols..(u_local + 1) * 2 * cols].split_at_mut(cols);
            let first_row = unit * per;
            let last_row = ((unit + 1) * per).min(rows);
            for row in first_row..last_row {
                let xr = &x[row * cols..(row + 1) * cols];
                let dyr = &dy[row * cols..(row + 1) * cols];
                let (mu, rs) = (mean[row], rstd[row]);
                for ((gk, &d), &w) in g.iter_mut().zip(dyr).zip(weight) {
                    *gk = d * w;
                }
                let c1 = sum_of(&g) / cols as f32;
                let c2 = dot_shifted(&g, xr, mu) * rs / cols as f32;
                for k in 0..cols {
                    let xhat = (xr[k] - mu) * rs;
                    dw[k] += dyr[k] * xhat;
                    db[k] += dyr[k];
                }
                let local = (row - first_unit * per) * cols;
                let dxr = &mut dx[local..local + cols];
                for k in 0..cols {
                    let xhat = (xr[k] - mu) * rs;
                    let inner = g[k] - xhat * c2;
                    // LayerNorm also subtracts mean(g - xhat c2) = c1 (xhat has zero mean).
                    dxr[k] = if rms { inner * rs } else { (inner - c1) * rs };
                }
            }
        }
    });
    dx.truncate(dx_len);
    let mut dweight = vec![0.0f32; cols];
    let mut dbias = vec![0.0f32; cols];
    for chunk in partial.chunks_exact(2 * cols) {
        let (dw, db) = chunk.split_at(cols);
        for k in 0..cols {
            dweight[k] += dw[k];
            dbias[k] += db[k];
        }
    }
    if rms {
        dbias.iter_mut().for_each(|v| *v = 0.0);
    }
    (dx, dweight, dbias)
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy.

/// Per-row `(max, sum exp(x - max))` of `logits` `[rows, vocab]`, interleaved `[rows, 2]`.
pub fn ce_stats(logits: &[f32], vocab: usize) -> Vec<f32> {
    let rows = logits.len() / vocab.max(1);
    let mut stats = vec![0.0; rows * 2];
    par_units(
        rows,
        logits.len() * 4,
        Outs::new(vec![(&mut stats, 2)]),
        |r, out| {
            for (i, row) in r.enumerate() {
                let xr = &logits[row * vocab..(row + 1) * vocab];
                let max = max_of(xr);
                let sum = sum_exp(xr, max);
                out[0][2 * i] = max;
                out[0][2 * i + 1] = sum;
            }
        },
    );
    stats
}

/// The target of a row as a local column of a shard starting at `vocab_start`, `None` when it
/// is ignored or in another shard; and whether the row counts at all.
#[inline]
fn local_target(
    t: i64,
    vocab: usize,
    vocab_start: usize,
    ignore_index: i64,
) -> (bool, Option<usize>) {
    if t == ignore_index {
        return (false, None);
    }
    let local = t - vocab_start as i64;
    (
        true,
        (local >= 0 && (local as usize) < vocab).then_some(local as usize),
    )
}

/// Per-row NLL contribution of a shard (as [`reference::ce_nll`](super::reference::ce_nll)).
pub fn ce_nll(
    logits: &[f32],
    vocab: usize,
    targets: &[i64],
    lse: &[f32],
    vocab_start: usize,
    count_lse: bool,
    ignore_index: i64,
) -> Vec<f32> {
    targets
        .iter()
        .enumerate()
        .map(|(row, &t)| {
            let (valid, local) = local_target(t, vocab, vocab_start, ignore_index);
            let picked = local.map_or(0.0, |c| logits[row * vocab + c]);
            match (valid, count_lse) {
                (false, _) => 0.0,
                (true, true) => lse[row] - picked,
                (true, false) => -picked,
            }
        })
        .collect()
}

/// Gradient of the cross-entropy for a shard of logits: `dnll (softmax - onehot)`, zero on
/// ignored rows (as [`reference::ce_backward`](super::reference::ce_backward)).
pub fn ce_backward(
    dnll: &[f32],
    logits: &[f32],
    vocab: usize,
    targets: &[i64],
    lse: &[f32],
    vocab_start: usize,
    ignore_index: i64,
) -> Vec<f32> {
    let rows = targets.len();
    let mut grad = vec![0.0; logits.len()];
    par_units(
        rows,
        logits.len() * 4,
        Outs::new(vec![(&mut grad, vocab)]),
        |r, out| {
            for (i, row) in r.enumerate() {
                let (valid, local) = local_target(targets[row], vocab, vocab_start, ignore_index);
                if !valid {
                    continue;
                }
                let (g, l) = (dnll[row], lse[row]);
                let xr = &logits[row * vocab..(row + 1) * vocab];
                let gr = &mut out[0][i * vocab..(i + 1) * vocab];
                scaled_exp(gr, xr, l, g);
                if let Some(c) = local {
                    gr[c] -= g;
                }
            }
        },
    );
    grad
}

// ---------------------------------------------------------------------------------------------
// Attention.

/// A row-major matrix view: element `(r, c)` at `ptr[r * rs + c * cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    fn rows(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            rs: width,
            cs: 1,
        }
    }

    fn transposed(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: width,
        }
    }

    /// Whether an `rows x cols` matrix with these strides lies inside the slice.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `dst[m x n] (row stride dst_rs) = (accumulate ? dst : 0) + scale * a[m x k] b[k x n]`.
#[allow(clippy::too_many_arguments)]
fn matmul_par(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: View<'_>,
    b: View<'_>,
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    assert!(
        m == 0 || n == 0 || (m - 1) * dst_rs + n <= dst.len(),
        "product output out of bounds: {m} x {n} rows of stride {dst_rs} in {}",
        dst.len()
    );
    // SAFETY: the assert above keeps every element written inside `dst`, which is borrowed
    // mutably, initialised (so `accumulate` may read it) and aliases neither operand.
    unsafe {
        gemm_into(
            dst.as_mut_ptr(),
            (m, n, k),
            dst_rs,
            accumulate,
            a,
            b,
            scale,
            parallelism,
        )
    }
}

/// A new row-major `m x n` matrix `a[m x k] b[k x n]`, written by the product alone: the
/// buffer is never zeroed first (a pass over the whole output that the product overwrites).
fn product(
    (m, n, k): (usize, usize, usize),
    a: View<'_>,
    b: View<'_>,
    parallelism: gemm::Parallelism,
) -> Vec<f32> {
    let len = m * n;
    let mut out = Vec::with_capacity(len);
    // SAFETY: `out` has capacity for the `m x n` rows-major output (row stride `n`) and is a
    // fresh allocation, aliasing nothing. With `accumulate` false `gemm_into` writes every one
    // of those elements without reading any (gemm stores `beta * a b` when `read_dst` is
    // false; `k == 0` writes zeros), so all `len` elements are initialised when `set_len`
    // runs.
    unsafe {
        gemm_into(
            out.as_mut_ptr(),
            (m, n, k),
            n,
            false,
            a,
            b,
            1.0,
            parallelism,
        );
        out.set_len(len);
    }
    out
}

/// The product behind [`matmul_par`] and [`product`], checking the operands' bounds.
///
/// # Safety
/// `dst` must be valid for writes of the `m x n` output at row stride `dst_rs` (and for reads
/// of it, initialised, when `accumulate` is set), and must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    dst: *mut f32,
    (m, n, k): (usize, usize, usize),
    dst_rs: usize,
    accumulate: bool,
    a: View<'_>,
    b: View<'_>,
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    assert!(
        a.covers(m, k) && b.covers(k, n),
        "product operands out of bounds: ({m} x {k}) ({k} x {n})"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                // SAFETY: row `r`'s `n` elements are inside the output (the caller's contract).
                unsafe { std::ptr::write_bytes(dst.add(r * dst_rs), 0, n) };
            }
        }
        return;
    }
    // SAFETY: the assert above checks that every element the product reads (a: m x k, b:
    // k x n with their strides) lies inside the borrowed slices; the caller guarantees the
    // output (m x n at row stride dst_rs) and that it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// [`matmul_par`] on the calling thread (the attention tiles: the threads split the heads).
fn matmul(
    dims: (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: View<'_>,
    b: View<'_>,
    scale: f32,
) {
    matmul_par(
        dims,
        dst,
        dst_rs,
        accumulate,
        a,
        b,
        scale,
        gemm::Parallelism::None,
    );
}

/// The intra-op threads for an `m x n x k` product: all of them from `128^3` multiply-adds
/// (in the caller's rayon pool: a thread rank's own, see [`crate::threads::in_rank_pool`]).
fn product_parallelism(m: usize, n: usize, k: usize) -> gemm::Parallelism {
    let threads = intra_op_threads();
    if threads > 1 && m.saturating_mul(n).saturating_mul(k) >= 128 * 128 * 128 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    }
}

// ---------------------------------------------------------------------------------------------
// Linear layers.

/// `y [rows, n] = x [rows, k] w [k, n] (+ b [n])`: the bias is written first and the product
/// accumulated onto it (without a bias the product writes `y` alone), so the output is never
/// zeroed and there is no separate bias pass.
pub fn linear_forward(x: &[f32], w: &[f32], b: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
    let rows = x.len() / k.max(1);
    let parallelism = product_parallelism(rows, n, k);
    let Some(b) = b else {
        return product(
            (rows, n, k),
            View::rows(x, k),
            View::rows(w, n),
            parallelism,
        );
    };
    assert_eq!(
        b.len(),
        n,
        "linear_forward: bias of {} for {n} outputs",
        b.len()
    );
    // SAFETY: the loop writes each row's `n` elements (`b` has `n`: asserted).
    let mut y = unsafe {
        par_new(rows, n, rows * n, |_, out| {
            for row in out.chunks_exact_mut(n.max(1)) {
                for (o, &v) in row.iter_mut().zip(b) {
                    o.write(v);
                }
            }
        })
    };
    matmul_par(
        (rows, n, k),
        &mut y,
        n,
        true,
        View::rows(x, k),
        View::rows(w, n),
        1.0,
        parallelism,
    );
    y
}

/// Gradients of [`linear_forward`]: `(dx = dy w^T, dw = x^T dy, db = column sums of dy)`;
/// the transposes are strides of the products, never copies.
pub fn linear_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / k.max(1);
    let dx = product(
        (rows, k, n),
        View::rows(dy, n),
        View::transposed(w, n),
        product_parallelism(rows, k, n),
    );
    let dw = product(
        (k, n, rows),
        View::transposed(x, k),
        View::rows(dy, n),
        product_parallelism(k, n, rows),
    );
    // Threads split the columns: each column is summed over the rows in order, whatever the
    // thread count (the same bits as one thread).
    let mut db = vec![0.0; n];
    par_units(n, dy.len(), Outs::new(vec![(&mut db, 1)]), |cols, out| {
        add_rows(out[0], dy, n, cols.start)
    });
    (dx, dw, db)
}

hot_loop! {
    /// `acc[j] += sum_r rows[r * width + first + j]`.
    fn add_rows(acc: &mut [f32], rows: &[f32], width: usize, first: usize) {
        for row in rows.chunks_exact(width.max(1)) {
            for (a, &v) in acc.iter_mut().zip(&row[first..]) {
                *a += v;
            }
        }
    }
}

/// Shape of one attention call: `batch x heads` independent problems of `tq` query and `tk`
/// key rows of width `dim`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Batch size.
    pub batch: usize,
    /// Heads per batch element.
    pub heads: usize,
    /// Query rows per head.
    pub tq: usize,
    /// Key/value rows per head.
    pub tk: usize,
    /// Head width (of queries, keys and values).
    pub dim: usize,
    /// Query row `i` sees keys `0..=i + (tk - tq)` only.
    pub causal: bool,
    /// Multiplies the scores (usually `1 / sqrt(dim)`).
    pub scale: f32,
}

impl AttentionShape {
    /// Keys visible to query row `i`: `0..visible(i)`.
    #[inline]
    fn visible(&self, i: usize) -> usize {
        if self.causal {
            (i + 1 + self.tk - self.tq.min(self.tk)).min(self.tk)
        } else {
            self.tk
        }
    }
}

/// Where the `(batch, head)` matrices of an attention operand lie in its slice: row `r` of head
/// `(b, h)` starts at `offset + b * batch + h * head + r * row`, its `dim` columns contiguous.
/// Any strided view with unit column stride is one, so a `[batch, seq, heads, dim]` tensor seen
/// as `[batch, heads, seq, dim]` is read in place, without a permute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadLayout {
    /// Element offset of head `(0, 0)`.
    pub offset: usize,
    /// Stride between batch elements.
    pub batch: usize,
    /// Stride between heads.
    pub head: usize,
    /// Stride between rows.
    pub row: usize,
}

impl HeadLayout {
    /// `[batch, heads, rows, dim]`, contiguous.
    pub fn heads_major(heads: usize, rows: usize, dim: usize) -> Self {
        Self {
            offset: 0,
            batch: heads * rows * dim,
            head: rows * dim,
            row: dim,
        }
    }

    /// `[batch, rows, heads, dim]`, contiguous: the storage of a sequence-major tensor whose
    /// heads are split off its last dim (`[b, s, h * d]` reshaped to `[b, s, h, d]`).
    pub fn rows_major(heads: usize, rows: usize, dim: usize) -> Self {
        Self {
            offset: 0,
            batch: rows * heads * dim,
            head: dim,
            row: heads * dim,
        }
    }

    /// The layout of an output: rows-major or heads-major, contiguous.
    fn output(rows_major: bool, heads: usize, rows: usize, dim: usize) -> Self {
        if rows_major {
            Self::rows_major(heads, rows, dim)
        } else {
            Self::heads_major(heads, rows, dim)
        }
    }

    /// First element of head `(b, h)`.
    #[inline]
    fn start(&self, b: usize, h: usize) -> usize {
        self.offset + b * self.batch + h * self.head
    }

    /// Rows `from..` of head `(b, h)` of `data` as a matrix (rows of `dim` columns).
    fn rows<'a>(&self, data: &'a [f32], b: usize, h: usize, from: usize) -> View<'a> {
        View {
            data: &data[self.start(b, h) + from * self.row..],
            rs: self.row,
            cs: 1,
        }
    }

    /// The transpose of [`HeadLayout::rows`].
    fn columns<'a>(&self, data: &'a [f32], b: usize, h: usize, from: usize) -> View<'a> {
        View {
            data: &data[self.start(b, h) + from * self.row..],
            rs: 1,
            cs: self.row,
        }
    }
}

/// How the outputs of an attention call are split over threads: into units of whole batch
/// elements when they are rows-major (a head's rows interleave with the other heads' there),
/// of single heads otherwise. Returns `(units, heads per unit)`.
fn attention_units(s: &AttentionShape, rows_major: bool) -> (usize, usize) {
    if rows_major {
        (s.batch, s.heads)
    } else {
        (s.batch * s.heads, 1)
    }
}

/// Blockwise attention forward: `(out, lse [batch * heads, tq])`, `out` rows-major
/// (`[batch, tq, heads, dim]`) when `rows_major`, else `[batch, heads, tq, dim]`.
pub fn attention_forward(
    (q, ql): (&[f32], HeadLayout),
    (k, kl): (&[f32], HeadLayout),
    (v, vl): (&[f32], HeadLayout),
    rows_major: bool,
    s: AttentionShape,
) -> (Vec<f32>, Vec<f32>) {
    let (tq, tk, d) = (s.tq, s.tk, s.dim);
    let ol = HeadLayout::output(rows_major, s.heads, tq, d);
    let total = s.batch * s.heads;
    let mut out = vec![0.0; total * tq * d];
    let mut lse = vec![0.0; total * tq];
    let work = total * tq * tk * d * 2;
    let (units, per_unit) = attention_units(&s, rows_major);
    let outs = Outs::new(vec![
        (&mut out, per_unit * tq * d),
        (&mut lse, per_unit * tq),
    ]);
    par_units(units, work, outs, |range, parts| {
        let [out, lse] = parts else {
            unreachable!("two outputs")
        };
        // Where this thread's parts start in the whole outputs.
        let (out_base, lse_base) = (range.start * per_unit * tq * d, range.start * per_unit * tq);
        let mut scores = vec![0.0f32; BLOCK_Q * BLOCK_KV];
        let (mut row_max, mut row_sum) = (vec![0.0f32; BLOCK_Q], vec![0.0f32; BLOCK_Q]);
        for g in range.start * per_unit..range.end * per_unit {
            let (b, h) = (g / s.heads, g % s.heads);
            let orow = ol.row;
            let o_at = ol.start(b, h) - out_base;
            let lh = &mut lse[g * tq - lse_base..(g + 1) * tq - lse_base];
            for i0 in (0..tq).step_by(BLOCK_Q) {
                let nr = BLOCK_Q.min(tq - i0);
                let acc = &mut out[o_at + i0 * orow..];
                for r in 0..nr {
                    acc[r * orow..r * orow + d].fill(0.0);
                }
                row_max[..nr].fill(f32::NEG_INFINITY);
                row_sum[..nr].fill(0.0);
                let last_visible = s.visible(i0 + nr - 1);
                for j0 in (0..last_visible).step_by(BLOCK_KV) {
                    let nc = BLOCK_KV.min(tk - j0);
                    matmul(
                        (nr, nc, d),
                        &mut scores,
                        BLOCK_KV,
                        false,
                        ql.rows(q, b, h, i0),
                        kl.columns(k, b, h, j0),
                        s.scale,
                    );
                    for r in 0..nr {
                        let limit = s.visible(i0 + r).saturating_sub(j0).min(nc);
                        let sr = &mut scores[r * BLOCK_KV..r * BLOCK_KV + nc];
                        let tile_max = max_of(&sr[..limit]);
                        let new_max = row_max[r].max(tile_max);
                        if new_max == f32::NEG_INFINITY {
                            sr.fill(0.0);
                            continue;
                        }
                        let alpha = if row_max[r] == f32::NEG_INFINITY {
                            0.0
                        } else {
                            exp(row_max[r] - new_max)
                        };
                        let sum = exp_shifted(&mut sr[..limit], new_max);
                        sr[limit..].fill(0.0);
                        row_sum[r] = row_sum[r] * alpha + sum;
                        row_max[r] = new_max;
                        if alpha != 1.0 {
                            acc[r * orow..r * orow + d]
                                .iter_mut()
                                .for_each(|a| *a *= alpha);
                        }
                    }
                    matmul(
                        (nr, d, nc),
                        acc,
                        orow,
                        true,
                        View::rows(&scores, BLOCK_KV),
                        vl.rows(v, b, h, j0),
                        1.0,
                    );
                }
                for r in 0..nr {
                    let inv = 1.0 / row_sum[r];
                    acc[r * orow..r * orow + d]
                        .iter_mut()
                        .for_each(|a| *a *= inv);
                    lh[i0 + r] = row_max[r] + row_sum[r].ln();
                }
            }
        }
    });
    (out, lse)
}

/// Blockwise attention backward from the forward's `out` and `lse` (`[batch * heads, tq]`):
/// `(dq, dk, dv)`, rows-major when `rows_major` (as [`attention_forward`]'s output).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    (dout, dl): (&[f32], HeadLayout),
    (q, ql): (&[f32], HeadLayout),
    (k, kl): (&[f32], HeadLayout),
    (v, vl): (&[f32], HeadLayout),
    (out, ol): (&[f32], HeadLayout),
    lse: &[f32],
    rows_major: bool,
    s: AttentionShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (tq, tk, d) = (s.tq, s.tk, s.dim);
    let total = s.batch * s.heads;
    let (dql, dkl) = (
        HeadLayout::output(rows_major, s.heads, tq, d),
        HeadLayout::output(rows_major, s.heads, tk, d),
    );
    let mut dq = vec![0.0; total * tq * d];
    let mut dk = vec![0.0; total * tk * d];
    let mut dv = vec![0.0; total * tk * d];
    let work = total * tq * tk * d * 4;
    let (units, per_unit) = attention_units(&s, rows_major);
    let outs = Outs::new(vec![
        (&mut dq, per_unit * tq * d),
        (&mut dk, per_unit * tk * d),
        (&mut dv, per_unit * tk * d),
    ]);
    par_units(units, work, outs, |range, parts| {
        let [dq, dk, dv] = parts else {
            unreachable!("three outputs")
        };
        let (q_base, k_base) = (
            range.start * per_unit * tq * d,
            range.start * per_unit * tk * d,
        );
        let mut probs = vec![0.0f32; BLOCK_Q * BLOCK_KV];
        let mut dprobs = vec![0.0f32; BLOCK_Q * BLOCK_KV];
        let mut delta = vec![0.0f32; tq];
        for g in range.start * per_unit..range.end * per_unit {
            let (b, h) = (g / s.heads, g % s.heads);
            let lh = &lse[g * tq..(g + 1) * tq];
            let (dq_at, dk_at) = (dql.start(b, h) - q_base, dkl.start(b, h) - k_base);
            for (i, di) in delta.iter_mut().enumerate() {
                let (o, g_o) = (ol.start(b, h) + i * ol.row, dl.start(b, h) + i * dl.row);
                *di = dot_shifted(&dout[g_o..g_o + d], &out[o..o + d], 0.0);
            }
            for j0 in (0..tk).step_by(BLOCK_KV) {
                let nc = BLOCK_KV.min(tk - j0);
                for i0 in (0..tq).step_by(BLOCK_Q) {
                    let nr = BLOCK_Q.min(tq - i0);
                    if s.visible(i0 + nr - 1) <= j0 {
                        continue; // the whole tile is above the causal diagonal
                    }
                    matmul(
                        (nr, nc, d),
                        &mut probs,
                        BLOCK_KV,
                        false,
                        ql.rows(q, b, h, i0),
                        kl.columns(k, b, h, j0),
                        s.scale,
                    );
                    for r in 0..nr {
                        let limit = s.visible(i0 + r).saturating_sub(j0).min(nc);
                        let l = lh[i0 + r];
                        let pr = &mut probs[r * BLOCK_KV..r * BLOCK_KV + nc];
                        exp_shifted(&mut pr[..limit], l);
                        pr[limit..].fill(0.0);
                    }
                    // dV_j += P^T dO_i
                    matmul(
                        (nc, d, nr),
                        &mut dv[dk_at + j0 * dkl.row..],
                        dkl.row,
                        true,
                        View::transposed(&probs, BLOCK_KV),
                        dl.rows(dout, b, h, i0),
                        1.0,
                    );
                    // dP = dO_i V_j^T
                    matmul(
                        (nr, nc, d),
                        &mut dprobs,
                        BLOCK_KV,
                        false,
                        dl.rows(dout, b, h, i0),
                        vl.columns(v, b, h, j0),
                        1.0,
                    );
                    // dS = P (dP - delta) scale, into dprobs.
                    for r in 0..nr {
                        let shift = delta[i0 + r];
                        let pr = &probs[r * BLOCK_KV..r * BLOCK_KV + nc];
                        let dr = &mut dprobs[r * BLOCK_KV..r * BLOCK_KV + nc];
                        for (g, &p) in dr.iter_mut().zip(pr) {
                            *g = p * (*g - shift) * s.scale;
                        }
                    }
                    // dQ_i += dS K_j ; dK_j += dS^T Q_i
                    matmul(
                        (nr, d, nc),
                        &mut dq[dq_at + i0 * dql.row..],
                        dql.row,
                        true,
                        View::rows(&dprobs, BLOCK_KV),
                        kl.rows(k, b, h, j0),
                        1.0,
                    );
                    matmul(
                        (nc, d, nr),
                        &mut dk[dk_at + j0 * dkl.row..],
                        dkl.row,
                        true,
                        View::transposed(&dprobs, BLOCK_KV),
                        ql.rows(q, b, h, i0),
                        1.0,
                    );
                }
            }
        }
    });
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_over_the_float_range() {
        for fused in [false, true] {
            let mut worst = 0.0f64;
            let mut x = -87.0f32;
            while x <= 88.0 {
                let want = (x as f64).exp();
                let got = if fused { exp_with::<true>(x) } else { exp(x) };
                worst = worst.max(((got as f64) - want).abs() / want);
                x += 0.0137;
            }
            assert!(worst < 3e-7, "relative error {worst:e} (fused {fused})");
        }
        assert_eq!(exp(0.0), 1.0);
    }

    /// Every output of every element-wise, norm, cross-entropy, attention and AdamW kernel on
    /// odd sizes, at the current tier.
    fn all_kernel_outputs() -> Vec<Vec<f32>> {
        let wave = |i: usize, p: usize, q: usize, scale: f32, shift: f32| {
            ((i * p) % q) as f32 * scale - shift
        };
        let n = 61 * 19;
        let x: Vec<f32> = (0..n).map(|i| wave(i, 7919, 2001, 0.005, 5.0)).collect();
        let dy: Vec<f32> = (0..n).map(|i| wave(i, 104_729, 997, 0.002, 1.0)).collect();
        let mut outs = vec![
            gelu_forward(&x, false),
            gelu_forward(&x, true),
            gelu_backward(&dy, &x, false),
            gelu_backward(&dy, &x, true),
            swiglu_forward(&x, &dy),
        ];
        let (da, db) = swiglu_backward(&dy, &x, &dy);
        outs.extend([da, db]);
        let cols = 61;
        let (weight, bias) = (dy[..cols].to_vec(), x[..cols].to_vec());
        for rms in [false, true] {
            let (y, mean, rstd) = norm_forward(&x, cols, &weight, &bias, 1e-5, rms);
            let (dx, dw, dbias) = norm_backward(&dy, &x, cols, &weight, &mean, &rstd, rms);
            outs.extend([y, mean, rstd, dx, dw, dbias]);
        }
        let lse = ce_stats(&x, cols);
        let targets: Vec<i64> = (0..n / cols).map(|r| (r * 13 % cols) as i64).collect();
        let lse_of_rows: Vec<f32> = lse.chunks(2).map(|c| c[0] + c[1].ln()).collect();
        let dnll = vec![0.25; targets.len()];
        outs.push(ce_backward(
            &dnll,
            &x,
            cols,
            &targets,
            &lse_of_rows,
            0,
            -100,
        ));
        outs.push(lse);
        let shape = AttentionShape {
            batch: 1,
            heads: 2,
            tq: 70,
            tk: 70,
            dim: 8,
            causal: true,
            scale: 0.35,
        };
        let len = 2 * 70 * 8;
        let l = HeadLayout::heads_major(2, 70, 8);
        let (q, k, v, dout) = (&x[..len], &x[3..3 + len], &dy[..len], &dy[5..5 + len]);
        let (out, lse) = attention_forward((q, l), (k, l), (v, l), false, shape);
        let (dq, dk, dv) = attention_backward(
            (dout, l),
            (q, l),
            (k, l),
            (v, l),
            (&out, l),
            &lse,
            false,
            shape,
        );
        outs.extend([out, lse, dq, dk, dv]);
        let (mut p, mut m, mut v) = (x.clone(), dy.clone(), vec![0.5; n]);
        let hyper = super::super::AdamWHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-5,
            weight_decay: 0.1,
            step: 3,
        };
        adamw_step(&mut p, &dy, &mut m, &mut v, &hyper);
        outs.extend([p, m, v]);
        outs
    }

    /// The SIMD tiers agree: AVX2 and AVX-512 bit for bit (both fuse their multiply-adds),
    /// the baseline within a few ulps (it does not).
    #[test]
    fn simd_tiers_agree() {
        let tiers = [Simd::Baseline, Simd::Avx2, Simd::Avx512];
        let runs: Vec<(Simd, Vec<Vec<f32>>)> = tiers
            .into_iter()
            .filter(|&tier| tier <= detected_simd())
            .map(|tier| {
                limit_simd(tier);
                assert_eq!(simd(), tier);
                (tier, all_kernel_outputs())
            })
            .collect();
        limit_simd(Simd::Avx512);
        let (_, baseline) = &runs[0];
        for (tier, got) in &runs[1..] {
            for (i, (g, w)) in got.iter().zip(baseline).enumerate() {
                assert_eq!(g.len(), w.len());
                for (j, (&a, &b)) in g.iter().zip(w).enumerate() {
                    let tol = 1e-5 * a.abs().max(b.abs()).max(1.0);
                    assert!(
                        (a - b).abs() <= tol,
                        "output {i}[{j}]: {a} at {tier:?}, {b} at the baseline"
                    );
                }
            }
        }
        if let [(_, avx2), (_, avx512)] = &runs[1..] {
            for (i, (g, w)) in avx512.iter().zip(avx2).enumerate() {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(g),
                    bits(w),
                    "output {i} differs between AVX-512 and AVX2"
                );
            }
        }
        let checked: Vec<Simd> = runs.iter().map(|(tier, _)| *tier).collect();
        println!(
            "tiers checked: {checked:?} (this CPU: {:?})",
            detected_simd()
        );
    }

    #[test]
    fn lane_reductions_match_sequential_sums() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let seq: f32 = x.iter().sum();
        assert!((sum_of(&x) - seq).abs() < 1e-5);
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        assert_eq!(max_of(&x), max);
        assert_eq!(max_of(&[]), f32::NEG_INFINITY);
        let dot: f32 = x.iter().map(|v| v * (v - 0.5)).sum();
        assert!((dot_shifted(&x, &x, 0.5) - dot).abs() < 1e-5);
    }
}
