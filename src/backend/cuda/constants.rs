//! Small read-only arrays that every layer of a step uploads again (the step's positions and
//! sequence lengths, the RoPE frequencies, the router's bias), kept on the device by their
//! content, so that each goes up once instead of once per call: an upload of a few bytes costs
//! the host about as much as a kernel launch, and a decode step made fifteen of them per layer.
//!
//! Only for arrays the kernels read: a buffer handed out here may be handed out again.

use super::device::{DevBuf, DevI32, Elem, Gpu};
use crate::error::Result;
use std::collections::HashMap;
use std::hash::Hash;
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
        let upload = || gpu.upload_i32(values).map(Arc::new);
        match values.len() > MAX_LEN {
            true => upload(),
            false => self.kept(values.to_vec(), |k| &mut k.i32s, upload),
        }
    }

    /// `values` on the device as f32.
    pub(super) fn f32s(&self, gpu: &Gpu, values: &[f32]) -> Result<Arc<DevBuf>> {
        let upload = || gpu.upload(values, Elem::F32).map(Arc::new);
        match values.len() > MAX_LEN {
            true => upload(),
            false => {
                let key = values.iter().map(|v| v.to_bits()).collect();
                self.kept(key, |k| &mut k.f32s, upload)
            }
        }
    }

    /// The buffer kept under `key` in the map `of` picks, or `upload`'s, kept from now on.
    fn kept<K: Eq + Hash, V: Clone>(
        &self,
        key: K,
        of: fn(&mut Kept) -> &mut HashMap<K, V>,
        upload: impl FnOnce() -> Result<V>,
    ) -> Result<V> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(buf) = of(&mut kept).get(&key) {
            return Ok(buf.clone());
        }
        let buf = upload()?;
        kept.make_room();
        of(&mut kept).insert(key, buf.clone());
        Ok(buf)
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
