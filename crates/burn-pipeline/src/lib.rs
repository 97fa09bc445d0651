//! burn-pipeline
