//! Command-line interface (SPEC §5). Exit codes: 0 ok, 1 invalid input, 2 usage, 3 other failures.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use keyway_core::offline::{self, Compiled};
use keyway_core::report::{self, Filter};
use keyway_core::{Kind, Time, jiff};

use crate::{source, state};

#[derive(Parser, Debug)]
#[command(
    name = "keyway",
    version,
    about = "A service-network gateway: Skupper-style sites and multi-key listeners, Gateway API ListenerSets."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a site: bind listeners, forward traffic, hot-reload the config directory.
    Run {
        /// Config directory.
        #[arg(long, default_value = "./keyway.d")]
        config: PathBuf,
        /// State directory (first-seen times and generations); default <config>/.keyway-state.
        #[arg(long)]
        state: Option<PathBuf>,
        /// Admin endpoint address (/status, /metrics, /config, /healthz, /readyz).
        #[arg(long, default_value = "127.0.0.1:9901")]
        admin: String,
        /// Seconds to let open connections finish on SIGINT/SIGTERM.
        #[arg(long, default_value_t = 10)]
        drain_timeout: u64,
    },
    /// Check a config directory; print file:line: path: message for every problem.
    Validate {
        /// Config directory.
        #[arg(long, default_value = "./keyway.d")]
        config: PathBuf,
    },
    /// Show every object with its status, computed offline from --config or read from a running site.
    Status {
        /// Config directory (offline view).
        #[arg(long, default_value = "./keyway.d", conflicts_with = "admin")]
        config: PathBuf,
        /// Admin address of a running site.
        #[arg(long)]
        admin: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Only this namespace.
        #[arg(short = 'n', long = "namespace")]
        namespace: Option<String>,
        /// Only these kinds, comma-separated (listener, mkl, gateway,listenerset, ...).
        kind: Option<String>,
        /// Only this name.
        name: Option<String>,
    },
    /// Start a small network on loopback (three linked sites, workloads, a Gateway) and print what to try.
    Demo {
        /// First port of the range the demo uses: base, +10, +80, +443 and +901..+903.
        #[arg(long, default_value_t = 17000)]
        port_base: u16,
        /// Keep the temp directory (configs, certificates, logs) after stopping.
        #[arg(long)]
        keep: bool,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
enum Output {
    Table,
    Yaml,
    Json,
}

/// Exit code for invalid input.
const INVALID: u8 = 1;
/// Exit code for failures other than invalid input.
const FAILURE: u8 = 3;

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli.command {
        Command::Run {
            config,
            state,
            admin,
            drain_timeout,
        } => {
            let state = state.unwrap_or_else(|| default_state_dir(&config));
            crate::run::run(
                config,
                state,
                &admin,
                std::time::Duration::from_secs(drain_timeout),
            )
        }
        Command::Validate { config } => validate(&config),
        Command::Status {
            config,
            admin,
            output,
            namespace,
            kind,
            name,
        } => status(&config, admin.as_deref(), output, namespace, kind, name),
        Command::Demo { port_base, keep } => crate::demo::run(port_base, keep),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(FAILURE)
        }
    }
}

pub fn now() -> Time {
    Time(jiff::Timestamp::now())
}

/// The state directory a site uses for `config` (SPEC §5 default).
pub fn default_state_dir(config: &Path) -> PathBuf {
    config.join(".keyway-state")
}

/// Compiles a directory offline, reading (never writing) its state directory.
fn compile_dir(config: &Path) -> Result<Compiled> {
    if !config.is_dir() {
        anyhow::bail!(
            "config directory {} does not exist; pass --config DIR (try --config examples/quickstart)",
            config.display()
        );
    }
    let files = source::load_dir(config)?;
    let mut objects = state::load(&default_state_dir(config))?;
    Ok(offline::compile(&files, &mut objects, &now()))
}

fn validate(config: &Path) -> Result<ExitCode> {
    let compiled = compile_dir(config)?;
    for w in &compiled.reconciled.warnings {
        eprintln!("warning: {w}");
    }
    let errors = compiled.errors();
    for e in &errors {
        println!("{e}");
    }
    if errors.is_empty() {
        println!(
            "{}: {} objects valid",
            config.display(),
            compiled.index.len()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "{} error(s); {} valid objects",
            errors.len(),
            compiled.index.len()
        );
        Ok(ExitCode::from(INVALID))
    }
}

fn status(
    config: &Path,
    admin: Option<&str>,
    output: Output,
    namespace: Option<String>,
    kind: Option<String>,
    name: Option<String>,
) -> Result<ExitCode> {
    // `kubectl`-style: `listener`, `mkl`, `gateway,listenerset`.
    let mut kinds = Vec::new();
    for k in kind
        .iter()
        .flat_map(|k| k.split(','))
        .filter(|k| !k.is_empty())
    {
        match Kind::parse_cli(k) {
            Some(kind) => kinds.push(kind),
            None => {
                let all: Vec<_> = Kind::ALL.iter().map(|k| k.name()).collect();
                eprintln!("error: unknown kind `{k}`; try one of: {}", all.join(", "));
                return Ok(ExitCode::from(2));
            }
        }
    }
    let filter = Filter {
        kinds,
        name,
        namespace,
    };
    if let Some(addr) = admin {
        let body = crate::admin::fetch(addr, "/status")?;
        let list: serde_json::Value =
            serde_json::from_str(&body).context("the site's /status is not JSON")?;
        let items: Vec<serde_json::Value> = list["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|item| filter.matches_value(item))
            .collect();
        for e in list["metadata"]["configErrors"]
            .as_array()
            .into_iter()
            .flatten()
        {
            eprintln!("error: {}", e.as_str().unwrap_or_default());
        }
        print_items(items, output)?;
        return Ok(ExitCode::SUCCESS);
    }
    let compiled = compile_dir(config)?;
    let errors = compiled.errors();
    for e in &errors {
        eprintln!("error: {e}");
    }
    let items = report::objects(&compiled.index, &compiled.statuses, &filter);
    print_items(items, output)?;
    Ok(if errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(INVALID)
    })
}

fn print_items(items: Vec<serde_json::Value>, output: Output) -> Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&report::as_list(items))?),
        Output::Yaml => {
            for item in &items {
                let text = serde_saphyr::to_string(item).context("cannot render YAML")?;
                print!("---\n{text}");
                if !text.ends_with('\n') {
                    println!();
                }
            }
        }
        Output::Table => print!("{}", report::tables(&items)),
    }
    Ok(())
}
