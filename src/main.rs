use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // NVLink multicast stays off in NCCL (tensor parallelism across GPUs), set while this process
    // has one thread; the library sets it too where a caller has not.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    let cli = mladb::cli::Cli::parse();
    match mladb::cli::main(cli) {
        Ok(code) => ExitCode::from(code),
        // The reader of stdout has gone (`| head`): nothing is left to say, and nobody to say it to.
        Err(e) if e.is_closed_stdout() => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", mladb::error::printable(&e.to_string()));
            ExitCode::from(2)
        }
    }
}
