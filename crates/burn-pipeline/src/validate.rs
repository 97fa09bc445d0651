//! Proves, before anything runs, that a [`Schedule`] is complete, that every dependency is
//! met, that every send has exactly one matching receive, and that the rank programs cannot
//! deadlock.
//!
//! The checks run in this order and stop at the first error:
//!
//! 1. **Well-formed**: every stage and micro-batch index is in range, every action sits on
//!    the rank that owns its stage, a send or receive names the neighbouring stage in the
//!    right direction (activations go `s -> s + 1`, gradients `s -> s - 1`) and that
//!    neighbour lives on another rank (stages on the same rank hand tensors over without
//!    communication).
//! 2. **No duplicates**, and no micro-batch of a stage uses both a full backward `B` and the
//!    split `I`/`W`.
//! 3. **Complete**: every (stage, micro-batch) has a forward and either `B` or both `I` and
//!    `W`; every stage has one `REDUCE`.
//! 4. **Local dependencies**, rank by rank in program order: `F` of stage `s` comes after `F`
//!    of `s - 1` (same rank) or after receiving that activation; `B`/`I` after the stage's
//!    own `F` and after the gradient from `s + 1` (local `B`/`I`, or its receive); `W` after
//!    `I`; a send after the action producing its tensor; `REDUCE(s)` after every `B`/`W` of
//!    `s`, and no computation of `s` after it.
//! 5. **Matching**: every send has a receive of the same [`Transfer`] on the peer's rank,
//!    and every receive a send.
//! 6. **No deadlock**: the rank programs are executed abstractly under a [`CommModel`]; if
//!    every unfinished rank is blocked, the error lists each one with the action it is stuck
//!    on and what it waits for.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::schedule::{Action, Schedule, Transfer};

/// The point-to-point semantics the deadlock check assumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommModel {
    /// A send hands its message over and returns at once; a receive blocks until the
    /// matching message has been sent. This is what `burn-parallel`'s transports do
    /// (`send` "returns without waiting for the receiver"), and what NCCL gives with
    /// non-blocking `isend` + `irecv` pairs.
    Eager,
    /// A send blocks until the peer reaches the matching receive, and both then proceed
    /// together (blocking NCCL/MPI `send` for large messages). Strictly harder: a schedule
    /// that passes under `Rendezvous` also passes under `Eager`. The generated schedules put
    /// a send right after its producer, so 1F1B-style steady states, where neighbours send to
    /// each other at the same time, need `Eager`.
    Rendezvous,
}

impl fmt::Display for CommModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommModel::Eager => f.write_str("eager sends"),
            CommModel::Rendezvous => f.write_str("rendezvous sends"),
        }
    }
}

/// One rank stuck in a deadlock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// The rank.
    pub rank: usize,
    /// Index of the action it is stuck on, in its program.
    pub index: usize,
    /// That action.
    pub action: Action,
    /// What it waits for, in words.
    pub waiting_for: String,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} at action #{} `{}` waits for {}",
            self.rank, self.index, self.action, self.waiting_for
        )
    }
}

