//! The runtime against a plain single-device run of the same stages: every schedule (GPipe,
//! 1F1B, interleaved with v = 2, ZB-H1, ZBV, DualPipeV) at pp 2 and 4 gives the single-device losses and
//! parameters over several SGD steps, with two tensors and metadata crossing every boundary.
//! And the bad cases: a shape that changes, a stage that panics or fails, a dead peer, ranks
//! holding different schedules, wrong stages or micro-batch counts: typed errors on every rank,
//! never a hang.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::{ProcessGroup, run_local};
use burn_pipeline::deferred::{DeferredLinear, WeightGradStore};
use burn_pipeline::generators::generate;
use burn_pipeline::runtime::{Checkpointing, Executor, PipelineError};
use burn_pipeline::stage::{Boundary, Stage, StageError, StageOutput};
use burn_pipeline::{Schedule, ScheduleKind};

const WIDTH: usize = 4;
const ROWS: usize = 2;

/// One micro-batch: inputs `[ROWS, WIDTH]` and targets `[ROWS, WIDTH]`.
#[derive(Clone, Debug)]
struct Batch {
    x: Vec<f32>,
    y: Vec<f32>,
}

fn batch(step: usize, mb: usize, rows: usize) -> Batch {
    let v = |k: usize| ((k * 37 + step * 11 + mb * 5) % 17) as f32 / 8.0 - 1.0;
    Batch {
        x: (0..rows * WIDTH).map(v).collect(),
        y: (0..rows * WIDTH).map(|k| v(k + 3) * 0.5).collect(),
    }
}

/// `tanh(x W + b)`; the first stage reads the batch, the last returns the mean squared error.
/// Between stages: the activation and its row sums (two tensors) and the row count (metadata).
#[derive(Module, Debug)]
struct Dense {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
    #[module(skip)]
    index: usize,
    #[module(skip)]
    stages: usize,
    /// Test hooks: panic, fail, or change the output width on micro-batch 1.
    #[module(skip)]
    fault: Fault,
    /// Forward calls: `[with the graph, without]` (activation checkpointing runs the forward
    /// without a graph, then again with one).
    #[module(skip)]
    calls: Arc<[AtomicUsize; 2]>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    Panic,
    Fail,
    Reshape,
    VariableRows,
}

impl Dense {
    fn new(index: usize, stages: usize, device: &Device) -> Self {
        let w: Vec<f32> = (0..WIDTH * WIDTH)
            .map(|k| (((k * 7 + index * 13) % 11) as f32 - 5.0) / 10.0)
            .collect();
        let b: Vec<f32> = (0..WIDTH).map(|k| (k + index) as f32 / 20.0).collect();
        Self {
            w: Param::from_tensor(Tensor::from_data(
                TensorData::new(w, [WIDTH, WIDTH]),
                device,
            )),
            b: Param::from_tensor(Tensor::from_data(TensorData::new(b, [WIDTH]), device)),
            index,
            stages,
            fault: Fault::None,
            calls: Arc::default(),
        }
    }

    fn apply(&self, x: Tensor<2>) -> Tensor<2> {
        (x.matmul(self.w.val()) + self.b.val().unsqueeze::<2>()).tanh()
    }
}

impl Stage<Batch> for Dense {
    fn forward(&self, input: Boundary, batch: &Batch) -> Result<StageOutput, StageError> {
        let device = self.w.val().device();
        let tracked = self.w.val().is_require_grad();
        self.calls[usize::from(!tracked)].fetch_add(1, Ordering::SeqCst);
        let rows = batch.x.len() / WIDTH;
        let x = if self.index == 0 {
            Tensor::<2>::from_data(TensorData::new(batch.x.clone(), [rows, WIDTH]), &device)
        } else {
            let meta: usize = input.meta()?;
            if meta != rows {
                return Err(StageError::new(format!(
                    "metadata says {meta} rows, not {rows}"
                )));
            }
            let h = input.get::<2>(0)?;
            let sums = input.get::<2>(1)?;
            h + sums * 0.1
        };
        let mb_marker = batch.x[0];
        let y = self.apply(x);
        if self.index + 1 == self.stages {
            let t =
                Tensor::<2>::from_data(TensorData::new(batch.y.clone(), [rows, WIDTH]), &device);
            return Ok(StageOutput::Loss((y - t).powf_scalar(2.0).mean()));
        }
        let faulty = mb_marker == batch_marker(1);
        let y = match self.fault {
            Fault::Panic if faulty => panic!("stage {} exploded", self.index),
            Fault::Fail if faulty => return Err(StageError::new("a deliberate failure")),
            Fault::Reshape if faulty => y.narrow(1, 0, WIDTH - 1),
            _ => y,
        };
        let sums = y.clone().sum_dim(1);
        Ok(StageOutput::Boundary(
            Boundary::new().with(y).with(sums).with_meta(&rows)?,
        ))
    }
}

