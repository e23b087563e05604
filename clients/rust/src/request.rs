//! Shortcuts for building requests. Raw prost messages work everywhere too; these only save typing.
//!
//! ```
//! use engine_client::request;
//!
//! let req = request::text("Once upon a time").max_tokens(16).greedy().stream(true).build();
//! assert_eq!(req.stopping.unwrap().max_tokens, Some(16));
//! ```
//!
//! # Structured output
//!
//! One builder method constrains every completion to a language (constrained decoding): the server masks each
//! token that cannot continue it, so the output is in the language whatever the model prefers.
//! [`json_schema`](GenerateRequestBuilder::json_schema),
//! [`json_object`](GenerateRequestBuilder::json_object), [`regex`](GenerateRequestBuilder::regex),
//! [`grammar`](GenerateRequestBuilder::grammar), [`choice`](GenerateRequestBuilder::choice) and
//! [`structural_tag`](GenerateRequestBuilder::structural_tag) each set the request's one `structured_output`;
//! of several, the last wins.
//!
//! A completion ends with [`FinishReason::Stop`] once its output is complete, with [`FinishReason::Length`]
//! when `max_tokens` comes first (the output is then an incomplete prefix: give it room), and with
//! [`FinishReason::ConstraintDeadEnd`] in the rare case that a grammar allows no next token. A constraint the
//! server cannot compile is `InvalidArgument` naming the field (`structured_output.regex: ...`).
//!
//! ```
//! use engine_client::proto::structured_output::Kind;
//! use engine_client::request;
//!
//! let schema = r#"{"type":"object","properties":{"answer":{"enum":["yes","no"]}},"required":["answer"]}"#;
//! let req = request::text("Is the sky blue?").max_tokens(64).json_schema(schema).build();
//! assert_eq!(req.structured_output.unwrap().kind, Some(Kind::JsonSchema(schema.into())));
//!
//! let colors = request::text("Pick a color:").choice(["red", "green", "blue"]).build();
//! let weather = request::tag("<function=get_weather>", r#"{"type":"object"}"#, "</function>");
//! let tools = request::text("Use a tool.").structural_tag([weather], ["<function="]).build();
//! ```
//!
//! [`FinishReason::Stop`]: crate::proto::FinishReason::Stop
//! [`FinishReason::Length`]: crate::proto::FinishReason::Length
//! [`FinishReason::ConstraintDeadEnd`]: crate::proto::FinishReason::ConstraintDeadEnd

use engine_proto::engine::v1::{
    embed_input, generate_request, structured_output, tokenize_request, ChatMessage, ChatMessages, Choice,
    EmbedInput, EmbedRequest, GenerateRequest, JsonObject, OutputOptions, SamplingParams, StoppingCriteria,
    StructuralTag, StructuralTagItem, StructuredOutput, TokenIds, TokenizeRequest,
};

/// A Generate request for a text prompt (tokenized by the server, special tokens added).
pub fn text(prompt: impl Into<String>) -> GenerateRequestBuilder {
    GenerateRequestBuilder::with_input(generate_request::Input::Text(prompt.into()))
}

/// A Generate request for a prompt of token ids, used as they are.
pub fn token_ids(ids: impl Into<Vec<u32>>) -> GenerateRequestBuilder {
    GenerateRequestBuilder::with_input(generate_request::Input::TokenIds(TokenIds { ids: ids.into() }))
}

/// A Generate request for a conversation of `(role, content)` turns, rendered with the model's chat template.
pub fn chat<R, C>(turns: impl IntoIterator<Item = (R, C)>) -> GenerateRequestBuilder
where
    R: Into<String>,
    C: Into<String>,
{
    let messages = turns
        .into_iter()
        .map(|(role, content)| ChatMessage { role: role.into(), content: content.into() })
        .collect();
    GenerateRequestBuilder::with_input(generate_request::Input::Chat(ChatMessages {
        messages,
        add_generation_prompt: None,
    }))
}

