//! [`MoeStep`]: the training step of a model with MoE layers under data and expert
//! parallelism.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::ReduceOp;
use burn_parallel::train::{
    Reduced, StepOutput, StepPhases, TrainStep, clip_to_norm, run_micro_batches,
};

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
        grads: GradientsParams,
    ) -> Result<(GradientsParams, Option<f64>)> {
        self.refuse_scaler()?;
        let reduced = self.reduce_scaled(model, grads)?;
        Ok((reduced.grads, reduced.grad_norm))
    }

    /// [`Self::reduce`] for the gradients of a loss scaled by the inner step's loss scaler
    /// ([`TrainStep::scaled_loss`], fp16's dynamic loss scaling): the dense and the expert
    /// gradients unscaled and checked for inf/NaN on every rank (the experts differ between
    /// expert-parallel ranks: their verdict is agreed over [`MoeParallel::ep`]); after an
    /// overflow the scale backs off and the result says to skip the step
    /// ([`TrainStep::apply`] does). The same as [`Self::reduce`] without a scaler.
    ///
    /// # Errors
    /// As [`Self::reduce`].
    pub fn reduce_scaled<M: Module>(
        &self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<Reduced> {
        if self.inner.max_grad_norm().is_some() {
            return Err(MoeError::Config {
                field: "TrainStep clipping".into(),
                reason: "build the inner TrainStep without clipping and clip with \
                         MoeStep::with_clip, whose norm counts the experts"
                    .into(),
            });
        }
        let taken = take_experts(model, &mut grads, &self.parallel);
        let (mut grads, dense_overflow) = self.inner.reduce_unscaled(model, grads)?;
        let mut experts = self.reduce_taken(taken)?;
        if self.inner.loss_scaler().is_some() {
            let scale = self.inner.loss_scale();
            if scale != 1.0 {
                experts.scale((1.0 / scale) as f32);
            }
            let bad = !experts.all_finite()?;
            let mut flag = f32::from(u8::from(bad || dense_overflow));
            if let Some(ep) = &self.parallel.ep {
                flag = ep.all_reduce_f32(vec![flag], ReduceOp::Max)?[0];
            }
            if !self.inner.update_loss_scale(flag > 0.0) {
                return Ok(Reduced::overflowed(grads));
            }
        }
        // The global norm every applied step (each expert once), for the NaN check and the
        // log; clipped by when asked.
        let rest = self.inner.global_norm(model, &grads)?;
        let norm = (rest * rest + self.expert_squared_norm(&experts)?).sqrt();
        experts.register_into(model, &mut grads);
        if let Some(max_norm) = self.max_grad_norm {
            grads = clip_to_norm(model, grads, norm, max_norm);
        }
        Ok(Reduced {
            grads,
            grad_norm: Some(norm),
            overflow: false,
        })
    }

    /// Takes the expert gradients out of `grads`, unreduced (no communication): to accumulate
    /// them over micro-steps before [`Self::reduce_experts`].
    ///
    /// # Arguments
    /// * `model` - the model the MoE layers of this step's [`MoeParallel`] belong to.
    /// * `grads` - this rank's gradients; the expert ones are removed.
    ///
    /// # Returns
    /// The expert gradients.
    pub fn take_experts<M: Module>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> GradientsParams {
        let mut experts = GradientsParams::new();
        struct Move<'a> {
            parallel: &'a MoeParallel,
            from: &'a mut GradientsParams,
            to: &'a mut GradientsParams,
        }
        impl ModuleVisitor for Move<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.parallel.experts.contains(&param.id)
                    && let Some(g) = self.from.remove::<D>(param.id)
                {
                    self.to.register::<D>(param.id, g);
                }
            }
        }
        model.visit(&mut Move {
            parallel: &self.parallel,
            from: grads,
            to: &mut experts,
        });
        experts
    }

    /// Takes the expert gradients out of `grads` and reduces them over the ranks holding the
    /// same experts (summed, divided by the data-parallel size), leaving the other gradients
    /// in `grads`: for a training step that reduces the rest its own way (ZeRO's sharded
    /// optimizer, whose flat space leaves the experts out). An expert no rank used gets no
    /// gradient. A collective over [`MoeParallel::expert_dp`]: every rank calls it.
    ///
    /// # Arguments
    /// * `model` - the model the MoE layers of this step's [`MoeParallel`] belong to.
    /// * `grads` - this rank's gradients (summed over micro-steps, if any); the expert ones are
    ///   removed.
    ///
    /// # Returns
    /// The reduced expert gradients.
    ///
    /// # Errors
    /// Collective errors.
    pub fn reduce_experts<M: Module>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<ExpertGradients> {
        let taken = take_experts(model, grads, &self.parallel);
        self.reduce_taken(taken)
    }

    /// The squared norm of the expert gradients of the whole model (each expert counted once:
    /// the squares summed over the expert-parallel group). A collective over
    /// [`MoeParallel::ep`].
    ///
    /// # Errors
    /// Collective errors.
    pub fn expert_squared_norm(&self, experts: &ExpertGradients) -> Result<f64> {
        // Summed on the device; one number read.
        let local = match experts.sum_of(|g| g.powi_scalar(2)) {
            Some(sum) => f64::from(scalar(&sum)?),
            None => 0.0,
        };
        Ok(match &self.parallel.ep {
            Some(ep) => ep
                .all_reduce_data(TensorData::new(vec![local], [1]), ReduceOp::Sum)?
                .try_to_vec::<f64>()
                .expect("f64 in, f64 out")[0],
            None => local,
        })
    }

    /// Sums `taken` over the ranks holding the same experts and divides by the data-parallel
    /// size. The values stay on the device: one flat f32 tensor of every expert gradient (zeros
    /// where a rank has none), one all-reduce (in device memory where the group collects there,
    /// as NCCL does with CUDA tensors); the presence flags, a few bytes, go through the host.
    fn reduce_taken(&self, taken: Vec<Taken>) -> Result<ExpertGradients> {
        // No expert parameter in sight (every expert inside a sharded FSDP unit): the same on
        // every rank holding the same experts.
        if taken.is_empty() {
            return Ok(ExpertGradients { grads: Vec::new() });
        }
        let mut present: Vec<f32> = taken
            .iter()
            .map(|t| f32::from(u8::from(t.grad.is_some())))
            .collect();
        let lens: Vec<usize> = taken.iter().map(|t| t.shape.iter().product()).collect();
        let pieces: Vec<Tensor<1>> = taken
            .iter()
            .zip(&lens)
            .map(|(t, &len)| match &t.grad {
                Some(g) => g.clone(),
                None => Tensor::<1>::zeros([len], (&t.device, DType::F32)),
            })
            .collect();
        let mut flat = Tensor::cat(pieces, 0);
        if let Some(group) = &self.parallel.expert_dp {
            present = group.all_reduce_f32(present, ReduceOp::Sum)?;
            flat = group.all_reduce(flat, ReduceOp::Sum)?;
        }
        let flat = flat * (1.0 / self.parallel.dp_size() as f32);
        let mut at = 0;
        let mut grads = Vec::with_capacity(taken.len());
        for ((t, len), used) in taken.into_iter().zip(lens).zip(present) {
            if used > 0.0 {
                grads.push((t.id, flat.clone().narrow(0, at, len), t.shape));
            }
            at += len;
        }
        Ok(ExpertGradients { grads })
    }

    /// One step of the model `forward` computes the loss of: [`Self::step_accumulated`] over
    /// one micro-batch. The bias updates of auxiliary-loss-free balancing are the caller's.
    ///
    /// # Errors
    /// `forward`'s error; [`Self::reduce_scaled`]'s, converted into `E`.
    pub fn step_with<M: Module, E: From<MoeError>>(
        &self,
        model: M,
        forward: impl FnOnce(&M) -> std::result::Result<Tensor<1>, E>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        let mut forward = Some(forward);
        self.step_accumulated(
            model,
            1,
            &mut |m, _| (forward.take().expect("one micro-batch"))(m),
            optim,
            lr,
        )
    }

    /// One optimizer step over `micro_batches` micro-batches (gradient accumulation, as
    /// [`TrainStep::step_accumulated`]): the MoE layers' loss scale set to the inner step's
    /// divided by `micro_batches` ([`MoeParallel::set_loss_scale`]), each micro-batch's forward
    /// (`forward(model, k)`, the mean loss of micro-batch `k`) on a compute copy of its own
    /// under the inner step's precision ([`burn_parallel::train::run_micro_batches`]), the
    /// backward of its loss divided by `micro_batches` and
    /// scaled ([`TrainStep::scaled_loss`]), the gradients summed, then [`Self::reduce_scaled`]
    /// and the optimizer step unless the gradients overflowed ([`StepOutput::skipped`]). Mixed
    /// precision and fp16's dynamic loss scaling work as under [`TrainStep::step_with`]; the
    /// bias updates of auxiliary-loss-free balancing are the caller's
    /// ([`MoeParallel::update_biases`]; [`crate::MoeTrainer`] does it).
    ///
    /// # Errors
    /// `forward`'s error; [`MoeError::Config`] for zero micro-batches;
    /// [`Self::reduce_scaled`]'s, converted into `E`.
    pub fn step_accumulated<M: Module, E: From<MoeError>>(
        &self,
        model: M,
        micro_batches: usize,
        forward: &mut dyn FnMut(&M, usize) -> std::result::Result<Tensor<1>, E>,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> std::result::Result<(M, StepOutput), E> {
        if micro_batches == 0 {
            return Err(E::from(MoeError::Config {
                field: "micro_batches".into(),
                reason: "zero micro-batches: give at least one".into(),
            }));
        }
        let n = micro_batches as f32;
        self.parallel
            .set_loss_scale(self.inner.loss_scale() as f32 / n);
        let mut phases = StepPhases::default();
        let mut acc = GradientsAccumulator::<M>::new();
        let local = run_micro_batches(
            micro_batches,
            &model,
            self.inner.precision(),
            forward,
            &mut phases,
            |_, loss| {
                let loss = self.inner.scaled_loss(loss / n);
                let grads = burn_parallel::autograd::backward(loss)
                    .map_err(|e| E::from(MoeError::from(e)))?;
                acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
                Ok(())
            },
        )?;
        Ok(self.finish(model, local, acc.grads(), optim, lr, phases)?)
    }

    /// One step: backward of `loss`, [`Self::reduce`], `optim.step(lr, ..)`, then the bias
    /// updates of auxiliary-loss-free balancing are the caller's (call
    /// [`crate::MoeLayer::update_bias`] on each layer). Not with a loss scaler (the loss was
    /// computed before the layers' loss scale could be set): use [`Self::step_with`].
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
        self.refuse_scaler()?;
        let local = scalar(&loss)?;
        let mut phases = StepPhases::default();
        let grads = phases.time(
            |p| &mut p.backward,
            || {
                burn_parallel::autograd::backward(loss)
                    .map(|g| GradientsParams::from_grads(g, &model))
            },
        )?;
        self.finish(model, local, grads, optim, lr, phases)
    }

    /// The end of every step ([`TrainStep::finish_with`]): the loss averaged over the
    /// data-parallel ranks, [`Self::reduce_scaled`], and the update unless the gradients
    /// overflowed.
    fn finish<M: Module>(
        &self,
        model: M,
        local: f32,
        grads: GradientsParams,
        optim: &mut ModuleOptimizer,
        lr: f64,
        phases: StepPhases,
    ) -> Result<(M, StepOutput)> {
        let reduce = |m: &M| self.reduce_scaled(m, grads);
        let loss = (local, self.parallel.dp.as_ref());
        self.inner
            .finish_with(model, loss, reduce, optim, lr, phases)
    }

    /// The inner step (the layout of every gradient but the experts', precision, scaler).
    pub fn inner(&self) -> &TrainStep {
        &self.inner
    }

    /// The groups of the MoE layers this step trains.
    pub fn parallel(&self) -> &MoeParallel {
        &self.parallel
    }

    /// The error of the entry points that cannot skip a step: the inner step has a loss scaler.
    fn refuse_scaler(&self) -> Result<()> {
        match self.inner.loss_scaler() {
            Some(_) => Err(MoeError::Config {
                field: "TrainStep loss scaler".into(),
                reason: "an overflow must skip the step, which `reduce` and `step` cannot do: \
                         call `reduce_scaled` and `TrainStep::apply`, or `step_with`"
                    .into(),
            }),
            None => Ok(()),
        }
    }
}

