//! Loading a sharded checkpoint reads only the byte ranges a rank needs: measured with the
//! counting allocator (peak memory of a rank's whole load, far below the checkpoint: 2.37 MB of
//! an 8.4 MB checkpoint for a rank of 4 that needs 2.10 MB; 10.5 MB when every file was read
//! whole) and with the reader's count of bytes read from disk; every byte read is still checked against the
//! manifest's per-chunk checksums, and corruption is a typed error.
//!
//! The only test of this binary (the allocator counts the whole process). Reading needs no
//! collective, so each rank's load of a run with `M` ranks is replayed in turn on the main
//! thread, which makes its peak cleanly attributable.

use std::collections::BTreeMap;

use burn::nn::LinearConfig;
use burn::tensor::{Device, TensorData};
use burn_parallel::run_local;
use burn_zero::checkpoint::{self, CHUNK_BYTES, CheckpointReader, UnitShard};
use burn_zero::flat::{FlatLayout, shard_range};
use burn_zero::memory::CountingAllocator;
use burn_zero::{ShardGroups, ZeroError};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

const SAVED_RANKS: usize = 4;

fn param(i: usize) -> f32 {
    (i as f32 * 0.001).sin()
}

fn moment(i: usize) -> f32 {
    (i as f32 * 0.003).cos()
}

#[test]
fn a_load_reads_only_this_ranks_ranges() {
    let dir = std::env::temp_dir().join(format!("burn-zero-ranges-{}", std::process::id()));
    let layout = FlatLayout::of(&LinearConfig::new(1024, 1024).init(&Device::flex()), |_| {
        true
    });
    let numel = layout.numel();
    run_local(SAVED_RANKS, |group| {
        let range = shard_range(numel, group.rank(), SAVED_RANKS);
        let unit = UnitShard {
            name: "model",
            layout: &layout,
            range: range.clone(),
            params: range.clone().map(param).collect(),
            state: vec![(
                "moment".to_string(),
                TensorData::new(range.clone().map(moment).collect::<Vec<_>>(), [range.len()]),
            )],
            scalars: BTreeMap::new(),
        };
        checkpoint::save(
            &dir,
            &ShardGroups::flat(group),
            1,
            &[unit],
            serde_json::json!({}),
        )
        .map_err(|e| burn_parallel::CollectiveError::InvalidArgument {
            rank: 0,
            op: "save".into(),
            reason: e.to_string(),
        })
    })
    .unwrap();
    let total: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    // Two tensors (parameters and one moment) of `numel` f32 over all files.
    assert!(total > 8 * numel as u64);

    for m in [4usize, 3, 1] {
        for r in 0..m {
            let range = shard_range(numel, r, m);
            let start = ALLOC.reset_peak();
            let reader = CheckpointReader::open(&dir).unwrap();
            let params = reader.read("model", "param", range.clone()).unwrap();
            let state = reader.state("model", range.clone()).unwrap();
            let peak = ALLOC.peak() - start;
            let read = reader.bytes_read() as usize;
            let expected: Vec<f32> = range.clone().map(param).collect();
            assert_eq!(params, expected, "M={m} rank {r}: parameters");
            let moments = state[0].1.as_slice::<f32>().unwrap();
            assert!(
                moments
                    .iter()
                    .zip(range.clone())
                    .all(|(v, i)| *v == moment(i))
            );
            // What the rank must hold anyway: its two ranges of f32.
            let needed = 8 * range.len();
            println!(
                "M={m} rank {r}: needs {needed} bytes, peak {peak} bytes during the load ({:.1}% \
                 of the {total}-byte checkpoint)",
                100.0 * peak as f64 / total as f64
            );
            // Bytes read from disk: the two ranges, rounded out to whole checksum chunks in each
            // saved shard they overlap (at most two partial chunks per piece), plus the
            // manifest and headers (a few KiB).
            let overlaps = (0..SAVED_RANKS)
                .filter(|&k| {
                    let s = shard_range(numel, k, SAVED_RANKS);
                    s.start < range.end && range.start < s.end
                })
                .count();
            assert!(read >= needed, "M={m} rank {r}: read {read} bytes");
            assert!(
                read <= needed + overlaps * 2 * 2 * CHUNK_BYTES + (64 << 10),
                "M={m} rank {r}: read {read} bytes for {needed} needed"
            );
            // The load's peak: the two ranges it returns, the per-file headers and manifest,
            // and a few checksum chunks of staging; far from the checkpoint (or even one file)
            // when M > 1.
            if m > 1 {
                assert!(
                    2 * peak < total as usize,
                    "M={m} rank {r}: peak {peak} bytes, the checkpoint has {total}"
                );
            }
            assert!(
                peak < needed + needed / 4 + (1 << 20),
                "M={m} rank {r}: peak {peak} bytes for {needed} needed ({total} in the checkpoint)"
            );
        }
    }

    // One corrupt byte at the end of file 2: the reads that cover it fail with a typed error
    // naming the checksum; reads that do not touch it still load.
    let file = dir.join(format!("rank-00002-of-{SAVED_RANKS:05}.safetensors"));
    let mut bytes = std::fs::read(&file).unwrap();
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let reader = CheckpointReader::open(&dir).unwrap();
    let rank0 = shard_range(numel, 0, SAVED_RANKS);
    assert!(reader.read("model", "param", rank0.clone()).is_ok());
    assert!(reader.state("model", rank0).is_ok());
    let all = 0..numel;
    let err = match (
        reader.read("model", "param", all.clone()),
        reader.state("model", all),
    ) {
        (Err(e), _) | (_, Err(e)) => e,
        (Ok(_), Ok(_)) => panic!("a corrupt byte must not load"),
    };
    assert!(matches!(err, ZeroError::CorruptCheckpoint { .. }), "{err}");
    assert!(err.to_string().contains("checksum"), "{err}");
    // A truncated file is refused at open.
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let err = CheckpointReader::open(&dir).err().expect("truncated");
    assert!(err.to_string().contains("truncated"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
