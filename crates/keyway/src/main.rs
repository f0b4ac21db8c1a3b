//! The `keyway` binary: command line, admin endpoint and wiring. It holds no semantics; the core
//! decides, the data plane carries traffic.

mod admin;
mod cli;
mod demo;
mod grants;
mod run;
mod site;
mod source;
mod state;
mod token;
mod watch;

use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    cli::main()
}
