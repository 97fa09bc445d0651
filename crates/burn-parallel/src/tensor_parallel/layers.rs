//! The tensor-parallel layers: column- and row-parallel linear maps, the vocabulary-parallel
//! embedding, and attention and MLP built from them.

use burn::module::{Module, Param};
use burn::tensor::activation::{gelu, silu, softmax};
use burn::tensor::module::{embedding, linear};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use super::dropout::{DropoutSite, SeededDropout};
use super::{
    Placement, SEQ_DIM, Shard, Split, TpError, TpResult, TpTensor, sequence_shard, sp_param,
};
use crate::autograd::{
    even_split, gather_from_sequence, reduce_from_group, reduce_scatter_to_sequence,
};
use crate::group::ProcessGroup;

/// `full`'s shard along `dim`, zero-padded to `shard.stored`, as host data.
fn take_shard<const D: usize>(full: Tensor<D>, dim: usize, shard: &Shard) -> TensorData {
    let full = full.detach();
    let mut part = full.clone().narrow(dim, shard.start, shard.len);
    if shard.stored > shard.len {
        let mut shape = full.dims();
        shape[dim] = shard.stored - shard.len;
        let pad = Tensor::<D>::zeros(shape, (&full.device(), full.dtype()));
        part = if shard.len == 0 {
            pad
        } else {
            Tensor::cat(vec![part, pad], dim)
        };
    }
    part.into_data()
}

/// Gathers a parameter shard along `dim` on every rank and drops the padding.
fn gather_param<const D: usize>(
    local: Tensor<D>,
    dim: usize,
    shard: &Shard,
    group: &ProcessGroup,
) -> TpResult<Tensor<D>> {
    let gathered = group.all_gather(local.detach(), dim)?;
    Ok(if gathered.dims()[dim] == shard.full {
        gathered
    } else {
        gathered.narrow(dim, 0, shard.full)
    })
}

/// Prepares the input of a column-parallel layer: Megatron's *f* on a replicated tensor, or
/// the all-gather of the sequence shards under sequence parallelism.
fn column_input<const D: usize>(
    x: TpTensor<D>,
    group: &ProcessGroup,
    sequence_parallel: bool,
    d_in: usize,
    layer: &str,
) -> TpResult<Tensor<D>> {
    x.same_group(group, layer)?;
    let width = x.dims()[D - 1];
    if width != d_in {
        return Err(TpError::Shape {
            layer: layer.into(),
            reason: format!(
                "input has {width} features, the layer takes {d_in} (a feature shard? then \
                 this layer should be a RowParallelLinear)"
            ),
        });
    }
    match (sequence_parallel, x.placement().clone()) {
        (false, Placement::Replicate) => Ok(if group.size() == 1 {
            x.into_tensor()
        } else {
            x.enter_region()
        }),
        (true, Placement::Shard { dim, shard }) if dim == SEQ_DIM && D >= 3 => {
            if shard.stored != shard.len {
                return Err(TpError::Layout {
                    layer: layer.into(),
                    expected: "a sequence shard without padding".into(),
                    got: x.placement().to_string(),
                    hint: String::new(),
                });
            }
            if group.size() == 1 {
                return Ok(x.into_tensor());
            }
            Ok(gather_from_sequence(x.into_tensor(), group, SEQ_DIM)?)
        }
        (sp, placement) => Err(TpError::Layout {
            layer: layer.into(),
            expected: if sp {
                "a sequence-parallel input (sharded along dim 1 of [batch, seq, ..])".into()
            } else {
                "a replicated input".into()
            },
            got: placement.to_string(),
            hint: match placement {
                Placement::Partial => "reduce the partial sum first".into(),
                Placement::Shard { dim, .. } if dim == D - 1 => {
                    "a feature shard must go to a RowParallelLinear, not a column-parallel \
                     layer (or gather it with gather_output)"
                        .into()
                }
                _ if sp => "the previous layer must run with sequence parallelism too \
                            (RowParallelLinear / VocabParallelEmbedding with_sequence_parallel, \
                            or TpTensor::scatter_sequence)"
                    .into(),
                _ => "this layer was built with_sequence_parallel(false) while its input is \
                      sequence-sharded: enable sequence parallelism on every layer of the region"
                    .into(),
            },
        }),
    }
}

