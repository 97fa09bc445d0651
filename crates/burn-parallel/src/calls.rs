//! A log of the collectives a rank issues, and of where their payload goes: what a training
//! step would hand to NCCL, proved on any backend.
//!
//! A group given a [`CallLog`] ([`ProcessGroup::with_call_log`](crate::ProcessGroup::with_call_log); its sub-groups inherit it)
//! appends one [`LoggedCall`] per collective its rank issues, in issue order, before it runs:
//!
//! - [`CallPath::Tensor`]: a collective on Burn tensors (`all_reduce`, `all_gather`,
//!   `reduce_scatter`, `broadcast`, `all_to_all`, `send`, `recv` and the `*_async` ones). On an
//!   `nccl` group with CUDA tensors these are NCCL calls on device memory; elsewhere they copy
//!   through the host, but the call is the same, so a log taken on thread ranks on the CPU shows
//!   the sequence of NCCL calls a GPU job would make: their order, grouping and sizes.
//! - [`CallPath::Host`]: a collective on host data (`*_data`, `*_bytes`, `*_object`,
//!   `all_reduce_f32`, `send_data`): staged through host memory whatever the backend. A step
//!   whose bulk data goes this way copies it to the host even under NCCL.
//!
//! What a tensor collective does inside (the host copy of the CPU backends, NCCL's own
//! handshakes) is not logged: only the call the caller made. An asynchronous collective is
//! logged when it is started, not when its communication thread runs it. Calls a rank issues
//! from several threads of its own (a communication thread of the caller's) are logged as they
//! come, so their order across threads may differ from run to run.
//!
//! # Example
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::calls::{CallLog, CallPath};
//! use burn_parallel::{ReduceOp, run_local};
//!
//! let logs = run_local(2, |group| {
//!     let log = CallLog::new();
//!     let group = group.with_call_log(log.clone());
//!     let x = Tensor::<1>::ones([256], &Device::flex());
//!     group.all_reduce(x, ReduceOp::Sum)?; // a tensor collective: NCCL's under nccl
//!     group.all_reduce_f32(vec![1.0], ReduceOp::Max)?; // host data, 4 bytes
//!     Ok(log.take())
//! })
//! .unwrap();
//! let calls = &logs[0];
//! assert_eq!(calls.len(), 2);
//! assert_eq!((calls[0].op, calls[0].path, calls[0].bytes), ("all_reduce", CallPath::Tensor, 1024));
//! assert_eq!((calls[1].path, calls[1].bytes), (CallPath::Host, 4));
//! assert_eq!(logs[0], logs[1]); // both ranks issued the same calls
//! ```

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use burn::tensor::DType;

/// Where a logged collective's payload goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallPath {
    /// A collective on tensors: on device memory under NCCL (CUDA tensors), through the host
    /// on the other backends.
    Tensor,
    /// A collective on host data: through host memory on every backend.
    Host,
}

/// One collective a rank issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedCall {
    /// The global ranks of the group it was issued on.
    pub members: Vec<usize>,
    /// The collective (`"all_reduce"`, `"reduce_scatter"`, `"send"`, ...).
    pub op: &'static str,
    /// Where its payload goes.
    pub path: CallPath,
    /// The payload's dtype (`U8` for byte and object collectives).
    pub dtype: DType,
    /// This rank's payload in bytes (a receive: what it received).
    pub bytes: usize,
    /// For a point-to-point call (`send`, `recv`): the other rank (global) and the tag; `None`
    /// for a collective. NCCL matches a pair's device messages in the order they were issued,
    /// so the tensor sends one rank makes to another must come in the order the other
    /// receives them.
    pub peer: Option<(usize, u64)>,
}

/// The calls one rank issued, shared by the groups that log into it (clone it to read it while
/// the groups go on).
#[derive(Debug, Clone, Default)]
pub struct CallLog(Arc<Mutex<Vec<LoggedCall>>>);

impl CallLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// The calls logged so far, in issue order.
    pub fn calls(&self) -> Vec<LoggedCall> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The calls logged so far, leaving the log empty (one step's calls at a time).
    pub fn take(&self) -> Vec<LoggedCall> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Appends a call unless this thread is inside another logged call.
    pub(crate) fn push(&self, call: LoggedCall) {
        if INSIDE.with(Cell::get) == 0 {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).push(call);
        }
    }
}

thread_local! {
    /// How many logged calls this thread is inside: the collectives they make on their own
    /// behalf (a tensor collective's host copy, an asynchronous one run on its lane) are theirs.
    static INSIDE: Cell<u32> = const { Cell::new(0) };
}

/// Marks this thread as inside a logged call until dropped.
pub(crate) struct Inside(());

impl Inside {
    pub(crate) fn enter() -> Self {
        INSIDE.with(|d| d.set(d.get() + 1));
        Inside(())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|d| d.set(d.get() - 1));
    }
}
