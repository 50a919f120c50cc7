//! Attaching to the user's own engine: a hook in a running vLLM, SGLang or transformers process
//! (`python/mladb_hook`) streams its tensors to mladb in the frames of [`wire`].
//!
//! So far this holds the wire format ([`wire`]) with the Python hook's writer, and the server
//! that takes frames from several ranks at once ([`server`], behind `mladb attach`); the name
//! maps that put engine module names and tensor-parallel shards back into mladb's ops, and the
//! live comparison, come next.

pub mod live;
pub mod server;
pub mod shards;
pub mod wire;
