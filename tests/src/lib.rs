//! Shared helpers of the cross-crate integration tests: small training configurations, the
//! independent single-device reference run every layout is checked against (losses and final
//! parameters), and the binaries that multi-process tests run through `burnrun`, built by Cargo
//! from the current sources before use.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Tensor};
use examples::data::{Corpus, Split};
use examples::gpt::{Gpt, GptConfig};
use examples::train::{NamedParam, Parallelism, TrainConfig, TrainReport};

pub mod golden;
pub mod learner;

/// A GPT run small enough for CI: 2 layers, width 32, global batch 8 x 16 tokens.
pub fn tiny_gpt_run(steps: usize) -> TrainConfig {
    let mut model = GptConfig::new(256, 2, 2, 32, 16);
    model.seed = 7;
    TrainConfig {
        model,
        steps,
        batch_size: 8,
        seq_len: 16,
        grad_accum: 1,
        lr: 3e-3,
        warmup_steps: 5,
        weight_decay: 0.01,
        bucket_mb: 0.01, // several buckets even for a tiny model
        eval_batches: 1,
        sample_len: 0,
        prompt: String::new(),
        max_grad_norm: None,
        precision: examples::train::Precision::F32,
        ..TrainConfig::default()
    }
}

/// Asserts that two loss curves agree within `tol` relative difference, step by step.
///
/// # Panics
/// With the first step that differs, both values and the whole curves.
pub fn assert_same_losses(reference: &[f64], other: &[f64], tol: f64, what: &str) {
    assert_eq!(reference.len(), other.len(), "{what}: number of steps");
    for (step, (a, b)) in reference.iter().zip(other).enumerate() {
        let rel = (a - b).abs() / a.abs().max(1e-12);
        assert!(
            rel <= tol,
            "{what}: step {step} loss {b} vs single-device {a} (relative difference {rel:.2e} > \
             {tol:.0e})\nreference {reference:?}\nother     {other:?}"
        );
    }
}

/// The worst relative difference, step by step, of the loss curve `other` from `reference`
/// (`|other - reference| / |reference|`): how far a lower-precision run drifts.
pub fn max_relative_loss_diff(other: &[f64], reference: &[f64]) -> f64 {
    other
        .iter()
        .zip(reference)
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0, f64::max)
}

/// Final parameters by module path: shape and values.
pub type Params = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// The independent single-device run: per-step losses and final parameters.
#[derive(Debug, Clone)]
pub struct Reference {
    /// Mean loss over the global batch, per step.
    pub losses: Vec<f64>,
    /// The trained parameters.
    pub params: Params,
}

impl Reference {
    /// A run of the trainer under one layout as the reference of other layouts of the same
    /// trainer (for backends where the plain-Burn oracle on Flex is not the comparison: a
    /// single-device WGPU run against WGPU layouts).
    pub fn of_run(report: examples::train::TrainReport) -> Self {
        Self {
            losses: report.losses,
            params: report
                .final_params
                .into_iter()
                .map(|p| (p.path, (p.shape, p.values)))
                .collect(),
        }
    }
}

/// Trains the GPT of `config` with the library trainer on `world` thread ranks split by
/// `parallel`, checks that every rank reports the same losses and gathers the same parameters,
/// and returns rank 0's report.
///
/// # Panics
/// When the run fails (with the layout and the error) or ranks disagree.
pub fn train_layout(world: usize, parallel: &Parallelism, config: &TrainConfig) -> TrainReport {
    train_layout_on(world, parallel, config, false)
}

/// [`train_layout`] with `tensor_path` set on the world (`ProcessGroup::with_tensor_path`,
/// inherited by the mesh's sub-groups): the path an NCCL job takes on CUDA, where every
/// technique communicates tensors on the device; here each collective stages them through host
/// memory inside.
pub fn train_layout_on(
    world: usize,
    parallel: &Parallelism,
    config: &TrainConfig,
    tensor_path: bool,
) -> TrainReport {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reports = burn_parallel_train::run_local(world, |g| {
        let g = g.with_tensor_path(tensor_path);
        examples::train::train_gpt(&g, config, parallel, &corpus, &mut |_| {})
    })
    .unwrap_or_else(|e| panic!("{parallel:?} on {world} ranks (tensor path {tensor_path}): {e}"));
    rank0_if_ranks_agree(reports, |r| (&r.losses, &r.final_params))
}

