//! Fault-tolerant data parallelism: data-parallel replicas that agree at every step on who is
//! alive, finish the step without a lost one, and take a restarted one back from a live peer.
//!
//! The world is cut into `R` *replicas* of `S` consecutive ranks each (a single rank under DDP;
//! the FSDP or tensor-parallel ranks of one replica under HSDP). Each replica trains its layout
//! on its own ranks ([`Replicas::island`]); what crosses replicas is one exchange per optimizer
//! step, [`Replicas::average`], in place of the data-parallel all-reduce: the ranks at the same
//! position in the live replicas average their (flattened) gradients, the loss riding along.
//!
//! # The exchange
//!
//! 1. *data*: a direct reduce-scatter and all-gather by point-to-point messages among the live
//!    replicas (as many bytes as a ring all-reduce, `2 (R − 1) / R` of the gradient per rank,
//!    but every wait is on the rank that owns the data, so a dead replica ends only the waits
//!    on itself). Chunk `k` is summed by the `k`-th live replica in replica order and sent to
//!    the others: every survivor holds the same bits.
//! 2. *agreement* (the replicas' first ranks, then a broadcast inside each replica): each sends
//!    its vote (its replica's data round completed, a stop asked, the replicas asking to join,
//!    a digest of its parameters when due) to every live replica, then the set of replicas it
//!    heard from; the replicas *agreed* are those every set received contains
//!    (`agree`, the same round that DiLoCo's dropped islands use).
//! 3. When every live replica is agreed and every vote says its data round completed, the step
//!    commits. Otherwise the live set becomes the agreed one and the exchange runs again on
//!    the same local gradients: the survivors finish the step without the lost replica, its
//!    rows of the batch missing from the average (a line on stderr says which).
//!
//! This agrees on every survivor when at most one replica fails during one exchange (a replica
//! that fails after its vote reached everyone is still averaged that once). A replica that
//! finds itself left out gets [`CollectiveError::Quorum`]; replicas whose parameters' digests
//! differ (checked every [`Replicas::with_verify_every`] steps) get it too, naming both.
//!
//! # Joining
//!
//! A restarted replica (its ranks' transports rejoined the running world, see
//! [`crate::comm::tcp::TcpConfig::with_rejoin`]) announces itself with [`Replicas::request_join`]
//! to every other replica's first rank. The live replicas admit it at the next exchange where
//! all of them have seen the request ([`Replicas::take_admitted`]); after that step the lowest
//! live replica sends it the training state ([`Replicas::send_state`]: weights, optimizer
//! state, step, loss scale, data position, in the checkpoint format, over the job's own
//! connections), which it receives with [`Replicas::receive_state`], and from the next step on
//! it trains with the others.
//!
//! Failures of another replica's ranks are isolated
//! ([`crate::comm::transport::Mailbox::isolate_failures_of`]); a failure inside this rank's own
//! replica still fails it (its replica is lost, and the others go on).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};

use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;
use crate::replica::Fnv1a;

/// The first tag of the exchanges' messages; each round takes four.
const TAG_BASE: u64 = 1 << 48;
/// A restarted replica's request to join.
const TAG_JOIN: u64 = TAG_BASE - 1;
/// The training state sent to a joining replica.
const TAG_STATE: u64 = TAG_BASE - 2;
/// Exchange attempts over the same live set before giving up (a replica whose messages keep
/// failing without leaving).
const MAX_SAME_ATTEMPTS: usize = 3;

/// What happened to the replicas at one exchange, for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaEvent {
    /// Replicas dropped from the average of exchange `step` (they failed, exited or fell
    /// silent); the survivors finished the step without their rows.
    Lost {
        /// The exchange (the optimizer step, from 0).
        step: u64,
        /// The replicas dropped.
        replicas: Vec<usize>,
        /// The replicas that go on.
        live: Vec<usize>,
    },
    /// Replicas admitted after exchange `step`; they train from the next step on.
    Admitted {
        /// The exchange after which they joined.
        step: u64,
        /// The replicas admitted.
        replicas: Vec<usize>,
    },
}

impl std::fmt::Display for ReplicaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicaEvent::Lost {
                step,
                replicas,
                live,
            } => write!(
                f,
                "step {}: lost replica(s) {replicas:?}; their rows of the batch are left out of \
                 this step; going on with replicas {live:?}",
                step + 1
            ),
            ReplicaEvent::Admitted { step, replicas } => write!(
                f,
                "step {}: replica(s) {replicas:?} rejoined; they receive the state from a live \
                 replica and train from step {} on",
                step + 1,
                step + 2
            ),
        }
    }
}

