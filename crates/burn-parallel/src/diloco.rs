//! DiLoCo: low-communication data parallelism for islands joined by slow links.
//!
//! The world is cut into *islands* (groups of ranks, [`Islands`]). Each island trains on its own
//! with its inner optimizer (AdamW, say; data parallel inside the island when it has several
//! ranks) for `H` steps. Then every island computes its *pseudo-gradient*
//! `Δ = θ_start − θ_end`, the islands average it over the *outer* group (the ranks with the same
//! position in their islands), and an outer optimizer (SGD with Nesterov momentum) moves the
//! shared starting point: `θ_start ← θ_start − lr · nesterov(avg Δ)`. Every island then
//! continues from the new `θ_start`. Communication happens once every `H` steps instead of once
//! per step, so the bytes sent drop by about `H` (DiLoCo, Douillard et al. 2023; OpenDiLoCo).
//!
//! Options of [`DiLoCoConfig`]:
//! - [`Compression`]: the pseudo-gradients travel as fp16, bf16 or int8 with one f32 scale per
//!   block; the average is still accumulated in f32 (each rank gathers the islands' compressed
//!   pseudo-gradients and sums them in f32, in island order, so every rank gets the same bits).
//!   Without compression they are averaged by a ring all-reduce in f32.
//! - *streaming* DiLoCo (`fragments` > 1): the parameters are cut into `F` fragments of about the
//!   same number of elements (consecutive parameters in module order); fragment `f` is synced
//!   after the inner steps `s` with `(s + 1) % H == f·H/F`, so each fragment is still synced
//!   every `H` steps, but the traffic is spread over the `H` steps instead of one burst. The
//!   sync runs on the calling thread (no overlap with compute): the parameter values must be
//!   read after the inner step that precedes it and written before the next one, and the burst
//!   is already `F` times smaller.
//!
//! Every rank of an island takes part in the outer sync with the ranks at its position in the
//! other islands, and syncs the whole fragment: the islands' replicas are identical, so each
//! outer group computes the same average and no broadcast inside the island is needed, but the
//! links between islands carry `ranks per island` copies of it. A hierarchical sync (each
//! position averaging `1 / ranks per island` of the fragment, then an all-gather inside the
//! island) would divide that traffic by the island size; it is not done here.
//!
//! An island that disappears is *not* dropped from the average: the group API marks the whole
//! world failed when one rank fails (every pending and later call ends), so there is no clean
//! way to go on with the survivors. A lost island is a typed error instead,
//! [`DiLoCoError::IslandLost`], naming it, never a hang (collectives have timeouts).
//!
//! Bytes on the wire are counted by [`count_sent_bytes`], a transport wrapper that adds up the
//! payload of every frame a rank sends (the same measure for DiLoCo and for a DDP baseline).
//!
//! # Example
//! ```
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{GradientsParams, Optimizer, SgdConfig};
//! use burn::tensor::{Device, Tensor};
//! use burn_parallel::diloco::{DiLoCo, DiLoCoConfig, Islands};
//! use burn_parallel::run_local;
//!
//! let weights = run_local(2, |world| {
//!     let device = Device::flex().autodiff();
//!     // Two islands of one rank each; the same initial weights everywhere.
//!     let islands = Islands::new(&world, 2).unwrap();
//!     let mut model: Linear = LinearConfig::new(4, 1).init(&device);
//!     model = islands.broadcast_module(model).unwrap();
//!     let config = DiLoCoConfig { inner_steps: 2, ..DiLoCoConfig::default() };
//!     let mut diloco = DiLoCo::new(&islands, config, &model).unwrap();
//!     let mut optim = SgdConfig::new().init();
//!     for step in 0..4 {
//!         // Each island sees other data.
//!         let x = Tensor::<2>::ones([8, 4], &device) * (islands.index() as f32 + 1.0);
//!         let loss = model.forward(x).powf_scalar(2.0).mean();
//!         let grads = GradientsParams::from_grads(loss.backward(), &model);
//!         model = optim.step(0.01, model, grads);
//!         model = diloco.sync(step, model).unwrap(); // outer step after steps 1 and 3
//!     }
//!     Ok(model.weight.val().into_data().try_to_vec::<f32>().unwrap())
//! })
//! .unwrap();
//! assert_eq!(weights[0], weights[1]); // both islands hold the outer model
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use crate::comm::host::ReduceOp;
use crate::comm::transport::{Frame, Mailbox, Transport};
use crate::ddp::{DistributedDataParallel, is_frozen};
use crate::error::CollectiveError;
use crate::group::{ProcessGroup, tensor_from_data};