/// The first of `reports` (one per rank), after checking that every rank reports the same losses
/// and gathered the same parameters (`view` picks them out of a report).
///
/// # Panics
/// When two ranks disagree, or `reports` is empty.
pub fn rank0_if_ranks_agree<R>(
    reports: Vec<R>,
    view: impl Fn(&R) -> (&Vec<f64>, &Vec<NamedParam>),
) -> R {
    let (losses, params) = view(&reports[0]);
    for r in &reports[1..] {
        let (l, p) = view(r);
        assert!(l == losses, "every rank reports the same losses");
        assert!(p == params, "every rank gathers the same parameters");
    }
    reports.into_iter().next().expect("rank 0")
}

/// [`train_layout`], then [`assert_matches_reference`] within `tol`.
///
/// # Panics
/// As both.
pub fn check_layout(
    reference: &Reference,
    world: usize,
    parallel: Parallelism,
    config: &TrainConfig,
    tol: f64,
    what: &str,
) {
    check_layout_on(reference, world, parallel, config, tol, what, false);
}

/// [`check_layout`], on the tensor-level path when `tensor_path` ([`train_layout_on`]).
///
/// # Panics
/// As [`check_layout`].
pub fn check_layout_on(
    reference: &Reference,
    world: usize,
    parallel: Parallelism,
    config: &TrainConfig,
    tol: f64,
    what: &str,
    tensor_path: bool,
) {
    let r = train_layout_on(world, &parallel, config, tensor_path);
    assert_matches_reference(reference, &r.losses, &r.final_params, tol, what);
}

/// Every float parameter of `module` by path (the test suite's own visitor, independent of the
/// `examples` crate's).
pub fn params_of<M: Module>(module: &M) -> Params {
    struct Collect(Vec<String>, Params);
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let shape = value.dims().to_vec();
            let values = value
                .try_into_vec_as::<f32>()
                .expect("f32 parameter values");
            let path = self.0.join(".");
            assert!(
                self.1.insert(path.clone(), (shape, values)).is_none(),
                "two parameters at {path}"
            );
        }
    }
    let mut collect = Collect(Vec::new(), Params::new());
    module.visit(&mut collect);
    collect.1
}

/// `params` by path.
///
/// # Panics
/// When two parameters have the same path.
pub fn params_map(params: &[NamedParam]) -> Params {
    let mut map = Params::new();
    for p in params {
        let old = map.insert(p.path.clone(), (p.shape.clone(), p.values.clone()));
        assert!(old.is_none(), "two parameters at {}", p.path);
    }
    map
}

/// The learning rate of `step`, written from [`TrainConfig`]'s documentation (linear warm-up
/// over `warmup_steps`, then cosine decay to 10% of `lr` at the last step).
fn reference_lr(config: &TrainConfig, step: usize) -> f64 {
    let (lr, warmup) = (config.lr, config.warmup_steps);
    if step < warmup {
        lr * (step + 1) as f64 / warmup as f64
    } else {
        let progress = (step - warmup) as f64 / (config.steps - warmup).max(1) as f64;
        lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    }
}

/// Scales `grads` so that their global L2 norm is at most `max_norm` (PyTorch's
/// `clip_grad_norm_`: factor `max_norm / (norm + 1e-6)` when below 1; sums of squares in f64).
fn reference_clip<M: Module>(model: &M, grads: GradientsParams, max_norm: f64) -> GradientsParams {
    struct SumSq<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for SumSq<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(param.id) {
                let g = g.try_into_vec_as::<f64>().expect("gradient values");
                self.1 += g.iter().map(|v| v * v).sum::<f64>();
            }
        }
    }
    struct Scale(GradientsParams, f64);
    impl ModuleVisitor for Scale {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, g * self.1);
            }
        }
    }
    let mut sum = SumSq(&grads, 0.0);
    model.visit(&mut sum);
    let factor = max_norm / (sum.1.sqrt() + 1e-6);
    if factor >= 1.0 {
        return grads;
    }
    let mut scale = Scale(grads, factor as f32 as f64);
    model.visit(&mut scale);
    scale.0
}

/// The oracle's loss of step `step`: the whole global batch on one device, cross-entropy written
/// out as `-mean(gather(log_softmax(logits), targets))`.
///
/// # Panics
/// When the model's forward fails.
pub fn reference_loss(
    model: &Gpt,
    corpus: &Corpus,
    config: &TrainConfig,
    step: usize,
    device: &Device,
) -> Tensor<1> {
    let batch = corpus.batch_rows(
        step as u64,
        0..config.batch_size,
        config.seq_len,
        Split::Train,
    );
    let (inputs, targets) = batch.to_tensors(device);
    let logits = model.forward(inputs).expect("a single-device GPT");
    let [b, s, v] = logits.dims();
    log_softmax(logits.reshape([b * s, v]), 1)
        .gather(1, targets.reshape([b * s, 1]))
        .mean()
        .neg()
}

