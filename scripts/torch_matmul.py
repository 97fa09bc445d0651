#!/usr/bin/env python3
"""PyTorch's (cuBLAS's) speed on the linear layers' products of a GPT shape, for comparison
with our step's products (`gpt --profile`, `BURN_PARALLEL_MATMUL=cube|cublas`).

For each linear layer `x [rows, k] w [k, n]` of the GPT (rows = batch x seq): the forward
`x w`, and the backward's `dy w^T` and `x^T dy`, in fp32, TF32 and bf16; the median of 20
timed repetitions after 5 warm-ups, as TFLOP/s.

  python3 scripts/torch_matmul.py --rows 8192 --d-model 768 --vocab 256
"""
import argparse
import statistics

import torch


def bench(fn, reps=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args()
    d, r = args.d_model, args.rows
    layers = [("attn q/k/v/o", d, d), ("mlp up", d, 4 * d), ("mlp down", 4 * d, d), ("head", d, args.vocab)]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: rows {r}")
    print(f"{'layer':<14} {'k':>5} {'n':>5} {'mode':<5} {'fwd':>8} {'dx':>8} {'dw':>8}  TFLOP/s")
    total = {}
    for mode in ["fp32", "tf32", "bf16"]:
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        for name, k, n in layers:
            x = torch.randn(r, k, device="cuda", dtype=dtype)
            w = torch.randn(k, n, device="cuda", dtype=dtype)
            dy = torch.randn(r, n, device="cuda", dtype=dtype)
            flops = 2 * r * k * n
            t = [bench(lambda: x @ w), bench(lambda: dy @ w.t()), bench(lambda: x.t() @ dy)]
            tf = [flops / s / 1e12 for s in t]
            count = 1 if name == "head" else args.layers * (4 if name.startswith("attn") else 1)
            total[mode] = total.get(mode, 0) + sum(t) * count
            print(f"{name:<14} {k:>5} {n:>5} {mode:<5} {tf[0]:>8.1f} {tf[1]:>8.1f} {tf[2]:>8.1f}")
    for mode, s in total.items():
        print(f"a step's linear products ({args.layers} layers and the head), {mode}: {s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
