//! [`MoeArgs`]: the mixture-of-experts flags of a training binary (experts, top-k, expert
//! width, capacity or dropless, auxiliary and z-losses, bias balancing), making or changing a
//! model's [`MoeConfig`].
//!
//! ```
//! use burn_moe::{ExpertKind, MoeConfig};
//! use burn_parallel_train::cli::MoeArgs;
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     moe: MoeArgs,
//! }
//!
//! let args = Args::parse_from(["t", "--moe-experts", "8", "--top-k", "1", "--z-loss", "0.001"]);
//! let dense = MoeConfig::new(64, 256, 1, 1); // the model's width and dense MLP
//! let moe = args.moe.apply(None, &dense).unwrap().unwrap();
//! assert_eq!((moe.n_experts, moe.top_k, moe.d_ff, moe.z_loss), (8, 1, 256, 0.001));
//! // MoE flags without experts are refused, not ignored.
//! let args = Args::parse_from(["t", "--top-k", "1"]);
//! assert!(args.moe.apply(None, &dense).unwrap_err().contains("--moe-experts"));
//! ```

use burn_moe::{Capacity, DropPolicy, MoeConfig};

/// The MoE flags: `--moe-experts`, `--top-k`, `--expert-d-ff`, `--capacity-factor`,
/// `--dropless`, `--aux-loss`, `--z-loss`, `--bias-balancing`, `--bias-rate`.
#[derive(Debug, Clone, clap::Args)]
pub struct MoeArgs {
    /// MoE: the MLP of the model's MoE blocks becomes a mixture of this many experts.
    #[arg(long)]
    pub moe_experts: Option<usize>,
    /// MoE: experts per token (default 2).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// MoE: hidden width of each expert (default: the dense MLP's).
    #[arg(long)]
    pub expert_d_ff: Option<usize>,
    /// MoE: capacity mode, each expert takes at most ceil(tokens x top_k / experts x C)
    /// tokens of each rank's batch; the others are dropped (pass on the residual).
    #[arg(long, conflicts_with = "dropless")]
    pub capacity_factor: Option<f64>,
    /// MoE: dropless mode (the default): no token is dropped.
    #[arg(long)]
    pub dropless: bool,
    /// MoE: coefficient of the Switch load-balancing loss.
    #[arg(long)]
    pub aux_loss: Option<f64>,
    /// MoE: coefficient of the router z-loss.
    #[arg(long)]
    pub z_loss: Option<f64>,
    /// MoE: auxiliary-loss-free balancing (DeepSeek-V3): expert biases move by --bias-rate
    /// after each step.
    #[arg(long)]
    pub bias_balancing: bool,
    /// Step of the expert biases of --bias-balancing.
    #[arg(long, default_value_t = 1e-3)]
    pub bias_rate: f64,
}

impl MoeArgs {
    /// Whether any flag but `--moe-experts` was given.
    fn changes(&self) -> bool {
        self.top_k.is_some()
            || self.expert_d_ff.is_some()
            || self.capacity_factor.is_some()
            || self.dropless
            || self.aux_loss.is_some()
            || self.z_loss.is_some()
            || self.bias_balancing
    }

    /// The model's MoE after these flags: `--moe-experts` makes one (replacing `current`) from
    /// `dense` (the model's width, dense MLP width, expert kind and biases); the others change
    /// it.
    ///
    /// # Errors
    /// MoE flags without experts (neither `--moe-experts` nor a `current` MoE), as one line.
    pub fn apply(
        &self,
        current: Option<MoeConfig>,
        dense: &MoeConfig,
    ) -> Result<Option<MoeConfig>, String> {
        let made = self.moe_experts.map(|experts| {
            let d_ff = self.expert_d_ff.unwrap_or(dense.d_ff);
            MoeConfig {
                expert: dense.expert,
                bias: dense.bias,
                ..MoeConfig::new(dense.d_model, d_ff, experts, self.top_k.unwrap_or(2))
            }
        });
        let Some(mut moe) = made.or(current) else {
            return match self.changes() {
                true => Err(
                    "the MoE flags (--top-k, --capacity-factor, ...) need --moe-experts \
                             (or a model.moe section in --config)"
                        .into(),
                ),
                false => Ok(None),
            };
        };
        if let Some(k) = self.top_k {
            moe.top_k = k;
        }
        if let Some(f) = self.expert_d_ff {
            moe.d_ff = f;
        }
        if let Some(factor) = self.capacity_factor {
            moe.capacity = Capacity::Factor {
                factor,
                drop: DropPolicy::Position,
            };
        }
        if self.dropless {
            moe.capacity = Capacity::Dropless;
        }
        if let Some(a) = self.aux_loss {
            moe.aux_loss = a;
        }
        if let Some(z) = self.z_loss {
            moe.z_loss = z;
        }
        if self.bias_balancing {
            moe.bias_update_rate = self.bias_rate;
        }
        Ok(Some(moe))
    }
}
