//! Drain (SIGTERM) as docs/deploy.md promises it to tonic clients: the server sends them an early
//! GOAWAY(2^31-1) while their stream runs (user-agent with "tonic/"), the stream still ends normally with every
//! token, a call made after the drain began is refused with UNAVAILABLE instead of hanging, and the server exits
//! 0 once its streams are done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use engine_client::proto::{FinishReason, GenerateResponse};
use engine_client::tonic::transport::Endpoint;
use engine_client::tonic::{Code, Request, Streaming};
use engine_client::{request, Completion, ServingStatus, StreamExt};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::server::Starting;
use crate::support::{connect, SETTLE_TIMEOUT};
use crate::Ctx;

/// A stream of about 3 s on the simulated engine (one token per step, no model): long enough to span the start
/// of a drain, short enough for a quick case.
const STEP_MS: &str = "20";
const MAX_TOKENS: u32 = 150;
/// Bound on the call made while draining: it must be refused, not left waiting.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(5);
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

pub async fn stream_survives_server_drain(ctx: Arc<Ctx>) {
    // A server of this case's own, with a drain timeout far longer than its stream.
    let args = ["--simulated-engine", STEP_MS, "--drain-timeout", "60"].map(String::from);
    let server = Starting::spawn("drain", ctx.workdir.join("drain"), &args).ready().await;
    let client = connect(server.target()).await;
    // NOTE: on a connection of its own, so that the stream's connection carries the stream alone.
    let mut health = watch_health(&server.target()).await;
    assert_eq!(next_status(&mut health).await, ServingStatus::Serving);

    let request = request::text("drain").max_tokens(MAX_TOKENS).ignore_eos(true).stream(true).build();
    let mut stream = client.generate(request).await.expect("Generate");
    let first = stream.next().await.expect("a first message").expect("first message");
    // 1) The rest is read as it arrives, so that the case knows the stream was still running when the drain
    // began.
    let num_tokens = Arc::new(AtomicUsize::new(count_tokens(&first)));
    let rest = tokio::spawn({
        let num_tokens = num_tokens.clone();
        async move {
            let mut responses = Vec::new();
            while let Some(item) = stream.next().await {
                let response = item?;
                num_tokens.fetch_add(count_tokens(&response), Ordering::SeqCst);
                responses.push(response);
            }
            Ok::<_, engine_client::Error>(responses)
        }
    });

    // 2) SIGTERM; NOT_SERVING says the drain has begun (the server refuses new calls from then on).
    server.terminate();
    assert_eq!(next_status(&mut health).await, ServingStatus::NotServing);
    let num_before = num_tokens.load(Ordering::SeqCst);
    assert!(
        num_before < MAX_TOKENS as usize,
        "the stream had all {num_before} tokens before the drain began: it proves nothing (raise MAX_TOKENS)"
    );

    // 3) A new call on the same client: refused at once, whether it goes out on the connection that got the
    // early GOAWAY or on a new one.
    let mut call = Request::new(request::text("after the drain began").max_tokens(1).build());
    call.set_timeout(REFUSAL_TIMEOUT);
    let refused = tokio::time::timeout(REFUSAL_TIMEOUT, client.complete(call))
        .await
        .unwrap_or_else(|_| panic!("a call made while draining got no answer in {REFUSAL_TIMEOUT:?}"));
    let err = refused.expect_err("a call made while draining succeeded");
    assert_eq!(err.code(), Code::Unavailable, "a call made while draining: {err}");

    // 4) The stream goes on to its normal end: every token, finish reason LENGTH, status OK.
    let responses = rest.await.expect("reader task").unwrap_or_else(|err| {
        panic!("the stream failed after {} tokens: {err}", num_tokens.load(Ordering::SeqCst))
    });
    let mut completion = Completion::default();
    for response in std::iter::once(first).chain(responses) {
        completion.push(response).expect("a well-formed stream");
    }
    assert_eq!(completion.outputs.len(), 1);
    assert_eq!(completion.outputs[0].token_ids.len(), MAX_TOKENS as usize);
    assert_eq!(completion.outputs[0].finish_reason, FinishReason::Length);
    assert_eq!(completion.usage.expect("usage").completion_tokens, MAX_TOKENS);

    // 5) The drain ends once the stream is done: the server exits, and with 0.
    let status = server.wait_exit(EXIT_TIMEOUT).await;
    assert!(status.is_some_and(|status| status.success()), "server exit: {status:?}\n{}", server.log_tail());
}

/// A health Watch of the whole server, on a plain channel of its own.
async fn watch_health(target: &str) -> Streaming<HealthCheckResponse> {
    let channel = Endpoint::from_shared(format!("http://{target}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let request = HealthCheckRequest { service: String::new() };
    HealthClient::new(channel).watch(request).await.expect("health Watch").into_inner()
}

/// The Watch's next status (bounded).
async fn next_status(watch: &mut Streaming<HealthCheckResponse>) -> ServingStatus {
    let message = tokio::time::timeout(SETTLE_TIMEOUT, watch.message())
        .await
        .unwrap_or_else(|_| panic!("no health status in {SETTLE_TIMEOUT:?}"));
    message.expect("health Watch").expect("the health Watch ended").status()
}

fn count_tokens(response: &GenerateResponse) -> usize {
    response.completions.iter().map(|chunk| chunk.token_ids.len()).sum()
}
