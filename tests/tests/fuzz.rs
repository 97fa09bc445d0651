//! No panic is reachable from input: random and adversarial configs, layouts, checkpoint
//! manifests and safetensors files thrown at the parsing and validation code, each outcome
//! `Ok` or a typed error. A seeded generator (splitmix64), so a failure reproduces: the
//! message names the case.
//!
//! Cases per run: 3,000 trainer configs (each validated on 1 to 8 ranks, under a layout, and
//! for memory), 3,000 layouts, 3,000 `gpt` and 1,000 `plan` command lines (parsed by their own
//! clap definitions, then checked and planned as the binaries do), 400 damaged manifests (half
//! sealed again, so that the checks behind the manifest's checksum run too), 400 damaged rank
//! files and 400 damaged safetensors files.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::TensorData;
use burn_parallel::checkpoint::{Checkpoint, Checkpointer, Piece};
use burn_parallel_train::{Layout, Workload};
use examples::train::TrainConfig;

/// A small seeded generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Values at the edges: zero, negative, huge, not finite, the wrong type.
const VALUES: [&str; 20] = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "7",
    "-1",
    "0.5",
    "1e308",
    "-1e308",
    "nan",
    "inf",
    "-inf",
    "18446744073709551615",
    "9223372036854775807",
    "4294967296",
    "true",
    "\"bf16\"",
    "\"x\"",
    "[1, 2]",
];

/// Runs `case`, turning a panic into a failure that names `what`.
fn no_panic(what: &str, case: impl FnOnce()) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(case)) {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!("{what} panicked: {message}");
    }
}

#[test]
fn random_trainer_configs_are_accepted_or_refused_never_panic() {
    let top = [
        "steps",
        "batch_size",
        "seq_len",
        "grad_accum",
        "lr",
        "warmup_steps",
        "weight_decay",
        "bucket_mb",
        "eval_batches",
        "sample_len",
        "max_grad_norm",
        "precision",
        "reduce_fp32",
        "learning_rate",
    ];
    let model = [
        "vocab_size",
        "n_layers",
        "n_heads",
        "d_model",
        "d_ff",
        "max_seq_len",
        "dropout",
        "rope_theta",
        "norm_eps",
        "seed",
        "tied_embeddings",
        "bias",
        "d_modle",
    ];
    let mut rng = Rng(0x5EED_0001);
    let mut parsed = 0;
    for case in 0..3000 {
        let mut text = String::new();
        for _ in 0..rng.below(5) {
            text += &format!("{} = {}\n", rng.pick(&top), rng.pick(&VALUES));
        }
        // Half the cases give a model: its required keys (random sizes), then random ones.
        if rng.below(2) == 0 {
            text += "[model]\n";
            let sizes = [
                "1",
                "2",
                "4",
                "8",
                "16",
                "256",
                "0",
                "4294967296",
                "9223372036854775807",
            ];
            for key in [
                "vocab_size",
                "n_layers",
                "n_heads",
                "d_model",
                "d_ff",
                "max_seq_len",
            ] {
                text += &format!("{key} = {}\n", rng.pick(&sizes));
            }
            for _ in 0..rng.below(3) {
                text += &format!("{} = {}\n", rng.pick(&model), rng.pick(&VALUES));
            }
        }
        let what = format!("config case {case}:\n{text}");
        no_panic(&what, || {
            let Ok(config) = TrainConfig::from_toml(&text) else {
                return;
            };
            parsed += 1;
            for ranks in 1..=8 {
                let _ = config.validate(ranks);
                let layout = Layout {
                    tp: 1 + ranks % 2,
                    ..Layout::default()
                };
                if config.validate_layout(&layout, ranks).is_ok() {
                    let _ = config.check_memory(&layout, ranks, ranks);
                    let _ = config.lr_at(config.steps.saturating_sub(1));
                }
            }
        });
    }
    assert!(
        parsed > 300,
        "the generator reaches the validation ({parsed} parsed)"
    );
}

#[test]
fn random_layouts_are_accepted_or_refused_never_panic() {
    let keys = [
        "tp",
        "sp",
        "cp",
        "cp_kind",
        "cp_balance",
        "pp",
        "ep",
        "zero",
        "replicate",
        "prefetch",
        "no_sync",
        "overlap",
        "offload",
        "pipeline.schedule",
        "pipeline.virtual_stages",
        "pipeline.recompute",
    ];
    let words = [
        "\"ring\"",
        "\"ulysses\"",
        "\"none\"",
        "\"head-tail\"",
        "false",
        "\"zbv\"",
        "\"interleaved\"",
        "\"stages\"",
        "\"blocks\"",
    ];
    let mut rng = Rng(0x5EED_0002);
    for case in 0..3000 {
        let mut text = String::new();
        for _ in 0..rng.below(6) {
            let value = match rng.below(3) {
                0 => *rng.pick(&words),
                _ => *rng.pick(&VALUES),
            };
            text += &format!("{} = {value}\n", rng.pick(&keys));
        }
        let sizes = [0usize, 1, 2, 3, 4, 6, 8, 16, usize::MAX];
        let work = Workload {
            n_heads: *rng.pick(&sizes),
            n_experts: *rng.pick(&[None, Some(0), Some(2), Some(8), Some(usize::MAX)]),
            dropout: rng.below(2) == 0,
            seq_len: *rng.pick(&sizes),
            batch_size: *rng.pick(&sizes),
            grad_accum: *rng.pick(&sizes),
            mixed_precision: rng.below(2) == 0,
            loss_scaling: rng.below(2) == 0,
        };
        let world = *rng.pick(&sizes);
        no_panic(
            &format!("layout case {case} on {world} ranks, {work:?}:\n{text}"),
            || {
                if let Ok(layout) = Layout::from_toml(&text)
                    && layout.validate(world, &work).is_ok()
                {
                    let _ = layout.dims(world);
                }
            },
        );
    }
}

