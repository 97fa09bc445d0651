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
//!   every `H` steps, but the traffic is spread over the `H` steps instead of one burst.
//! - *overlap* (`overlap_steps` = `τ` > 0, Streaming DiLoCo, Douillard et al. 2025): the
//!   calling thread only takes handles of a fragment's parameters after inner step `s` (tensors
//!   are values: later steps make new ones) and hands them to a background thread, which reads
//!   them to the host, forms the pseudo-gradient and runs the outer exchange while the inner
//!   steps go on;
//!   after inner step `s + τ` the outer step is taken on `θ_start` and the fragment becomes
//!   `α · θ_local + (1 − α) · θ_start` (the paper's merge with mixing factor `α`,
//!   `overlap_mix`, 0.5 by default; `α` = 0 replaces the `τ` local steps' progress with the
//!   outer model). Exchanges run one after the other in the order they were sent, the same on
//!   every rank; `τ` < `H`, so a fragment's update lands before its next send.
//!   [`DiLoCo::finish`] applies the exchanges in flight and then syncs every fragment at once, so
//!   that every island ends with the same outer model. `τ` = 0 is the synchronous sync above.
//! - *dropped islands* (`drop_lost_islands`): an island that disappears is dropped from the
//!   average and training goes on; see below.
//!
//! Every rank of an island takes part in the outer sync with the ranks at its position in the
//! other islands, and syncs the whole fragment: the islands' replicas are identical, so each
//! outer group computes the same average and no broadcast inside the island is needed, but the
//! links between islands carry `ranks per island` copies of it. A hierarchical sync (each
//! position averaging `1 / ranks per island` of the fragment, then an all-gather inside the
//! island) would divide that traffic by the island size; it is not done here (with
//! `drop_lost_islands` only the island's first rank exchanges, see below).
//!
//! # Lost islands
//!
//! By default a lost island is a typed error, [`DiLoCoError::IslandLost`], naming it, never a
//! hang (collectives have timeouts): the transports mark the whole world failed when one rank
//! fails, so every pending and later call ends.
//!
//! With `drop_lost_islands`, [`DiLoCo::new`] first tells this rank's mailbox that failures of
//! the *other* islands' ranks are theirs alone
//! ([`crate::comm::transport::Mailbox::isolate_failures_of`]): waits on such a rank end, the
//! rest of the world goes on (a failure inside this rank's own island still fails it). The
//! outer exchange is then made of point-to-point messages on the outer group, in two rounds:
//! 1. *data*: each live island sends its (encoded) pseudo-gradient to every other and waits for
//!    theirs until a deadline (the outer group's timeout); an island that failed, exited or
//!    said nothing in time is not heard from;
//! 2. *agreement*: each sends the set of islands it heard from, with a digest of its `θ_start`,
//!    to every island of the round (the ones it did not hear from learn that they are out), and
//!    waits for the sets of the islands it heard from.
//!
//! The islands averaged are those in every set received: the average is re-normalised over
//! them and summed in island order, so every survivor gets the same bits; the others are
//! dropped for good (a [`SyncEvent::dropped`] entry and a line on stderr). This agrees on every
//! survivor when at most one island fails during one exchange (an island that fails after
//! sending its pseudo-gradient to everyone is still averaged that once; one that reached only
//! some is left out by all). Several islands failing during the same exchange can, with bad
//! timing, leave survivors with different sets: the digest of the next round then says so,
//! [`DiLoCoError::Diverged`], instead of training on silently. An island that finds itself
//! left out (too late) gets [`DiLoCoError::Excluded`]; one left alone,
//! [`DiLoCoError::AllIslandsLost`]. With islands of several ranks, the island's first rank
//! runs the exchange and hands the outcome to the others (a broadcast inside the island), so
//! all ranks of an island drop the same islands. Every collective outside DiLoCo that spans
//! several islands (a world-wide loss average, say) must be avoided once islands may vanish.
//! The point-to-point exchange sends `islands − 1` copies of the pseudo-gradient per rank (the
//! ring all-reduce of the default path, about 2).
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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use crate::comm::host::ReduceOp;
use crate::comm::transport::{Frame, Mailbox, Transport};
use crate::ddp::{DistributedDataParallel, is_frozen};
use crate::error::CollectiveError;
use crate::group::{ProcessGroup, tensor_from_data};

