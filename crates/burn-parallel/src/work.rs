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

use std::sync::mpsc::{self, Receiver};

use burn::tensor::Tensor;

use crate::comm::host::ReduceOp;
use crate::error::{CollectiveError, Result};
use crate::group::{Job, ProcessGroup};

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
    /// In device memory: `finish` makes the result once `flight` completed.
    #[cfg(all(feature = "nccl", feature = "cuda"))]
    Device {
        flight: crate::comm::nccl::device::InFlight,
        finish: crate::comm::nccl::device::Finish<T>,
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
            State::Device { flight, finish } => flight.wait().and_then(|()| finish()),
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
            State::Device { flight, finish } => flight.wait_on_device().and_then(|()| finish()),
            state => Work { state }.wait(),
        }
    }
}

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
            // Logged by its caller when started ([`crate::calls`]).
            let _inside = crate::calls::Inside::enter();
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
        let _inside = self.logged_tensor("all_reduce", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::all_reduce_start(self, tensor, op) {
            Ok(Ok(started)) => return Work::on_device(started),
            Ok(Err(tensor)) => tensor,
            Err(e) => return Work::done(Err(e)),
        };
        self.on_lane("all_reduce_async", move |group| {
            group.all_reduce(tensor, op)
        })
    }

    /// Starts an all-gather of `tensor` along `dim` and returns at once; [`Work::wait`] gives
    /// what [`ProcessGroup::all_gather`] would have. See the [module docs](crate::work).
    ///
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::run_local;
    ///
    /// let out = run_local(2, |group| {
    ///     let x = Tensor::<1>::from_floats([group.rank() as f32], &Device::flex());
    ///     let work = group.all_gather_async(x, 0);
    ///     Ok(work.wait()?.into_data().to_vec::<f32>().unwrap())
    /// })
    /// .unwrap();
    /// assert_eq!(out[1], vec![0.0, 1.0]);
    /// ```
    ///
    /// # Errors
    /// Through [`Work::wait`]: see [`ProcessGroup::all_gather`].
    pub fn all_gather_async<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
    ) -> Work<Tensor<D>> {
        let _inside = self.logged_tensor("all_gather", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor = match crate::comm::nccl::device::all_gather_start(self, tensor, dim) {
            Ok(Ok(started)) => return Work::on_device(started),
            Ok(Err(tensor)) => tensor,
            Err(e) => return Work::done(Err(e)),
        };
        self.on_lane("all_gather_async", move |group| {
            group.all_gather(tensor, dim)
        })
    }

    /// Starts a reduce-scatter of `tensor` along `dim` (`sizes`: each rank's share, even when
    /// `None`) and returns at once; [`Work::wait`] gives what [`ProcessGroup::reduce_scatter`]
    /// would have. See the [module docs](crate::work).
    ///
    /// # Errors
    /// Through [`Work::wait`]: see [`ProcessGroup::reduce_scatter`].
    pub fn reduce_scatter_async<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
        op: ReduceOp,
        sizes: Option<&[usize]>,
    ) -> Work<Tensor<D>> {
        let _inside = self.logged_tensor("reduce_scatter", &tensor);
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        let tensor =
            match crate::comm::nccl::device::reduce_scatter_start(self, tensor, dim, op, sizes) {
                Ok(Ok(started)) => return Work::on_device(started),
                Ok(Err(tensor)) => tensor,
                Err(e) => return Work::done(Err(e)),
            };
        let sizes = sizes.map(<[usize]>::to_vec);
        self.on_lane("reduce_scatter_async", move |group| {
            group.reduce_scatter(tensor, dim, op, sizes.as_deref())
        })
    }
}

#[cfg(all(feature = "nccl", feature = "cuda"))]
impl<T> Work<T> {
    /// The handle of a collective the device path started.
    fn on_device((flight, finish): crate::comm::nccl::device::Started<T>) -> Self {
        Work {
            state: State::Device { flight, finish },
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor};

    use crate::{ReduceOp, run_local};

    fn values(t: Tensor<1>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// Three kinds of asynchronous collectives in flight at once, a synchronous collective on
    /// the same group meanwhile, waits in reverse order: each result is what the synchronous
    /// collective gives.
    #[test]
    fn async_collectives_match_the_synchronous_ones_in_any_wait_order() {
        let out = run_local(3, |g| {
            let d = Device::flex();
            let r = g.rank() as f32;
            let x = Tensor::<1>::from_floats([r, 10.0 + r, 20.0 + r, 30.0 + r], &d);
            let sum = g.all_reduce_async(x.clone(), ReduceOp::Sum);
            let gathered = g.all_gather_async(x.clone().narrow(0, 0, g.rank() + 1), 0);
            let scattered = g.reduce_scatter_async(x.clone(), 0, ReduceOp::Sum, Some(&[1, 1, 2]));
            // The caller's own collective on the group while those travel.
            let max = g.all_reduce(x.clone(), ReduceOp::Max)?;
            let scattered = values(scattered.wait()?);
            let gathered = values(gathered.wait()?);
            let sum = values(sum.wait()?);
            let want = (
                values(g.all_reduce(x.clone(), ReduceOp::Sum)?),
                values(g.all_gather(x.clone().narrow(0, 0, g.rank() + 1), 0)?),
                values(g.reduce_scatter(x, 0, ReduceOp::Sum, Some(&[1, 1, 2]))?),
            );
            Ok(((sum, gathered, scattered), want, values(max)))
        })
        .unwrap();
        for (rank, (got, want, max)) in out.into_iter().enumerate() {
            assert_eq!(got, want, "rank {rank}");
            assert_eq!(max, vec![2.0, 12.0, 22.0, 32.0]);
        }
    }

    /// A bad call started asynchronously is the synchronous call's typed error, at `wait`, on
    /// every rank (no hang).
    #[test]
    fn a_bad_async_call_is_a_typed_error_at_wait() {
        let out = run_local(2, |g| {
            let x = Tensor::<1>::ones([3], &Device::flex());
            // 3 rows cannot be split evenly over 2 ranks.
            Ok(g.reduce_scatter_async(x, 0, ReduceOp::Sum, None)
                .wait()
                .map_err(|e| e.to_string()))
        })
        .unwrap();
        for result in out {
            let e = result.expect_err("an uneven reduce-scatter without sizes");
            assert!(e.contains("reduce_scatter"), "{e}");
        }
    }
}
