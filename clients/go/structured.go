package engine

import (
	"encoding/json"
	"fmt"
	"slices"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/protobuf/proto"
)

// The structured output options (JSONSchema, JSONSchemaValue, JSONObject, Regex, Grammar, Choices,
// StructuralTag) set the request's one StructuredOutput: of several, the last wins. See the package docs.

// constrain makes an option that sets a fresh StructuredOutput (built by kind) on each request it is applied
// to, so one option value can build many requests without them sharing a message.
func constrain(kind func() *enginev1.StructuredOutput) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.StructuredOutput = kind() }
}

// JSONSchema constrains the output to JSON matching a JSON Schema (draft 2020-12) given as JSON text; see
// generate.proto for the keywords the server enforces. The output is compact JSON.
func JSONSchema(schema string) RequestOption {
	return constrain(func() *enginev1.StructuredOutput {
		return &enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_JsonSchema{JsonSchema: schema}}
	})
}

// JSONSchemaValue is JSONSchema for a schema held as a Go value (a map, or a struct with json tags),
// marshalled with encoding/json. It fails only where json.Marshal does.
func JSONSchemaValue(schema any) (RequestOption, error) {
	text, err := json.Marshal(schema)
	if err != nil {
		return nil, fmt.Errorf("engine: JSON schema: %w", err)
	}
	return JSONSchema(string(text)), nil
}

// JSONObject constrains the output to any JSON object.
func JSONObject() RequestOption {
	return constrain(func() *enginev1.StructuredOutput {
		return &enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_JsonObject{JsonObject: &enginev1.JsonObject{}}}
	})
}

// Regex constrains the whole output to match a regular expression (Rust regex syntax, anchored at both ends;
// no lookaround or backreferences).
func Regex(pattern string) RequestOption {
	return constrain(func() *enginev1.StructuredOutput {
		return &enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_Regex{Regex: pattern}}
	})
}

// Grammar constrains the output to a context-free grammar in Lark syntax, as the llguidance library reads it
// (`start` is the start rule).
func Grammar(lark string) RequestOption {
	return constrain(func() *enginev1.StructuredOutput {
		return &enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_Grammar{Grammar: lark}}
	})
}

// Choices constrains the output to exactly one of the given strings (at least one, each non-empty).
func Choices(choices ...string) RequestOption {
	choices = slices.Clone(choices)
	return constrain(func() *enginev1.StructuredOutput {
		choice := &enginev1.Choice{Choices: slices.Clone(choices)}
		return &enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_Choice{Choice: choice}}
	})
}

// StructuralTag constrains tool calls inside otherwise free text: the text is free until it contains one of
// the triggers; from there it continues with the begin of a tag that starts with that trigger, JSON matching
// the tag's schema, and the tag's end; then the text is free again. Build the tags with Tag.
func StructuralTag(triggers []string, tags ...*enginev1.StructuralTagItem) RequestOption {
	triggers, tags = slices.Clone(triggers), slices.Clone(tags)
	return constrain(func() *enginev1.StructuredOutput {
		tag := &enginev1.StructuralTag{Triggers: slices.Clone(triggers)}
		for _, item := range tags {
			tag.Tags = append(tag.Tags, proto.CloneOf(item))
		}
		return &enginev1.StructuredOutput{Kind: &enginev1.StructuredOutput_StructuralTag{StructuralTag: tag}}
	})
}

// Tag is one tag of a StructuralTag: begin (which starts with one of the triggers), then JSON matching the
// JSON Schema text schema ("" for any JSON value), then end (may be "").
func Tag(begin, schema, end string) *enginev1.StructuralTagItem {
	return &enginev1.StructuralTagItem{Begin: begin, JsonSchema: schema, End: end}
}