/// Leaves a row-parallel region: all-reduce (Megatron's *g*), or reduce-scatter along the
/// sequence under sequence parallelism.
pub(crate) fn row_output<const D: usize>(
    partial: Tensor<D>,
    group: &ProcessGroup,
    sequence_parallel: bool,
) -> TpResult<TpTensor<D>> {
    if sequence_parallel && D >= 3 {
        let seq = partial.dims()[SEQ_DIM];
        let shard = sequence_shard(seq, group)?;
        let y = if group.size() == 1 {
            partial
        } else {
            let sizes = even_split(seq, group.size());
            reduce_scatter_to_sequence(partial, group, SEQ_DIM, Some(&sizes))?
        };
        TpTensor::new(
            y,
            Placement::Shard {
                dim: SEQ_DIM,
                shard,
            },
            group,
        )
    } else {
        let y = if group.size() == 1 {
            partial
        } else {
            reduce_from_group(partial, group)?
        };
        Ok(TpTensor::replicated(y, group))
    }
}

/// A linear layer `y = x W + b` whose weight `W: [d_in, d_out]` is split by output features
/// (columns): this rank computes its slice of the outputs.
///
/// Input: replicated (sequence-sharded under sequence parallelism, all-gathered here).
/// Output: sharded along the last dimension, or gathered to a replicated tensor with
/// [`with_gather_output`](Self::with_gather_output).
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::{run_local, tensor_parallel::{ColumnParallelLinear, Split, TpTensor}};
/// run_local(2, |group| {
///     let device = Device::flex();
///     let w = Tensor::<2>::ones([4, 6], &device);
///     let layer = ColumnParallelLinear::from_full(w, None, Split::Even, &group, &device)
///         .unwrap()
///         .with_gather_output(true);
///     let x = TpTensor::replicated(Tensor::<2>::ones([2, 4], &device), &group);
///     assert_eq!(layer.forward(x).unwrap().dims(), [2, 6]);
///     Ok(())
/// })
/// .unwrap();
/// ```
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// This rank's columns `[d_in, shard.stored]` (zero padding columns at the end).
    pub weight: Param<Tensor<2>>,
    /// This rank's part of the bias `[shard.stored]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// Which output features this rank holds.
    #[module(skip)]
    pub shard: Shard,
    /// Input features.
    #[module(skip)]
    pub d_in: usize,
    /// All-gather the output to a replicated tensor.
    #[module(skip)]
    pub gather_output: bool,
    /// Input sharded along the sequence (all-gathered before the matmul).
    #[module(skip)]
    pub sequence_parallel: bool,
    /// Name used in error messages.
    #[module(skip)]
    pub name: String,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: ProcessGroup,
}

/// A bias of a linear layer with weight `[d_in, d_out]` must be `[d_out]`.
fn check_bias(layer: &str, bias: Option<&Tensor<1>>, d_in: usize, d_out: usize) -> TpResult<()> {
    match bias {
        Some(b) if b.dims() != [d_out] => Err(TpError::Shape {
            layer: layer.into(),
            reason: format!(
                "bias {:?} does not match weight [{d_in}, {d_out}]",
                b.dims()
            ),
        }),
        _ => Ok(()),
    }
}

impl ColumnParallelLinear {
    /// This rank's shard of the full `weight` `[d_in, d_out]` and `bias` `[d_out]` (Burn's
    /// `Linear` layout), as fresh parameters on `device`.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] / [`TpError::Config`] from `split`; [`TpError::Shape`] when
    /// the bias does not match.
    pub fn from_full(
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        split: Split,
        group: &ProcessGroup,
        device: &Device,
    ) -> TpResult<Self> {
        let [d_in, d_out] = weight.dims();
        let shard = split.shard(d_out, group.size(), group.rank(), "output features")?;
        check_bias("ColumnParallelLinear", bias.as_ref(), d_in, d_out)?;
        Ok(Self {
            weight: Param::from_data(take_shard(weight, 1, &shard), device),
            bias: bias.map(|b| Param::from_data(take_shard(b, 0, &shard), device)),
            shard,
            d_in,
            gather_output: false,
            sequence_parallel: false,
            name: "ColumnParallelLinear".into(),
            group: group.clone(),
        })
    }

    /// Gathers the output to a replicated tensor (padding dropped).
    pub fn with_gather_output(mut self, gather: bool) -> Self {
        self.gather_output = gather;
        self
    }

