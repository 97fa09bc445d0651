//! [`PlanArgs`]: the command line of the memory and FLOPs planner
//! ([`burn_parallel::planner`]): a transformer's shape, the run and the hardware, as flags, for a
//! binary that ranks the layouts that fit (the `plan` binary of the examples).
//!
//! ```
//! use burn_parallel_train::cli::PlanArgs;
//! use clap::Parser;
//!
//! let args = PlanArgs::parse_from(["plan", "--layers", "2", "--d-model", "64", "--world", "4"]);
//! let (shape, training, hardware) = args.inputs().unwrap();
//! assert_eq!((shape.layers, shape.d_model, training.world), (2, 64, 4));
//! let plan = burn_parallel::planner::plan(&shape, &training, &hardware).unwrap();
//! let report = args.report(&shape, &plan);
//! assert!(report[0].starts_with("model: ") && report.iter().any(|l| l.starts_with("| 1 |")));
//! let err = PlanArgs::parse_from(["plan", "--tflops", "0"]).inputs().unwrap_err();
//! assert!(err.contains("--tflops"), "{err}");
//! ```

use burn_parallel::planner::{
    Attention, Candidate, Hardware, ModelShape, MoeShape, NormShape, Plan, Training,
};
use clap::Parser;

/// Rank the layouts (dp, ZeRO 0-3, tp/sp, pp schedules, cp, ep, checkpointing) of a transformer by
/// predicted per-rank memory and step time.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct PlanArgs {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads (grouped-query attention; default: the heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// MLP width (default 4 d_model).
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// Vocabulary.
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Gated (SwiGLU) MLP.
    #[arg(long)]
    pub swiglu: bool,
    /// Rotary positions (no learned position table).
    #[arg(long)]
    pub rotary: bool,
    /// RMSNorm instead of LayerNorm.
    #[arg(long)]
    pub rmsnorm: bool,
    /// No biases in the linear layers.
    #[arg(long)]
    pub no_bias: bool,
    /// Tie the output projection to the token embedding.
    #[arg(long)]
    pub tied: bool,
    /// GPT-MoE: routed experts per MoE layer.
    #[arg(long)]
    pub moe_experts: Option<usize>,
    /// GPT-MoE: experts per token.
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// GPT-MoE: expert width (default: d_ff).
    #[arg(long)]
    pub expert_d_ff: Option<usize>,
    /// GPT-MoE: every n-th block is an MoE block.
    #[arg(long, default_value_t = 1)]
    pub moe_every: usize,
    /// Devices.
    #[arg(long, default_value_t = 8)]
    pub world: usize,
    /// Memory per device, GiB.
    #[arg(long, default_value_t = 16.0)]
    pub memory_gib: f64,
    /// Global batch, sequences per optimizer step.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub micro_batch: usize,
    /// Sustained TFLOP/s per device.
    #[arg(long, default_value_t = 100.0)]
    pub tflops: f64,
    /// Link bandwidth per device, GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub link_gbps: f64,
    /// fp32 everywhere (default: mixed precision, 2 + 2 + 12 bytes per parameter); the
    /// activations are then those this implementation keeps, tensor by tensor.
    #[arg(long)]
    pub fp32: bool,
    /// Flash (blockwise) attention: no `b a s^2` scores kept (default: materialised).
    #[arg(long)]
    pub flash: bool,
    /// No dropout (its masks are not kept).
    #[arg(long)]
    pub no_dropout: bool,
    /// The fused norms and cross-entropy of `burn_parallel::kernels` (fp32 model only).
    #[arg(long)]
    pub fused: bool,
    /// Rows of the table of fitting layouts.
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    /// Rejected layouts to explain.
    #[arg(long, default_value_t = 8)]
    pub rejected: usize,
    /// Write the whole plan as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

