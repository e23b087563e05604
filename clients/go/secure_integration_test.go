package engine_test

import (
	"math"
	"testing"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// dialSecure dials the TLS server with the test CA, a client certificate and the API key, then extra options.
func dialSecure(t *testing.T, opts ...engine.Option) *engine.Client {
	t.Helper()
	srv, certs := secureServer(t)
	opts = append([]engine.Option{
		engine.WithCACertFile(certs.CACert),
		engine.WithClientCertFiles(certs.ClientCert, certs.ClientKey),
		engine.WithAPIKey(secureAPIKey),
	}, opts...)
	return dial(t, srv.Target, opts...)
}

func TestEmbedOverMutualTLS(t *testing.T) {
	client := dialSecure(t)
	ctx := integrationContext(t)
	info, err := client.ModelInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.GetTask() != enginev1.ModelTask_MODEL_TASK_EMBED || info.GetEmbeddingDimension() == 0 {
		t.Fatalf("model info = %v", info)
	}
	vectors, err := client.EmbedTexts(ctx, "A cat sits on the mat.", "A cat sits on the mat.", "Stock markets fell.")
	if err != nil {
		t.Fatal(err)
	}
	if len(vectors) != 3 {
		t.Fatalf("%d vectors, want 3", len(vectors))
	}
	for i, v := range vectors {
		if len(v) != int(info.GetEmbeddingDimension()) {
			t.Errorf("vector %d has %d values, want %d", i, len(v), info.GetEmbeddingDimension())
		}
		if norm := math.Sqrt(dot(v, v)); math.Abs(norm-1) > 1e-3 {
			t.Errorf("vector %d has norm %f, want 1 (normalized by default)", i, norm)
		}
	}
	if same := dot(vectors[0], vectors[1]); same < 0.9999 {
		t.Errorf("one text embedded twice: cosine %f", same)
	}
	if other := dot(vectors[0], vectors[2]); other > 0.9 {
		t.Errorf("unrelated texts: cosine %f", other)
	}

	raw, err := client.Embed(ctx, &enginev1.EmbedRequest{
		Inputs:    []*enginev1.EmbedInput{{Input: &enginev1.EmbedInput_Text{Text: "A cat sits on the mat."}}},
		Normalize: new(bool),
	})
	if err != nil {
		t.Fatal(err)
	}
	if raw.GetEmbeddings()[0].GetNumTokens() == 0 || raw.GetUsage().GetPromptTokens() == 0 {
		t.Errorf("counts missing: %v", raw)
	}
	if norm := math.Sqrt(dot(raw.GetEmbeddings()[0].GetValues(), raw.GetEmbeddings()[0].GetValues())); math.Abs(norm-1) < 1e-3 {
		t.Errorf("normalize=false still returned a unit vector")
	}

	// The embedding model cannot generate; the code survives TLS and the SDK.
	if _, err := client.Complete(ctx, engine.TextPrompt("hi")); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Generate on an embedding model: %v, want INVALID_ARGUMENT", err)
	}
	if _, err := client.Embed(ctx, &enginev1.EmbedRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("empty batch: %v, want INVALID_ARGUMENT", err)
	}
}

func dot(a, b []float32) float64 {
	var sum float64
	for i := range a {
		sum += float64(a[i]) * float64(b[i])
	}
	return sum
}

func TestTLSAndAPIKeyFailures(t *testing.T) {
	srv, certs := secureServer(t)
	ctx := integrationContext(t)
	for _, tc := range []struct {
		name string
		opts []engine.Option
		want codes.Code
	}{
		{"server name override", []engine.Option{engine.WithServerName("localhost")}, codes.OK},
		{"no API key", nil, codes.Unauthenticated},
		{"wrong API key", []engine.Option{engine.WithAPIKey("wrong")}, codes.Unauthenticated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := []engine.Option{
				engine.WithCACertFile(certs.CACert), engine.WithClientCertFiles(certs.ClientCert, certs.ClientKey),
			}
			if tc.name != "no API key" {
				opts = append(opts, engine.WithAPIKey(secureAPIKey))
			}
			client := dial(t, srv.Target, append(opts, tc.opts...)...)
			if _, err := client.ModelInfo(ctx); status.Code(err) != tc.want {
				t.Errorf("ModelInfo: %v, want %v", err, tc.want)
			}
		})
	}
	// Transport failures: the handshake fails, which gRPC reports as UNAVAILABLE.
	for _, tc := range []struct {
		name string
		opts []engine.Option
	}{
		{"untrusted server", []engine.Option{engine.WithCACertFile(certs.OtherCACert),
			engine.WithClientCertFiles(certs.ClientCert, certs.ClientKey)}},
		{"no client certificate", []engine.Option{engine.WithCACertFile(certs.CACert)}},
		{"client certificate from another CA", []engine.Option{engine.WithCACertFile(certs.CACert),
			engine.WithClientCertFiles(certs.OtherClientCert, certs.OtherClientKey)}},
		{"plaintext to a TLS server", []engine.Option{engine.WithInsecureAPIKey()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := dial(t, srv.Target, append(tc.opts, engine.WithAPIKey(secureAPIKey))...)
			if _, err := client.ModelInfo(ctx); status.Code(err) != codes.Unavailable {
				t.Errorf("ModelInfo: %v, want UNAVAILABLE", err)
			}
		})
	}
	// Health over TLS needs the certificate but no key.
	health := dial(t, srv.Target, engine.WithCACertFile(certs.CACert),
		engine.WithClientCertFiles(certs.ClientCert, certs.ClientKey))
	if got, err := health.Health(ctx, engine.HealthServiceName); err != nil || got.String() != "SERVING" {
		t.Errorf("Health = %v, %v", got, err)
	}
}