fn list_blocked(blocked: &[Blocked]) -> String {
    blocked
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why a schedule is unsafe to run. Every variant names the rank, the action (and its index
/// in that rank's program) and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// A stage index beyond the placement.
    #[error(
        "rank {rank}, action #{index} `{action}`: stage {stage} does not exist (the placement \
         has {num_stages} stages)"
    )]
    StageOutOfRange {
        /// Rank whose program holds the action.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// The bad stage (local or peer).
        stage: usize,
        /// Stages in the placement.
        num_stages: usize,
    },
    /// A micro-batch index beyond the schedule's count.
    #[error(
        "rank {rank}, action #{index} `{action}`: micro-batch {microbatch} does not exist (the \
         schedule has {num_microbatches})"
    )]
    MicrobatchOutOfRange {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// The bad micro-batch.
        microbatch: usize,
        /// Micro-batches in the schedule.
        num_microbatches: usize,
    },
    /// An action for a stage that another rank owns.
    #[error(
        "rank {rank}, action #{index} `{action}`: stage {stage} lives on rank {owner}; move the \
         action to rank {owner}'s program"
    )]
    WrongRank {
        /// Rank whose program holds the action.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// Its local stage.
        stage: usize,
        /// The rank that owns the stage.
        owner: usize,
    },
    /// A send or receive whose peer is not the neighbouring stage in the data's direction.
    #[error(
        "rank {rank}, action #{index} `{action}`: activations flow from stage s to s + 1 and \
         gradients from s to s - 1; this transfer goes elsewhere"
    )]
    NotAdjacent {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
    },
    /// A send or receive between two stages on the same rank.
    #[error(
        "rank {rank}, action #{index} `{action}`: both stages live on rank {rank}, which hands \
         the tensor over without communication; remove the action"
    )]
    SameRankTransfer {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
    },
    /// The same action twice.
    #[error(
        "rank {rank}, action #{index} `{action}` appears twice (first at action #{first_index}); \
         remove one"
    )]
    Duplicate {
        /// Rank.
        rank: usize,
        /// Index of the second occurrence.
        index: usize,
        /// The action.
        action: Action,
        /// Index of the first occurrence.
        first_index: usize,
    },
    /// A micro-batch of a stage has both a full backward and split backward parts.
    #[error(
        "rank {rank}, action #{index} `{action}`: stage {stage} micro-batch {microbatch} mixes a \
         full backward B with the split I/W; use one or the other"
    )]
    MixedBackward {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// Stage.
        stage: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Something a complete step needs is absent.
    #[error(
        "rank {rank} (owner of stage {stage}) never runs {what}; add it to rank {rank}'s program"
    )]
    Incomplete {
        /// The owning rank.
        rank: usize,
        /// The stage.
        stage: usize,
        /// What is missing, in words.
        what: String,
    },
    /// An action whose input is not available at that point of its rank's program.
    #[error("rank {rank}, action #{index} `{action}` runs before {missing}")]
    MissingDependency {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// What must come first, in words.
        missing: String,
    },
    /// Computation of a stage after its gradients were reduced.
    #[error(
        "rank {rank}, action #{index} `{action}` comes after REDUCE({stage}) at action \
         #{reduce_index}; the reduction must follow the stage's last backward"
    )]
    AfterReduce {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// The stage.
        stage: usize,
        /// Where the reduction is.
        reduce_index: usize,
    },
    /// A send nobody receives.
    #[error(
        "rank {rank}, action #{index} `{action}`: rank {peer_rank} never receives this {transfer}; \
         add the matching receive there"
    )]
    UnmatchedSend {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// The rank that should receive.
        peer_rank: usize,
        /// The tensor.
        transfer: Transfer,
    },
    /// A receive nobody sends.
    #[error(
        "rank {rank}, action #{index} `{action}`: rank {peer_rank} never sends this {transfer}; \
         add the matching send there"
    )]
    UnmatchedRecv {
        /// Rank.
        rank: usize,
        /// Index in the program.
        index: usize,
        /// The action.
        action: Action,
        /// The rank that should send.
        peer_rank: usize,
        /// The tensor.
        transfer: Transfer,
    },
    /// Every unfinished rank waits on another: the schedule would hang.
    #[error("deadlock under {model}: {}", list_blocked(blocked))]
    Deadlock {
        /// The communication model simulated.
        model: CommModel,
        /// Each stuck rank, in rank order.
        blocked: Vec<Blocked>,
    },
}

impl ValidationError {
    /// The `(rank, index)` of the offending action, for
    /// [`crate::format::render_programs`]; for a deadlock, the first stuck rank's action;
    /// `None` for a missing action ([`ValidationError::Incomplete`]).
    pub fn location(&self) -> Option<(usize, usize)> {
        match self {
            ValidationError::StageOutOfRange { rank, index, .. }
            | ValidationError::MicrobatchOutOfRange { rank, index, .. }
            | ValidationError::WrongRank { rank, index, .. }
            | ValidationError::NotAdjacent { rank, index, .. }
            | ValidationError::SameRankTransfer { rank, index, .. }
            | ValidationError::Duplicate { rank, index, .. }
            | ValidationError::MixedBackward { rank, index, .. }
            | ValidationError::MissingDependency { rank, index, .. }
            | ValidationError::AfterReduce { rank, index, .. }
            | ValidationError::UnmatchedSend { rank, index, .. }
            | ValidationError::UnmatchedRecv { rank, index, .. } => Some((*rank, *index)),
            ValidationError::Deadlock { blocked, .. } => blocked.first().map(|b| (b.rank, b.index)),
            ValidationError::Incomplete { .. } => None,
        }
    }
}

