//! Activation checkpointing of one block (a sub-module) inside a stage: its forward keeps no
//! graph, and its backward runs the forward again with the graph, then its own backward.
//!
//! The runtime's [`crate::runtime::Checkpointing`] recomputes whole stages. [`checkpoint`]
//! recomputes one block at a time, so the backward rebuilds the graph of a single block rather
//! than of the whole stage (a lower peak), at the price of keeping each block's input.
//!
//! How it works in Burn, which computes every gradient in one `backward()`: the forward runs
//! `f` on a copy of the block without autodiff (`Module::valid`) and attaches a custom backward
//! step to the output (`burn_parallel::autograd::attach`). That step receives `dY`, runs `f`
//! again on the saved input made a leaf, back-propagates `sum(Y ⊙ dY)` (an inner `backward()`,
//! independent of the outer graph), returns the input gradient to the outer backward, and
//! deposits the block's parameter gradients in the stage's [`WeightGradStore`] under the
//! micro-batch being back-propagated. The runtime adds them to the stage's gradients with the
//! deferred weight gradients (after `B`, or at `W`). Outside the runtime, call
//! [`WeightGradStore::take`](crate::deferred::WeightGradStore::take) after the backward and
//! add its gradients to the step's.
//!
//! The block's forward must be deterministic (random ops must draw the same values twice).
//! Its parameters must be the model's own: under a mixed-precision compute copy
//! ([`crate::runtime::Executor::with_precision`]) they are casts of the fp32 weights, and the
//! recomputation's gradients would reach the casts, not the weights; recompute whole stages
//! there ([`crate::runtime::Checkpointing`]), which the executor does on the compute copy.
//!
//! ```
//! use burn::module::{Module, Param};
//! use burn::optim::GradientsParams;
//! use burn::tensor::{Device, Tensor};
//! use burn_pipeline::checkpoint::checkpoint;
//! use burn_pipeline::deferred::WeightGradStore;
//!
//! #[derive(Module, Debug)]
//! struct Scale {
//!     w: Param<Tensor<1>>,
//! }
//!
//! let device = Device::flex().autodiff();
//! let block = Scale { w: Param::from_tensor(Tensor::from_floats([3.0], &device)) };
//! let store = WeightGradStore::new();
//! let x = Tensor::<1>::from_floats([2.0], &device).require_grad();
//! let y = checkpoint(&block, x.clone(), &store, |b: &Scale, x| (x * b.w.val()).tanh());
//! let mut grads = y.sum().backward();
//! let dx = x.grad_remove(&mut grads).unwrap(); // through the recomputation
//! let dw: GradientsParams = store.take(0, &block); // the block's own gradients
//! let dw = dw.get::<1>(block.w.id).unwrap();
//! let sech2 = 1.0 - 6.0f32.tanh().powi(2);
//! assert!((dx.into_scalar::<f32>() - 3.0 * sech2).abs() < 1e-5);
//! assert!((dw.into_scalar::<f32>() - 2.0 * sech2).abs() < 1e-5);
//! ```

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_parallel::autograd::{BackwardFn, attach};
use burn_parallel::group::tensor_from_data;

use crate::deferred::WeightGradStore;

/// Runs `f(block, x)` without keeping its graph; its backward recomputes it (see the
/// [module docs](self)). The block's parameter gradients go to `store`.
///
/// # Panics
/// In the backward, when the recomputed forward panics (the pipeline runtime reports it as a
/// stage panic).
pub fn checkpoint<M, F, const D: usize>(
    block: &M,
    x: Tensor<D>,
    store: &WeightGradStore,
    f: F,
) -> Tensor<D>
where
    M: Module + Send + Sync + 'static,
    F: Fn(&M, Tensor<D>) -> Tensor<D> + Send + Sync + 'static,
{
    let device = x.device();
    let saved = x.clone().detach();
    let y = f(&block.valid(), saved.clone()).autodiff();
    let (block, store) = (block.clone(), store.clone());
    let needs_dx = x.is_tracked();
    let recompute = move |dy: burn::tensor::TensorData| {
        let leaf = saved.clone().require_grad();
        let y = f(&block, leaf.clone());
        let dy: Tensor<D> = tensor_from_data(dy, &device);
        let mut grads = (y * dy).sum().backward();
        let dx = leaf.grad_remove(&mut grads);
        store.deposit(GradientsParams::from_grads(grads, &block));
        dx
    };
    if needs_dx {
        attach(
            x,
            y,
            BackwardFn::new("checkpoint", move |dy| {
                let dx = recompute(dy).expect("the input is a leaf of the recomputation");
                Ok(dx.into_data())
            }),
        )
    } else {
        // The backward must still run for the block's parameters: hang it off a fresh leaf.
        let anchor = Tensor::<1>::zeros([1], &y.device()).require_grad();
        attach(
            anchor,
            y,
            BackwardFn::new("checkpoint", move |dy| {
                recompute(dy);
                Ok(burn::tensor::TensorData::new(vec![0f32], [1]))
            }),
        )
    }
}
