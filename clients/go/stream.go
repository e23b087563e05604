package engine

import (
	"context"
	"io"
	"iter"
	"sync"
	"sync/atomic"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// GenerateStream is one Generate call in flight. Read it with Recv until io.EOF, or range over All. Read it to
// the end or Close it: an abandoned stream holds its RPC (and the server's request) until ctx is done.
// A GenerateStream is not safe for concurrent use, except Close, which may be called from any goroutine.
type GenerateStream struct {
	stream    grpc.ServerStreamingClient[enginev1.GenerateResponse]
	callerCtx context.Context // the ctx Generate was given: done once the caller cancels or its deadline passes
	cancel    context.CancelFunc
	requestID string
	err       error // sticky: io.EOF after the end, or the error that ended the stream
	closeOnce sync.Once
	closed    atomic.Bool
}

// Generate starts a Generate call. Status errors the server sends about the request (INVALID_ARGUMENT, ...)
// arrive from the first Recv. Cancelling ctx, or Close, cancels the call and the server aborts the request.
func (c *Client) Generate(
	ctx context.Context, req *enginev1.GenerateRequest, opts ...grpc.CallOption,
) (*GenerateStream, error) {
	if req == nil {
		return nil, status.Error(codes.InvalidArgument, "engine: nil GenerateRequest")
	}
	// NOTE: a child context, so that Close and the end of the stream release the call even when the caller's
	// context lives on.
	callerCtx := ctx
	ctx, cancel := context.WithCancel(ctx)
	stream, err := c.rpc.Generate(ctx, req, opts...)
	if err != nil {
		cancel()
		return nil, err
	}
	return &GenerateStream{stream: stream, callerCtx: callerCtx, cancel: cancel, requestID: req.GetRequestId()}, nil
}

// Recv returns the next response. It returns io.EOF after the last one (the stream ended with status OK), or
// a gRPC status error (CANCELED or DEADLINE_EXCEEDED once ctx is done, even if responses were still buffered);
// after either it keeps returning the same error.
func (s *GenerateStream) Recv() (*enginev1.GenerateResponse, error) {
	if s.err != nil {
		return nil, s.err
	}
	// NOTE: gRPC may still hand out buffered messages after a cancel; a closed stream, or one whose context is
	// done (cancelled or past its deadline), yields no more.
	if s.closed.Load() {
		s.err = status.Error(codes.Canceled, "engine: generate stream closed")
		return nil, s.err
	}
	// NOTE: the caller's context itself: the call's child context learns of its end a moment later.
	if err := s.callerCtx.Err(); err != nil {
		s.err = status.FromContextError(err).Err()
		s.cancel()
		return nil, s.err
	}
	resp, err := s.stream.Recv()
	if err != nil {
		s.err = err
		s.cancel()
		return nil, err
	}
	if s.requestID == "" {
		s.requestID = resp.GetRequestId()
	}
	return resp, nil
}

// All iterates over the responses; a failed stream yields one (nil, err) pair last. Breaking out of the loop
// closes the stream, which aborts the request on the server.
func (s *GenerateStream) All() iter.Seq2[*enginev1.GenerateResponse, error] {
	return func(yield func(*enginev1.GenerateResponse, error) bool) {
		defer s.Close()
		for {
			resp, err := s.Recv()
			if err == io.EOF {
				return
			}
			if err != nil {
				yield(nil, err)
				return
			}
			if !yield(resp, nil) {
				return
			}
		}
	}
}

// RequestID is the request's id: the one the request set, or the server's once a response arrived.
func (s *GenerateStream) RequestID() string { return s.requestID }

// Close cancels the call if it is still running (the server aborts the request). It is safe to call more
// than once and after the end of the stream.
func (s *GenerateStream) Close() {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		s.cancel()
	})
}
