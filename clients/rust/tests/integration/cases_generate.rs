//! Generate: streaming, n > 1, errors, abort by id, cancellation by drop, deadlines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_client::proto::{FinishReason, GenerateRequest};
use engine_client::tonic::Code;
use engine_client::StreamExt;
use engine_client::{request, Client, Completion};

use crate::support::{connect, generate_error, python_generate, unique_id, wait_idle};
use crate::{Ctx, Srv};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";

/// A request long enough that it cannot finish on its own while a case watches it (the whole context).
async fn long_request(client: &Client, request_id: &str) -> GenerateRequest {
    let max_context = client.model_info().await.unwrap().max_context_length;
    request::text(PROMPT)
        .request_id(request_id)
        .max_tokens(max_context - 64)
        .ignore_eos(true)
        .stream(true)
        .build()
}

pub async fn greedy_stream_matches_python_client(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let streamed = request::text(PROMPT).max_tokens(24).ignore_eos(true).greedy().stream(true);

    // 1) Rust, streaming: every message but the last carries no usage and no finish reason.
    let mut stream = client.generate(streamed.clone().request_id(unique_id("greedy")).build()).await.unwrap();
    let mut responses = Vec::new();
    while let Some(response) = stream.next().await {
        responses.push(response.unwrap());
    }
    assert!(responses.len() > 1, "streamed in several messages, got {}", responses.len());
    let (last, rest) = responses.split_last().unwrap();
    assert!(last.usage.is_some());
    for response in rest {
        assert!(response.usage.is_none());
        assert!(response.completions.iter().all(|c| c.finish_reason() == FinishReason::Unspecified));
    }
    let mut completion = Completion::default();
    for response in responses.clone() {
        completion.push(response).unwrap();
    }
    let output = &completion.outputs[0];
    assert_eq!(completion.outputs.len(), 1);
    assert_eq!(output.token_ids.len(), 24);
    assert_eq!(output.finish_reason, FinishReason::Length);
    assert_eq!(completion.usage.unwrap().completion_tokens, 24);

    // 2) The same request (but not streamed) through the generated Python grpclib client.
    let reference = python_generate(ctx.server(Srv::Plain).port, &streamed.clone().stream(false).build());
    assert_eq!(reference, vec![(0, output.token_ids.clone(), output.text.clone())]);

    // 3) Rust, one message: the same tokens again.
    let whole = client.complete(streamed.stream(false).build()).await.unwrap();
    assert_eq!(whole.outputs[0].token_ids, output.token_ids);
    assert_eq!(whole.outputs[0].text, output.text);
}

pub async fn n_completions(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let greedy = request::text(PROMPT).max_tokens(8).ignore_eos(true).greedy().stream(true);
    let single = client.complete(greedy.clone().build()).await.unwrap();
    let triple = client.complete(greedy.n(3).build()).await.unwrap();
    assert_eq!(triple.outputs.len(), 3);
    for (index, output) in triple.outputs.iter().enumerate() {
        assert_eq!(output.index as usize, index);
        assert_eq!(output.token_ids, single.outputs[0].token_ids, "greedy completion {index}");
        assert_eq!(output.finish_reason, FinishReason::Length);
    }
    assert_eq!(triple.usage.unwrap().completion_tokens, 24);

    // Seeded sampling is reproducible, and the Python client gets the same tokens for the same request.
    let sampled =
        request::text(PROMPT).max_tokens(8).ignore_eos(true).temperature(1.0).seed(1234).n(2).build();
    let first = client.complete(sampled.clone()).await.unwrap();
    let again = client.complete(sampled.clone()).await.unwrap();
    assert_eq!(first.outputs, again.outputs);
    let reference = python_generate(ctx.server(Srv::Plain).port, &sampled);
    let ours: Vec<_> = first.outputs.iter().map(|o| (o.index, o.token_ids.clone(), o.text.clone())).collect();
    assert_eq!(ours, reference);
}

