//! Model FLOPs utilisation: the share of the devices' peak arithmetic a training run turns
//! into model FLOPs.
//!
//! `MFU = tokens/s * FLOPs per token / (devices * peak FLOP/s)`, with the FLOPs per token of
//! [`ModelShape::train_flops_per_token`](crate::planner::ModelShape::train_flops_per_token)
//! (`6 * matmul weights + 12 * layers * seq * d_model`: recomputation is not model work and is
//! not counted) and the peak of the arithmetic the products run in ([`Math`]): dense, without
//! structured sparsity, from the vendor's data sheet ([`peak_tflops`]), or given by the user.

use std::fmt;

/// The arithmetic the matrix products run in, which sets the peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Math {
    /// IEEE fp32 on the CUDA cores.
    F32,
    /// fp32 inputs multiplied in TF32 on the tensor cores.
    Tf32,
    /// bf16 or fp16 on the tensor cores, fp32 accumulation.
    Half,
}

impl fmt::Display for Math {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Math::F32 => "fp32",
            Math::Tf32 => "tf32",
            Math::Half => "bf16/fp16",
        })
    }
}

/// Dense peak TFLOP/s of an NVIDIA GPU by the driver's device name, or `None` for a device
/// not in the table. Figures of the SXM parts unless the name says PCIe/NVL.
///
/// ```
/// use burn_parallel::mfu::{Math, peak_tflops};
///
/// assert_eq!(peak_tflops("NVIDIA H200", Math::Half), Some(989.4));
/// assert_eq!(peak_tflops("NVIDIA H100 PCIe", Math::F32), Some(51.2));
/// assert_eq!(peak_tflops("a CPU", Math::F32), None);
/// ```
pub fn peak_tflops(device_name: &str, math: Math) -> Option<f64> {
    // (name fragment, fp32, tf32, bf16/fp16), most specific first.
    const TABLE: [(&str, f64, f64, f64); 8] = [
        ("H100 PCIe", 51.2, 378.0, 756.0),
        ("H100 NVL", 60.0, 417.5, 835.0),
        ("H200 NVL", 60.0, 417.5, 835.0),
        ("H200", 66.9, 494.7, 989.4),
        ("H100", 66.9, 494.7, 989.4),
        ("GH200", 66.9, 494.7, 989.4),
        ("A100", 19.5, 156.0, 312.0),
        ("L40S", 91.6, 183.0, 362.1),
    ];
    let (_, f32, tf32, half) = TABLE.iter().find(|row| device_name.contains(row.0))?;
    Some(match math {
        Math::F32 => *f32,
        Math::Tf32 => *tf32,
        Math::Half => *half,
    })
}

/// What MFU is measured against: the FLOPs of a token and the peak of the devices.
#[derive(Debug, Clone, PartialEq)]
pub struct Mfu {
    /// Training FLOPs per token.
    pub flops_per_token: f64,
    /// Peak FLOP/s of one device, when known.
    pub peak_per_device: Option<f64>,
    /// Devices the tokens/s is spread over.
    pub devices: usize,
}

impl Mfu {
    /// Model TFLOP/s achieved at `tokens_per_sec` (over all devices).
    pub fn tflops(&self, tokens_per_sec: f64) -> f64 {
        tokens_per_sec * self.flops_per_token / 1e12
    }

    /// MFU at `tokens_per_sec` (over all devices), as a fraction; `None` without a peak.
    ///
    /// ```
    /// use burn_parallel::mfu::Mfu;
    ///
    /// let mfu = Mfu { flops_per_token: 6e8, peak_per_device: Some(1e15), devices: 2 };
    /// assert!((mfu.of(1e6).unwrap() - 0.3).abs() < 1e-12);
    /// ```
    pub fn of(&self, tokens_per_sec: f64) -> Option<f64> {
        let peak = self.peak_per_device? * self.devices.max(1) as f64;
        (peak > 0.0).then_some(tokens_per_sec * self.flops_per_token / peak)
    }

    /// `"12.3 TFLOP/s  mfu 4.5%"`, or the TFLOP/s alone without a peak.
    pub fn describe(&self, tokens_per_sec: f64) -> String {
        let tflops = self.tflops(tokens_per_sec);
        match self.of(tokens_per_sec) {
            Some(m) => format!("{tflops:.3} TFLOP/s  mfu {:.1}%", 100.0 * m),
            None => format!("{tflops:.3} TFLOP/s"),
        }
    }
}
