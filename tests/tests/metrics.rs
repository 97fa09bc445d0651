//! The trainers' `--metrics` and `--plot`: a short `gpt` run writes one JSON line per step
//! (the losses of `--losses-out`), its validation loss after the last step and an SVG chart
//! of both panels; a `vit` run its test accuracies and images/s; `plot::draw_file` draws the
//! file again.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_parallel_train::metrics::Metrics;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bp-metrics-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `command`, panicking with its output when it fails.
fn run(command: &mut Command) {
    let out = command.output().expect("starting the binary");
    assert!(
        out.status.success(),
        "{command:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The SVG at `path`, checked for the parts every chart has.
fn chart(path: &Path) -> String {
    let svg = std::fs::read_to_string(path).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("<polyline"), "no line in {}", path.display());
    for text in ["step", "loss", "train loss", "throughput"] {
        let text = format!("\n{text}\n");
        assert!(
            svg.contains(&text),
            "{text} missing from {}",
            path.display()
        );
    }
    svg
}

#[test]
fn a_gpt_run_writes_its_metrics_and_chart() {
    const STEPS: usize = 20;
    let dir = scratch("gpt");
    let config = dir.join("run.toml");
    let run_config = tests::tiny_gpt_run(STEPS);
    std::fs::write(&config, toml::to_string(&run_config).unwrap()).unwrap();
    let (metrics, plot, losses) = (dir.join("m.jsonl"), dir.join("c.svg"), dir.join("l.json"));
    run(Command::new(tests::workspace_binary("examples", "gpt"))
        .args(["--ranks", "2", "--config"])
        .arg(&config)
        .arg("--metrics")
        .arg(&metrics)
        .arg("--plot")
        .arg(&plot)
        .arg("--losses-out")
        .arg(&losses));
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert_eq!(
        text.lines().count(),
        1 + STEPS + 1,
        "run, steps, val_loss:\n{text}"
    );
    let m = Metrics::read(&metrics).unwrap();
    let steps: Vec<usize> = m.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, (0..STEPS).collect::<Vec<_>>());
    let expected: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(&losses).unwrap()).unwrap();
    let written: Vec<f64> = m.steps.iter().map(|s| s.loss).collect();
    assert_eq!(written, expected, "the losses of --losses-out");
    assert_eq!(m.unit, "tok");
    assert!(
        m.steps
            .iter()
            .all(|s| s.throughput > 0.0 && s.tflops.is_some())
    );
    let val = m.eval_series("val_loss");
    assert!(
        val.len() == 1 && val[0].0 == STEPS - 1 && val[0].1.is_finite(),
        "{val:?}"
    );
    let svg = chart(&plot);
    assert!(svg.contains("val_loss") && svg.contains("tokens/s"));
    // On demand, from the file: the same chart.
    let again = dir.join("again.svg");
    burn_parallel_train::plot::draw_file(&metrics, &again).unwrap();
    assert_eq!(std::fs::read_to_string(&again).unwrap(), svg);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_vit_run_records_its_test_accuracy() {
    let dir = scratch("vit");
    let (metrics, plot) = (dir.join("m.jsonl"), dir.join("c.svg"));
    run(Command::new(tests::workspace_binary("examples", "vit"))
        .args(["--ranks", "1", "--steps", "10", "--eval-every", "5"])
        .arg("--metrics")
        .arg(&metrics)
        .arg("--plot")
        .arg(&plot));
    let m = Metrics::read(&metrics).unwrap();
    assert_eq!((m.steps.len(), m.unit.as_str()), (10, "img"));
    let accuracy = m.eval_series("test_accuracy");
    assert_eq!(accuracy.first().map(|a| a.0), Some(4), "{accuracy:?}");
    assert_eq!(accuracy.last().map(|a| a.0), Some(9), "{accuracy:?}");
    let svg = chart(&plot);
    assert!(svg.contains("images/s") && svg.contains("test_accuracy"));
    std::fs::remove_dir_all(&dir).unwrap();
}
