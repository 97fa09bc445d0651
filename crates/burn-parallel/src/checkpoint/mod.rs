//! Distributed checkpoints that outlive the layout (like torch's DCP and DeepSpeed's universal
//! checkpoint).
//!
//! A checkpoint stores *logical* tensors: a parameter, or one optimizer-state tensor of it, under
//! its path and full shape, whatever the layout that trained it. Every rank saves only the
//! [`Piece`]s it owns: a [`Region`] of the logical tensor (a tensor-parallel box, a ZeRO flat
//! range, or both) and the data of that region. A rank of *another* layout later asks for the
//! regions it owns there, and reads only the byte ranges of the saved pieces that meet them.
//!
//! Layout of one checkpoint directory:
//! - `rank-00000-of-00004.safetensors`: rank 0's pieces, one 1-D tensor per logical tensor, in
//!   its own dtype;
//! - `manifest.json`, written last by rank 0: every logical tensor (name, shape, dtype) with the
//!   file and region of each of its pieces; every file's length, the checksum of its header and
//!   of each [`CHUNK_BYTES`] chunk of each tensor; the step; the trainer's state (learning-rate
//!   schedule position, loss scaler, anything serialisable) and each rank's own state (data
//!   position, RNG, optimizer step counters); last, a checksum of the manifest itself.
//!
//! A manifest cannot lie about what it lists: its own checksum refuses any edit, and each
//! chunk's checksum runs over the piece's tensor name and region before its bytes, so a piece
//! that a manifest places in another tensor or region fails its check on the first read.
//! Optimizer state is all there or refused: a state tensor whose step counters are missing from
//! the rank states is an error, not a restarted optimizer.
//!
//! Writes are atomic: each file goes to a temporary name, is fsynced and renamed; the manifest is
//! written after every rank reported its file, so a directory without a manifest is an
//! interrupted save and never loads. [`Checkpointer`] keeps the last `K` checkpoints under a
//! root (`step-00000100/`, ...) and finds the newest complete one; [`Checkpointer::save_async`]
//! takes the pieces already copied to host memory and writes them on a background thread while
//! training goes on.
//!
//! # Example
//! ```
//! use burn::tensor::TensorData;
//! use burn_parallel::checkpoint::{Checkpoint, Checkpointer, Piece, Region};
//! use burn_parallel::run_local;
//!
//! let root = std::env::temp_dir().join(format!("dcp-doc-{}", std::process::id()));
//! // Saved at tp 2: each rank holds half of the columns of a [2, 4] weight.
//! run_local(2, |group| {
//!     let region = Region::full(&[2, 4]).chunk(1, 2, group.rank()).unwrap();
//!     let full: Vec<f32> = (0..8).map(|x| x as f32).collect();
//!     let mine: Vec<f32> = region.runs().into_iter().flat_map(|r| full[r].to_vec()).collect();
//!     let piece = Piece::new("w", region, TensorData::new(mine, [4])).unwrap();
//!     let mut saver = Checkpointer::new(&root, 2, &group).unwrap();
//!     saver.save(10, vec![piece], serde_json::json!({"lr_step": 10}), serde_json::Value::Null).unwrap();
//!     Ok(())
//! })
//! .unwrap();
//! // Loaded on one device: the whole weight.
//! let ckpt = Checkpointer::latest(&root).unwrap().expect("a complete checkpoint");
//! assert_eq!(ckpt.step(), 10);
//! let w = ckpt.read("w", &Region::full(&[2, 4])).unwrap();
//! assert_eq!(w.try_to_vec::<f32>().unwrap(), (0..8).map(|x| x as f32).collect::<Vec<_>>());
//! # std::fs::remove_dir_all(&root).unwrap();
//! ```

mod error;
pub mod hf;
mod module;
mod region;
mod source;
mod store;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use burn::tensor::{DType, TensorData};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ProcessGroup;
pub use error::{CheckpointError, Result};
pub use module::{
    FlatPart, FlatParts, LocalParam, LocalState, OPTIM, ParamKind, ParamMap, ScalarsByLogical,
    Segment, flat_space_segments, merged_scalars, read_segments, read_state, scalar_from_json,
    scalar_json, scalars_by_logical, segment_pieces,
};
pub use region::{Region, even_part, overlaps};
pub use source::{TensorSource, check_tensors};
pub use store::{CHUNK_BYTES, FileManifest};

