// Command consumertest is the program of the downstream-consumer test (consumer_test.go): the test copies
// this file into a module of its own outside the SDK, which requires the SDK the way a user's module does,
// builds it with `go build`, and runs it against a live server. It prints one JSON object on stdout.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
)

type result struct {
	SDKVersion   string   `json:"sdk_version"`
	Health       string   `json:"health"`
	Model        string   `json:"model"`
	RequestID    string   `json:"request_id"`
	TokenIDs     []uint32 `json:"token_ids"`
	Text         string   `json:"text"`
	FinishReason string   `json:"finish_reason"`
}

func main() {
	target := flag.String("target", "127.0.0.1:50051", "server address")
	apiKey := flag.String("api-key", "", "API key (sent over plaintext: loopback only)")
	prompt := flag.String("prompt", "Hello", "text prompt")
	maxTokens := flag.Uint("max-tokens", 8, "tokens to generate")
	flag.Parse()
	if err := run(*target, *apiKey, *prompt, uint32(*maxTokens)); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

func run(target, apiKey, prompt string, maxTokens uint32) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	opts := []engine.Option{engine.WithBlock(), engine.WithDefaultTimeout(30 * time.Second)}
	if apiKey != "" {
		opts = append(opts, engine.WithAPIKey(apiKey), engine.WithInsecureAPIKey())
	}
	client, err := engine.Dial(ctx, target, opts...)
	if err != nil {
		return err
	}
	defer client.Close()
	health, err := client.Health(ctx, engine.HealthServiceName)
	if err != nil {
		return err
	}
	info, err := client.ModelInfo(ctx)
	if err != nil {
		return err
	}
	// NOTE: a raw generated request (no builders), as a gateway forwarding requests would send it.
	temperature := float32(0)
	req := &enginev1.GenerateRequest{
		Input:    &enginev1.GenerateRequest_Text{Text: prompt},
		Sampling: &enginev1.SamplingParams{Temperature: &temperature},
		Stopping: &enginev1.StoppingCriteria{MaxTokens: &maxTokens},
		Stream:   true,
	}
	stream, err := client.Generate(ctx, req)
	if err != nil {
		return err
	}
	acc := engine.NewAccumulator(req)
	for resp, err := range stream.All() {
		if err != nil {
			return err
		}
		if err := acc.Add(resp); err != nil {
			return err
		}
	}
	completion := acc.Completion()
	first := completion.Choices[0] // NOTE: n=1, so the Accumulator holds exactly one choice
	return json.NewEncoder(os.Stdout).Encode(result{
		SDKVersion: engine.Version, Health: health.String(), Model: info.GetServedModelName(),
		RequestID: completion.RequestID, TokenIDs: first.TokenIDs, Text: first.Text,
		FinishReason: first.FinishReason.String(),
	})
}
