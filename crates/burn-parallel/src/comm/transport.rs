//! The transport contract every backend (`local`, `tcp`) implements, and the mailbox they share.
//!
//! A transport only moves [`Frame`]s between global ranks. Every collective algorithm is written
//! once, in [`crate::ProcessGroup`], on top of `send` and `recv`; a backend decides only how bytes
//! travel. Incoming frames are sorted into a [`Mailbox`] by `(source, stream)`, so that
//! collectives of different groups and tagged point-to-point messages never mix.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::error::{CollectiveError, Result};

/// Default timeout of every wait, unless `BURN_PARALLEL_TIMEOUT_SECS` says otherwise.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Longest timeout the settings accept (a year): `BURN_PARALLEL_TIMEOUT_SECS`,
/// `BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS`, [`crate::TcpConfig::timeout`] and
/// [`crate::ProcessGroup::with_timeout`]. To wait "forever", a year is as good, and its deadline
/// can always be represented. Re-exported as `comm::tcp::MAX_TIMEOUT`.
pub const MAX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// Identifies an independent ordered message stream between two ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamId {
    /// The process group the message belongs to.
    pub group: u64,
    /// [`StreamId::COLLECTIVE`] for collectives, otherwise a point-to-point tag.
    pub tag: u64,
}

impl StreamId {
    /// The tag reserved for the collectives of a group.
    pub const COLLECTIVE: u64 = u64::MAX;
    /// The tag reserved for setting up the NCCL channels between two ranks of a group.
    pub const CHANNEL_SETUP: u64 = u64::MAX - 1;
}

/// The metadata carried by every message, checked by the receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Which stream the frame belongs to.
    pub stream: StreamId,
    /// Call number of the collective inside its group (0 for point-to-point messages).
    pub seq: u64,
    /// Human-readable description of the call that sent it: operation, dtype and the parts of
    /// the shape every rank must agree on. Receivers compare it with their own.
    pub signature: String,
    /// Small integers that travel with the payload (for example the shape of a shard).
    pub meta: Vec<u64>,
}

/// A message: a header and a payload that can be shared without copying.
#[derive(Debug, Clone)]
pub struct Frame {
    /// Metadata.
    pub header: Header,
    /// The data.
    pub payload: Bytes,
}

/// How ranks move frames. Implemented by the `local` (threads) and `tcp` (processes) backends.
pub trait Transport: Send + Sync + 'static {
    /// Global rank of this process or thread.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn world_size(&self) -> usize;
    /// Short name of the backend, for messages (`"local"`, `"tcp"`).
    fn backend_name(&self) -> &'static str;
    /// Hands `frame` to global rank `dst`. Must not wait for the receiver to call `recv`.
    ///
    /// # Errors
    /// When `dst` is known to be dead or the connection to it fails.
    fn send(&self, dst: usize, frame: Frame) -> Result<()>;
    /// The mailbox receiving the frames addressed to this rank.
    fn mailbox(&self) -> &Mailbox;
    /// Tells every peer that this rank has failed with `reason`, so that they stop waiting
    /// for it. Called by launchers when a rank panics or returns an error.
    fn abort(&self, reason: &str);
    /// Where ranks sharing this process's memory publish buffers for zero-copy collectives;
    /// `None` (the default) when peers are other processes.
    fn board(&self) -> Option<&crate::comm::shm::Board> {
        None
    }
    /// The backend's own implementation of the host-data collectives, when it has one (MPI);
    /// [`crate::ProcessGroup`] then runs its `*_data` collectives there instead of its ring
    /// algorithms over [`Transport::send`]. `None` (the default) for `local` and `tcp`.
    fn native(&self) -> Option<&dyn NativeCollectives> {
        None
    }
    /// Whether this process joined a world that was already running (a restarted rank of a
    /// fault-tolerant `tcp` job, see [`crate::TcpConfig::rejoin`]) instead of forming it with
    /// the others. `false` (the default) for every backend without rejoining.
    fn rejoined(&self) -> bool {
        false
    }
}

