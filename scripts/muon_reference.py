#!/usr/bin/env python3
"""An independent PyTorch reference for burn-parallel's Muon (`crates/burn-parallel/src/muon.rs`).

Written from the published algorithm (Keller Jordan's Muon post, the quintic Newton-Schulz
iteration of modded-nanogpt, and the learning-rate adjustments that PyTorch's
`torch.optim.Muon` documents), not from any implementation's code:

    buf <- lerp(buf, g, 1 - beta)                    (buf starts at zero)
    d   <- lerp(g, buf, beta)   if nesterov  else  buf
    o   <- NS5(d)                                    X = d / (||d||_F + 1e-7), wide, then
                                                     A = X X^T; X <- a X + (b A + c A A) X
    p   <- p * (1 - lr * wd)                         decoupled weight decay
    p   <- p - lr * ratio * o                        ratio of the PyTorch shape (A, B) = (out, in):
                                                     "original"        sqrt(max(1, A / B))
                                                     "match_rms_adamw" 0.2 * sqrt(max(A, B))

Everything here runs on PyTorch's orientation of a linear weight, `(out, in)`; the fixture
stores Burn's, `[fan_in, fan_out]` (the transpose), for the Rust test
`crates/burn-parallel/tests/muon_reference.rs`.

The reference runs in float32 (the expected values) and again in float64 (a second opinion:
the script prints how far the two are apart). Where the installed torch has
`torch.optim.Muon` (2.9 and later), the script also steps it on the same data and prints the
largest difference: once as it is, with its Newton-Schulz iteration in bfloat16 (a figure
about bf16's rounding, ~1e-3, not an error of either side), and once with that iteration
turned to fp32 (which should agree to ~1e-7). Nothing here depends on it.

Regenerate the fixture (needs torch, CPU is enough):

    python3 scripts/muon_reference.py

which writes `crates/burn-parallel/tests/data/muon_reference.json`.
"""

import json
import math
import os
import sys

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
STEPS = 3
SEED = 20240611

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "crates",
    "burn-parallel",
    "tests",
    "data",
    "muon_reference.json",
)

# name, Burn shape [fan_in, fan_out], momentum, nesterov, ns_steps, weight decay, scale, lr
CASES = [
    ("square16_nesterov_match_adamw", (16, 16), 0.95, True, 5, 0.0, "match-adamw", 0.05),
    ("square16_nesterov_original", (16, 16), 0.95, True, 5, 0.0, "original", 0.05),
    ("wide8x24_original", (8, 24), 0.95, True, 5, 0.0, "original", 0.05),
    ("tall24x8_original", (24, 8), 0.95, True, 5, 0.0, "original", 0.05),
    ("square16_plain_momentum_original", (16, 16), 0.95, False, 5, 0.0, "original", 0.05),
    ("wide8x24_decay0.1_match_adamw", (8, 24), 0.95, True, 5, 0.1, "match-adamw", 0.1),
    ("tall24x8_decay0.1_plain_momentum_match_adamw", (24, 8), 0.9, False, 5, 0.1, "match-adamw", 0.1),
    ("odd12x20_beta0.8_ns3_decay0.05_original", (12, 20), 0.8, True, 3, 0.05, "original", 0.08),
]


def newton_schulz5(d, steps):
    """The quintic Newton-Schulz iteration: about the orthogonal factor U V^T of d = U S V^T."""
    a, b, c = NS_COEFFICIENTS
    x = d
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x, ord="fro") + NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if transposed else x


def lr_ratio(scale, pt_shape):
    """The learning rate's factor for a PyTorch weight of shape (A, B) = (out, in)."""
    a, b = pt_shape
    if scale == "original":
        return math.sqrt(max(1.0, a / b))
    if scale == "match-adamw":
        return 0.2 * math.sqrt(max(a, b))
    raise ValueError(scale)


def reference(w0, grads, momentum, nesterov, ns_steps, weight_decay, scale, lr, dtype):
    """Steps the PyTorch-oriented weight `w0` through `grads`; returns the weight after each."""
    p = w0.to(dtype).clone()
    buf = torch.zeros_like(p)
    ratio = lr_ratio(scale, tuple(p.shape))
    out = []
    for g in grads:
        g = g.to(dtype)
        buf.lerp_(g, 1 - momentum)
        d = g.lerp(buf, momentum) if nesterov else buf
        o = newton_schulz5(d, ns_steps)
        p.mul_(1 - lr * weight_decay)
        p.add_(o, alpha=-lr * ratio)
        out.append(p.clone())
    return out


