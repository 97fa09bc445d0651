//! The step engines of a model with MoE layers ([`StepEngine`]): [`MoeTrainer`] (every layout
//! of `TrainStep`: data parallelism, FSDP/HSDP, tensor parallelism) and [`MoeZero`] (ZeRO-1/2,
//! the experts outside its flat space). Both train, clip and checkpoint the experts with the
//! rest, so that a training loop drives an MoE model as any other, and name each expert in a
//! checkpoint by its global index: any expert-parallel layout loads what another saved.

use std::collections::HashMap;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;
use burn_parallel::checkpoint::{
    self, Checkpoint, CheckpointError, Checkpointer, ParamMap, merged_scalars,
};
use burn_parallel::nn::TpContext;
use burn_parallel::precision::MixedPrecision;
use burn_parallel::train::{
    OPTIM_SCALARS, SaveState, StepEngine, StepOutput, StepPhases, engine_states, run_micro_batches,
    saved_engine_states,
};
use burn_zero::{ElementWise, ZeroOptimizer, clip};
use serde_json::Value;

use crate::config::MoeError;
use crate::layer::MoeParallel;
use crate::step::MoeStep;

/// Key of the expert biases ([`MoeParallel::expert_biases`]) in each rank's checkpoint state.
pub const MOE_BIASES: &str = "moe_biases";

/// An [`MoeStep`] with its Burn optimizer: the [`StepEngine`] of a model with MoE layers under
/// every layout of `TrainStep`. Each step runs [`MoeStep::step_accumulated`], then moves the
/// expert biases of auxiliary-loss-free balancing ([`MoeParallel::update_biases`]).
/// Checkpoints name each expert by its global index and hold the biases.
///
/// # Example
/// ```
/// use burn::optim::AdamWConfig;
/// use burn::tensor::{Device, Tensor};
/// use burn_moe::{MoeConfig, MoeError, MoeLayer, MoeParallel, MoeStep, MoeTrainer};
/// use burn_parallel::init::Init;
/// use burn_parallel::train::{StepEngine, TrainStep};
///
/// let device = Device::flex().autodiff();
/// let parallel = MoeParallel::default();
/// let init = Init::new(0, &device);
/// let mut moe = MoeLayer::build(&MoeConfig::new(4, 8, 2, 1), &init, &parallel).unwrap();
/// let step = MoeStep::new(TrainStep::new(init.context()), &parallel);
/// let mut engine: Box<dyn StepEngine<MoeLayer, MoeError>> =
///     Box::new(MoeTrainer::new(step, AdamWConfig::new().init()));
/// let x = Tensor::<2>::ones([4, 4], &device);
/// let mut forward = |m: &MoeLayer, k: usize| {
///     Ok(m.forward(x.clone().narrow(0, 2 * k, 2))?.powf_scalar(2.0).mean())
/// };
/// let (next, out) = engine.step_accumulated(moe, 2, &mut forward, 1e-2).unwrap();
/// moe = next;
/// assert!(out.loss.is_finite() && !out.skipped);
/// # let _ = moe;
/// ```
#[derive(Clone)]
pub struct MoeTrainer {
    /// The step (layout, precision, clipping).
    pub step: MoeStep,
    /// The optimizer and its state.
    pub optim: ModuleOptimizer,
}

impl MoeTrainer {
    /// `step` with `optim`.
    pub fn new(step: MoeStep, optim: ModuleOptimizer) -> Self {
        Self { step, optim }
    }
}

impl<M: Module, E: From<MoeError>> StepEngine<M, E> for MoeTrainer {
    fn step_accumulated(
        &mut self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        let out = self
            .step
            .step_accumulated(model, micro_batches, forward, &mut self.optim, lr)?;
        self.step.parallel().update_biases();
        Ok(out)
    }

    fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        state: SaveState,
    ) -> checkpoint::Result<()> {
        let inner = self.step.inner();
        let map = expert_map(
            inner.param_map(model)?,
            self.step.parallel(),
            inner.tp_context(),
        )?;
        let state = with_biases(state, self.step.parallel());
        inner.save_mapped(saver, step, model, &self.optim, &map, state)
    }

    fn load(&mut self, checkpoint: &Checkpoint, model: M) -> checkpoint::Result<(M, Value)> {
        let inner = self.step.inner();
        let parallel = self.step.parallel();
        let map = expert_map(inner.param_map(&model)?, parallel, inner.tp_context())?;
        let map = whole_model(map, parallel)?;
        let (model, optim, state) =
            inner.load_mapped(checkpoint, model, self.optim.clone(), &map)?;
        self.optim = optim;
        restore_biases(checkpoint, parallel)?;
        Ok((model, state))
    }

    fn loss_scale(&self) -> f64 {
        self.step.inner().loss_scale()
    }

    fn optimizer(&self) -> Option<&ModuleOptimizer> {
        Some(&self.optim)
    }
}

/// ZeRO-1/2 for a model with MoE layers: the experts (different on each expert-parallel rank)
/// are left out of ZeRO's flat space (build `zero` with [`ZeroOptimizer::new_excluding`] on
/// [`MoeParallel::experts`]); their gradients are accumulated apart, reduced over the ranks
/// holding the same experts ([`MoeStep::reduce_experts`]), clipped with the flat space's under
/// one global norm, and stepped by their own optimizer. In fp32 only (build `zero` without a
/// mixed-precision policy or a loss scaler): the experts would have no master weights.
pub struct MoeZero<O: ElementWise> {
    /// The sharded optimizer of everything but the experts.
    pub zero: ZeroOptimizer<O>,
    /// The expert gradients' reduction (its inner step's layout is unused).
    pub experts: MoeStep,
    /// The experts' optimizer.
    pub optim: ModuleOptimizer,
}

impl<O: ElementWise> MoeZero<O> {
    /// ZeRO `zero` (built excluding the experts) with `optim` for the experts of `experts`'s
    /// MoE layers.
    ///
    /// # Errors
    /// [`MoeError::Config`] when `zero` has a mixed-precision policy or a loss scaler.
    pub fn new(
        zero: ZeroOptimizer<O>,
        experts: MoeStep,
        optim: ModuleOptimizer,
    ) -> crate::Result<Self> {
        // The experts, outside the flat space, would have neither fp32 master weights nor a
        // step skipped with ZeRO's.
        if zero.scaler().is_some() || zero.master().is_some() {
            return Err(MoeError::Config {
                field: "ZeRO precision".into(),
                reason: "the experts, outside ZeRO's flat space, have no fp32 master weights \
                         and cannot skip a step with its loss scaler; train mixed-precision \
                         MoE models without ZeRO-1/2 (data parallelism or FSDP)"
                    .into(),
            });
        }
        Ok(Self {
            zero,
            experts,
            optim,
        })
    }

    /// The experts' part of `map`: their replicas and global names.
    fn expert_part(&self, map: ParamMap) -> checkpoint::Result<ParamMap> {
        let parallel = self.experts.parallel();
        let registry = parallel.experts.clone();
        Ok(expert_map(map, parallel, &self.zero.tp_context())?.only(|p| registry.contains(&p.id)))
    }
}

