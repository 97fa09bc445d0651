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

Shapes (`--shapes`): default (L2 d128 h4 T64 B32, `TrainConfig::default`), wide (L4 d256 h4
T256 B16), issue (L4 d128 h4 T128 B16), gpt2 (GPT-2 small's body: L12 d768 h12 T1024 B8, for
GPUs).

Layouts:
  1   one process: `gpt --ranks 1`; torch with its default intra-op threads.
  2   two data-parallel ranks: `gpt --ranks 2` (thread ranks; with `--tcp` also
      `burnrun --nproc-per-node 2 -- gpt --backend tcp`); torch: DDP over gloo, 2 processes
      (torch.multiprocessing), `torch.set_num_threads(1)` each, the global batch split in two.
      CPU only.

Devices (`--device`):
  cpu   (the default) as above, fp32 on both sides.
  cuda  one GPU, layout 1: torch runs the model on `cuda:0` with fp32 master weights and
        `torch.optim.AdamW(..., fused=True)`, `torch.cuda.synchronize()` before each step time
        is read; ours runs `gpt --device cuda --precision f32|bf16` (a build with
        `--features examples/cuda`). `--precision`:
          f32   torch: TF32 off (matmul and cuDNN); ours: --precision f32.
          tf32  torch: `torch.backends.cuda.matmul.allow_tf32` and cuDNN's allow_tf32 on;
                ours: --precision f32 (our fp32 path).
          bf16  torch: `torch.autocast("cuda", dtype=torch.bfloat16)` around the forward and the
                loss; ours: --precision bf16 (bf16 compute, fp32 master weights).

MFU: with a peak (on cuda looked up from `torch.cuda.get_device_name()` for the precision:
H100/H200 SXM 66.9 fp32, 494.7 tf32, 989.4 bf16 TFLOP/s; H100 PCIe 51.2/378/756; A100
19.5/156/312; or given by `--peak-tflops`, also on CPU) each side's column has its MFU,
tokens/s x FLOPs per token / peak, with FLOPs per token = 6 x matmul params + 12 x layers x seq
x d_model, matmul params = layers x (4 d^2 (attention) + 2 x d x 4d + 4d + d (MLP, biases
included)) + 256 d (the head): `ModelShape::train_flops_per_token` of the planner.

