//! The CUDA backend: mladb's own kernels (kernels/*.cu, compiled by NVRTC at run time) and cuBLAS
//! GEMMs, through cudarc with dynamic loading so that the crate builds without a toolkit.

pub mod compile;
