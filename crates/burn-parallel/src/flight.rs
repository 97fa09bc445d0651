//! A flight recorder of collectives: what every rank was doing when a job hung or failed.
//!
//! Each rank keeps its last [`DEFAULT_ENTRIES`] collective and point-to-point calls (env
//! `BURN_PARALLEL_FLIGHT_ENTRIES`; `0` turns the recorder off) in a ring of preallocated
//! slots: the group's call number, the group, the op and its signature (dtype, shape), the
//! bytes, the state (issued → waiting → done, or failed with the error) and the times. One
//! short lock per state change; no allocation once a slot's strings have grown.
//!
//! When `BURN_PARALLEL_FLIGHT_DIR` is set (or [`FlightRecorder::set_dir`] was called), a rank
//! writes `flight-rank<R>.json` there (a [`RankRecord`]) when one of its calls fails (a
//! timeout, a failed peer, a mismatch, an invalid argument) and when the process receives
//! `SIGUSR1`; ranks that are threads of one process and write to the same directory are
//! written together. [`read_dir`] reads the files back and [`diagnose`] names the culprit
//! (`burnrun diagnose DIR` prints it).
//!
//! # Example
//! ```
//! use burn_parallel::{ReduceOp, flight, run_local};
//!
//! let records = run_local(2, |group| {
//!     group.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
//!     Ok(group.flight().expect("on by default").snapshot("example"))
//! })
//! .unwrap();
//! let last = records[0].entries.last().unwrap();
//! assert_eq!((last.op.as_str(), last.seq, last.state), ("all_reduce", 1, flight::CallState::Done));
//! assert!(flight::diagnose(&records).findings.is_empty());
//! ```

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

/// Calls a rank keeps when `BURN_PARALLEL_FLIGHT_ENTRIES` is not set.
pub const DEFAULT_ENTRIES: usize = 2048;
/// The environment variable of the ring's size (`0`: off).
pub const ENTRIES_ENV: &str = "BURN_PARALLEL_FLIGHT_ENTRIES";
/// The environment variable of the directory dumps go to (unset: no dump).
pub const DIR_ENV: &str = "BURN_PARALLEL_FLIGHT_DIR";

/// Where a recorded call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Called; no message awaited yet.
    Issued,
    /// Waiting for a peer's message.
    Waiting,
    /// Returned successfully.
    Done,
    /// Returned an error ([`Entry::error`]).
    Failed,
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The group's call number (`#N` of the signature); 0 for a point-to-point call.
    pub seq: u64,
    /// The group's id ([`GroupInfo::id`]).
    pub group: u64,
    /// The operation (`"all_reduce"`, `"send"`, ...).
    pub op: String,
    /// What the frames carry: operation, call number, arguments, dtype and shape.
    pub signature: String,
    /// The payload's dtype, when the call has one.
    pub dtype: Option<DType>,
    /// This rank's payload in bytes.
    pub bytes: usize,
    /// A point-to-point call's other rank (global) and tag.
    pub peer: Option<(usize, u64)>,
    /// Where the call is.
    pub state: CallState,
    /// The error of a failed call.
    pub error: Option<String>,
    /// When it was issued, in µs since [`RankRecord::start_unix_us`].
    pub issued_us: u64,
    /// When it returned, likewise.
    pub finished_us: Option<u64>,
}

/// A group a rank recorded calls on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInfo {
    /// The id its frames carry (0: the world).
    pub id: u64,
    /// Its members' global ranks, in group-rank order.
    pub members: Vec<usize>,
    /// A name given with [`FlightRecorder::name_group`] (`"dp"`, `"tp"`).
    pub name: Option<String>,
}

/// Everything one rank recorded: the content of `flight-rank<R>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    /// The rank's global rank.
    pub rank: usize,
    /// The world's size.
    pub world_size: usize,
    /// The process id.
    pub pid: u32,
    /// The wall-clock time (µs since the Unix epoch) that the offsets count from.
    pub start_unix_us: u64,
    /// When this snapshot was taken (µs offset).
    pub taken_us: u64,
    /// Why it was taken (the error, `SIGUSR1`, ...).
    pub reason: String,
    /// The groups its entries name.
    pub groups: Vec<GroupInfo>,
    /// The calls, oldest first.
    pub entries: Vec<Entry>,
}

