//! Which elements of a logical tensor a piece holds.
//!
//! Every layout cuts a parameter in one of two ways, or both:
//! - tensor parallelism keeps a *box*: a range of indices along one (or more) dimensions;
//! - ZeRO and FSDP keep a *flat range* of the elements, in row-major order, of what they shard
//!   (the whole tensor, or a tensor-parallel box of it).
//!
//! A [`Region`] is both at once: a box of the full tensor, then a range of the box's elements in
//! row-major order. A piece's data holds the region's elements in that order. To move data
//! between two layouts, both regions are turned into [`Region::runs`]: the maximal intervals of
//! the *full* tensor's row-major offsets that the region covers, in the region's order. Two
//! regions then meet where their runs intersect, a one-dimensional question.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A part of a logical tensor: a box of the full shape, then a row-major range of the box.
///
/// # Example
/// ```
/// use burn_parallel::checkpoint::Region;
///
/// // Columns 2..4 of a [3, 4] matrix (a column-parallel shard at tp 2, rank 1).
/// let shard = Region::full(&[3, 4]).narrow(1, 2..4).unwrap();
/// assert_eq!(shard.numel(), 6);
/// assert_eq!(shard.runs(), vec![2..4, 6..8, 10..12]);
/// // Its second half, as ZeRO would cut it over 2 ranks.
/// let zero = shard.flat_part(3..6).unwrap();
/// assert_eq!(zero.runs(), vec![7..8, 10..12]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// The full (logical) shape.
    pub shape: Vec<usize>,
    /// The box: one index range per dimension.
    pub bounds: Vec<Range<usize>>,
    /// The elements of the box kept, in the box's row-major order.
    pub flat: Range<usize>,
}

