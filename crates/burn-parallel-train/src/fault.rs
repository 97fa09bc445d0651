//! [`crate::fit()`]'s side of fault-tolerant data parallelism ([`burn_parallel::fault`]): the
//! state a live replica hands to a rejoining one, and the joining itself.
//!
//! The state travels in the checkpoint format, so that one loader serves a resume and a
//! rejoin: the lowest live replica saves it (weights, optimizer state, loss scaler, losses,
//! data position and dropout positions, as [`crate::fit()`] saves a checkpoint) into a spool
//! directory of each of its ranks, in the system's temporary directory, sends every file over
//! the job's own connections to every rank of the joining replica, and deletes the spool;
//! each joining rank writes the files into its own spool and resumes from it. No checkpoint of
//! the run's checkpoint directory is read.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn_parallel::checkpoint::Checkpointer;
use burn_parallel::fault::Replicas;
use burn_parallel::train::SaveState;
use burn_parallel::{Error, ProcessGroup};

use crate::build::Built;
use crate::model::ParallelModel;

/// How long a rejoining replica waits for the state: a live replica sends it after the step in
/// which all live replicas saw the request.
const JOIN_WAIT: Duration = Duration::from_secs(600);

/// This rank's spool directory (unique to the process and rank).
fn spool(world: &ProcessGroup) -> PathBuf {
    std::env::temp_dir().join(format!(
        "burn-parallel-rejoin-{}-rank{}",
        std::process::id(),
        world.global_rank()
    ))
}

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::invalid(
        "--fault-tolerant",
        format!(
            "{what} {}: {e}; check the temporary directory (TMPDIR)",
            path.display()
        ),
    )
}

/// The files under `root`, by their paths relative to it.
fn files_under(root: &Path) -> Result<Vec<(String, Vec<u8>)>, Error> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| io("listing", &dir, e))? {
            let path = entry.map_err(|e| io("listing", &dir, e))?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|e| io("reading", &path, e))?;
            let name = path
                .strip_prefix(root)
                .expect("under the root")
                .to_string_lossy()
                .into_owned();
            out.push((name, bytes));
        }
    }
    out.sort();
    Ok(out)
}

/// Sends the state after step `done` to the replicas `joiners`, from every rank of this (the
/// donor) replica: `saved` is what [`crate::fit()`] saves with a checkpoint. Collective over
/// this replica.
///
/// # Errors
/// A state that cannot be saved or sent (I/O in the temporary directory, collective errors).
pub(crate) fn donate<P: ParallelModel>(
    built: &Built<P>,
    replicas: &Replicas,
    joiners: &[usize],
    done: usize,
    saved: SaveState,
) -> Result<(), Error> {
    let root = spool(&built.groups.world);
    let _ = std::fs::remove_dir_all(&root);
    let mut saver = Checkpointer::new(&root, 1, replicas.island())?;
    built.save(&mut saver, done, saved)?;
    saver.wait()?;
    let files = files_under(&root);
    let _ = std::fs::remove_dir_all(&root);
    replicas.send_state(joiners, &files?)?;
    Ok(())
}

/// A restarted replica's way back in: asks the live replicas to take it back, waits for the
/// state, and writes it into this rank's spool, from which [`crate::fit()`] resumes.
///
/// # Returns
/// The spool directory (a checkpoint root).
///
/// # Errors
/// No live replica answering in time; I/O in the temporary directory.
pub(crate) fn join(replicas: &Replicas, world: &ProcessGroup) -> Result<PathBuf, Error> {
    replicas.request_join()?;
    let files = replicas.receive_state(JOIN_WAIT)?;
    let root = spool(world);
    let _ = std::fs::remove_dir_all(&root);
    for (name, bytes) in files {
        let path = root.join(&name);
        if Path::new(&name).is_absolute() || name.split('/').any(|c| c == "..") {
            return Err(Error::invalid(
                "--fault-tolerant",
                format!("the live replica sent a state file with a bad name: {name}"),
            ));
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
        }
        std::fs::write(&path, bytes).map_err(|e| io("writing", &path, e))?;
    }
    Ok(root)
}

/// Deletes this rank's spool after a rejoin loaded it.
pub(crate) fn clean(world: &ProcessGroup) {
    let _ = std::fs::remove_dir_all(spool(world));
}
