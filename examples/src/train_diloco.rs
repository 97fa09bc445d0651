//! The GPT trained with DiLoCo (`gpt --diloco-islands N --inner-steps H ...`): the technique is
//! [`burn_parallel::diloco`]; this file only wires it to the GPT.
//!
//! The world's ranks form `N` islands of `ranks / N` ranks ([`Islands`]); each island trains
//! with data parallelism inside (DDP over its ranks) and its own inner optimizer, and
//! [`DiLoCo::sync`] runs the outer step every `H` steps (per fragment under streaming
//! DiLoCo). The global batch of a step is that of [`crate::train::train_gpt_parallel`], cut
//! over all ranks, so a run spends the same tokens as a DDP run of the same config: with inner
//! SGD, `H` = 1, outer learning rate 1 and no momentum it *is* DDP with SGD.
//!
//! Every byte a rank sends goes through [`count_sent_bytes`]: the report gives the outer sync's
//! bytes and the total (inner DDP and the loss figures included).
//!
//! With `--diloco-drop-lost` ([`DiLoCoConfig::drop_lost_islands`]) an island that disappears is
//! dropped and the others go on: nothing then runs over the whole world after the start, so the
//! step losses and the validation loss are those of this rank's island (its rows of the global
//! batch), and each rank reports only its own bytes.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn_parallel::checkpoint::{Checkpointer, ParamMap};
use burn_parallel::diloco::{
    Compression, DiLoCo, DiLoCoConfig, DiLoCoError, Islands, count_sent_bytes,
};
use burn_parallel::train::{StepEngine, TrainStep, Trainer};
use burn_parallel::{CollectiveError, DistributedDataParallel, ProcessGroup, ReduceOp};
use burn_parallel_train::diloco::{DILOCO_STATE, DiLoCoCheckpoint};

use crate::data::{Corpus, Split};
use crate::gpt::Gpt;
use crate::train::{
    Parallelism, StepStats, StepTimer, TrainConfig, TrainDevice, TrainReport, generate,
    named_params,
};
use crate::train_checkpoint::{self, CheckpointOptions};

/// The optimizer each island runs between syncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InnerOptimizer {
    /// AdamW with the run's weight decay (DiLoCo's choice).
    #[default]
    AdamW,
    /// Plain SGD (the identity test: DiLoCo with `H` = 1 and outer SGD lr 1 is DDP with SGD).
    Sgd,
}

/// A DiLoCo run of the GPT.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiLoCoRun {
    /// Islands (they split the ranks evenly).
    pub islands: usize,
    /// The outer loop's settings.
    pub diloco: DiLoCoConfig,
    /// The inner optimizer.
    pub inner: InnerOptimizer,
    /// The device.
    pub device: TrainDevice,
}

/// What a DiLoCo run gives: the trainer's report and the bytes this rank sent.
#[derive(Debug, Clone)]
pub struct DiLoCoReport {
    /// Losses (global mean per step), validation loss of the final outer model, parameters.
    pub train: TrainReport,
    /// Payload bytes this rank sent in outer syncs.
    pub outer_bytes: u64,
    /// Payload bytes this rank sent in all (outer syncs, DDP inside its island, loss figures).
    pub total_bytes: u64,
    /// Fragment syncs this rank took part in (the final one of `DiLoCo::finish` included).
    pub syncs: usize,
    /// Islands dropped during the run, with the inner step after which each was dropped
    /// (`None`: in the final sync).
    pub dropped: Vec<(usize, Option<usize>)>,
    /// Seconds per step spent in [`DiLoCo::sync`] (the stall of the outer syncs, first step
    /// excluded like the step time).
    pub sync_seconds: f64,
}

/// A DiLoCo run that cannot go.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DiLoCoTrainError {
    /// A parallelism DiLoCo is not composed with.
    #[error(
        "{flag} is not composed with DiLoCo (--diloco-islands) yet: {why}; DiLoCo runs with \
         data parallelism inside each island (--ranks R, R/N ranks per island): drop {flag}"
    )]
    Unsupported {
        /// The flag to drop.
        flag: &'static str,
        /// Why.
        why: &'static str,
    },
    /// The run's config does not fit the ranks.
    #[error("DiLoCo run: {0}")]
    Config(String),
    /// A checkpoint that cannot be read or written, or is of another run.
    #[error("DiLoCo checkpoint: {0}")]
    Checkpoint(String),
    /// DiLoCo's own errors (settings, lost islands, collectives).
    #[error(transparent)]
    DiLoCo(#[from] DiLoCoError),
}

