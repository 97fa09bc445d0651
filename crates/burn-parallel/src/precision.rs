//! Mixed-precision policy: parameters and compute in a low-precision dtype, fp32 master weights
//! and optimizer state, a configurable reduction dtype, and dynamic loss scaling for f16. One
//! policy for every layout: [`crate::train::TrainStep::with_precision`] (one device, DDP,
//! TP/SP, FSDP units that are modules) and burn-zero's engines take the same types.
//!
//! Under [`TrainStep`](crate::train::TrainStep) the module keeps fp32 parameters (the master
//! weights, which the optimizer updates with fp32 state); each step runs the forward on a
//! *compute copy* ([`MixedPrecision::compute_copy`]) whose parameters are the fp32 ones cast
//! to `param_dtype`, tracked: the casts' backward brings the low-precision gradients back to
//! fp32 on the master parameters, as PyTorch's autocast and FSDP's `MixedPrecision` do. The
//! gradients are then reduced across data-parallel ranks in `reduce_dtype`.
//!
//! burn-zero's stages 1 and 2 (`burn_zero::ZeroOptimizer`): the module's parameters live in `param_dtype`
//! (full, on every rank: they are what the forward reads), the fp32 master copy of this rank's
//! shard lives in the wrapper next to its fp32 optimizer state. Low-precision gradients are
//! summed over micro-steps in an fp32 host buffer, reduced in `reduce_dtype` (half the bytes on
//! the wire with bf16/f16), unscaled and clipped in fp32, applied to the fp32 master shard, and
//! the new shard is cast to `param_dtype` *before* the all-gather.
//!
//! Where the casts sit (burn-zero's stage 3): the fp32 master shard is the leaf the optimizer updates; it is
//! cast to `param_dtype` *before* the all-gather when `reduce_dtype == param_dtype` (half the
//! bytes on the wire both ways: the backward reduce-scatter then runs in `param_dtype`), or
//! *after* it when `reduce_dtype` is `f32` (the gather and the gradient reduce-scatter run in
//! fp32, the cast's backward turning low-precision gradients into fp32 first).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::comm::host::ReduceOp;
use crate::group::ProcessGroup;

/// What is wrong with a precision policy or a loss scaler.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PrecisionError {
    /// The requested dtype cannot be used on this device.
    #[error("dtype {dtype:?} is not supported on device {device}: {hint}")]
    UnsupportedDType {
        /// The dtype asked for.
        dtype: DType,
        /// The device, as text.
        device: String,
        /// What to use instead.
        hint: String,
    },
    /// The configuration cannot work (says why).
    #[error("invalid mixed-precision setting: {0}")]
    Config(String),
    /// The overflow check's all-reduce failed.
    #[error(transparent)]
    Collective(#[from] crate::CollectiveError),
}

/// Result of the precision policy's checks.
pub type Result<T> = std::result::Result<T, PrecisionError>;

/// Which dtypes training computes and reduces in. Master weights and optimizer state are
/// always `f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecision {
    /// Dtype of the gathered parameters, hence of the forward and backward compute.
    pub param_dtype: DType,
    /// Dtype of the gradient reduction (`F32` or `param_dtype`).
    pub reduce_dtype: DType,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        Self::full()
    }
}

impl MixedPrecision {
    /// Everything in fp32 (the reference).
    pub fn full() -> Self {
        Self {
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
        }
    }

    /// bf16 compute and bf16 gradient reduction, fp32 master weights.
    pub fn bf16() -> Self {
        Self {
            param_dtype: DType::BF16,
            reduce_dtype: DType::BF16,
        }
    }

    /// f16 compute with fp32 reduction; pair it with a [`LossScaler`].
    pub fn f16() -> Self {
        Self {
            param_dtype: DType::F16,
            reduce_dtype: DType::F32,
        }
    }

