//! Hugging Face interop: GPT-2 and LLaMA checkpoints in the `transformers` safetensors layout,
//! in and out of the examples [`Gpt`], and (feature `hf-tokenizer`) their byte-level BPE
//! tokenizer.
//!
//! A checkpoint directory holds `config.json` and `model.safetensors` (or the shards listed by
//! `model.safetensors.index.json`). [`import`] reads the configuration ([`HfConfig`]), maps every
//! tensor onto the GPT's parameters and builds the model; [`export`] writes the same layout back.
//!
//! | `transformers` (GPT-2, optional `transformer.` prefix) | [`Gpt`] |
//! |---|---|
//! | `wte.weight`, `wpe.weight` | `wte.weight`, `wpe.weight` |
//! | `h.N.ln_1`, `h.N.ln_2`, `ln_f` (weight, bias) | `blocks.N.ln_1`, `blocks.N.ln_2`, `ln_f` |
//! | `h.N.attn.c_attn` (Conv1D `[d, 3d]`, fused q, k, v) | `blocks.N.attn.{q,k,v}` (`[d, d]` each) |
//! | `h.N.attn.c_proj`, `h.N.mlp.c_fc`, `h.N.mlp.c_proj` | `blocks.N.attn.o`, `blocks.N.mlp.up`, `blocks.N.mlp.down` |
//! | `lm_head.weight` (tied: absent or equal to `wte`) | tied head |
//!
//! GPT-2's Conv1D stores its weight `[in, out]`, Burn's layout: those are copied as they are.
//! LLaMA's `nn.Linear` weights are `[out, in]` and are transposed:
//!
//! | `transformers` (LLaMA) | [`Gpt`] |
//! |---|---|
//! | `model.embed_tokens.weight` | `wte.weight` |
//! | `model.layers.N.input_layernorm`, `.post_attention_layernorm` | `blocks.N.ln_1`, `blocks.N.ln_2` (RMSNorm) |
//! | `model.layers.N.self_attn.{q,k,v,o}_proj` | `blocks.N.attn.{q,k,v,o}` |
//! | `model.layers.N.mlp.{gate,up,down}_proj` | `blocks.N.mlp.{gate,up,down}` (SwiGLU) |
//! | `model.norm`, `lm_head` | `ln_f`, `lm_head` (absent when `tie_word_embeddings`) |
//!
//! The rotary embedding of the GPT is the half-split form of `transformers`' `rotate_half`
//! (frequency `theta^(-2i / head_dim)` on the pair `(i, i + head_dim / 2)`), so LLaMA's q and k
//! projections load unpermuted. Grouped-query attention (`num_key_value_heads !=
//! num_attention_heads`) is refused.
//!
//! Causal-mask buffers saved by old GPT-2 checkpoints (`h.N.attn.bias`, `h.N.attn.masked_bias`)
//! and LLaMA's `rotary_emb.inv_freq` are recognised and skipped; any other tensor the mapping
//! does not use is an error ([`HfError::Tensors`]), as is a missing one.
//!
//! ```
//! use burn::tensor::Device;
//! use examples::gpt::{Gpt, GptConfig, GeluKind};
//! use examples::hf::{self, HfArch, HfConfig};
//!
//! let device = Device::flex();
//! let model = GptConfig {
//!     tied_embeddings: true,
//!     gelu: GeluKind::Tanh,
//!     d_ff: 32,
//!     ..GptConfig::new(64, 1, 2, 8, 16)
//! };
//! let original = Gpt::new(&model, &device);
//! let dir = std::env::temp_dir().join(format!("hf-doc-{}", std::process::id()));
//! hf::export(&original, HfArch::Gpt2, &dir).unwrap();
//! let (config, imported) = hf::import(&dir, &device).unwrap();
//! assert_eq!(config, HfConfig { arch: HfArch::Gpt2, model: model.clone() });
//! let tokens = burn::tensor::Tensor::<2, burn::tensor::Int>::from_ints([[1, 2, 3]], &device);
//! let (a, b) = (original.forward(tokens.clone()).unwrap(), imported.forward(tokens).unwrap());
//! assert_eq!(a.into_data(), b.into_data());
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

use crate::gpt::{GeluKind, Gpt, GptConfig, MlpKind, NormKind, PositionKind, load_params};
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::{CheckpointError, hf as checkpoint_hf};
use burn_parallel::init::Init;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The file names of a single-file checkpoint and of a sharded checkpoint's index.
pub use burn_parallel::checkpoint::hf::{INDEX_FILE, WEIGHTS_FILE};
/// The file name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

