//! [`Layout`]: how the world is split, in one value, and the one place that says which splits
//! compose.

use burn_parallel::ParallelDims;
use burn_parallel::context_parallel::{CpBalance, CpKind, SeqLayout};
use burn_parallel::diloco::DiLoCoConfig;
use burn_pipeline::ScheduleKind;
use burn_zero::Stage;
use serde::{Deserialize, Serialize};

/// How a training run splits the world: the mesh `[pp, dp_replicate, dp_shard, cp, tp]` and the
/// options of the engine that steps it (torchtitan's `ParallelDims` with its parallelism
/// settings). The data-parallel size is what is left: `world / (pp · cp · tp)`.
///
/// Build one in code (`Layout { tp: 2, ..Layout::default() }`), from TOML ([`Layout::from_toml`],
/// the field names below, unknown keys refused) or from flags (the `gpt` and `byo_model`
/// binaries: each field's flag is named in its doc). Check it with [`Layout::validate`] before
/// any rank builds anything; [`crate::build()`] checks it again on every rank.
///
/// # Example
/// ```
/// use burn_parallel_train::{Layout, Workload};
///
/// let layout = Layout::from_toml("tp = 2\nsp = true\nzero = 3").unwrap();
/// let model = Workload { n_heads: 4, batch_size: 8, ..Workload::default() };
/// assert!(layout.validate(8, &model).is_ok());
/// assert_eq!(layout.dims(8).dp_shard, 4);
/// // Sequence parallelism without tensor parallelism names the flag to change.
/// let bad = Layout { sp: true, ..Layout::default() };
/// assert_eq!(bad.validate(8, &model).unwrap_err().flag, "--sp");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Layout {
    /// Tensor-parallel size (`--tp`; 1: none).
    pub tp: usize,
    /// Sequence parallelism inside each tensor-parallel group (`--sp`).
    pub sp: bool,
    /// Context-parallel size (`--cp`; 1: none): the ranks that split each sequence.
    pub cp: usize,
    /// Ring or Ulysses attention under context parallelism (`--cp-kind`).
    pub cp_kind: CpKind,
    /// How each sequence is split over the context-parallel ranks (`--cp-balance`).
    pub cp_balance: CpBalance,
    /// Pipeline-parallel size (`--pp`; 1: none).
    pub pp: usize,
    /// The pipeline's schedule, interleaving and recomputation (with `pp > 1`; `[pipeline]`
    /// in TOML). Its micro-batches are the step's micro-steps
    /// ([`crate::StepSettings::grad_accum`]).
    pub pipeline: PipelineLayout,
    /// Expert-parallel size (`--ep`; 1: every expert on every rank): each group of `ep`
    /// data-parallel ranks splits the experts of every MoE layer.
    pub ep: usize,
    /// `None`: DDP. Stage 1 or 2: ZeRO's sharded optimizer. Stage 3: FSDP (`--zero`).
    pub zero: Option<Stage>,
    /// Hybrid sharding (`--hybrid`, with `zero`): `replicate` groups, each sharding over
    /// `data ranks / replicate`. 1: shard over every data-parallel rank.
    pub replicate: usize,
    /// FSDP: all-gather the next unit while one computes (`--prefetch`).
    pub prefetch: bool,
    /// FSDP with accumulation: reduce-scatter each unit's gradient once per step
    /// (`--no-sync`).
    pub no_sync: bool,
    /// DDP with the gradient all-reduce during the backward (`--overlap`).
    pub overlap: bool,
    /// ZeRO-1/2: the optimizer state and its update in host memory (`--offload`).
    pub offload: bool,
    /// DiLoCo (`--diloco-islands`): islands of data-parallel ranks that step on their own and
    /// average their models every `inner_steps` steps. `None`: every data-parallel rank
    /// reduces its gradients every step.
    pub diloco: Option<DiLoCoLayout>,
    /// The optimizer (`--optim`): AdamW for every parameter, or Muon for the hidden matrices
    /// and AdamW for the rest, served under the layout ([`burn_parallel::muon`]).
    pub optim: Optim,
    /// Fault-tolerant data parallelism (`--fault-tolerant`): the data-parallel replicas (single
    /// ranks, or the FSDP and tensor-parallel ranks of one replica under `--hybrid`) agree on
    /// who is alive at every step, finish the step without a lost one, and take a restarted
    /// one back from a live replica ([`burn_parallel::fault`]).
    pub fault_tolerant: bool,
}

/// Which optimizer a [`Layout`] trains with (`--optim`; `optim = "muon"` in TOML).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Optim {
    /// AdamW for every parameter (the step settings' hyper-parameters).
    #[default]
    Adamw,
    /// Muon for the hidden 2-D matrices, AdamW for embeddings, head, norms and biases
    /// ([`crate::StepSettings::muon`] holds its settings and the rule that picks the matrices).
    Muon,
}

