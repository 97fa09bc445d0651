//! Rotary position embeddings (the half-split form of `transformers`' `rotate_half`).

use burn::tensor::{Device, Tensor, TensorData};

use crate::kernels;

/// Rotary position tables for the tokens of a pass.
///
/// For a head vector `x = [x1, x2]` (two halves of `head_dim / 2`), position `p` and frequency
/// `w_i = theta^(-2i / head_dim)`: `rope(x) = [x1 cos - x2 sin, x2 cos + x1 sin]` with the angle
/// `p * w_i`. The tables are built on the host in `f64`; [`Rope::at_positions`] takes any
/// global positions (a context-parallel rank's tokens), so the rotation does not depend on
/// how the sequence is split.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_parallel::nn::Rope;
///
/// let device = Device::flex();
/// let x = Tensor::<4>::ones([1, 2, 3, 8], &device); // [batch, heads, seq, head_dim]
/// let rope = Rope::new(8, 3, 0, 10_000.0, &device);
/// let composed = rope.apply(x.clone());
/// // Position 0 is not rotated.
/// let first = composed.clone().narrow(2, 0, 1).into_data();
/// first.assert_approx_eq::<f32>(&x.clone().narrow(2, 0, 1).into_data(), burn::tensor::Tolerance::absolute(1e-6));
/// let fused = rope.with_fused(true).apply(x).into_data();
/// fused.assert_approx_eq::<f32>(&composed.into_data(), burn::tensor::Tolerance::absolute(1e-5));
/// ```
#[derive(Clone, Debug)]
pub struct Rope {
    /// `cos(p w_i)`, shape `[1, 1, seq_len, head_dim / 2]`.
    pub cos: Tensor<4>,
    /// `sin(p w_i)`, shape `[1, 1, seq_len, head_dim / 2]`.
    pub sin: Tensor<4>,
    /// Rotate through the fused kernel ([`kernels::rope`]).
    pub fused: bool,
}

impl Rope {
    /// Tables for `seq_len` positions starting at `offset`.
    ///
    /// # Arguments
    /// - `head_dim`: the (even) head dimension.
    /// - `seq_len`: number of positions.
    /// - `offset`: position of the first token (non-zero for a chunk of a longer sequence).
    /// - `theta`: frequency base (10 000).
    /// - `device`: where the tables live.
    pub fn new(
        head_dim: usize,
        seq_len: usize,
        offset: usize,
        theta: f64,
        device: &Device,
    ) -> Self {
        let positions: Vec<usize> = (offset..offset + seq_len).collect();
        Self::at_positions(head_dim, &positions, theta, device)
    }

    /// Tables for tokens at arbitrary global `positions`, in the order the tokens are held (a
    /// context-parallel rank's tokens,
    /// [`SeqLayout::positions`](crate::context_parallel::SeqLayout::positions)).
    ///
    /// # Arguments
    /// - `head_dim`: the (even) head dimension.
    /// - `positions`: the global position of each token.
    /// - `theta`: frequency base (10 000).
    /// - `device`: where the tables live.
    pub fn at_positions(head_dim: usize, positions: &[usize], theta: f64, device: &Device) -> Self {
        let half = head_dim / 2;
        let seq_len = positions.len();
        let mut cos = Vec::with_capacity(seq_len * half);
        let mut sin = Vec::with_capacity(seq_len * half);
        for &p in positions {
            for i in 0..half {
                let freq = theta.powf(-2.0 * i as f64 / head_dim as f64);
                let angle = p as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = [1, 1, seq_len, half];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            fused: false,
        }
    }

    /// The same tables, rotating through the fused kernel when `fused`.
    pub fn with_fused(self, fused: bool) -> Self {
        Self { fused, ..self }
    }

    /// Rotates `x` of shape `[batch, heads, seq_len, head_dim]`.
    ///
    /// # Panics
    /// Through the fused kernel, if `x`'s sequence length or head width is not the tables'.
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        if self.fused {
            return kernels::rope(x, self.cos.clone(), self.sin.clone())
                .unwrap_or_else(|e| panic!("fused rope: {e}"));
        }
        let half = x.dims()[3] / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.narrow(3, half, half);
        let rotated_1 = x1.clone() * self.cos.clone() - x2.clone() * self.sin.clone();
        let rotated_2 = x2 * self.cos.clone() + x1 * self.sin.clone();
        Tensor::cat(vec![rotated_1, rotated_2], 3)
    }
}
