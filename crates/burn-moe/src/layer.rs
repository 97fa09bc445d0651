//! [`MoeLayer`]: a mixture-of-experts feed-forward layer, a drop-in replacement for an MLP.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::module::{Module, Param, ParamId};
use burn::tensor::activation::{gelu, sigmoid, silu, softmax};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_parallel::autograd::{BackwardFn, attach};
use burn_parallel::index::ParamIndex;
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::Linear;
use burn_parallel::{DeviceMesh, ParallelDims, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::config::{ExpertKind, MoeConfig, MoeError, Result, ScoreFn};
use crate::dispatch::{combine, dispatch, reorder};
use crate::router::{DispatchPlan, imbalance, plan_dispatch, select_experts};

/// One expert: `down(gelu(up(x)))` or `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Expert {
    /// Input projection `[d_model, hidden]`.
    pub up: Linear,
    /// Gate projection `[d_model, hidden]` (SwiGLU only).
    pub gate: Option<Linear>,
    /// Output projection `[hidden, d_model]`.
    pub down: Linear,
}

impl Expert {
    /// An expert of hidden width `hidden`, parameters `up.weight`, ... under `init`.
    ///
    /// # Errors
    /// Plan errors of `init`'s tensor-parallel plan.
    pub fn new(config: &MoeConfig, hidden: usize, init: &Init) -> Result<Self> {
        let d = config.d_model;
        let spec = |d_in, d_out, std| {
            LinearInit::new(d_in, d_out)
                .with_bias(config.bias)
                .with_std(std)
        };
        let std = config.init_std;
        Ok(Self {
            up: init.linear("up", spec(d, hidden, std))?,
            gate: match config.expert {
                ExpertKind::Gelu => None,
                ExpertKind::SwiGlu => Some(init.linear("gate", spec(d, hidden, std))?),
            },
            down: init.linear("down", spec(hidden, d, config.residual_std.unwrap_or(std)))?,
        })
    }

    /// `[rows, d_model] -> [rows, d_model]`.
    ///
    /// # Errors
    /// Shape errors of the linear layers.
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>> {
        let hidden = match &self.gate {
            None => gelu(self.up.forward(x)?),
            Some(gate) => silu(gate.forward(x.clone())?) * self.up.forward(x)?,
        };
        Ok(self.down.forward(hidden)?)
    }
}

/// The expert parameters of every MoE layer built with one [`MoeParallel`], each with the
/// global index of its expert (the index it has on one device): [`crate::MoeStep`] reduces
/// their gradients over the ranks that hold the same experts only, and checkpoints name them
/// by that index. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct ExpertParams(Arc<Mutex<HashMap<ParamId, usize>>>);

impl ExpertParams {
    /// Records `module`'s float parameters as those of global expert `index`.
    pub fn register<M: Module>(&self, module: &M, index: usize) {
        let ids = ParamIndex::of(module);
        let mut registry = self.0.lock().expect("expert registry");
        registry.extend(ids.ids().map(|id| (id, index)));
    }

    /// The global expert index of `id`, when it is an expert parameter.
    pub fn expert_of(&self, id: &ParamId) -> Option<usize> {
        self.0.lock().expect("expert registry").get(id).copied()
    }

    /// Whether `id` is an expert parameter.
    pub fn contains(&self, id: &ParamId) -> bool {
        self.0.lock().expect("expert registry").contains_key(id)
    }

