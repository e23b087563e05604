package engine_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	engine "github.com/engine-project/engine/clients/go"
)

// consumerGoMod is the go.mod of a downstream module: it requires the SDK and the generated code by their
// module paths, and points them at this checkout with replace directives (what a user does to try a
// checkout; with published versions the replace lines go away).
const consumerGoMod = `module example.com/engine-consumer

go 1.24.0

require (
	github.com/engine-project/engine/clients/go v%[1]s
	github.com/engine-project/engine/gen/go v%[1]s
)

replace (
	github.com/engine-project/engine/clients/go => %[2]s
	github.com/engine-project/engine/gen/go => %[3]s
)
`

// goCommand runs the go tool in dir, bounded, for a module outside this one.
func goCommand(ctx context.Context, t *testing.T, dir string, args ...string) {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the consumer test needs the go command on PATH: %v", err)
	}
	cmd := exec.CommandContext(ctx, goBin, args...)
	cmd.Dir = dir
	// NOTE: GOWORK=off keeps a workspace file above the temp dir from joining the consumer to other modules.
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS="+strings.TrimSpace(os.Getenv("GOFLAGS")+" -mod=mod"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %v in the consumer module: %v\n%s", args, err, out)
	}
}

func TestDownstreamConsumerBuildsAndRuns(t *testing.T) {
	srv := mainServer(t)
	// NOTE: after the server is up: the bound is for building (a cold build cache compiles gRPC) and running.
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	sdkDir, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	genDir := filepath.Join(sdkDir, "..", "..", "gen", "go")

	// 1) a module of its own in a temp dir: the program, a go.mod requiring the SDK, the SDK's go.sum.
	dir := t.TempDir()
	source, err := os.ReadFile(filepath.Join("internal", "consumertest", "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		"main.go": source,
		"go.mod":  fmt.Appendf(nil, consumerGoMod, engine.Version, sdkDir, genDir),
		"go.sum":  sum,
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// 2) resolve and build it as a user would.
	goCommand(ctx, t, dir, "mod", "tidy")
	goCommand(ctx, t, dir, "build", "-o", "consumer", ".")

	// 3) run it against the server; its greedy completion must be the SDK's own.
	const prompt = "A downstream consumer says"
	cmd := exec.CommandContext(ctx, filepath.Join(dir, "consumer"), "-target", srv.Target, "-api-key", mainAPIKey,
		"-prompt", prompt, "-max-tokens", "8")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("consumer: %v\n%s", err, stderr.String())
	}
	var got struct {
		SDKVersion   string   `json:"sdk_version"`
		Health       string   `json:"health"`
		Model        string   `json:"model"`
		RequestID    string   `json:"request_id"`
		TokenIDs     []uint32 `json:"token_ids"`
		Text         string   `json:"text"`
		FinishReason string   `json:"finish_reason"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("consumer output %q: %v", out, err)
	}
	want, err := dialMain(t).Complete(ctx, engine.TextPrompt(prompt, engine.Greedy(), engine.MaxTokens(8)))
	if err != nil {
		t.Fatal(err)
	}
	if got.SDKVersion != engine.Version || got.Health != "SERVING" || got.Model == "" || got.RequestID == "" {
		t.Errorf("consumer reported %+v", got)
	}
	if !slices.Equal(got.TokenIDs, want.Choices[0].TokenIDs) || got.Text != want.Text() {
		t.Errorf("consumer %v %q, SDK %v %q", got.TokenIDs, got.Text, want.Choices[0].TokenIDs, want.Text())
	}
	if got.FinishReason != want.Choices[0].FinishReason.String() {
		t.Errorf("finish reason: consumer %s, SDK %s", got.FinishReason, want.Choices[0].FinishReason)
	}
}

func TestGenerateExampleRuns(t *testing.T) {
	srv := mainServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	bin := filepath.Join(t.TempDir(), "generate")
	goCommand(ctx, t, ".", "build", "-o", bin, "./examples/generate")
	cmd := exec.CommandContext(ctx, bin, "-target", srv.Target, "-api-key", mainAPIKey, "-insecure-api-key",
		"-prompt", "The quick brown fox", "-max-tokens", "5")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("example: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "finish FINISH_REASON_LENGTH, ") ||
		!strings.Contains(string(out), " + 5 completion tokens]") {
		t.Errorf("example output:\n%s", out)
	}
	// Without -insecure-api-key the example refuses to send the key over plaintext.
	cmd = exec.CommandContext(ctx, bin, "-target", srv.Target, "-api-key", mainAPIKey)
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "plaintext") {
		t.Errorf("example sent the key over plaintext: %v\n%s", err, out)
	}
}
