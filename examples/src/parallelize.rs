//! Tensor-parallel (and sequence-parallel) plans for the reference [`Gpt`] and [`Vit`]
//! (torchtitan's `parallelize_llama`, for Burn).
//!
//! [`parallelize_gpt`] / [`parallelize_vit`] take the ordinary model (any device, freshly
//! initialised from the seed or trained) and a [`DeviceMesh`] with a `tp` dimension, and return
//! the model with every block split over the `tp` group, its parameters the exact shards of
//! the full ones (so a tensor-parallel run starts from the single-device model):
//!
//! | reference parameter | tensor-parallel layer | split |
//! |---|---|---|
//! | `wte` | [`VocabParallelEmbedding`] | vocabulary rows, padded to `tp` equal shards |
//! | `attn.q`, `attn.k`, `attn.v` | column-parallel ([`ParallelAttention`]) | whole heads |
//! | `attn.o` | row-parallel | whole heads |
//! | `mlp.up`, `mlp.gate` | column-parallel ([`ParallelMlp`]) | hidden units (even) |
//! | `mlp.down` | row-parallel | hidden units |
//! | `lm_head` | column-parallel, vocabulary-parallel loss | vocabulary (padded) |
//! | norms, `wpe`, ViT `patch_embed`/`cls_token`/`pos_embed`/`head` | replicated | - |
//!
//! With [`TpOptions::sequence_parallel`], the norms, residual adds and dropouts between the
//! blocks run on the rank's tokens only (Korthikanti et al. 2022); the replicated parameters
//! used there get their gradients summed over the group by [`sp_param`]. Results are the same
//! either way.
//!
//! [`TpGpt::to_full`] / [`TpVit::to_full`] gather the shards back into the reference model,
//! for saving and evaluation.
//!
//! Dropout (when the config asks for it) uses [`SeededDropout`]: its numbers depend on the
//! global position of each element, so replicated activations get the same mask on every rank
//! of a tensor-parallel group and sharded ones (heads, tokens under SP) different masks that
//! together equal the tensor-parallel-size-1 mask; the data-parallel coordinate separates
//! replicas.
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use burn_parallel::{DeviceMesh, run_local};
//! use examples::gpt::{Gpt, GptConfig};
//! use examples::parallelize::{TpOptions, parallelize_gpt};
//!
//! let config = GptConfig { d_ff: 32, ..GptConfig::new(256, 1, 2, 8, 16) };
//! let losses = run_local(2, |world| {
//!     let mesh = DeviceMesh::new(&world, &[("tp", 2)]).unwrap();
//!     let device = Device::flex();
//!     let full = Gpt::new(&config, &device);
//!     let tp = parallelize_gpt(&full, &mesh, &TpOptions::default(), &device).unwrap();
//!     let tokens = Tensor::<2, Int>::zeros([1, 4], &device);
//!     let loss = tp.loss(tokens.clone(), tokens).unwrap();
//!     Ok(loss.into_data().to_vec::<f32>().unwrap()[0])
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]);
//! ```

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Int, Tensor};
use burn_parallel::tensor_parallel::{
    ColumnParallelLinear, CrossEntropyOptions, Placement, SeededDropout, Split, TpError, TpResult,
    TpTensor, VocabParallelEmbedding, sp_param, vocab_parallel_cross_entropy,
};
use burn_parallel::{DeviceMesh, ParallelAttention, ParallelMlp, ProcessGroup};

use crate::gpt::{Block, Gpt, GptConfig, Norm, PositionKind, Rope, cross_entropy};
use crate::vit::{Vit, VitConfig, patchify};

/// How to parallelise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpOptions {
    /// Split the activations between the blocks along the sequence (sequence parallelism).
    pub sequence_parallel: bool,
    /// Each rank's vocabulary shard is a multiple of this (Megatron pads to 128).
    pub vocab_multiple: usize,
}

impl Default for TpOptions {
    fn default() -> Self {
        Self {
            sequence_parallel: false,
            vocab_multiple: 1,
        }
    }
}

fn tp_group(mesh: &DeviceMesh) -> TpResult<ProcessGroup> {
    mesh.group("tp").cloned().map_err(|e| {
        TpError::Config(format!(
            "the mesh needs a \"tp\" dimension (use (\"tp\", 1) for none): {e}"
        ))
    })
}

fn dropout_stream(mesh: &DeviceMesh) -> u64 {
    mesh.coord("dp").unwrap_or(0) as u64
}

