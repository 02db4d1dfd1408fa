"""`tidings auth token|keygen|inspect`: a token printed alone on stdout verifies with the keys and holds
what was asked; a key from keygen is a key; mistakes are one line with exit code 2, and no key or token
ever shows up in an error or in the help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli._support import tidings
from tidings.auth import KeySet, verify
from tidings.protocol import labels
from tidings.protocol.claims import Capability, Claims

KEY = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="  # bytes 0..31
OTHER = "ZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXp7fH1+f4CBgoM="
SHORT = "c2hvcnRrZXk="  # 8 bytes: refused, never echoed
NO_ENV = {"TIDINGS_AUTH_KEYS": "", "TIDINGS_AUTH_KEYS_FILE": "", "TIDINGS_AUTH_TOKEN": ""}


def _token(*args: str, env: dict[str, str] | None = None) -> tuple[str, Claims]:
    r = tidings("auth", "token", *args, env={**NO_ENV, **(env or {})})
    assert r.returncode == 0 and r.stderr == b"", r
    assert r.stdout.count(b"\n") == 1 and r.stdout.endswith(b"\n")  # (the token alone: $(tidings auth token ...))
    token = r.stdout.decode().strip()
    claims = verify(token, KeySet.parse(KEY), now=_iat(token))
    return token, claims


def _iat(token: str) -> int:
    from tidings.auth import decode_unverified

    return int(decode_unverified(token)[1]["iat"])


def test_keygen_prints_a_key_that_parses() -> None:
    r = tidings("auth", "keygen")
    assert r.returncode == 0 and r.stderr == b"", r
    assert [len(k) for k in KeySet.parse(r.stdout.decode()).keys] == [32]


def test_a_token_from_the_key_file_holds_what_was_asked(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"{KEY}\n{OTHER}\n")
    args = ["-c", "READ,append", "--selector", "app=orders,name:prefix=shop/", "--subject", "alice@ops"]
    _text, claims = _token(*args, "--auth-keys-file", str(f))
    sel = labels.parse_selector("app=orders,name:prefix=shop/")
    assert claims == Claims(
        cap=Capability.READ | Capability.APPEND, sel=sel, iat=claims.iat, exp=claims.iat + 3600, sub="alice@ops"
    )


def test_a_token_from_the_variable_with_days_and_numbered_capabilities() -> None:
    _token_text, claims = _token("-c", "LIST,65536", "--ttl", "30d", env={"TIDINGS_AUTH_KEYS": f"AA==,{KEY}"})
    assert claims.cap == Capability.LIST | 65536 and claims.exp - claims.iat == 30 * 86400
    assert labels.format_selector(claims.sel) == "" and claims.sub == ""  # (no selector: every journal)


@pytest.mark.parametrize(
    "args,env,line",
    [
        pytest.param(
            ["-c", "READ", "--auth-keys", f"{KEY},{SHORT}"],
            {},
            "error: --auth-keys (TIDINGS_AUTH_KEYS): key at index 1 is 8 bytes: HS256 wants 32 random bytes, "
            "e.g. `tidings auth keygen`",
            id="short-key",
        ),
        pytest.param(
            ["-c", "READ"],
            {"TIDINGS_AUTH_KEYS": f"{SHORT}!"},
            "error: --auth-keys (TIDINGS_AUTH_KEYS): key at index 0 is not base64",
            id="undecodable-key-from-the-variable",
        ),
        pytest.param(
            ["-c", "READ", "--auth-keys", KEY, "--auth-keys-file", "/etc/hostname"],
            {},
            "error: --auth-keys and --auth-keys-file are both given: give one",
            id="both",
        ),
        pytest.param(
            ["-c", "READ"], {}, "error: no keys to sign with: give --auth-keys-file or --auth-keys", id="none"
        ),
        pytest.param(
            ["-c", "READ", "--auth-keys", "AA=="],
            {},
            "error: --auth-keys (TIDINGS_AUTH_KEYS): only AA== (which",
            id="aa-alone",
        ),
        pytest.param(
            ["-c", "WRITE", "--auth-keys", KEY], {}, "error: --capability: 'WRITE' is not a capability", id="cap"
        ),
        pytest.param(
            ["-c", "READ", "--ttl", "1y", "--auth-keys", KEY], {}, "error: --ttl: '1y' is not a duration", id="ttl"
        ),
        pytest.param(
            ["-c", "READ", "--ttl", "0s", "--auth-keys", KEY], {}, "error: --ttl '0s' is less than", id="ttl-0"
        ),
        pytest.param(
            ["-c", "READ", "--selector", "App=x", "--auth-keys", KEY],
            {},
            "error: --selector.include[0].name: label name 'App' must match",
            id="selector",
        ),
    ],
)
def test_a_mistake_is_one_line_exit_2_and_never_shows_a_key(args: list[str], env: dict[str, str], line: str) -> None:
    r = tidings("auth", "token", *args, env={**NO_ENV, **env})
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"" and err.count("\n") == 1 and err.startswith(line), r
    for secret in (KEY, SHORT, KEY[:12], SHORT[:8]):
        assert secret not in err


def test_help_shows_no_secret_from_the_environment() -> None:
    env = {"TIDINGS_AUTH_KEYS": KEY, "TIDINGS_AUTH_TOKEN": "eyJ.secret.token"}
    for command in (("auth", "token", "-h"), ("auth", "inspect", "-h")):
        r = tidings(*command, env=env)
        assert r.returncode == 0 and KEY not in r.stdout.decode() and "secret" not in r.stdout.decode(), r


def test_inspect_decodes_a_token_and_says_whether_it_verifies(tmp_path: Path) -> None:
    token, claims = _token("-c", "APPEND", "--selector", "name=shop/orders", "--auth-keys", KEY)
    r = tidings("auth", "inspect", token, "--auth-keys", f"{OTHER},{KEY}", env=NO_ENV)
    assert r.returncode == 0 and r.stderr == b"", r
    shown = json.loads(r.stdout)
    assert shown["verified"] is True and shown["capabilities"] == "APPEND" and shown["selector"] == "name=shop/orders"
    assert shown["claims"]["exp"] == claims.exp and shown["header"] == {"alg": "HS256", "typ": "JWT"}

    r = tidings("auth", "inspect", "-", env={**NO_ENV, "TIDINGS_AUTH_KEYS": OTHER}, stdin=token.encode() + b"\n")
    assert r.returncode == 1 and json.loads(r.stdout)["verified"] is False, r
    assert r.stderr.decode() == (
        "error: the token does not verify: token signature does not verify with any key held here "
        "(signed with another key?)\n"
    )

    r = tidings("auth", "inspect", env={**NO_ENV, "TIDINGS_AUTH_TOKEN": token})  # (no keys: not checked)
    assert r.returncode == 0 and json.loads(r.stdout)["verified"] is None, r

    r = tidings("auth", "inspect", "not-a-token", env=NO_ENV)
    assert r.returncode == 2 and r.stderr.decode().startswith("error: TOKEN: malformed token"), r
