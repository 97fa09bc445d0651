//! Every collective on the `local` backend against a direct computation, for 1 to 4 ranks,
//! plus the failure behaviour (panics, errors, mismatched calls) that must never hang.

use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::{CollectiveError, DeviceMesh, ProcessGroup, ReduceOp, run_local};

const SIZES: [usize; 4] = [1, 2, 3, 4];

/// Deterministic test values of rank `r`: shape `[rows, cols]`.
fn values(r: usize, rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((r * 31 + i * 7) % 13) as f32 - 6.0 + r as f32 * 0.5)
        .collect()
}

fn data(r: usize, rows: usize, cols: usize) -> TensorData {
    TensorData::new(values(r, rows, cols), [rows, cols])
}

fn vec_of(d: TensorData) -> Vec<f32> {
    d.try_to_vec::<f32>().unwrap()
}

fn short(group: ProcessGroup) -> ProcessGroup {
    group.with_timeout(Duration::from_secs(10))
}

#[test]
fn all_reduce_every_op_matches_direct_computation() {
    for n in SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            // 7 x 5 = 35 elements: not divisible by 2, 3 or 4 (uneven ring pieces).
            let out = run_local(n, |g| g.all_reduce_data(data(g.rank(), 7, 5), op)).unwrap();
            let expected: Vec<f32> = (0..35)
                .map(|i| {
                    let column = (0..n).map(|r| values(r, 7, 5)[i]);
                    match op {
                        ReduceOp::Sum => column.sum(),
                        ReduceOp::Avg => column.sum::<f32>() / n as f32,
                        ReduceOp::Max => column.fold(f32::MIN, f32::max),
                        ReduceOp::Min => column.fold(f32::MAX, f32::min),
                    }
                })
                .collect();
            for (rank, d) in out.into_iter().enumerate() {
                assert_eq!(d.shape().as_slice(), &[7, 5]);
                let got = vec_of(d);
                for (a, b) in got.iter().zip(&expected) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "n={n} {op} rank {rank}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_reduce_of_tensors_in_other_dtypes() {
    let out = run_local(3, |g| {
        let device = Device::flex();
        let x = Tensor::<1>::from_data(TensorData::new(vec![g.rank() as f64, 1.0], [2]), &device);
        let x = x.cast(DType::F64);
        let y = g.all_reduce(x, ReduceOp::Sum)?;
        assert_eq!(y.dtype(), DType::F64);
        Ok(y.into_data().try_to_vec::<f64>().unwrap())
    })
    .unwrap();
    assert_eq!(out[2], vec![3.0, 3.0]);
    let ints = run_local(2, |g| {
        let x = TensorData::new(vec![g.rank() as i64 + 1, 5], [2]);
        g.all_reduce_data(x, ReduceOp::Max)
    })
    .unwrap();
    assert_eq!(ints[0].try_to_vec::<i64>().unwrap(), vec![2, 5]);
}

#[test]
fn all_gather_uneven_on_each_dim() {
    for n in SIZES {
        for dim in 0..2 {
            // Rank r holds r + 1 units along `dim`.
            let shape_of = |r: usize| if dim == 0 { (r + 1, 3) } else { (3, r + 1) };
            let out = run_local(n, |g| {
                let (rows, cols) = shape_of(g.rank());
                let x = Tensor::<2>::from_data(data(g.rank(), rows, cols), &Device::flex());
                g.all_gather(x, dim)
            })
            .unwrap();
            let parts: Vec<Tensor<2>> = (0..n)
                .map(|r| {
                    let (rows, cols) = shape_of(r);
                    Tensor::from_data(data(r, rows, cols), &Device::flex())
                })
                .collect();
            let expected = vec_of(Tensor::cat(parts, dim).into_data());
            for t in out {
                assert_eq!(vec_of(t.into_data()), expected, "n={n} dim={dim}");
            }
        }
    }
}

#[test]
fn reduce_scatter_even_and_uneven_on_each_dim() {
    for n in SIZES {
        for dim in 0..2 {
            let (rows, cols) = (2 * n + 1, 4);
            let full_len = if dim == 0 { rows } else { cols };
            let mut sizes = vec![full_len / n; n];
            sizes[0] += full_len % n;
            let out = run_local(n, |g| {
                let x = Tensor::<2>::from_data(data(g.rank(), rows, cols), &Device::flex());
                g.reduce_scatter(x, dim, ReduceOp::Sum, Some(&sizes))
            })
            .unwrap();
            let total = (0..n)
                .map(|r| Tensor::<2>::from_data(data(r, rows, cols), &Device::flex()))
                .reduce(|a, b| a + b)
                .unwrap();
            let mut start = 0;
            for (r, t) in out.into_iter().enumerate() {
                let expected = total.clone().narrow(dim, start, sizes[r]);
                start += sizes[r];
                assert_eq!(t.dims(), expected.dims());
                let (a, b) = (vec_of(t.into_data()), vec_of(expected.into_data()));
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() < 1e-5, "n={n} dim={dim} rank={r}");
                }
            }
        }
    }
    // An uneven dimension without sizes is refused with advice.
    let err = run_local(2, |g| {
        g.reduce_scatter_data(data(g.rank(), 3, 2), 0, ReduceOp::Sum, None)
    })
    .unwrap_err();
    assert!(err.to_string().contains("not divisible"), "{err}");
}

