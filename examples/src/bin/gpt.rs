//! Trains the reference GPT on the bundled King James Bible, byte-level, under any layout:
//! data parallelism, ZeRO-1/2/3 (FSDP), hybrid sharding, tensor + sequence parallelism, and
//! their combinations, on Flex or (with `--features wgpu`) WGPU.
//!
//! ```text
//! cargo run --release -p examples --bin gpt                          # 2 thread ranks
//! cargo run --release -p examples --bin gpt -- --ranks 1 --steps 50  # single device
//! burnrun --nproc-per-node 2 -- target/release/gpt --backend tcp     # 2 processes
//! burnrun --nproc-per-node 2 -- target/release/gpt --device cuda --backend nccl  # 2 GPUs
//! gpt --config run.toml --steps 100                                  # TOML, then flags
//! gpt --ranks 4 --tp 2 --sp                                          # dp 2 x tp 2, seq. parallel
//! gpt --ranks 4 --zero 3 --tp 2 --sp --clip 1.0                      # FSDP 2 x tp 2, clipped
//! burnrun --nproc-per-node 2 -- target/release/gpt --backend tcp --tp 2
//! gpt --ranks 4 --cp 2 --cp-kind ring --cp-balance headtail       # dp 2 x cp 2, ring attention
//! gpt --ranks 4 --moe-experts 8 --top-k 2 --ep 2 --dropless        # GPT-MoE, dp 4 with ep 2
//! gpt --moe-experts 8 --moe-every 2 --capacity-factor 1.25 --aux-loss 0.01 --z-loss 0.001
//! gpt --ranks 4 --tp 2 --save ckpt --save-every 100             # distributed checkpoints
//! gpt --ranks 4 --zero 3 --resume ckpt                           # resume under another layout
//! ```

use std::process::ExitCode;

use burn_moe::Capacity;
use burn_parallel::mfu::Mfu;
use burn_parallel::{CollectiveError, ProcessGroup};
use burn_parallel_train::Layout;
use burn_parallel_train::StopFlag;
use burn_parallel_train::cli::{MetricsArgs, moe_lines, profile_lines, stop_on_signals};
use burn_parallel_train::pipeline::bubble_summary;
use clap::Parser;
use examples::cli::{Backend, GptArgs, config_from, print_error, train_device};
use examples::data::Corpus;
use examples::pipeline::StageSplit;
use examples::run::{GptRun, check_run, train_gpt_under};
use examples::train::{Parallelism, StepPhases, StepStats, TrainConfig, TrainReport};

/// The world of a multi-process backend (`tcp`, `nccl` over it, or `mpi`).
fn process_world(backend: Backend) -> Result<ProcessGroup, CollectiveError> {
    match backend {
        Backend::Nccl => burn_parallel::nccl::init_from_env(),
        Backend::Mpi => burn_parallel::world::init_mpi(),
        Backend::Tcp | Backend::Local => burn_parallel::init_from_env(),
    }
}

/// Runs one rank under any layout and returns group rank 0's report; only rank 0 prints
/// (every rank its ZeRO/FSDP memory, in rank order).
fn run_rank(
    group: &ProcessGroup,
    run: &Run<'_>,
    log: &Logging,
) -> Result<Option<GptRun>, burn_parallel::Error> {
    let Run {
        config,
        layout,
        split,
        corpus,
    } = *run;
    let (log_every, profile) = (log.every, log.profile);
    let mfu = log.mfu(config, group.size());
    let lead = group.rank() == 0;
    if lead {
        let kernels = match config.model.fused {
            true => "fused",
            false => "composed (--unfused)",
        };
        let threads = burn_parallel::threads::describe();
        println!("kernels: {kernels}, {threads} intra-op threads per rank");
        println!("{}", log.describe(config));
        print_header(config, group.size(), group.backend(), corpus, layout);
    }
    let mut phases = StepPhases::default();
    let progress = log.metrics.progress(lead, config.steps, log_every)?;
    let progress = progress.with_mfu(mfu);
    let mut on_step = |s: &StepStats| {
        if s.log.step > 0 {
            phases.add(&s.log.phases);
        }
        progress.step(&s.log, &moe_lines(&s.moe));
    };
    let host_bytes = burn_parallel::group::host_bytes_sent();
    let report = train_gpt_under(group, config, (layout, split), corpus, &mut on_step);
    progress.finish();
    let report = report?;
    let train = report.train();
    progress.conclude(&[("val_loss", train.val_loss)])?;
    if profile && lead {
        let steps = config.steps.saturating_sub(1);
        for line in profile_lines(&phases, train.step_seconds, steps) {
            println!("{line}");
        }
        // Thread ranks share the process's counter: per rank, the mean.
        let local_ranks = match group.backend() {
            "local" => group.size(),
            _ => 1,
        };
        let sent = burn_parallel::group::host_bytes_sent() - host_bytes;
        println!(
            "  host transport           {:>8.3} MB/step per rank handed to host collectives \
             (training and evaluation)",
            sent as f64 / 1e6 / config.steps.max(1) as f64 / local_ranks as f64
        );
    }
    // ZeRO and FSDP: every rank prints its memory (shards, gradients, optimizer state, gathered
    // units), in rank order.
    if let Some(memory) = train.memory.as_ref().filter(|_| !layout.fault_tolerant) {
        for r in 0..group.size() {
            if r == group.rank() {
                println!("[rank {r}] zero memory: {}", memory.summary());
            }
            group.barrier()?;
        }
    }
    // DiLoCo: the outer syncs' stall and every rank's bytes (gathered unless islands may be
    // lost).
    if let (GptRun::DiLoCo(d), Some(layout)) = (&report, layout.diloco) {
        let drop_lost = layout.config.drop_lost_islands;
        for line in d.figures.summary(group, d.train.step_seconds, drop_lost)? {
            if lead {
                println!("{line}");
            }
        }
    }
    Ok(lead.then_some(report))
}

