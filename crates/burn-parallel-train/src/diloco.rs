//! DiLoCo under the builder: its step engine ([`DiLoCoEngine`]), the handle a caller reads
//! the outer loop through ([`DiLoCoHandle`]: history, islands, time in syncs, and with the
//! world's byte counter the run's [`DiLoCoFigures`]), and its checkpoints
//! ([`DiLoCoCheckpoint`]): what a DiLoCo run saves besides its step engine's state, under
//! names any layout reads.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use burn::module::{Module, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel::checkpoint::{
    self, Checkpoint, CheckpointError, Checkpointer, ParamMap, Piece, TensorSource, merged_scalars,
};
#[cfg(feature = "cli")]
use burn_parallel::diloco::Compression;
use burn_parallel::diloco::{
    ByteCounter, DiLoCo, DiLoCoConfig, DiLoCoMeta, DiLoCoState, Islands, SyncEvent,
};
use burn_parallel::nn::TpContext;
use burn_parallel::train::{
    OPTIM_SCALARS, SaveState, StepEngine, StepOutput, Trainer, engine_states, saved_engine_states,
};
use burn_parallel::{Error, ProcessGroup, ReduceOp};
use serde_json::Value;

use crate::layout::DiLoCoLayout;
use crate::saved::saved_state;

/// Key of DiLoCo's bookkeeping ([`DiLoCoMeta`]) in the caller's state of a checkpoint
/// ([`crate::saved_state`]): where [`DiLoCoCheckpoint::pieces`]'s `meta` goes.
pub const DILOCO_STATE: &str = "diloco";

/// Where a DiLoCo run's tensors go in a checkpoint, and back: the outer model under the model's
/// own names (so that a run without DiLoCo loads it), the outer momentum and the pseudo-gradients
/// in flight under `diloco/momentum/` and `diloco/in_flight.<j>/`, and each island's model and
/// inner optimizer state under `diloco/island.<k>/`.
///
/// The caller saves the pieces with its checkpointer, and DiLoCo's `meta` under
/// [`DILOCO_STATE`] in its own state; [`DiLoCoCheckpoint::load`] reads both back.
pub struct DiLoCoCheckpoint {
    /// The model under its own names, each tensor written by one rank of the world (the outer
    /// model and the outer optimizer's state are the same everywhere).
    shared: ParamMap,
    /// This island's model, under `diloco/island.<k>/`, written by the island's ranks.
    island: ParamMap,
    /// The outer model and every island's model: what a checkpoint of this run must hold
    /// besides DiLoCo's and the optimizers' state.
    expected: BTreeMap<String, Vec<usize>>,
}

impl DiLoCoCheckpoint {
    /// The names of `model` (its tensor-parallel context `tp`) trained by `islands` of
    /// `world`.
    ///
    /// # Errors
    /// A parameter [`ParamMap`] cannot describe.
    pub fn new<M: Module>(
        model: &M,
        tp: &TpContext,
        world: &ProcessGroup,
        islands: &Islands,
    ) -> Result<Self, Error> {
        let plain = ParamMap::new(model, tp, None)?;
        let shared = plain
            .clone()
            .with_replicas(|_| (world.size(), world.rank()));
        let (size, rank) = (islands.island().size(), islands.island().rank());
        let island = plain
            .clone()
            .with_replicas(|_| (size, rank))
            .with_logical_names(|name| island_name(islands.index(), name));
        let shapes = plain.logical_shapes();
        let mut expected = shapes.clone();
        for k in 0..islands.count() {
            expected.extend(shapes.iter().map(|(n, s)| (island_name(k, n), s.clone())));
        }
        Ok(Self {
            shared,
            island,
            expected,
        })
    }

    /// This rank's pieces, DiLoCo's bookkeeping and the inner optimizer's scalars (for the
    /// rank state, as [`burn_parallel::train::engine_states`] keeps them).
    ///
    /// # Errors
    /// DiLoCo's state cannot be taken; a parameter or state that cannot be described.
    pub fn pieces<M: Module>(
        &self,
        model: &M,
        optim: &ModuleOptimizer,
        diloco: &mut DiLoCo,
    ) -> Result<(Vec<Piece>, DiLoCoMeta, Value), Error> {
        let state = diloco.state()?;
        let mut pieces = self.island.param_pieces(model)?;
        let (inner, scalars) = self.island.optimizer_pieces(optim.to_record())?;
        pieces.extend(inner);
        let shared = |prefix: &str, values: &HashMap<ParamId, TensorData>| {
            self.shared
                .clone()
                .only(|p| values.contains_key(&p.id))
                .value_pieces(prefix, values)
        };
        pieces.extend(shared("", &state.outer)?);
        pieces.extend(shared(MOMENTUM, &state.momentum)?);
        for (j, grads) in state.in_flight.iter().enumerate() {
            pieces.extend(shared(&in_flight(j), grads)?);
        }
        Ok((pieces, state.meta, scalars))
    }

