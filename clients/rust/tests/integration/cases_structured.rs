//! Structured output on the tiny random-weight model: left alone it writes noise; constrained, every completion
//! must be in the language (JSON valid against the schema, one of the choices, a regex match), and a
//! constraint the server cannot compile is INVALID_ARGUMENT naming the field.

use std::sync::Arc;

use engine_client::proto::FinishReason;
use engine_client::request;
use engine_client::tonic::Code;

use crate::support::{assert_json_valid, connect, generate_error};
use crate::{Ctx, Srv};

/// Bounded: a completion closes within [`MAX_TOKENS`] (a few tokens of keys, one enum value, one digit), so
/// finish reason LENGTH would mean the constraint was not applied.
const SCHEMA: &str = r#"{"type":"object","properties":{"answer":{"type":"string","enum":["yes","no"]},"n":{"type":"integer","minimum":0,"maximum":9}},"required":["answer","n"],"additionalProperties":false}"#;
const MAX_TOKENS: u32 = 64;
const PROMPT: &str = "Answer in JSON:";

pub async fn json_schema_output_validates(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    // Streamed, three seeded samples: each completion is constrained on its own.
    let sampled = request::text(PROMPT).max_tokens(MAX_TOKENS).n(3).seed(7).stream(true).json_schema(SCHEMA);
    let completion = client.complete(sampled.build()).await.unwrap();
    assert_eq!(completion.outputs.len(), 3);
    for output in &completion.outputs {
        assert_eq!(
            output.finish_reason,
            FinishReason::Stop,
            "completion {}: {:?}",
            output.index,
            output.text
        );
        assert_json_valid(&output.text, SCHEMA);
    }

    // Greedy, one message; the same schema with whitespace is the same constraint.
    let greedy = client
        .complete(request::text(PROMPT).max_tokens(MAX_TOKENS).greedy().json_schema(SCHEMA).build())
        .await
        .unwrap();
    assert_eq!(greedy.outputs[0].finish_reason, FinishReason::Stop);
    assert_json_valid(&greedy.outputs[0].text, SCHEMA);
    let spaced = SCHEMA.replace(',', ",\n  ").replace(':', ": ");
    let again = client
        .complete(request::text(PROMPT).max_tokens(MAX_TOKENS).greedy().json_schema(spaced).build())
        .await;
    assert_eq!(again.unwrap().outputs[0].token_ids, greedy.outputs[0].token_ids);
}

pub async fn choice_regex_and_grammar(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let colors = ["red", "green", "blue"];
    let sampled = || request::text("Pick one:").max_tokens(MAX_TOKENS).n(4).seed(1);

    let chosen = client.complete(sampled().choice(colors).build()).await.unwrap();
    let by_regex = client.complete(sampled().regex("[0-9]{3}-[a-z]{2}").build()).await.unwrap();
    let by_grammar = client
        .complete(sampled().grammar("start: \"id=\" NUM \";\"\nNUM: /[1-9][0-9]?/\n").build())
        .await
        .unwrap();
    for output in chosen.outputs.iter().chain(&by_regex.outputs).chain(&by_grammar.outputs) {
        assert_eq!(output.finish_reason, FinishReason::Stop, "{:?}", output.text);
    }
    for output in &chosen.outputs {
        assert!(colors.contains(&output.text.as_str()), "not a choice: {:?}", output.text);
    }
    for output in &by_regex.outputs {
        let bytes = output.text.as_bytes();
        let shape = bytes.len() == 6
            && bytes[..3].iter().all(u8::is_ascii_digit)
            && bytes[3] == b'-'
            && bytes[4..].iter().all(u8::is_ascii_lowercase);
        assert!(shape, "does not match [0-9]{{3}}-[a-z]{{2}}: {:?}", output.text);
    }
    for output in &by_grammar.outputs {
        let number = output.text.strip_prefix("id=").and_then(|rest| rest.strip_suffix(';'));
        let number: u32 = number.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{:?}", output.text));
        assert!((1..100).contains(&number) && !output.text.starts_with("id=0"), "{:?}", output.text);
    }
}

pub async fn invalid_constraint_names_the_field(ctx: Arc<Ctx>) {
    let client = connect(ctx.target(Srv::Plain)).await;
    let base = || request::text(PROMPT).max_tokens(8);
    let cases = [
        (base().regex("(a"), "structured_output.regex"),
        (base().json_schema("{bad"), "structured_output.json_schema"),
        (base().json_schema(r#"{"type":"array","uniqueItems":true}"#), "structured_output.json_schema"),
        (base().choice(Vec::<String>::new()), "structured_output.choice"),
        (
            base().structural_tag([request::tag("<f>", "", "")], ["<call"]),
            "structured_output.structural_tag.tags[0].begin",
        ),
    ];
    for (builder, field) in cases {
        let err = generate_error(&client, builder.build()).await;
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        let message = err.status().expect("a server status").message().to_owned();
        assert!(message.starts_with(&format!("{field}:")), "{message:?} does not name {field}");
    }
}