    /// Number of registered parameters.
    pub fn len(&self) -> usize {
        self.0.lock().expect("expert registry").len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How an MoE layer is parallelised: the groups it communicates over.
#[derive(Debug, Clone, Default)]
pub struct MoeParallel {
    /// The expert-parallel group: its ranks split the experts and exchange tokens. `None`:
    /// every expert on every rank.
    pub ep: Option<ProcessGroup>,
    /// The ranks whose tokens form the global batch and whose gradients are averaged
    /// ([`ParallelDims::gradient_reduction`]): token counts are summed over them for the
    /// load-balancing loss, the bias updates and the metrics. `None`: one rank.
    pub dp: Option<ProcessGroup>,
    /// The ranks that hold the same experts ([`ParallelDims::expert_data_parallel`]): expert
    /// gradients are reduced over them. `None`: one rank.
    pub expert_dp: Option<ProcessGroup>,
    /// The expert parameters of the layers built with this value.
    pub experts: ExpertParams,
    /// The state and bias update rate of every layer built with this value, in build order,
    /// for [`Self::set_loss_scale`] and the bias methods.
    layers: Arc<Mutex<Vec<Registered>>>,
}

/// A layer in a [`MoeParallel`]'s registry: its state and its bias update rate.
type Registered = (Arc<Mutex<State>>, f32);

impl MoeParallel {
    /// Sets the loss scale of every MoE layer built with this value
    /// ([`MoeLayer::set_loss_scale`]): what a training step that scales its loss (by
    /// `1 / micro-steps`, by a dynamic loss scale) calls before the forward, so that the
    /// balancing losses' gradients, injected in the backward, are scaled as the loss is.
    /// [`crate::MoeStep::step_with`] does it.
    pub fn set_loss_scale(&self, scale: f32) {
        for (state, _) in self.layers.lock().expect("MoE layer registry").iter() {
            state.lock().expect("MoE state").loss_scale = scale;
        }
    }

    /// Moves the expert biases of every layer built with this value towards balance
    /// ([`MoeLayer::update_bias`]): what a training loop calls after each optimizer step (the
    /// [`crate::MoeTrainer`] engine does).
    pub fn update_biases(&self) {
        for (state, rate) in self.layers.lock().expect("MoE layer registry").iter() {
            update_bias(&mut state.lock().expect("MoE state"), *rate);
        }
    }

    /// The expert biases of every layer built with this value, in build order (for a
    /// checkpoint: the same on every rank).
    pub fn expert_biases(&self) -> Vec<Vec<f32>> {
        let layers = self.layers.lock().expect("MoE layer registry");
        layers
            .iter()
            .map(|(state, _)| state.lock().expect("MoE state").bias.clone())
            .collect()
    }

    /// Sets the expert biases of every layer built with this value from
    /// [`Self::expert_biases`] of the same model.
    ///
    /// # Errors
    /// [`MoeError::Shape`] when `biases` has another number of layers, or a layer another
    /// number of experts.
    pub fn set_expert_biases(&self, biases: &[Vec<f32>]) -> Result<()> {
        let layers = self.layers.lock().expect("MoE layer registry");
        if biases.len() != layers.len() {
            return Err(MoeError::Shape(format!(
                "expert biases of {} MoE layers given for a model of {}",
                biases.len(),
                layers.len()
            )));
        }
        for (i, ((state, _), bias)) in layers.iter().zip(biases).enumerate() {
            let mut state = state.lock().expect("MoE state");
            if bias.len() != state.bias.len() {
                return Err(MoeError::Shape(format!(
                    "MoE layer {i}: {} expert biases given for {} experts",
                    bias.len(),
                    state.bias.len()
                )));
            }
            state.bias = bias.clone();
        }
        Ok(())
    }

    /// The groups of `dims` on `mesh` (built by [`ParallelDims::build`]): `ep` from
    /// [`ParallelDims::expert_parallel`], `dp` from [`ParallelDims::gradient_reduction`],
    /// `expert_dp` from [`ParallelDims::expert_data_parallel`]. Creates groups: every rank must
    /// call it.
    ///
    /// # Errors
    /// Mesh errors.
    pub fn from_mesh(
        dims: &ParallelDims,
        mesh: &DeviceMesh,
    ) -> std::result::Result<Self, burn_parallel::MeshError> {
        let some = |g: ProcessGroup| (g.size() > 1).then_some(g);
        Ok(Self {
            dp: some(dims.gradient_reduction(mesh)?),
            ep: some(dims.expert_parallel(mesh)?),
            expert_dp: some(dims.expert_data_parallel(mesh)?),
            experts: ExpertParams::default(),
            layers: Arc::default(),
        })
    }

    /// The expert-parallel size.
    pub fn ep_size(&self) -> usize {
        self.ep.as_ref().map_or(1, ProcessGroup::size)
    }

    /// The data-parallel size.
    pub fn dp_size(&self) -> usize {
        self.dp.as_ref().map_or(1, ProcessGroup::size)
    }
}

/// Routing figures of one forward call, summed over the data-parallel ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeStats {
    /// Tokens routed.
    pub tokens: usize,
    /// Assignments each expert was chosen for (before capacity).
    pub routed: Vec<f64>,
    /// Assignments each expert computed (after capacity).
    pub kept: Vec<f64>,
    /// Assignments dropped for capacity.
    pub dropped: f64,
    /// The Switch load-balancing loss `E * sum_i f_i P_i` (without its coefficient) on this
    /// rank's tokens with the global `f`; its mean over the data-parallel ranks is the global
    /// value.
    pub aux_loss: f64,
    /// The router z-loss (without its coefficient), the same way.
    pub z_loss: f64,
}

impl MoeStats {
    /// Tokens routed to each expert (before capacity).
    pub fn tokens_per_expert(&self) -> &[f64] {
        &self.routed
    }

