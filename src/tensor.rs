//! A plain row-major tensor with an identity.
//!
//! Every tensor owns one buffer and carries a [`BufferId`] that is unique for the life of the
//! process, so the trace can say which buffer an op wrote and which buffers it read: the basis of
//! mladb's buffer forensics. Data is f32; integer results (top-k indices, expert ids) are stored as
//! exactly representable f32 values and tagged [`DType::I32`].

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The poison pattern output buffers are filled with before an op runs (a NaN whose payload no
/// arithmetic produces), so elements the op did not write can be counted afterwards.
pub const POISON_BITS: u32 = 0x7FA5_A5A5;

/// Largest single tensor mladb will allocate (12 GiB of f32). Bad input must fail cleanly instead
/// of asking the allocator for terabytes.
pub const MAX_TENSOR_BYTES: usize = 12 << 30;

/// The element type a tensor represents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    /// Integers (indices) held exactly in f32 storage.
    I32,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::I32 => "i32",
        }
    }
}

/// Process-unique identity of one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BufferId(pub u64);

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

impl BufferId {
    fn fresh() -> Self {
        BufferId(NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// A fresh identity for a buffer that is not a [`Tensor`] (a KV cache).
    pub fn fresh_cache() -> Self {
        Self::fresh()
    }
}

/// Number of elements of `shape`, or an error when it overflows or exceeds [`MAX_TENSOR_BYTES`].
pub fn checked_numel(shape: &[usize], what: &str) -> Result<usize> {
    let n = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::Allocation {
            what: what.to_string(),
            detail: format!("shape {shape:?} overflows"),
        })?;
    if n.saturating_mul(4) > MAX_TENSOR_BYTES {
        return Err(Error::Allocation {
            what: what.to_string(),
            detail: format!(
                "shape {shape:?} needs {} MiB, over the {} MiB cap",
                n.saturating_mul(4) >> 20,
                MAX_TENSOR_BYTES >> 20
            ),
        });
    }
    Ok(n)
}

/// A copy of a tensor in device memory, owned by the backend that made it.
pub trait DeviceBuffer: Send + Sync {
    /// The device pointer.
    fn address(&self) -> u64;
    fn bytes(&self) -> usize;
    /// The device the buffer lives on (its CUDA ordinal): ranks of a tensor-parallel run each
    /// have one.
    fn device_index(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
    /// The values as f32, copied to the host (for a tensor whose host copy is made on demand).
    fn download(&self) -> Result<Vec<f32>>;
    /// Values `from..from + len` as f32 (one row of a large tensor, without the rest).
    fn download_range(&self, from: usize, len: usize) -> Result<Vec<f32>> {
        let all = self.download()?;
        all.get(from..from + len)
            .map(<[f32]>::to_vec)
            .ok_or_else(|| Error::invalid("device read past the end of a buffer"))
    }
}

/// A row-major f32 tensor that owns its buffer, with an optional device mirror.
///
/// A device backend attaches the device buffer the values came from, or were uploaded to, so
/// that the next op finds them resident; the mirror is dropped with the tensor, and dropped when
/// the host data is changed. A tensor a device op computed has no host copy until something
/// reads its values ([`Tensor::data`]): statistics run on the device, so a traced run copies
/// back only what is looked at.
pub struct Tensor {
    shape: Vec<usize>,
    /// The host copy; empty only while a device buffer holds the values.
    data: OnceLock<Vec<f32>>,
    dtype: DType,
    id: BufferId,
    device: OnceLock<Arc<dyn DeviceBuffer>>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("id", &self.id)
            .field("device", &self.device.get().map(|d| d.address()))
            .finish()
    }
}

impl Clone for Tensor {
    /// A clone is a new buffer on the host, so it gets a new identity.
    fn clone(&self) -> Self {
        Tensor {
            shape: self.shape.clone(),
            data: OnceLock::from(self.data().to_vec()),
            dtype: self.dtype,
            id: BufferId::fresh(),
            device: OnceLock::new(),
        }
    }
}

impl Tensor {
    /// A zero-filled tensor; fails instead of allocating beyond the cap.
    pub fn zeros(shape: &[usize]) -> Result<Tensor> {
        let n = checked_numel(shape, "tensor")?;
        Ok(Tensor::from_parts(shape.to_vec(), vec![0.0; n], DType::F32))
    }

    /// A tensor filled with [`POISON_BITS`], or zeros when `poison` is false.
    pub fn alloc(shape: &[usize], poison: bool) -> Result<Tensor> {
        let n = checked_numel(shape, "tensor")?;
        let fill = if poison {
            f32::from_bits(POISON_BITS)
        } else {
            0.0
        };
        Ok(Tensor::from_parts(
            shape.to_vec(),
            vec![fill; n],
            DType::F32,
        ))
    }

    /// Wraps `data` with `shape`; the lengths must agree (a violated invariant is a bug).
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Tensor {
        Tensor::from_parts(shape.to_vec(), data, DType::F32)
    }