/// A dump or a read that went wrong.
#[derive(Debug, thiserror::Error)]
pub enum FlightError {
    /// No directory configured.
    #[error("no flight directory: set {DIR_ENV} or call FlightRecorder::set_dir")]
    NoDir,
    /// Reading or writing a file failed.
    #[error("flight recorder: {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// A record did not (de)serialise.
    #[error("flight recorder: {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: serde_json::Error,
    },
}

/// One slot of the ring, reused when the ring wraps (its strings keep their capacity).
#[derive(Default)]
struct Slot {
    index: u64,
    seq: u64,
    group: u64,
    op: &'static str,
    signature: String,
    dtype: Option<DType>,
    bytes: usize,
    peer: Option<(usize, u64)>,
    state: Option<CallState>,
    error: String,
    issued_us: u64,
    finished_us: Option<u64>,
}

struct Ring {
    next: u64,
    slots: Vec<Slot>,
}

/// One rank's recorder: a ring of its last calls, shared by its groups.
pub struct FlightRecorder {
    rank: usize,
    world_size: usize,
    ring: Mutex<Ring>,
    groups: Mutex<Vec<GroupInfo>>,
    dir: Mutex<Option<PathBuf>>,
}

impl fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlightRecorder")
            .field("rank", &self.rank)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static START: OnceLock<(Instant, u64)> = OnceLock::new();

fn start() -> &'static (Instant, u64) {
    START.get_or_init(|| {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        (Instant::now(), unix.as_micros() as u64)
    })
}

fn now_us() -> u64 {
    start().0.elapsed().as_micros() as u64
}

/// The recorders of this process, for `SIGUSR1` and for dumping thread ranks together.
static REGISTRY: Mutex<Vec<Weak<FlightRecorder>>> = Mutex::new(Vec::new());
/// One dump at a time, so that the newest snapshot is the one left on disk.
static DUMPING: Mutex<()> = Mutex::new(());

impl FlightRecorder {
    /// A recorder of `capacity` calls for global `rank` of a world of `world_size` (not
    /// registered: it dumps only when asked).
    pub fn new(rank: usize, world_size: usize, capacity: usize) -> Self {
        start();
        Self {
            rank,
            world_size,
            ring: Mutex::new(Ring {
                next: 0,
                slots: (0..capacity.max(1)).map(|_| Slot::default()).collect(),
            }),
            groups: Mutex::new(Vec::new()),
            dir: Mutex::new(std::env::var_os(DIR_ENV).map(PathBuf::from)),
        }
    }

