//! Gradient checks of the differentiable collectives: on n ranks, the gradient each rank gets
//! must equal the gradient of the single-device computation the collective replaces, on the
//! host path and on the tensor-level (device) path.

use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::autograd::{
    all_to_all, copy_to_group, even_split, gather_from_group, gather_from_sequence, recv,
    reduce_from_group, reduce_scatter_to_sequence, ring_shift, scatter_to_group, send,
};
use burn_parallel::{ProcessGroup, run_local};

fn dev() -> Device {
    Device::flex().autodiff()
}

/// A deterministic tensor; `salt` makes different tensors differ.
fn t2(salt: usize, rows: usize, cols: usize) -> Tensor<2> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| (((i * 7 + salt * 13) % 11) as f32 - 5.0) / 3.0)
        .collect();
    Tensor::from_data(TensorData::new(v, [rows, cols]), &dev())
}

fn leaf(salt: usize, rows: usize, cols: usize) -> Tensor<2> {
    t2(salt, rows, cols).require_grad()
}

fn close(a: Tensor<2>, b: Tensor<2>, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a = a.into_data().try_to_vec::<f32>().unwrap();
    let b = b.into_data().try_to_vec::<f32>().unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1.0),
            "{what}: {a:?} vs {b:?}"
        );
    }
}

fn grad(x: &Tensor<2>, loss: Tensor<1>) -> Tensor<2> {
    let grads = loss.backward();
    x.grad(&grads).expect("a gradient")
}

fn for_sizes(f: impl Fn(usize) + Sync) {
    for n in [1, 2, 3, 4] {
        f(n);
    }
}

/// Runs `f` on `n` ranks twice: with the collectives on host data, and on the tensor-level path
/// that NCCL runs on the device (`with_tensor_path`; here it stages through host memory inside
/// the collective): both must pass the same checks.
fn run(n: usize, f: impl Fn(ProcessGroup) -> burn_parallel::Result<()> + Send + Sync) {
    for tensor_path in [false, true] {
        run_local(n, |g| f(g.with_tensor_path(tensor_path)))
            .unwrap_or_else(|e| panic!("tensor path {tensor_path}: {e}"));
    }
}

#[test]
fn copy_to_group_sums_gradients() {
    for_sizes(|n| {
        run(n, |g| {
            let x = leaf(0, 3, 4);
            let c = t2(10 + g.rank(), 3, 4);
            let gx = grad(&x, (copy_to_group(x.clone(), &g) * c).sum());
            let expected = (0..n)
                .map(|r| t2(10 + r, 3, 4))
                .reduce(|a, b| a + b)
                .unwrap();
            close(gx, expected, "copy_to_group");
            Ok(())
        })
    });
}

#[test]
fn reduce_from_group_forward_sums_and_backward_is_identity() {
    for_sizes(|n| {
        run(n, |g| {
            let x = leaf(g.rank(), 3, 4);
            let y = reduce_from_group(x.clone(), &g)?;
            let total = (0..n).map(|r| t2(r, 3, 4)).reduce(|a, b| a + b).unwrap();
            close(y.clone(), total, "reduce_from_group forward");
            let c = t2(20, 3, 4);
            close(
                grad(&x, (y * c.clone()).sum()),
                c,
                "reduce_from_group backward",
            );
            Ok(())
        })
    });
}

#[test]
fn scatter_and_gather_along_each_dim() {
    for_sizes(|n| {
        for dim in 0..2 {
            run(n, |g| {
                // 5 x 7: uneven over 2, 3 and 4 ranks on both dims.
                let full = (5, 7);
                let sizes = even_split(if dim == 0 { full.0 } else { full.1 }, n);
                let start: usize = sizes[..g.rank()].iter().sum();
                let c = t2(30, full.0, full.1);

                // scatter: replicated x, each rank keeps a slice; grad is the full C.
                let x = leaf(1, full.0, full.1);
                let y = scatter_to_group(x.clone(), &g, dim)?;
                close(
                    y.clone(),
                    t2(1, full.0, full.1).narrow(dim, start, sizes[g.rank()]),
                    "scatter forward",
                );
                let c_slice = c.clone().narrow(dim, start, sizes[g.rank()]);
                close(
                    grad(&x, (y * c_slice.clone()).sum()),
                    c.clone(),
                    "scatter backward",
                );

                // gather: sharded x, replicated downstream C; grad is this rank's slice of C.
                let shard = leaf(2, full.0, full.1).narrow(dim, start, sizes[g.rank()]);
                let shard = shard.detach().require_grad();
                let y = gather_from_group(shard.clone(), &g, dim)?;
                close(y.clone(), t2(2, full.0, full.1), "gather forward");
                close(
                    grad(&shard, (y * c.clone()).sum()),
                    c_slice,
                    "gather backward",
                );
                Ok(())
            })
        }
    });
}

