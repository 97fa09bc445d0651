//! Data parallelism building blocks: replicas made identical, gradients averaged exactly
//! (including parameters some ranks do not use), accumulation that averages micro-steps.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{BucketPlace, DistributedDataParallel, run_local};

/// Both ways of forming buckets must give the same results.
const PLACES: [BucketPlace; 2] = [BucketPlace::Host, BucketPlace::Device];

#[derive(Module, Debug)]
struct TwoHeads {
    shared: Linear,
    extra: Param<Tensor<1>>,
}

fn model(rank: usize, device: &Device) -> TwoHeads {
    // Deliberately different on every rank before the broadcast.
    let w: Vec<f32> = (0..6).map(|i| (i + 3 * rank) as f32 * 0.1).collect();
    let mut shared = LinearConfig::new(3, 2).init(device);
    shared.weight = Param::from_data(TensorData::new(w, [3, 2]), device);
    TwoHeads {
        shared,
        extra: Param::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), device),
    }
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

#[test]
fn broadcast_then_averaged_gradients_match_the_mean_of_per_rank_gradients() {
    for place in PLACES {
        averaged_gradients_match_the_mean(place);
    }
}

fn averaged_gradients_match_the_mean(place: BucketPlace) {
    let n = 3;
    // Per-rank inputs; rank r's loss is sum(shared(x_r)) (+ sum(extra) on rank 0 only).
    let input = |r: usize, d: &Device| Tensor::<2>::from_floats([[1.0 + r as f32, 2.0, -1.0]], d);
    let out = run_local(n, |group| {
        let device = Device::flex().autodiff();
        let ddp = DistributedDataParallel::new(group.clone())
            .with_bucket_bytes(8)
            .with_buckets(place);
        let m = ddp.broadcast_module(model(group.rank(), &device), 0)?;
        let mut loss = m.shared.forward(input(group.rank(), &device)).sum();
        if group.rank() == 0 {
            loss = loss + m.extra.val().sum();
        }
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        let grads = ddp.all_reduce_grads(&m, grads)?;
        let w = values(m.shared.weight.val());
        let gw = values(grads.get::<2>(m.shared.weight.id).unwrap());
        let ge = grads
            .get::<1>(m.extra.id)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        Ok((w, gw, ge))
    })
    .unwrap();
    let w0: Vec<f32> = (0..6).map(|i| i as f32 * 0.1).collect();
    // d sum(x W) / dW[i][j] = x[i]; averaged over ranks.
    let mean_x = [(1.0 + 2.0 + 3.0) / 3.0, 2.0, -1.0];
    let expected_gw: Vec<f32> = mean_x.iter().flat_map(|&x| [x, x]).collect();
    for (w, gw, ge) in out {
        assert_eq!(w, w0, "replicas equal rank 0's weights after the broadcast");
        for (a, b) in gw.iter().zip(&expected_gw) {
            assert!((a - b).abs() < 1e-6, "{gw:?} vs {expected_gw:?}");
        }
        // Only rank 0 used `extra`: the others contribute zeros to the average.
        assert_eq!(ge, vec![1.0 / 3.0; 2]);
    }
}

#[test]
fn accumulation_averages_micro_steps_and_ranks() {
    for place in PLACES {
        accumulation_averages(place);
    }
}

/// Accumulation is Burn's [`GradientsAccumulator`] over micro-batch losses scaled by `1 / k`,
/// then one [`DistributedDataParallel::all_reduce_grads`] (what `TrainStep::step_accumulated`
/// does): the mean over every micro-batch of every rank.
fn accumulation_averages(place: BucketPlace) {
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let ddp = DistributedDataParallel::new(group.clone()).with_buckets(place);
        let m = model(0, &device);
        let mut acc = GradientsAccumulator::<TwoHeads>::new();
        for micro in 0..3 {
            let scale = (1 + micro + 3 * group.rank()) as f32;
            let x = Tensor::<2>::from_floats([[scale, 0.0, 0.0]], &device);
            let loss = m.shared.forward(x).sum() / 3.0;
            acc.accumulate(&m, GradientsParams::from_grads(loss.backward(), &m));
        }
        let grads = ddp.all_reduce_grads(&m, acc.grads())?;
        Ok(values(grads.get::<2>(m.shared.weight.id).unwrap()))
    })
    .unwrap();
    // Mean of x[0] over 6 micro-steps: (1+2+3+4+5+6)/6 = 3.5.
    for g in out {
        for (got, want) in g.iter().zip([3.5, 3.5, 0.0, 0.0, 0.0, 0.0]) {
            assert!((got - want).abs() <= 1e-6, "{g:?}");
        }
    }
}

