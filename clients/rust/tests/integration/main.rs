//! Integration tests of the SDK against real `engine-server` processes on loopback.
//!
//! One binary with its own harness (`harness = false`): the servers take a while to start, so they are started
//! once, concurrently, and shared by cases that run one after another. `cargo test -- NAME` runs the cases
//! whose name contains NAME (and starts only the servers they need).

mod cases_cache;
mod cases_cache_events;
mod cases_drain;
mod cases_generate;
mod cases_security;
mod cases_structured;
mod cases_unary;
mod certs;
mod consumer;
mod server;
mod support;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use certs::Certs;
use server::{ServerProcess, Starting};

/// Longest a single case may take (a hung call fails the case instead of the whole run).
const CASE_TIMEOUT: Duration = Duration::from_secs(120);
/// The downstream crate may have to compile its dependencies first (a cold target directory).
const BUILD_CASE_TIMEOUT: Duration = Duration::from_secs(900);
/// The key the secure server requires.
pub const API_KEY: &str = "test-key-0123456789";

/// Which server a case talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Srv {
    /// The tiny generation model, plaintext, no API key, engine in a subprocess (the default deployment).
    Plain,
    /// The tiny model behind TLS with client certificates (mTLS) and an API key.
    Secure,
    /// The MiniLM embedding model.
    Embed,
}

/// What every case gets: the running servers and the test PKI.
pub struct Ctx {
    servers: Vec<(Srv, ServerProcess)>,
    pub certs: Certs,
    /// A folder for what a case makes of its own (a dedicated server's files); removed after the run.
    pub workdir: PathBuf,
}

impl Ctx {
    pub fn server(&self, which: Srv) -> &ServerProcess {
        self.servers
            .iter()
            .find(|(kind, _)| *kind == which)
            .map(|(_, server)| server)
            .unwrap_or_else(|| panic!("server {which:?} not started: declare it in the case list"))
    }

    pub fn target(&self, which: Srv) -> String {
        self.server(which).target()
    }

    async fn start(needed: &[Srv], workdir: PathBuf) -> Ctx {
        let certs = Certs::generate(&workdir.join("certs"));
        // 1) spawn every needed server at once (startup is dominated by loading torch), 2) wait for each.
        let mut starting = Vec::new();
        for &which in needed {
            let dir = workdir.join(format!("{which:?}").to_lowercase());
            starting.push((which, Starting::spawn(server_name(which), dir, &server_args(which, &certs))));
        }
        let mut servers = Vec::new();
        for (which, pending) in starting {
            let begin = Instant::now();
            let server = pending.ready().await;
            println!(
                "server {which:?} ready on {} (+{:.1}s)",
                server.target(),
                begin.elapsed().as_secs_f64()
            );
            servers.push((which, server));
        }
        Ctx { servers, certs, workdir }
    }

    fn stop(&self) {
        for (_, server) in &self.servers {
            server.terminate();
        }
        for (_, server) in &self.servers {
            server.wait_stopped();
        }
    }
}

fn server_name(which: Srv) -> &'static str {
    match which {
        Srv::Plain => "plain",
        Srv::Secure => "secure",
        Srv::Embed => "embed",
    }
}

fn server_args(which: Srv, certs: &Certs) -> Vec<String> {
    let path = |p: &PathBuf| p.display().to_string();
    match which {
        Srv::Plain => vec![],
        Srv::Secure => vec![
            "--in-process-engine".into(),
            "--api-key".into(),
            API_KEY.into(),
            "--tls-cert".into(),
            path(&certs.server_cert_file),
            "--tls-key".into(),
            path(&certs.server_key_file),
            "--tls-client-ca".into(),
            path(&certs.ca_file),
        ],
        Srv::Embed => vec!["--in-process-engine".into(), "--model".into(), support::embedding_model_dir()],
    }
}

type CaseFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One test case: a name, the servers it needs and the async function.
struct Case {
    name: &'static str,
    needs: &'static [Srv],
    run: fn(Arc<Ctx>) -> CaseFuture,
    timeout: Duration,
}

