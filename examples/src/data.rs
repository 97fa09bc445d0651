//! The bundled data sets and deterministic batching.
//!
//! - [`Corpus`]: the King James Bible as byte-level tokens (vocabulary 256) for the GPT,
//!   `data/kjv.txt.gz`.
//! - [`Digits`]: the 8x8 hand-written digits (1,797 images, 10 classes) for the ViT,
//!   `data/digits.csv.gz`.
//!
//! Origins and licences are in `examples/data/README.md`. Batches are pure functions of
//! `(seed, step, row)`: every rank computes the same global batch and may take any slice of its
//! rows ([`Corpus::batch_rows`], [`Batch::rows`]), whatever the number of ranks.

use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use flate2::read::GzDecoder;

use crate::init::splitmix64;

/// Errors while loading the bundled data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file does not exist.
    #[error(
        "data file {path} is missing: give the folder that holds it with `--data-dir DIR` or \
         the environment variable BURN_PARALLEL_DATA_DIR (a binary copied to another machine \
         needs one of them); it ships with the repository under examples/data/ (see \
         examples/data/README.md for how it was produced)"
    )]
    Missing {
        /// The path that was tried.
        path: PathBuf,
    },
    /// Reading or decompressing failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A split of the corpus is shorter than one training window.
    #[error(
        "the corpus's {split:?} split has {bytes} bytes, too short for one window of {window} \
         bytes (--seq-len + 1): use a longer corpus or a shorter --seq-len{hint}",
        hint = if matches!(split, Split::Validation) { " (or eval_batches = 0 in the config)" } else { "" }
    )]
    TooShort {
        /// The split.
        split: Split,
        /// Its length.
        bytes: usize,
        /// The window a row needs.
        window: usize,
    },
    /// The content is not in the expected format.
    #[error("{path}:{line}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 when not line-specific).
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// Reads and gunzips `path`.
///
/// # Errors
///
/// [`DataError::Missing`] if the file does not exist, [`DataError::Io`] if it cannot be read or
/// is not valid gzip.
pub fn read_gz(path: &Path) -> Result<Vec<u8>, DataError> {
    let file = std::fs::File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            DataError::Missing {
                path: path.to_path_buf(),
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let mut bytes = Vec::new();
    GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(bytes)
}

/// The environment variable naming the folder of the data files, for a binary run away from
/// its source tree (`gpt --data-dir` overrides it).
pub const DATA_DIR_ENV: &str = "BURN_PARALLEL_DATA_DIR";

/// The folder of the data files: the one [`DATA_DIR_ENV`] names when it is set (and not
/// empty), else the bundled `examples/data` of the source tree this binary was built from.
pub fn data_dir() -> PathBuf {
    data_dir_from(std::env::var_os(DATA_DIR_ENV))
}

/// [`data_dir`] for a given value of [`DATA_DIR_ENV`].
///
/// ```
/// use std::path::PathBuf;
/// use examples::data::data_dir_from;
///
/// assert_eq!(data_dir_from(Some("/srv/data".into())), PathBuf::from("/srv/data"));
/// assert!(data_dir_from(None).ends_with("examples/data"));
/// assert_eq!(data_dir_from(Some("".into())), data_dir_from(None));
/// ```
pub fn data_dir_from(env: Option<std::ffi::OsString>) -> PathBuf {
    match env {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("data"),
    }
}

/// The file `file` in the folder `dir` (`--data-dir`), or in [`data_dir`] when `None`.
fn in_data_dir(dir: Option<&Path>, file: &str) -> PathBuf {
    dir.map_or_else(data_dir, Path::to_path_buf).join(file)
}

/// Which part of a data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// The first 95 % of the corpus.
    Train,
    /// The last 5 % of the corpus.
    Validation,
}

/// A uniform index in `0..n` for the counter `(key, index)` (multiply-shift, bias < n / 2^64).
fn index_below(key: u64, index: u64, n: usize) -> usize {
    let r = splitmix64(key ^ splitmix64(index));
    ((u128::from(r) * n as u128) >> 64) as usize
}

/// Stream key of `(seed, tag, step)`.
fn step_key(seed: u64, tag: u64, step: u64) -> u64 {
    splitmix64(splitmix64(seed ^ splitmix64(tag)) ^ step)
}

/// A host batch of token windows, row-major `[batch_size, seq_len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Input token ids.
    pub inputs: Vec<i64>,
    /// Next-token targets: `targets[r][t] == inputs[r][t + 1]` within the window.
    pub targets: Vec<i64>,
    /// Number of rows.
    pub batch_size: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

