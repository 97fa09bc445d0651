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
//! The tables are the GPT's ([`adapter`]); reading, checking, mapping and writing the tensors is
//! the library's [`burn_parallel::checkpoint::hf`]. Causal-mask buffers saved by old GPT-2
//! checkpoints (`h.N.attn.bias`, `h.N.attn.masked_bias`) and LLaMA's `rotary_emb.inv_freq` are
//! skipped; any other tensor the mapping does not use is an error, as is a missing one
//! ([`CheckpointError::Unmapped`] in [`HfError::Checkpoint`]).
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

use crate::gpt::{GeluKind, Gpt, GptConfig, MlpKind, NormKind, PositionKind};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::CheckpointError;
use burn_parallel::checkpoint::hf::{self as checkpoint_hf, Adapter, Entry};
use burn_parallel::init::Init;
use burn_parallel_train::load_named;
use serde_json::{Value, json};
use std::collections::BTreeMap;
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
    /// `config.json` is not valid JSON.
    #[error("{path}: not valid JSON: {reason}")]
    Json {
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
    /// A checkpoint's tensors could not be read or written, or do not match `config.json`: the
    /// library's error, naming the file or the tensor ([`CheckpointError::Io`], `Corrupt`,
    /// `Dtype`; [`CheckpointError::Shape`], `Unmapped` (every missing and unexpected tensor,
    /// with its shape), `Duplicate`, `Tied` (a tied head that differs from the embedding)).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
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

/// The GPT's mapping onto `config`'s checkpoint layout: the table of the module docs, GPT-2's
/// optional `transformer.` prefix, the tied head (`lm_head.weight`, when saved, must equal
/// `wte.weight`) and the buffers that carry no weight.
///
/// ```
/// use examples::hf::{self, HfConfig};
///
/// let json = serde_json::json!({
///     "model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 4,
///     "vocab_size": 16
/// });
/// let adapter = hf::adapter(&HfConfig::from_json(&json).unwrap());
/// let c_attn = &adapter.entries()[6];
/// assert_eq!((c_attn.name.as_str(), c_attn.shape.as_slice()), ("h.0.attn.c_attn.weight", &[8, 24][..]));
/// assert_eq!(adapter.param_shapes()["blocks.0.attn.k.weight"], vec![8, 8]);
/// ```
pub fn adapter(config: &HfConfig) -> Adapter {
    let m = &config.model;
    let (d, f, v) = (m.d_model, m.d_ff, m.vocab_size);
    use Entry as E;
    let mut e = Vec::new();
    let adapter = match config.arch {
        HfArch::Gpt2 => {
            e.push(E::param("wte.weight", &[v, d], "wte.weight"));
            e.push(E::param("wpe.weight", &[m.max_seq_len, d], "wpe.weight"));
            for i in 0..m.n_layers {
                let (h, b) = (format!("h.{i}"), format!("blocks.{i}"));
                for ln in ["ln_1", "ln_2"] {
                    for p in ["weight", "bias"] {
                        e.push(E::param(
                            format!("{h}.{ln}.{p}"),
                            &[d],
                            format!("{b}.{ln}.{p}"),
                        ));
                    }
                }
                let qkv = |p: &str| ["q", "k", "v"].map(|x| format!("{b}.attn.{x}.{p}"));
                let c_attn = format!("{h}.attn.c_attn");
                e.push(E::fused(
                    format!("{c_attn}.weight"),
                    &[d, 3 * d],
                    qkv("weight"),
                ));
                e.push(E::fused(format!("{c_attn}.bias"), &[3 * d], qkv("bias")));
                for (hf, ours, shape) in [
                    ("attn.c_proj", "attn.o", [d, d]),
                    ("mlp.c_fc", "mlp.up", [d, f]),
                    ("mlp.c_proj", "mlp.down", [f, d]),
                ] {
                    for (p, shape) in [("weight", &shape[..]), ("bias", &shape[1..])] {
                        e.push(E::param(
                            format!("{h}.{hf}.{p}"),
                            shape,
                            format!("{b}.{ours}.{p}"),
                        ));
                    }
                }
            }
            for p in ["weight", "bias"] {
                e.push(E::param(format!("ln_f.{p}"), &[d], format!("ln_f.{p}")));
            }
            Adapter::new(e)
                .with_prefix("transformer.")
                .with_skipped("h.*.attn.bias")
                .with_skipped("h.*.attn.masked_bias")
        }
        HfArch::Llama => {
            e.push(E::param("model.embed_tokens.weight", &[v, d], "wte.weight"));
            for i in 0..m.n_layers {
                let (h, b) = (format!("model.layers.{i}"), format!("blocks.{i}"));
                let norm = |hf: &str, ours: &str| {
                    E::param(
                        format!("{h}.{hf}.weight"),
                        &[d],
                        format!("{b}.{ours}.weight"),
                    )
                };
                e.push(norm("input_layernorm", "ln_1"));
                for x in ["q", "k", "v", "o"] {
                    e.push(E::transposed(
                        format!("{h}.self_attn.{x}_proj.weight"),
                        &[d, d],
                        format!("{b}.attn.{x}.weight"),
                    ));
                }
                e.push(norm("post_attention_layernorm", "ln_2"));
                for (x, shape) in [("gate", [f, d]), ("up", [f, d]), ("down", [d, f])] {
                    e.push(E::transposed(
                        format!("{h}.mlp.{x}_proj.weight"),
                        &shape,
                        format!("{b}.mlp.{x}.weight"),
                    ));
                }
            }
            e.push(E::param("model.norm.weight", &[d], "ln_f.weight"));
            if !m.tied_embeddings {
                e.push(E::transposed("lm_head.weight", &[v, d], "lm_head.weight"));
            }
            Adapter::new(e).with_skipped("model.layers.*.self_attn.rotary_emb.inv_freq")
        }
    };
    match m.tied_embeddings {
        true => adapter.with_tied("lm_head.weight", "wte.weight"),
        false => adapter,
    }
}

/// Builds the GPT of `config` on `device` from checkpoint tensors.
///
/// # Arguments
/// - `config`: the checkpoint's configuration ([`HfConfig::from_json`]).
/// - `tensors`: the checkpoint's tensors by name, in any float dtype
///   ([`burn_parallel::checkpoint::hf::read_dir`]).
/// - `device`: where the model lives (`device.autodiff()` to fine-tune it).
///
/// # Returns
/// The single-device GPT holding exactly the checkpoint's weights.
///
/// # Errors
/// [`HfError::Checkpoint`]: those of [`Adapter::from_hf`] (shapes, missing and unexpected
/// tensors, a tied head that differs); [`HfError::Model`] when the configuration does not
/// build.
pub fn import_tensors(
    config: &HfConfig,
    tensors: BTreeMap<String, TensorData>,
    device: &Device,
) -> Result<Gpt> {
    let adapter = adapter(config);
    let params = adapter.from_hf(tensors)?;
    let model = Gpt::build(&config.model, &Init::new(config.model.seed, device), None)
        .map_err(|e| HfError::Model(e.to_string()))?;
    // The mapping must cover the model exactly, shape for shape.
    let index = burn_parallel::index::ParamIndex::of(&model);
    let entries = index.entries().iter();
    let expected: BTreeMap<_, _> = entries.map(|e| (e.path.clone(), e.shape.clone())).collect();
    if expected != adapter.param_shapes() {
        return Err(HfError::Model(format!(
            "the mapping gives parameters {:?}, the model has {expected:?}",
            adapter.param_shapes()
        )));
    }
    Ok(load_named(model, &params.into_iter().collect()))
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
/// Those of [`HfConfig::from_dir`] and [`import_tensors`]; [`HfError::Checkpoint`] when the
/// safetensors cannot be read ([`burn_parallel::checkpoint::hf::read_dir`]).
pub fn import(dir: &Path, device: &Device) -> Result<(HfConfig, Gpt)> {
    let config = HfConfig::from_dir(dir)?;
    let model = import_tensors(&config, checkpoint_hf::read_dir(dir)?, device)?;
    Ok((config, model))
}

/// The tensors of the checkpoint in `dir` under the GPT's parameter paths (its logical names),
/// with the configuration they load into: the source from which a run of *any* layout starts
/// ([`ParamMap::load_params`](burn_parallel::checkpoint::ParamMap::load_params): each rank
/// reads its tensor-parallel box or FSDP range of each weight).
///
/// # Errors
/// Those of [`HfConfig::from_dir`]; [`HfError::Checkpoint`]: those of
/// [`burn_parallel::checkpoint::hf::read_dir`] and [`Adapter::from_hf`].
pub fn gpt_tensors(dir: &Path) -> Result<(HfConfig, BTreeMap<String, TensorData>)> {
    let config = HfConfig::from_dir(dir)?;
    let tensors = adapter(&config).from_hf(checkpoint_hf::read_dir(dir)?)?;
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

/// The checkpoint tensors (`f32`) of a single-device `model` in `arch`'s layout (GPT-2's with
/// the `transformer.` prefix, as `GPT2LMHeadModel.save_pretrained` writes them).
///
/// # Errors
/// [`HfError::NotExportable`] when the model's configuration has no equivalent in the layout
/// (for GPT-2: GELU MLP, learned positions, LayerNorm, biases, tied head; for LLaMA: SwiGLU,
/// rotary, RMSNorm, no biases; no MoE) or the model is split over ranks (export
/// `model.to_single(device)?` instead).
pub fn export_tensors(model: &Gpt, arch: HfArch) -> Result<BTreeMap<String, TensorData>> {
    check_exportable(&model.config, arch)?;
    if model.tp.group().is_some() || model.blocks.iter().any(|b| b.is_sharded()) {
        return Err(HfError::NotExportable {
            arch,
            reason: "the model is split over ranks; export `model.to_single(device)?`".into(),
        });
    }
    let params = burn_parallel_train::named_params(model).into_iter();
    let params = params.map(|p| (p.path, TensorData::new(p.values, p.shape)));
    let config = HfConfig {
        arch,
        model: model.config.clone(),
    };
    Ok(adapter(&config).to_hf(params.collect())?)
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
/// Those of [`export_tensors`]; [`HfError::Io`], [`HfError::Checkpoint`].
pub fn export(model: &Gpt, arch: HfArch, dir: &Path) -> Result<()> {
    let tensors = export_tensors(model, arch)?;
    std::fs::create_dir_all(dir).map_err(|source| HfError::Io {
        path: dir.into(),
        source,
    })?;
    checkpoint_hf::write_safetensors(&dir.join(WEIGHTS_FILE), &tensors)?;
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
