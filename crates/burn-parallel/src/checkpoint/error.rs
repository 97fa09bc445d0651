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
    /// A tensor whose element type is not a float, where a parameter's values are needed.
    #[error(
        "tensor `{tensor}` has dtype {dtype}; only float tensors (F32, F64, F16, BF16) load as \
         parameters"
    )]
    Dtype {
        /// The tensor.
        tensor: String,
        /// Its element type.
        dtype: String,
    },
    /// A tensor of another shape than a name mapping ([`super::hf::Adapter`]) expects.
    #[error(
        "tensor `{tensor}` has shape {found:?}, but the model's configuration implies \
         {expected:?} (a checkpoint of another size, or the wrong configuration)"
    )]
    Shape {
        /// The tensor (the checkpoint's name, or the parameter's path).
        tensor: String,
        /// The shape the mapping expects.
        expected: Vec<usize>,
        /// The shape found.
        found: Vec<usize>,
    },
    /// Tensors a name mapping ([`super::hf::Adapter`]) needs are missing from a checkpoint, or
    /// the checkpoint holds tensors it does not map (neither known buffers nor tied aliases).
    #[error("{}", unmapped(missing, unexpected))]
    Unmapped {
        /// Missing tensors, with the shapes the mapping expects.
        missing: Vec<(String, Vec<usize>)>,
        /// Tensors that map to nothing, with their shapes.
        unexpected: Vec<(String, Vec<usize>)>,
    },
    /// The same tensor is stored both with and without a prefix the mapping strips.
    #[error(
        "tensor `{tensor}` is stored both with and without the prefix `{prefix}`; keep one of \
         them"
    )]
    Duplicate {
        /// The tensor, without the prefix.
        tensor: String,
        /// The prefix.
        prefix: String,
    },
    /// A tied alias (a tied head saved anyway) that differs from the parameter it is tied to.
    #[error(
        "tensor `{tensor}` differs from `{param}`, but the configuration ties them \
         (`tie_word_embeddings`): untie them in the configuration, or drop the tensor"
    )]
    Tied {
        /// The checkpoint's tensor.
        tensor: String,
        /// The parameter it must equal.
        param: String,
    },
}

/// The text of [`CheckpointError::Unmapped`]: each list counted, each tensor with its shape.
fn unmapped(missing: &[(String, Vec<usize>)], unexpected: &[(String, Vec<usize>)]) -> String {
    let list = |what: &str, items: &[(String, Vec<usize>)]| {
        let items: Vec<String> = items.iter().map(|(n, s)| format!("`{n}` {s:?}")).collect();
        format!("{} {what}: {}", items.len(), items.join(", "))
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(list("missing", missing));
    }
    if !unexpected.is_empty() {
        parts.push(list("unexpected", unexpected));
    }
    format!(
        "the checkpoint does not match the model's configuration: {}",
        parts.join("; ")
    )
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