    /// Takes sequence-sharded input (sequence parallelism).
    pub fn with_sequence_parallel(mut self, sp: bool) -> Self {
        self.sequence_parallel = sp;
        self
    }

    /// Names the layer in error messages (its module path).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Applies the layer.
    ///
    /// # Errors
    /// [`TpError::Layout`] when `x` is not replicated (sequence-sharded under sequence
    /// parallelism); [`TpError::Shape`] for a wrong width; collective errors.
    pub fn forward<const D: usize>(&self, x: TpTensor<D>) -> TpResult<TpTensor<D>> {
        let x = column_input(
            x,
            &self.group,
            self.sequence_parallel,
            self.d_in,
            &self.name,
        )?;
        self.forward_entered(x)
    }

    /// The matmul on an input already prepared by `column_input` (shared by q, k, v).
    pub(crate) fn forward_entered<const D: usize>(&self, x: Tensor<D>) -> TpResult<TpTensor<D>> {
        let y = linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()));
        let placement = Placement::Shard {
            dim: D - 1,
            shard: self.shard,
        };
        let y = TpTensor::new(y, placement, &self.group)?;
        if self.gather_output {
            y.to_replicated()
        } else {
            Ok(y)
        }
    }

    /// The full weight `[d_in, d_out]` and bias, gathered on every rank (collective).
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_weights(&self) -> TpResult<(Tensor<2>, Option<Tensor<1>>)> {
        let w = gather_param(self.weight.val(), 1, &self.shard, &self.group)?;
        let b = match &self.bias {
            Some(b) => Some(gather_param(b.val(), 0, &self.shard, &self.group)?),
            None => None,
        };
        Ok((w, b))
    }
}

/// A linear layer `y = x W + b` whose weight `W: [d_in, d_out]` is split by input features
/// (rows): each rank multiplies its feature shard of `x` by its rows, and the partial products
/// are summed over the group. The bias is added once, after the sum.
///
/// Input: sharded along the last dimension with exactly this layer's input partition (the
/// output of the matching [`ColumnParallelLinear`]). Output: replicated (all-reduce), or
/// sequence-sharded (reduce-scatter) under sequence parallelism.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// This rank's rows `[shard.stored, d_out]`.
    pub weight: Param<Tensor<2>>,
    /// The bias `[d_out]`, replicated.
    pub bias: Option<Param<Tensor<1>>>,
    /// Which input features this rank holds.
    #[module(skip)]
    pub shard: Shard,
    /// Output features.
    #[module(skip)]
    pub d_out: usize,
    /// Reduce-scatter the output along the sequence instead of all-reducing it.
    #[module(skip)]
    pub sequence_parallel: bool,
    /// Name used in error messages.
    #[module(skip)]
    pub name: String,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: ProcessGroup,
}

impl RowParallelLinear {
    /// This rank's rows of the full `weight` `[d_in, d_out]`, and the whole `bias`.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::from_full`].
    pub fn from_full(
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        split: Split,
        group: &ProcessGroup,
        device: &Device,
    ) -> TpResult<Self> {
        let [d_in, d_out] = weight.dims();
        let shard = split.shard(d_in, group.size(), group.rank(), "input features")?;
        check_bias("RowParallelLinear", bias.as_ref(), d_in, d_out)?;
        Ok(Self {
            weight: Param::from_data(take_shard(weight, 0, &shard), device),
            bias: bias.map(|b| Param::from_data(b.detach().into_data(), device)),
            shard,
            d_out,
            sequence_parallel: false,
            name: "RowParallelLinear".into(),
            group: group.clone(),
        })
    }

    /// Reduce-scatters the output along the sequence (sequence parallelism).
    pub fn with_sequence_parallel(mut self, sp: bool) -> Self {
        self.sequence_parallel = sp;
        self
    }