    /// The same policy with gradients reduced in `dtype` (`F32`, or the parameter dtype).
    pub fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = dtype;
        self
    }

    /// Whether this policy changes anything.
    pub fn is_full(&self) -> bool {
        self.param_dtype == DType::F32 && self.reduce_dtype == DType::F32
    }

    /// The model the forward runs on: `model` itself when `param_dtype` is f32, else a copy
    /// whose float parameters are those of `model` cast to `param_dtype`. The casts are
    /// recorded by autodiff: the backward of a loss computed on the copy brings the gradients
    /// back to fp32 on `model`'s own parameters (the master weights), where
    /// `GradientsParams::from_grads(grads, &model)` finds them and the optimizer updates them
    /// with fp32 state. The copy holds the cast parameters only while it lives (one step).
    ///
    /// ```
    /// use burn::tensor::{DType, Device};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::precision::MixedPrecision;
    ///
    /// let device = Device::flex().autodiff();
    /// let model = Init::new(1, &device).linear("fc", LinearInit::new(4, 2)).unwrap();
    /// let compute = MixedPrecision::bf16().compute_copy(&model);
    /// assert_eq!(compute.weight.val().dtype(), DType::BF16);
    /// let x = burn::tensor::Tensor::<2>::ones([3, 4], (&device, DType::BF16));
    /// let grads = compute.forward(x).unwrap().sum().backward();
    /// let g = model.weight.val().grad(&grads).unwrap();
    /// assert_eq!(g.dtype(), DType::F32); // on the fp32 master weight
    /// ```
    pub fn compute_copy<M: Module>(&self, model: &M) -> M {
        struct Cast(DType);
        impl ModuleMapper for Cast {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let dtype = self.0;
                param.map(|t| if t.dtype() == dtype { t } else { t.cast(dtype) })
            }
        }
        if self.param_dtype == DType::F32 {
            return model.clone();
        }
        model.clone().map(&mut Cast(self.param_dtype))
    }

    /// Checks the policy and that `device` supports its dtypes.
    ///
    /// # Errors
    /// [`PrecisionError::UnsupportedDType`] naming the dtype and what to use instead;
    /// [`PrecisionError::Config`] for a reduction dtype that is neither f32 nor the parameter
    /// dtype.
    pub fn validate(&self, device: &Device) -> Result<()> {
        for dtype in [self.param_dtype, self.reduce_dtype] {
            if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Err(PrecisionError::Config(format!(
                    "mixed precision supports f32, bf16 and f16, not {dtype:?}"
                )));
            }
            if !device.supports_dtype(dtype) {
                return Err(PrecisionError::UnsupportedDType {
                    dtype,
                    device: format!("{device:?}"),
                    hint: "use MixedPrecision::full(), or a dtype this backend supports \
                           (bf16 on CUDA/Metal, f16 on most GPUs)"
                        .into(),
                });
            }
        }
        if self.reduce_dtype != DType::F32 && self.reduce_dtype != self.param_dtype {
            return Err(PrecisionError::Config(format!(
                "reduce_dtype must be F32 or the param_dtype ({:?}), not {:?}",
                self.param_dtype, self.reduce_dtype
            )));
        }
        Ok(())
    }
}

/// Dynamic loss scaling for f16 (as `torch.amp.GradScaler`): multiply the loss by `scale`
/// before `backward`, divide the gradients by it before clipping and the update; on an overflow
/// (any inf/NaN in the gradient, on any rank) skip the step (weights and optimizer state stay
/// untouched) and multiply the scale by `backoff_factor`; after `growth_interval` clean steps in
/// a row multiply it by `growth_factor`.
///
/// The trainers own the scaler: [`crate::train::TrainStep::with_loss_scaler`] scales the loss
/// itself and reports [`crate::train::StepOutput::skipped`]; burn-zero's engines take one in
/// `ZeroConfig::loss_scaler` (scale the loss with the wrapper's `loss_scale()` before
/// `backward`, and read `StepInfo::skipped`).
/// With powers of two as scale and factors (the defaults), scaling and unscaling are exact in
/// floating point: an fp32 run with a scaler gives the same losses as one without.
///
/// ```
/// use burn_parallel::precision::LossScaler;
/// let mut s = LossScaler::new(1024.0).with_growth_interval(2);
/// assert!(!s.update(true)); // overflow: skip the step
/// assert_eq!(s.scale(), 512.0);
/// assert!(s.update(false) && s.update(false)); // two clean steps: grow
/// assert_eq!(s.scale(), 1024.0);
/// assert_eq!(s.skipped(), 1);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: usize,
    min_scale: f64,
    good_steps: usize,
    skipped: usize,
}

impl LossScaler {
    /// A scaler starting at `scale` (65536 is customary for f16), doubling after 2000 clean
    /// steps, halving on each overflow, never below 1. Check it with [`LossScaler::validate`]
    /// (the wrappers do).
    pub fn new(scale: f64) -> Self {
        Self {
            scale,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
            good_steps: 0,
            skipped: 0,
        }
    }

    /// Sets the number of clean steps in a row before the scale grows (at least 1).
    pub fn with_growth_interval(mut self, steps: usize) -> Self {
        self.growth_interval = steps.max(1);
        self
    }

    /// Sets the factors of growth (> 1) and back-off (in (0, 1)).
    pub fn with_factors(mut self, growth: f64, backoff: f64) -> Self {
        self.growth_factor = growth;
        self.backoff_factor = backoff;
        self
    }

