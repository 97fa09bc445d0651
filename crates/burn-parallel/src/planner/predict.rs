//! Per-rank memory and step time of one layout (the model of the parent module's docs), and
//! the constraints a layout must meet.

use super::activation::{self, MicroBatch};
use super::{Candidate, Checkpoint, Hardware, Layout, Memory, ModelShape, Schedule, Training};

/// The per-rank parameters of one pipeline stage.
#[derive(Debug, Clone, Copy, Default)]
struct StageParams {
    /// Parameters sharded by ZeRO over `dp_shard x cp` (everything but routed experts).
    dense: f64,
    /// Routed experts on this rank (sharded over `dp_shard x cp / ep`).
    experts: f64,
    /// The largest FSDP unit (embedding, one block, or norm + head), per rank.
    largest_unit: f64,
    /// Active weights per token of the stage, per rank, for FLOPs (`x 1/tp` applied).
    active: f64,
}

fn stage_params(shape: &ModelShape, layout: &Layout, stage: usize) -> StageParams {
    let d = &layout.dims;
    let (p, t, e) = (d.pp, d.tp as f64, d.ep as f64);
    let per = shape.layers / p;
    let mut s = StageParams::default();
    for i in stage * per..(stage + 1) * per {
        let l = shape.layer(shape.is_moe_layer(i));
        let rank = l.tp_split / t + l.replicated + l.experts / e;
        s.dense += l.tp_split / t + l.replicated;
        s.experts += l.experts / e;
        s.largest_unit = s.largest_unit.max(rank);
        s.active += l.active / t;
    }
    let embed =
        (shape.vocab * shape.d_model) as f64 / t + (shape.position_table * shape.d_model) as f64;
    let head = if shape.tied_embeddings {
        (shape.vocab * shape.d_model) as f64 / t
    } else {
        shape.head_params() as f64 / t
    } + shape.norm.params(shape.d_model) as f64;
    if stage == 0 {
        s.dense += embed;
        s.largest_unit = s.largest_unit.max(embed);
    }
    if stage == p - 1 {
        // With tied embeddings and one stage, the head is the embedding already counted.
        let extra = if shape.tied_embeddings && p == 1 {
            shape.norm.params(shape.d_model) as f64
        } else {
            head
        };
        s.dense += extra;
        s.largest_unit = s.largest_unit.max(head);
        s.active += (shape.vocab * shape.d_model) as f64 / t;
    }
    let k = shape.scale();
    s.dense *= k;
    s.experts *= k;
    s.largest_unit *= k;
    s
}

/// Checks a layout against the model and the job.
pub(super) fn check(
    shape: &ModelShape,
    training: &Training,
    layout: &Layout,
) -> Result<(), String> {
    let d = &layout.dims;
    let w = training.world;
    if d.world_size() != w {
        return Err(format!(
            "pp {} x dp {} x {} x cp {} x tp {} = {} ranks, not the world of {w}",
            d.pp,
            d.dp_replicate,
            d.dp_shard,
            d.cp,
            d.tp,
            d.world_size()
        ));
    }
    if !shape.heads.is_multiple_of(d.tp) {
        return Err(format!("tp {} does not divide {} heads", d.tp, shape.heads));
    }
    if !shape.kv_heads.is_multiple_of(d.tp) {
        return Err(format!(
            "tp {} does not divide {} key/value heads",
            d.tp, shape.kv_heads
        ));
    }
    if !shape.d_ff.is_multiple_of(d.tp) {
        return Err(format!("tp {} does not divide d_ff {}", d.tp, shape.d_ff));
    }
    if !shape.layers.is_multiple_of(d.pp) {
        return Err(format!(
            "pp {} does not divide {} layers",
            d.pp, shape.layers
        ));
    }
    let chunks = layout.schedule.chunks();
    if !shape.layers.is_multiple_of(d.pp * chunks) {
        return Err(format!(
            "pp {} x {chunks} chunks of {} does not divide {} layers",
            d.pp, layout.schedule, shape.layers
        ));
    }
    if (d.pp == 1) != (layout.schedule == Schedule::None) {
        return Err(format!(
            "schedule {} does not go with pp {}",
            layout.schedule, d.pp
        ));
    }
    if !training.seq_len.is_multiple_of(d.cp) {
        return Err(format!(
            "cp {} does not divide the sequence of {} tokens",
            d.cp, training.seq_len
        ));
    }
    if layout.sp && (d.tp < 2 || !(training.seq_len / d.cp).is_multiple_of(d.tp)) {
        return Err(format!(
            "sequence parallelism needs tp > 1 dividing the {} tokens per cp rank (tp {})",
            training.seq_len / d.cp,
            d.tp
        ));
    }
    let dp = d.dp_replicate * d.dp_shard;
    match &shape.moe {
        Some(m) if !m.experts.is_multiple_of(d.ep) || !dp.is_multiple_of(d.ep) => {
            return Err(format!(
                "ep {} must divide the {} experts and the {dp} data-parallel ranks",
                d.ep, m.experts
            ));
        }
        None if d.ep != 1 => return Err(format!("ep {} without experts", d.ep)),
        _ => {}
    }
    if !training.global_batch.is_multiple_of(dp) {
        return Err(format!(
            "dp {dp} (replicate {} x shard {}) does not divide the global batch of {} sequences",
            d.dp_replicate, d.dp_shard, training.global_batch
        ));
    }
    let per_replica = training.global_batch / dp;
    if !per_replica.is_multiple_of(training.micro_batch)
        || per_replica / training.micro_batch != layout.micro_batches
    {
        return Err(format!(
            "micro-batches of {} sequences do not make {} micro-batches of the {per_replica} \
             sequences per replica",
            training.micro_batch, layout.micro_batches
        ));
    }
    if matches!(layout.schedule, Schedule::Interleaved { .. })
        && !layout.micro_batches.is_multiple_of(d.pp)
    {
        return Err(format!(
            "interleaved needs the {} micro-batches to be a multiple of pp {}",
            layout.micro_batches, d.pp
        ));
    }
    let stage_ok = match layout.zero {
        0 => d.dp_shard == 1,
        1..=3 => d.dp_shard * d.cp >= 2,
        _ => false,
    };
    if !stage_ok {
        return Err(format!(
            "ZeRO stage {} with dp_shard {} and cp {} (stage 0 needs dp_shard 1, stages 1-3 \
             shard over dp_shard x cp >= 2 ranks)",
            layout.zero, d.dp_shard, d.cp
        ));
    }
    Ok(())
}

