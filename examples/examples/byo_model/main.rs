//! Bring your own model: a LLaMA-style decoder defined in `model.rs` (not the bundled GPT),
//! trained on the bundled Bible under the layout its flags say, with only the public APIs of
//! the library.
//!
//! ```text
//! cargo run --release -p examples --example byo_model -- --ranks 1
//! cargo run --release -p examples --example byo_model -- --ranks 2
//! cargo run --release -p examples --example byo_model -- --ranks 2 --tp 2 --sp
//! cargo run --release -p examples --example byo_model -- --ranks 2 --zero 3
//! cargo run --release -p examples --example byo_model -- --ranks 4 --zero 3 --tp 2 --sp
//! cargo run --release -p examples --example byo_model -- --ranks 4 --zero 3 --hybrid 2
//! cargo run --release -p examples --example byo_model -- --ranks 2 --pp 2 --grad-accum 4
//! cargo run --release -p examples --example byo_model -- --ranks 2 --cp 2 --cp-kind ulysses
//! cargo run --release -p examples --example byo_model -- --ranks 4 --experts 8 --ep 2
//! cargo run --release -p examples --example byo_model -- --ranks 4 --experts 8 --ep 2 --zero 2 --grad-accum 2
//! cargo run --release -p examples --example byo_model -- --ranks 4 --tp 2 --sp --precision bf16
//! cargo run --release -p examples --example byo_model -- --ranks 2 --zero 3 --grad-accum 4 --no-sync --prefetch
//! cargo run --release -p examples --example byo_model -- --ranks 4 --tp 2 --sp --overlap
//! cargo run --release -p examples --example byo_model -- --ranks 4 --tp 2 --sp --steps 50 --save /tmp/ck
//! cargo run --release -p examples --example byo_model -- --ranks 2 --zero 3 --steps 100 --resume /tmp/ck
//! cargo run --release -p examples --example byo_model -- --ranks 2 --zero 2 --steps 50 --save /tmp/z
//! cargo run --release -p examples --example byo_model -- --ranks 2 --tp 2 --steps 100 --resume /tmp/z
//! cargo run --release -p examples --example byo_model -- --ranks 2 --pp 2 --steps 50 --save /tmp/p
//! cargo run --release -p examples --example byo_model -- --ranks 1 --steps 100 --resume /tmp/p
//! cargo run --release -p examples --example byo_model -- --all --ranks 4 --steps 20
//! ```
//!
//! Nothing here is layout-specific: the layout is the library's flags (`cli::LayoutArgs`),
//! `build` places the model (`model::Recipe`: plans, build, pipeline stages) with its engine,
//! and `fit` trains it (each rank its rows of `--grad-accum` micro-batches, `--save` after the
//! last step or on Ctrl-C, `--resume` from what any layout saved).

mod model;

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use burn::tensor::Device;
use burn_parallel::ProcessGroup;
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel_train::cli::{CheckpointArgs, LayoutArgs, Progress, StepArgs, stop_on_signals};
use burn_parallel_train::{
    Layout, LrSchedule, MicroBatch, StepLog, StepSettings, build, fit, run_local,
};
use clap::Parser;
use examples::data::{Corpus, Split};
use model::{Config, Recipe, moe_config};

/// Train the bring-your-own-model decoder.
#[derive(Debug, Clone, Parser)]
struct Args {
    /// Thread ranks.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Global batch (sequences per step, split over the data-parallel ranks).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// The MoE variant: this many experts per layer in place of the MLP (0: dense).
    #[arg(long, default_value_t = 0)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Run every layout of `every_layout` in turn (on `--ranks`, one rank for the first) and
    /// print each one's step time relative to one device.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    layout: LayoutArgs,
    #[command(flatten)]
    step: StepArgs,
    #[command(flatten)]
    checkpoint: CheckpointArgs,
}