    /// An integer-valued tensor (indices) stored in f32.
    pub fn from_indices(shape: &[usize], indices: &[usize]) -> Tensor {
        Tensor::from_parts(
            shape.to_vec(),
            indices.iter().map(|&i| i as f32).collect(),
            DType::I32,
        )
    }

    /// An integer-valued tensor from values already in f32 (−1 marks padding).
    pub fn from_index_values(shape: &[usize], values: Vec<f32>) -> Tensor {
        Tensor::from_parts(shape.to_vec(), values, DType::I32)
    }

    fn from_parts(shape: Vec<usize>, data: Vec<f32>, dtype: DType) -> Tensor {
        let numel: usize = shape.iter().product();
        assert_eq!(
            numel,
            data.len(),
            "tensor shape {shape:?} does not match its data"
        );
        Tensor {
            shape,
            data: OnceLock::from(data),
            dtype,
            id: BufferId::fresh(),
            device: OnceLock::new(),
        }
    }

    /// A tensor whose values are in `buffer` (f32 values of `shape`); the host copy is made
    /// when something reads them.
    pub fn from_device(shape: &[usize], buffer: Arc<dyn DeviceBuffer>) -> Tensor {
        Tensor {
            shape: shape.to_vec(),
            data: OnceLock::new(),
            dtype: DType::F32,
            id: BufferId::fresh(),
            device: OnceLock::from(buffer),
        }
    }

    /// The device mirror, if a device backend attached one.
    pub fn device(&self) -> Option<&Arc<dyn DeviceBuffer>> {
        self.device.get()
    }

    /// Attaches a device mirror holding the same values; returns false if one is attached.
    pub fn attach_device(&self, buffer: Arc<dyn DeviceBuffer>) -> bool {
        self.device.set(buffer).is_ok()
    }

    /// After a device op wrote the mirror in place: the host copy is dropped, to be copied
    /// again from the mirror when read. Without a mirror there is nothing to drop.
    pub fn host_stale(&mut self) {
        if self.device.get().is_some() {
            self.data = OnceLock::new();
        }
    }

    /// Whether the host copy has been made (a device op's output has none until it is read).
    pub fn on_host(&self) -> bool {
        self.data.get().is_some()
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn id(&self) -> BufferId {
        self.id
    }

    /// Address of the first element: the "device pointer" of a host buffer.
    pub fn address(&self) -> u64 {
        self.data().as_ptr() as u64
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * std::mem::size_of::<f32>()
    }

    /// The values, copied from the device mirror first if the host copy is not made yet.
    pub fn data(&self) -> &[f32] {
        match self.try_data() {
            Ok(d) => d,
            Err(e) => {
                // Only a failed device (its context lost) fails here, and its next op reports
                // the failure as the run's error; meanwhile the values read as NaN, never zero.
                tracing::error!("copying a tensor from the device failed: {e}");
                self.data.get_or_init(|| vec![f32::NAN; self.numel()])
            }
        }
    }

    /// Row `r` of the matrix view as an owned copy: from the host copy where there is one, else
    /// only that row from the device (the last row of a prefill's logits without the others).
    pub fn row_values(&self, r: usize) -> Result<Vec<f32>> {
        let c = self.cols();
        if r >= self.rows() {
            return Err(Error::invalid(format!(
                "row {r} of a tensor of shape {:?}",
                self.shape
            )));
        }
        match (self.data.get(), self.device.get()) {
            (None, Some(d)) => d.download_range(r * c, c),
            _ => Ok(self.row(r).to_vec()),
        }
    }

    /// [`Tensor::data`], with the error of a failed copy from the device.
    pub fn try_data(&self) -> Result<&[f32]> {
        if let Some(d) = self.data.get() {
            return Ok(d);
        }
        let device = self
            .device
            .get()
            .expect("a tensor without a host copy has a device buffer");
        let values = device.download()?;
        if values.len() != self.numel() {
            return Err(Error::invalid(format!(
                "a device buffer of {} values holds a tensor of shape {:?}",
                values.len(),
                self.shape
            )));
        }
        Ok(self.data.get_or_init(|| values))
    }

    /// Mutable host data; the device mirror (if any) no longer matches and is dropped.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.data();
        self.device = OnceLock::new();
        self.data.get_mut().expect("the host copy was made above")
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data();
        self.data
            .into_inner()
            .expect("the host copy was made above")
    }

    /// Number of rows when viewed as a matrix [rows, last dim].
    pub fn rows(&self) -> usize {
        if self.shape.is_empty() {
            1
        } else {
            self.numel() / self.cols().max(1)
        }
    }

    /// Size of the last dimension.
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Row `r` of the matrix view.
    pub fn row(&self, r: usize) -> &[f32] {
        let c = self.cols();
        &self.data()[r * c..(r + 1) * c]
    }

    /// Same buffer, another shape with the same element count (a view, keeps the identity).
    /// A second handle on this buffer: the same identity and device memory, a copy of the host
    /// values (or none yet, as the original). For a trace that reports one buffer as the output
    /// of two ops (a kernel's and its wrapper's), so that both name the buffer really written.
    pub fn alias(&self) -> Tensor {
        let device = OnceLock::new();
        if let Some(d) = self.device.get() {
            let _ = device.set(Arc::clone(d));
        }
        Tensor {
            shape: self.shape.clone(),
            data: self.data.clone(),
            dtype: self.dtype,
            id: self.id,
            device,
        }
    }

