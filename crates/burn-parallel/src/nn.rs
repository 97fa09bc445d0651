//! Layers for a model written once, that trains on one device and under tensor and sequence
//! parallelism (Megatron's way: a tensor-parallel linear at tp = 1 is a plain linear).
//!
//! Build them with [`crate::init::Init`]: the [`TpPlan`](crate::plan::TpPlan) given to
//! [`Init::with_tp`](crate::init::Init::with_tp) decides, by module path, whether each
//! [`Linear`] is column- or row-parallel and whether each [`Embedding`] is split by vocabulary;
//! every rank initialises only its shard from the seed. The forward passes take and return plain
//! tensors; the model keeps a [`TpContext`] (from [`Init::context`](crate::init::Init::context))
//! for the few places where the sequence enters or leaves the sequence-parallel region and for
//! the loss.
//!
//! | plan style | layer | forward |
//! |---|---|---|
//! | none / `replicate` | [`Linear`], [`Embedding`] | plain |
//! | `colwise` | [`Linear`] (output features) | *f* (or sequence all-gather), matmul: feature-sharded output |
//! | `rowwise` | [`Linear`] (input features) | matmul, all-reduce (or sequence reduce-scatter), bias once |
//! | `vocab` | [`Embedding`] (rows) | masked lookup, all-reduce: replicated output |
//! | `vocab` | [`Linear`] head (columns, padded) | vocabulary-sharded logits for [`Linear::cross_entropy`] |
//!
//! Beside them, the layers a transformer needs whatever its split, each with a composed and a
//! fused path (the kernels of [`crate::kernels`]): [`Norm`] (LayerNorm, RMSNorm) and [`Rope`]
//! (rotary position tables).
//!
//! # Example: a two-layer MLP, the same code at tp 1 and tp 2
//! ```
//! use burn::module::Module;
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::init::{Init, LinearInit};
//! use burn_parallel::nn::Linear;
//! use burn_parallel::plan::TpPlan;
//! use burn_parallel::run_local;
//!
//! #[derive(Module, Debug)]
//! struct Mlp {
//!     up: Linear,
//!     down: Linear,
//! }
//! impl Mlp {
//!     fn new(init: &Init) -> Self {
//!         let up = init.linear("up", LinearInit::new(4, 8)).unwrap();
//!         let down = init.linear("down", LinearInit::new(8, 4)).unwrap();
//!         init.finish().unwrap();
//!         Self { up, down }
//!     }
//!     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
//!         self.down.forward(self.up.forward(x).unwrap().tanh()).unwrap()
//!     }
//! }
//!
//! let device = Device::flex();
//! let x = Tensor::<2>::ones([3, 4], &device);
//! let single = Mlp::new(&Init::new(7, &device)).forward(x.clone()).into_data();
//! let split = run_local(2, move |group| {
//!     let plan = TpPlan::new().colwise("up").rowwise("down");
//!     let init = Init::new(7, &Device::flex()).with_tp(&group, plan).unwrap();
//!     let mlp = Mlp::new(&init);
//!     assert_eq!(mlp.up.weight.dims(), [4, 4]); // half of the 8 hidden units
//!     Ok(mlp.forward(Tensor::<2>::ones([3, 4], &Device::flex())).into_data())
//! })
//! .unwrap();
//! split[0].assert_approx_eq::<f32>(&single, burn::tensor::Tolerance::absolute(1e-6));
//! ```

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::module::linear;
use burn::tensor::{DType, Int, Tensor};

use crate::autograd::{
    GatheredSequence, WeightGradSink, copy_to_group, deferred_matmul, gather_from_sequence,
};
use crate::group::ProcessGroup;
use crate::init::{Init, Initializer, LinearInit};
use crate::plan::TpStyle;
use crate::tensor_parallel::region::row_output;
use crate::tensor_parallel::{
    CrossEntropyOptions, Placement, SEQ_DIM, Shard, Split, TpError, TpResult, TpTensor, sp_param,
    vocab_parallel_cross_entropy,
};

pub use crate::tensor_parallel::TpContext;

mod norm;
mod rope;
pub use norm::{Norm, NormKind};
pub use rope::Rope;

