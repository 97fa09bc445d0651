//! Hugging Face checkpoint directories: the safetensors files `save_pretrained` writes
//! (`model.safetensors`, or the shards `model.safetensors.index.json` lists), read into
//! tensors by name, which are a [`TensorSource`](super::TensorSource): map the names onto a
//! model's ([`super::ParamMap::with_logical_names`]) and load them under any layout
//! ([`super::ParamMap::load_params`]).
//!
//! A model's own layout (GPT-2's, LLaMA's names) is a table it supplies, torchtitan's state-dict
//! adapter: an [`Adapter`] of [`Entry`]s, one per checkpoint tensor, each a parameter as it is,
//! transposed, or several fused along the last axis ([`Source`]). The adapter does the rest:
//! [`Adapter::from_hf`] checks a checkpoint against the table (shapes, float dtypes, a prefix
//! stored twice, tied aliases, every missing and unexpected tensor) and maps it onto the
//! parameters; [`Adapter::to_hf`] writes the parameters in the layout.
//!
//! ```
//! use std::collections::BTreeMap;
//! use burn::tensor::{DType, TensorData};
//! use burn_parallel::checkpoint::hf;
//!
//! let dir = std::env::temp_dir().join(format!("hf-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let tensors = BTreeMap::from([
//!     ("wte.weight".to_string(), TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])),
//! ]);
//! hf::write_safetensors(&dir.join(hf::WEIGHTS_FILE), &tensors).unwrap();
//! let read = hf::read_dir(&dir).unwrap();
//! assert_eq!(read["wte.weight"].dtype(), DType::F32);
//! assert_eq!(read["wte.weight"].try_to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use burn::tensor::{DType, TensorData};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::{CheckpointError, Result};

mod adapter;
pub use adapter::{Adapter, Entry, Source};

/// The weights of an unsharded checkpoint.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint (`weight_map`: tensor name to shard file).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Reads every tensor of one safetensors file in its dtype (F32, F64, F16 or BF16).
///
/// # Errors
/// [`CheckpointError::Io`] when the file cannot be read; [`CheckpointError::Corrupt`] when it
/// is not a safetensors file; [`CheckpointError::Dtype`] naming a tensor of another dtype
/// (integers, fp8): a model's parameters are floats.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, TensorData>> {
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.into(),
        source,
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Corrupt {
        path: path.into(),
        reason: format!("not a safetensors file: {e}"),
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in file.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(CheckpointError::Dtype {
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let data = TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype);
        out.insert(name.to_string(), data);
    }
    Ok(out)
}

/// Reads the tensors of a checkpoint directory: [`WEIGHTS_FILE`], or every shard that
/// [`INDEX_FILE`] lists.
///
/// # Errors
/// Those of [`read_safetensors`]; [`CheckpointError::Corrupt`] for a malformed index or a
/// tensor stored in two shards.
pub fn read_dir(dir: &Path) -> Result<BTreeMap<String, TensorData>> {
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return read_safetensors(&dir.join(WEIGHTS_FILE));
    }
    let corrupt = |reason: String| CheckpointError::Corrupt {
        path: index.clone(),
        reason,
    };
    let text = std::fs::read_to_string(&index).map_err(|source| CheckpointError::Io {
        path: index.clone(),
        source,
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| corrupt(format!("not JSON: {e}")))?;
    let files: BTreeSet<&str> = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| corrupt("no `weight_map` object".into()))?
        .values()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| corrupt(format!("weight_map value {v} is not a file name")))
        })
        .collect::<Result<_>>()?;
    let mut out = BTreeMap::new();
    for file in files {
        for (name, t) in read_safetensors(&super::store::file_in(dir, file, &index)?)? {
            if out.insert(name.clone(), t).is_some() {
                return Err(corrupt(format!(
                    "tensor `{name}` is stored in two shards; the checkpoint is inconsistent"
                )));
            }
        }
    }
    Ok(out)
}

