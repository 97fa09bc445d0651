//! The `mpi` backend (feature `mpi`): ranks are the processes of an MPI job, started by
//! `mpirun -np N prog` or SLURM's `srun prog`; rank and world size come from MPI itself.
//!
//! - The host-data collectives of [`ProcessGroup`](crate::ProcessGroup) (all-reduce, all-gather, reduce-scatter,
//!   broadcast, all-to-all, barrier) run on MPI's own algorithms, through
//!   [`NativeCollectives`](crate::comm::transport::NativeCollectives). Before moving data, every call all-gathers a small header (a hash of
//!   the call's signature: operation, call number, dtype, shape), so a rank calling another
//!   collective, or the same one on another shape, is a [`CollectiveError::Mismatch`] naming
//!   both calls instead of corrupted data.
//! - Point-to-point messages and the frame-based helpers (bytes, objects) travel as MPI
//!   messages on a communicator of their own: `send` posts `MPI_Isend`s and returns (it never
//!   waits for the receiver), and a progress thread receives every incoming frame into the
//!   [`Mailbox`](crate::comm::transport::Mailbox), completes finished sends, and drives MPI's progress. This keeps one
//!   [`Transport`] contract for every backend, so every technique runs unchanged.
//! - Sub-groups ([`ProcessGroup::split`](crate::ProcessGroup::split), called by the members only) get their communicator
//!   from `MPI_Comm_create_group`, which only the members call, created at the group's first
//!   collective after a handshake among the members that has the group's timeout.
//! - No count overflows: every MPI call moves at most `i32::MAX` units; larger buffers are
//!   split into chunks or rounds (see [`chunks`]).
//! - Timeouts: the header exchange that starts every collective is nonblocking and polled with
//!   `MPI_Test` under the group's timeout. A rank that does not join (dead, stuck, or calling
//!   something else) makes it fail with [`CollectiveError::CollectiveTimeout`]; the unfinished
//!   exchange then stays on the communicator, so the job cannot go on, and it ends with
//!   `MPI_Abort` when the process exits. Once every member has joined, the data moves with
//!   MPI's blocking collectives (Open MPI's tuned algorithms and their MCA settings apply); a
//!   rank that dies inside one is seen by the MPI runtime, which ends the job, and an MPI error
//!   there is printed as a typed error before `MPI_Abort` (the buffers are then unusable).
//!
//! Requires an MPI library providing `MPI_THREAD_MULTIPLE` (Open MPI and MPICH do).
//!
//! # Example
//! ```no_run
//! use burn_parallel::ReduceOp;
//! // In a program started by `mpirun -np 4 prog` (or `srun prog`):
//! let world = burn_parallel::world::init_mpi()?;
//! let total = world.all_reduce_f32(vec![world.rank() as f32], ReduceOp::Sum)?;
//! assert_eq!(total, vec![6.0]);
//! # Ok::<(), burn_parallel::CollectiveError>(())
//! ```

use std::sync::Arc;

use crate::comm::transport::Transport;
#[cfg(feature = "mpi")]
use crate::comm::transport::{Mailbox, NativeCall, NativeCollectives};
use crate::error::{CollectiveError, Result};

#[path = "mpi/chunks.rs"]
pub mod chunks;

/// What to build and install for the `mpi` backend.
pub const NOT_BUILT_HINT: &str = "build with the `mpi` feature of burn-parallel (`--features \
    burn-parallel/mpi`, or `--features examples/mpi` for the `gpt` trainer); it needs an MPI \
    library with its headers and libclang at build time (Debian/Ubuntu: `apt-get install \
    libopenmpi-dev openmpi-bin libclang-dev clang`)";

/// Environment variable: the most units one MPI call moves (default and maximum `i32::MAX`).
/// Only useful to exercise the chunked paths with small buffers in tests.
pub const MAX_COUNT_VAR: &str = "BURN_PARALLEL_MPI_MAX_COUNT";

/// The transport of `MPI_COMM_WORLD`, created (MPI initialised with `MPI_THREAD_MULTIPLE`) on
/// the first call and shared by later ones; [`crate::world::init_mpi`] makes the world group
/// on it.
///
/// # Errors
/// As [`crate::world::init_mpi`].
pub(crate) fn world_transport() -> Result<Arc<dyn Transport>> {
    #[cfg(feature = "mpi")]
    {
        backend::world().map(|t| t as Arc<dyn Transport>)
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(CollectiveError::BackendNotBuilt {
            backend: "mpi".into(),
            hint: NOT_BUILT_HINT.into(),
        })
    }
}

/// How long the exit barrier waits for the other ranks (the world group's timeout).
pub(crate) fn set_exit_timeout(timeout: std::time::Duration) {
    #[cfg(feature = "mpi")]
    backend::set_exit_timeout(timeout);
    #[cfg(not(feature = "mpi"))]
    let _ = timeout;
}

