//! The positions of a model's dropout streams in checkpoints: [`crate::fit()`] saves each rank's
//! dropout layers' call counters ([`SeededDropout::calls`]) with every checkpoint and sets them
//! back on resume, so that a resumed run draws the masks the saving run would have drawn next.
//! The model names its layers ([`crate::ParallelModel::dropout_layers`],
//! [`crate::StagedModel::stage_dropout_layers`]).

use std::collections::BTreeMap;

use burn_parallel::Error;
use burn_parallel::checkpoint::Checkpoint;
use burn_parallel::tensor_parallel::SeededDropout;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The key of the dropout counters in each rank's state.
pub const DROPOUT_CALLS: &str = "dropout_calls";

/// The call counters of `layers` by name, for a rank state under [`DROPOUT_CALLS`].
pub fn dropout_calls(layers: &[(String, SeededDropout)]) -> Value {
    let calls: BTreeMap<&str, u64> = layers
        .iter()
        .map(|(n, d)| (n.as_str(), d.calls()))
        .collect();
    serde_json::to_value(calls).expect("counters serialise")
}

/// Sets the call counters of `layers` to those `checkpoint` saved (merged over its ranks).
///
/// # Errors
/// [`Error::Invalid`] naming a dropout layer whose counter the checkpoint does not hold, or a
/// counter two saving ranks disagree on.
pub fn restore_dropout(
    checkpoint: &Checkpoint,
    layers: &[(String, SeededDropout)],
) -> Result<(), Error> {
    if layers.is_empty() {
        return Ok(());
    }
    let fail = |e: String| Error::invalid("checkpoint", e);
    let saved: BTreeMap<String, u64> =
        merged_rank_values(checkpoint, DROPOUT_CALLS).map_err(fail)?;
    for (name, drop) in layers {
        let calls = saved.get(name).ok_or_else(|| {
            fail(format!(
                "{} holds no dropout position for {name} (saved without that dropout layer): \
                 resume with the model that saved it",
                checkpoint.dir().display()
            ))
        })?;
        drop.set_calls(*calls);
    }
    Ok(())
}

/// The values saved under `key` in the rank states of `checkpoint`, merged by name over the
/// saving ranks (a name saved by several ranks must have the same value on each).
///
/// # Errors
/// A sentence naming the value two saving ranks disagree on, or a rank state that does not
/// parse.
fn merged_rank_values<T: DeserializeOwned + PartialEq + std::fmt::Debug>(
    checkpoint: &Checkpoint,
    key: &str,
) -> Result<BTreeMap<String, T>, String> {
    let mut all: BTreeMap<String, (usize, T)> = BTreeMap::new();
    for (rank, state) in checkpoint.manifest().rank_states.iter().enumerate() {
        let Some(values) = state.get(key) else {
            continue;
        };
        let values: BTreeMap<String, T> = serde_json::from_value(values.clone()).map_err(|e| {
            format!(
                "{}: rank {rank}'s {key} does not parse ({e}); the checkpoint is damaged",
                checkpoint.dir().display()
            )
        })?;
        for (name, value) in values {
            match all.get(&name) {
                Some((first, v)) if *v != value => {
                    return Err(format!(
                        "{}: ranks {first} and {rank} saved {key} {name} as {v:?} and \
                         {value:?}; the checkpoint is inconsistent, resume from another one",
                        checkpoint.dir().display()
                    ));
                }
                Some(_) => {}
                None => {
                    all.insert(name, (rank, value));
                }
            }
        }
    }
    Ok(all.into_iter().map(|(n, (_, v))| (n, v)).collect())
}
