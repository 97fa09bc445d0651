//! Sequence parallelism must keep less activation memory than tensor parallelism alone: the
//! norms run on the sequence shard, and the column-parallel projections of a sub-layer (`q`,
//! `k`, `v`; `gate` and `up`) must not each keep their own all-gathered copy of the input
//! (they gather it once and keep only the shard).
//!
//! Measured with a counting global allocator (Flex keeps tensors on the heap): the bytes the
//! forward pass of a GPT keeps for its backward, summed over the thread ranks, per layer (the
//! slope between 1 and 3 layers, so the embedding and the head cancel).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicIsize, Ordering};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::init::Init;
use burn_parallel::run_local;
use examples::gpt::{Gpt, GptConfig, MlpKind};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter only observes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time: the counter is process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

const BATCH: usize = 8;
const SEQ: usize = 32;

fn config(layers: usize, mlp: MlpKind) -> GptConfig {
    GptConfig {
        mlp,
        fused: true,
        ..GptConfig::new(64, layers, 4, 64, SEQ)
    }
}

/// Bytes the forward pass (to the loss) keeps, summed over `tp` thread ranks.
fn kept(config: &GptConfig, tp: usize, sp: bool) -> isize {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let kept = Mutex::new(0isize);
    run_local(tp, |group| {
        let device = Device::flex().autodiff();
        let init = Init::new(config.seed, &device)
            .with_tp(&group, Gpt::tp_plan(config, sp))
            .unwrap();
        let gpt = Gpt::build(config, &init, None).unwrap();
        let ids: Vec<i64> = (0..BATCH * SEQ).map(|i| (i * 7 % 64) as i64).collect();
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [BATCH, SEQ]), &device);
        let targets = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|i| (i + 1) % 64).collect(), [BATCH, SEQ]),
            &device,
        );
        // A first step warms the kernels' per-thread buffers, which would count otherwise.
        drop(
            gpt.loss(tokens.clone(), targets.clone())
                .unwrap()
                .backward(),
        );
        // Every rank is between the same two barriers while rank 0 reads the counter.
        group.barrier()?;
        let before = LIVE.load(Ordering::Relaxed);
        group.barrier()?;
        let loss = gpt.loss(tokens, targets).unwrap();
        group.barrier()?;
        if group.rank() == 0 {
            *kept.lock().unwrap() = LIVE.load(Ordering::Relaxed) - before;
        }
        group.barrier()?;
        // The graph stays alive until here, then the backward runs as in training.
        let grads = loss.backward();
        drop(grads);
        Ok(())
    })
    .unwrap();
    kept.into_inner().unwrap()
}

/// Bytes kept per layer: the slope between 1 and 3 layers.
fn per_layer(mlp: MlpKind, tp: usize, sp: bool) -> f64 {
    let one = kept(&config(1, mlp), tp, sp);
    let three = kept(&config(3, mlp), tp, sp);
    (three - one) as f64 / 2.0
}

fn check(mlp: MlpKind) {
    let nd = (BATCH * SEQ * 64 * 4) as f64; // one fp32 [batch, seq, d] tensor
    let tp = per_layer(mlp, 2, false);
    let sp = per_layer(mlp, 2, true);
    // Per rank, sequence parallelism halves the norms' inputs (2 N d -> N d) and keeps the
    // shard of the two sub-layers' inputs rather than the whole (2 N d -> N d): 4 N d less on
    // the two ranks. (Gathering per projection and keeping the gathered copies kept more than
    // tp alone; gathering once but keeping the gathered input saves only the norms' 2 N d.)
    assert!(
        sp <= tp - 3.0 * nd,
        "{mlp:?}: tp2 + sp keeps {sp} bytes per layer on 2 ranks, tp2 {tp}: sequence \
         parallelism must keep at least {} bytes less",
        3.0 * nd
    );
}

#[test]
fn sequence_parallel_keeps_less_than_tensor_parallel_alone() {
    check(MlpKind::Gelu);
}

#[test]
fn sequence_parallel_swiglu_keeps_less_than_tensor_parallel_alone() {
    check(MlpKind::SwiGlu);
}
