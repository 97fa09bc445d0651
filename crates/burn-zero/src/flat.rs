//! Flat parameter spaces: a module's float parameters laid end to end in one 1-D buffer.
//!
//! Every ZeRO stage works on flat buffers (as DeepSpeed's `flat_param` and FSDP's
//! `FlatParameter`): the parameters of a *unit* (the whole model for stages 1 and 2, one wrapped
//! sub-module for stage 3) are concatenated in the module's visiting order, and rank `r` of `n`
//! owns the contiguous range [`shard_range`]`(numel, r, n)` of it (an even split, the first ranks
//! one element longer when it does not divide; no padding). Sharding a flat buffer, rather than
//! individual tensors, gives every rank the same number of elements whatever the shapes, and
//! makes resharding a checkpoint from `N` to `M` ranks a matter of re-slicing one range.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::index::ParamIndex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, ZeroError};

/// One parameter's place in a flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatEntry {
    /// Module path (`"blocks.0.attn.q.weight"`).
    pub path: String,
    /// Shape of the parameter.
    pub shape: Vec<usize>,
    /// First element of the parameter in the flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

/// The layout of a flat buffer: which parameter sits where.
///
/// # Example
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_zero::flat::FlatLayout;
///
/// let linear = LinearConfig::new(3, 2).init(&Device::flex());
/// let layout = FlatLayout::of(&linear, |_| true);
/// assert_eq!(layout.numel(), 3 * 2 + 2);
/// assert_eq!(layout.entries()[0].path, "weight");
/// ```
#[derive(Debug, Clone, Default)]
pub struct FlatLayout {
    entries: Vec<FlatEntry>,
    ids: Vec<ParamId>,
    numel: usize,
}

impl FlatLayout {
    /// The layout of `module`'s float parameters whose path passes `keep`, in visiting order.
    pub fn of<M: Module>(module: &M, keep: impl Fn(&str) -> bool) -> Self {
        Self::of_where(module, |path, _| keep(path))
    }

    /// The layout of `module`'s *trainable* float parameters whose path passes `keep`: frozen
    /// ones ([`is_frozen`]) are left out, so that they get no gradient, no optimizer state and
    /// are never rewritten (what the ZeRO optimizers and FSDP units step).
    pub fn trainable<M: Module>(module: &M, keep: impl Fn(&str) -> bool) -> Self {
        Self::of_where(module, |path, frozen| !frozen && keep(path))
    }

    /// The layout of `module`'s *frozen* float parameters ([`is_frozen`]) whose path passes
    /// `keep` (what an FSDP unit shards and gathers but never steps).
    pub fn frozen<M: Module>(module: &M, keep: impl Fn(&str) -> bool) -> Self {
        Self::of_where(module, |path, frozen| frozen && keep(path))
    }

    /// The layout of the float parameters for which `keep(path, frozen)` holds.
    fn of_where<M: Module>(module: &M, keep: impl Fn(&str, bool) -> bool) -> Self {
        let index = ParamIndex::with_state(module);
        let mut layout = FlatLayout::default();
        for e in index.entries() {
            if !keep(&e.path, e.is_frozen()) {
                continue;
            }
            let numel = e.numel();
            layout.entries.push(FlatEntry {
                path: e.path.clone(),
                shape: e.shape.clone(),
                offset: layout.numel,
                numel,
            });
            layout.ids.push(e.id);
            layout.numel += numel;
        }
        layout
    }

    /// Total number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The layout's parameters and the range `range` of it, as a checkpoint describes a flat
    /// shard ([`burn_parallel::checkpoint::ParamMap`]).
    pub fn parts(&self, range: Range<usize>) -> burn_parallel::checkpoint::FlatParts {
        burn_parallel::checkpoint::FlatParts {
            parts: self
                .entries()
                .iter()
                .zip(self.ids())
                .map(|(e, id)| burn_parallel::checkpoint::FlatPart {
                    path: e.path.clone(),
                    id: *id,
                    shape: e.shape.clone(),
                    offset: e.offset,
                })
                .collect(),
            range,
        }
    }

    /// The parameters, in flat order.
    pub fn entries(&self) -> &[FlatEntry] {
        &self.entries
    }

    /// The parameter ids, in flat order.
    pub fn ids(&self) -> &[ParamId] {
        &self.ids
    }

    /// The entry (index into [`FlatLayout::entries`]) of each parameter, by id.
    pub(crate) fn entry_index(&self) -> HashMap<ParamId, usize> {
        self.ids
            .iter()
            .enumerate()
            .map(|(i, id)| (*id, i))
            .collect()
    }

    /// Copies the parameters of `module` into one flat `f32` host buffer.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `module` lacks a parameter of the layout.
    pub fn flatten<M: Module>(&self, module: &M) -> Result<Vec<f32>> {
        self.flatten_range(module, 0..self.numel)
    }

