//! A run's metrics as JSON lines: [`MetricsWriter`] appends one [`Record`] per line (rank 0,
//! each line written whole and at once, so a killed run loses at most the line being written),
//! and [`Metrics::read`] parses a file back into its series, for a chart ([`crate::plot`], the
//! `plot` feature) or any other tool (`jq`, pandas' `read_json(lines=True)`).
//!
//! # The format (version 1)
//!
//! Every line is one JSON object with `"v": 1` and a `"kind"`:
//!
//! - `"run"`: written when a run opens the file: `"unit"`, what the throughput counts (`"tok"`
//!   for tokens, `"img"` for images);
//! - `"step"`: after each optimizer step: `"step"` (from 0), `"loss"` (the global batch's),
//!   `"lr"`, `"throughput"` (units of the global batch per second), `"elapsed_s"` (since the
//!   run started) and, where known, `"tflops"` (the model's TFLOP/s), `"mfu"` (a fraction),
//!   `"rss_bytes"` (the process's resident memory), `"grad_norm"` (before clipping),
//!   `"skipped"` (`true`: a loss-scaling overflow skipped the update);
//! - `"eval"`: an evaluation: `"step"` (the step it follows), `"name"` (`"val_loss"`,
//!   `"test_accuracy"`, ...) and `"value"`.
//!
//! ```text
//! {"v":1,"kind":"run","unit":"tok"}
//! {"v":1,"kind":"step","step":0,"loss":5.61,"lr":3e-5,"throughput":9120.5,"elapsed_s":0.4}
//! {"v":1,"kind":"eval","step":599,"name":"val_loss","value":1.93}
//! ```
//!
//! A run appends to its file. Where a step record does not come after the one before it (a
//! resumed run continuing the file from its checkpoint's step, or a new run from step 0), the
//! reader keeps the newer records: those of that step and after it that came before are
//! dropped, so the series is always the latest run's curve. A non-finite loss or value is
//! written as `null` and read back as NaN.
//!
//! ```
//! use burn_parallel_train::metrics::{Metrics, MetricsWriter, Record, StepRecord};
//!
//! let path = std::env::temp_dir().join(format!("metrics-doc-{}.jsonl", std::process::id()));
//! let mut writer = MetricsWriter::create(&path, "tok")?;
//! for step in 0..3 {
//!     let record = StepRecord::new(step, 4.0 - step as f64, 1e-3, 1000.0, 0.1 * step as f64);
//!     writer.write(&Record::Step(record))?;
//! }
//! writer.write(&Record::eval(2, "val_loss", 2.5))?;
//! let metrics = Metrics::read(&path)?;
//! assert_eq!(metrics.steps.len(), 3);
//! assert_eq!(metrics.eval_series("val_loss"), vec![(2, 2.5)]);
//! # std::fs::remove_file(&path).unwrap();
//! # Ok::<(), burn_parallel_train::metrics::MetricsError>(())
//! ```

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::fit::StepLog;

/// The version of the format this crate writes and reads (each line's `"v"`).
pub const VERSION: u32 = 1;

/// Why a metrics file cannot be written, read or drawn.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The file cannot be opened, read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Line `line` (from 1) is not a record of this format: not JSON, a missing field, an
    /// unknown kind. Only the last line may be incomplete (a killed run's); the reader drops
    /// it.
    #[error("{}line {line}: {reason}", at(path))]
    Corrupt {
        /// The file (`None`: text parsed with [`Metrics::parse`]).
        path: Option<PathBuf>,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Line `line` is of another version of the format than [`VERSION`].
    #[error(
        "{}line {line}: metrics format version {found}, this reader knows version {VERSION}",
        at(path)
    )]
    Version {
        /// The file (`None`: text parsed with [`Metrics::parse`]).
        path: Option<PathBuf>,
        /// The line, from 1.
        line: usize,
        /// Its version.
        found: u64,
    },
    /// The metrics hold nothing to draw, or the chart cannot be drawn.
    #[error("{}{reason}", at(path))]
    Plot {
        /// The chart (`None`: drawn into a string).
        path: Option<PathBuf>,
        /// Why.
        reason: String,
    },
}

/// `"PATH: "`, or nothing.
fn at(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map_or(String::new(), |p| format!("{}: ", p.display()))
}

