//! The interceptor that adds the API key to every call.

use std::fmt;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::error::Error;

const AUTHORIZATION: &str = "authorization";

/// Adds `authorization: Bearer <key>` to each call, unless the caller already set that header on the request.
#[derive(Clone, Default)]
pub struct ApiKeyInterceptor {
    header: Option<MetadataValue<Ascii>>,
}

impl ApiKeyInterceptor {
    /// An interceptor for `api_key`, or one that adds nothing when `api_key` is `None`.
    pub(crate) fn new(api_key: Option<&str>) -> Result<Self, Error> {
        let header = match api_key {
            None => None,
            Some(key) => {
                // NOTE: HTTP header values may carry bytes >= 0x80, but the server compares ASCII tokens.
                if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(Error::InvalidConfig("api key must be non-empty visible ASCII".into()));
                }
                let mut value: MetadataValue<Ascii> = format!("Bearer {key}")
                    .parse()
                    .map_err(|_| Error::InvalidConfig("api key must be visible ASCII".into()))?;
                // NOTE: marks the value so that HTTP/2 HPACK never indexes it and Debug output hides it.
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(Self { header })
    }
}

impl Interceptor for ApiKeyInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(header) = &self.header {
            let metadata = request.metadata_mut();
            if !metadata.contains_key(AUTHORIZATION) {
                metadata.insert(AUTHORIZATION, header.clone());
            }
        }
        Ok(request)
    }
}

impl fmt::Debug for ApiKeyInterceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKeyInterceptor").field("has_api_key", &self.header.is_some()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_bearer_header_only_when_absent() {
        let mut interceptor = ApiKeyInterceptor::new(Some("k1")).unwrap();
        let request = interceptor.call(Request::new(())).unwrap();
        assert_eq!(request.metadata().get(AUTHORIZATION).unwrap(), "Bearer k1");

        let mut own = Request::new(());
        own.metadata_mut().insert(AUTHORIZATION, "Bearer mine".parse().unwrap());
        let request = interceptor.call(own).unwrap();
        assert_eq!(request.metadata().get(AUTHORIZATION).unwrap(), "Bearer mine");
    }

    #[test]
    fn no_key_adds_nothing() {
        let mut interceptor = ApiKeyInterceptor::new(None).unwrap();
        let request = interceptor.call(Request::new(())).unwrap();
        assert!(request.metadata().get(AUTHORIZATION).is_none());
    }

    #[test]
    fn rejects_unusable_keys_and_hides_them() {
        for bad in ["", " k", "k\n", "ключ"] {
            let err = ApiKeyInterceptor::new(Some(bad)).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(_)), "{bad:?}");
        }
        let debug = format!("{:?}", ApiKeyInterceptor::new(Some("secret")).unwrap());
        assert!(!debug.contains("secret"), "{debug}");
    }
}
