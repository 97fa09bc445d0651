//! The oracle checked from outside: our single-device GPT training against golden trajectories
//! of an independent implementation.
//!
//! Every parity test compares a layout with our own model on one device, so a bug in the model
//! or in a fused kernel would be invisible to all of them. `scripts/golden.py` writes a GPT-2
//! and a LLaMA in PyTorch from the `transformers` checkpoint semantics, trains each for 20 steps
//! (fp32, `torch.optim.AdamW`, global-norm clipping at 1) on the batches our loader draws, and
//! commits the initial weights, the losses and the final weights under `tests/golden/<arch>/`.
//! Here (no PyTorch needed) the initial weights come in through our Hugging Face importer and
//! both our plain-Burn oracle (`tests::reference_run_from`, the reference of every parity test)
//! and the library trainer (fused and composed kernels) train them. `tests/byo_parity.rs` does
//! the same for the bring-your-own-model decoder (`tests/golden/byo/`).
//!
//! To regenerate: write the inputs (`cargo test -p tests --test golden --test byo_parity --
//! --ignored write_golden`), then `python3 scripts/golden.py tests/golden` (with torch,
//! safetensors and numpy installed), and commit `tests/golden/`.

use examples::data::{Corpus, Split};
use examples::hf::{self, HfConfig};
use examples::train::{NamedParam, Parallelism, TrainConfig};
use tests::golden::{self, Batches, Trajectory};

/// Losses (relative) and final parameters (`tests::compare_params`'s measure) must agree with
/// PyTorch within this. Two fp32 implementations differ in the order of their sums; over the
/// 20 steps that stays near 1e-6 (measured 1.1e-6 for the losses, 1.2e-6 for the weights).
const TOL: f64 = 1e-4;

/// The run PyTorch made, as our trainer's configuration, after checking that what our trainer
/// does not take as a parameter (AdamW's betas and epsilon, the schedule) is the same.
fn train_config(golden: &Trajectory, model: examples::gpt::GptConfig) -> TrainConfig {
    golden.assert_burn_adamw();
    let config = TrainConfig {
        model,
        steps: golden.usize("steps"),
        batch_size: golden.usize("batch_size"),
        seq_len: golden.usize("seq_len"),
        grad_accum: 1,
        lr: golden.f64("lr"),
        warmup_steps: golden.usize("warmup_steps"),
        weight_decay: golden.f64("weight_decay"),
        bucket_mb: 0.01,
        eval_batches: 1,
        sample_len: 0,
        prompt: String::new(),
        max_grad_norm: Some(golden.f64("max_grad_norm")),
        precision: examples::train::Precision::F32,
        ..TrainConfig::default()
    };
    for (step, lr) in golden.f64s("lrs").iter().enumerate() {
        let ours = config.lr_at(step);
        assert!(
            (ours - lr).abs() <= 1e-12 * lr,
            "step {step}: our learning rate {ours} vs the golden run's {lr}"
        );
    }
    config
}

/// The batches of `config`'s run as our loader draws them.
fn corpus_batches(config: &TrainConfig) -> Batches {
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
    Batches {
        shape: [config.steps, config.batch_size, config.seq_len],
        inputs,
        targets,
    }
}

/// Writes `tests/golden/batches.safetensors`, the input of `scripts/golden.py`'s GPT-2 and
/// LLaMA: a 20-step run of batch 8 x 16 tokens from the bundled corpus.
#[test]
#[ignore = "writes the golden inputs; run by hand before scripts/golden.py"]
fn write_golden_batches() {
    let config = TrainConfig {
        batch_size: 8,
        seq_len: 16,
        ..tests::tiny_gpt_run(20)
    };
    corpus_batches(&config).write(&golden::root().join("batches.safetensors"));
}

/// PyTorch's final weights under our parameter paths.
fn golden_final_params(arch: &str, config: &HfConfig) -> tests::Params {
    let tensors = golden::tensors(arch, "final.safetensors");
    let params = hf::adapter(config).from_hf(tensors);
    golden::params(params.expect("final.safetensors has the checkpoint's tensors"))
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

/// Our plain-Burn oracle (the reference of every parity test) from PyTorch's initial weights.
fn oracle_matches(arch: &str) {
    let dir = golden::dir(arch);
    let golden = Trajectory::load(arch);
    let (hf_config, model) = hf::import(&dir, &tests::reference_device()).expect("import");
    let config = train_config(&golden, hf_config.model.clone());
    corpus_batches(&config).assert_committed_at(&golden::root().join("batches.safetensors"));
    let ours = tests::reference_run_from(&config, model);
    let what = format!("{arch}: the single-device oracle vs PyTorch");
    golden::report_losses(&what, &ours.losses, &golden.losses());
    tests::assert_same_losses(&golden.losses(), &ours.losses, TOL, &what);
    let reference = golden_final_params(arch, &hf_config);
    tests::assert_same_params(&reference, &named(ours.params), TOL, &what);
}

/// The library trainer on one rank (`examples::train`, what `gpt --init-from-hf` runs), with
/// the fused kernels or the composed ones.
fn trainer_matches(arch: &str, fused: bool) {
    let dir = golden::dir(arch);
    let golden = Trajectory::load(arch);
    let hf_config = HfConfig::from_dir(&dir).expect("config.json");
    let mut config = train_config(&golden, hf_config.model.clone());
    config.model.fused = fused;
    config.init_from_hf = Some(dir);
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let report = burn_parallel_train::run_local(1, |g| {
        examples::train::train_gpt(&g, &config, &Parallelism::default(), &corpus, &mut |_| {})
    })
    .expect("single-device training")
    .remove(0);
    let what = format!("{arch}: the trainer (fused {fused}) vs PyTorch");
    golden::report_losses(&what, &report.losses, &golden.losses());
    tests::assert_same_losses(&golden.losses(), &report.losses, TOL, &what);
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

/// The comparison can fail: PyTorch's final weights with one value moved by 1e-3 (ten times the
/// tolerance) are caught, by name.
#[test]
fn a_perturbed_golden_weight_is_caught() {
    let hf_config = HfConfig::from_dir(&golden::dir("gpt2")).expect("config.json");
    let reference = golden_final_params("gpt2", &hf_config);
    let mut perturbed = reference.clone();
    let (_, values) = perturbed.get_mut("blocks.0.attn.q.bias").expect("a q bias");
    values[3] += 1e-3;
    let err = tests::compare_params(&reference, &named(perturbed), TOL)
        .expect_err("a 1e-3 change must exceed the tolerance");
    assert!(err.contains("blocks.0.attn.q.bias"), "{err}");
}