/// An input that entered a column-parallel region ([`Linear::forward_shared`]).
// A short-lived local of one forward call: the size of its variants does not matter.
#[allow(clippy::large_enum_variant)]
enum Entered<const D: usize> {
    /// The whole input in the graph (replicated with *f*, or all-gathered).
    Whole(Tensor<D>),
    /// Sequence parallelism: the shard in the graph, the gathered sequence for the products.
    Sequence(GatheredSequence<D>),
}

/// How a [`Linear`] is split.
#[derive(Debug, Clone)]
pub enum LinearSplit {
    /// The whole weight on every rank.
    Replicated,
    /// Output features: this rank holds `shard` of them.
    Column {
        /// This rank's output features.
        shard: Shard,
        /// The tensor-parallel group.
        group: ProcessGroup,
        /// The input arrives sequence-sharded and is all-gathered first.
        sequence_parallel: bool,
    },
    /// Input features: this rank holds `shard` of them.
    Row {
        /// This rank's input features.
        shard: Shard,
        /// The tensor-parallel group.
        group: ProcessGroup,
        /// The output leaves sequence-sharded (reduce-scatter instead of all-reduce).
        sequence_parallel: bool,
    },
}

/// A linear layer `y = x W + b` (`W: [d_in, d_out]`, Burn's layout) that a plan may split by
/// output features (colwise) or input features (rowwise). See the module docs.
#[derive(Module, Debug)]
pub struct Linear {
    /// This rank's part of the weight: `[d_in, d_out]`, `[d_in, shard]` or `[shard, d_out]`.
    pub weight: Param<Tensor<2>>,
    /// The bias: this rank's part for a column split, whole otherwise.
    pub bias: Option<Param<Tensor<1>>>,
    /// How the layer is split.
    #[module(skip)]
    pub split: LinearSplit,
    /// The layer's module path (error messages).
    #[module(skip)]
    pub name: String,
    /// Where the weight's gradient is deferred to (a zero-bubble pipeline schedule's `W` step,
    /// see [`Linear::with_deferred_weight`]); `None`: computed by `backward()` as usual.
    #[module(skip)]
    pub deferred: Option<Arc<dyn WeightGradSink>>,
}

impl Linear {
    /// Builds the layer at `init`'s own path as its plan says: [`Init::linear`]`(name, spec)` is
    /// `Linear::init(&init.at(name), spec)`. A lone layer that is an FSDP unit is built this
    /// way inside the unit's builder (`plan.wrap(&init.at("fc"), |init| Linear::init(init,
    /// spec))`), so that its parameters keep the names of the unwrapped model (`fc.weight`).
    ///
    /// # Errors
    /// [`TpError::Plan`] when the plan gives the layer a style it cannot take.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::Device;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::nn::Linear;
    ///
    /// let init = Init::new(7, &Device::flex());
    /// let fc = Linear::init(&init.at("fc"), LinearInit::new(4, 2)).unwrap();
    /// assert_eq!(fc.name, "fc");
    /// let same = init.linear("fc", LinearInit::new(4, 2)).unwrap();
    /// assert_eq!(fc.weight.val().into_data(), same.weight.val().into_data());
    /// ```
    pub fn init(init: &Init, spec: LinearInit) -> TpResult<Self> {
        let name = init.path("");
        let name = name.trim_end_matches('.').to_string();
        let LinearInit {
            d_in,
            d_out,
            bias,
            weight: weight_init,
            bias_init,
            block,
        } = spec;
        let split = |full: usize, group: &ProcessGroup, what: &str, multiple: Option<usize>| {
            let split = match multiple {
                Some(multiple) => Split::Padded { multiple },
                None if block > 1 => Split::Blocks { block },
                None => Split::Even,
            };
            split.shard(full, group.size(), group.rank(), &format!("{name}: {what}"))
        };
        let (weight, bias, split) = match init.layer_split() {
            None | Some((_, TpStyle::Replicate, ..)) => (
                init.param_part("weight", [d_in, d_out], weight_init, None),
                bias.then(|| init.param_part("bias", [d_out], bias_init, None)),
                LinearSplit::Replicated,
            ),
            Some((group, style @ (TpStyle::Colwise | TpStyle::Vocab), sp, multiple)) => {
                let multiple = (style == TpStyle::Vocab).then_some(multiple);
                let shard = split(d_out, &group, "output features", multiple)?;
                (
                    init.param_part("weight", [d_in, d_out], weight_init, Some((1, &shard))),
                    bias.then(|| init.param_part("bias", [d_out], bias_init, Some((0, &shard)))),
                    LinearSplit::Column {
                        shard,
                        group,
                        sequence_parallel: sp,
                    },
                )
            }
            Some((group, TpStyle::Rowwise, sp, _)) => {
                let shard = split(d_in, &group, "input features", None)?;
                (
                    init.param_part("weight", [d_in, d_out], weight_init, Some((0, &shard))),
                    bias.then(|| init.param_part("bias", [d_out], bias_init, None)),
                    LinearSplit::Row {
                        shard,
                        group,
                        sequence_parallel: sp,
                    },
                )
            }
            Some((_, style @ TpStyle::SequenceNorm, ..)) => {
                return Err(TpError::Plan(format!(
                    "`{name}` is a linear layer; the plan gives it the style {style}, which is \
                     for norms (use colwise, rowwise, vocab or replicate)"
                )));
            }
        };
        Ok(Self {
            weight,
            bias,
            split,
            name,
            deferred: None,
        })
    }

