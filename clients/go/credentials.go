package engine

import (
	"context"
	"time"

	"google.golang.org/grpc"
)

// bearerCredentials sends the API key as gRPC per-RPC credentials, so gRPC itself refuses to send it over a
// plaintext connection unless the caller allowed that explicitly.
type bearerCredentials struct {
	header      string
	requiresTLS bool
}

func newBearerCredentials(key string, requiresTLS bool) bearerCredentials {
	return bearerCredentials{header: "Bearer " + key, requiresTLS: requiresTLS}
}

func (b bearerCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": b.header}, nil
}

func (b bearerCredentials) RequireTransportSecurity() bool { return b.requiresTLS }

// defaultTimeoutInterceptor gives unary calls without a deadline the client's default timeout.
func defaultTimeoutInterceptor(timeout time.Duration) grpc.UnaryClientInterceptor {
	return func(
		ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
	) error {
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, timeout)
			defer cancel()
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}
