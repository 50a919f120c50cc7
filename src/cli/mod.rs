//! The command line: clap's option definitions ([`args`], turned into the plain types of
//! [`crate::setup`]) and one module per subcommand. The headless commands are not thin: each
//! holds its own work and report (check's detectors and exit codes, bisect, replay's verify,
//! JSON and dumps, the benchmarks, GGUF inspection); the debugger is [`crate::tui`]'s.
//!
//! Commands print with `writeln!(Out, ...)?`, never `println!`: a closed stdout (`mladb check |
//! head -1`) is then an error that propagates to `main`, which ends quietly with status 0, where
//! `println!` would panic.

pub mod args;
pub mod attach;
pub mod attach_report;
pub mod attach_tui;
pub mod bench;
pub mod bench_attach;
pub mod bench_fp8;
pub mod bench_gpu;
pub mod bench_ops;
pub mod bench_sparse;
pub mod bench_timing;
pub mod bench_traced;
pub mod bench_verdict;
pub mod check;
pub mod dump;
pub mod gguf_cmd;
pub mod import;
pub mod kernels;
pub mod layout_cmd;
pub mod layout_show;
pub mod replay;
pub mod run;
pub mod table;

use crate::error::{Error, Result};
use clap::{Parser, Subcommand};
use std::io::Write;

#[derive(Parser, Debug)]
#[command(
    name = "mladb",
    version,
    about = "A debugger for Multi-head Latent Attention (MLA) execution in GLM-5 and DeepSeek-V3",
    long_about = "mladb steps through a GLM-5 or DeepSeek-V3 forward pass op by op, on synthetic \
                  weights or a real checkpoint, and shows what each op produced.\n\nWith no \
                  subcommand it opens the debugger on the built-in glm5-tiny layout (or, when not \
                  on a terminal, prints `mladb run` of it)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Open the interactive debugger (what a bare `mladb` does on a terminal).
    Tui(args::TuiArgs),
    /// Run a forward pass headless and print the op trace.
    Run(run::RunArgs),
    /// Run the detectors (NaN/Inf, all-zero, unwritten, buffer disconnects, absorbed vs naive,
    /// prefill vs decode, a quantized kv_b_proj's decoding, an FP8 latent cache's rows, fast vs
    /// reference kernels, a reference dump) and print findings; exit 1 when there are any.
    Check(check::CheckArgs),
    /// Find the first op whose output differs between two flag sets (or a run and a dump).
    Bisect(check::BisectArgs),
    /// Time the forward pass per layer (with synthetic or real weights).
    Bench(bench::BenchArgs),
    /// Compile every CUDA kernel through NVRTC for the named architectures and report
    /// registers, shared memory and spills (no GPU needed).
    Kernels(kernels::KernelsArgs),
    /// List, show or import model layouts.
    Layout(layout_cmd::LayoutArgs),
    /// Open a recorded session in the debugger without recomputation (no model, no GPU);
    /// --verify recomputes and compares every recorded op; --json / --dump export it.
    Replay(replay::ReplayArgs),
    /// Listen for a running engine's hook (python/mladb_hook) and report the tensors it sends,
    /// from every rank at once.
    Attach(attach::AttachArgs),
    /// Turn another engine's recorded tensors (the hook's frame files, one per rank, or an
    /// SGLang dumper directory) into one dump with mladb's op names, for check --reference;
    /// exit 1 when an attention wrapper handed on another buffer than its kernel wrote.
    Import(import::ImportArgs),
    /// Inspect a GGUF file: metadata, tensors, statistics; dump a tensor dequantized to
    /// safetensors; or time dequantization on this CPU (--bench-dequant).
    Gguf(gguf_cmd::GgufArgs),
}

/// Runs the parsed command line; the exit code is 0, or 1 when `check` or `bisect` found
/// something.
pub fn main(cli: Cli) -> Result<u8> {
    let found = match cli.command {
        None => {
            use std::io::IsTerminal;
            if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() {
                crate::tui::run(&crate::tui::TuiArgs::default_demo()).map(|_| false)
            } else {
                run::run(&run::RunArgs::default_demo()).map(|_| false)
            }
        }
        Some(Command::Tui(args)) => crate::tui::run(&args.options()).map(|_| false),
        Some(Command::Run(args)) => run::run(&args).map(|_| false),
        Some(Command::Check(args)) => check::run(&args),
        Some(Command::Bisect(args)) => check::bisect(&args),
        Some(Command::Bench(args)) => bench::bench(&args).map(|_| false),
        Some(Command::Layout(args)) => layout_cmd::layout(&args).map(|_| false),
        Some(Command::Kernels(args)) => kernels::run(&args),
        Some(Command::Gguf(args)) => gguf_cmd::run(&args).map(|_| false),
        Some(Command::Attach(args)) => attach::run(&args),
        Some(Command::Import(args)) => import::run(&args),
        Some(Command::Replay(args)) => replay::run(&args),
    }?;
    Ok(found as u8)
}

/// Standard output for `write!` / `writeln!` whose errors are returned as an
/// [`Error`] about "stdout" instead of panicking as `println!` does.
pub struct Out;

impl Out {
    pub fn write_fmt(&mut self, args: std::fmt::Arguments) -> Result<()> {
        std::io::stdout()
            .lock()
            .write_fmt(args)
            .map_err(Error::stdout)
    }
}
