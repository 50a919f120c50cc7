//! mladb: an interactive debugger for Multi-head Latent Attention execution in GLM-5 and
//! DeepSeek-V3. See README.md for the tour and `../shared/docs/mla.md`-style notes at the top of
//! each module for the math it implements.
//!
//! Data flows one way: layouts + weights → [`model::Model`]; model + [`backend::Backend`] →
//! [`engine::Engine`], which reports every op to an [`engine::Observer`]; the debugger core
//! ([`debug`]) and sessions consume those events; [`setup`] loads models and prepares runs for
//! every front end; [`service`] serves the debugger to the UI ([`tui`]); the commands in [`cli`]
//! sit on top. An engine of the user's own (vLLM, SGLang, transformers) reaches mladb through
//! [`attach`], whose frames carry its tensors in.

pub mod attach;
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
pub mod ops;
pub mod service;
pub mod session;
pub mod setup;
pub mod stats;
pub mod tensor;
pub mod tensor_file;
pub mod tui;

pub use error::{Error, Result};