impl std::str::FromStr for Optim {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "adamw" => Ok(Self::Adamw),
            "muon" => Ok(Self::Muon),
            other => Err(format!("unknown optimizer `{other}`: adamw or muon")),
        }
    }
}

impl std::fmt::Display for Optim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Adamw => "adamw",
            Self::Muon => "muon",
        })
    }
}

/// DiLoCo's part of a [`Layout`]: `islands` islands split the world evenly; each trains with
/// DDP inside, and the outer optimizer of `config` averages their models.
///
/// ```
/// use burn_parallel_train::{Layout, Workload};
///
/// let layout = Layout::from_toml("[diloco]\nislands = 4\ninner_sgd = true").unwrap();
/// assert_eq!(layout.diloco.unwrap().islands, 4);
/// assert_eq!(layout.describe(8), "dp 8, DiLoCo 4 islands, H = 50");
/// // DiLoCo averages whole dense models: tensor parallelism is refused, by its flag.
/// let tp = Layout { tp: 2, ..layout };
/// assert_eq!(tp.validate(8, &Workload { batch_size: 8, ..Workload::default() }).unwrap_err().flag, "--tp");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiLoCoLayout {
    /// Islands (at least 1, dividing the world).
    pub islands: usize,
    /// The outer loop (the paper's defaults: `H` = 50, outer Nesterov SGD at 0.7, momentum 0.9).
    pub config: DiLoCoConfig,
    /// The inner optimizer: AdamW (the step settings'), or plain SGD.
    pub inner_sgd: bool,
}

/// The pipeline's part of a [`Layout`] (used with `pp > 1`).
///
/// ```
/// use burn_parallel_train::{Layout, Recompute, Workload};
/// use burn_pipeline::ScheduleKind;
///
/// let layout = Layout::from_toml("pp = 2\n[pipeline]\nschedule = \"zbv\"").unwrap();
/// assert_eq!(layout.pipeline.schedule, ScheduleKind::Zbv);
/// assert_eq!(layout.describe(4), "dp 2 x pp 2 (zbv)");
/// // Recomputing a forward that draws dropout masks would draw other masks.
/// let recompute = Layout { pipeline: layout.pipeline.with_recompute(Recompute::Stages), ..layout };
/// let work = Workload { dropout: true, batch_size: 8, grad_accum: 4, ..Workload::default() };
/// assert_eq!(recompute.validate(4, &work).unwrap_err().flag, "--checkpoint-activations");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineLayout {
    /// The schedule family (`--schedule`: gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev).
    pub schedule: ScheduleKind,
    /// Stages per rank of the interleaved schedule (`--virtual-stages`; default 2).
    pub virtual_stages: Option<usize>,
    /// Activation checkpointing of the stages.
    pub recompute: Recompute,
}

impl PipelineLayout {
    /// These settings recomputing as `recompute` says.
    pub fn with_recompute(self, recompute: Recompute) -> Self {
        Self { recompute, ..self }
    }
}

impl Default for PipelineLayout {
    fn default() -> Self {
        Self {
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: None,
            recompute: Recompute::Off,
        }
    }
}

/// Activation checkpointing of pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Every activation is kept from forward to backward.
    #[default]
    Off,
    /// Each stage keeps only its input and recomputes its whole forward in its backward
    /// (`--checkpoint-activations`; burn-pipeline's `Checkpointing::All`).
    Stages,
    /// Each layer keeps only its input and is recomputed alone in the backward
    /// (`--checkpoint-blocks`; `Sequential::with_checkpointed_layers`).
    Blocks,
}

impl Default for DiLoCoLayout {
    fn default() -> Self {
        Self {
            islands: 2,
            config: DiLoCoConfig::default(),
            inner_sgd: false,
        }
    }
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            tp: 1,
            sp: false,
            cp: 1,
            cp_kind: CpKind::Ring,
            cp_balance: CpBalance::HeadTail,
            pp: 1,
            pipeline: PipelineLayout::default(),
            ep: 1,
            zero: None,
            replicate: 1,
            prefetch: false,
            no_sync: false,
            overlap: false,
            offload: false,
            diloco: None,
            optim: Optim::Adamw,
            fault_tolerant: false,
        }
    }
}

/// The most pipeline stages (ranks x virtual stages) a layout may have.
pub const MAX_STAGES: usize = 1 << 12;
/// The most micro-batches of a pipelined step.
pub const MAX_MICRO_BATCHES: usize = 1 << 14;

