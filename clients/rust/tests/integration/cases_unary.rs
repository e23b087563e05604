//! Unary RPCs: health, model/server info, tokenize/detokenize, embed.

use std::sync::Arc;

use engine_client::proto::{EngineState, ModelTask, TokenizeRequest};
use engine_client::tonic::Code;
use engine_client::{request, ServingStatus, ENGINE_SERVICE_NAME};

use crate::support::{connect, generate_error};
use crate::{Ctx, Srv};

pub async fn health(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    assert_eq!(client.health("").await.unwrap(), ServingStatus::Serving);
    assert_eq!(client.health(ENGINE_SERVICE_NAME).await.unwrap(), ServingStatus::Serving);
    let err = client.health("no.such.Service").await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
}

pub async fn model_and_server_info(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let model = client.model_info().await.unwrap();
    assert_eq!(model.task(), ModelTask::Generate);
    assert_eq!(model.architecture, "LlamaForCausalLM");
    assert!(model.vocab_size > 0 && model.max_context_length > 0, "{model:?}");
    assert!(model.has_chat_template);
    let server = client.server_info().await.unwrap();
    assert_eq!(server.api_version, "engine.v1");
    assert_eq!(server.state(), EngineState::Serving);
    assert_eq!(server.limits.unwrap().max_model_len, model.max_context_length);
    let load = client.load().await.unwrap();
    assert_eq!(load.state(), EngineState::Serving);
    assert!(load.load.unwrap().num_total_kv_blocks > 0);
}

pub async fn tokenize_round_trip(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let text = "Hello, world! The quick brown fox: 42.";
    let plain = TokenizeRequest {
        add_special_tokens: Some(false),
        return_offsets: true,
        ..request::tokenize_text(text)
    };
    let tokens = client.tokenize(plain).await.unwrap();
    assert!(!tokens.token_ids.is_empty());
    assert_eq!(tokens.offsets.len(), tokens.token_ids.len());
    assert_eq!(tokens.offsets.last().unwrap().end as usize, text.chars().count());
    let decoded = client.detokenize(engine_client::proto::DetokenizeRequest {
        token_ids: tokens.token_ids.clone(),
        ..Default::default()
    });
    assert_eq!(decoded.await.unwrap(), text);

    // Special tokens (BOS) are added by default and skipped by default when decoding.
    let with_bos = client.tokenize(request::tokenize_text(text)).await.unwrap().token_ids;
    let bos = client.model_info().await.unwrap().special_tokens.unwrap().bos_token_id;
    if let Some(bos) = bos {
        assert_eq!(with_bos[0], bos);
        assert_eq!(&with_bos[1..], &tokens.token_ids[..]);
    }

    let vocab_size = client.model_info().await.unwrap().vocab_size;
    let bad = engine_client::proto::DetokenizeRequest { token_ids: vec![vocab_size], ..Default::default() };
    assert_eq!(client.detokenize(bad).await.unwrap_err().code(), Code::InvalidArgument);
}

pub async fn embed(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Embed)).await;
    let model = client.model_info().await.unwrap();
    assert_eq!(model.task(), ModelTask::Embed);
    assert_eq!(model.embedding_dimension, 384);
    let pad = model.special_tokens.unwrap().pad_token_id.expect("BERT has [PAD]");

    let texts =
        ["A cat sits on the mat.", "A kitten rests on a rug.", "Quarterly revenue grew by ten percent."];
    let response = client.embed(request::embed_texts(texts)).await.unwrap();
    assert_eq!(response.embeddings.len(), 3);
    for (embedding, text) in response.embeddings.iter().zip(texts) {
        assert_eq!(embedding.values.len(), 384);
        let norm: f32 = embedding.values.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "normalized by default: {norm}");
        let ids = client.tokenize(request::tokenize_text(text)).await.unwrap().token_ids;
        assert_eq!(embedding.num_tokens as usize, ids.len());
        assert!(!ids.contains(&pad), "only the text's tokens, no padding: {ids:?}");
    }
    let total: u32 = response.embeddings.iter().map(|e| e.num_tokens).sum();
    assert_eq!(response.usage.unwrap().prompt_tokens, total);

    // A real sentence embedding model (transformers + mean pooling give 0.665 and -0.025 for these pairs):
    // the paraphrase is close, the unrelated sentence is not.
    let cos = |a: usize, b: usize| -> f32 {
        response.embeddings[a].values.iter().zip(&response.embeddings[b].values).map(|(x, y)| x * y).sum()
    };
    assert!(cos(0, 1) > 0.6 && cos(0, 2) < 0.1, "cat/kitten {} vs cat/revenue {}", cos(0, 1), cos(0, 2));

    let empty = engine_client::proto::EmbedRequest::default();
    assert_eq!(client.embed(empty).await.unwrap_err().code(), Code::InvalidArgument);
}

pub async fn generate_on_embedding_model_is_invalid(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Embed)).await;
    let err = generate_error(&client, request::text("hi").max_tokens(4).build()).await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
}