/// Errors of reading, mapping and writing Hugging Face checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` (or the shard index) is not valid JSON.
    #[error("{path}: not valid JSON: {reason}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// A safetensors file could not be parsed.
    #[error("{path}: not a valid safetensors file: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// `config.json` lacks a field the architecture needs.
    #[error("config.json: missing field `{field}` (needed for {arch:?})")]
    MissingField {
        /// The field.
        field: String,
        /// The architecture.
        arch: HfArch,
    },
    /// A field of `config.json` has a value this importer does not support.
    #[error("config.json: unsupported `{field}` = {value}: {reason}")]
    Unsupported {
        /// The field.
        field: String,
        /// Its value, as JSON.
        value: String,
        /// Why, and what is supported.
        reason: String,
    },
    /// A tensor has an element type that is not a float.
    #[error("tensor `{tensor}` has dtype {dtype}; only F32, F16, BF16 and F64 weights import")]
    Dtype {
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// A tensor has another shape than the configuration implies.
    #[error(
        "tensor `{tensor}` has shape {found:?}, but config.json implies {expected:?} \
         (a checkpoint of another size, or the wrong config.json)"
    )]
    Shape {
        /// The tensor.
        tensor: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// Tensors the configuration needs are missing, or the file holds tensors it does not use.
    #[error("{}", tensor_list(missing, unexpected))]
    Tensors {
        /// Missing tensors, with the shapes the configuration implies.
        missing: Vec<(String, Vec<usize>)>,
        /// Tensors of the file that map to nothing, with their shapes.
        unexpected: Vec<(String, Vec<usize>)>,
    },
    /// The same tensor is stored twice (two shards, or with and without a prefix).
    #[error("tensor `{0}` is stored twice (in two shards, or with and without its prefix)")]
    Duplicate(String),
    /// A tied checkpoint's `lm_head.weight` differs from the token embedding.
    #[error(
        "`{0}` differs from the token embedding, but config.json ties them \
         (tie_word_embeddings); fix the config or drop the tensor"
    )]
    UntiedHead(String),
    /// The model cannot be written in the requested layout.
    #[error("cannot export as {arch:?}: {reason}")]
    NotExportable {
        /// The requested layout.
        arch: HfArch,
        /// Why.
        reason: String,
    },
    /// A run asked to start from a checkpoint of another model.
    #[error(
        "{dir} holds the model {saved:?}, this run has {run:?}: take the model from its \
         config.json (HfConfig::from_dir; `gpt --init-from-hf` does)"
    )]
    OtherModel {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// Its model, with the run's training-only settings.
        saved: Box<GptConfig>,
        /// The run's model.
        run: Box<GptConfig>,
    },
    /// The imported configuration does not build a GPT.
    #[error("the imported configuration does not build a GPT: {0}")]
    Model(String),
    /// The tokenizer could not be loaded, or failed on a text.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

fn tensor_list(missing: &[(String, Vec<usize>)], unexpected: &[(String, Vec<usize>)]) -> String {
    let mut s = String::from("the checkpoint does not match config.json:");
    let mut list = |what: &str, items: &[(String, Vec<usize>)]| {
        if !items.is_empty() {
            let _ = write!(s, " {} {what}:", items.len());
            for (name, shape) in items {
                let _ = write!(s, " `{name}` {shape:?},");
            }
            s.pop();
            s.push(';');
        }
    };
    list("missing", missing);
    list("unexpected", unexpected);
    s.pop();
    s
}

/// Result of this module.
pub type Result<T> = std::result::Result<T, HfError>;

/// The checkpoint layouts this module reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArch {
    /// `transformers`' `GPT2LMHeadModel` (`model_type: "gpt2"`).
    Gpt2,
    /// `transformers`' `LlamaForCausalLM` (`model_type: "llama"`), without grouped-query
    /// attention.
    Llama,
}

/// A host tensor: `f32` values in row-major order and their shape.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// The shape.
    pub shape: Vec<usize>,
    /// The values, row-major.
    pub values: Vec<f32>,
}

impl HostTensor {
    /// A tensor of `shape` holding `values`.
    ///
    /// # Panics
    /// If `values.len()` is not the product of `shape`.
    pub fn new(shape: Vec<usize>, values: Vec<f32>) -> Self {
        assert_eq!(
            values.len(),
            shape.iter().product::<usize>(),
            "HostTensor: {} values for shape {shape:?}",
            values.len()
        );
        Self { shape, values }
    }

    fn transposed(&self) -> Self {
        let [r, c] = [self.shape[0], self.shape[1]];
        let mut out = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                out[j * r + i] = self.values[i * c + j];
            }
        }
        Self::new(vec![c, r], out)
    }

    /// Concatenation of `parts` along their last axis.
    fn concat_last(parts: &[&HostTensor]) -> Self {
        let rows: usize = parts[0].shape[..parts[0].shape.len() - 1].iter().product();
        let widths: Vec<usize> = parts.iter().map(|p| *p.shape.last().unwrap()).collect();
        let mut values = Vec::with_capacity(rows * widths.iter().sum::<usize>());
        for r in 0..rows {
            for (p, w) in parts.iter().zip(&widths) {
                values.extend_from_slice(&p.values[r * w..(r + 1) * w]);
            }
        }
        let mut shape = parts[0].shape.clone();
        *shape.last_mut().unwrap() = widths.iter().sum();
        Self::new(shape, values)
    }

    /// Splits the last axis into `n` equal parts.
    fn split_last(&self, n: usize) -> Vec<Self> {
        let width = *self.shape.last().unwrap() / n;
        let rows = self.values.len() / (width * n);
        let mut shape = self.shape.clone();
        *shape.last_mut().unwrap() = width;
        (0..n)
            .map(|k| {
                let mut values = Vec::with_capacity(rows * width);
                for r in 0..rows {
                    let start = r * width * n + k * width;
                    values.extend_from_slice(&self.values[start..start + width]);
                }
                Self::new(shape.clone(), values)
            })
            .collect()
    }
}

/// A checkpoint's architecture and the [`GptConfig`] it maps onto.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The layout of the tensors.
    pub arch: HfArch,
    /// The GPT the checkpoint loads into (seed 0, no dropout).
    pub model: GptConfig,
}

fn field<'a>(json: &'a Value, name: &str, arch: HfArch) -> Result<&'a Value> {
    match json.get(name) {
        Some(v) if !v.is_null() => Ok(v),
        _ => Err(HfError::MissingField {
            field: name.into(),
            arch,
        }),
    }
}

