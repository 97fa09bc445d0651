//! The GPT trainer's settings and its engines' edge cases: runs that cannot fit, settings out
//! of range, refused before anything is built.

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor};
use burn_parallel::CollectiveError;
use burn_parallel::precision::LossScaler;
use burn_parallel::train::{StepEngine, TrainStep};
use burn_parallel_train::Layout;
use burn_zero::{ShardGroups, Stage, ZeroConfig, ZeroError, ZeroOptimizer};
use examples::data::Corpus;
use examples::gpt::GptConfig;
use examples::train::*;

/// A run that cannot fit is refused with the figures before anything is allocated (before:
/// `--d-model 1000000000000 --heads 1` panicked with "capacity overflow", `--batch-size
/// 100000000000` aborted out of memory with a backtrace).
#[test]
fn a_run_that_cannot_fit_is_refused_before_it_allocates() {
    let base = TrainConfig::default();
    let huge_model = TrainConfig {
        model: GptConfig {
            d_model: 1_000_000_000_000,
            n_heads: 1,
            ..base.model.clone()
        },
        ..base.clone()
    };
    let e = huge_model
        .check_memory(&Layout::default(), 1, 1)
        .unwrap_err();
    assert!(e.contains("needs about") && e.contains("--d-model"), "{e}");
    // Through the trainer: refused on every rank, nothing built.
    let corpus = Corpus::from_bytes(vec![b'a'; 4096]);
    let err = burn_parallel_train::run_local(2, |g| {
        train_gpt(&g, &huge_model, &Layout::default(), &corpus, &mut |_| {})
    })
    .unwrap_err();
    assert!(err.to_string().contains("needs about"), "{err}");
    // The batch: activations no machine of ours holds.
    let huge_batch = TrainConfig {
        batch_size: 100_000_000_000,
        ..base.clone()
    };
    if burn_parallel_train::available_memory().is_some() {
        let e = huge_batch
            .check_memory(&Layout::default(), 1, 1)
            .unwrap_err();
        assert!(e.contains("planner"), "{e}");
    }
    // What fits passes.
    base.check_memory(&Layout::default(), 2, 2).unwrap();
}

