use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
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
