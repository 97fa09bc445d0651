//! One rank's file: safetensors with a checksum per chunk, written atomically and read by byte
//! ranges.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use super::error::{CheckpointError, Result};

/// Size of the pieces of tensor data that carry their own checksum: the unit a load reads and
/// verifies.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// One rank's file, as the manifest records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileManifest {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Length in bytes.
    pub bytes: u64,
    /// CRC-32 of the safetensors header (its 8-byte length and its JSON), hexadecimal.
    pub header_crc32: String,
    /// Size of the checksummed chunks of tensor data.
    pub chunk_bytes: u64,
    /// For every tensor, the CRC-32 of each chunk of its data, in order, hexadecimal.
    pub chunks: BTreeMap<String, Vec<String>>,
}

/// The path of the file `name` that `listing` (a manifest, an index) names inside `dir`:
/// refused unless `name` is a relative path that stays inside `dir` (no `..`, no root, no
/// drive), so that an edited listing cannot make a reader open any other file.
///
/// # Errors
/// [`CheckpointError::Corrupt`] naming `listing` and the file name.
pub(crate) fn file_in(dir: &Path, name: &str, listing: &Path) -> Result<PathBuf> {
    use std::path::Component;
    let inside = !name.is_empty()
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    match inside {
        true => Ok(dir.join(name)),
        false => Err(CheckpointError::Corrupt {
            path: listing.to_path_buf(),
            reason: format!(
                "it names the file {name:?}, which is not inside {}: a listed file must be a \
                 relative path within its folder",
                dir.display()
            ),
        }),
    }
}

/// CRC-32 of `bytes` (hardware-accelerated where the CPU has it), hexadecimal.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// CRC-32 of a chunk of a piece's data, bound to the piece: the checksum runs over `identity`
/// (the piece's tensor and region, [`piece_identity`]) and then the chunk, so that a manifest
/// edited to place a piece in another tensor or region fails the check even though every
/// chunk's bytes are intact. An empty identity gives the plain CRC (format version 1).
pub(crate) fn chunk_checksum(identity: &str, bytes: &[u8]) -> String {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(identity.as_bytes());
    hasher.update(bytes);
    format!("{:08x}", hasher.finalize())
}

/// What a piece's chunk checksums are bound to: its tensor's name and its region (full shape,
/// box and flat range).
pub(crate) fn piece_identity(name: &str, region: &super::region::Region) -> String {
    serde_json::to_string(&(name, region)).expect("a name and a region serialise")
}

/// The safetensors name of a Burn dtype.
pub(crate) fn dtype_name(dtype: DType) -> std::result::Result<String, String> {
    Ok(safetensors_dtype(dtype)?.to_string())
}

fn safetensors_dtype(dtype: DType) -> std::result::Result<Dtype, String> {
    Ok(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 | DType::Flex32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U64 => Dtype::U64,
        DType::U32 => Dtype::U32,
        DType::U16 => Dtype::U16,
        DType::U8 => Dtype::U8,
        other => {
            return Err(format!(
                "dtype {other:?} cannot be checkpointed; convert it first"
            ));
        }
    })
}

/// The Burn dtype of a safetensors name.
pub(crate) fn dtype_from_name(name: &str) -> std::result::Result<DType, String> {
    Ok(match name {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "I16" => DType::I16,
        "I8" => DType::I8,
        "U64" => DType::U64,
        "U32" => DType::U32,
        "U16" => DType::U16,
        "U8" => DType::U8,
        other => return Err(format!("unknown dtype {other}")),
    })
}

/// Writes `bytes` to `path` atomically: a temporary file, fsync, rename, fsync of the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    f.write_all(bytes)
        .map_err(|e| CheckpointError::io(&tmp, e))?;
    f.sync_all().map_err(|e| CheckpointError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, e))?;
    sync_parent(path);
    Ok(())
}

