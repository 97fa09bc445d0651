//! Tensor (and sequence) parallelism reproduces single-device training: GPT and ViT trained 20
//! steps with tp 2 and 4, with and without sequence parallelism, and on a 2 x 2 `dp x tp`
//! mesh, give the single-device losses on the same global batch (relative difference
//! <= 1e-5) and, gathered whole, its final parameters; the GPT's reference is the independent
//! [`tests::reference_run`]. One GPT run goes through `burnrun` as 2 TCP processes. Also: the plan's shards
//! gather back to the exact reference weights, and impossible splits are clear errors.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{DeviceMesh, DistributedDataParallel, ReduceOp, TpError, run_local};
use examples::data::{Corpus, Digits};
use examples::gpt::{Gpt, MlpKind, NormKind, PositionKind};
use examples::parallelize::{TpOptions, parallelize_gpt, parallelize_vit};
use examples::train::{
    NamedParam, Parallelism, TrainConfig, TrainReport, named_params, train_gpt_parallel,
};
use examples::vit::{Vit, VitConfig};
use tests::{
    Reference, assert_matches_reference, gpt_through_burnrun, params_of, reference_run,
    tiny_gpt_run,
};

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

/// The tiny GPT with 4 heads (so that tp 4 splits them).
fn config() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.n_heads = 4;
    c
}

/// The other architecture: rotary positions, SwiGLU, RMSNorm, tied embeddings, no biases and
/// a vocabulary of 257 (not divisible by 2 or 4: padded shards).
fn llama_like() -> TrainConfig {
    let mut c = config();
    c.model.positions = PositionKind::Rotary;
    c.model.mlp = MlpKind::SwiGlu;
    c.model.norm = NormKind::RmsNorm;
    c.model.tied_embeddings = true;
    c.model.bias = false;
    c.model.vocab_size = 257;
    c
}

/// The GPT of `config` on `world` ranks as a `world/tp x tp` mesh; rank 0's report (every rank
/// reports the same losses and, gathered whole, the same parameters).
fn parallel(world: usize, tp: usize, sp: bool, config: &TrainConfig) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let p = Parallelism { tp, sp };
    let reports = run_local(world, |g| {
        train_gpt_parallel(&g, config, &p, &corpus, &mut |_| {})
    })
    .expect("training");
    for r in &reports[1..] {
        assert_eq!(
            r.losses, reports[0].losses,
            "every rank reports the same losses"
        );
        assert_eq!(
            r.final_params, reports[0].final_params,
            "every rank gathers the same parameters"
        );
    }
    reports.into_iter().next().expect("rank 0")
}

fn check(
    reference: &Reference,
    world: usize,
    tp: usize,
    sp: bool,
    config: &TrainConfig,
    what: &str,
) {
    let r = parallel(world, tp, sp, config);
    assert_matches_reference(reference, &r.losses, &r.final_params, TOL, what);
}

#[test]
fn gpt_tensor_parallel_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0] - 0.5,
        "the model must learn: {:?}",
        reference.losses
    );
    check(&reference, 2, 2, false, &config, "tp 2");
    check(&reference, 4, 4, false, &config, "tp 4");
    check(&reference, 2, 2, true, &config, "tp 2 + sp");
    check(&reference, 4, 4, true, &config, "tp 4 + sp");
}

#[test]
fn gpt_dp2_x_tp2_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    check(&reference, 4, 2, false, &config, "dp 2 x tp 2");
    check(&reference, 4, 2, true, &config, "dp 2 x tp 2 + sp");
}

#[test]
fn llama_like_gpt_with_padded_vocab_matches_single_device() {
    let config = llama_like();
    let reference = reference_run(&config);
    check(&reference, 2, 2, true, &config, "tp 2 + sp, vocab 257");
    check(&reference, 4, 4, false, &config, "tp 4, vocab 257");
}