impl Region {
    /// The whole tensor of `shape`.
    pub fn full(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            bounds: shape.iter().map(|&d| 0..d).collect(),
            flat: 0..shape.iter().product(),
        }
    }

    /// Elements in the region.
    pub fn numel(&self) -> usize {
        self.flat.len()
    }

    /// Elements in the box.
    pub fn box_numel(&self) -> usize {
        self.bounds.iter().map(Range::len).product()
    }

    /// The sizes of the box.
    pub fn box_shape(&self) -> Vec<usize> {
        self.bounds.iter().map(Range::len).collect()
    }

    /// Whether the region is a whole box (no flat cut).
    pub fn is_box(&self) -> bool {
        self.flat == (0..self.box_numel())
    }

    /// The region restricted to indices `range` (relative to the box) along `dim`, as tensor
    /// parallelism shards a weight.
    ///
    /// # Errors
    /// When the region already has a flat cut, `dim` is out of bounds or `range` leaves the box.
    pub fn narrow(&self, dim: usize, range: Range<usize>) -> Result<Self, String> {
        if !self.is_box() {
            return Err(format!(
                "cannot narrow dimension {dim} of a region with a flat cut {:?}",
                self.flat
            ));
        }
        let b = self
            .bounds
            .get(dim)
            .ok_or_else(|| format!("dimension {dim} out of bounds for shape {:?}", self.shape))?;
        if range.start > range.end || range.end > b.len() {
            return Err(format!(
                "range {range:?} leaves dimension {dim} of size {} (shape {:?})",
                b.len(),
                self.shape
            ));
        }
        let mut bounds = self.bounds.clone();
        bounds[dim] = b.start + range.start..b.start + range.end;
        let numel = bounds.iter().map(Range::len).product();
        Ok(Self {
            shape: self.shape.clone(),
            bounds,
            flat: 0..numel,
        })
    }

    /// Part `index` of `parts` equal parts of `dim` (the last ones one smaller when it does not
    /// divide), as tensor parallelism shards a weight.
    ///
    /// # Errors
    /// See [`Region::narrow`]; also when `index >= parts`.
    pub fn chunk(&self, dim: usize, parts: usize, index: usize) -> Result<Self, String> {
        let len = self
            .bounds
            .get(dim)
            .map(Range::len)
            .ok_or_else(|| format!("dimension {dim} out of bounds for {:?}", self.shape))?;
        if index >= parts {
            return Err(format!("part {index} of {parts}"));
        }
        self.narrow(dim, even_part(len, parts, index))
    }

    /// Elements `range` of the region's own order, as ZeRO shards a flat space.
    ///
    /// # Errors
    /// When `range` is longer than the region.
    pub fn flat_part(&self, range: Range<usize>) -> Result<Self, String> {
        if range.start > range.end || range.end > self.numel() {
            return Err(format!(
                "flat range {range:?} leaves a region of {} elements",
                self.numel()
            ));
        }
        Ok(Self {
            shape: self.shape.clone(),
            bounds: self.bounds.clone(),
            flat: self.flat.start + range.start..self.flat.start + range.end,
        })
    }

    /// Checks that the box lies in the shape and the flat range in the box.
    ///
    /// # Errors
    /// A sentence naming what is out of bounds.
    pub fn validate(&self) -> Result<(), String> {
        if self.bounds.len() != self.shape.len() {
            return Err(format!(
                "{} bounds for a shape of rank {}",
                self.bounds.len(),
                self.shape.len()
            ));
        }
        for (d, (b, &n)) in self.bounds.iter().zip(&self.shape).enumerate() {
            if b.start > b.end || b.end > n {
                return Err(format!("bounds {b:?} of dimension {d} leave size {n}"));
            }
        }
        if self.flat.start > self.flat.end || self.flat.end > self.box_numel() {
            return Err(format!(
                "flat range {:?} leaves a box of {} elements",
                self.flat,
                self.box_numel()
            ));
        }
        Ok(())
    }

    /// The intervals of the full tensor's row-major offsets the region covers, in the region's
    /// element order, adjacent intervals merged.
    pub fn runs(&self) -> Vec<Range<usize>> {
        let rank = self.shape.len();
        let mut runs: Vec<Range<usize>> = Vec::new();
        if self.flat.is_empty() {
            return runs;
        }
        if rank == 0 {
            runs.push(0..1);
            return runs;
        }
        // Strides of the full tensor.
        let mut strides = vec![1usize; rank];
        for d in (0..rank - 1).rev() {
            strides[d] = strides[d + 1] * self.shape[d + 1];
        }
        let row = self.bounds[rank - 1].len();
        // Walk the box's rows (index vectors over all but the last dimension).
        let box_shape = self.box_shape();
        let mut pos = self.flat.start;
        while pos < self.flat.end {
            let (row_index, col) = (pos / row, pos % row);
            let take = (row - col).min(self.flat.end - pos);
            // The full-tensor offset of the row's element `col`.
            let mut rest = row_index;
            let mut offset = self.bounds[rank - 1].start + col;
            for d in (0..rank - 1).rev() {
                let i = rest % box_shape[d];
                rest /= box_shape[d];
                offset += (self.bounds[d].start + i) * strides[d];
            }
            match runs.last_mut() {
                Some(last) if last.end == offset => last.end += take,
                _ => runs.push(offset..offset + take),
            }
            pos += take;
        }
        runs
    }
}

/// Range `index` of `parts` near-equal parts of `0..len` (the first `len % parts` one longer).
pub fn even_part(len: usize, parts: usize, index: usize) -> Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

