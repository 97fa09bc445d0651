//! Forming the world: the entry points that give a program its world [`ProcessGroup`], each
//! over one of the transports of [`crate::comm`] (which know nothing of groups: the layers
//! import downward, transports below the group, the group below what is built on it).
//!
//! | ranks are | entry point |
//! |---|---|
//! | threads of this process | [`run_local`], [`local_world`] |
//! | processes over TCP (`burnrun`, `torchrun`, SLURM) | [`init_from_env`], [`connect_tcp`], [`connect_tcp_with_rendezvous`] |
//! | MPI processes (`mpirun`, `srun`) | [`init_mpi`] |
//! | NCCL on CUDA | [`crate::nccl::init_from_env`]: TCP, then NCCL attached to the group |

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::thread;

use crate::comm::local::local_transports;
use crate::comm::tcp::{TcpConfig, TcpRendezvous, TcpTransport};
use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;

/// Creates the process groups of a local world of `world_size` ranks, one per rank, to be moved
/// into the threads that run them. Prefer [`run_local`], which also handles failures.
///
/// # Panics
/// If `world_size` is 0.
pub fn local_world(world_size: usize) -> Vec<ProcessGroup> {
    local_transports(world_size)
        .into_iter()
        .map(|transport| ProcessGroup::world(transport))
        .collect()
}

/// Runs `f` on `world_size` ranks, each a thread with its own [`ProcessGroup`], and returns the
/// per-rank results in rank order.
///
/// If any rank panics or returns an error, every other rank's pending and future collective
/// calls fail at once with [`CollectiveError::PeerFailed`] naming it, and `run_local` returns the
/// first failure (a panic is reported as [`CollectiveError::PeerFailed`] with its message).
///
/// The closure returns this crate's collective errors. A closure that returns the suite's
/// [`Error`](crate::Error) (a model's build, a tensor-parallel layer, a training loop: anything
/// `?` converts into it) runs under `burn_parallel_train::run_local`, the same launcher that
/// returns the failing rank's own [`Error`](crate::Error) whole.
///
/// # Example
/// ```
/// use burn_parallel::{ReduceOp, run_local};
/// let sums = run_local(3, |group| {
///     group.all_reduce_f32(vec![group.rank() as f32 + 1.0], ReduceOp::Sum)
/// })
/// .unwrap();
/// assert_eq!(sums, vec![vec![6.0]; 3]);
/// ```
///
/// # Errors
/// The first error returned by a rank (preferring the root cause over the errors of the ranks
/// that were merely interrupted by it).
pub fn run_local<T, F>(world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Send + Sync,
{
    let groups = local_world(world_size);
    // The thread ranks share this process's cores (the intra-op thread policy).
    crate::threads::launch(world_size, false);
    let f = &f;
    let outcomes: Vec<Result<T>> = thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let transport = group.transport().clone();
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            crate::threads::in_rank_pool(rank, || f(group))
                        }));
                        match outcome {
                            Ok(Ok(value)) => Ok(value),
                            Ok(Err(err)) => {
                                transport.abort(&err.to_string());
                                Err(err)
                            }
                            Err(panic) => {
                                let message = panic_message(&*panic);
                                let reason = format!("rank {rank} panicked: {message}");
                                transport.abort(&reason);
                                Err(CollectiveError::PeerFailed {
                                    rank,
                                    op: "run_local".into(),
                                    peer: rank,
                                    reason,
                                })
                            }
                        }
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads catch their panics"))
            .collect()
    });
    // Report the root cause: a rank's own failure, not the `PeerFailed` it caused elsewhere.
    let mut first_err = None;
    let mut values = Vec::with_capacity(world_size);
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(v) => values.push(v),
            Err(e) => {
                let is_root = match &e {
                    CollectiveError::PeerFailed { peer, .. } => *peer == rank,
                    _ => true,
                };
                match (&first_err, is_root) {
                    (None, _) => first_err = Some((is_root, e)),
                    (Some((false, _)), true) => first_err = Some((true, e)),
                    _ => {}
                }
            }
        }
    }
    match first_err {
        Some((_, e)) => Err(e),
        None => Ok(values),
    }
}

