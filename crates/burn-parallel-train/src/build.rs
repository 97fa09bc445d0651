//! [`build`]: from a [`Layout`], the world and the user's [`ParallelModel`], this rank's model
//! and the engine that steps it.
//!
//! The assembly is two steps, each usable alone:
//!
//! 1. [`Placed::new`]: the mesh and its groups, the plans (tensor parallel, FSDP, experts,
//!    context parallel), this rank's model built through them, and the check that the replicas
//!    agree. A run that starts from other weights (a Hugging Face checkpoint) loads them into
//!    [`Placed::model`] here, before the engine makes its master copies.
//! 2. [`Placed::into_engine`]: the [`StepEngine`] of the layout, composed of orthogonal parts:
//!    the data reduction (DDP, overlapped DDP, FSDP's reduce-scatter, ZeRO-1/2's sharded
//!    optimizer), the precision policy, and, for a mixture-of-experts model, burn-moe's expert
//!    step around it; under DiLoCo, the step of each island wrapped in the outer loop
//!    ([`crate::diloco::DiLoCoEngine`]).

use std::collections::BTreeMap;

use crate::layout::Optim;
use burn::module::Module;
use burn::optim::{ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, TensorData};
use burn_moe::{MoeParallel, MoeStep, MoeTrainer, MoeZero};
use burn_parallel::checkpoint::{Checkpoint, Checkpointer, ParamMap};
use burn_parallel::context_parallel::{ContextParallel, CpSettings};
use burn_parallel::diloco::Islands;
use burn_parallel::fault::Replicas;
use burn_parallel::init::Init;
use burn_parallel::muon::MatrixStep;
use burn_parallel::nn::TpContext;
use burn_parallel::overlap::OverlappedDdp;
use burn_parallel::replica::{verify_replicas_in, verify_replicas_of};
use burn_parallel::tensor_parallel::SeededDropout;
use burn_parallel::train::{SaveState, StepEngine, StepOutput, TrainStep, Trainer};
use burn_parallel::{DistributedDataParallel, Error, ProcessGroup};
use burn_zero::{FsdpPlan, MemoryTracker, ShardGroups, Stage, ZeroConfig, ZeroOptimizer};

use crate::diloco::{DiLoCoEngine, DiLoCoHandle};
use crate::layout::Layout;
use crate::model::{Groups, ModelParts, ParallelModel, PipelineSteps, StepSettings};
use serde_json::Value;

/// A layout placed on this rank: its groups and plans, and the model built through them.
pub struct Placed<P: ParallelModel> {
    /// The layout.
    pub layout: Layout,
    /// The groups.
    pub groups: Groups,
    /// This rank's model.
    pub model: P::Model,
    /// FSDP's plan (`zero` stage 3).
    pub fsdp: Option<FsdpPlan>,
    /// The experts' groups and registry.
    pub experts: MoeParallel,
    /// The seed, the device and the tensor-parallel plan the model was built with.
    pub init: Init,
    /// Whether the model has experts.
    moe: bool,
    /// DiLoCo's islands (under a layout with DiLoCo).
    islands: Option<Islands>,
    /// The replicas of fault-tolerant data parallelism (under `--fault-tolerant`).
    replicas: Option<Replicas>,
}

/// What a built layout trains on this rank.
pub enum Trainee<P: ParallelModel> {
    /// The model (this rank's part of it; in the compute dtype under ZeRO's mixed precision)
    /// and the engine that steps it: every layout but the pipeline.
    Whole {
        /// This rank's model.
        model: P::Model,
        /// The engine: one call per optimizer step ([`StepEngine::step_accumulated`]).
        engine: Box<dyn StepEngine<P::Model, Error>>,
    },
    /// This rank's pipeline stages and their executor ([`crate::pipeline`]).
    Pipeline(Box<dyn PipelineSteps<P>>),
    /// Nothing: a step or a load failed while the engine held the model (a dead peer in the
    /// middle of an update). Build again and resume from the last checkpoint.
    Lost,
}