/// An Embed request with one text input per item.
pub fn embed_texts<S: Into<String>>(texts: impl IntoIterator<Item = S>) -> EmbedRequest {
    let inputs = texts
        .into_iter()
        .map(|text| EmbedInput { input: Some(embed_input::Input::Text(text.into())) })
        .collect();
    EmbedRequest { inputs, normalize: None, add_special_tokens: None }
}

/// A Tokenize request for plain text (special tokens added, as the server's default).
pub fn tokenize_text(text: impl Into<String>) -> TokenizeRequest {
    TokenizeRequest { input: Some(tokenize_request::Input::Text(text.into())), ..TokenizeRequest::default() }
}

/// One tag of a [structural tag](GenerateRequestBuilder::structural_tag): `begin` (which starts with one of
/// the triggers), then JSON matching the JSON Schema `json_schema` (`""`: any JSON value), then `end` (may be
/// `""`).
pub fn tag(
    begin: impl Into<String>,
    json_schema: impl Into<String>,
    end: impl Into<String>,
) -> StructuralTagItem {
    StructuralTagItem { begin: begin.into(), json_schema: json_schema.into(), end: end.into() }
}

/// Builds a [`GenerateRequest`] field by field; unset fields keep the server's defaults.
#[derive(Clone, Debug, Default, PartialEq)]
#[must_use = "call .build() to get the request"]
pub struct GenerateRequestBuilder {
    request: GenerateRequest,
}

impl GenerateRequestBuilder {
    fn with_input(input: generate_request::Input) -> Self {
        Self { request: GenerateRequest { input: Some(input), ..GenerateRequest::default() } }
    }

    fn sampling(&mut self) -> &mut SamplingParams {
        self.request.sampling.get_or_insert_with(SamplingParams::default)
    }

    fn stopping(&mut self) -> &mut StoppingCriteria {
        self.request.stopping.get_or_insert_with(StoppingCriteria::default)
    }

    fn output(&mut self) -> &mut OutputOptions {
        self.request.output.get_or_insert_with(OutputOptions::default)
    }

