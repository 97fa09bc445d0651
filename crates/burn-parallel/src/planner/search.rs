//! The search: every layout of the job's devices, checked and predicted ([`plan`]), or one
//! ([`evaluate`]).

use super::predict::{check, predict};
use super::{
    Candidate, Checkpoint, Hardware, Layout, ModelShape, Plan, PlanError, Rejected, Rejection,
    Schedule, Training,
};
use crate::mesh::ParallelDims;

/// The divisors of `n`, in increasing order (found up to its square root).
fn divisors(n: usize) -> Vec<usize> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

/// The most layouts [`plan`] weighs: a world whose divisors give more (a highly composite
/// number of tens of thousands of devices) is refused with the count rather than searched for
/// minutes.
pub const MAX_LAYOUTS: usize = 500_000;

/// Every layout [`plan`] weighs (see there), in its order.
///
/// # Errors
/// [`PlanError::Training`] naming `world` when there are more than [`MAX_LAYOUTS`].
fn layouts(shape: &ModelShape, training: &Training) -> Result<Vec<Layout>, PlanError> {
    let w = training.world;
    let experts = shape.moe.as_ref().map(|m| m.experts);
    let mut out = Vec::new();
    for pp in divisors(w) {
        for cp in divisors(w / pp) {
            for tp in divisors(w / (pp * cp)) {
                let dp = w / (pp * cp * tp);
                let schedules: Vec<Schedule> = if pp == 1 {
                    vec![Schedule::None]
                } else {
                    vec![
                        Schedule::GPipe,
                        Schedule::OneFOneB,
                        Schedule::Interleaved { virtual_stages: 2 },
                        Schedule::ZbH1,
                        Schedule::Zbv,
                    ]
                };
                let eps: Vec<usize> = match experts {
                    Some(n) => divisors(dp).into_iter().filter(|e| n % e == 0).collect(),
                    None => vec![1],
                };
                let per_replica = training.global_batch / dp.max(1);
                let micro_batches = (per_replica / training.micro_batch).max(1);
                for dp_shard in divisors(dp) {
                    let dp_replicate = dp / dp_shard;
                    let stages: Vec<u8> = match (dp_shard, cp) {
                        (1, 1) => vec![0],
                        (1, _) => vec![0, 1, 2, 3],
                        _ => vec![1, 2, 3],
                    };
                    for &ep in &eps {
                        for &zero in &stages {
                            for sp in [false, true] {
                                if sp && tp == 1 {
                                    continue;
                                }
                                for &schedule in &schedules {
                                    for checkpoint in
                                        [Checkpoint::None, Checkpoint::Block, Checkpoint::Stage]
                                    {
                                        if out.len() == MAX_LAYOUTS {
                                            return Err(PlanError::Training {
                                                field: "world",
                                                reason: format!(
                                                    "{w} has too many divisors: its layouts are \
                                                     more than the {MAX_LAYOUTS} the planner \
                                                     weighs; plan a world of fewer divisors \
                                                     (a power of two, or a multiple of 8 nodes)"
                                                ),
                                            });
                                        }
                                        out.push(Layout {
                                            dims: ParallelDims {
                                                pp,
                                                dp_replicate,
                                                dp_shard,
                                                cp,
                                                tp,
                                                ep,
                                            },
                                            zero,
                                            sp,
                                            schedule,
                                            micro_batches,
                                            checkpoint,
                                        });
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Predicts memory and time of one layout.
///
/// # Arguments
/// - `shape`, `training`, `hw`: as for [`plan`]; `layout`: the layout to evaluate.
///
/// # Returns
/// The [`Candidate`] (whether it fits or not: compare
/// [`Memory::total`](super::Memory::total) with [`Hardware::memory_bytes`]).
///
/// # Errors
/// [`PlanError`] for invalid inputs, and [`PlanError::Training`] naming the failed constraint
/// when the layout does not suit the model or the job.
pub fn evaluate(
    shape: &ModelShape,
    training: &Training,
    hw: &Hardware,
    layout: &Layout,
) -> Result<Candidate, PlanError> {
    shape.validate()?;
    training.validate()?;
    hw.validate()?;
    check(shape, training, layout).map_err(|reason| PlanError::Training {
        field: "layout",
        reason,
    })?;
    Ok(predict(shape, training, hw, layout))
}

/// Every layout of the world, evaluated: the ones that fit ranked by predicted step time, the
/// others with the reason.
///
/// Enumerates `pp`, `cp`, `tp` over the divisors of the world, every split of the remaining
/// data-parallel ranks into `dp_replicate x dp_shard`, the ZeRO stages (0 when `dp_shard` is 1,
/// and 1-3 whenever `dp_shard x cp` shards), sequence parallelism on and off when `tp > 1`,
/// `ep` over the divisors of the data-parallel ranks and the experts, the five pipeline
/// schedules (interleaved with 2 chunks) when `pp > 1`, and the three checkpointing choices.
///
/// # Arguments
/// - `shape`: the model; `training`: the job; `hw`: one device.
///
/// # Returns
/// The [`Plan`] (its `fitting` list may be empty: then read `rejected`).
///
/// # Errors
/// [`PlanError`] naming the field when the shape, the job or the hardware is invalid.
///
/// # Example
/// ```
/// use burn_parallel::planner::{Hardware, ModelShape, Training, plan};
///
/// let shape = ModelShape::gpt(4, 256, 8, 1024, 256);
/// // tp 3 cannot split 8 heads: the plan says so rather than skipping it silently.
/// let plan = plan(&shape, &Training::new(6, 12, 256), &Hardware::from_units(1.0, 10.0, 10.0))
///     .unwrap();
/// assert!(plan.rejected.iter().any(|r| r.reason.to_string() == "tp 3 does not divide 8 heads"));
/// assert!(!plan.fitting.is_empty());
/// ```
pub fn plan(shape: &ModelShape, training: &Training, hw: &Hardware) -> Result<Plan, PlanError> {
    shape.validate()?;
    training.validate()?;
    hw.validate()?;
    let mut fitting = Vec::new();
    let mut constraints: Vec<Rejected> = Vec::new();
    let mut memory: Vec<Rejected> = Vec::new();
    for layout in layouts(shape, training)? {
        consider(
            shape,
            training,
            hw,
            layout,
            &mut fitting,
            &mut constraints,
            &mut memory,
        );
    }
    fitting.sort_by(|a: &Candidate, b: &Candidate| {
        a.step_seconds
            .total_cmp(&b.step_seconds)
            .then(a.memory.total().total_cmp(&b.memory.total()))
    });
    let needed = |r: &Rejected| match r.reason {
        Rejection::Memory { needed, .. } => needed,
        Rejection::Constraint(_) => 0.0,
    };
    memory.sort_by(|a, b| needed(a).total_cmp(&needed(b)));
    constraints.extend(memory);
    Ok(Plan {
        fitting,
        rejected: constraints,
    })
}

fn consider(
    shape: &ModelShape,
    training: &Training,
    hw: &Hardware,
    layout: Layout,
    fitting: &mut Vec<Candidate>,
    constraints: &mut Vec<Rejected>,
    memory: &mut Vec<Rejected>,
) {
    if let Err(reason) = check(shape, training, &layout) {
        if !constraints
            .iter()
            .any(|r| r.reason == Rejection::Constraint(reason.clone()))
        {
            constraints.push(Rejected {
                layout: layout.to_string(),
                candidate: None,
                reason: Rejection::Constraint(reason),
            });
        }
        return;
    }
    let candidate = predict(shape, training, hw, &layout);
    let available = hw.memory_bytes as f64;
    if candidate.memory.total() <= available {
        fitting.push(candidate);
    } else {
        memory.push(Rejected {
            layout: layout.to_string(),
            reason: Rejection::Memory {
                needed: candidate.memory.total(),
                available,
                largest: candidate.memory.largest(),
                zero: layout.zero,
            },
            candidate: Some(candidate),
        });
    }
}
