//! What one decoded token costs one layer's attention on each MLA path: FLOPs, bytes read from
//! the KV cache, and the time a roofline (peak FLOP/s, bandwidth) gives for both, from which the
//! context where absorption starts to win is solved.
//!
//! The model, per decoded token and layer, at context T (cached tokens), with N heads, head dims
//! P (nope), R (rope), V (value), latent width L and `elem` bytes per cached value:
//! - both paths pay a fixed 2·N·L·(P+V) FLOPs that does not grow with T: naive decompresses the
//!   new token (W_UK and W_UV on its c_kv); absorbed folds W_UK into the query and applies W_UV
//!   to the latent output;
//! - naive, per cached token: 2·N·(P+R) for the score and 2·N·V for the weighted sum, reading
//!   the expanded per-head cache, N·(P+R+V)·elem bytes;
//! - absorbed, per cached token: 2·N·(L+R) for the score and 2·N·L for the weighted sum, reading
//!   the latent cache, (L+R)·elem bytes, the one row all heads share.
//!
//! Weights (kv_b_proj) are read once per step and shared by a batch: left out, as are the query
//! and the output, which do not grow with T.

/// The dims that set the cost: N, P, R, V, L, and bytes per cached value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub heads: u64,
    pub nope: u64,
    pub rope: u64,
    pub v: u64,
    pub latent: u64,
    pub elem: u64,
}

impl Dims {
    /// A layout's dims with a bf16 cache.
    pub fn of(layout: &crate::model::Layout) -> Dims {
        Dims {
            heads: layout.num_heads as u64,
            nope: layout.qk_nope_head_dim as u64,
            rope: layout.qk_rope_head_dim as u64,
            v: layout.v_head_dim as u64,
            latent: layout.kv_lora_rank as u64,
            elem: 2,
        }
    }

    /// FLOPs that do not depend on the context (the same on both paths).
    pub fn fixed_flops(&self) -> u64 {
        2 * self.heads * self.latent * (self.nope + self.v)
    }

    /// Per cached token: (naive FLOPs, naive bytes, absorbed FLOPs, absorbed bytes).
    pub fn per_token(&self) -> (u64, u64, u64, u64) {
        let Dims {
            heads: n,
            nope: p,
            rope: r,
            v,
            latent: l,
            elem,
        } = *self;
        (
            2 * n * (p + r + v),
            n * (p + r + v) * elem,
            2 * n * (l + r) + 2 * n * l,
            (l + r) * elem,
        )
    }

    /// Both paths at context `t`.
    pub fn at(&self, t: u64) -> (Cost, Cost) {
        let (nf, nb, af, ab) = self.per_token();
        let c = self.fixed_flops();
        (
            Cost {
                flops: c + nf * t,
                bytes: nb * t,
            },
            Cost {
                flops: c + af * t,
                bytes: ab * t,
            },
        )
    }

    /// The smallest context at which the absorbed path's roofline time is below the naive
    /// path's (`None` if that does not happen by 2^24 tokens).
    pub fn crossover(&self, gpu: &Gpu) -> Option<u64> {
        // Both times are piecewise linear in t and the naive one grows faster per token, so
        // once absorption wins it keeps winning: a binary search finds the first t.
        let wins = |t: u64| {
            let (naive, absorbed) = self.at(t);
            gpu.seconds(&absorbed) < gpu.seconds(&naive)
        };
        let mut hi = 1u64;
        while !wins(hi) {
            hi *= 2;
            if hi > 1 << 24 {
                return None;
            }
        }
        let mut lo = hi / 2; // does not win (or 0)
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if wins(mid) {
                hi = mid
            } else {
                lo = mid
            }
        }
        Some(hi)
    }
}

/// FLOPs and bytes read of one path for one decoded token in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    pub flops: u64,
    pub bytes: u64,
}

impl Cost {
    /// Arithmetic intensity, FLOP per byte read.
    pub fn intensity(&self) -> f64 {
        self.flops as f64 / self.bytes.max(1) as f64
    }
}

/// A roofline: peak dense FLOP/s and memory bandwidth in bytes/s.
#[derive(Debug, Clone, Copy)]
pub struct Gpu {
    pub name: &'static str,
    pub flops: f64,
    pub bandwidth: f64,
}

/// The H200's stated figures: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e.
pub const H200: Gpu = Gpu {
    name: "H200",
    flops: 989e12,
    bandwidth: 4.8e12,
};

impl Gpu {
    /// FLOP per byte at which a kernel stops being bound by memory.
    pub fn ridge(&self) -> f64 {
        self.flops / self.bandwidth
    }

