//! FSDP for any module, as a Burn module: [`Fsdp<M>`] (torchtitan's `fully_shard`).
//!
//! A model declares the sub-modules that may become FSDP units with the type `Fsdp<Layer>`
//! instead of `Layer`, and calls [`Fsdp::get`] in its forward pass. The same model type then
//! trains on one device (the unit is the plain module, at the same parameter paths) and under
//! FSDP, HSDP and FSDP x TP:
//!
//! - [`FsdpPlan::wrap`] builds each unit from an [`Init`] (seeded, tensor-parallel if the `Init`
//!   has a plan) and, when the plan selects its path, keeps only this rank's slice of the unit's
//!   flat parameter space as one 1-D parameter (`<unit path>.flat_shard`). A rank never holds
//!   more than one whole unit, and only while it is being built.
//! - [`Fsdp::get`] all-gathers the flat parameter and returns the unit with its parameters
//!   replaced by slices of it; the backward of the gather reduce-scatters (averages) the
//!   gradient onto the shard.
//! - Because the shard is an ordinary parameter, any Burn optimizer keeps sharded state for it,
//!   and [`TrainStep`](burn_parallel::train::TrainStep) (with
//!   [`TrainStep::with_fsdp`](burn_parallel::train::TrainStep::with_fsdp)) averages the shard
//!   gradients over the replicate group (HSDP) and counts them once in the global norm.
//!
//! Frozen parameters (no `require_grad`) stay whole in the unit and are never updated; Burn's
//! visitors and mappers see them at their own paths (records, checkpoints, replica checks),
//! before the unit's `flat_shard`. So do the trainable parameters a plan keeps whole
//! ([`FsdpPlan::keep_whole`]), such as the experts of a mixture-of-experts layer under expert
//! parallelism, which differ between the ranks of the shard group: they train as parameters
//! outside the units do (their gradients are not reduce-scattered; the training step reduces
//! them).
//! Prefetch ([`FsdpPlan::with_prefetch`], [`Fsdp::prefetch`]) overlaps the next unit's
//! all-gather with the current unit's compute; accumulation without communication
//! ([`DataShards::set_gradient_sync`], `TrainStep::with_fsdp_no_sync`) reduce-scatters each
//! unit's gradient once per step; mixed precision is the training step's (the compute copy's
//! flat shard is gathered, and its gradient reduced, in the compute dtype).
//!
//! # Example
//! ```
//! use burn::module::Module;
//! use burn::tensor::{Device, Tensor, TensorData};
//! use burn_parallel::init::{Init, LinearInit};
//! use burn_parallel::nn::Linear;
//! use burn_parallel::run_local;
//! use burn_zero::{Fsdp, FsdpPlan};
//!
//! let shapes = run_local(2, |group| {
//!     let init = Init::new(1, &Device::flex().autodiff());
//!     let plan = FsdpPlan::new(&group).unit("blocks.*");
//!     let block: Fsdp<Linear> = plan
//!         .wrap(&init.at("blocks").at(0), |init| {
//!             Ok::<_, burn_zero::ZeroError>(init.linear("fc", LinearInit::new(4, 4))?)
//!         })
//!         .unwrap();
//!     plan.finish().unwrap();
//!     let y = block.get().unwrap().forward(Tensor::<2>::ones([1, 4], init.device())).unwrap();
//!     Ok((block.num_params(), y.dims()))
//! })
//! .unwrap();
//! assert_eq!(shapes[0], (8, [1, 4])); // half of the 16 weights on each rank
//! ```

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::ops::{Deref, Range};
use std::sync::{Arc, Mutex};

use burn::module::{
    Content, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor, Param,
    ParamId,
};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::autograd::{BackwardFn, attach};
use burn_parallel::index::{ParamEntry, ParamIndex};
use burn_parallel::init::Init;
use burn_parallel::nn::TpContext;
use burn_parallel::plan::Glob;
use burn_parallel::train::{DataShards, GradientSync};
use burn_parallel::{CollectiveError, ProcessGroup, ReduceOp, Work};

use crate::error::{Result, ZeroError};
use crate::flat::{FlatLayout, shard_range, shard_sizes, strip_params};
use crate::memory::{Category, MemoryTracker};
use crate::zero::paths_where;

/// A sub-module that is an FSDP unit under a sharded layout and the module itself otherwise.
/// See the module docs.
#[derive(Clone)]
pub struct Fsdp<M: Module> {
    inner: Inner<M>,
}

#[derive(Clone)]
enum Inner<M: Module> {
    Plain(M),
    Sharded(Box<Sharded<M>>),
}

#[derive(Clone)]
struct Sharded<M: Module> {
    /// The unit with its sharded parameters replaced by one-element placeholders.
    template: M,
    /// This rank's slice of the flat parameter space.
    shard: Param<Tensor<1>>,
    layout: FlatLayout,
    group: ProcessGroup,
    sizes: Vec<usize>,
    name: String,
    /// Sequence parallelism: the tensor-parallel group and the ranges of the unit's flat space
    /// holding parameters used on sequence shards (norms), whose gradients are summed over it.
    sequence: Option<(ProcessGroup, Vec<Range<usize>>)>,
    /// Paths (inside the unit) of the parameters kept whole in `template`: the frozen ones and
    /// those the plan keeps whole.
    whole: Arc<HashSet<String>>,
    /// Whether the backward reduces the gradient now ([`DataShards::set_gradient_sync`]).
    sync: GradientSync,
    /// The whole gradient summed over the backward passes that did not reduce it. Shared by
    /// the unit's clones and mapped copies (the gradient belongs to the unit, whatever copy
    /// computed it).
    held: Arc<Mutex<Option<Held>>>,
    /// With prefetch on ([`Fsdp::with_prefetch`]): the all-gather started by
    /// [`Fsdp::prefetch`]. Shared by clones; a mapped copy (other values) gets its own.
    prefetch: Option<Arc<PrefetchSlot>>,
    /// Where the unit counts its bytes ([`Fsdp::with_memory`]).
    memory: Option<MemoryTracker>,
}

/// A unit's gradient held between micro-batches (see [`GradientSync`]), summed in fp32.
struct Held {
    /// [`GradientSync::accumulation`] when it was first held.
    accumulation: u64,
    grad: HeldGrad,
}

enum HeldGrad {
    Host(Vec<f32>),
    Device(Box<Tensor<1>>),
}

