"""TLS for every tidings channel (docs/design/production.md §3.3): one switch per process.

`--tls-cert/--tls-key` give a process its certificate: a server serves TLS with it, and every channel
it opens presents it when the peer asks (mutual TLS). `--tls-ca` gives the CA bundle that verifies
peers: a client checks the servers it dials against it (without one, the system's roots), and a
server given a CA **requires** client certificates signed by it (Gazette's rule: a CA means mTLS).
A cluster is all-TLS or all-plaintext: endpoints stay `HOST:PORT`, and a process with TLS dials
every peer with TLS. Without any flag nothing changes (plaintext, for loopback).

The files are read once, at start, and checked there (a certificate without its key, a key that is
not the certificate's, a file that is not PEM): each is one line naming the flag. A mismatch with a
peer (a plaintext client at a TLS port, the wrong CA, an expired certificate, the wrong host name)
is named from gRPC's handshake error (`protocol.status.map_grpc_error`), or by `probe` where gRPC only
says "Socket closed".
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tidings.protocol.status import UsageError, name_hint, verify_hint

__all__ = ["TLS", "RefusalLog", "channel", "check_own", "load", "probe", "server_port", "why_refused"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TLS:
    """A process's TLS material, read from the files its flags name (PEM bytes)."""

    cert: bytes | None = field(repr=False)  # its certificate chain: served, and presented to servers that ask
    key: bytes | None = field(repr=False)  # (never in a repr: configs are logged)
    ca: bytes | None = field(repr=False)  # only its PEM certificates; verifies peers (a server: requires theirs)
    paths: dict[str, str] = field(default_factory=dict, compare=False)  # flag -> file, for messages

    @property
    def mutual(self) -> bool:
        """Whether a server with this TLS requires client certificates."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert is not None and self.key is not None, "a server needs --tls-cert and --tls-key"
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    @property
    def ca_text(self) -> str | None:
        """The CA bundle as the stdlib's `cadata` wants it (ASCII PEM: `load` kept only the certificates)."""
        return self.ca.decode("ascii") if self.ca is not None else None

    def server_context(self, alpn: str | list[str] | None = None) -> ssl.SSLContext:
        """A stdlib server context serving this certificate (the replication port's, /metrics'): TLS 1.2+,
        `alpn` if given, and with a CA, client certificates signed by it required (mutual TLS)."""
        assert self.cert is not None and self.key is not None, "a server needs --tls-cert and --tls-key"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if alpn is not None:
            ctx.set_alpn_protocols([alpn] if isinstance(alpn, str) else alpn)
        _load_chain(ctx, self.cert, self.key)
        if self.ca is not None:
            ctx.load_verify_locations(cadata=self.ca_text)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A stdlib client context with the same trust and certificate (the probe's)."""
        ctx = ssl.create_default_context(cadata=self.ca_text)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None and self.key is not None:
            _load_chain(ctx, self.cert, self.key)
        return ctx


def why_refused(exc: BaseException, timeout: float) -> str:
    """One line naming why a TLS handshake failed (`timeout`: its bound, for the message)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {getattr(exc, 'reason', None) or exc}"
    if isinstance(exc, TimeoutError):
        return f"TLS handshake not done within {timeout:g}s"
    return str(exc) or type(exc).__name__


class RefusalLog:
    """One log line per refused TLS connection, at most one per source address every `every` seconds (a
    scanner or a misconfigured peer must not flood the log): the replication port's and /metrics'."""

    def __init__(self, what: str, every: float = 10.0, logger: logging.Logger = log) -> None:
        self.what, self.every, self.log = what, every, logger
        self._logged: dict[str, float] = {}

    def note(self, peer: Any, why: str) -> None:
        source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        now = time.monotonic()
        if now - self._logged.get(source, -self.every) >= self.every:
            self._logged[source] = now
            if len(self._logged) > 4096:
                self._logged.clear()
            self.log.warning("%s from %s: refused (%s)", self.what, source, why)


def load(cert: str | Path | None, key: str | Path | None, ca: str | Path | None, who: str, server: bool) -> TLS | None:
    """The TLS the flags give `who`, or None when none is given; every mistake is a UsageError of one
    line naming the flag (a server must have a certificate to serve TLS; a client may give only a CA)."""
    if not (cert or key or ca):
        return None
    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise UsageError(f"{who}: {given} without {missing}: give both (a certificate and its private key)")
    if server and not cert:
        raise UsageError(
            f"{who}: --tls-ca without --tls-cert/--tls-key: a server serving TLS needs its own certificate and key"
        )
    paths = {flag: str(p) for flag, p in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)) if p}
    pem = {flag: _read(who, flag, Path(p)) for flag, p in paths.items()}
    bundle = pem.get("--tls-ca")
    if bundle is not None:  # (only the certificates: comments in any encoding are no concern of OpenSSL's)
        blocks = _PEM_CERT.findall(bundle)
        if not blocks:
            raise UsageError(f"{who}: --tls-ca {paths['--tls-ca']} is not a PEM CA bundle (no certificate in it)")
        bundle = b"\n".join(blocks) + b"\n"
    tls = TLS(pem.get("--tls-cert"), pem.get("--tls-key"), bundle, paths)
    if tls.cert is not None and tls.key is not None:
        try:
            _load_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), tls.cert, tls.key)
        except _EncryptedKey:
            raise UsageError(
                f"{who}: --tls-key {paths['--tls-key']} is encrypted: give it unencrypted, readable by this user "
                "only (openssl pkey -in KEY -out KEY.plain)"
            ) from None
        except (ssl.SSLError, OSError) as err:
            reason = getattr(err, "reason", None) or err
            what = (
                f"--tls-key {paths['--tls-key']} does not match --tls-cert {paths['--tls-cert']}"
                if "KEY_VALUES_MISMATCH" in str(err)
                else f"--tls-cert {paths['--tls-cert']} or --tls-key {paths['--tls-key']} is not usable ({reason})"
            )
            raise UsageError(f"{who}: {what}: give the certificate and the private key made with it") from None
    if tls.ca is not None:
        try:
            ssl.create_default_context(cadata=tls.ca_text)
        except (ssl.SSLError, ValueError, TypeError) as err:
            raise UsageError(f"{who}: --tls-ca {paths['--tls-ca']} is not a PEM CA bundle ({err})") from None
    return tls


def _read(who: str, flag: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UsageError(f"{who}: cannot read {flag} {path} ({err.strerror or err})") from None
    marker = b"PRIVATE KEY-----" if flag == "--tls-key" else b"-----BEGIN CERTIFICATE-----"
    if marker not in data:
        kind = "private key" if flag == "--tls-key" else "certificate"
        raise UsageError(f"{who}: {flag} {path} is not a PEM {kind}")
    return data


def _load_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """`load_cert_chain` from bytes (the stdlib reads only files: a private temporary one each)."""
    with tempfile.TemporaryDirectory(prefix="tidings-tls-") as tmp:
        cpath, kpath = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cpath.write_bytes(cert)
        fd = os.open(kpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
        ctx.load_cert_chain(cpath, kpath, password=_no_password)


_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]*?-----END CERTIFICATE-----")


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    """OpenSSL asks for an encrypted key's password (on the terminal, else it fails oddly): refuse."""
    raise _EncryptedKey


# gRPC gives each connection attempt its min_reconnect_backoff (20 s by default) before it tries again:
# one attempt never answered (a lost SYN; a handshake stalled on a loaded or still-settling host) held
# every call, and a process's start, for 20 s. Two seconds is ample for a TLS handshake under load, and
# the limit grows with the backoff (x1.6 per attempt, gRPC's default, up to 120 s) if a peer needs more.
CONNECT_ATTEMPT_OPTIONS = [("grpc.min_reconnect_backoff_ms", 2000)]


def canonical_endpoint(endpoint: str) -> str:
    """`endpoint` (HOST:PORT) with an IPv6 literal in the form gRPC prints addresses in (inet_ntop: the
    shortest, `[fd7d:0f65::11]` -> `[fd7d:f65::11]`, an IPv4-mapped one as `::ffff:10.0.0.5`): gRPC matches a
    certificate's IP address against the host it dials as text, so any other spelling of the very address
    the certificate names fails the check."""
    if not endpoint.startswith("["):
        return endpoint
    literal, _, rest = endpoint[1:].partition("]")
    address, scoped, scope = literal.partition("%")
    try:
        short = socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, address))
    except (OSError, ValueError):
        return endpoint  # (not an address: dialing it says what is wrong)
    return f"[{short}{scoped}{scope}]{rest}"


