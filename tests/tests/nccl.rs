//! The `nccl` backend.
//!
//! Everywhere (CI has no GPU): a build without the `nccl` feature, and a machine without the
//! CUDA driver, a device or `libnccl`, give [`CollectiveError::BackendUnavailable`] saying what
//! to install or rebuild with, on every rank and without a hang.
//!
//! With `--features nccl,cuda` on a machine with a CUDA device and `libnccl`: every
//! collective on CUDA tensors (all-reduce, all-gather even and uneven, reduce-scatter even and
//! uneven, broadcast, all-to-all, send/recv) matches the host path, sub-groups get their own
//! communicators, a mismatched call is an error, and the GPT under DDP and TP on an NCCL group
//! matches single-device training. Without a device these print a visible `SKIPPED` line, and
//! fail instead where `BURN_PARALLEL_REQUIRE_CUDA=1` (a GPU host).

use burn_parallel::CollectiveError;
use burn_parallel::nccl;

fn assert_unavailable(e: &CollectiveError, needles: &[&str]) {
    let text = e.to_string();
    assert!(
        matches!(e, CollectiveError::BackendUnavailable { .. }),
        "expected BackendUnavailable, got {e:?}"
    );
    assert!(
        needles.iter().any(|n| text.contains(n)),
        "the message should say one of {needles:?}: {text}"
    );
}

/// Without the `nccl` feature, asking for the backend says to rebuild with it.
#[cfg(not(feature = "nccl"))]
#[test]
fn without_the_feature_the_nccl_backend_says_to_rebuild() {
    const { assert!(!nccl::BUILT) };
    let e = nccl::probe(0).unwrap_err();
    assert_unavailable(&e, &["--features nccl"]);
    let out = burn_parallel::run_local(2, |g| match nccl::attach(g, 0) {
        Ok(_) => Ok(None),
        Err(e) => Ok(Some(e)),
    })
    .unwrap();
    for e in out {
        assert_unavailable(&e.expect("attach must fail"), &["--features nccl"]);
    }
}

/// NCCL on this machine, or `None` after a visible `SKIPPED test: reason` line (past libtest's
/// capture, so that a CI log shows it) when it lacks a CUDA device or `libnccl`. With
/// `BURN_PARALLEL_REQUIRE_CUDA` set (a GPU host), a missing piece fails the test instead.
///
/// # Panics
/// When `BURN_PARALLEL_REQUIRE_CUDA` is set and NCCL cannot run here.
#[cfg(all(feature = "nccl", feature = "cuda"))]
fn nccl_or_skip(test: &str) -> Option<nccl::NcclInfo> {
    match nccl::probe(0) {
        Ok(info) => Some(info),
        Err(e) if std::env::var_os("BURN_PARALLEL_REQUIRE_CUDA").is_some() => {
            panic!("BURN_PARALLEL_REQUIRE_CUDA is set but {e}")
        }
        Err(e) => {
            tests::visible_notice(&format!(
                "SKIPPED {test}: no CUDA device/libnccl here ({e}); set \
                 BURN_PARALLEL_REQUIRE_CUDA=1 to fail instead"
            ));
            None
        }
    }
}

/// No driver, no device or no libnccl: every rank of `attach` gets the same typed error at
/// once. On a machine with NCCL, a device index beyond the last one is the missing piece.
#[cfg(feature = "nccl")]
#[test]
fn a_missing_driver_device_or_libnccl_is_a_typed_error_on_every_rank() {
    let (device, needles): (usize, &[&str]) = match nccl::probe(0) {
        Ok(info) => (info.cuda_devices + 7, &["CUDA device"]),
        Err(e) => {
            // This machine lacks something: the probe must say what.
            eprintln!("without NCCL here: {e}");
            assert_unavailable(&e, &["CUDA driver", "cuInit", "libnccl", "CUDA device"]);
            (0, &["CUDA driver", "cuInit", "libnccl", "CUDA device"])
        }
    };
    let e = nccl::probe(device).unwrap_err();
    assert_unavailable(&e, needles);
    let started = std::time::Instant::now();
    let out = burn_parallel::run_local(3, |g| match nccl::attach(g, device) {
        Ok(_) => Ok(None),
        Err(e) => Ok(Some(e)),
    })
    .unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    for e in out {
        assert_unavailable(&e.expect("attach must fail on every rank"), needles);
    }
}

