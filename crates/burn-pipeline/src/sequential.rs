//! A stage for any model that is an input layer, a sequence of layers and an output layer
//! (most transformers): [`Sequential`]. The user implements three small traits on their own
//! modules and never writes a [`Stage`].
//!
//! - [`InputLayer`]: reads the micro-batch and returns the first activation (embedding, patch
//!   projection);
//! - [`Layer`]: one layer of the sequence (a transformer block), activation to activation;
//! - [`OutputLayer`]: the last activation to the micro-batch's loss (final norm, head, loss).
//!
//! Stage `i` holds the input layer when it is the first stage, its range of layers, and the
//! output layer when it is the last ([`Sequential::build`] calls the user's constructors only
//! for what the stage holds, so a rank never builds another stage's parameters). Activations
//! between stages are 3-D (`[batch, tokens, width]`). With
//! [`Sequential::with_checkpointed_layers`] every layer is recomputed in the backward
//! ([`crate::checkpoint`]).
//!
//! Parameter paths are `input.*`, `layers.{local index}.*` and `output.*`;
//! [`Sequential::global_path`] turns a local layer index into the model's.
//!
//! ```
//! use burn::module::{Module, Param};
//! use burn::tensor::{Device, Tensor};
//! use burn_pipeline::sequential::{InputLayer, Layer, OutputLayer, Sequential};
//! use burn_pipeline::stage::{Boundary, Stage, StageError, StageOutput};
//!
//! #[derive(Module, Debug)]
//! struct Lift { w: Param<Tensor<1>> }
//! impl InputLayer<Vec<f32>> for Lift {
//!     fn forward(&self, batch: &Vec<f32>) -> Result<Tensor<3>, StageError> {
//!         let x = Tensor::<1>::from_floats(batch.as_slice(), &self.w.device());
//!         Ok((x * self.w.val()).reshape([1, batch.len(), 1]))
//!     }
//! }
//! #[derive(Module, Debug)]
//! struct Tanh { b: Param<Tensor<1>> }
//! impl Layer<Vec<f32>> for Tanh {
//!     fn forward(&self, x: Tensor<3>, _: &Vec<f32>) -> Result<Tensor<3>, StageError> {
//!         Ok((x + self.b.val().unsqueeze::<3>()).tanh())
//!     }
//! }
//! #[derive(Module, Debug)]
//! struct Mse;
//! impl OutputLayer<Vec<f32>> for Mse {
//!     fn loss(&self, x: Tensor<3>, _: &Vec<f32>) -> Result<Tensor<1>, StageError> {
//!         Ok(x.powf_scalar(2.0).mean())
//!     }
//! }
//!
//! let device = Device::flex().autodiff();
//! let param = |v: f32| Param::from_tensor(Tensor::<1>::from_floats([v], &device));
//! // Stage 1 of 2, holding layers 2..4 of a model of 4 layers.
//! let stage = Sequential::<Lift, Tanh, Mse>::build(1, 2, 2..4,
//!     || Ok::<_, String>(Lift { w: param(1.0) }),
//!     |i| Ok(Tanh { b: param(i as f32) }),
//!     || Ok(Mse),
//! ).unwrap();
//! assert!(stage.input.is_none() && stage.output.is_some());
//! assert_eq!(stage.global_path("layers.1.b"), "layers.3.b");
//! let x = Tensor::<3>::zeros([1, 3, 1], &device);
//! let out = stage.forward(Boundary::new().with(x), &vec![0.0; 3]).unwrap();
//! assert!(matches!(out, StageOutput::Loss(_)));
//! ```

use std::ops::Range;

use burn::module::{Module, ModuleDisplay};
use burn::tensor::Tensor;

use crate::checkpoint::checkpoint;
use crate::deferred::WeightGradStore;
use crate::stage::{Boundary, Stage, StageError, StageOutput};

/// The first part of a staged model: the micro-batch to the first activation.
pub trait InputLayer<B>: Module + ModuleDisplay {
    /// The first activation `[batch, tokens, width]` of `batch`.
    ///
    /// # Errors
    /// [`StageError`] for anything that prevents the forward.
    fn forward(&self, batch: &B) -> Result<Tensor<3>, StageError>;
}