/// Single-device training of `config` in plain Burn, independent of the training loops under
/// test (`examples::train`, `burn-parallel`, `burn-zero`): the GPT of `config.model` (unfused)
/// from its seed, the whole global batch of every step, the mean token cross-entropy, AdamW with
/// `config`'s weight decay and learning-rate schedule, global-norm clipping at
/// `config.max_grad_norm`.
///
/// # Panics
/// When the bundled corpus does not load.
pub fn reference_run(config: &TrainConfig) -> Reference {
    let model_config = GptConfig {
        fused: false,
        ..config.model.clone()
    };
    reference_run_from(config, Gpt::new(&model_config, &reference_device()))
}

/// The device of the oracle: Flex with autodiff.
pub fn reference_device() -> Device {
    Device::flex().autodiff()
}

/// [`reference_run`] from the initial weights of `model` (on [`reference_device`]; built with
/// the unfused kernels), for example a checkpoint imported from another implementation.
///
/// # Panics
/// When the bundled corpus does not load.
pub fn reference_run_from(config: &TrainConfig, mut model: Gpt) -> Reference {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let device = reference_device();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(config.weight_decay as f32)
        .init();
    let mut losses = Vec::with_capacity(config.steps);
    for step in 0..config.steps {
        let loss = reference_loss(&model, &corpus, config, step, &device);
        losses.push(loss.clone().try_into_vec_as::<f64>().expect("the loss")[0]);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if let Some(max_norm) = config.max_grad_norm {
            grads = reference_clip(&model, grads, max_norm);
        }
        model = optim.step(reference_lr(config, step), model, grads);
    }
    Reference {
        losses,
        params: params_of(&model.valid()),
    }
}

/// Compares `other` with `reference`: the same paths and shapes, and each parameter within
/// `tol`, measured per tensor as `max |a - b| / max(1, max |a|)`: the largest absolute
/// difference for tensors whose values are below 1, relative to the largest value above. (A
/// purely relative measure would judge rounding noise: the key bias of attention has a zero
/// gradient in exact arithmetic, so it stays at about 1e-9, where the noise is all there is.)
///
/// # Returns
/// The worst error and its parameter's path.
///
/// # Errors
/// A message naming the first parameter missing, extra, misshapen or out of tolerance, with its
/// worst element and the error.
pub fn compare_params(
    reference: &Params,
    other: &[NamedParam],
    tol: f64,
) -> Result<(f64, String), String> {
    let mut seen = BTreeMap::new();
    for p in other {
        if seen.insert(p.path.as_str(), p).is_some() {
            return Err(format!("parameter {} reported twice", p.path));
        }
    }
    let missing: Vec<_> = reference
        .keys()
        .filter(|k| !seen.contains_key(k.as_str()))
        .collect();
    let extra: Vec<_> = seen
        .keys()
        .filter(|k| !reference.contains_key(**k))
        .collect();
    if !missing.is_empty() || !extra.is_empty() {
        return Err(format!(
            "parameters missing {missing:?}, unexpected {extra:?}"
        ));
    }
    let mut worst = (0.0f64, String::from("(none)"));
    for (path, (shape, a)) in reference {
        let p = seen[path.as_str()];
        if &p.shape != shape || p.values.len() != a.len() {
            return Err(format!(
                "parameter {path} has shape {:?} ({} values), expected {shape:?} ({})",
                p.shape,
                p.values.len(),
                a.len()
            ));
        }
        let scale = a.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let (index, diff) = a
            .iter()
            .zip(&p.values)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
            .enumerate()
            .fold((0, 0.0f64), |best, (i, d)| {
                if d > best.1 || d.is_nan() {
                    (i, d)
                } else {
                    best
                }
            });
        let err = diff / scale.max(1.0);
        if err.is_nan() || err > tol {
            return Err(format!(
                "parameter {path} differs from single-device training: element {index} is {} vs \
                 {} (max |diff| {diff:.3e}, tensor's max |value| {scale:.3e}, error \
                 {err:.2e} > {tol:.0e})",
                p.values[index], a[index]
            ));
        }
        if err >= worst.0 {
            worst = (err, path.clone());
        }
    }
    Ok(worst)
}