pub(super) fn predict(
    shape: &ModelShape,
    training: &Training,
    hw: &Hardware,
    layout: &Layout,
) -> Candidate {
    let d = &layout.dims;
    let (p, t, c, e, m) = (d.pp, d.tp, d.cp, d.ep, layout.micro_batches);
    let (bp, bg, bo) = training.bytes_per_param();
    let ab = training.activation_bytes();
    let shard = (d.dp_shard * c) as f64;
    let shard_experts = if (d.dp_shard * c).is_multiple_of(e) {
        ((d.dp_shard * c) / e).max(1) as f64
    } else {
        1.0
    };
    let mb = MicroBatch {
        sequences: training.micro_batch,
        local_tokens: training.seq_len / c,
        key_tokens: training.seq_len,
        tp: t,
        sp: layout.sp,
    };
    let tokens_mb = (mb.sequences * mb.local_tokens) as f64;
    let sbh = tokens_mb * shape.d_model as f64;
    let seq_split = if layout.sp { t as f64 } else { 1.0 };
    let recompute = layout.checkpoint != Checkpoint::None;
    let per = shape.layers / p;
    let (z, tf) = (layout.zero, t as f64);

    let mut worst = Memory::default();
    let mut worst_mb_seconds = 0.0f64;
    let mut worst_flops = 0.0f64;
    let mut comm_total = 0.0f64;
    let mut dp_seconds = 0.0f64;
    for stage in 0..p {
        let sp_params = stage_params(shape, layout, stage);
        let sharded = |n: f64, on: bool| if on { n / shard } else { n };
        let sharded_e = |n: f64, on: bool| if on { n / shard_experts } else { n };
        let held_params = sp_params.dense + sp_params.experts;
        let mut mem = Memory {
            params: bp * (sharded(sp_params.dense, z >= 3) + sharded_e(sp_params.experts, z >= 3)),
            grads: bg * (sharded(sp_params.dense, z >= 2) + sharded_e(sp_params.experts, z >= 2)),
            optimizer: bo
                * (sharded(sp_params.dense, z >= 1) + sharded_e(sp_params.experts, z >= 1)),
            stage,
            ..Memory::default()
        };

        // Activations.
        let fp32 = !training.mixed_precision;
        let kernels = activation::Kernels {
            attention: training.attention,
            fused: training.fused,
            dropout: training.dropout,
        };
        let layers: Vec<f64> = (stage * per..(stage + 1) * per)
            .map(|i| {
                let moe = if shape.is_moe_layer(i) {
                    shape.moe.as_ref()
                } else {
                    None
                };
                if fp32 {
                    activation::fp32_layer_bytes(shape, moe, &mb, &kernels)
                } else {
                    activation::paper_layer_bytes(
                        shape,
                        moe,
                        &mb,
                        training.attention,
                        training.dropout,
                    )
                }
            })
            .collect();
        let full: f64 = layers.iter().sum();
        let largest_layer = layers.iter().cloned().fold(0.0, f64::max);
        let held = layout.schedule.held(stage, p, m);
        // The paper's checkpoint is 16-bit; the fp32 block input is twice that.
        let ckpt = activation::checkpoint_bytes(shape, &mb) * if fp32 { 2.0 } else { 1.0 };
        mem.activations = match layout.checkpoint {
            Checkpoint::None => held * full,
            Checkpoint::Block => held * per as f64 * ckpt + largest_layer,
            Checkpoint::Stage => held.ceil() * ckpt + full,
        };
        let in_flight = held.min(m as f64);
        if fp32 {
            // One rank holds the whole vocabulary with the fused kernels: the fused loss.
            let fused_loss = training.fused && t == 1;
            if stage == p - 1 {
                let (kept, transient) =
                    activation::fp32_head_bytes(shape, &mb, &kernels, fused_loss);
                mem.activations += in_flight * kept;
                mem.transient += transient;
            }
            if stage == 0 {
                mem.activations +=
                    in_flight * activation::fp32_embedding_bytes(shape, &mb, &kernels);
            }
            // FSDP: autodiff keeps every gathered unit of the stage until its backward.
            if z >= 3 {
                mem.gathered = bp * held_params;
            }
        } else if stage == p - 1 {
            mem.activations += in_flight * activation::logits_bytes(shape, &mb);
        }
        mem.phased = fp32;

        // Communication buffers.
        let grad_bytes = bg * held_params;
        mem.buffers = match z {
            0..=2 => 2.0 * grad_bytes.min(training.bucket_bytes as f64),
            _ => sp_params.largest_unit * (bp + bg),
        };
        let kv_block =
            2.0 * tokens_mb * (shape.kv_heads * (shape.d_model / shape.heads)) as f64 / tf * ab;
        let moe_layers = (stage * per..(stage + 1) * per)
            .filter(|&i| shape.is_moe_layer(i))
            .count() as f64;
        let top_k = shape.moe.as_ref().map_or(0, |m| m.top_k) as f64;
        // The forward's and backward's buffers: in the fp32 model they live while the
        // activations do.
        let mut passes = 0.0;
        if t > 1 {
            passes += 2.0 * sbh * ab;
        }
        if c > 1 {
            passes += 2.0 * kv_block;
        }
        if p > 1 {
            passes += 2.0 * sbh * ab / seq_split;
        }
        if e > 1 && moe_layers > 0.0 {
            passes += 2.0 * sbh * top_k * ab;
        }
        if fp32 {
            mem.transient += passes;
        } else {
            mem.buffers += passes;
        }
        if mem.total() > worst.total() {
            worst = mem;
        }

        // Time of one micro-batch on this stage.
        let passes = if recompute { 4.0 } else { 3.0 };
        let attention = 4.0 * (training.seq_len * shape.d_model) as f64 / tf * per as f64;
        let flops_mb = passes * tokens_mb * (2.0 * sp_params.active * shape.scale() + attention);
        let mut comm = 0.0;
        if t > 1 {
            let ops = per as f64 * if recompute { 6.0 } else { 4.0 };
            comm += ops * 2.0 * (tf - 1.0) / tf * sbh * ab;
        }
        if c > 1 {
            comm += per as f64 * 3.0 * (c - 1) as f64 * kv_block;
        }
        if e > 1 {
            comm += moe_layers * 4.0 * (e - 1) as f64 / e as f64 * sbh * top_k * ab;
        }
        if p > 1 {
            comm += 2.0 * sbh * ab / seq_split;
        }
        let mb_seconds = flops_mb / hw.flops_per_s + comm / hw.link_bytes_per_s;
        worst_mb_seconds = worst_mb_seconds.max(mb_seconds);
        worst_flops = worst_flops.max(flops_mb * m as f64);

        // Gradient synchronisation (and ZeRO-3's gathers) once per step.
        let (r, n) = (d.dp_replicate as f64, shard);
        let ring = |k: f64| if k > 1.0 { (k - 1.0) / k } else { 0.0 };
        let dp_bytes = match z {
            0 => 2.0 * ring(r * n) * grad_bytes,
            1 | 2 => 2.0 * ring(n) * grad_bytes + 2.0 * ring(r) * grad_bytes / n,
            _ => {
                let gathers = 2.0 * m as f64 * ring(n) * bp * held_params;
                gathers + ring(n) * grad_bytes + 2.0 * ring(r) * grad_bytes / n
            }
        };
        dp_seconds = dp_seconds.max(dp_bytes / hw.link_bytes_per_s);
        comm_total = comm_total.max(comm * m as f64 + dp_bytes);
    }
    let bubble = layout.schedule.bubble_factor() * (p - 1) as f64 * worst_mb_seconds;
    let step_seconds = m as f64 * worst_mb_seconds + bubble + dp_seconds;
    let tokens = training.global_batch as f64 * training.seq_len as f64;
    let attention_all = 12.0 * (shape.layers * training.seq_len * shape.d_model) as f64;
    let dense_flops = 6.0 * shape.active_params() as f64 * shape.scale()
        + if recompute {
            2.0 * shape.active_params() as f64 * shape.scale()
        } else {
            0.0
        };
    let attention_flops = attention_all * if recompute { 4.0 / 3.0 } else { 1.0 };
    Candidate {
        layout: *layout,
        memory: worst,
        flops_per_step: tokens * (dense_flops + attention_flops),
        flops_per_rank: worst_flops,
        comm_bytes_per_rank: comm_total,
        step_seconds,
        bubble_fraction: bubble / step_seconds,
        tokens_per_s: tokens / step_seconds,
    }
}
