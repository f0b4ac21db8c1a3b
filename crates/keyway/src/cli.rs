//! Command-line interface (SPEC §5). Exit codes: 0 ok, 1 invalid input, 2 usage, 3 other failures.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use keyway_core::offline::{self, Compiled};
use keyway_core::report::{self, Filter};
use keyway_core::{Kind, Time, jiff};

use crate::{grants, source, state, token};

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

/// `HOST:PORT` (`[v6]:PORT` for an IPv6 address): a malformed address is a usage error (exit
/// 2), not a failure to bind.
fn host_port(s: &str) -> Result<String, String> {
    // An address with its port, or a name (no `:` in it: `::1:9901` is ambiguous) and a port.
    let well_formed = s.parse::<std::net::SocketAddr>().is_ok()
        || s.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && !host.contains([':', '[', ']']) && port.parse::<u16>().is_ok()
        });
    if well_formed {
        Ok(s.to_string())
    } else if s.contains(':') && !s.starts_with('[') {
        Err(format!(
            "`{s}` is not HOST:PORT: write an IPv6 address in brackets, [::1]:9901"
        ))
    } else {
        Err(format!("`{s}` is not HOST:PORT (e.g. 127.0.0.1:9901)"))
    }
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
        #[arg(long, default_value = "127.0.0.1:9901", value_parser = host_port)]
        admin: String,
        /// Seconds to let open connections finish on SIGINT/SIGTERM.
        #[arg(long, default_value_t = 10)]
        drain_timeout: u64,
        /// Seconds after which an HTTP client connection with no request in progress and
        /// nothing sent to it is closed (idle keep-alive, unfinished request heads).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
        http_idle_timeout: u64,
    },
    /// Check a config directory; print file:line: path: message for every problem.
    Validate {
        /// Config directory.
        #[arg(long, default_value = "./keyway.d")]
        config: PathBuf,
        /// State directory of the site that runs it (first-seen times decide conflicts);
        /// default <config>/.keyway-state. Only read.
        #[arg(long)]
        state: Option<PathBuf>,
    },
    /// Show every object with its status, computed offline from --config or read from a running site.
    Status {
        /// Config directory (offline view).
        #[arg(long, default_value = "./keyway.d", conflicts_with = "admin")]
        config: PathBuf,
        /// State directory of the site that runs --config (first-seen times decide conflicts);
        /// default <config>/.keyway-state. Only read.
        #[arg(long, conflicts_with = "admin")]
        state: Option<PathBuf>,
        /// Admin address of a running site.
        #[arg(long, value_parser = host_port)]
        admin: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Only this namespace.
        #[arg(short = 'n', long = "namespace")]
        namespace: Option<String>,
        /// Every namespace (the default; kubectl's flag, for habit's sake).
        #[arg(short = 'A', long = "all-namespaces", conflicts_with = "namespace")]
        all_namespaces: bool,
        /// Only these kinds, comma-separated (e.g. listener, mkl, gateway, listenerset), or
        /// KIND/NAME as kubectl takes it (listener/web).
        kind: Option<String>,
        /// Only this name.
        name: Option<String>,
    },
    /// Start a small network on loopback (three linked sites, workloads, a Gateway) and print what to try.
    Demo {
        /// First port of the range the demo uses: base, +10, +80, +443 and +901..+903.
        #[arg(long, default_value_t = 17000,
              value_parser = clap::value_parser!(u16).range(1024..=i64::from(u16::MAX - crate::demo::SPAN)))]
        port_base: u16,
        /// Keep the temp directory (configs, certificates, logs) after stopping.
        #[arg(long)]
        keep: bool,
    },
    /// Link sites with one-time tokens (AccessGrant / AccessToken), as `skupper token`.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Start a site's config directory, as `skupper site create`.
    #[command(subcommand)]
    Site(SiteCommand),
}

