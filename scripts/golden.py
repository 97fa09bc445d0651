#!/usr/bin/env python3
"""Golden trajectories: the GPT trained by an independent implementation (PyTorch).

Every parity test of this repository compares a parallel layout with our own model on one
device, so a bug in the model or a fused kernel would be invisible to all of them. This script
is the check from outside: a GPT-2 and a LLaMA written here from the `transformers` checkpoint
semantics (not from our Rust code), trained in fp32 with `torch.optim.AdamW` on the batches our
data loader draws, 20 steps. `tests/tests/golden.rs` (no PyTorch needed) imports the initial
weights through our Hugging Face importer, trains single-device and compares.

For the GPT-2 and the LLaMA, each `tests/golden/<arch>/` gets:
  config.json           the `transformers` config our importer reads
  model.safetensors     the initial weights (names and layouts of `transformers`)
  trajectory.json       the hyper-parameters, the losses, the gradient norms, the learning rates
  final.safetensors     the weights after the last step
from `tests/golden/batches.safetensors` (inputs/targets, int64 [steps, batch, seq]), written by
`cargo test -p tests --test golden -- --ignored write_golden_batches`. The third,
`tests/golden/byo/`, is the bring-your-own-model decoder (examples/examples/byo_model): its
initial weights and batches come from `cargo test -p tests --test byo_parity -- --ignored
write_golden_byo_inputs`, and the script adds trajectory.json and final.safetensors.

Usage: python3 scripts/golden.py [tests/golden]   (needs torch, safetensors, numpy)
"""

import json
import math
import os
import sys

import torch
from safetensors.torch import load_file, save_file

# Training, the same for both architectures (read back by the Rust test from trajectory.json).
HYPER = {
    "lr": 3e-3,
    "warmup_steps": 5,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.01,
    "betas": [0.9, 0.999],
    "eps": 1e-5,
    "max_grad_norm": 1.0,
}

VOCAB, LAYERS, HEADS, WIDTH, SEQ = 256, 2, 2, 32, 16

CONFIGS = {
    "gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": VOCAB,
        "n_positions": SEQ,
        "n_embd": WIDTH,
        "n_layer": LAYERS,
        "n_head": HEADS,
        "n_inner": 4 * WIDTH,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
        "torch_dtype": "float32",
    },
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": WIDTH,
        "intermediate_size": 3 * WIDTH,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": SEQ,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    },
}


