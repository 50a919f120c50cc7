//! Typed device buffers and the copies between host and device.
//!
//! [`DevBuf`] holds values of the backend's storage type (f32 or bf16, chosen at run time, as the
//! kernel-name suffix is); [`DevVec`] holds plain i32, byte or f64 values. An i32 buffer uploaded
//! from the host remembers the range of its values, so that a launcher can check indices the
//! kernel will read from it (block tables, row lists) before the launch. Fields are private: a
//! buffer's pointer reaches a kernel only through a typed launcher.

use super::free_list::Block;
use super::{Allocation, Gpu};
use crate::backend::DriverCall;
use crate::error::{CudaError, Error, Result};
use crate::tensor::{DeviceBuffer, POISON_BITS};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use std::any::Any;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How values are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }

    /// The kernel-name suffix of this storage type.
    pub fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
        }
    }

    /// The storage type a kernel name's suffix (`_f32`, `_bf16`) stands for.
    pub fn of_kernel(name: &str) -> Option<Elem> {
        if name.ends_with("_bf16") {
            Some(Elem::Bf16)
        } else if name.ends_with("_f32") {
            Some(Elem::F32)
        } else {
            None
        }
    }
}

/// bf16 bits of the poison pattern (its high half), and the f32 pattern it stands for on the host.
pub(super) const POISON_BF16: u16 = (POISON_BITS >> 16) as u16;

fn to_bf16(v: f32) -> u16 {
    if v.to_bits() == POISON_BITS {
        return POISON_BF16;
    }
    half::bf16::from_f32(v).to_bits()
}

fn from_bf16(b: u16) -> f32 {
    if b == POISON_BF16 {
        return f32::from_bits(POISON_BITS);
    }
    half::bf16::from_bits(b).to_f32()
}

/// One device allocation of storage values (f32 or bf16). The registry numbers every allocation.
pub struct DevBuf {
    slice: Block,
    ptr: u64,
    elem: Elem,
    /// Elements (of `elem`), not bytes.
    len: usize,
    serial: u64,
}

impl DevBuf {
    pub fn elem(&self) -> Elem {
        self.elem
    }

    /// Elements, not bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// The CUDA ordinal of the device it lives on.
    pub fn ordinal(&self) -> usize {
        self.slice.ordinal()
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl DeviceBuffer for DevBuf {
    fn address(&self) -> u64 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.len * self.elem.size()
    }
    fn device_index(&self) -> usize {
        self.ordinal()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    /// On the stream the buffer was made on (the backend's one stream), after its kernels.
    fn download(&self) -> Result<Vec<f32>> {
        let bytes = read_bytes(self.slice.stream(), &self.slice, 0, self.bytes())?;
        Ok(values_of(self.elem, &bytes))
    }
    fn download_range(&self, from: usize, len: usize) -> Result<Vec<f32>> {
        if from.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid("device read past the end of a buffer"));
        }
        let s = self.elem.size();
        let bytes = read_bytes(self.slice.stream(), &self.slice, from * s, len * s)?;
        Ok(values_of(self.elem, &bytes))
    }
}

/// `len` bytes from byte `from` of `slice`, once `stream` has done its work (so a kernel's
/// error surfaces here).
fn read_bytes(
    stream: &Arc<CudaStream>,
    slice: &CudaSlice<u8>,
    from: usize,
    len: usize,
) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    super::ledger::LEDGER.time(DriverCall::Download, || {
        if len > 0 {
            let view = slice.slice(from..from + len);
            stream
                .memcpy_dtoh(&view, &mut out)
                .map_err(CudaError::driver("download"))?;
        }
        stream.synchronize().map_err(CudaError::driver("kernel"))
    })?;
    Ok(out)
}

