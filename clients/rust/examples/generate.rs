//! Streams a greedy completion of a prompt and prints it as it arrives.
//!
//! ```text
//! cargo run --example generate -- 127.0.0.1:50051 "Once upon a time"
//! ENGINE_API_KEY=secret cargo run --example generate -- 127.0.0.1:50051 "Hello"
//! ```

use std::io::Write;

use engine_client::{request, Client, StreamExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let target = args.next().unwrap_or_else(|| "127.0.0.1:50051".to_owned());
    let prompt = args.next().unwrap_or_else(|| "Once upon a time".to_owned());

    let mut builder = Client::builder(target);
    if let Ok(api_key) = std::env::var("ENGINE_API_KEY") {
        builder = builder.api_key(api_key);
    }
    let client = builder.connect().await?;
    let model = client.model_info().await?;
    eprintln!("model: {} ({})", model.served_model_name, model.architecture);

    let req = request::text(prompt).max_tokens(32).greedy().stream(true).build();
    let mut stream = client.generate(req).await?;
    let mut stdout = std::io::stdout();
    while let Some(response) = stream.next().await {
        let response = response?;
        for chunk in &response.completions {
            write!(stdout, "{}", chunk.text)?;
            if chunk.finish_reason() != engine_client::proto::FinishReason::Unspecified {
                writeln!(stdout)?;
                eprintln!("finish: {:?}", chunk.finish_reason());
            }
        }
        stdout.flush()?;
        if let Some(usage) = response.usage {
            eprintln!(
                "usage: {} prompt + {} completion tokens",
                usage.prompt_tokens, usage.completion_tokens
            );
        }
    }
    Ok(())
}
