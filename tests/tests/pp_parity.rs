//! Pipeline parallelism reproduces single-device training: the bundled GPT (8 blocks) under
//! GPipe, 1F1B, interleaved 1F1B (v = 2), ZB-H1 and ZBV, at pp 2 and pp 4 with 4 and 8
//! micro-batches, and pp 2 x dp 2, gives over 20 steps the losses of the independent
//! plain-Burn [`tests::reference_run`] on the same global batch (relative difference <= 1e-5)
//! and its final parameters; so does `gpt --pp 2 --schedule zbv` as 2 TCP processes through
//! `burnrun`; so do global-norm clipping, activation checkpointing, tied embeddings across
//! stages, ZeRO-1/2 per stage, and pp x tp (x dp). Also: stages built from the seed hold exactly the single-device
//! initial values and only their own parameters, every split policy trains the same model, and
//! impossible settings are typed errors before anything runs.

use burn::tensor::Device;
use burn_parallel::init::Init;
use burn_parallel::run_local;
use burn_parallel_train::pipeline::{Balance, measure_layer_times, split_layers};
use burn_parallel_train::{Layout, PipelineLayout};
use burn_pipeline::ScheduleKind;
use burn_pipeline::partition::PartitionError;
use examples::data::Corpus;
use examples::gpt::Gpt;
use examples::pipeline::{
    Recompute, StageSplit, StagedGpt, build_stage, check_pipeline, stage_params,
    train_gpt_pipeline, with_deferred_weights,
};
use examples::train::{TrainConfig, TrainReport, named_params};
use tests::{
    Reference, assert_matches_reference, gpt_through_burnrun, params_of, reference_run,
    tiny_gpt_run,
};

const STEPS: usize = 20;
const TOL: f64 = 1e-5;

/// The tiny GPT with 8 blocks, so that 8 stages (pp 4 x 2 virtual stages) hold one each.
fn config() -> TrainConfig {
    let mut c = tiny_gpt_run(STEPS);
    c.model.n_layers = 8;
    c
}

/// A pipelined run: the layout's pipeline settings, the micro-batches (the run's
/// `grad_accum`) and the split.
#[derive(Debug, Clone)]
struct Pp {
    pp: usize,
    schedule: ScheduleKind,
    microbatches: usize,
    virtual_stages: Option<usize>,
    split: StageSplit,
    tp: usize,
    sp: bool,
    zero: Option<burn_zero::Stage>,
    recompute: Recompute,
}

impl Default for Pp {
    fn default() -> Self {
        Self {
            pp: 2,
            schedule: ScheduleKind::OneFOneB,
            microbatches: 4,
            virtual_stages: None,
            split: StageSplit::default(),
            tp: 1,
            sp: false,
            zero: None,
            recompute: Recompute::Off,
        }
    }
}

impl Pp {
    fn layout(&self) -> Layout {
        Layout {
            pp: self.pp,
            tp: self.tp,
            sp: self.sp,
            zero: self.zero,
            pipeline: PipelineLayout {
                schedule: self.schedule,
                virtual_stages: self.virtual_stages,
                recompute: self.recompute,
            },
            ..Layout::default()
        }
    }

    /// `config` with the micro-batches as its accumulation.
    fn config(&self, config: &TrainConfig) -> TrainConfig {
        TrainConfig {
            grad_accum: self.microbatches,
            ..config.clone()
        }
    }

    fn validate(&self, config: &TrainConfig, world: usize) -> Result<(), burn_parallel::Error> {
        check_pipeline(&self.config(config), &self.layout(), &self.split, world)
    }

    /// Trains on the thread rank of `g`.
    fn train(
        &self,
        g: &burn_parallel::ProcessGroup,
        config: &TrainConfig,
    ) -> Result<examples::pipeline::PipelineReport, burn_parallel::Error> {
        let corpus = Corpus::load_default().expect("the bundled corpus");
        let config = self.config(config);
        train_gpt_pipeline(
            g,
            &config,
            &self.layout(),
            &self.split,
            &corpus,
            &mut |_| {},
        )
    }
}