/// The background all-gather of a unit's flat parameter.
#[derive(Default)]
struct PrefetchSlot {
    gather: Mutex<Option<InFlight>>,
}

/// A prefetch in flight: the asynchronous all-gather ([`ProcessGroup::all_gather_async`]: in
/// device memory on NCCL, on the group's communication thread elsewhere), and its bytes
/// counted as gathered.
struct InFlight {
    work: Work<Tensor<1>>,
    counted: GatherGuard,
}

type Joined = (std::result::Result<Tensor<1>, CollectiveError>, GatherGuard);

thread_local! {
    /// The prefetch this thread has in flight (slot address, unit name): at most one, consumed
    /// by the next gather, which must be that unit's.
    static PREFETCHED: RefCell<Option<(usize, String)>> = const { RefCell::new(None) };
}

/// Forgets this thread's prefetch marker when it names `key`.
fn clear_marker(key: usize) {
    PREFETCHED.with(|p| {
        let mut p = p.borrow_mut();
        if p.as_ref().is_some_and(|(k, _)| *k == key) {
            *p = None;
        }
    });
}

impl PrefetchSlot {
    fn key(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }

    /// Waits for the gather in flight, if any: its result and the guard counting its bytes.
    fn join(self: &Arc<Self>) -> Option<Joined> {
        let InFlight { work, counted } = self
            .gather
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        clear_marker(self.key());
        Some((work.wait(), counted))
    }
}

impl Drop for PrefetchSlot {
    fn drop(&mut self) {
        // Never leave a collective running detached: wait for an unconsumed prefetch.
        let inflight = self
            .gather
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(InFlight { work, counted }) = inflight {
            clear_marker(self as *const Self as usize);
            let _ = work.wait();
            drop(counted);
        }
    }
}

impl<M: Module> fmt::Debug for Fsdp<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Inner::Plain(m) => m.fmt(f),
            Inner::Sharded(s) => write!(
                f,
                "Fsdp({}: {} of {} elements on rank {} of {})",
                s.name,
                s.shard.dims()[0],
                s.layout.numel(),
                s.group.rank(),
                s.group.size()
            ),
        }
    }
}

/// The unit, whole: borrowed when it is not sharded, gathered when it is. Dropping it releases
/// the gathered parameters (the autodiff graph keeps what the backward needs).
pub enum Unit<'a, M> {
    /// The module itself.
    Plain(&'a M),
    /// The module rebuilt from the all-gathered flat parameter, and the guard that counts its
    /// bytes as gathered ([`FsdpPlan::memory`]) until the unit is dropped.
    Gathered(M, GatherGuard),
}

/// Counts a gathered unit's bytes in a [`MemoryTracker`] (category `Gathered`) while it lives.
#[derive(Debug, Default)]
pub struct GatherGuard {
    release: Option<(MemoryTracker, usize)>,
}

impl Drop for GatherGuard {
    fn drop(&mut self) {
        if let Some((tracker, bytes)) = self.release.take() {
            tracker.sub(Category::Gathered, bytes);
        }
    }
}

impl<M> Deref for Unit<'_, M> {
    type Target = M;

    fn deref(&self) -> &M {
        match self {
            Unit::Plain(m) => m,
            Unit::Gathered(m, _) => m,
        }
    }
}

impl<M: Module> Fsdp<M> {
    /// The module as it is (no sharding).
    pub fn new(module: M) -> Self {
        Self {
            inner: Inner::Plain(module),
        }
    }

    /// Shards `module` over `group`: flattens its trainable parameters in visiting order and
    /// keeps this rank's contiguous slice; frozen parameters stay whole. `module` must be the
    /// same on every rank (built from the same seed). `tp` is the tensor-parallel context the
    /// module was built with: its shards are counted over `tp` in the global norm, and under
    /// sequence parallelism the gradients of its norms are summed over `tp` in the backward of
    /// [`Self::get`]. The shard is registered in `shards`.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when the unit has no trainable parameter.
    pub fn shard(name: &str, module: M, shards: &DataShards, tp: &TpContext) -> Result<Self> {
        Self::shard_keeping(name, module, shards, tp, &|_| false)
    }

    /// [`Self::shard`], keeping whole (out of the flat parameter) the trainable parameters for
    /// which `keep_whole` is true, besides the frozen ones: parameters that are not the same on
    /// every rank of the shard group (the experts of an expert-parallel layer). They are seen
    /// at their own paths by visitors and mappers, so the optimizer updates them, and their
    /// gradients reach the training step unreduced (reduce them there, as those of parameters
    /// outside the units).
    ///
    /// # Arguments
    /// * `name` - the unit's path, for messages.
    /// * `module` - the unit, the same on every rank for the parameters to shard.
    /// * `shards` - where the flat shard is registered.
    /// * `tp` - the tensor-parallel context the module was built with.
    /// * `keep_whole` - which trainable parameters (by id) stay out of the flat parameter.
    ///
    /// # Returns
    /// The unit, sharded.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when the unit has no parameter left to shard.
    ///
    /// # Example
    /// ```
    /// use burn::module::Module;
    /// use burn::tensor::Device;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::run_local;
    /// use burn_parallel::train::DataShards;
    /// use burn_zero::Fsdp;
    ///
    /// let counts = run_local(2, |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     let fc = init.linear("fc", LinearInit::new(4, 4).with_bias(true)).unwrap(); // 16 + 4
    ///     let bias = fc.bias.as_ref().unwrap().id;
    ///     let shards = DataShards::new(&group);
    ///     let unit = Fsdp::shard_keeping("fc", fc, &shards, &init.context(), &|id| id == bias)
    ///         .unwrap();
    ///     Ok(unit.num_params())
    /// })
    /// .unwrap();
    /// assert_eq!(counts, vec![8 + 4, 8 + 4]); // half of the weight, the whole bias
    /// ```
    pub fn shard_keeping(
        name: &str,
        module: M,
        shards: &DataShards,
        tp: &TpContext,
        keep_whole: &dyn Fn(ParamId) -> bool,
    ) -> Result<Self> {
        let whole = whole_paths(&module, keep_whole);
        let keep = |path: &str| !whole.contains(path);
        let layout = FlatLayout::of(&module, keep);
        if layout.numel() == 0 {
            return Err(ZeroError::Config(format!(
                "FSDP unit `{name}` has no trainable parameter to shard (every parameter is \
                 frozen or kept whole): do not make it a unit"
            )));
        }
        let group = shards.group().clone();
        let range = shard_range(layout.numel(), group.rank(), group.size());
        let full = layout.flatten(&module)?;
        let device = first_device(&module);
        let values = full[range.clone()].to_vec();
        drop(full);
        let len = values.len();
        let shard = Param::from_data(TensorData::new(values, [len]), &device);
        // Which elements of this shard belong to tensor-parallel shards.
        let tp_sharded = tp.sharded_ids();
        let tp_ranges = layout
            .entries()
            .iter()
            .zip(layout.ids())
            .filter(|(_, id)| tp_sharded.contains(id))
            .filter_map(|(e, _)| intersect(e.offset..e.offset + e.numel, &range))
            .collect();
        shards.register(shard.id, tp_ranges);
        shards.register_flat(shard.id, layout.parts(range.clone()));
        let sequence_ids: HashSet<ParamId> = tp.sequence_param_ids().into_iter().collect();
        let sequence_ranges: Vec<Range<usize>> = layout
            .entries()
            .iter()
            .zip(layout.ids())
            .filter(|(_, id)| sequence_ids.contains(id))
            .map(|(e, _)| e.offset..e.offset + e.numel)
            .collect();
        let sequence = match tp.group() {
            Some(group) if !sequence_ranges.is_empty() => Some((group.clone(), sequence_ranges)),
            _ => None,
        };
        Ok(Self {
            inner: Inner::Sharded(Box::new(Sharded {
                template: strip_params(module, keep),
                shard,
                sizes: shard_sizes(layout.numel(), group.size()),
                layout,
                group,
                name: name.to_string(),
                sequence,
                sync: shards.gradient_sync().clone(),
                held: Arc::default(),
                prefetch: None,
                memory: None,
                whole: Arc::new(whole),
            })),
        })
    }

