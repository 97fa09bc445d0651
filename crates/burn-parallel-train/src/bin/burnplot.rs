//! Draws the chart of a metrics file (a training binary's `--metrics`, JSON lines): the loss
//! and validation loss, the throughput and any other evaluation against the step, as SVG.
//!
//! ```text
//! burnplot metrics.jsonl                  # writes metrics.svg beside it
//! burnplot metrics.jsonl -o chart.svg
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Draw the loss/validation and throughput chart of a metrics file (SVG).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The metrics file (JSON lines, from `--metrics`).
    metrics: PathBuf,
    /// The SVG file to write (default: the metrics file with the extension `svg`).
    #[arg(short, long, value_name = "FILE")]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let out = args
        .out
        .unwrap_or_else(|| args.metrics.with_extension("svg"));
    match burn_parallel_train::plot::draw_file(&args.metrics, &out) {
        Ok(()) => {
            println!("{}", out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