/// One line of a metrics file (its `"kind"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// A run opened the file.
    Run(RunRecord),
    /// An optimizer step.
    Step(StepRecord),
    /// An evaluation.
    Eval(EvalRecord),
}

impl Record {
    /// The evaluation `name` = `value` after step `step`.
    pub fn eval(step: usize, name: impl Into<String>, value: f64) -> Self {
        Self::Eval(EvalRecord {
            step,
            name: name.into(),
            value,
        })
    }
}

/// A run's opening line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// What the throughput counts: `"tok"` (tokens), `"img"` (images).
    pub unit: String,
}

/// One optimizer step's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// The step (from 0).
    pub step: usize,
    /// The loss over the global batch (NaN written as `null`).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// The learning rate.
    pub lr: f64,
    /// Units of the global batch (the run's `unit`) per second.
    pub throughput: f64,
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// The model's TFLOP/s over all devices, where its FLOPs per unit are known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tflops: Option<f64>,
    /// Model FLOPs utilisation (a fraction), where the devices' peak is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// The process's resident memory in bytes (Linux).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    /// The global gradient norm before clipping, where the engine measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// A loss-scaling overflow skipped the update.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

impl StepRecord {
    /// Step `step`'s loss, rate, throughput and elapsed seconds, nothing else known.
    pub fn new(step: usize, loss: f64, lr: f64, throughput: f64, elapsed_s: f64) -> Self {
        Self {
            step,
            loss,
            lr,
            throughput,
            elapsed_s,
            tflops: None,
            mfu: None,
            rss_bytes: None,
            grad_norm: None,
            skipped: false,
        }
    }

    /// The record of [`crate::fit()`]'s `log`, `elapsed_s` seconds into the run (its gradient
    /// norm and skip included).
    pub fn of(log: &StepLog, elapsed_s: f64) -> Self {
        Self {
            grad_norm: log.grad_norm,
            skipped: log.skipped,
            ..Self::new(
                log.step,
                f64::from(log.loss),
                log.lr,
                log.tokens_per_sec,
                elapsed_s,
            )
        }
    }
}

/// An evaluation after a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// The step it follows (from 0).
    pub step: usize,
    /// What was measured: `"val_loss"`, `"test_accuracy"`, ...
    pub name: String,
    /// Its value (NaN written as `null`).
    #[serde(deserialize_with = "nan_if_null")]
    pub value: f64,
}

/// A number, or `null` (how `serde_json` writes a NaN or an infinity) as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Appends [`Record`]s to a metrics file, one line each, each written with one `write` call
/// (nothing buffered: a crash loses at most the line being written).
#[derive(Debug)]
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
}

impl MetricsWriter {
    /// Opens `path` for appending (creating it and its directory where missing) and writes a
    /// [`RunRecord`] with `unit`. An incomplete last line (a killed run's) is cut off first.
    ///
    /// # Errors
    /// [`MetricsError::Io`] naming `path`.
    pub fn create(path: impl AsRef<Path>, unit: &str) -> Result<Self, MetricsError> {
        let mut writer = Self::open(path)?;
        writer.write(&Record::Run(RunRecord { unit: unit.into() }))?;
        Ok(writer)
    }

