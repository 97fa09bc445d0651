//! The bundled GPT under data parallelism on 2 thread ranks, with the gradient all-reduce after
//! backward (`TrainStep`) and during it (`TrainStep::with_overlap`): first a parity check (the
//! same steps from the same weights give the same losses and parameters, within 1e-5; exits
//! with an error otherwise), then the median step time of each, interleaved step by step.
//!
//! ```text
//! cargo run --release -p examples --example gpt_overlap_bench -- [--layers 4] [--d 128] \
//!     [--heads 4] [--seq 128] [--batch 16] [--steps 10] [--bucket-mb 1] [--tied]
//! ```

use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::overlap::OverlappedDdp;
use burn_parallel::train::TrainStep;
use burn_parallel::{ProcessGroup, TpError, run_local};
use examples::gpt::{Gpt, GptConfig};

#[derive(Clone, Copy, Debug)]
struct Args {
    layers: usize,
    d: usize,
    heads: usize,
    seq: usize,
    batch: usize,
    steps: usize,
    bucket_mb: f64,
    tied: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        layers: 4,
        d: 128,
        heads: 4,
        seq: 128,
        batch: 16,
        steps: 10,
        bucket_mb: 1.0,
        tied: false,
    };
    let usage = "usage: gpt_overlap_bench [--layers N] [--d N] [--heads N] [--seq N] [--batch N] \
                 [--steps N] [--bucket-mb X] [--tied]";
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| usage.to_string());
        let num = |v: String| v.parse::<usize>().map_err(|_| usage.to_string());
        match arg.as_str() {
            "--layers" => a.layers = num(value()?)?,
            "--d" => a.d = num(value()?)?,
            "--heads" => a.heads = num(value()?)?,
            "--seq" => a.seq = num(value()?)?,
            "--batch" => a.batch = num(value()?)?,
            "--steps" => a.steps = num(value()?)?,
            "--bucket-mb" => a.bucket_mb = value()?.parse().map_err(|_| usage.to_string())?,
            "--tied" => a.tied = true,
            _ => return Err(usage.into()),
        }
    }
    Ok(a)
}

/// Rank `rank`'s tokens and next-token targets at `step` (deterministic, byte vocabulary).
fn batch(a: Args, step: usize, rank: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let n = a.batch * (a.seq + 1);
    let stream: Vec<i64> = (0..n)
        .map(|i| ((i * 31 + step * 7 + rank * 101) * 2654435761 % 256) as i64)
        .collect();
    let mut inputs = Vec::with_capacity(a.batch * a.seq);
    let mut targets = Vec::with_capacity(a.batch * a.seq);
    for row in stream.chunks(a.seq + 1) {
        inputs.extend_from_slice(&row[..a.seq]);
        targets.extend_from_slice(&row[1..]);
    }
    let t = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [a.batch, a.seq]), device);
    (t(inputs), t(targets))
}

fn params(model: &Gpt) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let v = param.val().into_data().convert::<f32>();
            self.0.extend(v.try_to_vec::<f32>().expect("f32"));
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

struct Trainer {
    model: Gpt,
    step: TrainStep,
    optim: ModuleOptimizer,
}

impl Trainer {
    fn new(config: &GptConfig, group: &ProcessGroup, overlap: Option<usize>) -> Self {
        let device = Device::flex().autodiff();
        let model = Gpt::new(config, &device);
        let mut step = TrainStep::new(model.tp.clone()).with_data_parallel(group.clone());
        if let Some(bytes) = overlap {
            step = step.with_overlap(OverlappedDdp::new(group.clone()).with_bucket_bytes(bytes));
        }
        Self {
            model,
            step,
            optim: AdamWConfig::new().init(),
        }
    }

    fn train(&mut self, a: Args, s: usize, rank: usize) -> Result<f32, TpError> {
        let device = Device::flex().autodiff();
        let (inputs, targets) = batch(a, s, rank, &device);
        let model = self.model.clone();
        let (next, out) = self.step.step_with(
            model,
            |m: &Gpt| m.loss(inputs, targets),
            &mut self.optim,
            1e-3,
        )?;
        self.model = next;
        Ok(out.loss)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse()?;
    let mut config = GptConfig::new(256, a.layers, a.heads, a.d, a.seq);
    config.tied_embeddings = a.tied;
    config.seed = 1;
    let bucket = (a.bucket_mb * 1024.0 * 1024.0) as usize;
    let out = run_local(2, |group| {
        let run = || -> Result<_, TpError> {
            let rank = group.rank();
            let mut plain = Trainer::new(&config, &group, None);
            let mut over = Trainer::new(&config, &group, Some(bucket));
            // Parity: 3 steps each from the same weights.
            let mut worst_loss = 0f32;
            for s in 0..3 {
                let (lp, lo) = (plain.train(a, s, rank)?, over.train(a, s, rank)?);
                worst_loss = worst_loss.max((lp - lo).abs() / lp.abs().max(1.0));
            }
            let (pp, po) = (params(&plain.model), params(&over.model));
            let worst_param = pp
                .iter()
                .zip(&po)
                .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
                .fold(0f32, f32::max);
            // Timing, interleaved (whichever goes first alternates).
            let mut times: [Vec<Duration>; 2] = Default::default();
            for s in 0..a.steps {
                for k in 0..2 {
                    let which = (s + k) % 2;
                    group.barrier()?;
                    let start = Instant::now();
                    match which {
                        0 => plain.train(a, 3 + s, rank)?,
                        _ => over.train(a, 3 + s, rank)?,
                    };
                    times[which].push(start.elapsed());
                }
            }
            Ok((worst_loss, worst_param, times))
        };
        run().map_err(|e| burn_parallel::CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: "gpt_overlap_bench".into(),
            reason: e.to_string(),
        })
    })?;
    let (worst_loss, worst_param, mut times) = out.into_iter().next().expect("rank 0");
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e3
    };
    let (tp, to) = (median(&mut times[0]), median(&mut times[1]));
    println!(
        "GPT {} layers, d {}, seq {}, batch {} per rank{}, 2 thread ranks, buckets of {} MB",
        a.layers,
        a.d,
        a.seq,
        a.batch,
        if a.tied { ", tied embeddings" } else { "" },
        a.bucket_mb
    );
    println!(
        "  parity over 3 steps: max relative difference {worst_loss:.2e} (loss), {worst_param:.2e} (parameters)"
    );
    println!(
        "  step (median of {}): after backward {tp:.1} ms, overlapped {to:.1} ms, ratio {:.3}",
        a.steps,
        to / tp
    );
    if worst_loss > 1e-5 || worst_param > 1e-5 {
        return Err("overlapped training differs from the plain step".into());
    }
    Ok(())
}
