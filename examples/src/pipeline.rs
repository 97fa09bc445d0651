//! Pipeline parallelism for the bundled GPT: [`GptStage`], the GPT staged by
//! `burn-pipeline`'s [`Sequential`] (its [`GptInput`] embedding on the first stage, its
//! [`GptOutput`] final norm, head and loss on the last, [`GptLayer`] blocks on every stage),
//! built from the same seeded [`Init`] as the single-device model so that each rank holds
//! exactly its stages' single-device parameters and nothing else; and
//! [`train_gpt_pipeline`], the trainer over a `pp x dp` mesh running any schedule of
//! `burn-pipeline`.
//!
//! ```text
//! gpt --ranks 2 --pp 2 --schedule 1f1b --microbatches 4
//! gpt --ranks 4 --pp 2 --schedule zbv --microbatches 4           # pp 2 x dp 2, V order
//! gpt --ranks 2 --pp 2 --schedule interleaved --virtual-stages 2 --microbatches 4
//! ```
//!
//! Global-norm clipping (`--clip`) holds every stage's optimizer step until the step's
//! backward is complete: the norm is summed over the pipeline ranks first, so the clipped
//! update is the single-device one. Activation checkpointing (`--checkpoint-activations`)
//! recomputes each stage's forward in its backward ([`burn_pipeline::runtime::Checkpointing`]).
//! [`PipelineReport::timeline`] is the last step's timeline of every rank, for a
//! Chrome/Perfetto trace (`--trace FILE`) and the measured bubble.
//! Checkpoints are saved under the whole model's names (`gpt --pp 2 --save D --save-every N`,
//! `--resume D`), which any other split or layout loads, ZeRO stage optimizers' sharded state
//! included; a run may start from a Hugging Face checkpoint (`--init-from-hf DIR`), each stage
//! reading its own tensors.
//!
//! Limits, each a typed error ([`check_pipeline`]): FSDP (`--zero 3`), context parallelism
//! and a GPT-MoE inside a pipeline (not composed yet), dropout with activation checkpointing
//! (the recomputed masks would differ).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ParamId};
use burn::tensor::{Device, Tensor};
use burn_moe::MoeParallel;
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::{Embedding, Linear, TpContext};
use burn_parallel::plan::TpPlan;
use burn_parallel::tensor_parallel::SeededDropout;
use burn_parallel::{CollectiveError, ProcessGroup, ReduceOp};
use burn_parallel_train::pipeline::{
    Balance, LayerTimes, PathMap, Stager, measure_layer_times, split_layers,
};
use burn_parallel_train::{
    Built, Layout, ModelParts, ParallelModel, StageParts, StagedModel, StepLog,
};
use burn_pipeline::generators;
use burn_pipeline::partition;
use burn_pipeline::runtime::StepReport;
use burn_pipeline::sequential::{InputLayer, Layer, Sequential};
use burn_pipeline::stage::StageError;
use burn_pipeline::trace::{StepTrack, Timeline};
use burn_zero::FsdpPlan;

use crate::data::{Batch, Corpus, Split};
use crate::gpt::{
    Block, Embeddings, Gpt, GptConfig, INIT_STD, Norm, OutputLayer, Pass, PositionKind,
};
use crate::train::{NamedParam, StepStats, TrainConfig, TrainReport, train_layout};

/// How the GPT's blocks are split into stages: a policy of the library's ([`Balance`]:
/// by count, by parameters, explicit boundaries, given times), or measured first.
#[derive(Debug, Clone, PartialEq)]
pub enum StageSplit {
    /// The library's split ([`split_layers`]), made when the stages are built.
    Balance(Balance),
    /// Balanced by time: the trainer measures the forward and backward of the embedding, one
    /// block and the head on a micro-batch ([`measure_layer_times`], averaged over the ranks
    /// so that every rank splits alike) and splits by [`Balance::Times`].
    Measured,
}

