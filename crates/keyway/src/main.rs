//! The `keyway` binary: command line, admin endpoint and wiring. It holds no semantics; the core
//! decides, the data plane carries traffic.

mod admin;
mod allocator;
mod cli;
mod demo;
mod grants;
mod process_metrics;
mod run;
mod site;
mod site_create;
mod source;
mod state;
mod token;
mod watch;

use std::process::ExitCode;

fn main() -> ExitCode {
    allocator::tune();
    cli::main()
}
