//! The wire format between an engine's hook (`python/mladb_hook`) and mladb: what a running
//! vLLM, SGLang or transformers process sends about its forward pass, small enough that a C++
//! engine could write it too.
//!
//! A stream is a sequence of frames. Each frame is
//!
//! ```text
//! magic  4 bytes   b"MLAW"
//! header u32 LE    length of the header in bytes
//! body   u64 LE    length of the payload in bytes
//! header           JSON object, UTF-8 (`Header`)
//! payload          the tensor's bytes, row-major, little-endian (empty for other frames)
//! ```
//!
//! The header's `v` is the format's version ([`WIRE_VERSION`]); a reader refuses any other.
//! Its `kind` says what the frame is: `hello` (who is talking: engine, model, rank and world
//! size), `step` (the batch a forward pass runs: phase, step, token ids and positions),
//! `tensor` (a module's tensor, with its dtype, shape and device pointer, and for attention
//! wrappers that take an output buffer, the pointer of the buffer handed to the kernel), `bye`
//! (the end, with how many tensors the hook dropped when its queue was full). Unknown header
//! fields are ignored, so a later hook can add some within a version.
//!
//! Every length is checked against [`Limits`] before anything is allocated, and a tensor's
//! payload must be exactly its shape times its dtype's size: a hostile or broken client gets an
//! error naming what was wrong, never an unbounded allocation.

use std::io::Read;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"MLAW";
/// The version of the format this build reads and writes.
pub const WIRE_VERSION: u32 = 1;
/// Bytes before the header: magic, header length, payload length.
pub const PREFIX_BYTES: usize = 16;

/// The largest frame mladb accepts. The defaults hold a full-size GLM-5 activation (a 16k-token
/// prefill's hidden states in f32 are 0.4 GB) and a long prompt's token ids in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_header: u32,
    pub max_payload: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header: 4 << 20,
            max_payload: 1 << 30,
        }
    }
}

/// A frame's header: the version and what the frame is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub v: u32,
    #[serde(flatten)]
    pub body: Body,
}

/// What a frame says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Body {
    /// The first frame of a connection: who is talking.
    Hello {
        /// `vllm`, `sglang`, `hf` or another engine's name.
        engine: String,
        /// The model's name or path, as the engine knows it.
        model: String,
        rank: u32,
        world_size: u32,
    },
    /// A forward pass begins: the batch it runs.
    Step {
        /// `prefill` or `decode`.
        phase: String,
        /// Counts forward passes from 0 on this rank.
        step: u64,
        tokens: Vec<u32>,
        positions: Vec<u32>,
    },
    /// One tensor of a module, in the engine's own module name; the payload holds its bytes.
    Tensor {
        module: String,
        dtype: Dtype,
        shape: Vec<u64>,
        /// The tensor's device pointer (its data_ptr), where it has one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ptr: Option<u64>,
        /// For an attention wrapper that hands its kernel an output buffer: that buffer's
        /// pointer (the tensor's own `ptr` is what the wrapper returned).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kernel_out_ptr: Option<u64>,
    },
    /// The end of the stream.
    Bye {
        /// Tensors the hook dropped because its queue was full (its `drop` policy).
        #[serde(default)]
        dropped: u64,
    },
}

/// The element types a tensor frame can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
    I32,
    I64,
}

impl Dtype {
    /// The name on the wire (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
        }
    }

    /// A payload's values in f32 (integers converted).
    pub fn values(self, payload: &[u8]) -> Vec<f32> {
        fn values<const N: usize>(payload: &[u8], value: impl Fn([u8; N]) -> f32) -> Vec<f32> {
            payload
                .chunks_exact(N)
                .map(|c| value(c.try_into().expect("N bytes")))
                .collect()
        }
        match self {
            Dtype::F32 => values(payload, f32::from_le_bytes),
            Dtype::Bf16 => values(payload, |c| half::bf16::from_le_bytes(c).to_f32()),
            Dtype::F16 => values(payload, |c| half::f16::from_le_bytes(c).to_f32()),
            Dtype::I32 => values(payload, |c| i32::from_le_bytes(c) as f32),
            Dtype::I64 => values(payload, |c| i64::from_le_bytes(c) as f32),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
        }
    }
}

/// One frame as read: its header and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub header: Header,
    pub payload: Vec<u8>,
}

/// The frame's bytes: prefix, header, payload. Refuses a tensor whose payload is not its shape's
/// size, so that a writer cannot produce what a reader would refuse.
pub fn encode(header: &Header, payload: &[u8]) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(header)
        .map_err(|e| Error::Invalid(format!("wire: cannot encode header: {e}")))?;
    let header_len =
        u32::try_from(json.len()).map_err(|_| Error::Invalid("wire: header over 4 GiB".into()))?;
    check_payload(&header.body, payload.len() as u64)?;
    let mut out = Vec::with_capacity(PREFIX_BYTES + json.len() + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(payload);
    Ok(out)
}

