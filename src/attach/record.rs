//! What `mladb attach --save DIR` keeps of an attachment, and what `--replay` reads back: each
//! connection's frames, in the order they came, in a file of its own (`rank0.frames`, or
//! `rank0-conn3.frames` when a rank connects again), in the wire format itself. The hook's
//! `file:PATH` address writes the same files, so a hook run without a server can be compared
//! later too. A file is written under a temporary name and renamed once its connection ends (or
//! the server stops, Ctrl-C included), so a file with the final name is whole; nothing already
//! in the directory is replaced.

use super::import::{Cursor, Importer, Record};
use super::wire::{encode, read_frame, Body, Dtype, Frame, Limits};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Writes each connection's frames to its file in `dir`.
pub struct Recorder {
    dir: PathBuf,
    open: HashMap<u64, Open>,
    /// Files finished so far.
    pub saved: Vec<PathBuf>,
}

struct Open {
    out: BufWriter<File>,
    partial: PathBuf,
    path: PathBuf,
}

impl Recorder {
    /// Records into `dir` (made if missing).
    pub fn new(dir: &Path) -> Result<Recorder> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        Ok(Recorder {
            dir: dir.to_path_buf(),
            open: HashMap::new(),
            saved: Vec::new(),
        })
    }

    /// Writes a frame of connection `conn`; its hello opens the connection's file.
    pub fn frame(&mut self, conn: u64, frame: &Frame) -> Result<()> {
        if let Body::Hello { rank, .. } = &frame.header.body {
            let free = |name: String| {
                let path = self.dir.join(&name);
                (!path.exists() && !self.dir.join(format!(".{name}.partial")).exists())
                    .then_some((path, self.dir.join(format!(".{name}.partial"))))
            };
            let (path, partial) = free(format!("rank{rank}.frames"))
                .or_else(|| free(format!("rank{rank}-conn{conn}.frames")))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "--save: {} already holds rank{rank}.frames and rank{rank}-conn{conn}.frames; nothing is replaced (save into another directory)",
                        self.dir.display()
                    ))
                })?;
            let file = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
            self.open.insert(
                conn,
                Open {
                    out: BufWriter::new(file),
                    partial,
                    path,
                },
            );
        }
        let Some(open) = self.open.get_mut(&conn) else {
            return Ok(());
        };
        let bytes = encode(&frame.header, &frame.payload)?;
        open.out
            .write_all(&bytes)
            .map_err(|e| Error::io(&open.partial, e))
    }

    /// The connection ended: its file gets its final name.
    pub fn close(&mut self, conn: u64) -> Result<()> {
        let Some(mut open) = self.open.remove(&conn) else {
            return Ok(());
        };
        open.out.flush().map_err(|e| Error::io(&open.partial, e))?;
        open.out
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&open.partial, e))?;
        std::fs::rename(&open.partial, &open.path).map_err(|e| Error::io(&open.path, e))?;
        self.saved.push(open.path);
        Ok(())
    }

    /// Closes every connection still open (the server stopped).
    pub fn finish(&mut self) -> Result<()> {
        let mut conns: Vec<u64> = self.open.keys().copied().collect();
        conns.sort_unstable();
        for conn in conns {
            self.close(conn)?;
        }
        Ok(())
    }
}

/// The frame files `paths` name: files as given, directories as their `*.frames` files in name
/// order. An empty list is an error.
pub fn frame_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| Error::io(p, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.extension().is_some_and(|x| x == "frames") && f.is_file())
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(Error::invalid(format!(
                    "--replay: {} holds no .frames file",
                    p.display()
                )));
            }
            files.extend(found);
        } else {
            files.push(p.clone());
        }
    }
    Ok(files)
}

/// One rank's hook frame file into the importer (`mladb_hook.attach(model, "file:...")`, `attach
/// --save`) in order; returns how many tensors the hook dropped because its queue was full.
pub fn import_frames(importer: &mut Importer, file: &Path, limits: Limits) -> Result<u64> {
    let mut frames = Frames::open(file, limits)?;
    let mut cursor: Option<Cursor> = None;
    let name = file.display().to_string();
    let mut dropped = 0;
    while let Some(frame) = frames.next_frame()? {
        let record = match frame.header.body {
            Body::Hello {
                engine,
                model,
                rank,
                world_size,
            } => Record::Hello {
                engine,
                model,
                rank,
                world: world_size,
            },
            Body::Step {
                step,
                tokens,
                positions,
                ..
            } => Record::Step {
                step,
                tokens,
                positions,
            },
            Body::Tensor {
                module,
                dtype,
                shape,
                ptr,
                kernel_out_ptr,
            } => Record::Tensor {
                module,
                shape: shape.iter().map(|&n| n as usize).collect(),
                data: dtype.values(&frame.payload),
                low_precision: matches!(dtype, Dtype::Bf16 | Dtype::F16),
                ptr,
                kernel_out_ptr,
            },
            Body::Bye { dropped: d } => {
                dropped += d;
                continue;
            }
        };
        importer.take(&mut cursor, record, &name)?;
    }
    Ok(dropped)
}

/// One file's frames, read in order, one at a time.
pub struct Frames {
    reader: std::io::BufReader<File>,
    path: PathBuf,
    limits: Limits,
}

impl Frames {
    pub fn open(path: &Path, limits: Limits) -> Result<Frames> {
        Ok(Frames {
            reader: std::io::BufReader::new(crate::input::open_regular(path)?),
            path: path.to_path_buf(),
            limits,
        })
    }

    /// The next frame, `None` at the end; a file that breaks off inside a frame, or holds
    /// anything but frames, is an error naming it.
    pub fn next_frame(&mut self) -> Result<Option<Frame>> {
        read_frame(&mut self.reader, self.limits)
            .map_err(|e| Error::parse(&self.path, e.to_string()))
    }
}
