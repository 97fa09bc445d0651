//! [`ParamIndex`]: the float parameters of a module, each with its path, its id and its shape,
//! read in one walk of the module and without initialising lazy parameters. The techniques that
//! need to know *which* parameters a module has (checkpoint maps, ZeRO's and FSDP's selections,
//! the planner's count) read it instead of walking the module each with a visitor of its own.
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

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

/// One float parameter of a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamEntry {
    /// Its path in the module (`blocks.0.attn.q.weight`).
    pub path: String,
    /// Its id.
    pub id: ParamId,
    /// Its shape on this rank (a shard's under tensor parallelism).
    pub shape: Vec<usize>,
}

impl ParamEntry {
    /// Elements on this rank.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
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
        struct Walk {
            stack: Vec<String>,
            entries: Vec<ParamEntry>,
        }
        impl ModuleVisitor for Walk {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.stack.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.stack.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.entries.push(ParamEntry {
                    path: self.stack.join("."),
                    id: param.id,
                    shape: param.lazy_shape().as_slice().to_vec(),
                });
            }
        }
        let mut walk = Walk {
            stack: Vec::new(),
            entries: Vec::new(),
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
}
