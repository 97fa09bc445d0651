//! A Burn module's parameters and optimizer state as logical tensors.
//!
//! [`ParamMap`] describes how each parameter *this rank* holds maps onto the logical
//! (single-device) parameters: whole (replicated), a tensor-parallel shard (from the
//! [`TpContext`] the model was built with, padding dropped), or a flat FSDP shard covering parts
//! of several parameters (from the [`DataShards`](crate::train::DataShards) the units registered
//! in). With it a rank turns
//! its module, and its optimizer's state, into [`Piece`]s, and reads them back from a checkpoint
//! saved under any other layout.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::OptimizerRecord;
use burn::tensor::{DType, Tensor, TensorData};
use serde_json::Value;

use super::{
    Checkpoint, CheckpointError, Piece, Region, Result, TensorSource, check_tensors, even_part,
};
use crate::nn::TpContext;

/// One parameter of an FSDP unit's flat space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatPart {
    /// Its path inside the unit.
    pub path: String,
    /// Its id when the unit was built (the id the tensor-parallel context knows it by).
    pub id: ParamId,
    /// Its (tensor-parallel local) shape.
    pub shape: Vec<usize>,
    /// Its first element in the flat space.
    pub offset: usize,
}

/// The flat space of an FSDP unit and the range of it a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatParts {
    /// The parameters, in flat order.
    pub parts: Vec<FlatPart>,
    /// This rank's range of the flat space.
    pub range: Range<usize>,
}

/// How a rank holds a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// Whole, like every rank of its replica group.
    Replicated,
    /// A tensor-parallel shard.
    TpSharded,
    /// A flat data-parallel shard (FSDP), covering parts of one or more parameters.
    Flat,
}

/// A correspondence between a region of a logical tensor and a region of a local parameter
/// (same number of elements, in the same order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The logical tensor's name (its single-device path).
    pub logical: String,
    /// The region of the logical tensor.
    pub region: Region,
    /// The region of the local parameter.
    pub local: Region,
}

impl Segment {
    /// The parts of the segment that lie in flat range `range` of the local parameter, each
    /// with the local position of its first element: one part per contiguous run of the local
    /// region in the range (a whole parameter, or one padded along its first dimension, is one
    /// run; tensor-parallel padding along another dimension leaves one run per row).
    fn restrict(&self, range: Range<usize>) -> std::result::Result<Vec<(Segment, usize)>, String> {
        let mut cuts = Vec::new();
        // Elements of the segment before the current run, in the segment's order.
        let mut before = 0;
        for run in self.local.runs() {
            let (a, b) = (range.start.max(run.start), range.end.min(run.end));
            if a < b {
                let part = before + (a - run.start)..before + (b - run.start);
                let cut = Segment {
                    logical: self.logical.clone(),
                    region: self.region.flat_part(part.clone())?,
                    local: self.local.flat_part(part)?,
                };
                cuts.push((cut, a));
            }
            before += run.len();
        }
        Ok(cuts)
    }

    /// Part `index` of `parts` equal flat parts of the segment (the share of one of `parts`
    /// ranks holding the same copy).
    pub fn part(&self, parts: usize, index: usize) -> Segment {
        let (parts, index) = (parts.max(1), index.min(parts.max(1) - 1));
        let range = even_part(self.region.numel(), parts, index);
        Segment {
            logical: self.logical.clone(),
            region: self
                .region
                .flat_part(range.clone())
                .expect("a part of the region"),
            local: self.local.flat_part(range).expect("a part of the region"),
        }
    }
}

/// One parameter this rank holds.
#[derive(Debug, Clone)]
pub struct LocalParam {
    /// Its id in the module.
    pub id: ParamId,
    /// Its path in the module.
    pub path: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// How it is held.
    pub kind: ParamKind,
    /// The logical regions it holds.
    pub segments: Vec<Segment>,
    /// The part of `segments` this rank writes (all of it unless replicas share the writing).
    pub writes: Vec<Segment>,
}

/// How this rank's parameters map onto logical tensors. See the module docs.
///
/// # Example
/// ```
/// use burn::module::Module;
/// use burn::tensor::Device;
/// use burn_parallel::checkpoint::ParamMap;
/// use burn_parallel::init::{Init, LinearInit};
/// use burn_parallel::plan::TpPlan;
/// use burn_parallel::run_local;
///
/// let maps = run_local(2, |group| {
///     let init = Init::new(1, &Device::flex())
///         .with_tp(&group, TpPlan::new().colwise("fc"))
///         .unwrap();
///     let fc = init.linear("fc", LinearInit::new(4, 6)).unwrap();
///     let map = ParamMap::new(&fc, &init.context(), None).unwrap();
///     let weight = map.params().iter().find(|p| p.path == "weight").unwrap();
///     Ok((map.logical_shapes(), weight.segments[0].region.bounds.clone()))
/// })
/// .unwrap();
/// // The logical [4, 6] weight; each rank holds 3 of its 6 output columns.
/// assert_eq!(maps[0].0.get("weight"), Some(&vec![4, 6]));
/// assert_eq!(maps[0].1, vec![0..4, 0..3]);
/// assert_eq!(maps[1].1, vec![0..4, 3..6]);
/// ```
#[derive(Debug, Clone)]
pub struct ParamMap {
    params: Vec<LocalParam>,
    logical: BTreeMap<String, Vec<usize>>,
}