fn unsupported(name: &str, value: &Value, reason: impl Into<String>) -> HfError {
    HfError::Unsupported {
        field: name.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn usize_field(json: &Value, name: &str, arch: HfArch) -> Result<usize> {
    let v = field(json, name, arch)?;
    v.as_u64()
        .filter(|&n| n > 0)
        .map(|n| n as usize)
        .ok_or_else(|| unsupported(name, v, "expected a positive integer"))
}

fn opt_usize(json: &Value, name: &str, arch: HfArch) -> Result<Option<usize>> {
    match json.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => usize_field(json, name, arch).map(Some),
    }
}

fn f64_or(json: &Value, name: &str, default: f64) -> Result<f64> {
    match json.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| unsupported(name, v, "expected a positive number")),
    }
}

fn bool_or(json: &Value, name: &str, default: bool) -> Result<bool> {
    match json.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| unsupported(name, v, "expected true or false")),
    }
}

/// Refuses `name` unless it is absent or equal to `supported`.
fn require_bool(json: &Value, name: &str, supported: bool, why: &str) -> Result<()> {
    if bool_or(json, name, supported)? != supported {
        return Err(unsupported(name, &json[name], why));
    }
    Ok(())
}

impl HfConfig {
    /// Reads a `transformers` `config.json` (GPT-2 or LLaMA, told apart by `model_type`).
    ///
    /// # Arguments
    /// - `json`: the parsed file.
    ///
    /// # Returns
    /// The architecture and the GPT configuration (seed 0, no dropout, exact `d_ff`).
    ///
    /// # Errors
    /// [`HfError::MissingField`] for a needed field that is absent; [`HfError::Unsupported`]
    /// for a `model_type` other than `gpt2`/`llama`, an activation other than GELU (GPT-2) or
    /// SiLU (LLaMA), grouped-query attention, rope scaling, attention biases in LLaMA, untied
    /// GPT-2 heads, or sizes the GPT cannot take (heads not dividing the width).
    ///
    /// ```
    /// use examples::gpt::GeluKind;
    /// use examples::hf::{HfArch, HfConfig};
    ///
    /// let json = serde_json::json!({
    ///     "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
    ///     "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"
    /// });
    /// let config = HfConfig::from_json(&json).unwrap();
    /// assert_eq!(config.arch, HfArch::Gpt2);
    /// assert_eq!((config.model.d_ff, config.model.gelu), (3072, GeluKind::Tanh));
    /// assert_eq!(config.model.num_params(), 124_439_808);
    /// ```
    pub fn from_json(json: &Value) -> Result<Self> {
        let model_type = json.get("model_type").cloned().unwrap_or(Value::Null);
        let config = match model_type.as_str() {
            Some("gpt2") => Self::gpt2(json)?,
            Some("llama") => Self::llama(json)?,
            _ => {
                return Err(unsupported(
                    "model_type",
                    &model_type,
                    "supported: \"gpt2\" and \"llama\"",
                ));
            }
        };
        config.model.validate().map_err(|e| HfError::Unsupported {
            field: "(sizes)".into(),
            value: format!(
                "d_model {}, heads {}",
                config.model.d_model, config.model.n_heads
            ),
            reason: e.to_string(),
        })?;
        Ok(config)
    }

    fn gpt2(json: &Value) -> Result<Self> {
        let arch = HfArch::Gpt2;
        let d = usize_field(json, "n_embd", arch)?;
        let max_seq_len = match opt_usize(json, "n_positions", arch)? {
            Some(n) => n,
            None => usize_field(json, "n_ctx", arch)?,
        };
        let act = json
            .get("activation_function")
            .cloned()
            .unwrap_or(json!("gelu_new"));
        let gelu = match act.as_str() {
            Some("gelu_new" | "gelu_pytorch_tanh") => GeluKind::Tanh,
            Some("gelu") => GeluKind::Erf,
            _ => {
                return Err(unsupported(
                    "activation_function",
                    &act,
                    "supported: \"gelu_new\", \"gelu_pytorch_tanh\" (tanh GELU) and \"gelu\" (exact)",
                ));
            }
        };
        require_bool(
            json,
            "tie_word_embeddings",
            true,
            "GPT-2's head is the token embedding; an untied GPT-2 head has no bias slot here",
        )?;
        require_bool(
            json,
            "scale_attn_weights",
            true,
            "attention is always scaled by 1/sqrt(head_dim)",
        )?;
        require_bool(
            json,
            "scale_attn_by_inverse_layer_idx",
            false,
            "per-layer attention scaling is not implemented",
        )?;
        require_bool(
            json,
            "add_cross_attention",
            false,
            "a decoder-only GPT has no cross-attention",
        )?;
        Ok(Self {
            arch,
            model: GptConfig {
                vocab_size: usize_field(json, "vocab_size", arch)?,
                n_layers: usize_field(json, "n_layer", arch)?,
                n_heads: usize_field(json, "n_head", arch)?,
                d_model: d,
                d_ff: opt_usize(json, "n_inner", arch)?.unwrap_or(4 * d),
                max_seq_len,
                mlp: MlpKind::Gelu,
                gelu,
                positions: PositionKind::Learned,
                tied_embeddings: true,
                norm: NormKind::LayerNorm,
                bias: true,
                norm_eps: f64_or(json, "layer_norm_epsilon", 1e-5)?,
                ..GptConfig::new(1, 1, 1, 1, 1)
            },
        })
    }

