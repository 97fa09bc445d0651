//! Sharded, reshardable checkpoints of flat parameter and optimizer-state shards.
//!
//! Layout of a checkpoint directory:
//!
//! - `rank-00000-of-00004.safetensors`, one per shard rank: for every unit `u`, the tensor
//!   `u/param` (this rank's slice of the unit's flat space) and `u/state/<name>` (the optimizer
//!   state tensors, slices of the same range); the optimizer's scalars (step counters) are in the
//!   safetensors metadata.
//! - `manifest.json`, written last by rank 0: format version, world size, step, units (name,
//!   numel, parameter paths and shapes) and, for every rank file, its length and FNV-1a 64
//!   checksum, plus free-form user metadata.
//!
//! Atomicity: every file is written to a `.tmp` name, synced and renamed; an existing manifest is
//! removed *first*, and the new one is written only after every rank reported its file, so a crash
//! at any point leaves a directory without a manifest, which never loads. Loading checks every
//! file's length and checksum against the manifest before reading anything.
//!
//! Resharding: shards are ranges of each unit's flat space, so a run with `M` ranks reads, for
//! its range under `M`, the overlapping parts of the `N` saved shards (every rank reads the
//! files it needs: the directory must be on a file system all ranks see).

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, ZeroError};
use crate::flat::{FlatEntry, FlatLayout, shard_range};
use crate::zero::ShardGroups;

/// Version of the on-disk format.
pub const FORMAT_VERSION: u32 = 1;
const MANIFEST: &str = "manifest.json";

/// One unit of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnitManifest {
    /// Unit name.
    pub name: String,
    /// Elements of the unit's flat space.
    pub numel: usize,
    /// The parameters, in flat order.
    pub entries: Vec<FlatEntry>,
}

/// One rank's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileManifest {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Length in bytes.
    pub bytes: u64,
    /// FNV-1a 64 of the content, hexadecimal.
    pub fnv64: String,
}

/// The manifest of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Number of shard ranks that saved it.
    pub world_size: usize,
    /// Training step (user-defined: usually the number of steps done).
    pub step: usize,
    /// Units in order.
    pub units: Vec<UnitManifest>,
    /// One file per rank, in rank order.
    pub files: Vec<FileManifest>,
    /// Free-form metadata (config, optimizer name...).
    pub metadata: Value,
}

/// What one rank contributes for one unit.
pub struct UnitShard<'a> {
    /// Unit name.
    pub name: &'a str,
    /// The unit's layout.
    pub layout: &'a FlatLayout,
    /// This rank's range.
    pub range: Range<usize>,
    /// Parameter values of the range (fp32).
    pub params: Vec<f32>,
    /// Optimizer state tensors of the range.
    pub state: Vec<(String, TensorData)>,
    /// Optimizer scalars.
    pub scalars: BTreeMap<String, Value>,
}

fn fnv64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn rank_file(rank: usize, n: usize) -> String {
    format!("rank-{rank:05}-of-{n:05}.safetensors")
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(|e| ZeroError::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| ZeroError::io(&tmp, e))?;
    f.sync_all().map_err(|e| ZeroError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| ZeroError::io(path, e))
}

