//! How the MPI backend keeps every count and displacement of an MPI call within `int`.
//!
//! MPI counts and displacements are C `int`s: a call moving more than `i32::MAX` elements, or a
//! variable-count call whose displacements pass `i32::MAX`, would overflow. Contiguous calls
//! (all-reduce, broadcast) are split into consecutive [`chunks`]. Variable-count calls
//! (all-gather-v, all-to-all-v, reduce-scatter) that do not fit in one call run in [`Rounds`]:
//! in round `r` every piece moves its units `[r * cap, (r + 1) * cap)`, through a packed staging
//! buffer, so that no round moves more than `limit` units in all. This is pure arithmetic, kept
//! apart from MPI so that it is tested without MPI and without gigabytes of memory.

use std::ops::Range;

/// The most units (elements, or bytes for untyped calls) one MPI call moves: `i32::MAX`.
pub const MAX_COUNT: usize = i32::MAX as usize;

/// Consecutive ranges of at most `limit` units covering `0..len` (none when `len` is 0).
///
/// # Panics
/// If `limit` is 0.
pub fn chunks(len: usize, limit: usize) -> impl Iterator<Item = Range<usize>> {
    assert!(limit > 0, "a chunk limit of 0 units moves nothing");
    (0..len.div_ceil(limit)).map(move |i| i * limit..((i + 1) * limit).min(len))
}

/// How a variable-count collective is split into rounds that each fit in one MPI call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rounds {
    /// Number of MPI calls.
    pub count: usize,
    /// Units of one piece moved per round.
    cap: usize,
}

impl Rounds {
    /// Plans the rounds of a call where `parties` pieces go into (or come out of) one packed
    /// buffer per rank.
    ///
    /// # Arguments
    /// * `longest` - the longest piece of the call, over every rank (units).
    /// * `busiest` - the most units one rank's buffer holds in the call, over every rank (the
    ///   total of a rank's send pieces, or of its receive pieces, whichever is larger).
    /// * `parties` - how many pieces share one buffer (the group size).
    /// * `limit` - the most units one call may move ([`MAX_COUNT`] outside tests).
    ///
    /// # Returns
    /// One round moving whole pieces in place when `busiest <= limit`; otherwise rounds of
    /// `limit / parties` units per piece (at least 1), so that one round moves at most
    /// `max(limit, parties)` units per buffer (`limit` whenever `parties <= limit`, as with
    /// the real limit), and displacements into the packed staging buffer stay below that.
    ///
    /// # Panics
    /// If `limit` or `parties` is 0.
    pub fn plan(longest: usize, busiest: usize, parties: usize, limit: usize) -> Self {
        assert!(limit > 0 && parties > 0, "rounds need a limit and parties");
        if busiest <= limit {
            return Rounds {
                count: 1,
                cap: longest.max(1),
            };
        }
        let cap = (limit / parties).max(1);
        Rounds {
            count: longest.div_ceil(cap).max(1),
            cap,
        }
    }

    /// `true` when the call fits in one MPI call without staging.
    pub fn direct(&self) -> bool {
        self.count == 1
    }

    /// The units of a piece of `len` units that move in round `round`.
    pub fn range(&self, len: usize, round: usize) -> Range<usize> {
        let start = round.saturating_mul(self.cap).min(len);
        start..start.saturating_add(self.cap).min(len)
    }
}

/// `usize` to MPI's `int`, for counts that [`chunks`] or [`Rounds`] have bounded.
///
/// # Panics
/// If the value does not fit, which would be a bug in the planning above.
pub fn to_int(value: usize) -> i32 {
    i32::try_from(value).expect("chunk planning keeps MPI counts within int")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_everything_once_and_respect_the_limit() {
        for len in [0usize, 1, 6, 7, 8, 100] {
            for limit in [1usize, 3, 7, 1000] {
                let all: Vec<_> = chunks(len, limit).collect();
                assert!(all.iter().all(|r| !r.is_empty() && r.len() <= limit));
                let joined: Vec<usize> = all.iter().flat_map(|r| r.clone()).collect();
                assert_eq!(
                    joined,
                    (0..len).collect::<Vec<_>>(),
                    "len {len} limit {limit}"
                );
            }
        }
    }

    /// The real limit (i32::MAX) with a 5 GB buffer: only arithmetic, no memory.
    #[test]
    fn a_five_gigabyte_all_reduce_takes_three_calls_of_at_most_int_max() {
        let len = 5usize << 30;
        let all: Vec<_> = chunks(len, MAX_COUNT).collect();
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|r| r.len() <= i32::MAX as usize));
        assert_eq!(all.last().unwrap().end, len);
    }

    /// Every piece is covered exactly once, in order, and no round of any rank's buffer moves
    /// more than the limit (or one unit per piece when the limit is below the piece count), so
    /// its counts and its packed displacements fit.
    fn check(lengths: &[usize], limit: usize) -> Rounds {
        let n = lengths.len();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let total: usize = lengths.iter().sum();
        let rounds = Rounds::plan(longest, total, n, limit);
        let mut next = vec![0usize; n];
        for round in 0..rounds.count {
            let mut packed = 0usize;
            for (k, &len) in lengths.iter().enumerate() {
                let range = rounds.range(len, round);
                assert_eq!(range.start, next[k], "piece {k} continues where it stopped");
                next[k] = range.end;
                packed += range.len();
            }
            let bound = limit.max(n);
            assert!(
                packed <= bound,
                "round {round} packs {packed} > {bound} units"
            );
        }
        assert_eq!(next, lengths, "every unit of every piece moves");
        rounds
    }

    #[test]
    fn rounds_fit_the_limit_and_cover_every_piece() {
        for lengths in [
            vec![0usize, 0],
            vec![5, 0, 3],
            vec![10, 10],
            vec![1, 2, 3],
            vec![17, 0, 4, 9],
            vec![100, 1],
        ] {
            for limit in [1usize, 2, 3, 4, 7, 10, 64] {
                let rounds = check(&lengths, limit);
                let total: usize = lengths.iter().sum();
                assert_eq!(rounds.direct(), total <= limit, "{lengths:?} limit {limit}");
            }
        }
    }

    /// Three ranks gathering 1.5 GB each (4.5 GB in all) with the real `int` limit.
    #[test]
    fn a_gather_past_two_gigabytes_runs_in_rounds_of_int_counts() {
        let piece = 3usize << 29;
        let rounds = check(&[piece, piece, piece], MAX_COUNT);
        assert!(!rounds.direct());
        assert_eq!(rounds.count, 3);
        // Two ranks of 1 GB each fit one call: displacements stay below 2^31.
        assert!(check(&[1 << 30, (1 << 30) - 1], MAX_COUNT).direct());
    }
}