/// The first input value of micro-batch `mb` at step 0 (how a stage recognises it).
fn batch_marker(mb: usize) -> f32 {
    batch(0, mb, ROWS).x[0]
}

fn sgd_update(
    optim: &mut burn::optim::ModuleOptimizer,
) -> impl FnMut(usize, Dense, GradientsParams) -> Result<Dense, burn_pipeline::runtime::UpdateError> + '_
{
    move |_, stage, grads| Ok(optim.step(0.1, stage, grads))
}

/// The single-device run: all stages chained on the whole batch, mean loss, SGD.
fn reference(stages: usize, m: usize, steps: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Device::flex().autodiff();
    let mut layers: Vec<Dense> = (0..stages)
        .map(|s| Dense::new(s, stages, &device))
        .collect();
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..steps {
        // The whole batch: the micro-batches' rows, in order.
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for mb in 0..m {
            let b = batch(step, mb, ROWS);
            x.extend(b.x);
            y.extend(b.y);
        }
        let rows = m * ROWS;
        let mut h = Tensor::<2>::from_data(TensorData::new(x, [rows, WIDTH]), &device);
        for (s, layer) in layers.iter().enumerate() {
            if s > 0 {
                let sums = h.clone().sum_dim(1);
                h = h + sums * 0.1;
            }
            h = layer.apply(h);
        }
        let t = Tensor::<2>::from_data(TensorData::new(y, [rows, WIDTH]), &device);
        let loss = (h - t).powf_scalar(2.0).mean();
        losses.push(loss.clone().into_data().try_to_vec::<f32>().unwrap()[0]);
        let mut grads = loss.backward();
        let all: Vec<GradientsParams> = layers
            .iter()
            .map(|l| GradientsParams::from_module(&mut grads, l))
            .collect();
        layers = layers
            .into_iter()
            .zip(all)
            .map(|(l, g)| optim.step(0.1, l, g))
            .collect();
    }
    (losses, layers.iter().map(params).collect())
}

fn params(layer: &Dense) -> Vec<f32> {
    let mut v = layer.w.val().into_data().try_to_vec::<f32>().unwrap();
    v.extend(layer.b.val().into_data().try_to_vec::<f32>().unwrap());
    v
}

/// One rank's losses and the final parameters of its stages, by stage.
type RankRun = (Vec<f32>, BTreeMap<usize, Vec<f32>>);

/// Runs `steps` steps of `schedule` on its ranks; per rank: the losses and the final
/// parameters of its stages.
fn pipelined(schedule: &Schedule, steps: usize) -> Vec<RankRun> {
    pipelined_with(schedule, steps, &Checkpointing::Off)
        .into_iter()
        .map(|(losses, params, _)| (losses, params))
        .collect()
}

/// Final parameters of each local stage.
type Params = BTreeMap<usize, Vec<f32>>;
/// Forward calls of each local stage: `[with the graph, without]`.
type Calls = BTreeMap<usize, [usize; 2]>;

/// [`pipelined`] with activation checkpointing; also returns each local stage's forward calls
/// `[with the graph, without]`.
fn pipelined_with(
    schedule: &Schedule,
    steps: usize,
    checkpointing: &Checkpointing,
) -> Vec<(Vec<f32>, Params, Calls)> {
    let p = schedule.num_ranks();
    let m = schedule.num_microbatches();
    let stages = schedule.num_stages();
    run_local(p, |group| {
        let device = Device::flex().autodiff();
        let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone())
            .unwrap()
            .with_checkpointing(checkpointing.clone());
        let mut local: BTreeMap<usize, Dense> = exec
            .local_stages()
            .into_iter()
            .map(|s| (s, Dense::new(s, stages, &device)))
            .collect();
        let mut optim = SgdConfig::new().init();
        let mut losses = Vec::new();
        for step in 0..steps {
            let batches: Vec<Batch> = (0..m).map(|mb| batch(step, mb, ROWS)).collect();
            let report = exec
                .step(&mut local, &batches, &mut sgd_update(&mut optim))
                .unwrap();
            losses.push(report.loss);
        }
        let calls = local
            .iter()
            .map(|(s, l)| (*s, l.calls.each_ref().map(|c| c.load(Ordering::SeqCst))))
            .collect();
        Ok((
            losses,
            local.iter().map(|(s, l)| (*s, params(l))).collect(),
            calls,
        ))
    })
    .unwrap()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs().max(1.0),
            "{what}: element {i}: {y} vs single-device {x}"
        );
    }
}