impl Default for StageSplit {
    fn default() -> Self {
        Self::Balance(Balance::Count)
    }
}

impl From<Balance> for StageSplit {
    fn from(balance: Balance) -> Self {
        Self::Balance(balance)
    }
}

/// Activation checkpointing of a pipelined GPT (the layout's).
pub use burn_parallel_train::Recompute;

/// Checks that `world` ranks can train `config` pipelined under `layout` (`pp > 1`, its
/// micro-batches `config.grad_accum`) with the blocks split as `split` says, before anything
/// is built: the layout's and the config's rules ([`TrainConfig::validate_layout`]), then the
/// schedule and the split.
///
/// # Errors
/// [`burn_parallel::Error::Invalid`] naming the setting to change;
/// [`burn_parallel::Error::Technique`] holding the schedule's
/// [`burn_pipeline::ScheduleError`] or the split's [`partition::PartitionError`].
pub fn check_pipeline(
    config: &TrainConfig,
    layout: &Layout,
    split: &StageSplit,
    world: usize,
) -> Result<(), burn_parallel::Error> {
    config
        .validate_layout(layout, world)
        .map_err(|e| burn_parallel::Error::invalid("the pipeline", e))?;
    let p = &layout.pipeline;
    let schedule = generators::generate(p.schedule, layout.pp, config.grad_accum, p.virtual_stages)
        .map_err(technique)?;
    // Explicit boundaries are checked as given. The other splits are made when the stages are
    // built (by parameters) or after measuring, and any feasible one has at least one block per
    // stage, as by count.
    let (n, stages) = (config.model.n_layers, schedule.num_stages());
    match split {
        StageSplit::Balance(Balance::Explicit(b)) => partition::explicit(n, stages, b),
        _ => partition::by_count(n, stages),
    }
    .map_err(technique)?;
    Ok(())
}

fn technique(e: impl std::error::Error + Send + Sync + 'static) -> burn_parallel::Error {
    burn_parallel::Error::Technique(Box::new(e))
}

/// One stage of the GPT, staged by `burn-pipeline`'s [`Sequential`]: the embedding
/// ([`GptInput`]) when it is the first stage, blocks `first_layer..first_layer + layers.len()`
/// ([`GptLayer`]), the final norm, head and loss ([`GptOutput`]) when it is the last.
/// Parameters carry the single-device model's values (same seed); [`model_names`] gives their
/// paths in the single-device model. Build it with [`build_stage`].
pub type GptStage = Sequential<GptInput, GptLayer, GptOutput>;

/// What every part of a stage needs for a forward besides its parameters.
#[derive(Debug, Clone)]
pub struct StageContext {
    /// The model's configuration.
    pub config: GptConfig,
    /// The tensor-parallel context the stage's layers were split under (single without
    /// tensor parallelism).
    pub tp: TpContext,
    /// Where the stage's tensors live.
    pub device: Device,
    /// The data-parallel stream of the dropout masks ([`Gpt::with_dropout_stream`]).
    pub stream: u64,
    /// The passes made so far, by sequence length: the stage's parts share one (its rotary
    /// tables are computed once per length, not once per layer).
    passes: Arc<Mutex<HashMap<usize, Pass>>>,
}

impl StageContext {
    /// The pass over `batch`'s sequences (rotary tables, this rank's tokens, dropout stream),
    /// as [`Gpt`]'s forward makes it.
    fn pass(&self, batch: &Batch) -> Pass {
        let s = batch.seq_len;
        let mut passes = self.passes.lock().unwrap_or_else(|e| e.into_inner());
        passes
            .entry(s)
            .or_insert_with(|| Pass {
                stream: self.stream,
                ..Pass::new(s, self.config.rope(s, 0, &self.device), &self.tp)
            })
            .clone()
    }
}

