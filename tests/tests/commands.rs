//! The commands the documentation prints run as a user copies them: the `byo_model`, `gpt` and
//! `vit` commands of their headers (`--help` texts) and of the README that run on this
//! machine's threads, shortened to a few steps, in order (a `--resume` reads what an earlier
//! `--save` wrote), with their `/tmp/` paths moved into a scratch folder. Before this test, the
//! documented MoE commands of `byo_model` failed at once and `--all --ranks 4` panicked, and
//! nothing noticed.

use std::path::Path;

/// `steps` of a documented command, shortened (save at 50, resume to 100: 2 then 4).
fn shortened(steps: usize) -> usize {
    (steps / 25).max(1)
}

/// The documented commands of `binary`: the lines of `texts` that start with one of
/// `prefixes`, without the prefix and any trailing shell comment.
fn commands<'a>(texts: &[&'a str], prefixes: &[&str]) -> Vec<&'a str> {
    texts
        .iter()
        .flat_map(|text| text.lines())
        .map(|l| l.strip_prefix("//! ").unwrap_or(l))
        .filter_map(|l| {
            prefixes.iter().find_map(|p| match l.strip_prefix(p) {
                Some(rest) => Some(rest.strip_prefix("-- ").unwrap_or(rest)),
                None => (l.trim_end() == p.trim_end()).then_some(""),
            })
        })
        .map(|l| l.split(" #").next().unwrap_or(l).trim())
        .collect()
}

/// Runs `exe` with each of `lines` (adjusted by `adjust`) in `scratch`; returns the failures.
fn run_all(
    exe: &Path,
    lines: &[&str],
    scratch: &Path,
    adjust: &dyn Fn(&mut Vec<String>),
) -> Vec<String> {
    let mut failures = Vec::new();
    for line in lines {
        // A synopsis's optional parts (`[--flag value]`) are run too.
        let mut args: Vec<String> = line
            .replace(['[', ']'], "")
            .replace("/tmp/", &format!("{}/", scratch.display()))
            .split_whitespace()
            .map(str::to_string)
            .collect();
        adjust(&mut args);
        let output = std::process::Command::new(exe)
            .args(&args)
            .current_dir(scratch)
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

const README: &str = include_str!("../../README.md");

#[test]
fn byo_model_documented_commands_run() {
    let header = include_str!("../../examples/examples/byo_model/main.rs");
    let lines = commands(
        &[header, README],
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

/// `gpt`: 4 steps, a checkpoint every 4 when the command saves, one validation batch and no
/// sample (a config file of the test's; the commands that name their own are left out, as
/// are those for `burnrun` and CUDA).
#[test]
fn gpt_documented_commands_run() {
    let header = include_str!("../../examples/src/bin/gpt.rs");
    let lines: Vec<&str> = commands(
        &[header, README],
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
    let lines = commands(
        &[header, README],
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
