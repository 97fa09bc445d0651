//! The `local` backend: every rank is a thread of one process.
//!
//! Sending a frame moves it into the receiver's [`Mailbox`]; payloads are reference-counted, so
//! a collective copies data only where its algorithm has to. [`crate::world::run_local`] runs
//! a closure on every rank and turns a panic or an error in any rank into a prompt error for
//! all of them.

use std::sync::Arc;

use crate::comm::shm::Board;
use crate::comm::transport::{Frame, Mailbox, Transport};
use crate::error::{CollectiveError, Result};

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

/// The transports of a local world of `world_size` ranks, one per rank (rank order).
/// [`crate::world::run_local`] and [`crate::world::local_world`] make the groups.
///
/// # Panics
/// If `world_size` is 0.
pub fn local_transports(world_size: usize) -> Vec<Arc<LocalTransport>> {
    assert!(world_size > 0, "a local world needs at least one rank");
    let world = Arc::new(LocalWorld {
        mailboxes: (0..world_size).map(|_| Mailbox::new()).collect(),
        board: Board::default(),
    });
    (0..world_size)
        .map(|rank| {
            Arc::new(LocalTransport {
                rank,
                world: world.clone(),
            })
        })
        .collect()
}
