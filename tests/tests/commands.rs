//! The commands the documentation prints run as a user copies them: the `byo_model`, `gpt` and
//! `vit` commands of their headers (`--help` texts), of the README and of the book
//! (`book/src/**/*.md`, read when the test runs, so that a new chapter's commands are run too),
//! and those of the benchmarks' headers, the README and the book, that run on this machine's
//! threads, shortened to a few
//! steps, in order (a `--resume` reads what an earlier `--save` wrote), with their `/tmp/` paths
//! and the JSON the benchmarks write moved into a scratch folder. Before this test, the
//! documented MoE commands of `byo_model` failed at once and `--all --ranks 4` panicked, and
//! nothing noticed.

use std::collections::HashSet;
use std::path::Path;

/// `steps` of a documented command, shortened (save at 50, resume to 100: 2 then 4).
fn shortened(steps: usize) -> usize {
    (steps / 25).max(1)
}

/// The documented commands of a program: the lines of `texts` that start with one of
/// `prefixes`, without the prefix and any trailing shell comment. A line that ends in `\`
/// goes on on the next one, as in a shell.
fn commands(texts: &[&str], prefixes: &[&str]) -> Vec<String> {
    let mut lines = Vec::new();
    for text in texts {
        let mut continued = String::new();
        for line in text.lines() {
            let line = line.strip_prefix("//! ").unwrap_or(line);
            match line.strip_suffix('\\') {
                Some(head) => continued.push_str(head),
                None => {
                    continued.push_str(line);
                    lines.push(std::mem::take(&mut continued));
                }
            }
        }
    }
    lines
        .iter()
        .filter_map(|l| {
            prefixes.iter().find_map(|p| match l.strip_prefix(p) {
                Some(rest) => Some(rest.strip_prefix("-- ").unwrap_or(rest)),
                None => (l.trim_end() == p.trim_end()).then_some(""),
            })
        })
        .map(|l| l.split(" #").next().unwrap_or(l).trim().to_string())
        .collect()
}