    fn llama(json: &Value) -> Result<Self> {
        let arch = HfArch::Llama;
        let d = usize_field(json, "hidden_size", arch)?;
        let heads = usize_field(json, "num_attention_heads", arch)?;
        if let Some(kv) = opt_usize(json, "num_key_value_heads", arch)?
            && kv != heads
        {
            return Err(unsupported(
                "num_key_value_heads",
                &json["num_key_value_heads"],
                format!(
                    "grouped-query attention is not supported: num_key_value_heads must equal \
                     num_attention_heads ({heads})"
                ),
            ));
        }
        if let Some(head_dim) = opt_usize(json, "head_dim", arch)?
            && head_dim * heads != d
        {
            return Err(unsupported(
                "head_dim",
                &json["head_dim"],
                format!("head_dim must be hidden_size / num_attention_heads = {d} / {heads}"),
            ));
        }
        let act = json.get("hidden_act").cloned().unwrap_or(json!("silu"));
        if act.as_str() != Some("silu") {
            return Err(unsupported(
                "hidden_act",
                &act,
                "supported: \"silu\" (SwiGLU)",
            ));
        }
        if let Some(v) = json.get("rope_scaling")
            && !v.is_null()
        {
            return Err(unsupported(
                "rope_scaling",
                v,
                "rope scaling is not implemented; only plain rotary (null)",
            ));
        }
        // Newer `transformers` write the rotary settings as `rope_parameters`.
        let mut rope_theta = f64_or(json, "rope_theta", 10_000.0)?;
        if let Some(params) = json.get("rope_parameters")
            && !params.is_null()
        {
            let kind = params.get("rope_type").cloned().unwrap_or(json!("default"));
            if kind.as_str() != Some("default") {
                return Err(unsupported(
                    "rope_parameters.rope_type",
                    &kind,
                    "rope scaling is not implemented; only \"default\" rotary",
                ));
            }
            rope_theta = f64_or(params, "rope_theta", rope_theta)?;
        }
        require_bool(
            json,
            "attention_bias",
            false,
            "LLaMA with attention biases is not supported",
        )?;
        require_bool(
            json,
            "mlp_bias",
            false,
            "LLaMA with MLP biases is not supported",
        )?;
        Ok(Self {
            arch,
            model: GptConfig {
                vocab_size: usize_field(json, "vocab_size", arch)?,
                n_layers: usize_field(json, "num_hidden_layers", arch)?,
                n_heads: heads,
                d_model: d,
                d_ff: usize_field(json, "intermediate_size", arch)?,
                max_seq_len: opt_usize(json, "max_position_embeddings", arch)?.unwrap_or(2048),
                mlp: MlpKind::SwiGlu,
                positions: PositionKind::Rotary,
                tied_embeddings: bool_or(json, "tie_word_embeddings", false)?,
                norm: NormKind::RmsNorm,
                bias: false,
                rope_theta,
                norm_eps: f64_or(json, "rms_norm_eps", 1e-6)?,
                ..GptConfig::new(1, 1, 1, 1, 1)
            },
        })
    }

    /// The `config.json` of this configuration, as [`export`] writes it.
    pub fn to_json(&self) -> Value {
        let m = &self.model;
        match self.arch {
            HfArch::Gpt2 => json!({
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": m.vocab_size,
                "n_positions": m.max_seq_len,
                "n_embd": m.d_model,
                "n_layer": m.n_layers,
                "n_head": m.n_heads,
                "n_inner": m.d_ff,
                "activation_function": match m.gelu {
                    GeluKind::Tanh => "gelu_new",
                    GeluKind::Erf => "gelu",
                },
                "layer_norm_epsilon": m.norm_eps,
                "tie_word_embeddings": true,
                "scale_attn_weights": true,
                "torch_dtype": "float32",
            }),
            HfArch::Llama => json!({
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": m.vocab_size,
                "hidden_size": m.d_model,
                "intermediate_size": m.d_ff,
                "num_hidden_layers": m.n_layers,
                "num_attention_heads": m.n_heads,
                "num_key_value_heads": m.n_heads,
                "max_position_embeddings": m.max_seq_len,
                "hidden_act": "silu",
                "rms_norm_eps": m.norm_eps,
                "rope_theta": m.rope_theta,
                "rope_scaling": null,
                "attention_bias": false,
                "mlp_bias": false,
                "tie_word_embeddings": m.tied_embeddings,
                "torch_dtype": "float32",
            }),
        }
    }

    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`HfError::Io`], [`HfError::Json`], and those of [`Self::from_json`].
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_json(&read_json(&dir.join(CONFIG_FILE))?)
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| HfError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| HfError::Json {
        path: path.into(),
        reason: e.to_string(),
    })
}

/// How one checkpoint tensor is made of GPT parameters.
#[derive(Clone, Debug)]
enum Source {
    /// The parameter as it is.
    Same(String),
    /// The transposed parameter (`nn.Linear`'s `[out, in]`).
    Transposed(String),
    /// The parameters concatenated along their last axis (GPT-2's fused `c_attn`).
    Fused(Vec<String>),
}

/// A tensor of the checkpoint layout: its name, its shape and where it comes from.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    source: Source,
}

