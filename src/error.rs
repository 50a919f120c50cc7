//! The library's error type. Every error names what it is about (a file, a tensor, an op) so the
//! CLI can print it as one `error:` line.

use std::path::PathBuf;

/// Everything that can go wrong in mladb's library code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file was read but its contents are malformed.
    #[error("{}: {msg}", path.display())]
    Parse { path: PathBuf, msg: String },
    /// A tensor the model needs is absent from the weights.
    #[error("tensor {name} is missing from {source_desc}")]
    MissingTensor { name: String, source_desc: String },
    /// A tensor has a shape other than the layout implies.
    #[error("tensor {name} in {source_desc}: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        name: String,
        source_desc: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// An allocation would exceed mladb's caps (bad input must never allocate without bound).
    #[error("refusing to allocate {what}: {detail}")]
    Allocation { what: String, detail: String },
    /// Any other invalid input or request, described in words.
    #[error("{0}")]
    Invalid(String),
    /// A call into the CUDA driver, NVRTC or cuBLAS failed; the library's error is the source.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// A failed CUDA library call: what mladb was doing, and the library's own error as the source.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("NVRTC {what}: {source}")]
    Nvrtc {
        what: String,
        #[source]
        source: cudarc::nvrtc::result::NvrtcError,
    },
    #[error("cuBLAS {what}: {source}")]
    Blas {
        what: String,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
}

impl CudaError {
    /// A closure that wraps a driver error with what was being done.
    pub fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        let what = what.into();
        move |source| Error::Cuda(CudaError::Driver { what, source })
    }

    pub fn nvrtc(
        what: impl Into<String>,
    ) -> impl FnOnce(cudarc::nvrtc::result::NvrtcError) -> Error {
        let what = what.into();
        move |source| Error::Cuda(CudaError::Nvrtc { what, source })
    }

    pub fn blas(
        what: impl Into<String>,
    ) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
        let what = what.into();
        move |source| Error::Cuda(CudaError::Blas { what, source })
    }
}

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }

    pub fn parse(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Parse {
            path: path.into(),
            msg: msg.into(),
        }
    }

    /// A RON file that does not parse: where, and what was wrong.
    pub fn ron(path: impl Into<PathBuf>, e: ron::error::SpannedError) -> Self {
        Error::parse(
            path,
            format!(
                "line {}, column {}: {}",
                e.span.start.line, e.span.start.col, e.code
            ),
        )
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// Writing to standard output failed.
    pub fn stdout(source: std::io::Error) -> Self {
        Error::io(STDOUT, source)
    }

    /// Standard output was closed by its reader (`mladb check | head -1`): not a failure of
    /// the command, which should end quietly with status 0, as Unix tools do.
    pub fn is_closed_stdout(&self) -> bool {
        matches!(self, Error::Io { path, source }
            if path.as_os_str() == STDOUT && source.kind() == std::io::ErrorKind::BrokenPipe)
    }
}

/// The name write errors on standard output are reported under.
const STDOUT: &str = "stdout";

/// `text` with control characters escaped (`\u{1b}`), so that an error quoting a file name or
/// a value cannot move the cursor, recolour or clear the terminal, or span several lines.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if ch.is_control() {
            out.extend(ch.escape_unicode());
        } else {
            out.push(ch);
        }
    }
    out
}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_error_keeps_the_library_error_as_its_source() {
        use cudarc::cublas::{result::CublasError, sys::cublasStatus_t};
        let status = cublasStatus_t::CUBLAS_STATUS_EXECUTION_FAILED;
        let e: Error = CudaError::blas("GEMM")(CublasError(status));
        assert!(e.to_string().starts_with("cuBLAS GEMM: "), "{e}");
        let source = std::error::Error::source(&e).expect("the cuBLAS error as the source");
        assert_eq!(
            source.downcast_ref::<CublasError>().map(|c| c.0),
            Some(status)
        );
    }
}
