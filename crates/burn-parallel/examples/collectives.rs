//! Collective benchmark: all-reduce algorithm and bus bandwidth from 1 MB to 256 MB on the
//! `local` backend (2 and 4 ranks) and the `tcp` backend (2 processes on loopback), printed
//! beside the machine's own limits measured in the same run: single-thread memcpy bandwidth
//! and raw TCP loopback throughput between two processes.
//!
//! ```text
//! cargo run -p burn-parallel --example collectives            # full sweep
//! cargo run -p burn-parallel --example collectives -- --quick # 1, 16 and 64 MB only
//! ```
//!
//! Bus bandwidth follows NCCL's convention: `algbw = size / time`, `busbw = algbw * 2(n-1)/n`
//! for all-reduce, so it is comparable with the bandwidth of one link. Results are also written
//! as JSON to `target/bench/collectives.json`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Instant;

use burn::tensor::TensorData;
use burn_parallel::{ProcessGroup, ReduceOp, run_local};

const MB: usize = 1 << 20;

fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![MB, 16 * MB, 64 * MB]
    } else {
        vec![MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
    }
}

/// Iterations for a size: enough to last a fraction of a second, at least 2.
fn iterations(bytes: usize) -> usize {
    (256 * MB / bytes).clamp(2, 20)
}

/// Median seconds of one all-reduce of `bytes` (f32) over `group`, after one warm-up.
fn time_all_reduce(group: &ProcessGroup, bytes: usize) -> f64 {
    let n = bytes / 4;
    let mut times = Vec::new();
    let mut data = TensorData::new(vec![1.0f32; n], [n]);
    for i in 0..=iterations(bytes) {
        group.barrier().expect("barrier");
        let start = Instant::now();
        data = group
            .all_reduce_data(data, ReduceOp::Avg)
            .expect("all_reduce");
        // The slowest rank defines the collective's time.
        let local = start.elapsed().as_secs_f64();
        let slowest = group
            .all_reduce_f32(vec![local as f32], ReduceOp::Max)
            .expect("max")[0] as f64;
        if i > 0 {
            times.push(slowest);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Single-thread memcpy bandwidth (bytes copied per second) on a 256 MB buffer.
fn memcpy_bandwidth() -> f64 {
    let src = vec![1u8; 256 * MB];
    let mut dst = vec![0u8; 256 * MB];
    dst.copy_from_slice(&src); // fault the pages in
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(start.elapsed().as_secs_f64());
    }
    src.len() as f64 / best
}

/// Raw TCP loopback throughput between this process and a child process (bytes per second).
fn tcp_loopback_bandwidth() -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args(["--sink", &port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the sink process");
    let (mut stream, _) = listener.accept().expect("accept");
    stream.set_nodelay(true).ok();
    let chunk = vec![7u8; 4 * MB];
    let total = 1024 * MB;
    // Warm-up.
    for _ in 0..16 {
        stream.write_all(&chunk).expect("write");
    }
    let start = Instant::now();
    for _ in 0..total / chunk.len() {
        stream.write_all(&chunk).expect("write");
    }
    stream.shutdown(std::net::Shutdown::Write).ok();
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).ok();
    let secs = start.elapsed().as_secs_f64();
    child.wait().ok();
    total as f64 / secs
}

/// The child side of [`tcp_loopback_bandwidth`]: reads everything, then acknowledges.
fn sink(port: u16) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let mut buf = vec![0u8; 4 * MB];
    while stream.read(&mut buf).expect("read") > 0 {}
    stream.write_all(&[1]).ok();
}

struct Row {
    backend: &'static str,
    ranks: usize,
    bytes: usize,
    seconds: f64,
}

impl Row {
    fn algbw(&self) -> f64 {
        self.bytes as f64 / self.seconds
    }
    fn busbw(&self) -> f64 {
        self.algbw() * 2.0 * (self.ranks as f64 - 1.0) / self.ranks as f64
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--sink") {
        sink(args[i + 1].parse().expect("port"));
        return;
    }
    if args.iter().any(|a| a == "--tcp-worker") {
        tcp_worker(args.iter().any(|a| a == "--quick"));
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let memcpy = memcpy_bandwidth();
    let loopback = tcp_loopback_bandwidth();
    println!(
        "machine limits: memcpy (1 thread) {:.0} MB/s, tcp loopback (2 processes) {:.0} MB/s",
        memcpy / MB as f64,
        loopback / MB as f64
    );

    let mut rows = Vec::new();
    for ranks in [2, 4] {
        for &bytes in &sizes(quick) {
            let times = run_local(ranks, |g| Ok(time_all_reduce(&g, bytes))).expect("local run");
            rows.push(Row {
                backend: "local",
                ranks,
                bytes,
                seconds: times[0],
            });
        }
    }
    rows.extend(run_tcp(quick));

    println!(
        "\n{:<7} {:>5} {:>9} {:>10} {:>12} {:>12} {:>9}",
        "backend", "ranks", "size", "time", "algbw MB/s", "busbw MB/s", "of limit"
    );
    let mut json = Vec::new();
    for row in &rows {
        let limit = if row.backend == "local" {
            memcpy
        } else {
            loopback
        };
        println!(
            "{:<7} {:>5} {:>6} MB {:>8.2}ms {:>12.0} {:>12.0} {:>8.0}%",
            row.backend,
            row.ranks,
            row.bytes / MB,
            row.seconds * 1e3,
            row.algbw() / MB as f64,
            row.busbw() / MB as f64,
            100.0 * row.busbw() / limit
        );
        json.push(format!(
            "{{\"backend\":\"{}\",\"ranks\":{},\"bytes\":{},\"seconds\":{},\"algbw\":{},\"busbw\":{},\"limit\":{}}}",
            row.backend, row.ranks, row.bytes, row.seconds, row.algbw(), row.busbw(), limit
        ));
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    if std::fs::create_dir_all(&dir).is_ok() {
        let path = dir.join("collectives.json");
        let body = format!(
            "{{\"memcpy\":{memcpy},\"tcp_loopback\":{loopback},\"rows\":[{}]}}\n",
            json.join(",")
        );
        if std::fs::write(&path, body).is_ok() {
            println!("\nwritten to {}", path.display());
        }
    }
}

/// Runs the tcp sweep in 2 child processes of this binary and collects their rows.
fn run_tcp(quick: bool) -> Vec<Row> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().expect("exe"));
            cmd.arg("--tcp-worker")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped());
            if quick {
                cmd.arg("--quick");
            }
            cmd.spawn().expect("spawn a tcp worker")
        })
        .collect();
    let mut rows = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().expect("tcp worker");
        assert!(out.status.success(), "tcp worker {rank} failed");
        if rank == 0 {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let mut parts = line.split_whitespace();
                if let (Some(bytes), Some(secs)) = (parts.next(), parts.next()) {
                    rows.push(Row {
                        backend: "tcp",
                        ranks: 2,
                        bytes: bytes.parse().expect("bytes"),
                        seconds: secs.parse().expect("seconds"),
                    });
                }
            }
        }
    }
    rows
}

fn tcp_worker(quick: bool) {
    let group = burn_parallel::init_from_env().expect("tcp rendezvous");
    for &bytes in &sizes(quick) {
        let secs = time_all_reduce(&group, bytes);
        if group.rank() == 0 {
            println!("{bytes} {secs}");
        }
    }
}
