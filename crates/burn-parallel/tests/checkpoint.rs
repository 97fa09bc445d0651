//! Distributed checkpoints: save under one layout, load under others; atomicity, checksums,
//! keep-K and asynchronous saves.

use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use burn_parallel::checkpoint::{
    Checkpoint, CheckpointError, Checkpointer, Manifest, Piece, Region, Segment, even_part,
    merged_scalars, read_state,
};
use burn_parallel::run_local;
use serde_json::{Value, json};

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bp-dcp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The logical tensors of the tests: name, shape, values (distinct for every element).
fn logical() -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
    let t = |name, shape: Vec<usize>, seed: f32| {
        let n: usize = shape.iter().product();
        let values = (0..n).map(|i| seed + i as f32 * 0.5).collect();
        (name, shape, values)
    };
    vec![
        t("wte", vec![10, 6], 0.0),
        t("blocks.0.qkv.weight", vec![6, 18], 1000.0),
        t("blocks.0.proj.weight", vec![6, 6], 2000.0),
        t("ln.bias", vec![6], 3000.0),
    ]
}

/// The elements of `values` (a tensor of `region.shape`) that `region` holds, in its order.
fn take(values: &[f32], region: &Region) -> Vec<f32> {
    region
        .runs()
        .into_iter()
        .flat_map(|r| values[r].to_vec())
        .collect()
}

/// The region rank `(tp, zero)` of a "tp × ZeRO" layout owns: tensor parallel on dimension
/// `dim` (or replicated when `None`), then ZeRO's flat cut of that over `zero_n` ranks.
fn region(
    shape: &[usize],
    dim: Option<usize>,
    (tp, tp_n): (usize, usize),
    (z, z_n): (usize, usize),
) -> Region {
    let full = Region::full(shape);
    let tp_region = match dim {
        Some(d) => full.chunk(d, tp_n, tp).unwrap(),
        None => full,
    };
    tp_region
        .flat_part(even_part(tp_region.numel(), z_n, z))
        .unwrap()
}

/// Which dimension tensor parallelism cuts: columns of qkv, rows of proj, rows of wte, none.
fn tp_dim(name: &str) -> Option<usize> {
    match name {
        "blocks.0.qkv.weight" => Some(1),
        "blocks.0.proj.weight" | "wte" => Some(0),
        _ => None,
    }
}

/// Saves the logical tensors at tp 2 × ZeRO 2 over 4 thread ranks (rank = tp * 2 + z); the
/// replicated bias is saved by its ZeRO cut only.
fn save_tp2_zero2(root: &Path, step: usize, keep: usize) {
    run_local(4, |group| {
        let (tp, z) = (group.rank() / 2, group.rank() % 2);
        let mut pieces = Vec::new();
        for (name, shape, values) in logical() {
            let dim = tp_dim(name);
            if dim.is_none() && tp != 0 {
                continue; // replicated over tp: one copy is enough
            }
            let r = region(&shape, dim, (tp, 2), (z, 2));
            let data = TensorData::new(take(&values, &r), [r.numel()]);
            pieces.push(Piece::new(name, r, data).unwrap());
        }
        let mut saver = Checkpointer::new(root, keep, &group).unwrap();
        saver
            .save(
                step,
                pieces,
                json!({ "lr_step": step }),
                json!({ "data_position": group.rank() * 100 + step }),
            )
            .unwrap();
        Ok(())
    })
    .unwrap();
}

