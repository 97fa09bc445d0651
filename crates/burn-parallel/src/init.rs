//! Deterministic, layout-independent parameter initialisation.
//!
//! Every value produced here is a pure function of `(seed, name, shape, element index)`. Nothing
//! depends on the calling thread, the rank, the order in which parameters are created or on
//! Burn's global RNG (ranks run as threads in one process and would race on it). This is what
//! lets every parallel layout start from bit-identical weights: a tensor-parallel rank builds the
//! *full* tensor with [`init_normal`] from the same `(seed, name)` as the single-device oracle and
//! keeps its shard.
//!
//! The generator is counter-based: element `i` of a tensor is derived from
//! `splitmix64(key + i * GOLDEN)` where `key = hash(seed, name, shape)`. Normal values use the
//! Box–Muller transform on the pair of uniforms of elements `2p` and `2p + 1`.
//!
//! Names follow Burn's module paths (`blocks.0.attn.q.weight`), so the name of a parameter is
//! the path a [`ModuleVisitor`](burn::module::ModuleVisitor) reports for it.
//!
//! ```
//! use examples::init::init_normal;
//!
//! let a = init_normal(42, "blocks.0.attn.q.weight", &[4, 4], 0.02);
//! let b = init_normal(42, "blocks.0.attn.q.weight", &[4, 4], 0.02);
//! assert_eq!(a, b);
//! ```

use burn::module::Param;
use burn::tensor::{Device, Tensor, TensorData};

/// Odd constant of SplitMix64 (2^64 / golden ratio).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// One SplitMix64 output for the state `x`: a bijective 64-bit mixer.
///
/// # Arguments
///
/// - `x`: the counter (state) to mix.
///
/// # Returns
///
/// A well-mixed 64-bit value; `splitmix64(key + i * GOLDEN)` for `i = 0, 1, ..` is the
/// SplitMix64 stream of `key`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream key of a parameter: a stable hash (FNV-1a mixed with SplitMix64) of the seed, the
/// name and the shape.
///
/// Stable across platforms, Rust versions and runs (unlike `std`'s `DefaultHasher`).
///
/// # Arguments
///
/// - `seed`: the model seed.
/// - `name`: the parameter's path, e.g. `"blocks.0.mlp.up.weight"`.
/// - `shape`: the shape of the *full* (unsharded) tensor.
///
/// # Returns
///
/// The 64-bit key of the element stream.
pub fn param_key(seed: u64, name: &str, shape: &[usize]) -> u64 {
    const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01B3;
    let mut h = FNV_OFFSET;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    let mut key = splitmix64(seed ^ splitmix64(h));
    for &d in shape {
        key = splitmix64(key ^ d as u64);
    }
    key
}

