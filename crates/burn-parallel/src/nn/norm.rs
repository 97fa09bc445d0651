//! LayerNorm and RMSNorm over the last dimension, composed or through the fused kernels.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::module::layer_norm;
use serde::{Deserialize, Serialize};

use crate::init::Init;
use crate::kernels;

/// Which normalisation a [`Norm`] applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormKind {
    /// Layer normalisation with weight and bias (GPT-2).
    #[default]
    LayerNorm,
    /// Root-mean-square normalisation with weight only (LLaMA).
    RmsNorm,
}

impl NormKind {
    /// Parameters of a norm of width `d`.
    pub fn num_params(self, d: usize) -> usize {
        match self {
            NormKind::LayerNorm => 2 * d,
            NormKind::RmsNorm => d,
        }
    }
}

/// LayerNorm or RMSNorm over the last dimension, with parameters `weight` (and `bias` for
/// LayerNorm). Its parameters are replicated under tensor parallelism; under sequence
/// parallelism their gradients are summed over the group (give the norm's path to
/// [`TpPlan`](crate::plan::TpPlan)'s sequence-parallel parameters, or pass the parameters
/// through [`sp_param`](crate::tensor_parallel::sp_param) and [`Norm::forward_with`]).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::init::Init;
/// use burn_parallel::nn::{Norm, NormKind};
///
/// let device = Device::flex();
/// let norm = Norm::new(NormKind::RmsNorm, 4, 1e-6, &Init::new(0, &device).at("ln"));
/// let x = Tensor::<2>::from_floats([[1.0, -1.0, 1.0, -1.0]], &device);
/// let composed = norm.forward(x.clone()).into_data();
/// composed.assert_approx_eq::<f32>(&x.clone().into_data(), burn::tensor::Tolerance::absolute(1e-5));
/// let fused = norm.forward_fused(x).into_data();
/// fused.assert_approx_eq::<f32>(&composed, burn::tensor::Tolerance::absolute(1e-5));
/// ```
#[derive(Module, Debug)]
pub struct Norm {
    /// Scale, initialised to ones.
    pub weight: Param<Tensor<1>>,
    /// Shift (LayerNorm only), initialised to zeros.
    pub bias: Option<Param<Tensor<1>>>,
    /// Which normalisation.
    #[module(skip)]
    pub kind: NormKind,
    /// Added to the variance.
    #[module(skip)]
    pub eps: f64,
}

impl Norm {
    /// A norm of width `d` (weight 1, bias 0) at `init`'s path.
    pub fn new(kind: NormKind, d: usize, eps: f64, init: &Init) -> Self {
        Self {
            weight: init.ones([d]),
            bias: match kind {
                NormKind::LayerNorm => Some(init.zeros([d])),
                NormKind::RmsNorm => None,
            },
            kind,
            eps,
        }
    }

    /// Normalises over the last dimension (composed Burn operations).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_with(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }

    /// Normalises over the last dimension with the given `weight` and `bias` (this norm's own
    /// parameters as they enter the graph, for example through a collective that sums their
    /// gradients under sequence parallelism).
    pub fn forward_with<const D: usize>(
        &self,
        x: Tensor<D>,
        weight: Tensor<1>,
        bias: Option<Tensor<1>>,
    ) -> Tensor<D> {
        match self.kind {
            NormKind::LayerNorm => layer_norm(x, weight, bias, self.eps),
            NormKind::RmsNorm => {
                let rms = (x.clone().square().mean_dim(D - 1) + self.eps).sqrt();
                x / rms * weight.unsqueeze()
            }
        }
    }

    /// [`Self::forward`] through the fused kernels ([`kernels::layer_norm`],
    /// [`kernels::rms_norm`]): one pass over the rows, forward and backward.
    ///
    /// # Panics
    /// If the last dimension of `x` is not the norm's width.
    pub fn forward_fused<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let weight = self.weight.val();
        let y = match self.kind {
            NormKind::LayerNorm => {
                kernels::layer_norm(x, weight, self.bias.as_ref().map(|b| b.val()), self.eps)
            }
            NormKind::RmsNorm => kernels::rms_norm(x, weight, self.eps),
        };
        y.unwrap_or_else(|e| panic!("fused norm: {e}"))
    }
}
