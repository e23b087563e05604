// @generated
/// Generated client implementations.
pub mod engine_service_client {
    #![allow(
        unused_variables,
        dead_code,
        missing_docs,
        clippy::wildcard_imports,
        clippy::let_unit_value,
    )]
    use tonic::codegen::*;
    use tonic::codegen::http::Uri;
    /** EngineService runs inference on one loaded model.
*/
    #[derive(Debug, Clone)]
    pub struct EngineServiceClient<T> {
        inner: tonic::client::Grpc<T>,
    }
    impl EngineServiceClient<tonic::transport::Channel> {
        /// Attempt to create a new client by connecting to a given endpoint.
        pub async fn connect<D>(dst: D) -> Result<Self, tonic::transport::Error>
        where
            D: TryInto<tonic::transport::Endpoint>,
            D::Error: Into<StdError>,
        {
            let conn = tonic::transport::Endpoint::new(dst)?.connect().await?;
            Ok(Self::new(conn))
        }
    }
    impl<T> EngineServiceClient<T>
    where
        T: tonic::client::GrpcService<tonic::body::Body>,
        T::Error: Into<StdError>,
        T::ResponseBody: Body<Data = Bytes> + std::marker::Send + 'static,
        <T::ResponseBody as Body>::Error: Into<StdError> + std::marker::Send,
    {
        pub fn new(inner: T) -> Self {
            let inner = tonic::client::Grpc::new(inner);
            Self { inner }
        }
        pub fn with_origin(inner: T, origin: Uri) -> Self {
            let inner = tonic::client::Grpc::with_origin(inner, origin);
            Self { inner }
        }
        pub fn with_interceptor<F>(
            inner: T,
            interceptor: F,
        ) -> EngineServiceClient<InterceptedService<T, F>>
        where
            F: tonic::service::Interceptor,
            T::ResponseBody: Default,
            T: tonic::codegen::Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<
                    <T as tonic::client::GrpcService<tonic::body::Body>>::ResponseBody,
                >,
            >,
            <T as tonic::codegen::Service<
                http::Request<tonic::body::Body>,
            >>::Error: Into<StdError> + std::marker::Send + std::marker::Sync,
        {
            EngineServiceClient::new(InterceptedService::new(inner, interceptor))
        }
        /// Compress requests with the given encoding.
        ///
        /// This requires the server to support it otherwise it might respond with an
        /// error.
        #[must_use]
        pub fn send_compressed(mut self, encoding: CompressionEncoding) -> Self {
            self.inner = self.inner.send_compressed(encoding);
            self
        }
        /// Enable decompressing responses.
        #[must_use]
        pub fn accept_compressed(mut self, encoding: CompressionEncoding) -> Self {
            self.inner = self.inner.accept_compressed(encoding);
            self
        }
        /// Limits the maximum size of a decoded message.
        ///
        /// Default: `4MB`
        #[must_use]
        pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
            self.inner = self.inner.max_decoding_message_size(limit);
            self
        }
        /// Limits the maximum size of an encoded message.
        ///
        /// Default: `usize::MAX`
        #[must_use]
        pub fn max_encoding_message_size(mut self, limit: usize) -> Self {
            self.inner = self.inner.max_encoding_message_size(limit);
            self
        }
        /** Generate completes a prompt. The server streams GenerateResponse messages: with `stream` = true, every
 generated token appears in exactly one message, in order, and the last message carries the finish reason of
 every completion and the usage; with `stream` = false the server sends exactly one message holding the
 whole result. The stream always ends with status OK once all completions have finished, including when
 they were aborted (finish reason ABORT). Cancelling the call or passing its deadline aborts the request.
 Errors:
   INVALID_ARGUMENT  a field is out of range or inconsistent (the message names the field), a token id is
                     outside the vocabulary, the prompt plus max_tokens exceeds the context length, text (or
                     a rendered conversation) that cannot fit in the context (GenerateRequest.text), the
                     request_id is already in flight, or the model cannot generate (an embedding model).
   DEADLINE_EXCEEDED the client's deadline passed; the request was aborted in the engine.
*/
        pub async fn generate(
            &mut self,
            request: impl tonic::IntoRequest<super::GenerateRequest>,
        ) -> std::result::Result<
            tonic::Response<tonic::codec::Streaming<super::GenerateResponse>>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/Generate",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "Generate"));
            self.inner.server_streaming(req, path, codec).await
        }
        /** Embed turns a batch of inputs into one vector each. Errors: INVALID_ARGUMENT for an empty batch, an input
 without tokens (none set, or text that tokenizes to nothing without the special tokens), a token id outside
 the vocabulary, an input longer than the context length (a text that cannot fit is refused before it is
 tokenized), more than 16384 tokens in all, or a model that is not an embedding model.
*/
        pub async fn embed(
            &mut self,
            request: impl tonic::IntoRequest<super::EmbedRequest>,
        ) -> std::result::Result<tonic::Response<super::EmbedResponse>, tonic::Status> {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/Embed",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "Embed"));
            self.inner.unary(req, path, codec).await
        }
        /** Tokenize turns text (or chat messages, through the model's chat template) into token ids.
 Errors: INVALID_ARGUMENT when chat messages are sent to a model without a chat template, or for text (or a
 rendered conversation) that could not fit in the model's context (TokenizeRequest).
*/
        pub async fn tokenize(
            &mut self,
            request: impl tonic::IntoRequest<super::TokenizeRequest>,
        ) -> std::result::Result<
            tonic::Response<super::TokenizeResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/Tokenize",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "Tokenize"));
            self.inner.unary(req, path, codec).await
        }
        /** Detokenize turns token ids into text. Errors: INVALID_ARGUMENT for a token id outside the vocabulary.
*/
        pub async fn detokenize(
            &mut self,
            request: impl tonic::IntoRequest<super::DetokenizeRequest>,
        ) -> std::result::Result<
            tonic::Response<super::DetokenizeResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/Detokenize",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "Detokenize"));
            self.inner.unary(req, path, codec).await
        }
        /** Abort stops in-flight Generate requests by id. Their streams end with finish reason ABORT and status OK.
 Unknown or already finished ids are ignored (not an error), so Abort is safe to repeat.
*/
        pub async fn abort(
            &mut self,
            request: impl tonic::IntoRequest<super::AbortRequest>,
        ) -> std::result::Result<tonic::Response<super::AbortResponse>, tonic::Status> {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/Abort",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "Abort"));
            self.inner.unary(req, path, codec).await
        }
        /** GetModelInfo describes the loaded model. It never fails once the server is serving.
*/
        pub async fn get_model_info(
            &mut self,
            request: impl tonic::IntoRequest<super::GetModelInfoRequest>,
        ) -> std::result::Result<
            tonic::Response<super::GetModelInfoResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/GetModelInfo",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "GetModelInfo"));
            self.inner.unary(req, path, codec).await
        }
        /** GetServerInfo describes the server: version, uptime, state, load and limits. It also answers while the
 server is draining or its engine has failed (state says which), so operators can see why.
*/
        pub async fn get_server_info(
            &mut self,
            request: impl tonic::IntoRequest<super::GetServerInfoRequest>,
        ) -> std::result::Result<
            tonic::Response<super::GetServerInfoResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/GetServerInfo",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "GetServerInfo"));
            self.inner.unary(req, path, codec).await
        }
        /** GetLoad is the cheap call for routers that poll often: running and waiting requests and KV cache usage.
 Like GetServerInfo it answers in every state.
*/
        pub async fn get_load(
            &mut self,
            request: impl tonic::IntoRequest<super::GetLoadRequest>,
        ) -> std::result::Result<
            tonic::Response<super::GetLoadResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/GetLoad",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "GetLoad"));
            self.inner.unary(req, path, codec).await
        }
        /** FlushCache empties the prefix cache without preempting or slowing any request: every cached block that no
 request uses is dropped, and the blocks running requests use stop being reusable (they are freed uncached
 when their requests end). So no request admitted after the call returns reuses KV computed before the
 flush: its cached_prompt_tokens counts only blocks stored after it. Running streams go on unchanged.
 Cache-event subscribers get a `cleared` event. The engine applies the flush between two steps, with
 --api-workers too (one engine serves every frontend), and the call returns once it is applied, usually
 within one step; the flush never waits for requests to finish, so it cannot fail for want of an idle
 engine (smg's FlushCache timeout has nothing to wait for here: use the call's deadline). Idempotent.
 Errors:
   DEADLINE_EXCEEDED  the deadline passed before the engine applied the flush; it may still be applied.
                      Retrying is safe.
*/
        pub async fn flush_cache(
            &mut self,
            request: impl tonic::IntoRequest<super::FlushCacheRequest>,
        ) -> std::result::Result<
            tonic::Response<super::FlushCacheResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/FlushCache",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "FlushCache"));
            self.inner.unary(req, path, codec).await
        }
        /** SubscribeCacheEvents streams the prefix cache's changes, so a router can send each request to the server
 that already holds its prefix. Token-id native: stored blocks carry their token ids and cache salt.
 The stream: a snapshot (CacheSnapshotPart) when the request asks for one or needs a resync, then one
 batch per engine step that changed the cache, numbered without gaps, each with the load record, and
 heartbeats (SubscribeCacheEventsResponse.heartbeat) while nothing changes. It runs until the client
 cancels it or the server stops (UNAVAILABLE while draining). Several subscribers may stream at once.
 Resuming: with start_sequence_number N > 0 and this instance's instance_id (or none), the server replays
 batches N, N+1, ... from its bounded replay buffer, then streams live ones; N = the next number to be
 published streams live batches only. Resync: when the replay buffer no longer holds batch N (the
 subscriber fell behind, or was away too long), or instance_id names another instance, the stream starts
 with a snapshot instead; the subscriber replaces what it knew with it. The engine never waits for a
 subscriber: one that reads too slowly while streaming, so that the batches it has not read pass the
 server's bound, has its stream ended with ABORTED, and resubscribes with its cursor + 1 (a replay, or a
 snapshot). A subscriber SHOULD send instance_id when it resumes, so a restarted server resyncs it.
 Errors:
   INVALID_ARGUMENT    start_sequence_number is beyond the next number to be published while instance_id is
                       this instance's (a number from the future).
   ABORTED             the subscriber fell behind while streaming (above); resubscribe.
   RESOURCE_EXHAUSTED  the server's limit of concurrent subscriptions is reached.
 Without prefix caching (the server's --no-prefix-caching) there are no events: the snapshot is empty and the
 stream carries heartbeats with the load.
*/
        pub async fn subscribe_cache_events(
            &mut self,
            request: impl tonic::IntoRequest<super::SubscribeCacheEventsRequest>,
        ) -> std::result::Result<
            tonic::Response<
                tonic::codec::Streaming<super::SubscribeCacheEventsResponse>,
            >,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/SubscribeCacheEvents",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(
                    GrpcMethod::new("engine.v1.EngineService", "SubscribeCacheEvents"),
                );
            self.inner.server_streaming(req, path, codec).await
        }
        /** LoRA adapter management. Admin operations: a server answers them only when its operator enabled them
 (--enable-adapter-admin); where the server uses API keys, a call MUST also carry the admin key in the
 `x-admin-key` metadata (besides the API key every call carries). Errors shared by the three:
   PERMISSION_DENIED  adapter management is off on this server, or the admin key is missing or wrong.

 LoadAdapter reads a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors; LoRA on any of the
 q/k/v/o and gate/up/down projections, any rank up to ServerLimits.max_lora_rank, lora_alpha and rsLoRA
 scaling as peft defines them) from below the server's adapter directory. It returns once the adapter is
 loaded; Generate requests may name it from then on. A refused adapter leaves nothing loaded.
 Errors:
   INVALID_ARGUMENT     a bad name; a path outside the adapter directory (../, absolute, a symlink leading
                        out: refused unread), missing, or not a directory; files that are not a LoRA
                        adapter the server implements (config missing or unparseable, another PEFT type,
                        DoRA or other options, safetensors missing, corrupt or oversized, wrong tensor
                        names or shapes, non-finite weights); target modules the model does not have; a
                        rank above max_lora_rank. The message says which.
   ALREADY_EXISTS       an adapter of that name is loaded.
   FAILED_PRECONDITION  the server serves no adapters (--max-adapters 0) or has no adapter directory.
*/
        pub async fn load_adapter(
            &mut self,
            request: impl tonic::IntoRequest<super::LoadAdapterRequest>,
        ) -> std::result::Result<
            tonic::Response<super::LoadAdapterResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/LoadAdapter",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "LoadAdapter"));
            self.inner.unary(req, path, codec).await
        }
        /** UnloadAdapter forgets a loaded adapter. It is refused while Generate requests use it: nothing is cut short;
 stop sending the name, let them finish (or Abort them), then unload.
 Errors:
   NOT_FOUND            no adapter of that name is loaded.
   FAILED_PRECONDITION  running or waiting requests use it (the message says how many).
*/
        pub async fn unload_adapter(
            &mut self,
            request: impl tonic::IntoRequest<super::UnloadAdapterRequest>,
        ) -> std::result::Result<
            tonic::Response<super::UnloadAdapterResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/UnloadAdapter",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "UnloadAdapter"));
            self.inner.unary(req, path, codec).await
        }
        /** ListAdapters lists the loaded adapters with their use now (requests, slot residency).
*/
        pub async fn list_adapters(
            &mut self,
            request: impl tonic::IntoRequest<super::ListAdaptersRequest>,
        ) -> std::result::Result<
            tonic::Response<super::ListAdaptersResponse>,
            tonic::Status,
        > {
            self.inner
                .ready()
                .await
                .map_err(|e| {
                    tonic::Status::unknown(
                        format!("Service was not ready: {}", e.into()),
                    )
                })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(
                "/engine.v1.EngineService/ListAdapters",
            );
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new("engine.v1.EngineService", "ListAdapters"));
            self.inner.unary(req, path, codec).await
        }
    }
}
/// Generated server implementations.
pub mod engine_service_server {
    #![allow(
        unused_variables,
        dead_code,
        missing_docs,
        clippy::wildcard_imports,
        clippy::let_unit_value,
    )]
    use tonic::codegen::*;
    /// Generated trait containing gRPC methods that should be implemented for use with EngineServiceServer.
    #[async_trait]
    pub trait EngineService: std::marker::Send + std::marker::Sync + 'static {
        /// Server streaming response type for the Generate method.
        type GenerateStream: tonic::codegen::tokio_stream::Stream<
                Item = std::result::Result<super::GenerateResponse, tonic::Status>,
            >
            + std::marker::Send
            + 'static;
        /** Generate completes a prompt. The server streams GenerateResponse messages: with `stream` = true, every
 generated token appears in exactly one message, in order, and the last message carries the finish reason of
 every completion and the usage; with `stream` = false the server sends exactly one message holding the
 whole result. The stream always ends with status OK once all completions have finished, including when
 they were aborted (finish reason ABORT). Cancelling the call or passing its deadline aborts the request.
 Errors:
   INVALID_ARGUMENT  a field is out of range or inconsistent (the message names the field), a token id is
                     outside the vocabulary, the prompt plus max_tokens exceeds the context length, text (or
                     a rendered conversation) that cannot fit in the context (GenerateRequest.text), the
                     request_id is already in flight, or the model cannot generate (an embedding model).
   DEADLINE_EXCEEDED the client's deadline passed; the request was aborted in the engine.
*/
        async fn generate(
            &self,
            request: tonic::Request<super::GenerateRequest>,
        ) -> std::result::Result<tonic::Response<Self::GenerateStream>, tonic::Status>;
        /** Embed turns a batch of inputs into one vector each. Errors: INVALID_ARGUMENT for an empty batch, an input
 without tokens (none set, or text that tokenizes to nothing without the special tokens), a token id outside
 the vocabulary, an input longer than the context length (a text that cannot fit is refused before it is
 tokenized), more than 16384 tokens in all, or a model that is not an embedding model.
*/
        async fn embed(
            &self,
            request: tonic::Request<super::EmbedRequest>,
        ) -> std::result::Result<tonic::Response<super::EmbedResponse>, tonic::Status>;
        /** Tokenize turns text (or chat messages, through the model's chat template) into token ids.
 Errors: INVALID_ARGUMENT when chat messages are sent to a model without a chat template, or for text (or a
 rendered conversation) that could not fit in the model's context (TokenizeRequest).
*/
        async fn tokenize(
            &self,
            request: tonic::Request<super::TokenizeRequest>,
        ) -> std::result::Result<
            tonic::Response<super::TokenizeResponse>,
            tonic::Status,
        >;
        /** Detokenize turns token ids into text. Errors: INVALID_ARGUMENT for a token id outside the vocabulary.
*/
        async fn detokenize(
            &self,
            request: tonic::Request<super::DetokenizeRequest>,
        ) -> std::result::Result<
            tonic::Response<super::DetokenizeResponse>,
            tonic::Status,
        >;
        /** Abort stops in-flight Generate requests by id. Their streams end with finish reason ABORT and status OK.
 Unknown or already finished ids are ignored (not an error), so Abort is safe to repeat.
*/
        async fn abort(
            &self,
            request: tonic::Request<super::AbortRequest>,
        ) -> std::result::Result<tonic::Response<super::AbortResponse>, tonic::Status>;
        /** GetModelInfo describes the loaded model. It never fails once the server is serving.
*/
        async fn get_model_info(
            &self,
            request: tonic::Request<super::GetModelInfoRequest>,
        ) -> std::result::Result<
            tonic::Response<super::GetModelInfoResponse>,
            tonic::Status,
        >;
        /** GetServerInfo describes the server: version, uptime, state, load and limits. It also answers while the
 server is draining or its engine has failed (state says which), so operators can see why.
*/
        async fn get_server_info(
            &self,
            request: tonic::Request<super::GetServerInfoRequest>,
        ) -> std::result::Result<
            tonic::Response<super::GetServerInfoResponse>,
            tonic::Status,
        >;
        /** GetLoad is the cheap call for routers that poll often: running and waiting requests and KV cache usage.
 Like GetServerInfo it answers in every state.
*/
        async fn get_load(
            &self,
            request: tonic::Request<super::GetLoadRequest>,
        ) -> std::result::Result<tonic::Response<super::GetLoadResponse>, tonic::Status>;
        /** FlushCache empties the prefix cache without preempting or slowing any request: every cached block that no
 request uses is dropped, and the blocks running requests use stop being reusable (they are freed uncached
 when their requests end). So no request admitted after the call returns reuses KV computed before the
 flush: its cached_prompt_tokens counts only blocks stored after it. Running streams go on unchanged.
 Cache-event subscribers get a `cleared` event. The engine applies the flush between two steps, with
 --api-workers too (one engine serves every frontend), and the call returns once it is applied, usually
 within one step; the flush never waits for requests to finish, so it cannot fail for want of an idle
 engine (smg's FlushCache timeout has nothing to wait for here: use the call's deadline). Idempotent.
 Errors:
   DEADLINE_EXCEEDED  the deadline passed before the engine applied the flush; it may still be applied.
                      Retrying is safe.
*/
        async fn flush_cache(
            &self,
            request: tonic::Request<super::FlushCacheRequest>,
        ) -> std::result::Result<
            tonic::Response<super::FlushCacheResponse>,
            tonic::Status,
        >;
        /// Server streaming response type for the SubscribeCacheEvents method.
        type SubscribeCacheEventsStream: tonic::codegen::tokio_stream::Stream<
                Item = std::result::Result<
                    super::SubscribeCacheEventsResponse,
                    tonic::Status,
                >,
            >
            + std::marker::Send
            + 'static;
        /** SubscribeCacheEvents streams the prefix cache's changes, so a router can send each request to the server
 that already holds its prefix. Token-id native: stored blocks carry their token ids and cache salt.
 The stream: a snapshot (CacheSnapshotPart) when the request asks for one or needs a resync, then one
 batch per engine step that changed the cache, numbered without gaps, each with the load record, and
 heartbeats (SubscribeCacheEventsResponse.heartbeat) while nothing changes. It runs until the client
 cancels it or the server stops (UNAVAILABLE while draining). Several subscribers may stream at once.
 Resuming: with start_sequence_number N > 0 and this instance's instance_id (or none), the server replays
 batches N, N+1, ... from its bounded replay buffer, then streams live ones; N = the next number to be
 published streams live batches only. Resync: when the replay buffer no longer holds batch N (the
 subscriber fell behind, or was away too long), or instance_id names another instance, the stream starts
 with a snapshot instead; the subscriber replaces what it knew with it. The engine never waits for a
 subscriber: one that reads too slowly while streaming, so that the batches it has not read pass the
 server's bound, has its stream ended with ABORTED, and resubscribes with its cursor + 1 (a replay, or a
 snapshot). A subscriber SHOULD send instance_id when it resumes, so a restarted server resyncs it.
 Errors:
   INVALID_ARGUMENT    start_sequence_number is beyond the next number to be published while instance_id is
                       this instance's (a number from the future).
   ABORTED             the subscriber fell behind while streaming (above); resubscribe.
   RESOURCE_EXHAUSTED  the server's limit of concurrent subscriptions is reached.
 Without prefix caching (the server's --no-prefix-caching) there are no events: the snapshot is empty and the
 stream carries heartbeats with the load.
*/
        async fn subscribe_cache_events(
            &self,
            request: tonic::Request<super::SubscribeCacheEventsRequest>,
        ) -> std::result::Result<
            tonic::Response<Self::SubscribeCacheEventsStream>,
            tonic::Status,
        >;
        /** LoRA adapter management. Admin operations: a server answers them only when its operator enabled them
 (--enable-adapter-admin); where the server uses API keys, a call MUST also carry the admin key in the
 `x-admin-key` metadata (besides the API key every call carries). Errors shared by the three:
   PERMISSION_DENIED  adapter management is off on this server, or the admin key is missing or wrong.

 LoadAdapter reads a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors; LoRA on any of the
 q/k/v/o and gate/up/down projections, any rank up to ServerLimits.max_lora_rank, lora_alpha and rsLoRA
 scaling as peft defines them) from below the server's adapter directory. It returns once the adapter is
 loaded; Generate requests may name it from then on. A refused adapter leaves nothing loaded.
 Errors:
   INVALID_ARGUMENT     a bad name; a path outside the adapter directory (../, absolute, a symlink leading
                        out: refused unread), missing, or not a directory; files that are not a LoRA
                        adapter the server implements (config missing or unparseable, another PEFT type,
                        DoRA or other options, safetensors missing, corrupt or oversized, wrong tensor
                        names or shapes, non-finite weights); target modules the model does not have; a
                        rank above max_lora_rank. The message says which.
   ALREADY_EXISTS       an adapter of that name is loaded.
   FAILED_PRECONDITION  the server serves no adapters (--max-adapters 0) or has no adapter directory.
*/
        async fn load_adapter(
            &self,
            request: tonic::Request<super::LoadAdapterRequest>,
        ) -> std::result::Result<
            tonic::Response<super::LoadAdapterResponse>,
            tonic::Status,
        >;
        /** UnloadAdapter forgets a loaded adapter. It is refused while Generate requests use it: nothing is cut short;
 stop sending the name, let them finish (or Abort them), then unload.
 Errors:
   NOT_FOUND            no adapter of that name is loaded.
   FAILED_PRECONDITION  running or waiting requests use it (the message says how many).
*/
        async fn unload_adapter(
            &self,
            request: tonic::Request<super::UnloadAdapterRequest>,
        ) -> std::result::Result<
            tonic::Response<super::UnloadAdapterResponse>,
            tonic::Status,
        >;
        /** ListAdapters lists the loaded adapters with their use now (requests, slot residency).
*/
        async fn list_adapters(
            &self,
            request: tonic::Request<super::ListAdaptersRequest>,
        ) -> std::result::Result<
            tonic::Response<super::ListAdaptersResponse>,
            tonic::Status,
        >;
    }
    /** EngineService runs inference on one loaded model.
*/
    #[derive(Debug)]
    pub struct EngineServiceServer<T> {
        inner: Arc<T>,
        accept_compression_encodings: EnabledCompressionEncodings,
        send_compression_encodings: EnabledCompressionEncodings,
        max_decoding_message_size: Option<usize>,
        max_encoding_message_size: Option<usize>,
    }
    impl<T> EngineServiceServer<T> {
        pub fn new(inner: T) -> Self {
            Self::from_arc(Arc::new(inner))
        }
        pub fn from_arc(inner: Arc<T>) -> Self {
            Self {
                inner,
                accept_compression_encodings: Default::default(),
                send_compression_encodings: Default::default(),
                max_decoding_message_size: None,
                max_encoding_message_size: None,
            }
        }
        pub fn with_interceptor<F>(
            inner: T,
            interceptor: F,
        ) -> InterceptedService<Self, F>
        where
            F: tonic::service::Interceptor,
        {
            InterceptedService::new(Self::new(inner), interceptor)
        }
        /// Enable decompressing requests with the given encoding.
        #[must_use]
        pub fn accept_compressed(mut self, encoding: CompressionEncoding) -> Self {
            self.accept_compression_encodings.enable(encoding);
            self
        }
        /// Compress responses with the given encoding, if the client supports it.
        #[must_use]
        pub fn send_compressed(mut self, encoding: CompressionEncoding) -> Self {
            self.send_compression_encodings.enable(encoding);
            self
        }
        /// Limits the maximum size of a decoded message.
        ///
        /// Default: `4MB`
        #[must_use]
        pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
            self.max_decoding_message_size = Some(limit);
            self
        }
        /// Limits the maximum size of an encoded message.
        ///
        /// Default: `usize::MAX`
        #[must_use]
        pub fn max_encoding_message_size(mut self, limit: usize) -> Self {
            self.max_encoding_message_size = Some(limit);
            self
        }
    }
    impl<T, B> tonic::codegen::Service<http::Request<B>> for EngineServiceServer<T>
    where
        T: EngineService,
        B: Body + std::marker::Send + 'static,
        B::Error: Into<StdError> + std::marker::Send + 'static,
    {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;
        fn poll_ready(
            &mut self,
            _cx: &mut Context<'_>,
        ) -> Poll<std::result::Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: http::Request<B>) -> Self::Future {
            match req.uri().path() {
                "/engine.v1.EngineService/Generate" => {
                    #[allow(non_camel_case_types)]
                    struct GenerateSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::ServerStreamingService<super::GenerateRequest>
                    for GenerateSvc<T> {
                        type Response = super::GenerateResponse;
                        type ResponseStream = T::GenerateStream;
                        type Future = BoxFuture<
                            tonic::Response<Self::ResponseStream>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::GenerateRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::generate(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = GenerateSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.server_streaming(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/Embed" => {
                    #[allow(non_camel_case_types)]
                    struct EmbedSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::EmbedRequest> for EmbedSvc<T> {
                        type Response = super::EmbedResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::EmbedRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::embed(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = EmbedSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/Tokenize" => {
                    #[allow(non_camel_case_types)]
                    struct TokenizeSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::TokenizeRequest>
                    for TokenizeSvc<T> {
                        type Response = super::TokenizeResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::TokenizeRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::tokenize(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = TokenizeSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/Detokenize" => {
                    #[allow(non_camel_case_types)]
                    struct DetokenizeSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::DetokenizeRequest>
                    for DetokenizeSvc<T> {
                        type Response = super::DetokenizeResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::DetokenizeRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::detokenize(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = DetokenizeSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/Abort" => {
                    #[allow(non_camel_case_types)]
                    struct AbortSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::AbortRequest> for AbortSvc<T> {
                        type Response = super::AbortResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::AbortRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::abort(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = AbortSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/GetModelInfo" => {
                    #[allow(non_camel_case_types)]
                    struct GetModelInfoSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::GetModelInfoRequest>
                    for GetModelInfoSvc<T> {
                        type Response = super::GetModelInfoResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::GetModelInfoRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::get_model_info(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = GetModelInfoSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/GetServerInfo" => {
                    #[allow(non_camel_case_types)]
                    struct GetServerInfoSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::GetServerInfoRequest>
                    for GetServerInfoSvc<T> {
                        type Response = super::GetServerInfoResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::GetServerInfoRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::get_server_info(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = GetServerInfoSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/GetLoad" => {
                    #[allow(non_camel_case_types)]
                    struct GetLoadSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::GetLoadRequest>
                    for GetLoadSvc<T> {
                        type Response = super::GetLoadResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::GetLoadRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::get_load(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = GetLoadSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/FlushCache" => {
                    #[allow(non_camel_case_types)]
                    struct FlushCacheSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::FlushCacheRequest>
                    for FlushCacheSvc<T> {
                        type Response = super::FlushCacheResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::FlushCacheRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::flush_cache(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = FlushCacheSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/SubscribeCacheEvents" => {
                    #[allow(non_camel_case_types)]
                    struct SubscribeCacheEventsSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::ServerStreamingService<
                        super::SubscribeCacheEventsRequest,
                    > for SubscribeCacheEventsSvc<T> {
                        type Response = super::SubscribeCacheEventsResponse;
                        type ResponseStream = T::SubscribeCacheEventsStream;
                        type Future = BoxFuture<
                            tonic::Response<Self::ResponseStream>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::SubscribeCacheEventsRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::subscribe_cache_events(
                                        &inner,
                                        request,
                                    )
                                    .await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = SubscribeCacheEventsSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.server_streaming(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/LoadAdapter" => {
                    #[allow(non_camel_case_types)]
                    struct LoadAdapterSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::LoadAdapterRequest>
                    for LoadAdapterSvc<T> {
                        type Response = super::LoadAdapterResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::LoadAdapterRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::load_adapter(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = LoadAdapterSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/UnloadAdapter" => {
                    #[allow(non_camel_case_types)]
                    struct UnloadAdapterSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::UnloadAdapterRequest>
                    for UnloadAdapterSvc<T> {
                        type Response = super::UnloadAdapterResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::UnloadAdapterRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::unload_adapter(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = UnloadAdapterSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                "/engine.v1.EngineService/ListAdapters" => {
                    #[allow(non_camel_case_types)]
                    struct ListAdaptersSvc<T: EngineService>(pub Arc<T>);
                    impl<
                        T: EngineService,
                    > tonic::server::UnaryService<super::ListAdaptersRequest>
                    for ListAdaptersSvc<T> {
                        type Response = super::ListAdaptersResponse;
                        type Future = BoxFuture<
                            tonic::Response<Self::Response>,
                            tonic::Status,
                        >;
                        fn call(
                            &mut self,
                            request: tonic::Request<super::ListAdaptersRequest>,
                        ) -> Self::Future {
                            let inner = Arc::clone(&self.0);
                            let fut = async move {
                                <T as EngineService>::list_adapters(&inner, request).await
                            };
                            Box::pin(fut)
                        }
                    }
                    let accept_compression_encodings = self.accept_compression_encodings;
                    let send_compression_encodings = self.send_compression_encodings;
                    let max_decoding_message_size = self.max_decoding_message_size;
                    let max_encoding_message_size = self.max_encoding_message_size;
                    let inner = self.inner.clone();
                    let fut = async move {
                        let method = ListAdaptersSvc(inner);
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec)
                            .apply_compression_config(
                                accept_compression_encodings,
                                send_compression_encodings,
                            )
                            .apply_max_message_size_config(
                                max_decoding_message_size,
                                max_encoding_message_size,
                            );
                        let res = grpc.unary(method, req).await;
                        Ok(res)
                    };
                    Box::pin(fut)
                }
                _ => {
                    Box::pin(async move {
                        let mut response = http::Response::new(
                            tonic::body::Body::default(),
                        );
                        let headers = response.headers_mut();
                        headers
                            .insert(
                                tonic::Status::GRPC_STATUS,
                                (tonic::Code::Unimplemented as i32).into(),
                            );
                        headers
                            .insert(
                                http::header::CONTENT_TYPE,
                                tonic::metadata::GRPC_CONTENT_TYPE,
                            );
                        Ok(response)
                    })
                }
            }
        }
    }
    impl<T> Clone for EngineServiceServer<T> {
        fn clone(&self) -> Self {
            let inner = self.inner.clone();
            Self {
                inner,
                accept_compression_encodings: self.accept_compression_encodings,
                send_compression_encodings: self.send_compression_encodings,
                max_decoding_message_size: self.max_decoding_message_size,
                max_encoding_message_size: self.max_encoding_message_size,
            }
        }
    }
    /// Generated gRPC service name
    pub const SERVICE_NAME: &str = "engine.v1.EngineService";
    impl<T> tonic::server::NamedService for EngineServiceServer<T> {
        const NAME: &'static str = SERVICE_NAME;
    }
}