#[test]
fn every_schedule_matches_single_device_training() {
    let steps = 3;
    for (kind, v) in [
        ("gpipe", None),
        ("1f1b", None),
        ("interleaved", Some(2)),
        ("zb-h1", None),
        ("zbv", None),
        ("dualpipev", None),
    ] {
        for p in [2, 4] {
            for m in [p, 2 * p, 2 * p + 2] {
                let kind: ScheduleKind = kind.parse().unwrap();
                // DualPipeV needs m >= 2p; the others run m = p and 2p.
                let runs = match kind {
                    ScheduleKind::DualPipeV => m >= 2 * p,
                    _ => m <= 2 * p,
                };
                if !runs {
                    continue;
                }
                let schedule = generate(kind, p, m, v).unwrap();
                let stages = schedule.num_stages();
                let (ref_losses, ref_params) = reference(stages, m, steps);
                let ranks = pipelined(&schedule, steps);
                let what = format!("{kind} p={p} m={m} ({stages} stages)");
                for (losses, _) in &ranks {
                    assert_close(&ref_losses, losses, &format!("{what}: losses"));
                }
                let mut seen = 0;
                for (_, params) in &ranks {
                    for (s, values) in params {
                        assert_close(&ref_params[*s], values, &format!("{what}: stage {s}"));
                        seen += 1;
                    }
                }
                assert_eq!(seen, stages, "{what}: every stage trained once");
            }
        }
    }
}

#[test]
fn activation_checkpointing_recomputes_and_changes_no_gradient() {
    let steps = 2;
    for (kind, v, p, m, which) in [
        ("gpipe", None, 2, 4, Checkpointing::All),
        ("1f1b", None, 4, 8, Checkpointing::All),
        ("interleaved", Some(2), 2, 4, Checkpointing::All),
        ("zb-h1", None, 2, 4, Checkpointing::All),
        // The V's turn hands stage 1's output to stage 2 on the same rank.
        ("zbv", None, 2, 4, Checkpointing::All),
        ("1f1b", None, 4, 4, Checkpointing::Stages(vec![0, 2])),
    ] {
        let kind: ScheduleKind = kind.parse().unwrap();
        let schedule = generate(kind, p, m, v).unwrap();
        let stages = schedule.num_stages();
        let (ref_losses, ref_params) = reference(stages, m, steps);
        let what = format!("{kind} p={p} m={m} {which:?}");
        for (losses, params, calls) in pipelined_with(&schedule, steps, &which) {
            assert_close(&ref_losses, &losses, &format!("{what}: losses"));
            for (s, values) in &params {
                assert_close(&ref_params[*s], values, &format!("{what}: stage {s}"));
                // A checkpointed stage runs each forward twice: without, then with the graph.
                let runs = steps * m;
                let expect = if which.covers(*s) {
                    [runs, runs]
                } else {
                    [runs, 0]
                };
                assert_eq!(calls[s], expect, "{what}: stage {s} forwards [graph, none]");
            }
        }
    }
}

/// Runs one step of 1F1B at pp 2 with `fault` on stage 0; returns each rank's outcome and
/// how long the slowest rank took.
fn faulty_step(
    fault: Fault,
    variable_dims: &[usize],
) -> (Vec<Result<(), PipelineError>>, Duration) {
    let schedule = generate(ScheduleKind::OneFOneB, 2, 4, None).unwrap();
    let start = Instant::now();
    let outcomes = run_local(2, |group: ProcessGroup| {
        let group = group.with_timeout(Duration::from_secs(20));
        let device = Device::flex().autodiff();
        let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone())
            .unwrap()
            .with_variable_dims(variable_dims);
        let mut stage = Dense::new(group.rank(), 2, &device);
        stage.fault = fault;
        let mut local = BTreeMap::from([(group.rank(), stage)]);
        let mut optim = SgdConfig::new().init();
        let rows = |mb: usize| {
            if fault == Fault::VariableRows {
                1 + mb
            } else {
                ROWS
            }
        };
        let batches: Vec<Batch> = (0..4).map(|mb| batch(0, mb, rows(mb))).collect();
        Ok(exec
            .step(&mut local, &batches, &mut sgd_update(&mut optim))
            .map(|_| ()))
    })
    .unwrap();
    (outcomes, start.elapsed())
}

#[test]
fn a_changed_shape_is_a_typed_error_on_every_rank() {
    let (outcomes, took) = faulty_step(Fault::Reshape, &[]);
    match &outcomes[0] {
        Err(PipelineError::ShapeMismatch {
            transfer,
            expected,
            got,
            ..
        }) => {
            assert!(
                transfer.contains("micro-batch 1 from stage 0 to stage 1"),
                "{transfer}"
            );
            assert!(
                expected.contains("[2, 4]") && got.contains("[2, 3]"),
                "{expected} / {got}"
            );
        }
        other => panic!("expected a shape mismatch on rank 0, got {other:?}"),
    }
    assert!(
        matches!(outcomes[1], Err(PipelineError::Collective { .. })),
        "{:?}",
        outcomes[1]
    );
    assert!(
        took < Duration::from_secs(10),
        "the peer failed at once, not at its timeout"
    );
}

