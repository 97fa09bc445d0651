//! The GPT of `gpt --ranks 1`, trained with plain Burn: `burn::nn` layers, Burn's attention,
//! Burn's cross-entropy, Burn's AdamW and `GradientsParams`, and nothing of burn-parallel in
//! the model or the optimizer. It is the baseline of "zero overhead over plain Burn": at one
//! rank, a step of our trainer must cost no more than this one.
//!
//! ```text
//! cargo build --release --workspace --bin gpt --example plain_burn_gpt
//! target/release/examples/plain_burn_gpt --steps 30            # plain Burn, Flex
//! target/release/gpt --ranks 1 --steps 30                        # burn-parallel, one rank
//! plain_burn_gpt --device cuda --layers 12 --d-model 768 --heads 12 --seq-len 1024 --batch-size 8
//! ```
//!
//! The model is the one of `examples/src/gpt.rs` with the defaults of `GptConfig::new` (and of
//! `scripts/vs_torch.py`'s PyTorch model): byte vocabulary (256), learned positions (a table of
//! `max(64, seq_len)` rows, as `gpt` raises its 64 to `--seq-len`), pre-norm blocks
//! `x + attn(ln_1(x))`, `x + mlp(ln_2(x))`, LayerNorm (eps 1e-5), separate `q`, `k`, `v`, `o`
//! projections, causal attention (`burn::tensor::module::attention`; `--attention composed`:
//! matmul, mask, softmax, matmul), exact (erf) GELU, `d_ff = 4 d_model`, biases everywhere,
//! final LayerNorm, untied `lm_head`, mean cross-entropy. Weights are drawn from
//! Normal(0, 0.02) (the residual projections `o` and `mlp.down` from Normal(0, 0.02 /
//! sqrt(2 layers))), biases and norm shifts are zeros, norm scales ones: the same
//! distributions as `gpt`, drawn by Burn's generator (so the losses are close to, not equal
//! to, `gpt`'s). The parameter count is checked against `GptConfig::num_params`.
//!
//! The training step is `gpt`'s: the same batches (`Corpus::batch_rows`, the bundled King
//! James Bible), AdamW with Burn's defaults and `TrainConfig`'s weight decay, the learning
//! rate of `TrainConfig::lr_at` (linear warm-up, cosine decay to 10 %), the loss read every
//! step. The final line has the form of `gpt`'s (`final train loss L, S s/step, N tokens/s`,
//! the first step not timed), so scripts parse both the same way.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use clap::{Parser, ValueEnum};
use examples::data::{Corpus, Split};
use examples::train::{TrainConfig, TrainDevice};

/// Standard deviation of the GPT-2 initialisation.
const INIT_STD: f64 = 0.02;

/// How the attention scores are computed.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum AttentionKind {
    /// `burn::tensor::module::attention` with `is_causal` (under autodiff, Burn's composed
    /// fallback).
    Burn,
    /// Written out: `softmax(mask(q k^T / sqrt(head_dim))) v`.
    Composed,
}

/// Train the `gpt` trainer's GPT with plain Burn (no burn-parallel), for comparison with
/// `gpt --ranks 1`.
#[derive(Debug, Parser)]
#[command(about)]
struct Args {
    /// Folder of the data files (`kjv.txt.gz`); default: $BURN_PARALLEL_DATA_DIR, else the
    /// bundled examples/data.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Transformer layers (default: `TrainConfig::default()`'s).
    #[arg(long)]
    layers: Option<usize>,
    /// Model width (the MLP is 4 times wider).
    #[arg(long)]
    d_model: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Tokens per sequence.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Sequences per step.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Seed of Burn's generator (the weights).
    #[arg(long)]
    seed: Option<u64>,
    /// The device (wgpu needs a build with `--features examples/wgpu`, cuda one with
    /// `--features examples/cuda`: device LOCAL_RANK or 0).
    #[arg(long, value_enum, default_value = "flex")]
    device: TrainDevice,
    /// How the attention is computed.
    #[arg(long, value_enum, default_value = "burn")]
    attention: AttentionKind,
    /// Print a line every N steps (and the last).
    #[arg(long, default_value_t = 10)]
    log_every: usize,
}

