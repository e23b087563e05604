package engine_test

import (
	"context"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// testContext bounds every unit test's network waits.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestRecvEndsWithEOF(t *testing.T) {
	client, _ := startFake(t)
	ctx := testContext(t)
	stream, err := client.Generate(ctx, engine.TokenPrompt([]uint32{1, 2}, engine.MaxTokens(3)))
	if err != nil {
		t.Fatal(err)
	}
	var tokens []uint32
	var last *enginev1.GenerateResponse
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		last = resp
		for _, c := range resp.GetCompletions() {
			tokens = append(tokens, c.GetTokenIds()...)
		}
	}
	if want := []uint32{0, 1, 2}; !slices.Equal(tokens, want) {
		t.Errorf("tokens = %v, want %v", tokens, want)
	}
	if got := last.GetCompletions()[0].GetFinishReason(); got != enginev1.FinishReason_FINISH_REASON_LENGTH {
		t.Errorf("finish reason = %v", got)
	}
	if stream.RequestID() != "fake-1" {
		t.Errorf("RequestID = %q, want the server's", stream.RequestID())
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Errorf("Recv after the end = %v, want io.EOF again", err)
	}
}

func TestCompleteAccumulatesEveryIndex(t *testing.T) {
	client, _ := startFake(t)
	got, err := client.Complete(testContext(t), engine.TextPrompt("hi", engine.N(2), engine.MaxTokens(2)))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Choices) != 2 {
		t.Fatalf("%d choices, want 2", len(got.Choices))
	}
	if !slices.Equal(got.Choices[1].TokenIDs, []uint32{1000, 1001}) || got.Choices[1].Text != "t1000 t1001 " {
		t.Errorf("choice 1 = %+v", got.Choices[1])
	}
	if got.Text() != "t0 t1 " || got.Choices[0].StopTokenID != nil {
		t.Errorf("choice 0 = %+v", got.Choices[0])
	}
	if got.Choices[1].StopTokenID == nil || *got.Choices[1].StopTokenID != 7 {
		t.Errorf("choice 1 stop token = %v, want 7", got.Choices[1].StopTokenID)
	}
	if got.Usage.GetCompletionTokens() != 4 || got.RequestID != "fake-1" {
		t.Errorf("usage %v, request id %q", got.Usage, got.RequestID)
	}
}

func TestStatusCodesSurvive(t *testing.T) {
	client, _ := startFake(t)
	ctx := testContext(t)
	_, err := client.Complete(ctx, &enginev1.GenerateRequest{})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("Complete error = %v, want INVALID_ARGUMENT", err)
	}
	stream, err := client.Generate(ctx, &enginev1.GenerateRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range stream.All() {
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("All yielded %v, want INVALID_ARGUMENT", err)
		}
	}
	if _, err := client.Generate(ctx, nil); status.Code(err) != codes.InvalidArgument {
		t.Errorf("nil request: %v", err)
	}
}

func TestAbortEndsStreamWithAbort(t *testing.T) {
	client, fake := startFake(t)
	ctx := testContext(t)
	stream, err := client.Generate(ctx, engine.TextPrompt("hi", engine.RequestID("slow-abort"), engine.MaxTokens(5)))
	if err != nil {
		t.Fatal(err)
	}
	waitStarted(ctx, t, fake)
	ids, err := client.Abort(ctx, "slow-abort", "unknown")
	if err != nil || !slices.Equal(ids, []string{"slow-abort"}) {
		t.Fatalf("Abort = %v, %v", ids, err)
	}
	var reasons []enginev1.FinishReason
	for resp, err := range stream.All() {
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range resp.GetCompletions() {
			reasons = append(reasons, c.GetFinishReason())
		}
	}
	if !slices.Equal(reasons, []enginev1.FinishReason{enginev1.FinishReason_FINISH_REASON_ABORT}) {
		t.Errorf("finish reasons = %v", reasons)
	}
}