/// Serialises `tensors` (each flattened to 1-D) into `path` atomically (streamed from the
/// tensors' memory, no copy of the whole file) and returns the file's manifest entry. Each
/// tensor comes with the identity its chunk checksums are bound to ([`chunk_checksum`]).
pub(crate) fn write_file(
    path: &Path,
    file: String,
    tensors: &[(String, String, &TensorData)],
) -> Result<FileManifest> {
    let views = tensors
        .iter()
        .map(|(name, _, data)| {
            let dtype =
                safetensors_dtype(data.dtype()).map_err(|e| CheckpointError::piece(name, e))?;
            let view = TensorView::new(dtype, vec![data.num_elements()], data.as_bytes())
                .map_err(|e| CheckpointError::piece(name, format!("{e}")))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let tmp = path.with_extension("tmp");
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| CheckpointError::piece(&file, format!("writing {}: {e}", tmp.display())))?;
    let mut f = File::open(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    f.sync_all().map_err(|e| CheckpointError::io(&tmp, e))?;
    let bytes = f
        .metadata()
        .map_err(|e| CheckpointError::io(&tmp, e))?
        .len();
    let head = read_header(&mut f).map_err(|reason| CheckpointError::Corrupt {
        path: tmp.clone(),
        reason,
    })?;
    // The data section holds each tensor's bytes as they are in memory (little-endian).
    let chunks = tensors
        .iter()
        .map(|(name, identity, data)| {
            let sums = data
                .as_bytes()
                .chunks(CHUNK_BYTES)
                .map(|chunk| chunk_checksum(identity, chunk))
                .collect();
            (name.clone(), sums)
        })
        .collect();
    fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, e))?;
    sync_parent(path);
    Ok(FileManifest {
        header_crc32: checksum(&head),
        bytes,
        chunk_bytes: CHUNK_BYTES as u64,
        chunks,
        file,
    })
}

/// Reads the header (its 8-byte length and its JSON) at the start of `file`.
fn read_header(file: &mut File) -> std::result::Result<Vec<u8>, String> {
    let mut head = vec![0u8; 8];
    file.read_exact(&mut head)
        .map_err(|e| format!("cannot read the header: {e}"))?;
    let json_len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    if json_len > 100 << 20 {
        return Err(format!("a header of {json_len} bytes is not plausible"));
    }
    head.resize(8 + json_len as usize, 0);
    file.read_exact(&mut head[8..])
        .map_err(|e| format!("cannot read the header: {e}"))?;
    Ok(head)
}

/// Makes a rename in `path`'s directory durable (not every file system supports it, hence no
/// error).
fn sync_parent(path: &Path) {
    if let Some(parent) = path.parent()
        && let Ok(dir) = File::open(parent)
    {
        let _ = dir.sync_all();
    }
}

/// Where a tensor's data lies, relative to the data section.
#[derive(Debug, Clone)]
struct Place {
    dtype: String,
    begin: u64,
    end: u64,
}

#[derive(Debug, Clone)]
struct Header {
    data_start: u64,
    tensors: HashMap<String, Place>,
}

/// Parses the safetensors header at the start of `bytes`.
fn parse_header(bytes: &[u8]) -> std::result::Result<Header, String> {
    let first: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("shorter than a safetensors header")?;
    let len = u64::from_le_bytes(first);
    if len > 100 << 20 {
        return Err(format!("a header of {len} bytes is not plausible"));
    }
    let json = bytes
        .get(8..8 + len as usize)
        .ok_or_else(|| format!("the header claims {len} bytes but the file is shorter"))?;
    let value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| format!("the header is not JSON: {e}"))?;
    let object = value.as_object().ok_or("the header is not a JSON object")?;
    let mut tensors = HashMap::new();
    for (name, entry) in object {
        if name == "__metadata__" {
            continue;
        }
        let offsets = entry["data_offsets"]
            .as_array()
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .filter(|(a, b)| a <= b)
            .ok_or_else(|| format!("tensor {name} has no valid data_offsets"))?;
        tensors.insert(
            name.clone(),
            Place {
                dtype: entry["dtype"].as_str().unwrap_or_default().to_string(),
                begin: offsets.0,
                end: offsets.1,
            },
        );
    }
    Ok(Header {
        data_start: 8 + len,
        tensors,
    })
}

/// A rank file opened for range reads.
pub(crate) struct FileReader {
    path: PathBuf,
    manifest: FileManifest,
    header: Header,
}

