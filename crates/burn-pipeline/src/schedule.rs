//! Actions, stage placements and schedules: the data a pipeline runtime executes.
//!
//! A [`Schedule`] is one ordered program of [`Action`]s per pipeline rank plus the
//! [`Placement`] that says which rank owns which stage. Nothing here runs a model: the
//! generators in [`crate::generators`] build schedules, [`crate::validate`] proves them safe,
//! [`crate::simulate`] predicts their timing and [`crate::format`] reads and writes them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;

/// What a transfer between two stages carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Payload {
    /// The output of a stage's forward, sent to the next stage.
    Activation,
    /// The gradient with respect to a stage's input, sent back to the previous stage.
    Grad,
}

/// The identity of one tensor crossing a stage boundary: which payload, from which stage to
/// which stage, for which micro-batch. A send and its receive carry the same `Transfer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Transfer {
    /// Activation (forward direction) or gradient (backward direction).
    pub payload: Payload,
    /// The stage that produces the tensor.
    pub from: usize,
    /// The stage that consumes it.
    pub to: usize,
    /// The micro-batch it belongs to.
    pub microbatch: usize,
}

impl Transfer {
    /// A message tag that is unique for this transfer within one schedule step, so that a
    /// runtime can match a send with its receive by `(peer, tag)` whatever order they run in.
    ///
    /// # Arguments
    /// * `num_stages` - the schedule's stage count; `from` and `to` must be below it.
    /// * `num_microbatches` - the schedule's micro-batch count; `microbatch` must be below it.
    ///
    /// # Returns
    /// `((payload * S + from) * S + to) * M + microbatch`, with `payload` 0 for activations
    /// and 1 for gradients.
    pub fn tag(&self, num_stages: usize, num_microbatches: usize) -> u64 {
        let payload = match self.payload {
            Payload::Activation => 0u64,
            Payload::Grad => 1u64,
        };
        let s = num_stages as u64;
        ((payload * s + self.from as u64) * s + self.to as u64) * num_microbatches as u64
            + self.microbatch as u64
    }
}

impl fmt::Display for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.payload {
            Payload::Activation => "activation",
            Payload::Grad => "gradient",
        };
        write!(
            f,
            "{what} of micro-batch {} from stage {} to stage {}",
            self.microbatch, self.from, self.to
        )
    }
}

/// The kind of an [`Action`], without its indices (for costs, counts and matching).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Forward of one micro-batch through one stage.
    Forward,
    /// Full backward (input and weight gradients at once).
    Backward,
    /// Backward for the input gradient only (the zero-bubble `B`, written `I` here).
    BackwardInput,
    /// Backward for the weight gradients only (the zero-bubble `W`).
    BackwardWeight,
    /// Send an activation to the next stage.
    SendActivation,
    /// Receive an activation from the previous stage.
    RecvActivation,
    /// Send an input gradient to the previous stage.
    SendGrad,
    /// Receive an input gradient from the next stage.
    RecvGrad,
    /// Reduce (and then apply) the stage's accumulated weight gradients.
    ReduceGrads,
}

impl ActionKind {
    /// Whether this kind is computation (forward, a backward part, or the gradient reduction)
    /// rather than point-to-point communication.
    pub fn is_compute(self) -> bool {
        match self {
            ActionKind::Forward
            | ActionKind::Backward
            | ActionKind::BackwardInput
            | ActionKind::BackwardWeight
            | ActionKind::ReduceGrads => true,
            ActionKind::SendActivation
            | ActionKind::RecvActivation
            | ActionKind::SendGrad
            | ActionKind::RecvGrad => false,
        }
    }
}