/// Version of the manifest format written. Version 2 added the manifest's own checksum and the
/// binding of chunk checksums to their piece; version 1 checkpoints still load, without those
/// two checks.
pub const FORMAT_VERSION: u32 = 2;
const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "burn-parallel-dcp";

/// A part of a logical tensor that one rank saves: its name, region, and data (the region's
/// elements in its order; any shape with that many elements).
#[derive(Debug, Clone)]
pub struct Piece {
    /// The logical tensor's name (a parameter path, or `optim/<state>/<path>`).
    pub name: String,
    /// Which of its elements `data` holds.
    pub region: Region,
    /// The elements.
    pub data: TensorData,
}

impl Piece {
    /// A piece, checked: the region lies in its shape and `data` has its number of elements.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] naming the tensor.
    pub fn new(name: impl Into<String>, region: Region, data: TensorData) -> Result<Self> {
        let name = name.into();
        region
            .validate()
            .map_err(|e| CheckpointError::piece(&name, e))?;
        if data.num_elements() != region.numel() {
            return Err(CheckpointError::piece(
                &name,
                format!(
                    "{} elements of data for a region of {}",
                    data.num_elements(),
                    region.numel()
                ),
            ));
        }
        store::dtype_name(data.dtype()).map_err(|e| CheckpointError::piece(&name, e))?;
        Ok(Self { name, region, data })
    }

    /// The whole of a tensor (replicated parameters: one replica saves it).
    ///
    /// # Errors
    /// See [`Piece::new`].
    pub fn whole(name: impl Into<String>, data: TensorData) -> Result<Self> {
        let region = Region::full(data.shape().as_slice());
        Self::new(name, region, data)
    }
}

/// Where one piece of a logical tensor is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceManifest {
    /// Index of the file in [`Manifest::files`] (the saving rank).
    pub file: usize,
    /// The region it holds.
    pub region: Region,
}

/// A logical tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorManifest {
    /// Full shape.
    pub shape: Vec<usize>,
    /// Element type (safetensors' name: `F32`, `BF16`, ...).
    pub dtype: String,
    /// Its pieces; together they cover every element at least once.
    pub pieces: Vec<PieceManifest>,
}

/// The manifest of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `"burn-parallel-dcp"`.
    pub format: String,
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Training step (the number of steps done when saved).
    pub step: usize,
    /// Number of ranks that saved it.
    pub world_size: usize,
    /// The logical tensors, by name.
    pub tensors: BTreeMap<String, TensorManifest>,
    /// One file per rank, in rank order.
    pub files: Vec<FileManifest>,
    /// The trainer's state, from rank 0 (schedule position, loss scaler, config...).
    pub state: Value,
    /// Each rank's own state (data position, RNG), in rank order.
    pub rank_states: Vec<Value>,
    /// CRC-32 of the manifest file's bytes with this field's value empty (format version 2
    /// on; the last field, so that it is the last `"checksum"` of the file).
    #[serde(default)]
    pub checksum: String,
}

/// The field [`Manifest::checksum`] as it begins in the file.
const CHECKSUM_FIELD: &[u8] = b"\"checksum\": \"";

impl Manifest {
    /// The manifest's file: its JSON with [`Manifest::checksum`] set to the CRC-32 of the same
    /// bytes with that value empty. Also what a tool that rewrites a manifest on purpose
    /// writes (a reader then trusts it as written); it does not make a lying manifest load: a
    /// piece placed in another tensor or region still fails its chunk checksums on read.
    pub fn sealed_json(&self) -> Vec<u8> {
        let unsealed = Manifest {
            checksum: String::new(),
            ..self.clone()
        };
        let mut bytes = serde_json::to_vec_pretty(&unsealed).expect("a manifest serialises");
        let sum = store::checksum(&bytes);
        let at = find_last(&bytes, CHECKSUM_FIELD).expect("the checksum field is written")
            + CHECKSUM_FIELD.len();
        bytes.splice(at..at, sum.into_bytes());
        bytes
    }

