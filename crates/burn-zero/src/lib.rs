//! burn-zero