    /// Names the layer in error messages (its module path).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Applies the layer.
    ///
    /// # Errors
    /// [`TpError::Layout`] unless `x` is sharded along its last dimension with this layer's
    /// input partition; collective errors.
    pub fn forward<const D: usize>(&self, x: TpTensor<D>) -> TpResult<TpTensor<D>> {
        x.same_group(&self.group, &self.name)?;
        match x.placement() {
            Placement::Shard { dim, shard } if *dim == D - 1 && *shard == self.shard => {}
            Placement::Shard { dim, shard } if *dim == D - 1 => {
                return Err(TpError::Layout {
                    layer: self.name.clone(),
                    expected: format!("the feature shard {}", self.shard),
                    got: format!("the feature shard {shard}"),
                    hint: "the column-parallel layer before it splits its outputs differently \
                           (another width, or heads vs an even split): build both with the same \
                           Split"
                        .into(),
                });
            }
            placement => {
                return Err(TpError::Layout {
                    layer: self.name.clone(),
                    expected: format!(
                        "its input sharded along the last dim ({}), as a ColumnParallelLinear \
                         without gather_output produces",
                        self.shard
                    ),
                    got: placement.to_string(),
                    hint: match placement {
                        Placement::Replicate => "a replicated (full or gathered) tensor fed to a \
                                                 row-parallel layer would be summed tp times: \
                                                 drop gather_output on the previous layer"
                            .into(),
                        _ => "pair each RowParallelLinear with the ColumnParallelLinear before it"
                            .into(),
                    },
                });
            }
        }
        let y = linear(x.into_tensor(), self.weight.val(), None);
        let y = row_output(y, &self.group, self.sequence_parallel)?;
        match &self.bias {
            None => Ok(y),
            Some(b) => {
                let b = sp_param(
                    b.val(),
                    &self.group,
                    self.sequence_parallel && self.group.size() > 1,
                );
                y.map("bias", |t| t + b.unsqueeze())
            }
        }
    }

    /// The full weight `[d_in, d_out]` and bias, gathered on every rank (collective).
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_weights(&self) -> TpResult<(Tensor<2>, Option<Tensor<1>>)> {
        let w = gather_param(self.weight.val(), 0, &self.shard, &self.group)?;
        Ok((w, self.bias.as_ref().map(|b| b.val().detach())))
    }
}

/// A vocabulary split over a group: which rows of an embedding table this rank holds.
#[derive(Debug, Clone)]
pub struct VocabSplit {
    /// This rank's vocabulary ids.
    pub shard: Shard,
    /// The tensor-parallel group.
    pub group: ProcessGroup,
}

impl VocabSplit {
    /// Embeds `tokens` (ids already checked against the vocabulary) with this rank's rows
    /// `weight`: ids of other ranks' ranges give zeros here, and the partial embeddings are
    /// summed over the group (reduce-scattered along the sequence under sequence parallelism).
    pub(crate) fn lookup(
        &self,
        weight: Tensor<2>,
        tokens: Tensor<2, Int>,
        sequence_parallel: bool,
    ) -> TpResult<TpTensor<3>> {
        let [b, s] = tokens.dims();
        let d = weight.dims()[1];
        let (start, end) = (
            self.shard.start as i64,
            (self.shard.start + self.shard.len) as i64,
        );
        let outside: Tensor<2, Bool> = tokens
            .clone()
            .lower_elem(start)
            .bool_or(tokens.clone().greater_equal_elem(end));
        let local = (tokens - start).mask_fill(outside.clone(), 0);
        let partial = embedding(weight, local)
            .mask_fill(outside.unsqueeze_dim::<3>(2).expand([b, s, d]), 0.0);
        row_output(partial, &self.group, sequence_parallel)
    }
}

/// A token embedding whose rows (the vocabulary) are split over the group, padded so that
/// every rank stores the same number of rows (the padding rows are zero and never selected).
/// Tokens of other ranks' ranges are masked to zero here and the partial embeddings summed.
///
/// Output: replicated, or sequence-sharded under sequence parallelism. [`Self::attend`] uses
/// the same shard as a vocabulary-parallel output projection (tied embeddings).
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// This rank's rows `[shard.stored, d_model]`.
    pub weight: Param<Tensor<2>>,
    /// Which vocabulary ids this rank holds.
    #[module(skip)]
    pub shard: Shard,
    /// Reduce-scatter the output along the sequence instead of all-reducing it.
    #[module(skip)]
    pub sequence_parallel: bool,
    /// Name used in error messages.
    #[module(skip)]
    pub name: String,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: ProcessGroup,
}

