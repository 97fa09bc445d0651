//! Host-side arithmetic on raw tensor bytes: element-wise reductions, and splitting or
//! concatenating row-major data along one dimension. Used by every collective algorithm.

use burn::tensor::DType;
use bytemuck::Pod;
use half::{bf16, f16};

/// The reduction applied by `all_reduce` and `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks of the group (sum, then divide by the group size).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        };
        f.write_str(name)
    }
}

/// Compact name of a dtype for messages: `f32`, `bf16`, ...
pub(crate) fn dtype_name(dtype: DType) -> String {
    match dtype {
        DType::F64 => "f64".into(),
        DType::F32 => "f32".into(),
        DType::Flex32 => "flex32".into(),
        DType::F16 => "f16".into(),
        DType::BF16 => "bf16".into(),
        DType::I64 => "i64".into(),
        DType::I32 => "i32".into(),
        DType::I16 => "i16".into(),
        DType::I8 => "i8".into(),
        DType::U64 => "u64".into(),
        DType::U32 => "u32".into(),
        DType::U16 => "u16".into(),
        DType::U8 => "u8".into(),
        other => format!("{other:?}"),
    }
}

/// Stable numeric code of a dtype, for the wire.
pub(crate) fn dtype_code(dtype: DType) -> Option<u64> {
    Some(match dtype {
        DType::F64 => 1,
        DType::F32 => 2,
        DType::Flex32 => 3,
        DType::F16 => 4,
        DType::BF16 => 5,
        DType::I64 => 6,
        DType::I32 => 7,
        DType::I16 => 8,
        DType::I8 => 9,
        DType::U64 => 10,
        DType::U32 => 11,
        DType::U16 => 12,
        DType::U8 => 13,
        DType::Bool(_) | DType::QFloat(_) => return None,
    })
}

/// Inverse of [`dtype_code`].
pub(crate) fn dtype_from_code(code: u64) -> Option<DType> {
    Some(match code {
        1 => DType::F64,
        2 => DType::F32,
        3 => DType::Flex32,
        4 => DType::F16,
        5 => DType::BF16,
        6 => DType::I64,
        7 => DType::I32,
        8 => DType::I16,
        9 => DType::I8,
        10 => DType::U64,
        11 => DType::U32,
        12 => DType::U16,
        13 => DType::U8,
        _ => return None,
    })
}

/// `true` when `reduce` supports the dtype.
pub(crate) fn reducible(dtype: DType) -> bool {
    dtype_code(dtype).is_some()
}

trait Elem: Pod {
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    fn scale(self, n: usize) -> Self;
}

macro_rules! float_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => self + other,
                    ReduceOp::Max => self.max(other),
                    ReduceOp::Min => self.min(other),
                }
            }
            #[inline(always)]
            fn scale(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_elem!(f32);
float_elem!(f64);

macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                let (a, b) = (self.to_f32(), other.to_f32());
                <$t>::from_f32(match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                })
            }
            #[inline(always)]
            fn scale(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
        }
    };
}
half_elem!(f16);
half_elem!(bf16);

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => self.wrapping_add(other),
                    ReduceOp::Max => self.max(other),
                    ReduceOp::Min => self.min(other),
                }
            }
            #[inline(always)]
            fn scale(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
int_elem!(i64);
int_elem!(i32);
int_elem!(i16);
int_elem!(i8);
int_elem!(u64);
int_elem!(u32);
int_elem!(u16);
int_elem!(u8);

fn combine_typed<T: Elem>(acc: &mut [u8], other: &[u8], op: ReduceOp, divide_by: usize) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(other),
    ) {
        // One loop per operation, so each compiles to a tight (vectorisable) loop.
        (Ok(a), Ok(b)) => match (op, divide_by) {
            (ReduceOp::Sum | ReduceOp::Avg, 2..) => {
                zip_with(a, b, |x, y| x.combine(y, ReduceOp::Sum).scale(divide_by))
            }
            (ReduceOp::Sum | ReduceOp::Avg, _) => {
                zip_with(a, b, |x, y| x.combine(y, ReduceOp::Sum))
            }
            (ReduceOp::Max, _) => zip_with(a, b, |x, y| x.combine(y, ReduceOp::Max)),
            (ReduceOp::Min, _) => zip_with(a, b, |x, y| x.combine(y, ReduceOp::Min)),
        },
        // Unaligned buffers (rare: a payload sliced at an odd offset) take the slow path.
        _ => {
            let size = std::mem::size_of::<T>();
            for (x, y) in acc.chunks_exact_mut(size).zip(other.chunks_exact(size)) {
                let a: T = bytemuck::pod_read_unaligned(x);
                let b: T = bytemuck::pod_read_unaligned(y);
                let c = a.combine(b, op);
                let c = if divide_by > 1 { c.scale(divide_by) } else { c };
                x.copy_from_slice(bytemuck::bytes_of(&c));
            }
        }
    }
}

#[inline(always)]
fn zip_with<T: Copy>(a: &mut [T], b: &[T], f: impl Fn(T, T) -> T) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = f(*x, *y);
    }
}

macro_rules! by_dtype {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::F64 => $f::<f64>($($arg),*),
            DType::F32 | DType::Flex32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I16 => $f::<i16>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::U64 => $f::<u64>($($arg),*),
            DType::U32 => $f::<u32>($($arg),*),
            DType::U16 => $f::<u16>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
            DType::Bool(_) | DType::QFloat(_) => {
                unreachable!("callers check `reducible` first")
            }
        }
    };
}

