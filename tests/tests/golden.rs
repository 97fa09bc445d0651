//! The oracle checked from outside: our single-device GPT training against golden trajectories
//! of an independent implementation.
//!
//! Every parity test compares a layout with our own model on one device, so a bug in the model
//! or in a fused kernel would be invisible to all of them. `scripts/golden.py` writes a GPT-2
//! and a LLaMA in PyTorch from the `transformers` checkpoint semantics, trains each for 20 steps
//! (fp32, `torch.optim.AdamW`, global-norm clipping) on the batches our loader draws, and
//! commits the initial weights, the losses and the final weights under `tests/golden/<arch>/`.
//! Here (no PyTorch needed) the initial weights come in through our Hugging Face importer and
//! both our plain-Burn oracle (`tests::reference_run_from`) and the library trainer (fused and
//! composed kernels) train them: losses within 1e-4 relative, final weights within 1e-4.
//!
//! To regenerate: `cargo test -p tests --test golden -- --ignored write_golden_batches`, then
//! `python3 scripts/golden.py tests/golden` (torch, safetensors and numpy installed).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use examples::data::{Corpus, Split};
use examples::hf::{self, HfConfig};
use examples::train::{NamedParam, Parallelism, TrainConfig};
use examples::train_checkpoint::CheckpointOptions;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde_json::Value;

/// Losses and final parameters must agree with PyTorch within this (relative loss difference;
/// parameters by `tests::compare_params`'s measure). Two fp32 implementations differ in the
/// order of their sums; over 20 AdamW steps that stays near 1e-6 (measured: see the test output).
const TOL: f64 = 1e-4;

fn golden_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

fn golden_dir(arch: &str) -> PathBuf {
    golden_root().join(arch)
}

/// The batches both golden runs train on.
fn batches_path() -> PathBuf {
    golden_root().join("batches.safetensors")
}

/// What `scripts/golden.py` recorded.
struct Trajectory {
    json: Value,
    losses: Vec<f64>,
}

impl Trajectory {
    fn load(arch: &str) -> Self {
        let path = golden_dir(arch).join("trajectory.json");
        let text = std::fs::read_to_string(&path)
            .or_panic(&path, "run scripts/golden.py (see this file's header)");
        let json: Value = serde_json::from_str(&text).expect("trajectory.json parses");
        let losses = self::f64s(&json, "losses");
        Self { json, losses }
    }

    fn f64(&self, key: &str) -> f64 {
        self.json[key]
            .as_f64()
            .unwrap_or_else(|| panic!("trajectory.json: {key} is not a number"))
    }

    fn usize(&self, key: &str) -> usize {
        self.json[key]
            .as_u64()
            .unwrap_or_else(|| panic!("trajectory.json: {key} is not an integer")) as usize
    }

    /// The run PyTorch made, as our trainer's configuration, after checking that the settings
    /// our trainer does not take as parameters (AdamW's betas and epsilon, the schedule's floor)
    /// are the ones it uses.
    fn train_config(&self, model: examples::gpt::GptConfig) -> TrainConfig {
        assert_eq!(
            (
                self::f64s(&self.json, "betas"),
                self.f64("eps"),
                self.f64("min_lr_ratio")
            ),
            (vec![0.9, 0.999], 1e-5, 0.1),
            "the golden run's AdamW betas/epsilon or schedule floor are not those of the trainer \
             (burn's AdamW defaults; TrainConfig::lr_at)"
        );
        let config = TrainConfig {
            model,
            steps: self.usize("steps"),
            batch_size: self.usize("batch_size"),
            seq_len: self.usize("seq_len"),
            grad_accum: 1,
            lr: self.f64("lr"),
            warmup_steps: self.usize("warmup_steps"),
            weight_decay: self.f64("weight_decay"),
            bucket_mb: 0.01,
            eval_batches: 1,
            sample_len: 0,
            prompt: String::new(),
            max_grad_norm: Some(self.f64("max_grad_norm")),
            precision: examples::train::Precision::F32,
        };
        for (step, lr) in self::f64s(&self.json, "lrs").iter().enumerate() {
            let ours = config.lr_at(step);
            assert!(
                (ours - lr).abs() <= 1e-12 * lr,
                "step {step}: our learning rate {ours} vs the golden run's {lr}"
            );
        }
        config
    }
}