    /// Share of the assignments dropped for capacity.
    pub fn drop_rate(&self) -> f64 {
        let total: f64 = self.routed.iter().sum();
        if total > 0.0 {
            self.dropped / total
        } else {
            0.0
        }
    }

    /// Load imbalance: the busiest expert's routed count over the mean (1: balanced).
    pub fn imbalance(&self) -> f64 {
        imbalance(&self.routed)
    }
}

#[derive(Debug, Default)]
struct State {
    bias: Vec<f32>,
    pending: Vec<f64>,
    last: Option<MoeStats>,
    /// The gradient the balancing losses get in the backward ([`MoeLayer::set_loss_scale`]).
    loss_scale: f32,
}

/// [`MoeLayer::update_bias`] on a layer's state: the biases moved by `rate` towards balance
/// from the token counts since the last update (`None`, nothing done, for a rate of 0).
fn update_bias(state: &mut State, rate: f32) -> Option<Vec<f32>> {
    if rate == 0.0 {
        return None;
    }
    let counts = std::mem::replace(&mut state.pending, vec![0.0; state.bias.len()]);
    let total: f64 = counts.iter().sum();
    if total > 0.0 {
        let mean = total / counts.len() as f64;
        for (b, c) in state.bias.iter_mut().zip(&counts) {
            let err = mean - c;
            if err > 0.0 {
                *b += rate;
            } else if err < 0.0 {
                *b -= rate;
            }
        }
    }
    Some(state.bias.clone())
}

/// A mixture-of-experts layer: a router picks `top_k` of `n_experts` experts per token, the
/// experts run on contiguous blocks of their tokens (sorted once, expert-major), and their
/// outputs are summed with the gate weights; shared experts, capacity, balancing losses and
/// bias balancing as [`MoeConfig`] says. Under expert parallelism ([`MoeParallel::ep`]) each
/// rank holds `n_experts / ep` experts and tokens travel by all-to-all ([`crate::dispatch`]).
///
/// The balancing losses are not returned: as in Megatron-Core, their gradient (coefficient
/// times the loss's gradient) is injected into the backward pass through the layer's output,
/// whose value they leave unchanged, so a plain training loop trains with them. Their values
/// are in [`Self::last_stats`]. A loop that scales its loss before the backward (gradient
/// accumulation's `1 / micro-steps`, a loss scaler) sets the same scale with
/// [`Self::set_loss_scale`]: the injected gradient does not pass through the loss.
///
/// Parameters: `router.weight` `[d_model, n_experts]` (Normal(0, init_std)), `experts.{i}.up`,
/// `.gate`, `.down` (this rank's experts, initialised at the path of their global index
/// `experts.{first_expert + i}`), `shared.*`.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_moe::{MoeConfig, MoeLayer};
/// use burn_parallel::init::Init;
///
/// let device = Device::flex();
/// let config = MoeConfig::new(8, 16, 4, 2);
/// let moe = MoeLayer::new(&config, &Init::new(0, &device)).unwrap();
/// let y = moe.forward(Tensor::<3>::ones([2, 5, 8], &device)).unwrap();
/// assert_eq!(y.dims(), [2, 5, 8]);
/// let stats = moe.last_stats().unwrap();
/// assert_eq!(stats.routed.iter().sum::<f64>(), 20.0); // 10 tokens x top-2
/// ```
#[derive(Module, Debug)]
pub struct MoeLayer {
    /// Router `[d_model, n_experts]`.
    pub router: Param<Tensor<2>>,
    /// This rank's experts.
    pub experts: Vec<Expert>,
    /// The shared experts, as one MLP.
    pub shared: Option<Expert>,
    /// The configuration.
    #[module(skip)]
    pub config: MoeConfig,
    /// The groups.
    #[module(skip)]
    pub parallel: MoeParallel,
    /// Global index of `experts[0]`.
    #[module(skip)]
    pub first_expert: usize,
    #[module(skip)]
    state: Arc<Mutex<State>>,
}

impl MoeLayer {
    /// A single-device layer at `init`'s path.
    ///
    /// # Errors
    /// [`MoeConfig::validate`]'s errors; plan errors.
    pub fn new(config: &MoeConfig, init: &Init) -> Result<Self> {
        Self::build(config, init, &MoeParallel::default())
    }