/// One layer of a staged model's sequence.
pub trait Layer<B>: Module + ModuleDisplay {
    /// The next activation; `batch` is there for what a layer may need of it (lengths, masks).
    ///
    /// # Errors
    /// [`StageError`] for anything that prevents the forward.
    fn forward(&self, x: Tensor<3>, batch: &B) -> Result<Tensor<3>, StageError>;
}

/// The last part of a staged model: the last activation to the micro-batch's loss.
pub trait OutputLayer<B>: Module + ModuleDisplay {
    /// The mean loss of the micro-batch, a one-element tensor.
    ///
    /// # Errors
    /// [`StageError`] for anything that prevents the forward.
    fn loss(&self, x: Tensor<3>, batch: &B) -> Result<Tensor<1>, StageError>;
}

/// One stage of a model made of an input layer, layers and an output layer (see the
/// [module docs](self)).
#[derive(Module, Debug)]
pub struct Sequential<I: Module, L: Module, O: Module> {
    /// The input layer (first stage).
    pub input: Option<I>,
    /// This stage's layers.
    pub layers: Vec<L>,
    /// The output layer (last stage).
    pub output: Option<O>,
    /// The model index of `layers[0]`.
    #[module(skip)]
    pub first_layer: usize,
    /// Recompute every layer in the backward.
    #[module(skip)]
    pub checkpoint_layers: bool,
    /// The layers' linears defer their weight gradients to the schedule's `W` steps
    /// ([`Self::with_deferred_weights`]).
    #[module(skip)]
    pub defer_weights: bool,
    /// Where recomputed layers leave their parameter gradients, and deferring linears their
    /// `(X, dY)` pairs.
    #[module(skip)]
    pub store: WeightGradStore,
}

impl<I: Module, L: Module, O: Module> Sequential<I, L, O> {
    /// Stage `index` of `num_stages`, holding the model's layers `layers` (from
    /// [`crate::partition`]): `input()` is called on the first stage only, `layer(i)` for each
    /// model index `i` in `layers`, `output()` on the last stage only.
    ///
    /// # Errors
    /// The first error of a constructor.
    pub fn build<E>(
        index: usize,
        num_stages: usize,
        layers: Range<usize>,
        input: impl FnOnce() -> Result<I, E>,
        layer: impl FnMut(usize) -> Result<L, E>,
        output: impl FnOnce() -> Result<O, E>,
    ) -> Result<Self, E> {
        let first_layer = layers.start;
        Ok(Self {
            input: if index == 0 { Some(input()?) } else { None },
            layers: layers.map(layer).collect::<Result<Vec<_>, E>>()?,
            output: if index + 1 == num_stages {
                Some(output()?)
            } else {
                None
            },
            first_layer,
            checkpoint_layers: false,
            defer_weights: false,
            store: WeightGradStore::new(),
        })
    }

    /// Tells the runtime that this stage's layers defer the weight gradients of their linears
    /// to the schedule's `W` steps (zero-bubble schedules): build them with
    /// [`Self::weight_sink`] as their sink (`burn_parallel::nn::Linear::with_deferred_weight`)
    /// and set this, so that a backward computes only the input gradients and `W` the rest.
    pub fn with_deferred_weights(mut self, on: bool) -> Self {
        self.defer_weights = on;
        self
    }

    /// The sink the layers' linears give their `(X, dY)` pairs to when they defer their
    /// weight gradients: this stage's store ([`Self::with_deferred_weights`]).
    pub fn weight_sink(&self) -> std::sync::Arc<dyn burn_parallel::autograd::WeightGradSink> {
        std::sync::Arc::new(self.store.clone())
    }

    /// Recomputes every layer in the backward instead of keeping its activations (each layer
    /// keeps only its input); its forward must be deterministic.
    pub fn with_checkpointed_layers(mut self, on: bool) -> Self {
        self.checkpoint_layers = on;
        self
    }

