//! Split backward for zero-bubble schedules: a linear layer whose weight gradient is deferred.
//!
//! Burn computes every gradient of a graph in one `backward()`. [`DeferredLinear`] takes its
//! weight out of that: the forward multiplies by the *untracked* weight and attaches its own
//! backward step (`burn_parallel::autograd::attach`). That step computes the input gradient
//! `dX = dY Wᵀ` at once and records `(X, dY)` in the stage's [`WeightGradStore`] under the
//! micro-batch being back-propagated. So a `backward()` (the schedule's `I`) returns the input
//! gradient, and the gradients of the other parameters (biases, norms, which stay tracked),
//! without computing any `dW`. The schedule's `W` then calls [`WeightGradStore::take`], which
//! computes `dW = Xᵀ dY` for each recorded pair (without autodiff) and returns them as
//! [`GradientsParams`] keyed by the weights' ids, to be added to the stage's accumulated
//! gradients. A full `B` does both at once. The memory cost of deferring is the recorded pairs
//! between `I` and `W`.
//!
//! A stage opts in by building its linears as [`DeferredLinear`]s sharing one store and
//! returning it from [`crate::stage::Stage::deferred_weights`]; the runtime then scopes each
//! backward to its micro-batch ([`WeightGradStore::begin`]) and runs the `W`s. A stage
//! without a store runs its whole backward in `I`, and `W` does nothing for it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_parallel::autograd::{WeightGradSink, deferred_matmul};
use burn_parallel::index::ParamEntry;

/// One deferred contribution to a micro-batch's parameter gradients.
enum Pending {
    /// A weight gradient to compute at `W`.
    Weight {
        param: ParamId,
        /// Computes this contribution to the weight's gradient (for a [`DeferredLinear`],
        /// `Xᵀ dY` from its recorded input and output gradient, without autodiff).
        compute: Box<dyn FnOnce() -> Tensor<2> + Send>,
    },
    /// Gradients already computed outside the step's graph (a recomputed block,
    /// [`crate::checkpoint::checkpoint`]), handed over with the others.
    Ready(GradientsParams),
}

#[derive(Default)]
struct Inner {
    /// The micro-batch whose backward is running.
    current: usize,
    pending: BTreeMap<usize, Vec<Pending>>,
}

/// The `(X, dY)` pairs of a stage's deferred weights, by micro-batch. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct WeightGradStore {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for WeightGradStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        let counts: BTreeMap<usize, usize> =
            inner.pending.iter().map(|(k, v)| (*k, v.len())).collect();
        f.debug_struct("WeightGradStore")
            .field("pending", &counts)
            .finish()
    }
}

impl WeightGradStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the pairs of the following backward passes under `microbatch` (the runtime
    /// calls it before each `B` or `I`; outside the runtime pairs go to micro-batch 0).
    pub fn begin(&self, microbatch: usize) {
        self.lock().current = microbatch;
    }

    /// Number of pairs waiting for `microbatch`'s `W`.
    pub fn pending(&self, microbatch: usize) -> usize {
        self.lock().pending.get(&microbatch).map_or(0, Vec::len)
    }

    /// The micro-batches with pairs waiting.
    pub fn pending_microbatches(&self) -> Vec<usize> {
        self.lock()
            .pending
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, _)| *k)
            .collect()
    }

    /// Defers one contribution to `param`'s gradient to the `W` step of the micro-batch whose
    /// backward is running: `compute` runs in [`Self::take`], and contributions to the same
    /// weight are summed. [`DeferredLinear`] records `Xᵀ dY` this way; a custom layer whose
    /// backward is written with `burn_parallel::autograd::attach` can defer its own weight
    /// gradients the same way.
    pub fn defer(&self, param: ParamId, compute: impl FnOnce() -> Tensor<2> + Send + 'static) {
        self.push(Pending::Weight {
            param,
            compute: Box::new(compute),
        });
    }

    /// Hands over parameter gradients computed outside the step's graph (by a recomputed
    /// block's own backward, [`crate::checkpoint::checkpoint`]) with the micro-batch whose
    /// backward is running; [`Self::take`] adds them to the result.
    pub fn deposit(&self, grads: GradientsParams) {
        self.push(Pending::Ready(grads));
    }

    fn push(&self, pending: Pending) {
        let mut inner = self.lock();
        let current = inner.current;
        inner.pending.entry(current).or_default().push(pending);
    }

    /// The parameter gradients of `microbatch` for the parameters of `module`: each weight's
    /// deferred contributions computed and summed (for a [`DeferredLinear`], `dW = Σ Xᵀ dY`),
    /// plus the deposited gradients; all removed from the store. Empty when nothing was
    /// recorded.
    pub fn take<M: Module>(&self, microbatch: usize, module: &M) -> GradientsParams {
        let pending = self.lock().pending.remove(&microbatch).unwrap_or_default();
        let mut sums: Vec<(ParamId, Tensor<2>)> = Vec::new();
        let mut ready = Vec::new();
        for p in pending {
            match p {
                Pending::Weight { param, compute } => {
                    let dw = compute();
                    match sums.iter_mut().find(|(id, _)| *id == param) {
                        Some((_, sum)) => *sum = sum.clone() + dw,
                        None => sums.push((param, dw)),
                    }
                }
                Pending::Ready(grads) => ready.push(grads),
            }
        }
        let mut grads = GradientsParams::new();
        // Under mixed precision the pairs are in the compute dtype: each gradient goes to its
        // weight in the weight's own dtype (the fp32 master's).
        let dtypes = if sums.is_empty() {
            BTreeMap::new()
        } else {
            param_dtypes(module)
        };
        for (id, dw) in sums {
            let dw = match dtypes.get(&id) {
                Some(&dtype) if dtype != dw.dtype() => dw.cast(dtype),
                _ => dw,
            };
            grads.register::<2>(id, dw);
        }
        if !ready.is_empty() {
            ready.push(grads);
            grads = merge(module, ready);
        }
        grads
    }
}

