//! The `tcp` backend over real loopback connections: every rank is a thread of this test
//! process, but ranks only talk through TCP sockets formed by the rendezvous. Every collective
//! is checked against a direct computation, for worlds of 2 and 3 ranks, and the failure cases
//! (crash, abort, clean shutdown, mismatched calls, bad rendezvous) must end in a prompt error
//! that names the culprit.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::comm::tcp::{LaunchEnv, Launcher, TcpTransport};
use burn_parallel::world::connect_tcp;
use burn_parallel::{CollectiveError, ProcessGroup, ReduceOp, Result, TcpConfig, TcpRendezvous};

/// Bound on the rendezvous and on every wait: failures must be detected well before it.
const TIMEOUT: Duration = Duration::from_secs(10);

fn config(rank: usize, world_size: usize, port: u16) -> TcpConfig {
    TcpConfig::new(rank, world_size, "127.0.0.1", port).with_timeout(TIMEOUT)
}

/// Runs `f` on `world_size` ranks connected over loopback TCP (each rank a thread calling
/// `TcpTransport::connect`) and returns every rank's result. A rank whose `f` fails aborts, as
/// a launcher would.
fn run_tcp<T, F>(world_size: usize, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(&Arc<TcpTransport>, ProcessGroup) -> Result<T> + Sync,
{
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let mut rendezvous = Some(rendezvous);
    let f = &f;
    thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let rendezvous = if rank == 0 { rendezvous.take() } else { None };
                scope.spawn(move || {
                    let transport =
                        TcpTransport::connect(&config(rank, world_size, port), rendezvous)?;
                    let group = ProcessGroup::world(transport.clone()).with_timeout(TIMEOUT);
                    let result = f(&transport, group.clone());
                    if let Err(e) = &result {
                        group.abort(&e.to_string());
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads do not panic"))
            .collect()
    })
}

/// Like [`run_tcp`], for calls that must succeed on every rank.
fn run_ok<T, F>(world_size: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Sync,
{
    run_tcp(world_size, |_, group| f(group))
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank} failed: {e}")))
        .collect()
}

/// Deterministic, rank-dependent test values (exact in f32).
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 13) % 17) as f32 - 8.0 + 0.25 * rank as f32)
        .collect()
}

fn f32s(data: &TensorData) -> Vec<f32> {
    data.as_slice::<f32>().unwrap().to_vec()
}

/// Row-major 2-D tensor as nested rows.
fn rows(v: &[f32], shape: [usize; 2]) -> Vec<Vec<f32>> {
    v.chunks(shape[1]).map(<[f32]>::to_vec).collect()
}

/// Concatenation of 2-D pieces along `dim`.
fn concat(pieces: &[(Vec<f32>, [usize; 2])], dim: usize) -> Vec<f32> {
    if dim == 0 {
        pieces.iter().flat_map(|(v, _)| v.clone()).collect()
    } else {
        let height = pieces[0].1[0];
        (0..height)
            .flat_map(|row| {
                pieces
                    .iter()
                    .flat_map(move |(v, s)| rows(v, *s)[row].clone())
            })
            .collect()
    }
}

/// The block of a 2-D tensor with `range` along `dim`.
fn slice(v: &[f32], shape: [usize; 2], dim: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    let rows = rows(v, shape);
    if dim == 0 {
        rows[range].concat()
    } else {
        rows.iter()
            .flat_map(|r| r[range.clone()].to_vec())
            .collect()
    }
}

