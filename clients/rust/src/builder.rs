//! Connection settings: endpoint, TLS, API key, timeouts, keepalive and message sizes.

use std::fmt;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::auth::ApiKeyInterceptor;
use crate::client::Client;
use crate::error::{Error, Result};

/// Default largest message accepted from or sent to the server: generous for long prompts and big embedding
/// batches (tonic's own default of 4 MiB is too small for 256 inputs of 1024-float vectors).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 * 1024 * 1024;

/// TLS settings: the CA that signed the server's certificate and, for mutual TLS, the client's identity.
///
/// Converts into tonic's [`ClientTlsConfig`]; pass a [`ClientTlsConfig`] to [`ClientBuilder::tls`] directly for
/// anything this type does not cover.
#[derive(Clone, Default)]
pub struct TlsConfig {
    ca_certificates_pem: Vec<Vec<u8>>,
    identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    domain_name: Option<String>,
}

impl TlsConfig {
    /// Settings that trust nothing yet: add at least one CA with [`TlsConfig::ca_certificate_pem`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts server certificates signed by this PEM-encoded CA certificate (may be called more than once).
    pub fn ca_certificate_pem(mut self, pem: impl AsRef<[u8]>) -> Self {
        self.ca_certificates_pem.push(pem.as_ref().to_vec());
        self
    }

    /// Presents this PEM certificate chain and private key to the server (mutual TLS).
    pub fn client_identity_pem(mut self, cert_pem: impl AsRef<[u8]>, key_pem: impl AsRef<[u8]>) -> Self {
        self.identity_pem = Some((cert_pem.as_ref().to_vec(), key_pem.as_ref().to_vec()));
        self
    }

    /// Verifies the server certificate against this name instead of the endpoint's host.
    pub fn domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain_name = Some(name.into());
        self
    }
}

// NOTE: hand-written so that the private key never reaches a log.
impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("num_ca_certificates", &self.ca_certificates_pem.len())
            .field("has_client_identity", &self.identity_pem.is_some())
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

impl From<TlsConfig> for ClientTlsConfig {
    fn from(config: TlsConfig) -> Self {
        let mut tls = ClientTlsConfig::new()
            .ca_certificates(config.ca_certificates_pem.into_iter().map(Certificate::from_pem));
        if let Some((cert, key)) = config.identity_pem {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        if let Some(name) = config.domain_name {
            tls = tls.domain_name(name);
        }
        tls
    }
}

/// HTTP/2 keepalive: a PING every `interval`, the connection is closed when no answer comes within `timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Time between pings.
    pub interval: Duration,
    /// How long to wait for the ping's answer.
    pub timeout: Duration,
    /// Also ping while no call is in flight (keeps idle router connections warm).
    pub while_idle: bool,
}

/// Builds a [`Client`]; start with [`Client::builder`].
///
/// ```no_run
/// # async fn run() -> engine_client::Result<()> {
/// use std::time::Duration;
/// use engine_client::{Client, TlsConfig};
///
/// let client = Client::builder("engine.internal:50051")
///     .tls(TlsConfig::new().ca_certificate_pem(std::fs::read("ca.pem").unwrap()))
///     .api_key("secret")
///     .timeout(Duration::from_secs(10))
///     .connect_timeout(Duration::from_secs(3))
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClientBuilder {
    target: String,
    tls: Option<ClientTlsConfig>,
    api_key: Option<String>,
    timeout: Option<Duration>,
    connect_timeout: Option<Duration>,
    keepalive: Option<Keepalive>,
    max_message_size: usize,
    user_agent: Option<String>,
}

