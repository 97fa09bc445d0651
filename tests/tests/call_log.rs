//! The collectives a training step issues, and where their payload goes, for each layout of
//! the GPT trainer: the sequence of NCCL calls a GPU job would make, checked on thread ranks.
//!
//! Every run takes the tensor-level path (`ProcessGroup::with_tensor_path`, the path an NCCL
//! job takes on CUDA) with a call log on the world (`burn_parallel::calls`, inherited by the
//! mesh's sub-groups), and one steady step (the third) is read from each rank's log:
//!
//! - *tensor* calls are the ones NCCL runs in device memory on CUDA; *host* calls stage their
//!   payload through host memory on every backend;
//! - DDP (plain and overlapped), ZeRO-1, ZeRO-2, FSDP, HSDP and tensor parallelism move every
//!   gradient and parameter through tensor calls: their host calls carry only scalars and
//!   flags (at most [`HOST_CALL_LIMIT`] bytes each, [`HOST_SHARE_LIMIT`] of the step's bytes);
//! - the pipeline (every schedule) sends its boundary tensors through tensor calls too, and
//!   each rank's tensor sends to another come in the order that rank receives them (NCCL
//!   matches one direction's device messages in the order they were sent);
//! - the ranks of a group issue the same calls in the same order (a different order or
//!   grouping would deadlock NCCL);
//! - each technique's calls are the ones it is designed to make: DDP all-reduces every
//!   gradient once; ZeRO-1 reduce-scatters the flat gradient once and all-gathers the updated
//!   shard; ZeRO-2 reduce-scatters it bucket by bucket (no all-reduce); FSDP gathers each unit
//!   in the forward and reduce-scatters its gradient in the backward; HSDP averages the shards
//!   across replicas in one all-reduce; sequence parallelism sums its norms' gradients in one.
//!
//! Run with `--nocapture` for each layout's figures (the host bytes per step and rank the
//! closing notes of issue 27 quote): `cargo test -p tests --test call_log -- --nocapture`.

use burn::tensor::DType;
use burn_parallel::calls::{CallLog, CallPath, LoggedCall};
use burn_parallel_train::PipelineLayout;
use burn_parallel_train::run_local;
use burn_zero::Stage;
use examples::data::Corpus;
use examples::pipeline::train_gpt_pipeline;
use examples::train::{Parallelism, TrainConfig, train_gpt};
use tests::tiny_gpt_run;

/// The step read from each log (0-based): steady, past the first step's one-off setup.
const STEP: usize = 2;
/// The largest host call a layout that keeps its data on the device may make: flags and
/// scalars (DDP's per-parameter presence flags are 4 bytes a parameter).
const HOST_CALL_LIMIT: usize = 1024;
/// The largest share of a step's bytes such a layout may hand to host calls.
const HOST_SHARE_LIMIT: f64 = 0.01;

/// Each rank's calls of step [`STEP`].
fn step_calls(
    world: usize,
    run: impl Fn(&burn_parallel::ProcessGroup, &mut dyn FnMut()) -> Result<(), burn_parallel::Error>
    + Send
    + Sync,
) -> Vec<Vec<LoggedCall>> {
    run_local(world, |group| {
        let log = CallLog::new();
        let group = group.with_tensor_path(true).with_call_log(log.clone());
        let mut steps = Vec::new();
        run(&group, &mut || steps.push(log.take()))?;
        Ok(steps.swap_remove(STEP))
    })
    .expect("the run trains")
}

/// The tiny GPT for four steps.
fn config() -> TrainConfig {
    tiny_gpt_run(STEP + 2)
}

/// Each rank's calls of step [`STEP`] under `parallel`.
fn layout_calls(
    world: usize,
    parallel: &Parallelism,
    config: &TrainConfig,
) -> Vec<Vec<LoggedCall>> {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    step_calls(world, |group, each_step| {
        train_gpt(group, config, parallel, &corpus, &mut |_| each_step())?;
        Ok(())
    })
}

/// Trainable parameter elements of the GPT of `config` (every parameter trains).
fn numel(config: &TrainConfig) -> usize {
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let one = TrainConfig {
        steps: 1,
        ..config.clone()
    };
    let report = run_local(1, |g| {
        train_gpt(&g, &one, &Parallelism::default(), &corpus, &mut |_| {})
    })
    .expect("one step trains");
    report[0].final_params.iter().map(|p| p.values.len()).sum()
}

/// Bytes of the calls on `path`.
fn bytes(calls: &[LoggedCall], path: CallPath) -> usize {
    calls
        .iter()
        .filter(|c| c.path == path)
        .map(|c| c.bytes)
        .sum()
}

