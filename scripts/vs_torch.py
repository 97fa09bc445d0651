#!/usr/bin/env python3
"""Times burn-parallel's `gpt` trainer against PyTorch eager on the same GPT and training step.

The PyTorch side is the model of `examples/src/gpt.rs` with the defaults of
`GptConfig::new` and `TrainConfig::default` (examples/src/train.rs), written as a PyTorch user
writes it (nanoGPT style): pre-norm blocks, LayerNorm (eps 1e-5), exact (erf) GELU, learned
positions, untied `lm_head`, biases in every linear, byte vocabulary (256), causal attention
through `F.scaled_dot_product_attention` (`--torch-attn manual`: matmul, mask, softmax, matmul),
mean cross-entropy, AdamW with Burn's defaults (betas 0.9/0.999, eps 1e-5, weight decay 0).
The parameter count of both sides is checked against the formula of `GptConfig::num_params`.

Runs alternate (ours, torch, ours, torch, ...) for `--repeats` rounds per shape and layout;
the table gives the median and the range of tokens/s of each side and the ratio ours / torch
of the medians, then the 2-rank / 1-rank efficiency of each side.

Layouts:
  1   one process: `gpt --ranks 1`; torch with its default intra-op threads.
  2   two data-parallel ranks: `gpt --ranks 2` (thread ranks; with `--tcp` also
      `burnrun --nproc-per-node 2 -- gpt --backend tcp`); torch: DDP over gloo, 2 processes
      (torch.multiprocessing), `torch.set_num_threads(1)` each, the global batch split in two.

Both sides time every step but the first (tokens/s = global batch x seq / mean step time);
our figure is the `N tokens/s` of the trainer's final line, computed the same way. With
`--warmup W` both sides leave the first W steps out (ours from its per-step lines): PyTorch's
first steps after start-up can be slow (allocator, oneDNN set-up), and more so on a busy machine.
The data is random bytes on the torch side and the bundled corpus on ours (speed does not
depend on it). A step on both sides includes reading the global mean loss.

Usage (from the repository root, after `cargo build --release -p examples --bin gpt`):

  python3 scripts/vs_torch.py --python /work/torchenv/bin/python
  python3 scripts/vs_torch.py --shapes default,wide --layouts 1,2 --steps 20 --repeats 3 \
      --json out.json --extra-args "--fused"

PyTorch is needed only by this benchmark (`pip install torch`), not by the project.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256
NORM_EPS = 1e-5  # default_norm_eps() in examples/src/gpt.rs
INIT_STD = 0.02
# burn-optim 0.22.1 AdamWConfig defaults (weight decay: TrainConfig::default's 0.0).
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-5
WEIGHT_DECAY = 0.0
LR = 3e-3


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    d_model: int
    heads: int
    seq_len: int
    batch: int  # global batch, in sequences

    @property
    def max_seq_len(self) -> int:
        # TrainConfig::default's model has 64 positions; `gpt` raises it to --seq-len.
        return max(64, self.seq_len)

    def num_params(self) -> int:
        """`GptConfig::num_params` for the GPT-2 style config (GELU MLP, d_ff = 4 d)."""
        d, f, v = self.d_model, 4 * self.d_model, VOCAB
        attn = 4 * (d * d + d)
        mlp = d * f + f + f * d + d
        block = attn + mlp + 2 * 2 * d
        return v * d + self.max_seq_len * d + self.layers * block + 2 * d + d * v + v


SHAPES = {
    "default": Shape("default", layers=2, d_model=128, heads=4, seq_len=64, batch=32),
    "wide": Shape("wide", layers=4, d_model=256, heads=4, seq_len=256, batch=16),
    "issue": Shape("issue", layers=4, d_model=128, heads=4, seq_len=128, batch=16),
}


def die(msg: str, code: int = 2) -> None:
    print(f"vs_torch: error: {msg}", file=sys.stderr)
    sys.exit(code)


# --------------------------------------------------------------------------------------------
# The PyTorch side (runs in a child process: `vs_torch.py --torch-worker ...`).
# --------------------------------------------------------------------------------------------


def build_torch_model(shape: Shape, attn_kind: str, fused_qkv: bool):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, h = shape.d_model, shape.heads
    hd = d // h
    residual_std = INIT_STD / math.sqrt(2 * shape.layers)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            if fused_qkv:
                self.qkv = nn.Linear(d, 3 * d)
            else:
                self.q = nn.Linear(d, d)
                self.k = nn.Linear(d, d)
                self.v = nn.Linear(d, d)
            self.o = nn.Linear(d, d)
            self.o.residual = True
            if attn_kind == "manual":
                mask = torch.tril(torch.ones(shape.max_seq_len, shape.max_seq_len, dtype=torch.bool))
                self.register_buffer("mask", mask.view(1, 1, *mask.shape), persistent=False)

        def forward(self, x):
            b, t, c = x.shape
            if fused_qkv:
                q, k, v = self.qkv(x).split(d, dim=2)
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            q = q.view(b, t, h, hd).transpose(1, 2)
            k = k.view(b, t, h, hd).transpose(1, 2)
            v = v.view(b, t, h, hd).transpose(1, 2)
            if attn_kind == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
                att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
                att = F.softmax(att, dim=-1)
                y = att @ v
            y = y.transpose(1, 2).contiguous().view(b, t, c)
            return self.o(y)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(d, 4 * d)
            self.act = nn.GELU(approximate="none")
            self.down = nn.Linear(4 * d, d)
            self.down.residual = True

        def forward(self, x):
            return self.down(self.act(self.up(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d, eps=NORM_EPS)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(d, eps=NORM_EPS)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, d)
            self.wpe = nn.Embedding(shape.max_seq_len, d)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln_f = nn.LayerNorm(d, eps=NORM_EPS)
            self.lm_head = nn.Linear(d, VOCAB)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    std = residual_std if getattr(m, "residual", False) else INIT_STD
                    nn.init.normal_(m.weight, 0.0, std)
                    nn.init.zeros_(m.bias)
                elif isinstance(m, nn.Embedding):
                    nn.init.normal_(m.weight, 0.0, INIT_STD)

        def forward(self, idx, targets):
            _, t = idx.shape
            pos = torch.arange(t, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return Gpt()


def torch_train(
    shape: Shape, steps: int, warmup: int, attn_kind: str, fused_qkv: bool, rank: int, world: int
):
    """Trains `steps` steps on this rank's rows; returns (tokens/s of the global batch over the
    steps after the first `warmup`, params, first loss, last loss)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(1234)
    model = build_torch_model(shape, attn_kind, fused_qkv)
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)  # broadcasts rank 0's weights; 25 MB buckets, as our bucket_mb
    optim = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY
    )
    rows = shape.batch // world
    gen = torch.Generator().manual_seed(100 + rank)
    timed = 0.0
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        data = torch.randint(0, VOCAB, (rows, shape.seq_len + 1), generator=gen)
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        loss = model(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        # The global mean loss, as our trainer computes and reads every step.
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        seconds = time.perf_counter() - start
        if step >= warmup:
            timed += seconds
    timed_steps = steps - warmup
    tokens_per_sec = shape.batch * shape.seq_len * timed_steps / max(timed, 1e-9)
    return tokens_per_sec, n_params, losses[0], losses[-1]


def _ddp_worker(rank, world, port, shape, steps, warmup, attn_kind, fused_qkv, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = torch_train(shape, steps, warmup, attn_kind, fused_qkv, rank, world)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    # Both ranks leave together (gloo aborts a rank whose peer tore the group down first).
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_worker(args) -> None:
    """`--torch-worker`: one torch run; prints one JSON line."""
    import torch

    shape = SHAPES[args.shape]
    if args.torch_threads and args.ranks == 1:
        torch.set_num_threads(args.torch_threads)
    if args.ranks == 1:
        tps, n_params, first, last = torch_train(
            shape, args.steps, args.warmup, args.torch_attn, args.torch_fused_qkv, 0, 1
        )
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "result.json")
            mp.spawn(
                _ddp_worker,
                args=(
                    args.ranks,
                    free_port(),
                    shape,
                    args.steps,
                    args.warmup,
                    args.torch_attn,
                    args.torch_fused_qkv,
                    out_path,
                ),
                nprocs=args.ranks,
                join=True,
            )
            with open(out_path) as f:
                tps, n_params, first, last = json.load(f)
    print(
        json.dumps(
            {
                "tokens_per_sec": tps,
                "params": n_params,
                "first_loss": first,
                "last_loss": last,
                "threads": torch.get_num_threads() if args.ranks == 1 else 1,
                "torch": torch.__version__,
            }
        )
    )


# --------------------------------------------------------------------------------------------
# The harness.
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    shape: str
    layout: str
    side: str  # "ours", "ours-tcp" or "torch"
    repeat: int
    tokens_per_sec: float
    wall_s: float
    load_before: float
    load_after: float
    params: str | int


FINAL = re.compile(r"([0-9.]+) tokens/s\s*$")
STEP = re.compile(r"step\s+([0-9]+)\s+loss .*?([0-9.]+) tok/s")
PARAMS = re.compile(r"\(([0-9.]+)M params\)")


def run_checked(cmd: list[str], what: str, env=None) -> tuple[str, float]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        die(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}", 1)
    return proc.stdout, wall


def ours_cmd(args, shape: Shape, ranks: int, tcp: bool, config_path: str | None) -> list[str]:
    flags = [
        "--steps", str(args.steps),
        "--layers", str(shape.layers),
        "--d-model", str(shape.d_model),
        "--heads", str(shape.heads),
        "--seq-len", str(shape.seq_len),
        "--batch-size", str(shape.batch),
        # Every step's line when steps beyond the first are left out of the timing.
        "--log-every", "1000" if args.warmup == 1 else "1",
    ]  # fmt: skip
    if config_path:
        flags += ["--config", config_path]
    flags += shlex.split(args.extra_args)
    if tcp:
        return [args.burnrun, "--nproc-per-node", str(ranks), "--", args.gpt, "--backend", "tcp"] + flags
    return [args.gpt, "--ranks", str(ranks)] + flags


def run_ours(args, shape, layout, tcp, repeat, config_path) -> RunResult:
    ranks = int(layout)
    cmd = ours_cmd(args, shape, ranks, tcp, config_path)
    load = os.getloadavg()[0]
    out, wall = run_checked(cmd, "our gpt")
    finals = [FINAL.search(line) for line in out.splitlines()]
    finals = [m for m in finals if m]
    if not finals:
        die(f"no final 'N tokens/s' line in the output of {shlex.join(cmd)}:\n{out[-2000:]}", 1)
    tokens_per_sec = float(finals[-1].group(1))
    if args.warmup > 1:
        # Each step's own tok/s is the global batch over that step's time (the final line's
        # figure, but over the steps after the first `warmup`).
        per_step = {}
        for line in out.splitlines():
            m = STEP.search(line)
            if m:
                per_step.setdefault(int(m.group(1)), float(m.group(2)))
        timed = [per_step.get(i) for i in range(args.warmup, args.steps)]
        if None in timed:
            die(f"missing per-step lines in the output of {shlex.join(cmd)}:\n{out[-2000:]}", 1)
        tokens = shape.batch * shape.seq_len
        tokens_per_sec = tokens * len(timed) / sum(tokens / t for t in timed)
    params = PARAMS.search(out)
    return RunResult(
        shape.name,
        layout,
        "ours-tcp" if tcp else "ours",
        repeat,
        tokens_per_sec,
        wall,
        load,
        os.getloadavg()[0],
        params.group(1) if params else "?",
    )


def run_torch(args, shape, layout, repeat) -> tuple[RunResult, dict]:
    cmd = [
        args.python, os.path.abspath(__file__), "--torch-worker",
        "--shape", shape.name,
        "--ranks", layout,
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
        "--torch-attn", args.torch_attn,
    ]  # fmt: skip
    if args.torch_fused_qkv:
        cmd.append("--torch-fused-qkv")
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    load = os.getloadavg()[0]
    out, wall = run_checked(cmd, "the PyTorch run")
    info = json.loads(out.strip().splitlines()[-1])
    result = RunResult(
        shape.name,
        layout,
        "torch",
        repeat,
        float(info["tokens_per_sec"]),
        wall,
        load,
        os.getloadavg()[0],
        int(info["params"]),
    )
    return result, info


def check_params(shape: Shape, ours: RunResult, torch_res: RunResult) -> None:
    expected = shape.num_params()
    if torch_res.params != expected:
        die(
            f"shape {shape.name}: the PyTorch model has {torch_res.params} parameters, "
            f"GptConfig::num_params gives {expected}: the models differ",
            1,
        )
    if ours.params != f"{expected / 1e6:.2f}":
        die(
            f"shape {shape.name}: our gpt prints {ours.params}M params, the PyTorch model has "
            f"{expected} ({expected / 1e6:.2f}M): the models differ",
            1,
        )


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_k(x: float) -> str:
    return f"{x / 1000:.2f}k"


def fmt_range(s: dict) -> str:
    return f"{fmt_k(s['median'])} ({fmt_k(s['min'])}–{fmt_k(s['max'])})"


def preflight(args) -> None:
    if not (os.path.isfile(args.gpt) and os.access(args.gpt, os.X_OK)):
        die(
            f"the gpt binary {args.gpt!r} does not exist: build it with "
            "`cargo build --release -p examples --bin gpt` (or pass --gpt PATH)"
        )
    if args.tcp and "2" in args.layouts and not (
        os.path.isfile(args.burnrun) and os.access(args.burnrun, os.X_OK)
    ):
        die(
            f"--tcp needs the burnrun launcher, {args.burnrun!r} does not exist: build it with "
            "`cargo build --release -p burn-parallel --bin burnrun` (or pass --burnrun PATH)"
        )
    probe = subprocess.run(
        [args.python, "-c", "import torch, torch.distributed as d; print(torch.__version__, d.is_gloo_available())"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        die(
            f"PyTorch is not importable by {args.python!r}: install it (`pip install torch`, the "
            "CPU wheel is enough) or pass --python PATH to a Python that has it "
            f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no output'})"
        )
    version, gloo = probe.stdout.split()
    if gloo != "True" and "2" in args.layouts:
        die(f"PyTorch {version} at {args.python!r} has no gloo backend, needed by the 2-rank DDP layout")
    args.torch_version = version


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt", default=os.path.join(REPO, "target/release/gpt"), help="our trainer binary")
    p.add_argument("--burnrun", default=os.path.join(REPO, "target/release/burnrun"), help="launcher for --tcp")
    p.add_argument("--python", default=sys.executable, help="the Python that has torch (default: this one)")
    p.add_argument("--shapes", default="default,wide", help=f"comma-separated, of {','.join(SHAPES)}")
    p.add_argument("--layouts", default="1,2", help="comma-separated: 1 (one process), 2 (two DP ranks)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--warmup", type=int, default=1,
                   help="leading steps left out of the timing on both sides (1: the first, as the trainer's final line)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds per shape and layout")
    p.add_argument("--extra-args", default="", help="extra flags for our gpt, e.g. '--fused'")
    p.add_argument("--tcp", action="store_true", help="also run our 2-rank layout as 2 processes over TCP (burnrun)")
    p.add_argument("--torch-attn", choices=["sdpa", "manual"], default="sdpa",
                   help="sdpa: F.scaled_dot_product_attention (default); manual: matmul/mask/softmax/matmul")
    p.add_argument("--torch-fused-qkv", action="store_true",
                   help="one c_attn Linear(d, 3d) for q, k, v on the torch side (nanoGPT's layout; same parameter count)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="intra-op threads of the 1-process torch run (default: torch's own, the core count)")
    p.add_argument("--full-run", action="store_true",
                   help="let our gpt run its default evaluation and sample after training (not timed either way)")
    p.add_argument("--json", metavar="FILE", help="also write every run and the summary as JSON")
    # Internal: one PyTorch run.
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    # `--extra-args "--fused"`: a value that starts with a dash would read as an option.
    argv = sys.argv[1:]
    for i, a in enumerate(argv[:-1]):
        if a == "--extra-args":
            argv[i : i + 2] = [f"--extra-args={argv[i + 1]}"]
            break
    args = p.parse_args(argv)

    if args.torch_worker:
        torch_worker(args)
        return

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            die(f"unknown shape {s!r}: use one of {', '.join(SHAPES)}")
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    for layout in layouts:
        if layout not in ("1", "2"):
            die(f"unknown layout {layout!r}: use 1 and/or 2")
    if args.warmup < 1 or args.steps <= args.warmup or args.repeats < 1:
        die("need 1 <= --warmup < --steps (the first step is never timed) and --repeats >= 1")
    args.layouts = layouts
    preflight(args)

    # Our trainer evaluates and samples after training (outside its tokens/s); a small config
    # skips most of that wall time. Flags given on the command line still override it.
    config_path = None
    tmpdir = tempfile.TemporaryDirectory()
    if not args.full_run and "--config" not in shlex.split(args.extra_args):
        config_path = os.path.join(tmpdir.name, "bench.toml")
        with open(config_path, "w") as f:
            f.write("eval_batches = 1\nsample_len = 0\n")

    print(
        f"# gpt vs PyTorch {args.torch_version} eager ({os.cpu_count()} CPUs), {args.steps} steps/run "
        f"(first {args.warmup} untimed), {args.repeats} alternating rounds; torch attention: {args.torch_attn}"
        f"{', fused qkv' if args.torch_fused_qkv else ''}"
        f"{f', torch threads {args.torch_threads}' if args.torch_threads else ''}; our extra args: {args.extra_args or '(none)'}",
        file=sys.stderr,
    )
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(
            f"# warning: the machine is busy (load average {load:.2f} on {os.cpu_count()} CPUs): "
            "timings will be noisy, PyTorch's multi-threaded 1-process run most of all (its "
            "intra-op threads wait on each other when a core is taken)",
            file=sys.stderr,
        )
    runs: list[RunResult] = []
    torch_info = {}
    for name in shapes:
        shape = SHAPES[name]
        for layout in layouts:
            sides = ["ours", "torch"] + (["ours-tcp"] if args.tcp and layout == "2" else [])
            for rep in range(args.repeats):
                for side in sides:
                    if side == "torch":
                        r, info = run_torch(args, shape, layout, rep)
                        torch_info[(name, layout)] = info
                    else:
                        r = run_ours(args, shape, layout, side == "ours-tcp", rep, config_path)
                    runs.append(r)
                    print(
                        f"  {name:8} {layout} rank(s) {side:8} round {rep + 1}: "
                        f"{r.tokens_per_sec:8.0f} tok/s  (wall {r.wall_s:5.1f} s, load {r.load_before:.2f}"
                        f"->{r.load_after:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )
                    if rep == 0 and side == "torch":
                        ours = next(x for x in runs if x.shape == name and x.layout == layout and x.side == "ours")
                        check_params(shape, ours, r)

    # ---- summary ----
    summary = {}
    for name in shapes:
        for layout in layouts:
            for side in ("ours", "ours-tcp", "torch"):
                vals = [r.tokens_per_sec for r in runs if (r.shape, r.layout, r.side) == (name, layout, side)]
                if vals:
                    summary[(name, layout, side)] = summarise(vals)

    def label(layout, side):
        if layout == "1":
            return "1 process"
        return {"ours": "2 ranks (threads)", "ours-tcp": "2 ranks (tcp, burnrun)", "torch": "2 ranks"}[side]

    lines = [
        f"| shape | layout | `gpt` tok/s median (min–max) | PyTorch {args.torch_version} tok/s median (min–max) | ours / torch |",
        "|---|---|---|---|---|",
    ]
    for name in shapes:
        s = SHAPES[name]
        desc = f"{name} (L{s.layers} d{s.d_model} h{s.heads} T{s.seq_len} B{s.batch}, {s.num_params() / 1e6:.2f}M)"
        for layout in layouts:
            t = summary[(name, layout, "torch")]
            for side in ("ours", "ours-tcp"):
                o = summary.get((name, layout, side))
                if o is None:
                    continue
                lines.append(
                    f"| {desc} | {label(layout, side)} | {fmt_range(o)} | {fmt_range(t)} | "
                    f"{o['median'] / t['median']:.2f}× |"
                )
    print("\n".join(lines))
    efficiency = {}
    if "1" in layouts and "2" in layouts:
        print()
        print("| shape | side | 2 ranks / 1 process (medians) |")
        print("|---|---|---|")
        for name in shapes:
            for side in ("ours", "ours-tcp", "torch"):
                two = summary.get((name, "2", side))
                one = summary.get((name, "1", "ours" if side == "ours-tcp" else side))
                if two and one:
                    eff = two["median"] / one["median"]
                    efficiency[f"{name}/{side}"] = eff
                    print(f"| {name} | {side} | {eff:.2f}× |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": args.torch_version,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "repeats": args.repeats,
                    "torch_attn": args.torch_attn,
                    "torch_fused_qkv": args.torch_fused_qkv,
                    "extra_args": args.extra_args,
                    "gpt": args.gpt,
                    "runs": [asdict(r) for r in runs],
                    "summary": [
                        {"shape": k[0], "layout": k[1], "side": k[2], **v} for k, v in summary.items()
                    ],
                    "ratio_ours_over_torch": {
                        f"{n}/{l}/{side}": summary[(n, l, side)]["median"] / summary[(n, l, "torch")]["median"]
                        for (n, l, side) in summary
                        if side != "torch"
                    },
                    "efficiency_2_over_1": efficiency,
                    "torch_runs": {f"{k[0]}/{k[1]}": v for k, v in torch_info.items()},
                },
                f,
                indent=2,
            )
    tmpdir.cleanup()


if __name__ == "__main__":
    main()
