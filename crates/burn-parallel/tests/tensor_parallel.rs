//! The tensor-parallel layers of `burn_parallel::nn` (built by `Init` from a `TpPlan`) against
//! their unsharded versions, for tensor-parallel sizes 1 to 4 (ranks as threads): forward
//! output, input gradient and every weight-gradient shard, with and without sequence
//! parallelism, uneven splits and an uneven (padded) vocabulary; the vocabulary-parallel
//! cross-entropy with label smoothing and ignored targets; layout-independent dropout; and the
//! checks that catch mis-paired layers and tensors.

use burn::tensor::activation::log_softmax;
use burn::tensor::module::{embedding, linear};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::autograd::{copy_to_group, even_split};
use burn_parallel::init::{Init, LinearInit};
use burn_parallel::nn::{Embedding, Linear, LinearSplit};
use burn_parallel::plan::TpPlan;
use burn_parallel::tensor_parallel::{
    CrossEntropyOptions, DropoutSite, Placement, SeededDropout, Shard, Split, TpError, TpTensor,
    vocab_parallel_cross_entropy,
};
use burn_parallel::{ProcessGroup, run_local};

/// Deterministic values in [-1, 1).
fn data(seed: u64, shape: &[usize]) -> TensorData {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    TensorData::new(values, shape.to_vec())
}

fn leaf<const D: usize>(seed: u64, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(data(seed, &shape), device).require_grad()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// `a` and `b` agree within `tol` relative to the largest magnitude of `a` (exact when 0).
fn close<const D: usize>(a: Tensor<D>, b: Tensor<D>, tol: f32, what: &str) {
    close_scaled(a, b, tol, 0.0, what)
}

/// As [`close`], relative to at least `floor` (for gradients that are zero up to rounding).
fn close_scaled<const D: usize>(a: Tensor<D>, b: Tensor<D>, tol: f32, floor: f32, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b) = (values(a), values(b));
    let scale = a.iter().fold(floor.max(1e-12), |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let rel = (x - y).abs() / scale;
        assert!(
            rel <= tol,
            "{what}: element {i}: {y} vs unsharded {x} (rel {rel:.2e})\n{a:?}\n{b:?}"
        );
    }
}

/// Relative tolerance of sharded against unsharded products (sums in another order).
const TOL: f32 = 1e-6;

fn device() -> Device {
    Device::flex().autodiff()
}

fn shard_range(full: usize, group: &ProcessGroup) -> (usize, usize) {
    let sizes = even_split(full, group.size());
    (sizes[..group.rank()].iter().sum(), sizes[group.rank()])
}

/// The layer `name` built from seed 7 under `plan` on this rank, and the same layer unsharded.
fn linear_pair(
    group: &ProcessGroup,
    plan: TpPlan,
    name: &str,
    spec: LinearInit,
) -> (Linear, Linear) {
    let dev = device();
    let init = Init::new(7, &dev).with_tp(group, plan).unwrap();
    let split = init.linear(name, spec).unwrap();
    init.finish().unwrap();
    let full = Init::new(7, &dev).linear(name, spec).unwrap();
    (split, full)
}

/// The layer's share of its split dimension (of size `full`): all of it at tp 1.
fn shard_of(layer: &Linear, full: usize) -> Shard {
    match &layer.split {
        LinearSplit::Column { shard, .. } | LinearSplit::Row { shard, .. } => *shard,
        LinearSplit::Replicated => Shard {
            full,
            start: 0,
            len: full,
            stored: full,
        },
    }
}

/// A leaf on the test device holding `t`'s values.
fn leaf_of<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    Tensor::from_data(t.detach().into_data(), &device()).require_grad()
}

/// This rank's part of a full `[b, s, d]` tensor: all of it, or its tokens under SP.
fn local_part(full: Tensor<3>, sp: bool, group: &ProcessGroup) -> Tensor<3> {
    if sp {
        let (start, len) = shard_range(full.dims()[1], group);
        full.narrow(1, start, len)
    } else {
        full
    }
}