/// One step of a rank's program.
///
/// `stage` is always the stage that lives on the rank executing the action: for a send it is
/// the producing stage, for a receive the consuming one; `to`/`from` name the peer stage.
/// The compact text form (see [`crate::format`]) is `{stage}{F|B|I|W}{microbatch}` for
/// computation, `SEND_F(a->b,mK)`, `RECV_F(a->b,mK)`, `SEND_B(a->b,mK)`, `RECV_B(a->b,mK)` for
/// communication (data flows from `a` to `b`) and `REDUCE(s)` for the gradient reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// Forward of `microbatch` through `stage`.
    Forward {
        /// Local stage.
        stage: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Full backward of `microbatch` through `stage`.
    Backward {
        /// Local stage.
        stage: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Input-gradient backward of `microbatch` through `stage`.
    BackwardInput {
        /// Local stage.
        stage: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Weight-gradient backward of `microbatch` through `stage`.
    BackwardWeight {
        /// Local stage.
        stage: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Send the activation of `microbatch` from `stage` to stage `to`.
    SendActivation {
        /// Local (producing) stage.
        stage: usize,
        /// Consuming stage.
        to: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Receive the activation of `microbatch` for `stage` from stage `from`.
    RecvActivation {
        /// Local (consuming) stage.
        stage: usize,
        /// Producing stage.
        from: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Send the input gradient of `microbatch` from `stage` to stage `to`.
    SendGrad {
        /// Local (producing) stage.
        stage: usize,
        /// Consuming stage.
        to: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Receive the gradient of `microbatch` for `stage` from stage `from`.
    RecvGrad {
        /// Local (consuming) stage.
        stage: usize,
        /// Producing stage.
        from: usize,
        /// Micro-batch index.
        microbatch: usize,
    },
    /// Reduce the weight gradients of `stage` (data-parallel all-reduce, tied weights) once
    /// every micro-batch's backward of that stage is done.
    ReduceGrads {
        /// Local stage.
        stage: usize,
    },
}

impl Action {
    /// The local stage of the action.
    pub fn stage(&self) -> usize {
        match *self {
            Action::Forward { stage, .. }
            | Action::Backward { stage, .. }
            | Action::BackwardInput { stage, .. }
            | Action::BackwardWeight { stage, .. }
            | Action::SendActivation { stage, .. }
            | Action::RecvActivation { stage, .. }
            | Action::SendGrad { stage, .. }
            | Action::RecvGrad { stage, .. }
            | Action::ReduceGrads { stage } => stage,
        }
    }

    /// The micro-batch of the action; `None` for [`Action::ReduceGrads`].
    pub fn microbatch(&self) -> Option<usize> {
        match *self {
            Action::Forward { microbatch, .. }
            | Action::Backward { microbatch, .. }
            | Action::BackwardInput { microbatch, .. }
            | Action::BackwardWeight { microbatch, .. }
            | Action::SendActivation { microbatch, .. }
            | Action::RecvActivation { microbatch, .. }
            | Action::SendGrad { microbatch, .. }
            | Action::RecvGrad { microbatch, .. } => Some(microbatch),
            Action::ReduceGrads { .. } => None,
        }
    }

    /// The kind of the action.
    pub fn kind(&self) -> ActionKind {
        match self {
            Action::Forward { .. } => ActionKind::Forward,
            Action::Backward { .. } => ActionKind::Backward,
            Action::BackwardInput { .. } => ActionKind::BackwardInput,
            Action::BackwardWeight { .. } => ActionKind::BackwardWeight,
            Action::SendActivation { .. } => ActionKind::SendActivation,
            Action::RecvActivation { .. } => ActionKind::RecvActivation,
            Action::SendGrad { .. } => ActionKind::SendGrad,
            Action::RecvGrad { .. } => ActionKind::RecvGrad,
            Action::ReduceGrads { .. } => ActionKind::ReduceGrads,
        }
    }

    /// Whether the action is computation (see [`ActionKind::is_compute`]).
    pub fn is_compute(&self) -> bool {
        self.kind().is_compute()
    }

    /// The tensor a send or receive carries; `None` for computation.
    pub fn transfer(&self) -> Option<Transfer> {
        match *self {
            Action::SendActivation {
                stage,
                to,
                microbatch,
            } => Some(Transfer {
                payload: Payload::Activation,
                from: stage,
                to,
                microbatch,
            }),
            Action::RecvActivation {
                stage,
                from,
                microbatch,
            } => Some(Transfer {
                payload: Payload::Activation,
                from,
                to: stage,
                microbatch,
            }),
            Action::SendGrad {
                stage,
                to,
                microbatch,
            } => Some(Transfer {
                payload: Payload::Grad,
                from: stage,
                to,
                microbatch,
            }),
            Action::RecvGrad {
                stage,
                from,
                microbatch,
            } => Some(Transfer {
                payload: Payload::Grad,
                from,
                to: stage,
                microbatch,
            }),
            Action::Forward { .. }
            | Action::Backward { .. }
            | Action::BackwardInput { .. }
            | Action::BackwardWeight { .. }
            | Action::ReduceGrads { .. } => None,
        }
    }

    /// The receive of `transfer`.
    fn receive(transfer: Transfer) -> Action {
        let Transfer {
            payload,
            from,
            to,
            microbatch,
        } = transfer;
        match payload {
            Payload::Activation => Action::RecvActivation {
                stage: to,
                from,
                microbatch,
            },
            Payload::Grad => Action::RecvGrad {
                stage: to,
                from,
                microbatch,
            },
        }
    }

    /// The peer stage of a send or receive; `None` for computation.
    pub fn peer_stage(&self) -> Option<usize> {
        match *self {
            Action::SendActivation { to, .. } | Action::SendGrad { to, .. } => Some(to),
            Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => Some(from),
            Action::Forward { .. }
            | Action::Backward { .. }
            | Action::BackwardInput { .. }
            | Action::BackwardWeight { .. }
            | Action::ReduceGrads { .. } => None,
        }
    }

    /// Whether the action is a send.
    pub fn is_send(&self) -> bool {
        matches!(
            self.kind(),
            ActionKind::SendActivation | ActionKind::SendGrad
        )
    }

    /// Whether the action is a receive.
    pub fn is_recv(&self) -> bool {
        matches!(
            self.kind(),
            ActionKind::RecvActivation | ActionKind::RecvGrad
        )
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { stage, microbatch } => write!(f, "{stage}F{microbatch}"),
            Action::Backward { stage, microbatch } => write!(f, "{stage}B{microbatch}"),
            Action::BackwardInput { stage, microbatch } => write!(f, "{stage}I{microbatch}"),
            Action::BackwardWeight { stage, microbatch } => write!(f, "{stage}W{microbatch}"),
            Action::SendActivation {
                stage,
                to,
                microbatch,
            } => write!(f, "SEND_F({stage}->{to},m{microbatch})"),
            Action::RecvActivation {
                stage,
                from,
                microbatch,
            } => write!(f, "RECV_F({from}->{stage},m{microbatch})"),
            Action::SendGrad {
                stage,
                to,
                microbatch,
            } => write!(f, "SEND_B({stage}->{to},m{microbatch})"),
            Action::RecvGrad {
                stage,
                from,
                microbatch,
            } => write!(f, "RECV_B({from}->{stage},m{microbatch})"),
            Action::ReduceGrads { stage } => write!(f, "REDUCE({stage})"),
        }
    }
}

/// Error parsing one action token (see the grammar in [`crate::format`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot parse pipeline action `{token}`: {reason}; expected `<stage><F|B|I|W><microbatch>` \
     (e.g. `0F3`), `SEND_F(a->b,mK)`, `RECV_F(a->b,mK)`, `SEND_B(a->b,mK)`, `RECV_B(a->b,mK)` \
     or `REDUCE(s)`"
)]
pub struct ActionParseError {
    /// The token as written.
    pub token: String,
    /// What is wrong with it.
    pub reason: String,
}

fn parse_index(text: &str, what: &str, token: &str) -> Result<usize, ActionParseError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ActionParseError {
            token: token.to_string(),
            reason: format!("{what} `{text}` is not a non-negative integer"),
        });
    }
    text.parse().map_err(|_| ActionParseError {
        token: token.to_string(),
        reason: format!("{what} `{text}` is too large"),
    })
}