/// ViT on the digits: `dp x tp` ranks, each data-parallel replica on its rows of the global
/// batch (two batches in turn, so that 20 steps visibly fit them). Returns the global losses and
/// the final parameters (gathered whole under tensor parallelism). `dp = tp = 1` is the
/// single-device reference, in plain Burn.
fn vit_run(dp: usize, tp: usize, sp: bool) -> (Vec<f64>, Vec<NamedParam>) {
    let digits = Digits::load_default().expect("the bundled digits");
    let config = VitConfig {
        n_layers: 2,
        d_model: 32,
        d_ff: 64,
        seed: 5,
        ..VitConfig::digits()
    };
    let batch = 16;
    let runs = run_local(dp * tp, |world| {
        let device = Device::flex().autodiff();
        let reference = Vit::new(&config, &Device::flex());
        let mut optim = AdamWConfig::new().with_weight_decay(0.01).init();
        let rows = batch / dp;
        let mut losses = Vec::new();
        if dp * tp == 1 {
            let mut model = Vit::new(&config, &device);
            for step in 0..STEPS {
                let (x, y) = digits.batch(step as u64 % 2, batch, 1).to_tensors(&device);
                let loss = model.loss(x, y);
                losses.push(
                    loss.clone()
                        .into_data()
                        .convert::<f64>()
                        .try_to_vec::<f64>()
                        .unwrap()[0],
                );
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-2, model, grads);
            }
            // The reference's parameters through the test suite's own visitor.
            let params = params_of(&model.valid())
                .into_iter()
                .map(|(path, (shape, values))| NamedParam {
                    path,
                    shape,
                    values,
                })
                .collect();
            return Ok((losses, params));
        }
        let mesh = DeviceMesh::new(&world, &[("dp", dp), ("tp", tp)]).unwrap();
        let options = TpOptions {
            sequence_parallel: sp,
            ..Default::default()
        };
        let mut model = parallelize_vit(&reference, &mesh, &options, &device).unwrap();
        let ddp = DistributedDataParallel::new(mesh.group("dp").unwrap().clone());
        let first = mesh.coord("dp").unwrap() * rows;
        for step in 0..STEPS {
            let (x, y) = digits.batch(step as u64 % 2, batch, 1).to_tensors(&device);
            let (x, y) = (x.narrow(0, first, rows), y.narrow(0, first, rows));
            let loss = model.loss(x, y).unwrap();
            let local = loss
                .clone()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap()[0];
            let grads =
                ddp.all_reduce_grads(&model, GradientsParams::from_grads(loss.backward(), &model))?;
            model = optim.step(1e-2, model, grads);
            let global = mesh
                .group("dp")
                .unwrap()
                .all_reduce_f32(vec![local], ReduceOp::Avg)?[0];
            losses.push(global as f64);
        }
        let full = model.valid().to_full(&Device::flex()).unwrap();
        Ok((losses, named_params(&full)))
    })
    .expect("training");
    for r in &runs[1..] {
        assert_eq!(r, &runs[0]);
    }
    runs.into_iter().next().expect("rank 0")
}

#[test]
fn vit_tensor_parallel_matches_single_device() {
    let (losses, params) = vit_run(1, 1, false);
    let late: f64 = losses[STEPS - 5..].iter().sum::<f64>() / 5.0;
    assert!(late < losses[0] - 0.05, "the model must learn: {losses:?}");
    let reference = Reference {
        losses,
        params: params
            .into_iter()
            .map(|p| (p.path, (p.shape, p.values)))
            .collect(),
    };
    // 17 tokens (class token + 16 patches): uneven sequence shards under SP.
    for (dp, tp, sp) in [
        (1, 2, false),
        (1, 4, false),
        (1, 2, true),
        (1, 4, true),
        (2, 2, false),
        (2, 2, true),
    ] {
        let what = format!("ViT dp {dp} x tp {tp}, sp {sp}");
        let (losses, params) = vit_run(dp, tp, sp);
        assert_matches_reference(&reference, &losses, &params, TOL, &what);
    }
}