    /// The unit without a collective: the module itself when it is not sharded; when it is,
    /// the module whose sharded parameters are one-element placeholders and whose parameters
    /// kept whole (frozen, or kept whole by the plan) are real. For reading what the flat
    /// parameter does not hold (configuration, `#[module(skip)]` state, kept-whole
    /// parameters) without gathering; use [`Self::get`] to compute with the unit.
    pub fn skeleton(&self) -> &M {
        match &self.inner {
            Inner::Plain(m) => m,
            Inner::Sharded(s) => &s.template,
        }
    }

    /// Whether the unit is sharded.
    pub fn is_sharded(&self) -> bool {
        matches!(self.inner, Inner::Sharded(_))
    }

    /// Turns prefetch on or off for this unit (a no-op when it is not sharded): with it on,
    /// [`Self::prefetch`] starts the unit's all-gather in the background. [`FsdpPlan::with_prefetch`]
    /// sets it for every unit of a plan.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        if let Inner::Sharded(s) = &mut self.inner {
            s.prefetch = on.then(Arc::default);
        }
        self
    }

    /// Counts the unit's memory in `tracker` (see [`crate::memory`]): its flat shard and the
    /// parameters it keeps whole now (params), the unit while gathered, prefetches included
    /// (gathered), and the whole gradient no-sync accumulation holds (grads). A no-op when it
    /// is not sharded. [`FsdpPlan::wrap`] does it with [`FsdpPlan::memory`].
    pub fn with_memory(mut self, tracker: &MemoryTracker) -> Self {
        if let Inner::Sharded(s) = &mut self.inner {
            let shard = s.shard.val();
            // The parameters the template keeps whole (the others are placeholders there).
            let template = ParamIndex::with_state(&s.template);
            let whole = template
                .entries()
                .iter()
                .filter(|e| s.whole.contains(&e.path));
            let whole: usize = whole.map(state_bytes).sum();
            let bytes = shard.shape().num_elements() * shard.dtype().size() + whole;
            tracker.add(Category::Params, bytes);
            s.memory = Some(tracker.clone());
        }
        self
    }

    /// Starts this unit's all-gather on a background thread and returns at once, so that the
    /// bytes travel while the caller computes with the unit before it; the next [`Self::get`]
    /// of this unit takes the result. A no-op when the unit is not sharded, prefetch is off
    /// ([`Self::with_prefetch`]) or this unit's prefetch is already in flight.
    ///
    /// The pattern, in a forward over units `layers`: gather unit `i`, prefetch unit `i + 1`,
    /// compute unit `i`. At most one prefetch is in flight per thread and the next gather must
    /// be of that unit: its all-gather shares the shard group's order with every other
    /// collective of that group, so it must not overtake one.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidArgument`] when another unit's prefetch is in flight or the
    /// thread cannot be started.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::nn::Linear;
    /// use burn_parallel::run_local;
    /// use burn_zero::{Fsdp, FsdpPlan};
    ///
    /// let outputs = run_local(2, |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     let plan = FsdpPlan::new(&group).unit("layers.*").with_prefetch(true);
    ///     let layers: Vec<Fsdp<Linear>> = (0..3)
    ///         .map(|i| {
    ///             plan.wrap(&init.at("layers").at(i), |init| {
    ///                 Ok::<_, burn_zero::ZeroError>(init.linear("fc", LinearInit::new(4, 4))?)
    ///             })
    ///         })
    ///         .collect::<Result<_, _>>()
    ///         .unwrap();
    ///     let mut x = Tensor::<2>::ones([2, 4], init.device());
    ///     for (i, layer) in layers.iter().enumerate() {
    ///         let unit = layer.get()?; // takes the prefetched gather from i > 0 on
    ///         if let Some(next) = layers.get(i + 1) {
    ///             next.prefetch()?; // travels while `unit` computes
    ///         }
    ///         x = unit.forward(x).unwrap();
    ///     }
    ///     Ok(x.dims())
    /// })
    /// .unwrap();
    /// assert_eq!(outputs[0], [2, 4]);
    /// ```
    pub fn prefetch(&self) -> std::result::Result<(), CollectiveError> {
        let (s, slot) = match &self.inner {
            Inner::Sharded(s) => match &s.prefetch {
                Some(slot) => (s, slot),
                None => return Ok(()),
            },
            Inner::Plain(_) => return Ok(()),
        };
        let key = slot.key();
        match PREFETCHED.with(|p| p.borrow().clone()) {
            Some((k, _)) if k == key => return Ok(()),
            Some((_, other)) => {
                return Err(s.invalid(
                    "Fsdp::prefetch",
                    format!(
                        "unit `{other}` was prefetched and not gathered yet: gather it \
                         (Fsdp::get) before prefetching another unit"
                    ),
                ));
            }
            None => {}
        }
        let shard = s.shard.val().detach();
        let counted = s.count_gathered(s.layout.numel() * shard.dtype().size());
        let work = s.group.all_gather_async(shard, 0);
        *slot.gather.lock().unwrap_or_else(|e| e.into_inner()) = Some(InFlight { work, counted });
        PREFETCHED.with(|p| *p.borrow_mut() = Some((key, s.name.clone())));
        Ok(())
    }

    /// The whole unit for a forward pass: all-gathers the flat parameter when sharded (a
    /// collective: every rank of the shard group calls it, in the same order), or takes the
    /// result of its [`Self::prefetch`].
    ///
    /// The backward reduce-scatters (averages) the unit's gradient onto the shard; with the
    /// shards' gradient sync off ([`DataShards::set_gradient_sync`]) it holds the whole
    /// gradient instead, and the next backward with the sync on reduces the sum.
    ///
    /// # Errors
    /// Collective errors; [`CollectiveError::InvalidArgument`] when another unit's prefetch is
    /// in flight on this thread (see [`Self::prefetch`]).
    pub fn get(&self) -> std::result::Result<Unit<'_, M>, CollectiveError> {
        let s = match &self.inner {
            Inner::Plain(m) => return Ok(Unit::Plain(m)),
            Inner::Sharded(s) => s,
        };
        let key = s.prefetch.as_ref().map(PrefetchSlot::key);
        if let Some((k, other)) = PREFETCHED.with(|p| p.borrow().clone())
            && Some(k) != key
        {
            return Err(s.invalid(
                "Fsdp::get",
                format!(
                    "unit `{other}` was prefetched but `{}` is gathered first: prefetch only \
                     the unit gathered next (its all-gather must not overtake another \
                     collective of the shard group)",
                    s.name
                ),
            ));
        }
        let shard = s.shard.val();
        let prefetched = s.prefetch.as_ref().and_then(PrefetchSlot::join);
        // On the device when the group collects there (NCCL), else through host memory.
        let (full, counted) = match prefetched {
            Some((full, counted)) => (full?, counted),
            None => {
                let full = s.group.all_gather(shard.clone().detach(), 0)?;
                let bytes = full.shape().num_elements() * full.dtype().size();
                (full, s.count_gathered(bytes))
            }
        };
        let on_device = s.group.collects_on_device(&shard.device());
        let n = s.sizes[s.group.rank()];
        let (group, sizes, sequence) = (s.group.clone(), s.sizes.clone(), s.sequence.clone());
        let (group_d, sizes_d, sequence_d) = (group.clone(), sizes.clone(), sequence.clone());
        let (sync, held, memory) = (s.sync.clone(), s.held.clone(), s.memory.clone());
        let (sync_d, held_d, memory_d) = (sync.clone(), held.clone(), memory.clone());
        let full = attach(
            shard,
            full,
            BackwardFn::new("Fsdp::get", move |grad| {
                let dtype = grad.dtype();
                let Some(grad) = hold_host(&held, &sync, memory.as_ref(), grad) else {
                    return Ok(TensorData::new(vec![0f32; n], [n]).convert_dtype(dtype));
                };
                let grad = match &sequence {
                    Some((tp, ranges)) => sum_ranges(grad, tp, ranges)?,
                    None => grad,
                };
                group.reduce_scatter_data(grad, 0, ReduceOp::Avg, Some(&sizes))
            })
            .on_device_if::<1>(on_device, move |grad| {
                let zeros = grad.clone().narrow(0, 0, n).zeros_like();
                let Some(grad) = hold_device(&held_d, &sync_d, memory_d.as_ref(), grad) else {
                    return Ok(zeros);
                };
                let grad = match &sequence_d {
                    Some((tp, ranges)) => sum_ranges_on_device(grad, tp, ranges)?,
                    None => grad,
                };
                group_d.reduce_scatter(grad, 0, ReduceOp::Avg, Some(&sizes_d))
            }),
        );
        let module = s
            .layout
            .unflatten(s.template.clone(), full, false)
            .map_err(|e| s.invalid(&format!("Fsdp::get({})", s.name), e.to_string()))?;
        Ok(Unit::Gathered(module, counted))
    }

    /// The whole unit, detached from any graph, as a plain module (for export and comparison).
    /// A collective when sharded.
    ///
    /// # Errors
    /// Collective errors.
    pub fn full(&self) -> std::result::Result<M, CollectiveError> {
        match &self.inner {
            Inner::Plain(m) => Ok(m.clone()),
            Inner::Sharded(_) => Ok(self.get()?.deref().clone().no_grad()),
        }
    }
}

