use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = mladb::cli::Cli::parse();
    match mladb::cli::main(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