#[derive(Subcommand, Debug)]
enum SiteCommand {
    /// Write a Site into a new config directory; with --enable-link-access also a RouterAccess
    /// and its Secret (a new CA and this site's certificate), ready for `keyway token issue`.
    Create {
        /// The site's name (unique in its network).
        name: String,
        /// Config directory (created if missing).
        #[arg(long, default_value = "./keyway.d")]
        config: PathBuf,
        /// Accept links from other sites (an inter-router RouterAccess).
        #[arg(long)]
        enable_link_access: bool,
        /// The name or address other sites dial to reach this one (with --enable-link-access).
        #[arg(long)]
        host: Option<String>,
        /// The inter-router port.
        #[arg(long, default_value_t = 55671)]
        port: u16,
    },
}

#[derive(Subcommand, Debug)]
enum TokenCommand {
    /// Write an AccessGrant into this site's config dir and print (or write) the AccessToken
    /// another site redeems to link here. Needs a RouterAccess whose Secret holds ca.key.
    Issue {
        /// Config directory of the granting site.
        #[arg(long, default_value = "./keyway.d")]
        config: PathBuf,
        /// How many times the token may be redeemed.
        #[arg(long, default_value_t = grants::DEFAULT_REDEMPTIONS)]
        redemptions: i64,
        /// How long the token may be redeemed (15m, 1h30m, 90s).
        #[arg(long, default_value = grants::DEFAULT_EXPIRY)]
        expiry: String,
        /// Name of the AccessGrant and AccessToken (default: token-<random>).
        #[arg(long)]
        name: Option<String>,
        /// Host other sites reach this site at (default: the RouterAccess bindHost, or its
        /// first subjectAlternativeName when it binds a wildcard address).
        #[arg(long)]
        host: Option<String>,
        /// A Secret holding the issuing CA as tls.crt + tls.key (default: ca.crt + ca.key of
        /// the RouterAccess Secret).
        #[arg(long)]
        issuer: Option<String>,
        /// Write the token here (mode 0600) instead of stdout.
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
    },
    /// Redeem an AccessToken at the granting site and write the resulting Link and its Secret
    /// into this site's config dir.
    Redeem {
        /// The AccessToken YAML file.
        file: PathBuf,
        /// Config directory of the redeeming site.
        #[arg(long, default_value = "./keyway.d")]
        config: PathBuf,
        /// Name of the Link and its Secret (default: the token's name).
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
enum Output {
    Table,
    /// As `table`, with no cell cut to fit 120 columns (messages and conflicts whole).
    Wide,
    Yaml,
    Json,
    /// `kind.group/name` per object, as `kubectl get -o name` prints.
    Name,
}

/// Exit code for invalid input.
pub const INVALID: u8 = 1;
/// Exit code for a command line used wrongly: flags that do not go together, a flag's value
/// out of its range (as clap's own checks exit).
pub const USAGE: u8 = 2;
/// Exit code for failures other than invalid input.
pub const FAILURE: u8 = 3;

/// A printing command ends quietly when its reader goes away (`keyway status | head`), as Unix
/// tools do, instead of panicking on a failed print. Not for `run` and `demo`: a server must see
/// a closed socket as an error, not die of it.
fn quiet_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any other thread exists, so nothing races
    // the disposition change; SIG_DFL installs no handler, so no code runs in signal context.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    if !matches!(cli.command, Command::Run { .. } | Command::Demo { .. }) {
        quiet_on_closed_stdout();
    }
    let result = match cli.command {
        Command::Run {
            config,
            state,
            admin,
            drain_timeout,
            http_idle_timeout,
        } => {
            let state = state.unwrap_or_else(|| default_state_dir(&config));
            crate::run::run(
                config,
                state,
                &admin,
                std::time::Duration::from_secs(drain_timeout),
                std::time::Duration::from_secs(http_idle_timeout),
            )
        }
        Command::Validate { config, state } => {
            let state = state.unwrap_or_else(|| default_state_dir(&config));
            validate(&config, &state)
        }
        Command::Status {
            config,
            state,
            admin,
            output,
            namespace,
            all_namespaces: _,
            kind,
            name,
        } => {
            let state = state.unwrap_or_else(|| default_state_dir(&config));
            let source = match admin.as_deref() {
                Some(addr) => Source::Site(addr),
                None => Source::Offline(&config, &state),
            };
            status(source, output, namespace, kind, name)
        }
        Command::Token(TokenCommand::Issue {
            config,
            redemptions,
            expiry,
            name,
            host,
            issuer,
            output,
        }) => token::issue(token::IssueArgs {
            config,
            redemptions,
            expiry,
            name,
            output,
            host,
            issuer,
        }),
        Command::Token(TokenCommand::Redeem { file, config, name }) => {
            token::redeem(&file, &config, name)
        }
        Command::Site(SiteCommand::Create {
            name,
            config,
            enable_link_access,
            host,
            port,
        }) => crate::site_create::create(crate::site_create::CreateArgs {
            name,
            config,
            link_access: enable_link_access,
            host,
            port,
        }),
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

/// That `config` is a directory; else an error saying what it is instead, and `hint`.
pub fn check_config_dir(config: &Path, hint: &str) -> Result<()> {
    if config.is_file() {
        anyhow::bail!(
            "{} is a file; --config takes the directory that holds the manifests",
            config.display()
        );
    }
    if !config.is_dir() {
        anyhow::bail!(
            "config directory {} does not exist; {hint}",
            config.display()
        );
    }
    Ok(())
}

/// Compiles a directory offline, reading (never writing) its state directory.
pub fn compile_dir(config: &Path, state_dir: &Path) -> Result<Compiled> {
    compile_dir_with(
        config,
        state_dir,
        "pass --config DIR, the directory that holds the site's manifests",
        |_, _| None,
    )
}

fn compile_dir_with(
    config: &Path,
    state_dir: &Path,
    hint: &str,
    bind_error: impl Fn(&str, u16) -> Option<String>,
) -> Result<Compiled> {
    check_config_dir(config, hint)?;
    let files = source::load_dir(config)?;
    // Read, never written, here: a corrupt state file costs these commands the recorded
    // creation times (as if every object were new), not their answer. `keyway run` refuses
    // it, as it would write over it.
    let mut objects = state::load(state_dir).unwrap_or_else(|e| {
        eprintln!("warning: {e:#}; read as empty here (objects count as created now)");
        keyway_core::ObjectState::default()
    });
    Ok(offline::compile_checking_addresses(
        &files,
        &mut objects,
        &now(),
        bind_error,
    ))
}

/// What `status --config` shows: the directory compiled as a site on this host would run it,
/// with the Listeners whose host it could not bind (each host looked up once).
fn compile_dir_for_status(config: &Path, state_dir: &Path) -> Result<Compiled> {
    let checked = std::cell::RefCell::new(std::collections::HashMap::new());
    let hint = "pass --config DIR, or --admin ADDR to ask a running site";
    compile_dir_with(config, state_dir, hint, |host, port| {
        checked
            .borrow_mut()
            .entry(host.to_string())
            .or_insert_with(|| local_address_error(host, port))
            .clone()
    })
}

/// Why a Listener on `host` could not bind, found as a site would find it, without taking its
/// port: the name is looked up, and an ephemeral port bound on each address until one is
/// local (a running site may hold the port itself).
fn local_address_error(host: &str, _port: u16) -> Option<String> {
    use std::net::ToSocketAddrs;
    let addrs = match (host, 0).to_socket_addrs() {
        Ok(addrs) => addrs,
        Err(e) => return Some(e.to_string()),
    };
    let mut last = None;
    for addr in addrs {
        match std::net::TcpListener::bind(addr) {
            Ok(_) => return None,
            Err(e) => last = Some(e.to_string()),
        }
    }
    Some(last.unwrap_or_else(|| "could not resolve to any address".into()))
}

fn validate(config: &Path, state_dir: &Path) -> Result<ExitCode> {
    let compiled = compile_dir(config, state_dir)?;
    for w in &compiled.reconciled.warnings {
        eprintln!("warning: {w}");
    }
    for w in unbindable_hosts(&compiled) {
        eprintln!("warning: {w}");
    }
    let mut errors = compiled.errors();
    errors.extend(certificate_errors(&compiled));
    // Found in several passes (parsing, references, certificates); read in file order.
    errors.sort_by(|a, b| {
        (a.origin.file.as_str(), a.origin.line).cmp(&(b.origin.file.as_str(), b.origin.line))
    });
    for e in &errors {
        println!("{e}");
    }
    if errors.is_empty() {
        let n = compiled.index.len();
        println!(
            "{}: {n} object{} valid",
            config.display(),
            if n == 1 { "" } else { "s" }
        );
        Ok(ExitCode::SUCCESS)
    } else {
        let n = compiled.index.len();
        eprintln!(
            "{} error(s); {n} valid object{}",
            errors.len(),
            if n == 1 { "" } else { "s" }
        );
        Ok(ExitCode::from(INVALID))
    }
}

/// Listeners whose host is no address of this machine (a name that does not resolve, as
/// `host: example-01` in the MultiKeyListener proposal): valid config, which may be meant for
/// another machine, so a warning saying what a site started here would report.
fn unbindable_hosts(compiled: &Compiled) -> Vec<keyway_core::ConfigError> {
    let mut checked: std::collections::HashMap<&str, Option<String>> = Default::default();
    let mut out = Vec::new();
    for l in &compiled.resolution.plan.listeners {
        let why = checked
            .entry(l.host.as_str())
            .or_insert_with(|| local_address_error(&l.host, l.port));
        if let (Some(why), Some(obj)) = (why, compiled.index.get(&l.id)) {
            out.push(obj.error_at(
                "spec.host",
                format!(
                    "{} cannot be bound on this machine ({why}); a site started here reports this {} not Configured (use an IP address of the machine, or a name that resolves to one)",
                    l.host,
                    l.id.kind.name()
                ),
            ));
        }
    }
    out
}

/// Terminating listeners whose certificates would not serve (a key that does not belong to its
/// certificate, a chain rustls refuses): what a running site reports as InvalidCertificateRef,
/// found by building each listener's TLS configuration as the data plane does.
fn certificate_errors(compiled: &Compiled) -> Vec<keyway_core::ConfigError> {
    let mut errors = Vec::new();
    let listeners = compiled
        .gateway
        .plan
        .gateways
        .iter()
        .flat_map(|g| &g.ports)
        .flat_map(|p| &p.listeners);
    for l in listeners {
        let Err(message) = keyway_dataplane::gateway::terminating_config(l) else {
            continue;
        };
        let Some(owner) = compiled.index.get(&l.owner) else {
            continue;
        };
        let at = owner.resource.to_value()["spec"]["listeners"]
            .as_array()
            .and_then(|ls| ls.iter().position(|x| x["name"] == l.name.as_str()));
        let path = match at {
            Some(i) => format!("spec.listeners[{i}].tls.certificateRefs"),
            None => "spec.listeners".into(),
        };
        errors.push(owner.error_at(&path, format!("listener {:?}: {message}", l.name)));
    }
    errors
}

/// Where `status` reads objects from.
enum Source<'a> {
    /// A running site's admin address.
    Site(&'a str),
    /// A config directory and its state directory, compiled here.
    Offline(&'a Path, &'a Path),
}

fn status(
    source: Source<'_>,
    output: Output,
    namespace: Option<String>,
    kind: Option<String>,
    name: Option<String>,
) -> Result<ExitCode> {
    // `kubectl`-style: `listener`, `mkl`, `gateway,listenerset`, `listener/web`.
    let (kind, name) = match kind.as_deref().map(|k| k.split_once('/')) {
        Some(Some((k, n))) => {
            if name.is_some() || k.contains(',') || n.is_empty() {
                eprintln!("error: `{k}/{n}` names one object: give it alone, or KIND NAME");
                return Ok(ExitCode::from(USAGE));
            }
            (Some(k.to_string()), Some(n.to_string()))
        }
        _ => (kind, name),
    };
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
                return Ok(ExitCode::from(USAGE));
            }
        }
    }
    let filter = Filter {
        kinds,
        name,
        namespace,
    };
    // `rejected`: a document was rejected (offline: a running site would keep its last valid
    // version, which the offline report cannot show).
    type Report = (Vec<serde_json::Value>, Vec<String>, Vec<String>, bool);
    let (items, errors, warnings, rejected): Report = match source {
        Source::Site(addr) => {
            let body = crate::admin::fetch(addr, "/status")?;
            let list: serde_json::Value =
                serde_json::from_str(&body).context("the site's /status is not JSON")?;
            // What a keyway site answers: anything else there is another server.
            let Some(items) = list["items"].as_array().filter(|_| list["kind"] == "List") else {
                anyhow::bail!(
                    "{addr} answered /status with JSON that is not a keyway site's (no `kind: List` with `items`): is it the admin address of a `keyway run`?"
                );
            };
            let items = items
                .clone()
                .into_iter()
                .filter(|item| filter.matches_value(item))
                .collect();
            let strings = |field: &str| -> Vec<String> {
                list["metadata"][field]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| e.as_str().unwrap_or_default().to_string())
                    .collect()
            };
            (
                items,
                strings("configErrors"),
                strings("configWarnings"),
                false,
            )
        }
        Source::Offline(config, state_dir) => {
            let mut compiled = compile_dir_for_status(config, state_dir)?;
            let warnings = compiled
                .reconciled
                .warnings
                .iter()
                .map(ToString::to_string)
                .collect();
            let errors = compiled.errors().iter().map(ToString::to_string).collect();
            let rejected = !compiled.reconciled.errors.is_empty();
            // AccessGrant redemption counts live in the state directory.
            let book = grants::GrantBook::load(state_dir)?;
            let now = now();
            let grant_statuses = grants::grant_statuses(
                &grants::GrantContext {
                    index: &compiled.index,
                    router_access: compiled.resolution.plan.router_access.as_ref(),
                    now: &now,
                },
                &book,
            );
            compiled.statuses.extend(grant_statuses);
            let items = report::objects(&compiled.index, &compiled.statuses, &filter);
            (items, errors, warnings, rejected)
        }
    };
    // As `validate` does: an ignored document or field may be why an object is missing.
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    let mut items = items;
    filter.add_builtin_class(&mut items, serde_json::to_value(now()).unwrap_or_default());
    for e in &errors {
        eprintln!("error: {e}");
    }
    if matches!(source, Source::Offline(..)) && rejected {
        eprintln!(
            "note: this is what a site starting now would report; a running site keeps the last valid version of a rejected document, which only `keyway status --admin` shows"
        );
    }
    // A name that matches nothing is an error, as in kubectl: "No objects." would read as an
    // answer to a script that asked whether it exists.
    if let Some(name) = &filter.name
        && items.is_empty()
    {
        let what = match filter.kinds.as_slice() {
            [] => "object".to_string(),
            kinds => kinds
                .iter()
                .map(|k| k.name())
                .collect::<Vec<_>>()
                .join(" or "),
        };
        let ns = filter
            .namespace
            .as_ref()
            .map(|ns| format!(" in namespace {ns}"))
            .unwrap_or_default();
        eprintln!("error: no {what} named {name}{ns}");
        return Ok(ExitCode::from(INVALID));
    }
    print_items(items, output, &errors, &warnings)?;
    // Config errors make the exit code say so, though every object was printed.
    Ok(if errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(INVALID)
    })
}