/// The command-line spelling of a flag's value (`flex`, `composed`, ...).
fn value_name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

/// A linear layer with weights from Normal(0, `std`) and a zero bias.
fn linear(d_input: usize, d_output: usize, std: f64, device: &Device) -> Linear {
    let mut layer = LinearConfig::new(d_input, d_output)
        .with_initializer(Initializer::Normal { mean: 0.0, std })
        .init(device);
    layer.bias = Some(Initializer::Zeros.init([d_output], device));
    layer
}

/// The causal mask: `true` where key `j` lies after query `i`.
fn causal_mask(seq_len: usize, device: &Device) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..seq_len)
        .flat_map(|i| (0..seq_len).map(move |j| j > i))
        .collect();
    Tensor::from_data(TensorData::new(values, [seq_len, seq_len]), device)
}

#[derive(Module, Debug)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    #[module(skip)]
    n_heads: usize,
    #[module(skip)]
    kind: AttentionKind,
}

impl Attention {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, d] = x.dims();
        let (h, hd) = (self.n_heads, d / self.n_heads);
        let heads = |t: Tensor<3>| t.reshape([b, s, h, hd]).swap_dims(1, 2);
        let q = heads(self.q.forward(x.clone()));
        let k = heads(self.k.forward(x.clone()));
        let v = heads(self.v.forward(x));
        let y = match self.kind {
            AttentionKind::Burn => {
                let options = AttentionModuleOptions {
                    is_causal: true,
                    ..Default::default()
                };
                attention(q, k, v, None, None, options)
            }
            AttentionKind::Composed => {
                let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
                let mask = causal_mask(s, &scores.device())
                    .reshape([1, 1, s, s])
                    .expand([b, h, s, s]);
                softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(v)
            }
        };
        self.o.forward(y.swap_dims(1, 2).reshape([b, s, d]))
    }
}

#[derive(Module, Debug)]
struct Mlp {
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.down.forward(gelu(self.up.forward(x)))
    }
}

#[derive(Module, Debug)]
struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x));
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

#[derive(Module, Debug)]
struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
}

/// The shape of the model.
#[derive(Debug, Clone, Copy)]
struct Shape {
    vocab: usize,
    layers: usize,
    heads: usize,
    d_model: usize,
    d_ff: usize,
    positions: usize,
    norm_eps: f64,
}

impl Gpt {
    fn new(c: Shape, attention: AttentionKind, device: &Device) -> Self {
        let d = c.d_model;
        let residual_std = INIT_STD / (2.0 * c.layers as f64).sqrt();
        let embedding = |n: usize| {
            EmbeddingConfig::new(n, d)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: INIT_STD,
                })
                .init(device)
        };
        let norm = || {
            LayerNormConfig::new(d)
                .with_epsilon(c.norm_eps)
                .init(device)
        };
        let blocks = (0..c.layers)
            .map(|_| Block {
                ln_1: norm(),
                attn: Attention {
                    q: linear(d, d, INIT_STD, device),
                    k: linear(d, d, INIT_STD, device),
                    v: linear(d, d, INIT_STD, device),
                    o: linear(d, d, residual_std, device),
                    n_heads: c.heads,
                    kind: attention,
                },
                ln_2: norm(),
                mlp: Mlp {
                    up: linear(d, c.d_ff, INIT_STD, device),
                    down: linear(c.d_ff, d, residual_std, device),
                },
            })
            .collect();
        Self {
            wte: embedding(c.vocab),
            wpe: embedding(c.positions),
            blocks,
            ln_f: norm(),
            lm_head: linear(d, c.vocab, INIT_STD, device),
        }
    }

    /// Logits `[batch, seq, vocab]` of `tokens` `[batch, seq]`.
    fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [_, s] = tokens.dims();
        let positions = Tensor::<1, Int>::arange(0..s as i64, &tokens.device()).reshape([1, s]);
        let mut x = self.wte.forward(tokens) + self.wpe.forward(positions);
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.lm_head.forward(self.ln_f.forward(x))
    }

    /// Mean cross-entropy of the next-token predictions.
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        ce: &CrossEntropyLoss,
    ) -> Tensor<1> {
        let logits = self.forward(inputs);
        let [b, s, v] = logits.dims();
        ce.forward(logits.reshape([b * s, v]), targets.reshape([b * s]))
    }
}