/// The first stage's embedding: token table, learned positions, dropout.
#[derive(Module, Debug)]
pub struct GptInput {
    /// Token embedding.
    pub wte: Embedding,
    /// Learned positions (learned positions only).
    pub wpe: Option<burn::nn::Embedding>,
    /// Embedding dropout.
    #[module(skip)]
    pub drop: Option<SeededDropout>,
    /// The stage's context.
    #[module(skip)]
    pub ctx: StageContext,
}

impl InputLayer<Batch> for GptInput {
    fn forward(&self, batch: &Batch) -> Result<Tensor<3>, StageError> {
        let (tokens, _) = batch.to_tensors(&self.ctx.device);
        Embeddings {
            wte: &self.wte,
            wpe: self.wpe.as_ref(),
            drop: self.drop.as_ref(),
            tp: &self.ctx.tp,
            config: &self.ctx.config,
        }
        .forward(tokens, 0, &self.ctx.pass(batch))
        .map_err(StageError::new)
    }
}

/// One transformer block of a stage.
#[derive(Module, Debug)]
pub struct GptLayer {
    /// The block.
    pub block: Block,
    /// The stage's context.
    #[module(skip)]
    pub ctx: StageContext,
}

impl Layer<Batch> for GptLayer {
    fn forward(&self, x: Tensor<3>, batch: &Batch) -> Result<Tensor<3>, StageError> {
        self.block
            .forward(x, &self.ctx.pass(batch))
            .map_err(StageError::new)
    }
}

/// The last stage's final norm, head and loss.
#[derive(Module, Debug)]
pub struct GptOutput {
    /// Final norm.
    pub ln_f: Norm,
    /// Output projection (untied embeddings).
    pub lm_head: Option<Linear>,
    /// The last stage's copy of the token table, the head of tied embeddings: the trainer
    /// sums its gradient with the first stage's ([`tied_weight`]).
    pub wte: Option<Embedding>,
    /// The stage's context.
    #[module(skip)]
    pub ctx: StageContext,
}

impl burn_pipeline::sequential::OutputLayer<Batch> for GptOutput {
    fn loss(&self, x: Tensor<3>, batch: &Batch) -> Result<Tensor<1>, StageError> {
        let x = if self.ctx.config.fused {
            self.ln_f.forward_fused(x)
        } else {
            self.ln_f.forward(x)
        };
        let (_, targets) = batch.to_tensors(&self.ctx.device);
        let (output, logits) = match (&self.lm_head, &self.wte) {
            (Some(head), _) => (OutputLayer::Head(head), head.forward(x)),
            (None, Some(wte)) => (OutputLayer::Tied(wte), wte.attend(x, &self.ctx.tp)),
            (None, None) => return Err(StageError::new("the last stage has no output layer")),
        };
        let logits = logits.map_err(StageError::new)?;
        output
            .loss(self.ctx.config.fused, logits, targets)
            .map_err(StageError::new)
    }
}

