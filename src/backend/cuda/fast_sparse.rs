//! The sparse MLA decode (kernels/mla_decode*.cu, `mla_sparse_*`): each query attends to its own
//! list of keys, the DSA indexer's top-k of GLM-5, over the same paged latent cache as the dense
//! decode. The lists are rows of one [batch, topk] i32 array (token positions, -1 padding) with
//! a length per row; the splits divide the lists and the dense merge joins them. Re-exported by
//! [`super::fast`].

use super::device::fast_kernels::SparseKeys;
use super::device::{variants, DevBuf, DevI32, Gpu};
use super::fast::{decode_launches, runs_on, DecodeQuery, DecodeShape, DecodeWork};
use crate::error::{Error, Result};
use crate::ops::KernelLaunch;

/// The sparse kernel for up to 8 heads a block (sm_90 on; kernels/mla_sparse_h8.cu: rows
/// gathered by bulk copies, the heads as the MMAs' columns), the first choice up to 8 heads.
const EIGHT_HEADS: &str = "mla_sparse_h8";

/// The sparse variants, in order of preference, with their shared bytes (kernels/variants.cuh:
/// the 64-head ones their dense twins' layouts and the row lookups). `mla_sparse_wgmma` (Hopper)
/// gathers its tiles by cp.async into the layout TMA gives its twin; the split-k kernels fed by
/// TMA (kt3, kt16) have no sparse twin.
fn sparse_variants() -> [(&'static str, u32); 6] {
    [
        EIGHT_HEADS,
        "mla_sparse_wgmma",
        "mla_sparse_ks3",
        "mla_sparse_ks2",
        "mla_sparse_t32",
        "mla_sparse_t16",
    ]
    .map(|kernel| (kernel, variants::shared_bytes(kernel)))
}

/// The sparse decode variants this device runs, in order of preference.
pub fn sparse_decode_variants_for(gpu: &Gpu) -> Vec<&'static str> {
    sparse_variants()
        .into_iter()
        .filter(|&(name, bytes)| runs_on(gpu, name, bytes))
        .map(|(name, _)| name)
        .collect()
}

/// The sparse kernel for a decode variant's name (a dense one with a twin, or a sparse one):
/// `--decode-variant ks3` runs `mla_sparse_ks3` on a sparse selection. `None` for kt3 and kt16.
pub fn sparse_twin(kernel: &str) -> Option<&'static str> {
    let tag = kernel
        .strip_prefix("mla_decode_")
        .or_else(|| kernel.strip_prefix("mla_sparse_"))?;
    // `--decode-variant h8` names the 8-head family (mla_decode_fp8_h8 is its dense form).
    let tag = tag.strip_prefix("fp8_").unwrap_or(tag);
    sparse_variants()
        .into_iter()
        .map(|(name, _)| name)
        .find(|name| name.strip_prefix("mla_sparse_") == Some(tag))
}

impl DecodeWork {
    /// The plan of a sparse decode: the variant `forced` (see [`sparse_twin`]) or the device's
    /// first, `splits` or the count chosen for the shape (`max_len`: the longest list).
    pub fn sparse(
        gpu: &Gpu,
        shape: DecodeShape,
        splits: Option<usize>,
        forced: Option<&str>,
    ) -> Result<DecodeWork> {
        let forced = match forced {
            Some(f) => Some(sparse_twin(f).ok_or_else(|| {
                Error::invalid(format!(
                    "{f} has no sparse twin (the sparse kernels: {})",
                    sparse_variants().map(|v| v.0).join(", ")
                ))
            })?),
            None => None,
        };
        DecodeWork::pick(gpu, shape, sparse_variants().to_vec(), forced, splits)
    }
}

/// Sparse absorbed MLA decode: as [`super::fast::mla_decode`], but sequence b attends to the
/// keys `indices[b, 0..lens[b]]` ([batch, topk] i32 token positions, -1 padding, mapped to cache
/// rows through row b of `block_table`), `lens` [batch] at most topk. A list of padding alone
/// gives zeros and an LSE of -inf. `work` must come from [`DecodeWork::sparse`].
#[allow(clippy::too_many_arguments)]
pub fn mla_decode_sparse(
    gpu: &Gpu,
    shape: DecodeShape,
    q: &DevBuf,
    cache: &DevBuf,
    block_table: &DevI32,
    (indices, topk): (&DevI32, usize),
    lens: &DevI32,
    scale: f32,
    out: &DevBuf,
    lse: &DevBuf,
    work: &DecodeWork,
) -> Result<Vec<KernelLaunch>> {
    let keys = SparseKeys { indices, topk };
    decode_launches(
        gpu,
        shape,
        DecodeQuery::Joined(q),
        cache,
        block_table,
        lens,
        Some(keys),
        scale,
        out,
        lse,
        work,
    )
}