/// The tensors of `config`'s checkpoint, in the layout's order (names without a prefix).
fn layout(config: &HfConfig) -> Vec<Entry> {
    let m = &config.model;
    let (d, f, v) = (m.d_model, m.d_ff, m.vocab_size);
    let mut out = Vec::new();
    let mut add = |name: String, shape: &[usize], source: Source| {
        out.push(Entry {
            name,
            shape: shape.to_vec(),
            source,
        })
    };
    let same = |s: String| Source::Same(s);
    let t = |s: String| Source::Transposed(s);
    match config.arch {
        HfArch::Gpt2 => {
            add("wte.weight".into(), &[v, d], same("wte.weight".into()));
            add(
                "wpe.weight".into(),
                &[m.max_seq_len, d],
                same("wpe.weight".into()),
            );
            for i in 0..m.n_layers {
                let (h, b) = (format!("h.{i}"), format!("blocks.{i}"));
                for ln in ["ln_1", "ln_2"] {
                    for p in ["weight", "bias"] {
                        add(format!("{h}.{ln}.{p}"), &[d], same(format!("{b}.{ln}.{p}")));
                    }
                }
                let qkv = |p: &str| {
                    Source::Fused(
                        ["q", "k", "v"]
                            .map(|x| format!("{b}.attn.{x}.{p}"))
                            .to_vec(),
                    )
                };
                add(
                    format!("{h}.attn.c_attn.weight"),
                    &[d, 3 * d],
                    qkv("weight"),
                );
                add(format!("{h}.attn.c_attn.bias"), &[3 * d], qkv("bias"));
                for (hf, ours, shape) in [
                    ("attn.c_proj", "attn.o", [d, d]),
                    ("mlp.c_fc", "mlp.up", [d, f]),
                    ("mlp.c_proj", "mlp.down", [f, d]),
                ] {
                    add(
                        format!("{h}.{hf}.weight"),
                        &shape,
                        same(format!("{b}.{ours}.weight")),
                    );
                    add(
                        format!("{h}.{hf}.bias"),
                        &shape[1..],
                        same(format!("{b}.{ours}.bias")),
                    );
                }
            }
            for p in ["weight", "bias"] {
                add(format!("ln_f.{p}"), &[d], same(format!("ln_f.{p}")));
            }
        }
        HfArch::Llama => {
            add(
                "model.embed_tokens.weight".into(),
                &[v, d],
                same("wte.weight".into()),
            );
            for i in 0..m.n_layers {
                let (h, b) = (format!("model.layers.{i}"), format!("blocks.{i}"));
                add(
                    format!("{h}.input_layernorm.weight"),
                    &[d],
                    same(format!("{b}.ln_1.weight")),
                );
                for x in ["q", "k", "v", "o"] {
                    add(
                        format!("{h}.self_attn.{x}_proj.weight"),
                        &[d, d],
                        t(format!("{b}.attn.{x}.weight")),
                    );
                }
                add(
                    format!("{h}.post_attention_layernorm.weight"),
                    &[d],
                    same(format!("{b}.ln_2.weight")),
                );
                for (x, shape) in [("gate", [f, d]), ("up", [f, d]), ("down", [d, f])] {
                    add(
                        format!("{h}.mlp.{x}_proj.weight"),
                        &shape,
                        t(format!("{b}.mlp.{x}.weight")),
                    );
                }
            }
            add("model.norm.weight".into(), &[d], same("ln_f.weight".into()));
            if !m.tied_embeddings {
                add("lm_head.weight".into(), &[v, d], t("lm_head.weight".into()));
            }
        }
    }
    out
}

/// Whether `name` is a buffer that `transformers` may have saved and that carries no weight:
/// GPT-2's causal masks and LLaMA's rotary frequencies.
fn is_skipped_buffer(arch: HfArch, name: &str) -> bool {
    let layer_tail = |prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.split_once('.'))
            .filter(|(i, _)| i.parse::<usize>().is_ok())
            .map(|(_, tail)| tail)
    };
    match arch {
        HfArch::Gpt2 => matches!(layer_tail("h."), Some("attn.bias" | "attn.masked_bias")),
        HfArch::Llama => layer_tail("model.layers.") == Some("self_attn.rotary_emb.inv_freq"),
    }
}

/// The name of the head's weight in both layouts (never prefixed).
const HEAD: &str = "lm_head.weight";

/// Maps checkpoint tensors (as in the file, GPT-2's with or without the `transformer.` prefix)
/// onto the GPT's parameter paths.
///
/// # Errors
/// [`HfError::Tensors`] listing every missing and unexpected tensor with its shape;
/// [`HfError::Shape`] naming the first tensor of the wrong shape; [`HfError::Duplicate`];
/// [`HfError::UntiedHead`].
pub fn to_gpt_params(
    config: &HfConfig,
    tensors: BTreeMap<String, HostTensor>,
) -> Result<BTreeMap<String, HostTensor>> {
    let mut by_name: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (name, tensor) in tensors {
        let name = match config.arch {
            HfArch::Gpt2 => name
                .strip_prefix("transformer.")
                .map(str::to_string)
                .unwrap_or(name),
            HfArch::Llama => name,
        };
        if by_name.contains_key(&name) {
            return Err(HfError::Duplicate(name));
        }
        by_name.insert(name, tensor);
    }
    let mut params = BTreeMap::new();
    let mut missing = Vec::new();
    for entry in layout(config) {
        let Some(tensor) = by_name.remove(&entry.name) else {
            missing.push((entry.name, entry.shape));
            continue;
        };
        if tensor.shape != entry.shape {
            return Err(HfError::Shape {
                tensor: entry.name,
                expected: entry.shape,
                found: tensor.shape,
            });
        }
        match entry.source {
            Source::Same(p) => {
                params.insert(p, tensor);
            }
            Source::Transposed(p) => {
                params.insert(p, tensor.transposed());
            }
            Source::Fused(ps) => {
                for (p, part) in ps.iter().zip(tensor.split_last(ps.len())) {
                    params.insert(p.clone(), part);
                }
            }
        }
    }
    // A tied head saved anyway must be the embedding.
    if config.model.tied_embeddings
        && let Some(head) = by_name.remove(HEAD)
        && let Some(wte) = params.get("wte.weight")
        && head != *wte
    {
        return Err(HfError::UntiedHead(HEAD.into()));
    }
    let unexpected: Vec<(String, Vec<usize>)> = by_name
        .into_iter()
        .filter(|(name, _)| !is_skipped_buffer(config.arch, name))
        .map(|(name, t)| (name, t.shape))
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        return Err(HfError::Tensors {
            missing,
            unexpected,
        });
    }
    Ok(params)
}

