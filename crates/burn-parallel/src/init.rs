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
//! use burn_parallel::init::init_normal;
//!
//! let a = init_normal(42, "blocks.0.attn.q.weight", &[4, 4], 0.02);
//! let b = init_normal(42, "blocks.0.attn.q.weight", &[4, 4], 0.02);
//! assert_eq!(a, b);
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::module::{Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};

use crate::group::ProcessGroup;
use crate::plan::{TpPlan, TpStyle};
use crate::tensor_parallel::{Shard, TpContext, TpError, TpResult};

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

/// How the values of a parameter are drawn: every variant is a pure function of
/// `(seed, name, full shape, element index)`, so any slice of a tensor can be produced without
/// the rest ([`Initializer::shard`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Initializer {
    /// Normal(0, `std`).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// Uniform in `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound (excluded).
        high: f64,
    },
    /// Every element `value` (ones for norm weights, zeros for biases).
    Constant(f32),
}

impl Initializer {
    /// Element `index` (row-major, in the full tensor) of the stream `key`.
    fn value(self, key: u64, index: u64) -> f32 {
        match self {
            Initializer::Normal { std } => (normal_at(key, index) * std) as f32,
            Initializer::Uniform { low, high } => {
                (low + (high - low) * uniform_at(key, index)) as f32
            }
            Initializer::Constant(v) => v,
        }
    }

    /// The whole tensor `name` of `shape`, on the host.
    pub fn full(self, seed: u64, name: &str, shape: &[usize]) -> TensorData {
        let key = param_key(seed, name, shape);
        let values: Vec<f32> = (0..numel(shape) as u64)
            .map(|i| self.value(key, i))
            .collect();
        TensorData::new(values, shape.to_vec())
    }

    /// Only the slice `shard.start .. shard.start + shard.len` along `dim` of the tensor
    /// `name` of full shape `shape`, zero-padded to `shard.stored` entries: exactly the matching
    /// slice of [`Self::full`], computed without materialising the rest.
    ///
    /// # Example
    /// ```
    /// use burn_parallel::init::Initializer;
    /// use burn_parallel::tensor_parallel::Shard;
    ///
    /// let init = Initializer::Normal { std: 0.02 };
    /// let full = init.full(1, "w", &[4, 6]).to_vec::<f32>().unwrap();
    /// let shard = Shard { full: 6, start: 2, len: 3, stored: 3 };
    /// let part = init.shard(1, "w", &[4, 6], 1, &shard).to_vec::<f32>().unwrap();
    /// assert_eq!(part[0], full[2]); // row 0, column 2
    /// assert_eq!(part[3], full[8]); // row 1, column 2
    /// ```
    ///
    /// # Panics
    /// If `dim` is out of range or the shard does not fit the dimension.
    pub fn shard(
        self,
        seed: u64,
        name: &str,
        shape: &[usize],
        dim: usize,
        shard: &Shard,
    ) -> TensorData {
        assert!(dim < shape.len(), "dim {dim} of a shape {shape:?}");
        assert!(
            shard.full == shape[dim]
                && shard.start + shard.len <= shard.full
                && shard.len <= shard.stored,
            "shard {shard} does not fit dim {dim} of {shape:?}"
        );
        let key = param_key(seed, name, shape);
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let mut values = Vec::with_capacity(outer * shard.stored * inner);
        for o in 0..outer {
            for j in 0..shard.stored {
                if j < shard.len {
                    let base = ((o * shape[dim] + shard.start + j) * inner) as u64;
                    values.extend((0..inner as u64).map(|i| self.value(key, base + i)));
                } else {
                    values.extend(std::iter::repeat_n(0.0, inner));
                }
            }
        }
        let mut local = shape.to_vec();
        local[dim] = shard.stored;
        TensorData::new(values, local)
    }
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
/// use burn_parallel::init::init_normal;
///
/// let w = init_normal(7, "wte.weight", &[256, 8], 0.02);
/// assert_eq!(w.shape().to_vec(), vec![256, 8]);
/// assert_ne!(w, init_normal(7, "wpe.weight", &[256, 8], 0.02));
/// ```
pub fn init_normal(seed: u64, name: &str, shape: &[usize], std: f64) -> TensorData {
    Initializer::Normal { std }.full(seed, name, shape)
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
    Initializer::Uniform { low, high }.full(seed, name, shape)
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
/// use burn_parallel::init::normal_param;
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
/// is named by its module path without string plumbing in the model code, and, with
/// [`Init::with_tp`], a tensor-parallel plan: the layers built with [`Init::linear`] and
/// [`Init::embedding`] then hold only this rank's shard, computed directly from the seed (no
/// rank ever holds the full model).
///
/// # Example
///
/// ```
/// use burn::tensor::Device;
/// use burn_parallel::init::{Init, init_normal};
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
    tp: Option<Arc<TpState>>,
}

/// The tensor-parallel state shared by every child of an [`Init`].
#[derive(Debug)]
struct TpState {
    group: ProcessGroup,
    plan: TpPlan,
    /// Which rules matched a layer built here.
    used: Mutex<Vec<bool>>,
    /// Layers whose parameters were created replicated although a splitting rule names them.
    conflicts: Mutex<Vec<String>>,
    /// Parameters used on sequence shards (their gradients are summed over the group).
    sequence_params: Arc<Mutex<Vec<ParamId>>>,
    /// Sharded parameters: the dimension and this rank's part of it.
    shards: Arc<Mutex<HashMap<ParamId, (usize, Shard)>>>,
}

impl Init {
    /// The root context: names are used as given, every parameter is replicated.
    pub fn new(seed: u64, device: &Device) -> Self {
        Self {
            seed,
            prefix: String::new(),
            device: device.clone(),
            tp: None,
        }
    }

