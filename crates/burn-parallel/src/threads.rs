//! Intra-op threads: how many threads one rank's CPU kernels may use, so that ranks x threads
//! never oversubscribe the cores of a machine.
//!
//! The policy, in order:
//! 1. a value set in the program ([`set_intra_op_threads`], e.g. from a `--threads` flag);
//! 2. the environment variable `BURN_PARALLEL_THREADS`;
//! 3. automatic: the machine's cores divided by the ranks on this node, at least 1. The launchers
//!    say how many ranks share the node: [`crate::run_local`] (thread ranks) and the TCP/MPI
//!    bootstrap (`LOCAL_WORLD_SIZE`) call [`set_ranks_per_node`].
//!
//! The fused CPU kernels ([`crate::kernels`]) split their work over this many threads, and
//! [`configure_pool`] sizes the rayon pool in which Flex runs its matrix products so that the
//! ranks of one process, or the processes of one node, share the cores instead of each taking
//! all of them.
//!
//! ```
//! use burn_parallel::threads;
//!
//! threads::set_ranks_per_node(2);
//! assert!(threads::intra_op_threads() >= 1);
//! threads::set_intra_op_threads(Some(1));
//! assert_eq!(threads::intra_op_threads(), 1);
//! threads::set_intra_op_threads(None); // back to the automatic policy
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};

/// The environment variable that overrides the automatic choice.
pub const THREADS_ENV: &str = "BURN_PARALLEL_THREADS";

/// Explicit setting (0: none).
static EXPLICIT: AtomicUsize = AtomicUsize::new(0);
/// Ranks sharing this machine's cores (0: unknown, taken as 1).
static RANKS_PER_NODE: AtomicUsize = AtomicUsize::new(0);

/// Sets (or, with `None`, clears) the intra-op thread count of this process.
pub fn set_intra_op_threads(threads: Option<usize>) {
    EXPLICIT.store(threads.unwrap_or(0), Ordering::Relaxed);
}

/// Declares how many ranks share this machine's cores (thread ranks of one process, or
/// processes of one node).
pub fn set_ranks_per_node(ranks: usize) {
    RANKS_PER_NODE.store(ranks, Ordering::Relaxed);
}

/// The cores of this machine (as the OS reports them to this process, read once: the answer
/// comes from the cgroup files, and every CPU kernel asks).
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The thread count of the automatic policy for `ranks` ranks per node.
pub fn auto_threads(ranks: usize) -> usize {
    (cores() / ranks.max(1)).max(1)
}

/// The threads one rank's CPU kernels use now (see the module documentation for the policy).
pub fn intra_op_threads() -> usize {
    match EXPLICIT.load(Ordering::Relaxed) {
        0 => {}
        n => return n,
    }
    if let Some(n) = env_threads() {
        return n;
    }
    auto_threads(RANKS_PER_NODE.load(Ordering::Relaxed))
}

/// `BURN_PARALLEL_THREADS` when it holds a positive integer.
fn env_threads() -> Option<usize> {
    std::env::var(THREADS_ENV)
        .ok()?
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
}

/// Sizes rayon's global pool (Flex's matrix products run in it) for `threads_in_process`
/// threads, the first time only: rayon's pool cannot be resized once built. Returns whether
/// this call built it (`false`: it already existed, e.g. a Flex operation ran before the
/// launcher; set `RAYON_NUM_THREADS` then).
pub fn configure_pool(threads_in_process: usize) -> bool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads_in_process.max(1))
        .thread_name(|i| format!("burn-parallel-intra-op-{i}"))
        .build_global()
        .is_ok()
}

/// Declares `ranks` ranks on this node, keeps freed memory in the heap
/// ([`crate::malloc::keep_freed_memory`]) and, for a process that is one rank
/// (`size_global_pool`), sizes rayon's global pool ([`configure_pool`]) unless
/// `RAYON_NUM_THREADS` is set. Thread ranks run in pools of their own ([`in_rank_pool`]).
pub(crate) fn launch(ranks: usize, size_global_pool: bool) {
    set_ranks_per_node(ranks);
    crate::malloc::keep_freed_memory();
    if size_global_pool && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        configure_pool(intra_op_threads());
    }
}

/// Runs `f` (one thread rank's work) inside a rayon pool of [`intra_op_threads`] threads, so
/// that the matrix products Flex runs in rayon stay on this rank's share of the cores: two
/// ranks on two cores each run their products on one thread instead of both queueing on one
/// shared pool. Runs `f` on the calling thread if the pool cannot be built.
pub fn in_rank_pool<R: Send>(rank: usize, f: impl FnOnce() -> R + Send) -> R {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(intra_op_threads())
        .thread_name(move |i| format!("rank-{rank}-intra-op-{i}"))
        .build();
    match pool {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// Where the thread count came from, for logs: `"4 (BURN_PARALLEL_THREADS)"` and so on.
pub fn describe() -> String {
    let n = intra_op_threads();
    let source = if EXPLICIT.load(Ordering::Relaxed) > 0 {
        "set by the program".to_string()
    } else if env_threads().is_some() {
        THREADS_ENV.to_string()
    } else {
        format!(
            "{} cores / {} ranks on this node",
            cores(),
            RANKS_PER_NODE.load(Ordering::Relaxed).max(1)
        )
    };
    format!("{n} ({source})")
}
