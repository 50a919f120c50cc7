//! Text in and out: a checkpoint's `tokenizer.json` (HF's format, read by the `tokenizers`
//! crate) turns `--prompt` text into token ids and shows generated ids as text. mladb runs on
//! ids throughout; text is only where a person reads or writes it, so ids and text never
//! disagree.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The largest tokenizer file read (real ones are a few to tens of MB).
const MAX_BYTES: u64 = 256 << 20;

/// A loaded tokenizer and where it came from.
pub struct TextCodec {
    inner: tokenizers::Tokenizer,
    pub path: PathBuf,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextCodec({})", self.path.display())
    }
}

impl TextCodec {
    pub fn load(path: &Path) -> Result<TextCodec> {
        let file = crate::input::open_regular(path)?;
        let size = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if size > MAX_BYTES {
            return Err(Error::parse(
                path,
                format!("{size} bytes; a tokenizer file is at most {MAX_BYTES}"),
            ));
        }
        let mut bytes = Vec::with_capacity(size as usize);
        use std::io::Read;
        file.take(MAX_BYTES)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::parse(path, format!("not a tokenizer.json (HF tokenizers): {e}"))
        })?;
        Ok(TextCodec {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// The tokenizer of a run: `--tokenizer FILE`, else the checkpoint directory's
    /// `tokenizer.json` when it has one.
    pub fn find(given: Option<&Path>, checkpoint: Option<&Path>) -> Result<Option<TextCodec>> {
        if let Some(p) = given {
            return TextCodec::load(p).map(Some);
        }
        match checkpoint.map(|d| d.join("tokenizer.json")) {
            Some(p) if p.is_file() => TextCodec::load(&p).map(Some),
            _ => Ok(None),
        }
    }

    /// The ids of `text`, with the special tokens the tokenizer adds to a plain input (what
    /// `tokenizer(text)` gives in transformers); each must fit a vocabulary of `vocab`.
    pub fn encode(&self, text: &str, vocab: usize) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::invalid(format!("--prompt: the tokenizer failed: {e}")))?;
        let ids = enc.get_ids().to_vec();
        if ids.is_empty() {
            return Err(Error::invalid(format!(
                "--prompt {text:?} has no tokens in {}",
                self.path.display()
            )));
        }
        if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(format!(
                "--prompt: {} gives token {t}, outside the model's vocabulary of {vocab} (another model's tokenizer?)",
                self.path.display()
            )));
        }
        Ok(ids)
    }

    /// The text of `ids`, as one string (special tokens shown).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner
            .decode(ids, false)
            .unwrap_or_else(|e| format!("<not decodable: {e}>"))
    }

    /// Each id's own text: what one generated token reads as.
    pub fn pieces(&self, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&t| self.decode(&[t])).collect()
    }
}

/// Text as one line for a terminal: control characters and newlines escaped, long text cut.
pub fn shown(text: &str) -> String {
    let mut s: String = text
        .chars()
        .take(200)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().count() > 200 {
        s.push('…');
    }
    format!("\"{s}\"")
}