impl FromStr for Action {
    type Err = ActionParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let token = text.trim();
        let err = |reason: &str| ActionParseError {
            token: token.to_string(),
            reason: reason.to_string(),
        };
        if token.is_empty() {
            return Err(err("empty token"));
        }
        if let Some(open) = token.find('(') {
            let name = &token[..open];
            let inner = token[open + 1..]
                .strip_suffix(')')
                .ok_or_else(|| err("missing closing `)`"))?;
            if name == "REDUCE" {
                let stage = parse_index(inner.trim(), "stage", token)?;
                return Ok(Action::ReduceGrads { stage });
            }
            let (route, mb) = inner
                .split_once(',')
                .ok_or_else(|| err("expected `(a->b,mK)`"))?;
            let (a, b) = route
                .split_once("->")
                .ok_or_else(|| err("expected `a->b` before the comma"))?;
            let a = parse_index(a.trim(), "source stage", token)?;
            let b = parse_index(b.trim(), "destination stage", token)?;
            let mb = mb
                .trim()
                .strip_prefix('m')
                .ok_or_else(|| err("expected `mK` after the comma"))?;
            let microbatch = parse_index(mb, "micro-batch", token)?;
            return match name {
                "SEND_F" => Ok(Action::SendActivation {
                    stage: a,
                    to: b,
                    microbatch,
                }),
                "RECV_F" => Ok(Action::RecvActivation {
                    stage: b,
                    from: a,
                    microbatch,
                }),
                "SEND_B" => Ok(Action::SendGrad {
                    stage: a,
                    to: b,
                    microbatch,
                }),
                "RECV_B" => Ok(Action::RecvGrad {
                    stage: b,
                    from: a,
                    microbatch,
                }),
                other => Err(err(&format!("unknown operation `{other}`"))),
            };
        }
        let letter = token
            .char_indices()
            .find(|(_, c)| !c.is_ascii_digit())
            .ok_or_else(|| err("no action letter"))?;
        let (pos, c) = letter;
        let stage = parse_index(&token[..pos], "stage", token)?;
        let microbatch = parse_index(&token[pos + c.len_utf8()..], "micro-batch", token)?;
        match c {
            'F' => Ok(Action::Forward { stage, microbatch }),
            'B' => Ok(Action::Backward { stage, microbatch }),
            'I' => Ok(Action::BackwardInput { stage, microbatch }),
            'W' => Ok(Action::BackwardWeight { stage, microbatch }),
            other => Err(err(&format!(
                "unknown action letter `{other}` (expected F, B, I or W)"
            ))),
        }
    }
}

