//! Tensor parallelism and sequence parallelism (Megatron-LM; Korthikanti et al. 2022): the
//! pieces under the layers of [`crate::nn`].
//!
//! A model is written once with [`crate::nn::Linear`] and [`crate::nn::Embedding`]; a
//! [`TpPlan`](crate::plan::TpPlan) given to [`Init::with_tp`](crate::init::Init::with_tp) splits
//! them (column- or row-parallel linears, vocabulary-split embeddings and heads). This module
//! holds what those layers share and what a user writing their own tensor-parallel operation
//! needs:
//!
//! | piece | what |
//! |---|---|
//! | [`Split`], [`Shard`] | how a dimension is split over the group (even, padded, whole blocks) |
//! | [`TpTensor`], [`Placement`] | a local tensor and its place in the group (replicated, sharded, partial sum), checked before use |
//! | [`vocab_parallel_cross_entropy`] | the loss of vocabulary-sharded logits, without gathering them |
//! | [`sequence_shard`], [`sp_param`], [`SEQ_DIM`] | sequence parallelism: a rank's tokens, replicated parameters used on sequence shards |
//! | [`SeededDropout`] | dropout whose masks do not depend on the layout |
//!
//! Communication is the conjugate pairs of [`crate::autograd`]: *f* = [`copy_to_group`] before
//! a column-parallel layer, *g* = [`reduce_from_group`] after a row-parallel layer, and under
//! sequence parallelism [`gather_from_sequence`](crate::autograd::gather_from_sequence) /
//! [`reduce_scatter_to_sequence`](crate::autograd::reduce_scatter_to_sequence) along the
//! sequence dimension ([`SEQ_DIM`] of `[batch, seq, ..]`) instead. Replicated parameters used on
//! sequence shards (norms, biases added after a reduce-scatter) go through [`sp_param`], whose
//! backward all-reduces their partial gradients over the group, so no separate "reduce the norm
//! gradients" step exists to be forgotten.
//!
//! # Example: a [`TpTensor`] refuses what its placement does not allow
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::run_local;
//! use burn_parallel::tensor_parallel::{Placement, Split, TpError, TpTensor};
//!
//! run_local(2, |group| {
//!     let device = Device::flex();
//!     let shard = Split::Even.shard(8, group.size(), group.rank(), "hidden").unwrap();
//!     let hidden = TpTensor::new(
//!         Tensor::<2>::ones([3, 4], &device),
//!         Placement::Shard { dim: 1, shard },
//!         &group,
//!     )
//!     .unwrap();
//!     // A norm needs whole feature vectors: on a feature shard it is a typed error.
//!     let err = hidden.clone().map_features("ln", |t| t).unwrap_err();
//!     assert!(matches!(err, TpError::Layout { .. }));
//!     // Gathering the shards gives the whole width back on every rank.
//!     assert_eq!(hidden.to_replicated().unwrap().dims(), [3, 8]);
//!     Ok(())
//! })
//! .unwrap();
//! ```

pub mod context;
pub mod dropout;
pub mod loss;
pub(crate) mod region;

use std::fmt;

use burn::tensor::Tensor;

use crate::autograd::{
    copy_to_group, even_split, gather_from_group, reduce_from_group, scatter_to_group,
};
use crate::error::CollectiveError;
use crate::group::ProcessGroup;

pub use context::TpContext;
pub use dropout::{DropoutSite, SeededDropout};
pub use loss::{CrossEntropyOptions, vocab_parallel_cross_entropy};
pub use region::VocabSplit;

/// The sequence dimension of activations `[batch, seq, ..]` under sequence parallelism.
pub const SEQ_DIM: usize = 1;

