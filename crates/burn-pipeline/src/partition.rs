//! Splitting a sequence of layers into contiguous stages: by layer count, balanced by a cost
//! per layer (parameter count, measured time), or at explicit boundaries.
//!
//! A split is one `Range` of layer indices per stage, in stage order, covering `0..layers`.
//! The first and the last stage usually hold more than layers (the embedding, the head and the
//! loss): [`balanced`] takes their extra cost, so they may get fewer layers.

use std::ops::Range;

/// Errors splitting layers into stages.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    /// There are fewer layers than stages.
    #[error(
        "cannot split {layers} layers into {stages} stages: every stage needs at least one \
         layer; use at most {layers} stages (--pp x --virtual-stages) or a deeper model"
    )]
    MoreStagesThanLayers {
        /// Layers of the model.
        layers: usize,
        /// Stages asked for.
        stages: usize,
    },
    /// No stage was asked for.
    #[error("cannot split layers into 0 stages")]
    NoStages,
    /// Explicit boundaries that do not describe a split.
    #[error(
        "explicit stage boundaries {boundaries:?} do not split {layers} layers into {stages} \
         stages: give {expected} strictly increasing first-layer indices of stages 1.., each \
         below {layers}"
    )]
    BadBoundaries {
        /// The boundaries given.
        boundaries: Vec<usize>,
        /// Layers of the model.
        layers: usize,
        /// Stages asked for.
        stages: usize,
        /// How many boundaries are needed (`stages - 1`).
        expected: usize,
    },
    /// A cost is negative or not finite.
    #[error("layer cost {index} is {value}: costs must be finite and non-negative")]
    BadCost {
        /// The layer.
        index: usize,
        /// Its cost.
        value: f64,
    },
}

fn check(layers: usize, stages: usize) -> Result<(), PartitionError> {
    if stages == 0 {
        return Err(PartitionError::NoStages);
    }
    if stages > layers {
        return Err(PartitionError::MoreStagesThanLayers { layers, stages });
    }
    Ok(())
}