/// One collective call of a group, as [`crate::ProcessGroup`] hands it to a backend's
/// [`NativeCollectives`].
#[derive(Debug, Clone, Copy)]
pub struct NativeCall<'a> {
    /// The group's id (0 for the world; every member computes the same id for a sub-group).
    pub group: u64,
    /// Global rank of each member, in group-rank order.
    pub members: &'a [usize],
    /// The caller's rank in the group.
    pub rank: usize,
    /// How long any wait of the call may take.
    pub timeout: Duration,
    /// Operation, call number, dtype and the shape every member must agree on: the backend
    /// checks that every member passes the same one before moving data.
    pub signature: &'a str,
}

/// Host-data collectives that a backend runs with its own algorithms (MPI's). Every method is
/// collective over `call.members`; data is raw row-major bytes of `dtype` elements.
///
/// Implementations must end every call with an error (never hang) when a member does not take
/// part within `call.timeout`, and report members that call with another signature as
/// [`CollectiveError::Mismatch`].
pub trait NativeCollectives: Send + Sync {
    /// Element-wise reduction of `input` over the members, written to `output` (same length).
    ///
    /// # Errors
    /// Timeouts, mismatches and backend failures, typed.
    fn all_reduce(
        &self,
        call: &NativeCall<'_>,
        input: &[u8],
        output: &mut [u8],
        dtype: burn::tensor::DType,
        op: crate::ReduceOp,
    ) -> Result<()>;
    /// Every member's bytes and one word of metadata, in rank order.
    ///
    /// # Errors
    /// As [`NativeCollectives::all_reduce`].
    fn all_gather(
        &self,
        call: &NativeCall<'_>,
        mine: &[u8],
        meta: u64,
    ) -> Result<Vec<(Bytes, u64)>>;
    /// `send` holds one piece per member, packed in rank order (`lens[k]` bytes for member
    /// `k`); reduces piece `k` over the members and returns the reduced piece `call.rank`.
    ///
    /// # Errors
    /// As [`NativeCollectives::all_reduce`].
    fn reduce_scatter(
        &self,
        call: &NativeCall<'_>,
        send: &[u8],
        lens: &[usize],
        dtype: burn::tensor::DType,
        op: crate::ReduceOp,
    ) -> Result<Vec<u8>>;
    /// Overwrites `data` with the root's `data` (same length on every member).
    ///
    /// # Errors
    /// As [`NativeCollectives::all_reduce`].
    fn broadcast(&self, call: &NativeCall<'_>, data: &mut [u8], root: usize) -> Result<()>;
    /// `send` holds one piece per member, packed in rank order (`lens[k]` bytes for member
    /// `k`); sends piece `k` with its metadata `metas[k]` to member `k` and returns what every
    /// member sent to the caller, with its metadata, in rank order.
    ///
    /// # Errors
    /// As [`NativeCollectives::all_reduce`].
    fn all_to_all(
        &self,
        call: &NativeCall<'_>,
        send: &[u8],
        lens: &[usize],
        metas: &[Vec<u64>],
    ) -> Result<Vec<(Bytes, Vec<u64>)>>;
    /// Returns once every member has called it.
    ///
    /// # Errors
    /// As [`NativeCollectives::all_reduce`].
    fn barrier(&self, call: &NativeCall<'_>) -> Result<()>;
}

/// Why a peer is no longer there.
#[derive(Debug, Clone)]
enum Gone {
    /// It finished normally: only waiting on it specifically is an error.
    Closed,
    /// It failed: the whole world is broken and every wait ends.
    Failed,
}

#[derive(Default)]
struct MailboxState {
    queues: HashMap<(usize, StreamId), VecDeque<Frame>>,
    gone: HashMap<usize, Gone>,
    /// First failure anywhere in the world: `(rank, reason)`.
    failure: Option<(usize, String)>,
    /// Peers whose failure is theirs alone ([`Mailbox::isolate_failures_of`]), with the
    /// reason once they failed.
    isolated: HashSet<usize>,
    isolated_failures: HashMap<usize, String>,
}

/// Frames that arrived for one rank, sorted by `(source, stream)`, plus what is known of the
/// peers' health. Shared by all transports.
#[derive(Default)]
pub struct Mailbox {
    state: Mutex<MailboxState>,
    arrived: Condvar,
}

impl Mailbox {
    /// Creates an empty mailbox.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores a frame that arrived from global rank `src` and wakes the waiters.
    pub fn deliver(&self, src: usize, frame: Frame) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .queues
            .entry((src, frame.header.stream))
            .or_default()
            .push_back(frame);
        drop(state);
        self.arrived.notify_all();
    }

    /// Records that `peer` failed: every wait in this mailbox ends with an error naming it.
    /// A peer given to [`Mailbox::isolate_failures_of`] is only marked failed itself: waits on
    /// it end, waits on other ranks go on.
    pub fn mark_failed(&self, peer: usize, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.gone.insert(peer, Gone::Failed);
        if state.isolated.contains(&peer) {
            state
                .isolated_failures
                .entry(peer)
                .or_insert_with(|| reason.to_string());
        } else if state.failure.is_none() {
            state.failure = Some((peer, reason.to_string()));
        }
        drop(state);
        self.arrived.notify_all();
    }

    /// Records that `peer` shut down cleanly: waiting on it is an error, waiting on others is not.
    pub fn mark_closed(&self, peer: usize) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.gone.entry(peer).or_insert(Gone::Closed);
        drop(state);
        self.arrived.notify_all();
    }

