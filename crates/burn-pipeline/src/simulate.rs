//! Predicts what a schedule costs: makespan, bubble fraction, activations held, and a
//! timeline (text grid or Chrome/Perfetto trace) for debugging.
//!
//! The model: each rank executes its program in order, one action at a time. A computation
//! takes its [`Costs`] entry; a send takes no rank time (eager transport) and its message
//! arrives `comm` later; a receive waits until the message has arrived. The schedule must be
//! valid ([`crate::validate`]) so that this play-through cannot get stuck.
//!
//! The **bubble fraction** is the idle share of all rank time: `1 - busy / (ranks x
//! makespan)`, where `busy` sums every rank's computation time (communication is not work).

use std::fmt::Write as _;

use crate::schedule::{Action, ActionKind, Schedule};
use crate::trace::{Timeline, Track};
use crate::validate::{CommModel, ValidationError, validate};

/// Time each action takes, in any unit.
#[derive(Clone, Debug, PartialEq)]
pub struct Costs {
    /// Forward of one micro-batch through one stage.
    pub forward: f64,
    /// Full backward.
    pub backward: f64,
    /// Input-gradient backward.
    pub backward_input: f64,
    /// Weight-gradient backward.
    pub backward_weight: f64,
    /// Gradient reduction of a stage.
    pub reduce: f64,
    /// Latency from a send to its receive being able to complete.
    pub comm: f64,
    /// Per-stage multiplier of the computation costs (empty: all 1), for unbalanced stages
    /// or measured per-stage times.
    pub stage_scale: Vec<f64>,
}

impl Costs {
    /// The textbook unit costs: `F = 1`, `B = 2`, `I = 1`, `W = 1`, reduction and
    /// communication free.
    pub fn unit() -> Self {
        Self {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            reduce: 0.0,
            comm: 0.0,
            stage_scale: Vec::new(),
        }
    }

    /// The mean time of each kind of action in a measured step, with a per-stage scale from
    /// each stage's mean forward: what the simulator needs to predict that step. Kinds that
    /// did not run cost 0; communication is taken as free (its waiting is what the
    /// prediction is compared with).
    ///
    /// # Example
    /// ```
    /// use burn_pipeline::generators::one_f_one_b;
    /// use burn_pipeline::simulate::{simulate, Costs};
    /// use burn_pipeline::trace::Timeline;
    ///
    /// let schedule = one_f_one_b(2, 4).unwrap();
    /// let unit = simulate(&schedule, &Costs::unit()).unwrap();
    /// let costs = Costs::from_timeline(&Timeline::from_simulated(&unit));
    /// assert_eq!((costs.forward, costs.backward), (1.0, 2.0));
    /// let again = simulate(&schedule, &costs).unwrap();
    /// assert!((again.bubble_fraction - unit.bubble_fraction).abs() < 1e-12);
    /// ```
    pub fn from_timeline(timeline: &Timeline) -> Self {
        let spans = || timeline.tracks.iter().flat_map(|t| &t.spans);
        let mean = |keep: &dyn Fn(&Span) -> bool| {
            let (sum, n) = spans()
                .filter(|s| keep(s))
                .fold((0.0, 0usize), |(t, n), s| (t + (s.end - s.start), n + 1));
            if n == 0 { 0.0 } else { sum / n as f64 }
        };
        let of = |kind: ActionKind| mean(&|s: &Span| s.action.kind() == kind);
        let forward = of(ActionKind::Forward);
        let stages = spans().map(|s| s.action.stage() + 1).max().unwrap_or(0);
        let stage_scale = (0..stages)
            .map(|stage| {
                let f = mean(&|s: &Span| {
                    s.action.kind() == ActionKind::Forward && s.action.stage() == stage
                });
                if forward > 0.0 && f > 0.0 {
                    f / forward
                } else {
                    1.0
                }
            })
            .collect();
        Self {
            forward,
            backward: of(ActionKind::Backward),
            backward_input: of(ActionKind::BackwardInput),
            backward_weight: of(ActionKind::BackwardWeight),
            reduce: of(ActionKind::ReduceGrads),
            comm: 0.0,
            stage_scale,
        }
    }

    /// Unit costs with a communication latency.
    pub fn with_comm(mut self, comm: f64) -> Self {
        self.comm = comm;
        self
    }

