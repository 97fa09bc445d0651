#!/usr/bin/env python3
"""Reads the device timeline of NCCL operations that `BURN_PARALLEL_NCCL_TRACE=FILE` writes
(one JSON line per operation: op, rank, start_ms, end_ms on the device's clock) and

- writes a Perfetto / chrome://tracing file (`--perfetto OUT.json`): one track per rank, one
  slice per operation, from when its inputs were ready to when it completed;
- prints, per step of DDP's gradient buckets, how the all-reduces sit in the backward: a
  bucket's `start` is when the kernels that produced its gradients had finished, so the last
  bucket's start is (to within its own packing) the end of the backward on the device. The
  communication that ran before it was hidden behind the backward.

A step starts at each repetition of the first operation's signature (every step issues the
same buckets in the same order).

Usage: scripts/nccl_trace.py TRACE.jsonl [--perfetto OUT.json] [--skip N]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--perfetto")
    ap.add_argument("--skip", type=int, default=1, help="first steps left out of the summary")
    args = ap.parse_args()
    ops = [json.loads(l) for l in open(args.trace) if l.strip()]
    if not ops:
        print("nccl_trace: no operations in", args.trace)
        return 1
    if args.perfetto:
        events = [
            {
                "name": o["op"],
                "ph": "X",
                "pid": o["rank"],
                "tid": "nccl stream",
                "ts": o["start_ms"] * 1000.0,
                "dur": max(o["end_ms"] - o["start_ms"], 0.0) * 1000.0,
            }
            for o in ops
        ]
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, open(args.perfetto, "w"))
    for rank in sorted({o["rank"] for o in ops}):
        mine = [o for o in ops if o["rank"] == rank]
        first = mine[0]["op"]
        steps, cur = [], []
        for o in mine:
            if o["op"] == first and cur:
                steps.append(cur)
                cur = []
            cur.append(o)
        if cur:
            steps.append(cur)
        print(f"rank {rank}: {len(steps)} steps of {len(steps[0])} operations")
        print("  step  buckets  comm_ms  hidden_ms  hidden%  spread_ms (first to last bucket ready)")
        fractions = []
        for i, step in enumerate(steps):
            last_ready = step[-1]["start_ms"]
            comm = sum(o["end_ms"] - o["start_ms"] for o in step)
            hidden = sum(
                max(0.0, min(o["end_ms"], last_ready) - o["start_ms"]) for o in step
            )
            spread = last_ready - step[0]["start_ms"]
            frac = hidden / comm if comm > 0 else 0.0
            if i >= args.skip:
                fractions.append(frac)
            print(
                f"  {i:4}  {len(step):7}  {comm:7.3f}  {hidden:9.3f}  {100 * frac:6.1f}%  {spread:9.3f}"
            )
        if fractions:
            print(
                f"  mean hidden fraction over steps {args.skip}..: "
                f"{100 * sum(fractions) / len(fractions):.1f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