/// Saves this rank's shards into `dir` (collective over the shard group; with hybrid sharding
/// only replica 0 writes, the others hold the same shards).
///
/// # Errors
/// I/O errors, collective failures, inconsistent units across ranks.
pub fn save(
    dir: &Path,
    groups: &ShardGroups,
    step: usize,
    units: &[UnitShard<'_>],
    metadata: Value,
) -> Result<()> {
    let writer = groups.replicate().is_none_or(|r| r.rank() == 0);
    let g = groups.shard();
    let (rank, n) = (g.rank(), g.size());
    if writer {
        if rank == 0 {
            fs::create_dir_all(dir).map_err(|e| ZeroError::io(dir, e))?;
            let manifest = dir.join(MANIFEST);
            if manifest.exists() {
                fs::remove_file(&manifest).map_err(|e| ZeroError::io(&manifest, e))?;
            }
        }
        g.barrier()?;
        let mut tensors: Vec<(String, TensorData)> = Vec::new();
        let mut meta = HashMap::new();
        for u in units {
            let len = u.params.len();
            if len != u.range.len() {
                return Err(ZeroError::Config(format!(
                    "unit {}: params do not cover the range",
                    u.name
                )));
            }
            tensors.push((
                format!("{}/param", u.name),
                TensorData::new(u.params.clone(), [len]),
            ));
            for (k, d) in &u.state {
                tensors.push((format!("{}/state/{k}", u.name), d.clone().convert::<f32>()));
            }
            meta.insert(
                format!("{}/scalars", u.name),
                serde_json::to_string(&u.scalars).expect("json"),
            );
            meta.insert(
                format!("{}/range", u.name),
                format!("{}..{}", u.range.start, u.range.end),
            );
        }
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(k, d)| {
                let view = TensorView::new(Dtype::F32, d.shape().as_slice().to_vec(), d.as_bytes())
                    .expect("shape matches bytes");
                (k.clone(), view)
            })
            .collect();
        let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| {
            ZeroError::Config(format!("serialising the shard with safetensors: {e}"))
        })?;
        let file = rank_file(rank, n);
        write_atomic(&dir.join(&file), &bytes)?;
        let info = FileManifest {
            file,
            bytes: bytes.len() as u64,
            fnv64: fnv64(&bytes),
        };
        let all = g.all_gather_object(&info)?;
        if rank == 0 {
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                world_size: n,
                step,
                units: units
                    .iter()
                    .map(|u| UnitManifest {
                        name: u.name.to_string(),
                        numel: u.layout.numel(),
                        entries: u.layout.entries().to_vec(),
                    })
                    .collect(),
                files: all,
                metadata,
            };
            let json = serde_json::to_vec_pretty(&manifest).expect("json");
            write_atomic(&dir.join(MANIFEST), &json)?;
        }
        g.barrier()?;
    }
    if let Some(r) = groups.replicate() {
        r.barrier()?;
    }
    Ok(())
}

/// A validated checkpoint, read for any number of ranks.
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    files: Vec<Option<Vec<u8>>>,
}