/// Sums the elements of `ranges` of the 1-D `grad` over `group` (the gradients of the norms
/// each tensor-parallel rank computed on its part of the sequence), leaving the rest.
fn sum_ranges(
    grad: TensorData,
    group: &ProcessGroup,
    ranges: &[Range<usize>],
) -> std::result::Result<TensorData, CollectiveError> {
    let dtype = grad.dtype();
    let mut values = grad
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("converted to f32");
    let picked: Vec<f32> = ranges
        .iter()
        .flat_map(|r| values[r.clone()].to_vec())
        .collect();
    let summed = group.all_reduce_f32(picked, ReduceOp::Sum)?;
    let mut at = 0;
    for r in ranges {
        values[r.clone()].copy_from_slice(&summed[at..at + r.len()]);
        at += r.len();
    }
    let len = values.len();
    Ok(TensorData::new(values, [len]).convert_dtype(dtype))
}

/// [`sum_ranges`] on the gradient as a tensor on its device (the group's tensor-level
/// all-reduce: NCCL when the group collects there).
fn sum_ranges_on_device(
    grad: Tensor<1>,
    group: &ProcessGroup,
    ranges: &[Range<usize>],
) -> std::result::Result<Tensor<1>, CollectiveError> {
    let picked = Tensor::cat(
        ranges
            .iter()
            .map(|r| grad.clone().slice(r.clone()))
            .collect(),
        0,
    );
    let summed = group.all_reduce(picked, ReduceOp::Sum)?;
    let mut at = 0;
    let mut grad = grad;
    for r in ranges {
        grad = grad.slice_assign(r.clone(), summed.clone().narrow(0, at, r.len()));
        at += r.len();
    }
    Ok(grad)
}

