//! The flags of a binary that trains under any layout (the `cli` feature, with `clap`):
//! [`LayoutArgs`] (a [`Layout`]; each flag is the one [`LayoutError`]s name), [`StepArgs`]
//! (precision, clipping, accumulation: the [`StepSettings`]), [`CheckpointArgs`] (saving and
//! resuming: the [`FitConfig`]'s checkpoints), [`MetricsArgs`] (the per-step metrics as JSON
//! lines and a chart of them), [`stop_on_signals`] (the flag a Ctrl-C sets, for
//! [`crate::fit()`]) and [`Progress`] (a bar and a line every N steps with the loss, tokens/s,
//! MFU and memory). Flatten the flags into the binary's own arguments.
//!
//! ```
//! use burn_parallel_train::cli::LayoutArgs;
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Args {
//!     /// Ranks of the run.
//!     #[arg(long, default_value_t = 4)]
//!     ranks: usize,
//!     #[command(flatten)]
//!     layout: LayoutArgs,
//! }
//!
//! let args = Args::parse_from(["train", "--tp", "2", "--sp", "--zero", "3"]);
//! let layout = args.layout.layout().unwrap();
//! assert_eq!(layout.describe(args.ranks), "FSDP 2 x tp 2 + sp");
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use burn_parallel::Error;
use burn_parallel::context_parallel::{CpBalance, CpKind};
use burn_pipeline::ScheduleKind;
use burn_zero::Stage;

use crate::fit::{CheckpointPolicy, FitConfig, LrSchedule};
use crate::layout::{Layout, LayoutError, Optim, PipelineLayout, Recompute};
use crate::metrics::MetricsWriter;
use crate::model::StepSettings;

pub use crate::moe_args::MoeArgs;
pub use crate::plan_args::PlanArgs;
pub use crate::progress::{Progress, moe_lines, profile_lines};

/// The layout flags: `--tp`, `--sp`, `--cp`, `--cp-kind`, `--cp-balance`, `--pp`,
/// `--schedule`, `--virtual-stages`, `--checkpoint-activations`, `--checkpoint-blocks`,
/// `--ep`, `--zero`, `--hybrid`, `--prefetch`, `--no-sync`, `--overlap`, `--offload`.
#[derive(Debug, Clone, clap::Args)]
pub struct LayoutArgs {
    /// Tensor-parallel size: each model is split over this many ranks (Megatron-style); the
    /// ranks form a `dp x tp` mesh with `dp = ranks / tp`.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Sequence parallelism inside each tensor-parallel group (needs --tp 2 or more).
    #[arg(long)]
    pub sp: bool,
    /// Context-parallel size: each sequence is split along its length over this many ranks
    /// (mesh `dp x cp x tp`); the sequence length must divide by 2 cp (by cp with
    /// `--cp-balance none`).
    #[arg(long, default_value_t = 1)]
    pub cp: usize,
    /// How attention crosses the context-parallel ranks: `ring` (K/V blocks rotate) or
    /// `ulysses` (all-to-all to head-sharded; the heads per tensor-parallel rank must divide by
    /// cp).
    #[arg(long, default_value = "ring")]
    pub cp_kind: CpKind,
    /// How each sequence is split over the context-parallel ranks: `headtail` (zigzag: chunks
    /// r and 2cp-1-r, the same causal work on every rank) or `none` (contiguous).
    #[arg(long, default_value = "headtail")]
    pub cp_balance: CpBalance,
    /// Pipeline-parallel size: the model's layers are split into stages over this many ranks
    /// (mesh `pp x dp`, dp = ranks / pp). 1: no pipeline.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// The pipeline schedule (with --pp): gpipe, 1f1b, interleaved, zb-h1, zbv or dualpipev.
    /// Its micro-batches are the step's micro-steps (--grad-accum).
    #[arg(long, default_value = "1f1b")]
    pub schedule: ScheduleKind,
    /// Stages per rank of the interleaved schedule (default 2).
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Recompute each pipeline stage's forward in its backward instead of keeping its
    /// activations (needs a model without dropout).
    #[arg(long, conflicts_with = "checkpoint_blocks")]
    pub checkpoint_activations: bool,
    /// Recompute layer by layer: each keeps only its input, and the backward rebuilds one
    /// layer's graph at a time (needs a model without dropout, and fp32).
    #[arg(long)]
    pub checkpoint_blocks: bool,
    /// Expert-parallel size, carved out of the data-parallel ranks (must divide the experts
    /// and the data-parallel ranks).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// ZeRO stage (1: optimizer state sharded, 2: + gradients, 3: + parameters: FSDP) over the
    /// data-parallel ranks, instead of plain DDP. Composes with --tp, --hybrid and clipping.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub zero: Option<u8>,
    /// Hybrid sharding with --zero: shard inside groups of ranks/N, replicate across N groups.
    #[arg(long, requires = "zero")]
    pub hybrid: Option<usize>,
    /// With --zero 3: all-gather the next unit while one computes (one more gathered unit of
    /// memory).
    #[arg(long, requires = "zero")]
    pub prefetch: bool,
    /// With --zero 3 and accumulation: hold each unit's whole gradient over the micro-steps
    /// and reduce-scatter it once per step.
    #[arg(long, requires = "zero")]
    pub no_sync: bool,
    /// Data parallelism: all-reduce the gradient buckets during the backward, each as its
    /// gradients become final (PyTorch DDP's overlap), instead of after it. Not with --zero.
    #[arg(long = "overlap", conflicts_with = "zero")]
    pub ddp_overlap: bool,
    /// With --zero 1|2: keep the optimizer state and its update in host memory (DeepSpeed's
    /// offload_optimizer), leaving the device the model, its gradients and the compute.
    #[arg(long, requires = "zero")]
    pub offload: bool,
    /// The optimizer: AdamW, or Muon for the hidden matrices (AdamW for embeddings, head,
    /// norms and biases), under any layout.
    #[arg(long, default_value = "adamw")]
    pub optim: Optim,
    /// Survive the loss of a data-parallel replica: the others finish the step and go on, and
    /// a restarted one (by hand, or by `burnrun --max-restarts`) rejoins from a live replica.
    #[arg(long)]
    pub fault_tolerant: bool,
}

impl LayoutArgs {
    /// The layout the flags say (not yet validated: [`Layout::validate`] knows the world and
    /// the model).
    ///
    /// # Errors
    /// A [`LayoutError`] naming `--zero` for a stage other than 1, 2 or 3 (which clap already
    /// refuses on the command line).
    pub fn layout(&self) -> Result<Layout, LayoutError> {
        let zero = self
            .zero
            .map(|s| Stage::from_number(usize::from(s)))
            .transpose()
            .map_err(|e| LayoutError {
                flag: "--zero",
                message: e.to_string(),
            })?;
        Ok(Layout {
            tp: self.tp,
            sp: self.sp,
            cp: self.cp,
            cp_kind: self.cp_kind,
            cp_balance: self.cp_balance,
            pp: self.pp,
            pipeline: PipelineLayout {
                schedule: self.schedule,
                virtual_stages: self.virtual_stages,
                recompute: match (self.checkpoint_activations, self.checkpoint_blocks) {
                    (true, _) => Recompute::Stages,
                    (_, true) => Recompute::Blocks,
                    _ => Recompute::Off,
                },
            },
            ep: self.ep,
            zero,
            replicate: self.hybrid.unwrap_or(1),
            prefetch: self.prefetch,
            no_sync: self.no_sync,
            overlap: self.ddp_overlap,
            offload: self.offload,
            diloco: None,
            optim: self.optim,
            fault_tolerant: self.fault_tolerant,
        })
    }
}

pub use crate::settings::Precision;

/// The step's flags: `--precision`, `--clip`, `--grad-accum`.
#[derive(Debug, Clone, clap::Args)]
pub struct StepArgs {
    /// Arithmetic of the forward and backward (master weights and optimizer state stay fp32).
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub clip: Option<f64>,
    /// Micro-batches per optimizer step: each data-parallel rank's rows split evenly between
    /// them (a pipeline's micro-batches with --pp).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
}

impl StepArgs {
    /// `base` (its optimizer, buckets and batch) with the precision, clipping and accumulation
    /// these flags say.
    pub fn settings(&self, base: StepSettings) -> StepSettings {
        StepSettings {
            precision: self.precision.policy(),
            loss_scaler: self.precision.scaler(),
            max_grad_norm: self.clip,
            grad_accum: self.grad_accum,
            ..base
        }
    }
}

/// The checkpoint flags: `--save`, `--save-every`, `--keep`, `--async-checkpoint`, `--resume`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckpointArgs {
    /// Save checkpoints under this directory (each rank its share): after the last step, on
    /// Ctrl-C, and every --save-every steps. Any layout resumes them.
    #[arg(long, value_name = "DIR", visible_alias = "checkpoint-dir")]
    pub save: Option<PathBuf>,
    /// With --save: every this many steps too (0: only after the last step and on a stop).
    #[arg(long, default_value_t = 0, requires = "save")]
    pub save_every: usize,
    /// With --save: the newest checkpoints kept (older ones are deleted).
    #[arg(
        long,
        default_value_t = 1,
        requires = "save",
        visible_alias = "keep-checkpoints"
    )]
    pub keep: usize,
    /// With --save: write on a background thread while training goes on (the tensors are
    /// first copied to host memory).
    #[arg(long, requires = "save")]
    pub async_checkpoint: bool,
    /// Resume from this checkpoint, or the newest complete one under this directory (saved
    /// under any layout), and train on to the last step.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

