//! DiLoCo (`burn_parallel::diloco`, `gpt --diloco-islands`):
//!
//! - with inner SGD, `H` = 1, outer SGD lr 1 and no momentum, it is DDP with SGD: the losses and
//!   final parameters of an independent single-device SGD run on the same global batch, within
//!   1e-5, at 2 islands of 1 and 2 ranks, and over 2 TCP processes through `burnrun`;
//! - the outer optimizer is SGD with (Nesterov) momentum on the averaged pseudo-gradient;
//! - fp16, bf16 and int8 pseudo-gradients stay close to f32 and send the bytes they should;
//! - streaming fragments are each synced exactly on their schedule;
//! - settings that make no sense, and a lost island, are typed errors.

use std::collections::BTreeSet;

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::diloco::{
    Compression, DiLoCo, DiLoCoConfig, DiLoCoError, Islands, count_sent_bytes,
};
use burn_parallel::{CollectiveError, local_world, run_local};
use examples::data::{Corpus, Split};
use examples::gpt::{Gpt, GptConfig};
use examples::train::{NamedParam, Parallelism, TrainConfig};
use examples::train_diloco::{
    DiLoCoReport, DiLoCoRun, DiLoCoTrainError, InnerOptimizer, train_gpt_diloco,
};
use tests::{
    Params, Reference, assert_matches_reference, compare_params, gpt_through_burnrun, params_of,
    tiny_gpt_run,
};

const TOL: f64 = 1e-5;

/// The tiny GPT with a learning rate that SGD makes progress with.
fn sgd_config(steps: usize) -> TrainConfig {
    TrainConfig {
        lr: 0.5,
        weight_decay: 0.0,
        ..tiny_gpt_run(steps)
    }
}

