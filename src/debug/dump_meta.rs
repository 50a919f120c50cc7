//! A dump's metadata: which run made it (tokens, prefill, decode count, generated tokens), the
//! model, the flags, the producer and the precision of its values, as safetensors `__metadata__`
//! strings, so that a run is never compared with a dump of other tokens.

use std::collections::HashMap;

/// The metadata keys of a dump (safetensors `__metadata__`, every value a string), written by
/// `mladb run --dump`, `mladb replay --dump`, tools/hf_dump.py and tools/make_hf_fixtures.py.
pub mod meta_key {
    /// The version of this set of keys ([`super::DUMP_FORMAT`]); a dump without it predates
    /// the metadata.
    pub const FORMAT: &str = "dump_format";
    /// The prompt token ids, a JSON array: `[3,141,59]`.
    pub const TOKENS: &str = "tokens";
    /// Prompt tokens prefilled at once (the rest went through decode one by one).
    pub const PREFILL: &str = "prefill";
    /// Greedy tokens generated after the prompt.
    pub const DECODE: &str = "decode";
    /// The generated token ids, a JSON array.
    pub const GENERATED: &str = "generated";
    /// The model: a layout and seed, or a checkpoint with its fingerprint.
    pub const MODEL: &str = "model";
    /// mladb's debugging flags, or the other engine's settings.
    pub const FLAGS: &str = "flags";
    /// What wrote the dump, with its version: `mladb 0.1.0`, `tools/hf_dump.py (transformers
    /// 5.17.0, ...)`. Dumps by mladb name their tensors with mladb's op names.
    pub const PRODUCER: &str = "producer";
    /// The precision the other engine's tensors were in (`bf16`, `f16`; absent: f32). A dump
    /// of a bf16 engine is judged by the bf16 tolerances whatever the checked run's dtype.
    pub const DTYPE: &str = "dtype";
}

/// The metadata format this build writes and reads.
pub const DUMP_FORMAT: u32 = 1;

/// What a dump says about the run that made it.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpMeta {
    pub tokens: Vec<u32>,
    pub prefill: usize,
    pub decode: usize,
    pub generated: Vec<u32>,
    pub model: String,
    pub flags: String,
    pub producer: String,
    /// The other engine's precision, when not f32 (`bf16`, `f16`).
    pub dtype: Option<String>,
}

impl DumpMeta {
    /// What mladb writes into a dump it makes. A bf16 run's dump says so, so that a run checked
    /// against it is judged by bf16's tolerances whatever its own dtype (its values hold bf16's
    /// rounding, which an f32 run does not have).
    pub fn of_mladb(
        schedule: &crate::engine::generate::Schedule,
        generated: &[u32],
        model: String,
        flags: &crate::debug::flags::Flags,
    ) -> DumpMeta {
        DumpMeta {
            tokens: schedule.prompt.clone(),
            prefill: schedule.prefill_len,
            decode: schedule.decode_steps,
            generated: generated.to_vec(),
            model,
            flags: flags.to_string(),
            producer: format!("mladb {}", env!("CARGO_PKG_VERSION")),
            dtype: match flags.dtype {
                crate::engine::StorageDtype::F32 => None,
                low => Some(low.to_string()),
            },
        }
    }

    /// The dump's tensors were computed in bf16 or f16.
    pub fn low_precision(&self) -> bool {
        matches!(self.dtype.as_deref(), Some("bf16" | "f16"))
    }

    /// mladb wrote the dump: its tensors carry mladb's op names, no name map applies.
    pub fn by_mladb(&self) -> bool {
        self.producer.starts_with("mladb ")
    }