impl VocabParallelEmbedding {
    /// This rank's rows of the full table `[vocab, d_model]`, split with
    /// `Split::Padded { multiple }`.
    ///
    /// # Errors
    /// [`TpError::Config`] for `multiple == 0`.
    pub fn from_full(
        weight: Tensor<2>,
        multiple: usize,
        group: &ProcessGroup,
        device: &Device,
    ) -> TpResult<Self> {
        let [vocab, _] = weight.dims();
        let shard = Split::Padded { multiple }.shard(vocab, group.size(), group.rank(), "vocab")?;
        Ok(Self {
            weight: Param::from_data(take_shard(weight, 0, &shard), device),
            shard,
            sequence_parallel: false,
            name: "VocabParallelEmbedding".into(),
            group: group.clone(),
        })
    }

    /// Reduce-scatters the output along the sequence (sequence parallelism); also makes
    /// [`Self::attend`] take sequence-sharded input.
    pub fn with_sequence_parallel(mut self, sp: bool) -> Self {
        self.sequence_parallel = sp;
        self
    }

    /// Names the layer in error messages (its module path).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The vocabulary size (without padding).
    pub fn vocab_size(&self) -> usize {
        self.shard.full
    }

    /// Embeds `tokens` `[batch, seq]` to `[batch, seq, d_model]`.
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`] for an id outside `0..vocab`; collective errors.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> TpResult<TpTensor<3>> {
        let ids = tokens.clone().into_data().convert::<i64>();
        let ids = ids.as_slice::<i64>().expect("converted to i64");
        if let Some(&id) = ids
            .iter()
            .find(|&&t| t < 0 || t as usize >= self.shard.full)
        {
            return Err(TpError::OutOfVocabulary {
                layer: self.name.clone(),
                id,
                vocab: self.shard.full,
            });
        }
        VocabSplit {
            shard: self.shard,
            group: self.group.clone(),
        }
        .lookup(self.weight.val(), tokens, self.sequence_parallel)
    }

    /// Vocabulary-parallel logits `x E^T` of `x` `[batch, seq, d_model]`: sharded along the
    /// vocabulary (padding columns included, masked by
    /// [`vocab_parallel_cross_entropy`](super::vocab_parallel_cross_entropy)).
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::forward`].
    pub fn attend(&self, x: TpTensor<3>) -> TpResult<TpTensor<3>> {
        let d = self.weight.dims()[1];
        let name = format!("{} (attend)", self.name);
        let x = column_input(x, &self.group, self.sequence_parallel, d, &name)?;
        let y = linear(x, self.weight.val().transpose(), None);
        TpTensor::new(
            y,
            Placement::Shard {
                dim: 2,
                shard: self.shard,
            },
            &self.group,
        )
    }

    /// The full table `[vocab, d_model]`, gathered on every rank (collective).
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_weight(&self) -> TpResult<Tensor<2>> {
        gather_param(self.weight.val(), 0, &self.shard, &self.group)
    }
}

/// Multi-head self-attention with the heads split over the group: `q`, `k`, `v` are
/// column-parallel (by whole heads), `o` row-parallel. The input is entered once (one
/// all-reduce of its gradient, or one all-gather under sequence parallelism) for all three
/// projections.
#[derive(Module, Debug)]
pub struct ParallelAttention {
    /// Query projection (this rank's heads).
    pub q: ColumnParallelLinear,
    /// Key projection.
    pub k: ColumnParallelLinear,
    /// Value projection.
    pub v: ColumnParallelLinear,
    /// Output projection.
    pub o: RowParallelLinear,
    /// Width of one head.
    #[module(skip)]
    pub head_dim: usize,
    /// Mask future positions.
    #[module(skip)]
    pub causal: bool,
    /// Dropout on the attention probabilities (sharded by heads).
    #[module(skip)]
    pub attn_drop: Option<SeededDropout>,
    /// Dropout on the output (replicated, or sequence-sharded).
    #[module(skip)]
    pub resid_drop: Option<SeededDropout>,
}

/// Full `(weight, bias)` of one linear map, Burn layout `[d_in, d_out]`.
pub type FullLinear = (Tensor<2>, Option<Tensor<1>>);