/// How pseudo-gradients travel between islands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Drop an island that disappears (its rank failed, exited or timed out) from the average
    /// and go on with the others, instead of failing with [`DiLoCoError::IslandLost`]. The
    /// outer exchange is then made of point-to-point messages with a deadline (the outer
    /// group's timeout) and an agreement round; see the module documentation.
    pub drop_lost_islands: bool,
    /// Streaming DiLoCo's overlap `τ`: a fragment's outer exchange sent after inner step `s`
    /// runs on a background thread while the inner steps go on, and its update is applied
    /// after inner step `s + τ` (merged with [`DiLoCoConfig::overlap_mix`]). 0: the exchange
    /// runs on the calling thread and is applied at once. Less than `inner_steps`.
    pub overlap_steps: usize,
    /// The mixing factor `α` of the delayed merge (`overlap_steps` > 0): the fragment becomes
    /// `α · local + (1 − α) · outer` (Streaming DiLoCo's rule; 0.5 there). In `[0, 1)`.
    pub overlap_mix: f64,
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
            drop_lost_islands: false,
            overlap_steps: 0,
            overlap_mix: 0.5,
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
        if self.overlap_steps >= self.inner_steps {
            return Err(DiLoCoError::OverlapTooLong {
                overlap_steps: self.overlap_steps,
                inner_steps: self.inner_steps,
            });
        }
        if !(0.0..1.0).contains(&self.overlap_mix) {
            return Err(DiLoCoError::OverlapMix(self.overlap_mix));
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
    /// The overlap reaches the fragment's next sync.
    #[error(
        "an overlap of {overlap_steps} steps reaches the next sync of the fragment \
         ({inner_steps} inner steps later): use --diloco-overlap / overlap_steps below \
         {inner_steps}"
    )]
    OverlapTooLong {
        /// Requested overlap `τ`.
        overlap_steps: usize,
        /// `H`.
        inner_steps: usize,
    },
    /// The mixing factor of the delayed merge is outside `[0, 1)`.
    #[error(
        "the overlap mixing factor must lie in [0, 1) (the share of the local values kept when \
         the outer update lands), got {0}; 0.5 is usual"
    )]
    OverlapMix(f64),
    /// Every other island was dropped: there is nothing left to average with.
    #[error(
        "island {island}: every other island is gone (dropped: {dropped:?}); DiLoCo cannot go \
         on alone, restart the job with the islands that are left"
    )]
    AllIslandsLost {
        /// This rank's island.
        island: usize,
        /// The islands dropped, in order.
        dropped: Vec<usize>,
    },
    /// The other islands dropped this one (it was too late, or they lost its messages).
    #[error(
        "island {island} was dropped by the other islands at an outer sync (its messages did \
         not reach them within the timeout); it cannot rejoin, stop it or raise the timeout \
         (BURN_PARALLEL_TIMEOUT_SECS)"
    )]
    Excluded {
        /// This rank's island.
        island: usize,
    },
    /// Two surviving islands hold different outer models (several islands failed during one
    /// sync and the survivors saw them fail differently).
    #[error(
        "island {island} and island {other} hold different outer models of fragment \
         {fragment}: several islands failed during one sync and the survivors disagree on \
         which; restart from a checkpoint"
    )]
    Diverged {
        /// This rank's island.
        island: usize,
        /// The island that disagrees.
        other: usize,
        /// The fragment compared.
        fragment: usize,
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
    /// A saved state cannot be restored into this DiLoCo ([`DiLoCo::restore`]), or no state
    /// can be taken now ([`DiLoCo::state`]).
    #[error("DiLoCo state: {0}")]
    State(String),
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
    anchor: Arc<Vec<f32>>,
    /// The outer optimizer's momentum.
    momentum: Vec<f32>,
}

/// One sync of one fragment, as recorded by [`DiLoCo::history`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SyncEvent {
    /// The inner step after which its pseudo-gradient was sent (`None`: [`DiLoCo::finish`]).
    pub step: Option<usize>,
    /// The inner step after which its update was applied: `step` without overlap, `step + τ`
    /// with ([`DiLoCoConfig::overlap_steps`]); `None` in [`DiLoCo::finish`].
    pub applied: Option<usize>,
    /// The fragment.
    pub fragment: usize,
    /// Elements of the fragment.
    pub elements: usize,
    /// Islands averaged (the survivors).
    pub islands: usize,
    /// Islands dropped at this sync ([`DiLoCoConfig::drop_lost_islands`]), in order.
    pub dropped: Vec<usize>,
}

/// The DiLoCo outer loop of one rank: call [`DiLoCo::sync`] after every inner optimizer step.
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
    /// Where outer exchanges run: here, or on the background thread of the overlap.
    runner: Runner,
    /// Exchanges in flight (overlap), in the order they were sent.
    pending: VecDeque<Pending>,
    /// Outcomes of the oldest exchanges in flight, already received ([`DiLoCo::state`] waits
    /// for them; [`DiLoCo::restore`] brings them back): taken before the runner's.
    received: VecDeque<Outcome>,
}

/// DiLoCo's own state, for a checkpoint ([`DiLoCo::state`], [`DiLoCo::restore`]): the outer
/// model `θ_start`, the outer momentum and the averaged pseudo-gradients of the exchanges in
/// flight, as host tensors by parameter id (to be saved under the parameters' names), and the
/// rest ([`DiLoCoMeta`]). It is the same on every rank. The islands' own models and inner
/// optimizers are not in it: save them as a run without DiLoCo would, per island.
#[derive(Debug, Clone)]
pub struct DiLoCoState {
    /// `θ_start` of every trainable parameter, f32 in the parameter's shape.
    pub outer: HashMap<ParamId, TensorData>,
    /// The outer momentum of every trainable parameter (empty without momentum).
    pub momentum: HashMap<ParamId, TensorData>,
    /// The averaged pseudo-gradients of the exchanges sent but not applied yet (overlap), in
    /// the order they were sent: those of their fragment's parameters.
    pub in_flight: Vec<HashMap<ParamId, TensorData>>,
    /// Everything else; serialise it with the trainer's state.
    pub meta: DiLoCoMeta,
}

/// The small part of [`DiLoCoState`]: the settings and islands it was taken under (a restore
/// checks them), the step and sync bookkeeping and the history.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DiLoCoMeta {
    config: DiLoCoConfig,
    islands: usize,
    params: usize,
    last_step: Option<usize>,
    fresh: Vec<bool>,
    /// `(fragment, sent, apply_after, islands averaged)` of each exchange in flight.
    pending: Vec<(usize, usize, usize, usize)>,
    history: Vec<SyncEvent>,
}