/// Uniform value in `[0, 1)` for element `index` of the stream `key` (53 random bits).
///
/// # Arguments
///
/// - `key`: a stream key from [`param_key`].
/// - `index`: the element's counter.
pub fn uniform_at(key: u64, index: u64) -> f64 {
    let bits = splitmix64(key.wrapping_add(index.wrapping_mul(GOLDEN))) >> 11;
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal value for element `index` of the stream `key` (Box–Muller on the uniforms of
/// counters `2 * (index / 2)` and `2 * (index / 2) + 1`; even indices take the cosine branch,
/// odd ones the sine branch).
///
/// # Arguments
///
/// - `key`: a stream key from [`param_key`].
/// - `index`: the element's row-major index in the full tensor.
pub fn normal_at(key: u64, index: u64) -> f64 {
    let pair = index / 2;
    // 1 - u lies in (0, 1], so the logarithm is finite.
    let u1 = 1.0 - uniform_at(key, 2 * pair);
    let u2 = uniform_at(key, 2 * pair + 1);
    let r = (-2.0 * u1.ln()).sqrt();
    let theta = 2.0 * core::f64::consts::PI * u2;
    if index.is_multiple_of(2) {
        r * theta.cos()
    } else {
        r * theta.sin()
    }
}

/// Number of elements of `shape`.
fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Normal(0, `std`) values for the full tensor `name` of `shape`, on the host.
///
/// # Arguments
///
/// - `seed`: the model seed.
/// - `name`: the parameter's path (see the module docs).
/// - `shape`: the full, unsharded shape.
/// - `std`: the standard deviation.
///
/// # Returns
///
/// `f32` [`TensorData`] of `shape`, a pure function of the arguments.
///
/// # Example
///
/// ```
/// use examples::init::init_normal;
///
/// let w = init_normal(7, "wte.weight", &[256, 8], 0.02);
/// assert_eq!(w.shape().to_vec(), vec![256, 8]);
/// assert_ne!(w, init_normal(7, "wpe.weight", &[256, 8], 0.02));
/// ```
pub fn init_normal(seed: u64, name: &str, shape: &[usize], std: f64) -> TensorData {
    let key = param_key(seed, name, shape);
    let values: Vec<f32> = (0..numel(shape) as u64)
        .map(|i| (normal_at(key, i) * std) as f32)
        .collect();
    TensorData::new(values, shape.to_vec())
}

/// Uniform values in `[low, high)` for the full tensor `name` of `shape`, on the host.
///
/// # Arguments
///
/// - `seed`, `name`, `shape`: as for [`init_normal`].
/// - `low`, `high`: the interval.
///
/// # Returns
///
/// `f32` [`TensorData`] of `shape`, a pure function of the arguments.
pub fn init_uniform(seed: u64, name: &str, shape: &[usize], low: f64, high: f64) -> TensorData {
    let key = param_key(seed, name, shape);
    let values: Vec<f32> = (0..numel(shape) as u64)
        .map(|i| (low + (high - low) * uniform_at(key, i)) as f32)
        .collect();
    TensorData::new(values, shape.to_vec())
}

/// A constant tensor (ones for norm weights, zeros for biases), on the host.
///
/// # Arguments
///
/// - `shape`: the shape.
/// - `value`: the value of every element.
pub fn init_constant(shape: &[usize], value: f32) -> TensorData {
    TensorData::new(vec![value; numel(shape)], shape.to_vec())
}

/// Turns host data into a trainable parameter on `device`.
///
/// The parameter requires a gradient when `device` has autodiff enabled (`device.autodiff()`);
/// on a plain device the setting is remembered and applies after moving to an autodiff device.
///
/// # Arguments
///
/// - `data`: the values; their shape must have rank `D`.
/// - `device`: where the tensor lives.
pub fn param_from_data<const D: usize>(data: TensorData, device: &Device) -> Param<Tensor<D>> {
    Param::from_data(data, device)
}

/// A Normal(0, `std`) parameter, see [`init_normal`].
///
/// # Example
///
/// ```
/// use burn::tensor::Device;
/// use examples::init::normal_param;
///
/// let w = normal_param(1, "head.weight", [8, 4], 0.02, &Device::flex());
/// assert_eq!(w.val().dims(), [8, 4]);
/// ```
pub fn normal_param<const D: usize>(
    seed: u64,
    name: &str,
    shape: [usize; D],
    std: f64,
    device: &Device,
) -> Param<Tensor<D>> {
    param_from_data(init_normal(seed, name, &shape, std), device)
}

/// A uniform parameter in `[low, high)`, see [`init_uniform`].
pub fn uniform_param<const D: usize>(
    seed: u64,
    name: &str,
    shape: [usize; D],
    (low, high): (f64, f64),
    device: &Device,
) -> Param<Tensor<D>> {
    param_from_data(init_uniform(seed, name, &shape, low, high), device)
}

/// A constant parameter, see [`init_constant`].
pub fn constant_param<const D: usize>(
    shape: [usize; D],
    value: f32,
    device: &Device,
) -> Param<Tensor<D>> {
    param_from_data(init_constant(&shape, value), device)
}

/// Carries `(seed, path prefix, device)` through a model's constructors so that each parameter
/// is named by its module path without string plumbing in the model code.
///
/// # Example
///
/// ```
/// use burn::tensor::Device;
/// use examples::init::{Init, init_normal};
///
/// let init = Init::new(3, &Device::flex());
/// let q = init.at("blocks").at(0).at("attn").normal("q.weight", [4, 4], 0.02);
/// let expected = init_normal(3, "blocks.0.attn.q.weight", &[4, 4], 0.02);
/// assert_eq!(q.val().into_data(), expected);
/// ```
#[derive(Clone, Debug)]
pub struct Init {
    seed: u64,
    prefix: String,
    device: Device,
}

impl Init {
    /// The root context: names are used as given.
    pub fn new(seed: u64, device: &Device) -> Self {
        Self {
            seed,
            prefix: String::new(),
            device: device.clone(),
        }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The device parameters are created on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A child context whose names are prefixed with `segment.`.
    pub fn at(&self, segment: impl core::fmt::Display) -> Self {
        Self {
            seed: self.seed,
            prefix: self.path(&segment.to_string()),
            device: self.device.clone(),
        }
    }

    /// The full path of `name` in this context.
    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        }
    }

    /// A Normal(0, `std`) parameter named `prefix.name`.
    pub fn normal<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        std: f64,
    ) -> Param<Tensor<D>> {
        normal_param(self.seed, &self.path(name), shape, std, &self.device)
    }

    /// A uniform parameter in `[low, high)` named `prefix.name`.
    pub fn uniform<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        low: f64,
        high: f64,
    ) -> Param<Tensor<D>> {
        uniform_param(
            self.seed,
            &self.path(name),
            shape,
            (low, high),
            &self.device,
        )
    }

    /// A parameter of ones (norm weights).
    pub fn ones<const D: usize>(&self, shape: [usize; D]) -> Param<Tensor<D>> {
        constant_param(shape, 1.0, &self.device)
    }

    /// A parameter of zeros (biases).
    pub fn zeros<const D: usize>(&self, shape: [usize; D]) -> Param<Tensor<D>> {
        constant_param(shape, 0.0, &self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(d: &TensorData) -> Vec<f32> {
        d.try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn deterministic_and_name_dependent() {
        let a = init_normal(1, "a.weight", &[3, 5], 1.0);
        let b = init_normal(1, "a.weight", &[3, 5], 1.0);
        assert_eq!(a, b);
        assert_ne!(
            values(&a),
            values(&init_normal(1, "b.weight", &[3, 5], 1.0))
        );
        assert_ne!(
            values(&a),
            values(&init_normal(2, "a.weight", &[3, 5], 1.0))
        );
        assert_ne!(
            values(&a),
            values(&init_normal(1, "a.weight", &[5, 3], 1.0))
        );
        // Same stream, scaled.
        let c = init_normal(1, "a.weight", &[3, 5], 0.5);
        for (x, y) in values(&a).iter().zip(values(&c)) {
            assert!((x * 0.5 - y).abs() < 1e-6);
        }
    }

    #[test]
    fn independent_of_thread_and_order() {
        let here = init_normal(9, "x", &[64], 0.02);
        let _other = init_normal(9, "y", &[64], 0.02);
        let there = std::thread::spawn(|| init_normal(9, "x", &[64], 0.02))
            .join()
            .unwrap();
        assert_eq!(here, there);
    }

    #[test]
    fn element_function_matches_tensor() {
        let d = init_normal(5, "w", &[4, 6], 2.0);
        let key = param_key(5, "w", &[4, 6]);
        let v = values(&d);
        for (i, x) in v.iter().enumerate() {
            assert_eq!(*x, (normal_at(key, i as u64) * 2.0) as f32);
        }
    }

    #[test]
    fn moments_are_plausible() {
        let n = 20_000;
        let v = values(&init_normal(0, "big", &[n], 1.0));
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");

        let u = values(&init_uniform(0, "u", &[n], -2.0, 3.0));
        assert!(u.iter().all(|&x| (-2.0..3.0).contains(&x)));
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    }

    #[test]
    fn init_context_builds_paths() {
        let init = Init::new(0, &Device::flex());
        assert_eq!(
            init.at("blocks").at(3).path("mlp.up.weight"),
            "blocks.3.mlp.up.weight"
        );
        assert_eq!(init.path("wte.weight"), "wte.weight");
        let p = init.ones([3]);
        assert_eq!(
            p.val().into_data().try_into_vec::<f32>().unwrap(),
            vec![1.0; 3]
        );
    }
}