impl ParallelAttention {
    /// Shards full `q`, `k`, `v`, `o` weights over `group` by whole heads.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] when `n_heads` is not a multiple of the group size;
    /// [`TpError::Config`] when the widths do not match `n_heads`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_full(
        q: FullLinear,
        k: FullLinear,
        v: FullLinear,
        o: FullLinear,
        n_heads: usize,
        causal: bool,
        sequence_parallel: bool,
        group: &ProcessGroup,
        device: &Device,
    ) -> TpResult<Self> {
        let width = q.0.dims()[1];
        if n_heads == 0 || !width.is_multiple_of(n_heads) {
            return Err(TpError::Config(format!(
                "attention width {width} is not a multiple of n_heads {n_heads}"
            )));
        }
        if !n_heads.is_multiple_of(group.size()) {
            return Err(TpError::NotDivisible {
                what: "n_heads".into(),
                value: n_heads,
                tp: group.size(),
                hint: "; attention is split by whole heads".into(),
            });
        }
        let head_dim = width / n_heads;
        let split = Split::Blocks { block: head_dim };
        let col = |(w, b): FullLinear, name: &str| {
            ColumnParallelLinear::from_full(w, b, split, group, device)
                .map(|l| l.with_sequence_parallel(sequence_parallel).with_name(name))
        };
        Ok(Self {
            q: col(q, "attn.q")?,
            k: col(k, "attn.k")?,
            v: col(v, "attn.v")?,
            o: RowParallelLinear::from_full(o.0, o.1, split, group, device)?
                .with_sequence_parallel(sequence_parallel)
                .with_name("attn.o"),
            head_dim,
            causal,
            attn_drop: None,
            resid_drop: None,
        })
    }

    /// Sets the dropouts (probabilities and sites).
    pub fn with_dropout(mut self, attn: SeededDropout, resid: SeededDropout) -> Self {
        self.attn_drop = Some(attn);
        self.resid_drop = Some(resid);
        self
    }

    /// Names the projections `{prefix}.q`, ... in error messages.
    pub fn with_name(mut self, prefix: &str) -> Self {
        self.q.name = format!("{prefix}.q");
        self.k.name = format!("{prefix}.k");
        self.v.name = format!("{prefix}.v");
        self.o.name = format!("{prefix}.o");
        self
    }

    /// Heads held by this rank.
    pub fn local_heads(&self) -> usize {
        self.q.shard.len / self.head_dim
    }

    fn split_heads(&self, x: Tensor<3>) -> Tensor<4> {
        let [b, s, width] = x.dims();
        x.reshape([b, s, width / self.head_dim, self.head_dim])
            .swap_dims(1, 2)
    }

    /// Attends over the sequence.
    ///
    /// # Arguments
    /// - `x`: `[batch, seq, d_model]`, replicated (sequence-sharded under sequence parallelism).
    /// - `rotate`: applied to `q` and `k` `[batch, local heads, seq, head_dim]` (rotary
    ///   positions of the *whole* sequence), or `None`.
    ///
    /// # Errors
    /// [`TpError::Layout`] / [`TpError::Shape`] for a mis-placed input; collective errors.
    pub fn forward(
        &self,
        x: TpTensor<3>,
        rotate: Option<&dyn Fn(Tensor<4>) -> Tensor<4>>,
    ) -> TpResult<TpTensor<3>> {
        let group = &self.q.group;
        let x = column_input(
            x,
            group,
            self.q.sequence_parallel,
            self.q.d_in,
            &self.q.name,
        )?;
        let [b, s, _] = x.dims();
        let mut q = self.split_heads(self.q.forward_entered(x.clone())?.into_tensor());
        let mut k = self.split_heads(self.k.forward_entered(x.clone())?.into_tensor());
        let v = self.split_heads(self.v.forward_entered(x)?.into_tensor());
        if let Some(rotate) = rotate {
            q = rotate(q);
            k = rotate(k);
        }
        let heads = q.dims()[1];
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mut scores = q.matmul(k.swap_dims(2, 3)) * scale;
        if self.causal {
            let mask = crate::kernels::causal_mask(0..s, 0..s, &scores.device())
                .reshape([1, 1, s, s])
                .expand([b, heads, s, s]);
            scores = scores.mask_fill(mask, f32::NEG_INFINITY);
        }
        let mut probs = softmax(scores, 3);
        if let Some(drop) = &self.attn_drop {
            let total_heads = self.q.shard.full / self.head_dim;
            let first = self.q.shard.start / self.head_dim;
            let site = DropoutSite::new(&[b, total_heads, s, s], &[0, first, 0, 0]);
            probs = drop.forward(probs, &site);
        }
        let y = probs
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, s, heads * self.head_dim]);
        let y = TpTensor::new(
            y,
            Placement::Shard {
                dim: 2,
                shard: self.o.shard,
            },
            group,
        )?;
        let out = self.o.forward(y)?;
        apply_resid_dropout(out, self.resid_drop.as_ref(), b, s)
    }
}

