//! [`MoeStep`]: the training step of a model with MoE layers under data and expert
//! parallelism.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};
use burn_parallel::ReduceOp;
use burn_parallel::train::{StepOutput, TrainStep, clip_to_norm};

use crate::config::{MoeError, Result};
use crate::layer::MoeParallel;

/// The training step of a model with MoE layers: the expert gradients are taken out, summed
/// over the ranks that hold the same experts ([`MoeParallel::expert_dp`]) and divided by the
/// data-parallel size (each rank's backward already brought back, through the combine's
/// all-to-all, the gradient of every token its experts computed, from all its expert-parallel
/// peers); every other gradient goes through `inner` (`TrainStep`: averaged over the
/// data-parallel group, tensor-parallel syncs, FSDP). An expert that no rank used gets no
/// gradient, as on one device. Global-norm clipping, when set here, counts each expert once.
///
/// # Example
/// ```
/// use burn::optim::AdamWConfig;
/// use burn::tensor::{Device, Tensor};
/// use burn_moe::{MoeConfig, MoeLayer, MoeParallel, MoeStep};
/// use burn_parallel::init::Init;
/// use burn_parallel::train::TrainStep;
/// use burn_parallel::{ParallelDims, run_local};
///
/// run_local(2, |world| {
///     let device = Device::flex().autodiff();
///     let dims = ParallelDims { dp_replicate: 2, ep: 2, ..ParallelDims::default() };
///     let mesh = dims.build(&world).unwrap();
///     let parallel = MoeParallel::from_mesh(&dims, &mesh).unwrap();
///     let moe = MoeLayer::build(&MoeConfig::new(4, 8, 2, 1), &Init::new(0, &device), &parallel)
///         .unwrap();
///     assert_eq!(moe.experts.len(), 1); // one of the two experts per rank
///     let step = MoeStep::new(TrainStep::new(Init::new(0, &device).context())
///         .with_data_parallel(dims.gradient_reduction(&mesh).unwrap()), &parallel);
///     let x = Tensor::<2>::ones([3, 4], &device) * (world.rank() as f32 + 1.0);
///     let loss = moe.forward(x).unwrap().powf_scalar(2.0).mean();
///     let mut optim = AdamWConfig::new().init();
///     let (_moe, out) = step.step(moe, loss, &mut optim, 1e-2).unwrap();
///     assert!(out.loss.is_finite());
///     Ok(())
/// })
/// .unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct MoeStep {
    inner: TrainStep,
    parallel: MoeParallel,
    max_grad_norm: Option<f64>,
}

impl MoeStep {
    /// The step of a model whose MoE layers were built with `parallel`; `inner` reduces every
    /// other gradient (build it without clipping: set clipping with [`Self::with_clip`]).
    pub fn new(inner: TrainStep, parallel: &MoeParallel) -> Self {
        Self {
            inner,
            parallel: parallel.clone(),
            max_grad_norm: None,
        }
    }

    /// Clips the global gradient norm (experts included) to `max_norm`.
    pub fn with_clip(mut self, max_norm: Option<f64>) -> Self {
        self.max_grad_norm = max_norm;
        self
    }

