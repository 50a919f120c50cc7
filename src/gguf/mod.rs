//! GGUF, the single-file model format of ggml / llama.cpp: a reader, a small writer, and the
//! block quantization formats its tensors are stored in.
//!
//! Layout of a file (little-endian; versions 2 and 3 are read, version 3 is written):
//!
//! ```text
//! "GGUF" u32 version  u64 n_tensors  u64 n_metadata
//! n_metadata × (string key, u32 value type, value)
//! n_tensors  × (string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 ggml type,
//!               u64 offset into the data section)
//! padding to `general.alignment` (default 32), then the data section
//! ```
//!
//! A string is a u64 byte length followed by that many bytes; an array is a u32 element type,
//! a u64 count, then the elements. Dimensions are listed fastest first (`ne0` = columns), so the
//! row-major shape used everywhere else in mladb is the reverse: [`TensorInfo::shape`].
//!
//! The reader treats the file as hostile: every count and size is checked against the bytes
//! actually present before anything is allocated, all size arithmetic is checked, and each
//! problem is reported as an [`Error::Parse`](crate::Error::Parse) naming the file and the field.
//! (The public llama.cpp advisories on GGUF were all unchecked size arithmetic.)

pub mod kquant;
pub mod quant;
pub mod reader;
pub mod value;
pub mod writer;

pub use quant::{dequantize, dequantize_into, dequantize_into_par, quantize, GgmlType};
pub use reader::{GgufFile, TensorInfo};
pub use value::{Array, Value, ValueType};
pub use writer::GgufWriter;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides [`DEFAULT_ALIGNMENT`] (a u32 power of two).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`: no tensor has more dimensions.
pub const MAX_DIMS: usize = 4;