/// What the quorum of this rank knows, shared by the clones of [`Replicas`].
#[derive(Debug, Default)]
struct State {
    /// The replicas averaged, in order.
    live: Vec<usize>,
    /// Exchange rounds attempted so far (the tags of the next one).
    rounds: u64,
    /// Exchanges committed so far (optimizer steps).
    steps: u64,
    /// This rank asks to stop after the current step.
    stop: bool,
    /// The replicas agreed to stop after the last step.
    stopping: bool,
    /// Joins seen by this replica's first rank, not admitted yet.
    joins: BTreeSet<usize>,
    /// Admitted at the last exchange: the state goes to them after the step.
    admitted: Vec<usize>,
    events: Vec<ReplicaEvent>,
    /// The parameters' digest for the next exchange's vote.
    digest: Option<u64>,
    /// Compare the digests every this many exchanges (0: never).
    verify_every: u64,
    /// The step's loss, averaged over this replica and then over the live replicas by the
    /// gradient exchange ([`crate::train::TrainStep::with_replicas`]).
    loss: Option<f32>,
}

/// The replicas of a fault-tolerant data-parallel job, from one rank's side (see the module
/// documentation). Clones share the quorum's state.
///
/// # Example
/// ```
/// use burn_parallel::fault::Replicas;
/// use burn_parallel::run_local;
///
/// let averaged = run_local(2, |world| {
///     let replicas = Replicas::new(&world, 2)?;
///     let mine = vec![world.rank() as f32; 3];
///     replicas.average(&mine)
/// })
/// .unwrap();
/// assert_eq!(averaged[0], vec![0.5; 3]);
/// assert_eq!(averaged[0], averaged[1]);
/// ```
#[derive(Clone)]
pub struct Replicas {
    world: ProcessGroup,
    /// This rank's replica.
    island: ProcessGroup,
    /// The ranks at this rank's position in every replica (outer rank = replica index).
    outer: ProcessGroup,
    replicas: usize,
    replica: usize,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicas")
            .field("replicas", &self.replicas)
            .field("replica", &self.replica)
            .field("live", &self.live())
            .finish()
    }
}

/// A vote of one replica in an exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Vote {
    ok: bool,
    stop: bool,
    digest: Option<u64>,
    joins: Vec<usize>,
}

impl Vote {
    fn encode(&self) -> Vec<u64> {
        let mut v = vec![
            u64::from(self.ok),
            u64::from(self.stop),
            u64::from(self.digest.is_some()),
            self.digest.unwrap_or(0),
        ];
        v.extend(self.joins.iter().map(|&j| j as u64));
        v
    }

    fn decode(words: &[u64]) -> Option<Self> {
        let [ok, stop, has, digest, joins @ ..] = words else {
            return None;
        };
        Some(Self {
            ok: *ok == 1,
            stop: *stop == 1,
            digest: (*has == 1).then_some(*digest),
            joins: joins.iter().map(|&j| j as usize).collect(),
        })
    }
}

/// What the replicas agreed on in one exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    agreed: Vec<usize>,
    all_ok: bool,
    stop: bool,
    admitted: Vec<usize>,
    /// Replicas whose parameters differ from the first agreed one's: `(first, other)`.
    diverged: Option<(usize, usize)>,
}

impl Outcome {
    fn encode(&self) -> Vec<u64> {
        let mut v = vec![
            u64::from(self.all_ok),
            u64::from(self.stop),
            self.diverged.map_or(u64::MAX, |d| d.0 as u64),
            self.diverged.map_or(u64::MAX, |d| d.1 as u64),
            self.agreed.len() as u64,
        ];
        v.extend(self.agreed.iter().map(|&r| r as u64));
        v.extend(self.admitted.iter().map(|&r| r as u64));
        v
    }

    fn decode(words: &[u64]) -> Option<Self> {
        let [all_ok, stop, d0, d1, n, rest @ ..] = words else {
            return None;
        };
        let n = usize::try_from(*n).ok().filter(|&n| n <= rest.len())?;
        Some(Self {
            all_ok: *all_ok == 1,
            stop: *stop == 1,
            diverged: (*d0 != u64::MAX).then_some((*d0 as usize, *d1 as usize)),
            agreed: rest[..n].iter().map(|&r| r as usize).collect(),
            admitted: rest[n..].iter().map(|&r| r as usize).collect(),
        })
    }
}

/// Whether `e` says that a peer is gone (failed, exited or silent past the deadline): what the
/// quorum survives. Anything else (a mismatch, a bad argument) is a bug and fails the rank.
fn is_lost(e: &CollectiveError) -> bool {
    matches!(
        e,
        CollectiveError::PeerFailed { .. }
            | CollectiveError::Timeout { .. }
            | CollectiveError::Transport { .. }
    )
}

fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}

fn send_words(group: &ProcessGroup, words: &[u64], peer: usize, tag: u64) -> Result<()> {
    group.send_data(TensorData::new(words.to_vec(), [words.len()]), peer, tag)
}

/// The bytes group rank `peer` sent under `tag`, waiting until `deadline` at most.
fn recv_by(group: &ProcessGroup, deadline: Instant, peer: usize, tag: u64) -> Result<Vec<u8>> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let data = group.clone().with_timeout(left).recv_data(peer, tag)?;
    Ok(data.as_bytes().to_vec())
}

/// What each member sent in an agreement round, by member.
pub(crate) type Heard = BTreeMap<usize, Vec<u8>>;

