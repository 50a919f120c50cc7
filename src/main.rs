use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // NVLink multicast stays off in NCCL (tensor parallelism across GPUs), set while this process
    // has one thread; the library sets it too where a caller has not.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    let cli = match mladb::cli::Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version: their text on stdout, exit 0.
        Err(e) if !e.use_stderr() => e.exit(),
        // A bad flag is one `error:` line and exit 2, as mladb's own checks are: clap's first
        // line, without its usage and hint lines.
        Err(e) => {
            let text = e.render().to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: bad arguments"));
            return ExitCode::from(2);
        }
    };
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
