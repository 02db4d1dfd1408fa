"""The client side: the `authorization` metadata each call carries (Gazette's Authorizer).

One interface whatever the client holds: keys (`KeyedAuthorizer` signs per-call claims, as
brokers do for their peers and long-running services should), a token (`BearerAuthorizer`, for
CLI commands, jobs and Spark), or nothing (`NoAuthorizer`, auth off). A caller names the
capability and, when it can, the selector of what it touches (`name=<journal>` for a Read or an
Append, a List's selector), and may cap the token's expiry (a broker proxying a call signs no token
outliving its caller's); a keyed authorizer scopes its token to exactly that.
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
from tidings.protocol.status import ValidationError

TOKEN_TTL: Final = 3600  # a signed token's life (Gazette's, for streams and blocking calls)
CACHE_SIZE: Final = 4096  # signed tokens kept, by (capability, selector): a broker signs per journal

CallMetadata = tuple[tuple[str, str], ...]
_ALL = pb.LabelSelector()  # (every item: an Apply's claims, a broker's own)


class Authorizer(Protocol):
    """What a client asks before each call: the metadata authorizing `cap` over `selector`'s items, in a
    token expiring by `exp` (Unix seconds) at the latest, when given."""

    def metadata(
        self, cap: int, selector: pb.LabelSelector | None = None, exp: float | None = None
    ) -> CallMetadata: ...


class _Signed(NamedTuple):
    metadata: CallMetadata
    renew_at: float
    exp: int


def _selector_key(sel: pb.LabelSelector) -> bytes:
    """`sel` as a cache key: its bytes (~1 µs, against ~5 for its labels as tuples: the append path
    asks per call); any empty selector is the same key."""
    if not sel.include.labels and not sel.exclude.labels:
        return b""
    return sel.SerializeToString(deterministic=True)


class KeyedAuthorizer:
    """Signs `Claims(cap, selector, exp=now + ttl, sub)` with the first key, and reuses each token
    until half its life is gone (so a call never carries a token about to expire, and signing, ~10 µs,
    stays off the hot path). A call capping the expiry (`exp`: a proxy's, at its caller's) reuses a token
    expiring no later than it and with at least half the life it would sign (a caller with a long token
    never gets one a short-lived caller left in the cache), else gets one of its own. `clock` is
    for tests."""

    def __init__(
        self, keys: KeySet, sub: str = "", ttl: int = TOKEN_TTL, clock: Callable[[], float] = time.time
    ) -> None:
        self.keys = keys
        self.sub = sub
        self.ttl = ttl
        self._clock = clock
        self._signed: OrderedDict[tuple[int, bytes], _Signed] = OrderedDict()

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None, exp: float | None = None) -> CallMetadata:
        sel = selector if selector is not None else _ALL
        key = (int(cap), _selector_key(sel))
        now = self._clock()
        iat = int(now)
        until = iat + self.ttl if exp is None else min(iat + self.ttl, int(exp))
        hit = self._signed.get(key)
        if hit is not None and now < hit.renew_at and iat + (until - iat) / 2 <= hit.exp <= until:
            self._signed.move_to_end(key)
            return hit.metadata
        token = sign(Claims(cap=int(cap), sel=sel, iat=iat, exp=until, sub=self.sub), self.keys.signing_key)
        signed = _Signed((("authorization", f"Bearer {token}"),), iat + (until - iat) / 2, until)
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

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None, exp: float | None = None) -> CallMetadata:
        return self._metadata


class NoAuthorizer:
    """Auth off: calls carry no metadata."""

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None, exp: float | None = None) -> CallMetadata:
        return ()


def authorizer_of(keys: KeySet | None, sub: str = "") -> Authorizer:
    """What a process holding `keys` signs its own calls with (None: auth off, no token): a server's
    calls to its peers, a consumer's to its brokers, a LogPlayer's to brokers and targets."""
    return KeyedAuthorizer(keys, sub=sub) if keys is not None else NoAuthorizer()
