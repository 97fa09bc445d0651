//! The `nccl` backend: collectives on the device memory of Burn's CUDA tensors, through NCCL.
//!
//! The split is the one torch makes between gloo and NCCL. A group of this backend is an
//! ordinary [`ProcessGroup`](crate::ProcessGroup) over the `tcp` transport (formed by the same rendezvous, from the
//! variables of `burnrun`, torchrun or SLURM), with NCCL communicators attached:
//!
//! - host-side frames (objects, metadata, `*_data` collectives, everything a technique sends as
//!   [`burn::tensor::TensorData`]) keep using the `tcp` transport;
//! - the tensor-level collectives of [`ProcessGroup`](crate::ProcessGroup) ([`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce),
//!   [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather), [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter),
//!   [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast), [`ProcessGroup::all_to_all`](crate::ProcessGroup::all_to_all), [`ProcessGroup::send`](crate::ProcessGroup::send) and
//!   [`ProcessGroup::recv`](crate::ProcessGroup::recv)) run in device memory through NCCL when their tensor lives on a CUDA
//!   device (features `nccl` and `cuda`); tensors of other backends take the host path.
//!
//! How the pieces fit:
//!
//! - **Loading.** Everything is loaded at run time, so this module builds on machines without
//!   CUDA: `cudarc` loads the CUDA driver (`libcuda`), and this crate loads NCCL itself (once
//!   per process) from the file named by `BURN_PARALLEL_NCCL_LIB` when that is set (and only
//!   from it), otherwise as `libnccl.so.2` (NCCL's soname, which runtime-only installs such as
//!   the `libnccl2` package have) and then `libnccl.so`, on the library path. [`probe`] reports
//!   a missing driver, device or library as [`CollectiveError::BackendUnavailable`] saying what
//!   was tried and what to install.
//! - **Bootstrap.** A communicator is created per group, lazily, at the group's first device
//!   collective (every member makes that call, so every member joins): group rank 0 makes the
//!   NCCL unique id and broadcasts it over the group's host transport, then every member joins
//!   in non-blocking mode. A sub-group made by [`ProcessGroup::split`](crate::ProcessGroup::split) gets its own
//!   communicator the same way (a new unique id through the host transport, which works with
//!   every NCCL version, unlike `ncclCommSplit`). Lazy creation keeps `split` free of
//!   communication and costs nothing for groups that never move CUDA tensors; [`connect`](crate::nccl::connect)
//!   creates a group's communicator at once (needed when a group's first device operation is
//!   a send/recv between some of its members, since creation needs all of them).
//! - **Ordering with Burn.** CubeCL does not expose the CUDA stream of its server, so each
//!   collective (1) binds the tensors' device buffers (CubeCL neither frees nor moves a bound
//!   allocation until the binding is dropped), (2) makes the communicator's stream wait, on the
//!   device, for the work Burn queued before the call (a word written by a one-thread kernel
//!   on Burn's stream, `cuStreamWaitValue32` on ours: the ordering words of `device/order.rs`,
//!   below both the kernels and the collectives; where the device refuses stream memory
//!   operations, or `BURN_PARALLEL_STREAM_ORDER=sync`, the host waits for Burn's work
//!   instead), (3) enqueues NCCL and records an event after it. The
//!   call returns there for the asynchronous collectives ([`crate::work::Work`]); the others
//!   wait at once. (4) Waiting polls the event: the result tensor is handed over, and the
//!   buffers released, only after NCCL completed, so Burn's later kernels read finished data
//!   and no buffer is reused while NCCL still reads or writes it.
//! - **Errors and timeouts.** While waiting, the communicator's asynchronous error
//!   (`ncclCommGetAsyncError`) is polled: an NCCL failure (a dead peer's connection included)
//!   becomes [`CollectiveError::Nccl`] naming the rank and the operation. A wait longer than the
//!   group's timeout (counted from the launch) aborts the communicator (`ncclCommAbort`)
//!   instead of hanging; later calls on the group then fail at once.
//! - **Agreement.** With [`signature_checks`] on (`BURN_PARALLEL_DEBUG=1`, or a build with
//!   debug assertions such as the tests'), the members first exchange the call's signature
//!   (operation, dtype, shape, sizes) over the host transport, so a rank that calls another
//!   collective or passes another shape gets [`CollectiveError::Mismatch`] instead of corrupt
//!   data. It costs a host round trip per collective, so a release build skips it: a mismatch
//!   then ends in NCCL's error or the group's timeout. Uneven all-gathers and all-to-alls
//!   always exchange their sizes.
//! - **Tracing.** `BURN_PARALLEL_NCCL_TRACE=FILE` appends each operation's start (its inputs
//!   ready) and end on the device's clock to `FILE`; `scripts/nccl_trace.py` makes a Perfetto
//!   trace of it.

use crate::error::{CollectiveError, Result};

/// The backend's name, as [`ProcessGroup::backend`](crate::ProcessGroup::backend) reports it.
pub const BACKEND: &str = "nccl";

/// `true` when this build has the NCCL backend (cargo feature `nccl` of `burn-parallel`).
pub const BUILT: bool = cfg!(feature = "nccl");

/// Whether device collectives first check, over the host transport, that every member calls
/// the same operation with the same dtype and shape ([`CollectiveError::Mismatch`] otherwise).
///
/// The check costs a host round trip per collective, so it is off on the hot path of a release
/// build, as torch's `TORCH_DISTRIBUTED_DEBUG` is: `BURN_PARALLEL_DEBUG=1` turns it on,
/// `BURN_PARALLEL_DEBUG=0` off; unset, it follows the build (on with debug assertions, so in
/// tests). Without it, ranks that disagree fail by NCCL's own error or the group's timeout
/// (a typed error naming the operation, never a hang). All-gathers and all-to-alls of uneven
/// sizes exchange their sizes whatever this says.
///
/// ```
/// // Tests build with debug assertions: checks are on unless BURN_PARALLEL_DEBUG=0.
/// let on = burn_parallel::comm::nccl::signature_checks();
/// assert_eq!(on, std::env::var("BURN_PARALLEL_DEBUG").map_or(cfg!(debug_assertions), |v| v != "0"));
/// ```
pub fn signature_checks() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("BURN_PARALLEL_DEBUG") {
        Ok(v) => v.trim() != "0",
        Err(_) => cfg!(debug_assertions),
    })
}

/// `true` when this build runs collectives on CUDA tensors' device memory (features `nccl` and
/// `cuda`); with `nccl` alone the communicators and errors exist but tensors take the host path.
pub const DEVICE_TENSORS: bool = cfg!(all(feature = "nccl", feature = "cuda"));

/// What [`probe`] found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclInfo {
    /// NCCL's version, `(major, minor, patch)`.
    pub version: (u32, u32, u32),
    /// Number of CUDA devices the driver reports.
    pub cuda_devices: usize,
}

pub(crate) fn not_built() -> CollectiveError {
    CollectiveError::BackendUnavailable {
        backend: BACKEND.into(),
        reason: "this build of burn-parallel has no NCCL backend: rebuild with `--features \
                 nccl` (and `cuda` for collectives on CUDA tensors; see scripts/setup-llvm.sh), \
                 or use the `tcp` backend"
            .into(),
    }
}

/// Checks that NCCL can run here on CUDA device `cuda_device`: the CUDA driver loads, the
/// device exists, and `libnccl` (2.14 or newer) loads: the file named by the environment
/// variable `BURN_PARALLEL_NCCL_LIB` when it is set (no other then), otherwise `libnccl.so.2`
/// or, failing that, `libnccl.so` on the library path (`LD_LIBRARY_PATH`, the `ld.so` cache).
/// For a pip install (`nvidia-nccl-cu12`), set `BURN_PARALLEL_NCCL_LIB` to its
/// `site-packages/nvidia/nccl/lib/libnccl.so.2` or put that folder on `LD_LIBRARY_PATH`. The
/// library is loaded once per process; the variable is read then.
///
/// # Arguments
/// - `cuda_device`: the CUDA device index this rank will use (usually its `LOCAL_RANK`).
///
/// # Returns
/// NCCL's version and the number of CUDA devices.
///
/// # Errors
/// [`CollectiveError::BackendUnavailable`] naming what is missing (the `nccl` feature, the CUDA
/// driver, the device, `libnccl`: every candidate tried and why it failed) and what to install.
///
/// # Example
/// ```
/// // On a machine without NVIDIA's driver or libnccl this is an error that says what to install.
/// match burn_parallel::comm::nccl::probe(0) {
///     Ok(info) => println!("NCCL {:?} with {} devices", info.version, info.cuda_devices),
///     Err(e) => println!("{e}"),
/// }
/// ```
pub fn probe(cuda_device: usize) -> Result<NcclInfo> {
    #[cfg(feature = "nccl")]
    {
        imp::probe(cuda_device)
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = cuda_device;
        Err(not_built())
    }
}

/// Creates the NCCL communicator of the group `host` now (see [`crate::nccl::connect`]).
///
/// # Errors
/// As [`crate::nccl::connect`].
pub(crate) fn connect(host: &dyn NcclHost) -> Result<()> {
    let Some(nccl) = host.nccl() else {
        return Err(CollectiveError::InvalidArgument {
            rank: host.global_rank(),
            op: "nccl::connect".into(),
            reason: format!(
                "the group's backend is {}, not nccl: attach NCCL first (nccl::attach or \
                 nccl::init_from_env)",
                host.backend()
            ),
        });
    };
    #[cfg(feature = "nccl")]
    {
        imp::communicator(&nccl.slot, host, nccl.ordinal, "nccl::connect").map(|_| ())
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = nccl;
        Err(not_built())
    }
}

/// Waits until the device messages of `host`'s channels have completed (see
/// [`ProcessGroup::wait_p2p`](crate::ProcessGroup::wait_p2p)).
///
/// # Errors
/// The first failure of a channel.
#[cfg(feature = "nccl")]
pub(crate) fn wait_channels(host: &dyn NcclHost, nccl: &DeviceComm) -> Result<()> {
    imp::wait_channels(&nccl.slot, host)
}

