package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
)

// Streaming a completion and printing its text as it arrives.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel() // cancelling the context also aborts the request on the server
	client, err := engine.Dial(ctx, "127.0.0.1:50051", engine.WithDefaultTimeout(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	stream, err := client.Generate(ctx, engine.TextPrompt("Once upon a time",
		engine.MaxTokens(64), engine.Temperature(0.7), engine.StopStrings("\n\n")))
	if err != nil {
		log.Fatal(err)
	}
	for resp, err := range stream.All() {
		if err != nil {
			log.Fatal(err) // a gRPC status error: status.Code(err) is the server's code
		}
		for _, chunk := range resp.GetCompletions() {
			fmt.Print(chunk.GetText())
		}
	}
}

// Complete returns the whole result; raw generated requests work as well as the builders.
func ExampleClient_Complete() {
	ctx := context.Background()
	client, err := engine.Dial(ctx, "127.0.0.1:50051")
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	maxTokens := uint32(16)
	completion, err := client.Complete(ctx, &enginev1.GenerateRequest{
		Input:    &enginev1.GenerateRequest_TokenIds{TokenIds: &enginev1.TokenIds{Ids: []uint32{0, 17, 42}}},
		Stopping: &enginev1.StoppingCriteria{MaxTokens: &maxTokens},
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(completion.Choices[0].TokenIDs, completion.Choices[0].FinishReason, completion.Usage)
}

// Abort stops a request by the id the client gave it, from anywhere (another goroutine, another process).
func ExampleClient_Abort() {
	ctx := context.Background()
	client, err := engine.Dial(ctx, "127.0.0.1:50051")
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	req := engine.TextPrompt("Tell me a story", engine.RequestID("story-1"))
	stream, err := client.Generate(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	go func() { _, _ = client.Abort(ctx, "story-1") }()
	acc := engine.NewAccumulator(req)
	for resp, err := range stream.All() {
		if err != nil {
			log.Fatal(err)
		}
		if err := acc.Add(resp); err != nil {
			log.Fatal(err)
		}
	}
	// The stream ends cleanly; the completion's finish reason is FINISH_REASON_ABORT.
	fmt.Println(acc.Completion().Choices[0].FinishReason)
}

// Mutual TLS with an API key.
func ExampleDial_mutualTLS() {
	client, err := engine.Dial(context.Background(), "engine.internal:443",
		engine.WithCACertFile("ca.pem"),
		engine.WithClientCertFiles("client.pem", "client-key.pem"),
		engine.WithAPIKey("secret"),
		engine.WithKeepalive(30*time.Second, 10*time.Second, false),
		engine.WithMaxRecvMsgSize(64<<20),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
}

// Structured output: the completion is JSON matching the schema (a Go value here; JSONSchema takes text).
func ExampleJSONSchemaValue() {
	ctx := context.Background()
	client, err := engine.Dial(ctx, "127.0.0.1:50051")
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	schema, err := engine.JSONSchemaValue(map[string]any{
		"type":                 "object",
		"properties":           map[string]any{"answer": map[string]any{"enum": []string{"yes", "no"}}},
		"required":             []string{"answer"},
		"additionalProperties": false,
	})
	if err != nil {
		log.Fatal(err)
	}
	completion, err := client.Complete(ctx, engine.TextPrompt("Is the sky blue?", engine.MaxTokens(64), schema))
	if err != nil {
		log.Fatal(err) // INVALID_ARGUMENT naming the field for a schema the server cannot enforce
	}
	var reply struct{ Answer string }
	if err := json.Unmarshal([]byte(completion.Text()), &reply); err != nil {
		log.Fatal(err) // only when max tokens came first: FinishReason is then FINISH_REASON_LENGTH
	}
	fmt.Println(reply.Answer)

	// One of a list of strings.
	color, err := client.Complete(ctx, engine.TextPrompt("Pick a color:", engine.Choices("red", "green", "blue")))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(color.Text())
}
