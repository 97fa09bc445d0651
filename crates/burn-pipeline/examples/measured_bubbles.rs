//! Measures the bubble of real pipelined steps and sets it beside the simulator and the closed
//! form, for every schedule.
//!
//! The stages cost a fixed wall-clock time per action, so that a 2-core machine's noise does
//! not swamp the figure: `F` sleeps one unit; the backward (a custom autodiff step) sleeps one
//! unit for the input gradient (`I`) and defers one more unit to the weight-gradient step
//! (`W`, through the stage's `WeightGradStore`), so `B = I + W = 2` units, the simulator's
//! unit costs. Everything else is the real runtime: thread ranks, boundary transfers, the
//! split backward, the schedule's program order. The measured bubble comes from the step's
//! timeline ([`burn_pipeline::trace::Timeline::bubble_fraction`]); receives and sends count as
//! idle, as in the simulator.
//!
//! ```sh
//! cargo run --release -p burn-pipeline --example measured_bubbles -- [pp] [microbatches] [unit-ms] [trace.json]
//! ```
//! The optional trace file gets the ZBV step's Chrome/Perfetto trace.

use std::collections::BTreeMap;
use std::time::Duration;

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use burn_parallel::autograd::{BackwardFn, attach};
use burn_parallel::{CollectiveError, ProcessGroup, run_local};
use burn_pipeline::ScheduleKind;
use burn_pipeline::deferred::WeightGradStore;
use burn_pipeline::generators::generate;
use burn_pipeline::runtime::{Executor, UpdateError};
use burn_pipeline::simulate::{Costs, simulate};
use burn_pipeline::stage::{Boundary, Stage, StageError, StageOutput};
use burn_pipeline::trace::{StepTrack, Timeline};

/// A stage whose every action takes `unit`: `F` sleeps, `I` sleeps, `W` sleeps.
#[derive(Module, Debug)]
struct Sleepy {
    w: Param<Tensor<2>>,
    #[module(skip)]
    unit: Duration,
    #[module(skip)]
    last: bool,
    #[module(skip)]
    store: WeightGradStore,
}

impl Stage<()> for Sleepy {
    fn forward(&self, input: Boundary, _: &()) -> Result<StageOutput, StageError> {
        std::thread::sleep(self.unit);
        let device = self.w.val().device();
        let x = if input.is_empty() {
            Tensor::<2>::zeros([1, 1], &device).require_grad()
        } else {
            input.get::<2>(0)?
        };
        let (unit, store, param) = (self.unit, self.store.clone(), self.w.id);
        let y = attach(
            x.clone(),
            x.detach(),
            BackwardFn::new("sleepy", move |dy| {
                std::thread::sleep(unit); // I
                let device = device.clone();
                store.defer(param, move || {
                    std::thread::sleep(unit); // W
                    Tensor::zeros([1, 1], &device)
                });
                Ok(dy)
            }),
        );
        Ok(if self.last {
            StageOutput::Loss(y.sum())
        } else {
            StageOutput::Boundary(Boundary::new().with(y))
        })
    }

    fn deferred_weights(&self) -> Option<&WeightGradStore> {
        Some(&self.store)
    }
}

/// A rank's failure as the error `run_local` carries.
fn fail(group: &ProcessGroup, op: &str, e: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::InvalidArgument {
        rank: group.rank(),
        op: op.into(),
        reason: e.to_string(),
    }
}

/// Runs `steps` steps of `kind` and returns the last step's timeline (rank 0's view).
fn measure(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: Option<usize>,
    unit: Duration,
    steps: usize,
) -> Result<Timeline, Box<dyn std::error::Error>> {
    let schedule = generate(kind, p, m, v)?;
    let stages = schedule.num_stages();
    let mut timelines = run_local(p, |group| {
        let device = Device::flex().autodiff();
        let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone())
            .map_err(|e| fail(&group, "executor", e))?;
        let mut local: BTreeMap<usize, Sleepy> = exec
            .local_stages()
            .into_iter()
            .map(|s| {
                let stage = Sleepy {
                    w: Param::from_tensor(Tensor::ones([1, 1], &device)),
                    unit,
                    last: s + 1 == stages,
                    store: WeightGradStore::new(),
                };
                (s, stage)
            })
            .collect();
        let batches = vec![(); m];
        let mut keep = |_: usize, stage: Sleepy, _: GradientsParams| Ok::<_, UpdateError>(stage);
        let mut last = None;
        for _ in 0..steps {
            let report = exec
                .step(&mut local, &batches, &mut keep)
                .map_err(|e| fail(&group, "step", e))?;
            last = Some(report);
        }
        let track = StepTrack::new(
            format!("rank {}", group.rank()),
            &last.expect("at least one step"),
        );
        let tracks = group.all_gather_object(&track)?;
        Timeline::from_steps(&tracks).map_err(|e| fail(&group, "trace", e))
    })?;
    Ok(timelines.swap_remove(0))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let p: usize = args.next().map_or(Ok(4), |a| a.parse())?;
    let m: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let unit_ms: f64 = args.next().map_or(Ok(20.0), |a| a.parse())?;
    let trace_path = args.next();
    let unit = Duration::from_secs_f64(unit_ms / 1000.0);
    let steps = 3;
    let (pf, mf) = (p as f64, m as f64);
    println!(
        "pp = {p}, micro-batches = {m}, thread ranks, F = I = W = {unit_ms} ms (B = I + W), \
         last of {steps} steps"
    );
    println!(
        "{:<16} {:>10} {:>11} {:>11} {:>9} {:>13}",
        "schedule", "measured", "simulator", "theory", "meas/thy", "step (ms)"
    );
    let rows: [(ScheduleKind, Option<usize>, f64, &str); 6] = [
        (ScheduleKind::GPipe, None, (pf - 1.0) / (mf + pf - 1.0), ""),
        (
            ScheduleKind::OneFOneB,
            None,
            (pf - 1.0) / (mf + pf - 1.0),
            "",
        ),
        (
            ScheduleKind::Interleaved1F1B,
            Some(2),
            (pf - 1.0) / (2.0 * mf + pf - 1.0),
            " v=2",
        ),
        (
            ScheduleKind::ZbH1,
            None,
            (pf - 1.0) / (3.0 * mf + pf - 1.0),
            "",
        ),
        (
            ScheduleKind::Zbv,
            None,
            (pf - 1.0) / (6.0 * mf + pf - 1.0),
            "",
        ),
        // No closed form here: the simulator's figure stands as the theory (m >= 2p).
        (ScheduleKind::DualPipeV, None, f64::NAN, ""),
    ];
    for (kind, v, theory, suffix) in rows {
        let timeline = measure(kind, p, m, v, unit, steps)?;
        let predicted = simulate(&generate(kind, p, m, v)?, &Costs::unit())?;
        let measured = timeline.bubble_fraction();
        let theory = match theory.is_nan() {
            true => predicted.bubble_fraction,
            false => theory,
        };
        println!(
            "{:<16} {:>9.2}% {:>10.2}% {:>10.2}% {:>9.2} {:>13.1}",
            format!("{kind}{suffix}"),
            100.0 * measured,
            100.0 * predicted.bubble_fraction,
            100.0 * theory,
            measured / theory,
            1000.0 * timeline.makespan()
        );
        if let (ScheduleKind::Zbv, Some(path)) = (kind, &trace_path) {
            std::fs::write(path, timeline.chrome_trace(1e6))?;
            println!("  (trace of this step written to {path})");
        }
    }
    Ok(())
}