fn pipeline(kind: &str, pp: usize, microbatches: usize) -> Pp {
    let schedule: ScheduleKind = kind.parse().expect("a schedule name");
    Pp {
        pp,
        schedule,
        microbatches,
        virtual_stages: (schedule == ScheduleKind::Interleaved1F1B).then_some(2),
        ..Pp::default()
    }
}

/// Runs `p` on `world` thread ranks; rank 0's report (every rank reports the same).
fn run(world: usize, p: &Pp, config: &TrainConfig) -> TrainReport {
    let reports = burn_parallel_train::run_local(world, |g| p.train(&g, config))
        .unwrap_or_else(|e| panic!("{p:?} on {world} ranks: {e}"));
    tests::rank0_if_ranks_agree(reports, |r| (&r.train.losses, &r.train.final_params)).train
}

fn check(reference: &Reference, world: usize, p: Pp, config: &TrainConfig) {
    let what = format!(
        "{} pp {} x dp {} x tp {}{} m {}",
        p.schedule,
        p.pp,
        world / (p.pp * p.tp),
        p.tp,
        if p.sp { " (sp)" } else { "" },
        p.microbatches
    );
    let r = run(world, &p, config);
    assert_matches_reference(reference, &r.losses, &r.final_params, TOL, &what);
}

fn check_schedule(kind: &str) {
    let config = config();
    let reference = reference_run(&config);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0] - 0.5,
        "the model must learn: {:?}",
        reference.losses
    );
    check(&reference, 2, pipeline(kind, 2, 4), &config);
    check(&reference, 4, pipeline(kind, 4, 4), &config);
    check(&reference, 4, pipeline(kind, 4, 8), &config);
}

#[test]
fn gpipe_matches_single_device() {
    check_schedule("gpipe");
}

#[test]
fn one_f_one_b_matches_single_device() {
    check_schedule("1f1b");
}

#[test]
fn interleaved_1f1b_matches_single_device() {
    check_schedule("interleaved");
}

#[test]
fn zb_h1_matches_single_device() {
    check_schedule("zb-h1");
}

#[test]
fn zbv_matches_single_device() {
    check_schedule("zbv");
}

/// DualPipeV (m >= 2p): pp 2 and 4, and pp 2 x dp 2; the GPT's linears defer their weight
/// gradients to its `W`s.
#[test]
fn dualpipev_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    check(&reference, 2, pipeline("dualpipev", 2, 4), &config);
    check(&reference, 4, pipeline("dualpipev", 4, 8), &config);
    check(&reference, 4, pipeline("dualpipev", 2, 4), &config);
}

#[test]
fn pp2_x_dp2_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    check(&reference, 4, pipeline("1f1b", 2, 2), &config);
    check(&reference, 4, pipeline("zbv", 2, 4), &config);
}

/// Tensor (and sequence) parallelism inside the stages: pp 2 x tp 2, and pp 2 x dp 2 x tp 2
/// in one mesh of 8 ranks, with clipping (the norm counts tp shards once per shard).
#[test]
fn pp_x_tp_matches_single_device() {
    let mut config = config();
    config.steps = 10;
    let reference = reference_run(&config);
    let tp = |p: Pp, sp: bool| Pp { tp: 2, sp, ..p };
    check(&reference, 4, tp(pipeline("1f1b", 2, 4), false), &config);
    check(&reference, 4, tp(pipeline("zbv", 2, 4), true), &config);
    config.max_grad_norm = Some(0.05);
    let clipped = reference_run(&config);
    check(
        &clipped,
        8,
        tp(pipeline("interleaved", 2, 4), true),
        &config,
    );

    // Each rank holds its half of its stage's split layers.
    config.steps = 1;
    let held = |p: Pp, world: usize| {
        run_local(world, |g| Ok(p.train(&g, &config).unwrap().held_params)).unwrap()
    };
    let whole = held(pipeline("1f1b", 2, 4), 2);
    let split = held(tp(pipeline("1f1b", 2, 4), false), 4);
    // Mesh [pp, dp, tp]: ranks 0, 1 hold stage 0; ranks 2, 3 stage 1.
    for (rank, &h) in split.iter().enumerate() {
        let stage = whole[rank / 2];
        assert!(
            h < stage * 6 / 10 && h > stage * 4 / 10,
            "rank {rank} holds {h} of its stage's {stage} parameters"
        );
    }
}

