//! Tensor-parallel benchmark: GPT step time at tp 1, 2, 4 (ranks as threads) on one global
//! batch, and per-rank bytes of weights and of activations saved for backward, with and
//! without sequence parallelism, against Korthikanti et al. (2022).
//!
//! ```text
//! cargo run --release -p examples --example tp_bench            # prints a table
//! cargo run --release -p examples --example tp_bench -- --quick # smaller, for a smoke test
//! ```
//!
//! How activations are measured: Burn does not expose the tensors its autodiff graph saves,
//! so a counting global allocator tracks live heap bytes (the `flex` backend keeps tensors on
//! the heap). Each rank builds its shards and its batch, then (between barriers) runs the
//! forward pass and keeps the loss, which keeps every saved tensor alive; the growth of live
//! bytes, divided by the number of thread ranks, is the per-rank saved activation. The
//! per-layer figure is the difference between a 4-layer and a 2-layer model divided by 2, so
//! the embedding, the logits and the loss cancel out. It includes the graph's bookkeeping and
//! whatever Burn's ops choose to keep (fp32), not only the tensors the formula counts.
//! Results are also written to `target/tp_bench.json`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use burn::tensor::Device;
use burn_parallel::init::Init;
use burn_parallel::run_local;
use examples::data::{Corpus, Split};
use examples::gpt::{Gpt, GptConfig};
use examples::train::{Parallelism, TrainConfig, train_gpt};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds the
// `GlobalAlloc` contract; the counter is only arithmetic on the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout, forwarded as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout, forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: `ptr` was allocated by `System` with `layout`; forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn model_config(layers: usize, d: usize, heads: usize, seq: usize) -> GptConfig {
    let mut m = GptConfig::new(256, layers, heads, d, seq);
    m.seed = 1;
    m
}

/// Per-rank (bytes of parameters, bytes live after the forward pass).
fn measure(
    config: &GptConfig,
    tp: usize,
    sp: bool,
    batch: usize,
    seq: usize,
    corpus: &Corpus,
) -> (usize, f64) {
    let out = run_local(tp, |world| {
        let device = Device::flex().autodiff();
        let init = Init::new(config.seed, &device)
            .with_tp(&world, Gpt::tp_plan(config, sp))
            .expect("plan");
        let model = Gpt::build(config, &init, None).expect("plan");
        let params = model.num_params() * 4;
        let (x, y) = corpus
            .batch(0, batch, seq, Split::Train)
            .to_tensors(&device);
        // Warm-up pass (lazy initialisations stay out of the measurement).
        drop(model.loss(x.clone(), y.clone()).expect("loss").backward());
        world.barrier()?;
        let before = LIVE.load(Ordering::SeqCst);
        world.barrier()?;
        let loss = model.loss(x, y).expect("loss");
        world.barrier()?;
        let after = LIVE.load(Ordering::SeqCst);
        world.barrier()?;
        drop(loss.backward());
        Ok((params, (after - before) as f64 / tp as f64))
    })
    .expect("measurement");
    out[0]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (d, heads, seq, batch, steps) = if quick {
        (64, 4, 32, 4, 3)
    } else {
        (256, 8, 128, 8, 6)
    };
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let mut json = Vec::new();

    println!(
        "GPT width {d}, {heads} heads, 2 layers, global batch {batch} x {seq} tokens, flex backend, ranks as threads"
    );
    println!("\nstep time (same global batch, {steps} steps, first excluded):");
    let mut base = 0.0;
    for tp in [1, 2, 4] {
        let config = TrainConfig {
            model: model_config(2, d, heads, seq),
            steps,
            batch_size: batch,
            seq_len: seq,
            eval_batches: 0,
            sample_len: 0,
            warmup_steps: 1,
            ..TrainConfig::default()
        };
        let p = Parallelism {
            tp,
            ..Parallelism::default()
        };
        let reports = burn_parallel_train::run_local(tp, |g| {
            train_gpt(&g, &config, &p, &corpus, &mut |_| {})
        })
        .expect("training");
        let s = reports[0].step_seconds;
        if tp == 1 {
            base = s;
        }
        println!(
            "  tp {tp}: {:8.1} ms/step  ({:.2}x tp 1)",
            s * 1e3,
            base / s
        );
        json.push(format!("{{\"kind\":\"step\",\"tp\":{tp},\"seconds\":{s}}}"));
    }

    println!("\nper-rank bytes (fp32) and saved activations per layer vs Korthikanti et al.:");
    println!(
        "  {:>3} {:>3} {:>12} {:>14} {:>16} {:>16}",
        "tp", "sp", "params", "act/layer", "formula 16-bit", "formula x2 fp32"
    );
    for tp in [1, 2, 4] {
        for sp in [false, true] {
            if sp && tp == 1 {
                continue;
            }
            let (p2, a2) = measure(&model_config(2, d, heads, seq), tp, sp, batch, seq, &corpus);
            let (_, a4) = measure(&model_config(4, d, heads, seq), tp, sp, batch, seq, &corpus);
            let per_layer = (a4 - a2) / 2.0;
            let (s, b, h, a, t) = (seq as f64, batch as f64, d as f64, heads as f64, tp as f64);
            let formula = if sp {
                s * b * h / t * (34.0 + 5.0 * a * s / h)
            } else {
                s * b * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t))
            };
            println!(
                "  {tp:>3} {:>3} {:>10.2}MB {:>12.2}MB {:>14.2}MB {:>14.2}MB",
                if sp { "on" } else { "off" },
                p2 as f64 / 1e6,
                per_layer / 1e6,
                formula / 1e6,
                2.0 * formula / 1e6
            );
            json.push(format!(
                "{{\"kind\":\"memory\",\"tp\":{tp},\"sp\":{sp},\"param_bytes_2_layers\":{p2},\"activation_bytes_per_layer\":{per_layer},\"formula_bytes_16bit\":{formula}}}"
            ));
        }
    }
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let path = std::path::Path::new(&dir).join("tp_bench.json");
    if std::fs::write(&path, format!("[{}]\n", json.join(",\n"))).is_ok() {
        println!("\nwritten {}", path.display());
    }
}
