//! Helpers shared by the model tests (`gpt_model`, `vit_model`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// Every parameter of `model` has a finite gradient in `grads`, non-zero for matrices.
pub fn assert_all_params_have_grads<M: Module>(model: &M, grads: &GradientsParams) {
    struct Check<'a> {
        grads: &'a GradientsParams,
        stack: Vec<String>,
        seen: usize,
    }
    impl ModuleVisitor for Check<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let path = self.stack.join(".");
            let grad = self
                .grads
                .get::<D>(param.id)
                .unwrap_or_else(|| panic!("no gradient for {path}"));
            let values = grad.into_data().try_into_vec::<f32>().unwrap();
            assert!(
                values.iter().all(|g| g.is_finite()),
                "{path}: non-finite gradient"
            );
            if D >= 2 {
                assert!(values.iter().any(|&g| g != 0.0), "{path}: zero gradient");
            }
            self.seen += 1;
        }
    }
    let mut check = Check {
        grads,
        stack: vec![],
        seen: 0,
    };
    model.visit(&mut check);
    assert!(check.seen > 0);
}