    /// Rank time taken by `action`.
    pub fn of(&self, action: &Action) -> f64 {
        let base = match action.kind() {
            ActionKind::Forward => self.forward,
            ActionKind::Backward => self.backward,
            ActionKind::BackwardInput => self.backward_input,
            ActionKind::BackwardWeight => self.backward_weight,
            ActionKind::ReduceGrads => self.reduce,
            ActionKind::SendActivation
            | ActionKind::RecvActivation
            | ActionKind::SendGrad
            | ActionKind::RecvGrad => return 0.0,
        };
        base * self.stage_scale.get(action.stage()).copied().unwrap_or(1.0)
    }
}

impl Default for Costs {
    fn default() -> Self {
        Self::unit()
    }
}

pub use crate::trace::Span;

/// What the simulator predicts for one schedule step.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Time from the first action to the last.
    pub makespan: f64,
    /// Computation time of each rank.
    pub busy: Vec<f64>,
    /// `1 - sum(busy) / (ranks x makespan)`.
    pub bubble_fraction: f64,
    /// Per rank, the most (stage, micro-batch) activations held at once: counted from the
    /// forward until the backward that frees them (`B`, or `W` when the backward is split,
    /// since `W` still needs the stage's saved inputs).
    pub peak_activations: Vec<usize>,
    /// Per rank, the same count freed at `B`/`I` instead (what stays after `I` is only the
    /// inputs `W` needs, usually much smaller than the full activations).
    pub peak_activations_until_input: Vec<usize>,
    /// Per stage, the most micro-batches held at once (until `B`/`W`).
    pub peak_microbatches_per_stage: Vec<usize>,
    /// Every action of every rank, in program order, placed in time.
    pub timeline: Vec<Vec<Span>>,
}

