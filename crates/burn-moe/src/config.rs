//! [`MoeConfig`] and the typed errors of the crate.

use burn_parallel::CollectiveError;
use burn_parallel::tensor_parallel::TpError;
use serde::{Deserialize, Serialize};

/// Errors of mixture-of-experts layers and expert parallelism.
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// `top_k` is 0 or larger than the number of experts.
    #[error(
        "top_k = {k} is invalid for {experts} experts: choose 1 <= top_k <= n_experts \
         (top_k = n_experts routes every token to every expert)"
    )]
    TopK {
        /// The requested number of experts per token.
        k: usize,
        /// The number of experts.
        experts: usize,
    },
    /// The capacity factor is not a finite number above 0.
    #[error(
        "capacity factor {factor} is invalid: it must be a finite number > 0 (1.0 gives each \
         expert exactly its share tokens * top_k / n_experts; use dropless mode for no limit)"
    )]
    CapacityFactor {
        /// The requested factor.
        factor: f64,
    },
    /// The experts do not split evenly over the expert-parallel ranks.
    #[error(
        "{experts} experts cannot be split over {ep} expert-parallel ranks: use an ep that \
         divides the number of experts"
    )]
    ExpertsNotDivisible {
        /// The number of experts.
        experts: usize,
        /// The expert-parallel size.
        ep: usize,
    },
    /// Another setting of the configuration is invalid.
    #[error("invalid MoE configuration: {field}: {reason}")]
    Config {
        /// The offending field.
        field: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// Two ranks built the layer with different settings.
    #[error(
        "rank {rank}: MoE layer settings differ from rank {peer}: this rank has {ours}, rank \
         {peer} has {theirs}; build the layer from the same configuration on every rank"
    )]
    RankMismatch {
        /// Global rank of the caller.
        rank: usize,
        /// Global rank of the first disagreeing peer.
        peer: usize,
        /// This rank's settings.
        ours: String,
        /// The peer's settings.
        theirs: String,
    },
    /// Token counts of an expert-parallel exchange do not add up.
    #[error("rank {rank}: token counts of the expert all-to-all do not add up: {reason}")]
    CountMismatch {
        /// Global rank of the caller.
        rank: usize,
        /// What does not match.
        reason: String,
    },
    /// An input has the wrong shape.
    #[error("MoE layer: {0}")]
    Shape(String),
    /// A layer of the experts failed.
    #[error(transparent)]
    Tp(#[from] TpError),
    /// A collective failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// ZeRO's sharded optimizer failed ([`crate::MoeZero`]).
    #[error(transparent)]
    Zero(#[from] burn_zero::ZeroError),
}

/// `Result` with [`MoeError`].
pub type Result<T> = std::result::Result<T, MoeError>;

/// An MoE error inside a model's forward whose error type is the tensor-parallel layers'
/// ([`TpError`]): collective and tensor-parallel failures keep their type, the others (a bad
/// configuration, experts that do not divide, ranks that disagree) become a
/// [`TpError::Shape`] of the layer `moe` with the message.
impl From<MoeError> for TpError {
    fn from(e: MoeError) -> Self {
        match e {
            MoeError::Tp(e) => e,
            MoeError::Collective(e) => TpError::Collective(e),
            other => TpError::Shape {
                layer: "moe".into(),
                reason: other.to_string(),
            },
        }
    }
}

/// The feed-forward network of each expert.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertKind {
    /// `down(gelu(up(x)))`.
    #[default]
    Gelu,
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
}

/// How router logits become scores (computed in fp32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScoreFn {
    /// Softmax over the experts (Switch, Mixtral, Qwen3-MoE).
    #[default]
    Softmax,
    /// Independent sigmoids (DeepSeek-V3).
    Sigmoid,
}

/// Which tokens an expert over capacity drops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum DropPolicy {
    /// Keep the earliest tokens (token order inside the capacity group).
    #[default]
    Position,
    /// Keep the tokens with the largest gate weights (ties: the earlier token).
    Weight,
}

