"""A thin async etcd v3 client over raw gRPC stubs (aetcd's generated ones).

aetcd's high-level API drops what tidings needs (the response header revision of a transaction,
watch progress notifications, one persistent lease keep-alive stream) and its connection is
plaintext only (`aetcd.Client.connect` builds an insecure channel), so this module opens its own
channel, with TLS when given one (a CA verifying etcd, a client certificate for etcd's
`--client-cert-auth`), and drives ``KVStub``, ``WatchStub``, ``LeaseStub`` and ``AuthStub`` directly.

etcd users (`--etcd-user`): `Authenticate` gives a token that every call carries (`_EtcdToken`, a
channel interceptor). etcd's tokens expire (`--auth-token-ttl`, 5 minutes unused by default): a
unary call refused for an invalid token authenticates again once and is retried; a stream (a watch,
the lease keep-alive) is opened with a token at most a second old, since its failure comes later,
to the stream's own reopening loop.

Keys are ``str`` (UTF-8 on the wire) and values ``bytes``. Every gRPC failure surfaces as a
:class:`~tidings.protocol.status.TransportError` naming the etcd endpoint; a compacted watch start
revision raises :class:`CompactedError`; a lease that etcd no longer knows raises
:class:`LeaseLostError`.

Cancellation: a cancelled unary call may or may not have been applied by etcd (as with any RPC);
callers that care guard their writes with compares (``mod_revision_is`` ...) and re-read.

etcd outages. The channel retries its connection at most every second (``RECONNECT_BACKOFF``,
instead of gRPC's default of up to two minutes), so a client notices an etcd that came back within
about a second. Unary calls fail fast with UNAVAILABLE while etcd is down; callers retry.
``keep_alive`` rides out an outage shorter than the lease: it keeps retrying until the lease's TTL
has elapsed since the last refresh etcd answered, as etcd's own expiry would, and only then reports
the lease lost (etcd's Go client does the same). Every unary call takes a ``timeout`` so that a
caller with a deadline of its own (a broker stopping) is never held up by an unreachable etcd.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeAlias

import grpc
from aetcd import rpc

from tidings.protocol.status import TidingsError, TransportError, UsageError, map_grpc_error, tls_hint
from tidings.tls import TLS, canonical_endpoint, probe, verify_failure

__all__ = [
    "KV",
    "CompactedError",
    "Compare",
    "RequestOp",
    "Etcd",
    "Event",
    "LeaseLostError",
    "Watch",
    "WatchBatch",
    "create_revision_is",
    "delete_op",
    "mod_revision_is",
    "prefix_end",
    "put_op",
    "value_is",
]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0  # seconds to wait for an unreachable endpoint before failing
RPC_TIMEOUT = 10.0  # deadline of each unary call
PAGE_SIZE = 1000  # keys per Range page in get_prefix
RECONNECT_BACKOFF = (100, 1000)  # ms: first and largest wait between connection attempts to etcd
# Each attempt's own limit (gRPC's min_reconnect_backoff: connect, TLS handshake, HTTP/2 settings). With
# backoff capped at 1 s it never grows, so it is longer than other channels' (tls.CONNECT_ATTEMPT_OPTIONS):
# an overloaded etcd's slow handshakes still get through, and an attempt never answered (a lost SYN) is
# retried within CONNECT_TIMEOUT rather than after gRPC's default 20 s.
CONNECT_ATTEMPT_MS = 3000
KEEPALIVE_MAX_INTERVAL = 1.0  # seconds between lease refreshes at most (else TTL/3)
KEEPALIVE_RETRY = 0.2  # seconds between attempts to reopen a failed keep-alive stream

_ETCD_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is etcd running there?",
    grpc.StatusCode.DEADLINE_EXCEEDED: "etcd did not answer in time",
}


class CompactedError(TidingsError):
    """A watch's start revision was compacted away; reload the prefix and watch again."""

    def __init__(self, compact_revision: int) -> None:
        self.compact_revision = compact_revision
        super().__init__(f"etcd compacted revisions before {compact_revision}; reload and watch again")


