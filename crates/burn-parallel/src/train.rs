//! One training step for every data × tensor-parallel layout: backward, the gradient
//! reductions the layout needs, global-norm clipping, the optimizer step.
//!
//! | stage | what [`TrainStep::step`] does |
//! |---|---|
//! | backward | `loss.backward()`, gradients of this rank's parameters |
//! | sequence parallelism | sums the gradients of the norms used on sequence shards over `tp` ([`TpContext::sync_gradients`]) |
//! | data parallelism | averages every gradient over `dp` (bucketed, [`DistributedDataParallel`]) |
//! | clipping | scales all gradients by `min(1, max_norm / ‖g‖)`, with `‖g‖` the norm of the whole model's gradient: tensor-parallel shards summed over `tp` once, replicated parameters counted once |
//! | step | the Burn optimizer, on this rank's parameters |
//!
//! ZeRO and FSDP shard the optimizer state and need their own step (`burn-zero`); everything
//! else trains with this one.
//!
//! # Example
//! ```
//! use burn::module::Module;
//! use burn::optim::AdamWConfig;
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::init::{Init, LinearInit};
//! use burn_parallel::nn::Linear;
//! use burn_parallel::train::TrainStep;
//! use burn_parallel::run_local;
//!
//! let losses = run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     let init = Init::new(1, &device);
//!     let mut model = init.linear("fc", LinearInit::new(4, 1)).unwrap();
//!     let mut optim = AdamWConfig::new().init();
//!     let step = TrainStep::new(init.context()).with_data_parallel(group.clone()).with_clip(Some(1.0));
//!     let x = Tensor::<2>::ones([2, 4], &device) * (group.rank() as f32 + 1.0);
//!     let loss = model.forward(x).unwrap().powf_scalar(2.0).mean();
//!     let (next, out) = step.step(model, loss, &mut optim, 1e-2).unwrap();
//!     model = next;
//!     let _ = model;
//!     Ok(out.loss)
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]); // the loss averaged over the data-parallel ranks
//! ```

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};

use crate::comm::host::ReduceOp;
use crate::ddp::DistributedDataParallel;
use crate::error::Result;
use crate::group::ProcessGroup;
use crate::nn::TpContext;

/// What a step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutput {
    /// The loss, averaged over the data-parallel ranks (the loss of the global batch).
    pub loss: f32,
    /// The global gradient norm before clipping, when clipping is on.
    pub grad_norm: Option<f64>,
}

/// The training step of a data × tensor-parallel layout. See the module docs.
#[derive(Debug, Clone)]
pub struct TrainStep {
    tp: TpContext,
    ddp: Option<DistributedDataParallel>,
    max_grad_norm: Option<f64>,
}

impl TrainStep {
    /// A step for a model built with the tensor-parallel context `tp` (from
    /// [`Init::context`](crate::init::Init::context); [`TpContext::single`] for none).
    pub fn new(tp: TpContext) -> Self {
        Self {
            tp,
            ddp: None,
            max_grad_norm: None,
        }
    }

    /// Averages gradients over the data-parallel group `dp` (each rank trains on its part of
    /// the global batch).
    pub fn with_data_parallel(mut self, dp: ProcessGroup) -> Self {
        self.ddp = (dp.size() > 1).then(|| DistributedDataParallel::new(dp));
        self
    }

    /// Uses `ddp` (for its bucket size) for the data-parallel reduction.
    pub fn with_ddp(mut self, ddp: DistributedDataParallel) -> Self {
        self.ddp = Some(ddp);
        self
    }

    /// Clips the global gradient norm to `max_norm` (`None`: no clipping).
    pub fn with_clip(mut self, max_norm: Option<f64>) -> Self {
        self.max_grad_norm = max_norm;
        self
    }

