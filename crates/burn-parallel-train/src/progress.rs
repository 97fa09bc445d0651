//! [`Progress`]: what a training binary shows while [`crate::fit()`] runs (the `cli` feature): a
//! progress bar on rank 0, and every `every` steps a line with the loss, the learning rate,
//! tokens per second, the model's TFLOP/s and MFU (with a peak), the process's resident memory
//! and the elapsed time; with [`Progress::with_metrics`] (a binary's `--metrics` and `--plot`:
//! [`crate::cli::MetricsArgs`]), the same figures as JSON lines ([`crate::metrics`]) and a chart
//! at the end ([`crate::plot`]).
//!
//! ```
//! use burn_parallel::mfu::Mfu;
//! use burn_parallel_train::cli::Progress;
//! use burn_parallel_train::StepLog;
//!
//! let progress = Progress::new(true, 10, 5)
//!     .with_mfu(Mfu { flops_per_token: 6e6, peak_per_device: Some(1e12), devices: 2 });
//! let log = StepLog {
//!     step: 4,
//!     loss: 2.5,
//!     lr: 1e-3,
//!     seconds: 0.5,
//!     tokens_per_sec: 1e4,
//!     skipped: false,
//!     grad_norm: Some(0.7),
//!     phases: Default::default(),
//! };
//! let line = progress.line(&log);
//! assert!(line.contains("loss 2.5000") && line.contains("mfu 3.0%"), "{line}");
//! progress.step(&log, &[]);
//! progress.finish();
//! ```

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use burn_moe::MoeStats;
use burn_parallel::Error;
use burn_parallel::mfu::Mfu;
use burn_parallel::train::StepPhases;
use indicatif::{ProgressBar, ProgressStyle};

use crate::fit::StepLog;
use crate::metrics::{Metrics, MetricsWriter, Record, RunRecord, StepRecord};

/// Rank 0's view of a run: a bar over the steps and a line every `every` steps.
pub struct Progress {
    bar: ProgressBar,
    lead: bool,
    every: usize,
    steps: usize,
    mfu: Option<Mfu>,
    unit: &'static str,
    start: Instant,
    metrics: Option<Mutex<Recorder>>,
}

/// Rank 0's metrics: the file they go to, or (plotting without one) the series kept here, and
/// where the chart goes.
struct Recorder {
    writer: Option<MetricsWriter>,
    series: Option<Metrics>,
    plot: Option<PathBuf>,
    /// The run's opening record is written (on the first step: the unit is known then).
    opened: bool,
    last_step: Option<usize>,
}

impl Recorder {
    /// Writes `record` to the file, keeps it, or both; a file that cannot be written is
    /// dropped with a warning (the run goes on).
    fn record(&mut self, record: Record) {
        if let Some(writer) = &mut self.writer
            && let Err(e) = writer.write(&record)
        {
            eprintln!("warning: metrics no longer written: {e}");
            self.writer = None;
        }
        if let Some(series) = &mut self.series {
            series.push(record);
        }
    }
}

impl Progress {
    /// The progress of a run of `steps` steps on a rank that shows it (`lead`: rank 0) or not,
    /// with a line every `every` steps (and after the last).
    pub fn new(lead: bool, steps: usize, every: usize) -> Self {
        let bar = match lead {
            true => {
                let bar = ProgressBar::new(steps as u64);
                let style = "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}";
                bar.set_style(ProgressStyle::with_template(style).expect("a valid template"));
                bar
            }
            false => ProgressBar::hidden(),
        };
        Self {
            bar,
            lead,
            every: every.max(1),
            steps,
            mfu: None,
            unit: "tok",
            start: Instant::now(),
            metrics: None,
        }
    }