/// How pseudo-gradients travel between islands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// 4 bytes per element, averaged by a ring all-reduce.
    #[default]
    F32,
    /// IEEE half precision, 2 bytes per element.
    Fp16,
    /// bfloat16, 2 bytes per element (f32's range, 8 bits of mantissa).
    Bf16,
    /// Symmetric int8 with one f32 scale (`max |x| / 127`) per block of `block_size` elements:
    /// `1 + 4 / block_size` bytes per element.
    Int8 {
        /// Elements per scale.
        block_size: usize,
    },
}

impl Compression {
    /// Int8 with blocks of 256 elements (a scale costs 1.6% of the payload).
    pub const INT8: Compression = Compression::Int8 { block_size: 256 };

    /// Bytes of `n` elements once encoded.
    pub fn encoded_len(self, n: usize) -> usize {
        match self {
            Compression::F32 => 4 * n,
            Compression::Fp16 | Compression::Bf16 => 2 * n,
            Compression::Int8 { block_size } => n + 4 * n.div_ceil(block_size.max(1)),
        }
    }

    /// Encodes `values` for the wire (little-endian).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len(values.len()));
        match self {
            Compression::F32 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            Compression::Fp16 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
            Compression::Bf16 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
            Compression::Int8 { block_size } => {
                let blocks: Vec<&[f32]> = values.chunks(block_size.max(1)).collect();
                let scales: Vec<f32> = blocks
                    .iter()
                    .map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0)
                    .collect();
                scales
                    .iter()
                    .for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
                for (block, &scale) in blocks.iter().zip(&scales) {
                    for v in *block {
                        let q = if scale > 0.0 {
                            (v / scale).round().clamp(-127.0, 127.0) as i8
                        } else {
                            0
                        };
                        out.push(q as u8);
                    }
                }
            }
        }
        out
    }

    /// Decodes `bytes` (from [`Compression::encode`] of `acc.len()` values) and adds the values
    /// to `acc`.
    ///
    /// # Errors
    /// A message when `bytes` has not the length `acc.len()` values encode to.
    pub fn decode_add(self, bytes: &[u8], acc: &mut [f32]) -> Result<(), String> {
        let expected = self.encoded_len(acc.len());
        if bytes.len() != expected {
            return Err(format!(
                "{} bytes arrived for {} values in {self:?}, expected {expected}",
                bytes.len(),
                acc.len()
            ));
        }
        match self {
            Compression::F32 => {
                for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(4)) {
                    *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Compression::Fp16 => {
                for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                    *a += half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Compression::Bf16 => {
                for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                    *a += half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Compression::Int8 { block_size } => {
                let block_size = block_size.max(1);
                let n_blocks = acc.len().div_ceil(block_size);
                let (scales, values) = bytes.split_at(4 * n_blocks);
                for (k, block) in acc.chunks_mut(block_size).enumerate() {
                    let s = &scales[4 * k..4 * k + 4];
                    let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    let q = &values[k * block_size..k * block_size + block.len()];
                    for (a, &q) in block.iter_mut().zip(q) {
                        *a += f32::from(q as i8) * scale;
                    }
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compression::F32 => write!(f, "f32"),
            Compression::Fp16 => write!(f, "fp16"),
            Compression::Bf16 => write!(f, "bf16"),
            Compression::Int8 { block_size } => write!(f, "int8 (blocks of {block_size})"),
        }
    }
}

/// The settings of DiLoCo. The defaults are the paper's: `H` = 50 inner steps, outer SGD with
/// learning rate 0.7 and Nesterov momentum 0.9, f32 pseudo-gradients, one fragment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiLoCoConfig {
    /// `H`: inner steps between two syncs of a fragment (at least 1).
    pub inner_steps: usize,
    /// Learning rate of the outer SGD (positive). 1 without momentum replaces `θ_start` with the
    /// islands' average.
    pub outer_lr: f64,
    /// Momentum of the outer SGD, in `[0, 1)`.
    pub outer_momentum: f64,
    /// Nesterov momentum (the update is `Δ + μ·m` instead of `m`).
    pub nesterov: bool,
    /// How pseudo-gradients travel.
    pub compression: Compression,
    /// Streaming DiLoCo: fragments synced at staggered steps (1: the whole model at once); at
    /// most `inner_steps` and at most the number of trainable parameters.
    pub fragments: usize,
}

impl Default for DiLoCoConfig {
    fn default() -> Self {
        Self {
            inner_steps: 50,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            nesterov: true,
            compression: Compression::F32,
            fragments: 1,
        }
    }
}

impl DiLoCoConfig {
    /// Checks the settings (the parameter count is checked by [`DiLoCo::new`]).
    ///
    /// # Errors
    /// The [`DiLoCoError`] naming the first setting that makes no sense.
    pub fn validate(&self) -> Result<(), DiLoCoError> {
        if self.inner_steps == 0 {
            return Err(DiLoCoError::ZeroInnerSteps);
        }
        if !(self.outer_lr.is_finite() && self.outer_lr > 0.0) {
            return Err(DiLoCoError::OuterLr(self.outer_lr));
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            return Err(DiLoCoError::OuterMomentum(self.outer_momentum));
        }
        if let Compression::Int8 { block_size: 0 } = self.compression {
            return Err(DiLoCoError::ZeroBlockSize);
        }
        if self.fragments == 0 {
            return Err(DiLoCoError::ZeroFragments);
        }
        if self.fragments > self.inner_steps {
            return Err(DiLoCoError::FragmentsExceedInnerSteps {
                fragments: self.fragments,
                inner_steps: self.inner_steps,
            });
        }
        Ok(())
    }
}

/// What can go wrong with DiLoCo.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DiLoCoError {
    /// `H` = 0.
    #[error(
        "DiLoCo needs at least 1 inner step between syncs (--inner-steps / inner_steps = 0); \
         50 to 500 is usual"
    )]
    ZeroInnerSteps,
    /// The outer learning rate is not a positive finite number.
    #[error("the outer learning rate must be a positive finite number, got {0}; 0.7 is usual")]
    OuterLr(f64),
    /// The outer momentum is outside `[0, 1)`.
    #[error("the outer momentum must lie in [0, 1), got {0}; 0.9 is usual, 0 for plain SGD")]
    OuterMomentum(f64),
    /// Int8 compression with blocks of 0 elements.
    #[error("int8 compression needs a block size of at least 1 element; 256 is usual")]
    ZeroBlockSize,
    /// No fragment.
    #[error("DiLoCo needs at least 1 fragment (1: the whole model synced at once)")]
    ZeroFragments,
    /// More fragments than inner steps: two fragments would share a sync step.
    #[error(
        "{fragments} fragments cannot be staggered over {inner_steps} inner steps; use at most \
         {inner_steps} fragments or more inner steps"
    )]
    FragmentsExceedInnerSteps {
        /// Requested fragments.
        fragments: usize,
        /// `H`.
        inner_steps: usize,
    },
    /// More fragments than trainable parameters: some fragment would be empty.
    #[error(
        "{fragments} fragments for a model with {params} trainable parameters: a fragment \
         holds whole parameters, use at most {params} fragments"
    )]
    TooManyFragments {
        /// Requested fragments.
        fragments: usize,
        /// Trainable parameters of the model.
        params: usize,
    },
    /// The world cannot be cut into that many islands.
    #[error(
        "{world} ranks cannot form {islands} islands of equal size; use a number of islands \
         that divides the number of ranks"
    )]
    IslandLayout {
        /// Ranks in the world.
        world: usize,
        /// Requested islands.
        islands: usize,
    },
    /// The model passed to a sync is not the one DiLoCo was created for.
    #[error(
        "the model has changed since DiLoCo::new: {0}; pass the same model (the inner \
         optimizer may change values, not parameters)"
    )]
    ModelChanged(String),
    /// An island stopped (a rank of it failed, exited or timed out) during a sync.
    #[error(
        "island {island} was lost during the DiLoCo sync (rank {peer} failed); DiLoCo cannot \
         drop an island and go on, restart the job: {source}"
    )]
    IslandLost {
        /// Global rank of the caller.
        rank: usize,
        /// The island of the failed rank.
        island: usize,
        /// The failed global rank.
        peer: usize,
        /// What the collective reported.
        source: CollectiveError,
    },
    /// Another collective failure.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// The world cut into `count` islands of consecutive ranks: island `i` holds the global ranks