impl From<CollectiveError> for DiLoCoTrainError {
    fn from(e: CollectiveError) -> Self {
        DiLoCoTrainError::DiLoCo(DiLoCoError::Collective(e))
    }
}

impl DiLoCoRun {
    /// Checks the run on `world` ranks, with the other layout settings of `parallel` (which
    /// DiLoCo refuses unless they are plain data parallelism), before anything is built.
    ///
    /// # Errors
    /// [`DiLoCoTrainError`] naming the setting to change.
    pub fn validate(
        &self,
        config: &TrainConfig,
        parallel: &Parallelism,
        world: usize,
    ) -> Result<(), DiLoCoTrainError> {
        let refused = [
            (
                parallel.tp > 1,
                "--tp",
                "the outer step reads whole parameters",
            ),
            (
                parallel.cp > 1,
                "--cp",
                "the islands run plain data parallelism",
            ),
            (
                parallel.zero.is_some(),
                "--zero",
                "the outer step reads whole parameters, not ZeRO's shards",
            ),
            (parallel.ep > 1, "--ep", "experts are not split over ranks"),
            (
                config.model.moe.is_some(),
                "--moe-experts",
                "the MoE routing figures and bias balancing are not wired into the DiLoCo loop",
            ),
        ];
        if let Some((_, flag, why)) = refused.into_iter().find(|r| r.0) {
            return Err(DiLoCoTrainError::Unsupported { flag, why });
        }
        self.diloco.validate()?;
        if self.islands == 0 || !world.is_multiple_of(self.islands) {
            return Err(DiLoCoError::IslandLayout {
                world,
                islands: self.islands,
            }
            .into());
        }
        config.validate(world).map_err(DiLoCoTrainError::Config)
    }
}