/// Every float parameter of `module` by module path, on the host.
pub fn host_params<M: Module>(module: &M) -> BTreeMap<String, HostTensor> {
    let params = burn_parallel_train::named_params(module).into_iter();
    params
        .map(|p| (p.path, HostTensor::new(p.shape, p.values)))
        .collect()
}

/// The shape of every float parameter of `module` by module path (no data read back).
fn param_shapes<M: Module>(module: &M) -> BTreeMap<String, Vec<usize>> {
    let index = burn_parallel::index::ParamIndex::of(module);
    let entries = index.entries().iter();
    entries.map(|e| (e.path.clone(), e.shape.clone())).collect()
}

/// Builds the GPT of `config` on `device` from checkpoint tensors.
///
/// # Arguments
/// - `config`: the checkpoint's configuration ([`HfConfig::from_json`]).
/// - `tensors`: the checkpoint's tensors by name ([`read_safetensors`]).
/// - `device`: where the model lives (`device.autodiff()` to fine-tune it).
///
/// # Returns
/// The single-device GPT holding exactly the checkpoint's weights.
///
/// # Errors
/// Those of [`to_gpt_params`]; [`HfError::Model`] when the configuration does not build.
pub fn import_tensors(
    config: &HfConfig,
    tensors: BTreeMap<String, HostTensor>,
    device: &Device,
) -> Result<Gpt> {
    let params = to_gpt_params(config, tensors)?;
    let model = Gpt::build(&config.model, &Init::new(config.model.seed, device), None)
        .map_err(|e| HfError::Model(e.to_string()))?;
    // The mapping must cover the model exactly, shape for shape.
    let expected = param_shapes(&model);
    let got: BTreeMap<String, Vec<usize>> = params
        .iter()
        .map(|(k, t)| (k.clone(), t.shape.clone()))
        .collect();
    if expected != got {
        return Err(HfError::Model(format!(
            "the mapping gives parameters {got:?}, the model has {expected:?}"
        )));
    }
    let params: HashMap<String, TensorData> = params
        .into_iter()
        .map(|(k, t)| (k, TensorData::new(t.values, t.shape)))
        .collect();
    Ok(load_params(model, &params))
}

/// Reads every tensor of one safetensors file as `f32` (F16, BF16 and F64 are converted;
/// the file is read by [`burn_parallel::checkpoint::hf::read_safetensors`]).
///
/// # Errors
/// [`HfError::Io`], [`HfError::Safetensors`]; [`HfError::Dtype`] for a non-float tensor.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    host_tensors(checkpoint_hf::read_safetensors(path), path)
}

/// Writes `tensors` as one `f32` safetensors file (through a temporary file and a rename;
/// [`burn_parallel::checkpoint::hf::write_safetensors`]).
///
/// # Errors
/// [`HfError::Io`]; [`HfError::Safetensors`] if the header cannot be built.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, HostTensor>) -> Result<()> {
    let tensors = tensors
        .iter()
        .map(|(k, t)| {
            (
                k.clone(),
                TensorData::new(t.values.clone(), t.shape.clone()),
            )
        })
        .collect();
    checkpoint_hf::write_safetensors(path, &tensors).map_err(|e| hf_error(e, path))
}

/// Reads the tensors of a checkpoint directory: `model.safetensors`, or every shard that
/// `model.safetensors.index.json` lists ([`burn_parallel::checkpoint::hf::read_dir`]).
///
/// # Errors
/// Those of [`read_safetensors`]; [`HfError::Safetensors`] for a malformed index or a tensor
/// stored in two shards.
pub fn read_checkpoint(dir: &Path) -> Result<BTreeMap<String, HostTensor>> {
    host_tensors(checkpoint_hf::read_dir(dir), dir)
}

/// The library's tensors as `f32` host tensors, its errors as this module's.
fn host_tensors(
    read: std::result::Result<BTreeMap<String, TensorData>, CheckpointError>,
    path: &Path,
) -> Result<BTreeMap<String, HostTensor>> {
    let tensors = read.map_err(|e| hf_error(e, path))?;
    tensors
        .into_iter()
        .map(|(name, t)| {
            let shape = t.shape().to_vec();
            let values = t
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| HfError::Dtype {
                    tensor: name.clone(),
                    dtype: format!("{e:?}"),
                })?;
            Ok((name, HostTensor::new(shape, values)))
        })
        .collect()
}

/// A checkpoint error of reading or writing `path` as this module's error.
fn hf_error(e: CheckpointError, path: &Path) -> HfError {
    match e {
        CheckpointError::Io { path, source } => HfError::Io { path, source },
        CheckpointError::Corrupt { path, reason } => HfError::Safetensors { path, reason },
        CheckpointError::Piece { name, reason } if reason.starts_with("dtype") => HfError::Dtype {
            tensor: name,
            dtype: reason,
        },
        other => HfError::Safetensors {
            path: path.into(),
            reason: other.to_string(),
        },
    }
}

/// Imports a checkpoint directory (`config.json` and its safetensors) as a single-device GPT.
///
/// # Arguments
/// - `dir`: the directory, as `save_pretrained` writes it.
/// - `device`: where the model lives.
///
/// # Returns
/// The configuration read and the model.
///
/// # Errors
/// Those of [`HfConfig::from_dir`], [`read_checkpoint`] and [`import_tensors`].
pub fn import(dir: &Path, device: &Device) -> Result<(HfConfig, Gpt)> {
    let config = HfConfig::from_dir(dir)?;
    let tensors = read_checkpoint(dir)?;
    let model = import_tensors(&config, tensors, device)?;
    Ok((config, model))
}

