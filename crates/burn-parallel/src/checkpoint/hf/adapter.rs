//! [`Adapter`]: a model's name mapping onto a checkpoint layout (torchtitan's state-dict
//! adapter). The model supplies the table, one [`Entry`] per checkpoint tensor: its name, its
//! shape and the parameters it is made of ([`Source`]); the adapter checks a checkpoint against
//! it and maps it onto the parameters ([`Adapter::from_hf`]), or the parameters onto the layout
//! ([`Adapter::to_hf`]).

use std::collections::{BTreeMap, BTreeSet};

use burn::tensor::TensorData;

use crate::checkpoint::{CheckpointError, Result};

/// What one checkpoint tensor is made of among a model's parameters (by module path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The parameter as it is (GPT-2's Conv1D weights are `[in, out]`, as Burn's).
    Param(String),
    /// The 2-D parameter transposed (`nn.Linear`'s weights are `[out, in]`).
    Transposed(String),
    /// Parameters of equal shape concatenated along their last axis (GPT-2's fused `c_attn`
    /// is q, k and v side by side).
    Fused(Vec<String>),
}

/// One tensor of a checkpoint layout: its name (without the layout's prefix), its shape in the
/// checkpoint and what it is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The tensor's name in the checkpoint, without [`Adapter::with_prefix`]'s prefix.
    pub name: String,
    /// Its shape in the checkpoint.
    pub shape: Vec<usize>,
    /// The parameters it is made of.
    pub source: Source,
}

impl Entry {
    /// Tensor `name` of `shape` is parameter `param` as it is.
    pub fn param(name: impl Into<String>, shape: &[usize], param: impl Into<String>) -> Self {
        let (name, shape) = (name.into(), shape.to_vec());
        let source = Source::Param(param.into());
        Self {
            name,
            shape,
            source,
        }
    }

    /// Tensor `name` of `shape` (2-D) is parameter `param` transposed.
    ///
    /// # Panics
    /// If `shape` is not 2-D (a bug of the table).
    pub fn transposed(name: impl Into<String>, shape: &[usize], param: impl Into<String>) -> Self {
        let name = name.into();
        assert_eq!(
            shape.len(),
            2,
            "hf::Entry `{name}`: a transposed tensor is 2-D"
        );
        let source = Source::Transposed(param.into());
        let shape = shape.to_vec();
        Self {
            name,
            shape,
            source,
        }
    }

    /// Tensor `name` of `shape` is `params` concatenated along their last axis, each of
    /// `shape` with the last axis divided by their number.
    ///
    /// # Panics
    /// If `params` is empty or does not divide the last axis of `shape` (a bug of the table).
    pub fn fused<S: Into<String>>(
        name: impl Into<String>,
        shape: &[usize],
        params: impl IntoIterator<Item = S>,
    ) -> Self {
        let name = name.into();
        let params: Vec<String> = params.into_iter().map(Into::into).collect();
        let last = shape.last().copied().unwrap_or(0);
        assert!(
            !params.is_empty() && last % params.len() == 0,
            "hf::Entry `{name}`: {} parameters do not split the last axis of {shape:?}",
            params.len()
        );
        let shape = shape.to_vec();
        let source = Source::Fused(params);
        Self {
            name,
            shape,
            source,
        }
    }

    /// The parameters this tensor is made of, each with its shape.
    ///
    /// ```
    /// use burn_parallel::checkpoint::hf::Entry;
    ///
    /// let qkv = Entry::fused("c_attn.weight", &[4, 12], ["q", "k", "v"]);
    /// assert_eq!(qkv.params()[1], ("k", vec![4, 4]));
    /// assert_eq!(Entry::transposed("w", &[2, 3], "p").params(), vec![("p", vec![3, 2])]);
    /// ```
    pub fn params(&self) -> Vec<(&str, Vec<usize>)> {
        match &self.source {
            Source::Param(p) => vec![(p.as_str(), self.shape.clone())],
            Source::Transposed(p) => vec![(p.as_str(), vec![self.shape[1], self.shape[0]])],
            Source::Fused(ps) => {
                let mut shape = self.shape.clone();
                *shape.last_mut().expect("checked by Entry::fused") /= ps.len();
                ps.iter().map(|p| (p.as_str(), shape.clone())).collect()
            }
        }
    }
}

