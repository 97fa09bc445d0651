//! Ordering a CUDA stream of our own (cuBLASLt's, an NCCL communicator's) with the work Burn
//! queued on CubeCL's stream, without waiting on the host (feature `cuda`).
//!
//! CubeCL 0.11 keeps its CUDA streams private (its server's collective stream, used by Burn's
//! in-process NCCL, too), so no CUDA event can be recorded on them. Two device words per (CUDA
//! device, thread) stand in for events: `[ready, done]`, `u32`, bound for the life of the
//! process.
//!
//! - [`mark`]: a one-thread CubeCL kernel, queued after Burn's work on the calling thread's
//!   stream, stores a fresh sequence number `s` in `ready`. [`Mark::wait_on`] makes our stream
//!   wait for `ready >= s` (`cuStreamWaitValue32`): what we launch there next reads finished
//!   inputs, and the host never waited.
//! - [`Mark::signal`] (cuBLASLt's products, whose outputs Burn reads next): our stream writes
//!   `s` to `done` (`cuStreamWriteValue32`) and a one-thread CubeCL kernel queued next spins
//!   until it reads `s`, so Burn's later kernels come after ours.
//! - [`Gate`] (NCCL's collectives waited for on the device, [`crate::work::Work::wait_on_device`]):
//!   the same in the other direction, with words of the communicator's own (one writer, numbers
//!   that only grow) and an abort word the host sets when a collective failed, so that a dead
//!   peer ends in a typed error (at the group's next call) instead of a stream spinning for
//!   ever.
//!
//! `BURN_PARALLEL_STREAM_ORDER=sync` (or the older `BURN_PARALLEL_CUBLAS_ORDER=sync`), or a
//! device that refuses stream memory operations, falls back to waiting for Burn's queued work
//! on the host (`client.sync()`): correct, two host round trips per call.

use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::ops::numeric::zeros_client;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cudarc::driver::sys as cusys;

use super::{bind, cuda_index};

/// How our streams are ordered with CubeCL's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    /// Device words (the default).
    Device,
    /// `client.sync()` on the host.
    Sync,
}

/// `BURN_PARALLEL_STREAM_ORDER` (else `BURN_PARALLEL_CUBLAS_ORDER`), read once.
fn order() -> Order {
    static ORDER: OnceLock<Order> = OnceLock::new();
    *ORDER.get_or_init(|| {
        let read = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let value = read("BURN_PARALLEL_STREAM_ORDER")
            .or_else(|| read("BURN_PARALLEL_CUBLAS_ORDER"))
            .unwrap_or_default();
        match value.trim() {
            "" | "device" => Order::Device,
            "sync" => Order::Sync,
            other => {
                eprintln!(
                    "warning: BURN_PARALLEL_STREAM_ORDER={other:?} is neither `device` nor \
                     `sync`; using `device`"
                );
                Order::Device
            }
        }
    })
}

/// The words of one (device, thread) pair.
struct Words {
    tensor: CubeTensor,
    /// The binding that keeps the words in place (never read).
    _bound: Box<dyn std::any::Any>,
    ready: cusys::CUdeviceptr,
    done: cusys::CUdeviceptr,
    seq: u32,
}

// SAFETY: the words' tensor and binding are used only under the `WORDS` mutex; device
// addresses are plain numbers.
unsafe impl Send for Words {}

/// `None` where the device refused stream memory operations (then every call syncs).
type Slot = Option<Words>;

/// Per (CUDA device, thread): CubeCL queues a thread's work on a stream of that thread's own,
/// so each thread has its own words and sequence.
static WORDS: Mutex<Vec<((usize, std::thread::ThreadId), Slot)>> = Mutex::new(Vec::new());

/// Two zeroed `u32` words on `like`'s device, bound for as long as the returned binding lives,
/// and the first one's address (the zeroing is queued on the calling thread's stream).
fn word_pair(
    like: &CubeTensor,
) -> Result<(CubeTensor, Box<dyn std::any::Any>, cusys::CUdeviceptr), String> {
    let words = zeros_client(
        like.client.clone(),
        like.device.clone(),
        [2].into(),
        DType::U32,
    );
    let (bound, addresses) = bind(&[&words])?;
    Ok((words, Box::new(bound), addresses[0]))
}

/// The number after `seq` (never 0, which the words start at).
fn next_number(seq: u32) -> u32 {
    seq.wrapping_add(1).max(1)
}

/// The CubeCL halves: without `wait`, store `value` in `flags[0]` (ready); with `wait`, spin
/// until `flags[1]` (done) has reached `value`.
#[cube(launch)]
fn order_kernel(flags: &mut Tensor<Atomic<u32>>, value: u32, #[comptime] wait: bool) {
    if ABSOLUTE_POS == 0 {
        if wait {
            loop {
                if flags[1].load() >= value {
                    break;
                }
            }
        } else {
            flags[0].store(value);
        }
    }
}