func TestCancelReachesServer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reqID string
		stop  func(context.CancelFunc, *engine.GenerateStream)
	}{
		{"context", "slow-ctx", func(cancel context.CancelFunc, _ *engine.GenerateStream) { cancel() }},
		{"close", "slow-close", func(_ context.CancelFunc, s *engine.GenerateStream) { s.Close() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, fake := startFake(t)
			ctx, cancel := context.WithCancel(testContext(t))
			defer cancel()
			stream, err := client.Generate(ctx, engine.TextPrompt("hi", engine.RequestID(tc.reqID), engine.MaxTokens(5)))
			if err != nil {
				t.Fatal(err)
			}
			waitStarted(ctx, t, fake)
			tc.stop(cancel, stream)
			if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
				t.Errorf("Recv after cancel = %v, want CANCELED", err)
			}
			select {
			case id := <-fake.cancelled:
				if id != tc.reqID {
					t.Errorf("server saw %q cancelled", id)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the server never saw the cancellation")
			}
		})
	}
}

func TestNoBufferedMessageAfterTheContextIsDone(t *testing.T) {
	client, _ := startFake(t)
	for _, want := range []codes.Code{codes.Canceled, codes.DeadlineExceeded} {
		ctx, cancel := context.WithTimeout(testContext(t), time.Hour)
		if want == codes.DeadlineExceeded {
			ctx, cancel = context.WithTimeout(testContext(t), 300*time.Millisecond)
		}
		stream, err := client.Generate(ctx, engine.TextPrompt("hi", engine.MaxTokens(50)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // NOTE: the other 49 messages arrive and wait in gRPC's buffer
		if want == codes.Canceled {
			cancel()
		} else {
			<-ctx.Done()
		}
		if _, err := stream.Recv(); status.Code(err) != want {
			t.Errorf("Recv after the context is done = %v, want %v", err, want)
		}
		cancel()
	}
}

func TestBreakingOutOfAllClosesTheCall(t *testing.T) {
	client, _ := startFake(t)
	stream, err := client.Generate(testContext(t), engine.TextPrompt("hi", engine.MaxTokens(50)))
	if err != nil {
		t.Fatal(err)
	}
	for range stream.All() {
		break
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
		t.Errorf("Recv after break = %v, want CANCELED", err)
	}
}

func TestAPIKeyIsSentAsBearer(t *testing.T) {
	client, fake := startFake(t, engine.WithAPIKey("s3cret"), engine.WithInsecureAPIKey())
	if _, err := client.Load(testContext(t)); err != nil {
		t.Fatal(err)
	}
	if got := fake.authHeaders(); !slices.Equal(got, []string{"Bearer s3cret"}) {
		t.Errorf("authorization = %q", got)
	}
}

func TestAPIKeyNeedsTLSUnlessAllowed(t *testing.T) {
	_, err := engine.Dial(context.Background(), "127.0.0.1:1", engine.WithAPIKey("k"))
	if err == nil {
		t.Fatal("Dial sent an API key over plaintext without WithInsecureAPIKey")
	}
}

func TestDefaultTimeoutBoundsUnaryCalls(t *testing.T) {
	client, _ := startFake(t, engine.WithDefaultTimeout(50*time.Millisecond))
	// NOTE: a context without a deadline (the default applies only then), cancelled late as a safety net.
	ctx, cancel := context.WithCancel(context.Background())
	defer time.AfterFunc(10*time.Second, cancel).Stop()
	_, err := client.TokenizeText(ctx, "block")
	if status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("err = %v, want DEADLINE_EXCEEDED", err)
	}
	ids, err := client.TokenizeText(testContext(t), "abc")
	if err != nil || !slices.Equal(ids, []uint32{3}) {
		t.Errorf("TokenizeText = %v, %v", ids, err)
	}
}

func TestHealth(t *testing.T) {
	client, _ := startFake(t)
	got, err := client.Health(testContext(t), engine.HealthServiceName)
	if err != nil || got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("Health = %v, %v", got, err)
	}
	if _, err := client.Health(testContext(t), "no.such.Service"); status.Code(err) != codes.NotFound {
		t.Errorf("unknown service: %v, want NOT_FOUND", err)
	}
}

func TestBlockingDialReportsUnreachableServer(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	target := listener.Addr().String()
	_ = listener.Close() // NOTE: nothing listens on target now, so the connection cannot become ready
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = engine.Dial(ctx, target, engine.WithBlock())
	if status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("Dial = %v, want DEADLINE_EXCEEDED", err)
	}
}

func TestTLSOptionErrors(t *testing.T) {
	ctx := context.Background()
	if _, err := engine.Dial(ctx, "127.0.0.1:1", engine.WithCACertFile("/no/such/ca.pem")); err == nil {
		t.Error("missing CA file accepted")
	}
	if _, err := engine.Dial(ctx, "127.0.0.1:1", engine.WithClientCertFiles("/no/cert.pem", "")); err == nil {
		t.Error("client certificate without key accepted")
	}
}