/// Runs `exe` with each of `lines` (adjusted by `adjust`) in `scratch`, with `CARGO_TARGET_DIR`
/// set to `scratch` (where the benchmarks write their JSON); returns the failures. A command
/// that `adjust` made the same as an earlier one is run once.
fn run_all(
    exe: &Path,
    lines: &[String],
    scratch: &Path,
    adjust: &dyn Fn(&mut Vec<String>),
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut seen = HashSet::new();
    for line in lines {
        // A synopsis's optional parts (`[--flag value]`) are run too.
        let mut args: Vec<String> = line
            .replace(['[', ']'], "")
            .replace("/tmp/", &format!("{}/", scratch.display()))
            .split_whitespace()
            .map(str::to_string)
            .collect();
        adjust(&mut args);
        if !seen.insert(args.clone()) {
            continue;
        }
        let output = std::process::Command::new(exe)
            .args(&args)
            .current_dir(scratch)
            .env("CARGO_TARGET_DIR", scratch)
            .output()
            .expect("running a documented command");
        if !output.status.success() {
            failures.push(format!(
                "{} {line}\n  (run as {args:?}): {}\n{}",
                exe.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    failures
}

/// Sets `flag` to `value` where the command gives it; adds it where `add`.
fn set(args: &mut Vec<String>, flag: &str, value: String, add: bool) {
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value,
        None if add => args.extend([flag.to_string(), value]),
        None => {}
    }
}

/// A scratch folder for one test.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-commands-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The README and every chapter of the book, in path order (the README first): the texts whose
/// commands run here besides the programs' own headers.
fn docs() -> Vec<String> {
    fn chapters(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("the book's sources") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                chapters(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut paths = Vec::new();
    chapters(&root.join("book/src"), &mut paths);
    paths.sort();
    std::iter::once(root.join("README.md"))
        .chain(paths)
        .map(|p| std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// `header` followed by [`docs`].
fn with_docs<'a>(header: &'a str, docs: &'a [String]) -> Vec<&'a str> {
    std::iter::once(header)
        .chain(docs.iter().map(String::as_str))
        .collect()
}

#[test]
fn byo_model_documented_commands_run() {
    let header = include_str!("../../examples/examples/byo_model/main.rs");
    let docs = docs();
    let lines = commands(
        &with_docs(header, &docs),
        &["cargo run --release -p examples --example byo_model -- "],
    );
    assert!(
        lines.len() >= 25,
        "the documented commands were found ({})",
        lines.len()
    );
    let dir = scratch("byo");
    let exe = tests::workspace_binary("examples", "byo_model");
    let failures = run_all(&exe, &lines, &dir, &|args| {
        let steps = args
            .iter()
            .position(|a| a == "--steps")
            .map_or(2, |i| shortened(args[i + 1].parse().expect("a step count")));
        set(args, "--steps", steps.to_string(), true);
    });
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `learner` (burn-train's `Learner` under a layout): 1 epoch, in a scratch directory (the
/// `burnrun` line is `learner.rs`'s multi-process test).
#[test]
fn learner_documented_commands_run() {
    let header = include_str!("../../examples/examples/learner.rs");
    let docs = docs();
    let lines = commands(
        &with_docs(header, &docs),
        &["cargo run --release -p examples --example learner "],
    );
    assert!(
        lines.len() >= 3,
        "the documented commands were found ({})",
        lines.len()
    );
    let dir = scratch("learner");
    let run_dir = dir.join("run").display().to_string();
    let exe = tests::workspace_binary("examples", "learner");
    let failures = run_all(&exe, &lines, &dir, &|args| {
        set(args, "--epochs", "1".into(), true);
        set(args, "--dir", run_dir.clone(), true);
    });
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `gpt`: 4 steps, a checkpoint every 4 when the command saves, one validation batch and no
/// sample (a config file of the test's; the commands that name their own are left out, as
/// are those for `burnrun` and CUDA).
#[test]
fn gpt_documented_commands_run() {
    let header = include_str!("../../examples/src/bin/gpt.rs");
    let docs = docs();
    let lines: Vec<String> = commands(
        &with_docs(header, &docs),
        &["gpt ", "cargo run --release -p examples --bin gpt "],
    )
    .into_iter()
    .filter(|l| !l.contains("--config") && !l.contains("cuda") && !l.contains("--features"))
    .collect();
    assert!(
        lines.len() >= 9,
        "the documented commands were found ({})",
        lines.len()
    );
    let dir = scratch("gpt");
    let quick = dir.join("quick.toml");
    std::fs::write(&quick, "eval_batches = 1\nsample_len = 0\n").unwrap();
    let exe = tests::workspace_binary("examples", "gpt");
    let failures = run_all(&exe, &lines, &dir, &|args| {
        set(args, "--steps", "4".into(), true);
        set(args, "--save-every", "4".into(), false);
        args.extend(["--config".to_string(), quick.display().to_string()]);
    });
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `vit`: 4 steps, a test evaluation every 2 when the command asks for one.
#[test]
fn vit_documented_commands_run() {
    let header = include_str!("../../examples/src/bin/vit.rs");
    let docs = docs();
    let lines = commands(
        &with_docs(header, &docs),
        &["vit ", "cargo run --release -p examples --bin vit "],
    );
    assert!(
        lines.len() >= 6,
        "the documented commands were found ({})",
        lines.len()
    );
    let dir = scratch("vit");
    let exe = tests::workspace_binary("examples", "vit");
    let failures = run_all(&exe, &lines, &dir, &|args| {
        set(args, "--steps", "4".into(), true);
        set(args, "--eval-every", "2".into(), false);
    });
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Adds the switch `flag` where the command does not give it.
fn switch(args: &mut Vec<String>, flag: &str) {
    if !args.iter().any(|a| a == flag) {
        args.push(flag.to_string());
    }
}

/// A benchmark example: its name, its source (whose `//!` header prints its commands), how many
/// commands the header, the README and the book print for it at least, and how the test
/// shortens them.
type Bench = (&'static str, &'static str, usize, fn(&mut Vec<String>));

/// The benchmarks, each shortened with its own flags to a few seconds per command in the dev
/// profile (about 30 s in all on 2 cores).
const BENCHES: [Bench; 10] = [
    (
        "checkpoint_bench",
        include_str!("../../examples/examples/checkpoint_bench.rs"),
        2,
        // A 4 MB checkpoint; the training stall of a d128 GPT over 6 steps.
        |args| {
            set(args, "--mb", "4".into(), true);
            switch(args, "--quick");
        },
    ),
    (
        "cp_bench",
        include_str!("../../examples/examples/cp_bench.rs"),
        2,
        // Sequences of 256 and 512 tokens, a cap of 8 MiB.
        |args| switch(args, "--quick"),
    ),
    (
        "diloco_figures",
        include_str!("../../examples/examples/diloco_figures.rs"),
        4,
        // 2 steps: each island still syncs once, at the end, whatever its inner steps.
        |args| set(args, "--steps", "2".into(), true),
    ),
    (
        "gpt_overlap_bench",
        include_str!("../../examples/examples/gpt_overlap_bench.rs"),
        1,
        // One layer of width 32, 2 x 16 tokens per rank, 2 timed steps, several buckets.
        |args| {
            for (flag, value) in [
                ("--layers", "1"),
                ("--d", "32"),
                ("--heads", "2"),
                ("--seq", "16"),
                ("--batch", "2"),
                ("--steps", "2"),
                ("--bucket-mb", "0.01"),
            ] {
                set(args, flag, value.into(), true);
            }
        },
    ),
    (
        "pipeline_memory",
        include_str!("../../examples/examples/pipeline_memory.rs"),
        1,
        // The synopsis names its positional arguments: 2 stages, 2 micro-batches, 2 layers.
        |args| {
            for a in args.iter_mut() {
                if ["pp", "microbatches", "layers"].contains(&a.as_str()) {
                    *a = "2".into();
                }
            }
        },
    ),
    (
        "plain_burn_gpt",
        include_str!("../../examples/examples/plain_burn_gpt.rs"),
        2,
        |args| set(args, "--steps", "2".into(), true),
    ),
    (
        "planner_check",
        include_str!("../../examples/examples/planner_check.rs"),
        5,
        // 2 layers on 8 x 32 tokens (`--probe` ignores it and is short already).
        |args| switch(args, "--quick"),
    ),
    (
        "tp_bench",
        include_str!("../../examples/examples/tp_bench.rs"),
        3,
        |args| switch(args, "--quick"),
    ),
    (
        "zero_bench",
        include_str!("../../examples/examples/zero_bench.rs"),
        4,
        // A cap of 1 MiB ends the width search after a few widths.
        |args| {
            switch(args, "--quick");
            set(args, "--cap-mib", "1".into(), true);
        },
    ),
    (
        "wrap_memory",
        include_str!("../../examples/examples/wrap_memory/main.rs"),
        3,
        // A decoder of 2 layers of width 64.
        |args| switch(args, "--quick"),
    ),
];

/// The benchmarks: every command of their headers, the README and the book, shortened by their
/// own flags. The commands for a GPU (`--device cuda`) are left out: this machine has none. Lines
/// of the headers that run other programs (`cargo build`, `gpt`) do not start with a
/// benchmark's name and are not taken. `zero_bench`'s commands set `CARGO_TARGET_DIR`, which the
/// test points at its scratch folder as for every benchmark.
#[test]
fn bench_documented_commands_run() {
    let dir = scratch("bench");
    let docs = docs();
    let mut failures = Vec::new();
    for (name, header, at_least, adjust) in BENCHES {
        let spellings = [
            format!("cargo run -p examples --example {name} "),
            format!("cargo run --release -p examples --example {name} "),
            format!(
                "CARGO_TARGET_DIR=/work/target cargo run --release -p examples --example {name} "
            ),
            format!("... --example {name} "),
            format!("target/release/examples/{name} "),
            format!("{name} "),
        ];
        let prefixes: Vec<&str> = spellings.iter().map(String::as_str).collect();
        let lines: Vec<String> = commands(&with_docs(header, &docs), &prefixes)
            .into_iter()
            .filter(|l| !l.contains("cuda"))
            .collect();
        assert!(
            lines.len() >= at_least,
            "{name}: the documented commands were found ({lines:?})"
        );
        let exe = tests::workspace_binary("examples", name);
        failures.extend(run_all(&exe, &lines, &dir, &adjust));
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
