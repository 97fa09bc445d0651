//! Context parallelism: attention over a sequence split along its length across the ranks of a
//! group, for sequences no single device holds.
//!
//! | file | what |
//! |---|---|
//! | [`balance`] | which tokens each rank holds ([`SeqLayout`]): contiguous or head-tail (zigzag) |
//! | [`ring`] | ring attention: K/V blocks rotate, partial outputs merge by log-sum-exp, the backward is a second ring pass written as one custom autodiff step |
//! | [`ulysses`] | Ulysses: all-to-all from sequence-sharded to head-sharded around a local attention |
//!
//! A rank holds Q, K, V for its tokens, `[batch, heads, local_seq, head_dim]`, in the local
//! order of its [`SeqLayout`]; [`ContextParallel::attention`] returns the attention output for
//! those tokens, exactly (up to rounding) the rows of full single-device attention, and its
//! gradients are the single-device ones.
//!
//! Everything else of a transformer (embeddings, norms, MLP, loss) runs token-wise on the local
//! tokens; the parameters' gradients are then summed (or averaged, with the loss averaged too)
//! over the context-parallel ranks like over data-parallel ranks.
//!
//! # Example
//! ```
//! use burn::tensor::{Device, Tensor, TensorData};
//! use burn_parallel::context_parallel::{ContextParallel, CpSettings};
//! use burn_parallel::run_local;
//!
//! let outs = run_local(2, |group| {
//!     let cp = ContextParallel::new(&group, CpSettings::default()).unwrap();
//!     let device = Device::flex();
//!     let full = Tensor::<4>::from_data(
//!         TensorData::new((0..32).map(|i| (i as f32 * 0.37).sin()).collect(), [1, 1, 8, 4]),
//!         &device,
//!     );
//!     let layout = cp.layout(8).unwrap();
//!     let local = layout.local(full, 2).unwrap(); // this rank's 4 tokens
//!     let out = cp.attention(local.clone(), local.clone(), local, true).unwrap();
//!     Ok(out.dims())
//! })
//! .unwrap();
//! assert_eq!(outs[0], [1, 1, 4, 4]);
//! ```

pub mod balance;
pub mod ring;
pub mod ulysses;

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

pub use balance::{CpBalance, SeqLayout};
pub use ring::ring_attention;
pub use ulysses::ulysses_attention;

use crate::autograd::{BackwardFn, attach};
use crate::error::CollectiveError;
use crate::group::ProcessGroup;

/// Errors of context parallelism. Each names the problem and what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CpError {
    /// The sequence does not split evenly over the ranks.
    #[error(
        "a sequence of {seq} tokens cannot be split over {cp} context-parallel ranks with \
         {balance} balancing: its length must be a multiple of {multiple} (pad the sequence or \
         change --seq-len / --cp)"
    )]
    SeqNotDivisible {
        /// The sequence length.
        seq: usize,
        /// The context-parallel size.
        cp: usize,
        /// The balancing asked for.
        balance: CpBalance,
        /// The multiple the length must be (`cp`, or `2 cp` for head-tail).
        multiple: usize,
    },
    /// Ulysses splits the heads over the ranks.
    #[error(
        "Ulysses attention splits the {heads} (local) heads over {cp} context-parallel ranks: \
         the number of heads must be a multiple of cp (use ring attention, or another cp)"
    )]
    HeadsNotDivisible {
        /// The number of heads this rank holds (after any tensor-parallel split).
        heads: usize,
        /// The context-parallel size.
        cp: usize,
    },
    /// Grouped-query attention is not supported.
    #[error(
        "grouped-query attention ({q_heads} query heads, {kv_heads} key/value heads) is not \
         supported by context parallelism: repeat the key/value heads to {q_heads} first"
    )]
    GroupedQuery {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// Tensors of the wrong shape.
    #[error("{op}: {reason}")]
    Shape {
        /// The operation.
        op: String,
        /// What is wrong.
        reason: String,
    },
    /// Ranks of one context-parallel group were set up differently.
    #[error(
        "rank {rank}: context-parallel settings differ across the group: this rank has \
         {ours}, rank {peer} has {theirs}; every rank must pass the same --cp, --cp-kind and \
         --cp-balance"
    )]
    SettingsDiffer {
        /// Global rank of the caller.
        rank: usize,
        /// Global rank that disagrees.
        peer: usize,
        /// The caller's settings.
        ours: String,
        /// The peer's settings.
        theirs: String,
    },
    /// A collective failed (for example a peer that died mid-ring).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// Shorthand for results of context parallelism.