/// The value of a one-element loss, in f32 whatever its dtype.
fn scalar(loss: &Tensor<1>) -> Result<f32> {
    let values = loss
        .clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| MoeError::Config {
            field: "loss".into(),
            reason: format!("{e:?}"),
        })?;
    values.first().copied().ok_or_else(|| MoeError::Config {
        field: "loss".into(),
        reason: "an empty loss tensor: give the mean loss, one element".into(),
    })
}

/// An expert parameter and its local gradient (if any), flat, in f32, on its device.
struct Taken {
    id: ParamId,
    shape: Vec<usize>,
    device: Device,
    grad: Option<Tensor<1>>,
}

/// The expert gradients of one step, reduced over the ranks holding the same experts
/// ([`MoeStep::reduce_experts`]), on their parameters' device: flat, in f32.
#[derive(Debug, Clone)]
pub struct ExpertGradients {
    grads: Vec<(ParamId, Tensor<1>, Vec<usize>)>,
}

impl ExpertGradients {
    /// Number of expert parameters with a gradient.
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    /// Whether no expert parameter has a gradient.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// Multiplies every gradient by `factor` (averaging micro-steps, clipping).
    pub fn scale(&mut self, factor: f32) {
        for (_, g, _) in &mut self.grads {
            *g = g.clone() * factor;
        }
    }

