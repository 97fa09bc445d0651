//! `burn_parallel_train::fit`, the library's training loop: a run stopped after step k (by the
//! flag a Ctrl-C handler sets, on one rank only) saves, and resumed from that checkpoint it
//! ends where the uninterrupted run ends: the same losses and final parameters, under the same
//! layout or another.

// The bring-your-own-model decoder; this test uses its dense build only.
#[path = "../../examples/examples/byo_model/model.rs"]
#[allow(dead_code)]
mod model;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::optim::AdamWConfig;
use burn::tensor::{Device, TensorData};
use burn_moe::MoeParallel;
use burn_parallel::optim::FusedAdamWConfig;
use burn_parallel::plan::TpPlan;
use burn_parallel::train::{StepEngine, TrainStep, Trainer};
use burn_parallel_train::{
    Built, CheckpointPolicy, FitConfig, Layout, LrSchedule, MicroBatch, ModelParts, ParallelModel,
    StepLog, StepSettings, Trainee, build, fit, open_checkpoint, run_local,
};
use burn_zero::{FsdpPlan, Stage};
use examples::data::{Batch, Corpus, Split};
use model::{Config, Decoder, Recipe};

const STEPS: usize = 6;
const BATCH: usize = 8;
const SEQ: usize = 16;

fn recipe() -> Recipe {
    Recipe {
        config: Config {
            vocab: 256,
            d_model: 32,
            n_heads: 4,
            d_ff: 48,
            n_layers: 2,
            seed: 3,
        },
        moe: None,
    }
}

type Params = Vec<(String, TensorData)>;

/// The settings of the tests that need no more than the batch (AdamW, clipping at 1).
fn batch_settings() -> StepSettings {
    StepSettings {
        batch_size: BATCH,
        seq_len: SEQ,
        ..StepSettings::default()
    }
}

/// This rank's rows of micro-batch `micro` of the bundled corpus.
fn corpus_batch(corpus: &Corpus, micro: &MicroBatch) -> Batch {
    corpus.batch_rows(micro.step as u64, micro.rows.clone(), SEQ, Split::Train)
}

/// `built` stepped by `engine(model)` in place of the layout's engine.
fn with_engine(
    built: &mut Built<Recipe>,
    engine: impl FnOnce(&Decoder) -> Box<dyn StepEngine<Decoder, burn_parallel::Error>>,
) {
    if let Trainee::Whole { model, engine: e } = &mut built.trainee {
        *e = engine(model);
    }
}

/// The decoder whose loss is NaN on a micro-batch marked poisoned.
struct Poisoned(Recipe);

impl ParallelModel for Poisoned {
    type Model = Decoder;
    type Batch = (Batch, bool);

    fn loss(
        model: &Decoder,
        (batch, poisoned): &(Batch, bool),
    ) -> Result<burn::tensor::Tensor<1>, burn_parallel::Error> {
        let loss = Recipe::loss(model, batch)?;
        Ok(if *poisoned {
            loss.mul_scalar(f32::NAN)
        } else {
            loss
        })
    }
    fn n_heads(&self) -> usize {
        self.0.n_heads()
    }
    fn seed(&self) -> u64 {
        self.0.seed()
    }
    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        self.0.tp_plan(sequence_parallel)
    }
    fn fsdp_plan(&self, shard: &burn_parallel::ProcessGroup, experts: &MoeParallel) -> FsdpPlan {
        self.0.fsdp_plan(shard, experts)
    }
    fn build(&self, parts: &ModelParts) -> Result<Decoder, burn_parallel::Error> {
        self.0.build(parts)
    }
}

struct Outcome {
    losses: Vec<f32>,
    params: Params,
    stopped_at: Option<usize>,
    /// The step, the ranks and the layout of the checkpoint resumed from.
    resumed_from: Option<(usize, usize, Option<String>)>,
}

