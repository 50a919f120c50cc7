//! The debugger core: what turns a forward pass into a debugger. A library API that the TUI,
//! sessions and headless commands drive; it holds no UI code.
//!
//! * [`flags`]: the variables a hunt changes one at a time (MLA disable, paths, dtype, faults),
//!   and the first op each change affects;
//! * [`record`], [`runner`]: runs kept whole, and re-runs that reuse an earlier run's leading ops;
//!   [`sample`]: the bounded samples a replay holds of outputs instead;
//! * [`controller`]: stepping, breakpoints and live flag changes over a running engine;
//! * [`compare`], [`bisect`], [`external`]: per-op comparisons of runs, phases and dumps;
//!   [`dump_meta`]: what a dump says about the run that made it;
//! * [`forensics`], [`detect`]: buffer forensics and the detectors of `mladb check`;
//!   [`findings`]: how their comparisons become findings;
//! * [`idle`]: flags and faults that had nothing to act on in a run;
//! * [`conditioning`], [`indexer_scores`]: how far an op's own values let its error outgrow its
//!   inputs' (the indexer's scores recomputed, small projections), and the ReLU's zeros;
//! * [`quant`]: a quantized kv_b_proj's two derivations compared, and its decoding checked;
//!   [`kv_quant`]: an FP8 latent cache's rows against what E4M3 explains;
//! * [`tp`]: a tensor-parallel run's ranks against the run on one rank.

pub mod bisect;
pub mod breakpoint;
pub mod compare;
pub mod conditioning;
pub mod controller;
pub mod detect;
pub mod diff;
pub mod dump_meta;
pub mod external;
pub mod findings;
pub mod flags;
pub mod forensics;
pub mod idle;
pub mod indexer_scores;
pub mod kv_quant;
pub mod name_map;
pub mod paired;
pub mod per_op;
pub mod quant;
pub mod ranking;
pub mod record;
pub mod runner;
pub mod sample;
pub mod selection;
pub mod tolerance;
pub mod tp;
mod worker;

pub use flags::Flags;
pub use record::RunRecord;
