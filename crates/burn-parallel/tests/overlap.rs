//! `OverlappedDdp` (gradient all-reduce during backward) against the non-overlapped DDP path
//! and single-device training: losses and final parameters after several SGD and AdamW steps,
//! at 2 and 3 thread ranks, with a parameter used twice (tied), parameters used by one rank or
//! by none, and gradient accumulation. Also: why Burn's own gradient sync cannot be used on
//! Flex, that the buckets really are sent during backward, and that failures are typed errors.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::module::{Module, Param, ParamId};
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::overlap::{GradHook, OverlappedDdp, grad_hook};
use burn_parallel::{CollectiveError, DistributedDataParallel, ProcessGroup, ReduceOp, run_local};

/// Three linear layers, a square matrix used twice (`tied`: after `a` and, transposed, after
/// `b`), a vector only rank 0 uses, and one nobody uses.
#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
    c: Linear,
    tied: Param<Tensor<2>>,
    rank0_only: Param<Tensor<1>>,
    unused: Param<Tensor<1>>,
}

/// Deterministic values, different for every `salt`.
fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + salt * 13) as f32 * 0.37).sin() * 0.5)
        .collect()
}

fn param<const D: usize>(shape: [usize; D], salt: usize, device: &Device) -> Param<Tensor<D>> {
    let n = shape.iter().product();
    Param::from_data(TensorData::new(values(n, salt), shape), device)
}

fn linear(d_in: usize, d_out: usize, salt: usize, device: &Device) -> Linear {
    let mut layer = burn::nn::LinearConfig::new(d_in, d_out).init(device);
    layer.weight = param([d_in, d_out], salt, device);
    layer.bias = Some(param([d_out], salt + 1, device));
    layer
}