#[test]
fn sequence_parallel_pair() {
    for_sizes(|n| {
        run(n, |g| {
            let rows = 2 * n + 1;
            let sizes = even_split(rows, n);
            let start: usize = sizes[..g.rank()].iter().sum();
            let mine = sizes[g.rank()];
            let sum_c = (0..n)
                .map(|r| t2(40 + r, rows, 3))
                .reduce(|a, b| a + b)
                .unwrap();

            // gather_from_sequence: each rank's downstream differs; grad of the shard is the
            // shard's slice of the sum of all downstream coefficients.
            let shard = t2(3, rows, 3).narrow(0, start, mine).require_grad();
            let y = gather_from_sequence(shard.clone(), &g, 0)?;
            close(y.clone(), t2(3, rows, 3), "gather_from_sequence forward");
            let gx = grad(&shard, (y * t2(40 + g.rank(), rows, 3)).sum());
            close(
                gx,
                sum_c.narrow(0, start, mine),
                "gather_from_sequence backward",
            );

            // reduce_scatter_to_sequence: partial sums in, summed slice out; grad is the full
            // coefficient tensor.
            let x = leaf(50 + g.rank(), rows, 3);
            let y = reduce_scatter_to_sequence(x.clone(), &g, 0, Some(&sizes))?;
            let total = (0..n)
                .map(|r| t2(50 + r, rows, 3))
                .reduce(|a, b| a + b)
                .unwrap();
            close(
                y.clone(),
                total.narrow(0, start, mine),
                "reduce_scatter forward",
            );
            let c = t2(60, rows, 3);
            let gx = grad(&x, (y * c.clone().narrow(0, start, mine)).sum());
            close(gx, c, "reduce_scatter backward");
            Ok(())
        })
    });
}

#[test]
fn all_to_all_backward_is_the_inverse_exchange() {
    for_sizes(|n| {
        run(n, |g| {
            // Rank r sends (r + k) % 2 + 1 rows to rank k; all pieces are concatenated on the
            // column dim (split dim != concat dim, as in Ulysses).
            let send_sizes = |r: usize| -> Vec<usize> { (0..n).map(|k| (r + k) % 2 + 1).collect() };
            // Pieces must agree on the split dim to be concatenated on another one: use equal
            // sizes for that case.
            let equal = vec![2usize; n];
            let rows = 2 * n;
            let x = leaf(70 + g.rank(), rows, 3);
            let y = all_to_all(x.clone(), &g, 0, &equal, 1)?;
            assert_eq!(y.dims(), [2, 3 * n]);
            // Expected forward: block k of y's columns is rank k's rows [2*me, 2*me+2).
            for k in 0..n {
                close(
                    y.clone().narrow(1, 3 * k, 3),
                    t2(70 + k, rows, 3).narrow(0, 2 * g.rank(), 2),
                    "all_to_all forward",
                );
            }
            let c = t2(80 + g.rank(), 2, 3 * n);
            let gx = grad(&x, (y * c).sum());
            // Row block k of x went to rank k, which multiplied it by its C's column block `me`.
            let expected = Tensor::cat(
                (0..n)
                    .map(|k| t2(80 + k, 2, 3 * n).narrow(1, 3 * g.rank(), 3))
                    .collect(),
                0,
            );
            close(gx, expected, "all_to_all backward (split != concat)");

            // Uneven splits on one dim (expert-parallel dispatch).
            let sizes = send_sizes(g.rank());
            let rows: usize = sizes.iter().sum();
            let x = leaf(90 + g.rank(), rows, 2);
            let y = all_to_all(x.clone(), &g, 0, &sizes, 0)?;
            let c = t2(95 + g.rank(), y.dims()[0], 2);
            let gx = grad(&x, (y * c).sum());
            let expected = Tensor::cat(
                (0..n)
                    .map(|k| {
                        let from: Vec<usize> = (0..n).map(|r| send_sizes(r)[k]).collect();
                        let start: usize = from[..g.rank()].iter().sum();
                        t2(95 + k, from.iter().sum(), 2).narrow(0, start, from[g.rank()])
                    })
                    .collect(),
                0,
            );
            close(gx, expected, "all_to_all backward (uneven)");
            Ok(())
        })
    });
}

