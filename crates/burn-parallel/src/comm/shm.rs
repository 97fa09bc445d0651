//! Shared-memory all-reduce for ranks that live in one process (the `local` backend).
//!
//! Message passing copies every piece at least once on each side. Threads can do better: each
//! rank publishes its buffer on a [`Board`], then
//!
//! 1. rank `r` reduces chunk `r` in place in its own buffer, reading chunk `r` of every peer;
//! 2. barrier: every chunk holds its final value in its owner's buffer;
//! 3. rank `r` copies chunk `k` of rank `k` into its own buffer, for every `k != r`;
//! 4. barrier: nobody reads anybody's buffer any more.
//!
//! Each rank reads `(2n-1)/n` and writes `1` buffer's worth of bytes, the least possible, and
//! allocates nothing. Concurrent accesses are always to disjoint chunks, or reads of chunks
//! nobody writes in that phase; the barriers (message exchanges through mutex-protected
//! mailboxes) order the phases. Buffers are reference-counted, so a rank that fails mid-way
//! never frees memory a peer is still reading.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

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
