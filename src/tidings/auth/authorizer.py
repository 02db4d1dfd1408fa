"""The client side: the `authorization` metadata each call carries (Gazette's Authorizer).

One interface whatever the client holds: keys (`KeyedAuthorizer` signs per-call claims, as
brokers do for their peers and long-running services should), a token (`BearerAuthorizer`, for
CLI commands, jobs and Spark), or nothing (`NoAuthorizer`, auth off). A caller names the
capability and, when it can, the selector of what it touches (`name=<journal>` for a Read or an
Append, a List's selector); a keyed authorizer scopes its token to exactly that.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, NamedTuple, Protocol

from tidings.auth.jwt import sign
from tidings.auth.keys import KeySet
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Claims
from tidings.protocol.labels import pairs
from tidings.protocol.status import ValidationError

TOKEN_TTL: Final = 3600  # a signed token's life (Gazette's, for streams and blocking calls)
CACHE_SIZE: Final = 4096  # signed tokens kept, by (capability, selector): a broker signs per journal

CallMetadata = tuple[tuple[str, str], ...]


class Authorizer(Protocol):
    """What a client asks before each call: the metadata authorizing `cap` over `selector`'s items."""

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None) -> CallMetadata: ...


class _Signed(NamedTuple):
    metadata: CallMetadata
    renew_at: float


class KeyedAuthorizer:
    """Signs `Claims(cap, selector, exp=now + ttl, sub)` with the first key, and reuses each token
    until half its life is gone (so a call never carries a token about to expire, and signing, ~10 µs,
    stays off the hot path). `clock` is for tests."""

    def __init__(
        self, keys: KeySet, sub: str = "", ttl: int = TOKEN_TTL, clock: Callable[[], float] = time.time
    ) -> None:
        self.keys = keys
        self.sub = sub
        self.ttl = ttl
        self._clock = clock
        self._signed: OrderedDict[tuple[int, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]], _Signed] = (
            OrderedDict()
        )

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None) -> CallMetadata:
        sel = selector if selector is not None else pb.LabelSelector()
        key = (int(cap), tuple(pairs(sel.include)), tuple(pairs(sel.exclude)))
        now = self._clock()
        hit = self._signed.get(key)
        if hit is not None and now < hit.renew_at:
            self._signed.move_to_end(key)
            return hit.metadata
        iat = int(now)
        token = sign(Claims(cap=int(cap), sel=sel, iat=iat, exp=iat + self.ttl, sub=self.sub), self.keys.signing_key)
        signed = _Signed((("authorization", f"Bearer {token}"),), iat + self.ttl / 2)
        self._signed[key] = signed
        self._signed.move_to_end(key)
        if len(self._signed) > CACHE_SIZE:
            self._signed.popitem(last=False)
        return signed.metadata


class BearerAuthorizer:
    """Sends one token, whatever the call: its claims are what its issuer granted."""

    def __init__(self, token: str) -> None:
        token = token.strip()  # (a token file ends with a newline)
        if not token or any(c.isspace() for c in token):
            raise ValidationError("--auth-token", "is empty or has spaces: give what `tidings auth token` printed")
        self._metadata: CallMetadata = (("authorization", f"Bearer {token}"),)

    def __repr__(self) -> str:  # (never the token)
        return "BearerAuthorizer(...)"

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None) -> CallMetadata:
        return self._metadata


class NoAuthorizer:
    """Auth off: calls carry no metadata."""

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None) -> CallMetadata:
        return ()