/// A small checkpoint of two tensors on one rank, in `dir`.
fn save_small(dir: &std::path::Path) -> std::path::PathBuf {
    let world = burn_parallel::local_world(1).remove(0);
    let mut saver = Checkpointer::new(dir, 1, &world).unwrap();
    let a = TensorData::new((0..12).map(|i| i as f32).collect::<Vec<_>>(), [4, 3]);
    let pieces = vec![
        Piece::whole("a", a).unwrap(),
        Piece::whole("b", TensorData::new(vec![1.5f32; 5], [5])).unwrap(),
    ];
    let state = serde_json::json!({"losses": [1.0]});
    saver
        .save(1, pieces, state, serde_json::Value::Null)
        .unwrap();
    Checkpointer::latest(dir)
        .unwrap()
        .unwrap()
        .dir()
        .to_path_buf()
}

/// Opens `dir` and reads every tensor: any outcome but a panic.
fn open_and_read(dir: &std::path::Path) {
    if let Ok(checkpoint) = Checkpoint::open(dir) {
        for name in ["a", "b"] {
            let _ = checkpoint.read_full(name);
        }
    }
}

/// `bytes` with `edits` random damages: flipped bytes, cut, an edge value pasted in.
fn damage(rng: &mut Rng, bytes: &[u8], edits: usize) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for _ in 0..edits {
        if out.is_empty() {
            break;
        }
        let at = rng.below(out.len());
        match rng.below(4) {
            0 => out[at] ^= 1 << rng.below(8),
            1 => out.truncate(at),
            2 => {
                let value = rng.pick(&VALUES).as_bytes().to_vec();
                let end = (at + value.len()).min(out.len());
                out.splice(at..end, value);
            }
            _ => out[at] = rng.next() as u8,
        }
    }
    out
}

