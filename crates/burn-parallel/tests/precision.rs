//! The precision policy of `TrainStep`: fp32 master weights under bf16/fp16 compute, gradients
//! reduced in the chosen dtype, dynamic loss scaling that skips an overflowing step.

use burn::optim::AdamWConfig;
use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::{Linear, TpContext};
use burn_parallel::precision::{LossScaler, MixedPrecision};
use burn_parallel::run_local;
use burn_parallel::train::TrainStep;

mod common;

fn model(device: &Device) -> Linear {
    Init::new(5, device)
        .linear("fc", LinearInit::new(16, 8).with_bias(true))
        .unwrap()
}

fn batch(step: usize, rank: usize, device: &Device) -> Tensor<2> {
    let data: Vec<f32> = (0..4 * 16)
        .map(|i| (((i * 7 + step * 13 + rank * 31) % 17) as f32 - 8.0) / 8.0)
        .collect();
    Tensor::<1>::from_floats(data.as_slice(), device).reshape([4, 16])
}

/// `steps` steps of `step` on `model`, the loss being the mean square of the output; returns
/// the losses, the skipped flags and the final weight.
fn train(
    step: &TrainStep,
    mut model: Linear,
    steps: usize,
    rank: usize,
    device: &Device,
) -> (Vec<f32>, Vec<bool>, Vec<f32>) {
    let mut optim = AdamWConfig::new().init();
    let dtype = step.precision().param_dtype;
    let (mut losses, mut skipped) = (Vec::new(), Vec::new());
    for i in 0..steps {
        let x = batch(i, rank, device).cast(dtype);
        let (next, out) = step
            .step_with(
                model,
                |m| m.forward(x).map(|y| y.powi_scalar(2).mean()),
                &mut optim,
                1e-2,
            )
            .unwrap();
        model = next;
        losses.push(out.loss);
        skipped.push(out.skipped);
    }
    let w = model.weight.val();
    assert_eq!(w.dtype(), DType::F32, "the master weights stay fp32");
    (losses, skipped, w.into_data().try_to_vec::<f32>().unwrap())
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max)
}

#[test]
fn bf16_compute_tracks_fp32_with_fp32_master_weights() {
    let device = Device::flex().autodiff();
    let single = TpContext::single();
    let (f32_losses, _, f32_w) = train(
        &TrainStep::new(single.clone()),
        model(&device),
        10,
        0,
        &device,
    );
    let bf16 = TrainStep::new(single).with_precision(MixedPrecision::bf16());
    let (losses, skipped, w) = train(&bf16, model(&device), 10, 0, &device);
    assert!(skipped.iter().all(|s| !s));
    // bf16 has 8 bits of mantissa: about 4e-3 relative per rounding.
    let (dl, dw) = (max_rel(&losses, &f32_losses), max_rel(&w, &f32_w));
    assert!(
        dl < 3e-2,
        "bf16 losses {losses:?} against fp32 {f32_losses:?}: {dl}"
    );
    assert!(dw < 2e-2, "bf16 weights differ from fp32 by {dw}");
    // And bf16 really ran: the curves are not identical.
    assert!(
        dl > 0.0,
        "bf16 gave fp32's losses bit for bit: the compute copy was not used"
    );
}

/// Accumulation under mixed precision: every micro-batch's forward runs on a compute copy of its
/// own (a copy shared by two micro-batches would have its casts' graph consumed by the first
/// backward, and the second would panic in Burn's autodiff). Two micro-batches of two rows
/// each give the step of the four rows at once, up to bf16's rounding.
#[test]
fn bf16_accumulation_casts_a_compute_copy_per_micro_batch() {
    let device = Device::flex().autodiff();
    let step = TrainStep::new(TpContext::single()).with_precision(MixedPrecision::bf16());
    let run = |micro: usize| {
        let mut model = model(&device);
        let mut optim = AdamWConfig::new().init();
        let mut losses = Vec::new();
        for i in 0..5 {
            let x = batch(i, 0, &device).cast(DType::BF16);
            let rows = 4 / micro;
            let mut forward = |m: &Linear, k: usize| {
                let x = x.clone().narrow(0, k * rows, rows);
                m.forward(x).map(|y| y.powi_scalar(2).mean())
            };
            let (next, out) = step
                .step_accumulated(model, micro, &mut forward, &mut optim, 1e-2)
                .unwrap();
            model = next;
            losses.push(out.loss);
        }
        assert_eq!(model.weight.val().dtype(), DType::F32);
        (
            losses,
            model.weight.val().into_data().try_to_vec::<f32>().unwrap(),
        )
    };
    let (whole, whole_w) = run(1);
    let (accumulated, w) = run(2);
    assert!(
        max_rel(&accumulated, &whole) < 1e-2 && max_rel(&w, &whole_w) < 1e-2,
        "2 micro-batches {accumulated:?} against one batch {whole:?}"
    );
}

#[test]
fn data_parallel_bf16_averages_in_the_chosen_dtype() {
    // Two ranks on half batches each against one rank on both halves is not the same batch;
    // compare two ranks with fp32 reduction and with bf16 reduction instead: they agree to
    // bf16 rounding, and differ (the reduction dtype is really used).
    let run = |reduce: DType| {
        run_local(2, move |group| {
            let device = Device::flex().autodiff();
            let step = TrainStep::new(TpContext::single())
                .with_data_parallel(group.clone())
                .with_precision(MixedPrecision::bf16().with_reduce_dtype(reduce));
            Ok(train(&step, model(&device), 6, group.rank(), &device))
        })
        .unwrap()
    };
    let exact = run(DType::F32);
    let halved = run(DType::BF16);
    for reports in [&exact, &halved] {
        assert_eq!(reports[0].2, reports[1].2, "the replicas stay identical");
    }
    let dw = max_rel(&halved[0].2, &exact[0].2);
    assert!(dw < 2e-2, "bf16 reduction moved the weights by {dw}");
    assert!(
        dw > 0.0,
        "the reduction dtype made no difference: it was not used"
    );
}