    /// Checks the seal of a manifest file's `bytes` ([`Manifest::sealed_json`]): the CRC-32 of
    /// the bytes with the checksum's value taken out must be that value. The check runs on the
    /// bytes as read, not on a re-serialisation (JSON floats need not parse back to the bits).
    fn check_seal(bytes: &[u8]) -> std::result::Result<(), String> {
        let at = find_last(bytes, CHECKSUM_FIELD).ok_or("it has no checksum field")?
            + CHECKSUM_FIELD.len();
        let len = bytes[at..]
            .iter()
            .position(|&b| b == b'"')
            .ok_or("its checksum field is not closed")?;
        let written = String::from_utf8_lossy(&bytes[at..at + len]).into_owned();
        let mut unsealed = bytes.to_vec();
        unsealed.drain(at..at + len);
        let sum = store::checksum(&unsealed);
        match written == sum {
            true => Ok(()),
            false => Err(format!(
                "the manifest's checksum is {written:?} but its content sums to {sum}: it was \
                 edited or damaged after it was written; resume from an earlier checkpoint"
            )),
        }
    }

    /// The identity a piece's chunk checksums are bound to (none before format version 2).
    fn identity(&self, name: &str, region: &Region) -> String {
        match self.format_version {
            1 => String::new(),
            _ => store::piece_identity(name, region),
        }
    }
}

/// What each rank tells rank 0 about its file.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RankReport {
    file: FileManifest,
    pieces: Vec<(String, Vec<usize>, String, Region)>,
    state: Value,
}

/// Saves and finds the checkpoints of one run under a root directory, keeping the last `K`.
///
/// Saving is collective over the group given to [`Checkpointer::new`]; the checkpointer keeps
/// its own sub-group of the same ranks, so that an asynchronous save's messages never mix with
/// the training's.
pub struct Checkpointer {
    root: PathBuf,
    keep: usize,
    group: ProcessGroup,
    pending: Option<JoinHandle<Result<SaveReport>>>,
    /// [`Checkpointer::submit`] saves in the background.
    background: bool,
}

/// What a save did, for logs and figures.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Bytes this rank wrote.
    pub bytes: u64,
    /// Seconds this rank spent writing (serialising, writing, fsync and the manifest).
    pub seconds: f64,
}

impl Checkpointer {
    /// A checkpointer writing under `root`, keeping the last `keep` complete checkpoints.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] (named `keep`) when `keep` is 0.
    pub fn new(root: impl Into<PathBuf>, keep: usize, group: &ProcessGroup) -> Result<Self> {
        if keep == 0 {
            return Err(CheckpointError::piece(
                "keep",
                "keeping 0 checkpoints would delete each one as it is written; keep at least 1",
            ));
        }
        let all: Vec<usize> = (0..group.size()).collect();
        Ok(Self {
            root: root.into(),
            keep,
            group: group.split(&all)?,
            pending: None,
            background: false,
        })
    }

    /// Makes [`Self::submit`] save in the background ([`Self::save_async`]) rather than now.
    pub fn with_background(mut self, on: bool) -> Self {
        self.background = on;
        self
    }

    /// [`Self::save`], or [`Self::save_async`] when made with [`Self::with_background`]: what
    /// the step engines' `save` calls, so that the caller picks.
    ///
    /// # Errors
    /// As [`Self::save`] (or, in the background, the previous save's error).
    pub fn submit(
        &mut self,
        step: usize,
        pieces: Vec<Piece>,
        state: Value,
        rank_state: Value,
    ) -> Result<()> {
        match self.background {
            true => self.save_async(step, pieces, state, rank_state),
            false => self.save(step, pieces, state, rank_state).map(|_| ()),
        }
    }

    /// The directory of the checkpoint of `step`.
    pub fn dir_of(&self, step: usize) -> PathBuf {
        self.root.join(format!("step-{step:08}"))
    }

    /// Saves `pieces` (this rank's), the trainer's `state` (rank 0's is kept) and this rank's
    /// `rank_state`, as the checkpoint of `step`, then deletes checkpoints beyond the last
    /// `keep`. Collective; waits for a pending asynchronous save first.
    ///
    /// # Errors
    /// I/O errors; [`CheckpointError::Piece`] when the ranks' pieces disagree on a tensor's shape
    /// or dtype, or leave elements of a tensor unsaved; collective failures.
    pub fn save(
        &mut self,
        step: usize,
        pieces: Vec<Piece>,
        state: Value,
        rank_state: Value,
    ) -> Result<SaveReport> {
        self.wait()?;
        save_dir(
            &self.group,
            &self.dir_of(step),
            step,
            pieces,
            state,
            rank_state,
        )
        .and_then(|report| {
            prune(&self.group, &self.root, self.keep)?;
            Ok(report)
        })
    }