#[cfg(feature = "mpi")]
mod backend {
    use std::collections::HashMap;
    use std::ffi::{c_char, c_int, c_void};
    use std::mem::MaybeUninit;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, OnceLock};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use burn::tensor::DType;
    use bytes::Bytes;
    use mpi::Threading;
    use mpi::ffi;

    use super::chunks::{Rounds, chunks, to_int};
    use super::*;
    use crate::ReduceOp;
    use crate::comm::host::combine_into;
    use crate::comm::transport::{Frame, Header, StreamId};

    /// Frame heads (header, and the payload when it is small).
    const TAG_HEAD: c_int = 1;
    /// Payload chunks following a head, in order (MPI keeps the order per source and tag).
    const TAG_CHUNK: c_int = 2;
    /// Payloads up to this size travel inside the head message (one message per frame).
    const INLINE_PAYLOAD: usize = 64 * 1024;
    /// Words of the header every collective all-gathers first.
    const HEADER_WORDS: usize = 6;
    /// Extra words that fit in the header itself.
    const INLINE_EXTRA: usize = HEADER_WORDS - 3;

    /// An MPI handle (communicator, datatype, op, request) that crosses threads.
    #[derive(Clone, Copy)]
    struct Handle<T>(T);
    // SAFETY: MPI handles are opaque references to library objects, usable from any thread of
    // the process because MPI was initialised with MPI_THREAD_MULTIPLE (checked in `start`).
    unsafe impl<T> Send for Handle<T> {}
    // SAFETY: as above; the library serialises access to its objects itself.
    unsafe impl<T> Sync for Handle<T> {}

    type Comm = Handle<ffi::MPI_Comm>;

    /// The transport of the world, created once per process.
    static WORLD: OnceLock<std::result::Result<Arc<MpiTransport>, CollectiveError>> =
        OnceLock::new();

    pub(super) fn world() -> Result<Arc<MpiTransport>> {
        WORLD.get_or_init(start).clone()
    }

    pub(super) fn set_exit_timeout(timeout: Duration) {
        if let Some(Ok(transport)) = WORLD.get() {
            *lock(&transport.exit_timeout) = timeout;
        }
    }

    fn mpi_error(code: c_int) -> String {
        let mut buf = [0 as c_char; 1024];
        let mut len: c_int = 0;
        // SAFETY: MPI_Error_string writes at most MPI_MAX_ERROR_STRING (< 1024) characters.
        unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
        let bytes: Vec<u8> = buf[..len.clamp(0, 1024) as usize]
            .iter()
            .map(|&c| c as u8)
            .collect();
        format!("MPI error {code}: {}", String::from_utf8_lossy(&bytes))
    }

    fn check(code: c_int, what: &str) -> std::result::Result<(), String> {
        if code == ffi::MPI_SUCCESS as c_int {
            Ok(())
        } else {
            Err(format!("{what} failed: {}", mpi_error(code)))
        }
    }

    fn u8_type() -> ffi::MPI_Datatype {
        // SAFETY: a constant exported by mpi-sys, valid once MPI is initialised.
        unsafe { ffi::RSMPI_UINT8_T }
    }

    fn u64_type() -> ffi::MPI_Datatype {
        // SAFETY: as in `u8_type`.
        unsafe { ffi::RSMPI_UINT64_T }
    }

    /// A stable 64-bit hash (FNV-1a) of a call's signature, equal in every process.
    fn signature_hash(signature: &str) -> u64 {
        signature.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    // ---------------------------------------------------------------------------------------
    // Reductions MPI has no built-in type for: f16 and bf16, as user-defined operations.

    macro_rules! half_op {
        ($name:ident, $dtype:expr, $op:expr) => {
            unsafe extern "C" fn $name(
                invec: *mut c_void,
                inoutvec: *mut c_void,
                len: *mut c_int,
                _datatype: *mut ffi::MPI_Datatype,
            ) {
                // SAFETY: MPI passes `*len` elements of our 2-byte datatype in each buffer, and
                // the two buffers do not overlap.
                let (input, inout) = unsafe {
                    let bytes = (*len).max(0) as usize * 2;
                    (
                        std::slice::from_raw_parts(invec as *const u8, bytes),
                        std::slice::from_raw_parts_mut(inoutvec as *mut u8, bytes),
                    )
                };
                combine_into(inout, input, $dtype, $op, 1);
            }
        };
    }
    half_op!(f16_sum, DType::F16, ReduceOp::Sum);
    half_op!(f16_max, DType::F16, ReduceOp::Max);
    half_op!(f16_min, DType::F16, ReduceOp::Min);
    half_op!(bf16_sum, DType::BF16, ReduceOp::Sum);
    half_op!(bf16_max, DType::BF16, ReduceOp::Max);
    half_op!(bf16_min, DType::BF16, ReduceOp::Min);

    type UserFn =
        unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

    /// Datatypes and operations for half-precision reductions.
    struct HalfOps {
        f16: Handle<ffi::MPI_Datatype>,
        bf16: Handle<ffi::MPI_Datatype>,
        /// `[f16, bf16] x [sum, max, min]`.
        ops: [[Handle<ffi::MPI_Op>; 3]; 2],
    }

    impl HalfOps {
        fn create() -> std::result::Result<Self, String> {
            let datatype = || -> std::result::Result<Handle<ffi::MPI_Datatype>, String> {
                let mut t = MaybeUninit::uninit();
                // SAFETY: creates and commits a new 2-byte datatype written into `t`.
                unsafe {
                    check(
                        ffi::MPI_Type_contiguous(2, u8_type(), t.as_mut_ptr()),
                        "MPI_Type_contiguous",
                    )?;
                    check(ffi::MPI_Type_commit(t.as_mut_ptr()), "MPI_Type_commit")?;
                    Ok(Handle(t.assume_init()))
                }
            };
            let op = |f: UserFn| -> std::result::Result<Handle<ffi::MPI_Op>, String> {
                let mut op = MaybeUninit::uninit();
                // SAFETY: registers a commutative user function; `f` lives for the program.
                unsafe {
                    check(
                        ffi::MPI_Op_create(Some(f), 1, op.as_mut_ptr()),
                        "MPI_Op_create",
                    )?;
                    Ok(Handle(op.assume_init()))
                }
            };
            Ok(HalfOps {
                f16: datatype()?,
                bf16: datatype()?,
                ops: [
                    [op(f16_sum)?, op(f16_max)?, op(f16_min)?],
                    [op(bf16_sum)?, op(bf16_max)?, op(bf16_min)?],
                ],
            })
        }
    }

    // ---------------------------------------------------------------------------------------
    // The transport.

    /// A send in flight and the memory it reads.
    struct Pending {
        request: Handle<ffi::MPI_Request>,
        _keep: Bytes,
    }

    /// One process's end of an MPI world.
    pub struct MpiTransport {
        rank: usize,
        size: usize,
        /// Duplicate of `MPI_COMM_WORLD` for the world group's collectives and the parent of
        /// sub-group communicators.
        world: Comm,
        /// Duplicate for frames (point-to-point and frame-based helpers).
        frames: Comm,
        /// Duplicate for sub-group handshakes and the exit barrier.
        control: Comm,
        mailbox: Mailbox,
        /// Sends in flight; its lock also keeps the messages of one frame together.
        outgoing: Mutex<Vec<Pending>>,
        /// Communicators of sub-groups, by group id.
        comms: Mutex<HashMap<u64, Comm>>,
        /// Set when a collective left a call unfinished on a communicator: the job cannot go on.
        broken: Mutex<Option<String>>,
        half: HalfOps,
        max_count: usize,
        stop: AtomicBool,
        progress: Mutex<Option<JoinHandle<()>>>,
        finished: AtomicBool,
        exit_timeout: Mutex<Duration>,
    }

    fn start() -> Result<Arc<MpiTransport>> {
        let rendezvous = |why: String| CollectiveError::Rendezvous(format!("mpi: {why}"));
        let Some((universe, provided)) = mpi::initialize_with_threading(Threading::Multiple) else {
            return Err(rendezvous(
                "MPI was already initialised outside burn-parallel; let \
                 burn_parallel::world::init_mpi() initialise it"
                    .into(),
            ));
        };
        // Finalised by `exit_hook`, after the exit barrier (or aborted there).
        std::mem::forget(universe);
        if provided != Threading::Multiple {
            return Err(rendezvous(format!(
                "the MPI library provides {provided:?} threading, but the backend needs \
                 MPI_THREAD_MULTIPLE (Open MPI and MPICH provide it; check how yours was built)"
            )));
        }
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        let dup = |name: &str| -> std::result::Result<Comm, String> {
            let mut comm = MaybeUninit::uninit();
            // SAFETY: duplicates the world communicator into `comm`, then makes its errors
            // returned codes instead of aborting, so that they become typed errors.
            unsafe {
                check(
                    ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, comm.as_mut_ptr()),
                    name,
                )?;
                let comm = comm.assume_init();
                check(
                    ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
                    "MPI_Comm_set_errhandler",
                )?;
                Ok(Handle(comm))
            }
        };
        // SAFETY: plain queries of the world communicator into local integers.
        unsafe {
            check(
                ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank),
                "MPI_Comm_rank",
            )
            .map_err(rendezvous)?;
            check(
                ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size),
                "MPI_Comm_size",
            )
            .map_err(rendezvous)?;
        }
        // The intra-op thread policy: the ranks on this node share its cores.
        crate::threads::launch(node_local_size().map_err(rendezvous)?, true);
        let max_count = max_count_from_env(rank as usize)?;
        let transport = Arc::new(MpiTransport {
            rank: rank as usize,
            size: size as usize,
            world: dup("MPI_Comm_dup").map_err(rendezvous)?,
            frames: dup("MPI_Comm_dup").map_err(rendezvous)?,
            control: dup("MPI_Comm_dup").map_err(rendezvous)?,
            mailbox: Mailbox::new(),
            outgoing: Mutex::new(Vec::new()),
            comms: Mutex::new(HashMap::new()),
            broken: Mutex::new(None),
            half: HalfOps::create().map_err(rendezvous)?,
            max_count,
            stop: AtomicBool::new(false),
            progress: Mutex::new(None),
            finished: AtomicBool::new(false),
            exit_timeout: Mutex::new(crate::comm::transport::DEFAULT_TIMEOUT),
        });
        let runner = transport.clone();
        let handle = std::thread::Builder::new()
            .name("mpi-progress".into())
            .spawn(move || runner.progress_loop())
            .map_err(|e| rendezvous(format!("spawning the progress thread: {e}")))?;
        *lock(&transport.progress) = Some(handle);
        // SAFETY: registers a plain `extern "C" fn` to run at process exit.
        if unsafe { libc::atexit(exit_hook) } != 0 {
            return Err(rendezvous("registering the exit hook failed".into()));
        }
        Ok(transport)
    }

    /// How many ranks of the world run on this node (MPI-3's shared-memory split; collective
    /// over the world).
    fn node_local_size() -> std::result::Result<usize, String> {
        let mut local = MaybeUninit::uninit();
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: splits the world communicator by shared-memory node into `local`, reads its
        // size into a local integer and frees it; every rank of the world makes the same call.
        unsafe {
            check(
                ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank),
                "MPI_Comm_rank",
            )?;
            check(
                ffi::MPI_Comm_split_type(
                    ffi::RSMPI_COMM_WORLD,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    rank,
                    ffi::RSMPI_INFO_NULL,
                    local.as_mut_ptr(),
                ),
                "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)",
            )?;
            let mut local = local.assume_init();
            let sized = check(ffi::MPI_Comm_size(local, &mut size), "MPI_Comm_size");
            check(ffi::MPI_Comm_free(&mut local), "MPI_Comm_free")?;
            sized?;
        }
        Ok(usize::try_from(size).unwrap_or(1).max(1))
    }

    fn max_count_from_env(rank: usize) -> Result<usize> {
        match std::env::var(MAX_COUNT_VAR) {
            Err(_) => Ok(chunks::MAX_COUNT),
            Ok(value) => match value.trim().parse::<usize>() {
                Ok(n) if (1..=chunks::MAX_COUNT).contains(&n) => Ok(n),
                _ => Err(CollectiveError::InvalidArgument {
                    rank,
                    op: MAX_COUNT_VAR.into(),
                    reason: format!(
                        "{value:?} is not a count from 1 to {}; unset it for the default",
                        chunks::MAX_COUNT
                    ),
                }),
            },
        }
    }

    fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }

    extern "C" fn exit_hook() {
        if let Some(Ok(transport)) = WORLD.get() {
            transport.shutdown();
        }
    }

    /// How a wait ended badly.
    enum Failed {
        Timeout,
        Mpi(String),
    }

    impl MpiTransport {
        /// Ends the job at once with `reason` (printed first): `MPI_Abort` on the world.
        fn abort_job(&self, reason: &str) -> ! {
            eprintln!(
                "burn-parallel: rank {}: aborting the MPI job: {reason}",
                self.rank
            );
            // SAFETY: MPI_Abort on the world communicator; it does not return.
            unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
            std::process::abort()
        }

        fn broken(&self) -> Option<String> {
            lock(&self.broken).clone()
        }

        fn set_broken(&self, reason: String) {
            lock(&self.broken).get_or_insert(reason);
        }

        /// Finalises MPI at process exit, or aborts the job when it cannot go on.
        fn shutdown(&self) {
            if self.finished.swap(true, Ordering::SeqCst) {
                return;
            }
            if let Some(reason) = self.broken() {
                self.abort_job(&reason);
            }
            let timeout = *lock(&self.exit_timeout);
            let mut request = MaybeUninit::uninit();
            // SAFETY: a nonblocking barrier on our own communicator, waited for below.
            let posted = unsafe { ffi::MPI_Ibarrier(self.control.0, request.as_mut_ptr()) };
            if let Err(e) = check(posted, "MPI_Ibarrier") {
                self.abort_job(&e);
            }
            // SAFETY: `posted` succeeded, so the request is initialised.
            let mut request = unsafe { request.assume_init() };
            let deadline = Instant::now().checked_add(timeout);
            match self.poll(&mut request, deadline) {
                Ok(()) => {}
                Err(Failed::Timeout) => self.abort_job(&format!(
                    "the other ranks did not reach the end of the job within {timeout:?} \
                     (one of them failed or is stuck)"
                )),
                Err(Failed::Mpi(e)) => self.abort_job(&e),
            }
            self.stop.store(true, Ordering::SeqCst);
            if let Some(handle) = lock(&self.progress).take() {
                let _ = handle.join();
            }
            // Every frame sent was received (the barrier came after), so sends complete.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !self.complete_sends() {
                if Instant::now() > deadline {
                    self.abort_job("frames sent at the end of the job were never received");
                }
                std::thread::yield_now();
            }
            // SAFETY: every request is complete and no other thread calls MPI any more.
            unsafe { ffi::MPI_Finalize() };
        }

        /// Polls `request` until it completes, `deadline` passes, or MPI reports an error.
        fn poll(
            &self,
            request: &mut ffi::MPI_Request,
            deadline: Option<Instant>,
        ) -> std::result::Result<(), Failed> {
            let started = Instant::now();
            loop {
                let mut flag: c_int = 0;
                // SAFETY: `request` is a live request of this process.
                let code = unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                check(code, "MPI_Test").map_err(Failed::Mpi)?;
                if flag != 0 {
                    return Ok(());
                }
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return Err(Failed::Timeout);
                }
                // Spin (yielding) while the call is young, as MPI's blocking calls do; then
                // poll gently so a long wait does not take a core from the computation.
                if now - started < Duration::from_millis(50) {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }

        /// Tests the sends in flight and drops the completed ones; `true` when none is left.
        fn complete_sends(&self) -> bool {
            let mut outgoing = lock(&self.outgoing);
            outgoing.retain_mut(|p| {
                let mut flag: c_int = 0;
                // SAFETY: the request is live until MPI_Test reports it complete.
                let code =
                    unsafe { ffi::MPI_Test(&mut p.request.0, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                code == ffi::MPI_SUCCESS as c_int && flag == 0
            });
            outgoing.is_empty()
        }

        fn progress_loop(&self) {
            let mut idle: u32 = 0;
            while !self.stop.load(Ordering::SeqCst) {
                self.complete_sends();
                match self.receive_one() {
                    Ok(true) => idle = 0,
                    Ok(false) => {
                        idle = idle.saturating_add(1);
                        if idle < 200 {
                            std::thread::yield_now();
                        } else {
                            let micros = u64::from(idle - 200).min(200) + 20;
                            std::thread::sleep(Duration::from_micros(micros));
                        }
                    }
                    Err((peer, reason)) => {
                        self.mailbox.mark_failed(peer, &reason);
                        return;
                    }
                }
            }
        }

        /// Receives one frame if one is waiting. Errors name the peer involved.
        fn receive_one(&self) -> std::result::Result<bool, (usize, String)> {
            let me = self.rank;
            let mut flag: c_int = 0;
            let mut message = MaybeUninit::uninit();
            let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
            // SAFETY: a matched probe on our frames communicator into local out-parameters.
            let code = unsafe {
                ffi::MPI_Improbe(
                    ffi::RSMPI_ANY_SOURCE,
                    TAG_HEAD,
                    self.frames.0,
                    &mut flag,
                    message.as_mut_ptr(),
                    status.as_mut_ptr(),
                )
            };
            check(code, "MPI_Improbe").map_err(|e| (me, e))?;
            if flag == 0 {
                return Ok(false);
            }
            // SAFETY: the probe matched, so the message and status are written.
            let (mut message, status) = unsafe { (message.assume_init(), status.assume_init()) };
            let source = status.MPI_SOURCE as usize;
            let mut count: c_int = 0;
            // SAFETY: reads the size of the matched message from its status.
            check(
                unsafe { ffi::MPI_Get_count(&status, u8_type(), &mut count) },
                "MPI_Get_count",
            )
            .map_err(|e| (source, e))?;
            let mut head = vec![0u8; count.max(0) as usize];
            // SAFETY: receives the matched message into a buffer of its exact size.
            let code = unsafe {
                ffi::MPI_Mrecv(
                    buf_mut(&mut head),
                    count,
                    u8_type(),
                    &mut message,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            check(code, "MPI_Mrecv").map_err(|e| (source, e))?;
            let (header, payload_len, inline_at) =
                decode_head(&head).map_err(|e| (source, format!("malformed frame: {e}")))?;
            let payload = match inline_at {
                Some(at) => {
                    if head.len() - at != payload_len {
                        return Err((source, "malformed frame: inline payload length".into()));
                    }
                    Bytes::from(head).slice(at..)
                }
                None => {
                    let mut payload = vec![0u8; payload_len];
                    for range in chunks(payload_len, self.max_count) {
                        let len = to_int(range.len());
                        // SAFETY: receives the next chunk of this frame from `source` (MPI keeps
                        // the order of messages per source and tag) into its place.
                        let code = unsafe {
                            ffi::MPI_Recv(
                                buf_mut(&mut payload[range]),
                                len,
                                u8_type(),
                                source as c_int,
                                TAG_CHUNK,
                                self.frames.0,
                                ffi::RSMPI_STATUS_IGNORE,
                            )
                        };
                        check(code, "MPI_Recv").map_err(|e| (source, e))?;
                    }
                    Bytes::from(payload)
                }
            };
            self.mailbox.deliver(source, Frame { header, payload });
            Ok(true)
        }

        fn isend(
            &self,
            outgoing: &mut Vec<Pending>,
            dst: usize,
            tag: c_int,
            data: Bytes,
        ) -> Result<()> {
            let mut request = MaybeUninit::uninit();
            // SAFETY: `data` stays alive in `outgoing` until the send completes.
            let code = unsafe {
                ffi::MPI_Isend(
                    buf_ptr(&data),
                    to_int(data.len()),
                    u8_type(),
                    dst as c_int,
                    tag,
                    self.frames.0,
                    request.as_mut_ptr(),
                )
            };
            check(code, "MPI_Isend").map_err(|reason| CollectiveError::Transport {
                rank: self.rank,
                peer: dst,
                reason,
            })?;
            outgoing.push(Pending {
                // SAFETY: MPI_Isend succeeded and wrote the request.
                request: Handle(unsafe { request.assume_init() }),
                _keep: data,
            });
            Ok(())
        }

        // -----------------------------------------------------------------------------------
        // Collectives.

        fn comm(&self, call: &NativeCall<'_>) -> Result<Comm> {
            if let Some(reason) = self.broken() {
                return Err(CollectiveError::Transport {
                    rank: self.rank,
                    peer: self.rank,
                    reason: format!(
                        "{}: an earlier MPI collective failed and is still in flight, so this \
                         MPI job cannot continue: {reason}",
                        call.signature
                    ),
                });
            }
            if call.group == 0 {
                return Ok(self.world);
            }
            if let Some(comm) = lock(&self.comms).get(&call.group) {
                return Ok(*comm);
            }
            let comm = self.create_comm(call)?;
            lock(&self.comms).insert(call.group, comm);
            Ok(comm)
        }

        /// The communicator of a sub-group: a handshake among the members (under the timeout,
        /// so a missing member is an error, not a hang), then `MPI_Comm_create_group`.
        fn create_comm(&self, call: &NativeCall<'_>) -> Result<Comm> {
            let tag = (call.group % 32_000) as c_int + 1;
            let failed = |reason: String| CollectiveError::Transport {
                rank: self.rank,
                peer: self.rank,
                reason: format!(
                    "{}: creating the MPI communicator of members {:?}: {reason}",
                    call.signature, call.members
                ),
            };
            let deadline = self.deadline(call)?;
            let mut requests = Vec::new();
            let mut token = [0u8; 1];
            for &peer in call.members.iter().filter(|&&p| p != self.rank) {
                for receive in [true, false] {
                    let mut request = MaybeUninit::uninit();
                    // SAFETY: zero-byte messages; the pointer is never read or written.
                    let code = unsafe {
                        if receive {
                            ffi::MPI_Irecv(
                                buf_mut(&mut token),
                                0,
                                u8_type(),
                                peer as c_int,
                                tag,
                                self.control.0,
                                request.as_mut_ptr(),
                            )
                        } else {
                            ffi::MPI_Isend(
                                buf_ptr(&token),
                                0,
                                u8_type(),
                                peer as c_int,
                                tag,
                                self.control.0,
                                request.as_mut_ptr(),
                            )
                        }
                    };
                    check(code, "handshake").map_err(failed)?;
                    // SAFETY: the call succeeded and wrote the request.
                    requests.push((receive, unsafe { request.assume_init() }));
                }
            }
            for i in 0..requests.len() {
                match self.poll(&mut requests[i].1, deadline) {
                    Ok(()) => {}
                    Err(failure) => {
                        for (receive, request) in &mut requests[i..] {
                            if *receive {
                                // SAFETY: cancels and frees our own pending zero-byte receive.
                                unsafe {
                                    ffi::MPI_Cancel(request);
                                    ffi::MPI_Request_free(request);
                                }
                            }
                        }
                        return Err(match failure {
                            Failed::Timeout => CollectiveError::CollectiveTimeout {
                                rank: self.rank,
                                op: format!(
                                    "{} (creating the communicator of members {:?})",
                                    call.signature, call.members
                                ),
                                backend: "mpi".into(),
                                timeout: call.timeout,
                            },
                            Failed::Mpi(e) => failed(e),
                        });
                    }
                }
            }
            let ranks: Vec<c_int> = call.members.iter().map(|&m| m as c_int).collect();
            // SAFETY: builds the MPI group of the members (world ranks, in group order) and
            // the communicator over it; every member is now calling this (handshake above).
            unsafe {
                let mut world_group = MaybeUninit::uninit();
                check(
                    ffi::MPI_Comm_group(self.world.0, world_group.as_mut_ptr()),
                    "MPI_Comm_group",
                )
                .map_err(failed)?;
                let mut world_group = world_group.assume_init();
                let mut group = MaybeUninit::uninit();
                check(
                    ffi::MPI_Group_incl(
                        world_group,
                        ranks.len() as c_int,
                        ranks.as_ptr(),
                        group.as_mut_ptr(),
                    ),
                    "MPI_Group_incl",
                )
                .map_err(failed)?;
                let mut group = group.assume_init();
                let mut comm = MaybeUninit::uninit();
                let created =
                    ffi::MPI_Comm_create_group(self.world.0, group, tag, comm.as_mut_ptr());
                ffi::MPI_Group_free(&mut group);
                ffi::MPI_Group_free(&mut world_group);
                check(created, "MPI_Comm_create_group").map_err(failed)?;
                let comm = comm.assume_init();
                check(
                    ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
                    "MPI_Comm_set_errhandler",
                )
                .map_err(failed)?;
                Ok(Handle(comm))
            }
        }

        fn deadline(&self, call: &NativeCall<'_>) -> Result<Option<Instant>> {
            match Instant::now().checked_add(call.timeout) {
                Some(d) => Ok(Some(d)),
                None => Err(CollectiveError::InvalidTimeout {
                    setting: "ProcessGroup::with_timeout".into(),
                    value: format!("{:?}", call.timeout),
                    reason: format!(
                        "rank {}: {}: a deadline that far away cannot be represented; give at \
                         most {} s",
                        self.rank,
                        call.signature,
                        crate::comm::transport::MAX_TIMEOUT.as_secs()
                    ),
                }),
            }
        }

        /// Waits for a call whose buffers are owned by the caller of this function (`keep`):
        /// on failure they are leaked (MPI may still write them), the transport is marked
        /// broken, and the typed error returned.
        fn wait_owned<T>(
            &self,
            mut request: ffi::MPI_Request,
            call: &NativeCall<'_>,
            deadline: Option<Instant>,
            keep: T,
        ) -> Result<T> {
            match self.poll(&mut request, deadline) {
                Ok(()) => Ok(keep),
                Err(failure) => {
                    std::mem::forget(keep);
                    let error = match failure {
                        Failed::Timeout => CollectiveError::CollectiveTimeout {
                            rank: self.rank,
                            op: call.signature.to_string(),
                            backend: "mpi".into(),
                            timeout: call.timeout,
                        },
                        Failed::Mpi(reason) => CollectiveError::Transport {
                            rank: self.rank,
                            peer: self.rank,
                            reason: format!("{}: {reason}", call.signature),
                        },
                    };
                    self.set_broken(error.to_string());
                    Err(error)
                }
            }
        }

        /// Ends the job when a blocking data transfer failed (the buffers are in an unknown
        /// state, and the other members may have finished the call).
        fn data_done(&self, code: c_int, call: &NativeCall<'_>, what: &str) {
            if let Err(reason) = check(code, what) {
                self.abort_job(
                    &CollectiveError::Transport {
                        rank: self.rank,
                        peer: self.rank,
                        reason: format!("{}: {reason}", call.signature),
                    }
                    .to_string(),
                );
            }
        }

        /// The first step of every collective: all members exchange the hash of their call's
        /// signature and up to a few words of `extra` (sizes). Returns every member's extra
        /// words, in rank order.
        fn agree(&self, comm: Comm, call: &NativeCall<'_>, extra: &[u64]) -> Result<Vec<Vec<u64>>> {
            let n = call.members.len();
            let deadline = self.deadline(call)?;
            let hash = signature_hash(call.signature);
            let mut header = vec![0u64; HEADER_WORDS];
            header[0] = hash;
            header[1] = call.signature.len() as u64;
            header[2] = extra.len() as u64;
            if extra.len() <= INLINE_EXTRA {
                header[3..3 + extra.len()].copy_from_slice(extra);
            }
            let mut all = vec![0u64; HEADER_WORDS * n];
            let mut request = MaybeUninit::uninit();
            // SAFETY: both buffers are owned here and kept alive (or leaked) by `wait_owned`.
            let code = unsafe {
                ffi::MPI_Iallgather(
                    buf_ptr(&header),
                    HEADER_WORDS as c_int,
                    u64_type(),
                    buf_mut(&mut all),
                    HEADER_WORDS as c_int,
                    u64_type(),
                    comm.0,
                    request.as_mut_ptr(),
                )
            };
            self.posted(code, call, "MPI_Iallgather")?;
            // SAFETY: posted successfully.
            let request = unsafe { request.assume_init() };
            let (_, all) = self.wait_owned(request, call, deadline, (header, all))?;

            let headers: Vec<&[u64]> = all.chunks(HEADER_WORDS).collect();
            if let Some(peer) = headers.iter().position(|h| h[0] != hash) {
                let theirs = self.gather_signatures(comm, call, &headers, deadline)?;
                return Err(CollectiveError::Mismatch {
                    rank: self.rank,
                    peer: call.members[peer],
                    ours: call.signature.to_string(),
                    theirs: theirs[peer].clone(),
                });
            }
            let lens: Vec<usize> = headers.iter().map(|h| h[2] as usize).collect();
            if lens.iter().all(|&l| l <= INLINE_EXTRA) {
                return Ok(headers
                    .iter()
                    .zip(&lens)
                    .map(|(h, &l)| h[3..3 + l].to_vec())
                    .collect());
            }
            let words = self.all_gather_words(comm, call, extra, &lens, deadline)?;
            let mut at = 0;
            Ok(lens
                .iter()
                .map(|&l| {
                    at += l;
                    words[at - l..at].to_vec()
                })
                .collect())
        }

        fn posted(&self, code: c_int, call: &NativeCall<'_>, what: &str) -> Result<()> {
            check(code, what).map_err(|reason| CollectiveError::Transport {
                rank: self.rank,
                peer: self.rank,
                reason: format!("{}: {reason}", call.signature),
            })
        }

        /// All-gather of a few words per member (`lens[k]` from member k), owned buffers.
        fn all_gather_words(
            &self,
            comm: Comm,
            call: &NativeCall<'_>,
            mine: &[u64],
            lens: &[usize],
            deadline: Option<Instant>,
        ) -> Result<Vec<u64>> {
            let send = mine.to_vec();
            let counts: Vec<c_int> = lens.iter().map(|&l| to_int(l)).collect();
            let displs = prefix(&counts);
            let mut out = vec![0u64; lens.iter().sum()];
            let mut request = MaybeUninit::uninit();
            // SAFETY: every buffer is owned here and kept alive (or leaked) by `wait_owned`.
            let code = unsafe {
                ffi::MPI_Iallgatherv(
                    buf_ptr(&send),
                    to_int(send.len()),
                    u64_type(),
                    buf_mut(&mut out),
                    counts.as_ptr(),
                    displs.as_ptr(),
                    u64_type(),
                    comm.0,
                    request.as_mut_ptr(),
                )
            };
            self.posted(code, call, "MPI_Iallgatherv")?;
            // SAFETY: posted successfully.
            let request = unsafe { request.assume_init() };
            let (_, _, _, out) =
                self.wait_owned(request, call, deadline, (send, counts, displs, out))?;
            Ok(out)
        }

        /// After a hash mismatch (seen by every member alike): every member's signature text.
        fn gather_signatures(
            &self,
            comm: Comm,
            call: &NativeCall<'_>,
            headers: &[&[u64]],
            deadline: Option<Instant>,
        ) -> Result<Vec<String>> {
            let send = call.signature.as_bytes().to_vec();
            let counts: Vec<c_int> = headers.iter().map(|h| to_int(h[1] as usize)).collect();
            let displs = prefix(&counts);
            let total: usize = counts.iter().map(|&c| c as usize).sum();
            let mut out = vec![0u8; total];
            let mut request = MaybeUninit::uninit();
            // SAFETY: every buffer is owned here and kept alive (or leaked) by `wait_owned`.
            let code = unsafe {
                ffi::MPI_Iallgatherv(
                    buf_ptr(&send),
                    to_int(send.len()),
                    u8_type(),
                    buf_mut(&mut out),
                    counts.as_ptr(),
                    displs.as_ptr(),
                    u8_type(),
                    comm.0,
                    request.as_mut_ptr(),
                )
            };
            self.posted(code, call, "MPI_Iallgatherv")?;
            // SAFETY: posted successfully.
            let request = unsafe { request.assume_init() };
            let (_, counts, displs, out) =
                self.wait_owned(request, call, deadline, (send, counts, displs, out))?;
            Ok(counts
                .iter()
                .zip(&displs)
                .map(|(&c, &d)| {
                    String::from_utf8_lossy(&out[d as usize..(d + c) as usize]).into_owned()
                })
                .collect())
        }

        fn reduction(&self, dtype: DType, op: ReduceOp) -> (ffi::MPI_Datatype, ffi::MPI_Op) {
            let which = match op {
                ReduceOp::Sum | ReduceOp::Avg => 0,
                ReduceOp::Max => 1,
                ReduceOp::Min => 2,
            };
            // SAFETY: constants exported by mpi-sys, valid once MPI is initialised.
            unsafe {
                let builtin = [ffi::RSMPI_SUM, ffi::RSMPI_MAX, ffi::RSMPI_MIN][which];
                match dtype {
                    DType::F64 => (ffi::RSMPI_DOUBLE, builtin),
                    DType::F32 | DType::Flex32 => (ffi::RSMPI_FLOAT, builtin),
                    DType::I64 => (ffi::RSMPI_INT64_T, builtin),
                    DType::I32 => (ffi::RSMPI_INT32_T, builtin),
                    DType::I16 => (ffi::RSMPI_INT16_T, builtin),
                    DType::I8 => (ffi::RSMPI_INT8_T, builtin),
                    DType::U64 => (ffi::RSMPI_UINT64_T, builtin),
                    DType::U32 => (ffi::RSMPI_UINT32_T, builtin),
                    DType::U16 => (ffi::RSMPI_UINT16_T, builtin),
                    DType::U8 => (ffi::RSMPI_UINT8_T, builtin),
                    DType::F16 => (self.half.f16.0, self.half.ops[0][which].0),
                    DType::BF16 => (self.half.bf16.0, self.half.ops[1][which].0),
                    DType::Bool(_) | DType::QFloat(_) => {
                        unreachable!("ProcessGroup checks `reducible` first")
                    }
                }
            }
        }
    }

    /// A buffer's address for MPI. An empty slice's address is dangling (`0x1` for bytes),
    /// which Open MPI takes for `MPI_IN_PLACE`: empty buffers get a real address instead.
    fn buf_ptr<T>(buf: &[T]) -> *const c_void {
        static EMPTY: [u64; 1] = [0];
        if buf.is_empty() {
            EMPTY.as_ptr().cast()
        } else {
            buf.as_ptr().cast()
        }
    }

    /// [`buf_ptr`] for a receive buffer (MPI writes nothing into an empty one).
    fn buf_mut<T>(buf: &mut [T]) -> *mut c_void {
        if buf.is_empty() {
            buf_ptr(buf).cast_mut()
        } else {
            buf.as_mut_ptr().cast()
        }
    }

    /// Exclusive prefix sums (MPI displacements).
    fn prefix(counts: &[c_int]) -> Vec<c_int> {
        let mut at = 0;
        counts
            .iter()
            .map(|&c| {
                let d = at;
                at += c;
                d
            })
            .collect()
    }

    /// Divides a sum by the group size (the second half of [`ReduceOp::Avg`]).
    fn divide(data: &mut [u8], dtype: DType, n: usize) {
        static ZEROS: [u8; 1 << 16] = [0; 1 << 16];
        for chunk in data.chunks_mut(1 << 16) {
            let len = chunk.len();
            combine_into(chunk, &ZEROS[..len], dtype, ReduceOp::Sum, n);
        }
    }

    /// Frame heads: `[inline flag u8][group u64][tag u64][seq u64][payload len u64]
    /// [meta count u32][meta u64...][signature len u32][signature]` then the inline payload.
    fn encode_head(header: &Header, payload_len: usize, inline: Option<&[u8]>) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            45 + 8 * header.meta.len() + header.signature.len() + inline.map_or(0, <[u8]>::len),
        );
        out.push(u8::from(inline.is_some()));
        for word in [
            header.stream.group,
            header.stream.tag,
            header.seq,
            payload_len as u64,
        ] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(&(header.meta.len() as u32).to_le_bytes());
        for m in &header.meta {
            out.extend_from_slice(&m.to_le_bytes());
        }
        out.extend_from_slice(&(header.signature.len() as u32).to_le_bytes());
        out.extend_from_slice(header.signature.as_bytes());
        if let Some(payload) = inline {
            out.extend_from_slice(payload);
        }
        out
    }

    /// Inverse of [`encode_head`]: the header, the payload length, and where the inline
    /// payload starts (`None` when the payload follows in chunks).
    fn decode_head(
        bytes: &[u8],
    ) -> std::result::Result<(Header, usize, Option<usize>), &'static str> {
        let mut at = 0usize;
        let mut take = |n: usize| -> std::result::Result<&[u8], &'static str> {
            let piece = bytes.get(at..at + n).ok_or("truncated head")?;
            at += n;
            Ok(piece)
        };
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let inline = take(1)?[0] == 1;
        let group = word(take(8)?);
        let tag = word(take(8)?);
        let seq = word(take(8)?);
        let payload_len = word(take(8)?) as usize;
        let meta_len = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
        let meta = (0..meta_len)
            .map(|_| take(8).map(word))
            .collect::<std::result::Result<Vec<u64>, _>>()?;
        let sig_len = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
        let signature = String::from_utf8(take(sig_len)?.to_vec()).map_err(|_| "signature")?;
        let header = Header {
            stream: StreamId { group, tag },
            seq,
            signature,
            meta,
        };
        Ok((header, payload_len, inline.then_some(at)))
    }

    impl Transport for MpiTransport {
        fn rank(&self) -> usize {
            self.rank
        }

        fn world_size(&self) -> usize {
            self.size
        }

        fn backend_name(&self) -> &'static str {
            "mpi"
        }

        fn send(&self, dst: usize, frame: Frame) -> Result<()> {
            if dst >= self.size {
                return Err(CollectiveError::Transport {
                    rank: self.rank,
                    peer: dst,
                    reason: format!("no rank {dst} in an MPI world of {} ranks", self.size),
                });
            }
            let payload = frame.payload;
            let inline = payload.len() <= INLINE_PAYLOAD.min(self.max_count);
            let head = encode_head(&frame.header, payload.len(), inline.then_some(&payload[..]));
            let mut outgoing = lock(&self.outgoing);
            self.isend(&mut outgoing, dst, TAG_HEAD, Bytes::from(head))?;
            if !inline {
                for range in chunks(payload.len(), self.max_count) {
                    self.isend(&mut outgoing, dst, TAG_CHUNK, payload.slice(range))?;
                }
            }
            Ok(())
        }

        fn mailbox(&self) -> &Mailbox {
            &self.mailbox
        }

        /// Prints `reason` and ends the whole MPI job (`MPI_Abort`): MPI has no way to tell
        /// the peers and let them go on.
        fn abort(&self, reason: &str) {
            self.abort_job(reason);
        }

        fn native(&self) -> Option<&dyn NativeCollectives> {
            Some(self)
        }
    }

    impl NativeCollectives for MpiTransport {
        fn all_reduce(
            &self,
            call: &NativeCall<'_>,
            input: &[u8],
            output: &mut [u8],
            dtype: DType,
            op: ReduceOp,
        ) -> Result<()> {
            let comm = self.comm(call)?;
            self.agree(comm, call, &[])?;
            let elem = dtype.size();
            let (datatype, mpi_op) = self.reduction(dtype, op);
            for range in chunks(input.len() / elem, self.max_count) {
                let bytes = range.start * elem..range.end * elem;
                // SAFETY: both slices are borrowed for the whole call.
                let code = unsafe {
                    ffi::MPI_Allreduce(
                        buf_ptr(&input[bytes.clone()]),
                        buf_mut(&mut output[bytes]),
                        to_int(range.len()),
                        datatype,
                        mpi_op,
                        comm.0,
                    )
                };
                self.data_done(code, call, "MPI_Allreduce");
            }
            if op == ReduceOp::Avg {
                divide(output, dtype, call.members.len());
            }
            Ok(())
        }

        fn all_gather(
            &self,
            call: &NativeCall<'_>,
            mine: &[u8],
            meta: u64,
        ) -> Result<Vec<(Bytes, u64)>> {
            let comm = self.comm(call)?;
            let extras = self.agree(comm, call, &[meta, mine.len() as u64])?;
            let n = extras.len();
            let lens: Vec<usize> = extras.iter().map(|e| e[1] as usize).collect();
            let offsets: Vec<usize> = lens
                .iter()
                .scan(0, |at, &l| {
                    *at += l;
                    Some(*at - l)
                })
                .collect();
            let total: usize = lens.iter().sum();
            let longest = lens.iter().copied().max().unwrap_or(0);
            let rounds = Rounds::plan(longest, total, n, self.max_count);
            let mut out = vec![0u8; total];
            for round in 0..rounds.count {
                let ranges: Vec<_> = lens.iter().map(|&l| rounds.range(l, round)).collect();
                let counts: Vec<c_int> = ranges.iter().map(|r| to_int(r.len())).collect();
                let displs = prefix(&counts);
                let mut staging = if rounds.direct() {
                    Vec::new()
                } else {
                    vec![0u8; ranges.iter().map(|r| r.len()).sum()]
                };
                let recv = if rounds.direct() {
                    &mut out[..]
                } else {
                    &mut staging[..]
                };
                let send = &mine[ranges[call.rank].clone()];
                // SAFETY: every buffer is borrowed for the whole call.
                let code = unsafe {
                    ffi::MPI_Allgatherv(
                        buf_ptr(send),
                        to_int(send.len()),
                        u8_type(),
                        buf_mut(recv),
                        counts.as_ptr(),
                        displs.as_ptr(),
                        u8_type(),
                        comm.0,
                    )
                };
                self.data_done(code, call, "MPI_Allgatherv");
                if !rounds.direct() {
                    for k in 0..n {
                        let at = offsets[k] + ranges[k].start;
                        let from = displs[k] as usize;
                        out[at..at + ranges[k].len()]
                            .copy_from_slice(&staging[from..from + ranges[k].len()]);
                    }
                }
            }
            let out = Bytes::from(out);
            Ok((0..n)
                .map(|k| (out.slice(offsets[k]..offsets[k] + lens[k]), extras[k][0]))
                .collect())
        }

        fn reduce_scatter(
            &self,
            call: &NativeCall<'_>,
            send: &[u8],
            byte_lens: &[usize],
            dtype: DType,
            op: ReduceOp,
        ) -> Result<Vec<u8>> {
            let comm = self.comm(call)?;
            self.agree(comm, call, &[])?;
            let n = byte_lens.len();
            let elem = dtype.size();
            let (datatype, mpi_op) = self.reduction(dtype, op);
            let lens: Vec<usize> = byte_lens.iter().map(|l| l / elem).collect();
            let starts: Vec<usize> = lens
                .iter()
                .scan(0, |at, &l| {
                    *at += l;
                    Some(*at - l)
                })
                .collect();
            let total: usize = lens.iter().sum();
            let longest = lens.iter().copied().max().unwrap_or(0);
            let rounds = Rounds::plan(longest, total, n, self.max_count);
            let mut out = vec![0u8; byte_lens[call.rank]];
            for round in 0..rounds.count {
                let ranges: Vec<_> = lens.iter().map(|&l| rounds.range(l, round)).collect();
                let counts: Vec<c_int> = ranges.iter().map(|r| to_int(r.len())).collect();
                let send: std::borrow::Cow<'_, [u8]> = if rounds.direct() {
                    std::borrow::Cow::Borrowed(send)
                } else {
                    std::borrow::Cow::Owned(
                        starts
                            .iter()
                            .zip(&ranges)
                            .flat_map(|(s, r)| {
                                send[(s + r.start) * elem..(s + r.end) * elem]
                                    .iter()
                                    .copied()
                            })
                            .collect(),
                    )
                };
                let mine = ranges[call.rank].clone();
                let recv = &mut out[mine.start * elem..mine.end * elem];
                // SAFETY: every buffer is borrowed for the whole call.
                let code = unsafe {
                    ffi::MPI_Reduce_scatter(
                        buf_ptr(&send),
                        buf_mut(recv),
                        counts.as_ptr(),
                        datatype,
                        mpi_op,
                        comm.0,
                    )
                };
                self.data_done(code, call, "MPI_Reduce_scatter");
            }
            if op == ReduceOp::Avg {
                divide(&mut out, dtype, n);
            }
            Ok(out)
        }

        fn broadcast(&self, call: &NativeCall<'_>, data: &mut [u8], root: usize) -> Result<()> {
            let comm = self.comm(call)?;
            self.agree(comm, call, &[])?;
            for range in chunks(data.len(), self.max_count) {
                let len = to_int(range.len());
                // SAFETY: the slice is borrowed for the whole call.
                let code = unsafe {
                    ffi::MPI_Bcast(
                        buf_mut(&mut data[range]),
                        len,
                        u8_type(),
                        root as c_int,
                        comm.0,
                    )
                };
                self.data_done(code, call, "MPI_Bcast");
            }
            Ok(())
        }

        fn all_to_all(
            &self,
            call: &NativeCall<'_>,
            send: &[u8],
            lens: &[usize],
            metas: &[Vec<u64>],
        ) -> Result<Vec<(Bytes, Vec<u64>)>> {
            let comm = self.comm(call)?;
            let n = lens.len();
            let me = call.rank;
            // Every member learns every piece's length (to plan the same rounds) and the
            // metadata of the pieces coming to it.
            let mut extra = Vec::new();
            for (len, meta) in lens.iter().zip(metas) {
                extra.push(*len as u64);
                extra.push(meta.len() as u64);
                extra.extend_from_slice(meta);
            }
            let extras = self.agree(comm, call, &extra)?;
            let malformed = || CollectiveError::Transport {
                rank: self.rank,
                peer: self.rank,
                reason: format!("{}: malformed all-to-all sizes", call.signature),
            };
            // lengths[s][d]: bytes from member s to member d; incoming metas for `me`.
            let mut lengths = vec![vec![0usize; n]; n];
            let mut incoming_meta = vec![Vec::new(); n];
            for ((s, words), row) in extras.iter().enumerate().zip(&mut lengths) {
                let mut at = 0;
                for (d, slot) in row.iter_mut().enumerate() {
                    let len = *words.get(at).ok_or_else(malformed)? as usize;
                    let meta_len = *words.get(at + 1).ok_or_else(malformed)? as usize;
                    let meta = words.get(at + 2..at + 2 + meta_len).ok_or_else(malformed)?;
                    *slot = len;
                    if d == me {
                        incoming_meta[s] = meta.to_vec();
                    }
                    at += 2 + meta_len;
                }
            }
            let send_lens: Vec<usize> = lengths[me].clone();
            let recv_lens: Vec<usize> = (0..n).map(|s| lengths[s][me]).collect();
            let busiest = (0..n)
                .map(|k| {
                    let sent: usize = lengths[k].iter().sum();
                    let received: usize = (0..n).map(|s| lengths[s][k]).sum();
                    sent.max(received)
                })
                .max()
                .unwrap_or(0);
            let longest = lengths.iter().flatten().copied().max().unwrap_or(0);
            let rounds = Rounds::plan(longest, busiest, n, self.max_count);
            let recv_offsets: Vec<usize> = recv_lens
                .iter()
                .scan(0, |at, &l| {
                    *at += l;
                    Some(*at - l)
                })
                .collect();
            let send_offsets: Vec<usize> = send_lens
                .iter()
                .scan(0, |at, &l| {
                    *at += l;
                    Some(*at - l)
                })
                .collect();
            let mut out = vec![0u8; recv_lens.iter().sum()];
            for round in 0..rounds.count {
                let sends: Vec<_> = send_lens.iter().map(|&l| rounds.range(l, round)).collect();
                let recvs: Vec<_> = recv_lens.iter().map(|&l| rounds.range(l, round)).collect();
                let send_counts: Vec<c_int> = sends.iter().map(|r| to_int(r.len())).collect();
                let recv_counts: Vec<c_int> = recvs.iter().map(|r| to_int(r.len())).collect();
                let send_displs = prefix(&send_counts);
                let recv_displs = prefix(&recv_counts);
                let send: std::borrow::Cow<'_, [u8]> = if rounds.direct() {
                    std::borrow::Cow::Borrowed(send)
                } else {
                    std::borrow::Cow::Owned(
                        send_offsets
                            .iter()
                            .zip(&sends)
                            .flat_map(|(o, r)| send[o + r.start..o + r.end].iter().copied())
                            .collect(),
                    )
                };
                let mut staging = if rounds.direct() {
                    Vec::new()
                } else {
                    vec![0u8; recvs.iter().map(|r| r.len()).sum()]
                };
                let recv = if rounds.direct() {
                    &mut out[..]
                } else {
                    &mut staging[..]
                };
                // Blocking on purpose: every member has joined (the header exchange above), and
                // Open MPI's nonblocking all-to-all-v (libnbc) desynchronises its internal tags
                // when a rank sends and receives nothing in a call (an empty schedule), which
                // made the next collective hang (seen with 2 ranks and rounds of 3 bytes).
                // SAFETY: every buffer is borrowed for the whole call.
                let code = unsafe {
                    ffi::MPI_Alltoallv(
                        buf_ptr(&send),
                        send_counts.as_ptr(),
                        send_displs.as_ptr(),
                        u8_type(),
                        buf_mut(recv),
                        recv_counts.as_ptr(),
                        recv_displs.as_ptr(),
                        u8_type(),
                        comm.0,
                    )
                };
                if let Err(reason) = check(code, "MPI_Alltoallv") {
                    self.abort_job(
                        &CollectiveError::Transport {
                            rank: self.rank,
                            peer: self.rank,
                            reason: format!("{}: {reason}", call.signature),
                        }
                        .to_string(),
                    );
                }
                if !rounds.direct() {
                    for s in 0..n {
                        let at = recv_offsets[s] + recvs[s].start;
                        let from = recv_displs[s] as usize;
                        out[at..at + recvs[s].len()]
                            .copy_from_slice(&staging[from..from + recvs[s].len()]);
                    }
                }
            }
            let out = Bytes::from(out);
            Ok((0..n)
                .map(|s| {
                    (
                        out.slice(recv_offsets[s]..recv_offsets[s] + recv_lens[s]),
                        std::mem::take(&mut incoming_meta[s]),
                    )
                })
                .collect())
        }

        fn barrier(&self, call: &NativeCall<'_>) -> Result<()> {
            let comm = self.comm(call)?;
            self.agree(comm, call, &[]).map(|_| ())
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn frame_heads_round_trip() {
            let header = Header {
                stream: StreamId { group: 7, tag: 9 },
                seq: 3,
                signature: "send(tag 9)".into(),
                meta: vec![2, 4, 5],
            };
            let bytes = encode_head(&header, 3, Some(&[1, 2, 3]));
            let (back, len, at) = decode_head(&bytes).unwrap();
            assert_eq!((back, len), (header.clone(), 3));
            assert_eq!(&bytes[at.unwrap()..], &[1, 2, 3]);
            let bytes = encode_head(&header, 1 << 40, None);
            assert_eq!(decode_head(&bytes).unwrap(), (header, 1 << 40, None));
            assert!(decode_head(&bytes[..bytes.len() - 1]).is_err());
        }

        #[test]
        fn signature_hash_is_stable() {
            // FNV-1a of "a": the same value in every process and build.
            assert_eq!(signature_hash("a"), 0xaf63_dc4c_8601_ec8c);
        }
    }
}