    /// Names the request (needed to abort it by id). Default: the server assigns one.
    pub fn request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request.request_id = request_id.into();
        self
    }

    /// Stream tokens as they are generated instead of one final message.
    pub fn stream(mut self, stream: bool) -> Self {
        self.request.stream = stream;
        self
    }

    /// Maximum tokens per completion.
    pub fn max_tokens(mut self, max_tokens: u32) -> Self {
        self.stopping().max_tokens = Some(max_tokens);
        self
    }

    /// No end-of-sequence or stop token before this many tokens.
    pub fn min_tokens(mut self, min_tokens: u32) -> Self {
        self.stopping().min_tokens = min_tokens;
        self
    }

    /// Stop strings (the matched one is cut from the text).
    pub fn stop<S: Into<String>>(mut self, stop: impl IntoIterator<Item = S>) -> Self {
        self.stopping().stop = stop.into_iter().map(Into::into).collect();
        self
    }

    /// Stop token ids (kept in the output).
    pub fn stop_token_ids(mut self, ids: impl Into<Vec<u32>>) -> Self {
        self.stopping().stop_token_ids = ids.into();
        self
    }

    /// Keep generating past the end-of-sequence token.
    pub fn ignore_eos(mut self, ignore_eos: bool) -> Self {
        self.stopping().ignore_eos = ignore_eos;
        self
    }

    /// Greedy decoding (temperature 0): deterministic output.
    pub fn greedy(self) -> Self {
        self.temperature(0.0)
    }

    /// Softmax temperature, >= 0.
    pub fn temperature(mut self, temperature: f32) -> Self {
        self.sampling().temperature = Some(temperature);
        self
    }

    /// Nucleus sampling threshold, in (0, 1].
    pub fn top_p(mut self, top_p: f32) -> Self {
        self.sampling().top_p = Some(top_p);
        self
    }

    /// Keep only the `top_k` most likely tokens (0 = off).
    pub fn top_k(mut self, top_k: u32) -> Self {
        self.sampling().top_k = Some(top_k);
        self
    }

    /// Seed of the request's random generator.
    pub fn seed(mut self, seed: u64) -> Self {
        self.sampling().seed = Some(seed);
        self
    }

    /// Number of completions, 1 to 16.
    pub fn n(mut self, n: u32) -> Self {
        self.sampling().n = Some(n);
        self
    }

    /// Return each sampled token's logprob with this many alternatives (0 to 20).
    pub fn logprobs(mut self, top: u32) -> Self {
        self.output().logprobs = Some(top);
        self
    }

    /// For text prompts: whether the server adds special tokens such as BOS (default true).
    pub fn add_special_tokens(mut self, add: bool) -> Self {
        self.request.add_special_tokens = Some(add);
        self
    }

    /// The prefix cache's namespace for this request: requests with different salts never share cached KV
    /// blocks, so one tenant cannot learn from its time to first token whether another sent the same prompt.
    /// Use a secret salt per tenant; `""` is the shared namespace (the default). At most 256 characters.
    pub fn cache_salt(mut self, salt: impl Into<String>) -> Self {
        self.request.cache_salt = salt.into();
        self
    }

    /// Scheduling priority: a lower value is served first, equal priorities first come, first served
    /// (default 0). It never changes the generated tokens.
    pub fn priority(mut self, priority: i32) -> Self {
        self.request.priority = priority;
        self
    }

    /// Generates with a loaded LoRA adapter (its name); `""` is the base model (the default). An unknown
    /// name is INVALID_ARGUMENT naming `adapter`.
    pub fn adapter(mut self, name: impl Into<String>) -> Self {
        self.request.adapter = name.into();
        self
    }

    /// Constrains every completion to a language (see [structured output](crate::request#structured-output));
    /// the shortcuts below set each kind. Replaces any constraint set before.
    pub fn structured_output(mut self, kind: structured_output::Kind) -> Self {
        self.request.structured_output = Some(StructuredOutput { kind: Some(kind) });
        self
    }

    /// JSON matching a JSON Schema (draft 2020-12) given as JSON text, for example a `serde_json::Value`'s
    /// `to_string()`. See `generate.proto` for the keywords the server enforces; the output is compact JSON.
    pub fn json_schema(self, schema: impl Into<String>) -> Self {
        self.structured_output(structured_output::Kind::JsonSchema(schema.into()))
    }

    /// Any JSON object.
    pub fn json_object(self) -> Self {
        self.structured_output(structured_output::Kind::JsonObject(JsonObject {}))
    }

    /// Text that matches `pattern` as a whole (Rust regex syntax, anchored at both ends; no lookaround or
    /// backreferences).
    pub fn regex(self, pattern: impl Into<String>) -> Self {
        self.structured_output(structured_output::Kind::Regex(pattern.into()))
    }

    /// Text in a context-free grammar in Lark syntax, as the llguidance library reads it (`start` is the
    /// start rule).
    pub fn grammar(self, lark: impl Into<String>) -> Self {
        self.structured_output(structured_output::Kind::Grammar(lark.into()))
    }

    /// Exactly one of `choices` (at least one, each non-empty).
    pub fn choice<S: Into<String>>(self, choices: impl IntoIterator<Item = S>) -> Self {
        let choices = choices.into_iter().map(Into::into).collect();
        self.structured_output(structured_output::Kind::Choice(Choice { choices }))
    }

    /// Free text in which tool calls are constrained: the text is free until it contains one of `triggers`;
    /// from there it continues with the `begin` of a tag that starts with that trigger, JSON matching the
    /// tag's schema, and the tag's `end`; then it is free again. Build the tags with [`tag`].
    pub fn structural_tag<S: Into<String>>(
        self,
        tags: impl IntoIterator<Item = StructuralTagItem>,
        triggers: impl IntoIterator<Item = S>,
    ) -> Self {
        let tags = tags.into_iter().collect();
        let triggers = triggers.into_iter().map(Into::into).collect();
        self.structured_output(structured_output::Kind::StructuralTag(StructuralTag { tags, triggers }))
    }

    /// The finished request.
    pub fn build(self) -> GenerateRequest {
        self.request
    }
}

