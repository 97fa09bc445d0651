//! The `local` backend: every rank is a thread of one process.
//!
//! Sending a frame moves it into the receiver's [`Mailbox`]; payloads are reference-counted, so
//! a collective copies data only where its algorithm has to. [`run_local`] runs a closure on
//! every rank and turns a panic or an error in any rank into a prompt error for all of them.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread;

use crate::comm::shm::Board;
use crate::comm::transport::{Frame, Mailbox, Transport};
use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;

struct LocalWorld {
    mailboxes: Vec<Mailbox>,
    board: Board,
}

impl LocalWorld {
    fn fail(&self, rank: usize, reason: &str) {
        for mailbox in &self.mailboxes {
            mailbox.mark_failed(rank, reason);
        }
    }
}

/// One rank's end of a local (in-process) world.
pub struct LocalTransport {
    rank: usize,
    world: Arc<LocalWorld>,
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.mailboxes.len()
    }

    fn backend_name(&self) -> &'static str {
        "local"
    }

    fn send(&self, dst: usize, frame: Frame) -> Result<()> {
        let mailbox = self
            .world
            .mailboxes
            .get(dst)
            .ok_or_else(|| CollectiveError::Transport {
                rank: self.rank,
                peer: dst,
                reason: format!(
                    "no rank {dst} in a local world of {} ranks",
                    self.world.mailboxes.len()
                ),
            })?;
        mailbox.deliver(self.rank, frame);
        Ok(())
    }

    fn mailbox(&self) -> &Mailbox {
        &self.world.mailboxes[self.rank]
    }

    fn abort(&self, reason: &str) {
        self.world.fail(self.rank, reason);
    }

    fn board(&self) -> Option<&Board> {
        Some(&self.world.board)
    }
}

/// Creates the process groups of a local world of `world_size` ranks, one per rank, to be moved
/// into the threads that run them. Prefer [`run_local`], which also handles failures.
///
/// # Panics
/// If `world_size` is 0.
pub fn local_world(world_size: usize) -> Vec<ProcessGroup> {
    assert!(world_size > 0, "a local world needs at least one rank");
    let world = Arc::new(LocalWorld {
        mailboxes: (0..world_size).map(|_| Mailbox::new()).collect(),
        board: Board::default(),
    });
    (0..world_size)
        .map(|rank| {
            ProcessGroup::world(Arc::new(LocalTransport {
                rank,
                world: world.clone(),
            }))
        })
        .collect()
}

/// Runs `f` on `world_size` ranks, each a thread with its own [`ProcessGroup`], and returns the
/// per-rank results in rank order.
///
/// If any rank panics or returns an error, every other rank's pending and future collective
/// calls fail at once with [`CollectiveError::PeerFailed`] naming it, and `run_local` returns the
/// first failure (a panic is reported as [`CollectiveError::PeerFailed`] with its message).
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
