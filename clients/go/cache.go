package engine

import (
	"context"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
)

// CacheSalt puts the request's prefix-cache blocks in the salt's namespace: requests with different salts never
// share cached KV, so one tenant cannot learn from its time to first token whether another sent the same
// prompt. Use a secret salt per tenant; "" is the shared namespace (the default). At most 256 characters.
func CacheSalt(salt string) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.CacheSalt = salt }
}

// Priority sets the request's scheduling priority: a lower value is served first, requests of equal priority
// first come, first served (default 0). It never changes the generated tokens.
func Priority(priority int32) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.Priority = priority }
}

// FlushCache empties the server's prefix cache without disturbing running requests and returns how many cached
// blocks it dropped. The server applies it between two engine steps; a context deadline that passes first
// gives DEADLINE_EXCEEDED (the flush may still happen; repeating it is safe).
func (c *Client) FlushCache(ctx context.Context, opts ...grpc.CallOption) (uint32, error) {
	resp, err := c.rpc.FlushCache(ctx, &enginev1.FlushCacheRequest{}, opts...)
	if err != nil {
		return 0, err
	}
	return resp.GetNumBlocksFlushed(), nil
}