/// The error of a call on a [`Trainee::Lost`].
fn lost() -> Error {
    Error::invalid(
        "model",
        "an earlier step or load failed while the engine held the model, so there is none to \
         continue with; build the layout again and resume from the last checkpoint",
    )
}

/// A layout built on this rank: what it trains and the engine that steps it.
pub struct Built<P: ParallelModel> {
    /// The model and its engine, or the pipeline stages.
    pub trainee: Trainee<P>,
    /// The groups.
    pub groups: Groups,
    /// FSDP's plan (`zero` stage 3): its memory account.
    pub fsdp: Option<FsdpPlan>,
    /// The experts' groups and registry.
    pub experts: MoeParallel,
    /// ZeRO-1/2's memory account.
    pub zero_memory: Option<MemoryTracker>,
    /// The settings it was built with (the batch [`crate::fit()`] splits).
    pub settings: StepSettings,
    /// The layout it was built under (saved with checkpoints, named on resume).
    pub layout: Layout,
    /// DiLoCo's outer loop (a layout with DiLoCo; `None` otherwise): its history, islands and
    /// time in syncs, still readable after [`Built::trained`] (which runs the final sync).
    pub diloco: Option<DiLoCoHandle>,
    /// The replicas of fault-tolerant data parallelism (under `--fault-tolerant`; `None`
    /// otherwise): who is alive, the events, the state handed to a rejoining replica.
    pub replicas: Option<Replicas>,
}

impl<P: ParallelModel> Built<P> {
    /// This rank's model, or `None` under a pipeline (whose ranks hold stages).
    pub fn model(&self) -> Option<&P::Model> {
        match &self.trainee {
            Trainee::Whole { model, .. } => Some(model),
            Trainee::Pipeline(_) | Trainee::Lost => None,
        }
    }

    /// The pipeline, or `None` under any other layout.
    pub fn pipeline(&self) -> Option<&dyn PipelineSteps<P>> {
        match &self.trainee {
            Trainee::Pipeline(pipeline) => Some(pipeline.as_ref()),
            Trainee::Whole { .. } | Trainee::Lost => None,
        }
    }

    /// One optimizer step over `micro_batches` micro-batches of this rank's rows, `batch(k)`
    /// giving micro-batch `k`, at rate `lr`: the gradients are accumulated (under a pipeline,
    /// the micro-batches flow through its schedule), reduced, clipped and applied once.
    ///
    /// # Errors
    /// `batch`'s errors, the model's, the engine's.
    pub fn step(
        &mut self,
        micro_batches: usize,
        batch: &mut dyn FnMut(usize) -> Result<P::Batch, Error>,
        lr: f64,
    ) -> Result<StepOutput, Error> {
        match std::mem::replace(&mut self.trainee, Trainee::Lost) {
            Trainee::Whole { model, mut engine } => {
                let mut forward = |m: &P::Model, k: usize| P::loss(m, &batch(k)?);
                // The engine takes the model by value and gives it back updated.
                let (model, out) =
                    engine.step_accumulated(model, micro_batches, &mut forward, lr)?;
                self.trainee = Trainee::Whole { model, engine };
                Ok(out)
            }
            Trainee::Pipeline(mut pipeline) => {
                let out = (0..micro_batches)
                    .map(&mut *batch)
                    .collect::<Result<Vec<_>, _>>()
                    .and_then(|batches| pipeline.step(&batches, lr));
                self.trainee = Trainee::Pipeline(pipeline);
                out
            }
            Trainee::Lost => Err(lost()),
        }
    }

    /// Saves the trained parameters and the optimizer state as checkpoint `step` of `saver`,
    /// with `state` ([`StepEngine::save`], [`PipelineSteps::save`]). Collective.
    ///
    /// # Errors
    /// I/O and collective failures.
    pub fn save(
        &self,
        saver: &mut Checkpointer,
        step: usize,
        state: SaveState,
    ) -> Result<(), Error> {
        match &self.trainee {
            Trainee::Whole { model, engine } => Ok(engine.save(saver, step, model, state)?),
            Trainee::Pipeline(pipeline) => pipeline.save(saver, step, state),
            Trainee::Lost => Err(lost()),
        }
    }

