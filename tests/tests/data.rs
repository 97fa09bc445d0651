//! The bundled data ([`examples::data`]): the King James Bible loads, splits and names itself;
//! its batches are deterministic, shifted by one token and stay inside their split; a missing
//! file is a clear error; the 8x8 digits load, split and batch deterministically.

use burn::tensor::Device;
use examples::data::{Corpus, DATA_DIR_ENV, DataError, Digits, Split};
use std::path::Path;

#[test]
fn corpus_loads_and_splits() {
    let corpus = Corpus::load_default().unwrap();
    assert!(corpus.len() > 4_000_000, "{}", corpus.len());
    let train = corpus.split(Split::Train).len();
    let val = corpus.split(Split::Validation).len();
    assert_eq!(train + val, corpus.len());
    assert!((val as f64 / corpus.len() as f64 - 0.05).abs() < 1e-4);
    assert!(
        corpus
            .split(Split::Train)
            .starts_with(b"Ge1:1 In the beginning")
    );
    let h = corpus.unigram_entropy_nats();
    assert!(h > 2.5 && h < 3.5, "unigram entropy {h}");
}

/// `bytes` gzipped, as the corpus files are.
fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

/// The corpus names itself as what it is (the `gpt` banner said "King James Bible" for
/// any `--data-dir` file).
#[test]
fn a_corpus_is_named_by_its_file() {
    assert_eq!(
        Corpus::load_default().unwrap().name(),
        "the bundled King James Bible"
    );
    let dir = std::env::temp_dir().join(format!("corpus-name-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(Corpus::FILE);
    std::fs::write(&path, gzip(b"Call me Ishmael. Some years ago.")).unwrap();
    let corpus = Corpus::load_from(Some(&dir)).unwrap();
    assert_eq!(corpus.name(), path.display().to_string());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn batches_are_deterministic_and_shifted() {
    let corpus = Corpus::load_default().unwrap();
    for split in [Split::Train, Split::Validation] {
        let a = corpus.batch(3, 6, 32, split);
        assert_eq!(a, corpus.batch(3, 6, 32, split));
        assert_ne!(a, corpus.batch(4, 6, 32, split));
        assert_eq!(a.inputs.len(), 6 * 32);
        for r in 0..6 {
            let row = |v: &[i64]| v[r * 32..(r + 1) * 32].to_vec();
            assert_eq!(row(&a.inputs)[1..], row(&a.targets)[..31]);
        }
        // Any slicing of the global batch gives the same rows.
        assert_eq!(a.rows(2..5), corpus.batch_rows(3, 2..5, 32, split));
        let (x, y) = a.to_tensors(&Device::flex());
        assert_eq!(x.dims(), [6, 32]);
        assert_eq!(y.into_data().try_into_vec_as::<i64>().unwrap(), a.targets);
    }
    let other = corpus.clone().with_seed(1).batch(3, 6, 32, Split::Train);
    assert_ne!(other, corpus.batch(3, 6, 32, Split::Train));
}

#[test]
fn small_corpus_windows_stay_in_split() {
    let corpus = Corpus::from_bytes((0..=255u8).cycle().take(1000).collect());
    assert_eq!(corpus.split(Split::Validation).len(), 50);
    // One window of 50 bytes fits: it must be the whole validation split (bytes 950..1000).
    let expected: Vec<i64> = (950..999).map(|i| i64::from((i % 256) as u8)).collect();
    for step in 0..20 {
        let b = corpus.batch(step, 4, 49, Split::Validation);
        assert_eq!(b.inputs[..49], expected[..]);
    }
    // Training windows never reach into the validation bytes.
    for step in 0..20 {
        for row in 0..8 {
            assert!(corpus.window_start(step, row, 10, Split::Train) + 11 <= 950);
        }
    }
}

#[test]
fn missing_file_is_a_clear_error() {
    let err = Corpus::load(Path::new("/nonexistent/kjv.txt.gz")).unwrap_err();
    assert!(matches!(err, DataError::Missing { .. }));
    let message = err.to_string();
    for what in ["examples/data/README.md", "--data-dir", DATA_DIR_ENV] {
        assert!(message.contains(what), "{message} does not name {what}");
    }
}

#[test]
fn digits_load_and_split() {
    let digits = Digits::load_default().unwrap();
    assert_eq!(digits.len(), 1797);
    assert_eq!(digits.images.len(), 1797 * 64);
    assert!(digits.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
    assert!(digits.labels.iter().all(|&l| l < 10));
    assert_eq!(&digits.labels[..3], &[0, 1, 2]);
    let (train, test) = digits.split(0.2, 0);
    assert_eq!((train.len(), test.len()), (1438, 359));
    assert_eq!(digits.split(0.2, 0), (train.clone(), test));
    let batch = train.batch(5, 7, 0);
    assert_eq!(batch, train.batch(5, 7, 0));
    let (x, y) = batch.to_tensors(&Device::flex());
    assert_eq!(x.dims(), [7, 1, 8, 8]);
    assert_eq!(y.dims(), [7]);
}