fn reduce(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    (0..inputs[0].len())
        .map(|i| {
            let column = inputs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => column.sum(),
                ReduceOp::Avg => column.sum::<f32>() / inputs.len() as f32,
                ReduceOp::Max => column.fold(f32::NEG_INFINITY, f32::max),
                ReduceOp::Min => column.fold(f32::INFINITY, f32::min),
            }
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

#[test]
fn all_reduce_matches_direct_computation() {
    for world in [2, 3] {
        let shape = [7, 143];
        let n = shape[0] * shape[1];
        let out = run_ok(world, |g| {
            let mut results = Vec::new();
            for op in OPS {
                let data = TensorData::new(values(g.rank(), n), shape);
                results.push(f32s(&g.all_reduce_data(data, op)?));
            }
            // The tensor API and an integer dtype.
            let x = Tensor::<2>::from_data(
                TensorData::new(values(g.rank(), n), shape),
                &Device::flex(),
            );
            let sum = g.all_reduce(x, ReduceOp::Sum)?.into_data();
            results.push(sum.convert::<f32>().as_slice::<f32>().unwrap().to_vec());
            let ints = TensorData::new(vec![g.rank() as i32 + 1; 5], [5]);
            let ints = g.all_reduce_data(ints, ReduceOp::Sum)?;
            assert_eq!(ints.dtype(), DType::I32);
            results.push(
                ints.as_slice::<i32>()
                    .unwrap()
                    .iter()
                    .map(|&v| v as f32)
                    .collect(),
            );
            Ok(results)
        });
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n)).collect();
        let triangle = (world * (world + 1) / 2) as f32;
        for (rank, results) in out.iter().enumerate() {
            for (op, got) in OPS.iter().zip(results) {
                assert_close(
                    got,
                    &reduce(&inputs, *op),
                    &format!("{op} world {world} rank {rank}"),
                );
            }
            assert_close(&results[4], &reduce(&inputs, ReduceOp::Sum), "tensor sum");
            assert_eq!(results[5], vec![triangle; 5], "i32 sum");
        }
    }
}

#[test]
fn large_all_reduce_is_exact() {
    // Large frames go through many partial writes and reads.
    for world in [2, 3] {
        let n = (3 << 20) + 5;
        let out = run_ok(world, |g| {
            let data = TensorData::new(vec![g.rank() as f32 + 1.0; n], [n]);
            Ok(f32s(&g.all_reduce_data(data, ReduceOp::Sum)?))
        });
        let want = (world * (world + 1) / 2) as f32;
        for got in out {
            assert_eq!(got.len(), n);
            assert!(got.iter().all(|&v| v == want));
        }
    }
}