#[derive(Module, Debug)]
struct PartlyFrozen {
    trainable: Linear,
    frozen: Linear,
    /// Used by rank 0 only.
    rank0_only: Param<Tensor<1>>,
    /// Used by no rank.
    unused: Param<Tensor<1>>,
}

#[test]
fn frozen_and_unused_parameters_get_no_gradient_no_state_and_keep_their_value() {
    for place in PLACES {
        frozen_and_unused(place);
    }
}

fn frozen_and_unused(place: BucketPlace) {
    use burn::optim::AdamWConfig;
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let ddp = DistributedDataParallel::new(group.clone())
            .with_bucket_bytes(16)
            .with_buckets(place);
        let m = PartlyFrozen {
            trainable: model(0, &device).shared,
            frozen: model(1, &device).shared.no_grad(),
            rank0_only: Param::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &device),
            unused: Param::from_data(TensorData::new(vec![3.0f32, 4.0], [2]), &device),
        };
        let m = ddp.broadcast_module(m, 0)?;
        assert!(
            !m.frozen.weight.val().is_require_grad(),
            "broadcast keeps the flag"
        );
        let before = (
            values(m.frozen.weight.val()),
            m.unused.val().into_data().try_to_vec::<f32>().unwrap(),
        );
        let x = Tensor::<2>::from_floats([[1.0 + group.rank() as f32, 2.0, -1.0]], &device);
        let h = m.frozen.forward(x);
        let mut loss = m
            .trainable
            .forward(h.clone().matmul(Tensor::ones([2, 3], &device)))
            .sum();
        if group.rank() == 0 {
            loss = loss + m.rank0_only.val().sum();
        }
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        let grads = ddp.all_reduce_grads(&m, grads)?;
        let has = |id| grads.get::<2>(id).is_some();
        let flags = (
            has(m.trainable.weight.id),
            has(m.frozen.weight.id),
            grads.get::<1>(m.rank0_only.id).is_some(),
            grads.get::<1>(m.unused.id).is_some(),
        );
        let rank0_only = grads
            .get::<1>(m.rank0_only.id)
            .map(|g| g.into_data().try_to_vec::<f32>().unwrap());
        let mut optim = AdamWConfig::new().with_weight_decay(0.5).init();
        let m = optim.step(0.1, m, grads);
        let after = (
            values(m.frozen.weight.val()),
            m.unused.val().into_data().try_to_vec::<f32>().unwrap(),
        );
        Ok((flags, rank0_only, before, after, optim.to_record().len()))
    })
    .unwrap();
    for (flags, rank0_only, before, after, state_tensors) in out {
        assert_eq!(
            flags,
            (true, false, true, false),
            "(trainable, frozen, rank0_only, unused) have a reduced gradient"
        );
        // Used on one rank of two: averaged with the other rank's zeros.
        assert_eq!(rank0_only, Some(vec![0.5, 0.5]));
        assert_eq!(
            before, after,
            "frozen and unused parameters keep their exact value"
        );
        // AdamW keeps two moments per parameter with state: only for the trainable weight and
        // bias and `rank0_only`, none for the frozen weight and bias or `unused`.
        assert_eq!(state_tensors, 2 * 3, "optimizer state tensors");
    }
}

