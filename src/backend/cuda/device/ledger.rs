//! A count of the calls the CUDA backend makes into the driver and cuBLAS, and the host time
//! they take, by kind, for the whole process (every device): what `mladb bench --op-times`
//! charges each op with, to tell the driver's share of an op's host time from mladb's own.

use crate::backend::{DriverCall, DriverCalls};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Calls and nanoseconds per kind, added up since the process started.
pub struct Ledger {
    calls: [AtomicU64; DriverCall::ALL.len()],
    nanos: [AtomicU64; DriverCall::ALL.len()],
}

/// The process's ledger.
pub static LEDGER: Ledger = Ledger {
    calls: [const { AtomicU64::new(0) }; DriverCall::ALL.len()],
    nanos: [const { AtomicU64::new(0) }; DriverCall::ALL.len()],
};

impl Ledger {
    /// Runs `f`, a call of kind `kind`, counting it and its host time.
    pub fn time<T>(&self, kind: DriverCall, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let nanos = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.calls[kind as usize].fetch_add(1, Ordering::Relaxed);
        self.nanos[kind as usize].fetch_add(nanos, Ordering::Relaxed);
        out
    }

    /// The totals so far.
    pub fn totals(&self) -> DriverCalls {
        let mut totals = DriverCalls::default();
        for kind in DriverCall::ALL {
            let i = kind as usize;
            totals.calls[i] = self.calls[i].load(Ordering::Relaxed);
            totals.nanos[i] = self.nanos[i].load(Ordering::Relaxed);
        }
        totals
    }
}
