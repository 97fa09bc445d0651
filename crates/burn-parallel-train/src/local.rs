//! [`run_local`]: thread ranks whose closure returns the suite's [`Error`].

use std::sync::Mutex;

use burn_parallel::{CollectiveError, Error, ProcessGroup};

/// [`burn_parallel::run_local`] for a closure that returns [`Error`] (what [`crate::build()`] and
/// a training loop built on it return): `world_size` thread ranks, each calling `f` with its
/// world group; a rank that fails aborts the others.
///
/// # Errors
/// The root cause: a rank's own error (a bad setting, a model that cannot be split) rather than
/// the collective failures it caused on the other ranks.
///
/// # Example
/// ```
/// use burn_parallel::Error;
///
/// let ranks = burn_parallel_train::run_local(2, |world| Ok(world.rank())).unwrap();
/// assert_eq!(ranks, [0, 1]);
/// let e = burn_parallel_train::run_local(2, |world| match world.rank() {
///     1 => Err(Error::invalid("--tp", "3 does not divide 2")),
///     _ => Ok(world.barrier()?),
/// })
/// .unwrap_err();
/// assert_eq!(e.to_string(), "--tp: 3 does not divide 2");
/// ```
pub fn run_local<T, F>(world_size: usize, f: F) -> Result<Vec<T>, Error>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T, Error> + Send + Sync,
{
    // Each rank's own error, kept whole; the launcher sees its collective form.
    let errors: Vec<Mutex<Option<Error>>> = (0..world_size).map(|_| Mutex::new(None)).collect();
    let outcome = burn_parallel::run_local(world_size, |world| {
        let rank = world.rank();
        f(world).map_err(|e| {
            let collective = match e.collective() {
                Some(c) => c.clone(),
                None => CollectiveError::InvalidArgument {
                    rank,
                    op: "run_local".into(),
                    reason: e.to_string(),
                },
            };
            *errors[rank].lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            collective
        })
    });
    let launch_error = match outcome {
        Ok(values) => return Ok(values),
        Err(e) => e,
    };
    let errors: Vec<Error> = errors
        .into_iter()
        .filter_map(|slot| slot.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect();
    // A rank's own failure first (not the failure of a peer it saw: a bad setting, a step
    // that turned NaN, with its context whole), then the launcher's choice.
    let own = errors
        .into_iter()
        .find(|e| e.collective().is_none_or(|c| !c.is_peer_failure()));
    Err(own.unwrap_or(Error::Collective(launch_error)))
}