/// Builds stage `index` of `num_stages` holding blocks `layers`, from `init`: the
/// single-device seed and device, and for tensor parallelism the GPT's plan
/// (`init.with_tp(group, Gpt::tp_plan(..))`; its rules for the embedding and the head match
/// only on the first and last stage); dropout masks of data-parallel stream `stream`.
///
/// # Errors
/// [`burn_parallel::Error::Invalid`] for an invalid model, a GPT-MoE or fewer than 2 stages;
/// the tensor-parallel split's error when a layer cannot be built.
///
/// # Example
/// ```
/// use burn::tensor::Device;
/// use burn_parallel::init::Init;
/// use examples::gpt::GptConfig;
/// use examples::pipeline::build_stage;
///
/// let config = GptConfig::new(256, 4, 2, 16, 16);
/// let init = Init::new(config.seed, &Device::flex());
/// let last = build_stage(&config, &init, 1, 2, 2..4, 0).unwrap();
/// assert!(last.input.is_none() && last.output.is_some());
/// assert_eq!(last.layers.len(), 2);
/// ```
pub fn build_stage(
    config: &GptConfig,
    init: &Init,
    index: usize,
    num_stages: usize,
    layers: Range<usize>,
    stream: u64,
) -> Result<GptStage, burn_parallel::Error> {
    use burn_parallel::Error;
    config.validate().map_err(|e| Error::invalid("model", e))?;
    if config.moe.is_some() {
        return Err(Error::invalid(
            "--moe-experts",
            "a GPT-MoE is not supported with pipeline parallelism yet; use data and expert \
             parallelism (--ep) without --pp",
        ));
    }
    if num_stages < 2 {
        return Err(Error::invalid(
            "--pp",
            format!(
                "a pipeline of {num_stages} stage(s): split the model into 2 stages or more, \
                 or train it without pipeline parallelism"
            ),
        ));
    }
    let (d, v) = (config.d_model, config.vocab_size);
    let ctx = StageContext {
        config: config.clone(),
        tp: init.context(),
        device: init.device().clone(),
        stream,
        passes: Arc::default(),
    };
    let wte = || init.embedding("wte", v, d, INIT_STD);
    let input = || {
        Ok(GptInput {
            wte: wte()?,
            wpe: match config.positions {
                PositionKind::Learned => Some(burn::nn::Embedding {
                    weight: init
                        .at("wpe")
                        .normal("weight", [config.max_seq_len, d], INIT_STD),
                }),
                PositionKind::Rotary => None,
            },
            drop: (config.dropout > 0.0)
                .then(|| SeededDropout::new(config.dropout, init.seed(), &init.path("drop"))),
            ctx: ctx.clone(),
        })
    };
    let layer = |i: usize| {
        Ok(GptLayer {
            block: Block::new(&config.block(), &init.at("blocks").at(i))?,
            ctx: ctx.clone(),
        })
    };
    let output = || {
        Ok(GptOutput {
            ln_f: Norm::new(config.norm, d, config.norm_eps, &init.at("ln_f")),
            lm_head: match config.tied_embeddings {
                true => None,
                false => Some(
                    init.linear(
                        "lm_head",
                        LinearInit::new(d, v)
                            .with_bias(config.bias)
                            .with_std(INIT_STD),
                    )?,
                ),
            },
            // Tied embeddings: the last stage holds its own copy of the token table for the
            // head.
            wte: match config.tied_embeddings {
                true => Some(wte()?),
                false => None,
            },
            ctx: ctx.clone(),
        })
    };
    Sequential::build(index, num_stages, layers, input, layer, output)
}

/// `stage` with the weight gradients of every linear layer (attention, MLP, head) deferred to
/// the schedule's `W` steps: `I` computes only the input gradient (and the small
/// parameters'), which is what makes ZB-H1 and ZBV zero-bubble. Harmless under schedules
/// without `W` (a full `B` computes the deferred gradients at once).
pub fn with_deferred_weights(stage: GptStage, on: bool) -> GptStage {
    let sink = on.then(|| stage.weight_sink());
    let mut stage = stage.with_deferred_weights(on);
    stage.layers = std::mem::take(&mut stage.layers)
        .into_iter()
        .map(|l| GptLayer {
            block: l.block.with_deferred_weights(sink.clone()),
            ctx: l.ctx,
        })
        .collect();
    stage.output = stage.output.take().map(|o| GptOutput {
        lm_head: o.lm_head.map(|h| h.with_deferred_weight(sink.clone())),
        ..o
    });
    stage
}

/// `stage`'s parameters, whole (tensor-parallel shards gathered), at the single-device model's
/// paths ([`model_names`]). A collective over the tensor-parallel group of `tp`.
///
/// # Errors
/// Collective errors of the gather.
pub fn stage_params(stage: &GptStage, tp: &TpContext) -> Result<Vec<NamedParam>, CollectiveError> {
    let name = model_names(stage.first_layer);
    Ok(tp
        .full_params(stage)?
        .into_iter()
        .map(|(path, data)| NamedParam {
            path: name(&path),
            shape: data.shape().to_vec(),
            values: data
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("a float parameter reads as f32"),
        })
        .collect())
}