impl FileReader {
    /// Opens the file: checks its length and its header's checksum against the manifest.
    pub(crate) fn open(dir: &Path, manifest: &FileManifest) -> Result<Self> {
        let path = file_in(dir, &manifest.file, &dir.join("manifest.json"))?;
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.clone(),
            reason,
        };
        let mut file = File::open(&path).map_err(|e| {
            corrupt(match e.kind() {
                std::io::ErrorKind::NotFound => "missing file: the manifest lists it".into(),
                _ => format!("the file cannot be read: {e}"),
            })
        })?;
        let meta = file
            .metadata()
            .map_err(|e| corrupt(format!("cannot stat: {e}")))?;
        if !meta.is_file() {
            return Err(corrupt(
                "a directory (or another non-file) stands where the manifest lists a file".into(),
            ));
        }
        let len = meta.len();
        if len != manifest.bytes {
            return Err(corrupt(format!(
                "the file has {len} bytes but the manifest records {}: truncated or overwritten",
                manifest.bytes
            )));
        }
        let head = read_header(&mut file).map_err(&corrupt)?;
        let sum = checksum(&head);
        if sum != manifest.header_crc32 {
            return Err(corrupt(format!(
                "header checksum {sum} differs from the manifest's {}: the file is corrupt; \
                 resume from an earlier checkpoint",
                manifest.header_crc32
            )));
        }
        let header = parse_header(&head).map_err(corrupt)?;
        Ok(Self {
            path,
            manifest: manifest.clone(),
            header,
        })
    }

    /// Bytes of the header (read by `open`).
    pub(crate) fn header_bytes(&self) -> u64 {
        self.header.data_start
    }

    /// Checks that the file holds tensor `name` of `dtype` with `numel` elements, and that the
    /// manifest has its chunk checksums.
    pub(crate) fn check_tensor(&self, name: &str, dtype: &str, numel: usize) -> Result<()> {
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: self.path.clone(),
            reason: format!("tensor {name}: {reason}"),
        };
        let place = self
            .header
            .tensors
            .get(name)
            .ok_or_else(|| corrupt("listed in the manifest but not in the file".into()))?;
        let size = dtype_from_name(dtype).map_err(&corrupt)?.size() as u64;
        if place.dtype != dtype || place.end - place.begin != numel as u64 * size {
            return Err(corrupt(format!(
                "the file holds {} bytes of {}, the manifest {numel} elements of {dtype}",
                place.end - place.begin,
                place.dtype
            )));
        }
        let chunk = self.manifest.chunk_bytes.max(1);
        let sums = self.manifest.chunks.get(name).map_or(0, Vec::len) as u64;
        if self.manifest.chunk_bytes == 0
            || sums != (place.end - place.begin).div_ceil(chunk)
            || self.header.data_start + place.end > self.manifest.bytes
        {
            return Err(corrupt(
                "the manifest's chunk checksums do not fit it".into(),
            ));
        }
        Ok(())
    }

    /// Reads byte ranges `(offset, len)` of tensor `name` (in increasing offset order), checking
    /// every chunk they touch, and hands each range's bytes to `sink(index, offset, bytes)`, one
    /// chunk's part at a time (`offset`: where `bytes` start within the range). `identity` is
    /// what the chunk checksums are bound to ([`chunk_checksum`]). Returns the bytes read from
    /// disk.
    pub(crate) fn read_ranges(
        &self,
        name: &str,
        identity: &str,
        ranges: impl Iterator<Item = (usize, usize)>,
        mut sink: impl FnMut(usize, usize, &[u8]),
    ) -> Result<u64> {
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: self.path.clone(),
            reason: format!("tensor {name}: {reason}"),
        };
        let place = self
            .header
            .tensors
            .get(name)
            .ok_or_else(|| corrupt("not in the file".into()))?;
        let len = (place.end - place.begin) as usize;
        let chunk = self.manifest.chunk_bytes as usize;
        let sums = &self.manifest.chunks[name];
        let mut file = File::open(&self.path).map_err(|e| CheckpointError::io(&self.path, e))?;
        // The chunk in hand: its index and bytes.
        let mut held: Option<(usize, Vec<u8>)> = None;
        let mut read = 0u64;
        for (k, (offset, n)) in ranges.enumerate() {
            if offset + n > len {
                return Err(corrupt(format!(
                    "bytes {offset}..{} asked of {len}",
                    offset + n
                )));
            }
            let mut at = offset;
            while at < offset + n {
                let c = at / chunk;
                if held.as_ref().is_none_or(|(h, _)| *h != c) {
                    let (start, end) = (c * chunk, ((c + 1) * chunk).min(len));
                    let mut buf = vec![0u8; end - start];
                    file.seek(SeekFrom::Start(
                        self.header.data_start + place.begin + start as u64,
                    ))
                    .and_then(|_| file.read_exact(&mut buf))
                    .map_err(|e| CheckpointError::io(&self.path, e))?;
                    read += buf.len() as u64;
                    let sum = chunk_checksum(identity, &buf);
                    if sum != sums[c] {
                        return Err(corrupt(format!(
                            "checksum {sum} of bytes {start}..{end} differs from the \
                             manifest's {}: the file is corrupt, or the manifest places this \
                             piece in another tensor or region than the one it was saved as; \
                             resume from an earlier checkpoint",
                            sums[c]
                        )));
                    }
                    held = Some((c, buf));
                }
                let (_, buf) = held.as_ref().expect("a chunk is held");
                let start = c * chunk;
                let stop = (offset + n).min(start + buf.len());
                // Handed over chunk by chunk: no copy of the whole range is ever held.
                sink(k, at - offset, &buf[at - start..stop - start]);
                at = stop;
            }
        }
        Ok(read)
    }
}
