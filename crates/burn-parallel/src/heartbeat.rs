//! Heartbeats: each rank says which step it finished, so that its launcher can tell progress
//! from a hang and a slow rank from its peers.
//!
//! A training loop calls [`Heartbeat::beat`] after each optimizer step. The beat replaces (never
//! partially) the file `rank<R>.beat` of the directory named by `BURN_PARALLEL_HEARTBEAT_DIR` ([`DIR_ENV`],
//! which `burnrun` sets for every rank) with one JSON object, a [`Beat`]:
//!
//! ```json
//! {"rank":1,"step":42,"compute_s":0.231,"step_s":0.305,"unix_ms":1764428400123,"pid":4242}
//! ```
//!
//! `compute_s` is the part of the step the rank spent computing (forward, backward, optimizer),
//! without its waits in collectives; `step_s` is the whole step. In synchronous data parallelism
//! every rank's step lasts as long as the slowest rank's, so only the compute time tells a
//! straggler: [`Stragglers`] compares the ranks' medians. [`read_beats`] reads the files back.
//!
//! # Example
//! ```
//! use burn_parallel::heartbeat::{Heartbeat, Stragglers, read_beats};
//!
//! let dir = std::env::temp_dir().join(format!("heartbeat-doc-{}", std::process::id()));
//! let mut detector = Stragglers::default();
//! for step in 0..20 {
//!     for rank in 0..4 {
//!         // Rank 3 computes twice as long as the others.
//!         let compute = if rank == 3 { 0.4 } else { 0.2 };
//!         Heartbeat::new(&dir, rank).beat(step, compute, 0.45);
//!     }
//!     for beat in read_beats(&dir) {
//!         detector.observe(&beat);
//!     }
//! }
//! let straggler = detector.verdict().expect("rank 3 is slower");
//! assert_eq!(straggler.rank, 3);
//! println!("{straggler}");
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The environment variable of the directory the beats go to (unset: [`Heartbeat::from_env`]
/// gives `None`).
pub const DIR_ENV: &str = "BURN_PARALLEL_HEARTBEAT_DIR";

/// Steps per rank that [`Stragglers::default`] keeps.
pub const DEFAULT_WINDOW: usize = 20;

/// How much slower than the others' a rank's median compute time must be for
/// [`Stragglers::default`] to name it.
pub const DEFAULT_RATIO: f64 = 1.3;

/// One rank's last beat: the content of `rank<R>.beat`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Beat {
    /// The rank's global rank.
    pub rank: usize,
    /// The step it finished last.
    pub step: usize,
    /// The seconds of that step spent computing (forward, backward, optimizer), without the
    /// waits in collectives.
    pub compute_s: f64,
    /// The seconds the whole step took.
    pub step_s: f64,
    /// When it was written, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The process that wrote it.
    pub pid: u32,
}

/// Writes a rank's beats to `DIR/rank<R>.beat` (see the [module](self) documentation).
///
/// ```
/// use burn_parallel::heartbeat::{Heartbeat, read_beats};
///
/// let dir = std::env::temp_dir().join(format!("heartbeat-new-{}", std::process::id()));
/// let heartbeat = Heartbeat::new(&dir, 2);
/// heartbeat.beat(7, 0.25, 0.3);
/// let beats = read_beats(&dir);
/// assert_eq!((beats[0].rank, beats[0].step, beats[0].compute_s), (2, 7, 0.25));
/// std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[derive(Debug)]
pub struct Heartbeat {
    rank: usize,
    path: PathBuf,
    temp: PathBuf,
    pid: u32,
    warned: AtomicBool,
}