/// Errors of tensor-parallel layers, plans and losses.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TpError {
    /// A collective failed (dead peer, mismatch, timeout).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Context-parallel attention refused its inputs (a sequence that does not split over the
    /// ranks, heads that Ulysses cannot share, settings that differ between ranks).
    #[error(transparent)]
    ContextParallel(crate::context_parallel::CpError),
    /// A layer received an activation with the wrong placement: the layers are mis-paired.
    #[error("{layer}: expects {expected}, got {got}. {hint}")]
    Layout {
        /// The layer (its name, or its type).
        layer: String,
        /// The placement the layer needs.
        expected: String,
        /// The placement it received.
        got: String,
        /// What to change.
        hint: String,
    },
    /// A tensor has the wrong shape for the layer.
    #[error("{layer}: {reason}")]
    Shape {
        /// The layer.
        layer: String,
        /// What is wrong.
        reason: String,
    },
    /// A size must be a multiple of the tensor-parallel size.
    #[error(
        "{what} ({value}) is not divisible by the tensor-parallel size {tp}; choose a \
         tensor-parallel size that divides it{hint}"
    )]
    NotDivisible {
        /// What must divide (for example `n_heads`).
        what: String,
        /// Its value.
        value: usize,
        /// The tensor-parallel size.
        tp: usize,
        /// Extra advice (starts with `; ` when present).
        hint: String,
    },
    /// A token or target id outside the vocabulary.
    #[error("{layer}: id {id} is outside the vocabulary 0..{vocab}")]
    OutOfVocabulary {
        /// The layer or loss.
        layer: String,
        /// The offending id.
        id: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A fused kernel refused its input (a target outside the vocabulary of the fused
    /// cross-entropy, a shape or dtype it does not take).
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    /// An inconsistent tensor-parallel configuration.
    #[error("invalid tensor-parallel configuration: {0}")]
    Config(String),
    /// A tensor-parallel plan that does not fit the model: a rule matching no layer, a style a
    /// layer cannot take, a malformed pattern.
    #[error("tensor-parallel plan: {0}")]
    Plan(String),
}

/// A context-parallel error inside a model's forward: its collective failures stay
/// [`TpError::Collective`], the rest is [`TpError::ContextParallel`].
impl From<crate::context_parallel::CpError> for TpError {
    fn from(e: crate::context_parallel::CpError) -> Self {
        match e {
            crate::context_parallel::CpError::Collective(c) => TpError::Collective(c),
            other => TpError::ContextParallel(other),
        }
    }
}

/// Shorthand for results of tensor-parallel operations.
pub type TpResult<T> = std::result::Result<T, TpError>;

/// One rank's part of a dimension of size `full`: the global entries
/// `start..start + len`, stored in `stored >= len` local entries (the tail `stored - len` is
/// padding: zero weights that never reach a result).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shard {
    /// Size of the whole dimension (without padding).
    pub full: usize,
    /// First global index held here.
    pub start: usize,
    /// Real entries held here.
    pub len: usize,
    /// Local entries, padding included.
    pub stored: usize,
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}..{} of {}",
            self.start,
            self.start + self.len,
            self.full
        )?;
        if self.stored > self.len {
            write!(f, " (+{} padding)", self.stored - self.len)?;
        }
        Ok(())
    }
}

/// How a dimension is split over the ranks of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// As evenly as possible, the first ranks one larger ([`even_split`]); no padding.
    Even,
    /// In whole blocks of `block` entries (attention heads: `block = head_dim`); the number of
    /// blocks must be a multiple of the group size.
    Blocks {
        /// Entries per block.
        block: usize,
    },
    /// Every rank stores the same `ceil(full / (tp * multiple)) * multiple` entries; the last
    /// ranks hold padding (Megatron's padded vocabulary).
    Padded {
        /// Each rank's size is a multiple of this (1 for the tightest padding).
        multiple: usize,
    },
}