pub type CpResult<T> = Result<T, CpError>;

/// Which algorithm moves the sequence around attention.
/// In a config file, as on the command line: `ring` or `ulysses`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpKind {
    /// Ring attention: K/V blocks rotate around the group ([`ring_attention`]).
    #[default]
    #[serde(alias = "Ring")]
    Ring,
    /// Ulysses: all-to-all to head-sharded and back ([`ulysses_attention`]).
    #[serde(alias = "Ulysses")]
    Ulysses,
}

impl std::str::FromStr for CpKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ring" => Ok(CpKind::Ring),
            "ulysses" => Ok(CpKind::Ulysses),
            other => Err(format!(
                "unknown context-parallel kind {other:?}: use `ring` or `ulysses`"
            )),
        }
    }
}

impl std::fmt::Display for CpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpKind::Ring => "ring",
            CpKind::Ulysses => "ulysses",
        })
    }
}

/// The settings every rank of a context-parallel group must share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CpSettings {
    /// Ring or Ulysses.
    pub kind: CpKind,
    /// How the sequence is split.
    pub balance: CpBalance,
}

/// A context-parallel group: the ranks that split each sequence, and how.
#[derive(Debug, Clone)]
pub struct ContextParallel {
    group: ProcessGroup,
    settings: CpSettings,
}

impl ContextParallel {
    /// Sets up context parallelism over `group` (every member calls it), checking with one
    /// small all-gather that every rank has the same settings.
    ///
    /// # Arguments
    /// - `group`: the context-parallel group (a mesh's `cp` dimension).
    /// - `settings`: ring or Ulysses, and the balancing.
    ///
    /// # Returns
    /// The context, cheap to clone.
    ///
    /// # Errors
    /// [`CpError::SettingsDiffer`] naming a rank with other settings (or another group size);
    /// collective errors.
    pub fn new(group: &ProcessGroup, settings: CpSettings) -> CpResult<Self> {
        let mine = (group.size(), settings);
        let all = group.all_gather_object(&mine)?;
        if let Some((peer, theirs)) = all.iter().enumerate().find(|(_, s)| **s != mine) {
            return Err(CpError::SettingsDiffer {
                rank: group.global_rank(),
                peer: group.members()[peer],
                ours: format!("{:?} over {} ranks", settings, group.size()),
                theirs: format!("{:?} over {} ranks", theirs.1, theirs.0),
            });
        }
        Ok(Self {
            group: group.clone(),
            settings,
        })
    }

    /// The group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The context-parallel size.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The settings.
    pub fn settings(&self) -> CpSettings {
        self.settings
    }

    /// The layout of a sequence of `seq` tokens (global) over this group.
    ///
    /// # Errors
    /// [`CpError::SeqNotDivisible`].
    pub fn layout(&self, seq: usize) -> CpResult<SeqLayout> {
        SeqLayout::new(seq, self.size(), self.rank(), self.settings.balance)
    }

    /// Attention of this rank's queries `q` over the whole sequence's keys and values, each
    /// rank holding `[batch, heads, local_seq, head_dim]` for its tokens (local order of
    /// [`Self::layout`] for `local_seq * cp` tokens), through ring or Ulysses per the settings.
    /// Scaled by `1/sqrt(head_dim)`; `causal` masks keys at later global positions.
    ///
    /// # Returns
    /// `[batch, heads, local_seq, head_dim]`, differentiable in `q`, `k` and `v`.
    ///
    /// # Errors
    /// Shape errors ([`CpError::GroupedQuery`] for fewer K/V heads,
    /// [`CpError::HeadsNotDivisible`] under Ulysses); collective errors. A collective that fails
    /// during the backward panics with the error (Burn's backward cannot return errors).
    pub fn attention(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        causal: bool,
    ) -> CpResult<Tensor<4>> {
        let layout = self.layout(q.dims()[2] * self.size())?;
        match self.settings.kind {
            CpKind::Ring => ring_attention(q, k, v, &self.group, &layout, causal),
            CpKind::Ulysses => ulysses_attention(q, k, v, &self.group, &layout, causal),
        }
    }

