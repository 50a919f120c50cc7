//! KV caches, one set per decoder layer.
//!
//! * [`LatentCache`]: what MLA really stores, the normalised c_kv (kv_lora_rank) followed by the
//!   roped k_pe (qk_rope_head_dim) of every token: 576 values per token for GLM-5. Its slots are
//!   in fixed-size pages reached through a block table, like vLLM's paged cache and FlashMLA's,
//!   so that slot-mapping faults have a place to live; a device backend's mirror is laid out
//!   by those pages.
//! * [`ExpandedCache`]: per-head K (qk_nope + qk_rope) and V (v_head_dim) of every token, what the
//!   MLA-disabled (naive) path attends over in decode. Filled from the latent cache on demand.
//! * [`IndexKeyCache`]: the DSA indexer's keys.

use crate::error::{Error, Result};
use crate::ops::rows::MirrorSlot;
use crate::ops::{Fp8Faults, KvCacheDtype};
use crate::tensor::{checked_numel, BufferId, Tensor};

pub use crate::ops::rows::{RowSource, PAGE_SIZE};

/// One layer's paged latent cache. Rows are kept as the tensors they were written in (a device
/// backend's stay on the device, and its mirror is filled from them by device copies); a row
/// comes to the host only when something reads it there. The pages are the slot mapping's: the
/// block table places each slot's row in the device mirror, as vLLM's and FlashMLA's paged caches
/// do, so that slot-mapping faults have a place to live.
#[derive(Debug)]
pub struct LatentCache {
    width: usize,
    /// Slots nothing wrote hold the poison pattern (else zeros).
    poison: bool,
    /// What a slot nothing wrote reads as.
    unwritten: Vec<f32>,
    /// Logical page i of the sequence lives in physical page block_table[i].
    block_table: Vec<usize>,
    /// The written tensors, in order.
    chunks: Vec<Tensor>,
    /// Per slot, the chunk and row last written to it.
    slots: Vec<Option<(usize, usize)>>,
    len: usize,
    id: BufferId,
    writes: Vec<usize>,
    mirror: MirrorSlot,
    dtype: KvCacheDtype,
    /// fp8_ds_mla: per physical page, each slot's row before the round trip and the codec
    /// faults it was written with (what a device's write kernel quantizes).
    fp8_pages: Vec<(Vec<f32>, Vec<Fp8Faults>)>,
}

impl LatentCache {
    pub fn new(width: usize, poison: bool) -> LatentCache {
        LatentCache::with_dtype(width, poison, KvCacheDtype::Bf16)
    }

    /// A cache whose rows are stored as `dtype` (fp8_ds_mla: written by
    /// [`LatentCache::push_fp8_rows`]).
    pub fn with_dtype(width: usize, poison: bool, dtype: KvCacheDtype) -> LatentCache {
        LatentCache {
            width,
            poison,
            unwritten: vec![unwritten_value(poison); width],
            block_table: Vec::new(),
            chunks: Vec::new(),
            slots: Vec::new(),
            len: 0,
            id: BufferId::fresh_cache(),
            writes: Vec::new(),
            mirror: MirrorSlot::default(),
            dtype,
            fp8_pages: Vec::new(),
        }
    }