fn net(device: &Device) -> Net {
    Net {
        a: linear(3, 4, 1, device),
        b: linear(4, 4, 3, device),
        c: linear(4, 1, 5, device),
        tied: param([4, 4], 7, device),
        rank0_only: param([2], 8, device),
        unused: param([3], 9, device),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    /// Only the three layers.
    Plain,
    /// Also `tied` twice and `rank0_only` on rank 0.
    Shared,
}

impl Net {
    /// The loss of `rank`'s rows.
    fn loss(&self, x: Tensor<2>, y: Tensor<2>, rank: usize, variant: Variant) -> Tensor<1> {
        let mut h = self.a.forward(x).tanh();
        if variant == Variant::Shared {
            h = h.matmul(self.tied.val()).tanh();
        }
        h = self.b.forward(h).tanh();
        if variant == Variant::Shared {
            h = h.matmul(self.tied.val().transpose());
        }
        let err = self.c.forward(h) - y;
        let mut loss = (err.clone() * err).mean();
        if variant == Variant::Shared && rank == 0 {
            loss = loss + self.rank0_only.val().powf_scalar(2.0).sum() * 0.1;
        }
        loss
    }
}

/// Rank `rank`'s rows at `step`, micro-step `micro`.
fn batch(step: usize, micro: usize, rank: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let salt = 100 + step * 31 + micro * 17 + rank * 5;
    let x = Tensor::from_data(TensorData::new(values(12, salt), [4, 3]), device);
    let y = Tensor::from_data(TensorData::new(values(4, salt + 1), [4, 1]), device);
    (x, y)
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    AdamW,
}

impl Opt {
    fn init(self) -> ModuleOptimizer {
        match self {
            Opt::Sgd => SgdConfig::new().init(),
            Opt::AdamW => AdamWConfig::new().with_weight_decay(0.1).init(),
        }
    }
    fn lr(self) -> f64 {
        match self {
            Opt::Sgd => 0.1,
            Opt::AdamW => 0.02,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Setup {
    ranks: usize,
    variant: Variant,
    opt: Opt,
    micro_steps: usize,
    steps: usize,
}

/// Per-step losses and the final parameters in visiting order.
type Run = (Vec<f32>, Vec<Vec<f32>>);

fn flat(model: &Net) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(
                param
                    .val()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec()
                    .unwrap(),
            );
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// Single device: the loss is the mean over ranks and micro-steps of the per-rank losses.
fn oracle(s: Setup) -> Run {
    let device = Device::flex().autodiff();
    let mut model = net(&device);
    let mut optim = s.opt.init();
    let mut losses = Vec::new();
    for step in 0..s.steps {
        let mut total: Option<Tensor<1>> = None;
        for micro in 0..s.micro_steps {
            for rank in 0..s.ranks {
                let (x, y) = batch(step, micro, rank, &device);
                let l = model.loss(x, y, rank, s.variant);
                total = Some(match total {
                    None => l,
                    Some(t) => t + l,
                });
            }
        }
        let loss = total.unwrap() / (s.ranks * s.micro_steps) as f32;
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(s.opt.lr(), model, grads);
    }
    (losses, flat(&model))
}

/// The mean over ranks of this rank's mean micro-step loss.
fn global_loss(group: &ProcessGroup, local: f32) -> burn_parallel::Result<f32> {
    Ok(group.all_reduce_f32(vec![local], ReduceOp::Avg)?[0])
}

/// DDP with the all-reduce after backward: micro-batch gradients summed locally (Burn's
/// `GradientsAccumulator`, losses scaled by `1 / k`), then one `all_reduce_grads`.
fn after_backward(s: Setup) -> Vec<Run> {
    run_local(s.ranks, |group| {
        let device = Device::flex().autodiff();
        let rank = group.rank();
        let ddp = DistributedDataParallel::new(group.clone()).with_bucket_bytes(40);
        let mut model = net(&device);
        let mut optim = s.opt.init();
        let mut losses = Vec::new();
        for step in 0..s.steps {
            let mut acc = GradientsAccumulator::new();
            let mut local = 0.0;
            for micro in 0..s.micro_steps {
                let (x, y) = batch(step, micro, rank, &device);
                let loss = model.loss(x, y, rank, s.variant);
                local += loss.clone().into_scalar::<f32>() / s.micro_steps as f32;
                let loss = loss / s.micro_steps as f32;
                acc.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            losses.push(global_loss(&group, local)?);
            let grads = ddp.all_reduce_grads(&model, acc.grads())?;
            model = optim.step(s.opt.lr(), model, grads);
        }
        Ok((losses, flat(&model)))
    })
    .unwrap()
}

/// DDP with the all-reduce during backward: host buckets, or (`device_buckets`, through
/// `ProcessGroup::with_tensor_path`) the buckets NCCL with CUDA takes: flat tensors on the
/// gradients' device, each an asynchronous all-reduce (`ProcessGroup::all_reduce_async`).
fn overlapped(s: Setup, device_buckets: bool) -> Vec<Run> {
    run_local(s.ranks, |group| {
        let group = group.with_tensor_path(device_buckets);
        let device = Device::flex().autodiff();
        let rank = group.rank();
        let ddp = OverlappedDdp::new(group.clone()).with_bucket_bytes(40);
        let mut model = net(&device);
        let mut optim = s.opt.init();
        let mut losses = Vec::new();
        for step in 0..s.steps {
            let mut overlap = ddp.start(&model)?;
            let mut local = 0.0;
            // Micro-steps without communication, on the plain module.
            for micro in 0..s.micro_steps - 1 {
                let (x, y) = batch(step, micro, rank, &device);
                let loss = model.loss(x, y, rank, s.variant);
                local += loss.clone().into_scalar::<f32>() / s.micro_steps as f32;
                overlap.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model))?;
            }
            // The last one through the hooks.
            let hooked = overlap.hook(model.clone());
            let (x, y) = batch(step, s.micro_steps - 1, rank, &device);
            let loss = hooked.loss(x, y, rank, s.variant);
            local += loss.clone().into_scalar::<f32>() / s.micro_steps as f32;
            let local_grads = GradientsParams::from_grads(overlap.backward(loss)?, &model);
            // The hooks took the gradients (the leaves are the model's own parameters).
            assert!(local_grads.is_empty());
            drop(hooked);
            losses.push(global_loss(&group, local)?);
            let grads = overlap.finish(&model)?;
            model = optim.step(s.opt.lr(), model, grads);
        }
        Ok((losses, flat(&model)))
    })
    .unwrap()
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1.0)
}

fn assert_runs_match(what: &str, got: &Run, want: &Run) {
    assert_eq!(got.0.len(), want.0.len());
    for (step, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        assert!(close(*a, *b), "{what}: loss at step {step}: {a} vs {b}");
    }
    assert_eq!(got.1.len(), want.1.len());
    for (p, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(close(*x, *y), "{what}: parameter {p}[{i}]: {x} vs {y}");
        }
    }
}

fn check(s: Setup) {
    let want = oracle(s);
    let plain = after_backward(s);
    let over = overlapped(s, false);
    let on_device = overlapped(s, true);
    for rank in 0..s.ranks {
        assert_runs_match(
            &format!("{s:?} overlapped with device buckets rank {rank} vs single device"),
            &on_device[rank],
            &want,
        );
        assert_runs_match(
            &format!("{s:?} DDP rank {rank} vs single device"),
            &plain[rank],
            &want,
        );
        assert_runs_match(
            &format!("{s:?} overlapped rank {rank} vs single device"),
            &over[rank],
            &want,
        );
        assert_runs_match(
            &format!("{s:?} overlapped vs DDP, rank {rank}"),
            &over[rank],
            &plain[rank],
        );
    }
    // The losses moved: the comparison is not between untrained models.
    assert!(want.0.first() != want.0.last(), "{:?}", want.0);
}

#[test]
fn overlapped_matches_ddp_and_single_device_sgd_and_adamw_at_2_and_3_ranks() {
    for ranks in [2, 3] {
        for opt in [Opt::Sgd, Opt::AdamW] {
            check(Setup {
                ranks,
                variant: Variant::Plain,
                opt,
                micro_steps: 1,
                steps: 5,
            });
        }
    }
}

#[test]
fn tied_and_unused_parameters_match_at_2_and_3_ranks() {
    for ranks in [2, 3] {
        check(Setup {
            ranks,
            variant: Variant::Shared,
            opt: Opt::AdamW,
            micro_steps: 1,
            steps: 5,
        });
    }
}

#[test]
fn gradient_accumulation_matches_at_2_and_3_ranks() {
    for (ranks, variant) in [(2, Variant::Shared), (3, Variant::Plain)] {
        check(Setup {
            ranks,
            variant,
            opt: Opt::Sgd,
            micro_steps: 3,
            steps: 4,
        });
    }
}

/// Parameters that no rank uses get no gradient, so AdamW neither moves them (weight decay)
/// nor keeps state for them; the one rank 0 alone uses is averaged with the others' zeros.
#[test]
fn unused_parameters_get_no_gradient_and_one_rank_parameters_are_averaged() {
    let out = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let ddp = OverlappedDdp::new(group.clone());
        let model = net(&device);
        let overlap = ddp.start(&model)?;
        let hooked = overlap.hook(model.clone());
        let (x, y) = batch(0, 0, group.rank(), &device);
        overlap.backward(hooked.loss(x, y, group.rank(), Variant::Shared))?;
        let grads = overlap.finish(&model)?;
        let rank0_only = grads
            .get::<1>(model.rank0_only.id)
            .map(|g| g.into_data().try_to_vec::<f32>().unwrap());
        Ok((rank0_only, grads.get::<1>(model.unused.id).is_some()))
    })
    .unwrap();
    let p = values(2, 8);
    let want: Vec<f32> = p.iter().map(|v| 0.2 * v / 2.0).collect();
    for (rank0_only, unused) in out {
        let got = rank0_only.expect("rank 0's parameter has a gradient on every rank");
        for (a, b) in got.iter().zip(&want) {
            assert!(close(*a, *b), "{got:?} vs {want:?}");
        }
        assert!(!unused, "a parameter nobody uses gets no gradient");
    }
}

