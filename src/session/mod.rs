//! Saved debugging sessions, in RON. Version 1 holds what a session *is*: the model source, the
//! tokens and schedule, the flags, the breakpoints, the cursor and the user's notes; loading it
//! recomputes the run. Version 2 adds the recorded results ([`recorded`]): every run with its
//! flags, where they took effect, its outcome, and per op the trace event and a bounded sample of
//! values (full tensors optionally in a companion safetensors file), the notes' places in the
//! timeline and `check`'s findings, so a session replays without recomputation. A version 1 file
//! loads as a version 2 session with no recorded results.

pub mod recorded;

use crate::debug::breakpoint::Breakpoint;
use crate::debug::Flags;
use crate::engine::trace::Phase;
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::tensor::Tensor;
use crate::tensor_file::{write_f32, F32Tensor, TensorReader};
use recorded::{Annotation, RecordedCheck, RecordedRun};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The newest session format this build writes (it reads 1 and 2).
pub const VERSION: u32 = 2;

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
    /// v2: notes placed in the timeline (replay shows each when it gets there).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub annotations: Vec<Annotation>,
    /// v2: `mladb check`'s findings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<RecordedCheck>,
    /// v2: the companion safetensors file with every recorded output in full (tensors named
    /// `runN/PHASE/OP`, N indexing `runs`), relative to the session file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<PathBuf>,
    /// v2: a hash of the companion file's bytes (FNV-1a, 64 bits, hex), binding the pair: a
    /// companion from another save (a kill between the two renames) is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors_hash: Option<String>,
    /// v2: the model's layout and a description of its weights, so a replay needs neither the
    /// weights nor the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<crate::model::Layout>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
    /// v2: how kv_b_proj is stored in each layer run, so a replay tells which flags had
    /// nothing to act on as the live debugger did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_b: Option<crate::debug::idle::KvBStorage>,
    /// v2: the recorded runs, in order (main runs in timeline order, comparison runs after the
    /// run they belong to). Empty for a v1 file.
    #[serde(default)]
    pub runs: Vec<RecordedRun>,
}

/// Only the version, read first so a newer file gets a clear error before any field does.
#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

impl Session {
    /// A session with nothing recorded.
    pub fn new(model: ModelSource, schedule: &crate::engine::generate::Schedule) -> Session {
        Session {
            version: VERSION,
            model,
            prompt: schedule.prompt.clone(),
            prefill: schedule.prefill_len,
            decode: schedule.decode_steps,
            layers: (0, 0),
            flags: Flags::default(),
            breakpoints: Vec::new(),
            cursor: None,
            notes: Vec::new(),
            annotations: Vec::new(),
            check: None,
            tensors: None,
            tensors_hash: None,
            layout: None,
            weights: None,
            kv_b: None,
            runs: Vec::new(),
        }
    }

    /// Records the model's layout, weights' description and kv_b_proj storage of the session's
    /// layers (what replay shows without the model); call it once `layers` is set.
    pub fn describe_model(&mut self, model: &crate::model::Model) {
        self.layout = Some(model.layout.clone());
        self.weights = Some(model.weights.describe());
        let layers = self.layers.0..self.layers.1;
        self.kv_b = crate::debug::idle::KvBStorage::of(model, &layers).ok();
    }

    /// The session's schedule.
    pub fn schedule(&self) -> crate::engine::generate::Schedule {
        crate::engine::generate::Schedule {
            prompt: self.prompt.clone(),
            prefill_len: self.prefill,
            decode_steps: self.decode,
        }
    }

    /// The session as RON text.
    pub fn to_ron(&self) -> Result<String> {
        // Depth 5 puts every recorded op on one line: a few MB for a full-size model, and an
        // error's line number says which op.
        let config = ron::ser::PrettyConfig::new().depth_limit(5);
        let text = ron::ser::to_string_pretty(self, config)
            .map_err(|e| Error::invalid(format!("cannot serialise the session: {e}")))?;
        Ok(format!("// mladb session\n{text}\n"))
    }