    pub fn id(&self) -> BufferId {
        self.id
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// Appends one token's row (c_kv | k_pe) at its own slot.
    pub fn push(&mut self, row: &[f32]) -> Result<()> {
        self.push_at(row, self.len)
    }

    /// Appends one token, writing its row to `slot` (≤ the new token's position). The slot
    /// mapping is the caller's: a wrong one leaves the token's own slot unwritten.
    pub fn push_at(&mut self, row: &[f32], slot: usize) -> Result<()> {
        assert_eq!(row.len(), self.width, "latent row of the wrong width");
        let row = Tensor::from_vec(&[1, self.width], row.to_vec());
        self.push_rows_at(row, &[slot])
    }

    /// Appends one token per row of `rows` ([n, width]), row i written to `slots[i]` (each ≤
    /// its token's position), without reading them.
    pub fn push_rows_at(&mut self, rows: Tensor, slots: &[usize]) -> Result<()> {
        self.append(rows, None, slots)
    }

    /// Appends tokens to an fp8_ds_mla cache: `stored` (the rows after the format's round trip,
    /// what attention reads) at `slots`, keeping `written` (the rows before it) and the codec
    /// faults of the write.
    pub fn push_fp8_rows(
        &mut self,
        stored: Tensor,
        written: &Tensor,
        faults: Fp8Faults,
        slots: &[usize],
    ) -> Result<()> {
        assert_eq!(written.shape(), stored.shape(), "fp8 rows of another shape");
        self.append(stored, Some((written, faults)), slots)
    }

    fn append(
        &mut self,
        rows: Tensor,
        fp8: Option<(&Tensor, Fp8Faults)>,
        slots: &[usize],
    ) -> Result<()> {
        assert_eq!(
            rows.numel(),
            slots.len() * self.width,
            "latent rows of the wrong width or count"
        );
        assert_eq!(
            fp8.is_some(),
            self.dtype == KvCacheDtype::Fp8DsMla,
            "a latent row written past its cache's format"
        );
        if slots.is_empty() {
            return Ok(());
        }
        let w = self.width;
        let chunk = self.chunks.len();
        for (r, &slot) in slots.iter().enumerate() {
            assert!(
                slot <= self.len,
                "slot {slot} past the token being appended"
            );
            if self.len.is_multiple_of(PAGE_SIZE) {
                checked_numel(&[PAGE_SIZE, w], "latent cache page")?;
                self.block_table.push(self.block_table.len());
                if fp8.is_some() {
                    let fill = unwritten_value(self.poison);
                    let faults = vec![Fp8Faults::default(); PAGE_SIZE];
                    self.fp8_pages.push((vec![fill; PAGE_SIZE * w], faults));
                }
            }
            self.len += 1;
            self.slots.push(None);
            self.slots[slot] = Some((chunk, r));
            if let Some((written, faults)) = fp8 {
                let (page_rows, slot_faults) =
                    &mut self.fp8_pages[self.block_table[slot / PAGE_SIZE]];
                let at = slot % PAGE_SIZE * w;
                page_rows[at..at + w].copy_from_slice(written.row(r));
                slot_faults[slot % PAGE_SIZE] = faults;
            }
            self.writes.push(slot);
        }
        self.chunks.push(rows.reshaped(&[slots.len(), w]));
        Ok(())
    }

    /// Address of the first rows written (0 while empty): on the device where they live there,
    /// else on the host; the cache's "device pointer".
    pub fn address(&self) -> u64 {
        self.chunks.first().map_or(0, |t| match t.device() {
            Some(d) => d.address(),
            None => t.data().as_ptr() as u64,
        })
    }

    /// Bytes held (whole pages).
    pub fn bytes(&self) -> usize {
        self.block_table.len() * PAGE_SIZE * self.width * 4
    }

    /// The block table: logical page → physical page.
    pub fn block_table(&self) -> &[usize] {
        &self.block_table
    }
}

/// The value of a cache slot nothing wrote.
fn unwritten_value(poison: bool) -> f32 {
    if poison {
        f32::from_bits(crate::tensor::POISON_BITS)
    } else {
        0.0
    }
}

impl RowSource for LatentCache {
    fn len(&self) -> usize {
        self.len
    }

    fn id(&self) -> BufferId {
        self.id
    }

    fn width(&self) -> usize {
        self.width
    }

    fn writes(&self) -> &[usize] {
        &self.writes
    }

    fn block_table(&self) -> Option<&[usize]> {
        Some(&self.block_table)
    }

    fn poisoned(&self) -> bool {
        self.poison
    }

    fn mirror(&self) -> &MirrorSlot {
        &self.mirror
    }

    fn row(&self, t: usize) -> &[f32] {
        match self.pushed_rows(t) {
            Some((tensor, r)) => tensor.row(r),
            None => &self.unwritten,
        }
    }

    fn pushed_rows(&self, t: usize) -> Option<(&Tensor, usize)> {
        assert!(t < self.len, "latent cache read past its end");
        let (chunk, r) = self.slots[t]?;
        Some((&self.chunks[chunk], r))
    }

    fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    fn fp8_written(&self, t: usize) -> Option<(&[f32], Fp8Faults)> {
        assert!(t < self.len, "latent cache read past its end");
        let (rows, faults) = self.fp8_pages.get(self.block_table[t / PAGE_SIZE])?;
        let slot = t % PAGE_SIZE;
        Some((
            &rows[slot * self.width..(slot + 1) * self.width],
            faults[slot],
        ))
    }
}

/// A growable cache of fixed-width rows, one per token. Rows are kept as the tensors they came
/// in (a device backend's outputs stay on the device): a device mirror is filled from them by
/// device copies, and a row comes to the host only when something reads it there.
#[derive(Debug)]
pub struct RowCache {
    width: usize,
    /// The pushed tensors in order, with the first row of each.
    chunks: Vec<(usize, Tensor)>,
    len: usize,
    id: BufferId,
    writes: Vec<usize>,
    mirror: MirrorSlot,
}

impl RowCache {
    pub fn new(width: usize) -> RowCache {
        RowCache {
            width,
            chunks: Vec::new(),
            len: 0,
            id: BufferId::fresh_cache(),
            writes: Vec::new(),
            mirror: MirrorSlot::default(),
        }
    }

