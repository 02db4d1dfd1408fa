"""Tokens are JWTs another implementation signs and verifies the same way, and every token that should
not pass is refused with its own reason (DESIGN.md invariant 11: no request acts without a capability).

The vectors were made once with PyJWT 2.15.1 (`jwt.encode(payload, key, algorithm=...)`, in a
throw-away venv) from payloads in Go's encoding of Gazette's claims; the HS256 signature was checked
again with `openssl dgst -sha256 -mac HMAC`. Pasted here, they check compatibility without the
dependency.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import pytest

from tidings.auth import LEEWAY, MAX_TOKEN_BYTES, AuthError, KeySet, decode_unverified, sign, verify
from tidings.protocol import labels
from tidings.protocol.claims import Capability, Claims

K1 = bytes(range(32))  # AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=
K2 = bytes(range(100, 132))  # ZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXp7fH1+f4CBgoM=
KEYS = KeySet.parse("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8= ZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXp7fH1+f4CBgoM=")
IAT, EXP = 1764300000, 1764303600

# {"cap":24,"sel":{"include":{"labels":[{"name":"app","value":"orders"}]},"exclude":{"labels":null}},
#  "sub":"alice@ops","exp":1764303600,"iat":1764300000}, HS256 with K1
PYJWT_HS256 = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
    "eyJjYXAiOjI0LCJzZWwiOnsiaW5jbHVkZSI6eyJsYWJlbHMiOlt7Im5hbWUiOiJhcHAiLCJ2YWx1ZSI6Im9yZGVycyJ9XX0sImV4Y2x1ZGUiOnsibG"
    "FiZWxzIjpudWxsfX0sInN1YiI6ImFsaWNlQG9wcyIsImV4cCI6MTc2NDMwMzYwMCwiaWF0IjoxNzY0MzAwMDAwfQ."
    "xBBwajno6ndkaSYZuC4moz8M6oLoMM2EcnM5sKR9QmI"
)
# {"cap":8,"sel":{"include":{"labels":[{"name":"name","value":"shop/","prefix":true}]},
#  "exclude":{"labels":[{"name":"tier","value":"gold"}]}},"exp":1764303600,"iat":1764300000}, HS384 with K2
PYJWT_HS384 = (
    "eyJhbGciOiJIUzM4NCIsInR5cCI6IkpXVCJ9."
    "eyJjYXAiOjgsInNlbCI6eyJpbmNsdWRlIjp7ImxhYmVscyI6W3sibmFtZSI6Im5hbWUiLCJ2YWx1ZSI6InNob3AvIiwicHJlZml4Ijp0cnVlfV19LCJl"
    "eGNsdWRlIjp7ImxhYmVscyI6W3sibmFtZSI6InRpZXIiLCJ2YWx1ZSI6ImdvbGQifV19fSwiZXhwIjoxNzY0MzAzNjAwLCJpYXQiOjE3NjQzMDAwMDB9."
    "-BZvAv-JEwBZy5Ek8Zce9fR5RYqpcxi5bT_MhWO-zk-_Koa8rvQwx2Bwz6LtOZSt"
)
# {"cap":4294967295,"sel":{"include":{"labels":null},"exclude":{"labels":null}},"exp":1764303600,"iat":1764300000},
# HS256 with K1: Gazette's shape of claims over everything
PYJWT_ALL = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
    "eyJjYXAiOjQyOTQ5NjcyOTUsInNlbCI6eyJpbmNsdWRlIjp7ImxhYmVscyI6bnVsbH0sImV4Y2x1ZGUiOnsibGFiZWxzIjpudWxsfX0sImV4cCI6MTc2"
    "NDMwMzYwMCwiaWF0IjoxNzY0MzAwMDAwfQ."
    "kOlRMT_4UFAwficyP8tp6_CGs8gOniArd0vvDSKguqI"
)


def test_a_pyjwt_token_verifies_and_ours_is_the_same_bytes() -> None:
    claims = Claims(cap=24, sel=labels.parse_selector("app=orders"), iat=IAT, exp=EXP, sub="alice@ops")
    assert verify(PYJWT_HS256, KEYS, IAT) == claims
    assert sign(claims, K1) == PYJWT_HS256


def test_claims_over_everything_in_gazettes_shape_verify_and_sign_the_same() -> None:
    claims = Claims(cap=Capability.ALL, iat=IAT, exp=EXP)
    assert verify(PYJWT_ALL, KEYS, IAT) == claims
    assert sign(claims, K1) == PYJWT_ALL


def test_hs384_is_accepted_and_any_key_of_the_set_verifies() -> None:
    claims = verify(PYJWT_HS384, KEYS, IAT)  # (K2, the second key)
    assert claims == Claims(cap=8, sel=labels.parse_selector("name:prefix=shop/,tier!=gold"), iat=IAT, exp=EXP)
    with pytest.raises(AuthError, match="signature does not verify"):
        verify(PYJWT_HS384, [K1], IAT)


def test_decode_unverified_shows_what_a_token_says() -> None:
    header, payload = decode_unverified(PYJWT_HS256)
    assert header == {"alg": "HS256", "typ": "JWT"} and payload["sub"] == "alice@ops"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _forge(payload: Any, header: Any = None, key: bytes = K1, digest: Any = hashlib.sha256) -> str:
    """A token made without `sign`: any header and payload (objects as JSON, bytes as they are)."""
    parts = [h if isinstance(h, bytes) else json.dumps(h).encode() for h in (header or {"alg": "HS256"}, payload)]
    signing_input = ".".join(_b64(p) for p in parts)
    return f"{signing_input}.{_b64(hmac.new(key, signing_input.encode(), digest).digest())}"


NOW = 1_800_000_000
GOOD = {"cap": 8, "iat": NOW, "exp": NOW + 3600}


def _tampered() -> str:
    header, _payload, sig = _forge(GOOD).split(".")
    return f"{header}.{_b64(json.dumps({**GOOD, 'cap': 0xFFFFFFFF}).encode())}.{sig}"


def _alg_none() -> str:
    header = _b64(json.dumps({"alg": "none"}).encode())
    return f"{header}.{_b64(json.dumps(GOOD).encode())}."


@pytest.mark.parametrize(
    "token,reason",
    [
        pytest.param("x" * (MAX_TOKEN_BYTES + 1), "token is 8193 bytes: at most 8192 are accepted", id="too-long"),
        pytest.param("a.b", "malformed token: not three base64url parts joined by dots", id="two-parts"),
        pytest.param("a.b.c.d", "malformed token: not three base64url parts", id="four-parts"),
        pytest.param("eyJh=.e30.abc", "malformed token: not three base64url parts", id="padding"),
        pytest.param("", "malformed token: not three base64url parts", id="empty"),
        pytest.param(f"{_b64(b'nope')}.e30.abc", "malformed token: its header is not base64url JSON", id="header"),
        pytest.param(f"{_b64(b'[1]')}.e30.abc", "malformed token: its header is not a JSON object", id="header-list"),
        pytest.param(_alg_none(), "token algorithm none is not accepted (HS256 or HS384)", id="alg-none"),
        pytest.param(_forge(GOOD, {"alg": "HS512"}), "token algorithm HS512 is not accepted", id="alg-hs512"),
        pytest.param(_forge(GOOD, {"alg": "RS256"}), "token algorithm RS256 is not accepted", id="alg-rs256"),
        pytest.param(_forge(GOOD, {"typ": "JWT"}), "token algorithm None is not accepted", id="alg-missing"),
        pytest.param(
            _forge(GOOD, key=b"k" * 32),
            "token signature does not verify with any key held here (signed with another key?)",
            id="foreign-key",
        ),
        pytest.param(_tampered(), "token signature does not verify", id="tampered-payload"),
        pytest.param(
            _forge(GOOD, {"alg": "HS384"}, digest=hashlib.sha256), "token signature does not verify", id="alg-swapped"
        ),
        pytest.param(_forge(GOOD) + "AA", "malformed token: its signature is not base64url", id="sig-length"),
        pytest.param(_forge(b"not json"), "malformed token: its payload is not base64url JSON", id="payload"),
        pytest.param(_forge(b"\xff\xfe"), "malformed token: its payload is not base64url JSON", id="payload-utf8"),
        pytest.param(_forge([1, 2]), "malformed token: its payload is not a JSON object", id="payload-list"),
        pytest.param(_forge(b'{"cap":8,"exp":NaN}'), "malformed token: its payload is not base64url JSON", id="nan"),
        pytest.param(_forge({"cap": 8}), "token has no expiry (exp): every token must expire", id="no-exp"),
        pytest.param(_forge({"cap": 8, "exp": None}), "token has no expiry (exp)", id="null-exp"),
        pytest.param(_forge({"cap": 8, "exp": "soon"}), "malformed token: exp 'soon' is not a time", id="exp-type"),
        pytest.param(_forge({**GOOD, "exp": NOW - 6}), "token expired 6 s ago", id="expired"),
        pytest.param(_forge({**GOOD, "exp": NOW - 7200}), "token expired 2 h ago", id="expired-hours"),
        pytest.param(
            _forge({**GOOD, "iat": NOW + 6}),
            "token issued in the future: clocks differ by more than 5 s?",
            id="issued-in-the-future",
        ),
        pytest.param(_forge({**GOOD, "nbf": NOW + 600}), "token not valid for another 10 min (nbf)", id="nbf"),
        pytest.param(
            _forge({**GOOD, "cap": 2**32}),
            "malformed token claims: cap: 4294967296 is not a whole number from 0 to 4294967295",
            id="cap-too-big",
        ),
        pytest.param(_forge({**GOOD, "cap": -8}), "malformed token claims: cap: -8", id="cap-negative"),
        pytest.param(_forge({**GOOD, "cap": "ALL"}), "malformed token claims: cap: 'ALL'", id="cap-text"),
        pytest.param(
            _forge({**GOOD, "sel": {"include": {"labels": [{"name": "app", "value": "x"}]}, "exlude": {}}}),
            "malformed token claims: sel: unknown field 'exlude'",
            id="selector-unknown-field",
        ),
        pytest.param(_forge({**GOOD, "sub": ["a"]}), "malformed token claims: sub: is not a string", id="sub"),
    ],
)
def test_each_bad_token_is_refused_with_its_reason(token: str, reason: str) -> None:
    with pytest.raises(AuthError) as exc:
        verify(token, KEYS, NOW)
    assert exc.value.code == "UNAUTHENTICATED"
    assert exc.value.reason.startswith(reason), exc.value.reason
    assert str(exc.value) == exc.value.reason


def test_a_good_forged_token_passes_so_the_cases_above_fail_for_their_reason() -> None:
    assert verify(_forge(GOOD), KEYS, NOW) == Claims(cap=8, iat=NOW, exp=NOW + 3600)
    assert verify(_forge(GOOD, {"alg": "HS384"}, digest=hashlib.sha384), KEYS, NOW).cap == 8


def test_clocks_may_differ_by_the_leeway_and_no_more() -> None:
    token = _forge({"cap": 8, "iat": NOW, "exp": NOW + 60})
    assert verify(token, KEYS, NOW - LEEWAY).iat == NOW  # (our clock behind the issuer's)
    with pytest.raises(AuthError, match="issued in the future"):
        verify(token, KEYS, NOW - LEEWAY - 0.001)
    assert verify(token, KEYS, NOW + 60 + LEEWAY).exp == NOW + 60  # (ours ahead: expired, within the leeway)
    with pytest.raises(AuthError, match="token expired 5 s ago"):
        verify(token, KEYS, NOW + 60 + LEEWAY + 0.001)


def test_sign_then_verify_keeps_every_claim() -> None:
    claims = Claims(
        cap=Capability.READ | Capability.APPEND | (1 << 16),
        sel=labels.parse_selector("app=orders,name:prefix=shop/,!tier"),
        iat=NOW,
        exp=NOW + 60,
        sub="svc/ingest é",
    )
    token = sign(claims, K2)
    assert verify(token, KEYS, NOW) == claims
    assert len(token) < 400


def test_a_token_nested_thousands_deep_is_refused_as_malformed() -> None:
    """(json.loads raises RecursionError past Python's limit: it must be a refusal like any other.)"""
    header = base64.urlsafe_b64encode(b"[" * 3000).rstrip(b"=").decode()  # (4000 bytes: under the size limit)
    with pytest.raises(AuthError, match="malformed token"):
        verify(f"{header}.e30.sig", KEYS, NOW)


def test_an_algorithm_with_a_line_break_is_quoted_in_the_reason() -> None:
    with pytest.raises(AuthError) as refused:
        verify(_forge(GOOD, {"alg": "\nERROR forged"}), KEYS, NOW)
    assert "\n" not in refused.value.reason