/// Single-device SGD in plain Burn on the whole global batch of every step (independent of
/// the trainers under test): the GPT from its seed, the mean token cross-entropy, SGD with the
/// run's schedule.
fn sgd_reference(config: &TrainConfig) -> Reference {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let device = Device::flex().autodiff();
    let mut model = Gpt::new(&config.model, &device);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..config.steps {
        let batch = corpus.batch_rows(
            step as u64,
            0..config.batch_size,
            config.seq_len,
            Split::Train,
        );
        let (inputs, targets) = batch.to_tensors(&device);
        let logits = model.forward(inputs).expect("a single-device GPT");
        let [b, s, v] = logits.dims();
        let loss = log_softmax(logits.reshape([b * s, v]), 1)
            .gather(1, targets.reshape([b * s, 1]))
            .mean()
            .neg();
        losses.push(loss.clone().try_into_vec_as::<f64>().expect("the loss")[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(config.lr_at(step), model, grads);
    }
    Reference {
        losses,
        params: params_of(&model.valid()),
    }
}

/// A DiLoCo run of the GPT on `ranks` thread ranks; checks that every rank reports the same
/// losses and parameters and returns every rank's report.
fn diloco(ranks: usize, config: &TrainConfig, run: &DiLoCoRun) -> Vec<DiLoCoReport> {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = run_local(ranks, |g| {
        train_gpt_diloco(&g, config, run, &corpus, &mut |_| {}).map_err(|e| {
            CollectiveError::InvalidArgument {
                rank: g.global_rank(),
                op: "diloco".into(),
                reason: e.to_string(),
            }
        })
    })
    .unwrap_or_else(|e| panic!("DiLoCo {run:?} on {ranks} ranks: {e}"));
    for r in &reports[1..] {
        assert_eq!(
            r.train.losses, reports[0].train.losses,
            "ranks agree on losses"
        );
        assert_eq!(
            r.train.final_params, reports[0].train.final_params,
            "every island ends with the outer model"
        );
    }
    reports
}

fn identity_run(islands: usize) -> DiLoCoRun {
    DiLoCoRun {
        islands,
        diloco: DiLoCoConfig {
            inner_steps: 1,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            nesterov: false,
            compression: Compression::F32,
            fragments: 1,
            ..DiLoCoConfig::default()
        },
        inner: InnerOptimizer::Sgd,
        device: Default::default(),
    }
}

/// The identity: H = 1, outer SGD lr 1 without momentum, inner SGD is DDP with SGD, at 2
/// islands of 1 rank and of 2 ranks (DDP inside each island). And it is not vacuous: H = 2
/// gives other losses.
#[test]
fn h1_outer_lr1_without_momentum_is_ddp_with_sgd() {
    let config = sgd_config(12);
    let reference = sgd_reference(&config);
    assert!(
        reference.losses[11] < reference.losses[0] - 0.3,
        "SGD must learn: {:?}",
        reference.losses
    );
    for ranks in [2, 4] {
        let r = &diloco(ranks, &config, &identity_run(2))[0];
        assert_matches_reference(
            &reference,
            &r.train.losses,
            &r.train.final_params,
            TOL,
            &format!("DiLoCo H=1, 2 islands x {} ranks", ranks / 2),
        );
        assert_eq!(r.syncs, 12, "one sync per step");
    }
    let mut h2 = identity_run(2);
    h2.diloco.inner_steps = 2;
    let r = &diloco(2, &config, &h2)[0];
    let differs = compare_params(&reference.params, &r.train.final_params, TOL).is_err();
    assert!(differs, "H = 2 must not reproduce DDP step by step");
}

/// The same identity over 2 TCP processes through `burnrun` (the `gpt` binary's flags).
#[test]
fn h1_identity_over_tcp_through_burnrun() {
    let config = sgd_config(6);
    let reference = sgd_reference(&config);
    let run = gpt_through_burnrun(
        2,
        &config,
        &[
            "--diloco-islands",
            "2",
            "--inner-steps",
            "1",
            "--outer-lr",
            "1",
            "--outer-momentum",
            "0",
            "--inner-optim",
            "sgd",
        ],
    );
    assert!(
        run.stdout.contains("DiLoCo: 2 islands x 1 ranks"),
        "{}",
        run.stdout
    );
    assert_matches_reference(&reference, &run.losses, &run.params, TOL, "DiLoCo over TCP");
}

/// A one-parameter model: `w`, shape [1, 1], no bias.
fn scalar_model(value: f32, device: &Device) -> Linear {
    let model: Linear = LinearConfig::new(1, 1).with_bias(false).init(device);
    set_all(model, value)
}

/// Every parameter of `module` set to `value`.
fn set_all<M: Module>(module: M, value: f32) -> M {
    struct Set(f32);
    impl ModuleMapper for Set {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let v = self.0;
            p.map(|t| t.zeros_like() + v)
        }
    }
    module.map(&mut Set(value))
}

/// Every parameter of `module` moved by `delta`.
fn shift_all<M: Module>(module: M, delta: f32) -> M {
    struct Shift(f32);
    impl ModuleMapper for Shift {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let d = self.0;
            p.map(|t| t + d)
        }
    }
    module.map(&mut Shift(delta))
}

/// The outer step is SGD with Nesterov momentum (PyTorch's convention) on the islands' mean
/// pseudo-gradient, written out by hand over three syncs; plain momentum differs.
#[test]
fn outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient() {
    let (lr, mu) = (0.7f32, 0.9f32);
    for nesterov in [true, false] {
        let got = run_local(2, |world| {
            let device = Device::flex();
            let islands = Islands::new(&world, 2).unwrap();
            let mut model = scalar_model(1.0, &device);
            let config = DiLoCoConfig {
                inner_steps: 1,
                outer_lr: lr as f64,
                outer_momentum: mu as f64,
                nesterov,
                ..DiLoCoConfig::default()
            };
            let mut diloco = DiLoCo::new(&islands, config, &model).unwrap();
            let mut values = Vec::new();
            for step in 0..3 {
                // Island i moves w by -(i + 1)·(step + 1)·0.1 during its inner steps.
                let delta = (islands.index() + 1) as f32 * (step + 1) as f32 * 0.1;
                model = shift_all(model, -delta);
                model = diloco.sync(step, model).unwrap();
                values.push(model.weight.val().into_data().try_to_vec::<f32>().unwrap()[0]);
            }
            Ok(values)
        })
        .unwrap();
        assert_eq!(got[0], got[1]);
        // By hand: Δ̄_s = mean over islands of (i + 1)(s + 1)0.1 = 0.15 (s + 1).
        let (mut w, mut m) = (1.0f32, 0.0f32);
        let mut expected = Vec::new();
        for s in 0..3 {
            let g = 0.15 * (s + 1) as f32;
            m = mu * m + g;
            w -= lr * if nesterov { g + mu * m } else { m };
            expected.push(w);
        }
        for (a, b) in got[0].iter().zip(&expected) {
            assert!(
                (a - b).abs() < 1e-5,
                "nesterov {nesterov}: {:?} vs {expected:?}",
                got[0]
            );
        }
    }
}