    /// Loads a checkpoint saved under any layout.
    ///
    /// # Returns
    /// The caller's state given to the save.
    ///
    /// # Errors
    /// A checkpoint of another model, or damaged.
    pub fn load(&mut self, checkpoint: &Checkpoint) -> Result<Value, Error> {
        match std::mem::replace(&mut self.trainee, Trainee::Lost) {
            Trainee::Whole { model, mut engine } => {
                let (model, state) = engine.load(checkpoint, model)?;
                self.trainee = Trainee::Whole { model, engine };
                Ok(state)
            }
            Trainee::Pipeline(mut pipeline) => {
                let state = pipeline.load(checkpoint);
                self.trainee = Trainee::Pipeline(pipeline);
                state
            }
            Trainee::Lost => Err(lost()),
        }
    }

    /// Checks that the replicas agree ([`verify_replicas`]; each stage's replicas under a
    /// pipeline).
    ///
    /// # Errors
    /// [`Error::Replica`] naming the first parameter that differs; collective failures.
    pub fn verify_replicas(&self) -> Result<(), Error> {
        match &self.trainee {
            Trainee::Whole { model, .. } => verify_replicas(model, &self.groups, &self.experts),
            Trainee::Pipeline(pipeline) => pipeline.verify_replicas(),
            Trainee::Lost => Err(lost()),
        }
    }

    /// The dropout layers of what this rank trains, by the whole model's names
    /// ([`ParallelModel::dropout_layers`], or each stage's under a pipeline).
    pub fn dropout_layers(&self) -> Vec<(String, SeededDropout)> {
        match &self.trainee {
            Trainee::Whole { model, .. } => P::dropout_layers(model),
            Trainee::Pipeline(pipeline) => pipeline.dropout_layers(),
            Trainee::Lost => Vec::new(),
        }
    }

    /// The current loss scale (1 without a loss scaler).
    pub fn loss_scale(&self) -> f64 {
        match &self.trainee {
            Trainee::Whole { engine, .. } => engine.loss_scale(),
            Trainee::Pipeline(pipeline) => pipeline.loss_scale(),
            Trainee::Lost => 1.0,
        }
    }

    /// The trained model with its fp32 master weights, to evaluate or export: this rank's
    /// part of it under the whole-model layouts ([`StepEngine::master_model`]); under a
    /// pipeline, the whole model on every rank, built on one device by `model` and loaded
    /// with every stage's parameters (collective over the world).
    ///
    /// # Errors
    /// Collective failures; a model whose stages' names do not match its own.
    pub fn trained(self, model: &P) -> Result<P::Model, Error> {
        match self.trainee {
            Trainee::Whole { model, engine } => engine.master_model(model),
            Trainee::Pipeline(pipeline) => {
                let params = pipeline.whole_params()?;
                let device = pipeline.device().clone();
                single_from(model, &device, &params)
            }
            Trainee::Lost => Err(lost()),
        }
    }
}

/// `model` built whole on `device` (no layout) and loaded with `params` under its paths.
fn single_from<P: ParallelModel>(
    model: &P,
    device: &Device,
    params: &BTreeMap<String, TensorData>,
) -> Result<P::Model, Error> {
    let parts = ModelParts {
        init: Init::new(model.seed(), device),
        fsdp: None,
        experts: MoeParallel::default(),
        context_parallel: None,
        data_rank: 0,
    };
    let whole = model.build(&parts)?;
    let map = ParamMap::new(&whole, &TpContext::single(), None)?;
    Ok(map.load_params(whole, params)?)
}