def lr_at(step, steps):
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it."""
    lr, warmup, floor = HYPER["lr"], HYPER["warmup_steps"], HYPER["min_lr_ratio"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def init_weights(arch, cfg, gen):
    """Random initial weights, biases and norm gains included (so that a bias or a gain that our
    import or model mishandles changes the losses)."""

    def normal(*shape, std=0.02, mean=0.0):
        return torch.randn(*shape, generator=gen) * std + mean

    w = {}
    d, layers = WIDTH, LAYERS
    proj_std = 0.02 / math.sqrt(2 * layers)
    if arch == "gpt2":
        f = cfg["n_inner"]
        w["wte.weight"] = normal(VOCAB, d)
        w["wpe.weight"] = normal(SEQ, d, std=0.01)
        for i in range(layers):
            h = f"h.{i}"
            for ln in ("ln_1", "ln_2"):
                w[f"{h}.{ln}.weight"] = normal(d, std=0.1, mean=1.0)
                w[f"{h}.{ln}.bias"] = normal(d)
            # transformers' Conv1D stores [in, out].
            w[f"{h}.attn.c_attn.weight"] = normal(d, 3 * d)
            w[f"{h}.attn.c_attn.bias"] = normal(3 * d)
            w[f"{h}.attn.c_proj.weight"] = normal(d, d, std=proj_std)
            w[f"{h}.attn.c_proj.bias"] = normal(d)
            w[f"{h}.mlp.c_fc.weight"] = normal(d, f)
            w[f"{h}.mlp.c_fc.bias"] = normal(f)
            w[f"{h}.mlp.c_proj.weight"] = normal(f, d, std=proj_std)
            w[f"{h}.mlp.c_proj.bias"] = normal(d)
        w["ln_f.weight"] = normal(d, std=0.1, mean=1.0)
        w["ln_f.bias"] = normal(d)
    else:
        f = cfg["intermediate_size"]
        w["model.embed_tokens.weight"] = normal(VOCAB, d)
        for i in range(layers):
            h = f"model.layers.{i}"
            w[f"{h}.input_layernorm.weight"] = normal(d, std=0.1, mean=1.0)
            w[f"{h}.post_attention_layernorm.weight"] = normal(d, std=0.1, mean=1.0)
            # nn.Linear stores [out, in].
            for x in ("q", "k", "v"):
                w[f"{h}.self_attn.{x}_proj.weight"] = normal(d, d)
            w[f"{h}.self_attn.o_proj.weight"] = normal(d, d, std=proj_std)
            w[f"{h}.mlp.gate_proj.weight"] = normal(f, d)
            w[f"{h}.mlp.up_proj.weight"] = normal(f, d)
            w[f"{h}.mlp.down_proj.weight"] = normal(d, f, std=proj_std)
        w["model.norm.weight"] = normal(d, std=0.1, mean=1.0)
        w["lm_head.weight"] = normal(VOCAB, d)
    return w


def causal_attention(q, k, v):
    """q, k, v: [batch, heads, seq, head_dim]; softmax(q k^T / sqrt(head_dim) + causal) v."""
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_heads(x):
    b, s, _ = x.shape
    return x.view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)


def merge_heads(x):
    b, _, s, _ = x.shape
    return x.transpose(1, 2).reshape(b, s, WIDTH)


def gpt2_logits(w, cfg, tokens):
    eps = cfg["layer_norm_epsilon"]

    def ln(x, name):
        return torch.nn.functional.layer_norm(x, (WIDTH,), w[f"{name}.weight"], w[f"{name}.bias"], eps)

    def gelu_tanh(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))

    s = tokens.shape[1]
    x = w["wte.weight"][tokens] + w["wpe.weight"][:s]
    for i in range(LAYERS):
        h = f"h.{i}"
        qkv = ln(x, f"{h}.ln_1") @ w[f"{h}.attn.c_attn.weight"] + w[f"{h}.attn.c_attn.bias"]
        q, k, v = qkv.split(WIDTH, dim=-1)
        a = merge_heads(causal_attention(split_heads(q), split_heads(k), split_heads(v)))
        x = x + a @ w[f"{h}.attn.c_proj.weight"] + w[f"{h}.attn.c_proj.bias"]
        m = gelu_tanh(ln(x, f"{h}.ln_2") @ w[f"{h}.mlp.c_fc.weight"] + w[f"{h}.mlp.c_fc.bias"])
        x = x + m @ w[f"{h}.mlp.c_proj.weight"] + w[f"{h}.mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].t()


def llama_logits(w, cfg, tokens):
    eps = cfg["rms_norm_eps"]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    s = tokens.shape[1]
    hd = WIDTH // HEADS
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):
        return x * cos + rotate_half(x) * sin

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        h = f"model.layers.{i}"
        a = rms(x, f"{h}.input_layernorm.weight")
        q, k, v = (split_heads(a @ w[f"{h}.self_attn.{p}_proj.weight"].t()) for p in "qkv")
        o = merge_heads(causal_attention(rope(q), rope(k), v))
        x = x + o @ w[f"{h}.self_attn.o_proj.weight"].t()
        m = rms(x, f"{h}.post_attention_layernorm.weight")
        g = torch.nn.functional.silu(m @ w[f"{h}.mlp.gate_proj.weight"].t())
        u = m @ w[f"{h}.mlp.up_proj.weight"].t()
        x = x + (g * u) @ w[f"{h}.mlp.down_proj.weight"].t()
    return rms(x, "model.norm.weight") @ w["lm_head.weight"].t()


def byo_logits(w, heads, tokens):
    """The bring-your-own-model decoder (examples/examples/byo_model/model.rs): RMSNorm
    (eps 1e-5), causal attention without positions, SwiGLU, untied head, no biases; linear
    weights stored [d_in, d_out] as Burn keeps them."""

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w[name]

    x = w["embed.weight"][tokens]
    b, s, d = x.shape
    hd = d // heads
    layers = sorted({int(k.split(".")[1]) for k in w if k.startswith("layers.")})

    def split(t):
        return t.view(b, s, heads, hd).transpose(1, 2)

    for i in layers:
        p = f"layers.{i}"
        a = rms(x, f"{p}.norm1.weight")
        q, k, v = (split(a @ w[f"{p}.attn.{n}.weight"]) for n in "qkv")
        o = causal_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + o @ w[f"{p}.attn.o.weight"]
        m = rms(x, f"{p}.norm2.weight")
        g = torch.nn.functional.silu(m @ w[f"{p}.mlp.gate.weight"])
        x = x + (g * (m @ w[f"{p}.mlp.up.weight"])) @ w[f"{p}.mlp.down.weight"]
    return rms(x, "norm.weight") @ w["head.weight"]


def adamw(params, lr):
    return torch.optim.AdamW(
        params.values(),
        lr=lr,
        betas=tuple(HYPER["betas"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )


def train_byo(out_dir):
    """The decoder from the initial weights and batches that `byo_parity`'s
    write_golden_byo_inputs wrote: constant learning rate 3e-3, as its tests train."""
    lr = 3e-3
    initial = load_file(os.path.join(out_dir, "model.safetensors"))
    batches = load_file(os.path.join(out_dir, "batches.safetensors"))
    inputs, targets = batches["inputs"], batches["targets"]
    losses, grad_norms, params = fit(
        "byo", initial, lambda w, tokens: byo_logits(w, 4, tokens), inputs, targets, lambda _: lr
    )
    save_file({k: v.detach().contiguous() for k, v in params.items()}, os.path.join(out_dir, "final.safetensors"))
    fields = {"arch": "byo", "steps": inputs.shape[0], "lrs": [lr] * inputs.shape[0], **HYPER, "lr": lr}
    write_trajectory(out_dir, fields, losses, grad_norms)


def fit(name, initial, logits_of, inputs, targets, lr_of):
    """Trains `initial` (a dict of tensors) for `inputs.shape[0]` steps: mean token
    cross-entropy of `logits_of(weights, tokens)`, global-norm clipping, AdamW at `lr_of(step)`.
    Returns the losses, the gradient norms before clipping and the trained weights."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in initial.items()}
    optim = adamw(params, lr_of(0))
    losses, grad_norms = [], []
    for step in range(inputs.shape[0]):
        lr = lr_of(step)
        for group in optim.param_groups:
            group["lr"] = lr
        optim.zero_grad()
        logits = logits_of(params, inputs[step])
        vocab = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets[step].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params.values(), HYPER["max_grad_norm"])
        optim.step()
        losses.append(loss.item())
        grad_norms.append(norm.item())
        print(f"{name} step {step:2d} loss {loss.item():.6f} grad norm {norm.item():.4f} lr {lr:.2e}")
    return losses, grad_norms, params


