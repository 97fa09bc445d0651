//! The `vit` trainer ([`examples::train_vit`]) against plain single-device Burn training of the
//! same ViT: DDP, ZeRO-1/2, tensor (+ sequence) and pipeline parallelism reproduce the losses (relative
//! difference <= 1e-5, 20 steps) and the final parameters, with and without global-norm
//! clipping; the test accuracy it reports is the accuracy of the model it returns, above chance
//! after a short run; impossible layouts are typed errors naming their flag.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel_train::{Layout, PipelineLayout, Recompute};
use burn_zero::Stage;
use examples::data::Digits;
use examples::train_vit::{VitReport, VitTrainConfig, VitTrainError, run_vit_local};
use examples::vit::{Vit, VitConfig};
use tests::assert_same_losses;

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

/// A ViT small enough for a few seconds per run: 4x4 patches, so 5 tokens (uneven sequence
/// shards over 2 ranks), 2 heads (tp 2 splits them), width 16, MLP 32.
fn tiny() -> VitTrainConfig {
    VitTrainConfig {
        model: VitConfig {
            patch_size: 4,
            n_layers: 2,
            n_heads: 2,
            d_model: 16,
            d_ff: 32,
            seed: 11,
            ..VitConfig::digits()
        },
        steps: STEPS,
        batch_size: 8,
        lr: 1e-2,
        warmup_steps: 5,
        weight_decay: 0.01,
        max_grad_norm: None,
        data_seed: 4,
        eval_every: 0,
        eval_batch: 64,
        ..VitTrainConfig::default()
    }
}

fn digits() -> Digits {
    Digits::load_default().expect("the bundled digits")
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

/// The global L2 norm of `grads`, then every gradient scaled by `max / (norm + 1e-6)` when
/// that is below 1 (torch's `clip_grad_norm_`).
fn clip(model: &Vit, grads: GradientsParams, max: f64) -> GradientsParams {
    struct Norm<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                self.1 += g
                    .into_data()
                    .iter::<f32>()
                    .map(|v| f64::from(v).powi(2))
                    .sum::<f64>();
            }
        }
    }
    struct Scale(GradientsParams, f32);
    impl ModuleVisitor for Scale {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(p.id) {
                self.0.register::<D>(p.id, g * self.1);
            }
        }
    }
    let mut norm = Norm(&grads, 0.0);
    model.visit(&mut norm);
    let scale = max / (norm.1.sqrt() + 1e-6);
    if scale >= 1.0 {
        return grads;
    }
    let mut scaled = Scale(grads, scale as f32);
    model.visit(&mut scaled);
    scaled.0
}

/// The oracle: plain Burn on one device, the whole global batch of each step, Burn's AdamW.
/// Returns the losses and the final parameters.
fn plain_burn(config: &VitTrainConfig) -> (Vec<f64>, Vit) {
    let device = Device::flex().autodiff();
    let (train, _) = digits().split(config.test_fraction, config.split_seed);
    let mut model = Vit::new(&config.model, &device);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(config.weight_decay as f32)
        .init();
    let mut losses = Vec::new();
    for step in 0..config.steps {
        let batch = train.batch(step as u64, config.batch_size, config.data_seed);
        let (x, y) = batch.to_tensors(&device);
        let loss = model.loss(x, y).expect("a single-device ViT");
        losses.push(f64::from(
            loss.clone().into_data().try_to_vec::<f32>().expect("f32")[0],
        ));
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if let Some(max) = config.max_grad_norm {
            grads = clip(&model, grads, max);
        }
        model = optim.step(config.lr_at(step), model, grads);
    }
    (losses, model.valid())
}

/// Runs the trainer; returns its report and the gradient norms it reported.
fn trainer(ranks: usize, config: &VitTrainConfig, layout: Layout) -> (VitReport, Vec<f64>) {
    let mut norms = Vec::new();
    let report = run_vit_local(ranks, config, &layout, &digits(), &mut |s| {
        norms.extend(s.log.grad_norm)
    })
    .unwrap_or_else(|e| panic!("{layout:?} on {ranks} ranks: {e}"));
    (report, norms)
}