/// A token table tied to the head: the first and the last stage each hold a copy, and their
/// gradients are summed before either steps: on two ranks (1F1B, interleaved with clipping,
/// where the norm counts the table once) and on one rank (ZBV's V puts both ends on rank 0).
#[test]
fn tied_embeddings_across_stages_match_single_device() {
    let mut config = config();
    config.steps = 10;
    config.model.tied_embeddings = true;
    let reference = reference_run(&config);
    check(&reference, 2, pipeline("1f1b", 2, 4), &config);
    check(&reference, 2, pipeline("zbv", 2, 4), &config);
    let tp = Pp {
        tp: 2,
        sp: true,
        ..pipeline("1f1b", 2, 4)
    };
    check(&reference, 4, tp, &config);
    config.max_grad_norm = Some(0.05);
    let clipped = reference_run(&config);
    check(&clipped, 4, pipeline("interleaved", 4, 4), &config);
}

/// ZeRO-1 and ZeRO-2 over each stage's data-parallel replicas (pp 2 x dp 2), and with tensor
/// parallelism inside the stages (pp 2 x dp 2 x tp 2); and with global-norm clipping and a
/// tied token table.
#[test]
fn pp_x_zero_matches_single_device() {
    let mut config = config();
    config.steps = 10;
    let reference = reference_run(&config);
    let zero = |p: Pp, n: usize| Pp {
        zero: Some(burn_zero::Stage::from_number(n).unwrap()),
        ..p
    };
    check(&reference, 4, zero(pipeline("1f1b", 2, 2), 1), &config);
    check(&reference, 4, zero(pipeline("zbv", 2, 4), 2), &config);
    let tp = Pp {
        tp: 2,
        ..pipeline("gpipe", 2, 2)
    };
    check(&reference, 8, zero(tp.clone(), 2), &config);

    // Clipped by the norm over every stage: each ZeRO stage gives the squares of its reduced
    // gradients, the tied table counted once (its copies on two ranks under 1F1B, on one
    // under ZBV), tensor-parallel shards once per shard.
    config.max_grad_norm = Some(0.05);
    config.model.tied_embeddings = true;
    let clipped = reference_run(&config);
    check(&clipped, 4, zero(pipeline("1f1b", 2, 2), 2), &config);
    check(&clipped, 4, zero(pipeline("zbv", 2, 4), 1), &config);
    check(&clipped, 8, zero(tp, 1), &config);
}

