//! Sharded, reshardable checkpoints of flat parameter and optimizer-state shards.
//!
//! Layout of a checkpoint directory:
//!
//! - `rank-00000-of-00004.safetensors`, one per shard rank: for every unit `u`, the tensor
//!   `u/param` (this rank's slice of the unit's flat space) and `u/state/<name>` (the optimizer
//!   state tensors, slices of the same range); the optimizer's scalars (step counters) are in the
//!   safetensors metadata.
//! - `manifest.json`, written last by rank 0: format version, world size, step, units (name,
//!   numel, parameter paths and shapes) and, for every rank file, its length, the FNV-1a 64
//!   checksum of its safetensors header, and the FNV-1a 64 checksums of every tensor's data in
//!   chunks of [`CHUNK_BYTES`], plus free-form user metadata.
//!
//! Atomicity: every file is written to a `.tmp` name, synced and renamed; an existing manifest is
//! removed *first*, and the new one is written only after every rank reported its file, so a crash
//! at any point leaves a directory without a manifest, which never loads.
//!
//! Loading reads only what the rank needs. [`CheckpointReader::open`] checks every file's length
//! against the manifest and reads and checks only the safetensors headers (a few hundred bytes
//! each); [`CheckpointReader::read`] then seeks to, and reads, just the chunks of each saved
//! tensor that overlap the requested range, and checks each chunk's checksum before using it. A
//! rank of a run with `M` ranks thus reads about `1/M` of the checkpoint (plus at most two chunks
//! per saved shard it overlaps) and holds no more than what it returns plus one chunk. A
//! corrupt byte is reported by every rank whose reads cover it, as
//! [`ZeroError::CorruptCheckpoint`] naming the file, tensor and byte range.
//!
//! Resharding: shards are ranges of each unit's flat space, so a run with `M` ranks reads, for
//! its range under `M`, the overlapping parts of the `N` saved shards (every rank reads the
//! files it needs: the directory must be on a file system all ranks see).

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::TensorData;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, ZeroError};
use crate::flat::{FlatEntry, FlatLayout, shard_range};
use crate::zero::ShardGroups;

/// Version of the on-disk format (2: per-chunk checksums, read by ranges).
pub const FORMAT_VERSION: u32 = 2;

/// Size of the pieces of tensor data that carry their own checksum in the manifest: the unit a
/// load reads and verifies.
pub const CHUNK_BYTES: usize = 256 * 1024;
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
    /// FNV-1a 64 of the safetensors header (its 8-byte length and its JSON), hexadecimal.
    pub header_fnv64: String,
    /// Size of the checksummed chunks of tensor data ([`CHUNK_BYTES`] when saved).
    pub chunk_bytes: u64,
    /// For every tensor, the FNV-1a 64 of each chunk of its data, in order (the last chunk may
    /// be shorter), hexadecimal.
    pub chunks: BTreeMap<String, Vec<String>>,
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
        let info = file_manifest(file, &bytes)?;
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

/// The manifest entry of a serialised shard file: its length, header checksum and per-chunk
/// checksums.
fn file_manifest(file: String, bytes: &[u8]) -> Result<FileManifest> {
    let bad = |reason: String| ZeroError::Config(format!("serialising {file}: {reason}"));
    let header = parse_header(bytes).map_err(bad)?;
    let mut chunks = BTreeMap::new();
    for (name, t) in &header.tensors {
        let data =
            &bytes[(header.data_start + t.begin) as usize..(header.data_start + t.end) as usize];
        chunks.insert(name.clone(), data.chunks(CHUNK_BYTES).map(fnv64).collect());
    }
    Ok(FileManifest {
        header_fnv64: fnv64(&bytes[..header.data_start as usize]),
        bytes: bytes.len() as u64,
        chunk_bytes: CHUNK_BYTES as u64,
        chunks,
        file,
    })
}

/// Where a tensor's data lies in a safetensors file, relative to the data section.
#[derive(Debug, Clone)]
struct TensorPlace {
    dtype: String,
    begin: u64,
    end: u64,
}

/// A parsed safetensors header.
#[derive(Debug, Clone)]
struct Header {
    /// Offset of the data section in the file (8 + the JSON's length).
    data_start: u64,
    tensors: BTreeMap<String, TensorPlace>,
    metadata: HashMap<String, String>,
}

