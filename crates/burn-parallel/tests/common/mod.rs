//! What several test binaries of `burn-parallel` share: the devices of the GPU tests, which
//! skip visibly where the device is missing and fail instead where it is required.

#![allow(dead_code)] // each test binary uses its own part

/// Writes `SKIPPED <test>: <reason>` through a `std::io::stderr()` handle: libtest captures
/// `print!`/`eprint!` but not such writes, so the line shows in `cargo test` output without
/// `--nocapture`.
pub fn skipped(test: &str, reason: &str) {
    use std::io::Write;
    // One write of the whole line, so that it does not interleave with libtest's output.
    let line = format!("SKIPPED {test}: {reason}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The WGPU device for `test`, or `None` (with a visible `SKIPPED` line) when there is no
/// adapter; with `BURN_PARALLEL_REQUIRE_WGPU=1` a missing adapter fails the test instead.
#[cfg(feature = "wgpu")]
pub fn wgpu_device(test: &str) -> Option<burn::tensor::Device> {
    match burn_parallel::kernels::wgpu_device() {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("BURN_PARALLEL_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("{test}: BURN_PARALLEL_REQUIRE_WGPU=1 but {e}");
            }
            // `e` reads "no WGPU adapter: <why>".
            skipped(
                test,
                &format!("{e}; set BURN_PARALLEL_REQUIRE_WGPU=1 to fail instead"),
            );
            None
        }
    }
}

/// [`wgpu_device`] when the adapter also supports f16; `None` with a visible `SKIPPED` line
/// otherwise.
#[cfg(feature = "wgpu")]
pub fn wgpu_f16_device(test: &str) -> Option<burn::tensor::Device> {
    let dev = wgpu_device(test)?;
    if dev.supports_dtype(burn::tensor::DType::F16) {
        Some(dev)
    } else {
        skipped(test, "the WGPU adapter does not support f16");
        None
    }
}

/// CUDA device 0, or `None` (with a visible `SKIPPED` line) where there is no NVIDIA driver
/// or GPU; with `BURN_PARALLEL_REQUIRE_CUDA=1` their absence fails the test instead.
#[cfg(feature = "cuda")]
pub fn cuda_device(test: &str) -> Option<burn::tensor::Device> {
    match burn_parallel::cuda::cuda_device(0, "the test's device") {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("BURN_PARALLEL_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("{test}: BURN_PARALLEL_REQUIRE_CUDA=1 but {e}");
            }
            skipped(test, &e.to_string());
            None
        }
    }
}
