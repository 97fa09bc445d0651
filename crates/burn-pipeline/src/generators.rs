//! Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZBV.
//!
//! Each generator orders the computation of every rank, appends `REDUCE(s)` after the last
//! backward of each stage, then inserts the communication with
//! [`Schedule::with_communication`] (send right after the producer, receive right before the
//! consumer, nothing between stages of the same rank).
//!
//! GPipe, 1F1B, interleaved 1F1B and ZB-H1 follow closed-form orders. ZBV is produced by a
//! small list scheduler that plays the pipeline forward in unit time steps (`F = I = W = 1`,
//! the cost model of the zero-bubble paper) and lets every idle rank pick, in this priority,
//! a ready input-gradient backward `I` (oldest micro-batch, deeper stage first), a ready
//! forward `F` if the rank holds fewer than `2 pp` stage activations whose `W` has not run,
//! or the oldest deferred weight-gradient backward `W`. Deferred `W`s fill what would be
//! bubbles; the cap keeps memory at the 1F1B level. Under unit costs the result reaches the
//! lower bound `makespan = 6 m + pp - 1` (the last rank cannot start before `pp - 1`). The
//! order is valid whatever the real costs are: costs only change how long ranks wait.

use std::collections::VecDeque;

use crate::schedule::{Action, Placement, Schedule, ScheduleError, ScheduleKind};

fn check_common(pp: usize, microbatches: usize) -> Result<(), ScheduleError> {
    if pp == 0 {
        return Err(ScheduleError::NoRanks);
    }
    if microbatches == 0 {
        return Err(ScheduleError::NoMicrobatches);
    }
    Ok(())
}

/// Appends `REDUCE(s)` right after the last backward (`B` or `W`) of each stage.
fn add_reductions(programs: &mut [Vec<Action>], microbatches: usize) {
    for program in programs.iter_mut() {
        let mut out = Vec::with_capacity(program.len() + 2);
        let mut done: std::collections::HashMap<usize, usize> = Default::default();
        for &action in program.iter() {
            out.push(action);
            if let Action::Backward { stage, .. } | Action::BackwardWeight { stage, .. } = action {
                let n = done.entry(stage).or_insert(0);
                *n += 1;
                if *n == microbatches {
                    out.push(Action::ReduceGrads { stage });
                }
            }
        }
        *program = out;
    }
}

fn finish(
    kind: ScheduleKind,
    placement: Placement,
    microbatches: usize,
    mut compute: Vec<Vec<Action>>,
) -> Result<Schedule, ScheduleError> {
    add_reductions(&mut compute, microbatches);
    Schedule::with_communication(kind, placement, microbatches, compute)
}

/// GPipe: every rank runs all its forwards, then all its backwards (micro-batch order).
///
/// # Arguments
/// * `pp` - pipeline ranks (one stage each).
/// * `microbatches` - micro-batches per step.
///
/// # Returns
/// The schedule, communication included.
///
/// # Errors
/// [`ScheduleError::NoRanks`] or [`ScheduleError::NoMicrobatches`].
///
/// # Example
/// ```
/// let s = burn_pipeline::generators::gpipe(2, 2).unwrap();
/// let text: Vec<String> = s.program(0).iter().map(|a| a.to_string()).collect();
/// assert_eq!(text[..3], ["0F0", "SEND_F(0->1,m0)", "0F1"]);
/// ```
pub fn gpipe(pp: usize, microbatches: usize) -> Result<Schedule, ScheduleError> {
    check_common(pp, microbatches)?;
    let compute = (0..pp)
        .map(|stage| {
            let f = (0..microbatches).map(|microbatch| Action::Forward { stage, microbatch });
            let b = (0..microbatches).map(|microbatch| Action::Backward { stage, microbatch });
            f.chain(b).collect()
        })
        .collect();
    finish(
        ScheduleKind::GPipe,
        Placement::looped(pp, 1)?,
        microbatches,
        compute,
    )
}