    /// [`MetricsWriter::create`] without the [`RunRecord`] (for a caller that writes it
    /// later).
    ///
    /// # Errors
    /// [`MetricsError::Io`] naming `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, MetricsError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| MetricsError::Io {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(io)?;
        let whole = whole_lines(&mut file).map_err(io)?;
        file.set_len(whole).map_err(io)?;
        Ok(Self { file, path })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `record` as one line.
    ///
    /// # Errors
    /// [`MetricsError::Io`] naming the file.
    pub fn write(&mut self, record: &Record) -> Result<(), MetricsError> {
        // `"v"` first, then `"kind"` and the fields in their order.
        let json = serde_json::to_string(record).expect("a record is JSON");
        let mut line = format!("{{\"v\":{VERSION},{}", &json[1..]);
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|source| MetricsError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// The length of `file` up to and including its last newline.
fn whole_lines(file: &mut File) -> std::io::Result<u64> {
    let mut end = file.seek(SeekFrom::End(0))?;
    let mut chunk = [0u8; 4096];
    while end > 0 {
        let start = end.saturating_sub(chunk.len() as u64);
        let chunk = &mut chunk[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// The series of a metrics file: the latest run's steps and evaluations, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// What the throughput counts (the last [`RunRecord`]'s; `"tok"` without one).
    pub unit: String,
    /// The step records.
    pub steps: Vec<StepRecord>,
    /// The evaluations.
    pub evals: Vec<EvalRecord>,
    /// The last line was incomplete (a killed run's) and was dropped.
    pub truncated: bool,
}

impl Metrics {
    /// No records, throughput in tokens.
    pub fn new() -> Self {
        Self {
            unit: "tok".into(),
            ..Self::default()
        }
    }

    /// Adds `record`. A step record at or before the last step drops the records of its step
    /// and after (a resumed or new run continuing the file).
    pub fn push(&mut self, record: Record) {
        match record {
            Record::Run(run) => self.unit = run.unit,
            Record::Step(step) => {
                if self.steps.last().is_some_and(|last| last.step >= step.step) {
                    self.steps.retain(|s| s.step < step.step);
                    self.evals.retain(|e| e.step < step.step);
                }
                self.steps.push(step);
            }
            Record::Eval(eval) => self.evals.push(eval),
        }
    }

    /// The metrics of the JSON lines `text`. A last line without its newline that does not
    /// parse (a killed run's) is dropped ([`Metrics::truncated`]); empty lines are skipped.
    ///
    /// # Errors
    /// [`MetricsError::Corrupt`] or [`MetricsError::Version`] naming the first bad line.
    ///
    /// ```
    /// use burn_parallel_train::metrics::{Metrics, MetricsError};
    ///
    /// let text = "{\"v\":1,\"kind\":\"step\",\"step\":0,\"loss\":2.0,\"lr\":0.1,\
    ///             \"throughput\":10.0,\"elapsed_s\":1.0}\n{\"v\":1,\"kind\":\"st";
    /// let metrics = Metrics::parse(text)?;
    /// assert_eq!((metrics.steps.len(), metrics.truncated), (1, true));
    /// let err = Metrics::parse("{\"v\":1,\"kind\":\"step\"}\n").unwrap_err();
    /// assert!(matches!(err, MetricsError::Corrupt { line: 1, .. }), "{err}");
    /// # Ok::<(), MetricsError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Self, MetricsError> {
        let mut metrics = Self::new();
        let last = text.lines().count();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match parse_line(line, i + 1) {
                Ok(record) => metrics.push(record),
                Err(_) if i + 1 == last && !text.ends_with('\n') => metrics.truncated = true,
                Err(e) => return Err(e),
            }
        }
        Ok(metrics)
    }

    /// The metrics of the file at `path` ([`Metrics::parse`]).
    ///
    /// # Errors
    /// [`MetricsError::Io`], or the first bad line's error, naming `path`.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, MetricsError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            MetricsError::Corrupt { line, reason, .. } => MetricsError::Corrupt {
                path: Some(path.to_path_buf()),
                line,
                reason,
            },
            MetricsError::Version { line, found, .. } => MetricsError::Version {
                path: Some(path.to_path_buf()),
                line,
                found,
            },
            other => other,
        })
    }

    /// The names of the evaluations, in the order they first appear.
    pub fn eval_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for e in &self.evals {
            if !names.contains(&e.name.as_str()) {
                names.push(&e.name);
            }
        }
        names
    }

    /// `(step, value)` of every evaluation named `name`.
    pub fn eval_series(&self, name: &str) -> Vec<(usize, f64)> {
        let named = self.evals.iter().filter(|e| e.name == name);
        named.map(|e| (e.step, e.value)).collect()
    }
}

