//! `gpt --zero 3` (FSDP: `Fsdp<M>` units in the layout-generic trainer) over 2 real processes
//! talking TCP, launched by `burnrun`, gives
//! the losses and final parameters of the independent single-device reference run with the same
//! global-norm clipping; each process reports the memory of its shards: parameters, gradients
//! and AdamW state of its half of every unit, and one whole unit gathered at a time.

use burn::tensor::Device;
use burn_zero::flat::shard_range;
use examples::gpt::Gpt;
use examples::train::TrainConfig;
use tests::{
    assert_matches_reference, gpt_through_burnrun, params_of, reference_run, tiny_gpt_run,
};

const PROCESSES: usize = 2;
const MIB: f64 = 1024.0 * 1024.0;

/// The figures of one rank's `zero memory:` line, in MiB, by name (`params`, `grads`,
/// `optimizer`, `gathered`, `staging`, `model state peak`, `total peak`).
fn memory_figures(stdout: &str, rank: usize) -> Vec<(String, f64)> {
    let prefix = format!("[rank {rank}] [rank {rank}] zero memory: ");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no memory line of rank {rank} in:\n{stdout}"));
    line.split([',', ';'])
        .map(|item| {
            let item = item.trim().trim_end_matches(" (peak)");
            let (name, value) = item
                .strip_suffix(" MiB")
                .and_then(|s| s.rsplit_once(' '))
                .unwrap_or_else(|| panic!("unreadable memory item {item:?} in {line:?}"));
            let value: f64 = value
                .parse()
                .unwrap_or_else(|e| panic!("{value:?} in {line:?}: {e}"));
            (name.to_string(), value)
        })
        .collect()
}

#[test]
fn zero3_over_tcp_processes_matches_single_device() {
    let config = TrainConfig {
        max_grad_norm: Some(0.5),
        ..tiny_gpt_run(20)
    };
    let reference = reference_run(&config);
    let tcp = gpt_through_burnrun(PROCESSES, &config, &["--zero", "3", "--clip", "0.5"]);
    assert_matches_reference(
        &reference,
        &tcp.losses,
        &tcp.params,
        1e-5,
        "ZeRO-3 over 2 tcp processes",
    );

    // The FSDP units of the GPT (`Gpt::fsdp_plan`: each block, the token and position
    // embeddings, the final norm, the head) and their sizes, from the model's own parameters.
    let params = params_of(&Gpt::new(&config.model, &Device::flex()));
    let unit_of = |path: &str| -> String {
        match path.split('.').collect::<Vec<_>>().as_slice() {
            ["blocks", i, ..] => format!("blocks.{i}"),
            [first, ..] => first.to_string(),
            [] => unreachable!("a parameter has a path"),
        }
    };
    let mut units = std::collections::BTreeMap::<String, usize>::new();
    for (path, (_, values)) in &params {
        *units.entry(unit_of(path)).or_default() += values.len();
    }
    let others: Vec<&str> = units
        .keys()
        .filter(|u| !u.starts_with("blocks."))
        .map(String::as_str)
        .collect();
    assert_eq!(others, ["lm_head", "ln_f", "wpe", "wte"], "{units:?}");
    assert_eq!(units.len(), config.model.n_layers + 4, "{units:?}");
    let largest = *units.values().max().expect("units");
    for rank in 0..PROCESSES {
        let figures = memory_figures(&tcp.stdout, rank);
        let get = |name: &str| {
            figures
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("rank {rank}: no {name} figure in {figures:?}"))
                .1
        };
        // This rank's fp32 shard of every unit.
        let shard: usize = units
            .values()
            .map(|&n| shard_range(n, rank, PROCESSES).len())
            .sum();
        let shard_mib = 4.0 * shard as f64 / MIB;
        let expected = [
            ("params", shard_mib),
            ("grads", shard_mib),
            ("optimizer", 2.0 * shard_mib), // AdamW's two moments
            ("gathered", 4.0 * largest as f64 / MIB),
        ];
        let mut state = 0.0;
        for (name, want) in expected {
            let got = get(name);
            // The line prints three decimals.
            assert!(
                (got - want).abs() <= 0.0005 + 1e-9,
                "rank {rank}: {name} {got} MiB, expected {want:.4} MiB ({figures:?})"
            );
            state += want;
        }
        let got = get("model state peak");
        assert!(
            (got - state).abs() <= 0.0005 + 1e-9,
            "rank {rank}: model state peak {got} MiB, expected {state:.4} MiB"
        );
        assert!(
            get("total peak") >= get("gathered"),
            "rank {rank}: total peak below the gathered unit: {figures:?}"
        );
        println!("rank {rank}: {figures:?} (shard {shard} of {} values)", {
            units.values().sum::<usize>()
        });
    }
}
