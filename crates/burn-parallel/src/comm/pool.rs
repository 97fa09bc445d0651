//! Reusable message buffers.
//!
//! Fresh large allocations are expensive: the kernel maps and zeroes every page on first touch,
//! which on some machines costs more than the copy that fills the buffer. The collectives
//! therefore take their send buffers from a process-wide pool; a buffer returns to the pool when
//! the last reference to the message holding it is dropped (on the receiving rank, for the local
//! backend). The pool keeps at most [`MAX_POOLED_BYTES`].

use std::sync::Mutex;

use burn::tensor::{DType, TensorData};
use bytes::Bytes;
use half::{bf16, f16};

/// Upper bound of the memory the pool keeps for reuse.
pub const MAX_POOLED_BYTES: usize = 1 << 30;

/// Buffers smaller than this are not worth pooling.
const MIN_POOLED_BYTES: usize = 64 * 1024;

struct Pool {
    free: Vec<Vec<u8>>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    bytes: 0,
});

/// Bytes the pool holds for reuse right now: freed message buffers, real memory that no
/// message uses (memory measurements subtract it to see what the computation itself holds).
pub fn pooled_bytes() -> usize {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).bytes
}

/// A buffer of exactly `len` bytes (contents unspecified), reused from the pool when one of a
/// suitable size (at least `len`, at most twice) is free.
pub fn take(len: usize) -> Vec<u8> {
    if len >= MIN_POOLED_BYTES {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let best = pool
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len && b.capacity() <= 2 * len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let mut buf = pool.free.swap_remove(i);
            pool.bytes -= buf.capacity();
            drop(pool);
            buf.truncate(len);
            return buf;
        }
    }
    vec![0u8; len]
}

/// Returns a buffer to the pool (or frees it when the pool is full or the buffer small).
pub fn give(mut buf: Vec<u8>) {
    let capacity = buf.capacity();
    if capacity < MIN_POOLED_BYTES {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if pool.bytes + capacity <= MAX_POOLED_BYTES {
        // Pooled buffers are kept fully initialised, so `take` can hand out any length.
        buf.resize(capacity, 0);
        pool.bytes += capacity;
        pool.free.push(buf);
    }
}

/// A pooled buffer that goes back to the pool when dropped.
struct Pooled(Vec<u8>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

/// Wraps a (pooled) buffer as a shareable message payload; the buffer returns to the pool when
/// the last clone of the payload is dropped.
pub fn share(buf: Vec<u8>) -> Bytes {
    Bytes::from_owner(Pooled(buf))
}

/// A buffer holding a copy of `data`.
pub fn copy_of(data: &[u8]) -> Bytes {
    let mut buf = take(data.len());
    buf.copy_from_slice(data);
    share(buf)
}

/// Storage for a tensor of `numel` elements of `dtype`, aligned for that dtype (so Burn never
/// has to re-align it), zero-filled lazily by the allocator.
///
/// # Panics
/// For dtypes the collectives do not move (`bool`, quantised), which callers reject earlier.
pub fn tensor_storage(numel: usize, dtype: DType) -> burn::tensor::Bytes {
    use burn::tensor::Bytes as Storage;
    match dtype {
        DType::F64 => Storage::from_elems(vec![0f64; numel]),
        DType::F32 | DType::Flex32 => Storage::from_elems(vec![0f32; numel]),
        DType::F16 => Storage::from_elems(vec![f16::ZERO; numel]),
        DType::BF16 => Storage::from_elems(vec![bf16::ZERO; numel]),
        DType::I64 => Storage::from_elems(vec![0i64; numel]),
        DType::I32 => Storage::from_elems(vec![0i32; numel]),
        DType::I16 => Storage::from_elems(vec![0i16; numel]),
        DType::I8 => Storage::from_elems(vec![0i8; numel]),
        DType::U64 => Storage::from_elems(vec![0u64; numel]),
        DType::U32 => Storage::from_elems(vec![0u32; numel]),
        DType::U16 => Storage::from_elems(vec![0u16; numel]),
        DType::U8 => Storage::from_elems(vec![0u8; numel]),
        DType::Bool(_) | DType::QFloat(_) => {
            unreachable!("collectives reject {dtype:?} before allocating")
        }
    }
}

/// Tensor data of `shape` and `dtype` whose bytes are filled by `fill` (without the extra copy
/// of `TensorData::from_bytes_vec`).
pub fn tensor_data(shape: Vec<usize>, dtype: DType, fill: impl FnOnce(&mut [u8])) -> TensorData {
    let numel = shape.iter().product();
    let mut storage = tensor_storage(numel, dtype);
    fill(&mut storage);
    TensorData::from_bytes(storage, shape, dtype)
}