/// `i·size .. (i+1)·size`.
#[derive(Debug, Clone)]
pub struct Islands {
    island: ProcessGroup,
    outer: ProcessGroup,
    count: usize,
    size: usize,
}

impl Islands {
    /// Cuts `world` into `count` islands (every rank calls it).
    ///
    /// # Arguments
    /// * `world` - the group of all ranks.
    /// * `count` - the number of islands; must divide the world size.
    ///
    /// # Returns
    /// This rank's island (the group its inner data parallelism runs on) and its outer group.
    ///
    /// # Errors
    /// [`DiLoCoError::IslandLayout`] when `count` does not divide the ranks.
    pub fn new(world: &ProcessGroup, count: usize) -> Result<Self, DiLoCoError> {
        let n = world.size();
        if count == 0 || !n.is_multiple_of(count) {
            return Err(DiLoCoError::IslandLayout {
                world: n,
                islands: count,
            });
        }
        let size = n / count;
        let (index, position) = (world.rank() / size, world.rank() % size);
        let island_ranks: Vec<usize> = (index * size..(index + 1) * size).collect();
        let outer_ranks: Vec<usize> = (0..count).map(|i| i * size + position).collect();
        Ok(Self {
            island: world.split(&island_ranks)?,
            outer: world.split(&outer_ranks)?,
            count,
            size,
        })
    }

