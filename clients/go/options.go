package engine

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// Option configures Dial.
type Option func(*dialConfig)

// dialConfig collects the options; Dial turns it into grpc.DialOptions. Files named by options are read by
// Dial, which reports their errors, so options stay plain values that compose.
type dialConfig struct {
	tls                 *tls.Config
	caFile              string
	clientCertFile      string
	clientKeyFile       string
	serverName          string
	apiKey              string
	allowInsecureAPIKey bool
	keepalive           *keepalive.ClientParameters
	maxRecvMsgSize      int
	maxSendMsgSize      int
	defaultTimeout      time.Duration
	waitForReady        bool
	userAgent           string
	extra               []grpc.DialOption
}

// WithTLS makes the connection use TLS with the given configuration (nil: the system's roots, no client
// certificate). The other TLS options add to this configuration; the caller's value is not modified.
func WithTLS(cfg *tls.Config) Option {
	return func(c *dialConfig) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		c.tls = cfg.Clone()
	}
}

// WithCACertFile makes the connection use TLS and trust only the CA certificates in the PEM file.
func WithCACertFile(path string) Option {
	return func(c *dialConfig) { c.caFile = path }
}

// WithClientCertFiles makes the connection use TLS and present the PEM certificate and key (mutual TLS).
func WithClientCertFiles(certFile, keyFile string) Option {
	return func(c *dialConfig) { c.clientCertFile, c.clientKeyFile = certFile, keyFile }
}

// WithServerName overrides the name checked against the server's certificate (default: the target's host).
func WithServerName(name string) Option {
	return func(c *dialConfig) { c.serverName = name }
}

// WithAPIKey sends `authorization: Bearer <key>` with every call. The key is only sent over TLS unless
// WithInsecureAPIKey is also given.
func WithAPIKey(key string) Option {
	return func(c *dialConfig) { c.apiKey = key }
}

// WithInsecureAPIKey allows WithAPIKey on a plaintext connection. Use it only where the network cannot be
// observed: loopback tests, or a sidecar on the same host.
func WithInsecureAPIKey() Option {
	return func(c *dialConfig) { c.allowInsecureAPIKey = true }
}

// WithKeepalive pings the server after `interval` without activity and closes the connection when no answer
// arrives within `timeout`. permitWithoutStream also pings while no call is active.
func WithKeepalive(interval, timeout time.Duration, permitWithoutStream bool) Option {
	return func(c *dialConfig) {
		c.keepalive = &keepalive.ClientParameters{
			Time: interval, Timeout: timeout, PermitWithoutStream: permitWithoutStream,
		}
	}
}

// WithMaxRecvMsgSize sets the largest response message the client accepts, in bytes (gRPC's default: 4 MiB).
func WithMaxRecvMsgSize(n int) Option {
	return func(c *dialConfig) { c.maxRecvMsgSize = n }
}

// WithMaxSendMsgSize sets the largest request message the client sends, in bytes.
func WithMaxSendMsgSize(n int) Option {
	return func(c *dialConfig) { c.maxSendMsgSize = n }
}

// WithDefaultTimeout bounds every unary call whose context has no deadline. It does not apply to Generate,
// whose length depends on the request: bound it with the context.
func WithDefaultTimeout(d time.Duration) Option {
	return func(c *dialConfig) { c.defaultTimeout = d }
}

// WithBlock makes Dial wait (bounded by its context) until the connection is ready, so an unreachable
// server is reported by Dial instead of by the first call.
func WithBlock() Option {
	return func(c *dialConfig) { c.waitForReady = true }
}

// WithUserAgent prepends a product token to the client's user agent.
func WithUserAgent(ua string) Option {
	return func(c *dialConfig) { c.userAgent = ua }
}

// WithDialOptions passes raw gRPC dial options through, after the ones this package builds.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *dialConfig) { c.extra = append(c.extra, opts...) }
}

// usesTLS says whether any TLS option was given.
func (c *dialConfig) usesTLS() bool {
	return c.tls != nil || c.caFile != "" || c.clientCertFile != "" || c.clientKeyFile != "" || c.serverName != ""
}

// tlsConfig builds the final TLS configuration from WithTLS and the file options.
func (c *dialConfig) tlsConfig() (*tls.Config, error) {
	cfg := c.tls
	if cfg == nil {
		cfg = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if c.caFile != "" {
		pem, err := os.ReadFile(c.caFile)
		if err != nil {
			return nil, fmt.Errorf("engine: read CA certificate: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("engine: no PEM certificate in %s", c.caFile)
		}
		cfg.RootCAs = pool
	}
	if (c.clientCertFile == "") != (c.clientKeyFile == "") {
		return nil, errors.New("engine: WithClientCertFiles needs both a certificate and a key file")
	}
	if c.clientCertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.clientCertFile, c.clientKeyFile)
		if err != nil {
			return nil, fmt.Errorf("engine: load client certificate: %w", err)
		}
		cfg.Certificates = append(cfg.Certificates, cert)
	}
	if c.serverName != "" {
		cfg.ServerName = c.serverName
	}
	return cfg, nil
}
