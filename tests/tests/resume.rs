//! Distributed checkpoints of the GPT trainer: a run saves at step 6 of 16 under one layout;
//! runs resumed from that checkpoint under the same and other layouts continue its loss curve
//! (bit for bit under the same layout, within 1e-5 under another) and end with its parameters.
//! Also: the `gpt` binary's `--save-every/--resume`, a SIGKILL during a save, and resuming
//! from the checkpoint of another model.

use std::path::{Path, PathBuf};

use burn_moe::{MoeConfig, ScoreFn};
use burn_parallel::run_local;
use burn_parallel_train::{CheckpointPolicy, Optim, PipelineLayout};
use burn_pipeline::ScheduleKind;
use burn_zero::Stage;
use examples::data::Corpus;
use examples::pipeline::train_gpt_pipeline;
use examples::train::{Parallelism, TrainConfig, TrainReport, train_gpt};
use tests::{Reference, assert_matches_reference, rank0_if_ranks_agree, tiny_gpt_run};

const STEPS: usize = 16;
const SAVED_AT: usize = 6;
const TOL: f64 = 1e-5;

fn config() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.n_heads = 4;
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bp-resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn layout(tp: usize, zero: Option<Stage>) -> Parallelism {
    Parallelism {
        tp,
        zero,
        ..Parallelism::default()
    }
}

/// Where a run saves and what it resumes: the trainer config's `save` and `resume`.
#[derive(Clone, Default)]
struct Checkpoints {
    save: Option<CheckpointPolicy>,
    resume: Option<PathBuf>,
}

impl Checkpoints {
    /// `config` saving and resuming so.
    fn on(&self, config: &TrainConfig) -> TrainConfig {
        TrainConfig {
            save: self.save.clone(),
            resume: self.resume.clone(),
            ..config.clone()
        }
    }
}

/// Saves every `every` steps under `dir` (the newest 5 kept).
fn saving(dir: &Path, every: usize) -> Checkpoints {
    let policy = CheckpointPolicy {
        every,
        at_end: false,
        keep: 5,
        ..CheckpointPolicy::new(dir)
    };
    Checkpoints {
        save: Some(policy),
        resume: None,
    }
}

/// Resumes from the checkpoint of step `saved` under `dir`.
fn resuming(dir: &Path, saved: usize) -> Checkpoints {
    Checkpoints {
        save: None,
        resume: Some(dir.join(format!("step-{saved:08}"))),
    }
}

/// Trains on `world` thread ranks with checkpoint `options`; rank 0's report (all ranks agree).
fn run(
    world: usize,
    parallel: &Parallelism,
    config: &TrainConfig,
    options: &Checkpoints,
) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let config = options.on(config);
    let reports = burn_parallel_train::run_local(world, |g| {
        train_gpt(&g, &config, parallel, &corpus, &mut |_| {})
    })
    .unwrap_or_else(|e| panic!("{parallel:?} on {world} ranks: {e}"));
    rank0_if_ranks_agree(reports, |r| (&r.losses, &r.final_params))
}

/// The uninterrupted run under `parallel`, saving every `SAVED_AT` steps under `dir`.
fn saving_run(world: usize, parallel: &Parallelism, dir: &Path) -> Reference {
    saving_run_of(world, parallel, &config(), (dir, SAVED_AT))
}

/// [`saving_run`] of `config`, saving every `every` steps.
fn saving_run_of(
    world: usize,
    parallel: &Parallelism,
    config: &TrainConfig,
    (dir, every): (&Path, usize),
) -> Reference {
    Reference::of_run(run(world, parallel, config, &saving(dir, every)))
}

/// A run resumed from the checkpoint of step `saved` under `dir`, under `parallel`, continues
/// `reference`: bit for bit (`tol` 0) or within `tol`.
fn check_resume(
    reference: &Reference,
    (dir, saved): (&Path, usize),
    (world, parallel): (usize, Parallelism),
    config: &TrainConfig,
    tol: f64,
    what: &str,
) {
    let r = run(world, &parallel, config, &resuming(dir, saved));
    continues(reference, &r, saved, tol, what);
}

