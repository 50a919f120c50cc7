//! Typed launchers of the batched MoE experts (experts.cu): the tables the kernels read are
//! built and uploaded here, from weights checked against the layer's dimensions and slots
//! checked against the tokens, so the kernels index only what these checks allow.

use super::kernels::{blocks, blocks_yz, need, need_i32, prod, size};
use super::signature::{Param::*, Sig};
use super::{grid_1d, DevBuf, DevI32, Elem, Gpu, Launch};
use crate::error::{Error, Result};

pub const EXPERTS_GATE_UP: Sig = Sig::new(
    "experts_gate_up_{e}",
    &[Storage, I32Ptr, U64, U64, Storage, U64, U64],
);
pub const EXPERTS_DOWN: Sig = Sig::new(
    "experts_down_{e}",
    &[Storage, I32Ptr, U64, Storage, U64, U64],
);
/// The same for tiles of one token (a decode step's experts).
pub const EXPERTS_GATE_UP1: Sig = Sig::new(
    "experts_gate_up1_{e}",
    &[Storage, I32Ptr, U64, U64, Storage, U64, U64],
);
pub const EXPERTS_DOWN1: Sig = Sig::new(
    "experts_down1_{e}",
    &[Storage, I32Ptr, U64, Storage, U64, U64],
);
pub const EXPERTS_COMBINE: Sig = Sig::new(
    "experts_combine_{e}",
    &[Storage, I32Ptr, U64, U64, U64, Storage, U64, U64],
);

pub const SIGNATURES: &[&Sig] = &[
    &EXPERTS_GATE_UP,
    &EXPERTS_DOWN,
    &EXPERTS_GATE_UP1,
    &EXPERTS_DOWN1,
    &EXPERTS_COMBINE,
];

/// Tokens one tile of the kernels applies a weight band to (experts.cu's EXPERT_TILE).
pub const EXPERT_TILE: usize = 8;
const THREADS: u32 = 256;
/// Weight rows per warp (experts.cu's GATE_UP_ROWS and DOWN_ROWS); 8 warps a block.
const GATE_UP_ROWS: usize = 4;
const DOWN_ROWS: usize = 8;

/// One expert's weights: gate and up [inter, hidden], down [hidden, inter].
pub struct ExpertWeights<'a> {
    pub gate: &'a DevBuf,
    pub up: &'a DevBuf,
    pub down: &'a DevBuf,
}

/// The uploaded tables of one batched call (see experts.cu for their layout), with what they
/// were checked against.
pub struct ExpertTables {
    meta: DevI32,
    tiles_at: usize,
    tiles: usize,
    /// The most tokens of a tile: 1 runs the one-token kernels.
    tile_tokens: usize,
    tok_at: usize,
    off_at: usize,
    by_tok_at: usize,
    w_at: usize,
    /// Rows of the slot-major buffers (`act`, `y`).
    pub slots: usize,
    tokens: usize,
    hidden: usize,
    inter: usize,
    elem: Elem,
}

impl Gpu {
    /// Checks and uploads the tables of one call: `jobs[j]`'s weights, the tiles (job, first
    /// slot, tokens) the kernels run, each slot's token (of `tokens`) and routing weight. Slots
    /// are numbered by job and need not all be in tiles (slots another path fills).
    #[allow(clippy::too_many_arguments)]
    pub fn expert_tables(
        &self,
        jobs: &[ExpertWeights],
        tiles: &[(usize, usize, usize)],
        slot_tokens: &[usize],
        slot_weights: &[f32],
        tokens: usize,
        (hidden, inter): (usize, usize),
        elem: Elem,
    ) -> Result<ExpertTables> {
        let slots = slot_tokens.len();
        let size = prod(&[hidden, inter])?;
        for w in jobs {
            for (what, b) in [("gate", w.gate), ("up", w.up), ("down", w.down)] {
                if b.elem() != elem || b.len() < size {
                    return Err(Error::invalid(format!(
                        "experts: a {what} weight of {} {} values for [{inter}, {hidden}] in {}",
                        b.len(),
                        b.elem().suffix(),
                        elem.suffix()
                    )));
                }
            }
        }
        let bad_tile = tiles.iter().any(|&(job, first, count)| {
            job >= jobs.len() || !(1..=EXPERT_TILE).contains(&count) || first + count > slots
        });
        if bad_tile
            || slot_weights.len() != slots
            || slot_tokens.iter().any(|&t| t >= tokens)
            || i32::try_from(slots.max(tokens)).is_err()
        {
            return Err(Error::invalid(
                "experts: tiles, slots and tokens do not agree",
            ));
        }
        let mut meta: Vec<i32> = Vec::new();
        for w in jobs {
            for b in [w.gate, w.up, w.down] {
                let p = b.ptr();
                meta.extend([p as u32 as i32, (p >> 32) as u32 as i32]);
            }
        }
        let tiles_at = meta.len();
        for &(job, first, count) in tiles {
            meta.extend([job as i32, first as i32, count as i32]);
        }
        let tok_at = meta.len();
        meta.extend(slot_tokens.iter().map(|&t| t as i32));
        // Each token's slots in slot order, which is expert order.
        let mut by_token: Vec<Vec<i32>> = vec![Vec::new(); tokens];
        for (s, &t) in slot_tokens.iter().enumerate() {
            by_token[t].push(s as i32);
        }
        let off_at = meta.len();
        let mut at = 0i32;
        meta.push(0);
        for list in &by_token {
            at += list.len() as i32;
            meta.push(at);
        }
        let by_tok_at = meta.len();
        meta.extend(by_token.into_iter().flatten());
        let w_at = meta.len();
        meta.extend(slot_weights.iter().map(|w| w.to_bits() as i32));
        Ok(ExpertTables {
            meta: self.upload_i32(&meta)?,
            tiles_at,
            tiles: tiles.len(),
            tile_tokens: tiles.iter().map(|t| t.2).max().unwrap_or(1),
            tok_at,
            off_at,
            by_tok_at,
            w_at,
            slots,
            tokens,
            hidden,
            inter,
            elem,
        })
    }

