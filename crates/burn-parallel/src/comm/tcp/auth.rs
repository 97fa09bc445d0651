//! The job secret (`BURN_PARALLEL_JOB_TOKEN`) and the HMAC-SHA256 proofs built from it.
//!
//! The token never crosses the wire. The accepting side of every connection (rank 0's store,
//! a rank's data listener) first sends a fresh random challenge; the connecting side answers
//! with `HMAC-SHA256(token, label ‖ challenge ‖ message)`, which only a holder of the token can
//! compute and which is worth nothing on another connection (the challenge differs), so a
//! recorded message cannot be replayed. The connecting side sends its own challenge too, and
//! the accepting side's reply carries an HMAC over it, so both ends prove the token.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{CollectiveError, Result};

/// The environment variable holding the job token.
pub const JOB_TOKEN_ENV: &str = "BURN_PARALLEL_JOB_TOKEN";

/// Bytes of a challenge.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub(crate) const TAG_LEN: usize = 32;

/// A random challenge.
pub(crate) type Nonce = [u8; NONCE_LEN];
/// An HMAC-SHA256 tag.
pub(crate) type Tag = [u8; TAG_LEN];

/// The secret shared by the ranks of one job: the rendezvous and every data connection are
/// authenticated with it (see [`crate::comm::tcp`]).
///
/// Its `Debug` form never shows the secret.
///
/// # Example
/// ```
/// use burn_parallel::comm::tcp::JobToken;
/// let token = JobToken::generate()?;
/// assert_eq!(token.as_str().len(), 64);
/// assert!(!format!("{token:?}").contains(token.as_str()));
/// assert!(JobToken::new("").is_err());
/// # Ok::<(), burn_parallel::CollectiveError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(Arc<str>);

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobToken(<{} bytes, redacted>)", self.0.len())
    }
}

impl JobToken {
    /// A token from a secret string.
    ///
    /// # Arguments
    /// * `secret` - the shared secret; any non-empty string (long and random: an eavesdropper
    ///   who records a handshake can try to guess it offline).
    ///
    /// # Errors
    /// [`CollectiveError::JobToken`] (for rank 0) when `secret` is empty.
    pub fn new(secret: impl AsRef<str>) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(CollectiveError::JobToken {
                rank: 0,
                reason: format!(
                    "the job token is empty: set {JOB_TOKEN_ENV} to a long random secret (the \
                     same on every rank), or unset it"
                ),
            });
        }
        Ok(Self(secret.into()))
    }

    /// A fresh token of 32 random bytes from the operating system, as 64 hex digits (what
    /// `burnrun` gives its ranks when `BURN_PARALLEL_JOB_TOKEN` is not set).
    ///
    /// # Errors
    /// [`CollectiveError::Rendezvous`] when the operating system's random source fails.
    pub fn generate() -> Result<Self> {
        let bytes: [u8; 32] = random_bytes()?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self::new(hex)
    }

    /// `BURN_PARALLEL_JOB_TOKEN`, or `None` when it is not set.
    ///
    /// # Errors
    /// [`CollectiveError::JobToken`] when it is set but empty or not valid UTF-8.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(JOB_TOKEN_ENV) {
            Ok(v) => Self::new(v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(CollectiveError::JobToken {
                rank: 0,
                reason: format!("{JOB_TOKEN_ENV} is not valid UTF-8: use a hex or ASCII secret"),
            }),
        }
    }

    /// The secret (to hand to processes that must join the same job).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn mac(&self, label: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.0.as_bytes())
            .expect("HMAC accepts keys of any length");
        for part in std::iter::once(label.as_bytes()).chain(parts.iter().copied()) {
            // Length-prefixed, so that no two different lists of parts hash alike.
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// The tag of `parts` under `label` (a constant naming the message).
    pub(crate) fn tag(&self, label: &str, parts: &[&[u8]]) -> Tag {
        self.mac(label, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` under `label` (compared in constant time).
    pub(crate) fn verify(&self, label: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.mac(label, parts).verify_slice(tag).is_ok()
    }
}

/// `N` random bytes from the operating system.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| {
        CollectiveError::Rendezvous(format!(
            "the operating system's random source failed ({e}); it is needed for the \
             rendezvous challenges"
        ))
    })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_token_label_and_every_part() {
        let a = JobToken::new("secret").unwrap();
        let b = JobToken::new("secreT").unwrap();
        let tag = a.tag("l", &[b"x", b"yz"]);
        assert!(a.verify("l", &[b"x", b"yz"], &tag));
        assert!(!b.verify("l", &[b"x", b"yz"], &tag));
        assert!(!a.verify("m", &[b"x", b"yz"], &tag));
        assert!(!a.verify("l", &[b"xy", b"z"], &tag));
        assert!(!a.verify("l", &[b"x", b"yz"], &tag[..31]));
    }
}
