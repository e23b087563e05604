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

type pyChoice struct {
	TokenIDs     []uint32 `json:"token_ids"`
	Text         string   `json:"text"`
	FinishReason int32    `json:"finish_reason"`
}

// referenceCompletion runs req through the Python reference against srv.
func referenceCompletion(
	ctx context.Context, t *testing.T, srv *testserver.Server, req *enginev1.GenerateRequest,
) []pyChoice {
	t.Helper()
	python, err := testserver.Python()
	if err != nil {
		t.Fatal(err)
	}
	data, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, python, "-c", pythonGenerate, "127.0.0.1", strconv.Itoa(srv.Port), mainAPIKey)
	cmd.Stdin = bytes.NewReader(data)
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
