//! Bring your own model: a LLaMA-style decoder defined in `model.rs` (not the bundled GPT),
//! trained on the bundled Bible under the layout a flag selects, with only the public APIs of
//! `burn-parallel`.
//!
//! ```text
//! cargo run --release -p examples --example byo_model -- --layout single
//! cargo run --release -p examples --example byo_model -- --layout ddp --ranks 2
//! cargo run --release -p examples --example byo_model -- --layout tp-sp --ranks 2
//! cargo run --release -p examples --example byo_model -- --layout dp-tp --ranks 4
//! cargo run --release -p examples --example byo_model -- --layout fsdp --ranks 2
//! cargo run --release -p examples --example byo_model -- --layout fsdp-tp --ranks 4
//! cargo run --release -p examples --example byo_model -- --layout hsdp --ranks 4
//! cargo run --release -p examples --example byo_model -- --layout pp --ranks 2
//! cargo run --release -p examples --example byo_model -- --layout cp --ranks 2 --cp-kind ulysses
//! cargo run --release -p examples --example byo_model -- --layout dp-cp --ranks 4
//! cargo run --release -p examples --example byo_model -- --layout ddp --ranks 4 --experts 8 --ep 2
//! cargo run --release -p examples --example byo_model -- --layout ddp --ranks 4 --experts 8 --ep 2 --zero 2 --grad-accum 2
//! cargo run --release -p examples --example byo_model -- --layout dp-tp --ranks 4 --precision bf16
//! cargo run --release -p examples --example byo_model -- --layout fsdp --ranks 2 --grad-accum 4 --no-sync --prefetch
//! cargo run --release -p examples --example byo_model -- --layout ddp --ranks 2 --zero 2
//! cargo run --release -p examples --example byo_model -- --layout dp-tp --ranks 4 --overlap
//! cargo run --release -p examples --example byo_model -- --layout dp-tp --ranks 4 --zero 1
//! cargo run --release -p examples --example byo_model -- --layout dp-tp --ranks 4 --steps 50 --save /tmp/ck
//! cargo run --release -p examples --example byo_model -- --layout fsdp --ranks 2 --steps 100 --resume /tmp/ck
//! cargo run --release -p examples --example byo_model -- --layout ddp --ranks 2 --zero 2 --steps 50 --save /tmp/z
//! cargo run --release -p examples --example byo_model -- --layout tp --ranks 2 --steps 100 --resume /tmp/z
//! cargo run --release -p examples --example byo_model -- --layout pp --ranks 2 --steps 50 --save /tmp/p
//! cargo run --release -p examples --example byo_model -- --layout single --steps 100 --resume /tmp/p
//! cargo run --release -p examples --example byo_model -- --all --ranks 4 --steps 20
//! ```
//!
//! The layout-specific code is one line per layout: the `match` in `layout` that turns a
//! preset into a `burn_parallel_train::Layout`. Everything else is the library's: `build` places
//! the model (`model::Recipe`, its plans and build) and picks the engine (the step with AdamW,
//! ZeRO-1/2 with `--zero`, FSDP, burn-moe's engines for the MoE variant `--experts`, mixed
//! precision with `--precision`), and `fit` trains it (each rank its rows of `--grad-accum`
//! micro-batches, `--save` after the last step or on Ctrl-C, `--resume` from what any layout
//! saved). The pipeline too: the builder stages the same parts (`model::stage`, the
//! decoder's `StagedModel` form) and `fit` runs them through burn-pipeline's executor, saving
//! under the single-device decoder's names, so every layout resumes what any other saved.

mod model;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use burn::tensor::Device;
use burn_parallel::ProcessGroup;
use burn_parallel::context_parallel::CpKind;
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::precision::{LossScaler, MixedPrecision};
use burn_parallel_train::{
    CheckpointPolicy, FitConfig, Layout, LrSchedule, MicroBatch, StepSettings, build, fit,
};
use burn_zero::Stage;
use clap::{Parser, ValueEnum};
use examples::data::{Corpus, Split};
use model::{Config, Recipe, moe_config};

/// Arithmetic of the forward and backward.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum Precision {
    /// Everything in fp32.
    F32,
    /// bf16 compute, gradients averaged in bf16, fp32 master weights and optimizer state.
    Bf16,
    /// fp16 compute with dynamic loss scaling, gradients averaged in fp32.
    Fp16,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum Preset {
    /// One device.
    Single,
    /// Data parallel over every rank.
    Ddp,
    /// Tensor parallel over every rank.
    Tp,
    /// Tensor + sequence parallel over every rank.
    TpSp,
    /// Data parallel x tensor + sequence parallel (tp = 2).
    DpTp,
    /// FSDP over every rank (each layer a unit).
    Fsdp,
    /// FSDP x tensor + sequence parallel (tp = 2).
    FsdpTp,
    /// HSDP: FSDP in pairs, replicated across pairs.
    Hsdp,
    /// Context parallel over every rank: each sequence split over them (`--cp-kind`).
    Cp,
    /// Data parallel x context parallel (cp = 2).
    DpCp,
    /// Context parallel (cp = 2) x tensor parallel (tp = 2).
    CpTp,
    /// Pipeline over every rank (1F1B over the `--grad-accum` micro-batches, 4 when not
    /// given), the model staged by `burn_pipeline::sequential` (see `model::stage`).
    Pp,
}