/// Asserts the trainer's losses and final parameters equal the oracle's.
fn assert_matches(reference: &(Vec<f64>, Vit), report: &VitReport, what: &str) {
    assert_same_losses(&reference.0, &report.losses, TOL, what);
    let (want, got) = (params(&reference.1), params(&report.model));
    assert_eq!(want.len(), got.len(), "{what}: number of parameters");
    for ((name, a), (other, b)) in want.iter().zip(&got) {
        assert_eq!(name, other, "{what}: parameter order");
        assert_eq!(a.shape(), b.shape(), "{what}: shape of {name}");
        let (a, b) = (
            a.try_to_vec::<f32>().unwrap(),
            b.try_to_vec::<f32>().unwrap(),
        );
        // Relative to the tensor's largest value, at least the init scale 0.02 (biases start at
        // 0 and some stay near it).
        let scale = a.iter().fold(0.02f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            f64::from(diff / scale) <= TOL,
            "{what}: final {name} differs by {diff:e} (largest value {scale:e})"
        );
    }
}

/// Asserts that training moved the weights far beyond the tolerance (so that matching final
/// parameters means something).
fn assert_trained(config: &VitTrainConfig, trained: &Vit) {
    let init = params(&Vit::new(&config.model, &Device::flex()));
    let moved = init
        .iter()
        .zip(params(trained))
        .map(|((_, a), (_, b))| {
            let (a, b) = (
                a.try_to_vec::<f32>().unwrap(),
                b.try_to_vec::<f32>().unwrap(),
            );
            a.iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        })
        .fold(0f32, f32::max);
    assert!(moved > 1e-2, "the weights barely moved ({moved:e})");
}

#[test]
fn ddp_and_zero_match_plain_burn_training() {
    let config = tiny();
    let reference = plain_burn(&config);
    assert_trained(&config, &reference.1);
    let ddp = |ranks| trainer(ranks, &config, Layout::default()).0;
    assert_matches(&reference, &ddp(1), "1 rank");
    assert_matches(&reference, &ddp(2), "DDP 2 ranks");
    for stage in [Stage::One, Stage::Two] {
        let layout = Layout {
            zero: Some(stage),
            ..Layout::default()
        };
        let what = format!("ZeRO-{} 2 ranks", stage.number());
        assert_matches(&reference, &trainer(2, &config, layout).0, &what);
    }
    // FSDP (every encoder block a unit), and ZeRO / FSDP over 2 data ranks x tp 2 + sp.
    let fsdp = Layout {
        zero: Some(Stage::Three),
        ..Layout::default()
    };
    assert_matches(&reference, &trainer(2, &config, fsdp).0, "FSDP 2 ranks");
    for stage in [Stage::Two, Stage::Three] {
        let layout = Layout {
            tp: 2,
            sp: true,
            zero: Some(stage),
            ..Layout::default()
        };
        let what = format!("ZeRO-{} 2 x tp 2 + sp", stage.number());
        assert_matches(&reference, &trainer(4, &config, layout).0, &what);
    }

    // Clipping to a norm the gradients exceed: the clipped steps must still match.
    let clipped = VitTrainConfig {
        max_grad_norm: Some(0.5),
        ..config
    };
    let reference = plain_burn(&clipped);
    let (report, norms) = trainer(2, &clipped, Layout::default());
    assert!(
        norms.iter().filter(|&&n| n > 0.5).count() >= STEPS / 2,
        "the test must clip: norms {norms:?}"
    );
    assert_matches(&reference, &report, "DDP 2 ranks, clip 0.5");
}

