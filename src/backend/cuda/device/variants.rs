//! The tensor-core kernel variants as kernels/variants.cuh describes them: that file is the one
//! place a variant's tiles, stages and shared memory are written. The kernels instantiate their
//! templates from its rows and check their layouts against them at compile time; the launchers
//! read the same rows here for the shared memory they request and the tiles they plan with.

use std::sync::LazyLock;

/// kernels/variants.cuh, as NVRTC is also given it (`compile::full_source`).
pub const SOURCE: &str = include_str!("../../../../kernels/variants.cuh");

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub kernel: &'static str,
    /// Query rows of a block: the heads of a decode group, the query tokens of a prefill tile.
    pub rows: usize,
    /// Keys per tile.
    pub tile: usize,
    /// Tiles in flight.
    pub stages: usize,
    /// Dynamic shared memory per block, in bytes.
    pub shared: u32,
}

static TABLE: LazyLock<Vec<Variant>> = LazyLock::new(|| {
    // The table is this crate's own source, checked by the tests below: a malformed row is a
    // build mistake, not an input.
    parse(SOURCE).unwrap_or_else(|e| panic!("kernels/variants.cuh: {e}"))
});

/// The row of a kernel, if it is a described variant.
pub fn variant(kernel: &str) -> Option<&'static Variant> {
    TABLE.iter().find(|v| v.kernel == kernel)
}

/// The shared bytes of a described kernel (`u32::MAX`, which no device allows, for another).
pub fn shared_bytes(kernel: &str) -> u32 {
    variant(kernel).map_or(u32::MAX, |v| v.shared)
}

/// The rows `KERNEL_VARIANT(kernel, rows, tile, stages, shared)`, one per line.
fn parse(src: &'static str) -> Result<Vec<Variant>, String> {
    src.lines()
        .filter_map(|line| line.strip_prefix("KERNEL_VARIANT("))
        .map(|row| {
            let fields = row
                .strip_suffix(')')
                .ok_or_else(|| format!("a row without its closing parenthesis: {row}"))?;
            let fields: Vec<&'static str> = fields.split(',').map(str::trim).collect();
            let [kernel, rows, tile, stages, shared] = fields[..] else {
                return Err(format!("a row of {} fields, not 5: {row}", fields.len()));
            };
            let int = |s: &str| {
                s.parse::<usize>()
                    .map_err(|_| format!("{kernel}: {s} is not a whole number"))
            };
            Ok(Variant {
                kernel,
                rows: int(rows)?,
                tile: int(tile)?,
                stages: int(stages)?,
                shared: u32::try_from(int(shared)?).map_err(|e| format!("{kernel}: {e}"))?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::device::compile::{HOPPER_SOURCES, SOURCES};

    #[test]
    fn the_table_parses_and_names_each_kernel_once() {
        let table = parse(SOURCE).unwrap();
        assert!(table.len() >= 27, "{} rows", table.len());
        for (i, v) in table.iter().enumerate() {
            assert!(
                table[..i].iter().all(|w| w.kernel != v.kernel),
                "{} twice",
                v.kernel
            );
            assert!(
                v.rows > 0 && v.tile > 0 && v.stages > 0 && v.shared > 0,
                "{v:?}"
            );
        }
    }

    #[test]
    fn every_described_kernel_is_defined_in_the_sources_and_takes_its_row() {
        let sources: Vec<&str> = SOURCES
            .iter()
            .chain(HOPPER_SOURCES.iter())
            .map(|(_, src)| *src)
            .collect();
        for v in TABLE.iter() {
            // An entry point either instantiates from its row by name, or a macro pastes it.
            let uses_row = sources.iter().any(|s| {
                s.contains(&format!("{}_v", v.kernel))
                    || s.contains(&format!("FLASH_PREFILL({},", v.kernel))
                    || s.contains(&format!("FLASH_PREFILL_TMA({},", v.kernel))
            });
            assert!(
                uses_row,
                "{} is described but no kernel reads its row",
                v.kernel
            );
        }
    }

    #[test]
    fn malformed_rows_are_reported() {
        assert!(parse("KERNEL_VARIANT(a, 1, 2, 3)").is_err());
        assert!(parse("KERNEL_VARIANT(a, 1, 2, 3, x)").is_err());
        assert!(parse("KERNEL_VARIANT(a, 1, 2, 3, 4").is_err());
        assert_eq!(parse("KERNEL_VARIANT(a, 1, 2, 3, 4)").unwrap()[0].shared, 4);
    }
}