    /// Writes each step's figures to `writer` ([`StepRecord`]s, after a [`RunRecord`] with the
    /// unit), and the evaluations of [`Progress::eval`] and [`Progress::conclude`]; and, with
    /// `plot`, has [`Progress::conclude`] draw the chart of the file (of the steps seen here
    /// without a file) into that SVG file. Nothing on a rank that does not show progress.
    pub fn with_metrics(mut self, writer: Option<MetricsWriter>, plot: Option<PathBuf>) -> Self {
        if self.lead && (writer.is_some() || plot.is_some()) {
            self.metrics = Some(Mutex::new(Recorder {
                series: writer.is_none().then(Metrics::new),
                writer,
                plot,
                opened: false,
                last_step: None,
            }));
        }
        self
    }

    /// Shows the model's TFLOP/s and, with a peak, the MFU on each line.
    pub fn with_mfu(mut self, mfu: Mfu) -> Self {
        self.mfu = Some(mfu);
        self
    }

    /// Names what the throughput counts (`"img"` for images per second; default `"tok"`).
    pub fn with_unit(mut self, unit: &'static str) -> Self {
        self.unit = unit;
        self
    }

    /// The line of `log`: step, loss, learning rate, tokens/s, TFLOP/s and MFU, gradient norm,
    /// resident memory, elapsed seconds.
    pub fn line(&self, log: &StepLog) -> String {
        let mut line = format!(
            "step {:>5}  loss {:.4}  lr {:.2e}  {:>8.0} {}/s",
            log.step, log.loss, log.lr, log.tokens_per_sec, self.unit
        );
        if let Some(mfu) = &self.mfu {
            line += &format!("  {}", mfu.describe(log.tokens_per_sec));
        }
        match (log.skipped, log.grad_norm) {
            (true, _) => line += "  skipped (loss scale overflow)",
            (false, Some(norm)) => line += &format!("  |g| {norm:.3}"),
            (false, None) => {}
        }
        if let Some(bytes) = resident_bytes() {
            line += &format!("  rss {:.2} GB", bytes / 1e9);
        }
        line + &format!("  {:>7.1}s", self.start.elapsed().as_secs_f64())
    }

    /// Advances the bar past `log`'s step and, every `every` steps and after the last, prints
    /// its line and then `extra` lines (rank 0 only).
    pub fn step(&self, log: &StepLog, extra: &[String]) {
        if !self.lead {
            return;
        }
        self.record(log);
        self.bar.set_position(log.step as u64 + 1);
        self.bar.set_message(format!(
            "loss {:.4}  {:.0} {}/s",
            log.loss, log.tokens_per_sec, self.unit
        ));
        if log.step.is_multiple_of(self.every) || log.step + 1 == self.steps {
            self.println(&self.line(log));
            for line in extra {
                self.println(line);
            }
        }
    }

    /// The metrics of `log` (with [`Progress::with_metrics`]).
    fn record(&self, log: &StepLog) {
        let Some(metrics) = &self.metrics else {
            return;
        };
        let mut record = StepRecord::of(log, self.start.elapsed().as_secs_f64());
        if let Some(mfu) = &self.mfu {
            record.tflops = Some(mfu.tflops(log.tokens_per_sec));
            record.mfu = mfu.of(log.tokens_per_sec);
        }
        record.rss_bytes = resident_bytes().map(|b| b as u64);
        let mut recorder = metrics.lock().unwrap_or_else(|e| e.into_inner());
        if !recorder.opened {
            let unit = self.unit.to_string();
            recorder.record(Record::Run(RunRecord { unit }));
            recorder.opened = true;
        }
        recorder.last_step = Some(log.step);
        recorder.record(Record::Step(record));
    }

    /// Records the evaluation `name` = `value` after step `step` (with
    /// [`Progress::with_metrics`], rank 0).
    pub fn eval(&self, step: usize, name: &str, value: f64) {
        if let Some(metrics) = &self.metrics {
            let mut recorder = metrics.lock().unwrap_or_else(|e| e.into_inner());
            recorder.record(Record::eval(step, name, value));
        }
    }