impl DiLoCoMeta {
    /// Exchanges in flight ([`DiLoCoState::in_flight`] holds as many pseudo-gradients).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

impl std::fmt::Debug for DiLoCo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiLoCo")
            .field("islands", &self.islands)
            .field("config", &self.config)
            .field("fragments", &self.fragments.len())
            .field("last_step", &self.last_step)
            .field("pending", &self.pending.len())
            .finish()
    }
}

/// A fragment whose exchange is in flight.
#[derive(Debug, Clone, Copy)]
struct Pending {
    fragment: usize,
    sent: usize,
    apply_after: usize,
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
                anchor: Arc::new(values),
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
        let mut island_sync = None;
        if config.drop_lost_islands {
            // A failure of another island's rank must not end this rank's other waits.
            let world = islands.count * islands.size;
            let mine = islands.index();
            let others: Vec<usize> = (0..world)
                .filter(|&r| islands.island_of(r) != mine)
                .collect();
            islands
                .outer
                .transport()
                .mailbox()
                .isolate_failures_of(&others);
            if islands.size > 1 {
                // The island's first rank runs the exchange and hands the outcome to the others
                // (on a group of its own: the inner steps use `island` meanwhile). It waits at
                // most two deadlines (data and agreement rounds): the others wait three.
                let all: Vec<usize> = (0..islands.size).collect();
                let timeout = islands.outer.timeout();
                let group = islands.island.split(&all)?;
                island_sync = Some(group.with_timeout(timeout.saturating_mul(3)));
            }
        }
        let outer = Outer {
            outer: islands.outer.clone(),
            island_sync,
            island_size: islands.size,
            compression: config.compression,
            resilient: config.drop_lost_islands,
            live: (0..islands.count).collect(),
            exchanges: 0,
        };
        let runner = if config.overlap_steps > 0 {
            Runner::spawn(outer)?
        } else {
            Runner::Inline(Box::new(outer))
        };
        Ok(Self {
            islands: islands.clone(),
            config,
            params,
            fresh: vec![true; fragments.len()],
            fragments,
            last_step: None,
            history: Vec::new(),
            runner,
            pending: VecDeque::new(),
            received: VecDeque::new(),
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
    /// `(step + 1) % H == f·H/F (mod H)`. With an overlap `τ`, their pseudo-gradients are sent
    /// then and their updates applied after step `step + τ`.
    pub fn fragments_due(&self, step: usize) -> Vec<usize> {
        let (h, n) = (self.config.inner_steps, self.config.fragments);
        (0..n)
            .filter(|f| (step + 1) % h == (f * h / n) % h)
            .collect()
    }

    /// Whether [`DiLoCo::sync`] sends pseudo-gradients after inner step `step`.
    pub fn should_sync(&self, step: usize) -> bool {
        !self.fragments_due(step).is_empty()
    }

    /// Every sync so far, in the order their updates were applied.
    pub fn history(&self) -> &[SyncEvent] {
        &self.history
    }

    /// The islands still averaged (all of them unless some were dropped; with an overlap, as of
    /// the last update applied).
    pub fn live_islands(&self) -> Vec<usize> {
        let mut live: Vec<usize> = (0..self.islands.count).collect();
        for event in &self.history {
            live.retain(|i| !event.dropped.contains(i));
        }
        live
    }

    /// Call after inner step `step` (0-based, every step, in order): applies the updates due
    /// then (with an overlap), syncs the fragments due then ([`DiLoCo::fragments_due`]) and
    /// returns the model with their new values; returns it unchanged when nothing is due.
    ///
    /// # Errors
    /// [`DiLoCoError::IslandLost`] when a rank of another island failed (without
    /// [`DiLoCoConfig::drop_lost_islands`]); [`DiLoCoError::AllIslandsLost`],
    /// [`DiLoCoError::Excluded`] or [`DiLoCoError::Diverged`] when dropping islands cannot go
    /// on; [`DiLoCoError::ModelChanged`] when `model` is not the model DiLoCo started from;
    /// [`DiLoCoError::Collective`] for other collective failures.
    pub fn sync<M: Module>(&mut self, step: usize, mut model: M) -> Result<M, DiLoCoError> {
        let due = self.fragments_due(step);
        self.last_step = Some(step);
        self.fresh.iter_mut().for_each(|f| *f = false);
        while let Some(p) = self.pending.front().copied() {
            if p.apply_after > step {
                break;
            }
            self.pending.pop_front();
            let outcome = self.next_outcome()?;
            let mix = Some(self.config.overlap_mix as f32);
            model = self.apply(p.fragment, outcome, mix, model, Some(p.sent), Some(step))?;
        }
        for f in due {
            let job = self.job(f, &model)?;
            if self.config.overlap_steps > 0 {
                self.runner.submit(job)?;
                self.pending.push_back(Pending {
                    fragment: f,
                    sent: step,
                    apply_after: step + self.config.overlap_steps,
                });
            } else {
                let outcome = self.runner.run(job)?;
                model = self.apply(f, outcome, None, model, Some(step), Some(step))?;
                self.fresh[f] = true;
            }
        }
        Ok(model)
    }

    /// Ends training so that every rank holds the same (outer) model: without an overlap,
    /// syncs every fragment not synced after the last inner step (a no-op when the last step
    /// synced everything); with one, applies the exchanges in flight, then syncs every
    /// fragment at once.
    ///
    /// # Errors
    /// As [`DiLoCo::sync`].
    pub fn finish<M: Module>(&mut self, mut model: M) -> Result<M, DiLoCoError> {
        while let Some(p) = self.pending.pop_front() {
            let outcome = self.next_outcome()?;
            let mix = Some(self.config.overlap_mix as f32);
            model = self.apply(
                p.fragment,
                outcome,
                mix,
                model,
                Some(p.sent),
                self.last_step,
            )?;
        }
        let overlap = self.config.overlap_steps > 0;
        let stale: Vec<usize> = (0..self.fragments.len())
            .filter(|&f| overlap || !self.fresh[f])
            .collect();
        for f in stale {
            let job = self.job(f, &model)?;
            let outcome = self.runner.run(job)?;
            model = self.apply(f, outcome, None, model, None, None)?;
            self.fresh[f] = true;
        }
        Ok(model)
    }

    /// The outcome of the oldest exchange in flight.
    fn next_outcome(&mut self) -> Result<Outcome, DiLoCoError> {
        match self.received.pop_front() {
            Some(outcome) => Ok(outcome),
            None => self.runner.result(),
        }
    }

    /// The state to checkpoint, after the sync of some inner step: waits for the outcomes of
    /// the exchanges in flight (the islands' updates still land at their step), then copies
    /// `θ_start`, the momentum and those outcomes to the state. With the islands' models and
    /// inner optimizers, a run restored from it ([`DiLoCo::restore`]) goes on bit for bit as
    /// the run that saved it.
    ///
    /// # Errors
    /// [`DiLoCoError::State`] once an island was dropped (a restart would start with every
    /// island again: restart from a checkpoint taken before); the errors of the exchanges in
    /// flight.
    ///
    /// # Example
    /// ```
    /// use burn::nn::{Initializer, LinearConfig};
    /// use burn::tensor::Device;
    /// use burn_parallel::diloco::{DiLoCo, DiLoCoConfig, Islands};
    /// use burn_parallel::run_local;
    ///
    /// run_local(2, |world| {
    ///     let model = LinearConfig::new(3, 2)
    ///         .with_initializer(Initializer::Constant { value: 0.5 })
    ///         .init(&Device::flex());
    ///     let islands = Islands::new(&world, 2).unwrap();
    ///     let config = DiLoCoConfig { inner_steps: 2, ..DiLoCoConfig::default() };
    ///     let mut diloco = DiLoCo::new(&islands, config, &model).unwrap();
    ///     let model = diloco.sync(0, model).unwrap(); // nothing due after step 0
    ///     let state = diloco.state().unwrap();
    ///     assert_eq!(state.outer.len(), 2); // the weight and the bias
    ///     // A restarted run: a fresh DiLoCo with the saved state.
    ///     let mut restarted = DiLoCo::new(&islands, config, &model).unwrap();
    ///     restarted.restore(state.clone()).unwrap();
    ///     assert_eq!(restarted.state().unwrap().meta, state.meta);
    ///     // Another number of islands is refused.
    ///     let one = Islands::new(&world, 1).unwrap();
    ///     let mut other = DiLoCo::new(&one, config, &model).unwrap();
    ///     assert!(other.restore(state).is_err());
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn state(&mut self) -> Result<DiLoCoState, DiLoCoError> {
        if let Some(event) = self.history.iter().find(|e| !e.dropped.is_empty()) {
            return Err(DiLoCoError::State(format!(
                "island(s) {:?} were dropped at the sync of step {:?}; a restarted job has \
                 every island again, so the state after that is not saved: restart from a \
                 checkpoint taken before",
                event.dropped, event.step
            )));
        }
        while self.received.len() < self.pending.len() {
            let outcome = self.runner.result()?;
            self.received.push_back(outcome);
        }
        let tensor =
            |p: &Tracked, values: &[f32]| TensorData::new(values.to_vec(), p.shape.clone());
        let outer = self
            .params
            .iter()
            .map(|p| (p.id, tensor(p, &p.anchor)))
            .collect();
        let momentum = match self.config.outer_momentum {
            0.0 => HashMap::new(),
            _ => self
                .params
                .iter()
                .map(|p| (p.id, tensor(p, &p.momentum)))
                .collect(),
        };
        let in_flight = self
            .pending
            .iter()
            .zip(&self.received)
            .map(|(p, outcome)| {
                let mut at = 0;
                self.fragments[p.fragment]
                    .iter()
                    .map(|&i| {
                        let param = &self.params[i];
                        let n = param.anchor.len();
                        at += n;
                        (param.id, tensor(param, &outcome.avg[at - n..at]))
                    })
                    .collect()
            })
            .collect();
        let meta = DiLoCoMeta {
            config: self.config,
            islands: self.islands.count,
            params: self.params.len(),
            last_step: self.last_step,
            fresh: self.fresh.clone(),
            pending: self
                .pending
                .iter()
                .zip(&self.received)
                .map(|(p, o)| (p.fragment, p.sent, p.apply_after, o.islands))
                .collect(),
            history: self.history.clone(),
        };
        Ok(DiLoCoState {
            outer,
            momentum,
            in_flight,
            meta,
        })
    }

    /// Restores a state taken by [`DiLoCo::state`] (after the islands' models were loaded: it
    /// does not touch the model); call it before the first [`DiLoCo::sync`], on every rank.
    ///
    /// # Errors
    /// [`DiLoCoError::State`] when the state was taken under other settings, another number of
    /// islands or for another model (parameters missing or of other shapes), or when this
    /// DiLoCo has synced already.
    pub fn restore(&mut self, state: DiLoCoState) -> Result<(), DiLoCoError> {
        let bad = |what: String| Err(DiLoCoError::State(what));
        let meta = state.meta;
        if self.last_step.is_some() || !self.pending.is_empty() {
            return bad("restore before the first sync".into());
        }
        if meta.config != self.config {
            return bad(format!(
                "saved with the settings {:?}, this run has {:?}; resume with the saved ones",
                meta.config, self.config
            ));
        }
        if meta.islands != self.islands.count {
            return bad(format!(
                "saved with {} islands, this run has {}; resume with {} islands (the ranks \
                 per island may change)",
                meta.islands, self.islands.count, meta.islands
            ));
        }
        if meta.params != self.params.len() || meta.fresh.len() != self.fragments.len() {
            return bad(format!(
                "saved for a model of {} trainable parameters, this one has {}",
                meta.params,
                self.params.len()
            ));
        }
        let values = |what: &str, p: &Tracked, map: &HashMap<ParamId, TensorData>| {
            let id = p.id;
            let data = map.get(&id).ok_or_else(|| {
                DiLoCoError::State(format!("{what} of parameter {id:?} is missing"))
            })?;
            if data.shape().as_slice() != p.shape.as_slice() {
                return Err(DiLoCoError::State(format!(
                    "{what} of parameter {id:?} has shape {:?}, the parameter {:?}",
                    data.shape(),
                    p.shape
                )));
            }
            data.clone()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| DiLoCoError::State(format!("{what} of parameter {id:?}: {e:?}")))
        };
        let mut received = VecDeque::new();
        for (&(fragment, _, _, islands), grads) in meta.pending.iter().zip(&state.in_flight) {
            let members = self.fragments.get(fragment).ok_or_else(|| {
                DiLoCoError::State(format!("an exchange of fragment {fragment} is in flight"))
            })?;
            let mut avg = Vec::new();
            for &i in members {
                let p = &self.params[i];
                avg.extend(values("an exchange in flight", p, grads)?);
            }
            received.push_back(Outcome {
                avg,
                islands,
                dropped: Vec::new(),
            });
        }
        if received.len() != meta.pending.len() {
            return bad(format!(
                "{} exchanges in flight, {} pseudo-gradients saved",
                meta.pending.len(),
                received.len()
            ));
        }
        let mut params = self.params.clone();
        for p in &mut params {
            p.anchor = Arc::new(values("the outer model", p, &state.outer)?);
            if self.config.outer_momentum != 0.0 {
                p.momentum = values("the outer momentum", p, &state.momentum)?;
            }
        }
        self.params = params;
        self.received = received;
        self.pending = meta
            .pending
            .iter()
            .map(|&(fragment, sent, apply_after, _)| Pending {
                fragment,
                sent,
                apply_after,
            })
            .collect();
        self.last_step = meta.last_step;
        self.fresh = meta.fresh;
        self.history = meta.history;
        Ok(())
    }

    /// The exchange of fragment `f`: its parameters' current values (tensor handles, read to
    /// the host where the exchange runs: on the background thread with an overlap) and their
    /// `θ_start`.
    fn job<M: Module>(&self, f: usize, model: &M) -> Result<Job, DiLoCoError> {
        let members = &self.fragments[f];
        let mut grabber = Grabber {
            wanted: members.iter().map(|&i| self.params[i].id).collect(),
            values: HashMap::new(),
        };
        model.visit(&mut grabber);
        let mut parts = Vec::with_capacity(members.len());
        for &i in members {
            let p = &self.params[i];
            let current = grabber.values.remove(&p.id).ok_or_else(|| {
                DiLoCoError::ModelChanged(format!("parameter {:?} is missing", p.id))
            })?;
            parts.push((p.id, current, p.anchor.clone()));
        }
        Ok(Job {
            fragment: f,
            parts,
            digest: self.config.drop_lost_islands,
        })
    }

    /// The outer step of fragment `f` from its averaged pseudo-gradient, and the model with the
    /// new values: `θ_start` itself (`mix` = `None`), or `α · local + (1 − α) · θ_start`
    /// (`mix` = `Some(α)`, the delayed merge of the overlap).
    fn apply<M: Module>(
        &mut self,
        f: usize,
        outcome: Outcome,
        mix: Option<f32>,
        model: M,
        step: Option<usize>,
        applied: Option<usize>,
    ) -> Result<M, DiLoCoError> {
        // Outer SGD (PyTorch's convention): m ← μ·m + Δ; step = Δ + μ·m (Nesterov) or m.
        let (lr, mu) = (
            self.config.outer_lr as f32,
            self.config.outer_momentum as f32,
        );
        let nesterov = self.config.nesterov;
        let members = &self.fragments[f];
        let mut at = 0;
        let mut new_values = HashMap::with_capacity(members.len());
        for &i in members {
            let p = &mut self.params[i];
            let n = p.anchor.len();
            let g = &outcome.avg[at..at + n];
            let anchor = Arc::make_mut(&mut p.anchor);
            for ((a, m), &g) in anchor.iter_mut().zip(p.momentum.iter_mut()).zip(g) {
                let update = if mu == 0.0 {
                    g
                } else {
                    *m = mu * *m + g;
                    if nesterov { g + mu * *m } else { *m }
                };
                *a -= lr * update;
            }
            at += n;
            new_values.insert(p.id, (p.shape.clone(), anchor.clone()));
        }
        self.history.push(SyncEvent {
            step,
            applied,
            fragment: f,
            elements: at,
            islands: outcome.islands,
            dropped: outcome.dropped,
        });
        Ok(model.map(&mut Writer {
            values: new_values,
            mix,
        }))
    }
}

/// FNV-1a over the bits of `values`: equal on two ranks when the values are.
fn digest(values: impl Iterator<Item = f32>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// One outer exchange: a fragment's parameters as they are after the inner step of the send
/// (flat tensor handles, not yet read) with their `θ_start`, and whether the digest of the
/// `θ_start` is wanted (the resilient exchange compares them).
struct Job {
    fragment: usize,
    parts: Vec<(ParamId, Tensor<1>, Arc<Vec<f32>>)>,
    digest: bool,
}

impl Job {
    /// The pseudo-gradient `Δ = θ_start − θ_end`, flat, and the digest of `θ_start` (0 when
    /// not wanted): reads the values to the host.
    fn delta(self) -> Result<(Vec<f32>, u64), DiLoCoError> {
        let n = self.parts.iter().map(|(_, _, a)| a.len()).sum();
        let mut delta = Vec::with_capacity(n);
        for (id, tensor, anchor) in &self.parts {
            let current = tensor
                .clone()
                .try_into_vec_as::<f32>()
                .expect("a float parameter reads as f32");
            if current.len() != anchor.len() {
                return Err(DiLoCoError::ModelChanged(format!(
                    "parameter {id:?} has {} elements, DiLoCo started with {}",
                    current.len(),
                    anchor.len()
                )));
            }
            delta.extend(anchor.iter().zip(&current).map(|(a, c)| a - c));
        }
        let digest = if self.digest {
            digest(self.parts.iter().flat_map(|(_, _, a)| a.iter().copied()))
        } else {
            0
        };
        Ok((delta, digest))
    }
}

/// What an exchange gives: the average over the islands averaged, and those dropped.
struct Outcome {
    avg: Vec<f32>,
    islands: usize,
    dropped: Vec<usize>,
}

/// Where exchanges run.
enum Runner {
    /// On the calling thread.
    Inline(Box<Outer>),
    /// On a background thread, one after the other in the order they were submitted (every
    /// rank submits the same exchanges in the same order).
    Worker {
        /// This rank, for errors.
        rank: usize,
        jobs: mpsc::Sender<Job>,
        /// The outcomes, in the order the jobs were submitted.
        results: mpsc::Receiver<Result<Outcome, DiLoCoError>>,
        /// Detached when dropped: the thread ends after the exchange it is running.
        _thread: thread::JoinHandle<()>,
    },
}

impl Runner {
    fn spawn(mut outer: Outer) -> Result<Self, DiLoCoError> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, results) = mpsc::channel();
        let rank = outer.outer.global_rank();
        let thread = thread::Builder::new()
            .name(format!("diloco-{rank}"))
            .spawn(move || {
                for job in inbox {
                    let result = outer.run(job);
                    let failed = result.is_err();
                    if outbox.send(result).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| {
                DiLoCoError::Collective(CollectiveError::InvalidArgument {
                    rank,
                    op: "DiLoCo overlap".into(),
                    reason: format!("cannot start the background thread of the overlap: {e}"),
                })
            })?;
        Ok(Runner::Worker {
            rank,
            jobs,
            results,
            _thread: thread,
        })
    }

    /// Hands `job` to the background thread (runs it now without one: its outcome is then
    /// lost, so [`DiLoCo`] only submits with an overlap).
    fn submit(&mut self, job: Job) -> Result<(), DiLoCoError> {
        match self {
            Runner::Inline(outer) => outer.run(job).map(|_| ()),
            Runner::Worker { rank, jobs, .. } => jobs.send(job).map_err(|_| Self::gone(*rank)),
        }
    }

    /// The outcome of the oldest job submitted (waits for it).
    fn result(&mut self) -> Result<Outcome, DiLoCoError> {
        match self {
            Runner::Inline(outer) => {
                Err(DiLoCoError::Collective(CollectiveError::InvalidArgument {
                    rank: outer.outer.global_rank(),
                    op: "DiLoCo overlap".into(),
                    reason: "no exchange is in flight without an overlap".into(),
                }))
            }
            Runner::Worker { rank, results, .. } => {
                results.recv().map_err(|_| Self::gone(*rank))?
            }
        }
    }

    /// Runs `job` now (after the jobs in flight) and returns its outcome.
    fn run(&mut self, job: Job) -> Result<Outcome, DiLoCoError> {
        match self {
            Runner::Inline(outer) => outer.run(job),
            Runner::Worker { .. } => {
                self.submit(job)?;
                self.result()
            }
        }
    }

    fn gone(rank: usize) -> DiLoCoError {
        DiLoCoError::Collective(CollectiveError::InvalidArgument {
            rank,
            op: "DiLoCo overlap".into(),
            reason: "the background thread of the overlap stopped after an error reported \
                     earlier; DiLoCo cannot go on"
                .into(),
        })
    }
}

/// The outer exchanges of one rank, and the islands still averaged.
struct Outer {
    outer: ProcessGroup,
    /// With [`DiLoCoConfig::drop_lost_islands`] and islands of several ranks: the island's
    /// ranks, through which its first rank hands the outcome of its exchange to the others.
    island_sync: Option<ProcessGroup>,
    island_size: usize,
    compression: Compression,
    /// Point-to-point exchange that drops lost islands, instead of collectives.
    resilient: bool,
    /// The islands (outer ranks) still averaged, in order.
    live: Vec<usize>,
    /// Exchanges so far (the tag of the next one's messages).
    exchanges: u64,
}

impl Outer {
    fn run(&mut self, job: Job) -> Result<Outcome, DiLoCoError> {
        let fragment = job.fragment;
        let (delta, digest) = job.delta()?;
        if !self.resilient {
            let islands = self.outer.size();
            let avg = self.average(delta).map_err(|e| self.lost(e))?;
            return Ok(Outcome {
                avg,
                islands,
                dropped: Vec::new(),
            });
        }
        match self.island_sync.clone() {
            None => self.exchange(fragment, delta, digest),
            Some(sync) if sync.rank() == 0 => {
                let outcome = self.exchange(fragment, delta, digest);
                let bytes = match &outcome {
                    Ok(o) => encode_outcome(o),
                    Err(e) => {
                        let mut b = vec![1u8];
                        b.extend(e.to_string().into_bytes());
                        b
                    }
                };
                sync.broadcast_bytes(bytes, 0)?;
                outcome
            }
            Some(sync) => {
                let bytes = sync.broadcast_bytes(Vec::new(), 0)?;
                decode_outcome(&bytes, delta.len()).map_err(|reason| {
                    DiLoCoError::Collective(CollectiveError::PeerFailed {
                        rank: sync.global_rank(),
                        op: format!("DiLoCo sync of fragment {}", fragment),
                        peer: sync.members()[0],
                        reason,
                    })
                })
            }
        }
    }

    /// The average of `delta` over the islands, accumulated in f32 (collectives).
    fn average(&self, delta: Vec<f32>) -> Result<Vec<f32>, CollectiveError> {
        let outer = &self.outer;
        if outer.size() == 1 {
            return Ok(delta);
        }
        let n = delta.len();
        match self.compression {
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

    /// Whether `e` says that a rank of *another* island is gone (failed, exited or timed
    /// out), which drops that island; failures of this rank's own island are not.
    fn other_island_lost(&self, e: &CollectiveError) -> bool {
        let me = self.outer.global_rank() / self.island_size;
        match e {
            CollectiveError::PeerFailed { peer, .. }
            | CollectiveError::Timeout { peer, .. }
            | CollectiveError::Transport { peer, .. } => *peer / self.island_size != me,
            _ => false,
        }
    }

    /// The resilient exchange (every island's rank at this position): a data round, where
    /// each live island sends its encoded pseudo-gradient to every other and waits for theirs
    /// until a deadline, then an agreement round, where each sends the set of islands it heard
    /// from (and the digest of its `θ_start`) and waits for the sets of those islands. The
    /// islands averaged are those every set received contains; the others are dropped for
    /// good.
    fn exchange(
        &mut self,
        fragment: usize,
        delta: Vec<f32>,
        digest: u64,
    ) -> Result<Outcome, DiLoCoError> {
        let me = self.outer.rank();
        let start = self.live.clone();
        let round = self.exchanges;
        self.exchanges += 1;
        // Two tags per exchange: its data round and its agreement round.
        let data_tag = 2 * round;
        let n = delta.len();
        let payload = self.compression.encode(&delta);
        let len = payload.len();
        // The data round carries the digest of this island's θ_start before its encoded
        // pseudo-gradient; the agreement round is the one fault-tolerant data parallelism
        // votes with ([`crate::fault`]).
        let mut mine = digest.to_le_bytes().to_vec();
        mine.extend(payload);
        let lost = |e: &CollectiveError| self.other_island_lost(e);
        let (mut heard, agreed) = crate::fault::agree(&self.outer, &start, data_tag, mine, &lost)
            .map_err(|e| self.lost(e))?;
        heard.retain(|p, _| agreed.contains(p));
        for (&p, bytes) in &heard {
            if bytes.len() != 8 + len {
                return Err(DiLoCoError::Collective(CollectiveError::InvalidArgument {
                    rank: self.outer.global_rank(),
                    op: format!("DiLoCo sync of fragment {}", fragment),
                    reason: format!(
                        "island {p} sent {} bytes of pseudo-gradient, expected {len}",
                        bytes.len().saturating_sub(8)
                    ),
                }));
            }
            if bytes[..8] != digest.to_le_bytes() {
                return Err(DiLoCoError::Diverged {
                    island: me,
                    other: p,
                    fragment,
                });
            }
        }
        let dropped: Vec<usize> = start
            .iter()
            .copied()
            .filter(|p| !agreed.contains(p))
            .collect();
        if !agreed.contains(&me) {
            return Err(DiLoCoError::Excluded { island: me });
        }
        if agreed.len() == 1 && start.len() > 1 {
            let mut all_dropped: Vec<usize> = (0..self.outer.size()).filter(|&i| i != me).collect();
            all_dropped.sort_unstable();
            return Err(DiLoCoError::AllIslandsLost {
                island: me,
                dropped: all_dropped,
            });
        }
        if !dropped.is_empty() {
            eprintln!(
                "DiLoCo: rank {} (island {me}): dropped island(s) {dropped:?} from the average \
                 of fragment {} (outer exchange {round}); going on with islands {:?}",
                self.outer.global_rank(),
                fragment,
                agreed
            );
        }
        // The average over the islands agreed on, summed in island order: the same bits on
        // every survivor.
        let mut sum = vec![0.0f32; n];
        for p in &agreed {
            self.compression
                .decode_add(&heard[p][8..], &mut sum)
                .map_err(|reason| {
                    DiLoCoError::Collective(CollectiveError::InvalidArgument {
                        rank: self.outer.global_rank(),
                        op: format!("DiLoCo sync: pseudo-gradient of island {p}"),
                        reason,
                    })
                })?;
        }
        let scale = 1.0 / agreed.len() as f32;
        sum.iter_mut().for_each(|v| *v *= scale);
        self.live = agreed.iter().copied().collect();
        Ok(Outcome {
            avg: sum,
            islands: agreed.len(),
            dropped,
        })
    }

    /// A collective error of a sync, naming the lost island when a peer is gone.
    fn lost(&self, e: CollectiveError) -> DiLoCoError {
        let peer = match &e {
            CollectiveError::PeerFailed { peer, .. }
            | CollectiveError::Timeout { peer, .. }
            | CollectiveError::Transport { peer, .. } => Some(*peer),
            _ => None,
        };
        let rank = self.outer.global_rank();
        match peer {
            Some(peer) if peer != rank => DiLoCoError::IslandLost {
                rank,
                island: peer / self.island_size,
                peer,
                source: e,
            },
            _ => DiLoCoError::Collective(e),
        }
    }
}

/// An exchange's outcome for the other ranks of the island: `0`, islands averaged (u32),
/// dropped count (u32), dropped islands (u32 each), the average (f32 each); little-endian.
fn encode_outcome(o: &Outcome) -> Vec<u8> {
    let mut b = vec![0u8];
    b.extend((o.islands as u32).to_le_bytes());
    b.extend((o.dropped.len() as u32).to_le_bytes());
    o.dropped
        .iter()
        .for_each(|&d| b.extend((d as u32).to_le_bytes()));
    o.avg.iter().for_each(|v| b.extend(v.to_le_bytes()));
    b
}

/// Reads [`encode_outcome`]'s bytes for `n` values, or the error message the island's first
/// rank sent instead (`1`, then the message).
fn decode_outcome(bytes: &[u8], n: usize) -> Result<Outcome, String> {
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    match bytes.first() {
        Some(0) => {}
        Some(1) => return Err(String::from_utf8_lossy(&bytes[1..]).into_owned()),
        _ => return Err("malformed outcome of the outer exchange".into()),
    }
    let bad = || {
        format!(
            "the outcome of the outer exchange has {} bytes",
            bytes.len()
        )
    };
    let islands = u32_at(1).ok_or_else(bad)? as usize;
    let count = u32_at(5).ok_or_else(bad)? as usize;
    let dropped = (0..count)
        .map(|k| u32_at(9 + 4 * k).map(|d| d as usize).ok_or_else(bad))
        .collect::<Result<Vec<_>, _>>()?;
    let at = 9 + 4 * count;
    if bytes.len() != at + 4 * n {
        return Err(bad());
    }
    let avg = bytes[at..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Outcome {
        avg,
        islands,
        dropped,
    })
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

/// The parameters in `wanted`, flat and detached (handles: nothing is read).
struct Grabber {
    wanted: Vec<ParamId>,
    values: HashMap<ParamId, Tensor<1>>,
}

impl ModuleVisitor for Grabber {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.wanted.contains(&param.id) && !self.values.contains_key(&param.id) {
            let value = param.val().detach();
            let n = value.dims().iter().product::<usize>();
            self.values.insert(param.id, value.reshape([n]));
        }
    }
}

/// Replaces the values of the parameters in `values` (dtype, device and `require_grad` kept),
/// or with `mix` = `Some(α)` merges them: `α · current + (1 − α) · value`, on the device (no
/// read back of the current values).
struct Writer {
    values: HashMap<ParamId, (Vec<usize>, Vec<f32>)>,
    mix: Option<f32>,
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
            let t = match self.mix {
                // A new leaf, like the values written without the merge.
                Some(alpha) => (tensor.detach() * alpha + t * (1.0 - alpha)).detach(),
                None => t,
            };
            if require_grad { t.require_grad() } else { t }
        })
    }
}

/// Bytes sent by one rank, counted by the transport wrapper of [`count_sent_bytes`], in all
/// and per group. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct ByteCounter(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    total: AtomicU64,
    /// Per [`crate::comm::transport::StreamId::group`].
    by_group: Mutex<HashMap<u64, u64>>,
}

impl ByteCounter {
    /// Payload bytes of every frame this rank sent so far (headers not included).
    pub fn sent(&self) -> u64 {
        self.0.total.load(Ordering::Relaxed)
    }

    /// Payload bytes this rank sent so far in the messages of `group` (its collectives and
    /// point-to-point messages; not those of its sub-groups), whichever thread sent them:
    /// for instance the outer syncs of DiLoCo, `Islands::outer`, overlap or not.
    pub fn sent_in(&self, group: &ProcessGroup) -> u64 {
        let by_group = self.0.by_group.lock().unwrap_or_else(|e| e.into_inner());
        by_group.get(&group.stream_group()).copied().unwrap_or(0)
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
        let bytes = frame.payload.len() as u64;
        self.sent.0.total.fetch_add(bytes, Ordering::Relaxed);
        *self
            .sent
            .0
            .by_group
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(frame.header.stream.group)
            .or_insert(0) += bytes;
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
