//! [`fit`]: the training loop a user would otherwise write around a built layout.
//!
//! Each step, every data-parallel rank computes its rows of the global batch in `grad_accum`
//! micro-steps ([`MicroBatch`]: the same rows of the global batch whatever the layout), the
//! engine reduces, clips and applies the update, and [`fit`] reports the step
//! ([`StepLog`]). It saves a checkpoint every `every` steps, after the last one and when asked
//! to stop (a flag a Ctrl-C handler sets: the ranks agree on it, so all stop after the same
//! step), and it resumes from the newest checkpoint under a directory, saved under any layout,
//! the model's dropout positions included ([`crate::streams`]). A pipeline layout runs through
//! the same loop: its micro-batches flow through the schedule ([`crate::pipeline`]).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn_parallel::checkpoint::{Checkpoint, CheckpointError, Checkpointer};
use burn_parallel::heartbeat::Heartbeat;
use burn_parallel::train::{SaveState, StepPhases, saved_loss_scaler};
use burn_parallel::{Error, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::build::Built;
use crate::model::ParallelModel;
use crate::saved::saved_state;
use crate::streams::{DROPOUT_CALLS, dropout_calls, restore_dropout};

/// The learning rate of each step: a linear warm-up over `warmup` steps to `peak`, then a
/// cosine decay to `floor · peak` at step `steps`.
///
/// # Example
/// ```
/// use burn_parallel_train::LrSchedule;
///
/// let lr = LrSchedule { peak: 1e-3, warmup: 10, steps: 110, floor: 0.1 };
/// assert_eq!(lr.at(0), 1e-4);
/// assert_eq!(lr.at(9), 1e-3);
/// assert!((lr.at(110) - 1e-4).abs() < 1e-12);
/// assert_eq!(LrSchedule::constant(3e-3).at(1000), 3e-3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The rate after the warm-up.
    pub peak: f64,
    /// Warm-up steps (0: none).
    pub warmup: usize,
    /// The step at which the decay reaches its floor.
    pub steps: usize,
    /// The final rate as a fraction of `peak` (1: no decay).
    pub floor: f64,
}

impl LrSchedule {
    /// `lr` at every step.
    pub fn constant(lr: f64) -> Self {
        Self {
            peak: lr,
            warmup: 0,
            steps: 0,
            floor: 1.0,
        }
    }

    /// Checks the rates: a peak and a floor that train (a NaN, infinite, zero or negative rate
    /// trains nothing, or uphill).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `--lr`.
    ///
    /// ```
    /// use burn_parallel_train::LrSchedule;
    ///
    /// assert!(LrSchedule::constant(1e-3).validate().is_ok());
    /// let err = LrSchedule::constant(f64::NAN).validate().unwrap_err();
    /// assert!(err.to_string().starts_with("--lr:"), "{err}");
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        if !(self.peak.is_finite() && self.peak > 0.0) {
            let reason = format!("the peak learning rate must be above 0, got {}", self.peak);
            return Err(Error::invalid("--lr", reason));
        }
        if !(0.0..=1.0).contains(&self.floor) {
            let reason = format!(
                "the final rate's fraction of the peak must be in [0, 1], got {}",
                self.floor
            );
            return Err(Error::invalid("--lr", reason));
        }
        Ok(())
    }

    /// The rate at `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        if self.floor == 1.0 {
            return self.peak;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.peak * (self.floor + (1.0 - self.floor) * cosine)
    }
}

/// Where and how often [`fit`] saves.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointPolicy {
    /// The directory the checkpoints go under (`DIR/step-00000100/`, ...).
    pub dir: PathBuf,
    /// Save after every `every` steps (0: only after the last step, with `at_end`, and on a
    /// stop).
    pub every: usize,
    /// Save after the last step too.
    pub at_end: bool,
    /// Complete checkpoints kept (older ones are deleted).
    pub keep: usize,
    /// Write on a background thread while training goes on.
    pub background: bool,
}

impl CheckpointPolicy {
    /// Saves under `dir` after the last step and on a stop, keeping the newest 3.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            every: 0,
            at_end: true,
            keep: 3,
            background: false,
        }
    }
}

