//! Leaving a tensor-parallel region, the two ways the layers of [`crate::nn`] share: the
//! row-parallel output (all-reduce, or reduce-scatter along the sequence) and the
//! vocabulary-split lookup.

use burn::tensor::module::embedding;
use burn::tensor::{Bool, Int, Tensor};

use super::{Placement, SEQ_DIM, Shard, TpResult, TpTensor, sequence_shard};
use crate::autograd::{even_split, reduce_from_group, reduce_scatter_to_sequence};
use crate::group::ProcessGroup;

/// Leaves a row-parallel region: all-reduce (Megatron's *g*), or reduce-scatter along the
/// sequence under sequence parallelism.
pub(crate) fn row_output<const D: usize>(
    partial: Tensor<D>,
    group: &ProcessGroup,
    sequence_parallel: bool,
) -> TpResult<TpTensor<D>> {
    if sequence_parallel && D >= 3 {
        let seq = partial.dims()[SEQ_DIM];
        let shard = sequence_shard(seq, group)?;
        let y = if group.size() == 1 {
            partial
        } else {
            let sizes = even_split(seq, group.size());
            reduce_scatter_to_sequence(partial, group, SEQ_DIM, Some(&sizes))?
        };
        TpTensor::new(
            y,
            Placement::Shard {
                dim: SEQ_DIM,
                shard,
            },
            group,
        )
    } else {
        let y = if group.size() == 1 {
            partial
        } else {
            reduce_from_group(partial, group)?
        };
        Ok(TpTensor::replicated(y, group))
    }
}

/// A vocabulary split over a group: which rows of an embedding table this rank holds.
#[derive(Debug, Clone)]
pub struct VocabSplit {
    /// This rank's vocabulary ids.
    pub shard: Shard,
    /// The tensor-parallel group.
    pub group: ProcessGroup,
}

impl VocabSplit {
    /// Embeds `tokens` (ids already checked against the vocabulary) with this rank's rows
    /// `weight`: ids of other ranks' ranges give zeros here, and the partial embeddings are
    /// summed over the group: replicated (a sequence-parallel model scatters it afterwards).
    pub(crate) fn lookup(
        &self,
        weight: Tensor<2>,
        tokens: Tensor<2, Int>,
    ) -> TpResult<TpTensor<3>> {
        let [b, s] = tokens.dims();
        let d = weight.dims()[1];
        let (start, end) = (
            self.shard.start as i64,
            (self.shard.start + self.shard.len) as i64,
        );
        let outside: Tensor<2, Bool> = tokens
            .clone()
            .lower_elem(start)
            .bool_or(tokens.clone().greater_equal_elem(end));
        let local = (tokens - start).mask_fill(outside.clone(), 0);
        let partial = embedding(weight, local)
            .mask_fill(outside.unsqueeze_dim::<3>(2).expand([b, s, d]), 0.0);
        row_output(partial, &self.group, false)
    }
}
