//! MoE figures: all-to-all bandwidth with uneven splits, MoE layer step time at ep 1/2/4, and
//! expert load imbalance over 200 steps with and without each balancing method.
//!
//! ```text
//! cargo run -p burn-moe --example moe_bench
//! ```
//!
//! Ranks are threads of this process (`run_local`), so the timings share the machine's cores.

use std::time::Instant;

use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor, TensorData};
use burn_moe::{MoeConfig, MoeLayer, MoeParallel, MoeStep, ScoreFn};
use burn_parallel::init::{Init, init_normal};
use burn_parallel::nn::TpContext;
use burn_parallel::train::TrainStep;
use burn_parallel::{ParallelDims, run_local};

fn main() {
    all_to_all_bandwidth();
    layer_step_time();
    imbalance();
}

/// Uneven splits: rank r sends peer p a share proportional to `1 + (r + p) % n`.
fn all_to_all_bandwidth() {
    println!(
        "## all-to-all, uneven splits (a 2048 x 1024 f32 tensor per rank; GB/s counts the bytes leaving the rank)"
    );
    println!("{:>5} {:>14} {:>16}", "ranks", "ms / call", "GB/s per rank");
    for n in [2usize, 4] {
        let results = run_local(n, |group| {
            let r = group.rank();
            let weights: Vec<usize> = (0..n).map(|p| 1 + (r + p) % n).collect();
            let total_w: usize = weights.iter().sum();
            let rows = 2048;
            let sizes: Vec<usize> = {
                let mut s: Vec<usize> = weights.iter().map(|w| rows * w / total_w).collect();
                let rest = rows - s.iter().sum::<usize>();
                s[0] += rest;
                s
            };
            let data = TensorData::new(vec![1f32; rows * 1024], [rows, 1024]);
            let sent: usize = sizes
                .iter()
                .enumerate()
                .filter(|(p, _)| *p != r)
                .map(|(_, s)| s * 1024 * 4)
                .sum();
            for _ in 0..3 {
                group.all_to_all_data(data.clone(), 0, &sizes)?;
            }
            group.barrier()?;
            let iters = 20;
            let start = Instant::now();
            for _ in 0..iters {
                group.all_to_all_data(data.clone(), 0, &sizes)?;
            }
            let secs = start.elapsed().as_secs_f64() / iters as f64;
            Ok((secs, sent as f64 / secs / 1e9))
        })
        .unwrap();
        let ms = results.iter().map(|r| r.0).fold(0.0, f64::max) * 1e3;
        let gbs = results.iter().map(|r| r.1).sum::<f64>() / n as f64;
        println!("{n:>5} {ms:>14.2} {gbs:>16.2}");
    }
}

/// Forward + backward + reduction + AdamW of one MoE layer, 4 ranks (dp 4), ep 1, 2, 4.
fn layer_step_time() {
    let config = MoeConfig::new(128, 512, 8, 2);
    let tokens = 512;
    println!(
        "\n## MoE layer step (d 128, d_ff 512, 8 experts, top-2, {tokens} tokens per rank, 4 ranks)"
    );
    println!(
        "{:>4} {:>14} {:>22}",
        "ep", "ms / step", "expert params / rank"
    );
    for ep in [1usize, 2, 4] {
        let dims = ParallelDims {
            dp_replicate: 4,
            ep,
            ..ParallelDims::default()
        };
        let results = run_local(4, |group| {
            let device = Device::flex().autodiff();
            let mesh = dims.build(&group).unwrap();
            let parallel = MoeParallel::from_mesh(&dims, &mesh).unwrap();
            let mut moe = MoeLayer::build(&config, &Init::new(1, &device), &parallel).unwrap();
            let step = MoeStep::new(
                TrainStep::new(TpContext::single())
                    .with_data_parallel(dims.gradient_reduction(&mesh).unwrap()),
                &parallel,
            );
            let mut optim = AdamWConfig::new().init();
            let x: Tensor<2> = Tensor::from_data(
                init_normal(group.rank() as u64, "x", &[tokens, 128], 1.0),
                &device,
            );
            let mut times = Vec::new();
            for i in 0..8 {
                group.barrier()?;
                let start = Instant::now();
                let loss = moe.forward(x.clone()).unwrap().square().mean();
                moe = step.step(moe, loss, &mut optim, 1e-3).unwrap().0;
                if i >= 2 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            let expert_params: usize = moe
                .experts
                .iter()
                .map(burn::module::Module::num_params)
                .sum();
            Ok((
                times.iter().sum::<f64>() / times.len() as f64,
                expert_params,
            ))
        })
        .unwrap();
        let ms = results.iter().map(|r| r.0).fold(0.0, f64::max) * 1e3;
        println!("{ep:>4} {ms:>14.1} {:>22}", results[0].1);
    }
}

/// Single-device training of an MoE layer on a skewed input distribution, 200 steps.
fn imbalance() {
    let device = Device::flex().autodiff();
    let base = MoeConfig {
        score: ScoreFn::Softmax,
        ..MoeConfig::new(16, 32, 8, 2)
    };
    let with = |aux_loss: f64, z_loss: f64, bias_update_rate: f64| MoeConfig {
        aux_loss,
        z_loss,
        bias_update_rate,
        ..base.clone()
    };
    let methods = [
        ("none", with(0.0, 0.0, 0.0)),
        ("aux loss 1e-2", with(1e-2, 0.0, 0.0)),
        ("aux loss 1e-1", with(1e-1, 0.0, 0.0)),
        ("z-loss 1e-3", with(0.0, 1e-3, 0.0)),
        ("bias rate 1e-3", with(0.0, 0.0, 1e-3)),
        ("bias rate 1e-2", with(0.0, 0.0, 1e-2)),
        ("aux 1e-2 + bias 1e-2", with(1e-2, 0.0, 1e-2)),
    ];
    println!(
        "\n## expert load imbalance (max / mean tokens per expert), 8 experts top-2, 256 tokens \
         per step, 200 steps, skewed inputs"
    );
    println!(
        "{:<22} {:>8} {:>16} {:>12} {:>14}",
        "balancing", "step 0", "mean 150..200", "max", "final loss"
    );
    let m: Tensor<2> = Tensor::from_data(init_normal(99, "m", &[16, 16], 0.5), &device);
    let shift: Tensor<2> = Tensor::from_data(init_normal(98, "shift", &[1, 16], 1.5), &device);
    for (name, config) in methods {
        let mut moe = MoeLayer::new(&config, &Init::new(2, &device)).unwrap();
        let mut optim = AdamWConfig::new().init();
        let mut imb = Vec::new();
        let mut last = 0.0;
        for step in 0..200u64 {
            let x: Tensor<2> =
                Tensor::<2>::from_data(init_normal(step, "x", &[256, 16], 1.0), &device)
                    + shift.clone();
            let y = x.clone().matmul(m.clone()).tanh();
            let loss = (moe.forward(x.clone()).unwrap() + x - y).square().mean();
            last = loss.clone().into_scalar::<f32>();
            imb.push(moe.last_stats().unwrap().imbalance());
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &moe);
            moe = optim.step(3e-3, moe, grads);
            moe.update_bias();
        }
        let tail = &imb[150..];
        println!(
            "{name:<22} {:>8.2} {:>16.2} {:>12.2} {last:>14.4}",
            imb[0],
            tail.iter().sum::<f64>() / tail.len() as f64,
            imb.iter().copied().fold(0.0, f64::max)
        );
    }
}