/// Writes `tensors` as one safetensors file, each in its dtype (F32, F64, F16 or BF16),
/// through a temporary file and a rename (a reader never sees half a file).
///
/// # Errors
/// [`CheckpointError::Io`]; [`CheckpointError::Piece`] naming a tensor of another dtype or
/// whose bytes do not match its shape.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, TensorData>) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let dtype = match t.dtype() {
                DType::F32 => Dtype::F32,
                DType::F64 => Dtype::F64,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                other => {
                    return Err(CheckpointError::piece(
                        name,
                        format!("dtype {other:?}: only F32, F64, F16 and BF16 are written"),
                    ));
                }
            };
            TensorView::new(dtype, t.shape().to_vec(), t.as_bytes())
                .map(|view| (name.as_str(), view))
                .map_err(|e| CheckpointError::piece(name, e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| CheckpointError::piece("safetensors header", e.to_string()))?;
    let tmp = path.with_extension("safetensors.tmp");
    let io = |source| CheckpointError::Io {
        path: path.into(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn shards_are_read_through_the_index_and_dtypes_kept() {
        let dir = temp("shards");
        let a = TensorData::new(vec![1.0f32, -2.0], [2]);
        let b = TensorData::new(vec![0.5f32, 4.0, 8.0], [3]).convert_dtype(DType::BF16);
        let one = BTreeMap::from([("a".to_string(), a.clone())]);
        let two = BTreeMap::from([("b".to_string(), b.clone())]);
        write_safetensors(&dir.join("one.safetensors"), &one).unwrap();
        write_safetensors(&dir.join("two.safetensors"), &two).unwrap();
        let index =
            serde_json::json!({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
        let read = read_dir(&dir).unwrap();
        assert_eq!(read["a"], a);
        assert_eq!(
            (read["b"].dtype(), read["b"].as_bytes()),
            (DType::BF16, b.as_bytes())
        );
        // The same tensor in two shards is refused.
        write_safetensors(&dir.join("two.safetensors"), &one).unwrap();
        assert!(matches!(
            read_dir(&dir),
            Err(CheckpointError::Corrupt { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A shard named outside the folder (`..`, an absolute path) is refused before it is
    /// opened, naming the index; before, `read_dir` read whatever the index pointed to.
    #[test]
    fn an_index_cannot_point_outside_its_folder() {
        let dir = temp("escape");
        let outside = dir.with_extension("outside.safetensors");
        let a = BTreeMap::from([("a".to_string(), TensorData::new(vec![1.0f32], [1]))]);
        write_safetensors(&outside, &a).unwrap();
        let escape = format!("../{}", outside.file_name().unwrap().to_string_lossy());
        for file in [escape, outside.display().to_string(), String::new()] {
            let index = serde_json::json!({"weight_map": {"a": file}});
            std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
            match read_dir(&dir) {
                Err(CheckpointError::Corrupt { path, reason }) => {
                    assert_eq!(path, dir.join(INDEX_FILE));
                    assert!(reason.contains("not inside"), "{reason}");
                }
                other => panic!(
                    "{file:?}: expected a refusal, got {:?}",
                    other.map(|m| m.len())
                ),
            }
        }
        std::fs::remove_file(&outside).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_are_typed_errors() {
        let dir = temp("bad");
        assert!(matches!(read_dir(&dir), Err(CheckpointError::Io { .. })));
        std::fs::write(dir.join(WEIGHTS_FILE), b"not a safetensors file").unwrap();
        assert!(matches!(
            read_dir(&dir),
            Err(CheckpointError::Corrupt { .. })
        ));
        let ints = vec![0u8; 8];
        let view = TensorView::new(Dtype::I64, vec![1], &ints).unwrap();
        safetensors::serialize_to_file([("ids", view)], None, &dir.join(WEIGHTS_FILE)).unwrap();
        match read_dir(&dir) {
            Err(CheckpointError::Dtype { tensor, dtype }) => {
                assert_eq!((&*tensor, &*dtype), ("ids", "I64"))
            }
            other => panic!("{:?}", other.map(|t| t.len())),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