/// Storage values (little-endian bytes) as f32; bf16 poison reads as the f32 poison.
fn values_of(elem: Elem, bytes: &[u8]) -> Vec<f32> {
    match elem {
        Elem::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Elem::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| from_bf16(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
    }
}

/// A plain value type a [`DevVec`] holds.
pub trait Plain: Copy {
    const SIZE: usize;
    fn from_le(bytes: &[u8]) -> Self;
    fn to_le(self, out: &mut Vec<u8>);
    /// The value as an index, for the range of an uploaded buffer (none for non-integers).
    fn as_index(self) -> Option<i64>;
}

impl Plain for i32 {
    const SIZE: usize = 4;
    fn from_le(b: &[u8]) -> i32 {
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes())
    }
    fn as_index(self) -> Option<i64> {
        Some(self as i64)
    }
}

impl Plain for u8 {
    const SIZE: usize = 1;
    fn from_le(b: &[u8]) -> u8 {
        b[0]
    }
    fn to_le(self, out: &mut Vec<u8>) {
        out.push(self)
    }
    fn as_index(self) -> Option<i64> {
        Some(self as i64)
    }
}

impl Plain for f64 {
    const SIZE: usize = 8;
    fn from_le(b: &[u8]) -> f64 {
        f64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
    }
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes())
    }
    fn as_index(self) -> Option<i64> {
        None
    }
}

/// A device buffer of plain values of type `T`.
pub struct DevVec<T: Plain> {
    slice: Block,
    ptr: u64,
    len: usize,
    serial: u64,
    /// The smallest and largest value, when the host wrote every value (uploads); `None` for a
    /// buffer a kernel writes.
    range: Option<(i64, i64)>,
    _values: PhantomData<T>,
}

/// Positions, indices, block tables.
pub type DevI32 = DevVec<i32>;
/// Masks, quantized blocks, flags.
pub type DevBytes = DevVec<u8>;
/// The statistics kernels' partial sums.
pub type DevF64 = DevVec<f64>;

