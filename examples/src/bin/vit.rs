//! Trains the reference ViT on the bundled 8x8 digits and reports its test accuracy.
//!
//! ```text
//! cargo run --release -p examples --bin vit                          # 2 thread ranks, DDP
//! cargo run --release -p examples --bin vit -- --ranks 1             # single device
//! vit --ranks 2 --tp 2 --sp                                          # tensor + sequence parallel
//! vit --ranks 4 --tp 2 --clip 1.0                                    # dp 2 x tp 2, clipping
//! vit --ranks 2 --zero 2                                             # ZeRO-2 over 2 ranks
//! vit --eval-every 100                                               # test accuracy on the way
//! ```

use std::process::ExitCode;

use burn_zero::Stage;
use clap::Parser;
use examples::data::Digits;
use examples::train_vit::{
    VitLayout, VitReport, VitStepStats, VitTrainConfig, run_local_ranks, run_vit_local,
};
use examples::vit_pipeline::{VitPipeline, train_vit_pipeline};
use indicatif::{ProgressBar, ProgressStyle};

/// Train a Vision Transformer on the 8x8 hand-written digits and print its test accuracy.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Folder of the data files (`digits.csv.gz`), for a binary run away from its source tree;
    /// default: $BURN_PARALLEL_DATA_DIR, else the bundled examples/data.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<std::path::PathBuf>,
    /// Thread ranks.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Global batch, in images per optimizer step (split over the data-parallel ranks).
    #[arg(long)]
    batch: Option<usize>,
    /// Peak learning rate (linear warm-up, then cosine decay to 10 %).
    #[arg(long)]
    lr: Option<f64>,
    /// Tensor-parallel size: each model is split over this many ranks (Megatron-style); the
    /// ranks form a `dp x tp` mesh with `dp = ranks / tp`.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequence parallelism inside each tensor-parallel group (needs --tp 2 or more).
    #[arg(long)]
    sp: bool,
    /// Clip the global norm of the averaged gradient to this value.
    #[arg(long)]
    clip: Option<f64>,
    /// ZeRO stage (1: optimizer state sharded, 2: + gradients) over the data-parallel ranks,
    /// instead of plain DDP.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    zero: Option<u8>,
    /// Seed of the weights and of the batch order (the train/test split stays fixed).
    #[arg(long)]
    seed: Option<u64>,
    /// Measure the test accuracy every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    eval_every: usize,
    /// Print a line every N steps (the progress bar shows every step).
    #[arg(long, default_value_t = 50)]
    log_every: usize,
    /// Transformer layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Model width (the MLP is twice as wide).
    #[arg(long)]
    d_model: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Side of the square patches (divides 8).
    #[arg(long)]
    patch: Option<usize>,
    /// AdamW weight decay.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Pipeline-parallel size: the encoder blocks are split into stages over this many ranks
    /// (mesh `pp x dp`); 1: no pipeline.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// The pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zbv or dualpipev.
    #[arg(long, default_value = "1f1b")]
    schedule: burn_pipeline::ScheduleKind,
    /// Micro-batches per step and data-parallel rank.
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Stages per rank of the interleaved schedule.
    #[arg(long)]
    virtual_stages: Option<usize>,
    /// Recompute every block in the backward (pipeline only).
    #[arg(long)]
    checkpoint_blocks: bool,
}

fn config_from(args: &Args) -> VitTrainConfig {
    let mut c = VitTrainConfig::default();
    macro_rules! set {
        ($field:expr, $value:expr) => {
            if let Some(v) = $value {
                $field = v;
            }
        };
    }
    set!(c.steps, args.steps);
    set!(c.batch_size, args.batch);
    set!(c.lr, args.lr);
    set!(c.model.n_layers, args.layers);
    set!(c.model.n_heads, args.heads);
    set!(c.model.patch_size, args.patch);
    set!(c.weight_decay, args.weight_decay);
    if let Some(d) = args.d_model {
        c.model.d_model = d;
        c.model.d_ff = 2 * d;
    }
    if let Some(seed) = args.seed {
        c.model.seed = seed;
        c.data_seed = seed;
    }
    c.max_grad_norm = args.clip;
    c.eval_every = args.eval_every;
    c.warmup_steps = c.warmup_steps.min(c.steps / 10);
    c
}