/// Queues [`order_kernel`] on `flags`' stream (the calling thread's).
fn queue(flags: &CubeTensor, value: u32, wait: bool) {
    order_kernel::launch(
        &flags.client.clone(),
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        flags.clone().into_tensor_arg(),
        value,
        wait,
    );
}

/// A point in the calling thread's CubeCL stream: everything queued there before [`mark`].
pub(crate) struct Mark {
    key: (usize, std::thread::ThreadId),
    /// `Some` under device ordering; `None`: the caller waits on the host.
    word: Option<(cusys::CUdeviceptr, cusys::CUdeviceptr, u32, CubeTensor)>,
}

/// Marks the work Burn has queued so far on the calling thread's stream of `like`'s device
/// (call it after the kernels that produce the buffers the foreign stream reads).
pub(crate) fn mark(like: &CubeTensor) -> Mark {
    let ordinal = cuda_index(&like.device).expect("ordering applies to CUDA devices only");
    let key = (ordinal, std::thread::current().id());
    if order() == Order::Sync {
        return Mark { key, word: None };
    }
    let mut all = WORDS.lock().unwrap_or_else(|p| p.into_inner());
    let at = match all.iter().position(|(k, _)| *k == key) {
        Some(at) => at,
        None => {
            let slot = match word_pair(like) {
                Ok((tensor, bound, ready)) => Some(Words {
                    tensor,
                    _bound: bound,
                    ready,
                    done: ready + 4,
                    seq: 0,
                }),
                Err(e) => {
                    eprintln!(
                        "warning: cannot bind the stream-ordering words ({e}); foreign streams \
                         wait on the host for Burn's work"
                    );
                    None
                }
            };
            all.push((key, slot));
            all.len() - 1
        }
    };
    let word = all[at].1.as_mut().map(|w| {
        // Limit: the words compare with `>=`, so after 2^32 marks on one thread (tens of
        // millions of steps) a wrapped number would pass early; not handled.
        w.seq = next_number(w.seq);
        queue(&w.tensor, w.seq, false);
        (w.ready, w.done, w.seq, w.tensor.clone())
    });
    Mark { key, word }
}

impl Mark {
    /// Makes `stream` (of the current CUDA context) wait for the marked work. `false` when it
    /// could not: the caller must wait for Burn's queued work on the host (`client.sync()`).
    pub(crate) fn wait_on(&self, stream: cusys::CUstream) -> bool {
        let Some((ready, _, seq, _)) = &self.word else {
            return false;
        };
        // SAFETY: `ready` is a bound device word of this context; the stream is live.
        let code = unsafe {
            cusys::cuStreamWaitValue32_v2(
                stream,
                *ready,
                *seq,
                cusys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        };
        if code != cusys::CUresult::CUDA_SUCCESS {
            eprintln!(
                "warning: cuStreamWaitValue32 failed ({code:?}): cuBLASLt and NCCL now wait on \
                 the host for Burn's work (BURN_PARALLEL_STREAM_ORDER=sync)"
            );
            self.refuse();
            return false;
        }
        true
    }

    /// Orders Burn's later work on the calling thread's stream after what `stream` has queued
    /// so far. `false` when it could not: the caller must wait for `stream` on the host.
    pub(crate) fn signal(&self, stream: cusys::CUstream) -> bool {
        let Some((_, done, seq, tensor)) = &self.word else {
            return false;
        };
        // SAFETY: `done` is a bound device word of this context; the stream is live.
        let code = unsafe {
            cusys::cuStreamWriteValue32_v2(
                stream,
                *done,
                *seq,
                cusys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        };
        if code != cusys::CUresult::CUDA_SUCCESS {
            self.refuse();
            return false;
        }
        queue(tensor, *seq, true);
        true
    }

    /// Every later mark of this (device, thread) pair waits on the host.
    fn refuse(&self) {
        let mut all = WORDS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, slot)) = all.iter_mut().find(|(k, _)| *k == self.key) {
            // Keep the words bound (a queued kernel may still use them); drop only the slot's
            // use: leak the binding rather than free memory a kernel might touch.
            if let Some(words) = slot.take() {
                std::mem::forget(words);
            }
        }
    }
}

