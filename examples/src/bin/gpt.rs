//! Trains the reference GPT on the bundled King James Bible, byte-level, under any layout:
//! data parallelism, ZeRO-1/2/3 (FSDP), hybrid sharding, tensor + sequence parallelism, and
//! their combinations, on Flex or (with `--features wgpu`) WGPU.
//!
//! ```text
//! cargo run --release -p examples --bin gpt                          # 2 thread ranks
//! cargo run --release -p examples --bin gpt -- --ranks 1 --steps 50  # single device
//! burnrun --nproc-per-node 2 -- target/release/gpt --backend tcp     # 2 processes
//! burnrun --nproc-per-node 2 -- target/release/gpt --device cuda --backend nccl  # 2 GPUs
//! gpt --config run.toml --steps 100                                  # TOML, then flags
//! gpt --ranks 4 --tp 2 --sp                                          # dp 2 x tp 2, seq. parallel
//! gpt --ranks 4 --zero 3 --tp 2 --sp --clip 1.0                      # FSDP 2 x tp 2, clipped
//! burnrun --nproc-per-node 2 -- target/release/gpt --backend tcp --tp 2
//! gpt --ranks 4 --cp 2 --cp-kind ring --cp-balance headtail       # dp 2 x cp 2, ring attention
//! gpt --ranks 4 --moe-experts 8 --top-k 2 --ep 2 --dropless        # GPT-MoE, dp 4 with ep 2
//! gpt --moe-experts 8 --moe-every 2 --capacity-factor 1.25 --aux-loss 0.01 --z-loss 0.001
//! gpt --ranks 4 --tp 2 --save-every 100 --checkpoint-dir ckpt   # distributed checkpoints
//! gpt --ranks 4 --zero 3 --resume ckpt                           # resume under another layout
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use burn_moe::{Capacity, DropPolicy, ExpertKind, MoeConfig};
use burn_parallel::mfu::{Math, Mfu, peak_tflops};
use burn_parallel::{CollectiveError, ProcessGroup, run_local};
use burn_parallel_train::Layout;
use burn_pipeline::generators::generate;
use burn_pipeline::simulate::{Costs, simulate};
use burn_pipeline::trace::Timeline;
use burn_zero::Stage;
use clap::{Parser, ValueEnum};
use examples::data::Corpus;
use examples::gpt::{MlpKind, PositionKind};
use examples::train::{
    LossScale, Parallelism, Precision, StepPhases, StepStats, TrainConfig, TrainDevice,
    TrainReport, train_gpt_checkpointed,
};
use examples::train_checkpoint::CheckpointOptions;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum Backend {
    /// Ranks are threads of this process.
    Local,
    /// This process is one rank; the world comes from RANK, WORLD_SIZE, MASTER_ADDR,
    /// MASTER_PORT (set by `burnrun` or torchrun) or SLURM's variables.
    Tcp,
    /// As `tcp`, with NCCL attached on CUDA device LOCAL_RANK: collectives on CUDA tensors run
    /// through NCCL (build with `--features nccl,cuda`; see `--device cuda`).
    Nccl,
    /// This process is one rank of an MPI job: `mpirun -np N gpt --backend mpi`, or `srun`
    /// (a build with `--features examples/mpi`).
    Mpi,
}

