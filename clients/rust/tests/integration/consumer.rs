//! A downstream crate, outside the repository, that depends on the SDK by path as a user would: it must build
//! with plain `cargo build` and talk to the server.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use crate::support::connect;
use crate::{Ctx, Srv};

const MAIN_RS: &str = r#"use engine_client::{request, Client, StreamExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let target = std::env::args().nth(1).ok_or("usage: consumer HOST:PORT")?;
    let client = Client::connect(target).await?;
    let req = request::text("Hello from downstream").max_tokens(5).ignore_eos(true).greedy().stream(true);
    let mut stream = client.generate(req.build()).await?;
    let mut ids = Vec::new();
    while let Some(response) = stream.next().await {
        for chunk in response?.completions {
            ids.extend(chunk.token_ids);
        }
    }
    println!("tokens={ids:?} health={:?}", client.health("").await?);
    Ok(())
}
"#;

fn manifest(sdk_dir: &Path) -> String {
    // NOTE: the same tokio features as the SDK's tests, so that the shared target dir can reuse their build.
    format!(
        r#"[package]
name = "engine-client-consumer"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
engine-client = {{ path = {sdk:?} }}
tokio = {{ version = "1", features = ["macros", "rt-multi-thread", "time"] }}

[workspace]
"#,
        sdk = sdk_dir.display().to_string()
    )
}

/// Where the consumer builds: the SDK's own target directory, so that the dependencies compiled for these
/// tests are reused (cargo releases the directory's lock before it runs the test binaries).
fn consumer_target_dir(sdk_dir: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        // NOTE: a relative CARGO_TARGET_DIR is relative to where cargo ran, which is where the tests run.
        Some(dir) => std::path::absolute(dir).expect("absolute target dir"),
        None => sdk_dir.join("target"),
    }
}

/// The variables cargo sets for this test process that describe the SDK package. They must not reach the nested
/// cargo: build scripts watch some of them (ring's reruns on `CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, ...), so
/// they would rebuild the shared dependencies for the consumer and again for the next `cargo test`.
fn package_env_vars() -> Vec<std::ffi::OsString> {
    const EXACT: [&str; 9] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    std::env::vars_os()
        .map(|(name, _)| name)
        .filter(|name| {
            let name = name.to_string_lossy();
            name.starts_with("CARGO_PKG_") || EXACT.contains(&name.as_ref())
        })
        .collect()
}

pub async fn downstream_crate_builds_and_runs(ctx: Arc<Ctx>) {
    let sdk_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("engine-client-consumer-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(dir.join("Cargo.toml"), manifest(&sdk_dir)).unwrap();
    std::fs::write(dir.join("src/main.rs"), MAIN_RS).unwrap();
    // Pin the SDK's dependency versions (cargo drops the entries the consumer does not use).
    std::fs::copy(sdk_dir.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target_dir = consumer_target_dir(&sdk_dir);
    let begin = Instant::now();
    let dir_for_build = dir.clone();
    let build = tokio::task::spawn_blocking(move || {
        let mut command = Command::new(cargo);
        command
            .args(["build", "--color", "never"])
            .current_dir(&dir_for_build)
            .env("CARGO_TARGET_DIR", &target_dir);
        for name in package_env_vars() {
            command.env_remove(name);
        }
        command.output().expect("run cargo build")
    })
    .await
    .unwrap();
    assert!(build.status.success(), "consumer build failed:\n{}", String::from_utf8_lossy(&build.stderr));
    let log = String::from_utf8_lossy(&build.stderr);
    let compiled: Vec<&str> = log.lines().filter_map(|line| line.trim().strip_prefix("Compiling ")).collect();
    let blocked = log.lines().any(|line| line.contains("Blocking"));
    println!(
        "  consumer built in {:.1}s{}; compiled {compiled:?}",
        begin.elapsed().as_secs_f64(),
        if blocked { " (waited for a cargo lock)" } else { "" }
    );

    let binary = consumer_target_dir(&sdk_dir).join("debug/engine-client-consumer");
    let target = ctx.target(Srv::Plain);
    let run =
        tokio::task::spawn_blocking(move || Command::new(binary).arg(target).output().expect("run consumer"))
            .await
            .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "consumer failed: {stdout}\n{}", String::from_utf8_lossy(&run.stderr));

    // It printed what the SDK itself gets for the same greedy request.
    let client = connect(ctx.target(Srv::Plain)).await;
    let req = engine_client::request::text("Hello from downstream").max_tokens(5).ignore_eos(true).greedy();
    let ids = client.complete(req.build()).await.unwrap().outputs[0].token_ids.clone();
    assert_eq!(stdout.trim(), format!("tokens={ids:?} health=Serving"));
    let _ = std::fs::remove_dir_all(&dir);
}