/// The tensor-parallel segment of a (unit-level or module-level) parameter.
fn tp_segment(
    tp: &HashMap<ParamId, (usize, crate::tensor_parallel::Shard)>,
    id: ParamId,
    logical: String,
    shape: &[usize],
) -> std::result::Result<(Segment, ParamKind), String> {
    let local = Region::full(shape);
    match tp.get(&id) {
        None => Ok((
            Segment {
                logical,
                region: Region::full(shape),
                local,
            },
            ParamKind::Replicated,
        )),
        Some(&(dim, shard)) => {
            let mut full = shape.to_vec();
            *full.get_mut(dim).ok_or_else(|| {
                format!("{logical}: sharded dimension {dim} of a parameter of shape {shape:?}")
            })? = shard.full;
            Ok((
                Segment {
                    region: Region::full(&full)
                        .narrow(dim, shard.start..shard.start + shard.len)?,
                    local: local.narrow(dim, 0..shard.len)?,
                    logical,
                },
                ParamKind::TpSharded,
            ))
        }
    }
}

impl ParamMap {
    /// The map of `module` on this rank, `flat_parts(id)` saying what the flat FSDP shard `id`
    /// holds (`None`: not a flat shard). The public constructor, [`ParamMap::new`], takes the
    /// registry of the shards, `crate::train::DataShards`, and is defined with it.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] naming a parameter whose layout cannot be described.
    pub(crate) fn with_flat_parts<M: Module>(
        module: &M,
        tp: &TpContext,
        flat_parts: impl Fn(ParamId) -> Option<FlatParts>,
    ) -> Result<Self> {
        let index = crate::index::ParamIndex::of(module);
        let tp_shards = tp.shards.lock().expect("plan bookkeeping").clone();
        let mut params = Vec::new();
        let mut logical = BTreeMap::new();
        for entry in index.entries() {
            let (path, id, shape) = (entry.path.clone(), entry.id, entry.shape.clone());
            let bad = |reason: String| CheckpointError::piece(&path, reason);
            let flat = flat_parts(id);
            let (kind, segments) = match flat {
                None => {
                    let (segment, kind) =
                        tp_segment(&tp_shards, id, path.clone(), &shape).map_err(bad)?;
                    (kind, vec![segment])
                }
                Some(flat) => {
                    // `<unit>.flat_shard`: the parts' logical paths are under `<unit>`.
                    let unit = path.rsplit_once('.').map_or("", |(unit, _)| unit);
                    let (segments, shapes) = flat_segments(&tp_shards, unit, &flat).map_err(bad)?;
                    logical.extend(shapes);
                    (ParamKind::Flat, segments)
                }
            };
            for s in &segments {
                logical.insert(s.logical.clone(), s.region.shape.clone());
            }
            params.push(LocalParam {
                id,
                path,
                shape,
                kind,
                writes: segments.clone(),
                segments,
            });
        }
        Ok(Self { params, logical })
    }

    /// Shares the writing of every parameter among the ranks holding the same copy of it:
    /// `replicas(param)` gives `(copies, this rank's index among them)` and this rank writes
    /// part `index` of `copies` equal parts (so each element is written once, and the I/O is
    /// spread). Without it every rank writes all it holds.
    pub fn with_replicas(mut self, replicas: impl Fn(&LocalParam) -> (usize, usize)) -> Self {
        for p in &mut self.params {
            let (copies, index) = replicas(p);
            p.writes = p.segments.iter().map(|s| s.part(copies, index)).collect();
        }
        self
    }

    /// [`Self::with_replicas`] for the parameters `replicas` gives a value for; the others keep
    /// theirs.
    pub fn with_replicas_where(
        mut self,
        replicas: impl Fn(&LocalParam) -> Option<(usize, usize)>,
    ) -> Self {
        for p in &mut self.params {
            if let Some((copies, index)) = replicas(p) {
                p.writes = p.segments.iter().map(|s| s.part(copies, index)).collect();
            }
        }
        self
    }

