"""The server side: each RPC's token verified and its capability checked (Gazette's `KeyedAuth.Verify`).

A servicer calls `await verifier.verify(context, CAP, "Rpc")` first thing in every RPC and passes the
returned Claims on; a refusal aborts the RPC with UNAUTHENTICATED (no usable token) or
PERMISSION_DENIED (a valid token lacking the capability) and a one-line reason. Clients send the
same token on every call, so verified tokens are cached (a dict lookup instead of an HMAC and a
JSON parse); a cached token's expiry is checked at each use.

Each refusal is counted (`tidings_auth_refusals_total{service, code}`) and logged at INFO, naming the
RPC, the peer and the token's holder (`sub`), never the token; one line per (peer host, reason) every
10 s at most, so a client retrying in a loop cannot flood the log. A journal (shard, target) the
token's selector hides is answered as missing (`hid`): the caller learns nothing, the operator's log
names it.
"""

from __future__ import annotations

import contextvars
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn, Protocol

from tidings.auth.jwt import LEEWAY, AuthError, check_expiry, verify
from tidings.auth.keys import KeySet
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import NEVER, Capability, Claims, missing_capability

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger(__name__)

CACHE_SIZE: Final = 4096  # verified tokens kept (least recently used dropped)
MISSING_TTL: Final = 3600  # the expiry of the claims AA== grants a request without a token (Gazette's)
LOG_EVERY: Final = 10.0  # seconds between two log lines of one (peer host, reason)
LOG_KEYS: Final = 1024  # (peer, reason) pairs remembered before the old ones are forgotten

Metadata = Sequence[tuple[str, str | bytes]]


class ServicerContext(Protocol):
    """What the verifier uses of a `grpc.aio.ServicerContext`."""

    def invocation_metadata(self) -> Metadata | None: ...

    def peer(self) -> str: ...

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> Any: ...


# The verified call of the running RPC's task, (rpc, context, sub) (grpc.aio runs each RPC in a task of its
# own): what a later refusal's line names; the resolver, which hides journals, knows neither the RPC nor
# its peer. (A tuple: a dataclass costs 0.7 µs more per call.)
_Call = tuple[str, "ServicerContext", str]
_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("tidings_auth_call", default=None)


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


def _peer(context: ServicerContext | None) -> str:
    """The caller's address, `HOST:PORT` (gRPC says `ipv4:HOST:PORT`)."""
    try:
        peer = context.peer() if context is not None else ""
    except Exception:  # (a context without a transport: a test's)
        peer = ""
    return (peer or "?").removeprefix("ipv4:").removeprefix("ipv6:")


def expires_at(claims: Claims) -> float:
    """When (Unix seconds, leeway included) the RPC holding `claims` must stop (Gazette's deadline at the
    token's expiry): a blocking Read or a List watch ends then, and its client opens it again with its
    current token; an Append still streaming is rolled back. Infinity: claims that never expire."""
    return math.inf if claims.exp >= NEVER else claims.exp + LEEWAY


def seconds_left(claims: Claims, now: float | None = None) -> float | None:
    """How long the RPC holding `claims` may go on (`expires_at`); None: for ever (auth off)."""
    at = expires_at(claims)
    return None if at == math.inf else at - (time.time() if now is None else now)


class _RefusalLog:
    """Counts every refusal; logs one line per (peer host, reason) every LOG_EVERY seconds at most."""

    def __init__(self, service: str, clock: Callable[[], float] = time.monotonic) -> None:
        from tidings.auth._metrics import REFUSALS  # (a server's: clients, and the CLI, load no metrics)

        self.service = service
        self._refusals: Counter = REFUSALS
        self._clock = clock
        self._logged: dict[tuple[str, str], float] = {}

    def note(self, rpc: str, peer: str, sub: str, code: str, reason: str) -> None:
        self._refusals.labels(self.service, code).inc()
        now = self._clock()
        # (per peer host and code, not reason: a reason may quote the caller's token, which would make
        # every line new; a client's port changes with each connection)
        key = (peer.rpartition(":")[0] or peer, code)
        if now - self._logged.get(key, -LOG_EVERY) < LOG_EVERY:
            return
        if len(self._logged) >= LOG_KEYS:
            self._logged = {k: t for k, t in self._logged.items() if now - t < LOG_EVERY}
        self._logged[key] = now
        holder = f" (sub {sub})" if sub else ""
        log.info("refused %s from %s%s: %s", rpc or "a call", peer, holder, reason)