    /// The safetensors metadata map.
    pub fn to_map(&self) -> HashMap<String, String> {
        let list = |v: &[u32]| serde_json::to_string(v).expect("a token list serialises");
        [
            (meta_key::FORMAT, DUMP_FORMAT.to_string()),
            (meta_key::TOKENS, list(&self.tokens)),
            (meta_key::PREFILL, self.prefill.to_string()),
            (meta_key::DECODE, self.decode.to_string()),
            (meta_key::GENERATED, list(&self.generated)),
            (meta_key::MODEL, self.model.clone()),
            (meta_key::FLAGS, self.flags.clone()),
            (meta_key::PRODUCER, self.producer.clone()),
        ]
        .into_iter()
        .chain(self.dtype.clone().map(|d| (meta_key::DTYPE, d)))
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Reads the metadata; `None` for a dump without it (made before it existed).
    pub fn from_map(
        map: &HashMap<String, String>,
    ) -> std::result::Result<Option<DumpMeta>, String> {
        let Some(format) = map.get(meta_key::FORMAT) else {
            return Ok(None);
        };
        match format.parse::<u32>() {
            Ok(DUMP_FORMAT) => {}
            _ => {
                return Err(format!(
                    "metadata {} is '{format}'; this mladb reads format {DUMP_FORMAT}",
                    meta_key::FORMAT
                ))
            }
        }
        let get = |key: &str| {
            map.get(key)
                .ok_or_else(|| format!("metadata {key} is missing"))
        };
        let number = |key: &str| {
            get(key)?
                .parse::<usize>()
                .map_err(|_| format!("metadata {key} is not a count: '{}'", map[key]))
        };
        let tokens = |key: &str| {
            serde_json::from_str::<Vec<u32>>(get(key)?)
                .map_err(|_| format!("metadata {key} is not a list of token ids: '{}'", map[key]))
        };
        let text = |key: &str| map.get(key).cloned().unwrap_or_default();
        let meta = DumpMeta {
            tokens: tokens(meta_key::TOKENS)?,
            prefill: number(meta_key::PREFILL)?,
            decode: number(meta_key::DECODE)?,
            generated: match map.get(meta_key::GENERATED) {
                Some(_) => tokens(meta_key::GENERATED)?,
                None => Vec::new(),
            },
            model: text(meta_key::MODEL),
            flags: text(meta_key::FLAGS),
            producer: text(meta_key::PRODUCER),
            dtype: map.get(meta_key::DTYPE).cloned(),
        };
        if let Some(d) = meta
            .dtype
            .as_deref()
            .filter(|d| !["f32", "bf16", "f16"].contains(d))
        {
            return Err(format!(
                "metadata {} is '{d}'; it is f32, bf16 or f16",
                meta_key::DTYPE
            ));
        }
        if meta.tokens.is_empty() || meta.prefill > meta.tokens.len() {
            return Err(format!(
                "metadata prefill {} does not fit its {} tokens",
                meta.prefill,
                meta.tokens.len()
            ));
        }
        Ok(Some(meta))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_metadata_round_trips_and_bad_values_are_named() {
        let meta = DumpMeta {
            tokens: vec![3, 141, 59],
            prefill: 2,
            decode: 1,
            generated: vec![7],
            model: "layout glm5-tiny, seed 0".into(),
            flags: "inject none".into(),
            producer: "mladb 0.1.0".into(),
            dtype: Some("bf16".into()),
        };
        let map = meta.to_map();
        assert_eq!(map[meta_key::TOKENS], "[3,141,59]");
        assert_eq!(DumpMeta::from_map(&map), Ok(Some(meta)));
        assert_eq!(DumpMeta::from_map(&HashMap::new()), Ok(None));
        let broken = |key: &str, value: &str| {
            let mut m = map.clone();
            m.insert(key.to_string(), value.to_string());
            DumpMeta::from_map(&m).unwrap_err()
        };
        assert!(broken(meta_key::FORMAT, "2").contains("reads format 1"));
        assert!(broken(meta_key::TOKENS, "3,141").contains("metadata tokens"));
        assert!(broken(meta_key::PREFILL, "-1").contains("metadata prefill"));
        assert!(broken(meta_key::PREFILL, "4").contains("does not fit"));
        assert!(broken(meta_key::DTYPE, "fp8").contains("metadata dtype"));
    }
}
