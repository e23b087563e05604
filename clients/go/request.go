package engine

import (
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/protobuf/proto"
)

// RequestOption sets fields of a GenerateRequest built by TextPrompt, TokenPrompt or ChatPrompt. Each option
// sets only its own field, so unset fields keep the server's defaults (written in generate.proto).
type RequestOption func(*enginev1.GenerateRequest)

// TextPrompt builds a streaming request for a text prompt (tokenized by the server, special tokens added).
func TextPrompt(text string, opts ...RequestOption) *enginev1.GenerateRequest {
	return build(&enginev1.GenerateRequest{Input: &enginev1.GenerateRequest_Text{Text: text}}, opts)
}

// TokenPrompt builds a streaming request for a prompt of token ids, used as they are.
func TokenPrompt(tokenIDs []uint32, opts ...RequestOption) *enginev1.GenerateRequest {
	input := &enginev1.GenerateRequest_TokenIds{TokenIds: &enginev1.TokenIds{Ids: tokenIDs}}
	return build(&enginev1.GenerateRequest{Input: input}, opts)
}

// ChatPrompt builds a streaming request for chat messages, rendered with the model's chat template.
func ChatPrompt(messages []*enginev1.ChatMessage, opts ...RequestOption) *enginev1.GenerateRequest {
	input := &enginev1.GenerateRequest_Chat{Chat: &enginev1.ChatMessages{Messages: messages}}
	return build(&enginev1.GenerateRequest{Input: input}, opts)
}

// Message is one chat turn, for ChatPrompt.
func Message(role, content string) *enginev1.ChatMessage {
	return &enginev1.ChatMessage{Role: role, Content: content}
}

func build(req *enginev1.GenerateRequest, opts []RequestOption) *enginev1.GenerateRequest {
	req.Stream = true
	for _, opt := range opts {
		opt(req)
	}
	return req
}

// ensure returns the sub-message *field points to, first setting it to an empty one when unset, so an
// option fills only its own field of Sampling, Stopping or Output.
func ensure[M any](field **M) *M {
	if *field == nil {
		*field = new(M)
	}
	return *field
}

// RequestID sets the client-chosen request id (used by Abort).
func RequestID(id string) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.RequestId = id }
}

// Stream chooses streaming (the builders' default) or one response holding the whole result.
func Stream(on bool) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.Stream = on }
}

// AddSpecialTokens chooses whether the server adds special tokens (such as BOS) to a text prompt.
func AddSpecialTokens(on bool) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.AddSpecialTokens = proto.Bool(on) }
}

// Temperature sets the softmax temperature (0: greedy).
func Temperature(t float32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).Temperature = proto.Float32(t) }
}

// Greedy picks the most likely token at every step (temperature 0).
func Greedy() RequestOption { return Temperature(0) }

// TopP sets nucleus sampling's probability mass, in (0, 1].
func TopP(p float32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).TopP = proto.Float32(p) }
}

// TopK keeps only the k most likely tokens (0: off).
func TopK(k uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).TopK = proto.Uint32(k) }
}

// MinP drops tokens below p times the most likely token's probability.
func MinP(p float32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).MinP = proto.Float32(p) }
}

// RepetitionPenalty sets the multiplicative penalty on tokens already seen (1: off).
func RepetitionPenalty(p float32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).RepetitionPenalty = proto.Float32(p) }
}

// PresencePenalty sets the penalty subtracted once from every generated token's logit, in [-2, 2].
func PresencePenalty(p float32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).PresencePenalty = proto.Float32(p) }
}

// FrequencyPenalty sets the penalty subtracted per occurrence of a generated token, in [-2, 2].
func FrequencyPenalty(p float32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).FrequencyPenalty = proto.Float32(p) }
}

// Seed makes sampling reproducible.
func Seed(seed uint64) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).Seed = proto.Uint64(seed) }
}

// N asks for n completions of the prompt (1 to 16).
func N(n uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Sampling).N = proto.Uint32(n) }
}

// MaxTokens bounds the tokens generated per completion.
func MaxTokens(n uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Stopping).MaxTokens = proto.Uint32(n) }
}

// MinTokens ignores end-of-sequence and stop tokens until n tokens were generated.
func MinTokens(n uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Stopping).MinTokens = n }
}

// StopStrings ends a completion when its text contains one of the strings.
func StopStrings(stop ...string) RequestOption {
	return func(r *enginev1.GenerateRequest) {
		s := ensure(&r.Stopping)
		s.Stop = append(s.Stop, stop...)
	}
}

// StopTokenIDs ends a completion after one of the token ids.
func StopTokenIDs(ids ...uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) {
		s := ensure(&r.Stopping)
		s.StopTokenIds = append(s.StopTokenIds, ids...)
	}
}

// IgnoreEOS keeps generating past the end-of-sequence token (until max tokens or a stop condition).
func IgnoreEOS() RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Stopping).IgnoreEos = true }
}

// Logprobs returns each sampled token's log-probability with k alternatives (0 to 20).
func Logprobs(k uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Output).Logprobs = proto.Uint32(k) }
}

// PromptLogprobs returns the prompt tokens' log-probabilities with k alternatives (0 to 20).
func PromptLogprobs(k uint32) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Output).PromptLogprobs = proto.Uint32(k) }
}

// ReturnText chooses whether responses carry text beside the token ids (default: true).
func ReturnText(on bool) RequestOption {
	return func(r *enginev1.GenerateRequest) { ensure(&r.Output).ReturnText = proto.Bool(on) }
}
