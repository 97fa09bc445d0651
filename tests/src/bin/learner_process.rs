//! One process of `tests/learner.rs`'s multi-process test, started by `burnrun`: the test's
//! `burn-train` training under the layout given as TOML (`--layout 'zero = 3'`), its ranks
//! joined over TCP from burnrun's variables; rank 0 writes the losses the metrics saw and the
//! final parameters as JSON to `--out`.
//!
//! ```text
//! burnrun --nproc-per-node 2 -- learner_process --layout 'zero = 3' --dir /tmp/run --out out.json
//! ```

use std::path::PathBuf;

use burn_parallel_learner::LayoutStrategy;
use burn_parallel_train::Layout;
use tests::learner::{CONFIG, EPOCHS, settings, train};

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut layout, mut dir, mut out) = (String::new(), None, None);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .unwrap_or_else(|| panic!("{flag} takes a value"));
        match flag.as_str() {
            "--layout" => layout = value,
            "--dir" => dir = Some(PathBuf::from(value)),
            "--out" => out = Some(PathBuf::from(value)),
            other => panic!("unknown flag {other}"),
        }
    }
    let (dir, out) = (dir.expect("--dir"), out.expect("--out"));
    let layout = Layout::from_toml(&layout).unwrap_or_else(|e| panic!("--layout: {e}"));
    let world = burn_parallel::init_from_env().unwrap_or_else(|e| panic!("{e}"));
    let rank = world.rank();
    let strategy = LayoutStrategy::new(world, layout, CONFIG, dir.join("checkpoints"))
        .with_settings(settings());
    let outcome = train(
        &dir.join(format!("rank{rank}")),
        Some(strategy),
        EPOCHS,
        None,
    );
    if rank == 0 {
        let json = serde_json::json!({
            "train": outcome.train,
            "valid": outcome.valid,
            "params": outcome.params,
        });
        std::fs::write(&out, json.to_string()).expect("writing --out");
    }
}