trait OrPanic<T> {
    fn or_panic(self, path: &Path, hint: &str) -> T;
}

impl<T, E: std::fmt::Display> OrPanic<T> for Result<T, E> {
    fn or_panic(self, path: &Path, hint: &str) -> T {
        self.unwrap_or_else(|e| panic!("{}: {e} ({hint})", path.display()))
    }
}

fn f64s(json: &Value, key: &str) -> Vec<f64> {
    json[key]
        .as_array()
        .unwrap_or_else(|| panic!("trajectory.json: {key} is not an array"))
        .iter()
        .map(|v| v.as_f64().expect("a number"))
        .collect()
}

/// The batches of `config`'s run as our loader draws them: inputs and targets, `[steps, batch,
/// seq]` row-major.
fn corpus_batches(config: &TrainConfig) -> (Vec<i64>, Vec<i64>) {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for step in 0..config.steps {
        let batch = corpus.batch_rows(
            step as u64,
            0..config.batch_size,
            config.seq_len,
            Split::Train,
        );
        inputs.extend(batch.inputs);
        targets.extend(batch.targets);
    }
    (inputs, targets)
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes `tests/golden/batches.safetensors`, the input of `scripts/golden.py`: the
/// batches of a 20-step run of batch 8 x 16 tokens from the bundled corpus.
#[test]
#[ignore = "writes the golden inputs; run by hand before scripts/golden.py"]
fn write_golden_batches() {
    let (steps, batch, seq) = (20, 8, 16);
    let config = TrainConfig {
        steps,
        batch_size: batch,
        seq_len: seq,
        ..tests::tiny_gpt_run(steps)
    };
    let (inputs, targets) = corpus_batches(&config);
    let (inputs, targets) = (i64_bytes(&inputs), i64_bytes(&targets));
    let shape = vec![steps, batch, seq];
    let views = [("inputs", &inputs), ("targets", &targets)].map(|(name, bytes)| {
        (
            name,
            TensorView::new(Dtype::I64, shape.clone(), bytes).expect("a tensor view"),
        )
    });
    let path = batches_path();
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("the golden directory");
    safetensors::serialize_to_file(views, None, &path).expect("batches.safetensors written");
}

/// The committed batches are the ones our loader draws (else the golden losses are of other
/// data, and the fix is to regenerate).
fn check_batches(config: &TrainConfig) {
    let path = batches_path();
    let bytes = std::fs::read(&path).or_panic(&path, "see this file's header");
    let file = SafeTensors::deserialize(&bytes).expect("batches.safetensors parses");
    let (inputs, targets) = corpus_batches(config);
    for (name, ours) in [("inputs", inputs), ("targets", targets)] {
        let view = file.tensor(name).expect("inputs and targets");
        assert_eq!(
            (view.dtype(), view.shape()),
            (
                Dtype::I64,
                &[config.steps, config.batch_size, config.seq_len][..]
            ),
            "{}: {name}",
            path.display()
        );
        assert!(
            view.data() == i64_bytes(&ours).as_slice(),
            "{}: the committed {name} are not the batches the bundled corpus gives now; \
             regenerate the golden files (see this file's header)",
            path.display()
        );
    }
}

/// PyTorch's final weights under our parameter paths.
fn golden_final_params(arch: &str, config: &HfConfig) -> tests::Params {
    let path = golden_dir(arch).join("final.safetensors");
    let tensors = hf::read_safetensors(&path).expect("final.safetensors");
    hf::to_gpt_params(config, tensors)
        .expect("final.safetensors has the checkpoint's tensors")
        .into_iter()
        .map(|(path, t)| (path, (t.shape, t.values)))
        .collect()
}

fn named(params: tests::Params) -> Vec<NamedParam> {
    params
        .into_iter()
        .map(|(path, (shape, values))| NamedParam {
            path,
            shape,
            values,
        })
        .collect()
}

fn loss_report(what: &str, ours: &[f64], golden: &[f64]) {
    println!(
        "{what}: 20-step losses within {:.2e} of PyTorch's (first {:.6} vs {:.6}, last {:.6} vs \
         {:.6})",
        tests::max_relative_loss_diff(ours, golden),
        ours[0],
        golden[0],
        ours[ours.len() - 1],
        golden[golden.len() - 1]
    );
}

/// Our plain-Burn oracle (the reference of every parity test) from PyTorch's initial weights.
fn oracle_matches(arch: &str) {
    let dir = golden_dir(arch);
    let golden = Trajectory::load(arch);
    let (hf_config, model) = hf::import(&dir, &tests::reference_device()).expect("import");
    let config = golden.train_config(hf_config.model.clone());
    check_batches(&config);
    let ours = tests::reference_run_from(&config, model);
    let what = format!("{arch}: the single-device oracle vs PyTorch");
    loss_report(&what, &ours.losses, &golden.losses);
    tests::assert_same_losses(&golden.losses, &ours.losses, TOL, &what);
    let reference = golden_final_params(arch, &hf_config);
    tests::assert_same_params(&reference, &named(ours.params), TOL, &what);
}

/// The library trainer on one rank (`examples::train`, what `gpt --init-from-hf` runs), with
/// the fused kernels or the composed ones.
fn trainer_matches(arch: &str, fused: bool) {
    let dir = golden_dir(arch);
    let golden = Trajectory::load(arch);
    let hf_config = HfConfig::from_dir(&dir).expect("config.json");
    let mut config = golden.train_config(hf_config.model.clone());
    config.model.fused = fused;
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let checkpoints = CheckpointOptions {
        init_from_hf: Some(dir),
        ..CheckpointOptions::default()
    };
    let report = burn_parallel::run_local(1, |g| {
        examples::train::train_gpt_checkpointed(
            &g,
            &config,
            &Parallelism::default(),
            &corpus,
            &checkpoints,
            &mut |_| {},
        )
    })
    .expect("single-device training")
    .remove(0);
    let what = format!("{arch}: the trainer (fused {fused}) vs PyTorch");
    loss_report(&what, &report.losses, &golden.losses);
    tests::assert_same_losses(&golden.losses, &report.losses, TOL, &what);
    let reference = golden_final_params(arch, &hf_config);
    tests::assert_same_params(&reference, &report.final_params, TOL, &what);
}

#[test]
fn gpt2_oracle_matches_pytorch() {
    oracle_matches("gpt2");
}

#[test]
fn llama_oracle_matches_pytorch() {
    oracle_matches("llama");
}

#[test]
fn gpt2_trainer_matches_pytorch_fused_and_composed() {
    trainer_matches("gpt2", true);
    trainer_matches("gpt2", false);
}

#[test]
fn llama_trainer_matches_pytorch_fused_and_composed() {
    trainer_matches("llama", true);
    trainer_matches("llama", false);
}

/// A golden file that disagrees is caught: the same check against a trajectory whose weights
/// are perturbed by 1e-3 fails (the comparison can fail).
#[test]
fn a_perturbed_golden_weight_is_caught() {
    let dir = golden_dir("gpt2");
    let hf_config = HfConfig::from_dir(&dir).expect("config.json");
    let reference = golden_final_params("gpt2", &hf_config);
    let mut perturbed = reference.clone();
    let (_, values) = perturbed.get_mut("blocks.0.attn.q.bias").expect("a q bias");
    values[3] += 1e-3;
    let err = tests::compare_params(&reference, &named(perturbed), TOL)
        .expect_err("a 1e-3 change must exceed the tolerance");
    assert!(err.contains("blocks.0.attn.q.bias"), "{err}");
    let mut other: BTreeMap<_, _> = reference.clone();
    other.remove("ln_f.weight");
    assert!(tests::compare_params(&reference, &named(other), TOL).is_err());
}
