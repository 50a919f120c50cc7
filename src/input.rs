//! Reading the files a user names: only regular files, and text files only up to a size cap per
//! kind, so that a device (`/dev/zero`), a FIFO or a huge file gives an `error:` instead of a
//! hang or an unbounded allocation.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The largest `config.json` read.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The largest safetensors index read (a 1,000-shard checkpoint's is a few MB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// The largest layout file read.
pub const MAX_LAYOUT_BYTES: u64 = 4 << 20;
/// The largest key bindings file read.
pub const MAX_KEYS_BYTES: u64 = 1 << 20;

/// Opens `path` for reading if it is a regular file (symbolic links followed). A FIFO is opened
/// non-blocking, so it cannot wait for a writer, and refused like a device, a socket or a
/// directory.
pub fn open_regular(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::parse(path, "not a regular file"));
    }
    // Back to blocking reads (a regular file never blocks anyway).
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a file descriptor this function owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(file)
}

/// A regular file of at most `cap` bytes, open for reading, and its length.
pub fn open_capped(path: &Path, cap: u64) -> Result<(File, u64)> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > cap {
        return Err(too_large(path, len, cap));
    }
    Ok((file, len))
}

/// What a file that is not a regular one is, in words.
pub fn kind_of(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a regular file"
    }
}

/// The bytes of a regular file of at most `cap` bytes.
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let (file, len) = open_capped(path, cap)?;
    let mut bytes = Vec::with_capacity(len as usize);
    // The file may grow while it is read: never past the cap.
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > cap {
        return Err(too_large(path, bytes.len() as u64, cap));
    }
    Ok(bytes)
}

/// The text of a regular file of at most `cap` bytes; a file holding a NUL byte is not text
/// (a sparse or binary file is refused without being scanned further).
pub fn read_text_capped(path: &Path, cap: u64) -> Result<String> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > cap {
        return Err(too_large(path, len, cap));
    }
    let mut head = Vec::with_capacity(4096.min(len as usize));
    let mut file = file;
    file.by_ref()
        .take(4096)
        .read_to_end(&mut head)
        .map_err(|e| Error::io(path, e))?;
    if head.contains(&0) {
        return Err(Error::parse(
            path,
            "binary data (a NUL byte): not a text file",
        ));
    }
    let mut bytes = head;
    bytes.reserve(len as usize - bytes.len().min(len as usize));
    file.take(cap + 1 - bytes.len() as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > cap {
        return Err(too_large(path, bytes.len() as u64, cap));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::parse(
            path,
            format!("not UTF-8 text (at byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

fn too_large(path: &Path, len: u64, cap: u64) -> Error {
    Error::parse(
        path,
        format!(
            "{} is larger than the {} this file may hold",
            bytes(len),
            bytes(cap)
        ),
    )
}

/// A byte count in words: `512 MiB`, `2.0 GiB`.
pub fn bytes(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_directories_are_refused() {
        for p in ["/dev/zero", "/dev/null", "/"] {
            let e = read_capped(Path::new(p), 10).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }

    #[test]
    fn caps_and_nul_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"hello").unwrap();
        assert_eq!(read_text_capped(&p, 5).unwrap(), "hello");
        assert!(read_text_capped(&p, 4)
            .unwrap_err()
            .to_string()
            .contains("larger than"));
        std::fs::write(&p, b"he\0llo").unwrap();
        assert!(read_text_capped(&p, 100)
            .unwrap_err()
            .to_string()
            .contains("NUL"));
    }
}
