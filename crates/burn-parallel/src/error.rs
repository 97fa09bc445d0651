//! Typed errors of the collectives, the transports and the mesh.

use std::time::Duration;

/// Everything that can go wrong in a collective or point-to-point call.
///
/// Every variant names the calling rank, the operation and, where relevant, the peer and the
/// shapes, so that a failure in a job of many ranks can be traced from one log line.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CollectiveError {
    /// No message arrived from `peer` within the group's timeout.
    #[error(
        "rank {rank}: {op} timed out after {timeout:?} waiting for rank {peer} \
         (is that rank alive and calling the same collectives in the same order? \
         raise the timeout with ProcessGroup::with_timeout or BURN_PARALLEL_TIMEOUT_SECS)"
    )]
    Timeout {
        /// Global rank of the caller.
        rank: usize,
        /// The operation, with its call number in the group.
        op: String,
        /// Global rank that was waited for.
        peer: usize,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// A peer failed (panicked, returned an error, exited or lost its connection).
    #[error("rank {rank}: {op} aborted because rank {peer} failed: {reason}")]
    PeerFailed {
        /// Global rank of the caller.
        rank: usize,
        /// The operation that was interrupted.
        op: String,
        /// Global rank that failed.
        peer: usize,
        /// What the failed rank (or its transport) reported.
        reason: String,
    },
    /// Two ranks called different collectives, or the same one with incompatible arguments.
    #[error(
        "rank {rank}: collective mismatch with rank {peer}: this rank called {ours} \
         but rank {peer} called {theirs}"
    )]
    Mismatch {
        /// Global rank of the caller.
        rank: usize,
        /// Global rank of the disagreeing peer.
        peer: usize,
        /// What this rank called (operation, call number, dtype, shape).
        ours: String,
        /// What the peer called.
        theirs: String,
    },
    /// The caller passed arguments that cannot work (wrong dimension, split sizes, dtype...).
    #[error("rank {rank}: invalid {op}: {reason}")]
    InvalidArgument {
        /// Global rank of the caller.
        rank: usize,
        /// The operation.
        op: String,
        /// What is wrong and what to do instead.
        reason: String,
    },
    /// A transport-level failure: connection refused or reset, malformed frame, I/O error.
    #[error("rank {rank}: transport error with rank {peer}: {reason}")]
    Transport {
        /// Global rank of the caller.
        rank: usize,
        /// The peer involved (the caller itself when there is none).
        peer: usize,
        /// What happened.
        reason: String,
    },
    /// Forming the world failed: bad environment, wrong world size, duplicate rank, rendezvous
    /// unreachable.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// A collective that the backend runs as one operation (MPI's) did not complete within the
    /// timeout; the backend cannot tell which member is missing.
    #[error(
        "rank {rank}: {op} on the {backend} backend did not complete within {timeout:?} \
         (is every rank of the group alive and calling the same collectives in the same order? \
         raise the timeout with ProcessGroup::with_timeout or BURN_PARALLEL_TIMEOUT_SECS)"
    )]
    CollectiveTimeout {
        /// Global rank of the caller.
        rank: usize,
        /// The operation, with its call number in the group.
        op: String,
        /// The backend (`"mpi"`).
        backend: String,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// A backend was asked for that this build does not include.
    #[error("the {backend} backend is not built in: {hint}")]
    BackendNotBuilt {
        /// The backend asked for (`"mpi"`).
        backend: String,
        /// Which feature to enable, and what it needs installed.
        hint: String,
    },
    /// A timeout setting that cannot be used: not a positive finite number of seconds, or too
    /// long for a deadline to be represented (see [`crate::comm::tcp::MAX_TIMEOUT`]).
    #[error("{setting}={value} is not a usable timeout: {reason}")]
    InvalidTimeout {
        /// Where the value came from (an environment variable or a method).
        setting: String,
        /// The value as given.
        value: String,
        /// What is wrong and what to set instead.
        reason: String,
    },
    /// The job token (`BURN_PARALLEL_JOB_TOKEN`) of this rank does not match the job's, or one
    /// side of the rendezvous has a token and the other has none.
    #[error("rank {rank}: job token (BURN_PARALLEL_JOB_TOKEN) refused: {reason}")]
    JobToken {
        /// Global rank of the caller.
        rank: usize,
        /// What was refused, and what to set.
        reason: String,
    },
    /// The device's backend is not one this build of `burn-parallel` supports.
    #[error(
        "the device {device} is on a backend this build of burn-parallel does not support: {hint}"
    )]
    UnsupportedBackend {
        /// The device, as Burn prints it.
        device: String,
        /// What to enable.
        hint: String,
    },
    /// A communication backend that this build or this machine cannot provide: a cargo feature
    /// that was not enabled, a shared library (libnccl) or a driver (CUDA) that cannot be loaded.
    #[error("the {backend} backend is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend (`"nccl"`, ...).
        backend: String,
        /// What is missing, and what to install or rebuild with.
        reason: String,
    },
    /// NCCL (or the CUDA driver under it) reported an error on this rank, synchronously or
    /// asynchronously (`ncclCommGetAsyncError`); the communicator is aborted.
    #[error("rank {rank}: NCCL {op} failed: {reason}")]
    Nccl {
        /// Global rank of the caller.
        rank: usize,
        /// The operation, with its shapes.
        op: String,
        /// NCCL's error and its last-error text.
        reason: String,
    },
    /// A training step's loss (averaged over the data-parallel ranks) or its gradients' global
    /// norm is not a finite number, and no loss scaler skips the step: the update is refused
    /// on every rank alike (both figures are global), before anything is written into the
    /// weights.
    #[error(
        "rank {rank}: the step's {what} is {value}: the update was refused (training stops \
         here; a checkpoint saved before holds finite weights); lower the learning rate, clip \
         the gradients, or check the data and the initial weights (under fp16, a loss scaler \
         skips such steps instead)"
    )]
    NonFinite {
        /// Global rank of the caller.
        rank: usize,
        /// `"loss"` or `"gradient norm"`.
        what: &'static str,
        /// The value.
        value: f64,
    },
    /// The fault-tolerant replicas ([`crate::fault`]) cannot go on together: this replica was
    /// left out, their parameters differ, or their exchange keeps failing.
    #[error("rank {rank}: fault-tolerant data parallelism: {reason}")]
    Quorum {
        /// Global rank of the caller.
        rank: usize,
        /// What happened and what to do.
        reason: String,
    },
}

impl CollectiveError {
    /// `Ok` when `value` (a step's `what`: its loss or gradient norm, on `rank`) is finite,
    /// [`CollectiveError::NonFinite`] otherwise: the one check every engine runs before its
    /// update.
    ///
    /// # Errors
    /// [`CollectiveError::NonFinite`] for a NaN or infinite `value`.
    pub fn ensure_finite(rank: usize, what: &'static str, value: f64) -> Result<()> {
        match value.is_finite() {
            true => Ok(()),
            false => Err(CollectiveError::NonFinite { rank, what, value }),
        }
    }

    /// `true` when the error means another rank is gone (and so the job cannot continue).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            CollectiveError::PeerFailed { .. } | CollectiveError::Transport { .. }
        )
    }
}

/// Shorthand for results of collective calls.
pub type Result<T> = std::result::Result<T, CollectiveError>;