/// How stages are laid out over ranks when each rank holds `v` stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlacementStyle {
    /// Stage `s` on rank `s % p` (Megatron's interleaved layout; `v = 1` is the plain
    /// pipeline).
    Loop,
    /// Zig-zag: chunk `c` goes down the ranks when `c` is even and back up when odd, so rank
    /// `r` holds stages `r` and `2p - 1 - r` when `v = 2` (the zero-bubble V layout).
    V,
    /// Any other stage-to-rank map (for example read from a file).
    Custom,
}

/// Errors building a placement or a schedule, or asking a generator for something it cannot
/// produce.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A pipeline needs at least one rank.
    #[error("a pipeline needs at least one rank; pass pp >= 1")]
    NoRanks,
    /// A schedule needs at least one micro-batch.
    #[error("a schedule needs at least one micro-batch; pass microbatches >= 1")]
    NoMicrobatches,
    /// Each rank needs at least one stage.
    #[error("each rank needs at least one stage; pass virtual stages v >= 1")]
    NoVirtualStages,
    /// A stage is mapped to a rank that does not exist.
    #[error("stage {stage} is placed on rank {rank}, but the pipeline has only {ranks} ranks")]
    RankOutOfRange {
        /// The stage.
        stage: usize,
        /// The rank it was given.
        rank: usize,
        /// The number of ranks.
        ranks: usize,
    },
    /// A rank owns no stage.
    #[error("rank {rank} owns no stage; every rank must hold at least one stage")]
    IdleRank {
        /// The rank.
        rank: usize,
    },
    /// The number of programs differs from the placement's rank count.
    #[error("the schedule has {programs} rank programs but the placement has {ranks} ranks")]
    ProgramCount {
        /// Programs given.
        programs: usize,
        /// Ranks in the placement.
        ranks: usize,
    },
    /// Megatron's interleaved 1F1B runs micro-batches in rounds of `pp`.
    #[error(
        "{schedule} needs the micro-batch count to be a multiple of the pipeline size: \
         {microbatches} micro-batches over pp = {ranks}; use {lower} or {upper} micro-batches"
    )]
    MicrobatchesNotDivisible {
        /// The schedule's name.
        schedule: &'static str,
        /// Micro-batches asked for.
        microbatches: usize,
        /// Pipeline ranks.
        ranks: usize,
        /// The nearest valid count below (0 when none).
        lower: usize,
        /// The nearest valid count above.
        upper: usize,
    },
    /// The schedule needs more micro-batches than were asked for.
    #[error(
        "{schedule} needs at least {needed} micro-batches at pp = {ranks}, got {microbatches}; \
         use {needed} or more"
    )]
    TooFewMicrobatches {
        /// The schedule's name.
        schedule: &'static str,
        /// Micro-batches asked for.
        microbatches: usize,
        /// Pipeline ranks.
        ranks: usize,
        /// The least it runs with.
        needed: usize,
    },
    /// The generator does not support this number of virtual stages.
    #[error("{schedule} supports {supported} virtual stages per rank, got v = {virtual_stages}")]
    VirtualStages {
        /// The schedule's name.
        schedule: &'static str,
        /// What was asked for.
        virtual_stages: usize,
        /// What the generator supports, in words.
        supported: &'static str,
    },
    /// An unknown schedule name.
    #[error(
        "unknown schedule `{name}`; expected one of gpipe, 1f1b, interleaved, zb-h1, zbv, \
         dualpipev"
    )]
    UnknownKind {
        /// The name given.
        name: String,
    },
    /// A list-scheduling generator could not make progress (a bug in the generator).
    #[error("the {schedule} generator stalled at time {time}; this is a bug, please report it")]
    GeneratorStalled {
        /// The schedule's name.
        schedule: &'static str,
        /// Simulated time of the stall.
        time: usize,
    },
}

