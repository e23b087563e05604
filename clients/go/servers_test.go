package engine_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	"github.com/engine-project/engine/clients/go/internal/testserver"
)

// The integration tests share two real servers, started together (in the background) by the first test that
// needs one, and stopped by TestMain:
//   - "main": the tiny generation model, plaintext on loopback, with an API key (sent with WithInsecureAPIKey);
//   - "secure": the MiniLM embedding model behind TLS with required client certificates and an API key.
// Unit tests on the in-process fake never wait for them.

const (
	mainAPIKey   = "go-sdk-test-key"
	secureAPIKey = "go-sdk-secure-key"
)

type sharedServer struct {
	ready  chan struct{}
	srv    *testserver.Server
	err    error
	logged sync.Once
}

type environment struct {
	startOnce sync.Once
	started   atomic.Bool
	main      sharedServer
	secure    sharedServer
	certs     *testserver.Certs
	certsDir  string
}

// env is the package's one shared test environment; TestMain stops what it started.
var env = &environment{
	main:   sharedServer{ready: make(chan struct{})},
	secure: sharedServer{ready: make(chan struct{})},
}

func TestMain(m *testing.M) {
	code := m.Run()
	env.stop()
	os.Exit(code)
}

func (e *environment) start() {
	e.startOnce.Do(func() {
		e.started.Store(true)
		ctx := context.Background()
		go func() {
			defer close(e.main.ready)
			e.main.srv, e.main.err = testserver.Start(ctx, "--api-key", mainAPIKey, "--log-level", "warning")
		}()
		go func() {
			defer close(e.secure.ready)
			e.secure.srv, e.secure.err = e.startSecure(ctx)
		}()
	})
}

func (e *environment) startSecure(ctx context.Context) (*testserver.Server, error) {
	modelDir, err := testserver.EmbedModelDir(ctx)
	if err != nil {
		return nil, err
	}
	e.certsDir, err = os.MkdirTemp("", "engine-go-test-certs-")
	if err != nil {
		return nil, err
	}
	if e.certs, err = testserver.WriteCerts(e.certsDir); err != nil {
		return nil, fmt.Errorf("generate certificates: %w", err)
	}
	return testserver.Start(ctx, "--model", modelDir, "--in-process-engine", "--log-level", "warning",
		"--api-key", secureAPIKey,
		"--tls-cert", e.certs.ServerCert, "--tls-key", e.certs.ServerKey, "--tls-client-ca", e.certs.CACert)
}

func (e *environment) stop() {
	if !e.started.Load() {
		return
	}
	var wg sync.WaitGroup
	for _, s := range []*sharedServer{&e.main, &e.secure} {
		<-s.ready
		if s.srv != nil {
			wg.Add(1)
			go func() { defer wg.Done(); s.srv.Stop() }()
		}
	}
	wg.Wait()
	if e.certsDir != "" {
		_ = os.RemoveAll(e.certsDir)
	}
}

func (s *sharedServer) wait(t *testing.T, name string) *testserver.Server {
	t.Helper()
	env.start()
	<-s.ready // bounded: testserver.Start gives up after its ready timeout
	if s.err != nil {
		t.Fatalf("the %s engine-server did not start (the Go SDK tests need a real server; run "+
			"scripts/bootstrap.sh python, or set ENGINE_SERVER_BIN): %v", name, s.err)
	}
	s.logged.Do(func() { t.Logf("the %s server started in %s", name, s.srv.StartupTime.Round(time.Millisecond)) })
	if s.srv.Exited() {
		t.Fatalf("the %s engine-server has exited:\n%s", name, s.srv.LogTail(4000))
	}
	return s.srv
}

// mainServer returns the tiny-model server, starting the servers on first use.
func mainServer(t *testing.T) *testserver.Server { return env.main.wait(t, "main") }

// secureServer returns the TLS + mTLS + API key embedding server, and its certificates.
func secureServer(t *testing.T) (*testserver.Server, *testserver.Certs) {
	return env.secure.wait(t, "secure"), env.certs
}

// dialMain dials the main server with its API key over loopback plaintext.
func dialMain(t *testing.T, opts ...engine.Option) *engine.Client {
	t.Helper()
	srv := mainServer(t)
	opts = append([]engine.Option{engine.WithAPIKey(mainAPIKey), engine.WithInsecureAPIKey()}, opts...)
	return dial(t, srv.Target, opts...)
}

func dial(t *testing.T, target string, opts ...engine.Option) *engine.Client {
	t.Helper()
	client, err := engine.Dial(context.Background(), target, opts...)
	if err != nil {
		t.Fatalf("Dial %s: %v", target, err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// integrationContext bounds one integration test's calls; make it after the server is up.
func integrationContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}
