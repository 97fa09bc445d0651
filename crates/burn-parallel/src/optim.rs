//! AdamW as one fused kernel per parameter: a Burn [`Optimizer`] whose step is
//! [`kernels::adamw_step`] (one pass over the parameter, its gradient and the two moments,
//! on Flex's CPU kernel or a CubeCL kernel), where Burn's `AdamW` runs a chain of about a
//! dozen tensor operations per parameter, each a pass over memory (and, on a GPU, a launch).
//!
//! Its state is Burn's own [`AdamWState`] (`moment_1`, `moment_2`, `time`): optimizer records
//! and checkpoints written by Burn's `AdamW` load into it and the other way round, and its
//! steps are Burn's `AdamW` to rounding (`tests/kernels.rs` compares them element for element).
//! On a backend without the fused kernels (NdArray), or for parameter dtypes the kernel does not
//! take, it runs Burn's `AdamW` itself.
//!
//! ```
//! use burn::module::Module;
//! use burn::optim::GradientsParams;
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::init::{Init, LinearInit};
//! use burn_parallel::optim::FusedAdamWConfig;
//!
//! let device = Device::flex().autodiff();
//! let init = Init::new(1, &device);
//! let model = init.linear("fc", LinearInit::new(4, 2)).unwrap();
//! let mut optim = FusedAdamWConfig::new().with_weight_decay(0.1).init();
//! let loss = model.forward(Tensor::<2>::ones([3, 4], &device)).unwrap().sum();
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! let model = optim.step(1e-3, model, grads);
//! # let _ = model;
//! ```

use burn::optim::{
    AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, ModuleOptimizer, Optimizer,
};
use burn::tensor::{DType, Device, Tensor};

use crate::kernels::{self, AdamWHyper};

/// Hyper-parameters of [`FusedAdamW`]; the defaults are those of Burn's `AdamWConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdamWConfig {
    /// First-moment decay (0.9).
    pub beta_1: f32,
    /// Second-moment decay (0.999).
    pub beta_2: f32,
    /// Added to `sqrt(v_hat)` (1e-5).
    pub epsilon: f32,
    /// Decoupled weight decay (1e-4).
    pub weight_decay: f32,
}

impl Default for FusedAdamWConfig {
    fn default() -> Self {
        Self {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 1e-4,
        }
    }
}

impl FusedAdamWConfig {
    /// Burn's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the first-moment decay.
    pub fn with_beta_1(mut self, beta_1: f32) -> Self {
        self.beta_1 = beta_1;
        self
    }

    /// Sets the second-moment decay.
    pub fn with_beta_2(mut self, beta_2: f32) -> Self {
        self.beta_2 = beta_2;
        self
    }

    /// Sets epsilon.
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// Sets the decoupled weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// The optimizer.
    pub fn build(&self) -> FusedAdamW {
        let composed = AdamWConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay)
            .build();
        FusedAdamW {
            config: *self,
            composed,
        }
    }

    /// The optimizer, ready for `optim.step(lr, model, grads)`.
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(self.build())
    }
}

/// AdamW whose step is one fused kernel per parameter (see the module docs).
#[derive(Clone)]
pub struct FusedAdamW {
    config: FusedAdamWConfig,
    /// Burn's AdamW with the same hyper-parameters, for what the kernel does not take.
    composed: AdamW,
}

