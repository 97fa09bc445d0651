//! Frozen parameters (`require_grad` false) under ZeRO-1/2 and stage 3 / FSDP keep their exact
//! value, get no optimizer state, and every parameter's `require_grad` flag survives the steps.
//! Replicas that differ when a module is wrapped are refused with the same error on every rank.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamW, AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{CollectiveError, ReplicaError, run_local};
use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroError, ZeroOptimizer};

#[derive(Module, Debug)]
struct Net {
    frozen: Linear,
    trainable: Linear,
}

/// A linear layer with deterministic weights (identical on every rank), shifted by `shift`.
fn linear(d_in: usize, d_out: usize, shift: f32, device: &Device) -> Linear {
    let mut l = LinearConfig::new(d_in, d_out).init(device);
    let w = (0..d_in * d_out)
        .map(|i| (i as f32 * 0.37 + shift).sin() * 0.5)
        .collect();
    let b = (0..d_out)
        .map(|i| (i as f32 * 0.11 + shift).cos())
        .collect();
    l.weight = Param::from_data(TensorData::new(w, [d_in, d_out]), device);
    l.bias = Some(Param::from_data(TensorData::new(b, [d_out]), device));
    l
}

fn net(device: &Device) -> Net {
    Net {
        frozen: linear(4, 5, 0.0, device).no_grad(),
        trainable: linear(5, 3, 1.0, device),
    }
}

/// Trainable elements of `Net`: 5 * 3 + 3.
const TRAINABLE: usize = 18;

fn loss(m: &Net, rank: usize, device: &Device) -> Tensor<1> {
    let x = Tensor::<2>::from_data(
        TensorData::new(
            (0..8).map(|i| (i + rank) as f32 * 0.1).collect::<Vec<_>>(),
            [2, 4],
        ),
        device,
    );
    m.trainable
        .forward(m.frozen.forward(x))
        .powf_scalar(2.0)
        .sum()
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// (weight, bias) values and require_grad flags of a linear layer.
fn snapshot(l: &Linear) -> (Vec<f32>, Vec<f32>, bool, bool) {
    let b = l.bias.as_ref().unwrap();
    (
        host(l.weight.val()),
        host(b.val()),
        l.weight.val().is_require_grad(),
        b.val().is_require_grad(),
    )
}

fn to_collective(e: ZeroError) -> CollectiveError {
    CollectiveError::InvalidArgument {
        rank: 0,
        op: "test".into(),
        reason: e.to_string(),
    }
}

fn adamw() -> AdamW {
    AdamWConfig::new().with_weight_decay(0.5).build()
}

#[test]
fn zero_1_and_2_keep_frozen_parameters_and_flags() {
    for stage in [Stage::One, Stage::Two] {
        let out = run_local(2, |group| {
            let device = Device::flex().autodiff();
            let mut m = net(&device);
            let frozen_before = snapshot(&m.frozen);
            let trainable_before = snapshot(&m.trainable);
            let mut zero = ZeroOptimizer::new(
                &m,
                ShardGroups::flat(group.clone()),
                ZeroConfig::new(stage),
                adamw(),
            )
            .map_err(to_collective)?;
            for _ in 0..2 {
                let grads =
                    GradientsParams::from_grads(loss(&m, group.rank(), &device).backward(), &m);
                zero.accumulate(&m, grads).map_err(to_collective)?;
                m = zero.step(1e-2, m).map_err(to_collective)?.0;
            }
            Ok((
                frozen_before,
                snapshot(&m.frozen),
                trainable_before,
                snapshot(&m.trainable),
                zero.optimizer().state_bytes(),
            ))
        })
        .unwrap();
        let mut state = 0;
        for (frozen_before, frozen_after, trainable_before, trainable_after, bytes) in out {
            assert_eq!(
                frozen_before, frozen_after,
                "stage {stage:?}: frozen values and flags (false, false) unchanged"
            );
            assert!(trainable_after.2 && trainable_after.3, "still trainable");
            assert_ne!(trainable_before.0, trainable_after.0, "trained");
            state += bytes;
        }
        // AdamW: two f32 moments per trainable element, split across the ranks.
        assert_eq!(
            state,
            2 * 4 * TRAINABLE,
            "stage {stage:?}: optimizer state bytes"
        );
    }
}

/// `Fsdp<Net>` trained by the library's step: the frozen layer stays whole in the unit and
/// keeps its value and flag, the trainable one trains, and AdamW holds state for the flat
/// shard only (half the trainable elements on each of 2 ranks).
#[test]
fn fsdp_keeps_frozen_parameters_and_flags() {
    use burn_parallel::nn::TpContext;
    use burn_parallel::train::TrainStep;
    use burn_zero::{Fsdp, FsdpPlan};
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let plan = FsdpPlan::new(&group).unit("net");
        let mut unit: Fsdp<Net> = plan
            .wrap(
                &burn_parallel::init::Init::new(0, &device).at("net"),
                |_| Ok::<_, ZeroError>(net(&device)),
            )
            .map_err(to_collective)?;
        plan.finish().map_err(to_collective)?;
        let before = unit.full()?;
        let step = TrainStep::new(TpContext::single()).with_fsdp(plan.shards().clone(), None);
        let mut optim = AdamWConfig::new().init();
        for _ in 0..2 {
            let rank = group.rank();
            let forward = |m: &Fsdp<Net>| {
                let net = m.get()?;
                Ok::<_, CollectiveError>(loss(&net, rank, &device))
            };
            unit = step.step_with(unit, forward, &mut optim, 1e-2)?.0;
        }
        let after = unit.get()?;
        let state = plan.optimizer_bytes(&optim).map_err(to_collective)?;
        // A gathered trainable parameter is not a leaf (it is a slice of the differentiable
        // all-gather of the shard, whose gradient flows back to the shard), so its flag reads
        // false; what survives is that it trains. The frozen ones are the unit's own.
        Ok((
            snapshot(&net(&device).frozen),
            snapshot(&after.frozen),
            host(before.trainable.weight.val()),
            host(after.trainable.weight.val()),
            state,
        ))
    })
    .unwrap();
    let mut state = 0;
    for (frozen_before, frozen_after, trainable_before, trainable_after, bytes) in out {
        assert_eq!(
            frozen_before, frozen_after,
            "frozen values and flags unchanged"
        );
        assert_ne!(trainable_before, trainable_after, "trained");
        state += bytes;
    }
    assert_eq!(state, 2 * 4 * TRAINABLE, "optimizer state bytes");
}

