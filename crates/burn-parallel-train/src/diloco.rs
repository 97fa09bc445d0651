//! DiLoCo's checkpoints ([`DiLoCoCheckpoint`]): what a DiLoCo run saves besides its step
//! engine's state, under names any layout reads.

use std::collections::{BTreeMap, HashMap};

use burn::module::{Module, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, TensorData};
use burn_parallel::checkpoint::{Checkpoint, ParamMap, Piece, TensorSource, merged_scalars};
use burn_parallel::diloco::{DiLoCo, DiLoCoMeta, DiLoCoState, Islands};
use burn_parallel::nn::TpContext;
use burn_parallel::train::OPTIM_SCALARS;
use burn_parallel::{Error, ProcessGroup};
use serde_json::Value;

use crate::fit::saved_state;

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
