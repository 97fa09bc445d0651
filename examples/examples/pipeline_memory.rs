//! Activation memory of a pipelined GPT step: GPipe against 1F1B, each without activation
//! checkpointing, recomputing whole stages and recomputing block by block, measured by
//! counting every allocation of the process.
//!
//! Thread ranks share the process, so each figure is the peak of one training step above the
//! bytes held before it, summed over the pipeline ranks (the model, its gradients and AdamW
//! state are held before the step and not counted; the first step, which allocates the
//! optimizer state, is skipped). Beside it, the runtime's own count of micro-batches held per
//! stage and the theory: GPipe holds all `m` micro-batches on every stage, 1F1B at most
//! `p - r` on rank `r`.
//!
//! ```sh
//! cargo run --release -p examples --example pipeline_memory -- [pp] [microbatches] [layers]
//! ```

use std::sync::Mutex;

use burn_parallel::{CollectiveError, run_local};
use burn_parallel_train::{Layout, PipelineLayout};
use burn_pipeline::ScheduleKind;
use burn_zero::memory::CountingAllocator;
use examples::data::Corpus;
use examples::gpt::GptConfig;
use examples::pipeline::{Recompute, train_gpt_pipeline};
use examples::train::TrainConfig;

/// Counts every allocation of the process.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// The largest step peak above the step's starting bytes, over steps after the first, and the
/// peak micro-batches held per stage in the last step.
fn measure(
    config: &TrainConfig,
    layout: &Layout,
    corpus: &Corpus,
) -> Result<(usize, Vec<usize>), CollectiveError> {
    let worst = Mutex::new(0usize);
    let reports = run_local(layout.pp, |g| {
        let lead = g.rank() == 0;
        let mut base = ALLOC.reset_peak();
        let mut on_step = |s: &examples::train::StepStats| {
            if lead {
                if s.log.step > 0 {
                    let mut w = worst.lock().unwrap_or_else(|e| e.into_inner());
                    *w = (*w).max(ALLOC.peak().saturating_sub(base));
                }
                base = ALLOC.reset_peak();
            }
        };
        let split = Default::default();
        train_gpt_pipeline(&g, config, layout, &split, corpus, &mut on_step).map_err(|e| {
            CollectiveError::InvalidArgument {
                rank: g.rank(),
                op: "train_gpt_pipeline".into(),
                reason: e.to_string(),
            }
        })
    })?;
    let held = reports
        .iter()
        .flat_map(|r| r.last_step.iter())
        .flat_map(|s| s.peak_held.values().copied())
        .collect();
    Ok((worst.into_inner().unwrap_or_else(|e| e.into_inner()), held))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let pp: usize = args.next().map_or(Ok(2), |a| a.parse())?;
    let m: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let layers: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let corpus = Corpus::load_default()?;
    let mut model = GptConfig::new(256, layers, 4, 128, 128);
    model.seed = 1;
    let config = TrainConfig {
        model,
        steps: 3,
        batch_size: 4 * m,
        seq_len: 128,
        grad_accum: m,
        lr: 1e-3,
        warmup_steps: 1,
        weight_decay: 0.0,
        bucket_mb: 1.0,
        eval_batches: 1,
        sample_len: 0,
        prompt: String::new(),
        ..TrainConfig::default()
    };
    println!(
        "GPT {layers} layers x width 128, sequence 128, micro-batch 4 rows; pp {pp}, m {m}; \
         peak bytes of a step above its start, summed over the {pp} thread ranks"
    );
    println!(
        "{:<8} {:>13} {:>14} {:>24} {:>20}",
        "schedule", "recompute", "step peak MiB", "held per stage (runtime)", "theory"
    );
    let mut by_kind = Vec::new();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for recompute in [Recompute::Off, Recompute::Stages, Recompute::Blocks] {
            let layout = Layout {
                pp,
                pipeline: PipelineLayout {
                    schedule: kind,
                    virtual_stages: None,
                    recompute,
                },
                ..Layout::default()
            };
            let (peak, held) = measure(&config, &layout, &corpus)?;
            let theory: Vec<usize> = (0..pp)
                .map(|r| match kind {
                    ScheduleKind::GPipe => m,
                    _ => (pp - r).min(m),
                })
                .collect();
            println!(
                "{:<8} {:>13} {:>14.1} {:>24} {:>20}",
                kind.to_string(),
                format!("{recompute:?}").to_lowercase(),
                peak as f64 / (1 << 20) as f64,
                format!("{held:?}"),
                format!("{theory:?}")
            );
            by_kind.push(peak);
        }
    }
    if let [
        gpipe,
        gpipe_stages,
        gpipe_blocks,
        ofob,
        ofob_stages,
        ofob_blocks,
    ] = by_kind[..]
    {
        let saved = |a: usize, b: usize| 100.0 * (1.0 - a as f64 / b.max(1) as f64);
        println!(
            "1F1B / GPipe: {:.2}; recomputing stages saves {:.0}% (GPipe) and {:.0}% (1F1B), \
             blocks {:.0}% and {:.0}%",
            ofob as f64 / gpipe.max(1) as f64,
            saved(gpipe_stages, gpipe),
            saved(ofob_stages, ofob),
            saved(gpipe_blocks, gpipe),
            saved(ofob_blocks, ofob)
        );
    }
    Ok(())
}