#[test]
fn a_variable_dimension_may_change_when_declared() {
    // The number of rows changes per micro-batch: an error unless dimension 0 is variable.
    let (outcomes, _) = faulty_step(Fault::VariableRows, &[]);
    assert!(
        matches!(outcomes[0], Err(PipelineError::ShapeMismatch { .. })),
        "{:?}",
        outcomes[0]
    );
    let (outcomes, _) = faulty_step(Fault::VariableRows, &[0]);
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
}

#[test]
fn a_panicking_or_failing_stage_stops_every_rank_promptly() {
    let (outcomes, took) = faulty_step(Fault::Panic, &[]);
    match &outcomes[0] {
        Err(PipelineError::StagePanicked {
            stage,
            action,
            message,
            ..
        }) => {
            assert_eq!((*stage, action.as_str()), (0, "0F1"));
            assert!(message.contains("stage 0 exploded"), "{message}");
        }
        other => panic!("expected a panic report, got {other:?}"),
    }
    assert!(matches!(outcomes[1], Err(PipelineError::Collective { .. })));
    assert!(took < Duration::from_secs(10));

    let (outcomes, _) = faulty_step(Fault::Fail, &[]);
    assert!(
        matches!(
            &outcomes[0],
            Err(PipelineError::Stage { stage: 0, microbatch: 1, message, .. })
                if message.contains("deliberate")
        ),
        "{:?}",
        outcomes[0]
    );
    assert!(outcomes[1].is_err());
}

#[test]
fn a_dead_peer_is_an_error_within_the_timeout() {
    let schedule = generate(ScheduleKind::GPipe, 2, 2, None).unwrap();
    let start = Instant::now();
    let outcomes = run_local(2, |group: ProcessGroup| {
        let group = group.with_timeout(Duration::from_secs(2));
        let device = Device::flex().autodiff();
        let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone()).unwrap();
        if group.rank() == 0 {
            // Rank 0 stops without running the step (and without reporting a failure).
            return Ok(None);
        }
        let mut local = BTreeMap::from([(1, Dense::new(1, 2, &device))]);
        let mut optim = SgdConfig::new().init();
        let batches: Vec<Batch> = (0..2).map(|mb| batch(0, mb, ROWS)).collect();
        Ok(Some(
            exec.step(&mut local, &batches, &mut sgd_update(&mut optim))
                .map(|_| ()),
        ))
    })
    .unwrap();
    match &outcomes[1] {
        Some(Err(e @ PipelineError::Collective { action, .. })) => {
            assert_eq!(action, "RECV_F(0->1,m0)", "{e}");
        }
        other => panic!("expected a communication error, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(15));
}

#[test]
fn ranks_with_different_schedules_refuse_to_start() {
    let outcomes = run_local(2, |group: ProcessGroup| {
        let kind = if group.rank() == 0 {
            ScheduleKind::GPipe
        } else {
            ScheduleKind::OneFOneB
        };
        let schedule = generate(kind, 2, 4, None).unwrap();
        Ok(Executor::new(schedule, group, Device::flex().autodiff()).map(|_| ()))
    })
    .unwrap();
    for (rank, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Err(PipelineError::ScheduleMismatch { other, .. }) => assert_eq!(*other, 1 - rank),
            other => panic!("rank {rank}: expected a schedule mismatch, got {other:?}"),
        }
    }
    // And a group of the wrong size.
    let outcomes = run_local(3, |group: ProcessGroup| {
        let schedule = generate(ScheduleKind::GPipe, 2, 4, None).unwrap();
        Ok(Executor::new(schedule, group, Device::flex().autodiff()).map(|_| ()))
    })
    .unwrap();
    assert!(outcomes.iter().all(|o| matches!(
        o,
        Err(PipelineError::GroupSize {
            schedule: 2,
            group: 3
        })
    )));
}