/// A fresh copy of a replicated parameter on `device` (no autodiff node shared with `p`).
fn copy_param<const D: usize>(p: &Param<Tensor<D>>, device: &Device) -> Param<Tensor<D>> {
    Param::from_data(p.val().into_data(), device)
}

fn copy_norm(norm: &Norm, device: &Device) -> Norm {
    Norm {
        weight: copy_param(&norm.weight, device),
        bias: norm.bias.as_ref().map(|b| copy_param(b, device)),
        kind: norm.kind,
        eps: norm.eps,
    }
}

fn copy_linear(l: &Linear, device: &Device) -> Linear {
    Linear {
        weight: copy_param(&l.weight, device),
        bias: l.bias.as_ref().map(|b| copy_param(b, device)),
    }
}

fn full(l: &Linear) -> (Tensor<2>, Option<Tensor<1>>) {
    (l.weight.val(), l.bias.as_ref().map(|b| b.val()))
}

fn linear_from(w: Tensor<2>, b: Option<Tensor<1>>, device: &Device) -> Linear {
    Linear {
        weight: Param::from_data(w.into_data(), device),
        bias: b.map(|b| Param::from_data(b.into_data(), device)),
    }
}

/// Applies `norm` to `x`; under sequence parallelism its parameters' gradients are summed
/// over the group.
fn apply_norm(norm: &Norm, x: TpTensor<3>, sp: bool) -> TpResult<TpTensor<3>> {
    let sp = sp && x.group().size() > 1;
    let w = sp_param(norm.weight.val(), x.group(), sp);
    let b = norm.bias.as_ref().map(|b| sp_param(b.val(), x.group(), sp));
    x.map_features("norm", |t| norm.forward_with(t, w, b))
}

/// A tensor-parallel transformer block (the reference [`Block`] with its attention and MLP
/// split over the `tp` group).
#[derive(Module, Debug)]
pub struct TpBlock {
    /// Norm before attention (replicated).
    pub ln_1: Norm,
    /// Attention, heads split.
    pub attn: ParallelAttention,
    /// Norm before the MLP (replicated).
    pub ln_2: Norm,
    /// MLP, hidden units split.
    pub mlp: ParallelMlp,
    /// Sequence parallelism between the sub-layers.
    #[module(skip)]
    pub sequence_parallel: bool,
}

impl TpBlock {
    /// Shards `block` (whose parameters live under `path`, for dropout sites and messages).
    fn new(
        block: &Block,
        path: &str,
        dropout: f64,
        seed: u64,
        options: &TpOptions,
        mesh: &DeviceMesh,
        device: &Device,
    ) -> TpResult<Self> {
        let group = tp_group(mesh)?;
        let sp = options.sequence_parallel;
        let a = &block.attn;
        let n_heads = a.q.weight.dims()[1] / a.head_dim;
        let mut attn = ParallelAttention::from_full(
            full(&a.q),
            full(&a.k),
            full(&a.v),
            full(&a.o),
            n_heads,
            a.causal,
            sp,
            &group,
            device,
        )?
        .with_name(&format!("{path}.attn"));
        let m = &block.mlp;
        let mut mlp = ParallelMlp::from_full(
            full(&m.up),
            m.gate.as_ref().map(full),
            full(&m.down),
            sp,
            &group,
            device,
        )?
        .with_name(&format!("{path}.mlp"));
        if dropout > 0.0 {
            let stream = dropout_stream(mesh);
            let drop = |site: &str| {
                SeededDropout::new(dropout, seed, &format!("{path}.{site}")).with_stream(stream)
            };
            attn = attn.with_dropout(drop("attn.attn_drop"), drop("attn.resid_drop"));
            mlp = mlp.with_dropout(drop("mlp.drop"));
        }
        Ok(Self {
            ln_1: copy_norm(&block.ln_1, device),
            attn,
            ln_2: copy_norm(&block.ln_2, device),
            mlp,
            sequence_parallel: sp,
        })
    }

    /// `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
    ///
    /// # Errors
    /// Layout and collective errors of the layers.
    pub fn forward(&self, x: TpTensor<3>, rope: Option<&Rope>) -> TpResult<TpTensor<3>> {
        let sp = self.sequence_parallel;
        let rotate = rope.map(|r| move |t: Tensor<4>| r.apply(t));
        let rotate = rotate
            .as_ref()
            .map(|f| f as &dyn Fn(Tensor<4>) -> Tensor<4>);
        let h = apply_norm(&self.ln_1, x.clone(), sp)?;
        let x = x.residual_add(self.attn.forward(h, rotate)?)?;
        let h = apply_norm(&self.ln_2, x.clone(), sp)?;
        x.residual_add(self.mlp.forward(h)?)
    }

