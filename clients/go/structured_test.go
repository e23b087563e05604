package engine_test

import (
	"math"
	"slices"
	"testing"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/protobuf/proto"
)

func TestStructuredOutputOptions(t *testing.T) {
	schema := `{"type":"object"}`
	for _, tc := range []struct {
		name string
		opt  engine.RequestOption
		want *enginev1.StructuredOutput
	}{
		{"json schema", engine.JSONSchema(schema),
			&enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_JsonSchema{JsonSchema: schema}}},
		{"json object", engine.JSONObject(),
			&enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_JsonObject{JsonObject: &enginev1.JsonObject{}}}},
		{"regex", engine.Regex(`\d+`),
			&enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_Regex{Regex: `\d+`}}},
		{"grammar", engine.Grammar(`start: "a"`),
			&enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_Grammar{Grammar: `start: "a"`}}},
		{"choices", engine.Choices("yes", "no"),
			&enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_Choice{
				Choice: &enginev1.Choice{Choices: []string{"yes", "no"}}}}},
		{"structural tag", engine.StructuralTag([]string{"<f="}, engine.Tag("<f=a>", schema, "</f>"), engine.Tag("<f=b>", "", "")),
			&enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_StructuralTag{StructuralTag: &enginev1.StructuralTag{
				Triggers: []string{"<f="},
				Tags: []*enginev1.StructuralTagItem{
					{Begin: "<f=a>", JsonSchema: schema, End: "</f>"}, {Begin: "<f=b>"},
				},
			}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := engine.TextPrompt("hi", engine.MaxTokens(4), tc.opt)
			if !proto.Equal(req.GetStructuredOutput(), tc.want) {
				t.Errorf("structured_output = %v, want %v", req.GetStructuredOutput(), tc.want)
			}
			if req.GetSampling() != nil || req.GetOutput() != nil || req.GetStopping().GetMaxTokens() != 4 {
				t.Errorf("the option set fields it does not own: %v", req)
			}
		})
	}
	if engine.TextPrompt("hi").GetStructuredOutput() != nil {
		t.Error("no option, but structured_output is set")
	}
}

func TestStructuredOutputLastOptionWins(t *testing.T) {
	req := engine.TextPrompt("hi", engine.Regex("a"), engine.Choices("x"))
	if req.GetStructuredOutput().GetRegex() != "" || !slices.Equal(req.GetStructuredOutput().GetChoice().GetChoices(), []string{"x"}) {
		t.Errorf("structured_output = %v, want only the choice", req.GetStructuredOutput())
	}
}

func TestStructuredOutputOptionsShareNothing(t *testing.T) {
	choices := []string{"a", "b"}
	opt := engine.Choices(choices...)
	choices[0] = "changed" // the caller's slice, after the option was made
	first, second := engine.TextPrompt("1", opt), engine.TextPrompt("2", opt)
	first.GetStructuredOutput().GetChoice().Choices[1] = "changed too"
	if got := second.GetStructuredOutput().GetChoice().GetChoices(); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("choices of the second request = %v", got)
	}
	tag := engine.Tag("<a>", "", "")
	tagged := engine.StructuralTag([]string{"<"}, tag)
	one, two := engine.TextPrompt("1", tagged), engine.TextPrompt("2", tagged)
	one.GetStructuredOutput().GetStructuralTag().GetTags()[0].Begin = "<b>"
	if two.GetStructuredOutput().GetStructuralTag().GetTags()[0].GetBegin() != "<a>" || tag.GetBegin() != "<a>" {
		t.Error("requests built by one StructuralTag option share their tags")
	}
}

func TestJSONSchemaValue(t *testing.T) {
	opt, err := engine.JSONSchemaValue(map[string]any{"type": "object", "required": []string{"n"}})
	if err != nil {
		t.Fatal(err)
	}
	// encoding/json sorts map keys: the text is stable
	if got := engine.TextPrompt("hi", opt).GetStructuredOutput().GetJsonSchema(); got != `{"required":["n"],"type":"object"}` {
		t.Errorf("json_schema = %s", got)
	}
	for _, bad := range []any{map[string]any{"maximum": math.Inf(1)}, make(chan int)} {
		if opt, err := engine.JSONSchemaValue(bad); err == nil || opt != nil {
			t.Errorf("JSONSchemaValue(%v) = %v, %v; want an error", bad, opt, err)
		}
	}
}
