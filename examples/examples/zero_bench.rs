//! ZeRO benchmark (issue 3): two measurements, printed as tables and written to
//! `<target>/zero_bench.json` (`$CARGO_TARGET_DIR`, else the workspace's `target/`).
//!
//! 1. **Step time at N=2**: the same GPT and global batch trained with plain DDP
//!    (`examples::train::train_gpt`), with ZeRO stages 1 and 2 (`burn-zero`'s `ZeroOptimizer`)
//!    and stage 3 (FSDP), all in the layout-generic trainer (`examples::train`, as
//!    `gpt --zero N`), ranks as threads on the `flex` CPU backend; mean
//!    seconds per step (first step excluded) and the ratio to DDP, all from one run of this
//!    program (the machine is noisy: compare ratios, not absolute times across runs).
//! 2. **Largest width under a memory cap at N=4**: for DDP and each stage, the widest GPT
//!    (`d_model` in steps of 32, `d_ff = 4 d_model`, fixed depth) whose per-rank model-state
//!    peak, *as measured by the burn-zero memory accounting*
//!    ([`burn_zero::MemoryReport::model_state_peak`]: parameters + gradients + AdamW state +
//!    gathered units, the maximum over ranks, over a real training step), stays under the cap.
//!    DDP is measured the same way as burn-zero with no sharding: a `dp_replicate = 4` x
//!    `dp_shard = 1` mesh, where every rank keeps full parameters, gradients and optimizer state
//!    and gradients are averaged across the replicas (16 bytes per parameter, plain DDP's
//!    footprint). Each probe trains 2 steps; the search walks widths upward and stops at the
//!    first one over the cap.
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target cargo run --release -p examples --example zero_bench
//! CARGO_TARGET_DIR=/work/target cargo run --release -p examples --example zero_bench -- --quick
//! ... --example zero_bench -- --cap-mib 16 --layers 4
//! ```

use std::path::PathBuf;

use burn_parallel::Error;
use burn_parallel_train::run_local;
use burn_zero::memory::CountingAllocator;
use burn_zero::{MemoryReport, Stage};
use examples::data::Corpus;
use examples::gpt::GptConfig;
use examples::train::{Parallelism, TrainConfig, train_gpt};
use serde_json::json;

/// Counts every allocation of the process: the measured memory column.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// Runs `f` and returns its result with the per-rank peak of the bytes allocated while it ran
/// (process peak above the start, divided by `ranks`).
fn measured<T>(ranks: usize, f: impl FnOnce() -> T) -> (T, usize) {
    let start = ALLOC.reset_peak();
    let out = f();
    (out, (ALLOC.peak() - start) / ranks)
}

/// Which data-parallel layout a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Ddp,
    Zero(Stage),
}

impl Layout {
    fn name(self) -> String {
        match self {
            Layout::Ddp => "ddp".into(),
            Layout::Zero(s) => format!("zero{}", s.number()),
        }
    }
}

const ALL: [Layout; 4] = [
    Layout::Ddp,
    Layout::Zero(Stage::One),
    Layout::Zero(Stage::Two),
    Layout::Zero(Stage::Three),
];

struct Args {
    quick: bool,
    cap_mib: f64,
    layers: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        quick: false,
        cap_mib: 8.0,
        layers: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value"))
                .and_then(|v| v.parse::<f64>().map_err(|e| format!("{name} {v}: {e}")))
        };
        match a.as_str() {
            "--quick" => args.quick = true,
            "--cap-mib" => args.cap_mib = value("--cap-mib")?,
            "--layers" => args.layers = value("--layers")? as usize,
            other => {
                return Err(format!(
                    "unknown argument {other}; use --quick, --cap-mib MIB, --layers N"
                ));
            }
        }
    }
    if args.cap_mib.is_nan() || args.cap_mib <= 0.0 || args.layers == 0 {
        return Err("--cap-mib must be positive and --layers at least 1".into());
    }
    Ok(args)
}

fn train_config(model: GptConfig, steps: usize, batch_size: usize, seq_len: usize) -> TrainConfig {
    TrainConfig {
        model,
        steps,
        batch_size,
        seq_len,
        grad_accum: 1,
        lr: 1e-3,
        warmup_steps: 0,
        weight_decay: 0.01,
        bucket_mb: 25.0,
        eval_batches: 1,
        sample_len: 0,
        prompt: String::new(),
        ..TrainConfig::default()
    }
}

fn gpt(layers: usize, heads: usize, width: usize, max_seq: usize) -> GptConfig {
    let mut model = GptConfig::new(256, layers, heads, width, max_seq);
    model.d_ff = 4 * width;
    model.seed = 7;
    model
}

/// What the benchmark reads of a rank's run.
struct Measured {
    losses: Vec<f64>,
    step_seconds: f64,
    memory: MemoryReport,
}

/// Trains `layout` on `ranks` thread ranks in the layout-generic trainer (as `gpt --zero N`);
/// returns every rank's figures.
fn run_zero(
    layout: Layout,
    ranks: usize,
    config: &TrainConfig,
    corpus: &Corpus,
) -> Result<Vec<Measured>, Error> {
    // DDP's footprint: ZeRO-1 over shard groups of one rank (no sharding), replicated across
    // every rank, measured by the same accounting.
    let (zero, replicate) = match layout {
        Layout::Ddp => (Stage::One, ranks),
        Layout::Zero(stage) => (stage, 1),
    };
    let parallel = Parallelism {
        zero: Some(zero),
        replicate,
        ..Parallelism::default()
    };
    run_local(ranks, |world| {
        let r = train_gpt(&world, config, &parallel, corpus, &mut |_| {})?;
        Ok(Measured {
            losses: r.losses,
            step_seconds: r.step_seconds,
            memory: r
                .memory
                .ok_or_else(|| invalid("ZeRO reported no memory".into()))?,
        })
    })
}