#[test]
fn wrong_stages_or_microbatch_counts_are_refused() {
    let schedule = generate(ScheduleKind::OneFOneB, 2, 4, None).unwrap();
    let outcomes = run_local(2, |group: ProcessGroup| {
        let device = Device::flex().autodiff();
        let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone()).unwrap();
        let mut optim = SgdConfig::new().init();
        let mut wrong = BTreeMap::from([(1 - group.rank(), Dense::new(0, 2, &device))]);
        let batches: Vec<Batch> = (0..4).map(|mb| batch(0, mb, ROWS)).collect();
        let a = exec
            .step(&mut wrong, &batches, &mut sgd_update(&mut optim))
            .map(|_| ());
        let mut right = BTreeMap::from([(group.rank(), Dense::new(group.rank(), 2, &device))]);
        let b = exec
            .step(&mut right, &batches[..3], &mut sgd_update(&mut optim))
            .map(|_| ());
        Ok((a, b))
    })
    .unwrap();
    for (rank, (a, b)) in outcomes.iter().enumerate() {
        assert!(
            matches!(a, Err(PipelineError::StagesMismatch { expected, .. }) if expected == &vec![rank]),
            "{a:?}"
        );
        assert!(
            matches!(
                b,
                Err(PipelineError::MicrobatchCount {
                    expected: 4,
                    given: 3
                })
            ),
            "{b:?}"
        );
    }
}

#[test]
fn peak_held_microbatches_follow_the_schedule() {
    // GPipe holds every micro-batch on every stage; 1F1B at most p - r on rank r.
    let (p, m) = (4, 8);
    for (kind, expect) in [
        (ScheduleKind::GPipe, [8, 8, 8, 8]),
        (ScheduleKind::OneFOneB, [4, 3, 2, 1]),
    ] {
        let schedule = generate(kind, p, m, None).unwrap();
        let peaks = run_local(p, |group| {
            let device = Device::flex().autodiff();
            let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone()).unwrap();
            let mut local = BTreeMap::from([(group.rank(), Dense::new(group.rank(), p, &device))]);
            let mut optim = SgdConfig::new().init();
            let batches: Vec<Batch> = (0..m).map(|mb| batch(0, mb, ROWS)).collect();
            let report = exec
                .step(&mut local, &batches, &mut sgd_update(&mut optim))
                .unwrap();
            Ok(report.peak_held[&group.rank()])
        })
        .unwrap();
        assert_eq!(peaks, expect, "{kind}");
    }
}

/// [`Dense`] with its weight deferred: `I` computes no weight gradient, `W` does.
#[derive(Module, Debug)]
struct DenseZ {
    lin: DeferredLinear,
    #[module(skip)]
    index: usize,
    #[module(skip)]
    stages: usize,
}

impl DenseZ {
    fn new(index: usize, stages: usize, device: &Device) -> Self {
        let d = Dense::new(index, stages, device);
        Self {
            lin: DeferredLinear::new(d.w, Some(d.b), &WeightGradStore::new()),
            index,
            stages,
        }
    }

    fn params(&self) -> Vec<f32> {
        let mut v = self
            .lin
            .weight
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let b = self.lin.bias.as_ref().expect("a bias").val();
        v.extend(b.into_data().try_to_vec::<f32>().unwrap());
        v
    }
}

impl Stage<Batch> for DenseZ {
    fn forward(&self, input: Boundary, batch: &Batch) -> Result<StageOutput, StageError> {
        let device = self.lin.weight.val().device();
        let rows = batch.x.len() / WIDTH;
        let x = if self.index == 0 {
            Tensor::<2>::from_data(TensorData::new(batch.x.clone(), [rows, WIDTH]), &device)
        } else {
            let h = input.get::<2>(0)?;
            let sums = input.get::<2>(1)?;
            h + sums * 0.1
        };
        let y = self.lin.forward(x).tanh();
        if self.index + 1 == self.stages {
            let t =
                Tensor::<2>::from_data(TensorData::new(batch.y.clone(), [rows, WIDTH]), &device);
            return Ok(StageOutput::Loss((y - t).powf_scalar(2.0).mean()));
        }
        let sums = y.clone().sum_dim(1);
        Ok(StageOutput::Boundary(
            Boundary::new().with(y).with(sums).with_meta(&rows)?,
        ))
    }

    fn deferred_weights(&self) -> Option<&WeightGradStore> {
        Some(&self.lin.store)
    }
}