    /// The ranks of this rank's island (inner data parallelism).
    pub fn island(&self) -> &ProcessGroup {
        &self.island
    }

    /// The ranks with this rank's position in every island (the pseudo-gradient average).
    pub fn outer(&self) -> &ProcessGroup {
        &self.outer
    }

    /// This rank's island.
    pub fn index(&self) -> usize {
        self.outer.rank()
    }

    /// Number of islands.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Ranks per island.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The island of a global rank.
    pub fn island_of(&self, global_rank: usize) -> usize {
        global_rank / self.size
    }

    /// Gives every rank island 0's first rank's parameters (identical starting points). Seeded
    /// initialisation gives them already; this makes sure.
    ///
    /// # Errors
    /// When a broadcast fails.
    pub fn broadcast_module<M: Module>(&self, module: M) -> Result<M, DiLoCoError> {
        let module =
            DistributedDataParallel::new(self.outer.clone()).broadcast_module(module, 0)?;
        Ok(DistributedDataParallel::new(self.island.clone()).broadcast_module(module, 0)?)
    }
}

/// One trainable parameter followed by DiLoCo.
#[derive(Debug, Clone)]
struct Tracked {
    id: ParamId,
    shape: Vec<usize>,
    /// `θ_start`: the outer model's value (host, f32).
    anchor: Vec<f32>,
    /// The outer optimizer's momentum.
    momentum: Vec<f32>,
}