/// A deeper MLP whose activation after the first layer carries a probe: when the probe runs
/// in backward (before the first layer's backward), how many buckets were already sent?
#[derive(Module, Debug)]
struct Deep {
    layers: Vec<Linear>,
}

#[test]
fn buckets_are_sent_while_backward_runs() {
    for device_buckets in [false, true] {
        buckets_are_sent_while_backward_runs_with(device_buckets);
    }
}

fn buckets_are_sent_while_backward_runs_with(device_buckets: bool) {
    let out = run_local(2, |group| {
        let group = group.with_tensor_path(device_buckets);
        let device = Device::flex().autodiff();
        let depth = 6;
        let model = Deep {
            layers: (0..depth)
                .map(|l| linear(8, 8, 10 + 2 * l, &device))
                .collect(),
        };
        // One parameter per bucket.
        let ddp = OverlappedDdp::new(group.clone()).with_bucket_bytes(1);
        let mut seen = Vec::new();
        for step in 0..3 {
            let overlap = ddp.start(&model)?;
            let buckets = overlap.bucket_count();
            let sent = overlap.buckets_sent();
            let at_probe = Arc::new(Mutex::new(None));
            let hooked = overlap.hook(model.clone());
            let x = Tensor::<2>::from_data(
                TensorData::new(values(16, step + group.rank()), [2, 8]),
                &device,
            );
            let mut h = hooked.layers[0].forward(x).tanh();
            let record = at_probe.clone();
            let probe = GradHook::observe("probe", move |_| {
                *record.lock().unwrap() = Some(sent.load(Ordering::Acquire));
            });
            h = grad_hook(h, &Tensor::zeros([1], &device), probe);
            for layer in &hooked.layers[1..] {
                h = layer.forward(h).tanh();
            }
            overlap.backward(h.sum())?;
            overlap.finish(&model)?;
            let before_first_layer = at_probe.lock().unwrap().expect("the probe ran");
            seen.push((before_first_layer, buckets));
        }
        Ok(seen)
    })
    .unwrap();
    for seen in out {
        println!(
            "device buckets {device_buckets}: (buckets sent before the first layer's \
             backward, buckets) per step: {seen:?}"
        );
        let (first, buckets) = seen[0];
        assert_eq!(buckets, 12);
        // The first step measures the depth: its hooks all run at the end of backward.
        assert_eq!(first, 0, "{seen:?}");
        for &(sent, _) in &seen[1..] {
            // Later steps: most of layers 2..6's ten buckets are sent before layer 1's backward.
            assert!(
                sent >= 6,
                "buckets sent before the first layer's backward: {seen:?}"
            );
        }
    }
}