impl CheckpointArgs {
    /// The saving these flags ask for (`None` without `--save`).
    pub fn policy(&self) -> Option<CheckpointPolicy> {
        self.save.as_ref().map(|dir| CheckpointPolicy {
            every: self.save_every,
            keep: self.keep,
            background: self.async_checkpoint,
            ..CheckpointPolicy::new(dir)
        })
    }

    /// The loop of `steps` steps at rates `lr`, saving and resuming as these flags say.
    pub fn fit_config(&self, steps: usize, lr: LrSchedule) -> FitConfig {
        FitConfig {
            lr,
            checkpoint: self.policy(),
            resume: self.resume.clone(),
            ..FitConfig::new(steps, lr.peak)
        }
    }
}

/// The metrics flags: `--metrics FILE` (rank 0's per-step figures and evaluations as JSON
/// lines: [`crate::metrics`]) and `--plot FILE` (their chart at the end: [`crate::plot`]).
/// [`MetricsArgs::progress`] makes the [`Progress`] that writes them.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MetricsArgs {
    /// Append rank 0's metrics to this file, one JSON object a line: each step's loss,
    /// learning rate, throughput, TFLOP/s and MFU, memory, gradient norm, and the evaluations
    /// (a resumed run continues the file).
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// At the end, draw the run's loss/validation and throughput chart into this SVG file
    /// (from the --metrics file when given: a resumed run's whole curve). A metrics file of
    /// an earlier run: `burnplot FILE -o CHART.svg`.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