/// Builds `model` on this rank of `world` under `layout`, with the engine that steps it.
/// Every rank calls it.
///
/// # Errors
/// A layout that cannot run (as [`Error::Invalid`] naming its flag), a model that cannot be
/// split, collective failures, replicas that differ.
pub fn build<P: ParallelModel>(
    world: &ProcessGroup,
    layout: &Layout,
    model: &P,
    device: &Device,
    settings: &StepSettings,
) -> Result<Built<P>, Error> {
    build_from(world, layout, model, device, settings, None)
}

/// The pipeline of `layout` (`pp > 1`) for `model`'s staged form.
fn build_pipeline<P: ParallelModel>(
    world: &ProcessGroup,
    layout: &Layout,
    model: &P,
    device: &Device,
    settings: &StepSettings,
) -> Result<Built<P>, Error> {
    layout.validate(world.size(), &settings.workload(model))?;
    let stager = model.stages().ok_or_else(|| {
        Error::invalid(
            "--pp",
            "this model has no pipeline form: implement burn_parallel_train::StagedModel \
             for it and return Some(self) from ParallelModel::stages, or drop --pp",
        )
    })?;
    let (groups, pipeline) = stager.place(world, layout, device, settings)?;
    Ok(Built {
        trainee: Trainee::Pipeline(pipeline),
        groups,
        fsdp: None,
        experts: MoeParallel::default(),
        zero_memory: None,
        settings: settings.clone(),
        layout: *layout,
        diloco: None,
        replicas: None,
    })
}

/// [`build`] starting from `params` (whole-model tensors under the model's paths: a Hugging
/// Face checkpoint mapped onto its names, another run's export) instead of the seeded
/// initialisation: each rank loads its part of them ([`Placed::load_params`], or each
/// pipeline stage its layers) before the engine makes its master copies.
///
/// # Errors
/// As [`build`]; tensors that do not match the model (a missing or extra name, another
/// shape), named.
pub fn build_from<P: ParallelModel>(
    world: &ProcessGroup,
    layout: &Layout,
    model: &P,
    device: &Device,
    settings: &StepSettings,
    params: Option<&BTreeMap<String, TensorData>>,
) -> Result<Built<P>, Error> {
    settings.validate()?;
    if layout.pp > 1 {
        let mut built = build_pipeline(world, layout, model, device, settings)?;
        if let (Some(params), Trainee::Pipeline(stages)) = (params, &mut built.trainee) {
            stages.load_params(params)?;
        }
        return Ok(built);
    }
    let placed = Placed::new(world, layout, model, device, settings)?;
    let placed = match params {
        Some(params) => placed.load_params(params)?,
        None => placed,
    };
    placed.into_engine(settings)
}

/// Checks that the replicas of `model` agree: the ranks of `groups.replicate` hold the same
/// parameters (and, under expert parallelism, the ranks holding the same experts the same
/// experts). Collective over the layout's ranks.
///
/// # Errors
/// [`Error::Replica`] naming the first parameter that differs and the ranks on each side;
/// collective failures.
pub fn verify_replicas<M: Module>(
    model: &M,
    groups: &Groups,
    experts: &MoeParallel,
) -> Result<(), Error> {
    match experts.ep {
        Some(_) => {
            let expert_dp = groups.dims.expert_data_parallel(&groups.mesh)?;
            let registry = experts.experts.clone();
            verify_replicas_of(model, &[&expert_dp], |id| registry.contains(&id))?;
            verify_replicas_of(model, &[&groups.replicate], |id| !registry.contains(&id))?;
        }
        None => verify_replicas_in(model, &[&groups.replicate], |_| true)?,
    }
    Ok(())
}

