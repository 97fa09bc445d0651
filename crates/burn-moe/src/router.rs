//! Token-choice routing on the host: which experts each token picks, which picks fit the
//! capacity, and the expert-major order the experts compute in. Pure functions of the scores,
//! deterministic (ties go to the lower expert index, then the earlier token), tested on their
//! own.

use crate::config::{Capacity, DropPolicy};

/// Picks `k` experts per token from `scores` (`[tokens, experts]`, row-major) plus `bias`
/// (`[experts]`; selection only), optionally limited to the `topk_groups` best of `n_groups`
/// expert groups.
///
/// # Returns
/// `tokens * k` expert indices, token-major, each token's in decreasing score order (ties: the
/// lower index first).
///
/// # Panics
/// If the sizes are inconsistent (callers validate the configuration first).
pub fn select_experts(
    scores: &[f32],
    bias: &[f32],
    experts: usize,
    k: usize,
    n_groups: usize,
    topk_groups: usize,
) -> Vec<usize> {
    assert!(experts > 0 && scores.len().is_multiple_of(experts));
    assert!(k >= 1 && k <= experts && bias.len() == experts);
    let tokens = scores.len() / experts;
    let mut chosen = Vec::with_capacity(tokens * k);
    let mut sel: Vec<(f32, usize)> = Vec::with_capacity(experts);
    for row in scores.chunks(experts) {
        sel.clear();
        sel.extend(
            row.iter()
                .zip(bias)
                .enumerate()
                .map(|(i, (s, b))| (s + b, i)),
        );
        if n_groups > 1 {
            let size = experts / n_groups;
            let mut groups: Vec<(f32, usize)> = (0..n_groups)
                .map(|g| {
                    let mut top: Vec<f32> =
                        sel[g * size..(g + 1) * size].iter().map(|s| s.0).collect();
                    top.sort_by(|a, b| b.total_cmp(a));
                    (top.iter().take(2).sum(), g)
                })
                .collect();
            groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let keep: Vec<usize> = groups[..topk_groups].iter().map(|g| g.1).collect();
            sel.retain(|&(_, i)| keep.contains(&(i / size)));
        }
        sel.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        chosen.extend(sel[..k].iter().map(|s| s.1));
    }
    chosen
}

/// Where every (token, slot) assignment goes: the output of [`plan_dispatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchPlan {
    /// Kept assignments in expert-major order (token order inside an expert), as slot indices
    /// `token * k + j`.
    pub order: Vec<usize>,
    /// Kept assignments per expert (the block sizes of `order`).
    pub kept: Vec<usize>,
    /// Assignments per expert before capacity (the router's choices).
    pub routed: Vec<usize>,
}

impl DispatchPlan {
    /// Assignments dropped for capacity.
    pub fn dropped(&self) -> usize {
        self.routed.iter().sum::<usize>() - self.order.len()
    }

    /// The position in `order` of every slot `token * k + j`, `None` when dropped.
    pub fn positions(&self, slots: usize) -> Vec<Option<usize>> {
        let mut at = vec![None; slots];
        for (p, &s) in self.order.iter().enumerate() {
            at[s] = Some(p);
        }
        at
    }
}

/// Per-expert capacity of a group of `tokens` tokens: `ceil(tokens * k / experts * factor)`.
pub fn capacity(tokens: usize, k: usize, experts: usize, factor: f64) -> usize {
    ((tokens * k) as f64 / experts as f64 * factor).ceil() as usize
}

/// Sizes of `total` items cut into `n` contiguous groups as evenly as possible (the first
/// groups one larger).
pub fn group_sizes(total: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|g| total / n + usize::from(g < total % n))
        .collect()
}

/// Applies the capacity to the router's `chosen` experts (`tokens * k`, token-major) and
/// orders the kept assignments expert-major.
///
/// # Arguments
/// - `chosen`: from [`select_experts`].
/// - `gates`: the gate weight of each assignment (same layout; read by [`DropPolicy::Weight`]).
/// - `experts`, `k`: the layer's sizes.
/// - `capacity_mode`: dropless or a capacity factor.
/// - `groups`: capacity groups (contiguous token ranges, see [`group_sizes`]).
///
/// # Panics
/// If the sizes are inconsistent.
pub fn plan_dispatch(
    chosen: &[usize],
    gates: &[f32],
    experts: usize,
    k: usize,
    capacity_mode: Capacity,
    groups: usize,
) -> DispatchPlan {
    assert!(chosen.len().is_multiple_of(k) && gates.len() == chosen.len());
    let tokens = chosen.len() / k;
    let mut routed = vec![0; experts];
    // Per expert, its assignments in token order.
    let mut per_expert: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (slot, &e) in chosen.iter().enumerate() {
        routed[e] += 1;
        per_expert[e].push(slot);
    }
    if let Capacity::Factor { factor, drop } = capacity_mode {
        let mut start = 0;
        let bounds: Vec<(usize, usize)> = group_sizes(tokens, groups)
            .into_iter()
            .map(|n| {
                start += n;
                (start - n, start)
            })
            .collect();
        for list in per_expert.iter_mut() {
            let mut kept = Vec::with_capacity(list.len());
            for &(lo, hi) in &bounds {
                let cap = capacity(hi - lo, k, experts, factor);
                let mut members: Vec<usize> = list
                    .iter()
                    .copied()
                    .filter(|&s| (lo..hi).contains(&(s / k)))
                    .collect();
                if members.len() > cap {
                    if drop == DropPolicy::Weight {
                        members.sort_by(|&a, &b| gates[b].total_cmp(&gates[a]).then(a.cmp(&b)));
                    }
                    members.truncate(cap);
                    members.sort_unstable();
                }
                kept.extend(members);
            }
            *list = kept;
        }
    }
    let kept = per_expert.iter().map(Vec::len).collect();
    DispatchPlan {
        order: per_expert.into_iter().flatten().collect(),
        kept,
        routed,
    }
}

