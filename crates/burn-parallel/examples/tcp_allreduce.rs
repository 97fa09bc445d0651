//! All-reduce bandwidth of the `tcp` backend between processes, run through `burnrun`:
//!
//! ```text
//! cargo build --release -p burn-parallel --example tcp_allreduce --bin burnrun
//! target/release/burnrun --nproc-per-node 2 -- target/release/examples/tcp_allreduce [MIB...]
//! ```
//!
//! For each size (default 64 MiB of f32), every rank runs 2 unmeasured and 10 measured sum
//! all-reduces, each started together after a barrier. Rank 0 prints the mean time, the
//! algorithm bandwidth (size / time) and the bus bandwidth (algorithm bandwidth x 2(n-1)/n,
//! the bytes each rank's link carries, comparable with the raw link speed of `tcp_loopback`),
//! in MB/s (10^6 bytes per second), and one JSON object per size with `--json`.

use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel::{ReduceOp, init_from_env};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut json = false;
    let mut sizes_mib = Vec::new();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--json" => json = true,
            size => sizes_mib.push(
                size.parse::<usize>()
                    .map_err(|_| "usage: tcp_allreduce [--json] [MIB...]")?,
            ),
        }
    }
    if sizes_mib.is_empty() {
        sizes_mib.push(64);
    }
    let group = init_from_env()?;
    let n = group.size();
    for mib in sizes_mib {
        let count = (mib << 20) / 4;
        let data = TensorData::new(vec![group.rank() as f32; count], [count]);
        let (warmup, iters) = (2, 10);
        let mut measured = Duration::ZERO;
        for i in 0..warmup + iters {
            let input = data.clone();
            group.barrier()?;
            let start = Instant::now();
            let out = group.all_reduce_data(input, ReduceOp::Sum)?;
            let elapsed = start.elapsed();
            if i >= warmup {
                measured += elapsed;
            }
            let want = (n * (n - 1) / 2) as f32;
            let got = out.as_slice::<f32>().map_err(|e| format!("{e:?}"))?;
            if got[0] != want || got[count - 1] != want {
                return Err(format!("wrong all_reduce result {} != {want}", got[0]).into());
            }
        }
        let seconds = measured.as_secs_f64() / iters as f64;
        let bytes = (count * 4) as f64;
        let alg = bytes / seconds / 1e6;
        let bus = alg * 2.0 * (n - 1) as f64 / n as f64;
        if group.rank() == 0 {
            if json {
                println!(
                    "{{\"benchmark\":\"tcp_allreduce\",\"ranks\":{n},\"bytes\":{},\"seconds\":{seconds:.6},\"alg_mb_per_s\":{alg:.1},\"bus_mb_per_s\":{bus:.1}}}",
                    count * 4
                );
            } else {
                println!(
                    "tcp all_reduce of {mib} MiB over {n} processes: {:.2} ms, algorithm \
                     bandwidth {alg:.0} MB/s, bus bandwidth {bus:.0} MB/s",
                    seconds * 1e3
                );
            }
        }
    }
    Ok(())
}