#[test]
fn deferred_weights_split_the_backward_and_still_match_single_device_training() {
    let steps = 3;
    for (kind, p, m) in [
        (ScheduleKind::ZbH1, 2, 4),
        (ScheduleKind::ZbH1, 4, 8),
        (ScheduleKind::Zbv, 2, 4),
        (ScheduleKind::Zbv, 4, 8),
        // `B` (no split): the deferred gradients are computed right after the backward.
        (ScheduleKind::OneFOneB, 2, 4),
    ] {
        let schedule = generate(kind, p, m, None).unwrap();
        let stages = schedule.num_stages();
        let (ref_losses, ref_params) = reference(stages, m, steps);
        let ranks = run_local(p, |group| {
            let device = Device::flex().autodiff();
            let mut exec = Executor::new(schedule.clone(), group.clone(), device.clone()).unwrap();
            let mut local: BTreeMap<usize, DenseZ> = exec
                .local_stages()
                .into_iter()
                .map(|s| (s, DenseZ::new(s, stages, &device)))
                .collect();
            let mut optim = SgdConfig::new().init();
            let mut losses = Vec::new();
            for step in 0..steps {
                let batches: Vec<Batch> = (0..m).map(|mb| batch(step, mb, ROWS)).collect();
                let mut update =
                    |_: usize,
                     stage: DenseZ,
                     grads: GradientsParams|
                     -> Result<DenseZ, burn_pipeline::runtime::UpdateError> {
                        // Every weight gradient arrived, through `W`.
                        if grads.get::<2>(stage.lin.weight.id).is_none() {
                            return Err("no weight gradient at REDUCE".into());
                        }
                        Ok(optim.step(0.1, stage, grads))
                    };
                losses.push(exec.step(&mut local, &batches, &mut update).unwrap().loss);
            }
            Ok((
                losses,
                local
                    .iter()
                    .map(|(s, l)| (*s, l.params()))
                    .collect::<BTreeMap<_, _>>(),
            ))
        })
        .unwrap();
        let what = format!("deferred {kind} p={p} m={m}");
        for (losses, params) in &ranks {
            assert_close(&ref_losses, losses, &format!("{what}: losses"));
            for (s, values) in params {
                assert_close(&ref_params[*s], values, &format!("{what}: stage {s}"));
            }
        }
    }
}

#[test]
fn input_backward_gives_the_input_gradient_and_weight_backward_completes_the_rest() {
    let device = Device::flex().autodiff();
    let plain = Dense::new(1, 2, &device);
    let deferred = DenseZ::new(1, 2, &device);
    let store = deferred.deferred_weights().unwrap().clone();
    let x0: Vec<f32> = (0..3 * WIDTH).map(|k| (k as f32 - 5.0) / 7.0).collect();
    let leaf = || Tensor::<2>::from_data(TensorData::new(x0.clone(), [3, WIDTH]), &device);

    // The plain layer: every gradient at once.
    let x = leaf().require_grad();
    let mut grads = plain.apply(x.clone()).powf_scalar(2.0).sum().backward();
    let dx_plain = x.grad(&grads).unwrap();
    let all = GradientsParams::from_module(&mut grads, &plain);

    // `I`: the input gradient (and the bias's), no weight gradient, one pair recorded.
    store.begin(5);
    let x = leaf().require_grad();
    let y = deferred.lin.forward(x.clone()).tanh();
    let mut grads = y.powf_scalar(2.0).sum().backward();
    let dx = x.grad(&grads).unwrap();
    let input_only = GradientsParams::from_module(&mut grads, &deferred);
    assert!(input_only.get::<2>(deferred.lin.weight.id).is_none());
    assert!(
        input_only
            .get::<1>(deferred.lin.bias.as_ref().unwrap().id)
            .is_some()
    );
    assert_eq!(store.pending(5), 1);
    let close = |a: Tensor<2>, b: Tensor<2>, what: &str| {
        assert_close(
            &a.into_data().try_to_vec::<f32>().unwrap(),
            &b.into_data().try_to_vec::<f32>().unwrap(),
            what,
        )
    };
    close(dx_plain, dx, "dX");

    // `W`: the weight gradient, equal to the plain layer's.
    let w = store.take(5, &deferred);
    assert_eq!(store.pending(5), 0);
    close(
        all.get::<2>(plain.w.id).unwrap(),
        w.get::<2>(deferred.lin.weight.id).unwrap(),
        "dW",
    );
}

