package engine_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// streamAll reads a Generate stream to its end, checking the stream's invariants on the way: every message
// carries the request id, an index finishes exactly once and gets no tokens afterwards, and usage comes in
// the last message only.
func streamAll(t *testing.T, stream *engine.GenerateStream, req *enginev1.GenerateRequest) *engine.Completion {
	t.Helper()
	acc := engine.NewAccumulator(req)
	finished := map[uint32]bool{}
	var numMessages int
	var sawUsage bool
	for resp, err := range stream.All() {
		if err != nil {
			t.Fatalf("stream: %v", err)
		}
		numMessages++
		if sawUsage {
			t.Errorf("a message after the one with usage: %v", resp)
		}
		sawUsage = resp.GetUsage() != nil
		if resp.GetRequestId() == "" {
			t.Errorf("message without request id: %v", resp)
		}
		for _, c := range resp.GetCompletions() {
			if finished[c.GetIndex()] {
				t.Errorf("index %d continued after its finish: %v", c.GetIndex(), c)
			}
			finished[c.GetIndex()] = c.GetFinishReason() != enginev1.FinishReason_FINISH_REASON_UNSPECIFIED
		}
		if err := acc.Add(resp); err != nil {
			t.Fatal(err)
		}
	}
	if !sawUsage {
		t.Error("no message carried usage")
	}
	if req.GetStream() && numMessages < 2 {
		t.Errorf("a streaming request got %d message(s)", numMessages)
	}
	return acc.Completion()
}

