//! The GPT under any layout, as the `gpt` binary runs it: [`train_gpt_under`] dispatches a
//! [`Layout`] to the whole-model trainer ([`crate::train`]), the pipeline
//! ([`crate::pipeline`], `pp > 1`) or DiLoCo ([`crate::train_diloco`], `layout.diloco`), and
//! [`check_run`] refuses, before any rank starts, what none of them can run.

use burn_parallel::ProcessGroup;
use burn_parallel_train::Layout;

use crate::data::Corpus;
use crate::pipeline::{PipelineArgs, PipelineReport, train_gpt_pipeline_checkpointed};
use crate::train::{StepStats, TrainConfig, TrainReport, train_gpt_checkpointed};
use crate::train_checkpoint::CheckpointOptions;
use crate::train_diloco::{DiLoCoReport, train_gpt_diloco_checkpointed, validate_diloco};

/// What a GPT run reports, by the kind of layout it ran under.
#[derive(Debug, Clone)]
pub enum GptRun {
    /// Every layout but the pipeline and DiLoCo.
    Whole(TrainReport),
    /// `pp > 1`: with the split, the last step's timeline and the parameters each rank held.
    Pipeline(PipelineReport),
    /// DiLoCo: with the bytes sent and the islands dropped.
    DiLoCo(DiLoCoReport),
}

impl GptRun {
    /// The trainer's report (losses, validation loss, sample, timing, parameters).
    pub fn train(&self) -> &TrainReport {
        match self {
            GptRun::Whole(r) => r,
            GptRun::Pipeline(r) => &r.train,
            GptRun::DiLoCo(r) => &r.train,
        }
    }
}

/// Checks that `world` ranks can train `config` under `layout` (with `pipeline`'s flags when
/// `pp > 1`), before any rank builds anything: the layout's rules and the run's, and the
/// memory a rank needs (`ranks_here` ranks share this process).
///
/// # Errors
/// The first refusal, naming its flag.
pub fn check_run(
    config: &TrainConfig,
    layout: &Layout,
    pipeline: &PipelineArgs,
    world: usize,
    ranks_here: usize,
) -> Result<(), burn_parallel::Error> {
    let invalid = |e: &dyn std::fmt::Display| burn_parallel::Error::invalid("gpt", e);
    if let Some(run) = &layout.diloco {
        return validate_diloco(config, run, layout, world).map_err(|e| invalid(&e));
    }
    if layout.pp > 1 {
        let pipeline = pipeline.config(config.device, layout);
        return Ok(pipeline.validate(config, world)?);
    }
    config
        .check(layout, world, ranks_here)
        .map_err(|e| invalid(&e))
}

/// Trains the GPT of `config` on `world` under `layout` (every rank calls it), saving and
/// resuming as `checkpoints` say, calling `on_step` after every step.
///
/// # Errors
/// [`check_run`]'s refusals; the trainers' errors.
pub fn train_gpt_under(
    world: &ProcessGroup,
    config: &TrainConfig,
    layout: &Layout,
    pipeline: &PipelineArgs,
    (corpus, checkpoints): (&Corpus, &CheckpointOptions),
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<GptRun, burn_parallel::Error> {
    if let Some(run) = &layout.diloco {
        let report =
            train_gpt_diloco_checkpointed(world, config, run, corpus, checkpoints, on_step)?;
        return Ok(GptRun::DiLoCo(report));
    }
    if layout.pp > 1 {
        let pipeline = pipeline.config(config.device, layout);
        let report = train_gpt_pipeline_checkpointed(
            world,
            config,
            &pipeline,
            corpus,
            checkpoints,
            on_step,
        )?;
        return Ok(GptRun::Pipeline(report));
    }
    let report = train_gpt_checkpointed(world, config, layout, corpus, checkpoints, on_step)?;
    Ok(GptRun::Whole(report))
}