impl FusedAdamW {
    /// Whether the fused kernel takes a parameter of `dtype` on `device`.
    fn fused(device: &Device, dtype: DType) -> bool {
        kernels::supported(device)
            && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
            && !kernels::composed("adamw")
    }
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let device = tensor.device();
        let moments_ok = state.as_ref().is_none_or(|s| {
            s.momentum.max_moment_2.is_none()
                && s.momentum.moment_1.dtype() == DType::F32
                && s.momentum.moment_2.dtype() == DType::F32
        });
        if !Self::fused(&device, tensor.dtype()) || grad.dtype() != tensor.dtype() || !moments_ok {
            return self.composed.step(lr, tensor, grad, state);
        }
        let (m, v, time) = match state {
            Some(s) => (
                s.momentum.moment_1,
                s.momentum.moment_2,
                s.momentum.time + 1,
            ),
            None => {
                let zeros = || Tensor::<D>::zeros(tensor.shape(), (&device, DType::F32));
                (zeros(), zeros(), 1)
            }
        };
        let hyper = AdamWHyper {
            lr,
            beta1: self.config.beta_1,
            beta2: self.config.beta_2,
            eps: self.config.epsilon,
            weight_decay: self.config.weight_decay,
            step: u32::try_from(time).unwrap_or(u32::MAX),
        };
        if hyper.validate().is_err() {
            // Hyper-parameters the kernel refuses (and Burn takes): Burn's AdamW decides.
            let momentum = AdaptiveMomentumState {
                time: time - 1,
                moment_1: m,
                moment_2: v,
                max_moment_2: None,
            };
            let state = (time > 1).then_some(AdamWState { momentum });
            return self.composed.step(lr, tensor, grad, state);
        }
        let (tensor, moment_1, moment_2) = kernels::adamw_step(tensor, grad, m, v, hyper)
            .expect("shapes and dtypes checked: the parameter, its gradient and its moments");
        let momentum = AdaptiveMomentumState {
            time,
            moment_1,
            moment_2,
            max_moment_2: None,
        };
        (tensor, Some(AdamWState { momentum }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        <AdamW as Optimizer>::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::{Device, Tensor};

    use super::FusedAdamWConfig;
    use crate::init::{Init, LinearInit};

    /// Five steps of a linear layer under the fused optimizer and under Burn's AdamW, on
    /// the device `device`: the parameters agree element for element.
    pub(crate) fn check_against_burn(device: &Device) {
        let init = Init::new(3, device);
        let model = init
            .linear("fc", LinearInit::new(37, 19).with_bias(true))
            .unwrap();
        let (beta_2, eps, wd) = (0.98, 1e-7, 0.05);
        let mut fused = FusedAdamWConfig::new()
            .with_beta_2(beta_2)
            .with_epsilon(eps)
            .with_weight_decay(wd)
            .init();
        let mut burn = AdamWConfig::new()
            .with_beta_2(beta_2)
            .with_epsilon(eps)
            .with_weight_decay(wd)
            .init();
        let (mut a, mut b) = (model.clone(), model);
        for step in 0..5 {
            let x = Tensor::<2>::random(
                [8, 37],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                device,
            );
            let lr = 1e-2 / (step + 1) as f64;
            let ga = GradientsParams::from_grads(
                a.forward(x.clone())
                    .unwrap()
                    .powi_scalar(2)
                    .mean()
                    .backward(),
                &a,
            );
            let gb = GradientsParams::from_grads(
                b.forward(x).unwrap().powi_scalar(2).mean().backward(),
                &b,
            );
            a = fused.step(lr, a, ga);
            b = burn.step(lr, b, gb);
        }
        let w = (a.weight.val() - b.weight.val())
            .abs()
            .max()
            .into_scalar::<f32>();
        assert!(w < 1e-6, "weights differ by {w}");
        let bias = |m: &crate::nn::Linear| m.bias.as_ref().expect("a bias").val();
        let bd = (bias(&a) - bias(&b)).abs().max().into_scalar::<f32>();
        assert!(bd < 1e-6, "biases differ by {bd}");
    }

    #[test]
    fn fused_adamw_matches_burn_adamw_on_flex() {
        check_against_burn(&Device::flex().autodiff());
    }

    #[cfg(feature = "ndarray")]
    #[allow(deprecated)] // Burn 0.22 deprecates NdArray; users still run it.
    #[test]
    fn fused_adamw_falls_back_to_burn_adamw_on_ndarray() {
        check_against_burn(&Device::ndarray().autodiff());
    }
}