func TestGreedyStreamEqualsPythonReference(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	srv := mainServer(t)
	const prompt, maxTokens = "The quick brown fox", 24
	req := engine.TextPrompt(prompt, engine.Greedy(), engine.MaxTokens(maxTokens), engine.IgnoreEOS())
	stream, err := client.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	got := streamAll(t, stream, req)
	want := referenceCompletion(ctx, t, srv, req)
	if len(got.Choices) != 1 || len(want) != 1 {
		t.Fatalf("choices: go %d, python %d", len(got.Choices), len(want))
	}
	if len(got.Choices[0].TokenIDs) != maxTokens {
		t.Errorf("%d tokens, want max_tokens=%d", len(got.Choices[0].TokenIDs), maxTokens)
	}
	if !slices.Equal(got.Choices[0].TokenIDs, want[0].TokenIDs) || got.Text() != want[0].Text {
		t.Errorf("go and python differ:\n go %v %q\n py %v %q", got.Choices[0].TokenIDs, got.Text(),
			want[0].TokenIDs, want[0].Text)
	}
	// The Python SDK's stream of the same request (built from the same knobs by its own code) agrees too.
	sdk := pythonClientCompletion(ctx, t, srv, prompt, maxTokens)
	if !slices.Equal(got.Choices[0].TokenIDs, sdk[0].TokenIDs) || got.Text() != sdk[0].Text ||
		int32(got.Choices[0].FinishReason) != sdk[0].FinishReason {
		t.Errorf("go and the Python SDK differ:\n go %v %q\n py %v %q", got.Choices[0].TokenIDs, got.Text(),
			sdk[0].TokenIDs, sdk[0].Text)
	}
	if got.Choices[0].FinishReason != enginev1.FinishReason_FINISH_REASON_LENGTH ||
		int32(got.Choices[0].FinishReason) != want[0].FinishReason {
		t.Errorf("finish reason: go %v, python %v", got.Choices[0].FinishReason, want[0].FinishReason)
	}
	if got.Usage.GetCompletionTokens() != maxTokens || got.Usage.GetPromptTokens() == 0 {
		t.Errorf("usage = %v", got.Usage)
	}

	// The server's own non-streaming result of the same request is the same completion, in one message.
	req.Stream = false
	whole, err := client.Complete(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(whole.Choices[0].TokenIDs, got.Choices[0].TokenIDs) || whole.Text() != got.Text() {
		t.Errorf("non-streaming result differs: %v %q", whole.Choices[0].TokenIDs, whole.Text())
	}
}

func TestTextPromptEqualsItsTokens(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	const text = "Hello world, how are you?"
	ids, err := client.TokenizeText(ctx, text)
	if err != nil {
		t.Fatal(err)
	}
	detok, err := client.Detokenize(ctx, &enginev1.DetokenizeRequest{TokenIds: ids})
	if err != nil {
		t.Fatal(err)
	}
	if detok.GetText() != text {
		t.Errorf("round trip: %q -> %v -> %q", text, ids, detok.GetText())
	}
	fromText, err := client.Complete(ctx, engine.TextPrompt(text, engine.Greedy(), engine.MaxTokens(8)))
	if err != nil {
		t.Fatal(err)
	}
	fromIDs, err := client.Complete(ctx, engine.TokenPrompt(ids, engine.Greedy(), engine.MaxTokens(8)))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(fromText.Choices[0].TokenIDs, fromIDs.Choices[0].TokenIDs) {
		t.Errorf("text prompt %v, token prompt %v", fromText.Choices[0].TokenIDs, fromIDs.Choices[0].TokenIDs)
	}
	if fromIDs.Usage.GetPromptTokens() != uint32(len(ids)) {
		t.Errorf("prompt tokens %d, want %d", fromIDs.Usage.GetPromptTokens(), len(ids))
	}
}

func TestSeveralCompletionsEqualPythonReference(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	req := engine.TextPrompt("Once upon a time", engine.N(3), engine.Temperature(1), engine.Seed(1234),
		engine.MaxTokens(12), engine.IgnoreEOS())
	stream, err := client.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	got := streamAll(t, stream, req)
	if len(got.Choices) != 3 {
		t.Fatalf("%d choices, want 3", len(got.Choices))
	}
	var total uint32
	for i, c := range got.Choices {
		if c.Index != uint32(i) || len(c.TokenIDs) != 12 || c.FinishReason != enginev1.FinishReason_FINISH_REASON_LENGTH {
			t.Errorf("choice %d: index %d, %d tokens, %v", i, c.Index, len(c.TokenIDs), c.FinishReason)
		}
		total += uint32(len(c.TokenIDs))
	}
	if got.Usage.GetCompletionTokens() != total {
		t.Errorf("usage counts %d completion tokens, the choices %d", got.Usage.GetCompletionTokens(), total)
	}
	if slices.Equal(got.Choices[0].TokenIDs, got.Choices[1].TokenIDs) &&
		slices.Equal(got.Choices[1].TokenIDs, got.Choices[2].TokenIDs) {
		t.Errorf("three sampled completions are identical: %v", got.Choices[0].TokenIDs)
	}
	// A seeded request gives the same tokens whatever else the server runs, so Python must see them too.
	want := referenceCompletion(ctx, t, mainServer(t), req)
	for i := range want {
		if i >= len(got.Choices) || !slices.Equal(got.Choices[i].TokenIDs, want[i].TokenIDs) {
			t.Errorf("choice %d: python %v, go %v", i, want[i].TokenIDs, got.Choices)
		}
	}
}

// longRequest generates until aborted (no EOS, up to the context length).
func longRequest(requestID string) *enginev1.GenerateRequest {
	return engine.TextPrompt("Tell me a long story", engine.RequestID(requestID), engine.Greedy(),
		engine.IgnoreEOS())
}

func TestAbortByIDFromAnotherGoroutine(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	requestID := fmt.Sprintf("go-abort-%d", time.Now().UnixNano())
	stream, err := client.Generate(ctx, longRequest(requestID))
	if err != nil {
		t.Fatal(err)
	}
	// 1) the first tokens prove the request runs; 2) another goroutine aborts it by id; 3) the stream ends
	// cleanly (io.EOF, status OK) with finish reason ABORT.
	first, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if first.GetRequestId() != requestID {
		t.Errorf("request id %q, want %q", first.GetRequestId(), requestID)
	}
	aborted := make(chan []string, 1)
	abortErr := make(chan error, 1)
	go func() {
		ids, err := client.Abort(ctx, requestID, "go-no-such-request")
		aborted <- ids
		abortErr <- err
	}()
	var reason enginev1.FinishReason
	var numTokens int
	for resp, err := range stream.All() {
		if err != nil {
			t.Fatalf("stream after abort: %v (want a clean end)", err)
		}
		for _, c := range resp.GetCompletions() {
			numTokens += len(c.GetTokenIds())
			if c.GetFinishReason() != enginev1.FinishReason_FINISH_REASON_UNSPECIFIED {
				reason = c.GetFinishReason()
			}
		}
	}
	if err := <-abortErr; err != nil {
		t.Fatalf("Abort: %v", err)
	}
	if ids := <-aborted; !slices.Equal(ids, []string{requestID}) {
		t.Errorf("Abort returned %v, want only %q", ids, requestID)
	}
	if reason != enginev1.FinishReason_FINISH_REASON_ABORT {
		t.Errorf("finish reason %v after %d tokens, want ABORT", reason, numTokens)
	}
	// Abort is idempotent: the finished id is now unknown.
	if ids, err := client.Abort(ctx, requestID); err != nil || len(ids) != 0 {
		t.Errorf("second Abort = %v, %v", ids, err)
	}
}

// waitIdle polls GetLoad (bounded) until the server runs and queues nothing.
func waitIdle(ctx context.Context, t *testing.T, client *engine.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		load, err := client.Load(ctx)
		if err == nil && load.GetLoad().GetNumRunningRequests() == 0 && load.GetLoad().GetNumWaitingRequests() == 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("server still busy after cancellation: %v (err %v)", load, err)
		case <-tick.C:
		}
	}
}

