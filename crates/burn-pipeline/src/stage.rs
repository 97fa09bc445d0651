//! What a pipeline stage is to the runtime: a Burn [`Module`] whose forward takes the tensors
//! and metadata crossing its input boundary ([`Boundary`]) plus the micro-batch's data, and
//! returns the boundary for the next stage or, on the last stage, the loss ([`StageOutput`]).
//!
//! A boundary carries any number of float tensors of any rank (each tensor gets its own
//! gradient back) and one serialisable value (`serde_json::Value`: masks as lists, lengths,
//! flags). Tensors are carried flattened with their shape, so a stage of any architecture can
//! pass a residual stream `[batch, seq, d]` next to, say, a `[batch]` tensor of lengths.
//!
//! Every rank sees the whole micro-batch's data (`&B`): the first stage reads the inputs, the
//! last the targets, the others usually nothing. The data is not sent between stages.

use burn::module::Module;
use burn::tensor::{DType, Tensor};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// An error a stage's forward reports (wrong input, a failed collective inside the stage).
/// The runtime wraps it with the stage, the micro-batch and the action.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct StageError {
    /// What went wrong, in words.
    pub message: String,
}

impl StageError {
    /// An error with this message.
    pub fn new(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
        }
    }
}

/// One float tensor crossing a stage boundary: its values flattened, and its shape.
#[derive(Clone, Debug)]
pub struct BoundaryTensor {
    flat: Tensor<1>,
    shape: Vec<usize>,
}

impl BoundaryTensor {
    /// Wraps a tensor of any rank.
    pub fn new<const D: usize>(tensor: Tensor<D>) -> Self {
        let shape = tensor.dims().to_vec();
        let n: usize = shape.iter().product();
        Self {
            flat: tensor.reshape([n]),
            shape,
        }
    }

    /// A flattened tensor and the shape it stands for (`flat` must hold `product(shape)`
    /// values).
    pub(crate) fn from_flat(flat: Tensor<1>, shape: Vec<usize>) -> Self {
        Self { flat, shape }
    }

    /// The shape of the tensor.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.flat.dtype()
    }

    /// The flattened values (differentiable: a reshape of the carried tensor).
    pub fn flat(&self) -> &Tensor<1> {
        &self.flat
    }

    /// The tensor with its shape, as a tensor of rank `D` (differentiable).
    ///
    /// # Errors
    /// [`StageError`] when the tensor is not of rank `D`.
    pub fn get<const D: usize>(&self) -> Result<Tensor<D>, StageError> {
        let dims: [usize; D] = self.shape.as_slice().try_into().map_err(|_| {
            StageError::new(format!(
                "a boundary tensor of shape {:?} was read as a tensor of rank {D}",
                self.shape
            ))
        })?;
        Ok(self.flat.clone().reshape(dims))
    }
}

/// The tensors and metadata crossing one stage boundary for one micro-batch.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_pipeline::stage::Boundary;
///
/// let device = Device::flex();
/// let x = Tensor::<3>::ones([2, 4, 8], &device);
/// let boundary = Boundary::new().with(x).with_meta(&vec![4usize, 3]).unwrap();
/// assert_eq!(boundary.get::<3>(0).unwrap().dims(), [2, 4, 8]);
/// assert_eq!(boundary.meta::<Vec<usize>>().unwrap(), vec![4, 3]);
/// assert!(boundary.get::<2>(0).is_err()); // wrong rank: an error, not a panic
/// ```
#[derive(Clone, Debug, Default)]
pub struct Boundary {
    tensors: Vec<BoundaryTensor>,
    meta: serde_json::Value,
}

impl Boundary {
    /// A boundary with no tensor and no metadata (the first stage's input).
    pub fn new() -> Self {
        Self::default()
    }

    /// From tensors and metadata.
    pub fn from_parts(tensors: Vec<BoundaryTensor>, meta: serde_json::Value) -> Self {
        Self { tensors, meta }
    }

    /// Appends a tensor of any rank.
    pub fn with<const D: usize>(mut self, tensor: Tensor<D>) -> Self {
        self.tensors.push(BoundaryTensor::new(tensor));
        self
    }