/// How [`fit`] runs.
#[derive(Debug, Clone, PartialEq)]
pub struct FitConfig {
    /// The step to train up to (a resumed run continues from its checkpoint's step).
    pub steps: usize,
    /// The learning rate of each step.
    pub lr: LrSchedule,
    /// Saving (`None`: never).
    pub checkpoint: Option<CheckpointPolicy>,
    /// Resume from this checkpoint, or from the newest complete one under this directory.
    pub resume: Option<PathBuf>,
    /// Check every `check_replicas_every` steps that the replicas still agree
    /// ([`crate::build::verify_replicas`]; 0: never). Replicas that drift apart (a reduction
    /// that misses a parameter, a rank that steps differently) are then an error naming the
    /// parameter, not a silently wrong model.
    pub check_replicas_every: usize,
}

impl FitConfig {
    /// `steps` steps at the constant rate `lr`, no checkpoints, replicas checked every 100
    /// steps.
    pub fn new(steps: usize, lr: f64) -> Self {
        Self {
            steps,
            lr: LrSchedule::constant(lr),
            checkpoint: None,
            resume: None,
            check_replicas_every: 100,
        }
    }
}

/// The rows of the step's global batch that this rank computes in one micro-step. Micro-step
/// `micro` is the same rows of the global batch whatever the number of data-parallel ranks
/// (each takes its part of them), so what a micro-batch computes as a whole does not depend on
/// the layout. Context-parallel ranks receive the same rows (the model splits the tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatch {
    /// The optimizer step.
    pub step: usize,
    /// The micro-step within it.
    pub micro: usize,
    /// Rows of the global batch.
    pub rows: Range<usize>,
}

/// What [`fit`] reports after each step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLog {
    /// The step just taken (0-based).
    pub step: usize,
    /// Its loss over the global batch.
    pub loss: f32,
    /// Its learning rate.
    pub lr: f64,
    /// Its wall time.
    pub seconds: f64,
    /// Tokens of the global batch per second.
    pub tokens_per_sec: f64,
    /// Whether the update was skipped (a loss-scaling overflow).
    pub skipped: bool,
    /// The global gradient norm before clipping, where the engine measured it.
    pub grad_norm: Option<f64>,
    /// Where the step's time went ([`StepPhases`]).
    pub phases: StepPhases,
}

/// What [`fit`] returns.
pub struct Fitted<P: ParallelModel> {
    /// The layout with the trained model and its engine.
    pub built: Built<P>,
    /// The loss of every step from step 0 (a resumed run's include the saved run's).
    pub losses: Vec<f32>,
    /// The step a resumed run started from (0 otherwise).
    pub first_step: usize,
    /// `Some(step)` when the run stopped on the flag after `step` steps (saved, when a
    /// checkpoint policy is set).
    pub stopped_at: Option<usize>,
    /// The checkpoint a resumed run loaded (the newest complete one under
    /// [`FitConfig::resume`], which may be older than the newest attempted).
    pub resumed_from: Option<Resumed>,
    /// Mean seconds of the steps this run took, its first excluded (a warm-up, or the first
    /// after a resume); 0 when no step was timed.
    pub step_seconds: f64,
    /// Steps whose update a loss-scaling overflow skipped, the resumed run's before its
    /// checkpoint included (when this run scales its loss too).
    pub skipped_steps: usize,
}

impl<P: ParallelModel> Fitted<P> {
    /// Tokens of the global batch per second at [`Self::step_seconds`] (0 when no step was
    /// timed).
    pub fn tokens_per_sec(&self) -> f64 {
        let settings = &self.built.settings;
        match self.step_seconds {
            0.0 => 0.0,
            s => (settings.batch_size * settings.seq_len) as f64 / s,
        }
    }
}

/// The checkpoint a run resumed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    /// Its directory.
    pub dir: PathBuf,
    /// The step it was saved after.
    pub step: usize,
    /// The number of ranks that saved it (any layout loads it).
    pub saved_by: usize,
    /// The layout that saved it, in words ([`crate::Layout::describe`]); `None` for a checkpoint not
    /// saved by [`fit`].
    pub layout: Option<String>,
}