/// The header and payload lengths of a frame's prefix, checked against the limits.
pub fn parse_prefix(prefix: &[u8; PREFIX_BYTES], limits: Limits) -> Result<(u32, u64)> {
    if prefix[..4] != MAGIC {
        return Err(Error::Invalid(format!(
            "wire: a frame must start with {:?}, found {:?} (not an mladb hook, or a stream out of step)",
            String::from_utf8_lossy(&MAGIC),
            String::from_utf8_lossy(&prefix[..4])
        )));
    }
    let header_len = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes"));
    let payload_len = u64::from_le_bytes(prefix[8..16].try_into().expect("8 bytes"));
    if header_len == 0 || header_len > limits.max_header {
        return Err(Error::Invalid(format!(
            "wire: header of {header_len} bytes (limit {})",
            limits.max_header
        )));
    }
    if payload_len > limits.max_payload {
        return Err(Error::Invalid(format!(
            "wire: payload of {payload_len} bytes (limit {})",
            limits.max_payload
        )));
    }
    Ok((header_len, payload_len))
}

/// A frame's header from its JSON bytes, of this version, consistent with its payload length.
pub fn parse_header(json: &[u8], payload_len: u64) -> Result<Header> {
    let header: Header = serde_json::from_slice(json)
        .map_err(|e| Error::Invalid(format!("wire: malformed header: {e}")))?;
    if header.v != WIRE_VERSION {
        return Err(Error::Invalid(format!(
            "wire: format version {} (this mladb reads version {WIRE_VERSION})",
            header.v
        )));
    }
    check_payload(&header.body, payload_len)?;
    Ok(header)
}

/// A tensor's payload is exactly its elements; every other frame has none.
fn check_payload(body: &Body, payload_len: u64) -> Result<()> {
    let expected = match body {
        Body::Tensor {
            module,
            dtype,
            shape,
            ..
        } => shape
            .iter()
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                Error::Invalid(format!("wire: tensor {module}: shape {shape:?} overflows"))
            })?,
        _ => 0,
    };
    if payload_len != expected {
        let what = match body {
            Body::Tensor {
                module,
                shape,
                dtype,
                ..
            } => {
                format!(
                    "tensor {module} ({} {shape:?}) needs {expected} bytes",
                    dtype.name()
                )
            }
            _ => "a frame other than a tensor carries no payload".to_string(),
        };
        return Err(Error::Invalid(format!(
            "wire: payload of {payload_len} bytes, but {what}"
        )));
    }
    Ok(())
}

/// Reads the next frame. `Ok(None)` at a clean end of the stream (before a frame's first byte);
/// an end inside a frame, or any malformed part, is an error.
pub fn read_frame(reader: &mut impl Read, limits: Limits) -> Result<Option<Frame>> {
    let mut prefix = [0u8; PREFIX_BYTES];
    let mut got = 0;
    while got < PREFIX_BYTES {
        match reader.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(truncated("prefix", got, PREFIX_BYTES as u64)),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Invalid(format!("wire: read failed: {e}"))),
        }
    }
    let (header_len, payload_len) = parse_prefix(&prefix, limits)?;
    let json = read_exact(reader, header_len as u64, "header")?;
    let header = parse_header(&json, payload_len)?;
    let payload = read_exact(reader, payload_len, "payload")?;
    Ok(Some(Frame { header, payload }))
}

/// `len` bytes (already checked against the limits), or an error that says where the stream
/// ended.
fn read_exact(reader: &mut impl Read, len: u64, what: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    let got = reader
        .take(len)
        .read_to_end(&mut buf)
        .map_err(|e| Error::Invalid(format!("wire: read failed in the {what}: {e}")))?;
    if (got as u64) < len {
        return Err(truncated(what, got, len));
    }
    Ok(buf)
}

