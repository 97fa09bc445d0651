//! The bundled GPT on one device ([`examples::gpt`]): shapes and parameter counts, initialisation
//! as a function of the seed and Burn's module paths, the causal mask, rotary positions, the
//! loss at initialisation and exact cross-entropy, an AdamW step, gradients for every
//! parameter, mixture-of-experts blocks and the configuration's validation and serialisation.

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::assert_all_params_have_grads;
use examples::gpt::{
    Gpt, GptConfig, INIT_STD, MlpKind, NormKind, PositionKind, Rope, cross_entropy,
};
use examples::init::init_normal;
use std::ops::Deref;

fn tiny() -> GptConfig {
    GptConfig {
        d_ff: 32,
        seed: 7,
        ..GptConfig::new(256, 2, 2, 16, 16)
    }
}

fn tokens(b: usize, s: usize, salt: i64, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..(b * s) as i64)
        .map(|i| (i * 37 + salt * 11 + 5) % 256)
        .collect();
    Tensor::from_data(TensorData::new(v, [b, s]), device)
}

fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

fn scalar(t: Tensor<1>) -> f32 {
    to_vec(t)[0]
}

#[test]
fn forward_shape_and_param_count() {
    let device = Device::flex();
    for config in [
        tiny(),
        GptConfig {
            positions: PositionKind::Rotary,
            tied_embeddings: true,
            mlp: MlpKind::SwiGlu,
            norm: NormKind::RmsNorm,
            bias: false,
            ..tiny()
        },
    ] {
        let model = Gpt::new(&config, &device);
        let logits = model.forward(tokens(3, 5, 0, &device)).unwrap();
        assert_eq!(logits.dims(), [3, 5, 256]);
        assert!(to_vec(logits).iter().all(|x| x.is_finite()));
        assert_eq!(model.num_params(), config.num_params());
    }
}

#[test]
fn init_is_a_function_of_seed_and_path() {
    let device = Device::flex();
    let config = tiny();
    let a = Gpt::new(&config, &device);
    let b = Gpt::new(&config, &device);
    let q = a.blocks[1].full().unwrap().attn.q.weight.val().into_data();
    assert_eq!(
        q,
        b.blocks[1].full().unwrap().attn.q.weight.val().into_data()
    );
    assert_eq!(
        q,
        init_normal(7, "blocks.1.attn.q.weight", &[16, 16], INIT_STD)
    );
    let o = a.blocks[0].full().unwrap().attn.o.weight.val().into_data();
    let std = INIT_STD / 2.0;
    assert_eq!(o, init_normal(7, "blocks.0.attn.o.weight", &[16, 16], std));
    let k0 = to_vec(a.blocks[0].full().unwrap().attn.k.weight.val());
    let k1 = to_vec(a.blocks[1].full().unwrap().attn.k.weight.val());
    assert_ne!(k0, k1);
    let other = Gpt::new(&GptConfig { seed: 8, ..config }, &device);
    assert_ne!(
        q,
        other.blocks[1]
            .full()
            .unwrap()
            .attn
            .q
            .weight
            .val()
            .into_data()
    );
}

/// The names used at initialisation are Burn's module paths.
#[test]
fn init_names_are_module_paths() {
    struct Paths {
        stack: Vec<String>,
        found: Vec<(String, TensorData)>,
    }
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.found
                .push((self.stack.join("."), param.val().into_data()));
        }
    }
    let device = Device::flex();
    let config = tiny();
    let model = Gpt::new(&config, &device);
    let mut paths = Paths {
        stack: vec![],
        found: vec![],
    };
    model.visit(&mut paths);
    let names: Vec<&str> = paths.found.iter().map(|(n, _)| n.as_str()).collect();
    for expected in [
        "wte.weight",
        "wpe.weight",
        "blocks.0.ln_1.weight",
        "blocks.1.attn.v.bias",
        "blocks.1.mlp.down.weight",
        "ln_f.bias",
        "lm_head.weight",
    ] {
        assert!(names.contains(&expected), "{expected} not in {names:?}");
    }
    for (name, data) in &paths.found {
        if name.ends_with("up.weight") || name.starts_with("wte") || name.starts_with("lm_head.w") {
            let shape = data.shape().to_vec();
            assert_eq!(*data, init_normal(7, name, &shape, INIT_STD), "{name}");
        }
    }
}

