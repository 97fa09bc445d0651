//! Which layout of the GPT fits, and which is fastest: the memory and FLOPs planner of
//! `burn_parallel::planner` on the command line.
//!
//! ```text
//! cargo run -p examples --bin plan -- --layers 24 --d-model 2048 --heads 16 --vocab 50304 \
//!     --seq-len 2048 --world 16 --memory-gib 16 --batch 64 --tflops 100 --link-gbps 50
//! plan --layers 32 --d-model 4096 --heads 32 --kv-heads 8 --d-ff 14336 --swiglu --rotary \
//!     --rmsnorm --vocab 128256 --seq-len 8192 --world 64 --memory-gib 80 --batch 512
//! plan --moe-experts 8 --top-k 2 --world 8 --memory-gib 1   # GPT-MoE, expert parallel too
//! ```
//!
//! Prints the layouts that fit, fastest first (per-rank memory by part, predicted step time
//! and tokens/s), then why the first rejected ones do not. `--json FILE` writes the whole plan.

use std::process::ExitCode;

use burn_parallel::planner::{
    Attention, Candidate, Hardware, ModelShape, MoeShape, NormShape, Training, plan,
};
use clap::Parser;

/// Rank the layouts (dp, ZeRO 0-3, tp/sp, pp schedules, cp, ep, checkpointing) of a GPT by
/// predicted per-rank memory and step time.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads (grouped-query attention; default: the heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// MLP width (default 4 d_model).
    #[arg(long)]
    d_ff: Option<usize>,
    /// Vocabulary.
    #[arg(long, default_value_t = 256)]
    vocab: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Gated (SwiGLU) MLP.
    #[arg(long)]
    swiglu: bool,
    /// Rotary positions (no learned position table).
    #[arg(long)]
    rotary: bool,
    /// RMSNorm instead of LayerNorm.
    #[arg(long)]
    rmsnorm: bool,
    /// No biases in the linear layers.
    #[arg(long)]
    no_bias: bool,
    /// Tie the output projection to the token embedding.
    #[arg(long)]
    tied: bool,
    /// GPT-MoE: routed experts per MoE layer.
    #[arg(long)]
    moe_experts: Option<usize>,
    /// GPT-MoE: experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// GPT-MoE: expert width (default: d_ff).
    #[arg(long)]
    expert_d_ff: Option<usize>,
    /// GPT-MoE: every n-th block is an MoE block.
    #[arg(long, default_value_t = 1)]
    moe_every: usize,
    /// Devices.
    #[arg(long, default_value_t = 8)]
    world: usize,
    /// Memory per device, GiB.
    #[arg(long, default_value_t = 16.0)]
    memory_gib: f64,
    /// Global batch, sequences per optimizer step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    micro_batch: usize,
    /// Sustained TFLOP/s per device.
    #[arg(long, default_value_t = 100.0)]
    tflops: f64,
    /// Link bandwidth per device, GB/s.
    #[arg(long, default_value_t = 25.0)]
    link_gbps: f64,
    /// fp32 everywhere (default: mixed precision, 2 + 2 + 12 bytes per parameter); the
    /// activations are then those this implementation keeps, tensor by tensor.
    #[arg(long)]
    fp32: bool,
    /// Flash (blockwise) attention: no `b a s^2` scores kept (default: materialised).
    #[arg(long)]
    flash: bool,
    /// No dropout (its masks are not kept).
    #[arg(long)]
    no_dropout: bool,
    /// The fused norms and cross-entropy of `burn_parallel::kernels` (fp32 model only).
    #[arg(long)]
    fused: bool,
    /// Rows of the table of fitting layouts.
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// Rejected layouts to explain.
    #[arg(long, default_value_t = 8)]
    rejected: usize,
    /// Write the whole plan as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

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

fn main() -> ExitCode {
    let a = Args::parse();
    let shape = ModelShape {
        kv_heads: a.kv_heads.unwrap_or(a.heads),
        d_ff: a.d_ff.unwrap_or(4 * a.d_model),
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
            d_ff: a.expert_d_ff.or(a.d_ff).unwrap_or(4 * a.d_model),
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
    let hw = match Hardware::try_from_units(a.memory_gib, a.tflops, a.link_gbps) {
        Ok(hw) => hw,
        Err(e) => {
            eprintln!("error: {e} (--memory-gib, --tflops, --link-gbps)");
            return ExitCode::from(2);
        }
    };
    let result = match plan(&shape, &training, &hw) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "model: {} parameters ({} active), {} layers x d_model {}, {} heads; world {}, {} GiB \
         per device, batch {} x {} tokens, {}",
        shape.num_params(),
        shape.active_params(),
        shape.layers,
        shape.d_model,
        shape.heads,
        a.world,
        a.memory_gib,
        a.batch,
        a.seq_len,
        if a.fp32 { "fp32" } else { "mixed precision" }
    );
    let shown = &result.fitting[..a.top.min(result.fitting.len())];
    let gib = 1024.0 * 1024.0 * 1024.0;
    let (unit, unit_name) = if shown.iter().any(|c| c.memory.total() >= gib) {
        (gib, "GiB")
    } else {
        (1024.0 * 1024.0, "MiB")
    };
    println!(
        "\n{} layouts fit, {} rejected; the {} fastest ({unit_name} per rank, worst pipeline \
         stage):\n",
        result.fitting.len(),
        result.rejected.len(),
        shown.len()
    );
    println!(
        "(fp32: total = params + optim + max(activ + gathered + transient, grads + buffers): \
         the gradients exist once the backward has released the activations)"
    );
    println!(
        "| # | layout | params | grads | optim | activ | buffers | gathered | transient | total | \
         ms/step | tokens/s | bubble |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, c) in shown.iter().enumerate() {
        println!("{}", row(i + 1, c, unit));
    }
    if !result.rejected.is_empty() {
        println!(
            "\nrejected (first {}):",
            a.rejected.min(result.rejected.len())
        );
        for r in result.rejected.iter().take(a.rejected) {
            println!("- {}: {}", r.layout, r.reason);
        }
    }
    if let Some(path) = &a.json {
        let text = match serde_json::to_string_pretty(&result) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: cannot serialise the plan: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("\nwritten to {}", path.display());
    }
    if result.fitting.is_empty() {
        eprintln!("no layout fits: see the reasons above");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
