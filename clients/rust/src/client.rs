//! The client: one HTTP/2 channel, the engine.v1 stub and the health stub over it.

use std::time::Duration;

use engine_proto::engine::v1::engine_service_client::EngineServiceClient;
use engine_proto::engine::v1::{
    AbortRequest, AdapterInfo, DetokenizeRequest, EmbedRequest, EmbedResponse, FlushCacheRequest,
    GenerateRequest, GetLoadRequest, GetLoadResponse, GetModelInfoRequest, GetModelInfoResponse,
    GetServerInfoRequest, GetServerInfoResponse, ListAdaptersRequest, LoadAdapterRequest,
    SubscribeCacheEventsRequest, SubscribeCacheEventsResponse, TokenizeRequest, TokenizeResponse,
    UnloadAdapterRequest,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::IntoRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::auth::ApiKeyInterceptor;
use crate::builder::{ClientBuilder, Settings};
use crate::error::Result;
use crate::stream::{Completion, GenerateStream};

/// The channel every stub of this client shares: tonic's [`Channel`] with the API key interceptor.
pub type AuthChannel = InterceptedService<Channel, ApiKeyInterceptor>;

/// The name under which servers report the health of the engine service (`grpc.health.v1`).
pub const ENGINE_SERVICE_NAME: &str = "engine.v1.EngineService";

/// An async client of one engine server.
///
/// Cloning is cheap and clones share the connection: clone it into each task rather than wrapping it in a
/// mutex. Every method takes `impl IntoRequest<_>`, so either a bare message or a [`tonic::Request`] carrying
/// metadata or its own deadline ([`tonic::Request::set_timeout`]) works.
#[derive(Clone, Debug)]
pub struct Client {
    engine: EngineServiceClient<AuthChannel>,
    health: HealthClient<AuthChannel>,
    timeout: Option<Duration>,
}

impl Client {
    /// Connects to `target` (`host:port`, or an `http://` URI) in plaintext without an API key.
    pub async fn connect(target: impl Into<String>) -> Result<Self> {
        ClientBuilder::new(target).connect().await
    }

    /// Starts configuring a client for `target`: TLS, API key, timeouts, keepalive, message sizes.
    pub fn builder(target: impl Into<String>) -> ClientBuilder {
        ClientBuilder::new(target)
    }

    pub(crate) fn from_parts(channel: Channel, settings: Settings) -> Self {
        let intercepted = InterceptedService::new(channel, settings.interceptor);
        let engine = EngineServiceClient::new(intercepted.clone())
            .max_decoding_message_size(settings.max_message_size)
            .max_encoding_message_size(settings.max_message_size);
        Self { engine, health: HealthClient::new(intercepted), timeout: settings.timeout }
    }

    /// The generated tonic stub, for anything this client does not wrap. It shares the connection and the API
    /// key, but not the unary [`ClientBuilder::timeout`].
    pub fn raw(&self) -> EngineServiceClient<AuthChannel> {
        self.engine.clone()
    }

    /// Starts a Generate call and returns its response stream once the server accepted it.
    ///
    /// The stream yields every response message and then ends (`None`) after the last one, which carries the
    /// finish reasons and the usage. Dropping the stream early cancels the call, and the server aborts the
    /// request. Validation errors (INVALID_ARGUMENT) arrive either here or as the stream's first item,
    /// depending on when the server reports them.
    pub async fn generate(&self, request: impl IntoRequest<GenerateRequest>) -> Result<GenerateStream> {
        let response = self.engine.clone().generate(request).await?;
        Ok(GenerateStream::new(response.into_inner()))
    }

    /// Runs a Generate call to the end and gathers its output per completion (works with `stream` true or
    /// false).
    pub async fn complete(&self, request: impl IntoRequest<GenerateRequest>) -> Result<Completion> {
        self.generate(request).await?.collect_completion().await
    }

    /// Embeds a batch of inputs (the server must serve an embedding model).
    pub async fn embed(&self, request: impl IntoRequest<EmbedRequest>) -> Result<EmbedResponse> {
        Ok(self.engine.clone().embed(self.unary(request)).await?.into_inner())
    }

    /// Tokenizes text or chat messages.
    pub async fn tokenize(&self, request: impl IntoRequest<TokenizeRequest>) -> Result<TokenizeResponse> {
        Ok(self.engine.clone().tokenize(self.unary(request)).await?.into_inner())
    }

    /// Decodes token ids to text (special tokens skipped unless the request says otherwise).
    pub async fn detokenize(&self, request: impl IntoRequest<DetokenizeRequest>) -> Result<String> {
        Ok(self.engine.clone().detokenize(self.unary(request)).await?.into_inner().text)
    }

    /// Aborts in-flight Generate requests by id; returns the ids that were in flight (unknown ids are ignored).
    pub async fn abort<I, S>(&self, request_ids: I) -> Result<Vec<String>>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let request = AbortRequest { request_ids: request_ids.into_iter().map(Into::into).collect() };
        Ok(self.engine.clone().abort(self.unary(request)).await?.into_inner().aborted_request_ids)
    }

    /// Describes the loaded model.
    pub async fn model_info(&self) -> Result<GetModelInfoResponse> {
        Ok(self.engine.clone().get_model_info(self.unary(GetModelInfoRequest {})).await?.into_inner())
    }

    /// Describes the server: version, state, load and limits.
    pub async fn server_info(&self) -> Result<GetServerInfoResponse> {
        Ok(self.engine.clone().get_server_info(self.unary(GetServerInfoRequest {})).await?.into_inner())
    }

    /// The server's current load and engine state (cheap; meant for frequent polling).
    pub async fn load(&self) -> Result<GetLoadResponse> {
        Ok(self.engine.clone().get_load(self.unary(GetLoadRequest {})).await?.into_inner())
    }

    /// Empties the server's prefix cache without disturbing running requests; returns how many cached blocks
    /// it dropped. The server applies it between two engine steps; a deadline that passes first is
    /// DEADLINE_EXCEEDED (the flush may still happen; repeating it is safe).
    pub async fn flush_cache(&self) -> Result<u32> {
        let response = self.engine.clone().flush_cache(self.unary(FlushCacheRequest {})).await?;
        Ok(response.into_inner().num_blocks_flushed)
    }

    /// Opens the server's prefix-cache event stream (`SubscribeCacheEvents`), for a router that sends each
    /// request to the server that already caches its prefix: a snapshot first (responses with `snapshot` set;
    /// part 0 begins with a `cleared` event), then one response per engine step that changed the cache,
    /// numbered without gaps, each with the server's `Load`, and heartbeats while nothing changes. Keep the
    /// `sequence_number` of the last response applied and the `instance_id`; after an error (ABORTED: the
    /// subscriber fell behind; UNAVAILABLE), resubscribe with `start_sequence_number` = cursor + 1 and that
    /// `instance_id`: the server replays what was missed, or sends a snapshot. Dropping the stream cancels
    /// the call. No deadline is applied unless the request carries one (the stream runs until dropped).
    pub async fn subscribe_cache_events(
        &self,
        request: impl IntoRequest<SubscribeCacheEventsRequest>,
    ) -> Result<tonic::Streaming<SubscribeCacheEventsResponse>> {
        Ok(self.engine.clone().subscribe_cache_events(request).await?.into_inner())
    }

    /// Loads a PEFT LoRA adapter (`LoadAdapterRequest { name, path }`, the path relative to the server's
    /// `--adapter-dir`) and describes it. An admin call: PERMISSION_DENIED unless the server enables adapter
    /// management (and the request carries its admin key: [`with_admin_key`](crate::with_admin_key));
    /// INVALID_ARGUMENT for a path outside the adapter directory, files the server refuses or a rank above its
    /// maximum (nothing is loaded); ALREADY_EXISTS for a loaded name.
    pub async fn load_adapter(&self, request: impl IntoRequest<LoadAdapterRequest>) -> Result<AdapterInfo> {
        let response = self.engine.clone().load_adapter(self.unary(request)).await?;
        Ok(response.into_inner().adapter.unwrap_or_default())
    }

    /// Unloads an adapter: NOT_FOUND for an unknown name, FAILED_PRECONDITION while requests use it.
    pub async fn unload_adapter(&self, request: impl IntoRequest<UnloadAdapterRequest>) -> Result<()> {
        self.engine.clone().unload_adapter(self.unary(request)).await?;
        Ok(())
    }

    /// The loaded adapters, with the requests using each now (an admin call).
    pub async fn list_adapters(
        &self,
        request: impl IntoRequest<ListAdaptersRequest>,
    ) -> Result<Vec<AdapterInfo>> {
        let response = self.engine.clone().list_adapters(self.unary(request)).await?;
        Ok(response.into_inner().adapters)
    }

    /// `grpc.health.v1` status of `service`: `""` for the whole server, or [`ENGINE_SERVICE_NAME`].
    /// A service the server does not know is an error with code NOT_FOUND.
    pub async fn health(&self, service: &str) -> Result<ServingStatus> {
        let request = HealthCheckRequest { service: service.to_owned() };
        let response = self.health.clone().check(self.unary(request)).await?.into_inner();
        Ok(response.status())
    }

    /// Applies the client's unary deadline unless the caller gave the request its own.
    fn unary<T>(&self, request: impl IntoRequest<T>) -> tonic::Request<T> {
        let mut request = request.into_request();
        if let Some(timeout) = self.timeout {
            if !request.metadata().contains_key("grpc-timeout") {
                request.set_timeout(timeout);
            }
        }
        request
    }
}