#[test]
fn all_gather_of_uneven_shards_along_dims_0_and_1() {
    for world in [2, 3] {
        let shard_shape = |rank: usize, dim: usize| {
            if dim == 0 {
                [rank + 1, 3]
            } else {
                [2, rank + 2]
            }
        };
        let out = run_ok(world, |g| {
            let mut results = Vec::new();
            for dim in [0, 1] {
                let shape = shard_shape(g.rank(), dim);
                let data = TensorData::new(values(g.rank(), shape[0] * shape[1]), shape);
                let gathered = g.all_gather_data(data, dim)?;
                results.push((f32s(&gathered), gathered.shape().as_slice().to_vec()));
            }
            // The tensor API.
            let x = Tensor::<2>::from_data(
                TensorData::new(values(g.rank(), 2 * (g.rank() + 2)), [2, g.rank() + 2]),
                &Device::flex(),
            );
            let gathered = g.all_gather(x, 1)?.into_data();
            results.push((f32s(&gathered), gathered.shape().as_slice().to_vec()));
            Ok(results)
        });
        for dim in [0, 1] {
            let pieces: Vec<(Vec<f32>, [usize; 2])> = (0..world)
                .map(|r| {
                    let s = shard_shape(r, dim);
                    (values(r, s[0] * s[1]), s)
                })
                .collect();
            let want = concat(&pieces, dim);
            let mut want_shape = pieces[0].1.to_vec();
            want_shape[dim] = pieces.iter().map(|(_, s)| s[dim]).sum();
            for (rank, results) in out.iter().enumerate() {
                assert_eq!(results[dim].0, want, "world {world} dim {dim} rank {rank}");
                assert_eq!(results[dim].1, want_shape);
                if dim == 1 {
                    assert_eq!(results[2].0, want, "tensor all_gather");
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_of_uneven_pieces_along_dims_0_and_1() {
    for world in [2, 3] {
        // (full shape, dim, per-rank sizes); `None` is the even split.
        let cases: Vec<([usize; 2], usize, Option<Vec<usize>>)> = vec![
            (
                [5, 4],
                0,
                Some(if world == 2 {
                    vec![2, 3]
                } else {
                    vec![1, 2, 2]
                }),
            ),
            (
                [3, 7],
                1,
                Some(if world == 2 {
                    vec![3, 4]
                } else {
                    vec![2, 2, 3]
                }),
            ),
            ([2, 6], 1, None),
        ];
        let out = run_ok(world, |g| {
            let mut results = Vec::new();
            for (shape, dim, sizes) in &cases {
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let data = TensorData::new(values(g.rank(), shape[0] * shape[1]), *shape);
                    let piece = g.reduce_scatter_data(data, *dim, op, sizes.as_deref())?;
                    results.push((f32s(&piece), piece.shape().as_slice().to_vec()));
                }
            }
            Ok(results)
        });
        for (rank, results) in out.iter().enumerate() {
            let mut k = 0;
            for (shape, dim, sizes) in &cases {
                let sizes = sizes.clone().unwrap_or(vec![shape[*dim] / world; world]);
                let start: usize = sizes[..rank].iter().sum();
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let inputs: Vec<Vec<f32>> =
                        (0..world).map(|r| values(r, shape[0] * shape[1])).collect();
                    let full = reduce(&inputs, op);
                    let want = slice(&full, *shape, *dim, start..start + sizes[rank]);
                    let mut want_shape = shape.to_vec();
                    want_shape[*dim] = sizes[rank];
                    assert_close(&results[k].0, &want, &format!("{op} {shape:?} dim {dim}"));
                    assert_eq!(results[k].1, want_shape);
                    k += 1;
                }
            }
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for world in [2, 3] {
        let out = run_ok(world, |g| {
            let mut results = Vec::new();
            for root in 0..g.size() {
                let data = TensorData::new(values(g.rank(), 12), [3, 4]);
                results.push(f32s(&g.broadcast_data(data, root)?));
            }
            let x =
                Tensor::<1>::from_data(TensorData::new(values(g.rank(), 6), [6]), &Device::flex());
            results.push(f32s(&g.broadcast(x, world - 1)?.into_data()));
            Ok(results)
        });
        for results in out {
            for (root, got) in results.iter().take(world).enumerate() {
                assert_eq!(got, &values(root, 12));
            }
            assert_eq!(results[world], values(world - 1, 6));
        }
    }
}

#[test]
fn send_and_recv_with_tags() {
    for world in [2, 3] {
        let out = run_ok(world, |g| {
            let (r, n) = (g.rank(), g.size());
            let next = (r + 1) % n;
            let prev = (r + n - 1) % n;
            // Tag 9 is sent before tag 5 but received after it: tags are independent streams;
            // messages under one tag arrive in order.
            g.send_data(TensorData::new(vec![r as f32, 9.0], [2]), next, 9)?;
            g.send_data(TensorData::new(vec![r as i64, 5, 1], [1, 3]), next, 5)?;
            g.send_data(TensorData::new(vec![r as i64, 5, 2], [3]), next, 5)?;
            let x = Tensor::<2>::from_data(TensorData::new(values(r, 6), [2, 3]), &Device::flex());
            g.send(x, next, 77)?;
            let a = g.recv_data(prev, 5)?;
            let b = g.recv_data(prev, 5)?;
            let c = g.recv_data(prev, 9)?;
            let d: Tensor<2> = g.recv(prev, 77, &Device::flex())?;
            assert_eq!(a.shape().as_slice(), &[1, 3]);
            assert_eq!(b.dtype(), DType::I64);
            Ok((
                a.as_slice::<i64>().unwrap().to_vec(),
                b.as_slice::<i64>().unwrap().to_vec(),
                f32s(&c),
                f32s(&d.into_data()),
            ))
        });
        for (r, (a, b, c, d)) in out.into_iter().enumerate() {
            let prev = (r + world - 1) % world;
            assert_eq!(a, vec![prev as i64, 5, 1]);
            assert_eq!(b, vec![prev as i64, 5, 2]);
            assert_eq!(c, vec![prev as f32, 9.0]);
            assert_eq!(d, values(prev, 6));
        }
    }
}

#[test]
fn all_to_all_with_uneven_splits() {
    // Rank r sends `split(r, k)` rows of width 2 to rank k.
    let split = |r: usize, k: usize| (r + 2 * k) % 3;
    for world in [2, 3] {
        let out = run_ok(world, |g| {
            let r = g.rank();
            let sizes: Vec<usize> = (0..g.size()).map(|k| split(r, k)).collect();
            let rows: usize = sizes.iter().sum();
            let data = TensorData::new(values(r, rows * 2), [rows, 2]);
            let got = g.all_to_all_data(data, 0, &sizes)?;
            let x = Tensor::<2>::from_data(
                TensorData::new(values(r, rows * 2), [rows, 2]),
                &Device::flex(),
            );
            let tensor = g.all_to_all(x, 0, &sizes)?.into_data();
            Ok((f32s(&got), got.shape().as_slice().to_vec(), f32s(&tensor)))
        });
        for (r, (got, shape, tensor)) in out.into_iter().enumerate() {
            let mut want = Vec::new();
            for k in 0..world {
                let sizes: Vec<usize> = (0..world).map(|d| split(k, d)).collect();
                let start: usize = sizes[..r].iter().sum();
                let all = values(k, sizes.iter().sum::<usize>() * 2);
                want.extend_from_slice(&all[start * 2..(start + sizes[r]) * 2]);
            }
            assert_eq!(got, want, "world {world} rank {r}");
            assert_eq!(shape, vec![want.len() / 2, 2]);
            assert_eq!(tensor, want);
        }
    }
}

#[test]
fn barrier_objects_and_bytes() {
    for world in [2, 3] {
        let out = run_ok(world, |g| {
            g.barrier()?;
            let root_value = (g.rank() == 1).then(|| ("config".to_string(), vec![1u32, 2, 3]));
            let config: (String, Vec<u32>) = g.broadcast_object(root_value.as_ref(), 1)?;
            let all: Vec<(usize, String)> =
                g.all_gather_object(&(g.rank(), format!("host-{}", g.rank())))?;
            let gathered = g.gather_bytes(vec![g.rank() as u8; g.rank() + 1], 0)?;
            g.barrier()?;
            Ok((config, all, gathered))
        });
        for (rank, (config, all, gathered)) in out.into_iter().enumerate() {
            assert_eq!(config, ("config".to_string(), vec![1, 2, 3]));
            let want: Vec<(usize, String)> = (0..world).map(|r| (r, format!("host-{r}"))).collect();
            assert_eq!(all, want);
            if rank == 0 {
                let want: Vec<Vec<u8>> = (0..world).map(|r| vec![r as u8; r + 1]).collect();
                assert_eq!(gathered, Some(want));
            } else {
                assert_eq!(gathered, None);
            }
        }
    }
}

#[test]
fn sub_groups_from_split() {
    // World 3: {2, 0} (in that order) and {1}; world 2: {1, 0} reversed.
    for world in [2, 3] {
        let out = run_ok(world, |g| {
            let members: Vec<usize> = match (world, g.rank()) {
                (3, 1) => vec![1],
                (3, _) => vec![2, 0],
                _ => vec![1, 0],
            };
            let sub = g.split(&members)?;
            let sum = sub.all_reduce_f32(vec![g.rank() as f32 + 1.0], ReduceOp::Sum)?;
            let order = sub.all_gather_object(&g.rank())?;
            // The world group still works after the sub-group's calls.
            let total = g.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
            Ok((sub.rank(), sum, order, total))
        });
        for (rank, (sub_rank, sum, order, total)) in out.into_iter().enumerate() {
            assert_eq!(total, vec![world as f32]);
            match (world, rank) {
                (3, 1) => assert_eq!((sub_rank, sum, order), (0, vec![2.0], vec![1])),
                (3, _) => {
                    assert_eq!(sub_rank, if rank == 2 { 0 } else { 1 });
                    assert_eq!((sum, order), (vec![4.0], vec![2, 0]));
                }
                _ => {
                    assert_eq!(sub_rank, 1 - rank);
                    assert_eq!((sum, order), (vec![3.0], vec![1, 0]));
                }
            }
        }
    }
}

#[test]
fn world_of_one_needs_no_network() {
    let group = connect_tcp(&TcpConfig::new(0, 1, "256.0.0.1", 1).with_timeout(TIMEOUT)).unwrap();
    assert_eq!((group.rank(), group.size(), group.backend()), (0, 1, "tcp"));
    assert_eq!(
        group.all_reduce_f32(vec![2.0], ReduceOp::Sum).unwrap(),
        vec![2.0]
    );
    group.barrier().unwrap();
}

// ----------------------------------------------------------------------------------------
// Failures.

#[test]
fn a_crashed_rank_is_named_by_the_others() {
    let start = Instant::now();
    let out = run_tcp(3, |transport, g| {
        g.barrier()?;
        if g.rank() == 2 {
            transport.disconnect_abruptly();
            return Ok(());
        }
        g.all_reduce_f32(vec![1.0; 1000], ReduceOp::Sum).map(|_| ())
    });
    assert!(
        start.elapsed() < TIMEOUT,
        "the failure was not detected before the timeout"
    );
    assert!(out[2].is_ok());
    for rank in [0, 1] {
        let err = out[rank].as_ref().unwrap_err();
        assert!(
            matches!(err, CollectiveError::PeerFailed { .. }),
            "rank {rank}: {err}"
        );
        assert!(
            err.to_string().contains("connection to rank 2 lost"),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn an_abort_reaches_every_peer_with_its_reason() {
    let out = run_tcp(3, |_, g| {
        if g.rank() == 1 {
            g.abort("rank 1 ran out of memory");
            return Ok(());
        }
        g.barrier()
    });
    assert!(out[1].is_ok());
    for rank in [0, 2] {
        match out[rank].as_ref().unwrap_err() {
            CollectiveError::PeerFailed { peer, reason, .. } => {
                assert_eq!(*peer, 1);
                assert_eq!(reason, "rank 1 ran out of memory");
            }
            other => panic!("rank {rank}: expected PeerFailed, got {other}"),
        }
    }
}

#[test]
fn a_clean_shutdown_is_not_a_failure_for_the_others() {
    let out = run_tcp(3, |_, g| {
        g.barrier()?;
        if g.rank() == 2 {
            return Ok(None); // drops its group: says goodbye
        }
        let pair = g.split(&[0, 1])?;
        let sum = pair.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
        assert_eq!(sum, vec![2.0]);
        // Waiting on the rank that left is an error, not a hang.
        Ok(Some(g.recv_data(2, 3).unwrap_err()))
    });
    assert!(matches!(out[2], Ok(None)));
    for rank in [0, 1] {
        let err = out[rank].as_ref().unwrap().as_ref().unwrap();
        assert!(
            matches!(err, CollectiveError::PeerFailed { peer: 2, .. }),
            "rank {rank}: {err}"
        );
        assert!(err.to_string().contains("shut down"), "rank {rank}: {err}");
    }
}

#[test]
fn the_last_frames_of_a_finished_rank_arrive() {
    let n = 2 << 20;
    let out = run_tcp(2, |_, g| {
        if g.rank() == 0 {
            g.send_data(TensorData::new(values(0, n), [n]), 1, 1)?;
            return Ok(None); // drops the group right after sending
        }
        thread::sleep(Duration::from_millis(200));
        Ok(Some(f32s(&g.recv_data(0, 1)?)))
    });
    assert_eq!(out[1].as_ref().unwrap().as_ref().unwrap(), &values(0, n));
}

#[test]
fn a_different_collective_is_a_mismatch() {
    let out = run_tcp(2, |_, g| {
        let data = TensorData::new(vec![1.0f32; 4], [4]);
        if g.rank() == 0 {
            g.all_reduce_data(data, ReduceOp::Sum).map(|_| ())
        } else {
            g.all_gather_data(data, 0).map(|_| ())
        }
    });
    for (rank, result) in out.iter().enumerate() {
        match result.as_ref().unwrap_err() {
            CollectiveError::Mismatch {
                peer, ours, theirs, ..
            } => {
                assert_eq!(*peer, 1 - rank);
                let (mine, other) = if rank == 0 {
                    ("all_reduce", "all_gather")
                } else {
                    ("all_gather", "all_reduce")
                };
                assert!(
                    ours.contains(mine) && theirs.contains(other),
                    "{ours} / {theirs}"
                );
            }
            other => panic!("rank {rank}: expected Mismatch, got {other}"),
        }
    }
}

#[test]
fn a_different_shape_is_an_error() {
    let out = run_tcp(2, |_, g| {
        let n = 4 + g.rank();
        g.all_reduce_data(TensorData::new(vec![1.0f32; n], [n]), ReduceOp::Sum)
            .map(|_| ())
    });
    for (rank, result) in out.iter().enumerate() {
        let err = result.as_ref().unwrap_err();
        assert!(
            matches!(err, CollectiveError::Mismatch { .. }),
            "rank {rank}: {err}"
        );
        assert!(
            err.to_string().contains("[4]") && err.to_string().contains("[5]"),
            "{err}"
        );
    }
}

/// Runs the rendezvous of one process per config (threads), rank 0 first in `configs`.
fn rendezvous_results(configs: Vec<TcpConfig>, rendezvous: TcpRendezvous) -> Vec<Result<()>> {
    let mut rendezvous = Some(rendezvous);
    thread::scope(|scope| {
        let handles: Vec<_> = configs
            .into_iter()
            .enumerate()
            .map(|(i, config)| {
                let rendezvous = if i == 0 { rendezvous.take() } else { None };
                scope.spawn(move || TcpTransport::connect(&config, rendezvous).map(|_| ()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn rendezvous_message(result: &Result<()>) -> String {
    match result {
        Err(CollectiveError::Rendezvous(m)) => m.clone(),
        Err(other) => panic!("expected a rendezvous error, got {other}"),
        Ok(()) => panic!("expected a rendezvous error, the world formed"),
    }
}

#[test]
fn a_world_size_disagreement_is_refused() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let start = Instant::now();
    let out = rendezvous_results(vec![config(0, 2, port), config(1, 3, port)], rendezvous);
    assert!(start.elapsed() < TIMEOUT);
    for result in &out {
        let message = rendezvous_message(result);
        assert!(
            message.contains("WORLD_SIZE=3") && message.contains("WORLD_SIZE=2"),
            "{message}"
        );
    }
}

#[test]
fn a_duplicate_rank_is_refused() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let start = Instant::now();
    let out = rendezvous_results(
        vec![config(0, 3, port), config(1, 3, port), config(1, 3, port)],
        rendezvous,
    );
    assert!(start.elapsed() < TIMEOUT);
    for result in &out {
        let message = rendezvous_message(result);
        assert!(
            message.contains("rank 1 is claimed by two processes"),
            "{message}"
        );
    }
}

#[test]
fn a_rank_out_of_range_is_refused() {
    let message = rendezvous_message(&TcpTransport::connect(&config(2, 2, 1), None).map(|_| ()));
    assert!(message.contains("rank 2 is out of range"), "{message}");
}

#[test]
fn the_rendezvous_times_out_instead_of_hanging() {
    // A rank whose rank 0 never comes.
    let unused = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = unused.port();
    drop(unused);
    let short = Duration::from_millis(500);
    let start = Instant::now();
    let message = rendezvous_message(
        &TcpTransport::connect(&config(1, 2, port).with_timeout(short), None).map(|_| ()),
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(message.contains("could not connect"), "{message}");

    // A rank 0 whose other ranks never come.
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let start = Instant::now();
    let message = rendezvous_message(
        &TcpTransport::connect(&config(0, 3, port).with_timeout(short), Some(rendezvous))
            .map(|_| ()),
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(message.contains("rank(s) [1, 2]"), "{message}");
}

// ----------------------------------------------------------------------------------------
// The launch environment.

fn env_of(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
    LaunchEnv::from_lookup(|name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    })
}

#[test]
fn the_launch_environment_is_read_and_checked() {
    let torchrun = [
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29400"),
    ];
    let env = env_of(&torchrun).unwrap();
    assert_eq!(
        env,
        LaunchEnv {
            rank: 2,
            world_size: 4,
            local_rank: Some(0),
            local_world_size: Some(2),
            master_addr: "10.1.2.3".into(),
            master_port: 29400,
            launcher: Launcher::Torchrun,
        }
    );

    let without = |name: &str| -> Vec<(&str, &str)> {
        torchrun
            .iter()
            .copied()
            .filter(|(k, _)| *k != name)
            .collect()
    };
    let with = |name: &'static str, value: &'static str| -> Vec<(&'static str, &'static str)> {
        let mut vars: Vec<_> = torchrun
            .iter()
            .copied()
            .filter(|(k, _)| *k != name)
            .collect();
        vars.push((name, value));
        vars
    };
    let message = |r: Result<LaunchEnv>| match r {
        Err(CollectiveError::Rendezvous(m)) => m,
        other => panic!("expected a rendezvous error, got {other:?}"),
    };
    let m = message(env_of(&without("RANK")));
    assert!(
        m.contains("RANK is not set") && m.contains("burnrun"),
        "{m}"
    );
    let m = message(env_of(&without("MASTER_PORT")));
    assert!(m.contains("MASTER_PORT is not set"), "{m}");
    let m = message(env_of(&without("MASTER_ADDR")));
    assert!(m.contains("MASTER_ADDR is not set"), "{m}");
    let m = message(env_of(&with("WORLD_SIZE", "four")));
    assert!(m.contains("WORLD_SIZE=\"four\""), "{m}");
    let m = message(env_of(&with("MASTER_PORT", "70000")));
    assert!(m.contains("MASTER_PORT=\"70000\""), "{m}");
    let m = message(env_of(&with("RANK", "4")));
    assert!(m.contains("RANK=4 is out of range for WORLD_SIZE=4"), "{m}");
    let m = message(env_of(&with("LOCAL_RANK", "-1")));
    assert!(m.contains("LOCAL_RANK=\"-1\""), "{m}");

    let slurm = env_of(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "4"),
        ("SLURM_JOB_NODELIST", "gpu[012-013]"),
    ])
    .unwrap();
    assert_eq!(
        (
            slurm.rank,
            slurm.world_size,
            slurm.local_rank,
            slurm.local_world_size
        ),
        (5, 8, Some(1), Some(4))
    );
    assert_eq!(
        (
            slurm.master_addr.as_str(),
            slurm.master_port,
            slurm.launcher
        ),
        ("gpu012", 29500, Launcher::Slurm)
    );
    let m = message(env_of(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]));
    assert!(
        m.contains("MASTER_ADDR is not set (nor SLURM_JOB_NODELIST)"),
        "{m}"
    );
}