/// 1F1B (PipeDream-flush): rank `r` runs `min(pp - 1 - r, m)` warm-up forwards, then
/// alternates one forward and one backward, then drains the remaining backwards. Rank `r`
/// holds at most `pp - r` micro-batches' activations.
///
/// # Arguments
/// * `pp` - pipeline ranks (one stage each).
/// * `microbatches` - micro-batches per step (any count >= 1).
///
/// # Errors
/// [`ScheduleError::NoRanks`] or [`ScheduleError::NoMicrobatches`].
///
/// # Example
/// ```
/// let s = burn_pipeline::generators::one_f_one_b(4, 8).unwrap();
/// s.validate().unwrap();
/// ```
pub fn one_f_one_b(pp: usize, microbatches: usize) -> Result<Schedule, ScheduleError> {
    check_common(pp, microbatches)?;
    let compute = (0..pp)
        .map(|stage| one_f_one_b_rank(stage, pp - 1 - stage, microbatches, false))
        .collect();
    finish(
        ScheduleKind::OneFOneB,
        Placement::looped(pp, 1)?,
        microbatches,
        compute,
    )
}

fn one_f_one_b_rank(stage: usize, warmup: usize, m: usize, split: bool) -> Vec<Action> {
    let warmup = warmup.min(m);
    let f = |microbatch| Action::Forward { stage, microbatch };
    let b = |microbatch| {
        if split {
            Action::BackwardInput { stage, microbatch }
        } else {
            Action::Backward { stage, microbatch }
        }
    };
    let mut out: Vec<Action> = (0..warmup).map(f).collect();
    for k in 0..m - warmup {
        out.push(f(warmup + k));
        out.push(b(k));
    }
    out.extend((m - warmup..m).map(b));
    out
}

/// Interleaved 1F1B (Megatron's virtual pipeline): `v` stages per rank in loop order
/// (stage `s` on rank `s % pp`). Forwards run in rounds: `pp` micro-batches through chunk 0,
/// the same `pp` through chunk 1, ..., then the next `pp` micro-batches; backwards run the
/// chunks in reverse. Rank `r` warms up with `2 (pp - 1 - r) + (v - 1) pp` forwards (capped
/// by `v m`), then alternates, then drains. With `v = 1` this is exactly [`one_f_one_b`].
///
/// # Arguments
/// * `pp` - pipeline ranks.
/// * `microbatches` - micro-batches per step; a multiple of `pp` when `v > 1`.
/// * `v` - virtual stages per rank.
///
/// # Errors
/// [`ScheduleError::NoRanks`], [`ScheduleError::NoMicrobatches`],
/// [`ScheduleError::NoVirtualStages`], or [`ScheduleError::MicrobatchesNotDivisible`] when
/// `v > 1` and `pp` does not divide `microbatches` (Megatron's constraint: the rounds of
/// `pp` micro-batches must be full).
///
/// # Example
/// ```
/// use burn_pipeline::generators::interleaved_1f1b;
/// let s = interleaved_1f1b(2, 4, 2).unwrap();
/// assert_eq!(s.num_stages(), 4);
/// assert!(interleaved_1f1b(2, 3, 2).is_err());
/// ```
pub fn interleaved_1f1b(
    pp: usize,
    microbatches: usize,
    v: usize,
) -> Result<Schedule, ScheduleError> {
    check_common(pp, microbatches)?;
    let placement = Placement::looped(pp, v)?;
    if v > 1 && !microbatches.is_multiple_of(pp) {
        return Err(ScheduleError::MicrobatchesNotDivisible {
            schedule: "interleaved 1F1B",
            microbatches,
            ranks: pp,
            lower: microbatches / pp * pp,
            upper: (microbatches / pp + 1) * pp,
        });
    }
    let total = microbatches * v;
    let compute = (0..pp)
        .map(|rank| {
            // Virtual micro-batch k -> (chunk, micro-batch).
            let locate = |k: usize, backward: bool| {
                let within = k % (pp * v);
                let chunk = within / pp;
                let chunk = if backward { v - 1 - chunk } else { chunk };
                let microbatch = k / (pp * v) * pp + within % pp;
                (chunk * pp + rank, microbatch)
            };
            let f = |k| {
                let (stage, microbatch) = locate(k, false);
                Action::Forward { stage, microbatch }
            };
            let b = |k| {
                let (stage, microbatch) = locate(k, true);
                Action::Backward { stage, microbatch }
            };
            let warmup = if v == 1 {
                pp - 1 - rank
            } else {
                2 * (pp - 1 - rank) + (v - 1) * pp
            }
            .min(total);
            let mut out: Vec<Action> = (0..warmup).map(f).collect();
            for k in 0..total - warmup {
                out.push(f(warmup + k));
                out.push(b(k));
            }
            out.extend((total - warmup..total).map(b));
            out
        })
        .collect();
    finish(
        ScheduleKind::Interleaved1F1B,
        placement,
        microbatches,
        compute,
    )
}