/// How much an expert may receive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum Capacity {
    /// No token is dropped.
    #[default]
    Dropless,
    /// Each expert takes at most `ceil(tokens * top_k / n_experts * factor)` tokens of each
    /// capacity group (see [`MoeConfig::capacity_groups`]); the others are dropped: their
    /// slot contributes nothing, so the token passes on the residual only.
    Factor {
        /// The capacity factor (> 0).
        factor: f64,
        /// Which tokens are dropped.
        drop: DropPolicy,
    },
}

fn one() -> usize {
    1
}

fn one_f() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn default_std() -> f64 {
    0.02
}

/// Hyper-parameters of a [`crate::MoeLayer`]. Serialisable; optional fields have serde
/// defaults.
///
/// # Capacity groups
///
/// Capacity is applied per *capacity group*: the tokens of one forward call on one rank are cut
/// into `capacity_groups` contiguous groups of (almost) equal size, and each expert takes at
/// most `ceil(group_tokens * top_k / n_experts * factor)` tokens of each group. Under data or
/// expert parallelism each rank's tokens are one group (set `capacity_groups = 1`): a
/// single-device run over the global batch with `capacity_groups` = the number of
/// data-parallel ranks drops exactly the same tokens (GShard's per-group capacity).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Width of the input and output.
    pub d_model: usize,
    /// Hidden width of each expert.
    pub d_ff: usize,
    /// Number of routed experts.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The experts' feed-forward kind.
    #[serde(default)]
    pub expert: ExpertKind,
    /// Biases in the experts' linear layers.
    #[serde(default)]
    pub bias: bool,
    /// Shared experts every token uses (DeepSeek): one MLP of hidden width `n_shared * d_ff`
    /// added to the routed output, unweighted. 0: none.
    #[serde(default)]
    pub n_shared: usize,
    /// Score function of the router.
    #[serde(default)]
    pub score: ScoreFn,
    /// Renormalise the gate weights over the chosen `top_k`.
    #[serde(default = "yes")]
    pub renormalize: bool,
    /// Factor applied to the gate weights (DeepSeek-V3's `routed_scaling_factor`).
    #[serde(default = "one_f")]
    pub route_scale: f64,
    /// Group-limited routing: the experts form `n_groups` groups (0 or 1: off); each token
    /// first keeps its `topk_groups` best groups (a group's score is the sum of its two best
    /// selection scores, or its best when it has one expert), then picks `top_k` experts inside.
    #[serde(default)]
    pub n_groups: usize,
    /// Groups each token may use under group-limited routing.
    #[serde(default)]
    pub topk_groups: usize,
    /// Capacity mode or dropless mode.
    #[serde(default)]
    pub capacity: Capacity,
    /// Number of capacity groups the tokens of one forward call are cut into (see above).
    #[serde(default = "one")]
    pub capacity_groups: usize,
    /// Coefficient of the Switch/GShard load-balancing loss `E * sum_i f_i P_i` (0: off).
    #[serde(default)]
    pub aux_loss: f64,
    /// Coefficient of the router z-loss `mean(logsumexp(logits)^2)` (0: off).
    #[serde(default)]
    pub z_loss: f64,
    /// Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert bias moves by
    /// this much towards balance, `b_i += rate * sign(mean count - count_i)` (0: off).
    #[serde(default)]
    pub bias_update_rate: f64,
    /// Std of the normal initialisation of the router and the experts' input projections.
    #[serde(default = "default_std")]
    pub init_std: f64,
    /// Std of the experts' output projections (`down`); `None`: `init_std`.
    #[serde(default)]
    pub residual_std: Option<f64>,
}