    /// Writes the session atomically (a crash never leaves half a file in place of a good one).
    pub fn save(&self, path: &Path) -> Result<()> {
        write_atomic(path, self.to_ron()?.as_bytes())
    }

    /// Writes the session and, beside it, a companion safetensors file with full outputs:
    /// `outputs[n]` are run n's op outputs (a missing or shorter list records what it holds).
    /// Both writes are atomic; the companion is written first, so a session never names a
    /// missing file.
    pub fn save_with_tensors(&self, path: &Path, outputs: &[Vec<Arc<Tensor>>]) -> Result<()> {
        let name = companion_name(path)?;
        let companion = path.with_file_name(&name);
        let mut tensors = Vec::new();
        for (n, run) in self.runs.iter().enumerate() {
            let Some(outs) = outputs.get(n) else { continue };
            for (op, out) in run.ops.iter().zip(outs) {
                tensors.push(F32Tensor {
                    name: format!("run{n}/{}", op.event.dump_name()),
                    shape: out.shape(),
                    data: out.data(),
                });
            }
        }
        crate::fsutil::check_output(path)?;
        let hash = write_f32(&companion, None, tensors, "recorded output")?;
        let mut with = self.clone();
        with.tensors = Some(PathBuf::from(name));
        with.tensors_hash = Some(hash_text(hash));
        with.save(path)
    }

    /// Reads a session; a damaged or hand-edited file gives an error naming the line, column and
    /// field (`runs[0].ops[41].event.stats.mean`).
    pub fn load(path: &Path) -> Result<Session> {
        let text = read_bounded(path)?;
        Session::parse(&text).map_err(|msg| Error::parse(path, msg))
    }

    /// Parses session text; the error is the message of [`Session::load`]'s.
    pub fn parse(text: &str) -> std::result::Result<Session, String> {
        let error = |e: ron::error::SpannedError| {
            let (line, col) = (e.span.start.line, e.span.start.col);
            let field = field_path(text, line, col);
            let at = if field.is_empty() {
                String::new()
            } else {
                format!(", field {field}")
            };
            format!("line {line}, column {col}{at}: {}", e.code)
        };
        // The version first: a file from a newer mladb is named as such, not as a bad field.
        if let Ok(v) = ron::from_str::<VersionOnly>(text) {
            if v.version == 0 || v.version > VERSION {
                return Err(format!(
                    "session version {} is not one this build reads (1..={VERSION})",
                    v.version
                ));
            }
        }
        let session: Session = ron::from_str(text).map_err(error)?;
        if session.version == 0 || session.version > VERSION {
            return Err(format!(
                "session version {} is not one this build reads (1..={VERSION})",
                session.version
            ));
        }
        // The recorded layout is what a replay computes sizes from (the Learn view, the memory
        // estimate): it must be one a run could have had.
        if let Some(layout) = &session.layout {
            layout.validate().map_err(|e| format!("layout: {e}"))?;
        }
        if let Some(t) = session.tensors.as_deref().filter(|t| !is_file_name(t)) {
            return Err(not_a_file_name(t));
        }
        if session.version < 2 && (!session.runs.is_empty() || session.tensors.is_some()) {
            return Err(format!(
                "a version {} session cannot hold recorded runs (they came with version 2)",
                session.version
            ));
        }
        recorded::check_annotations(&session.annotations, &session.runs)?;
        for (n, run) in session.runs.iter().enumerate() {
            for (i, op) in run.ops.iter().enumerate() {
                let Some(numel) = crate::debug::sample::numel(&op.event.shape) else {
                    return Err(format!(
                        "runs[{n}].ops[{i}].event.shape: {:?} has more elements than memory can address",
                        op.event.shape
                    ));
                };
                let want = recorded::sample_indices(numel).len();
                if op.sample.len() != want {
                    return Err(format!(
                        "runs[{n}].ops[{i}].sample: {} values where an output of shape {:?} samples {want}",
                        op.sample.len(),
                        op.event.shape
                    ));
                }
            }
        }
        Ok(session)
    }