    /// Gives logical tensors other names than their local paths, for layouts where a rank
    /// holds some entries of a list under local indices: expert parallelism (this rank's local
    /// expert `i` of a layer is global expert `first + i`), pipeline parallelism (a stage's
    /// local block `i` is the model's block `first + i`). `rename(local logical name)` gives
    /// the model's (single-device) name; checkpoints then hold the model's names whatever the
    /// layout, optimizer state and scalars included.
    ///
    /// # Arguments
    /// * `rename` - the logical name of a local logical name (identity for the others).
    ///
    /// # Returns
    /// The map with every segment and logical shape renamed.
    ///
    /// # Example
    /// ```
    /// use burn::tensor::Device;
    /// use burn_parallel::checkpoint::ParamMap;
    /// use burn_parallel::init::{Init, LinearInit};
    /// use burn_parallel::nn::TpContext;
    ///
    /// // An expert-parallel rank holding global expert 3 as its local expert 0.
    /// let init = Init::new(1, &Device::flex());
    /// let expert = init.linear("up", LinearInit::new(4, 6)).unwrap();
    /// let map = ParamMap::new(&expert, &TpContext::single(), None)
    ///     .unwrap()
    ///     .with_logical_names(|name| format!("experts.3.{name}"));
    /// assert!(map.logical_shapes().contains_key("experts.3.weight"));
    /// assert_eq!(map.params()[0].segments[0].logical, "experts.3.weight");
    /// ```
    pub fn with_logical_names(mut self, rename: impl Fn(&str) -> String) -> Self {
        for p in &mut self.params {
            for s in p.segments.iter_mut().chain(p.writes.iter_mut()) {
                s.logical = rename(&s.logical);
            }
        }
        self.logical = std::mem::take(&mut self.logical)
            .into_iter()
            .map(|(name, shape)| (rename(&name), shape))
            .collect();
        self
    }

    /// Completes the logical tensors with those the other ranks of `group` hold (a collective:
    /// every rank of `group` calls it). Where ranks hold different parts of the model under
    /// the same layout (pipeline stages, expert-parallel ranks), each rank's map knows only
    /// its own tensors; loading checks the checkpoint against the whole model's.
    ///
    /// # Arguments
    /// * `group` - the ranks that together hold the whole model (the world is always right).
    ///
    /// # Errors
    /// [`CheckpointError::Collective`] when the exchange fails; [`CheckpointError::Piece`]
    /// naming a tensor two ranks give different full shapes.
    pub fn with_logical_of(self, group: &crate::ProcessGroup) -> Result<Self> {
        let all = group.all_gather_object(&self.logical)?;
        all.into_iter()
            .enumerate()
            .try_fold(self, |map, (rank, theirs)| {
                map.with_logical_shapes(theirs, &format!("rank {rank} of the group"))
            })
    }

    /// Adds logical tensors (name and full shape) that other ranks, or other modules of this
    /// rank (a pipeline rank's other stages), hold; loading then checks the checkpoint
    /// against them too.
    ///
    /// # Arguments
    /// * `shapes` - the logical tensors to add.
    /// * `whose` - who holds them, for the error message.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] naming a tensor given another full shape than the map's.
    pub fn with_logical_shapes(
        mut self,
        shapes: BTreeMap<String, Vec<usize>>,
        whose: &str,
    ) -> Result<Self> {
        for (name, shape) in shapes {
            match self.logical.get(&name) {
                Some(mine) if *mine != shape => {
                    return Err(CheckpointError::piece(
                        &name,
                        format!(
                            "full shape {mine:?} here but {shape:?} on {whose}: the ranks do \
                             not build the same model"
                        ),
                    ));
                }
                Some(_) => {}
                None => {
                    self.logical.insert(name, shape);
                }
            }
        }
        Ok(self)
    }

    /// The map restricted to the parameters `keep` selects, for an optimizer that steps only
    /// those (so that its state is saved and loaded for them alone). The logical tensors are
    /// kept whole.
    ///
    /// # Arguments
    /// * `keep` - whether a parameter belongs to the restricted map.
    ///
    /// # Returns
    /// The restricted map.
    pub fn only(mut self, keep: impl Fn(&LocalParam) -> bool) -> Self {
        self.params.retain(|p| keep(p));
        self
    }

    /// The map without the segments `drop` selects (each parameter keeps the rest, possibly
    /// none): the map of an optimizer that steps only part of the parameters (AdamW beside a
    /// matrix optimizer, [`crate::muon`]), so that its state is saved and read for that part.
    pub fn without_segments(&self, drop: impl Fn(&Segment) -> bool) -> Self {
        let mut map = self.clone();
        for p in &mut map.params {
            p.segments.retain(|s| !drop(s));
            p.writes.retain(|s| !drop(s));
        }
        map
    }

    /// The parameters this rank holds.
    pub fn params(&self) -> &[LocalParam] {
        &self.params
    }

