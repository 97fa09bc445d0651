//! Hugging Face interop: tiny random GPT-2 and LLaMA checkpoints written here in the
//! `transformers` safetensors layout (no network), imported into the examples GPT, checked
//! against an independent plain-f32 implementation computed from the file's arrays, exported
//! and imported again; typed errors on bad checkpoints; the tokenizer round trip; training that
//! starts from an imported checkpoint under several layouts.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::CheckpointError;
use burn_parallel::diloco::DiLoCoConfig;
use burn_parallel_train::DiLoCoLayout;
use burn_parallel_train::named_params;
use burn_zero::Stage;
use examples::data::{Corpus, Split};
use examples::gpt::{GeluKind, MlpKind, NormKind, PositionKind};
use examples::hf::{self, HfArch, HfConfig, HfError};
use examples::pipeline::train_gpt_pipeline;
use examples::train::{Parallelism, TrainConfig, train_gpt};
use examples::train_diloco::train_gpt_diloco;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// SplitMix64 then Box-Muller: a fixed-seed normal stream.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    fn tensor(&mut self, shape: &[usize], mean: f32, std: f32) -> (Vec<usize>, Vec<f32>) {
        let n = shape.iter().product();
        let values = (0..n).map(|_| mean + std * self.normal()).collect();
        (shape.to_vec(), values)
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hf-interop-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_file(path: &Path, tensors: &Tensors) {
    let bytes: Vec<(&String, &Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(k, (s, v))| (k, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes.iter().map(|(k, s, b)| {
        (
            k.as_str(),
            TensorView::new(Dtype::F32, s.to_vec(), b).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn write_checkpoint(dir: &Path, config: &Value, tensors: &Tensors) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    write_file(&dir.join("model.safetensors"), tensors);
}

fn read_file(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.iter()
        .map(|(k, v)| {
            assert_eq!(v.dtype(), Dtype::F32, "{k}");
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (k.to_string(), (v.shape().to_vec(), values))
        })
        .collect()
}

// ---------------------------------------------------------------- tiny checkpoints

// 256: the bundled corpus's byte tokens fit (the fine-tuning test trains on it).
const VOCAB: usize = 256;
const D: usize = 16;
const HEADS: usize = 2;
const LAYERS: usize = 2;
const CTX: usize = 12;

fn gpt2_config() -> Value {
    json!({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": VOCAB, "n_positions": CTX, "n_embd": D, "n_layer": LAYERS,
        "n_head": HEADS, "n_inner": null, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 0
    })
}

/// A random GPT-2 checkpoint, names with `prefix`; with the causal-mask buffers old
/// checkpoints carry when `masks`.
fn gpt2_tensors(seed: u64, prefix: &str, masks: bool) -> Tensors {
    let mut rng = Rng(seed);
    let mut t = Tensors::new();
    let mut add = |name: String, value| {
        t.insert(format!("{prefix}{name}"), value);
    };
    add("wte.weight".into(), rng.tensor(&[VOCAB, D], 0.0, 0.3));
    add("wpe.weight".into(), rng.tensor(&[CTX, D], 0.0, 0.1));
    for i in 0..LAYERS {
        for ln in ["ln_1", "ln_2"] {
            add(format!("h.{i}.{ln}.weight"), rng.tensor(&[D], 1.0, 0.1));
            add(format!("h.{i}.{ln}.bias"), rng.tensor(&[D], 0.0, 0.1));
        }
        add(
            format!("h.{i}.attn.c_attn.weight"),
            rng.tensor(&[D, 3 * D], 0.0, 0.3),
        );
        add(
            format!("h.{i}.attn.c_attn.bias"),
            rng.tensor(&[3 * D], 0.0, 0.1),
        );
        add(
            format!("h.{i}.attn.c_proj.weight"),
            rng.tensor(&[D, D], 0.0, 0.2),
        );
        add(
            format!("h.{i}.attn.c_proj.bias"),
            rng.tensor(&[D], 0.0, 0.1),
        );
        add(
            format!("h.{i}.mlp.c_fc.weight"),
            rng.tensor(&[D, 4 * D], 0.0, 0.3),
        );
        add(
            format!("h.{i}.mlp.c_fc.bias"),
            rng.tensor(&[4 * D], 0.0, 0.1),
        );
        add(
            format!("h.{i}.mlp.c_proj.weight"),
            rng.tensor(&[4 * D, D], 0.0, 0.2),
        );
        add(format!("h.{i}.mlp.c_proj.bias"), rng.tensor(&[D], 0.0, 0.1));
        if masks {
            let mask: Vec<f32> = (0..CTX * CTX)
                .map(|k| f32::from(u8::from(k % CTX <= k / CTX)))
                .collect();
            add(format!("h.{i}.attn.bias"), (vec![1, 1, CTX, CTX], mask));
            add(format!("h.{i}.attn.masked_bias"), (vec![], vec![-1e4]));
        }
    }
    add("ln_f.weight".into(), rng.tensor(&[D], 1.0, 0.1));
    add("ln_f.bias".into(), rng.tensor(&[D], 0.0, 0.1));
    t
}

const FF: usize = 40;

fn llama_config(tied: bool) -> Value {
    json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": D, "intermediate_size": FF,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "max_position_embeddings": CTX, "rms_norm_eps": 1e-6, "rope_theta": 500.0,
        "hidden_act": "silu", "tie_word_embeddings": tied, "rope_scaling": null,
        "attention_bias": false, "bos_token_id": 1, "eos_token_id": 2
    })
}

fn llama_tensors(seed: u64, tied: bool) -> Tensors {
    let mut rng = Rng(seed);
    let mut t = Tensors::new();
    t.insert(
        "model.embed_tokens.weight".into(),
        rng.tensor(&[VOCAB, D], 0.0, 0.5),
    );
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        t.insert(
            format!("{p}.input_layernorm.weight"),
            rng.tensor(&[D], 1.0, 0.1),
        );
        for x in ["q", "k", "v", "o"] {
            t.insert(
                format!("{p}.self_attn.{x}_proj.weight"),
                rng.tensor(&[D, D], 0.0, 0.3),
            );
        }
        t.insert(
            format!("{p}.post_attention_layernorm.weight"),
            rng.tensor(&[D], 1.0, 0.1),
        );
        t.insert(
            format!("{p}.mlp.gate_proj.weight"),
            rng.tensor(&[FF, D], 0.0, 0.3),
        );
        t.insert(
            format!("{p}.mlp.up_proj.weight"),
            rng.tensor(&[FF, D], 0.0, 0.3),
        );
        t.insert(
            format!("{p}.mlp.down_proj.weight"),
            rng.tensor(&[D, FF], 0.0, 0.2),
        );
    }
    t.insert("model.norm.weight".into(), rng.tensor(&[D], 1.0, 0.1));
    if !tied {
        t.insert("lm_head.weight".into(), rng.tensor(&[VOCAB, D], 0.0, 0.3));
    }
    t
}

// ---------------------------------------------------------------- the plain reference

fn get<'a>(t: &'a Tensors, name: &str) -> &'a [f32] {
    &t.get(name).unwrap_or_else(|| panic!("{name}")).1
}

