//! Dropout whose random numbers are a function of the *global* position of each element.
//!
//! Element `(i_0, .., i_{D-1})` of the full (unsharded) activation is dropped when
//! `hash(seed, site, stream, call, global linear index) < p`, where `call` counts the calls of
//! this dropout layer. Consequently:
//!
//! - ranks that hold the same element (a replicated tensor inside a tensor-parallel group) draw
//!   the same number, so replicas stay identical;
//! - ranks that hold different elements (heads split across ranks, tokens split by sequence
//!   parallelism) draw different numbers, and together they draw exactly the mask a single
//!   device would draw for the full tensor, whatever the tensor-parallel size;
//! - `stream` separates data-parallel replicas (set it to the data-parallel rank), which see
//!   different samples and must not share masks.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::tensor_parallel::{DropoutSite, SeededDropout};
//!
//! let drop = SeededDropout::new(0.5, 7, "blocks.0.attn.attn_drop");
//! let x = Tensor::<2>::ones([2, 4], &Device::flex().autodiff()).require_grad();
//! let full = drop.forward(x.clone(), &DropoutSite::full(&[2, 4]));
//! drop.reset(); // replay the same call with a shard: the same numbers
//! let right = drop.forward(x.narrow(1, 2, 2), &DropoutSite::new(&[2, 4], &[0, 2]));
//! assert_eq!(full.narrow(1, 2, 2).into_data(), right.into_data());
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Tensor, TensorData};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hash_str(s: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix(h)
}

/// Where a local tensor sits in the full activation: the full shape and the global index of
/// the local tensor's first element along each dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropoutSite {
    full: Vec<usize>,
    offsets: Vec<usize>,
}

impl DropoutSite {
    /// A local tensor that is the block of `full` starting at `offsets`.
    pub fn new(full: &[usize], offsets: &[usize]) -> Self {
        Self {
            full: full.to_vec(),
            offsets: offsets.to_vec(),
        }
    }

    /// A replicated (whole) tensor of shape `full`.
    pub fn full(full: &[usize]) -> Self {
        Self::new(full, &vec![0; full.len()])
    }
}

/// Dropout with layout-independent random numbers (see the [module docs](self)).
///
/// The call counter is shared by clones (an optimizer step returns a new module that keeps
/// counting). Every rank must call it the same number of times, which tensor parallelism
/// guarantees.
#[derive(Debug, Clone)]
pub struct SeededDropout {
    prob: f64,
    key: u64,
    calls: Arc<AtomicU64>,
}

impl SeededDropout {
    /// Dropout with probability `prob` for the layer named `site` (its module path) under
    /// `seed`.
    ///
    /// # Panics
    /// When `prob` is outside `[0, 1)`.
    pub fn new(prob: f64, seed: u64, site: &str) -> Self {
        assert!(
            (0.0..1.0).contains(&prob),
            "dropout probability must be in [0, 1), got {prob}"
        );
        Self {
            prob,
            key: mix(seed ^ hash_str(site)),
            calls: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Separates the masks of data-parallel replicas: use the data-parallel rank.
    pub fn with_stream(mut self, stream: u64) -> Self {
        self.key = mix(self.key ^ mix(stream.wrapping_add(1)));
        self
    }

    /// The drop probability.
    pub fn prob(&self) -> f64 {
        self.prob
    }

    /// Restarts the call counter (to replay a step).
    pub fn reset(&self) {
        self.calls.store(0, Ordering::SeqCst);
    }

    /// The number of masks drawn so far: with the seed, the site and the stream, it decides
    /// every later mask (a checkpoint saves it, [`Self::set_calls`] restores it).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Sets the call counter (shared by the clones), so that the next call draws mask number
    /// `calls`: a run resumed from a checkpoint draws the masks the saving run would have drawn.
    ///
    /// # Arguments
    /// * `calls` - the value [`Self::calls`] gave when the state was saved.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::tensor_parallel::{DropoutSite, SeededDropout};
    ///
    /// let drop = SeededDropout::new(0.5, 7, "drop");
    /// let x = || Tensor::<1>::ones([16], &Device::flex().autodiff()).require_grad();
    /// let site = DropoutSite::full(&[16]);
    /// drop.forward(x(), &site);
    /// let saved = drop.calls();
    /// let second = drop.forward(x(), &site).into_data();
    /// let resumed = SeededDropout::new(0.5, 7, "drop");
    /// resumed.set_calls(saved);
    /// assert_eq!(resumed.forward(x(), &site).into_data(), second);
    /// ```
    pub fn set_calls(&self, calls: u64) {
        self.calls.store(calls, Ordering::SeqCst);
    }

    /// Zeroes the dropped elements of `x` and scales the others by `1 / (1 - p)`; the identity
    /// when `p == 0` or when `x` is not tracked by autodiff (evaluation).
    ///
    /// # Panics
    /// When `site` does not describe a block of the full shape containing `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>, site: &DropoutSite) -> Tensor<D> {
        if self.prob == 0.0 || !x.is_tracked() {
            return x;
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let local = x.dims();
        assert!(
            site.full.len() == D && (0..D).all(|d| site.offsets[d] + local[d] <= site.full[d]),
            "dropout site {site:?} does not contain a local tensor of shape {local:?}"
        );
        let key = mix(self.key ^ mix(call));
        let threshold = (self.prob * (1u64 << 53) as f64) as u64;
        let scale = (1.0 / (1.0 - self.prob)) as f32;
        let numel: usize = local.iter().product();
        let mut values = Vec::with_capacity(numel);
        let mut index = [0usize; D];
        for _ in 0..numel {
            let mut global = 0u64;
            for ((&f, &o), &i) in site.full.iter().zip(&site.offsets).zip(&index) {
                global = global * f as u64 + (o + i) as u64;
            }
            let bits = mix(key.wrapping_add(global.wrapping_mul(GOLDEN))) >> 11;
            values.push(if bits < threshold { 0.0 } else { scale });
            for d in (0..D).rev() {
                index[d] += 1;
                if index[d] < local[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        let mask = Tensor::<D>::from_data(TensorData::new(values, local), &x.device());
        x * mask
    }
}