    /// The logical tensors (name and full shape) of the module, as on one device.
    pub fn logical_shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.logical.clone()
    }

    /// The host values of the module's parameters that the map knows, by id.
    fn host_values<M: Module>(&self, module: &M) -> HashMap<ParamId, TensorData> {
        struct Read<'a> {
            ids: std::collections::HashSet<ParamId>,
            values: &'a mut HashMap<ParamId, TensorData>,
        }
        impl ModuleVisitor for Read<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.ids.contains(&param.id) {
                    self.values.insert(param.id, param.val().into_data());
                }
            }
        }
        let mut values = HashMap::new();
        module.visit(&mut Read {
            ids: self.params.iter().map(|p| p.id).collect(),
            values: &mut values,
        });
        values
    }

    /// The pieces of the module's parameters this rank writes (copied to host memory).
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when the module does not match the map.
    pub fn param_pieces<M: Module>(&self, module: &M) -> Result<Vec<Piece>> {
        self.value_pieces("", &self.host_values(module))
    }

    /// The pieces this rank writes of tensors laid out as its parameters, by parameter id,
    /// named `<name_prefix><logical parameter>`: state that has the parameters' shapes but is
    /// not the module's (an outer optimizer's model and momentum, say). Read them back with
    /// [`ParamMap::read_values`].
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when a parameter has no value or a value of another shape.
    ///
    /// # Example
    /// ```
    /// use std::collections::HashMap;
    /// use burn::nn::LinearConfig;
    /// use burn::tensor::{Device, TensorData};
    /// use burn_parallel::checkpoint::ParamMap;
    /// use burn_parallel::nn::TpContext;
    ///
    /// let fc = LinearConfig::new(2, 3).init(&Device::flex());
    /// let map = ParamMap::new(&fc, &TpContext::single(), None).unwrap();
    /// let zeros: HashMap<_, _> = map.params().iter()
    ///     .map(|p| (p.id, TensorData::zeros::<f32, _>(p.shape.clone())))
    ///     .collect();
    /// let pieces = map.value_pieces("outer/", &zeros).unwrap();
    /// assert!(pieces.iter().any(|p| p.name == "outer/weight"));
    /// ```
    pub fn value_pieces(
        &self,
        name_prefix: &str,
        values: &HashMap<ParamId, TensorData>,
    ) -> Result<Vec<Piece>> {
        let mut pieces = Vec::new();
        for p in &self.params {
            let data = values.get(&p.id).ok_or_else(|| {
                CheckpointError::piece(&p.path, "no value for the parameter with the map's id")
            })?;
            if data.shape().as_slice() != p.shape.as_slice() {
                return Err(CheckpointError::piece(
                    &p.path,
                    format!(
                        "a value of shape {:?} for a parameter of {:?}",
                        data.shape(),
                        p.shape
                    ),
                ));
            }
            pieces.extend(segment_pieces(name_prefix, &p.writes, data)?);
        }
        Ok(pieces)
    }

    /// Tensors `<name_prefix><logical parameter>` of `checkpoint`, read into each parameter's
    /// local layout (only the regions this rank holds), by parameter id, in `dtype`: what
    /// [`ParamMap::value_pieces`] wrote.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when a tensor is missing or does not fit; read errors.
    pub fn read_values(
        &self,
        checkpoint: &Checkpoint,
        name_prefix: &str,
        dtype: DType,
    ) -> Result<HashMap<ParamId, TensorData>> {
        self.params
            .iter()
            .map(|p| {
                let data =
                    read_segments(checkpoint, name_prefix, &p.segments, &p.shape, Some(dtype))?;
                Ok((p.id, data))
            })
            .collect()
    }

    /// `module` with every parameter of the map read from `checkpoint` (each rank reads only
    /// the regions it holds; tensor-parallel padding keeps its value). Ids and whether a
    /// parameter requires a gradient are kept. `checkpoint` is any [`TensorSource`]: a saved
    /// [`Checkpoint`], or whole tensors in memory (a model imported from another format), so a
    /// run of any layout can also start from those.
    ///
    /// Tensors whose names hold a `/` are other components' state (`optim/...`, DiLoCo's
    /// `diloco/...`), not parameters: they are neither read nor reported as unexpected.
    ///
    /// # Errors
    /// [`CheckpointError::Mismatch`] listing missing, unexpected and reshaped tensors when the
    /// checkpoint is of another model; read errors.
    pub fn load_params<M: Module, S: TensorSource + ?Sized>(
        &self,
        module: M,
        checkpoint: &S,
    ) -> Result<M> {
        let mut expected: Vec<(&str, &[usize])> = self
            .logical
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        // A name with a `/` is the state of a component, not a parameter (Burn's paths are
        // dotted): optimizer tensors are checked by `load_optimizer`, others by their owner
        // (DiLoCo's `diloco/...`).
        let shapes = checkpoint.shapes();
        expected.extend(shapes.into_iter().filter(|(k, _)| k.contains('/')));
        check_tensors(checkpoint, expected)?;
        let mut loaded = self.host_values(&module);
        for p in &self.params {
            let data = loaded.remove(&p.id).ok_or_else(|| {
                CheckpointError::piece(&p.path, "the module has no parameter with the map's id")
            })?;
            let dtype = data.dtype();
            let mut bytes = data.into_bytes().to_vec();
            for s in &p.segments {
                let values = checkpoint.read(&s.logical, &s.region)?.convert_dtype(dtype);
                scatter(&mut bytes, dtype, &s.local, values.as_bytes());
            }
            loaded.insert(
                p.id,
                TensorData::from_bytes_vec(bytes, p.shape.clone(), dtype),
            );
        }
        struct Write {
            values: HashMap<ParamId, TensorData>,
        }
        impl ModuleMapper for Write {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(data) = self.values.remove(&param.id) else {
                    return param;
                };
                param.map(|t| {
                    let grad = t.is_require_grad();
                    let dtype = data.dtype();
                    let v = Tensor::<D>::from_data(data, (&t.device(), dtype));
                    if grad { v.require_grad() } else { v }
                })
            }
        }
        Ok(module.map(&mut Write { values: loaded }))
    }

    /// The pieces of an optimizer's state (Burn's [`OptimizerRecord`], whose tensors are keyed
    /// by parameter id) this rank writes, named `optim/<state>/<logical parameter>`, and its
    /// scalars (step counters) by logical parameter, for the rank state.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when the record cannot be read or holds the state of a
    /// parameter the map does not know.
    pub fn optimizer_pieces(&self, record: OptimizerRecord) -> Result<(Vec<Piece>, Value)> {
        let bad = |e: String| CheckpointError::piece("optimizer", e);
        let bytes = record
            .into_bytes()
            .map_err(|e| bad(format!("serialising the optimizer record: {e:?}")))?;
        let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| bad(format!("{e:?}")))?;
        let by_id: HashMap<u64, &LocalParam> =
            self.params.iter().map(|p| (p.id.val(), p)).collect();
        let mut scalars = ScalarsByLogical::new();
        for (key, value) in reader.scalars() {
            let Some((id, field)) = split_key(key) else {
                continue;
            };
            if field == RANK_KEY {
                continue;
            }
            let p = by_id
                .get(&id)
                .ok_or_else(|| bad(format!("scalar {key} of no parameter")))?;
            for s in &p.segments {
                scalars
                    .entry(s.logical.clone())
                    .or_default()
                    .insert(field.to_string(), scalar_json(*value));
            }
        }
        let mut pieces = Vec::new();
        let tensors = reader.into_tensors().map_err(|e| bad(format!("{e:?}")))?;
        for tensor in tensors {
            let (name, dtype, shape, id, bytes) =
                tensor.into_parts().map_err(|e| bad(format!("{e:?}")))?;
            let (id, field) = split_key(&name)
                .filter(|(i, _)| Some(*i) == id)
                .ok_or_else(|| bad(format!("state tensor {name} names no parameter")))?;
            let p = by_id
                .get(&id)
                .ok_or_else(|| bad(format!("state tensor {name} of no parameter of the map")))?;
            if shape.as_slice() != p.shape.as_slice() {
                return Err(bad(format!(
                    "state {field} of {} has shape {:?}, the parameter {:?}",
                    p.path,
                    shape.as_slice(),
                    p.shape
                )));
            }
            // Every parameter with state has its scalars entry, even an empty one (SGD's
            // momentum has no counter), so that a load can tell state whose counters were
            // lost from state that never had any.
            for s in &p.segments {
                scalars.entry(s.logical.clone()).or_default();
            }
            let data = TensorData::from_bytes_vec(bytes.to_vec(), p.shape.clone(), dtype);
            pieces.extend(segment_pieces(
                &format!("{OPTIM}{field}/"),
                &p.writes,
                &data,
            )?);
        }
        Ok((
            pieces,
            serde_json::to_value(scalars).expect("scalars serialise"),
        ))
    }

    /// The optimizer record of this rank's parameters, read from `checkpoint` (`None` when it
    /// holds no optimizer state). `scalars` are the per-parameter scalars of
    /// [`ParamMap::optimizer_pieces`], merged over the saving ranks ([`merged_scalars`]).
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when a parameter's state is only partly there or its
    /// scalars disagree between the logical parameters it covers; read errors.
    pub fn load_optimizer(
        &self,
        checkpoint: &Checkpoint,
        scalars: &ScalarsByLogical,
    ) -> Result<Option<OptimizerRecord>> {
        if !checkpoint
            .manifest()
            .tensors
            .keys()
            .any(|k| k.starts_with(OPTIM))
        {
            return Ok(None);
        }
        let mut tensors = Vec::new();
        let mut writer_scalars: Vec<(String, burn_pack::Scalar)> = Vec::new();
        let mut metadata = Vec::new();
        for p in &self.params {
            let Some((state, mine)) = read_state(checkpoint, &p.segments, &p.shape, scalars)
                .map_err(|e| CheckpointError::piece(&p.path, e))?
            else {
                continue; // no state yet for this parameter
            };
            for (field, data) in state {
                tensors.push(burn_pack::Tensor::new(
                    format!("{}.{field}", p.id.val()),
                    data.dtype(),
                    p.shape.clone(),
                    Some(p.id.val()),
                    data.into_bytes(),
                ));
            }
            for (field, value) in mine {
                let scalar = scalar_from_json(&value).ok_or_else(|| {
                    CheckpointError::piece(&p.path, format!("optimizer scalar {field} = {value}"))
                })?;
                writer_scalars.push((format!("{}.{field}", p.id.val()), scalar));
            }
            writer_scalars.push((
                format!("{}.{RANK_KEY}", p.id.val()),
                burn_pack::Scalar::UInt(p.shape.len() as u64),
            ));
            metadata.push((p.id.val().to_string(), p.path.clone()));
        }
        let mut writer = burn_pack::Writer::new(tensors);
        for (k, v) in writer_scalars {
            writer = writer.with_scalar(&k, v);
        }
        for (k, v) in metadata {
            writer = writer.with_metadata(&k, &v);
        }
        let bytes = writer
            .into_bytes()
            .map_err(|e| CheckpointError::piece("optimizer", format!("{e:?}")))?;
        OptimizerRecord::from_bytes(bytes)
            .map(Some)
            .map_err(|e| CheckpointError::piece("optimizer", format!("{e:?}")))
    }
}