/// Burn's own route (`Tensor::set_distributed`, whose gradients autodiff hands to
/// `DistributedOps::submit_gradient_sync`) is not available on Flex: marking a parameter
/// panics in `Dispatch::set_distributed_params`. If a Burn upgrade makes this pass, the
/// backend route becomes worth revisiting.
#[test]
fn burns_distributed_gradient_sync_is_unavailable_on_flex() {
    let device = Device::flex().autodiff();
    let param = Tensor::<1>::zeros([2], &device).require_grad();
    assert!(!param.is_distributed());
    let result = std::panic::catch_unwind(move || param.set_distributed(ParamId::new()));
    let message = match result {
        Ok(_) => panic!("set_distributed on Flex worked: Burn's gradient sync may now be usable"),
        Err(e) => e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    };
    assert!(
        message.contains("Distributed operations are not supported"),
        "{message}"
    );
}

/// A rank whose model differs (another shape) makes `finish` a typed mismatch on every rank.
#[test]
fn a_rank_with_another_model_is_a_mismatch_error_on_every_rank() {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let result = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let group = group.with_timeout(Duration::from_secs(20));
        let ddp = OverlappedDdp::new(group.clone());
        let width = if group.rank() == 1 { 5 } else { 4 };
        let model = linear(3, width, 1, &device);
        let overlap = ddp.start(&model)?;
        let hooked = overlap.hook(model.clone());
        let (x, _) = batch(0, 0, group.rank(), &device);
        overlap.backward(hooked.forward(x).sum())?;
        let result = overlap.finish(&model);
        if let Err(e) = &result {
            errors.lock().unwrap().push(e.to_string());
        }
        result.map(|_| ())
    });
    assert!(result.is_err());
    let errors = errors.lock().unwrap();
    assert!(!errors.is_empty(), "every rank failed");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("mismatch") || e.contains("Mismatch")),
        "{errors:?}"
    );
}