impl<M, O, E> StepEngine<M, E> for MoeZero<O>
where
    M: Module,
    O: ElementWise,
    E: From<MoeError>,
{
    fn step_accumulated(
        &mut self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        let zero_err = |e: burn_zero::ZeroError| E::from(MoeError::from(e));
        if micro_batches == 0 {
            return Err(E::from(MoeError::Config {
                field: "micro_batches".into(),
                reason: "zero micro-batches: give at least one".into(),
            }));
        }
        // ZeRO averages the micro-batches itself: the loss goes to backward as it is.
        let parallel = self.experts.parallel().clone();
        parallel.set_loss_scale(1.0);
        let mut phases = StepPhases::default();
        let mut acc = GradientsAccumulator::<M>::new();
        let (zero, experts) = (&mut self.zero, &self.experts);
        let local = run_micro_batches(
            micro_batches,
            &model,
            MixedPrecision::full(),
            forward,
            &mut phases,
            |_, loss| {
                let grads = burn_parallel::autograd::backward(loss).map_err(MoeError::from)?;
                let mut grads = GradientsParams::from_grads(grads, &model);
                acc.accumulate(&model, experts.take_experts(&model, &mut grads));
                zero.accumulate(&model, grads).map_err(zero_err)
            },
        )?;
        let max_norm = self.zero.max_grad_norm();
        let experts = phases.time(
            |p| &mut p.reduce,
            || -> crate::Result<_> {
                let mut grads = acc.grads();
                let mut experts = self.experts.reduce_experts(&model, &mut grads)?;
                experts.scale(1.0 / micro_batches as f32);
                // Counted every step: the global norm is checked for NaN clipped or not.
                let outside = self.experts.expert_squared_norm(&experts)?;
                Ok((experts, outside))
            },
        );
        let (mut experts, outside) = experts?;
        let loss = self.zero.mean_loss(local).map_err(zero_err)?;
        let (model, info) = phases.time(
            |p| &mut p.optimizer,
            || -> crate::Result<_> {
                let (model, info) = self.zero.step_with_outside(lr, model, outside)?;
                if let (Some(max_norm), Some(norm)) = (max_norm, info.grad_norm) {
                    let coef = clip::clip_coefficient(norm, max_norm);
                    if coef < 1.0 {
                        experts.scale(coef as f32);
                    }
                }
                let grads = experts.into_gradients(&model);
                Ok((self.optim.step(lr, model, grads), info))
            },
        )?;
        parallel.update_biases();
        Ok((
            model,
            StepOutput {
                loss,
                grad_norm: info.grad_norm,
                skipped: info.skipped,
                phases,
            },
        ))
    }

    /// ZeRO's flat space as [`ZeroOptimizer`]'s engine saves it, the experts and their
    /// optimizer state under their global names, the expert biases.
    fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        model: &M,
        state: SaveState,
    ) -> checkpoint::Result<()> {
        let zero_err = |e: burn_zero::ZeroError| CheckpointError::piece("zero", e.to_string());
        let tp = self.zero.tp_context();
        let (mut pieces, scalars) = self.zero.checkpoint_pieces(model).map_err(zero_err)?;
        let mut scalars = serde_json::to_value(scalars).unwrap_or(Value::Null);
        let map = self.expert_part(ParamMap::new(model, &tp, None)?)?;
        pieces.extend(map.param_pieces(model)?);
        let (more, more_scalars) = map.optimizer_pieces(self.optim.to_record())?;
        pieces.extend(more);
        if let (Some(all), Value::Object(more)) = (scalars.as_object_mut(), more_scalars) {
            all.extend(more);
        }
        let state = with_biases(state, self.experts.parallel());
        let (trainer, rank) = engine_states(state, None, &scalars);
        saver.submit(step, pieces, trainer, rank)
    }

    fn load(&mut self, checkpoint: &Checkpoint, model: M) -> checkpoint::Result<(M, Value)> {
        let zero_err = |e: burn_zero::ZeroError| CheckpointError::piece("zero", e.to_string());
        let tp = self.zero.tp_context();
        let parallel = self.experts.parallel().clone();
        // The experts, checking the checkpoint against the whole model (the experts other
        // expert-parallel ranks hold too), then ZeRO's flat space.
        let map = whole_model(
            self.expert_part(ParamMap::new(&model, &tp, None)?)?,
            &parallel,
        )?;
        let model = map.load_params(model, checkpoint)?;
        let model = self
            .zero
            .load_checkpoint_params(model, checkpoint, &tp)
            .map_err(zero_err)?;
        let (state, _, _) = saved_engine_states(checkpoint)?;
        let scalars = merged_scalars(checkpoint, OPTIM_SCALARS);
        self.zero
            .load_checkpoint_state(checkpoint, &tp, &scalars)
            .map_err(zero_err)?;
        if let Some(record) = map.load_optimizer(checkpoint, &scalars)? {
            self.optim = self.optim.clone().load_record(record);
        }
        restore_biases(checkpoint, &parallel)?;
        Ok((model, state))
    }

    /// [`ZeroOptimizer::master_module`].
    fn master_model(&self, model: M) -> std::result::Result<M, E> {
        Ok(self.zero.master_module(model).map_err(MoeError::from)?)
    }
}