/// Optimizer state of one local tensor: each state tensor (by field) and the scalars.
pub type LocalState = (Vec<(String, TensorData)>, BTreeMap<String, Value>);

/// The optimizer state of a local tensor of `shape` whose elements are `segments`: every state
/// field saved as `optim/<field>/<logical>` for its logical parameters, read into a tensor of
/// `shape`, and the scalars of its logical parameters (from `scalars`). `None` when none of its
/// logical parameters has state.
///
/// # Errors
/// A sentence when part of it has state and part not, or its logical parameters' scalars
/// disagree; read errors (as text).
pub fn read_state(
    checkpoint: &Checkpoint,
    segments: &[Segment],
    shape: &[usize],
    scalars: &ScalarsByLogical,
) -> std::result::Result<Option<LocalState>, String> {
    let mut fields: Option<Vec<String>> = None;
    for s in segments {
        let suffix = format!("/{}", s.logical);
        let here: Vec<String> = checkpoint
            .manifest()
            .tensors
            .keys()
            .filter_map(|k| k.strip_prefix(OPTIM)?.strip_suffix(&suffix))
            // A field is one name: `optim/moment_1/diloco/island.0/w` is another tensor's
            // state (an island's `w`), not a field `moment_1/diloco/island.0` of `w`.
            .filter(|field| !field.contains('/'))
            .map(str::to_string)
            .collect();
        match &fields {
            None => fields = Some(here),
            Some(f) if *f == here => {}
            Some(f) => {
                return Err(format!(
                    "optimizer state {f:?} for part of it but {here:?} for {}",
                    s.logical
                ));
            }
        }
    }
    let fields = fields.unwrap_or_default();
    if fields.is_empty() {
        return Ok(None);
    }
    let mut state = Vec::new();
    for field in fields {
        let data = read_segments(
            checkpoint,
            &format!("{OPTIM}{field}/"),
            segments,
            shape,
            None,
        )
        .map_err(|e| e.to_string())?;
        state.push((field, data));
    }
    let mut mine: Option<&BTreeMap<String, Value>> = None;
    for s in segments {
        // Since format version 2, every parameter with state has a scalars entry: one missing
        // means the rank state that held it was dropped, and loading would restart the
        // optimizer's step count (AdamW's bias correction) without a word.
        if checkpoint.manifest().format_version >= 2 && !scalars.contains_key(&s.logical) {
            return Err(format!(
                "the checkpoint holds optimizer state for {} but no rank state holds its step \
                 counters: every saving rank's state must be in the manifest; resume from an \
                 earlier checkpoint",
                s.logical
            ));
        }
        match (mine, scalars.get(&s.logical)) {
            (None, h) => mine = h,
            (Some(m), Some(h)) if m != h => {
                return Err(format!(
                    "optimizer scalars {m:?} for part of it but {h:?} for {}",
                    s.logical
                ));
            }
            _ => {}
        }
    }
    Ok(Some((state, mine.cloned().unwrap_or_default())))
}

