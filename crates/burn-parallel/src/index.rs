//! [`ParamIndex`]: the float parameters of a module, each with its path, its id and its shape,
//! read in one walk of the module and without initialising lazy parameters. The techniques that
//! need to know *which* parameters a module has (checkpoint maps, ZeRO's and FSDP's selections,
//! the planner's count) read it instead of walking the module each with a visitor of its own.
//! [`ParamIndex::with_state`] adds what Burn tells only from a parameter's value (its dtype,
//! whether it is frozen, its device): what data parallelism's buckets, the flat layouts of
//! ZeRO and FSDP and the memory accounts need.
//!
//! ```
//! use burn::nn::LinearConfig;
//! use burn::tensor::Device;
//! use burn_parallel::index::ParamIndex;
//!
//! let linear = LinearConfig::new(8, 4).init(&Device::flex());
//! let index = ParamIndex::of(&linear);
//! let weight = index.by_path("weight").unwrap();
//! assert_eq!(weight.shape, vec![8, 4]);
//! assert_eq!(index.get(weight.id).unwrap().path, "weight");
//! assert_eq!(index.numel(), 8 * 4 + 4);
//! ```

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Tensor};

/// What Burn tells about a parameter only from its value: read by [`ParamIndex::with_state`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamState {
    /// Its dtype.
    pub dtype: DType,
    /// Whether it is frozen: on an autodiff device but not requiring a gradient (see Burn's
    /// `Module::no_grad`). On a device without autodiff no tensor tracks gradients, so nothing
    /// is frozen there.
    pub frozen: bool,
    /// The device it lives on (`Param::lazy_device`: with its autodiff setting; take
    /// `Device::inner` for the backend's own).
    pub device: Device,
}

/// One float parameter of a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamEntry {
    /// Its path in the module (`blocks.0.attn.q.weight`).
    pub path: String,
    /// Its id.
    pub id: ParamId,
    /// Its shape on this rank (a shard's under tensor parallelism).
    pub shape: Vec<usize>,
    /// Its dtype, whether it is frozen and its device: `Some` in an index built by
    /// [`ParamIndex::with_state`], `None` in one built by [`ParamIndex::of`] (which leaves lazy
    /// parameters uninitialised, and Burn tells these only from the value).
    pub state: Option<ParamState>,
}

impl ParamEntry {
    /// Elements on this rank.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the parameter is frozen ([`ParamState::frozen`]); `false` when the index holds no
    /// state ([`ParamIndex::of`]).
    pub fn is_frozen(&self) -> bool {
        self.state.as_ref().is_some_and(|s| s.frozen)
    }
}

/// The float parameters of a module, in the order the module visits them (a parameter the
/// module reaches twice is listed at each path), with lookups by id and by path.
#[derive(Debug, Clone, Default)]
pub struct ParamIndex {
    entries: Vec<ParamEntry>,
    by_id: HashMap<ParamId, usize>,
}

impl ParamIndex {
    /// The index of `module` (lazy parameters stay uninitialised).
    pub fn of<M: Module>(module: &M) -> Self {
        Self::walk(module, false)
    }

    /// The index of `module` with each parameter's [`ParamState`] (its dtype, whether it is
    /// frozen and its device). Burn tells the dtype and the gradient requirement only from the
    /// value, so this initialises lazy parameters; prefer [`ParamIndex::of`] where paths, ids
    /// and shapes are enough.
    ///
    /// # Example
    /// ```
    /// use burn::module::Module;
    /// use burn::nn::LinearConfig;
    /// use burn::tensor::{DType, Device};
    /// use burn_parallel::index::ParamIndex;
    ///
    /// let device = Device::flex().autodiff();
    /// let frozen = LinearConfig::new(2, 3).init(&device).no_grad();
    /// let index = ParamIndex::with_state(&frozen);
    /// let weight = index.by_path("weight").unwrap();
    /// let state = weight.state.as_ref().unwrap();
    /// assert!(state.frozen && weight.is_frozen());
    /// assert_eq!(state.dtype, DType::F32);
    /// // Without the state, nothing is known to be frozen.
    /// assert!(!ParamIndex::of(&frozen).entries()[0].is_frozen());
    /// ```
    pub fn with_state<M: Module>(module: &M) -> Self {
        Self::walk(module, true)
    }

