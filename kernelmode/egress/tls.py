"""TLS for the egress proxy: the deployment's interception CA (made with ``cryptography``, kept in
``egress.ca_dir``, by default the data dir's ``egress/``), certificates minted from it per intercepted host, the upstream verification
context, the kernels' CA bundle, and the SNI of a tunnel's ClientHello (read by the stdlib's own
TLS parser, so no ClientHello is parsed by hand here).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import ssl
import tempfile
from pathlib import Path

import certifi
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .policy import ip_literal

CA_NAME = "kernelmode egress interception CA"
MAX_CLIENT_HELLO = 64 * 1024  # bytes read before the SNI must be known (a real one is ~0.5-2 KB)
CAKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey  # --make-ca makes EC; openssl's RSA works too


def ca_directory(ca_dir: Path | None, data_dir: Path) -> Path:
    """Where the deployment CA lives: ``egress.ca_dir``, else ``<data_dir>/egress``."""
    return ca_dir.expanduser().absolute() if ca_dir is not None else data_dir / "egress"


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write a file with ``mode``, atomically (a crash leaves the old one or none)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Certificates:
    """The deployment CA (``DIR/ca.pem``, key ``DIR/ca-key.pem`` 0600), created on first use, and
    one server context per intercepted host, minted on first use and kept for the process.
    Several processes may share DIR (proxy replicas, a manager): the first to find no CA makes
    it under a lock, the others load that one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._ca: tuple[x509.Certificate, CAKey] | None = None
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._contexts: dict[str, ssl.SSLContext] = {}

    @property
    def ca_pem_path(self) -> Path:
        return self.directory / "ca.pem"

    def ca(self) -> tuple[x509.Certificate, CAKey]:
        """The CA, loaded or made (OSError: the directory is unreadable or, to make one,
        unwritable; ValueError: its files are not a CA and its key)."""
        if self._ca is None:
            self._ca = self._load() or self._locked_create()
        return self._ca

    def ca_pem(self) -> bytes:
        return self.ca()[0].public_bytes(serialization.Encoding.PEM)

    def _load(self) -> tuple[x509.Certificate, CAKey] | None:
        # ca.pem is written last: when it is there, so is its key.
        try:
            cert = x509.load_pem_x509_certificate(self.ca_pem_path.read_bytes())
            key = serialization.load_pem_private_key((self.directory / "ca-key.pem").read_bytes(), None)
        except FileNotFoundError:
            return None
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise ValueError(f"{self.directory}/ca-key.pem is neither an EC nor an RSA key")
        if cert.public_key() != key.public_key():
            raise ValueError(f"{self.directory}/ca-key.pem is not the key of {self.ca_pem_path}")
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise ValueError(f"{self.ca_pem_path} is not a CA certificate (basicConstraints CA:TRUE)")
        return cert, key

    def _locked_create(self) -> tuple[x509.Certificate, CAKey]:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.directory / ".ca.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return self._load() or self.create()
        finally:
            os.close(fd)

    def create(self) -> tuple[x509.Certificate, CAKey]:
        """Make a new CA in the directory (replacing one there: callers check first)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=True, crl_sign=True,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        write_atomic(self.directory / "ca-key.pem", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), 0o600)
        write_atomic(self.ca_pem_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        self._ca = cert, key
        return cert, key

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``host`` signed by the CA."""
        ctx = self._contexts.get(host)
        if ctx is None:
            ctx = self._contexts[host] = self._mint(host)
        return ctx

    def _mint(self, host: str) -> ssl.SSLContext:
        ca_cert, ca_key = self.ca()
        literal = ip_literal(host)
        san: x509.GeneralName = x509.IPAddress(literal) if literal else x509.DNSName(host)
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
                .issuer_name(ca_cert.subject).public_key(self._leaf_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=90))
                .add_extension(x509.SubjectAlternativeName([san]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        chain = (cert.public_bytes(serialization.Encoding.PEM) + self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        # ssl loads a certificate only from a file: a private one (0600, in the temp dir: the CA's
        # may be a read-only mount), removed once loaded.
        fd, name = tempfile.mkstemp(prefix="kernelmode-leaf-", suffix=".pem")
        path = Path(name)
        try:
            os.write(fd, chain)
        finally:
            os.close(fd)
        try:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(path)
        finally:
            path.unlink(missing_ok=True)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


def upstream_context(upstream_ca_file: Path | None) -> ssl.SSLContext:
    """How intercepted upstreams are verified: the system store, plus the operator's CAs."""
    ctx = ssl.create_default_context()
    if not ctx.get_ca_certs() and not ssl.get_default_verify_paths().cafile:
        ctx.load_verify_locations(certifi.where())  # a host without a system store
    if upstream_ca_file is not None:
        ctx.load_verify_locations(upstream_ca_file)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def system_bundle() -> bytes:
    """The host's CA bundle (PEM), or certifi's where the host has none."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate).read_bytes()
    return Path(certifi.where()).read_bytes()


def kernel_bundle(ca_pem: bytes | None, upstream_ca_file: Path | None) -> bytes:
    """The CA bundle kernels trust: the system's, the operator's upstream CAs (tunnelled hosts
    are verified by the kernel itself) and, when the policy intercepts, the deployment CA."""
    parts = [system_bundle()]
    if upstream_ca_file is not None:
        parts.append(upstream_ca_file.read_bytes())
    if ca_pem is not None:
        parts.append(ca_pem)
    return b"\n".join(p.rstrip(b"\n") + b"\n" for p in parts)


class ClientHelloReader:
    """Feeds a tunnel's first bytes to the stdlib TLS server parser only to learn the SNI: the
    callback aborts the handshake as soon as OpenSSL has parsed the ClientHello, so nothing is
    answered and the bytes are forwarded untouched. ``feed`` returns None while more bytes are
    needed, else ``(is_tls, sni or None)``."""

    _CONTEXT: ssl.SSLContext | None = None

    def __init__(self) -> None:
        self._name: list[str | None] = []
        self._in = ssl.MemoryBIO()
        self._obj = self._context().wrap_bio(self._in, ssl.MemoryBIO(), server_side=True)
        self._size = 0

    @classmethod
    def _context(cls) -> ssl.SSLContext:
        if cls._CONTEXT is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.sni_callback = cls._seen
            cls._CONTEXT = ctx
        return cls._CONTEXT

    @staticmethod
    def _seen(obj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> int:
        reader = getattr(obj, "_kernelmode_reader", None)
        if reader is not None:
            reader._name.append(name)
        return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE  # stop here: we only wanted the name

    def feed(self, data: bytes) -> tuple[bool, str | None] | None:
        self._size += len(data)
        self._in.write(data)
        self._obj._kernelmode_reader = self  # type: ignore[attr-defined]
        try:
            self._obj.do_handshake()
        except ssl.SSLWantReadError:
            return None if self._size < MAX_CLIENT_HELLO else (False, None)
        except ssl.SSLError:
            pass
        if self._name:
            return True, self._name[0]
        return False, None