/// The tensor calls named `op`, in order.
fn tensor_ops<'a>(calls: &'a [LoggedCall], op: &str) -> Vec<&'a LoggedCall> {
    calls
        .iter()
        .filter(|c| c.path == CallPath::Tensor && c.op == op)
        .collect()
}

/// One line of figures for a layout (rank 0's step).
fn describe(what: &str, calls: &[LoggedCall]) -> String {
    let count = |path| calls.iter().filter(|c| c.path == path).count();
    let largest = calls
        .iter()
        .filter(|c| c.path == CallPath::Host)
        .map(|c| c.bytes)
        .max()
        .unwrap_or(0);
    let mut by_op = std::collections::BTreeMap::<(&str, &str), usize>::new();
    for c in calls {
        let path = if c.path == CallPath::Tensor {
            "tensor"
        } else {
            "host"
        };
        *by_op.entry((path, c.op)).or_default() += 1;
    }
    let by_op: Vec<String> = by_op
        .into_iter()
        .map(|((path, op), n)| format!("{n} {path} {op}"))
        .collect();
    format!(
        "{what:<24} tensor calls {:>4} ({:>9} B)  host calls {:>4} ({:>9} B, largest {:>7} B): {}",
        count(CallPath::Tensor),
        bytes(calls, CallPath::Tensor),
        count(CallPath::Host),
        bytes(calls, CallPath::Host),
        largest,
        by_op.join(", ")
    )
}

/// Every rank issued the same collectives in the same order: operation, path, dtype and group
/// size, and the same payload for the collectives whose inputs are alike on every rank
/// (all-reduce, reduce-scatter, broadcast; an all-gather's shards may differ by an element, an
/// all-to-all's by the tokens routed).
fn assert_same_sequence(what: &str, ranks: &[Vec<LoggedCall>]) {
    let key = |c: &LoggedCall| {
        let alike = matches!(c.op, "all_reduce" | "reduce_scatter" | "broadcast");
        let bytes = if alike { c.bytes } else { 0 };
        (c.op, c.path, c.dtype, c.members.len(), bytes)
    };
    let first: Vec<_> = ranks[0].iter().map(key).collect();
    for (r, calls) in ranks.iter().enumerate().skip(1) {
        let other: Vec<_> = calls.iter().map(key).collect();
        assert_eq!(
            other, first,
            "{what}: rank {r} issued other calls than rank 0"
        );
    }
}

/// The step's bulk data went through tensor calls only: no host call above
/// [`HOST_CALL_LIMIT`] bytes, host calls under [`HOST_SHARE_LIMIT`] of the step's bytes.
fn assert_no_host_copies(what: &str, ranks: &[Vec<LoggedCall>]) {
    for (r, calls) in ranks.iter().enumerate() {
        if let Some(big) = calls
            .iter()
            .find(|c| c.path == CallPath::Host && c.bytes > HOST_CALL_LIMIT)
        {
            panic!("{what}: rank {r} staged {big:?} through the host");
        }
        let (host, tensor) = (bytes(calls, CallPath::Host), bytes(calls, CallPath::Tensor));
        assert!(
            (host as f64) < HOST_SHARE_LIMIT * (host + tensor) as f64,
            "{what}: rank {r} handed {host} of {} bytes to host calls",
            host + tensor
        );
    }
}

/// Each rank's calls of step [`STEP`] under `parallel`, printed as `what` (rank 0), after
/// checking what every layout that keeps its data on the device must do: the same calls on
/// every rank ([`assert_same_sequence`]) and no host copies ([`assert_no_host_copies`]).
fn device_layout(
    what: &str,
    world: usize,
    parallel: &Parallelism,
    config: &TrainConfig,
) -> Vec<Vec<LoggedCall>> {
    let calls = layout_calls(world, parallel, config);
    println!("{}", describe(what, &calls[0]));
    assert_same_sequence(what, &calls);
    assert_no_host_copies(what, &calls);
    calls
}

fn zero(stage: Stage) -> Parallelism {
    Parallelism {
        zero: Some(stage),
        ..Parallelism::default()
    }
}

