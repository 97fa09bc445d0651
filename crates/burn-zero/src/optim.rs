//! A sharded optimizer: any Burn [`Optimizer`] (Adam, AdamW, SGD...) applied to flat shards.
//!
//! Burn's element-wise optimizers update every element from its own gradient and state, so
//! applying Burn's own `step` to a rank's contiguous slice of the flat parameter space gives,
//! element by element, exactly the update the unsharded optimizer would give: there is no
//! re-implementation of the formulas to drift from Burn's (bias correction, epsilon placement,
//! decoupled decay all come from burn-optim). Optimizers that are *not* element-wise (LAMB's
//! per-tensor trust ratio, Muon's orthogonalisation, Adafactor's factored moments) would see a
//! flat slice instead of a tensor: the [`ElementWise`] bound refuses them at compile time.
//!
//! With offload, the state lives on the host (Burn's `flex` CPU backend) and the update runs
//! there; parameters and gradients are copied host-side for the update and the new parameters
//! copied back (DeepSpeed's ZeRO-Offload of the optimizer).

use std::collections::BTreeMap;

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};
use serde_json::Value;

use crate::error::{Result, ZeroError};

/// An optimizer that updates every element from its own gradient and state alone, so that
/// applying it to a contiguous slice of the flattened parameters gives exactly the update of
/// the whole tensors. ZeRO-1/2 ([`ShardedOptimizer`], [`crate::ZeroOptimizer`]) accepts only
/// these: an optimizer that needs the shape of a
/// parameter (LAMB's per-tensor trust ratio, Muon's orthogonalised 2-D updates, Adafactor's
/// factored moments, L-BFGS) would be handed a flat 1-D slice and compute something else, so it
/// is refused when the program is compiled, with a message that says why.
///
/// Implemented for Burn's Adam, AdamW, SGD, RMSProp, AdaGrad, Lion and Adan. Implement it for
/// your own optimizer only if its update of an element depends on nothing but that element.
///
/// ```compile_fail
/// use burn::optim::LambConfig;
/// use burn_zero::optim::ShardedOptimizer;
/// // LAMB scales each tensor's update by a per-tensor trust ratio: refused.
/// let optim = ShardedOptimizer::new(LambConfig::new().build(), 1);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an element-wise optimizer: ZeRO and FSDP apply it to flat 1-D \
               slices of the parameters, where an optimizer that needs each tensor's shape \
               computes a different update",
    note = "use Adam, AdamW, SGD, RMSProp, AdaGrad, Lion or Adan with ZeRO/FSDP; keep LAMB, \
            Muon, Adafactor and L-BFGS to DDP or tensor parallelism; implement \
            burn_zero::optim::ElementWise for your own optimizer only if it is element-wise"
)]
pub trait ElementWise: Optimizer {}

impl ElementWise for burn::optim::Adam {}
impl ElementWise for burn::optim::AdamW {}
impl ElementWise for burn::optim::Sgd {}
impl ElementWise for burn::optim::RmsProp {}
impl ElementWise for burn::optim::AdaGrad {}
impl ElementWise for burn::optim::Lion {}
impl ElementWise for burn::optim::Adan {}

/// Per-unit state of a Burn optimizer over flat shards.
///
/// # Example
/// ```
/// use burn::optim::AdamWConfig;
/// use burn::tensor::Device;
/// use burn_zero::flat::tensor_1d;
/// use burn_zero::optim::ShardedOptimizer;
///
/// let device = Device::flex();
/// let mut optim = ShardedOptimizer::new(AdamWConfig::new().build(), 1);
/// let p = tensor_1d(vec![1.0, 2.0], &device);
/// let g = tensor_1d(vec![0.5, -0.5], &device);
/// let p = optim.step(0, 0.1, p, g);
/// assert_eq!(p.dims(), [2]);
/// assert_eq!(optim.state_bytes(), 2 * 2 * 4); // two moments of two f32
/// ```
pub struct ShardedOptimizer<O: ElementWise> {
    optim: O,
    states: Vec<Option<O::State<1>>>,
    state_bytes: Vec<usize>,
    offload: bool,
}

impl<O: ElementWise> ShardedOptimizer<O> {
    /// `optim` over `units` flat shards (one state per shard).
    pub fn new(optim: O, units: usize) -> Self {
        Self {
            optim,
            states: (0..units).map(|_| None).collect(),
            state_bytes: vec![0; units],
            offload: false,
        }
    }

