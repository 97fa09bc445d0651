//! Step time of data parallelism with the gradient all-reduce after backward
//! (`DistributedDataParallel::all_reduce_grads`) and during it (`OverlappedDdp`), on an MLP, at
//! 2 ranks as threads and as 2 TCP processes on loopback (this program starts them itself).
//!
//! ```text
//! cargo run --release -p burn-parallel --example overlap_bench -- [--width 1024] [--layers 6]
//!     [--batch 16] [--steps 30] [--bucket-mb 4] [--mode threads|tcp|both]
//! ```
//!
//! Each rank runs, after two unmeasured steps, `--steps` steps of each path (after backward,
//! overlapped, and compute only: the same step without any communication, the floor),
//! interleaved step by step in a rotating order, each behind a barrier, and rank 0 prints the median step time of each path, the ratio
//! overlapped / after backward, and the communication left exposed after backward (the time in
//! `all_reduce_grads`, resp. in `OverlapStep::finish`). One JSON line per mode follows with
//! `--json`.

use std::process::Command;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor};
use burn_parallel::overlap::OverlappedDdp;
use burn_parallel::{DistributedDataParallel, ProcessGroup, init_from_env, run_local};

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = x.tanh();
            }
        }
        x
    }
}

#[derive(Clone, Copy, Debug)]
struct Args {
    width: usize,
    layers: usize,
    batch: usize,
    steps: usize,
    bucket_mb: f64,
    threads: bool,
    tcp: bool,
    json: bool,
}

fn parse() -> Result<(Args, bool), String> {
    let mut a = Args {
        width: 1024,
        layers: 6,
        batch: 16,
        steps: 30,
        bucket_mb: 4.0,
        threads: true,
        tcp: true,
        json: false,
    };
    let mut worker = false;
    let mut it = std::env::args().skip(1);
    let usage = "usage: overlap_bench [--width N] [--layers N] [--batch N] [--steps N] \
                 [--bucket-mb X] [--mode threads|tcp|both] [--json]";
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| usage.to_string());
        let num = |v: String| v.parse::<usize>().map_err(|_| usage.to_string());
        match arg.as_str() {
            "--width" => a.width = num(value()?)?,
            "--layers" => a.layers = num(value()?)?,
            "--batch" => a.batch = num(value()?)?,
            "--steps" => a.steps = num(value()?)?,
            "--bucket-mb" => {
                a.bucket_mb = value()?.parse().map_err(|_| usage.to_string())?;
            }
            "--mode" => match value()?.as_str() {
                "threads" => (a.threads, a.tcp) = (true, false),
                "tcp" => (a.threads, a.tcp) = (false, true),
                "both" => (a.threads, a.tcp) = (true, true),
                _ => return Err(usage.into()),
            },
            "--json" => a.json = true,
            "--worker" => worker = true,
            _ => return Err(usage.into()),
        }
    }
    if a.layers == 0 || a.width == 0 || a.batch == 0 || a.steps == 0 {
        return Err(usage.into());
    }
    Ok((a, worker))
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Path {
    AfterBackward,
    Overlapped,
    ComputeOnly,
}

/// Median step times (after backward, overlapped, compute only), median exposed communication
/// (after backward, overlapped) and the number of buckets.
type Figures = ([Duration; 3], [Duration; 2], usize);