/// Dropout on a residual-branch output: replicated, or sequence-sharded.
fn apply_resid_dropout(
    out: TpTensor<3>,
    drop: Option<&SeededDropout>,
    batch: usize,
    seq: usize,
) -> TpResult<TpTensor<3>> {
    let Some(drop) = drop else { return Ok(out) };
    let d = out.dims()[2];
    let site = match out.placement() {
        Placement::Shard { dim: 1, shard } => {
            DropoutSite::new(&[batch, seq, d], &[0, shard.start, 0])
        }
        _ => DropoutSite::full(&[batch, seq, d]),
    };
    out.map("dropout", |t| drop.forward(t, &site))
}

/// The activation of a [`ParallelMlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpActivation {
    /// `down(gelu(up(x)))`.
    Gelu,
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
}

/// Feed-forward network with the hidden units split over the group: `up` (and `gate`)
/// column-parallel, `down` row-parallel.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    /// Up projection.
    pub up: ColumnParallelLinear,
    /// Gate projection (SwiGLU).
    pub gate: Option<ColumnParallelLinear>,
    /// Down projection.
    pub down: RowParallelLinear,
    /// Dropout on the output.
    #[module(skip)]
    pub drop: Option<SeededDropout>,
}

impl ParallelMlp {
    /// Shards full `up`, `gate` (SwiGLU) and `down` weights over `group` (hidden units split
    /// evenly; an uneven hidden width is allowed).
    ///
    /// # Errors
    /// [`TpError::Config`] when `gate` is given for GELU or missing for SwiGLU, or the widths do
    /// not match.
    pub fn from_full(
        up: FullLinear,
        gate: Option<FullLinear>,
        down: FullLinear,
        sequence_parallel: bool,
        group: &ProcessGroup,
        device: &Device,
    ) -> TpResult<Self> {
        if up.0.dims()[1] != down.0.dims()[0] {
            return Err(TpError::Config(format!(
                "up {:?} and down {:?} do not match",
                up.0.dims(),
                down.0.dims()
            )));
        }
        let col = |(w, b): FullLinear, name: &str| {
            ColumnParallelLinear::from_full(w, b, Split::Even, group, device)
                .map(|l| l.with_sequence_parallel(sequence_parallel).with_name(name))
        };
        Ok(Self {
            up: col(up, "mlp.up")?,
            gate: gate.map(|g| col(g, "mlp.gate")).transpose()?,
            down: RowParallelLinear::from_full(down.0, down.1, Split::Even, group, device)?
                .with_sequence_parallel(sequence_parallel)
                .with_name("mlp.down"),
            drop: None,
        })
    }

    /// Sets the output dropout.
    pub fn with_dropout(mut self, drop: SeededDropout) -> Self {
        self.drop = Some(drop);
        self
    }

    /// Names the projections `{prefix}.up`, ... in error messages.
    pub fn with_name(mut self, prefix: &str) -> Self {
        self.up.name = format!("{prefix}.up");
        if let Some(g) = &mut self.gate {
            g.name = format!("{prefix}.gate");
        }
        self.down.name = format!("{prefix}.down");
        self
    }

    /// The activation.
    pub fn activation(&self) -> MlpActivation {
        if self.gate.is_some() {
            MlpActivation::SwiGlu
        } else {
            MlpActivation::Gelu
        }
    }

    /// `[batch, seq, d_model] -> [batch, seq, d_model]`.
    ///
    /// # Errors
    /// As [`ParallelAttention::forward`].
    pub fn forward(&self, x: TpTensor<3>) -> TpResult<TpTensor<3>> {
        let group = &self.up.group;
        let x = column_input(
            x,
            group,
            self.up.sequence_parallel,
            self.up.d_in,
            &self.up.name,
        )?;
        let [b, s, _] = x.dims();
        let hidden = match &self.gate {
            None => self.up.forward_entered(x)?.map("gelu", gelu)?,
            Some(gate) => {
                let g = gate.forward_entered(x.clone())?.into_tensor();
                self.up.forward_entered(x)?.map("swiglu", |u| silu(g) * u)?
            }
        };
        let out = self.down.forward(hidden)?;
        apply_resid_dropout(out, self.drop.as_ref(), b, s)
    }
}
