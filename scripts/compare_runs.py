#!/usr/bin/env python3
"""Compares `gpt` runs by their `--losses-out` and `--params-out` files: the first run is the
reference; for each other run, the largest relative difference of the per-step losses and of
the final parameters (max |a - b| over max |a|, per parameter, the worst one named).

  python3 scripts/compare_runs.py LOSSES_REF PARAMS_REF LOSSES_B PARAMS_B [LOSSES_C PARAMS_C ...]
"""
import json
import sys


def load_params(path):
    out = {}
    for p in json.load(open(path)):
        out[p["path"]] = p["values"]
    return out


def main():
    files = sys.argv[1:]
    if len(files) < 4 or len(files) % 2:
        sys.exit(__doc__)
    pairs = [(files[i], files[i + 1]) for i in range(0, len(files), 2)]
    ref_l, ref_p = json.load(open(pairs[0][0])), load_params(pairs[0][1])
    print(f"reference {pairs[0][0]}: final loss {ref_l[-1]:.6f}")
    for lf, pf in pairs[1:]:
        losses, params = json.load(open(lf)), load_params(pf)
        dl = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_l, losses))
        worst, name = 0.0, ""
        for k, a in ref_p.items():
            b = params.get(k)
            if b is None or len(b) != len(a):
                print(f"  {pf}: parameter {k} missing or of another size")
                continue
            scale = max(max(abs(x) for x in a), 1e-12)
            d = max(abs(x - y) for x, y in zip(a, b)) / scale
            if d > worst:
                worst, name = d, k
        print(f"  {lf}: final loss {losses[-1]:.6f}, worst loss rel diff {dl:.2e}; worst param rel diff {worst:.2e} ({name})")


if __name__ == "__main__":
    main()
