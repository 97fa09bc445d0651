//! Where a [`ParamMap`](super::ParamMap) reads parameters from: a saved [`Checkpoint`], or
//! whole tensors in memory (a model imported from another format, a single-device state).
//!
//! Both are read the same way, by logical name and [`Region`], so any layout can start from
//! either: a tensor-parallel rank takes its box of each weight, an FSDP rank its flat range.
//!
//! ```
//! use std::collections::BTreeMap;
//! use burn::tensor::TensorData;
//! use burn_parallel::checkpoint::{Region, TensorSource};
//!
//! let mut tensors = BTreeMap::new();
//! tensors.insert("w".to_string(), TensorData::new((0..8).map(|x| x as f32).collect(), [2, 4]));
//! // Rank 1 of tp 2 splitting the columns reads columns 2..4 of both rows.
//! let region = Region::full(&[2, 4]).chunk(1, 2, 1).unwrap();
//! let mine = tensors.read("w", &region).unwrap();
//! assert_eq!(mine.try_to_vec::<f32>().unwrap(), vec![2.0, 3.0, 6.0, 7.0]);
//! ```

use std::collections::{BTreeMap, HashSet};

use burn::tensor::TensorData;

use super::{Checkpoint, CheckpointError, Region, Result};

/// Logical tensors that can be read by region.
pub trait TensorSource {
    /// The name and full shape of every tensor.
    fn shapes(&self) -> Vec<(&str, &[usize])>;

    /// Reads `region` of tensor `name`: its elements in the region's order, as a 1-D tensor of
    /// the stored dtype.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when there is no such tensor or the region does not fit its
    /// shape; the source's read errors.
    fn read(&self, name: &str, region: &Region) -> Result<TensorData>;
}

/// Checks that `source` holds exactly the tensors `expected` (name, full shape).
///
/// # Errors
/// [`CheckpointError::Mismatch`] listing the missing, unexpected and reshaped tensors.
pub fn check_tensors<'a, S: TensorSource + ?Sized>(
    source: &S,
    expected: impl IntoIterator<Item = (&'a str, &'a [usize])>,
) -> Result<()> {
    let have: BTreeMap<&str, &[usize]> = source.shapes().into_iter().collect();
    let mut missing = Vec::new();
    let mut shapes = Vec::new();
    let mut seen = HashSet::new();
    for (name, shape) in expected {
        seen.insert(name);
        match have.get(name) {
            None => missing.push((name.to_string(), shape.to_vec())),
            Some(saved) if *saved != shape => {
                shapes.push((name.to_string(), saved.to_vec(), shape.to_vec()));
            }
            Some(_) => {}
        }
    }
    let unexpected: Vec<_> = have
        .iter()
        .filter(|(n, _)| !seen.contains(*n))
        .map(|(n, s)| (n.to_string(), s.to_vec()))
        .collect();
    if missing.is_empty() && unexpected.is_empty() && shapes.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::Mismatch {
            missing,
            unexpected,
            shapes,
        })
    }
}

impl TensorSource for Checkpoint {
    fn shapes(&self) -> Vec<(&str, &[usize])> {
        self.manifest()
            .tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape.as_slice()))
            .collect()
    }

    fn read(&self, name: &str, region: &Region) -> Result<TensorData> {
        Checkpoint::read(self, name, region)
    }
}

/// Whole tensors by logical name, each in its full shape.
impl TensorSource for BTreeMap<String, TensorData> {
    fn shapes(&self) -> Vec<(&str, &[usize])> {
        self.iter()
            .map(|(n, t)| (n.as_str(), &**t.shape()))
            .collect()
    }

    fn read(&self, name: &str, region: &Region) -> Result<TensorData> {
        let t = self.get(name).ok_or_else(|| {
            CheckpointError::piece(name, format!("not among the {} tensors given", self.len()))
        })?;
        if region.shape.as_slice() != &**t.shape() {
            return Err(CheckpointError::piece(
                name,
                format!(
                    "asked for a region of shape {:?}, the tensor has shape {:?}",
                    region.shape,
                    &**t.shape()
                ),
            ));
        }
        region
            .validate()
            .map_err(|e| CheckpointError::piece(name, e))?;
        let size = t.dtype().size();
        let bytes = t.as_bytes();
        if bytes.len() != t.num_elements() * size {
            return Err(CheckpointError::piece(
                name,
                format!(
                    "holds {} bytes, its shape {:?} of {:?} needs {}",
                    bytes.len(),
                    &**t.shape(),
                    t.dtype(),
                    t.num_elements() * size
                ),
            ));
        }
        let mut out = Vec::with_capacity(region.numel() * size);
        for run in region.runs() {
            out.extend_from_slice(&bytes[run.start * size..run.end * size]);
        }
        Ok(TensorData::from_bytes_vec(
            out,
            vec![region.numel()],
            t.dtype(),
        ))
    }
}