    /// The recorder of a new world's rank, sized from the environment; `None` when off.
    pub(crate) fn for_world(rank: usize, world_size: usize) -> Option<Arc<Self>> {
        static ENTRIES: OnceLock<usize> = OnceLock::new();
        let entries = *ENTRIES.get_or_init(|| match std::env::var(ENTRIES_ENV) {
            Err(_) => DEFAULT_ENTRIES,
            Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                eprintln!(
                    "burn-parallel: {ENTRIES_ENV}={v:?} is not a number; using {DEFAULT_ENTRIES}"
                );
                DEFAULT_ENTRIES
            }),
        });
        if entries == 0 {
            return None;
        }
        let recorder = Arc::new(Self::new(rank, world_size, entries));
        recorder.add_group(0, &(0..world_size).collect::<Vec<_>>());
        let mut registry = lock(&REGISTRY);
        registry.retain(|w| w.strong_count() > 0);
        registry.push(Arc::downgrade(&recorder));
        drop(registry);
        if lock(&recorder.dir).is_some() {
            install_sigusr1();
        }
        Some(recorder)
    }

    /// Remembers a group's members (at its creation, not per call).
    pub(crate) fn add_group(&self, id: u64, members: &[usize]) {
        let mut groups = lock(&self.groups);
        if !groups.iter().any(|g| g.id == id) {
            if groups.len() >= 4096 {
                groups.remove(1); // the world (first) stays
            }
            groups.push(GroupInfo {
                id,
                members: members.to_vec(),
                name: None,
            });
        }
    }

    /// Names group `id` in the records and the diagnosis (`"dp"`, `"tp"`).
    pub fn name_group(&self, id: u64, name: &str) {
        if let Some(g) = lock(&self.groups).iter_mut().find(|g| g.id == id) {
            g.name = Some(name.to_string());
        }
    }

    /// Where dumps go (`None`: no dump). Set from `BURN_PARALLEL_FLIGHT_DIR` at creation.
    pub fn set_dir(&self, dir: Option<PathBuf>) {
        if dir.is_some() {
            install_sigusr1();
        }
        *lock(&self.dir) = dir;
    }

    /// Records a call being issued; returns its handle.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn issue(
        self: &Arc<Self>,
        seq: u64,
        group: u64,
        op: &'static str,
        signature: &str,
        payload: Option<(DType, usize)>,
        peer: Option<(usize, u64)>,
    ) -> InFlight {
        let issued_us = now_us();
        let mut ring = lock(&self.ring);
        let index = ring.next;
        ring.next += 1;
        let len = ring.slots.len() as u64;
        let s = &mut ring.slots[(index % len) as usize];
        s.index = index;
        s.seq = seq;
        s.group = group;
        s.op = op;
        s.signature.clear();
        s.signature.push_str(signature);
        s.dtype = payload.map(|p| p.0);
        s.bytes = payload.map_or(0, |p| p.1);
        s.peer = peer;
        s.state = Some(CallState::Issued);
        s.error.clear();
        s.issued_us = issued_us;
        s.finished_us = None;
        drop(ring);
        InFlight {
            recorder: self.clone(),
            index,
            waiting: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        }
    }

    /// Moves call `index` to `state` (when its slot still holds it).
    fn set(&self, index: u64, state: CallState, error: Option<&dyn fmt::Display>) {
        let finished = matches!(state, CallState::Done | CallState::Failed).then(now_us);
        let mut ring = lock(&self.ring);
        let len = ring.slots.len() as u64;
        let s = &mut ring.slots[(index % len) as usize];
        if s.index == index && s.state.is_some() {
            s.state = Some(state);
            s.finished_us = finished;
            if let Some(e) = error {
                let _ = write!(s.error, "{e}");
            }
        }
    }

    /// This rank's calls now, oldest first.
    pub fn snapshot(&self, reason: &str) -> RankRecord {
        let ring = lock(&self.ring);
        let len = ring.slots.len() as u64;
        let first = ring.next.saturating_sub(len);
        let entries: Vec<Entry> = (first..ring.next)
            .map(|i| &ring.slots[(i % len) as usize])
            .filter_map(|s| {
                Some(Entry {
                    seq: s.seq,
                    group: s.group,
                    op: s.op.to_string(),
                    signature: s.signature.clone(),
                    dtype: s.dtype,
                    bytes: s.bytes,
                    peer: s.peer,
                    state: s.state?,
                    error: (!s.error.is_empty()).then(|| s.error.clone()),
                    issued_us: s.issued_us,
                    finished_us: s.finished_us,
                })
            })
            .collect();
        drop(ring);
        let groups = lock(&self.groups)
            .iter()
            .filter(|g| entries.iter().any(|e| e.group == g.id))
            .cloned()
            .collect();
        RankRecord {
            rank: self.rank,
            world_size: self.world_size,
            pid: std::process::id(),
            start_unix_us: start().1,
            taken_us: now_us(),
            reason: reason.to_string(),
            groups,
            entries,
        }
    }

    /// Writes [`Self::snapshot`] to `flight-rank<R>.json` in the directory (through a
    /// temporary file renamed over it); returns the path.
    ///
    /// # Errors
    /// [`FlightError::NoDir`] without a directory; I/O and serialisation errors.
    pub fn dump(&self, reason: &str) -> Result<PathBuf, FlightError> {
        let dir = lock(&self.dir).clone().ok_or(FlightError::NoDir)?;
        let _one = lock(&DUMPING);
        let record = self.snapshot(reason);
        let path = dir.join(format!("flight-rank{}.json", self.rank));
        let tmp = dir.join(format!(
            ".flight-rank{}.{}.tmp",
            self.rank,
            std::process::id()
        ));
        let io = |source| FlightError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let json = serde_json::to_vec(&record).map_err(|source| FlightError::Json {
            path: path.clone(),
            source,
        })?;
        std::fs::write(&tmp, json).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(path)
    }

    /// Dumps this recorder and every other of this process that writes to the same
    /// directory (the thread ranks of one job); errors go to stderr.
    pub(crate) fn dump_job(&self, reason: &str) {
        let Some(dir) = lock(&self.dir).clone() else {
            return;
        };
        let others: Vec<Arc<Self>> = lock(&REGISTRY).iter().filter_map(Weak::upgrade).collect();
        for r in others.iter().filter(|r| !std::ptr::eq(&***r, self)) {
            if lock(&r.dir).as_ref() == Some(&dir) {
                report(r.dump(&format!("rank {} failed: {reason}", self.rank)));
            }
        }
        report(self.dump(reason));
    }
}