    /// Sets the metadata to `value` serialised.
    ///
    /// # Errors
    /// [`StageError`] when `value` does not serialise.
    pub fn with_meta<T: Serialize>(mut self, value: &T) -> Result<Self, StageError> {
        self.meta = serde_json::to_value(value)
            .map_err(|e| StageError::new(format!("boundary metadata does not serialise: {e}")))?;
        Ok(self)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there is no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The tensors.
    pub fn tensors(&self) -> &[BoundaryTensor] {
        &self.tensors
    }

    /// The metadata as JSON (`null` when none was set).
    pub fn meta_value(&self) -> &serde_json::Value {
        &self.meta
    }

    /// Tensor `index` as a tensor of rank `D`.
    ///
    /// # Errors
    /// [`StageError`] when there is no such tensor or its rank is not `D`.
    pub fn get<const D: usize>(&self, index: usize) -> Result<Tensor<D>, StageError> {
        self.tensors
            .get(index)
            .ok_or_else(|| {
                StageError::new(format!(
                    "boundary tensor {index} was asked for but the boundary carries {}",
                    self.tensors.len()
                ))
            })?
            .get()
    }

    /// The metadata, deserialised.
    ///
    /// # Errors
    /// [`StageError`] when it does not deserialise as `T`.
    pub fn meta<T: DeserializeOwned>(&self) -> Result<T, StageError> {
        serde_json::from_value(self.meta.clone())
            .map_err(|e| StageError::new(format!("boundary metadata: {e}")))
    }

    /// The parts.
    pub(crate) fn into_parts(self) -> (Vec<BoundaryTensor>, serde_json::Value) {
        (self.tensors, self.meta)
    }
}

/// What a stage's forward returns.
#[derive(Clone, Debug)]
// A Burn tensor is an enum over the backends of the build (640 bytes with WGPU); a stage
// returns one per micro-batch, so boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum StageOutput {
    /// The input of the next stage (every stage but the last).
    Boundary(Boundary),
    /// The loss of the micro-batch, a one-element tensor (the last stage): the mean over the
    /// micro-batch's rows and tokens. The runtime scales it by `1 / micro-batches`, so that the
    /// accumulated gradients are those of the mean loss over the whole batch.
    Loss(Tensor<1>),
}

/// One stage of a pipelined model.
///
/// `B` is the data of one micro-batch, visible to every stage. The stage's parameters are
/// those its [`Module`] implementation visits: the runtime collects their gradients with
/// [`burn::optim::GradientsParams::from_grads`] after each backward and accumulates them
/// over the micro-batches.
///
/// # Example
/// ```
/// use burn::module::{Module, Param};
/// use burn::tensor::{Device, Tensor};
/// use burn_pipeline::stage::{Boundary, Stage, StageError, StageOutput};
///
/// /// `y = x * w`, on a stage that is not the last.
/// #[derive(Module, Debug)]
/// struct Scale {
///     w: Param<Tensor<1>>,
/// }
///
/// impl Stage<()> for Scale {
///     fn forward(&self, input: Boundary, _: &()) -> Result<StageOutput, StageError> {
///         let x = input.get::<2>(0)?;
///         let y = x * self.w.val().unsqueeze::<2>();
///         Ok(StageOutput::Boundary(Boundary::new().with(y)))
///     }
/// }
///
/// let device = Device::flex();
/// let stage = Scale { w: Param::from_tensor(Tensor::from_floats([2.0, 3.0], &device)) };
/// let x = Tensor::<2>::ones([1, 2], &device);
/// let StageOutput::Boundary(out) = stage.forward(Boundary::new().with(x), &()).unwrap() else {
///     unreachable!()
/// };
/// assert_eq!(out.get::<2>(0).unwrap().into_data().to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
/// ```
pub trait Stage<B>: Module {
    /// Forward of one micro-batch.
    ///
    /// # Arguments
    /// * `input` - the previous stage's output (empty on the first stage). Its tensors are
    ///   leaves that require a gradient: the runtime reads their gradients after the backward
    ///   and sends them back.
    /// * `batch` - the micro-batch's data.
    ///
    /// # Returns
    /// [`StageOutput::Boundary`] on every stage but the last, [`StageOutput::Loss`] on the last.
    ///
    /// # Errors
    /// [`StageError`] for anything that prevents the forward.
    fn forward(&self, input: Boundary, batch: &B) -> Result<StageOutput, StageError>;

    /// The store of the stage's deferred weight gradients, when its linears are
    /// [`crate::deferred::DeferredLinear`]s: the schedule's `I` then computes no weight
    /// gradient of theirs and `W` computes them. `None` (the default): `I` runs the whole
    /// backward and `W` does nothing.
    fn deferred_weights(&self) -> Option<&crate::deferred::WeightGradStore> {
        None
    }
}