/// `x [n] @ w [n, m]` (Conv1D) plus `b`.
fn conv1d(x: &[f32], w: &[f32], b: Option<&[f32]>, m: usize) -> Vec<f32> {
    (0..m)
        .map(|j| {
            let s: f32 = x.iter().enumerate().map(|(i, xi)| xi * w[i * m + j]).sum();
            s + b.map_or(0.0, |b| b[j])
        })
        .collect()
}

/// `w [m, n] . x [n]` (nn.Linear, no bias).
fn linear(x: &[f32], w: &[f32], m: usize) -> Vec<f32> {
    let n = x.len();
    (0..m)
        .map(|o| (0..n).map(|i| w[o * n + i] * x[i]).sum())
        .collect()
}

fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    x.iter()
        .enumerate()
        .map(|(i, v)| (v - mean) * inv * w[i] + b[i])
        .collect()
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| w * (v * inv)).collect()
}

fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Causal multi-head attention over `q`, `k`, `v` (`[t][d]`), heads of `hs` columns.
fn attention(q: &[Vec<f32>], k: &[Vec<f32>], v: &[Vec<f32>], hs: usize) -> Vec<Vec<f32>> {
    let t = q.len();
    let d = q[0].len();
    let mut out = vec![vec![0.0f32; d]; t];
    for h in 0..d / hs {
        let cols = h * hs..(h + 1) * hs;
        for i in 0..t {
            let scores: Vec<f32> = (0..=i)
                .map(|j| cols.clone().map(|c| q[i][c] * k[j][c]).sum::<f32>() / (hs as f32).sqrt())
                .collect();
            let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f32 = e.iter().sum();
            for c in cols.clone() {
                out[i][c] = (0..=i).map(|j| e[j] / z * v[j][c]).sum();
            }
        }
    }
    out
}

fn add_into(x: &mut [Vec<f32>], y: &[Vec<f32>]) {
    for (a, b) in x.iter_mut().zip(y) {
        for (p, q) in a.iter_mut().zip(b) {
            *p += q;
        }
    }
}

