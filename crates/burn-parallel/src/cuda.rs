//! Opening a CUDA device with a typed error instead of a panic.
//!
//! Burn's CUDA backend initialises the driver the first time a device is used and panics
//! (inside `cudarc`) when there is no NVIDIA driver or no such device. [`cuda_device`] checks
//! the driver and the device index first, so a trainer asked for `--device cuda` on the wrong
//! machine stops with an error that says what is missing; [`local_device_index`] reads which
//! device a process of a node should take from the launcher's environment.

/// Why a CUDA device cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// This build has no CUDA backend.
    #[error(
        "this build has no CUDA backend: rebuild with `--features cuda` (the LLVM it needs: \
         scripts/setup-llvm.sh)"
    )]
    NotBuilt,
    /// The driver library cannot be loaded.
    #[error(
        "the CUDA driver library (libcuda.so) cannot be loaded: this machine has no NVIDIA \
         driver; install it (and a GPU), or train on another device (`--device flex` or `wgpu`)"
    )]
    NoDriver,
    /// The driver loaded but did not initialise.
    #[error(
        "the CUDA driver loaded but cuInit failed ({0}): no usable NVIDIA GPU, or a \
         driver/kernel-module mismatch (check `nvidia-smi`)"
    )]
    Init(String),
    /// The device index is not one the driver sees.
    #[error(
        "CUDA device {index} was asked for ({source_var}) but the driver sees {count} device(s) \
         (CUDA_VISIBLE_DEVICES={visible}): start at most {count} ranks per node, or give each \
         process its own device index"
    )]
    NoSuchDevice {
        /// The index asked for.
        index: usize,
        /// How many devices the driver reports.
        count: usize,
        /// Where the index came from.
        source_var: String,
        /// `CUDA_VISIBLE_DEVICES` as read (`unset` when it is not).
        visible: String,
    },
    /// The local rank names a device beyond those `CUDA_VISIBLE_DEVICES` lists.
    #[error(
        "CUDA device {index} was asked for ({source_var}) but CUDA_VISIBLE_DEVICES={visible} \
         lists {listed} device(s) for this process: list one device per process (then it is \
         device 0), or all the node's devices, or start at most {listed} ranks per node"
    )]
    NotVisible {
        /// The index asked for.
        index: usize,
        /// Where the index came from.
        source_var: String,
        /// How many devices the variable lists.
        listed: usize,
        /// The variable's value.
        visible: String,
    },
    /// A launcher variable that should hold a device index does not.
    #[error("{var}={value:?} is not a device index: set it to 0, 1, ...")]
    BadIndex {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
}

/// The index of this process's CUDA device, and where it was read: the one place the trainers
/// and the NCCL backend ([`crate::nccl::init_from_env`]) choose it, so that tensors and the
/// communicator land on the same device.
///
/// - The node-local rank: `LOCAL_RANK` (burnrun, torchrun), else `SLURM_LOCALID` (srun), else
///   0.
/// - `CUDA_VISIBLE_DEVICES`, when set, renumbers what the process sees: with one device listed
///   (one GPU per task, as `srun --gpus-per-task=1` or a per-rank launcher sets it) the index is
///   0 whatever the local rank; with several, the local rank must be one of them.
///
/// # Errors
/// [`CudaError::BadIndex`] when a variable holds something that is not an index;
/// [`CudaError::NotVisible`] when the local rank is beyond the devices
/// `CUDA_VISIBLE_DEVICES` lists.
///
/// # Example
/// ```
/// let (index, _from) = burn_parallel::cuda::local_device_index().unwrap();
/// assert!(index < 1 << 16);
/// ```
pub fn local_device_index() -> Result<(usize, String), CudaError> {
    device_index_from(|var| std::env::var(var).ok())
}

/// [`local_device_index`] from the variables `var` gives.
fn device_index_from(var: impl Fn(&str) -> Option<String>) -> Result<(usize, String), CudaError> {
    let mut local = (
        0,
        "the default, as neither LOCAL_RANK nor SLURM_LOCALID is set".to_string(),
    );
    for name in ["LOCAL_RANK", "SLURM_LOCALID"] {
        if let Some(value) = var(name) {
            let index = value.trim().parse().map_err(|_| CudaError::BadIndex {
                var: name,
                value: value.clone(),
            })?;
            local = (index, format!("{name}={index}"));
            break;
        }
    }
    let Some(visible) = var("CUDA_VISIBLE_DEVICES").filter(|v| !v.trim().is_empty()) else {
        return Ok(local);
    };
    let listed = visible.split(',').filter(|d| !d.trim().is_empty()).count();
    match listed {
        1 => Ok((
            0,
            format!("CUDA_VISIBLE_DEVICES={visible}, one device for this process"),
        )),
        n if local.0 < n => Ok((
            local.0,
            format!("{} of CUDA_VISIBLE_DEVICES={visible}", local.1),
        )),
        n => Err(CudaError::NotVisible {
            index: local.0,
            source_var: local.1,
            listed: n,
            visible,
        }),
    }
}

