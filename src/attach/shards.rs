//! Putting a tensor-parallel engine's shards back together: each rank sends its own piece of a
//! module's output, and the name map's shard rule says how the pieces make the whole tensor
//! mladb computes (see [`Shard`]). Pieces wait here, keyed by step, op and occurrence, until
//! every rank's has come.

use crate::debug::name_map::Shard;
use std::collections::HashMap;

/// One rank's piece: `rows` tokens × `data.len() / rows` features, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub rank: u32,
    pub rows: usize,
    pub data: Vec<f32>,
}

/// The whole tensor, and which features each rank held (for [`Shard::Columns`]: the rank a
/// difference lies in).
#[derive(Debug, Clone, PartialEq)]
pub struct Whole {
    pub rows: usize,
    pub data: Vec<f32>,
    /// Per rank, in rank order: the range of features (per row) it held; empty unless the rule
    /// is `Columns`.
    pub rank_columns: Vec<(u32, std::ops::Range<usize>)>,
}

/// Puts `pieces` (one per rank, any order) together by `shard`; an error says what does not fit.
pub fn assemble(shard: Shard, mut pieces: Vec<Piece>) -> Result<Whole, String> {
    pieces.sort_by_key(|p| p.rank);
    let first = pieces.first().ok_or("no pieces")?;
    let rows = first.rows;
    if rows == 0 {
        return Err("a piece has no rows".into());
    }
    for p in &pieces {
        if p.rows != rows || p.data.len() % rows != 0 {
            return Err(format!(
                "rank {} sent {} values for {} tokens; rank {} sent {} for {rows}",
                p.rank,
                p.data.len(),
                p.rows,
                first.rank,
                first.data.len()
            ));
        }
    }
    match shard {
        Shard::Replicated => Ok(Whole {
            rows,
            data: std::mem::take(&mut pieces[0].data),
            rank_columns: Vec::new(),
        }),
        // Partial sums that are all the same are already reduced (an engine that all-reduces
        // this output after all, as vLLM's DeepSeek-V3 path does where its GLM-5 path does not):
        // adding them would count the sum once per rank.
        Shard::RowSum if pieces.len() > 1 && pieces.iter().all(|p| p.data == first.data) => {
            Ok(Whole {
                rows,
                data: std::mem::take(&mut pieces[0].data),
                rank_columns: Vec::new(),
            })
        }
        Shard::RowSum => {
            let n = first.data.len();
            if let Some(p) = pieces.iter().find(|p| p.data.len() != n) {
                return Err(format!(
                    "partial sums differ in size: rank {} has {}, rank {} {n}",
                    p.rank,
                    p.data.len(),
                    first.rank
                ));
            }
            let mut data = vec![0f32; n];
            for p in &pieces {
                for (d, x) in data.iter_mut().zip(&p.data) {
                    *d += x;
                }
            }
            Ok(Whole {
                rows,
                data,
                rank_columns: Vec::new(),
            })
        }
        Shard::Columns => {
            let widths: Vec<usize> = pieces.iter().map(|p| p.data.len() / rows).collect();
            let total: usize = widths.iter().sum();
            let mut data = Vec::with_capacity(total * rows);
            for r in 0..rows {
                for (p, w) in pieces.iter().zip(&widths) {
                    data.extend_from_slice(&p.data[r * w..(r + 1) * w]);
                }
            }
            let mut start = 0;
            let rank_columns = pieces
                .iter()
                .zip(&widths)
                .map(|(p, w)| {
                    start += w;
                    (p.rank, start - w..start)
                })
                .collect();
            Ok(Whole {
                rows,
                data,
                rank_columns,
            })
        }
    }
}

/// The columns `range` of every row of a `rows`-row tensor (a fused output's piece).
pub fn columns(
    data: &[f32],
    rows: usize,
    range: std::ops::Range<usize>,
) -> Result<Vec<f32>, String> {
    let width = data.len() / rows.max(1);
    if rows == 0 || !data.len().is_multiple_of(rows) || range.end > width {
        return Err(format!(
            "columns {}..{} of a tensor of {rows} rows × {width} features",
            range.start, range.end
        ));
    }
    Ok((0..rows)
        .flat_map(|r| {
            data[r * width + range.start..r * width + range.end]
                .iter()
                .copied()
        })
        .collect())
}

/// What of a rank's tensor is `target`'s: for a split applied per rank, that rank's share of
/// the target's columns, then joined with the other ranks' by columns (the target returned
/// says so); otherwise the tensor as it is, cut after the ranks are put together.
pub fn rank_part(
    target: &crate::debug::name_map::Target,
    world: u32,
    rows: usize,
    data: Vec<f32>,
) -> Result<(crate::debug::name_map::Target, Vec<f32>), String> {
    let (true, Some(r)) = (target.per_rank, &target.columns) else {
        return Ok((target.clone(), data));
    };
    let w = world.max(1) as usize;
    if r.start % w != 0 || r.end % w != 0 {
        return Err(format!(
            "columns {}..{} of {} do not divide among {w} ranks",
            r.start, r.end, target.op
        ));
    }
    let part = columns(&data, rows, r.start / w..r.end / w)?;
    let joined = crate::debug::name_map::Target {
        columns: None,
        shard: if w > 1 { Shard::Columns } else { target.shard },
        per_rank: false,
        ..target.clone()
    };
    Ok((joined, part))
}