    /// A layer for the groups of `parallel`: this rank builds only its `n_experts / ep`
    /// experts. Checks with one small all-gather over the data-parallel group (and one over the
    /// expert-parallel group) that every rank has the same settings.
    ///
    /// # Errors
    /// [`MoeConfig::validate`]'s errors; [`MoeError::ExpertsNotDivisible`];
    /// [`MoeError::RankMismatch`] when ranks disagree on the number of experts, `top_k` or
    /// another routing setting; plan and collective errors.
    pub fn build(config: &MoeConfig, init: &Init, parallel: &MoeParallel) -> Result<Self> {
        config.validate()?;
        let ep = parallel.ep_size();
        if !config.n_experts.is_multiple_of(ep) {
            return Err(MoeError::ExpertsNotDivisible {
                experts: config.n_experts,
                ep,
            });
        }
        let settings = format!(
            "n_experts {} top_k {} ep {ep} d_model {} d_ff {} score {:?} capacity {:?} \
             groups {}/{} aux {} z {} bias rate {}",
            config.n_experts,
            config.top_k,
            config.d_model,
            config.d_ff,
            config.score,
            config.capacity,
            config.topk_groups,
            config.n_groups,
            config.aux_loss,
            config.z_loss,
            config.bias_update_rate
        );
        for group in [&parallel.dp, &parallel.ep].into_iter().flatten() {
            let all = group.all_gather_object(&settings)?;
            if let Some((peer, theirs)) = all.iter().enumerate().find(|(_, s)| **s != settings) {
                return Err(MoeError::RankMismatch {
                    rank: group.global_rank(),
                    peer: group.members()[peer],
                    ours: settings,
                    theirs: theirs.clone(),
                });
            }
        }
        let per_rank = config.n_experts / ep;
        let first_expert = parallel.ep.as_ref().map_or(0, |g| g.rank() * per_rank);
        let experts = (first_expert..first_expert + per_rank)
            .map(|i| Expert::new(config, config.d_ff, &init.at("experts").at(i)))
            .collect::<Result<Vec<_>>>()?;
        for (i, expert) in experts.iter().enumerate() {
            parallel.experts.register(expert, first_expert + i);
        }
        let shared = (config.n_shared > 0)
            .then(|| Expert::new(config, config.n_shared * config.d_ff, &init.at("shared")))
            .transpose()?;
        let state = Arc::new(Mutex::new(State {
            bias: vec![0.0; config.n_experts],
            pending: vec![0.0; config.n_experts],
            last: None,
            loss_scale: 1.0,
        }));
        parallel
            .layers
            .lock()
            .expect("MoE layer registry")
            .push((state.clone(), config.bias_update_rate as f32));
        Ok(Self {
            router: init.at("router").normal(
                "weight",
                [config.d_model, config.n_experts],
                config.init_std,
            ),
            experts,
            shared,
            config: config.clone(),
            parallel: parallel.clone(),
            first_expert,
            state,
        })
    }

    /// Applies the layer to `x` `[.., d_model]` (every leading dimension is a token).
    ///
    /// # Errors
    /// [`MoeError::Shape`] when the last dimension is not `d_model`; collective errors under
    /// expert or data parallelism.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>> {
        let dims = x.dims();
        let d = dims[D - 1];
        if d != self.config.d_model {
            return Err(MoeError::Shape(format!(
                "input has {d} features, the layer takes d_model = {}",
                self.config.d_model
            )));
        }
        let tokens: usize = dims[..D - 1].iter().product();
        Ok(self.forward_tokens(x.reshape([tokens, d]))?.reshape(dims))
    }

