//! Async Rust client for the `engine.v1` gRPC inference API.
//!
//! ```no_run
//! use engine_client::{request, Client, StreamExt};
//!
//! # async fn run() -> engine_client::Result<()> {
//! let client = Client::connect("127.0.0.1:50051").await?;
//! let mut stream = client.generate(request::text("Hello").max_tokens(16).stream(true).build()).await?;
//! while let Some(response) = stream.next().await {
//!     for chunk in response?.completions {
//!         print!("{}", chunk.text);
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! * [`Client`] wraps one HTTP/2 connection; [`Client::builder`] adds TLS (mutual TLS too), an API key,
//!   deadlines, keepalive and message size limits.
//! * [`Client::generate`] returns a [`GenerateStream`]; dropping it cancels the request on the server.
//!   [`Client::complete`] gathers the whole result into a [`Completion`].
//! * Every failure is an [`Error`]; server statuses keep their gRPC code ([`Error::code`]).
//! * The generated messages are re-exported as [`proto`]; the [`request`] module has shortcuts to build them,
//!   structured output (a JSON schema, a regex, a grammar, a choice, ...) among them.
//!
//! The crate's version follows the contract: `0.x` of this crate speaks `engine.v1`.
#![warn(missing_docs)]

mod adapters;
mod auth;
mod builder;
mod client;
mod error;
pub mod request;
mod stream;

pub use adapters::{with_admin_key, ADMIN_KEY_METADATA};
pub use auth::ApiKeyInterceptor;
pub use builder::{ClientBuilder, Keepalive, TlsConfig, DEFAULT_MAX_MESSAGE_SIZE};
pub use client::{AuthChannel, Client, ENGINE_SERVICE_NAME};
pub use error::{Error, Result};
pub use stream::{Completion, CompletionOutput, GenerateStream};
/// The stream traits of [`GenerateStream`] (`next().await` and the other combinators), re-exported so that
/// users need no extra dependency.
pub use tokio_stream::{Stream, StreamExt};
/// The tonic version this crate is built on (for [`tonic::Code`], [`tonic::Request`], TLS types).
pub use tonic;
/// This crate's version, sent in the user agent (`engine-rust/VERSION`); released together with the contract.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The contract package this SDK speaks.
pub const API_VERSION: &str = "engine.v1";
/// `grpc.health.v1` serving status, as [`Client::health`] returns it.
pub use tonic_health::pb::health_check_response::ServingStatus;

/// The generated `engine.v1` messages and stubs (prost + tonic), from the `engine-proto` crate.
pub mod proto {
    pub use engine_proto::engine::v1::*;
}