    /// Defers the weight's gradient to `sink` (`burn_pipeline::deferred::WeightGradStore`):
    /// `backward()` then computes the input gradient and the bias's, and records `(X, dY)` for
    /// the schedule's `W` step, which computes `dW = Xᵀ dY` (the split backward of zero-bubble
    /// schedules). The tensor-parallel split is unchanged: the deferred product is this rank's
    /// part. `None` turns it off.
    pub fn with_deferred_weight(mut self, sink: Option<Arc<dyn WeightGradSink>>) -> Self {
        self.deferred = sink;
        self
    }

    /// `x W (+ b)` on this rank's part, with the weight's gradient deferred when asked.
    fn product<const D: usize>(&self, x: Tensor<D>, bias: Option<Tensor<1>>) -> Tensor<D> {
        let Some(sink) = &self.deferred else {
            // The fused product (one pass, no copies on Flex; Burn's `linear` elsewhere). The
            // shapes were checked by `forward`.
            return crate::kernels::linear(x, self.weight.val(), bias)
                .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        };
        let dims = x.dims();
        let rows = dims[..D - 1].iter().product::<usize>();
        let y = deferred_matmul(x.reshape([rows, dims[D - 1]]), &self.weight, sink.clone());
        let mut out = dims;
        out[D - 1] = self.weight.dims()[1];
        let y = y.reshape(out);
        match bias {
            Some(b) => y + b.unsqueeze(),
            None => y,
        }
    }

    /// Checks that an input of `width` features is what this rank's part takes.
    fn check_width(&self, width: usize) -> TpResult<()> {
        let expected = self.weight.dims()[0];
        if width == expected {
            return Ok(());
        }
        let hint = match &self.split {
            LinearSplit::Row { .. } => {
                " (a row-parallel layer takes the feature shard of the column-parallel layer \
                 before it: is that layer planned colwise?)"
            }
            _ => "",
        };
        Err(TpError::Shape {
            layer: self.name.clone(),
            reason: format!("input has {width} features, this rank's part takes {expected}{hint}"),
        })
    }

    /// How a column-parallel layer enters its region for an input of rank `D`: its group and
    /// whether the input is all-gathered along the sequence (`true`) or only marked with *f*
    /// (`false`). `None` for replicated and row-parallel layers (no entry).
    fn column_entry<const D: usize>(&self) -> Option<(&ProcessGroup, bool)> {
        match &self.split {
            LinearSplit::Column {
                group,
                sequence_parallel,
                ..
            } => Some((group, *sequence_parallel && D >= 3)),
            _ => None,
        }
    }

    /// Enters the column-parallel region as `entry` says. Under sequence parallelism the
    /// sequence is all-gathered once for the forward products, and the graph keeps only the
    /// shard ([`GatheredSequence`]: each product's backward gathers it again and
    /// reduce-scatters its input gradient), unless `deferred` (a layer defers its weight
    /// gradient, which needs the gathered input): then the gathered input itself enters the
    /// graph ([`gather_from_sequence`], backward: reduce-scatter). Otherwise Megatron's *f*
    /// (backward: all-reduce).
    fn enter<const D: usize>(
        x: Tensor<D>,
        (group, gather): (&ProcessGroup, bool),
        deferred: bool,
    ) -> TpResult<Entered<D>> {
        Ok(match (gather, deferred) {
            (true, false) => Entered::Sequence(GatheredSequence::new(x, group, SEQ_DIM)?),
            (true, true) => Entered::Whole(gather_from_sequence(x, group, SEQ_DIM)?),
            (false, _) => Entered::Whole(copy_to_group(x, group)),
        })
    }