impl Batch {
    /// Uploads the batch: `(inputs, targets)`, both `[batch_size, seq_len]`.
    pub fn to_tensors(&self, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let shape = [self.batch_size, self.seq_len];
        (
            Tensor::from_data(TensorData::new(self.inputs.clone(), shape), device),
            Tensor::from_data(TensorData::new(self.targets.clone(), shape), device),
        )
    }

    /// The rows `rows` of the batch (a data-parallel rank's share).
    ///
    /// # Panics
    ///
    /// If `rows` is out of bounds.
    pub fn rows(&self, rows: Range<usize>) -> Batch {
        assert!(
            rows.end <= self.batch_size,
            "rows {rows:?} out of {}",
            self.batch_size
        );
        let span = rows.start * self.seq_len..rows.end * self.seq_len;
        Batch {
            inputs: self.inputs[span.clone()].to_vec(),
            targets: self.targets[span].to_vec(),
            batch_size: rows.len(),
            seq_len: self.seq_len,
        }
    }
}

/// A byte-level text corpus with a train/validation split.
///
/// ```no_run
/// use burn::tensor::Device;
/// use examples::data::{Corpus, Split};
///
/// let corpus = Corpus::load_default()?;
/// let batch = corpus.batch(0, 8, 64, Split::Train);
/// let (inputs, targets) = batch.to_tensors(&Device::flex());
/// assert_eq!(inputs.dims(), [8, 64]);
/// # Ok::<(), examples::data::DataError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Corpus {
    bytes: Vec<u8>,
    n_train: usize,
    seed: u64,
    /// What the bytes are, for logs ([`Corpus::name`]).
    name: String,
}

impl Corpus {
    /// Fraction of the corpus (its end) kept for validation.
    pub const VALIDATION_FRACTION: f64 = 0.05;
    /// Vocabulary size of byte-level tokens.
    pub const VOCAB_SIZE: usize = 256;

    /// File name of the King James Bible in a data folder.
    pub const FILE: &str = "kjv.txt.gz";

    /// Loads the King James Bible from the folder `dir` (`--data-dir`), or from [`data_dir`]
    /// (bundled: `examples/data/kjv.txt.gz`) when `None`.
    ///
    /// # Errors
    ///
    /// [`DataError`] if the file is missing (naming `--data-dir` and [`DATA_DIR_ENV`]),
    /// unreadable or empty.
    pub fn load_from(dir: Option<&Path>) -> Result<Self, DataError> {
        Self::load(&in_data_dir(dir, Self::FILE))
    }

    /// Loads the bundled King James Bible (about 4.4 MB of text): `load_from(None)`.
    ///
    /// # Errors
    ///
    /// As [`Self::load_from`].
    pub fn load_default() -> Result<Self, DataError> {
        Self::load_from(None)
    }