/// Trains the GPT of `config` with DiLoCo on `world` (every rank calls it) and calls `on_step`
/// after every inner step (the loss is the global batch's: averaged over every rank).
///
/// # Errors
/// [`DiLoCoTrainError`]: invalid settings (before any communication), a lost island, collective
/// failures.
pub fn train_gpt_diloco(
    world: &ProcessGroup,
    config: &TrainConfig,
    run: &DiLoCoRun,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<DiLoCoReport, DiLoCoTrainError> {
    let none = CheckpointOptions::default();
    train_gpt_diloco_checkpointed(world, config, run, corpus, &none, on_step)
}

/// [`train_gpt_diloco`] that saves distributed checkpoints and resumes from one
/// (`gpt --diloco-islands N --save-every S --checkpoint-dir D`, `--resume D`). A checkpoint
/// holds:
/// - the outer model `θ_start` under the model's own names, so that any other layout resumes
///   from it (or evaluates or exports it) as from a plain run's checkpoint, without optimizer
///   state;
/// - the outer momentum (`diloco/momentum/<name>`) and the averaged pseudo-gradients of the
///   exchanges in flight under an overlap (`diloco/in_flight.<j>/<name>`), with DiLoCo's
///   bookkeeping in the trainer state ([`burn_parallel::diloco::DiLoCoState`]);
/// - each island's own model and inner optimizer state (`diloco/island.<k>/<name>`,
///   `optim/<state>/diloco/island.<k>/<name>`), written by the island's ranks together.
///
/// A DiLoCo run resumed from it with the same settings and number of islands (the ranks per
/// island may change) continues the loss curve; bit for bit under the same layout. It saves
/// after any inner step: between syncs the islands' models differ, and each is kept.
///
/// # Errors
/// As [`train_gpt_diloco`]; [`DiLoCoTrainError::Checkpoint`] for a checkpoint that cannot be
/// read, is of another run (model, DiLoCo settings, islands) or cannot be written, and for a
/// Hugging Face checkpoint (`init_from_hf`, every island's start) that cannot be read or is of
/// another model.
pub fn train_gpt_diloco_checkpointed(
    world: &ProcessGroup,
    config: &TrainConfig,
    run: &DiLoCoRun,
    corpus: &Corpus,
    checkpoints: &CheckpointOptions,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<DiLoCoReport, DiLoCoTrainError> {
    checkpoints.validate().map_err(DiLoCoTrainError::Config)?;
    run.validate(config, &Parallelism::default(), world.size())?;
    let (world, counter) = count_sent_bytes(world)?;
    let islands = Islands::new(&world, run.islands)?;
    let plain = run.device.device().map_err(DiLoCoTrainError::Config)?;
    let device = plain.clone().autodiff();

    // Seeded: the same weights on every rank; a hash comparison (not a broadcast: its bytes
    // would count as DiLoCo's) makes sure.
    let mut model = Gpt::new(&config.model, &device).with_dropout_stream(world.rank() as u64);
    if let Some(dir) = checkpoints
        .init_from_hf
        .as_ref()
        .filter(|_| checkpoints.resume.is_none())
    {
        // Every island starts from the imported weights: they are the first outer model.
        let tensors = crate::hf::gpt_tensors_for(dir, &config.model).map_err(checkpoint_error)?;
        model = ParamMap::new(&model, &model.tp, None)
            .and_then(|map| map.load_params(model, &tensors))
            .map_err(checkpoint_error)?;
    }
    burn_parallel::verify_replicas(&model, &world)
        .map_err(|e| DiLoCoTrainError::Config(e.to_string()))?;
    let mut diloco = DiLoCo::new(&islands, run.diloco, &model)?;
    // The inner step: the library's, under the run's precision policy (the forward on the
    // compute copy, fp32 weights and optimizer state, dynamic loss scaling for fp16), DDP inside
    // the island. The outer sync sees the fp32 weights.
    let mut step_engine = TrainStep::new(model.tp.clone())
        .with_clip(config.max_grad_norm)
        .with_precision(config.precision_policy());
    if let Some(scaler) = config.loss_scaler() {
        step_engine = step_engine.with_loss_scaler(scaler);
    }
    if islands.size() > 1 {
        let ddp = DistributedDataParallel::new(islands.island().clone())
            .with_bucket_bytes((config.bucket_mb * 1024.0 * 1024.0) as usize);
        step_engine = step_engine.with_ddp(ddp);
    }
    let inner = || -> ModuleOptimizer {
        match run.inner {
            InnerOptimizer::AdamW => AdamWConfig::new()
                .with_weight_decay(config.weight_decay as f32)
                .init(),
            InnerOptimizer::Sgd => SgdConfig::new().init(),
        }
    };
    let mut trainer = Trainer::new(step_engine, inner());

    // Each rank takes its rows of the global batch, as a DDP rank would.
    let ranks = world.size();
    let micro_rows = config.batch_size / ranks / config.grad_accum;
    let tokens_per_step = (config.batch_size * config.seq_len) as f64;
    let start = Instant::now();
    let mut losses = Vec::with_capacity(config.steps);
    let (mut timer, mut sync_timer) = (StepTimer::default(), StepTimer::default());
    // Who the loss figures are averaged over: the world, or this island once islands may
    // disappear.
    let drop_lost = run.diloco.drop_lost_islands;
    let loss_group = if drop_lost {
        islands.island().clone()
    } else {
        world.clone()
    };
    let names =
        DiLoCoCheckpoint::new(&model, &model.tp, &world, &islands).map_err(checkpoint_error)?;
    let mut first_step = 0;
    let mut skipped = 0;
    if let Some(path) = &checkpoints.resume {
        let checkpoint = burn_parallel_train::open_checkpoint(path).map_err(checkpoint_error)?;
        let state =
            train_checkpoint::resume_state(&checkpoint, config).map_err(checkpoint_error)?;
        model = names
            .load(
                model,
                (&mut trainer.optim, &inner),
                &mut diloco,
                &checkpoint,
            )
            .map_err(checkpoint_error)?;
        train_checkpoint::restore_dropout(&checkpoint, &train_checkpoint::dropout_layers(&model))
            .map_err(checkpoint_error)?;
        if let Some(saved) =
            train_checkpoint::saved_loss_scaler(&checkpoint).map_err(checkpoint_error)?
            && trainer
                .step
                .restore_loss_scaler(&saved)
                .map_err(checkpoint_error)?
        {
            skipped = saved.skipped;
        }
        first_step = checkpoint.step();
        losses = state.losses;
    }
    let mut saver = match (&checkpoints.dir, checkpoints.save_every) {
        (Some(dir), every) if every > 0 => Some(
            Checkpointer::new(dir, checkpoints.keep, &world)
                .map_err(checkpoint_error)?
                .with_background(checkpoints.asynchronous),
        ),
        _ => None,
    };
    for step in first_step..config.steps {
        let step_start = Instant::now();
        let lr = config.lr_at(step);
        let mut forward = |m: &Gpt, micro: usize| {
            let first = micro * micro_rows * ranks + world.rank() * micro_rows;
            let batch = corpus.batch_rows(
                step as u64,
                first..first + micro_rows,
                config.seq_len,
                Split::Train,
            );
            let (inputs, targets) = batch.to_tensors(&device);
            m.loss(inputs, targets)
                .map_err(|e| DiLoCoTrainError::Config(e.to_string()))
        };
        // The loss of the island's batch (averaged over its ranks by the step).
        let (stepped, out) =
            trainer.step_accumulated(model, config.grad_accum, &mut forward, lr)?;
        model = stepped;
        skipped += usize::from(out.skipped);
        let local_loss = f64::from(out.loss);
        let sync_start = Instant::now();
        model = diloco.sync(step, model)?;
        let sync_seconds = sync_start.elapsed().as_secs_f64();
        let loss = loss_group.all_reduce_f32(vec![local_loss as f32], ReduceOp::Avg)?[0] as f64;
        losses.push(loss);
        let seconds = step_start.elapsed().as_secs_f64();
        timer.add(step == first_step, seconds);
        sync_timer.add(step == first_step, sync_seconds);
        on_step(&StepStats {
            step,
            loss,
            lr,
            tokens_per_sec: tokens_per_step / seconds,
            elapsed: start.elapsed().as_secs_f64(),
            moe: Vec::new(),
            phases: Default::default(), // not split by phase here
        });
        if let Some(saver) = saver.as_mut().filter(|_| checkpoints.saves_after(step)) {
            let (pieces, meta, scalars) = names
                .pieces(&model, &trainer.optim, &mut diloco)
                .map_err(checkpoint_error)?;
            let mut state = train_checkpoint::TrainerState::json(&losses, config);
            state[DILOCO_STATE] = serde_json::to_value(meta).expect("DiLoCo's state serialises");
            let state = burn_parallel::train::SaveState::from(state).with_rank(
                train_checkpoint::DROPOUT_CALLS,
                train_checkpoint::dropout_calls(&train_checkpoint::dropout_layers(&model)),
            );
            let scaler = trainer.step.loss_scaler().map(|s| s.state());
            train_checkpoint::save_after(saver, step, pieces, state, scaler, &scalars)
                .map_err(checkpoint_error)?;
        }
    }
    if let Some(saver) = saver.as_mut() {
        saver.wait().map_err(checkpoint_error)?;
    }
    // The outer model: fragments not synced after the last step are synced now.
    model = diloco.finish(model)?;
    // The outer syncs' bytes are those of the outer group (sent by a background thread with an
    // overlap, while the inner steps send theirs).
    let outer_bytes = counter.sent_in(islands.outer());
    let total_bytes = counter.sent();

    let eval = model.valid();
    let val_loss = crate::train::validation_loss(
        &loss_group,
        &loss_group,
        config,
        run.device,
        corpus,
        &|inputs, targets| {
            eval.loss(inputs, targets)
                .map_err(|e| CollectiveError::InvalidArgument {
                    rank: loss_group.global_rank(),
                    op: "validation loss".into(),
                    reason: e.to_string(),
                })
        },
    )?;
    let dropped = diloco
        .history()
        .iter()
        .flat_map(|e| e.dropped.iter().map(|&i| (i, e.step)))
        .collect();
    let sample = if config.sample_len > 0 && world.rank() == 0 {
        generate(&eval, &config.prompt, config, &plain)
    } else {
        String::new()
    };
    let (step_seconds, tokens_per_sec) = timer.figures(tokens_per_step);
    Ok(DiLoCoReport {
        train: TrainReport {
            losses,
            val_loss,
            sample,
            step_seconds,
            tokens_per_sec,
            final_params: named_params(&eval),
            skipped_steps: skipped,
            loss_scale: trainer.step.loss_scale(),
            memory: None,
        },
        outer_bytes,
        total_bytes,
        syncs: diloco.history().len(),
        dropped,
        sync_seconds: sync_timer.step_seconds(),
    })
}

/// How pseudo-gradients travel (`--diloco-compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CompressionArg {
    /// 4 bytes per element (ring all-reduce).
    #[default]
    F32,
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
    /// int8 with an f32 scale per block of `--int8-block` elements.
    Int8,
}

/// The inner optimizer (`--inner-optim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum InnerOptimArg {
    /// AdamW.
    #[default]
    Adamw,
    /// Plain SGD.
    Sgd,
}