impl MetricsArgs {
    /// [`Progress::new`]`(lead, steps, every)` writing the metrics and drawing the chart these
    /// flags ask for (rank 0: `lead`); its [`Progress::conclude`] draws the chart.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `--metrics` when its file cannot be opened, `--plot` when the
    /// chart's directory cannot be created.
    pub fn progress(&self, lead: bool, steps: usize, every: usize) -> Result<Progress, Error> {
        let progress = Progress::new(lead, steps, every);
        if !lead {
            return Ok(progress);
        }
        let writer = self.metrics.as_ref().map(MetricsWriter::open).transpose();
        let writer = writer.map_err(|e| Error::invalid("--metrics", e))?;
        let dir = self.plot.as_ref().and_then(|p| p.parent());
        if let Some(dir) = dir.filter(|d| !d.as_os_str().is_empty()) {
            let reason = |e| format!("{}: {e}", dir.display());
            std::fs::create_dir_all(dir).map_err(|e| Error::invalid("--plot", reason(e)))?;
        }
        Ok(progress.with_metrics(writer, self.plot.clone()))
    }
}

/// A flag that Ctrl-C (SIGINT) and SIGTERM set, for [`crate::fit()`]'s `stop`: every rank then
/// stops after the same step, saving first. A second signal ends the process at once (exit
/// code 130), for a run that does not reach the end of its step. Where a signal cannot be
/// caught it says so on stderr (the run then stops without saving).
pub fn stop_on_signals() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registered first, so it sees the flag the first signal set.
        let second = signal_hook::flag::register_conditional_shutdown(signal, 130, stop.clone());
        let first = second.and_then(|_| signal_hook::flag::register(signal, Arc::clone(&stop)));
        if let Err(e) = first {
            eprintln!("warning: cannot catch signal {signal} ({e}); Ctrl-C stops without saving");
        }
    }
    stop
}

