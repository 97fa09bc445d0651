//! Which tokens of a sequence each rank of a context-parallel group holds.
//!
//! - [`CpBalance::None`]: contiguous chunks, rank `r` holds `[r s/cp, (r+1) s/cp)`. Under a
//!   causal mask rank `cp-1` does `cp` times the work of rank 0.
//! - [`CpBalance::HeadTail`] (zigzag): the sequence is cut into `2 cp` chunks and rank `r` holds
//!   chunks `r` and `2cp-1-r`, so every rank attends to the same number of (query, key) pairs
//!   under a causal mask.

use std::ops::Range;

use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::{CpError, CpResult};

/// How the sequence is split over the ranks of a context-parallel group.
/// In a config file, as on the command line: `none` or `head-tail`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpBalance {
    /// Contiguous chunks in rank order (the sequence length must divide by `cp`).
    #[serde(alias = "None")]
    None,
    /// Head-tail (zigzag) chunks: `2 cp` chunks, rank `r` holds `r` and `2cp-1-r` (the sequence
    /// length must divide by `2 cp`).
    #[default]
    #[serde(alias = "HeadTail", alias = "headtail", alias = "zigzag")]
    HeadTail,
}

impl std::str::FromStr for CpBalance {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(CpBalance::None),
            "headtail" | "head-tail" | "zigzag" => Ok(CpBalance::HeadTail),
            other => Err(format!(
                "unknown context-parallel balance {other:?}: use `headtail` or `none`"
            )),
        }
    }
}

impl std::fmt::Display for CpBalance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpBalance::None => "none",
            CpBalance::HeadTail => "headtail",
        })
    }
}

/// The split of a sequence of `seq` tokens over `cp` ranks: for each rank, the global token
/// ranges it holds, in the order it holds them (local order).
///
/// # Example
/// ```
/// use burn_parallel::context_parallel::{CpBalance, SeqLayout};
///
/// let layout = SeqLayout::new(8, 2, 1, CpBalance::HeadTail).unwrap();
/// // 4 chunks of 2: rank 1 holds chunks 1 and 2.
/// assert_eq!(layout.positions(), vec![2, 3, 4, 5]);
/// assert_eq!(layout.positions_of(0), vec![0, 1, 6, 7]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqLayout {
    seq: usize,
    cp: usize,
    rank: usize,
    balance: CpBalance,
}

impl SeqLayout {
    /// The layout of `seq` tokens over `cp` ranks, seen from `rank`.
    ///
    /// # Errors
    /// [`CpError::SeqNotDivisible`] when `seq` is not a multiple of `cp` (or of `2 cp` with
    /// head-tail balancing); [`CpError::Shape`] for `cp == 0` or `rank >= cp`.
    pub fn new(seq: usize, cp: usize, rank: usize, balance: CpBalance) -> CpResult<Self> {
        if cp == 0 || rank >= cp {
            return Err(CpError::Shape {
                op: "SeqLayout::new".into(),
                reason: format!("rank {rank} of a context-parallel group of {cp} ranks"),
            });
        }
        let multiple = match balance {
            CpBalance::None => cp,
            CpBalance::HeadTail => 2 * cp,
        };
        if seq == 0 || !seq.is_multiple_of(multiple) {
            return Err(CpError::SeqNotDivisible {
                seq,
                cp,
                balance,
                multiple,
            });
        }
        Ok(Self {
            seq,
            cp,
            rank,
            balance,
        })
    }

    /// The global sequence length.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// The number of ranks.
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// The calling rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The balancing.
    pub fn balance(&self) -> CpBalance {
        self.balance
    }

    /// Tokens per rank (`seq / cp`).
    pub fn local_len(&self) -> usize {
        self.seq / self.cp
    }

    /// The global token ranges rank `rank` holds, in local order.
    pub fn segments_of(&self, rank: usize) -> Vec<Range<usize>> {
        match self.balance {
            CpBalance::None => {
                let n = self.local_len();
                let only = rank * n..(rank + 1) * n;
                vec![only]
            }
            CpBalance::HeadTail => {
                let c = self.seq / (2 * self.cp);
                let tail = 2 * self.cp - 1 - rank;
                vec![rank * c..(rank + 1) * c, tail * c..(tail + 1) * c]
            }
        }
    }

    /// The global token ranges of the calling rank, in local order.
    pub fn segments(&self) -> Vec<Range<usize>> {
        self.segments_of(self.rank)
    }

    /// The global position of each token `rank` holds, in local order (for rotary tables and
    /// learned position embeddings).
    pub fn positions_of(&self, rank: usize) -> Vec<usize> {
        self.segments_of(rank).into_iter().flatten().collect()
    }