/// Replicas that differ are an error on every rank (no rank left waiting in a collective),
/// naming the first differing parameter and the ranks on each side; broadcasting fixes them.
#[test]
fn differing_replicas_are_an_error_on_every_rank() {
    use burn_parallel::ReplicaError;
    let n = 3;
    let out = run_local(n, |group| {
        let device = Device::flex().autodiff();
        let ddp = DistributedDataParallel::new(group.clone());
        // `shared.weight` differs on rank 2 only; `extra` is the same everywhere.
        let m = model(if group.rank() == 2 { 1 } else { 0 }, &device);
        let before = ddp.verify_replicas(&m);
        let m = ddp.broadcast_module(m, 0)?;
        Ok((before, ddp.verify_replicas(&m)))
    })
    .unwrap();
    for (before, after) in out {
        match before {
            Err(ReplicaError::Mismatch {
                ref path,
                ref agreeing,
                ref differing,
                ..
            }) => {
                assert_eq!(path, "shared.weight");
                assert_eq!(agreeing, &vec![0, 1]);
                assert_eq!(differing, &vec![2]);
                let text = before.as_ref().unwrap_err().to_string();
                assert!(text.contains("broadcast from rank 0"), "{text}");
                assert!(text.contains("same seed"), "{text}");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        assert_eq!(after, Ok(()));
    }
}

/// Buckets formed as device tensors reduce to the same bits as host buckets: three ranks,
/// buckets cut mid-model, a half-precision parameter (a bucket of its own dtype), a gradient
/// in f32 for it (cast to the parameter's dtype), accumulation scaling.
#[test]
fn device_buckets_equal_host_buckets_bit_for_bit() {
    use burn::tensor::DType;
    #[derive(Module, Debug)]
    struct Mixed {
        a: Linear,
        half: Param<Tensor<1>>,
        b: Linear,
    }
    let run = |place: BucketPlace| {
        run_local(3, |group| {
            let device = Device::flex().autodiff();
            let ddp = DistributedDataParallel::new(group.clone())
                .with_bucket_bytes(40)
                .with_buckets(place);
            let r = group.rank() as f32;
            // Deterministic weights, so both runs start from the same model.
            let linear = |i: usize, o: usize| {
                let mut l = LinearConfig::new(i, o).init(&device);
                let w: Vec<f32> = (0..i * o)
                    .map(|k| ((k * 7) % 11) as f32 * 0.1 - 0.5)
                    .collect();
                l.weight = Param::from_data(TensorData::new(w, [i, o]), &device);
                l.bias = Some(Param::from_data(
                    TensorData::new(vec![0.1f32; o], [o]),
                    &device,
                ));
                l
            };
            let mut m = Mixed {
                a: linear(5, 4),
                half: Param::from_data(
                    TensorData::new(vec![0.5f32, -1.5, 2.0], [3]).convert_dtype(DType::F16),
                    &device,
                ),
                b: linear(4, 3),
            };
            m = ddp.broadcast_module(m, 0)?;
            let mut acc = GradientsAccumulator::<Mixed>::new();
            for micro in 0..2 {
                let x = Tensor::<2>::from_floats(
                    [[1.0 + r, 0.3 * micro as f32, -2.0, r * r, 0.7]],
                    &device,
                );
                let h = m.b.forward(m.a.forward(x).tanh());
                let loss = (h * m.half.val().cast(DType::F32).reshape([1, 3]))
                    .powf_scalar(2.0)
                    .sum()
                    / 2.0;
                acc.accumulate(&m, GradientsParams::from_grads(loss.backward(), &m));
            }
            let grads = ddp.all_reduce_grads(&m, acc.grads())?;
            let bits = |t: Tensor<1>| t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
            let flat = |t: Tensor<2>| bits(t.flatten(0, 1));
            Ok(vec![
                flat(grads.get::<2>(m.a.weight.id).unwrap()),
                bits(grads.get::<1>(m.a.bias.as_ref().unwrap().id).unwrap()),
                bits(grads.get::<1>(m.half.id).unwrap()),
                flat(grads.get::<2>(m.b.weight.id).unwrap()),
                bits(grads.get::<1>(m.b.bias.as_ref().unwrap().id).unwrap()),
            ])
        })
        .unwrap()
    };
    let (host, device) = (run(BucketPlace::Host), run(BucketPlace::Device));
    assert_eq!(host, device);
    // Every rank holds the same average, and it is not trivially zero.
    assert!(host.iter().all(|r| *r == host[0]));
    assert!(host[0].iter().flatten().any(|&g| g != 0.0));
}
