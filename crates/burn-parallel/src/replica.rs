//! Checking that replicas are identical before training starts.
//!
//! Data parallelism, ZeRO and FSDP all assume that every rank starts from the same parameters:
//! DDP averages gradients, ZeRO updates shards of what it believes is one model, FSDP keeps
//! the slice of each rank's own copy. Ranks that initialised their model from different random
//! states train silently wrong. [`verify_replicas`] compares a stable hash of every parameter
//! across the ranks of a group and returns a [`ReplicaError`] naming the first parameter that
//! differs and the ranks that disagree.
//!
//! The hash is 64-bit FNV-1a over the parameter's module path, dtype, shape and bytes (stable
//! across runs, processes and platforms of the same endianness, unlike std's `DefaultHasher`).
//! Every rank gathers every rank's hashes and decides from the same data, so all ranks return
//! the same verdict: one rank never errors while another waits in a collective.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::CollectiveError;
use crate::group::ProcessGroup;

/// What [`verify_replicas`] found wrong.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ReplicaError {
    /// A parameter differs across ranks (its values, dtype or shape, or it exists on some
    /// ranks only).
    #[error(
        "the replicas differ at parameter \"{path}\": ranks {agreeing:?} hold one value and \
         ranks {differing:?} another ({detail}); broadcast from rank 0 \
         (DistributedDataParallel::broadcast_module) or initialise from the same seed on every \
         rank before wrapping the model"
    )]
    Mismatch {
        /// Module path of the first parameter (in visiting order) that differs.
        path: String,
        /// Global ranks that hold the same parameter as the lowest rank.
        agreeing: Vec<usize>,
        /// Global ranks that hold something else.
        differing: Vec<usize>,
        /// What differs (values, or the parameter is missing on some ranks).
        detail: String,
    },
    /// The hashes could not be exchanged.
    #[error("cannot compare the replicas: {0}")]
    Collective(#[from] CollectiveError),
}

/// One rank's parameter fingerprints, in visiting order.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
struct Fingerprint {
    /// Global rank.
    rank: usize,
    /// (module path, hash) of every float parameter.
    params: Vec<(String, u64)>,
}

/// 64-bit FNV-1a, fed incrementally (also the fault-tolerant replicas' digest,
/// [`crate::fault`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fnv1a(pub(crate) u64);

impl Fnv1a {
    pub(crate) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The stable hash of one parameter: FNV-1a over its path, dtype, shape and bytes.
fn param_hash<const D: usize>(path: &str, param: &Param<Tensor<D>>) -> u64 {
    let data = param.val().into_data();
    let mut h = Fnv1a::new();
    h.write(path.as_bytes());
    h.write(&[0]);
    h.write(format!("{:?}", data.dtype()).as_bytes());
    h.write(&[0]);
    for &d in data.shape().as_slice() {
        h.write(&(d as u64).to_le_bytes());
    }
    h.write(data.as_bytes());
    h.0
}

/// The fingerprints of the float parameters of `module` whose path passes `keep`.
fn fingerprint<M: Module>(
    module: &M,
    rank: usize,
    keep: &dyn Fn(&str, ParamId) -> bool,
) -> Fingerprint {
    struct Hasher<'a> {
        stack: Vec<String>,
        keep: &'a dyn Fn(&str, ParamId) -> bool,
        out: Vec<(String, u64)>,
    }
    impl ModuleVisitor for Hasher<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let path = self.stack.join(".");
            if (self.keep)(&path, param.id) {
                let hash = param_hash(&path, param);
                self.out.push((path, hash));
            }
        }
    }
    let mut hasher = Hasher {
        stack: Vec::new(),
        keep,
        out: Vec::new(),
    };
    module.visit(&mut hasher);
    Fingerprint {
        rank,
        params: hasher.out,
    }
}

/// Checks that `module` is identical on every rank of `group`.
///
/// Every rank hashes each float parameter (FNV-1a over module path, dtype, shape and bytes, in
/// visiting order), the hashes are all-gathered, and every rank compares the same data: all
/// ranks return `Ok`, or all return the same error. Collective: every rank of `group` must call
/// it at the same point.
///
/// # Arguments
/// * `module` - this rank's replica.
/// * `group` - the ranks that must hold identical replicas.
///
/// # Returns
/// `Ok(())` when every parameter is identical on every rank.
///
/// # Errors
/// [`ReplicaError::Mismatch`] naming the first differing parameter and the ranks on each side;
/// [`ReplicaError::Collective`] when the exchange fails.
///
/// # Example
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_parallel::replica::{ReplicaError, verify_replicas};
/// use burn_parallel::{DistributedDataParallel, run_local};
///
/// let verdicts = run_local(2, |group| {
///     let device = Device::flex();
///     // A random initialisation differs on every rank...
///     let model = LinearConfig::new(4, 4).init(&device);
///     let before = verify_replicas(&model, &group);
///     // ... until rank 0's weights are broadcast.
///     let model = DistributedDataParallel::new(group.clone()).broadcast_module(model, 0)?;
///     let after = verify_replicas(&model, &group);
///     Ok((before, after))
/// })
/// .unwrap();
/// for (before, after) in verdicts {
///     assert!(matches!(before, Err(ReplicaError::Mismatch { .. })));
///     assert_eq!(after, Ok(()));
/// }
/// ```
pub fn verify_replicas<M: Module>(module: &M, group: &ProcessGroup) -> Result<(), ReplicaError> {
    verify_replicas_in(module, &[group], |_| true)
}