    /// The reduced (and clipped) gradients for `model`, and the norm before clipping.
    ///
    /// # Errors
    /// [`MoeError::Config`] when `inner` clips (its norm would miss the experts); collective
    /// errors.
    pub fn reduce<M: Module>(
        &self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<(GradientsParams, Option<f64>)> {
        // Expert gradients out, in visiting order (the same on ranks holding the same experts).
        let mut take = Take {
            parallel: &self.parallel,
            grads: &mut grads,
            taken: Vec::new(),
        };
        model.visit(&mut take);
        let taken = take.taken;
        let (mut grads, inner_norm) = self.inner.reduce(model, grads)?;
        if inner_norm.is_some() {
            return Err(MoeError::Config {
                field: "TrainStep clipping".into(),
                reason: "build the inner TrainStep without clipping and clip with \
                         MoeStep::with_clip, whose norm counts the experts"
                    .into(),
            });
        }
        // [presence flags..., values...] summed over the ranks holding the same experts.
        let mut flat: Vec<f32> = taken
            .iter()
            .map(|(_, _, g)| f32::from(u8::from(g.is_some())))
            .collect();
        for (_, shape, g) in &taken {
            match g {
                Some(g) => flat.extend(g.iter::<f32>()),
                None => flat.extend(std::iter::repeat_n(0f32, shape.iter().product())),
            }
        }
        // No expert parameter in sight (every expert inside a sharded FSDP unit, without
        // expert parallelism): the same on every rank holding the same experts.
        if let Some(group) = self
            .parallel
            .expert_dp
            .as_ref()
            .filter(|_| !taken.is_empty())
        {
            let n = flat.len();
            flat = group
                .all_reduce_data(TensorData::new(flat, [n]), ReduceOp::Sum)?
                .try_to_vec::<f32>()
                .expect("f32 in, f32 out");
        }
        let scale = 1.0 / self.parallel.dp_size() as f32;
        let mut at = taken.len();
        let mut reduced = Vec::with_capacity(taken.len());
        let mut expert_sq = 0f64;
        for (i, (id, shape, _)) in taken.iter().enumerate() {
            let len: usize = shape.iter().product();
            if flat[i] > 0.0 {
                let values: Vec<f32> = flat[at..at + len].iter().map(|g| g * scale).collect();
                expert_sq += values
                    .iter()
                    .map(|&g| f64::from(g) * f64::from(g))
                    .sum::<f64>();
                reduced.push((*id, TensorData::new(values, shape.clone())));
            }
            at += len;
        }
        let mut put = Put {
            grads: &mut grads,
            reduced: reduced.into_iter().collect(),
        };
        model.visit(&mut put);
        let norm = match self.max_grad_norm {
            None => None,
            Some(max_norm) => {
                let rest = self
                    .inner
                    .global_norm(model, &without_experts(model, &grads, &self.parallel))?;
                // Each expert lives on one rank of the expert-parallel group.
                let experts = match &self.parallel.ep {
                    Some(ep) => ep
                        .all_reduce_data(TensorData::new(vec![expert_sq], [1]), ReduceOp::Sum)?
                        .try_to_vec::<f64>()
                        .expect("f64 in, f64 out")[0],
                    None => expert_sq,
                };
                let norm = (rest * rest + experts).sqrt();
                grads = clip_to_norm(model, grads, norm, max_norm);
                Some(norm)
            }
        };
        Ok((grads, norm))
    }

    /// One step: backward of `loss`, [`Self::reduce`], `optim.step(lr, ..)`, then the bias
    /// updates of auxiliary-loss-free balancing are the caller's (call
    /// [`crate::MoeLayer::update_bias`] on each layer).
    ///
    /// # Errors
    /// As [`Self::reduce`].
    pub fn step<M: Module>(
        &self,
        model: M,
        loss: Tensor<1>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<(M, StepOutput)> {
        let local = loss.clone().into_scalar::<f32>();
        let loss_avg = match &self.parallel.dp {
            Some(dp) => dp.all_reduce_f32(vec![local], ReduceOp::Avg)?[0],
            None => local,
        };
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let (grads, grad_norm) = self.reduce(&model, grads)?;
        let model = optim.step(lr, model, grads);
        Ok((
            model,
            StepOutput {
                loss: loss_avg,
                grad_norm,
            },
        ))
    }
}

/// An expert parameter's id, shape and local gradient (if any).
type Taken = (ParamId, Vec<usize>, Option<TensorData>);

struct Take<'a> {
    parallel: &'a MoeParallel,
    grads: &'a mut GradientsParams,
    taken: Vec<Taken>,
}

impl ModuleVisitor for Take<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.parallel.experts.contains(&param.id) {
            let grad = self
                .grads
                .remove::<D>(param.id)
                .map(|g| g.into_data().convert::<f32>());
            self.taken
                .push((param.id, param.val().dims().to_vec(), grad));
        }
    }
}

struct Put<'a> {
    grads: &'a mut GradientsParams,
    reduced: std::collections::HashMap<ParamId, TensorData>,
}

impl ModuleVisitor for Put<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(data) = self.reduced.remove(&param.id) {
            let device = param.val().device();
            let dtype = param.val().dtype();
            let g = Tensor::<D>::from_data(data, &device).cast(dtype);
            self.grads.register::<D>(param.id, g);
        }
    }
}

/// A copy of `grads` without the expert gradients.
fn without_experts<M: Module>(
    model: &M,
    grads: &GradientsParams,
    parallel: &MoeParallel,
) -> GradientsParams {
    struct Copy<'a> {
        from: &'a GradientsParams,
        to: GradientsParams,
        parallel: &'a MoeParallel,
    }
    impl ModuleVisitor for Copy<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !self.parallel.experts.contains(&param.id)
                && let Some(g) = self.from.get::<D>(param.id)
            {
                self.to.register::<D>(param.id, g);
            }
        }
    }
    let mut copy = Copy {
        from: grads,
        to: GradientsParams::new(),
        parallel,
    };
    model.visit(&mut copy);
    copy.to
}