    /// The routing of `x` `[tokens, d_model]`: the fp32 router logits, the scores, the chosen
    /// experts (`tokens * top_k`, token-major) and the gate weights `[tokens, top_k]`.
    ///
    /// # Errors
    /// Never at present (reserved for backends that cannot read scores back).
    pub fn route(&self, x: Tensor<2>) -> Result<Routing> {
        let [t, _] = x.dims();
        let cfg = &self.config;
        let (e, k) = (cfg.n_experts, cfg.top_k);
        let logits = x
            .cast(DType::F32)
            .matmul(self.router.val().cast(DType::F32));
        let scores = match cfg.score {
            ScoreFn::Softmax => softmax(logits.clone(), 1),
            ScoreFn::Sigmoid => sigmoid(logits.clone()),
        };
        let host: Vec<f32> = scores
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32 scores");
        let bias = self.expert_bias();
        let groups = if cfg.n_groups > 1 { cfg.n_groups } else { 0 };
        let chosen = select_experts(&host, &bias, e, k, groups, cfg.topk_groups);
        let index: Vec<i64> = chosen.iter().map(|&c| c as i64).collect();
        let index = Tensor::<2, Int>::from_data(TensorData::new(index, [t, k]), &scores.device());
        let mut gates = scores.clone().gather(1, index);
        if cfg.renormalize {
            gates = gates.clone() / gates.sum_dim(1);
        }
        if cfg.route_scale != 1.0 {
            gates = gates * cfg.route_scale;
        }
        Ok(Routing {
            logits,
            scores,
            chosen,
            gates,
        })
    }

    /// [`Self::forward`] on `[tokens, d_model]`.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn forward_tokens(&self, x: Tensor<2>) -> Result<Tensor<2>> {
        let [t, d] = x.dims();
        let cfg = &self.config;
        let (e, k) = (cfg.n_experts, cfg.top_k);
        let tracked = x.is_tracked() || self.router.val().is_tracked();
        let routing = self.route(x.clone())?;
        let gate_host: Vec<f32> = routing
            .gates
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32 gates");
        let plan = plan_dispatch(
            &routing.chosen,
            &gate_host,
            e,
            k,
            cfg.capacity,
            cfg.capacity_groups,
        );
        let stats = self.global_counts(t, &plan)?;
        let aux = self.balancing_losses(&routing, &stats)?;