    /// Records that `peer` cannot be reached (a rank that was down when this process rejoined
    /// a running world): waits on `peer` end with an error, waits on other ranks go on, as for
    /// an isolated peer ([`Mailbox::isolate_failures_of`]) whether or not `peer` is isolated.
    /// [`Mailbox::revive`] undoes it once the peer connects.
    pub fn mark_lost(&self, peer: usize, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.gone.insert(peer, Gone::Failed);
        state
            .isolated_failures
            .entry(peer)
            .or_insert_with(|| reason.to_string());
        drop(state);
        self.arrived.notify_all();
    }

    /// `peer` is back (a restarted process took its place): forgets that it failed or shut
    /// down, and drops the frames from it still queued (they came from the process that is
    /// gone), then wakes the waiters. A peer given to [`Mailbox::isolate_failures_of`] stays
    /// isolated. The world-wide failure ([`Mailbox::failure`]) is not cleared: a failure that
    /// was not isolated is final.
    pub fn revive(&self, peer: usize) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.gone.remove(&peer);
        state.isolated_failures.remove(&peer);
        state.queues.retain(|&(src, _), _| src != peer);
        drop(state);
        self.arrived.notify_all();
    }

    /// From now on, a failure of one of `peers` ends only the waits on that peer instead of
    /// every wait of this mailbox (used by DiLoCo to drop a lost island and go on with the
    /// others). A failure recorded before this call is not undone.
    pub fn isolate_failures_of(&self, peers: &[usize]) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.isolated.extend(peers.iter().copied());
    }

    /// The first failure recorded in the world, if any: `(rank, reason)`.
    pub fn failure(&self) -> Option<(usize, String)> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.failure.clone()
    }

    /// Waits for the next frame from global rank `src` on `stream`.
    ///
    /// # Arguments
    /// * `me` - global rank of the owner, for error messages.
    /// * `op` - description of the waiting operation, for error messages.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidTimeout`] when `timeout` is too long for a deadline to be
    /// represented (such as `Duration::MAX`);
    /// [`CollectiveError::Timeout`] after `timeout`; [`CollectiveError::PeerFailed`] as soon as
    /// any rank of the world is known to have failed, or `src` has shut down.
    pub fn recv(
        &self,
        me: usize,
        src: usize,
        stream: StreamId,
        timeout: Duration,
        op: &dyn Fn() -> String,
    ) -> Result<Frame> {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            return Err(CollectiveError::InvalidTimeout {
                setting: "ProcessGroup::with_timeout".into(),
                value: format!("{timeout:?}"),
                reason: format!(
                    "rank {me}: {}: a deadline that far away cannot be represented; give at \
                     most {} s",
                    op(),
                    MAX_TIMEOUT.as_secs()
                ),
            });
        };
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(frame) = state
                .queues
                .get_mut(&(src, stream))
                .and_then(VecDeque::pop_front)
            {
                return Ok(frame);
            }
            if let Some((peer, reason)) = &state.failure {
                return Err(CollectiveError::PeerFailed {
                    rank: me,
                    op: op(),
                    peer: *peer,
                    reason: reason.clone(),
                });
            }
            if let Some(reason) = state.isolated_failures.get(&src) {
                return Err(CollectiveError::PeerFailed {
                    rank: me,
                    op: op(),
                    peer: src,
                    reason: reason.clone(),
                });
            }
            if let Some(Gone::Closed) = state.gone.get(&src) {
                return Err(CollectiveError::PeerFailed {
                    rank: me,
                    op: op(),
                    peer: src,
                    reason: "it shut down its process group before sending this message".into(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CollectiveError::Timeout {
                    rank: me,
                    op: op(),
                    peer: src,
                    timeout,
                });
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(tag: u64, byte: u8) -> Frame {
        Frame {
            header: Header {
                stream: StreamId { group: 0, tag },
                seq: 0,
                signature: "test".into(),
                meta: Vec::new(),
            },
            payload: Bytes::from(vec![byte]),
        }
    }

    fn recv(mailbox: &Mailbox, src: usize, tag: u64) -> Result<Frame> {
        mailbox.recv(
            0,
            src,
            StreamId { group: 0, tag },
            Duration::from_millis(50),
            &|| "recv".into(),
        )
    }

    #[test]
    fn revive_clears_an_isolated_failure_and_the_dead_processes_frames() {
        let mailbox = Mailbox::new();
        mailbox.isolate_failures_of(&[1, 2]);
        mailbox.deliver(1, frame(7, 1));
        mailbox.deliver(2, frame(7, 2));
        mailbox.mark_failed(1, "crashed");
        assert!(matches!(
            recv(&mailbox, 1, 8),
            Err(CollectiveError::PeerFailed { peer: 1, .. })
        ));
        mailbox.revive(1);
        // The frame of the dead process is gone; the wait now times out instead of failing.
        assert!(matches!(
            recv(&mailbox, 1, 7),
            Err(CollectiveError::Timeout { peer: 1, .. })
        ));
        // Other peers' frames stay.
        assert_eq!(recv(&mailbox, 2, 7).unwrap().payload[0], 2);
        mailbox.deliver(1, frame(7, 3));
        assert_eq!(recv(&mailbox, 1, 7).unwrap().payload[0], 3);
        // Still isolated: a second failure ends only the waits on it.
        mailbox.mark_failed(1, "crashed again");
        assert!(mailbox.failure().is_none());
        assert!(matches!(
            recv(&mailbox, 1, 7),
            Err(CollectiveError::PeerFailed { peer: 1, .. })
        ));
        assert!(matches!(
            recv(&mailbox, 2, 7),
            Err(CollectiveError::Timeout { peer: 2, .. })
        ));
    }

    #[test]
    fn revive_keeps_a_world_wide_failure_and_forgets_a_goodbye() {
        let mailbox = Mailbox::new();
        mailbox.mark_closed(2);
        assert!(recv(&mailbox, 2, 1).is_err());
        mailbox.revive(2);
        mailbox.deliver(2, frame(1, 9));
        assert_eq!(recv(&mailbox, 2, 1).unwrap().payload[0], 9);
        mailbox.mark_failed(1, "crashed");
        mailbox.revive(1);
        assert_eq!(mailbox.failure().map(|(r, _)| r), Some(1));
        assert!(matches!(
            recv(&mailbox, 2, 1),
            Err(CollectiveError::PeerFailed { peer: 1, .. })
        ));
    }

    #[test]
    fn a_lost_peer_ends_only_its_own_waits_until_revived() {
        let mailbox = Mailbox::new();
        mailbox.mark_lost(3, "down when this rank rejoined");
        assert!(mailbox.failure().is_none());
        assert!(matches!(
            recv(&mailbox, 3, 0),
            Err(CollectiveError::PeerFailed { peer: 3, .. })
        ));
        mailbox.revive(3);
        mailbox.deliver(3, frame(0, 4));
        assert_eq!(recv(&mailbox, 3, 0).unwrap().payload[0], 4);
    }
}