class LeaseLostError(TidingsError):
    """etcd no longer holds the lease (it expired or was revoked): keys attached to it are gone."""

    def __init__(self, lease_id: int, detail: str = "") -> None:
        self.lease_id = lease_id
        msg = f"etcd lease {lease_id:x} was lost"
        super().__init__(f"{msg}: {detail}" if detail else msg)


@dataclass(frozen=True, slots=True)
class KV:
    """One etcd key-value with its revisions (``lease`` 0 when not leased)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    """A watch event. For a delete, ``kv`` holds the key and the deletion's ``mod_revision``."""

    type: Literal["put", "delete"]
    kv: KV


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Events of one watch response, and the revision through which the watcher is now current.

    ``revision`` is the last event's revision for an event batch (safe even when etcd splits a
    catch-up into several responses) and the header revision of a progress notification, whose
    ``events`` are empty.
    """

    events: list[Event]
    revision: int


def prefix_end(prefix: str) -> bytes:
    """The range end covering every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # an empty prefix: every key


def _kv(pbkv: rpc.KeyValue) -> KV:
    return KV(
        key=pbkv.key.decode(),
        value=bytes(pbkv.value),
        create_revision=pbkv.create_revision,
        mod_revision=pbkv.mod_revision,
        lease=pbkv.lease,
    )


# --- compare and operation builders (for Etcd.txn) ---------------------------------------

Compare: TypeAlias = rpc.Compare  # a txn guard, built by the functions below
RequestOp: TypeAlias = rpc.RequestOp  # a txn operation, built by put_op / delete_op


def mod_revision_is(key: str, rev: int) -> Compare:
    """The key's mod revision equals ``rev``; ``rev`` 0 means the key must not exist."""
    return rpc.Compare(
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.MOD,
        key=key.encode(),
        mod_revision=rev,
    )


def create_revision_is(key: str, rev: int) -> Compare:
    """The key's create revision equals ``rev`` (0: the key must not exist)."""
    return rpc.Compare(
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.CREATE,
        key=key.encode(),
        create_revision=rev,
    )


def value_is(key: str, value: bytes) -> Compare:
    return rpc.Compare(
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.VALUE,
        key=key.encode(),
        value=value,
    )


def put_op(key: str, value: bytes, lease: int = 0, *, ignore_lease: bool = False) -> RequestOp:
    """Put ``value`` under ``lease`` (0: none); ``ignore_lease`` keeps the existing key's lease instead.

    etcd fails an ``ignore_lease`` put of a key that does not exist, so guard it with
    ``mod_revision_is``.
    """
    if ignore_lease and lease:
        raise UsageError(f"put of {key!r}: pass a lease or ignore_lease, not both")
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=key.encode(), value=value, lease=lease, ignore_lease=ignore_lease)
    )


def delete_op(key: str) -> RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))


# --- the client --------------------------------------------------------------------------


def _parse_endpoint(endpoint: str) -> tuple[str, int, bool]:
    """(host, port, https?) of HOST:PORT, http://HOST:PORT or https://HOST:PORT."""
    rest, https = endpoint, endpoint.startswith("https://")
    rest = rest.removeprefix("https://").removeprefix("http://").rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"etcd endpoint {endpoint!r} must look like 127.0.0.1:2379 or http(s)://127.0.0.1:2379")
    return host, int(port), https


