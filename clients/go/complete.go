package engine

import (
	"context"
	"fmt"
	"io"
	"strings"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
)

// Completion is the whole result of a Generate request.
type Completion struct {
	// RequestID is the request's id (the client's, or the one the server assigned).
	RequestID string
	// Choices holds one entry per completion index, 0 to n-1.
	Choices []Choice
	// PromptLogprobs are the prompt tokens' log-probabilities, when the request asked for them.
	PromptLogprobs []*enginev1.TokenLogprob
	// Usage counts the tokens; set when the stream ended normally.
	Usage *enginev1.Usage
}

// Text is the text of the first completion, the only one unless the request set n.
func (c *Completion) Text() string {
	if len(c.Choices) == 0 {
		return ""
	}
	return c.Choices[0].Text
}

// Choice is one completion of the prompt.
type Choice struct {
	Index        uint32
	TokenIDs     []uint32
	Text         string
	Logprobs     []*enginev1.TokenLogprob
	FinishReason enginev1.FinishReason
	// StopString is the stop string that ended the completion, if one did.
	StopString string
	// StopTokenID is the stop or end-of-sequence token that ended the completion, if one did.
	StopTokenID *uint32
}

// Accumulator merges the responses of one Generate stream into a Completion, for callers that want to
// handle each response as it arrives and also the whole result.
type Accumulator struct {
	numCompletions uint32
	requestID      string
	choices        []Choice
	texts          []*strings.Builder
	promptLogprobs []*enginev1.TokenLogprob
	usage          *enginev1.Usage
}

// NewAccumulator makes an Accumulator for the responses to req (it reads the number of completions, n).
func NewAccumulator(req *enginev1.GenerateRequest) *Accumulator {
	n := uint32(1)
	if sampling := req.GetSampling(); sampling != nil && sampling.N != nil {
		n = sampling.GetN()
	}
	acc := &Accumulator{numCompletions: n}
	// NOTE: the server rejects n above 16; growing on demand keeps a huge n from allocating before it does.
	acc.grow(min(n, 16))
	return acc
}

func (a *Accumulator) grow(size uint32) {
	for uint32(len(a.choices)) < size {
		a.choices = append(a.choices, Choice{Index: uint32(len(a.choices))})
		a.texts = append(a.texts, &strings.Builder{})
	}
}

// Add merges one response. It fails when the server sent a completion index outside the request's n.
func (a *Accumulator) Add(resp *enginev1.GenerateResponse) error {
	if a.requestID == "" {
		a.requestID = resp.GetRequestId()
	}
	if len(resp.GetPromptLogprobs()) > 0 {
		a.promptLogprobs = append(a.promptLogprobs, resp.GetPromptLogprobs()...)
	}
	if resp.GetUsage() != nil {
		a.usage = resp.GetUsage()
	}
	for _, chunk := range resp.GetCompletions() {
		index := chunk.GetIndex()
		if index >= a.numCompletions {
			return fmt.Errorf("engine: response for completion index %d, but the request asked for %d",
				index, a.numCompletions)
		}
		a.grow(index + 1)
		choice := &a.choices[index]
		choice.TokenIDs = append(choice.TokenIDs, chunk.GetTokenIds()...)
		choice.Logprobs = append(choice.Logprobs, chunk.GetLogprobs()...)
		a.texts[index].WriteString(chunk.GetText())
		if reason := chunk.GetFinishReason(); reason != enginev1.FinishReason_FINISH_REASON_UNSPECIFIED {
			choice.FinishReason = reason
		}
		switch stop := chunk.GetMatchedStop().(type) {
		case *enginev1.CompletionChunk_StopString:
			choice.StopString = stop.StopString
		case *enginev1.CompletionChunk_StopTokenId:
			id := stop.StopTokenId
			choice.StopTokenID = &id
		}
	}
	return nil
}

// Completion returns the result so far.
func (a *Accumulator) Completion() *Completion {
	choices := make([]Choice, len(a.choices))
	copy(choices, a.choices)
	for i := range choices {
		choices[i].Text = a.texts[i].String()
	}
	return &Completion{
		RequestID: a.requestID, Choices: choices, PromptLogprobs: a.promptLogprobs, Usage: a.usage,
	}
}

// Complete runs a Generate request to its end and returns the accumulated result. It works for streaming and
// non-streaming requests alike (a non-streaming request is cheaper when only the result matters).
func (c *Client) Complete(ctx context.Context, req *enginev1.GenerateRequest) (*Completion, error) {
	stream, err := c.Generate(ctx, req)
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	acc := NewAccumulator(req)
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			return acc.Completion(), nil
		}
		if err != nil {
			return nil, err
		}
		if err := acc.Add(resp); err != nil {
			return nil, err
		}
	}
}