/// `fit` of the decoder on `ranks` thread ranks under `layout`; with `stop_after`, rank 0's
/// flag is set after that many steps.
fn train(ranks: usize, layout: Layout, config: &FitConfig, stop_after: Option<usize>) -> Outcome {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let settings = StepSettings {
        max_grad_norm: Some(1.0),
        adamw: FusedAdamWConfig::new()
            .with_weight_decay(0.01)
            .with_epsilon(1e-3),
        batch_size: BATCH,
        seq_len: SEQ,
        grad_accum: 2,
        ..StepSettings::default()
    };
    let mut out = run_local(ranks, |world| {
        let device = Device::flex().autodiff();
        let built = build(&world, &layout, &recipe(), &device, &settings)?;
        let flag = AtomicBool::new(false);
        let mut batch = |micro: &MicroBatch| Ok(corpus_batch(&corpus, micro));
        // What a Ctrl-C handler does, on one rank: the ranks agree to stop after this step.
        let mut on_step = |log: &StepLog, _: &Built<Recipe>| {
            if world.rank() == 0 && Some(log.step + 1) == stop_after {
                flag.store(true, Ordering::SeqCst);
            }
            Ok(())
        };
        let fitted = fit(built, config, &mut batch, &mut on_step, Some(&flag))?;
        let (losses, stopped_at) = (fitted.losses, fitted.stopped_at);
        let resumed_from = fitted.resumed_from.map(|r| (r.step, r.saved_by, r.layout));
        let params = fitted.built.trained(&recipe())?.whole_params()?;
        Ok(Outcome {
            losses,
            params,
            stopped_at,
            resumed_from,
        })
    })
    .unwrap_or_else(|e| panic!("{e}"));
    out.swap_remove(0)
}

fn fit_config(checkpoint: Option<&PathBuf>, resume: Option<&PathBuf>) -> FitConfig {
    FitConfig {
        steps: STEPS,
        lr: LrSchedule {
            peak: 3e-3,
            warmup: 2,
            steps: STEPS,
            floor: 0.1,
        },
        checkpoint: checkpoint.map(CheckpointPolicy::new),
        resume: resume.cloned(),
        check_replicas_every: 1,
    }
}

/// The worst relative difference of `a` and `b`, losses and parameters.
fn assert_close(what: &str, a: &Outcome, b: &Outcome, tol: f32) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: steps");
    for (step, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        assert!(
            ((x - y) / y).abs() <= tol,
            "{what}: loss of step {step}: {x} vs {y}"
        );
    }
    assert_eq!(a.params.len(), b.params.len(), "{what}: parameters");
    for ((name, x), (other, y)) in a.params.iter().zip(&b.params) {
        assert_eq!(name, other, "{what}");
        let x = x.try_to_vec::<f32>().unwrap();
        let y = y.try_to_vec::<f32>().unwrap();
        let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            assert!(
                (p - q).abs() / scale <= tol,
                "{what}: {name}[{i}]: {p} vs {q}"
            );
        }
    }
}