impl Split {
    /// Rank `rank`'s shard of a dimension of size `full` split over `tp` ranks.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] when whole blocks cannot be shared equally;
    /// [`TpError::Config`] for a zero block, multiple or group size.
    ///
    /// # Example
    /// ```
    /// use burn_parallel::tensor_parallel::{Shard, Split};
    /// let s = Split::Padded { multiple: 1 }.shard(10, 4, 3, "vocab").unwrap();
    /// assert_eq!(s, Shard { full: 10, start: 9, len: 1, stored: 3 });
    /// ```
    pub fn shard(self, full: usize, tp: usize, rank: usize, what: &str) -> TpResult<Shard> {
        if tp == 0 || rank >= tp {
            return Err(TpError::Config(format!("rank {rank} of a group of {tp}")));
        }
        match self {
            Split::Even => {
                let sizes = even_split(full, tp);
                let start = sizes[..rank].iter().sum();
                Ok(Shard {
                    full,
                    start,
                    len: sizes[rank],
                    stored: sizes[rank],
                })
            }
            Split::Blocks { block } => {
                if block == 0 || !full.is_multiple_of(block) {
                    return Err(TpError::Config(format!(
                        "{what} ({full}) is not a whole number of blocks of {block}"
                    )));
                }
                let blocks = full / block;
                if !blocks.is_multiple_of(tp) {
                    return Err(TpError::NotDivisible {
                        what: format!("{what} (in blocks of {block})"),
                        value: blocks,
                        tp,
                        hint: String::new(),
                    });
                }
                let len = full / tp;
                Ok(Shard {
                    full,
                    start: rank * len,
                    len,
                    stored: len,
                })
            }
            Split::Padded { multiple } => {
                if multiple == 0 {
                    return Err(TpError::Config("padding multiple 0".into()));
                }
                let unit = tp * multiple;
                let per = full.div_ceil(unit) * multiple;
                let start = (rank * per).min(full);
                let len = full.saturating_sub(rank * per).min(per);
                Ok(Shard {
                    full,
                    start,
                    len,
                    stored: per,
                })
            }
        }
    }
}

/// Where the values of a [`TpTensor`] live in its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds the whole tensor, and the same values.
    Replicate,
    /// Every rank holds its [`Shard`] of dimension `dim`.
    Shard {
        /// The split dimension.
        dim: usize,
        /// This rank's part.
        shard: Shard,
    },
    /// Every rank holds a full-shaped partial sum; the value is the sum over the group.
    Partial,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => write!(f, "a replicated tensor"),
            Placement::Shard { dim, shard } => {
                write!(f, "a tensor sharded along dim {dim} (this rank: {shard})")
            }
            Placement::Partial => write!(f, "a partial sum (not yet all-reduced)"),
        }
    }
}

/// A local tensor together with its [`Placement`] in a tensor-parallel group: what flows
/// between tensor-parallel layers.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::run_local;
/// use burn_parallel::tensor_parallel::{Placement, TpTensor};
///
/// run_local(2, |group| {
///     let x = TpTensor::replicated(Tensor::<3>::ones([1, 5, 4], &Device::flex()), &group);
///     let shards = x.clone().scatter_sequence().unwrap(); // sequence parallel: 3 + 2 tokens
///     assert!(matches!(shards.placement(), Placement::Shard { dim: 1, .. }));
///     assert_eq!(shards.to_replicated().unwrap().dims(), [1, 5, 4]);
///     Ok(())
/// })
/// .unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct TpTensor<const D: usize> {
    tensor: Tensor<D>,
    placement: Placement,
    group: ProcessGroup,
}

impl<const D: usize> TpTensor<D> {
    /// Declares `tensor` replicated over `group` (the caller guarantees that every rank holds
    /// the same values).
    pub fn replicated(tensor: Tensor<D>, group: &ProcessGroup) -> Self {
        Self {
            tensor,
            placement: Placement::Replicate,
            group: group.clone(),
        }
    }