/// The key of each rank's state under which [`fit`] saves the layout.
const LAYOUT_KEY: &str = "layout";

impl Resumed {
    /// What `checkpoint` is, for the line a resume prints.
    pub fn of(checkpoint: &Checkpoint) -> Self {
        let layout = checkpoint.rank_state(0)[LAYOUT_KEY]["description"]
            .as_str()
            .map(str::to_string);
        Self {
            dir: checkpoint.dir().to_path_buf(),
            step: checkpoint.step(),
            saved_by: checkpoint.manifest().world_size,
            layout,
        }
    }
}

impl std::fmt::Display for Resumed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (step {}, saved by {} ranks",
            self.dir.display(),
            self.step,
            self.saved_by
        )?;
        match &self.layout {
            Some(layout) => write!(f, " as {layout})"),
            None => write!(f, ")"),
        }
    }
}

/// The checkpoint at `path`: a checkpoint directory, or the newest complete one under it.
///
/// # Errors
/// [`CheckpointError::Corrupt`] when there is none; I/O errors.
pub fn open_checkpoint(path: &Path) -> Result<Checkpoint, CheckpointError> {
    if path.join("manifest.json").exists() {
        return Checkpoint::open(path);
    }
    Checkpointer::latest(path)?.ok_or_else(|| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        reason: "no complete checkpoint here (no manifest.json in it or in a step-* directory \
                 under it); check the path, or start without resuming"
            .into(),
    })
}

/// What a run saves with its checkpoints besides the parameters and the optimizer state (the
/// loss history, a data position, each rank's random streams), and restores from them.
pub trait RunState<P: ParallelModel> {
    /// The state to save after `losses.len()` steps of `built`.
    fn save(&self, losses: &[f32], built: &Built<P>) -> SaveState;

    /// Checks `checkpoint` against this run and restores the state it saved, before the
    /// engine loads the parameters into `built`.
    ///
    /// # Returns
    /// The losses of the steps before the checkpoint.
    ///
    /// # Errors
    /// A checkpoint this run cannot continue (another model, another batch).
    fn restore(&mut self, checkpoint: &Checkpoint, built: &Built<P>) -> Result<Vec<f32>, Error>;
}

/// A run's settings saved with its checkpoints beside the loss history, and checked on
/// resume: `check(saved, now)` refuses a checkpoint this run cannot continue (another model,
/// another batch), saying what differs. The state is `{"losses": [...], "config": ...}`.
///
/// ```
/// use burn_parallel_train::SavedConfig;
///
/// #[derive(serde::Serialize, serde::Deserialize, PartialEq)]
/// struct Run { width: usize, steps: usize }
///
/// let now = Run { width: 64, steps: 100 };
/// let state = SavedConfig::new(&now, |saved: &Run, now: &Run| match saved.width == now.width {
///     true => Ok(()),
///     false => Err(format!("saved with width {}, this run has {}", saved.width, now.width)),
/// });
/// # let _ = state;
/// ```
pub struct SavedConfig<'a, C> {
    config: &'a C,
    check: Box<Resumable<'a, C>>,
}

/// Whether a run of the second settings can continue a checkpoint saved with the first (an
/// error says what differs).
pub type Resumable<'a, C> = dyn Fn(&C, &C) -> Result<(), String> + 'a;

impl<'a, C> SavedConfig<'a, C> {
    /// The state of a run of `config`, resuming only where `check(saved, now)` agrees.
    pub fn new(config: &'a C, check: impl Fn(&C, &C) -> Result<(), String> + 'a) -> Self {
        Self {
            config,
            check: Box::new(check),
        }
    }
}

/// What [`SavedConfig`] saves.
#[derive(Serialize, Deserialize)]
struct SavedRun<C> {
    losses: Vec<f64>,
    config: C,
}