/// Parses the header at the start of `bytes` (which must hold at least all of it).
fn parse_header(bytes: &[u8]) -> std::result::Result<Header, String> {
    let len = header_len(bytes)?;
    let json = bytes
        .get(8..8 + len as usize)
        .ok_or_else(|| format!("the header claims {len} bytes but the file is shorter"))?;
    parse_header_json(json, 8 + len)
}

/// The length of the header's JSON, from the file's first 8 bytes.
fn header_len(bytes: &[u8]) -> std::result::Result<u64, String> {
    let first: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("shorter than a safetensors header")?;
    let len = u64::from_le_bytes(first);
    if len > 100 << 20 {
        return Err(format!("a header of {len} bytes is not plausible"));
    }
    Ok(len)
}

fn parse_header_json(json: &[u8], data_start: u64) -> std::result::Result<Header, String> {
    let value: Value =
        serde_json::from_slice(json).map_err(|e| format!("the header is not JSON: {e}"))?;
    let object = value.as_object().ok_or("the header is not a JSON object")?;
    let mut header = Header {
        data_start,
        tensors: BTreeMap::new(),
        metadata: HashMap::new(),
    };
    for (name, entry) in object {
        if name == "__metadata__" {
            header.metadata = serde_json::from_value(entry.clone())
                .map_err(|e| format!("malformed __metadata__: {e}"))?;
            continue;
        }
        let dtype = entry["dtype"].as_str().unwrap_or_default().to_string();
        let offsets = entry["data_offsets"]
            .as_array()
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| format!("tensor {name} has no valid data_offsets"))?;
        if offsets.0 > offsets.1 {
            return Err(format!("tensor {name} has data_offsets {offsets:?}"));
        }
        header.tensors.insert(
            name.clone(),
            TensorPlace {
                dtype,
                begin: offsets.0,
                end: offsets.1,
            },
        );
    }
    Ok(header)
}

/// A validated checkpoint, read for any number of ranks: only the headers are in memory, and
/// every [`CheckpointReader::read`] reads the chunks it needs from the files.
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    headers: Vec<Header>,
    bytes_read: AtomicU64,
}

