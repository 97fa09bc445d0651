//! `burn-parallel-learner`: a stock `burn-train` training (`SupervisedTraining`, its metrics,
//! a `Learner` with AdamW and a learning-rate scheduler) under our layouts through
//! `TrainingStrategy::Custom(LayoutStrategy)`, against the same training by burn-train's own
//! single-device strategy: the losses the metrics see at every iteration and the final
//! parameters agree under DDP, FSDP, ZeRO-2 and TP + SP; a checkpoint saved under one layout
//! resumes under another.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use burn::tensor::Device;
use burn_parallel_learner::{LayoutStrategy, single_device};
use burn_parallel_train::Layout;
use burn_train::{Learner, SupervisedTraining, TrainingStrategy};
use burn_zero::Stage;
use tests::learner::{
    BATCH, CONFIG, EPOCHS, ITEMS, LR, Outcome, Params, adamw, loaders_of, train, under,
};
use tests::workspace_binary;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bp-learner-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn assert_close(what: &str, got: &Outcome, want: &Outcome, tol: f64) {
    assert_eq!(
        got.train.len(),
        want.train.len(),
        "{what}: train iterations"
    );
    assert_eq!(
        got.valid.len(),
        want.valid.len(),
        "{what}: valid iterations"
    );
    let worst = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    let (train, valid) = (
        worst(&got.train, &want.train),
        worst(&got.valid, &want.valid),
    );
    assert!(
        train <= tol,
        "{what}: train losses {:?} against {:?}",
        got.train,
        want.train
    );
    assert!(
        valid <= tol,
        "{what}: valid losses {:?} against {:?}",
        got.valid,
        want.valid
    );
    assert_eq!(
        got.params.keys().collect::<Vec<_>>(),
        want.params.keys().collect::<Vec<_>>()
    );
    let mut params = 0.0f64;
    for (name, a) in &got.params {
        let a: Vec<f64> = a.iter().map(|&x| f64::from(x)).collect();
        let b: Vec<f64> = want.params[name].iter().map(|&x| f64::from(x)).collect();
        let diff = worst(&a, &b);
        assert!(diff <= tol, "{what}: {name} differs by {diff}");
        params = params.max(diff);
    }
    // The figures the book quotes: `cargo test -p tests --test learner -- --nocapture`.
    println!(
        "{what}: worst train loss {train:.1e}, valid loss {valid:.1e}, parameter {params:.1e}"
    );
}

/// Losses and parameters of the single-device Learner within this bound: f32 sums in another
/// order (the gradients averaged over ranks, FSDP's flat shards, tensor-parallel partial
/// sums) over 12 AdamW steps.
const TOL: f64 = 1e-5;

#[test]
fn learner_under_every_layout_matches_burn_train_single_device() {
    let single = train(&temp_dir("single"), None, EPOCHS, None);
    assert_eq!(single.train.len(), EPOCHS * ITEMS / BATCH);
    let per_epoch = ITEMS / BATCH;
    let mean = |epoch: usize| {
        single.train[epoch * per_epoch..][..per_epoch]
            .iter()
            .sum::<f64>()
    };
    assert!(mean(1) < mean(0), "it learns: {:?}", single.train);
    let zero = |stage| Layout {
        zero: Some(stage),
        ..Layout::default()
    };
    let cases = [
        ("DDP 2", Layout::default(), 2),
        ("FSDP 2", zero(Stage::Three), 2),
        ("ZeRO-2 over 2", zero(Stage::Two), 2),
        (
            "TP 2 + SP",
            Layout {
                tp: 2,
                sp: true,
                ..Layout::default()
            },
            2,
        ),
        (
            "FSDP 2 x TP 2 + SP",
            Layout {
                tp: 2,
                sp: true,
                ..zero(Stage::Three)
            },
            4,
        ),
    ];
    for (what, layout, world) in cases {
        let got = under(
            layout,
            world,
            &temp_dir(&what.replace(' ', "_")),
            EPOCHS,
            None,
        );
        assert_close(what, &got, &single, TOL);
    }
}

#[test]
fn a_learner_checkpoint_saved_under_one_layout_resumes_under_another() {
    let single = train(&temp_dir("single-resume"), None, EPOCHS, None);
    let dir = temp_dir("resume");
    // Epoch 1 under FSDP over 2 ranks, epoch 2 under TP 2 + SP resumed from its checkpoint.
    let fsdp = Layout {
        zero: Some(Stage::Three),
        ..Layout::default()
    };
    let first = under(fsdp, 2, &dir, 1, None);
    let tp = Layout {
        tp: 2,
        sp: true,
        ..Layout::default()
    };
    let second = under(tp, 2, &dir, EPOCHS, Some(1));
    let joined = Outcome {
        train: [first.train, second.train].concat(),
        valid: [first.valid, second.valid].concat(),
        params: second.params,
    };
    assert_close(
        "FSDP 2, then TP 2 + SP from its checkpoint",
        &joined,
        &single,
        TOL,
    );
}