/// ZB-H1 (zero bubble, "handcrafted 1"): one stage per rank, backward split into `I` and
/// `W`. The order is 1F1B's with `I` in place of `B`; rank `r` follows each `I` with the
/// oldest pending `W` once more than `r` are pending, and runs the rest at the end, so that
/// the input gradients of the drain run back to back. Rank `r` holds at most `pp - r`
/// activations (until `I`), as in 1F1B, plus at most `r` deferred `W` inputs. With
/// `F = I = W = 1` every rank idles `pp - 1` units, a third of 1F1B's `3 (pp - 1)`: the
/// makespan is `3 m + pp - 1`.
///
/// # Arguments
/// * `pp` - pipeline ranks.
/// * `microbatches` - micro-batches per step (any count >= 1).
///
/// # Errors
/// [`ScheduleError::NoRanks`] or [`ScheduleError::NoMicrobatches`].
///
/// # Example
/// ```
/// let s = burn_pipeline::generators::zb_h1(4, 8).unwrap();
/// assert!(s.splits_backward());
/// s.validate().unwrap();
/// ```
pub fn zb_h1(pp: usize, microbatches: usize) -> Result<Schedule, ScheduleError> {
    check_common(pp, microbatches)?;
    let placement = Placement::looped(pp, 1)?;
    let compute = (0..pp)
        .map(|stage| {
            let warmup = (pp - 1 - stage).min(microbatches);
            // 1F1B with `I` in place of `B`; then `W`s: rank `r` lets `r` of them wait during
            // the steady state and the drain, so that the input gradients of the drain run
            // back to back, and flushes the rest at the end.
            let mut out = Vec::with_capacity(3 * microbatches + 1);
            let mut next_w = 0usize;
            let mut done_i = 0usize;
            for action in one_f_one_b_rank(stage, warmup, microbatches, true) {
                out.push(action);
                if let Action::BackwardInput { .. } = action {
                    done_i += 1;
                    if done_i - next_w > stage {
                        out.push(Action::BackwardWeight {
                            stage,
                            microbatch: next_w,
                        });
                        next_w += 1;
                    }
                }
            }
            out.extend(
                (next_w..microbatches)
                    .map(|microbatch| Action::BackwardWeight { stage, microbatch }),
            );
            out
        })
        .collect();
    finish(ScheduleKind::ZbH1, placement, microbatches, compute)
}

