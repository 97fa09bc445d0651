//! [`Error`]: the one error type at the surface of the suite, so that a training loop built on
//! any of its crates is `?` throughout.
//!
//! Each crate keeps its own precise error (`CollectiveError`, `TpError`, `CheckpointError`,
//! `burn_zero::ZeroError`, `burn_moe::MoeError`, `burn_pipeline::PipelineError`, ...) and each
//! converts into [`Error`]: this crate's here, the sibling crates' in their own crate (they
//! depend on this one, not the other way round). A collective failure arrives as
//! [`Error::Collective`] whichever layer saw it first, so a loop that restarts on a dead peer
//! matches one variant.

use crate::checkpoint::CheckpointError;
use crate::diloco::DiLoCoError;
use crate::error::CollectiveError;
use crate::mesh::MeshError;
use crate::replica::ReplicaError;
use crate::tensor_parallel::TpError;

/// Everything a training run built on the suite can fail with.
///
/// # Example
/// ```
/// use burn_parallel::{CollectiveError, Error, TpError};
///
/// // A collective failure is `Error::Collective` whichever layer reported it.
/// let dead = CollectiveError::PeerFailed { rank: 0, op: "all_reduce".into(), peer: 1, reason: "closed".into() };
/// assert!(matches!(Error::from(TpError::Collective(dead.clone())), Error::Collective(_)));
/// // A setting that cannot run names the setting.
/// let e = Error::invalid("--tp", "3 does not divide 4 ranks");
/// assert_eq!(e.to_string(), "--tp: 3 does not divide 4 ranks");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective or point-to-point call failed (a dead peer, a timeout, mismatched calls).
    #[error(transparent)]
    Collective(CollectiveError),
    /// A tensor-parallel plan, layer or loss refused its input.
    #[error(transparent)]
    TensorParallel(TpError),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(CheckpointError),
    /// The mesh does not fit the world.
    #[error(transparent)]
    Mesh(MeshError),
    /// Replicas that should be identical are not.
    #[error(transparent)]
    Replica(ReplicaError),
    /// DiLoCo's outer loop failed.
    #[error(transparent)]
    DiLoCo(DiLoCoError),
    /// A setting, input or file that cannot run: `what` names it (a flag, a config key, a path).
    #[error("{what}: {reason}")]
    Invalid {
        /// The setting, input or file (`--tp`, `model.n_heads`, a path).
        what: String,
        /// Why, and what to do.
        reason: String,
    },
    /// Resuming from the checkpoint at `path` failed: it cannot be read, or this run cannot
    /// continue it (`source` says which).
    #[error("resuming from {}: {source}", path.display())]
    Resume {
        /// The checkpoint (or the directory of them) resumed from.
        path: std::path::PathBuf,
        /// What failed.
        source: Box<Error>,
    },
    /// Training step `step` (counted from 1, as checkpoints count the steps done) failed: a
    /// non-finite loss or gradient norm, a dead peer, ... (`source` says which).
    #[error("step {step}: {source}")]
    Step {
        /// The step that failed.
        step: usize,
        /// What failed.
        source: Box<Error>,
    },
    /// An error of one of the suite's technique crates (`burn-zero`, `burn-moe`,
    /// `burn-pipeline`), which converts its own error into this one.
    #[error(transparent)]
    Technique(Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// [`Error::Invalid`]: `what` (a flag, a key, a path) cannot run, for `reason`.
    pub fn invalid(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Invalid {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    /// The collective failure inside, if this is one: what a loop that survives a dead peer
    /// looks at.
    pub fn collective(&self) -> Option<&CollectiveError> {
        match self {
            Self::Collective(e) => Some(e),
            Self::Resume { source, .. } | Self::Step { source, .. } => source.collective(),
            _ => None,
        }
    }

    /// This error as the failure of training step `step` (counted from 1).
    pub fn at_step(self, step: usize) -> Self {
        Self::Step {
            step,
            source: Box::new(self),
        }
    }

    /// This error as a failure to resume from `path`.
    pub fn resuming(self, path: &std::path::Path) -> Self {
        Self::Resume {
            path: path.to_path_buf(),
            source: Box::new(self),
        }
    }
}

impl From<CollectiveError> for Error {
    fn from(e: CollectiveError) -> Self {
        Self::Collective(e)
    }
}

impl From<TpError> for Error {
    fn from(e: TpError) -> Self {
        match e {
            TpError::Collective(e) => Self::Collective(e),
            e => Self::TensorParallel(e),
        }
    }
}

impl From<CheckpointError> for Error {
    fn from(e: CheckpointError) -> Self {
        match e {
            CheckpointError::Collective(e) => Self::Collective(e),
            e => Self::Checkpoint(e),
        }
    }
}

impl From<MeshError> for Error {
    fn from(e: MeshError) -> Self {
        match e {
            MeshError::Collective(e) => Self::Collective(e),
            e => Self::Mesh(e),
        }
    }
}

impl From<ReplicaError> for Error {
    fn from(e: ReplicaError) -> Self {
        match e {
            ReplicaError::Collective(e) => Self::Collective(e),
            e => Self::Replica(e),
        }
    }
}

impl From<DiLoCoError> for Error {
    fn from(e: DiLoCoError) -> Self {
        match e {
            DiLoCoError::Collective(e) => Self::Collective(e),
            e => Self::DiLoCo(e),
        }
    }
}
