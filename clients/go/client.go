package engine

import (
	"context"
	"errors"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// HealthServiceName is the service name the server reports health for (besides the empty name, which is the
// whole server).
const HealthServiceName = "engine.v1.EngineService"

// Client is a connection to one engine server. It is safe for concurrent use; create one per server and
// share it.
type Client struct {
	conn   *grpc.ClientConn
	rpc    enginev1.EngineServiceClient
	health healthpb.HealthClient
}

// Dial creates a client for target ("host:port", or any gRPC target such as "unix:///path"). Without TLS
// options the connection is plaintext. The connection is made in the background; with WithBlock, Dial waits
// for it until ctx is done and returns a status error with the context's code if it is not ready by then.
func Dial(ctx context.Context, target string, opts ...Option) (*Client, error) {
	var cfg dialConfig
	for _, opt := range opts {
		opt(&cfg)
	}
	dialOpts, err := cfg.dialOptions()
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(target, dialOpts...)
	if err != nil {
		return nil, err
	}
	if cfg.waitForReady {
		if err := waitReady(ctx, conn); err != nil {
			_ = conn.Close()
			return nil, err
		}
	}
	return NewClient(conn), nil
}

// NewClient wraps a connection the caller made; Close closes it.
func NewClient(conn *grpc.ClientConn) *Client {
	return &Client{conn: conn, rpc: enginev1.NewEngineServiceClient(conn), health: healthpb.NewHealthClient(conn)}
}

func (c *dialConfig) dialOptions() ([]grpc.DialOption, error) {
	var opts []grpc.DialOption
	secure := c.usesTLS()
	if secure {
		tlsCfg, err := c.tlsConfig()
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)))
	} else {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	if c.apiKey != "" {
		if !secure && !c.allowInsecureAPIKey {
			return nil, errors.New("engine: WithAPIKey on a plaintext connection: add a TLS option, " +
				"or WithInsecureAPIKey where the network cannot be observed")
		}
		opts = append(opts, grpc.WithPerRPCCredentials(newBearerCredentials(c.apiKey, !c.allowInsecureAPIKey)))
	}
	if c.keepalive != nil {
		opts = append(opts, grpc.WithKeepaliveParams(*c.keepalive))
	}
	var callOpts []grpc.CallOption
	if c.maxRecvMsgSize > 0 {
		callOpts = append(callOpts, grpc.MaxCallRecvMsgSize(c.maxRecvMsgSize))
	}
	if c.maxSendMsgSize > 0 {
		callOpts = append(callOpts, grpc.MaxCallSendMsgSize(c.maxSendMsgSize))
	}
	if len(callOpts) > 0 {
		opts = append(opts, grpc.WithDefaultCallOptions(callOpts...))
	}
	if c.defaultTimeout > 0 {
		opts = append(opts, grpc.WithChainUnaryInterceptor(defaultTimeoutInterceptor(c.defaultTimeout)))
	}
	ua := "engine-go/" + Version
	if c.userAgent != "" {
		ua = c.userAgent + " " + ua
	}
	opts = append(opts, grpc.WithUserAgent(ua))
	return append(opts, c.extra...), nil
}