/// The ViT staged by the library's generic stage (`burn_pipeline::sequential::Sequential`):
/// 1F1B at pp 2, ZBV at pp 2 x dp 2 with every block recomputed, and GPipe with global-norm
/// clipping over the stages, each equal to plain single-device training.
#[test]
fn pipeline_parallel_matches_plain_burn_training() {
    let mut config = tiny();
    config.model.n_layers = 4;
    // The pipeline's micro-batches are the run's (`grad_accum`); rank 0's report.
    let pipelined =
        |world: usize, layout: Layout, micro_batches: usize, config: &VitTrainConfig| {
            let config = VitTrainConfig {
                grad_accum: micro_batches,
                ..config.clone()
            };
            trainer(world, &config, layout).0
        };
    let reference = plain_burn(&config);
    let schedule = |name: &str| PipelineLayout {
        schedule: name.parse().unwrap(),
        ..PipelineLayout::default()
    };
    let one_f_one_b = Layout {
        pp: 2,
        pipeline: schedule("1f1b"),
        ..Layout::default()
    };
    let r = pipelined(2, one_f_one_b, 4, &config);
    assert_matches(&reference, &r, "vit pp 2 1f1b");
    let zbv = Layout {
        pipeline: schedule("zbv").with_recompute(Recompute::Blocks),
        ..one_f_one_b
    };
    let r = pipelined(4, zbv, 2, &config);
    assert_matches(&reference, &r, "vit pp 2 x dp 2 zbv, blocks recomputed");
    config.max_grad_norm = Some(0.1);
    let clipped = plain_burn(&config);
    let gpipe = Layout {
        pipeline: schedule("gpipe"),
        ..one_f_one_b
    };
    let r = pipelined(2, gpipe, 4, &config);
    assert_matches(&clipped, &r, "vit pp 2 gpipe, clipped");
}

#[test]
fn tensor_and_sequence_parallel_match_plain_burn_training() {
    let config = tiny();
    let reference = plain_burn(&config);
    for (ranks, tp, sp) in [(2, 2, false), (2, 2, true), (4, 2, true)] {
        let layout = Layout {
            tp,
            sp,
            ..Layout::default()
        };
        let what = format!("{ranks} ranks, tp {tp}, sp {sp}");
        assert_matches(&reference, &trainer(ranks, &config, layout).0, &what);
    }

    // Clipping under tp: the norm counts each shard once, replicated parameters once.
    let clipped = VitTrainConfig {
        max_grad_norm: Some(0.5),
        ..config
    };
    let reference = plain_burn(&clipped);
    for ranks in [2, 4] {
        let layout = Layout {
            tp: 2,
            sp: true,
            ..Layout::default()
        };
        let (report, norms) = trainer(ranks, &clipped, layout);
        assert!(
            norms.iter().filter(|&&n| n > 0.5).count() >= STEPS / 2,
            "the test must clip: norms {norms:?}"
        );
        let what = format!("{ranks} ranks, tp 2 + sp, clip 0.5");
        assert_matches(&reference, &report, &what);
    }
}

/// The accuracy of `model` on the held-out split, computed here image by image batch.
fn accuracy(model: &Vit, config: &VitTrainConfig) -> (usize, usize) {
    let (_, test) = digits().split(config.test_fraction, config.split_seed);
    let all: Vec<usize> = (0..test.len()).collect();
    let batch = test.select(&all);
    let (x, _) = batch.to_tensors(&Device::flex());
    let predicted = model
        .predict(x)
        .unwrap()
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap();
    let correct = predicted
        .iter()
        .zip(&batch.labels)
        .filter(|(p, l)| p == l)
        .count();
    (correct, test.len())
}

#[test]
fn a_short_run_is_above_chance_and_reports_its_models_accuracy() {
    let config = VitTrainConfig {
        steps: 60,
        batch_size: 32,
        eval_every: 30,
        eval_batch: 50, // 359 test images: uneven shares and chunks
        ..tiny()
    };
    for (ranks, tp) in [(2, 1), (2, 2), (3, 1)] {
        let config = VitTrainConfig {
            batch_size: 30 * ranks / tp, // divisible by dp
            ..config.clone()
        };
        let layout = Layout {
            tp,
            sp: tp > 1,
            ..Layout::default()
        };
        let (report, _) = trainer(ranks, &config, layout);
        let what = format!("{ranks} ranks, tp {tp}");
        assert_eq!(report.test_images, 359, "{what}");
        assert_eq!(
            (report.test_correct, report.test_images),
            accuracy(&report.model, &config),
            "{what}: the reported accuracy is that of the returned model"
        );
        assert!(
            report.test_accuracy > 0.3,
            "{what}: accuracy {} after {} steps is not above chance (0.1)",
            report.test_accuracy,
            config.steps
        );
        let steps: Vec<usize> = report.evals.iter().map(|e| e.0).collect();
        assert_eq!(
            steps,
            [29, 59],
            "{what}: evaluations every 30 steps and at the end"
        );
    }
}

