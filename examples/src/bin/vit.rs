//! Trains the reference ViT on the bundled 8x8 digits and reports its test accuracy.
//!
//! ```text
//! cargo run --release -p examples --bin vit                          # 2 thread ranks, DDP
//! cargo run --release -p examples --bin vit -- --ranks 1             # single device
//! vit --ranks 2 --tp 2 --sp                                          # tensor + sequence parallel
//! vit --ranks 4 --tp 2 --clip 1.0                                    # dp 2 x tp 2, clipping
//! vit --ranks 2 --zero 2                                             # ZeRO-2 over 2 ranks
//! vit --ranks 2 --precision bf16                                     # bf16, fp32 master weights
//! vit --eval-every 100                                               # test accuracy on the way
//! vit --ranks 2 --pp 2 --grad-accum 4                                # pipeline, 1F1B
//! vit --ranks 4 --pp 2 --schedule zbv --grad-accum 2 --checkpoint-blocks --layers 4
//! ```

use std::process::ExitCode;

use burn_parallel_train::Layout;
use burn_parallel_train::cli::{LayoutArgs, MetricsArgs, StepArgs};
use clap::Parser;
use examples::cli::print_error;
use examples::data::Digits;
use examples::train_vit::{VitReport, VitStepStats, VitTrainConfig, run_vit_local};

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
    /// The step: --precision f32|bf16|fp16, --clip, --grad-accum (the pipeline's
    /// micro-batches with --pp).
    #[command(flatten)]
    step: StepArgs,
    /// The layout: --tp, --sp, --zero (1 or 2), --pp with --schedule, --virtual-stages and
    /// --checkpoint-blocks; what the ViT does not support is refused by name.
    #[command(flatten)]
    layout: LayoutArgs,
    /// --metrics FILE (per-step figures and test accuracies, JSON lines), --plot FILE (SVG).
    #[command(flatten)]
    metrics: MetricsArgs,
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
    c.max_grad_norm = args.step.clip;
    c.precision = args.step.precision;
    c.eval_every = args.eval_every;
    c.grad_accum = args.step.grad_accum;
    c.warmup_steps = c.warmup_steps.min(c.steps / 10);
    c
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = config_from(&args);
    let Ok(layout) = args.layout.layout().map_err(print_error) else {
        return ExitCode::from(2);
    };
    let Ok(digits) = Digits::load_from(args.data_dir.as_deref()).map_err(print_error) else {
        return ExitCode::from(2);
    };
    print_header(&config, &layout, args.ranks, &digits);
    let progress = args.metrics.progress(true, config.steps, args.log_every);
    let Ok(progress) = progress.map_err(print_error) else {
        return ExitCode::from(2);
    };
    let progress = progress.with_unit("img");
    let mut on_step = |s: &VitStepStats| {
        let step = s.log.step;
        let accuracy = s
            .test_accuracy
            .map(|acc| format!("step {step:>5}  test accuracy {:.2} %", 100.0 * acc));
        progress.step(&s.log, accuracy.as_slice());
        if let Some(accuracy) = s.test_accuracy {
            progress.eval(step, "test_accuracy", accuracy);
        }
    };
    let outcome = run_vit_local(args.ranks, &config, &layout, &digits, &mut on_step);
    progress.finish();
    let outcome = outcome.and_then(|report| {
        print_report(&report);
        progress.conclude(&[("test_accuracy", report.test_accuracy)])
    });
    match outcome.map_err(print_error) {
        Ok(()) => ExitCode::SUCCESS,
        Err(()) => ExitCode::FAILURE,
    }
}

fn print_header(config: &VitTrainConfig, layout: &Layout, ranks: usize, digits: &Digits) {
    let m = &config.model;
    let shape = layout.describe(ranks);
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

fn print_report(report: &VitReport) {
    // The throughput of the steps after the first (a warm-up): none for a run of one step.
    let rate = match report.images_per_sec {
        r if r > 0.0 => format!(" ({r:.0} img/s)"),
        _ => String::new(),
    };
    println!(
        "final train loss {:.4}; {:.1} s of training{rate}",
        report.losses.last().copied().unwrap_or(f64::NAN),
        report.train_seconds,
    );
    println!(
        "test accuracy {:.2} % ({} / {} held-out images)",
        100.0 * report.test_accuracy,
        report.test_correct,
        report.test_images
    );
}