impl CheckpointReader {
    /// Opens `dir`: reads and checks the manifest, and the length and checksum of every file.
    ///
    /// # Errors
    /// [`ZeroError::CorruptCheckpoint`] when the manifest is missing (an interrupted save) or
    /// unreadable, or a file is missing, truncated or altered.
    pub fn open(dir: &Path) -> Result<Self> {
        let corrupt = |path: &Path, reason: String| ZeroError::CorruptCheckpoint {
            path: path.to_path_buf(),
            reason,
        };
        let mpath = dir.join(MANIFEST);
        let bytes = fs::read(&mpath).map_err(|e| {
            corrupt(
                &mpath,
                format!(
                    "cannot read the manifest ({e}): the save did not complete or this is not a \
                 burn-zero checkpoint; resume from an earlier checkpoint"
                ),
            )
        })?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(&mpath, format!("invalid manifest: {e}")))?;
        if manifest.format_version != FORMAT_VERSION {
            return Err(corrupt(
                &mpath,
                format!(
                    "format version {} is not supported (this build reads {FORMAT_VERSION})",
                    manifest.format_version
                ),
            ));
        }
        if manifest.files.len() != manifest.world_size {
            return Err(corrupt(&mpath, "one file per rank expected".into()));
        }
        let mut files = Vec::new();
        for f in &manifest.files {
            let path = dir.join(&f.file);
            let data =
                fs::read(&path).map_err(|e| corrupt(&path, format!("missing shard file: {e}")))?;
            if data.len() as u64 != f.bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "the file has {} bytes but the manifest records {}: truncated or overwritten",
                        data.len(),
                        f.bytes
                    ),
                ));
            }
            let sum = fnv64(&data);
            if sum != f.fnv64 {
                return Err(corrupt(
                    &path,
                    format!(
                        "checksum {sum} differs from the manifest's {}: the file is corrupt",
                        f.fnv64
                    ),
                ));
            }
            SafeTensors::deserialize(&data)
                .map_err(|e| corrupt(&path, format!("not a valid safetensors file: {e}")))?;
            files.push(Some(data));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            files,
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Checks that the checkpoint's units are `units` (names and layouts).
    ///
    /// # Errors
    /// [`ZeroError::CheckpointMismatch`] naming the first difference.
    pub fn check_units(&self, units: &[(&str, &FlatLayout)]) -> Result<()> {
        let mismatch = |reason: String| ZeroError::CheckpointMismatch {
            path: self.dir.clone(),
            reason,
        };
        let saved: Vec<&str> = self
            .manifest
            .units
            .iter()
            .map(|u| u.name.as_str())
            .collect();
        let ours: Vec<&str> = units.iter().map(|u| u.0).collect();
        if saved != ours {
            return Err(mismatch(format!(
                "it holds units {saved:?} but this model is wrapped as {ours:?} (same stage and \
                 wrapping plan needed)"
            )));
        }
        for (u, (_, layout)) in self.manifest.units.iter().zip(units) {
            if u.entries != layout.entries() {
                let diff = u
                    .entries
                    .iter()
                    .zip(layout.entries())
                    .find(|(a, b)| a != b)
                    .map(|(a, b)| {
                        format!("saved {} {:?} vs {} {:?}", a.path, a.shape, b.path, b.shape)
                    })
                    .unwrap_or_else(|| {
                        format!(
                            "{} vs {} parameters",
                            u.entries.len(),
                            layout.entries().len()
                        )
                    });
                return Err(mismatch(format!("unit {}: {diff}", u.name)));
            }
        }
        Ok(())
    }

    fn unit(&self, unit: &str) -> Result<&UnitManifest> {
        self.manifest
            .units
            .iter()
            .find(|u| u.name == unit)
            .ok_or_else(|| ZeroError::CheckpointMismatch {
                path: self.dir.clone(),
                reason: format!("no unit named {unit}"),
            })
    }

    /// Elements `range` of tensor `key` (`"param"` or `"state/<name>"`) of `unit`'s flat space,
    /// assembled from the saved shards.
    ///
    /// # Errors
    /// [`ZeroError::CheckpointMismatch`] for an unknown unit or key, or a range out of bounds.
    pub fn read(&self, unit: &str, key: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let u = self.unit(unit)?;
        if range.end > u.numel {
            return Err(ZeroError::CheckpointMismatch {
                path: self.dir.clone(),
                reason: format!("range {range:?} beyond unit {unit} of {} elements", u.numel),
            });
        }
        let n = self.manifest.world_size;
        let mut out = Vec::with_capacity(range.len());
        for k in 0..n {
            let saved = shard_range(u.numel, k, n);
            let (lo, hi) = (saved.start.max(range.start), saved.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let data = self.files[k].as_ref().expect("read at open");
            let st = SafeTensors::deserialize(data).expect("validated at open");
            let name = format!("{unit}/{key}");
            let view = st
                .tensor(&name)
                .map_err(|_| ZeroError::CheckpointMismatch {
                    path: self.dir.join(&self.manifest.files[k].file),
                    reason: format!("no tensor {name}"),
                })?;
            let bytes = &view.data()[(lo - saved.start) * 4..(hi - saved.start) * 4];
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(out)
    }

    /// The optimizer state names saved for `unit` (empty when there was no state yet).
    ///
    /// # Errors
    /// When the unit is unknown.
    pub fn state_names(&self, unit: &str) -> Result<Vec<String>> {
        self.unit(unit)?;
        let data = self.files[0].as_ref().expect("read at open");
        let st = SafeTensors::deserialize(data).expect("validated at open");
        let prefix = format!("{unit}/state/");
        let mut names: Vec<String> = st
            .names()
            .into_iter()
            .filter_map(|n| n.strip_prefix(&prefix).map(str::to_string))
            .collect();
        names.sort();
        Ok(names)
    }

    /// The optimizer scalars saved for `unit` (rank 0's; they are the same on every rank).
    ///
    /// # Errors
    /// When the unit is unknown or the metadata is malformed.
    pub fn scalars(&self, unit: &str) -> Result<BTreeMap<String, Value>> {
        self.unit(unit)?;
        let data = self.files[0].as_ref().expect("read at open");
        let (_, meta) = SafeTensors::read_metadata(data).expect("validated at open");
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(&format!("{unit}/scalars")).cloned())
            .unwrap_or_else(|| "{}".into());
        serde_json::from_str(&text).map_err(|e| ZeroError::CorruptCheckpoint {
            path: self.dir.join(&self.manifest.files[0].file),
            reason: format!("optimizer scalars of {unit}: {e}"),
        })
    }

    /// The optimizer state of `unit` for `range`: named tensors ready for
    /// [`crate::optim::ShardedOptimizer::import`].
    ///
    /// # Errors
    /// See [`CheckpointReader::read`].
    pub fn state(&self, unit: &str, range: Range<usize>) -> Result<Vec<(String, TensorData)>> {
        let mut out = Vec::new();
        for name in self.state_names(unit)? {
            let v = self.read(unit, &format!("state/{name}"), range.clone())?;
            let len = v.len();
            out.push((name, TensorData::new(v, [len])));
        }
        Ok(out)
    }
}