#[test]
fn any_layout_loads_what_another_saved() {
    let root = scratch("layouts");
    save_tp2_zero2(&root, 7, 3);
    let ckpt = Checkpointer::latest(&root).unwrap().expect("complete");
    assert_eq!(ckpt.step(), 7);
    assert_eq!(ckpt.state(), &json!({ "lr_step": 7 }));
    assert_eq!(ckpt.rank_state(3), &json!({ "data_position": 307 }));
    assert_eq!(ckpt.rank_state(9), &Value::Null);
    let shapes: Vec<(&str, Vec<usize>)> =
        logical().iter().map(|(n, s, _)| (*n, s.clone())).collect();
    ckpt.check(shapes.iter().map(|(n, s)| (*n, s.as_slice())))
        .unwrap();
    // 1 device; tp 4 (other cuts of wte rows and qkv columns); ZeRO-3 over 4; tp 3 × ZeRO 2.
    let layouts: Vec<((usize, usize), (usize, usize))> = (0..1)
        .map(|_| ((0, 1), (0, 1)))
        .chain((0..4).map(|t| ((t, 4), (0, 1))))
        .chain((0..4).map(|z| ((0, 1), (z, 4))))
        .chain((0..6).map(|k| ((k / 2, 3), (k % 2, 2))))
        .collect();
    for (name, shape, values) in logical() {
        for &(tp, z) in &layouts {
            let r = region(&shape, tp_dim(name), tp, z);
            let got = ckpt.read(name, &r).unwrap();
            assert_eq!(
                got.try_to_vec::<f32>().unwrap(),
                take(&values, &r),
                "{name} {tp:?} {z:?}"
            );
        }
        let full = ckpt.read_full(name).unwrap();
        assert_eq!(full.shape().as_slice(), shape.as_slice());
        assert_eq!(full.try_to_vec::<f32>().unwrap(), values);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_rank_reads_only_the_chunks_it_needs() {
    let root = scratch("ranges");
    // One large tensor of 4 MB in 4 row pieces; a reader wants a quarter of the columns.
    let shape = [1024usize, 1024];
    run_local(4, |group| {
        let r = Region::full(&shape).chunk(0, 4, group.rank()).unwrap();
        let values: Vec<f32> = (0..r.numel()).map(|i| i as f32).collect();
        let piece = Piece::new("big", r, TensorData::new(values, [256 * 1024])).unwrap();
        Checkpointer::new(&root, 1, &group)
            .unwrap()
            .save(1, vec![piece], Value::Null, Value::Null)
            .unwrap();
        Ok(())
    })
    .unwrap();
    let ckpt = Checkpointer::latest(&root).unwrap().unwrap();
    let before = ckpt.bytes_read();
    // The first quarter of the rows: all in rank 0's file, a quarter of the data.
    let rows = Region::full(&shape).chunk(0, 4, 0).unwrap();
    ckpt.read("big", &rows).unwrap();
    let read = ckpt.bytes_read() - before;
    assert_eq!(read, 1 << 20, "a quarter of 4 MB, chunk-aligned");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn other_dtypes_round_trip() {
    let root = scratch("dtypes");
    let bf16: Vec<half::bf16> = (0..12)
        .map(|i| half::bf16::from_f32(i as f32 / 4.0))
        .collect();
    let steps: Vec<i64> = vec![3, 1 << 40];
    run_local(2, |group| {
        let r = Region::full(&[3, 4]).chunk(1, 2, group.rank()).unwrap();
        let mine: Vec<half::bf16> = r
            .runs()
            .into_iter()
            .flat_map(|x| bf16[x].to_vec())
            .collect();
        let mut pieces = vec![Piece::new("w", r, TensorData::new(mine, [6])).unwrap()];
        if group.rank() == 1 {
            pieces.push(Piece::whole("count", TensorData::new(steps.clone(), [2])).unwrap());
        }
        Checkpointer::new(&root, 1, &group)
            .unwrap()
            .save(2, pieces, Value::Null, Value::Null)
            .unwrap();
        Ok(())
    })
    .unwrap();
    let ckpt = Checkpointer::latest(&root).unwrap().unwrap();
    let w = ckpt.read_full("w").unwrap();
    assert_eq!(w.dtype(), DType::BF16);
    assert_eq!(w.try_to_vec::<half::bf16>().unwrap(), bf16);
    assert_eq!(
        ckpt.read_full("count")
            .unwrap()
            .try_to_vec::<i64>()
            .unwrap(),
        steps
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn corruption_is_named() {
    let root = scratch("corrupt");
    save_tp2_zero2(&root, 1, 1);
    let dir = root.join("step-00000001");
    // A flipped byte in the data of rank 2's file: the read that covers it names file and tensor.
    let file = dir.join("rank-00002-of-00004.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut errors = Vec::new();
    for (name, ..) in logical() {
        if let Err(e) = ckpt.read_full(name) {
            errors.push(e.to_string());
        }
    }
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("rank-00002-of-00004") && errors[0].contains("checksum"),
        "{}",
        errors[0]
    );
    // A truncated file: opening fails and names it.
    bytes.truncate(bytes.len() - 8);
    std::fs::write(&file, &bytes).unwrap();
    let err = Checkpoint::open(&dir).err().expect("truncated");
    assert!(
        matches!(err, CheckpointError::Corrupt { ref path, .. } if path == &file),
        "{err}"
    );
    assert!(err.to_string().contains("truncated"), "{err}");
    // No manifest: an interrupted save, not a checkpoint.
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    assert!(Checkpoint::open(&dir).is_err());
    assert!(Checkpointer::latest(&root).unwrap().is_none());
    std::fs::remove_dir_all(&root).unwrap();
}

/// A manifest edited to name a file outside its folder is refused before the file is opened
/// (before, `Checkpoint::open` opened whatever path the manifest joined); a directory standing
/// where a rank file belongs is named as such (before: "the file has 4096 bytes").
#[test]
fn a_manifest_names_only_files_inside_its_checkpoint() {
    let root = scratch("escape");
    save_tp2_zero2(&root, 1, 1);
    let dir = root.join("step-00000001");
    let name = "rank-00001-of-00004.safetensors";
    std::fs::copy(dir.join(name), root.join(name)).unwrap();
    let manifest = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let quoted = format!("\"{name}\"");
    assert!(text.contains(&quoted), "the manifest lists {name}");
    for escape in [format!("../{name}"), root.join(name).display().to_string()] {
        // Sealed again after the edit, as a tool that rewrites manifests would.
        std::fs::write(&manifest, &text).unwrap();
        reseal(&manifest, |m| {
            let text = serde_json::to_string(m).unwrap();
            *m = serde_json::from_str(&text.replace(&quoted, &format!("\"{escape}\""))).unwrap();
        });
        let err = Checkpoint::open(&dir)
            .err()
            .expect("a file outside the checkpoint");
        assert!(
            matches!(err, CheckpointError::Corrupt { ref path, .. } if path == &manifest),
            "{err}"
        );
        assert!(err.to_string().contains("not inside"), "{err}");
    }
    std::fs::write(&manifest, &text).unwrap();
    Checkpoint::open(&dir).expect("the original manifest opens");
    // A directory in place of a rank file.
    std::fs::remove_file(dir.join(name)).unwrap();
    std::fs::create_dir(dir.join(name)).unwrap();
    let err = Checkpoint::open(&dir)
        .err()
        .expect("a directory is no rank file");
    assert!(err.to_string().contains("a directory"), "{err}");
    // A missing one.
    std::fs::remove_dir(dir.join(name)).unwrap();
    let err = Checkpoint::open(&dir).err().expect("a missing rank file");
    assert!(err.to_string().contains("missing file"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Rewrites the manifest at `path` through `edit` and seals it again
/// ([`Manifest::sealed_json`]), as a tool that edits manifests consistently would.
fn reseal(path: &Path, edit: impl FnOnce(&mut Manifest)) {
    let mut manifest: Manifest = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut manifest);
    std::fs::write(path, manifest.sealed_json()).unwrap();
}

/// A manifest cannot lie. Edited without sealing, it is refused at open by its own checksum;
/// sealed after placing a piece in another region (every chunk's bytes intact), the read
/// fails on the piece's chunk checksums; without every saving rank's state it is refused.
/// Before (format version 1) the first two loaded another region's values without a word.
#[test]
fn a_manifest_cannot_lie_about_its_pieces() {
    let root = scratch("lie");
    save_tp2_zero2(&root, 3, 1);
    let dir = root.join("step-00000003");
    let path = dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    // An unsealed edit: the step.
    std::fs::write(&path, text.replace("\"step\": 3", "\"step\": 4")).unwrap();
    let err = Checkpoint::open(&dir).err().expect("an edited manifest");
    assert!(err.to_string().contains("checksum"), "{err}");
    // A sealed edit that swaps the regions of two pieces of the same size: the qkv weight's
    // tensor-parallel halves, each on its own rank file.
    std::fs::write(&path, &text).unwrap();
    reseal(&path, |m| {
        let pieces = &mut m.tensors.get_mut("blocks.0.qkv.weight").unwrap().pieces;
        let (a, b) = (pieces[0].region.clone(), pieces[3].region.clone());
        assert_eq!(a.numel(), b.numel());
        assert_ne!(a, b);
        pieces[0].region = b;
        pieces[3].region = a;
    });
    let ckpt = Checkpoint::open(&dir).expect("sealed: it opens");
    let err = ckpt
        .read_full("blocks.0.qkv.weight")
        .expect_err("a piece placed in another region");
    assert!(
        err.to_string().contains("another tensor or region"),
        "{err}"
    );
    // The untouched tensors still read.
    ckpt.read_full("wte").unwrap();
    // A sealed edit that drops the rank states.
    std::fs::write(&path, &text).unwrap();
    reseal(&path, |m| m.rank_states.truncate(1));
    let err = Checkpoint::open(&dir).err().expect("rank states dropped");
    assert!(err.to_string().contains("rank states"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Optimizer state whose step counters were lost (the rank states nulled, the manifest sealed)
/// is refused by name; before, it loaded with the counters restarted, which silently changes
/// AdamW's bias correction.
#[test]
fn optimizer_state_without_its_step_counters_is_refused() {
    let root = scratch("counters");
    run_local(1, |group| {
        let w = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [4]);
        let m = TensorData::new(vec![0.1f32, 0.2, 0.3, 0.4], [4]);
        let pieces = vec![
            Piece::whole("w", w).unwrap(),
            Piece::whole("optim/moment_1/w", m).unwrap(),
        ];
        let counters = json!({ "optim_scalars": { "w": { "time": { "int": 7 } } } });
        Checkpointer::new(&root, 1, &group)
            .unwrap()
            .save(1, pieces, Value::Null, counters)
            .unwrap();
        Ok(())
    })
    .unwrap();
    let dir = root.join("step-00000001");
    let segments = [Segment {
        logical: "w".into(),
        region: Region::full(&[4]),
        local: Region::full(&[4]),
    }];
    let ckpt = Checkpoint::open(&dir).unwrap();
    let scalars = merged_scalars(&ckpt, "optim_scalars");
    let (state, counters) = read_state(&ckpt, &segments, &[4], &scalars)
        .unwrap()
        .expect("state is there");
    assert_eq!(state.len(), 1);
    assert_eq!(counters["time"], json!({ "int": 7 }));
    reseal(&dir.join("manifest.json"), |m| {
        m.rank_states = vec![Value::Null]
    });
    let ckpt = Checkpoint::open(&dir).unwrap();
    let scalars = merged_scalars(&ckpt, "optim_scalars");
    let err = read_state(&ckpt, &segments, &[4], &scalars).expect_err("counters lost");
    assert!(err.contains("step counters"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn another_model_is_refused_with_the_differences() {
    let root = scratch("mismatch");
    save_tp2_zero2(&root, 1, 1);
    let ckpt = Checkpointer::latest(&root).unwrap().unwrap();
    let expected: Vec<(&str, Vec<usize>)> = vec![
        ("wte", vec![10, 6]),
        ("blocks.0.qkv.weight", vec![6, 24]),
        ("blocks.1.qkv.weight", vec![6, 18]),
    ];
    let err = ckpt
        .check(expected.iter().map(|(n, s)| (*n, s.as_slice())))
        .unwrap_err();
    match err {
        CheckpointError::Mismatch {
            missing,
            unexpected,
            shapes,
        } => {
            assert_eq!(
                missing,
                vec![("blocks.1.qkv.weight".to_string(), vec![6, 18])]
            );
            assert_eq!(
                unexpected,
                vec![
                    ("blocks.0.proj.weight".to_string(), vec![6, 6]),
                    ("ln.bias".to_string(), vec![6]),
                ]
            );
            assert_eq!(
                shapes,
                vec![("blocks.0.qkv.weight".to_string(), vec![6, 18], vec![6, 24])]
            );
        }
        other => panic!("{other}"),
    }
    let err = ckpt.read("wte", &Region::full(&[10, 7])).unwrap_err();
    assert!(err.to_string().contains("wte"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn unsaved_elements_fail_the_save_on_every_rank() {
    let root = scratch("coverage");
    let errors = run_local(2, |group| {
        // Both ranks save the first half of the rows: the second half belongs to nobody.
        let r = Region::full(&[4, 2]).chunk(0, 2, 0).unwrap();
        let piece = Piece::new("w", r, TensorData::new(vec![0f32; 4], [4])).unwrap();
        let result = Checkpointer::new(&root, 1, &group).unwrap().save(
            1,
            vec![piece],
            Value::Null,
            Value::Null,
        );
        Ok(result.unwrap_err().to_string())
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("tensor manifest") || e.contains("saved by no rank"),
            "{e}"
        );
        assert!(e.contains("4..8"), "{e}");
    }
    assert!(Checkpointer::latest(&root).unwrap().is_none());
    // A piece whose data does not fit its region is refused before anything is written.
    let bad = Piece::new(
        "w",
        Region::full(&[2, 2]),
        TensorData::new(vec![0f32; 3], [3]),
    );
    assert!(bad.unwrap_err().to_string().contains("3 elements of data"));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn keeps_the_last_k_and_skips_interrupted_saves() {
    let root = scratch("keep");
    for step in [1, 2, 3, 4] {
        save_tp2_zero2(&root, step, 2);
    }
    let mut left: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, vec!["step-00000003", "step-00000004"]);
    // An interrupted later save (files, no manifest) is skipped by `latest`.
    std::fs::create_dir_all(root.join("step-00000005")).unwrap();
    std::fs::write(
        root.join("step-00000005/rank-00000-of-00004.safetensors"),
        b"partial",
    )
    .unwrap();
    assert_eq!(Checkpointer::latest(&root).unwrap().unwrap().step(), 4);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn an_asynchronous_save_completes_while_the_caller_goes_on() {
    let root = scratch("async");
    let values: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    run_local(2, |group| {
        let mut saver = Checkpointer::new(&root, 2, &group).unwrap();
        for step in 0..3 {
            let r = Region::full(&[64, 64]).chunk(0, 2, group.rank()).unwrap();
            let mine: Vec<f32> = take(&values, &r).iter().map(|v| v + step as f32).collect();
            let piece = Piece::new("w", r, TensorData::new(mine, [2048])).unwrap();
            saver
                .save_async(step, vec![piece], json!({ "step": step }), Value::Null)
                .unwrap();
            // Training's own collectives go on meanwhile, on the training group.
            let sum = group.all_reduce_f32(vec![1.0], burn_parallel::ReduceOp::Sum)?;
            assert_eq!(sum, vec![2.0]);
        }
        let report = saver.wait().unwrap().expect("the last save");
        assert!(report.bytes > 8192);
        Ok(())
    })
    .unwrap();
    let ckpt = Checkpointer::latest(&root).unwrap().unwrap();
    assert_eq!(ckpt.step(), 2);
    let expected: Vec<f32> = values.iter().map(|v| v + 2.0).collect();
    assert_eq!(
        ckpt.read_full("w").unwrap().try_to_vec::<f32>().unwrap(),
        expected
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// The manifest's seal is checked on the bytes as written: a state full of floats (a loss
/// history) opens, though serde_json's default float parsing need not give back their last
/// bit (a first version of the seal re-serialised the parsed manifest and refused such runs).
#[test]
fn a_sealed_manifest_with_any_floats_opens() {
    let root = scratch("floats");
    let losses: Vec<f64> = (1..4000)
        .map(|i| (i as f64 * 0.37).sin() / 3.0 + 1e-7 * i as f64)
        .collect();
    run_local(1, |group| {
        let piece = Piece::whole("w", TensorData::new(vec![1.0f32, 2.0], [2])).unwrap();
        Checkpointer::new(&root, 1, &group)
            .unwrap()
            .save(1, vec![piece], json!({ "losses": losses }), Value::Null)
            .unwrap();
        Ok(())
    })
    .unwrap();
    let ckpt = Checkpointer::latest(&root).unwrap().expect("it opens");
    assert_eq!(
        ckpt.state()["losses"].as_array().unwrap().len(),
        losses.len()
    );
    std::fs::remove_dir_all(&root).unwrap();
}