    /// Wraps a local tensor with an explicit placement (for layers written outside this
    /// module). Checks that the local size matches a [`Placement::Shard`].
    ///
    /// # Errors
    /// [`TpError::Shape`] when the local size along the shard's dimension is not `stored`.
    pub fn new(tensor: Tensor<D>, placement: Placement, group: &ProcessGroup) -> TpResult<Self> {
        if let Placement::Shard { dim, shard } = &placement
            && (*dim >= D || tensor.dims()[*dim] != shard.stored)
        {
            return Err(TpError::Shape {
                layer: "TpTensor::new".into(),
                reason: format!(
                    "a local tensor of shape {:?} cannot hold shard {shard} of dim {dim}",
                    tensor.dims()
                ),
            });
        }
        Ok(Self {
            tensor,
            placement,
            group: group.clone(),
        })
    }

    /// The local tensor.
    pub fn tensor(&self) -> &Tensor<D> {
        &self.tensor
    }

    /// The local tensor, consuming the wrapper.
    pub fn into_tensor(self) -> Tensor<D> {
        self.tensor
    }

    /// The placement.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The local shape.
    pub fn dims(&self) -> [usize; D] {
        self.tensor.dims()
    }

    /// Applies an element-wise (or position-wise) function that keeps the placement:
    /// activations, dropout, scaling.
    ///
    /// # Errors
    /// [`TpError::Layout`] on a partial sum (a non-linear function of a partial sum is wrong).
    pub fn map(self, op: &str, f: impl FnOnce(Tensor<D>) -> Tensor<D>) -> TpResult<Self> {
        if self.placement == Placement::Partial {
            return Err(TpError::Layout {
                layer: op.into(),
                expected: "a complete (replicated or sharded) tensor".into(),
                got: self.placement.to_string(),
                hint: "reduce the partial sum first (TpTensor::reduce)".into(),
            });
        }
        Ok(Self {
            tensor: f(self.tensor),
            ..self
        })
    }

    /// Applies a function that reduces over the last (feature) dimension, such as a norm or a
    /// softmax; it needs whole feature vectors.
    ///
    /// # Errors
    /// [`TpError::Layout`] when the tensor is a partial sum or sharded along its last dimension
    /// (a norm of a feature shard normalises by the wrong statistics).
    pub fn map_features(self, op: &str, f: impl FnOnce(Tensor<D>) -> Tensor<D>) -> TpResult<Self> {
        if let Placement::Shard { dim, .. } = &self.placement
            && *dim == D - 1
        {
            return Err(TpError::Layout {
                layer: op.into(),
                expected: "whole feature vectors (replicated, or sharded along the sequence)"
                    .into(),
                got: self.placement.to_string(),
                hint: "a feature shard comes out of a column-parallel linear: feed it to the \
                       matching row-parallel one, or gather it first (to_replicated)"
                    .into(),
            });
        }
        self.map(op, f)
    }

    /// Element-wise sum of two tensors of the same placement (a residual connection).
    ///
    /// # Errors
    /// [`TpError::Layout`] when the placements or groups differ (for example adding a
    /// sequence shard to a replicated tensor, which broadcasting could silently accept).
    pub fn residual_add(self, other: TpTensor<D>) -> TpResult<Self> {
        self.same_group(&other.group, "residual add")?;
        if self.placement != other.placement {
            return Err(TpError::Layout {
                layer: "residual add".into(),
                expected: format!("two tensors of the same placement ({})", self.placement),
                got: other.placement.to_string(),
                hint: "convert one side first (to_replicated, scatter_sequence) or enable \
                       sequence parallelism on every layer of the block"
                    .into(),
            });
        }
        if self.dims() != other.dims() {
            return Err(TpError::Shape {
                layer: "residual add".into(),
                reason: format!("shapes {:?} and {:?} differ", self.dims(), other.dims()),
            });
        }
        Ok(Self {
            tensor: self.tensor + other.tensor,
            ..self
        })
    }

    /// Fails unless `group` has the same members as this tensor's group.
    pub(crate) fn same_group(&self, group: &ProcessGroup, layer: &str) -> TpResult<()> {
        if self.group.members() != group.members() {
            return Err(TpError::Layout {
                layer: layer.into(),
                expected: format!("a tensor of the group {:?}", group.members()),
                got: format!("a tensor of the group {:?}", self.group.members()),
                hint: "layers of one tensor-parallel region must share one group".into(),
            });
        }
        Ok(())
    }

