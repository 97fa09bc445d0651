//! DiLoCo against DDP on the bundled corpus, at the same token budget: the validation loss of
//! each and the bytes each rank sends (counted on the wire by
//! `burn_parallel::diloco::count_sent_bytes`). Prints a table and writes
//! `<target>/diloco_figures.json` (`$CARGO_TARGET_DIR`, else the workspace's `target/`).
//!
//! Measured on a 2-core CPU (2 islands of 1 rank, 600 steps, outer lr 0.7, Nesterov momentum
//! 0.5): DDP validation loss 1.803 with 1.13 GB sent per rank; DiLoCo H = 50 1.858 (+3.0%)
//! with 22.6 MB (50x fewer), int8 1.853 with 5.7 MB; streaming (5 fragments) 1.828 (+1.4%).
//! With the paper's momentum 0.9 the 12 outer steps overshoot (2.078).
//!
//! ```text
//! cargo run --release -p examples --example diloco_figures -- --outer-momentum 0.5 \
//!     --inner-steps 50,10,100 --fragments 5                                # the figures above
//! cargo run --release -p examples --example diloco_figures                  # 600 steps, H = 50
//! cargo run --release -p examples --example diloco_figures -- --inner-steps 50,10,100 --fragments 5
//! ```

use std::process::ExitCode;

use burn_parallel::diloco::{Compression, DiLoCoConfig, count_sent_bytes};
use burn_parallel::run_local;
use burn_parallel_train::DiLoCoLayout;
use clap::Parser;
use examples::data::Corpus;
use examples::train::{Parallelism, TrainConfig, train_gpt};
use examples::train_diloco::train_gpt_diloco;

/// DiLoCo vs DDP: validation loss and bytes sent at the same token budget.
#[derive(Debug, Parser)]
struct Args {
    /// Thread ranks; DiLoCo runs them as this many islands of one rank.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer steps (the token budget: steps x the global batch of 32 x 64 tokens).
    #[arg(long, default_value_t = 600)]
    steps: usize,
    /// DiLoCo's H: the first runs with f32, int8 (and streaming) pseudo-gradients, the others
    /// (comma-separated) with f32 only, for the loss-against-bytes curve.
    #[arg(long, value_delimiter = ',', default_value = "50")]
    inner_steps: Vec<usize>,
    /// Learning rate of the outer SGD.
    #[arg(long, default_value_t = 0.7)]
    outer_lr: f64,
    /// Momentum (Nesterov) of the outer SGD.
    #[arg(long, default_value_t = 0.9)]
    outer_momentum: f64,
    /// Streaming DiLoCo's fragments, for one extra run (1: no extra run).
    #[arg(long, default_value_t = 1)]
    fragments: usize,
}

/// One row of the table.
#[derive(Debug, serde::Serialize)]
struct Row {
    run: String,
    val_loss: f64,
    final_train_loss: f64,
    /// Bytes rank 0 sent in all.
    bytes_sent: u64,
    /// Bytes rank 0 sent in outer syncs (DiLoCo only).
    outer_bytes: Option<u64>,
    seconds: f64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let corpus = match Corpus::load_default() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let config = TrainConfig {
        steps: args.steps,
        sample_len: 0,
        ..TrainConfig::default()
    };
    let tokens = config.steps * config.batch_size * config.seq_len;
    println!(
        "GPT {:.2}M params, {} ranks, {} steps x {} x {} tokens = {tokens} tokens",
        config.model.num_params() as f64 / 1e6,
        args.ranks,
        config.steps,
        config.batch_size,
        config.seq_len
    );
    let mut rows = Vec::new();

    // DDP: every step all-reduces the gradients.
    let start = std::time::Instant::now();
    let ddp = burn_parallel_train::run_local(args.ranks, |world| {
        let (world, counter) = count_sent_bytes(&world)?;
        let report = train_gpt(
            &world,
            &config,
            &Parallelism::default(),
            &corpus,
            &mut |_| {},
        )?;
        Ok((report, counter.sent()))
    });
    match ddp {
        Ok(mut r) => {
            let (report, bytes) = r.swap_remove(0);
            rows.push(Row {
                run: "DDP".into(),
                val_loss: report.val_loss,
                final_train_loss: *report.losses.last().unwrap_or(&f64::NAN),
                bytes_sent: bytes,
                outer_bytes: None,
                seconds: start.elapsed().as_secs_f64(),
            });
            print_row(rows.last().expect("pushed"), None);
        }
        Err(e) => {
            eprintln!("error: DDP: {e}");
            return ExitCode::FAILURE;
        }
    }

    let Some(&first_h) = args.inner_steps.first() else {
        eprintln!("error: give at least one --inner-steps");
        return ExitCode::from(2);
    };
    let mut runs = vec![
        ("DiLoCo f32", Compression::F32, 1, first_h),
        ("DiLoCo int8", Compression::INT8, 1, first_h),
    ];
    if args.fragments > 1 {
        runs.push(("DiLoCo f32", Compression::F32, args.fragments, first_h));
    }
    for &h in &args.inner_steps[1..] {
        runs.push(("DiLoCo f32", Compression::F32, 1, h));
    }
    for (name, compression, fragments, inner_steps) in runs {
        let run = DiLoCoLayout {
            islands: args.ranks,
            config: DiLoCoConfig {
                inner_steps,
                compression,
                fragments,
                outer_lr: args.outer_lr,
                outer_momentum: args.outer_momentum,
                ..DiLoCoConfig::default()
            },
            inner_sgd: false,
        };
        let name = format!("{name} H={inner_steps} F={fragments}");
        let start = std::time::Instant::now();
        let outcome = run_local(args.ranks, |world| {
            train_gpt_diloco(&world, &config, &run, &corpus, &mut |_| {}).map_err(|e| {
                burn_parallel::CollectiveError::InvalidArgument {
                    rank: world.global_rank(),
                    op: "diloco_figures".into(),
                    reason: e.to_string(),
                }
            })
        });
        match outcome {
            Ok(mut r) => {
                let r = r.swap_remove(0);
                rows.push(Row {
                    run: name,
                    val_loss: r.train.val_loss,
                    final_train_loss: *r.train.losses.last().unwrap_or(&f64::NAN),
                    bytes_sent: r.figures.total_bytes,
                    outer_bytes: Some(r.figures.outer_bytes),
                    seconds: start.elapsed().as_secs_f64(),
                });
                print_row(rows.last().expect("pushed"), Some(&rows[0]));
            }
            Err(e) => {
                eprintln!("error: {name}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let json = serde_json::json!({ "ranks": args.ranks, "steps": args.steps,
        "inner_steps": args.inner_steps, "tokens": tokens, "rows": rows });
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = dir.join("diloco_figures.json");
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")))
    {
        eprintln!("error: writing {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    println!("written to {}", path.display());
    ExitCode::SUCCESS
}

fn print_row(row: &Row, ddp: Option<&Row>) {
    let versus = match ddp {
        Some(d) => format!(
            "  (val loss {:+.2}% vs DDP, {:.1}x fewer bytes)",
            100.0 * (row.val_loss - d.val_loss) / d.val_loss,
            d.bytes_sent as f64 / row.bytes_sent.max(1) as f64
        ),
        None => String::new(),
    };
    let outer = row
        .outer_bytes
        .map_or(String::new(), |b| format!(" ({b} in outer syncs)"));
    println!(
        "{:<28} val loss {:.4}  train loss {:.4}  rank 0 sent {} bytes{outer}  {:.0} s{versus}",
        row.run, row.val_loss, row.final_train_loss, row.bytes_sent, row.seconds
    );
}
