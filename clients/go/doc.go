// Package engine is the Go client of the engine.v1 gRPC inference API.
//
// It wraps the generated stubs of github.com/engine-project/engine/gen/go/api/engine/v1 (imported as enginev1)
// with what every caller needs: dialing with TLS, mTLS and an API key, a Generate stream that ends with io.EOF
// (or a range-over-func iterator), a Complete helper that accumulates a whole result, unary helpers and the
// standard gRPC health check. Requests and responses are the generated messages, so every field of the
// contract is reachable; the builders in this package (TextPrompt, MaxTokens, Temperature, ...) are optional.
//
//	client, err := engine.Dial(ctx, "127.0.0.1:50051")
//	if err != nil { ... }
//	defer client.Close()
//	stream, err := client.Generate(ctx, engine.TextPrompt("Hello", engine.MaxTokens(32), engine.Greedy()))
//	if err != nil { ... }
//	for resp, err := range stream.All() {
//		if err != nil { ... }
//		for _, c := range resp.GetCompletions() {
//			fmt.Print(c.GetText())
//		}
//	}
//
// Errors returned by the client are gRPC status errors, so status.Code(err) gives the code the server sent
// (INVALID_ARGUMENT, UNAUTHENTICATED, ...). Cancelling the context of a Generate call (or calling
// GenerateStream.Close) cancels the RPC, and the server aborts the request in its engine.
package engine