/// The agreement round among `members` (ranks of `group`, this rank among them): each member
/// sends its payload (`mine`: a vote, a pseudo-gradient) under `tag` to every other and
/// waits for theirs until `group`'s timeout, then sends the set of members it heard from
/// under `tag + 1` and waits for the sets of those it heard from. A member that failed or fell
/// silent is not heard from (`lost` says which errors mean that; any other error is
/// returned). Fault-tolerant data parallelism votes with it every step, and DiLoCo's outer
/// exchange with dropped islands averages what it hears.
///
/// # Returns
/// The payloads heard (this rank's own included) and the members agreed: those every set
/// received contains. With at most one member failing during the round, every member that
/// goes on gets the same set.
///
/// # Errors
/// Collective errors that `lost` does not accept.
pub(crate) fn agree(
    group: &ProcessGroup,
    members: &[usize],
    tag: u64,
    mine: Vec<u8>,
    lost: &dyn Fn(&CollectiveError) -> bool,
) -> Result<(Heard, BTreeSet<usize>)> {
    let me = group.rank();
    let others: Vec<usize> = members.iter().copied().filter(|&p| p != me).collect();
    let send = |bytes: &[u8], p: usize, tag: u64| -> Result<()> {
        let data = TensorData::new(bytes.to_vec(), [bytes.len()]);
        match group.send_data(data, p, tag) {
            Err(e) if !lost(&e) => Err(e),
            _ => Ok(()),
        }
    };
    for &p in &others {
        send(&mine, p, tag)?;
    }
    let mut heard = BTreeMap::from([(me, mine)]);
    let deadline = Instant::now() + group.timeout();
    for &p in &others {
        match recv_by(group, deadline, p, tag) {
            Ok(bytes) => {
                heard.insert(p, bytes);
            }
            Err(e) if lost(&e) => {}
            Err(e) => return Err(e),
        }
    }
    let view: Vec<u8> = heard
        .keys()
        .flat_map(|&p| (p as u64).to_le_bytes())
        .collect();
    for &p in &others {
        send(&view, p, tag + 1)?;
    }
    let mut agreed: BTreeSet<usize> = heard.keys().copied().collect();
    let deadline = Instant::now() + group.timeout();
    for &p in heard.keys().filter(|&&p| p != me) {
        match recv_by(group, deadline, p, tag + 1) {
            Ok(bytes) => {
                let theirs = words(&bytes);
                agreed.retain(|r| theirs.contains(&(*r as u64)));
            }
            Err(e) if lost(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((heard, agreed))
}

impl Replicas {
    /// The replicas of `world` cut into `replicas` groups of consecutive ranks; from now on a
    /// failure of another replica's rank ends only the waits on that rank. Every rank calls
    /// it; no communication takes place.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when `replicas` does not divide the world, or for a
    /// backend that cannot survive a lost rank (NCCL, MPI).
    pub fn new(world: &ProcessGroup, replicas: usize) -> Result<Self> {
        let n = world.size();
        if replicas == 0 || !n.is_multiple_of(replicas) {
            return Err(CollectiveError::InvalidArgument {
                rank: world.global_rank(),
                op: "Replicas::new".into(),
                reason: format!(
                    "{replicas} replicas cannot split the world of {n} ranks evenly; use a \
                     number of data-parallel replicas that divides it"
                ),
            });
        }
        if !matches!(world.backend(), "tcp" | "local") {
            return Err(CollectiveError::InvalidArgument {
                rank: world.global_rank(),
                op: "Replicas::new".into(),
                reason: format!(
                    "fault-tolerant replicas need the tcp backend (or thread ranks): the {} \
                     backend ends the whole job when one rank fails; use --backend tcp",
                    world.backend()
                ),
            });
        }
        let size = n / replicas;
        let replica = world.rank() / size;
        let position = world.rank() % size;
        let island: Vec<usize> = (replica * size..(replica + 1) * size).collect();
        let outer: Vec<usize> = (0..replicas).map(|r| r * size + position).collect();
        let others: Vec<usize> = (0..n)
            .filter(|r| r / size != replica)
            .map(|r| world.members()[r])
            .collect();
        world.transport().mailbox().isolate_failures_of(&others);
        let island = world.split(&island)?;
        let outer = world.split(&outer)?;
        if let Some(flight) = outer.flight() {
            flight.name_group(outer.flight_id(), "replicas");
        }
        Ok(Self {
            world: world.clone(),
            island,
            outer,
            replicas,
            replica,
            state: Arc::new(Mutex::new(State {
                live: (0..replicas).collect(),
                ..State::default()
            })),
        })
    }

    /// Compares the replicas' parameters every `steps` exchanges (0: never), by a digest in
    /// the vote ([`Replicas::note_digest`]): replicas that differ are an error naming them.
    pub fn with_verify_every(self, steps: u64) -> Self {
        self.set_verify_every(steps);
        self
    }

    /// [`Self::with_verify_every`] for the replicas already shared (every clone sees it).
    pub fn set_verify_every(&self, steps: u64) {
        self.state().verify_every = steps;
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This rank's replica (its ranks, which train one copy of the model together).
    pub fn island(&self) -> &ProcessGroup {
        &self.island
    }

    /// The number of replicas the job started with.
    pub fn count(&self) -> usize {
        self.replicas
    }

    /// This rank's replica index.
    pub fn index(&self) -> usize {
        self.replica
    }

    /// The replicas averaged now, in order.
    pub fn live(&self) -> Vec<usize> {
        self.state().live.clone()
    }

    /// Exchanges committed so far (optimizer steps taken by the replicas).
    pub fn steps(&self) -> u64 {
        self.state().steps
    }

    /// Whether this rank's replica is the lowest live one (the one that saves checkpoints and
    /// sends the state to joining replicas).
    pub fn is_first_live(&self) -> bool {
        self.state().live.first() == Some(&self.replica)
    }

    /// Asks (or stops asking) the replicas to stop after the current step; every replica
    /// learns it at the step's exchange ([`Self::stopping`]).
    pub fn request_stop(&self, stop: bool) {
        self.state().stop = stop;
    }

    /// Whether the replicas agreed at the last exchange to stop after it.
    pub fn stopping(&self) -> bool {
        self.state().stopping
    }

    /// Whether the next exchange compares the parameters' digests (call
    /// [`Self::note_digest`] before it then).
    pub fn digest_due(&self) -> bool {
        let st = self.state();
        st.verify_every > 0 && st.steps.is_multiple_of(st.verify_every)
    }

    /// The replica that sends the state to the `admitted` ones: the lowest live replica that
    /// is not one of them.
    pub fn donor(&self, admitted: &[usize]) -> Option<usize> {
        self.state()
            .live
            .iter()
            .copied()
            .find(|r| !admitted.contains(r))
    }

    /// The digest of this rank's parameters, compared across the replicas at the next
    /// exchange.
    pub fn note_digest(&self, digest: u64) {
        self.state().digest = Some(digest);
    }

    /// Keeps the step's loss (averaged over this replica) for the gradient exchange.
    pub(crate) fn stage_loss(&self, loss: f32) {
        self.state().loss = Some(loss);
    }

    /// The loss kept by [`Self::stage_loss`] (averaged over the live replicas once the
    /// exchange ran), emptying it.
    pub(crate) fn take_loss(&self) -> Option<f32> {
        self.state().loss.take()
    }

    /// The events of the exchanges since the last call (lost and admitted replicas).
    pub fn take_events(&self) -> Vec<ReplicaEvent> {
        std::mem::take(&mut self.state().events)
    }

    /// The replicas admitted at the last exchange: after the step, the lowest live replica
    /// sends them the state ([`Self::send_state`]).
    pub fn take_admitted(&self) -> Vec<usize> {
        std::mem::take(&mut self.state().admitted)
    }

    /// The average of `local` (this replica's values: its gradients, flattened, and its loss)
    /// over the live replicas, summed in replica order, the same bits on every survivor. A
    /// replica lost during the exchange is dropped and the exchange runs again over the
    /// others (see the module documentation). Every rank of every live replica calls it once
    /// per step, with as many values.
    ///
    /// # Errors
    /// [`CollectiveError::Quorum`] when this replica was left out, when the replicas'
    /// parameters differ, or when an exchange keeps failing with the same replicas; errors
    /// that are not a lost peer (a mismatch, a bad argument).
    pub fn average(&self, local: &[f32]) -> Result<Vec<f32>> {
        let mut same = 0;
        loop {
            let (round, live, mut vote) = {
                let mut st = self.state();
                let round = st.rounds;
                st.rounds += 1;
                let vote = Vote {
                    ok: true,
                    stop: st.stop,
                    digest: st.digest,
                    joins: Vec::new(),
                };
                (round, st.live.clone(), vote)
            };
            let tag = TAG_BASE + 4 * round;
            let data = self.reduce_direct(local, &live, tag);
            vote.ok = match &data {
                Ok(_) => true,
                Err(e) if is_lost(e) => false,
                Err(e) => return Err(e.clone()),
            };
            let outcome = self.decide(&live, tag + 2, vote)?;
            let me = self.replica;
            if !outcome.agreed.contains(&me) {
                return Err(self.quorum(format!(
                    "the other replicas left replica {me} out of step {} (it was too late, or \
                     they lost its messages); restart this replica's ranks to rejoin",
                    self.steps() + 1
                )));
            }
            if let Some((a, b)) = outcome.diverged {
                return Err(self.quorum(format!(
                    "the parameters of replicas {a} and {b} differ before step {}: the replicas \
                     are no longer copies of one model; resume from the last checkpoint",
                    self.steps() + 1
                )));
            }
            let mut st = self.state();
            if outcome.agreed != live {
                let lost: Vec<usize> = live
                    .iter()
                    .copied()
                    .filter(|r| !outcome.agreed.contains(r))
                    .collect();
                let event = ReplicaEvent::Lost {
                    step: st.steps,
                    replicas: lost,
                    live: outcome.agreed.clone(),
                };
                if self.island.rank() == 0 {
                    eprintln!("burn-parallel: replica {me}: {event}");
                }
                st.events.push(event);
                st.live = outcome.agreed;
                same = 0;
                continue;
            }
            if !outcome.all_ok {
                same += 1;
                if same >= MAX_SAME_ATTEMPTS {
                    return Err(self.quorum(format!(
                        "the exchange of step {} failed {same} times with the same replicas \
                         {live:?}; check the network between them",
                        st.steps + 1
                    )));
                }
                continue;
            }
            // Committed.
            st.stopping = outcome.stop;
            st.digest = None;
            if !outcome.admitted.is_empty() {
                let event = ReplicaEvent::Admitted {
                    step: st.steps,
                    replicas: outcome.admitted.clone(),
                };
                if self.island.rank() == 0 {
                    eprintln!("burn-parallel: replica {me}: {event}");
                }
                st.events.push(event);
                st.joins.retain(|j| !outcome.admitted.contains(j));
                let mut live: BTreeSet<usize> = st.live.iter().copied().collect();
                live.extend(outcome.admitted.iter().copied());
                st.live = live.into_iter().collect();
                st.admitted = outcome.admitted;
            }
            st.steps += 1;
            return data;
        }
    }

    /// Chunk `k` of `len` values cut among `n`.
    fn bounds(len: usize, n: usize, k: usize) -> std::ops::Range<usize> {
        k * len / n..(k + 1) * len / n
    }

    /// The data round: a direct reduce-scatter and all-gather among this position's ranks of
    /// the `live` replicas, under `tag` and `tag + 1`. It goes on past a lost peer (so that the
    /// others are not left waiting) and then returns the first such error.
    fn reduce_direct(&self, local: &[f32], live: &[usize], tag: u64) -> Result<Vec<f32>> {
        let n = live.len();
        let Some(me) = live.iter().position(|&r| r == self.replica) else {
            return Err(self.quorum(format!(
                "replica {} is not among the live replicas {live:?}",
                self.replica
            )));
        };
        if n == 1 {
            return Ok(local.to_vec());
        }
        let len = local.len();
        let mut first_lost: Option<CollectiveError> = None;
        let mut keep = |r: Result<()>| -> Result<()> {
            match r {
                Ok(()) => Ok(()),
                Err(e) if is_lost(&e) => {
                    first_lost.get_or_insert(e);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        };
        for (k, &r) in live.iter().enumerate().filter(|&(k, _)| k != me) {
            let chunk = &local[Self::bounds(len, n, k)];
            let data = TensorData::new(chunk.to_vec(), [chunk.len()]);
            keep(self.outer.send_data(data, r, tag))?;
        }
        let mine = Self::bounds(len, n, me);
        let mut sum = vec![0.0f32; mine.len()];
        let deadline = Instant::now() + self.outer.timeout();
        for (k, &r) in live.iter().enumerate() {
            if k == me {
                sum.iter_mut()
                    .zip(&local[mine.clone()])
                    .for_each(|(s, v)| *s += v);
                continue;
            }
            match recv_by(&self.outer, deadline, r, tag) {
                Ok(bytes) if bytes.len() == 4 * sum.len() => {
                    for (s, b) in sum.iter_mut().zip(bytes.chunks_exact(4)) {
                        *s += f32::from_le_bytes(b.try_into().expect("4 bytes"));
                    }
                }
                Ok(bytes) => return Err(self.bad_length(r, bytes.len(), 4 * sum.len())),
                Err(e) => keep(Err(e))?,
            }
        }
        let scale = 1.0 / n as f32;
        sum.iter_mut().for_each(|s| *s *= scale);
        for (_, &r) in live.iter().enumerate().filter(|&(k, _)| k != me) {
            let data = TensorData::new(sum.clone(), [sum.len()]);
            keep(self.outer.send_data(data, r, tag + 1))?;
        }
        let mut out = vec![0.0f32; len];
        out[mine].copy_from_slice(&sum);
        for (k, &r) in live.iter().enumerate().filter(|&(k, _)| k != me) {
            let range = Self::bounds(len, n, k);
            match recv_by(&self.outer, deadline, r, tag + 1) {
                Ok(bytes) if bytes.len() == 4 * range.len() => {
                    for (o, b) in out[range].iter_mut().zip(bytes.chunks_exact(4)) {
                        *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                    }
                }
                Ok(bytes) => return Err(self.bad_length(r, bytes.len(), 4 * range.len())),
                Err(e) => keep(Err(e))?,
            }
        }
        match first_lost {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn bad_length(&self, replica: usize, got: usize, expected: usize) -> CollectiveError {
        CollectiveError::Mismatch {
            rank: self.world.global_rank(),
            peer: self.outer.members()[replica],
            ours: format!("a gradient exchange chunk of {expected} bytes"),
            theirs: format!("{got} bytes (do the replicas train the same model?)"),
        }
    }

    fn quorum(&self, reason: String) -> CollectiveError {
        CollectiveError::Quorum {
            rank: self.world.global_rank(),
            reason,
        }
    }

    /// The votes of the replicas (their first ranks agree; the outcome is broadcast inside
    /// each replica, so that all its ranks take the same decision).
    fn decide(&self, live: &[usize], tag: u64, mut vote: Vote) -> Result<Outcome> {
        if self.island.size() > 1 {
            // The replica's vote: its data round completed on every rank, any rank asked to
            // stop, the digest of all its ranks' parameters.
            let mine = [
                u64::from(vote.ok),
                u64::from(vote.stop),
                vote.digest.unwrap_or(0),
            ];
            let all = self
                .island
                .all_gather_bytes(mine.iter().flat_map(|w| w.to_le_bytes()).collect())?;
            let all: Vec<Vec<u64>> = all.iter().map(|b| words(b)).collect();
            vote.ok = all.iter().all(|w| w.first() == Some(&1));
            vote.stop = all.iter().any(|w| w.get(1) == Some(&1));
            if vote.digest.is_some() {
                let mut h = Fnv1a::new();
                all.iter().for_each(|w| h.write(&w[2].to_le_bytes()));
                vote.digest = Some(h.0);
            }
        }
        let outcome = match self.island.rank() {
            0 => {
                vote.joins = self.poll_joins(live);
                let outcome = self.agree_votes(live, tag, vote)?;
                if self.island.size() > 1 {
                    let bytes: Vec<u8> = outcome
                        .encode()
                        .iter()
                        .flat_map(|w| w.to_le_bytes())
                        .collect();
                    self.island.broadcast_bytes(bytes, 0)?;
                }
                outcome
            }
            _ => {
                let bytes = self.island.broadcast_bytes(Vec::new(), 0)?;
                Outcome::decode(&words(&bytes))
                    .ok_or_else(|| self.quorum("a malformed outcome from its replica".into()))?
            }
        };
        Ok(outcome)
    }

    /// The first ranks' agreement on the votes (see [`agree`]).
    fn agree_votes(&self, live: &[usize], tag: u64, vote: Vote) -> Result<Outcome> {
        let mine = vote.encode().iter().flat_map(|w| w.to_le_bytes()).collect();
        let (heard, agreed) = agree(&self.outer, live, tag, mine, &is_lost)?;
        let votes: BTreeMap<usize, Vote> = heard
            .iter()
            .filter(|(r, _)| agreed.contains(r))
            .map(|(&r, b)| {
                Vote::decode(&words(b))
                    .map(|v| (r, v))
                    .ok_or_else(|| self.quorum(format!("a malformed vote from replica {r}")))
            })
            .collect::<Result<_>>()?;
        let mut admitted: Option<BTreeSet<usize>> = None;
        for v in votes.values() {
            let theirs: BTreeSet<usize> = v.joins.iter().copied().collect();
            admitted = Some(match admitted {
                None => theirs,
                Some(a) => a.intersection(&theirs).copied().collect(),
            });
        }
        let digests: Vec<(usize, u64)> = votes
            .iter()
            .filter_map(|(&r, v)| v.digest.map(|d| (r, d)))
            .collect();
        let diverged = digests
            .iter()
            .find(|(_, d)| *d != digests[0].1)
            .map(|&(r, _)| (digests[0].0, r));
        Ok(Outcome {
            agreed: agreed.into_iter().collect(),
            all_ok: votes.values().all(|v| v.ok),
            stop: votes.values().any(|v| v.stop),
            admitted: admitted
                .unwrap_or_default()
                .into_iter()
                .filter(|r| !live.contains(r))
                .collect(),
            diverged,
        })
    }

    /// The replicas outside `live` whose first rank asked to join (this replica's first rank
    /// only; the requests stay until admitted).
    fn poll_joins(&self, live: &[usize]) -> Vec<usize> {
        let mut st = self.state();
        for r in (0..self.replicas).filter(|r| !live.contains(r) && *r != self.replica) {
            while let Ok(Some(_)) = self.outer.try_recv_bytes(r, TAG_JOIN) {
                st.joins.insert(r);
            }
        }
        st.joins.iter().copied().collect()
    }

    /// A restarted replica asks the others to take it back: its first rank sends the request
    /// to every other replica's first rank (the ones alive receive it). Then every rank of the
    /// replica waits for the state with [`Self::receive_state`].
    ///
    /// # Errors
    /// Collective errors other than a lost peer.
    pub fn request_join(&self) -> Result<()> {
        if self.island.rank() != 0 {
            return Ok(());
        }
        let me = self.replica as u64;
        for r in (0..self.replicas).filter(|&r| r != self.replica) {
            match send_words(&self.outer, &[me], r, TAG_JOIN) {
                Err(e) if !is_lost(&e) => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Sends this rank's share of the training state (`files`: name and bytes, in the
    /// checkpoint format) to every rank of each replica in `joiners`, with the quorum's state
    /// (live replicas, exchange rounds and steps). Every rank of the sending replica calls it.
    ///
    /// # Errors
    /// Collective errors other than a lost joiner.
    pub fn send_state(&self, joiners: &[usize], files: &[(String, Vec<u8>)]) -> Result<()> {
        let size = self.island.size();
        let (live, rounds, steps) = {
            let st = self.state();
            (st.live.clone(), st.rounds, st.steps)
        };
        let mut head: Vec<u64> = vec![rounds, steps, live.len() as u64];
        head.extend(live.iter().map(|&r| r as u64));
        let blob = encode_files(&head, files);
        for &j in joiners {
            for p in 0..size {
                let peer = j * size + p;
                let data = TensorData::new(blob.clone(), [blob.len()]);
                match self.world.send_data(data, peer, TAG_STATE) {
                    Err(e) if !is_lost(&e) => return Err(e),
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Waits (up to `timeout`) for the state the lowest live replica sends to this joining
    /// replica ([`Self::send_state`]), one message from each of its ranks, and takes the
    /// quorum's state from it.
    ///
    /// # Returns
    /// The files (name and bytes) of every rank of the sending replica.
    ///
    /// # Errors
    /// [`CollectiveError::Quorum`] when no live replica sent it in time; a malformed message.
    pub fn receive_state(&self, timeout: Duration) -> Result<Vec<(String, Vec<u8>)>> {
        let deadline = Instant::now() + timeout;
        let size = self.island.size();
        let mut gone = BTreeSet::new();
        loop {
            // The sender is the lowest live replica, which this rank does not know yet: the
            // first replica that sends wins, the others in turn.
            for r in (0..self.replicas).filter(|&r| r != self.replica) {
                let first = match self.world.try_recv_bytes(r * size, TAG_STATE) {
                    Ok(Some(first)) => first,
                    Ok(None) => continue,
                    Err(e) if is_lost(&e) => {
                        gone.insert(r);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let mut all = Vec::new();
                let (head, files) = decode_files(&first)
                    .ok_or_else(|| self.quorum(format!("a malformed state from replica {r}")))?;
                all.extend(files);
                for p in 1..size {
                    let bytes = recv_by(&self.world, deadline, r * size + p, TAG_STATE)?;
                    let (_, files) = decode_files(&bytes).ok_or_else(|| {
                        self.quorum(format!("a malformed state from replica {r}"))
                    })?;
                    all.extend(files);
                }
                let [rounds, steps, n, live @ ..] = head.as_slice() else {
                    return Err(self.quorum(format!("a malformed state from replica {r}")));
                };
                let mut st = self.state();
                st.rounds = *rounds;
                st.steps = *steps;
                st.live = live.iter().take(*n as usize).map(|&r| r as usize).collect();
                return Ok(all);
            }
            if gone.len() + 1 == self.replicas {
                return Err(self.quorum(format!(
                    "replica {} asked to rejoin but every other replica is gone (the job ended, \
                     or failed); nothing to rejoin",
                    self.replica
                )));
            }
            if Instant::now() >= deadline {
                return Err(self.quorum(format!(
                    "replica {} asked to rejoin but no live replica sent the training state \
                     within {timeout:?}; are the other replicas still training with \
                     --fault-tolerant?",
                    self.replica
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A digest of `model`'s parameters (their values, in module order), for
    /// [`Self::note_digest`].
    pub fn digest_of<M: Module>(model: &M) -> u64 {
        struct Digest(Fnv1a);
        impl ModuleVisitor for Digest {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.write(param.val().into_data().as_bytes());
            }
        }
        let mut d = Digest(Fnv1a::new());
        model.visit(&mut d);
        d.0.0
    }
}

/// `head` (count, words), then each file: name length, name, length, bytes (little-endian u64
/// lengths).
fn encode_files(head: &[u64], files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend((head.len() as u64).to_le_bytes());
    head.iter().for_each(|w| b.extend(w.to_le_bytes()));
    for (name, bytes) in files {
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend((bytes.len() as u64).to_le_bytes());
        b.extend(bytes);
    }
    b
}

type Files = Vec<(String, Vec<u8>)>;

fn decode_files(b: &[u8]) -> Option<(Vec<u64>, Files)> {
    struct Cursor<'a>(&'a [u8]);
    impl<'a> Cursor<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
            self.0 = rest;
            Some(head)
        }
        fn word(&mut self) -> Option<u64> {
            Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
        }
    }
    let mut c = Cursor(b);
    let n = usize::try_from(c.word()?).ok()?;
    let head = (0..n).map(|_| c.word()).collect::<Option<Vec<u64>>>()?;
    let mut files = Vec::new();
    while !c.0.is_empty() {
        let len = usize::try_from(c.word()?).ok()?;
        let name = String::from_utf8(c.take(len)?.to_vec()).ok()?;
        let len = usize::try_from(c.word()?).ok()?;
        files.push((name, c.take(len)?.to_vec()));
    }
    Some((head, files))
}

/// The gradients of `model` averaged over the live replicas by `replicas`, with `loss`
/// riding along: one exchange per step (see [`Replicas::average`]). The gradients travel in
/// f32 and come back in their own dtype, on their own device.
///
/// # Returns
/// The averaged gradients and the loss averaged over the live replicas.
///
/// # Errors
/// As [`Replicas::average`].
pub fn average_gradients<M: Module>(
    replicas: &Replicas,
    model: &M,
    grads: GradientsParams,
    loss: f32,
) -> Result<(GradientsParams, f32)> {
    struct Take {
        grads: GradientsParams,
        flat: Vec<f32>,
        lens: Vec<(ParamId, usize, DType)>,
    }
    impl ModuleVisitor for Take {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let dtype = g.dtype();
                let data = g.into_data().convert::<f32>();
                let values = data.as_slice::<f32>().expect("converted to f32");
                self.flat.extend_from_slice(values);
                self.lens.push((param.id, values.len(), dtype));
            }
        }
    }
    let mut take = Take {
        grads,
        flat: Vec::new(),
        lens: Vec::new(),
    };
    model.visit(&mut take);
    let Take {
        grads,
        mut flat,
        lens,
    } = take;
    flat.push(loss);
    let mut averaged = replicas.average(&flat)?;
    let loss = averaged.pop().expect("the loss rides last");
    struct Put {
        grads: GradientsParams,
        averaged: Vec<f32>,
        at: usize,
        lens: BTreeMap<ParamId, (usize, DType)>,
    }
    impl ModuleVisitor for Put {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(&(len, dtype)) = self.lens.get(&param.id) else {
                return;
            };
            if let Some(g) = self.grads.remove::<D>(param.id) {
                let shape = g.shape();
                let device = g.device();
                let values = self.averaged[self.at..self.at + len].to_vec();
                self.at += len;
                let t = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
                let t = match dtype {
                    DType::F32 => t,
                    other => t.cast(other),
                };
                self.grads.register::<D>(param.id, t);
            }
        }
    }
    let mut put = Put {
        grads,
        averaged,
        at: 0,
        lens: lens.into_iter().map(|(id, n, d)| (id, (n, d))).collect(),
    };
    model.visit(&mut put);
    Ok((put.grads, loss))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn votes_and_outcomes_round_trip() {
        let vote = Vote {
            ok: true,
            stop: false,
            digest: Some(42),
            joins: vec![3],
        };
        assert_eq!(Vote::decode(&vote.encode()), Some(vote));
        let outcome = Outcome {
            agreed: vec![0, 2],
            all_ok: true,
            stop: true,
            admitted: vec![1],
            diverged: None,
        };
        assert_eq!(Outcome::decode(&outcome.encode()), Some(outcome));
    }

    #[test]
    fn files_round_trip() {
        let files = vec![("a".to_string(), vec![1u8, 2]), ("bc".into(), vec![])];
        let blob = encode_files(&[7, 8], &files);
        assert_eq!(decode_files(&blob), Some((vec![7, 8], files)));
        assert_eq!(decode_files(&blob[..3]), None);
    }

    #[test]
    fn chunks_cover_every_value_once() {
        for n in 1..6 {
            let covered: usize = (0..n).map(|k| Replicas::bounds(10, n, k).len()).sum();
            assert_eq!(covered, 10);
        }
    }
}

#[cfg(test)]
mod exchange_tests {
    use super::*;
    use crate::run_local;

    #[test]
    fn a_replica_that_leaves_is_dropped_and_the_others_agree() {
        let out = run_local(3, |world| {
            let world = world.with_timeout(Duration::from_secs(2));
            let replicas = Replicas::new(&world, 3)?;
            let mine = vec![world.rank() as f32 + 1.0; 5];
            let first = replicas.average(&mine)?;
            if world.rank() == 2 {
                return Ok((first, Vec::new(), Vec::new()));
            }
            let second = replicas.average(&mine)?;
            Ok((first, second, replicas.take_events()))
        })
        .unwrap();
        assert_eq!(out[0].0, vec![2.0; 5]);
        assert_eq!(out[0].1, vec![1.5; 5], "the average of the survivors");
        assert_eq!(out[0].1, out[1].1);
        assert_eq!(
            out[0].2,
            vec![ReplicaEvent::Lost {
                step: 1,
                replicas: vec![2],
                live: vec![0, 1]
            }]
        );
    }

    #[test]
    fn replicas_of_several_ranks_exchange_by_position_and_stop_together() {
        let out = run_local(4, |world| {
            let replicas = Replicas::new(&world, 2)?;
            replicas.request_stop(world.rank() == 3);
            let mine: Vec<f32> = (0..7).map(|i| (world.rank() * 10 + i) as f32).collect();
            let avg = replicas.average(&mine)?;
            Ok((avg, replicas.stopping()))
        })
        .unwrap();
        // Position 0: ranks 0 and 2; position 1: ranks 1 and 3.
        let expect = |a: usize, b: usize| -> Vec<f32> {
            (0..7)
                .map(|i| ((a * 10 + i) as f32 + (b * 10 + i) as f32) * 0.5)
                .collect()
        };
        assert_eq!(out[0].0, expect(0, 2));
        assert_eq!(out[2].0, expect(0, 2));
        assert_eq!(out[1].0, expect(1, 3));
        assert!(out.iter().all(|(_, stop)| *stop), "rank 3 asked to stop");
    }

    #[test]
    fn replicas_that_differ_are_named() {
        let err = run_local(2, |world| {
            let replicas = Replicas::new(&world, 2)?.with_verify_every(1);
            assert!(replicas.digest_due());
            replicas.note_digest(world.rank() as u64);
            replicas.average(&[1.0])
        })
        .unwrap_err();
        assert!(err.to_string().contains("replicas 0 and 1 differ"), "{err}");
    }
}
