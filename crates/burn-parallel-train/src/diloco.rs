//! DiLoCo's checkpoints ([`DiLoCoCheckpoint`]): what a DiLoCo run saves besides its step
//! engine's state, under names any layout reads.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use burn::module::{Module, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel::checkpoint::{
    self, Checkpoint, CheckpointError, Checkpointer, ParamMap, Piece, TensorSource, merged_scalars,
};
use burn_parallel::diloco::{DiLoCo, DiLoCoConfig, DiLoCoMeta, DiLoCoState, Islands};
use burn_parallel::nn::TpContext;
use burn_parallel::train::{
    OPTIM_SCALARS, SaveState, StepEngine, StepOutput, Trainer, engine_states, saved_engine_states,
};
use burn_parallel::{Error, ProcessGroup, ReduceOp};
use serde_json::Value;

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
/// the islands' models every `H` steps). Built by [`crate::build`] for a layout with
/// [`crate::layout::DiLoCoLayout`]; checkpoints through [`DiLoCoCheckpoint`].
///
/// The loss it reports is averaged over the world (over the island when lost islands are
/// dropped, since the world may then have lost ranks).
pub struct DiLoCoEngine {
    inner: Trainer,
    fresh: Box<dyn Fn() -> ModuleOptimizer + Send + Sync>,
    /// Behind a lock: saving and the final model read DiLoCo's state through `&self`.
    diloco: Mutex<DiLoCo>,
    names: DiLoCoCheckpoint,
    loss_group: ProcessGroup,
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
        Ok(Self {
            inner,
            fresh,
            diloco: Mutex::new(DiLoCo::new(islands, config, model)?),
            names: DiLoCoCheckpoint::new(model, tp, world, islands)?,
            loss_group,
            step: 0,
        })
    }

    fn diloco(&self) -> std::sync::MutexGuard<'_, DiLoCo> {
        self.diloco.lock().unwrap_or_else(|p| p.into_inner())
    }
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
        let model = self.diloco().sync(self.step, model)?;
        self.step += 1;
        out.loss = self
            .loss_group
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
        let mut diloco = self.diloco.lock().unwrap_or_else(|p| p.into_inner());
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
