//! The planner's per-rank memory against the measured peak of the GPT trainer, layout by
//! layout.
//!
//! ```text
//! cargo run -p examples --example planner_check            # prints a table
//! ```
//!
//! Measured: a counting global allocator tracks live heap bytes (Flex keeps tensors on the
//! heap). Ranks are threads of this process, so the per-rank peak is the process's peak during
//! the third training step, less the live bytes before the run started (the corpus), divided
//! by the number of ranks (every layout here is symmetric). Predicted:
//! `burn_parallel::planner::evaluate` for the same model, batch and layout, in fp32.

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use burn_parallel::planner::{
    Attention, Checkpoint, Hardware, Layout, Schedule, Training, evaluate, human_bytes,
};
use burn_parallel::{ParallelDims, run_local};
use burn_zero::Stage;
use examples::data::Corpus;
use examples::train::{Parallelism, TrainConfig, train_gpt_parallel};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static PEAK_SIZE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live =
                LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed) + layout.size() as isize;
            if PEAK.fetch_max(live, Ordering::Relaxed) < live {
                PEAK_SIZE.store(layout.size() as isize, Ordering::Relaxed);
            }
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The measured per-rank peak of step 2 (from 0) of `parallel` on `world` thread ranks.
fn measure(world: usize, parallel: &Parallelism, config: &TrainConfig, corpus: &Corpus) -> f64 {
    let base = LIVE.load(Ordering::Relaxed);
    let peak = std::sync::Mutex::new(0isize);
    run_local(world, |g| {
        let lead = g.rank() == 0;
        train_gpt_parallel(&g, config, parallel, corpus, &mut |s| {
            if !lead {
                return;
            }
            match s.step {
                1 => {
                    let live = LIVE.load(Ordering::Relaxed);
                    eprintln!("steady (after step 1): {}", live - base);
                    PEAK.store(live, Ordering::Relaxed)
                }
                2 => *peak.lock().unwrap() = PEAK.load(Ordering::Relaxed),
                _ => {}
            }
        })
    })
    .expect("training");
    let peak = *peak.lock().unwrap();
    (peak - base) as f64 / world as f64
}

/// Live bytes one forward keeps and the peak of its backward, relative to before the forward,
/// for a single-device GPT: the per-tensor derivation's check.
fn probe_one(model: &examples::gpt::GptConfig, batch: usize, seq: usize, corpus: &Corpus) -> (isize, isize, isize) {
    use examples::data::Split;
    use examples::gpt::Gpt;
    let device = burn::tensor::Device::flex().autodiff();
    let gpt = Gpt::new(model, &device);
    let (inputs, targets) = corpus.batch_rows(0, 0..batch, seq, Split::Train).to_tensors(&device);
    let base = LIVE.load(Ordering::Relaxed);
    let loss = gpt.loss(inputs, targets).expect("loss");
    let fwd = LIVE.load(Ordering::Relaxed) - base;
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    let grads = loss.backward();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    let after = LIVE.load(Ordering::Relaxed) - base;
    drop(grads);
    (fwd, peak, after)
}

fn probe_steady(corpus: &Corpus) {
    use burn::optim::{AdamWConfig, GradientsParams};
    use examples::data::Split;
    use examples::gpt::Gpt;
    let device = burn::tensor::Device::flex().autodiff();
    let base = LIVE.load(Ordering::Relaxed);
    let mut m = examples::gpt::GptConfig::new(256, 4, 4, 128, 128);
    m.fused = true;
    let mut gpt = Gpt::new(&m, &device);
    println!("params {} built {}", m.num_params(), LIVE.load(Ordering::Relaxed) - base);
    let mut optim = AdamWConfig::new().init();
    for step in 0..3 {
        let (inputs, targets) = corpus.batch_rows(step, 0..16, 128, Split::Train).to_tensors(&device);
        let loss = gpt.loss(inputs, targets).expect("loss");
        let grads = GradientsParams::from_grads(loss.backward(), &gpt);
        println!("grads {}", LIVE.load(Ordering::Relaxed) - base);
        gpt = optim.step(1e-3, gpt, grads);
        println!("step {step} steady {}", LIVE.load(Ordering::Relaxed) - base);
    }
    drop(optim);
    println!("no optim {}", LIVE.load(Ordering::Relaxed) - base);
    drop(gpt);
    println!("no model {}", LIVE.load(Ordering::Relaxed) - base);
}

