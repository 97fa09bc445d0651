//! The shared-memory all-reduce of thread ranks (`local` backend, buffers of 256 KiB and more):
//! the sum in rank order, bitwise the same on every rank, for every dtype and operation, on
//! sizes that do not divide by the number of ranks, and typed errors (never a hang) when a
//! peer is missing, fails or calls something else.

use std::time::{Duration, Instant};

use burn::tensor::{Element, TensorData};
use burn_parallel::{CollectiveError, ReduceOp, run_local};
use half::{bf16, f16};

/// Element counts above the shared-memory threshold for every dtype (256 KiB of `u8`), not
/// divisible by 2, 3 or 4.
const LEN: usize = 300_007;

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

#[test]
fn floats_are_summed_in_rank_order_and_every_rank_holds_the_same_bits() {
    // With these values the order of the additions shows in the result:
    // (1e8 + -1e8) + 1 + 1 = 2, but (1 + 1e8) + -1e8 + 1 = 1 in f32.
    let value = |r: usize, i: usize| -> f32 {
        let scale = 1.0 + (i % 5) as f32;
        match r {
            0 => 1e8 * scale,
            1 => -1e8 * scale,
            _ => 1.0 + (i % 3) as f32,
        }
    };
    for n in [3, 4] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let out = run_local(n, |g| {
                let v: Vec<f32> = (0..LEN).map(|i| value(g.rank(), i)).collect();
                g.all_reduce_data(TensorData::new(v, [LEN]), op)
            })
            .unwrap();
            let expected: Vec<f32> = (0..LEN)
                .map(|i| {
                    let sum = (1..n).fold(value(0, i), |acc, r| acc + value(r, i));
                    match op {
                        ReduceOp::Avg => sum / n as f32,
                        _ => sum,
                    }
                })
                .collect();
            for (rank, d) in out.iter().enumerate() {
                let got = d.as_slice::<f32>().unwrap();
                let wrong = got
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                if let Some(i) = wrong {
                    panic!(
                        "n={n} {op}: rank {rank} element {i} is {}, the rank-order fold gives {}",
                        got[i], expected[i]
                    );
                }
            }
            assert!(out.iter().all(|d| d.as_bytes() == out[0].as_bytes()));
        }
    }
}

/// Small integers, exact in every dtype, so that the expected values do not depend on the
/// order of the reduction.
fn small(r: usize, i: usize, signed: bool) -> i64 {
    let v = ((r * 17 + i * 7) % 41) as i64;
    if signed { v - 20 } else { v }
}

trait Case: Element + bytemuck::Pod + PartialEq + std::fmt::Debug {
    const SIGNED: bool;
    fn of(v: i64) -> Self;
    /// The expected reduction of the column `values` (in rank order).
    fn reduce(values: &[i64], op: ReduceOp) -> Self;
}

macro_rules! float_case {
    ($t:ty, $from:expr, $div:expr) => {
        impl Case for $t {
            const SIGNED: bool = true;
            fn of(v: i64) -> Self {
                $from(v)
            }
            fn reduce(values: &[i64], op: ReduceOp) -> Self {
                let sum: i64 = values.iter().sum();
                match op {
                    ReduceOp::Sum => $from(sum),
                    ReduceOp::Avg => $div(sum, values.len()),
                    ReduceOp::Max => $from(*values.iter().max().unwrap()),
                    ReduceOp::Min => $from(*values.iter().min().unwrap()),
                }
            }
        }
    };
}

float_case!(f64, |v: i64| v as f64, |s: i64, n: usize| s as f64
    / n as f64);
float_case!(f32, |v: i64| v as f32, |s: i64, n: usize| s as f32
    / n as f32);
float_case!(f16, |v: i64| f16::from_f32(v as f32), |s: i64, n: usize| {
    f16::from_f32(s as f32 / n as f32)
});
float_case!(
    bf16,
    |v: i64| bf16::from_f32(v as f32),
    |s: i64, n: usize| { bf16::from_f32(s as f32 / n as f32) }
);

macro_rules! int_case {
    ($t:ty, $signed:expr) => {
        impl Case for $t {
            const SIGNED: bool = $signed;
            fn of(v: i64) -> Self {
                v as $t
            }
            fn reduce(values: &[i64], op: ReduceOp) -> Self {
                let sum: i64 = values.iter().sum();
                match op {
                    ReduceOp::Sum => sum as $t,
                    ReduceOp::Avg => (sum as $t) / values.len() as $t,
                    ReduceOp::Max => *values.iter().max().unwrap() as $t,
                    ReduceOp::Min => *values.iter().min().unwrap() as $t,
                }
            }
        }
    };
}