impl<M: Module> Sharded<M> {
    /// Counts `bytes` as gathered until the returned guard drops.
    fn count_gathered(&self, bytes: usize) -> GatherGuard {
        GatherGuard {
            release: self.memory.as_ref().map(|t| {
                t.add(Category::Gathered, bytes);
                (t.clone(), bytes)
            }),
        }
    }

    fn invalid(&self, op: &str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            rank: self.group.global_rank(),
            op: op.to_string(),
            reason,
        }
    }
}

/// The unit's whole gradient `grad` plus what it holds: returned to be reduced when the
/// gradient sync is on, held (and `None` returned) when it is off. What an earlier, abandoned
/// accumulation left is dropped. The held buffer (fp32) counts as gradient memory.
fn hold_host(
    held: &Mutex<Option<Held>>,
    sync: &GradientSync,
    memory: Option<&MemoryTracker>,
    grad: TensorData,
) -> Option<TensorData> {
    let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
    let accumulation = sync.accumulation();
    let (dtype, shape) = (grad.dtype(), grad.shape().clone());
    let mut values = grad
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("converted to f32");
    let bytes = values.len() * 4;
    if let Some(before) = take_held(&mut held, memory, bytes)
        && before.accumulation == accumulation
        && let HeldGrad::Host(sum) = before.grad
    {
        values.iter_mut().zip(sum).for_each(|(v, s)| *v += s);
    }
    if sync.is_on() {
        return Some(TensorData::new(values, shape).convert_dtype(dtype));
    }
    if let Some(t) = memory {
        t.add(Category::Grads, bytes);
    }
    *held = Some(Held {
        accumulation,
        grad: HeldGrad::Host(values),
    });
    None
}

/// [`hold_host`] on the device (the sum kept in fp32 there).
fn hold_device(
    held: &Mutex<Option<Held>>,
    sync: &GradientSync,
    memory: Option<&MemoryTracker>,
    grad: Tensor<1>,
) -> Option<Tensor<1>> {
    let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
    let accumulation = sync.accumulation();
    let dtype = grad.dtype();
    let bytes = grad.shape().num_elements() * 4;
    let mut sum = grad.cast(burn::tensor::DType::F32);
    if let Some(before) = take_held(&mut held, memory, bytes)
        && before.accumulation == accumulation
        && let HeldGrad::Device(before) = before.grad
    {
        sum = sum + *before;
    }
    if sync.is_on() {
        return Some(sum.cast(dtype));
    }
    if let Some(t) = memory {
        t.add(Category::Grads, bytes);
    }
    *held = Some(Held {
        accumulation,
        grad: HeldGrad::Device(Box::new(sum)),
    });
    None
}

/// Takes what a unit holds, releasing its `bytes` from the gradient count.
fn take_held(
    held: &mut Option<Held>,
    memory: Option<&MemoryTracker>,
    bytes: usize,
) -> Option<Held> {
    let before = held.take()?;
    if let Some(t) = memory {
        t.sub(Category::Grads, bytes);
    }
    Some(before)
}

fn intersect(a: Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let (start, end) = (a.start.max(b.start), a.end.min(b.end));
    (start < end).then(|| start - b.start..end - b.start)
}

/// Paths of the parameters of `module` that stay whole in a unit: those that do not require a
/// gradient (on an autodiff device) and those `keep_whole` selects.
fn whole_paths<M: Module>(module: &M, keep_whole: &dyn Fn(ParamId) -> bool) -> HashSet<String> {
    // Off autodiff no tensor requires a gradient: there, every parameter is trainable.
    let index = ParamIndex::with_state(module);
    let whole = index.entries().iter();
    let whole = whole.filter(|e| e.is_frozen() || keep_whole(e.id));
    whole.map(|e| e.path.clone()).collect()
}

fn first_device<M: Module>(module: &M) -> Device {
    module.devices().into_iter().next().unwrap_or_default()
}

impl<M: Module> Module for Fsdp<M> {
    fn collect_devices(&self, devices: Vec<Device>) -> Vec<Device> {
        match &self.inner {
            Inner::Plain(m) => m.collect_devices(devices),
            Inner::Sharded(s) => Module::collect_devices(&s.shard, devices),
        }
    }

    fn fork(self, device: &Device) -> Self {
        self.map_inner(|m| m.fork(device), |p| Module::fork(p, device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.map_inner(|m| m.to_device(device), |p| Module::to_device(p, device))
    }

    fn train(self) -> Self {
        self.map_inner(Module::train, Module::train)
    }

    fn valid(&self) -> Self {
        self.clone().map_inner(|m| m.valid(), |p| Module::valid(&p))
    }

    fn materialize(self) -> Self {
        self.map_inner(Module::materialize, Module::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        match &self.inner {
            Inner::Plain(m) => m.visit(visitor),
            Inner::Sharded(s) => {
                // The parameters kept whole, at their own paths; then the flat shard.
                s.template.visit(&mut WholeOnly {
                    inner: visitor,
                    path: Vec::new(),
                    whole: &s.whole,
                });
                visitor.enter_module("flat_shard", "Struct:Fsdp");
                Module::visit(&s.shard, visitor);
                visitor.exit_module("flat_shard", "Struct:Fsdp");
            }
        }
    }

    fn map<Mp: ModuleMapper>(self, mapper: &mut Mp) -> Self {
        match self.inner {
            Inner::Plain(m) => Self::new(m.map(mapper)),
            Inner::Sharded(mut s) => {
                let whole = s.whole.clone();
                s.template = s.template.map(&mut WholeOnly {
                    inner: mapper,
                    path: Vec::new(),
                    whole: &whole,
                });
                mapper.enter_module("flat_shard", "Struct:Fsdp");
                s.shard = Module::map(s.shard, mapper);
                mapper.exit_module("flat_shard", "Struct:Fsdp");
                // Other values: a prefetch of the old ones is not this copy's.
                s.prefetch = s.prefetch.as_ref().map(|_| Arc::default());
                Self {
                    inner: Inner::Sharded(s),
                }
            }
        }
    }
}

/// The bytes of a parameter of an index built [`ParamIndex::with_state`].
fn state_bytes(e: &ParamEntry) -> usize {
    let dtype = e.state.as_ref().expect("an index with_state").dtype;
    e.numel() * dtype.size()
}

/// Shows a visitor or mapper only the parameters a unit's template keeps whole (frozen or kept
/// whole by the plan; the others there are placeholders, their values live in the flat shard).
struct WholeOnly<'a, T> {
    inner: &'a mut T,
    path: Vec<String>,
    whole: &'a HashSet<String>,
}

impl<T> WholeOnly<'_, T> {
    fn is_whole(&self) -> bool {
        self.whole.contains(&self.path.join("."))
    }
}

impl<V: ModuleVisitor> ModuleVisitor for WholeOnly<'_, V> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        self.inner.enter_module(name, container_type);
    }
    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.path.pop();
        self.inner.exit_module(name, container_type);
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.is_whole() {
            self.inner.visit_float(param);
        }
    }
}

