//! File writing that never leaves a half-written file in place of a good one.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Refuses an output target that must not be replaced: anything but a regular file or a new
/// path (a device such as `/dev/full`, a FIFO, a socket, a directory), a symbolic link, or a
/// read-only file. Called before a run starts, so a bad `--dump` or `--record` costs nothing.
pub fn check_output(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let refuse = |why: String| Err(Error::invalid(format!("{}: {why}", path.display())));
    if path.file_name().is_none() {
        return refuse("not a file path".into());
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let dir = parent_dir(path);
            match std::fs::metadata(dir) {
                Ok(m) if m.is_dir() => Ok(()),
                Ok(_) => refuse(format!("{} is not a directory", dir.display())),
                Err(e) => Err(Error::io(dir, e)),
            }
        }
        Err(e) => Err(Error::io(path, e)),
        Ok(m) if m.file_type().is_symlink() => {
            refuse("is a symbolic link: refusing to replace it (name its target instead)".into())
        }
        Ok(m) if !m.is_file() => refuse(format!(
            "not a regular file ({}): refusing to write over it",
            crate::input::kind_of(&m.file_type())
        )),
        Ok(m) if m.permissions().mode() & 0o222 == 0 => {
            refuse("read-only: refusing to replace it".into())
        }
        Ok(_) => Ok(()),
    }
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The temporary files of `path` are `.NAME.mladb-tmp-PID`, beside it.
const TMP_MARK: &str = ".mladb-tmp-";