    /// The full outputs of every run from the companion file, if the session has one:
    /// `[run][op]`, in the ops' shapes. The file is read a tensor at a time, so loading holds the
    /// outputs, not the file's bytes beside them.
    pub fn load_tensors(&self, session_path: &Path) -> Result<Option<Vec<Vec<Arc<Tensor>>>>> {
        let Some((path, reader)) = self.companion(session_path)? else {
            return Ok(None);
        };
        // Every recorded op's tensor, checked against the header before a value is read.
        let mut places: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
        {
            let infos: HashMap<String, &safetensors::tensor::TensorInfo> =
                reader.tensors().into_iter().collect();
            for (n, run) in self.runs.iter().enumerate() {
                for (i, op) in run.ops.iter().enumerate() {
                    let name = format!("run{n}/{}", op.event.dump_name());
                    let Some(info) = infos.get(&name) else {
                        return Err(Error::parse(&path, format!("{name}: not in the file")));
                    };
                    if info.dtype != safetensors::Dtype::F32 {
                        return Err(Error::parse(&path, format!("{name}: not F32")));
                    }
                    // The event's shape is the op's; the stored one need only hold as many values.
                    let numel = crate::debug::sample::numel(&op.event.shape);
                    if crate::debug::sample::numel(&info.shape) != numel {
                        return Err(Error::parse(
                            &path,
                            format!(
                                "{name}: shape {:?} where the session has {:?}",
                                info.shape, op.event.shape
                            ),
                        ));
                    }
                    places.entry(name).or_default().push((n, i));
                }
            }
        }
        let (read, hash) = reader.read_f32(|name, _| places.contains_key(name))?;
        self.check_companion_hash(session_path, &path, hash)?;
        let mut runs: Vec<Vec<Option<Arc<Tensor>>>> =
            self.runs.iter().map(|r| vec![None; r.ops.len()]).collect();
        for t in read {
            let Some((&(n, i), others)) = places.get(&t.name).and_then(|p| p.split_last()) else {
                continue;
            };
            for &(m, j) in others {
                let shape = &self.runs[m].ops[j].event.shape;
                runs[m][j] = Some(Arc::new(Tensor::from_vec(shape, t.values.clone())));
            }
            let shape = &self.runs[n].ops[i].event.shape;
            runs[n][i] = Some(Arc::new(Tensor::from_vec(shape, t.values)));
        }
        // Every op was found in the header above, so every place is filled.
        let runs = runs
            .into_iter()
            .map(|outs| outs.into_iter().collect::<Option<Vec<_>>>())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::parse(&path, "an output the header lists was not read"))?;
        Ok(Some(runs))
    }

    /// Reads the companion file through, if the session has one, and checks that it is the
    /// one its session was saved with (`replay --verify`), holding none of its values.
    pub fn verify_companion(&self, session_path: &Path) -> Result<()> {
        if let Some((path, reader)) = self.companion(session_path)? {
            let (_, hash) = reader.read_f32(|_, _| false)?;
            self.check_companion_hash(session_path, &path, hash)?;
        }
        Ok(())
    }
}

impl Session {
    /// The companion file's path, opened with its header read, if the session has one: a
    /// regular file beside the session, no larger than the recorded outputs need.
    fn companion(&self, session_path: &Path) -> Result<Option<(PathBuf, TensorReader)>> {
        let Some(rel) = &self.tensors else {
            return Ok(None);
        };
        if !is_file_name(rel) {
            return Err(Error::parse(session_path, not_a_file_name(rel)));
        }
        let path = match session_path.parent() {
            Some(dir) => dir.join(rel),
            None => rel.clone(),
        };
        // The recorded outputs in f32, and a generous header (names, shapes, offsets).
        let mut cap: u64 = 64 << 20;
        for run in &self.runs {
            for op in &run.ops {
                let numel = crate::debug::sample::numel(&op.event.shape).unwrap_or(usize::MAX);
                cap = cap
                    .saturating_add((numel as u64).saturating_mul(4))
                    .saturating_add(512);
            }
        }
        let reader = TensorReader::open(&path, cap)?;
        Ok(Some((path, reader)))
    }