/// Line `line`'s record.
fn parse_line(text: &str, line: usize) -> Result<Record, MetricsError> {
    let corrupt = |reason: String| MetricsError::Corrupt {
        path: None,
        line,
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))?;
    match value.get("v").map(serde_json::Value::as_u64) {
        Some(Some(v)) if v == u64::from(VERSION) => {}
        Some(Some(found)) => {
            return Err(MetricsError::Version {
                path: None,
                line,
                found,
            });
        }
        _ => return Err(corrupt("no version (\"v\")".into())),
    }
    Record::deserialize(value).map_err(|e| corrupt(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let path = std::env::temp_dir()
            .join(format!("bp-metrics-{name}-{}", std::process::id()))
            .join("m.jsonl");
        let _ = std::fs::remove_file(&path);
        path
    }

    fn step(step: usize, loss: f64) -> Record {
        Record::Step(StepRecord::new(step, loss, 1e-3, 100.0, step as f64))
    }

    /// Every field, optional ones included, comes back as written; NaN comes back as NaN.
    #[test]
    fn records_round_trip() {
        let path = scratch("round-trip");
        let mut writer = MetricsWriter::create(&path, "img").unwrap();
        let full = StepRecord {
            tflops: Some(1.5),
            mfu: Some(0.25),
            rss_bytes: Some(1 << 30),
            grad_norm: Some(0.5),
            skipped: true,
            ..StepRecord::new(0, 3.0, 1e-3, 512.0, 0.5)
        };
        writer.write(&Record::Step(full.clone())).unwrap();
        writer.write(&step(1, f64::NAN)).unwrap();
        writer
            .write(&Record::eval(1, "test_accuracy", 0.9))
            .unwrap();
        let metrics = Metrics::read(&path).unwrap();
        assert_eq!(metrics.unit, "img");
        assert_eq!(metrics.steps[0], full);
        assert!(metrics.steps[1].loss.is_nan());
        assert_eq!(metrics.eval_names(), ["test_accuracy"]);
        assert_eq!(metrics.eval_series("test_accuracy"), [(1, 0.9)]);
        assert!(!metrics.truncated);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 4);
        assert!(
            text.lines().all(|l| l.starts_with("{\"v\":1,\"kind\":")),
            "{text}"
        );
    }

    /// A killed run's incomplete last line is dropped by the reader and cut off by the next
    /// writer, whose run continuing from step 1 replaces the old steps 1 and after.
    #[test]
    fn a_truncated_line_is_dropped_and_a_resumed_run_continues() {
        let path = scratch("truncated");
        let mut writer = MetricsWriter::create(&path, "tok").unwrap();
        for s in 0..3 {
            writer.write(&step(s, 5.0)).unwrap();
        }
        writer.write(&Record::eval(2, "val_loss", 4.0)).unwrap();
        drop(writer);
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"{\"v\":1,\"kind\":\"step\",\"st").unwrap();
        let metrics = Metrics::read(&path).unwrap();
        assert!(metrics.truncated);
        assert_eq!(metrics.steps.len(), 3);
        let mut writer = MetricsWriter::create(&path, "tok").unwrap();
        for s in 1..4 {
            writer.write(&step(s, 1.0)).unwrap();
        }
        let metrics = Metrics::read(&path).unwrap();
        let curve: Vec<(usize, f64)> = metrics.steps.iter().map(|s| (s.step, s.loss)).collect();
        assert_eq!(curve, [(0, 5.0), (1, 1.0), (2, 1.0), (3, 1.0)]);
        assert!(metrics.evals.is_empty() && !metrics.truncated);
    }

    /// A bad line before the last is an error naming the file and the line; so is another
    /// version, and a record without one.
    #[test]
    fn a_corrupt_file_is_refused_naming_the_line() {
        let good = "{\"v\":1,\"kind\":\"eval\",\"step\":0,\"name\":\"val_loss\",\"value\":1}";
        let path = scratch("corrupt");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, format!("{good}\n\n{{not json\n{good}\n")).unwrap();
        let err = Metrics::read(&path).unwrap_err();
        assert!(
            matches!(err, MetricsError::Corrupt { line: 3, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("m.jsonl: line 3:"), "{err}");
        let other = good.replace("\"v\":1", "\"v\":2");
        let err = Metrics::parse(&format!("{good}\n{other}\n")).unwrap_err();
        assert!(
            matches!(
                err,
                MetricsError::Version {
                    line: 2,
                    found: 2,
                    ..
                }
            ),
            "{err}"
        );
        let err = Metrics::parse("{\"kind\":\"run\",\"unit\":\"tok\"}\n").unwrap_err();
        assert!(err.to_string().contains("line 1: no version"), "{err}");
        let unknown = good.replace("eval", "sample");
        let err = Metrics::parse(&format!("{unknown}\n")).unwrap_err();
        assert!(err.to_string().contains("sample"), "{err}");
        let missing = Metrics::read(path.with_extension("missing")).unwrap_err();
        assert!(matches!(missing, MetricsError::Io { .. }), "{missing}");
    }
}