#[test]
fn causal_mask_is_causal() {
    let device = Device::flex();
    for positions in [PositionKind::Learned, PositionKind::Rotary] {
        let model = Gpt::new(
            &GptConfig {
                positions,
                ..tiny()
            },
            &device,
        );
        let a: Vec<i64> = vec![1, 2, 3, 4, 5, 6];
        let mut b = a.clone();
        b[4] = 200;
        let make = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, 6]), &device);
        let la = model.forward(make(a)).unwrap();
        let lb = model.forward(make(b)).unwrap();
        let early_a = to_vec(la.clone().narrow(1, 0, 4));
        let early_b = to_vec(lb.clone().narrow(1, 0, 4));
        assert_eq!(early_a, early_b, "{positions:?}: earlier logits changed");
        let late_a = to_vec(la.narrow(1, 4, 2));
        let late_b = to_vec(lb.narrow(1, 4, 2));
        assert_ne!(late_a, late_b);
    }
}

#[test]
fn rope_rotates_and_offsets_compose() {
    let device = Device::flex();
    let x = Tensor::<4>::from_data(init_normal(0, "x", &[1, 1, 3, 4], 1.0), &device);
    // Rotation preserves the norm of each head vector.
    let r = Rope::new(4, 3, 0, 10_000.0, &device).apply(x.clone());
    let n0 = to_vec(x.clone().square().sum_dim(3));
    let n1 = to_vec(r.clone().square().sum_dim(3));
    for (a, b) in n0.iter().zip(&n1) {
        assert!((a - b).abs() < 1e-5);
    }
    // Position 0 is the identity; an offset table equals the tail of a longer one.
    assert_eq!(
        to_vec(r.clone().narrow(2, 0, 1)),
        to_vec(x.clone().narrow(2, 0, 1))
    );
    let tail = Rope::new(4, 2, 1, 10_000.0, &device).apply(x.clone().narrow(2, 1, 2));
    let diff: f32 = to_vec(tail - r.narrow(2, 1, 2))
        .iter()
        .map(|d| d.abs())
        .sum();
    assert!(diff < 1e-6);
}

#[test]
fn loss_at_init_is_uniform() {
    let device = Device::flex();
    for tied_embeddings in [false, true] {
        let model = Gpt::new(
            &GptConfig {
                tied_embeddings,
                ..tiny()
            },
            &device,
        );
        let loss = scalar(
            model
                .loss(tokens(2, 8, 0, &device), tokens(2, 8, 1, &device))
                .unwrap(),
        );
        let uniform = (256f32).ln();
        assert!(
            (loss - uniform).abs() < 0.05,
            "tied={tied_embeddings}: {loss} vs {uniform}"
        );
    }
}

#[test]
fn cross_entropy_is_exact() {
    let device = Device::flex();
    let logits = Tensor::<2>::from_data([[0.0, 1.0, 2.0], [3.0, 0.0, -1.0]], &device);
    let targets = Tensor::<1, Int>::from_data([2, 0], &device);
    let loss = scalar(cross_entropy(logits, targets)) as f64;
    let lse = |v: [f64; 3]| v.iter().map(|x| x.exp()).sum::<f64>().ln();
    let expected = ((lse([0.0, 1.0, 2.0]) - 2.0) + (lse([3.0, 0.0, -1.0]) - 3.0)) / 2.0;
    assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
}

/// The GPT-2-like and the LLaMA-like (rotary, tied, SwiGLU, RMSNorm) tiny configs.
fn variants() -> [GptConfig; 2] {
    [
        tiny(),
        GptConfig {
            positions: PositionKind::Rotary,
            tied_embeddings: true,
            mlp: MlpKind::SwiGlu,
            norm: NormKind::RmsNorm,
            ..tiny()
        },
    ]
}

