package engine

import (
	"context"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
)

// CacheEventStream is one SubscribeCacheEvents call: the server's prefix-cache events, for a router that sends
// each request to the server that already caches its prefix. Read it with Recv; Close it (or cancel its
// context) when done. Not safe for concurrent use, except Close.
//
// The stream starts with a snapshot (responses with Snapshot set; part 0 begins with a cleared event), then one
// response per engine step that changed the cache, numbered without gaps, each with the server's Load, and
// heartbeats (Heartbeat set; the cursor stays) while nothing changes. Keep the SequenceNumber of the last
// response applied and the InstanceId; after an error (ABORTED: the subscriber fell behind; UNAVAILABLE),
// resubscribe with ResumeAfter(cursor, instanceID): the server replays what was missed, or sends a snapshot.
type CacheEventStream struct {
	stream grpc.ServerStreamingClient[enginev1.SubscribeCacheEventsResponse]
	cancel context.CancelFunc
}

// CacheEventsOption adjusts a SubscribeCacheEventsRequest.
type CacheEventsOption func(*enginev1.SubscribeCacheEventsRequest)

// ResumeAfter resumes a subscription after the last batch applied (cursor) of engine instance instanceID.
func ResumeAfter(cursor uint64, instanceID string) CacheEventsOption {
	return func(r *enginev1.SubscribeCacheEventsRequest) {
		r.StartSequenceNumber = cursor + 1
		r.InstanceId = instanceID
	}
}

// SubscribeCacheEvents opens the stream. Status errors (INVALID_ARGUMENT for a number from the future,
// RESOURCE_EXHAUSTED past the server's limit of streams) arrive from the first Recv.
func (c *Client) SubscribeCacheEvents(
	ctx context.Context, opts ...CacheEventsOption,
) (*CacheEventStream, error) {
	req := &enginev1.SubscribeCacheEventsRequest{}
	for _, opt := range opts {
		opt(req)
	}
	ctx, cancel := context.WithCancel(ctx)
	stream, err := c.rpc.SubscribeCacheEvents(ctx, req)
	if err != nil {
		cancel()
		return nil, err
	}
	return &CacheEventStream{stream: stream, cancel: cancel}, nil
}

// Recv returns the next response, or the error that ended the stream.
func (s *CacheEventStream) Recv() (*enginev1.SubscribeCacheEventsResponse, error) {
	resp, err := s.stream.Recv()
	if err != nil {
		s.cancel()
	}
	return resp, err
}

// Close cancels the call (idempotent).
func (s *CacheEventStream) Close() { s.cancel() }

// StoredBlockTokens splits a stored event's concatenated token ids into its blocks' (block_size each).
func StoredBlockTokens(stored *enginev1.CacheBlocksStored) [][]uint32 {
	size := int(stored.GetBlockSize())
	tokens := stored.GetTokenIds()
	blocks := make([][]uint32, 0, len(stored.GetBlockHashes()))
	for i := range stored.GetBlockHashes() {
		if size <= 0 || (i+1)*size > len(tokens) {
			break
		}
		blocks = append(blocks, tokens[i*size:(i+1)*size])
	}
	return blocks
}