    /// The reference block, gathered on every rank of the group (collective).
    fn to_full(&self, device: &Device) -> TpResult<Block> {
        let lin = |(w, b): (Tensor<2>, Option<Tensor<1>>)| linear_from(w, b, device);
        let a = &self.attn;
        let m = &self.mlp;
        Ok(Block {
            ln_1: copy_norm(&self.ln_1, device),
            attn: crate::gpt::Attention {
                q: lin(a.q.full_weights()?),
                k: lin(a.k.full_weights()?),
                v: lin(a.v.full_weights()?),
                o: lin(a.o.full_weights()?),
                attn_drop: burn::nn::DropoutConfig::new(prob(&a.attn_drop)).init(),
                resid_drop: burn::nn::DropoutConfig::new(prob(&a.resid_drop)).init(),
                head_dim: a.head_dim,
                causal: a.causal,
            },
            ln_2: copy_norm(&self.ln_2, device),
            mlp: crate::gpt::Mlp {
                up: lin(m.up.full_weights()?),
                gate: m
                    .gate
                    .as_ref()
                    .map(|g| g.full_weights().map(lin))
                    .transpose()?,
                down: lin(m.down.full_weights()?),
                drop: burn::nn::DropoutConfig::new(prob(&m.drop)).init(),
            },
        })
    }
}

fn prob(d: &Option<SeededDropout>) -> f64 {
    d.as_ref().map_or(0.0, SeededDropout::prob)
}

/// The tensor-parallel GPT built by [`parallelize_gpt`].
#[derive(Module, Debug)]
pub struct TpGpt {
    /// Token embedding, vocabulary split.
    pub wte: VocabParallelEmbedding,
    /// Learned positions (replicated).
    pub wpe: Option<Embedding>,
    /// The blocks.
    pub blocks: Vec<TpBlock>,
    /// Final norm (replicated).
    pub ln_f: Norm,
    /// Output projection, vocabulary split; `None` when tied to `wte`.
    pub lm_head: Option<ColumnParallelLinear>,
    /// Dropout on the embeddings.
    #[module(skip)]
    pub drop: Option<SeededDropout>,
    /// The reference configuration.
    #[module(skip)]
    pub config: GptConfig,
    /// Sequence parallelism.
    #[module(skip)]
    pub sequence_parallel: bool,
}

/// Splits the reference `model` over the `tp` dimension of `mesh`; parameters are created on
/// `device` (use `device.autodiff()` to train).
///
/// # Errors
/// [`TpError::NotDivisible`] when `n_heads` is not a multiple of the `tp` size;
/// [`TpError::Config`] when the mesh has no `tp` dimension.
pub fn parallelize_gpt(
    model: &Gpt,
    mesh: &DeviceMesh,
    options: &TpOptions,
    device: &Device,
) -> TpResult<TpGpt> {
    let group = tp_group(mesh)?;
    let config = &model.config;
    if !config.n_heads.is_multiple_of(group.size()) {
        return Err(TpError::NotDivisible {
            what: "n_heads".into(),
            value: config.n_heads,
            tp: group.size(),
            hint: "; attention is split by whole heads".into(),
        });
    }
    let sp = options.sequence_parallel;
    let wte = VocabParallelEmbedding::from_full(
        model.wte.weight.val(),
        options.vocab_multiple,
        &group,
        device,
    )?
    .with_sequence_parallel(sp)
    .with_name("wte");
    let lm_head = match &model.lm_head {
        None => None,
        Some(head) => Some(
            ColumnParallelLinear::from_full(
                head.weight.val(),
                head.bias.as_ref().map(|b| b.val()),
                Split::Padded {
                    multiple: options.vocab_multiple,
                },
                &group,
                device,
            )?
            .with_sequence_parallel(sp)
            .with_name("lm_head"),
        ),
    };
    let blocks = model
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            TpBlock::new(
                b,
                &format!("blocks.{i}"),
                config.dropout,
                config.seed,
                options,
                mesh,
                device,
            )
        })
        .collect::<TpResult<Vec<_>>>()?;
    let drop = (config.dropout > 0.0).then(|| {
        SeededDropout::new(config.dropout, config.seed, "drop").with_stream(dropout_stream(mesh))
    });
    Ok(TpGpt {
        wte,
        wpe: model.wpe.as_ref().map(|e| Embedding {
            weight: copy_param(&e.weight, device),
        }),
        blocks,
        ln_f: copy_norm(&model.ln_f, device),
        lm_head,
        drop,
        config: config.clone(),
        sequence_parallel: sp,
    })
}