fn probe(corpus: &Corpus) {
    probe_steady(corpus);
    for fused in [true, false] {
        for (layers, batch) in [(1, 8), (2, 8), (1, 16), (2, 16), (4, 16)] {
            let mut m = examples::gpt::GptConfig::new(256, layers, 4, 128, 128);
            m.fused = fused;
            let (f, p, a) = probe_one(&m, batch, 128, corpus);
            println!("fused {fused} L{layers} B{batch}: fwd {f} peak {p} after {a} peak-fwd {} set by {}", p - f, PEAK_SIZE.load(Ordering::Relaxed));
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--probe") {
        probe(&Corpus::load_default().expect("the bundled corpus"));
        return;
    }
    let mut config = TrainConfig::default();
    config.model.d_model = 128;
    config.model.d_ff = 512;
    config.model.n_layers = 4;
    config.model.n_heads = 4;
    config.model.max_seq_len = 128;
    config.seq_len = 128;
    config.batch_size = 16;
    config.steps = 3;
    config.eval_batches = 0;
    config.sample_len = 0;
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let shape = config.model.planner_shape();
    let hw = Hardware::from_units(64.0, 1.0, 1.0);
    let layouts: Vec<(usize, Parallelism)> = vec![
        (1, Parallelism::default()),
        (2, Parallelism::default()),
        (4, Parallelism::default()),
        (
            2,
            Parallelism {
                tp: 2,
                ..Parallelism::default()
            },
        ),
        (
            4,
            Parallelism {
                tp: 4,
                ..Parallelism::default()
            },
        ),
        (
            2,
            Parallelism {
                tp: 2,
                sp: true,
                ..Parallelism::default()
            },
        ),
        (
            2,
            Parallelism {
                zero: Some(Stage::One),
                ..Parallelism::default()
            },
        ),
        (
            2,
            Parallelism {
                zero: Some(Stage::Two),
                ..Parallelism::default()
            },
        ),
        (
            2,
            Parallelism {
                zero: Some(Stage::Three),
                ..Parallelism::default()
            },
        ),
        (
            4,
            Parallelism {
                zero: Some(Stage::Three),
                ..Parallelism::default()
            },
        ),
        (
            4,
            Parallelism {
                tp: 2,
                ..Parallelism::default()
            },
        ),
    ];
    println!(
        "{:<22} {:>11} {:>11} {:>11} {:>8}",
        "layout", "predicted", "activations", "measured", "error"
    );
    for (world, parallel) in layouts {
        let dp = world / parallel.tp;
        let (zero, dp_shard, dp_replicate) = match parallel.zero {
            None => (0, 1, dp),
            Some(s) => (s.number() as u8, dp, 1),
        };
        let layout = Layout {
            dims: ParallelDims {
                dp_replicate,
                dp_shard,
                tp: parallel.tp,
                ..ParallelDims::default()
            },
            zero,
            sp: parallel.sp,
            schedule: Schedule::None,
            micro_batches: 1,
            checkpoint: Checkpoint::None,
        };
        let training = Training {
            world,
            global_batch: config.batch_size,
            seq_len: config.seq_len,
            micro_batch: config.batch_size / dp,
            mixed_precision: false,
            optimizer_bytes: 8,
            bucket_bytes: (config.bucket_mb * 1024.0 * 1024.0) as usize,
            attention: if config.model.fused {
                Attention::Flash
            } else {
                Attention::Materialized
            },
            dropout: config.model.dropout > 0.0,
            fused: config.model.fused,
        };
        let predicted = evaluate(&shape, &training, &hw, &layout).expect("a valid layout");
        let measured = measure(world, &parallel, &config, &corpus);
        let total = predicted.memory.total();
        println!(
            "{:<22} {:>11} {:>11} {:>11} {:>+7.1}%",
            layout.to_string(),
            human_bytes(total),
            human_bytes(predicted.memory.activations),
            human_bytes(measured),
            100.0 * (total - measured) / measured
        );
    }
}