    /// Refuses a companion whose bytes hash to other than the session recorded: the pair comes
    /// from two saves (sessions saved before the hash existed are taken as they are).
    fn check_companion_hash(&self, session_path: &Path, path: &Path, hash: u64) -> Result<()> {
        let Some(want) = &self.tensors_hash else {
            return Ok(());
        };
        let found = hash_text(hash);
        if &found != want {
            return Err(Error::parse(
                path,
                format!(
                    "does not match its session {} (hash {found}, the session recorded {want}): \
                     the pair comes from two different saves",
                    session_path.display()
                ),
            ));
        }
        Ok(())
    }
}

/// The session's `tensors` is a plain file name: the companion lies beside the session.
fn is_file_name(rel: &Path) -> bool {
    let mut parts = rel.components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    )
}

/// The error for a `tensors` that is not a plain file name.
fn not_a_file_name(rel: &Path) -> String {
    format!(
        "tensors: {:?} is not a file name: the companion tensors must lie beside the session",
        rel.display().to_string()
    )
}

/// A companion hash as the session writes it.
fn hash_text(hash: u64) -> String {
    format!("{hash:016x}")
}

/// The largest session file read (about two million recorded ops).
const MAX_SESSION_BYTES: u64 = 2 << 30;

/// A session file's text: a regular file (not `/dev/zero` or a FIFO, which would never end) of
/// at most [`MAX_SESSION_BYTES`].
fn read_bounded(path: &Path) -> Result<String> {
    crate::input::read_text_capped(path, MAX_SESSION_BYTES)
}

/// The companion file's name: `NAME.tensors.safetensors` for `NAME.ron`.
pub fn companion_name(path: &Path) -> Result<String> {
    let stem = path
        .file_stem()
        .ok_or_else(|| Error::invalid(format!("{}: not a file path", path.display())))?;
    Ok(format!("{}.tensors.safetensors", stem.to_string_lossy()))
}