    /// Copies elements `range` of the flat space of `module`'s parameters into a host buffer
    /// of `range.len()` values, reading only the parameters that overlap `range` (no full flat
    /// copy: what a ZeRO rank needs for its shard).
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `module` lacks a parameter of the layout or `range` goes
    /// beyond the layout.
    pub fn flatten_range<M: Module>(&self, module: &M, range: Range<usize>) -> Result<Vec<f32>> {
        let device = module
            .devices()
            .into_iter()
            .next()
            .map_or_else(Device::flex, Device::inner);
        Ok(host_f32(self.flatten_range_on(module, range, &device)?))
    }

    /// Elements `range` of the flat space of `module`'s parameters as one 1-D `f32` tensor on
    /// `device` (a device without autodiff, normally the parameters' own), cut from the
    /// parameters that overlap `range` without leaving the device: what a ZeRO rank steps.
    ///
    /// # Errors
    /// As [`FlatLayout::flatten_range`].
    ///
    /// # Example
    /// ```
    /// use burn::nn::LinearConfig;
    /// use burn::tensor::Device;
    /// use burn_zero::flat::{FlatLayout, host_f32};
    ///
    /// let device = Device::flex();
    /// let linear = LinearConfig::new(3, 2).init(&device);
    /// let layout = FlatLayout::of(&linear, |_| true);
    /// // The last weight and both biases.
    /// let tail = layout.flatten_range_on(&linear, 5..8, &device).unwrap();
    /// let all = layout.flatten(&linear).unwrap();
    /// assert_eq!(host_f32(tail), all[5..8].to_vec());
    /// ```
    pub fn flatten_range_on<M: Module>(
        &self,
        module: &M,
        range: Range<usize>,
        device: &Device,
    ) -> Result<Tensor<1>> {
        if range.end > self.numel || range.start > range.end {
            return Err(ZeroError::Config(format!(
                "range {range:?} is outside a flat layout of {} elements",
                self.numel
            )));
        }
        struct Collector<'a> {
            wanted: HashMap<ParamId, usize>,
            /// The piece of each entry that overlaps the range, by entry.
            pieces: Vec<Option<Tensor<1>>>,
            entries: &'a [FlatEntry],
            range: Range<usize>,
            device: &'a Device,
            found: usize,
        }
        impl ModuleVisitor for Collector<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(&i) = self.wanted.get(&param.id) {
                    self.found += 1;
                    let e = &self.entries[i];
                    let lo = e.offset.max(self.range.start);
                    let hi = (e.offset + e.numel).min(self.range.end);
                    if lo >= hi || self.pieces[i].is_some() {
                        return;
                    }
                    let flat: Tensor<1> = param.val().inner().flatten(0, D - 1);
                    let piece = flat
                        .narrow(0, lo - e.offset, hi - lo)
                        .to_device(self.device);
                    self.pieces[i] = Some(as_f32(piece));
                }
            }
        }
        let mut collector = Collector {
            wanted: self.entry_index(),
            pieces: vec![None; self.entries.len()],
            entries: &self.entries,
            range,
            device,
            found: 0,
        };
        module.visit(&mut collector);
        if collector.found != self.entries.len() {
            return Err(ZeroError::Config(format!(
                "the module has {} of the {} parameters of this flat layout; pass the module the \
                 wrapper was built from (parameter ids must not change)",
                collector.found,
                self.entries.len()
            )));
        }
        Ok(concat_1d(
            collector.pieces.into_iter().flatten().collect(),
            device,
        ))
    }

    /// Replaces the parameters of the layout in `module` by slices of `flat` (a 1-D tensor of
    /// [`FlatLayout::numel`] elements), reshaped. With `as_leaves`, each new value is detached
    /// and made a leaf that requires a gradient (stages 1 and 2); otherwise the slices stay
    /// attached to `flat`'s graph (stage 3, where `flat` is the differentiable all-gather).
    /// Parameters outside the layout are left alone.
    ///
    /// # Errors
    /// [`ZeroError::Config`] when `flat` has the wrong length or a parameter is missing.
    pub fn unflatten<M: Module>(&self, module: M, flat: Tensor<1>, as_leaves: bool) -> Result<M> {
        if flat.dims()[0] != self.numel {
            return Err(ZeroError::Config(format!(
                "a flat buffer of {} elements was given for a layout of {}",
                flat.dims()[0],
                self.numel
            )));
        }
        struct Setter<'a> {
            wanted: HashMap<ParamId, usize>,
            entries: &'a [FlatEntry],
            flat: Tensor<1>,
            as_leaves: bool,
            found: usize,
        }
        impl ModuleMapper for Setter<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(&i) = self.wanted.get(&param.id) else {
                    return param;
                };
                self.found += 1;
                let e = &self.entries[i];
                let mut shape = [0usize; D];
                shape.copy_from_slice(&e.shape);
                let value: Tensor<D> = self
                    .flat
                    .clone()
                    .narrow(0, e.offset, e.numel)
                    .reshape(shape);
                let (id, _, mapper) = param.consume();
                let value = if self.as_leaves {
                    value.detach().require_grad()
                } else {
                    value
                };
                Param::from_mapped_value(id, value, mapper)
            }
        }
        let mut setter = Setter {
            wanted: self.entry_index(),
            entries: &self.entries,
            flat,
            as_leaves,
            found: 0,
        };
        let module = module.map(&mut setter);
        if setter.found != self.entries.len() {
            return Err(ZeroError::Config(format!(
                "the module has {} of the {} parameters of this flat layout",
                setter.found,
                self.entries.len()
            )));
        }
        Ok(module)
    }
}