/// Which rank owns which stage.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Placement {
    num_ranks: usize,
    stage_to_rank: Vec<usize>,
    style: PlacementStyle,
}

impl Placement {
    /// `v` stages per rank in loop order: stage `s` on rank `s % pp`.
    ///
    /// # Arguments
    /// * `pp` - pipeline ranks.
    /// * `v` - stages per rank.
    ///
    /// # Errors
    /// [`ScheduleError::NoRanks`] or [`ScheduleError::NoVirtualStages`] when either is 0.
    pub fn looped(pp: usize, v: usize) -> Result<Self, ScheduleError> {
        check_sizes(pp, v)?;
        Ok(Self {
            num_ranks: pp,
            stage_to_rank: (0..pp * v).map(|s| s % pp).collect(),
            style: PlacementStyle::Loop,
        })
    }

    /// `v` stages per rank in V (zig-zag) order: chunk `c` of rank `r` is stage
    /// `c * pp + r` when `c` is even and `c * pp + pp - 1 - r` when odd.
    ///
    /// # Arguments
    /// * `pp` - pipeline ranks.
    /// * `v` - stages per rank (2 for ZBV).
    ///
    /// # Errors
    /// [`ScheduleError::NoRanks`] or [`ScheduleError::NoVirtualStages`] when either is 0.
    pub fn v_shape(pp: usize, v: usize) -> Result<Self, ScheduleError> {
        check_sizes(pp, v)?;
        let stage_to_rank = (0..pp * v)
            .map(|s| {
                let (chunk, i) = (s / pp, s % pp);
                if chunk % 2 == 0 { i } else { pp - 1 - i }
            })
            .collect();
        Ok(Self {
            num_ranks: pp,
            stage_to_rank,
            style: PlacementStyle::V,
        })
    }

    /// An explicit stage-to-rank map (`stage_to_rank[s]` is the rank of stage `s`).
    ///
    /// # Errors
    /// [`ScheduleError::NoRanks`], [`ScheduleError::RankOutOfRange`] or
    /// [`ScheduleError::IdleRank`] (a rank without stages).
    pub fn custom(num_ranks: usize, stage_to_rank: Vec<usize>) -> Result<Self, ScheduleError> {
        if num_ranks == 0 {
            return Err(ScheduleError::NoRanks);
        }
        for (stage, &rank) in stage_to_rank.iter().enumerate() {
            if rank >= num_ranks {
                return Err(ScheduleError::RankOutOfRange {
                    stage,
                    rank,
                    ranks: num_ranks,
                });
            }
        }
        if let Some(rank) = (0..num_ranks).find(|r| !stage_to_rank.contains(r)) {
            return Err(ScheduleError::IdleRank { rank });
        }
        let looped = stage_to_rank
            .iter()
            .enumerate()
            .all(|(s, &r)| r == s % num_ranks);
        let v = stage_to_rank.len() / num_ranks;
        let style = if looped && stage_to_rank.len().is_multiple_of(num_ranks) {
            PlacementStyle::Loop
        } else if stage_to_rank.len().is_multiple_of(num_ranks)
            && Placement::v_shape(num_ranks, v)
                .map(|p| p.stage_to_rank == stage_to_rank)
                .unwrap_or(false)
        {
            PlacementStyle::V
        } else {
            PlacementStyle::Custom
        };
        Ok(Self {
            num_ranks,
            stage_to_rank,
            style,
        })
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// Number of stages (over all ranks).
    pub fn num_stages(&self) -> usize {
        self.stage_to_rank.len()
    }

    /// The layout style.
    pub fn style(&self) -> PlacementStyle {
        self.style
    }

    /// The rank owning `stage`, or `None` when the stage does not exist.
    pub fn rank_of(&self, stage: usize) -> Option<usize> {
        self.stage_to_rank.get(stage).copied()
    }

    /// The stages of `rank`, in increasing stage order.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.stage_to_rank[s] == rank)
            .collect()
    }

    /// The whole stage-to-rank map.
    pub fn stage_to_rank(&self) -> &[usize] {
        &self.stage_to_rank
    }
}

fn check_sizes(pp: usize, v: usize) -> Result<(), ScheduleError> {
    if pp == 0 {
        return Err(ScheduleError::NoRanks);
    }
    if v == 0 {
        return Err(ScheduleError::NoVirtualStages);
    }
    Ok(())
}