    /// `model` (this island's) and `optim` as saved (`fresh` makes an empty one of its kind),
    /// and `diloco`'s state restored.
    ///
    /// # Errors
    /// A checkpoint not saved by a DiLoCo run, or by another (model, settings, islands); read
    /// errors.
    pub fn load<M: Module>(
        &self,
        model: M,
        (optim, fresh): (&mut ModuleOptimizer, &dyn Fn() -> ModuleOptimizer),
        diloco: &mut DiLoCo,
        checkpoint: &Checkpoint,
    ) -> Result<M, Error> {
        let meta: DiLoCoMeta = match saved_state(checkpoint).get(DILOCO_STATE) {
            Some(meta) => serde_json::from_value(meta.clone()).map_err(|e| {
                Error::invalid(
                    "checkpoint",
                    format!(
                        "{}: DiLoCo's state does not parse ({e}); the checkpoint is damaged",
                        checkpoint.dir().display()
                    ),
                )
            })?,
            None => {
                return Err(Error::invalid(
                    "checkpoint",
                    format!(
                        "{} was not saved by a DiLoCo run (it holds no outer momentum nor the \
                     islands' models): resume it without DiLoCo, or start DiLoCo from its \
                     weights with a run that saves again",
                        checkpoint.dir().display()
                    ),
                ));
            }
        };
        // The islands' models are checked with the model (the other tensors, named with a
        // `/`, as they are read).
        let island = self
            .island
            .clone()
            .with_logical_shapes(self.expected.clone(), "the DiLoCo run")?;
        let model = island.load_params(model, checkpoint)?;
        let scalars = merged_scalars(checkpoint, OPTIM_SCALARS);
        if let Some(record) = island.load_optimizer(checkpoint, &scalars)? {
            let empty = std::mem::replace(optim, fresh());
            *optim = empty.load_record(record);
        }
        let read = |prefix: &str| {
            let names: std::collections::HashSet<&str> = checkpoint
                .shapes()
                .into_iter()
                .filter_map(|(n, _)| n.strip_prefix(prefix))
                .collect();
            self.shared
                .clone()
                .only(|p| {
                    p.segments
                        .iter()
                        .all(|s| names.contains(s.logical.as_str()))
                })
                .read_values(checkpoint, prefix, DType::F32)
        };
        let state = DiLoCoState {
            outer: read("")?,
            momentum: read(MOMENTUM)?,
            in_flight: (0..meta.in_flight())
                .map(|j| read(&in_flight(j)))
                .collect::<Result<_, _>>()?,
            meta,
        };
        diloco.restore(state)?;
        Ok(model)
    }
}

/// Prefix of the outer momentum's tensors.
const MOMENTUM: &str = "diloco/momentum/";

/// Prefix of the averaged pseudo-gradient of exchange `j` in flight.
fn in_flight(j: usize) -> String {
    format!("diloco/in_flight.{j}/")
}

/// The name of island `k`'s copy of parameter `name`.
fn island_name(k: usize, name: &str) -> String {
    format!("diloco/island.{k}/{name}")
}

/// DiLoCo as a [`StepEngine`]: the inner step over this rank's island (DDP inside it, the
/// layout's precision and clipping), then DiLoCo's outer sync after every step (which averages
/// the islands' models every `H` steps). Built by [`crate::build()`] for a layout with
/// [`crate::layout::DiLoCoLayout`]; checkpoints through [`DiLoCoCheckpoint`]; its outer loop is
/// read through [`DiLoCoEngine::handle`] (also [`crate::Built::diloco`]).
///
/// The loss it reports is averaged over [`DiLoCoHandle::loss_group`]: the world, or the
/// island when lost islands are dropped (the world may then have lost ranks).
pub struct DiLoCoEngine {
    inner: Trainer,
    fresh: Box<dyn Fn() -> ModuleOptimizer + Send + Sync>,
    /// DiLoCo, shared with the caller's handles: saving and the final model read its state
    /// through `&self`.
    handle: DiLoCoHandle,
    names: DiLoCoCheckpoint,
    /// Steps done (the outer sync's clock).
    step: usize,
}