`--plain-burn` adds a third column: `plain_burn_gpt` (examples/examples/plain_burn_gpt.rs, the
same GPT and step written with plain Burn: `burn::nn` layers, Burn's AdamW), layout 1, same shape
and device (`--device flex|cuda`), with the ratio ours / plain Burn: at one rank our step must
cost no more than plain Burn's. Plain Burn has no mixed precision: under `--precision bf16` its
column is fp32 (its MFU still against the bf16 peak).

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
  cargo build --release --workspace --bin gpt --example plain_burn_gpt --features examples/cuda
  python3 scripts/vs_torch.py --device cuda --precision bf16 --shapes gpt2 --layouts 1 \
      --steps 30 --warmup 5 --plain-burn
  python3 scripts/vs_torch.py --device cuda --precision tf32 --shapes gpt2 --layouts 1 \
      --our-binary /opt/packed/gpt --peak-tflops 494.7

PyTorch is needed only by this benchmark (`pip install torch`), not by the project.
"""

from __future__ import annotations

import argparse
import ast
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

    def matmul_params(self) -> int:
        """Weights each token is multiplied by: per block 4 d^2 (attention) + 2 d 4d + 4d + d (MLP,
        biases included), and the head's d x 256 (`ModelShape::matmul_params`)."""
        d = self.d_model
        block = 4 * d * d + 2 * d * 4 * d + 4 * d + d
        return self.layers * block + d * VOCAB

    def flops_per_token(self) -> float:
        """Training FLOPs per token, `6 * matmul_params + 12 * layers * seq * d_model`
        (`ModelShape::train_flops_per_token`)."""
        return 6.0 * self.matmul_params() + 12.0 * self.layers * self.seq_len * self.d_model


SHAPES = {
    "default": Shape("default", layers=2, d_model=128, heads=4, seq_len=64, batch=32),
    "wide": Shape("wide", layers=4, d_model=256, heads=4, seq_len=256, batch=16),
    "issue": Shape("issue", layers=4, d_model=128, heads=4, seq_len=128, batch=16),
    # GPT-2 small's body (byte vocabulary): the GPU issue's shape.
    "gpt2": Shape("gpt2", layers=12, d_model=768, heads=12, seq_len=1024, batch=8),
}

# Dense peak TFLOP/s by CUDA device name (fp32, tf32, bf16), most specific first: the table of
# `burn_parallel::mfu::peak_tflops` (SXM parts unless the name says PCIe/NVL).
PEAK_TFLOPS = [
    ("H100 PCIe", 51.2, 378.0, 756.0),
    ("H100 NVL", 60.0, 417.5, 835.0),
    ("H200 NVL", 60.0, 417.5, 835.0),
    ("H200", 66.9, 494.7, 989.4),
    ("H100", 66.9, 494.7, 989.4),
    ("GH200", 66.9, 494.7, 989.4),
    ("A100", 19.5, 156.0, 312.0),
    ("L40S", 91.6, 183.0, 362.1),
]


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The data-sheet peak of `device_name` for `precision` (f32, tf32, bf16), or None."""
    column = {"f32": 1, "tf32": 2, "bf16": 3}[precision]
    for row in PEAK_TFLOPS:
        if row[0] in device_name:
            return row[column]
    return None


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
    shape: Shape,
    steps: int,
    warmup: int,
    attn_kind: str,
    fused_qkv: bool,
    rank: int,
    world: int,
    device: str = "cpu",
    precision: str = "f32",
):
    """Trains `steps` steps on this rank's rows; returns (tokens/s of the global batch over the
    steps after the first `warmup`, params, first loss, last loss). On `device` "cuda": the
    model on cuda:0 in fp32 (master weights), TF32 on for `precision` "tf32", bf16 autocast
    around the forward and the loss for "bf16", fused AdamW."""
    import contextlib

    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    dev = torch.device("cuda:0" if cuda else "cpu")
    torch.manual_seed(1234)
    model = build_torch_model(shape, attn_kind, fused_qkv).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)  # broadcasts rank 0's weights; 25 MB buckets, as our bucket_mb
    adamw = dict(lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    if cuda:
        adamw["fused"] = True
    optim = torch.optim.AdamW(model.parameters(), **adamw)

    def autocast():
        if cuda and precision == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    rows = shape.batch // world
    gen = torch.Generator().manual_seed(100 + rank)
    timed = 0.0
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        data = torch.randint(0, VOCAB, (rows, shape.seq_len + 1), generator=gen)
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        if cuda:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with autocast():
            loss = model(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        # The global mean loss, as our trainer computes and reads every step.
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.float().item())
        if cuda:
            torch.cuda.synchronize()
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
            shape,
            args.steps,
            args.warmup,
            args.torch_attn,
            args.torch_fused_qkv,
            0,
            1,
            args.device,
            args.precision,
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
                "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                "precision": args.precision,
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
    side: str  # "ours", "ours-tcp", "torch" or "plain" (plain Burn)
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


def shape_flags(args, shape: Shape) -> list[str]:
    """The step count, the shape and the logging, as `gpt` and `plain_burn_gpt` both take them."""
    return [
        "--steps", str(args.steps),
        "--layers", str(shape.layers),
        "--d-model", str(shape.d_model),
        "--heads", str(shape.heads),
        "--seq-len", str(shape.seq_len),
        "--batch-size", str(shape.batch),
        # Every step's line when steps beyond the first are left out of the timing.
        "--log-every", "1000" if args.warmup == 1 else "1",
    ]  # fmt: skip


def ours_cmd(args, shape: Shape, ranks: int, tcp: bool, config_path: str | None) -> list[str]:
    flags = shape_flags(args, shape)
    if config_path:
        flags += ["--config", config_path]
    if args.device == "cuda":
        # tf32 is torch's setting; our fp32 path is the same for both.
        flags += ["--device", "cuda", "--precision", "bf16" if args.precision == "bf16" else "f32"]
    flags += shlex.split(args.extra_args)
    if tcp:
        return [args.burnrun, "--nproc-per-node", str(ranks), "--", args.gpt, "--backend", "tcp"] + flags
    return [args.gpt, "--ranks", str(ranks)] + flags


def plain_cmd(args, shape: Shape) -> list[str]:
    """`plain_burn_gpt` on the same shape and device (fp32: plain Burn has no mixed precision)."""
    device = "cuda" if args.device == "cuda" else "flex"
    return [args.plain_binary] + shape_flags(args, shape) + ["--device", device]


def run_ours(args, shape, layout, tcp, repeat, config_path, plain: bool = False) -> RunResult:
    ranks = int(layout)
    cmd = plain_cmd(args, shape) if plain else ours_cmd(args, shape, ranks, tcp, config_path)
    load = os.getloadavg()[0]
    out, wall = run_checked(cmd, "plain_burn_gpt" if plain else "our gpt")
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
        "plain" if plain else "ours-tcp" if tcp else "ours",
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
        "--device", args.device,
        "--precision", args.precision,
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


def check_params(shape: Shape, ours: RunResult, torch_res: RunResult, plain: RunResult | None = None) -> None:
    expected = shape.num_params()
    if torch_res.params != expected:
        die(
            f"shape {shape.name}: the PyTorch model has {torch_res.params} parameters, "
            f"GptConfig::num_params gives {expected}: the models differ",
            1,
        )
    for what, run in (("our gpt", ours), ("plain_burn_gpt", plain)):
        if run is not None and run.params != f"{expected / 1e6:.2f}":
            die(
                f"shape {shape.name}: {what} prints {run.params}M params, the PyTorch model has "
                f"{expected} ({expected / 1e6:.2f}M): the models differ",
                1,
            )


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_k(x: float) -> str:
    return f"{x / 1000:.2f}k"


def fmt_range(s: dict) -> str:
    return f"{fmt_k(s['median'])} ({fmt_k(s['min'])}–{fmt_k(s['max'])})"


def mfu(args, shape: Shape, tokens_per_sec: float) -> float | None:
    """Model FLOPs utilisation of one device at `tokens_per_sec`, or None without a peak."""
    if not args.peak:
        return None
    return tokens_per_sec * shape.flops_per_token() / (args.peak * 1e12)


def fmt_mfu(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def preflight(args) -> None:
    if not (os.path.isfile(args.gpt) and os.access(args.gpt, os.X_OK)):
        die(
            f"the gpt binary {args.gpt!r} does not exist: build it with "
            "`cargo build --release -p examples --bin gpt` (or pass --our-binary PATH)"
        )
    if args.plain_burn and not (os.path.isfile(args.plain_binary) and os.access(args.plain_binary, os.X_OK)):
        die(
            f"--plain-burn needs the plain_burn_gpt binary, {args.plain_binary!r} does not exist: build "
            "it with `cargo build --release --workspace --example plain_burn_gpt` (with "
            "`--features examples/cuda` for --device cuda), or pass --plain-binary PATH"
        )
    if args.tcp and "2" in args.layouts and not (
        os.path.isfile(args.burnrun) and os.access(args.burnrun, os.X_OK)
    ):
        die(
            f"--tcp needs the burnrun launcher, {args.burnrun!r} does not exist: build it with "
            "`cargo build --release -p burn-parallel --bin burnrun` (or pass --burnrun PATH)"
        )
    code = "import torch, torch.distributed as d; print(torch.__version__, d.is_gloo_available())"
    if args.device == "cuda":
        code = (
            "import torch, torch.distributed as d; "
            "ok = torch.cuda.is_available(); "
            "print(torch.__version__, d.is_gloo_available(), ok, "
            "repr(torch.cuda.get_device_name(0) if ok else ''))"
        )
    probe = subprocess.run([args.python, "-c", code], capture_output=True, text=True)
    if probe.returncode != 0:
        die(
            f"PyTorch is not importable by {args.python!r}: install it (`pip install torch`, the "
            "CPU wheel is enough) or pass --python PATH to a Python that has it "
            f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no output'})"
        )
    version, gloo = probe.stdout.split()[:2]
    if gloo != "True" and "2" in args.layouts:
        die(f"PyTorch {version} at {args.python!r} has no gloo backend, needed by the 2-rank DDP layout")
    args.torch_version = version
    args.device_name = "cpu"
    if args.device == "cuda":
        fields = probe.stdout.split(None, 3)
        if fields[2] != "True":
            die(f"PyTorch {version} at {args.python!r} sees no CUDA device (torch.cuda.is_available() is False)")
        args.device_name = ast.literal_eval(fields[3].strip())
    args.peak, args.peak_source = None, "give --peak-tflops for MFU"
    if args.peak_tflops:
        args.peak, args.peak_source = args.peak_tflops, "--peak-tflops"
    elif args.device == "cuda":
        args.peak = peak_tflops(args.device_name, args.precision)
        args.peak_source = (
            f"{args.device_name}, {args.precision} data sheet"
            if args.peak
            else f"{args.device_name} is not in the table: give --peak-tflops for MFU"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt", "--our-binary", dest="gpt", default=os.path.join(REPO, "target/release/gpt"),
                   help="our trainer binary (a packed or installed `gpt` elsewhere too)")
    p.add_argument("--burnrun", default=os.path.join(REPO, "target/release/burnrun"), help="launcher for --tcp")
    p.add_argument("--python", default=sys.executable, help="the Python that has torch (default: this one)")
    p.add_argument("--shapes", default="default,wide", help=f"comma-separated, of {','.join(SHAPES)}")
    p.add_argument("--layouts", default=None,
                   help="comma-separated: 1 (one process), 2 (two DP ranks, CPU only); default 1,2 on cpu, 1 on cuda")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (default), or cuda: one GPU, cuda:0 for torch, `gpt --device cuda` for ours")
    p.add_argument("--precision", choices=["f32", "tf32", "bf16"], default="f32",
                   help="with --device cuda: f32, tf32 (torch's TF32 matmuls; ours f32) or bf16 (torch autocast; ours --precision bf16)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device for MFU (default on cuda: from torch.cuda.get_device_name() and --precision)")
    p.add_argument("--plain-burn", action="store_true",
                   help="add a third column: plain_burn_gpt (the same GPT with plain Burn) on the same shape and device, layout 1")
    p.add_argument("--plain-binary", default=os.path.join(REPO, "target/release/examples/plain_burn_gpt"),
                   help="the plain_burn_gpt binary of --plain-burn")
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
    if args.layouts is None:
        args.layouts = "1" if args.device == "cuda" else "1,2"
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    for layout in layouts:
        if layout not in ("1", "2"):
            die(f"unknown layout {layout!r}: use 1 and/or 2")
    if args.device == "cuda" and layouts != ["1"]:
        die("--device cuda runs layout 1 (one GPU) only: use --layouts 1")
    if args.device == "cpu" and args.precision != "f32":
        die(f"--precision {args.precision} needs --device cuda (the CPU runs are fp32)")
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

    where = f"{os.cpu_count()} CPUs" if args.device == "cpu" else f"{args.device_name}, {args.precision}"
    print(
        f"# gpt vs PyTorch {args.torch_version} eager ({where}), {args.steps} steps/run "
        f"(first {args.warmup} untimed), {args.repeats} alternating rounds; torch attention: {args.torch_attn}"
        f"{', fused qkv' if args.torch_fused_qkv else ''}"
        f"{f', torch threads {args.torch_threads}' if args.torch_threads else ''}; our extra args: {args.extra_args or '(none)'}",
        file=sys.stderr,
    )
    if args.peak or args.device == "cuda":
        print(
            f"# MFU: FLOPs/token = 6 x matmul params + 12 x layers x seq x d_model; peak "
            f"{f'{args.peak:g} TFLOP/s' if args.peak else 'unknown'} ({args.peak_source})"
            f"{'; plain Burn runs fp32 (no mixed precision)' if args.plain_burn and args.precision == 'bf16' else ''}",
            file=sys.stderr,
        )
    load = os.getloadavg()[0]
    if args.device == "cpu" and load > 0.5 * (os.cpu_count() or 1):
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
            # plain_burn_gpt is one device: layout 1 only.
            sides += ["plain"] if args.plain_burn and layout == "1" else []
            for rep in range(args.repeats):
                for side in sides:
                    if side == "torch":
                        r, info = run_torch(args, shape, layout, rep)
                        torch_info[(name, layout)] = info
                    else:
                        r = run_ours(
                            args, shape, layout, side == "ours-tcp", rep, config_path, plain=side == "plain"
                        )
                    runs.append(r)
                    m = mfu(args, shape, r.tokens_per_sec)
                    print(
                        f"  {name:8} {layout} rank(s) {side:8} round {rep + 1}: "
                        f"{r.tokens_per_sec:8.0f} tok/s{f'  MFU {fmt_mfu(m)}' if m is not None else ''}  "
                        f"(wall {r.wall_s:5.1f} s, load {r.load_before:.2f}->{r.load_after:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )
                    if rep == 0 and side == sides[-1]:
                        same = [x for x in runs if x.shape == name and x.layout == layout]
                        ours = next(x for x in same if x.side == "ours")
                        plain = next((x for x in same if x.side == "plain"), None)
                        check_params(shape, ours, next(x for x in same if x.side == "torch"), plain)

    # ---- summary ----
    summary = {}
    for name in shapes:
        for layout in layouts:
            for side in ("ours", "ours-tcp", "torch", "plain"):
                vals = [r.tokens_per_sec for r in runs if (r.shape, r.layout, r.side) == (name, layout, side)]
                if vals:
                    summary[(name, layout, side)] = summarise(vals)
                    summary[(name, layout, side)]["mfu"] = mfu(args, SHAPES[name], statistics.median(vals))

    def label(layout, side):
        if layout == "1":
            return "1 process" if args.device == "cpu" else "1 GPU"
        return {"ours": "2 ranks (threads)", "ours-tcp": "2 ranks (tcp, burnrun)", "torch": "2 ranks"}[side]

    # MFU columns with a peak, plain Burn's with --plain-burn; otherwise the CPU table as before.
    show_mfu = args.peak is not None
    show_plain = args.plain_burn

    def cell(stats: dict | None) -> list[str]:
        if stats is None:
            return ["–"] + (["–"] if show_mfu else [])
        return [fmt_range(stats)] + ([fmt_mfu(stats["mfu"])] if show_mfu else [])

    plain_label = "plain Burn tok/s median (min–max)" + (" (fp32)" if args.precision == "bf16" else "")
    header = ["shape", "layout", "`gpt` tok/s median (min–max)"] + (["`gpt` MFU"] if show_mfu else [])
    header += [f"PyTorch {args.torch_version} tok/s median (min–max)"] + (["PyTorch MFU"] if show_mfu else [])
    header += ["ours / torch"]
    if show_plain:
        header += [plain_label] + (["plain Burn MFU"] if show_mfu else []) + ["ours / plain Burn"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in shapes:
        s = SHAPES[name]
        desc = f"{name} (L{s.layers} d{s.d_model} h{s.heads} T{s.seq_len} B{s.batch}, {s.num_params() / 1e6:.2f}M)"
        for layout in layouts:
            t = summary[(name, layout, "torch")]
            for side in ("ours", "ours-tcp"):
                o = summary.get((name, layout, side))
                if o is None:
                    continue
                row = [desc, label(layout, side)] + cell(o) + cell(t) + [f"{o['median'] / t['median']:.2f}×"]
                if show_plain:
                    pb = summary.get((name, layout, "plain"))
                    row += cell(pb) + [f"{o['median'] / pb['median']:.2f}×" if pb else "–"]
                lines.append("| " + " | ".join(row) + " |")
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
                    "device": args.device,
                    "device_name": args.device_name,
                    "precision": args.precision,
                    "peak_tflops": args.peak,
                    "peak_source": args.peak_source,
                    "flops_per_token": {n: SHAPES[n].flops_per_token() for n in shapes},
                    "plain_burn": args.plain_binary if args.plain_burn else None,
                    "runs": [asdict(r) for r in runs],
                    "summary": [
                        {"shape": k[0], "layout": k[1], "side": k[2], **v} for k, v in summary.items()
                    ],
                    "ratio_ours_over_torch": {
                        f"{n}/{l}/{side}": summary[(n, l, side)]["median"] / summary[(n, l, "torch")]["median"]
                        for (n, l, side) in summary
                        if side not in ("torch", "plain")
                    },
                    "ratio_plain_over_torch": {
                        f"{n}/{l}": summary[(n, l, "plain")]["median"] / summary[(n, l, "torch")]["median"]
                        for (n, l, side) in summary
                        if side == "plain"
                    },
                    "ratio_ours_over_plain": {
                        f"{n}/{l}": summary[(n, l, "ours")]["median"] / summary[(n, l, "plain")]["median"]
                        for (n, l, side) in summary
                        if side == "plain"
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