/// The world of a multi-process backend (`tcp`, `nccl` over it, or `mpi`).
fn process_world(backend: Backend) -> Result<ProcessGroup, CollectiveError> {
    match backend {
        Backend::Nccl => burn_parallel::nccl::init_from_env(),
        Backend::Mpi => burn_parallel::world::init_mpi(),
        Backend::Tcp | Backend::Local => burn_parallel::init_from_env(),
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mlp {
    Gelu,
    Swiglu,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Positions {
    Learned,
    Rotary,
}

/// Train a byte-level GPT on the King James Bible with data parallelism.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Folder of the data files (`kjv.txt.gz`), for a binary run away from its source tree;
    /// default: $BURN_PARALLEL_DATA_DIR, else the bundled examples/data.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<std::path::PathBuf>,
    /// A TOML file with a `TrainConfig` (flags given here override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// How ranks talk.
    #[arg(long, value_enum, default_value = "local")]
    backend: Backend,
    /// Thread ranks (local backend only).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Global batch, in sequences per optimizer step.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Tokens per sequence.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Gradient-accumulation micro-steps per optimizer step.
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Transformer layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Model width.
    #[arg(long)]
    d_model: Option<usize>,
    /// MLP kind.
    #[arg(long, value_enum)]
    mlp: Option<Mlp>,
    /// Position encoding.
    #[arg(long, value_enum)]
    positions: Option<Positions>,
    /// Tie the LM head to the token embedding.
    #[arg(long)]
    tied: bool,
    /// Seed of the weights.
    #[arg(long)]
    seed: Option<u64>,
    /// Gradient bucket size in MB.
    #[arg(long)]
    bucket_mb: Option<f64>,
    /// Print a line every N steps (the progress bar shows every step).
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Peak TFLOP/s of one device, for the MFU on the log lines (default: looked up from the
    /// CUDA device's name; none on other devices, where only the model TFLOP/s are shown).
    #[arg(long, value_name = "TFLOPS")]
    peak_tflops: Option<f64>,
    /// Tensor-parallel size: each model is split over this many ranks (Megatron-style); the
    /// ranks form a `dp x tp` mesh with `dp = ranks / tp`.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequence parallelism inside each tensor-parallel group (needs --tp 2 or more).
    #[arg(long)]
    sp: bool,
    /// Context-parallel size: each sequence is split along its length over this many ranks
    /// (mesh `dp x cp x tp`); the sequence length must divide by 2 cp (by cp with
    /// `--cp-balance none`).
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// How attention crosses the context-parallel ranks: `ring` (K/V blocks rotate) or
    /// `ulysses` (all-to-all to head-sharded; the heads per tensor-parallel rank must divide by
    /// cp).
    #[arg(long, default_value = "ring")]
    cp_kind: burn_parallel::context_parallel::CpKind,
    /// How each sequence is split over the context-parallel ranks: `headtail` (zigzag: chunks
    /// r and 2cp-1-r, the same causal work on every rank) or `none` (contiguous).
    #[arg(long, default_value = "headtail")]
    cp_balance: burn_parallel::context_parallel::CpBalance,
    /// ZeRO stage (1: optimizer state sharded, 2: + gradients, 3: + parameters: FSDP, each
    /// block, the embeddings, the final norm and the head a unit) over the data-parallel ranks,
    /// instead of plain DDP. Composes with --tp (the 2-D layout), --hybrid and --clip.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    zero: Option<u8>,
    /// Hybrid sharding with --zero: shard inside groups of ranks/N, replicate across N groups.
    #[arg(long, requires = "zero")]
    hybrid: Option<usize>,
    /// With --zero 3: all-gather the next block while one computes (one more gathered block
    /// of memory).
    #[arg(long, requires = "zero")]
    prefetch: bool,
    /// With --zero 3 and --grad-accum: hold each block's whole gradient over the micro-steps
    /// and reduce-scatter it once per step (one block-sized buffer per block).
    #[arg(long, requires = "zero")]
    no_sync: bool,
    /// Data parallelism: all-reduce the gradient buckets during the backward, each as its
    /// gradients become final (PyTorch DDP's overlap; `burn_parallel::overlap`), instead of
    /// after it. Not with --zero.
    #[arg(long = "overlap", conflicts_with = "zero")]
    ddp_overlap: bool,
    /// With --zero 1|2: keep the optimizer state and its update in host memory (DeepSpeed's
    /// offload_optimizer), leaving the device the model, its gradients and the compute.
    #[arg(long, requires = "zero")]
    offload: bool,
    /// Clip the global norm of the averaged gradient to this value.
    #[arg(long)]
    clip: Option<f64>,
    /// Write the per-step losses as JSON to this file (rank 0).
    #[arg(long)]
    losses_out: Option<PathBuf>,
    /// Write the trained parameters (whole, fp32, by path) as JSON to this file (rank 0).
    #[arg(long)]
    params_out: Option<PathBuf>,
    /// Run norms, attention, GELU/SwiGLU, RoPE and the cross-entropy through the fused kernels
    /// (the default; kept for old command lines).
    #[arg(long, conflicts_with = "unfused")]
    fused: bool,
    /// Run the model as composed Burn operations instead of the fused kernels (the reference
    /// the fused paths are checked against).
    #[arg(long)]
    unfused: bool,
    /// Arithmetic of the forward and backward: f32, or bf16 / fp16 (loss-scaled) with fp32
    /// master weights and optimizer state (data, tensor, ZeRO and FSDP parallelism).
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// With --precision bf16: average the gradients in fp32 (twice the bytes, no bf16
    /// rounding of the sums; fp16 always does).
    #[arg(long, requires = "precision")]
    reduce_fp32: bool,
    /// Dynamic loss scaling from this scale (with `--precision fp16` the default is 65536):
    /// an overflowing step is skipped and halves it.
    #[arg(long)]
    loss_scale: Option<f64>,
    /// Clean steps in a row that double the loss scale (default 2000).
    #[arg(long, requires = "loss_scale")]
    loss_scale_window: Option<usize>,
    /// Let fp32 matrix products run in TF32 where the device has it (CUDA: cuBLASLt's TF32
    /// mode), as PyTorch's `allow_tf32`; bf16/fp16 products are unaffected.
    #[arg(long)]
    tf32: bool,
    /// Intra-op threads of each rank's CPU kernels (default: the cores divided by the ranks on
    /// this machine; also BURN_PARALLEL_THREADS).
    #[arg(long)]
    threads: Option<usize>,
    /// Print where the step time went on rank 0 at the end (forward, backward, gradient
    /// communication, optimizer; the first step excluded).
    #[arg(long)]
    profile: bool,
    /// Device of the trainer, under every layout (`wgpu` needs a build with `--features wgpu`,
    /// `cuda` one with `--features cuda`: device LOCAL_RANK of each process).
    #[arg(long, value_enum)]
    device: Option<DeviceArg>,
    /// Pipeline parallelism: --pp N --schedule gpipe|1f1b|interleaved|zb-h1|zbv|dualpipev
    /// --microbatches M [--virtual-stages V] [--balance-params].
    #[command(flatten)]
    pipeline: examples::pipeline::PipelineArgs,
    /// DiLoCo: --diloco-islands N --inner-steps H --outer-lr X --outer-momentum M
    /// [--diloco-compression f32|fp16|bf16|int8] [--diloco-fragments F] [--diloco-overlap T]
    /// [--diloco-drop-lost].
    #[command(flatten)]
    diloco: examples::train_diloco::DiLoCoArgs,
    /// Distributed checkpoints: --save-every N --checkpoint-dir D [--keep-checkpoints K]
    /// [--async-checkpoint], and --resume D (under any dp/tp/ZeRO/ep/pp layout; GPT-MoE and
    /// dropout included; not yet with --diloco-islands, nor --pp with --zero).
    #[command(flatten)]
    checkpoint: examples::train_checkpoint::CheckpointArgs,
    /// Hidden width of the dense MLP (default 4 x d_model).
    #[arg(long)]
    d_ff: Option<usize>,
    /// GPT-MoE: the MLP of every --moe-every-th block becomes a mixture of this many experts.
    #[arg(long)]
    moe_experts: Option<usize>,
    /// GPT-MoE: experts per token.
    #[arg(long)]
    top_k: Option<usize>,
    /// GPT-MoE: blocks N-1, 2N-1, ... are MoE blocks (1: every block).
    #[arg(long)]
    moe_every: Option<usize>,
    /// GPT-MoE: hidden width of each expert (default: the dense MLP's d_ff).
    #[arg(long)]
    expert_d_ff: Option<usize>,
    /// GPT-MoE: expert-parallel size, carved out of the data-parallel ranks (must divide the
    /// experts and the data-parallel ranks).
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// GPT-MoE: capacity mode, each expert takes at most ceil(tokens x top_k / experts x C)
    /// tokens of each rank's batch; the others are dropped (pass on the residual).
    #[arg(long, conflicts_with = "dropless")]
    capacity_factor: Option<f64>,
    /// GPT-MoE: dropless mode (the default): no token is dropped.
    #[arg(long)]
    dropless: bool,
    /// GPT-MoE: coefficient of the Switch load-balancing loss.
    #[arg(long)]
    aux_loss: Option<f64>,
    /// GPT-MoE: coefficient of the router z-loss.
    #[arg(long)]
    z_loss: Option<f64>,
    /// GPT-MoE: auxiliary-loss-free balancing (DeepSeek-V3): expert biases move by
    /// --bias-rate after each step.
    #[arg(long)]
    bias_balancing: bool,
    /// Step of the expert biases of --bias-balancing.
    #[arg(long, default_value_t = 1e-3)]
    bias_rate: f64,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F32,
    Bf16,
    Fp16,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DeviceArg {
    Flex,
    #[cfg(feature = "wgpu")]
    Wgpu,
    #[cfg(feature = "cuda")]
    Cuda,
}

fn train_device(args: &Args) -> TrainDevice {
    match args.device {
        None | Some(DeviceArg::Flex) => TrainDevice::Flex,
        #[cfg(feature = "wgpu")]
        Some(DeviceArg::Wgpu) => TrainDevice::Wgpu,
        #[cfg(feature = "cuda")]
        Some(DeviceArg::Cuda) => TrainDevice::Cuda,
    }
}

fn config_from(args: &Args) -> Result<TrainConfig, String> {
    let mut c = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            TrainConfig::from_toml(&text).map_err(|e| format!("parsing {}: {e}", path.display()))?
        }
        None => TrainConfig::default(),
    };
    macro_rules! set {
        ($field:expr, $value:expr) => {
            if let Some(v) = $value {
                $field = v;
            }
        };
    }
    set!(c.steps, args.steps);
    set!(c.batch_size, args.batch_size);
    set!(c.seq_len, args.seq_len);
    set!(c.grad_accum, args.grad_accum);
    set!(c.lr, args.lr);
    set!(c.model.n_layers, args.layers);
    set!(c.model.n_heads, args.heads);
    set!(c.bucket_mb, args.bucket_mb);
    set!(c.model.seed, args.seed);
    set!(c.max_grad_norm, args.clip.map(Some));
    set!(
        c.precision,
        args.precision.map(|p| match p {
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Fp16 => Precision::Fp16,
        })
    );
    c.reduce_fp32 |= args.reduce_fp32;
    if let Some(initial) = args.loss_scale {
        let default = LossScale::default();
        c.loss_scale = Some(LossScale {
            initial,
            window: args.loss_scale_window.unwrap_or(default.window),
            ..default
        });
    }
    if let Some(d) = args.d_model {
        c.model.d_model = d;
        c.model.d_ff = 4 * d;
    }
    set!(c.model.d_ff, args.d_ff);
    if let Some(m) = args.mlp {
        c.model.mlp = match m {
            Mlp::Gelu => MlpKind::Gelu,
            Mlp::Swiglu => MlpKind::SwiGlu,
        };
    }
    if let Some(p) = args.positions {
        c.model.positions = match p {
            Positions::Learned => PositionKind::Learned,
            Positions::Rotary => PositionKind::Rotary,
        };
    }
    if args.tied {
        c.model.tied_embeddings = true;
    }
    if args.fused {
        c.model.fused = true;
    }
    if args.unfused {
        c.model.fused = false;
    }
    moe_from(args, &mut c)?;
    c.model.max_seq_len = c.model.max_seq_len.max(c.seq_len);
    Ok(c)
}

/// The GPT-MoE flags: `--moe-experts` makes (or replaces) `model.moe`, the others change it.
fn moe_from(args: &Args, c: &mut TrainConfig) -> Result<(), String> {
    if let Some(experts) = args.moe_experts {
        let mut moe = MoeConfig::new(
            c.model.d_model,
            args.expert_d_ff.unwrap_or(c.model.d_ff),
            experts,
            args.top_k.unwrap_or(2),
        );
        moe.bias = c.model.bias;
        moe.expert = match c.model.mlp {
            MlpKind::Gelu => ExpertKind::Gelu,
            MlpKind::SwiGlu => ExpertKind::SwiGlu,
        };
        c.model.moe = Some(moe);
    }
    let Some(moe) = &mut c.model.moe else {
        let given = args.top_k.is_some()
            || args.moe_every.is_some()
            || args.expert_d_ff.is_some()
            || args.capacity_factor.is_some()
            || args.dropless
            || args.aux_loss.is_some()
            || args.z_loss.is_some()
            || args.bias_balancing;
        return match given {
            true => Err(
                "the MoE flags (--top-k, --capacity-factor, ...) need --moe-experts \
                         (or a model.moe section in --config)"
                    .into(),
            ),
            false => Ok(()),
        };
    };
    if args.d_model.is_some() {
        moe.d_model = c.model.d_model;
    }
    if let Some(k) = args.top_k {
        moe.top_k = k;
    }
    if let Some(f) = args.expert_d_ff {
        moe.d_ff = f;
    }
    if let Some(every) = args.moe_every {
        c.model.moe_every = every;
    }
    if let Some(factor) = args.capacity_factor {
        moe.capacity = Capacity::Factor {
            factor,
            drop: DropPolicy::Position,
        };
    }
    if args.dropless {
        moe.capacity = Capacity::Dropless;
    }
    if let Some(a) = args.aux_loss {
        moe.aux_loss = a;
    }
    if let Some(z) = args.z_loss {
        moe.z_loss = z;
    }
    if args.bias_balancing {
        moe.bias_update_rate = args.bias_rate;
    }
    Ok(())
}

/// One line per MoE layer: tokens per expert, drop rate, imbalance, auxiliary losses.
fn moe_lines(s: &StepStats) -> Vec<String> {
    s.moe
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let counts: Vec<String> = m
                .tokens_per_expert()
                .iter()
                .map(|c| format!("{c:.0}"))
                .collect();
            format!(
                "        moe {i}: tokens/expert [{}]  drop {:.2}%  imbalance {:.2}  aux {:.4}  \
                 z {:.3}",
                counts.join(" "),
                100.0 * m.drop_rate(),
                m.imbalance(),
                m.aux_loss,
                m.z_loss
            )
        })
        .collect()
}

