"""Per-tenant certificate authorities for host-side credential injection.

When a tenant has secrets marked for injection, its batches' proxy
terminates TLS: the sandbox trusts only that tenant's CA (its certificate is
put in the sandbox's egress dir and named by SSL_CERT_FILE), the proxy
presents a certificate for the requested host signed by it, swaps the
placeholder for the real secret on requests to the hosts the secret is meant
for, and opens its own verified TLS connection upstream. Keys stay on the
host, under the data dir (0700), one CA per tenant, so a tenant's CA can
never be used to intercept another tenant's traffic.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_DAYS = 3650
LEAF_DAYS = 7


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common[:64]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tenantq egress")])


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


class TenantCA:
    """One tenant's CA: created once under `<base>/<tenant hex>/`, then reused."""

    def __init__(self, base: Path, tenant: str) -> None:
        self.dir = base / tenant.encode().hex()
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(base, 0o700)
        self.tenant = tenant
        key_path, cert_path = self.dir / "ca.key", self.dir / "ca.pem"
        if not (key_path.exists() and cert_path.exists()):
            self._create(key_path, cert_path, tenant)
        self.key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        self.cert_pem = cert_path.read_bytes()
        self.cert = x509.load_pem_x509_certificate(self.cert_pem)
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _create(key_path: Path, cert_path: Path, tenant: str) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(f"tenantq egress CA {tenant}"))
                .issuer_name(_name(f"tenantq egress CA {tenant}")).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(hours=1))
                .not_valid_after(now + dt.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_private(key_path, key.private_bytes(serialization.Encoding.PEM,
                                                   serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for `host`."""
        with self._lock:
            ctx = self._contexts.get(host)
            if ctx is None:
                ctx = self._contexts[host] = self._leaf(host)
            return ctx

    def _leaf(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        assert isinstance(self.key, ec.EllipticCurvePrivateKey)
        cert = (x509.CertificateBuilder().subject_name(_name(host)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(hours=1))
                .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        # ssl loads chains from files only: a private file per host
        path = self.dir / f"leaf-{hashlib.sha256(host.encode()).hexdigest()[:16]}.pem"
        _write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption())
                       + cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(path)
        return ctx


class CAStore:
    """The tenants' CAs of one dispatcher (created on first use)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._cas: dict[str, TenantCA] = {}
        self._lock = threading.Lock()

    def for_tenant(self, tenant: str) -> TenantCA:
        with self._lock:
            ca = self._cas.get(tenant)
            if ca is None:
                ca = self._cas[tenant] = TenantCA(self.base, tenant)
            return ca


def upstream_context(extra_ca: str | None = None) -> ssl.SSLContext:
    """How the proxy verifies the real servers: the system's CAs (plus one
    more file, for a private or test CA)."""
    ctx = ssl.create_default_context()
    if extra_ca:
        ctx.load_verify_locations(extra_ca)
    return ctx