func TestCancellationAbortsOnServer(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	waitIdle(ctx, t, client) // NOTE: a clean start, so the counts below belong to this test
	for _, tc := range []struct {
		name string
		stop func(context.CancelFunc, *engine.GenerateStream)
	}{
		{"cancel context", func(cancel context.CancelFunc, _ *engine.GenerateStream) { cancel() }},
		{"close stream", func(_ context.CancelFunc, s *engine.GenerateStream) { s.Close() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			callCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			stream, err := client.Generate(callCtx, longRequest(fmt.Sprintf("go-cancel-%d", time.Now().UnixNano())))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := stream.Recv(); err != nil {
				t.Fatal(err)
			}
			load, err := client.Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if load.GetLoad().GetNumRunningRequests() != 1 {
				t.Fatalf("running requests while streaming = %d, want 1", load.GetLoad().GetNumRunningRequests())
			}
			tc.stop(cancel, stream)
			if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
				t.Errorf("Recv after cancel = %v, want CANCELED", err)
			}
			waitIdle(ctx, t, client)
		})
	}
}

func TestInvalidArgument(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	info, err := client.ModelInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		req   *enginev1.GenerateRequest
		field string
	}{
		{"negative temperature", engine.TextPrompt("hi", engine.Temperature(-1)), "temperature"},
		{"token outside vocabulary", engine.TokenPrompt([]uint32{info.GetVocabSize()}), ""},
		{"no prompt", &enginev1.GenerateRequest{}, ""},
		{"too many completions", engine.TextPrompt("hi", engine.N(17)), "n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := client.Complete(ctx, tc.req)
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("err = %v, want INVALID_ARGUMENT", err)
			}
			if !strings.Contains(status.Convert(err).Message(), tc.field) {
				t.Errorf("message %q does not name %q", status.Convert(err).Message(), tc.field)
			}
		})
	}
}

func TestInfoLoadAndHealth(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	info, err := client.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.GetApiVersion() != engine.APIVersion || info.GetState() != enginev1.EngineState_ENGINE_STATE_SERVING {
		t.Errorf("server info = %v", info)
	}
	// SDKs and server are released together (docs/versioning.md): the same MAJOR.MINOR is the same contract.
	if majorMinor(info.GetServerVersion()) != majorMinor(engine.Version) {
		t.Errorf("server %s, SDK %s: released together, they share MAJOR.MINOR", info.GetServerVersion(),
			engine.Version)
	}
	model, err := client.ModelInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if model.GetTask() != enginev1.ModelTask_MODEL_TASK_GENERATE || model.GetVocabSize() == 0 {
		t.Errorf("model info = %v", model)
	}
	// Health needs no API key (load balancers probe it), and answers for both names.
	anonymous := dial(t, mainServer(t).Target)
	for _, service := range []string{"", engine.HealthServiceName} {
		got, err := anonymous.Health(ctx, service)
		if err != nil || got.String() != "SERVING" {
			t.Errorf("Health(%q) = %v, %v", service, got, err)
		}
	}
}

func TestAPIKeyOnPlaintextLoopback(t *testing.T) {
	target := mainServer(t).Target
	ctx := integrationContext(t)
	if _, err := dial(t, target).ModelInfo(ctx); status.Code(err) != codes.Unauthenticated {
		t.Errorf("without a key: %v, want UNAUTHENTICATED", err)
	}
	wrong := dial(t, target, engine.WithAPIKey("wrong"), engine.WithInsecureAPIKey())
	if _, err := wrong.Complete(ctx, engine.TextPrompt("hi", engine.MaxTokens(2))); status.Code(err) != codes.Unauthenticated {
		t.Errorf("wrong key: %v, want UNAUTHENTICATED", err)
	}
	if _, err := dialMain(t).ModelInfo(ctx); err != nil {
		t.Errorf("right key: %v", err)
	}
}

func majorMinor(version string) string {
	parts := strings.SplitN(version, ".", 3)
	return strings.Join(parts[:min(2, len(parts))], ".")
}

func TestDeadlineAbortsOnServer(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	waitIdle(ctx, t, client)
	// NOTE: 8 completions to the context length: 2,000+ engine steps of 8 sequences, far beyond the deadline.
	callCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req := longRequest(fmt.Sprintf("go-deadline-%d", time.Now().UnixNano()))
	engine.N(8)(req)
	stream, err := client.Generate(callCtx, req)
	if err != nil {
		t.Fatal(err)
	}
	var numTokens int
	for resp, err := range stream.All() {
		if err != nil {
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("stream ended with %v, want DEADLINE_EXCEEDED", err)
			}
			break
		}
		for _, c := range resp.GetCompletions() {
			numTokens += len(c.GetTokenIds())
			if c.GetFinishReason() != enginev1.FinishReason_FINISH_REASON_UNSPECIFIED {
				t.Fatalf("finished (%v after %d tokens) before the deadline", c.GetFinishReason(), numTokens)
			}
		}
	}
	t.Logf("%d tokens before the deadline", numTokens)
	waitIdle(ctx, t, client)
}
