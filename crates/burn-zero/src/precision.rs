//! Mixed-precision policy: parameters and compute in a low-precision dtype, fp32 master weights
//! and optimizer state, a configurable reduction dtype, and dynamic loss scaling for f16.
//!
//! Where the casts sit (stage 3): the fp32 master shard is the leaf the optimizer updates; it is
//! cast to `param_dtype` *before* the all-gather when `reduce_dtype == param_dtype` (half the
//! bytes on the wire both ways: the backward reduce-scatter then runs in `param_dtype`), or
//! *after* it when `reduce_dtype` is `f32` (the gather and the gradient reduce-scatter run in
//! fp32, the cast's backward turning low-precision gradients into fp32 first).

use burn::tensor::{DType, Device};
use burn_parallel::{ProcessGroup, ReduceOp};

use crate::error::{Result, ZeroError};

/// Which dtypes the wrapper computes and reduces in. Master weights and optimizer state are
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

    /// Whether this policy changes anything.
    pub fn is_full(&self) -> bool {
        self.param_dtype == DType::F32 && self.reduce_dtype == DType::F32
    }

    /// Checks the policy and that `device` supports its dtypes.
    ///
    /// # Errors
    /// [`ZeroError::UnsupportedDType`] naming the dtype and what to use instead;
    /// [`ZeroError::Config`] for a reduction dtype that is neither f32 nor the parameter dtype.
    pub fn validate(&self, device: &Device) -> Result<()> {
        for dtype in [self.param_dtype, self.reduce_dtype] {
            if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Err(ZeroError::Config(format!(
                    "mixed precision supports f32, bf16 and f16, not {dtype:?}"
                )));
            }
            if !device.supports_dtype(dtype) {
                return Err(ZeroError::UnsupportedDType {
                    dtype,
                    device: format!("{device:?}"),
                    hint: "use MixedPrecision::full(), or a dtype this backend supports \
                           (bf16 on CUDA/Metal, f16 on most GPUs)"
                        .into(),
                });
            }
        }
        if self.reduce_dtype != DType::F32 && self.reduce_dtype != self.param_dtype {
            return Err(ZeroError::Config(format!(
                "reduce_dtype must be F32 or the param_dtype ({:?}), not {:?}",
                self.param_dtype, self.reduce_dtype
            )));
        }
        Ok(())
    }
}

/// Dynamic loss scaling for f16 (as `torch.amp.GradScaler`): multiply the loss by `scale`,
/// divide gradients by it; on an overflow (any inf/NaN on any rank) skip the step and halve the
/// scale; after `growth_interval` clean steps double it.
///
/// ```
/// use burn_zero::precision::LossScaler;
/// let mut s = LossScaler::new(1024.0);
/// assert!(!s.update(true)); // overflow: skip the step
/// assert_eq!(s.scale(), 512.0);
/// ```
#[derive(Debug, Clone)]
pub struct LossScaler {
    scale: f64,
    growth_interval: usize,
    good_steps: usize,
    skipped: usize,
}

impl LossScaler {
    /// A scaler starting at `scale` (65536 is customary), growing every 2000 clean steps.
    pub fn new(scale: f64) -> Self {
        Self {
            scale,
            growth_interval: 2000,
            good_steps: 0,
            skipped: 0,
        }
    }

    /// Sets the number of clean steps before the scale doubles.
    pub fn with_growth_interval(mut self, steps: usize) -> Self {
        self.growth_interval = steps.max(1);
        self
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped because of overflows so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Whether any rank of `group` saw a non-finite value in its (unscaled) gradient shard.
    ///
    /// # Errors
    /// When the all-reduce fails.
    pub fn found_overflow(&self, local: &[f32], group: &ProcessGroup) -> Result<bool> {
        let bad = local.iter().any(|v| !v.is_finite());
        let any = group.all_reduce_f32(vec![f32::from(u8::from(bad))], ReduceOp::Max)?;
        Ok(any[0] > 0.0)
    }

    /// Updates the scale after a step; returns whether the step should be applied.
    pub fn update(&mut self, overflow: bool) -> bool {
        if overflow {
            self.scale = (self.scale * 0.5).max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        true
    }
}