    /// Applies the tensor-parallel `plan` over `group` to every layer built from this context.
    ///
    /// # Errors
    /// [`TpError::Plan`] for a malformed plan; [`TpError::Collective`] when the device's backend
    /// is not supported by this build ([`crate::autograd::check_device`]).
    pub fn with_tp(mut self, group: &ProcessGroup, plan: TpPlan) -> TpResult<Self> {
        plan.validate()?;
        crate::autograd::check_device(&self.device)?;
        self.tp = Some(Arc::new(TpState {
            group: group.clone(),
            used: Mutex::new(vec![false; plan.rules().len()]),
            plan,
            conflicts: Mutex::new(Vec::new()),
            sequence_params: Arc::new(Mutex::new(Vec::new())),
            shards: Arc::new(Mutex::new(HashMap::new())),
        }));
        Ok(self)
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
            prefix: self.path(&segment.to_string()),
            ..self.clone()
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

    /// The tensor-parallel context of the model being built: what its forward pass needs
    /// (the group, whether sequence parallelism is on) and its training step needs (the
    /// parameters whose gradients are summed over the group). Single-device when no plan is set.
    pub fn context(&self) -> TpContext {
        match &self.tp {
            None => TpContext::single(),
            Some(tp) => TpContext {
                group: Some(tp.group.clone()),
                sequence_parallel: tp.plan.sequence_parallel && tp.group.size() > 1,
                sequence_params: tp.sequence_params.clone(),
                shards: tp.shards.clone(),
            },
        }
    }

    /// The style the plan gives the layer at `layer`, recording the use.
    fn style_of(&self, layer: &str) -> Option<(&TpState, TpStyle)> {
        let tp = self.tp.as_deref()?;
        let (index, style) = tp.plan.lookup(layer)?;
        tp.used.lock().expect("plan bookkeeping")[index] = true;
        Some((tp, style))
    }

    /// A replicated parameter `name` of this context's layer: a splitting rule naming the layer
    /// is a conflict ([`Self::finish`] reports it), a sequence-norm rule registers it.
    fn replicated<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        init: Initializer,
    ) -> Param<Tensor<D>> {
        let path = self.path(name);
        let param: Param<Tensor<D>> =
            param_from_data(init.full(self.seed, &path, &shape), &self.device);
        let layer = path.rsplit_once('.').map_or("", |(layer, _)| layer);
        match self.style_of(layer) {
            Some((tp, TpStyle::SequenceNorm)) if D != 1 => {
                tp.conflicts.lock().expect("plan bookkeeping").push(format!(
                    "`{layer}` is planned sequence_norm but its parameter `{name}` has {D} \
                     dimensions (sequence_norm is for the 1-D weights and biases of norms)"
                ));
            }
            Some((tp, TpStyle::SequenceNorm))
                if tp.plan.sequence_parallel && tp.group.size() > 1 =>
            {
                tp.sequence_params
                    .lock()
                    .expect("plan bookkeeping")
                    .push(param.id);
            }
            Some((tp, style @ (TpStyle::Colwise | TpStyle::Rowwise | TpStyle::Vocab))) => {
                tp.conflicts.lock().expect("plan bookkeeping").push(format!(
                    "`{}` is planned {style} but its parameter `{name}` was created replicated \
                     (build the layer with Init::linear or Init::embedding)",
                    layer
                ));
            }
            _ => {}
        }
        param
    }