/// Clipping over the stages with ZeRO stage optimizers (each stage's replicas sharding its
/// state): each gives the squares of its reduced gradients to the norm over every stage and is
/// clipped by it, so the run is the run of plain AdamW stages clipped the same way (pp 2 x
/// dp 2, a norm small enough that every step clips). A ZeRO optimizer built with another norm
/// is an error.
#[test]
fn clipping_with_zero_stage_optimizers_matches_plain_ones() {
    use burn_parallel::DistributedDataParallel;
    use burn_parallel::mesh::ParallelDims;
    use burn_parallel::nn::TpContext;
    use burn_parallel::train::TrainStep;
    use burn_pipeline::update::{StageOptimizer, StageUpdater};
    use burn_zero::{ShardGroups, Stage as ZeroStage, ZeroConfig, ZeroOptimizer};
    const MAX_NORM: f64 = 1e-3;
    let schedule = generate(ScheduleKind::OneFOneB, 2, 2, None).unwrap();
    // `zero`: the stages' ZeRO stage and the norm their ZeRO optimizers clip to.
    let run = |zero: Option<(ZeroStage, Option<f64>)>| {
        run_local(4, |world| {
            let device = Device::flex().autodiff();
            let dims = ParallelDims {
                pp: 2,
                dp_replicate: 2,
                ..ParallelDims::default()
            };
            let mesh = dims.build(&world).unwrap();
            let pp = mesh.group("pp").unwrap().clone();
            let dp = dims.data_parallel(&mesh).unwrap();
            let mut exec = Executor::new(schedule.clone(), pp.clone(), device.clone()).unwrap();
            let s = pp.rank();
            let mut stages = BTreeMap::from([(s, Dense::new(s, 2, &device))]);
            let adamw = burn::optim::AdamWConfig::new();
            let optim = match zero {
                None => StageOptimizer::Module(adamw.init()),
                Some((stage, clip)) => {
                    let config = ZeroConfig::new(stage).with_max_grad_norm(clip);
                    let zero = ZeroOptimizer::new(
                        &stages[&s],
                        ShardGroups::flat(dp.clone()),
                        config,
                        adamw.build(),
                    )
                    .unwrap();
                    StageOptimizer::Zero(Box::new(zero))
                }
            };
            let reduce = TrainStep::new(TpContext::single())
                .with_ddp(DistributedDataParallel::new(dp.clone()));
            let mut updater = StageUpdater::new(&exec, BTreeMap::from([(s, optim)]), reduce)
                .unwrap()
                .with_clip(Some(MAX_NORM));
            updater.set_lr(0.05);
            let mut norms = Vec::new();
            for step in 0..3 {
                let batches: Vec<Batch> = (0..2)
                    .map(|mb| batch(step, dp.rank() * 2 + mb, ROWS))
                    .collect();
                let report = exec
                    .step(&mut stages, &batches, &mut |s, stage, g| {
                        updater.at_reduce(s, stage, g)
                    })
                    .unwrap();
                match updater.finish(&mut stages, &report) {
                    Ok(norm) => norms.push(norm.expect("a norm")),
                    Err(e) => return Ok(Err(e.to_string())),
                }
            }
            let stage = &stages[&s];
            let values = |t: Tensor<2>| t.try_into_vec_as::<f32>().unwrap();
            Ok(Ok((
                norms,
                values(stage.w.val()),
                stage.b.val().try_into_vec_as::<f32>().unwrap(),
            )))
        })
        .unwrap()
    };
    let plain: Vec<_> = run(None).into_iter().map(Result::unwrap).collect();
    assert!(
        plain[0].0[0] > MAX_NORM * 10.0,
        "every step clips: {:?}",
        plain[0].0
    );
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let zero: Vec<_> = run(Some((stage, Some(MAX_NORM))))
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for (rank, (z, p)) in zero.iter().zip(&plain).enumerate() {
            for (a, b) in z.0.iter().zip(&p.0) {
                assert!(
                    (a - b).abs() <= 1e-5 * b,
                    "{stage:?} rank {rank}: norm {a} vs {b}"
                );
            }
            for (a, b) in z.1.iter().chain(&z.2).zip(p.1.iter().chain(&p.2)) {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{stage:?} rank {rank}: parameter {a} vs {b}"
                );
            }
        }
    }
    // A ZeRO optimizer built without the updater's norm would not clip: an error, not a
    // silently unclipped run.
    for outcome in run(Some((ZeroStage::One, None))) {
        let e = outcome.unwrap_err();
        assert!(e.contains("with_max_grad_norm(Some(0.001))"), "{e}");
    }
}