    /// The global position of each of the calling rank's tokens, in local order.
    pub fn positions(&self) -> Vec<usize> {
        self.positions_of(self.rank)
    }

    /// [`Self::positions`] as an `Int` tensor on `device`.
    pub fn positions_tensor(&self, device: &Device) -> Tensor<1, Int> {
        let p: Vec<i64> = self.positions().into_iter().map(|p| p as i64).collect();
        let n = p.len();
        Tensor::from_data(TensorData::new(p, [n]), device)
    }

    /// The calling rank's tokens of a whole sequence `x` (global order along `dim`), by
    /// narrowing and concatenating: no communication. Under autodiff the gradient of `x` is
    /// this rank's part only (zeros elsewhere), which is what a layout that sums or averages
    /// gradients over the context-parallel ranks (like data ranks) wants; see
    /// [`super::ContextParallel::shard`] for the replicated-input form.
    ///
    /// # Errors
    /// [`CpError::Shape`] when `x` does not have `seq` entries along `dim`.
    pub fn local<const D: usize, K>(&self, x: Tensor<D, K>, dim: usize) -> CpResult<Tensor<D, K>>
    where
        K: burn::tensor::kind::Basic,
    {
        self.check_len(
            x.dims().get(dim).copied(),
            self.seq,
            dim,
            "SeqLayout::local",
        )?;
        let parts: Vec<Tensor<D, K>> = self
            .segments()
            .into_iter()
            .map(|r| x.clone().narrow(dim, r.start, r.len()))
            .collect();
        Ok(if parts.len() == 1 {
            parts.into_iter().next().expect("one part")
        } else {
            Tensor::cat(parts, dim)
        })
    }

    /// Puts the rank-ordered concatenation of every rank's tokens (what an all-gather along
    /// `dim` returns) back into global order.
    ///
    /// # Errors
    /// [`CpError::Shape`] when `x` does not have `seq` entries along `dim`.
    pub fn to_global<const D: usize, K>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> CpResult<Tensor<D, K>>
    where
        K: burn::tensor::kind::Basic,
    {
        self.check_len(
            x.dims().get(dim).copied(),
            self.seq,
            dim,
            "SeqLayout::to_global",
        )?;
        if self.balance == CpBalance::None {
            return Ok(x);
        }
        // Where each global chunk sits in the rank-ordered concatenation.
        let mut pieces: Vec<(usize, usize, usize)> = Vec::new(); // (global start, offset, len)
        let mut offset = 0;
        for r in 0..self.cp {
            for seg in self.segments_of(r) {
                pieces.push((seg.start, offset, seg.len()));
                offset += seg.len();
            }
        }
        pieces.sort_unstable();
        let parts = pieces
            .into_iter()
            .map(|(_, off, len)| x.clone().narrow(dim, off, len))
            .collect();
        Ok(Tensor::cat(parts, dim))
    }

    fn check_len(&self, got: Option<usize>, want: usize, dim: usize, op: &str) -> CpResult<()> {
        if got == Some(want) {
            Ok(())
        } else {
            Err(CpError::Shape {
                op: op.into(),
                reason: format!(
                    "expected {want} tokens along dim {dim}, got {}",
                    got.map_or("no such dim".to_string(), |g| g.to_string())
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_tail_chunks() {
        let l = SeqLayout::new(16, 4, 1, CpBalance::HeadTail).unwrap();
        assert_eq!(l.segments(), vec![2..4, 12..14]);
        let all: Vec<usize> = (0..4).flat_map(|r| l.positions_of(r)).collect();
        let mut sorted = all.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..16).collect::<Vec<_>>());
        assert!(matches!(
            SeqLayout::new(12, 4, 0, CpBalance::HeadTail),
            Err(CpError::SeqNotDivisible { multiple: 8, .. })
        ));
        assert!(SeqLayout::new(12, 4, 0, CpBalance::None).is_ok());
    }

    #[test]
    fn local_then_to_global_round_trips() {
        let device = Device::flex();
        let x = Tensor::<1, Int>::arange(0..12, &device);
        for balance in [CpBalance::None, CpBalance::HeadTail] {
            let parts: Vec<_> = (0..3)
                .map(|r| {
                    SeqLayout::new(12, 3, r, balance)
                        .unwrap()
                        .local(x.clone(), 0)
                        .unwrap()
                })
                .collect();
            let l = SeqLayout::new(12, 3, 0, balance).unwrap();
            let back = l.to_global(Tensor::cat(parts, 0), 0).unwrap();
            assert_eq!(back.into_data(), x.clone().into_data(), "{balance}");
        }
    }
}
