//! The command lines of the `gpt` binary ([`GptArgs`]) and of `plan` ([`PlanArgs`], the
//! library's), and the settings they make: in the library so that a test can throw command
//! lines at the same parsing and validation the binaries run (`tests/tests/fuzz.rs`).

use std::path::PathBuf;

use burn_moe::{ExpertKind, MoeConfig};
use burn_parallel_train::Layout;
use burn_parallel_train::cli::{LayoutArgs, MoeArgs};
use clap::{Parser, ValueEnum};

use crate::gpt::{MlpKind, PositionKind};
use crate::train::{LossScale, Precision, TrainConfig, TrainDevice};

/// How the ranks of a run talk.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum Backend {
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

/// Train a byte-level GPT on the King James Bible with data parallelism.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct GptArgs {
    /// Folder of the data files (`kjv.txt.gz`), for a binary run away from its source tree;
    /// default: $BURN_PARALLEL_DATA_DIR, else the bundled examples/data.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<std::path::PathBuf>,
    /// A TOML file with a `TrainConfig` (flags given here override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// How ranks talk.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: Backend,
    /// Thread ranks (local backend only).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Optimizer steps.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Global batch, in sequences per optimizer step.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Tokens per sequence.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step (gradient accumulation; a pipeline's micro-batches,
    /// 4 by default with --pp).
    #[arg(long, visible_alias = "microbatches")]
    pub grad_accum: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Transformer layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Model width.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// MLP kind.
    #[arg(long, value_enum)]
    pub mlp: Option<MlpKind>,
    /// Position encoding.
    #[arg(long, value_enum)]
    pub positions: Option<PositionKind>,
    /// Tie the LM head to the token embedding.
    #[arg(long)]
    pub tied: bool,
    /// Seed of the weights.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Gradient bucket size in MB.
    #[arg(long)]
    pub bucket_mb: Option<f64>,
    /// Print a line every N steps (the progress bar shows every step).
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// Peak TFLOP/s of one device, for the MFU on the log lines (default: looked up from the
    /// CUDA device's name; none on other devices, where only the model TFLOP/s are shown).
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
    /// The layout: --tp, --sp, --cp, --cp-kind, --cp-balance, --pp, --ep, --zero, --hybrid,
    /// --prefetch, --no-sync, --overlap, --offload.
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Clip the global norm of the averaged gradient to this value.
    #[arg(long)]
    pub clip: Option<f64>,
    /// Write the per-step losses as JSON to this file (rank 0).
    #[arg(long)]
    pub losses_out: Option<PathBuf>,
    /// Write the trained parameters (whole, fp32, by path) as JSON to this file (rank 0).
    #[arg(long)]
    pub params_out: Option<PathBuf>,
    /// Run norms, attention, GELU/SwiGLU, RoPE and the cross-entropy through the fused kernels
    /// (the default; kept for old command lines).
    #[arg(long, conflicts_with = "unfused")]
    pub fused: bool,
    /// Run the model as composed Burn operations instead of the fused kernels (the reference
    /// the fused paths are checked against).
    #[arg(long)]
    pub unfused: bool,
    /// Arithmetic of the forward and backward: f32, or bf16 / fp16 (loss-scaled) with fp32
    /// master weights and optimizer state (data, tensor, ZeRO and FSDP parallelism).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// With --precision bf16: average the gradients in fp32 (twice the bytes, no bf16
    /// rounding of the sums; fp16 always does).
    #[arg(long, requires = "precision")]
    pub reduce_fp32: bool,
    /// Dynamic loss scaling from this scale (with `--precision fp16` the default is 65536):
    /// an overflowing step is skipped and halves it.
    #[arg(long)]
    pub loss_scale: Option<f64>,
    /// Clean steps in a row that double the loss scale (default 2000).
    #[arg(long, requires = "loss_scale")]
    pub loss_scale_window: Option<usize>,
    /// Let fp32 matrix products run in TF32 where the device has it (CUDA: cuBLASLt's TF32
    /// mode), as PyTorch's `allow_tf32`; bf16/fp16 products are unaffected.
    #[arg(long)]
    pub tf32: bool,
    /// Intra-op threads of each rank's CPU kernels (default: the cores divided by the ranks on
    /// this machine; also BURN_PARALLEL_THREADS).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print where the step time went on rank 0 at the end (forward, backward, gradient
    /// communication, optimizer; the first step excluded).
    #[arg(long)]
    pub profile: bool,
    /// Device of the trainer, under every layout (`wgpu` needs a build with `--features wgpu`,
    /// `cuda` one with `--features cuda`: device LOCAL_RANK of each process).
    #[arg(long, value_enum)]
    pub device: Option<TrainDevice>,
    /// Pipeline parallelism: --pp N --schedule gpipe|1f1b|interleaved|zb-h1|zbv|dualpipev
    /// --microbatches M [--virtual-stages V] [--balance-params | --balance-time] [--trace F].
    #[command(flatten)]
    pub pipeline: crate::pipeline::PipelineArgs,
    /// DiLoCo: --diloco-islands N --inner-steps H --outer-lr X --outer-momentum M
    /// [--diloco-compression f32|fp16|bf16|int8] [--diloco-fragments F] [--diloco-overlap T]
    /// [--diloco-drop-lost].
    #[command(flatten)]
    pub diloco: burn_parallel_train::diloco::DiLoCoFlags,
    /// Distributed checkpoints: --save D [--save-every N] [--keep K] [--async-checkpoint], and
    /// --resume D, under any layout (GPT-MoE, dropout and DiLoCo included).
    #[command(flatten)]
    pub checkpoint: burn_parallel_train::cli::CheckpointArgs,
    /// Metrics: --metrics FILE (rank 0's per-step figures, JSON lines), --plot FILE (SVG chart).
    #[command(flatten)]
    pub metrics: burn_parallel_train::cli::MetricsArgs,
    /// Start from the weights of a Hugging Face GPT-2 or LLaMA checkpoint directory
    /// (`config.json` + safetensors), under any layout; the model is the one its config.json
    /// describes (the model-shape flags are ignored).
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub init_from_hf: Option<PathBuf>,
    /// Hidden width of the dense MLP (default 4 x d_model).
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// GPT-MoE: --moe-experts N --top-k K --expert-d-ff F --capacity-factor C | --dropless
    /// --aux-loss A --z-loss Z --bias-balancing [--bias-rate R].
    #[command(flatten)]
    pub moe: MoeArgs,
    /// GPT-MoE: blocks N-1, 2N-1, ... are MoE blocks (1: every block).
    #[arg(long)]
    pub moe_every: Option<usize>,
}