/// ZBV (zero bubble V): two stages per rank in V order (rank `r` holds stages `r` and
/// `2 pp - 1 - r`, so the first and last stage share rank 0 and the turn of the V is local to
/// rank `pp - 1`), backward split into `I` and `W`. Each rank holds at most `2 pp` stage
/// activations whose `W` has not run, i.e. `pp` micro-batches of a full rank's layers, the
/// 1F1B bound of rank 0. The bubble is near zero once `m >= 2 pp`.
///
/// Any `m >= 1` gives a valid schedule (smaller `m` only leaves larger bubbles), so there is
/// no minimum and no padding.
///
/// # Arguments
/// * `pp` - pipeline ranks.
/// * `microbatches` - micro-batches per step.
///
/// # Errors
/// [`ScheduleError::NoRanks`] or [`ScheduleError::NoMicrobatches`].
///
/// # Example
/// ```
/// let s = burn_pipeline::generators::zbv(4, 8).unwrap();
/// assert_eq!(s.placement().stages_of(0), vec![0, 7]);
/// s.validate().unwrap();
/// ```
pub fn zbv(pp: usize, microbatches: usize) -> Result<Schedule, ScheduleError> {
    check_common(pp, microbatches)?;
    let placement = Placement::v_shape(pp, 2)?;
    let compute = list_schedule("ZBV", &placement, microbatches, 2 * pp)?;
    finish(ScheduleKind::Zbv, placement, microbatches, compute)
}

/// DualPipeV: two stages per rank in V order (rank `r` holds stages `r` and `2p - 1 - r`, like
/// ZBV), in the phases of DeepSeek's DualPipe cut in half. Writing `F0`/`F1` for a forward of
/// the rank's first/second stage and `B`, `I`, `W` likewise, rank `r` of `p` runs:
///
/// 1. `2 (p - r - 1)` × `F0` (filling the way down);
/// 2. `r + 1` × `F0 F1`;
/// 3. `p - r - 1` × `I1 W F1` (the first backwards split, their `W` at once);
/// 4. `m - 2p + r + 1` × `F0 B1 F1 B0`: the steady state, each forward paired with a backward
///    of the other stage (DualPipe overlaps each pair's computation with the other's
///    communication; here they run one after the other);
/// 5. `p - r - 1` × `B1 F1 B0`;
/// 6. `r + 1` × `B1 B0`, split (`I`) from the middle on;
/// 7. `p - r - 1` × `W I0`;
/// 8. `r + 1` × `W`.
///
/// Deferred `W`s run oldest first. It needs `m >= 2p`.
///
/// # Errors
/// [`ScheduleError::NoRanks`], [`ScheduleError::NoMicrobatches`],
/// [`ScheduleError::TooFewMicrobatches`] when `m < 2p`.
///
/// # Example
/// ```
/// let s = burn_pipeline::generators::dualpipe_v(4, 10).unwrap();
/// assert_eq!(s.placement().stages_of(1), vec![1, 6]);
/// s.validate().unwrap();
/// assert!(burn_pipeline::generators::dualpipe_v(4, 7).is_err());
/// ```
pub fn dualpipe_v(pp: usize, microbatches: usize) -> Result<Schedule, ScheduleError> {
    check_common(pp, microbatches)?;
    if microbatches < 2 * pp {
        return Err(ScheduleError::TooFewMicrobatches {
            schedule: "DualPipeV",
            microbatches,
            ranks: pp,
            needed: 2 * pp,
        });
    }
    let placement = Placement::v_shape(pp, 2)?;
    let compute = (0..pp)
        .map(|r| dualpipe_v_rank(pp, r, microbatches))
        .collect();
    finish(ScheduleKind::DualPipeV, placement, microbatches, compute)
}

