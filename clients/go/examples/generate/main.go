// Command generate streams a completion from an engine server to stdout.
//
//	go run ./examples/generate -target 127.0.0.1:50051 -prompt "Once upon a time" -max-tokens 32
//
// With -ca-cert the connection uses TLS (add -client-cert/-client-key for mutual TLS); -api-key sends
// `authorization: Bearer <key>` (over plaintext only with -insecure-api-key).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"time"

	engine "github.com/engine-project/engine/clients/go"
)

func main() {
	target := flag.String("target", "127.0.0.1:50051", "server address, host:port")
	prompt := flag.String("prompt", "Hello", "text prompt")
	maxTokens := flag.Uint("max-tokens", 32, "tokens to generate at most")
	temperature := flag.Float64("temperature", 0, "sampling temperature (0: greedy)")
	apiKey := flag.String("api-key", os.Getenv("ENGINE_API_KEY"), "API key (default: $ENGINE_API_KEY)")
	insecureKey := flag.Bool("insecure-api-key", false, "allow sending the API key without TLS")
	caCert := flag.String("ca-cert", "", "PEM file of the CA that signed the server's certificate (enables TLS)")
	clientCert := flag.String("client-cert", "", "PEM client certificate, for mutual TLS")
	clientKey := flag.String("client-key", "", "PEM client key, for mutual TLS")
	timeout := flag.Duration("timeout", 5*time.Minute, "deadline of the whole request")
	flag.Parse()

	if err := run(*target, *prompt, uint32(*maxTokens), float32(*temperature), *timeout, dialOptions(
		*apiKey, *insecureKey, *caCert, *clientCert, *clientKey)); err != nil {
		fmt.Fprintln(os.Stderr, "generate:", err)
		os.Exit(1)
	}
}

func dialOptions(apiKey string, insecureKey bool, caCert, clientCert, clientKey string) []engine.Option {
	var opts []engine.Option
	if apiKey != "" {
		opts = append(opts, engine.WithAPIKey(apiKey))
	}
	if insecureKey {
		opts = append(opts, engine.WithInsecureAPIKey())
	}
	if caCert != "" {
		opts = append(opts, engine.WithCACertFile(caCert))
	}
	if clientCert != "" || clientKey != "" {
		opts = append(opts, engine.WithClientCertFiles(clientCert, clientKey))
	}
	return opts
}

func run(
	target, prompt string, maxTokens uint32, temperature float32, timeout time.Duration, opts []engine.Option,
) error {
	// Ctrl-C cancels the context, which cancels the call: the server aborts the request.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	client, err := engine.Dial(ctx, target, opts...)
	if err != nil {
		return err
	}
	defer client.Close()

	req := engine.TextPrompt(prompt, engine.MaxTokens(maxTokens), engine.Temperature(temperature))
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
		for _, chunk := range resp.GetCompletions() {
			fmt.Print(chunk.GetText())
		}
	}
	result := acc.Completion()
	fmt.Printf("\n[request %s: finish %s, %d prompt + %d completion tokens]\n", result.RequestID,
		result.Choices[0].FinishReason, result.Usage.GetPromptTokens(), result.Usage.GetCompletionTokens())
	return nil
}
