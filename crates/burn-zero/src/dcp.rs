//! The ZeRO engines' state as pieces of a distributed checkpoint ([`burn_parallel::checkpoint`]).
//!
//! A flat space (ZeRO-1/2's whole model, or one stage-3 unit) is a row-major concatenation of
//! parameters, and a rank's range of it is a run of [`Segment`]s of *logical* parameters: the
//! pieces this rank writes are those segments of its fp32 master shard (the parameters) and of
//! its optimizer state (`optim/<state>/<logical parameter>`), so a checkpoint saved by any
//! number of shard ranks, at any stage, loads at any other, and into DDP or `Fsdp<M>` runs, which
//! write the same names ([`burn_parallel::checkpoint::ParamMap`]).
//!
//! Mixed precision: the fp32 master weights are the truth and are what is saved; the
//! low-precision copy a module computes with is derived from them on load. The loss scaler's
//! state is the same on every rank: put [`crate::LossScaler::state`] in the trainer's state.

use std::ops::Range;

use burn::tensor::{DType, Device, TensorData};
use burn_parallel::checkpoint::{
    Checkpoint, OPTIM, Piece, ScalarsByLogical, Segment, flat_space_segments, read_segments,
    read_state, scalars_by_logical, segment_pieces,
};
use burn_parallel::nn::TpContext;

use crate::error::{Result, ZeroError};
use crate::flat::FlatLayout;
use crate::optim::{ElementWise, ShardedOptimizer};

/// The logical segments of range `range` of flat space `layout`, whose parameter paths are
/// under `prefix` (`""` when they are already full paths): which region of which logical
/// parameter each part of the range holds.
///
/// # Arguments
/// * `tp` - the tensor-parallel context the flat space's module was built with
///   (`TpContext::single()` for none).
/// * `prefix` - the flat space's path in the whole model.
/// * `layout` - the flat space.
/// * `range` - the part of it (a rank's shard, or all of it).
///
/// # Returns
/// The segments, in flat order; their local regions lie in a 1-D tensor of `range.len()`.
///
/// # Errors
/// [`ZeroError::Checkpoint`] when a parameter's layout cannot be described.
///
/// # Example
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_parallel::nn::TpContext;
/// use burn_zero::dcp;
/// use burn_zero::flat::FlatLayout;
///
/// // A [4, 3] weight then a [3] bias; rank 1 of 2 holds elements 8..15 of the 15.
/// let layout = FlatLayout::of(&LinearConfig::new(4, 3).init(&Device::flex()), |_| true);
/// let segments = dcp::segments(&TpContext::single(), "fc", &layout, 8..15).unwrap();
/// assert_eq!(segments[0].logical, "fc.weight");
/// assert_eq!(segments[0].region.flat, 8..12);
/// assert_eq!(segments[1].logical, "fc.bias");
/// assert_eq!(segments[1].local.flat, 4..7);
/// ```
pub fn segments(
    tp: &TpContext,
    prefix: &str,
    layout: &FlatLayout,
    range: Range<usize>,
) -> Result<Vec<Segment>> {
    Ok(flat_space_segments(tp, prefix, &layout.parts(range))?)
}

/// The logical parameters (name and full shape) of flat space `layout` under `prefix`: what a
/// checkpoint must hold for it ([`Checkpoint::check`]).
///
/// # Errors
/// [`ZeroError::Checkpoint`] when a parameter's layout cannot be described.
pub fn logical_shapes(
    tp: &TpContext,
    prefix: &str,
    layout: &FlatLayout,
) -> Result<Vec<(String, Vec<usize>)>> {
    Ok(segments(tp, prefix, layout, 0..layout.numel())?
        .into_iter()
        .map(|s| (s.logical, s.region.shape))
        .collect())
}

/// The part of `segments` this rank writes: part `copies.1` of `copies.0` ranks holding the
/// same shard (hybrid sharding's replicas share the writing).
fn writes(segments: &[Segment], copies: (usize, usize)) -> Vec<Segment> {
    segments
        .iter()
        .map(|s| s.part(copies.0, copies.1))
        .collect()
}

/// The pieces of an fp32 shard `values` laid out along `segments` (from [`segments`]), named
/// by logical parameter; `copies` = `(ranks holding this same shard, this rank's index among
/// them)` shares the writing among replicas (`(1, 0)`: this rank writes all of it).
///
/// # Errors
/// [`ZeroError::Checkpoint`] when a segment does not fit `values`.
pub fn param_pieces(
    values: Vec<f32>,
    segments: &[Segment],
    copies: (usize, usize),
) -> Result<Vec<Piece>> {
    let len = values.len();
    let data = TensorData::new(values, [len]);
    Ok(segment_pieces("", &writes(segments, copies), &data)?)
}

/// The fp32 values of a shard of `len` elements laid out along `segments` (from [`segments`]),
/// read from the logical parameters of `checkpoint` (converted from whatever dtype they were
/// saved in). Only the checksummed chunks of the saved pieces that meet the segments are read.
///
/// # Errors
/// [`ZeroError::Checkpoint`] when a parameter is missing, a chunk fails its checksum or a file
/// cannot be read.
pub fn read_params(checkpoint: &Checkpoint, segments: &[Segment], len: usize) -> Result<Vec<f32>> {
    // Segment by segment, straight into the shard: the staging is one segment's read.
    read_segments(checkpoint, "", segments, &[len], Some(DType::F32))?
        .try_into_vec::<f32>()
        .map_err(|e| ZeroError::Config(format!("parameters read from the checkpoint: {e:?}")))
}

/// Unit `unit`'s optimizer state as pieces `optim/<state>/<logical>`, and its scalars by
/// logical parameter.
pub(crate) fn state_pieces<O: ElementWise>(
    optim: &ShardedOptimizer<O>,
    unit: usize,
    segments: &[Segment],
    copies: (usize, usize),
) -> Result<(Vec<Piece>, ScalarsByLogical)> {
    let writes = writes(segments, copies);
    let (state, scalars) = optim.export(unit);
    let mut pieces = Vec::new();
    for (field, data) in &state {
        pieces.extend(segment_pieces(&format!("{OPTIM}{field}/"), &writes, data)?);
    }
    Ok((pieces, scalars_by_logical(segments, &scalars)))
}

/// Restores unit `unit`'s optimizer state (a shard of `len` elements along `segments`) from
/// `checkpoint`; no state there leaves it empty, as before a first step.
pub(crate) fn load_state<O: ElementWise>(
    optim: &mut ShardedOptimizer<O>,
    (unit, len): (usize, usize),
    checkpoint: &Checkpoint,
    segments: &[Segment],
    scalars: &ScalarsByLogical,
    device: &Device,
) -> Result<()> {
    let (state, scalars) = read_state(checkpoint, segments, &[len], scalars)
        .map_err(ZeroError::Config)?
        .unwrap_or_default();
    optim.import(unit, state, &scalars, len, device)
}