/// The schedule families this crate generates, plus `Custom` for hand-written or loaded ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward, after a warm-up.
    OneFOneB,
    /// Megatron's interleaved 1F1B over `v` looped stages per rank.
    Interleaved1F1B,
    /// Zero-bubble H1: 1F1B with the backward split and weight gradients deferred.
    ZbH1,
    /// Zero-bubble V: two stages per rank in V order, split backward.
    Zbv,
    /// DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab): two stages per rank in V
    /// order, a forward of one stage paired with a backward of the other in the steady state,
    /// the backward split at the ends.
    DualPipeV,
    /// Anything else.
    Custom,
}

impl ScheduleKind {
    /// Every family [`crate::generators::generate`] makes (all but `Custom`).
    ///
    /// ```
    /// use burn_pipeline::{ScheduleKind, generators::generate};
    /// for kind in ScheduleKind::GENERATED {
    ///     assert_eq!(generate(kind, 2, 4, None).unwrap().kind(), kind);
    /// }
    /// ```
    pub const GENERATED: [ScheduleKind; 6] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbH1,
        ScheduleKind::Zbv,
        ScheduleKind::DualPipeV,
    ];

    /// The name used on command lines and in files.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::Zbv => "zbv",
            ScheduleKind::DualPipeV => "dualpipev",
            ScheduleKind::Custom => "custom",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name.trim().to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved-1f1b" | "interleaved1f1b" => {
                Ok(ScheduleKind::Interleaved1F1B)
            }
            "zb-h1" | "zbh1" => Ok(ScheduleKind::ZbH1),
            "zbv" | "zb-v" => Ok(ScheduleKind::Zbv),
            "dualpipev" | "dualpipe-v" => Ok(ScheduleKind::DualPipeV),
            "custom" => Ok(ScheduleKind::Custom),
            _ => Err(ScheduleError::UnknownKind {
                name: name.to_string(),
            }),
        }
    }
}

// A schedule kind reads and writes as its command-line name (`"zbv"`), in TOML and JSON alike.
impl serde::Serialize for ScheduleKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for ScheduleKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// A pipeline schedule: one ordered program of actions per rank, and the stage placement.
///
/// Build one with a generator ([`crate::generators`]), by hand with [`Schedule::new`], or by
/// loading a file ([`crate::format`]); check it with [`Schedule::validate`] before running it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    kind: ScheduleKind,
    placement: Placement,
    num_microbatches: usize,
    programs: Vec<Vec<Action>>,
}

impl Schedule {
    /// Assembles a schedule from per-rank programs (no validation beyond sizes: call
    /// [`Schedule::validate`]).
    ///
    /// # Arguments
    /// * `kind` - the family it belongs to ([`ScheduleKind::Custom`] for hand-made ones).
    /// * `placement` - which rank owns which stage.
    /// * `num_microbatches` - micro-batches per step.
    /// * `programs` - `programs[r]` is rank `r`'s ordered action list.
    ///
    /// # Errors
    /// [`ScheduleError::NoMicrobatches`], or [`ScheduleError::ProgramCount`] when
    /// `programs.len()` differs from the placement's rank count.
    pub fn new(
        kind: ScheduleKind,
        placement: Placement,
        num_microbatches: usize,
        programs: Vec<Vec<Action>>,
    ) -> Result<Self, ScheduleError> {
        if num_microbatches == 0 {
            return Err(ScheduleError::NoMicrobatches);
        }
        if programs.len() != placement.num_ranks() {
            return Err(ScheduleError::ProgramCount {
                programs: programs.len(),
                ranks: placement.num_ranks(),
            });
        }
        Ok(Self {
            kind,
            placement,
            num_microbatches,
            programs,
        })
    }

