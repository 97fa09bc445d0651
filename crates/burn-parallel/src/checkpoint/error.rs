//! Why a checkpoint could not be saved or loaded: [`CheckpointError`].

use std::path::{Path, PathBuf};

use crate::CollectiveError;

/// Why a checkpoint could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A file does not match the manifest: truncated, altered or missing.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor where one is concerned.
        reason: String,
    },
    /// The checkpoint holds other tensors than the model asks for.
    #[error(
        "the checkpoint does not match the model: missing {missing:?}, unexpected {unexpected:?}, \
         other shapes {shapes:?}; load a checkpoint of this model or map the names"
    )]
    Mismatch {
        /// Tensors the model has and the checkpoint lacks, with their shapes.
        missing: Vec<(String, Vec<usize>)>,
        /// Tensors the checkpoint has and the model lacks, with their shapes.
        unexpected: Vec<(String, Vec<usize>)>,
        /// Tensors of both with different shapes: (name, checkpoint's, model's).
        shapes: Vec<(String, Vec<usize>, Vec<usize>)>,
    },
    /// The pieces given to a save, or the region asked of a load, do not make sense.
    #[error("tensor {name}: {reason}")]
    Piece {
        /// The logical tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The ranks could not agree (a collective failed).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

impl CheckpointError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
    /// [`Self::Piece`]: tensor or state `name` cannot be written or read, for `reason`.
    pub fn piece(name: &str, reason: impl Into<String>) -> Self {
        Self::Piece {
            name: name.to_string(),
            reason: reason.into(),
        }
    }
}

/// Result of the checkpoint functions.
pub type Result<T> = std::result::Result<T, CheckpointError>;