/// Removes temporaries of `path` left by processes that no longer exist (killed mid-write):
/// files, or whole directories (see [`create_dir_atomic`]).
fn remove_stale_temporaries(dir: &Path, file_name: &str) {
    let prefix = format!(".{file_name}{TMP_MARK}");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if pid > 0 && pid as u32 != std::process::id() && !process_exists(pid) {
            match entry.file_type() {
                Ok(t) if t.is_dir() => {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
                _ => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
}

/// Whether a process of that id exists (it may belong to another user).
fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, flushed to disk, then renamed
/// over the target. A crash or a full disk leaves the old file (or none) intact. A target that
/// [`check_output`] refuses is left alone.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes).map_err(|e| Error::io(path, e)))
}

/// [`write_atomic`] for a writer that streams the file: `write` writes it, a buffer at a time, into
/// a new temporary beside `path` (named as [`temporary_beside`] says, so one a kill leaves is
/// removed by a later write), which is then flushed to disk and renamed over the target. On any
/// error the temporary is removed and the old file stays as it was.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    let tmp = temporary_beside(path)?;
    let io = |e| Error::io(path, e);
    let result = (|| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io)?;
        let mut buffered = std::io::BufWriter::with_capacity(1 << 20, file);
        write(&mut buffered)?;
        let file = buffered.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The temporary an atomic write of `path` goes through (`.NAME.mladb-tmp-PID` beside it, nothing
/// there), once [`check_output`] accepts `path`; stale ones of dead processes are removed.
fn temporary_beside(path: &Path) -> Result<PathBuf> {
    check_output(path)?;
    let dir = parent_dir(path);
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::invalid(format!("{}: not a file path", path.display())))?
        .to_string_lossy()
        .into_owned();
    remove_stale_temporaries(dir, &file_name);
    let tmp = dir.join(format!(".{file_name}{TMP_MARK}{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    Ok(tmp)
}

/// Creates the directory `path` whole or not at all: `fill` writes into a temporary directory
/// beside it (`.NAME.mladb-tmp-PID`), whose files are flushed to disk before it is renamed into
/// place. A `path` that exists is refused unless it is an empty directory (which the rename
/// replaces), so nothing already there is ever written over. On failure the temporary
/// directory is removed; one left by a killed process is removed by the next call.
pub fn create_dir_atomic<T>(path: &Path, fill: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    let refuse = |why: &str| Err(Error::invalid(format!("{}: {why}", path.display())));
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return refuse("not a directory path");
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(path, e)),
        Ok(m) if m.file_type().is_symlink() => {
            return refuse("is a symbolic link: refusing to write through it")
        }
        Ok(m) if !m.is_dir() => {
            return refuse("exists and is not a directory: refusing to replace it")
        }
        Ok(_) => {
            let mut entries = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
            if entries.next().is_some() {
                return refuse("exists and is not empty: refusing to write over it");
            }
        }
    }
    let parent = parent_dir(path);
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return refuse(&format!("{} is not a directory", parent.display())),
        Err(e) => return Err(Error::io(parent, e)),
    }
    remove_stale_temporaries(parent, &name);
    let tmp = parent.join(format!(".{name}{TMP_MARK}{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let result = fill(&tmp).and_then(|value| {
        sync_files(&tmp)?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
        // The rename itself reaches the disk with the parent directory's entry.
        if let Ok(dir) = std::fs::File::open(parent) {
            let _ = dir.sync_all();
        }
        Ok(value)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Flushes every file of a directory (not recursive) and the directory itself to disk.
fn sync_files(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.is_file() {
            let f = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
            f.sync_all().map_err(|e| Error::io(&path, e))?;
        }
    }
    let d = std::fs::File::open(dir).map_err(|e| Error::io(dir, e))?;
    d.sync_all().map_err(|e| Error::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_streamed_write_that_fails_keeps_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        let failed = write_atomic_with(&path, |w| {
            w.write_all(&[7; 3 << 20]).unwrap();
            Err(Error::invalid("interrupted"))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        write_atomic_with(&path, |w| {
            w.write_all(b"new").map_err(|e| Error::io(&path, e))
        })
        .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
    }

    #[test]
    fn a_link_left_at_the_temporary_is_removed_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("other.bin");
        std::fs::write(&other, b"keep").unwrap();
        std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o600)).unwrap();
        let out = dir.path().join("out.bin");
        let tmp = dir
            .path()
            .join(format!(".out.bin{TMP_MARK}{}", std::process::id()));
        std::os::unix::fs::symlink(&other, &tmp).unwrap();
        write_atomic(&out, b"new").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"new");
        assert!(!std::fs::symlink_metadata(&out).unwrap().is_symlink());
        assert_eq!(std::fs::read(&other).unwrap(), b"keep");
        let mode = std::fs::metadata(&other).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the link's target keeps its mode");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("out.bin");
        assert!(write_atomic(&path, b"x").is_err());
    }

    #[test]
    fn a_directory_appears_whole_or_not_at_all() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("ckpt");
        let failed: Result<()> = create_dir_atomic(&out, |tmp| {
            std::fs::write(tmp.join("a"), b"1").unwrap();
            Err(Error::invalid("interrupted"))
        });
        assert!(failed.is_err());
        assert_eq!(
            std::fs::read_dir(root.path()).unwrap().count(),
            0,
            "no trace left"
        );
        create_dir_atomic(&out, |tmp| {
            std::fs::write(tmp.join("a"), b"1").map_err(|e| Error::io(tmp, e))
        })
        .unwrap();
        assert_eq!(std::fs::read(out.join("a")).unwrap(), b"1");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
        let orphan = root.path().join("missing").join("ckpt");
        let e = create_dir_atomic(&orphan, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing: No such file"), "{e}");
        let again = create_dir_atomic(&out, |_| Ok(())).unwrap_err().to_string();
        assert!(again.contains("exists and is not empty"), "{again}");
        assert_eq!(std::fs::read(out.join("a")).unwrap(), b"1", "left alone");
        // An empty directory is filled.
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        create_dir_atomic(&empty, |tmp| {
            std::fs::write(tmp.join("b"), b"2").map_err(|e| Error::io(tmp, e))
        })
        .unwrap();
        assert_eq!(std::fs::read(empty.join("b")).unwrap(), b"2");
    }
}
