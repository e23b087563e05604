//! TLS with client certificates (mTLS) and the API key.

use std::sync::Arc;
use std::time::Duration;

use engine_client::tonic::Code;
use engine_client::{request, Client, ServingStatus, TlsConfig};

use crate::{Ctx, Srv, API_KEY};

fn tls(ctx: &Ctx) -> TlsConfig {
    TlsConfig::new()
        .ca_certificate_pem(&ctx.certs.ca_pem)
        .client_identity_pem(&ctx.certs.client_cert_pem, &ctx.certs.client_key_pem)
        .domain_name("localhost")
}

pub async fn tls_with_api_key(ctx: Arc<Ctx>) {
    let client = Client::builder(ctx.target(Srv::Secure))
        .tls(tls(&ctx))
        .api_key(API_KEY)
        .timeout(Duration::from_secs(30))
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("connect over mTLS");
    assert_eq!(client.health("").await.unwrap(), ServingStatus::Serving);
    assert_eq!(client.model_info().await.unwrap().architecture, "LlamaForCausalLM");
    let completion =
        client.complete(request::text("hello").max_tokens(4).ignore_eos(true).build()).await.unwrap();
    assert_eq!(completion.outputs[0].token_ids.len(), 4);
}

pub async fn rejected_credentials(ctx: Arc<Ctx>) {
    let target = ctx.target(Srv::Secure);

    // No API key, or a wrong one: UNAUTHENTICATED (health stays open, for load balancers).
    let keyless = Client::builder(&target).tls(tls(&ctx)).connect().await.expect("TLS itself works");
    assert_eq!(keyless.model_info().await.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(keyless.health("").await.unwrap(), ServingStatus::Serving);
    let wrong = Client::builder(&target).tls(tls(&ctx)).api_key("wrong-key").connect().await.unwrap();
    let err = wrong.complete(request::text("hi").max_tokens(2).build()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");

    // No client certificate (mTLS required), a server signed by an unknown CA, or plaintext: no call succeeds.
    let anonymous = TlsConfig::new().ca_certificate_pem(&ctx.certs.ca_pem).domain_name("localhost");
    let untrusted = TlsConfig::new()
        .ca_certificate_pem(&ctx.certs.other_ca_pem)
        .client_identity_pem(&ctx.certs.client_cert_pem, &ctx.certs.client_key_pem)
        .domain_name("localhost");
    let attempts = [
        ("no client certificate", Client::builder(&target).tls(anonymous).api_key(API_KEY)),
        ("untrusted server", Client::builder(&target).tls(untrusted).api_key(API_KEY)),
        ("plaintext", Client::builder(&target).api_key(API_KEY)),
    ];
    for (what, builder) in attempts {
        let outcome = match builder
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
        {
            Err(err) => Err(err),
            Ok(client) => client.model_info().await.map(|_| ()),
        };
        let err = outcome.expect_err(what);
        assert_ne!(err.code(), Code::Unauthenticated, "{what}: refused before the API key check: {err}");
        println!("  {what}: {err}");
    }
}
