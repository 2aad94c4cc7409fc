"""A private CA and certificates for TLS and mutual TLS between roles.

`hio certs --out DIR --names master,repository,worker,gateway,kd --hosts
master.example.org,10.0.0.5` writes ``ca.pem``, ``ca-key.pem`` and, per name,
``<name>.pem`` / ``<name>-key.pem`` usable both as server and client
certificates (so the same pair serves mutual TLS). Keys are ECDSA P-256;
private keys are written with mode 0600.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from hio.config import ConfigError, setting
from hio.storage.files import atomic_write


@dataclasses.dataclass(frozen=True)
class CertsConfig:
    out: str = setting("./certs", "folder to write the CA and certificates to")
    names: tuple[str, ...] = setting(
        None, "one certificate per name", factory=lambda: ("master", "repository", "worker", "gateway", "kd")
    )
    hosts: tuple[str, ...] = setting(
        None, "DNS names and IP addresses every certificate is valid for", factory=lambda: ("localhost", "127.0.0.1")
    )
    days: int = setting(825, "validity in days")
    log_level: str = setting("warning", "log level")
    log_json: bool = setting(False, "log as JSON")

    def validate(self) -> None:
        if not self.names:
            raise ConfigError("names: give at least one")
        if self.days < 1:
            raise ConfigError("days must be positive")


def generate(out: Path, names: tuple[str, ...], hosts: tuple[str, ...], days: int = 825) -> dict[str, Path]:
    """Write a CA and one certificate per name; returns the paths written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    paths: dict[str, Path] = {}

    def certificate(name: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
        )

    def save(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        """``<name>.pem`` and ``<name>-key.pem`` (the key readable by its owner only)."""
        paths[name], paths[f"{name}-key"] = out / f"{name}.pem", out / f"{name}-key.pem"
        atomic_write(paths[name], cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        atomic_write(paths[f"{name}-key"], key_pem, mode=0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "HarmonicIO CA")])
    ca = (
        certificate(ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    save("ca", ca, ca_key)
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        save(name, cert, key)
    return paths


def run_certs(config: CertsConfig) -> int:
    paths = generate(Path(config.out), config.names, config.hosts, config.days)
    print(f"wrote a CA and {len(config.names)} certificates to {config.out}:")
    for name in config.names:
        print(f"  {name}: --tls-cert {paths[name]} --tls-key {paths[name + '-key']} --tls-ca {paths['ca']}")
    print("servers add --tls-client-auth for mutual TLS; keep ca-key.pem offline")
    return 0
