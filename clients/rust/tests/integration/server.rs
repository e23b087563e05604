//! Runs `engine-server` as a child process: `--port 0 --ready-file`, a bounded wait for the ready file, and a
//! SIGTERM (then SIGKILL) when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// First start builds the tiny model, and several servers share two cores with the build: be generous.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(240);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The server executable: `$ENGINE_SERVER_BIN`, else the project venv's `engine-server`.
pub fn server_bin() -> PathBuf {
    match std::env::var_os("ENGINE_SERVER_BIN") {
        Some(path) => PathBuf::from(path),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/engine-server"),
    }
}

/// The Python of the server's environment: `$ENGINE_PYTHON`, else `python` beside the server executable.
pub fn python_bin() -> PathBuf {
    match std::env::var_os("ENGINE_PYTHON") {
        Some(path) => PathBuf::from(path),
        None => server_bin().with_file_name("python"),
    }
}

/// One running server; stopped on drop.
pub struct ServerProcess {
    pub name: &'static str,
    pub port: u16,
    // NOTE: a Mutex so that the harness can stop servers through a shared reference, even if a timed-out case
    // still holds the context.
    child: Mutex<Child>,
    workdir: PathBuf,
}

/// A server that was spawned but is not known to be ready yet.
pub struct Starting {
    name: &'static str,
    child: Child,
    workdir: PathBuf,
    ready_file: PathBuf,
}

impl Starting {
    /// Spawns `engine-server --host 127.0.0.1 --port 0 --ready-file <tmp> <args>`.
    pub fn spawn(name: &'static str, workdir: PathBuf, args: &[String]) -> Starting {
        let bin = server_bin();
        assert!(
            bin.is_file(),
            "engine-server not found at {} (run scripts/bootstrap.sh python, or set ENGINE_SERVER_BIN)",
            bin.display()
        );
        std::fs::create_dir_all(&workdir).expect("create server workdir");
        let ready_file = workdir.join("ready.json");
        let log = std::fs::File::create(workdir.join("server.log")).expect("create server log");
        let child = Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", "0", "--ready-file"])
            .arg(&ready_file)
            // NOTE: tests never leave streams behind on purpose; a short drain keeps teardown fast regardless.
            .args(["--drain-timeout", "5"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        Starting { name, child, workdir, ready_file }
    }

    /// Waits (bounded) until the ready file appears; fails with the server's log if it exits or times out.
    pub async fn ready(mut self) -> ServerProcess {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(&self.ready_file) {
                let port = parse_port(&text).unwrap_or_else(|| panic!("bad ready file {text:?}"));
                return ServerProcess {
                    name: self.name,
                    port,
                    child: Mutex::new(self.child),
                    workdir: self.workdir,
                };
            }
            if let Some(status) = self.child.try_wait().expect("poll server") {
                panic!(
                    "server {} exited with {status} before it was ready:\n{}",
                    self.name,
                    log_tail(&self.workdir)
                );
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "server {} not ready after {STARTUP_TIMEOUT:?}:\n{}",
                    self.name,
                    log_tail(&self.workdir)
                );
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

impl ServerProcess {
    /// `127.0.0.1:PORT`.
    pub fn target(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The end of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.workdir)
    }

    /// Asks the server to stop (SIGTERM: drain, then exit); [`ServerProcess::wait_stopped`] finishes the job.
    pub fn terminate(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(child.try_wait(), Ok(None)) {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        }
    }

    /// Waits (at most `timeout`) for the server to exit on its own, after [`ServerProcess::terminate`]; `None`
    /// if it still runs then.
    pub async fn wait_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let status =
                self.child.lock().unwrap_or_else(|e| e.into_inner()).try_wait().expect("poll server");
            if status.is_some() || Instant::now() > deadline {
                return status;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Waits for the exit after [`ServerProcess::terminate`]; SIGKILL after a bounded time.
    pub fn wait_stopped(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + STOP_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                eprintln!("server {} ignored SIGTERM for {STOP_TIMEOUT:?}: killing it", self.name);
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.terminate();
        self.wait_stopped();
    }
}

/// The port of a ready file: `{"port": N, "pid": P}` (read by hand to spare the tests a JSON dependency).
fn parse_port(text: &str) -> Option<u16> {
    let rest = &text[text.find("\"port\"")? + "\"port\"".len()..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().filter(|&port| port != 0)
}

fn log_tail(workdir: &Path) -> String {
    let log = std::fs::read_to_string(workdir.join("server.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