/// The id of `stage`'s copy of the token table when the model ties it to the head: the first
/// stage's input table and the last stage's copy in its output, whose gradients must be summed
/// before either steps.
pub fn tied_weight(stage: &GptStage) -> Option<ParamId> {
    let first = stage
        .input
        .as_ref()
        .filter(|i| i.ctx.config.tied_embeddings)
        .map(|i| i.wte.weight.id);
    first.or_else(|| {
        let output = stage.output.as_ref()?;
        output.wte.as_ref().map(|w| w.weight.id)
    })
}

/// What a pipelined run reports besides [`TrainReport`]: the last step's per-rank timeline.
#[derive(Debug, Clone)]
pub struct PipelineReport {
    /// Losses, validation loss, sample, timing and the final parameters (whole, by path).
    pub train: TrainReport,
    /// This rank's report of the last step (timeline, peak micro-batches held).
    pub last_step: Option<StepReport>,
    /// Parameters this rank holds (its stages' share under tensor parallelism).
    pub held_params: usize,
    /// The blocks of each stage.
    pub split: Vec<Range<usize>>,
    /// The last step's timeline on every rank (track `pp r / dp d`), for
    /// [`Timeline::chrome_trace`] and [`Timeline::bubble_fraction`].
    pub timeline: Timeline,
}

/// Trains the GPT of `config` with pipeline parallelism over `layout.pp` ranks and data
/// parallelism over the `world / pp` replicas (mesh `[pp, dp_replicate]`, with tensor
/// parallelism inside each stage when `layout.tp > 1`), running `layout.pipeline`'s schedule.
/// Each data-parallel rank takes its rows of the global batch and splits them into
/// `config.grad_accum` micro-batches; each stage's gradients are averaged over its replicas at
/// the schedule's `REDUCE` and stepped by its own optimizer (ZeRO-1/2 with `layout.zero`).
/// Whatever the schedule, the losses and final parameters are those of single-device training
/// on the same global batch. Checkpoints (`config.save`, `config.resume`) hold each stage's
/// parameters and optimizer state under the whole model's names (a stage's local block `i` is
/// block `first_layer + i`; a tied token table is written once), so another split or a layout
/// without a pipeline loads them, and the other way round; a run may start from a Hugging Face
/// checkpoint (`config.init_from_hf`), each stage reading its own tensors. At the end every
/// rank gathers the whole model (for the validation loss, the sample and the report).
///
/// # Errors
/// [`check_pipeline`]'s, before any communication; the pipeline's, the collectives' and the
/// checkpoints' while running.
pub fn train_gpt_pipeline(
    world: &ProcessGroup,
    config: &TrainConfig,
    layout: &Layout,
    split: &StageSplit,
    corpus: &Corpus,
    on_step: &mut dyn FnMut(&StepStats),
) -> Result<PipelineReport, burn_parallel::Error> {
    check_pipeline(config, layout, split, world.size())?;
    let device = config.device.device()?.autodiff();
    let settings = config.step_settings();
    let dp_size = layout.data_parallel_size(world.size());
    let mut model = StagedGpt {
        config: config.model.clone(),
        balance: Balance::Count,
    };
    model.balance = match split {
        StageSplit::Balance(balance) => balance.clone(),
        StageSplit::Measured => {
            let rows = config.batch_size / dp_size / config.grad_accum;
            let probe = corpus.batch_rows(0, 0..rows, config.seq_len, Split::Train);
            let t = measure_layer_times(&model, &probe, &device, 3)?;
            // Every rank splits alike: the mean of the ranks' measurements.
            let mean = world.all_reduce_f32(
                vec![t.first as f32, t.layer as f32, t.last as f32],
                ReduceOp::Avg,
            )?;
            Balance::Times(LayerTimes {
                first: mean[0].into(),
                layer: mean[1].into(),
                last: mean[2].into(),
            })
        }
    };
    // ---- the library's builder stages the GPT (`StagedGpt`), its loop trains it ----
    // Before the stages are gathered: this rank's last step and the timeline of every rank.
    let mut figures = None;
    let mut keep = |built: &Built<StagedGpt>| {
        let stages = built.pipeline().expect("a pipeline layout");
        let last_step = stages.last_step().cloned();
        let timeline = match &last_step {
            Some(report) => {
                let (mesh, dp) = (&built.groups.mesh, built.groups.data.rank());
                let group = |name| mesh.group(name).map_err(burn_parallel::Error::from);
                let (pp, tp) = (group("pp")?.rank(), group("tp")?);
                let name = match tp.size() {
                    1 => format!("pp {pp} / dp {dp}"),
                    _ => format!("pp {pp} / dp {dp} / tp {}", tp.rank()),
                };
                let tracks = built
                    .groups
                    .world
                    .all_gather_object(&StepTrack::new(name, report))?;
                Timeline::from_steps(&tracks)
                    .map_err(|e| burn_parallel::Error::invalid("--trace", e))?
            }
            None => Timeline::default(),
        };
        let split = stages.split().to_vec();
        figures = Some((last_step, stages.held_params(), split, timeline));
        Ok(())
    };
    // (No MoE figures: a GPT-MoE is refused under pipeline parallelism.)
    let no_moe = &mut |_: &StepLog, _: &Built<StagedGpt>| Ok(Vec::new());
    let run = (layout, &model, &settings);
    let train = train_layout(world, config, run, corpus, on_step, (no_moe, &mut keep))?;
    let (last_step, held_params, split, timeline) = figures.expect("the run's end was reached");
    Ok(PipelineReport {
        train,
        last_step,
        held_params,
        split,
        timeline,
    })
}