/// One sync of one fragment, as recorded by [`DiLoCo::history`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncEvent {
    /// The inner step after which it ran (`None`: [`DiLoCo::finish`]).
    pub step: Option<usize>,
    /// The fragment.
    pub fragment: usize,
    /// Elements of the fragment.
    pub elements: usize,
}

/// The DiLoCo outer loop of one rank: call [`DiLoCo::sync`] after every inner optimizer step.
#[derive(Debug)]
pub struct DiLoCo {
    islands: Islands,
    config: DiLoCoConfig,
    params: Vec<Tracked>,
    /// Indices into `params` of each fragment.
    fragments: Vec<Vec<usize>>,
    /// The last inner step passed to `sync`, and whether each fragment was synced right then.
    last_step: Option<usize>,
    fresh: Vec<bool>,
    history: Vec<SyncEvent>,
}

impl DiLoCo {
    /// Starts DiLoCo from `model` (its current values become `θ_start`).
    ///
    /// # Arguments
    /// * `islands` - this rank's island and outer group ([`Islands::new`]).
    /// * `config` - the settings.
    /// * `model` - the model as every island starts it (identical on every rank).
    ///
    /// # Errors
    /// [`DiLoCoError`] for settings that make no sense (see [`DiLoCoConfig::validate`]) and for
    /// more fragments than trainable parameters.
    pub fn new<M: Module>(
        islands: &Islands,
        config: DiLoCoConfig,
        model: &M,
    ) -> Result<Self, DiLoCoError> {
        config.validate()?;
        let mut lister = Lister(Vec::new());
        model.visit(&mut lister);
        let params: Vec<Tracked> = lister
            .0
            .into_iter()
            .map(|(id, shape, values)| Tracked {
                id,
                shape,
                momentum: vec![0.0; values.len()],
                anchor: values,
            })
            .collect();
        if config.fragments > params.len() {
            return Err(DiLoCoError::TooManyFragments {
                fragments: config.fragments,
                params: params.len(),
            });
        }
        let fragments = split_fragments(
            &params.iter().map(|p| p.anchor.len()).collect::<Vec<_>>(),
            config.fragments,
        );
        Ok(Self {
            islands: islands.clone(),
            config,
            params,
            fresh: vec![true; fragments.len()],
            fragments,
            last_step: None,
            history: Vec::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &DiLoCoConfig {
        &self.config
    }

    /// The fragments' sizes in elements, in fragment order.
    pub fn fragment_elements(&self) -> Vec<usize> {
        self.fragments
            .iter()
            .map(|f| f.iter().map(|&i| self.params[i].anchor.len()).sum())
            .collect()
    }

    /// The fragments synced after inner step `step` (0-based): fragment `f` when
    /// `(step + 1) % H == f·H/F (mod H)`.
    pub fn fragments_due(&self, step: usize) -> Vec<usize> {
        let (h, n) = (self.config.inner_steps, self.config.fragments);
        (0..n)
            .filter(|f| (step + 1) % h == (f * h / n) % h)
            .collect()
    }

    /// Whether [`DiLoCo::sync`] communicates after inner step `step`.
    pub fn should_sync(&self, step: usize) -> bool {
        !self.fragments_due(step).is_empty()
    }

    /// Every sync so far, in order.
    pub fn history(&self) -> &[SyncEvent] {
        &self.history
    }

    /// Call after inner step `step` (0-based, every step, in order): syncs the fragments due
    /// then ([`DiLoCo::fragments_due`]) and returns the model with their new values; returns
    /// it unchanged when none is due.
    ///
    /// # Errors
    /// [`DiLoCoError::IslandLost`] when a rank of another island failed;
    /// [`DiLoCoError::ModelChanged`] when `model` is not the model DiLoCo started from;
    /// [`DiLoCoError::Collective`] for other collective failures.
    pub fn sync<M: Module>(&mut self, step: usize, model: M) -> Result<M, DiLoCoError> {
        let due = self.fragments_due(step);
        self.last_step = Some(step);
        self.fresh.iter_mut().for_each(|f| *f = false);
        self.sync_fragments(Some(step), &due, model)
    }

    /// Ends training: syncs every fragment not synced after the last inner step, so that every
    /// rank holds the same (outer) model. A no-op when the last step synced everything.
    ///
    /// # Errors
    /// As [`DiLoCo::sync`].
    pub fn finish<M: Module>(&mut self, model: M) -> Result<M, DiLoCoError> {
        let stale: Vec<usize> = (0..self.fragments.len())
            .filter(|&f| !self.fresh[f])
            .collect();
        self.sync_fragments(None, &stale, model)
    }

    fn sync_fragments<M: Module>(
        &mut self,
        step: Option<usize>,
        due: &[usize],
        mut model: M,
    ) -> Result<M, DiLoCoError> {
        for &f in due {
            model = self.sync_fragment(f, model)?;
            self.fresh[f] = true;
            self.history.push(SyncEvent {
                step,
                fragment: f,
                elements: self.fragment_elements()[f],
            });
        }
        Ok(model)
    }

    /// One outer step of fragment `f`.
    fn sync_fragment<M: Module>(&mut self, f: usize, model: M) -> Result<M, DiLoCoError> {
        let members = &self.fragments[f];
        let mut reader = Reader {
            wanted: members.iter().map(|&i| self.params[i].id).collect(),
            values: HashMap::new(),
        };
        model.visit(&mut reader);
        // The pseudo-gradient Δ = θ_start − θ_end of the fragment, flat.
        let mut delta =
            Vec::with_capacity(members.iter().map(|&i| self.params[i].anchor.len()).sum());
        for &i in members {
            let p = &self.params[i];
            let current = reader.values.remove(&p.id).ok_or_else(|| {
                DiLoCoError::ModelChanged(format!("parameter {:?} is missing", p.id))
            })?;
            if current.len() != p.anchor.len() {
                return Err(DiLoCoError::ModelChanged(format!(
                    "parameter {:?} has {} elements, DiLoCo started with {}",
                    p.id,
                    current.len(),
                    p.anchor.len()
                )));
            }
            delta.extend(p.anchor.iter().zip(&current).map(|(a, c)| a - c));
        }
        let avg = self.average(delta).map_err(|e| self.lost(e))?;
        // Outer SGD (PyTorch's convention): m ← μ·m + Δ; step = Δ + μ·m (Nesterov) or m.
        let (lr, mu) = (
            self.config.outer_lr as f32,
            self.config.outer_momentum as f32,
        );
        let nesterov = self.config.nesterov;
        let mut at = 0;
        let mut new_values = HashMap::with_capacity(members.len());
        for &i in members {
            let p = &mut self.params[i];
            let g = &avg[at..at + p.anchor.len()];
            at += p.anchor.len();
            for ((a, m), &g) in p.anchor.iter_mut().zip(p.momentum.iter_mut()).zip(g) {
                let update = if mu == 0.0 {
                    g
                } else {
                    *m = mu * *m + g;
                    if nesterov { g + mu * *m } else { *m }
                };
                *a -= lr * update;
            }
            new_values.insert(p.id, (p.shape.clone(), p.anchor.clone()));
        }
        Ok(model.map(&mut Writer { values: new_values }))
    }

    /// The average of `delta` over the islands, accumulated in f32.
    fn average(&self, delta: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
        let outer = &self.islands.outer;
        if outer.size() == 1 {
            return Ok(delta);
        }
        let n = delta.len();
        match self.config.compression {
            Compression::F32 => {
                let data = outer.all_reduce_data(TensorData::new(delta, [n]), ReduceOp::Avg)?;
                Ok(data.try_to_vec::<f32>().expect("f32 in, f32 out"))
            }
            compression => {
                let pieces = outer.all_gather_bytes(compression.encode(&delta))?;
                let mut sum = vec![0.0f32; n];
                for (island, piece) in pieces.iter().enumerate() {
                    compression.decode_add(piece, &mut sum).map_err(|reason| {
                        CollectiveError::InvalidArgument {
                            rank: outer.global_rank(),
                            op: format!("DiLoCo sync: pseudo-gradient of island {island}"),
                            reason,
                        }
                    })?;
                }
                let scale = 1.0 / outer.size() as f32;
                sum.iter_mut().for_each(|v| *v *= scale);
                Ok(sum)
            }
        }
    }

    /// A collective error of a sync, naming the lost island when a peer is gone.
    fn lost(&self, e: CollectiveError) -> DiLoCoError {
        let peer = match &e {
            CollectiveError::PeerFailed { peer, .. }
            | CollectiveError::Timeout { peer, .. }
            | CollectiveError::Transport { peer, .. } => Some(*peer),
            _ => None,
        };
        let rank = self.islands.outer.global_rank();
        match peer {
            Some(peer) if peer != rank => DiLoCoError::IslandLost {
                rank,
                island: self.islands.island_of(peer),
                peer,
                source: e,
            },
            _ => DiLoCoError::Collective(e),
        }
    }
}

/// Cuts parameters (by element count, in order) into `n` consecutive fragments of about the same
/// size, none empty (`n` <= number of parameters).
fn split_fragments(sizes: &[usize], n: usize) -> Vec<Vec<usize>> {
    let total: usize = sizes.iter().sum();
    let mut fragments: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut seen = 0usize;
    let mut f = 0;
    for (i, &size) in sizes.iter().enumerate() {
        // Move on when this fragment reached its share, or when the parameters left are just
        // enough to give each remaining fragment one.
        let remaining_params = sizes.len() - i;
        let remaining_fragments = n - f;
        if !fragments[f].is_empty()
            && f + 1 < n
            && (seen * n >= (f + 1) * total || remaining_params < remaining_fragments)
        {
            f += 1;
        }
        fragments[f].push(i);
        seen += size;
    }
    fragments
}

/// Trainable parameters, once each, in module order: id, shape, f32 values.
struct Lister(Vec<(ParamId, Vec<usize>, Vec<f32>)>);

impl ModuleVisitor for Lister {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_frozen(param) || self.0.iter().any(|(id, _, _)| *id == param.id) {
            return;
        }
        let value = param.val();
        let shape = value.dims().to_vec();
        let values = value
            .try_into_vec_as::<f32>()
            .expect("a float parameter reads as f32");
        self.0.push((param.id, shape, values));
    }
}

/// The f32 values of the parameters in `wanted`.
struct Reader {
    wanted: Vec<ParamId>,
    values: HashMap<ParamId, Vec<f32>>,
}

impl ModuleVisitor for Reader {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.wanted.contains(&param.id) && !self.values.contains_key(&param.id) {
            let values = param
                .val()
                .try_into_vec_as::<f32>()
                .expect("a float parameter reads as f32");
            self.values.insert(param.id, values);
        }
    }
}

/// Replaces the values of the parameters in `values` (dtype, device and `require_grad` kept).
struct Writer {
    values: HashMap<ParamId, (Vec<usize>, Vec<f32>)>,
}

impl ModuleMapper for Writer {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some((shape, values)) = self.values.get(&param.id).cloned() else {
            return param;
        };
        param.map(|tensor| {
            let device = tensor.device();
            let require_grad = tensor.is_require_grad();
            let data = TensorData::new(values, shape).convert_dtype(tensor.dtype());
            let t = tensor_from_data::<D>(data, &device);
            if require_grad { t.require_grad() } else { t }
        })
    }
}

