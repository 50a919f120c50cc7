//! Attaching to the user's own engine: a hook in a running vLLM, SGLang or transformers process
//! (`python/mladb_hook`) streams its tensors to mladb in the frames of [`wire`]; the server
//! ([`server`], behind `mladb attach`) takes them from several ranks at once; the live comparison
//! ([`live`]) runs mladb's reference on the same tokens and compares each tensor as it arrives,
//! through the name maps ([`crate::debug::name_map`]), with tensor-parallel shards put back
//! together ([`shards`]) and choices compared as choices ([`choices`]). What it reports is in
//! [`events`].

mod choices;
pub mod events;
pub mod forced;
pub mod import;
pub mod live;
pub mod pickle;
pub mod record;
mod sequence;
pub mod server;
pub mod sglang_dump;
pub mod shards;
pub mod torch_file;
pub mod wire;
