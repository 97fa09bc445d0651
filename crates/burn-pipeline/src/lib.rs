//! # burn-pipeline: pipeline parallelism for Burn
//!
//! This crate holds pipeline schedules **as data**. A [`Schedule`] is one ordered list of
//! [`Action`]s per pipeline rank, plus the [`Placement`] saying which rank owns which stage.
//! The crate generates the usual schedules, checks them before anything runs, predicts their
//! timing, and reads and writes them as files. Its runtime ([`runtime::Executor`]) then runs
//! a validated schedule on Burn modules ([`stage::Stage`]) over a pipeline `ProcessGroup` of
//! `burn-parallel`; [`partition`] splits a model's layers into stages.
//!
//! | module | what it does |
//! |---|---|
//! | [`schedule`] | [`Action`], [`Transfer`] (what a send carries), [`Placement`] (loop or V order, `v` stages per rank), [`Schedule`], [`ScheduleKind`] |
//! | [`generators`] | GPipe, 1F1B, interleaved 1F1B (`v` stages per rank), ZB-H1, ZBV |
//! | [`validate`] | checks that dependencies hold, that sends and receives match, and that no deadlock can happen; each error is typed and names the rank, the action and what is missing |
//! | [`simulate`] | makespan, bubble fraction, peak activations per rank and stage; a text timeline and a Chrome/Perfetto trace |
//! | [`format`](mod@format) | CSV and TOML files (the grammar is in the module docs), and a side-by-side listing that marks the failing action |
//! | [`sequential`] | [`sequential::Sequential`]: the stage of any input layer → layers → output layer model, from three small traits on the user's own modules |
//! | [`stage`] | the [`stage::Stage`] trait (a Burn module whose forward takes a [`stage::Boundary`]: several tensors and serialisable metadata) |
//! | [`partition`] | layers into stages: by count, balanced by cost (first and last stage may take fewer), or at explicit boundaries |
//! | [`checkpoint`] | activation checkpointing of one block inside a stage: graph-free forward, recomputed in the backward, its parameter gradients handed to the stage |
//! | [`deferred`] | split backward: [`deferred::DeferredLinear`] (weight gradient deferred from `I` to `W`) and its [`deferred::WeightGradStore`] |
//! | [`trace`] | one timeline type for measured and simulated steps: the measured bubble fraction, a Chrome/Perfetto trace with a track per rank |
//! | [`update`] | [`update::StageUpdater`]: each stage's gradients reduced over its replicas (DDP, or ZeRO-1/2) and stepped; clipping by the norm over every stage; weights tied between the first and the last stage; dynamic loss scaling decided over every stage |
//! | [`runtime`] | [`runtime::Executor`]: runs this rank's program, sends and receives boundaries, accumulates and hands over each stage's gradients at `REDUCE`; mixed precision (each stage's compute copy, the loss-scaled seed: [`runtime::Executor::with_precision`]); typed [`runtime::PipelineError`]s, never a hang |
//!
//! ```
//! use burn_pipeline::{generators, simulate::{simulate, Costs}};
//!
//! let schedule = generators::generate("zbv".parse().unwrap(), 4, 8, None).unwrap();
//! schedule.validate().unwrap(); // dependencies, matching, no deadlock
//! let report = simulate(&schedule, &Costs::unit()).unwrap();
//! assert!(report.bubble_fraction < 0.06); // 1F1B: 0.27 at the same size
//! println!("{}", report.render(1.0)); // rank x time grid
//! let csv = burn_pipeline::format::to_csv(&schedule); // or to_toml, save, load
//! # assert!(csv.contains("SEND_F(0->1,m0)"));
//! ```
//!
//! ## Actions
//!
//! An action is one of: a forward `F`, a full backward `B`, the input-gradient half `I` or
//! the weight-gradient half `W` of a stage for one micro-batch; a send or receive of an
//! activation or a gradient between neighbouring stages; or `REDUCE(s)`, the point after the
//! last backward of stage `s` where its gradients may be reduced (data parallel, tied
//! weights) and applied. An action always names its *local* stage, which lives on the rank
//! that runs it. Transfers name the peer stage as well. A send and its receive carry the same
//! [`Transfer`] (payload, from, to, micro-batch), and [`Transfer::tag`] turns it into a
//! unique message tag. The compact text form is the same one the files use: `0F3`, `1I2`,
//! `SEND_F(1->2,m3)`, `REDUCE(0)`.
//!
//! The generators order the computation and then add the communication in one place,
//! [`Schedule::with_communication`]: each send comes right after the action that produces
//! its tensor, and each receive comes right before the first action that uses it. Two
//! neighbouring stages on the same rank (the turn of the V in ZBV) pass the tensor over
//! directly. Because the placement and the communication are explicit, a hand-written or
//! loaded schedule goes through the same checks as a generated one.
//!
//! ## What is proven before running
//!
//! [`validate::validate`] checks, in this order: indices are in range; each action is on
//! the rank that owns its stage; transfers go to the adjacent stage on another rank; there
//! are no duplicates; no micro-batch mixes `B` with `I`/`W`; the step is complete; local
//! dependencies hold in program order; every send has exactly one receive; and the programs
//! cannot deadlock. The deadlock check runs the programs abstractly. It uses
//! [`validate::CommModel::Eager`] (a send returns at once, as `burn-parallel`'s transports do)
//! or [`validate::CommModel::Rendezvous`] (a send blocks until the receive is posted, as
//! blocking NCCL sends of large messages do). When ranks get stuck, the error lists every
//! stuck rank, the action it is waiting on, and where its peer is. The generated schedules
//! are checked under the eager model; 1F1B-style steady states deadlock under the rendezvous
//! model, which the tests show.
//!
//! ## What the simulator predicts (unit costs `F = 1`, `B = 2`, `I = W = 1`, free communication)
//!
//! The tests check these closed forms exactly, for `p` in 2..=4 and `m` in `p..=4p`:
//!
//! | schedule | makespan | bubble fraction |
//! |---|---|---|
//! | GPipe, 1F1B | `3 (m + p - 1)` | `(p - 1) / (m + p - 1)` |
//! | interleaved 1F1B, `v` stages per rank, `p \| m` | `3 (v m + p - 1)` | `(p - 1) / (v m + p - 1)` |
//! | ZB-H1 | `3 m + p - 1` (each rank idles `p - 1`, a third of 1F1B's `3 (p - 1)`) | `(p - 1) / (3 m + p - 1)` |
//! | ZBV (2 stages per rank) | `6 m + p - 1`, the lower bound | `(p - 1) / (6 m + p - 1)` |
//!
//! GPipe holds all `m` micro-batches. 1F1B holds at most `p - r` on rank `r`. ZB-H1 holds the
//! same until `I`, plus at most `r` deferred `W` inputs. ZBV holds at most `2p` stage
//! activations, which is `p` micro-batches of one rank's layers.
//!
//! ## The runtime
//!
//! *Executing a program.* [`runtime::Executor::new`] validates the schedule, checks that the
//! pipeline group has one rank per program, and all-gathers [`Schedule::fingerprint`]: ranks
//! holding different schedules refuse to start. [`runtime::Executor::step`] then walks this
//! rank's program. `F` runs the stage module on the received activation (made a leaf with
//! `require_grad`) or on the output of the rank's previous stage, handed over in memory, and
//! keeps the input leaves and the output under `(stage, micro-batch)`. `SEND_*`/`RECV_*` go to
//! `burn-parallel`'s `ProcessGroup::send`/`recv`, eager sends on every backend (through NCCL in
//! device memory on CUDA), which matches the validated model: a JSON header (step, shapes, the
//! boundary's metadata) then each tensor, all under [`Transfer::tag`], each rank's receives run in the
//! order their senders send them ([`Schedule::with_receives_in_send_order`]). Every receive has the group's timeout, so a dead peer is an
//! error and never a hang, and a rank that fails aborts the group so that its peers fail at
//! once. Burn has no `backward(dY)`, so `B`/`I` call `backward()` on the surrogate
//! `Σ sum(output * dY.detach())` (the loss divided by the micro-batch count on the last
//! stage), which gives the same gradients. They then take the input leaves' gradients to send
//! them on, and add the stage's parameter gradients to its `GradientsAccumulator`. `REDUCE(s)`
//! hands the stage and its summed gradients to the caller, which reduces them (data
//! parallelism: `burn_parallel::train::TrainStep::reduce`) and steps the optimizer. The first
//! transfer over each boundary fixes its spec (tensor count, dtypes, shapes); later ones are
//! checked against it, except along dimensions declared variable (a sequence length that
//! changes per micro-batch).
//!
//! *Splitting the backward (I/W) in Burn* ([`deferred`]). Burn computes every gradient of a
//! graph in one `backward()`. To defer weight gradients, a stage's linear layers are
//! [`deferred::DeferredLinear`]s: the forward multiplies by the weight *untracked* and
//! attaches its own backward step (`burn_parallel::autograd::attach`, a backend-extension op
//! whose `Autodiff` impl registers a custom `Backward`), so `backward()` does not produce
//! `dW`. The step's backward computes
//! `dX = dY Wᵀ` at once and pushes `(x, dY)`, both without autodiff, into the stage's
//! [`deferred::WeightGradStore`] under the micro-batch being back-propagated (the runtime
//! scopes each backward with `begin(microbatch)`). So the `I` action is `backward()` with the
//! store recording. It returns the input gradient as soon as possible, and it also produces
//! the gradients of the small parameters (biases, norms), which are simply left tracked. The
//! `W` action takes that micro-batch's entries, computes `dW = xᵀ dY` without autodiff, and
//! adds the result to the stage's accumulated `GradientsParams`. A full `B` runs `backward()`
//! and then the same computation at once. When a layer's input needs no gradient (the first
//! layer of the first stage reads data), the step hangs off a fresh one-element leaf so that
//! it still runs. `REDUCE(s)` refuses to run while pairs are left, then hands the stage's
//! gradients to data parallelism and the optimizer. The memory cost of deferring is the
//! `(x, dY)` pairs; the simulator counts them: this is the difference between
//! `peak_activations` and `peak_activations_until_input`. A stage without deferred linears
//! (the bundled GPT, whose layers are `burn_parallel::nn::Linear`) runs its whole backward in
//! `I` and nothing in `W`: correct, with the timing of a schedule whose `W` is free.
//! [`deferred::WeightGradStore::defer`] takes any closure computing a weight's gradient, so a
//! custom layer whose backward is written with `attach` can defer its own.
//!
//! *Activation checkpointing* ([`runtime::Checkpointing`],
//! [`runtime::Executor::with_checkpointing`]). A checkpointed stage's `F` runs the stage on a
//! graph-free copy of the module (`Module::valid`, the input a plain tensor), so no
//! intermediate activation outlives the forward; the stage keeps only its input (and its
//! output until it is sent). Its `B`/`I` run the forward again on that input, with the graph,
//! then the backward as usual: the same gradients for one more forward per micro-batch. The
//! stage's forward must be deterministic (random ops must draw the same values twice).
//!
//! *Traces* ([`trace`]). Every [`runtime::StepReport`] holds this rank's timeline and the wall
//! clock of its start; [`trace::StepTrack`]s gathered from every rank make one
//! [`trace::Timeline`], the same type the simulator's report converts to, so that the measured
//! bubble and the predicted one ([`simulate::Costs::from_timeline`] feeds the step's own
//! action times back to the simulator) compare directly, and both write a Chrome/Perfetto
//! trace with a track per rank.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod deferred;
pub mod format;
pub mod generators;
pub mod partition;
pub mod runtime;
pub mod schedule;
pub mod sequential;
pub mod simulate;
pub mod stage;
pub mod trace;
pub mod update;
pub mod validate;

pub use schedule::{
    Action, ActionKind, ActionParseError, Payload, Placement, PlacementStyle, Schedule,
    ScheduleError, ScheduleKind, Transfer,
};
