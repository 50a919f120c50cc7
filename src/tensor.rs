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
    fn as_any(&self) -> &dyn Any;
}

/// A row-major f32 tensor that owns its buffer, with an optional device mirror.
///
/// The host copy is always there (the trace and the debugger read it). A device backend attaches
/// the device buffer the values came from, or were uploaded to, so that the next op finds them
/// resident; the mirror is dropped with the tensor, and dropped when the host data is changed.
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
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
    /// A clone is a new buffer, so it gets a new identity.
    fn clone(&self) -> Self {
        Tensor {
            shape: self.shape.clone(),
            data: self.data.clone(),
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
            data,
            dtype,
            id: BufferId::fresh(),
            device: OnceLock::new(),
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

    /// The host data for a device backend that updates both copies itself (the mirror stays).
    pub fn data_mut_keeping_device(&mut self) -> &mut [f32] {
        &mut self.data
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
        self.data.as_ptr() as u64
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    pub fn size_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Mutable host data; the device mirror (if any) no longer matches and is dropped.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.device = OnceLock::new();
        &mut self.data
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data
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
        &self.data[r * c..(r + 1) * c]
    }

    /// Same buffer, another shape with the same element count (a view, keeps the identity).
    /// A second handle on this buffer: the same identity and device memory, a copy of the host
    /// values. For a trace that reports one buffer as the output of two ops (a kernel's and its
    /// wrapper's), so that both name the buffer that was really written.
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
            self.data.len(),
            "reshape to {shape:?} changes the element count"
        );
        self.shape = shape.to_vec();
        self
    }
}