impl<Mp: ModuleMapper> ModuleMapper for WholeOnly<'_, Mp> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        self.inner.enter_module(name, container_type);
    }
    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.path.pop();
        self.inner.exit_module(name, container_type);
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.is_whole() {
            self.inner.map_float(param)
        } else {
            param
        }
    }
}

impl<M: Module> Fsdp<M> {
    /// Applies `plain` to an unsharded module, `shard` to the flat shard (and `plain` to the
    /// template, which holds the parameters kept whole).
    fn map_inner(
        self,
        plain: impl Fn(M) -> M,
        shard: impl FnOnce(Param<Tensor<1>>) -> Param<Tensor<1>>,
    ) -> Self {
        match self.inner {
            Inner::Plain(m) => Self::new(plain(m)),
            Inner::Sharded(mut s) => {
                s.template = plain(s.template);
                s.shard = shard(s.shard);
                s.prefetch = s.prefetch.as_ref().map(|_| Arc::default());
                Self {
                    inner: Inner::Sharded(s),
                }
            }
        }
    }
}

impl<M: Module> ModuleDisplayDefault for Fsdp<M> {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_single(&format!("{self:?}")).optional()
    }
}

impl<M: Module> ModuleDisplay for Fsdp<M> {}

/// Selects units by module path.
type UnitPredicate = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Selects the parameters kept whole, by id.
type ParamPredicate = Arc<dyn Fn(ParamId) -> bool + Send + Sync>;

/// Which sub-modules of a model become FSDP units, by module path (globs as in
/// [`burn_parallel::plan`]) or by a predicate, over which shard group; and the registry of the
/// shards for [`TrainStep::with_fsdp`](burn_parallel::train::TrainStep::with_fsdp).
#[derive(Clone)]
pub struct FsdpPlan {
    shards: DataShards,
    units: Vec<Glob>,
    predicate: Option<UnitPredicate>,
    keep_whole: Option<ParamPredicate>,
    prefetch: bool,
    memory: MemoryTracker,
    used: Arc<Mutex<Vec<bool>>>,
    errors: Vec<String>,
}

impl fmt::Debug for FsdpPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsdpPlan")
            .field("group_size", &self.shards.group().size())
            .field("units", &self.units)
            .finish()
    }
}

impl FsdpPlan {
    /// Units sharded over `group` (the `dp_shard` group of the mesh); no unit selected yet.
    pub fn new(group: &ProcessGroup) -> Self {
        Self {
            shards: DataShards::new(group),
            units: Vec::new(),
            predicate: None,
            keep_whole: None,
            prefetch: false,
            memory: MemoryTracker::default(),
            used: Arc::new(Mutex::new(Vec::new())),
            errors: Vec::new(),
        }
    }

    /// Makes the sub-modules whose path matches `pattern` units.
    pub fn unit(mut self, pattern: &str) -> Self {
        match Glob::new(pattern) {
            Ok(glob) => {
                self.units.push(glob);
                self.used.lock().expect("plan bookkeeping").push(false);
            }
            Err(e) => self.errors.push(e.to_string()),
        }
        self
    }

    /// Makes the sub-modules whose path passes `predicate` units.
    pub fn unit_if(mut self, predicate: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.predicate = Some(Arc::new(predicate));
        self
    }

    /// Keeps whole, in every unit, the trainable parameters whose id passes `predicate`
    /// (checked once the unit is built, so ids registered while building it count): parameters
    /// that differ between the ranks of the shard group, such as the experts of an
    /// expert-parallel MoE layer. See [`Fsdp::shard_keeping`]; reduce their gradients in the
    /// training step (for experts, `burn_moe::MoeStep` does).
    ///
    /// # Example
    /// ```
    /// use burn::module::{Module, ParamId};
    /// use burn::tensor::Device;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::nn::Linear;
    /// use burn_parallel::run_local;
    /// use burn_zero::{Fsdp, FsdpPlan};
    /// use std::sync::{Arc, Mutex};
    ///
    /// let counts = run_local(2, |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     // The ids to keep whole become known while the unit is built.
    ///     let kept: Arc<Mutex<Vec<ParamId>>> = Arc::default();
    ///     let seen = kept.clone();
    ///     let plan = FsdpPlan::new(&group)
    ///         .unit("blocks.*")
    ///         .keep_whole(move |id| seen.lock().unwrap().contains(&id));
    ///     let block: Fsdp<Linear> = plan
    ///         .wrap(&init.at("blocks").at(0), |init| {
    ///             let fc = init.linear("fc", LinearInit::new(4, 4).with_bias(true))?;
    ///             kept.lock().unwrap().push(fc.bias.as_ref().unwrap().id);
    ///             Ok::<_, burn_zero::ZeroError>(fc)
    ///         })
    ///         .unwrap();
    ///     plan.finish().unwrap();
    ///     Ok(block.num_params())
    /// })
    /// .unwrap();
    /// assert_eq!(counts, vec![12, 12]); // 8 of the 16 weights, the 4 biases whole
    /// ```
    pub fn keep_whole(
        mut self,
        predicate: impl Fn(ParamId) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.keep_whole = Some(Arc::new(predicate));
        self
    }

    /// Turns prefetch on for every unit the plan builds ([`Fsdp::with_prefetch`]): the model's
    /// forward calls [`Fsdp::prefetch`] on the next unit after gathering the current one, and
    /// its all-gather overlaps the current unit's compute. Costs one more gathered unit of
    /// memory.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }

