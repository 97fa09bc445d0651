//! `ZeroOptimizer::gradient_squares` picks parameters anywhere in the flat space, including
//! those that lie wholly in another rank's shard (this rank then contributes nothing, summed on
//! its device over no elements), and the parts add up to the whole, at stages 1 and 2.

use burn::nn::{Initializer, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{CollectiveError, run_local};
use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroOptimizer};

#[test]
fn squares_of_parameters_outside_a_ranks_shard_add_up_to_the_whole() {
    for stage in [Stage::One, Stage::Two] {
        let out = run_local(2, |group| {
            let device = Device::flex().autodiff();
            // 12 weights then 3 biases: the biases lie in rank 1's shard (elements 8..15).
            let model = LinearConfig::new(4, 3)
                .with_initializer(Initializer::Constant { value: 0.1 })
                .init(&device);
            let mut zero = ZeroOptimizer::new(
                &model,
                ShardGroups::flat(group.clone()),
                ZeroConfig::new(stage),
                AdamWConfig::new().build(),
            )
            .map_err(|e| CollectiveError::InvalidArgument {
                rank: group.rank(),
                op: "test".into(),
                reason: e.to_string(),
            })?;
            let x: Vec<f32> = (0..8)
                .map(|i| (i as f32 + group.rank() as f32).sin())
                .collect();
            let x = Tensor::<2>::from_data(TensorData::new(x, [2, 4]), &device);
            let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
            zero.accumulate(&model, grads).unwrap();
            let bias = model.bias.as_ref().expect("a bias").id;
            let weight = model.weight.id;
            let all = zero.gradient_squares(|_| true).unwrap();
            let of_bias = zero.gradient_squares(|id| id == bias).unwrap();
            let of_weight = zero.gradient_squares(|id| id == weight).unwrap();
            Ok((all, of_weight, of_bias))
        })
        .unwrap();
        assert_eq!(out[0], out[1], "{stage:?}: every rank gets the same sums");
        let (all, of_weight, of_bias) = out[0];
        // The bias gradient is the mean over ranks of the batch's row count (2): 2 each.
        assert!(
            (of_bias - 3.0 * 4.0).abs() < 1e-5,
            "{stage:?}: bias squares {of_bias}"
        );
        assert!(of_weight > 0.0, "{stage:?}");
        assert!(
            (of_weight + of_bias - all).abs() < 1e-5 * all,
            "{stage:?}: {of_weight} + {of_bias} != {all}"
        );
    }
}