/// The scalars of a local tensor's optimizer state, by each logical parameter it covers (for
/// a rank state; [`merged_scalars`] reads them back).
pub fn scalars_by_logical(
    segments: &[Segment],
    scalars: &BTreeMap<String, Value>,
) -> ScalarsByLogical {
    segments
        .iter()
        .map(|s| (s.logical.clone(), scalars.clone()))
        .collect()
}

/// The segments of a flat shard: for each part of `flat` (a parameter of the unit under the
/// path prefix `unit`) that meets `flat.range`, its logical region and where its elements lie
/// in the 1-D shard. Also returns every part's logical shape (held here or not).
fn flat_segments(
    tp: &HashMap<ParamId, (usize, crate::tensor_parallel::Shard)>,
    unit: &str,
    flat: &FlatParts,
) -> std::result::Result<(Vec<Segment>, Shapes), String> {
    let shard = [flat.range.len()];
    let mut segments = Vec::new();
    let mut shapes = BTreeMap::new();
    for part in &flat.parts {
        let name = match unit {
            "" => part.path.clone(),
            unit => format!("{unit}.{}", part.path),
        };
        let (segment, _) = tp_segment(tp, part.id, name, &part.shape)?;
        shapes.insert(segment.logical.clone(), segment.region.shape.clone());
        let numel: usize = part.shape.iter().product();
        let (lo, hi) = (
            flat.range.start.max(part.offset),
            flat.range.end.min(part.offset + numel),
        );
        if lo >= hi {
            continue;
        }
        for (cut, first) in segment.restrict(lo - part.offset..hi - part.offset)? {
            // Where the cut's elements lie in the 1-D shard.
            let at = part.offset + first - flat.range.start;
            segments.push(Segment {
                local: Region::full(&shard).flat_part(at..at + cut.local.numel())?,
                ..cut
            });
        }
    }
    Ok((segments, shapes))
}

