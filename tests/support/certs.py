"""Test certificates (trustme): one CA per test session, certificates for loopback made on demand,
expired ones, ones for another name, and a second CA nobody trusts; written as PEM files (no secrets
in the repo)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path

import trustme

from tidings.tls import TLS, load

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class Certs:
    dir: Path
    ca: trustme.CA = field(default_factory=trustme.CA)
    other: trustme.CA = field(default_factory=trustme.CA)  # a CA none of our processes trusts

    @property
    def ca_file(self) -> Path:
        path = self.dir / "ca.pem"
        if not path.exists():
            self.ca.cert_pem.write_to_path(str(path))
        return path

    @property
    def other_ca_file(self) -> Path:
        path = self.dir / "other-ca.pem"
        if not path.exists():
            self.other.cert_pem.write_to_path(str(path))
        return path

    def issue(self, name: str, *hosts: str, expired: bool = False, by_other: bool = False) -> tuple[Path, Path]:
        """(cert, key) files of a certificate for `hosts` (default: loopback)."""
        ca = self.other if by_other else self.ca
        now = datetime.datetime.now(datetime.UTC)
        dates = {"not_before": now - datetime.timedelta(days=2), "not_after": now - datetime.timedelta(days=1)}
        cert = ca.issue_cert(*(hosts or LOOPBACK), **(dates if expired else {}))
        cpath, kpath = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(str(cpath))
        cert.private_key_pem.write_to_path(str(kpath))
        return cpath, kpath

    def tls(self, name: str, *hosts: str, ca: bool = True, server: bool = True, **kw: bool) -> TLS:
        """A process's TLS: its certificate `name` and (with `ca`) our CA, as its flags would give it."""
        cert, key = self.issue(name, *hosts, **kw)
        tls = load(cert, key, self.ca_file if ca else None, name, server)
        assert tls is not None
        return tls