/// What [`Layout::validate`] needs to know of the model and the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Attention heads (tensor parallelism splits whole heads).
    pub n_heads: usize,
    /// Experts per MoE layer (`None`: a dense model).
    pub n_experts: Option<usize>,
    /// Whether the model has dropout (not composed with context parallelism).
    pub dropout: bool,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub batch_size: usize,
    /// Micro-steps per optimizer step.
    pub grad_accum: usize,
    /// bf16 or fp16 compute (`--precision`) or a loss scaler.
    pub mixed_precision: bool,
    /// A dynamic loss scaler (fp16, `--loss-scale`).
    pub loss_scaling: bool,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            n_heads: 1,
            n_experts: None,
            dropout: false,
            seq_len: 1,
            batch_size: 1,
            grad_accum: 1,
            mixed_precision: false,
            loss_scaling: false,
        }
    }
}

/// A layout that cannot run: `flag` is the setting to change or drop, `message` says why and
/// what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LayoutError {
    /// The flag (`--tp`, `--zero`, ...) to change or drop.
    pub flag: &'static str,
    /// Why, naming the flag and what to do.
    pub message: String,
}

impl From<LayoutError> for burn_parallel::Error {
    fn from(e: LayoutError) -> Self {
        burn_parallel::Error::invalid(e.flag, e.message)
    }
}

/// Refuses with `flag` when `refused`.
fn rule(
    refused: bool,
    flag: &'static str,
    message: impl FnOnce() -> String,
) -> Result<(), LayoutError> {
    match refused {
        true => Err(LayoutError {
            flag,
            message: message(),
        }),
        false => Ok(()),
    }
}