    /// Like [`Checkpointer::save`], but returns at once: the pieces (already in host memory)
    /// are written by a background thread while training goes on. The next save, or
    /// [`Checkpointer::wait`], waits for it and reports its error.
    ///
    /// # Errors
    /// The error of the previous asynchronous save.
    pub fn save_async(
        &mut self,
        step: usize,
        pieces: Vec<Piece>,
        state: Value,
        rank_state: Value,
    ) -> Result<()> {
        self.wait()?;
        let (group, dir, root, keep) = (
            self.group.clone(),
            self.dir_of(step),
            self.root.clone(),
            self.keep,
        );
        self.pending = Some(std::thread::spawn(move || {
            let report = save_dir(&group, &dir, step, pieces, state, rank_state)?;
            prune(&group, &root, keep)?;
            Ok(report)
        }));
        Ok(())
    }

    /// Waits for the pending asynchronous save, if any.
    ///
    /// # Errors
    /// That save's error.
    pub fn wait(&mut self) -> Result<Option<SaveReport>> {
        match self.pending.take() {
            None => Ok(None),
            Some(handle) => match handle.join() {
                Ok(result) => result.map(Some),
                Err(_) => Err(CheckpointError::piece(
                    "save",
                    "the background save thread panicked",
                )),
            },
        }
    }

    /// The newest complete checkpoint under `root` (`None` when there is none). Directories
    /// without a manifest (interrupted saves) are skipped.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] when `root` exists but cannot be listed; an error of
    /// [`Checkpoint::open`] for the newest complete one.
    pub fn latest(root: &Path) -> Result<Option<Checkpoint>> {
        match complete_steps(root)?.last() {
            None => Ok(None),
            Some((_, dir)) => Checkpoint::open(dir).map(Some),
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            eprintln!("burn-parallel: the last asynchronous checkpoint failed: {e}");
        }
    }
}

/// The step of a checkpoint directory named by [`Checkpointer::dir_of`].
fn step_of(dir: &Path) -> Option<usize> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// Complete checkpoints (with a manifest) under `root`, oldest first.
fn complete_steps(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io(root, e)),
    };
    let mut steps = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io(root, e))?;
        let Some(step) = step_of(&entry.path()) else {
            continue;
        };
        if entry.path().join(MANIFEST).exists() {
            steps.push((step, entry.path()));
        }
    }
    steps.sort();
    Ok(steps)
}

/// Deletes the complete checkpoints beyond the newest `keep`, and interrupted ones older than
/// the newest complete one (rank 0 deletes; the others wait).
fn prune(group: &ProcessGroup, root: &Path, keep: usize) -> Result<()> {
    if group.rank() == 0 {
        let complete = complete_steps(root)?;
        let newest = complete.last().map(|(s, _)| *s);
        let old = complete.len().saturating_sub(keep);
        for (_, dir) in &complete[..old] {
            fs::remove_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
        }
        // Interrupted saves older than the newest complete one will never complete.
        for entry in fs::read_dir(root).map_err(|e| CheckpointError::io(root, e))? {
            let path = entry.map_err(|e| CheckpointError::io(root, e))?.path();
            if let (Some(step), Some(newest)) = (step_of(&path), newest)
                && step < newest
                && !path.join(MANIFEST).exists()
            {
                fs::remove_dir_all(&path).map_err(|e| CheckpointError::io(&path, e))?;
            }
        }
    }
    group.barrier()?;
    Ok(())
}

