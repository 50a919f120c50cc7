//! One tensor-parallel rank's weights, read from the full model's source as the plan of
//! [`super`] cuts them.

use super::{check_tp, copy_columns, weight_shard, Shard};
use crate::error::{Error, Result};
use crate::model::catalog::Catalog;
use crate::model::layout::Layout;
use crate::model::quant::QuantTensor;
use crate::model::weights::WeightSource;

/// The weights one rank holds: each tensor of the full model as [`weight_shard`] cuts it, read
/// from the full model's source (a row shard reads only its rows; a column shard reads whole
/// rows and keeps its columns). An expert another rank owns is not there. Quantized tensors keep
/// their blocks where the shard is whole blocks (rows always; columns when they start and end on
/// block boundaries); otherwise the rank reads them decoded.
pub struct RankSource {
    full: std::sync::Arc<dyn WeightSource>,
    layout: Layout,
    tp: usize,
    rank: usize,
}

impl RankSource {
    /// Rank `rank` of `tp` over the full model's `source`; the layout must divide (see
    /// [`check_tp`]).
    pub fn new(
        full: std::sync::Arc<dyn WeightSource>,
        layout: &Layout,
        tp: usize,
        rank: usize,
    ) -> Result<RankSource> {
        check_tp(layout, tp)?;
        if rank >= tp {
            return Err(Error::invalid(format!("rank {rank} of {tp}")));
        }
        Ok(RankSource {
            full,
            layout: layout.clone(),
            tp,
            rank,
        })
    }

    /// What this rank holds of `name`, with the full tensor's shape (`None`: not a weight of
    /// the layout).
    pub fn shard(&self, name: &str) -> Option<(Shard, Vec<usize>)> {
        let shape = self.full.shape(name)?;
        let shard = weight_shard(&self.layout, name, &shape, self.tp, self.rank).ok()?;
        Some((shard, shape))
    }

    /// The shapes of the tensors this rank holds: the full model's catalog, cut.
    pub fn catalog(&self) -> Catalog {
        Catalog::new(&self.layout).filter_map(|name, spec| match self.shard(name)?.0 {
            Shard::Absent => None,
            shard => Some(shard_shape(&spec.shape, shard)),
        })
    }

    /// Rows of this rank's shard of `name` from `start_row` into `out`, from `read` (rows of
    /// the full tensor from a start row: its values, or those before quantization), cut as the
    /// shard is; `None` where the rank holds nothing or `read` has nothing.
    fn read_cut(
        &self,
        name: &str,
        start_row: usize,
        out: &mut [f32],
        mut read: impl FnMut(usize, &mut [f32]) -> Option<Result<()>>,
    ) -> Option<Result<()>> {
        let (shard, shape) = self.shard(name)?;
        match shard {
            Shard::Absent => None,
            Shard::Whole => read(start_row, out),
            Shard::Rows { start, .. } => read(start + start_row, out),
            Shard::Columns { start, len } => {
                let cols: usize = shape[1..].iter().product();
                let mut whole = vec![0.0f32; out.len() / len.max(1) * cols];
                if let Err(e) = read(start_row, &mut whole)? {
                    return Some(Err(e));
                }
                copy_columns(&whole, cols, start, out, len);
                Some(Ok(()))
            }
        }
    }
}

/// The shape of `shard` of a tensor of `shape`.
fn shard_shape(shape: &[usize], shard: Shard) -> Vec<usize> {
    match shard {
        Shard::Whole | Shard::Absent => shape.to_vec(),
        Shard::Rows { len, .. } => {
            let mut s = shape.to_vec();
            s[0] = len;
            s
        }
        Shard::Columns { len, .. } => vec![shape[0], len],
    }
}

impl WeightSource for RankSource {
    fn describe(&self) -> String {
        format!(
            "{}, rank {} of {}",
            self.full.describe(),
            self.rank,
            self.tp
        )
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.shard(name)? {
            (Shard::Absent, _) => None,
            (shard, shape) => Some(shard_shape(&shape, shard)),
        }
    }

    /// A row shard (or a whole tensor) is a run of the full tensor's rows; a column shard is
    /// not one run of values, so it is read.
    fn recipe(&self, name: &str, start_row: usize) -> Option<super::super::weights::Recipe> {
        match self.shard(name)?.0 {
            Shard::Whole => self.full.recipe(name, start_row),
            Shard::Rows { start, .. } => self.full.recipe(name, start + start_row),
            Shard::Columns { .. } | Shard::Absent => None,
        }
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()> {
        self.read_cut(name, start_row, out, |from, rows| {
            Some(self.full.read_rows(name, from, rows))
        })
        .unwrap_or_else(|| {
            Err(Error::invalid(format!(
                "{name}: not held by rank {}",
                self.rank
            )))
        })
    }

    fn readable(&self, name: &str) -> Result<()> {
        self.full.readable(name)
    }

    fn quantized(&self, name: &str) -> Option<Result<QuantTensor>> {
        let (shard, _) = self.shard(name)?;
        let full = match self.full.quantized(name)? {
            Ok(q) => q,
            Err(e) => return Some(Err(e)),
        };
        match shard {
            Shard::Absent => None,
            Shard::Whole => Some(Ok(full)),
            Shard::Rows { start, len } => Some(QuantTensor::new(
                full.ty,
                len,
                full.cols,
                full.rows_bytes(start, len).into(),
            )),
            Shard::Columns { start, len } => {
                let block = full.ty.block_size();
                if !start.is_multiple_of(block) || !len.is_multiple_of(block) {
                    return None; // read decoded
                }
                let (per_block, row_bytes) = (full.ty.type_size(), full.row_bytes());
                let (from, count) = (start / block * per_block, len / block * per_block);
                let bytes: Vec<u8> = (0..full.rows)
                    .flat_map(|r| {
                        full.bytes()[r * row_bytes + from..][..count]
                            .iter()
                            .copied()
                    })
                    .collect();
                Some(QuantTensor::new(full.ty, full.rows, len, bytes.into()))
            }
        }
    }

    fn original(&self, name: &str, start_row: usize, out: &mut [f32]) -> Option<Result<()>> {
        // The values before quantization, cut as the decoded ones are.
        self.read_cut(name, start_row, out, |from, rows| {
            self.full.original(name, from, rows)
        })
    }
}
