//! Fused CubeCL kernels vs the composed Burn ops they replace, on the same WGPU device.
//!
//! ```text
//! cargo run --release -p burn-parallel --features wgpu --example kernel_bench [-- --quick]
//! ```
//!
//! For each kernel: time per call of the forward (plain device) and of forward + backward
//! (autodiff device), fused vs composed, and the theoretical bytes moved per element (fp32).
//! Then the memory the cross-entropy keeps for backward at a vocabulary of 50,257, fused vs
//! unfused (`log_softmax` + `gather`). Figures are printed and written as JSON to
//! `target/kernel_bench.json`. Machines are noisy: compare ratios from one run.

use std::time::Instant;

use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::module::layer_norm;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::kernels::{self, AdamWHyper, reference};

struct Row {
    name: String,
    fused_ms: f64,
    composed_ms: f64,
    fused_bytes: f64,
    composed_bytes: f64,
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed), shape), device)
}

/// Milliseconds per call of `f` (2 warm-up calls, then `iters` timed, synchronised).
fn time(device: &Device, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    device.sync().expect("device sync");
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    device.sync().expect("device sync");
    start.elapsed().as_secs_f64() * 1e3 / iters as f64
}

/// The unfused cross-entropy: `-mean(gather(log_softmax(logits), targets))`.
fn unfused_ce(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n, _] = logits.dims();
    log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1]))
        .mean()
        .neg()
}