/// Each setting out of range is refused by name (each passed before: `--lr nan` trained to
/// a NaN loss, `--lr=-1` uphill, `--batch-size 0` on nothing, `--clip=-1` reversed the
/// update, `--clip nan` turned clipping off, `--clip 0` froze the weights).
#[test]
fn settings_out_of_range_are_refused_by_name() {
    let base = TrainConfig::default();
    assert_eq!(base.validate(2), Ok(()));
    let cases: Vec<(&str, TrainConfig)> = vec![
        (
            "--lr",
            TrainConfig {
                lr: f64::NAN,
                ..base.clone()
            },
        ),
        (
            "--lr",
            TrainConfig {
                lr: f64::INFINITY,
                ..base.clone()
            },
        ),
        (
            "--lr",
            TrainConfig {
                lr: -1.0,
                ..base.clone()
            },
        ),
        (
            "--lr",
            TrainConfig {
                lr: 0.0,
                ..base.clone()
            },
        ),
        (
            "--batch-size",
            TrainConfig {
                batch_size: 0,
                ..base.clone()
            },
        ),
        (
            "--clip",
            TrainConfig {
                max_grad_norm: Some(-1.0),
                ..base.clone()
            },
        ),
        (
            "--clip",
            TrainConfig {
                max_grad_norm: Some(f64::NAN),
                ..base.clone()
            },
        ),
        (
            "--clip",
            TrainConfig {
                max_grad_norm: Some(0.0),
                ..base.clone()
            },
        ),
        (
            "--bucket-mb",
            TrainConfig {
                bucket_mb: 0.0,
                ..base.clone()
            },
        ),
        (
            "--bucket-mb",
            TrainConfig {
                bucket_mb: -4.0,
                ..base.clone()
            },
        ),
        (
            "weight_decay",
            TrainConfig {
                weight_decay: f64::NAN,
                ..base.clone()
            },
        ),
        (
            "weight_decay",
            TrainConfig {
                weight_decay: -0.1,
                ..base.clone()
            },
        ),
    ];
    for (flag, config) in cases {
        let err = config.validate(2).expect_err(flag);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

/// A TOML key the config does not know is refused (it was silently ignored), at the top
/// and in the model's section, with the nearest key when one is close.
#[test]
fn unknown_toml_keys_are_refused() {
    let err = TrainConfig::from_toml("stpes = 10").unwrap_err();
    assert!(
        err.contains("stpes") && err.contains("did you mean `steps`"),
        "{err}"
    );
    let err = TrainConfig::from_toml("learning_rate = 0.5").unwrap_err();
    assert!(
        err.contains("unknown field `learning_rate`") && err.contains("`lr`"),
        "{err}"
    );
    let model = "[model]\nvocab_size = 256\nn_layers = 2\nn_heads = 4\nd_model = 128\n\
                 d_ff = 512\nmax_seq_len = 64\nn_head = 4\n";
    let err = TrainConfig::from_toml(model).unwrap_err();
    assert!(err.contains("did you mean `n_heads`"), "{err}");
    let config = TrainConfig::from_toml("lr = 0.01\n[loss_scale]\ninitial = 1024.0").unwrap();
    assert_eq!(
        (config.lr, config.loss_scale.unwrap().initial),
        (0.01, 1024.0)
    );
}

/// A corpus whose validation split is shorter than a window is refused before the first
/// step, on every rank (a rank's batch panicked before; the validation's after training).
#[test]
fn a_corpus_shorter_than_a_window_is_refused_before_training() {
    let config = TrainConfig {
        steps: 2,
        batch_size: 4,
        ..TrainConfig::default()
    };
    // 950 training bytes, 50 of validation: windows of 65 bytes fit only the first.
    let corpus = Corpus::from_bytes(vec![b'a'; 1000]);
    let steps = std::sync::atomic::AtomicUsize::new(0);
    let err = burn_parallel_train::run_local(2, |group| {
        let count = |_: &StepStats| {
            steps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        train_gpt(&group, &config, &Default::default(), &corpus, &mut {
            count
        })
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("Validation split has 50 bytes"), "{err}");
    assert_eq!(steps.into_inner(), 0, "no step before the refusal");
}

/// A NaN or infinite loss is a typed error, not an update (it trained on to NaN weights
/// and exited 0 before); with a loss scaler the step is skipped instead, as before.
#[test]
fn a_non_finite_loss_refuses_the_update() {
    use burn::module::Param;
    use burn_parallel::nn::TpContext;

    #[derive(Module, Debug)]
    struct Weights {
        w: Param<Tensor<1>>,
    }
    let device = Device::flex().autodiff();
    let model = Weights {
        w: Param::from_tensor(Tensor::from_floats([1.0, 2.0], &device)),
    };
    let mut optim = AdamWConfig::new().init();
    for bad in [f32::NAN, f32::INFINITY] {
        let forward = |m: &Weights| Ok::<_, CollectiveError>(m.w.val().sum().mul_scalar(bad));
        let step = TrainStep::new(TpContext::single());
        match step.step_with(model.clone(), forward, &mut optim, 1e-3) {
            Err(CollectiveError::NonFinite { what, value, .. }) => {
                assert_eq!(what, "loss");
                assert_eq!(value.is_nan(), bad.is_nan());
            }
            other => panic!("a loss of {bad} must be refused: {other:?}"),
        }
        let scaled = TrainStep::new(TpContext::single()).with_loss_scaler(LossScaler::new(8.0));
        let (kept, out) = scaled
            .step_with(model.clone(), forward, &mut optim, 1e-3)
            .unwrap();
        assert!(out.skipped, "a loss scaler skips the step");
        let weights = kept.w.val().into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(weights, vec![1.0, 2.0]);
    }
    // ZeRO-2's engine over two ranks: both refuse the step, before its update.
    let outcomes = burn_parallel::run_local(2, |group| {
        let device = Device::flex().autodiff();
        let model = Weights {
            w: Param::from_tensor(Tensor::from_floats([1.0, 2.0], &device)),
        };
        let adamw = AdamWConfig::new().build();
        let config = ZeroConfig::new(Stage::Two);
        let mut zero = ZeroOptimizer::new(&model, ShardGroups::flat(group), config, adamw).unwrap();
        let model = zero.prepare_module(model).unwrap();
        let mut forward = |m: &Weights, _: usize| Ok(m.w.val().sum().mul_scalar(f32::NAN));
        let engine: &mut dyn StepEngine<Weights, ZeroError> = &mut zero;
        match engine.step_accumulated(model, 1, &mut forward, 1e-3) {
            Err(ZeroError::Collective(CollectiveError::NonFinite { what, .. })) => Ok(what),
            other => panic!("ZeRO must refuse a NaN loss: {other:?}"),
        }
    })
    .unwrap();
    assert_eq!(outcomes, vec!["loss", "loss"]);
    // A finite loss whose gradient is not (sqrt at 0), without clipping: the norm is
    // computed every step and refused by the step and by ZeRO-2 alike (before, both wrote
    // an infinite gradient into the weights: only a clipped step measured the norm).
    let forward = |m: &Weights| Ok::<_, CollectiveError>(m.w.val().sqrt().sum());
    let zeros = Weights {
        w: Param::from_tensor(Tensor::from_floats([0.0, 1.0], &device)),
    };
    match TrainStep::new(TpContext::single()).step_with(zeros, forward, &mut optim, 1e-3) {
        Err(CollectiveError::NonFinite { what, .. }) => assert_eq!(what, "gradient norm"),
        other => panic!("an infinite gradient must be refused: {other:?}"),
    }
    let outcomes = burn_parallel::run_local(2, |group| {
        let device = Device::flex().autodiff();
        let model = Weights {
            w: Param::from_tensor(Tensor::from_floats([0.0, 1.0], &device)),
        };
        let adamw = AdamWConfig::new().build();
        let mut zero = ZeroOptimizer::new(
            &model,
            ShardGroups::flat(group),
            ZeroConfig::new(Stage::Two),
            adamw,
        )
        .unwrap();
        let model = zero.prepare_module(model).unwrap();
        let mut forward = |m: &Weights, _: usize| Ok(m.w.val().sqrt().sum());
        let engine: &mut dyn StepEngine<Weights, ZeroError> = &mut zero;
        match engine.step_accumulated(model, 1, &mut forward, 1e-3) {
            Err(ZeroError::Collective(CollectiveError::NonFinite { what, .. })) => Ok(what),
            other => panic!("ZeRO must refuse an infinite gradient: {other:?}"),
        }
    })
    .unwrap();
    assert_eq!(outcomes, vec!["gradient norm", "gradient norm"]);
}