impl Heartbeat {
    /// The heartbeat of this process's rank when `BURN_PARALLEL_HEARTBEAT_DIR` is set (as
    /// `burnrun` does), with the rank from `RANK` (default 0); `None` otherwise.
    ///
    /// ```
    /// use burn_parallel::heartbeat::{DIR_ENV, Heartbeat};
    ///
    /// if let Some(heartbeat) = Heartbeat::from_env() {
    ///     heartbeat.beat(0, 0.1, 0.1);
    /// } else {
    ///     assert!(std::env::var_os(DIR_ENV).is_none());
    /// }
    /// ```
    pub fn from_env() -> Option<Heartbeat> {
        let dir = std::env::var_os(DIR_ENV).filter(|d| !d.is_empty())?;
        let rank = match std::env::var("RANK") {
            Err(_) => 0,
            Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                eprintln!(
                    "burn-parallel: heartbeat: RANK={v:?} is not a rank; beating as rank 0 \
                     (set RANK to this process's global rank)"
                );
                0
            }),
        };
        Some(Heartbeat::new(dir, rank))
    }

    /// The heartbeat of `rank`, writing to `dir/rank<R>.beat` (the directory is created by the
    /// first beat when missing).
    pub fn new(dir: impl Into<PathBuf>, rank: usize) -> Heartbeat {
        let dir = dir.into();
        let pid = std::process::id();
        Heartbeat {
            rank,
            path: dir.join(format!("rank{rank}.beat")),
            temp: dir.join(format!(".rank{rank}.beat.{pid}.tmp")),
            pid,
            warned: AtomicBool::new(false),
        }
    }

    /// The file the beats replace.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Says that this rank finished `step`, whose computing took `compute_seconds` (without the
    /// waits in collectives) of its `step_seconds`. Replaces the rank's file through a
    /// temporary file renamed into place, so a reader never sees a partial beat (the previous
    /// one, this one, or for a moment none). Costs some 30 µs on ext4. Never fails: an I/O
    /// error is printed once on stderr, then ignored.
    pub fn beat(&self, step: usize, compute_seconds: f64, step_seconds: f64) {
        let beat = Beat {
            rank: self.rank,
            step,
            compute_s: compute_seconds,
            step_s: step_seconds,
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            pid: self.pid,
        };
        if let Err(e) = self.write(&beat)
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            eprintln!(
                "burn-parallel: heartbeat: cannot write {}: {e}; later beats are dropped \
                 silently (check that {DIR_ENV} names a writable directory)",
                self.path.display()
            );
        }
    }

    fn write(&self, beat: &Beat) -> std::io::Result<()> {
        use std::io::{ErrorKind, Write};
        let json = serde_json::to_vec(beat).map_err(std::io::Error::other)?;
        let open = || {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&self.temp)
        };
        let mut file = match open() {
            Ok(file) => file,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if let Some(dir) = self.path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                open()?
            }
            // Left by a beat that was interrupted.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                std::fs::remove_file(&self.temp)?;
                open()?
            }
            Err(e) => return Err(e),
        };
        file.write_all(&json)?;
        drop(file);
        // The old beat is removed rather than renamed over: ext4 writes a file renamed over
        // another (or truncated) out to disk at once (`auto_da_alloc`), which costs about 1 ms
        // a beat instead of some 30 µs. A reader may find no file for a moment: it skips it.
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::rename(&self.temp, &self.path)
    }
}

/// The beats of `dir` (the files `rank<R>.beat`), in rank order. A file that cannot be read or
/// is not a whole [`Beat`] is skipped, and so is a missing directory (no beat yet).
///
/// ```
/// let none = burn_parallel::heartbeat::read_beats(std::path::Path::new("/nonexistent"));
/// assert!(none.is_empty());
/// ```
pub fn read_beats(dir: &Path) -> Vec<Beat> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut beats: Vec<Beat> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("rank") && name.ends_with(".beat")
        })
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|text| serde_json::from_slice::<Beat>(&text).ok())
        .collect();
    beats.sort_by_key(|b| b.rank);
    beats
}

/// A rank whose steps compute slower than the others' (see [`Stragglers::verdict`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    /// The slow rank.
    pub rank: usize,
    /// Its median compute time over its window, in seconds.
    pub median_s: f64,
    /// The median of the other ranks' medians, in seconds.
    pub others_median_s: f64,
    /// The steps its median is over.
    pub steps: usize,
}

impl fmt::Display for Straggler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} is a straggler: its steps compute in {}, the other ranks' in {} (median \
             over the last {} steps)",
            self.rank,
            Seconds(self.median_s),
            Seconds(self.others_median_s),
            self.steps
        )
    }
}

/// Seconds with two decimals, or three significant digits below 0.1 s.
struct Seconds(f64);

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            s if s >= 0.1 => write!(f, "{s:.2} s"),
            s if s >= 0.01 => write!(f, "{s:.3} s"),
            s => write!(f, "{s:.2e} s"),
        }
    }
}

