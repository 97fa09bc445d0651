//! Cross-entropy on vocabulary-sharded logits (Megatron's `vocab_parallel_cross_entropy`).
//!
//! No rank ever holds the full logits: the row maximum is all-reduced (max), then the sum of
//! exponentials and the target logit are all-reduced together (one sum over `[n, 2]`, or
//! `[n, 3]` with label smoothing). Padding columns of a padded vocabulary are masked out.

use burn::tensor::{Int, Tensor, TensorData};

use super::{Placement, TpError, TpResult, TpTensor};
use crate::autograd::reduce_from_group;
use crate::comm::host::ReduceOp;

/// Options of [`vocab_parallel_cross_entropy`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CrossEntropyOptions {
    /// Label smoothing `eps` in `[0, 1)`: the loss is `(1 - eps) * nll + eps * mean_j(-log p_j)`
    /// (PyTorch's definition).
    pub label_smoothing: f64,
    /// Targets equal to this id contribute nothing; the mean is over the other positions
    /// (0 when every target is ignored).
    pub ignore_index: Option<i64>,
}

/// Mean cross-entropy of vocabulary-sharded `logits` (`[n, vocab]`, sharded along dim 1, as a
/// vocabulary-split [`crate::nn::Linear`] head or [`crate::nn::Embedding::attend`] produces
/// them; [`crate::nn::Linear::cross_entropy`] calls this) against global class ids `targets`
/// `[n]`. The result `[1]` is replicated over the group.
///
/// # Errors
/// [`TpError::Layout`] when `logits` are not sharded along dim 1 (gathered logits: use the
/// ordinary cross-entropy); [`TpError::OutOfVocabulary`] for a target outside the vocabulary
/// (other than `ignore_index`); [`TpError::Config`] for a bad smoothing; collective errors.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use burn_parallel::run_local;
/// use burn_parallel::tensor_parallel::{
///     vocab_parallel_cross_entropy, CrossEntropyOptions, Placement, Split, TpTensor,
/// };
/// let losses = run_local(2, |group| {
///     let device = Device::flex();
///     // 5 classes over 2 ranks, padded to 3 columns each; this rank's logits are all zero.
///     let shard = Split::Padded { multiple: 1 }.shard(5, 2, group.rank(), "vocab").unwrap();
///     let local = Tensor::<2>::zeros([3, shard.stored], &device);
///     let logits = TpTensor::new(local, Placement::Shard { dim: 1, shard }, &group).unwrap();
///     let targets = Tensor::<1, Int>::from_data([0, 4, 2], &device);
///     let loss = vocab_parallel_cross_entropy(logits, targets, CrossEntropyOptions::default()).unwrap();
///     Ok(loss.into_data().to_vec::<f32>().unwrap()[0])
/// })
/// .unwrap();
/// assert!((losses[0] - 5f32.ln()).abs() < 1e-6); // uniform over 5 classes, padding excluded
/// ```
pub fn vocab_parallel_cross_entropy(
    logits: TpTensor<2>,
    targets: Tensor<1, Int>,
    options: CrossEntropyOptions,
) -> TpResult<Tensor<1>> {
    let layer = "vocab_parallel_cross_entropy";
    let shard = match logits.placement() {
        Placement::Shard { dim: 1, shard } => *shard,
        other => {
            return Err(TpError::Layout {
                layer: layer.into(),
                expected: "logits sharded along the vocabulary (dim 1)".into(),
                got: other.to_string(),
                hint: "use the ordinary cross-entropy on gathered logits, or pass the head's \
                       vocabulary shard without gathering it"
                    .into(),
            });
        }
    };
    if !(0.0..1.0).contains(&options.label_smoothing) {
        return Err(TpError::Config(format!(
            "label smoothing must be in [0, 1), got {}",
            options.label_smoothing
        )));
    }
    let group = logits.group().clone();
    let logits = logits.into_tensor();
    let [n, stored] = logits.dims();
    if targets.dims() != [n] {
        return Err(TpError::Shape {
            layer: layer.into(),
            reason: format!(
                "{n} rows of logits but targets of shape {:?}",
                targets.dims()
            ),
        });
    }
    let ids = targets.clone().into_data().convert::<i64>();
    let ids = ids.as_slice::<i64>().expect("converted to i64").to_vec();
    if let Some(&id) = ids
        .iter()
        .find(|&&t| Some(t) != options.ignore_index && (t < 0 || t as usize >= shard.full))
    {
        return Err(TpError::OutOfVocabulary {
            layer: layer.into(),
            id,
            vocab: shard.full,
        });
    }
    let device = logits.device();
    let reduce = |t: Tensor<2>| -> TpResult<Tensor<2>> {
        Ok(if group.size() == 1 {
            t
        } else {
            reduce_from_group(t, &group)?
        })
    };

    // Padding columns never take part.
    let padding = stored - shard.len;
    let pad_mask = (padding > 0).then(|| {
        let cols: Vec<bool> = (0..stored).map(|j| j >= shard.len).collect();
        Tensor::<2, burn::tensor::Bool>::from_data(TensorData::new(cols, [1, stored]), &device)
            .expand([n, stored])
    });
    let masked = match &pad_mask {
        Some(m) => logits.clone().mask_fill(m.clone(), f32::NEG_INFINITY),
        None => logits.clone(),
    };

    // Global row maximum: a constant shift, no gradient needed.
    let local_max = if shard.len == 0 {
        Tensor::<2>::full([n, 1], f32::MIN, &device)
    } else {
        masked.clone().detach().max_dim(1)
    };
    let max = if group.size() == 1 {
        local_max
    } else {
        group.all_reduce(local_max, ReduceOp::Max)?
    };
    let shifted = masked - max;

    // Target logit: only the rank holding the target contributes.
    let (start, end) = (shard.start as i64, (shard.start + shard.len) as i64);
    let outside = targets
        .clone()
        .lower_elem(start)
        .bool_or(targets.clone().greater_equal_elem(end));
    let local_ids = (targets.clone() - start)
        .mask_fill(outside.clone(), 0)
        .reshape([n, 1]);
    let target_logit = shifted
        .clone()
        .gather(1, local_ids)
        .mask_fill(outside.reshape([n, 1]), 0.0);
    let sum_exp = shifted.clone().exp().sum_dim(1);

    let mut parts = vec![sum_exp, target_logit];
    let smoothing = options.label_smoothing > 0.0;
    if smoothing {
        let finite = match &pad_mask {
            Some(m) => shifted.clone().mask_fill(m.clone(), 0.0),
            None => shifted.clone(),
        };
        parts.push(finite.sum_dim(1));
    }
    let reduced = reduce(Tensor::cat(parts, 1))?;
    let lse = reduced.clone().narrow(1, 0, 1).log();
    let nll = lse.clone() - reduced.clone().narrow(1, 1, 1);
    let per_row = if smoothing {
        let eps = options.label_smoothing;
        let mean_logit = reduced.narrow(1, 2, 1) / shard.full as f64;
        nll * (1.0 - eps) + (lse - mean_logit) * eps
    } else {
        nll
    };
    let per_row = per_row.reshape([n]);
    Ok(match options.ignore_index {
        None => per_row.mean(),
        Some(ignore) => {
            let keep: Vec<f32> = ids
                .iter()
                .map(|&t| f32::from(u8::from(t != ignore)))
                .collect();
            let count = keep.iter().sum::<f32>().max(1.0);
            let keep = Tensor::<1>::from_data(TensorData::new(keep, [n]), &device);
            (per_row * keep).sum() / count
        }
    })
}
