//! burn-moe