/// `pieces` with consecutive pieces of one tensor joined where their regions are one: the same
/// box, adjacent flat ranges, the same dtype (a flat shard cuts a tensor-parallel shard padded
/// along a later dimension into one piece per row, which together are one region of the
/// logical tensor).
fn coalesce(pieces: Vec<Piece>) -> Vec<Piece> {
    let joins = |a: &Piece, b: &Piece| {
        a.name == b.name
            && a.region.shape == b.region.shape
            && a.region.bounds == b.region.bounds
            && a.region.flat.end == b.region.flat.start
            && a.data.dtype() == b.data.dtype()
    };
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    let mut pieces = pieces.into_iter().peekable();
    while let Some(first) = pieces.next() {
        let mut run = vec![first];
        while let Some(next) = pieces.next_if(|p| joins(&run[run.len() - 1], p)) {
            run.push(next);
        }
        if run.len() == 1 {
            out.extend(run);
            continue;
        }
        // One copy of the run's bytes (a row-by-row cut has as many pieces as rows).
        let (dtype, end) = (run[0].data.dtype(), run[run.len() - 1].region.flat.end);
        let numel = run.iter().map(|p| p.data.num_elements()).sum::<usize>();
        let mut bytes = Vec::with_capacity(run.iter().map(|p| p.data.as_bytes().len()).sum());
        for p in &run {
            bytes.extend_from_slice(p.data.as_bytes());
        }
        let mut joined = run.swap_remove(0);
        joined.data = TensorData::from_bytes_vec(bytes, vec![numel], dtype);
        joined.region.flat.end = end;
        out.push(joined);
    }
    out
}