    /// Keeps the state on the host and runs the update there.
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }

    /// Whether the state is offloaded to the host.
    pub fn offload(&self) -> bool {
        self.offload
    }

    /// Number of shards.
    pub fn units(&self) -> usize {
        self.states.len()
    }

    /// One optimizer step of shard `unit`: `param` and `grad` are 1-D tensors of the same
    /// length on a non-autodiff device; returns the new parameters on `param`'s device.
    ///
    /// # Panics
    /// When `unit` is out of range.
    pub fn step(
        &mut self,
        unit: usize,
        lr: LearningRate,
        param: Tensor<1>,
        grad: Tensor<1>,
    ) -> Tensor<1> {
        let device = param.device();
        let (param, grad) = if self.offload {
            let host = Device::flex();
            (param.to_device(&host), grad.to_device(&host))
        } else {
            (param, grad)
        };
        let state = self.states[unit].take();
        let fresh = state.is_none();
        let (param, state) = self.optim.step(lr, param, grad, state);
        if fresh && let Some(s) = &state {
            self.state_bytes[unit] = tensor_bytes(s);
        }
        self.states[unit] = state;
        if self.offload {
            param.to_device(&device)
        } else {
            param
        }
    }

    /// Bytes of optimizer state held by this rank (over all shards).
    pub fn state_bytes(&self) -> usize {
        self.state_bytes.iter().sum()
    }

    /// The state of shard `unit` as named tensors (all of the shard's length) and scalars.
    pub fn export(&self, unit: usize) -> (Vec<(String, TensorData)>, BTreeMap<String, Value>) {
        let mut sink = StateSink::default();
        if let Some(state) = &self.states[unit] {
            state.state_flatten("", &mut sink);
        }
        let scalars = sink
            .scalars
            .into_iter()
            .map(|(k, v)| (k, scalar_to_json(v)))
            .collect();
        (sink.tensors, scalars)
    }

    /// Restores the state of shard `unit` from named tensors and scalars (as given by
    /// [`ShardedOptimizer::export`], re-sliced for this rank). No tensors means "no state yet".
    ///
    /// # Errors
    /// [`ZeroError::Config`] when the entries do not form a state of this optimizer, or a
    /// tensor's length is not `len`.
    pub fn import(
        &mut self,
        unit: usize,
        tensors: Vec<(String, TensorData)>,
        scalars: &BTreeMap<String, Value>,
        len: usize,
        device: &Device,
    ) -> Result<()> {
        if tensors.is_empty() {
            self.states[unit] = None;
            self.state_bytes[unit] = 0;
            return Ok(());
        }
        let mut parsed = BTreeMap::new();
        for (k, v) in scalars {
            parsed.insert(
                k.clone(),
                scalar_from_json(v).ok_or_else(|| {
                    ZeroError::Config(format!(
                        "optimizer scalar {k} = {v} is not a number or bool"
                    ))
                })?,
            );
        }
        let mut source = StateSource::new(parsed);
        for (name, data) in tensors {
            if data.shape().num_elements() != len {
                return Err(ZeroError::Config(format!(
                    "optimizer state tensor {name} has {} elements but the shard has {len}",
                    data.shape().num_elements()
                )));
            }
            source.insert_tensor(name, data);
        }
        let device = if self.offload {
            Device::flex()
        } else {
            device.clone()
        };
        let state = <O::State<1> as RecordState>::state_unflatten("", &mut source, &device)
            .ok_or_else(|| {
                ZeroError::Config(
                    "the saved optimizer state lacks entries this optimizer needs: was it saved \
                     with another optimizer (Adam vs SGD, AMSGrad on/off)?"
                        .into(),
                )
            })?;
        self.state_bytes[unit] = tensor_bytes(&state);
        self.states[unit] = Some(state);
        Ok(())
    }
}

fn tensor_bytes<S: RecordState>(state: &S) -> usize {
    let mut sink = StateSink::default();
    state.state_flatten("", &mut sink);
    sink.tensors.iter().map(|(_, d)| d.as_bytes().len()).sum()
}

use burn_parallel::checkpoint::{scalar_from_json, scalar_json as scalar_to_json};