def torch_muon(w0, grads, momentum, nesterov, ns_steps, weight_decay, scale, lr, ns_fp32=False):
    """The same steps through `torch.optim.Muon`, or None where torch has none.

    `ns_fp32` runs its Newton-Schulz iteration in fp32 instead of bf16, by pointing
    `torch.bfloat16` (the dtype it casts to) at `torch.float32` for the duration of the steps:
    a hack, for a cross-check only, that isolates the difference bf16 makes."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        return None
    if ns_fp32:
        saved = torch.bfloat16
        torch.bfloat16 = torch.float32
        try:
            return torch_muon(w0, grads, momentum, nesterov, ns_steps, weight_decay, scale, lr)
        except Exception:  # noqa: BLE001 - a cross-check that does not apply to this torch
            return None
        finally:
            torch.bfloat16 = saved
    p = torch.nn.Parameter(w0.to(torch.float32).clone())
    opt = muon(
        [p],
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=NS_COEFFICIENTS,
        eps=NS_EPS,
        ns_steps=ns_steps,
        adjust_lr_fn={"original": "original", "match-adamw": "match_rms_adamw"}[scale],
    )
    out = []
    for g in grads:
        p.grad = g.to(torch.float32).clone()
        opt.step()
        out.append(p.detach().clone())
    return out


def short(values, decimals):
    """Row-major values rounded to `decimals` places (a short, exact-enough JSON)."""
    return [round(float(v), decimals) or 0.0 for v in values.reshape(-1).tolist()]


def main():
    gen = torch.Generator().manual_seed(SEED)
    cases = []
    worst64 = 0.0
    worst_torch = None
    worst_torch32 = None
    for name, burn_shape, momentum, nesterov, ns_steps, weight_decay, scale, lr in CASES:
        fan_in, fan_out = burn_shape
        pt_shape = (fan_out, fan_in)
        # Inputs with 4 decimals, so that the JSON is short and both sides read the same f32.
        w0_burn = torch.round(torch.randn(burn_shape, generator=gen, dtype=torch.float64) * 0.5e4) / 1e4
        grads_burn = []
        for step in range(STEPS):
            # The steps' gradients differ in size, so that the momentum's mixing matters.
            g = torch.randn(burn_shape, generator=gen, dtype=torch.float64) * (1.0 + step)
            grads_burn.append(torch.round(g * 1e4) / 1e4)
        w0_burn = [short(w0_burn, 4)]
        grads_burn = [short(g, 4) for g in grads_burn]
        # What the fixture holds, read back as f32 exactly as the Rust test reads it.
        w0 = torch.tensor(w0_burn[0], dtype=torch.float32).reshape(burn_shape).T.contiguous()
        grads = [torch.tensor(g, dtype=torch.float32).reshape(burn_shape).T.contiguous() for g in grads_burn]
        args = (momentum, nesterov, ns_steps, weight_decay, scale, lr)
        ws32 = reference(w0, grads, *args, dtype=torch.float32)
        ws64 = reference(w0, grads, *args, dtype=torch.float64)
        diff64 = max((a.double() - b).abs().max().item() for a, b in zip(ws32, ws64))
        worst64 = max(worst64, diff64)
        line = f"{name:48s} f32 vs f64 {diff64:.2e}"
        theirs = torch_muon(w0, grads, *args)
        if theirs is not None:
            d = max((a - b).abs().max().item() for a, b in zip(ws32, theirs))
            worst_torch = d if worst_torch is None else max(worst_torch, d)
            line += f"   vs torch.optim.Muon: bf16 NS {d:.2e}"
        theirs32 = torch_muon(w0, grads, *args, ns_fp32=True)
        if theirs32 is not None:
            d = max((a - b).abs().max().item() for a, b in zip(ws32, theirs32))
            worst_torch32 = d if worst_torch32 is None else max(worst_torch32, d)
            line += f", fp32 NS {d:.2e}"
        print(line)
        cases.append(
            {
                "name": name,
                "pytorch_shape": list(pt_shape),
                "burn_shape": list(burn_shape),
                "momentum": momentum,
                "nesterov": nesterov,
                "ns_steps": ns_steps,
                "weight_decay": weight_decay,
                "scale": scale,
                "lr": lr,
                "initial": w0_burn[0],
                "grads": grads_burn,
                # Burn's orientation: the transpose of PyTorch's.
                "expected": [short(w.T.contiguous(), 8) for w in ws32],
                "f64_max_diff": float(f"{diff64:.3e}"),
            }
        )
    fixture = {
        "generator": "scripts/muon_reference.py",
        "torch": torch.__version__,
        "dtype": "float32",
        "seed": SEED,
        "ns_coefficients": list(NS_COEFFICIENTS),
        "ns_eps": NS_EPS,
        "layout": "burn: row-major [fan_in, fan_out] (PyTorch's (out, in) transposed)",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    size = os.path.getsize(OUT)
    print(f"torch {torch.__version__}; worst f32 vs f64 {worst64:.2e}", end="")
    if worst_torch is not None:
        print(f"; worst vs torch.optim.Muon: bf16 NS {worst_torch:.2e}", end="")
        if worst_torch32 is not None:
            print(f", fp32 NS {worst_torch32:.2e}", end="")
    else:
        print("; torch.optim.Muon: not in this torch", end="")
    print(f"\nwrote {os.path.relpath(OUT)} ({size} bytes)")
    if size > 150_000:
        sys.exit("the fixture is over 150 KB")


if __name__ == "__main__":
    main()
