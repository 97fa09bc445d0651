//! The files of the golden trajectories (`tests/golden/`, written by `scripts/golden.py`, an
//! independent PyTorch implementation): batches in, initial and final weights, and the
//! recorded run. Used by `tests/golden.rs` (the GPT) and `tests/byo_parity.rs` (the
//! bring-your-own-model decoder).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde_json::Value;

/// `tests/golden/`.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// `tests/golden/<name>/`.
pub fn dir(name: &str) -> PathBuf {
    root().join(name)
}

fn or_panic<T, E: std::fmt::Display>(result: Result<T, E>, path: &Path) -> T {
    result.unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate the golden files: see tests/golden.rs's header)",
            path.display()
        )
    })
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Token batches of a whole run: `inputs` and `targets`, row-major `[steps, batch, seq]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batches {
    /// `[steps, batch, seq]`.
    pub shape: [usize; 3],
    /// Input token ids.
    pub inputs: Vec<i64>,
    /// Target token ids.
    pub targets: Vec<i64>,
}

impl Batches {
    /// Writes `path` (int64 safetensors `inputs`, `targets`), creating its directory.
    ///
    /// # Panics
    /// When the file cannot be written.
    pub fn write(&self, path: &Path) {
        let (inputs, targets) = (i64_bytes(&self.inputs), i64_bytes(&self.targets));
        let views = [("inputs", &inputs), ("targets", &targets)].map(|(name, bytes)| {
            let view = TensorView::new(Dtype::I64, self.shape.to_vec(), bytes);
            (name, view.expect("a tensor view of the batch"))
        });
        let parent = path.parent().expect("a file in a directory");
        or_panic(std::fs::create_dir_all(parent), parent);
        or_panic(safetensors::serialize_to_file(views, None, path), path);
    }

    /// Asserts that `path` holds these batches: else the golden losses are of other data (the
    /// loader changed) and the golden files must be regenerated.
    ///
    /// # Panics
    /// With the file and the tensor that differs.
    pub fn assert_committed_at(&self, path: &Path) {
        let bytes = or_panic(std::fs::read(path), path);
        let file = or_panic(SafeTensors::deserialize(&bytes), path);
        for (name, ours) in [("inputs", &self.inputs), ("targets", &self.targets)] {
            let view = or_panic(file.tensor(name), path);
            assert_eq!(
                (view.dtype(), view.shape()),
                (Dtype::I64, &self.shape[..]),
                "{}: {name}",
                path.display()
            );
            assert!(
                view.data() == i64_bytes(ours).as_slice(),
                "{}: the committed {name} are not the batches the test draws now; regenerate \
                 the golden files (see tests/golden.rs's header)",
                path.display()
            );
        }
    }
}

/// What `scripts/golden.py` recorded (`trajectory.json`).
pub struct Trajectory {
    json: Value,
    path: PathBuf,
}

impl Trajectory {
    /// Reads `tests/golden/<name>/trajectory.json`.
    ///
    /// # Panics
    /// When the file is missing or not JSON.
    pub fn load(name: &str) -> Self {
        let path = dir(name).join("trajectory.json");
        let text = or_panic(std::fs::read_to_string(&path), &path);
        let json = or_panic(serde_json::from_str(&text), &path);
        Self { json, path }
    }

    /// A number of the record.
    ///
    /// # Panics
    /// When `key` is not a number.
    pub fn f64(&self, key: &str) -> f64 {
        self.json[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{}: {key} is not a number", self.path.display()))
    }

    /// A count of the record.
    ///
    /// # Panics
    /// When `key` is not a non-negative integer.
    pub fn usize(&self, key: &str) -> usize {
        self.json[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{}: {key} is not an integer", self.path.display()))
            as usize
    }

    /// A list of numbers of the record (`losses`, `lrs`, `betas`, ...).
    ///
    /// # Panics
    /// When `key` is not an array of numbers.
    pub fn f64s(&self, key: &str) -> Vec<f64> {
        let values = self.json[key].as_array();
        let values =
            values.unwrap_or_else(|| panic!("{}: {key} is not an array", self.path.display()));
        values
            .iter()
            .map(|v| v.as_f64().expect("a number"))
            .collect()
    }

    /// The per-step losses of the PyTorch run.
    pub fn losses(&self) -> Vec<f64> {
        self.f64s("losses")
    }

    /// Asserts that the AdamW settings our trainers do not take as parameters (betas, epsilon:
    /// Burn's `AdamWConfig` defaults) are the recorded ones.
    ///
    /// # Panics
    /// When they differ.
    pub fn assert_burn_adamw(&self) {
        assert_eq!(
            (self.f64s("betas"), self.f64("eps")),
            (vec![0.9, 0.999], 1e-5),
            "{}: the golden run's AdamW betas and epsilon are not Burn's defaults",
            self.path.display()
        );
    }
}

/// Reads the float tensors of `tests/golden/<name>/<file>` by name.
///
/// # Panics
/// When the file is missing or not safetensors of floats.
pub fn tensors(name: &str, file: &str) -> BTreeMap<String, TensorData> {
    let path = dir(name).join(file);
    or_panic(
        burn_parallel::checkpoint::hf::read_safetensors(&path),
        &path,
    )
}

/// Float tensors by name as `f32` shapes and values.
pub fn params(tensors: impl IntoIterator<Item = (String, TensorData)>) -> crate::Params {
    let values = |t: TensorData| t.try_into_vec_as::<f32>().expect("float tensors");
    let tensors = tensors.into_iter();
    tensors
        .map(|(k, t)| (k, (t.shape().to_vec(), values(t))))
        .collect()
}

/// Prints how far `ours` is from the golden `golden` losses: the worst relative difference and
/// its step.
pub fn report_losses(what: &str, ours: &[f64], golden: &[f64]) {
    let (step, worst) = ours
        .iter()
        .zip(golden)
        .map(|(a, b)| ((a - b) / b).abs())
        .enumerate()
        .fold(
            (0, 0.0),
            |best, (i, d)| if d > best.1 { (i, d) } else { best },
        );
    println!(
        "{what}: {}-step losses within {worst:.2e} of PyTorch's (worst at step {step}: {:.7} vs \
         {:.7})",
        golden.len(),
        ours[step],
        golden[step],
    );
}
