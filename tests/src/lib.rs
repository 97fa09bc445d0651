//! cross-crate integration tests