/// Every float parameter of a module, by path.
fn params<M: Module>(m: &M) -> Vec<(String, TensorData)> {
    struct P(Vec<String>, Vec<(String, TensorData)>);
    impl ModuleVisitor for P {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.1.push((self.0.join("."), p.val().into_data()));
        }
    }
    let mut p = P(vec![], vec![]);
    m.visit(&mut p);
    p.1
}

#[test]
fn plans_gather_back_to_the_exact_reference_weights() {
    for tp in [1, 2, 3] {
        for config in [config().model, llama_like().model] {
            let mut config = config;
            config.n_heads = 6;
            config.d_model = 36; // 6 heads of 6: tp 3 divides them; vocab 256/257 uneven for 3
            run_local(tp, |world| {
                let mesh = DeviceMesh::new(&world, &[("tp", tp)]).unwrap();
                let device = Device::flex();
                let full = Gpt::new(&config, &device);
                let options = TpOptions {
                    sequence_parallel: tp > 1,
                    ..Default::default()
                };
                let sharded = parallelize_gpt(&full, &mesh, &options, &device).unwrap();
                let back = sharded.to_full(&device).unwrap();
                let (a, b) = (params(&full), params(&back));
                assert_eq!(a.len(), b.len());
                for ((na, da), (nb, db)) in a.iter().zip(&b) {
                    assert_eq!(na, nb);
                    assert_eq!(da, db, "{na} after a round trip through tp {tp}");
                }
                Ok(())
            })
            .unwrap();
        }
    }
    let vit = Vit::new(&VitConfig::digits(), &Device::flex());
    run_local(2, |world| {
        let mesh = DeviceMesh::new(&world, &[("tp", 2)]).unwrap();
        let back = parallelize_vit(&vit, &mesh, &TpOptions::default(), &Device::flex())
            .unwrap()
            .to_full(&Device::flex())
            .unwrap();
        assert_eq!(params(&vit), params(&back));
        Ok(())
    })
    .unwrap();
}

#[test]
fn impossible_splits_are_clear_errors() {
    let corpus = Corpus::load_default().unwrap();
    // 4 heads over 3 ranks.
    let err = run_local(3, |g| {
        train_gpt_parallel(
            &g,
            &config(),
            &Parallelism { tp: 3, sp: false },
            &corpus,
            &mut |_| {},
        )
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("n_heads (4) is not divisible by the tensor-parallel size 3"),
        "{err}"
    );
    // A tp that does not divide the world.
    let err = Parallelism { tp: 2, sp: false }
        .validate(&config(), 3)
        .unwrap_err();
    assert!(err.contains("--tp"), "{err}");
    // The plan itself, called directly.
    let full = Gpt::new(&config().model, &Device::flex());
    run_local(3, |world| {
        let mesh = DeviceMesh::new(&world, &[("tp", 3)]).unwrap();
        let err =
            parallelize_gpt(&full, &mesh, &TpOptions::default(), &Device::flex()).unwrap_err();
        assert!(
            matches!(
                err,
                TpError::NotDivisible {
                    value: 4,
                    tp: 3,
                    ..
                }
            ),
            "{err}"
        );
        // A mesh without a tp dimension.
        let mesh = DeviceMesh::new(&world, &[("dp", 3)]).unwrap();
        let err =
            parallelize_gpt(&full, &mesh, &TpOptions::default(), &Device::flex()).unwrap_err();
        assert!(err.to_string().contains("\"tp\" dimension"), "{err}");
        Ok(())
    })
    .unwrap();
}

#[test]
fn tp_over_tcp_processes_through_burnrun_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    let tcp = gpt_through_burnrun(2, &config, &["--tp", "2", "--sp"]);
    assert_matches_reference(
        &reference,
        &tcp.losses,
        &tcp.params,
        TOL,
        "tp 2 + sp, 2 tcp processes",
    );
}