    /// A Normal(0, `std`) parameter named `prefix.name`.
    pub fn normal<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        std: f64,
    ) -> Param<Tensor<D>> {
        self.replicated(name, shape, Initializer::Normal { std })
    }

    /// A uniform parameter in `[low, high)` named `prefix.name`.
    pub fn uniform<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        low: f64,
        high: f64,
    ) -> Param<Tensor<D>> {
        self.replicated(name, shape, Initializer::Uniform { low, high })
    }

    /// A parameter of ones (norm weights).
    pub fn ones<const D: usize>(&self, shape: [usize; D]) -> Param<Tensor<D>> {
        self.replicated("weight", shape, Initializer::Constant(1.0))
    }

    /// A parameter of zeros (biases).
    pub fn zeros<const D: usize>(&self, shape: [usize; D]) -> Param<Tensor<D>> {
        self.replicated("bias", shape, Initializer::Constant(0.0))
    }

    /// The plan's decision for the layer this context is at, for the layers of [`crate::nn`]:
    /// `(group, style, sequence parallel, vocab multiple)`; `None` when single-device or
    /// replicated.
    pub(crate) fn layer_split(&self) -> Option<(ProcessGroup, TpStyle, bool, usize)> {
        let (tp, style) = self.style_of(&self.prefix)?;
        if tp.group.size() == 1 {
            return None;
        }
        Some((
            tp.group.clone(),
            style,
            tp.plan.sequence_parallel,
            tp.plan.vocab_multiple,
        ))
    }

    /// A parameter with the values of `init` for the tensor `prefix.name` of full `shape`,
    /// keeping only `shard` of dimension `dim` (all of it for `None`).
    pub(crate) fn param_part<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        init: Initializer,
        part: Option<(usize, &Shard)>,
    ) -> Param<Tensor<D>> {
        let path = self.path(name);
        let data = match part {
            None => init.full(self.seed, &path, &shape),
            Some((dim, shard)) => init.shard(self.seed, &path, &shape, dim, shard),
        };
        let param: Param<Tensor<D>> = param_from_data(data, &self.device);
        if let (Some((dim, shard)), Some(tp)) = (part, &self.tp) {
            tp.shards
                .lock()
                .expect("plan bookkeeping")
                .insert(param.id, (dim, *shard));
        }
        param
    }

    /// Ends the construction of a model: checks that every rule of the plan matched a layer
    /// and that no planned layer was built replicated.
    ///
    /// # Errors
    /// [`TpError::Plan`] naming each rule that matched nothing (a typo in a path, or a layer
    /// built without this context) and each conflict.
    pub fn finish(&self) -> TpResult<()> {
        let Some(tp) = &self.tp else { return Ok(()) };
        let used = tp.used.lock().expect("plan bookkeeping");
        let mut problems: Vec<String> = tp
            .plan
            .rules()
            .iter()
            .zip(used.iter())
            .filter(|(_, used)| !**used)
            .map(|(rule, _)| {
                format!(
                    "rule `{}` ({}) matched no layer built through burn_parallel::init::Init",
                    rule.glob.as_str(),
                    rule.style
                )
            })
            .collect();
        problems.extend(
            tp.conflicts
                .lock()
                .expect("plan bookkeeping")
                .iter()
                .cloned(),
        );
        if problems.is_empty() {
            Ok(())
        } else {
            Err(TpError::Plan(problems.join("; ")))
        }
    }
}