/// A foreign stream's gate (one per foreign stream: an NCCL communicator's): lets CubeCL's
/// streams wait *on the device* for operations of that stream, which the host has not seen
/// complete.
///
/// Two words, `[abort, done]`. The foreign stream writes a fresh sequence number `s` to `done`
/// after an operation ([`Gate::open_after`], `cuStreamWriteValue32`); [`Gate::close_until`]
/// queues on the calling thread's stream a one-thread kernel that spins until `done >= s` or
/// `abort != 0`. The numbers only grow, and one stream writes them in order, so no word is ever
/// reset behind a waiter's back (a gate zeroed per operation on Burn's stream could be zeroed
/// *after* the foreign stream had opened it, and the waiter then spun for ever). The words are
/// zeroed once, at creation, and the host waits for that. [`Gate::abort`] opens every waiter
/// from the host, for an operation that failed and will never write its number.
pub(crate) struct Gate {
    words: CubeTensor,
    /// The binding that keeps the words in place (never read).
    _bound: Box<dyn std::any::Any>,
    abort: cusys::CUdeviceptr,
    done: cusys::CUdeviceptr,
    /// The last number handed out (written in this order by the foreign stream).
    seq: std::sync::atomic::AtomicU32,
    /// A stream of its own for [`Gate::abort`]'s write: non-blocking, so it runs while Burn's
    /// stream spins (a write on the legacy default stream would wait for the spinning kernel).
    side: cusys::CUstream,
}

// SAFETY: the words' tensor is a handle (launching kernels with it is thread-safe in CubeCL);
// the binding is never used, only dropped; device addresses and the stream are plain tokens.
unsafe impl Send for Gate {}
// SAFETY: see `Send`; shared access reads the immutable fields or the atomic counter.
unsafe impl Sync for Gate {}

impl Drop for Gate {
    fn drop(&mut self) {
        // SAFETY: the stream was created in `Gate::new` and is not used after this.
        let _ = unsafe { cusys::cuStreamDestroy_v2(self.side) };
    }
}

/// The gate kernel: spins until `flags[1] >= value` or `flags[0] != 0`.
#[cube(launch)]
fn gate_kernel(flags: &mut Tensor<Atomic<u32>>, value: u32) {
    if ABSOLUTE_POS == 0 {
        loop {
            if flags[1].load() >= value {
                break;
            }
            if flags[0].load() != 0 {
                break;
            }
        }
    }
}

impl Gate {
    /// A gate on `like`'s device, or `None` under `BURN_PARALLEL_STREAM_ORDER=sync` or where
    /// the device refuses it (the caller then waits on the host). Waits on the host for the
    /// words' zeroing (once per foreign stream).
    pub(crate) fn new(like: &CubeTensor) -> Option<Gate> {
        if order() == Order::Sync {
            return None;
        }
        let (words, bound, abort) = word_pair(like)
            .inspect_err(|e| {
                eprintln!(
                    "warning: cannot bind an NCCL communicator's gate ({e}); its collectives \
                     are waited for on the host"
                );
            })
            .ok()?;
        cubecl::future::block_on(words.client.sync()).ok()?;
        let mut side = std::ptr::null_mut();
        // SAFETY: `side` outlives the call; the current context is the device's (bound above).
        let code = unsafe {
            cusys::cuStreamCreate(
                &mut side,
                cusys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        if code != cusys::CUresult::CUDA_SUCCESS {
            return None;
        }
        Some(Gate {
            words,
            _bound: bound,
            abort,
            done: abort + 4,
            seq: std::sync::atomic::AtomicU32::new(0),
            side,
        })
    }

    /// Enqueues on `stream` (the foreign one, of the current context) the write of the next
    /// number, after what `stream` has queued so far, and returns the number. Calls for one
    /// gate must be serialised with the foreign stream's other uses (so numbers reach the
    /// stream in order).
    pub(crate) fn open_after(&self, stream: cusys::CUstream) -> Result<u32, cusys::CUresult> {
        use std::sync::atomic::Ordering;
        let seq = next_number(self.seq.load(Ordering::Acquire));
        // SAFETY: `done` is the gate's bound word, of this context; the stream is live.
        let code = unsafe {
            cusys::cuStreamWriteValue32_v2(
                stream,
                self.done,
                seq,
                cusys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        };
        if code != cusys::CUresult::CUDA_SUCCESS {
            return Err(code);
        }
        self.seq.store(seq, Ordering::Release);
        Ok(seq)
    }

    /// Queues on the calling thread's CubeCL stream the wait for number `seq`: Burn's later
    /// kernels there run after the foreign operation, and the host does not wait.
    pub(crate) fn close_until(&self, seq: u32) {
        gate_kernel::launch(
            &self.words.client.clone(),
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            self.words.clone().into_tensor_arg(),
            seq,
        );
    }

    /// Opens every waiter of the gate, now and for good (an operation failed and will never
    /// write its number; the foreign stream is not used again). Call with the device's
    /// context current.
    pub(crate) fn abort(&self) {
        // SAFETY: `abort` is the gate's bound word of the current context; `side` is live;
        // the write of one 32-bit word does not wait for other streams.
        unsafe {
            let _ = cusys::cuMemsetD32Async(self.abort, 1, 1, self.side);
            let _ = cusys::cuStreamSynchronize(self.side);
        }
    }
}