#[test]
fn adamw_step_decreases_loss() {
    let device = Device::flex().autodiff();
    for config in variants() {
        let mut model = Gpt::new(&config, &device);
        let mut optim = AdamWConfig::new().init();
        let (x, y) = (tokens(2, 8, 0, &device), tokens(2, 8, 1, &device));
        let loss = model.loss(x.clone(), y.clone()).unwrap();
        let before = scalar(loss.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
        let after = scalar(model.loss(x, y).unwrap());
        assert!(after < before - 0.01, "{config:?}: {before} -> {after}");
    }
}

#[test]
fn every_parameter_gets_a_gradient() {
    let device = Device::flex().autodiff();
    for config in variants() {
        let model = Gpt::new(&config, &device);
        let loss = model
            .loss(tokens(2, 8, 0, &device), tokens(2, 8, 1, &device))
            .unwrap();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        assert_all_params_have_grads(&model, &grads);
    }
}

fn tiny_moe() -> GptConfig {
    let base = tiny();
    GptConfig {
        moe: Some(burn_moe::MoeConfig {
            capacity: burn_moe::Capacity::Factor {
                factor: 1.5,
                drop: burn_moe::DropPolicy::Weight,
            },
            aux_loss: 0.01,
            ..burn_moe::MoeConfig::new(base.d_model, 24, 4, 2)
        }),
        moe_every: 2,
        ..base
    }
}

#[test]
fn gpt_moe_blocks_params_and_forward() {
    let device = Device::flex();
    let config = tiny_moe();
    assert!(!config.is_moe_block(0) && config.is_moe_block(1));
    let model = Gpt::new(&config, &device);
    let block = |i: usize| model.blocks[i].get().unwrap().deref().clone();
    assert!(block(0).mlp.is_some() && block(0).moe.is_none());
    assert!(block(1).mlp.is_none() && block(1).moe.as_ref().unwrap().experts.len() == 4);
    assert_eq!(model.num_params(), config.num_params());
    // One MoE block of 4 experts, 2 active: the inactive 2 experts are not counted.
    let expert = 16 * 24 + 24 * 16;
    assert_eq!(config.num_params() - config.active_params(), 2 * expert);
    let logits = model.forward(tokens(2, 5, 0, &device)).unwrap();
    assert_eq!(logits.dims(), [2, 5, 256]);
    let stats = model.moe_stats();
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].tokens, 10);
    assert_eq!(stats[0].routed.iter().sum::<f64>(), 20.0);
    // The MoE layer's experts use the blocks' residual init unless told otherwise.
    let moe = config.block_at(1).moe.unwrap();
    assert_eq!(moe.residual_std, Some(config.block().residual_std));
}

#[test]
fn gpt_moe_config_errors() {
    let bad_width = GptConfig {
        moe: Some(burn_moe::MoeConfig::new(8, 24, 4, 2)),
        ..tiny()
    };
    assert!(
        bad_width
            .validate()
            .unwrap_err()
            .to_string()
            .contains("moe.d_model")
    );
    let bad_k = GptConfig {
        moe: Some(burn_moe::MoeConfig::new(16, 24, 4, 5)),
        ..tiny()
    };
    assert!(
        bad_k
            .validate()
            .unwrap_err()
            .to_string()
            .contains("top_k = 5")
    );
    let every_0 = GptConfig {
        moe_every: 0,
        ..tiny_moe()
    };
    assert!(every_0.validate().is_err());
}

#[test]
fn gpt_moe_config_serialises_to_json_and_toml() {
    let config = tiny_moe();
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<GptConfig>(&json).unwrap(), config);
    let text = toml::to_string(&config).unwrap();
    assert_eq!(toml::from_str::<GptConfig>(&text).unwrap(), config);
}

#[test]
fn config_serde_round_trip_and_defaults() {
    let config = GptConfig {
        mlp: MlpKind::SwiGlu,
        ..tiny()
    };
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<GptConfig>(&json).unwrap(), config);
    let minimal =
        r#"{"vocab_size":256,"n_layers":1,"n_heads":2,"d_model":8,"d_ff":16,"max_seq_len":4}"#;
    let parsed: GptConfig = serde_json::from_str(minimal).unwrap();
    assert_eq!(parsed.norm, NormKind::LayerNorm);
    assert!(parsed.bias);
    assert_eq!(parsed.dropout, 0.0);
    assert_eq!((parsed.moe, parsed.moe_every), (None, 1));
    assert!(
        GptConfig {
            n_heads: 3,
            ..tiny()
        }
        .validate()
        .is_err()
    );
}