    pub fn id(&self) -> BufferId {
        self.id
    }

    /// Appends one token's row.
    pub fn push(&mut self, row: &[f32]) -> Result<()> {
        assert_eq!(row.len(), self.width, "cache row of the wrong width");
        self.push_rows(Tensor::from_vec(&[1, self.width], row.to_vec()))
    }

    /// Appends the rows of `rows` (whole rows of this cache's width, one token each), without
    /// reading them.
    pub fn push_rows(&mut self, rows: Tensor) -> Result<()> {
        if self.width == 0 || !rows.numel().is_multiple_of(self.width) {
            return Err(Error::invalid(format!(
                "cache rows of shape {:?} for a cache of width {}",
                rows.shape(),
                self.width
            )));
        }
        let n = rows.numel() / self.width;
        if n == 0 {
            return Ok(());
        }
        let new_len = self.len + n;
        if new_len.saturating_mul(self.width).saturating_mul(4) > crate::tensor::MAX_TENSOR_BYTES {
            return Err(Error::Allocation {
                what: "KV cache".into(),
                detail: format!("{new_len} tokens of width {}", self.width),
            });
        }
        self.writes.extend(self.len..new_len);
        self.chunks
            .push((self.len, rows.reshaped(&[n, self.width])));
        self.len = new_len;
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        self.len * self.width * 4
    }

    /// Address of the first rows: on the device where they live there, else on the host.
    pub fn address(&self) -> u64 {
        self.chunks.first().map_or(0, |(_, t)| match t.device() {
            Some(d) => d.address(),
            None => t.data().as_ptr() as u64,
        })
    }

    /// The chunk holding row `t` and the row's index in it.
    fn chunk_of(&self, t: usize) -> (&Tensor, usize) {
        assert!(t < self.len, "cache read past its end");
        let c = self.chunks.partition_point(|(start, _)| *start <= t) - 1;
        let (start, tensor) = &self.chunks[c];
        (tensor, t - start)
    }
}

impl RowSource for RowCache {
    fn len(&self) -> usize {
        self.len
    }

    fn id(&self) -> BufferId {
        self.id
    }

    fn width(&self) -> usize {
        self.width
    }

    fn writes(&self) -> &[usize] {
        &self.writes
    }

    fn row(&self, t: usize) -> &[f32] {
        let (tensor, r) = self.chunk_of(t);
        tensor.row(r)
    }

    fn pushed_rows(&self, t: usize) -> Option<(&Tensor, usize)> {
        Some(self.chunk_of(t))
    }

    fn mirror(&self) -> &MirrorSlot {
        &self.mirror
    }
}

/// Per-head K and V rows of every token: K rows are heads × (qk_nope + qk_rope), V rows heads × v.
/// One logical buffer for the trace (one id), stored as two row caches.
#[derive(Debug)]
pub struct ExpandedCache {
    pub k: RowCache,
    pub v: RowCache,
    id: BufferId,
}

impl ExpandedCache {
    pub fn new(k_width: usize, v_width: usize) -> ExpandedCache {
        ExpandedCache {
            k: RowCache::new(k_width),
            v: RowCache::new(v_width),
            id: BufferId::fresh_cache(),
        }
    }

    pub fn id(&self) -> BufferId {
        self.id
    }

    pub fn len(&self) -> usize {
        self.k.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }

    /// Address of the K rows.
    pub fn address(&self) -> u64 {
        self.k.address()
    }
}

/// All caches of one layer.
#[derive(Debug)]
pub struct LayerCache {
    pub latent: LatentCache,
    /// Created the first time the naive path needs it.
    pub expanded: Option<ExpandedCache>,
    /// DSA indexer keys (layers with their own indexer).
    pub index_keys: Option<RowCache>,
    /// A quantized kv_b_proj as a plain weight, made once per run (through the identity matrix,
    /// or force-dequantized).
    pub kv_b_plain: Option<std::sync::Arc<crate::tensor::Tensor>>,
}

impl LayerCache {
    pub fn bytes(&self) -> usize {
        self.latent.bytes()
            + self
                .expanded
                .as_ref()
                .map_or(0, |e| e.k.bytes() + e.v.bytes())
            + self.index_keys.as_ref().map_or(0, RowCache::bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_cache_keeps_pushed_tensors_and_reads_rows_across_them() {
        use crate::tensor::test_device::FakeDevice;
        use std::sync::atomic::Ordering;
        let mut c = RowCache::new(2);
        c.push(&[0.0, 0.5]).unwrap();
        let d = FakeDevice::holding(&[1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
        // Rows of a device output, pushed whole ([3, 2] seen as rows of width 2).
        c.push_rows(Tensor::from_device(&[6], d.clone())).unwrap();
        c.push(&[4.0, 4.5]).unwrap();
        assert_eq!(
            (c.len(), c.writes(), c.bytes()),
            (5, &[0, 1, 2, 3, 4][..], 40)
        );
        assert_eq!(d.downloads.load(Ordering::Relaxed), 0, "nothing read yet");
        let (t, r) = c.pushed_rows(3).unwrap();
        assert_eq!((t.shape(), r), (&[3, 2][..], 2));
        for (t, want) in [
            (0, [0.0, 0.5]),
            (1, [1.0, 1.5]),
            (3, [3.0, 3.5]),
            (4, [4.0, 4.5]),
        ] {
            assert_eq!(c.row(t), want);
        }
        assert_eq!(
            d.downloads.load(Ordering::Relaxed),
            1,
            "read once, when read"
        );
        assert!(c.push_rows(Tensor::from_vec(&[3], vec![0.0; 3])).is_err());
        c.push_rows(Tensor::from_vec(&[0, 2], Vec::new())).unwrap();
        assert_eq!(c.len(), 5);
    }

    #[test]
    fn a_latent_cache_keeps_written_tensors_and_reads_them_only_when_asked() {
        use crate::tensor::test_device::FakeDevice;
        use std::sync::atomic::Ordering;
        let mut c = LatentCache::new(2, true);
        c.push(&[0.0, 0.5]).unwrap();
        // Three rows of a device output: the first two at their own slots, the third one slot
        // early (it overwrites slot 2 and leaves slot 3 unwritten).
        let d = FakeDevice::holding(&[1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
        c.push_rows_at(Tensor::from_device(&[3, 2], d.clone()), &[1, 2, 2])
            .unwrap();
        assert_eq!((c.len(), c.writes()), (4, &[0, 1, 2, 2][..]));
        assert_eq!(d.downloads.load(Ordering::Relaxed), 0, "nothing read yet");
        let (t, r) = c.pushed_rows(2).unwrap();
        assert_eq!((t.shape(), r), (&[3, 2][..], 2), "the slot's last write");
        assert!(c.pushed_rows(3).is_none(), "an unwritten slot");
        assert_eq!(c.row(0), &[0.0, 0.5]);
        assert_eq!(c.row(1), &[1.0, 1.5]);
        assert_eq!(c.row(2), &[3.0, 3.5]);
        assert_eq!(c.row(3)[1].to_bits(), crate::tensor::POISON_BITS);
        assert_eq!(d.downloads.load(Ordering::Relaxed), 1, "read once");
        assert_eq!((c.block_table(), c.bytes()), (&[0][..], PAGE_SIZE * 2 * 4));
    }

    #[test]
    fn paged_rows_read_back_across_page_boundaries() {
        let mut c = LatentCache::new(3, false);
        for t in 0..(PAGE_SIZE * 2 + 5) {
            c.push(&[t as f32, -(t as f32), 0.5]).unwrap();
        }
        assert_eq!(c.len(), PAGE_SIZE * 2 + 5);
        assert_eq!(c.block_table(), &[0, 1, 2]);
        for t in [0, PAGE_SIZE - 1, PAGE_SIZE, 2 * PAGE_SIZE + 4] {
            assert_eq!(c.row(t), &[t as f32, -(t as f32), 0.5]);
        }
        // A token written one slot early leaves its own slot holding the poison pattern.
        let mut c = LatentCache::new(2, true);
        c.push(&[1.0, 1.0]).unwrap();
        c.push_at(&[2.0, 2.0], 0).unwrap();
        assert_eq!(c.row(0), &[2.0, 2.0]);
        assert_eq!(c.row(1)[0].to_bits(), crate::tensor::POISON_BITS);
    }
}