/// The segments of a flat space that is not a module parameter (ZeRO-1/2's sharded optimizer
/// state): the parameters of `flat` (paths under `prefix`, tensor-parallel shards as `tp`
/// knows them) and the range this rank holds.
///
/// # Errors
/// [`CheckpointError::Piece`] when a part's layout cannot be described.
pub fn flat_space_segments(tp: &TpContext, prefix: &str, flat: &FlatParts) -> Result<Vec<Segment>> {
    let shards = tp.shards.lock().expect("plan bookkeeping").clone();
    flat_segments(&shards, prefix, flat)
        .map(|(segments, _)| segments)
        .map_err(|e| CheckpointError::piece(prefix, e))
}

/// The pieces named `<name_prefix><logical>` of `data` (a local tensor) along `segments`.
///
/// # Errors
/// [`CheckpointError::Piece`] when a segment does not fit `data`.
pub fn segment_pieces(
    name_prefix: &str,
    segments: &[Segment],
    data: &TensorData,
) -> Result<Vec<Piece>> {
    segments
        .iter()
        .map(|s| {
            Piece::new(
                format!("{name_prefix}{}", s.logical),
                s.region.clone(),
                extract(data, &s.local),
            )
        })
        .collect()
}

/// A local tensor of `shape` whose `segments` are read from the tensors
/// `<name_prefix><logical>` of `checkpoint`, converted to `dtype` (the saved dtype when
/// `None`); elements outside the segments are zero.
///
/// # Errors
/// Read errors.
pub fn read_segments(
    checkpoint: &Checkpoint,
    name_prefix: &str,
    segments: &[Segment],
    shape: &[usize],
    dtype: Option<DType>,
) -> Result<TensorData> {
    let mut dtype = dtype;
    let mut bytes = Vec::new();
    for s in segments {
        let values = checkpoint.read(&format!("{name_prefix}{}", s.logical), &s.region)?;
        let d = *dtype.get_or_insert(values.dtype());
        if bytes.is_empty() {
            bytes = vec![0u8; shape.iter().product::<usize>() * d.size()];
        }
        scatter(&mut bytes, d, &s.local, values.convert_dtype(d).as_bytes());
    }
    let dtype = dtype.unwrap_or(DType::F32);
    if bytes.is_empty() {
        bytes = vec![0u8; shape.iter().product::<usize>() * dtype.size()];
    }
    Ok(TensorData::from_bytes_vec(bytes, shape.to_vec(), dtype))
}

/// Logical shapes by name.
type Shapes = BTreeMap<String, Vec<usize>>;

/// Optimizer scalars (step counters...) by logical parameter, then by state field.
pub type ScalarsByLogical = BTreeMap<String, BTreeMap<String, Value>>;

/// Prefix of the optimizer-state tensors' names.
pub const OPTIM: &str = "optim/";
/// The scalar Burn's optimizer records keep for each parameter's rank.
const RANK_KEY: &str = "__rank";

/// `"<id>.<field>"` -> `(id, field)`.
fn split_key(key: &str) -> Option<(u64, &str)> {
    let (id, field) = key.split_once('.')?;
    Some((id.parse().ok()?, field))
}

/// An optimizer scalar as JSON (`{"int": 3}`, `{"float": 0.5}`, ...), its type kept.
pub fn scalar_json(s: burn_pack::Scalar) -> Value {
    match s {
        burn_pack::Scalar::Int(v) => serde_json::json!({ "int": v }),
        burn_pack::Scalar::UInt(v) => serde_json::json!({ "uint": v }),
        burn_pack::Scalar::Float(v) => serde_json::json!({ "float": v }),
        burn_pack::Scalar::Bool(v) => serde_json::json!({ "bool": v }),
    }
}

