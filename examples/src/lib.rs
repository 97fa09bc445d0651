//! Reference models and bundled data for `burn-parallel`.
//!
//! This crate is the single-device oracle that every parallel layout of the suite is checked
//! against, and the code its runnable trainers share:
//!
//! - [`init`]: deterministic initialisation, a pure function of `(seed, parameter path, shape)`,
//!   independent of thread, rank and call order (never Burn's global RNG);
//! - [`gpt`]: a decoder-only, pre-norm GPT ([`gpt::Gpt`], [`gpt::GptConfig`]) with GELU or
//!   SwiGLU MLPs, learned or rotary positions, LayerNorm or RMSNorm, tied or untied embeddings;
//! - [`vit`]: a Vision Transformer for small images ([`vit::Vit`], [`vit::VitConfig`]) built from
//!   the same blocks;
//! - [`hf`]: Hugging Face GPT-2 and LLaMA checkpoints (safetensors) in and out of the GPT, and
//!   (feature `hf-tokenizer`) their `tokenizer.json`;
//! - [`data`]: the bundled King James Bible as byte tokens ([`data::Corpus`]) and the 8x8
//!   hand-written digits ([`data::Digits`]), with batches that are pure functions of the step.
//!
//! Each model is one type for one device and every layout: its linear layers and embeddings
//! are `burn_parallel::nn` layers that a tensor-parallel plan splits (at tp = 1 they are plain
//! layers), its blocks `burn_zero::Fsdp` units that an FSDP plan shards. `Gpt::tp_plan`,
//! `Gpt::fsdp_plan` (and the ViT's) are the whole layout-specific code.
//!
//! ```
//! use burn::tensor::Device;
//! use examples::data::{Corpus, Split};
//! use examples::gpt::{Gpt, GptConfig};
//!
//! let device = Device::flex();
//! let model = Gpt::new(&GptConfig { d_ff: 32, ..GptConfig::new(256, 1, 2, 8, 16) }, &device);
//! let corpus = Corpus::from_bytes(b"In the beginning God created the heaven and the earth.".to_vec());
//! let (inputs, targets) = corpus.batch(0, 2, 16, Split::Train).to_tensors(&device);
//! let loss = model.loss(inputs, targets).unwrap();
//! assert_eq!(loss.dims(), [1]);
//! ```

pub mod cli;
pub mod data;
pub mod gpt;
pub mod hf;
pub use burn_parallel::init;
pub mod pipeline;
pub mod run;
pub mod train;
pub mod train_diloco;
pub mod train_vit;
pub mod vit;
pub mod vit_pipeline;
