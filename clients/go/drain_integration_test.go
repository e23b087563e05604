package engine_test

import (
	"context"
	"io"
	"sync/atomic"
	"testing"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	"github.com/engine-project/engine/clients/go/internal/testserver"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

const (
	// drainStepMillis and drainMaxTokens make a stream of about 3 s on the simulated engine (one token per
	// step, no model): long enough to span the start of a drain, short enough for a quick test.
	drainStepMillis = "20"
	drainMaxTokens  = 150
	// drainRefusalTimeout bounds the call made while draining: it must be refused, not left waiting.
	drainRefusalTimeout = 5 * time.Second
	drainExitTimeout    = 30 * time.Second
)

// generateResult is what the rest of a Generate stream brought: its messages, then io.EOF or the error.
type generateResult struct {
	responses []*enginev1.GenerateResponse
	err       error
}

// TestGenerateStreamSurvivesServerDrain checks docs/deploy.md's promise to grpc-go clients: on SIGTERM the
// server tells them GOAWAY while their stream runs (the early GOAWAY(2^31-1) for user-agents with "grpc-go/"),
// the stream still ends normally with every token, a call made after the drain began is refused with
// UNAVAILABLE instead of hanging, and the server exits 0 once its streams are done.
func TestGenerateStreamSurvivesServerDrain(t *testing.T) {
	srv := startDrainServer(t)
	client := dial(t, srv.Target)
	ctx := integrationContext(t)
	// NOTE: on a connection of its own, so that the stream's connection carries the stream alone.
	health := watchHealth(ctx, t, dial(t, srv.Target).Conn())
	if got := health(); got != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health before the drain: %v", got)
	}

	req := engine.TextPrompt("drain", engine.MaxTokens(drainMaxTokens), engine.IgnoreEOS())
	stream, err := client.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	first, err := stream.Recv()
	if err != nil {
		t.Fatalf("first message: %v", err)
	}
	// 1) The rest is read as it arrives, so that the test knows the stream was still running when the
	// drain began.
	var numTokens atomic.Int64
	numTokens.Store(int64(countTokens(first)))
	rest := make(chan generateResult, 1)
	go func() {
		var result generateResult
		for {
			resp, err := stream.Recv()
			if err != nil {
				result.err = err
				break
			}
			result.responses = append(result.responses, resp)
			numTokens.Add(int64(countTokens(resp)))
		}
		rest <- result
	}()

	// 2) SIGTERM; NOT_SERVING says the drain has begun (the server refuses new calls from then on).
	srv.Terminate()
	if got := health(); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health after SIGTERM: %v", got)
	}
	if n := numTokens.Load(); n >= drainMaxTokens {
		t.Fatalf("the stream had all %d tokens before the drain began: it proves nothing (raise drainMaxTokens)", n)
	}

	// 3) A new call on the same client: refused at once, whether it goes out on the connection that got the
	// early GOAWAY or on a new one.
	callCtx, cancel := context.WithTimeout(ctx, drainRefusalTimeout)
	defer cancel()
	_, err = client.Complete(callCtx, engine.TextPrompt("after the drain began", engine.MaxTokens(1)))
	if status.Code(err) != codes.Unavailable {
		t.Errorf("a call made while draining: %v, want UNAVAILABLE", err)
	}

	// 4) The stream goes on to its normal end: every token, finish reason LENGTH, status OK.
	result := <-rest // bounded: the stream's context ends with the test's
	if result.err != io.EOF {
		t.Fatalf("the stream ended with %v after %d tokens, want its normal end", result.err, numTokens.Load())
	}
	acc := engine.NewAccumulator(req)
	for _, resp := range append([]*enginev1.GenerateResponse{first}, result.responses...) {
		if err := acc.Add(resp); err != nil {
			t.Fatal(err)
		}
	}
	completion := acc.Completion()
	if len(completion.Choices) != 1 {
		t.Fatalf("%d choices, want 1", len(completion.Choices))
	}
	choice := completion.Choices[0]
	if len(choice.TokenIDs) != drainMaxTokens || completion.Usage.GetCompletionTokens() != drainMaxTokens {
		t.Errorf("%d tokens (usage %v), want max_tokens=%d", len(choice.TokenIDs), completion.Usage, drainMaxTokens)
	}
	if choice.FinishReason != enginev1.FinishReason_FINISH_REASON_LENGTH {
		t.Errorf("finish reason %v, want LENGTH", choice.FinishReason)
	}

	// 5) The drain ends once the stream is done: the server exits, and with 0.
	code, err := srv.WaitExit(drainExitTimeout)
	if err != nil || code != 0 {
		t.Errorf("server exit: code %d, %v\n%s", code, err, srv.LogTail(4000))
	}
}

// startDrainServer starts a server of the test's own (it is stopped by the test): the simulated engine, whose
// streams take a known time, and a drain timeout far longer than any stream of the test.
func startDrainServer(t *testing.T) *testserver.Server {
	t.Helper()
	srv, err := testserver.Start(context.Background(), "--simulated-engine", drainStepMillis,
		"--drain-timeout", "60", "--log-level", "warning")
	if err != nil {
		t.Fatalf("the drain test's engine-server did not start: %v", err)
	}
	t.Cleanup(srv.Stop)
	return srv
}

// watchHealth opens a health Watch of the whole server and returns a function that waits for its next status
// (bounded by ctx; a broken Watch fails the test).
func watchHealth(
	ctx context.Context, t *testing.T, conn *grpc.ClientConn,
) func() healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	watch, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return func() healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("health Watch: %v", err)
		}
		return resp.GetStatus()
	}
}

func countTokens(resp *enginev1.GenerateResponse) int {
	n := 0
	for _, c := range resp.GetCompletions() {
		n += len(c.GetTokenIds())
	}
	return n
}