pub async fn invalid_argument(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let err = generate_error(&client, request::text(PROMPT).temperature(-1.0).build()).await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.status().unwrap().message().contains("temperature"), "names the field: {err}");

    let vocab_size = client.model_info().await.unwrap().vocab_size;
    let err = generate_error(&client, request::token_ids([1, vocab_size]).max_tokens(4).build()).await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");

    let err = generate_error(&client, GenerateRequest::default()).await;
    assert_eq!(err.code(), Code::InvalidArgument, "no input: {err}");

    // A request id already in flight.
    let request_id = unique_id("dup");
    let mut running = client.generate(long_request(&client, &request_id).await).await.unwrap();
    running.next().await.unwrap().unwrap();
    let err = generate_error(&client, request::text(PROMPT).request_id(&request_id).build()).await;
    assert_eq!(err.code(), Code::InvalidArgument, "duplicate id: {err}");
    drop(running);
    wait_idle(&client).await;
}

pub async fn abort_by_id(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let request_id = unique_id("abort");
    let mut stream = client.generate(long_request(&client, &request_id).await).await.unwrap();
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first.request_id, request_id);

    let begin = Instant::now();
    assert_eq!(client.abort([request_id.as_str()]).await.unwrap(), vec![request_id.clone()]);
    // The stream ends on its own, with status OK and finish reason ABORT.
    let mut completion = Completion::default();
    completion.push(first).unwrap();
    while let Some(response) = stream.next().await {
        completion.push(response.unwrap()).unwrap();
    }
    assert_eq!(completion.outputs[0].finish_reason, FinishReason::Abort);
    let generated = completion.outputs[0].token_ids.len() as u32;
    let max_tokens = long_request(&client, &request_id).await.stopping.unwrap().max_tokens.unwrap();
    assert!(generated < max_tokens, "aborted early: {generated} of {max_tokens} tokens");
    println!("  abort: {generated} tokens, stream ended {:.3}s after Abort", begin.elapsed().as_secs_f64());
    // Unknown or finished ids are ignored: Abort is safe to repeat.
    assert!(client.abort([request_id.as_str(), "no-such-request"]).await.unwrap().is_empty());
    wait_idle(&client).await;
}

pub async fn cancel_by_drop(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let request_id = unique_id("drop");
    let request = long_request(&client, &request_id).await;
    let max_tokens = request.stopping.as_ref().unwrap().max_tokens.unwrap();
    let mut stream = client.generate(request).await.unwrap();
    // Read a few messages to learn how fast this server generates, so that "idle soon after the drop" can be
    // told apart from "the request ran to its end".
    let begin = Instant::now();
    let mut received = 0;
    for _ in 0..8 {
        received += stream
            .next()
            .await
            .unwrap()
            .unwrap()
            .completions
            .iter()
            .map(|c| c.token_ids.len())
            .sum::<usize>();
    }
    let tokens_per_s = received as f64 / begin.elapsed().as_secs_f64();
    let natural_s = (max_tokens as usize - received) as f64 / tokens_per_s;
    let load = client.load().await.unwrap().load.unwrap();
    assert_eq!(load.num_running_requests + load.num_waiting_requests, 1, "{load:?}");

    let begin = Instant::now();
    drop(stream);
    wait_idle(&client).await;
    let idle_s = begin.elapsed().as_secs_f64();
    println!(
        "  cancel: server idle {idle_s:.3}s after the drop; running to the end would take ~{natural_s:.0}s"
    );
    assert!(idle_s < natural_s / 4.0, "idle after {idle_s:.2}s: the request was not cancelled");
    // The request is gone from the engine, not merely hidden: Abort no longer finds it.
    assert!(client.abort([request_id.as_str()]).await.unwrap().is_empty());
}

pub async fn deadline_exceeded(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let mut call = engine_client::tonic::Request::new(long_request(&client, &unique_id("deadline")).await);
    call.set_timeout(Duration::from_millis(500));
    let err = match client.generate(call).await {
        Err(err) => err,
        Ok(mut stream) => loop {
            match stream.next().await {
                Some(Ok(_)) => continue,
                Some(Err(err)) => break err,
                None => panic!("the stream outlived its deadline"),
            }
        },
    };
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    wait_idle(&client).await;
}