/// Finds a straggler among ranks from their beats over time: per rank, the compute times of
/// its last `window` distinct steps.
///
/// ```
/// use burn_parallel::heartbeat::{Beat, Stragglers};
///
/// let mut detector = Stragglers::new(4, 1.5);
/// for step in 0..4 {
///     for (rank, compute_s) in [(0, 1.0), (1, 1.1), (2, 2.0)] {
///         let beat = Beat { rank, step, compute_s, step_s: 2.0, unix_ms: 0, pid: 1 };
///         detector.observe(&beat);
///     }
/// }
/// let straggler = detector.verdict().unwrap();
/// assert_eq!((straggler.rank, straggler.steps), (2, 4));
/// assert!((straggler.others_median_s - 1.05).abs() < 1e-12);
/// ```
#[derive(Debug, Clone)]
pub struct Stragglers {
    window: usize,
    ratio: f64,
    /// Per rank, (step, compute seconds), oldest first.
    ranks: BTreeMap<usize, VecDeque<(usize, f64)>>,
}

impl Default for Stragglers {
    /// A window of [`DEFAULT_WINDOW`] steps and a ratio of [`DEFAULT_RATIO`].
    fn default() -> Self {
        Self::new(DEFAULT_WINDOW, DEFAULT_RATIO)
    }
}

impl Stragglers {
    /// A detector keeping the last `window` steps of each rank (at least 1) that names a rank
    /// whose median compute time is over `ratio` times the others'.
    pub fn new(window: usize, ratio: f64) -> Self {
        Self {
            window: window.max(1),
            ratio,
            ranks: BTreeMap::new(),
        }
    }

    /// Takes a beat into account. A step already in the rank's window (the same beat read
    /// again, or a step repeated after a restart) is ignored.
    pub fn observe(&mut self, beat: &Beat) {
        if !beat.compute_s.is_finite() || beat.compute_s < 0.0 {
            return;
        }
        let steps = self.ranks.entry(beat.rank).or_default();
        if steps.iter().any(|&(s, _)| s == beat.step) {
            return;
        }
        steps.push_back((beat.step, beat.compute_s));
        while steps.len() > self.window {
            steps.pop_front();
        }
    }

    /// Forgets what was seen of `rank` (a restarted rank starts afresh).
    pub fn forget(&mut self, rank: usize) {
        self.ranks.remove(&rank);
    }

    /// The slowest straggler, if any (the first of [`Stragglers::all`]).
    pub fn verdict(&self) -> Option<Straggler> {
        self.all().into_iter().next()
    }

    /// Every rank whose median compute time over its window exceeds `ratio` times the median of
    /// the other ranks' medians, slowest first. Empty until two ranks or more were seen and
    /// every rank seen has at least `window / 2` steps in its window.
    pub fn all(&self) -> Vec<Straggler> {
        let needed = (self.window / 2).max(1);
        if self.ranks.len() < 2 || self.ranks.values().any(|s| s.len() < needed) {
            return Vec::new();
        }
        let medians: Vec<(usize, f64, usize)> = self
            .ranks
            .iter()
            .map(|(&rank, steps)| (rank, median(steps.iter().map(|&(_, c)| c)), steps.len()))
            .collect();
        let mut found: Vec<Straggler> = medians
            .iter()
            .filter_map(|&(rank, median_s, steps)| {
                let others = median(
                    medians
                        .iter()
                        .filter(|&&(r, ..)| r != rank)
                        .map(|&(_, m, _)| m),
                );
                (median_s > self.ratio * others).then_some(Straggler {
                    rank,
                    median_s,
                    others_median_s: others,
                    steps,
                })
            })
            .collect();
        let slowness = |s: &Straggler| s.median_s / s.others_median_s.max(f64::MIN_POSITIVE);
        found.sort_by(|a, b| slowness(b).total_cmp(&slowness(a)));
        found
    }
}

