//! Mixed precision and dynamic loss scaling of the ZeRO wrappers, on two thread ranks:
//!
//! - an overflow injected on one rank only skips the step on every rank, halves the scale and
//!   leaves weights (master and compute copies) and optimizer state bit for bit untouched, at
//!   stages 1 and 2 and under FSDP (`Fsdp<M>` with the library's step), in fp32 and bf16; the
//!   next clean step is applied;
//! - under bf16 the module computes in bf16 while master weights and optimizer state are fp32;
//! - on flex the f16 policy validates and the module computes in f16 over fp32 master weights;
//! - misuse (an unprepared module, an invalid scaler or policy) is a typed error.

use std::collections::BTreeMap;

use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamW, AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::{CollectiveError, run_local};
use burn_zero::flat::{FlatLayout, host_f32};
use burn_zero::optim::ShardedOptimizer;
use burn_zero::{
    LossScaler, MixedPrecision, ShardGroups, Stage, StepInfo, ZeroConfig, ZeroError, ZeroOptimizer,
};
use serde_json::Value;

type State = (Vec<(String, TensorData)>, BTreeMap<String, Value>);

fn state_of(optim: &ShardedOptimizer<AdamW>, unit: usize) -> State {
    optim.export(unit)
}

fn same_state(a: &State, b: &State) -> bool {
    a.1 == b.1
        && a.0.len() == b.0.len()
        && a.0.iter().zip(&b.0).all(|((na, da), (nb, db))| {
            na == nb && da.dtype() == db.dtype() && da.as_bytes() == db.as_bytes()
        })
}

fn to_collective(e: ZeroError) -> CollectiveError {
    CollectiveError::InvalidArgument {
        rank: 0,
        op: "test".into(),
        reason: e.to_string(),
    }
}

fn model(device: &Device) -> Linear {
    // Deterministic values: the parameters must be identical on every rank.
    let m = LinearConfig::new(6, 5).init(&Device::flex());
    let layout = FlatLayout::of(&m, |_| true);
    let values = (0..layout.numel())
        .map(|i| (i as f32 * 0.37).sin() * 0.3)
        .collect();
    layout
        .unflatten(m, burn_zero::flat::tensor_1d(values, device), true)
        .unwrap()
}

/// The gradient of `sum(model(x)) * factor`: `factor = inf` injects an overflow.
fn loss(m: &Linear, device: &Device, factor: f32, scale: f64) -> Tensor<1> {
    let x = Tensor::<2>::from_data(
        TensorData::new((0..12).map(|i| i as f32 * 0.1).collect(), [2, 6]),
        device,
    )
    .cast(m.weight.val().dtype());
    let y = m.forward(x);
    let y = if y.dtype() == DType::F32 {
        y
    } else {
        y.cast(DType::F32)
    };
    (y.sum() * factor) * scale
}

/// Step 0 clean, step 1 with an overflow on rank 1 only, step 2 clean. Returns the step infos.
fn zero12_overflow(stage: Stage, precision: MixedPrecision) -> Vec<[StepInfo; 3]> {
    run_local(2, move |group| {
        let device = Device::flex().autodiff();
        let m = model(&device);
        let config = ZeroConfig::new(stage)
            .with_precision(precision)
            .with_max_grad_norm(Some(1.0))
            .with_loss_scaler(Some(LossScaler::new(1024.0).with_growth_interval(100)));
        let mut zero = ZeroOptimizer::new(
            &m,
            ShardGroups::flat(group.clone()),
            config,
            AdamWConfig::new().build(),
        )
        .map_err(to_collective)?;
        let mut m = zero.prepare_module(m).map_err(to_collective)?;
        let mut infos = Vec::new();
        for step in 0..3 {
            let factor = if step == 1 && group.rank() == 1 {
                f32::INFINITY
            } else {
                1.0
            };
            let before_params = zero.layout().flatten(&m).unwrap();
            let before_master = zero.master().map(|t| host_f32(t.clone()));
            let before_state = state_of(zero.optimizer(), 0);
            let scale = zero.loss_scale();
            let grads = loss(&m, &device, factor, scale).backward();
            zero.accumulate(&m, GradientsParams::from_grads(grads, &m))
                .map_err(to_collective)?;
            let (next, info) = zero.step(1e-2, m).map_err(to_collective)?;
            m = next;
            let after_params = zero.layout().flatten(&m).unwrap();
            let after_master = zero.master().map(|t| host_f32(t.clone()));
            let after_state = state_of(zero.optimizer(), 0);
            assert_eq!(info.loss_scale, scale);
            if step == 1 {
                assert!(
                    info.skipped,
                    "rank {}: the overflow must skip",
                    group.rank()
                );
                assert_eq!(zero.loss_scale(), 512.0, "the scale must be halved");
                assert_eq!(before_params, after_params, "weights must not move");
                assert_eq!(before_master, after_master, "master weights must not move");
                assert!(
                    same_state(&before_state, &after_state),
                    "optimizer state must not move"
                );
                assert_eq!(zero.scaler().unwrap().skipped(), 1);
            } else {
                assert!(!info.skipped);
                assert!(info.grad_norm.unwrap().is_finite());
                assert_ne!(before_params, after_params, "a clean step updates");
                assert!(!same_state(&before_state, &after_state));
            }
            if precision.param_dtype != DType::F32 {
                // Master weights and optimizer state stay fp32; the module computes low.
                assert_eq!(zero.master().unwrap().dtype(), DType::F32);
                assert!(after_state.0.iter().all(|(_, d)| d.dtype() == DType::F32));
                assert_eq!(m.weight.val().dtype(), precision.param_dtype);
            } else {
                assert!(zero.master().is_none());
            }
            infos.push(info);
        }
        Ok([infos[0], infos[1], infos[2]])
    })
    .unwrap()
}