fn layout_from(args: &Args) -> VitLayout {
    VitLayout {
        tp: args.tp,
        sp: args.sp,
        zero: args.zero.map(|z| match z {
            1 => Stage::One,
            _ => Stage::Two,
        }),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = config_from(&args);
    let layout = layout_from(&args);
    if args.pp > 1 && (args.tp > 1 || args.sp || args.zero.is_some()) {
        eprintln!(
            "error: --tp, --sp and --zero are not composed with the ViT's pipeline (--pp) yet; \
             use --pp with data parallelism (--ranks)"
        );
        return ExitCode::from(2);
    }
    if let Err(e) = layout.validate(&config, args.ranks / args.pp.max(1)) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let digits = match Digits::load_from(args.data_dir.as_deref()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    print_header(&config, &layout, args.ranks, &digits);
    if args.pp > 1 {
        println!(
            "pipeline: pp {} x dp {}, schedule {} ({} micro-batches{})",
            args.pp,
            args.ranks / args.pp,
            args.schedule,
            args.microbatches,
            if args.checkpoint_blocks {
                ", blocks recomputed"
            } else {
                ""
            }
        );
    }

    let bar = ProgressBar::new(config.steps as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("a valid template"),
    );
    let log_every = args.log_every.max(1);
    let steps = config.steps;
    let mut on_step = |s: &VitStepStats| {
        bar.set_message(format!("loss {:.4}  {:.0} img/s", s.loss, s.images_per_sec));
        bar.inc(1);
        let mut line = None;
        if s.step.is_multiple_of(log_every) || s.step + 1 == steps {
            line = Some(format!(
                "step {:>5}  loss {:.4}  lr {:.2e}{}  {:>6.0} img/s  {:>6.1}s",
                s.step,
                s.loss,
                s.lr,
                s.grad_norm
                    .map(|n| format!("  |g| {n:.3}"))
                    .unwrap_or_default(),
                s.images_per_sec,
                s.elapsed
            ));
        }
        if let Some(acc) = s.test_accuracy {
            line = Some(format!(
                "{}step {:>5}  test accuracy {:.2} %",
                line.map(|l| l + "\n").unwrap_or_default(),
                s.step,
                100.0 * acc
            ));
        }
        if let Some(line) = line {
            // A bar drawn nowhere (output not a terminal) would swallow the line.
            if bar.is_hidden() {
                println!("{line}");
            } else {
                bar.println(line);
            }
        }
    };
    let outcome = if args.pp > 1 {
        let pipeline = VitPipeline {
            pp: args.pp,
            schedule: args.schedule,
            microbatches: args.microbatches,
            virtual_stages: args.virtual_stages,
            checkpoint_blocks: args.checkpoint_blocks,
        };
        run_local_ranks(args.ranks, &mut on_step, &|world, report| {
            train_vit_pipeline(world, &config, &pipeline, &digits, report)
        })
    } else {
        run_vit_local(args.ranks, &config, &layout, &digits, &mut on_step)
    };
    bar.finish_and_clear();
    match outcome {
        Ok(report) => {
            print_report(&report, &config);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_header(config: &VitTrainConfig, layout: &VitLayout, ranks: usize, digits: &Digits) {
    let m = &config.model;
    let tp = layout.tp_size();
    let mut shape = format!("dp {}", ranks / tp);
    if tp > 1 {
        shape += &format!(" x tp {tp}");
    }
    if layout.sp {
        shape += " + sequence parallel";
    }
    if let Some(stage) = layout.zero {
        shape += &format!(", ZeRO-{}", stage.number());
    }
    println!(
        "ViT {} layers x {} heads x width {} ({:.1}k params), {} patches of {}x{}, {ranks} \
         thread ranks = {shape}",
        m.n_layers,
        m.n_heads,
        m.d_model,
        m.num_params() as f64 / 1e3,
        m.n_patches(),
        m.patch_size,
        m.patch_size
    );
    let n_test = (digits.len() as f64 * config.test_fraction).round() as usize;
    println!(
        "digits: {} training / {} test images; global batch {}, {} steps, lr {:.1e}{}",
        digits.len() - n_test,
        n_test,
        config.batch_size,
        config.steps,
        config.lr,
        config
            .max_grad_norm
            .map(|c| format!(", clip {c}"))
            .unwrap_or_default()
    );
}

fn print_report(report: &VitReport, config: &VitTrainConfig) {
    println!(
        "final train loss {:.4}; {:.1} s of training ({:.0} img/s)",
        report.losses.last().copied().unwrap_or(f64::NAN),
        report.train_seconds,
        (config.batch_size * config.steps) as f64 / report.train_seconds.max(1e-9)
    );
    println!(
        "test accuracy {:.2} % ({} / {} held-out images)",
        100.0 * report.test_accuracy,
        report.test_correct,
        report.test_images
    );
}