/// `map` with the experts of `parallel`'s layers named by their global index
/// (`…experts.{local}.…` -> `…experts.{first + local}.…`) and held by the ranks holding the
/// same experts ([`MoeParallel::expert_dp`]) times the tensor-parallel ranks of `tp` (each with
/// the whole expert); every other parameter keeps its replicas.
///
/// # Errors
/// [`CheckpointError::Piece`] for an expert parameter whose path names no expert index.
pub fn expert_map(
    map: ParamMap,
    parallel: &MoeParallel,
    tp: &TpContext,
) -> checkpoint::Result<ParamMap> {
    let registry = parallel.experts.clone();
    let mut renames = HashMap::new();
    for p in map.params() {
        if let Some(global) = registry.expert_of(&p.id) {
            renames.insert(p.path.clone(), global_path(&p.path, global)?);
        }
    }
    let of = |g: Option<&burn_parallel::ProcessGroup>| g.map_or((1, 0), |g| (g.size(), g.rank()));
    let (edp, edp_rank) = of(parallel.expert_dp.as_ref());
    let (tp, tp_rank) = of(tp.group());
    let holders = (edp * tp, edp_rank * tp + tp_rank);
    let map = map.with_replicas_where(|p| registry.contains(&p.id).then_some(holders));
    Ok(map.with_logical_names(|name| renames.get(name).cloned().unwrap_or(name.to_string())))
}

/// `path` with its expert index (the number after the last `experts` segment) replaced by
/// `global`.
fn global_path(path: &str, global: usize) -> checkpoint::Result<String> {
    let mut parts: Vec<&str> = path.split('.').collect();
    let at = parts
        .windows(2)
        .rposition(|w| w[0] == "experts" && w[1].parse::<usize>().is_ok())
        .ok_or_else(|| {
            CheckpointError::piece(
                path,
                "an expert parameter whose path has no `experts.<index>` segment",
            )
        })?;
    let index = global.to_string();
    parts[at + 1] = &index;
    Ok(parts.join("."))
}

/// `map` checking a checkpoint against the whole model: the logical parameters of every
/// expert-parallel rank (the experts the others hold), gathered over [`MoeParallel::ep`].
fn whole_model(map: ParamMap, parallel: &MoeParallel) -> checkpoint::Result<ParamMap> {
    match &parallel.ep {
        Some(ep) => map.with_logical_of(ep),
        None => Ok(map),
    }
}

/// `state` with the expert biases of `parallel`'s layers in this rank's part.
fn with_biases(state: SaveState, parallel: &MoeParallel) -> SaveState {
    let biases = serde_json::to_value(parallel.expert_biases()).unwrap_or(Value::Null);
    state.with_rank(MOE_BIASES, biases)
}

/// Sets the expert biases of `parallel`'s layers from rank 0's state in `checkpoint` (every
/// rank saves the same).
///
/// # Errors
/// [`CheckpointError::Piece`] naming [`MOE_BIASES`] when they are missing or do not fit.
fn restore_biases(checkpoint: &Checkpoint, parallel: &MoeParallel) -> checkpoint::Result<()> {
    if parallel.expert_biases().is_empty() {
        return Ok(());
    }
    let saved = checkpoint
        .manifest()
        .rank_states
        .iter()
        .find_map(|s| s.get(MOE_BIASES))
        .ok_or_else(|| {
            CheckpointError::piece(
                MOE_BIASES,
                "no expert biases saved: the checkpoint is of a model without MoE layers, or \
                 of an older format; resume with the model that saved it",
            )
        })?;
    let biases: Vec<Vec<f32>> = serde_json::from_value(saved.clone())
        .map_err(|e| CheckpointError::piece(MOE_BIASES, e.to_string()))?;
    parallel
        .set_expert_biases(&biases)
        .map_err(|e| CheckpointError::piece(MOE_BIASES, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::global_path;

    #[test]
    fn an_expert_path_takes_its_global_index() {
        assert_eq!(
            global_path("blocks.3.moe.experts.1.up.weight", 5).unwrap(),
            "blocks.3.moe.experts.5.up.weight"
        );
        assert!(global_path("blocks.3.moe.router", 5).is_err());
    }
}