/// Each rank builds a different model (a different shift on rank 1): wrapping it is an error
/// on every rank, naming the first differing parameter, for ZeRO-1/2 and for an FSDP unit.
#[test]
fn differing_replicas_are_refused_on_every_rank() {
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let make = || Net {
            frozen: linear(4, 5, 0.0, &device).no_grad(),
            trainable: linear(5, 3, group.rank() as f32, &device),
        };
        let zero = ZeroOptimizer::new(
            &make(),
            ShardGroups::flat(group.clone()),
            ZeroConfig::new(Stage::Two),
            adamw(),
        )
        .err();
        let plan = burn_zero::FsdpPlan::new(&group).unit("net");
        let init = burn_parallel::init::Init::new(0, &device).at("net");
        let fsdp = plan
            .wrap(&init, |_| Ok::<_, ZeroError>(make()))
            .map(|_: burn_zero::Fsdp<Net>| ())
            .err();
        Ok((zero.map(|e| e.to_string()), fsdp.map(|e| e.to_string())))
    })
    .unwrap();
    for (zero, fsdp) in out {
        for err in [zero, fsdp] {
            let err = err.expect("differing replicas must be refused");
            assert!(err.contains("\"trainable.weight\""), "{err}");
            assert!(err.contains("broadcast from rank 0"), "{err}");
        }
    }
    // The error is typed.
    let typed = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let m = linear(3, 3, group.rank() as f32, &device);
        Ok(matches!(
            ZeroOptimizer::new(
                &m,
                ShardGroups::flat(group.clone()),
                ZeroConfig::new(Stage::One),
                adamw()
            ),
            Err(ZeroError::Replica(ReplicaError::Mismatch { .. }))
        ))
    })
    .unwrap();
    assert_eq!(typed, vec![true, true]);
}

/// `Fsdp<M>` (the composable FSDP) keeps a unit's frozen parameters whole, out of the flat
/// shard, and still shows them to Burn's visitors and mappers at their own paths: they are
/// counted, saved in records and checkpoints, checked across replicas and loaded back; the
/// trainable ones are the flat shard.
#[test]
fn fsdp_module_visits_its_frozen_parameters() {
    use burn::module::{ModuleMapper, ModuleVisitor};
    use burn_zero::{Fsdp, FsdpPlan};
    struct Paths(Vec<String>, Vec<(String, Vec<usize>)>);
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.1.push((self.0.join("."), p.dims().to_vec()));
        }
    }
    /// Adds 1 to every parameter it is shown.
    struct AddOne;
    impl ModuleMapper for AddOne {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            p.map(|t| t + 1.0)
        }
    }
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let plan = FsdpPlan::new(&group).unit("net");
        let unit: Fsdp<Net> = plan
            .wrap(
                &burn_parallel::init::Init::new(0, &device).at("net"),
                |_| Ok::<_, ZeroError>(net(&device)),
            )
            .map_err(to_collective)?;
        plan.finish().map_err(to_collective)?;
        let mut paths = Paths(vec![], vec![]);
        unit.visit(&mut paths);
        let count = unit.num_params();
        let frozen_before = snapshot(&net(&device).frozen);
        let mapped = unit.map(&mut AddOne);
        let whole = mapped.full()?;
        Ok((paths.1, count, frozen_before, snapshot(&whole.frozen)))
    })
    .unwrap();
    for (paths, count, before, after) in out {
        assert_eq!(
            paths,
            vec![
                ("frozen.weight".to_string(), vec![4, 5]),
                ("frozen.bias".to_string(), vec![5]),
                ("flat_shard".to_string(), vec![TRAINABLE / 2]),
            ]
        );
        assert_eq!(count, 4 * 5 + 5 + TRAINABLE / 2);
        // The mapper reached the frozen parameters (values + 1), which stay frozen.
        let plus_one = |v: &[f32]| v.iter().map(|x| x + 1.0).collect::<Vec<_>>();
        assert_eq!(after.0, plus_one(&before.0));
        assert_eq!(after.1, plus_one(&before.1));
        assert_eq!((after.2, after.3), (false, false));
    }
}
