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
    /// A launcher variable that should hold a device index does not.
    #[error("{var}={value:?} is not a device index: set it to 0, 1, ...")]
    BadIndex {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
}

/// The index of this process's device on its node, and where it was read: `LOCAL_RANK`
/// (burnrun, torchrun), else `SLURM_LOCALID` (srun), else 0.
///
/// # Errors
/// [`CudaError::BadIndex`] when the variable is set to something that is not an index.
///
/// # Example
/// ```
/// let (index, _from) = burn_parallel::cuda::local_device_index().unwrap();
/// assert!(index < 1 << 16);
/// ```
pub fn local_device_index() -> Result<(usize, &'static str), CudaError> {
    for var in ["LOCAL_RANK", "SLURM_LOCALID"] {
        if let Ok(value) = std::env::var(var) {
            return value
                .trim()
                .parse()
                .map(|i| (i, var))
                .map_err(|_| CudaError::BadIndex { var, value });
        }
    }
    Ok((
        0,
        "the default, as neither LOCAL_RANK nor SLURM_LOCALID is set",
    ))
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
}