#[test]
fn colwise_linear_matches_unsharded() {
    for tp in 1..=4 {
        for sp in [false, true] {
            run_local(tp, |group| {
                let dev = device();
                // 7 outputs: uneven for tp 2, 3, 4; 5 tokens: uneven sequence shards.
                let spec = LinearInit::new(5, 7).with_bias(true);
                let plan = TpPlan::new().colwise("up").with_sequence_parallel(sp);
                let (layer, full) = linear_pair(&group, plan, "up", spec);
                let shard = shard_of(&layer, 7);
                let x = leaf(1, [2, 5, 5], &dev);
                let r = Tensor::<3>::from_data(data(4, &[2, 5, 7]), &dev);
                let y = full.forward(x.clone()).unwrap();
                let g = (y.clone() * r.clone()).sum().backward();

                let xt = leaf_of(local_part(x.clone(), sp, &group));
                let out = layer.forward(xt.clone()).unwrap();
                let (start, len) = (shard.start, shard.len);
                close(y.narrow(2, start, len), out.clone(), TOL, "output shard");
                let gt = (out * r.narrow(2, start, len)).sum().backward();
                close(
                    local_part(x.grad(&g).unwrap(), sp, &group),
                    xt.grad(&gt).unwrap(),
                    TOL,
                    "input grad",
                );
                let w_grad = full.weight.val().grad(&g).unwrap().narrow(1, start, len);
                close(
                    w_grad,
                    layer.weight.val().grad(&gt).unwrap(),
                    TOL,
                    "weight grad shard",
                );
                let b_grad = full.bias.as_ref().unwrap().val().grad(&g).unwrap();
                let b_tp = layer.bias.as_ref().unwrap().val().grad(&gt).unwrap();
                close(b_grad.narrow(0, start, len), b_tp, TOL, "bias grad shard");
                Ok(())
            })
            .unwrap_or_else(|e| panic!("tp {tp} sp {sp}: {e}"));
        }
    }
}

#[test]
fn rowwise_linear_matches_unsharded() {
    for tp in 1..=4 {
        for sp in [false, true] {
            run_local(tp, |group| {
                let dev = device();
                let spec = LinearInit::new(7, 4).with_bias(true);
                let plan = TpPlan::new().rowwise("down").with_sequence_parallel(sp);
                let (layer, full) = linear_pair(&group, plan, "down", spec);
                let shard = shard_of(&layer, 7);
                let x = leaf(1, [2, 5, 7], &dev);
                let r = Tensor::<3>::from_data(data(4, &[2, 5, 4]), &dev);
                let y = full.forward(x.clone()).unwrap();
                let g = (y.clone() * r.clone()).sum().backward();

                // The input is a column layer's output: this rank's features, every token.
                let xt = leaf_of(x.clone().narrow(2, shard.start, shard.len));
                let out = layer.forward(xt.clone()).unwrap();
                close(local_part(y, sp, &group), out.clone(), TOL, "output");
                let gt = (out * local_part(r, sp, &group)).sum().backward();
                close(
                    x.grad(&g).unwrap().narrow(2, shard.start, shard.len),
                    xt.grad(&gt).unwrap(),
                    TOL,
                    "input grad shard",
                );
                close(
                    full.weight
                        .val()
                        .grad(&g)
                        .unwrap()
                        .narrow(0, shard.start, shard.len),
                    layer.weight.val().grad(&gt).unwrap(),
                    TOL,
                    "weight grad shard",
                );
                // The bias is added once, after the sum; under SP each rank sees its tokens'
                // part of its gradient, summed over the group in the backward.
                close(
                    full.bias.as_ref().unwrap().val().grad(&g).unwrap(),
                    layer.bias.as_ref().unwrap().val().grad(&gt).unwrap(),
                    TOL,
                    "bias grad",
                );
                Ok(())
            })
            .unwrap_or_else(|e| panic!("tp {tp} sp {sp}: {e}"));
        }
    }
}