/// The matrix optimizer of `settings` (Muon) served under `layout`: its holders are the ranks
/// that hold different pieces of the same matrices (tensor parallelism, and the shard group of
/// ZeRO or FSDP), its replicas the data-parallel copies of those pieces.
///
/// # Errors
/// [`Error::Invalid`] naming `--optim` for a layout that cannot serve it yet.
fn matrix_step(
    settings: &StepSettings,
    layout: &Layout,
    groups: &Groups,
    moe: bool,
) -> Result<Option<MatrixStep>, Error> {
    if layout.optim != Optim::Muon {
        return Ok(None);
    }
    let config = &settings.muon;
    let refuse = |what: &str| {
        Err(Error::invalid(
            "--optim",
            format!("Muon does not run under {what} yet: use --optim adamw there"),
        ))
    };
    if layout.diloco.is_some() {
        return refuse("DiLoCo (its inner optimizer is AdamW or SGD)");
    }
    if moe {
        return refuse("a mixture-of-experts model");
    }
    let (dims, replicas): (&[&str], _) = match layout.zero {
        Some(_) => (&["dp_shard", "cp", "tp"], &groups.replicate),
        None => (&["tp"], &groups.reduce),
    };
    let mut step = MatrixStep::new(config.build()).with_replicas(replicas.clone());
    if let Some(holders) = mesh_group(&groups.mesh, dims)? {
        step = step.with_holders(holders);
    }
    Ok(Some(step))
}

/// The group of the mesh's dimensions among `names` flattened together (`None` when the mesh
/// has none of them). Collective over the world, like every group of the mesh.
///
/// # Errors
/// Collective failures creating the group.
pub(crate) fn mesh_group(
    mesh: &burn_parallel::DeviceMesh,
    names: &[&str],
) -> Result<Option<ProcessGroup>, Error> {
    let present: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| mesh.names().iter().any(|m| m == n))
        .collect();
    match present.is_empty() {
        true => Ok(None),
        false => Ok(Some(mesh.flattened(&present)?)),
    }
}

impl<P: ParallelModel> Placed<P> {
    /// Places `layout` on this rank of `world`: validates it for `model` and `settings`, builds
    /// the mesh, the plans and the model, and checks that the replicas agree. `device` is the
    /// autodiff device the model trains on. Every rank calls it.
    ///
    /// # Errors
    /// As [`build`].
    pub fn new(
        world: &ProcessGroup,
        layout: &Layout,
        model: &P,
        device: &Device,
        settings: &StepSettings,
    ) -> Result<Self, Error> {
        layout.validate(world.size(), &settings.workload(model))?;
        if layout.pp > 1 {
            return Err(Error::invalid(
                "--pp",
                "Placed holds a whole model, and a pipeline rank holds stages: place a \
                 pipeline with build (the model's StagedModel form)",
            ));
        }
        let dims = layout.dims(world.size());
        let mesh = dims.build(world)?;
        let group = |name: &str| mesh.group(name).cloned();
        let data = dims.data_parallel(&mesh)?;
        let (reduce, shard) = match dims.cp {
            1 => (data.clone(), group("dp_shard")?),
            _ => (dims.gradient_reduction(&mesh)?, dims.shard_with_cp(&mesh)?),
        };
        let mut groups = Groups {
            world: world.clone(),
            dims,
            data,
            reduce,
            replicate: group("dp_replicate")?,
            shard,
            mesh,
        };
        let init = Init::new(model.seed(), device)
            .with_tp(&groups.mesh.group("tp")?.clone(), model.tp_plan(layout.sp))?;
        let experts = match model.n_experts() {
            Some(_) => MoeParallel::from_mesh(&groups.dims, &groups.mesh)?,
            None => MoeParallel::default(),
        };
        let fsdp = (layout.zero == Some(Stage::Three)).then(|| {
            model
                .fsdp_plan(&groups.shard, &experts)
                .with_prefetch(layout.prefetch)
        });
        let context_parallel = match groups.dims.cp {
            1 => None,
            _ => {
                let settings = CpSettings {
                    kind: layout.cp_kind,
                    balance: layout.cp_balance,
                };
                Some(
                    ContextParallel::new(groups.mesh.group("cp")?, settings)
                        .map_err(|e| Error::invalid("--cp", e))?,
                )
            }
        };
        let parts = ModelParts {
            init,
            fsdp,
            experts,
            context_parallel,
            data_rank: groups.data.rank(),
        };
        let built = model.build(&parts)?;
        let ModelParts {
            init,
            fsdp,
            experts,
            ..
        } = parts;
        // Fault-tolerant data parallelism: each replica reduces inside itself, and the replicas
        // average once per step through the quorum (no collective spans them).
        let replicas = match layout.fault_tolerant {
            true => {
                let replicas = Replicas::new(world, layout.replicas(world.size()))?;
                let island = replicas.island().members().to_vec();
                let inside = |g: &ProcessGroup| -> Result<ProcessGroup, Error> {
                    let ranks: Vec<usize> = g
                        .members()
                        .iter()
                        .copied()
                        .filter(|r| island.contains(r))
                        .collect();
                    Ok(world.split(&ranks)?)
                };
                groups.reduce = inside(&groups.reduce)?;
                groups.replicate = inside(&groups.replicate)?;
                Some(replicas)
            }
            false => None,
        };
        // Seeded init gives identical replicas; fail loudly if they are not (under
        // --fault-tolerant, inside each replica here, and across them at the first exchange).
        verify_replicas(&built, &groups, &experts)?;
        // Under DiLoCo, each island reduces its gradients and holds one replica between syncs
        // (all of them were checked identical just now).
        let islands = match layout.diloco {
            Some(d) => {
                let islands = Islands::new(world, d.islands)?;
                groups.reduce = islands.island().clone();
                groups.replicate = islands.island().clone();
                Some(islands)
            }
            None => None,
        };
        Ok(Self {
            layout: *layout,
            groups,
            model: built,
            fsdp,
            experts,
            init,
            moe: model.n_experts().is_some(),
            islands,
            replicas,
        })
    }