/// The `gpt` binary's DiLoCo flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DiLoCoArgs {
    /// DiLoCo: cut the ranks into this many islands (ranks/N each, DDP inside); islands
    /// average their pseudo-gradients every --inner-steps steps.
    #[arg(long = "diloco-islands")]
    pub islands: Option<usize>,
    /// DiLoCo: inner steps H between syncs.
    #[arg(long, default_value_t = 50, requires = "islands")]
    pub inner_steps: usize,
    /// DiLoCo: learning rate of the outer SGD.
    #[arg(long, default_value_t = 0.7, requires = "islands")]
    pub outer_lr: f64,
    /// DiLoCo: momentum of the outer SGD, in [0, 1).
    #[arg(long, default_value_t = 0.9, requires = "islands")]
    pub outer_momentum: f64,
    /// DiLoCo: plain momentum instead of Nesterov's.
    #[arg(long, requires = "islands")]
    pub no_nesterov: bool,
    /// DiLoCo: how pseudo-gradients travel.
    #[arg(
        long = "diloco-compression",
        value_enum,
        default_value = "f32",
        requires = "islands"
    )]
    pub compression: CompressionArg,
    /// DiLoCo: elements per scale of int8 compression.
    #[arg(long, default_value_t = 256, requires = "islands")]
    pub int8_block: usize,
    /// Streaming DiLoCo: fragments synced at staggered steps.
    #[arg(long = "diloco-fragments", default_value_t = 1, requires = "islands")]
    pub fragments: usize,
    /// Streaming DiLoCo's overlap: a fragment's outer exchange runs in the background during
    /// the next N inner steps, and its update lands after them (0: at once, no overlap).
    #[arg(long = "diloco-overlap", default_value_t = 0, requires = "islands")]
    pub overlap: usize,
    /// DiLoCo overlap: share of the local values kept when a delayed update lands, in [0, 1).
    #[arg(
        long = "diloco-overlap-mix",
        default_value_t = 0.5,
        requires = "islands"
    )]
    pub overlap_mix: f64,
    /// DiLoCo: an island that disappears (crash, exit, timeout) is dropped from the average
    /// and the others go on, instead of stopping the job.
    #[arg(long = "diloco-drop-lost", requires = "islands")]
    pub drop_lost: bool,
    /// DiLoCo: the inner optimizer.
    #[arg(
        long = "inner-optim",
        value_enum,
        default_value = "adamw",
        requires = "islands"
    )]
    pub inner: InnerOptimArg,
}