/// The tensors of the checkpoint in `dir` under the GPT's parameter paths (its logical names),
/// with the configuration they load into: the source from which a run of *any* layout starts
/// ([`ParamMap::load_params`](burn_parallel::checkpoint::ParamMap::load_params): each rank
/// reads its tensor-parallel box or FSDP range of each weight).
///
/// # Errors
/// Those of [`HfConfig::from_dir`], [`read_checkpoint`] and [`to_gpt_params`].
pub fn gpt_tensors(dir: &Path) -> Result<(HfConfig, BTreeMap<String, TensorData>)> {
    let config = HfConfig::from_dir(dir)?;
    let params = to_gpt_params(&config, read_checkpoint(dir)?)?;
    let tensors = params
        .into_iter()
        .map(|(k, t)| (k, TensorData::new(t.values, t.shape)))
        .collect();
    Ok((config, tensors))
}

/// [`gpt_tensors`] of the checkpoint in `dir` for a run of model `run`: the tensors a run of
/// any layout starts from (`gpt --init-from-hf DIR`).
///
/// # Errors
/// Those of [`gpt_tensors`]; [`HfError::OtherModel`] when the checkpoint holds another model
/// than `run` (the training-only settings of [`with_run_settings`] aside).
pub fn gpt_tensors_for(dir: &Path, run: &GptConfig) -> Result<BTreeMap<String, TensorData>> {
    let (hf, tensors) = gpt_tensors(dir)?;
    let saved = with_run_settings(&hf.model, run);
    if &saved != run {
        return Err(HfError::OtherModel {
            dir: dir.to_path_buf(),
            saved: Box::new(saved),
            run: Box::new(run.clone()),
        });
    }
    Ok(tensors)
}

/// `model` with the training-only settings (`seed`, `dropout`, `fused`) of `run`, so that a
/// model read from a checkpoint can be compared with, or replaced by, the one of a run.
pub fn with_run_settings(model: &GptConfig, run: &GptConfig) -> GptConfig {
    GptConfig {
        seed: run.seed,
        dropout: run.dropout,
        fused: run.fused,
        ..model.clone()
    }
}

/// Checks that `config` is expressible in `arch`'s layout.
fn check_exportable(config: &GptConfig, arch: HfArch) -> Result<()> {
    let not = |reason: String| Err(HfError::NotExportable { arch, reason });
    if config.moe.is_some() {
        return not("a GPT-MoE has no dense MLP to write".into());
    }
    let (mlp, positions, norm, bias) = match arch {
        HfArch::Gpt2 => (
            MlpKind::Gelu,
            PositionKind::Learned,
            NormKind::LayerNorm,
            true,
        ),
        HfArch::Llama => (
            MlpKind::SwiGlu,
            PositionKind::Rotary,
            NormKind::RmsNorm,
            false,
        ),
    };
    let found = (config.mlp, config.positions, config.norm, config.bias);
    if found != (mlp, positions, norm, bias) {
        return not(format!(
            "the layout needs (mlp, positions, norm, bias) = {:?}, the model has {found:?}",
            (mlp, positions, norm, bias)
        ));
    }
    if arch == HfArch::Gpt2 && !config.tied_embeddings {
        return not("GPT-2's head is tied to the token embedding; the model's is not".into());
    }
    Ok(())
}

/// The checkpoint tensors of a single-device `model` in `arch`'s layout (GPT-2's with the
/// `transformer.` prefix, as `GPT2LMHeadModel.save_pretrained` writes them).
///
/// # Errors
/// [`HfError::NotExportable`] when the model's configuration has no equivalent in the layout
/// (for GPT-2: GELU MLP, learned positions, LayerNorm, biases, tied head; for LLaMA: SwiGLU,
/// rotary, RMSNorm, no biases; no MoE) or the model is split over ranks (export
/// `model.to_single(device)?` instead).
pub fn export_tensors(model: &Gpt, arch: HfArch) -> Result<BTreeMap<String, HostTensor>> {
    check_exportable(&model.config, arch)?;
    if model.tp.group().is_some() || model.blocks.iter().any(|b| b.is_sharded()) {
        return Err(HfError::NotExportable {
            arch,
            reason: "the model is split over ranks; export `model.to_single(device)?`".into(),
        });
    }
    let params = host_params(model);
    let config = HfConfig {
        arch,
        model: model.config.clone(),
    };
    let prefix = match arch {
        HfArch::Gpt2 => "transformer.",
        HfArch::Llama => "",
    };
    let get = |p: &str| {
        params.get(p).ok_or_else(|| HfError::NotExportable {
            arch,
            reason: format!("the model has no parameter `{p}`"),
        })
    };
    let mut out = BTreeMap::new();
    for entry in layout(&config) {
        let tensor = match &entry.source {
            Source::Same(p) => get(p)?.clone(),
            Source::Transposed(p) => get(p)?.transposed(),
            Source::Fused(ps) => {
                let parts = ps.iter().map(|p| get(p)).collect::<Result<Vec<_>>>()?;
                HostTensor::concat_last(&parts)
            }
        };
        debug_assert_eq!(tensor.shape, entry.shape, "{}", entry.name);
        let name = match entry.name.as_str() {
            "lm_head.weight" => entry.name,
            _ => format!("{prefix}{}", entry.name),
        };
        out.insert(name, tensor);
    }
    Ok(out)
}