/// [`verify_replicas`] over several groups whose ranks together form the set of replicas (for
/// hybrid sharding: the shard group and the replica group), for the parameters whose module
/// path passes `keep`.
///
/// The fingerprints are all-gathered over `groups[0]`, then what each rank holds is all-gathered
/// over `groups[1]`, and so on: when the groups form a grid (as the dimensions of a
/// `DeviceMesh` do), every rank ends with every rank's fingerprints and all reach the same
/// verdict.
///
/// # Arguments
/// * `module` - this rank's replica.
/// * `groups` - the groups, in gathering order.
/// * `keep` - which parameters (by module path) to compare.
///
/// # Returns
/// `Ok(())` when every compared parameter is identical on every rank reached.
///
/// # Errors
/// See [`verify_replicas`].
pub fn verify_replicas_in<M: Module>(
    module: &M,
    groups: &[&ProcessGroup],
    keep: impl Fn(&str) -> bool,
) -> Result<(), ReplicaError> {
    verify_replicas_where(module, groups, &|path, _| keep(path))
}

/// [`verify_replicas_in`] for the parameters whose id passes `keep` (the experts of a
/// mixture-of-experts model are replicas over other ranks than the rest: select them by their
/// registry of ids, whatever their paths).
///
/// # Errors
/// See [`verify_replicas`].
pub fn verify_replicas_of<M: Module>(
    module: &M,
    groups: &[&ProcessGroup],
    keep: impl Fn(ParamId) -> bool,
) -> Result<(), ReplicaError> {
    verify_replicas_where(module, groups, &|_, id| keep(id))
}

fn verify_replicas_where<M: Module>(
    module: &M,
    groups: &[&ProcessGroup],
    keep: &dyn Fn(&str, ParamId) -> bool,
) -> Result<(), ReplicaError> {
    let Some(first) = groups.first() else {
        return Ok(());
    };
    let mut known = vec![fingerprint(module, first.global_rank(), keep)];
    for group in groups {
        if group.size() == 1 {
            continue;
        }
        let gathered: Vec<Vec<Fingerprint>> = group.all_gather_object(&known)?;
        let mut by_rank = BTreeMap::new();
        for f in gathered.into_iter().flatten() {
            by_rank.insert(f.rank, f);
        }
        known = by_rank.into_values().collect();
    }
    compare(&known)
}

/// The verdict over every rank's fingerprints (sorted by rank).
fn compare(all: &[Fingerprint]) -> Result<(), ReplicaError> {
    let Some(reference) = all.first() else {
        return Ok(());
    };
    let longest = all.iter().map(|f| f.params.len()).max().unwrap_or(0);
    for i in 0..longest {
        let ours = reference.params.get(i);
        let (agreeing, differing): (Vec<&Fingerprint>, Vec<&Fingerprint>) =
            all.iter().partition(|f| f.params.get(i) == ours);
        if differing.is_empty() {
            continue;
        }
        let path = ours
            .or_else(|| differing.iter().find_map(|f| f.params.get(i)))
            .map(|(p, _)| p.clone())
            .unwrap_or_default();
        let missing: Vec<usize> = all
            .iter()
            .filter(|f| f.params.get(i).is_none_or(|(p, _)| *p != path))
            .map(|f| f.rank)
            .collect();
        let detail = if missing.is_empty() {
            "different values, dtype or shape".to_string()
        } else {
            format!(
                "ranks {missing:?} have another parameter at that position or none: the models \
                 differ in structure"
            )
        };
        return Err(ReplicaError::Mismatch {
            path,
            agreeing: agreeing.iter().map(|f| f.rank).collect(),
            differing: differing.iter().map(|f| f.rank).collect(),
            detail,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(rank: usize, params: &[(&str, u64)]) -> Fingerprint {
        Fingerprint {
            rank,
            params: params.iter().map(|(p, h)| (p.to_string(), *h)).collect(),
        }
    }

    #[test]
    fn compare_names_the_first_difference_and_both_sides() {
        let same = [fp(0, &[("a", 1), ("b", 2)]), fp(1, &[("a", 1), ("b", 2)])];
        assert_eq!(compare(&same), Ok(()));
        let differ = [
            fp(0, &[("a", 1), ("b", 2)]),
            fp(1, &[("a", 1), ("b", 3)]),
            fp(2, &[("a", 1), ("b", 2)]),
        ];
        match compare(&differ) {
            Err(ReplicaError::Mismatch {
                path,
                agreeing,
                differing,
                ..
            }) => {
                assert_eq!(path, "b");
                assert_eq!(agreeing, vec![0, 2]);
                assert_eq!(differing, vec![1]);
            }
            other => panic!("{other:?}"),
        }
        let shorter = [fp(0, &[("a", 1)]), fp(1, &[("a", 1), ("b", 3)])];
        let err = compare(&shorter).unwrap_err();
        assert!(err.to_string().contains("\"b\""), "{err}");
        assert!(err.to_string().contains("structure"), "{err}");
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        let hash = |s: &str| {
            let mut h = Fnv1a::new();
            h.write(s.as_bytes());
            h.0
        };
        // Published FNV-1a 64 test vectors.
        assert_eq!(hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash("foobar"), 0x8594_4171_f739_67e8);
    }
}