#[test]
fn damaged_checkpoints_are_refused_never_panic() {
    let root = std::env::temp_dir().join(format!("fuzz-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = save_small(&root);
    let manifest = dir.join("manifest.json");
    let rank = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .expect("a rank file");
    let (manifest_bytes, rank_bytes) = (
        std::fs::read(&manifest).unwrap(),
        std::fs::read(&rank).unwrap(),
    );
    let mut rng = Rng(0x5EED_0003);
    for (file, original) in [(&manifest, &manifest_bytes), (&rank, &rank_bytes)] {
        for case in 0..400 {
            let edits = 1 + rng.below(4);
            let mut damaged = damage(&mut rng, original, edits);
            // Half the damaged manifests that still parse are sealed again, as a tool that
            // rewrites manifests would: the checks behind the seal see them too.
            if file == &manifest && case % 2 == 0 {
                type Manifest = burn_parallel::checkpoint::Manifest;
                if let Ok(parsed) = serde_json::from_slice::<Manifest>(&damaged) {
                    damaged = parsed.sealed_json();
                }
            }
            std::fs::write(file, &damaged).unwrap();
            no_panic(&format!("{} case {case}", file.display()), || {
                open_and_read(&dir)
            });
        }
        std::fs::write(file, original).unwrap();
    }
    // Safetensors files read whole (Hugging Face's).
    let hf = root.join("model.safetensors");
    for case in 0..400 {
        let edits = 1 + rng.below(4);
        std::fs::write(&hf, damage(&mut rng, &rank_bytes, edits)).unwrap();
        no_panic(&format!("safetensors case {case}"), || {
            let _ = burn_parallel::checkpoint::hf::read_safetensors(&hf);
        });
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Command-line values at the edges, for flags of any type.
const ARGS: [&str; 24] = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "-1",
    "0.5",
    "1e308",
    "nan",
    "inf",
    "18446744073709551615",
    "9223372036854775807",
    "4294967296",
    "x",
    "",
    "ring",
    "ulysses",
    "none",
    "bf16",
    "fp16",
    "swiglu",
    "rotary",
    "zbv",
];

/// A command line of `flags` (with a value, from [`ARGS`]) and `switches` (without), at most
/// `most` of them, each picked at random.
fn command_line(rng: &mut Rng, flags: &[&str], switches: &[&str], most: usize) -> Vec<String> {
    let mut line = vec!["bin".to_string()];
    for _ in 0..rng.below(most + 1) {
        match rng.below(4) {
            0 => line.push(rng.pick(switches).to_string()),
            _ => {
                line.push(rng.pick(flags).to_string());
                line.push(rng.pick(&ARGS).to_string());
            }
        }
    }
    line
}

#[test]
fn random_gpt_command_lines_are_accepted_or_refused_never_panic() {
    use clap::Parser;
    use examples::cli::GptArgs;
    use examples::train_diloco::validate_diloco;
    let flags = [
        "--ranks",
        "--steps",
        "--batch-size",
        "--seq-len",
        "--grad-accum",
        "--lr",
        "--layers",
        "--heads",
        "--d-model",
        "--d-ff",
        "--seed",
        "--bucket-mb",
        "--clip",
        "--tp",
        "--cp",
        "--cp-kind",
        "--cp-balance",
        "--pp",
        "--ep",
        "--zero",
        "--hybrid",
        "--precision",
        "--loss-scale",
        "--loss-scale-window",
        "--mlp",
        "--positions",
        "--schedule",
        "--microbatches",
        "--virtual-stages",
        "--moe-experts",
        "--top-k",
        "--moe-every",
        "--expert-d-ff",
        "--capacity-factor",
        "--aux-loss",
        "--z-loss",
        "--bias-rate",
        "--diloco-islands",
        "--inner-steps",
        "--outer-lr",
        "--outer-momentum",
        "--threads",
    ];
    let switches = [
        "--sp",
        "--tied",
        "--prefetch",
        "--no-sync",
        "--overlap",
        "--offload",
        "--unfused",
        "--reduce-fp32",
        "--dropless",
        "--bias-balancing",
        "--balance-params",
        "--checkpoint-activations",
    ];
    let mut rng = Rng(0x5EED_0004);
    let (mut parsed, mut accepted) = (0, 0);
    for case in 0..3000 {
        let line = command_line(&mut rng, &flags, &switches, 6);
        no_panic(&format!("gpt case {case}: {line:?}"), || {
            let Ok(args) = GptArgs::try_parse_from(&line) else {
                return;
            };
            parsed += 1;
            // What `gpt` checks before it loads data: the settings, the layout, the memory,
            // and DiLoCo's rules when it is asked for.
            if let Ok((config, layout)) = args.checked(args.ranks) {
                accepted += 1;
                if let Some(run) = args.diloco.layout() {
                    let _ = validate_diloco(&config, &run, &layout, args.ranks);
                }
            }
        });
    }
    // The generator reaches past clap, and some command lines train.
    assert!(
        parsed > 300 && accepted > 30,
        "{parsed} parsed, {accepted} accepted"
    );
}

#[test]
fn random_plan_command_lines_are_planned_or_refused_never_panic() {
    use clap::Parser;
    use examples::cli::PlanArgs;
    let flags = [
        "--layers",
        "--d-model",
        "--heads",
        "--kv-heads",
        "--d-ff",
        "--vocab",
        "--seq-len",
        "--moe-experts",
        "--top-k",
        "--expert-d-ff",
        "--moe-every",
        "--world",
        "--memory-gib",
        "--batch",
        "--micro-batch",
        "--tflops",
        "--link-gbps",
    ];
    let switches = [
        "--swiglu",
        "--rotary",
        "--rmsnorm",
        "--no-bias",
        "--tied",
        "--fp32",
    ];
    let mut rng = Rng(0x5EED_0005);
    let (mut planned, start) = (0, std::time::Instant::now());
    for case in 0..1000 {
        let line = command_line(&mut rng, &flags, &switches, 5);
        no_panic(&format!("plan case {case}: {line:?}"), || {
            let Ok(args) = PlanArgs::try_parse_from(&line) else {
                return;
            };
            if let Ok((shape, training, hw)) = args.inputs()
                && burn_parallel::planner::plan(&shape, &training, &hw).is_ok()
            {
                planned += 1;
            }
        });
    }
    assert!(planned > 100, "{planned} planned");
    // The absurd sizes are refused by name at once (before, each ran for minutes).
    for (line, field) in [
        ("--world 4000000000", "world"),
        ("--world 720720", "world"),
        ("--layers 4000000", "layers"),
        ("--seq-len 100000000000", "position_table"),
        ("--seq-len 100000000000 --rotary", "seq_len"),
        ("--vocab 18446744073709551615", "vocab"),
    ] {
        let args =
            PlanArgs::try_parse_from(std::iter::once("plan").chain(line.split(' '))).unwrap();
        let (shape, training, hw) = args.inputs().unwrap();
        let err = burn_parallel::planner::plan(&shape, &training, &hw)
            .expect_err(line)
            .to_string();
        assert!(err.contains(field), "{line}: {err}");
    }
    assert!(start.elapsed().as_secs() < 60, "{:?}", start.elapsed());
}
