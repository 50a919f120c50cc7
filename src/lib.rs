//! mladb: an interactive debugger for Multi-head Latent Attention execution in GLM-5 and
//! DeepSeek-V3. See README.md for the tour and `../shared/docs/mla.md`-style notes at the top of
//! each module for the math it implements.
//!
//! Data flows one way: layouts + weights → [`model::Model`]; model + [`backend::Backend`] →
//! [`engine::Engine`], which reports every op to an [`engine::Observer`]; the commands in
//! [`cli`] consume those events.

pub mod backend;
pub mod cli;
pub mod debug;
pub mod engine;
pub mod error;
pub mod fsutil;
pub mod gguf;
pub mod input;
pub mod memory;
pub mod model;
pub mod session;
pub mod stats;
pub mod tensor;
pub mod tui;

pub use error::{Error, Result};