impl<T: Plain> DevVec<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// The device address, for the trace.
    pub fn address(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.len * T::SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn serial(&self) -> u64 {
        self.serial
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// This buffer, known to hold values in the range `other` was known to hold (a kernel
    /// filled it with copies of `other`'s values).
    pub(super) fn with_range_of(mut self, other: &DevVec<T>) -> DevVec<T> {
        self.range = other.range;
        self
    }

    /// Whether the first `count` values are known to lie in lo..hi (true for `count` = 0).
    pub(super) fn values_within(&self, count: usize, lo: i64, hi: i64) -> bool {
        count == 0
            || (count <= self.len && self.range.is_some_and(|(min, max)| min >= lo && max < hi))
    }
}

/// Page-locked host memory for small results copied back after every op (the statistics): a
/// copy into it is one DMA, without the staging through the driver's own page-locked buffer
/// that a copy into ordinary memory takes.
pub struct PinnedBytes(PinnedHostSlice<u8>);

fn byte_count(len: usize, size: usize) -> Result<usize> {
    len.checked_mul(size).ok_or_else(|| Error::Allocation {
        what: "device buffer".into(),
        detail: format!("{len} elements of {size} bytes overflow"),
    })
}

impl Gpu {
    /// `bytes` of uninitialised device memory (a kept buffer of that size, or a new one),
    /// numbered in the registry.
    fn alloc_bytes(&self, bytes: usize) -> Result<(Block, u64, u64)> {
        let bytes = bytes.max(4);
        let alloc = || {
            // SAFETY: device memory is only ever copied as plain bytes (every bit pattern is
            // a valid f32, bf16, i32, byte or f64), so memory no kernel has written yet reads
            // as garbage, never as undefined behaviour; every caller fills what it reads.
            super::ledger::LEDGER.time(DriverCall::Alloc, || unsafe {
                self.stream.alloc::<u8>(bytes)
            })
        };
        let slice = match self.free.take(bytes).map_or_else(alloc, Ok) {
            Ok(slice) => slice,
            // The free list and the pool keep freed memory (`keep_freed_memory`): a full device
            // gets it back and the allocation is tried once more.
            Err(_) => {
                self.free.clear();
                self.release_kept_memory()?;
                alloc().map_err(CudaError::driver(format!("alloc of {bytes} bytes")))?
            }
        };
        let ptr = {
            let (p, _sync) = slice.device_ptr(&self.stream);
            p
        };
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let mut reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        reg.push(Allocation { serial, ptr, bytes });
        if reg.len() > 4096 {
            reg.drain(..1024);
        }
        Ok((Block::new(slice, self.free.clone()), ptr, serial))
    }

    /// Allocates `len` elements of `elem` (contents undefined until written).
    pub fn alloc(&self, len: usize, elem: Elem) -> Result<DevBuf> {
        let bytes = byte_count(len, elem.size())?;
        let (slice, ptr, serial) = self.alloc_bytes(bytes)?;
        Ok(DevBuf {
            slice,
            ptr,
            elem,
            len,
            serial,
        })
    }

    /// Allocates `len` plain values for a kernel to write.
    pub fn alloc_vec<T: Plain>(&self, len: usize) -> Result<DevVec<T>> {
        let bytes = byte_count(len, T::SIZE)?;
        let (slice, ptr, serial) = self.alloc_bytes(bytes)?;
        Ok(DevVec {
            slice,
            ptr,
            len,
            serial,
            range: None,
            _values: PhantomData,
        })
    }

    /// A buffer holding `data` in `elem`.
    pub fn upload(&self, data: &[f32], elem: Elem) -> Result<DevBuf> {
        let mut buf = self.alloc(data.len(), elem)?;
        self.write(&mut buf, 0, data)?;
        Ok(buf)
    }

    /// Writes `data` at element offset `at` of `buf`.
    pub fn write(&self, buf: &mut DevBuf, at: usize, data: &[f32]) -> Result<()> {
        if at + data.len() > buf.len {
            return Err(Error::invalid("device write past the end of a buffer"));
        }
        if data.is_empty() {
            return Ok(());
        }
        let bytes: Vec<u8> = match buf.elem {
            Elem::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Elem::Bf16 => data
                .iter()
                .flat_map(|v| to_bf16(*v).to_le_bytes())
                .collect(),
        };
        let offset = at * buf.elem.size();
        let mut view = buf.slice.slice_mut(offset..offset + bytes.len());
        super::ledger::LEDGER
            .time(DriverCall::Upload, || {
                self.stream.memcpy_htod(&bytes, &mut view)
            })
            .map_err(CudaError::driver("upload"))?;
        Ok(())
    }

    /// A buffer of plain values, remembering their range.
    pub fn upload_vec<T: Plain>(&self, data: &[T]) -> Result<DevVec<T>> {
        let mut buf = self.alloc_vec::<T>(data.len())?;
        let mut bytes = Vec::with_capacity(data.len() * T::SIZE);
        for &v in data {
            v.to_le(&mut bytes);
        }
        if !bytes.is_empty() {
            let mut view = buf.slice.slice_mut(0..bytes.len());
            super::ledger::LEDGER
                .time(DriverCall::Upload, || {
                    self.stream.memcpy_htod(&bytes, &mut view)
                })
                .map_err(CudaError::driver("upload"))?;
        }
        let indices: Option<Vec<i64>> = data.iter().map(|v| v.as_index()).collect();
        buf.range = indices.and_then(|ix| Some((*ix.iter().min()?, *ix.iter().max()?)));
        Ok(buf)
    }

    /// A buffer of i32 values (positions, indices).
    pub fn upload_i32(&self, data: &[i32]) -> Result<DevI32> {
        self.upload_vec(data)
    }

    /// A buffer of bytes (masks, quantized blocks).
    pub fn upload_bytes(&self, data: &[u8]) -> Result<DevBytes> {
        self.upload_vec(data)
    }

    /// `bytes` of page-locked host memory for [`Gpu::download_vec_pinned`].
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBytes> {
        // SAFETY: the memory starts undefined, and is only read through `download_vec_pinned`
        // after a copy into it has completed, and only as far as that copy wrote. Flags 0: plain
        // cached page-locked memory (not write-combined, which the host reads slowly).
        let slice = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }
            .map_err(CudaError::driver("page-locked allocation"))?;
        Ok(PinnedBytes(slice))
    }

    /// [`Gpu::download_vec`] through page-locked memory (as large as the copy, at least).
    pub fn download_vec_pinned<T: Plain>(
        &self,
        buf: &DevVec<T>,
        count: usize,
        pinned: &mut PinnedBytes,
    ) -> Result<Vec<T>> {
        let bytes = byte_count(count, T::SIZE)?;
        if count > buf.len || bytes > pinned.0.len() {
            return Err(Error::invalid("device read past the end of a buffer"));
        }
        // A download and its wait are one call, as `read_bytes` counts them.
        super::ledger::LEDGER.time(DriverCall::Download, || {
            if bytes > 0 {
                let view = buf.slice.slice(0..bytes);
                self.stream
                    .memcpy_dtoh(&view, &mut pinned.0)
                    .map_err(CudaError::driver("download"))?;
            }
            self.stream
                .synchronize()
                .map_err(CudaError::driver("kernel"))
        })?;
        let host = pinned.0.as_slice().map_err(CudaError::driver("download"))?;
        Ok(host[..bytes]
            .chunks_exact(T::SIZE)
            .map(T::from_le)
            .collect())
    }

    /// Copies a buffer back as f32 (waits for the stream, so kernel errors surface here).
    pub fn download(&self, buf: &DevBuf) -> Result<Vec<f32>> {
        self.download_range(buf, 0, buf.len)
    }

    /// Copies `len` elements from element `from` of a buffer back as f32.
    pub fn download_range(&self, buf: &DevBuf, from: usize, len: usize) -> Result<Vec<f32>> {
        if from + len > buf.len {
            return Err(Error::invalid("device read past the end of a buffer"));
        }
        let s = buf.elem.size();
        let bytes = read_bytes(&self.stream, &buf.slice, from * s, len * s)?;
        Ok(values_of(buf.elem, &bytes))
    }

    /// The first `count` values of a plain buffer.
    pub fn download_vec<T: Plain>(&self, buf: &DevVec<T>, count: usize) -> Result<Vec<T>> {
        if count > buf.len {
            return Err(Error::invalid("device read past the end of a buffer"));
        }
        let bytes = read_bytes(&self.stream, &buf.slice, 0, count * T::SIZE)?;
        Ok(bytes.chunks_exact(T::SIZE).map(T::from_le).collect())
    }

    /// Copies `len` elements from `src` at `from` to `dst` at `to` (same storage type), bit for
    /// bit (poison stays poison). Like a kernel, it writes through `dst`'s pointer, so `dst` may
    /// be a tensor's shared device mirror.
    pub fn copy(
        &self,
        src: &DevBuf,
        from: usize,
        dst: &DevBuf,
        to: usize,
        len: usize,
    ) -> Result<()> {
        let overlap = src.serial == dst.serial && from < to + len && to < from + len;
        if src.elem != dst.elem || from + len > src.len || to + len > dst.len || overlap {
            return Err(Error::invalid(
                "device copy between buffers of other types, past an end, or onto itself",
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let s = src.elem.size();
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("copy"))?;
        // SAFETY: both ranges lie within live allocations of this context and do not overlap
        // (checked above); the copy is queued on the one stream every kernel uses.
        super::ledger::LEDGER
            .time(DriverCall::Copy, || unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.ptr + (to * s) as u64,
                    src.ptr + (from * s) as u64,
                    len * s,
                    self.stream.cu_stream(),
                )
            })
            .map_err(CudaError::driver("copy"))
    }
}