    /// `f` of each gradient, summed into one element on the device (`None` without
    /// gradients).
    fn sum_of(&self, f: impl Fn(Tensor<1>) -> Tensor<1>) -> Option<Tensor<1>> {
        self.grads
            .iter()
            .map(|(_, g, _)| f(g.clone()).sum())
            .reduce(|a, b| {
                let device = a.device();
                a + b.to_device(&device)
            })
    }

    /// Whether every gradient is finite (no infinity, no NaN): one number read.
    fn all_finite(&self) -> Result<bool> {
        // `0 * x` is NaN exactly for an infinite or NaN `x`.
        Ok(match self.sum_of(|g| g * 0.0) {
            Some(zero) => scalar(&zero)?.is_finite(),
            None => true,
        })
    }

    /// The gradients as Burn's, for `model` (on each parameter's device and dtype): what an
    /// optimizer takes.
    pub fn into_gradients<M: Module>(self, model: &M) -> GradientsParams {
        let mut grads = GradientsParams::new();
        self.register_into(model, &mut grads);
        grads
    }

    /// Registers the gradients in `grads`.
    fn register_into<M: Module>(self, model: &M, grads: &mut GradientsParams) {
        let mut put = Put {
            grads,
            reduced: self
                .grads
                .into_iter()
                .map(|(id, g, shape)| (id, (g, shape)))
                .collect(),
        };
        model.visit(&mut put);
    }
}

/// Removes the expert gradients from `grads`, in visiting order (the same on ranks holding the
/// same experts).
fn take_experts<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    parallel: &MoeParallel,
) -> Vec<Taken> {
    let mut take = Take {
        parallel,
        grads,
        taken: Vec::new(),
    };
    model.visit(&mut take);
    take.taken
}

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
                .map(|g| g.cast(DType::F32).flatten::<1>(0, D - 1));
            self.taken.push(Taken {
                id: param.id,
                shape: param.val().dims().to_vec(),
                device: param.val().device(),
                grad,
            });
        }
    }
}

struct Put<'a> {
    grads: &'a mut GradientsParams,
    reduced: std::collections::HashMap<ParamId, (Tensor<1>, Vec<usize>)>,
}

impl ModuleVisitor for Put<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some((flat, shape)) = self.reduced.remove(&param.id) {
            let value = param.val();
            let shape: [usize; D] = shape.try_into().expect("the parameter's own shape");
            let g = flat
                .reshape(shape)
                .to_device(&value.device())
                .cast(value.dtype());
            self.grads.register::<D>(param.id, g);
        }
    }
}
