//! Collectives that return at once with a handle, [`Work`] (torch's `Work`): the caller goes on
//! computing while the collective runs, and waits only where it needs the result.
//!
//! Where the collective runs:
//!
//! - **In device memory** (NCCL with a CUDA tensor, see [`crate::comm::nccl`]): it is enqueued
//!   on the communicator's stream, ordered after the kernels Burn queued for its input by a
//!   device-side wait ([`crate::kernels`]' ordering words, no host sync), and the call returns.
//!   [`Work::wait`] polls its completion (an event on that stream) together with NCCL's
//!   asynchronous error and the group's timeout, so a dead peer ends in a typed error, never a
//!   hang. Device collectives of one group run in the order they were started, on every rank.
//! - **Through the host** (threads, TCP, MPI, or tensors NCCL does not take): on the group's
//!   *lane*, one communication thread per group that runs the started collectives in order, on a
//!   sub-group over the same ranks (made at the group's first asynchronous call, as with
//!   [`ProcessGroup::split`]: every rank makes its first asynchronous call on a group at the
//!   same point of its program). So synchronous collectives the caller runs on the group
//!   meanwhile never interleave with them.
//!
//! Every rank must start the same asynchronous collectives in the same order; waiting may
//! happen in any order. A `Work` dropped without [`Work::wait`] still completes (its buffers
//! stay alive until then); its result and error are discarded.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::{ReduceOp, run_local};
//!
//! let out = run_local(2, |group| {
//!     let device = Device::flex();
//!     let x = Tensor::<1>::from_floats([group.rank() as f32, 1.0], &device);
//!     let work = group.all_reduce_async(x, ReduceOp::Sum); // returns at once
//!     let other = Tensor::<1>::ones([2], &device) * 2.0; // overlapped with the all-reduce
//!     let sum = work.wait()?;
//!     Ok((sum + other).into_data().to_vec::<f32>().unwrap())
//! })
//! .unwrap();
//! assert_eq!(out[1], vec![3.0, 4.0]);
//! ```

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;

use crate::comm::host::ReduceOp;
use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;

/// A collective in flight: [`Work::wait`] returns its result. See the [module docs](self).
#[must_use = "a Work's result is read by `wait`"]
pub struct Work<T> {
    state: State<T>,
}

enum State<T> {
    Done(Result<T>),
    /// On the group's lane.
    Lane {
        result: Receiver<Result<T>>,
        rank: usize,
        op: &'static str,
    },
    /// In device memory: the result once `flight` completed.
    #[cfg(all(feature = "nccl", feature = "cuda"))]
    Device {
        flight: crate::comm::nccl::device::InFlight,
        value: T,
    },
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Done(_) => "done",
            State::Lane { .. } => "on the host lane",
            #[cfg(all(feature = "nccl", feature = "cuda"))]
            State::Device { .. } => "in device memory",
        };
        write!(f, "Work({state})")
    }
}

impl<T> Work<T> {
    /// A `Work` that has its result already (a collective that ran synchronously).
    pub fn done(result: Result<T>) -> Self {
        Self {
            state: State::Done(result),
        }
    }

    /// Waits for the collective and returns its result.
    ///
    /// # Errors
    /// The collective's error: a dead peer, a timeout, a mismatch (see [`CollectiveError`]).
    pub fn wait(self) -> Result<T> {
        match self.state {
            State::Done(result) => result,
            State::Lane { result, rank, op } => result.recv().unwrap_or_else(|_| {
                Err(CollectiveError::InvalidArgument {
                    rank,
                    op: op.into(),
                    reason: "the group's communication thread stopped without a result \
                                 (it panicked: see its message above)"
                        .into(),
                })
            }),
            #[cfg(all(feature = "nccl", feature = "cuda"))]
            State::Device { flight, value } => flight.wait().map(|()| value),
        }
    }
}

