//! Attaching to the user's own engine: a hook in a running vLLM, SGLang or transformers process
//! (`python/mladb_hook`) streams its tensors to mladb in the frames of [`wire`].
//!
//! So far this holds the wire format, its reader and writer, and their tests against the
//! Python hook's writer; the server (`mladb attach`), the name maps that put engine module
//! names and tensor-parallel shards back into mladb's ops, and the live comparison come next.

pub mod wire;