/// GPT-2's logits `[t][vocab]`, straight from the checkpoint's arrays.
fn gpt2_reference(t: &Tensors, prefix: &str, tokens: &[usize]) -> Vec<Vec<f32>> {
    let g = |n: &str| get(t, &format!("{prefix}{n}"));
    let (wte, wpe) = (g("wte.weight"), g("wpe.weight"));
    let eps = 1e-5;
    let mut x: Vec<Vec<f32>> = tokens
        .iter()
        .enumerate()
        .map(|(p, &tok)| (0..D).map(|c| wte[tok * D + c] + wpe[p * D + c]).collect())
        .collect();
    for i in 0..LAYERS {
        let l = |n: &str| g(&format!("h.{i}.{n}"));
        let h: Vec<Vec<f32>> = x
            .iter()
            .map(|r| layer_norm(r, l("ln_1.weight"), l("ln_1.bias"), eps))
            .collect();
        let qkv: Vec<Vec<f32>> = h
            .iter()
            .map(|r| {
                conv1d(
                    r,
                    l("attn.c_attn.weight"),
                    Some(l("attn.c_attn.bias")),
                    3 * D,
                )
            })
            .collect();
        let part = |k: usize| -> Vec<Vec<f32>> {
            qkv.iter().map(|r| r[k * D..(k + 1) * D].to_vec()).collect()
        };
        let a = attention(&part(0), &part(1), &part(2), D / HEADS);
        let a: Vec<Vec<f32>> = a
            .iter()
            .map(|r| conv1d(r, l("attn.c_proj.weight"), Some(l("attn.c_proj.bias")), D))
            .collect();
        add_into(&mut x, &a);
        let m: Vec<Vec<f32>> = x
            .iter()
            .map(|r| {
                let h = layer_norm(r, l("ln_2.weight"), l("ln_2.bias"), eps);
                let f: Vec<f32> = conv1d(&h, l("mlp.c_fc.weight"), Some(l("mlp.c_fc.bias")), 4 * D)
                    .into_iter()
                    .map(gelu_tanh)
                    .collect();
                conv1d(&f, l("mlp.c_proj.weight"), Some(l("mlp.c_proj.bias")), D)
            })
            .collect();
        add_into(&mut x, &m);
    }
    x.iter()
        .map(|r| {
            let h = layer_norm(r, g("ln_f.weight"), g("ln_f.bias"), eps);
            linear(&h, wte, VOCAB)
        })
        .collect()
}

/// `transformers`' rotary embedding: `x cos + rotate_half(x) sin`, with the frequencies
/// repeated over both halves.
fn hf_rope(x: &[f32], pos: usize, hs: usize, theta: f64) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for h in 0..x.len() / hs {
        let head = &x[h * hs..(h + 1) * hs];
        let rotate_half: Vec<f32> = (0..hs)
            .map(|c| {
                if c < hs / 2 {
                    -head[c + hs / 2]
                } else {
                    head[c - hs / 2]
                }
            })
            .collect();
        for c in 0..hs {
            let inv_freq = 1.0 / theta.powf((2 * (c % (hs / 2))) as f64 / hs as f64);
            let angle = pos as f64 * inv_freq;
            out[h * hs + c] = head[c] * angle.cos() as f32 + rotate_half[c] * angle.sin() as f32;
        }
    }
    out
}

/// LLaMA's logits `[t][vocab]`, straight from the checkpoint's arrays.
fn llama_reference(t: &Tensors, tied: bool, tokens: &[usize]) -> Vec<Vec<f32>> {
    let g = |n: &str| get(t, n);
    let (eps, theta, hs) = (1e-6, 500.0, D / HEADS);
    let embed = g("model.embed_tokens.weight");
    let mut x: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&tok| embed[tok * D..(tok + 1) * D].to_vec())
        .collect();
    for i in 0..LAYERS {
        let l = |n: &str| g(&format!("model.layers.{i}.{n}"));
        let h: Vec<Vec<f32>> = x
            .iter()
            .map(|r| rms_norm(r, l("input_layernorm.weight"), eps))
            .collect();
        let proj = |name: &str, rope: bool| -> Vec<Vec<f32>> {
            h.iter()
                .enumerate()
                .map(|(p, r)| {
                    let y = linear(r, l(&format!("self_attn.{name}_proj.weight")), D);
                    if rope { hf_rope(&y, p, hs, theta) } else { y }
                })
                .collect()
        };
        let a = attention(&proj("q", true), &proj("k", true), &proj("v", false), hs);
        let a: Vec<Vec<f32>> = a
            .iter()
            .map(|r| linear(r, l("self_attn.o_proj.weight"), D))
            .collect();
        add_into(&mut x, &a);
        let m: Vec<Vec<f32>> = x
            .iter()
            .map(|r| {
                let h = rms_norm(r, l("post_attention_layernorm.weight"), eps);
                let gate = linear(&h, l("mlp.gate_proj.weight"), FF);
                let up = linear(&h, l("mlp.up_proj.weight"), FF);
                let f: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
                linear(&f, l("mlp.down_proj.weight"), D)
            })
            .collect();
        add_into(&mut x, &m);
    }
    let head = if tied { embed } else { g("lm_head.weight") };
    x.iter()
        .map(|r| linear(&rms_norm(r, g("model.norm.weight"), eps), head, VOCAB))
        .collect()
}

// ---------------------------------------------------------------- helpers on the model

const TOKENS: [usize; 10] = [3, 17, 0, 36, 5, 5, 21, 9, 30, 12];

fn logits(model: &examples::gpt::Gpt, tokens: &[usize]) -> Vec<Vec<f32>> {
    let device = Device::flex();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, tokens.len()]), &device);
    let out = model.forward(input).unwrap();
    let values = out
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap();
    values.chunks(VOCAB).map(<[f32]>::to_vec).collect()
}

