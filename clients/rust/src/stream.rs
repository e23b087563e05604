//! The Generate response stream and the accumulation of its chunks into whole completions.

use std::pin::Pin;
use std::task::{Context, Poll};

use engine_proto::engine::v1::completion_chunk::MatchedStop;
use engine_proto::engine::v1::{FinishReason, GenerateResponse, TokenLogprob, Usage};
use tokio_stream::{Stream, StreamExt};

use crate::error::{Error, Result};

/// More completions than the contract allows (n <= 16) by a wide margin: a larger index is a broken server,
/// and refusing it keeps a bad message from making the client allocate without bound.
const MAX_COMPLETION_INDEX: u32 = 1024;

/// The responses of one Generate call, as a [`Stream`] of `Result<GenerateResponse, Error>`.
///
/// It ends (`None`) after the server's last message and OK status; a failing status arrives as an `Err` item.
/// Dropping it before the end cancels the call (HTTP/2 RST_STREAM) and the server aborts the request.
#[derive(Debug)]
pub struct GenerateStream {
    inner: tonic::Streaming<GenerateResponse>,
}

impl GenerateStream {
    pub(crate) fn new(inner: tonic::Streaming<GenerateResponse>) -> Self {
        Self { inner }
    }

    /// The next response, or `None` once the call ended with status OK (an alternative to [`StreamExt::next`]).
    pub async fn message(&mut self) -> Result<Option<GenerateResponse>> {
        Ok(self.inner.message().await?)
    }

    /// Reads the stream to its end and gathers the output per completion index.
    ///
    /// Fails with [`Error::Protocol`] if the stream ends while a completion has no finish reason.
    pub async fn collect_completion(mut self) -> Result<Completion> {
        let mut completion = Completion::default();
        while let Some(response) = self.next().await {
            completion.push(response?)?;
        }
        if completion.outputs.is_empty() || !completion.is_finished() {
            return Err(Error::Protocol("the Generate stream ended before every completion finished".into()));
        }
        Ok(completion)
    }

    /// The underlying tonic stream (for trailers and other transport details).
    pub fn into_inner(self) -> tonic::Streaming<GenerateResponse> {
        self.inner
    }
}

impl Stream for GenerateStream {
    type Item = Result<GenerateResponse>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(cx).map(|item| item.map(|result| result.map_err(Error::from)))
    }
}

/// The whole result of a Generate call, built from its responses by [`Completion::push`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    /// The request's id (the client's, or the one the server assigned).
    pub request_id: String,
    /// One entry per completion, `outputs[i].index == i`.
    pub outputs: Vec<CompletionOutput>,
    /// Log-probabilities of the prompt tokens, when they were asked for.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Token counts, from the last response.
    pub usage: Option<Usage>,
}

/// One completion of the prompt, accumulated over its chunks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompletionOutput {
    /// Which completion, 0 to n-1.
    pub index: u32,
    /// Every generated token id, in order.
    pub token_ids: Vec<u32>,
    /// The generated text (when the request asked for text).
    pub text: String,
    /// Log-probabilities of `token_ids`, when they were asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Why it ended; [`FinishReason::Unspecified`] while it runs.
    pub finish_reason: FinishReason,
    /// The stop string or token that ended it, when `finish_reason` is STOP.
    pub matched_stop: Option<MatchedStop>,
}

impl Completion {
    /// Adds one response of the stream: appends each chunk to its completion and keeps the usage.
    ///
    /// Fails with [`Error::Protocol`] for an absurd index or output after a completion's finish.
    pub fn push(&mut self, response: GenerateResponse) -> Result<()> {
        if self.request_id.is_empty() {
            self.request_id = response.request_id;
        }
        self.prompt_logprobs.extend(response.prompt_logprobs);
        if response.usage.is_some() {
            self.usage = response.usage;
        }
        for chunk in response.completions {
            let finish_reason = chunk.finish_reason();
            if chunk.index >= MAX_COMPLETION_INDEX {
                return Err(Error::Protocol(format!("completion index {} out of range", chunk.index)));
            }
            let index = chunk.index as usize;
            while self.outputs.len() <= index {
                let next = self.outputs.len() as u32;
                self.outputs.push(CompletionOutput { index: next, ..CompletionOutput::default() });
            }
            let output = &mut self.outputs[index];
            if output.finish_reason != FinishReason::Unspecified {
                return Err(Error::Protocol(format!("completion {index} got output after it finished")));
            }
            output.token_ids.extend(chunk.token_ids);
            output.text.push_str(&chunk.text);
            output.logprobs.extend(chunk.logprobs);
            output.finish_reason = finish_reason;
            output.matched_stop = chunk.matched_stop;
        }
        Ok(())
    }

    /// Whether every completion seen so far has its finish reason.
    pub fn is_finished(&self) -> bool {
        self.outputs.iter().all(|output| output.finish_reason != FinishReason::Unspecified)
    }
}

#[cfg(test)]
mod tests {
    use engine_proto::engine::v1::CompletionChunk;

    use super::*;

    fn chunk(index: u32, token_ids: &[u32], text: &str, finish: FinishReason) -> CompletionChunk {
        CompletionChunk {
            index,
            token_ids: token_ids.to_vec(),
            text: text.into(),
            finish_reason: finish as i32,
            ..CompletionChunk::default()
        }
    }

    #[test]
    fn push_accumulates_per_index_and_keeps_usage() {
        let mut completion = Completion::default();
        let first = GenerateResponse {
            request_id: "r".into(),
            completions: vec![
                chunk(1, &[5], "a", FinishReason::Unspecified),
                chunk(0, &[7, 8], "bc", FinishReason::Unspecified),
            ],
            ..GenerateResponse::default()
        };
        let last = GenerateResponse {
            request_id: "r".into(),
            completions: vec![
                chunk(0, &[], "", FinishReason::Stop),
                chunk(1, &[6], "d", FinishReason::Length),
            ],
            usage: Some(Usage { prompt_tokens: 3, completion_tokens: 4, cached_prompt_tokens: 0 }),
            ..GenerateResponse::default()
        };
        completion.push(first).unwrap();
        assert!(!completion.is_finished());
        completion.push(last).unwrap();
        assert!(completion.is_finished());
        assert_eq!(completion.request_id, "r");
        assert_eq!(completion.outputs[0].token_ids, [7, 8]);
        assert_eq!(completion.outputs[0].text, "bc");
        assert_eq!(completion.outputs[0].finish_reason, FinishReason::Stop);
        assert_eq!(completion.outputs[1].token_ids, [5, 6]);
        assert_eq!(completion.outputs[1].finish_reason, FinishReason::Length);
        assert_eq!(completion.usage.unwrap().completion_tokens, 4);
    }

    #[test]
    fn push_rejects_output_after_finish_and_absurd_indexes() {
        let mut completion = Completion::default();
        let done = GenerateResponse {
            completions: vec![chunk(0, &[1], "", FinishReason::Stop)],
            ..Default::default()
        };
        completion.push(done.clone()).unwrap();
        assert!(matches!(completion.push(done), Err(Error::Protocol(_))));
        let huge = GenerateResponse {
            completions: vec![chunk(u32::MAX, &[1], "", FinishReason::Stop)],
            ..Default::default()
        };
        assert!(matches!(Completion::default().push(huge), Err(Error::Protocol(_))));
    }
}
