//! The engine: a GLM-5 / DeepSeek-V3 forward pass, op by op, on a [`Backend`], reporting every
//! op to an [`Observer`]. It holds no UI code and knows nothing of who observes it.
//!
//! Op order of one decoder layer (weights [out, in], N heads, P = qk_nope, R = qk_rope,
//! V = v_head, L = kv_lora_rank):
//! 1. input_layernorm → x
//! 2. q_a_proj → q_a_layernorm (= q_resid) → q_b_proj → per head q_nope (P) | q_pe (R)
//! 3. kv_a_proj_with_mqa → c_kv (L) | k_pe (R); kv_a_layernorm on c_kv
//! 4. RoPE on q_pe and k_pe; c_kv | k_pe appended to the latent cache
//! 5. DSA indexer (GLM-5): top-k keys per query, or every causal key while the context is no
//!    longer than index_topk
//! 6. attention, naive or absorbed (see [`attention`]), o_proj, residual add
//! 7. post_attention_layernorm, dense MLP or MoE, residual add
//!
//! After the last layer: final norm and lm_head.

pub mod attention;
pub mod cache;
mod experts;
pub mod faults;
pub mod forcing;
pub mod forward;
pub mod generate;
pub mod mlp;
pub mod sink;
pub mod tp;
pub mod trace;

/// Routing and RoPE live below the engine (the backends use them too); kept reachable here.
pub use crate::ops::{moe, rope};
pub use faults::{Fault, Faults};
pub use forcing::{ForcedChoice, ForcedSelections};
pub use forward::{Engine, EngineOptions, LayerTiming, MlaPath, MlaPaths};
pub use sink::{OpCounts, StorageDtype};
pub use trace::{NullObserver, Observer, OpEvent, OpKind, Phase, Recorder, Replay};