#[test]
fn vocab_embedding_matches_unsharded_with_uneven_vocab() {
    for tp in 1..=4 {
        run_local(tp, |group| {
            let dev = device();
            let (vocab, d) = (11, 3); // 11 ids: padded for tp 2, 3, 4
            let init = Init::new(5, &dev)
                .with_tp(&group, TpPlan::new().vocab("emb"))
                .unwrap();
            let emb: Embedding = init.embedding("emb", vocab, d, 0.5).unwrap();
            init.finish().unwrap();
            let w = Init::new(5, &dev)
                .embedding("emb", vocab, d, 0.5)
                .unwrap()
                .weight
                .val();
            let ids: Vec<i64> = vec![0, 10, 3, 7, 7, 1, 9, 5, 2, 10];
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 5]), &dev);
            let r = Tensor::<3>::from_data(data(2, &[2, 5, d]), &dev);
            let y = embedding(w.clone(), tokens.clone());
            let g = (y.clone() * r.clone()).sum().backward();

            let shard = emb.split.as_ref().map(|s| s.shard).unwrap_or(Shard {
                full: vocab,
                start: 0,
                len: vocab,
                stored: vocab,
            });
            assert_eq!(shard.stored, vocab.div_ceil(tp));
            let out = emb.forward(tokens.clone()).unwrap();
            close(y, out.clone(), 0.0, "output");
            let gt = (out * r).sum().backward();
            let wg = emb.weight.val().grad(&gt).unwrap();
            if shard.len > 0 {
                let real = w.grad(&g).unwrap().narrow(0, shard.start, shard.len);
                close(
                    real,
                    wg.clone().narrow(0, 0, shard.len),
                    0.0,
                    "weight grad shard",
                );
            }
            let padding = if shard.stored > shard.len {
                values(wg.narrow(0, shard.len, shard.stored - shard.len))
            } else {
                vec![]
            };
            assert!(
                padding.iter().all(|v| *v == 0.0),
                "padding rows got gradient {padding:?}"
            );
            // An id outside the vocabulary is an error naming the layer, not a silent zero row.
            let bad = Tensor::<2, Int>::from_data([[1, 11]], &dev);
            match emb.forward(bad) {
                Err(TpError::OutOfVocabulary {
                    layer,
                    id: 11,
                    vocab: 11,
                }) => assert_eq!(layer, "emb"),
                other => panic!("expected an out-of-vocabulary error, got {other:?}"),
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("tp {tp}: {e}"));
    }
}

/// Reference cross-entropy with PyTorch's label smoothing and ignore index.
fn reference_ce(logits: Tensor<2>, targets: &[i64], options: CrossEntropyOptions) -> Tensor<1> {
    let [n, v] = logits.dims();
    let device = logits.device();
    let lp = log_softmax(logits, 1);
    let ignore = options.ignore_index;
    let ids: Vec<i64> = targets
        .iter()
        .map(|&t| if Some(t) == ignore { 0 } else { t })
        .collect();
    let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, 1]), &device);
    let nll = lp.clone().gather(1, t).neg().reshape([n]);
    let eps = options.label_smoothing;
    let smooth = lp.sum_dim(1).neg().reshape([n]) / v as f64;
    let per = nll * (1.0 - eps) + smooth * eps;
    let keep: Vec<f32> = targets
        .iter()
        .map(|&t| if Some(t) == ignore { 0.0 } else { 1.0 })
        .collect();
    let count = keep.iter().sum::<f32>().max(1.0);
    (per * Tensor::<1>::from_data(TensorData::new(keep, [n]), &device)).sum() / count
}