def write_trajectory(out_dir, fields, losses, grad_norms):
    trajectory = {
        "implementation": f"scripts/golden.py, torch {torch.__version__}, float32, CPU",
        **fields,
        "losses": losses,
        "grad_norms": grad_norms,
    }
    with open(os.path.join(out_dir, "trajectory.json"), "w") as f:
        json.dump(trajectory, f, indent=2)
        f.write("\n")


def train(arch, out_dir, seed, inputs, targets):
    cfg = CONFIGS[arch]
    os.makedirs(out_dir, exist_ok=True)
    steps = inputs.shape[0]

    gen = torch.Generator().manual_seed(seed)
    initial = init_weights(arch, cfg, gen)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in initial.items()}, os.path.join(out_dir, "model.safetensors"))

    logits_of = gpt2_logits if arch == "gpt2" else llama_logits
    lrs = [lr_at(step, steps) for step in range(steps)]
    losses, grad_norms, params = fit(
        arch, initial, lambda w, tokens: logits_of(w, cfg, tokens), inputs, targets, lambda step: lrs[step]
    )
    save_file({k: v.detach().contiguous() for k, v in params.items()}, os.path.join(out_dir, "final.safetensors"))
    fields = {
        "arch": arch,
        "seed": seed,
        "steps": steps,
        "batch_size": inputs.shape[1],
        "seq_len": inputs.shape[2],
        **HYPER,
        "lrs": lrs,
    }
    write_trajectory(out_dir, fields, losses, grad_norms)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/golden"
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    batches = load_file(os.path.join(root, "batches.safetensors"))
    for seed, arch in enumerate(CONFIGS):
        train(arch, os.path.join(root, arch), seed, batches["inputs"], batches["targets"])
    train_byo(os.path.join(root, "byo"))


if __name__ == "__main__":
    main()