#[test]
fn broadcast_from_every_root() {
    for n in SIZES {
        for root in 0..n {
            let out = run_local(n, |g| g.broadcast_data(data(g.rank(), 3, 3), root)).unwrap();
            for d in out {
                assert_eq!(vec_of(d), values(root, 3, 3));
            }
        }
    }
}

#[test]
fn all_to_all_uneven_splits() {
    for n in SIZES {
        // Rank r sends (r + k) % 3 + 1 rows to rank k.
        let send = |r: usize| -> Vec<usize> { (0..n).map(|k| (r + k) % 3 + 1).collect() };
        let out = run_local(n, |g| {
            let sizes = send(g.rank());
            let rows: usize = sizes.iter().sum();
            g.all_to_all_data(data(g.rank(), rows, 2), 0, &sizes)
        })
        .unwrap();
        for (me, d) in out.into_iter().enumerate() {
            let mut expected = Vec::new();
            for r in 0..n {
                let sizes = send(r);
                let start: usize = sizes[..me].iter().sum();
                let rows: usize = sizes.iter().sum();
                expected.extend_from_slice(&values(r, rows, 2)[start * 2..(start + sizes[me]) * 2]);
            }
            assert_eq!(vec_of(d), expected, "n={n} rank={me}");
        }
    }
}

#[test]
fn send_recv_tags_and_barrier() {
    run_local(3, |g| {
        let device = Device::flex();
        let next = (g.rank() + 1) % 3;
        let prev = (g.rank() + 2) % 3;
        // Two tags sent in one order, received in the other: tags keep them apart.
        g.send(
            Tensor::<1>::from_floats([g.rank() as f32], &device),
            next,
            7,
        )?;
        g.send(Tensor::<2>::zeros([2, g.rank() + 1], &device), next, 9)?;
        let b: Tensor<2> = g.recv(prev, 9, &device)?;
        let a: Tensor<1> = g.recv(prev, 7, &device)?;
        assert_eq!(b.dims(), [2, prev + 1]);
        assert_eq!(vec_of(a.into_data()), vec![prev as f32]);
        g.barrier()?;
        Ok(())
    })
    .unwrap();
}

