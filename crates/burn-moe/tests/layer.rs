//! Single-device behaviour of the MoE layer: the dense reference, routing edge cases, capacity,
//! balancing losses, typed errors, and the token exchange with zero rows.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_moe::dispatch::{combine, dispatch};
use burn_moe::router::plan_dispatch;
use burn_moe::{
    Capacity, DropPolicy, ExpertKind, MoeConfig, MoeError, MoeLayer, MoeParallel, ScoreFn,
};
use burn_parallel::init::{Init, init_normal};
use burn_parallel::{ParallelDims, run_local};

fn data(seed: u64, shape: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(init_normal(seed, "x", &shape, 1.0), device)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every expert applied to every token, outputs weighted by dense gates (zero where the token
/// did not choose the expert): written independently of the layer's sort/permute path.
fn dense_reference(moe: &MoeLayer, x: Tensor<2>) -> Tensor<2> {
    let cfg = &moe.config;
    let [t, _] = x.dims();
    let logits = x.clone().cast(DType::F32).matmul(moe.router.val());
    let scores = match cfg.score {
        ScoreFn::Softmax => softmax(logits, 1),
        ScoreFn::Sigmoid => sigmoid(logits),
    };
    let routing = moe.route(x.clone()).unwrap();
    let mut mask = vec![0f32; t * cfg.n_experts];
    for (slot, &e) in routing.chosen.iter().enumerate() {
        mask[(slot / cfg.top_k) * cfg.n_experts + e] = 1.0;
    }
    let mask = Tensor::<2>::from_data(TensorData::new(mask, [t, cfg.n_experts]), &x.device());
    let mut gates = scores * mask;
    if cfg.renormalize {
        gates = gates.clone() / gates.sum_dim(1);
    }
    gates = gates * cfg.route_scale;
    let mut out = x.zeros_like();
    for (e, expert) in moe.experts.iter().enumerate() {
        out = out + expert.forward(x.clone()).unwrap() * gates.clone().narrow(1, e, 1);
    }
    if let Some(shared) = &moe.shared {
        out = out + shared.forward(x).unwrap();
    }
    out
}

/// Gradients of every parameter by path.
fn grads_by_path<M: Module>(model: &M, grads: &GradientsParams) -> Vec<(String, Option<Vec<f32>>)> {
    struct V<'a>(
        &'a GradientsParams,
        Vec<String>,
        Vec<(String, Option<Vec<f32>>)>,
    );
    impl ModuleVisitor for V<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.1.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.1.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.2
                .push((self.1.join("."), self.0.get::<D>(p.id).map(values)));
        }
    }
    let mut v = V(grads, vec![], vec![]);
    model.visit(&mut v);
    v.2
}

fn configs() -> Vec<MoeConfig> {
    let base = MoeConfig::new(8, 12, 4, 2);
    vec![
        base.clone(),
        MoeConfig {
            expert: ExpertKind::SwiGlu,
            score: ScoreFn::Sigmoid,
            n_shared: 1,
            route_scale: 2.5,
            bias: true,
            ..base.clone()
        },
        MoeConfig {
            renormalize: false,
            n_groups: 2,
            topk_groups: 1,
            ..base.clone()
        },
        // top-k = E: every token uses every expert.
        MoeConfig { top_k: 4, ..base },
    ]
}

#[test]
fn output_and_gradients_match_the_dense_reference() {
    let device = Device::flex().autodiff();
    for config in configs() {
        let moe = MoeLayer::new(&config, &Init::new(3, &device)).unwrap();
        let x = data(1, [10, 8], &device).require_grad();
        let weights = data(2, [10, 8], &device);
        let y = moe.forward(x.clone()).unwrap();
        let reference = dense_reference(&moe, x.clone());
        let d = max_diff(&values(y.clone()), &values(reference.clone()));
        assert!(d < 1e-6, "{config:?}: output differs by {d}");
        let g1 = (y * weights.clone()).sum().backward();
        let gx1 = values(x.grad(&g1).unwrap());
        let p1 = grads_by_path(&moe, &GradientsParams::from_grads(g1, &moe));
        let x2 = x.clone().detach().require_grad();
        let g2 = (dense_reference(&moe, x2.clone()) * weights)
            .sum()
            .backward();
        let gx2 = values(x2.grad(&g2).unwrap());
        let p2 = grads_by_path(&moe, &GradientsParams::from_grads(g2, &moe));
        assert!(max_diff(&gx1, &gx2) < 1e-5, "{config:?}: input gradient");
        assert_eq!(p1.len(), p2.len());
        for ((path, a), (_, b)) in p1.iter().zip(&p2) {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            let d = max_diff(a, b);
            assert!(d < 1e-5, "{config:?}: gradient of {path} differs by {d}");
        }
    }
}