class Verifier:
    """Verifies requests' tokens with `keys` (any key may verify); `keys.allow_missing` (`AA==`)
    admits a request without a token as if it held exactly the capability it needs. `service` names the
    gRPC service in the refusals' metric (journal, shard, target)."""

    def __init__(self, keys: KeySet, cache_size: int = CACHE_SIZE, service: str = "journal") -> None:
        self.keys = keys
        self._cache: OrderedDict[str, Claims] = OrderedDict()
        self._cache_size = cache_size
        self._refusals = _RefusalLog(service)

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
            raise AuthError("PERMISSION_DENIED", reason, claims.sub)
        return claims

    async def verify(self, context: ServicerContext, cap: int, rpc: str = "") -> Claims:
        """The claims of the RPC `rpc` in `context` if they allow `cap`; else the RPC is aborted with the
        refusal's code and reason (`context.abort` raises), the refusal logged and counted."""
        try:
            claims = self.verify_metadata(context.invocation_metadata(), cap)
        except AuthError as exc:
            await self.refuse(context, exc, rpc)
        _CALL.set((rpc, context, claims.sub))
        return claims

    async def refuse(self, context: ServicerContext, exc: AuthError, rpc: str = "") -> NoReturn:
        """End the RPC in `context` with `exc`'s code and reason (an Apply outside the token's selector,
        after `verify` let it in), logged and counted."""
        call = _CALL.get()
        rpc = rpc or (call[0] if call is not None else "")
        sub = exc.sub or (call[2] if call is not None else "")
        self._refusals.note(rpc, _peer(context), sub, exc.code, exc.reason)
        await _abort(context, exc)

    def note_refusal(self, rpc: str, peer: str, exc: AuthError) -> None:
        """A refusal made outside gRPC (the replication port's HELLO), logged and counted as `verify`'s."""
        self._refusals.note(rpc, peer, exc.sub, exc.code, exc.reason)

    def hid(self, what: str, answered: str) -> None:
        """`what` ("journal shop/b") lies outside the verified token's selector and was answered as missing
        (`answered`: JOURNAL_NOT_FOUND): logged (naming it: the operator may see it, the caller never
        does) and counted."""
        rpc, context, sub = _CALL.get() or ("", None, "")
        self._refusals.note(rpc, _peer(context), sub, answered, f"{what} outside the token's selector")


_EVERYTHING: Final = Claims(cap=Capability.ALL, sel=pb.LabelSelector(), exp=NEVER)  # (one: read-only)


class NoVerifier:
    """Auth off: every request holds every capability over everything, for ever."""

    def verify_metadata(self, metadata: Metadata | None, cap: int, now: float | None = None) -> Claims:
        return _EVERYTHING

    async def verify(self, context: ServicerContext, cap: int, rpc: str = "") -> Claims:
        return self.verify_metadata(None, cap)

    async def refuse(self, context: ServicerContext, exc: AuthError, rpc: str = "") -> NoReturn:
        await _abort(context, exc)  # (nothing is refused without keys: no claims fall short of ALL)

    def note_refusal(self, rpc: str, peer: str, exc: AuthError) -> None:
        pass

    def hid(self, what: str, answered: str) -> None:
        pass  # (nothing is hidden: an empty selector matches everything)


def verifier_of(keys: KeySet | None, service: str) -> Verifier | NoVerifier:
    """A server's verifier: with `keys` every RPC of `service` (journal, shard, target) needs a token
    they verify; without, auth is off."""
    return Verifier(keys, service=service) if keys is not None else NoVerifier()
