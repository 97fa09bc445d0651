//! Muon against an independent PyTorch reference (`scripts/muon_reference.py`, which writes
//! `tests/data/muon_reference.json`): for each case, three steps of `Muon::direction` and
//! `W ← W·(1 − lr·λ) − lr·O` on Flex must land within 1e-5 of the reference's fp32 weights.

use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::muon::{MuonConfig, MuonScale, WholeMatrix};
use serde::Deserialize;

const TOLERANCE: f32 = 1e-5;

#[derive(Deserialize)]
struct Fixture {
    torch: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    pytorch_shape: [usize; 2],
    burn_shape: [usize; 2],
    momentum: f64,
    nesterov: bool,
    ns_steps: usize,
    weight_decay: f64,
    /// `original` or `match-adamw` (mapped here, not through `MuonScale`'s serde names).
    scale: String,
    lr: f64,
    initial: Vec<f32>,
    grads: Vec<Vec<f32>>,
    expected: Vec<Vec<f32>>,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/muon_reference.json"
    );
    let text = std::fs::read_to_string(path).expect("read the fixture");
    serde_json::from_str(&text).expect("parse the fixture")
}

fn scale(name: &str) -> MuonScale {
    match name {
        "original" => MuonScale::Original,
        "match-adamw" => MuonScale::MatchAdamW,
        other => panic!("unknown scale `{other}` in the fixture"),
    }
}

fn tensor(values: &[f32], shape: [usize; 2], device: &Device) -> Tensor<2> {
    assert_eq!(values.len(), shape[0] * shape[1], "a matrix of the fixture");
    Tensor::from_data(TensorData::new(values.to_vec(), shape), device)
}

fn max_abs_diff(a: &Tensor<2>, b: &[f32]) -> f32 {
    let a = a.clone().into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    // A NaN counts as infinitely far (`f32::max` would drop it).
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .map(|d| if d.is_nan() { f32::INFINITY } else { d })
        .fold(0.0, f32::max)
}

#[test]
fn muon_matches_the_pytorch_reference() {
    let fixture = fixture();
    assert!(fixture.cases.len() >= 6, "the fixture has too few cases");
    let device = Device::flex();
    let mut failures = Vec::new();
    for case in &fixture.cases {
        let [fan_in, fan_out] = case.burn_shape;
        assert_eq!(
            case.pytorch_shape,
            [fan_out, fan_in],
            "{}: orientations",
            case.name
        );
        assert_eq!(
            case.grads.len(),
            case.expected.len(),
            "{}: steps",
            case.name
        );
        let config = MuonConfig::new()
            .with_momentum(case.momentum)
            .with_nesterov(case.nesterov)
            .with_ns_steps(case.ns_steps)
            .with_weight_decay(case.weight_decay)
            .with_scale(scale(&case.scale));
        config.validate().unwrap();
        let mut muon = config.build();
        let path = "block.mlp.fc.weight";
        assert!(muon.takes(path, &case.burn_shape));
        let decay = 1.0 - case.lr * muon.weight_decay();
        let mut w = tensor(&case.initial, case.burn_shape, &device);
        let mut worst = 0.0f32;
        for (step, (grad, expected)) in case.grads.iter().zip(&case.expected).enumerate() {
            let g = tensor(grad, case.burn_shape, &device);
            let o = muon.direction(path, g);
            assert_eq!(
                o.dims(),
                case.burn_shape,
                "{}: direction's shape",
                case.name
            );
            w = w.mul_scalar(decay) - o.mul_scalar(case.lr);
            let diff = max_abs_diff(&w, expected);
            worst = worst.max(diff);
            if diff > TOLERANCE {
                failures.push(format!("{} step {}: {diff:.3e}", case.name, step + 1));
            }
        }
        eprintln!(
            "{:48} worst |W - reference (torch {})| over {} steps: {worst:.3e}",
            case.name,
            fixture.torch,
            case.grads.len()
        );
    }
    assert!(
        failures.is_empty(),
        "beyond {TOLERANCE:e} of the PyTorch reference: {failures:?}"
    );
}