impl CheckpointReader {
    /// Opens `dir`: reads and checks the manifest, every file's length, and every file's
    /// header (its checksum and its tensors against the manifest). Tensor data is read later,
    /// by range, by [`CheckpointReader::read`].
    ///
    /// # Errors
    /// [`ZeroError::CorruptCheckpoint`] when the manifest is missing (an interrupted save),
    /// unreadable or of another format version, or a file is missing, truncated or has an
    /// altered header.
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
        let value: Value = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(&mpath, format!("invalid manifest: {e}")))?;
        let version = value["format_version"].as_u64().unwrap_or(0);
        if version != u64::from(FORMAT_VERSION) {
            return Err(corrupt(
                &mpath,
                format!(
                    "format version {version} is not supported (this build reads \
                     {FORMAT_VERSION}, with per-chunk checksums; version 1 had one checksum \
                     per file): load it with the burn-zero version that saved it"
                ),
            ));
        }
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| corrupt(&mpath, format!("invalid manifest: {e}")))?;
        if manifest.files.len() != manifest.world_size {
            return Err(corrupt(&mpath, "one file per rank expected".into()));
        }
        let mut headers = Vec::new();
        let mut bytes_read = bytes.len() as u64;
        for f in &manifest.files {
            let path = dir.join(&f.file);
            let mut file = File::open(&path)
                .map_err(|e| corrupt(&path, format!("missing shard file: {e}")))?;
            let len = file
                .metadata()
                .map_err(|e| corrupt(&path, format!("cannot stat the shard file: {e}")))?
                .len();
            if len != f.bytes {
                return Err(corrupt(
                    &path,
                    format!(
                        "the file has {len} bytes but the manifest records {}: truncated or \
                         overwritten",
                        f.bytes
                    ),
                ));
            }
            // The header only: its length, then its JSON.
            let mut head = vec![0u8; 8];
            file.read_exact(&mut head)
                .map_err(|e| corrupt(&path, format!("cannot read the header: {e}")))?;
            let json_len = header_len(&head).map_err(|e| corrupt(&path, e))?;
            if 8 + json_len > len {
                return Err(corrupt(
                    &path,
                    "the header runs past the end of the file".into(),
                ));
            }
            head.resize(8 + json_len as usize, 0);
            file.read_exact(&mut head[8..])
                .map_err(|e| corrupt(&path, format!("cannot read the header: {e}")))?;
            bytes_read += head.len() as u64;
            let sum = fnv64(&head);
            if sum != f.header_fnv64 {
                return Err(corrupt(
                    &path,
                    format!(
                        "header checksum {sum} differs from the manifest's {}: the file is \
                         corrupt; resume from an earlier checkpoint",
                        f.header_fnv64
                    ),
                ));
            }
            let header = parse_header(&head).map_err(|e| corrupt(&path, e))?;
            for (name, t) in &header.tensors {
                let chunks = f.chunks.get(name).map_or(0, Vec::len) as u64;
                let expected = (t.end - t.begin).div_ceil(f.chunk_bytes.max(1));
                if header.data_start + t.end > len || chunks != expected || f.chunk_bytes == 0 {
                    return Err(corrupt(
                        &path,
                        format!("tensor {name} does not match the manifest's chunk checksums"),
                    ));
                }
            }
            headers.push(header);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            headers,
            bytes_read: AtomicU64::new(bytes_read),
        })
    }

    /// Bytes read from the checkpoint's files by this reader so far (manifest and headers
    /// included).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Elements `lo..hi` (f32) of tensor `name` of saved shard file `k`: reads the chunks that
    /// cover them, checks each chunk's checksum, and appends the values to `out`.
    fn read_piece(
        &self,
        k: usize,
        name: &str,
        lo: usize,
        hi: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let f = &self.manifest.files[k];
        let path = self.dir.join(&f.file);
        let corrupt = |reason: String| ZeroError::CorruptCheckpoint {
            path: path.clone(),
            reason,
        };
        let place =
            self.headers[k]
                .tensors
                .get(name)
                .ok_or_else(|| ZeroError::CheckpointMismatch {
                    path: path.clone(),
                    reason: format!("no tensor {name}"),
                })?;
        if place.dtype != "F32" {
            return Err(corrupt(format!(
                "tensor {name} is {}, not F32",
                place.dtype
            )));
        }
        let len = place.end - place.begin;
        let (lo_b, hi_b) = (lo as u64 * 4, hi as u64 * 4);
        if hi_b > len {
            return Err(corrupt(format!(
                "tensor {name} has {} elements, {hi} were expected",
                len / 4
            )));
        }
        let chunk = f.chunk_bytes;
        let (first, last) = (lo_b / chunk, (hi_b - 1) / chunk);
        let mut file = File::open(&path).map_err(|e| ZeroError::io(&path, e))?;
        let mut buf = Vec::new();
        let sums = &f.chunks[name];
        for c in first..=last {
            let start = c * chunk;
            let end = ((c + 1) * chunk).min(len);
            buf.resize((end - start) as usize, 0);
            file.seek(SeekFrom::Start(
                self.headers[k].data_start + place.begin + start,
            ))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| ZeroError::io(&path, e))?;
            self.bytes_read
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
            let sum = fnv64(&buf);
            if sum != sums[c as usize] {
                return Err(corrupt(format!(
                    "checksum {sum} of bytes {start}..{end} of tensor {name} differs from the \
                     manifest's {}: the file is corrupt; resume from an earlier checkpoint",
                    sums[c as usize]
                )));
            }
            let (a, b) = (lo_b.max(start) - start, hi_b.min(end) - start);
            out.extend(
                buf[a as usize..b as usize]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(())
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
    /// assembled from the saved shards: only the checksummed chunks that overlap `range` are
    /// read, and each is verified.
    ///
    /// # Errors
    /// [`ZeroError::CheckpointMismatch`] for an unknown unit or key, or a range out of bounds;
    /// [`ZeroError::CorruptCheckpoint`] when a chunk read does not match its checksum;
    /// [`ZeroError::Io`] when a file cannot be read.
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
            let name = format!("{unit}/{key}");
            self.read_piece(k, &name, lo - saved.start, hi - saved.start, &mut out)?;
        }
        Ok(out)
    }

    /// The optimizer state names saved for `unit` (empty when there was no state yet).
    ///
    /// # Errors
    /// When the unit is unknown.
    pub fn state_names(&self, unit: &str) -> Result<Vec<String>> {
        self.unit(unit)?;
        let prefix = format!("{unit}/state/");
        let mut names: Vec<String> = self.headers[0]
            .tensors
            .keys()
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
        let text = self.headers[0]
            .metadata
            .get(&format!("{unit}/scalars"))
            .cloned()
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