// Defined here, with the checks, rather than in `crate::schedule`: the schedule types sit below
// their validation.
impl Schedule {
    /// Checks the schedule (see [`validate`]) under the eager-send model of this suite's
    /// transports.
    ///
    /// # Errors
    /// The first [`ValidationError`] found.
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate(self, CommModel::Eager)
    }
}

/// Checks `schedule` and proves it cannot deadlock under `model` (see the module docs for
/// the list of checks).
///
/// # Arguments
/// * `schedule` - the schedule to check.
/// * `model` - the send/receive semantics of the transport that will run it.
///
/// # Returns
/// `Ok(())` when every check passes.
///
/// # Errors
/// The first [`ValidationError`] found.
///
/// # Example
/// ```
/// use burn_pipeline::generators::one_f_one_b;
/// use burn_pipeline::validate::{validate, CommModel};
///
/// let schedule = one_f_one_b(4, 8).unwrap();
/// validate(&schedule, CommModel::Eager).unwrap();
/// ```
pub fn validate(schedule: &Schedule, model: CommModel) -> Result<(), ValidationError> {
    check_well_formed(schedule)?;
    check_unique(schedule)?;
    check_complete(schedule)?;
    check_local_dependencies(schedule)?;
    check_matching(schedule)?;
    check_deadlock(schedule, model)
}

fn check_well_formed(schedule: &Schedule) -> Result<(), ValidationError> {
    let placement = schedule.placement();
    let num_stages = placement.num_stages();
    let num_microbatches = schedule.num_microbatches();
    for (rank, program) in schedule.programs().iter().enumerate() {
        for (index, &action) in program.iter().enumerate() {
            let stage = action.stage();
            for s in std::iter::once(stage).chain(action.peer_stage()) {
                if s >= num_stages {
                    return Err(ValidationError::StageOutOfRange {
                        rank,
                        index,
                        action,
                        stage: s,
                        num_stages,
                    });
                }
            }
            if let Some(microbatch) = action.microbatch()
                && microbatch >= num_microbatches
            {
                return Err(ValidationError::MicrobatchOutOfRange {
                    rank,
                    index,
                    action,
                    microbatch,
                    num_microbatches,
                });
            }
            let owner = placement.rank_of(stage).unwrap_or(usize::MAX);
            if owner != rank {
                return Err(ValidationError::WrongRank {
                    rank,
                    index,
                    action,
                    stage,
                    owner,
                });
            }
            if let Some(peer) = action.peer_stage() {
                let adjacent = match action {
                    Action::SendActivation { .. } => peer == stage + 1,
                    Action::RecvActivation { .. } => peer + 1 == stage,
                    Action::SendGrad { .. } => peer + 1 == stage,
                    Action::RecvGrad { .. } => peer == stage + 1,
                    Action::Forward { .. }
                    | Action::Backward { .. }
                    | Action::BackwardInput { .. }
                    | Action::BackwardWeight { .. }
                    | Action::ReduceGrads { .. } => true,
                };
                if !adjacent {
                    return Err(ValidationError::NotAdjacent {
                        rank,
                        index,
                        action,
                    });
                }
                if placement.rank_of(peer) == Some(rank) {
                    return Err(ValidationError::SameRankTransfer {
                        rank,
                        index,
                        action,
                    });
                }
            }
        }
    }
    Ok(())
}