/// Global-norm clipping (the norm summed over the stages before any stage steps) and
/// activation checkpointing (every stage's, or every block's, forward recomputed in its
/// backward) give the single-device run, alone and together, with data parallelism and in V order; the last
/// step's timeline has one track per rank holding that rank's whole program.
#[test]
fn clipping_and_activation_checkpointing_match_single_device() {
    let mut config = config();
    config.steps = 10;
    let plain = reference_run(&config);
    let recompute = |p: Pp| Pp {
        recompute: Recompute::Stages,
        ..p
    };
    let blocks = |p: Pp| Pp {
        recompute: Recompute::Blocks,
        ..p
    };
    check(&plain, 4, recompute(pipeline("gpipe", 4, 8)), &config);
    check(&plain, 4, recompute(pipeline("zb-h1", 2, 4)), &config);
    check(&plain, 2, blocks(pipeline("1f1b", 2, 4)), &config);
    // The blocks' gradients arrive at `W` under a split backward; with tensor parallelism.
    let tp = Pp {
        tp: 2,
        sp: true,
        ..pipeline("zbv", 2, 4)
    };
    check(&plain, 4, blocks(tp), &config);
    // A norm well below the gradients' so that every step clips.
    config.max_grad_norm = Some(0.05);
    let clipped = reference_run(&config);
    assert_ne!(
        plain.losses[9], clipped.losses[9],
        "clipping must change the run"
    );
    check(&clipped, 2, pipeline("1f1b", 2, 4), &config);
    check(&clipped, 4, recompute(pipeline("zbv", 2, 4)), &config);

    let p = pipeline("1f1b", 2, 4);
    let timelines = run_local(4, |g| {
        let r = p.train(&g, &config).unwrap();
        Ok(r.timeline)
    })
    .unwrap();
    let schedule = burn_pipeline::generators::generate(p.schedule, 2, 4, None).unwrap();
    for timeline in &timelines {
        let names: Vec<&str> = timeline.tracks.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            ["pp 0 / dp 0", "pp 0 / dp 1", "pp 1 / dp 0", "pp 1 / dp 1"]
        );
        for (track, pp) in timeline.tracks.iter().zip([0, 0, 1, 1]) {
            let actions: Vec<_> = track.spans.iter().map(|s| s.action).collect();
            assert_eq!(actions, schedule.program(pp), "{}", track.name);
        }
        let bubble = timeline.bubble_fraction();
        assert!((0.0..1.0).contains(&bubble), "bubble {bubble}");
    }
}

/// The `gpt` binary's flags, as 2 TCP processes through `burnrun`: ZBV (V order, both ends of
/// the model on rank 0) over real sockets.
#[test]
fn zbv_over_two_tcp_processes_matches_single_device() {
    let config = config();
    let reference = reference_run(&config);
    let run = gpt_through_burnrun(
        2,
        &config,
        &["--pp", "2", "--schedule", "zbv", "--microbatches", "4"],
    );
    assert_matches_reference(
        &reference,
        &run.losses,
        &run.params,
        TOL,
        "gpt --pp 2 --schedule zbv over TCP",
    );
}

#[test]
fn every_split_policy_trains_the_same_model() {
    let mut config = config();
    config.steps = 5;
    let reference = reference_run(&config);
    for split in [
        Balance::Params.into(),
        Balance::Explicit(vec![1, 6, 7]).into(),
        StageSplit::Measured,
    ] {
        let p = Pp {
            split: split.clone(),
            ..pipeline("1f1b", 4, 4)
        };
        let r = run(4, &p, &config);
        assert_matches_reference(
            &reference,
            &r.losses,
            &r.final_params,
            TOL,
            &format!("{split:?}"),
        );
    }
}

/// A head far heavier than a block (a 16k vocabulary on a width of 32) measures so, and the
/// time-balanced split leaves the last stage a single block.
#[test]
fn measured_times_give_a_heavy_head_fewer_blocks() {
    let mut model = config().model;
    model.vocab_size = 16384;
    model.d_model = 32;
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let batch = corpus.batch_rows(0, 0..4, 16, examples::data::Split::Train);
    let device = Device::flex().autodiff();
    let model = StagedGpt {
        config: model,
        balance: Balance::Count,
    };
    let t = measure_layer_times(&model, &batch, &device, 3).unwrap();
    assert!(t.last > 2.0 * t.layer, "{t:?}");
    let split = split_layers(&model, 4, &Balance::Times(t), &device).unwrap();
    // By count every stage takes 2 of the 8 blocks; the heavy head keeps the last stage at 1.
    assert_eq!(split[3].len(), 1, "{split:?} from {t:?}");
}

