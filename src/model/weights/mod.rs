//! Weights behind one trait, fetched lazily per tensor (and per expert, and per row range) so that
//! a full-size layout runs without ever holding the whole model in memory.

mod cache;
pub mod safetensors;
pub mod synthetic;

pub use cache::Held;

use super::catalog::Catalog;
use super::layout::Layout;
use super::quant::QuantTensor;
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, Tensor};
use cache::{Budgets, LruCache};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where weight values come from. Names are the canonical HF names of [`Catalog`].
pub trait WeightSource: Send + Sync {
    /// A short description for messages ("synthetic (seed 0)", a directory path).
    fn describe(&self) -> String;
    /// The stored shape of a tensor, or `None` when the source lacks it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Fills `out` with rows `start_row..` of the tensor viewed as a matrix
    /// [shape[0], product of the rest]; `out.len()` is a whole number of rows.
    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()>;
    /// Whether the tensor can be read at all (its stored type is one this source decodes):
    /// checked at load, so an unreadable tensor is an error before the run, not in the middle.
    fn readable(&self, _name: &str) -> Result<()> {
        Ok(())
    }
    /// The tensor's ggml blocks when the source stores it quantized (a GGUF file, `--quant`);
    /// `read_rows` then returns the decoded values.
    fn quantized(&self, _name: &str) -> Option<Result<QuantTensor>> {
        None
    }
    /// Rows of the values a quantized tensor was made from, when the source still has them
    /// (`--quant`): the reference a quantization-error check needs.
    fn original(&self, _name: &str, _start_row: usize, _out: &mut [f32]) -> Option<Result<()>> {
        None
    }
    /// How rows `start_row..` of the tensor can be made anew where they are used, when the
    /// source generates them (synthetic weights) rather than reading them.
    fn recipe(&self, _name: &str, _start_row: usize) -> Option<Recipe> {
        None
    }
}

/// How generated weight values can be made anywhere: element i (row-major, from the rows'
/// start) is `offset + scale · normalish(key, first + i)` ([`synthetic::normalish`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recipe {
    pub key: u64,
    pub first: u64,
    pub offset: f32,
    pub scale: f32,
}

impl Recipe {
    /// Element `i` (from the rows' start), as the CPU generator makes it.
    #[inline]
    pub fn value(&self, i: u64) -> f32 {
        self.offset + self.scale * synthetic::normalish(self.key, self.first + i)
    }

    /// The first `len` values on the host.
    pub fn values(&self, len: usize) -> Vec<f32> {
        (0..len as u64).map(|i| self.value(i)).collect()
    }
}

/// Makes weight tensors from their recipes where they are used (a GPU: the values never cross
/// PCIe). The tensor's host copy, when something reads it, is the CPU generator's values.
pub trait WeightMaker: Send + Sync {
    fn make(&self, shape: &[usize], recipe: Recipe) -> Result<Tensor>;
}

/// Materialised weights with a byte budget: tensors are kept (least recently used first out)
/// until the budget is full, so repeated steps do not refetch, and full-size models still fit.
pub struct WeightStore {
    /// Shared so that tensor-parallel ranks can read their shards from the same source.
    source: Arc<dyn WeightSource>,
    catalog: Catalog,
    budget_bytes: usize,
    /// The most bytes of cached weights held on the device (see [`WeightStore::set_device_budget`]).
    device_budget: AtomicUsize,
    cache: Mutex<LruCache>,
    /// Quantized forms fetched so far (`None`: the tensor is not quantized).
    quantized: Mutex<HashMap<String, Option<Arc<QuantTensor>>>>,
    /// Total time spent in the source (reading or generating), in nanoseconds.
    fetch_nanos: AtomicU64,
    /// Where generated tensors are made, when not on the host (see [`WeightMaker`]).
    maker: Mutex<Option<Arc<dyn WeightMaker>>>,
}

impl WeightStore {
    /// Wraps a source, checking that every tensor the layout needs is present with its shape.
    pub fn new(
        layout: &Layout,
        source: Box<dyn WeightSource>,
        budget_bytes: usize,
    ) -> Result<WeightStore> {
        WeightStore::with_catalog(Catalog::new(layout), source, budget_bytes)
    }

    /// The same for the tensors of `catalog` (a tensor-parallel rank's, which holds cut shapes
    /// and not every expert).
    pub fn with_catalog(
        catalog: Catalog,
        source: Box<dyn WeightSource>,
        budget_bytes: usize,
    ) -> Result<WeightStore> {
        for (name, spec) in catalog.iter() {
            match source.shape(name) {
                None => {
                    return Err(Error::MissingTensor {
                        name: name.clone(),
                        source_desc: source.describe(),
                    })
                }
                Some(found) if found != spec.shape => {
                    return Err(Error::ShapeMismatch {
                        name: name.clone(),
                        source_desc: source.describe(),
                        expected: spec.shape.clone(),
                        found,
                    })
                }
                Some(_) => source.readable(name)?,
            }
        }
        Ok(WeightStore {
            source: Arc::from(source),
            catalog,
            budget_bytes,
            device_budget: AtomicUsize::new(usize::MAX),
            cache: Mutex::new(LruCache::default()),
            quantized: Mutex::new(HashMap::new()),
            fetch_nanos: AtomicU64::new(0),
            maker: Mutex::new(None),
        })
    }