impl From<GenerateRequestBuilder> for GenerateRequest {
    fn from(builder: GenerateRequestBuilder) -> Self {
        builder.build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_sets_only_what_was_asked() {
        let req = token_ids([1, 2, 3]).request_id("a").n(2).seed(7).stop(["\n"]).logprobs(0).build();
        assert_eq!(req.request_id, "a");
        assert_eq!(req.input, Some(generate_request::Input::TokenIds(TokenIds { ids: vec![1, 2, 3] })));
        let sampling = req.sampling.unwrap();
        assert_eq!((sampling.n, sampling.seed, sampling.temperature), (Some(2), Some(7), None));
        assert_eq!(req.stopping.unwrap().stop, ["\n"]);
        assert_eq!(req.output.unwrap().logprobs, Some(0));
        assert!(!req.stream);
    }

    #[test]
    fn each_constraint_sets_its_kind_and_nothing_else() {
        use structured_output::Kind;
        let kind = |builder: GenerateRequestBuilder| {
            let req = builder.build();
            assert_eq!((req.sampling, req.stopping, req.output), (None, None, None));
            req.structured_output.expect("structured_output set").kind.expect("kind set")
        };
        assert_eq!(kind(text("x").json_schema("{}")), Kind::JsonSchema("{}".into()));
        assert_eq!(kind(text("x").json_object()), Kind::JsonObject(JsonObject {}));
        assert_eq!(kind(text("x").regex("a+")), Kind::Regex("a+".into()));
        assert_eq!(kind(text("x").grammar("start: \"a\"")), Kind::Grammar("start: \"a\"".into()));
        assert_eq!(
            kind(text("x").choice(["a", "b"])),
            Kind::Choice(Choice { choices: vec!["a".into(), "b".into()] })
        );
        let tags = [tag("<f=a>", "{}", "</f>"), tag("<f=b>", "", "")];
        assert_eq!(
            kind(text("x").structural_tag(tags.clone(), ["<f="])),
            Kind::StructuralTag(StructuralTag { tags: tags.to_vec(), triggers: vec!["<f=".into()] })
        );
        assert_eq!(text("x").build().structured_output, None);
        // one constraint per request: the last one wins
        assert_eq!(
            kind(text("x").regex("a").choice(["b"])),
            Kind::Choice(Choice { choices: vec!["b".into()] })
        );
    }

    #[test]
    fn cache_salt_and_priority_are_top_level_fields() {
        let req = text("x").cache_salt("tenant-a").priority(-3).build();
        assert_eq!((req.cache_salt.as_str(), req.priority), ("tenant-a", -3));
        assert_eq!((req.sampling, req.stopping, req.output), (None, None, None));
        let unset = text("x").build();
        assert_eq!((unset.cache_salt.as_str(), unset.priority), ("", 0));
    }

    #[test]
    fn adapter_is_a_top_level_field() {
        let req = text("x").adapter("sql").build();
        assert_eq!(req.adapter, "sql");
        assert_eq!((req.sampling, req.stopping, req.output), (None, None, None));
        assert_eq!(text("x").build().adapter, "");
    }

    #[test]
    fn chat_and_text_inputs() {
        let req = chat([("user", "hi")]).build();
        let Some(generate_request::Input::Chat(chat)) = req.input else { panic!("not chat") };
        assert_eq!(chat.messages[0].role, "user");
        assert_eq!(text("x").greedy().build().sampling.unwrap().temperature, Some(0.0));
    }
}
