//! Context-parallel attention benchmark (one run, Flex, ranks as threads):
//!
//! 1. step time (forward + backward of one causal attention layer, `[1, 4 heads, seq, 32]`,
//!    the slowest rank's wall time) at sequence 1k, 2k, 4k for cp = 1 (plain attention, what
//!    one device runs), 2 and 4, ring against Ulysses, with the measured peak of the step's
//!    allocations per rank (the counting allocator: process peak over the step divided by the
//!    ranks, inputs excluded) beside the theory (one `seq x seq` score matrix per head, over
//!    cp);
//! 2. the longest sequence whose step fits a per-rank cap of allocations, cp = 1 against ring
//!    cp = 4;
//! 3. the load imbalance of ring attention (slowest rank's thread CPU time over the fastest's,
//!    from `/proc/thread-self/stat`) with head-tail against contiguous sharding.
//!
//! ```text
//! cargo run --release -p examples --example cp_bench
//! cargo run --release -p examples --example cp_bench -- --quick   # short sequences, a smoke test
//! ```
//!
//! `--quick` measures sequences of 256 and 512 (section 3 at 2048) and searches under a cap of
//! 8 MiB from 128 tokens, in seconds instead of minutes.
//!
//! Writes the figures as JSON to `<target>/cp_bench.json` (`$CARGO_TARGET_DIR`, else the
//! workspace's `target/`). The machine's cores are shared by the ranks: compare within one run.

use std::time::Instant;

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_parallel::context_parallel::{ContextParallel, CpBalance, CpKind, CpSettings};
use burn_parallel::run_local;
use burn_zero::memory::CountingAllocator;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

const HEADS: usize = 4;
const HEAD_DIM: usize = 32;
const MIB: f64 = 1024.0 * 1024.0;
/// The longest sequence the longest-sequence search tries.
const SEARCH_LIMIT: usize = 16384;

/// What one run measures: the full figures, or the small ones of `--quick`.
struct Sizes {
    /// Sequence lengths of section 1.
    seqs: &'static [usize],
    /// Per-rank cap of the step's allocations for the longest-sequence search (section 2).
    cap_mib: f64,
    /// The first sequence the search tries (it doubles from there).
    search_from: usize,
    /// Sequence length of the load-imbalance figure (section 3).
    imbalance_seq: usize,
}

impl Sizes {
    const FULL: Sizes = Sizes {
        seqs: &[1024, 2048, 4096],
        cap_mib: 128.0,
        search_from: 512,
        imbalance_seq: 4096,
    };
    const QUICK: Sizes = Sizes {
        seqs: &[256, 512],
        cap_mib: 8.0,
        search_from: 128,
        imbalance_seq: 2048,
    };
}

/// CPU seconds this thread has used (user + system), from `/proc/thread-self/stat` (ticks of
/// 1/100 s); `None` where that file does not exist.
fn thread_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// This rank's tokens of a deterministic `[1, HEADS, seq, HEAD_DIM]` tensor, built directly
/// (no rank holds the whole one).
fn local_input(salt: usize, positions: &[usize], device: &Device) -> Tensor<4> {
    let n = positions.len();
    let mut v = Vec::with_capacity(HEADS * n * HEAD_DIM);
    for h in 0..HEADS {
        for &p in positions {
            for d in 0..HEAD_DIM {
                let i = ((h * 131 + p) * 31 + d) * 7 + salt * 9973;
                v.push(((i % 2003) as f32 / 1001.5 - 1.0) * 0.5);
            }
        }
    }
    Tensor::from_data(TensorData::new(v, [1, HEADS, n, HEAD_DIM]), device)
}

/// Plain causal attention (composed ops under autodiff): what one device runs without cp.
fn plain_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [b, h, s, d] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)) / (d as f32).sqrt();
    let mask: Vec<bool> = (0..s).flat_map(|i| (0..s).map(move |j| j > i)).collect();
    let mask = Tensor::<2, Bool>::from_data(TensorData::new(mask, [s, s]), &scores.device())
        .reshape([1, 1, s, s])
        .expand([b, h, s, s]);
    softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(v)
}

/// What one configuration measured.
#[derive(Debug, Clone)]
struct Measured {
    /// Slowest rank's wall seconds for forward + backward.
    seconds: f64,
    /// Process peak of allocations over the step, above the start, per rank.
    peak_per_rank: f64,
    /// Each rank's thread CPU seconds over the step.
    cpu: Vec<Option<f64>>,
}

/// One forward + backward of causal attention over `seq` tokens on `cp` ranks (`kind = None`:
/// plain attention on one rank).
fn step(seq: usize, cp: usize, kind: Option<CpKind>, balance: CpBalance) -> Measured {
    let start = std::sync::Mutex::new(0usize);
    let results = run_local(cp, |group| {
        let device = Device::flex().autodiff();
        let settings = CpSettings {
            kind: kind.unwrap_or(CpKind::Ring),
            balance,
        };
        let ctx = ContextParallel::new(&group, settings).expect("same settings everywhere");
        let layout = ctx.layout(seq).expect("a sequence that splits");
        let positions = layout.positions();
        let q = local_input(1, &positions, &device).require_grad();
        let k = local_input(2, &positions, &device).require_grad();
        let v = local_input(3, &positions, &device).require_grad();
        let c = local_input(4, &positions, &device);
        group.barrier()?;
        if group.rank() == 0 {
            *start.lock().unwrap() = ALLOC.reset_peak();
        }
        group.barrier()?;
        let (t0, cpu0) = (Instant::now(), thread_cpu_seconds());
        let out = match kind {
            None => plain_attention(q.clone(), k.clone(), v.clone()),
            Some(_) => ctx
                .attention(q.clone(), k.clone(), v.clone(), true)
                .expect("attention"),
        };
        let grads = (out * c).sum().backward();
        let dq = q.grad(&grads).expect("a gradient");
        drop((grads, dq));
        let seconds = t0.elapsed().as_secs_f64();
        let cpu = thread_cpu_seconds().zip(cpu0).map(|(a, b)| a - b);
        group.barrier()?;
        Ok((seconds, cpu))
    })
    .expect("the benchmark runs");
    let peak = ALLOC.peak().saturating_sub(*start.lock().unwrap());
    Measured {
        seconds: results.iter().map(|r| r.0).fold(0.0, f64::max),
        peak_per_rank: peak as f64 / cp as f64,
        cpu: results.iter().map(|r| r.1).collect(),
    }
}