fn report(outcome: Result<PathBuf, FlightError>) {
    if let Err(e) = outcome {
        eprintln!("burn-parallel: {e}");
    }
}

/// Dumps every recorder of this process on `SIGUSR1` (a thread waits for it).
fn install_sigusr1() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let spawned = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1]).and_then(
            |mut signals| {
                std::thread::Builder::new()
                    .name("flight-sigusr1".into())
                    .spawn(move || {
                        for _ in signals.forever() {
                            let all: Vec<_> =
                                lock(&REGISTRY).iter().filter_map(Weak::upgrade).collect();
                            for r in all.iter().filter(|r| lock(&r.dir).is_some()) {
                                report(r.dump("SIGUSR1"));
                            }
                        }
                    })
            },
        );
        if let Err(e) = spawned {
            eprintln!("burn-parallel: flight recorder: cannot watch SIGUSR1: {e}");
        }
    });
}

thread_local! {
    /// An invalid-argument error raised on this thread during the current call.
    static NOTED: RefCell<Option<String>> = const { RefCell::new(None) };
    /// The payload of the host collective about to begin on this thread (dtype, bytes).
    static PAYLOAD: Cell<Option<(DType, usize)>> = const { Cell::new(None) };
}

/// Notes the payload of the host collective this thread is about to begin.
pub(crate) fn note_payload(dtype: DType, bytes: usize) {
    PAYLOAD.with(|p| p.set(Some((dtype, bytes))));
}

/// The payload noted for the collective beginning now (`None` for a barrier).
pub(crate) fn take_payload() -> Option<(DType, usize)> {
    PAYLOAD.with(Cell::take)
}

/// Notes an error raised outside the transport (an invalid argument): the call in flight on
/// this thread ends failed with it.
pub(crate) fn note_error(error: &dyn fmt::Display) {
    NOTED.with(|n| *n.borrow_mut() = Some(error.to_string()));
}

/// Forgets a noted error (at the start of a call).
pub(crate) fn clear_noted() {
    NOTED.with(|n| n.borrow_mut().take());
}

/// A recorded call in progress: done when dropped, unless marked failed.
pub(crate) struct InFlight {
    recorder: Arc<FlightRecorder>,
    index: u64,
    waiting: AtomicBool,
    failed: AtomicBool,
}

impl InFlight {
    /// The call waits for a peer's message (recorded once).
    pub(crate) fn waiting(&self) {
        if !self.waiting.swap(true, Ordering::Relaxed) {
            self.recorder.set(self.index, CallState::Waiting, None);
        }
    }

    /// The call failed with `error`: recorded, and the rank's records dumped.
    pub(crate) fn fail(&self, error: &dyn fmt::Display) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            self.recorder
                .set(self.index, CallState::Failed, Some(error));
            self.recorder.dump_job(&error.to_string());
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        match NOTED.with(|n| n.borrow_mut().take()) {
            Some(error) => self.fail(&error),
            None if !self.failed.load(Ordering::Relaxed) => {
                self.recorder.set(self.index, CallState::Done, None)
            }
            None => {}
        }
    }
}

