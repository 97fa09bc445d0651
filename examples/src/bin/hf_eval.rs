//! `hf_eval`: imports a Hugging Face GPT-2 or LLaMA checkpoint directory (`config.json`,
//! `model.safetensors`, `tokenizer.json`), tokenizes a text with the checkpoint's tokenizer
//! and prints the model's loss and perplexity on it. Optionally exports the imported model
//! back to the `transformers` layout.
//!
//! ```sh
//! cargo run --release -p examples --features hf-tokenizer --bin hf_eval -- \
//!     --model path/to/gpt2 --text some.txt --window 256
//! ```

use burn::tensor::Device;
use clap::Parser;
use examples::data::{Corpus, Split};
use examples::hf::{self, Tokenizer};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Loss and perplexity of a Hugging Face GPT-2/LLaMA checkpoint on a text")]
struct Args {
    /// Checkpoint directory: config.json, model.safetensors (or its sharded index).
    #[arg(long)]
    model: PathBuf,
    /// Text file to evaluate on; without it, the first `--chars` bytes of the bundled corpus' validation split.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Bytes of the bundled corpus to evaluate on (without `--text`).
    #[arg(long, default_value_t = 4000)]
    chars: usize,
    /// tokenizer.json (default: the one in the checkpoint directory).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Tokens per forward pass (default: the model's context, at most 512).
    #[arg(long)]
    window: Option<usize>,
    /// Also export the imported model to this directory (same layout).
    #[arg(long)]
    export: Option<PathBuf>,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("hf_eval: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::flex();
    let t0 = Instant::now();
    let (config, model) = hf::import(&args.model, &device)?;
    println!(
        "imported {:?}: {} layers, d_model {}, {} heads, vocab {}, {} parameters ({:.1} s)",
        config.arch,
        config.model.n_layers,
        config.model.d_model,
        config.model.n_heads,
        config.model.vocab_size,
        model.num_params(),
        t0.elapsed().as_secs_f64()
    );
    let tokenizer_path = args
        .tokenizer
        .unwrap_or_else(|| args.model.join("tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
    let text = match &args.text {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => {
            let corpus = Corpus::load_default()?;
            let bytes = corpus.split(Split::Validation);
            String::from_utf8_lossy(&bytes[..args.chars.min(bytes.len())]).into_owned()
        }
    };
    let tokens = tokenizer.encode(&text)?;
    let window = args.window.unwrap_or(config.model.max_seq_len.min(512));
    let t1 = Instant::now();
    let eval = hf::evaluate(&model, &tokens, window)?;
    println!(
        "{} characters, {} tokens, window {window}: loss {:.4} nats/token, perplexity {:.2}, \
         {:.3} bits/byte ({:.1} s)",
        text.len(),
        tokens.len(),
        eval.loss,
        eval.perplexity(),
        eval.loss * eval.tokens as f64 / std::f64::consts::LN_2 / text.len().max(1) as f64,
        t1.elapsed().as_secs_f64()
    );
    if let Some(dir) = args.export {
        hf::export(&model, config.arch, &dir)?;
        println!("exported to {}", dir.display());
    }
    Ok(())
}