impl DiLoCoArgs {
    /// The run these flags ask for on `device`; `None` without `--diloco-islands` (the other
    /// DiLoCo flags are refused without it rather than ignored).
    pub fn run(&self, device: TrainDevice) -> Option<DiLoCoRun> {
        let compression = match self.compression {
            CompressionArg::F32 => Compression::F32,
            CompressionArg::Fp16 => Compression::Fp16,
            CompressionArg::Bf16 => Compression::Bf16,
            CompressionArg::Int8 => Compression::Int8 {
                block_size: self.int8_block,
            },
        };
        Some(DiLoCoRun {
            islands: self.islands?,
            diloco: DiLoCoConfig {
                inner_steps: self.inner_steps,
                outer_lr: self.outer_lr,
                outer_momentum: self.outer_momentum,
                nesterov: !self.no_nesterov,
                compression,
                fragments: self.fragments,
                drop_lost_islands: self.drop_lost,
                overlap_steps: self.overlap,
                overlap_mix: self.overlap_mix,
            },
            inner: match self.inner {
                InnerOptimArg::Adamw => InnerOptimizer::AdamW,
                InnerOptimArg::Sgd => InnerOptimizer::Sgd,
            },
            device,
        })
    }
}

/// Runs one rank of `gpt --diloco-islands`: trains, prints every `log_every` steps and the
/// bytes sent (group rank 0), and returns rank 0's report.
///
/// # Errors
/// As [`train_gpt_diloco`], as a [`CollectiveError`] for the launchers (a lost island keeps
/// its message).
pub fn run_rank(
    world: &ProcessGroup,
    config: &TrainConfig,
    run: &DiLoCoRun,
    corpus: &Corpus,
    log_every: usize,
    checkpoints: &CheckpointOptions,
) -> burn_parallel::Result<Option<DiLoCoReport>> {
    let lead = world.rank() == 0;
    if lead {
        let d = &run.diloco;
        println!(
            "DiLoCo: {} islands x {} ranks, H = {}, outer SGD lr {} momentum {}{}, \
             pseudo-gradients {}, {} fragment(s), overlap {} step(s), {}inner {:?}",
            run.islands,
            world.size() / run.islands.max(1),
            d.inner_steps,
            d.outer_lr,
            d.outer_momentum,
            if d.nesterov { " (Nesterov)" } else { "" },
            d.compression,
            d.fragments,
            d.overlap_steps,
            if d.drop_lost_islands {
                "lost islands dropped, "
            } else {
                ""
            },
            run.inner
        );
    }
    let mut on_step = |s: &StepStats| {
        if lead && (s.step.is_multiple_of(log_every.max(1)) || s.step + 1 == config.steps) {
            println!(
                "step {:>5}  loss {:.4}  lr {:.2e}  {:>7.0} tok/s  {:>7.1}s",
                s.step, s.loss, s.lr, s.tokens_per_sec, s.elapsed
            );
        }
    };
    let report =
        train_gpt_diloco_checkpointed(world, config, run, corpus, checkpoints, &mut on_step)
            .map_err(|e| match e {
                DiLoCoTrainError::DiLoCo(DiLoCoError::Collective(c)) => c,
                other => CollectiveError::InvalidArgument {
                    rank: world.global_rank(),
                    op: "gpt --diloco-islands".into(),
                    reason: other.to_string(),
                },
            })?;
    if lead {
        for (island, step) in &report.dropped {
            match step {
                Some(step) => {
                    println!("DiLoCo: island {island} dropped at the sync of step {step}")
                }
                None => println!("DiLoCo: island {island} dropped at the final sync"),
            }
        }
        println!(
            "DiLoCo: {:.4} s per step in outer syncs (stall), {:.4} s per step in all",
            report.sync_seconds, report.train.step_seconds
        );
    }
    if run.diloco.drop_lost_islands {
        // Islands may be gone: no collective over the world.
        if lead {
            println!(
                "rank 0: sent {} bytes in {} outer syncs, {} bytes in all",
                report.outer_bytes, report.syncs, report.total_bytes
            );
        }
        return Ok(Some(report).filter(|_| lead));
    }
    // Every rank's bytes, on rank 0.
    let bytes = world.all_gather_object(&(report.outer_bytes, report.total_bytes))?;
    if lead {
        for (rank, (outer, total)) in bytes.iter().enumerate() {
            println!(
                "rank {rank}: sent {outer} bytes in {} outer syncs, {total} bytes in all",
                report.syncs
            );
        }
    }
    Ok(lead.then_some(report))
}

/// A checkpoint error of a DiLoCo run.
fn checkpoint_error(e: impl std::fmt::Display) -> DiLoCoTrainError {
    DiLoCoTrainError::Checkpoint(e.to_string())
}