fn check_unique(schedule: &Schedule) -> Result<(), ValidationError> {
    // Every action lives on its stage's owner (checked before), so duplicates and mixed
    // backwards can only occur within one rank's program.
    for (rank, program) in schedule.programs().iter().enumerate() {
        let mut seen: HashMap<Action, usize> = HashMap::new();
        let mut full: HashSet<(usize, usize)> = HashSet::new();
        let mut split: HashSet<(usize, usize)> = HashSet::new();
        for (index, &action) in program.iter().enumerate() {
            if let Some(&first_index) = seen.get(&action) {
                return Err(ValidationError::Duplicate {
                    rank,
                    index,
                    action,
                    first_index,
                });
            }
            seen.insert(action, index);
            let (mixed, stage, microbatch) = match action {
                Action::Backward { stage, microbatch } => {
                    full.insert((stage, microbatch));
                    (split.contains(&(stage, microbatch)), stage, microbatch)
                }
                Action::BackwardInput { stage, microbatch }
                | Action::BackwardWeight { stage, microbatch } => {
                    split.insert((stage, microbatch));
                    (full.contains(&(stage, microbatch)), stage, microbatch)
                }
                Action::Forward { .. }
                | Action::SendActivation { .. }
                | Action::RecvActivation { .. }
                | Action::SendGrad { .. }
                | Action::RecvGrad { .. }
                | Action::ReduceGrads { .. } => (false, 0, 0),
            };
            if mixed {
                return Err(ValidationError::MixedBackward {
                    rank,
                    index,
                    action,
                    stage,
                    microbatch,
                });
            }
        }
    }
    Ok(())
}

fn check_complete(schedule: &Schedule) -> Result<(), ValidationError> {
    let placement = schedule.placement();
    for stage in 0..placement.num_stages() {
        let rank = placement.rank_of(stage).unwrap_or(0);
        let program: HashSet<Action> = schedule.program(rank).iter().copied().collect();
        let incomplete = |what: String| ValidationError::Incomplete { rank, stage, what };
        for microbatch in 0..schedule.num_microbatches() {
            let has = |a: Action| program.contains(&a);
            if !has(Action::Forward { stage, microbatch }) {
                return Err(incomplete(format!(
                    "the forward of micro-batch {microbatch} (`{stage}F{microbatch}`)"
                )));
            }
            let full = has(Action::Backward { stage, microbatch });
            let input = has(Action::BackwardInput { stage, microbatch });
            let weight = has(Action::BackwardWeight { stage, microbatch });
            if !full && !input && !weight {
                return Err(incomplete(format!(
                    "a backward of micro-batch {microbatch} (`{stage}B{microbatch}`, or \
                     `{stage}I{microbatch}` and `{stage}W{microbatch}`)"
                )));
            }
            if input && !weight {
                return Err(incomplete(format!(
                    "the weight-gradient backward of micro-batch {microbatch} \
                     (`{stage}W{microbatch}`)"
                )));
            }
            if weight && !input {
                return Err(incomplete(format!(
                    "the input-gradient backward of micro-batch {microbatch} \
                     (`{stage}I{microbatch}`)"
                )));
            }
        }
        if !program.contains(&Action::ReduceGrads { stage }) {
            return Err(incomplete(format!(
                "the gradient reduction `REDUCE({stage})` after its last backward"
            )));
        }
    }
    Ok(())
}

/// What one rank holds at a point of its program.
#[derive(Default)]
struct Local {
    forward: HashSet<(usize, usize)>,
    /// Input gradient computed (`B` or `I`).
    input_grad: HashSet<(usize, usize)>,
    /// Weight gradient computed (`B` or `W`).
    weight_grad: HashSet<(usize, usize)>,
    input_only: HashSet<(usize, usize)>,
    received: HashSet<Transfer>,
    reduced: HashMap<usize, usize>,
}