/// The shape and initialisation of a linear layer for [`Init::linear`].
///
/// [`LinearInit::new`] is GPT-2's (Normal(0, 0.02) weights, no bias); [`LinearInit::burn`] and
/// `LinearInit::try_from(&LinearConfig)` keep Burn's `LinearConfig` distributions, so a model
/// ported from `burn::nn::Linear` keeps how it is initialised (the values themselves come from
/// the seed and the parameter's path, the same under every split).
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn_parallel::init::{Initializer, LinearInit};
///
/// let ours = LinearInit::try_from(&LinearConfig::new(16, 8)).unwrap();
/// assert_eq!(ours, LinearInit::burn(16, 8));
/// assert!(ours.bias);
/// assert_eq!(ours.weight, Initializer::Uniform { low: -0.25, high: 0.25 }); // 1/sqrt(16)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearInit {
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
    /// How the weights `[d_in, d_out]` are drawn.
    pub weight: Initializer,
    /// How the bias is drawn, when there is one.
    pub bias_init: Initializer,
    /// Features are split in whole blocks of this size (the head width of attention
    /// projections, so that each rank gets whole heads); 1 for any split.
    pub block: usize,
}

impl LinearInit {
    /// `d_in -> d_out`, no bias (zeros when added), Normal(0, 0.02) weights, any split.
    pub fn new(d_in: usize, d_out: usize) -> Self {
        Self {
            d_in,
            d_out,
            bias: false,
            weight: Initializer::Normal { std: 0.02 },
            bias_init: Initializer::Constant(0.0),
            block: 1,
        }
    }

    /// Burn's `LinearConfig::new(d_in, d_out)`: a bias, and weights and bias uniform in
    /// `±1/sqrt(d_in)` (Kaiming-uniform with gain `1/sqrt(3)`).
    pub fn burn(d_in: usize, d_out: usize) -> Self {
        let a = 1.0 / (d_in as f64).sqrt();
        let uniform = Initializer::Uniform { low: -a, high: a };
        Self {
            bias: true,
            weight: uniform,
            bias_init: uniform,
            ..Self::new(d_in, d_out)
        }
    }

    /// With or without a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Normal(0, `std`) weights.
    pub fn with_std(mut self, std: f64) -> Self {
        self.weight = Initializer::Normal { std };
        self
    }

    /// Splits in whole blocks of `block` features (attention heads).
    pub fn with_block(mut self, block: usize) -> Self {
        self.block = block;
        self
    }
}

/// Burn's `LinearConfig` as a [`LinearInit`]: its sizes, its bias and its initializer's
/// distribution (fans `d_input` and `d_output`, for the weights and the bias alike, as Burn
/// draws them). Its `layout` does not matter: the weights are `[d_in, d_out]` here.
impl TryFrom<&burn::nn::LinearConfig> for LinearInit {
    type Error = crate::Error;