/// Forms the world described by `config` and returns its world group.
///
/// Rank 0 binds `master_addr:master_port` and serves the rendezvous; the other ranks retry
/// connecting to it until `config.timeout`, so the processes may start in any order. With
/// [`TcpConfig::rejoin`] (`BURN_PARALLEL_FAULT_TOLERANT=1` for [`init_from_env`]), a restarted
/// process of a failed rank calls it again with the same configuration and joins the running
/// world instead ([`ProcessGroup::rejoined`] then says so; see [`crate::comm::tcp`]).
///
/// # Errors
/// [`CollectiveError::Rendezvous`] when the world cannot be formed within the timeout: rank 0
/// unreachable, ranks missing, world sizes that disagree, a rank claimed twice or out of range,
/// `MASTER_ADDR` not an address of rank 0's machine;
/// [`CollectiveError::JobToken`] when this rank's job token is refused until the timeout, or
/// when it has a token and rank 0 none (or the reverse); [`CollectiveError::Rendezvous`] also
/// when the ranks disagree on [`TcpConfig::rejoin`], and for a restarted rank that rank 0
/// refuses (its rank is still running, or is rank 0) or that reaches no other rank;
/// [`CollectiveError::InvalidTimeout`] for a timeout (`config.timeout`,
/// `BURN_PARALLEL_TIMEOUT_SECS`) that is zero or longer than
/// [`MAX_TIMEOUT`](crate::comm::tcp::MAX_TIMEOUT).
pub fn connect_tcp(config: &TcpConfig) -> Result<ProcessGroup> {
    Ok(ProcessGroup::world(TcpTransport::connect(config, None)?))
}

/// Like [`connect_tcp`], for rank 0, serving the rendezvous on a listener bound beforehand.
///
/// # Errors
/// As [`connect_tcp`]; also when `config.rank` is not 0.
pub fn connect_tcp_with_rendezvous(
    config: &TcpConfig,
    rendezvous: TcpRendezvous,
) -> Result<ProcessGroup> {
    Ok(ProcessGroup::world(TcpTransport::connect(
        config,
        Some(rendezvous),
    )?))
}

/// Forms the world described by the environment of `burnrun`, `torchrun` or SLURM (see
/// [`LaunchEnv`](crate::comm::tcp::LaunchEnv)) and returns its world group.
///
/// # Errors
/// [`CollectiveError::Rendezvous`] naming a missing or garbled variable and what to set, or
/// when the world cannot be formed (see [`connect_tcp`]).
///
/// # Example
/// ```no_run
/// use burn_parallel::{ReduceOp, init_from_env};
/// // Run with: burnrun --nproc-per-node 4 -- ./my_program
/// let group = init_from_env()?;
/// let total = group.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
/// assert_eq!(total, vec![group.size() as f32]);
/// # Ok::<(), burn_parallel::CollectiveError>(())
/// ```
pub fn init_from_env() -> Result<ProcessGroup> {
    connect_tcp(&TcpConfig::from_env()?)
}

/// The world group of `MPI_COMM_WORLD`: initialises MPI (with `MPI_THREAD_MULTIPLE`) on the
/// first call and returns the same group (clones of it) on later calls. MPI is finalised when
/// the process exits, after a barrier with the group's timeout; a job whose collectives failed
/// ends with `MPI_Abort` instead, so that no rank waits forever for a failed one.
///
/// # Returns
/// The world group: rank and size are MPI's (`mpirun -np N`, `srun`).
///
/// # Errors
/// [`CollectiveError::BackendNotBuilt`] when burn-parallel was built without the `mpi`
/// feature; [`CollectiveError::Rendezvous`] when MPI cannot be initialised or does not
/// provide `MPI_THREAD_MULTIPLE`; [`CollectiveError::InvalidArgument`] for a bad
/// `BURN_PARALLEL_MPI_MAX_COUNT`.
///
/// # Example
/// ```no_run
/// let world = burn_parallel::world::init_mpi()?;
/// println!("rank {} of {}", world.rank(), world.size());
/// # Ok::<(), burn_parallel::CollectiveError>(())
/// ```
pub fn init_mpi() -> Result<ProcessGroup> {
    static WORLD: std::sync::OnceLock<Result<ProcessGroup>> = std::sync::OnceLock::new();
    WORLD
        .get_or_init(|| {
            let group = ProcessGroup::world(crate::comm::mpi::world_transport()?);
            crate::comm::mpi::set_exit_timeout(group.timeout());
            Ok(group)
        })
        .clone()
}

/// Extracts the message of a panic payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