/// The GPT staged for the builder: its blocks split as `balance` says ([`split_layers`]: by
/// count, by parameters, explicit boundaries or measured times), each stage a [`GptStage`].
#[derive(Debug, Clone)]
pub struct StagedGpt {
    /// The model.
    pub config: GptConfig,
    /// How its blocks are split into stages.
    pub balance: Balance,
}

impl ParallelModel for StagedGpt {
    type Model = Gpt;
    type Batch = Batch;

    fn loss(model: &Gpt, batch: &Batch) -> Result<Tensor<1>, burn_parallel::Error> {
        GptConfig::loss(model, batch)
    }
    fn n_heads(&self) -> usize {
        self.config.n_heads
    }
    fn n_experts(&self) -> Option<usize> {
        self.config.n_experts()
    }
    fn has_dropout(&self) -> bool {
        self.config.has_dropout()
    }
    fn seed(&self) -> u64 {
        self.config.seed
    }
    fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        self.config.tp_plan(sequence_parallel)
    }
    fn fsdp_plan(&self, shard: &ProcessGroup, experts: &MoeParallel) -> FsdpPlan {
        self.config.fsdp_plan(shard, experts)
    }
    fn build(&self, parts: &ModelParts) -> Result<Gpt, burn_parallel::Error> {
        self.config.build(parts)
    }
    fn dropout_layers(model: &Gpt) -> Vec<(String, SeededDropout)> {
        GptConfig::dropout_layers(model)
    }
    fn stages(&self) -> Option<&dyn Stager<Self>> {
        Some(self)
    }
}

impl StagedModel for StagedGpt {
    type Stage = GptStage;

    fn n_layers(&self) -> usize {
        self.config.n_layers
    }

    fn split(
        &self,
        num_stages: usize,
        device: &Device,
    ) -> Result<Vec<Range<usize>>, burn_parallel::Error> {
        split_layers(self, num_stages, &self.balance, device)
    }