/// Reads every `flight-rank<R>.json` of `dir`, in rank order.
///
/// # Errors
/// An unreadable directory or file, or a file that is not a [`RankRecord`].
pub fn read_dir(dir: &Path) -> Result<Vec<RankRecord>, FlightError> {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FlightError + '_ {
        move |source| FlightError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
    let mut records = Vec::new();
    for item in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = item.map_err(io(dir))?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("flight-rank") && name.ends_with(".json") {
            let text = std::fs::read(&path).map_err(io(&path))?;
            records.push(
                serde_json::from_slice::<RankRecord>(&text).map_err(|source| {
                    FlightError::Json {
                        path: path.clone(),
                        source,
                    }
                })?,
            );
        }
    }
    records.sort_by_key(|r| r.rank);
    Ok(records)
}

/// One thing [`diagnose`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Finding {
    /// `ranks` are behind on `group`: `waiting` wait in `call` (a later call there), which
    /// they never reached; `doing` is what each of them was last in (any group).
    Behind {
        /// The group.
        group: GroupInfo,
        /// The ranks behind.
        ranks: Vec<usize>,
        /// What each was last in (any group), with that group.
        doing: Vec<(usize, Option<(Entry, GroupInfo)>)>,
        /// The ranks waiting for them.
        waiting: Vec<usize>,
        /// The call they wait in.
        call: Entry,
    },
    /// At call `seq` of `group` the members called different things: one side per signature,
    /// the largest first.
    Mismatch {
        /// The group.
        group: GroupInfo,
        /// The call number.
        seq: u64,
        /// The ranks of each signature, with one of their entries.
        sides: Vec<(Vec<usize>, Entry)>,
    },
    /// `ranks` left no record (dead, or never dumped), while `waiting` wait in `call` on
    /// `group` when some member was seen waiting.
    NoRecord {
        /// The group.
        group: GroupInfo,
        /// The members without a record.
        ranks: Vec<usize>,
        /// Members waiting in a call.
        waiting: Vec<usize>,
        /// Their call (`None`: nobody was seen waiting).
        call: Option<Entry>,
    },
    /// `rank` waits in a receive from `peer`, which was last in `peer_doing`.
    StuckRecv {
        /// The receiving rank.
        rank: usize,
        /// Its receive.
        call: Entry,
        /// The sender.
        peer: usize,
        /// What the sender was last in (`None`: no record).
        peer_doing: Option<Entry>,
    },
}

/// What [`diagnose`] found; its [`Display`](fmt::Display) is the report.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Diagnosis {
    /// The findings, group by group.
    pub findings: Vec<Finding>,
}