impl<P: ParallelModel, C: Serialize + serde::de::DeserializeOwned + Clone> RunState<P>
    for SavedConfig<'_, C>
{
    fn save(&self, losses: &[f32], _: &Built<P>) -> SaveState {
        let state = SavedRun {
            losses: losses.iter().map(|&l| f64::from(l)).collect(),
            config: self.config.clone(),
        };
        SaveState::from(serde_json::to_value(state).expect("the run's settings serialise"))
    }

    fn restore(&mut self, checkpoint: &Checkpoint, _: &Built<P>) -> Result<Vec<f32>, Error> {
        let dir = checkpoint.dir().display();
        let fail = |e: String| Error::invalid("checkpoint", format!("{dir}: {e}"));
        let saved: SavedRun<C> = serde_json::from_value(saved_state(checkpoint).clone())
            .map_err(|e| fail(format!("not saved by this trainer ({e})")))?;
        (self.check)(&saved.config, self.config).map_err(fail)?;
        let step = checkpoint.step();
        if saved.losses.len() != step {
            return Err(fail(format!(
                "holds step {step} but {} losses",
                saved.losses.len()
            )));
        }
        // The losses were f32 before they were saved as f64.
        Ok(saved.losses.iter().map(|&l| l as f32).collect())
    }
}

/// The state [`fit`] keeps: the loss history.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossHistory;

/// The saved losses in a checkpoint's state.
#[derive(Serialize, Deserialize)]
struct FitState {
    losses: Vec<f32>,
}

impl<P: ParallelModel> RunState<P> for LossHistory {
    fn save(&self, losses: &[f32], _: &Built<P>) -> SaveState {
        let state = FitState {
            losses: losses.to_vec(),
        };
        SaveState::from(serde_json::to_value(state).expect("a list of numbers serialises"))
    }

    fn restore(&mut self, checkpoint: &Checkpoint, _: &Built<P>) -> Result<Vec<f32>, Error> {
        // A checkpoint of another trainer may keep other state: the history is then empty.
        let mut losses = serde_json::from_value::<FitState>(saved_state(checkpoint).clone())
            .map(|state| state.losses)
            .unwrap_or_default();
        losses.truncate(checkpoint.step());
        Ok(losses)
    }
}

/// What [`fit`] calls for each micro-batch: this rank's rows of it, as the model's
/// [`ParallelModel::loss`] (or its pipeline's stages) take them.
pub type BatchFn<'a, P> = dyn FnMut(&MicroBatch) -> Result<<P as ParallelModel>::Batch, Error> + 'a;

/// A flag that ends a run after the same step on every rank, saving first ([`fit`]'s `stop`),
/// in a form a run's settings can hold: clones share the flag, and two are equal when they are
/// the same flag. The `cli` feature's `stop_on_signals` gives one that Ctrl-C sets.
///
/// ```
/// use burn_parallel_train::StopFlag;
/// use std::sync::atomic::Ordering;
///
/// let flag = StopFlag::default();
/// let held = flag.clone();
/// flag.stop();
/// assert!(held.flag().load(Ordering::SeqCst));
/// assert_eq!(flag, held);
/// assert_ne!(flag, StopFlag::default());
/// ```
#[derive(Debug, Clone, Default)]
pub struct StopFlag(pub Arc<AtomicBool>);

impl StopFlag {
    /// Asks the run to stop after its current step.
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// The flag, for [`fit`].
    pub fn flag(&self) -> &AtomicBool {
        &self.0
    }
}