/// The dtype of each float parameter of `module`, by id.
fn param_dtypes<M: Module>(module: &M) -> BTreeMap<ParamId, DType> {
    let index = burn_parallel::index::ParamIndex::with_state(module);
    let entries = index.entries().iter();
    let dtype = |e: &ParamEntry| e.state.as_ref().map(|s| (e.id, s.dtype));
    entries.filter_map(dtype).collect()
}

/// The sum of several gradient sets, parameter by parameter, over `module`'s parameters.
fn merge<M: Module>(module: &M, mut parts: Vec<GradientsParams>) -> GradientsParams {
    struct Merge<'a> {
        parts: &'a mut [GradientsParams],
        out: GradientsParams,
    }
    impl ModuleVisitor for Merge<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let sum = self
                .parts
                .iter_mut()
                .filter_map(|g| g.remove::<D>(param.id))
                .reduce(|a, b| a + b);
            if let Some(sum) = sum {
                self.out.register::<D>(param.id, sum);
            }
        }
    }
    let mut merge = Merge {
        parts: &mut parts,
        out: GradientsParams::new(),
    };
    module.visit(&mut merge);
    merge.out
}

impl WeightGradSink for WeightGradStore {
    fn defer(&self, param: ParamId, compute: Box<dyn FnOnce() -> Tensor<2> + Send>) {
        self.push(Pending::Weight { param, compute });
    }
}

/// A linear layer `y = x W + b` (`W`: `[d_in, d_out]`, as Burn's `Linear`) whose weight
/// gradient is deferred to the store's `W` step (see the module docs). The bias stays an
/// ordinary tracked parameter.
///
/// # Example
/// ```
/// use burn::module::Param;
/// use burn::tensor::{Device, Tensor};
/// use burn_pipeline::deferred::{DeferredLinear, WeightGradStore};
///
/// let device = Device::flex().autodiff();
/// let store = WeightGradStore::new();
/// let w = Param::from_tensor(Tensor::<2>::ones([3, 2], &device));
/// let linear = DeferredLinear::new(w, None, &store);
/// let x = Tensor::<2>::ones([4, 3], &device).require_grad();
/// let grads = linear.forward(x.clone()).sum().backward(); // the `I` step
/// assert_eq!(x.grad(&grads).unwrap().dims(), [4, 3]); // dX now
/// assert!(linear.weight.val().grad(&grads).is_none()); // no dW yet
/// let dw = store.take(0, &linear).get::<2>(linear.weight.id).unwrap(); // the `W` step
/// assert_eq!(dw.into_data().try_to_vec::<f32>().unwrap(), vec![4.0; 6]);
/// ```
#[derive(Module, Debug)]
pub struct DeferredLinear {
    /// Weight `[d_in, d_out]`.
    pub weight: Param<Tensor<2>>,
    /// Bias `[d_out]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// Where the backward records `(X, dY)`.
    #[module(skip)]
    pub store: WeightGradStore,
}

impl DeferredLinear {
    /// A layer with these parameters recording into `store` (share one store per stage).
    pub fn new(
        weight: Param<Tensor<2>>,
        bias: Option<Param<Tensor<1>>>,
        store: &WeightGradStore,
    ) -> Self {
        Self {
            weight,
            bias,
            store: store.clone(),
        }
    }

    /// `[.., d_in] -> [.., d_out]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let dims = x.dims();
        let d_in = dims[D - 1];
        let rows = dims[..D - 1].iter().product::<usize>();
        let d_out = self.weight.dims()[1];
        let y = deferred_matmul(
            x.reshape([rows, d_in]),
            &self.weight,
            Arc::new(self.store.clone()),
        );
        let mut out_dims = dims;
        out_dims[D - 1] = d_out;
        let y = y.reshape(out_dims);
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<D>(),
            None => y,
        }
    }
}
