//! [`ProcessGroup`]: the collectives, written once over any [`Transport`].
//!
//! Algorithms: ring reduce-scatter and ring all-gather (so all-reduce sends `2(n-1)/n` of the
//! data per rank, bandwidth-optimal), direct exchange for all-to-all, a star from the root for
//! broadcast. Every message carries the call number and a signature (operation, dtype, shape),
//! so a rank that calls another collective, or the same one on another shape, is reported by
//! name instead of corrupting data or hanging.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::{DType, Tensor, TensorData};
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::calls::{CallLog, CallPath, Inside, LoggedCall};
use crate::comm::host::{
    ReduceOp, combine_to, concat_into, dtype_code, dtype_from_code, dtype_name, geometry,
    reducible, split_along,
};
use crate::comm::pool;
use crate::comm::shm::{Board, SharedBuffer, reduce_chunk_everywhere};
use crate::comm::transport::{Frame, Header, NativeCall, StreamId, Transport};
use crate::error::{CollectiveError, Result};
use crate::flight::{FlightRecorder, InFlight};

/// Below this size the shared-memory all-reduce's two barriers cost more than they save.
const SHM_MIN_BYTES: usize = 256 * 1024;

pub use crate::comm::transport::DEFAULT_TIMEOUT;

/// `BURN_PARALLEL_TIMEOUT_SECS`, or [`DEFAULT_TIMEOUT`]. An unusable value (`inf`, `NaN`,
/// negative, beyond [`crate::comm::tcp::MAX_TIMEOUT`]) is an error of the `tcp` backend's
/// `connect`, before any group exists; a group of another backend warns once and keeps the
/// default.
fn default_timeout() -> Duration {
    match crate::comm::tcp::env::timeout_from_env("BURN_PARALLEL_TIMEOUT_SECS") {
        Ok(timeout) => timeout.unwrap_or(DEFAULT_TIMEOUT),
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| eprintln!("burn-parallel: {e}; using {DEFAULT_TIMEOUT:?}"));
            DEFAULT_TIMEOUT
        }
    }
}

/// A set of ranks that run collectives together: the world, or a sub-group of it.
///
/// Cheap to clone; clones share the call counter, so they are the same group. All members must
/// call the same collectives in the same order (as in every collective library); when they do
/// not, the call fails with [`CollectiveError::Mismatch`] or [`CollectiveError::Timeout`].
///
/// Collectives work on Burn tensors of any dtype on any backend (data is staged through host
/// memory) and on raw [`TensorData`].
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{ReduceOp, run_local};
///
/// let out = run_local(2, |group| {
///     let device = Device::flex();
///     let x = Tensor::<1>::from_floats([group.rank() as f32, 1.0], &device);
///     let sum = group.all_reduce(x, ReduceOp::Sum)?;
///     Ok(sum.into_data().to_vec::<f32>().unwrap())
/// })
/// .unwrap();
/// assert_eq!(out[0], vec![1.0, 2.0]);
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    transport: Arc<dyn Transport>,
    /// Global rank of each member, in group-rank order.
    members: Arc<[usize]>,
    /// This rank's index in `members`.
    rank: usize,
    id: u64,
    seq: Arc<AtomicU64>,
    timeout: Duration,
    /// How many groups with a given member list this rank created (for unique ids).
    registry: Arc<Mutex<HashMap<Vec<usize>, u64>>>,
    /// NCCL communicators for CUDA tensors (the `nccl` backend, see [`crate::comm::nccl`]);
    /// `None` on the host backends. Sub-groups get their own.
    nccl: Option<crate::comm::nccl::DeviceComm>,
    /// Take the tensor-level paths even where the transport stages tensors through host memory
    /// ([`ProcessGroup::with_tensor_path`]); inherited by sub-groups.
    tensor_path: bool,
    /// The communication thread of the asynchronous collectives ([`crate::work`]), started at
    /// the first; shared by clones, not by sub-groups.
    lane: LaneSlot,
    /// Where this rank's calls are logged ([`ProcessGroup::with_call_log`]); inherited by
    /// sub-groups.
    log: Option<CallLog>,
    /// This rank's flight recorder ([`crate::flight`]); shared by its groups.
    flight: Option<Arc<FlightRecorder>>,
}

/// A job on a lane: runs a collective on the lane's group.
pub(crate) type Job = Box<dyn FnOnce(&ProcessGroup) + Send>;

/// A group's lane (shared by its clones): the queue of its communication thread, which runs
/// started collectives in order on a sub-group over the same ranks ([`crate::work`]). Dropped
/// with the last clone of its group: the thread finishes the jobs it has and ends.
type LaneSlot = Arc<Mutex<Option<Sender<Job>>>>;

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend())
            .field("rank", &self.rank)
            .field("size", &self.members.len())
            .field("members", &self.members)
            .finish()
    }
}

/// One collective call in progress: its number and signature.
struct Call {
    seq: u64,
    signature: String,
    /// Its entry in the flight recorder: done when the call ends, unless marked failed.
    flight: Option<InFlight>,
}

impl Call {
    /// Marks the call failed in the flight recorder when `outcome` is an error.
    fn noted<T>(&self, outcome: Result<T>) -> Result<T> {
        if let (Err(e), Some(f)) = (&outcome, &self.flight) {
            f.fail(e);
        }
        outcome
    }
}

/// Payload bytes this process handed to host transports (every group, every thread rank).
static HOST_BYTES: AtomicU64 = AtomicU64::new(0);