    /// Roofline time: the slower of computing and reading.
    pub fn seconds(&self, c: &Cost) -> f64 {
        (c.flops as f64 / self.flops).max(c.bytes as f64 / self.bandwidth)
    }

    /// Whether the roofline says compute (rather than memory) sets the time.
    pub fn compute_bound(&self, c: &Cost) -> bool {
        c.intensity() >= self.ridge()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GLM5: Dims = Dims {
        heads: 64,
        nope: 192,
        rope: 64,
        v: 256,
        latent: 512,
        elem: 2,
    };
    const DSV3: Dims = Dims {
        heads: 128,
        nope: 128,
        rope: 64,
        v: 128,
        latent: 512,
        elem: 2,
    };

    #[test]
    fn dims_come_from_the_shipped_layouts() {
        let of = |name: &str| Dims::of(&crate::model::Layout::resolve(name).unwrap());
        assert_eq!(of("glm5"), GLM5);
        assert_eq!(of("deepseek-v3"), DSV3);
    }

    #[test]
    fn glm5_costs_computed_by_hand() {
        // Fixed: 2·64·512·(192+256) = 29 360 128.
        assert_eq!(GLM5.fixed_flops(), 29_360_128);
        // Per cached token: naive 2·64·512 = 65 536 FLOPs reading 64·512·2 = 65 536 B;
        // absorbed 2·64·576 + 2·64·512 = 139 264 FLOPs reading 576·2 = 1 152 B.
        assert_eq!(GLM5.per_token(), (65_536, 65_536, 139_264, 1_152));
        let (naive, absorbed) = GLM5.at(1024);
        assert_eq!(naive.flops, 29_360_128 + 67_108_864);
        assert_eq!(naive.bytes, 67_108_864);
        assert_eq!(absorbed.flops, 29_360_128 + 142_606_336);
        assert_eq!(absorbed.bytes, 1_179_648);
        // mla.md: about 120 FLOP/B for the absorbed decode at long contexts.
        let (_, long) = GLM5.at(131_072);
        assert!(
            (long.intensity() - 121.1).abs() < 0.1,
            "{}",
            long.intensity()
        );
    }

    #[test]
    fn deepseek_v3_costs_computed_by_hand() {
        // Fixed: 2·128·512·(128+128) = 33 554 432.
        assert_eq!(DSV3.fixed_flops(), 33_554_432);
        // Naive 2·128·320 = 81 920 FLOPs and 128·320·2 = 81 920 B per cached token;
        // absorbed 2·128·(576+512) = 278 528 FLOPs and 1 152 B.
        assert_eq!(DSV3.per_token(), (81_920, 81_920, 278_528, 1_152));
        let (naive, absorbed) = DSV3.at(1024);
        assert_eq!(naive.flops, 117_440_512);
        assert_eq!(absorbed.flops, 318_767_104);
        assert_eq!(absorbed.bytes, 1_179_648);
    }

    #[test]
    fn h200_ridge_and_crossovers() {
        assert!((H200.ridge() - 206.04).abs() < 0.01);
        // GLM-5 at T = 2: naive is compute-bound on the fixed part, 29 491 200 FLOPs, below
        // absorbed's 29 638 656; at T = 3 naive reads 196 608 B = 40.5 M FLOP-equivalents at the
        // ridge while absorbed computes 29 777 920 FLOPs: absorbed wins from 3 tokens.
        assert_eq!(GLM5.crossover(&H200), Some(3));
        // DeepSeek-V3 at T = 2: naive reads 163 840 B (33.76 M at the ridge) against absorbed's
        // 34 111 488 FLOPs; at T = 3 naive 50.6 M, absorbed 34.39 M.
        assert_eq!(DSV3.crossover(&H200), Some(3));
        // At long contexts both are memory-bound and the time ratio is the bytes ratio, 56.9×.
        let (naive, absorbed) = GLM5.at(131_072);
        assert!(!H200.compute_bound(&naive) && !H200.compute_bound(&absorbed));
        let ratio = H200.seconds(&naive) / H200.seconds(&absorbed);
        assert!((ratio - 65_536.0 / 1_152.0).abs() < 1e-9, "{ratio}");
    }

    #[test]
    fn no_crossover_when_absorbing_reads_as_much() {
        // One head with a latent as wide as K+V: absorption saves no bytes and costs FLOPs.
        let d = Dims {
            heads: 1,
            nope: 64,
            rope: 0,
            v: 64,
            latent: 128,
            elem: 2,
        };
        assert_eq!(d.crossover(&H200), None);
    }
}