    /// The memory the plan's units account for, per rank ([`Fsdp::with_memory`]): their shards
    /// and kept-whole parameters, the units gathered at a time (prefetches included) and the
    /// gradients no-sync accumulation holds. The training loop adds what Burn holds for the
    /// shards: their gradients ([`Self::gradient_bytes`]) and the optimizer's state
    /// ([`Self::optimizer_bytes`]). Parameters outside the units are not counted.
    ///
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::run_local;
    /// use burn_zero::FsdpPlan;
    ///
    /// let reports = run_local(2, |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     let plan = FsdpPlan::new(&group).unit("fc");
    ///     let fc = plan
    ///         .wrap(&init.at("fc"), |init| {
    ///             Ok::<_, burn_zero::ZeroError>(init.linear("", LinearInit::new(4, 4))?)
    ///         })
    ///         .unwrap();
    ///     let x = Tensor::<2>::ones([1, 4], init.device());
    ///     let _y = fc.get()?.forward(x).unwrap(); // gathered while the unit lives
    ///     Ok(plan.memory().report())
    /// })
    /// .unwrap();
    /// assert_eq!(reports[0].current.params, 8 * 4); // half of the 16 weights, fp32
    /// assert_eq!(reports[0].peak.gathered, 16 * 4); // the whole unit, once
    /// assert_eq!(reports[0].current.gathered, 0);
    /// ```
    pub fn memory(&self) -> &MemoryTracker {
        &self.memory
    }

    /// The bytes of the flat shards' gradients in `grads` (what Burn holds for them between
    /// the backward and the optimizer step).
    pub fn gradient_bytes(&self, grads: &GradientsParams) -> usize {
        self.shards
            .ids()
            .into_iter()
            .filter_map(|id| grads.get::<1>(id))
            .map(|g| g.shape().num_elements() * g.dtype().size())
            .sum()
    }

    /// The bytes of the flat shards' gradients once the backward made them: the shards of
    /// `model`'s parameters, in their dtype. For a memory account where the gradients are out
    /// of sight (a step engine's), as [`Self::gradient_bytes`] counts them.
    pub fn shard_gradient_bytes<M: Module>(&self, model: &M) -> usize {
        let ids: HashSet<ParamId> = self.shards.ids().into_iter().collect();
        let index = ParamIndex::with_state(model);
        let shards = index.entries().iter().filter(|e| ids.contains(&e.id));
        shards.map(state_bytes).sum()
    }

    /// The bytes of `optim`'s state for the flat shards (moments and the like). Reads the
    /// state through the optimizer's record (a copy to the host): call it once, for a report.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when the record cannot be read.
    pub fn optimizer_bytes(&self, optim: &ModuleOptimizer) -> Result<usize> {
        let ids: HashSet<u64> = self.shards.ids().into_iter().map(|id| id.val()).collect();
        let unreadable = |e: String| ZeroError::Config(format!("optimizer record: {e}"));
        let bytes = optim
            .to_record()
            .into_bytes()
            .map_err(|e| unreadable(format!("{e:?}")))?;
        let tensors = burn_pack::Reader::from_bytes(bytes)
            .and_then(|r| r.into_tensors())
            .map_err(|e| unreadable(format!("{e:?}")))?;
        Ok(tensors
            .iter()
            .filter(|t| t.param_id.is_some_and(|id| ids.contains(&id)))
            .map(|t| t.byte_len())
            .sum())
    }

    /// The registry of the shards, for [`TrainStep::with_fsdp`](burn_parallel::train::TrainStep::with_fsdp),
    /// and the switch of the units' gradient reduction ([`DataShards::set_gradient_sync`]).
    ///
    /// Accumulating micro-batches with one reduce-scatter per unit (what
    /// [`TrainStep::with_fsdp_no_sync`](burn_parallel::train::TrainStep::with_fsdp_no_sync)
    /// does for you):
    /// ```
    /// use burn::optim::{GradientsAccumulator, GradientsParams};
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::nn::Linear;
    /// use burn_parallel::run_local;
    /// use burn_zero::{Fsdp, FsdpPlan};
    ///
    /// run_local(2, |group| {
    ///     let init = Init::new(1, &Device::flex().autodiff());
    ///     let plan = FsdpPlan::new(&group).unit("fc");
    ///     let fc: Fsdp<Linear> = plan
    ///         .wrap(&init.at("fc"), |init| {
    ///             Ok::<_, burn_zero::ZeroError>(init.linear("", LinearInit::new(4, 4))?)
    ///         })
    ///         .unwrap();
    ///     let shards = plan.shards();
    ///     let x = Tensor::<2>::ones([2, 4], init.device());
    ///     let mut acc = GradientsAccumulator::<Fsdp<Linear>>::new();
    ///     shards.begin_accumulation();
    ///     for last in [false, false, true] {
    ///         shards.set_gradient_sync(last); // communicate on the last micro-batch only
    ///         let loss = fc.get()?.forward(x.clone()).unwrap().sum() / 3.0;
    ///         acc.accumulate(&fc, GradientsParams::from_grads(loss.backward(), &fc));
    ///     }
    ///     let _grads = acc.grads(); // the shard's gradient, averaged over the shard group
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn shards(&self) -> &DataShards {
        &self.shards
    }

    fn selects(&self, path: &str) -> bool {
        let mut selected = self.predicate.as_ref().is_some_and(|p| p(path));
        let mut used = self.used.lock().expect("plan bookkeeping");
        for (glob, used) in self.units.iter().zip(used.iter_mut()) {
            if glob.matches(path) {
                *used = true;
                selected = true;
            }
        }
        selected
    }

    /// Builds the sub-module at `init`'s path with `build` and makes it a unit when the plan
    /// selects the path and the shard group has more than one rank.
    ///
    /// # Errors
    /// What `build` returns; [`ZeroError::Config`] for a malformed pattern or a unit without
    /// trainable parameters; [`ZeroError::Replica`], on every rank, when the ranks of the
    /// shard group built different units (collective: every rank of the group wraps its units
    /// in the same order).
    pub fn wrap<M: Module, E>(
        &self,
        init: &Init,
        build: impl FnOnce(&Init) -> std::result::Result<M, E>,
    ) -> std::result::Result<Fsdp<M>, E>
    where
        E: From<ZeroError>,
    {
        if let Some(e) = self.errors.first() {
            return Err(ZeroError::Config(e.clone()).into());
        }
        let module = build(init)?;
        let path = init.path("");
        let path = path.trim_end_matches('.');
        if !self.selects(path) || self.shards.group().size() == 1 {
            return Ok(Fsdp::new(module));
        }
        let keep_whole: &dyn Fn(ParamId) -> bool = match &self.keep_whole {
            Some(predicate) => predicate.as_ref(),
            None => &|_| false,
        };
        // Every rank must slice the same unit: a build that differs between the ranks (an
        // unseeded initialisation) is refused on every rank, naming the first parameter that
        // differs, instead of training a mix of replicas. Parameters kept whole may differ.
        let whole = paths_where(&module, keep_whole);
        burn_parallel::replica::verify_replicas_in(&module, &[self.shards.group()], |p| {
            !whole.contains(p)
        })
        .map_err(ZeroError::from)?;
        Ok(
            Fsdp::shard_keeping(path, module, &self.shards, &init.context(), keep_whole)?
                .with_prefetch(self.prefetch)
                .with_memory(&self.memory),
        )
    }