/// `init_from_env` without a launcher's variables is a rendezvous error, not a hang.
#[test]
fn init_from_env_without_a_launcher_is_an_error() {
    if std::env::var_os("WORLD_SIZE").is_some() || std::env::var_os("SLURM_PROCID").is_some() {
        eprintln!("init_from_env_without_a_launcher_is_an_error: skipped: launched by a launcher");
        return;
    }
    let e = nccl::init_from_env().unwrap_err();
    if nccl::BUILT {
        assert!(
            matches!(e, CollectiveError::Rendezvous(_)),
            "expected a rendezvous error, got {e:?}"
        );
    } else {
        assert_unavailable(&e, &["--features nccl"]);
    }
}

/// The device tests: CUDA tensors through NCCL against the host path.
#[cfg(all(feature = "nccl", feature = "cuda"))]
mod device {
    use burn::tensor::{Device, Distribution, Tensor, TensorData, Tolerance};
    use burn_parallel::{CollectiveError, ProcessGroup, ReduceOp, run_local};
    use examples::train::{Parallelism, TrainConfig, TrainDevice};

    use super::{nccl, nccl_or_skip};

    /// Thread ranks, one per CUDA device (NCCL refuses two ranks of a communicator on one
    /// device), at most 4.
    fn ranks(info: &nccl::NcclInfo) -> usize {
        info.cuda_devices.min(4)
    }

    /// Runs `f` on `n` thread ranks with NCCL attached, rank r on CUDA device r.
    fn on_nccl<T: Send>(
        n: usize,
        f: impl Fn(&ProcessGroup, &Device) -> burn_parallel::Result<T> + Sync,
    ) -> Vec<T> {
        run_local(n, |g| {
            let rank = g.rank();
            let g = nccl::attach(g, rank)?;
            assert_eq!(g.backend(), "nccl");
            f(&g, &Device::cuda(rank))
        })
        .unwrap_or_else(|e| panic!("nccl run on {n} ranks: {e}"))
    }

    /// Input of rank `r`: distinct per rank, reproducible.
    fn input(r: usize, shape: [usize; 2], device: &Device) -> Tensor<2> {
        let n = shape[0] * shape[1];
        let values: Vec<f32> = (0..n)
            .map(|i| (i * 7 + r * 13) as f32 * 0.25 - 3.0)
            .collect();
        Tensor::from_data(TensorData::new(values, shape), device)
    }

    fn host(t: Tensor<2>) -> TensorData {
        t.into_data()
    }

    /// The same collective on a `local` group of Flex tensors (the host path).
    fn on_host<T: Send>(n: usize, f: impl Fn(&ProcessGroup, &Device) -> T + Sync) -> Vec<T> {
        run_local(n, |g| Ok(f(&g, &Device::flex()))).unwrap()
    }

