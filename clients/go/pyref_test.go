package engine_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"strconv"
	"testing"

	"github.com/engine-project/engine/clients/go/internal/testserver"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/protobuf/proto"
)

// pythonGenerate is the reference: it sends the very same serialized GenerateRequest through the generated
// Python grpclib stub (engine_proto ... EngineServiceStub, the stack the Python client is built on) and
// accumulates the streamed responses per completion index.
const pythonGenerate = `
import asyncio, json, sys
from grpclib.client import Channel
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub

async def main() -> None:
    host, port, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    request = generate_pb2.GenerateRequest.FromString(sys.stdin.buffer.read())
    channel = Channel(host, port)
    try:
        responses = await EngineServiceStub(channel).Generate(
            request, metadata={"authorization": "Bearer " + key}, timeout=60)
    finally:
        channel.close()
    choices = {}
    for response in responses:
        for chunk in response.completions:
            choice = choices.setdefault(chunk.index, {"token_ids": [], "text": "", "finish_reason": 0})
            choice["token_ids"] += list(chunk.token_ids)
            choice["text"] += chunk.text
            if chunk.finish_reason:
                choice["finish_reason"] = chunk.finish_reason
    print(json.dumps([choices[i] for i in sorted(choices)]))

asyncio.run(main())
`

// pythonClientGreedy streams a greedy text completion through the Python SDK (engine_client.EngineClient),
// the client the issue names as the reference; its knobs are the Go test's, passed as arguments.
const pythonClientGreedy = `
import json, sys
from engine_client import EngineClient

target, key, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
token_ids, text, finish = [], "", 0
with EngineClient(target, api_key=key) as client:
    for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        token_ids += list(chunk.token_ids)
        text += chunk.text
        if chunk.finish_reason is not None:
            # engine.v1 FinishReason numbers, for comparison with the Go enum
            finish = {"stop": 1, "length": 2, "abort": 3}.get(chunk.finish_reason.value, -1)
print(json.dumps([{"token_ids": token_ids, "text": text, "finish_reason": finish}]))
`

type pyChoice struct {
	TokenIDs     []uint32 `json:"token_ids"`
	Text         string   `json:"text"`
	FinishReason int32    `json:"finish_reason"`
}

// referenceCompletion runs req through the generated Python stub against srv.
func referenceCompletion(
	ctx context.Context, t *testing.T, srv *testserver.Server, req *enginev1.GenerateRequest,
) []pyChoice {
	t.Helper()
	data, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return runPython(ctx, t, data, pythonGenerate, "127.0.0.1", strconv.Itoa(srv.Port), mainAPIKey)
}

// pythonClientCompletion streams a greedy, EOS-ignoring text completion through the Python SDK.
func pythonClientCompletion(
	ctx context.Context, t *testing.T, srv *testserver.Server, prompt string, maxTokens uint32,
) []pyChoice {
	t.Helper()
	return runPython(ctx, t, nil, pythonClientGreedy, srv.Target, mainAPIKey, prompt,
		strconv.FormatUint(uint64(maxTokens), 10))
}

func runPython(ctx context.Context, t *testing.T, stdin []byte, script string, args ...string) []pyChoice {
	t.Helper()
	python, err := testserver.Python()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, python, append([]string{"-c", script}, args...)...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python reference: %v\n%s", err, stderr.String())
	}
	var choices []pyChoice
	if err := json.Unmarshal(out, &choices); err != nil {
		t.Fatalf("python reference output %q: %v", out, err)
	}
	return choices
}