int_case!(i64, true);
int_case!(i32, true);
int_case!(i16, true);
int_case!(i8, true);
int_case!(u64, false);
int_case!(u32, false);
int_case!(u16, false);
int_case!(u8, false);

fn check_dtype<T: Case>(n: usize) {
    for op in OPS {
        let out = run_local(n, |g| {
            let v: Vec<T> = (0..LEN)
                .map(|i| T::of(small(g.rank(), i, T::SIGNED)))
                .collect();
            g.all_reduce_data(TensorData::new(v, [LEN]), op)
        })
        .unwrap();
        let dtype = out[0].dtype();
        for (rank, d) in out.iter().enumerate() {
            assert_eq!(d.dtype(), T::dtype(), "n={n} {op}");
            assert_eq!(d.shape().as_slice(), &[LEN]);
            let got = d.as_slice::<T>().unwrap();
            for (i, &x) in got.iter().enumerate() {
                let column: Vec<i64> = (0..n).map(|r| small(r, i, T::SIGNED)).collect();
                let want = T::reduce(&column, op);
                assert_eq!(x, want, "{dtype:?} n={n} {op}: rank {rank} element {i}");
            }
        }
    }
}

#[test]
fn every_dtype_and_op_on_two_and_three_ranks() {
    for n in [2, 3] {
        check_dtype::<f64>(n);
        check_dtype::<f32>(n);
        check_dtype::<f16>(n);
        check_dtype::<bf16>(n);
        check_dtype::<i64>(n);
        check_dtype::<i32>(n);
        check_dtype::<i16>(n);
        check_dtype::<i8>(n);
        check_dtype::<u64>(n);
        check_dtype::<u32>(n);
        check_dtype::<u16>(n);
        check_dtype::<u8>(n);
    }
}

#[test]
fn sizes_around_the_chunk_boundaries() {
    // From just above the threshold (65_536 f32) to sizes that leave 1, 2 or 3 extra elements
    // over 4 ranks, and sizes larger than one block of the copy loop.
    for len in [65_536, 65_537, 65_538, 65_539, 262_147, 1_000_003] {
        for n in [2, 3, 4] {
            let out = run_local(n, |g| {
                let v: Vec<f32> = (0..len)
                    .map(|i| (g.rank() * 1000 + i % 997) as f32)
                    .collect();
                g.all_reduce_data(TensorData::new(v, [len]), ReduceOp::Sum)
            })
            .unwrap();
            for d in &out {
                let got = d.as_slice::<f32>().unwrap();
                for (i, &x) in got.iter().enumerate() {
                    let want: f32 = (0..n).map(|r| (r * 1000 + i % 997) as f32).sum();
                    assert_eq!(x, want, "len={len} n={n} element {i}");
                }
            }
        }
    }
}

#[test]
fn a_missing_peer_times_out_and_a_failed_peer_fails_everyone() {
    let big = || TensorData::new(vec![1.0f32; LEN], [LEN]);
    let start = Instant::now();
    let err = run_local(2, |g| {
        let g = g.with_timeout(Duration::from_millis(300));
        if g.rank() == 0 {
            g.all_reduce_data(big(), ReduceOp::Sum).map(|_| ())
        } else {
            // Rank 1 never calls but stays alive past rank 0's timeout.
            std::thread::sleep(Duration::from_millis(600));
            Ok(())
        }
    })
    .unwrap_err();
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
    let err = run_local(3, |g| {
        let g = g.with_timeout(Duration::from_secs(10));
        if g.rank() == 2 {
            panic!("rank 2 dies before the all-reduce");
        }
        g.all_reduce_data(big(), ReduceOp::Sum).map(|_| ())
    })
    .unwrap_err();
    assert!(err.to_string().contains("rank 2 dies"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn another_op_or_dtype_on_one_rank_is_a_mismatch() {
    let err = run_local(3, |g| {
        let g = g.with_timeout(Duration::from_secs(10));
        let op = if g.rank() == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        g.all_reduce_data(TensorData::new(vec![1.0f32; LEN], [LEN]), op)
            .map(|_| ())
    })
    .unwrap_err();
    assert!(err.to_string().contains("mismatch"), "{err}");
    let err = run_local(2, |g| {
        let g = g.with_timeout(Duration::from_secs(10));
        let data = match g.rank() {
            0 => TensorData::new(vec![1.0f32; LEN], [LEN]),
            _ => TensorData::new(vec![1i32; LEN], [LEN]),
        };
        g.all_reduce_data(data, ReduceOp::Sum).map(|_| ())
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("mismatch") && msg.contains("f32") && msg.contains("i32"),
        "{msg}"
    );
}
