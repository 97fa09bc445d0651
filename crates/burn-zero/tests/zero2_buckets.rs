//! ZeRO-2's bucket-by-bucket reduce-scatter gives the update of ZeRO-1's full all-reduce, for
//! buckets of every size (one parameter per bucket, several, one bucket for all), uneven
//! shards (3 ranks), buckets straddling shard boundaries, gradient accumulation, and a
//! parameter used on one rank only.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{CollectiveError, run_local};
use burn_zero::flat::FlatLayout;
use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};

#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
    rank0_only: Param<Tensor<1>>,
}

fn net(device: &Device) -> Net {
    let m = Net {
        a: LinearConfig::new(5, 7).init(&Device::flex()),
        b: LinearConfig::new(7, 3).init(&Device::flex()),
        rank0_only: Param::from_data(TensorData::new(vec![0.5f32; 4], [4]), &Device::flex()),
    };
    // Deterministic values, identical on every rank.
    let layout = FlatLayout::of(&m, |_| true);
    let values = (0..layout.numel())
        .map(|i| (i as f32 * 0.29).sin() * 0.4)
        .collect();
    layout
        .unflatten(m, burn_zero::flat::tensor_1d(values, device), true)
        .unwrap()
}

fn run(stage: Stage, bucket_bytes: usize, ranks: usize, micro: usize) -> Vec<f32> {
    let out = run_local(ranks, |group| {
        let device = Device::flex().autodiff();
        let mut m = net(&device);
        let config = ZeroConfig::new(stage)
            .with_bucket_bytes(bucket_bytes)
            .with_max_grad_norm(Some(0.5));
        let mut zero = ZeroOptimizer::new(
            &m,
            ShardGroups::flat(group.clone()),
            config,
            AdamWConfig::new().with_weight_decay(0.1).build(),
        )
        .map_err(|e| CollectiveError::InvalidArgument {
            rank: group.rank(),
            op: "test".into(),
            reason: e.to_string(),
        })?;
        for step in 0..3 {
            for k in 0..micro {
                let x: Vec<f32> = (0..10)
                    .map(|i| ((i + 3 * group.rank() + 7 * k + step) as f32 * 0.3).cos())
                    .collect();
                let x = Tensor::<2>::from_data(TensorData::new(x, [2, 5]), &device);
                let mut loss = m.b.forward(m.a.forward(x).tanh()).powf_scalar(2.0).sum();
                if group.rank() == 0 {
                    loss = loss + m.rank0_only.val().powf_scalar(2.0).sum();
                }
                let grads = GradientsParams::from_grads(loss.backward(), &m);
                zero.accumulate(&m, grads).unwrap();
            }
            m = zero.step(1e-2, m).unwrap().0;
        }
        Ok(FlatLayout::of(&m, |_| true).flatten(&m).unwrap())
    })
    .unwrap();
    for o in &out[1..] {
        assert_eq!(o, &out[0], "every rank holds the same parameters");
    }
    out[0].clone()
}

#[test]
fn bucketed_reduce_scatter_matches_the_full_all_reduce() {
    for (ranks, micro) in [(3, 1), (2, 2), (1, 1)] {
        let reference = run(Stage::One, usize::MAX, ranks, micro);
        // 1 byte: one parameter per bucket; 100 bytes: buckets of a few parameters that
        // straddle shard boundaries; 1 MB: one bucket.
        for bucket in [1, 100, 1 << 20] {
            let bucketed = run(Stage::Two, bucket, ranks, micro);
            for (a, b) in reference.iter().zip(&bucketed) {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                    "{ranks} ranks x {micro} micro, buckets of {bucket} bytes: {a} vs {b}"
                );
            }
        }
    }
}
