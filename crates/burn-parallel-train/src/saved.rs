//! [`saved_state`]: the caller's part of a checkpoint, below the loop ([`crate::fit()`]) and the
//! engines ([`crate::diloco`]) that both read it.

use burn_parallel::checkpoint::Checkpoint;

/// The caller's state saved with `checkpoint` (what [`crate::RunState::save`] gave; the whole
/// trainer state of a checkpoint written before the step engines kept it apart).
pub fn saved_state(checkpoint: &Checkpoint) -> &serde_json::Value {
    let saved = checkpoint.state();
    saved
        .get("state")
        .filter(|s| s.is_object())
        .unwrap_or(saved)
}