/// Pieces waiting for the other ranks, keyed by (step, the engine's module, mladb's op): two
/// modules that stand for one op (vLLM's MLA layer output and o_proj's input) are put together
/// apart, so one rank's piece of the one never takes the place of its piece of the other.
#[derive(Default)]
pub struct Pending {
    waiting: HashMap<PendingKey, Vec<Piece>>,
}

/// (step, module, op) of [`Pending`].
pub type PendingKey = (u64, String, String);

impl Pending {
    /// Adds a rank's piece; once `world` ranks have sent theirs, returns them all.
    pub fn add(&mut self, key: PendingKey, piece: Piece, world: u32) -> Option<Vec<Piece>> {
        let entry = self.waiting.entry(key.clone()).or_default();
        entry.retain(|p| p.rank != piece.rank);
        entry.push(piece);
        if entry.len() as u32 >= world {
            return self.waiting.remove(&key);
        }
        None
    }

    /// Drops what waits for steps before `step` (their other ranks will not come now); returns
    /// the keys dropped, with the ranks that had sent theirs.
    pub fn expire_before(&mut self, step: u64) -> Vec<(PendingKey, Vec<u32>)> {
        let old: Vec<_> = self
            .waiting
            .keys()
            .filter(|k| k.0 < step)
            .cloned()
            .collect();
        let mut out: Vec<_> = old
            .into_iter()
            .map(|k| {
                let ranks = self.waiting.remove(&k).unwrap_or_default();
                (k, ranks.iter().map(|p| p.rank).collect())
            })
            .collect();
        out.sort();
        out
    }

    /// Everything still waiting (at the end of a run).
    pub fn drain(&mut self) -> Vec<(PendingKey, Vec<u32>)> {
        self.expire_before(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rank: u32, rows: usize, data: &[f32]) -> Piece {
        Piece {
            rank,
            rows,
            data: data.to_vec(),
        }
    }

    #[test]
    fn columns_rows_and_replicas_go_back_together() {
        // Two tokens; rank 0 holds features 0..2, rank 1 features 2..3; sent out of order.
        let w = assemble(
            Shard::Columns,
            vec![piece(1, 2, &[3.0, 6.0]), piece(0, 2, &[1.0, 2.0, 4.0, 5.0])],
        )
        .unwrap();
        assert_eq!(w.data, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(w.rank_columns, vec![(0, 0..2), (1, 2..3)]);
        let s = assemble(
            Shard::RowSum,
            vec![piece(0, 1, &[1.0, 2.0]), piece(1, 1, &[0.5, -2.0])],
        )
        .unwrap();
        assert_eq!(s.data, vec![1.5, 0.0]);
        let reduced = assemble(
            Shard::RowSum,
            vec![piece(0, 1, &[1.0, 2.0]), piece(1, 1, &[1.0, 2.0])],
        )
        .unwrap();
        assert_eq!(
            reduced.data,
            vec![1.0, 2.0],
            "already all-reduced: not added again"
        );
        let r = assemble(Shard::Replicated, vec![piece(0, 1, &[7.0])]).unwrap();
        assert_eq!(r.data, vec![7.0]);
        assert!(assemble(
            Shard::RowSum,
            vec![piece(0, 1, &[1.0]), piece(1, 1, &[1.0, 2.0])]
        )
        .unwrap_err()
        .contains("differ in size"));
        assert!(
            assemble(Shard::Columns, vec![piece(0, 2, &[1.0, 2.0, 3.0])])
                .unwrap_err()
                .contains("for 2 tokens")
        );
        assert_eq!(
            columns(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 1..3).unwrap(),
            vec![2.0, 3.0, 5.0, 6.0]
        );
        assert!(columns(&[1.0, 2.0], 1, 1..3).is_err());
    }

    #[test]
    fn pieces_wait_for_every_rank_and_expire_with_their_step() {
        let mut p = Pending::default();
        let key = |s: u64| (s, "m".to_string(), "op".to_string());
        assert!(p.add(key(0), piece(1, 1, &[1.0]), 2).is_none());
        // A rank sending twice replaces its piece.
        assert!(p.add(key(0), piece(1, 1, &[2.0]), 2).is_none());
        let all = p.add(key(0), piece(0, 1, &[3.0]), 2).unwrap();
        assert_eq!(all.len(), 2);
        assert!(p.add(key(1), piece(0, 1, &[1.0]), 2).is_none());
        assert_eq!(p.expire_before(1), vec![]);
        assert_eq!(p.expire_before(2), vec![(key(1), vec![0])]);
        assert!(p.drain().is_empty());
    }
}