    fn same(a: &[TensorData], b: &[TensorData], what: &str) {
        assert_eq!(a.len(), b.len());
        for (r, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.shape(), y.shape(), "{what}: rank {r} shape");
            x.assert_approx_eq::<f32>(y, Tolerance::absolute(1e-4));
        }
    }

    #[test]
    fn collectives_on_cuda_tensors_match_the_host_path() {
        let Some(info) = nccl_or_skip("collectives_on_cuda_tensors_match_the_host_path") else {
            return;
        };
        let n = ranks(&info);
        eprintln!("NCCL {:?}, {n} rank(s), one per CUDA device", info.version);
        type Case = (
            &'static str,
            fn(&ProcessGroup, Tensor<2>) -> burn_parallel::Result<Tensor<2>>,
        );
        let cases: Vec<Case> = vec![
            ("all_reduce sum", |g, x| g.all_reduce(x, ReduceOp::Sum)),
            ("all_reduce avg", |g, x| g.all_reduce(x, ReduceOp::Avg)),
            ("all_reduce max", |g, x| g.all_reduce(x, ReduceOp::Max)),
            ("all_gather dim 0", |g, x| g.all_gather(x, 0)),
            ("all_gather dim 1", |g, x| g.all_gather(x, 1)),
            ("all_gather uneven dim 1", |g, x| {
                let keep = 1 + g.rank() % 3;
                g.all_gather(x.narrow(1, 0, keep), 1)
            }),
            ("reduce_scatter even dim 0", |g, x| {
                let rows = 2 * g.size();
                g.reduce_scatter(x.narrow(0, 0, rows), 0, ReduceOp::Sum, None)
            }),
            ("reduce_scatter uneven dim 1", |g, x| {
                let mut sizes = vec![1; g.size()];
                sizes[0] = 5 - (g.size() - 1).min(4);
                let total: usize = sizes.iter().sum();
                g.reduce_scatter(x.narrow(1, 0, total), 1, ReduceOp::Sum, Some(&sizes))
            }),
            ("broadcast from last", |g, x| g.broadcast(x, g.size() - 1)),
            ("all_to_all dim 0", |g, x| {
                // Rank r sends k + 1 rows to rank k (uneven), the rest to itself.
                let n = g.size();
                let mut sizes: Vec<usize> = (0..n).map(|k| k + 1).collect();
                let rest = 8 - sizes.iter().sum::<usize>().min(8);
                sizes[g.rank()] += rest;
                let total: usize = sizes.iter().sum();
                g.all_to_all(x.narrow(0, 0, total), 0, &sizes)
            }),
        ];
        for (what, op) in cases {
            let shape = [8 + 2 * n, 5];
            let got: Vec<TensorData> =
                on_nccl(n, |g, d| op(g, input(g.rank(), shape, d)).map(host));
            let want: Vec<TensorData> =
                on_host(n, |g, d| host(op(g, input(g.rank(), shape, d)).unwrap()));
            same(&got, &want, what);
            eprintln!("{what}: NCCL matches the host path on {n} rank(s)");
        }
    }

    #[test]
    fn autodiff_and_other_dtypes_go_through_nccl() {
        let Some(info) = nccl_or_skip("autodiff_and_other_dtypes_go_through_nccl") else {
            return;
        };
        let n = ranks(&info);
        let got = on_nccl(n, |g, d| {
            let x = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &d.clone().autodiff());
            let y = g.all_reduce(x, ReduceOp::Sum)?;
            assert!(
                y.is_autodiff(),
                "an autodiff input gives an autodiff output"
            );
            let h = Tensor::<1>::from_floats([0.5, 1.5], d).cast(burn::tensor::DType::F16);
            let h = g.all_reduce(h, ReduceOp::Sum)?;
            Ok((
                y.into_data().try_to_vec::<f32>().unwrap(),
                h.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            ))
        });
        for (y, h) in got {
            assert_eq!(y, vec![n as f32, 2.0 * n as f32, 3.0 * n as f32]);
            assert_eq!(h, vec![0.5 * n as f32, 1.5 * n as f32]);
        }
    }

    #[test]
    fn send_recv_and_subgroups_on_cuda_tensors() {
        let Some(info) = nccl_or_skip("send_recv_and_subgroups_on_cuda_tensors") else {
            return;
        };
        let n = ranks(&info);
        if n < 2 {
            eprintln!("send_recv_and_subgroups_on_cuda_tensors: skipped: needs 2 CUDA devices");
            return;
        }
        let got = on_nccl(n, |g, d| {
            // A ring of sends (rank r to r + 1), each received in order, plus a host-path send
            // received through the same `recv`.
            let next = (g.rank() + 1) % g.size();
            let prev = (g.rank() + g.size() - 1) % g.size();
            let x = Tensor::<2>::random([3, 4], Distribution::Default, d);
            let sent = x.clone().into_data();
            // Every rank sends first and receives second: device sends return at once (a
            // channel per direction), so the ring cannot deadlock once its pairs connected.
            g.connect_peers(&[next, prev], d)?;
            g.send(x, next, 7)?;
            g.send_data(TensorData::new(vec![g.rank() as f32], [1]), next, 8)?;
            let (received, host) = (g.recv::<2>(prev, 7, d)?, g.recv::<1>(prev, 8, d)?);
            g.wait_p2p()?;
            // A sub-group of the even ranks gets its own communicator.
            let evens: Vec<usize> = (0..g.size()).step_by(2).collect();
            let sub = if g.rank() % 2 == 0 {
                let sub = g.split(&evens)?;
                let s = sub.all_reduce(Tensor::<1>::ones([2], d), ReduceOp::Sum)?;
                Some(s.into_data().try_to_vec::<f32>().unwrap())
            } else {
                let _ = g.split(&(1..g.size()).step_by(2).collect::<Vec<_>>())?;
                None
            };
            Ok((
                sent,
                received.into_data(),
                host.into_data(),
                sub,
                evens.len(),
            ))
        });
        for (r, (_, received, host, sub, evens)) in got.iter().enumerate() {
            let prev = (r + n - 1) % n;
            assert_eq!(
                received, &got[prev].0,
                "rank {r} received rank {prev}'s tensor"
            );
            assert_eq!(host.try_to_vec::<f32>().unwrap(), vec![prev as f32]);
            if let Some(sub) = sub {
                assert_eq!(sub, &vec![*evens as f32; 2]);
            }
        }
    }

    /// `all_reduce_async` on a CUDA tensor returns before NCCL ran, and NCCL's stream is
    /// ordered after the kernels that produce its input by a device-side wait (no host sync):
    /// the input here is the end of a long chain of products still running when the
    /// collective is launched, so NCCL reading it early would sum unfinished memory. Several
    /// collectives in flight at once, waited for in reverse order, each give its own sum.
    #[test]
    fn async_collectives_wait_for_their_inputs_on_the_device() {
        let Some(info) = nccl_or_skip("async_collectives_wait_for_their_inputs_on_the_device")
        else {
            return;
        };
        let n = ranks(&info);
        let got = on_nccl(n, |g, d| {
            let mut works = Vec::new();
            let mut kept = Vec::new();
            for k in 0..3 {
                let mut x = input(g.rank() + k, [256, 256], d) * 1e-3;
                for _ in 0..40 {
                    x = (x.clone().matmul(x.clone().transpose()) * 1e-2).tanh() + x;
                }
                // A copy made on the device (nothing is read to the host before the launch).
                kept.push(x.clone() * 1.0);
                // The input is moved in: the collective must keep its memory from being
                // reused by the kernels queued below before NCCL has read it.
                works.push(g.all_reduce_async(x, ReduceOp::Sum));
                let _junk: Vec<Tensor<2>> = (0..4)
                    .map(|j| Tensor::<2>::ones([256, 256], d) * (j as f32 + 7.0))
                    .collect();
            }
            // Computed while the collectives are in flight.
            let busy = input(g.rank(), [256, 256], d).matmul(input(0, [256, 256], d));
            let mut sums = Vec::new();
            for work in works.into_iter().rev() {
                sums.push(host(work.wait()?));
            }
            sums.reverse();
            let _ = busy.into_data();
            Ok((kept.into_iter().map(host).collect::<Vec<_>>(), sums))
        });
        for k in 0..3 {
            let mut want = got[0].0[k]
                .clone()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            for (inputs, _) in &got[1..] {
                let theirs = inputs[k]
                    .clone()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap();
                want.iter_mut().zip(theirs).for_each(|(w, t)| *w += t);
            }
            let want = TensorData::new(want, [256, 256]);
            for (r, (_, sums)) in got.iter().enumerate() {
                sums[k].assert_approx_eq::<f32>(&want, Tolerance::absolute(1e-3));
                eprintln!("async all_reduce {k} on rank {r}: the sum of the finished inputs");
            }
        }
    }

    /// `Work::wait_on_device`: the caller's stream waits for the collective on the device and
    /// the host goes on at once. The consumer of each result is queued right behind the wait,
    /// with the collective (16M elements) still running: a consumer not ordered after it would
    /// read a half-written buffer. Two hundred rounds, each result folded into a running sum
    /// on the device, checked once at the end against the sums of the inputs.
    #[test]
    fn device_side_waits_order_the_consumer_after_the_collective() {
        let name = "device_side_waits_order_the_consumer_after_the_collective";
        let Some(info) = nccl_or_skip(name) else {
            return;
        };
        let n = ranks(&info);
        const LEN: usize = 1 << 24;
        let got = on_nccl(n, |g, d| {
            let base: Vec<f32> = (0..LEN).map(|i| i as f32 * 1e-7).collect();
            let base = Tensor::<1>::from_data(TensorData::new(base, [LEN]), d);
            let mut acc = Tensor::<1>::zeros([LEN], d);
            let mut want = Tensor::<1>::zeros([LEN], d);
            for round in 0..200 {
                let x = (base.clone() + (round + g.rank()) as f32).sin();
                want = want + x.clone();
                let y = g.all_reduce_async(x, ReduceOp::Sum).wait_on_device()?;
                acc = acc + y;
            }
            Ok((want.into_data(), acc.into_data()))
        });
        let mut want = vec![0f32; LEN];
        for (inputs, _) in &got {
            let inputs = inputs.clone().try_to_vec::<f32>().unwrap();
            want.iter_mut().zip(inputs).for_each(|(w, t)| *w += t);
        }
        let want = TensorData::new(want, [LEN]);
        for (r, (_, acc)) in got.iter().enumerate() {
            acc.assert_approx_eq::<f32>(&want, Tolerance::absolute(5e-2));
            eprintln!("{name}: rank {r}: 200 results, each read after its collective");
        }
    }

    /// `all_gather_async` and `reduce_scatter_async` on the device (their results are made
    /// after the wait: slices of the gathered buffer, the rank's piece of the scattered one),
    /// one waited for on the host and one on the device, against the synchronous collectives.
    #[test]
    fn async_gathers_and_scatters_match_the_synchronous_ones() {
        let name = "async_gathers_and_scatters_match_the_synchronous_ones";
        let Some(info) = nccl_or_skip(name) else {
            return;
        };
        let n = ranks(&info);
        let got = on_nccl(n, |g, d| {
            let mut x = input(g.rank(), [64 * n, 64], d) * 1e-3;
            for _ in 0..20 {
                x = (x.clone() * 1.01).tanh() + x;
            }
            let gathered = g.all_gather_async(x.clone(), 0);
            let scattered = g.reduce_scatter_async(x.clone(), 0, ReduceOp::Sum, None);
            let scattered = host(scattered.wait_on_device()?);
            let gathered = host(gathered.wait()?);
            let want_gathered = host(g.all_gather(x.clone(), 0)?);
            let want_scattered = host(g.reduce_scatter(x, 0, ReduceOp::Sum, None)?);
            Ok(((gathered, scattered), (want_gathered, want_scattered)))
        });
        for (r, ((gathered, scattered), (want_gathered, want_scattered))) in
            got.into_iter().enumerate()
        {
            assert_eq!(gathered, want_gathered, "{name}: rank {r}: all_gather");
            assert_eq!(
                scattered, want_scattered,
                "{name}: rank {r}: reduce_scatter"
            );
            eprintln!("{name}: rank {r}: both as the synchronous collectives");
        }
    }

    #[test]
    fn a_mismatched_call_is_an_error_not_corrupt_data() {
        let Some(info) = nccl_or_skip("a_mismatched_call_is_an_error_not_corrupt_data") else {
            return;
        };
        let n = ranks(&info);
        if n < 2 {
            eprintln!("a_mismatched_call_is_an_error_not_corrupt_data: skipped: needs 2 devices");
            return;
        }
        if !burn_parallel::comm::nccl::signature_checks() {
            tests::visible_notice(
                "SKIPPED a_mismatched_call_is_an_error_not_corrupt_data: signature checks are \
                 off in this build (set BURN_PARALLEL_DEBUG=1)",
            );
            return;
        }
        let out = run_local(n, |g| {
            let rank = g.rank();
            let g = nccl::attach(g, rank)?;
            let len = if rank == 0 { 4 } else { 5 };
            let x = Tensor::<1>::ones([len], &Device::cuda(rank));
            Ok(g.all_reduce(x, ReduceOp::Sum).err())
        })
        .unwrap();
        for e in out {
            assert!(
                matches!(e, Some(CollectiveError::Mismatch { .. })),
                "expected a mismatch, got {e:?}"
            );
        }
    }

    /// GPT under DDP and TP on an NCCL group (two thread ranks, one CUDA device each) matches
    /// single-device training on CUDA. Needs two GPUs.
    #[test]
    fn gpt_ddp_and_tp_on_an_nccl_group_match_single_device() {
        let Some(info) = nccl_or_skip("gpt_ddp_and_tp_on_an_nccl_group_match_single_device") else {
            return;
        };
        if info.cuda_devices < 2 {
            tests::visible_notice(&format!(
                "SKIPPED gpt_ddp_and_tp_on_an_nccl_group_match_single_device: needs 2 CUDA \
                 devices (NCCL refuses two ranks on one), this host has {}",
                info.cuda_devices
            ));
            return;
        }
        let corpus = examples::data::Corpus::load_default().unwrap();
        let mut config: TrainConfig = tests::tiny_gpt_run(20);
        config.model.n_heads = 2;
        config.device = TrainDevice::Cuda;
        let reference =
            tests::Reference::of_run(tests::train_layout(1, &Parallelism::default(), &config));
        for (what, p) in [
            ("ddp 2", Parallelism::default()),
            (
                "tp 2 + sp",
                Parallelism {
                    tp: 2,
                    sp: true,
                    ..Parallelism::default()
                },
            ),
        ] {
            let reports = burn_parallel_train::run_local(2, |g| {
                // One GPU per thread rank, the communicator and the trainer on the same one.
                let rank = g.rank();
                let g = nccl::attach(g, rank)?;
                let config = TrainConfig {
                    device: TrainDevice::CudaDevice(rank),
                    ..config.clone()
                };
                examples::train::train_gpt(&g, &config, &p, &corpus, &mut |_| {})
            })
            .unwrap_or_else(|e| panic!("{what} on nccl: {e}"));
            let r = tests::rank0_if_ranks_agree(reports, |r| (&r.losses, &r.final_params));
            tests::assert_matches_reference(&reference, &r.losses, &r.final_params, 1e-5, what);
            eprintln!("{what} on an NCCL group matches single-device CUDA training");
        }
    }
}