    /// One walk of `module`, reading each parameter's value when `state`.
    fn walk<M: Module>(module: &M, state: bool) -> Self {
        struct Walk {
            stack: Vec<String>,
            entries: Vec<ParamEntry>,
            state: bool,
        }
        impl ModuleVisitor for Walk {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.stack.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.stack.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let state = self.state.then(|| {
                    let value = param.val();
                    ParamState {
                        dtype: value.dtype(),
                        frozen: value.is_autodiff() && !value.is_require_grad(),
                        device: param.lazy_device(),
                    }
                });
                self.entries.push(ParamEntry {
                    path: self.stack.join("."),
                    id: param.id,
                    shape: param.lazy_shape().as_slice().to_vec(),
                    state,
                });
            }
        }
        let mut walk = Walk {
            stack: Vec::new(),
            entries: Vec::new(),
            state,
        };
        module.visit(&mut walk);
        let mut by_id = HashMap::new();
        for (i, entry) in walk.entries.iter().enumerate() {
            by_id.entry(entry.id).or_insert(i);
        }
        Self {
            entries: walk.entries,
            by_id,
        }
    }

    /// Every parameter, in the module's order.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// The parameter `id` (its first path, when the module reaches it twice).
    pub fn get(&self, id: ParamId) -> Option<&ParamEntry> {
        self.by_id.get(&id).map(|&i| &self.entries[i])
    }

    /// The parameter at `path`.
    pub fn by_path(&self, path: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.path == path)
    }

    /// The paths of the parameters whose id `select` picks.
    pub fn paths_where(&self, select: impl Fn(ParamId) -> bool) -> Vec<&str> {
        let picked = self.entries.iter().filter(|e| select(e.id));
        picked.map(|e| e.path.as_str()).collect()
    }

    /// Elements of every entry on this rank (a parameter reached twice counts twice).
    pub fn numel(&self) -> usize {
        self.entries.iter().map(ParamEntry::numel).sum()
    }

    /// The ids of every entry, in the module's order (a parameter reached twice is listed
    /// twice).
    ///
    /// # Example
    /// ```
    /// use burn::nn::LinearConfig;
    /// use burn::tensor::Device;
    /// use burn_parallel::index::ParamIndex;
    ///
    /// let linear = LinearConfig::new(2, 3).init(&Device::flex());
    /// let ids: Vec<_> = ParamIndex::of(&linear).ids().collect();
    /// assert_eq!(ids[0], linear.weight.id);
    /// assert_eq!(ids.len(), 2);
    /// ```
    pub fn ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.entries.iter().map(|e| e.id)
    }

    /// The parameters an optimizer steps, each once, in the module's order: the entries that
    /// are not frozen ([`ParamEntry::is_frozen`]), a parameter the module reaches twice at its
    /// first unfrozen path. Needs the state ([`ParamIndex::with_state`]): in an index without
    /// it nothing is known to be frozen, and every parameter is listed once.
    ///
    /// # Example
    /// ```
    /// use burn::module::Module;
    /// use burn::nn::LinearConfig;
    /// use burn::tensor::Device;
    /// use burn_parallel::index::ParamIndex;
    ///
    /// let device = Device::flex().autodiff();
    /// let trained = LinearConfig::new(2, 3).init(&device);
    /// let frozen = LinearConfig::new(3, 1).init(&device).no_grad();
    /// let pair = (trained, frozen);
    /// let index = ParamIndex::with_state(&pair);
    /// let paths: Vec<_> = index.trainable().map(|e| e.path.as_str()).collect();
    /// assert_eq!(paths, ["0.weight", "0.bias"]);
    /// ```
    pub fn trainable(&self) -> impl Iterator<Item = &ParamEntry> + '_ {
        let mut seen = HashSet::new();
        self.entries
            .iter()
            .filter(move |e| !e.is_frozen() && seen.insert(e.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    /// A module reaching one linear layer twice, and a frozen one.
    #[derive(Module, Debug)]
    struct Shared {
        a: Linear,
        b: Linear,
        frozen: Linear,
    }

    fn shared(device: &Device) -> Shared {
        let a = LinearConfig::new(2, 3).init(device);
        Shared {
            b: a.clone(),
            a,
            frozen: LinearConfig::new(3, 1).init(device).no_grad(),
        }
    }

    #[test]
    fn of_leaves_lazy_parameters_uninitialised_and_knows_no_state() {
        let linear = LinearConfig::new(4, 5).init(&Device::flex());
        let index = ParamIndex::of(&linear);
        assert!(!linear.weight.is_initialized());
        assert!(index.entries().iter().all(|e| e.state.is_none()));
        assert_eq!(index.by_path("weight").unwrap().shape, vec![4, 5]);
    }

    #[test]
    fn with_state_reads_dtype_frozen_and_device() {
        let device = Device::flex().autodiff();
        let model = shared(&device);
        let index = ParamIndex::with_state(&model);
        assert_eq!(index.entries().len(), 6);
        for e in index.entries() {
            let state = e.state.as_ref().expect("with_state reads every state");
            assert_eq!(state.dtype, DType::F32);
            assert_eq!(state.device, device);
            assert_eq!(state.frozen, e.path.starts_with("frozen."), "{}", e.path);
        }
        // Same paths, ids and shapes as the lazy index.
        let lazy = ParamIndex::of(&model);
        let strip = |i: &ParamIndex| {
            let e = i.entries().iter();
            e.map(|e| (e.path.clone(), e.id, e.shape.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&index), strip(&lazy));
    }

    #[test]
    fn nothing_is_frozen_off_autodiff() {
        let index = ParamIndex::with_state(&shared(&Device::flex()));
        assert!(index.entries().iter().all(|e| !e.is_frozen()));
        assert_eq!(index.trainable().count(), 4);
    }

    #[test]
    fn ids_list_every_entry_and_trainable_each_parameter_once() {
        let model = shared(&Device::flex().autodiff());
        let index = ParamIndex::with_state(&model);
        let ids: Vec<ParamId> = index.ids().collect();
        assert_eq!(
            ids,
            [
                model.a.weight.id,
                model.a.bias.as_ref().unwrap().id,
                model.a.weight.id,
                model.a.bias.as_ref().unwrap().id,
                model.frozen.weight.id,
                model.frozen.bias.as_ref().unwrap().id,
            ]
        );
        let trainable: Vec<&str> = index.trainable().map(|e| e.path.as_str()).collect();
        assert_eq!(trainable, ["a.weight", "a.bias"]);
        // Without the state every parameter is listed, once.
        assert_eq!(ParamIndex::of(&model).trainable().count(), 4);
    }
}