/// `ProcessGroup::send_recv`, the exchange of a ring: rotations both ways at 2 to 4 ranks
/// (at 2 the next and the previous rank are the same one), two exchanges in flight under
/// different tags, and the typed errors: itself as a peer, a reserved tag, a tensor of
/// another rank than the receiver expects.
#[test]
fn send_recv_rotates_a_ring_and_rejects_bad_peers() {
    for n in [2, 3, 4] {
        let got = run_local(n, |g| {
            let device = Device::flex();
            let (r, next, prev) = (g.rank(), (g.rank() + 1) % n, (g.rank() + n - 1) % n);
            let mine = Tensor::<2>::from_data(data(r, 2, 3), &device);
            let forward = g.send_recv(mine.clone(), next, prev, 1)?;
            let backward = g.send_recv(mine, prev, next, 2)?;
            let (from_prev, from_next) = (forward.wait()?, backward.wait()?);
            Ok((vec_of(from_prev.into_data()), vec_of(from_next.into_data())))
        })
        .unwrap();
        for (r, (from_prev, from_next)) in got.into_iter().enumerate() {
            assert_eq!(
                from_prev,
                values((r + n - 1) % n, 2, 3),
                "{n} ranks, rank {r}"
            );
            assert_eq!(from_next, values((r + 1) % n, 2, 3), "{n} ranks, rank {r}");
        }
    }
    let errors = run_local(2, |g| {
        let g = short(g);
        let device = Device::flex();
        let x = Tensor::<1>::from_floats([1.0, 2.0], &device);
        let me = g.rank();
        let to_self = g.send_recv(x.clone(), me, 1 - me, 3).err();
        let reserved = g.send_recv(x.clone(), 1 - me, 1 - me, u64::MAX).err();
        let setup = g.send(x.clone(), 1 - me, u64::MAX - 1).err();
        // Rank 0 sends a vector, rank 1 a matrix; each expects its own rank back.
        let wrong_rank = if me == 0 {
            g.send_recv(x, 1, 1, 4)?.wait().err()
        } else {
            let m = Tensor::<2>::zeros([1, 2], &device);
            g.send_recv(m, 0, 0, 4)?.wait().err()
        };
        Ok([to_self, reserved, setup, wrong_rank])
    })
    .unwrap();
    for (rank, errors) in errors.into_iter().enumerate() {
        let cases = [
            "itself as a peer",
            "the collectives' tag",
            "the channel setup's tag",
            "another tensor rank",
        ];
        for (what, e) in cases.into_iter().zip(errors) {
            match e {
                Some(CollectiveError::InvalidArgument { .. }) => {}
                other => panic!("rank {rank}, {what}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
}

#[test]
fn objects_and_bytes() {
    let out = run_local(3, |g| {
        let config = (g.rank() == 1).then(|| ("gpt".to_string(), 42u32));
        let got: (String, u32) = g.broadcast_object(config.as_ref(), 1)?;
        let all: Vec<usize> = g.all_gather_object(&(g.rank() * 10))?;
        let gathered = g.gather_bytes(vec![g.rank() as u8; g.rank()], 2)?;
        Ok((got, all, gathered))
    })
    .unwrap();
    for (rank, (got, all, gathered)) in out.into_iter().enumerate() {
        assert_eq!(got, ("gpt".to_string(), 42));
        assert_eq!(all, vec![0, 10, 20]);
        assert_eq!(gathered.is_some(), rank == 2);
        if let Some(g) = gathered {
            assert_eq!(g, vec![vec![], vec![1], vec![2, 2]]);
        }
    }
}

#[test]
fn sub_groups_and_mesh() {
    let out = run_local(4, |g| {
        let mesh = DeviceMesh::new(&g, &[("dp", 2), ("tp", 2)]).unwrap();
        let tp = mesh.group("tp").unwrap();
        let dp = mesh.group("dp").unwrap();
        let tp_sum = tp.all_reduce_f32(vec![g.rank() as f32], ReduceOp::Sum)?;
        let dp_sum = dp.all_reduce_f32(vec![g.rank() as f32], ReduceOp::Sum)?;
        // Odd ranks only, through `split`.
        let odd = if g.rank() % 2 == 1 {
            Some(
                g.split(&[3, 1])?
                    .all_reduce_f32(vec![g.rank() as f32], ReduceOp::Max)?,
            )
        } else {
            None
        };
        Ok((mesh.coords().to_vec(), tp_sum[0], dp_sum[0], odd))
    })
    .unwrap();
    assert_eq!(out[0], (vec![0, 0], 1.0, 2.0, None));
    assert_eq!(out[1], (vec![0, 1], 1.0, 4.0, Some(vec![3.0])));
    assert_eq!(out[2], (vec![1, 0], 5.0, 2.0, None));
    assert_eq!(out[3], (vec![1, 1], 5.0, 4.0, Some(vec![3.0])));

    let err = run_local(4, |g| {
        DeviceMesh::new(&g, &[("dp", 3), ("tp", 2)])
            .map_err(|e| CollectiveError::Rendezvous(e.to_string()))
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("6 ranks but the world has 4"),
        "{err}"
    );
}

#[test]
fn a_panicking_rank_fails_everyone_promptly() {
    let start = Instant::now();
    let err = run_local(3, |g| {
        let g = short(g);
        if g.rank() == 1 {
            panic!("boom on purpose");
        }
        g.all_reduce_f32(vec![1.0], ReduceOp::Sum)
    })
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(err.to_string().contains("boom on purpose"), "{err}");
}

#[test]
fn a_rank_that_returns_early_fails_the_others() {
    let err = run_local(2, |g| {
        let g = short(g);
        if g.rank() == 0 {
            return Err(CollectiveError::Rendezvous("rank 0 gave up".into()));
        }
        g.barrier()
    })
    .unwrap_err();
    assert!(err.to_string().contains("rank 0 gave up"), "{err}");
}

#[test]
fn different_shapes_or_ops_are_reported_not_hung() {
    let start = Instant::now();
    let err = run_local(2, |g| {
        let g = short(g);
        g.all_reduce_data(data(0, 2, 2 + g.rank()), ReduceOp::Sum)
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("mismatch") && msg.contains("[2, 2]") && msg.contains("[2, 3]"),
        "{msg}"
    );

    let err = run_local(2, |g| {
        let g = short(g);
        if g.rank() == 0 {
            g.all_reduce_data(data(0, 2, 2), ReduceOp::Sum).map(|_| ())
        } else {
            g.all_gather_data(data(1, 2, 2), 0).map(|_| ())
        }
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("all_reduce") && msg.contains("all_gather"),
        "{msg}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_missing_peer_times_out_with_a_clear_error() {
    let start = Instant::now();
    let err = run_local(2, |g| {
        let g = g.with_timeout(Duration::from_millis(300));
        if g.rank() == 0 {
            g.barrier()
        } else {
            // Rank 1 never joins the barrier but stays alive past rank 0's timeout.
            std::thread::sleep(Duration::from_millis(600));
            Ok(())
        }
    })
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            err,
            CollectiveError::Timeout {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn large_all_reduce_takes_the_shared_memory_path_and_is_exact() {
    // 300_001 f32 (1.2 MB): above the shared-memory threshold, not divisible by 2, 3 or 4.
    let len = 300_001;
    let value = |r: usize, i: usize| ((r * 7 + i * 13) % 101) as f32 - 50.0;
    for n in [2, 3, 4] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let out = run_local(n, |g| {
                let v: Vec<f32> = (0..len).map(|i| value(g.rank(), i)).collect();
                // Twice, so buffers and board entries of one call never leak into the next.
                let first = g.all_reduce_data(TensorData::new(v.clone(), [len]), op)?;
                let second = g.all_reduce_data(TensorData::new(v, [len]), op)?;
                assert_eq!(first, second);
                Ok(vec_of(first))
            })
            .unwrap();
            for i in (0..len).step_by(997).chain([len - 1]) {
                let column = (0..n).map(|r| value(r, i));
                let expected = match op {
                    ReduceOp::Sum => column.sum(),
                    ReduceOp::Avg => column.sum::<f32>() / n as f32,
                    ReduceOp::Max => column.fold(f32::MIN, f32::max),
                    ReduceOp::Min => column.fold(f32::MAX, f32::min),
                };
                for got in &out {
                    assert!((got[i] - expected).abs() < 1e-4, "n={n} {op} i={i}");
                }
            }
        }
    }
    // A shape mismatch is caught before any rank touches another's memory.
    let err = run_local(2, |g| {
        let g = short(g);
        let len = 100_000 + g.rank();
        g.all_reduce_data(TensorData::new(vec![1.0f32; len], [len]), ReduceOp::Sum)
    })
    .unwrap_err();
    assert!(err.to_string().contains("mismatch"), "{err}");
}