#[test]
fn vocab_parallel_cross_entropy_matches_unsharded() {
    let cases = [
        CrossEntropyOptions::default(),
        CrossEntropyOptions {
            label_smoothing: 0.1,
            ignore_index: None,
        },
        CrossEntropyOptions {
            label_smoothing: 0.0,
            ignore_index: Some(-100),
        },
        CrossEntropyOptions {
            label_smoothing: 0.2,
            ignore_index: Some(-100),
        },
    ];
    for tp in 1..=4 {
        for options in cases {
            run_local(tp, |group| {
                let dev = device();
                let (n, d, vocab) = (6, 4, 11);
                let x = leaf(1, [n, d], &dev);
                let w = leaf(2, [d, vocab], &dev);
                let targets: Vec<i64> = vec![0, 10, -100, 5, 4, 9];
                let targets: Vec<i64> = if options.ignore_index.is_some() {
                    targets
                } else {
                    targets.into_iter().map(|t| t.max(0)).collect()
                };
                let logits = linear(x.clone(), w.clone(), None) * 3.0;
                let loss = reference_ce(logits, &targets, options);
                let g = loss.clone().backward();

                // This rank's head columns, zero-padded to the stored width.
                let shard = Split::Padded { multiple: 1 }
                    .shard(vocab, tp, group.rank(), "head")
                    .unwrap();
                let mut cols = w.clone().detach().narrow(1, shard.start, shard.len);
                if shard.stored > shard.len {
                    let pad = Tensor::<2>::zeros([d, shard.stored - shard.len], &dev);
                    cols = if shard.len == 0 {
                        pad
                    } else {
                        Tensor::cat(vec![cols, pad], 1)
                    };
                }
                let wt = leaf_of(cols);
                let xt = leaf(1, [n, d], &dev);
                let local = linear(copy_to_group(xt.clone(), &group), wt.clone(), None) * 3.0;
                let placement = Placement::Shard { dim: 1, shard };
                let lt = TpTensor::new(local, placement, &group).unwrap();
                let tt = Tensor::<1, Int>::from_data(TensorData::new(targets.clone(), [n]), &dev);
                let loss_tp = vocab_parallel_cross_entropy(lt, tt, options).unwrap();
                close(loss, loss_tp.clone(), TOL, "loss");
                let gt = loss_tp.backward();
                close(
                    x.grad(&g).unwrap(),
                    xt.grad(&gt).unwrap(),
                    1e-5,
                    "input grad",
                );
                let wg = wt.grad(&gt).unwrap();
                if shard.len > 0 {
                    let real = w.grad(&g).unwrap().narrow(1, shard.start, shard.len);
                    close(
                        real,
                        wg.clone().narrow(1, 0, shard.len),
                        1e-5,
                        "weight grad shard",
                    );
                }
                let pad = if shard.stored > shard.len {
                    values(wg.narrow(1, shard.len, shard.stored - shard.len))
                } else {
                    vec![]
                };
                assert!(
                    pad.iter().all(|v| *v == 0.0),
                    "padding columns got gradient"
                );
                Ok(())
            })
            .unwrap_or_else(|e| panic!("tp {tp} {options:?}: {e}"));
        }
    }
}

#[test]
fn dropout_is_layout_independent() {
    // The same seeded dropout on the hidden units of an MLP (up colwise, down rowwise): tp 1
    // gives the single-device masks; tp 2 and 3, with and without SP, reproduce them (each rank
    // draws the numbers of its hidden units' global positions).
    let run = |tp: usize, sp: bool| -> Vec<Vec<f32>> {
        run_local(tp, |group| {
            let dev = device();
            let (bs, s, d, f) = (2, 6, 4, 10);
            let plan = TpPlan::new()
                .colwise("up")
                .rowwise("down")
                .with_sequence_parallel(sp);
            let init = Init::new(3, &dev).with_tp(&group, plan).unwrap();
            let up = init.linear("up", LinearInit::new(d, f)).unwrap();
            let down = init.linear("down", LinearInit::new(f, d)).unwrap();
            init.finish().unwrap();
            let drop = SeededDropout::new(0.5, 9, "mlp.drop");
            let site = DropoutSite::new(&[bs, s, f], &[0, 0, shard_of(&up, f).start]);
            let x = local_part(
                Tensor::<3>::from_data(data(1, &[bs, s, d]), &dev),
                sp,
                &group,
            );
            let mut outs = Vec::new();
            for _ in 0..2 {
                let hidden = drop.forward(up.forward(x.clone()).unwrap(), &site);
                let out = down.forward(hidden).unwrap();
                let out = if sp {
                    group.all_gather(out, 1).unwrap()
                } else {
                    out
                };
                outs.push(values(out));
            }
            Ok(outs)
        })
        .unwrap()
        .swap_remove(0)
    };
    let reference = run(1, false);
    assert_ne!(reference[0], reference[1], "each call draws new numbers");
    for (tp, sp) in [(2, false), (2, true), (3, true)] {
        let other = run(tp, sp);
        for (a, b) in reference.iter().zip(&other) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "tp {tp} sp {sp}: {x} vs {y}"
                );
            }
        }
    }
}