/// The median (the mean of the middle two for an even count); 0 for none.
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(rank: usize, step: usize, compute_s: f64) -> Beat {
        Beat {
            rank,
            step,
            compute_s,
            step_s: 1.0,
            unix_ms: 0,
            pid: 1,
        }
    }

    /// A deterministic value in [-1, 1) (no `rand` dependency).
    fn noise(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    #[test]
    fn equal_ranks_have_no_straggler() {
        let mut detector = Stragglers::default();
        for step in 0..40 {
            for rank in 0..8 {
                detector.observe(&beat(rank, step, 0.25));
            }
        }
        assert_eq!(detector.verdict(), None);
    }

    #[test]
    fn a_rank_twice_as_slow_is_named() {
        let mut detector = Stragglers::default();
        for step in 0..30 {
            for rank in 0..4 {
                let compute = if rank == 3 { 0.46 } else { 0.23 };
                detector.observe(&beat(rank, step, compute));
            }
        }
        let straggler = detector.verdict().expect("rank 3 is twice as slow");
        assert_eq!(
            straggler,
            Straggler {
                rank: 3,
                median_s: 0.46,
                others_median_s: 0.23,
                steps: 20
            }
        );
        assert_eq!(
            straggler.to_string(),
            "rank 3 is a straggler: its steps compute in 0.46 s, the other ranks' in 0.23 s \
             (median over the last 20 steps)"
        );
        assert_eq!(detector.all().len(), 1);
    }

    #[test]
    fn noise_of_ten_percent_is_no_straggler() {
        let mut seed = 7;
        let mut detector = Stragglers::default();
        for step in 0..200 {
            for rank in 0..8 {
                detector.observe(&beat(rank, step, 0.3 * (1.0 + 0.1 * noise(&mut seed))));
            }
            assert_eq!(detector.verdict(), None, "step {step}");
        }
    }

    #[test]
    fn no_verdict_before_half_a_window_of_every_rank() {
        let mut detector = Stragglers::default();
        for step in 0..9 {
            detector.observe(&beat(0, step, 0.1));
            detector.observe(&beat(1, step, 1.0));
        }
        assert_eq!(
            detector.verdict(),
            None,
            "9 steps are under half the window"
        );
        detector.observe(&beat(0, 9, 0.1));
        assert_eq!(detector.verdict(), None, "rank 1 has 9 steps only");
        // The same beat read twice counts once.
        detector.observe(&beat(1, 8, 1.0));
        assert_eq!(detector.verdict(), None);
        detector.observe(&beat(1, 9, 1.0));
        assert_eq!(detector.verdict().map(|s| (s.rank, s.steps)), Some((1, 10)));
        detector.forget(1);
        assert_eq!(detector.verdict(), None, "a lone rank has no peers");
    }

    #[test]
    fn a_beat_is_written_atomically_and_read_back() {
        let dir = std::env::temp_dir().join(format!("heartbeat-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let heartbeat = Heartbeat::new(dir.join("nested"), 5);
        heartbeat.beat(3, 0.5, 0.75);
        // A partial file and a foreign file are skipped.
        std::fs::write(dir.join("nested/rank9.beat"), b"{\"rank\":9,\"st").unwrap();
        std::fs::write(dir.join("nested/notes.txt"), b"x").unwrap();
        let beats = read_beats(&dir.join("nested"));
        assert_eq!(beats.len(), 1, "{beats:?}");
        let b = &beats[0];
        assert_eq!(
            (b.rank, b.step, b.compute_s, b.step_s, b.pid),
            (5, 3, 0.5, 0.75, std::process::id())
        );
        assert!(b.unix_ms > 0);
        let text = std::fs::read_to_string(heartbeat.path()).unwrap();
        for key in ["rank", "step", "compute_s", "step_s", "unix_ms", "pid"] {
            assert!(text.contains(&format!("\"{key}\":")), "{text}");
        }

        // The cost of one beat (printed, not asserted: it depends on the file system).
        let n = 2000;
        let start = std::time::Instant::now();
        for step in 0..n {
            heartbeat.beat(step, 0.5, 0.75);
        }
        let per_beat = start.elapsed() / n as u32;
        println!(
            "one beat costs {per_beat:?} (mean of {n}, in {})",
            dir.display()
        );
        assert_eq!(read_beats(&dir.join("nested"))[0].step, n - 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_write_error_does_not_fail_the_caller() {
        // A directory that cannot be created: under a regular file.
        let file = std::env::temp_dir().join(format!("heartbeat-file-{}", std::process::id()));
        std::fs::write(&file, b"").unwrap();
        let heartbeat = Heartbeat::new(file.join("dir"), 0);
        heartbeat.beat(0, 0.1, 0.1);
        heartbeat.beat(1, 0.1, 0.1);
        assert!(heartbeat.warned.load(Ordering::Relaxed));
        std::fs::remove_file(&file).unwrap();
    }
}
