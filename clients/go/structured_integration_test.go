package engine_test

import (
	"bytes"
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A bounded schema: every completion closes well within structuredMaxTokens (a few tokens of keys, one enum
// value, one digit), so FINISH_REASON_LENGTH would mean the constraint was not applied.
var answerSchema = map[string]any{
	"type": "object",
	"properties": map[string]any{
		"answer": map[string]any{"type": "string", "enum": []string{"yes", "no"}},
		"n":      map[string]any{"type": "integer", "minimum": 0, "maximum": 9},
	},
	"required":             []string{"answer", "n"},
	"additionalProperties": false,
}

const structuredMaxTokens = 64

// checkAnswer requires a completion that ended at its language's end with JSON of answerSchema's shape.
func checkAnswer(t *testing.T, choice engine.Choice) {
	t.Helper()
	if choice.FinishReason != enginev1.FinishReason_FINISH_REASON_STOP {
		t.Errorf("completion %d: finish reason %v, want STOP (text %q)", choice.Index, choice.FinishReason, choice.Text)
	}
	var got struct {
		Answer *string `json:"answer"`
		N      *int    `json:"n"`
	}
	dec := json.NewDecoder(strings.NewReader(choice.Text))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&got); err != nil || dec.More() {
		t.Fatalf("completion %d: %q is not one JSON object of the schema's fields: %v", choice.Index, choice.Text, err)
	}
	if got.Answer == nil || (*got.Answer != "yes" && *got.Answer != "no") || got.N == nil || *got.N < 0 || *got.N > 9 {
		t.Errorf("completion %d: %q does not match the schema", choice.Index, choice.Text)
	}
}

func TestStructuredJSONSchema(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	schemaOpt, err := engine.JSONSchemaValue(answerSchema)
	if err != nil {
		t.Fatal(err)
	}
	// Streamed, three seeded samples: each completion is constrained on its own.
	req := engine.TextPrompt("Answer in JSON:", engine.MaxTokens(structuredMaxTokens), engine.N(3), engine.Seed(7), schemaOpt)
	stream, err := client.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	sampled := streamAll(t, stream, req)
	if len(sampled.Choices) != 3 {
		t.Fatalf("%d choices, want 3", len(sampled.Choices))
	}
	for _, choice := range sampled.Choices {
		checkAnswer(t, choice)
	}

	// Greedy and whole; the same schema as indented text is the same constraint.
	greedy, err := client.Complete(ctx, engine.TextPrompt("Answer in JSON:", engine.MaxTokens(structuredMaxTokens),
		engine.Greedy(), engine.Stream(false), schemaOpt))
	if err != nil {
		t.Fatal(err)
	}
	checkAnswer(t, greedy.Choices[0])
	compact, _ := json.Marshal(answerSchema)
	var indented bytes.Buffer
	if err := json.Indent(&indented, compact, "", "  "); err != nil {
		t.Fatal(err)
	}
	fromText, err := client.Complete(ctx, engine.TextPrompt("Answer in JSON:", engine.MaxTokens(structuredMaxTokens),
		engine.Greedy(), engine.JSONSchema(indented.String())))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(fromText.Choices[0].TokenIDs, greedy.Choices[0].TokenIDs) {
		t.Errorf("schema as text %q, as a value %q", fromText.Text(), greedy.Text())
	}
}

func TestStructuredChoicesRegexAndGrammar(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	colors := []string{"red", "green", "blue"}
	for _, tc := range []struct {
		name   string
		opt    engine.RequestOption
		accept func(string) bool
	}{
		{"choices", engine.Choices(colors...), func(s string) bool { return slices.Contains(colors, s) }},
		{"regex", engine.Regex(`[0-9]{3}-[a-z]{2}`), regexp.MustCompile(`^[0-9]{3}-[a-z]{2}$`).MatchString},
		{"grammar", engine.Grammar("start: \"id=\" NUM \";\"\nNUM: /[1-9][0-9]?/\n"),
			regexp.MustCompile(`^id=[1-9][0-9]?;$`).MatchString},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := client.Complete(ctx, engine.TextPrompt("Pick one:", engine.MaxTokens(structuredMaxTokens),
				engine.N(4), engine.Seed(1), tc.opt))
			if err != nil {
				t.Fatal(err)
			}
			for _, choice := range got.Choices {
				if !tc.accept(choice.Text) || choice.FinishReason != enginev1.FinishReason_FINISH_REASON_STOP {
					t.Errorf("completion %d: %q, %v", choice.Index, choice.Text, choice.FinishReason)
				}
			}
		})
	}
}

func TestStructuredInvalidConstraintNamesTheField(t *testing.T) {
	client := dialMain(t)
	ctx := integrationContext(t)
	for _, tc := range []struct {
		name  string
		opt   engine.RequestOption
		field string
	}{
		{"unclosed group", engine.Regex("(a"), "structured_output.regex"},
		{"schema not JSON", engine.JSONSchema("{bad"), "structured_output.json_schema"},
		{"unenforceable keyword", engine.JSONSchema(`{"type":"array","uniqueItems":true}`), "structured_output.json_schema"},
		{"no choices", engine.Choices(), "structured_output.choice"},
		{"tag without its trigger", engine.StructuralTag([]string{"<call"}, engine.Tag("<f>", "", "")),
			"structured_output.structural_tag.tags[0].begin"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stream, err := client.Generate(ctx, engine.TextPrompt("hi", engine.MaxTokens(8), tc.opt))
			if err != nil {
				t.Fatal(err)
			}
			_, err = stream.Recv()
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("err = %v, want INVALID_ARGUMENT", err)
			}
			if msg := status.Convert(err).Message(); !strings.HasPrefix(msg, tc.field+":") {
				t.Errorf("message %q does not start with %q", msg, tc.field)
			}
		})
	}
}