impl ClientBuilder {
    pub(crate) fn new(target: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            tls: None,
            api_key: None,
            timeout: None,
            connect_timeout: None,
            keepalive: None,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            user_agent: None,
        }
    }

    /// Connects over TLS (a [`TlsConfig`] or tonic's [`ClientTlsConfig`]). A target without a scheme then
    /// gets `https://`.
    pub fn tls(mut self, tls: impl Into<ClientTlsConfig>) -> Self {
        self.tls = Some(tls.into());
        self
    }

    /// Sends `authorization: Bearer <api_key>` with every call.
    pub fn api_key(mut self, api_key: impl Into<String>) -> Self {
        self.api_key = Some(api_key.into());
        self
    }

    /// Deadline of each unary call, sent to the server as `grpc-timeout` (it aborts the work when it passes).
    /// Not applied to Generate streams, whose length depends on the output: give a Generate call its own
    /// deadline with [`tonic::Request::set_timeout`]. Default: none.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Limit on establishing the connection (TCP and TLS). Default: none.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// HTTP/2 keepalive pings. Default: off.
    pub fn keepalive(mut self, keepalive: Keepalive) -> Self {
        self.keepalive = Some(keepalive);
        self
    }

    /// Largest message sent or accepted, in bytes. Default: [`DEFAULT_MAX_MESSAGE_SIZE`].
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Replaces the `user-agent` prefix (default `engine-rust/VERSION`; tonic appends its own).
    pub fn user_agent(mut self, user_agent: impl Into<String>) -> Self {
        self.user_agent = Some(user_agent.into());
        self
    }

    /// Connects now; fails with [`Error::Transport`] when the server cannot be reached.
    pub async fn connect(self) -> Result<Client> {
        let (endpoint, settings) = self.into_parts()?;
        let channel = endpoint.connect().await?;
        Ok(Client::from_parts(channel, settings))
    }

    /// Returns a client at once and connects on the first call (and reconnects after failures). Useful when the
    /// server may start after the client.
    pub fn connect_lazy(self) -> Result<Client> {
        let (endpoint, settings) = self.into_parts()?;
        Ok(Client::from_parts(endpoint.connect_lazy(), settings))
    }

    fn into_parts(self) -> Result<(Endpoint, Settings)> {
        let uri = target_uri(&self.target, self.tls.is_some())?;
        let mut endpoint = Endpoint::from_shared(uri)
            .map_err(|e| Error::InvalidConfig(format!("endpoint {:?}: {e}", self.target)))?;
        if let Some(tls) = self.tls {
            endpoint = endpoint.tls_config(tls).map_err(|e| Error::InvalidConfig(format!("tls: {e}")))?;
        }
        if let Some(timeout) = self.connect_timeout {
            endpoint = endpoint.connect_timeout(timeout);
        }
        if let Some(keepalive) = self.keepalive {
            endpoint = endpoint
                .http2_keep_alive_interval(keepalive.interval)
                .keep_alive_timeout(keepalive.timeout)
                .keep_alive_while_idle(keepalive.while_idle);
        }
        let user_agent = self.user_agent.unwrap_or_else(|| format!("engine-rust/{}", crate::VERSION));
        endpoint =
            endpoint.user_agent(user_agent).map_err(|e| Error::InvalidConfig(format!("user agent: {e}")))?;
        let settings = Settings {
            interceptor: ApiKeyInterceptor::new(self.api_key.as_deref())?,
            timeout: self.timeout,
            max_message_size: self.max_message_size,
        };
        Ok((endpoint, settings))
    }
}

// NOTE: hand-written so that neither the API key nor a TLS private key (tonic's `Identity` prints its bytes)
// reaches a log.
impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("target", &self.target)
            .field("has_tls", &self.tls.is_some())
            .field("has_api_key", &self.api_key.is_some())
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("keepalive", &self.keepalive)
            .field("max_message_size", &self.max_message_size)
            .field("user_agent", &self.user_agent)
            .finish()
    }
}

/// What the client applies per call once connected.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub(crate) interceptor: ApiKeyInterceptor,
    pub(crate) timeout: Option<Duration>,
    pub(crate) max_message_size: usize,
}

/// Adds the scheme a bare `host:port` target needs and refuses plaintext/TLS mismatches, which would otherwise
/// fail later with an obscure transport error.
fn target_uri(target: &str, has_tls: bool) -> Result<String> {
    match target.split_once("://") {
        None if has_tls => Ok(format!("https://{target}")),
        None => Ok(format!("http://{target}")),
        Some(("https", _)) if !has_tls => Err(Error::InvalidConfig(format!(
            "{target:?} is https but no TLS settings were given: call .tls(...)"
        ))),
        Some(("http", _)) if has_tls => Err(Error::InvalidConfig(format!(
            "{target:?} is plaintext http but TLS settings were given: use https:// or a bare host:port"
        ))),
        Some(("http" | "https", _)) => Ok(target.to_owned()),
        Some((scheme, _)) => {
            Err(Error::InvalidConfig(format!("unsupported scheme {scheme:?} in {target:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_targets_get_the_scheme_of_their_security() {
        assert_eq!(target_uri("127.0.0.1:1", false).unwrap(), "http://127.0.0.1:1");
        assert_eq!(target_uri("localhost:1", true).unwrap(), "https://localhost:1");
        assert_eq!(target_uri("http://h:1", false).unwrap(), "http://h:1");
        assert_eq!(target_uri("https://h:1", true).unwrap(), "https://h:1");
    }

    #[test]
    fn mismatched_or_unknown_schemes_are_config_errors() {
        for (target, tls) in [("https://h:1", false), ("http://h:1", true), ("unix:///tmp/s", false)] {
            let err = target_uri(target, tls).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(_)), "{target} {tls}: {err}");
        }
    }

    #[test]
    fn debug_output_hides_secrets() {
        let tls = TlsConfig::new().client_identity_pem("CERT", "SECRET-KEY");
        let builder = ClientBuilder::new("h:1").api_key("SECRET-API-KEY").tls(tls.clone());
        for text in [format!("{tls:?}"), format!("{builder:?}")] {
            assert!(!text.contains("SECRET"), "{text}");
        }
    }

    #[test]
    fn invalid_endpoint_fails_before_connecting() {
        let err = ClientBuilder::new("bad host:1").connect_lazy().unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    }
}