#[test]
fn send_recv_carry_the_gradient_back() {
    run(2, |g| {
        if g.rank() == 0 {
            let x = leaf(1, 2, 3);
            let token = send(x.clone() * 2.0, &g, 1, 5)?;
            let gx = grad(&x, token.sum());
            close(gx, t2(7, 2, 3) * 2.0, "send/recv");
        } else {
            let anchor = Tensor::<1>::zeros([1], &dev()).require_grad();
            let r: Tensor<2> = recv(anchor, &g, 0, 5)?;
            close(r.clone(), t2(1, 2, 3) * 2.0, "recv forward");
            let _ = (r * t2(7, 2, 3)).sum().backward();
        }
        Ok(())
    });
}

#[test]
fn ring_shift_moves_gradients_the_other_way() {
    for_sizes(|n| {
        run(n, |g| {
            let x = leaf(g.rank(), 2, 2);
            let y = ring_shift(x.clone(), &g, 1, 11)?;
            let from = (g.rank() + n - 1) % n;
            close(y.clone(), t2(from, 2, 2), "ring_shift forward");
            let gx = grad(&x, (y * t2(20 + g.rank(), 2, 2)).sum());
            close(gx, t2(20 + (g.rank() + 1) % n, 2, 2), "ring_shift backward");
            Ok(())
        })
    });
}

/// A collective that fails inside the backward (here: the peer left before its backward, so
/// the gradient all-reduce of `copy_to_group` finds it gone) is a typed error from
/// `autograd::backward`, on the host and the tensor-level path; it used to panic inside Burn's
/// backward. The second collective of the same backward does not communicate (it would wait for
/// the absent peer until the timeout), and the error is consumed by the call that returned it.
#[test]
fn a_collective_failing_inside_the_backward_is_a_typed_error() {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    for tensor_path in [false, true] {
        let seen = Arc::new(Mutex::new(None));
        let timeout = Duration::from_secs(3);
        let result = run_local(2, |group| {
            let group = group.with_timeout(timeout).with_tensor_path(tensor_path);
            let x = leaf(1, 2, 3);
            let h = copy_to_group(x.clone(), &group) * 2.0;
            let y = copy_to_group(h, &group);
            if group.rank() == 1 {
                return Err(burn_parallel::CollectiveError::InvalidArgument {
                    rank: 1,
                    op: "test".into(),
                    reason: "this rank leaves before its backward".into(),
                });
            }
            let start = Instant::now();
            let out = burn_parallel::autograd::backward(y.sum());
            let elapsed = start.elapsed();
            let stale = burn_parallel::autograd::take_backward_error();
            *seen.lock().unwrap() = Some((out.map(|_| ()), elapsed, stale.is_none()));
            Ok(())
        });
        assert!(result.is_err(), "rank 1 failed");
        let (out, elapsed, consumed) = seen.lock().unwrap().take().expect("rank 0 returned");
        let e = out.expect_err("the backward's all-reduce cannot complete without rank 1");
        assert!(e.to_string().contains("rank"), "{e}");
        assert!(consumed, "the error is taken by the call that returned it");
        // One timeout at most (the first collective's), not one per collective.
        assert!(
            elapsed < timeout * 2,
            "the backward took {elapsed:?} with a timeout of {timeout:?}"
        );
    }
}