/// The computation order of rank `r` under DualPipeV (see [`dualpipe_v`]).
fn dualpipe_v_rank(p: usize, r: usize, m: usize) -> Vec<Action> {
    struct Program {
        stages: [usize; 2],
        forwards: [usize; 2],
        backwards: [usize; 2],
        deferred: std::collections::VecDeque<(usize, usize)>,
        out: Vec<Action>,
    }
    impl Program {
        fn f(&mut self, c: usize) {
            let (stage, microbatch) = (self.stages[c], self.forwards[c]);
            self.forwards[c] += 1;
            self.out.push(Action::Forward { stage, microbatch });
        }
        fn b(&mut self, c: usize, split: bool) {
            let (stage, microbatch) = (self.stages[c], self.backwards[c]);
            self.backwards[c] += 1;
            self.out.push(match split {
                true => {
                    self.deferred.push_back((stage, microbatch));
                    Action::BackwardInput { stage, microbatch }
                }
                false => Action::Backward { stage, microbatch },
            });
        }
        fn w(&mut self) {
            if let Some((stage, microbatch)) = self.deferred.pop_front() {
                self.out.push(Action::BackwardWeight { stage, microbatch });
            }
        }
    }
    let mut q = Program {
        stages: [r, 2 * p - 1 - r],
        forwards: [0; 2],
        backwards: [0; 2],
        deferred: Default::default(),
        out: Vec::with_capacity(6 * m),
    };
    let down = p - r - 1;
    for _ in 0..2 * down {
        q.f(0);
    }
    for _ in 0..=r {
        q.f(0);
        q.f(1);
    }
    for _ in 0..down {
        q.b(1, true);
        q.w();
        q.f(1);
    }
    for _ in 0..m + r + 1 - 2 * p {
        q.f(0);
        q.b(1, false);
        q.f(1);
        q.b(0, false);
    }
    for _ in 0..down {
        q.b(1, false);
        q.f(1);
        q.b(0, false);
    }
    // The last backwards split from the middle on, so that their W fill the drain.
    let half = r.div_ceil(2);
    for i in 0..=r {
        q.b(1, i > half || (i == half && r % 2 == 1));
        q.b(0, i >= half);
    }
    for _ in 0..down {
        q.w();
        q.b(0, true);
    }
    for _ in 0..=r {
        q.w();
    }
    q.out
}

/// Generates a schedule of `kind`.
///
/// # Arguments
/// * `kind` - the family (not [`ScheduleKind::Custom`]).
/// * `pp` - pipeline ranks.
/// * `microbatches` - micro-batches per step.
/// * `virtual_stages` - stages per rank; `None` for the family's default (2 for ZBV, 1 for
///   the others). Only interleaved 1F1B accepts a choice.
///
/// # Errors
/// The generator's errors, [`ScheduleError::VirtualStages`] when the family does not support
/// `virtual_stages`, or [`ScheduleError::UnknownKind`] for `Custom`.
///
/// # Example
/// ```
/// use burn_pipeline::{generators::generate, ScheduleKind};
/// let kind: ScheduleKind = "zb-h1".parse().unwrap();
/// let s = generate(kind, 2, 4, None).unwrap();
/// assert_eq!(s.kind(), ScheduleKind::ZbH1);
/// ```
pub fn generate(
    kind: ScheduleKind,
    pp: usize,
    microbatches: usize,
    virtual_stages: Option<usize>,
) -> Result<Schedule, ScheduleError> {
    let fixed =
        |schedule: &'static str, default: usize, supported: &'static str| match virtual_stages {
            Some(v) if v != default => Err(ScheduleError::VirtualStages {
                schedule,
                virtual_stages: v,
                supported,
            }),
            Some(_) | None => Ok(()),
        };
    match kind {
        ScheduleKind::GPipe => {
            fixed("GPipe", 1, "exactly 1")?;
            gpipe(pp, microbatches)
        }
        ScheduleKind::OneFOneB => {
            fixed("1F1B", 1, "exactly 1 (use interleaved for more)")?;
            one_f_one_b(pp, microbatches)
        }
        ScheduleKind::Interleaved1F1B => {
            interleaved_1f1b(pp, microbatches, virtual_stages.unwrap_or(2))
        }
        ScheduleKind::ZbH1 => {
            fixed("ZB-H1", 1, "exactly 1")?;
            zb_h1(pp, microbatches)
        }
        ScheduleKind::Zbv => {
            fixed("ZBV", 2, "exactly 2")?;
            zbv(pp, microbatches)
        }
        ScheduleKind::DualPipeV => {
            fixed("DualPipeV", 2, "exactly 2")?;
            dualpipe_v(pp, microbatches)
        }
        ScheduleKind::Custom => Err(ScheduleError::UnknownKind {
            name: "custom".into(),
        }),
    }
}