/// Train the bring-your-own-model decoder.
#[derive(Debug, Clone, Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "ddp")]
    layout: Preset,
    /// Thread ranks.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Global batch (sequences per step, split over the data-parallel ranks).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    seq: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Global-norm clipping.
    #[arg(long)]
    clip: Option<f64>,
    /// Micro-batches per optimizer step (each rank's rows split evenly between them; the
    /// pipeline's micro-batches with `--layout pp`, 4 by default there, 1 elsewhere).
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Arithmetic of the forward and backward (master weights and optimizer state stay fp32).
    #[arg(long, value_enum, default_value = "f32")]
    precision: Precision,
    /// ZeRO stage over the ranks that reduce gradients (1: optimizer state sharded, 2:
    /// gradients too); with every layout but the FSDP ones (stage 3 already) and `pp`.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    zero: Option<u8>,
    /// Save a checkpoint (parameters and optimizer state, each rank its share) into this
    /// directory after the last step; any layout resumes from it.
    #[arg(long)]
    save: Option<std::path::PathBuf>,
    /// Resume from the newest checkpoint under this directory (saved under any layout) and
    /// train on to `--steps`.
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Average the gradients during the backward (buckets reduced as their gradients become
    /// final) instead of after it; not with the FSDP layouts, mixed precision or accumulation.
    #[arg(long)]
    overlap: bool,
    /// FSDP layouts: all-gather the next layer while this one computes (one more gathered
    /// layer of memory).
    #[arg(long)]
    prefetch: bool,
    /// FSDP layouts with `--grad-accum`: keep each layer's whole gradient over the
    /// micro-batches and reduce-scatter it once per step (one layer-sized buffer each).
    #[arg(long)]
    no_sync: bool,
    /// How the context-parallel layouts attend across ranks: `ring` or `ulysses`.
    #[arg(long, default_value = "ring")]
    cp_kind: CpKind,
    /// The MoE variant: this many experts per layer in place of the MLP (0: dense), with
    /// `single` or `ddp` (and `--zero`, `--grad-accum`, `--save`/`--resume`).
    #[arg(long, default_value_t = 0)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Expert parallelism: the experts split over this many of the data-parallel ranks (which
    /// exchange tokens all-to-all).
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Run every layout in turn (on `--ranks`, one rank for `single`) and print each one's
    /// step time relative to single-device training.
    #[arg(long)]
    all: bool,
}

fn config() -> Config {
    Config {
        vocab: 256,
        d_model: 128,
        n_heads: 4,
        d_ff: 344,
        n_layers: 2,
        seed: 1,
    }
}

/// The library's layout of `args` on `n` ranks: the preset's mesh and the options.
fn layout(args: &Args, n: usize) -> Result<Layout, burn_parallel::Error> {
    let fsdp = (Some(Stage::Three), false);
    let plain = (
        args.zero
            .map(|z| Stage::from_number(z.into()))
            .transpose()?,
        true,
    );
    // (dp_replicate under FSDP, cp, tp, sequence parallel, pp, (ZeRO stage, --zero allowed))
    let (replicate, cp, tp, sp, pp, (zero, zero_allowed)) = match args.layout {
        Preset::Single | Preset::Ddp => (1, 1, 1, false, 1, plain),
        Preset::Tp => (1, 1, n, false, 1, plain),
        Preset::TpSp => (1, 1, n, true, 1, plain),
        Preset::DpTp => (1, 1, 2, true, 1, plain),
        Preset::Fsdp => (1, 1, 1, false, 1, fsdp),
        Preset::FsdpTp => (1, 1, 2, true, 1, fsdp),
        Preset::Hsdp => (n / 2, 1, 1, false, 1, fsdp),
        Preset::Cp => (1, n, 1, false, 1, plain),
        Preset::DpCp => (1, 2, 1, false, 1, plain),
        Preset::CpTp => (1, 2, n / 2, false, 1, plain),
        Preset::Pp => (1, 1, 1, false, n, plain),
    };
    if args.zero.is_some() && !zero_allowed {
        return Err(burn_parallel::Error::invalid(
            "--zero",
            "the FSDP layouts are ZeRO-3 already: drop --zero or pick another layout",
        ));
    }
    Ok(Layout {
        tp,
        sp,
        cp,
        pp,
        cp_kind: args.cp_kind,
        ep: if args.experts > 0 { args.ep } else { 1 },
        zero,
        replicate,
        prefetch: args.prefetch,
        no_sync: args.no_sync,
        overlap: args.overlap,
        ..Layout::default()
    })
}

