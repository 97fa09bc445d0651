//! ZeRO stage 3 (FSDP units) over 2 real processes talking TCP, launched by `burnrun`, gives
//! the losses of single-device training with the same global-norm clipping.

use std::process::Command;

use burn_parallel::run_local;
use examples::data::Corpus;
use examples::train_zero::train_gpt_reference;
use tests::{assert_same_losses, tiny_gpt_run, workspace_binary};

#[test]
fn zero3_over_tcp_processes_matches_single_device() {
    let config = tiny_gpt_run(20);
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let reference = run_local(1, |g| train_gpt_reference(&g, &config, &corpus, Some(0.5)))
        .expect("reference run")
        .remove(0);

    let dir = std::env::temp_dir().join(format!("burn-parallel-zero3-tcp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("run.toml");
    std::fs::write(&config_path, toml::to_string(&config).unwrap()).unwrap();
    let losses_path = dir.join("losses.json");
    let output = Command::new(workspace_binary("burn-parallel", "burnrun"))
        .args(["--nproc-per-node", "2", "--"])
        .arg(workspace_binary("examples", "gpt"))
        .args([
            "--backend",
            "tcp",
            "--zero",
            "3",
            "--clip",
            "0.5",
            "--config",
        ])
        .arg(&config_path)
        .arg("--losses-out")
        .arg(&losses_path)
        .env("BURN_PARALLEL_TIMEOUT_SECS", "60")
        .output()
        .expect("running burnrun");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "burnrun failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    // Both processes report their sharded memory.
    assert!(stdout.contains("[rank 0] [rank 0] zero memory"), "{stdout}");
    assert!(stdout.contains("[rank 1] [rank 1] zero memory"), "{stdout}");
    let tcp: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(&losses_path).unwrap()).unwrap();
    assert_same_losses(&reference, &tcp, 1e-5, "ZeRO-3 over 2 tcp processes");
    std::fs::remove_dir_all(&dir).ok();
}
