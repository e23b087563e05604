package engine_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

// fakeEngine is an in-process EngineService for fast unit tests of the client's plumbing. It "generates"
// token ids index*1000 + step, one per message, and blocks before each step of a request whose id starts
// with "slow" until that request is aborted or cancelled.
type fakeEngine struct {
	enginev1.UnimplementedEngineServiceServer

	mu            sync.Mutex
	authorization []string                 // the authorization metadata of every call
	aborts        map[string]chan struct{} // in-flight request ids
	started       chan string              // ids of requests registered (and abortable)
	cancelled     chan string              // ids whose call context ended before they finished
	adapters      []string                 // names loaded through LoadAdapter (adapters_test.go)
}

func newFakeEngine() *fakeEngine {
	return &fakeEngine{aborts: map[string]chan struct{}{}, started: make(chan string, 16),
		cancelled: make(chan string, 16)}
}

func (f *fakeEngine) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.authorization = append(f.authorization, md.Get("authorization")...)
}

func (f *fakeEngine) Generate(req *enginev1.GenerateRequest, stream grpc.ServerStreamingServer[enginev1.GenerateResponse]) error {
	ctx := stream.Context()
	f.record(ctx)
	if req.GetText() == "" && len(req.GetTokenIds().GetIds()) == 0 {
		return status.Error(codes.InvalidArgument, "input: a prompt is required")
	}
	id := req.GetRequestId()
	if id == "" {
		id = "fake-1"
	}
	aborted := make(chan struct{})
	f.mu.Lock()
	f.aborts[id] = aborted
	f.mu.Unlock()
	f.started <- id
	n := uint32(1)
	if req.GetSampling() != nil && req.GetSampling().N != nil {
		n = req.GetSampling().GetN()
	}
	maxTokens := req.GetStopping().GetMaxTokens()
	for step := uint32(0); step < maxTokens; step++ {
		if len(id) >= 4 && id[:4] == "slow" {
			select {
			case <-aborted:
				return f.finish(stream, id, n, step, enginev1.FinishReason_FINISH_REASON_ABORT)
			case <-ctx.Done():
				f.cancelled <- id
				return ctx.Err()
			}
		}
		resp := &enginev1.GenerateResponse{RequestId: id}
		for index := range n {
			token := index*1000 + step
			resp.Completions = append(resp.Completions, &enginev1.CompletionChunk{
				Index: index, TokenIds: []uint32{token}, Text: fmt.Sprintf("t%d ", token),
			})
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
	return f.finish(stream, id, n, maxTokens, enginev1.FinishReason_FINISH_REASON_LENGTH)
}

func (f *fakeEngine) finish(
	stream grpc.ServerStreamingServer[enginev1.GenerateResponse], id string, n, steps uint32,
	reason enginev1.FinishReason,
) error {
	resp := &enginev1.GenerateResponse{
		RequestId: id, Usage: &enginev1.Usage{PromptTokens: 3, CompletionTokens: n * steps},
	}
	for index := range n {
		chunk := &enginev1.CompletionChunk{Index: index, FinishReason: reason}
		if index == 1 {
			chunk.MatchedStop = &enginev1.CompletionChunk_StopTokenId{StopTokenId: 7}
		}
		resp.Completions = append(resp.Completions, chunk)
	}
	return stream.Send(resp)
}

func (f *fakeEngine) Abort(ctx context.Context, req *enginev1.AbortRequest) (*enginev1.AbortResponse, error) {
	f.record(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &enginev1.AbortResponse{}
	for _, id := range req.GetRequestIds() {
		if ch, ok := f.aborts[id]; ok {
			close(ch)
			delete(f.aborts, id)
			resp.AbortedRequestIds = append(resp.AbortedRequestIds, id)
		}
	}
	return resp, nil
}

// Tokenize blocks until the call's context ends when the text is "block" (to test deadlines).
func (f *fakeEngine) Tokenize(ctx context.Context, req *enginev1.TokenizeRequest) (*enginev1.TokenizeResponse, error) {
	f.record(ctx)
	if req.GetText() == "block" {
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	return &enginev1.TokenizeResponse{TokenIds: []uint32{uint32(len(req.GetText()))}}, nil
}

func (f *fakeEngine) GetLoad(ctx context.Context, _ *enginev1.GetLoadRequest) (*enginev1.GetLoadResponse, error) {
	f.record(ctx)
	return &enginev1.GetLoadResponse{State: enginev1.EngineState_ENGINE_STATE_SERVING, Load: &enginev1.Load{}}, nil
}

func (f *fakeEngine) FlushCache(ctx context.Context, _ *enginev1.FlushCacheRequest) (*enginev1.FlushCacheResponse, error) {
	f.record(ctx)
	return &enginev1.FlushCacheResponse{NumBlocksFlushed: 7}, nil
}

func (f *fakeEngine) authHeaders() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.authorization...)
}

// startFake serves fakeEngine and the health service on an in-memory listener and dials it.
func startFake(t *testing.T, opts ...engine.Option) (*engine.Client, *fakeEngine) {
	t.Helper()
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	fake := newFakeEngine()
	enginev1.RegisterEngineServiceServer(server, fake)
	healthServer := health.NewServer()
	healthServer.SetServingStatus(engine.HealthServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(server, healthServer)
	go func() { _ = server.Serve(listener) }()
	t.Cleanup(server.Stop)
	dialer := func(ctx context.Context, _ string) (net.Conn, error) { return listener.DialContext(ctx) }
	opts = append(opts, engine.WithDialOptions(grpc.WithContextDialer(dialer)))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	client, err := engine.Dial(ctx, "passthrough:///bufnet", opts...)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client, fake
}
