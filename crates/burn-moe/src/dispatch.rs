//! Expert-parallel token exchange: [`dispatch`] sends each token to the rank that holds its
//! expert and orders what arrives expert-major; [`combine`] is its inverse. Both are
//! differentiable, and the backward of each is the other (both are built on the uneven
//! all-to-all of [`burn_parallel::autograd::all_to_all`], whose backward is the inverse
//! all-to-all, and on row selections).

use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel::ProcessGroup;
use burn_parallel::autograd::all_to_all;

use crate::config::{MoeError, Result};

/// What [`combine`] needs to undo a [`dispatch`].
#[derive(Debug, Clone)]
pub struct DispatchLayout {
    group: ProcessGroup,
    /// Rows this rank sent to each peer (what comes back in [`combine`]).
    sent: Vec<usize>,
    /// Rows received from each peer.
    received: Vec<usize>,
    /// For each row of the expert-major block, its row in the received (peer-major) block.
    perm: Vec<usize>,
    /// Rows for each of this rank's experts.
    pub expert_rows: Vec<usize>,
}

/// Sends rows of `x` to the ranks holding their experts.
///
/// # Arguments
/// - `x`: `[rows, d]`, rows in expert-major order over all experts of the layer (the experts
///   are numbered so that rank `r` of `group` holds `r * E / ep ..(r + 1) * E / ep`).
/// - `counts`: rows of `x` for each of the `E` experts (0 is fine).
/// - `group`: the expert-parallel group.
///
/// # Returns
/// The rows for this rank's experts, expert-major (for each local expert, the rows from peer
/// 0, then peer 1, ...), and the layout for [`combine`]; `layout.expert_rows` gives the block
/// size of each local expert.
///
/// # Errors
/// [`MoeError::ExpertsNotDivisible`] when `E` is not a multiple of the group size;
/// [`MoeError::CountMismatch`] when `counts` do not add up to the rows of `x`, or the rows that
/// arrive are not what the peers announced; [`MoeError::RankMismatch`] when peers announce
/// another number of experts; collective errors.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_moe::dispatch::{combine, dispatch};
/// use burn_parallel::run_local;
///
/// run_local(2, |ep| {
///     let device = Device::flex();
///     // Two experts, one per rank; rank r sends r + 1 rows to expert 0 and one to expert 1.
///     let rows = ep.rank() + 2;
///     let x = Tensor::<2>::ones([rows, 3], &device) * (ep.rank() as f32);
///     let (local, layout) = dispatch(x.clone(), &[rows - 1, 1], &ep).unwrap();
///     assert_eq!(layout.expert_rows, if ep.rank() == 0 { vec![3] } else { vec![2] });
///     let back = combine(local, &layout).unwrap();
///     assert_eq!(back.into_data(), x.into_data());
///     Ok(())
/// })
/// .unwrap();
/// ```
pub fn dispatch(
    x: Tensor<2>,
    counts: &[usize],
    group: &ProcessGroup,
) -> Result<(Tensor<2>, DispatchLayout)> {
    let n = group.size();
    let me = group.rank();
    let experts = counts.len();
    if experts == 0 || !experts.is_multiple_of(n) {
        return Err(MoeError::ExpertsNotDivisible { experts, ep: n });
    }
    let rows = x.dims()[0];
    let total: usize = counts.iter().sum();
    if total != rows {
        return Err(MoeError::CountMismatch {
            rank: group.global_rank(),
            reason: format!(
                "the per-expert counts {counts:?} add up to {total} but the tensor has {rows} rows"
            ),
        });
    }
    let per_rank = experts / n;
    let all: Vec<Vec<usize>> = group.all_gather_object(&counts.to_vec())?;
    for (p, theirs) in all.iter().enumerate() {
        if theirs.len() != experts {
            return Err(MoeError::RankMismatch {
                rank: group.global_rank(),
                peer: group.members()[p],
                ours: format!("{experts} experts"),
                theirs: format!("{} experts", theirs.len()),
            });
        }
    }
    let block =
        |c: &[usize], r: usize| -> usize { c[r * per_rank..(r + 1) * per_rank].iter().sum() };
    let sent: Vec<usize> = (0..n).map(|r| block(counts, r)).collect();
    let received: Vec<usize> = (0..n).map(|p| block(&all[p], me)).collect();
    let arrived = all_to_all(x, group, 0, &sent, 0)?;
    let expected: usize = received.iter().sum();
    if arrived.dims()[0] != expected {
        return Err(MoeError::CountMismatch {
            rank: group.global_rank(),
            reason: format!(
                "the peers announced {received:?} rows ({expected} in all) but {} arrived",
                arrived.dims()[0]
            ),
        });
    }
    // Peer-major (for each peer, its rows for each of our experts) to expert-major.
    let mut starts = Vec::with_capacity(n);
    let mut at = 0;
    for r in &received {
        starts.push(at);
        at += r;
    }
    let mut perm = Vec::with_capacity(expected);
    let mut expert_rows = vec![0; per_rank];
    for (j, rows_j) in expert_rows.iter_mut().enumerate() {
        for p in 0..n {
            let mine = &all[p][me * per_rank..(me + 1) * per_rank];
            let start = starts[p] + mine[..j].iter().sum::<usize>();
            perm.extend(start..start + mine[j]);
            *rows_j += mine[j];
        }
    }
    let local = reorder(arrived, &perm);
    Ok((
        local,
        DispatchLayout {
            group: group.clone(),
            sent,
            received,
            perm,
            expert_rows,
        },
    ))
}

/// Sends expert outputs `y` (rows as [`dispatch`] returned them) back to the ranks the tokens
/// came from: the inverse of [`dispatch`], rows in the order they were dispatched.
///
/// # Errors
/// [`MoeError::CountMismatch`] when `y` does not have the rows of the dispatch; collective
/// errors.
pub fn combine(y: Tensor<2>, layout: &DispatchLayout) -> Result<Tensor<2>> {
    if y.dims()[0] != layout.perm.len() {
        return Err(MoeError::CountMismatch {
            rank: layout.group.global_rank(),
            reason: format!(
                "combine got {} rows but the dispatch delivered {}",
                y.dims()[0],
                layout.perm.len()
            ),
        });
    }
    let mut inverse = vec![0; layout.perm.len()];
    for (i, &p) in layout.perm.iter().enumerate() {
        inverse[p] = i;
    }
    let peer_major = reorder(y, &inverse);
    let back = all_to_all(peer_major, &layout.group, 0, &layout.received, 0)?;
    let expected: usize = layout.sent.iter().sum();
    if back.dims()[0] != expected {
        return Err(MoeError::CountMismatch {
            rank: layout.group.global_rank(),
            reason: format!("{expected} rows were sent but {} came back", back.dims()[0]),
        });
    }
    Ok(back)
}

/// Rows `index` of `x` (no operation when `index` is the identity, which includes no rows).
pub(crate) fn reorder(x: Tensor<2>, index: &[usize]) -> Tensor<2> {
    if index.iter().enumerate().all(|(i, &j)| i == j) && index.len() == x.dims()[0] {
        return x;
    }
    let device = x.device();
    let index: Vec<i64> = index.iter().map(|&i| i as i64).collect();
    let n = index.len();
    x.select(
        0,
        Tensor::<1, Int>::from_data(TensorData::new(index, [n]), &device),
    )
}