/// What NCCL needs of the group it is attached to: its members, its timeout and its host
/// transport (the communicator's unique id, the calls' agreement, the point-to-point
/// announcements). [`ProcessGroup`](crate::ProcessGroup) implements it: the backend sits below
/// the group and never names it.
#[cfg_attr(not(all(feature = "nccl", feature = "cuda")), allow(dead_code))]
pub(crate) trait NcclHost {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// The number of members.
    fn size(&self) -> usize;
    /// This rank's global rank.
    fn global_rank(&self) -> usize;
    /// The members' global ranks, in group order.
    fn members(&self) -> &[usize];
    /// How long any wait may last.
    fn timeout(&self) -> std::time::Duration;
    /// The group's backend name.
    fn backend(&self) -> &'static str;
    /// The NCCL state attached to the group, if any.
    fn nccl(&self) -> Option<&DeviceComm>;
    /// Every member's `bytes`, in group order.
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Group rank `root`'s `bytes`, on every member.
    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>>;
    /// Sends host data to group rank `peer` under `tag`.
    fn send_data(&self, data: burn::tensor::TensorData, peer: usize, tag: u64) -> Result<()>;
    /// Receives host data from group rank `peer` under `tag`.
    fn recv_data(&self, peer: usize, tag: u64) -> Result<burn::tensor::TensorData>;
    /// Sends bytes to group rank `peer` on the stream reserved for setting up channels.
    fn send_setup(&self, bytes: Vec<u8>, peer: usize) -> Result<()>;
    /// Receives what group rank `peer` sent with [`NcclHost::send_setup`].
    fn recv_setup(&self, peer: usize) -> Result<Vec<u8>>;
}

/// Every member's `value`, in group order, over `host`'s transport.
#[cfg_attr(not(all(feature = "nccl", feature = "cuda")), allow(dead_code))]
fn all_gather_object<T: serde::Serialize + serde::de::DeserializeOwned>(
    host: &dyn NcclHost,
    value: &T,
) -> Result<Vec<T>> {
    let invalid = |reason: String| CollectiveError::InvalidArgument {
        rank: host.global_rank(),
        op: "all_gather_object".into(),
        reason,
    };
    let bytes = serde_json::to_vec(value).map_err(|e| invalid(format!("serialising: {e}")))?;
    host.all_gather_bytes(bytes)?
        .iter()
        .map(|b| serde_json::from_slice(b).map_err(|e| invalid(format!("deserialising: {e}"))))
        .collect()
}

/// The NCCL state a [`ProcessGroup`](crate::ProcessGroup) carries: the group's communicator, created at its first
/// device collective. [`ProcessGroup::split`](crate::ProcessGroup::split) gives a sub-group a fresh one.
#[derive(Clone)]
pub struct DeviceComm {
    /// This rank's CUDA device index, given to [`attach`](crate::nccl::attach).
    #[cfg(feature = "nccl")]
    ordinal: usize,
    #[cfg(feature = "nccl")]
    slot: std::sync::Arc<std::sync::Mutex<imp::Slot>>,
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceComm")
    }
}

impl DeviceComm {
    pub(crate) fn new(cuda_device: usize) -> Self {
        let _ = cuda_device;
        Self {
            #[cfg(feature = "nccl")]
            ordinal: cuda_device,
            #[cfg(feature = "nccl")]
            slot: Default::default(),
        }
    }

    /// The state of a new sub-group: no communicator yet (its members create one at their
    /// first device collective).
    pub(crate) fn for_subgroup(&self) -> Self {
        #[cfg(feature = "nccl")]
        {
            Self::new(self.ordinal)
        }
        #[cfg(not(feature = "nccl"))]
        {
            Self::new(0)
        }
    }
}