impl Layout {
    /// Reads a layout from TOML: the field names of [`Layout`], every one optional.
    ///
    /// # Errors
    /// A message naming the key that is unknown or of the wrong type.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        crate::from_toml(text).map_err(|e| format!("invalid layout: {e}"))
    }

    /// Data-parallel ranks (replicate x shard) on `world` ranks: what is left after the
    /// pipeline, context and tensor dimensions (at least 1).
    pub fn data_parallel_size(&self, world: usize) -> usize {
        let model_ranks = self.tp.max(1).saturating_mul(self.cp.max(1));
        (world / model_ranks.saturating_mul(self.pp.max(1))).max(1)
    }

    /// The mesh of this layout on `world` ranks.
    pub fn dims(&self, world: usize) -> ParallelDims {
        let dp = self.data_parallel_size(world);
        let replicate = match self.zero {
            None => dp,
            Some(_) => self.replicate.max(1),
        };
        ParallelDims {
            dp_replicate: replicate,
            dp_shard: dp / replicate,
            pp: self.pp.max(1),
            cp: self.cp.max(1),
            tp: self.tp.max(1),
            ep: self.ep.max(1),
        }
    }

    /// The layout in words on `world` ranks, as banners, logs and resumes name it: `dp 2 x tp 2
    /// + sp, ZeRO-2`, `FSDP 4 x cp 2 (ulysses, headtail balance)`, `HSDP 2 x 2 x pp 2`.
    ///
    /// ```
    /// use burn_parallel_train::Layout;
    /// use burn_zero::Stage;
    ///
    /// let layout = Layout { tp: 2, sp: true, zero: Some(Stage::Two), ..Layout::default() };
    /// assert_eq!(layout.describe(4), "dp 2 x tp 2 + sp, ZeRO-2");
    /// assert_eq!(Layout::default().describe(1), "dp 1");
    /// ```
    pub fn describe(&self, world: usize) -> String {
        let dims = self.dims(world);
        let mut parts = vec![match self.zero {
            Some(Stage::Three) if dims.dp_replicate > 1 => {
                format!("HSDP {} x {}", dims.dp_replicate, dims.dp_shard)
            }
            Some(Stage::Three) => format!("FSDP {}", dims.dp_shard),
            _ => format!("dp {}", dims.dp_replicate * dims.dp_shard),
        }];
        if dims.tp > 1 {
            parts.push(format!(
                "tp {}{}",
                dims.tp,
                if self.sp { " + sp" } else { "" }
            ));
        }
        if dims.cp > 1 {
            parts.push(format!(
                "cp {} ({}, {} balance)",
                dims.cp, self.cp_kind, self.cp_balance
            ));
        }
        if dims.pp > 1 {
            let p = self.pipeline;
            let mut pp = format!("pp {} ({}", dims.pp, p.schedule);
            if let Some(v) = p.virtual_stages {
                pp += &format!(", {v} stages per rank");
            }
            match p.recompute {
                Recompute::Off => {}
                Recompute::Stages => pp += ", stages recomputed",
                Recompute::Blocks => pp += ", layers recomputed",
            }
            parts.push(pp + ")");
        }
        if dims.ep > 1 {
            parts.push(format!("ep {}", dims.ep));
        }
        let mut text = parts.join(" x ");
        match self.zero {
            Some(Stage::One) => text += ", ZeRO-1",
            Some(Stage::Two) => text += ", ZeRO-2",
            _ => {}
        }
        if self.offload {
            text += ", offloaded";
        }
        if let Some(d) = self.diloco {
            text += &format!(
                ", DiLoCo {} islands, H = {}",
                d.islands, d.config.inner_steps
            );
        }
        if self.fault_tolerant {
            text += ", fault-tolerant";
        }
        text
    }

    /// The data-parallel replicas of fault-tolerant training on `world` ranks: the FSDP
    /// replicate groups under `--hybrid`, every data-parallel rank otherwise.
    pub fn replicas(&self, world: usize) -> usize {
        self.dims(world).dp_replicate
    }

    /// Whether the ZeRO stage is 1 or 2 (the sharded optimizer over replicated parameters).
    fn zero_1_2(&self) -> bool {
        matches!(self.zero, Some(Stage::One | Stage::Two))
    }

    /// Checks that `world` ranks can train `work` under this layout: every rule of which
    /// techniques compose, in one place. Call it before any rank builds anything.
    ///
    /// # Errors
    /// The first rule broken, as a [`LayoutError`] naming its flag.
    pub fn validate(&self, world: usize, work: &Workload) -> Result<(), LayoutError> {
        let (tp, cp, pp) = (self.tp, self.cp, self.pp);
        rule(world == 0, "--ranks", || {
            "a world needs at least one rank".into()
        })?;
        rule(tp == 0 || !world.is_multiple_of(tp), "--tp", || {
            format!(
                "the world of {world} ranks cannot be split into tensor-parallel groups of \
                 {tp}; use a --tp that divides the number of ranks"
            )
        })?;
        rule(self.sp && tp == 1, "--sp", || {
            "sequence parallelism (--sp) needs --tp 2 or more".into()
        })?;
        rule(!work.n_heads.is_multiple_of(tp), "--tp", || {
            format!(
                "the model's {} attention heads are not divisible by --tp {tp}: attention is \
                 split by whole heads",
                work.n_heads
            )
        })?;
        // Products checked: one that overflows is no split of the world either.
        let divides = |n: Option<usize>| n.is_some_and(|n| world.is_multiple_of(n));
        rule(cp == 0 || !divides(tp.checked_mul(cp)), "--cp", || {
            format!(
                "the world of {world} ranks cannot be split into groups of tp {tp} x cp {cp}; use \
                 a --cp that divides the number of ranks over --tp"
            )
        })?;
        rule(
            pp == 0 || !divides(tp.checked_mul(cp).and_then(|n| n.checked_mul(pp))),
            "--pp",
            || {
                format!(
                    "the world of {world} ranks cannot be split into groups of tp {tp} x cp {cp} x \
                 pp {pp}; use a --pp that divides the number of ranks over --tp and --cp"
                )
            },
        )?;
        let dp = world / (tp * cp * pp);
        if pp > 1 {
            rule(work.n_experts.is_some(), "--pp", || {
                "pipeline parallelism is not composed with a mixture-of-experts model yet: the \
                 pipeline stages do not build MoE layers; drop --pp"
                    .into()
            })?;
            for (on, flag) in [
                (cp > 1, "--cp"),
                (self.replicate > 1, "--hybrid"),
                (self.ep > 1, "--ep"),
                (self.overlap, "--overlap"),
                (self.offload, "--offload"),
            ] {
                rule(on, flag, || {
                    format!(
                        "{flag} is not composed with pipeline parallelism yet; --pp runs with \
                         data parallelism (--ranks, --zero 1|2) and tensor parallelism (--tp, \
                         --sp): drop {flag}"
                    )
                })?;
            }
            rule(self.zero == Some(Stage::Three), "--zero", || {
                "FSDP (--zero 3) is not composed with pipeline parallelism yet; use --zero 1 or 2 \
                 (optimizer state and gradients sharded over each stage's replicas)"
                    .into()
            })?;
            let p = self.pipeline;
            let micro = work.grad_accum;
            // Bounds before a schedule is generated (its programs grow with both).
            rule(pp > MAX_STAGES, "--pp", || {
                format!("--pp {pp} is more than the {MAX_STAGES} pipeline ranks supported")
            })?;
            rule(micro > MAX_MICRO_BATCHES, "--grad-accum", || {
                format!(
                    "{micro} micro-batches per step is more than the {MAX_MICRO_BATCHES} a \
                     pipeline schedule supports; use a smaller --grad-accum"
                )
            })?;
            let virtual_stages = p.virtual_stages.unwrap_or(1);
            rule(
                virtual_stages == 0 || virtual_stages > MAX_STAGES / pp,
                "--virtual-stages",
                || {
                    format!(
                        "--virtual-stages {virtual_stages} must be at least 1 and give at most \
                         {MAX_STAGES} stages over --pp {pp}"
                    )
                },
            )?;
            burn_pipeline::generators::generate(p.schedule, pp, micro, p.virtual_stages).map_err(
                |e| LayoutError {
                    flag: "--schedule",
                    message: format!(
                        "the {} schedule (--schedule) over --pp {pp} with {micro} micro-batches \
                         (the step's micro-steps, --grad-accum) cannot be generated: {e}",
                        p.schedule
                    ),
                },
            )?;
            rule(
                p.recompute != Recompute::Off && work.dropout,
                "--checkpoint-activations",
                || {
                    "activation checkpointing recomputes the forward, and the model's dropout \
                     would draw other masks the second time: set its dropout to 0 or drop \
                     --checkpoint-activations / --checkpoint-blocks"
                        .into()
                },
            )?;
            rule(
                p.recompute == Recompute::Blocks && work.mixed_precision,
                "--checkpoint-blocks",
                || {
                    "--precision bf16|fp16 runs each stage on its compute copy, and a layer \
                     recomputed inside the backward would hand its gradients to that copy, not \
                     to the fp32 weights: recompute whole stages (--checkpoint-activations) \
                     instead of --checkpoint-blocks, or drop --precision"
                        .into()
                },
            )?;
            rule(work.loss_scaling && self.zero.is_some(), "--zero", || {
                "dynamic loss scaling (--precision fp16, --loss-scale) skips a step on every \
                 stage at once, which ZeRO's stage optimizers do not: use --precision bf16 with \
                 --zero, or drop --zero"
                    .into()
            })?;
        } else {
            rule(
                self.pipeline != PipelineLayout::default(),
                "--schedule",
                || {
                    "the pipeline's settings (--schedule, --virtual-stages, --checkpoint-activations, \
                 --checkpoint-blocks) need --pp 2 or more"
                    .into()
                },
            )?;
        }
        if cp > 1 {
            SeqLayout::new(work.seq_len, cp, 0, self.cp_balance).map_err(|e| LayoutError {
                flag: "--cp",
                message: e.to_string(),
            })?;
            let heads = work.n_heads / tp;
            rule(
                self.cp_kind == CpKind::Ulysses && !heads.is_multiple_of(cp),
                "--cp-kind",
                || {
                    format!(
                        "Ulysses splits the {heads} heads of each tensor-parallel rank over --cp \
                         {cp}: use a cp that divides them, or --cp-kind ring"
                    )
                },
            )?;
            rule(work.dropout, "--cp", || {
                "dropout is not supported with --cp: set the model's dropout to 0 or drop --cp"
                    .into()
            })?;
            rule(self.replicate > 1 && self.zero_1_2(), "--hybrid", || {
                "hybrid ZeRO-1/2 (--hybrid with --zero 1|2) is not supported with --cp; use \
                 --zero 3 or no --hybrid"
                    .into()
            })?;
        }
        let ep = self.ep;
        match work.n_experts {
            None => rule(ep != 1, "--ep", || {
                format!("--ep {ep} needs a mixture-of-experts model; use --ep 1")
            })?,
            Some(experts) => {
                rule(cp > 1, "--cp", || {
                    "context parallelism is not composed with a mixture-of-experts model: each \
                     rank would route only its part of every sequence, so the load-balancing \
                     loss, the token counts and the capacity groups would not be those of the \
                     whole batch; drop --cp"
                        .into()
                })?;
                rule(
                    ep == 0 || !experts.is_multiple_of(ep) || !dp.is_multiple_of(ep),
                    "--ep",
                    || {
                        format!(
                            "--ep {ep} must divide both the {experts} experts and the {dp} \
                             data-parallel ranks; choose an ep that divides both"
                        )
                    },
                )?;
                rule(
                    work.mixed_precision && self.zero_1_2(),
                    "--precision",
                    || {
                        "mixed precision (--precision bf16|fp16, or --loss-scale) with a \
                     mixture-of-experts model trains under data, tensor, expert and FSDP \
                     parallelism; under ZeRO-1/2 the experts stay out of the sharded optimizer \
                     and would have no fp32 master weights: use --zero 3 or drop --zero, or \
                     drop --precision"
                            .into()
                    },
                )?;
                rule(self.overlap, "--overlap", || {
                    "--overlap overlaps data parallelism's all-reduce of a dense model, not a \
                     mixture-of-experts model's (whose experts reduce over their own groups): \
                     drop --overlap"
                        .into()
                })?;
            }
        }
        rule(self.offload && !self.zero_1_2(), "--offload", || {
            "--offload keeps ZeRO-1/2's optimizer state on the host: use it with --zero 1 or \
             --zero 2"
                .into()
        })?;
        rule(
            self.replicate == 0 || !dp.is_multiple_of(self.replicate),
            "--hybrid",
            || {
                format!(
                    "{dp} data-parallel ranks cannot form {} replicate groups; use a --hybrid \
                     that divides {dp}",
                    self.replicate
                )
            },
        )?;
        rule(
            self.replicate > 1 && self.zero.is_none(),
            "--hybrid",
            || "hybrid sharding (--hybrid) needs --zero".into(),
        )?;
        rule(self.overlap && self.zero.is_some(), "--overlap", || {
            "--overlap overlaps data parallelism's all-reduce; ZeRO and FSDP reduce-scatter \
             instead: drop --overlap or --zero"
                .into()
        })?;
        for (on, flag) in [(self.prefetch, "--prefetch"), (self.no_sync, "--no-sync")] {
            rule(on && self.zero != Some(Stage::Three), flag, || {
                format!("{flag} is an option of FSDP: use it with --zero 3")
            })?;
        }
        if let Some(d) = self.diloco {
            for (on, flag) in [
                (tp > 1, "--tp"),
                (cp > 1, "--cp"),
                (pp > 1, "--pp"),
                (self.ep > 1, "--ep"),
                (self.zero.is_some(), "--zero"),
                (self.overlap, "--overlap"),
                (work.n_experts.is_some(), "--moe-experts"),
            ] {
                rule(on, flag, || {
                    format!(
                        "{flag} is not composed with DiLoCo: its outer step averages whole \
                         dense models of islands that run plain data parallelism; drop {flag} or \
                         --diloco-islands"
                    )
                })?;
            }
            rule(
                d.islands == 0 || !world.is_multiple_of(d.islands),
                "--diloco-islands",
                || {
                    format!(
                        "--diloco-islands {} cannot split the world of {world} ranks evenly; use \
                         a number of islands that divides it",
                        d.islands
                    )
                },
            )?;
            d.config.validate().map_err(|e| LayoutError {
                flag: "--diloco-islands",
                message: format!("DiLoCo's settings (--diloco-islands): {e}"),
            })?;
        }
        if self.fault_tolerant {
            for (on, flag) in [
                (pp > 1, "--pp"),
                (self.ep > 1, "--ep"),
                (self.zero_1_2(), "--zero"),
                (self.overlap, "--overlap"),
                (self.diloco.is_some(), "--diloco-islands"),
                (work.n_experts.is_some(), "--moe-experts"),
            ] {
                rule(on, flag, || {
                    format!(
                        "{flag} is not composed with --fault-tolerant, whose replicas are whole \
                         dense models (data parallelism, or FSDP and tensor parallelism inside \
                         each replica with --zero 3 --hybrid) averaged once per step; drop \
                         {flag} or --fault-tolerant"
                    )
                })?;
            }
            rule(self.replicas(world) < 2, "--fault-tolerant", || {
                "--fault-tolerant needs at least 2 data-parallel replicas to survive the loss \
                 of one (with --zero 3, add --hybrid N)"
                    .into()
            })?;
        }
        let accum = work.grad_accum;
        rule(accum == 0, "--grad-accum", || {
            "--grad-accum must be at least 1".into()
        })?;
        rule(
            work.batch_size == 0
                || dp
                    .checked_mul(accum.max(1))
                    .is_none_or(|n| !work.batch_size.is_multiple_of(n)),
            "--batch-size",
            || {
                let multiple = dp
                    .checked_mul(accum.max(1))
                    .map_or_else(|| "their product".to_string(), |n| n.to_string());
                format!(
                    "the global batch of {} sequences cannot be split evenly over {dp} \
                     data-parallel ranks x {accum} micro-batches per step (--grad-accum); use a \
                     --batch-size that is a multiple of {multiple}",
                    work.batch_size,
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_optimizer_is_a_key_of_a_toml_layout() {
        let layout: Layout = toml::from_str("tp = 2\noptim = \"muon\"").unwrap();
        assert_eq!((layout.tp, layout.optim), (2, Optim::Muon));
        assert_eq!(Layout::default().optim, Optim::Adamw);
        assert!(toml::from_str::<Layout>("optim = \"lamb\"").is_err());
        assert_eq!("muon".parse::<Optim>(), Ok(Optim::Muon));
        assert!(
            "sgd"
                .parse::<Optim>()
                .unwrap_err()
                .contains("adamw or muon")
        );
    }

    fn work() -> Workload {
        Workload {
            n_heads: 4,
            seq_len: 16,
            batch_size: 8,
            ..Workload::default()
        }
    }

    fn moe() -> Workload {
        Workload {
            n_experts: Some(4),
            ..work()
        }
    }

    /// The flag the layout is refused for on `world` ranks, with the flag in the message.
    fn refused(layout: Layout, world: usize, work: &Workload) -> &'static str {
        let e = layout
            .validate(world, work)
            .expect_err("the layout must be refused");
        assert!(
            e.message.contains(e.flag) || e.flag == "--ranks",
            "the message names its flag {}: {}",
            e.flag,
            e.message
        );
        e.flag
    }

    #[test]
    fn every_composable_layout_is_accepted() {
        let ok = [
            (Layout::default(), 1, work()),
            (Layout::default(), 4, work()),
            (
                Layout {
                    tp: 2,
                    sp: true,
                    zero: Some(Stage::Three),
                    replicate: 2,
                    ..Layout::default()
                },
                8,
                work(),
            ),
            (
                Layout {
                    cp: 2,
                    tp: 2,
                    zero: Some(Stage::Three),
                    ..Layout::default()
                },
                8,
                work(),
            ),
            (
                Layout {
                    pp: 2,
                    tp: 2,
                    zero: Some(Stage::One),
                    ..Layout::default()
                },
                8,
                work(),
            ),
            (
                Layout {
                    ep: 2,
                    tp: 2,
                    zero: Some(Stage::Two),
                    ..Layout::default()
                },
                8,
                moe(),
            ),
            (
                Layout {
                    zero: Some(Stage::Two),
                    offload: true,
                    ..Layout::default()
                },
                2,
                work(),
            ),
            (
                Layout {
                    zero: Some(Stage::Three),
                    prefetch: true,
                    no_sync: true,
                    ..Layout::default()
                },
                2,
                work(),
            ),
            (
                Layout {
                    overlap: true,
                    ..Layout::default()
                },
                2,
                work(),
            ),
        ];
        for (layout, world, work) in ok {
            assert_eq!(
                layout.validate(world, &work),
                Ok(()),
                "{layout:?} on {world}"
            );
        }
    }

    #[test]
    fn each_rule_names_its_flag() {
        let d = Layout::default();
        let z3 = Some(Stage::Three);
        let cases: Vec<(Layout, usize, Workload, &str)> = vec![
            (d, 0, work(), "--ranks"),
            (Layout { tp: 3, ..d }, 4, work(), "--tp"),
            (Layout { tp: 0, ..d }, 4, work(), "--tp"),
            (Layout { sp: true, ..d }, 4, work(), "--sp"),
            (Layout { tp: 8, ..d }, 8, work(), "--tp"),
            (Layout { cp: 3, ..d }, 4, work(), "--cp"),
            (Layout { pp: 3, ..d }, 4, work(), "--pp"),
            (Layout { pp: 2, ep: 2, ..d }, 4, moe(), "--pp"),
            (Layout { pp: 2, cp: 2, ..d }, 4, work(), "--cp"),
            (
                Layout {
                    pp: 2,
                    zero: z3,
                    replicate: 2,
                    ..d
                },
                8,
                work(),
                "--hybrid",
            ),
            (
                Layout {
                    pp: 2,
                    zero: z3,
                    ..d
                },
                4,
                work(),
                "--zero",
            ),
            (
                Layout {
                    pp: 2,
                    overlap: true,
                    ..d
                },
                4,
                work(),
                "--overlap",
            ),
            // The pipeline's own rules.
            (
                Layout {
                    pp: 2,
                    pipeline: PipelineLayout {
                        schedule: ScheduleKind::Interleaved1F1B,
                        virtual_stages: Some(2),
                        ..PipelineLayout::default()
                    },
                    ..d
                },
                4,
                Workload {
                    grad_accum: 3,
                    batch_size: 12,
                    ..work()
                },
                "--schedule",
            ),
            (
                Layout {
                    pipeline: PipelineLayout::default().with_recompute(Recompute::Stages),
                    ..d
                },
                4,
                work(),
                "--schedule",
            ),
            (
                Layout {
                    pp: 2,
                    pipeline: PipelineLayout::default().with_recompute(Recompute::Stages),
                    ..d
                },
                4,
                Workload {
                    dropout: true,
                    ..work()
                },
                "--checkpoint-activations",
            ),
            (
                Layout {
                    pp: 2,
                    pipeline: PipelineLayout::default().with_recompute(Recompute::Blocks),
                    ..d
                },
                4,
                Workload {
                    mixed_precision: true,
                    ..work()
                },
                "--checkpoint-blocks",
            ),
            (
                Layout {
                    pp: 2,
                    zero: Some(Stage::Two),
                    ..d
                },
                4,
                Workload {
                    mixed_precision: true,
                    loss_scaling: true,
                    ..work()
                },
                "--zero",
            ),
            (
                Layout { pp: 2, ..d },
                4,
                Workload {
                    grad_accum: MAX_MICRO_BATCHES + 1,
                    ..work()
                },
                "--grad-accum",
            ),
            (
                Layout {
                    pp: 2,
                    pipeline: PipelineLayout {
                        virtual_stages: Some(0),
                        ..PipelineLayout::default()
                    },
                    ..d
                },
                4,
                work(),
                "--virtual-stages",
            ),
            (
                Layout { cp: 4, ..d },
                4,
                Workload {
                    seq_len: 6,
                    ..work()
                },
                "--cp",
            ),
            (
                Layout {
                    cp: 8,
                    cp_kind: CpKind::Ulysses,
                    ..d
                },
                8,
                Workload {
                    seq_len: 32,
                    ..work()
                },
                "--cp-kind",
            ),
            (
                Layout { cp: 2, ..d },
                2,
                Workload {
                    dropout: true,
                    ..work()
                },
                "--cp",
            ),
            (
                Layout {
                    cp: 2,
                    zero: Some(Stage::One),
                    replicate: 2,
                    ..d
                },
                8,
                work(),
                "--hybrid",
            ),
            (Layout { ep: 2, ..d }, 4, work(), "--ep"),
            (Layout { cp: 2, ..d }, 4, moe(), "--cp"),
            (Layout { ep: 3, ..d }, 6, moe(), "--ep"),
            (Layout { ep: 4, ..d }, 2, moe(), "--ep"),
            (
                Layout {
                    zero: Some(Stage::Two),
                    ..d
                },
                2,
                Workload {
                    mixed_precision: true,
                    ..moe()
                },
                "--precision",
            ),
            (Layout { overlap: true, ..d }, 2, moe(), "--overlap"),
            (Layout { offload: true, ..d }, 2, work(), "--offload"),
            (
                Layout {
                    offload: true,
                    zero: z3,
                    ..d
                },
                2,
                work(),
                "--offload",
            ),
            (
                Layout {
                    zero: z3,
                    replicate: 3,
                    ..d
                },
                4,
                work(),
                "--hybrid",
            ),
            (Layout { replicate: 2, ..d }, 4, work(), "--hybrid"),
            (
                Layout {
                    overlap: true,
                    zero: Some(Stage::One),
                    ..d
                },
                2,
                work(),
                "--overlap",
            ),
            (
                Layout {
                    prefetch: true,
                    zero: Some(Stage::Two),
                    ..d
                },
                2,
                work(),
                "--prefetch",
            ),
            (Layout { no_sync: true, ..d }, 2, work(), "--no-sync"),
            (
                d,
                2,
                Workload {
                    grad_accum: 0,
                    ..work()
                },
                "--grad-accum",
            ),
            (d, 3, work(), "--batch-size"),
            (
                d,
                2,
                Workload {
                    grad_accum: 3,
                    ..work()
                },
                "--batch-size",
            ),
        ];
        // DiLoCo's rules: islands that divide the world, dense plain data parallelism inside,
        // sane outer settings.
        let islands = |n: usize| {
            Some(DiLoCoLayout {
                islands: n,
                ..DiLoCoLayout::default()
            })
        };
        let diloco = Layout {
            diloco: islands(2),
            ..d
        };
        let mut cases = cases;
        cases.extend([
            (Layout { tp: 2, ..diloco }, 4, work(), "--tp"),
            (Layout { cp: 2, ..diloco }, 4, work(), "--cp"),
            (Layout { pp: 2, ..diloco }, 4, work(), "--pp"),
            (Layout { zero: z3, ..diloco }, 4, work(), "--zero"),
            (
                Layout {
                    overlap: true,
                    ..diloco
                },
                4,
                work(),
                "--overlap",
            ),
            (diloco, 4, moe(), "--moe-experts"),
            (
                Layout {
                    diloco: islands(3),
                    ..d
                },
                4,
                work(),
                "--diloco-islands",
            ),
            (
                Layout {
                    diloco: islands(0),
                    ..d
                },
                4,
                work(),
                "--diloco-islands",
            ),
        ]);
        let mut no_inner_steps = DiLoCoLayout::default();
        no_inner_steps.config.inner_steps = 0;
        cases.push((
            Layout {
                diloco: Some(no_inner_steps),
                ..d
            },
            4,
            work(),
            "--diloco-islands",
        ));
        assert!(diloco.validate(4, &work()).is_ok());
        for (layout, world, work, flag) in cases {
            assert_eq!(
                refused(layout, world, &work),
                flag,
                "{layout:?} on {world} ranks"
            );
        }
    }

    #[test]
    fn toml_names_an_unknown_key() {
        let e = Layout::from_toml("tp = 2\nzeros = 3").unwrap_err();
        assert!(e.contains("zeros"), "{e}");
        let e = Layout::from_toml("zero = 4").unwrap_err();
        assert!(e.contains("stage 4"), "{e}");
        let layout =
            Layout::from_toml("cp = 2\ncp_kind = \"ulysses\"\ncp_balance = \"none\"\nzero = 1")
                .unwrap();
        assert_eq!(
            (layout.cp, layout.cp_kind, layout.zero),
            (2, CpKind::Ulysses, Some(Stage::One))
        );
    }
}
