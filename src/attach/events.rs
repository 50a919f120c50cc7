//! What goes into the live comparison (the server's events, payloads in f32) and what comes
//! out of it (comparisons, findings, notes, and the totals of a whole attachment), as `mladb
//! attach` prints them: text lines, or JSON objects with `--json`.

use super::server::Budget;
use super::wire::{Body, Dtype, Frame};
use crate::debug::detect::Finding;
use crate::engine::trace::Phase;
use serde::Serialize;
use std::collections::BTreeSet;

/// What the comparison takes: the server's events, payloads already in f32.
#[derive(Debug)]
pub enum Input {
    Hello {
        conn: u64,
        engine: String,
        rank: u32,
        world_size: u32,
    },
    Step {
        conn: u64,
        step: u64,
        tokens: Vec<u32>,
        positions: Vec<u32>,
    },
    Tensor {
        conn: u64,
        module: String,
        dtype: Dtype,
        data: Vec<f32>,
        ptr: Option<u64>,
        kernel_out_ptr: Option<u64>,
        /// The frame's share of the server's memory budget, held until the comparison has
        /// taken the tensor: an engine that outruns the comparison waits at the server.
        budget: Option<Budget>,
    },
    Closed {
        conn: u64,
    },
}

impl Input {
    /// What a connection's frame gives the comparison (`None` for its `bye`); `budget` is the
    /// frame's share of the server's memory, held until the tensor has been taken.
    pub fn of_frame(conn: u64, frame: &Frame, budget: Option<Budget>) -> Option<Input> {
        Some(match &frame.header.body {
            Body::Hello {
                engine,
                rank,
                world_size,
                ..
            } => Input::Hello {
                conn,
                engine: engine.clone(),
                rank: *rank,
                world_size: *world_size,
            },
            Body::Step {
                step,
                tokens,
                positions,
                ..
            } => Input::Step {
                conn,
                step: *step,
                tokens: tokens.clone(),
                positions: positions.clone(),
            },
            Body::Tensor {
                module,
                dtype,
                ptr,
                kernel_out_ptr,
                ..
            } => Input::Tensor {
                conn,
                module: module.clone(),
                dtype: *dtype,
                data: dtype.values(&frame.payload),
                ptr: *ptr,
                kernel_out_ptr: *kernel_out_ptr,
                budget,
            },
            Body::Bye { .. } => return None,
        })
    }
}

/// What the comparison reports, as it happens.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Live {
    /// mladb ran its reference for an engine step.
    Reference {
        step: u64,
        phase: String,
        tokens: usize,
        ops: usize,
    },
    /// One engine tensor (or its ranks' shards together) against mladb's op.
    Compared {
        step: u64,
        phase: String,
        module: String,
        op: String,
        /// The rank that sent it; `None` when the ranks' shards were put together.
        rank: Option<u32>,
        error: f64,
        tolerance: f64,
        diverges: bool,
        /// With shards put together: the rank whose piece differs most, and its error.
        worst_rank: Option<(u32, f64)>,
        detail: String,
    },
    Finding {
        step: u64,
        rank: Option<u32>,
        #[serde(flatten)]
        finding: Finding,
    },
    Note {
        step: Option<u64>,
        rank: Option<u32>,
        text: String,
    },
}

/// What the comparison saw over the whole attachment.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    pub steps: u64,
    pub compared: u64,
    pub divergent: u64,
    pub findings: u64,
    /// mladb op names the engine sent that mladb's run of that step does not have.
    pub not_in_run: BTreeSet<String>,
    /// Engine tensors the name map leaves out.
    pub left_out: u64,
    /// Divergences after a choice (an MoE router's experts, the DSA indexer's keys) the engine
    /// made otherwise than mladb from numbers that agree within their tolerance: the engine's
    /// choice explains them (reported as notes).
    pub after_selection_flip: u64,
}

/// One comparison's outcome, as `Comparator::report` turns it into events.
pub(crate) struct Verdict<'a> {
    pub step: u64,
    pub phase: Phase,
    /// The engine's module, and the mladb op it was compared with.
    pub module: &'a str,
    pub op: &'a str,
    /// The op's index in mladb's run.
    pub index: usize,
    /// The rank that sent it (`None`: the ranks' shards put together).
    pub rank: Option<u32>,
    pub worst_rank: Option<(u32, f64)>,
    pub error: f64,
    pub tolerance: f64,
    pub detail: String,
    pub diverges: bool,
    /// Whose tensor it was, for the finding's text (empty: the module says it).
    pub who: String,
    /// The rank a finding names (the sender, or the rank whose shard differs most).
    pub blamed: Option<u32>,
    /// The tolerance as the finding explains it (`tolerance 2.1e-2 (...)`; empty for none).
    pub tolerance_text: String,
}

impl<'a> Verdict<'a> {
    /// A verdict on `op` without shards or figures; [`Verdict::says`] gives its text.
    pub fn at(
        step: u64,
        phase: Phase,
        module: &'a str,
        op: &'a str,
        index: usize,
        rank: Option<u32>,
    ) -> Verdict<'a> {
        Verdict {
            step,
            phase,
            module,
            op,
            index,
            rank,
            worst_rank: None,
            error: 0.0,
            tolerance: 0.0,
            detail: String::new(),
            diverges: false,
            who: String::new(),
            blamed: rank,
            tolerance_text: String::new(),
        }
    }

    /// What was found, and whether it diverges (then without figures: NaN).
    pub fn says(mut self, detail: String, diverges: bool) -> Verdict<'a> {
        self.detail = detail;
        self.diverges = diverges;
        if diverges {
            (self.error, self.tolerance) = (f64::NAN, f64::NAN);
        }
        self
    }
}