async def _handshake_failure(channel: grpc.aio.Channel | None, endpoint: str, tls: TLS | None) -> str:
    """Why a channel to a reachable etcd never became ready, in one line ("": no TLS mismatch found, or
    no answer within HINT_TIMEOUT). A call that does not wait for `channel` (None: one with an etcd user's
    interceptor, which would authenticate first) fails at once with its last handshake's error; a handshake
    of our own verifies etcd's certificate; a server that refuses our certificate, or speaks TLS to a
    plaintext client, says so only to the probe."""
    why = ""
    try:
        async with asyncio.timeout(HINT_TIMEOUT):
            if tls is not None and channel is not None:
                try:
                    await rpc.KVStub(channel).Range(rpc.RangeRequest(key=b"\0"), timeout=1.0, wait_for_ready=False)
                except grpc.RpcError as err:
                    why = tls_hint(err.details() or "", endpoint)
            if not why and tls is not None:
                why = await asyncio.to_thread(verify_failure, endpoint, tls)
            if not why:
                why = await asyncio.to_thread(probe, endpoint, tls, 1.0)
    except TimeoutError:
        return ""
    return why.replace("--tls-", "--etcd-tls-")  # (etcd's flags)


HINT_TIMEOUT = 3.0  # seconds the reason for a failed connection is looked for at most


_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
STREAM_TOKEN_AGE = 1.0  # seconds: a stream opens with a token at most this old (its failure comes later)
TOKEN_REFRESH = 60.0  # seconds: a unary call authenticates again first if the token is older


def _invalid_token(err: grpc.RpcError) -> bool:
    details = err.details() if hasattr(err, "details") else ""
    return "invalid auth token" in (details or "") or "user name is empty" in (details or "")


class _EtcdToken:
    """Adds an etcd user's token to every call; authenticates again when it went stale. (grpc.aio
    takes one interceptor object per kind of call: `interceptors()`.)"""

    def __init__(self, endpoint: str, user: str, password: str) -> None:
        self.endpoint, self.user, self._password = endpoint, user, password
        self.channel: grpc.aio.Channel | None = None  # set once the channel exists
        self._token = ""
        self._at = -1e9
        self._lock = asyncio.Lock()
        self.started = False  # (then a refusal is a retriable TransportError, not a usage error)
        self.authentications = 0  # Authenticate calls that gave a token (etcd runs bcrypt for each)
        self._auth_off_logged = False

    async def authenticate(self, older_than: float, stale: str | None = None) -> None:
        """A new token, unless another caller got one in the last `older_than` seconds or (`stale`: the
        token a call was refused for) one since: callers refused together authenticate once."""
        async with asyncio.timeout(RPC_TIMEOUT), self._lock:
            if time.monotonic() - self._at < older_than or (stale is not None and self._token != stale):
                return
            assert self.channel is not None
            try:
                resp = await rpc.AuthStub(self.channel).Authenticate(
                    rpc.AuthenticateRequest(name=self.user, password=self._password), timeout=RPC_TIMEOUT
                )
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (err.details() or ""):
                    if not self._auth_off_logged:  # (etcd's authentication was turned off: no token needed)
                        log.warning("etcd %s: authentication is not enabled; going on without user %s",
                                    self.endpoint, self.user)  # fmt: skip
                        self._auth_off_logged = True
                    self._token, self._at = "", time.monotonic()
                    return
                why = f"etcd {self.endpoint} refused user {self.user}: {err.details()}"
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise TransportError(f"{err.code().name} from {why}", err.code(), retriable=True) from None
                if self.started:  # (a password changed under a running process: it retries, loudly)
                    log.error("%s; retrying (set its new password and restart this process)", why)
                    raise TransportError(why, grpc.StatusCode.UNAUTHENTICATED, retriable=True) from None
                raise UsageError(
                    f"{why} (check --etcd-user and TIDINGS_ETCD_PASSWORD or --etcd-password-file)"
                ) from None
            self._token, self._at = resp.token, time.monotonic()
            self.authentications += 1

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != "token"]
        return details._replace(metadata=(*metadata, ("token", self._token)))  # (a namedtuple)

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method in (_AUTHENTICATE, _AUTHENTICATE.encode()):
            return await continuation(details, request)
        await self.authenticate(TOKEN_REFRESH)
        used = self._token
        call = await continuation(self._details(details), request)
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            if not _invalid_token(err):
                raise
        log.info("etcd %s: its token for %s went stale; authenticating again", self.endpoint, self.user)
        await self.authenticate(0.0, stale=used)
        return await (await continuation(self._details(details), request))

    async def intercept_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        await self.authenticate(STREAM_TOKEN_AGE)
        return await continuation(self._details(details), request)

    def interceptors(self) -> list[Any]:
        return [_UnaryUnary(self), _UnaryStream(self), _StreamStream(self)]


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # (untyped base)
    def __init__(self, token: _EtcdToken) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self.token.intercept_unary_unary(continuation, details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]  # (untyped base)
    def __init__(self, token: _EtcdToken) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self.token.intercept_stream(continuation, details, request)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]  # (untyped base)
    def __init__(self, token: _EtcdToken) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await self.token.intercept_stream(continuation, details, request_iterator)