impl DiLoCoEngine {
    /// DiLoCo of `config` over `islands` of `world`, starting from `model` (identical on every
    /// rank), stepping each island with `inner` (a step whose data-parallel group is the
    /// island); `fresh` makes an empty inner optimizer of the kind `inner` holds.
    ///
    /// # Errors
    /// DiLoCo's settings; a model the checkpoint names cannot describe.
    pub fn new<M: Module>(
        world: &ProcessGroup,
        islands: &Islands,
        config: DiLoCoConfig,
        model: &M,
        tp: &TpContext,
        (inner, fresh): (Trainer, Box<dyn Fn() -> ModuleOptimizer + Send + Sync>),
    ) -> Result<Self, Error> {
        let loss_group = match config.drop_lost_islands {
            true => islands.island().clone(),
            false => world.clone(),
        };
        let handle = DiLoCoHandle(Arc::new(Shared {
            diloco: Mutex::new(DiLoCo::new(islands, config, model)?),
            islands: islands.clone(),
            loss_group,
            timing: Mutex::default(),
        }));
        Ok(Self {
            inner,
            fresh,
            handle,
            names: DiLoCoCheckpoint::new(model, tp, world, islands)?,
            step: 0,
        })
    }

    /// The outer loop as the caller reads it: its history, islands and time in syncs. It
    /// stays valid after the engine is consumed ([`crate::Built::trained`] runs the final
    /// sync, after which the history is complete).
    pub fn handle(&self) -> DiLoCoHandle {
        self.handle.clone()
    }

    fn diloco(&self) -> MutexGuard<'_, DiLoCo> {
        self.handle.diloco()
    }
}

/// A DiLoCo run's outer loop, shared by its [`DiLoCoEngine`] and the caller
/// ([`crate::Built::diloco`]): what to report once the run is done. Cheap to clone.
#[derive(Clone)]
pub struct DiLoCoHandle(Arc<Shared>);

struct Shared {
    diloco: Mutex<DiLoCo>,
    islands: Islands,
    loss_group: ProcessGroup,
    timing: Mutex<SyncTiming>,
}

/// The seconds spent in [`DiLoCo::sync`], the engine's first step excluded (as a step timer
/// excludes the warm-up step, and the first step after a resume).
#[derive(Debug, Default)]
struct SyncTiming {
    steps: usize,
    timed: usize,
    seconds: f64,
}

impl DiLoCoHandle {
    fn diloco(&self) -> MutexGuard<'_, DiLoCo> {
        self.0.diloco.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn timing(&self) -> MutexGuard<'_, SyncTiming> {
        self.0.timing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The islands: this rank's island (its inner data parallelism) and its outer group (the
    /// pseudo-gradient average, whose bytes [`ByteCounter::sent_in`] counts).
    pub fn islands(&self) -> &Islands {
        &self.0.islands
    }

    /// The ranks the step losses are averaged over, and a validation loss should be: the
    /// world, or this rank's island under [`DiLoCoConfig::drop_lost_islands`] (islands may be
    /// gone, so nothing runs over the whole world after the start).
    pub fn loss_group(&self) -> &ProcessGroup {
        &self.0.loss_group
    }

    /// Every fragment sync so far ([`DiLoCo::history`]; the final one of [`DiLoCo::finish`]
    /// once the trained model was taken).
    pub fn history(&self) -> Vec<SyncEvent> {
        self.diloco().history().to_vec()
    }

    /// The islands dropped so far, each with the inner step after whose sync it was dropped
    /// (`None`: in the final sync).
    pub fn dropped(&self) -> Vec<(usize, Option<usize>)> {
        self.diloco()
            .history()
            .iter()
            .flat_map(|e| e.dropped.iter().map(|&i| (i, e.step)))
            .collect()
    }

    /// Mean seconds per step spent in [`DiLoCo::sync`] (the stall of the outer syncs), the
    /// first step this engine took excluded; 0 when no step was timed.
    pub fn sync_seconds(&self) -> f64 {
        let timing = self.timing();
        match timing.timed {
            0 => 0.0,
            n => timing.seconds / n as f64,
        }
    }

    /// Adds one step's time in the sync.
    fn add_sync_time(&self, seconds: f64) {
        let mut timing = self.timing();
        if timing.steps > 0 {
            timing.seconds += seconds;
            timing.timed += 1;
        }
        timing.steps += 1;
    }

