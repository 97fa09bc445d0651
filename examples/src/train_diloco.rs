//! The GPT trained with DiLoCo (`gpt --diloco-islands N --inner-steps H ...`): the technique is
//! [`burn_parallel::diloco`] and its step engine the library's
//! ([`burn_parallel_train::diloco::DiLoCoEngine`]); this file only wires the GPT to the
//! builder (a [`Layout`] with [`DiLoCoLayout`]) and to the loop ([`fit_with`]).
//!
//! The world's ranks form `N` islands of `ranks / N` ranks; each island trains with data
//! parallelism inside (DDP over its ranks) and its own inner optimizer, and the outer step
//! runs every `H` steps (per fragment under streaming DiLoCo). The global batch of a step is
//! that of [`crate::train::train_gpt`], cut over all ranks, so a run spends the same
//! tokens as a DDP run of the same config: with inner SGD, `H` = 1, outer learning rate 1 and
//! no momentum it *is* DDP with SGD.
//!
//! Every byte a rank sends goes through [`count_sent_bytes`]: the report gives the outer sync's
//! bytes and the total (inner DDP and the loss figures included).
//!
//! With `--diloco-drop-lost` ([`DiLoCoConfig::drop_lost_islands`]) an island that disappears is
//! dropped and the others go on: nothing then runs over the whole world after the start, so the
//! step losses and the validation loss are those of this rank's island (its rows of the global
//! batch), and each rank reports only its own bytes.

use burn_parallel::ProcessGroup;
use burn_parallel::diloco::count_sent_bytes;
pub use burn_parallel_train::diloco::{CompressionArg, DiLoCoFlags, InnerOptimArg};
use burn_parallel_train::{Built, DiLoCoFigures, DiLoCoLayout, Layout, StepLog};

use crate::data::Corpus;
use crate::gpt::GptConfig;
use crate::train::{Parallelism, StepStats, TrainConfig, TrainReport, train_layout};

/// What a DiLoCo run gives: the trainer's report and the bytes this rank sent.
#[derive(Debug, Clone)]
pub struct DiLoCoReport {
    /// Losses (global mean per step), validation loss of the final outer model, parameters.
    pub train: TrainReport,
    /// The bytes this rank sent (in outer syncs, and in all), the syncs it took part in, the
    /// islands dropped and the stall of the syncs.
    pub figures: DiLoCoFigures,
}

/// Checks a DiLoCo run of `config` under `run` on `world` ranks, with the other layout
/// settings of `parallel` (which DiLoCo refuses unless they are plain data parallelism), before
/// anything is built: [`Layout::validate`]'s rules, then the run's.
///
/// # Errors
/// [`burn_parallel::Error::Invalid`] naming the setting to change.
pub fn validate_diloco(
    config: &TrainConfig,
    run: &DiLoCoLayout,
    parallel: &Parallelism,
    world: usize,
) -> Result<(), burn_parallel::Error> {
    let layout = Layout {
        diloco: Some(*run),
        ..*parallel
    };
    let work = config.step_settings().workload(&config.model);
    layout.validate(world, &work)?;
    config
        .validate(world)
        .map_err(|e| burn_parallel::Error::invalid("--diloco-islands", e))
}

/// Trains the GPT of `config` with DiLoCo on `world` (every rank calls it) and calls `on_step`
/// after every inner step (the loss is the global batch's: averaged over every rank). It saves
/// and resumes as `config.save` and `config.resume` say; a checkpoint
/// ([`burn_parallel_train::diloco::DiLoCoCheckpoint`]) holds:
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
/// [`validate_diloco`]'s (before any communication); a lost island
/// ([`burn_parallel::Error::DiLoCo`]), collective failures; a checkpoint that cannot be read,
/// is of another run (model, DiLoCo settings, islands) or cannot be written; a Hugging Face
/// checkpoint (`init_from_hf`, every island's start) that cannot be read or is of another model.
pub fn train_gpt_diloco(
    world: &ProcessGroup,
    config: &TrainConfig,
    run: &DiLoCoLayout,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<DiLoCoReport, burn_parallel::Error> {
    validate_diloco(config, run, &Parallelism::default(), world.size())?;
    // Everything runs on the counting world, the builder's checks and groups included.
    let (world, counter) = count_sent_bytes(world)?;
    let layout = Layout {
        diloco: Some(*run),
        ..Layout::default()
    };
    // The inner step is the library's under the run's precision policy, DDP inside the
    // island; the outer sync sees the fp32 weights. No MoE figures (refused above); the outer
    // loop's figures are read after the final sync.
    let mut handle = None;
    let mut keep = |built: &Built<GptConfig>| {
        handle = built.diloco.clone();
        Ok(())
    };
    let no_moe = &mut |_: &StepLog, _: &Built<GptConfig>| Ok(Vec::new());
    let settings = config.step_settings();
    let run = (&layout, &config.model, &settings);
    let train = train_layout(&world, config, run, corpus, on_step, (no_moe, &mut keep))?;
    let figures = handle
        .expect("a DiLoCo layout has DiLoCo's engine")
        .figures(&counter);
    Ok(DiLoCoReport { train, figures })
}
