//! The `keyway` binary: command line, admin endpoint and wiring. It holds no semantics; the core
//! decides, the data plane carries traffic.

mod cli;
mod source;
mod state;

use std::process::ExitCode;

fn main() -> ExitCode {
    cli::main()
}