/// Unit-time list scheduling with split backward (see the module docs). `cap` bounds, on
/// every rank, the (stage, micro-batch) pairs whose `F` has started and whose `W` has not.
/// Returns the computation order of every rank.
fn list_schedule(
    name: &'static str,
    placement: &Placement,
    m: usize,
    cap: usize,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let ranks = placement.num_ranks();
    let stages = placement.num_stages();
    let last = stages - 1;
    // Completion times (`None` until started; ops take one unit, so an op started at `t`
    // is visible from `t + 1`).
    let mut f_done: Vec<Vec<Option<usize>>> = vec![vec![None; m]; stages];
    let mut i_done: Vec<Vec<Option<usize>>> = vec![vec![None; m]; stages];
    let mut next_f = vec![0usize; stages];
    let mut next_i = vec![0usize; stages];
    let mut pending_w: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); ranks];
    let mut held = vec![0usize; ranks];
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); ranks];
    // Deeper stages first: they finish micro-batches and start backwards sooner.
    let local: Vec<Vec<usize>> = (0..ranks)
        .map(|r| {
            let mut s = placement.stages_of(r);
            s.reverse();
            s
        })
        .collect();
    let total_w = stages * m;
    let mut w_count = 0usize;
    let mut idle_steps = 0usize;
    let mut t = 0usize;
    let ready = |v: Option<usize>, t: usize| v.is_some_and(|d| d <= t);
    while w_count < total_w {
        let mut started = false;
        for r in 0..ranks {
            // 1. Input-gradient backward, oldest micro-batch first.
            let input = local[r]
                .iter()
                .filter_map(|&s| {
                    let mb = next_i[s];
                    (mb < m
                        && ready(f_done[s][mb], t)
                        && (s == last || ready(i_done[s + 1][mb], t)))
                    .then_some((mb, s))
                })
                .min_by_key(|&(mb, s)| (mb, std::cmp::Reverse(s)));
            if let Some((mb, s)) = input {
                i_done[s][mb] = Some(t + 1);
                next_i[s] += 1;
                pending_w[r].push_back((s, mb));
                out[r].push(Action::BackwardInput {
                    stage: s,
                    microbatch: mb,
                });
                started = true;
                continue;
            }
            // 2. A forward within the memory cap.
            let forward = (held[r] < cap)
                .then(|| {
                    local[r]
                        .iter()
                        .filter_map(|&s| {
                            let mb = next_f[s];
                            (mb < m && (s == 0 || ready(f_done[s - 1][mb], t))).then_some((mb, s))
                        })
                        .min_by_key(|&(mb, s)| (mb, std::cmp::Reverse(s)))
                })
                .flatten();
            if let Some((mb, s)) = forward {
                f_done[s][mb] = Some(t + 1);
                next_f[s] += 1;
                held[r] += 1;
                out[r].push(Action::Forward {
                    stage: s,
                    microbatch: mb,
                });
                started = true;
                continue;
            }
            // 3. Otherwise a deferred weight gradient fills the slot.
            if let Some((s, mb)) = pending_w[r].pop_front() {
                held[r] -= 1;
                w_count += 1;
                out[r].push(Action::BackwardWeight {
                    stage: s,
                    microbatch: mb,
                });
                started = true;
            }
        }
        idle_steps = if started { 0 } else { idle_steps + 1 };
        if idle_steps > 1 {
            return Err(ScheduleError::GeneratorStalled {
                schedule: name,
                time: t,
            });
        }
        t += 1;
    }
    Ok(out)
}