    /// The run's figures, with the bytes this rank sent as `counter` counted them (the counter
    /// of [`burn_parallel::diloco::count_sent_bytes`], whose world the layout was built on).
    /// Take them after [`crate::Built::trained`], so that they include the final sync.
    pub fn figures(&self, counter: &ByteCounter) -> DiLoCoFigures {
        // One lock at a time (the guard of a temporary lives to the end of its statement).
        let syncs = self.diloco().history().len();
        DiLoCoFigures {
            // The outer syncs' bytes are those of the outer group (sent by a background thread
            // under an overlap, while the inner steps send theirs).
            outer_bytes: counter.sent_in(self.islands().outer()),
            total_bytes: counter.sent(),
            syncs,
            dropped: self.dropped(),
            sync_seconds: self.sync_seconds(),
        }
    }
}

/// What a DiLoCo run did on this rank ([`DiLoCoHandle::figures`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DiLoCoFigures {
    /// Payload bytes this rank sent in outer syncs.
    pub outer_bytes: u64,
    /// Payload bytes this rank sent in all (outer syncs, DDP inside its island, loss figures,
    /// the start's checks).
    pub total_bytes: u64,
    /// Fragment syncs this rank took part in (the final one of [`DiLoCo::finish`] included).
    pub syncs: usize,
    /// Islands dropped, with the inner step after which each was dropped (`None`: in the final
    /// sync).
    pub dropped: Vec<(usize, Option<usize>)>,
    /// Seconds per step spent in [`DiLoCo::sync`], the first step excluded.
    pub sync_seconds: f64,
}

impl<M: Module> StepEngine<M, Error> for DiLoCoEngine {
    fn step_accumulated(
        &mut self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> Result<Tensor<1>, Error>,
        lr: f64,
    ) -> Result<(M, StepOutput), Error> {
        let (model, mut out) = self
            .inner
            .step_accumulated(model, micro_batches, forward, lr)?;
        let start = Instant::now();
        let model = self.diloco().sync(self.step, model)?;
        self.handle.add_sync_time(start.elapsed().as_secs_f64());
        self.step += 1;
        out.loss = self
            .handle
            .loss_group()
            .all_reduce_f32(vec![out.loss], ReduceOp::Avg)?[0];
        Ok((model, out))
    }

    fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        state: SaveState,
    ) -> checkpoint::Result<()> {
        let diloco_error = |e: Error| CheckpointError::piece("diloco", e.to_string());
        let (pieces, meta, scalars) = self
            .names
            .pieces(model, &self.inner.optim, &mut self.diloco())
            .map_err(diloco_error)?;
        // DiLoCo's bookkeeping goes into the caller's state, where `DiLoCoCheckpoint::load`
        // reads it back (`saved_state`).
        let mut state = state;
        let mut trainer = match std::mem::take(&mut state.trainer) {
            Value::Object(map) => map,
            Value::Null => serde_json::Map::new(),
            other => {
                return Err(CheckpointError::piece(
                    "state",
                    format!("DiLoCo adds its state to an object's, not to {other}"),
                ));
            }
        };
        trainer.insert(
            DILOCO_STATE.into(),
            serde_json::to_value(meta).expect("DiLoCo's state serialises"),
        );
        state.trainer = Value::Object(trainer);
        let scaler = self.inner.step.loss_scaler().map(|s| s.state());
        let (trainer, rank) = engine_states(state, scaler, &scalars);
        saver.submit(step, pieces, trainer, rank)
    }

    fn load(&mut self, checkpoint: &Checkpoint, model: M) -> checkpoint::Result<(M, Value)> {
        let diloco_error = |e: Error| CheckpointError::piece("diloco", e.to_string());
        let mut diloco = self.handle.diloco();
        let model = self
            .names
            .load(
                model,
                (&mut self.inner.optim, &*self.fresh),
                &mut diloco,
                checkpoint,
            )
            .map_err(diloco_error)?;
        drop(diloco);
        let (state, scaler, _) = saved_engine_states(checkpoint)?;
        if let Some(saved) = scaler {
            self.inner
                .step
                .restore_loss_scaler(&saved)
                .map_err(|e| CheckpointError::piece("loss_scaler", e.to_string()))?;
        }
        self.step = checkpoint.step();
        Ok((model, state))
    }

    fn loss_scale(&self) -> f64 {
        self.inner.step.loss_scale()
    }

    /// The outer model: the fragments not synced since the last sync are synced now.
    fn master_model(&self, model: M) -> Result<M, Error> {
        Ok(self.diloco().finish(model)?)
    }

    fn optimizer(&self) -> Option<&ModuleOptimizer> {
        Some(&self.inner.optim)
    }
}