/// The optimizer scalar of [`scalar_json`]'s JSON.
pub fn scalar_from_json(v: &Value) -> Option<burn_pack::Scalar> {
    let o = v.as_object()?;
    if let Some(x) = o.get("int") {
        return x.as_i64().map(burn_pack::Scalar::Int);
    }
    if let Some(x) = o.get("uint") {
        return x.as_u64().map(burn_pack::Scalar::UInt);
    }
    if let Some(x) = o.get("float") {
        return x.as_f64().map(burn_pack::Scalar::Float);
    }
    o.get("bool")?.as_bool().map(burn_pack::Scalar::Bool)
}

/// Merges the optimizer scalars of every saving rank's state (`rank_state[key]`).
pub fn merged_scalars(checkpoint: &Checkpoint, key: &str) -> ScalarsByLogical {
    let mut all = BTreeMap::new();
    for state in &checkpoint.manifest().rank_states {
        if let Some(map) = state
            .get(key)
            .and_then(|v| serde_json::from_value::<ScalarsByLogical>(v.clone()).ok())
        {
            all.extend(map);
        }
    }
    all
}

/// The elements of `local` (a region of the tensor `data`), in its order.
fn extract(data: &TensorData, local: &Region) -> TensorData {
    let size = data.dtype().size();
    let bytes = data.as_bytes();
    let mut out = Vec::with_capacity(local.numel() * size);
    for r in local.runs() {
        out.extend_from_slice(&bytes[r.start * size..r.end * size]);
    }
    TensorData::from_bytes_vec(out, vec![local.numel()], data.dtype())
}

/// Writes `values` (the elements of region `local`, in its order) into `bytes`.
fn scatter(bytes: &mut [u8], dtype: DType, local: &Region, values: &[u8]) {
    let size = dtype.size();
    let mut at = 0;
    for r in local.runs() {
        let n = r.len() * size;
        bytes[r.start * size..r.start * size + n].copy_from_slice(&values[at..at + n]);
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor-parallel shard padded along its last dimension (local `[2, 3]`, of which
    /// `[0..2, 0..2]` is real: columns 2..4 of a logical `[2, 4]`) cut by a flat shard: one part
    /// per row in the range, at the row's local position, padding left out (before, a typed
    /// error: ZeRO-1/2 and FSDP could not checkpoint such a parameter).
    #[test]
    fn a_flat_shard_cuts_a_shard_padded_along_its_last_dimension_row_by_row() {
        let segment = Segment {
            logical: "w".into(),
            region: Region {
                shape: vec![2, 4],
                bounds: vec![0..2, 2..4],
                flat: 0..4,
            },
            local: Region {
                shape: vec![2, 3],
                bounds: vec![0..2, 0..2],
                flat: 0..4,
            },
        };
        // Local positions 1..5: the second element of row 0, then row 1 (3..5).
        let cuts = segment.restrict(1..5).unwrap();
        let parts: Vec<_> = cuts
            .iter()
            .map(|(cut, first)| (cut.region.flat.clone(), cut.local.flat.clone(), *first))
            .collect();
        assert_eq!(parts, vec![(1..2, 1..2, 1), (2..4, 2..4, 3)]);
        // The padding (local position 2) alone: nothing.
        assert!(segment.restrict(2..3).unwrap().is_empty());
        // An unpadded parameter is one run: one part, as before.
        let whole = Segment {
            logical: "b".into(),
            region: Region::full(&[2, 2]),
            local: Region::full(&[2, 2]),
        };
        let cuts = whole.restrict(1..4).unwrap();
        assert_eq!(cuts.len(), 1);
        assert_eq!((cuts[0].0.region.flat.clone(), cuts[0].1), (1..4, 1));
    }

    /// The row pieces of such a cut are one region of the logical tensor: the save joins
    /// consecutive pieces of one box with adjacent flat ranges into one piece per tensor and
    /// rank (what the checkpoint format holds), and leaves the others alone.
    #[test]
    fn adjacent_pieces_of_one_region_are_saved_as_one() {
        let piece = |name: &str, flat: Range<usize>, values: Vec<f32>| {
            let region = Region {
                shape: vec![2, 4],
                bounds: vec![0..2, 2..4],
                flat,
            };
            let n = values.len();
            Piece::new(name, region, TensorData::new(values, [n])).unwrap()
        };
        let joined = crate::checkpoint::coalesce(vec![
            piece("w", 0..1, vec![1.0]),
            piece("w", 1..4, vec![2.0, 3.0, 4.0]),
            piece("v", 0..2, vec![5.0, 6.0]),
            piece("v", 3..4, vec![7.0]),
        ]);
        let summary: Vec<_> = joined
            .iter()
            .map(|p| {
                (
                    p.name.as_str(),
                    p.region.flat.clone(),
                    p.data.try_to_vec::<f32>().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("w", 0..4, vec![1.0, 2.0, 3.0, 4.0]),
                ("v", 0..2, vec![5.0, 6.0]),
                ("v", 3..4, vec![7.0]),
            ]
        );
    }
}
