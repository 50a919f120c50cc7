//! Synthetic weights: every value is a pure function of (seed, tensor name, element index).
//!
//! A counter-based generator (a SplitMix64 finaliser over key + index·golden ratio) means any row
//! of any tensor of a 744B-parameter model can be produced on demand, in any order, identically on
//! every machine. Values are near-normal (the sum of four 16-bit uniforms, Irwin–Hall) and scaled
//! by role: projections ~ 1/sqrt(fan_in), norm weights near 1, a small non-zero router bias.

use super::{Recipe, WeightSource};
use crate::error::{Error, Result};
use crate::model::catalog::{Catalog, TensorRole};
use crate::model::layout::Layout;
use rayon::prelude::*;

pub struct SyntheticWeights {
    seed: u64,
    catalog: Catalog,
}

impl SyntheticWeights {
    pub fn new(layout: &Layout, seed: u64) -> SyntheticWeights {
        SyntheticWeights {
            seed,
            catalog: Catalog::new(layout),
        }
    }
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective avalanche mix of 64 bits.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// FNV-1a over the bytes of a name: stable across platforms and Rust versions.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_from(FNV1A64_START, bytes)
}

/// The FNV-1a state before any byte.
pub const FNV1A64_START: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a continued from state `h` over `bytes`: a hash taken a buffer at a time.
pub fn fnv1a64_from(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The generator key of one tensor.
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    mix64(fnv1a64(name.as_bytes()) ^ mix64(seed.wrapping_add(GOLDEN)))
}

/// A near-standard-normal value (mean 0, variance 1, support ±2·sqrt(3)) for element `index`.
#[inline]
pub fn normalish(key: u64, index: u64) -> f32 {
    let h = mix64(key.wrapping_add(index.wrapping_mul(GOLDEN)));
    let sum = (h & 0xFFFF) + ((h >> 16) & 0xFFFF) + ((h >> 32) & 0xFFFF) + (h >> 48);
    // Each 16-bit lane is uniform on {0..65535}; (sum + 2) / 65536 has mean 2, variance ≈ 1/3.
    let u = (sum as f64 + 2.0) / 65536.0;
    ((u - 2.0) * 3f64.sqrt()) as f32
}

/// Maps a standard value to the role's scale.
fn scale_for(role: TensorRole, fan_in: usize) -> (f32, f32) {
    match role {
        TensorRole::Embedding => (0.0, 1.0),
        TensorRole::Projection => (0.0, 1.0 / (fan_in as f32).sqrt()),
        TensorRole::NormWeight => (1.0, 0.05),
        TensorRole::Bias => (0.0, 0.02),
        TensorRole::RouterBias => (0.0, 0.05),
    }
}

impl WeightSource for SyntheticWeights {
    fn describe(&self) -> String {
        format!("synthetic weights (seed {})", self.seed)
    }

    /// Element i of rows `start_row..` is `offset + scale · normalish(key, start_row · cols + i)`,
    /// the key from the seed and the name, the scale from the tensor's role and fan-in.
    fn recipe(&self, name: &str, start_row: usize) -> Option<Recipe> {
        let spec = self.catalog.get(name)?;
        let cols: usize = spec.shape.iter().skip(1).product::<usize>().max(1);
        let (offset, scale) = scale_for(spec.role, cols);
        Some(Recipe {
            key: tensor_key(self.seed, name),
            first: (start_row * cols) as u64,
            offset,
            scale,
        })
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.catalog.get(name).map(|s| s.shape.clone())
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()> {
        let recipe = self
            .recipe(name, start_row)
            .ok_or_else(|| Error::invalid(format!("synthetic weights have no tensor {name}")))?;
        const CHUNK: usize = 1 << 16;
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                let base = (c * CHUNK) as u64;
                for (i, v) in chunk.iter_mut().enumerate() {
                    *v = recipe.value(base + i as u64);
                }
            });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_a_pure_function_of_seed_name_and_index() {
        let layout = Layout::resolve("glm5-tiny").unwrap();
        let a = SyntheticWeights::new(&layout, 7);
        let b = SyntheticWeights::new(&layout, 7);
        let name = "model.layers.1.self_attn.kv_b_proj.weight";
        let cols = a.shape(name).unwrap()[1];
        let mut whole = vec![0.0; 8 * cols];
        a.read_rows(name, 0, &mut whole).unwrap();
        let mut tail = vec![0.0; 3 * cols];
        b.read_rows(name, 5, &mut tail).unwrap();
        assert_eq!(
            &whole[5 * cols..],
            &tail[..],
            "rows fetched alone equal rows fetched together"
        );
        let c = SyntheticWeights::new(&layout, 8);
        let mut other = vec![0.0; 8 * cols];
        c.read_rows(name, 0, &mut other).unwrap();
        assert_ne!(whole, other, "another seed gives other weights");
    }

    #[test]
    fn generator_is_fixed_across_machines() {
        // Pinned values: a change here changes every synthetic model and every recorded session.
        let key = tensor_key(0, "model.embed_tokens.weight");
        assert_eq!(key, 0x22b2_aecc_ed89_bb86);
        let bits: Vec<u32> = (0..4).map(|i| normalish(key, i).to_bits()).collect();
        assert_eq!(bits, [0x3f0ac98f, 0x3e80dca4, 0x3f5d7e26, 0xbe39a08c]);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
    }

    #[test]
    fn normalish_has_unit_variance_and_zero_mean() {
        let key = tensor_key(3, "x");
        let n = 200_000u64;
        let (mut s, mut s2) = (0f64, 0f64);
        for i in 0..n {
            let v = normalish(key, i) as f64;
            s += v;
            s2 += v * v;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }

    #[test]
    fn scales_follow_the_role() {
        let layout = Layout::resolve("glm5-tiny").unwrap();
        let w = SyntheticWeights::new(&layout, 0);
        let read = |name: &str| {
            let shape = w.shape(name).unwrap();
            let mut v = vec![0.0; shape.iter().product()];
            w.read_rows(name, 0, &mut v).unwrap();
            v
        };
        let norm = read("model.layers.0.input_layernorm.weight");
        assert!(norm.iter().all(|v| (v - 1.0).abs() < 0.2));
        let bias = read("model.layers.1.mlp.gate.e_score_correction_bias");
        assert!(bias.iter().any(|v| *v != 0.0));
        let proj = read("model.layers.0.self_attn.q_a_proj.weight");
        let rms = (proj.iter().map(|v| v * v).sum::<f32>() / proj.len() as f32).sqrt();
        let expected = 1.0 / (layout.hidden_size as f32).sqrt();
        assert!(
            (rms / expected - 1.0).abs() < 0.05,
            "rms {rms} vs {expected}"
        );
    }
}