    pub fn reshaped(mut self, shape: &[usize]) -> Tensor {
        let numel: usize = shape.iter().product();
        assert_eq!(
            numel,
            self.numel(),
            "reshape to {shape:?} changes the element count"
        );
        self.shape = shape.to_vec();
        self
    }
}

/// A device buffer in host memory, for tests of what lies above the backends.
#[cfg(test)]
pub(crate) mod test_device {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    /// Holds its values on the host and counts their copies "to the host".
    pub(crate) struct FakeDevice {
        pub(crate) values: Mutex<Vec<f32>>,
        pub(crate) downloads: AtomicUsize,
    }

    impl FakeDevice {
        pub(crate) fn holding(values: &[f32]) -> Arc<FakeDevice> {
            Arc::new(FakeDevice {
                values: Mutex::new(values.to_vec()),
                downloads: AtomicUsize::new(0),
            })
        }
    }

    impl DeviceBuffer for FakeDevice {
        fn address(&self) -> u64 {
            0xD000
        }
        fn bytes(&self) -> usize {
            self.values.lock().unwrap().len() * 4
        }
        fn device_index(&self) -> usize {
            0
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn download(&self) -> Result<Vec<f32>> {
            self.downloads.fetch_add(1, Ordering::Relaxed);
            Ok(self.values.lock().unwrap().clone())
        }
        fn download_range(&self, from: usize, len: usize) -> Result<Vec<f32>> {
            self.downloads.fetch_add(1, Ordering::Relaxed);
            Ok(self.values.lock().unwrap()[from..from + len].to_vec())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_device::FakeDevice;
    use super::*;

    #[test]
    fn one_row_of_a_device_tensor_comes_back_without_the_rest() {
        let d = FakeDevice::holding(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let t = Tensor::from_device(&[3, 2], d.clone());
        assert_eq!(t.row_values(2).unwrap(), [5.0, 6.0]);
        assert!(!t.on_host(), "reading one row made no host copy");
        assert!(t.row_values(3).is_err());
        // Once the host copy exists, rows come from it.
        assert_eq!(t.row(0), [1.0, 2.0]);
        let copies = d.downloads.load(Ordering::Relaxed);
        assert_eq!(t.row_values(1).unwrap(), [3.0, 4.0]);
        assert_eq!(d.downloads.load(Ordering::Relaxed), copies);
    }

    #[test]
    fn a_device_tensor_is_copied_to_the_host_once_and_only_when_read() {
        let d = FakeDevice::holding(&[1.0, 2.0, 3.0, 4.0]);
        let t = Tensor::from_device(&[2, 2], d.clone());
        assert_eq!((t.numel(), t.size_bytes(), t.on_host()), (4, 16, false));
        assert_eq!(d.downloads.load(Ordering::Relaxed), 0, "nothing read yet");
        assert_eq!(t.row(1), &[3.0, 4.0]);
        assert_eq!(t.data(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(d.downloads.load(Ordering::Relaxed), 1, "copied once");
        // An alias shares the identity and device buffer, and the copy made so far.
        let a = t.alias();
        assert_eq!((a.id(), a.data()), (t.id(), t.data()));
        assert_eq!(d.downloads.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_kernel_write_in_place_makes_the_host_copy_stale() {
        let d = FakeDevice::holding(&[1.0, 2.0]);
        let mut t = Tensor::from_device(&[2], d.clone());
        assert_eq!(t.data(), &[1.0, 2.0]);
        *d.values.lock().unwrap() = vec![5.0, 6.0];
        t.host_stale();
        assert_eq!(t.data(), &[5.0, 6.0], "read again from the device");
        // Writing the host copy drops the mirror, which no longer matches.
        t.data_mut()[0] = 9.0;
        assert!(t.device().is_none());
        assert_eq!(t.into_data(), vec![9.0, 6.0]);
        // A host tensor has no mirror to go stale: its values stay.
        let mut h = Tensor::from_vec(&[1], vec![7.0]);
        h.host_stale();
        assert_eq!(h.data(), &[7.0]);
    }

    #[test]
    fn a_clone_is_a_host_copy_with_its_own_identity() {
        let d = FakeDevice::holding(&[1.0, 2.0]);
        let t = Tensor::from_device(&[2], d.clone());
        let c = t.clone();
        assert_ne!(c.id(), t.id());
        assert!(c.device().is_none() && c.on_host());
        assert_eq!(c.data(), &[1.0, 2.0]);
    }

    #[test]
    fn a_device_buffer_of_the_wrong_size_is_an_error_not_a_short_tensor() {
        let t = Tensor::from_device(&[3], FakeDevice::holding(&[1.0, 2.0]));
        assert!(t.try_data().is_err());
        // `data` never hands out a short or zeroed tensor: the values read as NaN.
        assert_eq!(t.data().len(), 3);
        assert!(t.data().iter().all(|v| v.is_nan()));
    }
}
