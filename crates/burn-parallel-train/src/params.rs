//! [`NamedParam`]: a parameter's path, shape and values on the host, the form in which a
//! trainer reports (and a test compares with single-device training) the trained model;
//! [`named_params`] reads them from any module, [`load_named`] writes such values back.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorData};
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

/// `module` with every float parameter whose path is a key of `values` replaced by that value
/// (converted to the parameter's dtype, on its device, and requiring a gradient when the
/// parameter did); the other parameters are kept. The inverse of [`named_params`]: a
/// single-device model filled from gathered or imported tensors.
///
/// # Example
/// ```
/// use std::collections::HashMap;
/// use burn::nn::LinearConfig;
/// use burn::tensor::{Device, TensorData};
/// use burn_parallel_train::{load_named, named_params};
///
/// let linear = LinearConfig::new(3, 2).init(&Device::flex());
/// let bias = TensorData::new(vec![1.0f32, 2.0], [2]);
/// let loaded = load_named(linear, &HashMap::from([("bias".to_string(), bias)]));
/// assert_eq!(named_params(&loaded)[1].values, vec![1.0, 2.0]);
/// ```
pub fn load_named<M: Module>(module: M, values: &HashMap<String, TensorData>) -> M {
    struct Load<'a> {
        path: Vec<String>,
        values: &'a HashMap<String, TensorData>,
    }
    impl ModuleMapper for Load<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(data) = self.values.get(&self.path.join(".")) else {
                return param;
            };
            param.map(|t| {
                let (grad, dtype) = (t.is_require_grad(), t.dtype());
                let data = data.clone().convert_dtype(dtype);
                let v = Tensor::<D>::from_data(data, (&t.device(), dtype));
                if grad { v.require_grad() } else { v }
            })
        }
    }
    module.map(&mut Load {
        path: Vec::new(),
        values,
    })
}