    /// The end of the run (with [`Progress::with_metrics`], rank 0): records `finals`
    /// (`(name, value)`: the final validation loss, ...) as evaluations after the last step
    /// seen, then draws the chart if one was asked for and says where.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `--plot` when the chart cannot be drawn, or the metrics file
    /// cannot be read back.
    pub fn conclude(&self, finals: &[(&str, f64)]) -> Result<(), Error> {
        let Some(metrics) = &self.metrics else {
            return Ok(());
        };
        let mut recorder = metrics.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(step) = recorder.last_step {
            for &(name, value) in finals {
                recorder.record(Record::eval(step, name, value));
            }
        }
        let Some(plot) = recorder.plot.clone() else {
            return Ok(());
        };
        let failed = |e| Error::invalid("--plot", e);
        let (series, title) = match (&recorder.series, &recorder.writer) {
            (Some(series), _) => (series.clone(), "training run".to_string()),
            (None, Some(writer)) => {
                let name = writer.path().file_name().unwrap_or_default();
                let series = Metrics::read(writer.path()).map_err(failed)?;
                (series, name.to_string_lossy().into_owned())
            }
            (None, None) => return Ok(()),
        };
        crate::plot::draw(&series, &title, &plot).map_err(failed)?;
        self.println(&format!("chart of the run written to {}", plot.display()));
        Ok(())
    }

    /// Prints `line` above the bar (rank 0 only), or plainly when the bar is not drawn (output
    /// not a terminal), where the bar would swallow it.
    pub fn println(&self, line: &str) {
        if !self.lead {
            return;
        }
        match self.bar.is_hidden() {
            true => println!("{line}"),
            false => self.bar.println(line),
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The `--profile` table: where the mean step of `step_seconds` went, from `phases` summed over
/// `steps` steps (forward, backward, gradient communication, optimizer, and the rest).
///
/// ```
/// use burn_parallel::train::StepPhases;
/// use burn_parallel_train::cli::profile_lines;
///
/// let phases = StepPhases { forward: 0.2, backward: 0.4, reduce: 0.1, optimizer: 0.1 };
/// let lines = profile_lines(&phases, 0.5, 2);
/// assert!(lines[1].contains("forward") && lines[1].contains("100.0 ms"), "{lines:?}");
/// assert!(lines[5].contains("other") && lines[5].contains("100.0 ms"), "{lines:?}");
/// ```
pub fn profile_lines(phases: &StepPhases, step_seconds: f64, steps: usize) -> Vec<String> {
    let steps = steps.max(1) as f64;
    let step_ms = step_seconds * 1e3;
    let share = |ms: f64| 100.0 * ms / step_ms.max(1e-9);
    let mut lines = vec![format!(
        "profile (rank 0, mean of {steps} steps, the first excluded): {step_ms:.1} ms/step"
    )];
    let rows = [
        ("forward", phases.forward),
        ("backward", phases.backward),
        ("gradient communication", phases.reduce),
        ("optimizer", phases.optimizer),
    ];
    for (name, seconds) in rows {
        let ms = seconds / steps * 1e3;
        lines.push(format!("  {name:<24} {ms:>8.1} ms  {:>5.1}%", share(ms)));
    }
    let other = step_ms - phases.total() / steps * 1e3;
    let name = "other (data, loss sync)";
    lines.push(format!(
        "  {name:<24} {other:>8.1} ms  {:>5.1}%",
        share(other)
    ));
    lines
}

/// One line per MoE layer of a step's routing figures: tokens per expert, drop rate,
/// imbalance, auxiliary losses.
pub fn moe_lines(stats: &[MoeStats]) -> Vec<String> {
    let line = |(i, m): (usize, &MoeStats)| {
        let counts: Vec<String> = m
            .tokens_per_expert()
            .iter()
            .map(|c| format!("{c:.0}"))
            .collect();
        format!(
            "        moe {i}: tokens/expert [{}]  drop {:.2}%  imbalance {:.2}  aux {:.4}  z {:.3}",
            counts.join(" "),
            100.0 * m.drop_rate(),
            m.imbalance(),
            m.aux_loss,
            m.z_loss
        )
    };
    stats.iter().enumerate().map(line).collect()
}

/// The process's resident memory in bytes (Linux: `VmRSS` of `/proc/self/status`); `None`
/// elsewhere.
fn resident_bytes() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}
