//! Heap tuning for CPU training: keep freed tensor buffers in the process instead of handing
//! them back to the kernel at every step.
//!
//! A training step frees and reallocates the same few-megabyte activation and gradient
//! buffers thousands of times. glibc's defaults serve such sizes with `mmap` or return the
//! top of the heap to the kernel, so every step faults its memory in again page by page
//! (measured on the 4-layer GPT at 1 rank: 156k page faults in 12 steps, kernel time 1.0 s of
//! 5.8 s; with [`keep_freed_memory`] 28k faults and 0.7 s). This is what PyTorch's caching
//! allocator avoids by construction.
//!
//! [`keep_freed_memory`] raises glibc's mmap threshold to its maximum (32 MiB), the trim
//! threshold to 1 GiB and the top padding to 64 MiB. The launchers ([`crate::run_local`],
//! the TCP bootstrap) call it; `BURN_PARALLEL_MALLOC=system` or any `MALLOC_*` tunable in the
//! environment leaves the heap alone. On other C libraries it does nothing.
//!
//! ```
//! // Harmless to call more than once; `false` where it does nothing.
//! let _tuned: bool = burn_parallel::malloc::keep_freed_memory();
//! ```

/// The environment variable that turns the tuning off (`system`).
pub const MALLOC_ENV: &str = "BURN_PARALLEL_MALLOC";

/// Tunes glibc's heap as the module documentation says; returns whether it did.
pub fn keep_freed_memory() -> bool {
    if std::env::var(MALLOC_ENV).is_ok_and(|v| v.trim() == "system")
        || std::env::vars_os().any(|(k, _)| k.to_string_lossy().starts_with("MALLOC_"))
    {
        return false;
    }
    tune()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune() -> bool {
    const MIB: libc::c_int = 1 << 20;
    // SAFETY: `mallopt` only changes the allocator's tunables; it is thread-safe in glibc and
    // takes plain integers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 * MIB) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * MIB) == 1
            && libc::mallopt(libc::M_TOP_PAD, 64 * MIB) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune() -> bool {
    false
}
