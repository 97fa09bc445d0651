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

use burn_parallel::planner::{Candidate, plan};
use clap::Parser;
use examples::cli::PlanArgs;

fn row(rank: usize, c: &Candidate, unit: f64) -> String {
    let m = &c.memory;
    format!(
        "| {rank} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | \
         {:.0} | {:.0}% |",
        c.layout,
        m.params / unit,
        m.grads / unit,
        m.optimizer / unit,
        m.activations / unit,
        m.buffers / unit,
        m.gathered / unit,
        m.transient / unit,
        m.total() / unit,
        1e3 * c.step_seconds,
        c.tokens_per_s,
        100.0 * c.bubble_fraction
    )
}

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
    println!(
        "model: {} parameters ({} active), {} layers x d_model {}, {} heads; world {}, {} GiB \
         per device, batch {} x {} tokens, {}",
        shape.num_params(),
        shape.active_params(),
        shape.layers,
        shape.d_model,
        shape.heads,
        a.world,
        a.memory_gib,
        a.batch,
        a.seq_len,
        if a.fp32 { "fp32" } else { "mixed precision" }
    );
    let shown = &result.fitting[..a.top.min(result.fitting.len())];
    let gib = 1024.0 * 1024.0 * 1024.0;
    let (unit, unit_name) = if shown.iter().any(|c| c.memory.total() >= gib) {
        (gib, "GiB")
    } else {
        (1024.0 * 1024.0, "MiB")
    };
    println!(
        "\n{} layouts fit, {} rejected; the {} fastest ({unit_name} per rank, worst pipeline \
         stage):\n",
        result.fitting.len(),
        result.rejected.len(),
        shown.len()
    );
    println!(
        "(fp32: total = params + optim + max(activ + gathered + transient, grads + buffers): \
         the gradients exist once the backward has released the activations)"
    );
    println!(
        "| # | layout | params | grads | optim | activ | buffers | gathered | transient | total | \
         ms/step | tokens/s | bubble |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, c) in shown.iter().enumerate() {
        println!("{}", row(i + 1, c, unit));
    }
    if !result.rejected.is_empty() {
        println!(
            "\nrejected (first {}):",
            a.rejected.min(result.rejected.len())
        );
        for r in result.rejected.iter().take(a.rejected) {
            println!("- {}: {}", r.layout, r.reason);
        }
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
