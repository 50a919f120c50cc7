//! Small read-only arrays that every layer of a step uploads again (the step's positions and
//! sequence lengths, the RoPE frequencies, the router's bias), kept on the device by their
//! content, so that each goes up once instead of once per call: an upload of a few bytes costs
//! the host about as much as a kernel launch, and a decode step made fifteen of them per layer.
//!
//! Only for arrays the kernels read: a buffer handed out here may be handed out again.

use super::device::{DevBuf, DevI32, Elem, Gpu};
use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Arrays longer than this are uploaded every time (they are not the repeated kind).
const MAX_LEN: usize = 4096;
/// Arrays kept at most; when full, all are dropped (those of every step come back at once).
const MAX_ENTRIES: usize = 256;

/// The kept arrays, by content (f32 by their bits).
#[derive(Default)]
pub(super) struct Constants(Mutex<Kept>);

#[derive(Default)]
struct Kept {
    i32s: HashMap<Vec<i32>, Arc<DevI32>>,
    f32s: HashMap<Vec<u32>, Arc<DevBuf>>,
}

impl Constants {
    /// `values` on the device as i32.
    pub(super) fn i32s(&self, gpu: &Gpu, values: &[i32]) -> Result<Arc<DevI32>> {
        if values.len() > MAX_LEN {
            return Ok(Arc::new(gpu.upload_i32(values)?));
        }
        let mut kept = self.lock();
        if let Some(buf) = kept.i32s.get(values) {
            return Ok(buf.clone());
        }
        let buf = Arc::new(gpu.upload_i32(values)?);
        kept.make_room();
        kept.i32s.insert(values.to_vec(), buf.clone());
        Ok(buf)
    }

    /// `values` on the device as f32.
    pub(super) fn f32s(&self, gpu: &Gpu, values: &[f32]) -> Result<Arc<DevBuf>> {
        if values.len() > MAX_LEN {
            return Ok(Arc::new(gpu.upload(values, Elem::F32)?));
        }
        let key: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        let mut kept = self.lock();
        if let Some(buf) = kept.f32s.get(&key) {
            return Ok(buf.clone());
        }
        let buf = Arc::new(gpu.upload(values, Elem::F32)?);
        kept.make_room();
        kept.f32s.insert(key, buf.clone());
        Ok(buf)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Kept {
    fn make_room(&mut self) {
        if self.i32s.len() + self.f32s.len() >= MAX_ENTRIES {
            self.i32s.clear();
            self.f32s.clear();
        }
    }
}
