//! All-reduce bus bandwidth of the `nccl` backend on CUDA tensors, 1 to 256 MiB.
//!
//! ```text
//! cargo build --release -p burn-parallel --features cuda,nccl --example nccl_allreduce --bin burnrun
//! # one process per GPU:
//! target/release/burnrun --nproc-per-node 2 -- target/release/examples/nccl_allreduce [--json] [MIB...]
//! # or one thread per GPU in one process:
//! target/release/examples/nccl_allreduce --threads 2 [--json] [MIB...]
//! ```
//!
//! For each size (default 1, 2, 4, ... 256 MiB of f32), every rank runs 3 unmeasured and 20
//! measured sum all-reduces of a tensor on CUDA device `LOCAL_RANK` (or its thread index), each
//! started together after a barrier. A measured call is the whole tensor-level
//! `ProcessGroup::all_reduce`: the signature check over the host transport, the wait for Burn's
//! queued work and NCCL on the device. Rank 0 prints the mean time, the algorithm bandwidth
//! (size / time) and the bus bandwidth (algorithm bandwidth x 2(n-1)/n, NCCL's `busbw`), in
//! GB/s (10^9 bytes per second), and one JSON object per size with `--json`. Results are
//! checked against the exact sum.

use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use burn_parallel::nccl;
use burn_parallel::{ProcessGroup, ReduceOp, run_local};

fn bench(
    group: &ProcessGroup,
    device: &Device,
    sizes_mib: &[usize],
    json: bool,
) -> burn_parallel::Result<()> {
    let n = group.size();
    for &mib in sizes_mib {
        let count = (mib << 20) / 4;
        let input = Tensor::<1>::full([count], group.rank() as f32, device);
        let (warmup, iters) = (3, 20);
        let mut measured = Duration::ZERO;
        let mut last = None;
        for i in 0..warmup + iters {
            let x = input.clone();
            group.barrier()?;
            let start = Instant::now();
            let out = group.all_reduce(x, ReduceOp::Sum)?;
            let elapsed = start.elapsed();
            if i >= warmup {
                measured += elapsed;
            }
            last = Some(out);
        }
        let want = (n * (n - 1) / 2) as f32;
        let out = last.expect("at least one iteration");
        let ends = Tensor::cat(
            vec![out.clone().narrow(0, 0, 1), out.narrow(0, count - 1, 1)],
            0,
        );
        let got = ends.into_data().try_to_vec::<f32>().expect("f32");
        if got != [want, want] {
            return Err(burn_parallel::CollectiveError::InvalidArgument {
                rank: group.global_rank(),
                op: "nccl_allreduce".into(),
                reason: format!("wrong all_reduce result {got:?}, expected {want}"),
            });
        }
        let seconds = measured.as_secs_f64() / iters as f64;
        let bytes = (count * 4) as f64;
        let alg = bytes / seconds / 1e9;
        let bus = alg * 2.0 * (n - 1) as f64 / n as f64;
        if group.rank() == 0 {
            if json {
                println!(
                    "{{\"benchmark\":\"nccl_allreduce\",\"ranks\":{n},\"bytes\":{},\"seconds\":{seconds:.6},\"alg_gb_per_s\":{alg:.2},\"bus_gb_per_s\":{bus:.2}}}",
                    count * 4
                );
            } else {
                println!(
                    "nccl all_reduce of {mib} MiB over {n} ranks: {:.3} ms, algorithm bandwidth \
                     {alg:.2} GB/s, bus bandwidth {bus:.2} GB/s",
                    seconds * 1e3
                );
            }
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: nccl_allreduce [--threads N] [--json] [MIB...]";
    let (mut json, mut threads, mut sizes_mib) = (false, None, Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--threads" => {
                threads = Some(
                    args.next()
                        .and_then(|v| v.parse::<usize>().ok())
                        .ok_or(usage)?,
                )
            }
            size => sizes_mib.push(size.parse::<usize>().map_err(|_| usage)?),
        }
    }
    if sizes_mib.is_empty() {
        sizes_mib = (0..=8).map(|p| 1 << p).collect();
    }
    let info = nccl::probe(0)?;
    eprintln!(
        "NCCL {:?}, {} CUDA device(s)",
        info.version, info.cuda_devices
    );
    match threads {
        Some(t) => {
            run_local(t, |g| {
                let rank = g.rank();
                let g = nccl::attach(g, rank)?;
                bench(&g, &Device::cuda(rank), &sizes_mib, json)
            })?;
        }
        None => {
            let local = std::env::var("LOCAL_RANK")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            let group = nccl::init_from_env()?;
            bench(&group, &Device::cuda(local), &sizes_mib, json)?;
        }
    }
    Ok(())
}