#[cfg(test)]
mod tests {
    use burn_parallel::precision::MixedPrecision;
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::fit::StepLog;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        layout: LayoutArgs,
    }

    /// Every flag reaches its field, and clap's own checks of the definition pass.
    #[test]
    fn each_flag_sets_its_field() {
        Args::command().debug_assert();
        let args = Args::parse_from([
            "t",
            "--tp",
            "2",
            "--sp",
            "--cp",
            "2",
            "--cp-kind",
            "ulysses",
            "--cp-balance",
            "none",
            "--pp",
            "2",
            "--schedule",
            "zbv",
            "--checkpoint-blocks",
            "--ep",
            "2",
            "--zero",
            "3",
            "--hybrid",
            "2",
            "--prefetch",
            "--no-sync",
        ]);
        let layout = args.layout.layout().unwrap();
        let expected = Layout {
            tp: 2,
            sp: true,
            cp: 2,
            cp_kind: CpKind::Ulysses,
            cp_balance: CpBalance::None,
            pp: 2,
            pipeline: PipelineLayout {
                schedule: ScheduleKind::Zbv,
                virtual_stages: None,
                recompute: Recompute::Blocks,
            },
            ep: 2,
            zero: Some(Stage::Three),
            replicate: 2,
            prefetch: true,
            no_sync: true,
            overlap: false,
            offload: false,
            diloco: None,
            optim: Optim::Adamw,
            fault_tolerant: false,
        };
        assert_eq!(layout, expected);
        let args = Args::parse_from(["t", "--overlap"]);
        assert!(args.layout.layout().unwrap().overlap);
        let args = Args::parse_from(["t", "--zero", "2", "--offload"]);
        assert!(args.layout.layout().unwrap().offload);
        assert!(Args::try_parse_from(["t", "--zero", "2", "--overlap"]).is_err());
        assert!(Args::try_parse_from(["t", "--zero", "4"]).is_err());
        assert!(Args::try_parse_from(["t", "--offload"]).is_err());
    }

    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        step: StepArgs,
        #[command(flatten)]
        checkpoint: CheckpointArgs,
    }

    /// The step's and the checkpoints' flags reach the settings and the loop.
    #[test]
    fn step_and_checkpoint_flags_set_the_run() {
        Run::command().debug_assert();
        let run = Run::parse_from([
            "t",
            "--precision",
            "fp16",
            "--clip",
            "0.5",
            "--grad-accum",
            "4",
            "--save",
            "/tmp/ck",
            "--save-every",
            "10",
            "--resume",
            "/tmp/old",
        ]);
        let settings = run.step.settings(StepSettings::default());
        assert_eq!(settings.precision, MixedPrecision::f16());
        assert!(settings.loss_scaler.is_some());
        assert_eq!(
            (settings.max_grad_norm, settings.grad_accum),
            (Some(0.5), 4)
        );
        let fit = run.checkpoint.fit_config(100, LrSchedule::constant(1e-3));
        let policy = fit.checkpoint.expect("a checkpoint policy");
        assert_eq!((policy.every, policy.keep, fit.steps), (10, 1, 100));
        assert_eq!(fit.resume, Some(PathBuf::from("/tmp/old")));
        assert!(Run::try_parse_from(["t", "--save-every", "10"]).is_err());
    }

    #[derive(Parser)]
    struct Plotted {
        #[command(flatten)]
        metrics: MetricsArgs,
    }

    /// `--metrics` and `--plot`: rank 0 writes a line per step and an evaluation, then draws
    /// the chart from the file; other ranks write nothing.
    #[test]
    fn metrics_flags_write_the_file_and_the_chart() {
        Plotted::command().debug_assert();
        let dir = std::env::temp_dir().join(format!("bp-cli-metrics-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (file, chart) = (dir.join("m.jsonl"), dir.join("charts/c.svg"));
        let args = Plotted::parse_from([
            "t",
            "--metrics",
            file.to_str().unwrap(),
            "--plot",
            chart.to_str().unwrap(),
        ]);
        let other = args.metrics.progress(false, 3, 1).unwrap();
        let progress = args.metrics.progress(true, 3, 1).unwrap().with_unit("img");
        for step in 0..3 {
            let log = StepLog {
                step,
                loss: 2.0,
                lr: 1e-3,
                seconds: 0.1,
                tokens_per_sec: 100.0,
                skipped: false,
                grad_norm: None,
                phases: Default::default(),
            };
            progress.step(&log, &[]);
            other.step(&log, &[]);
        }
        progress.eval(1, "test_accuracy", 0.5);
        other.conclude(&[("val_loss", 9.0)]).unwrap();
        progress.conclude(&[("val_loss", 1.5)]).unwrap();
        let metrics = crate::metrics::Metrics::read(&file).unwrap();
        let steps: Vec<usize> = metrics.steps.iter().map(|s| s.step).collect();
        assert_eq!((steps, metrics.unit.as_str()), (vec![0, 1, 2], "img"));
        assert_eq!(metrics.eval_series("val_loss"), [(2, 1.5)]);
        assert!(metrics.steps[0].rss_bytes.is_some() || !cfg!(target_os = "linux"));
        let svg = std::fs::read_to_string(&chart).unwrap();
        assert!(svg.contains("images/s") && svg.contains("test_accuracy"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
