"""Per-tenant certificate authorities for host-side credential injection.

When a tenant has secrets marked for injection, its batches' proxy
terminates TLS: the sandbox trusts only that tenant's CA (its certificate is
put in the sandbox's egress dir and named by SSL_CERT_FILE), the proxy
presents a certificate for the requested host signed by it, writes the real
secret into its header on requests to the hosts the secret is meant for,
and opens its own verified TLS connection upstream. CA keys stay on the
host, under the data dir (0700), one CA per tenant, so a tenant's CA can
never be used to intercept another tenant's traffic.

Leaf certificates cost bounded memory and no disk (docs/security.md, rule
E3): one key per CA, made in memory when the CA is loaded; per host name a
certificate signed with it, loaded into an SSLContext through an anonymous
memory file (`memfd`: `ssl` loads chains from paths only), and kept in a
least-recently-used cache of LEAVES_PER_TENANT names per tenant and
LEAVES_IN_ALL over every tenant. Callers make them off the event loop.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import threading
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_DAYS = 3650
LEAF_DAYS = 7
LEAVES_PER_TENANT = 128
LEAVES_IN_ALL = 1024


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common[:64]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tenantq egress")])


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


class TenantCA:
    """One tenant's CA: created once under `<base>/<tenant hex>/`, then reused."""

    def __init__(self, base: Path, tenant: str, cache: LeafCache | None = None) -> None:
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
        # every leaf of this CA carries this key (never on disk)
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key_pem = self._leaf_key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption())
        self.cache = cache or LeafCache()

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
        """A TLS server context presenting a certificate for `host` (made
        now, or from the cache; off the event loop: it signs)."""
        ctx = self.cache.get(self.tenant, host)
        if ctx is None:
            ctx = self._leaf(host)
            self.cache.put(self.tenant, host, ctx)
        return ctx

    def _leaf(self, host: str) -> ssl.SSLContext:
        now = dt.datetime.now(dt.UTC)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        assert isinstance(self.key, ec.EllipticCurvePrivateKey)
        cert = (x509.CertificateBuilder().subject_name(_name(host)).issuer_name(self.cert.subject)
                .public_key(self._leaf_key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(hours=1))
                .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # an anonymous memory file: no path on any filesystem, gone on close
        fd = os.memfd_create("tenantq-leaf", os.MFD_CLOEXEC)
        try:
            os.write(fd, self._leaf_key_pem + cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return ctx


class LeafCache:
    """Leaf contexts by (tenant, host name), least recently used first out:
    at most `per_tenant` for one tenant, `in_all` for every tenant."""

    def __init__(self, per_tenant: int = LEAVES_PER_TENANT, in_all: int = LEAVES_IN_ALL) -> None:
        self.per_tenant, self.in_all = per_tenant, in_all
        self._contexts: OrderedDict[tuple[str, str], ssl.SSLContext] = OrderedDict()
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._contexts)

    def count(self, tenant: str) -> int:
        return self._counts.get(tenant, 0)

    def get(self, tenant: str, host: str) -> ssl.SSLContext | None:
        with self._lock:
            ctx = self._contexts.get((tenant, host))
            if ctx is not None:
                self._contexts.move_to_end((tenant, host))
            return ctx

    def put(self, tenant: str, host: str, ctx: ssl.SSLContext) -> None:
        with self._lock:
            if (tenant, host) in self._contexts:
                return
            self._contexts[(tenant, host)] = ctx
            self._counts[tenant] = self._counts.get(tenant, 0) + 1
            if self._counts[tenant] > self.per_tenant:
                self._drop(next(k for k in self._contexts if k[0] == tenant))
            while len(self._contexts) > self.in_all:
                self._drop(next(iter(self._contexts)))

    def _drop(self, key: tuple[str, str]) -> None:
        del self._contexts[key]
        self._counts[key[0]] -= 1
        if not self._counts[key[0]]:
            del self._counts[key[0]]


class CAStore:
    """The tenants' CAs of one dispatcher (created on first use)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.leaves = LeafCache()
        self._cas: dict[str, TenantCA] = {}
        self._lock = threading.Lock()

    def for_tenant(self, tenant: str) -> TenantCA:
        with self._lock:
            ca = self._cas.get(tenant)
            if ca is None:
                ca = self._cas[tenant] = TenantCA(self.base, tenant, self.leaves)
            return ca


def upstream_context(extra_ca: str | None = None) -> ssl.SSLContext:
    """How the proxy verifies the real servers: the system's CAs (plus one
    more file, for a private or test CA)."""
    ctx = ssl.create_default_context()
    if extra_ca:
        ctx.load_verify_locations(extra_ca)
    return ctx
