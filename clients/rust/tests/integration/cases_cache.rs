//! cache_salt, priority and FlushCache against the spawned server: different salts never share cached prompt
//! tokens, the same salt does, priority changes no token, and a flush empties the cache.

use std::sync::Arc;

use engine_client::request;
use engine_client::tonic::Code;
use engine_client::Client;

use crate::support::{connect, generate_error};
use crate::{Ctx, Srv};

/// A 40-token prompt can take two full 16-token blocks from the prefix cache.
const CACHED: u32 = 32;

/// 40 token ids from a fixed recipe (a small linear congruential sequence in the tiny model's vocabulary).
fn prompt(seed: u32) -> Vec<u32> {
    let mut x = seed;
    (0..40)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            3 + (x >> 16) % 997
        })
        .collect()
}

async fn cached(client: &Client, prompt: &[u32], salt: &str, priority: i32) -> (u32, Vec<u32>) {
    let req = request::token_ids(prompt.to_vec())
        .max_tokens(4)
        .greedy()
        .ignore_eos(true)
        .cache_salt(salt)
        .priority(priority)
        .build();
    let completion = client.complete(req).await.unwrap();
    let usage = completion.usage.expect("usage in the last response");
    (usage.cached_prompt_tokens, completion.outputs[0].token_ids.clone())
}

pub async fn cache_salt_priority_and_flush(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let prompt = prompt(17);
    let (first, tokens) = cached(&client, &prompt, "rust-a", 0).await;
    assert_eq!(first, 0);
    assert_eq!(cached(&client, &prompt, "rust-b", 0).await.0, 0, "another salt shares nothing");
    let (again, again_tokens) = cached(&client, &prompt, "rust-a", i32::MIN).await;
    assert_eq!(again, CACHED, "the same salt reuses the prefix");
    assert_eq!(again_tokens, tokens, "neither the cache nor priority changes tokens");
    let flushed = client.flush_cache().await.unwrap();
    assert!(flushed >= 2, "FlushCache dropped {flushed} blocks");
    assert_eq!(cached(&client, &prompt, "rust-a", i32::MAX).await.0, 0, "nothing cached after the flush");

    let too_long = request::token_ids(prompt.clone()).max_tokens(1).cache_salt("s".repeat(257)).build();
    let err = generate_error(&client, too_long).await;
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.to_string().contains("cache_salt"), "{err}");
}