fn count_host_bytes(bytes: usize) {
    HOST_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// The bytes this process has handed to host collectives (each rank's input to the `*_data`,
/// `*_bytes` and `*_object` collectives and host sends, whatever the transport: threads,
/// TCP, MPI), over every group and thread rank since it started: what communication still
/// stages through host memory. Device collectives (NCCL) are not counted. Read it before and
/// after a step for that step's bytes.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{ReduceOp, group::host_bytes_sent, run_local};
///
/// let before = host_bytes_sent();
/// run_local(2, |g| g.all_reduce(Tensor::<1>::ones([1024], &Device::flex()), ReduceOp::Sum)).unwrap();
/// assert!(host_bytes_sent() - before >= 2 * 4 * 1024); // both ranks' inputs
/// ```
pub fn host_bytes_sent() -> u64 {
    HOST_BYTES.load(Ordering::Relaxed)
}

impl ProcessGroup {
    /// The group of all ranks of `transport`'s world.
    pub fn world(transport: Arc<dyn Transport>) -> Self {
        let members: Arc<[usize]> = (0..transport.world_size()).collect();
        Self {
            flight: FlightRecorder::for_world(transport.rank(), transport.world_size()),
            rank: transport.rank(),
            transport,
            members,
            id: 0,
            seq: Arc::new(AtomicU64::new(0)),
            timeout: default_timeout(),
            registry: Arc::new(Mutex::new(HashMap::new())),
            nccl: None,
            tensor_path: false,
            lane: Default::default(),
            log: None,
        }
    }

    /// Logs every collective this rank issues on this group, its clones made after and its
    /// sub-groups into `log` (see [`crate::calls`]).
    pub fn with_call_log(mut self, log: CallLog) -> Self {
        self.log = Some(log);
        self
    }

    /// Logs a call (when the group has a log; `peer` and tag for a point-to-point call) and
    /// marks this thread as inside it until the guard is dropped, so that the collectives it
    /// makes itself are not logged again.
    fn log_call(
        &self,
        op: &'static str,
        path: CallPath,
        dtype: DType,
        bytes: usize,
        peer: Option<(usize, u64)>,
    ) -> Option<Inside> {
        let log = self.log.as_ref()?;
        log.push(LoggedCall {
            members: self.members.to_vec(),
            op,
            path,
            dtype,
            bytes,
            peer: peer.and_then(|(p, tag)| Some((*self.members.get(p)?, tag))),
        });
        Some(Inside::enter())
    }

    /// Logs a collective on tensor `t` ([`CallPath::Tensor`]).
    pub(crate) fn logged_tensor<const D: usize>(
        &self,
        op: &'static str,
        t: &Tensor<D>,
    ) -> Option<Inside> {
        self.tensor_call(op, t, None)
    }

    /// Logs a point-to-point call on tensor `t` with group rank `peer` under `tag`.
    fn logged_p2p<const D: usize>(
        &self,
        op: &'static str,
        t: &Tensor<D>,
        peer: usize,
        tag: u64,
    ) -> Option<Inside> {
        self.tensor_call(op, t, Some((peer, tag)))
    }

    fn tensor_call<const D: usize>(
        &self,
        op: &'static str,
        t: &Tensor<D>,
        peer: Option<(usize, u64)>,
    ) -> Option<Inside> {
        let bytes = t.shape().num_elements() * t.dtype().size();
        self.log_call(op, CallPath::Tensor, t.dtype(), bytes, peer)
    }

    /// Counts `bytes` handed to the host transport ([`host_bytes_sent`]) and logs the call
    /// ([`CallPath::Host`]).
    fn host_call(&self, op: &'static str, dtype: DType, bytes: usize) -> Option<Inside> {
        crate::flight::note_payload(dtype, bytes);
        self.host_call_p2p(op, dtype, bytes, None)
    }

    /// [`Self::host_call`], of a point-to-point call when `peer` is given.
    fn host_call_p2p(
        &self,
        op: &'static str,
        dtype: DType,
        bytes: usize,
        peer: Option<(usize, u64)>,
    ) -> Option<Inside> {
        count_host_bytes(bytes);
        self.log_call(op, CallPath::Host, dtype, bytes, peer)
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many collectives this rank has called on this group (its clones included; each
    /// sub-group counts its own): what a test or a log reads to check how often a technique
    /// communicates.
    pub fn collectives_called(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// This rank's index in the world.
    pub fn global_rank(&self) -> usize {
        self.transport.rank()
    }

    /// Global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The name of the backend (`"local"`, `"tcp"`, or `"nccl"` once
    /// [`crate::nccl::attach`] attached NCCL to the group).
    pub fn backend(&self) -> &'static str {
        match self.nccl {
            Some(_) => crate::comm::nccl::BACKEND,
            None => self.transport.backend_name(),
        }
    }

    /// Whether this process joined a world that was already running (a restarted rank of a
    /// fault-tolerant `tcp` job, see [`crate::TcpConfig::rejoin`]).
    pub fn rejoined(&self) -> bool {
        self.transport.rejoined()
    }

    /// The group with NCCL attached (see [`crate::nccl::attach`]).
    pub(crate) fn with_nccl(mut self, nccl: crate::comm::nccl::DeviceComm) -> Self {
        self.nccl = Some(nccl);
        self
    }

    /// The group's NCCL state, when NCCL is attached.
    #[cfg_attr(not(all(feature = "nccl", feature = "cuda")), allow(dead_code))]
    pub(crate) fn nccl(&self) -> Option<&crate::comm::nccl::DeviceComm> {
        self.nccl.as_ref()
    }

    /// Whether the techniques should hand this group tensors on `device` (the tensor-level
    /// collectives, [`ProcessGroup::all_reduce`], ...) rather than host data: true when those
    /// move them in device memory (NCCL attached and a CUDA device, with the `nccl` and `cuda`
    /// features), or when [`ProcessGroup::with_tensor_path`] asks for it.
    ///
    /// Where it is true, DDP forms its gradient buckets on the device and the differentiable
    /// collectives of [`crate::autograd`] (tensor and sequence parallelism) communicate
    /// activations and gradients without leaving it.
    ///
    /// ```
    /// use burn::tensor::Device;
    /// burn_parallel::run_local(2, |group| {
    ///     assert!(!group.collects_on_device(&Device::flex()));
    ///     assert!(group.with_tensor_path(true).collects_on_device(&Device::flex()));
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn collects_on_device(&self, device: &burn::tensor::Device) -> bool {
        if self.tensor_path {
            return true;
        }
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        return crate::comm::nccl::device::routes(self, device);
        #[cfg(not(all(feature = "nccl", feature = "cuda")))]
        {
            let _ = device;
            false
        }
    }

    /// Makes [`ProcessGroup::collects_on_device`] true on every device, for this group and the
    /// sub-groups split from it: the techniques then take their tensor-level path, which on a
    /// transport without device collectives stages each tensor through host memory inside the
    /// collective (the same result, more copies). For testing that path, and the device path of
    /// an NCCL job, on machines without a GPU.
    pub fn with_tensor_path(mut self, on: bool) -> Self {
        self.tensor_path = on;
        self
    }

    /// The slot of the group's asynchronous lane ([`crate::work`]).
    pub(crate) fn lane_slot(&self) -> &LaneSlot {
        &self.lane
    }

    /// The timeout applied to every wait of this group.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The same group with another timeout for every wait. A timeout too long for a deadline
    /// to be represented (such as `Duration::MAX`) makes every wait fail with
    /// [`CollectiveError::InvalidTimeout`]; [`crate::comm::tcp::MAX_TIMEOUT`] always works.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The id its messages carry ([`StreamId::group`]).
    pub(crate) fn stream_group(&self) -> u64 {
        self.id
    }

    /// The underlying transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Reports this rank as failed to every peer (their pending calls end with an error).
    pub fn abort(&self, reason: &str) {
        self.transport.abort(reason);
    }

    /// Creates the sub-group of the given members (ranks of *this* group, in the order that
    /// becomes the sub-group's rank order). Every member must create it, and members must
    /// create their sub-groups in the same order. No communication takes place.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when a rank is out of range or repeated, or when the
    /// caller is not a member.
    pub fn split(&self, ranks: &[usize]) -> Result<ProcessGroup> {
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            rank: self.global_rank(),
            op: format!("split({ranks:?})"),
            reason,
        };
        if ranks.is_empty() {
            return Err(invalid("a group needs at least one rank".into()));
        }
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() {
                return Err(invalid(format!(
                    "rank {r} is out of range for a group of {} ranks",
                    self.size()
                )));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(invalid(format!("rank {r} is listed twice")));
            }
        }
        let Some(my_index) = ranks.iter().position(|&r| r == self.rank) else {
            return Err(invalid(format!(
                "the calling rank {} is not a member; only members create a sub-group",
                self.rank
            )));
        };
        let members: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let nth = {
            let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            let counter = registry.entry(members.clone()).or_insert(0);
            *counter += 1;
            *counter
        };
        let mut hasher = DefaultHasher::new();
        (self.id, &members, nth).hash(&mut hasher);
        let id = (hasher.finish() & !(1 << 63)).max(1);
        if let Some(flight) = &self.flight {
            flight.add_group(id, &members);
        }
        Ok(ProcessGroup {
            transport: self.transport.clone(),
            members: members.into(),
            rank: my_index,
            id,
            seq: Arc::new(AtomicU64::new(0)),
            timeout: self.timeout,
            registry: self.registry.clone(),
            nccl: self.nccl.as_ref().map(|nccl| nccl.for_subgroup()),
            tensor_path: self.tensor_path,
            lane: Default::default(),
            log: self.log.clone(),
            flight: self.flight.clone(),
        })
    }

    // ------------------------------------------------------------------------------------
    // Message plumbing.

    fn begin(&self, op: &'static str, detail: String) -> Call {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let signature = format!("{op}(#{seq} {detail})");
        let payload = crate::flight::take_payload();
        let flight = self.flight.as_ref().map(|f| {
            crate::flight::clear_noted();
            f.issue(seq, self.id, op, &signature, payload, None)
        });
        Call {
            seq,
            signature,
            flight,
        }
    }

    /// This rank's flight recorder ([`crate::flight`]; shared by its groups), or `None` when
    /// `BURN_PARALLEL_FLIGHT_ENTRIES=0` turned it off.
    pub fn flight(&self) -> Option<&Arc<FlightRecorder>> {
        self.flight.as_ref()
    }

    /// The id of this group in the flight recorder's entries ([`crate::flight::GroupInfo`]).
    pub fn flight_id(&self) -> u64 {
        self.id
    }

    fn invalid(&self, op: &str, reason: String) -> CollectiveError {
        let error = CollectiveError::InvalidArgument {
            rank: self.global_rank(),
            op: op.to_string(),
            reason,
        };
        crate::flight::note_error(&error);
        error
    }

    fn send_frame(&self, call: &Call, to: usize, meta: Vec<u64>, payload: Bytes) -> Result<()> {
        let frame = Frame {
            header: Header {
                stream: StreamId {
                    group: self.id,
                    tag: StreamId::COLLECTIVE,
                },
                seq: call.seq,
                signature: call.signature.clone(),
                meta,
            },
            payload,
        };
        call.noted(self.transport.send(self.members[to], frame))
    }

    fn recv_frame(&self, call: &Call, from: usize) -> Result<Frame> {
        let peer = self.members[from];
        let stream = StreamId {
            group: self.id,
            tag: StreamId::COLLECTIVE,
        };
        if let Some(f) = &call.flight {
            f.waiting();
        }
        let frame = call.noted(self.transport.mailbox().recv(
            self.global_rank(),
            peer,
            stream,
            self.timeout,
            &|| call.signature.clone(),
        ))?;
        if frame.header.seq != call.seq || frame.header.signature != call.signature {
            return call.noted(Err(CollectiveError::Mismatch {
                rank: self.global_rank(),
                peer,
                ours: call.signature.clone(),
                theirs: frame.header.signature,
            }));
        }
        Ok(frame)
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size()
    }

    /// `call` as the backend's native collectives see it (see [`Transport::native`]).
    fn native_call<'a>(&'a self, call: &'a Call) -> NativeCall<'a> {
        if let Some(f) = &call.flight {
            f.waiting(); // the backend's collective waits for the peers from here
        }
        NativeCall {
            group: self.id,
            members: &self.members,
            rank: self.rank,
            timeout: self.timeout,
            signature: &call.signature,
        }
    }

    fn prev(&self) -> usize {
        (self.rank + self.size() - 1) % self.size()
    }

    // ------------------------------------------------------------------------------------
    // Ring algorithms on byte pieces (piece k ends on rank k).

    /// Ring reduce-scatter: `pieces[k]` is this rank's contribution to piece `k`; returns piece
    /// `rank` reduced over all ranks (in a pooled buffer). Each step sends one piece to the next
    /// rank and reduces the one received from the previous rank with this rank's contribution,
    /// in one pass into a pooled buffer that becomes the next message.
    fn ring_reduce_scatter(
        &self,
        call: &Call,
        pieces: &[&[u8]],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Vec<u8>> {
        let n = self.size();
        let r = self.rank;
        if n == 1 {
            let mut only = pool::take(pieces[0].len());
            only.copy_from_slice(pieces[0]);
            return Ok(only);
        }
        self.send_frame(
            call,
            self.next(),
            vec![],
            pool::copy_of(pieces[(r + n - 1) % n]),
        )?;
        for s in 0..n - 1 {
            let idx = (2 * n + r - 2 - s) % n;
            let frame = self.recv_frame(call, self.prev())?;
            let own = pieces[idx];
            if frame.payload.len() != own.len() {
                return Err(self.invalid(
                    &call.signature,
                    format!(
                        "piece {idx} has {} bytes on rank {} but {} bytes here",
                        frame.payload.len(),
                        self.members[self.prev()],
                        own.len()
                    ),
                ));
            }
            let last = s + 2 == n;
            // The division of an average is fused into the last reduction.
            let divide_by = if last && op == ReduceOp::Avg { n } else { 1 };
            let mut acc = pool::take(own.len());
            combine_to(&mut acc, &frame.payload, own, dtype, op, divide_by);
            drop(frame);
            if s + 2 < n {
                self.send_frame(call, self.next(), vec![], pool::share(acc))?;
            } else {
                return Ok(acc);
            }
        }
        unreachable!("the loop returns at its last step")
    }

    /// Waits until every rank of the group reached this point of `call`.
    fn sync(&self, call: &Call) -> Result<()> {
        self.ring_all_gather(call, Bytes::new(), vec![]).map(|_| ())
    }

    /// All-reduce through shared memory (ranks in one process): see [`crate::comm::shm`].
    fn shm_all_reduce(
        &self,
        call: &Call,
        board: &Board,
        storage: burn::tensor::Bytes,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<burn::tensor::Bytes> {
        let n = self.size();
        let r = self.rank;
        let key = |k: usize| (self.id, call.seq, self.members[k]);
        let mine = Arc::new(SharedBuffer::new(storage));
        board.post(key(r), mine.clone());
        let outcome = (|| {
            // Everyone has posted (and agrees on the call: frames carry the signature).
            self.sync(call)?;
            let peers = (0..n)
                .map(|k| {
                    board.get(&key(k)).ok_or_else(|| {
                        self.invalid(&call.signature, format!("rank {k} posted no buffer"))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            if let Some(k) = peers.iter().position(|p| p.len() != mine.len()) {
                return Err(self.invalid(
                    &call.signature,
                    format!(
                        "rank {} posted {} bytes, this rank {} bytes",
                        self.members[k],
                        peers[k].len(),
                        mine.len()
                    ),
                ));
            }
            let elem = dtype.size();
            let count = mine.len() / elem;
            let (base, extra) = (count / n, count % n);
            let start = (r * base + r.min(extra)) * elem;
            let chunk = start..start + (base + usize::from(r < extra)) * elem;
            // SAFETY: between the two barriers, chunk r of every buffer is read and written by
            // this rank alone (rank k touches only chunk k, and the chunks are disjoint); every
            // buffer has the same length (checked above) and the chunk ends on elements.
            unsafe { reduce_chunk_everywhere(&peers, chunk, dtype, op) };
            drop(peers);
            // Nobody reads anybody's buffer after this.
            self.sync(call)
        })();
        board.remove(&key(r));
        outcome?;
        match Arc::try_unwrap(mine) {
            Ok(buffer) => Ok(buffer.into_storage()),
            Err(_) => Err(self.invalid(
                &call.signature,
                "a peer still holds this rank's buffer after the final barrier".into(),
            )),
        }
    }

    /// Ring all-gather of one piece (with its metadata) per rank, returned in rank order.
    fn ring_all_gather(
        &self,
        call: &Call,
        mine: Bytes,
        meta: Vec<u64>,
    ) -> Result<Vec<(Bytes, Vec<u64>)>> {
        let n = self.size();
        let r = self.rank;
        let mut out: Vec<Option<(Bytes, Vec<u64>)>> = vec![None; n];
        out[r] = Some((mine, meta));
        for s in 0..n - 1 {
            let send_idx = (r + n - s) % n;
            let (payload, meta) = out[send_idx].clone().expect("filled at the previous step");
            self.send_frame(call, self.next(), meta, payload)?;
            let frame = self.recv_frame(call, self.prev())?;
            out[(r + 2 * n - s - 1) % n] = Some((frame.payload, frame.header.meta));
        }
        Ok(out
            .into_iter()
            .map(|p| p.expect("every piece arrives"))
            .collect())
    }

    // ------------------------------------------------------------------------------------
    // Collectives on host data.

    fn check_reducible(&self, op: &str, dtype: DType) -> Result<()> {
        if reducible(dtype) {
            Ok(())
        } else {
            Err(self.invalid(
                op,
                format!("dtype {dtype:?} cannot be reduced; cast to a float or int dtype first"),
            ))
        }
    }

    /// All-reduce of host data: every rank gets the element-wise `op` over all ranks.
    ///
    /// # Errors
    /// See [`CollectiveError`]; shapes and dtypes must agree on every rank.
    pub fn all_reduce_data(&self, data: TensorData, op: ReduceOp) -> Result<TensorData> {
        let _inside = self.host_call("all_reduce", data.dtype(), data.as_bytes().len());
        let dtype = data.dtype();
        let shape = data.shape().clone();
        let call = self.begin(
            "all_reduce",
            format!("{op} {}{:?}", dtype_name(dtype), shape.as_slice()),
        );
        self.check_reducible(&call.signature, dtype)?;
        let n = self.size();
        if n == 1 {
            return Ok(data);
        }
        // The result is written over the input's own storage: no allocation for the output.
        let elem = dtype.size();
        let mut storage = data.into_bytes();
        if let Some(native) = self.transport.native() {
            let mut out = pool::tensor_storage(storage.len() / elem, dtype);
            call.noted(native.all_reduce(&self.native_call(&call), &storage, &mut out, dtype, op))?;
            return Ok(TensorData::from_bytes(out, shape, dtype));
        }
        if let Some(board) = self.transport.board()
            && storage.len() >= SHM_MIN_BYTES
        {
            let storage = self.shm_all_reduce(&call, board, storage, dtype, op)?;
            return Ok(TensorData::from_bytes(storage, shape, dtype));
        }
        let count = storage.len() / elem;
        let (base, extra) = (count / n, count % n);
        let mut ranges = Vec::with_capacity(n);
        let mut start = 0;
        for k in 0..n {
            let len = (base + usize::from(k < extra)) * elem;
            ranges.push(start..start + len);
            start += len;
        }
        let mine = {
            let pieces: Vec<&[u8]> = ranges.iter().map(|r| &storage[r.clone()]).collect();
            self.ring_reduce_scatter(&call, &pieces, dtype, op)?
        };
        storage[ranges[self.rank].clone()].copy_from_slice(&mine);
        let gathered = self.ring_all_gather(&call, pool::share(mine), vec![])?;
        for (k, (piece, _)) in gathered.iter().enumerate() {
            if k != self.rank {
                storage[ranges[k].clone()].copy_from_slice(piece);
            }
        }
        Ok(TensorData::from_bytes(storage, shape, dtype))
    }

    /// All-gather of host data along `dim`: shards may differ in size along `dim` (every other
    /// dimension and the dtype must agree). Returns the concatenation in rank order.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when `dim` is out of range; see [`CollectiveError`].
    pub fn all_gather_data(&self, data: TensorData, dim: usize) -> Result<TensorData> {
        let _inside = self.host_call("all_gather", data.dtype(), data.as_bytes().len());
        let dtype = data.dtype();
        let shape = data.shape().as_slice().to_vec();
        let call = self.begin(
            "all_gather",
            format!(
                "dim {dim} {}{}",
                dtype_name(dtype),
                shape_except(&shape, dim)
            ),
        );
        if dim >= shape.len() {
            return Err(self.invalid(
                &call.signature,
                format!(
                    "dim {dim} is out of range for a tensor of rank {}",
                    shape.len()
                ),
            ));
        }
        if self.size() == 1 {
            return Ok(data);
        }
        let elem = dtype.size();
        let bytes = into_shared_bytes(data);
        let pieces: Vec<(Bytes, u64)> = match self.transport.native() {
            Some(native) => {
                call.noted(native.all_gather(&self.native_call(&call), &bytes, shape[dim] as u64))?
            }
            None => self
                .ring_all_gather(&call, bytes, vec![shape[dim] as u64])?
                .into_iter()
                .map(|(p, m)| (p, m[0]))
                .collect(),
        };
        let sizes: Vec<usize> = pieces.iter().map(|(_, m)| *m as usize).collect();
        let payloads: Vec<Bytes> = pieces.into_iter().map(|(p, _)| p).collect();
        let (outer, unit) = geometry(&shape, dim, elem);
        let mut out_shape = shape;
        out_shape[dim] = sizes.iter().sum();
        Ok(pool::tensor_data(out_shape, dtype, |out| {
            concat_into(out, &payloads, &sizes, outer, unit)
        }))
    }

    /// Reduce-scatter of host data along `dim`: the full tensor (same shape on every rank) is
    /// split into `sizes[k]` units along `dim` (an even split when `sizes` is `None`), reduced
    /// with `op`, and rank `k` receives piece `k`.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when the sizes do not add up to the dimension, or the
    /// dimension is not divisible by the group size and no sizes are given.
    pub fn reduce_scatter_data(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
        sizes: Option<&[usize]>,
    ) -> Result<TensorData> {
        let _inside = self.host_call("reduce_scatter", data.dtype(), data.as_bytes().len());
        let dtype = data.dtype();
        let shape = data.shape().as_slice().to_vec();
        let call = self.begin(
            "reduce_scatter",
            format!(
                "{op} dim {dim} sizes {sizes:?} {}{shape:?}",
                dtype_name(dtype)
            ),
        );
        self.check_reducible(&call.signature, dtype)?;
        let n = self.size();
        if dim >= shape.len() {
            return Err(self.invalid(
                &call.signature,
                format!(
                    "dim {dim} is out of range for a tensor of rank {}",
                    shape.len()
                ),
            ));
        }
        let sizes = match sizes {
            Some(s) if s.len() != n || s.iter().sum::<usize>() != shape[dim] => {
                return Err(self.invalid(
                    &call.signature,
                    format!(
                        "{} sizes adding up to {} given for {n} ranks and dimension {dim} of \
                         size {}",
                        s.len(),
                        s.iter().sum::<usize>(),
                        shape[dim]
                    ),
                ));
            }
            Some(s) => s.to_vec(),
            None if !shape[dim].is_multiple_of(n) => {
                return Err(self.invalid(
                    &call.signature,
                    format!(
                        "dimension {dim} of size {} is not divisible by {n} ranks; pass the \
                         per-rank sizes explicitly",
                        shape[dim]
                    ),
                ));
            }
            None => vec![shape[dim] / n; n],
        };
        let elem = dtype.size();
        let bytes = into_shared_bytes(data);
        let pieces = split_along(&bytes, &shape, dim, &sizes, elem);
        let refs: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
        let mine = match self.transport.native() {
            Some(native) => {
                let lens: Vec<usize> = refs.iter().map(|p| p.len()).collect();
                let packed = packed(&bytes, &refs, &shape, dim, elem);
                call.noted(native.reduce_scatter(
                    &self.native_call(&call),
                    &packed,
                    &lens,
                    dtype,
                    op,
                ))?
            }
            None => self.ring_reduce_scatter(&call, &refs, dtype, op)?,
        };
        let mut out_shape = shape;
        out_shape[dim] = sizes[self.rank];
        let out = pool::tensor_data(out_shape, dtype, |out| out.copy_from_slice(&mine));
        pool::give(mine);
        Ok(out)
    }

    /// Broadcast of host data from group rank `root`; every rank must pass data of the same
    /// shape and dtype (non-root contents are ignored).
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn broadcast_data(&self, data: TensorData, root: usize) -> Result<TensorData> {
        let _inside = self.host_call("broadcast", data.dtype(), data.as_bytes().len());
        let dtype = data.dtype();
        let shape = data.shape().clone();
        let call = self.begin(
            "broadcast",
            format!("root {root} {}{:?}", dtype_name(dtype), shape.as_slice()),
        );
        if root >= self.size() {
            return Err(self.invalid(
                &call.signature,
                format!("root {root} is out of range for {} ranks", self.size()),
            ));
        }
        if let Some(native) = self.transport.native() {
            let mut storage = data.into_bytes();
            call.noted(native.broadcast(&self.native_call(&call), &mut storage, root))?;
            return Ok(TensorData::from_bytes(storage, shape, dtype));
        }
        if self.rank == root {
            self.star_broadcast(&call, root, || pool::copy_of(data.as_bytes()))?;
            return Ok(data);
        }
        let payload = self.star_broadcast(&call, root, Bytes::new)?;
        if payload.len() != data.as_bytes().len() {
            return Err(self.invalid(
                &call.signature,
                format!("received {} bytes from the root", payload.len()),
            ));
        }
        Ok(pool::tensor_data(shape.as_slice().to_vec(), dtype, |out| {
            out.copy_from_slice(&payload)
        }))
    }

    fn star_broadcast(
        &self,
        call: &Call,
        root: usize,
        data: impl FnOnce() -> Bytes,
    ) -> Result<Bytes> {
        if self.rank == root {
            let payload = data();
            for peer in (0..self.size()).filter(|&p| p != root) {
                self.send_frame(call, peer, vec![], payload.clone())?;
            }
            Ok(payload)
        } else {
            Ok(self.recv_frame(call, root)?.payload)
        }
    }

    /// All-to-all of host data along `dim`: the tensor is split into `send_sizes[k]` units
    /// along `dim`, piece `k` goes to rank `k`, and the pieces received from every rank are
    /// concatenated along `dim` in rank order (their sizes need not match).
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when the sizes do not add up; see [`CollectiveError`].
    pub fn all_to_all_data(
        &self,
        data: TensorData,
        dim: usize,
        send_sizes: &[usize],
    ) -> Result<TensorData> {
        Ok(self.all_to_all_dims_data(data, dim, send_sizes, dim)?.0)
    }

    /// All-to-all that splits along `split_dim` and concatenates along `concat_dim` (Ulysses
    /// sequence parallelism swaps heads and sequence this way). Returns the result and the
    /// size along `concat_dim` of the piece received from each rank (the `send_sizes` of the
    /// inverse all-to-all).
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when the sizes do not add up or a dimension is out
    /// of range; [`CollectiveError::Mismatch`] when a received piece does not fit.
    pub fn all_to_all_dims_data(
        &self,
        data: TensorData,
        split_dim: usize,
        send_sizes: &[usize],
        concat_dim: usize,
    ) -> Result<(TensorData, Vec<usize>)> {
        let _inside = self.host_call("all_to_all", data.dtype(), data.as_bytes().len());
        let dtype = data.dtype();
        let shape = data.shape().as_slice().to_vec();
        let call = self.begin(
            "all_to_all",
            format!(
                "split {split_dim} concat {concat_dim} {}",
                dtype_name(dtype)
            ),
        );
        let n = self.size();
        if split_dim >= shape.len()
            || concat_dim >= shape.len()
            || send_sizes.len() != n
            || send_sizes.iter().sum::<usize>() != shape[split_dim]
        {
            return Err(self.invalid(
                &call.signature,
                format!(
                    "send sizes {send_sizes:?} must have one entry per rank ({n}) adding up to \
                     dimension {split_dim} of shape {shape:?} (concat dim {concat_dim})"
                ),
            ));
        }
        let elem = dtype.size();
        let bytes = into_shared_bytes(data);
        let pieces = split_along(&bytes, &shape, split_dim, send_sizes, elem);
        let piece_shape = |k: usize| {
            let mut s = shape.clone();
            s[split_dim] = send_sizes[k];
            s
        };
        let mut received: Vec<Bytes> = vec![Bytes::new(); n];
        let mut shapes: Vec<Vec<usize>> = vec![Vec::new(); n];
        received[self.rank] = pieces[self.rank].clone();
        shapes[self.rank] = piece_shape(self.rank);
        let metas: Vec<Vec<u64>> = (0..n)
            .map(|k| piece_shape(k).iter().map(|&d| d as u64).collect())
            .collect();
        let mut native = match self.transport.native() {
            Some(native) => {
                let refs: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
                let lens: Vec<usize> = refs.iter().map(|p| p.len()).collect();
                let packed = packed(&bytes, &refs, &shape, split_dim, elem);
                Some(call.noted(native.all_to_all(
                    &self.native_call(&call),
                    &packed,
                    &lens,
                    &metas,
                ))?)
            }
            None => {
                for s in 1..n {
                    let to = (self.rank + s) % n;
                    self.send_frame(&call, to, metas[to].clone(), pieces[to].clone())?;
                }
                None
            }
        };
        for s in 1..n {
            let from = (self.rank + n - s) % n;
            let frame = match &mut native {
                Some(incoming) => {
                    let (payload, meta) = std::mem::take(&mut incoming[from]);
                    Frame {
                        header: Header {
                            stream: StreamId {
                                group: self.id,
                                tag: StreamId::COLLECTIVE,
                            },
                            seq: call.seq,
                            signature: call.signature.clone(),
                            meta,
                        },
                        payload,
                    }
                }
                None => self.recv_frame(&call, from)?,
            };
            let got: Vec<usize> = frame.header.meta.iter().map(|&d| d as usize).collect();
            let fits = got.len() == shape.len()
                && got.iter().product::<usize>() * elem == frame.payload.len()
                && (0..shape.len()).all(|d| d == concat_dim || got[d] == shapes[self.rank][d]);
            if !fits {
                return call.noted(Err(CollectiveError::Mismatch {
                    rank: self.global_rank(),
                    peer: self.members[from],
                    ours: format!(
                        "{} expecting pieces shaped like {:?} except along dim {concat_dim}",
                        call.signature, shapes[self.rank]
                    ),
                    theirs: format!("a piece of shape {got:?}"),
                }));
            }
            shapes[from] = got;
            received[from] = frame.payload;
        }
        let sizes: Vec<usize> = shapes.iter().map(|s| s[concat_dim]).collect();
        let (outer, unit) = geometry(&shapes[self.rank], concat_dim, elem);
        let mut out_shape = shapes[self.rank].clone();
        out_shape[concat_dim] = sizes.iter().sum();
        let out = pool::tensor_data(out_shape, dtype, |out| {
            concat_into(out, &received, &sizes, outer, unit)
        });
        Ok((out, sizes))
    }

    /// Waits until every rank of the group has reached the barrier.
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn barrier(&self) -> Result<()> {
        let call = self.begin("barrier", String::new());
        if self.size() > 1 {
            match self.transport.native() {
                Some(native) => call.noted(native.barrier(&self.native_call(&call)))?,
                None => {
                    self.ring_all_gather(&call, Bytes::new(), vec![])?;
                }
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------------
    // Point to point.

    fn p2p_stream(&self, tag: u64) -> StreamId {
        StreamId {
            group: self.id,
            tag,
        }
    }

    fn check_peer(&self, op: &str, peer: usize, tag: u64) -> Result<()> {
        if peer >= self.size() || peer == self.rank {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} must be another rank of this group of {} ranks",
                    self.size()
                ),
            ));
        }
        if tag >= StreamId::CHANNEL_SETUP {
            return Err(self.invalid(
                op,
                format!(
                    "tag {tag} is reserved (u64::MAX for collectives, u64::MAX - 1 for NCCL's \
                     channels); use a smaller tag"
                ),
            ));
        }
        Ok(())
    }

    /// Sends `bytes` to group rank `peer` on the stream reserved for setting up NCCL's
    /// channels ([`StreamId::CHANNEL_SETUP`]).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn send_setup(&self, bytes: Vec<u8>, peer: usize) -> Result<()> {
        let frame = Frame {
            header: Header {
                stream: self.p2p_stream(StreamId::CHANNEL_SETUP),
                seq: 0,
                signature: "nccl channel setup".into(),
                meta: Vec::new(),
            },
            payload: Bytes::from(bytes),
        };
        self.transport.send(self.members[peer], frame)
    }

    /// Receives what group rank `peer` sent with [`Self::send_setup`].
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn recv_setup(&self, peer: usize) -> Result<Vec<u8>> {
        let frame = self.transport.mailbox().recv(
            self.global_rank(),
            self.members[peer],
            self.p2p_stream(StreamId::CHANNEL_SETUP),
            self.timeout,
            &|| format!("nccl channel setup (from rank {peer})"),
        )?;
        Ok(frame.payload.to_vec())
    }

    /// Sends host data to group rank `peer` under `tag`; returns without waiting for the
    /// receiver. Messages with the same `(peer, tag)` arrive in order.
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn send_data(&self, data: TensorData, peer: usize, tag: u64) -> Result<()> {
        let bytes = data.as_bytes().len();
        let _inside = self.host_call_p2p("send", data.dtype(), bytes, Some((peer, tag)));
        let flight = self.p2p_flight("send", tag, Some((data.dtype(), bytes)), peer);
        self.check_peer("send", peer, tag)?;
        let dtype = data.dtype();
        let code = dtype_code(dtype)
            .ok_or_else(|| self.invalid("send", format!("dtype {dtype:?} cannot be sent")))?;
        let mut meta = vec![code];
        meta.extend(data.shape().as_slice().iter().map(|&d| d as u64));
        let frame = Frame {
            header: Header {
                stream: self.p2p_stream(tag),
                seq: 0,
                signature: format!("send(tag {tag})"),
                meta,
            },
            payload: into_shared_bytes(data),
        };
        let sent = self.transport.send(self.members[peer], frame);
        if let (Err(e), Some(f)) = (&sent, &flight) {
            f.fail(e);
        }
        sent
    }

    /// The flight recorder's entry of a point-to-point call with group rank `peer`.
    fn p2p_flight(
        &self,
        op: &'static str,
        tag: u64,
        payload: Option<(DType, usize)>,
        peer: usize,
    ) -> Option<InFlight> {
        let f = self.flight.as_ref()?;
        crate::flight::clear_noted();
        let signature = format!("{op}(tag {tag})");
        let global = self.members.get(peer).copied().unwrap_or(peer);
        Some(f.issue(0, self.id, op, &signature, payload, Some((global, tag))))
    }

    /// The payload of a message group rank `peer` sent under `tag` with [`Self::send_data`],
    /// if one has arrived: never waits (for polling a request that may or may not come; not
    /// logged in the flight recorder).
    ///
    /// # Errors
    /// [`CollectiveError::PeerFailed`] when `peer` is gone (failed or shut down) and nothing
    /// from it is left; [`CollectiveError::InvalidArgument`] for a rank out of range.
    pub(crate) fn try_recv_bytes(&self, peer: usize, tag: u64) -> Result<Option<Vec<u8>>> {
        self.check_peer("poll", peer, tag)?;
        let received = self.transport.mailbox().recv(
            self.global_rank(),
            self.members[peer],
            self.p2p_stream(tag),
            Duration::ZERO,
            &|| format!("poll(from rank {peer}, tag {tag})"),
        );
        match received {
            Ok(frame) => Ok(Some(frame.payload.to_vec())),
            Err(CollectiveError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Receives the next host data sent by group rank `peer` under `tag`.
    ///
    /// # Errors
    /// See [`CollectiveError`]; a malformed header is a [`CollectiveError::Transport`] error.
    pub fn recv_data(&self, peer: usize, tag: u64) -> Result<TensorData> {
        let flight = self.p2p_flight("recv", tag, None, peer);
        self.check_peer("recv", peer, tag)?;
        let global = self.members[peer];
        if let Some(f) = &flight {
            f.waiting();
        }
        let received = self.transport.mailbox().recv(
            self.global_rank(),
            global,
            self.p2p_stream(tag),
            self.timeout,
            &|| format!("recv(from rank {peer}, tag {tag})"),
        );
        if let (Err(e), Some(f)) = (&received, &flight) {
            f.fail(e);
        }
        let frame = received?;
        let bad = |reason: &str| {
            let error = CollectiveError::Transport {
                rank: self.global_rank(),
                peer: global,
                reason: format!("malformed message under tag {tag}: {reason}"),
            };
            crate::flight::note_error(&error);
            error
        };
        let (&code, dims) = frame
            .header
            .meta
            .split_first()
            .ok_or_else(|| bad("no dtype"))?;
        let dtype = dtype_from_code(code).ok_or_else(|| bad("unknown dtype"))?;
        let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        if shape.iter().product::<usize>() * dtype.size() != frame.payload.len() {
            return Err(bad("payload length does not match its shape"));
        }
        Ok(pool::tensor_data(shape, dtype, |out| {
            out.copy_from_slice(&frame.payload)
        }))
    }

    // ------------------------------------------------------------------------------------
    // Bytes and objects.

    /// Broadcasts a byte buffer from `root` (the buffer passed by other ranks is ignored).
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        let _inside = self.host_call("broadcast_bytes", DType::U8, bytes.len());
        let call = self.begin("broadcast_bytes", format!("root {root}"));
        if root >= self.size() {
            return Err(self.invalid(&call.signature, format!("root {root} is out of range")));
        }
        Ok(self
            .star_broadcast(&call, root, || Bytes::from(bytes))?
            .to_vec())
    }

    /// Gathers every rank's byte buffer on every rank, in rank order.
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let _inside = self.host_call("all_gather_bytes", DType::U8, bytes.len());
        let call = self.begin("all_gather_bytes", String::new());
        let pieces = self.ring_all_gather(&call, Bytes::from(bytes), vec![])?;
        Ok(pieces.into_iter().map(|(p, _)| p.to_vec()).collect())
    }

    /// Gathers every rank's byte buffer on `root` (`Some` there, `None` elsewhere).
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn gather_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Option<Vec<Vec<u8>>>> {
        let _inside = self.host_call("gather_bytes", DType::U8, bytes.len());
        let call = self.begin("gather_bytes", format!("root {root}"));
        if root >= self.size() {
            return Err(self.invalid(&call.signature, format!("root {root} is out of range")));
        }
        if self.rank != root {
            self.send_frame(&call, root, vec![], Bytes::from(bytes))?;
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.size());
        for k in 0..self.size() {
            if k == root {
                out.push(Vec::new());
            } else {
                out.push(self.recv_frame(&call, k)?.payload.to_vec());
            }
        }
        out[root] = bytes;
        Ok(Some(out))
    }

    /// Broadcasts a serde value from `root`. Other ranks pass `None`.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when the root passes `None` or the value does not
    /// (de)serialise; see [`CollectiveError`].
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T> {
        let bytes = match (self.rank == root, value) {
            (true, Some(v)) => serde_json::to_vec(v)
                .map_err(|e| self.invalid("broadcast_object", format!("serialising: {e}")))?,
            (true, None) => {
                return Err(self.invalid("broadcast_object", "the root must pass a value".into()));
            }
            (false, _) => Vec::new(),
        };
        let bytes = self.broadcast_bytes(bytes, root)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| self.invalid("broadcast_object", format!("deserialising: {e}")))
    }

    /// Gathers a serde value from every rank on every rank, in rank order.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when a value does not (de)serialise.
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(value)
            .map_err(|e| self.invalid("all_gather_object", format!("serialising: {e}")))?;
        self.all_gather_bytes(bytes)?
            .iter()
            .map(|b| {
                serde_json::from_slice(b)
                    .map_err(|e| self.invalid("all_gather_object", format!("deserialising: {e}")))
            })
            .collect()
    }

    /// All-reduce of a vector of `f32` (a convenience for metrics and small control values).
    ///
    /// # Errors
    /// See [`CollectiveError`].
    pub fn all_reduce_f32(&self, values: Vec<f32>, op: ReduceOp) -> Result<Vec<f32>> {
        let len = values.len();
        let data = self.all_reduce_data(TensorData::new(values, [len]), op)?;
        Ok(data.try_to_vec::<f32>().expect("f32 in, f32 out"))
    }

    // ------------------------------------------------------------------------------------
    // Collectives on Burn tensors (not differentiable: see `crate::autograd` for those).

    /// All-reduce of a tensor; the result lives on the input's device.
    ///
    /// # Errors
    /// See [`ProcessGroup::all_reduce_data`].
    pub fn all_reduce<const D: usize>(&self, tensor: Tensor<D>, op: ReduceOp) -> Result<Tensor<D>> {
        let _inside = self.logged_tensor("all_reduce", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::all_reduce(self, tensor, op)? {
            Ok(out) => return Ok(out),
            Err(tensor) => tensor,
        };
        on_host(tensor, |data| self.all_reduce_data(data, op))
    }

    /// All-gather of a tensor along `dim` (uneven shards allowed).
    ///
    /// # Errors
    /// See [`ProcessGroup::all_gather_data`].
    pub fn all_gather<const D: usize>(&self, tensor: Tensor<D>, dim: usize) -> Result<Tensor<D>> {
        let _inside = self.logged_tensor("all_gather", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::all_gather(self, tensor, dim)? {
            Ok(out) => return Ok(out),
            Err(tensor) => tensor,
        };
        on_host(tensor, |data| self.all_gather_data(data, dim))
    }

    /// Reduce-scatter of a tensor along `dim` (`sizes`: per-rank sizes, even when `None`).
    ///
    /// # Errors
    /// See [`ProcessGroup::reduce_scatter_data`].
    pub fn reduce_scatter<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
        op: ReduceOp,
        sizes: Option<&[usize]>,
    ) -> Result<Tensor<D>> {
        let _inside = self.logged_tensor("reduce_scatter", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::reduce_scatter(self, tensor, dim, op, sizes)?
        {
            Ok(out) => return Ok(out),
            Err(tensor) => tensor,
        };
        on_host(tensor, |data| {
            self.reduce_scatter_data(data, dim, op, sizes)
        })
    }

    /// All-reduce of many 1-D tensors as few collectives: those of one dtype on one device are
    /// laid end to end and reduced in one call, then cut back (torch's
    /// `all_reduce_coalesced`). For many small gradients, such as the norms' of sequence
    /// parallelism or FSDP's shards across replicas, where one NCCL launch each would cost more
    /// than the data. Returns the results in the order given; every rank passes the same
    /// lengths, dtypes and devices in the same order.
    ///
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::{ReduceOp, run_local};
    ///
    /// let out = run_local(2, |group| {
    ///     let device = Device::flex();
    ///     let r = group.rank() as f32;
    ///     let a = Tensor::<1>::from_floats([r, 1.0], &device);
    ///     let b = Tensor::<1>::from_floats([10.0 * r], &device);
    ///     let sums = group.all_reduce_coalesced(vec![a, b], ReduceOp::Sum)?;
    ///     Ok(sums.into_iter().map(|t| t.into_data().to_vec::<f32>().unwrap()).collect::<Vec<_>>())
    /// })
    /// .unwrap();
    /// assert_eq!(out[0], vec![vec![1.0, 2.0], vec![10.0]]);
    /// ```
    ///
    /// # Errors
    /// See [`ProcessGroup::all_reduce`].
    pub fn all_reduce_coalesced(
        &self,
        tensors: Vec<Tensor<1>>,
        op: ReduceOp,
    ) -> Result<Vec<Tensor<1>>> {
        // The positions of each (dtype, device) kind, in order of first appearance.
        let mut kinds: Vec<(DType, burn::tensor::Device, Vec<usize>)> = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let (dtype, device) = (t.dtype(), t.device());
            match kinds
                .iter_mut()
                .find(|(d, dev, _)| *d == dtype && *dev == device)
            {
                Some((_, _, at)) => at.push(i),
                None => kinds.push((dtype, device, vec![i])),
            }
        }
        let mut slots: Vec<Option<Tensor<1>>> = tensors.into_iter().map(Some).collect();
        let mut out: Vec<Option<Tensor<1>>> = vec![None; slots.len()];
        for (_, _, at) in kinds {
            let parts: Vec<Tensor<1>> = at
                .iter()
                .map(|&i| slots[i].take().expect("each tensor is taken once"))
                .collect();
            let lens: Vec<usize> = parts.iter().map(|t| t.dims()[0]).collect();
            let flat = match parts.len() {
                1 => parts.into_iter().next().expect("one part"),
                _ => Tensor::cat(parts, 0),
            };
            let reduced = self.all_reduce(flat, op)?;
            let mut start = 0;
            for (&i, len) in at.iter().zip(lens) {
                out[i] = Some(reduced.clone().slice(start..start + len));
                start += len;
            }
        }
        Ok(out
            .into_iter()
            .map(|t| t.expect("every position filled"))
            .collect())
    }

    /// Broadcast of a tensor from group rank `root`.
    ///
    /// # Errors
    /// See [`ProcessGroup::broadcast_data`].
    pub fn broadcast<const D: usize>(&self, tensor: Tensor<D>, root: usize) -> Result<Tensor<D>> {
        let _inside = self.logged_tensor("broadcast", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::broadcast(self, tensor, root)? {
            Ok(out) => return Ok(out),
            Err(tensor) => tensor,
        };
        on_host(tensor, |data| self.broadcast_data(data, root))
    }

    /// All-to-all of a tensor along `dim` with per-destination sizes.
    ///
    /// # Errors
    /// See [`ProcessGroup::all_to_all_data`].
    pub fn all_to_all<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
        send_sizes: &[usize],
    ) -> Result<Tensor<D>> {
        let _inside = self.logged_tensor("all_to_all", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::all_to_all(self, tensor, dim, send_sizes)? {
            Ok(out) => return Ok(out),
            Err(tensor) => tensor,
        };
        on_host(tensor, |data| self.all_to_all_data(data, dim, send_sizes))
    }

    /// Sends a tensor to group rank `peer` under `tag`; returns without waiting for the
    /// receiver, on every backend.
    ///
    /// On an NCCL group with a CUDA tensor the data goes through NCCL in device memory, on the
    /// channel of this direction between the two ranks (a two-rank communicator with a stream
    /// of its own, created by [`ProcessGroup::connect_peers`] or at the pair's first device
    /// message): the send is launched after the kernels that produce the tensor, and its
    /// buffer is held until it completed. NCCL matches the device messages of one direction in
    /// the order they were sent, whatever their tag: the receiver must take them in that
    /// order (a mismatch is a [`CollectiveError::Mismatch`]). A small host frame under `tag`
    /// announces each one (its dtype and shape).
    ///
    /// # Errors
    /// See [`ProcessGroup::send_data`]; on NCCL a failure of an earlier device send to `peer`
    /// (see [`ProcessGroup::wait_p2p`]).
    pub fn send<const D: usize>(&self, tensor: Tensor<D>, peer: usize, tag: u64) -> Result<()> {
        let _inside = self.logged_p2p("send", &tensor, peer, tag);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::send(self, tensor, peer, tag)? {
            Ok(()) => return Ok(()),
            Err(tensor) => tensor,
        };
        self.send_data(tensor.into_data(), peer, tag)
    }

    /// Receives a tensor of rank `D` from group rank `peer` under `tag`, onto `device`.
    ///
    /// On an NCCL group with a CUDA `device`, a tensor the peer sent from its CUDA device comes
    /// through NCCL: the receive is launched on the direction's channel and Burn's stream waits
    /// for it on the device, so this returns as soon as the announcement arrived.
    ///
    /// # Errors
    /// See [`ProcessGroup::recv_data`]; also when the received tensor is not of rank `D`.
    pub fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        device: &burn::tensor::Device,
    ) -> Result<Tensor<D>> {
        let received = {
            let _inside = Inside::enter();
            self.recv_tensor(peer, tag, device)?
        };
        // Logged once received: its size is known then.
        drop(self.logged_p2p("recv", &received, peer, tag));
        Ok(received)
    }

    /// Prepares the point-to-point traffic of this rank with `peers` for tensors on `device`.
    /// On an NCCL group with a CUDA `device` it creates now the channel of each direction
    /// between this rank and each peer (two-rank NCCL communicators), which otherwise are
    /// created at a pair's first device message: creation waits for both ranks, so a first
    /// send would wait for its receiver. Elsewhere it only checks `peers`.
    ///
    /// Each peer must call it too, with this rank among its `peers`. Pairs are connected in
    /// one order on every rank (by their lower, then higher rank), so any set of ranks that
    /// call it together cannot deadlock, whatever peers each names.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when a peer is not another rank of the group;
    /// [`CollectiveError::Nccl`] when a channel cannot be created (within the group's timeout).
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::run_local;
    ///
    /// // Two ranks of a pipeline: connected once, then any number of sends either way.
    /// let got = run_local(2, |group| {
    ///     let device = Device::flex();
    ///     let peer = 1 - group.rank();
    ///     group.connect_peers(&[peer], &device)?;
    ///     group.send(Tensor::<1>::from_floats([group.rank() as f32], &device), peer, 3)?;
    ///     let x: Tensor<1> = group.recv(peer, 3, &device)?;
    ///     group.wait_p2p()?;
    ///     Ok(x.into_data().to_vec::<f32>().unwrap()[0])
    /// })
    /// .unwrap();
    /// assert_eq!(got, vec![1.0, 0.0]);
    /// ```
    pub fn connect_peers(&self, peers: &[usize], device: &burn::tensor::Device) -> Result<()> {
        for &peer in peers {
            self.check_peer("connect_peers", peer, 0)?;
        }
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        crate::comm::nccl::device::connect_peers(self, peers, device)?;
        #[cfg(not(all(feature = "nccl", feature = "cuda")))]
        let _ = device;
        Ok(())
    }

    /// Waits until every tensor this rank sent or received on this group's device channels
    /// (NCCL) has arrived, and returns the first failure among them: a device send or
    /// receive fails after its call returned (a dead peer, a timeout), and the data Burn's
    /// stream read from a failed receive is garbage. Call it before using what a step
    /// received for anything that lasts (the optimizer step). Returns at once on the host
    /// transports, whose sends and receives complete or fail in their calls.
    ///
    /// # Errors
    /// [`CollectiveError::Nccl`] naming the failed transfer and why.
    pub fn wait_p2p(&self) -> Result<()> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = &self.nccl {
            return crate::comm::nccl::wait_channels(self, nccl);
        }
        Ok(())
    }

    /// [`ProcessGroup::recv`], not logged.
    fn recv_tensor<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        device: &burn::tensor::Device,
    ) -> Result<Tensor<D>> {
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let data = match crate::comm::nccl::device::recv(self, peer, tag, device)? {
            Some(crate::comm::nccl::device::Received::Device(flat, shape)) => {
                if shape.len() != D {
                    return Err(self.invalid(
                        "recv",
                        format!(
                            "expected a tensor of rank {D} from rank {peer} (tag {tag}) but got \
                             shape {shape:?}"
                        ),
                    ));
                }
                let shape: [usize; D] = shape.try_into().expect("length checked");
                return Ok((*flat).reshape(shape));
            }
            Some(crate::comm::nccl::device::Received::Host(data)) => data,
            None => self.recv_data(peer, tag)?,
        };
        #[cfg(not(all(feature = "nccl", feature = "cuda")))]
        let data = self.recv_data(peer, tag)?;
        if data.shape().len() != D {
            return Err(self.invalid(
                "recv",
                format!(
                    "expected a tensor of rank {D} from rank {peer} (tag {tag}) but got shape {:?}",
                    data.shape().as_slice()
                ),
            ));
        }
        Ok(tensor_from_data(data, device))
    }

    /// Starts the exchange of a ring: sends `tensor` to group rank `to` and receives a tensor
    /// of rank `D` from group rank `from`, both under `tag`; [`SendRecv::wait`] completes it
    /// and returns what was received, on `tensor`'s device.
    ///
    /// The send leaves at once on every backend (see [`ProcessGroup::send`]: on NCCL each
    /// direction between two ranks has a channel of its own, so a ring of ranks that all send
    /// first and receive second cannot deadlock), so the caller can compute while the block
    /// travels and wait afterwards. On NCCL the channels with `to` and `from` are connected at
    /// the first call ([`ProcessGroup::connect_peers`]), so every rank of the ring makes its
    /// first call together.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when `to` or `from` is not another rank of the
    /// group or `tag` is reserved; those of [`ProcessGroup::send`] and [`ProcessGroup::recv`].
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::run_local;
    ///
    /// // Three ranks pass their rank to the next one around the ring.
    /// let got = run_local(3, |group| {
    ///     let (r, n) = (group.rank(), group.size());
    ///     let mine = Tensor::<1>::from_floats([r as f32], &Device::flex());
    ///     let shift = group.send_recv(mine, (r + 1) % n, (r + n - 1) % n, 7)?;
    ///     // ... compute here while the block travels ...
    ///     Ok(shift.wait()?.into_data().to_vec::<f32>().unwrap()[0])
    /// })
    /// .unwrap();
    /// assert_eq!(got, vec![2.0, 0.0, 1.0]);
    /// ```
    pub fn send_recv<const D: usize>(
        &self,
        tensor: Tensor<D>,
        to: usize,
        from: usize,
        tag: u64,
    ) -> Result<SendRecv<D>> {
        self.check_peer("send_recv", to, tag)?;
        self.check_peer("send_recv", from, tag)?;
        let device = tensor.device();
        self.connect_peers(&[to, from], &device)?;
        self.send(tensor, to, tag)?;
        Ok(SendRecv {
            group: self.clone(),
            from,
            tag,
            device,
        })
    }
}

/// An exchange started by [`ProcessGroup::send_recv`]; [`SendRecv::wait`] completes it.
#[must_use = "the receive completes only in SendRecv::wait"]
#[derive(Debug)]
pub struct SendRecv<const D: usize> {
    group: ProcessGroup,
    from: usize,
    tag: u64,
    device: burn::tensor::Device,
}

impl<const D: usize> SendRecv<D> {
    /// Completes the exchange: returns the tensor received from `from`, on the device of the
    /// tensor sent.
    ///
    /// # Errors
    /// Those of [`ProcessGroup::recv`] (a dead peer, a timeout, a tensor of another rank than
    /// `D`).
    pub fn wait(self) -> Result<Tensor<D>> {
        self.group.recv(self.from, self.tag, &self.device)
    }
}

/// Shape with `dim` shown as `*` (the part of a shape every rank must agree on).
fn shape_except(shape: &[usize], dim: usize) -> String {
    let parts: Vec<String> = shape
        .iter()
        .enumerate()
        .map(|(i, d)| if i == dim { "*".into() } else { d.to_string() })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// The pieces of `bytes` split along `dim`, packed in order: `bytes` itself when the split is
/// along the first non-trivial dimension (the pieces are then consecutive), else a copy.
fn packed<'a>(
    bytes: &'a [u8],
    pieces: &[&[u8]],
    shape: &[usize],
    dim: usize,
    elem: usize,
) -> std::borrow::Cow<'a, [u8]> {
    if geometry(shape, dim, elem).0 == 1 {
        std::borrow::Cow::Borrowed(bytes)
    } else {
        std::borrow::Cow::Owned(pieces.concat())
    }
}

/// Keeps a tensor's storage alive inside a message payload.
struct Storage(burn::tensor::Bytes);

impl AsRef<[u8]> for Storage {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Moves tensor bytes into a shareable payload, without copying.
fn into_shared_bytes(data: TensorData) -> Bytes {
    Bytes::from_owner(Storage(data.into_bytes()))
}

/// Runs a host-data collective on a tensor: stages it to the host, and puts the result back on
/// the tensor's device.
fn on_host<const D: usize>(
    tensor: Tensor<D>,
    collective: impl FnOnce(TensorData) -> Result<TensorData>,
) -> Result<Tensor<D>> {
    let device = tensor.device();
    Ok(tensor_from_data(collective(tensor.into_data())?, &device))
}

/// A tensor on `device` holding `data` in its own dtype (Burn's `from_data` would convert it to
/// the device's default float dtype).
pub fn tensor_from_data<const D: usize>(
    data: TensorData,
    device: &burn::tensor::Device,
) -> Tensor<D> {
    let dtype = data.dtype();
    Tensor::from_data(data, (device, dtype))
}

/// What the NCCL backend, below the group, needs of it.
impl crate::comm::nccl::NcclHost for ProcessGroup {
    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }
    fn size(&self) -> usize {
        ProcessGroup::size(self)
    }
    fn global_rank(&self) -> usize {
        ProcessGroup::global_rank(self)
    }
    fn members(&self) -> &[usize] {
        ProcessGroup::members(self)
    }
    fn timeout(&self) -> Duration {
        ProcessGroup::timeout(self)
    }
    fn backend(&self) -> &'static str {
        ProcessGroup::backend(self)
    }
    fn nccl(&self) -> Option<&crate::comm::nccl::DeviceComm> {
        ProcessGroup::nccl(self)
    }
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        ProcessGroup::all_gather_bytes(self, bytes)
    }
    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        ProcessGroup::broadcast_bytes(self, bytes, root)
    }
    fn send_data(&self, data: TensorData, peer: usize, tag: u64) -> Result<()> {
        ProcessGroup::send_data(self, data, peer, tag)
    }
    fn recv_data(&self, peer: usize, tag: u64) -> Result<TensorData> {
        ProcessGroup::recv_data(self, peer, tag)
    }
    fn send_setup(&self, bytes: Vec<u8>, peer: usize) -> Result<()> {
        ProcessGroup::send_setup(self, bytes, peer)
    }
    fn recv_setup(&self, peer: usize) -> Result<Vec<u8>> {
        ProcessGroup::recv_setup(self, peer)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use crate::run_local;

    /// The stream that sets up NCCL's channels is apart from every user tag: setup bytes and a
    /// user message, sent in either order, each reach their own receive.
    #[test]
    fn the_channel_setup_stream_is_apart_from_user_tags() {
        let got = run_local(2, |g| {
            let peer = 1 - g.rank();
            g.send_data(TensorData::new(vec![7u8], [1]), peer, u64::MAX - 2)?;
            g.send_setup(vec![g.rank() as u8; 3], peer)?;
            let setup = g.recv_setup(peer)?;
            let user = g.recv_data(peer, u64::MAX - 2)?;
            Ok((setup, user.try_to_vec::<u8>().unwrap()))
        })
        .unwrap();
        assert_eq!(got[0], (vec![1, 1, 1], vec![7]));
        assert_eq!(got[1], (vec![0, 0, 0], vec![7]));
    }
}
