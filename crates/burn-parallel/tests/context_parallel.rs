//! Context parallelism against full single-device attention: the output and dQ, dK, dV of
//! ring and Ulysses attention at cp = 2, 3, 4, causal and not, with and without head-tail
//! balancing, equal those of plain attention written with composed Burn ops and differentiated
//! by Burn's autodiff. Also: the number of messages each algorithm sends, counted by a
//! transport wrapper (ring: cp - 1 K/V rotations forward; cp - 1 K/V and cp - 1 dK/dV rotations
//! backward), and the typed errors.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_parallel::comm::transport::{Frame, Mailbox, StreamId, Transport};
use burn_parallel::context_parallel::ring::{TAG_DKV_BACKWARD, TAG_KV_BACKWARD, TAG_KV_FORWARD};
use burn_parallel::context_parallel::{
    ContextParallel, CpBalance, CpError, CpKind, CpSettings, SeqLayout,
};
use burn_parallel::{CollectiveError, ProcessGroup, local_world, run_local};

const B: usize = 2;
const H: usize = 12;
const D: usize = 8;
const TOL: f32 = 2e-5;

fn dev() -> Device {
    Device::flex().autodiff()
}

/// A deterministic `[B, h, s, D]` tensor.
fn t4(salt: usize, h: usize, s: usize) -> Tensor<4> {
    let n = B * h * s * D;
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + salt * 104_729) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(v, [B, h, s, D]), &dev())
}

/// Plain attention over the whole sequence (composed ops, `-inf` causal mask).
fn reference_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    let [b, h, s, d] = q.dims();
    let mut scores = q.matmul(k.swap_dims(2, 3)) / (d as f32).sqrt();
    if causal {
        let mask: Vec<bool> = (0..s).flat_map(|i| (0..s).map(move |j| j > i)).collect();
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(mask, [s, s]), &scores.device())
            .reshape([1, 1, s, s])
            .expand([b, h, s, s]);
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    softmax(scores, 3).matmul(v)
}

/// Output and gradients of q, k, v of `sum(attention * c)` on one device.
struct Expected {
    out: Tensor<4>,
    dq: Tensor<4>,
    dk: Tensor<4>,
    dv: Tensor<4>,
    c: Tensor<4>,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
}

fn expected(h: usize, s: usize, causal: bool) -> Expected {
    let (q, k, v, c) = (t4(1, h, s), t4(2, h, s), t4(3, h, s), t4(4, h, s));
    let (ql, kl, vl) = (
        q.clone().require_grad(),
        k.clone().require_grad(),
        v.clone().require_grad(),
    );
    let out = reference_attention(ql.clone(), kl.clone(), vl.clone(), causal);
    let grads = (out.clone() * c.clone()).sum().backward();
    Expected {
        out: out.detach(),
        dq: ql.grad(&grads).unwrap(),
        dk: kl.grad(&grads).unwrap(),
        dv: vl.grad(&grads).unwrap(),
        c,
        q,
        k,
        v,
    }
}

fn close(got: Tensor<4>, want: Tensor<4>, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let got = got.into_data().try_to_vec::<f32>().unwrap();
    let want = want.into_data().try_to_vec::<f32>().unwrap();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0.0f32, f32::max);
    assert!(worst <= TOL, "{what}: worst error {worst:.2e} > {TOL:.0e}");
}

/// Runs `kind` attention on `cp` ranks, each holding its tokens of the expected case, and
/// checks output and gradients on every rank.
fn check(cp: usize, kind: CpKind, balance: CpBalance, causal: bool) {
    let s = 24;
    let e = expected(H, s, causal);
    let what = format!("{kind} cp {cp} {balance} causal {causal}");
    run_local(cp, |group| {
        let ctx = ContextParallel::new(&group, CpSettings { kind, balance }).unwrap();
        let layout = ctx.layout(s).unwrap();
        let local = |x: &Tensor<4>| layout.local(x.clone(), 2).unwrap();
        let (q, k, v) = (
            local(&e.q).require_grad(),
            local(&e.k).require_grad(),
            local(&e.v).require_grad(),
        );
        let out = ctx
            .attention(q.clone(), k.clone(), v.clone(), causal)
            .unwrap();
        close(out.clone(), local(&e.out), &format!("{what}: output"));
        let grads = (out * local(&e.c)).sum().backward();
        close(
            q.grad(&grads).unwrap(),
            local(&e.dq),
            &format!("{what}: dq"),
        );
        close(
            k.grad(&grads).unwrap(),
            local(&e.dk),
            &format!("{what}: dk"),
        );
        close(
            v.grad(&grads).unwrap(),
            local(&e.dv),
            &format!("{what}: dv"),
        );
        Ok(())
    })
    .unwrap();
}

