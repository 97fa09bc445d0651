//! The GPT under any layout, as the `gpt` binary runs it: [`train_gpt_under`] dispatches a
//! [`Layout`] to the whole-model trainer ([`crate::train`]), the pipeline
//! ([`crate::pipeline`], `pp > 1`) or DiLoCo ([`crate::train_diloco`], `layout.diloco`), and
//! [`check_run`] refuses, before any rank starts, what none of them can run.

use burn_parallel::ProcessGroup;
use burn_parallel_train::Layout;

use crate::data::Corpus;
use crate::pipeline::{PipelineReport, StageSplit, check_pipeline, train_gpt_pipeline};
use crate::train::{StepStats, TrainConfig, TrainReport, train_gpt};
use crate::train_diloco::{DiLoCoReport, train_gpt_diloco, validate_diloco};

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

/// Checks that `world` ranks can train `config` under `layout` (its stages split as `split`
/// says when `pp > 1`), before any rank builds anything: the layout's rules and the run's, and
/// the memory a rank needs (`ranks_here` ranks share this process).
///
/// # Errors
/// The first refusal, naming its flag.
pub fn check_run(
    config: &TrainConfig,
    layout: &Layout,
    split: &StageSplit,
    world: usize,
    ranks_here: usize,
) -> Result<(), burn_parallel::Error> {
    if let Some(run) = &layout.diloco {
        return validate_diloco(config, run, layout, world);
    }
    if layout.pp > 1 {
        return check_pipeline(config, layout, split, world);
    }
    config
        .check(layout, world, ranks_here)
        .map_err(|e| burn_parallel::Error::invalid("gpt", e))
}

/// Trains the GPT of `config` on `world` under `layout` (every rank calls it), its stages split
/// as `split` says when `pp > 1`, calling `on_step` after every step.
///
/// # Errors
/// [`check_run`]'s refusals; the trainers' errors.
pub fn train_gpt_under(
    world: &ProcessGroup,
    config: &TrainConfig,
    (layout, split): (&Layout, &StageSplit),
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<GptRun, burn_parallel::Error> {
    if let Some(run) = &layout.diloco {
        let report = train_gpt_diloco(world, config, run, corpus, on_step)?;
        return Ok(GptRun::DiLoCo(report));
    }
    if layout.pp > 1 {
        let report = train_gpt_pipeline(world, config, layout, split, corpus, on_step)?;
        return Ok(GptRun::Pipeline(report));
    }
    let report = train_gpt(world, config, layout, corpus, on_step)?;
    Ok(GptRun::Whole(report))
}