    /// Builds a schedule from computation-only programs by inserting the communication: a
    /// send right after every action that produces a tensor for a stage on another rank, and
    /// the matching receive right before the first action that consumes it. Stages on the
    /// same rank hand tensors over without communication.
    ///
    /// # Arguments
    /// As [`Schedule::new`]; `compute` must contain only computation actions (any send or
    /// receive in it is dropped and regenerated).
    ///
    /// # Errors
    /// As [`Schedule::new`].
    pub fn with_communication(
        kind: ScheduleKind,
        placement: Placement,
        num_microbatches: usize,
        compute: Vec<Vec<Action>>,
    ) -> Result<Self, ScheduleError> {
        let num_stages = placement.num_stages();
        let programs = compute
            .iter()
            .enumerate()
            .map(|(rank, actions)| {
                let remote = |stage: usize| placement.rank_of(stage).is_some_and(|r| r != rank);
                let mut out = Vec::with_capacity(actions.len() * 2);
                for action in actions.iter().filter(|a| a.is_compute()) {
                    match *action {
                        Action::Forward { stage, microbatch } => {
                            if stage > 0 && remote(stage - 1) {
                                out.push(Action::RecvActivation {
                                    stage,
                                    from: stage - 1,
                                    microbatch,
                                });
                            }
                            out.push(*action);
                            if stage + 1 < num_stages && remote(stage + 1) {
                                out.push(Action::SendActivation {
                                    stage,
                                    to: stage + 1,
                                    microbatch,
                                });
                            }
                        }
                        Action::Backward { stage, microbatch }
                        | Action::BackwardInput { stage, microbatch } => {
                            if stage + 1 < num_stages && remote(stage + 1) {
                                out.push(Action::RecvGrad {
                                    stage,
                                    from: stage + 1,
                                    microbatch,
                                });
                            }
                            out.push(*action);
                            if stage > 0 && remote(stage - 1) {
                                out.push(Action::SendGrad {
                                    stage,
                                    to: stage - 1,
                                    microbatch,
                                });
                            }
                        }
                        Action::BackwardWeight { .. } | Action::ReduceGrads { .. } => {
                            out.push(*action)
                        }
                        Action::SendActivation { .. }
                        | Action::RecvActivation { .. }
                        | Action::SendGrad { .. }
                        | Action::RecvGrad { .. } => {}
                    }
                }
                out
            })
            .collect();
        Schedule::new(kind, placement, num_microbatches, programs)
    }

    /// The schedule family.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// The stage placement.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Number of pipeline ranks.
    pub fn num_ranks(&self) -> usize {
        self.placement.num_ranks()
    }

    /// Number of stages.
    pub fn num_stages(&self) -> usize {
        self.placement.num_stages()
    }

    /// Micro-batches per step.
    pub fn num_microbatches(&self) -> usize {
        self.num_microbatches
    }

    /// Rank `rank`'s program (empty when the rank does not exist).
    pub fn program(&self, rank: usize) -> &[Action] {
        self.programs.get(rank).map(Vec::as_slice).unwrap_or(&[])
    }

    /// All programs, indexed by rank.
    pub fn programs(&self) -> &[Vec<Action>] {
        &self.programs
    }

    /// The programs with the communication removed.
    pub fn compute_programs(&self) -> Vec<Vec<Action>> {
        self.programs
            .iter()
            .map(|p| p.iter().copied().filter(Action::is_compute).collect())
            .collect()
    }

    /// Whether the schedule splits backwards into `I` and `W`.
    pub fn splits_backward(&self) -> bool {
        self.programs
            .iter()
            .flatten()
            .any(|a| a.kind() == ActionKind::BackwardInput)
    }