/// Load imbalance of per-expert `counts`: the largest over the mean (1 is perfectly balanced;
/// `experts` when every token goes to one expert). 1 for no tokens.
pub fn imbalance(counts: &[f64]) -> f64 {
    let total: f64 = counts.iter().sum();
    if total <= 0.0 || counts.is_empty() {
        return 1.0;
    }
    let max = counts.iter().copied().fold(0.0, f64::max);
    max / (total / counts.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP1: Capacity = Capacity::Factor {
        factor: 1.0,
        drop: DropPolicy::Position,
    };

    #[test]
    fn ties_go_to_the_lower_expert() {
        let scores = [0.25, 0.25, 0.25, 0.25, 0.1, 0.4, 0.4, 0.1];
        let chosen = select_experts(&scores, &[0.0; 4], 4, 2, 0, 0);
        assert_eq!(chosen, vec![0, 1, 1, 2]);
        // Top-1 of a full tie: expert 0.
        assert_eq!(select_experts(&scores[..4], &[0.0; 4], 4, 1, 0, 0), vec![0]);
    }

    #[test]
    fn bias_changes_selection_only() {
        let scores = [0.5, 0.3, 0.2];
        assert_eq!(
            select_experts(&scores, &[0.0, 0.0, 0.0], 3, 1, 0, 0),
            vec![0]
        );
        assert_eq!(
            select_experts(&scores, &[0.0, 0.0, 0.4], 3, 1, 0, 0),
            vec![2]
        );
    }

    #[test]
    fn top_k_equals_experts_takes_all_in_score_order() {
        let scores = [0.1, 0.6, 0.3];
        assert_eq!(
            select_experts(&scores, &[0.0; 3], 3, 3, 0, 0),
            vec![1, 2, 0]
        );
        let plan = plan_dispatch(&[1, 2, 0], &[0.6, 0.3, 0.1], 3, 3, Capacity::Dropless, 1);
        assert_eq!(plan.kept, vec![1, 1, 1]);
        assert_eq!(plan.order, vec![2, 0, 1]);
    }

    #[test]
    fn group_limited_routing_stays_in_the_best_groups() {
        // Two groups of two; group 1 has the single best expert (3) but group 0 the best pair.
        let scores = [0.3, 0.3, 0.0, 0.4];
        assert_eq!(select_experts(&scores, &[0.0; 4], 4, 2, 0, 0), vec![3, 0]);
        assert_eq!(select_experts(&scores, &[0.0; 4], 4, 2, 2, 1), vec![0, 1]);
        assert_eq!(select_experts(&scores, &[0.0; 4], 4, 2, 2, 2), vec![3, 0]);
    }

    #[test]
    fn all_tokens_to_one_expert_and_empty_experts() {
        let chosen = vec![2; 6];
        let gates = vec![1.0; 6];
        let dropless = plan_dispatch(&chosen, &gates, 4, 1, Capacity::Dropless, 1);
        assert_eq!(dropless.kept, vec![0, 0, 6, 0]);
        assert_eq!(dropless.order, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(dropless.dropped(), 0);
        assert_eq!(imbalance(&[0.0, 0.0, 6.0, 0.0]), 4.0);
        // Capacity ceil(6 * 1 / 4 * 1.0) = 2: the first two tokens stay.
        let capped = plan_dispatch(&chosen, &gates, 4, 1, CAP1, 1);
        assert_eq!(capped.kept, vec![0, 0, 2, 0]);
        assert_eq!(capped.order, vec![0, 1]);
        assert_eq!(capped.dropped(), 4);
        assert_eq!(
            capped.positions(6),
            vec![Some(0), Some(1), None, None, None, None]
        );
    }

    #[test]
    fn drop_by_weight_keeps_the_heaviest() {
        let chosen = vec![0, 0, 0, 0];
        let gates = vec![0.1, 0.9, 0.5, 0.9];
        let plan = plan_dispatch(
            &chosen,
            &gates,
            2,
            1,
            Capacity::Factor {
                factor: 1.0,
                drop: DropPolicy::Weight,
            },
            1,
        );
        // Capacity 2: the two 0.9 tokens, in token order.
        assert_eq!(plan.order, vec![1, 3]);
    }

    #[test]
    fn capacity_is_per_group() {
        // Four tokens, all to expert 0, two groups of two: capacity ceil(2/2*1) = 1 per group.
        let plan = plan_dispatch(&[0, 0, 0, 0], &[1.0; 4], 2, 1, CAP1, 2);
        assert_eq!(plan.order, vec![0, 2]);
        let one_group = plan_dispatch(&[0, 0, 0, 0], &[1.0; 4], 2, 1, CAP1, 1);
        assert_eq!(one_group.order, vec![0, 1]);
        assert_eq!(capacity(5, 2, 4, 1.25), 4); // ceil(3.125)
    }

    #[test]
    fn expert_major_order_and_positions_invert() {
        let chosen = vec![1, 0, 0, 2, 1, 2];
        let plan = plan_dispatch(&chosen, &[0.5; 6], 3, 2, Capacity::Dropless, 1);
        assert_eq!(plan.kept, vec![2, 2, 2]);
        assert_eq!(plan.order, vec![1, 2, 0, 4, 3, 5]);
        let pos = plan.positions(6);
        for (p, &s) in plan.order.iter().enumerate() {
            assert_eq!(pos[s], Some(p));
        }
    }
}
