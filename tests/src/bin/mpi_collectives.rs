//! An MPI program for `tests/mpi.rs`, run as `mpirun -np N mpi_collectives MODE`: every rank
//! checks the collectives of the `mpi` backend against values it computes directly (every
//! rank's input is a pure function of its rank), and prints `rank R: ok NAME` per check.
//!
//! Modes: `collectives` (every collective, dtype and sub-group), `mismatch` (two ranks calling
//! different shapes get a typed error, and the job goes on), `timeout` (a rank that arrives
//! late makes the others' call fail with a typed error, then the job is aborted), `mesh` (a
//! mesh that does not fit the MPI world is a typed error).

use std::process::ExitCode;
use std::time::Duration;

use burn::tensor::{DType, TensorData};
use burn_parallel::{CollectiveError, MeshError, ParallelDims, ProcessGroup, ReduceOp};

/// Rank `k`'s value at index `i`: small integers, exact in every dtype and in every sum.
fn value(k: usize, i: usize) -> f64 {
    ((k * 31 + i * 7) % 17) as f64 - 8.0
}

fn data(k: usize, shape: &[usize], dtype: DType) -> TensorData {
    let len = shape.iter().product();
    let values: Vec<f32> = (0..len).map(|i| value(k, i) as f32).collect();
    TensorData::new(values, shape.to_vec()).convert_dtype(dtype)
}

fn floats(data: &TensorData) -> Vec<f64> {
    data.iter::<f64>().collect()
}

/// Asserts that `got` has `shape` and the values `want`, and prints `rank R: ok NAME`.
fn check(rank: usize, name: &str, got: &TensorData, shape: &[usize], want: &[f64]) {
    check_within(rank, name, got, shape, want, 1e-6);
}

/// [`check`] with a relative tolerance (the rounding of a half-precision average).
fn check_within(
    rank: usize,
    name: &str,
    got: &TensorData,
    shape: &[usize],
    want: &[f64],
    tol: f64,
) {
    assert_eq!(got.shape().as_slice(), shape, "rank {rank}: {name}: shape");
    let got = floats(got);
    assert_eq!(got.len(), want.len(), "rank {rank}: {name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "rank {rank}: {name}: element {i} is {g}, expected {w}"
        );
    }
    println!("rank {rank}: ok {name}");
}

fn reduce(values: impl Iterator<Item = f64>, op: ReduceOp, n: usize) -> f64 {
    let all: Vec<f64> = values.collect();
    match op {
        ReduceOp::Sum => all.iter().sum(),
        ReduceOp::Avg => all.iter().sum::<f64>() / n as f64,
        ReduceOp::Max => all.iter().copied().fold(f64::MIN, f64::max),
        ReduceOp::Min => all.iter().copied().fold(f64::MAX, f64::min),
    }
}

