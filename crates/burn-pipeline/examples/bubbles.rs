//! Prints the simulator's prediction for every schedule beside the closed-form bubble, and
//! a timeline.
//!
//! ```sh
//! cargo run -p burn-pipeline --example bubbles -- [pp] [microbatches] [timeline-schedule]
//! ```

use burn_pipeline::ScheduleKind;
use burn_pipeline::generators::generate;
use burn_pipeline::simulate::{Costs, simulate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let p: usize = args.next().map_or(Ok(4), |a| a.parse())?;
    let m: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let show: ScheduleKind = args.next().map_or(Ok(ScheduleKind::Zbv), |a| a.parse())?;
    let (pf, mf) = (p as f64, m as f64);
    println!("pp = {p}, micro-batches = {m}, unit costs F = 1, B = 2, I = W = 1, comm = 0");
    println!(
        "(costs and activations are per stage: with v stages per rank a stage is 1/v of a \
         rank's layers,\n so compare bubble fractions across schedules, not makespans)\n"
    );
    println!(
        "{:<16} {:>8} {:>11} {:>11}  {:<26} peak activations / rank",
        "schedule", "makespan", "bubble sim", "bubble thy", "formula"
    );
    let rows: [(ScheduleKind, Option<usize>, f64, &str); 6] = [
        (
            ScheduleKind::GPipe,
            None,
            (pf - 1.0) / (mf + pf - 1.0),
            "(p-1)/(m+p-1)",
        ),
        (
            ScheduleKind::OneFOneB,
            None,
            (pf - 1.0) / (mf + pf - 1.0),
            "(p-1)/(m+p-1)",
        ),
        (
            ScheduleKind::Interleaved1F1B,
            Some(2),
            (pf - 1.0) / (2.0 * mf + pf - 1.0),
            "(p-1)/(vm+p-1), v=2",
        ),
        (
            ScheduleKind::ZbH1,
            None,
            (pf - 1.0) / (3.0 * mf + pf - 1.0),
            "(p-1)/(3m+p-1)",
        ),
        (
            ScheduleKind::Zbv,
            None,
            (pf - 1.0) / (6.0 * mf + pf - 1.0),
            "(p-1)/(6m+p-1)",
        ),
        (
            ScheduleKind::Interleaved1F1B,
            Some(4),
            (pf - 1.0) / (4.0 * mf + pf - 1.0),
            "(p-1)/(vm+p-1), v=4",
        ),
    ];
    for (kind, v, theory, formula) in rows {
        match generate(kind, p, m, v) {
            Ok(schedule) => {
                let r = simulate(&schedule, &Costs::unit())?;
                let name = match v {
                    Some(v) => format!("{kind} v={v}"),
                    None => kind.to_string(),
                };
                println!(
                    "{:<16} {:>8} {:>10.2}% {:>10.2}%  {:<26} {:?}",
                    name,
                    r.makespan,
                    100.0 * r.bubble_fraction,
                    100.0 * theory,
                    formula,
                    r.peak_activations
                );
            }
            Err(e) => println!("{kind:<16} not generated: {e}"),
        }
    }
    let schedule = generate(show, p, m, None)?;
    println!(
        "\n{show} timeline:\n{}",
        simulate(&schedule, &Costs::unit())?.render(1.0)
    );
    Ok(())
}
