"""The server side: each RPC's token verified and its capability checked (Gazette's `KeyedAuth.Verify`).

A servicer calls `await verifier.verify(context, CAP)` first thing in every RPC and passes the
returned Claims on; a refusal aborts the RPC with UNAUTHENTICATED (no usable token) or
PERMISSION_DENIED (a valid token lacking the capability) and a one-line reason. Clients send the
same token on every call, so verified tokens are cached (a dict lookup instead of an HMAC and a
JSON parse); a cached token's expiry is checked at each use.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final, NoReturn, Protocol

from tidings.auth.jwt import AuthError, check_expiry, verify
from tidings.auth.keys import KeySet
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import NEVER, Capability, Claims, missing_capability

CACHE_SIZE: Final = 4096  # verified tokens kept (least recently used dropped)
MISSING_TTL: Final = 3600  # the expiry of the claims AA== grants a request without a token (Gazette's)

Metadata = Sequence[tuple[str, str | bytes]]


class ServicerContext(Protocol):
    """What the verifier uses of a `grpc.aio.ServicerContext`."""

    def invocation_metadata(self) -> Metadata | None: ...

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> Any: ...


async def _abort(context: ServicerContext, exc: AuthError) -> NoReturn:
    import grpc  # (a server has it loaded; the CLI, which imports keys and jwt, does not need it)

    await context.abort(grpc.StatusCode[exc.code], exc.reason)
    raise exc  # (abort raises; a context that did not must still not let the call through)


def _bearer(metadata: Metadata | None) -> str | None:
    """The `authorization` header's value (the first, as Gazette), None without one."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


class Verifier:
    """Verifies requests' tokens with `keys` (any key may verify); `keys.allow_missing` (`AA==`)
    admits a request without a token as if it held exactly the capability it needs."""

    def __init__(self, keys: KeySet, cache_size: int = CACHE_SIZE) -> None:
        self.keys = keys
        self._cache: OrderedDict[str, Claims] = OrderedDict()
        self._cache_size = cache_size

    def verify_token(self, token: str, now: float) -> Claims:
        """`token`'s claims, from the cache when it was verified before (its expiry checked again)."""
        claims = self._cache.get(token)
        if claims is not None:
            try:
                check_expiry(claims, now)
            except AuthError:
                del self._cache[token]
                raise
            self._cache.move_to_end(token)
            return claims
        claims = verify(token, self.keys, now)
        self._cache[token] = claims
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return claims

    def verify_metadata(self, metadata: Metadata | None, cap: int, now: float | None = None) -> Claims:
        """The claims of the request with `metadata` if they allow `cap`; else AuthError."""
        now = time.time() if now is None else now
        header = _bearer(metadata)
        if header is None:
            if self.keys.allow_missing:
                return Claims(cap=cap, iat=int(now), exp=int(now) + MISSING_TTL)
            raise AuthError("UNAUTHENTICATED", "no token: pass --auth-token (TIDINGS_AUTH_TOKEN)")
        scheme, _, token = header.partition(" ")
        if scheme != "Bearer" or not token:
            raise AuthError("UNAUTHENTICATED", "invalid or unsupported Authorization header (expected 'Bearer TOKEN')")
        claims = self.verify_token(token.strip(), now)
        if reason := missing_capability(claims.cap, cap):
            raise AuthError("PERMISSION_DENIED", reason)
        return claims

    async def verify(self, context: ServicerContext, cap: int) -> Claims:
        """The claims of the RPC in `context` if they allow `cap`; else the RPC is aborted with the
        refusal's code and reason (`context.abort` raises)."""
        try:
            return self.verify_metadata(context.invocation_metadata(), cap)
        except AuthError as exc:
            await _abort(context, exc)


class NoVerifier:
    """Auth off: every request holds every capability over everything, for ever."""

    def verify_metadata(self, metadata: Metadata | None, cap: int, now: float | None = None) -> Claims:
        return Claims(cap=Capability.ALL, sel=pb.LabelSelector(), exp=NEVER)

    async def verify(self, context: ServicerContext, cap: int) -> Claims:
        return self.verify_metadata(None, cap)
