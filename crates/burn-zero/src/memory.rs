//! Memory accounting: the bytes the wrapper holds, per rank, by category, with peaks.
//!
//! Method: the wrapper allocates every buffer it holds itself (flat parameter shards, gradient
//! shards or full flat gradients, optimizer state, gathered units, communication staging
//! buffers), so it counts them exactly at allocation and release, in a [`MemoryTracker`] shared
//! by the wrapper and the gathered-unit guards. Nothing is estimated. Not counted: activations
//! and the gradients Burn's autodiff materialises during `backward` before the wrapper takes
//! them (and, for stage 3, gathered weights the autodiff graph saves for the backward), because
//! the wrapper does not own them; they are the same in every stage and in DDP.
//!
//! The "model state" of the issue (`8P + 8P/N` for stage 1, `4P + 12P/N` for stage 2, `16P/N`
//! plus the largest gathered unit for stage 3, with fp32 Adam) is
//! [`MemoryReport::model_state_peak`]: the peaks over the step of parameters, gradients,
//! optimizer state and gathered units. Staging buffers of the collectives are reported apart.
//!
//! The tracker is the wrapper's own bookkeeping; [`CountingAllocator`] measures what the process
//! really allocates, and is what the memory tests compare against the formulas.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// What the bytes hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// Parameters resident on this rank (the full model for stages 1-2, shards for stage 3).
    Params,
    /// Gradients held by the wrapper (full flat for stage 1, shards for stages 2-3, plus any
    /// unsharded accumulation buffers during gradient accumulation).
    Grads,
    /// Optimizer state (moments...).
    Optimizer,
    /// Units all-gathered for compute (stage 3).
    Gathered,
    /// Temporary staging buffers of collectives (inputs and outputs of reduce-scatter and
    /// all-gather of flat buffers).
    Buffers,
}

/// Bytes per category.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Bytes {
    /// Parameters.
    pub params: usize,
    /// Gradients.
    pub grads: usize,
    /// Optimizer state.
    pub optimizer: usize,
    /// Gathered units.
    pub gathered: usize,
    /// Staging buffers.
    pub buffers: usize,
}

impl Bytes {
    fn slot(&mut self, c: Category) -> &mut usize {
        match c {
            Category::Params => &mut self.params,
            Category::Grads => &mut self.grads,
            Category::Optimizer => &mut self.optimizer,
            Category::Gathered => &mut self.gathered,
            Category::Buffers => &mut self.buffers,
        }
    }

    /// Sum of all categories.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer + self.gathered + self.buffers
    }
}

/// A snapshot of a rank's accounting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// Bytes held now.
    pub current: Bytes,
    /// Per-category peaks since the last [`MemoryTracker::reset_peaks`].
    pub peak: Bytes,
    /// Peak of the total since the last reset.
    pub peak_total: usize,
}

impl MemoryReport {
    /// Sum of the per-category peaks of parameters, gradients, optimizer state and gathered
    /// units (staging buffers excluded): the figure the ZeRO formulas predict. The categories
    /// may peak at different moments, so this is an upper bound of their simultaneous peak
    /// (`peak_total` is the true simultaneous peak, staging included).
    pub fn model_state_peak(&self) -> usize {
        self.peak.params + self.peak.grads + self.peak.optimizer + self.peak.gathered
    }

    /// One line for logs, in MiB.
    pub fn summary(&self) -> String {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        format!(
            "params {:.3} MiB, grads {:.3} MiB, optimizer {:.3} MiB, gathered {:.3} MiB (peak), \
             staging {:.3} MiB (peak); model state peak {:.3} MiB, total peak {:.3} MiB",
            mib(self.peak.params),
            mib(self.peak.grads),
            mib(self.peak.optimizer),
            mib(self.peak.gathered),
            mib(self.peak.buffers),
            mib(self.model_state_peak()),
            mib(self.peak_total)
        )
    }
}

