package engine_test

import (
	"slices"
	"testing"

	engine "github.com/engine-project/engine/clients/go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestSubscribeCacheEventsSeesACompletionsBlocks(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	events, err := client.SubscribeCacheEvents(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer events.Close()
	first, err := events.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if first.GetSnapshot() == nil || first.GetSnapshot().GetIndex() != 0 {
		t.Fatalf("the stream does not start with a snapshot: %v", first)
	}
	last := first
	for last.GetSnapshot().GetIndex()+1 < last.GetSnapshot().GetCount() {
		if last, err = events.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	prompt := cacheTestPrompt(4747)
	if _, err := client.Complete(ctx, engine.TokenPrompt(prompt, engine.MaxTokens(2), engine.Greedy(),
		engine.CacheSalt("go-events"), engine.Stream(false))); err != nil {
		t.Fatal(err)
	}
	want := [][]uint32{prompt[:16], prompt[16:32]}
	found := 0
	cursor := last.GetSequenceNumber()
	for found < len(want) {
		resp, err := events.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetHeartbeat() {
			continue
		}
		if resp.GetSequenceNumber() != cursor+1 {
			t.Fatalf("batch %d after %d", resp.GetSequenceNumber(), cursor)
		}
		cursor = resp.GetSequenceNumber()
		if resp.GetLoad() == nil {
			t.Fatal("a batch without its Load")
		}
		for _, event := range resp.GetEvents() {
			stored := event.GetStored()
			if stored == nil || stored.GetCacheSalt() != "go-events" {
				continue
			}
			for _, block := range engine.StoredBlockTokens(stored) {
				for _, w := range want {
					if slices.Equal(block, w) {
						found++
					}
				}
			}
		}
	}
	// a number from the future is INVALID_ARGUMENT
	future, err := client.SubscribeCacheEvents(ctx, engine.ResumeAfter(cursor+1000, first.GetInstanceId()))
	if err != nil {
		t.Fatal(err)
	}
	defer future.Close()
	if _, err := future.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a cursor from the future: %v, want INVALID_ARGUMENT", err)
	}
}
