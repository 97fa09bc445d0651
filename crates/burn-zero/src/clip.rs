//! Global gradient-norm clipping that is correct when gradients are sharded.
//!
//! The norm of the full gradient is `sqrt(sum over ranks of the sum of squares of the rank's
//! shard)`: shards of the flat space are disjoint, so one all-reduce of one number per rank gives
//! the exact global norm (PyTorch's `clip_grad_norm_` semantics: `coef = max_norm / (norm +
//! 1e-6)`, applied only when below 1). [`crate::ZeroOptimizer`] sums each rank's squares on the
//! gradients' device (in f32, one number read); the reference here ([`clip_grads_global_norm`])
//! sums host values in `f64`.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_parallel::{ProcessGroup, ReduceOp};

use crate::error::Result;

/// Sum of squares of host values, in `f64`.
pub fn sum_of_squares(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

/// The global L2 norm from this rank's partial sum of squares over disjoint shards (`group`:
/// the ranks whose shards partition the space; a replica group must not be included).
///
/// # Errors
/// When the all-reduce fails.
pub fn global_norm(local_sum_sq: f64, group: &ProcessGroup) -> Result<f64> {
    let data = burn::tensor::TensorData::new(vec![local_sum_sq], [1]);
    let total = group.all_reduce_data(data, ReduceOp::Sum)?;
    Ok(total.try_to_vec::<f64>().expect("f64 in, f64 out")[0].sqrt())
}

/// The factor gradients are multiplied by: `min(1, max_norm / (norm + 1e-6))`.
///
/// ```
/// assert_eq!(burn_zero::clip::clip_coefficient(0.5, 1.0), 1.0);
/// assert!((burn_zero::clip::clip_coefficient(2.0, 1.0) - 0.5).abs() < 1e-6);
/// ```
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// Clips unsharded gradients (single device or DDP after the all-reduce) by their global norm;
/// returns the clipped gradients and the norm before clipping. The reference the sharded
/// clipping is tested against.
pub fn clip_grads_global_norm<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: f64,
) -> (GradientsParams, f64) {
    struct Norm<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(param.id) {
                self.1 += sum_of_squares(&crate::flat::host_f32(g));
            }
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, g * self.1);
            }
        }
    }
    let mut norm = Norm(&grads, 0.0);
    module.visit(&mut norm);
    let norm = norm.1.sqrt();
    let coef = clip_coefficient(norm, max_norm);
    if coef < 1.0 {
        module.visit(&mut Scale(&mut grads, coef as f32));
    }
    (grads, norm)
}
