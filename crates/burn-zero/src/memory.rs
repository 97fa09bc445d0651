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