/// How many CUDA devices the driver sees, after checking that it loads and initialises.
///
/// # Errors
/// [`CudaError::NotBuilt`] without the `cuda` or `nccl` feature, [`CudaError::NoDriver`] or
/// [`CudaError::Init`] on a machine without a usable NVIDIA driver.
pub fn device_count() -> Result<usize, CudaError> {
    #[cfg(any(feature = "cuda", feature = "nccl"))]
    {
        use cudarc::driver::{result as cu, sys as cusys};
        // SAFETY: only tries to dlopen the driver's library names.
        if !unsafe { cusys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        cu::init().map_err(|e| CudaError::Init(e.to_string()))?;
        let count = cu::device::get_count().map_err(|e| CudaError::Init(e.to_string()))?;
        Ok(usize::try_from(count).unwrap_or(0))
    }
    #[cfg(not(any(feature = "cuda", feature = "nccl")))]
    {
        Err(CudaError::NotBuilt)
    }
}

/// The driver's name of CUDA device `index` (`NVIDIA H200`, ...), for looking up its peak
/// throughput ([`crate::mfu::peak_tflops`]).
///
/// # Errors
/// Those of [`check_device`].
pub fn device_name(index: usize) -> Result<String, CudaError> {
    check_device(index, "a device name lookup")?;
    #[cfg(any(feature = "cuda", feature = "nccl"))]
    {
        use cudarc::driver::result as cu;
        let device = i32::try_from(index)
            .map_err(|_| CudaError::Init(format!("device index {index} out of range")))
            .and_then(|i| cu::device::get(i).map_err(|e| CudaError::Init(e.to_string())))?;
        cu::device::get_name(device).map_err(|e| CudaError::Init(e.to_string()))
    }
    #[cfg(not(any(feature = "cuda", feature = "nccl")))]
    {
        Err(CudaError::NotBuilt)
    }
}

/// Checks that CUDA device `index` exists (`source_var` says where the index came from, for
/// the error).
///
/// # Errors
/// Those of [`device_count`], and [`CudaError::NoSuchDevice`].
pub fn check_device(index: usize, source_var: &str) -> Result<usize, CudaError> {
    let count = device_count()?;
    if index >= count {
        return Err(CudaError::NoSuchDevice {
            index,
            count,
            source_var: source_var.into(),
            visible: std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into()),
        });
    }
    Ok(count)
}

/// Burn's CUDA device `index`, once the driver and the device have been checked.
///
/// # Errors
/// [`CudaError::NotBuilt`] without the `cuda` feature, and those of [`check_device`].
///
/// # Example
/// ```
/// // On a machine without an NVIDIA driver (or a build without `cuda`) this is an error that
/// // says what is missing, never a panic.
/// match burn_parallel::cuda::cuda_device(0, "an example") {
///     Ok(device) => println!("{device:?}"),
///     Err(e) => println!("{e}"),
/// }
/// ```
pub fn cuda_device(index: usize, source_var: &str) -> Result<burn::tensor::Device, CudaError> {
    #[cfg(feature = "cuda")]
    {
        check_device(index, source_var)?;
        Ok(burn::tensor::Device::cuda(index))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (index, source_var);
        Err(CudaError::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_or_device_is_an_error_not_a_panic() {
        // No machine has this many GPUs: whatever this build and machine are, the answer is a
        // typed error that names the cause.
        let err = cuda_device(1 << 20, "a test").unwrap_err();
        match (&err, cfg!(feature = "cuda")) {
            (CudaError::NotBuilt, false) => assert!(err.to_string().contains("--features cuda")),
            (CudaError::NoDriver, true) => assert!(err.to_string().contains("libcuda")),
            (CudaError::Init(_), true) => assert!(err.to_string().contains("cuInit")),
            (CudaError::NoSuchDevice { count, .. }, true) => {
                assert!(err.to_string().contains(&format!("sees {count} device")))
            }
            other => panic!("unexpected {other:?}"),
        }
        if cfg!(any(feature = "cuda", feature = "nccl")) {
            // The driver check itself never panics either.
            let _ = device_count();
        } else {
            assert_eq!(device_count(), Err(CudaError::NotBuilt));
        }
    }

    fn index(vars: &[(&str, &str)]) -> Result<(usize, String), CudaError> {
        device_index_from(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn the_device_follows_the_launcher_and_the_visible_devices() {
        assert_eq!(index(&[]).unwrap().0, 0);
        assert_eq!(index(&[("LOCAL_RANK", "3")]).unwrap().0, 3);
        // srun: SLURM_LOCALID, LOCAL_RANK first when both are set.
        assert_eq!(index(&[("SLURM_LOCALID", "2")]).unwrap().0, 2);
        assert_eq!(
            index(&[("LOCAL_RANK", "1"), ("SLURM_LOCALID", "2")])
                .unwrap()
                .0,
            1
        );
        // One GPU per task: the one visible device is device 0, whatever the local rank.
        let (i, from) = index(&[("SLURM_LOCALID", "3"), ("CUDA_VISIBLE_DEVICES", "3")]).unwrap();
        assert_eq!(i, 0);
        assert!(from.contains("CUDA_VISIBLE_DEVICES=3"), "{from}");
        // All the node's devices visible: the local rank picks one.
        let all = [("LOCAL_RANK", "2"), ("CUDA_VISIBLE_DEVICES", "0,1,2,3")];
        assert_eq!(index(&all).unwrap().0, 2);
    }

    #[test]
    fn a_device_the_process_cannot_see_is_a_typed_error() {
        match index(&[("LOCAL_RANK", "2"), ("CUDA_VISIBLE_DEVICES", "0,1")]) {
            Err(
                e @ CudaError::NotVisible {
                    index: 2,
                    listed: 2,
                    ..
                },
            ) => {
                assert!(e.to_string().contains("LOCAL_RANK=2"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            index(&[("SLURM_LOCALID", "x")]),
            Err(CudaError::BadIndex {
                var: "SLURM_LOCALID",
                ..
            })
        ));
    }
}