/// `r`, resumed from the checkpoint of step `saved`, continues `reference`: the saved losses,
/// then the rest bit for bit (`tol` 0) or within `tol`, and the final parameters.
fn continues(reference: &Reference, r: &TrainReport, saved: usize, tol: f64, what: &str) {
    assert_eq!(
        r.losses[..saved],
        reference.losses[..saved],
        "{what}: saved losses"
    );
    if tol == 0.0 {
        assert_eq!(r.losses, reference.losses, "{what}: identical losses");
    }
    assert_matches_reference(reference, &r.losses, &r.final_params, tol, what);
}

/// Saves every `SAVED_AT` steps under `dir`.
fn saving_to(dir: &Path) -> Checkpoints {
    saving(dir, SAVED_AT)
}

fn resume_from(dir: &Path) -> Checkpoints {
    resuming(dir, SAVED_AT)
}

#[test]
fn dp2_tp2_resumes_under_tp4_zero3_and_one_device() {
    let dir = scratch("dp2tp2");
    let reference = saving_run(4, &layout(2, None), &dir);
    // The same layout: bit for bit.
    let same = run(4, &layout(2, None), &config(), &resume_from(&dir));
    assert_eq!(
        same.losses, reference.losses,
        "same layout: identical losses"
    );
    assert_matches_reference(
        &reference,
        &same.losses,
        &same.final_params,
        0.0,
        "same layout",
    );
    // Other layouts: the continued curve within 1e-5, the same final parameters.
    for (world, parallel, what) in [
        (4, layout(4, None), "tp 4"),
        (4, layout(1, Some(Stage::Three)), "dp 4 ZeRO-3"),
        (1, layout(1, None), "one device"),
    ] {
        let r = run(world, &parallel, &config(), &resume_from(&dir));
        assert_eq!(
            r.losses[..SAVED_AT],
            reference.losses[..SAVED_AT],
            "{what}: saved losses"
        );
        assert_matches_reference(&reference, &r.losses, &r.final_params, TOL, what);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Muon's momentum (whole by matrix, on each matrix's owner) saved at dp 2 x tp 2 resumes on
/// one device, under ZeRO-1 and under FSDP 2: a resumed run that lost it (a fresh momentum)
/// would leave the curve at the first step after the save.
#[test]
fn muon_dp2_tp2_resumes_on_one_device_zero1_and_fsdp() {
    let dir = scratch("muon");
    let muon = |p: Parallelism| Parallelism {
        optim: Optim::Muon,
        ..p
    };
    let reference = saving_run(4, &muon(layout(2, None)), &dir);
    let same = run(4, &muon(layout(2, None)), &config(), &resume_from(&dir));
    continues(&reference, &same, SAVED_AT, 0.0, "Muon, same layout");
    for (world, parallel, what) in [
        (1, muon(layout(1, None)), "Muon, one device"),
        (2, muon(layout(1, Some(Stage::One))), "Muon, ZeRO-1 dp 2"),
        (2, muon(layout(1, Some(Stage::Three))), "Muon, FSDP 2"),
    ] {
        check_resume(
            &reference,
            (&dir, SAVED_AT),
            (world, parallel),
            &config(),
            TOL,
            what,
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn zero1_tp2_resumes_under_zero3_and_ddp() {
    let dir = scratch("zero1");
    let reference = saving_run(4, &layout(2, Some(Stage::One)), &dir);
    let same = run(
        4,
        &layout(2, Some(Stage::One)),
        &config(),
        &resume_from(&dir),
    );
    assert_eq!(
        same.losses, reference.losses,
        "same layout: identical losses"
    );
    for (world, parallel, what) in [
        (4, layout(2, Some(Stage::Three)), "dp 2 x tp 2 ZeRO-3"),
        (2, layout(1, Some(Stage::Two)), "dp 2 ZeRO-2"),
        (2, layout(1, None), "dp 2 DDP"),
    ] {
        let r = run(world, &parallel, &config(), &resume_from(&dir));
        assert_matches_reference(&reference, &r.losses, &r.final_params, TOL, what);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Dropout: each layer's call counter (with the seed, the layer and the data-parallel rank it
/// decides the masks) is saved and restored, so the resumed run draws the masks the saving
/// run drew; at another tensor-parallel / ZeRO layout with the same data-parallel size the
/// masks are the same too.
#[test]
fn dropout_resumes_with_the_masks_of_the_saving_run() {
    let dir = scratch("dropout");
    let mut c = config();
    c.model.dropout = 0.1;
    c.grad_accum = 2;
    let reference = saving_run_of(4, &layout(2, None), &c, (&dir, SAVED_AT));
    let saved = (dir.as_path(), SAVED_AT);
    check_resume(
        &reference,
        saved,
        (4, layout(2, None)),
        &c,
        0.0,
        "same layout",
    );
    let sp = Parallelism {
        sp: true,
        zero: Some(Stage::One),
        ..layout(2, None)
    };
    check_resume(
        &reference,
        saved,
        (4, sp),
        &c,
        TOL,
        "dp 2 x tp 2 + sp ZeRO-1",
    );
    let zero3 = layout(1, Some(Stage::Three));
    check_resume(&reference, saved, (2, zero3), &c, TOL, "dp 2 ZeRO-3");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPT-MoE (4 experts, top-2, balancing losses and auxiliary-loss-free bias balancing).
fn moe_config() -> TrainConfig {
    let mut c = config();
    c.model.moe = Some(MoeConfig {
        aux_loss: 0.01,
        z_loss: 0.001,
        bias: true,
        score: ScoreFn::Sigmoid,
        bias_update_rate: 0.05,
        ..MoeConfig::new(c.model.d_model, 48, 4, 2)
    });
    c
}

fn with_ep(ep: usize, parallel: Parallelism) -> Parallelism {
    Parallelism { ep, ..parallel }
}

/// Expert parallelism: each rank saves its experts under their global index (rank r's local
/// expert i is expert 2r + i at ep 2), with their AdamW state and the expert biases, so that
/// a checkpoint saved at ep 2 loads at ep 2, on one device, under ZeRO-1 without expert
/// parallelism and under FSDP x tp 2 at ep 2; and one saved under ZeRO-1 x ep 2 (the experts'
/// own AdamW beside ZeRO's flat state) loads under DDP at ep 1.
#[test]
fn moe_checkpoints_name_experts_by_their_global_index() {
    let c = moe_config();
    // Saved after step 5: the biases, which move by ±0.05 each step, are not back at 0.
    let dir = scratch("moe");
    let reference = saving_run_of(2, &with_ep(2, layout(1, None)), &c, (&dir, 5));
    let saved = (dir.as_path(), 5);
    check_resume(
        &reference,
        saved,
        (2, with_ep(2, layout(1, None))),
        &c,
        0.0,
        "ep 2",
    );
    for (world, parallel, what) in [
        (1, layout(1, None), "one device"),
        (2, layout(1, Some(Stage::One)), "dp 2 ZeRO-1, ep 1"),
        (
            4,
            with_ep(2, layout(2, Some(Stage::Three))),
            "FSDP 2 x tp 2, ep 2",
        ),
    ] {
        check_resume(&reference, saved, (world, parallel), &c, TOL, what);
    }
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("moe-zero1");
    let zero1 = with_ep(2, layout(1, Some(Stage::One)));
    let reference = saving_run_of(2, &zero1, &c, (&dir, 5));
    let saved = (dir.as_path(), 5);
    check_resume(&reference, saved, (2, zero1), &c, 0.0, "ZeRO-1 x ep 2");
    check_resume(
        &reference,
        saved,
        (2, layout(1, None)),
        &c,
        TOL,
        "dp 2 DDP, ep 1",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Trains the pipelined GPT (4 micro-batches) on `world` thread ranks with checkpoint
/// `options`; rank 0's report (all ranks agree).
fn run_pipeline(
    world: usize,
    pipeline: &Parallelism,
    config: &TrainConfig,
    options: &Checkpoints,
) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let config = TrainConfig {
        grad_accum: 4,
        ..options.on(config)
    };
    let reports = burn_parallel_train::run_local(world, |g| {
        let split = Default::default();
        train_gpt_pipeline(&g, &config, pipeline, &split, &corpus, &mut |_| {})
    })
    .unwrap_or_else(|e| panic!("{pipeline:?} on {world} ranks: {e}"));
    rank0_if_ranks_agree(reports, |r| (&r.train.losses, &r.train.final_params)).train
}

fn pp2(schedule: ScheduleKind) -> Parallelism {
    Parallelism {
        pp: 2,
        pipeline: PipelineLayout {
            schedule,
            ..PipelineLayout::default()
        },
        ..Parallelism::default()
    }
}

/// Pipeline parallelism: each stage saves its blocks under the whole model's indices, with
/// their AdamW state, and the token table tied to the head once. Saved at pp 2 under ZBV
/// (rank 0 holds the first and the last stage, both copies of the tied table): resumes
/// bit-identically under ZBV, and within 1e-5 at pp 2 x dp 2 under 1F1B, on one device and
/// at dp 2 without a pipeline. Saved at pp 2 x tp 2 + sp under 1F1B (the two copies of the
/// table on two ranks, tensor-parallel shards): resumes on one device. And a checkpoint of
/// dp 2 resumes at pp 2.
#[test]
fn pipeline_checkpoints_carry_the_whole_models_names() {
    let mut c = config();
    c.model.n_layers = 4;
    c.model.tied_embeddings = true;
    let save = saving_to;
    let resume = resume_from;
    let same = |what: &str, reference: &Reference, r: &TrainReport, tol: f64| {
        continues(reference, r, SAVED_AT, tol, what)
    };

    let dir = scratch("pp-zbv");
    let zbv = pp2(ScheduleKind::Zbv);
    let reference = Reference::of_run(run_pipeline(2, &zbv, &c, &save(&dir)));
    let r = run_pipeline(2, &zbv, &c, &resume(&dir));
    same("ZBV pp 2", &reference, &r, 0.0);
    let r = run_pipeline(4, &pp2(ScheduleKind::OneFOneB), &c, &resume(&dir));
    same("1F1B pp 2 x dp 2", &reference, &r, TOL);
    for (world, what) in [(1, "one device"), (2, "dp 2")] {
        let r = run(world, &layout(1, None), &c, &resume(&dir));
        same(what, &reference, &r, TOL);
    }
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("pp-1f1b");
    let tp_sp = Parallelism {
        tp: 2,
        sp: true,
        ..pp2(ScheduleKind::OneFOneB)
    };
    let reference = Reference::of_run(run_pipeline(4, &tp_sp, &c, &save(&dir)));
    let r = run(1, &layout(1, None), &c, &resume(&dir));
    same("1F1B pp 2 x tp 2 + sp on one device", &reference, &r, TOL);
    std::fs::remove_dir_all(&dir).unwrap();
    let one_f = pp2(ScheduleKind::OneFOneB);

    let dir = scratch("dp-to-pp");
    let reference = saving_run_of(2, &layout(1, None), &c, (&dir, SAVED_AT));
    let r = run_pipeline(2, &one_f, &c, &resume(&dir));
    same("dp 2 resumed at 1F1B pp 2", &reference, &r, TOL);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pipeline in fp16 with dynamic loss scaling (from 2^16, growing after every 3 clean steps,
/// so the scale at the save is not the initial one): its checkpoint carries the loss scaler's
/// state (scale, clean-step count, skipped steps) with the fp32 weights and AdamW state. Saved
/// at pp 2 under 1F1B: resumes bit for bit there (the same later skips and scale), and on one
/// device with the pipeline's 4 micro-batches as gradient accumulation (the same operations:
/// within 1e-5).
#[test]
fn fp16_pipeline_resumes_its_loss_scale() {
    let c = TrainConfig {
        precision: examples::train::Precision::Fp16,
        loss_scale: Some(examples::train::LossScale {
            window: 3,
            ..Default::default()
        }),
        ..config()
    };
    let dir = scratch("pp-fp16");
    let one_f = pp2(ScheduleKind::OneFOneB);
    let whole = run_pipeline(2, &one_f, &c, &saving_to(&dir));
    assert!(
        whole.skipped_steps > 0,
        "fp16 from 2^16 skips its first steps"
    );
    let reference = Reference::of_run(whole.clone());
    let r = run_pipeline(2, &one_f, &c, &resume_from(&dir));
    continues(&reference, &r, SAVED_AT, 0.0, "fp16 1F1B pp 2");
    assert_eq!(
        (r.skipped_steps, r.loss_scale),
        (whole.skipped_steps, whole.loss_scale),
        "skipped steps and the final loss scale"
    );
    println!(
        "fp16 1F1B pp 2: {} skipped, final scale {}",
        whole.skipped_steps, whole.loss_scale
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Pipeline stages stepped by ZeRO: each stage's shard ranks write their ranges of the
/// stage's AdamW state under the whole model's names (the tied table's once, by the first
/// stage). Saved at pp 2 x dp 2 with ZeRO-2 (tied table on two ranks): resumes
/// bit-identically under the same layout, and within 1e-5 at pp 2 with plain AdamW, at
/// pp 2 x dp 2 with ZeRO-1 under ZBV, and at dp 2 with ZeRO-1 without a pipeline. A ZeRO-1
/// checkpoint saved without a pipeline resumes at pp 2 x dp 2 with ZeRO-2.
#[test]
fn pipeline_zero_checkpoints_resume_under_any_layout() {
    let mut c = config();
    c.model.n_layers = 4;
    c.model.tied_embeddings = true;
    let same = |what: &str, reference: &Reference, r: &TrainReport, tol: f64| {
        continues(reference, r, SAVED_AT, tol, what)
    };
    let with_zero = |pipeline: Parallelism, zero: Stage| Parallelism {
        zero: Some(zero),
        ..pipeline
    };

    let dir = scratch("pp-zero");
    let zero2 = with_zero(pp2(ScheduleKind::OneFOneB), Stage::Two);
    let reference = Reference::of_run(run_pipeline(4, &zero2, &c, &saving_to(&dir)));
    let r = run_pipeline(4, &zero2, &c, &resume_from(&dir));
    same("pp 2 x dp 2 ZeRO-2", &reference, &r, 0.0);
    let r = run_pipeline(2, &pp2(ScheduleKind::OneFOneB), &c, &resume_from(&dir));
    same("pp 2 AdamW", &reference, &r, TOL);
    let zbv = with_zero(pp2(ScheduleKind::Zbv), Stage::One);
    let r = run_pipeline(4, &zbv, &c, &resume_from(&dir));
    same("ZBV pp 2 x dp 2 ZeRO-1", &reference, &r, TOL);
    let r = run(2, &layout(1, Some(Stage::One)), &c, &resume_from(&dir));
    same("dp 2 ZeRO-1", &reference, &r, TOL);
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("zero-to-pp");
    let reference = saving_run_of(2, &layout(1, Some(Stage::One)), &c, (&dir, SAVED_AT));
    let r = run_pipeline(4, &zero2, &c, &resume_from(&dir));
    same(
        "dp 2 ZeRO-1 resumed at pp 2 x dp 2 ZeRO-2",
        &reference,
        &r,
        TOL,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_of_another_model_is_refused_with_its_differences() {
    let dir = scratch("other");
    saving_run(2, &layout(1, None), &dir);
    let mut other = config();
    other.model.d_model = 48;
    let corpus = Corpus::load_default().unwrap();
    let errors = run_local(2, |g| {
        let other = resume_from(&dir).on(&other);
        let r = train_gpt(&g, &other, &layout(1, None), &corpus, &mut |_| {});
        Ok(r.map(|_| ()).expect_err("refused").to_string())
    })
    .unwrap();
    assert!(errors[0].contains("model"), "{}", errors[0]);
    // No checkpoint at all: the path is named.
    let missing = dir.join("nothing-here");
    let err = burn_parallel_train::open_checkpoint(&missing)
        .err()
        .unwrap();
    assert!(err.to_string().contains("nothing-here"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A 40-step run of the `gpt` binary on 2 thread ranks with `flags`, saving under
/// `<dir>/ckpt` (`save_flag <dir>/ckpt`): its scratch directory, the run's config and the
/// started process.
fn spawn_gpt(
    name: &str,
    (flags, save_flag): (&[&str], &str),
    stdout: std::process::Stdio,
) -> (PathBuf, TrainConfig, std::process::Child) {
    let dir = scratch(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = config();
    c.steps = 40;
    let config_path = dir.join("run.toml");
    std::fs::write(&config_path, toml::to_string(&c).unwrap()).unwrap();
    let child = std::process::Command::new(tests::workspace_binary("examples", "gpt"))
        .args(["--ranks", "2"])
        .args(flags)
        .arg(save_flag)
        .arg(dir.join("ckpt"))
        .arg("--config")
        .arg(&config_path)
        .stdout(stdout)
        .spawn()
        .expect("starting gpt");
    (dir, c, child)
}

/// `gpt --resume ckpt` (2 TCP processes through `burnrun`) ends with the losses and parameters
/// of the uninterrupted run of `c`; the two runs' outputs.
fn resumed_matches_uninterrupted(
    c: &TrainConfig,
    ckpt: &Path,
    what: &str,
) -> (tests::BurnrunRun, tests::BurnrunRun) {
    let reference = tests::gpt_through_burnrun(2, c, &[]);
    let resumed = tests::gpt_through_burnrun(2, c, &["--resume", ckpt.to_str().unwrap()]);
    let expected = Reference {
        losses: reference.losses.clone(),
        params: tests::params_map(&reference.params),
    };
    assert_matches_reference(&expected, &resumed.losses, &resumed.params, TOL, what);
    (reference, resumed)
}

/// The `gpt` binary with `--save` (no `--save-every`) gets a Ctrl-C (SIGINT) after step 2: every
/// rank stops after the same step, it saves there and ends cleanly, saying so; `gpt --resume`
/// then ends with the losses and parameters of an uninterrupted run.
#[test]
fn gpt_stopped_by_ctrl_c_saves_and_resumes_where_the_uninterrupted_run_ends() {
    use std::io::BufRead;
    let piped = std::process::Stdio::piped();
    let flags = (&["--log-every", "1"][..], "--save");
    let (dir, c, mut child) = spawn_gpt("sigint", flags, piped);
    let ckpt = dir.join("ckpt");
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let at_step_2 = line.trim_start().starts_with("step     2");
        out.push(line);
        if at_step_2 {
            break;
        }
    }
    let pid = child.id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status();
    assert!(sent.unwrap().success(), "kill -INT {pid}");
    out.extend(lines.map(|l| l.unwrap()));
    let status = child.wait().unwrap();
    let out = out.join("\n");
    assert!(status.success(), "gpt after Ctrl-C: {status}\n{out}");
    let newest = burn_parallel::checkpoint::Checkpointer::latest(&ckpt)
        .unwrap()
        .expect("the stop saved a checkpoint");
    let stopped = newest.step();
    assert!((3..40).contains(&stopped), "saved at step {stopped}\n{out}");
    let said = format!("stopped by a signal after step {stopped} of 40: saved");
    assert!(out.contains(&said), "{out}");
    resumed_matches_uninterrupted(&c, &ckpt, "after Ctrl-C");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `gpt` binary saving after every step is killed with SIGKILL (most likely during a
/// save); `gpt --resume` over TCP processes then continues from the newest complete
/// checkpoint, and ends with the losses and parameters of an uninterrupted run.
#[test]
fn gpt_killed_during_saves_resumes_from_the_last_complete_checkpoint() {
    let flags = ["--save-every", "1", "--keep-checkpoints", "3"];
    let flags = (&flags[..], "--checkpoint-dir");
    let (dir, c, mut child) = spawn_gpt("sigkill", flags, std::process::Stdio::null());
    let ckpt = dir.join("ckpt");
    // Once the checkpoint of step 4 is complete, kill it as soon as the save of step 5 has
    // begun (its directory exists): it is then writing files, fsyncing or about to write the
    // manifest.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    for started in ["step-00000004/manifest.json", "step-00000005"] {
        while !ckpt.join(started).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "gpt never wrote {started}"
            );
            if let Some(status) = child.try_wait().unwrap() {
                panic!("gpt ended ({status}) before it was killed");
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let mut left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let complete = path.join("manifest.json").exists();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            format!("{name}{}", if complete { "" } else { " (interrupted)" })
        })
        .collect();
    left.sort();
    eprintln!("after SIGKILL: {left:?}");
    let newest = burn_parallel::checkpoint::Checkpointer::latest(&ckpt)
        .unwrap()
        .expect("a complete checkpoint survives");
    assert!(newest.step() >= 4, "step {}", newest.step());
    let (reference, resumed) = resumed_matches_uninterrupted(&c, &ckpt, "after SIGKILL");
    // It names the checkpoint it loaded (the newest complete one, not the interrupted newer).
    let loaded = format!("resuming from {}", newest.dir().display());
    assert!(resumed.stdout.contains(&loaded), "{}", resumed.stdout);
    tests::assert_same_losses(
        &reference.losses,
        &resumed.losses,
        TOL,
        "resumed after SIGKILL",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
