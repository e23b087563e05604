//! Throwaway PKI for the TLS cases: a CA, a server certificate for localhost/127.0.0.1 and a client
//! certificate, all signed by that CA, plus an unrelated CA for the negative cases.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// PEM texts of the test PKI, and the files the server reads.
pub struct Certs {
    pub ca_pem: String,
    pub other_ca_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
    pub server_cert_file: PathBuf,
    pub server_key_file: PathBuf,
    pub ca_file: PathBuf,
}

fn new_ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("self-sign CA");
    (cert.pem(), Issuer::new(params, key))
}

fn new_leaf(
    name: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
    issuer: &Issuer<'_, KeyPair>,
) -> (String, String) {
    let mut params =
        CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().expect("leaf key");
    let cert = params.signed_by(&key, issuer).expect("sign leaf");
    (cert.pem(), key.serialize_pem())
}

impl Certs {
    /// Generates everything and writes the server's files into `dir`.
    pub fn generate(dir: &Path) -> Certs {
        let (ca_pem, issuer) = new_ca("engine-client test CA");
        let (other_ca_pem, _) = new_ca("unrelated CA");
        let (server_cert_pem, server_key_pem) =
            new_leaf("localhost", &["localhost", "127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth, &issuer);
        let (client_cert_pem, client_key_pem) =
            new_leaf("engine-client test", &["client.test"], ExtendedKeyUsagePurpose::ClientAuth, &issuer);
        std::fs::create_dir_all(dir).expect("create cert dir");
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write cert file");
            path
        };
        Certs {
            server_cert_file: write("server.pem", &server_cert_pem),
            server_key_file: write("server.key", &server_key_pem),
            ca_file: write("ca.pem", &ca_pem),
            ca_pem,
            other_ca_pem,
            client_cert_pem,
            client_key_pem,
        }
    }
}
