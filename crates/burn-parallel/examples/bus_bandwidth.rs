//! All-reduce bus bandwidth of the `mpi` backend beside our `tcp` backend, in one run of the
//! same processes on one machine:
//!
//! ```text
//! cargo build --release -p burn-parallel --features mpi --example bus_bandwidth
//! mpirun --oversubscribe -np 2 target/release/examples/bus_bandwidth [MB...]
//! ```
//!
//! The ranks are an MPI job; rank 0 also serves a `tcp` rendezvous on 127.0.0.1 (its port is
//! broadcast over MPI), so the same processes form a `tcp` world on loopback. For each size
//! (default 1, 4, 16, 64, 256 MB of f32) and each backend, every rank runs 2 unmeasured and 5
//! measured sum all-reduces, each started after a barrier, and checks the result. Rank 0
//! prints the mean time, the algorithm bandwidth (`size / time`) and the bus bandwidth
//! (`algbw * 2(n-1)/n`, NCCL's convention: the bytes each rank's link carries), in MB/s.

use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel::comm::tcp::{TcpConfig, TcpRendezvous};
use burn_parallel::world::{connect_tcp, connect_tcp_with_rendezvous};
use burn_parallel::{ProcessGroup, ReduceOp};

/// Mean seconds of one all-reduce of `bytes` bytes of f32 on `group`.
fn measure(group: &ProcessGroup, bytes: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let n = group.size();
    let count = bytes / 4;
    let data = TensorData::new(vec![group.rank() as f32 + 1.0; count], [count]);
    let (warmup, iters) = (2, 5);
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
        let want = (n * (n + 1) / 2) as f32;
        let got = out.as_slice::<f32>().map_err(|e| format!("{e:?}"))?;
        if got[0] != want || got[count - 1] != want {
            return Err(format!("wrong all-reduce result on {}", group.backend()).into());
        }
    }
    Ok(measured.as_secs_f64() / iters as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut sizes_mb: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().map_err(|_| "usage: bus_bandwidth [MB...]"))
        .collect::<Result<_, _>>()?;
    if sizes_mb.is_empty() {
        sizes_mb = vec![1, 4, 16, 64, 256];
    }
    let mpi = burn_parallel::world::init_mpi()?;
    let (rank, n) = (mpi.rank(), mpi.size());
    // The tcp world of the same processes, on loopback.
    let tcp = if rank == 0 {
        let rendezvous = TcpRendezvous::bind("127.0.0.1:0")?;
        let port = rendezvous.port();
        mpi.broadcast_object(Some(&port), 0)?;
        connect_tcp_with_rendezvous(&TcpConfig::new(0, n, "127.0.0.1", port), rendezvous)?
    } else {
        let port: u16 = mpi.broadcast_object(None, 0)?;
        connect_tcp(&TcpConfig::new(rank, n, "127.0.0.1", port))?
    };
    if rank == 0 {
        println!("all-reduce (sum, f32) on {n} ranks, one machine; MB = 10^6 bytes");
        println!(
            "{:>8} {:>8} {:>10} {:>12} {:>12}",
            "size MB", "backend", "time ms", "algbw MB/s", "busbw MB/s"
        );
    }
    for mb in sizes_mb {
        let bytes = mb * 1_000_000;
        for group in [&mpi, &tcp] {
            let seconds = measure(group, bytes)?;
            if rank == 0 {
                let alg = bytes as f64 / seconds / 1e6;
                let bus = alg * 2.0 * (n - 1) as f64 / n as f64;
                println!(
                    "{mb:>8} {:>8} {:>10.2} {alg:>12.0} {bus:>12.0}",
                    group.backend(),
                    seconds * 1e3
                );
            }
        }
    }
    mpi.barrier()?;
    Ok(())
}