/// `--precision`: the library's flag value.
pub use burn_parallel_train::cli::Precision as PrecisionArg;

/// Prints `e` as the error that ends a binary (on stderr).
pub fn print_error(e: impl std::fmt::Display) {
    eprintln!("error: {e}");
}

/// The trainer's device of `--device` (Flex without it).
pub fn train_device(args: &GptArgs) -> TrainDevice {
    args.device.unwrap_or_default()
}

/// The trainer's settings: the `--config` file's (or the defaults), then each flag given.
///
/// # Errors
/// An unreadable or invalid `--config` file, MoE flags without experts; as one line.
pub fn config_from(args: &GptArgs) -> Result<TrainConfig, String> {
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
    set!(c.model.mlp, args.mlp);
    set!(c.model.positions, args.positions);
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
    if let Some(dir) = &args.init_from_hf {
        let hf = crate::hf::HfConfig::from_dir(dir)
            .map_err(|e| format!("--init-from-hf {}: {e}", dir.display()))?;
        c.model = crate::hf::with_run_settings(&hf.model, &c.model);
    }
    if args.layout.pp > 1 && args.grad_accum.is_none() {
        c.grad_accum = 4;
    }
    c.save = args.checkpoint.policy();
    c.resume = args.checkpoint.resume.clone();
    c.init_from_hf = args.init_from_hf.clone();
    Ok(c)
}

/// The GPT-MoE flags: `--moe-experts` makes (or replaces) `model.moe` (experts shaped like the
/// dense MLP), the others change it ([`MoeArgs::apply`]); `--moe-every` says which blocks.
fn moe_from(args: &GptArgs, c: &mut TrainConfig) -> Result<(), String> {
    let m = &c.model;
    let dense = MoeConfig {
        bias: m.bias,
        expert: match m.mlp {
            MlpKind::Gelu => ExpertKind::Gelu,
            MlpKind::SwiGlu => ExpertKind::SwiGlu,
        },
        ..MoeConfig::new(m.d_model, m.d_ff, 1, 1)
    };
    let mut moe = args.moe.apply(c.model.moe.take(), &dense)?;
    if let (Some(moe), Some(_)) = (&mut moe, args.d_model) {
        moe.d_model = c.model.d_model;
    }
    match (&moe, args.moe_every) {
        (None, Some(_)) => return Err("--moe-every needs --moe-experts".into()),
        (_, Some(every)) => c.model.moe_every = every,
        _ => {}
    }
    c.model.moe = moe;
    Ok(())
}

impl GptArgs {
    /// The layout of the flags (`--pp` with the pipeline's own flags).
    ///
    /// # Errors
    /// A stage `--zero` does not know (clap refuses it first), as one line.
    pub fn layout(&self) -> Result<Layout, String> {
        self.layout.layout().map_err(|e| e.to_string())
    }

    /// What the binary checks before it loads data or builds a model, on `ranks` thread ranks:
    /// the settings ([`config_from`]), then the layout (DiLoCo's flags included) against them
    /// and the memory a rank needs ([`crate::run::check_run`]).
    ///
    /// # Errors
    /// The first refusal, as one line naming its flag.
    pub fn checked(&self, ranks: usize) -> Result<(TrainConfig, Layout), String> {
        let mut config = config_from(self)?;
        config.device = train_device(self);
        let mut layout = self.layout()?;
        layout.diloco = self.diloco.layout();
        crate::run::check_run(&config, &layout, &self.pipeline.split(), ranks, ranks)
            .map_err(|e| e.to_string())?;
        Ok((config, layout))
    }
}

/// The `plan` binary's flags: the library's planner command line.
pub use burn_parallel_train::cli::PlanArgs;