    /// This rank's tokens of a tensor `x` replicated over the group (whole sequence along
    /// `dim`, global order). The backward all-gathers the gradient (so every rank gets the
    /// gradient of the whole `x`, as for `crate::autograd::scatter_to_group`).
    ///
    /// # Errors
    /// [`CpError::SeqNotDivisible`], [`CpError::Shape`].
    pub fn shard<const D: usize>(&self, x: Tensor<D>, dim: usize) -> CpResult<Tensor<D>> {
        let layout = self.layout(dim_len(&x, dim, "shard")?)?;
        let y = layout.local(x.clone().detach(), dim)?;
        let (group, device) = (self.group.clone(), x.device().inner());
        Ok(attach(
            x,
            y,
            // On the device where the group collects there (NCCL).
            BackwardFn::on_tensors::<D>("context_parallel::shard", device, move |grad| {
                let gathered = group.all_gather(grad, dim)?;
                layout
                    .to_global(gathered, dim)
                    .map_err(|e| CollectiveError::InvalidArgument {
                        rank: group.global_rank(),
                        op: "context_parallel::shard backward".into(),
                        reason: e.to_string(),
                    })
            }),
        ))
    }

    /// The whole sequence (global order along `dim`) from every rank's tokens `x`: an
    /// all-gather and a reordering. The backward keeps this rank's tokens of the gradient.
    ///
    /// # Errors
    /// [`CpError::SeqNotDivisible`], [`CpError::Shape`]; collective errors.
    pub fn unshard<const D: usize>(&self, x: Tensor<D>, dim: usize) -> CpResult<Tensor<D>> {
        let layout = self.layout(dim_len(&x, dim, "unshard")? * self.size())?;
        let device = x.device().inner();
        // On the device where the group collects there (NCCL).
        let gathered = self.group.all_gather(x.clone().detach(), dim)?;
        let y = layout.to_global(gathered, dim)?;
        let group = self.group.clone();
        Ok(attach(
            x,
            y,
            BackwardFn::on_tensors::<D>("context_parallel::unshard", device, move |grad| {
                layout
                    .local(grad, dim)
                    .map_err(|e| CollectiveError::InvalidArgument {
                        rank: group.global_rank(),
                        op: "context_parallel::unshard backward".into(),
                        reason: e.to_string(),
                    })
            }),
        ))
    }
}

fn dim_len<const D: usize>(x: &Tensor<D>, dim: usize, op: &str) -> CpResult<usize> {
    x.dims().get(dim).copied().ok_or_else(|| CpError::Shape {
        op: format!("context_parallel::{op}"),
        reason: format!("dim {dim} is out of range for a tensor of rank {D}"),
    })
}

/// Checks that q, k, v are `[batch, heads, local_seq, head_dim]` alike (no GQA).
pub(crate) fn check_qkv(
    op: &str,
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    group: &ProcessGroup,
    layout: &SeqLayout,
) -> CpResult<()> {
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if kd != vd {
        return Err(CpError::Shape {
            op: op.into(),
            reason: format!("k {kd:?} and v {vd:?} differ"),
        });
    }
    if qd[1] != kd[1] && qd[0] == kd[0] && qd[2] == kd[2] && qd[3] == kd[3] {
        return Err(CpError::GroupedQuery {
            q_heads: qd[1],
            kv_heads: kd[1],
        });
    }
    if qd != kd {
        return Err(CpError::Shape {
            op: op.into(),
            reason: format!("q {qd:?} and k {kd:?} must have the same shape"),
        });
    }
    if layout.cp() != group.size() || layout.rank() != group.rank() || layout.local_len() != qd[2] {
        return Err(CpError::Shape {
            op: op.into(),
            reason: format!(
                "a layout of {} tokens over {} ranks (rank {}) does not fit a group of {} ranks \
                 (rank {}) holding {} tokens each",
                layout.seq(),
                layout.cp(),
                layout.rank(),
                group.size(),
                group.rank(),
                qd[2]
            ),
        });
    }
    Ok(())
}