/// Whether `param` is frozen: on an autodiff device but not requiring a gradient (see Burn's
/// `Module::no_grad` and `Param::set_require_grad`). On a device without autodiff no tensor
/// tracks gradients, so nothing counts as frozen there.
pub fn is_frozen<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    let value = param.val();
    value.is_autodiff() && !value.is_require_grad()
}

/// Casts every frozen float parameter of `module` ([`is_frozen`]) to `dtype`, keeping it
/// frozen (under mixed precision the frozen weights compute in the policy's dtype like the
/// rest; being never updated, they need no fp32 master copy).
pub fn cast_frozen<M: Module>(module: M, dtype: DType) -> M {
    struct Caster(DType);
    impl ModuleMapper for Caster {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !is_frozen(&param) || param.val().dtype() == self.0 {
                return param;
            }
            let dtype = self.0;
            param.map(|t| t.cast(dtype).detach())
        }
    }
    module.map(&mut Caster(dtype))
}

/// Replaces every float parameter of `module` whose path passes `drop` by a one-element
/// placeholder (so that a template module costs no parameter memory). Ids are kept.
pub fn strip_params<M: Module>(module: M, drop: impl Fn(&str) -> bool) -> M {
    struct Stripper<F> {
        stack: Vec<String>,
        drop: F,
    }
    impl<F: Fn(&str) -> bool> ModuleMapper for Stripper<F> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !(self.drop)(&self.stack.join(".")) {
                return param;
            }
            let (id, value, mapper) = param.consume();
            let placeholder = Tensor::<D>::zeros([1; D], &value.device().inner());
            Param::from_mapped_value(id, placeholder, mapper)
        }
    }
    module.map(&mut Stripper {
        stack: Vec::new(),
        drop,
    })
}

/// The range of a flat buffer of `numel` elements owned by rank `rank` of `n`: an even split,
/// the first `numel % n` ranks one element longer.
///
/// ```
/// use burn_zero::flat::shard_range;
/// assert_eq!(shard_range(10, 0, 4), 0..3);
/// assert_eq!(shard_range(10, 3, 4), 8..10);
/// ```
pub fn shard_range(numel: usize, rank: usize, n: usize) -> Range<usize> {
    let (base, extra) = (numel / n, numel % n);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Shard lengths of every rank ([`shard_range`]'s lengths).
pub fn shard_sizes(numel: usize, n: usize) -> Vec<usize> {
    (0..n).map(|r| shard_range(numel, r, n).len()).collect()
}

/// A 1-D `f32` tensor on `device` from host values.
pub fn tensor_1d(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let len = values.len();
    Tensor::from_data(TensorData::new(values, [len]), (device, DType::F32))
}

/// `t` in `f32` (unchanged when it already is).
pub(crate) fn as_f32<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    match t.dtype() {
        DType::F32 => t,
        _ => t.cast(DType::F32),
    }
}

/// The 1-D tensors `parts` laid end to end on `device` (an empty tensor for no parts).
pub(crate) fn concat_1d(mut parts: Vec<Tensor<1>>, device: &Device) -> Tensor<1> {
    match parts.len() {
        0 => Tensor::zeros([0], device),
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 0),
    }
}

/// `t`, a tensor without autodiff, tracked as tensors made on `device` are (the same
/// gradient-checkpointing strategy): a device without autodiff leaves it alone.
pub(crate) fn tracked_as(t: Tensor<1>, device: &Device) -> Tensor<1> {
    match device.gradient_checkpointing_strategy() {
        Some(strategy) => t.autodiff().with_gradient_checkpointing_strategy(strategy),
        None => t,
    }
}

/// The host `f32` values of a tensor (converted from its dtype).
pub fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("converted to f32")
}
