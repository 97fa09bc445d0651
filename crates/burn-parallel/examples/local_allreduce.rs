//! The local (thread-rank) all-reduce against single-thread memcpy, in one run.
//!
//! ```text
//! cargo run --release -p burn-parallel --example local_allreduce            # 64 MiB
//! cargo run --release -p burn-parallel --example local_allreduce -- 16 64 256 --iters 30
//! ```
//!
//! The figure (issue 14): the **algorithm bandwidth** of an f32 all-reduce ([`ReduceOp::Avg`],
//! in place: `data = group.all_reduce_data(data, Avg)`) of `S` bytes with 2 thread ranks
//! (`run_local(2, ..)`), `S / time` where the time of one call is that of the slowest rank
//! from a common barrier, divided by the bandwidth of a single-thread memcpy of the same `S`
//! bytes (`dst.copy_from_slice(&src)`, `S / time`). Both are timed in the same loop, one
//! memcpy (on rank 0, while rank 1 waits) before each all-reduce, so that both see the same
//! machine; the ratio is that of the medians (the best times are printed beside them). Every
//! buffer is written before the first timed iteration (no page faults in the timings); the
//! first iteration is not timed.
//!
//! With `--bounds`, the run also times the raw memory patterns that bound an in-place
//! all-reduce of two buffers on two threads, without any collective machinery: a 2-thread
//! memcpy of the same bytes, and "each thread reads its half of both buffers and writes the
//! sum into both" (the least traffic an in-place all-reduce can move: every buffer read once
//! and written once).
//!
//! What bounds the ratio: per byte of the buffer, a 2-rank in-place all-reduce moves 4 bytes
//! of memory traffic (both buffers read, both written; no write-allocate, the lines were just
//! read) on 2 cores, while a memcpy moves 3 (read, write-allocate, write) on 1 core, or 2 when
//! glibc switches to non-temporal stores for copies above its `non_temporal_threshold`
//! (`/lib64/ld-linux-x86-64.so.2 --list-diagnostics`; 192 MiB on the 2-core VM of issue 14).
//! So at 64 MiB the all-reduce can beat memcpy when 2 cores get about twice one core's
//! bandwidth, and at 256 MiB it cannot pass about 50% of memcpy.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use burn::tensor::TensorData;
use burn_parallel::{ReduceOp, run_local};

const MIB: usize = 1 << 20;

struct Args {
    sizes_mib: Vec<usize>,
    iters: usize,
    bounds: bool,
}

fn parse_args() -> Result<Args, String> {
    let usage = "usage: local_allreduce [MiB ...] [--iters N] [--bounds]";
    let mut args = Args {
        sizes_mib: Vec::new(),
        iters: 20,
        bounds: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--iters" => {
                args.iters = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n: &usize| n >= 1)
                    .ok_or(usage)?;
            }
            "--bounds" => args.bounds = true,
            size => args
                .sizes_mib
                .push(size.parse().ok().filter(|&s| s > 0).ok_or(usage)?),
        }
    }
    if args.sizes_mib.is_empty() {
        args.sizes_mib.push(64);
    }
    Ok(args)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Times `iters` memcpys of `bytes` (rank 0) and all-reduces of `bytes` f32 on 2 thread ranks,
/// interleaved; returns `(memcpy seconds, all-reduce seconds)` per timed iteration.
fn measure(bytes: usize, iters: usize) -> (Vec<f64>, Vec<f64>) {
    let count = bytes / 4;
    let out = run_local(2, |group| {
        let rank = group.rank();
        // Rank 0 holds 1.0, rank 1 holds 3.0: the average is 2.0, a fixed point.
        let value = if rank == 0 { 1.0f32 } else { 3.0 };
        let mut data = TensorData::new(vec![value; count], [count]);
        let (src, mut dst) = if rank == 0 {
            (vec![1.0f32; count], vec![0.0f32; count])
        } else {
            (Vec::new(), Vec::new())
        };
        let (mut copies, mut reduces) = (Vec::new(), Vec::new());
        for i in 0..=iters {
            if rank == 0 {
                let start = Instant::now();
                dst.copy_from_slice(&src);
                std::hint::black_box(&mut dst);
                copies.push(start.elapsed().as_secs_f64());
            }
            group.barrier()?;
            let start = Instant::now();
            data = group.all_reduce_data(data, ReduceOp::Avg)?;
            let local = start.elapsed().as_secs_f64();
            // The slowest rank defines the collective's time.
            let slowest = group.all_reduce_f32(vec![local as f32], ReduceOp::Max)?[0] as f64;
            if i == 0 {
                copies.clear();
            } else {
                reduces.push(slowest);
            }
        }
        let values = data.as_slice::<f32>().expect("f32 data");
        if let Some(bad) = values.iter().position(|&v| v != 2.0) {
            panic!(
                "rank {rank}: element {bad} is {} instead of 2.0",
                values[bad]
            );
        }
        Ok((copies, reduces))
    })
    .expect("the local all-reduce run");
    let (copies, reduces) = out.into_iter().next().expect("rank 0");
    (copies, reduces)
}