    /// The gradients of `loss` for `model`, reduced as the layout needs and clipped: what the
    /// optimizer takes. Also returns the global norm before clipping (when clipping is on).
    ///
    /// # Errors
    /// Collective errors.
    pub fn gradients<M: Module>(
        &self,
        model: &M,
        loss: Tensor<1>,
    ) -> Result<(GradientsParams, Option<f64>)> {
        let grads = GradientsParams::from_grads(loss.backward(), model);
        let grads = self.tp.sync_gradients(grads)?;
        let mut grads = match &self.ddp {
            Some(ddp) => ddp.all_reduce_grads(model, grads)?,
            None => grads,
        };
        let norm = match self.max_grad_norm {
            None => None,
            Some(max_norm) => {
                let norm = self.global_norm(model, &grads)?;
                let scale = max_norm / (norm + 1e-6);
                if scale < 1.0 {
                    grads = scale_grads(model, grads, scale as f32);
                }
                Some(norm)
            }
        };
        Ok((grads, norm))
    }

    /// One step: backward of `loss`, reductions, clipping, `optim.step(lr, ..)`.
    ///
    /// # Errors
    /// Collective errors (the model is then lost: the job cannot go on).
    pub fn step<M: Module>(
        &self,
        model: M,
        loss: Tensor<1>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<(M, StepOutput)> {
        let local = loss.clone().into_scalar::<f32>();
        let loss_avg = match &self.ddp {
            Some(ddp) => ddp.group().all_reduce_f32(vec![local], ReduceOp::Avg)?[0],
            None => local,
        };
        let (grads, grad_norm) = self.gradients(&model, loss)?;
        let model = optim.step(lr, model, grads);
        Ok((
            model,
            StepOutput {
                loss: loss_avg,
                grad_norm,
            },
        ))
    }

    /// The norm of the whole model's gradient: the squares of tensor-parallel shards summed over
    /// the `tp` group, those of replicated parameters counted once. Gradients are already
    /// averaged over `dp`, so they are the same on every data-parallel rank.
    ///
    /// # Errors
    /// Collective errors.
    pub fn global_norm<M: Module>(&self, model: &M, grads: &GradientsParams) -> Result<f64> {
        let sharded = self.tp.sharded_ids();
        let mut sums = [0f64; 2]; // [replicated, sharded]
        for_each_grad(model, grads, |id, data| {
            let sq: f64 = data
                .iter::<f32>()
                .map(|g| f64::from(g) * f64::from(g))
                .sum();
            sums[usize::from(sharded.contains(&id))] += sq;
        });
        let sharded_total = match self.tp.group() {
            Some(group) if group.size() > 1 => {
                let total =
                    group.all_reduce_data(TensorData::new(vec![sums[1]], [1]), ReduceOp::Sum)?;
                total.try_to_vec::<f64>().expect("f64 in, f64 out")[0]
            }
            _ => sums[1],
        };
        Ok((sums[0] + sharded_total).sqrt())
    }
}

/// Calls `f` with the id and host data of every gradient `grads` holds for `model`.
fn for_each_grad<M: Module>(
    model: &M,
    grads: &GradientsParams,
    f: impl FnMut(ParamId, TensorData),
) {
    struct Visit<'a, F> {
        grads: &'a GradientsParams,
        f: F,
    }
    impl<F: FnMut(ParamId, TensorData)> ModuleVisitor for Visit<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                (self.f)(param.id, g.into_data().convert::<f32>());
            }
        }
    }
    model.visit(&mut Visit { grads, f });
}

/// Multiplies every gradient `grads` holds for `model` by `scale`.
fn scale_grads<M: Module>(model: &M, grads: GradientsParams, scale: f32) -> GradientsParams {
    struct Scale {
        grads: GradientsParams,
        scale: f32,
    }
    impl ModuleVisitor for Scale {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register::<D>(param.id, g * self.scale);
            }
        }
    }
    let mut visitor = Scale { grads, scale };
    model.visit(&mut visitor);
    visitor.grads
}