/// Shared counter of the bytes a wrapper holds. Cheap to clone (clones share the counts).
///
/// ```
/// use burn_zero::memory::{Category, MemoryTracker};
/// let t = MemoryTracker::default();
/// t.add(Category::Gathered, 100);
/// t.sub(Category::Gathered, 100);
/// assert_eq!(t.report().peak.gathered, 100);
/// assert_eq!(t.report().current.gathered, 0);
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryTracker {
    inner: Arc<Mutex<MemoryReport>>,
    last_step: Arc<Mutex<Option<MemoryReport>>>,
}

impl MemoryTracker {
    fn with(&self, f: impl FnOnce(&mut MemoryReport)) {
        let mut r = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut r);
        let current = r.current;
        for c in [
            Category::Params,
            Category::Grads,
            Category::Optimizer,
            Category::Gathered,
            Category::Buffers,
        ] {
            let now = *current.clone().slot(c);
            let peak = r.peak.slot(c);
            *peak = (*peak).max(now);
        }
        r.peak_total = r.peak_total.max(current.total());
    }

    /// Records `bytes` more held in `c`.
    pub fn add(&self, c: Category, bytes: usize) {
        self.with(|r| *r.current.slot(c) += bytes);
    }

    /// Records `bytes` released from `c`.
    pub fn sub(&self, c: Category, bytes: usize) {
        self.with(|r| {
            let slot = r.current.slot(c);
            *slot = slot.saturating_sub(bytes);
        });
    }

    /// Sets the bytes held in `c`.
    pub fn set(&self, c: Category, bytes: usize) {
        self.with(|r| *r.current.slot(c) = bytes);
    }

    /// Restarts the peaks from the current values (call at the start of a step).
    pub fn reset_peaks(&self) {
        let mut r = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        r.peak = r.current;
        r.peak_total = r.current.total();
    }

    /// Ends a step: remembers the counts and peaks of the step (see
    /// [`MemoryTracker::last_step`]) and restarts the peaks, so that the next step's peaks
    /// include its forward (where stage 3 gathers).
    pub fn finish_step(&self) {
        let report = self.report();
        *self.last_step.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        self.reset_peaks();
    }

    /// The counts and peaks of the last completed step, or the live ones before any step.
    pub fn last_step(&self) -> MemoryReport {
        self.last_step
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or_else(|| self.report())
    }

    /// The current counts and peaks.
    pub fn report(&self) -> MemoryReport {
        *self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A global allocator that counts the bytes the process holds, with a resettable peak: the
/// measurement behind the memory figures and tests (every allocation is counted, staging
/// buffers, pools and Burn's own tensors included, not only what a wrapper accounts for).
///
/// It wraps [`std::alloc::System`]; counting costs two atomic operations per allocation.
/// Install it in a test or benchmark binary:
///
/// ```rust,standalone_crate
/// use burn_zero::memory::CountingAllocator;
///
/// #[global_allocator]
/// static ALLOC: CountingAllocator = CountingAllocator::new();
///
/// ALLOC.reset_peak();
/// let before = ALLOC.current();
/// let buffer = vec![0u8; 1 << 20];
/// assert!(ALLOC.peak() >= before + (1 << 20));
/// drop(buffer);
/// assert!(ALLOC.current() < before + (1 << 20));
/// ```
///
/// Ranks run as threads share the process, so the counts are the sum over ranks: attribute
/// them with care (see `tests/memory.rs` of this crate).
#[derive(Debug, Default)]
pub struct CountingAllocator {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl CountingAllocator {
    /// A counter at zero (usable in a `static`).
    pub const fn new() -> Self {
        Self {
            current: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed through this allocator.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// The largest [`CountingAllocator::current`] since the last reset.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Restarts the peak from the current bytes; returns the current bytes.
    pub fn reset_peak(&self) -> usize {
        let now = self.current();
        self.peak.store(now, Ordering::Relaxed);
        now
    }

    fn grew(&self, bytes: usize) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn shrank(&self, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's layout and pointer unchanged, so
// `System`'s guarantees hold; the counters are plain atomics and never allocate.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on unchanged.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            self.grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            self.grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through this allocator) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        self.shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by `System` with `layout`; the caller upholds the rest.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                self.grew(new_size - layout.size());
            } else {
                self.shrank(layout.size() - new_size);
            }
        }
        new
    }
}