    /// # Errors
    /// [`crate::Error::Invalid`] for an initializer with no per-element form: orthogonal
    /// weights (a QR of the whole matrix) and a Normal of non-zero mean.
    fn try_from(config: &burn::nn::LinearConfig) -> Result<Self, Self::Error> {
        use burn::nn::Initializer as Burn;
        let (fan_in, fan_out) = (config.d_input as f64, config.d_output as f64);
        let uniform = |a: f64| Initializer::Uniform { low: -a, high: a };
        let kaiming = |fan_out_only: bool| 1.0 / if fan_out_only { fan_out } else { fan_in }.sqrt();
        let xavier = (2.0 / (fan_in + fan_out)).sqrt();
        let init = match config.initializer.clone() {
            Burn::Constant { value } => Initializer::Constant(value as f32),
            Burn::Ones => Initializer::Constant(1.0),
            Burn::Zeros => Initializer::Constant(0.0),
            Burn::Uniform { min, max } => Initializer::Uniform {
                low: min,
                high: max,
            },
            Burn::Normal { mean: 0.0, std } => Initializer::Normal { std },
            Burn::KaimingUniform { gain, fan_out_only } => {
                uniform(3f64.sqrt() * gain * kaiming(fan_out_only))
            }
            Burn::KaimingNormal { gain, fan_out_only } => Initializer::Normal {
                std: gain * kaiming(fan_out_only),
            },
            Burn::XavierUniform { gain } => uniform(3f64.sqrt() * gain * xavier),
            Burn::XavierNormal { gain } => Initializer::Normal { std: gain * xavier },
            other => {
                return Err(crate::Error::invalid(
                    "LinearConfig::initializer",
                    format!(
                        "{other:?} has no per-element form that every split draws alike; use a \
                         Normal of mean 0, a uniform, Kaiming or Xavier initializer"
                    ),
                ));
            }
        };
        Ok(Self {
            d_in: config.d_input,
            d_out: config.d_output,
            bias: config.bias,
            weight: init,
            bias_init: init,
            block: 1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(d: &TensorData) -> Vec<f32> {
        d.try_to_vec::<f32>().unwrap()
    }

    /// Burn's `LinearConfig` keeps its distributions: the default Kaiming-uniform (weights and
    /// bias in `±1/sqrt(d_in)`), Xavier's and Kaiming's by the fans Burn uses, a plain Normal;
    /// what has no per-element form is refused naming the field.
    #[test]
    fn burn_linear_configs_keep_their_distributions() {
        use burn::nn::{Initializer as Burn, LinearConfig};
        let config = LinearConfig::new(9, 4);
        let ours = LinearInit::try_from(&config).unwrap();
        let third = 1.0 / 3.0;
        assert_eq!(
            ours.weight,
            Initializer::Uniform {
                low: -third,
                high: third
            }
        );
        assert_eq!((ours.bias, ours.bias_init), (true, ours.weight));
        let xavier = config
            .clone()
            .with_initializer(Burn::XavierNormal { gain: 2.0 });
        let std = 2.0 * (2.0f64 / 13.0).sqrt();
        let xavier = LinearInit::try_from(&xavier).unwrap().weight;
        assert_eq!(xavier, Initializer::Normal { std });
        let fan_out = Burn::KaimingNormal {
            gain: 1.0,
            fan_out_only: true,
        };
        let fan_out = LinearInit::try_from(&config.clone().with_initializer(fan_out)).unwrap();
        assert_eq!(fan_out.weight, Initializer::Normal { std: 0.5 });
        let no_bias = config.clone().with_bias(false);
        assert!(!LinearInit::try_from(&no_bias).unwrap().bias);
        let orthogonal = config.with_initializer(Burn::Orthogonal { gain: 1.0 });
        let err = LinearInit::try_from(&orthogonal).unwrap_err().to_string();
        assert!(err.contains("LinearConfig::initializer"), "{err}");
        // The layer itself: its values in the range, a bias, whatever the split.
        let device = burn::tensor::Device::flex();
        let linear = Init::new(3, &device)
            .linear("l", LinearInit::burn(9, 4))
            .unwrap();
        let values = linear.weight.val().into_data().try_to_vec::<f32>().unwrap();
        assert!(values.iter().all(|v| v.abs() <= third as f32), "{values:?}");
        let bias = linear
            .bias
            .expect("a bias")
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert!(bias.iter().all(|v| v.abs() <= third as f32) && bias.iter().any(|v| *v != 0.0));
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