/// Every collective of `group` (whose members are the world ranks `members`).
fn collectives(group: &ProcessGroup, label: &str) -> burn_parallel::Result<()> {
    let n = group.size();
    let r = group.rank();
    let world_rank = group.global_rank();
    let members = group.members().to_vec();
    // Inputs are functions of the *world* rank, so sub-groups see different data.
    let input = |k: usize, shape: &[usize], dtype| data(members[k], shape, dtype);
    let at = |k: usize, i: usize| value(members[k], i);
    // With MPI calls limited to a few units (BURN_PARALLEL_MPI_MAX_COUNT), large buffers
    // would take thousands of calls: the limited run keeps to the small ones.
    let limited = std::env::var(burn_parallel::comm::mpi::MAX_COUNT_VAR).is_ok();
    let lens: &[usize] = if limited {
        &[1, 5, 1000]
    } else {
        &[1, 5, 1000, 70_001]
    };
    let p2p_lens: &[usize] = if limited {
        &[3, 1000]
    } else {
        &[3, 1000, 100_000]
    };

    for dtype in [DType::F32, DType::F64, DType::I32, DType::F16, DType::BF16] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            if op == ReduceOp::Avg && dtype == DType::I32 {
                continue; // integer averages truncate: checked in float dtypes
            }
            for &len in lens {
                let got = group.all_reduce_data(input(r, &[len], dtype), op)?;
                let want: Vec<f64> = (0..len)
                    .map(|i| reduce((0..n).map(|k| at(k, i)), op, n))
                    .collect();
                let name = format!("{label} all_reduce {op} {dtype:?} [{len}]");
                let tol = match dtype {
                    DType::F16 => 1e-3,
                    DType::BF16 => 1e-2,
                    _ => 1e-6,
                };
                check_within(world_rank, &name, &got, &[len], &want, tol);
            }
        }
    }

    // All-gather along dim 0 and dim 1, with uneven shards (rank k has k + 1 units).
    for dim in [0usize, 1] {
        let shape = |k: usize| {
            if dim == 0 {
                vec![k + 1, 3]
            } else {
                vec![2, k + 1]
            }
        };
        let got = group.all_gather_data(input(r, &shape(r), DType::F32), dim)?;
        let total: usize = (0..n).map(|k| k + 1).sum();
        let mut want = Vec::new();
        let out_shape = if dim == 0 {
            vec![total, 3]
        } else {
            vec![2, total]
        };
        if dim == 0 {
            for k in 0..n {
                want.extend((0..(k + 1) * 3).map(|i| at(k, i)));
            }
        } else {
            for row in 0..2 {
                for k in 0..n {
                    want.extend((0..k + 1).map(|c| at(k, row * (k + 1) + c)));
                }
            }
        }
        let name = format!("{label} all_gather dim {dim}");
        check(world_rank, &name, &got, &out_shape, &want);
    }

    // Reduce-scatter along dim 0 (even) and dim 1 (explicit uneven sizes).
    for (dim, sizes) in [(0usize, None), (1, Some((1..=n).collect::<Vec<_>>()))] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let cols: usize = sizes.as_ref().map_or(3, |s| s.iter().sum());
            let rows = if dim == 0 { 2 * n } else { 2 };
            let full = [rows, cols];
            let got = group.reduce_scatter_data(
                input(r, &full, DType::F32),
                dim,
                op,
                sizes.as_deref(),
            )?;
            let reduced: Vec<f64> = (0..rows * cols)
                .map(|i| reduce((0..n).map(|k| at(k, i)), op, n))
                .collect();
            let (shape, want) = if dim == 0 {
                let mine = &reduced[r * 2 * cols..(r + 1) * 2 * cols];
                (vec![2, cols], mine.to_vec())
            } else {
                let sizes = sizes.as_ref().expect("dim 1 has sizes");
                let start: usize = sizes[..r].iter().sum();
                let want: Vec<f64> = (0..rows)
                    .flat_map(|row| (0..sizes[r]).map(move |c| (row, c)))
                    .map(|(row, c)| reduced[row * cols + start + c])
                    .collect();
                (vec![rows, sizes[r]], want)
            };
            let name = format!("{label} reduce_scatter {op} dim {dim}");
            check(world_rank, &name, &got, &shape, &want);
        }
    }

    // Broadcast from the first and the last rank.
    for root in [0, n - 1] {
        let got = group.broadcast_data(input(r, &[4, 3], DType::F32), root)?;
        let want: Vec<f64> = (0..12).map(|i| at(root, i)).collect();
        check(
            world_rank,
            &format!("{label} broadcast root {root}"),
            &got,
            &[4, 3],
            &want,
        );
    }

    // All-to-all along dim 0: rank k sends d + k + 1 rows (of 2 values) to rank d.
    let rows_to = |k: usize, d: usize| d + k + 1;
    let send_sizes: Vec<usize> = (0..n).map(|d| rows_to(r, d)).collect();
    let my_rows: usize = send_sizes.iter().sum();
    let got = group.all_to_all_data(input(r, &[my_rows, 2], DType::F32), 0, &send_sizes)?;
    let mut want = Vec::new();
    for k in 0..n {
        let start: usize = (0..r).map(|d| rows_to(k, d)).sum();
        want.extend((start * 2..(start + rows_to(k, r)) * 2).map(|i| at(k, i)));
    }
    let rows: usize = (0..n).map(|k| rows_to(k, r)).sum();
    check(
        world_rank,
        &format!("{label} all_to_all dim 0"),
        &got,
        &[rows, 2],
        &want,
    );

    // All-to-all splitting dim 1 (2 columns per rank) and concatenating dim 0 (Ulysses).
    let (got, sizes) =
        group.all_to_all_dims_data(input(r, &[3, 2 * n], DType::F32), 1, &vec![2; n], 0)?;
    assert_eq!(sizes, vec![3; n], "rank {world_rank}: received sizes");
    let want: Vec<f64> = (0..n)
        .flat_map(|k| (0..3).flat_map(move |row| (0..2).map(move |c| (k, row * 2 * n + 2 * r + c))))
        .map(|(k, i)| at(k, i))
        .collect();
    check(
        world_rank,
        &format!("{label} all_to_all split 1 concat 0"),
        &got,
        &[3 * n, 2],
        &want,
    );

    group.barrier()?;
    println!("rank {world_rank}: ok {label} barrier");

    // Point to point around the ring, small (inline) and large (chunked) payloads.
    if n > 1 {
        for &len in p2p_lens {
            group.send_data(input(r, &[len], DType::F32), (r + 1) % n, 5)?;
            let from = (r + n - 1) % n;
            let got = group.recv_data(from, 5)?;
            let want: Vec<f64> = (0..len).map(|i| at(from, i)).collect();
            check(
                world_rank,
                &format!("{label} send/recv [{len}]"),
                &got,
                &[len],
                &want,
            );
        }
    }

    // Objects and bytes (frames over MPI point to point).
    let names = group.all_gather_object(&format!("rank {world_rank}"))?;
    let expected: Vec<String> = members.iter().map(|m| format!("rank {m}")).collect();
    assert_eq!(names, expected, "rank {world_rank}: all_gather_object");
    let config: String =
        group.broadcast_object((r == 0).then_some(&"from the root".to_string()), 0)?;
    assert_eq!(config, "from the root");
    println!("rank {world_rank}: ok {label} objects");
    Ok(())
}