/// The step's settings of `args`: AdamW with weight decay 0.01, `--clip`, `--precision` (fp16
/// with dynamic loss scaling from 2^16), the batch.
fn settings(args: &Args) -> StepSettings {
    let (precision, loss_scaler) = match args.precision {
        Precision::F32 => (MixedPrecision::full(), None),
        Precision::Bf16 => (MixedPrecision::bf16(), None),
        Precision::Fp16 => (MixedPrecision::f16(), Some(LossScaler::new(65536.0))),
    };
    StepSettings {
        precision,
        loss_scaler,
        max_grad_norm: args.clip,
        adamw: FusedAdamWConfig::new().with_weight_decay(0.01),
        batch_size: args.batch,
        seq_len: args.seq,
        grad_accum: match (args.grad_accum, args.layout) {
            (Some(n), _) => n,
            (None, Preset::Pp) => 4,
            (None, _) => 1,
        },
        ..StepSettings::default()
    }
}

fn run_rank(
    world: ProcessGroup,
    args: &Args,
    corpus: &Corpus,
    stop: &AtomicBool,
) -> Result<Vec<f32>, burn_parallel::Error> {
    let device = Device::flex().autodiff();
    let recipe = Recipe {
        config: config(),
        moe: (args.experts > 0).then(|| moe_config(&config(), args.experts, args.top_k)),
    };
    // The library builds the model and its engine for the layout: the step with AdamW, ZeRO-1/2,
    // FSDP, and burn-moe's engines around them for the MoE variant. One loop for all, and one
    // checkpoint format: each layout resumes what another saved.
    let built = build(
        &world,
        &layout(args, world.size())?,
        &recipe,
        &device,
        &settings(args),
    )?;
    // The library's loop: each data-parallel rank its rows of every micro-batch; `--save`
    // after the last step or on Ctrl-C, `--resume` from the newest checkpoint (any layout's).
    let config = FitConfig {
        steps: args.steps,
        lr: LrSchedule::constant(args.lr),
        checkpoint: args.save.as_ref().map(|dir| CheckpointPolicy {
            keep: 1,
            ..CheckpointPolicy::new(dir)
        }),
        resume: args.resume.clone(),
        check_replicas_every: 100,
    };
    let mut batch = |micro: &MicroBatch| {
        let (step, rows) = (micro.step as u64, micro.rows.clone());
        Ok(corpus.batch_rows(step, rows, args.seq, Split::Train))
    };
    let fitted = fit(built, &config, &mut batch, &mut |_, _| Ok(()), Some(stop))?;
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

/// Trains under `args.layout`; prints the loss curve's ends and returns seconds per step.
fn run(args: &Args, corpus: &Corpus, stop: &AtomicBool) -> f64 {
    let ranks = match args.layout {
        Preset::Single => 1,
        // A stage holds at least one layer (`--all` on more ranks than layers).
        Preset::Pp if args.all => args.ranks.min(config().n_layers),
        _ => args.ranks,
    };
    let start = Instant::now();
    let losses = burn_parallel_train::run_local(ranks, |world| run_rank(world, args, corpus, stop))
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(1);
        });
    let curve = &losses[0];
    let per_step = start.elapsed().as_secs_f64() / curve.len().max(1) as f64;
    let zero = args
        .zero
        .map(|n| format!(" + ZeRO-{n}"))
        .unwrap_or_default();
    match (curve.first(), curve.last()) {
        (Some(first), Some(last)) => println!(
            "layout {:?}{zero} on {ranks} rank(s): loss {first:.4} -> {last:.4} over {} steps, \
             {per_step:.3} s/step",
            args.layout,
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
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(e) = signal_hook::flag::register(signal, Arc::clone(&stop)) {
            eprintln!("warning: cannot catch signal {signal} ({e}); Ctrl-C stops without saving");
        }
    }
    if !args.all {
        run(&args, &corpus, &stop);
        return;
    }
    let mut times = Vec::new();
    for layout in Preset::value_variants() {
        let args = Args {
            layout: *layout,
            ..args.clone()
        };
        times.push((*layout, run(&args, &corpus, &stop)));
    }
    let single = times[0].1;
    println!("\nstep time relative to one device ({} ranks):", args.ranks);
    for (layout, t) in times {
        let name = format!("{layout:?}");
        println!("{name:<8} {t:>8.3} s/step  {:>5.2}x", t / single);
    }
}
