//! The book's Hugging Face example (`book/src/huggingface.md` includes it): a GPT written out in
//! the `transformers` safetensors layout of GPT-2 and imported back, with the same loss. A test
//! target without the harness: `cargo test -p tests --test book_hf` runs `main`.

// ANCHOR: roundtrip
use burn::tensor::Device;
use examples::gpt::{GeluKind, Gpt, GptConfig};
use examples::hf::{self, HfArch, HfError};

fn main() -> Result<(), HfError> {
    let dir = std::env::temp_dir().join(format!("book-hf-{}", std::process::id()));
    // A tiny GPT-2: its head tied to the token embedding, GELU in its tanh form.
    let config = GptConfig {
        tied_embeddings: true,
        gelu: GeluKind::Tanh,
        ..GptConfig::new(256, 2, 2, 32, 64)
    };
    let model = Gpt::new(&config, &Device::flex());
    hf::export(&model, HfArch::Gpt2, &dir)?; // config.json + model.safetensors
    let (_config, imported) = hf::import(&dir, &Device::flex())?;
    // The imported model computes what the exported one did.
    let tokens: Vec<u32> = b"In the beginning God created"
        .iter()
        .map(|&b| b.into())
        .collect();
    let ours = hf::evaluate(&model, &tokens, 16)?;
    let theirs = hf::evaluate(&imported, &tokens, 16)?;
    assert_eq!(ours.loss, theirs.loss);
    println!(
        "loss {:.4} nats/token, perplexity {:.1}",
        theirs.loss,
        theirs.loss.exp()
    );
    std::fs::remove_dir_all(&dir).map_err(|source| HfError::Io { path: dir, source })
}
// ANCHOR_END: roundtrip