// waitReady connects and waits until the connection is ready or ctx is done.
func waitReady(ctx context.Context, conn *grpc.ClientConn) error {
	conn.Connect()
	for {
		state := conn.GetState()
		switch state {
		case connectivity.Ready:
			return nil
		case connectivity.Shutdown:
			return status.Error(codes.Canceled, "engine: connection closed while dialing")
		}
		if !conn.WaitForStateChange(ctx, state) {
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// Close closes the connection; calls in flight end with status CANCELED.
func (c *Client) Close() error { return c.conn.Close() }

// Conn returns the underlying connection, for other services on the same server.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Service returns the generated stub on this client's connection (same credentials and interceptors), for
// call options this package does not expose.
func (c *Client) Service() enginev1.EngineServiceClient { return c.rpc }

// Embed returns one vector per input. The server must serve an embedding model.
func (c *Client) Embed(
	ctx context.Context, req *enginev1.EmbedRequest, opts ...grpc.CallOption,
) (*enginev1.EmbedResponse, error) {
	return c.rpc.Embed(ctx, req, opts...)
}

// EmbedTexts embeds texts with the server's defaults (normalized vectors, special tokens added).
func (c *Client) EmbedTexts(ctx context.Context, texts ...string) ([][]float32, error) {
	req := &enginev1.EmbedRequest{Inputs: make([]*enginev1.EmbedInput, len(texts))}
	for i, text := range texts {
		req.Inputs[i] = &enginev1.EmbedInput{Input: &enginev1.EmbedInput_Text{Text: text}}
	}
	resp, err := c.rpc.Embed(ctx, req)
	if err != nil {
		return nil, err
	}
	vectors := make([][]float32, len(resp.GetEmbeddings()))
	for i, e := range resp.GetEmbeddings() {
		vectors[i] = e.GetValues()
	}
	return vectors, nil
}

// Tokenize turns text or chat messages into token ids.
func (c *Client) Tokenize(
	ctx context.Context, req *enginev1.TokenizeRequest, opts ...grpc.CallOption,
) (*enginev1.TokenizeResponse, error) {
	return c.rpc.Tokenize(ctx, req, opts...)
}

// TokenizeText returns the token ids of text, with the tokenizer's special tokens (as Generate adds them to a
// text prompt).
func (c *Client) TokenizeText(ctx context.Context, text string) ([]uint32, error) {
	resp, err := c.rpc.Tokenize(ctx, &enginev1.TokenizeRequest{Input: &enginev1.TokenizeRequest_Text{Text: text}})
	if err != nil {
		return nil, err
	}
	return resp.GetTokenIds(), nil
}

// Detokenize turns token ids into text.
func (c *Client) Detokenize(
	ctx context.Context, req *enginev1.DetokenizeRequest, opts ...grpc.CallOption,
) (*enginev1.DetokenizeResponse, error) {
	return c.rpc.Detokenize(ctx, req, opts...)
}

// Abort stops in-flight Generate requests and returns the ids that were in flight. Their streams end with
// finish reason ABORT; unknown ids are ignored.
func (c *Client) Abort(ctx context.Context, requestIDs ...string) ([]string, error) {
	resp, err := c.rpc.Abort(ctx, &enginev1.AbortRequest{RequestIds: requestIDs})
	if err != nil {
		return nil, err
	}
	return resp.GetAbortedRequestIds(), nil
}

// ModelInfo describes the loaded model.
func (c *Client) ModelInfo(ctx context.Context, opts ...grpc.CallOption) (*enginev1.GetModelInfoResponse, error) {
	return c.rpc.GetModelInfo(ctx, &enginev1.GetModelInfoRequest{}, opts...)
}

// ServerInfo describes the server: version, state, load and limits.
func (c *Client) ServerInfo(ctx context.Context, opts ...grpc.CallOption) (*enginev1.GetServerInfoResponse, error) {
	return c.rpc.GetServerInfo(ctx, &enginev1.GetServerInfoRequest{}, opts...)
}

// Load returns the server's current load (running and waiting requests, KV cache use) and engine state.
func (c *Client) Load(ctx context.Context, opts ...grpc.CallOption) (*enginev1.GetLoadResponse, error) {
	return c.rpc.GetLoad(ctx, &enginev1.GetLoadRequest{}, opts...)
}

// Health asks the standard grpc.health.v1 service about service ("" for the whole server, or
// HealthServiceName).
func (c *Client) Health(
	ctx context.Context, service string, opts ...grpc.CallOption,
) (healthpb.HealthCheckResponse_ServingStatus, error) {
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service}, opts...)
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN, err
	}
	return resp.GetStatus(), nil
}