fn assert_close(ours: &[Vec<f32>], reference: &[Vec<f32>], what: &str) {
    let mut max = 0.0f32;
    for (a, b) in ours.iter().zip(reference) {
        for (x, y) in a.iter().zip(b) {
            max = max.max((x - y).abs());
        }
    }
    let spread = reference
        .iter()
        .flatten()
        .fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(
        spread > 0.5,
        "{what}: logits too small to test anything ({spread})"
    );
    assert!(max < 1e-4, "{what}: max |ours - reference| = {max}");
}

/// Mean next-token cross-entropy of reference logits.
fn reference_loss(logits: &[Vec<f32>], tokens: &[usize]) -> f64 {
    let n = tokens.len() - 1;
    let mut sum = 0.0f64;
    for (row, &target) in logits[..n].iter().zip(&tokens[1..]) {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        sum += lse - row[target] as f64;
    }
    sum / n as f64
}

fn host(t: &Tensors) -> BTreeMap<String, TensorData> {
    t.iter()
        .map(|(k, (s, v))| (k.clone(), TensorData::new(v.clone(), s.clone())))
        .collect()
}

fn import_err(config: &Value, tensors: &Tensors) -> HfError {
    let config = match HfConfig::from_json(config) {
        Ok(c) => c,
        Err(e) => return e,
    };
    match hf::import_tensors(&config, host(tensors), &Device::flex()) {
        Ok(_) => panic!("imported a bad checkpoint"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------- GPT-2

#[test]
fn gpt2_config_maps_onto_the_gpt() {
    let config = HfConfig::from_json(&gpt2_config()).unwrap();
    let m = &config.model;
    assert_eq!(config.arch, HfArch::Gpt2);
    assert_eq!(
        (
            m.vocab_size,
            m.n_layers,
            m.n_heads,
            m.d_model,
            m.d_ff,
            m.max_seq_len
        ),
        (VOCAB, LAYERS, HEADS, D, 4 * D, CTX)
    );
    assert_eq!(
        (m.mlp, m.gelu, m.norm),
        (MlpKind::Gelu, GeluKind::Tanh, NormKind::LayerNorm)
    );
    assert_eq!(m.positions, PositionKind::Learned);
    assert!(m.tied_embeddings && m.bias && m.dropout == 0.0);
    // config.json written back reads as the same configuration.
    assert_eq!(HfConfig::from_json(&config.to_json()).unwrap(), config);
}

#[test]
fn gpt2_logits_match_the_plain_reference() {
    for (prefix, masks) in [("", true), ("transformer.", false)] {
        let tensors = gpt2_tensors(11, prefix, masks);
        let dir = temp_dir(&format!("gpt2-ref-{}", prefix.len()));
        write_checkpoint(&dir, &gpt2_config(), &tensors);
        let (_, model) = hf::import(&dir, &Device::flex()).unwrap();
        let reference = gpt2_reference(&tensors, prefix, &TOKENS);
        assert_close(&logits(&model, &TOKENS), &reference, "gpt2");
        // The loss the evaluation helper reports is the reference's, over two windows.
        let tokens: Vec<u32> = TOKENS.iter().map(|&t| t as u32).collect();
        let eval = hf::evaluate(&model, &tokens, CTX).unwrap();
        assert_eq!(eval.tokens, TOKENS.len() - 1);
        let expected = reference_loss(&reference, &TOKENS);
        assert!(
            (eval.loss - expected).abs() < 1e-5,
            "{} vs {expected}",
            eval.loss
        );
        let split = hf::evaluate(&model, &tokens, 4).unwrap();
        assert_eq!(split.tokens, TOKENS.len() - 1);
        assert!(
            (split.loss - expected).abs() > 1e-4,
            "shorter windows see less context"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn gpt2_import_export_import_is_identical() {
    let tensors = gpt2_tensors(12, "", true);
    let dir = temp_dir("gpt2-rt-a");
    write_checkpoint(&dir, &gpt2_config(), &tensors);
    let (config, first) = hf::import(&dir, &Device::flex()).unwrap();
    let out = temp_dir("gpt2-rt-b");
    hf::export(&first, HfArch::Gpt2, &out).unwrap();
    // The exported file holds every weight of the original, bit for bit, under the
    // `transformer.` prefix (the masks are buffers, not weights).
    let exported = read_file(&out.join("model.safetensors"));
    let weights: Tensors = tensors
        .iter()
        .filter(|(k, _)| !k.ends_with(".attn.bias") && !k.ends_with(".attn.masked_bias"))
        .map(|(k, v)| (format!("transformer.{k}"), v.clone()))
        .collect();
    assert_eq!(
        exported.keys().collect::<Vec<_>>(),
        weights.keys().collect::<Vec<_>>()
    );
    for (k, v) in &weights {
        assert!(exported[k] == *v, "{k} differs");
    }
    let (config2, second) = hf::import(&out, &Device::flex()).unwrap();
    assert_eq!(config2, config);
    assert_eq!(named_params(&first), named_params(&second));
    // And a second export is the same file's tensors again.
    let again = temp_dir("gpt2-rt-c");
    hf::export(&second, HfArch::Gpt2, &again).unwrap();
    assert_eq!(read_file(&again.join("model.safetensors")), exported);
    for d in [dir, out, again] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

// ---------------------------------------------------------------- LLaMA

#[test]
fn llama_logits_match_the_plain_reference() {
    for tied in [false, true] {
        let tensors = llama_tensors(21 + u64::from(tied), tied);
        let dir = temp_dir(&format!("llama-ref-{tied}"));
        write_checkpoint(&dir, &llama_config(tied), &tensors);
        let (config, model) = hf::import(&dir, &Device::flex()).unwrap();
        let m = &config.model;
        assert_eq!(
            (m.mlp, m.norm, m.positions),
            (MlpKind::SwiGlu, NormKind::RmsNorm, PositionKind::Rotary)
        );
        assert_eq!(
            (m.d_ff, m.rope_theta, m.norm_eps, m.bias),
            (FF, 500.0, 1e-6, false)
        );
        assert_eq!(m.tied_embeddings, tied);
        let reference = llama_reference(&tensors, tied, &TOKENS);
        assert_close(
            &logits(&model, &TOKENS),
            &reference,
            &format!("llama tied={tied}"),
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn llama_import_export_import_is_identical() {
    for tied in [false, true] {
        let tensors = llama_tensors(31, tied);
        let dir = temp_dir(&format!("llama-rt-a-{tied}"));
        write_checkpoint(&dir, &llama_config(tied), &tensors);
        let (config, first) = hf::import(&dir, &Device::flex()).unwrap();
        let out = temp_dir(&format!("llama-rt-b-{tied}"));
        hf::export(&first, HfArch::Llama, &out).unwrap();
        assert_eq!(read_file(&out.join("model.safetensors")), tensors);
        let (config2, second) = hf::import(&out, &Device::flex()).unwrap();
        assert_eq!(config2, config);
        assert_eq!(named_params(&first), named_params(&second));
        for d in [dir, out] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}

#[test]
fn sharded_checkpoint_with_index_imports() {
    let tensors = llama_tensors(41, false);
    let dir = temp_dir("llama-sharded");
    std::fs::write(dir.join("config.json"), llama_config(false).to_string()).unwrap();
    let (mut a, mut b) = (Tensors::new(), Tensors::new());
    let mut map = serde_json::Map::new();
    for (i, (k, v)) in tensors.iter().enumerate() {
        let (part, file) = if i % 2 == 0 {
            (&mut a, "model-00001-of-00002.safetensors")
        } else {
            (&mut b, "model-00002-of-00002.safetensors")
        };
        part.insert(k.clone(), v.clone());
        map.insert(k.clone(), json!(file));
    }
    write_file(&dir.join("model-00001-of-00002.safetensors"), &a);
    write_file(&dir.join("model-00002-of-00002.safetensors"), &b);
    let index = json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let (_, model) = hf::import(&dir, &Device::flex()).unwrap();
    assert_close(
        &logits(&model, &TOKENS),
        &llama_reference(&tensors, false, &TOKENS),
        "sharded",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn half_precision_weights_are_converted() {
    let mut tensors = gpt2_tensors(51, "", false);
    let dir = temp_dir("gpt2-bf16");
    std::fs::write(dir.join("config.json"), gpt2_config().to_string()).unwrap();
    // wte in bf16: its values as the file holds them are the truncated ones.
    let (shape, values) = tensors["wte.weight"].clone();
    let bf: Vec<u8> = values
        .iter()
        .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
        .collect();
    let rounded: Vec<f32> = values
        .iter()
        .map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000))
        .collect();
    tensors.insert("wte.weight".into(), (shape.clone(), rounded));
    let f32_bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .filter(|(k, _)| *k != "wte.weight")
        .map(|(k, (s, v))| {
            (
                k.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let mut views: Vec<(&str, TensorView)> = f32_bytes
        .iter()
        .map(|(k, s, b)| {
            (
                k.as_str(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    views.push((
        "wte.weight",
        TensorView::new(Dtype::BF16, shape, &bf).unwrap(),
    ));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let (_, model) = hf::import(&dir, &Device::flex()).unwrap();
    assert_close(
        &logits(&model, &TOKENS),
        &gpt2_reference(&tensors, "", &TOKENS),
        "bf16 wte",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- bad input

#[test]
fn missing_and_unexpected_tensors_are_listed_with_shapes() {
    let mut tensors = gpt2_tensors(61, "", false);
    tensors.remove("h.1.mlp.c_fc.bias");
    tensors.remove("ln_f.weight");
    tensors.insert("h.1.mlp.extra.weight".into(), (vec![2, 3], vec![0.0; 6]));
    let err = import_err(&gpt2_config(), &tensors);
    let HfError::Checkpoint(CheckpointError::Unmapped {
        missing,
        unexpected,
    }) = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        missing,
        &vec![
            ("h.1.mlp.c_fc.bias".to_string(), vec![4 * D]),
            ("ln_f.weight".to_string(), vec![D])
        ]
    );
    assert_eq!(
        unexpected,
        &vec![("h.1.mlp.extra.weight".to_string(), vec![2, 3])]
    );
    let text = err.to_string();
    assert!(text.contains("`h.1.mlp.c_fc.bias` [64]"), "{text}");
    assert!(
        text.contains("1 unexpected: `h.1.mlp.extra.weight` [2, 3]"),
        "{text}"
    );
    // A layer too many (a checkpoint of a deeper model) is unexpected tensors.
    let mut deeper = llama_tensors(62, false);
    deeper.insert(
        "model.layers.2.input_layernorm.weight".into(),
        (vec![D], vec![1.0; D]),
    );
    let err = import_err(&llama_config(false), &deeper);
    assert!(
        matches!(&err, HfError::Checkpoint(CheckpointError::Unmapped { missing, unexpected }) if missing.is_empty() && unexpected.len() == 1),
        "{err}"
    );
}

#[test]
fn a_shape_mismatch_names_the_tensor() {
    let mut tensors = gpt2_tensors(71, "transformer.", false);
    tensors.insert(
        "transformer.h.0.attn.c_attn.weight".into(),
        (vec![3 * D, D], vec![0.0; 3 * D * D]),
    );
    let err = import_err(&gpt2_config(), &tensors);
    match &err {
        HfError::Checkpoint(CheckpointError::Shape {
            tensor,
            expected,
            found,
        }) => {
            assert_eq!(tensor, "h.0.attn.c_attn.weight");
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[D, 3 * D][..], &[3 * D, D][..])
            );
        }
        other => panic!("{other}"),
    }
    // A config of another width: the first tensor is named.
    let mut wider = gpt2_config();
    wider["n_embd"] = json!(32);
    let err = import_err(&wider, &gpt2_tensors(72, "", false));
    assert!(
        matches!(&err, HfError::Checkpoint(CheckpointError::Shape { tensor, .. }) if tensor == "wte.weight"),
        "{err}"
    );
}

#[test]
fn unsupported_config_values_are_refused_by_name() {
    let cases: Vec<(Value, &str)> = vec![
        (
            {
                let mut c = llama_config(false);
                c["num_key_value_heads"] = json!(1);
                c
            },
            "num_key_value_heads",
        ),
        (
            {
                let mut c = llama_config(false);
                c["hidden_act"] = json!("gelu");
                c
            },
            "hidden_act",
        ),
        (
            {
                let mut c = llama_config(false);
                c["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
                c
            },
            "rope_scaling",
        ),
        (
            {
                let mut c = llama_config(false);
                c["attention_bias"] = json!(true);
                c
            },
            "attention_bias",
        ),
        (
            {
                let mut c = gpt2_config();
                c["activation_function"] = json!("relu");
                c
            },
            "activation_function",
        ),
        (
            {
                let mut c = gpt2_config();
                c["scale_attn_by_inverse_layer_idx"] = json!(true);
                c
            },
            "scale_attn_by_inverse_layer_idx",
        ),
        (
            {
                let mut c = gpt2_config();
                c["tie_word_embeddings"] = json!(false);
                c
            },
            "tie_word_embeddings",
        ),
        (
            {
                let mut c = gpt2_config();
                c["n_head"] = json!(3);
                c
            },
            "(sizes)",
        ),
        (
            {
                let mut c = gpt2_config();
                c["model_type"] = json!("bert");
                c
            },
            "model_type",
        ),
    ];
    for (config, name) in cases {
        match HfConfig::from_json(&config) {
            Err(HfError::Unsupported { field, .. }) => assert_eq!(field, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    // The newer `rope_parameters` form: its theta is read, a scaled rope type refused.
    let mut newer = llama_config(false);
    newer.as_object_mut().unwrap().remove("rope_theta");
    newer["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 250.0});
    assert_eq!(HfConfig::from_json(&newer).unwrap().model.rope_theta, 250.0);
    newer["rope_parameters"]["rope_type"] = json!("llama3");
    match HfConfig::from_json(&newer) {
        Err(HfError::Unsupported { field, .. }) => assert_eq!(field, "rope_parameters.rope_type"),
        other => panic!("{other:?}"),
    }
    let gqa = HfConfig::from_json(&{
        let mut c = llama_config(false);
        c["num_key_value_heads"] = json!(1);
        c
    })
    .unwrap_err()
    .to_string();
    assert!(
        gqa.contains("grouped-query attention is not supported"),
        "{gqa}"
    );
    let mut no_width = gpt2_config();
    no_width.as_object_mut().unwrap().remove("n_embd");
    assert!(
        matches!(HfConfig::from_json(&no_width), Err(HfError::MissingField { field, .. }) if field == "n_embd")
    );
}

#[test]
fn a_tied_head_that_differs_and_integer_weights_are_errors() {
    let mut tensors = gpt2_tensors(81, "", false);
    let mut head = tensors["wte.weight"].clone();
    head.1[0] += 1.0;
    tensors.insert("lm_head.weight".into(), head);
    assert!(matches!(
        import_err(&gpt2_config(), &tensors),
        HfError::Checkpoint(CheckpointError::Tied { .. })
    ));
    // The same head equal to the embedding is accepted.
    let mut tensors = gpt2_tensors(81, "", false);
    tensors.insert("lm_head.weight".into(), tensors["wte.weight"].clone());
    let config = HfConfig::from_json(&gpt2_config()).unwrap();
    hf::import_tensors(&config, host(&tensors), &Device::flex()).unwrap();

    let dir = temp_dir("int-weights");
    std::fs::write(dir.join("config.json"), gpt2_config().to_string()).unwrap();
    let ints = vec![0u8; 8 * 4];
    let view = TensorView::new(Dtype::I64, vec![4], &ints).unwrap();
    safetensors::serialize_to_file([("wte.weight", view)], None, &dir.join("model.safetensors"))
        .unwrap();
    match hf::import(&dir, &Device::flex()) {
        Err(HfError::Checkpoint(CheckpointError::Dtype { tensor, .. })) => {
            assert_eq!(tensor, "wte.weight")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    std::fs::write(dir.join("model.safetensors"), b"not a safetensors file").unwrap();
    assert!(matches!(
        hf::import(&dir, &Device::flex()),
        Err(HfError::Checkpoint(CheckpointError::Corrupt { .. }))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(
        hf::import(&dir, &Device::flex()),
        Err(HfError::Io { .. })
    ));
}

#[test]
fn models_without_an_hf_equivalent_are_not_exported() {
    let device = Device::flex();
    let config = HfConfig::from_json(&gpt2_config()).unwrap().model;
    let untied = examples::gpt::Gpt::new(
        &examples::gpt::GptConfig {
            tied_embeddings: false,
            ..config.clone()
        },
        &device,
    );
    let dir = temp_dir("not-exportable");
    for (model, arch) in [
        (&untied, HfArch::Gpt2),
        (&examples::gpt::Gpt::new(&config, &device), HfArch::Llama),
    ] {
        match hf::export(model, arch, &dir) {
            Err(HfError::NotExportable { arch: a, .. }) => assert_eq!(a, arch),
            other => panic!("{other:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- tokenizer

/// GPT-2's reversible map from bytes to printable characters.
#[cfg(feature = "hf-tokenizer")]
fn bytes_to_unicode() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// A byte-level BPE `tokenizer.json`: the 256 byte symbols, a few merges and one special token.
#[cfg(feature = "hf-tokenizer")]
fn tiny_tokenizer_json() -> (Value, BTreeMap<String, u32>) {
    let symbols = bytes_to_unicode();
    let mut vocab: BTreeMap<String, u32> = BTreeMap::new();
    for (i, c) in symbols.iter().enumerate() {
        vocab.insert(c.to_string(), i as u32);
    }
    let space = symbols[b' ' as usize];
    let merges = [
        ("h".to_string(), "e".to_string()),
        (format!("{space}"), "t".to_string()),
        (format!("{space}t"), "he".to_string()),
        ("i".to_string(), "n".to_string()),
        (format!("{space}"), "in".to_string()),
    ];
    for (a, b) in &merges {
        let id = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), id);
    }
    let eot = vocab.len() as u32;
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": vocab, "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    });
    (json, vocab)
}

#[cfg(feature = "hf-tokenizer")]
#[test]
fn byte_level_bpe_round_trips_text() {
    let (json, vocab) = tiny_tokenizer_json();
    let dir = temp_dir("tokenizer");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let tokenizer = hf::Tokenizer::from_file(&path).unwrap();
    assert_eq!(tokenizer.vocab_size(), 256 + 5 + 1);
    let text = "In the beginning the heaven and\tthe earth, in ünïcode 🦀 too.\n";
    let ids = tokenizer.encode(text).unwrap();
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    // The merges apply: " the" is one token (twice; the one after the tab has no space),
    // "the" after the tab is "t" + "he", " in" one token, and fewer ids than bytes.
    let the = vocab["Ġthe"];
    assert_eq!(ids.iter().filter(|&&i| i == the).count(), 2, "{ids:?}");
    let tab = vocab[&bytes_to_unicode()[b'\t' as usize].to_string()];
    let after_tab = ids.iter().position(|&i| i == tab).unwrap();
    assert_eq!(ids[after_tab + 1..after_tab + 3], [vocab["t"], vocab["he"]]);
    assert!(ids.contains(&vocab["Ġin"]));
    assert!(ids.len() < text.len());
    assert!(ids.iter().all(|&i| (i as usize) < tokenizer.vocab_size()));
    // The special token decodes as itself; an id outside the vocabulary is an error or dropped,
    // never a panic.
    assert_eq!(tokenizer.decode(&[256 + 5]).unwrap(), "<|endoftext|>");
    let _ = tokenizer.decode(&[100_000]);
    std::fs::write(&path, "{\"model\": 3}").unwrap();
    assert!(matches!(
        hf::Tokenizer::from_file(&path),
        Err(HfError::Tokenizer(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run that starts from a GPT-2 checkpoint (`gpt --init-from-hf`), under any layout: its
/// first loss is the loss of the first batch computed by the plain reference from the file's
/// arrays, and dp 2 × tp 2, FSDP 2 × tp 2, pp 2 × tp 2 and pp 2 × dp 2 with ZeRO-1 follow the
/// single-device run (losses and final parameters within 1e-5), and DiLoCo's islands start
/// from it. A checkpoint of another shape is refused with the tensors named.
#[test]
fn training_starts_from_an_imported_gpt2_under_any_layout() {
    let tensors = gpt2_tensors(5, "transformer.", false);
    let dir = temp_dir("gpt2-finetune");
    write_checkpoint(&dir, &gpt2_config(), &tensors);
    let hf_config = HfConfig::from_dir(&dir).unwrap();
    let mut config = tests::tiny_gpt_run(4);
    config.model = hf::with_run_settings(&hf_config.model, &config.model);
    config.seq_len = CTX;
    config.batch_size = 4;
    config.init_from_hf = Some(dir.clone());
    let corpus = Corpus::load_default().expect("the bundled corpus");
    let run = |world: usize, parallel: Parallelism| {
        let reports = burn_parallel_train::run_local(world, |g| {
            train_gpt(&g, &config, &parallel, &corpus, &mut |_| {})
        })
        .unwrap_or_else(|e| panic!("{parallel:?}: {e}"));
        tests::rank0_if_ranks_agree(reports, |r| (&r.losses, &r.final_params))
    };
    let single = run(1, Parallelism::default());

    // The first loss, from the file's arrays by the plain reference, row by row.
    let batch = corpus.batch_rows(0, 0..config.batch_size, config.seq_len, Split::Train);
    let mut first = 0.0;
    for r in 0..batch.batch_size {
        let row = |v: &[i64]| -> Vec<usize> {
            v[r * CTX..(r + 1) * CTX]
                .iter()
                .map(|&t| t as usize)
                .collect()
        };
        let (inputs, targets) = (row(&batch.inputs), row(&batch.targets));
        let logits = gpt2_reference(&tensors, "transformer.", &inputs);
        // `reference_loss` scores token t + 1 of its input: give it the window shifted by one.
        let mut shifted = vec![inputs[0]];
        shifted.extend(&targets);
        first += reference_loss(&logits, &shifted);
    }
    first /= batch.batch_size as f64;
    assert!(
        (single.losses[0] - first).abs() < 1e-4,
        "first loss {} vs the reference's {first}",
        single.losses[0]
    );

    let reference = tests::Reference::of_run(single);
    for (world, parallel) in [
        (
            4,
            Parallelism {
                tp: 2,
                ..Parallelism::default()
            },
        ),
        (
            4,
            Parallelism {
                tp: 2,
                zero: Some(Stage::Three),
                ..Parallelism::default()
            },
        ),
    ] {
        let what = format!("{parallel:?}");
        let report = run(world, parallel);
        tests::assert_matches_reference(
            &reference,
            &report.losses,
            &report.final_params,
            1e-5,
            &what,
        );
    }
    // Pipelined: each stage reads its own blocks (the tied table on both end stages), at
    // pp 2 x tp 2 and at pp 2 x dp 2 with ZeRO-1, 2 micro-batches.
    let micro = TrainConfig {
        grad_accum: 2,
        ..config.clone()
    };
    for (world, pipeline) in [
        (
            4,
            Parallelism {
                pp: 2,
                tp: 2,
                ..Parallelism::default()
            },
        ),
        (
            4,
            Parallelism {
                pp: 2,
                zero: Some(Stage::One),
                ..Parallelism::default()
            },
        ),
    ] {
        let what = format!("{pipeline:?}");
        let reports = burn_parallel_train::run_local(world, |g| {
            let split = Default::default();
            train_gpt_pipeline(&g, &micro, &pipeline, &split, &corpus, &mut |_| {})
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let report =
            tests::rank0_if_ranks_agree(reports, |r| (&r.train.losses, &r.train.final_params));
        tests::assert_matches_reference(
            &reference,
            &report.train.losses,
            &report.train.final_params,
            1e-5,
            &what,
        );
    }

    // DiLoCo: both islands start from the imported weights, so the first step's loss (the
    // mean over the islands' rows of the global batch) is the single-device one.
    let run = DiLoCoLayout {
        islands: 2,
        config: DiLoCoConfig {
            inner_steps: 2,
            ..DiLoCoConfig::default()
        },
        inner_sgd: false,
    };
    let reports = burn_parallel_train::run_local(2, |g| {
        train_gpt_diloco(&g, &config, &run, &corpus, &mut |_| {})
    })
    .unwrap_or_else(|e| panic!("DiLoCo: {e}"));
    let first = reports[0].train.losses[0];
    assert!(
        (first - reference.losses[0]).abs() < 1e-5,
        "DiLoCo's first loss {first} vs {}",
        reference.losses[0]
    );

    // Another model: the tensors that do not fit are named.
    let mut wider = config.clone();
    wider.model.d_ff *= 2;
    let err = burn_parallel_train::run_local(1, |g| {
        train_gpt(&g, &wider, &Parallelism::default(), &corpus, &mut |_| {})
    })
    .map(|_| ())
    .unwrap_err()
    .to_string();
    assert!(err.contains("take the model from its config.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