    /// A stable 64-bit fingerprint (FNV-1a over the compact text of placement, micro-batch
    /// count and every program), for ranks to compare before running: two ranks holding
    /// different schedules must refuse to start.
    pub fn fingerprint(&self) -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut feed = |bytes: &[u8]| {
            for &b in bytes {
                hash ^= u64::from(b);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        feed(format!("m={};", self.num_microbatches).as_bytes());
        for r in &self.placement.stage_to_rank {
            feed(format!("{r},").as_bytes());
        }
        for program in &self.programs {
            feed(b"|");
            for action in program {
                feed(action.to_string().as_bytes());
                feed(b" ");
            }
        }
        hash
    }

    /// The same schedule with each rank's receives from every other rank in the order that
    /// rank sends them: a receive wanted before one its sender sent earlier takes that earlier
    /// one first (moved up from its own place, which it leaves). The runtime runs this form:
    /// NCCL matches the device messages of one direction between two ranks in the order they
    /// were sent. Schedules already in that order are returned unchanged (GPipe's, 1F1B's,
    /// interleaved 1F1B's and ZB-H1's; not ZBV's, nor DualPipeV's beyond two ranks). Under eager sends receiving earlier never waits longer (what
    /// it takes left its sender before what it wanted), and [`Schedule::validate`] checks the
    /// result again. A receive with no matching send is left in place for the validator.
    ///
    /// ```
    /// use burn_pipeline::generators::{one_f_one_b, zbv};
    ///
    /// let s = one_f_one_b(2, 4).unwrap();
    /// assert_eq!(s.with_receives_in_send_order(), s);
    /// let v = zbv(2, 4).unwrap().with_receives_in_send_order();
    /// assert!(v.validate().is_ok());
    /// ```
    pub fn with_receives_in_send_order(&self) -> Schedule {
        let placement = &self.placement;
        let programs = self
            .programs
            .iter()
            .enumerate()
            .map(|(rank, program)| {
                // What each other rank sends this one, in its order.
                let mut sent: HashMap<usize, VecDeque<Transfer>> = HashMap::new();
                for (peer, theirs) in self.programs.iter().enumerate() {
                    let sends = theirs.iter().filter(|a| a.is_send());
                    for t in sends.filter_map(Action::transfer) {
                        if peer != rank && placement.rank_of(t.to) == Some(rank) {
                            sent.entry(peer).or_default().push_back(t);
                        }
                    }
                }
                let mut ahead: HashSet<Transfer> = HashSet::new();
                let mut out = Vec::with_capacity(program.len());
                for action in program {
                    let Some(wanted) = action.transfer().filter(|_| action.is_recv()) else {
                        out.push(*action);
                        continue;
                    };
                    if ahead.remove(&wanted) {
                        continue; // received ahead, where an earlier receive wanted it
                    }
                    let queue = placement
                        .rank_of(wanted.from)
                        .and_then(|peer| sent.get_mut(&peer))
                        .filter(|queue| queue.contains(&wanted));
                    let Some(queue) = queue else {
                        out.push(*action);
                        continue;
                    };
                    while let Some(next) = queue.pop_front() {
                        out.push(Action::receive(next));
                        if next == wanted {
                            break;
                        }
                        ahead.insert(next);
                    }
                }
                out
            })
            .collect();
        Schedule {
            programs,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_text_round_trips() {
        let actions = [
            Action::Forward {
                stage: 0,
                microbatch: 3,
            },
            Action::Backward {
                stage: 12,
                microbatch: 0,
            },
            Action::BackwardInput {
                stage: 1,
                microbatch: 2,
            },
            Action::BackwardWeight {
                stage: 1,
                microbatch: 2,
            },
            Action::SendActivation {
                stage: 1,
                to: 2,
                microbatch: 3,
            },
            Action::RecvActivation {
                stage: 2,
                from: 1,
                microbatch: 3,
            },
            Action::SendGrad {
                stage: 2,
                to: 1,
                microbatch: 3,
            },
            Action::RecvGrad {
                stage: 1,
                from: 2,
                microbatch: 3,
            },
            Action::ReduceGrads { stage: 4 },
        ];
        for a in actions {
            let text = a.to_string();
            assert_eq!(text.parse::<Action>().unwrap(), a, "{text}");
        }
        assert_eq!(actions[4].to_string(), "SEND_F(1->2,m3)");
        assert_eq!(actions[5].to_string(), "RECV_F(1->2,m3)");
        assert_eq!(actions[4].transfer(), actions[5].transfer());
        assert_eq!(actions[6].transfer(), actions[7].transfer());
        assert_ne!(actions[4].transfer(), actions[6].transfer());
    }

    #[test]
    fn bad_tokens_are_rejected_with_the_reason() {
        for bad in [
            "",
            "F3",
            "0X3",
            "0F",
            "SEND_F(1->2,3)",
            "SEND_F(1-2,m3)",
            "PUT(1->2,m3)",
            "REDUCE(x)",
            "SEND_F(1->2,m3",
        ] {
            let err = bad.parse::<Action>().unwrap_err();
            assert!(err.to_string().contains("cannot parse"), "{err}");
        }
    }

    #[test]
    fn placements() {
        let v = Placement::v_shape(4, 2).unwrap();
        assert_eq!(v.stage_to_rank(), &[0, 1, 2, 3, 3, 2, 1, 0]);
        assert_eq!(v.stages_of(1), vec![1, 6]);
        let l = Placement::looped(2, 3).unwrap();
        assert_eq!(l.stage_to_rank(), &[0, 1, 0, 1, 0, 1]);
        assert_eq!(
            Placement::custom(2, vec![0, 1, 1, 0]).unwrap().style(),
            PlacementStyle::V
        );
        assert_eq!(
            Placement::custom(3, vec![0, 1, 1]),
            Err(ScheduleError::IdleRank { rank: 2 })
        );
    }

    #[test]
    fn tags_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for payload in [Payload::Activation, Payload::Grad] {
            for from in 0..4 {
                for to in 0..4 {
                    for microbatch in 0..5 {
                        let t = Transfer {
                            payload,
                            from,
                            to,
                            microbatch,
                        };
                        assert!(seen.insert(t.tag(4, 5)));
                    }
                }
            }
        }
    }
}