/// Runs one rank; only group rank 0 prints.
fn run_rank(
    group: &ProcessGroup,
    config: &TrainConfig,
    parallel: &Parallelism,
    corpus: &Corpus,
    log: &Logging,
    checkpoints: &CheckpointOptions,
) -> burn_parallel::Result<TrainReport> {
    let (log_every, profile) = (log.every, log.profile);
    let mfu = log.mfu(config, group.size());
    let lead = group.rank() == 0;
    if lead {
        println!(
            "kernels: {}, {} intra-op threads per rank",
            if config.model.fused {
                "fused"
            } else {
                "composed (--unfused)"
            },
            burn_parallel::threads::describe()
        );
        println!("{}", log.describe(config));
    }
    let mut phases = StepPhases::default();
    let bar = if lead {
        let bar = ProgressBar::new(config.steps as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("a valid template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut on_step = |s: &StepStats| {
        if s.step > 0 {
            phases.add(&s.phases);
        }
        bar.set_message(format!("loss {:.4}  {:.0} tok/s", s.loss, s.tokens_per_sec));
        bar.inc(1);
        if lead && (s.step.is_multiple_of(log_every.max(1)) || s.step + 1 == config.steps) {
            let line = format!(
                "step {:>5}  loss {:.4}  lr {:.2e}  {:>7.0} tok/s  {}  {:>7.1}s",
                s.step,
                s.loss,
                s.lr,
                s.tokens_per_sec,
                mfu.describe(s.tokens_per_sec),
                s.elapsed
            );
            // A bar drawn nowhere (output not a terminal) would swallow the line.
            for line in std::iter::once(line).chain(moe_lines(s)) {
                if bar.is_hidden() {
                    println!("{line}");
                } else {
                    bar.println(line);
                }
            }
        }
    };
    let host_bytes = burn_parallel::group::host_bytes_sent();
    let report = train_gpt_checkpointed(group, config, parallel, corpus, checkpoints, &mut on_step);
    bar.finish_and_clear();
    if let (true, Ok(report)) = (profile && lead, &report) {
        print_profile(&phases, report.step_seconds, config.steps.saturating_sub(1));
        // Thread ranks share the process's counter: per rank, the mean.
        let local_ranks = if group.backend() == "local" {
            group.size()
        } else {
            1
        };
        let sent = burn_parallel::group::host_bytes_sent() - host_bytes;
        println!(
            "  host transport           {:>8.3} MB/step per rank handed to host collectives \
             (training and evaluation)",
            sent as f64 / 1e6 / config.steps.max(1) as f64 / local_ranks as f64
        );
    }
    // ZeRO and FSDP: every rank prints its memory (shards, gradients, optimizer state, gathered
    // units), in rank order.
    if let Ok(TrainReport {
        memory: Some(memory),
        ..
    }) = &report
    {
        for r in 0..group.size() {
            if r == group.rank() {
                println!("[rank {r}] zero memory: {}", memory.summary());
            }
            group.barrier()?;
        }
    }
    report
}

/// The `--profile` table: mean milliseconds per step of each phase on rank 0.
fn print_profile(phases: &StepPhases, step_seconds: f64, steps: usize) {
    let steps = steps.max(1) as f64;
    let step_ms = step_seconds * 1e3;
    let rows = [
        ("forward", phases.forward),
        ("backward", phases.backward),
        ("gradient communication", phases.reduce),
        ("optimizer", phases.optimizer),
    ];
    println!("profile (rank 0, mean of {steps} steps, the first excluded): {step_ms:.1} ms/step");
    for (name, seconds) in rows {
        let ms = seconds / steps * 1e3;
        println!(
            "  {name:<24} {ms:>8.1} ms  {:>5.1}%",
            100.0 * ms / step_ms.max(1e-9)
        );
    }
    let other = step_ms - phases.total() / steps * 1e3;
    println!(
        "  {:<24} {other:>8.1} ms  {:>5.1}%",
        "other (data, loss sync)",
        100.0 * other / step_ms.max(1e-9)
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.threads {
        Some(0) => {
            eprintln!("error: --threads must be at least 1");
            return ExitCode::from(2);
        }
        Some(n) => burn_parallel::threads::set_intra_op_threads(Some(n)),
        None => {}
    }
    burn_parallel::kernels::allow_tf32(args.tf32);
    let mut config = match config_from(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(dir) = &args.checkpoint.init_from_hf {
        match examples::hf::HfConfig::from_dir(dir) {
            Ok(hf) => {
                config.model = examples::hf::with_run_settings(&hf.model, &config.model);
                println!(
                    "model from {}: {:?}, {} layers, d_model {}, {} heads, vocabulary {}",
                    dir.join("config.json").display(),
                    hf.arch,
                    config.model.n_layers,
                    config.model.d_model,
                    config.model.n_heads,
                    config.model.vocab_size
                );
            }
            Err(e) => {
                eprintln!("error: --init-from-hf {}: {e}", dir.display());
                return ExitCode::from(2);
            }
        }
        if config.seq_len > config.model.max_seq_len {
            eprintln!(
                "error: --seq-len {} is longer than the imported model's {} positions",
                config.seq_len, config.model.max_seq_len
            );
            return ExitCode::from(2);
        }
        // The bundled corpus is byte-level: its tokens are the ids 0..256 of any vocabulary
        // at least that large (for a BPE model they are not its own tokenisation of the text).
        if config.model.vocab_size < 256 {
            eprintln!(
                "error: the imported model's vocabulary has {} tokens; the bundled corpus's \
                 byte tokens need at least 256",
                config.model.vocab_size
            );
            return ExitCode::from(2);
        }
    }
    let corpus = Corpus::load_from(args.data_dir.as_deref()).and_then(|corpus| {
        corpus.check_windows(config.seq_len, config.eval_batches)?;
        Ok(corpus)
    });
    let corpus = match corpus {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let checkpoints = args.checkpoint.options();
    let diloco = args.diloco.run(train_device(&args));
    if let Some(run) = diloco {
        return run_diloco(&args, &config, &corpus, &run, &checkpoints);
    }
    let zero = match args
        .zero
        .map(|s| Stage::from_number(s as usize))
        .transpose()
    {
        Ok(zero) => zero,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    config.device = train_device(&args);
    let parallel = Layout {
        tp: args.tp,
        sp: args.sp,
        cp: args.cp,
        cp_kind: args.cp_kind,
        cp_balance: args.cp_balance,
        pp: args.pipeline.pp,
        ep: args.ep,
        zero,
        replicate: args.hybrid.unwrap_or(1),
        prefetch: args.prefetch,
        no_sync: args.no_sync,
        overlap: args.ddp_overlap,
        offload: args.offload,
    };
    if args.pipeline.pp > 1 {
        // The layout's rules (Layout::validate) are checked on the world the ranks form.
        return run_pipeline(&args, &config, &corpus, &checkpoints, &parallel);
    }
    let log = Logging::new(&args);
    let outcome = match args.backend {
        Backend::Local => {
            let checked = config
                .validate_layout(&parallel, args.ranks)
                .and_then(|()| config.check_memory(&parallel, args.ranks, args.ranks));
            if let Err(e) = checked {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
            print_header(&config, args.ranks, "local", &corpus, &parallel);
            run_local(args.ranks, |group| {
                run_rank(&group, &config, &parallel, &corpus, &log, &checkpoints)
            })
            .map(|mut reports| Some(reports.swap_remove(0)))
        }
        Backend::Tcp | Backend::Nccl | Backend::Mpi => on_world(args.backend, |group| {
            // Before the banner (which counts the parameters) and any allocation.
            config
                .check_memory(&parallel, group.size(), 1)
                .map_err(|reason| CollectiveError::InvalidArgument {
                    rank: group.global_rank(),
                    op: "gpt".into(),
                    reason,
                })?;
            if group.rank() == 0 {
                print_header(&config, group.size(), group.backend(), &corpus, &parallel);
            }
            let report = run_rank(&group, &config, &parallel, &corpus, &log, &checkpoints)?;
            // Rank 0 reports for everyone.
            Ok((group.rank() == 0).then_some(report))
        }),
    };
    match outcome {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(report)) => {
            print_report(&report, &corpus);
            write_outputs(&args, &report.losses, &report.final_params)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `run` on this process's rank of a process-per-rank backend (`tcp`, `nccl`, `mpi`). On MPI a
/// failed rank aborts the job (`MPI_Abort`), since MPI cannot tell the others to stop waiting.
fn on_world<T>(
    backend: Backend,
    run: impl FnOnce(ProcessGroup) -> Result<T, CollectiveError>,
) -> Result<T, CollectiveError> {
    let world = process_world(backend)?;
    let keep = (backend == Backend::Mpi).then(|| world.clone());
    let outcome = run(world);
    if let (Some(world), Err(e)) = (keep, &outcome) {
        world.abort(&format!("error: {e}"));
    }
    outcome
}

/// What the log lines show: every how many steps, the profile, and MFU's peak.
struct Logging {
    every: usize,
    profile: bool,
    /// Peak FLOP/s of one device, and where it came from (or why there is none).
    peak: (Option<f64>, String),
}

impl Logging {
    fn new(args: &Args) -> Self {
        Self {
            every: args.log_every,
            profile: args.profile,
            peak: device_peak(args),
        }
    }

    /// MFU of `config` over `devices` ranks.
    fn mfu(&self, config: &TrainConfig, devices: usize) -> Mfu {
        let shape = config.model.planner_shape();
        Mfu {
            flops_per_token: shape.train_flops_per_token(config.seq_len),
            peak_per_device: self.peak.0,
            devices,
        }
    }

    /// The line describing the MFU figures.
    fn describe(&self, config: &TrainConfig) -> String {
        let per_token = self.mfu(config, 1).flops_per_token;
        let peak = match self.peak.0 {
            Some(p) => format!("{:.1} TFLOP/s per device ({})", p / 1e12, self.peak.1),
            None => format!("no peak, no MFU ({})", self.peak.1),
        };
        format!(
            "model FLOPs: {:.2} MFLOP/token (6 x matmul weights + 12 x layers x seq x width); \
             {peak}",
            per_token / 1e6
        )
    }
}

/// The peak FLOP/s of one device: `--peak-tflops`, or the data sheet of the CUDA device the
/// driver names, for the arithmetic of `--precision`.
fn device_peak(args: &Args) -> (Option<f64>, String) {
    let math = match args.precision {
        None | Some(PrecisionArg::F32) if args.tf32 => Math::Tf32,
        None | Some(PrecisionArg::F32) => Math::F32,
        Some(PrecisionArg::Bf16 | PrecisionArg::Fp16) => Math::Half,
    };
    if let Some(t) = args.peak_tflops {
        return (Some(t * 1e12), "--peak-tflops".into());
    }
    match train_device(args) {
        device @ (TrainDevice::Cuda | TrainDevice::CudaDevice(_)) => {
            let name = match device {
                TrainDevice::CudaDevice(index) => burn_parallel::cuda::device_name(index),
                _ => burn_parallel::cuda::local_device_index()
                    .and_then(|(index, _)| burn_parallel::cuda::device_name(index)),
            };
            match name {
                Ok(name) => match peak_tflops(&name, math) {
                    Some(t) => (Some(t * 1e12), format!("{name}, {math} data sheet")),
                    None => (
                        None,
                        format!("{name} is not in the table: give --peak-tflops"),
                    ),
                },
                Err(e) => (None, e.to_string()),
            }
        }
        _ => (
            None,
            "give the device's peak with --peak-tflops to see MFU".into(),
        ),
    }
}

fn print_header(
    config: &TrainConfig,
    ranks: usize,
    backend: &str,
    corpus: &Corpus,
    parallel: &Parallelism,
) {
    let m = &config.model;
    let layout = if parallel.tp > 1 || parallel.cp > 1 {
        let dp = ranks / (parallel.tp * parallel.cp);
        let data = match parallel.zero {
            None => format!("dp {dp}"),
            Some(stage) => format!(
                "ZeRO-{} over {dp} (hybrid {})",
                stage.number(),
                parallel.replicate
            ),
        };
        let cp = if parallel.cp > 1 {
            format!(
                " x cp {} ({}, {} balance)",
                parallel.cp, parallel.cp_kind, parallel.cp_balance
            )
        } else {
            String::new()
        };
        format!(
            " = {data}{cp} x tp {}{}",
            parallel.tp,
            if parallel.sp {
                " + sequence parallel"
            } else {
                ""
            }
        )
    } else {
        String::new()
    };
    println!(
        "GPT {} layers x {} heads x width {} ({:.2}M params), {} ranks{layout} ({backend}), \
         global batch {} x {} tokens, {} steps",
        m.n_layers,
        m.n_heads,
        m.d_model,
        m.num_params() as f64 / 1e6,
        ranks,
        config.batch_size,
        config.seq_len,
        config.steps
    );
    if let Some(moe) = &m.moe {
        let capacity = match moe.capacity {
            Capacity::Dropless => "dropless".to_string(),
            Capacity::Factor { factor, drop } => format!("capacity factor {factor} ({drop:?})"),
        };
        println!(
            "MoE: {} of {} blocks, {} experts of width {}, top-{}, ep {}, {capacity}, aux loss \
             {}, z-loss {}, bias balancing {}; {:.2}M active params per token",
            m.n_moe_blocks(),
            m.n_layers,
            moe.n_experts,
            moe.d_ff,
            moe.top_k,
            parallel.ep,
            moe.aux_loss,
            moe.z_loss,
            moe.bias_update_rate,
            m.active_params() as f64 / 1e6
        );
    }
    println!(
        "corpus: {}, {} training bytes, unigram entropy {:.3} nats/byte",
        corpus.name(),
        corpus.split(examples::data::Split::Train).len(),
        corpus.unigram_entropy_nats()
    );
}

fn print_report(report: &TrainReport, corpus: &Corpus) {
    let speed = match report.step_seconds {
        0.0 => "no step timed (the first step is warm-up)".to_string(),
        s => format!("{s:.3} s/step, {:.0} tokens/s", report.tokens_per_sec),
    };
    println!(
        "final train loss {:.4}, validation loss {:.4} nats/byte (unigram entropy {:.3}), \
         {speed}",
        report.losses.last().copied().unwrap_or(f64::NAN),
        report.val_loss,
        corpus.unigram_entropy_nats(),
    );
    if report.skipped_steps > 0 || report.loss_scale != 1.0 {
        println!(
            "loss scaling: {} steps skipped (overflow), final loss scale {}",
            report.skipped_steps, report.loss_scale
        );
    }
    println!("sample:\n{}", report.sample);
}

/// `--losses-out` and `--params-out`: the per-step losses as a JSON list, then the trained
/// parameters (path, shape, values) as JSON.
fn write_outputs(args: &Args, losses: &[f64], params: &[examples::train::NamedParam]) -> ExitCode {
    let files: [(_, &dyn Fn() -> String); 2] = [
        (args.losses_out.as_deref(), &|| {
            serde_json::to_string(losses).expect("json")
        }),
        (args.params_out.as_deref(), &|| {
            serde_json::to_string(params).expect("json")
        }),
    ];
    for (path, json) in files {
        if let Some(path) = path
            && let Err(e) = std::fs::write(path, json())
        {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// The last step's measured bubble beside the simulator's prediction from the step's own
/// action times.
fn print_bubble(pipeline: &examples::pipeline::PipelineConfig, timeline: &Timeline) {
    let costs = Costs::from_timeline(timeline);
    let predicted = generate(
        pipeline.schedule,
        pipeline.pp,
        pipeline.microbatches,
        pipeline.virtual_stages,
    )
    .ok()
    .and_then(|schedule| simulate(&schedule, &costs).ok());
    let ms = |t: f64| 1000.0 * t;
    println!(
        "last step: bubble {:.1}% measured over {} ranks, {} predicted from its action times \
         (F {:.1} ms, B {:.1} ms, I {:.1} ms, W {:.1} ms)",
        100.0 * timeline.bubble_fraction(),
        timeline.tracks.len(),
        predicted.map_or("-".into(), |r| format!("{:.1}%", 100.0 * r.bubble_fraction)),
        ms(costs.forward),
        ms(costs.backward),
        ms(costs.backward_input),
        ms(costs.backward_weight),
    );
}

/// `--pp N`: pipeline parallelism (mesh `pp x dp x tp`), see `examples::pipeline`.
fn run_pipeline(
    args: &Args,
    config: &TrainConfig,
    corpus: &Corpus,
    checkpoints: &CheckpointOptions,
    layout: &Layout,
) -> ExitCode {
    let pipeline = args
        .pipeline
        .config(train_device(args), args.tp, args.sp, layout.zero);
    let work = config.step_settings().workload(&config.model);
    let run = |world: ProcessGroup| {
        layout
            .validate(world.size(), &work)
            .map_err(|e| CollectiveError::InvalidArgument {
                rank: world.global_rank(),
                op: "gpt --pp".into(),
                reason: e.to_string(),
            })?;
        examples::pipeline::run_rank(
            &world,
            config,
            &pipeline,
            corpus,
            args.log_every,
            checkpoints,
        )
        .map_err(|e| CollectiveError::InvalidArgument {
            rank: world.global_rank(),
            op: "gpt --pp".into(),
            reason: e.to_string(),
        })
    };
    let outcome = match args.backend {
        Backend::Local => run_local(args.ranks, run).map(|mut r| r.swap_remove(0)),
        Backend::Tcp | Backend::Nccl | Backend::Mpi => on_world(args.backend, run),
    };
    match outcome {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(report)) => {
            print_report(&report.train, corpus);
            println!("blocks per stage: {:?}", report.split);
            print_bubble(&pipeline, &report.timeline);
            if let Some(path) = &args.pipeline.trace {
                if let Err(e) = std::fs::write(path, report.timeline.chrome_trace(1e6)) {
                    eprintln!("error: writing the trace to {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
                println!("trace of the last step written to {}", path.display());
            }
            write_outputs(args, &report.train.losses, &report.train.final_params)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--diloco-islands N`: DiLoCo, see `examples::train_diloco`.
fn run_diloco(
    args: &Args,
    config: &TrainConfig,
    corpus: &Corpus,
    run: &examples::train_diloco::DiLoCoRun,
    checkpoints: &examples::train_checkpoint::CheckpointOptions,
) -> ExitCode {
    use examples::train_diloco::{DiLoCoTrainError, run_rank};
    let parallel = Parallelism {
        tp: args.tp,
        cp: args.cp,
        zero: args.zero.map(|_| Stage::One), // any stage: DiLoCo refuses --zero
        ep: args.ep,
        ..Parallelism::default()
    };
    let pp = DiLoCoTrainError::Unsupported {
        flag: "--pp",
        why: "the outer step reads whole parameters",
    };
    // Over TCP the world size is known once the world is formed: every rank checks then.
    let checked = match (args.pipeline.pp > 1, args.backend) {
        (true, _) => Err(pp),
        (false, Backend::Local) => run.validate(config, &parallel, args.ranks),
        (false, Backend::Tcp | Backend::Nccl | Backend::Mpi) => Ok(()),
    };
    if let Err(e) = checked {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let rank = |world: ProcessGroup| {
        run.validate(config, &parallel, world.size()).map_err(|e| {
            CollectiveError::InvalidArgument {
                rank: world.global_rank(),
                op: "gpt --diloco-islands".into(),
                reason: e.to_string(),
            }
        })?;
        if world.rank() == 0 {
            print_header(config, world.size(), world.backend(), corpus, &parallel);
        }
        run_rank(&world, config, run, corpus, args.log_every, checkpoints)
    };
    let outcome = match args.backend {
        Backend::Local => run_local(args.ranks, rank).map(|mut r| r.swap_remove(0)),
        Backend::Tcp | Backend::Nccl | Backend::Mpi => on_world(args.backend, rank),
    };
    match outcome {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(report)) => {
            print_report(&report.train, corpus);
            write_outputs(args, &report.train.losses, &report.train.final_params)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