#[test]
fn a_run_stopped_by_the_flag_resumes_where_the_uninterrupted_run_ends() {
    let dir = std::env::temp_dir().join(format!("fit-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // dp 2 x tp 2 + sp, ZeRO-2: parameters, optimizer state and the ZeRO shards all saved.
    let layout = Layout {
        tp: 2,
        sp: true,
        zero: Some(Stage::Two),
        ..Layout::default()
    };
    let whole = train(4, layout, &fit_config(None, None), None);
    assert_eq!(whole.stopped_at, None);
    assert_eq!(whole.losses.len(), STEPS);

    // Stopped after step 2 of 6: it saves there and reports it.
    let stopped = train(4, layout, &fit_config(Some(&dir), None), Some(2));
    assert_eq!(stopped.stopped_at, Some(2));
    assert_eq!(stopped.losses, whole.losses[..2]);
    assert_eq!(open_checkpoint(&dir).unwrap().step(), 2);

    // Resumed under the same layout: the same run, to the last bit of the losses.
    let resumed = train(4, layout, &fit_config(None, Some(&dir)), None);
    assert_eq!(resumed.stopped_at, None);
    // It names what it loaded: step 2, saved by 4 ranks, and their layout.
    let saved_as = Some("dp 2 x tp 2 + sp, ZeRO-2".to_string());
    assert_eq!(resumed.resumed_from, Some((2, 4, saved_as.clone())));
    assert_close("resumed under the same layout", &resumed, &whole, 1e-6);
    // Resumed under FSDP on 2 ranks: the checkpoint outlives the layout.
    let fsdp = Layout {
        zero: Some(Stage::Three),
        ..Layout::default()
    };
    let moved = train(2, fsdp, &fit_config(None, Some(&dir)), None);
    assert_eq!(moved.resumed_from, Some((2, 4, saved_as)));
    assert_close("resumed under fsdp 2", &moved, &whole, 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Resuming from a directory without a checkpoint is a clear error on every rank, not a fresh
/// run that silently starts over.
#[test]
fn resuming_from_nothing_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("fit-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = fit_config(None, Some(&dir));
    let settings = batch_settings();
    let err = run_local(2, |world| {
        let device = Device::flex().autodiff();
        let built = build(&world, &Layout::default(), &recipe(), &device, &settings)?;
        let mut batch = |_: &MicroBatch| unreachable!("no step is taken");
        fit(built, &config, &mut batch, &mut |_, _| Ok(()), None).map(|_| ())
    })
    .unwrap_err();
    assert!(err.to_string().contains("no complete checkpoint"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Replicas that drift apart are caught by `fit`'s periodic check, naming the parameter: here
/// each of 2 data-parallel ranks steps on its own rows with an engine that does not reduce
/// gradients (what a step built without its data-parallel reduction does).
#[test]
fn replicas_that_drift_apart_are_an_error() {
    let settings = batch_settings();
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let config = FitConfig {
        check_replicas_every: 2,
        ..FitConfig::new(STEPS, 3e-3)
    };
    let err = run_local(2, |world| {
        let device = Device::flex().autodiff();
        let mut built = build(&world, &Layout::default(), &recipe(), &device, &settings)?;
        with_engine(&mut built, |model| {
            let alone = TrainStep::new(model.tp.clone());
            Box::new(Trainer::new(alone, AdamWConfig::new().init()))
        });
        let mut batch = |micro: &MicroBatch| Ok(corpus_batch(&corpus, micro));
        fit(built, &config, &mut batch, &mut |_, _| Ok(()), None).map(|_| ())
    })
    .unwrap_err();
    assert!(
        matches!(err, burn_parallel::Error::Replica(_))
            && err.to_string().contains("replicas differ"),
        "{err}"
    );
}

/// A step whose loss turns NaN (here on one data-parallel rank's rows of step 3) stops the run
/// on every rank with an error naming the step, the rank and the loss, and saves nothing over
/// the last good checkpoint (step 2's, saved every step). Before, the error did not say which
/// step.
#[test]
fn a_non_finite_step_stops_the_run_naming_the_step() {
    let dir = std::env::temp_dir().join(format!("fit-nan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let settings = batch_settings();
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let config = FitConfig {
        checkpoint: Some(CheckpointPolicy {
            every: 1,
            ..CheckpointPolicy::new(&dir)
        }),
        ..FitConfig::new(STEPS, 3e-3)
    };
    let err = run_local(2, |world| {
        let device = Device::flex().autodiff();
        let built = build(
            &world,
            &Layout::default(),
            &Poisoned(recipe()),
            &device,
            &settings,
        )?;
        let rank = world.rank();
        let mut batch = |micro: &MicroBatch| {
            let poisoned = (micro.step, rank) == (2, 1);
            Ok((corpus_batch(&corpus, micro), poisoned))
        };
        fit(built, &config, &mut batch, &mut |_, _| Ok(()), None).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("step 3") && err.contains("loss is NaN") && err.contains("rank"),
        "{err}"
    );
    assert_eq!(
        open_checkpoint(&dir).unwrap().step(),
        2,
        "the last good one"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// DiLoCo through the builder, its islands' steps and outer loop one `StepEngine`.
fn diloco(inner_steps: usize, momentum: f64, inner_sgd: bool) -> Layout {
    use burn_parallel::diloco::DiLoCoConfig;
    Layout {
        diloco: Some(burn_parallel_train::DiLoCoLayout {
            islands: 2,
            config: DiLoCoConfig {
                inner_steps,
                outer_lr: if momentum == 0.0 { 1.0 } else { 0.7 },
                outer_momentum: momentum,
                nesterov: momentum > 0.0,
                ..DiLoCoConfig::default()
            },
            inner_sgd,
        }),
        ..Layout::default()
    }
}

/// DiLoCo with one inner step, outer SGD at learning rate 1 without momentum, and SGD inside
/// is data parallelism with SGD: the islands' models averaged after one SGD step each are the
/// model stepped by the averaged gradient. Built by `build` from the layout, trained by `fit`.
#[test]
fn diloco_from_the_builder_at_one_inner_step_is_data_parallelism() {
    use burn::optim::SgdConfig;
    use burn_parallel::DistributedDataParallel;
    // No clipping: each island would clip its own gradient, DDP the average.
    let settings = StepSettings {
        max_grad_norm: None,
        ..batch_settings()
    };
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let config = FitConfig::new(STEPS, 0.05);
    let run = |layout: Layout| {
        let mut out = run_local(4, |world| {
            let device = Device::flex().autodiff();
            let mut built = build(&world, &layout, &recipe(), &device, &settings)?;
            if layout.diloco.is_none() {
                // The reference: DDP over the world with SGD.
                with_engine(&mut built, |model| {
                    let ddp = DistributedDataParallel::new(world.clone());
                    let step = TrainStep::new(model.tp.clone()).with_ddp(ddp);
                    Box::new(Trainer::new(step, SgdConfig::new().init()))
                });
            }
            let mut batch = |micro: &MicroBatch| Ok(corpus_batch(&corpus, micro));
            let fitted = fit(built, &config, &mut batch, &mut |_, _| Ok(()), None)?;
            let losses = fitted.losses;
            let model = fitted.built.trained(&recipe())?;
            Ok(Outcome {
                losses,
                params: model.whole_params()?,
                stopped_at: None,
                resumed_from: None,
            })
        })
        .unwrap_or_else(|e| panic!("{e}"));
        out.swap_remove(0)
    };
    let ddp = run(Layout::default());
    let islands = run(diloco(1, 0.0, true));
    assert_close("DiLoCo at H = 1 against DDP", &islands, &ddp, 1e-5);
}

/// DiLoCo stopped between two syncs (after step 3 of 6, H = 2, Nesterov outer momentum, AdamW
/// inside) resumes from its checkpoint and ends where the uninterrupted run ends: the islands'
/// models, their optimizers and the outer momentum all come back.
#[test]
fn diloco_from_the_builder_resumes_between_syncs() {
    let dir = std::env::temp_dir().join(format!("fit-diloco-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let layout = diloco(2, 0.9, false);
    let whole = train(4, layout, &fit_config(None, None), None);
    let stopped = train(4, layout, &fit_config(Some(&dir), None), Some(3));
    assert_eq!(stopped.stopped_at, Some(3));
    let resumed = train(4, layout, &fit_config(None, Some(&dir)), None);
    let saved_as = "dp 4, DiLoCo 2 islands, H = 2".to_string();
    assert_eq!(resumed.resumed_from, Some((3, 4, Some(saved_as))));
    assert_close("DiLoCo resumed between syncs", &resumed, &whole, 1e-6);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The pipeline through the same `build` and `fit` as every other layout: pp 2 x dp 2 (1F1B
/// over the step's 2 micro-steps, the model's `StagedModel` form) trains as dp 2 does; stopped
/// after step 2 it saves under the whole model's names, and dp 2 x tp 2 + sp resumes it to the
/// uninterrupted run's end.
#[test]
fn a_pipeline_from_the_builder_trains_and_resumes_like_any_layout() {
    let dir = std::env::temp_dir().join(format!("fit-pp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pp = Layout {
        pp: 2,
        ..Layout::default()
    };
    let dp = train(2, Layout::default(), &fit_config(None, None), None);
    let piped = train(4, pp, &fit_config(None, None), None);
    assert_close("pp 2 x dp 2 against dp 2", &piped, &dp, 1e-5);
    let stopped = train(4, pp, &fit_config(Some(&dir), None), Some(2));
    assert_eq!(stopped.stopped_at, Some(2));
    let tp = Layout {
        tp: 2,
        sp: true,
        ..Layout::default()
    };
    let resumed = train(4, tp, &fit_config(None, Some(&dir)), None);
    let saved_as = "dp 2 x pp 2 (1f1b)".to_string();
    assert_eq!(resumed.resumed_from, Some((2, 4, Some(saved_as))));
    assert_close("pp 2 x dp 2 resumed by dp 2 x tp 2", &resumed, &dp, 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}