/// A model's mapping onto a checkpoint layout: the table of its tensors ([`Entry`]), a prefix
/// the names may carry (GPT-2's `transformer.`), tied aliases (a tied head saved anyway) and
/// buffers that carry no weight (old GPT-2 checkpoints' causal masks).
///
/// ```
/// use std::collections::BTreeMap;
/// use burn::tensor::TensorData;
/// use burn_parallel::checkpoint::hf::{Adapter, Entry};
///
/// // `nn.Linear`'s `[out, in]` weight is Burn's `[in, out]` parameter transposed.
/// let adapter = Adapter::new([Entry::transposed("proj.weight", &[3, 2], "linear.weight")])
///     .with_prefix("model.")
///     .with_skipped("rotary.*.inv_freq");
/// let params = BTreeMap::from([(
///     "linear.weight".to_string(),
///     TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]),
/// )]);
/// let checkpoint = adapter.to_hf(params.clone()).unwrap();
/// let proj = &checkpoint["model.proj.weight"];
/// assert_eq!(proj.shape().to_vec(), vec![3, 2]);
/// assert_eq!(proj.try_to_vec::<f32>().unwrap(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
/// // Read back (with a buffer to skip): the same parameters.
/// let mut checkpoint = checkpoint;
/// checkpoint.insert("rotary.0.inv_freq".into(), TensorData::new(vec![1.0f32], [1]));
/// assert_eq!(adapter.from_hf(checkpoint).unwrap(), params);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Adapter {
    entries: Vec<Entry>,
    prefix: String,
    tied: Vec<(String, String)>,
    skipped: Vec<String>,
}

impl Adapter {
    /// The mapping of the tensors `entries`, in the layout's order; no prefix, alias or
    /// skipped buffer.
    pub fn new(entries: impl IntoIterator<Item = Entry>) -> Self {
        Self {
            entries: entries.into_iter().collect(),
            ..Self::default()
        }
    }

    /// Names in the checkpoint may carry `prefix` (`"transformer."`): [`Self::from_hf`] strips
    /// it where present, [`Self::to_hf`] writes every name with it.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Tensor `tensor` of a checkpoint (`"lm_head.weight"`), when present, must equal
    /// parameter `param` (`"wte.weight"`): [`Self::from_hf`] checks and drops it,
    /// [`Self::to_hf`] does not write it.
    pub fn with_tied(mut self, tensor: impl Into<String>, param: impl Into<String>) -> Self {
        self.tied.push((tensor.into(), param.into()));
        self
    }

    /// Tensors whose name (prefix stripped) matches `pattern` carry no weight and are skipped
    /// by [`Self::from_hf`]: `pattern` is a dotted name in which `*` stands for any one part
    /// (`"h.*.attn.bias"`).
    pub fn with_skipped(mut self, pattern: impl Into<String>) -> Self {
        self.skipped.push(pattern.into());
        self
    }

    /// The table, in the layout's order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Every parameter the table makes, with its shape: what a model must hold, exactly, for
    /// [`Self::from_hf`]'s result to load into it.
    pub fn param_shapes(&self) -> BTreeMap<String, Vec<usize>> {
        let params = self.entries.iter().flat_map(Entry::params);
        params.map(|(p, s)| (p.to_string(), s)).collect()
    }

    fn is_skipped(&self, name: &str) -> bool {
        self.skipped.iter().any(|pattern| {
            let (mut p, mut n) = (pattern.split('.'), name.split('.'));
            loop {
                match (p.next(), n.next()) {
                    (None, None) => return true,
                    (Some(a), Some(b)) if a == "*" || a == b => {}
                    _ => return false,
                }
            }
        })
    }