    /// Ends the construction: every pattern must have matched a unit.
    ///
    /// # Errors
    /// [`ZeroError::Config`] naming the patterns that matched nothing.
    pub fn finish(&self) -> Result<()> {
        let used = self.used.lock().expect("plan bookkeeping");
        let unused: Vec<&str> = self
            .units
            .iter()
            .zip(used.iter())
            .filter(|(_, u)| !**u)
            .map(|(g, _)| g.as_str())
            .collect();
        if unused.is_empty() {
            Ok(())
        } else {
            Err(ZeroError::Config(format!(
                "FSDP unit patterns matched no module built through FsdpPlan::wrap: {unused:?}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_parallel::init::LinearInit;
    use burn_parallel::nn::Linear;
    use burn_parallel::run_local;

    fn layers(plan: &FsdpPlan, init: &Init) -> Vec<Fsdp<Linear>> {
        (0..3)
            .map(|i| {
                plan.wrap(&init.at("layers").at(i), |init| {
                    Ok::<_, ZeroError>(init.linear("fc", LinearInit::new(4, 4))?)
                })
                .unwrap()
            })
            .collect()
    }

    fn weight(unit: &Unit<'_, Linear>) -> Vec<f32> {
        unit.weight.val().into_data().try_to_vec::<f32>().unwrap()
    }

    /// The plan's memory figures, against the sizes: the shards (params), one unit gathered at
    /// a time without prefetch and two with it (gathered), the whole gradients no-sync holds
    /// and the shards' gradients (grads), AdamW's two moments of the shards (optimizer).
    #[test]
    fn memory_counts_shards_gathered_units_held_gradients_and_optimizer_state() {
        use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
        let out = run_local(2, |group| {
            let mut figures = Vec::new();
            for prefetch in [false, true] {
                let init = Init::new(3, &Device::flex().autodiff());
                let plan = FsdpPlan::new(&group)
                    .unit("layers.*")
                    .with_prefetch(prefetch);
                let units = layers(&plan, &init);
                let shards = plan.shards();
                let mut acc = GradientsAccumulator::<Vec<Fsdp<Linear>>>::new();
                shards.begin_accumulation();
                let mut held = 0;
                for last in [false, true] {
                    shards.set_gradient_sync(last);
                    let mut x = Tensor::<2>::ones([2, 4], init.device());
                    for (i, layer) in units.iter().enumerate() {
                        let unit = layer.get()?;
                        if let Some(next) = units.get(i + 1) {
                            next.prefetch()?;
                        }
                        x = unit.forward(x).unwrap();
                    }
                    let grads = GradientsParams::from_grads(x.sum().backward(), &units);
                    acc.accumulate(&units, grads);
                    if !last {
                        held = plan.memory().report().current.grads;
                    }
                }
                let grads = acc.grads();
                let gradient_bytes = plan.gradient_bytes(&grads);
                let mut optim = AdamWConfig::new().init();
                let _units = optim.step(1e-3, units, grads);
                let optimizer_bytes = plan.optimizer_bytes(&optim).unwrap();
                let report = plan.memory().report();
                figures.push((
                    report.current.params,
                    report.peak.gathered,
                    report.current.gathered,
                    held,
                    report.current.grads,
                    gradient_bytes,
                    optimizer_bytes,
                ));
            }
            Ok(figures)
        })
        .unwrap();
        // 3 units of 16 fp32 weights, each rank holding 8 of each.
        let (unit, shards) = (16 * 4, 3 * 8 * 4);
        for figures in out {
            assert_eq!(
                figures,
                vec![
                    (shards, unit, 0, 3 * unit, 0, shards, 2 * shards),
                    (shards, 2 * unit, 0, 3 * unit, 0, shards, 2 * shards),
                ],
                "(params, gathered peak, gathered after, held by no-sync, grads after, shard \
                 gradients, optimizer state) without and with prefetch"
            );
        }
    }

    /// A prefetch is in flight until its unit's gather takes it, which gives the values of a
    /// plain gather; gathering another unit first is a typed error naming the prefetched one.
    /// With prefetch off, `prefetch` does nothing.
    #[test]
    fn prefetch_is_taken_by_its_units_gather_and_keeps_the_order() {
        let out = run_local(2, |group| {
            let init = Init::new(3, &Device::flex().autodiff());
            let plan = FsdpPlan::new(&group).unit("layers.*").with_prefetch(true);
            let units = layers(&plan, &init);
            let plain = weight(&units[1].get()?);
            units[1].prefetch()?;
            units[1].prefetch()?; // already in flight: nothing more
            let overtaking = units[0].get().err().map(|e| e.to_string());
            let second = units[2].prefetch().err().map(|e| e.to_string());
            let prefetched = weight(&units[1].get()?);
            units[0].get()?; // nothing in flight any more
            let off = FsdpPlan::new(&group).unit("layers.*");
            let off_units = layers(&off, &init);
            off_units[1].prefetch()?;
            off_units[0].get()?;
            Ok((plain == prefetched, overtaking, second))
        })
        .unwrap();
        for (same, overtaking, second) in out {
            assert!(same, "the prefetched gather differs from a plain one");
            let overtaking = overtaking.expect("gathering another unit first is an error");
            assert!(
                overtaking.contains("`layers.1` was prefetched") && overtaking.contains("layers.0"),
                "{overtaking}"
            );
            let second = second.expect("a second prefetch in flight is an error");
            assert!(second.contains("`layers.1` was prefetched"), "{second}");
        }
    }
}