class Etcd:
    """An open connection to one etcd endpoint.

    Usage::

        etcd = await Etcd.connect("127.0.0.1:2379")
        try:
            rev = await etcd.put("/a", b"1")
            kv, header_rev = await etcd.get("/a")
        finally:
            await etcd.aclose()
    """

    def __init__(self, endpoint: str, channel: grpc.aio.Channel, user: _EtcdToken | None = None) -> None:
        self.endpoint = endpoint
        self._channel = channel
        self._user = user  # (an etcd user's token, with --etcd-user)
        self._metadata: tuple[tuple[str, str], ...] = ()  # (a user's token: the channel's interceptor adds it)
        self._kv = rpc.KVStub(channel)
        self._watch = rpc.WatchStub(channel)
        self._lease = rpc.LeaseStub(channel)

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        timeout: float = CONNECT_TIMEOUT,
        *,
        tls: TLS | None = None,
        user: str = "",
        password: str = "",
    ) -> Etcd:
        """Connect and wait until the channel is ready; TransportError after ``timeout`` seconds. With
        `tls` (or an https:// endpoint: the system's CAs) over TLS; with `user`, as that etcd user."""
        host, port, https = _parse_endpoint(endpoint)
        if https and tls is None:
            tls = TLS(None, None, None)
        options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF[1]),
            ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
        ]
        token = _EtcdToken(endpoint, user, password) if user else None
        target = canonical_endpoint(f"{host}:{port}")
        interceptors = token.interceptors() if token is not None else None
        channel = (
            grpc.aio.secure_channel(target, tls.channel_credentials(), options, interceptors=interceptors)
            if tls is not None
            else grpc.aio.insecure_channel(target, options, interceptors=interceptors)
        )
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
            if token is not None:
                token.channel = channel
                await token.authenticate(0.0)
                token.started = True
        except (TimeoutError, grpc.RpcError) as err:
            try:
                why = await _handshake_failure(channel if token is None else None, target, tls)
            finally:
                await channel.close()
            how = " over TLS (check --etcd-tls-ca and that etcd serves TLS)" if tls is not None else ""
            why = why or (
                f"not reachable{how} within {timeout:g}s ({type(err).__name__}); is etcd running there? "
                "(pass --etcd or set TIDINGS_ETCD)"
            )
            raise TransportError(
                f"UNAVAILABLE from etcd {endpoint}: {why}", grpc.StatusCode.UNAVAILABLE, retriable=True
            ) from err
        except BaseException:
            await channel.close()
            raise
        return cls(endpoint, channel, token)

    @property
    def authentications(self) -> int:
        """How many tokens this connection's etcd user was given (0 without a user)."""
        return self._user.authentications if self._user is not None else 0

    async def aclose(self) -> None:
        """Close the channel; open watches and keep-alives fail with TransportError."""
        await self._channel.close()

    def _error(self, err: grpc.RpcError) -> TransportError:
        """``map_grpc_error`` (code, retriable), with hints about etcd rather than about brokers."""
        mapped = map_grpc_error(err, f"etcd {self.endpoint}")
        name = mapped.code.name if mapped.code is not None else "UNKNOWN"
        details = err.details() if hasattr(err, "details") else str(err)
        hint = _ETCD_HINTS.get(mapped.code) if mapped.code is not None else None
        message = f"{name} from etcd {self.endpoint}: {details}" + (f"; {hint}" if hint else "")
        return TransportError(message, mapped.code, retriable=mapped.retriable)

    # --- KV ---

    async def _range(self, req: rpc.RangeRequest, timeout: float = RPC_TIMEOUT) -> rpc.RangeResponse:
        try:
            return await self._kv.Range(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._error(err) from err

    async def get(self, key: str, timeout: float = RPC_TIMEOUT) -> tuple[KV | None, int]:
        """The key (or None) and the header revision the read was served at."""
        resp = await self._range(rpc.RangeRequest(key=key.encode()), timeout)
        return (_kv(resp.kvs[0]) if resp.kvs else None), resp.header.revision

    async def get_prefix(self, prefix: str, timeout: float = RPC_TIMEOUT) -> tuple[list[KV], int]:
        """Every key under ``prefix`` sorted by key, read page by page at one revision."""
        start, end = prefix.encode(), prefix_end(prefix)
        out: list[KV] = []
        rev = 0
        while True:
            resp = await self._range(rpc.RangeRequest(key=start, range_end=end, limit=PAGE_SIZE, revision=rev), timeout)
            if rev == 0:
                rev = resp.header.revision
            out.extend(_kv(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return out, rev
            start = resp.kvs[-1].key + b"\0"

    async def prefix_summary(self, prefix: str) -> tuple[int, int, int]:
        """(key count, largest mod revision, header revision) of the prefix, keys only.

        Lets a KeySpace prove it is current at the header revision without a progress
        notification: same count and same largest mod revision mean no change reached the
        prefix after the KeySpace's last applied event (see ``KeySpace.wait_for_revision``).
        """
        resp = await self._range(
            rpc.RangeRequest(
                key=prefix.encode(),
                range_end=prefix_end(prefix),
                limit=1,
                keys_only=True,
                sort_order=rpc.RangeRequest.SortOrder.DESCEND,
                sort_target=rpc.RangeRequest.SortTarget.MOD,
            )
        )
        top = resp.kvs[0].mod_revision if resp.kvs else 0
        return resp.count, top, resp.header.revision

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        try:
            resp = await self._kv.Put(
                rpc.PutRequest(key=key.encode(), value=value, lease=lease), timeout=RPC_TIMEOUT, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise self._error(err) from err
        revision: int = resp.header.revision  # aetcd's messages are untyped
        return revision

    async def compact(self, revision: int) -> None:
        """Compact etcd's history below ``revision`` (operators and tests; watches older than it fail)."""
        try:
            await self._kv.Compact(
                rpc.CompactionRequest(revision=revision, physical=True), timeout=RPC_TIMEOUT, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise self._error(err) from err

    async def _delete(self, req: rpc.DeleteRangeRequest, timeout: float = RPC_TIMEOUT) -> int:
        try:
            resp = await self._kv.DeleteRange(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._error(err) from err
        revision: int = resp.header.revision  # aetcd's messages are untyped
        return revision

    async def delete(self, key: str) -> int:
        return await self._delete(rpc.DeleteRangeRequest(key=key.encode()))

    async def delete_prefix(self, prefix: str, timeout: float = RPC_TIMEOUT) -> int:
        return await self._delete(rpc.DeleteRangeRequest(key=prefix.encode(), range_end=prefix_end(prefix)), timeout)

    async def txn(
        self,
        compares: Iterable[Compare],
        success: Iterable[RequestOp],
        failure: Iterable[RequestOp] = (),
        timeout: float = RPC_TIMEOUT,
    ) -> tuple[bool, int]:
        """(succeeded, header revision). On success the revision is the one the ops wrote at."""
        req = rpc.TxnRequest(compare=list(compares), success=list(success), failure=list(failure))
        try:
            resp = await self._kv.Txn(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._error(err) from err
        return resp.succeeded, resp.header.revision

    # --- Watch ---

    def watch(self, prefix: str, start_revision: int) -> Watch:
        """Watch every key under ``prefix`` from ``start_revision`` (inclusive), with progress notifications.

        Returns a :class:`Watch`: iterate it (``async for batch in etcd.watch(...)``) and close it
        (``aclose()`` or ``async with``).
        """
        return Watch(self, prefix, start_revision)

    # --- Leases ---

    async def grant_lease(self, ttl: int, timeout: float = RPC_TIMEOUT) -> int:
        try:
            resp = await self._lease.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=ttl), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise self._error(err) from err
        if resp.error:
            raise TransportError(f"etcd {self.endpoint} refused a lease of {ttl}s: {resp.error}")
        lease_id: int = resp.ID
        return lease_id

    async def revoke_lease(self, lease_id: int, timeout: float = RPC_TIMEOUT) -> None:
        """Revoke the lease, deleting its keys; a lease that is already gone is not an error."""
        try:
            await self._lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise self._error(err) from err

    async def lease_time_to_live(self, lease_id: int, timeout: float = RPC_TIMEOUT) -> tuple[int, int]:
        """(seconds left, seconds granted) of the lease; (-1, 0) if etcd no longer holds it."""
        try:
            resp = await self._lease.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=lease_id), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return -1, 0
            raise self._error(err) from err
        return (resp.TTL, resp.grantedTTL) if resp.TTL > 0 else (-1, 0)

    async def keep_alive(
        self,
        lease_id: int,
        ttl: int,
        *,
        since: float | None = None,
        on_refresh: Callable[[float], None] | None = None,
    ) -> None:
        """Keep the lease alive over one persistent stream, until cancelled.

        The lease counts as alive until a deadline: ``since`` (a ``time.monotonic()`` at which it
        was known alive, e.g. just before it was granted; default now) plus ``ttl``, then, after
        each refresh etcd answers, the time that refresh was *sent* plus the TTL etcd reports
        (never later than etcd's own expiry). Refreshes go every TTL/3 (at most every
        ``KEEPALIVE_MAX_INTERVAL``). A failed or closed stream is reopened every
        ``KEEPALIVE_RETRY`` seconds, and a refresh etcd does not answer (a hung etcd) is waited
        for, until the deadline passes: an etcd outage shorter than the lease costs nothing.
        ``on_refresh(deadline)`` is called after each answered refresh.

        Raises LeaseLostError when etcd reports the lease gone (expired or revoked), or when the
        deadline passed without an answered refresh (etcd has expired it, or will as soon as it
        can). One warning is logged when refreshes start failing, one info line when they recover.
        """
        deadline = (time.monotonic() if since is None else since) + ttl
        failing_since: float | None = None

        def failing(reason: object) -> None:
            nonlocal failing_since
            if failing_since is None:
                failing_since = time.monotonic()
                log.warning(
                    "lease %x: keep-alive to etcd %s failed (%s); retrying until the lease would expire in %.1fs",
                    lease_id,
                    self.endpoint,
                    reason,
                    deadline - failing_since,
                )

        while True:
            call = self._lease.LeaseKeepAlive(metadata=self._metadata)
            try:
                while True:
                    sent = time.monotonic()
                    await _write(call, rpc.LeaseKeepAliveRequest(ID=lease_id))
                    # Wait for the answer without cancelling the read (that would end the call):
                    # briefly, then, if etcd is silent, say so and wait on until the deadline.
                    reading = asyncio.ensure_future(call.read())
                    done, _ = await asyncio.wait([reading], timeout=min(KEEPALIVE_MAX_INTERVAL, deadline - sent))
                    if not done:
                        failing("etcd does not answer")
                        done, _ = await asyncio.wait([reading], timeout=max(deadline - time.monotonic(), 0))
                    if not done:
                        reading.cancel()
                        raise TimeoutError("etcd does not answer")
                    resp = reading.result()
                    if resp is grpc.aio.EOF:
                        raise TransportError(f"etcd {self.endpoint} closed the lease keep-alive stream")
                    if resp.TTL <= 0:
                        raise LeaseLostError(lease_id, "etcd reports it expired or revoked")
                    deadline = sent + resp.TTL
                    if failing_since is not None:
                        log.info(
                            "lease %x: keep-alive to etcd %s works again after %.1fs",
                            lease_id,
                            self.endpoint,
                            time.monotonic() - failing_since,
                        )
                        failing_since = None
                    if on_refresh is not None:
                        on_refresh(deadline)
                    await asyncio.sleep(min(resp.TTL / 3.0, KEEPALIVE_MAX_INTERVAL))
            except (grpc.RpcError, TransportError, TimeoutError) as exc:
                err = self._error(exc) if isinstance(exc, grpc.RpcError) else exc
                now = time.monotonic()
                if now >= deadline:
                    raise LeaseLostError(
                        lease_id, f"no refresh answered by etcd {self.endpoint} within its {ttl}s TTL ({err})"
                    ) from exc
                failing(err)
                await asyncio.sleep(min(KEEPALIVE_RETRY, deadline - now))
            finally:
                call.cancel()


async def _write(call: grpc.aio.StreamStreamCall, message: object) -> None:
    """``call.write(message)``, raising the call's own status if it already ended.

    grpc.aio raises ``asyncio.InvalidStateError`` for a write to a finished call (e.g. etcd went
    away between two writes); the call's status says why, and ``read()`` raises it.
    """
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        await call.read()  # raises the call's RpcError
        raise TransportError("the etcd stream ended") from None


class Watch:
    """One etcd watch over a prefix: an async iterator of :class:`WatchBatch`.

    Raises CompactedError if the start revision was compacted, and TransportError if the stream
    fails or etcd cancels the watch. Progress notifications arrive as batches without events.
    """

    def __init__(self, etcd: Etcd, prefix: str, start_revision: int) -> None:
        self._etcd = etcd
        self.prefix = prefix
        self.start_revision = start_revision
        self._call: grpc.aio.StreamStreamCall | None = None

    async def _open(self) -> grpc.aio.StreamStreamCall:
        call = self._etcd._watch.Watch(metadata=self._etcd._metadata)
        self._call = call
        create = rpc.WatchCreateRequest(
            key=self.prefix.encode(),
            range_end=prefix_end(self.prefix),
            start_revision=self.start_revision,
            progress_notify=True,
        )
        try:
            await _write(call, rpc.WatchRequest(create_request=create))
        except grpc.RpcError as err:
            raise self._etcd._error(err) from err
        return call

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchBatch:
        call = self._call or await self._open()
        while True:
            try:
                resp = await call.read()
            except grpc.RpcError as err:
                raise self._etcd._error(err) from err
            if resp is grpc.aio.EOF:
                raise TransportError(f"etcd {self._etcd.endpoint} ended the watch of {self.prefix!r}")
            if resp.compact_revision:
                raise CompactedError(resp.compact_revision)
            if resp.canceled:
                raise TransportError(
                    f"etcd {self._etcd.endpoint} canceled the watch of {self.prefix!r}: {resp.cancel_reason}"
                )
            if resp.created and not resp.events:
                continue  # the creation acknowledgement carries no progress guarantee
            events = [
                Event("put" if ev.type == rpc.Event.EventType.PUT else "delete", _kv(ev.kv)) for ev in resp.events
            ]
            revision = events[-1].kv.mod_revision if events else resp.header.revision
            return WatchBatch(events, revision)

    async def aclose(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