    /// Loads a gzip-compressed text file.
    ///
    /// # Errors
    ///
    /// [`DataError`] if the file is missing, unreadable or empty.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let bytes = read_gz(path)?;
        if bytes.len() < 2 {
            return Err(DataError::Format {
                path: path.to_path_buf(),
                line: 0,
                message: "corpus is empty".into(),
            });
        }
        let name = match path == data_dir_from(None).join(Self::FILE) {
            true => "the bundled King James Bible".to_string(),
            false => path.display().to_string(),
        };
        Ok(Self {
            name,
            ..Self::from_bytes(bytes)
        })
    }

    /// A corpus of `bytes`, the last 5 % being the validation split; batch seed 0.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let n_val = (bytes.len() as f64 * Self::VALIDATION_FRACTION).ceil() as usize;
        let n_train = bytes.len() - n_val.min(bytes.len());
        Self {
            bytes,
            n_train,
            seed: 0,
            name: "a corpus given as bytes".into(),
        }
    }

    /// What the corpus is, for logs: the bundled King James Bible, or the file it was read
    /// from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same corpus with another batch-sampling seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Total number of bytes (tokens).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the corpus is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes of a split.
    pub fn split(&self, split: Split) -> &[u8] {
        match split {
            Split::Train => &self.bytes[..self.n_train],
            Split::Validation => &self.bytes[self.n_train..],
        }
    }

    /// Checks that the training split, and the validation split when `eval_batches` is not 0,
    /// each hold a window of `seq_len + 1` bytes: a run checks it before its first step rather
    /// than failing in a rank's batch (or, for the validation split, after training).
    ///
    /// # Errors
    /// [`DataError::TooShort`] naming the split, its bytes and the window.
    ///
    /// # Example
    /// ```
    /// use examples::data::Corpus;
    ///
    /// let corpus = Corpus::from_bytes(vec![b'a'; 1000]); // 950 training bytes, 50 validation
    /// assert!(corpus.check_windows(32, 8).is_ok());
    /// assert!(corpus.check_windows(64, 8).is_err()); // validation has no window of 65 bytes
    /// assert!(corpus.check_windows(64, 0).is_ok());
    /// ```
    pub fn check_windows(&self, seq_len: usize, eval_batches: usize) -> Result<(), DataError> {
        let mut splits = vec![Split::Train];
        if eval_batches > 0 {
            splits.push(Split::Validation);
        }
        for split in splits {
            let bytes = self.split(split).len();
            if bytes <= seq_len {
                return Err(DataError::TooShort {
                    split,
                    bytes,
                    window: seq_len + 1,
                });
            }
        }
        Ok(())
    }

    /// Start (within the split) of row `row` of the batch of `step`: uniform over the
    /// `len - seq_len` windows of `seq_len + 1` bytes, a pure function of
    /// `(seed, split, step, row, seq_len)`.
    ///
    /// # Panics
    ///
    /// If the split has no window of `seq_len + 1` bytes.
    pub fn window_start(&self, step: u64, row: usize, seq_len: usize, split: Split) -> usize {
        let len = self.split(split).len();
        assert!(
            len > seq_len,
            "{split:?} split has {len} bytes, too short for windows of {} bytes",
            seq_len + 1
        );
        let tag = match split {
            Split::Train => 1,
            Split::Validation => 2,
        };
        index_below(step_key(self.seed, tag, step), row as u64, len - seq_len)
    }

    /// Rows `rows` of the global batch of `step`: the same rows whatever range they are asked
    /// in, so ranks that slice a global batch agree with a single device.
    ///
    /// # Panics
    ///
    /// As [`Corpus::window_start`].
    pub fn batch_rows(&self, step: u64, rows: Range<usize>, seq_len: usize, split: Split) -> Batch {
        let data = self.split(split);
        let mut inputs = Vec::with_capacity(rows.len() * seq_len);
        let mut targets = Vec::with_capacity(rows.len() * seq_len);
        for row in rows.clone() {
            let start = self.window_start(step, row, seq_len, split);
            let window = &data[start..start + seq_len + 1];
            inputs.extend(window[..seq_len].iter().map(|&b| i64::from(b)));
            targets.extend(window[1..].iter().map(|&b| i64::from(b)));
        }
        Batch {
            inputs,
            targets,
            batch_size: rows.len(),
            seq_len,
        }
    }

    /// The global batch of `step`: `batch_size` random windows of `seq_len + 1` bytes, inputs
    /// the first `seq_len`, targets the last `seq_len`.
    ///
    /// # Arguments
    ///
    /// - `step`: the training step (any `u64`; validation uses its own stream).
    /// - `batch_size`: rows of the global batch.
    /// - `seq_len`: tokens per row.
    /// - `split`: train or validation.
    ///
    /// # Panics
    ///
    /// As [`Corpus::window_start`].
    pub fn batch(&self, step: u64, batch_size: usize, seq_len: usize, split: Split) -> Batch {
        self.batch_rows(step, 0..batch_size, seq_len, split)
    }

    /// Entropy (nats per byte) of the byte frequencies of the training split: the loss of the
    /// best model that ignores context, a yardstick for training curves (ln 256 = 5.55 is the
    /// uniform model).
    pub fn unigram_entropy_nats(&self) -> f64 {
        let data = self.split(Split::Train);
        let mut counts = [0u64; 256];
        for &b in data {
            counts[usize::from(b)] += 1;
        }
        let n = data.len() as f64;
        counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }
}

/// A host batch of digit images.
#[derive(Clone, Debug, PartialEq)]
pub struct DigitsBatch {
    /// Pixels in `[0, 1]`, row-major `[batch_size, 1, 8, 8]`.
    pub images: Vec<f32>,
    /// Class ids `0..10`.
    pub labels: Vec<i64>,
}

impl DigitsBatch {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Uploads the batch: images `[batch, 1, 8, 8]` and labels `[batch]`.
    pub fn to_tensors(&self, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
        let side = Digits::SIDE;
        let n = self.len();
        (
            Tensor::from_data(
                TensorData::new(self.images.clone(), [n, 1, side, side]),
                device,
            ),
            Tensor::from_data(TensorData::new(self.labels.clone(), [n]), device),
        )
    }
}

/// The 8x8 hand-written digits (UCI ML, as shipped by scikit-learn).
///
/// ```no_run
/// use examples::data::Digits;
///
/// let digits = Digits::load_default()?;
/// let (train, test) = digits.split(0.2, 0);
/// assert_eq!(train.len() + test.len(), 1797);
/// # Ok::<(), examples::data::DataError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Digits {
    /// Pixels divided by 16, so in `[0, 1]`; `len() * 64` values, image-major.
    pub images: Vec<f32>,
    /// Class ids `0..10`.
    pub labels: Vec<u8>,
}