/// The error of a stream that ended inside a frame (the sync reader here, the server's async
/// one).
pub(crate) fn truncated(what: &str, got: usize, len: u64) -> Error {
    Error::Invalid(format!(
        "wire: the stream ended inside a frame's {what} ({got} of {len} bytes)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(module: &str, shape: Vec<u64>) -> Header {
        Header {
            v: WIRE_VERSION,
            body: Body::Tensor {
                module: module.into(),
                dtype: Dtype::F32,
                shape,
                ptr: Some(0x7f00_0000_1000),
                kernel_out_ptr: None,
            },
        }
    }

    fn frames(bytes: &[u8], limits: Limits) -> Result<Vec<Frame>> {
        let mut reader = bytes;
        let mut out = Vec::new();
        while let Some(frame) = read_frame(&mut reader, limits)? {
            out.push(frame);
        }
        Ok(out)
    }

    #[test]
    fn frames_round_trip() {
        let hello = Header {
            v: WIRE_VERSION,
            body: Body::Hello {
                engine: "vllm".into(),
                model: "zai-org/GLM-5".into(),
                rank: 1,
                world_size: 8,
            },
        };
        let step = Header {
            v: WIRE_VERSION,
            body: Body::Step {
                phase: "prefill".into(),
                step: 0,
                tokens: vec![3, 141, 59],
                positions: vec![0, 1, 2],
            },
        };
        let t = tensor("model.layers.0.self_attn.o_proj", vec![3, 2]);
        let payload: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let bye = Header {
            v: WIRE_VERSION,
            body: Body::Bye { dropped: 2 },
        };
        let mut stream = Vec::new();
        for (h, p) in [(&hello, &[][..]), (&step, &[]), (&t, &payload), (&bye, &[])] {
            stream.extend(encode(h, p).unwrap());
        }
        let got = frames(&stream, Limits::default()).unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[0].header, hello);
        assert_eq!(got[1].header, step);
        assert_eq!(got[2].header, t);
        assert_eq!(got[2].payload, payload);
        assert_eq!(got[3].header, bye);
    }

    #[test]
    fn the_header_is_plain_json_with_a_kind() {
        let bytes = encode(&tensor("m", vec![0]), &[]).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&bytes[PREFIX_BYTES..]).unwrap();
        assert_eq!(json["v"], 1);
        assert_eq!(json["kind"], "tensor");
        assert_eq!(json["dtype"], "f32");
        assert_eq!(json["shape"], serde_json::json!([0]));
        assert!(json.get("kernel_out_ptr").is_none());
    }

    #[test]
    fn hostile_frames_are_refused_with_what_was_wrong() {
        let good = encode(&tensor("m", vec![2]), &[0; 8]).unwrap();
        let err = |bytes: &[u8], limits: Limits| frames(bytes, limits).unwrap_err().to_string();

        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        assert!(err(&bad_magic, Limits::default()).contains("must start with"));

        let small = Limits {
            max_header: 16,
            max_payload: 1 << 20,
        };
        assert!(err(&good, small).contains("header of"));
        let tiny_payload = Limits {
            max_header: 1 << 20,
            max_payload: 4,
        };
        assert!(err(&good, tiny_payload).contains("limit 4"));

        // A prefix claiming 2^64 − 1 bytes of payload is refused before any allocation.
        let mut huge = good.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge, Limits::default()).contains("payload of 18446744073709551615"));

        // The stream ends mid-prefix, mid-header and mid-payload.
        assert!(err(&good[..10], Limits::default()).contains("inside a frame's prefix"));
        assert!(err(&good[..PREFIX_BYTES + 3], Limits::default()).contains("frame's header"));
        assert!(err(&good[..good.len() - 1], Limits::default()).contains("frame's payload (7 of 8"));

        // A payload that is not the shape's size, either way.
        let header = serde_json::to_vec(&tensor("m", vec![3])).unwrap();
        let mut short = Vec::new();
        short.extend_from_slice(&MAGIC);
        short.extend_from_slice(&(header.len() as u32).to_le_bytes());
        short.extend_from_slice(&8u64.to_le_bytes());
        short.extend_from_slice(&header);
        short.extend_from_slice(&[0; 8]);
        assert!(err(&short, Limits::default()).contains("needs 12 bytes"));
        assert!(encode(&tensor("m", vec![3]), &[0; 8]).is_err());

        // A shape whose size overflows, garbage JSON, another version, an unknown kind.
        for (json, needle) in [
            (
                r#"{"v":1,"kind":"tensor","module":"m","dtype":"f32","shape":[4294967296,4294967296]}"#,
                "overflows",
            ),
            ("{not json", "malformed header"),
            (r#"{"v":2,"kind":"bye"}"#, "version 2"),
            (r#"{"v":1,"kind":"launch_missiles"}"#, "malformed header"),
            (
                r#"{"v":1,"kind":"tensor","module":"m","dtype":"f128","shape":[1]}"#,
                "malformed header",
            ),
        ] {
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&MAGIC);
            bytes.extend_from_slice(&(json.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&0u64.to_le_bytes());
            bytes.extend_from_slice(json.as_bytes());
            assert!(err(&bytes, Limits::default()).contains(needle), "{json}");
        }
    }

    #[test]
    fn fields_a_later_hook_adds_are_ignored() {
        let json = r#"{"v":1,"kind":"bye","dropped":1,"queue_depth":9}"#;
        let header = parse_header(json.as_bytes(), 0).unwrap();
        assert_eq!(header.body, Body::Bye { dropped: 1 });
    }

    #[test]
    fn an_empty_stream_is_a_clean_end() {
        assert!(frames(&[], Limits::default()).unwrap().is_empty());
    }
}