impl PlanArgs {
    /// The planner's inputs these flags describe: the model's shape, the training run and the
    /// hardware.
    ///
    /// # Errors
    /// A width that overflows (`4 x --d-model` for the default MLP), or a hardware figure that
    /// is not finite and above 0, as one line naming the flag.
    pub fn inputs(&self) -> Result<(ModelShape, Training, Hardware), String> {
        let a = self;
        let default_ff = a.d_model.checked_mul(4).ok_or_else(|| {
            format!(
                "--d-model {} is too large for the default MLP width of 4 x d_model; give --d-ff",
                a.d_model
            )
        })?;
        let d_ff = a.d_ff.unwrap_or(default_ff);
        let shape = ModelShape {
            kv_heads: a.kv_heads.unwrap_or(a.heads),
            d_ff,
            position_table: if a.rotary { 0 } else { a.seq_len },
            gated_mlp: a.swiglu,
            bias: !a.no_bias,
            norm: if a.rmsnorm {
                NormShape::RmsNorm
            } else {
                NormShape::LayerNorm
            },
            tied_embeddings: a.tied,
            moe: a.moe_experts.map(|experts| MoeShape {
                experts,
                top_k: a.top_k,
                d_ff: a.expert_d_ff.unwrap_or(d_ff),
                shared: 0,
                gated: a.swiglu,
                bias: false,
                every: a.moe_every,
            }),
            ..ModelShape::gpt(a.layers, a.d_model, a.heads, a.vocab, a.seq_len)
        };
        let training = Training {
            micro_batch: a.micro_batch,
            mixed_precision: !a.fp32,
            attention: if a.flash {
                Attention::Flash
            } else {
                Attention::Materialized
            },
            dropout: !a.no_dropout,
            fused: a.fused,
            ..Training::new(a.world, a.batch, a.seq_len)
        };
        let hw = Hardware::try_from_units(a.memory_gib, a.tflops, a.link_gbps)
            .map_err(|e| format!("{e} (--memory-gib, --tflops, --link-gbps)"))?;
        Ok((shape, training, hw))
    }
}

impl PlanArgs {
    /// The planner's report of `plan` (of [`Self::inputs`]'s `shape`), as the `plan` binary
    /// prints it: the model and the run in one line, then the `--top` fastest layouts that fit
    /// (per-rank memory by part, step time, tokens/s, bubble) as a Markdown table, then why the
    /// first `--rejected` others do not.
    pub fn report(&self, shape: &ModelShape, plan: &Plan) -> Vec<String> {
        let a = self;
        let precision = if a.fp32 { "fp32" } else { "mixed precision" };
        let mut lines = vec![format!(
            "model: {} parameters ({} active), {} layers x d_model {}, {} heads; world {}, {} GiB \
             per device, batch {} x {} tokens, {precision}",
            shape.num_params(),
            shape.active_params(),
            shape.layers,
            shape.d_model,
            shape.heads,
            a.world,
            a.memory_gib,
            a.batch,
            a.seq_len,
        )];
        let shown = &plan.fitting[..a.top.min(plan.fitting.len())];
        let gib = 1024.0 * 1024.0 * 1024.0;
        let (unit, unit_name) = match shown.iter().any(|c| c.memory.total() >= gib) {
            true => (gib, "GiB"),
            false => (1024.0 * 1024.0, "MiB"),
        };
        lines.push(format!(
            "\n{} layouts fit, {} rejected; the {} fastest ({unit_name} per rank, worst pipeline \
             stage):\n",
            plan.fitting.len(),
            plan.rejected.len(),
            shown.len()
        ));
        lines.push(
            "(fp32: total = params + optim + max(activ + gathered + transient, grads + buffers): \
             the gradients exist once the backward has released the activations)"
                .into(),
        );
        lines.push(
            "| # | layout | params | grads | optim | activ | buffers | gathered | transient | \
             total | ms/step | tokens/s | bubble |"
                .into(),
        );
        lines.push("|---|---|---|---|---|---|---|---|---|---|---|---|---|".into());
        for (i, c) in shown.iter().enumerate() {
            lines.push(row(i + 1, c, unit));
        }
        if !plan.rejected.is_empty() {
            let n = a.rejected.min(plan.rejected.len());
            lines.push(format!("\nrejected (first {n}):"));
            for r in plan.rejected.iter().take(a.rejected) {
                lines.push(format!("- {}: {}", r.layout, r.reason));
            }
        }
        lines
    }
}

/// One row of the table of fitting layouts, memory in `unit` bytes.
fn row(rank: usize, c: &Candidate, unit: f64) -> String {
    let m = &c.memory;
    format!(
        "| {rank} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | \
         {:.0} | {:.0}% |",
        c.layout,
        m.params / unit,
        m.grads / unit,
        m.optimizer / unit,
        m.activations / unit,
        m.buffers / unit,
        m.gathered / unit,
        m.transient / unit,
        m.total() / unit,
        1e3 * c.step_seconds,
        c.tokens_per_s,
        100.0 * c.bubble_fraction
    )
}