/// Bytes sent by one rank, counted by the transport wrapper of [`count_sent_bytes`]. Cheap to
/// clone (shared).
#[derive(Debug, Clone, Default)]
pub struct ByteCounter(Arc<AtomicU64>);

impl ByteCounter {
    /// Payload bytes of every frame this rank sent so far (headers not included).
    pub fn sent(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A transport that counts the payload bytes this rank sends. It offers no shared-memory
/// board, so ranks in one process run the same ring algorithms over frames as ranks in other
/// processes, and every byte a network would carry is counted.
struct CountingTransport {
    inner: Arc<dyn Transport>,
    sent: ByteCounter,
}

impl Transport for CountingTransport {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
    fn send(&self, dst: usize, frame: Frame) -> crate::Result<()> {
        self.sent
            .0
            .fetch_add(frame.payload.len() as u64, Ordering::Relaxed);
        self.inner.send(dst, frame)
    }
    fn mailbox(&self) -> &Mailbox {
        self.inner.mailbox()
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// The world group over a transport that counts the bytes this rank sends (every collective of
/// the returned group and of its sub-groups). Call it on every rank, before any other collective
/// of `world`, and use the returned group instead of `world` from then on.
///
/// # Arguments
/// * `world` - the group of all ranks (not a sub-group).
///
/// # Returns
/// The counting world group (same ranks, same timeout) and its counter.
///
/// # Errors
/// [`CollectiveError::InvalidArgument`] when `world` is a sub-group.
///
/// # Example
/// ```
/// use burn_parallel::{ReduceOp, run_local};
/// use burn_parallel::diloco::count_sent_bytes;
///
/// let sent = run_local(2, |world| {
///     let (world, counter) = count_sent_bytes(&world)?;
///     world.all_reduce_f32(vec![1.0; 1000], ReduceOp::Sum)?;
///     Ok(counter.sent())
/// })
/// .unwrap();
/// assert_eq!(sent, vec![4000, 4000]); // a ring all-reduce sends 2(n-1)/n of the data
/// ```
pub fn count_sent_bytes(world: &ProcessGroup) -> crate::Result<(ProcessGroup, ByteCounter)> {
    let transport = world.transport().clone();
    if world.size() != transport.world_size()
        || world.members().iter().enumerate().any(|(i, &m)| i != m)
    {
        return Err(CollectiveError::InvalidArgument {
            rank: world.global_rank(),
            op: "count_sent_bytes".into(),
            reason: "pass the world group, not a sub-group".into(),
        });
    }
    let counter = ByteCounter::default();
    let counting = Arc::new(CountingTransport {
        inner: transport,
        sent: counter.clone(),
    });
    let group = ProcessGroup::world(counting).with_timeout(world.timeout());
    Ok((group, counter))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_round_trips_within_its_precision() {
        let values: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin() * 0.1).collect();
        for (c, tol) in [
            (Compression::F32, 0.0),
            (Compression::Fp16, 1e-4),
            (Compression::Bf16, 1e-3),
            (Compression::Int8 { block_size: 64 }, 0.1 / 127.0),
        ] {
            let bytes = c.encode(&values);
            assert_eq!(bytes.len(), c.encoded_len(values.len()), "{c}");
            let mut back = vec![0.0; values.len()];
            c.decode_add(&bytes, &mut back).unwrap();
            let worst = values
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst <= tol, "{c}: worst error {worst} > {tol}");
            assert!(c.decode_add(&bytes[1..], &mut back).is_err(), "{c}: short");
        }
    }

    #[test]
    fn int8_blocks_have_their_own_scale() {
        // A tiny block next to a large one keeps its precision.
        let mut values = vec![1e-4f32; 8];
        values.extend([100.0f32; 8]);
        let c = Compression::Int8 { block_size: 8 };
        let mut back = vec![0.0; 16];
        c.decode_add(&c.encode(&values), &mut back).unwrap();
        assert!((back[0] - 1e-4).abs() < 1e-6, "{back:?}");
        assert_eq!(back[15], 100.0);
    }

    #[test]
    fn fragments_are_balanced_and_never_empty() {
        assert_eq!(
            split_fragments(&[10, 10, 10, 10], 2),
            vec![vec![0, 1], vec![2, 3]]
        );
        assert_eq!(
            split_fragments(&[100, 1, 1], 3),
            vec![vec![0], vec![1], vec![2]]
        );
        assert_eq!(split_fragments(&[1, 1, 100], 2), vec![vec![0, 1], vec![2]]);
        let f = split_fragments(&[5; 7], 7);
        assert!(f.iter().all(|f| f.len() == 1));
    }
}