/// One fwd+bwd cross-entropy step on a fresh device; prints `CE_MEMORY <kept> <peak>`.
fn ce_memory_probe(device: &Device, fused: bool, n: usize) {
    let vocab = 50_257;
    let ad = device.clone().autodiff();
    let ids: Vec<i64> = (0..n as i64).map(|i| (i * 7919) % vocab as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &ad);
    let logits = tensor([n, vocab], 11, &ad).require_grad();
    device.sync().expect("sync");
    let before = device
        .memory_pool_usage()
        .map(|u| u.bytes_in_use)
        .unwrap_or(0);
    let loss = if fused {
        kernels::cross_entropy(logits.clone(), targets, None).expect("fused cross-entropy")
    } else {
        unfused_ce(logits.clone(), targets)
    };
    device.sync().expect("sync");
    let after = device
        .memory_pool_usage()
        .map(|u| u.bytes_in_use)
        .unwrap_or(0);
    let grads = loss.backward();
    let _grad = logits.grad(&grads).expect("a gradient");
    device.sync().expect("sync");
    let peak = device
        .memory_pool_usage()
        .map(|u| u.bytes_reserved)
        .unwrap_or(0);
    println!("CE_MEMORY {} {peak}", after.saturating_sub(before));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let device = match kernels::wgpu_device() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Some(i) = args.iter().position(|a| a == "--ce-memory") {
        let rows = args
            .iter()
            .position(|a| a == "--rows")
            .and_then(|j| args.get(j + 1))
            .and_then(|r| r.parse().ok())
            .unwrap_or(128);
        ce_memory_probe(
            &device,
            args.get(i + 1).map(String::as_str) == Some("fused"),
            rows,
        );
        return;
    }
    let ad = device.clone().autodiff();
    let iters = if quick { 3 } else { 10 };
    let (rows, width) = if quick { (512, 768) } else { (2048, 768) };
    let mut table: Vec<Row> = Vec::new();
    let mut push = |name: &str, f: f64, c: f64, fb: f64, cb: f64| {
        println!(
            "{name:<26} fused {f:>9.3} ms   composed {c:>9.3} ms   speed-up {:>5.2}x   bytes/elem {fb:>4.0} vs {cb:>4.0}",
            c / f
        );
        table.push(Row {
            name: name.into(),
            fused_ms: f,
            composed_ms: c,
            fused_bytes: fb,
            composed_bytes: cb,
        });
    };
    println!(
        "device: WGPU ({:?}), fp32, {iters} iterations per figure",
        device
    );

    // RMSNorm / LayerNorm [rows, width].
    let x = tensor([rows, width], 1, &device);
    let w = tensor([width], 2, &device).add_scalar(1.0);
    let b = tensor([width], 3, &device);
    let f = time(&device, iters, || {
        let _ = kernels::rms_norm(x.clone(), w.clone(), 1e-5).unwrap();
    });
    let c = time(&device, iters, || {
        let rms = (x.clone().square().mean_dim(1) + 1e-5).sqrt();
        let _ = x.clone() / rms * w.clone().unsqueeze();
    });
    push("rms_norm fwd", f, c, 8.0, 28.0);
    let f = time(&device, iters, || {
        let _ = kernels::layer_norm(x.clone(), w.clone(), Some(b.clone()), 1e-5).unwrap();
    });
    let c = time(&device, iters, || {
        let _ = layer_norm(x.clone(), w.clone(), Some(b.clone()), 1e-5);
    });
    push("layer_norm fwd", f, c, 8.0, 44.0);
    let xa = x.clone().detach();
    let dy = tensor([rows, width], 4, &ad);
    let f = time(&device, iters, || {
        let (x, w) = (
            Tensor::<2>::from_data(xa.to_data(), &ad).require_grad(),
            Tensor::<1>::from_data(w.to_data(), &ad).require_grad(),
        );
        let _ = (kernels::rms_norm(x, w, 1e-5).unwrap() * dy.clone())
            .sum()
            .backward();
    });
    let c = time(&device, iters, || {
        let (x, w) = (
            Tensor::<2>::from_data(xa.to_data(), &ad).require_grad(),
            Tensor::<1>::from_data(w.to_data(), &ad).require_grad(),
        );
        let rms = (x.clone().square().mean_dim(1) + 1e-5).sqrt();
        let _ = ((x / rms * w.unsqueeze()) * dy.clone()).sum().backward();
    });
    push("rms_norm fwd+bwd", f, c, 8.0 + 24.0, 28.0 + 80.0);

    // SwiGLU [rows, 4 width].
    let a = tensor([rows, 4 * width], 5, &device);
    let g = tensor([rows, 4 * width], 6, &device);
    let f = time(&device, iters, || {
        let _ = kernels::swiglu(a.clone(), g.clone()).unwrap();
    });
    let c = time(&device, iters, || {
        let _ = silu(a.clone()) * g.clone();
    });
    push("swiglu fwd", f, c, 12.0, 32.0);
    let dy = tensor([rows, 4 * width], 7, &ad);
    let f = time(&device, iters, || {
        let a = Tensor::<2>::from_data(a.to_data(), &ad).require_grad();
        let g = Tensor::<2>::from_data(g.to_data(), &ad).require_grad();
        let _ = (kernels::swiglu(a, g).unwrap() * dy.clone())
            .sum()
            .backward();
    });
    let c = time(&device, iters, || {
        let a = Tensor::<2>::from_data(a.to_data(), &ad).require_grad();
        let g = Tensor::<2>::from_data(g.to_data(), &ad).require_grad();
        let _ = ((silu(a) * g) * dy.clone()).sum().backward();
    });
    push("swiglu fwd+bwd", f, c, 12.0 + 20.0, 32.0 + 64.0);

    // RoPE [batch 4, heads 12, seq rows/4, 64].
    let seq = rows / 4;
    let q = tensor([4, 12, seq, 64], 8, &device);
    let cos = tensor([1, 1, seq, 32], 9, &device);
    let sin = tensor([1, 1, seq, 32], 10, &device);
    let f = time(&device, iters, || {
        let _ = kernels::rope(q.clone(), cos.clone(), sin.clone()).unwrap();
    });
    let c = time(&device, iters, || {
        let x1 = q.clone().narrow(3, 0, 32);
        let x2 = q.clone().narrow(3, 32, 32);
        let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let r2 = x2 * cos.clone() + x1 * sin.clone();
        let _ = Tensor::cat(vec![r1, r2], 3);
    });
    push("rope fwd", f, c, 8.0, 36.0);

    // Cross-entropy [n, 50,257].
    let n = if quick { 32 } else { 128 };
    let vocab = 50_257;
    let logits = tensor([n, vocab], 11, &device);
    let ids: Vec<i64> = (0..n as i64).map(|i| (i * 7919) % vocab as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &device);
    let f = time(&device, iters, || {
        let _ = kernels::cross_entropy(logits.clone(), targets.clone(), None).unwrap();
    });
    let c = time(&device, iters, || {
        let _ = unfused_ce(logits.clone(), targets.clone());
    });
    push("cross_entropy fwd", f, c, 4.0, 36.0);
    let targets_ad = Tensor::<1, Int>::from_data(targets.to_data(), &ad);
    let f = time(&device, iters, || {
        let l = Tensor::<2>::from_data(logits.to_data(), &ad).require_grad();
        let _ = kernels::cross_entropy(l, targets_ad.clone(), None)
            .unwrap()
            .backward();
    });
    let c = time(&device, iters, || {
        let l = Tensor::<2>::from_data(logits.to_data(), &ad).require_grad();
        let _ = unfused_ce(l, targets_ad.clone()).backward();
    });
    push("cross_entropy fwd+bwd", f, c, 4.0 + 8.0, 36.0 + 36.0);

    // AdamW on a flat shard.
    let numel = if quick { 1 << 20 } else { 1 << 22 };
    let h = AdamWHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
    };
    let (p, gr) = (tensor([numel], 12, &device), tensor([numel], 13, &device));
    let (m, v) = (
        tensor([numel], 14, &device) * 0.1,
        tensor([numel], 15, &device).abs() * 0.1,
    );
    let f = time(&device, iters, || {
        let _ = kernels::adamw_step(p.clone(), gr.clone(), m.clone(), v.clone(), h).unwrap();
    });
    let c = time(&device, iters, || {
        let _ = reference::adamw_step(p.clone(), gr.clone(), m.clone(), v.clone(), &h);
    });
    push("adamw step", f, c, 28.0, 120.0);

    // Peak memory of one cross-entropy step at vocabulary 50,257, each variant in a fresh
    // process (a fresh allocator): the pool's reserved bytes after forward + backward (pools
    // keep their pages, so this is the high-water mark) and the bytes in use after forward.
    let exe = std::env::current_exe().expect("the benchmark executable");
    let measure = |mode: &str| -> (u64, u64) {
        let out = std::process::Command::new(&exe)
            .args(["--ce-memory", mode, "--rows", &n.to_string()])
            .output()
            .expect("running the memory probe");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("CE_MEMORY "))
            .unwrap_or_else(|| panic!("memory probe failed: {text}"));
        let mut it = line.split(' ').map(|v| v.parse::<u64>().expect("a number"));
        (it.next().expect("kept"), it.next().expect("peak"))
    };
    let (fused_kept, fused_peak) = measure("fused");
    let (unfused_kept, unfused_peak) = measure("unfused");
    let logits_mb = (n * vocab * 4) as f64 / 1e6;
    println!(
        "cross_entropy memory [{n} x {vocab}] (logits {logits_mb:.1} MB, inputs included): \
         peak (pool reserved after fwd+bwd) fused {:.1} MB vs unfused {:.1} MB; \
         in use after forward {:.1} MB vs {:.1} MB",
        fused_peak as f64 / 1e6,
        unfused_peak as f64 / 1e6,
        fused_kept as f64 / 1e6,
        unfused_kept as f64 / 1e6,
    );

    let json = serde_json::json!({
        "device": format!("{device:?}"),
        "iterations": iters,
        "kernels": table.iter().map(|r| serde_json::json!({
            "name": r.name,
            "fused_ms": r.fused_ms,
            "composed_ms": r.composed_ms,
            "speedup": r.composed_ms / r.fused_ms,
            "fused_bytes_per_elem": r.fused_bytes,
            "composed_bytes_per_elem": r.composed_bytes,
        })).collect::<Vec<_>>(),
        "cross_entropy_memory": {
            "rows": n, "vocab": vocab,
            "fused_in_use_after_forward_bytes": fused_kept,
            "unfused_in_use_after_forward_bytes": unfused_kept,
            "fused_peak_reserved_bytes": fused_peak,
            "unfused_peak_reserved_bytes": unfused_peak,
        },
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("kernel_bench.json");
    match std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")) {
        Ok(()) => println!("wrote {}", path.display()),
        Err(e) => eprintln!("could not write {}: {e}", path.display()),
    }
}