/// For each run of `want` (in order), the parts of `have`'s runs that cover it: triples
/// `(offset in want's order, offset in have's order, length)`.
///
/// `have` is one saved piece; the caller combines several to cover `want` entirely.
pub fn overlaps(want: &[Range<usize>], have: &[Range<usize>]) -> Vec<(usize, usize, usize)> {
    // `have`'s runs sorted by tensor offset, with their position in `have`'s order.
    let mut sorted: Vec<(Range<usize>, usize)> = Vec::with_capacity(have.len());
    let mut at = 0;
    for r in have {
        sorted.push((r.clone(), at));
        at += r.len();
    }
    sorted.sort_by_key(|(r, _)| r.start);
    let mut out = Vec::new();
    let mut want_at = 0;
    for w in want {
        // First saved run that ends after w.start.
        let mut i = sorted.partition_point(|(r, _)| r.end <= w.start);
        while i < sorted.len() && sorted[i].0.start < w.end {
            let (r, r_at) = &sorted[i];
            let lo = w.start.max(r.start);
            let hi = w.end.min(r.end);
            if lo < hi {
                out.push((want_at + lo - w.start, r_at + lo - r.start, hi - lo));
            }
            i += 1;
        }
        want_at += w.len();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets of every element of `region`, by brute force.
    fn offsets(region: &Region) -> Vec<usize> {
        let shape = region.box_shape();
        let numel: usize = shape.iter().product();
        let mut all = Vec::with_capacity(numel);
        for k in 0..numel {
            let mut rest = k;
            let mut idx = vec![0; shape.len()];
            for d in (0..shape.len()).rev() {
                idx[d] = rest % shape[d];
                rest /= shape[d];
            }
            let mut off = 0;
            for (d, i) in idx.iter().enumerate() {
                off = off * region.shape[d] + region.bounds[d].start + i;
            }
            all.push(off);
        }
        all[region.flat.clone()].to_vec()
    }

    fn expand(runs: &[Range<usize>]) -> Vec<usize> {
        runs.iter().flat_map(Clone::clone).collect()
    }

    #[test]
    fn runs_match_brute_force() {
        let full = Region::full(&[3, 5, 4]);
        let cases = vec![
            full.clone(),
            full.narrow(1, 1..4).unwrap(),
            full.narrow(2, 2..4).unwrap(),
            full.narrow(0, 1..3).unwrap().narrow(2, 0..3).unwrap(),
            full.narrow(2, 1..3).unwrap().flat_part(5..17).unwrap(),
            full.flat_part(7..41).unwrap(),
            full.narrow(1, 2..2).unwrap(),
        ];
        for r in cases {
            r.validate().unwrap();
            assert_eq!(expand(&r.runs()), offsets(&r), "{r:?}");
        }
        assert_eq!(expand(&Region::full(&[]).runs()), vec![0]);
    }

    #[test]
    fn overlaps_cover_every_element_once() {
        let full = Region::full(&[6, 10]);
        // Saved: tp 2 by columns, each cut by ZeRO over 3 ranks.
        let mut saved = Vec::new();
        for t in 0..2 {
            let tp = full.chunk(1, 2, t).unwrap();
            for z in 0..3 {
                saved.push(tp.flat_part(even_part(tp.numel(), 3, z)).unwrap());
            }
        }
        // Wanted: tp 4 by rows, whole.
        for t in 0..4 {
            let want = full.chunk(0, 4, t).unwrap();
            let want_offsets = offsets(&want);
            let mut got = vec![None; want.numel()];
            for s in &saved {
                let have_offsets = offsets(s);
                for (w, h, n) in overlaps(&want.runs(), &s.runs()) {
                    for k in 0..n {
                        assert_eq!(want_offsets[w + k], have_offsets[h + k]);
                        assert!(got[w + k].is_none(), "covered twice");
                        got[w + k] = Some(());
                    }
                }
            }
            assert!(got.iter().all(Option::is_some), "part {t} not covered");
        }
    }

    #[test]
    fn bad_cuts_are_refused() {
        let full = Region::full(&[4, 4]);
        assert!(full.narrow(2, 0..1).is_err());
        assert!(full.narrow(0, 2..5).is_err());
        assert!(full.flat_part(0..17).is_err());
        assert!(full.flat_part(0..3).unwrap().narrow(0, 0..1).is_err());
        assert!(full.chunk(0, 2, 2).is_err());
        assert_eq!(even_part(10, 4, 0), 0..3);
        assert_eq!(even_part(10, 4, 3), 8..10);
    }
}