impl Diagnosis {
    /// The ranks named as the cause: behind, on the minority side of a mismatch, without a
    /// record, or the sender a receive waits for.
    pub fn culprits(&self) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        for f in &self.findings {
            match f {
                Finding::Behind { ranks, .. } | Finding::NoRecord { ranks, .. } => {
                    out.extend(ranks)
                }
                Finding::Mismatch { sides, .. } => {
                    let tie = sides.len() > 1 && sides[0].0.len() == sides[1].0.len();
                    let skip = usize::from(!tie);
                    out.extend(sides.iter().skip(skip).flat_map(|s| s.0.iter()));
                }
                Finding::StuckRecv { peer, .. } => out.push(*peer),
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Diagnoses all ranks' records: for each group, the members whose last call is behind the
/// others' while they wait, members that called something else at the same call number, and
/// members without a record; then receives that wait for a peer.
///
/// ```
/// use burn_parallel::flight::{FlightRecorder, diagnose};
///
/// let healthy = vec![FlightRecorder::new(0, 2, 8).snapshot("t"), FlightRecorder::new(1, 2, 8).snapshot("t")];
/// assert_eq!(diagnose(&healthy).to_string(), "no culprit: no rank waits for another");
/// ```
pub fn diagnose(records: &[RankRecord]) -> Diagnosis {
    let by_rank: BTreeMap<usize, &RankRecord> = records.iter().map(|r| (r.rank, r)).collect();
    let mut groups: BTreeMap<u64, GroupInfo> = BTreeMap::new();
    for g in records.iter().flat_map(|r| &r.groups) {
        let slot = groups.entry(g.id).or_insert_with(|| g.clone());
        if slot.name.is_none() {
            slot.name.clone_from(&g.name);
        }
    }
    let latest = |rank: usize| -> Option<&Entry> {
        let entries = &by_rank.get(&rank)?.entries;
        let open = |e: &&Entry| matches!(e.state, CallState::Issued | CallState::Waiting);
        entries.iter().rev().find(open).or(entries.last())
    };
    let group_of = |e: &Entry| {
        groups.get(&e.group).cloned().unwrap_or(GroupInfo {
            id: e.group,
            members: Vec::new(),
            name: None,
        })
    };
    let open = |e: &Entry| e.state != CallState::Done;
    let mut findings = Vec::new();
    let mut reported = std::collections::BTreeSet::new();
    for group in groups.values() {
        let last: Vec<(usize, Option<&Entry>)> = group
            .members
            .iter()
            .filter(|m| by_rank.contains_key(m))
            .map(|&m| {
                (
                    m,
                    by_rank[&m]
                        .entries
                        .iter()
                        .rev()
                        .find(|e| e.group == group.id && e.seq > 0),
                )
            })
            .collect();
        let Some(top) = last.iter().filter_map(|(_, e)| e.map(|e| e.seq)).max() else {
            continue;
        };
        let front: Vec<(usize, &Entry)> = last
            .iter()
            .filter_map(|&(m, e)| e.filter(|e| e.seq == top).map(|e| (m, e)))
            .collect();
        let mut sides: Vec<(Vec<usize>, Entry)> = Vec::new();
        for &(m, e) in &front {
            match sides.iter_mut().find(|s| s.1.signature == e.signature) {
                Some(side) => side.0.push(m),
                None => sides.push((vec![m], e.clone())),
            }
        }
        sides.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        if sides.len() > 1 {
            findings.push(Finding::Mismatch {
                group: group.clone(),
                seq: top,
                sides: sides.clone(),
            });
        }
        let waiting: Vec<usize> = front
            .iter()
            .filter(|(_, e)| open(e))
            .map(|(m, _)| *m)
            .collect();
        let Some(&(_, call)) = front.iter().find(|(_, e)| open(e)) else {
            continue;
        };
        let behind: Vec<usize> = last
            .iter()
            .filter(|(_, e)| e.is_none_or(|e| e.seq < top))
            .map(|(m, _)| *m)
            .collect();
        if !behind.is_empty() {
            let doing = behind
                .iter()
                .map(|&m| (m, latest(m).map(|e| (e.clone(), group_of(e)))))
                .collect();
            findings.push(Finding::Behind {
                group: group.clone(),
                ranks: behind,
                doing,
                waiting: waiting.clone(),
                call: call.clone(),
            });
        }
        let missing: Vec<usize> = group
            .members
            .iter()
            .copied()
            .filter(|m| !by_rank.contains_key(m) && reported.insert(*m))
            .collect();
        if !missing.is_empty() {
            findings.push(Finding::NoRecord {
                group: group.clone(),
                ranks: missing,
                waiting,
                call: Some(call.clone()),
            });
        }
    }
    // Ranks of the world without a record that nobody was seen waiting for.
    let world = records.iter().map(|r| r.world_size).max().unwrap_or(0);
    let silent: Vec<usize> = (0..world)
        .filter(|r| !by_rank.contains_key(r) && !reported.contains(r))
        .collect();
    if !silent.is_empty() {
        let group = groups.get(&0).cloned().unwrap_or(GroupInfo {
            id: 0,
            members: (0..world).collect(),
            name: None,
        });
        findings.push(Finding::NoRecord {
            group,
            ranks: silent,
            waiting: Vec::new(),
            call: None,
        });
    }
    for r in records {
        if let Some(e) = r.entries.last().filter(|e| e.op == "recv" && open(e))
            && let Some((peer, _)) = e.peer
        {
            findings.push(Finding::StuckRecv {
                rank: r.rank,
                call: e.clone(),
                peer,
                peer_doing: latest(peer).cloned(),
            });
        }
    }
    Diagnosis { findings }
}

/// `0-3` for a run of ranks, else `0, 2, 5`.
fn ranks(list: &[usize]) -> String {
    match list {
        [a, .., b] if b - a + 1 == list.len() && list.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("{a}-{b}")
        }
        _ => list
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn who(list: &[usize]) -> String {
    let s = if list.len() == 1 { "rank" } else { "ranks" };
    format!("{s} {}", ranks(list))
}

impl fmt::Display for GroupInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match (&self.name, self.id) {
            (Some(n), _) => n.clone(),
            (None, 0) => "world".into(),
            (None, id) => format!("{id:x}"),
        };
        match self.members.is_empty() {
            true => write!(f, "group {name}"),
            false => write!(f, "group {name} (ranks {})", ranks(&self.members)),
        }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head = format!("{}(#{} ", self.op, self.seq);
        let args = self
            .signature
            .strip_prefix(&head)
            .and_then(|s| s.strip_suffix(')'))
            .unwrap_or(&self.signature);
        match self.peer {
            Some((peer, tag)) => write!(f, "{} with rank {peer} (tag {tag}", self.op)?,
            None => write!(f, "{} #{} ({args}", self.op, self.seq)?,
        }
        match self.state {
            CallState::Issued => write!(f, ", issued)"),
            CallState::Waiting => write!(f, ", waiting)"),
            CallState::Done => write!(f, ", done)"),
            CallState::Failed => write!(f, ", failed: {})", self.error.as_deref().unwrap_or("?")),
        }
    }
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.findings.is_empty() {
            return write!(f, "no culprit: no rank waits for another");
        }
        for (i, finding) in self.findings.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            match finding {
                Finding::Behind {
                    group,
                    ranks,
                    doing,
                    waiting,
                    call,
                } => {
                    let them: Vec<String> = doing
                        .iter()
                        .map(|(r, e)| match e {
                            Some((e, g)) if e.state == CallState::Done => {
                                format!(
                                    "rank {r} last finished {e} on {g} and issued nothing since"
                                )
                            }
                            Some((e, g)) => format!("rank {r} is in {e} on {g}"),
                            None => format!("rank {r} has recorded no call"),
                        })
                        .collect();
                    write!(
                        f,
                        "{} behind on {group}: {}; {} wait in {call}",
                        who(ranks),
                        them.join("; "),
                        who(waiting)
                    )?;
                }
                Finding::Mismatch { group, seq, sides } => {
                    let all: Vec<String> = sides
                        .iter()
                        .map(|(r, e)| format!("{} called {e}", who(r)))
                        .collect();
                    write!(f, "mismatch at call #{seq} on {group}: {}", all.join("; "))?;
                }
                Finding::NoRecord {
                    group,
                    ranks,
                    waiting,
                    call,
                } => {
                    write!(f, "{} of {group} left no record (dead?)", who(ranks))?;
                    if let Some(call) = call {
                        write!(f, "; {} wait in {call}", who(waiting))?;
                    }
                }
                Finding::StuckRecv {
                    rank,
                    call,
                    peer,
                    peer_doing,
                } => {
                    let doing = peer_doing
                        .as_ref()
                        .map_or("has no record".into(), |e| format!("is in {e}"));
                    write!(f, "rank {rank} waits in {call}; rank {peer} {doing}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_wraps_and_a_late_finish_leaves_the_new_call_alone() {
        let recorder = Arc::new(FlightRecorder::new(0, 1, 4));
        let first = recorder.issue(1, 0, "all_reduce", "all_reduce(#1 sum f32[1])", None, None);
        for seq in 2..=6 {
            drop(recorder.issue(seq, 0, "barrier", "barrier", None, None));
        }
        drop(first); // its slot now holds call 5: untouched
        let entries = recorder.snapshot("t").entries;
        let seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![3, 4, 5, 6]);
        assert!(entries.iter().all(|e| e.state == CallState::Done));
    }

    /// The cost of recording one call (issue, waiting, done) without any communication:
    /// `cargo test -p burn-parallel --lib flight::tests::recording_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "prints a figure"]
    fn recording_cost() {
        let recorder = Arc::new(FlightRecorder::new(0, 2, DEFAULT_ENTRIES));
        let signature = "all_reduce(#1 sum f32[4])";
        let calls = 1_000_000u64;
        let start = Instant::now();
        for seq in 0..calls {
            let call = recorder.issue(
                seq,
                0,
                "all_reduce",
                signature,
                Some((DType::F32, 16)),
                None,
            );
            call.waiting();
        }
        let ns = start.elapsed().as_nanos() as f64 / calls as f64;
        println!("flight recorder: {ns:.0} ns per recorded call (issue + waiting + done)");
    }
}