    /// This layer's product on an input that entered its region.
    fn apply_entered<const D: usize>(&self, entered: &Entered<D>) -> Tensor<D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        match entered {
            Entered::Whole(x) => self.product(x.clone(), bias),
            Entered::Sequence(gathered) => gathered.linear(self.weight.val(), bias),
        }
    }

    /// Applies several layers to the same input `x`, entering the tensor-parallel region once:
    /// the projections of one sub-layer (attention's `q`, `k`, `v`; a gated MLP's `gate` and
    /// `up`). Under sequence parallelism the sequence shard `x` is all-gathered once for the
    /// column-parallel layers of the same group, and the backward keeps only the shard
    /// (Megatron's saving, [`GatheredSequence`]: each layer's backward gathers it again for its
    /// weight gradient and reduce-scatters its input gradient); without sequence parallelism
    /// they share one *f*, so their input gradients are summed before one all-reduce. A layer
    /// that defers its weight gradient ([`Self::with_deferred_weight`]) makes the gathered
    /// input enter the graph whole instead. A layer split otherwise than the first
    /// (replicated, or over another group) enters on its own, as [`Self::forward`] does, so
    /// the result is always that of `K` calls of [`Self::forward`].
    ///
    /// # Arguments
    /// - `layers`: the layers, all taking `x`'s features.
    /// - `x`: `[.., features]`, as [`Self::forward`] takes it (this rank's tokens
    ///   `[batch, tokens, features]` under sequence parallelism).
    ///
    /// # Returns
    /// The `K` outputs, in the order of `layers`.
    ///
    /// # Errors
    /// [`TpError::Shape`] when a layer does not take `x`'s width on this rank; collective
    /// errors.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::nn::Linear;
    ///
    /// let init = Init::new(3, &Device::flex());
    /// let q = init.linear("q", LinearInit::new(4, 4)).unwrap();
    /// let k = init.linear("k", LinearInit::new(4, 4)).unwrap();
    /// init.finish().unwrap();
    /// let x = Tensor::<3>::ones([2, 5, 4], &Device::flex());
    /// let [yq, yk] = Linear::forward_shared([&q, &k], x.clone()).unwrap();
    /// yq.into_data().assert_eq(&q.forward(x.clone()).unwrap().into_data(), true);
    /// yk.into_data().assert_eq(&k.forward(x).unwrap().into_data(), true);
    /// ```
    pub fn forward_shared<const D: usize, const K: usize>(
        layers: [&Linear; K],
        x: Tensor<D>,
    ) -> TpResult<[Tensor<D>; K]> {
        let width = x.dims()[D - 1];
        for layer in layers {
            layer.check_width(width)?;
        }
        let same = |a: (&ProcessGroup, bool), b: (&ProcessGroup, bool)| {
            a.1 == b.1 && a.0.members() == b.0.members()
        };
        // The entry of the first column-parallel layer, made once.
        let shared_entry = layers.iter().find_map(|l| l.column_entry::<D>());
        let shares = |l: &Linear| match (l.column_entry::<D>(), shared_entry) {
            (Some(entry), Some(first)) => same(entry, first),
            _ => false,
        };
        let deferred = layers.iter().any(|l| shares(l) && l.deferred.is_some());
        let shared = match shared_entry {
            Some(entry) => Some(Self::enter(x.clone(), entry, deferred)?),
            None => None,
        };
        let mut out = Vec::with_capacity(K);
        for layer in layers {
            let y = match &shared {
                Some(entered) if shares(layer) => layer.apply_entered(entered),
                _ => layer.forward(x.clone())?,
            };
            out.push(y);
        }
        Ok(out
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per layer")))
    }

    /// Applies the layer to `x` `[.., features]`.
    ///
    /// - replicated: `x W + b`;
    /// - column: `x` replicated (sequence-sharded `[batch, seq, ..]` under sequence
    ///   parallelism, gathered here); returns this rank's output features;
    /// - row: `x` holds this rank's input features (a column layer's output); returns the
    ///   replicated result (sequence-sharded under sequence parallelism).
    ///
    /// Several column-parallel layers applied to the same input share one entry into the
    /// region with [`Self::forward_shared`].
    ///
    /// # Errors
    /// [`TpError::Shape`] when the width of `x` is not what the layer takes on this rank;
    /// collective errors.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> TpResult<Tensor<D>> {
        self.check_width(x.dims()[D - 1])?;
        let bias = self.bias.as_ref().map(|b| b.val());
        match &self.split {
            LinearSplit::Replicated => Ok(self.product(x, bias)),
            LinearSplit::Column { .. } => {
                let entry = self.column_entry::<D>().expect("a column split");
                let entered = Self::enter(x, entry, self.deferred.is_some())?;
                Ok(self.apply_entered(&entered))
            }
            LinearSplit::Row {
                group,
                sequence_parallel,
                ..
            } => {
                let partial = self.product(x, None);
                let y = row_output(partial, group, *sequence_parallel)?.into_tensor();
                Ok(match bias {
                    None => y,
                    Some(b) => y + sp_param(b, group, *sequence_parallel && D >= 3).unsqueeze(),
                })
            }
        }
    }

    /// Mean cross-entropy of the logits `logits` `[batch, seq, out]` this layer produced (an
    /// output head) against `targets` `[batch, seq]`: the ordinary cross-entropy for a replicated
    /// head, the vocabulary-parallel one for a head split by the plan (colwise or vocab), both
    /// in f32 whatever the logits' dtype (a mixed-precision compute copy's). The result `[1]`,
    /// f32, is the same on every rank.
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`] for a target outside the vocabulary; collective errors.
    pub fn cross_entropy(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        let split = match &self.split {
            LinearSplit::Column { shard, group, .. } => Some((*shard, group)),
            LinearSplit::Replicated | LinearSplit::Row { .. } => None,
        };
        head_cross_entropy(&self.name, logits, targets, split)
    }
}

/// Mean cross-entropy of the logits `[batch, seq, out]` an output head (`layer`) produced
/// against `targets` `[batch, seq]`: the ordinary one for a replicated head, the
/// vocabulary-parallel one for a head whose outputs are split (`split`: this rank's shard and
/// the group). What [`Linear::cross_entropy`] and [`Embedding::cross_entropy`] share.
fn head_cross_entropy(
    layer: &str,
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    split: Option<(crate::tensor_parallel::Shard, &ProcessGroup)>,
) -> TpResult<Tensor<1>> {
    // Mixed precision: the softmax and the loss in f32, as autocast does (the logits of a
    // compute copy are in its dtype; a bf16 loss would keep 8 bits of mantissa).
    let logits = match logits.dtype() {
        DType::F32 => logits,
        _ => logits.cast(DType::F32),
    };
    let [b, s, v] = logits.dims();
    let logits = logits.reshape([b * s, v]);
    let targets = targets.reshape([b * s]);
    match split {
        Some((shard, group)) => {
            let logits = TpTensor::new(logits, Placement::Shard { dim: 1, shard }, group)?;
            vocab_parallel_cross_entropy(logits, targets, CrossEntropyOptions::default())
        }
        None => {
            check_targets(layer, &targets, v)?;
            Ok(log_softmax(logits, 1)
                .gather(1, targets.reshape([b * s, 1]))
                .mean()
                .neg())
        }
    }
}

fn check_targets(layer: &str, targets: &Tensor<1, Int>, vocab: usize) -> TpResult<()> {
    let ids = targets.clone().into_data().convert::<i64>();
    let ids = ids.as_slice::<i64>().expect("converted to i64");
    match ids.iter().find(|&&t| t < 0 || t as usize >= vocab) {
        Some(&id) => Err(TpError::OutOfVocabulary {
            layer: layer.into(),
            id,
            vocab,
        }),
        None => Ok(()),
    }
}

/// An embedding table `[vocab, d_model]` that a plan may split by vocabulary rows
/// ([`TpStyle::Vocab`], padded so every rank stores the same number of rows).
#[derive(Module, Debug)]
pub struct Embedding {
    /// The whole table, or this rank's rows `[shard.stored, d_model]`.
    pub weight: Param<Tensor<2>>,
    /// The split, `None` when replicated.
    #[module(skip)]
    pub split: Option<crate::tensor_parallel::VocabSplit>,
    /// The vocabulary size.
    #[module(skip)]
    pub vocab: usize,
    /// The layer's module path (error messages).
    #[module(skip)]
    pub name: String,
}

impl Embedding {
    /// Builds the table at `init`'s own path as its plan says ([`Init::embedding`]`(name, ..)` is
    /// `Embedding::init(&init.at(name), ..)`): a lone table that is an FSDP unit keeps its
    /// path, as [`Linear::init`] says.
    ///
    /// # Errors
    /// [`TpError::Plan`] when the plan gives the table a style it cannot take.
    pub fn init(init: &Init, vocab: usize, d_model: usize, std: f64) -> TpResult<Self> {
        let name = init.path("").trim_end_matches('.').to_string();
        let normal = Initializer::Normal { std };
        let (weight, split) = match init.layer_split() {
            None | Some((_, TpStyle::Replicate, ..)) => (
                init.param_part("weight", [vocab, d_model], normal, None),
                None,
            ),
            Some((group, TpStyle::Vocab, _, multiple)) => {
                let shard = Split::Padded { multiple }.shard(
                    vocab,
                    group.size(),
                    group.rank(),
                    &format!("{name}: vocabulary"),
                )?;
                (
                    init.param_part("weight", [vocab, d_model], normal, Some((0, &shard))),
                    Some(crate::tensor_parallel::VocabSplit { shard, group }),
                )
            }
            Some((_, style, ..)) => {
                return Err(TpError::Plan(format!(
                    "`{name}` is an embedding; the plan gives it the style {style} (use vocab or \
                     replicate)"
                )));
            }
        };
        Ok(Self {
            weight,
            split,
            vocab,
            name,
        })
    }

    /// Embeds `tokens` `[batch, seq]` to `[batch, seq, d_model]`, replicated on every rank.
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`] for an id outside the vocabulary; collective errors.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        let [b, s] = tokens.dims();
        check_targets(&self.name, &tokens.clone().reshape([b * s]), self.vocab)?;
        match &self.split {
            None => Ok(burn::tensor::module::embedding(self.weight.val(), tokens)),
            Some(split) => Ok(split.lookup(self.weight.val(), tokens)?.into_tensor()),
        }
    }

    /// Logits `x E^T` of `x` `[batch, seq, d_model]` against the table (tied input and output
    /// embeddings); under a vocabulary split, this rank's vocabulary shard, for
    /// [`Self::cross_entropy`].
    ///
    /// # Errors
    /// Collective errors.
    pub fn attend(&self, x: Tensor<3>, ctx: &TpContext) -> TpResult<Tensor<3>> {
        let w = self.weight.val().transpose();
        match &self.split {
            None => Ok(linear(x, w, None)),
            Some(split) => {
                let x = if ctx.sequence_parallel {
                    gather_from_sequence(x, &split.group, SEQ_DIM)?
                } else {
                    copy_to_group(x, &split.group)
                };
                Ok(linear(x, w, None))
            }
        }
    }

    /// Mean cross-entropy of logits from [`Self::attend`] against `targets` `[batch, seq]`.
    ///
    /// # Errors
    /// As [`Linear::cross_entropy`].
    pub fn cross_entropy(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        let split = self.split.as_ref().map(|split| (split.shard, &split.group));
        head_cross_entropy(&self.name, logits, targets, split)
    }
}

// The layers' constructors on `Init`, here with the layers: `crate::init` sits below them.
impl Init {
    /// A linear layer `name` (`name.weight` `[d_in, d_out]`, `name.bias` `[d_out]`), split as
    /// the plan says: see [`Linear`].
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] when the split cannot be made (heads not divisible by the
    /// group size); [`TpError::Plan`] when the plan gives a linear layer a style it cannot take.
    pub fn linear(&self, name: &str, spec: LinearInit) -> TpResult<Linear> {
        Linear::init(&self.at(name), spec)
    }

    /// An embedding table `name.weight` `[vocab, d_model]` (Normal(0, `std`)), split by
    /// vocabulary when the plan says [`TpStyle::Vocab`]: see [`Embedding`].
    ///
    /// # Errors
    /// [`TpError::Plan`] when the plan gives an embedding a style it cannot take.
    pub fn embedding(
        &self,
        name: &str,
        vocab: usize,
        d_model: usize,
        std: f64,
    ) -> TpResult<Embedding> {
        Embedding::init(&self.at(name), vocab, d_model, std)
    }
}