fn bench(group: &ProcessGroup, a: Args) -> burn_parallel::Result<Figures> {
    let device = Device::flex().autodiff();
    let bucket_bytes = (a.bucket_mb * 1024.0 * 1024.0) as usize;
    let ddp = DistributedDataParallel::new(group.clone()).with_bucket_bytes(bucket_bytes);
    let overlap = OverlappedDdp::new(group.clone()).with_bucket_bytes(bucket_bytes);
    let init = Mlp {
        layers: (0..a.layers)
            .map(|_| LinearConfig::new(a.width, a.width).init(&device))
            .collect(),
    };
    let init = ddp.broadcast_module(init, 0)?;
    let x = Tensor::<2>::random(
        [a.batch, a.width],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        &device,
    );
    let mut models = [init.clone(), init.clone(), init];
    let mut optims: Vec<ModuleOptimizer> = (0..3).map(|_| SgdConfig::new().init()).collect();
    let paths = [Path::AfterBackward, Path::Overlapped, Path::ComputeOnly];
    let mut times: [Vec<Duration>; 3] = Default::default();
    let mut exposed: [Vec<Duration>; 2] = Default::default();
    let mut buckets = 0;
    // Two unmeasured steps, then `steps` measured ones; each runs the three paths, in an
    // order that rotates, so that a change of load (other processes) hits all three alike.
    for iter in 0..2 + a.steps {
        let measured = iter >= 2;
        for shift in 0..paths.len() {
            let p = (iter + shift) % paths.len();
            let path = paths[p];
            {
                group.barrier()?;
                let start = Instant::now();
                let model = models[p].clone();
                let grads = match path {
                    Path::AfterBackward => {
                        let loss = model.forward(x.clone()).powf_scalar(2.0).mean();
                        let grads = GradientsParams::from_grads(loss.backward(), &model);
                        let comm = Instant::now();
                        let grads = ddp.all_reduce_grads(&model, grads)?;
                        if measured {
                            exposed[0].push(comm.elapsed());
                        }
                        grads
                    }
                    Path::ComputeOnly => {
                        let loss = model.forward(x.clone()).powf_scalar(2.0).mean();
                        GradientsParams::from_grads(loss.backward(), &model)
                    }
                    Path::Overlapped => {
                        let step = overlap.start(&model)?;
                        buckets = step.bucket_count();
                        let hooked = step.hook(model.clone());
                        let loss = hooked.forward(x.clone()).powf_scalar(2.0).mean();
                        step.backward(loss)?;
                        drop(hooked);
                        let comm = Instant::now();
                        let grads = step.finish(&model)?;
                        if measured {
                            exposed[1].push(comm.elapsed());
                        }
                        grads
                    }
                };
                models[p] = optims[p].step(1e-3, model, grads);
                if measured {
                    times[p].push(start.elapsed());
                }
            }
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let [t0, t1, t2] = &mut times;
    let [e0, e1] = &mut exposed;
    Ok((
        [median(t0), median(t1), median(t2)],
        [median(e0), median(e1)],
        buckets,
    ))
}

fn report(mode: &str, a: Args, (t, e, buckets): Figures) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let params = a.layers * (a.width * a.width + a.width);
    println!(
        "{mode}: MLP {} x {} ({:.1} MB of f32 gradients, {buckets} buckets of {} MB), batch {} per rank",
        a.layers,
        a.width,
        params as f64 * 4.0 / 1e6,
        a.bucket_mb,
        a.batch
    );
    println!(
        "  step (median of {}): after backward {:.1} ms, overlapped {:.1} ms, compute only {:.1} ms",
        a.steps,
        ms(t[0]),
        ms(t[1]),
        ms(t[2])
    );
    println!(
        "  overlapped / after backward = {:.3}; communication exposed after backward: {:.1} ms (all_reduce_grads) vs {:.1} ms (finish)",
        ms(t[1]) / ms(t[0]),
        ms(e[0]),
        ms(e[1]),
    );
    if a.json {
        println!(
            "{{\"mode\":\"{mode}\",\"width\":{},\"layers\":{},\"batch\":{},\"bucket_mb\":{},\"after_backward_ms\":{:.3},\"overlapped_ms\":{:.3},\"compute_only_ms\":{:.3},\"ratio\":{:.4},\"exposed_after_backward_ms\":{:.3},\"exposed_overlapped_ms\":{:.3}}}",
            a.width,
            a.layers,
            a.batch,
            a.bucket_mb,
            ms(t[0]),
            ms(t[1]),
            ms(t[2]),
            ms(t[1]) / ms(t[0]),
            ms(e[0]),
            ms(e[1])
        );
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (a, worker) = parse()?;
    if worker {
        let group = init_from_env()?;
        let figures = bench(&group, a)?;
        if group.rank() == 0 {
            report("2 TCP processes", a, figures);
        }
        return Ok(());
    }
    if a.threads {
        let figures = run_local(2, |group| bench(&group, a))?;
        report("2 thread ranks", a, figures[0]);
    }
    if a.tcp {
        // Two copies of this program as the ranks of a loopback job.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let token = format!(
            "{:x}{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos()
        );
        let me = std::env::current_exe()?;
        let args: Vec<String> = std::env::args().skip(1).collect();
        let children = (0..2)
            .map(|rank| {
                Command::new(&me)
                    .args(&args)
                    .arg("--worker")
                    .env("RANK", rank.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("WORLD_SIZE", "2")
                    .env("LOCAL_WORLD_SIZE", "2")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("BURN_PARALLEL_JOB_TOKEN", &token)
                    .spawn()
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        for mut child in children {
            let status = child.wait()?;
            if !status.success() {
                return Err(format!("a rank failed: {status}").into());
            }
        }
    }
    Ok(())
}
