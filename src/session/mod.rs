//! Saved debugging sessions, in RON. Version 1 holds what a session *is*: the model source, the
//! tokens and schedule, the flags, the breakpoints, the cursor and the user's notes; loading it
//! recomputes the run. (Recorded results, for replay without recomputation, are a later version
//! of this file; every version the project ships stays loadable.)

use crate::debug::breakpoint::Breakpoint;
use crate::debug::Flags;
use crate::engine::trace::Phase;
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The newest session format this build writes.
pub const VERSION: u32 = 1;

/// Where the model of a session comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ModelSource {
    /// A built-in layout name or a .ron path, with synthetic weights from `seed`, quantized at
    /// load when `quant` names a type (`--quant`).
    Layout {
        layout: String,
        seed: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quant: Option<String>,
    },
    /// An HF checkpoint directory or a GGUF file; `fingerprint` notices a changed one.
    Checkpoint {
        path: PathBuf,
        fingerprint: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quant: Option<String>,
    },
}

/// Where the cursor stood: an op of a phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cursor {
    pub phase: Phase,
    pub op: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Session {
    pub version: u32,
    pub model: ModelSource,
    pub prompt: Vec<u32>,
    pub prefill: usize,
    pub decode: usize,
    /// Decoder layers run: start..end.
    pub layers: (usize, usize),
    pub flags: Flags,
    #[serde(default)]
    pub breakpoints: Vec<Breakpoint>,
    #[serde(default)]
    pub cursor: Option<Cursor>,
    #[serde(default)]
    pub notes: Vec<String>,
}

impl Session {
    /// Writes the session atomically (a crash never leaves half a file in place of a good one).
    pub fn save(&self, path: &Path) -> Result<()> {
        let config = ron::ser::PrettyConfig::new().depth_limit(4);
        let text = ron::ser::to_string_pretty(self, config)
            .map_err(|e| Error::invalid(format!("cannot serialise the session: {e}")))?;
        write_atomic(path, format!("// mladb session\n{text}\n").as_bytes())
    }

    /// Reads a session; a damaged or hand-edited file gives an error naming the line and field.
    pub fn load(path: &Path) -> Result<Session> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let session: Session = ron::from_str(&text).map_err(|e| {
            Error::parse(
                path,
                format!(
                    "line {}, column {}: {}",
                    e.span.start.line, e.span.start.col, e.code
                ),
            )
        })?;
        if session.version == 0 || session.version > VERSION {
            return Err(Error::parse(
                path,
                format!(
                    "session version {} is not one this build reads (1..={VERSION})",
                    session.version
                ),
            ));
        }
        Ok(session)
    }
}

/// A cheap fingerprint of a checkpoint directory: its config.json and the names and sizes of its
/// safetensors files (hashing hundreds of GB is not cheap).
pub fn checkpoint_fingerprint(dir: &Path) -> Result<String> {
    use crate::model::weights::synthetic::fnv1a64;
    if dir.is_file() {
        // A GGUF file: its size and a hash of its first 16 MiB (header, metadata, tensor
        // table and the start of the data), so a 400 GB file is not read end to end.
        use std::io::Read;
        let mut f = std::fs::File::open(dir).map_err(|e| Error::io(dir, e))?;
        let size = f.metadata().map_err(|e| Error::io(dir, e))?.len();
        let mut head = Vec::new();
        f.by_ref()
            .take(16 << 20)
            .read_to_end(&mut head)
            .map_err(|e| Error::io(dir, e))?;
        return Ok(format!("size:{size},head:{:016x}", fnv1a64(&head)));
    }
    let config = std::fs::read(dir.join("config.json"))
        .map_err(|e| Error::io(dir.join("config.json"), e))?;
    let mut parts = vec![format!("{:016x}", fnv1a64(&config))];
    let mut files: Vec<(String, u64)> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().map(|m| m.len()).unwrap_or(0),
            )
        })
        .collect();
    files.sort();
    parts.extend(files.iter().map(|(n, s)| format!("{n}:{s}")));
    Ok(parts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.ron");
        let s = Session {
            version: VERSION,
            model: ModelSource::Layout {
                layout: "glm5-tiny".into(),
                seed: 3,
                quant: None,
            },
            prompt: vec![1, 2, 3],
            prefill: 2,
            decode: 1,
            layers: (0, 4),
            flags: Flags::parse("mla-disable,inject=softmax-scale-latent").unwrap(),
            breakpoints: vec![Breakpoint::NanInf, Breakpoint::Layer(2)],
            cursor: Some(Cursor {
                phase: Phase::Decode(0),
                op: "logits".into(),
            }),
            notes: vec!["absorbed path looks off".into()],
        };
        s.save(&path).unwrap();
        assert_eq!(Session::load(&path).unwrap(), s);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("prefill: 2", "prefill: \"two\"")).unwrap();
        let err = Session::load(&path).unwrap_err().to_string();
        assert!(err.contains("line ") && err.contains("s.ron"), "{err}");
        std::fs::write(&path, &text[..text.len() / 2]).unwrap();
        assert!(Session::load(&path).is_err());
    }
}