def channel(endpoint: str, tls: TLS | None, options: Any = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `endpoint`: TLS when the process has TLS, else plaintext."""
    options = [*CONNECT_ATTEMPT_OPTIONS, *(options or ())]
    endpoint = canonical_endpoint(endpoint)
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, tls.channel_credentials(), options=options)


def server_port(server: grpc.aio.Server, listen: str, tls: TLS | None) -> int:
    """Bind `server` to `listen` with TLS or without; the port bound."""
    port: int = (
        server.add_insecure_port(listen) if tls is None else server.add_secure_port(listen, tls.server_credentials())
    )
    return port


@contextlib.contextmanager
def _handshake(endpoint: str, ctx: ssl.SSLContext, timeout: float) -> Iterator[ssl.SSLSocket]:
    """A stdlib TLS connection to `endpoint` (HOST:PORT), its handshake done with `ctx` for that host."""
    host = endpoint.rpartition(":")[0].strip("[]")
    with socket.create_connection((host, int(endpoint.rpartition(":")[2])), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            yield s


def check_own(endpoint: str, tls: TLS, who: str, timeout: float = 5.0, alpn: str = "h2") -> None:
    """Handshake with ourselves at the `endpoint` we announce, as a peer would (verifying with our CA
    for the host name announced: a process without --tls-ca skips it): an expired certificate or one not
    valid for that address is a UsageError of one line before anyone is told to dial it. Not reaching
    ourselves (an address only others route) is only logged."""
    ctx = tls.client_context()
    ctx.set_alpn_protocols([alpn])
    try:
        with _handshake(endpoint, ctx, timeout):
            pass
    except ssl.SSLCertVerificationError as err:
        why = err.verify_message or str(err)
        advice = {
            "certificate has expired": "renew it",
            "unable to get local issuer certificate": "give --tls-ca the CA that signed it",
            "self-signed certificate": "give --tls-ca the CA that signed it",
        }.get(why, "give a certificate whose SANs include it" if "mismatch" in why else "check --tls-cert and --tls-ca")
        raise UsageError(f"{who} cannot serve TLS at {endpoint}: its certificate: {why}: {advice}") from None
    except (OSError, ValueError) as err:
        log.warning("%s: could not check its own certificate at %s (%s); serving anyway", who, endpoint, err)


def probe(endpoint: str, tls: TLS | None, timeout: float = 2.0) -> str:
    """Why a connection to `endpoint` closed during its handshake ("Socket closed" is all gRPC says):
    one stdlib TLS handshake to it, unverified, says whether it speaks TLS and whether it took us."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if tls is not None and tls.cert is not None and tls.key is not None:
        _load_chain(ctx, tls.cert, tls.key)
    try:
        with _handshake(endpoint, ctx, timeout) as s:
            s.settimeout(timeout)
            closed = _closed_after_handshake(s)
    except (ssl.SSLError, OSError, ValueError):
        return ""
    if tls is None:
        return f"TLS: {endpoint} speaks TLS: pass --tls-ca (and --tls-cert/--tls-key if it wants a client certificate)"
    if closed and tls.cert is None:
        return f"TLS: {endpoint} requires a client certificate: pass --tls-cert and --tls-key (signed by its CA)"
    if closed:
        return f"TLS: {endpoint} refused our client certificate (not signed by its CA, or expired)"
    return ""


def verify_failure(endpoint: str, tls: TLS, timeout: float = 1.0) -> str:
    """Why `endpoint`'s certificate fails our verification (its CA, its expiry, the host dialed), in one
    line; "" when it passes or no handshake happens."""
    ctx = tls.client_context()
    ctx.set_alpn_protocols(["h2"])
    try:
        with _handshake(endpoint, ctx, timeout):
            return ""
    except ssl.SSLCertVerificationError as err:
        why = err.verify_message or str(err)
        return name_hint(endpoint) if "mismatch" in why else verify_hint(endpoint, why)
    except (ssl.SSLError, OSError, ValueError):
        return ""


def _closed_after_handshake(s: ssl.SSLSocket) -> bool:
    """Whether the server ends the connection right after the handshake (TLS 1.3 servers refuse a
    client certificate only then)."""
    try:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        return s.recv(1) == b""
    except TimeoutError:  # (it took us, and waits for more)
        return False
    except OSError:  # (ssl.SSLError included: an alert, "certificate required")
        return True