/// Best seconds of `f(thread)` run on 2 threads from a common barrier (the slower thread's
/// time), over `iters` runs after one untimed run.
fn two_threads(iters: usize, f: &(dyn Fn(usize) + Sync)) -> f64 {
    let barrier = Arc::new(Barrier::new(2));
    let mut times = Vec::new();
    for i in 0..=iters {
        let t = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|t| {
                    let barrier = barrier.clone();
                    s.spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        f(t);
                        start.elapsed().as_secs_f64()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("bound thread"))
                .fold(0.0, f64::max)
        });
        if i > 0 {
            times.push(t);
        }
    }
    best(&times)
}

/// The raw 2-thread memory patterns that bound the all-reduce (see the module docs).
fn bounds(bytes: usize, iters: usize, memcpy_best: f64) {
    let count = bytes / 4;
    let half = count / 2;
    let src = vec![1.0f32; count];
    let mut a = vec![1.0f32; count];
    let mut b = vec![3.0f32; count];
    // Each thread takes its half of every buffer: split the buffers before sharing them.
    let dst_halves: Vec<std::sync::Mutex<&mut [f32]>> = {
        let (x, y) = a.split_at_mut(half);
        vec![std::sync::Mutex::new(x), std::sync::Mutex::new(y)]
    };
    let copy = two_threads(iters, &|t| {
        let mut dst = dst_halves[t].lock().expect("half");
        let from = if t == 0 { &src[..half] } else { &src[half..] };
        dst.copy_from_slice(from);
    });
    drop(dst_halves);
    let pairs: Vec<std::sync::Mutex<(&mut [f32], &mut [f32])>> = {
        let (a0, a1) = a.split_at_mut(half);
        let (b0, b1) = b.split_at_mut(half);
        vec![
            std::sync::Mutex::new((a0, b0)),
            std::sync::Mutex::new((a1, b1)),
        ]
    };
    let fused = two_threads(iters, &|t| {
        let mut pair = pairs[t].lock().expect("half");
        let (x, y) = &mut *pair;
        for (p, q) in x.chunks_mut(8192).zip(y.chunks_mut(8192)) {
            for (u, v) in p.iter_mut().zip(q.iter_mut()) {
                let s = (*u + *v) * 0.5;
                *u = s;
                *v = s;
            }
        }
    });
    drop(pairs);
    std::hint::black_box((&a, &b));
    let mb = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "  bound: memcpy on 2 threads (halves)       best {:7.2} ms {:7.2} GB/s = {:4.0}% of memcpy",
        copy * 1e3,
        mb(copy),
        100.0 * memcpy_best / copy
    );
    println!(
        "  bound: read both, write both (2 threads) best {:7.2} ms {:7.2} GB/s = {:4.0}% of memcpy",
        fused * 1e3,
        mb(fused),
        100.0 * memcpy_best / fused
    );
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(usage) => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    println!(
        "local all-reduce (avg, f32, in place) on 2 thread ranks vs single-thread memcpy of the \
         same bytes; {} timed iterations; GB/s = 10^9 bytes/s",
        args.iters
    );
    for &mib in &args.sizes_mib {
        let bytes = mib * MIB;
        let (copies, reduces) = measure(bytes, args.iters);
        let (copy_med, copy_best) = (median(copies.clone()), best(&copies));
        let (red_med, red_best) = (median(reduces.clone()), best(&reduces));
        let gb = |s: f64| bytes as f64 / s / 1e9;
        println!("{mib} MiB:");
        println!(
            "  memcpy (1 thread)              median {:7.2} ms {:7.2} GB/s   best {:7.2} ms {:7.2} GB/s",
            copy_med * 1e3,
            gb(copy_med),
            copy_best * 1e3,
            gb(copy_best)
        );
        println!(
            "  all_reduce_data (2 ranks)      median {:7.2} ms {:7.2} GB/s   best {:7.2} ms {:7.2} GB/s (algbw)",
            red_med * 1e3,
            gb(red_med),
            red_best * 1e3,
            gb(red_best)
        );
        println!(
            "  ratio algbw / memcpy: {:.2} (medians), {:.2} (bests)",
            copy_med / red_med,
            copy_best / red_best
        );
        if args.bounds {
            bounds(bytes, args.iters, copy_best);
        }
    }
}