/// Under a split backward the GPT's linear layers defer their weight gradients: a backward
/// gives the input gradient and the norms' and biases' gradients but no linear weight's, and the
/// stage's store computes exactly those at `W`.
#[test]
fn zero_bubble_schedules_defer_the_gpt_weight_gradients() {
    use burn_pipeline::stage::{Boundary, Stage, StageOutput};
    let config = config().model;
    let device = Device::flex().autodiff();
    let init = Init::new(config.seed, &device);
    let stage = with_deferred_weights(build_stage(&config, &init, 1, 2, 4..8, 0).unwrap(), true);
    let store = stage.deferred_weights().unwrap().clone();
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let batch = corpus.batch_rows(0, 0..2, 16, examples::data::Split::Train);
    let x = burn::tensor::Tensor::<3>::ones([2, 16, config.d_model], &device).require_grad();
    let StageOutput::Loss(loss) = stage
        .forward(Boundary::new().with(x.clone()), &batch)
        .unwrap()
    else {
        panic!("the last stage returns the loss")
    };
    store.begin(0);
    let mut grads = loss.backward();
    assert!(
        x.grad_remove(&mut grads).is_some(),
        "the input gradient comes at once"
    );
    let now = burn::optim::GradientsParams::from_grads(grads, &stage);
    let head = stage.output.as_ref().unwrap().lm_head.as_ref().unwrap();
    let block = &stage.layers[0].block;
    let q = &block.attn.q;
    assert!(now.get::<2>(q.weight.id).is_none() && now.get::<2>(head.weight.id).is_none());
    assert!(now.get::<1>(block.ln_1.weight.id).is_some());
    // 4 blocks x (q, k, v, o, up, down) + the head.
    assert_eq!(store.pending(0), 4 * 6 + 1);
    let later = store.take(0, &stage);
    assert!(later.get::<2>(q.weight.id).is_some() && later.get::<2>(head.weight.id).is_some());
    assert_eq!(store.pending(0), 0);
}

#[test]
fn stages_hold_their_single_device_parameters_and_nothing_else() {
    let config = config().model;
    let device = Device::flex();
    let whole = params_of(&Gpt::new(&config, &device));
    let init = Init::new(config.seed, &device);
    let staged = StagedGpt {
        config: config.clone(),
        balance: Balance::Count,
    };
    let split = split_layers(&staged, 3, &Balance::Count, &device).unwrap();
    assert_eq!(split, vec![0..3, 3..6, 6..8]);
    let mut seen = 0;
    for (s, layers) in split.into_iter().enumerate() {
        let stage = build_stage(&config, &init, s, 3, layers.clone(), 0).unwrap();
        let params = stage_params(&stage, &init.context()).unwrap();
        for p in &params {
            let (shape, values) = &whole[&p.path];
            assert_eq!((&p.shape, &p.values), (shape, values), "{}", p.path);
            if let Some(rest) = p.path.strip_prefix("blocks.") {
                let block: usize = rest.split('.').next().unwrap().parse().unwrap();
                assert!(layers.contains(&block), "stage {s} holds {}", p.path);
            }
        }
        // Local paths are renamed, not duplicated.
        assert_eq!(params.len(), named_params(&stage).len());
        seen += params.len();
    }
    assert_eq!(seen, whole.len(), "every parameter on exactly one stage");
}

/// The same worst relative loss difference of bf16 against fp32 as `gpt_parity`'s
/// `BF16_LOSS_TOL`, and a worst parameter difference of 1e-2 (AdamW moves a weight by at most
/// about lr per step; bf16 keeps 8 bits of mantissa).
const BF16_LOSS_TOL: f64 = 2e-3;
const BF16_PARAM_TOL: f64 = 1e-2;