fn each_case(kind: CpKind) {
    for cp in [2, 3, 4] {
        for balance in [CpBalance::None, CpBalance::HeadTail] {
            for causal in [true, false] {
                check(cp, kind, balance, causal);
            }
        }
    }
}

#[test]
fn ring_attention_matches_full_attention() {
    each_case(CpKind::Ring);
}

#[test]
fn ulysses_attention_matches_full_attention() {
    each_case(CpKind::Ulysses);
}

/// On one rank the ring is blockwise attention with the log-sum-exp merge over segments.
#[test]
fn ring_attention_on_one_rank_is_full_attention() {
    for balance in [CpBalance::None, CpBalance::HeadTail] {
        check(1, CpKind::Ring, balance, true);
    }
}

/// `shard` and `unshard` around the attention of replicated inputs: every rank gets the
/// single-device output and the gradients of the whole q, k, v.
#[test]
fn shard_and_unshard_are_differentiable() {
    let s = 24;
    let e = expected(H, s, true);
    for kind in [CpKind::Ring, CpKind::Ulysses] {
        run_local(3, |group| {
            let settings = CpSettings {
                kind,
                balance: CpBalance::HeadTail,
            };
            let ctx = ContextParallel::new(&group, settings).unwrap();
            // Leaves of this rank's own graph (thread ranks must not share autodiff nodes).
            let leaf = |x: &Tensor<4>| Tensor::<4>::from_data(x.to_data(), &dev()).require_grad();
            let (q, k, v) = (leaf(&e.q), leaf(&e.k), leaf(&e.v));
            let shard = |x: &Tensor<4>| ctx.shard(x.clone(), 2).unwrap();
            let local = ctx
                .attention(shard(&q), shard(&k), shard(&v), true)
                .unwrap();
            let out = ctx.unshard(local, 2).unwrap();
            close(out.clone(), e.out.clone(), "unshard output");
            let grads = (out * e.c.clone()).sum().backward();
            close(q.grad(&grads).unwrap(), e.dq.clone(), "shard dq");
            close(k.grad(&grads).unwrap(), e.dk.clone(), "shard dk");
            close(v.grad(&grads).unwrap(), e.dv.clone(), "shard dv");
            Ok(())
        })
        .unwrap();
    }
}

// ---- counting messages ----

/// A transport that records the stream tag and signature of every frame it sends.
struct Counting {
    inner: Arc<dyn Transport>,
    sent: Arc<Mutex<Vec<(u64, String)>>>,
}