/// A router that sends every token to expert `e` (its column much larger than the others).
fn one_expert_layer(config: &MoeConfig, e: usize, device: &Device) -> MoeLayer {
    let mut moe = MoeLayer::new(config, &Init::new(5, device)).unwrap();
    let (d, n) = (config.d_model, config.n_experts);
    let mut w = vec![0f32; d * n];
    for row in 0..d {
        w[row * n + e] = 10.0;
    }
    moe.router = Param::from_data(TensorData::new(w, [d, n]), device);
    moe
}

#[test]
fn all_tokens_to_one_expert_leaves_the_others_empty() {
    let device = Device::flex().autodiff();
    let config = MoeConfig::new(4, 8, 4, 1);
    let moe = one_expert_layer(&config, 2, &device);
    let x = data(7, [6, 4], &device).abs() + 0.1; // positive inputs: expert 2 wins
    let y = moe.forward(x.clone()).unwrap();
    let stats = moe.last_stats().unwrap();
    assert_eq!(stats.routed, vec![0.0, 0.0, 6.0, 0.0]);
    assert_eq!(stats.imbalance(), 4.0);
    assert_eq!(stats.drop_rate(), 0.0);
    let expected = moe.experts[2].forward(x.clone()).unwrap(); // top-1 renormalised: gate 1
    assert!(max_diff(&values(y.clone()), &values(expected)) < 1e-6);
    let grads = GradientsParams::from_grads(y.sum().backward(), &moe);
    for (path, g) in grads_by_path(&moe, &grads) {
        let used = path.starts_with("experts.2") || path.starts_with("router");
        assert_eq!(
            g.is_some(),
            used,
            "{path}: an empty expert gets no gradient"
        );
    }
}

#[test]
fn capacity_drops_pass_on_the_residual_only() {
    let device = Device::flex();
    for drop in [DropPolicy::Position, DropPolicy::Weight] {
        let config = MoeConfig {
            capacity: Capacity::Factor { factor: 1.0, drop },
            ..MoeConfig::new(4, 8, 4, 1)
        };
        let moe = one_expert_layer(&config, 1, &device);
        let x = data(8, [8, 4], &device).abs() + 0.1;
        let y = values(moe.forward(x.clone()).unwrap());
        let stats = moe.last_stats().unwrap();
        // Capacity ceil(8 * 1 / 4) = 2: six of the eight tokens dropped.
        assert_eq!(stats.kept, vec![0.0, 2.0, 0.0, 0.0]);
        assert_eq!(stats.dropped, 6.0);
        assert!((stats.drop_rate() - 0.75).abs() < 1e-12);
        let routing = moe.route(x.clone()).unwrap();
        let gates = values(routing.gates);
        let plan = plan_dispatch(&routing.chosen, &gates, 4, 1, config.capacity, 1);
        let kept: Vec<usize> = plan.order.clone();
        if drop == DropPolicy::Position {
            assert_eq!(kept, vec![0, 1]);
        }
        let full = values(moe.experts[1].forward(x).unwrap());
        for t in 0..8 {
            let row = &y[t * 4..(t + 1) * 4];
            if kept.contains(&t) {
                assert!(max_diff(row, &full[t * 4..(t + 1) * 4]) < 1e-6);
            } else {
                assert!(
                    row.iter().all(|&v| v == 0.0),
                    "dropped token {t} got {row:?}"
                );
            }
        }
    }
}

