//! `tp-mismatch`: a tensor-parallel run against the same schedule on one rank, op by op and
//! rank by rank. Each rank's output is held against the part of the unsharded output it should
//! be, as the plan of [`crate::model::shard`] says: a replicated op against the whole, a rank's
//! heads or columns against their slice, a collective's output against the op whose partial
//! sums or parts it joins. Partial sums themselves have no unsharded counterpart: their
//! all-reduce is compared instead, and the comparison says how many it passed over.

use super::compare::{aligned_router_weights, compare_outputs, OpComparison};
use super::record::RunRecord;
use super::sample::holds_all;
use super::selection::is_selection;
use super::tolerance::Tolerances;
use crate::engine::OpEvent;
use crate::model::shard::{collective_of, head_parts, partial_sum, slice_in_whole};
use crate::model::Layout;

/// Every op of `sharded` (a run of `tp` ranks) against the op of `whole` (one rank) it should
/// equal or be a slice of, in `sharded`'s order, each judged against its tolerance. Choices are
/// compared as choices (`super::paired`); partial sums are left to their all-reduce.
pub fn compare_ranks(
    sharded: &RunRecord,
    whole: &RunRecord,
    tp: usize,
    layout: &Layout,
    tolerances: &Tolerances,
) -> Vec<OpComparison> {
    let num_heads = layout.num_heads;
    let mut all: Vec<OpComparison> = sharded
        .events
        .iter()
        .enumerate()
        .filter(|(_, e)| compared(e))
        .filter_map(|(i, e)| {
            let rank = e.rank.unwrap_or(0);
            let j = unsharded_op(whole, e)?;
            let (theirs, shape) = (whole.outputs[j].data(), &whole.events[j].shape);
            let mine = sharded.outputs[i].data();
            let whole_held = holds_all(shape, theirs.len());
            let parts = head_parts(layout, &e.name).filter(|_| e.shape != *shape);
            // Routing weights: the one rank's in this rank's order of experts.
            let aligned = aligned_router_weights(sharded, i, whole, j);
            let theirs = aligned.as_deref().unwrap_or(theirs);
            let c = match slice_in_whole(&e.shape, shape, tp, rank) {
                Ok(_) if parts.is_some() && whole_held => {
                    let widths = parts.unwrap_or_default();
                    let part = rank_parts(theirs, widths, tp, rank);
                    compare_outputs(e, i, mine, &e.shape, &part, num_heads / tp)
                }
                Ok(None) => compare_outputs(e, i, mine, shape, theirs, num_heads),
                Ok(Some((dim, start, len))) if whole_held => {
                    let part = slice(theirs, shape, dim, start, len);
                    compare_outputs(e, i, mine, &e.shape, &part, num_heads / tp)
                }
                Ok(Some(_)) => compare_outputs(e, i, mine, &e.shape, &[], num_heads),
                Err(why) => {
                    let mut c = compare_outputs(e, i, mine, shape, theirs, num_heads);
                    c.diff = Err(why);
                    c
                }
            };
            Some(c)
        })
        .collect();
    tolerances.judge(sharded, &mut all);
    all
}

/// The part of `data` (laid out as `shape`) at `start..start + len` along dimension `dim`.
fn slice(data: &[f32], shape: &[usize], dim: usize, start: usize, len: usize) -> Vec<f32> {
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let from = (o * shape[dim] + start) * inner;
        out.extend_from_slice(&data[from..from + len * inner]);
    }
    out
}

/// Rank `rank` of `tp`'s part of rows that join two parts of `widths`, each split by heads:
/// its share of each part, in order.
fn rank_parts(data: &[f32], widths: [usize; 2], tp: usize, rank: usize) -> Vec<f32> {
    let row: usize = widths.iter().sum();
    let rows = data.len().checked_div(row).unwrap_or(0);
    let mut out = Vec::with_capacity(data.len() / tp.max(1));
    for r in 0..rows {
        let mut from = r * row;
        for w in widths {
            let share = w / tp;
            out.extend_from_slice(&data[from + rank * share..from + (rank + 1) * share]);
            from += w;
        }
    }
    out
}

/// How many ops of `sharded` hold partial sums, which only their all-reduce is compared by.
pub fn partial_sums(sharded: &RunRecord) -> usize {
    sharded
        .events
        .iter()
        .filter(|e| partial_sum(&e.name))
        .count()
}

/// Whether [`compare_ranks`] compares a rank's op numerically: choices are compared as choices,
/// partial sums through their all-reduce.
fn compared(e: &OpEvent) -> bool {
    !is_selection(e) && !partial_sum(&e.name)
}

/// The index in `whole`, a run on one rank, of the op a rank's op `e` is compared with: the op
/// of the same name, or for a collective the op whose partial sums or parts it joins.
pub fn unsharded_op(whole: &RunRecord, e: &OpEvent) -> Option<usize> {
    let unsharded = collective_of(&e.name).map_or(e.name.as_str(), |(_, stem)| stem);
    whole.find_at(e.phase, None, unsharded)
}

/// How many ops of `sharded` that [`compare_ranks`] would compare have no counterpart in
/// `whole` (none in a run of mladb's own: every op of a rank is an op of the model or a
/// collective after one).
pub fn without_counterpart(sharded: &RunRecord, whole: &RunRecord) -> usize {
    let events = sharded.events.iter();
    events
        .filter(|e| compared(e) && unsharded_op(whole, e).is_none())
        .count()
}

#[cfg(test)]
mod tests {
    use super::slice;

    #[test]
    fn a_slice_along_a_middle_dimension_takes_that_range_of_every_outer_row() {
        // [2, 4, 2]: rows 1..3 of the middle dimension.
        let data: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let part = slice(&data, &[2, 4, 2], 1, 1, 2);
        assert_eq!(part, [2., 3., 4., 5., 10., 11., 12., 13.]);
        assert_eq!(
            slice(&data, &[2, 8], 1, 4, 4),
            [4., 5., 6., 7., 12., 13., 14., 15.]
        );
    }
}