#[test]
fn fp16_loss_scaling_skips_an_overflowing_step_and_recovers() {
    fp16_loss_scaling_on(&Device::flex().autodiff());
}

/// The same on WGPU (CubeCL's f16 kernels, Burn's fusion): an overflow there is an inf too,
/// and the step is skipped.
#[cfg(feature = "wgpu")]
#[test]
fn fp16_loss_scaling_on_wgpu_skips_an_overflowing_step_and_recovers() {
    if let Some(device) = common::wgpu_f16_device("fp16_loss_scaling_on_wgpu") {
        fp16_loss_scaling_on(&device.autodiff());
    }
}

/// An overflowing step skipped (weights untouched, scale backed off), the next ones applied,
/// and fp16 with scaling within 5e-3 of fp32, on `device`.
fn fp16_loss_scaling_on(device: &Device) {
    let device = device.clone();
    // 2^40 times any loss overflows fp16 (max 65504): the first step must be skipped, the
    // scale backed off to 2^10, and the next steps applied.
    let scaler = LossScaler::new(2f64.powi(40)).with_factors(2.0, 2f64.powi(-30));
    let step = TrainStep::new(TpContext::single())
        .with_precision(MixedPrecision::f16())
        .with_loss_scaler(scaler);
    let start = model(&device);
    let w0 = start.weight.val().into_data().try_to_vec::<f32>().unwrap();
    let (losses, skipped, w) = train(&step, start.clone(), 1, 0, &device);
    assert_eq!(skipped, vec![true], "losses {losses:?}");
    assert_eq!(w, w0, "a skipped step leaves the weights alone");
    assert_eq!(step.loss_scale(), 1024.0);
    // The step shares its scaler with the next run: it goes on at the backed-off scale.
    let (_, skipped, w) = train(&step, start, 4, 0, &device);
    assert!(skipped.iter().all(|s| !s), "{skipped:?}");
    assert_ne!(w, w0, "the applied steps moved the weights");
    let scaler = step.loss_scaler().unwrap();
    assert_eq!(scaler.skipped(), 1);

    // fp16 with scaling tracks fp32.
    let f32_run = train(
        &TrainStep::new(TpContext::single()),
        model(&device),
        5,
        0,
        &device,
    );
    let fp16 = TrainStep::new(TpContext::single())
        .with_precision(MixedPrecision::f16())
        .with_loss_scaler(LossScaler::new(1024.0));
    let fp16_run = train(&fp16, model(&device), 5, 0, &device);
    let dw = max_rel(&fp16_run.2, &f32_run.2);
    assert!(dw < 5e-3, "fp16 weights differ from fp32 by {dw}");
}

#[test]
fn reduce_refuses_to_hide_an_overflow() {
    let device = Device::flex().autodiff();
    let m = model(&device);
    let step = TrainStep::new(TpContext::single()).with_loss_scaler(LossScaler::new(8.0));
    let loss = m
        .forward(Tensor::<2>::random([2, 16], Distribution::Default, &device))
        .unwrap()
        .sum();
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &m);
    let err = step.reduce(&m, grads).unwrap_err().to_string();
    assert!(err.contains("reduce_scaled"), "{err}");
}

/// `step_accumulated` refuses zero micro-batches as a typed error naming what to change;
/// under overlapped data parallelism it accumulates (it refused before): two micro-batches on
/// different rows per replica, and the replicas still end identical.
#[test]
fn step_accumulated_refuses_zero_micro_batches_and_accumulates_under_overlap() {
    use burn_parallel::overlap::OverlappedDdp;
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let mut optim = AdamWConfig::new().init();
        let rank = group.rank();
        let forward =
            |m: &Linear, k: usize| m.forward(batch(0, 2 * rank + k, &device)).map(|y| y.mean());
        let zero = TrainStep::new(TpContext::single())
            .step_accumulated(model(&device), 0, forward, &mut optim, 1e-2)
            .unwrap_err();
        let (m, _) = TrainStep::new(TpContext::single())
            .with_overlap(OverlappedDdp::new(group.clone()))
            .step_accumulated(model(&device), 2, forward, &mut optim, 1e-2)
            .unwrap();
        let weights = m.weight.val().into_data().try_to_vec::<f32>().unwrap();
        Ok((zero.to_string(), weights))
    })
    .unwrap();
    assert!(out[0].0.contains("zero micro-batches"), "{}", out[0].0);
    assert_eq!(
        out[0].1, out[1].1,
        "the replicas diverged: no reduction ran"
    );
}

/// Under overlapped data parallelism one micro-batch is the overlapped step itself: the
/// replicas train on different rows and still end identical (their gradients were averaged).
#[test]
fn step_accumulated_with_overlap_averages_over_the_replicas() {
    use burn_parallel::overlap::OverlappedDdp;
    let weights = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let mut optim = AdamWConfig::new().init();
        let step =
            TrainStep::new(TpContext::single()).with_overlap(OverlappedDdp::new(group.clone()));
        let rank = group.rank();
        let x = batch(0, rank, &device);
        let (m, _) = step
            .step_accumulated(
                model(&device),
                1,
                |m, _| m.forward(x.clone()).map(|y| y.powi_scalar(2).mean()),
                &mut optim,
                1e-2,
            )
            .unwrap();
        Ok(m.weight.val().into_data().try_to_vec::<f32>().unwrap())
    })
    .unwrap();
    assert_eq!(
        weights[0], weights[1],
        "the replicas diverged: no reduction ran"
    );
}