/// Asserts [`compare_params`] and prints the worst error.
///
/// # Panics
/// With [`compare_params`]'s message.
pub fn assert_same_params(reference: &Params, other: &[NamedParam], tol: f64, what: &str) {
    match compare_params(reference, other, tol) {
        Ok((err, path)) => println!(
            "{what}: {} parameters within {tol:.0e} (worst {err:.2e} at {path})",
            reference.len()
        ),
        Err(message) => panic!("{what}: {message}"),
    }
}

/// Asserts that a run reproduces the reference: losses step by step and final parameters,
/// both within `tol`.
///
/// # Panics
/// As [`assert_same_losses`] and [`assert_same_params`].
pub fn assert_matches_reference(
    reference: &Reference,
    losses: &[f64],
    params: &[NamedParam],
    tol: f64,
    what: &str,
) {
    assert_same_losses(&reference.losses, losses, tol, what);
    assert_same_params(&reference.params, params, tol, what);
}

/// Writes `line` to the real standard error, past libtest's output capture (which takes
/// `print!`/`eprint!` but not writes through a `std::io::stderr()` handle), so that it shows in
/// `cargo test` output without `--nocapture`.
pub fn visible_notice(line: &str) {
    // One write of the whole line, so that it does not interleave with libtest's output.
    let line = format!("{line}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The WGPU device for the test `test`, or `None` after a visible `SKIPPED test: reason` line
/// when this machine has no adapter. With `BURN_PARALLEL_REQUIRE_WGPU` set (CI installs Mesa's
/// software Vulkan driver and sets it), a missing adapter fails the test instead.
///
/// # Panics
/// When `BURN_PARALLEL_REQUIRE_WGPU` is set and no adapter is found.
#[cfg(feature = "wgpu")]
pub fn wgpu_or_skip(test: &str) -> Option<burn::tensor::Device> {
    match burn_parallel::kernels::wgpu_device() {
        Ok(device) => Some(device),
        Err(e) if std::env::var_os("BURN_PARALLEL_REQUIRE_WGPU").is_some() => {
            panic!("BURN_PARALLEL_REQUIRE_WGPU is set but {e}")
        }
        Err(e) => {
            visible_notice(&format!(
                "SKIPPED {test}: {e}; set BURN_PARALLEL_REQUIRE_WGPU=1 to fail instead"
            ));
            None
        }
    }
}

/// The workspace executables the tests run: package, Cargo target flag (a binary or an example)
/// and name. They are built together, in one Cargo invocation over both packages, so that Cargo
/// resolves the features of their dependencies as for this test crate (which depends on both)
/// and reuses its build.
const BINARIES: [(&str, &str, &str); 15] = [
    ("burn-parallel", "--bin", "burnrun"),
    ("examples", "--bin", "gpt"),
    ("examples", "--bin", "vit"),
    ("examples", "--example", "byo_model"),
    ("examples", "--example", "learner"),
    // The benchmarks, whose documented commands `tests/commands.rs` runs.
    ("examples", "--example", "checkpoint_bench"),
    ("examples", "--example", "cp_bench"),
    ("examples", "--example", "diloco_figures"),
    ("examples", "--example", "gpt_overlap_bench"),
    ("examples", "--example", "pipeline_memory"),
    ("examples", "--example", "plain_burn_gpt"),
    ("examples", "--example", "planner_check"),
    ("examples", "--example", "tp_bench"),
    ("examples", "--example", "zero_bench"),
    ("examples", "--example", "wrap_memory"),
];

/// The `gpt` binary as rank `rank` of a `world`-rank TCP job whose rank 0 serves the
/// rendezvous on 127.0.0.1:`port`, with the launch environment `burnrun` gives (job token
/// `token`) and a 60 s collective timeout; stdout piped for rank 0 only, stderr piped.
pub fn gpt_rank(rank: usize, world: usize, port: u16, token: &str) -> Command {
    let mut c = Command::new(workspace_binary("examples", "gpt"));
    c.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("BURN_PARALLEL_JOB_TOKEN", token)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .stdout(match rank {
            0 => std::process::Stdio::piped(),
            _ => std::process::Stdio::null(),
        })
        .stderr(std::process::Stdio::piped());
    c
}

/// Path of the executable `name` of workspace package `package`, one of [`BINARIES`]:
/// `burn-parallel`'s binary `burnrun`, `examples`' binaries `gpt` and `vit`, and its examples
/// `byo_model` and the benchmarks. Cargo builds them all from the current sources first, with the
/// profile and target directory of this test executable, so that a test never runs an
/// out-of-date executable. Cargo runs once per test process; it names the executables it built
/// (or found fresh).
///
/// # Panics
/// For another executable, or when Cargo fails to build them, with Cargo's output.
pub fn workspace_binary(package: &str, name: &str) -> PathBuf {
    static BUILT: Mutex<Option<HashMap<String, PathBuf>>> = Mutex::new(None);
    assert!(
        BINARIES.iter().any(|&(p, _, n)| (p, n) == (package, name)),
        "workspace_binary knows {BINARIES:?}, not {package}/{name}"
    );
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let paths = built.get_or_insert_with(build_binaries);
    paths
        .get(name)
        .unwrap_or_else(|| {
            panic!("cargo build named no executable for {package}/{name}: {paths:?}")
        })
        .clone()
}

/// Runs `cargo build` for [`BINARIES`] and returns the executables by binary name.
fn build_binaries() -> HashMap<String, PathBuf> {
    // Integration tests run from `<target dir>/<profile dir>/deps/`.
    let exe = std::env::current_exe().expect("the test executable");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from <target>/<profile>/deps");
    let target_dir = profile_dir.parent().expect("a target directory");
    let profile = match profile_dir.file_name().and_then(|p| p.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["build", "--manifest-path", manifest, "--profile", profile])
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--message-format=json");
    for (package, target, name) in BINARIES {
        cargo.args(["-p", package, target, name]);
    }
    // The backend features this test crate was built with, so that Cargo reuses its build.
    for (on, feature) in [
        (cfg!(feature = "wgpu"), "examples/wgpu"),
        (cfg!(feature = "ndarray"), "examples/ndarray"),
        (cfg!(feature = "mpi"), "examples/mpi"),
        (cfg!(feature = "nccl"), "examples/nccl"),
        (cfg!(feature = "cuda"), "examples/cuda"),
        // It turns on features of Burn's own dependencies: without it here, Cargo would build
        // the whole Burn stack a second time for the binaries.
        (cfg!(feature = "hf-tokenizer"), "examples/hf-tokenizer"),
    ] {
        if on {
            cargo.args(["--features", feature]);
        }
    }
    let output = cargo.output().expect("running cargo build");
    assert!(
        output.status.success(),
        "cargo build of {BINARIES:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter_map(|m| {
            let name = m["target"]["name"].as_str()?.to_string();
            let path = PathBuf::from(m["executable"].as_str()?);
            Some((name, path))
        })
        .collect()
}

/// What a `gpt` run through `burnrun` gave.
#[derive(Debug, Clone)]
pub struct BurnrunRun {
    /// Per-step losses of rank 0.
    pub losses: Vec<f64>,
    /// Final parameters of rank 0 (whole).
    pub params: Vec<NamedParam>,
    /// The launcher's output, every line prefixed by its rank.
    pub stdout: String,
}

/// Runs the `gpt` binary as `processes` processes over TCP through `burnrun`, with `config`
/// (passed as a TOML file) and extra `flags`; returns what rank 0 wrote (losses, parameters)
/// and the launcher's output.
///
/// # Panics
/// When the run fails, with its whole output.
pub fn gpt_through_burnrun(processes: usize, config: &TrainConfig, flags: &[&str]) -> BurnrunRun {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "burn-parallel-burnrun-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let config_path = dir.join("run.toml");
    std::fs::write(
        &config_path,
        toml::to_string(config).expect("a TOML config"),
    )
    .expect("writing the config");
    let losses_path = dir.join("losses.json");
    let params_path = dir.join("params.json");
    let burnrun = workspace_binary("burn-parallel", "burnrun");
    let gpt = workspace_binary("examples", "gpt");
    let output = Command::new(burnrun)
        .args(["--nproc-per-node", &processes.to_string(), "--"])
        .arg(gpt)
        .args(["--backend", "tcp"])
        .args(flags)
        .arg("--config")
        .arg(&config_path)
        .arg("--losses-out")
        .arg(&losses_path)
        .arg("--params-out")
        .arg(&params_path)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .output()
        .expect("running burnrun");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "burnrun {flags:?} failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let read = |path: &PathBuf, what: &str| {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("rank 0 wrote its {what}: {e}"))
    };
    let losses =
        serde_json::from_str(&read(&losses_path, "losses")).expect("a JSON list of losses");
    let params =
        serde_json::from_str(&read(&params_path, "parameters")).expect("a JSON list of params");
    std::fs::remove_dir_all(&dir).ok();
    BurnrunRun {
        losses,
        params,
        stdout,
    }
}
