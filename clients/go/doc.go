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
// Structured output (constrained decoding) is a request option like the others: JSONSchema, JSONSchemaValue,
// JSONObject, Regex, Grammar, Choices or StructuralTag constrains every completion to a language. The server
// masks each token that cannot continue it, so the output is in the language whatever the model prefers. A
// completion ends with FINISH_REASON_STOP once its output is complete, with FINISH_REASON_LENGTH when MaxTokens
// comes first (the output is then an incomplete prefix), and with FINISH_REASON_CONSTRAINT_DEAD_END in the
// rare case that a grammar allows no next token. A constraint the server cannot compile is INVALID_ARGUMENT
// naming the field ("structured_output.regex: ...").
//
//	req := engine.TextPrompt("Is the sky blue?", engine.MaxTokens(64),
//		engine.JSONSchema(`{"type":"object","properties":{"answer":{"enum":["yes","no"]}},"required":["answer"]}`))
//
// Errors returned by the client are gRPC status errors, so status.Code(err) gives the code the server sent
// (INVALID_ARGUMENT, UNAUTHENTICATED, ...). Cancelling the context of a Generate call (or calling
// GenerateStream.Close) cancels the RPC, and the server aborts the request in its engine.
package engine
