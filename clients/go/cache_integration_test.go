package engine_test

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	engine "github.com/engine-project/engine/clients/go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// cachedPromptTokens is what a 40-token prompt can take from the prefix cache: two full 16-token blocks.
const cachedPromptTokens = 32

func cacheTestPrompt(seed uint64) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 1))
	prompt := make([]uint32, 40)
	for i := range prompt {
		prompt[i] = 3 + uint32(rng.IntN(997))
	}
	return prompt
}

func TestCacheSaltPriorityAndFlushCache(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	prompt := cacheTestPrompt(11)
	run := func(opts ...engine.RequestOption) (uint32, []uint32) {
		t.Helper()
		opts = append([]engine.RequestOption{engine.MaxTokens(4), engine.Greedy(), engine.IgnoreEOS(),
			engine.Stream(false)}, opts...)
		got, err := client.Complete(ctx, engine.TokenPrompt(prompt, opts...))
		if err != nil {
			t.Fatal(err)
		}
		return got.Usage.GetCachedPromptTokens(), got.Choices[0].TokenIDs
	}
	first, tokens := run(engine.CacheSalt("go-a"))
	if first != 0 {
		t.Fatalf("first request: %d cached prompt tokens, want 0", first)
	}
	if other, _ := run(engine.CacheSalt("go-b")); other != 0 {
		t.Errorf("another salt: %d cached prompt tokens, want 0", other)
	}
	again, againTokens := run(engine.CacheSalt("go-a"), engine.Priority(math.MinInt32))
	if again != cachedPromptTokens {
		t.Errorf("the same salt: %d cached prompt tokens, want %d", again, cachedPromptTokens)
	}
	if !slices.Equal(tokens, againTokens) {
		t.Errorf("tokens changed with the cache and priority: %v, then %v", tokens, againTokens)
	}
	flushed, err := client.FlushCache(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if flushed < 2 {
		t.Errorf("FlushCache dropped %d blocks, want at least 2", flushed)
	}
	if after, _ := run(engine.CacheSalt("go-a"), engine.Priority(math.MaxInt32)); after != 0 {
		t.Errorf("after FlushCache: %d cached prompt tokens, want 0", after)
	}
	_, err = client.Complete(ctx, engine.TokenPrompt(prompt, engine.MaxTokens(1), engine.CacheSalt(strings.Repeat("s", 257))))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "cache_salt") {
		t.Errorf("a 257-character salt: %v, want INVALID_ARGUMENT naming cache_salt", err)
	}
}
