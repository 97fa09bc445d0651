//! DiLoCo (`burn_parallel::diloco`, `gpt --diloco-islands`):
//!
//! - with inner SGD, `H` = 1, outer SGD lr 1 and no momentum, it is DDP with SGD: the losses and
//!   final parameters of an independent single-device SGD run on the same global batch, within
//!   1e-5, at 2 islands of 1 and 2 ranks, and over 2 TCP processes through `burnrun`;
//! - the outer optimizer is SGD with (Nesterov) momentum on the averaged pseudo-gradient;
//! - fp16, bf16 and int8 pseudo-gradients stay close to f32 and send the bytes they should;
//! - streaming fragments are each synced exactly on their schedule;
//! - settings that make no sense, and a lost island, are typed errors;
//! - with `drop_lost_islands`, a lost island (an abort, a silent rank, a TCP crash, a killed
//!   `gpt` process) is dropped and the survivors match the outer steps written out by hand;
//! - with an overlap, each update lands exactly once, `τ` steps after it was sent, as the
//!   delayed merge written out by hand;
//! - a run resumed from a checkpoint taken between syncs, with an exchange in flight, goes on
//!   bit for bit, and within 1e-5 with more ranks per island; its outer model loads in a run
//!   without DiLoCo.

use std::collections::BTreeSet;

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::diloco::{
    Compression, DiLoCo, DiLoCoConfig, DiLoCoError, Islands, SyncEvent, count_sent_bytes,
};
use burn_parallel::{CollectiveError, ProcessGroup, local_world, run_local};
use burn_parallel_train::{CheckpointPolicy, DiLoCoLayout};
use examples::data::Corpus;
use examples::gpt::{Gpt, GptConfig};
use examples::train::{NamedParam, Parallelism, TrainConfig};
use examples::train_diloco::{DiLoCoReport, train_gpt_diloco, validate_diloco};
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
        let loss = tests::reference_loss(&model, &corpus, config, step, &device);
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
fn diloco(ranks: usize, config: &TrainConfig, run: &DiLoCoLayout) -> Vec<DiLoCoReport> {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = burn_parallel_train::run_local(ranks, |g| {
        train_gpt_diloco(&g, config, run, &corpus, &mut |_| {})
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

fn identity_run(islands: usize) -> DiLoCoLayout {
    DiLoCoLayout {
        islands,
        config: DiLoCoConfig {
            inner_steps: 1,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            nesterov: false,
            compression: Compression::F32,
            fragments: 1,
            ..DiLoCoConfig::default()
        },
        inner_sgd: true,
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
        assert_eq!(r.figures.syncs, 12, "one sync per step");
    }
    let mut h2 = identity_run(2);
    h2.config.inner_steps = 2;
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

/// Every parameter of `module` moved by `delta` (trainable ones stay trainable leaves).
fn shift_all<M: Module>(module: M, delta: f32) -> M {
    struct Shift(f32);
    impl ModuleMapper for Shift {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let d = self.0;
            // A trainable leaf stays one, as after an optimizer step.
            p.map(|t| {
                let trainable = t.is_require_grad();
                let t = (t + d).detach();
                if trainable { t.require_grad() } else { t }
            })
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

fn compression_run(compression: Compression) -> DiLoCoLayout {
    DiLoCoLayout {
        islands: 2,
        config: DiLoCoConfig {
            inner_steps: 5,
            compression,
            ..DiLoCoConfig::default()
        },
        inner_sgd: false,
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
    let syncs = f32_run.figures.syncs as u64;
    assert_eq!(syncs, 4);
    assert_eq!(f32_run.figures.outer_bytes, syncs * 4 * elements as u64);
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
            r.figures.outer_bytes,
            f32_run.figures.outer_bytes
        );
        assert!(
            rel < loss_tol && val_rel < loss_tol,
            "{compression}: rel {rel:.2e}"
        );
        assert!(params < param_tol as f32, "{compression}: {params:.2e}");
        assert!(params > 0.0, "{compression} must actually round something");
        let expected = syncs * compression.encoded_len(elements) as u64;
        assert_eq!(
            r.figures.outer_bytes, expected,
            "{compression}: bytes of the outer syncs"
        );
    }
}

/// The inner steps under `gpt --precision bf16|fp16` (the library's step: the forward on the
/// bf16 compute copy, fp32 weights and AdamW state; fp16 with dynamic loss scaling), 2 islands
/// x 2 ranks (DDP inside each, gradients averaged in the compute dtype), 20 steps, 4 syncs of
/// the fp32 weights: against the same DiLoCo in fp32, the losses within the bf16 tolerance of
/// the dense GPT (2e-3; measured 4.2e-4, parameters 1.0e-2 apart) and not equal; fp16 from
/// 2^16 skips its first steps on every island alike (measured: 3, ending at scale 8192) and
/// then trains.
#[test]
fn mixed_precision_inner_steps_track_fp32() {
    use examples::train::Precision;
    let config = tiny_gpt_run(20);
    let run = compression_run(Compression::F32);
    let fp32 = &diloco(4, &config, &run)[0];
    let bf16 = TrainConfig {
        precision: Precision::Bf16,
        ..config.clone()
    };
    let r = &diloco(4, &bf16, &run)[0];
    let err = tests::max_relative_loss_diff(&r.train.losses, &fp32.train.losses);
    let params = max_abs_diff(&r.train.final_params, &fp32.train.final_params);
    println!(
        "DiLoCo bf16 inner steps against fp32: losses {err:.2e}, max |param diff| {params:.2e}"
    );
    assert!(err < 2e-3 && err > 0.0, "bf16: losses {err:.2e}");
    assert_eq!(r.train.skipped_steps, 0);
    let fp16 = TrainConfig {
        precision: Precision::Fp16,
        ..config.clone()
    };
    let r = &diloco(4, &fp16, &run)[0];
    println!(
        "DiLoCo fp16 inner steps: {} skipped, final scale {}, final loss {:.4} (fp32 {:.4})",
        r.train.skipped_steps, r.train.loss_scale, r.train.losses[19], fp32.train.losses[19]
    );
    assert!(
        (1..=4).contains(&r.train.skipped_steps),
        "{} skipped",
        r.train.skipped_steps
    );
    assert!(
        r.train.losses[19] < r.train.losses[0] - 0.5,
        "{:?}",
        r.train.losses
    );
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
        (
            DiLoCoConfig {
                inner_steps: 4,
                overlap_steps: 4,
                ..ok
            },
            DiLoCoError::OverlapTooLong {
                overlap_steps: 4,
                inner_steps: 4,
            },
        ),
        (
            DiLoCoConfig {
                overlap_steps: 1,
                overlap_mix: 1.0,
                ..ok
            },
            DiLoCoError::OverlapMix(1.0),
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
    // Each refusal names its flag (the library's `Layout::validate`).
    let flag = |r: Result<(), burn_parallel::Error>| match r {
        Err(burn_parallel::Error::Invalid { what, reason }) => (what, reason),
        other => panic!("a layout error, got {other:?}"),
    };
    assert_eq!(flag(validate_diloco(&config, &run, &tp, 4)).0, "--tp");
    let mut h0 = run;
    h0.config.inner_steps = 0;
    let (f, message) = flag(validate_diloco(&config, &h0, &Parallelism::default(), 2));
    assert_eq!(f, "--diloco-islands");
    assert!(
        message.contains(&DiLoCoError::ZeroInnerSteps.to_string()),
        "{message}"
    );
    let (f, message) = flag(validate_diloco(&config, &run, &Parallelism::default(), 3));
    assert_eq!(f, "--diloco-islands");
    assert!(
        message.contains("cannot split the world of 3 ranks"),
        "{message}"
    );
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

// ----------------------------------------------------------------------------------------
// Dropped islands and the overlap of streaming DiLoCo, on the one-parameter model: island `i`
// moves `w` by `-(i + 1)(s + 1)·0.1` in inner step `s`, so every outer step can be written out
// by hand.

/// The value of the one-parameter model.
fn w_of(model: &Linear) -> f32 {
    model.weight.val().into_data().try_to_vec::<f32>().unwrap()[0]
}

/// What a surviving rank of [`shifting_islands`] saw: `w` after every sync call and after
/// `finish`, and the sync history.
type Survivor = (Vec<f32>, Vec<SyncEvent>);

/// `count` islands move the one-parameter model as above for `steps` steps, DiLoCo syncing
/// after each; the ranks of island `dies.0` call `die` instead of inner step `dies.1` and stop
/// (`None`).
fn shifting_islands(
    world: &ProcessGroup,
    count: usize,
    config: DiLoCoConfig,
    steps: usize,
    dies: Option<(usize, usize)>,
    die: &dyn Fn(&ProcessGroup),
) -> Result<Option<Survivor>, DiLoCoError> {
    let islands = Islands::new(world, count)?;
    let mut model = scalar_model(1.0, &Device::flex());
    let mut diloco = DiLoCo::new(&islands, config, &model)?;
    let mut values = Vec::new();
    for step in 0..steps {
        if dies == Some((islands.index(), step)) {
            die(world);
            return Ok(None);
        }
        let delta = (islands.index() + 1) as f32 * (step + 1) as f32 * 0.1;
        model = shift_all(model, -delta);
        model = diloco.sync(step, model)?;
        values.push(w_of(&model));
    }
    model = diloco.finish(model)?;
    values.push(w_of(&model));
    Ok(Some((values, diloco.history().to_vec())))
}

/// [`shifting_islands`] written out by hand: per island, `w` after every step and after the
/// final sync. The dead island sends nothing from step `dies.1` on: the average is over the
/// others (re-normalised); an update in flight when it died keeps its average. With an overlap
/// `τ` the update of the pseudo-gradient sent after step `s` lands after step `s + τ` (or at
/// the end) as `α·w + (1 − α)·θ`, and the end syncs every island to `θ`.
fn shifting_by_hand(
    count: usize,
    c: &DiLoCoConfig,
    steps: usize,
    dies: Option<(usize, usize)>,
) -> Vec<Vec<f32>> {
    let (lr, mu, alpha) = (
        c.outer_lr as f32,
        c.outer_momentum as f32,
        c.overlap_mix as f32,
    );
    let (h, tau) = (c.inner_steps, c.overlap_steps);
    let (mut a, mut m) = (1.0f32, 0.0f32);
    let mut w = vec![1.0f32; count];
    let mut live: Vec<usize> = (0..count).collect();
    let mut pending: std::collections::VecDeque<(usize, f32)> = Default::default();
    let mut seen = vec![Vec::new(); count];
    let mut outer = |a: &mut f32, g: f32| {
        m = mu * m + g;
        *a -= lr * if c.nesterov { g + mu * m } else { m };
    };
    let mut synced_last = true;
    for s in 0..steps {
        if let Some((d, at)) = dies
            && at == s
        {
            live.retain(|&i| i != d);
        }
        for &i in &live {
            w[i] -= (i + 1) as f32 * (s + 1) as f32 * 0.1;
        }
        while pending.front().is_some_and(|p| p.0 <= s) {
            let (_, g) = pending.pop_front().unwrap();
            outer(&mut a, g);
            live.iter()
                .for_each(|&i| w[i] = alpha * w[i] + (1.0 - alpha) * a);
        }
        synced_last = (s + 1) % h == 0;
        if synced_last {
            let g = live.iter().map(|&i| a - w[i]).sum::<f32>() / live.len() as f32;
            if tau == 0 {
                outer(&mut a, g);
                live.iter().for_each(|&i| w[i] = a);
            } else {
                pending.push_back((s + tau, g));
            }
        }
        live.iter().for_each(|&i| seen[i].push(w[i]));
    }
    while let Some((_, g)) = pending.pop_front() {
        outer(&mut a, g);
        live.iter()
            .for_each(|&i| w[i] = alpha * w[i] + (1.0 - alpha) * a);
    }
    if tau > 0 || !synced_last {
        let g = live.iter().map(|&i| a - w[i]).sum::<f32>() / live.len() as f32;
        outer(&mut a, g);
        live.iter().for_each(|&i| w[i] = a);
    }
    live.iter().for_each(|&i| seen[i].push(w[i]));
    seen
}

/// Checks a surviving rank's values against the hand computation, within 1e-5.
fn assert_by_hand(got: &[f32], expected: &[f32], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: {got:?} vs {expected:?}");
    for (a, b) in got.iter().zip(expected) {
        assert!((a - b).abs() < 1e-5, "{what}: {got:?} vs {expected:?}");
    }
}

fn dropping(inner_steps: usize) -> DiLoCoConfig {
    DiLoCoConfig {
        inner_steps,
        outer_lr: 0.7,
        outer_momentum: 0.9,
        drop_lost_islands: true,
        ..DiLoCoConfig::default()
    }
}

/// The survivors of [`shifting_islands`] (ranks of the islands other than `dead`) agree with
/// each other and with the hand computation where `dead` stops at step `at`, and their
/// history names `dead` as dropped at the sync of step `at` (the first one it missed), and
/// only there.
fn check_survivors(
    outcomes: &[Option<Survivor>],
    count: usize,
    config: &DiLoCoConfig,
    steps: usize,
    (dead, at): (usize, usize),
    what: &str,
) {
    let ranks_per_island = outcomes.len() / count;
    let expected = shifting_by_hand(count, config, steps, Some((dead, at)));
    let intact = shifting_by_hand(count, config, steps, None);
    let first = outcomes[0].as_ref().expect("island 0 survives");
    for (rank, outcome) in outcomes.iter().enumerate() {
        let island = rank / ranks_per_island;
        if island == dead {
            assert!(outcome.is_none(), "{what}: rank {rank} died");
            continue;
        }
        let (values, history) = outcome.as_ref().expect("a survivor");
        assert_eq!(
            values.last(),
            first.0.last(),
            "{what}: rank {rank} ends with island 0's outer model"
        );
        assert_by_hand(values, &expected[island], &format!("{what}, rank {rank}"));
        let drops: Vec<(Option<usize>, Vec<usize>)> = history
            .iter()
            .filter(|e| !e.dropped.is_empty())
            .map(|e| (e.step, e.dropped.clone()))
            .collect();
        // The first sync the dead island missed.
        let sync_of = (at..).find(|s| (s + 1) % config.inner_steps == 0).unwrap();
        assert_eq!(
            drops,
            vec![(Some(sync_of), vec![dead])],
            "{what}: rank {rank}"
        );
        for e in history {
            let before = e.step.is_some_and(|s| s < sync_of);
            assert_eq!(
                e.islands,
                if before { count } else { count - 1 },
                "{what}: {e:?}"
            );
        }
    }
    // Not vacuous: the run without the loss differs.
    assert!(
        (first.0.last().unwrap() - intact[0].last().unwrap()).abs() > 1e-3,
        "{what}: dropping an island must change the outer model"
    );
}

/// Three islands of one rank and of two ranks (local threads, Nesterov outer SGD): island 2
/// fails before step 3 (its ranks abort, as `run_local` does for a rank that fails); islands
/// 0 and 1 drop it at once, average over the two of them from that sync on and finish with
/// equal parameters, equal to the hand computation of that run.
#[test]
fn a_lost_island_is_dropped_and_the_others_go_on() {
    for (ranks, h) in [(3, 1), (6, 2)] {
        let config = dropping(h);
        let steps = 8;
        let start = std::time::Instant::now();
        let outcome = run_local(ranks, |world| {
            let world = world.with_timeout(std::time::Duration::from_secs(60));
            shifting_islands(&world, 3, config, steps, Some((2, 3)), &|world| {
                world.abort("island 2 lost its machine")
            })
            .map_err(|e| CollectiveError::InvalidArgument {
                rank: world.global_rank(),
                op: "test".into(),
                reason: e.to_string(),
            })
        });
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the loss was seen at once, not after the timeout"
        );
        let outcomes = match outcome {
            // Thread ranks share one transport, and its abort reaches every rank's pending
            // collective: with two ranks per island, a surviving island can be inside one of
            // its own collectives when island 2 aborts (timing), and then reports that abort
            // (directly, as the typed "restart the job" error, or as island 0 left alone once
            // island 1 went down with it) instead of dropping the island.
            // Over TCP a dead process only breaks its own connections. Either outcome names the
            // injected failure; anything else (another error, a hang, wrong parameters) fails.
            Err(e)
                if h > 1
                    && ["island 2 lost its machine", "every other island is gone"]
                        .iter()
                        .any(|cause| e.to_string().contains(cause)) =>
            {
                eprintln!(
                    "{ranks} ranks, H = {h}: a surviving island was inside its own collective: {e}"
                );
                continue;
            }
            other => other.unwrap(),
        };
        check_survivors(
            &outcomes,
            3,
            &config,
            steps,
            (2, 3),
            &format!("{ranks} ranks, H = {h}"),
        );
    }
}

/// An island whose rank just returns (no failure reported: its peers only stop hearing from
/// it) is dropped when the outer exchange's deadline (the group's timeout) passes.
#[test]
fn an_island_that_goes_silent_is_dropped_at_the_deadline() {
    let config = dropping(1);
    let timeout = std::time::Duration::from_secs(5);
    let outcomes = run_local(3, |world| {
        let world = world.with_timeout(timeout);
        shifting_islands(&world, 3, config, 6, Some((2, 2)), &|_| {}).map_err(|e| {
            CollectiveError::InvalidArgument {
                rank: world.global_rank(),
                op: "test".into(),
                reason: e.to_string(),
            }
        })
    })
    .unwrap();
    check_survivors(&outcomes, 3, &config, 6, (2, 2), "silent island");
}

/// The same over TCP (every rank a thread with its own loopback connections): rank 2 cuts its
/// connections as a crashed process would; ranks 0 and 1 drop it at once and go on.
#[test]
fn a_crashed_tcp_rank_is_dropped_and_the_others_go_on() {
    use burn_parallel::comm::tcp::TcpTransport;
    use burn_parallel::{TcpConfig, TcpRendezvous};
    let timeout = std::time::Duration::from_secs(60);
    let config = dropping(2);
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let mut rendezvous = Some(rendezvous);
    let start = std::time::Instant::now();
    let outcomes: Vec<Option<Survivor>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let rendezvous = if rank == 0 { rendezvous.take() } else { None };
                scope.spawn(move || {
                    let tcp = TcpConfig::new(rank, 3, "127.0.0.1", port).with_timeout(timeout);
                    let transport = TcpTransport::connect(&tcp, rendezvous).unwrap();
                    let world = ProcessGroup::world(transport.clone()).with_timeout(timeout);
                    shifting_islands(&world, 3, config, 8, Some((2, 5)), &|_| {
                        transport.disconnect_abruptly()
                    })
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    check_survivors(&outcomes, 3, &config, 8, (2, 5), "tcp");
}

/// When every other island is gone there is nothing to average with: a typed error naming
/// them, at once.
#[test]
fn when_every_other_island_is_gone_it_is_a_typed_error() {
    let outcomes = run_local(2, |world| {
        let world = world.with_timeout(std::time::Duration::from_secs(60));
        Ok(
            shifting_islands(&world, 2, dropping(1), 4, Some((1, 1)), &|world| {
                world.abort("island 1 lost its machine")
            })
            .err(),
        )
    })
    .unwrap();
    assert_eq!(
        outcomes[0],
        Some(DiLoCoError::AllIslandsLost {
            island: 0,
            dropped: vec![1]
        })
    );
    println!("{}", outcomes[0].as_ref().unwrap());
}

fn overlapping(inner_steps: usize, overlap_steps: usize) -> DiLoCoConfig {
    DiLoCoConfig {
        inner_steps,
        outer_lr: 0.7,
        outer_momentum: 0.9,
        overlap_steps,
        overlap_mix: 0.5,
        ..DiLoCoConfig::default()
    }
}

/// The overlap against the delayed rule written out by hand (H = 4, τ = 1 and 3, mix 0.5,
/// Nesterov): each update lands exactly once, `τ` steps after its pseudo-gradient left, merged
/// half and half with the local values; and with an island dropped meanwhile.
#[test]
fn overlap_applies_each_update_once_tau_steps_later() {
    for tau in [1, 3] {
        let config = overlapping(4, tau);
        let steps = 12;
        let outcomes = run_local(2, |world| {
            Ok(shifting_islands(&world, 2, config, steps, None, &|_| {})
                .unwrap()
                .unwrap())
        })
        .unwrap();
        let expected = shifting_by_hand(2, &config, steps, None);
        for (island, (values, history)) in outcomes.iter().enumerate() {
            assert_by_hand(
                values,
                &expected[island],
                &format!("tau {tau}, island {island}"),
            );
            let sent: Vec<(Option<usize>, Option<usize>)> =
                history.iter().map(|e| (e.step, e.applied)).collect();
            // Sent after steps 3, 7 and 11; applied τ steps later (the last one at the end),
            // then the final sync.
            let expected_events = vec![
                (Some(3), Some(3 + tau)),
                (Some(7), Some(7 + tau)),
                (Some(11), Some(11)),
                (None, None),
            ];
            assert_eq!(sent, expected_events, "tau {tau}");
        }
        // The islands differ while updates are merged, and agree at the end.
        assert_ne!(outcomes[0].0[5], outcomes[1].0[5]);
        assert_eq!(outcomes[0].0.last(), outcomes[1].0.last());
        // Not vacuous: without the overlap the outer model differs.
        let direct = shifting_by_hand(2, &overlapping(4, 0), steps, None);
        assert!((expected[0].last().unwrap() - direct[0].last().unwrap()).abs() > 1e-3);
    }
    // Overlap and a dropped island together (3 islands, island 2 fails before step 5).
    let config = DiLoCoConfig {
        drop_lost_islands: true,
        ..overlapping(2, 1)
    };
    let outcomes = run_local(3, |world| {
        let world = world.with_timeout(std::time::Duration::from_secs(60));
        Ok(
            shifting_islands(&world, 3, config, 8, Some((2, 5)), &|world| {
                world.abort("island 2 lost its machine")
            })
            .unwrap(),
        )
    })
    .unwrap();
    let expected = shifting_by_hand(3, &config, 8, Some((2, 5)));
    for island in 0..2 {
        let (values, history) = outcomes[island].as_ref().unwrap();
        assert_by_hand(
            values,
            &expected[island],
            &format!("overlap + drop, {island}"),
        );
        let dropped: Vec<_> = history.iter().filter(|e| !e.dropped.is_empty()).collect();
        assert_eq!(dropped.len(), 1, "{history:?}");
        assert_eq!((dropped[0].step, &dropped[0].dropped), (Some(5), &vec![2]));
    }
}

/// Streaming DiLoCo with an overlap on the GPT (H = 6, F = 3, τ = 2): every fragment's
/// pseudo-gradient is sent on its schedule and its update applied exactly once, 2 steps later
/// (the last ones at the end); the islands end with equal parameters, which still train.
#[test]
fn streaming_overlap_applies_every_fragment_once_on_schedule() {
    let (h, f, tau) = (6, 3, 2);
    let observed = run_local(2, |world| {
        // Autodiff: merged parameters must stay trainable leaves.
        let device = Device::flex().autodiff();
        let islands = Islands::new(&world, 2).unwrap();
        let mut model = Gpt::new(&GptConfig::new(256, 2, 2, 16, 16), &device);
        let settings = DiLoCoConfig {
            inner_steps: h,
            fragments: f,
            overlap_steps: tau,
            ..DiLoCoConfig::default()
        };
        let mut diloco = DiLoCo::new(&islands, settings, &model).unwrap();
        for step in 0..2 * h {
            model = shift_all(model, 0.01 * (islands.index() + 1) as f32);
            model = diloco.sync(step, model).unwrap();
        }
        model = diloco.finish(model).unwrap();
        let all: BTreeSet<String> = params_of(&model).into_keys().collect();
        let equal = equal_across(&world, &params_of(&model));
        // The merged parameters are trainable leaves: a backward pass reaches all of them.
        let tokens = Tensor::<2, burn::tensor::Int>::zeros([1, 16], &device);
        let loss = model.forward(tokens).unwrap().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        assert_eq!(grads.len(), all.len(), "every parameter gets a gradient");
        Ok((diloco.history().to_vec(), equal == all))
    })
    .unwrap();
    let (history, equal) = &observed[0];
    assert!(equal, "the islands end with the same parameters");
    let events: Vec<(usize, Option<usize>, Option<usize>)> = history
        .iter()
        .map(|e| (e.fragment, e.step, e.applied))
        .collect();
    let expected = vec![
        (1, Some(1), Some(3)),
        (2, Some(3), Some(5)),
        (0, Some(5), Some(7)),
        (1, Some(7), Some(9)),
        (2, Some(9), Some(11)),
        (0, Some(11), Some(11)), // in flight at the end: applied by finish
        (0, None, None),
        (1, None, None),
        (2, None, None),
    ];
    assert_eq!(events, expected);
}

/// The GPT trainer with an overlap (H = 5, τ = 2, AdamW inside): it trains, the islands end
/// with the same parameters, and the outer bytes, sent by the background thread while the
/// inner steps run, are counted exactly: 4 sends and the final sync of every fragment, 4 bytes
/// per element each (2 islands).
#[test]
fn the_gpt_trains_with_an_overlap_and_counts_its_outer_bytes() {
    let config = tiny_gpt_run(20);
    let mut run = compression_run(Compression::F32);
    run.config.overlap_steps = 2;
    let r = &diloco(2, &config, &run)[0];
    let elements = Gpt::new(&config.model, &Device::flex()).num_params() as u64;
    assert_eq!(r.figures.syncs, 5);
    assert_eq!(r.figures.outer_bytes, 5 * 4 * elements);
    let losses = &r.train.losses;
    assert!(
        losses[19] < losses[0] - 0.5 && r.train.val_loss.is_finite(),
        "{losses:?}"
    );
}

/// The process form: three `gpt --backend tcp --diloco-drop-lost` processes, rank 2 killed
/// (SIGKILL) mid-run; ranks 0 and 1 drop its island, finish the run and exit cleanly, rank 0
/// naming the island dropped. No hang: well within the 60 s timeout.
#[test]
fn a_killed_gpt_process_is_dropped_and_the_others_finish() {
    use std::io::{BufRead, BufReader};
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let dir =
        std::env::temp_dir().join(format!("burn-parallel-diloco-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("run.toml");
    let config = TrainConfig {
        batch_size: 6, // 2 rows per island
        ..tiny_gpt_run(40)
    };
    std::fs::write(&config_path, toml::to_string(&config).unwrap()).unwrap();
    let start = std::time::Instant::now();
    let mut children: Vec<std::process::Child> = (0..3)
        .map(|rank| {
            tests::gpt_rank(rank, 3, port, "diloco-kill-test")
                .args([
                    "--backend",
                    "tcp",
                    "--diloco-islands",
                    "3",
                    "--inner-steps",
                    "2",
                ])
                .args(["--diloco-drop-lost", "--log-every", "1", "--config"])
                .arg(&config_path)
                .spawn()
                .unwrap()
        })
        .collect();
    // Kill rank 2 once rank 0 has logged step 5.
    let stdout = children[0].stdout.take().unwrap();
    let mut lines = Vec::new();
    let mut killed = false;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if !killed && line.starts_with("step") && line.contains("    5 ") {
            children[2].kill().unwrap();
            killed = true;
        }
        lines.push(line);
    }
    let out: String = lines.join("\n");
    let statuses: Vec<_> = children.iter_mut().map(|c| c.wait().unwrap()).collect();
    let stderr = |c: &mut std::process::Child| {
        let mut s = String::new();
        std::io::Read::read_to_string(c.stderr.as_mut().unwrap(), &mut s).unwrap();
        s
    };
    let errs: Vec<String> = children.iter_mut().map(stderr).collect();
    std::fs::remove_dir_all(&dir).ok();
    assert!(killed, "rank 0 logged step 5:\n{out}\n{}", errs[0]);
    assert!(!statuses[2].success(), "rank 2 was killed");
    for rank in [0, 1] {
        assert!(
            statuses[rank].success(),
            "rank {rank}: {}\n{out}\n{}",
            statuses[rank],
            errs[rank]
        );
        assert!(
            errs[rank].contains("dropped island(s) [2]"),
            "rank {rank}: {}",
            errs[rank]
        );
    }
    assert!(
        out.contains("DiLoCo: island 2 dropped at the sync of step"),
        "{out}"
    );
    assert!(out.contains("step    39"), "{out}");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(60),
        "no wait for the timeout"
    );
    println!("{out}\n{}", errs[0]);
}

/// A DiLoCo run of the GPT on `ranks` thread ranks, saving and resuming as `config` says:
/// rank 0's report (the ranks agree), or the first rank's error.
fn diloco_checkpointed(
    ranks: usize,
    config: &TrainConfig,
    run: &DiLoCoLayout,
) -> Result<DiLoCoReport, String> {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = burn_parallel_train::run_local(ranks, |g| {
        train_gpt_diloco(&g, config, run, &corpus, &mut |_| {})
    })
    .map_err(|e| e.to_string())?;
    Ok(tests::rank0_if_ranks_agree(reports, |r| {
        (&r.train.losses, &r.train.final_params)
    }))
}

/// Streaming DiLoCo with an overlap, Nesterov momentum and AdamW inside, saved after step 6 of
/// 16: between two syncs (the islands' models differ) and with fragment 1's exchange in
/// flight (sent after step 5, applied after step 6). Resumed at the same layout it goes on bit
/// for bit; with 2 ranks per island instead of 1, within 1e-5. The checkpoint's outer model
/// loads into a run without DiLoCo; another number of islands, and a checkpoint without
/// DiLoCo's state, are refused with what differs.
#[test]
fn a_diloco_run_resumes_from_a_checkpoint_between_syncs() {
    const SAVED: usize = 6;
    let config = tiny_gpt_run(16);
    let run = DiLoCoLayout {
        islands: 2,
        config: DiLoCoConfig {
            inner_steps: 4,
            fragments: 2,
            overlap_steps: 1,
            ..DiLoCoConfig::default()
        },
        inner_sgd: false,
    };
    let dir = std::env::temp_dir().join(format!("bp-diloco-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = TrainConfig {
        save: Some(CheckpointPolicy {
            every: SAVED,
            at_end: false,
            keep: 5,
            ..CheckpointPolicy::new(&dir)
        }),
        ..config.clone()
    };
    let resume = TrainConfig {
        resume: Some(dir.join(format!("step-{SAVED:08}"))),
        ..config.clone()
    };
    let saving = diloco_checkpointed(2, &save, &run).unwrap();
    let same = diloco_checkpointed(2, &resume, &run).unwrap();
    assert_eq!(same.train.losses, saving.train.losses, "identical losses");
    assert_eq!(
        same.train.final_params, saving.train.final_params,
        "identical parameters"
    );
    let reference = Reference::of_run(saving.train);
    let wider = diloco_checkpointed(4, &resume, &run).unwrap();
    assert_matches_reference(
        &reference,
        &wider.train.losses,
        &wider.train.final_params,
        TOL,
        "2 islands of 2 ranks",
    );
    // Other DiLoCo settings, or another number of islands, are refused.
    let other = DiLoCoLayout {
        config: DiLoCoConfig {
            outer_momentum: 0.5,
            ..run.config
        },
        ..run
    };
    let err = diloco_checkpointed(2, &resume, &other).unwrap_err();
    assert!(err.contains("saved with the settings"), "{err}");
    let one = DiLoCoLayout { islands: 1, ..run };
    let err = diloco_checkpointed(2, &resume, &one).unwrap_err();
    assert!(
        err.contains("saved with 2 islands, this run has 1"),
        "{err}"
    );

    // The outer model, under the model's own names, loads without DiLoCo.
    let corpus = Corpus::load_default().expect("the bundled corpus");
    // The first SAVED steps of `config`'s run without DiLoCo on `ranks` ranks.
    let plain_run = |ranks: usize, config: &TrainConfig| {
        let at_save = TrainConfig {
            steps: SAVED,
            ..config.clone()
        };
        burn_parallel_train::run_local(ranks, |g| {
            let parallel = Parallelism::default();
            examples::train::train_gpt(&g, &at_save, &parallel, &corpus, &mut |_| {})
        })
        .unwrap()
        .remove(0)
    };
    let plain = plain_run(1, &resume);
    let checkpoint =
        burn_parallel::checkpoint::Checkpoint::open(&dir.join(format!("step-{SAVED:08}"))).unwrap();
    for p in &plain.final_params {
        let saved = checkpoint
            .read_full(&p.path)
            .unwrap()
            .try_into_vec::<f32>()
            .unwrap();
        assert_eq!(saved, p.values, "{}: the outer model", p.path);
    }
    std::fs::remove_dir_all(&dir).unwrap();

    // A checkpoint of a run without DiLoCo.
    let plain_dir = dir.with_extension("plain");
    let plain_save = TrainConfig {
        save: Some(CheckpointPolicy {
            dir: plain_dir.clone(),
            ..save.save.clone().unwrap()
        }),
        ..config.clone()
    };
    plain_run(2, &plain_save);
    let from_plain = TrainConfig {
        resume: Some(plain_dir.clone()),
        ..config.clone()
    };
    let err = diloco_checkpointed(2, &from_plain, &run).unwrap_err();
    assert!(err.contains("was not saved by a DiLoCo run"), "{err}");
    std::fs::remove_dir_all(&plain_dir).unwrap();
}
