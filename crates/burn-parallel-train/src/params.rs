//! [`NamedParam`]: a parameter's path, shape and values on the host, the form in which a
//! trainer reports (and a test compares with single-device training) the trained model;
//! [`named_params`] reads them from any module.

use burn::module::Module;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// One parameter of a trained model: its module path, shape and values (fp32, on the host).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedParam {
    /// Module path, as Burn's module visitor names it (`"blocks.0.attn.q.weight"`).
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values in row-major order, converted to fp32.
    pub values: Vec<f32>,
}

/// Every float parameter of `module`, in visiting order, with its path, as fp32 host values.
///
/// # Arguments
/// * `module` - any Burn module.
///
/// # Returns
/// One [`NamedParam`] per float parameter.
///
/// # Example
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_parallel_train::named_params;
///
/// let params = named_params(&LinearConfig::new(3, 2).init(&Device::flex()));
/// assert_eq!(params[0].path, "weight");
/// assert_eq!(params[0].shape, vec![3, 2]);
/// assert_eq!(params[1].values.len(), 2);
/// ```
pub fn named_params<M: Module>(module: &M) -> Vec<NamedParam> {
    struct Collect {
        stack: Vec<String>,
        out: Vec<NamedParam>,
    }
    impl burn::module::ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let value = param.val();
            self.out.push(NamedParam {
                path: self.stack.join("."),
                shape: value.dims().to_vec(),
                values: value
                    .try_into_vec_as::<f32>()
                    .expect("a float parameter reads as f32"),
            });
        }
    }
    let mut collect = Collect {
        stack: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut collect);
    collect.out
}