impl Digits {
    /// Side of an image in pixels.
    pub const SIDE: usize = 8;
    /// Pixels per image.
    pub const PIXELS: usize = 64;
    /// Number of classes.
    pub const N_CLASSES: usize = 10;

    /// File name of the digits in a data folder.
    pub const FILE: &str = "digits.csv.gz";

    /// Loads the digits from the folder `dir` (`--data-dir`), or from [`data_dir`] (bundled:
    /// `examples/data/digits.csv.gz`) when `None`.
    ///
    /// # Errors
    ///
    /// [`DataError`] if the file is missing (naming `--data-dir` and [`DATA_DIR_ENV`]),
    /// unreadable or malformed.
    pub fn load_from(dir: Option<&Path>) -> Result<Self, DataError> {
        Self::load(&in_data_dir(dir, Self::FILE))
    }

    /// Loads the bundled digits (1,797 images): `load_from(None)`.
    ///
    /// # Errors
    ///
    /// As [`Self::load_from`].
    pub fn load_default() -> Result<Self, DataError> {
        Self::load_from(None)
    }

    /// Loads a gzip-compressed CSV with 64 pixel values in `0..=16` and a label in `0..10` per
    /// line.
    ///
    /// # Errors
    ///
    /// [`DataError`] if the file is missing, unreadable or malformed.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let bytes = read_gz(path)?;
        let format = |line: usize, message: String| DataError::Format {
            path: path.to_path_buf(),
            line,
            message,
        };
        let text = String::from_utf8(bytes).map_err(|e| format(0, e.to_string()))?;
        let mut images = Vec::new();
        let mut labels = Vec::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let fields: Vec<&str> = line.trim().split(',').collect();
            if fields.len() != Self::PIXELS + 1 {
                return Err(format(
                    i + 1,
                    format!("expected 65 fields, got {}", fields.len()),
                ));
            }
            for field in &fields[..Self::PIXELS] {
                let v: f32 = field
                    .trim()
                    .parse()
                    .map_err(|e| format(i + 1, format!("pixel {field:?}: {e}")))?;
                if !(0.0..=16.0).contains(&v) {
                    return Err(format(i + 1, format!("pixel {v} outside 0..=16")));
                }
                images.push(v / 16.0);
            }
            let label = fields[Self::PIXELS].trim();
            let label: u8 = label
                .parse::<f32>()
                .ok()
                .filter(|l| l.fract() == 0.0 && (0.0..10.0).contains(l))
                .map(|l| l as u8)
                .ok_or_else(|| format(i + 1, format!("label {label:?} is not in 0..10")))?;
            labels.push(label);
        }
        Ok(Self { images, labels })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The images at `indices`, in that order.
    ///
    /// # Panics
    ///
    /// If an index is out of bounds.
    pub fn select(&self, indices: &[usize]) -> DigitsBatch {
        let mut images = Vec::with_capacity(indices.len() * Self::PIXELS);
        for &i in indices {
            images.extend_from_slice(&self.images[i * Self::PIXELS..(i + 1) * Self::PIXELS]);
        }
        DigitsBatch {
            images,
            labels: indices.iter().map(|&i| i64::from(self.labels[i])).collect(),
        }
    }

    /// Deterministic train/test split: a permutation keyed by `seed`, the first
    /// `round(len * test_fraction)` images of which form the test set; both keep file order.
    ///
    /// # Returns
    ///
    /// `(train, test)`.
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Digits, Digits) {
        let mut order: Vec<usize> = (0..self.len()).collect();
        let key = splitmix64(seed ^ 0xD161_7500);
        order.sort_by_key(|&i| (splitmix64(key ^ splitmix64(i as u64)), i));
        let n_test = ((self.len() as f64 * test_fraction).round() as usize).min(self.len());
        let (mut test, mut train) = (order[..n_test].to_vec(), order[n_test..].to_vec());
        test.sort_unstable();
        train.sort_unstable();
        let part = |idx: &[usize]| {
            let b = self.select(idx);
            Digits {
                images: b.images,
                labels: b.labels.iter().map(|&l| l as u8).collect(),
            }
        };
        (part(&train), part(&test))
    }

    /// The global batch of `step`: `batch_size` images drawn uniformly (with replacement), a
    /// pure function of `(seed, step, row)`.
    ///
    /// # Panics
    ///
    /// If the set is empty.
    pub fn batch(&self, step: u64, batch_size: usize, seed: u64) -> DigitsBatch {
        assert!(!self.is_empty(), "cannot draw a batch from an empty set");
        let key = step_key(seed, 3, step);
        let indices: Vec<usize> = (0..batch_size)
            .map(|row| index_below(key, row as u64, self.len()))
            .collect();
        self.select(&indices)
    }
}