/// `layers` layers in `stages` stages of as equal a count as possible (the first stages take
/// one more when it does not divide).
///
/// # Errors
/// [`PartitionError::MoreStagesThanLayers`], [`PartitionError::NoStages`].
///
/// # Example
/// ```
/// use burn_pipeline::partition::by_count;
/// assert_eq!(by_count(5, 2).unwrap(), vec![0..3, 3..5]);
/// assert!(by_count(2, 4).is_err());
/// ```
pub fn by_count(layers: usize, stages: usize) -> Result<Vec<Range<usize>>, PartitionError> {
    check(layers, stages)?;
    let (base, extra) = (layers / stages, layers % stages);
    let mut start = 0;
    Ok((0..stages)
        .map(|s| {
            let len = base + usize::from(s < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect())
}

/// Stages starting at the given layers: `boundaries[i]` is the first layer of stage `i + 1`.
///
/// # Errors
/// [`PartitionError::BadBoundaries`] unless there are `stages - 1` strictly increasing
/// boundaries in `1..layers`.
///
/// # Example
/// ```
/// use burn_pipeline::partition::explicit;
/// assert_eq!(explicit(6, 3, &[1, 5]).unwrap(), vec![0..1, 1..5, 5..6]);
/// ```
pub fn explicit(
    layers: usize,
    stages: usize,
    boundaries: &[usize],
) -> Result<Vec<Range<usize>>, PartitionError> {
    check(layers, stages)?;
    let bad = || PartitionError::BadBoundaries {
        boundaries: boundaries.to_vec(),
        layers,
        stages,
        expected: stages - 1,
    };
    if boundaries.len() != stages - 1 {
        return Err(bad());
    }
    let mut starts = vec![0];
    starts.extend_from_slice(boundaries);
    starts.push(layers);
    if starts.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad());
    }
    Ok(starts.windows(2).map(|w| w[0]..w[1]).collect())
}

/// The contiguous split of layers with costs `costs` into `stages` stages that minimises the
/// largest stage cost, where the first stage also costs `first_extra` and the last
/// `last_extra` (embedding, head and loss). Every stage gets at least one layer. Among the
/// optimal splits, the one found by filling stages from the back as late as possible is
/// returned (exact, by dynamic programming over `O(stages x layers^2)`).
///
/// # Arguments
/// * `costs` - one non-negative cost per layer (parameter counts, measured seconds).
/// * `stages` - number of stages.
/// * `first_extra`, `last_extra` - what the first and last stage cost besides their layers.
///
/// # Errors
/// [`PartitionError::MoreStagesThanLayers`], [`PartitionError::NoStages`],
/// [`PartitionError::BadCost`].
///
/// # Example
/// ```
/// use burn_pipeline::partition::balanced;
/// // Four equal layers; the head costs as much as two layers: the last stage takes one.
/// assert_eq!(balanced(&[1.0; 4], 2, 0.0, 2.0).unwrap(), vec![0..3, 3..4]);
/// ```
pub fn balanced(
    costs: &[f64],
    stages: usize,
    first_extra: f64,
    last_extra: f64,
) -> Result<Vec<Range<usize>>, PartitionError> {
    let layers = costs.len();
    check(layers, stages)?;
    for (index, &value) in costs
        .iter()
        .chain([first_extra, last_extra].iter())
        .enumerate()
    {
        if !value.is_finite() || value < 0.0 {
            return Err(PartitionError::BadCost { index, value });
        }
    }
    let mut prefix = vec![0.0; layers + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let cost = |s: usize, a: usize, b: usize| {
        let mut c = prefix[b] - prefix[a];
        if s == 0 {
            c += first_extra;
        }
        if s == stages - 1 {
            c += last_extra;
        }
        c
    };
    // best[s][j]: the smallest largest cost of stages 0..=s covering layers 0..j.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; layers + 1]; stages];
    let mut cut = vec![vec![0usize; layers + 1]; stages];
    for (j, best) in best[0].iter_mut().enumerate().skip(1) {
        *best = cost(0, 0, j);
    }
    for s in 1..stages {
        for j in s + 1..=layers {
            for i in s..j {
                let candidate = best[s - 1][i].max(cost(s, i, j));
                // `<=`: later cuts win ties, which gives the first stages the extra layers.
                if candidate <= best[s][j] {
                    best[s][j] = candidate;
                    cut[s][j] = i;
                }
            }
        }
    }
    let mut ranges = vec![0..0; stages];
    let mut end = layers;
    for s in (0..stages).rev() {
        let start = if s == 0 { 0 } else { cut[s][end] };
        ranges[s] = start..end;
        end = start;
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_count_covers_every_layer_once() {
        for layers in 1..12 {
            for stages in 1..=layers {
                let split = by_count(layers, stages).unwrap();
                assert_eq!(split.len(), stages);
                assert_eq!(split[0].start, 0);
                assert_eq!(split[stages - 1].end, layers);
                assert!(split.windows(2).all(|w| w[0].end == w[1].start));
                let sizes: Vec<usize> = split.iter().map(|r| r.len()).collect();
                assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn balanced_gives_fewer_layers_to_heavy_ends() {
        // 8 equal layers on 4 stages, embedding worth 1 layer, head worth 3.
        let split = balanced(&[1.0; 8], 4, 1.0, 3.0).unwrap();
        let sizes: Vec<usize> = split.iter().map(|r| r.len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 8);
        let max = split
            .iter()
            .enumerate()
            .map(|(s, r)| {
                r.len() as f64 + if s == 0 { 1.0 } else { 0.0 } + if s == 3 { 3.0 } else { 0.0 }
            })
            .fold(0.0, f64::max);
        // The last stage costs at least 1 + 3: one layer only, and the rest fit under 4.
        assert_eq!(max, 4.0, "{split:?}");
        assert_eq!(split[3].len(), 1, "{split:?}");
        // Unequal layers: the optimum is found (checked against brute force).
        let costs = [5.0, 1.0, 1.0, 1.0, 4.0, 2.0, 2.0];
        let split = balanced(&costs, 3, 0.0, 0.0).unwrap();
        let stage_cost = |r: &Range<usize>| costs[r.clone()].iter().sum::<f64>();
        let got = split.iter().map(stage_cost).fold(0.0, f64::max);
        let mut brute = f64::INFINITY;
        for a in 1..costs.len() {
            for b in a + 1..costs.len() {
                let m = [0..a, a..b, b..costs.len()]
                    .iter()
                    .map(stage_cost)
                    .fold(0.0, f64::max);
                brute = brute.min(m);
            }
        }
        assert_eq!(got, brute);
    }

    #[test]
    fn bad_splits_are_errors() {
        assert_eq!(
            by_count(3, 4),
            Err(PartitionError::MoreStagesThanLayers {
                layers: 3,
                stages: 4
            })
        );
        assert!(matches!(
            balanced(&[1.0; 3], 4, 0.0, 0.0),
            Err(PartitionError::MoreStagesThanLayers { .. })
        ));
        assert!(matches!(
            balanced(&[1.0, f64::NAN], 2, 0.0, 0.0),
            Err(PartitionError::BadCost { index: 1, .. })
        ));
        for bad in [&[][..], &[0][..], &[3, 2][..], &[2, 6][..], &[1, 2, 3][..]] {
            assert!(
                matches!(
                    explicit(6, 3, bad),
                    Err(PartitionError::BadBoundaries { .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(by_count(3, 0), Err(PartitionError::NoStages));
    }
}