        // Expert-major rows, computed on this rank or on the ranks holding the experts.
        let rows: Vec<usize> = plan.order.iter().map(|s| s / k).collect();
        let n = rows.len();
        let sorted = match &self.parallel.ep {
            Some(ep) => {
                let mut xs = rows_of(x.clone(), &rows);
                if tracked && !xs.is_tracked() {
                    // Every rank's exchanges must be in the graph (their backwards are
                    // collectives): tie untracked inputs to the router with an exact zero.
                    let anchor = self.router.val().sum().cast(x.dtype()) * 0.0;
                    xs = xs + anchor.reshape([1, 1]);
                }
                let (local, layout) = dispatch(xs, &plan.kept, ep)?;
                let y = self.run_experts(local, &layout.expert_rows)?;
                Some(combine(y, &layout)?)
            }
            None if n == 0 => None,
            None => Some(self.run_experts(rows_of(x.clone(), &rows), &plan.kept)?),
        };
        let device = x.device();
        let dtype = x.dtype();
        let mut out = match sorted {
            None => Tensor::<2>::zeros([t, d], (&device, dtype)),
            Some(y) => {
                // Un-permute to slot order; dropped slots read a zero row.
                let with_zero = Tensor::cat(vec![y, Tensor::zeros([1, d], (&device, dtype))], 0);
                let slots: Vec<usize> = plan
                    .positions(t * k)
                    .into_iter()
                    .map(|p| p.unwrap_or(n))
                    .collect();
                let per_slot = reorder(with_zero, &slots).reshape([t, k, d]);
                let gates = routing.gates.clone().cast(dtype).reshape([t, k, 1]);
                (per_slot * gates).sum_dim(1).reshape([t, d])
            }
        };
        if let Some(shared) = &self.shared {
            out = out + shared.forward(x)?;
        }
        if let Some(total) = aux.1
            && tracked
        {
            // Megatron's aux-loss scaler: the forward value is unchanged, the backward gives
            // the loss term gradient 1 (its coefficients are inside `total`).
            let zero = Tensor::<2>::zeros([1, 1], (&device, dtype));
            let scale = self.state.lock().expect("MoE state").loss_scale;
            let inject = attach(
                total,
                zero,
                BackwardFn::new("moe_balancing_loss", move |_| {
                    Ok(TensorData::new(vec![scale], [1]))
                }),
            );
            out = out + inject;
        }
        let mut state = self.state.lock().expect("MoE state");
        if tracked {
            for (p, r) in state.pending.iter_mut().zip(&stats.routed) {
                *p += r;
            }
        }
        state.last = Some(MoeStats {
            aux_loss: aux.0[0],
            z_loss: aux.0[1],
            ..stats
        });
        Ok(out)
    }

    /// Token counts summed over the data-parallel ranks.
    fn global_counts(&self, tokens: usize, plan: &DispatchPlan) -> Result<MoeStats> {
        let e = self.config.n_experts;
        let mut v: Vec<f32> = Vec::with_capacity(2 * e + 2);
        v.push(tokens as f32);
        v.extend(plan.routed.iter().map(|&c| c as f32));
        v.extend(plan.kept.iter().map(|&c| c as f32));
        v.push(plan.dropped() as f32);
        if let Some(dp) = &self.parallel.dp {
            v = dp.all_reduce_f32(v, ReduceOp::Sum)?;
        }
        let f = |x: &[f32]| x.iter().map(|&c| f64::from(c)).collect::<Vec<f64>>();
        Ok(MoeStats {
            tokens: v[0] as usize,
            routed: f(&v[1..=e]),
            kept: f(&v[e + 1..=2 * e]),
            dropped: f64::from(v[2 * e + 1]),
            aux_loss: 0.0,
            z_loss: 0.0,
        })
    }

    /// The load-balancing loss and the z-loss (values), and their weighted sum as a tensor
    /// when a coefficient is set. Scaled so that their gradients averaged over the
    /// data-parallel ranks are those of the global batch.
    fn balancing_losses(
        &self,
        routing: &Routing,
        stats: &MoeStats,
    ) -> Result<([f64; 2], Option<Tensor<1>>)> {
        let cfg = &self.config;
        let (e, k) = (cfg.n_experts, cfg.top_k);
        let per_token = self.parallel.dp_size() as f64 / stats.tokens.max(1) as f64;
        let device = routing.scores.device();
        // Switch: f_i = share of the (global) assignments, P_i = mean router probability.
        let probs = match cfg.score {
            ScoreFn::Softmax => routing.scores.clone(),
            ScoreFn::Sigmoid => routing.scores.clone() / routing.scores.clone().sum_dim(1),
        };
        let f: Vec<f32> = stats
            .routed
            .iter()
            .map(|&c| (c / (stats.tokens.max(1) * k) as f64) as f32)
            .collect();
        let f = Tensor::<2>::from_data(TensorData::new(f, [1, e]), &device);
        let aux = (probs.sum_dim(0) * f).sum() * (per_token * e as f64);
        // z-loss: mean squared log-sum-exp of the logits.
        let m = routing.logits.clone().max_dim(1).detach();
        let lse = (routing.logits.clone() - m.clone()).exp().sum_dim(1).log() + m;
        let z = lse.square().sum() * per_token;
        let values = [scalar(&aux), scalar(&z)];
        let total = match (cfg.aux_loss > 0.0, cfg.z_loss > 0.0) {
            (false, false) => None,
            (true, false) => Some(aux * cfg.aux_loss),
            (false, true) => Some(z * cfg.z_loss),
            (true, true) => Some(aux * cfg.aux_loss + z * cfg.z_loss),
        };
        Ok((values, total))
    }

    /// Runs this rank's experts on `x`, whose rows are blocks of `rows[j]` rows for local
    /// expert `j`; an expert with no rows is skipped (its parameters get no gradient, as on
    /// one device).
    fn run_experts(&self, x: Tensor<2>, rows: &[usize]) -> Result<Tensor<2>> {
        let mut outs = Vec::with_capacity(rows.len());
        let mut start = 0;
        for (expert, &n) in self.experts.iter().zip(rows) {
            if n > 0 {
                outs.push(expert.forward(x.clone().narrow(0, start, n))?);
            }
            start += n;
        }
        Ok(match outs.len() {
            0 => x, // no rows: the (empty) input keeps the exchange in the graph
            1 => outs.pop().expect("one output"),
            _ => Tensor::cat(outs, 0),
        })
    }

    /// Moves the expert biases towards balance from the token counts of the training forward
    /// calls since the last update (summed over the data-parallel ranks, so every rank computes
    /// the same biases): `b_i += rate * sign(mean - count_i)`. Call it after each optimizer
    /// step. No-op (returns `None`) when `bias_update_rate` is 0.
    pub fn update_bias(&self) -> Option<Vec<f32>> {
        let rate = self.config.bias_update_rate as f32;
        update_bias(&mut self.state.lock().expect("MoE state"), rate)
    }

    /// Sets the factor the training loop multiplies its loss by before the backward (1 by
    /// default): the balancing losses' gradient, injected in the backward rather than through
    /// the loss, is scaled by it too (Megatron-Core's `MoEAuxLossAutoScaler.set_loss_scale`).
    /// Under gradient accumulation with the loss divided by the number of micro-steps, set
    /// `1 / micro-steps`, so that the balancing losses weigh, relative to the loss, what their
    /// coefficients say. Applies to the forward calls that follow.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_moe::{MoeConfig, MoeLayer};
    /// use burn_parallel::init::Init;
    ///
    /// let device = Device::flex().autodiff();
    /// let config = MoeConfig { aux_loss: 0.1, ..MoeConfig::new(4, 8, 2, 1) };
    /// let moe = MoeLayer::new(&config, &Init::new(0, &device)).unwrap();
    /// let router_grad = |scale: f32| {
    ///     moe.set_loss_scale(scale);
    ///     let x = Tensor::<2>::ones([3, 4], &device);
    ///     // A loss that does not depend on the output: only the balancing loss's gradient.
    ///     let grads = (moe.forward(x).unwrap().sum() * 0.0).backward();
    ///     moe.router.val().grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap()
    /// };
    /// let (one, half) = (router_grad(1.0), router_grad(0.5));
    /// assert!(one.iter().zip(&half).all(|(a, b)| (a * 0.5 - b).abs() < 1e-7));
    /// ```
    pub fn set_loss_scale(&self, scale: f32) {
        self.state.lock().expect("MoE state").loss_scale = scale;
    }

    /// The expert biases (added to the scores for selection only).
    pub fn expert_bias(&self) -> Vec<f32> {
        self.state.lock().expect("MoE state").bias.clone()
    }

    /// Sets the expert biases (for example those of a trained expert-parallel layer on its
    /// single-device copy).
    ///
    /// # Errors
    /// [`MoeError::Shape`] when `bias` does not have one value per expert.
    pub fn set_expert_bias(&self, bias: &[f32]) -> Result<()> {
        if bias.len() != self.config.n_experts {
            return Err(MoeError::Shape(format!(
                "{} expert biases given for {} experts",
                bias.len(),
                self.config.n_experts
            )));
        }
        self.state.lock().expect("MoE state").bias = bias.to_vec();
        Ok(())
    }

    /// The routing figures of the last forward call.
    pub fn last_stats(&self) -> Option<MoeStats> {
        self.state.lock().expect("MoE state").last.clone()
    }
}

/// What the router decided for a batch of tokens ([`MoeLayer::route`]).
#[derive(Debug, Clone)]
pub struct Routing {
    /// Router logits `[tokens, n_experts]`, fp32.
    pub logits: Tensor<2>,
    /// Scores `[tokens, n_experts]` (softmax or sigmoid of the logits).
    pub scores: Tensor<2>,
    /// Chosen experts, `tokens * top_k`, token-major.
    pub chosen: Vec<usize>,
    /// Gate weights `[tokens, top_k]`: the chosen scores, renormalised and scaled.
    pub gates: Tensor<2>,
}

fn scalar(x: &Tensor<1>) -> f64 {
    x.clone()
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .expect("a scalar")[0]
}

/// Rows `rows` of `x` (possibly none, possibly repeated).
fn rows_of(x: Tensor<2>, rows: &[usize]) -> Tensor<2> {
    if rows.is_empty() {
        return x.narrow(0, 0, 0);
    }
    reorder(x, rows)
}
