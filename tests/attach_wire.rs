//! The Python hook's frame writer (python/mladb_hook/wire.py) against mladb's reader
//! (src/attach/wire.rs): what the hook writes is read back exactly, and what it refuses to write
//! the reader would refuse too. Needs python3 (CI has it); no numpy.

use std::process::Command;

use mladb::attach::wire::{read_frame, Body, Dtype, Limits};

/// Runs `script` with python/ on the path and returns its stdout.
fn python(script: &str) -> Vec<u8> {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .env("PYTHONPATH", format!("{root}/python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 must be on the path for this test (CI installs it)");
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn frames_written_by_the_python_hook_are_read_back_exactly() {
    let stream = python(
        r#"
import struct, sys
from mladb_hook import wire
out = sys.stdout.buffer
out.write(wire.hello("hf", "glm5-tiny", rank=1, world_size=2))
out.write(wire.step("decode", 3, [7, 8], [12, 13]))
out.write(wire.tensor("model.layers.0.self_attn.o_proj", "f32", [2, 3], struct.pack("<6f", *range(6)), ptr=0x7f0000001000))
out.write(wire.tensor("model.layers.0.self_attn.attn", "bf16", [4], struct.pack("<4H", 0x3f80, 0x4000, 0xbf80, 0), ptr=16, kernel_out_ptr=32))
out.write(wire.bye(dropped=5))
"#,
    );
    let mut reader = &stream[..];
    let mut frames = Vec::new();
    while let Some(frame) = read_frame(&mut reader, Limits::default()).unwrap() {
        frames.push(frame);
    }
    assert_eq!(frames.len(), 5);
    assert!(matches!(
        &frames[0].header.body,
        Body::Hello { engine, model, rank: 1, world_size: 2 } if engine == "hf" && model == "glm5-tiny"
    ));
    assert!(matches!(
        &frames[1].header.body,
        Body::Step { phase, step: 3, tokens, positions }
            if phase == "decode" && tokens == &[7, 8] && positions == &[12, 13]
    ));
    match &frames[2].header.body {
        Body::Tensor {
            module,
            dtype: Dtype::F32,
            shape,
            ptr: Some(0x7f00_0000_1000),
            kernel_out_ptr: None,
        } => {
            assert_eq!(module, "model.layers.0.self_attn.o_proj");
            assert_eq!(shape, &[2, 3]);
        }
        other => panic!("not the f32 tensor: {other:?}"),
    }
    let values: Vec<f32> = frames[2]
        .payload
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert!(matches!(
        &frames[3].header.body,
        Body::Tensor {
            dtype: Dtype::Bf16,
            ptr: Some(16),
            kernel_out_ptr: Some(32),
            ..
        }
    ));
    let bf16: Vec<f32> = frames[3]
        .payload
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(bf16, [1.0, 2.0, -1.0, 0.0]);
    assert!(matches!(frames[4].header.body, Body::Bye { dropped: 5 }));
}

#[test]
fn the_python_writer_refuses_what_the_reader_would() {
    let refused = python(
        r#"
from mladb_hook import wire
for args in [("m", "f32", [3], b"\0" * 8), ("m", "f64", [1], b"\0" * 8), ("m", "i64", [2, 2], b"\0" * 31)]:
    try:
        wire.tensor(*args)
        print("accepted", args[:3])
    except ValueError as e:
        print("refused:", e)
"#,
    );
    let text = String::from_utf8(refused).unwrap();
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(text.lines().all(|l| l.starts_with("refused:")), "{text}");
    assert!(text.contains("needs 12 bytes, got 8"), "{text}");
}