/// `gpt --pp --precision bf16|fp16`: each stage computes on its compute copy (the boundary
/// tensors travel in the compute dtype), fp32 master weights and AdamW state, gradients
/// reduced in the compute dtype; under fp16 the loss scale seeds every backward and a step
/// that overflowed on any stage is skipped on all of them.
/// - Against the single device in the same precision on the same micro-batches (`grad_accum`
///   = micro-batches), with the same steps skipped and the same final loss scale: 1F1B at pp 2
///   and whole-stage activation checkpointing do the same operations in the same order
///   (measured: parameters bit for bit, losses 1.2e-7), so within [`TOL`]; ZBV at pp 2 (its
///   linears' weight gradients computed from compute-dtype pairs in one product, where
///   autodiff sums per-sequence products in the compute dtype) and pp 2 x tp 2 + SP (partial
///   sums reduced in the compute dtype) round differently (measured bf16: losses 3.5e-4 and
///   2.9e-4, parameters 2.2e-3 and 6.0e-3; fp16: 1.8e-5 / 9.6e-4, 1.8e-5 / 1.9e-3), so within
///   [`BF16_LOSS_TOL`] / [`BF16_PARAM_TOL`]; so does 1F1B with tied embeddings (each copy's
///   gradient cast to fp32 and summed over the pair of ranks, where one device sums the two
///   uses in the compute dtype) clipped at 0.5 after the unscaling (bf16 2.2e-4 / 4.6e-4, fp16
///   1.9e-5 / 4.9e-5).
/// - bf16 against fp32, at pp 2, pp 2 x dp 2 (gradients averaged in bf16) and pp 2 x dp 2 with
///   ZeRO-2 per stage (fp32 shards; the stages' compute copies in bf16): within the same
///   tolerances (measured: losses 9.2e-4, 8.6e-4, 9.2e-4; parameters 6.1e-3 each).
#[test]
fn mixed_precision_pipelines_match_the_single_device_in_that_precision() {
    use examples::train::{Parallelism, Precision};
    let within = |what: &str, r: &TrainReport, reference: &Reference| {
        let err = tests::max_relative_loss_diff(&r.losses, &reference.losses);
        let (param_err, path) =
            tests::compare_params(&reference.params, &r.final_params, BF16_PARAM_TOL)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        println!("{what}: losses {err:.2e}, parameters {param_err:.2e} at {path}");
        assert!(
            err < BF16_LOSS_TOL,
            "{what}: losses {err:.2e}: {:?}",
            r.losses
        );
        err
    };
    let fp32 = reference_run(&config());
    for precision in [Precision::Bf16, Precision::Fp16] {
        let mixed = TrainConfig {
            precision,
            ..config()
        };
        let single = tests::train_layout(
            1,
            &Parallelism::default(),
            &TrainConfig {
                grad_accum: 4,
                ..mixed.clone()
            },
        );
        assert!(
            single.losses[STEPS - 1] < single.losses[0] - 0.5,
            "{precision}: the model must learn: {:?}",
            single.losses
        );
        if precision == Precision::Fp16 {
            assert!(
                single.skipped_steps > 0,
                "fp16 from 2^16 skips its first step(s)"
            );
        }
        let same = Reference::of_run(single.clone());
        let tp_sp = Pp {
            tp: 2,
            sp: true,
            ..pipeline("1f1b", 2, 4)
        };
        let recompute = Pp {
            recompute: Recompute::Stages,
            ..pipeline("1f1b", 2, 4)
        };
        for (world, p, same_order) in [
            (2, pipeline("1f1b", 2, 4), true),
            (2, recompute, true),
            (2, pipeline("zbv", 2, 4), false),
            (4, tp_sp, false),
        ] {
            let what = format!(
                "{precision} {} pp {} x tp {} (recompute {:?}) against the single device in \
                 {precision}",
                p.schedule, p.pp, p.tp, p.recompute
            );
            let r = run(world, &p, &mixed);
            assert_eq!(
                r.skipped_steps, single.skipped_steps,
                "{what}: skipped steps"
            );
            assert_eq!(r.loss_scale, single.loss_scale, "{what}: final loss scale");
            match same_order {
                true => assert_matches_reference(&same, &r.losses, &r.final_params, TOL, &what),
                false => {
                    within(&what, &r, &same);
                }
            }
        }
        // Tied embeddings (the two copies' unscaled gradients summed over the pair of ranks)
        // and clipping by the norm over both stages, after the unscaling.
        let mut tied = TrainConfig {
            max_grad_norm: Some(0.5),
            ..mixed.clone()
        };
        tied.model.tied_embeddings = true;
        let single = tests::train_layout(
            1,
            &Parallelism::default(),
            &TrainConfig {
                grad_accum: 4,
                ..tied.clone()
            },
        );
        let r = run(2, &pipeline("1f1b", 2, 4), &tied);
        let what = format!("{precision} 1f1b pp 2, tied embeddings, clipped at 0.5");
        assert_eq!(
            r.skipped_steps, single.skipped_steps,
            "{what}: skipped steps"
        );
        within(&what, &r, &Reference::of_run(single));
        if precision == Precision::Bf16 {
            let zero = Pp {
                zero: Some(burn_zero::Stage::Two),
                ..pipeline("1f1b", 2, 2)
            };
            for (world, p) in [
                (2, pipeline("1f1b", 2, 4)),
                (4, pipeline("1f1b", 2, 2)),
                (4, zero),
            ] {
                let what = format!(
                    "bf16 pp {} x dp {} (ZeRO {:?}) against fp32",
                    p.pp,
                    world / p.pp,
                    p.zero
                );
                let err = within(&what, &run(world, &p, &mixed), &fp32);
                assert!(
                    err > 0.0,
                    "{what}: fp32's losses: the compute copy was not used"
                );
            }
        }
    }
}