/// `TrainConfig::default()` with the flags applied (as the `gpt` binary applies them).
fn config_from(args: &Args) -> TrainConfig {
    let mut c = TrainConfig::default();
    if let Some(v) = args.layers {
        c.model.n_layers = v;
    }
    if let Some(v) = args.heads {
        c.model.n_heads = v;
    }
    if let Some(d) = args.d_model {
        c.model.d_model = d;
        c.model.d_ff = 4 * d;
    }
    if let Some(v) = args.seq_len {
        c.seq_len = v;
    }
    if let Some(v) = args.batch_size {
        c.batch_size = v;
    }
    if let Some(v) = args.steps {
        c.steps = v;
    }
    if let Some(v) = args.lr {
        c.lr = v;
    }
    if let Some(v) = args.seed {
        c.model.seed = v;
    }
    c.model.max_seq_len = c.model.max_seq_len.max(c.seq_len);
    c
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = config_from(&args);
    if let Err(e) = config.validate(1) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let device = match args.device.device() {
        Ok(device) => device.autodiff(),
        Err(e) => {
            eprintln!(
                "error: cannot open --device {}: {e}",
                value_name(args.device)
            );
            return ExitCode::from(2);
        }
    };
    let corpus = match Corpus::load_from(args.data_dir.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };

    let m = &config.model;
    let shape = Shape {
        vocab: m.vocab_size,
        layers: m.n_layers,
        heads: m.n_heads,
        d_model: m.d_model,
        d_ff: m.d_ff,
        positions: m.max_seq_len,
        norm_eps: m.norm_eps,
    };
    device.seed(m.seed);
    let mut model = Gpt::new(shape, args.attention, &device);
    let params = model.num_params();
    if params != m.num_params() {
        eprintln!(
            "error: the plain Burn model has {params} parameters, GptConfig::num_params gives {}: \
             the models differ",
            m.num_params()
        );
        return ExitCode::FAILURE;
    }
    let ce = CrossEntropyLossConfig::new().init(&device);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(config.weight_decay as f32)
        .init();
    println!(
        "plain Burn GPT {} layers x {} heads x width {} ({:.2}M params), 1 device ({}), \
         attention: {}, global batch {} x {} tokens, {} steps",
        m.n_layers,
        m.n_heads,
        m.d_model,
        params as f64 / 1e6,
        value_name(args.device),
        value_name(args.attention),
        config.batch_size,
        config.seq_len,
        config.steps
    );

    let tokens_per_step = (config.batch_size * config.seq_len) as f64;
    let start = Instant::now();
    let (mut timed_seconds, mut timed_steps, mut last_loss) = (0.0, 0usize, f64::NAN);
    for step in 0..config.steps {
        let step_start = Instant::now();
        let batch = corpus.batch_rows(
            step as u64,
            0..config.batch_size,
            config.seq_len,
            Split::Train,
        );
        let (inputs, targets) = batch.to_tensors(&device);
        let loss = model.loss(inputs, targets, &ce);
        // Read every step, as the `gpt` trainer reads its loss after the forward pass.
        last_loss = f64::from(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let lr = config.lr_at(step);
        model = optim.step(lr, model, grads);
        let seconds = step_start.elapsed().as_secs_f64();
        if step > 0 {
            timed_seconds += seconds;
            timed_steps += 1;
        }
        if step.is_multiple_of(args.log_every.max(1)) || step + 1 == config.steps {
            println!(
                "step {step:>5}  loss {last_loss:.4}  lr {lr:.2e}  {:>7.0} tok/s  {:>7.1}s",
                tokens_per_step / seconds,
                start.elapsed().as_secs_f64()
            );
        }
    }
    let (step_seconds, tokens_per_sec) = match timed_steps {
        0 => (0.0, 0.0),
        n => {
            let s = timed_seconds / n as f64;
            (s, tokens_per_step / s)
        }
    };
    println!(
        "final train loss {last_loss:.4}, {step_seconds:.3} s/step, {tokens_per_sec:.0} tokens/s"
    );
    ExitCode::SUCCESS
}
