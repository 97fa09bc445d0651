//! Data parallelism building blocks: replicas made identical, gradients averaged exactly
//! (including parameters some ranks do not use), accumulation that averages micro-steps.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{DistributedDataParallel, run_local};

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
    let n = 3;
    // Per-rank inputs; rank r's loss is sum(shared(x_r)) (+ sum(extra) on rank 0 only).
    let input = |r: usize, d: &Device| Tensor::<2>::from_floats([[1.0 + r as f32, 2.0, -1.0]], d);
    let out = run_local(n, |group| {
        let device = Device::flex().autodiff();
        let ddp = DistributedDataParallel::new(group.clone()).with_bucket_bytes(8);
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
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let ddp = DistributedDataParallel::new(group.clone());
        let m = model(0, &device);
        let mut acc = ddp.accumulator();
        for micro in 0..3 {
            let scale = (1 + micro + 3 * group.rank()) as f32;
            let x = Tensor::<2>::from_floats([[scale, 0.0, 0.0]], &device);
            let loss = m.shared.forward(x).sum();
            acc.accumulate(&m, GradientsParams::from_grads(loss.backward(), &m));
        }
        assert_eq!(acc.steps(), 3);
        let grads = acc.finish(&m)?;
        Ok(values(grads.get::<2>(m.shared.weight.id).unwrap()))
    })
    .unwrap();
    // Mean of x[0] over 6 micro-steps: (1+2+3+4+5+6)/6 = 3.5.
    for g in out {
        assert_eq!(g, vec![3.5, 3.5, 0.0, 0.0, 0.0, 0.0]);
    }
    let err = run_local(1, |group| {
        let m = model(0, &Device::flex().autodiff());
        DistributedDataParallel::new(group)
            .accumulator()
            .finish(&m)
            .map(|_| ())
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("no gradients were accumulated"),
        "{err}"
    );
}
