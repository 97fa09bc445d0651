//! Shared-memory all-reduce for ranks that live in one process (the `local` backend).
//!
//! Message passing copies every piece at least once on each side. Threads can do better: each
//! rank publishes its buffer on a [`Board`], then
//!
//! 1. barrier: every rank has posted its buffer (and calls the same collective);
//! 2. rank `r` reduces chunk `r` over every buffer, in rank order, and writes the result into
//!    chunk `r` of every buffer (`reduce_chunk_everywhere`);
//! 3. barrier: every chunk holds its final value everywhere; nobody reads anybody's buffer
//!    any more.
//!
//! Over all ranks, every buffer is read once and written once: the least traffic an in-place
//! all-reduce can move (the previous scheme, "reduce your chunk in place, barrier, copy the
//! others' chunks", read each byte `(2n-1)/n` times per rank and needed a third barrier). Each
//! chunk is reduced by one rank and copied from there, so every rank holds the same bits, and
//! the fold `((x_0 op x_1) op x_2) ...` runs in rank order, whatever rank owns the chunk.
//! Nothing is allocated. Concurrent accesses are always to disjoint chunks; the barriers
//! (message exchanges through mutex-protected mailboxes) order the phases. Buffers are
//! reference-counted, so a rank that fails mid-way never frees memory a peer is still reading
//! or writing.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::tensor::DType;

use crate::comm::host::{ReduceOp, combine_into};

/// A rank's tensor storage, shared with the other ranks of the process during one all-reduce.
pub(crate) struct SharedBuffer {
    ptr: *mut u8,
    len: usize,
    storage: UnsafeCell<burn::tensor::Bytes>,
}

// SAFETY: the buffer is plain bytes; all cross-thread accesses go through `read`/`write`, whose
// callers guarantee (by the phase protocol above) that no two threads access overlapping bytes
// while one of them writes.
unsafe impl Send for SharedBuffer {}
// SAFETY: as for `Send`.
unsafe impl Sync for SharedBuffer {}

impl SharedBuffer {
    /// Takes ownership of `storage` and records its address.
    pub(crate) fn new(mut storage: burn::tensor::Bytes) -> Self {
        let ptr = storage.as_mut_ptr();
        let len = storage.len();
        Self {
            ptr,
            len,
            storage: UnsafeCell::new(storage),
        }
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes of `range`.
    ///
    /// # Safety
    /// No thread may write any byte of `range` while the returned slice is alive.
    pub(crate) unsafe fn read(&self, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: in bounds (checked above); the caller guarantees no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    /// The bytes of `range`, mutably.
    ///
    /// # Safety
    /// No other thread may access any byte of `range` while the returned slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn write(&self, range: Range<usize>) -> &mut [u8] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: in bounds (checked above); the caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// Gives the storage back once no other rank holds the buffer.
    pub(crate) fn into_storage(self) -> burn::tensor::Bytes {
        self.storage.into_inner()
    }
}

/// Where the ranks of one process publish their buffers, keyed by (group, call, global rank).
#[derive(Default)]
pub struct Board {
    posted: Mutex<HashMap<(u64, u64, usize), Arc<SharedBuffer>>>,
}

impl Board {
    pub(crate) fn post(&self, key: (u64, u64, usize), buffer: Arc<SharedBuffer>) {
        let mut posted = self.posted.lock().unwrap_or_else(|e| e.into_inner());
        posted.insert(key, buffer);
    }

    pub(crate) fn get(&self, key: &(u64, u64, usize)) -> Option<Arc<SharedBuffer>> {
        let posted = self.posted.lock().unwrap_or_else(|e| e.into_inner());
        posted.get(key).cloned()
    }

    pub(crate) fn remove(&self, key: &(u64, u64, usize)) {
        let mut posted = self.posted.lock().unwrap_or_else(|e| e.into_inner());
        posted.remove(key);
    }
}

/// Bytes reduced and copied at a time by [`reduce_chunk_everywhere`]: the first buffer's block
/// is still in the core's L1/L2 cache when it is copied into the others.
const BLOCK_BYTES: usize = 32 * 1024;

/// Reduces bytes `range` of every buffer of `buffers` (element-wise `op` over elements of
/// `dtype`, folded in the order of `buffers`; an average divides by `buffers.len()` in the
/// last step) and writes the result into `range` of every buffer.
///
/// # Safety
/// While this runs, no other thread may access any byte of `range` of any of `buffers`.
/// `range` must start and end on element boundaries of `dtype`, and every buffer must be at
/// least `range.end` bytes long (checked: a shorter one panics before any access).
pub(crate) unsafe fn reduce_chunk_everywhere(
    buffers: &[Arc<SharedBuffer>],
    range: Range<usize>,
    dtype: DType,
    op: ReduceOp,
) {
    let n = buffers.len();
    assert!(n >= 1 && buffers.iter().all(|b| b.len() >= range.end));
    let elem = dtype.size();
    debug_assert!(range.start.is_multiple_of(elem) && range.end.is_multiple_of(elem));
    // A multiple of every element size (1, 2, 4, 8 bytes).
    let block = BLOCK_BYTES;
    let mut start = range.start;
    while start < range.end {
        let part = start..(start + block).min(range.end);
        // SAFETY: the caller gives this thread exclusive access to `range` of every buffer;
        // `part` lies inside it and the buffers are distinct allocations, so this mutable
        // slice aliases none of the slices below.
        let acc = unsafe { buffers[0].write(part.clone()) };
        for (k, other) in buffers.iter().enumerate().skip(1) {
            // The division of an average is fused into the last reduction.
            let divide_by = if k + 1 == n && op == ReduceOp::Avg {
                n
            } else {
                1
            };
            // SAFETY: as above (exclusive access to `part` of a buffer distinct from the
            // first).
            combine_into(
                acc,
                unsafe { other.read(part.clone()) },
                dtype,
                op,
                divide_by,
            );
        }
        for other in &buffers[1..] {
            // SAFETY: as above.
            unsafe { other.write(part.clone()) }.copy_from_slice(acc);
        }
        start = part.end;
    }
}
