//! The sharded optimizer gives Burn's own update, element for element, and the flat layout
//! round-trips.

use burn::nn::LinearConfig;
use burn::optim::{
    AdaGradConfig, AdamConfig, AdamWConfig, AdanConfig, LionConfig, RmsPropConfig, SgdConfig,
};
use burn::tensor::Device;
use burn_zero::flat::{FlatLayout, host_f32, shard_range, tensor_1d};
use burn_zero::optim::{ElementWise, ShardedOptimizer};

fn check<O: ElementWise>(optim: O) {
    let device = Device::flex();
    let p: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut full_state = None;
    let mut full = tensor_1d(p.clone(), &device);
    let mut sharded = ShardedOptimizer::new(optim.clone(), 3);
    let mut shards: Vec<_> = (0..3)
        .map(|r| tensor_1d(p[shard_range(37, r, 3)].to_vec(), &device))
        .collect();
    for step in 0..4 {
        let g: Vec<f32> = (0..37)
            .map(|i| ((i * (step + 3)) as f32 * 0.11).cos())
            .collect();
        let (next, state) = optim.step(1e-2, full, tensor_1d(g.clone(), &device), full_state);
        full = next;
        full_state = state;
        for (r, s) in shards.iter_mut().enumerate() {
            let grad = tensor_1d(g[shard_range(37, r, 3)].to_vec(), &device);
            *s = sharded.step(r, 1e-2, s.clone(), grad);
        }
    }
    let joined: Vec<f32> = shards.into_iter().flat_map(host_f32).collect();
    assert_eq!(joined, host_f32(full), "sharded update must equal Burn's");
}

#[test]
fn sharded_adamw_adam_sgd_equal_burn() {
    check(AdamWConfig::new().with_weight_decay(0.1).build());
    check(AdamConfig::new().build());
    check(SgdConfig::new().build());
    // Every optimizer `ElementWise` is implemented for really is element-wise.
    check(RmsPropConfig::new().build());
    check(AdaGradConfig::new().build());
    check(LionConfig::new().build());
    check(AdanConfig::new().build());
}

#[test]
fn export_import_round_trips_and_checks_lengths() {
    let device = Device::flex();
    let mut a = ShardedOptimizer::new(AdamWConfig::new().build(), 1);
    let p = a.step(
        0,
        0.1,
        tensor_1d(vec![1.0; 5], &device),
        tensor_1d(vec![0.5; 5], &device),
    );
    let (tensors, scalars) = a.export(0);
    assert_eq!(tensors.len(), 2);
    let mut b = ShardedOptimizer::new(AdamWConfig::new().build(), 1);
    b.import(0, tensors.clone(), &scalars, 5, &device).unwrap();
    let g = tensor_1d(vec![0.25; 5], &device);
    assert_eq!(
        host_f32(a.step(0, 0.1, p.clone(), g.clone())),
        host_f32(b.step(0, 0.1, p, g))
    );
    assert!(b.import(0, tensors, &scalars, 4, &device).is_err());
}

#[test]
fn flat_layout_round_trips() {
    let device = Device::flex();
    let linear = LinearConfig::new(3, 4).init(&device);
    let layout = FlatLayout::of(&linear, |_| true);
    let flat = layout.flatten(&linear).unwrap();
    let doubled: Vec<f32> = flat.iter().map(|v| v * 2.0).collect();
    let other = layout
        .unflatten(linear, tensor_1d(doubled.clone(), &device), false)
        .unwrap();
    assert_eq!(layout.flatten(&other).unwrap(), doubled);
    assert!(
        layout
            .unflatten(other, tensor_1d(vec![0.0; 3], &device), false)
            .is_err()
    );
}