fn compression_run(compression: Compression) -> DiLoCoRun {
    DiLoCoRun {
        islands: 2,
        diloco: DiLoCoConfig {
            inner_steps: 5,
            compression,
            ..DiLoCoConfig::default()
        },
        inner: InnerOptimizer::AdamW,
        device: Default::default(),
    }
}

fn max_abs_diff(a: &[NamedParam], b: &[NamedParam]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.values.iter().zip(&y.values).map(|(u, v)| (u - v).abs()))
        .fold(0.0, f32::max)
}

/// fp16, bf16 and int8 pseudo-gradients against f32 DiLoCo on 20 steps (4 syncs, AdamW inside,
/// Nesterov outside): losses and parameters close, and the bytes of the outer syncs exactly
/// those of the encodings (2 islands: the ring all-reduce sends 4 bytes per element, the
/// all-gather one encoded copy).
#[test]
fn compressed_pseudo_gradients_stay_close_to_f32() {
    let config = tiny_gpt_run(20);
    let f32_run = &diloco(2, &config, &compression_run(Compression::F32))[0];
    let elements = Gpt::new(&config.model, &Device::flex()).num_params();
    let syncs = f32_run.syncs as u64;
    assert_eq!(syncs, 4);
    assert_eq!(f32_run.outer_bytes, syncs * 4 * elements as u64);
    let last = |r: &DiLoCoReport| *r.train.losses.last().unwrap();
    for (compression, loss_tol, param_tol) in [
        (Compression::Fp16, 1e-4, 1e-4),
        (Compression::Bf16, 1e-3, 1e-3),
        (Compression::INT8, 1e-3, 2e-3),
    ] {
        let r = &diloco(2, &config, &compression_run(compression))[0];
        let rel = (last(r) - last(f32_run)).abs() / last(f32_run);
        let val_rel = (r.train.val_loss - f32_run.train.val_loss).abs() / f32_run.train.val_loss;
        let params = max_abs_diff(&r.train.final_params, &f32_run.train.final_params);
        println!(
            "{compression}: final loss {:.5} vs f32 {:.5} (rel {rel:.2e}), validation {:.5} vs \
             {:.5} (rel {val_rel:.2e}), max |param diff| {params:.2e}, outer bytes {} vs {}",
            last(r),
            last(f32_run),
            r.train.val_loss,
            f32_run.train.val_loss,
            r.outer_bytes,
            f32_run.outer_bytes
        );
        assert!(
            rel < loss_tol && val_rel < loss_tol,
            "{compression}: rel {rel:.2e}"
        );
        assert!(params < param_tol as f32, "{compression}: {params:.2e}");
        assert!(params > 0.0, "{compression} must actually round something");
        let expected = syncs * compression.encoded_len(elements) as u64;
        assert_eq!(
            r.outer_bytes, expected,
            "{compression}: bytes of the outer syncs"
        );
    }
}

/// Which parameters (by path) hold the same value on both islands, per rank.
fn equal_across(world: &burn_parallel::ProcessGroup, params: &Params) -> BTreeSet<String> {
    let mine: Vec<(String, Vec<f32>)> = params
        .iter()
        .map(|(k, (_, v))| (k.clone(), v.clone()))
        .collect();
    let all = world.all_gather_object(&mine).unwrap();
    mine.iter()
        .enumerate()
        .filter(|(i, (_, v))| all.iter().all(|other| &other[*i].1 == v))
        .map(|(_, (k, _))| k.clone())
        .collect()
}