fn run(world: &ProcessGroup, mode: &str) -> burn_parallel::Result<()> {
    let n = world.size();
    let r = world.rank();
    match mode {
        "collectives" => {
            assert_eq!(world.backend(), "mpi");
            // The thread policy counted the ranks on this node (all of them, under one mpirun).
            let threads = burn_parallel::threads::intra_op_threads();
            assert_eq!(
                threads,
                burn_parallel::threads::auto_threads(n),
                "rank {r}: intra-op threads"
            );
            println!("rank {r}: ok threads {threads} for {n} ranks on this node");
            collectives(world, "world")?;
            // A sub-group of the ranks in reverse order, and one of every other rank (its
            // communicator is created by its members only).
            let reversed: Vec<usize> = (0..n).rev().collect();
            collectives(&world.split(&reversed)?, "reversed")?;
            let evens: Vec<usize> = (0..n).step_by(2).collect();
            if evens.contains(&r) {
                collectives(&world.split(&evens)?, "evens")?;
            }
            // Mesh dimensions are sub-groups too: an all-reduce on each dimension.
            if n.is_multiple_of(2) {
                let dims = ParallelDims {
                    dp_replicate: n / 2,
                    tp: 2,
                    ..Default::default()
                };
                let mesh = dims
                    .build(world)
                    .map_err(|e| CollectiveError::InvalidArgument {
                        rank: world.global_rank(),
                        op: "mesh".into(),
                        reason: e.to_string(),
                    })?;
                let tp = mesh.group("tp").expect("a tp dimension");
                let sum = tp.all_reduce_f32(vec![world.global_rank() as f32], ReduceOp::Sum)?;
                let want: f32 = tp.members().iter().map(|&m| m as f32).sum();
                assert_eq!(sum, vec![want], "rank {r}: tp all-reduce");
                println!("rank {r}: ok mesh tp all_reduce");
            }
            world.barrier()?;
            println!("rank {r}: ok all");
        }
        "mismatch" => {
            let len = if r == 0 { 4 } else { 5 };
            let err = world
                .all_reduce_data(data(r, &[len], DType::F32), ReduceOp::Sum)
                .expect_err("shapes differ");
            match &err {
                CollectiveError::Mismatch { ours, theirs, .. } => {
                    assert!(ours.contains(&format!("[{len}]")), "{err}");
                    assert!(theirs.contains("all_reduce"), "{err}");
                }
                other => panic!("rank {r}: expected a mismatch, got {other}"),
            }
            println!("rank {r}: mismatch error: {err}");
            // Every rank saw the mismatch before moving data: the job goes on.
            let sum = world.all_reduce_f32(vec![1.0], ReduceOp::Sum)?;
            assert_eq!(sum, vec![n as f32]);
            println!("rank {r}: ok mismatch");
        }
        "timeout" => {
            let world = world.clone().with_timeout(Duration::from_secs(2));
            if r == n - 1 {
                std::thread::sleep(Duration::from_secs(5));
            }
            match world.barrier() {
                Err(e @ CollectiveError::CollectiveTimeout { .. }) => {
                    println!("rank {r}: timeout error: {e}");
                    return Err(e);
                }
                Err(e) => panic!("rank {r}: expected a timeout, got {e}"),
                Ok(()) if r == n - 1 => {
                    // The late rank finds the others' headers; they have given up.
                    std::thread::sleep(Duration::from_secs(60));
                }
                Ok(()) => panic!("rank {r}: the barrier passed without the late rank"),
            }
        }
        "mesh" => {
            let dims = ParallelDims {
                dp_replicate: 2,
                tp: 2,
                ..Default::default()
            };
            match dims.build(world) {
                Err(e @ MeshError::SizeMismatch { .. }) => println!("rank {r}: mesh error: {e}"),
                Err(e) => panic!("rank {r}: expected a world-size error, got {e}"),
                Ok(_) => panic!("rank {r}: a 2 x 2 mesh built on {n} MPI ranks"),
            }
            println!("rank {r}: ok mesh");
        }
        other => panic!("unknown mode {other}"),
    }
    Ok(())
}

fn main() -> ExitCode {
    let mode = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "collectives".into());
    let world = match burn_parallel::world::init_mpi() {
        Ok(world) => world,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&world, &mode) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {}: error: {e}", world.rank());
            ExitCode::FAILURE
        }
    }
}