/// `acc[i] = op(acc[i], other[i])` over elements of `dtype`, then divided by `divide_by` when
/// it is above 1 and `op` sums (the last reduction of [`ReduceOp::Avg`], fused into one pass).
pub(crate) fn combine_into(
    acc: &mut [u8],
    other: &[u8],
    dtype: DType,
    op: ReduceOp,
    divide_by: usize,
) {
    debug_assert_eq!(acc.len(), other.len());
    by_dtype!(dtype, combine_typed, acc, other, op, divide_by)
}

fn combine_to_typed<T: Elem>(out: &mut [u8], a: &[u8], b: &[u8], op: ReduceOp, divide_by: usize) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(out),
        bytemuck::try_cast_slice::<u8, T>(a),
        bytemuck::try_cast_slice::<u8, T>(b),
    ) {
        (Ok(o), Ok(a), Ok(b)) => match (op, divide_by) {
            (ReduceOp::Sum | ReduceOp::Avg, 2..) => {
                zip3(o, a, b, |x, y| x.combine(y, ReduceOp::Sum).scale(divide_by))
            }
            (ReduceOp::Sum | ReduceOp::Avg, _) => zip3(o, a, b, |x, y| x.combine(y, ReduceOp::Sum)),
            (ReduceOp::Max, _) => zip3(o, a, b, |x, y| x.combine(y, ReduceOp::Max)),
            (ReduceOp::Min, _) => zip3(o, a, b, |x, y| x.combine(y, ReduceOp::Min)),
        },
        _ => {
            out.copy_from_slice(a);
            combine_typed::<T>(out, b, op, divide_by);
        }
    }
}

#[inline(always)]
fn zip3<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = f(*x, *y);
    }
}

/// `out[i] = op(a[i], b[i])` over elements of `dtype` (one pass, no copy of `a`), divided by
/// `divide_by` as in [`combine_into`].
pub(crate) fn combine_to(
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
    dtype: DType,
    op: ReduceOp,
    divide_by: usize,
) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    by_dtype!(dtype, combine_to_typed, out, a, b, op, divide_by)
}

/// Row-major geometry of a split along `dim`: `(outer, inner_bytes_per_unit)`, where `outer` is
/// the product of the dimensions before `dim` and each unit of `dim` spans
/// `inner_bytes_per_unit` contiguous bytes.
pub(crate) fn geometry(shape: &[usize], dim: usize, elem_size: usize) -> (usize, usize) {
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    (outer, inner * elem_size)
}

/// Splits row-major `data` of `shape` along `dim` into pieces of `sizes[k]` units each.
/// Along the first non-trivial dimension no copy is made.
pub(crate) fn split_along(
    data: &bytes::Bytes,
    shape: &[usize],
    dim: usize,
    sizes: &[usize],
    elem_size: usize,
) -> Vec<bytes::Bytes> {
    let (outer, unit) = geometry(shape, dim, elem_size);
    let row = shape[dim] * unit;
    let mut pieces = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for &size in sizes {
        let len = size * unit;
        if outer == 1 {
            pieces.push(data.slice(start..start + len));
        } else {
            let mut piece = Vec::with_capacity(outer * len);
            for o in 0..outer {
                let base = o * row + start;
                piece.extend_from_slice(&data[base..base + len]);
            }
            pieces.push(bytes::Bytes::from(piece));
        }
        start += len;
    }
    pieces
}

/// Concatenates row-major pieces along `dim` into `out`; piece `k` has `sizes[k]` units along
/// `dim`, with `outer`/`unit` geometry from [`geometry`] of any piece's shape.
pub(crate) fn concat_into(
    out: &mut [u8],
    pieces: &[impl AsRef<[u8]>],
    sizes: &[usize],
    outer: usize,
    unit: usize,
) {
    let mut at = 0;
    for o in 0..outer {
        for (piece, &size) in pieces.iter().zip(sizes) {
            let len = size * unit;
            out[at..at + len].copy_from_slice(&piece.as_ref()[o * len..(o + 1) * len]);
            at += len;
        }
    }
    debug_assert_eq!(at, out.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_concat_round_trips_on_every_dim() {
        let shape = [2usize, 3, 4];
        let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let data = bytes::Bytes::from(bytemuck::cast_slice::<f32, u8>(&values).to_vec());
        for dim in 0..3 {
            let n = shape[dim];
            let sizes: Vec<usize> = if n == 4 { vec![1, 3] } else { vec![1, n - 1] };
            let pieces = split_along(&data, &shape, dim, &sizes, 4);
            let (outer, unit) = geometry(&shape, dim, 4);
            let mut out = vec![0u8; data.len()];
            concat_into(&mut out, &pieces, &sizes, outer, unit);
            assert_eq!(out, data.to_vec());
        }
    }

    #[test]
    fn reductions_of_every_kind() {
        let mut a = bytemuck::cast_slice::<f32, u8>(&[1.0, 5.0]).to_vec();
        let b = bytemuck::cast_slice::<f32, u8>(&[3.0, 2.0]).to_vec();
        combine_into(&mut a, &b, DType::F32, ReduceOp::Max, 1);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&a), &[3.0, 5.0]);
        combine_into(&mut a, &b, DType::F32, ReduceOp::Min, 1);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&a), &[3.0, 2.0]);
        let mut out = vec![0u8; 8];
        combine_to(&mut out, &a, &b, DType::F32, ReduceOp::Sum, 1);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&out), &[6.0, 4.0]);
        let mut h = bytemuck::cast_slice::<bf16, u8>(&[bf16::from_f32(1.5)]).to_vec();
        let g = h.clone();
        combine_into(&mut h, &g, DType::BF16, ReduceOp::Sum, 3);
        assert_eq!(bytemuck::cast_slice::<u8, bf16>(&h)[0].to_f32(), 1.0);
    }
}
