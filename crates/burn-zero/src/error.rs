//! Typed errors of burn-zero. Every message says what went wrong and what to do about it.

use burn_parallel::CollectiveError;
use burn_parallel::replica::ReplicaError;

/// Everything that can go wrong while sharding, stepping or checkpointing.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A collective failed (dead peer, mismatched call order, timeout...).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A tensor-parallel layer or plan failed while building or running a unit.
    #[error(transparent)]
    Tp(#[from] burn_parallel::tensor_parallel::TpError),
    /// A distributed checkpoint could not be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] burn_parallel::checkpoint::CheckpointError),
    /// The replicas handed to a wrapper are not identical on every rank (checked with
    /// [`burn_parallel::replica::verify_replicas`] when a module is wrapped).
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    /// The configuration or the call sequence cannot work.
    #[error("invalid burn-zero usage: {0}")]
    Config(String),
    /// A background prefetch (stage 3) did not complete.
    #[error("prefetch of unit {unit} failed: {reason}")]
    Prefetch {
        /// The unit whose gather was prefetched.
        unit: String,
        /// What happened to the background gather.
        reason: String,
    },
    /// The requested dtype cannot be used on this device.
    #[error("dtype {dtype:?} is not supported on device {device}: {hint}")]
    UnsupportedDType {
        /// The dtype asked for.
        dtype: burn::tensor::DType,
        /// The device, as text.
        device: String,
        /// What to do instead.
        hint: String,
    },
}

/// Shorthand for burn-zero results.
pub type Result<T> = std::result::Result<T, ZeroError>;

impl From<burn_parallel::precision::PrecisionError> for ZeroError {
    fn from(e: burn_parallel::precision::PrecisionError) -> Self {
        use burn_parallel::precision::PrecisionError as P;
        match e {
            P::UnsupportedDType {
                dtype,
                device,
                hint,
            } => ZeroError::UnsupportedDType {
                dtype,
                device,
                hint,
            },
            P::Config(reason) => ZeroError::Config(reason),
            P::Collective(c) => ZeroError::Collective(c),
        }
    }
}

/// A ZeRO error in a training loop whose error type is the tensor-parallel layers' ([`TpError`],
/// as for [`burn_parallel::train::StepEngine`]): collective and tensor-parallel failures keep
/// their type, the others become a [`TpError::Config`] with the message.
///
/// [`TpError`]: burn_parallel::tensor_parallel::TpError
/// [`TpError::Config`]: burn_parallel::tensor_parallel::TpError::Config
impl From<ZeroError> for burn_parallel::tensor_parallel::TpError {
    fn from(e: ZeroError) -> Self {
        use burn_parallel::tensor_parallel::TpError;
        match e {
            ZeroError::Tp(e) => e,
            ZeroError::Collective(e) => TpError::Collective(e),
            other => TpError::Config(other.to_string()),
        }
    }
}

/// ZeRO's error at the suite's surface: a collective, tensor-parallel, checkpoint or replica
/// failure as that variant of [`burn_parallel::Error`], the rest as
/// [`burn_parallel::Error::Technique`].
impl From<ZeroError> for burn_parallel::Error {
    fn from(e: ZeroError) -> Self {
        match e {
            ZeroError::Collective(e) => e.into(),
            ZeroError::Tp(e) => e.into(),
            ZeroError::Checkpoint(e) => e.into(),
            ZeroError::Replica(e) => e.into(),
            e => Self::Technique(Box::new(e)),
        }
    }
}