/// The field at (line, column) of RON text, as a path from the top (`runs[0].ops[41].sample`):
/// a scan that follows nesting, list indices and `name:` keys, skipping strings and comments.
pub fn field_path(text: &str, line: usize, col: usize) -> String {
    struct Frame {
        list: bool,
        field: Option<String>,
        index: usize,
    }
    let mut stack = vec![Frame {
        list: false,
        field: None,
        index: 0,
    }];
    // Bytes, not a list of chars: the text may be 2 GiB. Every character the scan looks for
    // is ASCII; columns count characters (UTF-8 continuation bytes do not advance them).
    let chars = text.as_bytes();
    let (mut l, mut c) = (1usize, 1usize);
    let mut i = 0;
    let advance = |ch: u8, l: &mut usize, c: &mut usize| {
        if ch == b'\n' {
            *l += 1;
            *c = 1;
        } else if ch & 0xC0 != 0x80 {
            *c += 1;
        }
    };
    while i < chars.len() && (l, c) < (line, col) {
        let ch = chars[i];
        if ch == b'"' {
            advance(ch, &mut l, &mut c);
            i += 1;
            while i < chars.len() && chars[i] != b'"' {
                if chars[i] == b'\\' && i + 1 < chars.len() {
                    advance(chars[i], &mut l, &mut c);
                    i += 1;
                }
                advance(chars[i], &mut l, &mut c);
                i += 1;
            }
        } else if ch == b'/' && chars.get(i + 1) == Some(&b'/') {
            while i < chars.len() && chars[i] != b'\n' {
                advance(chars[i], &mut l, &mut c);
                i += 1;
            }
            continue;
        } else if ch.is_ascii_alphabetic() || ch == b'_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == b'_') {
                advance(chars[i], &mut l, &mut c);
                i += 1;
            }
            let word = String::from_utf8_lossy(&chars[start..i]).into_owned();
            let mut j = i;
            while j < chars.len() && chars[j] == b' ' {
                j += 1;
            }
            if chars.get(j) == Some(&b':') {
                if let Some(top) = stack.last_mut() {
                    top.field = Some(word);
                }
            }
            continue;
        } else if matches!(ch, b'(' | b'[' | b'{') {
            stack.push(Frame {
                list: ch == b'[',
                field: None,
                index: 0,
            });
        } else if matches!(ch, b')' | b']' | b'}') {
            if stack.len() > 1 {
                stack.pop();
            }
        } else if ch == b',' {
            if let Some(top) = stack.last_mut() {
                top.index += 1;
                if !top.list {
                    top.field = None;
                }
            }
        }
        advance(ch, &mut l, &mut c);
        i += 1;
    }
    let mut path = String::new();
    for f in &stack {
        if f.list {
            path.push_str(&format!("[{}]", f.index));
        }
        if let Some(name) = &f.field {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(name);
        }
    }
    path
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
    let config =
        crate::input::read_capped(&dir.join("config.json"), crate::input::MAX_CONFIG_BYTES)?;
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
        let mut s = Session::new(
            ModelSource::Layout {
                layout: "glm5-tiny".into(),
                seed: 3,
                quant: None,
            },
            &crate::engine::generate::Schedule {
                prompt: vec![1, 2, 3],
                prefill_len: 2,
                decode_steps: 1,
            },
        );
        s.layers = (0, 4);
        s.flags = Flags::parse("mla-disable,inject=softmax-scale-latent").unwrap();
        s.breakpoints = vec![Breakpoint::NanInf, Breakpoint::Layer(2)];
        s.cursor = Some(Cursor {
            phase: Phase::Decode(0),
            op: "logits".into(),
        });
        s.notes = vec!["absorbed path looks off".into()];
        s.save(&path).unwrap();
        assert_eq!(Session::load(&path).unwrap(), s);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("prefill: 2", "prefill: \"two\"")).unwrap();
        let err = Session::load(&path).unwrap_err().to_string();
        assert!(err.contains("line ") && err.contains("s.ron"), "{err}");
        std::fs::write(&path, &text[..text.len() / 2]).unwrap();
        assert!(Session::load(&path).is_err());
    }

    #[test]
    fn a_version_1_file_loads_with_nothing_recorded() {
        let text = r#"// mladb session
(
    version: 1,
    model: Layout(layout: "glm5-tiny", seed: 0),
    prompt: [1, 2, 3],
    prefill: 3,
    decode: 1,
    layers: (0, 4),
    flags: (mla_disable: false, prefill_path: naive, decode_path: absorbed, force_dequant: false, device: cpu, dtype: f32, faults: ["output-buffer-disconnect"]),
    breakpoints: [],
    cursor: None,
    notes: ["a note"],
)
"#;
        let s = Session::parse(text).unwrap();
        assert_eq!(s.version, 1);
        assert!(s.runs.is_empty() && s.annotations.is_empty() && s.check.is_none());
        assert_eq!(s.notes, vec!["a note".to_string()]);
        let newer = text.replace("version: 1", "version: 9");
        assert!(Session::parse(&newer).unwrap_err().contains("version 9"));
    }

    #[test]
    fn field_paths_follow_nesting() {
        let text =
            "(\n  a: 1,\n  runs: [\n    (ops: [(x: 1), (x: 2, y: \"s,(\", z: oops)]),\n  ],\n)";
        let line = 4;
        let col = text.lines().nth(3).unwrap().find("oops").unwrap() + 1;
        assert_eq!(field_path(text, line, col), "runs[0].ops[1].z");
    }
}