/// The layout's refusals are the library's ([`Layout::validate`]), each naming its flag; they
/// come back as typed errors before any rank starts.
#[test]
fn impossible_layouts_are_typed_errors() {
    let digits = digits();
    let err = |ranks, config: &VitTrainConfig, layout| match run_vit_local(
        ranks,
        config,
        &layout,
        &digits,
        &mut |_| {},
    ) {
        Err(VitTrainError::Invalid { what, reason }) => (what, reason),
        other => panic!("expected a config error, got {:?}", other.map(|r| r.losses)),
    };
    let sp_alone = Layout {
        tp: 1,
        sp: true,
        ..Layout::default()
    };
    let (flag, reason) = err(2, &tiny(), sp_alone);
    assert_eq!(flag, "--sp", "{reason}");
    assert!(reason.contains("--sp"), "{reason}");
    let tp3 = Layout {
        tp: 3,
        ..Layout::default()
    };
    // 2 heads over tp 3: attention is split by whole heads.
    let (flag, reason) = err(3, &tiny(), tp3);
    assert_eq!(flag, "--tp", "{reason}");
    assert!(
        reason.contains("2 attention heads are not divisible"),
        "{reason}"
    );
    let (flag, reason) = err(2, &tiny(), Layout { tp: 4, ..tp3 });
    assert_eq!(flag, "--tp", "{reason}");
    assert!(reason.contains("--tp that divides"), "{reason}");
    let odd = VitTrainConfig {
        batch_size: 7,
        ..tiny()
    };
    let (flag, reason) = err(2, &odd, Layout::default());
    assert_eq!(flag, "--batch-size", "{reason}");
    assert!(reason.contains("multiple of 2"), "{reason}");
}

/// Mixed precision trains the ViT too (before: `--precision bf16` panicked, "patch_embed:
/// linear: x is F32 but weight is BF16", the pixels were never cast): under DDP and a pipeline,
/// bf16 tracks fp32 training of the same model (each step's loss within 5%: bf16 keeps 8 bits
/// of mantissa; measured 0.4%), fp16's loss-scaled run trains (its first steps may be
/// skipped while the scale backs off, so it is not compared step by step), and the model
/// returned holds fp32 master weights.
#[test]
fn mixed_precision_tracks_fp32_training() {
    use burn_parallel_train::Precision;
    let pipeline = Layout {
        pp: 2,
        ..Layout::default()
    };
    for layout in [Layout::default(), pipeline] {
        let fp32 = VitTrainConfig {
            grad_accum: layout.pp,
            ..tiny()
        };
        let bf16 = VitTrainConfig {
            precision: Precision::Bf16,
            ..fp32.clone()
        };
        let want = trainer(2, &fp32, layout).0.losses;
        let (report, _) = trainer(2, &bf16, layout);
        let worst = report
            .losses
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / w.abs());
        let worst = worst.fold(0.0, f64::max);
        assert!(
            worst < 0.05,
            "bf16 under {layout:?}: {:?} against {want:?}",
            report.losses
        );
        let dtypes = params(&report.model).into_iter().map(|(_, t)| t.dtype());
        assert!(dtypes.into_iter().all(|d| d == burn::tensor::DType::F32));
    }
    let fp16 = VitTrainConfig {
        precision: Precision::Fp16,
        ..tiny()
    };
    let losses = trainer(2, &fp16, Layout::default()).0.losses;
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last.is_finite() && last < first, "fp16: {losses:?}");
}