/// The layouts `--all` compares on `n` ranks (in TOML, as a file would give them), each with
/// its ranks: one device, DDP, tensor, FSDP, context and pipeline parallelism.
fn every_layout(n: usize) -> Vec<(usize, Layout)> {
    let pp = n.min(Config::small().n_layers);
    let layouts = [
        (1, String::new()),
        (n, String::new()),
        (n, format!("tp = {n}\nsp = true")),
        (n, "tp = 2\nsp = true".into()),
        (n, "zero = 3".into()),
        (n, "zero = 3\ntp = 2\nsp = true".into()),
        (n, format!("cp = {n}")),
        (n, "cp = 2".into()),
        (pp, format!("pp = {pp}")),
    ];
    let layout = |toml: &str| Layout::from_toml(toml).expect("a valid layout");
    layouts.into_iter().map(|(r, t)| (r, layout(&t))).collect()
}

/// One rank's run: the library builds the model and its engine for `layout` (the step with
/// AdamW, ZeRO-1/2, FSDP, burn-moe's engines for the MoE variant, the pipeline's stages), and
/// its loop trains it. Returns the losses of the steps it trained.
fn run_rank(
    world: ProcessGroup,
    args: &Args,
    layout: &Layout,
    corpus: &Corpus,
    stop: &AtomicBool,
) -> Result<Vec<f32>, burn_parallel::Error> {
    let recipe = Recipe {
        config: Config::small(),
        moe: (args.experts > 0).then(|| moe_config(&Config::small(), args.experts, args.top_k)),
    };
    let settings = args.step.settings(StepSettings {
        adamw: FusedAdamWConfig::new().with_weight_decay(0.01),
        batch_size: args.batch_size,
        seq_len: args.seq_len,
        ..StepSettings::default()
    });
    let device = Device::flex().autodiff();
    let built = build(&world, layout, &recipe, &device, &settings)?;
    let config = args
        .checkpoint
        .fit_config(args.steps, LrSchedule::constant(args.lr));
    let mut batch = |micro: &MicroBatch| {
        let (step, rows) = (micro.step as u64, micro.rows.clone());
        Ok(corpus.batch_rows(step, rows, args.seq_len, Split::Train))
    };
    // Rank 0 shows a bar and a line every 10 steps (loss, tokens/s, memory).
    let progress = Progress::new(world.rank() == 0, args.steps, 10);
    let mut on_step = |log: &StepLog, _: &_| {
        progress.step(log, &[]);
        Ok(())
    };
    let fitted = fit(built, &config, &mut batch, &mut on_step, Some(stop))?;
    progress.finish();
    if world.rank() == 0 {
        if let Some(resumed) = &fitted.resumed_from {
            println!("resumed from {resumed}");
        }
        if let Some(step) = fitted.stopped_at {
            println!("stopped after step {step}; resume with --resume");
        }
    }
    Ok(fitted.losses[fitted.first_step..].to_vec())
}

/// Trains under `layout` on `ranks` ranks; prints the loss curve's ends and returns seconds
/// per step.
fn run(args: &Args, ranks: usize, layout: &Layout, corpus: &Corpus, stop: &AtomicBool) -> f64 {
    let start = Instant::now();
    let losses = run_local(ranks, |world| run_rank(world, args, layout, corpus, stop))
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(1);
        });
    let curve = &losses[0];
    let per_step = start.elapsed().as_secs_f64() / curve.len().max(1) as f64;
    match (curve.first(), curve.last()) {
        (Some(first), Some(last)) => println!(
            "{} on {ranks} rank(s): loss {first:.4} -> {last:.4} over {} steps, \
             {per_step:.3} s/step",
            layout.describe(ranks),
            curve.len(),
        ),
        _ => println!("no step left to train (the checkpoint is at --steps already)"),
    }
    per_step
}

fn main() {
    let args = Args::parse();
    let corpus = Corpus::load_default().expect("the bundled corpus");
    // Ctrl-C (or SIGTERM) stops every rank after the same step, saving under --save first.
    let stop = stop_on_signals();
    if !args.all {
        match args.layout.layout() {
            Ok(layout) => run(&args, args.ranks, &layout, &corpus, &stop),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2)
            }
        };
        return;
    }
    let mut times = Vec::new();
    for (ranks, layout) in every_layout(args.ranks) {
        times.push((
            layout.describe(ranks),
            run(&args, ranks, &layout, &corpus, &stop),
        ));
    }
    let single = times[0].1;
    println!("\nstep time relative to one device ({} ranks):", args.ranks);
    for (name, t) in times {
        println!("{name:<24} {t:>8.3} s/step  {:>5.2}x", t / single);
    }
}