    pub fn describe(&self) -> String {
        self.source.describe()
    }

    /// The source the store reads from (a tensor-parallel rank reads its shards from it).
    pub fn source(&self) -> Arc<dyn WeightSource> {
        self.source.clone()
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    fn spec_shape(&self, name: &str) -> Result<&[usize]> {
        self.catalog
            .get(name)
            .map(|s| s.shape.as_slice())
            .ok_or_else(|| Error::invalid(format!("the layout has no tensor named {name}")))
    }

    /// Shape of a tensor of the layout.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        self.spec_shape(name).map(<[usize]>::to_vec)
    }

    /// Bytes the whole tensor takes in f32.
    pub fn size_bytes(&self, name: &str) -> Result<usize> {
        Ok(self.spec_shape(name)?.iter().product::<usize>() * 4)
    }

    /// The most bytes of weights kept at once on the host.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Bounds the bytes of cached weights held on the device (`--device-cache-gb`; unbounded
    /// until set). Weights made on the device hold no host copy, so only this bounds them.
    pub fn set_device_budget(&self, bytes: usize) {
        self.device_budget.store(bytes, Ordering::Relaxed);
    }

    pub fn device_budget(&self) -> usize {
        self.device_budget.load(Ordering::Relaxed)
    }

    fn budgets(&self) -> Budgets {
        Budgets {
            host: self.budget_bytes,
            device: self.device_budget(),
        }
    }

    /// Whether a host tensor of this many bytes may be cached.
    pub fn fits_budget(&self, bytes: usize) -> bool {
        bytes <= self.budget_bytes
    }

    /// The whole tensor, from the cache or fetched (and cached when the budget allows).
    pub fn get(&self, name: &str) -> Result<Arc<Tensor>> {
        let budgets = self.budgets();
        if let Some(t) = self.lock().touch(name, budgets) {
            return Ok(t);
        }
        let shape = self.shape(name)?;
        let rows = shape.first().copied().unwrap_or(1);
        let tensor = self.fetch(name, &shape, 0, rows)?;
        let tensor = Arc::new(tensor);
        self.lock().insert(name, tensor.clone(), budgets);
        Ok(tensor)
    }

    /// Rows `start..start + count` of a tensor viewed as a matrix; never cached.
    pub fn rows(&self, name: &str, start: usize, count: usize) -> Result<Tensor> {
        let shape = self.shape(name)?;
        let total = shape.first().copied().unwrap_or(1);
        if start.checked_add(count).is_none_or(|end| end > total) {
            return Err(Error::invalid(format!(
                "rows {start}..{} of {name} are out of range (it has {total})",
                start.saturating_add(count)
            )));
        }
        self.fetch(name, &shape, start, count)
    }

    /// The tensor's quantized blocks, when the source stores it quantized (kept once fetched).
    pub fn quantized(&self, name: &str) -> Result<Option<Arc<QuantTensor>>> {
        let mut map = self.quantized.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = map.get(name) {
            return Ok(q.clone());
        }
        self.spec_shape(name)?;
        let q = self.source.quantized(name).transpose()?.map(Arc::new);
        map.insert(name.to_string(), q.clone());
        Ok(q)
    }

    /// The whole tensor as it was before quantization, when the source still has it.
    pub fn original(&self, name: &str) -> Result<Option<Tensor>> {
        let shape = self.shape(name)?;
        let mut data = vec![0.0f32; checked_numel(&shape, name)?];
        match self.source.original(name, 0, &mut data) {
            None => Ok(None),
            Some(r) => r.map(|_| Some(Tensor::from_vec(&shape, data))),
        }
    }

    /// Makes the tensors the source generates with `maker` from now on (`None`: on the host).
    /// Tensors already cached stay: any backend reads either kind.
    pub fn set_maker(&self, maker: Option<Arc<dyn WeightMaker>>) {
        *self.maker.lock().unwrap_or_else(|p| p.into_inner()) = maker;
    }

    fn fetch(&self, name: &str, shape: &[usize], start: usize, count: usize) -> Result<Tensor> {
        let cols: usize = shape.iter().skip(1).product();
        let mut out_shape = shape.to_vec();
        if out_shape.is_empty() {
            out_shape.push(1);
        }
        out_shape[0] = count;
        let n = checked_numel(&out_shape, name)?;
        let begin = Instant::now();
        let maker = self.maker.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let tensor = match maker.zip(self.source.recipe(name, start)) {
            Some((maker, recipe)) => maker.make(&out_shape, recipe)?,
            None => {
                let mut data = vec![0.0f32; n];
                debug_assert_eq!(n, count * cols);
                self.source.read_rows(name, start, &mut data)?;
                Tensor::from_vec(&out_shape, data)
            }
        };
        self.fetch_nanos
            .fetch_add(begin.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(tensor)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache> {
        // A poisoned lock only means another thread panicked mid-insert; the map is still valid.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seconds spent so far reading or generating weights.
    pub fn fetch_seconds(&self) -> f64 {
        self.fetch_nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Bytes currently held by the cache, on the host and on the device.
    pub fn cached_bytes(&self) -> Held {
        self.lock().held()
    }
}