#[test]
fn permute_then_unpermute_is_the_identity() {
    let device = Device::flex();
    let x = data(9, [7, 3], &device);
    let chosen = vec![2, 0, 1, 2, 0, 0, 3];
    let plan = plan_dispatch(&chosen, &[1.0; 7], 4, 1, Capacity::Dropless, 1);
    let index = |v: Vec<usize>| {
        let n = v.len();
        Tensor::<1, Int>::from_data(
            TensorData::new(v.into_iter().map(|i| i as i64).collect::<Vec<_>>(), [n]),
            &device,
        )
    };
    let sorted = x.clone().select(0, index(plan.order.clone()));
    let blocks: Vec<usize> = plan.order.iter().map(|&s| chosen[s]).collect();
    assert_eq!(blocks, vec![0, 0, 0, 1, 2, 2, 3]); // contiguous expert blocks
    let back = sorted.select(
        0,
        index(plan.positions(7).into_iter().map(Option::unwrap).collect()),
    );
    assert_eq!(values(back), values(x));
}

#[test]
fn balancing_losses_are_reported_and_train_the_router() {
    let device = Device::flex().autodiff();
    let base = MoeConfig::new(8, 12, 4, 2);
    let x = data(11, [16, 8], &device);
    let router_grad = |config: &MoeConfig| {
        let moe = MoeLayer::new(config, &Init::new(3, &device)).unwrap();
        let y = moe.forward(x.clone()).unwrap();
        let grads = GradientsParams::from_grads(y.sum().backward(), &moe);
        (
            values(grads.get::<2>(moe.router.id).unwrap()),
            moe.last_stats().unwrap(),
        )
    };
    let (plain, stats) = router_grad(&base);
    let (with_aux, _) = router_grad(&MoeConfig {
        aux_loss: 0.5,
        z_loss: 0.1,
        ..base.clone()
    });
    // The injected gradient is coefficient x the loss gradient, computed here in plain Burn.
    let moe = MoeLayer::new(&base, &Init::new(3, &device)).unwrap();
    let logits = x.clone().matmul(moe.router.val());
    let probs = softmax(logits.clone(), 1);
    let f: Vec<f32> = stats.routed.iter().map(|&c| (c / 32.0) as f32).collect();
    let f = Tensor::<2>::from_data(TensorData::new(f, [1, 4]), &device);
    let aux = (probs.mean_dim(0) * f).sum() * 4.0;
    let lse = logits.exp().sum_dim(1).log();
    let z = lse.square().mean();
    // The reported values are those losses.
    let (aux_v, z_v) = (values(aux.clone())[0], values(z.clone())[0]);
    assert!(
        (stats.aux_loss - aux_v as f64).abs() < 1e-6,
        "{} vs {aux_v}",
        stats.aux_loss
    );
    assert!(
        (stats.z_loss - z_v as f64).abs() < 1e-5,
        "{} vs {z_v}",
        stats.z_loss
    );
    let g = (aux * 0.5 + z * 0.1).backward();
    let extra = values(moe.router.val().grad(&g).unwrap());
    let expected: Vec<f32> = plain.iter().zip(&extra).map(|(a, b)| a + b).collect();
    assert!(max_diff(&with_aux, &expected) < 1e-5);
}

#[test]
fn bias_balancing_moves_load_to_idle_experts() {
    let device = Device::flex().autodiff();
    let config = MoeConfig {
        bias_update_rate: 0.05,
        ..MoeConfig::new(4, 8, 4, 1)
    };
    let moe = one_expert_layer(&config, 0, &device);
    let x = data(12, [12, 4], &device).abs() * 0.01 + 0.01;
    let before = {
        let _ = moe.forward(x.clone().require_grad()).unwrap();
        moe.last_stats().unwrap().imbalance()
    };
    assert_eq!(before, 4.0);
    let bias = moe.update_bias().unwrap();
    assert_eq!(bias, vec![-0.05, 0.05, 0.05, 0.05]);
    // An untracked (evaluation) forward does not count.
    let _ = moe.forward(x.clone()).unwrap();
    for _ in 0..40 {
        let _ = moe.forward(x.clone().require_grad()).unwrap();
        moe.update_bias();
    }
    let _ = moe.forward(x.require_grad()).unwrap();
    let after = moe.last_stats().unwrap().imbalance();
    assert!(after < before, "imbalance {before} -> {after}");
    // Gates come from the scores, not the biased scores: no bias in the output's gradient path.
    assert!(moe.expert_bias().iter().any(|&b| b != 0.0));
}