impl PartialEq for StopFlag {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// How often the fault-tolerant replicas compare their parameters' digests: `every`
/// ([`FitConfig::check_replicas_every`]), or `BURN_PARALLEL_VERIFY_REPLICAS_EVERY` when set (a
/// whole number of steps; 1 checks every step).
///
/// # Errors
/// [`Error::Invalid`] naming the variable for a value that is not a whole number.
fn verify_every(every: usize) -> Result<u64, Error> {
    const VAR: &str = "BURN_PARALLEL_VERIFY_REPLICAS_EVERY";
    match std::env::var(VAR) {
        Err(_) => Ok(every as u64),
        Ok(v) => v.trim().parse().map_err(|_| {
            Error::invalid(
                VAR,
                format!("`{v}` is not a number of steps; give a whole number (0: never)"),
            )
        }),
    }
}

/// What [`fit`] calls after each step with the step's figures and what is trained (to log,
/// to evaluate every so often: [`Built::model`]).
pub type OnStep<'a, P> = dyn FnMut(&StepLog, &Built<P>) -> Result<(), Error> + 'a;

/// Trains `built` to `config.steps`: `batch(micro_batch)` gives this rank's rows of one
/// micro-batch (the model's [`ParallelModel::loss`] computes its loss, or its pipeline's
/// stages do); `on_step` sees every step; `stop` (set by a Ctrl-C handler, say) ends the run
/// after the step in which any rank saw it, saving first. Every rank calls it, under any
/// layout, the pipeline included.
///
/// # Errors
/// `batch`'s and `on_step`'s errors, the engine's, a checkpoint that cannot be read or
/// written.
///
/// # Example
/// See `tests/tests/fit.rs`: a run stopped by the flag after step 2 saves, and resumed (under
/// the same layout or another) it ends where the uninterrupted run ends.
pub fn fit<P: ParallelModel>(
    built: Built<P>,
    config: &FitConfig,
    batch: &mut BatchFn<'_, P>,
    on_step: &mut OnStep<'_, P>,
    stop: Option<&AtomicBool>,
) -> Result<Fitted<P>, Error> {
    fit_with(built, config, batch, on_step, stop, &mut LossHistory)
}

/// [`fit`] that saves and restores `state` with its checkpoints (in place of the loss history
/// alone).
///
/// # Errors
/// As [`fit`]; `state`'s refusal of a checkpoint.
pub fn fit_with<P: ParallelModel>(
    mut built: Built<P>,
    config: &FitConfig,
    batch: &mut BatchFn<'_, P>,
    on_step: &mut OnStep<'_, P>,
    stop: Option<&AtomicBool>,
    state: &mut dyn RunState<P>,
) -> Result<Fitted<P>, Error> {
    config.lr.validate()?;
    let world = built.groups.world.clone();
    let data = built.groups.data.clone();
    let (rows, accum) = (built.settings.batch_size, built.settings.grad_accum.max(1));
    let micro_rows = rows / (data.size() * accum);
    let tokens = (rows * built.settings.seq_len) as f64;
    // Under fault tolerance each replica can save alone (the lowest live one does), and a
    // restarted replica resumes from the state a live one sends ([`crate::fault`]).
    let replicas = built.replicas.clone();
    let savers = replicas.as_ref().map_or(&world, |r| r.island());
    let mut saver = match &config.checkpoint {
        Some(policy) => Some(
            Checkpointer::new(&policy.dir, policy.keep, savers)?.with_background(policy.background),
        ),
        None => None,
    };
    if let Some(r) = &replicas {
        r.set_verify_every(verify_every(config.check_replicas_every)?);
    }
    let joined = match &replicas {
        Some(r) if world.rejoined() => Some(crate::fault::join(r, &world)?),
        _ => None,
    };
    let mut losses = Vec::new();
    let mut first_step = 0;
    let mut resumed_from = None;
    let mut skipped_steps = 0;
    if let Some(path) = joined.as_ref().or(config.resume.as_ref()) {
        let resuming = |e: Error| e.resuming(path);
        let checkpoint = open_checkpoint(path).map_err(|e| resuming(e.into()))?;
        losses = state.restore(&checkpoint, &built).map_err(resuming)?;
        built.load(&checkpoint).map_err(resuming)?;
        // The dropout streams of what was loaded continue where the saving run's stopped.
        restore_dropout(&checkpoint, &built.dropout_layers()).map_err(resuming)?;
        first_step = checkpoint.step();
        resumed_from = Some(Resumed::of(&checkpoint));
        // The steps the saved run skipped count when this run scales its loss too.
        if built.settings.loss_scaler.is_some() {
            let saved = saved_loss_scaler(&checkpoint).map_err(|e| resuming(e.into()))?;
            skipped_steps = saved.map_or(0, |s| s.skipped);
        }
        if joined.is_some() {
            crate::fault::clean(&world);
        }
    }
    let mut stopped_at = None;
    let (mut timed_seconds, mut timed_steps) = (0.0, 0usize);
    // What a checkpoint (or a rejoining replica) gets besides the engine's state.
    let saved_state = |state: &dyn RunState<P>, losses: &[f32], built: &Built<P>| {
        let layout = serde_json::json!({
            "layout": built.layout,
            "description": built.layout.describe(world.size()),
        });
        state
            .save(losses, built)
            .with_rank(LAYOUT_KEY, layout)
            .with_rank(DROPOUT_CALLS, dropout_calls(&built.dropout_layers()))
    };
    // burnrun's supervisor reads each step's heartbeat (progress, stragglers, rejoins).
    let heartbeat = Heartbeat::from_env();
    for step in first_step..config.steps {
        let start = Instant::now();
        if let (Some(r), Some(flag)) = (&replicas, stop) {
            r.request_stop(flag.load(Ordering::SeqCst));
        }
        let lr = config.lr.at(step);
        let mut micro_batch = |micro: usize| {
            let first = micro * micro_rows * data.size() + data.rank() * micro_rows;
            let rows = first..first + micro_rows;
            batch(&MicroBatch { step, micro, rows })
        };
        let out = built
            .step(accum, &mut micro_batch, lr)
            .map_err(|e| e.at_step(step + 1))?;
        losses.push(out.loss);
        skipped_steps += usize::from(out.skipped);
        let seconds = start.elapsed().as_secs_f64();
        if step > first_step {
            timed_seconds += seconds;
            timed_steps += 1;
        }
        if let Some(beat) = &heartbeat {
            let p = &out.phases;
            beat.beat(step, p.forward + p.backward + p.optimizer, seconds);
        }
        let log = StepLog {
            step,
            loss: out.loss,
            lr,
            seconds,
            tokens_per_sec: tokens / seconds,
            skipped: out.skipped,
            grad_norm: out.grad_norm,
            phases: out.phases,
        };
        on_step(&log, &built)?;
        let done = step + 1;
        let every = config.check_replicas_every;
        if every > 0 && done.is_multiple_of(every) {
            built.verify_replicas()?;
        }
        // The ranks agree on the stop: any rank's flag stops all after this step (under
        // DiLoCo, those of the group its losses are averaged over: the world, or this rank's
        // island where islands may be lost).
        let stopping = match (stop, &replicas) {
            // The replicas agreed on it in the step's exchange.
            (Some(_), Some(r)) => r.stopping(),
            (Some(flag), None) => {
                let seen = f32::from(u8::from(flag.load(Ordering::SeqCst)));
                let agree = built.diloco.as_ref().map_or(&world, |d| d.loss_group());
                agree.all_reduce_f32(vec![seen], ReduceOp::Max)?[0] > 0.0
            }
            (None, _) => false,
        };
        // Replicas admitted at this step's exchange get the state now, from the lowest live
        // replica that is not one of them.
        if let Some(r) = &replicas {
            let admitted = r.take_admitted();
            if !admitted.is_empty() && r.donor(&admitted) == Some(r.index()) {
                let saved = saved_state(&*state, &losses, &built);
                crate::fault::donate(&built, r, &admitted, done, saved)?;
            }
        }
        let saves = replicas.as_ref().is_none_or(|r| r.is_first_live());
        if let (Some(saver), Some(policy), true) = (saver.as_mut(), &config.checkpoint, saves) {
            let due = policy.every > 0 && done.is_multiple_of(policy.every);
            if due || stopping || (policy.at_end && done == config.steps) {
                let saved = saved_state(&*state, &losses, &built);
                built.save(saver, done, saved)?;
            }
        }
        if stopping {
            stopped_at = Some(done);
            break;
        }
    }
    if let Some(saver) = saver.as_mut() {
        saver.wait()?;
    }
    let step_seconds = match timed_steps {
        0 => 0.0,
        n => timed_seconds / n as f64,
    };
    Ok(Fitted {
        built,
        losses,
        first_step,
        stopped_at,
        resumed_from,
        step_seconds,
        skipped_steps,
    })
}