/// The error each rank's training ends with (`None`: it trained) on `world` thread ranks, each
/// checkpointing where `checkpoints(rank)` says, with burn-train's own checkpointers when
/// `burn_checkpointers`.
fn training_errors(
    world: usize,
    checkpoints: impl Fn(usize) -> PathBuf + Send + Sync,
    burn_checkpointers: bool,
) -> Vec<Option<String>> {
    training_errors_with(world, checkpoints, burn_checkpointers, ITEMS)
}

/// [`training_errors`] over `items` training rows.
fn training_errors_with(
    world: usize,
    checkpoints: impl Fn(usize) -> PathBuf + Send + Sync,
    burn_checkpointers: bool,
    items: usize,
) -> Vec<Option<String>> {
    let dir = temp_dir(&format!("refused-{world}-{burn_checkpointers}"));
    burn_parallel_train::run_local(world, move |group| {
        let own = checkpoints(group.rank());
        let strategy = LayoutStrategy::new(group, Layout::default(), CONFIG, own);
        let device = Device::flex().autodiff();
        let (train, valid) = loaders_of(items);
        let mut training = SupervisedTraining::new(&dir, train, valid).num_epochs(1);
        if burn_checkpointers {
            training = training.with_default_checkpointers();
        }
        let model = single_device(&CONFIG, &device)?;
        let result = training
            .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
            .launch(Learner::new(model, adamw().init(), LR));
        Ok(result.error.map(|e| e.to_string()))
    })
    .unwrap()
}

#[test]
fn burn_train_checkpointers_are_refused_by_name() {
    let dir = temp_dir("ck");
    let errors = training_errors(1, move |_| dir.clone(), true);
    let error = errors[0].clone().expect("refused");
    assert!(error.contains("with_default_checkpointers"), "{error}");
}

/// Two processes started by `burnrun`, joined over TCP, training the same `Learner` under FSDP:
/// the losses and the final parameters of the single-device training.
#[test]
fn learner_over_two_tcp_processes_matches_single_device() {
    let single = train(&temp_dir("single-tcp"), None, EPOCHS, None);
    let dir = temp_dir("tcp");
    let out = dir.join("out.json");
    let output = Command::new(workspace_binary("burn-parallel", "burnrun"))
        .args(["--nproc-per-node", "2", "--"])
        .arg(env!("CARGO_BIN_EXE_learner_process"))
        .args(["--layout", "zero = 3"])
        .arg("--dir")
        .arg(&dir)
        .arg("--out")
        .arg(&out)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .output()
        .expect("running burnrun");
    assert!(
        output.status.success(),
        "burnrun failed: {}\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("rank 0 wrote --out"))
            .expect("JSON");
    let losses = |key: &str| -> Vec<f64> { serde_json::from_value(json[key].clone()).unwrap() };
    let params: Params = serde_json::from_value(json["params"].clone()).unwrap();
    let tcp = Outcome {
        train: losses("train"),
        valid: losses("valid"),
        params,
    };
    assert_close("FSDP over 2 tcp processes", &tcp, &single, TOL);
    std::fs::remove_dir_all(&dir).ok();
}

/// Ranks given different checkpoint directories would each write half a checkpoint: refused
/// before the first step, naming both directories.
#[test]
fn ranks_with_different_checkpoint_directories_are_refused() {
    let dir = temp_dir("dirs");
    let errors = training_errors(2, move |rank| dir.join(format!("ck-{rank}")), false);
    for error in errors {
        let error = error.expect("refused");
        assert!(
            error.contains("different checkpoint directories"),
            "{error}"
        );
        assert!(error.contains("ck-0") && error.contains("ck-1"), "{error}");
    }
}

/// A failure of one rank alone (the epoch's last batch of 1 row leaves data rank 1 without
/// rows) ends the other rank at once, naming it, not at the collectives' timeout.
#[test]
fn one_rank_failing_alone_ends_the_others_at_once() {
    let dir = temp_dir("alone");
    let start = std::time::Instant::now();
    let errors = training_errors_with(2, move |_| dir.clone(), false, BATCH + 1);
    let elapsed = start.elapsed();
    let rank1 = errors[1].clone().expect("rank 1 fails");
    assert!(rank1.contains("without rows"), "{rank1}");
    let rank0 = errors[0].clone().expect("rank 0 fails with it");
    assert!(
        rank0.contains("without rows"),
        "rank 0 names rank 1's error: {rank0}"
    );
    assert!(elapsed.as_secs() < 20, "not at the timeout: {elapsed:?}");
}