    /// Maps the tensors of a checkpoint (as [`super::read_dir`] reads them, names with or
    /// without the prefix, any float dtype) onto the model's parameters, as `f32`.
    ///
    /// # Arguments
    /// - `tensors`: the checkpoint's tensors by name.
    ///
    /// # Returns
    /// Every parameter of [`Self::param_shapes`] by path, `f32`: a
    /// [`TensorSource`](crate::checkpoint::TensorSource) that loads under any layout
    /// ([`ParamMap::load_params`](crate::checkpoint::ParamMap::load_params)).
    ///
    /// # Errors
    /// [`CheckpointError::Duplicate`] for a tensor stored with and without the prefix;
    /// [`CheckpointError::Shape`] naming the first tensor (in the table's order) of another
    /// shape than its entry's, or a tied alias of another shape than its parameter;
    /// [`CheckpointError::Dtype`] naming a tensor that is not a float;
    /// [`CheckpointError::Tied`] for a tied alias that differs from its parameter;
    /// [`CheckpointError::Unmapped`] listing every missing tensor and every tensor that maps to
    /// nothing (skipped buffers aside), with their shapes.
    pub fn from_hf(
        &self,
        tensors: BTreeMap<String, TensorData>,
    ) -> Result<BTreeMap<String, TensorData>> {
        let mut by_name = BTreeMap::new();
        for (name, tensor) in tensors {
            let name = match name.strip_prefix(&self.prefix) {
                Some(rest) if !self.prefix.is_empty() => rest.to_string(),
                _ => name,
            };
            if by_name.contains_key(&name) {
                let prefix = self.prefix.clone();
                return Err(CheckpointError::Duplicate {
                    tensor: name,
                    prefix,
                });
            }
            by_name.insert(name, tensor);
        }
        let mut params = BTreeMap::new();
        let mut missing = Vec::new();
        for entry in &self.entries {
            let Some(tensor) = by_name.remove(&entry.name) else {
                missing.push((entry.name.clone(), entry.shape.clone()));
                continue;
            };
            let tensor = Host::read(&entry.name, &entry.shape, tensor)?;
            let parts = match &entry.source {
                Source::Param(_) => vec![tensor],
                Source::Transposed(_) => vec![tensor.transposed()],
                Source::Fused(ps) => tensor.split_last(ps.len()),
            };
            let names = entry.params().into_iter().map(|(p, _)| p.to_string());
            params.extend(names.zip(parts));
        }
        for (name, param) in &self.tied {
            if let (Some(alias), Some(value)) = (by_name.remove(name), params.get(param))
                && Host::read(name, &value.shape, alias)?.values != value.values
            {
                return Err(CheckpointError::Tied {
                    tensor: name.clone(),
                    param: param.clone(),
                });
            }
        }
        let unexpected: Vec<(String, Vec<usize>)> = by_name
            .into_iter()
            .filter(|(name, _)| !self.is_skipped(name))
            .map(|(name, t)| (name, t.shape().to_vec()))
            .collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            return Err(CheckpointError::Unmapped {
                missing,
                unexpected,
            });
        }
        Ok(params.into_iter().map(|(p, t)| (p, t.data())).collect())
    }

    /// Maps the model's parameters onto the checkpoint layout: every tensor of the table, in
    /// `f32`, named with the prefix (tied aliases are not written).
    ///
    /// # Arguments
    /// - `params`: the model's parameters by path (any float dtype), whole (not sharded).
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] naming a parameter the table needs and `params` lacks, or one
    /// of `params` that no tensor of the table is made of (the layout cannot hold it);
    /// [`CheckpointError::Shape`] naming a parameter of another shape than its entry implies;
    /// [`CheckpointError::Dtype`] naming a parameter that is not a float.
    pub fn to_hf(
        &self,
        mut params: BTreeMap<String, TensorData>,
    ) -> Result<BTreeMap<String, TensorData>> {
        let mut out = BTreeMap::new();
        let mut used = BTreeSet::new();
        for entry in &self.entries {
            let mut parts = Vec::new();
            for (param, shape) in entry.params() {
                let data = match params.remove(param) {
                    Some(data) => data,
                    None if used.contains(param) => {
                        return Err(CheckpointError::piece(
                            param,
                            "the mapping makes two tensors of this parameter; tie the second",
                        ));
                    }
                    None => {
                        let reason = format!(
                            "the mapping makes `{}` of it, but the model has no such parameter",
                            entry.name
                        );
                        return Err(CheckpointError::piece(param, reason));
                    }
                };
                parts.push(Host::read(param, &shape, data)?);
                used.insert(param);
            }
            let tensor = match &entry.source {
                Source::Param(_) => parts.pop().expect("one part"),
                Source::Transposed(_) => parts[0].transposed(),
                Source::Fused(_) => Host::concat_last(&parts),
            };
            out.insert(format!("{}{}", self.prefix, entry.name), tensor.data());
        }
        if let Some(param) = params.keys().next() {
            return Err(CheckpointError::piece(
                param,
                "no tensor of the mapping is made of this parameter: the layout cannot hold it",
            ));
        }
        Ok(out)
    }
}