impl TpGpt {
    /// The tensor-parallel group.
    pub fn group(&self) -> &ProcessGroup {
        &self.wte.group
    }

    /// Vocabulary-sharded logits `[batch, seq, local vocab]` of `tokens` `[batch, seq]`.
    ///
    /// # Errors
    /// [`TpError::OutOfVocabulary`]; [`TpError::Shape`] when the sequence exceeds
    /// `max_seq_len`; collective errors.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> TpResult<TpTensor<3>> {
        let [b, s] = tokens.dims();
        let device = tokens.device();
        if s > self.config.max_seq_len {
            return Err(TpError::Shape {
                layer: "TpGpt".into(),
                reason: format!(
                    "sequence of {s} tokens exceeds max_seq_len {}",
                    self.config.max_seq_len
                ),
            });
        }
        let sp = self.sequence_parallel && self.group().size() > 1;
        let mut x = self.wte.forward(tokens)?;
        let token_range = match x.placement() {
            Placement::Shard { shard, .. } => (shard.start, shard.len),
            _ => (0, s),
        };
        if let Some(wpe) = &self.wpe {
            let table = sp_param(wpe.weight.val(), self.group(), sp);
            let pos = table.narrow(0, token_range.0, token_range.1);
            x = x.map("wpe", |t| t + pos.unsqueeze::<3>())?;
        }
        if let Some(drop) = &self.drop {
            let site = burn_parallel::tensor_parallel::DropoutSite::new(
                &[b, s, self.config.d_model],
                &[0, token_range.0, 0],
            );
            x = x.map("dropout", |t| drop.forward(t, &site))?;
        }
        let rope = match self.config.positions {
            PositionKind::Rotary => Some(Rope::new(
                self.config.head_dim(),
                s,
                0,
                self.config.rope_theta,
                &device,
            )),
            PositionKind::Learned => None,
        };
        for block in &self.blocks {
            x = block.forward(x, rope.as_ref())?;
        }
        let x = apply_norm(&self.ln_f, x, self.sequence_parallel)?;
        match &self.lm_head {
            Some(head) => head.forward(x),
            None => self.wte.attend(x),
        }
    }

    /// Mean next-token cross-entropy (vocabulary-parallel, the full logits never formed),
    /// replicated over the group.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        let [b, s] = targets.dims();
        let logits = self.forward(tokens)?;
        let placement = logits.placement().clone();
        let Placement::Shard { shard, .. } = placement else {
            return Err(TpError::Config(
                "the output layer must not gather its output".into(),
            ));
        };
        let group = logits.group().clone();
        let flat = logits.into_tensor().reshape([b * s, shard.stored]);
        let flat = TpTensor::new(flat, Placement::Shard { dim: 1, shard }, &group)?;
        vocab_parallel_cross_entropy(
            flat,
            targets.reshape([b * s]),
            CrossEntropyOptions::default(),
        )
    }

    /// The reference model with the full weights, built on every rank (collective: every rank
    /// of the group must call it).
    ///
    /// # Errors
    /// Collective errors.
    pub fn to_full(&self, device: &Device) -> TpResult<Gpt> {
        let blocks = self
            .blocks
            .iter()
            .map(|b| b.to_full(device))
            .collect::<TpResult<Vec<_>>>()?;
        Ok(Gpt {
            wte: Embedding {
                weight: Param::from_data(self.wte.full_weight()?.into_data(), device),
            },
            wpe: self.wpe.as_ref().map(|e| Embedding {
                weight: copy_param(&e.weight, device),
            }),
            drop: burn::nn::DropoutConfig::new(prob(&self.drop)).init(),
            blocks,
            ln_f: copy_norm(&self.ln_f, device),
            lm_head: match &self.lm_head {
                Some(h) => {
                    let (w, b) = h.full_weights()?;
                    Some(linear_from(w, b, device))
                }
                None => None,
            },
            config: self.config.clone(),
        })
    }
}