fn name(kind: Option<CpKind>) -> String {
    kind.map_or("plain".into(), |k| k.to_string())
}

fn main() {
    let sizes = if std::env::args().any(|a| a == "--quick") {
        Sizes::QUICK
    } else {
        Sizes::FULL
    };
    // Warm up (allocator pools, first-use costs).
    step(256, 2, Some(CpKind::Ring), CpBalance::HeadTail);
    let mut json = Vec::new();

    println!(
        "## 1. Causal attention forward + backward, [1, {HEADS} heads, seq, {HEAD_DIM}], Flex, \
         ranks as threads\n"
    );
    println!(
        "| seq | cp | kind | s/step | vs cp 1 | peak/rank (MiB) | theory: seq² x heads x 4 B / cp (MiB) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &seq in sizes.seqs {
        let single = step(seq, 1, None, CpBalance::None);
        let theory = |cp: usize| (seq * seq * HEADS * 4) as f64 / cp as f64 / MIB;
        let mut rows = vec![(1, None, single.clone())];
        for cp in [2, 4] {
            for kind in [CpKind::Ring, CpKind::Ulysses] {
                rows.push((
                    cp,
                    Some(kind),
                    step(seq, cp, Some(kind), CpBalance::HeadTail),
                ));
            }
        }
        for (cp, kind, m) in rows {
            println!(
                "| {seq} | {cp} | {} | {:.3} | {:.2}x | {:.1} | {:.1} |",
                name(kind),
                m.seconds,
                m.seconds / single.seconds,
                m.peak_per_rank / MIB,
                theory(cp)
            );
            json.push(serde_json::json!({
                "figure": "step", "seq": seq, "cp": cp, "kind": name(kind),
                "seconds": m.seconds, "peak_bytes_per_rank": m.peak_per_rank,
                "theory_bytes_per_rank": theory(cp) * MIB,
            }));
        }
    }

    let cap_mib = sizes.cap_mib;
    println!(
        "\n## 2. Longest sequence under a per-rank cap of {cap_mib} MiB of step allocations\n"
    );
    println!(
        "| layout | longest seq that fits | its peak/rank (MiB) | next seq's peak/rank (MiB) |"
    );
    println!("|---|---|---|---|");
    for (cp, kind) in [(1, None), (4, Some(CpKind::Ring))] {
        let mut seq = sizes.search_from;
        let mut fits = None;
        let over = loop {
            let m = step(seq, cp, kind, CpBalance::HeadTail);
            if m.peak_per_rank / MIB > cap_mib {
                break Some((seq, m.peak_per_rank));
            }
            fits = Some((seq, m.peak_per_rank));
            if seq >= SEARCH_LIMIT {
                break None;
            }
            seq *= 2;
        };
        let fmt = |f: Option<(usize, f64)>| {
            f.map_or("-".into(), |(s, p)| format!("{s} ({:.1})", p / MIB))
        };
        println!(
            "| {} cp {cp} | {} | {} | {} |",
            name(kind),
            fits.map_or("none".into(), |f| f.0.to_string()),
            fits.map_or("-".into(), |f| format!("{:.1}", f.1 / MIB)),
            fmt(over),
        );
        json.push(serde_json::json!({
            "figure": "cap", "cap_mib": cap_mib, "cp": cp, "kind": name(kind),
            "longest_seq": fits.map(|f| f.0), "searched_up_to": SEARCH_LIMIT,
        }));
    }

    let seq = sizes.imbalance_seq;
    println!("\n## 3. Load imbalance of ring attention, cp 4, seq {seq} (thread CPU seconds)\n");
    println!("| balance | per-rank CPU s | slowest / fastest |");
    println!("|---|---|---|");
    for balance in [CpBalance::HeadTail, CpBalance::None] {
        let m = step(seq, 4, Some(CpKind::Ring), balance);
        let cpu: Vec<f64> = m.cpu.iter().flatten().copied().collect();
        let ratio = if cpu.len() == 4 {
            let max = cpu.iter().copied().fold(0.0, f64::max);
            let min = cpu.iter().copied().fold(f64::INFINITY, f64::min);
            format!("{:.2}", max / min.max(1e-9))
        } else {
            "n/a (no /proc/thread-self/stat)".into()
        };
        let per_rank: Vec<String> = cpu.iter().map(|c| format!("{c:.2}")).collect();
        println!("| {balance} | {} | {ratio} |", per_rank.join(", "));
        json.push(serde_json::json!({
            "figure": "imbalance", "seq": seq, "balance": balance.to_string(), "cpu_seconds": cpu,
        }));
    }

    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = dir.join("cp_bench.json");
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, serde_json::to_string_pretty(&json).expect("JSON")));
    match written {
        Ok(()) => println!("\nwrote {}", path.display()),
        Err(e) => eprintln!("could not write {}: {e}", path.display()),
    }
}