#[test]
fn data_parallel_layouts_keep_gradients_and_parameters_in_tensor_calls() {
    let config = config();
    let p = numel(&config);
    for world in [2, 4] {
        // DDP: every gradient all-reduced once, in buckets, as f32.
        let what = format!("DDP, {world} ranks");
        let ddp = device_layout(&what, world, &Parallelism::default(), &config);
        let reduces = tensor_ops(&ddp[0], "all_reduce");
        assert!(reduces.len() > 1, "{what}: {} buckets", reduces.len());
        assert_eq!(
            reduces.iter().map(|c| c.bytes).sum::<usize>(),
            4 * p,
            "{what}"
        );

        // ZeRO-2: the flat gradient reduce-scattered bucket by bucket, never all-reduced; the
        // updated shard all-gathered once.
        let what = format!("ZeRO-2, {world} ranks");
        let z2 = device_layout(&what, world, &zero(Stage::Two), &config);
        for (r, calls) in z2.iter().enumerate() {
            let scatters = tensor_ops(calls, "reduce_scatter");
            assert!(scatters.len() > 1, "{what}: {} buckets", scatters.len());
            assert_eq!(
                scatters.iter().map(|c| c.bytes).sum::<usize>(),
                4 * p,
                "{what}"
            );
            assert!(
                tensor_ops(calls, "all_reduce").is_empty(),
                "{what}: an all-reduce"
            );
            let gathers = tensor_ops(calls, "all_gather");
            assert_eq!(gathers.len(), 1, "{what}: one all-gather of the shard");
            let shard = burn_zero::flat::shard_range(p, r, world).len();
            assert_eq!(gathers[0].bytes, 4 * shard, "{what}: rank {r}'s shard");
            // The reduce-scatters come before the all-gather of the update.
            let last_scatter = calls.iter().rposition(|c| c.op == "reduce_scatter");
            let gather = calls.iter().position(|c| c.op == "all_gather");
            assert!(last_scatter < gather, "{what}: update before the gradients");
        }
    }
}

#[test]
fn zero1_fsdp_hsdp_overlap_and_tensor_parallel_layouts_keep_their_data_in_tensor_calls() {
    let config = config();
    let p = numel(&config);
    let world = 2;

    let z1 = device_layout("ZeRO-1, 2 ranks", world, &zero(Stage::One), &config);
    // One reduce-scatter of the whole flat gradient per step (each rank needs the sum of its
    // shard only), no all-reduce, one all-gather of the update.
    let scatters = tensor_ops(&z1[0], "reduce_scatter");
    assert_eq!(
        scatters.len(),
        1,
        "ZeRO-1: one reduce-scatter of the flat gradient"
    );
    assert_eq!(scatters[0].bytes, 4 * p);
    assert!(
        tensor_ops(&z1[0], "all_reduce").is_empty(),
        "ZeRO-1: an all-reduce"
    );
    assert_eq!(tensor_ops(&z1[0], "all_gather").len(), 1);

    let fsdp = device_layout("FSDP, 2 ranks", world, &zero(Stage::Three), &config);
    let (gathers, scatters) = (
        tensor_ops(&fsdp[0], "all_gather"),
        tensor_ops(&fsdp[0], "reduce_scatter"),
    );
    assert!(!gathers.is_empty(), "FSDP: the units are gathered");
    assert_eq!(
        gathers.len(),
        scatters.len(),
        "FSDP: one gather in the forward, one reduce-scatter in the backward per unit"
    );

    // HSDP: shard over 2 ranks, replicate over 2; each unit's shard gradient, averaged over
    // its shard group by the backward's reduce-scatter, is averaged across the replicas with
    // the other units' in one all-reduce.
    let hsdp = device_layout(
        "HSDP 2 x 2",
        4,
        &Parallelism {
            zero: Some(Stage::Three),
            replicate: 2,
            ..Parallelism::default()
        },
        &config,
    );
    for (r, calls) in hsdp.iter().enumerate() {
        let shard_group = &tensor_ops(calls, "reduce_scatter")[0].members;
        let across_replicas = tensor_ops(calls, "all_reduce")
            .into_iter()
            .filter(|c| c.members.len() == 2 && &c.members != shard_group)
            .count();
        assert_eq!(
            across_replicas, 1,
            "HSDP: rank {r}'s shards in one all-reduce"
        );
    }

    let overlap = device_layout(
        "DDP overlapped, 2 ranks",
        world,
        &Parallelism {
            overlap: true,
            ..Parallelism::default()
        },
        &config,
    );
    let reduced: usize = tensor_ops(&overlap[0], "all_reduce")
        .iter()
        .map(|c| c.bytes)
        .sum();
    assert_eq!(reduced, 4 * p, "overlapped DDP: every gradient once");

    let tp = device_layout(
        "TP 2 + SP",
        world,
        &Parallelism {
            tp: 2,
            sp: true,
            ..Parallelism::default()
        },
        &config,
    );
    assert!(
        tp[0]
            .iter()
            .all(|c| c.path == CallPath::Host || c.dtype == DType::F32),
        "TP + SP: f32 activations and gradients"
    );
    // After the backward's last collective, the gradients of every sequence-parallel norm
    // (replicated over the tensor-parallel group, each rank holding part of their sum) are
    // summed in one all-reduce, not one per norm.
    let tensor: Vec<&LoggedCall> = tp[0]
        .iter()
        .filter(|c| c.path == CallPath::Tensor)
        .collect();
    let trailing = tensor
        .iter()
        .rev()
        .take_while(|c| c.op == "all_reduce")
        .count();
    assert_eq!(
        trailing, 1,
        "TP + SP: the norms' gradients in one all-reduce"
    );
}