/// Simulates `schedule` under `costs`.
///
/// # Arguments
/// * `schedule` - a schedule; it is validated first (eager sends).
/// * `costs` - the time of each action.
///
/// # Returns
/// The [`Report`].
///
/// # Errors
/// The [`ValidationError`] of an invalid schedule.
///
/// # Example
/// ```
/// use burn_pipeline::generators::one_f_one_b;
/// use burn_pipeline::simulate::{simulate, Costs};
///
/// let (p, m) = (4, 8);
/// let report = simulate(&one_f_one_b(p, m).unwrap(), &Costs::unit()).unwrap();
/// let theory = (p - 1) as f64 / (m + p - 1) as f64;
/// assert!((report.bubble_fraction - theory).abs() < 1e-12);
/// assert_eq!(report.peak_activations[0], p);
/// ```
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Report, ValidationError> {
    validate(schedule, CommModel::Eager)?;
    let programs = schedule.programs();
    let ranks = programs.len();
    let mut pc = vec![0usize; ranks];
    let mut clock = vec![0.0f64; ranks];
    let mut arrival: std::collections::HashMap<crate::schedule::Transfer, f64> = Default::default();
    let mut timeline: Vec<Vec<Span>> = programs
        .iter()
        .map(|p| Vec::with_capacity(p.len()))
        .collect();
    // Validation proved the eager play-through completes; each sweep advances at least one
    // rank, so this loop ends.
    loop {
        let mut progress = false;
        for r in 0..ranks {
            while let Some(&action) = programs[r].get(pc[r]) {
                let start = clock[r];
                let end = match action.transfer() {
                    Some(t) if action.is_send() => {
                        arrival.insert(t, start + costs.comm);
                        start
                    }
                    Some(t) => match arrival.get(&t) {
                        Some(&at) => at.max(start),
                        None => break,
                    },
                    None => start + costs.of(&action),
                };
                clock[r] = end;
                timeline[r].push(Span { action, start, end });
                pc[r] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    let busy: Vec<f64> = programs
        .iter()
        .map(|p| p.iter().map(|a| costs.of(a)).sum())
        .collect();
    let total: f64 = busy.iter().sum();
    let bubble_fraction = if makespan > 0.0 {
        1.0 - total / (ranks as f64 * makespan)
    } else {
        0.0
    };
    let (peak_activations, peak_microbatches_per_stage) = peaks(schedule, true);
    let (peak_activations_until_input, _) = peaks(schedule, false);
    Ok(Report {
        makespan,
        busy,
        bubble_fraction,
        peak_activations,
        peak_activations_until_input,
        peak_microbatches_per_stage,
        timeline,
    })
}

/// Peak live activations per rank and per stage, in program order. With `until_weight`, a
/// split backward frees at `W`, otherwise at `I`.
fn peaks(schedule: &Schedule, until_weight: bool) -> (Vec<usize>, Vec<usize>) {
    let mut per_stage_peak = vec![0usize; schedule.num_stages()];
    let mut live_stage = vec![0usize; schedule.num_stages()];
    let per_rank = schedule
        .programs()
        .iter()
        .map(|program| {
            let (mut live, mut peak) = (0usize, 0usize);
            for action in program {
                let s = action.stage();
                match action.kind() {
                    ActionKind::Forward => {
                        live += 1;
                        live_stage[s] += 1;
                        peak = peak.max(live);
                        per_stage_peak[s] = per_stage_peak[s].max(live_stage[s]);
                    }
                    ActionKind::Backward => {
                        live -= 1;
                        live_stage[s] -= 1;
                    }
                    ActionKind::BackwardInput if !until_weight => {
                        live -= 1;
                        live_stage[s] -= 1;
                    }
                    ActionKind::BackwardWeight if until_weight => {
                        live -= 1;
                        live_stage[s] -= 1;
                    }
                    ActionKind::BackwardInput
                    | ActionKind::BackwardWeight
                    | ActionKind::SendActivation
                    | ActionKind::RecvActivation
                    | ActionKind::SendGrad
                    | ActionKind::RecvGrad
                    | ActionKind::ReduceGrads => {}
                }
            }
            peak
        })
        .collect();
    (per_rank, per_stage_peak)
}

impl Report {
    /// Renders the computation as a rank x time grid, one column per `resolution` time units
    /// (use the smallest cost, 1 for unit costs). Each busy cell shows the action running in
    /// it (`0F3` = stage 0 forward of micro-batch 3), idle cells show `.`; the summary line
    /// gives the makespan and bubble fraction.
    ///
    /// # Arguments
    /// * `resolution` - time per column (> 0).
    ///
    /// # Returns
    /// The grid as text, one line per rank plus a header and a summary.
    pub fn render(&self, resolution: f64) -> String {
        let resolution = if resolution > 0.0 { resolution } else { 1.0 };
        let columns = (self.makespan / resolution).ceil() as usize;
        let cells: Vec<Vec<String>> = self
            .timeline
            .iter()
            .map(|spans| {
                let mut row = vec![".".to_string(); columns];
                for span in spans
                    .iter()
                    .filter(|s| s.action.is_compute() && s.end > s.start)
                {
                    let first = (span.start / resolution + 1e-9).floor() as usize;
                    let last = ((span.end / resolution - 1e-9).ceil() as usize).max(first + 1);
                    for cell in row.iter_mut().take(last.min(columns)).skip(first) {
                        *cell = span.action.to_string();
                    }
                }
                row
            })
            .collect();
        let width = cells
            .iter()
            .flatten()
            .map(String::len)
            .chain([columns.saturating_sub(1).to_string().len()])
            .max()
            .unwrap_or(1);
        let mut out = String::new();
        let _ = write!(out, "{:>7} ", "t");
        for c in 0..columns {
            let _ = write!(out, "{:>width$} ", c);
        }
        out.push('\n');
        for (r, row) in cells.iter().enumerate() {
            let _ = write!(out, "{:>7} ", format!("rank {r}"));
            for cell in row {
                let _ = write!(out, "{cell:>width$} ");
            }
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "makespan {:.3}, bubble {:.2}%, peak activations per rank {:?}",
            self.makespan,
            100.0 * self.bubble_fraction,
            self.peak_activations
        );
        out
    }

    /// The timeline as a Chrome/Perfetto trace (JSON, `chrome://tracing` or
    /// <https://ui.perfetto.dev>): one track per rank (see
    /// [`crate::trace::Timeline::chrome_trace`]). One cost unit = `us_per_unit` microseconds.
    pub fn chrome_trace(&self, us_per_unit: f64) -> String {
        Timeline::from_simulated(self).chrome_trace(us_per_unit)
    }
}

// The simulator's side of `crate::trace` (defined here, with `Report`: the timeline types sit
// below the simulator and the runtime).
impl Timeline {
    /// The simulator's timeline, one track per rank.
    pub fn from_simulated(report: &Report) -> Self {
        Self {
            tracks: report
                .timeline
                .iter()
                .enumerate()
                .map(|(r, spans)| Track {
                    name: format!("rank {r}"),
                    spans: spans.clone(),
                })
                .collect(),
        }
    }
}