#[test]
fn injected_overflow_skips_zero_1_and_2_steps() {
    for stage in [Stage::One, Stage::Two] {
        for precision in [MixedPrecision::full(), MixedPrecision::bf16()] {
            let infos = zero12_overflow(stage, precision);
            assert_eq!(infos[0], infos[1], "both ranks see the same steps");
        }
    }
}

/// FSDP (`Fsdp<M>` trained by the library's step) in fp32 and bf16 with dynamic loss scaling:
/// an overflow injected on rank 1 only skips that step on both ranks, halves the scale and
/// leaves the fp32 master shard as it was; the run then ends, bit for bit, where the run that
/// never saw the overflowing batch ends (so the optimizer state was not touched either: a
/// moment or step counter moved by the skipped step would change the next update).
#[test]
fn injected_overflow_skips_fsdp_step() {
    use burn_parallel::init::Init;
    use burn_parallel::nn::TpContext;
    use burn_parallel::train::TrainStep;
    use burn_zero::{Fsdp, FsdpPlan};
    let weights = |m: &Linear| {
        let mut v = host_f32(m.weight.val());
        v.extend(host_f32(m.bias.as_ref().unwrap().val()));
        v
    };
    for precision in [MixedPrecision::full(), MixedPrecision::bf16()] {
        let run = |factors: &'static [f32]| {
            run_local(2, move |group| {
                let device = Device::flex().autodiff();
                let plan = FsdpPlan::new(&group).unit("linear");
                let init = Init::new(0, &device).at("linear");
                let mut unit: Fsdp<Linear> = plan
                    .wrap(&init, |_| Ok::<_, ZeroError>(model(&device)))
                    .map_err(to_collective)?;
                plan.finish().map_err(to_collective)?;
                let step = TrainStep::new(TpContext::single())
                    .with_fsdp(plan.shards().clone(), None)
                    .with_precision(precision)
                    .with_loss_scaler(LossScaler::new(64.0).with_growth_interval(100));
                let mut optim = AdamWConfig::new().init();
                let mut skipped = Vec::new();
                for &factor in factors {
                    let factor = if group.rank() == 1 { factor } else { 1.0 };
                    let before = weights(&unit.full()?);
                    let forward = |m: &Fsdp<Linear>| {
                        let gathered = m.get()?;
                        assert_eq!(gathered.weight.val().dtype(), precision.param_dtype);
                        Ok::<_, CollectiveError>(loss(&gathered, &device, factor, 1.0))
                    };
                    let (next, out) = step.step_with(unit, forward, &mut optim, 1e-2)?;
                    unit = next;
                    skipped.push(out.skipped);
                    let master = unit.full()?;
                    assert_eq!(master.weight.val().dtype(), DType::F32, "fp32 master shard");
                    if out.skipped {
                        assert_eq!(before, weights(&master), "the shard must not move");
                        assert_eq!(step.loss_scale(), 32.0, "the scale halves");
                    } else {
                        assert_ne!(before, weights(&master), "a clean step trains");
                    }
                }
                Ok((skipped, weights(&unit.full()?)))
            })
            .unwrap()
        };
        let with = run(&[1.0, f32::INFINITY, 1.0]);
        let without = run(&[1.0, 1.0]);
        for (r, w) in with.iter().zip(&without) {
            assert_eq!(
                r.0,
                vec![false, true, false],
                "{precision:?}: every rank skips"
            );
            assert_eq!(r.1, w.1, "{precision:?}: the skipped step left no trace");
        }
    }
}

