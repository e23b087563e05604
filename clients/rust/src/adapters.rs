//! LoRA adapters' admin calls: the admin key a server started with `--admin-key` requires on them.

use tonic::metadata::{Ascii, MetadataValue};
use tonic::IntoRequest;

use crate::error::{Error, Result};

/// The metadata key that carries the server's adapter admin key.
pub const ADMIN_KEY_METADATA: &str = "x-admin-key";

/// `message` (a `LoadAdapterRequest`, `UnloadAdapterRequest` or `ListAdaptersRequest`) as a request carrying
/// the admin key, for [`Client::load_adapter`](crate::Client::load_adapter) and the other admin calls. Only
/// the requests built with it carry the key. An admin key that is not printable ASCII is `InvalidConfig`.
pub fn with_admin_key<T>(message: impl IntoRequest<T>, key: &str) -> Result<tonic::Request<T>> {
    let value: MetadataValue<Ascii> =
        key.parse().map_err(|_| Error::InvalidConfig("the admin key must be printable ASCII".to_owned()))?;
    let mut request = message.into_request();
    request.metadata_mut().insert(ADMIN_KEY_METADATA, value);
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_proto::engine::v1::ListAdaptersRequest;

    #[test]
    fn the_admin_key_travels_as_metadata() {
        let request = with_admin_key(ListAdaptersRequest {}, "adm").unwrap();
        assert_eq!(request.metadata().get(ADMIN_KEY_METADATA).unwrap(), "adm");
        assert!(with_admin_key(ListAdaptersRequest {}, "bad\nkey").is_err());
    }
}