    /// The model's path of a parameter of this stage: `layers.{local}.rest` becomes
    /// `layers.{first_layer + local}.rest`; other paths are unchanged.
    pub fn global_path(&self, path: &str) -> String {
        global_path(self.first_layer, path)
    }
}

/// `path` of a stage whose first layer is `first_layer` in the model's layer numbering.
fn global_path(first_layer: usize, path: &str) -> String {
    let Some(rest) = path.strip_prefix("layers.") else {
        return path.to_string();
    };
    let (local, tail) = rest.split_once('.').unwrap_or((rest, ""));
    match local.parse::<usize>() {
        Ok(i) if tail.is_empty() => format!("layers.{}", i + first_layer),
        Ok(i) => format!("layers.{}.{tail}", i + first_layer),
        Err(_) => path.to_string(),
    }
}

/// `path` of a stage whose first layer is `first_layer` in the flat single-device model.
fn flat_path(first_layer: usize, path: &str) -> String {
    match path
        .strip_prefix("input.")
        .or_else(|| path.strip_prefix("output."))
    {
        Some(rest) => rest.to_string(),
        None => global_path(first_layer, path),
    }
}

impl<I: Module, L: Module, O: Module> Sequential<I, L, O> {
    /// The path of a parameter of this stage in a single-device model that holds the input
    /// layer's fields, its layers as `layers` and the output layer's fields side by side
    /// (`embed`, `layers`, `norm`, `head`): `input.embed.weight` is `embed.weight`,
    /// `layers.{local}.*` is `layers.{first_layer + local}.*` ([`Self::global_path`]),
    /// `output.head.weight` is `head.weight`. The names a pipelined checkpoint is saved under
    /// (`crate::update::StageUpdater::save`) so that the single-device model, or any other
    /// layout of it, loads it.
    ///
    /// ```
    /// use burn::module::{Module, Param};
    /// use burn::tensor::{Device, Tensor};
    /// use burn_pipeline::sequential::Sequential;
    ///
    /// #[derive(Module, Debug)]
    /// struct Part { w: Param<Tensor<1>> }
    /// let device = Device::flex();
    /// let part = || Ok::<_, String>(Part { w: Param::from_tensor(Tensor::zeros([1], &device)) });
    /// let stage = Sequential::<Part, Part, Part>::build(1, 2, 2..4, part, |_| part(), part)
    ///     .unwrap();
    /// assert_eq!(stage.flat_path("layers.1.w"), "layers.3.w");
    /// assert_eq!(stage.flat_path("output.w"), "w");
    /// ```
    pub fn flat_path(&self, path: &str) -> String {
        flat_path(self.first_layer, path)
    }

    /// [`Self::flat_path`] as a function that owns what it needs (for names that outlive the
    /// stage's borrow: a ZeRO optimizer's logical names, a builder's path map).
    pub fn flat_paths(&self) -> impl Fn(&str) -> String + Send + Sync + Clone + 'static {
        let first_layer = self.first_layer;
        move |path| flat_path(first_layer, path)
    }
}

impl<B, I, L, O> Stage<B> for Sequential<I, L, O>
where
    B: Clone + Send + Sync + 'static,
    I: InputLayer<B>,
    L: Layer<B> + Send + Sync + 'static,
    O: OutputLayer<B>,
{
    fn forward(&self, input: Boundary, batch: &B) -> Result<StageOutput, StageError> {
        let mut x = match &self.input {
            Some(first) => first.forward(batch)?,
            None => input.get::<3>(0)?,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            x = if self.checkpoint_layers {
                let (batch, index) = (batch.clone(), self.first_layer + i);
                checkpoint(layer, x, &self.store, move |layer: &L, x| {
                    layer
                        .forward(x, &batch)
                        .unwrap_or_else(|e| panic!("layer {index}: {}", e.message))
                })
            } else {
                layer.forward(x, batch)?
            };
        }
        Ok(match &self.output {
            Some(last) => StageOutput::Loss(last.loss(x, batch)?),
            None => StageOutput::Boundary(Boundary::new().with(x)),
        })
    }

    fn deferred_weights(&self) -> Option<&WeightGradStore> {
        (self.checkpoint_layers || self.defer_weights).then_some(&self.store)
    }
}