/// A rank that fails before sending its buckets: the others' `finish` ends with a typed error
/// (the peer failed), not a hang.
#[test]
fn a_failed_rank_is_an_error_not_a_hang() {
    for device_buckets in [false, true] {
        a_failed_rank_is_an_error_not_a_hang_with(device_buckets);
    }
}

fn a_failed_rank_is_an_error_not_a_hang_with(device_buckets: bool) {
    let seen = Arc::new(Mutex::new(None));
    let result = run_local(2, |group| {
        let device = Device::flex().autodiff();
        let group = group
            .with_timeout(Duration::from_secs(20))
            .with_tensor_path(device_buckets);
        let ddp = OverlappedDdp::new(group.clone());
        let model = net(&device);
        let overlap = ddp.start(&model)?;
        if group.rank() == 1 {
            return Err(CollectiveError::InvalidArgument {
                rank: 1,
                op: "test".into(),
                reason: "this rank gives up".into(),
            });
        }
        let hooked = overlap.hook(model.clone());
        let (x, y) = batch(0, 0, 0, &device);
        overlap.backward(hooked.loss(x, y, 0, Variant::Plain))?;
        let result = overlap.finish(&model);
        *seen.lock().unwrap() = Some(result.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        result.map(|_| ())
    });
    assert!(result.is_err());
    let seen = seen.lock().unwrap().clone().expect("rank 0 finished");
    let message = seen.expect_err("rank 0's finish fails");
    assert!(message.contains("rank 1"), "{message}");
}

/// Misuse is a typed error: finishing a step that neither hooked nor accumulated anything,
/// and accumulating after hooking.
#[test]
fn misuse_is_a_typed_error() {
    let out = run_local(1, |group| {
        let device = Device::flex().autodiff();
        let ddp = OverlappedDdp::new(group.clone());
        let model = net(&device);
        let empty = ddp.start(&model)?.finish(&model).unwrap_err().to_string();
        let mut overlap = ddp.start(&model)?;
        let _hooked = overlap.hook(model.clone());
        let late = overlap
            .accumulate(&model, GradientsParams::new())
            .unwrap_err()
            .to_string();
        Ok((empty, late))
    })
    .unwrap();
    let (empty, late) = &out[0];
    assert!(empty.contains("nothing to reduce"), "{empty}");
    assert!(late.contains("accumulate was called after hook"), "{late}");
}

/// `TrainStep` with `with_overlap` gives the losses, gradient norms and parameters of the plain
/// data-parallel `TrainStep` (AdamW, global-norm clipping that bites), 2 and 3 ranks, in fp32,
/// bf16 and fp16 with a loss scaler, with one micro-batch and with accumulation.
#[test]
fn train_step_with_overlap_matches_train_step() {
    use burn::tensor::DType;
    use burn_parallel::init::{Init, LinearInit};
    use burn_parallel::precision::{LossScaler, MixedPrecision};
    use burn_parallel::train::TrainStep;

    #[derive(Module, Debug)]
    struct Two {
        fc1: burn_parallel::nn::Linear,
        fc2: burn_parallel::nn::Linear,
    }

    /// Per step (loss, gradient norm), and the final weights.
    type Outcome = (Vec<(f32, Option<f64>)>, Vec<Vec<f32>>);

    fn run(ranks: usize, overlap: bool, half: Option<&str>, micro: usize) -> Vec<Outcome> {
        run_local(ranks, |group| {
            let device = Device::flex().autodiff();
            let init = Init::new(7, &device);
            let mut model = Two {
                fc1: init.linear("fc1", LinearInit::new(3, 8)).unwrap(),
                fc2: init.linear("fc2", LinearInit::new(8, 1)).unwrap(),
            };
            let mut step = TrainStep::new(init.context())
                .with_data_parallel(group.clone())
                .with_clip(Some(0.005));
            if overlap {
                step = step.with_overlap(OverlappedDdp::new(group.clone()).with_bucket_bytes(64));
            }
            match half {
                Some("bf16") => step = step.with_precision(MixedPrecision::bf16()),
                Some("fp16") => {
                    step = step
                        .with_precision(MixedPrecision::f16())
                        .with_loss_scaler(LossScaler::new(1024.0));
                }
                _ => {}
            }
            let mut optim = AdamWConfig::new().init();
            let mut out = Vec::new();
            for s in 0..4 {
                let rank = group.rank();
                let (next, report) = step
                    .step_accumulated(
                        model,
                        micro,
                        |m: &Two, k| {
                            let (x, y) = batch(s, k, rank, &device);
                            // The compute dtype (the compute copy's, under mixed precision).
                            let dtype = m.fc1.weight.val().dtype();
                            let h = m.fc1.forward(x.cast(dtype))?.tanh();
                            let err = (m.fc2.forward(h)? - y.cast(dtype)).cast(DType::F32);
                            Ok::<_, burn_parallel::TpError>((err.clone() * err).mean())
                        },
                        &mut optim,
                        1e-2,
                    )
                    .unwrap();
                model = next;
                out.push((report.loss, report.grad_norm));
            }
            let mut params = Vec::new();
            for p in [model.fc1.weight.val(), model.fc2.weight.val()] {
                params.push(p.into_data().try_to_vec::<f32>().unwrap());
            }
            Ok((out, params))
        })
        .unwrap()
    }
    // Mixed precision too (the hooks on the compute copy, fp16 with a loss scaler): the same
    // low-precision gradients, averaged in fp32 either way.
    // And gradient accumulation (3 micro-batches: two accumulated, the last one hooked).
    for (ranks, half, micro) in [
        (2, None, 1),
        (3, None, 1),
        (2, Some("bf16"), 1),
        (2, Some("fp16"), 1),
        (3, None, 3),
        // bf16 on 2 ranks: on 3, the two paths' buckets cut the ring's chunks differently, so
        // bf16's sums round in another order.
        (2, Some("bf16"), 3),
    ] {
        let plain = run(ranks, false, half, micro);
        let over = run(ranks, true, half, micro);
        for (p, o) in plain.iter().zip(&over) {
            for ((lp, np), (lo, no)) in p.0.iter().zip(&o.0) {
                assert!(close(*lp, *lo), "{half:?}: loss {lp} vs {lo}");
                let (np, no) = (np.unwrap(), no.unwrap());
                assert!(
                    (np - no).abs() <= 1e-5 * np.max(1.0),
                    "{half:?}: norm {np} vs {no}"
                );
                assert!(np > 0.005, "clipping is active: {np}");
            }
            for (a, b) in p.1.iter().zip(&o.1) {
                for (x, y) in a.iter().zip(b) {
                    assert!(close(*x, *y), "{half:?}: parameter {x} vs {y}");
                }
            }
        }
    }
}