/// Streaming DiLoCo, H = 6 and F = 3: fragment 0 is synced after steps 5 and 11, fragment 1
/// after steps 1 and 7, fragment 2 after steps 3 and 9 (offsets f·H/F); a sync makes that
/// fragment's parameters equal on both islands, and only those. The islands drift apart every
/// step, so a fragment skipped or synced at another step shows.
#[test]
fn streaming_fragments_are_each_synced_on_schedule() {
    let (h, f) = (6, 3);
    let observed = run_local(2, |world| {
        let device = Device::flex();
        let islands = Islands::new(&world, 2).unwrap();
        let config = GptConfig::new(256, 2, 2, 16, 16);
        let mut model = Gpt::new(&config, &device);
        let settings = DiLoCoConfig {
            inner_steps: h,
            fragments: f,
            ..DiLoCoConfig::default()
        };
        let mut diloco = DiLoCo::new(&islands, settings, &model).unwrap();
        let mut synced = Vec::new();
        for step in 0..2 * h {
            model = shift_all(model, 0.01 * (islands.index() + 1) as f32);
            model = diloco.sync(step, model).unwrap();
            synced.push(equal_across(&world, &params_of(&model)));
        }
        let all: BTreeSet<String> = params_of(&model).into_keys().collect();
        Ok((synced, all))
    })
    .unwrap();
    let (synced, all) = &observed[0];
    let schedule: [(usize, &[usize]); 3] = [(0, &[5, 11]), (1, &[1, 7]), (2, &[3, 9])];
    let mut covered = BTreeSet::new();
    for (fragment, steps) in schedule {
        let set = &synced[steps[0]];
        assert!(
            !set.is_empty(),
            "fragment {fragment} synced at step {}",
            steps[0]
        );
        assert_eq!(
            &synced[steps[1]], set,
            "fragment {fragment}: the same parameters again"
        );
        assert!(covered.is_disjoint(set), "fragments overlap: {set:?}");
        covered.extend(set.iter().cloned());
    }
    assert_eq!(&covered, all, "every parameter belongs to a fragment");
    for (step, set) in synced.iter().enumerate() {
        if ![1, 3, 5, 7, 9, 11].contains(&step) {
            assert!(
                set.is_empty(),
                "nothing is synced after step {step}: {set:?}"
            );
        }
    }
}