fn check_local_dependencies(schedule: &Schedule) -> Result<(), ValidationError> {
    let placement = schedule.placement();
    let last = placement.num_stages() - 1;
    for (rank, program) in schedule.programs().iter().enumerate() {
        let local_stage = |s: usize| placement.rank_of(s) == Some(rank);
        let mut st = Local::default();
        for (index, &action) in program.iter().enumerate() {
            let missing = |missing: String| ValidationError::MissingDependency {
                rank,
                index,
                action,
                missing,
            };
            if action.kind() != crate::schedule::ActionKind::ReduceGrads
                && action.is_compute()
                && let Some(&reduce_index) = st.reduced.get(&action.stage())
            {
                return Err(ValidationError::AfterReduce {
                    rank,
                    index,
                    action,
                    stage: action.stage(),
                    reduce_index,
                });
            }
            match action {
                Action::Forward { stage, microbatch } => {
                    if stage > 0 {
                        let prev = stage - 1;
                        if local_stage(prev) {
                            if !st.forward.contains(&(prev, microbatch)) {
                                return Err(missing(format!(
                                    "the forward of stage {prev} for micro-batch {microbatch} \
                                     (`{prev}F{microbatch}`, same rank) that produces its input"
                                )));
                            }
                        } else if !st.received.contains(&Transfer {
                            payload: crate::schedule::Payload::Activation,
                            from: prev,
                            to: stage,
                            microbatch,
                        }) {
                            return Err(missing(format!(
                                "receiving its input activation \
                                 (`RECV_F({prev}->{stage},m{microbatch})`)"
                            )));
                        }
                    }
                    st.forward.insert((stage, microbatch));
                }
                Action::Backward { stage, microbatch }
                | Action::BackwardInput { stage, microbatch } => {
                    if !st.forward.contains(&(stage, microbatch)) {
                        return Err(missing(format!(
                            "the forward it differentiates (`{stage}F{microbatch}`)"
                        )));
                    }
                    if stage < last {
                        let next = stage + 1;
                        if local_stage(next) {
                            if !st.input_grad.contains(&(next, microbatch)) {
                                return Err(missing(format!(
                                    "the backward of stage {next} for micro-batch {microbatch} \
                                     (`{next}B{microbatch}` or `{next}I{microbatch}`, same rank) \
                                     that produces its output gradient"
                                )));
                            }
                        } else if !st.received.contains(&Transfer {
                            payload: crate::schedule::Payload::Grad,
                            from: next,
                            to: stage,
                            microbatch,
                        }) {
                            return Err(missing(format!(
                                "receiving its output gradient \
                                 (`RECV_B({next}->{stage},m{microbatch})`)"
                            )));
                        }
                    }
                    st.input_grad.insert((stage, microbatch));
                    if matches!(action, Action::Backward { .. }) {
                        st.weight_grad.insert((stage, microbatch));
                    } else {
                        st.input_only.insert((stage, microbatch));
                    }
                }
                Action::BackwardWeight { stage, microbatch } => {
                    if !st.input_only.contains(&(stage, microbatch)) {
                        return Err(missing(format!(
                            "the input-gradient backward `{stage}I{microbatch}` whose saved \
                             inputs it uses"
                        )));
                    }
                    st.weight_grad.insert((stage, microbatch));
                }
                Action::SendActivation {
                    stage, microbatch, ..
                } => {
                    if !st.forward.contains(&(stage, microbatch)) {
                        return Err(missing(format!(
                            "the forward that produces the activation (`{stage}F{microbatch}`)"
                        )));
                    }
                }
                Action::SendGrad {
                    stage, microbatch, ..
                } => {
                    if !st.input_grad.contains(&(stage, microbatch)) {
                        return Err(missing(format!(
                            "the backward that produces the gradient (`{stage}B{microbatch}` or \
                             `{stage}I{microbatch}`)"
                        )));
                    }
                }
                Action::RecvActivation { .. } | Action::RecvGrad { .. } => {
                    if let Some(t) = action.transfer() {
                        st.received.insert(t);
                    }
                }
                Action::ReduceGrads { stage } => {
                    if let Some(microbatch) = (0..schedule.num_microbatches())
                        .find(|&m| !st.weight_grad.contains(&(stage, m)))
                    {
                        return Err(missing(format!(
                            "the weight gradient of micro-batch {microbatch} \
                             (`{stage}B{microbatch}` or `{stage}W{microbatch}`)"
                        )));
                    }
                    st.reduced.insert(stage, index);
                }
            }
        }
    }
    Ok(())
}

