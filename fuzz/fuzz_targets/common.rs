#![allow(dead_code)] // each target uses part of it
//! What the fuzz targets share: a scratch folder per process, an input split into parts, and a
//! walk over a parsed layout that calls what the engine would.

use mladb::model::layout::Layout;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A folder of this process's own, emptied for each input.
pub fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mladb-fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// Splits `data` into `n` parts, each led by a little-endian u16 length (the last takes the
/// rest), so that one byte string drives several files.
pub fn parts(mut data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::with_capacity(n);
    for _ in 1..n {
        if data.len() < 2 {
            out.push(&data[..0]);
            continue;
        }
        let len = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
        out.push(&data[2..2 + len]);
        data = &data[2 + len..];
    }
    out.push(data);
    out
}

/// Everything the engine asks of a layout, which must not panic once it validated.
pub fn walk(layout: &Layout) {
    if layout.validate().is_err() {
        return;
    }
    let _ = (
        layout.qk_head_dim(),
        layout.latent_width(),
        layout.softmax_scale(),
        layout.parameter_count(),
    );
    for l in 0..layout.num_layers.min(4096) {
        let _ = (layout.mlp_kind(l), layout.indexer_mode(l));
    }
    let _ = mladb::model::catalog::Catalog::new(layout).len();
    let text = layout.to_ron();
    let back = Layout::from_ron_str(&text, std::path::Path::new("fuzz.ron"))
        .expect("a validated layout's RON reads back");
    assert_eq!(back.to_ron(), text, "a layout survives its RON");
}

/// The model of the test fixtures' SGLang dump (tests/fixtures/hf/glm5-sparse), whose widths
/// the import targets' seeds have.
pub fn fixture_layout() -> &'static Layout {
    static LAYOUT: OnceLock<Layout> = OnceLock::new();
    LAYOUT.get_or_init(|| {
        let config = include_str!("../../tests/fixtures/hf/glm5-sparse/config.json");
        let value = serde_json::from_str(config).expect("the fixture's config");
        mladb::model::hf_config::layout_from_config(&value, "glm5-sparse").expect("its layout")
    })
}

/// An import's end: what it gives, if anything, must hold each tensor's values in its shape.
pub fn finish_import(importer: mladb::attach::import::Importer) {
    if let Ok(outcome) = importer.finish("fuzz") {
        for t in &outcome.tensors {
            assert_eq!(
                t.shape.iter().product::<usize>(),
                t.data.len(),
                "{}: an imported tensor's shape is its values",
                t.key
            );
        }
    }
}