impl Transport for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
    fn send(&self, dst: usize, frame: Frame) -> burn_parallel::Result<()> {
        self.sent
            .lock()
            .unwrap()
            .push((frame.header.stream.tag, frame.header.signature.clone()));
        self.inner.send(dst, frame)
    }
    fn mailbox(&self) -> &Mailbox {
        self.inner.mailbox()
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// What one rank sent, by phase.
#[derive(Debug, Default, Clone, PartialEq)]
struct Sent {
    kv_forward: usize,
    kv_backward: usize,
    dkv_backward: usize,
    /// Distinct all-to-all calls (each sends cp - 1 frames).
    all_to_all: usize,
    other: usize,
}

fn tally(frames: &[(u64, String)]) -> Sent {
    let mut sent = Sent::default();
    let mut calls = std::collections::HashSet::new();
    for (tag, signature) in frames {
        match *tag {
            TAG_KV_FORWARD => sent.kv_forward += 1,
            TAG_KV_BACKWARD => sent.kv_backward += 1,
            TAG_DKV_BACKWARD => sent.dkv_backward += 1,
            StreamId::COLLECTIVE if signature.starts_with("all_to_all") => {
                calls.insert(signature.clone());
            }
            _ => sent.other += 1,
        }
    }
    sent.all_to_all = calls.len();
    sent
}

/// Runs one attention forward and backward on `cp` ranks over counting transports; returns
/// what each rank sent during the forward and during the backward.
fn count(cp: usize, kind: CpKind, causal: bool) -> Vec<(Sent, Sent)> {
    let s = 4 * cp;
    let e = expected(4, s, causal);
    let worlds = local_world(cp);
    std::thread::scope(|scope| {
        let handles: Vec<_> = worlds
            .into_iter()
            .map(|g| {
                let e = &e;
                scope.spawn(move || {
                    let sent = Arc::new(Mutex::new(Vec::new()));
                    let group = ProcessGroup::world(Arc::new(Counting {
                        inner: g.transport().clone(),
                        sent: sent.clone(),
                    }));
                    let settings = CpSettings {
                        kind,
                        balance: CpBalance::HeadTail,
                    };
                    let ctx = ContextParallel::new(&group, settings).unwrap();
                    let layout = ctx.layout(s).unwrap();
                    let local = |x: &Tensor<4>| layout.local(x.clone(), 2).unwrap();
                    let q = local(&e.q).require_grad();
                    sent.lock().unwrap().clear();
                    let out = ctx.attention(q.clone(), local(&e.k), local(&e.v), causal);
                    let loss = (out.unwrap() * local(&e.c)).sum();
                    let forward = tally(&std::mem::take(&mut *sent.lock().unwrap()));
                    let grads = loss.backward();
                    assert!(q.grad(&grads).is_some());
                    let backward = tally(&sent.lock().unwrap());
                    (forward, backward)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ring_rotates_cp_minus_one_times_each_way() {
    for cp in [1, 2, 3, 4] {
        for causal in [true, false] {
            for (rank, (forward, backward)) in
                count(cp, CpKind::Ring, causal).into_iter().enumerate()
            {
                let what = format!("ring cp {cp} causal {causal} rank {rank}");
                let rotations = cp - 1;
                assert_eq!(
                    forward,
                    Sent {
                        kv_forward: rotations,
                        ..Sent::default()
                    },
                    "{what}: forward"
                );
                assert_eq!(
                    backward,
                    Sent {
                        kv_backward: rotations,
                        dkv_backward: rotations,
                        ..Sent::default()
                    },
                    "{what}: backward"
                );
            }
        }
    }
}

#[test]
fn ulysses_makes_two_all_to_alls_each_way() {
    for cp in [2, 4] {
        for (rank, (forward, backward)) in count(cp, CpKind::Ulysses, true).into_iter().enumerate()
        {
            let what = format!("ulysses cp {cp} rank {rank}");
            let two = Sent {
                all_to_all: 2,
                ..Sent::default()
            };
            assert_eq!(forward, two, "{what}: forward");
            assert_eq!(backward, two, "{what}: backward");
        }
    }
}

// ---- errors ----

#[test]
fn sequence_not_divisible_is_a_typed_error() {
    assert_eq!(
        SeqLayout::new(12, 4, 0, CpBalance::HeadTail),
        Err(CpError::SeqNotDivisible {
            seq: 12,
            cp: 4,
            balance: CpBalance::HeadTail,
            multiple: 8
        })
    );
    assert!(matches!(
        SeqLayout::new(10, 4, 0, CpBalance::None),
        Err(CpError::SeqNotDivisible { multiple: 4, .. })
    ));
    let message = SeqLayout::new(12, 4, 0, CpBalance::HeadTail)
        .unwrap_err()
        .to_string();
    assert!(message.contains("multiple of 8"), "{message}");
}

#[test]
fn heads_not_divisible_and_gqa_are_typed_errors() {
    run_local(2, |group| {
        let ulysses = ContextParallel::new(
            &group,
            CpSettings {
                kind: CpKind::Ulysses,
                balance: CpBalance::None,
            },
        )
        .unwrap();
        let x = t4(0, 3, 4);
        assert_eq!(
            ulysses
                .attention(x.clone(), x.clone(), x.clone(), true)
                .unwrap_err(),
            CpError::HeadsNotDivisible { heads: 3, cp: 2 }
        );
        let ring = ContextParallel::new(&group, CpSettings::default()).unwrap();
        let (q, kv) = (t4(0, 4, 4), t4(1, 2, 4));
        for ctx in [&ring, &ulysses] {
            assert_eq!(
                ctx.attention(q.clone(), kv.clone(), kv.clone(), true)
                    .unwrap_err(),
                CpError::GroupedQuery {
                    q_heads: 4,
                    kv_heads: 2
                }
            );
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn different_settings_across_ranks_are_a_typed_error() {
    let errors = run_local(2, |group| {
        let balance = if group.rank() == 0 {
            CpBalance::HeadTail
        } else {
            CpBalance::None
        };
        let settings = CpSettings {
            kind: CpKind::Ring,
            balance,
        };
        Ok(ContextParallel::new(&group, settings).unwrap_err())
    })
    .unwrap();
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            matches!(e, CpError::SettingsDiffer { rank: r, peer, .. } if *r == rank && *peer == 1 - rank),
            "{e}"
        );
        assert!(e.to_string().contains("--cp-balance"), "{e}");
    }
}

/// A peer that dies before the ring completes: the others get a collective error naming it,
/// promptly, instead of hanging.
#[test]
fn a_peer_dying_mid_ring_is_an_error_not_a_hang() {
    let seen = Mutex::new(Vec::new());
    let start = std::time::Instant::now();
    let result = run_local(3, |group| {
        let group = group.with_timeout(Duration::from_secs(30));
        let ctx = ContextParallel::new(&group, CpSettings::default()).unwrap();
        if group.rank() == 2 {
            panic!("rank 2 is killed");
        }
        let layout = ctx.layout(12).unwrap();
        let x = layout.local(t4(0, 2, 12), 2).unwrap();
        let err = ctx.attention(x.clone(), x.clone(), x, true).unwrap_err();
        seen.lock().unwrap().push(err);
        Ok(())
    });
    assert!(result.is_err());
    assert!(start.elapsed() < Duration::from_secs(20), "no hang");
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 2);
    for e in seen {
        match e {
            CpError::Collective(CollectiveError::PeerFailed {
                peer: 2, reason, ..
            }) => {
                assert!(reason.contains("killed"), "{reason}")
            }
            other => panic!("expected PeerFailed naming rank 2, got {other}"),
        }
    }
}

/// A peer that never calls: a timeout naming it.
#[test]
fn a_silent_peer_times_out() {
    let groups = local_world(2);
    let mut groups = groups.into_iter();
    let g0 = groups
        .next()
        .unwrap()
        .with_timeout(Duration::from_millis(300));
    let _g1 = groups.next().unwrap();
    // The settings check itself is a collective: rank 1 is not there.
    let err = ContextParallel::new(&g0, CpSettings::default()).unwrap_err();
    assert!(
        matches!(
            err,
            CpError::Collective(CollectiveError::Timeout { peer: 1, .. })
        ),
        "{err}"
    );
}

// ---- memory ----

/// Counts the bytes allocated and their peak (the whole test process).
struct CountingAlloc {
    current: AtomicUsize,
    peak: AtomicUsize,
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counters only observe.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's (a valid, non-zero-sized layout).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = self.current.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout (the caller's contract).
        unsafe { System.dealloc(ptr, layout) };
        self.current.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc {
    current: AtomicUsize::new(0),
    peak: AtomicUsize::new(0),
};

/// Ring attention keeps nothing of its blocks: the peak of a forward and backward per rank
/// stays below one `seq x seq` score matrix per head divided by cp (what Ulysses or a plain
/// attention split cp ways would hold), here about a third of it. (Computing the blocks on
/// detached tensors of the autodiff backend kept them alive: 99 MiB per rank here.)
#[test]
fn ring_attention_memory_per_rank_is_below_a_score_matrix_over_cp() {
    let (cp, s, h) = (4, 2048, 4);
    let bound = (s * s * h * 4 / cp) as f64;
    let start = Mutex::new(0usize);
    run_local(cp, |group| {
        let ctx = ContextParallel::new(&group, CpSettings::default()).unwrap();
        let layout = ctx.layout(s).unwrap();
        let local = |salt| {
            Tensor::<4>::from_data(t4(salt, h, 1).into_data(), &dev())
                .repeat_dim(2, layout.local_len())
        };
        let (q, k, v, c) = (
            local(1).require_grad(),
            local(2).require_grad(),
            local(3).require_grad(),
            local(4),
        );
        group.barrier()?;
        if group.rank() == 0 {
            let now = ALLOC.current.load(Ordering::Relaxed);
            ALLOC.peak.store(now, Ordering::Relaxed);
            *start.lock().unwrap() = now;
        }
        group.barrier()?;
        let out = ctx.attention(q.clone(), k, v, true).unwrap();
        let grads = (out * c).sum().backward();
        assert!(q.grad(&grads).is_some());
        drop(grads);
        group.barrier()
    })
    .unwrap();
    let peak = ALLOC.peak.load(Ordering::Relaxed) - *start.lock().unwrap();
    let per_rank = peak as f64 / cp as f64;
    println!(
        "ring cp {cp} seq {s}: peak {:.1} MiB per rank, bound {:.1} MiB",
        per_rank / 1048576.0,
        bound / 1048576.0
    );
    assert!(
        per_rank < bound,
        "ring attention allocated {:.1} MiB per rank at its peak, more than one score matrix \
         over cp ({:.1} MiB)",
        per_rank / 1048576.0,
        bound / 1048576.0
    );
}
