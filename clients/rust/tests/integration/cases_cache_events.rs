//! SubscribeCacheEvents against the spawned server: a snapshot first, then a completion's salted blocks in
//! batches numbered without gaps, each with its Load; a sequence number from the future is INVALID_ARGUMENT.

use std::sync::Arc;

use engine_client::proto::{cache_event, SubscribeCacheEventsRequest};
use engine_client::request;
use engine_client::tonic::Code;
use engine_client::StreamExt;

use crate::support::connect;
use crate::{Ctx, Srv};

pub async fn subscribe_cache_events_sees_a_completions_blocks(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let mut events = client.subscribe_cache_events(SubscribeCacheEventsRequest::default()).await.unwrap();
    let mut last = events.next().await.expect("a snapshot").unwrap();
    let part = last.snapshot.expect("the stream starts with a snapshot");
    assert_eq!(part.index, 0);
    while last.snapshot.is_some_and(|p| p.index + 1 < p.count) {
        last = events.next().await.expect("the snapshot's next part").unwrap();
    }
    let prompt: Vec<u32> = (0..40).map(|i| 500 + (i * 13) % 400).collect();
    let req = request::token_ids(prompt.clone()).max_tokens(2).greedy().cache_salt("rust-events").build();
    client.complete(req).await.unwrap();
    let wanted = [prompt[..16].to_vec(), prompt[16..32].to_vec()];
    let mut found = 0;
    let mut cursor = last.sequence_number;
    while found < wanted.len() {
        let batch = events.next().await.expect("the stream goes on").unwrap();
        if batch.heartbeat {
            continue;
        }
        assert_eq!(batch.sequence_number, cursor + 1, "a gap or a repeat");
        cursor = batch.sequence_number;
        assert!(batch.load.is_some(), "a batch without its Load");
        for event in &batch.events {
            let Some(cache_event::Kind::Stored(stored)) = &event.kind else { continue };
            if stored.cache_salt != "rust-events" {
                continue;
            }
            let size = stored.block_size as usize;
            for block in stored.token_ids.chunks(size) {
                found += wanted.iter().filter(|w| w.as_slice() == block).count();
            }
        }
    }
    drop(events);
    let future =
        SubscribeCacheEventsRequest { start_sequence_number: cursor + 1000, instance_id: last.instance_id };
    let err = match client.subscribe_cache_events(future).await {
        Err(err) => err,
        Ok(mut stream) => engine_client::Error::from(
            stream.next().await.expect("an answer").expect_err("a number from the future"),
        ),
    };
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
}