#[test]
fn mixed_precision_misuse_is_a_typed_error() {
    run_local(1, |group| {
        let device = Device::flex().autodiff();
        let m = model(&device);
        let groups = ShardGroups::flat(group);
        // Forgetting prepare_module under bf16.
        let config = ZeroConfig::new(Stage::Two).with_precision(MixedPrecision::bf16());
        let mut zero =
            ZeroOptimizer::new(&m, groups.clone(), config, AdamWConfig::new().build()).unwrap();
        let grads = loss(&m, &device, 1.0, 1.0).backward();
        let err = zero
            .accumulate(&m, GradientsParams::from_grads(grads, &m))
            .unwrap_err();
        assert!(
            matches!(&err, ZeroError::Config(s) if s.contains("prepare_module")),
            "{err}"
        );
        // An invalid scaler, an invalid policy.
        let bad = [
            ZeroConfig::new(Stage::One).with_loss_scaler(Some(LossScaler::new(0.0))),
            ZeroConfig::new(Stage::One)
                .with_loss_scaler(Some(LossScaler::new(8.0).with_factors(2.0, 1.5))),
            ZeroConfig::new(Stage::One)
                .with_precision(MixedPrecision::bf16().with_reduce_dtype(DType::F16)),
            ZeroConfig::new(Stage::One).with_precision(MixedPrecision {
                param_dtype: DType::I32,
                reduce_dtype: DType::F32,
            }),
        ];
        for config in bad {
            let err = ZeroOptimizer::new(&m, groups.clone(), config, AdamWConfig::new().build())
                .err()
                .expect("invalid config");
            assert!(matches!(err, ZeroError::Config(_)), "{err}");
        }
        Ok(())
    })
    .unwrap();
}

/// Flex supports f16 (the f16 training tests of `tests/tests/zero_parity.rs` rely on it): the
/// f16 policy validates, and a module prepared under it holds f16 copies of the fp32 values
/// (within f16 rounding), computes in f16, and keeps fp32 master weights.
#[test]
fn f16_on_flex_validates_and_computes_in_f16() {
    let device = Device::flex().autodiff();
    assert!(
        device.supports_dtype(DType::F16),
        "flex must support f16 tensors"
    );
    MixedPrecision::f16()
        .validate(&device)
        .expect("the f16 policy on flex");
    run_local(1, |group| {
        let m = model(&device);
        let fp32 = FlatLayout::of(&m, |_| true).flatten(&m).unwrap();
        let config = ZeroConfig::new(Stage::Two).with_precision(MixedPrecision::f16());
        let zero = ZeroOptimizer::new(
            &m,
            ShardGroups::flat(group),
            config,
            AdamWConfig::new().build(),
        )
        .map_err(to_collective)?;
        let m = zero.prepare_module(m).map_err(to_collective)?;
        assert_eq!(m.weight.val().dtype(), DType::F16, "f16 compute copy");
        assert_eq!(
            zero.master().expect("a master copy under f16").dtype(),
            DType::F32
        );
        assert_eq!(
            host_f32(zero.master().unwrap().clone()),
            fp32,
            "exact fp32 master"
        );
        let low = zero.layout().flatten(&m).unwrap();
        assert_ne!(low, fp32, "the compute copy must be rounded to f16");
        for (i, (l, f)) in low.iter().zip(&fp32).enumerate() {
            // f16 has an 11-bit significand: relative rounding error at most 2^-11.
            assert!(
                (l - f).abs() <= f.abs() * 2f32.powi(-11),
                "value {i}: f16 copy {l} of {f}"
            );
        }
        let y = loss(&m, &device, 1.0, 1.0);
        assert_eq!(y.dtype(), DType::F32, "the loss is taken in fp32");
        let x = Tensor::<2>::zeros([1, 6], &device).cast(DType::F16);
        assert_eq!(m.forward(x).dtype(), DType::F16, "the forward runs in f16");
        Ok(())
    })
    .unwrap();
}
