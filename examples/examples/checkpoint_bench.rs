//! Distributed checkpoint figures, in one run:
//! 1. save and load throughput (MB/s) of `burn_parallel::checkpoint` against the raw disk write
//!    speed (the same bytes written and fsynced by plain `std::fs` from the same ranks);
//! 2. the training stall of synchronous against asynchronous saves in the GPT trainer.
//!
//! ```text
//! cargo run -p examples --example checkpoint_bench                   # 256 MB, GPT d 384 x 4
//! cargo run -p examples --example checkpoint_bench -- --mb 64 --quick
//! ```
//!
//! Loads read what the saves just wrote, so they come from the page cache unless the machine
//! is short of memory: they measure the library's reading (range reads, checksums, copies),
//! not the disk.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::TensorData;
use burn_parallel::checkpoint::{Checkpointer, Piece, Region};
use burn_parallel::run_local;
use burn_parallel_train::CheckpointPolicy;
use examples::data::Corpus;
use examples::train::{Parallelism, TrainConfig, train_gpt};

const RANKS: usize = 2;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Seconds of `f`.
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}

/// Raw disk: every rank writes and fsyncs `bytes` bytes to its own file, concurrently.
fn raw_write(dir: &Path, bytes: usize) -> f64 {
    let (_, secs) = timed(|| {
        run_local(RANKS, |g| {
            let path = dir.join(format!("raw-{}.bin", g.rank()));
            let data = vec![g.rank() as u8 + 1; bytes];
            let mut f = std::fs::File::create(&path).expect("a raw file");
            f.write_all(&data).expect("raw write");
            f.sync_all().expect("fsync");
            g.barrier()?;
            Ok(())
        })
        .expect("raw write")
    });
    secs
}

fn io_figures(root: &Path, mb: usize) {
    // Four tensors, together `mb` MB of f32; each rank holds half of each (a tp-2 cut of
    // columns), so a one-device load reads from both files.
    let elements = mb * (1 << 20) / 4;
    let shapes: Vec<[usize; 2]> = (0..4).map(|_| [elements / 4 / 1024, 1024]).collect();
    let per_rank = elements / RANKS * 4;
    let raw = raw_write(root, per_rank);
    let ckpt_root = root.join("ckpt");
    let (_, save) = timed(|| {
        run_local(RANKS, |g| {
            let pieces: Vec<Piece> = shapes
                .iter()
                .enumerate()
                .map(|(i, shape)| {
                    let region = Region::full(shape).chunk(1, RANKS, g.rank()).unwrap();
                    let values: Vec<f32> = (0..region.numel()).map(|k| k as f32).collect();
                    let n = values.len();
                    Piece::new(format!("t{i}"), region, TensorData::new(values, [n])).unwrap()
                })
                .collect();
            g.barrier()?;
            let mut saver = Checkpointer::new(&ckpt_root, 1, &g).unwrap();
            saver
                .save(1, pieces, serde_json::Value::Null, serde_json::Value::Null)
                .unwrap();
            Ok(())
        })
        .expect("save")
    });
    let ckpt = Checkpointer::latest(&ckpt_root).unwrap().unwrap();
    let ((), load_one) = timed(|| {
        for i in 0..shapes.len() {
            ckpt.read_full(&format!("t{i}")).unwrap();
        }
    });
    // Another layout: tp 2 by rows instead of columns, two ranks reading concurrently.
    let (_, load_two) = timed(|| {
        run_local(RANKS, |g| {
            let ckpt = burn_parallel::checkpoint::Checkpoint::open(ckpt.dir()).unwrap();
            for (i, shape) in shapes.iter().enumerate() {
                let rows = Region::full(shape).chunk(0, RANKS, g.rank()).unwrap();
                ckpt.read(&format!("t{i}"), &rows).unwrap();
            }
            Ok(())
        })
        .expect("load")
    });
    let mb = (elements * 4) as f64 / 1e6;
    println!("checkpoint of {mb:.0} MB (4 tensors, f32), {RANKS} ranks writing half each");
    println!("  raw write + fsync (std::fs)     {:>8.1} MB/s", mb / raw);
    println!(
        "  save (checkpoint::save)         {:>8.1} MB/s  ({:.2}x raw)",
        mb / save,
        raw / save
    );
    println!(
        "  load, 1 rank, whole tensors     {:>8.1} MB/s  (page cache)",
        mb / load_one
    );
    println!(
        "  load, 2 ranks, rows of columns  {:>8.1} MB/s  (page cache)",
        mb / load_two
    );
}

/// Mean seconds per step of a run saving every `every` steps (0: none).
fn step_seconds(
    config: &TrainConfig,
    dir: &Path,
    every: usize,
    asynchronous: bool,
) -> (f64, usize) {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let _ = std::fs::remove_dir_all(dir);
    let config = TrainConfig {
        save: (every > 0).then(|| CheckpointPolicy {
            every,
            at_end: false,
            keep: 2,
            background: asynchronous,
            ..CheckpointPolicy::new(dir)
        }),
        ..config.clone()
    };
    let (_, secs) = timed(|| {
        burn_parallel_train::run_local(RANKS, |g| {
            train_gpt(&g, &config, &Parallelism::default(), &corpus, &mut |_| {})
        })
        .expect("training")
    });
    let saves = config.steps.checked_div(every).unwrap_or(0);
    (secs / config.steps as f64, saves)
}

fn stall_figures(root: &Path, quick: bool) {
    let mut config = TrainConfig::default();
    config.model.d_model = if quick { 128 } else { 384 };
    config.model.d_ff = 4 * config.model.d_model;
    config.model.n_layers = 4;
    config.model.n_heads = 4;
    config.steps = if quick { 6 } else { 12 };
    config.batch_size = 4;
    config.seq_len = 32;
    config.eval_batches = 0;
    config.sample_len = 0;
    let params = config.model.num_params();
    let dir = root.join("train");
    let (none, _) = step_seconds(&config, &dir, 0, false);
    let (sync, saves) = step_seconds(&config, &dir, 2, false);
    let (asynchronous, _) = step_seconds(&config, &dir, 2, true);
    let steps = config.steps as f64;
    let stall = |t: f64| (t - none) * steps / saves as f64;
    println!(
        "GPT d {} x {} layers ({:.1}M params, {:.0} MB of params + AdamW per save), {RANKS} \
         ranks, a save every 2 of {} steps",
        config.model.d_model,
        config.model.n_layers,
        params as f64 / 1e6,
        params as f64 * 12.0 / 1e6,
        config.steps
    );
    println!("  step time, no saves             {:>8.3} s", none);
    println!(
        "  step time, synchronous saves    {:>8.3} s  (stall {:.3} s per save)",
        sync,
        stall(sync)
    );
    println!(
        "  step time, asynchronous saves   {:>8.3} s  (stall {:.3} s per save)",
        asynchronous,
        stall(asynchronous)
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let mb: usize = arg("--mb")
        .map(|v| v.parse().expect("--mb N"))
        .unwrap_or(if quick { 64 } else { 256 });
    let root = arg("--dir").map(PathBuf::from).unwrap_or_else(|| {
        std::env::temp_dir().join(format!("bp-ckpt-bench-{}", std::process::id()))
    });
    std::fs::create_dir_all(&root).expect("a scratch directory");
    io_figures(&root, mb);
    stall_figures(&root, quick);
    std::fs::remove_dir_all(&root).ok();
}
