//! A lone `Linear` as an FSDP unit at its own path: built with `Linear::init` inside the unit's
//! builder, its parameters keep the unwrapped model's names (`fc.weight`), so that weights
//! saved on one device (or a Hugging Face file) load into the sharded model and back.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use burn_moe::MoeParallel;
use burn_parallel::init::LinearInit;
use burn_parallel::nn::Linear;
use burn_parallel::plan::TpPlan;
use burn_parallel::{Error, ProcessGroup};
use burn_parallel_train::{Layout, ModelParts, ParallelModel, Placed, StepSettings};
use burn_zero::{Fsdp, FsdpPlan, Stage};

#[derive(Module, Debug)]
struct Tiny {
    fc: Fsdp<Linear>,
}

struct TinyConfig;

impl ParallelModel for TinyConfig {
    type Model = Tiny;
    type Batch = ();
    fn loss(model: &Tiny, _: &()) -> Result<Tensor<1>, Error> {
        let fc = model.fc.get()?;
        let x = Tensor::<2>::ones([2, 4], &fc.weight.device());
        Ok(fc.forward(x)?.powi_scalar(2).mean())
    }
    fn n_heads(&self) -> usize {
        1
    }
    fn seed(&self) -> u64 {
        3
    }
    fn tp_plan(&self, _: bool) -> TpPlan {
        TpPlan::new()
    }
    fn fsdp_plan(&self, shard: &ProcessGroup, _: &MoeParallel) -> FsdpPlan {
        FsdpPlan::new(shard).unit("fc")
    }
    fn build(&self, parts: &ModelParts) -> Result<Tiny, Error> {
        let spec = LinearInit::new(4, 6).with_bias(true);
        let at = parts.init.at("fc");
        let fc = match &parts.fsdp {
            Some(plan) => plan.wrap(&at, |init| Linear::init(init, spec))?,
            None => Fsdp::new(Linear::init(&at, spec)?),
        };
        Ok(Tiny { fc })
    }
}

#[test]
fn a_lone_linear_is_an_fsdp_unit_under_its_own_names() {
    let device = Device::flex().autodiff();
    let single = burn_parallel_learner::single_device(&TinyConfig, &device).unwrap();
    let names: Vec<String> = burn_parallel_train::named_params(&single)
        .into_iter()
        .map(|p| p.path)
        .collect();
    assert_eq!(names, ["fc.weight", "fc.bias"]);
    // Other values than the seeded ones, by the single-device names: they load into each
    // rank's shard of the unit, and the unit gathered holds them whole.
    let whole: BTreeMap<String, TensorData> = burn_parallel_train::named_params(&single)
        .into_iter()
        .map(|p| {
            let values = p.values.iter().map(|v| v + 1.0).collect::<Vec<_>>();
            (p.path, TensorData::new(values, p.shape))
        })
        .collect();
    let expected = whole.clone();
    let layout = Layout {
        zero: Some(Stage::Three),
        ..Layout::default()
    };
    let gathered = burn_parallel_train::run_local(2, move |world| {
        let settings = StepSettings {
            batch_size: 2,
            ..StepSettings::default()
        };
        let placed = Placed::new(&world, &layout, &TinyConfig, &device, &settings)?;
        assert!(placed.fsdp.is_some(), "FSDP placed");
        let placed = placed.load_params(&whole)?;
        let fc = placed.model.fc.full()?;
        Ok([
            fc.weight.val().into_data(),
            fc.bias.unwrap().val().into_data(),
        ])
    })
    .unwrap();
    for [weight, bias] in gathered {
        weight.assert_eq(&expected["fc.weight"].clone().convert::<f32>(), true);
        bias.assert_eq(&expected["fc.bias"].clone().convert::<f32>(), true);
    }
}