impl MoeConfig {
    /// `n_experts` GELU experts of hidden width `d_ff`, `top_k` per token, softmax scores
    /// renormalised over the chosen experts, dropless, no balancing loss.
    pub fn new(d_model: usize, d_ff: usize, n_experts: usize, top_k: usize) -> Self {
        Self {
            d_model,
            d_ff,
            n_experts,
            top_k,
            expert: ExpertKind::Gelu,
            bias: false,
            n_shared: 0,
            score: ScoreFn::Softmax,
            renormalize: true,
            route_scale: 1.0,
            n_groups: 0,
            topk_groups: 0,
            capacity: Capacity::Dropless,
            capacity_groups: 1,
            aux_loss: 0.0,
            z_loss: 0.0,
            bias_update_rate: 0.0,
            init_std: default_std(),
            residual_std: None,
        }
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`MoeError::TopK`] for `top_k` 0 or above `n_experts`; [`MoeError::CapacityFactor`] for
    /// a factor that is not a finite number above 0; [`MoeError::Config`] for the others (sizes
    /// of 0, groups that do not divide the experts, negative coefficients).
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(MoeError::Config {
                field: field.into(),
                reason,
            })
        };
        for (name, v) in [
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
            ("n_experts", self.n_experts),
            ("capacity_groups", self.capacity_groups),
        ] {
            if v == 0 {
                return bad(name, "must be positive".into());
            }
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(MoeError::TopK {
                k: self.top_k,
                experts: self.n_experts,
            });
        }
        if let Capacity::Factor { factor, .. } = self.capacity
            && !(factor.is_finite() && factor > 0.0)
        {
            return Err(MoeError::CapacityFactor { factor });
        }
        if self.n_groups > 1 {
            if !self.n_experts.is_multiple_of(self.n_groups) {
                return bad(
                    "n_groups",
                    format!(
                        "{} groups do not divide {} experts",
                        self.n_groups, self.n_experts
                    ),
                );
            }
            let per_group = self.n_experts / self.n_groups;
            if self.topk_groups == 0
                || self.topk_groups > self.n_groups
                || self.topk_groups * per_group < self.top_k
            {
                return bad(
                    "topk_groups",
                    format!(
                        "{} of {} groups of {per_group} experts cannot hold top_k = {}; use \
                         1 <= topk_groups <= n_groups with topk_groups * {per_group} >= top_k",
                        self.topk_groups, self.n_groups, self.top_k
                    ),
                );
            }
        }
        for (name, v) in [
            ("route_scale", self.route_scale),
            ("init_std", self.init_std),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(name, format!("{v} must be a finite number > 0"));
            }
        }
        for (name, v) in [
            ("aux_loss", self.aux_loss),
            ("z_loss", self.z_loss),
            ("bias_update_rate", self.bias_update_rate),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(name, format!("{v} must be a finite number >= 0 (0: off)"));
            }
        }
        Ok(())
    }

    /// Number of parameters of the whole layer (all experts, on every rank together).
    pub fn num_params(&self) -> usize {
        let (d, f, b) = (self.d_model, self.d_ff, usize::from(self.bias));
        let expert = |f: usize| {
            let n_in = match self.expert {
                ExpertKind::Gelu => 1,
                ExpertKind::SwiGlu => 2,
            };
            n_in * (d * f + b * f) + f * d + b * d
        };
        let shared = if self.n_shared > 0 {
            expert(self.n_shared * f)
        } else {
            0
        };
        d * self.n_experts + self.n_experts * expert(f) + shared
    }

    /// Parameters one token uses: the router, `top_k` experts and the shared experts (the
    /// active parameters per token).
    pub fn active_params(&self) -> usize {
        let dense = MoeConfig {
            n_experts: self.top_k,
            ..self.clone()
        };
        dense.num_params() - self.d_model * self.top_k + self.d_model * self.n_experts
    }
}

/// The MoE error at the suite's surface: a collective, tensor-parallel or ZeRO failure as
/// [`burn_parallel::Error`] converts those, the rest as [`burn_parallel::Error::Technique`].
impl From<MoeError> for burn_parallel::Error {
    fn from(e: MoeError) -> Self {
        match e {
            MoeError::Collective(e) => e.into(),
            MoeError::Tp(e) => e.into(),
            MoeError::Zero(e) => e.into(),
            e => Self::Technique(Box::new(e)),
        }
    }
}