/// Communicators, waiting and error mapping: needs `libnccl` (loaded by
/// [`crate::comm::nccl_lib`]) and the CUDA driver at run time only, so it builds (and its errors
/// are tested) without Burn's `cuda`.
#[cfg(feature = "nccl")]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod imp {
    use std::collections::HashMap;
    use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
    use std::sync::{Arc, Mutex, MutexGuard};
    use std::time::{Duration, Instant};

    use cudarc::driver::result as cu;
    use cudarc::driver::sys as cusys;
    use cudarc::nccl::sys;

    use super::{BACKEND, NcclHost, NcclInfo};
    use crate::comm::nccl_lib::{self, Nccl};
    use crate::error::{CollectiveError, Result};

    /// NCCL before 2.14 has no non-blocking communicators (needed to time out instead of hang).
    const MIN_VERSION: (u32, u32) = (2, 14);

    fn unavailable(reason: String) -> CollectiveError {
        CollectiveError::BackendUnavailable {
            backend: BACKEND.into(),
            reason,
        }
    }

    pub(super) fn probe(cuda_device: usize) -> Result<NcclInfo> {
        let count = crate::cuda::check_device(cuda_device, "LOCAL_RANK")
            .map_err(|e| unavailable(format!("{e}; or use the `tcp` backend")))?;
        // BURN_PARALLEL_NCCL_LIB, else libnccl.so.2, else libnccl.so; the error lists them.
        let nccl = nccl_lib::get().map_err(unavailable)?;
        let mut code: c_int = 0;
        // SAFETY: `code` outlives the call; ncclGetVersion only writes the version into it.
        let result = unsafe { (nccl.get_version)(&mut code) };
        if result != sys::ncclResult_t::ncclSuccess {
            return Err(unavailable(format!(
                "ncclGetVersion of libnccl {} failed: {}",
                nccl.origin(),
                describe(result)
            )));
        }
        let code = u32::try_from(code).unwrap_or(0);
        // NCCL_VERSION(X, Y, Z) is X * 10000 + Y * 100 + Z since 2.9.
        let version = (code / 10000, (code / 100) % 100, code % 100);
        if (version.0, version.1) < MIN_VERSION {
            return Err(unavailable(format!(
                "libnccl {}.{}.{} ({}) is too old: install NCCL {}.{} or newer",
                version.0,
                version.1,
                version.2,
                nccl.origin(),
                MIN_VERSION.0,
                MIN_VERSION.1
            )));
        }
        Ok(NcclInfo {
            version,
            cuda_devices: count,
        })
    }

    /// NCCL's name and text for a result code (the name alone if NCCL is not loaded).
    pub(super) fn describe(code: sys::ncclResult_t) -> String {
        let Ok(nccl) = nccl_lib::get() else {
            return format!("{code:?}");
        };
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { (nccl.get_error_string)(code) };
        let text = if text.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated and static (see above).
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        format!("{code:?} ({text})")
    }

    /// `ncclConfig_t` as NCCL 2.14 defined it. NCCL reads a configuration up to the `size` and
    /// `version` it carries, so the oldest layout is understood by every newer library (the
    /// newer layouts of cudarc's bindings are not understood by older ones).
    #[repr(C)]
    struct ConfigV21400 {
        size: usize,
        magic: c_uint,
        version: c_uint,
        blocking: c_int,
        cga_cluster_size: c_int,
        min_ctas: c_int,
        max_ctas: c_int,
        net_name: *const c_char,
    }

    impl ConfigV21400 {
        /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: calls return `ncclInProgress` and the
        /// caller polls, which is what lets a wait time out and abort.
        fn non_blocking() -> Self {
            const UNDEF_INT: c_int = c_int::MIN;
            Self {
                size: std::mem::size_of::<Self>(),
                magic: 0xcafe_beef,
                version: 21400,
                blocking: 0,
                cga_cluster_size: UNDEF_INT,
                min_ctas: UNDEF_INT,
                max_ctas: UNDEF_INT,
                net_name: std::ptr::null(),
            }
        }
    }

    /// The per-group state: the communicator once created, the point-to-point channels and
    /// counters.
    #[derive(Default)]
    pub(crate) struct Slot {
        comm: Option<Arc<Communicator>>,
        /// The channel of each direction `(from, to)` between two group ranks (this rank one of
        /// them): a two-rank communicator whose rank 0 sends and rank 1 receives, with a stream
        /// of its own, so that one direction's sends never wait behind the other's.
        channels: HashMap<(usize, usize), Arc<Communicator>>,
        /// Device sends to each group rank so far (receivers check the order).
        pub(crate) sent: HashMap<usize, u64>,
        /// Device receives from each group rank so far.
        pub(crate) received: HashMap<usize, u64>,
    }

    enum Health {
        Ready,
        Aborted(String),
    }

    /// An operation enqueued by [`Communicator::launch`]: the event recorded after it on the
    /// communicator's stream, and its deadline.
    pub(crate) struct Launched {
        event: cusys::CUevent,
        until: Option<Instant>,
        timeout: Duration,
        /// Under `BURN_PARALLEL_NCCL_TRACE`: an event recorded when the stream had waited for
        /// the inputs (the operation's start on the device); `event` then times too.
        started: Option<cusys::CUevent>,
    }

    // SAFETY: a CUDA event is a plain token usable from any thread of the process.
    unsafe impl Send for Launched {}

    /// One NCCL communicator and the CUDA stream its operations run on.
    pub(crate) struct Communicator {
        /// The loaded NCCL the communicator belongs to.
        nccl: &'static Nccl,
        comm: sys::ncclComm_t,
        stream: cusys::CUstream,
        context: cusys::CUcontext,
        /// CUDA device index.
        pub(crate) ordinal: usize,
        /// Global rank of the caller (for messages).
        global_rank: usize,
        /// Serialises the use of the communicator, and records whether it was aborted.
        health: Mutex<Health>,
        /// The watchdog of operations waited for on the device ([`Communicator::watch`]),
        /// started at the first.
        watchdog: Mutex<Option<std::sync::mpsc::Sender<Watched>>>,
        /// Where CubeCL's streams wait on the device for this communicator's operations.
        #[cfg(feature = "cuda")]
        gate: std::sync::OnceLock<Option<crate::device::order::Gate>>,
    }

    /// An operation the watchdog polls until it completes.
    pub(crate) struct Watched {
        comm: Arc<Communicator>,
        op: String,
        launched: Launched,
        /// Dropped once the operation completed (its buffers).
        keep: Box<dyn std::any::Any + Send>,
    }

    /// Polls the watched operations; ends when every communicator that could send more is
    /// gone and nothing is pending.
    fn watchdog(queue: std::sync::mpsc::Receiver<Watched>) {
        use std::sync::mpsc::RecvTimeoutError;
        let mut pending: Vec<Watched> = Vec::new();
        let mut closed = false;
        loop {
            if closed && pending.is_empty() {
                return;
            }
            let wait = match pending.is_empty() {
                true => Duration::from_secs(3600),
                false => Duration::from_micros(200),
            };
            match queue.recv_timeout(wait) {
                Ok(w) => pending.push(w),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    closed = true;
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            while let Ok(w) = queue.try_recv() {
                pending.push(w);
            }
            let mut k = 0;
            while k < pending.len() {
                let w = &pending[k];
                match w.comm.check(&w.op, &w.launched) {
                    Ok(false) => k += 1,
                    done => {
                        let w = pending.swap_remove(k);
                        w.comm.finish(&w.op, &w.launched, done.is_ok());
                        drop(w.keep);
                    }
                }
            }
        }
    }

    // SAFETY: the raw NCCL and CUDA handles are plain tokens usable from any thread; every use
    // of the communicator goes through the `health` mutex, so NCCL never sees concurrent calls
    // on it, and the CUDA context is made current on the calling thread before each use.
    unsafe impl Send for Communicator {}
    // SAFETY: see `Send`; shared access only reads the immutable handles or takes the mutex.
    unsafe impl Sync for Communicator {}

    impl Drop for Communicator {
        fn drop(&mut self) {
            let health = self.health.get_mut().unwrap_or_else(|e| e.into_inner());
            if matches!(health, Health::Ready) {
                // SAFETY: the communicator is alive (not aborted) and no call is in flight:
                // every operation in flight holds the communicator (an `Arc`) until waited for.
                // Abort rather than destroy: it never waits for peers, so teardown cannot hang.
                let _ = unsafe { (self.nccl.comm_abort)(self.comm) };
            }
            // SAFETY: the stream was created by this communicator and is not used after this;
            // CUDA releases it once pending work (none: every operation was waited for) ends.
            let _ = unsafe { cu::stream::destroy(self.stream) };
        }
    }

    /// The group's communicator, created at the first call (every member makes this call,
    /// so every member joins).
    pub(crate) fn communicator(
        slot: &Mutex<Slot>,
        group: &dyn NcclHost,
        ordinal: usize,
        op: &str,
    ) -> Result<Arc<Communicator>> {
        let mut slot = lock(slot);
        if let Some(comm) = &slot.comm {
            check_ordinal(comm, ordinal, group, op)?;
            return Ok(comm.clone());
        }
        let comm = Arc::new(Communicator::create(
            ordinal,
            (group.rank(), group.size()),
            group.global_rank(),
            group.timeout(),
            |mine| group.broadcast_bytes(mine, 0),
        )?);
        slot.comm = Some(comm.clone());
        Ok(comm)
    }

    /// The channel carrying device messages from group rank `from` to group rank `to` (one of
    /// them this rank); creates the pair's two channels when they do not exist yet, which
    /// waits for the other rank to do the same.
    pub(crate) fn channel(
        slot: &Mutex<Slot>,
        group: &dyn NcclHost,
        ordinal: usize,
        (from, to): (usize, usize),
        op: &str,
    ) -> Result<Arc<Communicator>> {
        connect_pair(slot, group, ordinal, from.min(to), from.max(to), op)?;
        Ok(lock(slot).channels[&(from, to)].clone())
    }

    /// Creates the channels between group ranks `low` and `high` (this rank one of them) that
    /// do not exist yet, low to high first: the sender of each makes the NCCL unique id and
    /// hands it to the receiver on the setup stream.
    pub(crate) fn connect_pair(
        slot: &Mutex<Slot>,
        group: &dyn NcclHost,
        ordinal: usize,
        low: usize,
        high: usize,
        op: &str,
    ) -> Result<()> {
        let me = group.rank();
        debug_assert!(low < high && (me == low || me == high));
        let mut slot = lock(slot);
        for (from, to) in [(low, high), (high, low)] {
            if let Some(comm) = slot.channels.get(&(from, to)) {
                check_ordinal(comm, ordinal, group, op)?;
                continue;
            }
            let comm = Communicator::create(
                ordinal,
                (usize::from(me == to), 2),
                group.global_rank(),
                group.timeout(),
                |mine| match me == from {
                    true => group.send_setup(mine.clone(), to).map(|()| mine),
                    false => group.recv_setup(from),
                },
            )?;
            warm_up(&comm, me == from, group.timeout(), op)?;
            slot.channels.insert((from, to), Arc::new(comm));
        }
        Ok(())
    }

    /// Connects the two ranks of a new channel now, while both are here: NCCL connects a pair
    /// at its first operation, whose host call waits for the peer, so without this a
    /// channel's first send would wait for its receiver. One element goes from rank 0 to
    /// rank 1.
    fn warm_up(comm: &Communicator, sender: bool, timeout: Duration, op: &str) -> Result<()> {
        let op = format!("{op}: connecting a channel");
        // SAFETY: the communicator's context is current inside `enqueue`; four bytes, freed
        // below once the operation using them completed.
        let buffer = comm.enqueue(&op, |_| unsafe { cu::malloc_sync(4) }.map_err(|e| e.0))?;
        let launched = comm.launch(
            &op,
            timeout,
            |_| Ok(()),
            |lib, c, s| {
                let float = sys::ncclDataType_t::ncclFloat32;
                // SAFETY: `buffer` holds one f32 and outlives the operation (waited for).
                unsafe {
                    match sender {
                        true => (lib.send)(ptr(buffer), 1, float, 1, c, s),
                        false => (lib.recv)(ptr(buffer), 1, float, 0, c, s),
                    }
                }
            },
        )?;
        // On a failure the buffer is left allocated: the aborted operation may still hold it.
        comm.wait(&op, launched)?;
        // SAFETY: allocated above; the operation that used it completed.
        comm.enqueue(&op, |_| unsafe { cu::free_sync(buffer) }.map_err(|e| e.0))
    }

    /// Waits on the host until everything launched so far on the group's channels has
    /// completed; the first failure (an earlier one the watchdog saw included).
    pub(crate) fn wait_channels(slot: &Mutex<Slot>, group: &dyn NcclHost) -> Result<()> {
        let mut channels: Vec<((usize, usize), Arc<Communicator>)> = lock(slot)
            .channels
            .iter()
            .map(|(k, c)| (*k, c.clone()))
            .collect();
        channels.sort_by_key(|(k, _)| *k);
        for ((from, to), comm) in channels {
            let op = format!(
                "waiting for the device messages from rank {} to rank {}",
                group.members()[from],
                group.members()[to]
            );
            // An event recorded now on the channel's stream follows everything launched on it.
            let event = comm.enqueue(&op, |stream| record_event(stream, false).map_err(|e| e.0))?;
            let launched = Launched {
                event,
                until: deadline(group.timeout()),
                timeout: group.timeout(),
                started: None,
            };
            comm.wait(&op, launched)?;
        }
        Ok(())
    }

    /// A communicator made for CUDA device `ordinal` (a rank keeps its tensors on one device).
    fn check_ordinal(
        comm: &Communicator,
        ordinal: usize,
        group: &dyn NcclHost,
        op: &str,
    ) -> Result<()> {
        if comm.ordinal == ordinal {
            return Ok(());
        }
        Err(CollectiveError::InvalidArgument {
            rank: group.global_rank(),
            op: op.into(),
            reason: format!(
                "the tensor is on CUDA device {ordinal} but this group's NCCL communicators are \
                 on device {}; keep each rank's tensors on one device (Device::cuda(LOCAL_RANK))",
                comm.ordinal
            ),
        })
    }

    pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn deadline(timeout: Duration) -> Option<Instant> {
        // A timeout too long to be represented waits without a deadline (as long as asked).
        Instant::now().checked_add(timeout)
    }

    fn context_of(ordinal: usize) -> std::result::Result<cusys::CUcontext, cu::DriverError> {
        cu::init()?;
        let device = cu::device::get(ordinal as c_int)?;
        // SAFETY: `device` is a valid device handle. The primary context is the one CubeCL's
        // CUDA runtime uses, so device pointers of Burn tensors are valid in it; retaining
        // only increments its reference count.
        unsafe { cu::primary_ctx::retain(device) }
    }

    impl Communicator {
        /// Creates a communicator of `size` ranks on CUDA device `ordinal`, this rank being
        /// `rank`: rank 0 makes NCCL's unique id and `exchange` hands it to every rank (given
        /// rank 0's bytes, or nothing elsewhere, it returns rank 0's; empty when rank 0 failed).
        fn create(
            ordinal: usize,
            (rank, size): (usize, usize),
            global_rank: usize,
            timeout: Duration,
            exchange: impl FnOnce(Vec<u8>) -> Result<Vec<u8>>,
        ) -> Result<Self> {
            let op = format!("communicator creation ({size} ranks)");
            let cuda = |what: &str, e: cu::DriverError| CollectiveError::Nccl {
                rank: global_rank,
                op: op.clone(),
                reason: format!("{what}: {e}"),
            };
            // Loaded already by `probe` (through `attach`); an error here is that same one.
            let nccl = nccl_lib::get().map_err(unavailable)?;
            let context = context_of(ordinal).map_err(|e| cuda("retaining the CUDA context", e))?;
            // SAFETY: `context` is a live primary context.
            unsafe { cu::ctx::set_current(context) }
                .map_err(|e| cuda("making the CUDA context current", e))?;

            // Rank 0 makes the unique id; an empty message tells the others it failed.
            let mine = if rank == 0 {
                let mut id = sys::ncclUniqueId { internal: [0; 128] };
                // SAFETY: `id` outlives the call; ncclGetUniqueId only writes it.
                let code = unsafe { (nccl.get_unique_id)(&mut id) };
                if code != sys::ncclResult_t::ncclSuccess {
                    let _ = exchange(Vec::new());
                    return Err(CollectiveError::Nccl {
                        rank: global_rank,
                        op,
                        reason: format!("ncclGetUniqueId: {}", describe(code)),
                    });
                }
                id.internal.iter().map(|&c| c as u8).collect()
            } else {
                Vec::new()
            };
            let bytes = exchange(mine)?;
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            if bytes.len() != id.internal.len() {
                return Err(CollectiveError::Nccl {
                    rank: global_rank,
                    op,
                    reason: format!(
                        "rank 0 of the communicator sent an NCCL unique id of {} bytes \
                         (expected 128): it could not create one (see its error)",
                        bytes.len()
                    ),
                });
            }
            for (dst, &src) in id.internal.iter_mut().zip(&bytes) {
                *dst = src as c_char;
            }

            let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda("creating the communication stream", e))?;
            let mut config = ConfigV21400::non_blocking();
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            let (size, rank) = (size as c_int, rank as c_int);
            // SAFETY: `comm` is written by NCCL; `config` outlives the call and has the layout
            // of NCCL 2.14's `ncclConfig_t` (the probe checked the library is 2.14 or newer),
            // which NCCL reads according to the size and version it carries.
            let code = unsafe {
                (nccl.comm_init_rank_config)(
                    &mut comm,
                    size,
                    id,
                    rank,
                    (&mut config as *mut ConfigV21400).cast::<sys::ncclConfig_t>(),
                )
            };
            let this = Communicator {
                nccl,
                comm,
                stream,
                context,
                ordinal,
                global_rank,
                health: Mutex::new(Health::Ready),
                watchdog: Mutex::new(None),
                #[cfg(feature = "cuda")]
                gate: std::sync::OnceLock::new(),
            };
            if comm.is_null() {
                // `Drop` destroys the stream; there is no communicator to abort.
                let mut this = this;
                *this.health.get_mut().unwrap_or_else(|e| e.into_inner()) =
                    Health::Aborted("never created".into());
                return Err(CollectiveError::Nccl {
                    rank: global_rank,
                    op,
                    reason: format!("ncclCommInitRankConfig: {}", describe(code)),
                });
            }
            {
                let mut health = lock(&this.health);
                this.settle(&mut health, &op, code, deadline(timeout), timeout)?;
            }
            Ok(this)
        }

        /// Enqueues an operation: `before` runs first with the communicator's stream (it
        /// orders the stream after the inputs' producers), then `launch` (NCCL calls, through
        /// the given library table, on the given communicator and stream). Returns once NCCL
        /// has enqueued the work; [`Self::wait`] waits for its completion. Operations of one
        /// communicator run in the order they were launched.
        ///
        /// # Errors
        /// [`CollectiveError::Nccl`] for an NCCL or CUDA failure, a timeout (the communicator
        /// is aborted) or a communicator aborted earlier.
        pub(crate) fn launch(
            &self,
            op: &str,
            timeout: Duration,
            before: impl FnOnce(cusys::CUstream) -> Result<()>,
            launch: impl FnOnce(&Nccl, sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
        ) -> Result<Launched> {
            let mut health = lock(&self.health);
            self.check_alive(&health, op)?;
            // SAFETY: the context is the live primary context retained at creation.
            unsafe { cu::ctx::set_current(self.context) }
                .map_err(|e| self.error(op, format!("making the CUDA context current: {e}")))?;
            let until = deadline(timeout);
            before(self.stream)?;
            let started = trace::path().and_then(|_| trace::stamp(self.stream));
            let code = launch(self.nccl, self.comm, self.stream.cast());
            self.settle(&mut health, op, code, until, timeout)?;
            let event = record_event(self.stream, started.is_some())
                .map_err(|e| self.abort(&mut health, op, format!("recording a CUDA event: {e}")))?;
            Ok(Launched {
                event,
                until,
                timeout,
                started,
            })
        }

        /// Waits for a launched operation, polling NCCL's asynchronous error and the timeout
        /// (counted from the launch).
        ///
        /// # Errors
        /// As [`Self::launch`].
        pub(crate) fn wait(&self, op: &str, launched: Launched) -> Result<()> {
            let mut backoff = Backoff::default();
            let result = loop {
                match self.check(op, &launched) {
                    Ok(true) => break Ok(()),
                    Ok(false) => backoff.wait(),
                    Err(e) => break Err(e),
                }
            };
            self.finish(op, &launched, result.is_ok());
            result
        }

        /// One look at a launched operation: `Ok(true)` once it completed, `Ok(false)` while
        /// it runs; NCCL's asynchronous error, a failed stream or the deadline abort the
        /// communicator and give the error.
        fn check(&self, op: &str, launched: &Launched) -> Result<bool> {
            let mut health = lock(&self.health);
            self.check_alive(&health, op)?;
            // SAFETY: the context is the live primary context retained at creation.
            unsafe { cu::ctx::set_current(self.context) }
                .map_err(|e| self.error(op, format!("making the CUDA context current: {e}")))?;
            // SAFETY: the event is live (destroyed by `finish`, once).
            match unsafe { cusys::cuEventQuery(launched.event) } {
                cusys::CUresult::CUDA_SUCCESS => return Ok(true),
                cusys::CUresult::CUDA_ERROR_NOT_READY => {}
                failed => {
                    let reason = format!("the CUDA stream failed: {}", cu::DriverError(failed));
                    return Err(self.abort(&mut health, op, reason));
                }
            }
            self.poll(&mut health, op)?;
            if launched.until.is_some_and(|t| Instant::now() >= t) {
                return Err(self.timed_out(&mut health, op, launched.timeout));
            }
            Ok(false)
        }

        /// Releases a launched operation's events (tracing it when it completed).
        fn finish(&self, op: &str, launched: &Launched, completed: bool) {
            if let (true, Some(started)) = (completed, launched.started) {
                trace::record(op, self.global_rank, started, launched.event);
            }
            for event in [Some(launched.event), launched.started]
                .into_iter()
                .flatten()
            {
                // SAFETY: the event is not used after this (CUDA releases it once complete).
                let _ = unsafe { cu::event::destroy(event) };
            }
        }

        /// Enqueues `f(stream)` on the communicator's stream, after everything launched so
        /// far. `f` runs under the communicator's lock, so what it enqueues is ordered with
        /// every other use.
        pub(crate) fn enqueue<T>(
            &self,
            op: &str,
            f: impl FnOnce(cusys::CUstream) -> std::result::Result<T, cusys::CUresult>,
        ) -> Result<T> {
            let health = lock(&self.health);
            self.check_alive(&health, op)?;
            // SAFETY: the context is the live primary context retained at creation.
            unsafe { cu::ctx::set_current(self.context) }
                .map_err(|e| self.error(op, format!("making the CUDA context current: {e}")))?;
            f(self.stream)
                .map_err(|code| self.error(op, format!("a stream operation failed: {code:?}")))
        }

        /// The communicator's gate on `like`'s device ([`order::Gate`], made at the first
        /// call), or `None` where streams are ordered on the host.
        #[cfg(feature = "cuda")]
        pub(crate) fn gate(
            &self,
            like: &burn_cubecl::tensor::CubeTensor,
        ) -> Option<&crate::device::order::Gate> {
            self.gate
                .get_or_init(|| crate::device::order::Gate::new(like))
                .as_ref()
        }

        /// Opens the gate's waiters from the host (after an abort: nothing will write their
        /// numbers any more).
        #[cfg(feature = "cuda")]
        fn open_gate(&self) {
            if let Some(Some(gate)) = self.gate.get() {
                // SAFETY: the context is the live primary context retained at creation.
                if unsafe { cu::ctx::set_current(self.context) }.is_ok() {
                    gate.abort();
                }
            }
        }

        /// Hands a launched operation to the communicator's watchdog thread, which polls it
        /// (asynchronous errors and the deadline included), drops `keep` once it completed,
        /// and on a failure aborts the communicator: later calls on the group fail with the
        /// error, and the gate's waiters are released ([`Self::abort`]).
        pub(crate) fn watch(
            self: &Arc<Self>,
            op: String,
            launched: Launched,
            keep: Box<dyn std::any::Any + Send>,
        ) {
            let watched = Watched {
                comm: self.clone(),
                op,
                launched,
                keep,
            };
            let mut slot = lock(&self.watchdog);
            let sender = slot.get_or_insert_with(|| {
                let (sender, queue) = std::sync::mpsc::channel();
                let _ = std::thread::Builder::new()
                    .name(format!("nccl-watchdog-{}", self.global_rank))
                    .spawn(move || watchdog(queue));
                sender
            });
            if let Err(std::sync::mpsc::SendError(w)) = sender.send(watched) {
                // No watchdog (its thread could not start): wait here.
                *slot = None;
                drop(slot);
                let _ = w.comm.wait(&w.op, w.launched);
            }
        }

        fn check_alive(&self, health: &Health, op: &str) -> Result<()> {
            match health {
                Health::Ready => Ok(()),
                Health::Aborted(why) => Err(self.error(
                    op,
                    format!(
                        "this group's NCCL communicator was aborted earlier ({why}); the group \
                         cannot run device collectives any more"
                    ),
                )),
            }
        }

        fn error(&self, op: &str, reason: String) -> CollectiveError {
            CollectiveError::Nccl {
                rank: self.global_rank,
                op: op.into(),
                reason,
            }
        }

        /// NCCL's last error text for this communicator.
        fn last_error(&self) -> String {
            // SAFETY: the communicator is alive; NCCL returns a NUL-terminated string it owns.
            let text = unsafe { (self.nccl.get_last_error)(self.comm) };
            if text.is_null() {
                return String::new();
            }
            // SAFETY: non-null and NUL-terminated (see above); copied out at once.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        }

        /// Aborts the communicator and returns the error to report. Streams waiting on the
        /// device for its operations are released (their results are then garbage; the error
        /// reaches the caller at its next call on the group).
        fn abort(&self, health: &mut Health, op: &str, reason: String) -> CollectiveError {
            if matches!(health, Health::Ready) {
                // SAFETY: the communicator is alive; after this it is never used again (the
                // health says so to every later call and to `Drop`).
                let _ = unsafe { (self.nccl.comm_abort)(self.comm) };
                *health = Health::Aborted(format!("{op}: {reason}"));
                #[cfg(feature = "cuda")]
                self.open_gate();
            }
            self.error(
                op,
                format!("{reason}; the communicator was aborted (ncclCommAbort)"),
            )
        }

        /// The communicator's asynchronous state: `Ok(true)` when still in progress.
        fn poll(&self, health: &mut Health, op: &str) -> Result<bool> {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is alive and `state` outlives the call.
            let code = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) };
            if code != sys::ncclResult_t::ncclSuccess {
                let reason = format!("ncclCommGetAsyncError: {}", describe(code));
                return Err(self.abort(health, op, reason));
            }
            match state {
                sys::ncclResult_t::ncclSuccess => Ok(false),
                sys::ncclResult_t::ncclInProgress => Ok(true),
                failed => {
                    let reason = format!(
                        "asynchronous error {} ({}); a peer may have died or failed",
                        describe(failed),
                        self.last_error()
                    );
                    Err(self.abort(health, op, reason))
                }
            }
        }

        fn timed_out(&self, health: &mut Health, op: &str, timeout: Duration) -> CollectiveError {
            self.abort(
                health,
                op,
                format!(
                    "did not complete within {timeout:?} (is every rank alive and calling the \
                     same collectives in the same order? raise the timeout with \
                     ProcessGroup::with_timeout or BURN_PARALLEL_TIMEOUT_SECS)"
                ),
            )
        }

        /// Handles the return code of a non-blocking NCCL call: polls until the communicator
        /// leaves `ncclInProgress`.
        fn settle(
            &self,
            health: &mut Health,
            op: &str,
            code: sys::ncclResult_t,
            until: Option<Instant>,
            timeout: Duration,
        ) -> Result<()> {
            match code {
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
                failed => {
                    let reason = format!("{} ({})", describe(failed), self.last_error());
                    return Err(self.abort(health, op, reason));
                }
            }
            let mut backoff = Backoff::default();
            while self.poll(health, op)? {
                if until.is_some_and(|t| Instant::now() >= t) {
                    return Err(self.timed_out(health, op, timeout));
                }
                backoff.wait();
            }
            Ok(())
        }
    }

    /// A new event recorded on `stream` (of the current context) now, with timing when `timed`.
    fn record_event(
        stream: cusys::CUstream,
        timed: bool,
    ) -> std::result::Result<cusys::CUevent, cu::DriverError> {
        let flags = match timed {
            true => cusys::CUevent_flags::CU_EVENT_DEFAULT,
            false => cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        };
        let event = cu::event::create(flags)?;
        // SAFETY: the event was just created in the current context; the stream is live.
        if let Err(e) = unsafe { cu::event::record(event, stream) } {
            // SAFETY: created above, never recorded.
            let _ = unsafe { cu::event::destroy(event) };
            return Err(e);
        }
        Ok(event)
    }

    /// A device timeline of the NCCL operations, for seeing them beside the compute:
    /// `BURN_PARALLEL_NCCL_TRACE=FILE` appends one JSON line per completed operation, `{"op",
    /// "rank", "start_ms", "end_ms"}`, in milliseconds of the device's clock since the first
    /// traced operation of the process. `start_ms` is when the stream had waited for the
    /// operation's inputs (their producing kernels had finished), `end_ms` when it completed.
    /// `scripts/nccl_trace.py` turns the file into a Perfetto (Chrome JSON) trace and says how
    /// much of each step's communication ran before its last bucket's gradients were ready.
    mod trace {
        use std::io::Write;
        use std::sync::{Mutex, OnceLock};

        use cudarc::driver::result as cu;
        use cudarc::driver::sys as cusys;

        /// The trace file, read once.
        pub(super) fn path() -> Option<&'static str> {
            static PATH: OnceLock<Option<String>> = OnceLock::new();
            PATH.get_or_init(|| {
                std::env::var("BURN_PARALLEL_NCCL_TRACE")
                    .ok()
                    .filter(|p| !p.trim().is_empty())
            })
            .as_deref()
        }

        /// The first traced point of the process (never destroyed).
        struct Origin(cusys::CUevent);
        // SAFETY: a CUDA event is a plain token usable from any thread.
        unsafe impl Send for Origin {}
        static ORIGIN: Mutex<Option<Origin>> = Mutex::new(None);

        /// A timing event recorded on `stream` now (and the origin, at the first call).
        pub(super) fn stamp(stream: cusys::CUstream) -> Option<cusys::CUevent> {
            let mut origin = ORIGIN.lock().unwrap_or_else(|e| e.into_inner());
            if origin.is_none() {
                *origin = super::record_event(stream, true).ok().map(Origin);
            }
            super::record_event(stream, true).ok()
        }

        /// Appends the completed operation `op` (both events done) to the trace file.
        pub(super) fn record(
            op: &str,
            rank: usize,
            started: cusys::CUevent,
            ended: cusys::CUevent,
        ) {
            let (Some(path), Some(origin)) = (
                path(),
                ORIGIN
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .map(|o| o.0),
            ) else {
                return;
            };
            // SAFETY: the three events were recorded and have completed (the origin before
            // `started`, on the same device).
            let times = unsafe {
                (
                    cu::event::elapsed(origin, started),
                    cu::event::elapsed(origin, ended),
                )
            };
            let (Ok(start), Ok(end)) = times else { return };
            let line = serde_json::json!({
                "op": op, "rank": rank, "start_ms": start, "end_ms": end,
            });
            if let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = writeln!(file, "{line}");
            }
        }
    }

    /// Polling interval: starts at a few microseconds (small collectives finish fast), grows to
    /// one millisecond (long waits do not spin a core).
    #[derive(Default)]
    struct Backoff(u32);

    impl Backoff {
        fn wait(&mut self) {
            self.0 = self.0.saturating_add(1);
            if self.0 < 64 {
                std::hint::spin_loop();
                std::thread::yield_now();
            } else {
                let micros = (u64::from(self.0) - 63).min(1000);
                std::thread::sleep(Duration::from_micros(micros));
            }
        }
    }

    /// A raw pointer argument for NCCL.
    pub(crate) fn ptr(address: u64) -> *mut c_void {
        address as usize as *mut c_void
    }
}