/// Key lists as the sparse kernels take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLists {
    /// [lists, topk] positions, each list padded with -1 after its length.
    pub indices: Vec<i32>,
    /// The row length: the longest list (at least 1, so that no buffer is empty).
    pub topk: usize,
    /// [lists] lengths.
    pub lens: Vec<i32>,
}

impl KeyLists {
    /// The lists followed by `empty` lists of no keys (all -1): a padded batch's rows.
    pub fn padded(mut self, empty: usize) -> KeyLists {
        self.indices
            .resize(self.indices.len() + empty * self.topk, -1);
        self.lens.resize(self.lens.len() + empty, 0);
        self
    }
}

/// Each query's selected key positions as one padded [n, topk] array with its lengths.
pub fn key_lists(selected: &[Vec<usize>]) -> Result<KeyLists> {
    let topk = selected.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let as_i32 = |v: usize| {
        i32::try_from(v).map_err(|_| Error::invalid(format!("key position {v} past i32")))
    };
    let mut indices = Vec::with_capacity(selected.len() * topk);
    let mut lens = Vec::with_capacity(selected.len());
    for keys in selected {
        for &k in keys {
            indices.push(as_i32(k)?);
        }
        indices.resize(indices.len() + topk - keys.len(), -1);
        lens.push(as_i32(keys.len())?);
    }
    Ok(KeyLists {
        indices,
        topk,
        lens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_lists_pad_each_list_to_the_longest() {
        let lists = key_lists(&[vec![0, 3, 9], vec![], vec![5]]).unwrap();
        assert_eq!(lists.topk, 3);
        assert_eq!(lists.indices, [0, 3, 9, -1, -1, -1, 5, -1, -1]);
        assert_eq!(lists.lens, [3, 0, 1]);
        let padded = lists.padded(1);
        assert_eq!(padded.indices[9..], [-1, -1, -1]);
        assert_eq!((padded.topk, padded.lens), (3, vec![3, 0, 1, 0]));
        let none = key_lists(&[vec![], vec![]]).unwrap();
        assert_eq!(
            (none.topk, none.indices, none.lens),
            (1, vec![-1, -1], vec![0, 0])
        );
        assert!(key_lists(&[vec![1 << 40]]).is_err());
    }

    #[test]
    fn dense_names_map_to_their_sparse_twins() {
        assert_eq!(sparse_twin("mla_decode_ks3"), Some("mla_sparse_ks3"));
        assert_eq!(sparse_twin("mla_decode_t16"), Some("mla_sparse_t16"));
        assert_eq!(sparse_twin("mla_sparse_ks2"), Some("mla_sparse_ks2"));
        assert_eq!(sparse_twin("mla_decode_kt3"), None);
        assert_eq!(sparse_twin("mla_decode_wgmma"), Some("mla_sparse_wgmma"));
        assert_eq!(sparse_twin("mla_decode_kt16"), None);
        assert_eq!(sparse_twin("ks3"), None);
    }

    #[test]
    fn sparse_variants_are_described_and_fit_hopper() {
        for (name, bytes) in sparse_variants() {
            assert_ne!(bytes, u32::MAX, "{name} has no row in kernels/variants.cuh");
            // The 64-head ones: their twin's layout and the ring, more than the twin, never
            // another layout. (The 8-head kernel has no dense twin.)
            if name != EIGHT_HEADS {
                let dense = name.replace("mla_sparse_", "mla_decode_");
                assert!(bytes > variants::shared_bytes(&dense), "{name}");
            }
            // The largest still fits Hopper's and B200's 227 KB per block.
            assert!(bytes <= 232_448, "{name}: {bytes}");
        }
        // The 8-head kernel fits sm_120's 99 KB, and `--decode-variant h8` names it.
        assert!(variants::shared_bytes(EIGHT_HEADS) <= 101_376);
        assert_eq!(sparse_twin("mla_decode_fp8_h8"), Some(EIGHT_HEADS));
        assert_eq!(sparse_twin("mla_decode_fp8_h16"), None);
        // Its block is four compute warps and the producer warp (the kernel traps otherwise).
        use crate::backend::cuda::device::fast_kernels::decode_block;
        assert_eq!(decode_block(EIGHT_HEADS), (8, 160));
        // So is the sparse FP8 8-head kernel's; its dense form keeps four warps.
        assert_eq!(decode_block("mla_sparse_fp8_h8"), (8, 160));
        assert_eq!(decode_block("mla_decode_fp8_h8"), (8, 128));
    }
}