/// Pipeline parallelism under each schedule (pp 2, 4 micro-batches, the tiny GPT with 4
/// blocks so that every schedule has a block per stage): the boundary tensors go through
/// tensor calls (NCCL's device sends on CUDA), the host carries only their small headers and
/// the loss, and each rank's tensor sends to the other come in the order the other receives
/// them: NCCL matches the device messages of one direction in the order they were sent, and
/// ZBV's second rank wants one of them before one sent earlier (the runtime runs the
/// schedule with its receives in send order).
#[test]
fn pipeline_transfers_are_device_messages_taken_in_send_order() {
    use burn_pipeline::ScheduleKind;
    let mut config = config();
    config.model.n_layers = 4;
    config.grad_accum = 4;
    let corpus = Corpus::load_default().expect("the bundled corpus");
    for schedule in ScheduleKind::GENERATED {
        let pipeline = Parallelism {
            pp: 2,
            pipeline: PipelineLayout {
                schedule,
                virtual_stages: (schedule == ScheduleKind::Interleaved1F1B).then_some(2),
                ..PipelineLayout::default()
            },
            ..Parallelism::default()
        };
        let split = Default::default();
        let pp = step_calls(2, |group, each_step| {
            let each = &mut |_: &_| each_step();
            train_gpt_pipeline(group, &config, &pipeline, &split, &corpus, each)?;
            Ok(())
        });
        let what = format!("pp 2 {schedule}");
        for (r, calls) in pp.iter().enumerate() {
            println!("{}", describe(&format!("{what}, rank {r}"), calls));
            assert!(
                !tensor_ops(calls, "send").is_empty() && !tensor_ops(calls, "recv").is_empty(),
                "{what}: rank {r} sends and receives its boundary tensors as tensors"
            );
        }
        assert_no_host_copies(&what, &pp);
        assert_sends_meet_receives_in_order(&what, &pp);
    }
}

/// Ring attention (context parallelism 2 and 4): its K/V blocks and their gradients rotate
/// through tensor sends and receives, each rank's sends to its neighbour in the order the
/// neighbour receives them, and nothing bulky goes through the host.
#[test]
fn ring_attention_blocks_are_device_messages_in_send_order() {
    let config = config();
    for cp in [2, 4] {
        let parallel = Parallelism {
            cp,
            ..Parallelism::default()
        };
        let what = format!("cp {cp} ring");
        let calls = device_layout(&what, cp, &parallel, &config);
        assert!(
            !tensor_ops(&calls[0], "send").is_empty(),
            "{what}: the blocks rotate by tensor sends"
        );
        assert_sends_meet_receives_in_order(&what, &calls);
    }
}

/// Each rank's tensor sends to each other rank (tag and bytes) are, in order, that rank's
/// tensor receives from it.
fn assert_sends_meet_receives_in_order(what: &str, calls: &[Vec<LoggedCall>]) {
    let p2p = |rank: usize, op: &str, peer: usize| -> Vec<(u64, usize)> {
        tensor_ops(&calls[rank], op)
            .into_iter()
            .filter_map(|c| match c.peer {
                Some((p, tag)) if p == peer => Some((tag, c.bytes)),
                _ => None,
            })
            .collect()
    };
    for from in 0..calls.len() {
        for to in (0..calls.len()).filter(|&to| to != from) {
            assert_eq!(
                p2p(from, "send", to),
                p2p(to, "recv", from),
                "{what}: the tensors rank {from} sends rank {to} (tag, bytes), in order, are \
                 the ones rank {to} receives from it"
            );
        }
    }
}

/// Expert parallelism: its figures, printed (what still stages through the host: MoE's
/// routing plan is read to the host), and the same sequence on every rank of the expert
/// group.
#[test]
fn expert_parallel_steps_are_logged() {
    let mut moe = tiny_gpt_run(STEP + 2);
    moe.model.moe = Some(burn_moe::MoeConfig::new(moe.model.d_model, 48, 4, 2));
    let ep = layout_calls(
        2,
        &Parallelism {
            ep: 2,
            ..Parallelism::default()
        },
        &moe,
    );
    println!("{}", describe("ep 2", &ep[0]));
    assert_same_sequence("ep 2", &ep);
    assert!(
        !tensor_ops(&ep[0], "all_to_all").is_empty(),
        "ep: tokens reach their experts by all-to-all"
    );
}