    /// Loads `params` (whole-model tensors under the model's paths) into this rank's part of
    /// the model: its tensor-parallel shards, FSDP's flat shards, its experts (under their
    /// global names). Every rank calls it; the tensors are checked against the whole model,
    /// those other ranks hold included.
    ///
    /// # Errors
    /// Tensors that do not match the model (a missing or extra name, another shape), named;
    /// collective failures.
    pub fn load_params(mut self, params: &BTreeMap<String, TensorData>) -> Result<Self, Error> {
        let tp = self.init.context();
        let shards = self.fsdp.as_ref().map(|plan| plan.shards().clone());
        let map = ParamMap::new(&self.model, &tp, shards.as_ref())?;
        let mut map = burn_moe::engine::expert_map(map, &self.experts, &tp)?;
        if self.experts.ep.is_some() {
            // Each rank holds only its experts: the others' come from their ranks.
            map = map.with_logical_of(&self.groups.world)?;
        }
        self.model = map.load_params(self.model, params)?;
        Ok(self)
    }

    /// The engine of the layout for the placed model (see the module's doc for its parts).
    ///
    /// # Errors
    /// ZeRO or MoE settings that cannot run; collective failures.
    pub fn into_engine(self, settings: &StepSettings) -> Result<Built<P>, Error> {
        let Self {
            layout,
            groups,
            mut model,
            fsdp,
            experts,
            init,
            moe,
            islands,
            replicas,
        } = self;
        let hyper = settings.adamw;
        let adamw = settings.adamw_config();
        let matrix = matrix_step(settings, &layout, &groups, moe)?;
        let mut zero_memory = None;
        let mut diloco = None;
        let engine: Box<dyn StepEngine<P::Model, Error>> = match (layout.diloco, islands) {
            (Some(d), Some(islands)) => {
                // Each island's step (DDP inside it), then the outer loop.
                let mut step = TrainStep::new(init.context())
                    .with_precision(settings.precision)
                    .with_clip(settings.max_grad_norm);
                if let Some(scaler) = &settings.loss_scaler {
                    step = step.with_loss_scaler(scaler.clone());
                }
                if islands.size() > 1 {
                    step = step.with_ddp(
                        DistributedDataParallel::new(islands.island().clone())
                            .with_bucket_bytes(settings.bucket_bytes),
                    );
                }
                let fresh: Box<dyn Fn() -> ModuleOptimizer + Send + Sync> = match d.inner_sgd {
                    true => Box::new(|| SgdConfig::new().init()),
                    false => {
                        let adamw = adamw.clone();
                        Box::new(move || adamw.init())
                    }
                };
                let inner = Trainer::new(step, fresh());
                let engine = DiLoCoEngine::new(
                    &groups.world,
                    &islands,
                    d.config,
                    &model,
                    &init.context(),
                    (inner, fresh),
                )?;
                diloco = Some(engine.handle());
                Box::new(engine)
            }
            _ => match layout.zero {
                Some(stage @ (Stage::One | Stage::Two)) => {
                    let shard_groups = match layout.replicate {
                        1 => ShardGroups::flat(groups.reduce.clone()),
                        _ => ShardGroups::hybrid(&groups.mesh)?,
                    };
                    // fp32 master shards and AdamW state; the experts (different on each
                    // expert-parallel rank) stay out of the flat space.
                    let config = ZeroConfig::new(stage)
                        .with_max_grad_norm(settings.max_grad_norm)
                        .with_precision(settings.precision)
                        .with_loss_scaler(settings.loss_scaler.clone())
                        .with_offload(layout.offload)
                        .with_bucket_bytes(settings.bucket_bytes);
                    let registry = experts.experts.clone();
                    let zero = ZeroOptimizer::new_excluding(
                        &model,
                        shard_groups,
                        config,
                        adamw.build(),
                        |id| registry.contains(&id),
                    )?
                    .with_tensor_parallel(&init.context());
                    let zero = match matrix {
                        Some(matrix) => zero.with_matrix_step(matrix),
                        None => zero,
                    };
                    model = zero.prepare_module(model)?;
                    zero_memory = Some(zero.tracker().clone());
                    match moe {
                        true => {
                            let step = MoeStep::new(TrainStep::new(init.context()), &experts);
                            Box::new(MoeZero::new(zero, step, adamw.init())?)
                        }
                        false => Box::new(zero),
                    }
                }
                _ => {
                    let mut step = TrainStep::new(init.context())
                        .with_precision(settings.precision)
                        // MoeStep clips itself (its norm counts each expert once).
                        .with_clip(settings.max_grad_norm.filter(|_| !moe));
                    if let Some(scaler) = &settings.loss_scaler {
                        step = step.with_loss_scaler(scaler.clone());
                    }
                    let reduce = &groups.reduce;
                    if layout.overlap {
                        step = step.with_overlap(
                            OverlappedDdp::new(reduce.clone())
                                .with_bucket_bytes(settings.bucket_bytes),
                        );
                    } else if reduce.size() > 1 {
                        step = step.with_ddp(
                            DistributedDataParallel::new(reduce.clone())
                                .with_bucket_bytes(settings.bucket_bytes),
                        );
                    }
                    if let Some(plan) = &fsdp {
                        step = step
                            .with_fsdp(plan.shards().clone(), Some(groups.replicate.clone()))
                            .with_fsdp_no_sync(layout.no_sync);
                    }
                    if let Some(matrix) = matrix {
                        step = step.with_matrix_step(matrix);
                    }
                    if let Some(replicas) = &replicas {
                        step = step.with_replicas(replicas.clone());
                    }
                    let optim = match settings.fused_adamw {
                        true => hyper.init(),
                        false => adamw.init(),
                    };
                    match moe {
                        true => {
                            let step =
                                MoeStep::new(step, &experts).with_clip(settings.max_grad_norm);
                            Box::new(MoeTrainer::new(step, optim))
                        }
                        false => Box::new(Trainer::new(step, optim)),
                    }
                }
            },
        };
        Ok(Built {
            trainee: Trainee::Whole { model, engine },
            groups,
            fsdp,
            experts,
            zero_memory,
            settings: settings.clone(),
            layout,
            diloco,
            replicas,
        })
    }
}