    fn stage(&self, parts: &StageParts<'_>) -> Result<GptStage, burn_parallel::Error> {
        let stream = parts.data_rank as u64;
        let (index, stages) = (parts.index, parts.num_stages);
        let stage = build_stage(
            &self.config,
            parts.init,
            index,
            stages,
            parts.layers.clone(),
            stream,
        )?
        .with_checkpointed_layers(parts.recompute_layers);
        Ok(with_deferred_weights(stage, parts.defer_weights))
    }

    fn model_paths(stage: &GptStage) -> PathMap {
        Arc::new(model_names(stage.first_layer))
    }

    fn tied_weight(stage: &GptStage) -> Option<ParamId> {
        tied_weight(stage)
    }

    fn stage_dropout_layers(stage: &GptStage) -> Vec<(String, SeededDropout)> {
        stage_dropouts(stage)
    }

    fn variable_dims(&self) -> Vec<usize> {
        // Micro-batches may differ in sequence length.
        vec![1]
    }
}

/// The dropout layers of a stage, by the whole model's names.
fn stage_dropouts(stage: &GptStage) -> Vec<(String, SeededDropout)> {
    let mut out = Vec::new();
    if let Some(drop) = stage.input.as_ref().and_then(|i| i.drop.as_ref()) {
        out.push(("drop".to_string(), drop.clone()));
    }
    for (i, layer) in stage.layers.iter().enumerate() {
        let name = format!("blocks.{}", stage.first_layer + i);
        layer.block.dropout_layers(&name, &mut out);
    }
    out
}

/// The single-device model's name of a parameter path of a stage whose first block is model
/// block `first_layer`: `input.*` and `output.*` lose their prefix (`input.wte.weight` and a
/// tied head's `output.wte.weight` are both `wte.weight`), local layer `i`'s
/// `layers.{i}.block.*` is `blocks.{first_layer + i}.*`.
pub fn model_names(first_layer: usize) -> impl Fn(&str) -> String + Send + Sync + Clone + 'static {
    move |name| {
        if let Some(rest) = name.strip_prefix("input.") {
            return rest.to_string();
        }
        if let Some(rest) = name.strip_prefix("output.") {
            return rest.to_string();
        }
        let Some(rest) = name.strip_prefix("layers.") else {
            return name.to_string();
        };
        let (local, tail) = rest.split_once('.').unwrap_or((rest, ""));
        match (local.parse::<usize>(), tail.strip_prefix("block.")) {
            (Ok(i), Some(tail)) => format!("blocks.{}.{tail}", first_layer + i),
            (Ok(i), None) if tail == "block" => format!("blocks.{}", first_layer + i),
            _ => name.to_string(),
        }
    }
}

/// The `gpt` binary's pipeline flags besides the layout's (`--pp`, `--schedule`,
/// `--virtual-stages`, `--checkpoint-activations`, `--checkpoint-blocks`) and the
/// micro-batches (`--microbatches`, the accumulation's `--grad-accum`).
#[derive(Debug, Clone, clap::Args)]
pub struct PipelineArgs {
    /// Balance the stages by parameter count (embedding on the first, head on the last)
    /// instead of by block count.
    #[arg(long, conflicts_with = "balance_time")]
    pub balance_params: bool,
    /// Balance the stages by the measured forward + backward time of the embedding, a block
    /// and the head (measured on every rank before training, averaged).
    #[arg(long)]
    pub balance_time: bool,
    /// Write the last step's Chrome/Perfetto trace (one track per rank) to this file.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
}

impl PipelineArgs {
    /// The split these flags ask for.
    pub fn split(&self) -> StageSplit {
        match (self.balance_params, self.balance_time) {
            (true, _) => Balance::Params.into(),
            (_, true) => StageSplit::Measured,
            _ => Balance::Count.into(),
        }
    }
}
