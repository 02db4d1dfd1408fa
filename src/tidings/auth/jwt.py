"""JSON Web Tokens, HS256, with the standard library: the subset Gazette signs and verifies.

A token is `header.payload.signature`, each base64url without padding; the header is
`{"alg":"HS256","typ":"JWT"}`, the payload Gazette's claims JSON (`tidings.protocol.claims`), the
signature an HMAC of `header.payload` under a pre-shared key. About sixty lines instead of a
dependency: sign takes ~10 µs, verify ~24 µs (docs/design/production.md §2.4), and the verifier
caches verified tokens.

`verify` follows Gazette's rules (golang-jwt with `WithExpirationRequired`, `WithIssuedAt`,
`WithLeeway(5s)`, `WithValidMethods(HS256, HS384)`): any key of the set may verify, `exp` is
required, `iat` and `nbf` are checked when present, clocks may differ by 5 s. Each refusal is an
`AuthError` with one reason, which the server sends back as is: reasons say what is wrong with the
token, never which keys the server holds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

from tidings.auth.keys import KeySet
from tidings.protocol.claims import Claims, claims_from_json, claims_json
from tidings.protocol.status import TidingsError, ValidationError

LEEWAY: Final = 5  # seconds of clock difference tolerated on exp, iat and nbf (Gazette's)
MAX_TOKEN_BYTES: Final = 8192  # a longer token is refused before any work (headers are small)
_ALGORITHMS: Final[dict[str, Callable[..., Any]]] = {"HS256": hashlib.sha256, "HS384": hashlib.sha384}
_PART: Final = re.compile(r"^[A-Za-z0-9_-]*$")  # base64url, no padding

AuthCode = Literal["UNAUTHENTICATED", "PERMISSION_DENIED"]  # grpc.StatusCode names


class AuthError(TidingsError):
    """A request refused: `code` is the gRPC status it ends with (UNAUTHENTICATED: no valid token;
    PERMISSION_DENIED: a valid token that does not allow it), `reason` the one line sent back; `sub`
    the holder of a token that verified (for the server's log)."""

    def __init__(self, code: AuthCode, reason: str, sub: str = "") -> None:
        super().__init__(reason)
        self.code: AuthCode = code
        self.reason = reason
        self.sub = sub


def _refuse(reason: str) -> AuthError:
    return AuthError("UNAUTHENTICATED", reason)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # (json reads NaN and Infinity unless told not to)


_HEADER: Final = _b64(b'{"alg":"HS256","typ":"JWT"}')


def sign(claims: Claims, key: bytes) -> str:
    """`claims` as an HS256 token signed with `key` (their `iat` and `exp` as given: the signer sets them)."""
    payload = json.dumps(claims_json(claims), separators=(",", ":"), ensure_ascii=False).encode()
    signing_input = f"{_HEADER}.{_b64(payload)}"
    mac = hmac.new(key, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


def _json_part(part: str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(_unb64(part).decode("utf-8"), parse_constant=_no_constants)
    except (binascii.Error, ValueError, RecursionError):  # (a JSON nested thousands deep: RecursionError)
        raise _refuse(f"malformed token: its {what} is not base64url JSON") from None
    if not isinstance(obj, dict):
        raise _refuse(f"malformed token: its {what} is not a JSON object")
    return obj


def _split(token: str) -> list[str]:
    if len(token) > MAX_TOKEN_BYTES:
        raise _refuse(f"token is {len(token)} bytes: at most {MAX_TOKEN_BYTES} are accepted")
    parts = token.split(".")
    if len(parts) != 3 or not parts[0] or not parts[1] or not all(_PART.match(p) for p in parts):
        raise _refuse("malformed token: not three base64url parts joined by dots")
    return parts


def decode_unverified(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and payload of `token`, **not verified** (for `tidings auth inspect`)."""
    header, payload, _sig = _split(token)
    return _json_part(header, "header"), _json_part(payload, "payload")


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def check_expiry(claims: Claims, now: float) -> None:
    """Refuse `claims` once expired (beyond the leeway): verify does it, and so does every use of a
    cached token."""
    if now > claims.exp + LEEWAY:
        raise _refuse(f"token expired {_ago(now - claims.exp)} ago")


def _date(payload: dict[str, Any], key: str) -> float | None:
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refuse(f"malformed token: {key} {value!r} is not a time (Unix seconds)")
    return float(value)


def verify(token: str, keys: KeySet | Iterable[bytes], now: float) -> Claims:
    """The claims of `token` if one of `keys` signed it and it is current at `now` (Unix seconds);
    else AuthError (UNAUTHENTICATED) with the reason."""
    header_part, payload_part, sig_part = _split(token)
    header = _json_part(header_part, "header")
    alg = header.get("alg")
    if not isinstance(alg, str) or alg not in _ALGORITHMS:
        plain = isinstance(alg, str) and len(alg) <= 16 and alg.isascii() and alg.isprintable()
        said = alg if plain else repr(alg)[:16]  # (the caller's text: never a line of the log's own)
        raise _refuse(f"token algorithm {said} is not accepted (HS256 or HS384)")
    signing_input = f"{header_part}.{payload_part}".encode("ascii")
    try:
        signature = _unb64(sig_part)
    except binascii.Error:  # (a length of 4n+1 is no base64)
        raise _refuse("malformed token: its signature is not base64url") from None
    digest = _ALGORITHMS[alg]
    for key in keys.keys if isinstance(keys, KeySet) else keys:
        if hmac.compare_digest(hmac.new(key, signing_input, digest).digest(), signature):
            break
    else:
        raise _refuse("token signature does not verify with any key held here (signed with another key?)")
    payload = _json_part(payload_part, "payload")
    if _date(payload, "exp") is None:
        raise _refuse("token has no expiry (exp): every token must expire")
    if (iat := _date(payload, "iat")) is not None and iat > now + LEEWAY:
        raise _refuse(f"token issued in the future: clocks differ by more than {LEEWAY} s?")
    if (nbf := _date(payload, "nbf")) is not None and nbf > now + LEEWAY:
        raise _refuse(f"token not valid for another {_ago(nbf - now)} (nbf): clocks differ by more than {LEEWAY} s?")
    try:
        claims = claims_from_json(payload)
    except ValidationError as exc:
        raise _refuse(f"malformed token claims: {exc}") from None
    check_expiry(claims, now)
    return claims