fn invalid(reason: String) -> Error {
    Error::invalid("zero_bench", reason)
}

fn step_times(args: &Args, corpus: &Corpus) -> Result<serde_json::Value, Error> {
    let (width, layers, steps, batch, seq) = if args.quick {
        (64, 2, 4, 8, 32)
    } else {
        (128, 4, 8, 16, 64)
    };
    let config = train_config(gpt(layers, 4, width, seq), steps, batch, seq);
    println!(
        "\n## Step time at N=2 ({} params, {layers} layers x d_model {width}, batch {batch} x \
         {seq} tokens, {steps} steps, flex CPU, ranks as threads)\n",
        config.model.num_params()
    );
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let (ddp, ddp_peak) = measured(2, || {
        run_local(2, |g| {
            train_gpt(&g, &config, &Default::default(), corpus, &mut |_| {})
        })
    });
    let ddp = ddp?[0].step_seconds;
    println!("| layout | s/step | vs DDP | measured peak/rank (MiB) |\n|---|---|---|---|");
    println!(
        "| DDP (examples::train) | {ddp:.4} | 1.00x | {:.2} |",
        mib(ddp_peak)
    );
    let mut rows = vec![json!({
        "layout": "ddp",
        "step_seconds": ddp,
        "ratio": 1.0,
        "measured_peak_bytes_per_rank": ddp_peak,
    })];
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        let (reports, peak) = measured(2, || run_zero(Layout::Zero(stage), 2, &config, corpus));
        let r = &reports?[0];
        let ratio = r.step_seconds / ddp;
        println!(
            "| ZeRO-{} | {:.4} | {ratio:.2}x | {:.2} |",
            stage.number(),
            r.step_seconds,
            mib(peak)
        );
        rows.push(json!({
            "layout": Layout::Zero(stage).name(),
            "step_seconds": r.step_seconds,
            "ratio": ratio,
            "memory": r.memory,
            "measured_peak_bytes_per_rank": peak,
        }));
    }
    Ok(json!({
        "ranks": 2,
        "params": config.model.num_params(),
        "layers": layers,
        "d_model": width,
        "batch_size": batch,
        "seq_len": seq,
        "steps": steps,
        "rows": rows,
    }))
}

fn largest_width(args: &Args, corpus: &Corpus) -> Result<serde_json::Value, Error> {
    const RANKS: usize = 4;
    const STEP: usize = 32;
    let cap = (args.cap_mib * 1024.0 * 1024.0) as usize;
    let max_width = if args.quick { 256 } else { 1024 };
    let (batch, seq) = (RANKS, 16);
    println!(
        "\n## Largest width under a per-rank cap of {} MiB at N={RANKS} ({} layers, d_ff = 4 \
         d_model, vocab 256; model-state peak from the burn-zero accounting, max over ranks)\n",
        args.cap_mib, args.layers
    );
    println!("| layout | largest d_model | params | per-rank peak (MiB) | next width (MiB) |");
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    for layout in ALL {
        let mut best: Option<(usize, usize, usize)> = None;
        let mut over: Option<(usize, usize)> = None;
        let mut width = STEP;
        while width <= max_width {
            let config = train_config(gpt(args.layers, 4, width, seq), 2, batch, seq);
            let reports = run_zero(layout, RANKS, &config, corpus)?;
            let peak = reports
                .iter()
                .map(|r| r.memory.model_state_peak())
                .max()
                .unwrap_or(0);
            if !reports[0].losses.iter().all(|l| l.is_finite()) {
                return Err(invalid(format!(
                    "{} at width {width} diverged",
                    layout.name()
                )));
            }
            if peak > cap {
                over = Some((width, peak));
                break;
            }
            best = Some((width, config.model.num_params(), peak));
            width += STEP;
        }
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        let label = match layout {
            Layout::Ddp => "DDP".to_string(),
            Layout::Zero(s) => format!("ZeRO-{}", s.number()),
        };
        match best {
            Some((w, p, peak)) => println!(
                "| {label} | {w} | {p} | {:.2} | {} |",
                mib(peak),
                over.map_or("(search limit)".into(), |(w, b)| format!(
                    "{w}: {:.2}",
                    mib(b)
                ))
            ),
            None => println!("| {label} | none fits | | | |"),
        }
        rows.push(json!({
            "layout": layout.name(),
            "largest_d_model": best.map(|b| b.0),
            "params": best.map(|b| b.1),
            "peak_bytes": best.map(|b| b.2),
            "first_over": over.map(|(w, b)| json!({ "d_model": w, "peak_bytes": b })),
        }));
    }
    Ok(json!({
        "ranks": RANKS,
        "cap_bytes": cap,
        "layers": args.layers,
        "width_step": STEP,
        "rows": rows,
    }))
}

fn output_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("zero_bench.json")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let corpus = Corpus::load_default()?;
    let step = step_times(&args, &corpus)?;
    let memory = largest_width(&args, &corpus)?;
    let out = output_path();
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&json!({ "step_time_n2": step, "memory_cap_n4": memory }))?,
    )?;
    println!("\nwritten to {}", out.display());
    Ok(())
}