fn layout_error<T: std::fmt::Debug>(r: Result<T, TpError>, needle: &str) -> String {
    match r {
        Err(e @ TpError::Layout { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(needle),
                "message {msg:?} should mention {needle:?}"
            );
            msg
        }
        other => panic!("expected a layout error mentioning {needle:?}, got {other:?}"),
    }
}

#[test]
fn mis_paired_layers_and_tensors_are_caught() {
    run_local(2, |group| {
        let dev = Device::flex();
        let plan = TpPlan::new().colwise("up").rowwise("down");
        let init = Init::new(1, &dev).with_tp(&group, plan).unwrap();
        let up = init.linear("up", LinearInit::new(8, 8)).unwrap();
        let down = init.linear("down", LinearInit::new(8, 8)).unwrap();
        init.finish().unwrap();
        let x = Tensor::<3>::from_data(data(1, &[2, 4, 8]), &dev);
        // The whole width into a row-parallel layer (it takes this rank's 4 features).
        let err = down.forward(x.clone()).unwrap_err();
        assert!(
            matches!(&err, TpError::Shape { layer, .. } if layer == "down"),
            "{err}"
        );
        // A feature shard into a column-parallel layer (it takes all 8).
        let hidden = up.forward(x.clone()).unwrap();
        let err = up.forward(hidden).unwrap_err();
        assert!(
            matches!(&err, TpError::Shape { layer, .. } if layer == "up"),
            "{err}"
        );
        // A linear given a norm's style, and heads that do not divide the group.
        let init = Init::new(1, &dev)
            .with_tp(&group, TpPlan::new().sequence_norm("q").colwise("k"))
            .unwrap();
        let err = init.linear("q", LinearInit::new(6, 6)).unwrap_err();
        assert!(
            matches!(&err, TpError::Plan(m) if m.contains("`q`")),
            "{err}"
        );
        let err = init
            .linear("k", LinearInit::new(6, 6).with_block(2))
            .unwrap_err();
        assert!(
            matches!(
                err,
                TpError::NotDivisible {
                    value: 3,
                    tp: 2,
                    ..
                }
            ),
            "3 heads of 2 over 2 ranks: {err}"
        );

        // The placement checks of a hand-written region.
        let replicated = TpTensor::replicated(x.clone(), &group);
        let shard = Split::Even.shard(8, 2, group.rank(), "hidden").unwrap();
        let local = x.clone().narrow(2, shard.start, shard.len);
        let features = TpTensor::new(local, Placement::Shard { dim: 2, shard }, &group).unwrap();
        // A norm (whole feature vectors) on a feature shard.
        layout_error(features.map_features("ln_2", |t| t), "feature shard");
        // A residual add of a sequence shard to a replicated tensor.
        let seq = replicated.clone().scatter_sequence().unwrap();
        layout_error(replicated.clone().residual_add(seq), "residual add");
        // Vocab-parallel cross-entropy on replicated (gathered) logits.
        let targets = Tensor::<1, Int>::from_data([1, 2], &dev);
        let logits = TpTensor::replicated(Tensor::<2>::zeros([2, 8], &dev), &group);
        layout_error(
            vocab_parallel_cross_entropy(logits, targets, CrossEntropyOptions::default()),
            "vocabulary",
        );
        // Reducing a complete tensor.
        layout_error(replicated.reduce(), "partial");
        Ok(())
    })
    .unwrap();
}