/// What every rank of a run trains: the settings, the layout and the data.
#[derive(Clone, Copy)]
struct Run<'a> {
    config: &'a TrainConfig,
    layout: &'a Layout,
    split: &'a StageSplit,
    corpus: &'a Corpus,
}

fn main() -> ExitCode {
    let args = GptArgs::parse();
    match args.threads {
        Some(0) => {
            eprintln!("error: --threads must be at least 1");
            return ExitCode::from(2);
        }
        Some(n) => burn_parallel::threads::set_intra_op_threads(Some(n)),
        None => {}
    }
    burn_parallel::kernels::allow_tf32(args.tf32);
    let Ok(mut config) = config_from(&args).map_err(print_error) else {
        return ExitCode::from(2);
    };
    if let Some(dir) = &args.init_from_hf {
        let m = &config.model;
        let (layers, width, heads, vocab) = (m.n_layers, m.d_model, m.n_heads, m.vocab_size);
        let from = dir.join("config.json");
        println!(
            "model from {}: {layers} layers, d_model {width}, {heads} heads, vocabulary {vocab}",
            from.display()
        );
    }
    let corpus = Corpus::load_from(args.data_dir.as_deref()).and_then(|corpus| {
        corpus.check_windows(config.seq_len, config.eval_batches)?;
        Ok(corpus)
    });
    let Ok(corpus) = corpus.map_err(print_error) else {
        return ExitCode::from(2);
    };
    let Ok(mut layout) = args.layout().map_err(print_error) else {
        return ExitCode::from(2);
    };
    layout.diloco = args.diloco.layout();
    config.device = train_device(&args);
    config.stop = Some(StopFlag(stop_on_signals()));
    let log = Logging::new(&args);
    let split = args.pipeline.split();
    let run = Run {
        config: &config,
        layout: &layout,
        split: &split,
        corpus: &corpus,
    };
    let outcome = match args.backend {
        Backend::Local => {
            // Thread ranks share this process's memory.
            if let Err(e) = check_run(&config, &layout, &split, args.ranks, args.ranks) {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
            burn_parallel_train::run_local(args.ranks, |group| run_rank(&group, &run, &log))
                .map(|mut reports| reports.swap_remove(0))
        }
        // Over TCP the world size is known once the world is formed: every rank checks then,
        // before the banner (which counts the parameters) and any allocation.
        Backend::Tcp | Backend::Nccl | Backend::Mpi => on_world(args.backend, |group| {
            check_run(&config, &layout, &split, group.size(), 1)?;
            run_rank(&group, &run, &log)
        }),
    };
    match outcome {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(report)) => {
            print_report(report.train(), &corpus);
            let done = report.train().losses.len();
            if done < config.steps {
                let saved = config.save.as_ref().map(|p| p.dir.display().to_string());
                let resume = saved.map_or(String::new(), |d| format!(": saved, --resume {d}"));
                println!(
                    "stopped by a signal after step {done} of {}{resume}",
                    config.steps
                );
            }
            if let GptRun::Pipeline(p) = &report {
                println!("blocks per stage: {:?}", p.split);
                println!(
                    "{}",
                    bubble_summary(&layout, config.grad_accum, &p.timeline)
                );
                if let Some(path) = &args.pipeline.trace {
                    if let Err(e) = std::fs::write(path, p.timeline.chrome_trace(1e6)) {
                        eprintln!("error: writing the trace to {}: {e}", path.display());
                        return ExitCode::FAILURE;
                    }
                    println!("trace of the last step written to {}", path.display());
                }
            }
            let train = report.train();
            write_outputs(&args, &train.losses, &train.final_params)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `run` on this process's rank of a process-per-rank backend (`tcp`, `nccl`, `mpi`). On MPI a
/// failed rank aborts the job (`MPI_Abort`), since MPI cannot tell the others to stop waiting.
fn on_world<T>(
    backend: Backend,
    run: impl FnOnce(ProcessGroup) -> Result<T, burn_parallel::Error>,
) -> Result<T, burn_parallel::Error> {
    let world = process_world(backend)?;
    let keep = (backend == Backend::Mpi).then(|| world.clone());
    let outcome = run(world);
    if let (Some(world), Err(e)) = (keep, &outcome) {
        world.abort(&format!("error: {e}"));
    }
    outcome
}

/// What the log lines show: every how many steps, the profile, and MFU's peak.
struct Logging {
    every: usize,
    profile: bool,
    metrics: MetricsArgs,
    /// Peak FLOP/s of one device, and where it came from (or why there is none).
    peak: (Option<f64>, String),
}

impl Logging {
    fn new(args: &GptArgs) -> Self {
        Self {
            every: args.log_every,
            profile: args.profile,
            metrics: args.metrics.clone(),
            peak: device_peak(args),
        }
    }

    /// MFU of `config` over `devices` ranks.
    fn mfu(&self, config: &TrainConfig, devices: usize) -> Mfu {
        let shape = config.model.planner_shape();
        Mfu {
            flops_per_token: shape.train_flops_per_token(config.seq_len),
            peak_per_device: self.peak.0,
            devices,
        }
    }

    /// The line describing the MFU figures.
    fn describe(&self, config: &TrainConfig) -> String {
        let per_token = self.mfu(config, 1).flops_per_token;
        let peak = match self.peak.0 {
            Some(p) => format!("{:.1} TFLOP/s per device ({})", p / 1e12, self.peak.1),
            None => format!("no peak, no MFU ({})", self.peak.1),
        };
        format!(
            "model FLOPs: {:.2} MFLOP/token (6 x matmul weights + 12 x layers x seq x width); \
             {peak}",
            per_token / 1e6
        )
    }
}

/// The peak FLOP/s of one device: `--peak-tflops`, or the data sheet of the CUDA device the
/// driver names, for the arithmetic of `--precision`; or why there is none.
fn device_peak(args: &GptArgs) -> (Option<f64>, String) {
    if let Some(t) = args.peak_tflops {
        return (Some(t * 1e12), "--peak-tflops".into());
    }
    let math = args.precision.unwrap_or_default().math(args.tf32);
    match train_device(args).peak_flops(math) {
        Ok((peak, source)) => (Some(peak), source),
        Err(why) => (None, why),
    }
}

fn print_header(
    config: &TrainConfig,
    ranks: usize,
    backend: &str,
    corpus: &Corpus,
    parallel: &Parallelism,
) {
    let m = &config.model;
    let layout = format!(" = {}", parallel.describe(ranks));
    println!(
        "GPT {} layers x {} heads x width {} ({:.2}M params), {} ranks{layout} ({backend}), \
         global batch {} x {} tokens, {} steps",
        m.n_layers,
        m.n_heads,
        m.d_model,
        m.num_params() as f64 / 1e6,
        ranks,
        config.batch_size,
        config.seq_len,
        config.steps
    );
    if let Some(moe) = &m.moe {
        let capacity = match moe.capacity {
            Capacity::Dropless => "dropless".to_string(),
            Capacity::Factor { factor, drop } => format!("capacity factor {factor} ({drop:?})"),
        };
        println!(
            "MoE: {} of {} blocks, {} experts of width {}, top-{}, ep {}, {capacity}, aux loss \
             {}, z-loss {}, bias balancing {}; {:.2}M active params per token",
            m.n_moe_blocks(),
            m.n_layers,
            moe.n_experts,
            moe.d_ff,
            moe.top_k,
            parallel.ep,
            moe.aux_loss,
            moe.z_loss,
            moe.bias_update_rate,
            m.active_params() as f64 / 1e6
        );
    }
    if let Some(d) = parallel.diloco {
        println!("{}", d.summary(ranks));
    }
    println!(
        "corpus: {}, {} training bytes, unigram entropy {:.3} nats/byte",
        corpus.name(),
        corpus.split(examples::data::Split::Train).len(),
        corpus.unigram_entropy_nats()
    );
}

fn print_report(report: &TrainReport, corpus: &Corpus) {
    let speed = match report.step_seconds {
        0.0 => "no step timed (the first step is warm-up)".to_string(),
        s => format!("{s:.3} s/step, {:.0} tokens/s", report.tokens_per_sec),
    };
    println!(
        "final train loss {:.4}, validation loss {:.4} nats/byte (unigram entropy {:.3}), \
         {speed}",
        report.losses.last().copied().unwrap_or(f64::NAN),
        report.val_loss,
        corpus.unigram_entropy_nats(),
    );
    if report.skipped_steps > 0 || report.loss_scale != 1.0 {
        println!(
            "loss scaling: {} steps skipped (overflow), final loss scale {}",
            report.skipped_steps, report.loss_scale
        );
    }
    println!("sample:\n{}", report.sample);
}

/// `--losses-out` and `--params-out`: the per-step losses as a JSON list, then the trained
/// parameters (path, shape, values) as JSON.
fn write_outputs(
    args: &GptArgs,
    losses: &[f64],
    params: &[examples::train::NamedParam],
) -> ExitCode {
    let files: [(_, &dyn Fn() -> String); 2] = [
        (args.losses_out.as_deref(), &|| {
            serde_json::to_string(losses).expect("json")
        }),
        (args.params_out.as_deref(), &|| {
            serde_json::to_string(params).expect("json")
        }),
    ];
    for (path, json) in files {
        if let Some(path) = path
            && let Err(e) = std::fs::write(path, json())
        {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
