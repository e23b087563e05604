"""Throwaway X.509 material for the TLS tests: a CA, a server cert for 127.0.0.1/localhost, client certs."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_KeyAndCert = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


@dataclass(frozen=True, slots=True)
class CertFiles:
    ca: str  # trusted by clients (server CA) and by the server for mTLS
    server_cert: str
    server_key: str
    client_cert: str  # signed by `ca`
    client_key: str
    other_client_cert: str  # signed by an unrelated CA
    other_client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str,
    *,
    issuer: _KeyAndCert | None,
    is_ca: bool,
    usage: x509.ObjectIdentifier | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> _KeyAndCert:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_key, issuer_cert = issuer if issuer is not None else (key, None)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_cert.subject if issuer_cert is not None else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer_cert is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    if is_ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, pair: _KeyAndCert) -> tuple[str, str]:
    key, cert = pair
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def make_cert_files(directory: Path) -> CertFiles:
    ca = _issue("engine test CA", issuer=None, is_ca=True)
    other_ca = _issue("unrelated CA", issuer=None, is_ca=True)
    server = _issue(
        "localhost",
        issuer=ca,
        is_ca=False,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _issue("client", issuer=ca, is_ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other_client = _issue("intruder", issuer=other_ca, is_ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    ca_cert, _ = _write(directory, "ca", ca)
    server_cert, server_key = _write(directory, "server", server)
    client_cert, client_key = _write(directory, "client", client)
    other_cert, other_key = _write(directory, "other_client", other_client)
    return CertFiles(ca_cert, server_cert, server_key, client_cert, client_key, other_cert, other_key)


def reissue_server_cert(files: CertFiles, *, cert_path: str, key_path: str) -> int:
    """A new key and certificate for localhost from the same CA, written to the given paths; its serial."""
    ca_dir = Path(files.ca).parent
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(Path(files.ca).read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    pair = _issue(
        "localhost",
        issuer=(ca_key, ca_cert),
        is_ca=False,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    tmp = Path(cert_path).parent / "reissued"
    tmp.mkdir(exist_ok=True)
    new_cert, new_key = _write(tmp, "server", pair)
    Path(new_cert).replace(cert_path)  # NOTE: rename, as rotation tools do: the watcher sees a new inode
    Path(new_key).replace(key_path)
    return pair[1].serial_number
