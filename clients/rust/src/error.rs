//! The one error type of the SDK.

use tonic::Code;

/// Everything a call of this crate can fail with.
///
/// Server-side failures keep their gRPC status: match on [`Error::code`] (for example
/// [`Code::InvalidArgument`] for a bad request, [`Code::Unauthenticated`] for a missing API key,
/// [`Code::Unavailable`] while the server is starting or draining).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server (or tonic on its behalf) answered with a non-OK gRPC status.
    #[error("rpc failed: {}: {}{}", .0.code(), .0.message(), causes(.0))]
    Status(tonic::Status),
    /// The connection could not be established (DNS, TCP, TLS handshake, HTTP/2 setup).
    #[error("connection failed{}", causes(.0))]
    Transport(#[from] tonic::transport::Error),
    /// The client configuration is invalid (bad endpoint URI, unusable API key, bad TLS material).
    #[error("invalid client configuration: {0}")]
    InvalidConfig(String),
    /// The server broke the contract (for example a Generate stream that ended without a finish reason).
    #[error("protocol violation: {0}")]
    Protocol(String),
}

impl Error {
    /// The gRPC status code that best describes this error.
    ///
    /// A [`Error::Status`] returns the server's code; a connection failure is [`Code::Unavailable`] (as tonic
    /// reports it on calls over a broken channel), invalid configuration is [`Code::InvalidArgument`] and a
    /// contract violation is [`Code::Internal`].
    pub fn code(&self) -> Code {
        match self {
            Error::Status(status) => status.code(),
            Error::Transport(_) => Code::Unavailable,
            Error::InvalidConfig(_) => Code::InvalidArgument,
            Error::Protocol(_) => Code::Internal,
        }
    }

    /// The gRPC status, when the error came from one.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            Error::Status(status) => Some(status),
            _ => None,
        }
    }

    /// Whether a retry on another connection or replica may succeed. True for UNAVAILABLE and
    /// RESOURCE_EXHAUSTED (the contract says both are safe to retry, except for a Generate that already
    /// streamed output) and for connection failures.
    pub fn is_retryable(&self) -> bool {
        matches!(self.code(), Code::Unavailable | Code::ResourceExhausted)
    }
}

/// The error's sources, as `: a: b`. tonic's transport errors say only "transport error" themselves; the
/// cause (certificate rejected, connection refused, ...) is in the chain.
fn causes(err: &dyn std::error::Error) -> String {
    let mut text = String::new();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // NOTE: wrappers often repeat their source's message; print each distinct message once.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Self {
        // NOTE: tonic reports its own client-side deadline (grpc-timeout reached before the response headers) as
        // CANCELLED "Timeout expired"; gRPC says DEADLINE_EXCEEDED, which is also what the server sends when the
        // deadline passes later. One code for one cause.
        if status.code() == Code::Cancelled && status.message() == tonic::TimeoutExpired(()).to_string() {
            return Error::Status(tonic::Status::deadline_exceeded(status.message()));
        }
        // NOTE: a call that never reached the server because its connection was going away (a GOAWAY, as a
        // draining server sends, arrived while another stream kept the connection open) is a connection failure:
        // UNAVAILABLE, and safe to retry (tonic reconnects for the next call). It comes back two ways: dropped
        // unsent by hyper, as CANCELLED with the transport error as source; or refused by h2 itself (the GOAWAY
        // with NO_ERROR was in before the stream went out), as INTERNAL with h2's error behind it.
        let dropped_by_hyper = status.code() == Code::Cancelled
            && std::error::Error::source(&status)
                .is_some_and(|source| source.is::<tonic::transport::Error>());
        if dropped_by_hyper || refused_after_goaway(&status) {
            // The new status cannot carry the source along: its messages go into the text instead.
            return Error::Status(tonic::Status::unavailable(format!(
                "{}{}",
                status.message(),
                causes(&status)
            )));
        }
        Error::Status(status)
    }
}

/// Whether `status` stands for a stream h2 did not open because the server's GOAWAY (NO_ERROR) had arrived.
fn refused_after_goaway(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if let Some(h2_err) = err.downcast_ref::<h2::Error>() {
            return h2_err.is_go_away()
                && h2_err.is_remote()
                && h2_err.reason() == Some(h2::Reason::NO_ERROR);
        }
        source = err.source();
    }
    false
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_side_timeout_is_deadline_exceeded() {
        let err = Error::from(tonic::Status::cancelled(tonic::TimeoutExpired(()).to_string()));
        assert_eq!(err.code(), Code::DeadlineExceeded);
        assert_eq!(Error::from(tonic::Status::cancelled("by peer")).code(), Code::Cancelled);
        assert!(Error::from(tonic::Status::unavailable("draining")).is_retryable());
    }

    #[test]
    fn call_dropped_by_the_transport_is_unavailable() {
        let transport = tonic::transport::Endpoint::from_shared("not a uri").expect_err("a bad uri");
        let mut status = tonic::Status::cancelled("operation was canceled");
        status.set_source(std::sync::Arc::new(transport));
        let err = Error::from(status);
        assert_eq!(err.code(), Code::Unavailable);
        assert!(err.is_retryable());
        assert!(err.to_string().contains("invalid URI"), "the cause is kept in the message: {err}");
        // A CANCELLED the server sent has no transport error behind it and stays what it is.
        assert_eq!(Error::from(tonic::Status::cancelled("by peer")).code(), Code::Cancelled);
    }

    #[test]
    fn only_a_goaway_refusal_turns_an_h2_error_into_unavailable() {
        // (h2 makes its GOAWAY errors itself: tests/integration's drain case meets one.) Any other h2 error,
        // a reset or a protocol error, stays what tonic made of it.
        for reason in [h2::Reason::NO_ERROR, h2::Reason::PROTOCOL_ERROR, h2::Reason::CANCEL] {
            let mut status = tonic::Status::internal("h2 protocol error");
            status.set_source(std::sync::Arc::new(h2::Error::from(reason)));
            assert_eq!(Error::from(status).code(), Code::Internal, "{reason:?}");
        }
    }
}