    /// act [slots, inter] = SiLU(x·W_gateᵀ) · (x·W_upᵀ) for the tiles' slots; x [tokens, hidden].
    pub fn experts_gate_up(&self, t: &ExpertTables, x: &DevBuf, act: &DevBuf) -> Result<()> {
        if t.tiles == 0 {
            return Ok(());
        }
        let e = t.elem;
        let args = [
            need("experts input", x, prod(&[t.tokens, t.hidden])?, e)?,
            need_i32("expert tables", &t.meta, t.meta.len(), None)?,
            size(t.tiles_at),
            size(t.tok_at),
            need("experts gate", act, prod(&[t.slots, t.inter])?, e)?,
            size(t.hidden),
            size(t.inter),
        ];
        let cfg = self.expert_launch(t, t.inter, GATE_UP_ROWS)?;
        let (sig, base) = match t.tile_tokens {
            1 => (&EXPERTS_GATE_UP1, "experts_gate_up1"),
            _ => (&EXPERTS_GATE_UP, "experts_gate_up"),
        };
        // SAFETY: tile i's block reads its job's gate and up weights (each holding inter × hidden
        // values of this type, checked when the tables were made), x rows of its slots' tokens
        // (< tokens), and writes act rows first..first + count < slots, inter values each.
        unsafe { self.launch(sig, &super::kernels::name(base, e), cfg, &args) }
    }

    /// y [slots, hidden] = act · W_downᵀ for the tiles' slots.
    pub fn experts_down(&self, t: &ExpertTables, act: &DevBuf, y: &DevBuf) -> Result<()> {
        if t.tiles == 0 {
            return Ok(());
        }
        let e = t.elem;
        let args = [
            need("experts gate", act, prod(&[t.slots, t.inter])?, e)?,
            need_i32("expert tables", &t.meta, t.meta.len(), None)?,
            size(t.tiles_at),
            need("experts output", y, prod(&[t.slots, t.hidden])?, e)?,
            size(t.inter),
            size(t.hidden),
        ];
        let cfg = self.expert_launch(t, t.hidden, DOWN_ROWS)?;
        let (sig, base) = match t.tile_tokens {
            1 => (&EXPERTS_DOWN1, "experts_down1"),
            _ => (&EXPERTS_DOWN, "experts_down"),
        };
        // SAFETY: tile i's block reads its job's down weight (hidden × inter values), act rows
        // and writes y rows first..first + count < slots.
        unsafe { self.launch(sig, &super::kernels::name(base, e), cfg, &args) }
    }

    /// out [tokens, hidden]: each token's weighted sum of its slots' rows of y, in expert order.
    pub fn experts_combine(&self, t: &ExpertTables, y: &DevBuf, out: &DevBuf) -> Result<()> {
        let e = t.elem;
        let args = [
            need("experts output", y, prod(&[t.slots, t.hidden])?, e)?,
            need_i32("expert tables", &t.meta, t.meta.len(), None)?,
            size(t.off_at),
            size(t.by_tok_at),
            size(t.w_at),
            need("routed experts", out, prod(&[t.tokens, t.hidden])?, e)?,
            size(t.tokens),
            size(t.hidden),
        ];
        if t.tokens * t.hidden == 0 {
            return Ok(());
        }
        // SAFETY: output element (t, c) reads token t's slot range (tokens + 1 offsets), those
        // slots (< slots) and their weights, and y rows of them.
        unsafe {
            self.launch(
                &EXPERTS_COMBINE,
                &super::kernels::name("experts_combine", e),
                grid_1d(t.tokens * t.hidden),
                &args,
            )
        }
    }

    /// Blocks of 8 warps of `rows_per_warp` output rows each, one grid row per tile, and the
    /// shared memory of a tile's inputs (its tokens × 32 lanes × 16 bytes of storage, as f32).
    fn expert_launch(&self, t: &ExpertTables, rows: usize, rows_per_warp: usize) -> Result<Launch> {
        let per_block = (THREADS as usize / 32) * rows_per_warp;
        let chunk = 32 * 16 / t.elem.size();
        Ok(Launch {
            grid: (
                blocks("experts", rows.div_ceil(per_block))?,
                blocks_yz("expert tiles", t.tiles)?,
                1,
            ),
            block: THREADS,
            shared: (tile_capacity(t) * chunk * 4) as u32,
        })
    }
}

/// Tokens a tile of `t`'s kernels holds: one for the one-token kernels, else [`EXPERT_TILE`].
fn tile_capacity(t: &ExpertTables) -> usize {
    match t.tile_tokens {
        1 => 1,
        _ => EXPERT_TILE,
    }
}