func TestAccumulatorRejectsIndexOutsideN(t *testing.T) {
	acc := engine.NewAccumulator(engine.TextPrompt("x"))
	err := acc.Add(&enginev1.GenerateResponse{Completions: []*enginev1.CompletionChunk{{Index: 1}}})
	if err == nil {
		t.Error("index 1 accepted for n=1")
	}
	acc = engine.NewAccumulator(engine.TextPrompt("x", engine.N(20)))
	if err := acc.Add(&enginev1.GenerateResponse{Completions: []*enginev1.CompletionChunk{{Index: 19}}}); err != nil {
		t.Errorf("index 19 of 20: %v", err)
	}
	if got := len(acc.Completion().Choices); got != 20 {
		t.Errorf("%d choices, want 20", got)
	}
}

func TestRequestBuilders(t *testing.T) {
	req := engine.ChatPrompt(
		[]*enginev1.ChatMessage{engine.Message("user", "hi")},
		engine.RequestID("r1"), engine.Greedy(), engine.TopK(5), engine.Seed(9), engine.N(3), engine.MaxTokens(7),
		engine.StopStrings("a"), engine.StopStrings("b"), engine.StopTokenIDs(4), engine.IgnoreEOS(),
		engine.Logprobs(2), engine.Stream(false),
	)
	switch {
	case req.GetChat().GetMessages()[0].GetContent() != "hi", req.GetRequestId() != "r1", req.GetStream():
		t.Errorf("input/id/stream wrong: %v", req)
	case req.GetSampling().Temperature == nil || req.GetSampling().GetTemperature() != 0:
		t.Errorf("temperature not set to 0: %v", req.GetSampling())
	case req.GetSampling().GetTopK() != 5, req.GetSampling().GetSeed() != 9, req.GetSampling().GetN() != 3:
		t.Errorf("sampling = %v", req.GetSampling())
	case req.GetStopping().GetMaxTokens() != 7, !slices.Equal(req.GetStopping().GetStop(), []string{"a", "b"}):
		t.Errorf("stopping = %v", req.GetStopping())
	case !req.GetStopping().GetIgnoreEos(), req.GetOutput().GetLogprobs() != 2:
		t.Errorf("stopping/output = %v %v", req.GetStopping(), req.GetOutput())
	case req.GetSampling().TopP != nil || req.GetOutput().ReturnText != nil:
		t.Error("options set fields they do not own")
	}
	if !engine.TextPrompt("x").GetStream() {
		t.Error("builders should stream by default")
	}
}

func TestMessageSizeLimits(t *testing.T) {
	client, _ := startFake(t, engine.WithMaxRecvMsgSize(8), engine.WithKeepalive(time.Minute, 10*time.Second, false))
	_, err := client.Complete(testContext(t), engine.TextPrompt("hi", engine.MaxTokens(2)))
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("response over the receive limit: %v, want RESOURCE_EXHAUSTED", err)
	}
	client, _ = startFake(t, engine.WithMaxSendMsgSize(64))
	_, err = client.Complete(testContext(t), engine.TokenPrompt(make([]uint32, 100), engine.MaxTokens(1)))
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("request over the send limit: %v, want RESOURCE_EXHAUSTED", err)
	}
	if _, err := client.Complete(testContext(t), engine.TokenPrompt([]uint32{1}, engine.MaxTokens(1))); err != nil {
		t.Errorf("small request: %v", err)
	}
}

// TestVersionsAgree guards the release rule of docs/versioning.md: the SDK requires the generated module at
// its own version.
func TestVersionsAgree(t *testing.T) {
	goMod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	want := "github.com/engine-project/engine/gen/go v" + engine.Version + "\n"
	if !strings.Contains(string(goMod), want) {
		t.Errorf("go.mod does not require %q", strings.TrimSpace(want))
	}
}

// waitStarted returns once the fake has registered a request (so it can be aborted or cancelled).
func waitStarted(ctx context.Context, t *testing.T, fake *fakeEngine) {
	t.Helper()
	select {
	case <-fake.started:
	case <-ctx.Done():
		t.Fatal("the request never reached the server")
	}
}
