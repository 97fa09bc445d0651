#!/usr/bin/env python3
"""Where a training run's CPU time goes, by operation category.

Samples the command with `perf record -e cpu-clock` (Debian: `apt-get install linux-perf`),
then sums the self time of every sampled function into categories (matrix products, the
attention kernel, element-wise ops, copies, memory, autodiff bookkeeping, ...) and prints a
table. Example:

    python3 scripts/profile_ops.py -- target/release/gpt --ranks 1 --steps 20 --layers 4 \\
        --batch-size 16 --seq-len 128

The whole run is sampled (including start-up and the final evaluation); use enough steps
that training dominates.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# (category, regex on the symbol), first match wins.
CATEGORIES = [
    ("matmul (gemm)", r"gemm"),
    ("attention kernel", r"kernels::cpu::(attention|exp_shifted)"),
    ("GELU / SwiGLU kernels", r"kernels::cpu::(gelu|swiglu)"),
    ("norm kernels", r"kernels::cpu::norm"),
    ("cross-entropy kernels", r"kernels::cpu::(ce_|sum_exp|scaled_exp)"),
    ("AdamW kernel", r"kernels::cpu::adamw"),
    ("other fused kernels", r"kernels::cpu"),
    ("composed softmax / norm (Flex)", r"burn_flex::ops::activation"),
    ("GELU erf (composed)", r"erff|libm"),
    ("exp/log/trig (libm)", r"__(exp|log|sin|cos|pow)f?_|expf|logf"),
    ("element-wise ops (Flex)", r"burn_flex::(ops::(binary|unary|comparison|mask)|zip)|macerator|scalar_op"),
    ("reductions (Flex)", r"burn_flex::ops::reduce"),
    ("copies / layout", r"memmove|memcpy|copy_2d|into_contiguous|to_contiguous|burn_flex::tensor|ops::(cat|slice|expand|gather)"),
    ("memory: zeroing", r"memset|clear_page"),
    ("memory: allocator + page faults", r"malloc|free|_int_|page_fault|handle_mm|do_anonymous|mem_cgroup|memcg|unmap|alloc_pages|folio|lru|charge|pte_|rmap|mmap|brk"),
    ("optimizer (Burn AdamW)", r"burn_optim"),
    ("collectives", r"burn_parallel::(comm|group|ddp)"),
    ("autodiff bookkeeping", r"burn_autodiff|hashbrown|HashMap|Arc|drop_in_place|spin|Mutex|futex"),
    ("threads / scheduler", r"sched|switch|yield|rayon|crossbeam|thread|wake|\[k\]"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--freq", type=int, default=499, help="samples per second")
    parser.add_argument("--top", type=int, default=0, help="also print the N hottest symbols")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to profile")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to profile after --")
    if shutil.which("perf") is None:
        sys.exit("perf is not installed: apt-get install linux-perf")
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        run = subprocess.run(["perf", "record", "-e", "cpu-clock", "-F", str(args.freq), "-o", data, "--", *command],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if run.returncode != 0:
            sys.exit(f"perf record failed ({run.returncode}):\n{run.stderr[-2000:]}")
        report = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "symbol"],
                                capture_output=True, text=True, check=True).stdout
    totals = {name: 0.0 for name, _ in CATEGORIES}
    totals["other"] = 0.0
    symbols = []
    for line in report.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+\[([.k])\]\s+(.*?)\s*$", line)
        if not m:
            continue
        pct, space, sym = float(m.group(1)), m.group(2), m.group(3)
        sym = ("[k] " if space == "k" else "") + sym
        symbols.append((pct, sym))
        for name, pattern in CATEGORIES:
            if re.search(pattern, sym):
                totals[name] += pct
                break
        else:
            totals["other"] += pct
    print("| category | share of CPU time |")
    print("|---|---|")
    for name, pct in sorted(totals.items(), key=lambda kv: -kv[1]):
        if pct >= 0.05:
            print(f"| {name} | {pct:.1f}% |")
    if args.top:
        print()
        for pct, sym in symbols[: args.top]:
            print(f"{pct:6.2f}%  {sym[:100]}")


if __name__ == "__main__":
    main()
