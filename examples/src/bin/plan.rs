//! Which layout of the GPT fits, and which is fastest: the memory and FLOPs planner of
//! `burn_parallel::planner` on the command line.
//!
//! ```text
//! cargo run -p examples --bin plan -- --layers 24 --d-model 2048 --heads 16 --vocab 50304 \
//!     --seq-len 2048 --world 16 --memory-gib 16 --batch 64 --tflops 100 --link-gbps 50
//! plan --layers 32 --d-model 4096 --heads 32 --kv-heads 8 --d-ff 14336 --swiglu --rotary \
//!     --rmsnorm --vocab 128256 --seq-len 8192 --world 64 --memory-gib 80 --batch 512
//! plan --moe-experts 8 --top-k 2 --world 8 --memory-gib 1   # GPT-MoE, expert parallel too
//! ```
//!
//! Prints the layouts that fit, fastest first (per-rank memory by part, predicted step time
//! and tokens/s), then why the first rejected ones do not. `--json FILE` writes the whole plan.

use std::process::ExitCode;

use burn_parallel::planner::plan;
use clap::Parser;
use examples::cli::PlanArgs;

fn main() -> ExitCode {
    let a = PlanArgs::parse();
    let (shape, training, hw) = match a.inputs() {
        Ok(inputs) => inputs,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match plan(&shape, &training, &hw) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    for line in a.report(&shape, &result) {
        println!("{line}");
    }
    if let Some(path) = &a.json {
        let text = match serde_json::to_string_pretty(&result) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: cannot serialise the plan: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("\nwritten to {}", path.display());
    }
    if result.fitting.is_empty() {
        eprintln!("no layout fits: see the reasons above");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
