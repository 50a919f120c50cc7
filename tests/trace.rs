//! The op trace is a connected record: every activation an op reads was written by an earlier op,
//! every cache it reads was written by an earlier cache write, names are unique within a phase.
//! This is what buffer forensics will rely on to call a mismatch a disconnect.

mod common;

use common::*;
use mladb::engine::trace::{BufferRole, OpKind};
use mladb::engine::{MlaPath, MlaPaths};
use std::collections::HashSet;

fn check_connected(layout: &str, paths: MlaPaths) {
    let model = synthetic(layout, 9);
    let p = prompt(model.layout.vocab_size, 12);
    let (rec, _) = record(&model, paths, &p, 9, 3);
    let mut written = HashSet::new();
    let mut caches = HashSet::new();
    let mut names = HashSet::new();
    for (i, e) in rec.events.iter().enumerate() {
        let what = format!("{layout} {paths:?} #{i} {} {}", e.phase, e.name);
        assert_eq!(e.index, i, "{what}: events are numbered in order");
        assert!(
            names.insert((e.phase, e.name.clone())),
            "{what}: name repeats in its phase"
        );
        for input in &e.inputs {
            match input.role {
                BufferRole::Activation => {
                    assert!(
                        written.contains(&input.id),
                        "{what} reads activation {:?} nobody wrote",
                        input.id
                    )
                }
                BufferRole::Cache => assert!(
                    caches.contains(&input.id),
                    "{what} reads a cache nobody wrote"
                ),
                BufferRole::Weight => assert!(
                    !written.contains(&input.id),
                    "{what}: a weight id was an op output"
                ),
            }
        }
        match (e.kind, e.output.role) {
            (OpKind::CacheWrite, BufferRole::Cache) => {
                caches.insert(e.output.id);
            }
            (OpKind::CacheWrite, role) => panic!("{what}: a cache write into a {role:?} buffer"),
            (_, BufferRole::Activation) => {
                written.insert(e.output.id);
            }
            (_, role) => panic!("{what}: op output in a {role:?} buffer"),
        }
        if e.kind != OpKind::CacheWrite {
            assert_eq!(
                e.output.bytes,
                e.shape.iter().product::<usize>() * 4,
                "{what}: output bytes"
            );
        }
        assert_ne!(e.output.address, 0, "{what}: an output has an address");
    }
}

#[test]
fn every_read_has_a_writer_on_every_path_and_path_switch() {
    for layout in ["glm5-tiny", "deepseek-v3-tiny"] {
        for paths in [
            MlaPaths::production(),
            MlaPaths::disabled(),
            // Absorbed prefill then naive decode: the expanded cache is back-filled from the
            // latent cache.
            MlaPaths {
                prefill: MlaPath::Absorbed,
                decode: MlaPath::Naive,
            },
        ] {
            check_connected(layout, paths);
        }
    }
}

#[test]
fn a_path_switch_backfills_the_expanded_cache_from_the_latent_cache() {
    let model = synthetic("glm5-tiny", 9);
    let p = prompt(model.layout.vocab_size, 6);
    let paths = MlaPaths {
        prefill: MlaPath::Absorbed,
        decode: MlaPath::Naive,
    };
    let (rec, _) = record(&model, paths, &p, 4, 1);
    let backfills: Vec<_> = rec
        .events
        .iter()
        .filter(|e| e.name.ends_with("self_attn.expand_cache"))
        .collect();
    assert_eq!(
        backfills.len(),
        model.layout.num_layers,
        "once per layer, at the first naive step"
    );
    assert!(backfills
        .iter()
        .all(|e| e.shape[0] == 4 && e.phase.to_string() == "decode.0"));
}