impl<T> Work<T> {
    /// Like [`Work::wait`], but a collective in device memory is waited for *on the device*
    /// and this returns at once with the result tensor: the calling thread's CubeCL stream
    /// waits for the collective (a one-thread kernel spinning on a word the communication
    /// stream writes when it completed), so the host goes on queueing work (an optimizer step,
    /// the next forward) while the collective and the kernels before it finish, as torch's
    /// `Work::wait` does for NCCL. Other collectives wait on the host, as [`Work::wait`].
    ///
    /// Use the result on the calling thread's stream (reading it to the host is fine: the read
    /// comes after the wait). A failure after this returned (a peer dying mid-collective, the
    /// group's timeout) cannot be returned here: the group's watchdog aborts the communicator
    /// and releases the waiting stream, the result then holds garbage, and the group's next
    /// collective returns the error. Whatever was computed from that result (an optimizer step
    /// taken with it) must be discarded: resume from the last checkpoint, as after torch's
    /// NCCL watchdog ends a job.
    ///
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::{ReduceOp, run_local};
    ///
    /// let out = run_local(2, |group| {
    ///     let x = Tensor::<1>::ones([3], &Device::flex());
    ///     let sum = group.all_reduce_async(x, ReduceOp::Sum).wait_on_device()?;
    ///     Ok(sum.into_data().to_vec::<f32>().unwrap())
    /// })
    /// .unwrap();
    /// assert_eq!(out[0], vec![2.0; 3]);
    /// ```
    ///
    /// # Errors
    /// An error known by now (a launch that failed, a communicator aborted earlier); on the
    /// host paths, the collective's error.
    pub fn wait_on_device(self) -> Result<T> {
        match self.state {
            #[cfg(all(feature = "nccl", feature = "cuda"))]
            State::Device { flight, value } => flight.wait_on_device().map(|()| value),
            state => Work { state }.wait(),
        }
    }
}

/// A job on a lane: runs a collective on the lane's group.
type Job = Box<dyn FnOnce(&ProcessGroup) + Send>;

/// A group's lane (shared by its clones): the queue of its communication thread, which runs
/// started collectives in order on a sub-group over the same ranks. Dropped with the last clone
/// of its group: the thread finishes the jobs it has and ends.
pub(crate) type LaneSlot = Arc<Mutex<Option<Sender<Job>>>>;

impl ProcessGroup {
    /// Runs `job` on this group's lane (started at the first call) and returns its handle.
    pub(crate) fn on_lane<T: Send + 'static>(
        &self,
        op: &'static str,
        job: impl FnOnce(&ProcessGroup) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let rank = self.global_rank();
        let mut slot = self.lane_slot().lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let all: Vec<usize> = (0..self.size()).collect();
            let group = match self.split(&all) {
                Ok(group) => group,
                Err(e) => return Work::done(Err(e)),
            };
            let (jobs, queue) = mpsc::channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name(format!("burn-parallel-lane-{rank}"))
                .spawn(move || {
                    for job in queue {
                        job(&group);
                    }
                });
            if let Err(e) = spawned {
                return Work::done(Err(CollectiveError::InvalidArgument {
                    rank,
                    op: op.into(),
                    reason: format!("cannot start the group's communication thread: {e}"),
                }));
            }
            *slot = Some(jobs);
        }
        let (to_caller, result) = mpsc::channel();
        let job: Job = Box::new(move |group| {
            let _ = to_caller.send(job(group));
        });
        let jobs = slot.as_ref().expect("started above");
        if jobs.send(job).is_err() {
            return Work::done(Err(CollectiveError::InvalidArgument {
                rank,
                op: op.into(),
                reason: "the group's communication thread has stopped (a collective on it \
                         panicked)"
                    .into(),
            }));
        }
        Work {
            state: State::Lane { result, rank, op },
        }
    }

    /// Starts an all-reduce of `tensor` and returns at once; [`Work::wait`] gives what
    /// [`ProcessGroup::all_reduce`] would have. See the [module docs](crate::work).
    ///
    /// # Errors
    /// Through [`Work::wait`]: see [`ProcessGroup::all_reduce_data`].
    pub fn all_reduce_async<const D: usize>(
        &self,
        tensor: Tensor<D>,
        op: ReduceOp,
    ) -> Work<Tensor<D>> {
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::all_reduce_start(self, tensor, op) {
            Ok(Ok((flight, value))) => {
                return Work {
                    state: State::Device { flight, value },
                };
            }
            Ok(Err(tensor)) => tensor,
            Err(e) => return Work::done(Err(e)),
        };
        self.on_lane("all_reduce_async", move |group| {
            group.all_reduce(tensor, op)
        })
    }
}