fn check_matching(schedule: &Schedule) -> Result<(), ValidationError> {
    let placement = schedule.placement();
    let mut sends: HashMap<Transfer, (usize, usize, Action)> = HashMap::new();
    let mut recvs: HashMap<Transfer, (usize, usize, Action)> = HashMap::new();
    for (rank, program) in schedule.programs().iter().enumerate() {
        for (index, &action) in program.iter().enumerate() {
            if let Some(t) = action.transfer() {
                let map = if action.is_send() {
                    &mut sends
                } else {
                    &mut recvs
                };
                map.insert(t, (rank, index, action));
            }
        }
    }
    let mut unmatched: Vec<ValidationError> = Vec::new();
    for (t, &(rank, index, action)) in &sends {
        if !recvs.contains_key(t) {
            unmatched.push(ValidationError::UnmatchedSend {
                rank,
                index,
                action,
                peer_rank: placement.rank_of(t.to).unwrap_or(0),
                transfer: *t,
            });
        }
    }
    for (t, &(rank, index, action)) in &recvs {
        if !sends.contains_key(t) {
            unmatched.push(ValidationError::UnmatchedRecv {
                rank,
                index,
                action,
                peer_rank: placement.rank_of(t.from).unwrap_or(0),
                transfer: *t,
            });
        }
    }
    // Report the earliest one (by rank, then position) so the error is deterministic.
    let position = |e: &ValidationError| match e {
        ValidationError::UnmatchedSend { rank, index, .. }
        | ValidationError::UnmatchedRecv { rank, index, .. } => (*rank, *index),
        _ => (usize::MAX, usize::MAX),
    };
    unmatched.sort_by_key(position);
    match unmatched.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn check_deadlock(schedule: &Schedule, model: CommModel) -> Result<(), ValidationError> {
    let programs = schedule.programs();
    let placement = schedule.placement();
    let ranks = programs.len();
    let mut pc = vec![0usize; ranks];
    let mut sent: HashSet<Transfer> = HashSet::new();
    loop {
        let mut progress = false;
        for rank in 0..ranks {
            while let Some(&action) = programs[rank].get(pc[rank]) {
                match (action.transfer(), model) {
                    (None, _) => {}
                    (Some(t), CommModel::Eager) => {
                        if action.is_send() {
                            sent.insert(t);
                        } else if !sent.contains(&t) {
                            break;
                        }
                    }
                    (Some(t), CommModel::Rendezvous) => {
                        if !action.is_send() {
                            // Receives advance together with their sender.
                            break;
                        }
                        let peer = placement.rank_of(t.to).unwrap_or(0);
                        let waiting = programs[peer]
                            .get(pc[peer])
                            .is_some_and(|a| a.is_recv() && a.transfer() == Some(t));
                        if !waiting {
                            break;
                        }
                        pc[peer] += 1;
                    }
                }
                pc[rank] += 1;
                progress = true;
            }
        }
        if (0..ranks).all(|r| pc[r] == programs[r].len()) {
            return Ok(());
        }
        if !progress {
            let blocked = (0..ranks)
                .filter(|&r| pc[r] < programs[r].len())
                .map(|rank| {
                    let index = pc[rank];
                    let action = programs[rank][index];
                    let t = action.transfer().expect("only communication blocks");
                    let peer = if action.is_send() {
                        placement.rank_of(t.to)
                    } else {
                        placement.rank_of(t.from)
                    }
                    .unwrap_or(0);
                    let peer_state = match programs[peer].get(pc[peer]) {
                        Some(a) => format!("rank {peer} is stuck at action #{} `{a}`", pc[peer]),
                        None => format!("rank {peer} has finished its program"),
                    };
                    let waiting_for = if action.is_send() {
                        format!("rank {peer} to reach the matching receive, but {peer_state}")
                    } else {
                        format!("rank {peer} to send this {t}, but {peer_state}")
                    };
                    Blocked {
                        rank,
                        index,
                        action,
                        waiting_for,
                    }
                })
                .collect();
            return Err(ValidationError::Deadlock { model, blocked });
        }
    }
}
