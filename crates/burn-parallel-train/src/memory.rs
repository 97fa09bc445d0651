//! [`check_memory`]: refuses, before anything is allocated, a run that cannot fit, with the
//! figures and the settings to change (instead of a "capacity overflow" panic or an
//! out-of-memory abort with a backtrace).

use burn_parallel::Error;
use burn_parallel::planner::{
    self, Checkpoint, Hardware, ModelShape, Schedule, Training, human_bytes,
};

use crate::layout::Layout;
use crate::settings::{TrainDevice, available_memory};

/// No device holds more than this (256 TiB).
const ANY_DEVICE: f64 = (1u64 << 48) as f64;

/// The parameters of `shape`, estimated in floating point (sizes that overflow integer
/// arithmetic must still be refused with a figure): the blocks' attention and MLPs (the
/// experts of the MoE blocks), the embeddings and an untied head.
fn params_estimate(shape: &ModelShape) -> f64 {
    let (d, layers) = (shape.d_model as f64, shape.layers as f64);
    let projections = |gated: bool| if gated { 3.0 } else { 2.0 };
    let dense = projections(shape.gated_mlp) * d * shape.d_ff as f64;
    let blocks = match &shape.moe {
        Some(m) => {
            // Blocks every-1, 2 every-1, ... are MoE blocks.
            let moe_layers = (shape.layers / m.every.max(1)) as f64;
            let experts = m.experts as f64 * projections(m.gated) * d * m.d_ff as f64;
            layers * 4.0 * d * d + moe_layers * experts + (layers - moe_layers) * dense
        }
        None => layers * (4.0 * d * d + dense),
    };
    let head = if shape.tied_embeddings {
        0.0
    } else {
        shape.vocab as f64 * d
    };
    blocks + (shape.vocab as f64 + shape.position_table as f64) * d + head
}

/// Refuses a run of `shape` trained as `training` says under `layout` (on `training.world`
/// ranks, `ranks_here` of them in this process) that cannot fit: one whose training state
/// (fp32 parameters, gradients and AdamW's two moments, split at best over every rank) exceeds
/// what any device holds, or, on the host CPU, whose state or the planner's predicted peak
/// ([`planner::evaluate`], within 10% of the measured peak on the layouts it models) exceeds
/// this machine's available memory by half again (the margin keeps any run that could fit).
///
/// # Errors
/// [`Error::Invalid`] with the figures, naming the flags that shrink the run.
///
/// ```
/// use burn_parallel::planner::{ModelShape, Training};
/// use burn_parallel_train::{Layout, TrainDevice, check_memory};
///
/// let training = Training::new(2, 8, 64);
/// let small = ModelShape::gpt(2, 64, 4, 256, 64);
/// assert!(check_memory(&small, &training, &Layout::default(), 2, TrainDevice::Flex).is_ok());
/// let huge = ModelShape::gpt(2, 1 << 40, 1, 256, 64);
/// let err = check_memory(&huge, &training, &Layout::default(), 2, TrainDevice::Flex);
/// assert!(err.unwrap_err().to_string().contains("needs about"));
/// ```
pub fn check_memory(
    shape: &ModelShape,
    training: &Training,
    layout: &Layout,
    ranks_here: usize,
    device: TrainDevice,
) -> Result<(), Error> {
    let state = 16.0 * params_estimate(shape) / training.world.max(1) as f64;
    let too_big = |what: &str, need: f64, have: String| {
        let reason = format!(
            "{what} needs about {} per rank but {have}: reduce --d-model, --layers, --d-ff, \
             --vocab, --batch-size or --seq-len, or spread the model over more ranks (--zero 3, \
             --tp)",
            human_bytes(need),
        );
        Error::invalid("memory", reason)
    };
    if state > ANY_DEVICE {
        let have = format!("no device holds more than {}", human_bytes(ANY_DEVICE));
        return Err(too_big("the model's training state", state, have));
    }
    let Some(available) = available_memory().filter(|_| device.is_host()) else {
        return Ok(());
    };
    let here = ranks_here.max(1) as f64;
    let have = format!("{} is available", human_bytes(available / here));
    if state * here > 1.5 * available {
        return Err(too_big("the model's training state", state, have));
    }
    let dims = layout.dims(training.world);
    let dp = dims.dp_replicate * dims.dp_shard;
    let plan = planner::Layout {
        dims,
        zero: layout.zero.map_or(0, |s| s.number() as u8),
        sp: layout.sp,
        schedule: Schedule::None,
        micro_batches: training.global_batch / (dp * training.micro_batch).max(1),
        checkpoint: Checkpoint::None,
    };
    let hw = Hardware::from_units(1.0, 1.0, 1.0);
    if let Ok(candidate) = planner::evaluate(shape, training, &hw, &plan) {
        let peak = candidate.memory.total();
        if peak * here > 1.5 * available {
            return Err(too_big("training (the planner's peak)", peak, have));
        }
    }
    Ok(())
}
