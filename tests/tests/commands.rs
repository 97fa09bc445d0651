//! The commands the documentation prints run as a user copies them: every `byo_model` command
//! of its header (`examples/examples/byo_model/main.rs`) and of the README, shortened to a few
//! steps, in order (a `--resume` reads what an earlier `--save` wrote), with their `/tmp/`
//! paths moved into a scratch folder. Before this test, the documented MoE commands failed at
//! once and `--all --ranks 4` panicked, and nothing noticed.

/// `steps` of a documented command, shortened (save at 50, resume to 100: 2 then 4).
fn shortened(steps: usize) -> usize {
    (steps / 25).max(1)
}

#[test]
fn byo_model_documented_commands_run() {
    let header = include_str!("../../examples/examples/byo_model/main.rs");
    let readme = include_str!("../../README.md");
    let command = "cargo run --release -p examples --example byo_model -- ";
    let lines = (header.lines().filter_map(|l| l.strip_prefix("//! ")))
        .chain(readme.lines())
        .filter_map(|l| l.strip_prefix(command))
        // A trailing shell comment is not an argument.
        .map(|l| l.split(" #").next().unwrap_or(l));
    let exe = tests::workspace_binary("examples", "byo_model");
    let scratch = std::env::temp_dir().join(format!("byo-commands-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let mut failures = Vec::new();
    let mut ran = 0;
    for line in lines {
        let mut args: Vec<String> = line
            .replace("/tmp/", &format!("{}/", scratch.display()))
            .split_whitespace()
            .map(str::to_string)
            .collect();
        match args.iter().position(|a| a == "--steps") {
            Some(i) => {
                let steps: usize = args[i + 1].parse().expect("a step count");
                args[i + 1] = shortened(steps).to_string();
            }
            None => args.extend(["--steps".to_string(), "2".to_string()]),
        }
        let output = std::process::Command::new(&exe)
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("running byo_model");
        ran += 1;
        if !output.status.success() {
            failures.push(format!(
                "byo_model {line}\n  (run as {args:?}): {}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    std::fs::remove_dir_all(&scratch).unwrap();
    assert!(ran >= 25, "the documented commands were found ({ran})");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The `gpt` commands of its `--help` header (`examples/src/bin/gpt.rs`) that run on this
/// machine's threads (not those for `burnrun`, CUDA or a config file of the user's), shortened:
/// 4 steps, a checkpoint every 4 when the command saves, one validation batch and no sample.
#[test]
fn gpt_documented_commands_run() {
    let header = include_str!("../../examples/src/bin/gpt.rs");
    let exe = tests::workspace_binary("examples", "gpt");
    let scratch = std::env::temp_dir().join(format!("gpt-commands-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let quick = scratch.join("quick.toml");
    std::fs::write(&quick, "eval_batches = 1\nsample_len = 0\n").unwrap();
    let lines = header
        .lines()
        .filter_map(|l| l.strip_prefix("//! "))
        .filter_map(|l| {
            l.strip_prefix("gpt ")
                .or_else(|| l.strip_prefix("cargo run --release -p examples --bin gpt -- "))
                .or_else(|| {
                    (l.starts_with("cargo run --release -p examples --bin gpt ")).then_some("")
                })
        })
        .map(|l| l.split(" #").next().unwrap_or(l))
        .filter(|l| !l.contains("--config") && !l.contains("cuda"));
    let mut failures = Vec::new();
    let mut ran = 0;
    for line in lines {
        let mut args: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        for (flag, value) in [("--steps", "4"), ("--save-every", "4")] {
            if let Some(i) = args.iter().position(|a| a == flag) {
                args[i + 1] = value.to_string();
            } else if flag == "--steps" {
                args.extend([flag.to_string(), value.to_string()]);
            }
        }
        let output = std::process::Command::new(&exe)
            .args(&args)
            .arg("--config")
            .arg(&quick)
            .current_dir(&scratch)
            .output()
            .expect("running gpt");
        ran += 1;
        if !output.status.success() {
            failures.push(format!(
                "gpt {line}\n  (run as {args:?}): {}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    std::fs::remove_dir_all(&scratch).unwrap();
    assert!(ran >= 8, "the documented commands were found ({ran})");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
