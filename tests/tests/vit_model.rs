//! The bundled ViT on one device ([`examples::vit`]): shapes, parameter count, initialisation
//! and the loss at initialisation; the order of the patches; an AdamW step with a gradient for
//! every parameter.

mod common;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::assert_all_params_have_grads;
use examples::gpt::INIT_STD;
use examples::init::{init_normal, init_uniform};
use examples::vit::{Vit, VitConfig, patchify};

fn tiny() -> VitConfig {
    VitConfig {
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        seed: 3,
        ..VitConfig::digits()
    }
}

fn images(n: usize, device: &Device) -> Tensor<4> {
    Tensor::from_data(init_uniform(0, "images", &[n, 1, 8, 8], 0.0, 1.0), device)
}

fn labels(n: usize, device: &Device) -> Tensor<1, Int> {
    let v: Vec<i64> = (0..n as i64).map(|i| (i * 7) % 10).collect();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

fn scalar(t: Tensor<1>) -> f32 {
    t.into_data().try_into_vec::<f32>().unwrap()[0]
}

#[test]
fn forward_shape_and_params() {
    let device = Device::flex();
    let config = tiny();
    let model = Vit::new(&config, &device);
    assert_eq!(model.forward(images(3, &device)).unwrap().dims(), [3, 10]);
    assert_eq!(model.predict(images(3, &device)).unwrap().dims(), [3]);
    assert_eq!(model.num_params(), config.num_params());
    assert_eq!(
        model.pos_embed.val().into_data(),
        init_normal(3, "pos_embed", &[1, 17, 16], INIT_STD)
    );
    let loss = scalar(model.loss(images(4, &device), labels(4, &device)).unwrap());
    assert!((loss - 10f32.ln()).abs() < 0.1, "{loss}");
}

#[test]
fn patchify_orders_patches() {
    let device = Device::flex();
    let data: Vec<f32> = (0..2 * 16).map(|i| i as f32).collect();
    let x = Tensor::<4>::from_data(TensorData::new(data, [1, 2, 4, 4]), &device);
    let p = patchify(x, 2);
    assert_eq!(p.dims(), [1, 4, 8]);
    let v = p.into_data().try_into_vec::<f32>().unwrap();
    // Patch 1 (top-right): channel 0 rows 0..2, columns 2..4, then channel 1.
    assert_eq!(&v[8..16], &[2.0, 3.0, 6.0, 7.0, 18.0, 19.0, 22.0, 23.0]);
}

#[test]
fn adamw_step_decreases_loss() {
    let device = Device::flex().autodiff();
    let mut model = Vit::new(&tiny(), &device);
    let mut optim = AdamWConfig::new().init();
    let (x, y) = (images(8, &device), labels(8, &device));
    let loss = model.loss(x.clone(), y.clone()).unwrap();
    let before = scalar(loss.clone());
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    assert_all_params_have_grads(&model, &grads);
    model = optim.step(1e-2, model, grads);
    let after = scalar(model.loss(x, y).unwrap());
    assert!(after < before - 0.01, "{before} -> {after}");
}
