//! [`TpContext`]: what a model's forward pass and training step need to know about tensor
//! parallelism. [`Init::context`](crate::init::Init::context) makes it for a model built with
//! the layers of [`crate::nn`], [`TpContext::for_group`] for one split by hand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};

use crate::autograd::{gather_from_group, scatter_to_group};
use crate::comm::host::ReduceOp;
use crate::error::CollectiveError;
use crate::group::ProcessGroup;
use crate::tensor_parallel::{SEQ_DIM, Shard, TpResult, sequence_shard};

/// What a model's forward pass and training step need to know about tensor parallelism:
/// Megatron's `parallel_state`, passed explicitly. Keep it in the model as a
/// `#[module(skip)]` field (it is cheap to clone). Single-device: every method is the identity.
#[derive(Debug, Clone)]
pub struct TpContext {
    pub(crate) group: Option<ProcessGroup>,
    pub(crate) sequence_parallel: bool,
    pub(crate) sequence_params: Arc<Mutex<Vec<ParamId>>>,
    pub(crate) shards: Arc<Mutex<HashMap<ParamId, (usize, Shard)>>>,
}

impl Default for TpContext {
    fn default() -> Self {
        Self::single()
    }
}

impl TpContext {
    /// No tensor parallelism.
    pub fn single() -> Self {
        Self {
            group: None,
            sequence_parallel: false,
            sequence_params: Arc::new(Mutex::new(Vec::new())),
            shards: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A context over `group` for a model split without [`Init`](crate::init::Init) (with the layers of
    /// [`crate::tensor_parallel`] directly): register its shards with [`Self::register_shard`]
    /// so that clipping and [`Self::full_params`] know them. Those layers sum the gradients of
    /// their sequence-parallel parameters themselves.
    pub fn for_group(group: &ProcessGroup) -> Self {
        Self {
            group: (group.size() > 1).then(|| group.clone()),
            ..Self::single()
        }
    }

    /// Records that parameter `id` holds `shard` of dimension `dim` of a tensor split over the
    /// group.
    pub fn register_shard(&self, id: ParamId, dim: usize, shard: Shard) {
        self.shards
            .lock()
            .expect("plan bookkeeping")
            .insert(id, (dim, shard));
    }

    /// The tensor-parallel group (`None` on one device).
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.group.as_ref()
    }

    /// Whether the activations between the tensor-parallel regions are sequence-sharded.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// Enters the sequence-parallel region: keeps this rank's part of the sequence of a
    /// replicated `[batch, seq, ..]` tensor (the backward all-gathers). The identity without
    /// sequence parallelism.
    ///
    /// # Errors
    /// Collective errors.
    pub fn scatter_sequence(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        match (&self.group, self.sequence_parallel) {
            (Some(group), true) => Ok(scatter_to_group(x, group, SEQ_DIM)?),
            _ => Ok(x),
        }
    }

    /// The inverse of [`Self::scatter_sequence`]: all-gathers this rank's tokens of `x`
    /// `[batch, tokens, ..]` into the whole sequence, replicated (the backward keeps this rank's
    /// part of the gradient). For a model that reads whole-sequence results after the
    /// sequence-parallel region, such as a classifier reading its class token. The identity
    /// without sequence parallelism.
    ///
    /// # Errors
    /// Collective errors.
    pub fn gather_sequence(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        match (&self.group, self.sequence_parallel) {
            (Some(group), true) => Ok(gather_from_group(x, group, SEQ_DIM)?),
            _ => Ok(x),
        }
    }

    /// The global position of this rank's first token of a sequence of `seq` tokens under
    /// sequence parallelism, and how many it holds (`(0, seq)` otherwise): what position
    /// embeddings added inside the sequence-parallel region need.
    pub fn sequence_range(&self, seq: usize) -> (usize, usize) {
        match (&self.group, self.sequence_parallel) {
            (Some(group), true) => {
                let shard =
                    sequence_shard(seq, group).expect("a valid group always has a sequence shard");
                (shard.start, shard.len)
            }
            _ => (0, seq),
        }
    }

    /// Sums over the tensor-parallel group the gradients of the parameters used on sequence
    /// shards (those under a [`TpStyle::SequenceNorm`](crate::plan::TpStyle::SequenceNorm) rule, with sequence parallelism on), so
    /// that they are the gradients of the whole sequence. Call it between the backward pass and
    /// the optimizer step (the training steps of this crate do); without sequence parallelism it
    /// returns `grads` untouched.
    ///
    /// # Errors
    /// Collective errors.
    pub fn sync_gradients(
        &self,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, CollectiveError> {
        let Some(group) = self.group.as_ref().filter(|_| self.sequence_parallel) else {
            return Ok(grads);
        };
        let ids = self
            .sequence_params
            .lock()
            .expect("plan bookkeeping")
            .clone();
        // Every rank of the group holds the parameters (replicated), so every rank either has
        // a gradient for one or has none: the same tensors on every rank, summed in one
        // collective (one per dtype), not one per norm.
        let present: Vec<(ParamId, Tensor<1>)> = ids
            .into_iter()
            .filter_map(|id| grads.remove::<1>(id).map(|g| (id, g)))
            .collect();
        let (ids, parts): (Vec<ParamId>, Vec<Tensor<1>>) = present.into_iter().unzip();
        for (id, summed) in ids
            .into_iter()
            .zip(group.all_reduce_coalesced(parts, ReduceOp::Sum)?)
        {
            grads.register::<1>(id, summed);
        }
        Ok(grads)
    }

    /// Every parameter of `module` by module path, whole: the shards of the parameters this
    /// context split are all-gathered over the group (padding dropped), the others read as they
    /// are. A collective: every rank of the group must call it. For export, evaluation and
    /// comparison against single-device training.
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_params<M: Module>(
        &self,
        module: &M,
    ) -> Result<Vec<(String, TensorData)>, CollectiveError> {
        struct Collect<'a> {
            path: Vec<String>,
            shards: &'a HashMap<ParamId, (usize, Shard)>,
            group: Option<&'a ProcessGroup>,
            out: Vec<(String, TensorData)>,
            error: Option<CollectiveError>,
        }
        impl ModuleVisitor for Collect<'_> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.error.is_some() {
                    return;
                }
                let value = param.val().detach();
                let data = match (self.shards.get(&param.id), self.group) {
                    (Some((dim, shard)), Some(group)) => match group.all_gather(value, *dim) {
                        Ok(full) => full.narrow(*dim, 0, shard.full).into_data(),
                        Err(e) => {
                            self.error = Some(e);
                            return;
                        }
                    },
                    _ => value.into_data(),
                };
                self.out.push((self.path.join("."), data));
            }
        }
        let shards = self.shards.lock().expect("plan bookkeeping").clone();
        let mut visitor = Collect {
            path: Vec::new(),
            shards: &shards,
            group: self.group.as_ref(),
            out: Vec::new(),
            error: None,
        };
        module.visit(&mut visitor);
        match visitor.error {
            Some(e) => Err(e),
            None => Ok(visitor.out),
        }
    }

    /// The ids of the parameters this context split over the group (for norms and clipping:
    /// their squares are summed over the group, those of the others counted once).
    pub fn sharded_ids(&self) -> std::collections::HashSet<ParamId> {
        self.shards
            .lock()
            .expect("plan bookkeeping")
            .keys()
            .copied()
            .collect()
    }

    /// The ids of the parameters used on sequence shards whose gradients are summed over the
    /// group (empty without sequence parallelism), in construction order.
    pub fn sequence_param_ids(&self) -> Vec<ParamId> {
        if !self.sequence_parallel {
            return Vec::new();
        }
        self.sequence_params
            .lock()
            .expect("plan bookkeeping")
            .clone()
    }
}
