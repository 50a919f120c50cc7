//! The device copy of an fp8_ds_mla latent cache: a paged byte cache (656 bytes a slot) that the
//! write kernel (kernels/kv_fp8.cu) fills from the rows the engine wrote, and the FP8-cache
//! decode reads.
//!
//! The host cache holds each row after the format's round trip (what every attention reads) and,
//! beside it, the row as it was written with the codec faults of the write. The write kernel
//! quantizes the latter, which gives exactly the bytes the CPU codec gave. Quantizing the
//! round-tripped row again would not: its largest value is 448 × scale rounded to f32, and
//! that over 448 is not always the scale back (about one scale in ten is off by an ulp), so the
//! decoded values would sit an ulp away and occasionally round to another bf16.

use super::attention::{count_mirror, take_mirrors, uncount_mirror, Mirror};
use super::device::{DevBytes, Elem};
use super::CudaBackend;
use crate::error::{Error, Result};
use crate::ops::kv_fp8::TOKEN_BYTES;
use crate::ops::{RowSource, PAGE_SIZE};

/// The byte cache of one fp8_ds_mla latent cache, kept in step with the host cache's writes.
pub(super) struct Fp8Mirror {
    backend: u64,
    bytes: DevBytes,
    /// Slots the buffer holds.
    slots: usize,
    /// Writes of the host cache already applied.
    applied: usize,
}

impl Fp8Mirror {
    fn new(backend: u64, bytes: DevBytes, slots: usize) -> Fp8Mirror {
        count_mirror(bytes.bytes());
        Fp8Mirror {
            backend,
            bytes,
            slots,
            applied: 0,
        }
    }
}

impl Drop for Fp8Mirror {
    fn drop(&mut self) {
        uncount_mirror(self.bytes.bytes());
    }
}

/// The byte cache in a slot that [`CudaBackend::sync_fp8_cache`] brought up to date.
pub(super) fn fp8_bytes<'a>(slot: &'a Mirror) -> &'a DevBytes {
    &slot
        .as_ref()
        .and_then(|m| m.downcast_ref::<super::attention::Mirrors>())
        .and_then(|m| m.fp8.as_ref())
        .expect("sync_fp8_cache leaves a byte cache")
        .bytes
}

impl CudaBackend {
    /// Brings the byte cache of an fp8_ds_mla cache up to date, quantizing the rows written
    /// since the last call at their physical slots, and returns its slot, locked. A byte cache
    /// that must grow is made anew and every write replayed (quantizing is deterministic).
    pub(super) fn sync_fp8_cache<'a>(&self, src: &'a dyn RowSource) -> Result<Mirror<'a>> {
        let Some(table) = src.block_table() else {
            return Err(Error::invalid("an fp8_ds_mla cache without pages"));
        };
        let needed = (table.iter().max().map_or(0, |m| m + 1) * PAGE_SIZE).max(PAGE_SIZE);
        let physical = |s: usize| table[s / PAGE_SIZE] * PAGE_SIZE + s % PAGE_SIZE;
        let mut slot = src.mirror().lock();
        let mut mirrors = take_mirrors(&mut slot);
        let old = mirrors.fp8.take().filter(|m| m.backend == self.id);
        let mut mirror = match old {
            Some(m) if m.slots >= needed => m,
            old => {
                let slots = needed.max(old.as_ref().map_or(0, |m| m.slots * 2));
                let bytes = self.gpu.alloc_vec::<u8>(slots * TOKEN_BYTES)?;
                // Unwritten slots decode as NaN when poisoned (0xFF: E4M3 NaN, NaN scales and
                // bf16 NaN), as zeros otherwise.
                let fill = if src.poisoned() { 0xFF } else { 0 };
                self.gpu.fill_bytes(&bytes, fill)?;
                Fp8Mirror::new(self.id, bytes, slots)
            }
        };
        // Each slot written since: its row as written now (a slot written twice holds the later
        // row), grouped by the codec faults its write carried.
        let mut fresh: Vec<usize> = src.writes()[mirror.applied..].to_vec();
        fresh.sort_unstable();
        fresh.dedup();
        let mut groups: Vec<(u32, Vec<f32>, Vec<i32>)> = Vec::new();
        for t in fresh {
            let (row, faults) = src
                .fp8_written(t)
                .ok_or_else(|| Error::invalid("the latent cache holds no fp8_ds_mla rows"))?;
            let at = match groups.iter().position(|g| g.0 == faults.bits()) {
                Some(i) => i,
                None => {
                    groups.push((faults.bits(), Vec::new(), Vec::new()));
                    groups.len() - 1
                }
            };
            groups[at].1.extend_from_slice(row);
            groups[at].2.push(physical(t) as i32);
        }
        for (faults, rows, slots) in groups {
            let staged = self.gpu.upload(&rows, Elem::F32)?;
            let slots_dev = self.gpu.upload_i32(&slots)?;
            self.gpu
                .kv_fp8_write(&staged, &slots_dev, &mirror.bytes, slots.len(), faults)?;
        }
        mirror.applied = src.writes().len();
        mirrors.fp8 = Some(mirror);
        *slot = Some(Box::new(mirrors));
        Ok(slot)
    }
}
