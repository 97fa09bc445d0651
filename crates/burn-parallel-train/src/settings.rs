//! The run settings a config file and flags name, whatever the model: the arithmetic
//! ([`Precision`]), dynamic loss scaling ([`LossScale`]) and the device ([`TrainDevice`]).
//!
//! ```
//! use burn_parallel_train::{LossScale, Precision, TrainDevice};
//!
//! // As a TOML file says them.
//! #[derive(serde::Deserialize)]
//! struct Run {
//!     precision: Precision,
//!     loss_scale: Option<LossScale>,
//! }
//! let run: Run = toml::from_str("precision = \"fp16\"\n[loss_scale]\nwindow = 500").unwrap();
//! assert_eq!(run.precision, Precision::Fp16);
//! assert_eq!(run.loss_scale.unwrap().scaler().growth_interval(), 500);
//! assert!(TrainDevice::Flex.device().is_ok());
//! ```

use burn::tensor::Device;
use burn_parallel::Error;
use burn_parallel::mfu::Math;
use burn_parallel::precision::{LossScaler, MixedPrecision};
use serde::{Deserialize, Serialize};

/// The arithmetic of the forward and backward (`--precision`, `precision` in a config file).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in fp32.
    #[default]
    F32,
    /// bf16 compute, gradients averaged in bf16, fp32 master weights and optimizer state.
    Bf16,
    /// fp16 compute with dynamic loss scaling (from 2^16), gradients averaged in fp32, fp32
    /// master weights and optimizer state.
    Fp16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

impl Precision {
    /// The library's policy for it.
    pub fn policy(self) -> MixedPrecision {
        match self {
            Precision::F32 => MixedPrecision::full(),
            Precision::Bf16 => MixedPrecision::bf16(),
            Precision::Fp16 => MixedPrecision::f16(),
        }
    }

    /// The arithmetic of its matrix products (fp32 ones in TF32 with `tf32`), for a device's
    /// peak ([`TrainDevice::peak_flops`]).
    pub fn math(self, tf32: bool) -> Math {
        match self {
            Precision::F32 if tf32 => Math::Tf32,
            Precision::F32 => Math::F32,
            Precision::Bf16 | Precision::Fp16 => Math::Half,
        }
    }

    /// The loss scaler it needs (fp16: [`LossScale::default`], as PyTorch's `GradScaler`).
    pub fn scaler(self) -> Option<LossScaler> {
        (self == Precision::Fp16).then(|| LossScale::default().scaler())
    }
}

/// Dynamic loss scaling, as torch's `GradScaler` takes it: an overflowing step is skipped and
/// multiplies the scale by `backoff_factor`; `window` clean steps in a row multiply it by
/// `growth_factor` (Megatron-LM's `--initial-loss-scale` and `--loss-scale-window`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LossScale {
    /// The first scale.
    pub initial: f64,
    /// Clean steps in a row between two growths.
    pub window: usize,
    /// What a growth multiplies the scale by (> 1).
    pub growth_factor: f64,
    /// What an overflow multiplies the scale by (in (0, 1)).
    pub backoff_factor: f64,
}

impl Default for LossScale {
    /// fp16's customary scaling: from 65536, doubling after 2000 clean steps, halving on an
    /// overflow.
    fn default() -> Self {
        Self {
            initial: 65536.0,
            window: 2000,
            growth_factor: 2.0,
            backoff_factor: 0.5,
        }
    }
}

impl LossScale {
    /// The scaler that starts this way.
    pub fn scaler(&self) -> LossScaler {
        LossScaler::new(self.initial)
            .with_growth_interval(self.window)
            .with_factors(self.growth_factor, self.backoff_factor)
    }

    /// How `scaler` is set to start (its current scale, interval and factors).
    pub fn of(scaler: &LossScaler) -> Self {
        let (growth_factor, backoff_factor) = scaler.factors();
        Self {
            initial: scaler.scale(),
            window: scaler.growth_interval(),
            growth_factor,
            backoff_factor,
        }
    }
}

/// The device a run trains on (`--device flex|wgpu|cuda`; not saved with checkpoints: a run
/// resumes on any device). A device this build lacks is refused by [`TrainDevice::device`],
/// naming the feature to build with.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum TrainDevice {
    /// Burn's pure-Rust CPU backend.
    #[default]
    Flex,
    /// Burn's WGPU backend (needs the `wgpu` feature and an adapter), where the fused paths
    /// run as CubeCL kernels.
    Wgpu,
    /// Burn's CUDA backend (needs the `cuda` feature and an NVIDIA GPU) on device `LOCAL_RANK`
    /// (0 when the launcher does not set it): one GPU per process of a node.
    Cuda,
    /// Burn's CUDA backend on device `index`: for thread ranks of one process, one GPU each
    /// (NCCL refuses two ranks of a communicator on one GPU).
    #[cfg_attr(feature = "cli", value(skip))]
    CudaDevice(usize),
}

impl TrainDevice {
    /// The (plain, non-autodiff) Burn device.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `--device` for WGPU without the `wgpu` feature or an adapter,
    /// and for CUDA without a driver or the device.
    pub fn device(self) -> Result<Device, Error> {
        let invalid = |e: &dyn std::fmt::Display| Error::invalid("--device", e);
        match self {
            TrainDevice::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            TrainDevice::Wgpu => burn_parallel::kernels::wgpu_device().map_err(|e| invalid(&e)),
            #[cfg(not(feature = "wgpu"))]
            TrainDevice::Wgpu => Err(invalid(
                &"this build has no WGPU backend: rebuild with --features wgpu",
            )),
            // The driver and the device are checked first: a typed error, not cudarc's panic.
            TrainDevice::Cuda => {
                use burn_parallel::cuda;
                let (index, from) = cuda::local_device_index().map_err(|e| invalid(&e))?;
                cuda::cuda_device(index, &from).map_err(|e| invalid(&e))
            }
            TrainDevice::CudaDevice(index) => burn_parallel::cuda::cuda_device(
                index,
                &format!("TrainDevice::CudaDevice({index})"),
            )
            .map_err(|e| invalid(&e)),
        }
    }

    /// The peak FLOP/s of one such device for `math` (MFU's denominator), from the data sheet
    /// of the CUDA device the driver names.
    ///
    /// # Errors
    /// Why there is none, saying what to do (a device not in the table, a non-CUDA device:
    /// give the peak by hand).
    pub fn peak_flops(self, math: Math) -> Result<(f64, String), String> {
        use burn_parallel::cuda;
        let name = match self {
            TrainDevice::CudaDevice(index) => cuda::device_name(index),
            TrainDevice::Cuda => cuda::local_device_index().and_then(|(i, _)| cuda::device_name(i)),
            TrainDevice::Flex | TrainDevice::Wgpu => {
                return Err("give the device's peak with --peak-tflops to see MFU".into());
            }
        };
        let name = name.map_err(|e| e.to_string())?;
        match burn_parallel::mfu::peak_tflops(&name, math) {
            Some(t) => Ok((t * 1e12, format!("{name}, {math} data sheet"))),
            None => Err(format!("{name} is not in the table: give --peak-tflops")),
        }
    }

    /// Whether it is the host CPU (whose memory [`available_memory`] reports).
    pub fn is_host(self) -> bool {
        self == TrainDevice::Flex
    }
}

/// This machine's available memory in bytes (Linux: `MemAvailable`), if known.
pub fn available_memory() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}