/// Writes a single-device `model` to `dir` as `config.json` and `model.safetensors` (`f32`) in
/// `arch`'s layout; `transformers`' `from_pretrained` and [`import`] read it back.
///
/// # Arguments
/// - `model`: a single-device GPT (`to_single` a split one first).
/// - `arch`: the layout.
/// - `dir`: created if needed; existing files of these names are replaced.
///
/// # Errors
/// Those of [`export_tensors`]; [`HfError::Io`].
pub fn export(model: &Gpt, arch: HfArch, dir: &Path) -> Result<()> {
    let tensors = export_tensors(model, arch)?;
    std::fs::create_dir_all(dir).map_err(|source| HfError::Io {
        path: dir.into(),
        source,
    })?;
    write_safetensors(&dir.join(WEIGHTS_FILE), &tensors)?;
    let config = HfConfig {
        arch,
        model: model.config.clone(),
    };
    let text = serde_json::to_string_pretty(&config.to_json()).expect("JSON values serialise");
    let path = dir.join(CONFIG_FILE);
    std::fs::write(&path, text).map_err(|source| HfError::Io { path, source })
}

/// The figures of [`evaluate`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// Mean next-token cross-entropy (nats per token).
    pub loss: f64,
    /// Number of predicted tokens.
    pub tokens: usize,
}

impl Perplexity {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Mean next-token loss of `model` over a token stream, in non-overlapping windows of
/// `window` predictions (each window sees `window` tokens and predicts the next ones; a
/// shorter last window counts too).
///
/// # Arguments
/// - `model`: the GPT (single-device).
/// - `tokens`: the token ids, at least 2.
/// - `window`: tokens per forward pass, at most `max_seq_len`.
///
/// # Errors
/// [`HfError::Model`] for fewer than 2 tokens, a window of 0 or longer than `max_seq_len`, a
/// token outside the vocabulary, or a model error.
///
/// ```
/// use burn::tensor::Device;
/// use examples::gpt::{Gpt, GptConfig};
/// use examples::hf::evaluate;
///
/// let model = Gpt::new(&GptConfig { d_ff: 32, ..GptConfig::new(64, 1, 2, 8, 16) }, &Device::flex());
/// let tokens: Vec<u32> = (0..40).map(|i| i % 64).collect();
/// let eval = evaluate(&model, &tokens, 16).unwrap();
/// assert_eq!(eval.tokens, 39);
/// assert!((eval.loss - 64f64.ln()).abs() < 0.1); // an untrained model is near uniform
/// ```
pub fn evaluate(model: &Gpt, tokens: &[u32], window: usize) -> Result<Perplexity> {
    let bad = |s: String| Err(HfError::Model(s));
    if tokens.len() < 2 {
        return bad(format!("need at least 2 tokens, got {}", tokens.len()));
    }
    if window == 0 || window > model.config.max_seq_len {
        return bad(format!(
            "window {window} must be in 1..={} (max_seq_len)",
            model.config.max_seq_len
        ));
    }
    if let Some(t) = tokens
        .iter()
        .find(|&&t| t as usize >= model.config.vocab_size)
    {
        return bad(format!(
            "token {t} is outside the vocabulary of {}",
            model.config.vocab_size
        ));
    }
    let device = model.wte.skeleton().weight.val().device();
    let (mut sum, mut count) = (0.0f64, 0usize);
    let mut start = 0;
    while start + 1 < tokens.len() {
        let n = window.min(tokens.len() - 1 - start);
        let ids = |from: usize| -> Tensor<2, Int> {
            let v: Vec<i64> = tokens[from..from + n].iter().map(|&t| t as i64).collect();
            Tensor::from_data(TensorData::new(v, [1, n]), &device)
        };
        let loss = model
            .loss(ids(start), ids(start + 1))
            .map_err(|e| HfError::Model(e.to_string()))?;
        let loss: f32 = loss.into_scalar();
        sum += loss as f64 * n as f64;
        count += n;
        start += n;
    }
    Ok(Perplexity {
        loss: sum / count as f64,
        tokens: count,
    })
}

/// A byte-level BPE (or any) tokenizer from a `tokenizer.json`, through the `tokenizers` crate
/// (feature `hf-tokenizer`).
///
/// ```
/// use examples::hf::Tokenizer;
///
/// let json = r#"{"version": "1.0", "added_tokens": [], "normalizer": null,
///     "pre_tokenizer": null, "post_processor": null, "decoder": null,
///     "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}}"#;
/// let tokenizer = Tokenizer::from_bytes(json.as_bytes()).unwrap();
/// assert_eq!(tokenizer.encode("abab").unwrap(), vec![2, 2]);
/// assert_eq!(tokenizer.vocab_size(), 3);
/// ```
#[cfg(feature = "hf-tokenizer")]
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

#[cfg(feature = "hf-tokenizer")]
impl Tokenizer {
    /// Loads `tokenizer.json`.
    ///
    /// # Errors
    /// [`HfError::Io`] when the file cannot be read; [`HfError::Tokenizer`] when it is not a
    /// tokenizer the crate understands.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| HfError::Io {
            path: path.into(),
            source,
        })?;
        Self::from_bytes(&bytes).map_err(|e| HfError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Parses the contents of a `tokenizer.json`.
    ///
    /// # Errors
    /// [`HfError::Tokenizer`] when it is not a tokenizer the crate understands.
    pub fn from_bytes(json: &[u8]) -> Result<Self> {
        tokenizers::Tokenizer::from_bytes(json)
            .map(|inner| Self { inner })
            .map_err(|e| HfError::Tokenizer(e.to_string()))
    }

    /// The token ids of `text` (no special tokens added).
    ///
    /// # Errors
    /// [`HfError::Tokenizer`] from the tokenizer.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| HfError::Tokenizer(e.to_string()))
    }

    /// The text of `ids` (special tokens kept).
    ///
    /// # Errors
    /// [`HfError::Tokenizer`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| HfError::Tokenizer(e.to_string()))
    }

    /// Number of tokens, with the added ones.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