/// The tensor-parallel ViT built by [`parallelize_vit`]: the patch embedding and classifier
/// are replicated (they are small), the encoder blocks split.
#[derive(Module, Debug)]
pub struct TpVit {
    /// Patch projection (replicated).
    pub patch_embed: Linear,
    /// Class token (replicated).
    pub cls_token: Param<Tensor<3>>,
    /// Position embedding (replicated).
    pub pos_embed: Param<Tensor<3>>,
    /// Encoder blocks.
    pub blocks: Vec<TpBlock>,
    /// Final norm (replicated).
    pub ln_f: Norm,
    /// Classifier (replicated).
    pub head: Linear,
    /// The reference configuration.
    #[module(skip)]
    pub config: VitConfig,
    /// Sequence parallelism in the encoder (the 1 + patches tokens split, unevenly if needed).
    #[module(skip)]
    pub sequence_parallel: bool,
    /// The tensor-parallel group.
    #[module(skip)]
    pub group: ProcessGroup,
}

/// Splits the reference ViT over the `tp` dimension of `mesh`.
///
/// # Errors
/// As [`parallelize_gpt`].
pub fn parallelize_vit(
    model: &Vit,
    mesh: &DeviceMesh,
    options: &TpOptions,
    device: &Device,
) -> TpResult<TpVit> {
    let group = tp_group(mesh)?;
    let blocks = model
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            TpBlock::new(
                b,
                &format!("blocks.{i}"),
                0.0,
                model.config.seed,
                options,
                mesh,
                device,
            )
        })
        .collect::<TpResult<Vec<_>>>()?;
    Ok(TpVit {
        patch_embed: copy_linear(&model.patch_embed, device),
        cls_token: copy_param(&model.cls_token, device),
        pos_embed: copy_param(&model.pos_embed, device),
        blocks,
        ln_f: copy_norm(&model.ln_f, device),
        head: copy_linear(&model.head, device),
        config: model.config.clone(),
        sequence_parallel: options.sequence_parallel,
        group,
    })
}

impl TpVit {
    /// Class logits `[batch, n_classes]` (replicated) of `images` `[batch, channels, size, size]`.
    ///
    /// # Errors
    /// Layout and collective errors.
    pub fn forward(&self, images: Tensor<4>) -> TpResult<Tensor<2>> {
        let [b, _, _, _] = images.dims();
        let d = self.config.d_model;
        let x = self
            .patch_embed
            .forward(patchify(images, self.config.patch_size));
        let cls = self.cls_token.val().expand([b, 1, d]);
        let x = Tensor::cat(vec![cls, x], 1) + self.pos_embed.val();
        let mut x = TpTensor::replicated(x, &self.group);
        if self.sequence_parallel && self.group.size() > 1 {
            x = x.scatter_sequence()?;
        }
        for block in &self.blocks {
            x = block.forward(x, None)?;
        }
        let x = x.to_replicated()?.into_tensor();
        let cls = self.ln_f.forward(x).narrow(1, 0, 1).reshape([b, d]);
        Ok(self.head.forward(cls))
    }

    /// Mean cross-entropy against `labels` `[batch]`, replicated.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn loss(&self, images: Tensor<4>, labels: Tensor<1, Int>) -> TpResult<Tensor<1>> {
        Ok(cross_entropy(self.forward(images)?, labels))
    }

    /// The reference ViT with the full weights (collective).
    ///
    /// # Errors
    /// Collective errors.
    pub fn to_full(&self, device: &Device) -> TpResult<Vit> {
        Ok(Vit {
            patch_embed: copy_linear(&self.patch_embed, device),
            cls_token: copy_param(&self.cls_token, device),
            pos_embed: copy_param(&self.pos_embed, device),
            blocks: self
                .blocks
                .iter()
                .map(|b| b.to_full(device))
                .collect::<TpResult<Vec<_>>>()?,
            ln_f: copy_norm(&self.ln_f, device),
            head: copy_linear(&self.head, device),
            config: self.config.clone(),
        })
    }
}

/// Model sizes that a `tp` split must divide, checked before any rank builds anything.
///
/// # Errors
/// [`TpError::NotDivisible`] for the heads; [`TpError::Config`] for `tp == 0`.
pub fn check_gpt_tp(config: &GptConfig, tp: usize) -> TpResult<()> {
    if tp == 0 {
        return Err(TpError::Config("tp must be at least 1".into()));
    }
    if !config.n_heads.is_multiple_of(tp) {
        return Err(TpError::NotDivisible {
            what: "n_heads".into(),
            value: config.n_heads,
            tp,
            hint: "; attention is split by whole heads".into(),
        });
    }
    Ok(())
}