/// What cannot be composed with mixed precision in the pipeline is refused before anything
/// runs: block-by-block recomputation (its gradients would reach the compute copy) and dynamic
/// loss scaling with ZeRO stage optimizers (ZeRO skips one stage at a time).
#[test]
fn mixed_precision_refusals_are_typed_errors() {
    use examples::train::Precision;
    let bf16 = TrainConfig {
        precision: Precision::Bf16,
        ..config()
    };
    let blocks = Pp {
        recompute: Recompute::Blocks,
        ..pipeline("1f1b", 2, 4)
    };
    let e = blocks.validate(&bf16, 2).unwrap_err();
    assert!(e.to_string().contains("--precision bf16"), "{e}");
    let fp16 = TrainConfig {
        precision: Precision::Fp16,
        ..config()
    };
    let zero = Pp {
        zero: Some(burn_zero::Stage::One),
        ..pipeline("1f1b", 2, 4)
    };
    let e = zero.validate(&fp16, 4).unwrap_err();
    assert!(e.to_string().contains("--zero"), "{e}");
    // bf16 with ZeRO stage optimizers trains.
    zero.validate(&bf16, 4).unwrap();
}

#[test]
fn impossible_settings_are_typed_errors() {
    let config = config();
    // 2 x 8 stages of ZBV at pp 8 need 16 blocks.
    let p = pipeline("zbv", 8, 8);
    let e = p.validate(&config, 8).unwrap_err();
    let burn_parallel::Error::Technique(e) = e else {
        panic!("the split's error, got {e:?}")
    };
    assert!(matches!(
        e.downcast_ref::<PartitionError>(),
        Some(PartitionError::MoreStagesThanLayers {
            layers: 8,
            stages: 16
        })
    ));
    let zero = |n: usize| Pp {
        zero: Some(burn_zero::Stage::from_number(n).unwrap()),
        ..pipeline("1f1b", 2, 4)
    };
    let e = zero(3).validate(&config, 4).unwrap_err();
    assert!(e.to_string().contains("--zero 3"), "{e}");
    let mut dropout = config.clone();
    dropout.model.dropout = 0.1;
    let recompute = Pp {
        recompute: Recompute::Blocks,
        ..pipeline("1f1b", 2, 4)
    };
    let e = recompute.validate(&dropout, 2).unwrap_err();
    assert!(e.to_string().contains("--checkpoint-activations"), "{e}");
    // 8 rows over 3 micro-batches.
    let e = pipeline("1f1b", 2, 3).validate(&config, 2).unwrap_err();
    assert!(e.to_string().contains("micro-batches"), "{e}");
    // Interleaved needs micro-batches in rounds of pp.
    assert!(matches!(
        pipeline("interleaved", 4, 2).validate(&config, 4),
        Err(burn_parallel::Error::Invalid { .. } | burn_parallel::Error::Technique(_))
    ));
    // The world must be a multiple of pp.
    let e = pipeline("gpipe", 2, 4).validate(&config, 3).unwrap_err();
    assert!(e.to_string().contains("--pp"), "{e}");
}