/// `-o json` is the List `/status` answers (SPEC §6), with the config's errors and warnings.
fn print_items(
    items: Vec<serde_json::Value>,
    output: Output,
    errors: &[String],
    warnings: &[String],
) -> Result<()> {
    match output {
        Output::Json => {
            let list = report::status_list(items, errors, warnings);
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
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
        Output::Wide => print!("{}", report::tables_width(&items, usize::MAX)),
        Output::Name => {
            for item in &items {
                println!("{}", report::kubectl_name(item));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--admin` takes an address with its port, or a name and a port; a bare or unbracketed
    /// IPv6 address is a usage error with the bracketed form to write.
    #[test]
    fn admin_addresses_are_host_and_port() {
        for ok in [
            "127.0.0.1:9901",
            "[::1]:9901",
            "localhost:9901",
            "0.0.0.0:1",
        ] {
            assert_eq!(host_port(ok).as_deref(), Ok(ok));
        }
        for bad in [
            "::1",
            "::1:9901",
            "[::1]",
            "127.0.0.1",
            "localhost:x",
            ":9901",
            "[a]:1",
        ] {
            assert!(host_port(bad).is_err(), "{bad}");
        }
        assert!(host_port("::1").is_err_and(|e| e.contains("[::1]:9901")));
    }
}
