//! Kernels compiled in an earlier run, kept on disk: NVRTC is most of a run's start (about
//! 30 seconds for every kernel file on an H200 host, against 3 seconds for a whole full-size
//! GLM-5 pass). A file's PTX depends only on its source, the target, NVRTC's flags and version,
//! which make the key; an entry that does not read back whole under its key is compiled again.
//!
//! The cache lives in `$MLADB_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/mladb/kernels`, else
//! `~/.cache/mladb/kernels`; `MLADB_CACHE_DIR=off` turns it off. A cache that cannot be written
//! costs only the compile.

use super::compile::{compile, describe_version, full_source, NVRTC_FLAGS};
use crate::error::Result;
use std::path::{Path, PathBuf};

/// The PTX (or cubin) of kernel file `file` for `target`, from the cache or compiled now (and
/// then kept).
pub fn compile_cached(file: &str, src: &str, target: &str) -> Result<Vec<u8>> {
    let key = cache_key(&describe_version(), src, target);
    let path = cache_dir().map(|d| d.join(format!("{file}-{target}-{key:016x}")));
    if let Some(code) = path.as_deref().and_then(|p| read_entry(p, key)) {
        return Ok(code);
    }
    let code = compile(file, src, target)?.code;
    if let Some(p) = &path {
        // A cache that cannot be written only costs the next run this compile.
        let _ = write_entry(p, key, &code);
    }
    Ok(code)
}

/// The key of a file's compiled form: FNV-1a over NVRTC's version, the target, the flags and
/// the whole source.
fn cache_key(nvrtc: &str, src: &str, target: &str) -> u64 {
    let flags = NVRTC_FLAGS.join(" ");
    let parts = [nvrtc, target, &flags, &full_source(src)];
    parts.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, part| {
        part.bytes()
            .chain([0u8])
            .fold(h, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
    })
}

fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = match env("MLADB_CACHE_DIR") {
        Some(d) if d.as_os_str() == "off" => return None,
        Some(d) => d.join("kernels"),
        None => env("XDG_CACHE_HOME")
            .or_else(|| env("HOME").map(|h| h.join(".cache")))?
            .join("mladb/kernels"),
    };
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
}

/// The most an entry may hold (the largest PTX is a few MB).
const ENTRY_CAP: u64 = 64 << 20;

/// An entry: a header line naming the key and the length, then the code.
fn header(key: u64, len: usize) -> String {
    format!("mladb kernel cache 1 {key:016x} {len}\n")
}

fn read_entry(path: &Path, key: u64) -> Option<Vec<u8>> {
    let bytes = crate::input::read_capped(path, ENTRY_CAP).ok()?;
    let end = bytes.iter().position(|&b| b == b'\n')? + 1;
    let code = &bytes[end..];
    (bytes[..end] == *header(key, code.len()).as_bytes()).then(|| code.to_vec())
}

fn write_entry(path: &Path, key: u64, code: &[u8]) -> Result<()> {
    let mut bytes = header(key, code.len()).into_bytes();
    bytes.extend_from_slice(code);
    crate::fsutil::write_atomic(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_only_whole_and_under_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mla.cu-compute_90-1");
        let key = cache_key("NVRTC 13.0", "__global__ void k() {}", "compute_90");
        write_entry(&path, key, b"ptx text").unwrap();
        assert_eq!(read_entry(&path, key).as_deref(), Some(&b"ptx text"[..]));
        assert_eq!(read_entry(&path, key ^ 1), None, "another key");
        // Truncated, or grown, or without a header: compiled again.
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() - 1]).unwrap();
        assert_eq!(read_entry(&path, key), None);
        std::fs::write(&path, [&whole[..], b"x"].concat()).unwrap();
        assert_eq!(read_entry(&path, key), None);
        std::fs::write(&path, b"ptx text").unwrap();
        assert_eq!(read_entry(&path, key), None);
        assert_eq!(read_entry(&dir.path().join("absent"), key), None);
    }

    #[test]
    fn the_key_follows_the_source_the_target_and_nvrtc() {
        let k = |v: &str, s: &str, t: &str| cache_key(v, s, t);
        let base = k("NVRTC 13.0", "a", "compute_90");
        assert_ne!(base, k("NVRTC 13.1", "a", "compute_90"));
        assert_ne!(base, k("NVRTC 13.0", "b", "compute_90"));
        assert_ne!(base, k("NVRTC 13.0", "a", "compute_90a"));
        // The parts are delimited: moving a byte from one to the next changes the key.
        assert_ne!(k("ab", "c", "t"), k("a", "bc", "t"));
        assert_eq!(base, k("NVRTC 13.0", "a", "compute_90"));
    }
}