#[test]
fn bad_settings_are_typed_errors() {
    let device = Device::flex();
    let init = Init::new(0, &device);
    let err = |c: MoeConfig| MoeLayer::new(&c, &init).unwrap_err();
    assert!(matches!(
        err(MoeConfig::new(4, 8, 4, 5)),
        MoeError::TopK { k: 5, experts: 4 }
    ));
    assert!(matches!(
        err(MoeConfig::new(4, 8, 4, 0)),
        MoeError::TopK { .. }
    ));
    for factor in [0.0, -1.0, f64::NAN] {
        let c = MoeConfig {
            capacity: Capacity::Factor {
                factor,
                drop: DropPolicy::Position,
            },
            ..MoeConfig::new(4, 8, 4, 1)
        };
        assert!(matches!(err(c), MoeError::CapacityFactor { .. }));
    }
    let c = MoeConfig {
        n_groups: 3,
        topk_groups: 1,
        ..MoeConfig::new(4, 8, 4, 1)
    };
    assert!(matches!(err(c), MoeError::Config { .. }));
    let moe = MoeLayer::new(&MoeConfig::new(4, 8, 4, 1), &init).unwrap();
    assert!(matches!(
        moe.forward(Tensor::<2>::ones([2, 5], &device)),
        Err(MoeError::Shape(_))
    ));
    // E not divisible by ep, and ranks that disagree on k.
    let out = run_local(2, |world| {
        let dims = ParallelDims {
            dp_replicate: 2,
            ep: 2,
            ..ParallelDims::default()
        };
        let mesh = dims.build(&world).unwrap();
        let parallel = MoeParallel::from_mesh(&dims, &mesh).unwrap();
        let init = Init::new(0, &Device::flex());
        let odd = MoeLayer::build(&MoeConfig::new(4, 8, 3, 1), &init, &parallel).unwrap_err();
        assert!(matches!(
            odd,
            MoeError::ExpertsNotDivisible { experts: 3, ep: 2 }
        ));
        let k = 1 + world.rank();
        let mismatch = MoeLayer::build(&MoeConfig::new(4, 8, 4, k), &init, &parallel).unwrap_err();
        Ok(mismatch.to_string())
    })
    .unwrap();
    assert!(
        out[0].contains("top_k 1") && out[0].contains("top_k 2"),
        "{}",
        out[0]
    );
    // ep must divide the data-parallel ranks.
    run_local(2, |world| {
        let dims = ParallelDims {
            dp_replicate: 2,
            ep: 4,
            ..ParallelDims::default()
        };
        assert!(
            dims.build(&world)
                .unwrap_err()
                .to_string()
                .contains("expert-parallel size 4")
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn dispatch_handles_zero_rows_and_bad_counts() {
    let results = run_local(2, |ep| {
        let device = Device::flex().autodiff();
        // Rank 0 keeps three rows for its own expert; rank 1 sends nothing at all.
        let rows = if ep.rank() == 0 { 3 } else { 0 };
        let x = Tensor::<2>::from_data(
            TensorData::new(
                (0..rows * 2).map(|v| v as f32).collect::<Vec<_>>(),
                [rows, 2],
            ),
            &device,
        )
        .require_grad();
        let counts = if ep.rank() == 0 { [3, 0] } else { [0, 0] };
        let (local, layout) = dispatch(x.clone(), &counts, &ep).unwrap();
        assert_eq!(layout.expert_rows, vec![if ep.rank() == 0 { 3 } else { 0 }]);
        let back = combine(local * 2.0, &layout).unwrap();
        assert_eq!(back.dims(), [rows, 2]);
        let grads = (back.sum() * 1.0).backward();
        let g = x.grad(&grads).map(values).unwrap_or_default();
        // Counts that do not add up.
        let bad = dispatch(Tensor::<2>::ones([2, 2], &device), &[1, 0], &ep).unwrap_err();
        assert!(matches!(bad, MoeError::CountMismatch { .. }), "{bad}");
        Ok(g)
    })
    .unwrap();
    assert_eq!(results[0], vec![2.0; 6]);
    assert!(results[1].iter().all(|&g| g == 2.0));
}