    /// All-reduces a partial sum (Megatron's *g*; identity backward).
    ///
    /// # Errors
    /// [`TpError::Layout`] unless the tensor is [`Placement::Partial`]; collective errors.
    pub fn reduce(self) -> TpResult<Self> {
        if self.placement != Placement::Partial {
            return Err(TpError::Layout {
                layer: "TpTensor::reduce".into(),
                expected: "a partial sum".into(),
                got: self.placement.to_string(),
                hint: "reducing a complete tensor would multiply it by the group size".into(),
            });
        }
        Ok(Self {
            tensor: reduce_from_group(self.tensor, &self.group)?,
            placement: Placement::Replicate,
            group: self.group,
        })
    }

    /// The whole tensor on every rank, for a replicated computation downstream: all-gathers a
    /// shard (padding dropped; the backward keeps this rank's slice), all-reduces a partial
    /// sum, returns a replicated tensor as is.
    ///
    /// # Errors
    /// Collective errors.
    pub fn to_replicated(self) -> TpResult<Self> {
        match self.placement {
            Placement::Replicate => Ok(self),
            Placement::Partial => self.reduce(),
            Placement::Shard { dim, shard } => {
                let gathered = gather_from_group(self.tensor, &self.group, dim)?;
                let total = gathered.dims()[dim];
                let tensor = if total == shard.full {
                    gathered
                } else {
                    // Padded shards: every real index precedes every padding index.
                    gathered.narrow(dim, 0, shard.full)
                };
                Ok(Self {
                    tensor,
                    placement: Placement::Replicate,
                    group: self.group,
                })
            }
        }
    }

    /// Enters sequence parallelism from a replicated `[batch, seq, ..]` tensor: keeps this
    /// rank's tokens ([`Split::Even`] along [`SEQ_DIM`]); the backward all-gathers.
    ///
    /// # Errors
    /// [`TpError::Layout`] unless replicated.
    pub fn scatter_sequence(self) -> TpResult<Self> {
        if self.placement != Placement::Replicate || D < 2 {
            return Err(TpError::Layout {
                layer: "scatter_sequence".into(),
                expected: "a replicated [batch, seq, ..] tensor".into(),
                got: self.placement.to_string(),
                hint: String::new(),
            });
        }
        let shard = sequence_shard(self.tensor.dims()[SEQ_DIM], &self.group)?;
        Ok(Self {
            tensor: scatter_to_group(self.tensor, &self.group, SEQ_DIM)?,
            placement: Placement::Shard {
                dim: SEQ_DIM,
                shard,
            },
            group: self.group,
        })
    }
}

/// This rank's part of a sequence of `seq` tokens under sequence parallelism.
///
/// # Errors
/// Never for a valid group; typed for uniformity.
pub fn sequence_shard(seq: usize, group: &ProcessGroup) -> TpResult<Shard> {
    Split::Even.shard(seq, group.size(), group.rank(), "sequence")
}

/// A replicated parameter used on sequence shards: identity forward, gradient all-reduced over
/// `group` backward (each rank only saw its tokens). Use it for norm weights and biases inside
/// a sequence-parallel region; outside one (`sequence_parallel == false`) it returns `param`.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{run_local, tensor_parallel::sp_param};
/// run_local(2, |group| {
///     let w = Tensor::<1>::ones([3], &Device::flex());
///     assert_eq!(sp_param(w, &group, true).dims(), [3]);
///     Ok(())
/// })
/// .unwrap();
/// ```
pub fn sp_param<const D: usize>(
    param: Tensor<D>,
    group: &ProcessGroup,
    sequence_parallel: bool,
) -> Tensor<D> {
    if sequence_parallel {
        copy_to_group(param, group)
    } else {
        param
    }
}
