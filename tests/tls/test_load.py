"""A process's TLS flags (tidings/tls.py `load`): nothing given is plaintext; every mistake in them (a
certificate without its key, a key that is not the certificate's, a file that is not PEM or cannot be
read, a server with a CA but no certificate) is one line naming the flag and what to do, before
anything listens or dials."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.certs import Certs
from tidings.protocol.status import UsageError
from tidings.tls import load


def test_no_flag_is_plaintext() -> None:
    assert load(None, None, None, "broker b0", server=True) is None


def test_a_ca_bundle_with_comments_in_any_encoding_loads_and_no_key_is_ever_shown(certs: Certs) -> None:
    cert, key = certs.issue("good")
    commented = certs.dir / "ca-commented.pem"
    commented.write_bytes("# la CA de l'équipe\n".encode() + certs.ca_file.read_bytes())
    tls = load(cert, key, commented, "broker b0", server=True)
    assert tls is not None and tls.ca_text is not None and "équipe" not in tls.ca_text
    assert "PRIVATE KEY" not in repr(tls)


def test_an_encrypted_key_is_one_line_not_a_password_prompt(certs: Certs) -> None:
    import subprocess

    cert, key = certs.issue("good")
    locked = certs.dir / "locked.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(key), "-out", str(locked), "-aes256", "-passout", "pass:x"], check=True
    )
    with pytest.raises(UsageError, match="is encrypted: give it unencrypted") as refused:
        load(cert, locked, None, "broker b0", server=True)
    assert "\n" not in str(refused.value)


def test_a_certificate_with_its_key_and_a_ca_is_mutual_tls(certs: Certs) -> None:
    cert, key = certs.issue("good")
    tls = load(cert, key, certs.ca_file, "broker b0", server=True)
    assert tls is not None and tls.mutual and tls.cert == cert.read_bytes()
    client = load(None, None, certs.ca_file, "tidings", server=False)  # (a client may trust a CA and show nothing)
    assert client is not None and client.cert is None


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("cert", None, None), "broker b0: --tls-cert without --tls-key: give both"),
        ((None, "key", None), "broker b0: --tls-key without --tls-cert: give both"),
        ((None, None, "ca"), "broker b0: --tls-ca without --tls-cert/--tls-key: a server serving TLS needs its own"),
        (("cert", "other-key", None), "does not match --tls-cert"),
        (("key", "key", None), "--tls-cert {dir}/good.key is not a PEM certificate"),
        (("cert", "cert", None), "--tls-key {dir}/good.pem is not a PEM private key"),
        (("cert", "key", "missing"), "cannot read --tls-ca {dir}/missing.pem (No such file or directory)"),
        (("cert", "key", "garbage"), "--tls-ca {dir}/garbage.pem is not a PEM"),
    ],
)
def test_a_mistake_in_the_flags_is_one_line_naming_the_flag(certs: Certs, flags: tuple, says: str) -> None:
    cert, key = certs.issue("good")
    _other_cert, other_key = certs.issue("other")
    garbage = certs.dir / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    files = {"cert": cert, "key": key, "other-key": other_key, "ca": certs.ca_file, "garbage": garbage,
             "missing": certs.dir / "missing.pem", None: None}  # fmt: skip
    paths: list[Path | None] = [files[f] for f in flags]
    with pytest.raises(UsageError) as refused:
        load(*paths, "broker b0", server=True)
    assert says.format(dir=certs.dir) in str(refused.value) and "\n" not in str(refused.value)