impl DiLoCoFigures {
    /// What a run reports at its end, line by line: the islands dropped, the time in syncs
    /// against `step_seconds` (the whole step's), and the bytes sent: every rank's, gathered
    /// over `world` (collective), or, when lost islands are dropped (`drop_lost`: the world may
    /// have lost ranks), this rank's alone.
    ///
    /// # Errors
    /// Collective failures of the gather.
    pub fn summary(
        &self,
        world: &ProcessGroup,
        step_seconds: f64,
        drop_lost: bool,
    ) -> burn_parallel::Result<Vec<String>> {
        let mut lines: Vec<String> = self
            .dropped
            .iter()
            .map(|(island, step)| match step {
                Some(step) => format!("DiLoCo: island {island} dropped at the sync of step {step}"),
                None => format!("DiLoCo: island {island} dropped at the final sync"),
            })
            .collect();
        lines.push(format!(
            "DiLoCo: {:.4} s per step in outer syncs (stall), {step_seconds:.4} s per step in all",
            self.sync_seconds
        ));
        let bytes = match drop_lost {
            // Islands may be gone: no collective over the world.
            true => vec![(world.rank(), (self.outer_bytes, self.total_bytes))],
            false => world
                .all_gather_object(&(self.outer_bytes, self.total_bytes))?
                .into_iter()
                .enumerate()
                .collect(),
        };
        lines.extend(bytes.into_iter().map(|(rank, (outer, total))| {
            format!(
                "rank {rank}: sent {outer} bytes in {} outer syncs, {total} bytes in all",
                self.syncs
            )
        }));
        Ok(lines)
    }
}

impl DiLoCoLayout {
    /// The settings in one line, for a run's header on `world` ranks: islands and their ranks,
    /// `H`, the outer optimizer, the pseudo-gradients' encoding, fragments, overlap, and the
    /// inner optimizer.
    ///
    /// ```
    /// use burn_parallel_train::DiLoCoLayout;
    ///
    /// let line = DiLoCoLayout::default().summary(8);
    /// assert!(line.starts_with("DiLoCo: 2 islands x 4 ranks, H = 50"), "{line}");
    /// ```
    pub fn summary(&self, world: usize) -> String {
        let d = &self.config;
        format!(
            "DiLoCo: {} islands x {} ranks, H = {}, outer SGD lr {} momentum {}{}, \
             pseudo-gradients {}, {} fragment(s), overlap {} step(s), {}inner {}",
            self.islands,
            world / self.islands.max(1),
            d.inner_steps,
            d.outer_lr,
            d.outer_momentum,
            if d.nesterov { " (Nesterov)" } else { "" },
            d.compression,
            d.fragments,
            d.overlap_steps,
            match d.drop_lost_islands {
                true => "lost islands dropped, ",
                false => "",
            },
            match self.inner_sgd {
                true => "SGD",
                false => "AdamW",
            }
        )
    }
}

/// How pseudo-gradients travel (`--diloco-compression`).
#[cfg(feature = "cli")]
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
#[cfg(feature = "cli")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum InnerOptimArg {
    /// AdamW.
    #[default]
    Adamw,
    /// Plain SGD.
    Sgd,
}

/// DiLoCo's command-line flags (`--diloco-islands N --inner-steps H ...`): flatten them into a
/// trainer's arguments (`#[command(flatten)]`) and read them as a [`DiLoCoLayout`]
/// ([`DiLoCoFlags::layout`]). The other flags are refused without `--diloco-islands`.
#[cfg(feature = "cli")]
#[derive(Debug, Clone, clap::Args)]
pub struct DiLoCoFlags {
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

#[cfg(feature = "cli")]
impl DiLoCoFlags {
    /// The DiLoCo part of a layout these flags ask for; `None` without `--diloco-islands`.
    pub fn layout(&self) -> Option<DiLoCoLayout> {
        let compression = match self.compression {
            CompressionArg::F32 => Compression::F32,
            CompressionArg::Fp16 => Compression::Fp16,
            CompressionArg::Bf16 => Compression::Bf16,
            CompressionArg::Int8 => Compression::Int8 {
                block_size: self.int8_block,
            },
        };
        Some(DiLoCoLayout {
            islands: self.islands?,
            config: DiLoCoConfig {
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
            inner_sgd: self.inner == InnerOptimArg::Sgd,
        })
    }
}