/// Mixed precision needs the executor (compute copies, the loss scale of each backward's seed)
/// and the updater (reduction dtype, unscaling, the skip decision) to share one policy and one
/// loss scaler: a mismatch, or a loss scaler with ZeRO stage optimizers (which scale and skip
/// one stage at a time), is a typed error naming what to do, before any step.
#[test]
fn a_precision_the_executor_and_the_updater_disagree_on_is_refused() {
    use burn_parallel::mesh::ParallelDims;
    use burn_parallel::nn::TpContext;
    use burn_parallel::precision::{LossScaler, MixedPrecision};
    use burn_parallel::train::TrainStep;
    use burn_pipeline::update::{StageOptimizer, StageUpdater};
    use burn_zero::{ShardGroups, Stage as ZeroStage, ZeroConfig, ZeroOptimizer};
    let schedule = generate(ScheduleKind::OneFOneB, 2, 2, None).unwrap();
    run_local(2, |world| {
        let device = Device::flex().autodiff();
        let dims = ParallelDims {
            pp: 2,
            ..ParallelDims::default()
        };
        let mesh = dims.build(&world).unwrap();
        let pp = mesh.group("pp").unwrap().clone();
        let s = pp.rank();
        let exec = Executor::new(schedule.clone(), pp.clone(), device.clone()).unwrap();
        let sgd = || BTreeMap::from([(s, StageOptimizer::module(SgdConfig::new().init()))]);
        let refused = |e: PipelineError, words: &[&str]| {
            let text = e.to_string();
            assert!(matches!(e, PipelineError::Precision { .. }), "{text}");
            for w in words {
                assert!(text.contains(w), "{w:?} not in: {text}");
            }
        };
        let bf16 = TrainStep::new(TpContext::single()).with_precision(MixedPrecision::bf16());
        let f16 = || {
            TrainStep::new(TpContext::single())
                .with_precision(MixedPrecision::f16())
                .with_loss_scaler(LossScaler::new(1024.0))
        };
        // The updater reduces in bf16, the executor was given no policy.
        let e = StageUpdater::new(&exec, sgd(), bf16.clone()).unwrap_err();
        refused(e, &["BF16", "Executor::with_precision"]);
        // The executor computes in bf16, the updater in f16.
        let exec = exec.with_precision(&bf16);
        let e = StageUpdater::new(&exec, sgd(), f16()).unwrap_err();
        refused(e, &["BF16", "F16", "a clone shares its loss scaler"]);
        // The same policy, two loss scalers: the skip decisions would differ.
        let step = f16();
        let exec = exec.with_precision(&step);
        let e = StageUpdater::new(&exec, sgd(), f16()).unwrap_err();
        refused(e, &["another loss scaler"]);
        // A clone of the executor's step shares its scaler: accepted.
        StageUpdater::new(&exec, sgd(), step.clone()).unwrap();
        // A loss scaler with a ZeRO stage optimizer.
        let dp = dims.data_parallel(&mesh).unwrap();
        let stage = Dense::new(s, 2, &device);
        let zero = ZeroOptimizer::new(
            &stage,
            ShardGroups::flat(dp),
            ZeroConfig::new(ZeroStage::One),
            burn::optim::AdamWConfig::new().build(),
        )
        .unwrap();
        let zero = BTreeMap::from([(s, StageOptimizer::Zero(Box::new(zero)))]);
        let e = StageUpdater::new(&exec, zero, step).unwrap_err();
        refused(e, &["ZeRO", "bf16"]);
        Ok(())
    })
    .unwrap();
}

/// A NaN in the data stops the step on every rank before a weight is written, with the loss or
/// the gradients named, whether the stages are held for clipping (the loss and the global norm
/// checked in `finish`) or stepped during the schedule (each stage's own gradients checked
/// first). Before, both trained on with NaN weights and the run exited 0.
#[test]
fn a_non_finite_step_is_refused_on_every_rank_before_the_update() {
    use burn_parallel::nn::TpContext;
    use burn_parallel::train::TrainStep;
    use burn_pipeline::update::{StageOptimizer, StageUpdater};
    let schedule = generate(ScheduleKind::OneFOneB, 2, 2, None).unwrap();
    for clip in [Some(1.0), None] {
        let out = run_local(2, |pp| {
            let device = Device::flex().autodiff();
            let mut exec = Executor::new(schedule.clone(), pp.clone(), device.clone()).unwrap();
            let s = pp.rank();
            let mut stages = BTreeMap::from([(s, Dense::new(s, 2, &device))]);
            let before = params(&stages[&s]);
            let optim = StageOptimizer::module(SgdConfig::new().init());
            let reduce = TrainStep::new(TpContext::single());
            let mut updater = StageUpdater::new(&exec, BTreeMap::from([(s, optim)]), reduce)
                .unwrap()
                .with_clip(clip);
            updater.set_lr(0.1);
            let mut batches: Vec<Batch> = (0..2).map(|mb| batch(0, mb, ROWS)).collect();
            batches[1].x[2] = f32::NAN;
            let outcome = exec
                .step(&mut stages, &batches, &mut |s, stage, g| {
                    updater.at_reduce(s, stage, g)
                })
                .and_then(|report| updater.finish(&mut stages, &report));
            let err = outcome.expect_err("a NaN step").to_string();
            let after = stages.get(&s).map(params);
            Ok((err, after == Some(before) || after.is_none()))
        })
        .unwrap();
        for (rank, (err, untouched)) in out.iter().enumerate() {
            assert!(
                *untouched,
                "clip {clip:?}: rank {rank}'s weights were written"
            );
            assert!(
                err.contains("NaN") || err.contains("aborted"),
                "clip {clip:?}, rank {rank}: {err}"
            );
        }
        // The rank that found it names what was not finite.
        assert!(
            out.iter().any(|(e, _)| e.contains("is NaN")),
            "clip {clip:?}: {out:?}"
        );
    }
}