/// An `f32` host tensor: row-major values and their shape.
#[derive(Debug, PartialEq)]
struct Host {
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl Host {
    /// Tensor `name`'s values as `f32`, after checking that it has `shape` and is a float.
    fn read(name: &str, shape: &[usize], data: TensorData) -> Result<Self> {
        if data.shape().as_slice() != shape {
            return Err(CheckpointError::Shape {
                tensor: name.into(),
                expected: shape.to_vec(),
                found: data.shape().to_vec(),
            });
        }
        let dtype = data.dtype();
        let dtype_error = || CheckpointError::Dtype {
            tensor: name.into(),
            dtype: format!("{dtype:?}"),
        };
        if !dtype.is_float() {
            return Err(dtype_error());
        }
        let values = data.try_into_vec_as::<f32>().map_err(|_| dtype_error())?;
        let shape = shape.to_vec();
        Ok(Self { shape, values })
    }

    fn data(self) -> TensorData {
        TensorData::new(self.values, self.shape)
    }

    /// The 2-D tensor transposed.
    fn transposed(&self) -> Self {
        let [r, c] = [self.shape[0], self.shape[1]];
        let mut values = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                values[j * r + i] = self.values[i * c + j];
            }
        }
        let shape = vec![c, r];
        Self { shape, values }
    }

    /// `parts` (of equal shapes but the last axis) concatenated along their last axis.
    fn concat_last(parts: &[Self]) -> Self {
        let widths: Vec<usize> = parts.iter().map(|p| *p.shape.last().unwrap()).collect();
        let rows = parts[0].values.len() / widths[0].max(1);
        let mut values = Vec::with_capacity(rows * widths.iter().sum::<usize>());
        for r in 0..rows {
            for (p, w) in parts.iter().zip(&widths) {
                values.extend_from_slice(&p.values[r * w..(r + 1) * w]);
            }
        }
        let mut shape = parts[0].shape.clone();
        *shape.last_mut().unwrap() = widths.iter().sum();
        Self { shape, values }
    }

    /// The last axis split into `n` equal parts.
    fn split_last(&self, n: usize) -> Vec<Self> {
        let width = *self.shape.last().unwrap() / n;
        let rows = self.values.len() / (width * n).max(1);
        let mut shape = self.shape.clone();
        *shape.last_mut().unwrap() = width;
        (0..n)
            .map(|k| {
                let mut values = Vec::with_capacity(rows * width);
                for r in 0..rows {
                    let start = r * width * n + k * width;
                    values.extend_from_slice(&self.values[start..start + width]);
                }
                let shape = shape.clone();
                Self { shape, values }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    fn data(shape: &[usize], offset: f32) -> TensorData {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| offset + i as f32).collect();
        TensorData::new(values, shape.to_vec())
    }

    /// A GPT-2-like table: a plain, a transposed and a fused entry, a prefix, a tied head and
    /// a skipped buffer.
    fn adapter() -> Adapter {
        Adapter::new([
            Entry::param("wte.weight", &[5, 2], "wte.weight"),
            Entry::transposed("h.0.proj.weight", &[3, 2], "blocks.0.proj.weight"),
            Entry::fused(
                "h.0.qkv.weight",
                &[2, 6],
                ["q.weight", "k.weight", "v.weight"],
            ),
            Entry::fused("h.0.qkv.bias", &[6], ["q.bias", "k.bias", "v.bias"]),
        ])
        .with_prefix("transformer.")
        .with_tied("lm_head.weight", "wte.weight")
        .with_skipped("h.*.attn.bias")
    }

    fn params() -> BTreeMap<String, TensorData> {
        let shapes = adapter().param_shapes();
        let params = shapes.iter().enumerate();
        params
            .map(|(i, (p, s))| (p.clone(), data(s, 100.0 * i as f32)))
            .collect()
    }

    type Shapes = Vec<(String, Vec<usize>)>;

    fn unmapped(err: CheckpointError) -> (Shapes, Shapes) {
        match err {
            CheckpointError::Unmapped {
                missing,
                unexpected,
            } => (missing, unexpected),
            other => panic!("expected Unmapped, got {other}"),
        }
    }

    #[test]
    fn round_trip_gives_back_the_parameters() {
        let hf = adapter().to_hf(params()).unwrap();
        let names: Vec<&str> = hf.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "transformer.h.0.proj.weight",
                "transformer.h.0.qkv.bias",
                "transformer.h.0.qkv.weight",
                "transformer.wte.weight"
            ]
        );
        // The fused weight is q, k, v side by side, row by row.
        let qkv = hf["transformer.h.0.qkv.weight"]
            .try_to_vec::<f32>()
            .unwrap();
        let p = params();
        let row =
            |name: &str, r: usize| p[name].try_to_vec::<f32>().unwrap()[2 * r..2 * r + 2].to_vec();
        let first_row = [row("q.weight", 0), row("k.weight", 0), row("v.weight", 0)].concat();
        assert_eq!(qkv[..6], first_row[..]);
        // The transposed weight is [out, in].
        let proj = hf["transformer.h.0.proj.weight"]
            .try_to_vec::<f32>()
            .unwrap();
        let ours = p["blocks.0.proj.weight"].try_to_vec::<f32>().unwrap();
        assert_eq!((proj[1], proj[2]), (ours[3], ours[1]));
        assert_eq!(adapter().from_hf(hf.clone()).unwrap(), params());
        // Without the prefix, in another dtype, with a skipped buffer and an equal tied head.
        let mut bare: BTreeMap<String, TensorData> = hf
            .into_iter()
            .map(|(k, t)| {
                (
                    k["transformer.".len()..].to_string(),
                    t.convert_dtype(DType::F64),
                )
            })
            .collect();
        bare.insert("h.0.attn.bias".into(), data(&[1, 1, 4, 4], 0.0));
        bare.insert("lm_head.weight".into(), params()["wte.weight"].clone());
        assert_eq!(adapter().from_hf(bare).unwrap(), params());
    }

    #[test]
    fn a_tensor_with_and_without_the_prefix_is_a_duplicate() {
        let mut hf = adapter().to_hf(params()).unwrap();
        hf.insert("wte.weight".into(), data(&[5, 2], 0.0));
        match adapter().from_hf(hf) {
            Err(CheckpointError::Duplicate { tensor, prefix }) => {
                assert_eq!(
                    (tensor.as_str(), prefix.as_str()),
                    ("wte.weight", "transformer.")
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_shape_mismatch_names_the_tensor_and_both_shapes() {
        let mut hf = adapter().to_hf(params()).unwrap();
        hf.insert("transformer.h.0.qkv.weight".into(), data(&[6, 2], 0.0));
        let err = adapter().from_hf(hf).unwrap_err();
        let text = err.to_string();
        match err {
            CheckpointError::Shape {
                tensor,
                expected,
                found,
            } => assert_eq!(
                (tensor, expected, found),
                ("h.0.qkv.weight".into(), vec![2, 6], vec![6, 2])
            ),
            other => panic!("{other}"),
        }
        assert!(text.contains("`h.0.qkv.weight` has shape [6, 2]"), "{text}");
        // On export, a parameter of another shape is named.
        let mut p = params();
        p.insert("k.weight".into(), data(&[2, 3], 0.0));
        assert!(matches!(
            adapter().to_hf(p),
            Err(CheckpointError::Shape { tensor, .. }) if tensor == "k.weight"
        ));
    }

    #[test]
    fn every_missing_and_unexpected_tensor_is_listed_with_its_shape() {
        let mut hf = adapter().to_hf(params()).unwrap();
        hf.remove("transformer.h.0.qkv.bias");
        hf.remove("transformer.wte.weight");
        hf.insert("transformer.h.0.extra".into(), data(&[2, 3], 0.0));
        // Not skipped: the pattern's `*` is one part only.
        hf.insert("h.0.1.attn.bias".into(), data(&[1], 0.0));
        let err = adapter().from_hf(hf).unwrap_err();
        let text = err.to_string();
        let (missing, unexpected) = unmapped(err);
        let list = |v: &[(&str, &[usize])]| -> Shapes {
            v.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect()
        };
        assert_eq!(
            missing,
            list(&[("wte.weight", &[5, 2]), ("h.0.qkv.bias", &[6])])
        );
        assert_eq!(
            unexpected,
            list(&[("h.0.1.attn.bias", &[1]), ("h.0.extra", &[2, 3])])
        );
        assert!(
            text.contains("2 missing: `wte.weight` [5, 2], `h.0.qkv.bias` [6]; 2 unexpected"),
            "{text}"
        );
        // Export: a parameter missing or one the layout cannot hold is named.
        let mut p = params();
        p.remove("v.bias");
        assert!(
            matches!(adapter().to_hf(p), Err(CheckpointError::Piece { name, .. }) if name == "v.bias")
        );
        let mut p = params();
        p.insert("extra".into(), data(&[1], 0.0));
        assert!(
            matches!(adapter().to_hf(p), Err(CheckpointError::Piece { name, .. }) if name == "extra")
        );
    }

    #[test]
    fn a_tensor_that_is_not_a_float_is_refused_by_name() {
        let mut hf = adapter().to_hf(params()).unwrap();
        hf.insert(
            "transformer.h.0.qkv.bias".into(),
            TensorData::new(vec![1i64; 6], [6]),
        );
        match adapter().from_hf(hf) {
            Err(CheckpointError::Dtype { tensor, dtype }) => {
                assert_eq!((tensor.as_str(), dtype.as_str()), ("h.0.qkv.bias", "I64"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tied_alias_must_equal_its_parameter() {
        let mut hf = adapter().to_hf(params()).unwrap();
        let mut head = params()["wte.weight"].try_to_vec::<f32>().unwrap();
        head[3] += 1.0;
        hf.insert("lm_head.weight".into(), TensorData::new(head, [5, 2]));
        let err = adapter().from_hf(hf.clone()).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Tied { tensor, param } if tensor == "lm_head.weight" && param == "wte.weight"),
            "{err}"
        );
        hf.insert("lm_head.weight".into(), data(&[2, 5], 0.0));
        assert!(matches!(
            adapter().from_hf(hf),
            Err(CheckpointError::Shape { tensor, .. }) if tensor == "lm_head.weight"
        ));
        // Without the alias, the head is an unexpected tensor.
        let hf = Adapter::new([Entry::param("w", &[1], "w")]);
        let t = BTreeMap::from([
            ("w".into(), data(&[1], 0.0)),
            ("lm_head.weight".into(), data(&[1], 0.0)),
        ]);
        assert_eq!(
            unmapped(hf.from_hf(t).unwrap_err()).1,
            vec![("lm_head.weight".into(), vec![1])]
        );
    }
}