/// Settings that make no sense are typed errors, before any communication.
#[test]
fn bad_settings_are_typed_errors() {
    let ok = DiLoCoConfig::default();
    let cases = [
        (
            DiLoCoConfig {
                inner_steps: 0,
                ..ok
            },
            DiLoCoError::ZeroInnerSteps,
        ),
        (
            DiLoCoConfig {
                outer_lr: 0.0,
                ..ok
            },
            DiLoCoError::OuterLr(0.0),
        ),
        (
            DiLoCoConfig {
                outer_lr: f64::INFINITY,
                ..ok
            },
            DiLoCoError::OuterLr(f64::INFINITY),
        ),
        (
            DiLoCoConfig {
                outer_momentum: 1.0,
                ..ok
            },
            DiLoCoError::OuterMomentum(1.0),
        ),
        (
            DiLoCoConfig {
                outer_momentum: -0.1,
                ..ok
            },
            DiLoCoError::OuterMomentum(-0.1),
        ),
        (
            DiLoCoConfig { fragments: 0, ..ok },
            DiLoCoError::ZeroFragments,
        ),
        (
            DiLoCoConfig {
                inner_steps: 4,
                fragments: 5,
                ..ok
            },
            DiLoCoError::FragmentsExceedInnerSteps {
                fragments: 5,
                inner_steps: 4,
            },
        ),
        (
            DiLoCoConfig {
                compression: Compression::Int8 { block_size: 0 },
                ..ok
            },
            DiLoCoError::ZeroBlockSize,
        ),
    ];
    for (config, expected) in cases {
        assert_eq!(config.validate(), Err(expected.clone()));
        // DiLoCo::new refuses them too, and the message says what to do.
        let e = run_local(1, |world| {
            let islands = Islands::new(&world, 1).unwrap();
            let model = scalar_model(0.0, &Device::flex());
            Ok(DiLoCo::new(&islands, config, &model).unwrap_err())
        })
        .unwrap()
        .remove(0);
        assert_eq!(e, expected);
        println!("{e}");
    }
    // More fragments than parameters; islands that do not divide the world.
    run_local(3, |world| {
        let islands = Islands::new(&world, 1).unwrap();
        let model = scalar_model(0.0, &Device::flex());
        let config = DiLoCoConfig {
            fragments: 2,
            ..DiLoCoConfig::default()
        };
        assert_eq!(
            DiLoCo::new(&islands, config, &model).unwrap_err(),
            DiLoCoError::TooManyFragments {
                fragments: 2,
                params: 1
            }
        );
        for count in [0, 2] {
            assert_eq!(
                Islands::new(&world, count).unwrap_err(),
                DiLoCoError::IslandLayout {
                    world: 3,
                    islands: count
                }
            );
        }
        Ok(())
    })
    .unwrap();
    // The trainer refuses layouts it does not compose with, and bad settings.
    let config = tiny_gpt_run(2);
    let run = identity_run(2);
    let tp = Parallelism {
        tp: 2,
        ..Parallelism::default()
    };
    assert!(matches!(
        run.validate(&config, &tp, 4),
        Err(DiLoCoTrainError::Unsupported { flag: "--tp", .. })
    ));
    let mut h0 = run;
    h0.diloco.inner_steps = 0;
    assert_eq!(
        h0.validate(&config, &Parallelism::default(), 2),
        Err(DiLoCoTrainError::DiLoCo(DiLoCoError::ZeroInnerSteps))
    );
    assert!(matches!(
        run.validate(&config, &Parallelism::default(), 3),
        Err(DiLoCoTrainError::DiLoCo(DiLoCoError::IslandLayout { .. }))
    ));
}

/// Island 1 (ranks 2 and 3) is lost before the sync: the syncs of island 0's ranks end with
/// `IslandLost` naming island 1 and a failed rank of it, not a hang (2 islands x 2 ranks; the
/// failure reported first may be a rank outside the caller's outer group).
#[test]
fn a_lost_island_is_a_typed_error_naming_it() {
    let groups = local_world(4);
    let outcomes: Vec<Option<DiLoCoError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|world| {
                scope.spawn(move || {
                    let world = world.with_timeout(std::time::Duration::from_secs(30));
                    let islands = Islands::new(&world, 2).unwrap();
                    let model = scalar_model(1.0, &Device::flex());
                    let config = DiLoCoConfig {
                        inner_steps: 1,
                        ..DiLoCoConfig::default()
                    };
                    let mut diloco = DiLoCo::new(&islands, config, &model).unwrap();
                    if islands.index() == 1 {
                        world.abort("island 1 lost its machine");
                        return None;
                    }
                    diloco.sync(0, model).err()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, outcome) in outcomes.iter().enumerate().take(2) {
        match outcome {
            Some(DiLoCoError::IslandLost {
                island: 1,
                peer: 2 | 3,
                ..
            }) => println!("rank {rank}: {}", outcome.as_ref().unwrap()),
            other => panic!("rank {rank}: expected IslandLost naming island 1, got {other:?}"),
        }
    }
}

/// `count_sent_bytes` counts what a rank sends: a broadcast from rank 0 of 1000 f32 to 2 peers
/// is 8000 bytes there and none elsewhere.
#[test]
fn byte_counter_counts_payloads() {
    let sent = run_local(3, |world| {
        let (world, counter) = count_sent_bytes(&world)?;
        world.broadcast_data(TensorData::new(vec![1.0f32; 1000], [1000]), 0)?;
        Ok(counter.sent())
    })
    .unwrap();
    assert_eq!(sent, vec![8000, 0, 0]);
}