macro_rules! case {
    ($f:path, $needs:expr) => {
        case!($f, $needs, CASE_TIMEOUT)
    };
    ($f:path, $needs:expr, $timeout:expr) => {
        Case { name: stringify!($f), needs: $needs, run: |ctx| Box::pin($f(ctx)), timeout: $timeout }
    };
}

fn all_cases() -> Vec<Case> {
    use Srv::*;
    vec![
        case!(cases_unary::health, &[Plain]),
        case!(cases_unary::model_and_server_info, &[Plain]),
        case!(cases_unary::tokenize_round_trip, &[Plain]),
        case!(cases_generate::greedy_stream_matches_python_client, &[Plain]),
        case!(cases_generate::n_completions, &[Plain]),
        case!(cases_generate::invalid_argument, &[Plain]),
        case!(cases_generate::abort_by_id, &[Plain]),
        case!(cases_generate::cancel_by_drop, &[Plain]),
        case!(cases_generate::deadline_exceeded, &[Plain]),
        case!(cases_structured::json_schema_output_validates, &[Plain]),
        case!(cases_structured::choice_regex_and_grammar, &[Plain]),
        case!(cases_structured::invalid_constraint_names_the_field, &[Plain]),
        case!(cases_cache::cache_salt_priority_and_flush, &[Plain]),
        case!(cases_cache_events::subscribe_cache_events_sees_a_completions_blocks, &[Plain]),
        case!(cases_drain::stream_survives_server_drain, &[]),
        case!(cases_unary::embed, &[Embed]),
        case!(cases_unary::generate_on_embedding_model_is_invalid, &[Embed]),
        case!(cases_security::tls_with_api_key, &[Secure]),
        case!(cases_security::rejected_credentials, &[Secure]),
        case!(consumer::downstream_crate_builds_and_runs, &[Plain], BUILD_CASE_TIMEOUT),
    ]
}

fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|arg| !arg.starts_with('-')).collect();
    let cases: Vec<Case> = all_cases()
        .into_iter()
        .filter(|case| filters.is_empty() || filters.iter().any(|f| case.name.contains(f.as_str())))
        .collect();
    let mut needed: Vec<Srv> = Vec::new();
    for case in &cases {
        for which in case.needs {
            if !needed.contains(which) {
                needed.push(*which);
            }
        }
    }
    let workdir = std::env::temp_dir().join(format!("engine-client-it-{}", std::process::id()));
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");

    let begin = Instant::now();
    let ctx = Arc::new(runtime.block_on(Ctx::start(&needed, workdir.clone())));
    println!(
        "servers {needed:?} ready in {:.1}s; running {} cases",
        begin.elapsed().as_secs_f64(),
        cases.len()
    );

    let mut failed = Vec::new();
    for case in &cases {
        let started = Instant::now();
        let outcome = runtime.block_on(async {
            let mut task = tokio::spawn((case.run)(ctx.clone()));
            let outcome = tokio::time::timeout(case.timeout, &mut task).await;
            if outcome.is_err() {
                task.abort();
            }
            outcome
        });
        let verdict = match outcome {
            Ok(Ok(())) => "ok",
            Ok(Err(_)) => "FAILED (panicked, see above)",
            Err(_) => "FAILED (timed out)",
        };
        println!("case {} ... {verdict} ({:.2}s)", case.name, started.elapsed().as_secs_f64());
        if verdict != "ok" {
            failed.push(case.name);
        }
    }

    if !failed.is_empty() {
        for (which, server) in &ctx.servers {
            eprintln!("---- log tail of server {which:?} ----\n{}", server.log_tail());
        }
    }
    ctx.stop();
    drop(ctx);
    drop(runtime);
    let _ = std::fs::remove_dir_all(&workdir);
    println!(
        "{} passed, {} failed in {:.1}s",
        cases.len() - failed.len(),
        failed.len(),
        begin.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        eprintln!("failed cases: {failed:?}");
        std::process::exit(1);
    }
}