/// The device path of the tensor-level collectives (features `nccl` and `cuda`).
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub(crate) mod device {
    use burn::backend::Cube;
    use burn::backend::DispatchDevice;
    use burn::tensor::{DType, Device, Shape, Tensor, TensorData};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cudarc::nccl::sys;

    use std::sync::Arc;

    use super::imp::{self, Communicator, Launched, lock, ptr};
    use super::{NcclHost, all_gather_object};
    use crate::comm::host::{ReduceOp, dtype_code, dtype_from_code};
    use crate::comm::nccl_lib::Nccl;
    use crate::device::{Held, bind, from_cube, order, to_cube};
    use crate::error::{CollectiveError, Result};

    /// `Ok(result)` when the device path ran; `Err(tensor)` hands the tensor back to the host
    /// path (not a CUDA tensor, a group without NCCL, a dtype NCCL has no type for).
    pub(crate) type Routed<T, const D: usize> = std::result::Result<T, Tensor<D>>;

    /// Marks a host frame announcing a tensor that follows through NCCL (`b"NCCLSEND"`).
    const P2P_MAGIC: u64 = u64::from_le_bytes(*b"NCCLSEND");

    /// Whether tensors on `device` take the device path on `group` (NCCL attached, a CUDA
    /// device).
    pub(crate) fn routes(group: &dyn NcclHost, device: &Device) -> bool {
        group.nccl().is_some() && cuda_ordinal(device).is_some()
    }

    /// The CUDA device index of `device`, if it is a CUDA device.
    fn cuda_ordinal(device: &Device) -> Option<usize> {
        match device.as_dispatch().clone().inner() {
            DispatchDevice::Cube(cubecl::Device::Cuda(cuda)) => Some(cuda.index),
            _ => None,
        }
    }

    fn nccl_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
        use sys::ncclDataType_t as N;
        Some(match dtype {
            DType::F64 => N::ncclFloat64,
            DType::F32 => N::ncclFloat32,
            DType::F16 => N::ncclFloat16,
            DType::BF16 => N::ncclBfloat16,
            DType::I64 => N::ncclInt64,
            DType::I32 => N::ncclInt32,
            DType::I8 => N::ncclInt8,
            DType::U64 => N::ncclUint64,
            DType::U32 => N::ncclUint32,
            DType::U8 => N::ncclUint8,
            _ => return None,
        })
    }

    fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
        match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        }
    }

    /// What a device collective works with: the communicator, the CUDA device, whether the
    /// input was an autodiff tensor, and its NCCL type.
    struct Ctx<'a> {
        group: &'a dyn NcclHost,
        comm: &'a std::sync::Mutex<imp::Slot>,
        ordinal: usize,
        autodiff: bool,
        dtype: DType,
        nccl: sys::ncclDataType_t,
    }

    /// Decides whether `tensor` takes the device path on `group`.
    fn route<'a, const D: usize>(
        group: &'a dyn NcclHost,
        tensor: &Tensor<D>,
    ) -> Option<(Ctx<'a>, Tensor<D>)> {
        let slot = group.nccl()?;
        let ordinal = cuda_ordinal(&tensor.device())?;
        let dtype = tensor.dtype();
        let nccl = nccl_dtype(dtype)?;
        let autodiff = tensor.is_autodiff();
        Some((
            Ctx {
                group,
                comm: &slot.slot,
                ordinal,
                autodiff,
                dtype,
                nccl,
            },
            tensor.clone().inner(),
        ))
    }

    impl Ctx<'_> {
        fn communicator(&self, op: &str) -> Result<std::sync::Arc<Communicator>> {
            imp::communicator(self.comm, self.group, self.ordinal, op)
        }

        fn invalid(&self, op: &str, reason: String) -> CollectiveError {
            CollectiveError::InvalidArgument {
                rank: self.group.global_rank(),
                op: op.into(),
                reason,
            }
        }

        /// Every member checks that the others call the same thing (`signature`) and learns
        /// their `sizes`, over the host transport.
        fn agree(&self, signature: &str, sizes: Vec<usize>) -> Result<Vec<Vec<usize>>> {
            let all: Vec<(String, Vec<usize>)> =
                all_gather_object(self.group, &(signature.to_string(), sizes))?;
            let mut out = Vec::with_capacity(all.len());
            for (k, (theirs, sizes)) in all.into_iter().enumerate() {
                if theirs != signature {
                    return Err(CollectiveError::Mismatch {
                        rank: self.group.global_rank(),
                        peer: self.group.members()[k],
                        ours: signature.into(),
                        theirs,
                    });
                }
                out.push(sizes);
            }
            Ok(out)
        }

        fn out<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
            if self.autodiff { t.autodiff() } else { t }
        }
    }

    /// The contiguous CubeCL primitive of a (non-autodiff) CUDA tensor.
    fn cube<const D: usize>(t: Tensor<D>, op: &str, group: &dyn NcclHost) -> Result<CubeTensor> {
        t.try_into_primitive::<Cube>()
            .map(|t| into_contiguous(to_cube(t)))
            .map_err(|e| CollectiveError::InvalidArgument {
                rank: group.global_rank(),
                op: op.into(),
                reason: format!("a CUDA tensor that is not a CubeCL primitive: {e:?}"),
            })
    }

    fn tensor<const D: usize>(t: CubeTensor) -> Tensor<D> {
        Tensor::from_primitive::<Cube>(from_cube(t))
    }

    /// A new contiguous buffer on CUDA device `ordinal`.
    fn alloc(ordinal: usize, dtype: DType, shape: Vec<usize>) -> CubeTensor {
        let device = cubecl::Device::Cuda(cubecl::device::CudaDevice::new(ordinal));
        empty_device_contiguous_dtype(device.client(), device, Shape::from(shape), dtype)
    }

    fn empty(like: &CubeTensor, shape: Vec<usize>) -> CubeTensor {
        empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            Shape::from(shape),
            like.dtype,
        )
    }

    /// A device operation in flight: the buffers it reads and writes stay bound (CubeCL
    /// neither frees nor moves a bound allocation) until the host has seen it complete.
    pub(crate) struct InFlight {
        comm: Arc<Communicator>,
        op: String,
        launched: Option<Launched>,
        held: Bound,
    }

    /// What an operation in flight keeps: its buffers' bindings and the tensors themselves.
    /// Holding the tensors matters: a tensor dropped while NCCL has not read it yet would
    /// return its memory to CubeCL's pool, and a kernel queued after the launch could write
    /// there before NCCL reads it (nothing on Burn's stream waits for NCCL).
    struct Bound(Held, Vec<CubeTensor>);

    // SAFETY: the bindings and tensors are never used, only dropped (which releases CubeCL's
    // reference counts, thread-safe), so the operation may be waited for on another thread.
    unsafe impl Send for Bound {}

    impl InFlight {
        /// Waits for completion (NCCL's asynchronous errors and the group's timeout polled).
        pub(crate) fn wait(mut self) -> Result<()> {
            let launched = self.launched.take().expect("waited once");
            let out = self.comm.wait(&self.op, launched);
            self.held.0.clear();
            self.held.1.clear();
            out
        }
    }

    impl InFlight {
        /// Orders the calling thread's CubeCL stream after the operation, on the device
        /// ([`order::Gate`]), and returns at once. The communicator's watchdog releases the
        /// buffers once the operation completed, and handles a failure (NCCL's asynchronous
        /// error, a failed stream, the deadline): it aborts the communicator, so the group's
        /// next call returns the error, and opens the gate, so Burn's stream does not wait for
        /// ever. Waits on the host instead under `BURN_PARALLEL_STREAM_ORDER=sync` or where the
        /// device refuses stream memory operations.
        pub(crate) fn wait_on_device(mut self) -> Result<()> {
            let Some(like) = self.held.1.first().cloned() else {
                return self.wait();
            };
            let comm = self.comm.clone();
            let Some(gate) = comm.gate(&like) else {
                return self.wait();
            };
            // The gate's number is written right after the operation (its completion event,
            // which the watchdog polls and the trace times, stays the operation's own).
            match comm.enqueue(&self.op, |stream| gate.open_after(stream)) {
                Ok(seq) => gate.close_until(seq),
                Err(_) => return self.wait(),
            }
            let launched = self.launched.take().expect("waited once");
            let held = std::mem::replace(&mut self.held, Bound(Vec::new(), Vec::new()));
            comm.watch(self.op.clone(), launched, Box::new(held));
            Ok(())
        }
    }

    impl InFlight {
        /// Returns at once, the operation left to the communicator's watchdog, which releases
        /// its buffers once it completed and aborts the communicator on a failure (the next
        /// call on it returns the error). For an operation nothing on Burn's stream reads: a
        /// send.
        pub(crate) fn release(mut self) {
            let launched = self.launched.take().expect("waited once");
            let held = std::mem::replace(&mut self.held, Bound(Vec::new(), Vec::new()));
            self.comm.watch(self.op.clone(), launched, Box::new(held));
        }
    }

    impl Drop for InFlight {
        fn drop(&mut self) {
            // Dropped unwaited (an error path): the buffers are released only once NCCL is
            // done with them (or the communicator was aborted on a timeout).
            if let Some(launched) = self.launched.take() {
                let _ = self.comm.wait(&self.op, launched);
            }
        }
    }

    /// Binds `tensors`' device buffers and enqueues `launch` (NCCL calls given the library,
    /// communicator, stream and the buffers' addresses) on `comm`'s stream, ordered after the
    /// work Burn queued on the calling thread's stream by [`order::mark`] (a device wait: the
    /// host does not wait for Burn's kernels; where the device refuses it, `client.sync()`).
    fn launch_bound(
        tensors: &[&CubeTensor],
        op: &str,
        group: &dyn NcclHost,
        comm: &Arc<Communicator>,
        launch: impl FnOnce(&Nccl, sys::ncclComm_t, sys::cudaStream_t, &[u64]) -> sys::ncclResult_t,
    ) -> Result<InFlight> {
        let error = |what: &str, e: String| CollectiveError::Nccl {
            rank: group.global_rank(),
            op: op.into(),
            reason: format!("{what}: {e}"),
        };
        // Marked before binding: what Burn queued so far, the inputs' producers included.
        let mark = tensors.first().map(|t| order::mark(t));
        let (held, addresses) = bind(tensors).map_err(|e| error("binding a device buffer", e))?;
        let client = tensors.first().map(|t| t.client.clone());
        let launched = comm.launch(
            op,
            group.timeout(),
            |stream| {
                if mark.as_ref().is_some_and(|m| m.wait_on(stream)) {
                    return Ok(());
                }
                match &client {
                    Some(client) => cubecl::future::block_on(client.sync())
                        .map_err(|e| error("waiting for Burn's queued work", format!("{e:?}"))),
                    None => Ok(()),
                }
            },
            |lib, c, s| launch(lib, c, s, &addresses),
        )?;
        Ok(InFlight {
            comm: comm.clone(),
            op: op.into(),
            launched: Some(launched),
            held: Bound(held, tensors.iter().map(|t| (*t).clone()).collect()),
        })
    }

    /// [`launch_bound`], then waits for completion.
    fn run_bound(
        tensors: &[&CubeTensor],
        op: &str,
        group: &dyn NcclHost,
        comm: &Arc<Communicator>,
        launch: impl FnOnce(&Nccl, sys::ncclComm_t, sys::cudaStream_t, &[u64]) -> sys::ncclResult_t,
    ) -> Result<()> {
        launch_bound(tensors, op, group, comm, launch)?.wait()
    }

    fn count(t: &CubeTensor) -> usize {
        t.meta.shape().num_elements()
    }

    /// All-reduce in device memory.
    pub(crate) fn all_reduce<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        op: ReduceOp,
    ) -> Result<Routed<Tensor<D>, D>> {
        finished(all_reduce_start(group, t, op)?)
    }

    /// A device collective launched and not waited for: the operation in flight, and what
    /// makes its result once it completed (on the host or on the device: kernels queued after
    /// the wait).
    pub(crate) type Started<T> = (InFlight, Finish<T>);

    /// Makes a started collective's result; call it after waiting for the operation.
    pub(crate) type Finish<T> = Box<dyn FnOnce() -> Result<T> + Send>;

    /// Waits for a started collective on the host and makes its result.
    fn finished<T, const D: usize>(started: Routed<Started<T>, D>) -> Result<Routed<T, D>> {
        Ok(match started {
            Ok((flight, finish)) => {
                flight.wait()?;
                Ok(finish()?)
            }
            Err(t) => Err(t),
        })
    }

    /// Launches an all-reduce in device memory and returns at once (see [`Started`]).
    pub(crate) fn all_reduce_start<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        op: ReduceOp,
    ) -> Result<Routed<Started<Tensor<D>>, D>> {
        let Some((ctx, x)) = route(group, &t) else {
            return Ok(Err(t));
        };
        let shape = x.shape().as_slice().to_vec();
        let sig = format!("nccl all_reduce({op} {:?}{shape:?})", ctx.dtype);
        if super::signature_checks() {
            ctx.agree(&sig, vec![])?;
        }
        let comm = ctx.communicator(&sig)?;
        let x = cube(x, &sig, group)?;
        let y = empty(&x, shape);
        let n = count(&x);
        let flight = launch_bound(&[&x, &y], &sig, group, &comm, |lib, c, s, addresses| {
            let (src, dst) = (addresses[0], addresses[1]);
            // SAFETY: `src` and `dst` are bound device buffers of `n` elements of this type, in
            // the context NCCL runs in; they stay bound until the operation was waited for.
            unsafe { (lib.all_reduce)(ptr(src), ptr(dst), n, ctx.nccl, nccl_op(op), c, s) }
        })?;
        let y = ctx.out(tensor(y));
        Ok(Ok((flight, Box::new(move || Ok(y)))))
    }

    /// Broadcast from group rank `root` in device memory.
    pub(crate) fn broadcast<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        root: usize,
    ) -> Result<Routed<Tensor<D>, D>> {
        let Some((ctx, x)) = route(group, &t) else {
            return Ok(Err(t));
        };
        let shape = x.shape().as_slice().to_vec();
        let sig = format!("nccl broadcast(root {root} {:?}{shape:?})", ctx.dtype);
        if root >= group.size() {
            return Err(ctx.invalid(&sig, format!("root {root} is out of range")));
        }
        if super::signature_checks() {
            ctx.agree(&sig, vec![])?;
        }
        let comm = ctx.communicator(&sig)?;
        let x = cube(x, &sig, group)?;
        let y = empty(&x, shape);
        let n = count(&x);
        run_bound(&[&x, &y], &sig, group, &comm, |lib, c, s, addresses| {
            let (src, dst) = (addresses[0], addresses[1]);
            // SAFETY: as in `all_reduce`: bound buffers of `n` elements, waited for.
            unsafe { (lib.broadcast)(ptr(src), ptr(dst), n, ctx.nccl, root as i32, c, s) }
        })?;
        Ok(Ok(ctx.out(tensor(y))))
    }

    fn shape_except(shape: &[usize], dim: usize) -> Vec<String> {
        shape
            .iter()
            .enumerate()
            .map(|(i, d)| if i == dim { "*".into() } else { d.to_string() })
            .collect()
    }

    /// All-gather along `dim` in device memory (uneven sizes along `dim` allowed).
    pub(crate) fn all_gather<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        dim: usize,
    ) -> Result<Routed<Tensor<D>, D>> {
        finished(all_gather_start(group, t, dim)?)
    }

    /// Launches an all-gather along `dim` in device memory and returns at once (see
    /// [`Started`]); uneven pieces go by grouped sends and receives.
    pub(crate) fn all_gather_start<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        dim: usize,
    ) -> Result<Routed<Started<Tensor<D>>, D>> {
        if dim >= D {
            return Ok(Err(t)); // the host path reports the error
        }
        let Some((ctx, x)) = route(group, &t) else {
            return Ok(Err(t));
        };
        let shape = x.shape().as_slice().to_vec();
        let sig = format!(
            "nccl all_gather(dim {dim} {:?}{:?})",
            ctx.dtype,
            shape_except(&shape, dim)
        );
        let sizes: Vec<usize> = ctx
            .agree(&sig, vec![shape[dim]])?
            .into_iter()
            .map(|s| s[0])
            .collect();
        if sizes.iter().all(|&s| s == 0) {
            // Every rank knows it (the sizes were exchanged): all refuse, none launches.
            return Err(ctx.invalid(&sig, "every rank passed an empty piece".into()));
        }
        let n = group.size();
        let comm = ctx.communicator(&sig)?;
        let piece_shape = |k: usize| {
            let mut s = shape.clone();
            s[dim] = sizes[k];
            s
        };
        let shapes: Vec<Vec<usize>> = (0..n).map(piece_shape).collect();
        let (flight, pieces): (InFlight, Box<dyn FnOnce() -> Vec<Tensor<D>> + Send>) =
            if sizes.iter().all(|&s| s == sizes[0]) {
                // Even: one ncclAllGather into rank-major storage.
                let x = cube(x, &sig, group)?;
                let each = count(&x);
                let y = empty(&x, vec![n * each]);
                let flight =
                    launch_bound(&[&x, &y], &sig, group, &comm, |lib, c, s, addresses| {
                        let (src, dst) = (addresses[0], addresses[1]);
                        // SAFETY: `src` holds `each` elements, `dst` `n * each`; bound until waited for.
                        unsafe { (lib.all_gather)(ptr(src), ptr(dst), each, ctx.nccl, c, s) }
                    })?;
                let pieces = move || {
                    let flat: Tensor<1> = tensor(y);
                    shapes
                        .into_iter()
                        .enumerate()
                        .map(|(k, shape)| {
                            flat.clone()
                                .narrow(0, k * each, each)
                                .reshape(Shape::from(shape))
                        })
                        .collect()
                };
                (flight, Box::new(pieces))
            } else {
                // Uneven: every rank sends its piece to every other, grouped.
                let x = cube(x, &sig, group)?;
                let received: Vec<CubeTensor> = shapes.into_iter().map(|s| empty(&x, s)).collect();
                let mut all: Vec<&CubeTensor> = vec![&x];
                all.extend(received.iter());
                let me = group.rank();
                let flight = launch_bound(&all, &sig, group, &comm, |lib, c, s, addresses| {
                    let mine = count(&x);
                    let counts: Vec<usize> = received.iter().map(count).collect();
                    let addresses = addresses.to_vec();
                    grouped(lib, || {
                        let mut code = sys::ncclResult_t::ncclSuccess;
                        for k in (0..n).filter(|&k| k != me) {
                            if mine > 0 {
                                // SAFETY: bound buffer of `mine` elements until waited for.
                                code = unsafe {
                                    (lib.send)(ptr(addresses[0]), mine, ctx.nccl, k as i32, c, s)
                                };
                                if is_failure(code) {
                                    return code;
                                }
                            }
                            if counts[k] > 0 {
                                // SAFETY: bound buffer of `counts[k]` elements until waited for.
                                code = unsafe {
                                    (lib.recv)(
                                        ptr(addresses[k + 1]),
                                        counts[k],
                                        ctx.nccl,
                                        k as i32,
                                        c,
                                        s,
                                    )
                                };
                                if is_failure(code) {
                                    return code;
                                }
                            }
                        }
                        code
                    })
                })?;
                let pieces = move || {
                    let x_tensor: Tensor<D> = tensor(x);
                    received
                        .into_iter()
                        .enumerate()
                        .map(|(k, r)| if k == me { x_tensor.clone() } else { tensor(r) })
                        .collect()
                };
                (flight, Box::new(pieces))
            };
        let autodiff = ctx.autodiff;
        let finish = move || {
            let pieces: Vec<Tensor<D>> = pieces()
                .into_iter()
                .zip(&sizes)
                .filter(|(_, s)| **s > 0)
                .map(|(p, _)| p)
                .collect();
            let y = Tensor::cat(pieces, dim);
            Ok(if autodiff { y.autodiff() } else { y })
        };
        Ok(Ok((flight, Box::new(finish))))
    }

    fn is_failure(code: sys::ncclResult_t) -> bool {
        !matches!(
            code,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        )
    }

    /// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd` of `lib` (always ended, so a
    /// failed call does not leave the thread inside a group).
    fn grouped(lib: &Nccl, calls: impl FnOnce() -> sys::ncclResult_t) -> sys::ncclResult_t {
        // SAFETY: group calls only mark the thread's NCCL calls as one launch.
        let start = unsafe { (lib.group_start)() };
        if is_failure(start) {
            return start;
        }
        let inner = calls();
        // SAFETY: closes the group opened above.
        let end = unsafe { (lib.group_end)() };
        if is_failure(inner) { inner } else { end }
    }

    /// Reduce-scatter along `dim` in device memory: pieces (of `sizes` along `dim`) are
    /// flattened and padded to the largest, so one `ncclReduceScatter` serves uneven sizes.
    pub(crate) fn reduce_scatter<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        dim: usize,
        op: ReduceOp,
        sizes: Option<&[usize]>,
    ) -> Result<Routed<Tensor<D>, D>> {
        finished(reduce_scatter_start(group, t, dim, op, sizes)?)
    }

    /// Launches a reduce-scatter in device memory and returns at once (see [`Started`]).
    pub(crate) fn reduce_scatter_start<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        dim: usize,
        op: ReduceOp,
        sizes: Option<&[usize]>,
    ) -> Result<Routed<Started<Tensor<D>>, D>> {
        let n = group.size();
        let shape = t.shape().as_slice().to_vec();
        let sizes: Vec<usize> = match sizes {
            _ if dim >= D => return Ok(Err(t)),
            Some(s) if s.len() == n && s.iter().sum::<usize>() == shape[dim] => s.to_vec(),
            None if shape[dim].is_multiple_of(n) => vec![shape[dim] / n; n],
            // The host path reports the error.
            _ => return Ok(Err(t)),
        };
        let Some((ctx, x)) = route(group, &t) else {
            return Ok(Err(t));
        };
        let sig = format!(
            "nccl reduce_scatter({op} dim {dim} sizes {sizes:?} {:?}{shape:?})",
            ctx.dtype
        );
        if super::signature_checks() {
            ctx.agree(&sig, vec![])?;
        }
        let comm = ctx.communicator(&sig)?;
        let numel = |s: usize| shape.iter().product::<usize>() / shape[dim].max(1) * s;
        let widest = sizes.iter().map(|&s| numel(s)).max().unwrap_or(0);
        let mut offset = 0;
        let mut rows = Vec::with_capacity(n);
        for &s in &sizes {
            let piece: Tensor<1> = x.clone().narrow(dim, offset, s).flatten(0, D - 1);
            offset += s;
            let pad = widest - numel(s);
            rows.push(if pad == 0 {
                piece
            } else {
                let zeros = Tensor::<1>::zeros([pad], (&piece.device(), ctx.dtype));
                Tensor::cat(vec![piece, zeros], 0)
            });
        }
        let stacked = cube(Tensor::cat(rows, 0), &sig, group)?;
        let y = empty(&stacked, vec![widest]);
        let flight = launch_bound(
            &[&stacked, &y],
            &sig,
            group,
            &comm,
            |lib, c, s, addresses| {
                let (src, dst) = (addresses[0], addresses[1]);
                // SAFETY: `src` holds `n * widest` elements and `dst` `widest`; bound until
                // waited for.
                unsafe {
                    (lib.reduce_scatter)(ptr(src), ptr(dst), widest, ctx.nccl, nccl_op(op), c, s)
                }
            },
        )?;
        let mine = numel(sizes[group.rank()]);
        let mut out_shape = shape.clone();
        out_shape[dim] = sizes[group.rank()];
        let autodiff = ctx.autodiff;
        let finish = move || {
            let flat: Tensor<1> = tensor(y);
            let y = flat.narrow(0, 0, mine).reshape(Shape::from(out_shape));
            Ok(if autodiff { y.autodiff() } else { y })
        };
        Ok(Ok((flight, Box::new(finish))))
    }

    /// All-to-all along `dim` in device memory, from grouped send/recv.
    pub(crate) fn all_to_all<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        dim: usize,
        send_sizes: &[usize],
    ) -> Result<Routed<Tensor<D>, D>> {
        let n = group.size();
        let shape = t.shape().as_slice().to_vec();
        if dim >= D || send_sizes.len() != n || send_sizes.iter().sum::<usize>() != shape[dim] {
            return Ok(Err(t)); // the host path reports the error
        }
        let Some((ctx, x)) = route(group, &t) else {
            return Ok(Err(t));
        };
        let sig = format!(
            "nccl all_to_all(dim {dim} {:?}{:?})",
            ctx.dtype,
            shape_except(&shape, dim)
        );
        let all = ctx.agree(&sig, send_sizes.to_vec())?;
        let me = group.rank();
        let recv_sizes: Vec<usize> = all.iter().map(|s| s[me]).collect();
        let comm = ctx.communicator(&sig)?;
        let mut offset = 0;
        let mut outgoing = Vec::with_capacity(n);
        for &s in send_sizes {
            outgoing.push(x.clone().narrow(dim, offset, s));
            offset += s;
        }
        let own = outgoing[me].clone();
        drop(x);
        let sends: Vec<Option<CubeTensor>> = outgoing
            .into_iter()
            .enumerate()
            .map(|(k, p)| {
                (k != me && send_sizes[k] > 0)
                    .then(|| cube(p, &sig, group))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let recvs: Vec<Option<CubeTensor>> = (0..n)
            .map(|k| {
                (k != me && recv_sizes[k] > 0).then(|| {
                    let mut s = shape.clone();
                    s[dim] = recv_sizes[k];
                    alloc(ctx.ordinal, ctx.dtype, s)
                })
            })
            .collect();
        let mut buffers: Vec<&CubeTensor> = sends.iter().flatten().collect();
        buffers.extend(recvs.iter().flatten());
        run_bound(&buffers, &sig, group, &comm, |lib, c, s, addresses| {
            // Addresses in the order bound: the sends, then the receives.
            let mut next = addresses.iter().copied();
            let send_at: Vec<Option<(u64, usize)>> = sends
                .iter()
                .map(|b| b.as_ref().map(|b| (next.next().expect("bound"), count(b))))
                .collect();
            let recv_at: Vec<Option<(u64, usize)>> = recvs
                .iter()
                .map(|b| b.as_ref().map(|b| (next.next().expect("bound"), count(b))))
                .collect();
            grouped(lib, || {
                let mut code = sys::ncclResult_t::ncclSuccess;
                for k in 0..n {
                    if let Some((address, len)) = send_at[k] {
                        // SAFETY: bound buffer of `len` elements; waited for.
                        code = unsafe { (lib.send)(ptr(address), len, ctx.nccl, k as i32, c, s) };
                        if is_failure(code) {
                            return code;
                        }
                    }
                    if let Some((address, len)) = recv_at[k] {
                        // SAFETY: bound buffer of `len` elements; waited for.
                        code = unsafe { (lib.recv)(ptr(address), len, ctx.nccl, k as i32, c, s) };
                        if is_failure(code) {
                            return code;
                        }
                    }
                }
                code
            })
        })?;
        let mut recvs = recvs;
        let pieces: Vec<Tensor<D>> = (0..n)
            .filter(|&k| recv_sizes[k] > 0)
            .map(|k| {
                if k == me {
                    own.clone()
                } else {
                    tensor(recvs[k].take().expect("allocated for every sender"))
                }
            })
            .collect();
        // Nothing received: this rank's own (empty) piece has the result's shape.
        let out = if pieces.is_empty() {
            own
        } else {
            Tensor::cat(pieces, dim)
        };
        Ok(Ok(ctx.out(out)))
    }

    /// Sends a CUDA tensor to group rank `peer`: a host frame under `tag` announces it (dtype,
    /// shape, order), the data follows through NCCL on the channel to `peer`. Returns once the
    /// send is launched (ordered after the tensor's producers); the watchdog holds the buffer
    /// until it completed.
    pub(crate) fn send<const D: usize>(
        group: &dyn NcclHost,
        t: Tensor<D>,
        peer: usize,
        tag: u64,
    ) -> Result<Routed<(), D>> {
        if peer >= group.size() || peer == group.rank() {
            return Ok(Err(t)); // the host path reports the error
        }
        let Some((ctx, x)) = route(group, &t) else {
            return Ok(Err(t));
        };
        let shape = x.shape().as_slice().to_vec();
        let sig = format!("nccl send(to {peer}, tag {tag}, {:?}{shape:?})", ctx.dtype);
        // Announced first: a receiver connects the channel once it sees a device message.
        announce(group, ctx.dtype, &shape, peer, tag)?;
        let me = group.rank();
        let comm = imp::channel(ctx.comm, group, ctx.ordinal, (me, peer), &sig)?;
        let x = cube(x, &sig, group)?;
        let n = count(&x);
        launch_bound(&[&x], &sig, group, &comm, |lib, c, s, addresses| {
            let src = addresses[0];
            // SAFETY: bound buffer of `n` elements, held until the watchdog saw it complete.
            // On the channel this rank is rank 0 and the receiver rank 1.
            unsafe { (lib.send)(ptr(src), n, ctx.nccl, 1, c, s) }
        })?
        .release();
        Ok(Ok(()))
    }

    /// Creates the channels between this rank and each of `peers` for tensors on `device`
    /// ([`ProcessGroup::connect_peers`](crate::ProcessGroup::connect_peers)): pairs in the
    /// order of their lower, then higher rank. Nothing when `device` is not a CUDA device or
    /// the group has no NCCL.
    pub(crate) fn connect_peers(
        group: &dyn NcclHost,
        peers: &[usize],
        device: &Device,
    ) -> Result<()> {
        let (Some(slot), Some(ordinal)) = (group.nccl(), cuda_ordinal(device)) else {
            return Ok(());
        };
        let me = group.rank();
        let mut pairs: Vec<(usize, usize)> =
            peers.iter().map(|&p| (me.min(p), me.max(p))).collect();
        pairs.sort_unstable();
        pairs.dedup();
        for (low, high) in pairs {
            imp::connect_pair(&slot.slot, group, ordinal, low, high, "connect_peers")?;
        }
        Ok(())
    }

    /// What [`recv`] got.
    pub(crate) enum Received {
        /// A host frame (the sender used the host path).
        Host(TensorData),
        /// A tensor that came through NCCL, flat, with its shape.
        Device(Box<Tensor<1>>, Vec<usize>),
    }

    /// Receives a tensor from group rank `peer` under `tag` onto `device`: through NCCL when
    /// the sender announced a device send, from the host frame otherwise. `None` when the
    /// device path does not apply (no NCCL, or `device` is not a CUDA device).
    pub(crate) fn recv(
        group: &dyn NcclHost,
        peer: usize,
        tag: u64,
        device: &Device,
    ) -> Result<Option<Received>> {
        let (Some(slot), Some(ordinal)) = (group.nccl(), cuda_ordinal(device)) else {
            return Ok(None);
        };
        if peer >= group.size() || peer == group.rank() {
            return Ok(None); // the host path reports the error
        }
        let data = group.recv_data(peer, tag)?;
        let sig = format!("nccl recv(from {peer}, tag {tag})");
        let Some((dtype, nccl, shape)) = device_header(group, &data, peer, tag, &sig)? else {
            return Ok(Some(Received::Host(data)));
        };
        let ctx = Ctx {
            group,
            comm: &slot.slot,
            ordinal,
            autodiff: device.is_autodiff(),
            dtype,
            nccl,
        };
        let comm = imp::channel(ctx.comm, group, ordinal, (peer, group.rank()), &sig)?;
        let y = alloc(ordinal, dtype, vec![shape.iter().product()]);
        let n = count(&y);
        // Burn's stream waits for the receive on the device; the host goes on.
        launch_bound(&[&y], &sig, group, &comm, |lib, c, s, addresses| {
            let dst = addresses[0];
            // SAFETY: bound buffer of `n` elements, held until the receive completed. On the
            // channel the sender is rank 0.
            unsafe { (lib.recv)(ptr(dst), n, nccl, 0, c, s) }
        })?
        .wait_on_device()?;
        let received: Tensor<1> = tensor(y);
        Ok(Some(Received::Device(
            Box::new(ctx.out(received.reshape([n]))),
            shape,
        )))
    }

    /// Announces a device send to `peer` under `tag`: a host frame with the message's order
    /// between the two ranks, its dtype and its shape (NCCL's data follows).
    fn announce(
        group: &dyn NcclHost,
        dtype: DType,
        shape: &[usize],
        peer: usize,
        tag: u64,
    ) -> Result<()> {
        let slot = &group.nccl().expect("routed").slot;
        let order = {
            let mut slot = lock(slot);
            let counter = slot.sent.entry(peer).or_insert(0);
            *counter += 1;
            *counter
        };
        let code = dtype_code(dtype).expect("NCCL dtypes have codes");
        let mut header = vec![P2P_MAGIC, order, code];
        header.extend(shape.iter().map(|&d| d as u64));
        let len = header.len();
        group.send_data(TensorData::new(header, [len]), peer, tag)
    }

    /// Reads the announcement of a device send from `peer` ([`announce`]): the dtype, its
    /// NCCL type and the shape, after checking the message's order; `None` when `data` is a
    /// host frame (the sender took the host path).
    fn device_header(
        group: &dyn NcclHost,
        data: &TensorData,
        peer: usize,
        tag: u64,
        sig: &str,
    ) -> Result<Option<(DType, sys::ncclDataType_t, Vec<usize>)>> {
        let header: Option<Vec<u64>> = (data.dtype() == DType::U64)
            .then(|| data.try_to_vec::<u64>().ok())
            .flatten()
            .filter(|h| h.len() >= 3 && h[0] == P2P_MAGIC);
        let Some(header) = header else {
            return Ok(None);
        };
        let bad = |reason: String| CollectiveError::Transport {
            rank: group.global_rank(),
            peer: group.members()[peer],
            reason,
        };
        let dtype = dtype_from_code(header[2])
            .ok_or_else(|| bad("unknown dtype in a device send".into()))?;
        let nccl = nccl_dtype(dtype).ok_or_else(|| bad(format!("{dtype:?} cannot go by NCCL")))?;
        let shape: Vec<usize> = header[3..].iter().map(|&d| d as usize).collect();
        let slot = &group.nccl().expect("routed").slot;
        let expected = {
            let mut slot = lock(slot);
            let counter = slot.received.entry(peer).or_insert(0);
            *counter += 1;
            *counter
        };
        if header[1] != expected {
            return Err(CollectiveError::Mismatch {
                rank: group.global_rank(),
                peer: group.members()[peer],
                ours: format!(
                    "{sig} as device message {expected} from that rank (NCCL delivers device \
                     messages between two ranks in the order they were sent, whatever their tag)"
                ),
                theirs: format!("device message {} under tag {tag}", header[1]),
            });
        }
        Ok(Some((dtype, nccl, shape)))
    }
}