    /// Sets the smallest scale the back-off may reach (default 1).
    pub fn with_min_scale(mut self, min_scale: f64) -> Self {
        self.min_scale = min_scale;
        self
    }

    /// Checks that the scale and factors can work.
    ///
    /// # Errors
    /// [`PrecisionError::Config`] for a scale or minimum that is not positive and finite, a growth
    /// factor not above 1 or a back-off factor outside (0, 1).
    pub fn validate(&self) -> Result<()> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.scale) || !positive(self.min_scale) {
            return Err(PrecisionError::Config(format!(
                "loss scale {} and minimum {} must be positive and finite",
                self.scale, self.min_scale
            )));
        }
        let growth_ok = self.growth_factor.is_finite() && self.growth_factor > 1.0;
        let backoff_ok = self.backoff_factor > 0.0 && self.backoff_factor < 1.0;
        if !growth_ok || !backoff_ok {
            return Err(PrecisionError::Config(format!(
                "loss-scale growth factor {} must be > 1 and back-off factor {} in (0, 1)",
                self.growth_factor, self.backoff_factor
            )));
        }
        Ok(())
    }

    /// The current scale: multiply the loss by it before `backward`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped because of overflows so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Clean steps since the last overflow or growth.
    pub fn good_steps(&self) -> usize {
        self.good_steps
    }

    /// Clean steps in a row before the scale grows.
    pub fn growth_interval(&self) -> usize {
        self.growth_interval
    }

    /// The factors of growth and back-off, in that order.
    pub fn factors(&self) -> (f64, f64) {
        (self.growth_factor, self.backoff_factor)
    }

    /// What changes while training (scale, clean-step counter, skipped steps), for a
    /// checkpoint: the same on every rank, so it belongs to the trainer's state. The factors
    /// and interval are configuration and stay with the run.
    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            scale: self.scale,
            good_steps: self.good_steps,
            skipped: self.skipped,
        }
    }

    /// Restores the state [`LossScaler::state`] saved, so that a resumed run scales its next
    /// loss, and grows or backs off, exactly as the uninterrupted run would.
    ///
    /// # Arguments
    /// * `state` - the saved state.
    ///
    /// # Errors
    /// [`PrecisionError::Config`] when the saved scale is not positive and finite (a corrupt or
    /// foreign trainer state); the scaler is left unchanged.
    ///
    /// # Example
    /// ```
    /// use burn_parallel::precision::LossScaler;
    /// let mut run = LossScaler::new(1024.0).with_growth_interval(2);
    /// run.update(true); // an overflow: 512
    /// run.update(false); // one clean step
    /// let mut resumed = LossScaler::new(1024.0).with_growth_interval(2);
    /// resumed.restore(&run.state()).unwrap();
    /// assert_eq!(resumed, run);
    /// assert!(resumed.update(false)); // the second clean step: grows, as `run` would
    /// assert_eq!(resumed.scale(), 1024.0);
    /// ```
    pub fn restore(&mut self, state: &LossScalerState) -> Result<()> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(PrecisionError::Config(format!(
                "a saved loss scale of {} cannot be restored (it must be positive and finite): \
                 the trainer state is corrupt or not a loss scaler's",
                state.scale
            )));
        }
        self.scale = state.scale;
        self.good_steps = state.good_steps;
        self.skipped = state.skipped;
        Ok(())
    }

    /// Whether any rank of `group` saw a non-finite value in its gradient shard.
    ///
    /// # Errors
    /// When the all-reduce fails.
    pub fn found_overflow(&self, local: &[f32], group: &ProcessGroup) -> Result<bool> {
        let bad = local.iter().any(|v| !v.is_finite());
        let any = group.all_reduce_f32(vec![f32::from(u8::from(bad))], ReduceOp::Max)?;
        Ok(any[0] > 0.0)
    }

    /// Updates the scale after a step whose gradients did (`overflow`) or did not overflow;
    /// returns whether the step should be applied.
    pub fn update(&mut self, overflow: bool) -> bool {
        if overflow {
            self.scale = (self.scale * self.backoff_factor).max(self.min_scale);
            self.good_steps = 0;
            self.skipped += 1;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale *= self.growth_factor;
            self.good_steps = 0;
        }
        true
    }
}

/// The state of a [`LossScaler`] that training changes ([`LossScaler::state`]), serialisable
/// into a checkpoint's trainer state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub scale: f64,
    /// Clean steps since the last overflow or growth.
    pub good_steps: usize,
    /// Steps skipped because of overflows so far.
    pub skipped: usize,
}