/// Writes one checkpoint directory (collective over `group`).
fn save_dir(
    group: &ProcessGroup,
    dir: &Path,
    step: usize,
    pieces: Vec<Piece>,
    state: Value,
    rank_state: Value,
) -> Result<SaveReport> {
    let start = std::time::Instant::now();
    let (rank, n) = (group.rank(), group.size());
    if rank == 0 {
        fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
        let manifest = dir.join(MANIFEST);
        if manifest.exists() {
            fs::remove_file(&manifest).map_err(|e| CheckpointError::io(&manifest, e))?;
        }
    }
    group.barrier()?;
    let pieces = coalesce(pieces);
    let mut names = std::collections::HashSet::new();
    for p in &pieces {
        if !names.insert(p.name.clone()) {
            return Err(CheckpointError::piece(
                &p.name,
                format!("rank {rank} gave two pieces of it; give one region per tensor and rank"),
            ));
        }
    }
    let file = format!("rank-{rank:05}-of-{n:05}.safetensors");
    let tensors: Vec<(String, String, &TensorData)> = pieces
        .iter()
        .map(|p| {
            let identity = store::piece_identity(&p.name, &p.region);
            (p.name.clone(), identity, &p.data)
        })
        .collect();
    let file_manifest = store::write_file(&dir.join(&file), file, &tensors)?;
    let bytes = file_manifest.bytes;
    let report = RankReport {
        file: file_manifest,
        pieces: pieces
            .iter()
            .map(|p| {
                let dtype = store::dtype_name(p.data.dtype()).expect("checked by Piece::new");
                (
                    p.name.clone(),
                    p.region.shape.clone(),
                    dtype,
                    p.region.clone(),
                )
            })
            .collect(),
        state: rank_state,
    };
    drop(pieces);
    let reports =
        group.gather_bytes(serde_json::to_vec(&report).expect("a report serialises"), 0)?;
    // Rank 0 checks the pieces and writes the manifest; the others learn whether it did.
    let outcome: std::result::Result<(), String> = match reports {
        None => Ok(()),
        Some(reports) => write_manifest(dir, step, n, &reports, state).map_err(|e| e.to_string()),
    };
    let outcome: std::result::Result<(), String> = group.broadcast_object(Some(&outcome), 0)?;
    outcome.map_err(|reason| CheckpointError::piece("manifest", reason))?;
    Ok(SaveReport {
        dir: dir.to_path_buf(),
        bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Rank 0: assembles, checks and writes the manifest from the ranks' reports.
fn write_manifest(
    dir: &Path,
    step: usize,
    world_size: usize,
    reports: &[Vec<u8>],
    state: Value,
) -> Result<()> {
    let mut files = Vec::with_capacity(reports.len());
    let mut rank_states = Vec::with_capacity(reports.len());
    let mut tensors: BTreeMap<String, TensorManifest> = BTreeMap::new();
    for (k, bytes) in reports.iter().enumerate() {
        let report: RankReport = serde_json::from_slice(bytes)
            .map_err(|e| CheckpointError::piece("manifest", format!("rank {k}'s report: {e}")))?;
        for (name, shape, dtype, region) in report.pieces {
            let entry = tensors
                .entry(name.clone())
                .or_insert_with(|| TensorManifest {
                    shape: shape.clone(),
                    dtype: dtype.clone(),
                    pieces: Vec::new(),
                });
            if entry.shape != shape || entry.dtype != dtype {
                return Err(CheckpointError::piece(
                    &name,
                    format!(
                        "rank {k} saves it as {dtype} {shape:?}, an earlier rank as {} {:?}",
                        entry.dtype, entry.shape
                    ),
                ));
            }
            entry.pieces.push(PieceManifest { file: k, region });
        }
        files.push(report.file);
        rank_states.push(report.state);
    }
    for (name, t) in &tensors {
        let numel: usize = t.shape.iter().product();
        let mut runs: Vec<_> = t.pieces.iter().flat_map(|p| p.region.runs()).collect();
        runs.sort_by_key(|r| r.start);
        let mut covered = 0;
        for r in runs {
            if r.start > covered {
                return Err(CheckpointError::piece(
                    name,
                    format!(
                        "elements {covered}..{} of {numel} are saved by no rank: every element \
                         must belong to some rank's piece",
                        r.start
                    ),
                ));
            }
            covered = covered.max(r.end);
        }
        if covered < numel {
            return Err(CheckpointError::piece(
                name,
                format!("elements {covered}..{numel} of {numel} are saved by no rank"),
            ));
        }
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        step,
        world_size,
        tensors,
        files,
        state,
        rank_states,
        checksum: String::new(),
    };
    let json = manifest.sealed_json();
    store::write_atomic(&dir.join(MANIFEST), &json)
}

/// A complete checkpoint, opened for reading by any layout.
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    files: Vec<store::FileReader>,
    bytes_read: AtomicU64,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: reads the manifest and checks every file's length and
    /// header against it. Tensor data is read later, by region.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] naming the file when the manifest is missing (an
    /// interrupted save), malformed or of another format, or a file is missing, truncated or
    /// has an altered header.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.clone(),
            reason,
        };
        let bytes = fs::read(&path).map_err(|e| {
            corrupt(format!(
                "cannot read the manifest ({e}): the save did not complete; resume from an \
                 earlier checkpoint"
            ))
        })?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(format!("not a checkpoint manifest: {e}")))?;
        if manifest.format != FORMAT || !(1..=FORMAT_VERSION).contains(&manifest.format_version) {
            return Err(corrupt(format!(
                "format {} version {} is not {FORMAT} version 1 to {FORMAT_VERSION}",
                manifest.format, manifest.format_version
            )));
        }
        if manifest.format_version >= 2 {
            Manifest::check_seal(&bytes).map_err(&corrupt)?;
        }
        if manifest.files.len() != manifest.world_size
            || manifest.rank_states.len() != manifest.world_size
        {
            return Err(corrupt(format!(
                "{} files and {} rank states listed for {} ranks: every saving rank's file and \
                 state (its data position and optimizer step counters) must be there",
                manifest.files.len(),
                manifest.rank_states.len(),
                manifest.world_size
            )));
        }
        let mut files = Vec::with_capacity(manifest.files.len());
        let mut read = bytes.len() as u64;
        for f in &manifest.files {
            let reader = store::FileReader::open(dir, f)?;
            read += reader.header_bytes();
            files.push(reader);
        }
        for (name, t) in &manifest.tensors {
            for p in &t.pieces {
                let file = files.get(p.file).ok_or_else(|| {
                    corrupt(format!(
                        "tensor {name}: a piece in file {} of {}",
                        p.file,
                        files.len()
                    ))
                })?;
                p.region
                    .validate()
                    .map_err(|e| corrupt(format!("tensor {name}: {e}")))?;
                file.check_tensor(name, &t.dtype, p.region.numel())?;
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            files,
            bytes_read: AtomicU64::new(read),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The step it was saved at.
    pub fn step(&self) -> usize {
        self.manifest.step
    }

    /// The trainer's state (rank 0's).
    pub fn state(&self) -> &Value {
        &self.manifest.state
    }

    /// Rank `rank`'s own state as saved (`Null` past the saving world).
    pub fn rank_state(&self, rank: usize) -> &Value {
        self.manifest.rank_states.get(rank).unwrap_or(&Value::Null)
    }

    /// Bytes read from the checkpoint's files so far (manifest and headers included).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// The full shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.manifest.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// Checks that the checkpoint holds exactly the tensors `expected` (name, full shape).
    ///
    /// # Errors
    /// [`CheckpointError::Mismatch`] listing the missing, unexpected and reshaped tensors.
    pub fn check<'a>(
        &self,
        expected: impl IntoIterator<Item = (&'a str, &'a [usize])>,
    ) -> Result<()> {
        check_tensors(self, expected)
    }

    /// Reads `region` of tensor `name` (its elements in the region's order, as a 1-D tensor of
    /// the saved dtype), reading only the byte ranges of the saved pieces that meet it, each
    /// checked against its chunk checksums.
    ///
    /// # Errors
    /// [`CheckpointError::Piece`] when there is no such tensor or the region does not fit its
    /// shape; [`CheckpointError::Corrupt`] naming the file and tensor on a checksum mismatch.
    pub fn read(&self, name: &str, region: &Region) -> Result<TensorData> {
        self.read_shaped(name, region, vec![region.numel()])
    }

    /// [`Checkpoint::read`] into a tensor of `shape` (with the region's number of elements).
    fn read_shaped(&self, name: &str, region: &Region, shape: Vec<usize>) -> Result<TensorData> {
        let t = self.manifest.tensors.get(name).ok_or_else(|| {
            CheckpointError::piece(
                name,
                format!(
                    "not in the checkpoint {} (it has {} tensors)",
                    self.dir.display(),
                    self.manifest.tensors.len()
                ),
            )
        })?;
        if region.shape != t.shape {
            return Err(CheckpointError::piece(
                name,
                format!(
                    "asked for a region of shape {:?}, saved with shape {:?}",
                    region.shape, t.shape
                ),
            ));
        }
        region
            .validate()
            .map_err(|e| CheckpointError::piece(name, e))?;
        let dtype =
            store::dtype_from_name(&t.dtype).map_err(|e| CheckpointError::piece(name, e))?;
        let size = dtype.size();
        let want = region.runs();
        let mut out = vec![0u8; region.numel() * size];
        // The element ranges of the region filled so far (pieces may overlap).
        let mut filled: Vec<(usize, usize)> = Vec::new();
        for p in &t.pieces {
            let hits = overlaps(&want, &p.region.runs());
            if hits.is_empty() {
                continue;
            }
            let read = self.files[p.file].read_ranges(
                name,
                &self.manifest.identity(name, &p.region),
                hits.iter().map(|&(_, h, n)| (h * size, n * size)),
                |k, at, bytes| {
                    let start = hits[k].0 * size + at;
                    out[start..start + bytes.len()].copy_from_slice(bytes);
                },
            )?;
            filled.extend(hits.iter().map(|&(w, _, n)| (w, w + n)));
            self.bytes_read.fetch_add(read, Ordering::Relaxed);
        }
        filled.sort_unstable();
        let mut covered = 0;
        for &(start, end) in &filled {
            if start > covered {
                break;
            }
            covered = covered.max(end);
        }
        if covered < region.numel() {
            let first = covered;
            return Err(CheckpointError::Corrupt {
                path: self.dir.join(MANIFEST),
                reason: format!(
                    "tensor {name}: element {first} of the requested region is in no piece"
                ),
            });
        }
        Ok(TensorData::from_bytes_vec(out, shape, dtype))
    }

    /// Reads the whole of tensor `name` in its full shape.
    ///
    /// # Errors
    /// See [`Checkpoint::read`].
    pub fn read_full(&self, name: &str) -> Result<TensorData> {
        let shape = self
            .shape(name)
            .ok_or_else(|| CheckpointError::piece(name, "not in the checkpoint"))?
            .to_vec();
        self.read_shaped(name, &Region::full(&shape), shape.clone())
    }
}

/// Where `needle` last begins in `haystack`.
fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// The element type names of the format, for a Burn dtype.
pub fn dtype_name(dtype: DType) -> std::result::Result<String, String> {
    store::dtype_name(dtype)
}
