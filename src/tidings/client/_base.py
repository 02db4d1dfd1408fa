"""What the async and sync clients share, with no I/O of its own: results, the route cache, the retry policy.

**Routing.** Every broker response carries a Header with the journal's Route (members, primary,
endpoints) as of an etcd revision. The `RouteCache` keeps the newest Route seen per journal, so
appends go straight to the primary and reads to a replica in the client's zone (else the
primary, else any member). A journal it knows nothing of goes to the configured broker, which
proxies; a status that says the route moved drops the cached Route.

**Retries.** Transient statuses (NO_JOURNAL_PRIMARY_BROKER, NOT_JOURNAL_PRIMARY_BROKER,
INSUFFICIENT_JOURNAL_BROKERS, ...: `StatusError.retriable`) and transport failures that leave
nothing half-done (UNAVAILABLE, ...) are retried with jittered exponential backoff; a definite
refusal (REGISTER_MISMATCH, WRONG_APPEND_OFFSET, NOT_ALLOWED, JOURNAL_NOT_FOUND) never is: it
raises its `StatusError` subclass, which names the journal and the status. A client made with
``retries=None`` retries for as long as it lives (Gazette's RetryReader): what long-running
processes use (a consumer, a LogPlayer, Spark's tasks), so an outage of the brokers or of etcd, of
any length, costs them time but never fails them. Its reads then also retry every transport
failure but those that say the request itself is wrong (`DEFINITE_CODES`), and an operation
failing for long is logged (`Outage`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import grpc

from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError

__all__ = ["AppendResult", "DEFINITE_CODES", "Outage", "ReadChunk", "RetryPolicy", "RouteCache"]

log = logging.getLogger(__name__)

CHUNK = 256 * 1024  # content moves in chunks of this size
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # During a call, ping a silent connection: a broker frozen or cut off fails the call instead of hanging it.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclasses.dataclass(frozen=True, slots=True)
class AppendResult:
    """The committed span [begin, end) of an append, the journal's registers after it, and the SHA1
    (hex) of the appended content as the primary committed it."""

    journal: str
    begin: int
    end: int
    registers: dict[str, list[str]]
    sum: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadChunk:
    """Committed content of `journal` at [offset, offset + len(content)); `write_head` as the broker saw it."""

    offset: int
    content: bytes
    write_head: int


def registers_dict(ls: pb.LabelSet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in labels.pairs(ls):
        out.setdefault(k, []).append(v)
    return out


def first_append_request(
    journal: str,
    offset: int = 0,
    check_registers: pb.LabelSelector | None = None,
    union_registers: pb.LabelSet | None = None,
    subtract_registers: pb.LabelSet | None = None,
    suspend: pb.AppendRequest.Suspend = pb.AppendRequest.SUSPEND_RESUME,
) -> pb.AppendRequest:
    """The metadata message that opens an Append stream (an `offset` of 0, "any", is left unset)."""
    first = pb.AppendRequest(journal=journal, suspend=suspend)
    if offset:
        first.offset = offset
    if check_registers is not None:
        first.check_registers.CopyFrom(check_registers)
    if union_registers is not None:
        first.union_registers.CopyFrom(union_registers)
    if subtract_registers is not None:
        first.subtract_registers.CopyFrom(subtract_registers)
    return first


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long to wait before retry `attempt` (0-based): jittered exponential backoff, capped.

    **Parameters:**
    * `attempts` - retries of one operation before its error is raised (None: no limit, until cancelled).
    * `base` / `cap` - seconds before the first retry, and the most between two.
    * `deadline` - with it, retries also stop once this many seconds passed since the first failure.
    """

    attempts: int | None = 20
    base: float = 0.02
    cap: float = 1.0
    deadline: float = 0.0  # seconds of retrying after an operation's first failure (0: `attempts` only)

    def delay(self, attempt: int) -> float:
        return min(self.cap, self.base * (2.0 ** min(attempt, 30))) * (0.5 + random.random())

    def gives_up(self, attempt: int, failing_since: float) -> bool:
        """No retry `attempt`: too many, or `deadline` seconds passed since the first failure (monotonic)."""
        return (self.attempts is not None and attempt >= self.attempts) or self.expired(failing_since)

    def expired(self, failing_since: float) -> bool:
        return bool(self.deadline) and time.monotonic() - failing_since >= self.deadline

    @property
    def forever(self) -> bool:
        """Retries stop only when the caller cancels (a long-running process's client)."""
        return self.attempts is None and not self.deadline


# Transport failures that no retry can mend: the request itself is at fault.
DEFINITE_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.DATA_LOSS,  # (a broker found a fragment's content corrupt)
    }
)

OUTAGE_WARN_AFTER = 5.0  # seconds of failures before an operation's outage is logged as a warning
OUTAGE_LOG_EVERY = 30.0  # seconds between two warnings of one outage


class Outage:
    """How long an operation (`what`: "journal X: reading", say) has been failing: a warning once it
    fails for OUTAGE_WARN_AFTER seconds and every OUTAGE_LOG_EVERY seconds while it lasts, and a
    line when it works again, so an operator sees a reader waiting out an outage."""

    __slots__ = ("logged", "since", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.since = 0.0
        self.logged = 0.0

    def failed(self, err: BaseException) -> None:
        now = time.monotonic()
        if not self.since:
            self.since = now
        elif now - self.since >= OUTAGE_WARN_AFTER and now - self.logged >= OUTAGE_LOG_EVERY:
            log.warning("%s has failed for %.0f s (%s); retrying until it works", self.what, now - self.since, err)
            self.logged = now

    def ok(self) -> None:
        if self.logged:
            log.warning("%s works again after %.0f s of failures", self.what, time.monotonic() - self.since)
        self.since = self.logged = 0.0


class RouteCache:
    """The newest Route seen per journal (by etcd revision), and which endpoint to use for what.

    **Parameters:**
    * `default` - the broker to use for a journal whose Route is unknown (any broker proxies).
    * `zone` - the client's zone: reads prefer a replica there.
    """

    def __init__(self, default: str, zone: str | None = None) -> None:
        self.default = default
        self.zone = zone
        self._routes: dict[str, tuple[int, pb.Route, int]] = {}  # (revision, Route, `_forgotten` then)
        self._forgotten = 0  # data ports forgotten so far: a Route learnt before then is learnt again
        self.endpoints: dict[str, None] = {default: None}  # every broker heard of, in order: fallbacks
        self.data_endpoints: dict[str, str] = {}  # a broker's data port, by its gRPC endpoint (Routes say)
        self.data_members: dict[str, str] = {}  # the broker ("zone/suffix") a data port belongs to, by the port

    def update(self, journal: str, header: pb.Header) -> None:
        """Learn `journal`'s Route from a response Header, unless a newer one is already known."""
        rev = header.etcd.revision
        known = self._routes.get(journal)
        if known is not None and (known[0] > rev or (known[0] == rev and known[2] == self._forgotten)):
            return  # (a newer one; or this one: a Route at a revision is the keyspace's at that revision)
        route = header.route
        self.endpoints.update(dict.fromkeys(ep for ep in route.endpoints if ep))
        for ep, data, member in zip(route.endpoints, route.data_endpoints, route.members, strict=False):
            if ep and data:
                self.data_endpoints[ep] = data
                self.data_members[data] = f"{member.zone}/{member.suffix}"
        if route.members and all(route.endpoints):
            self._routes[journal] = (rev, route, self._forgotten)
        else:
            self._routes.pop(journal, None)

    def forget_data_port(self, endpoint: str) -> None:
        """Call `endpoint` over gRPC until a Route names its data port again (a restarted broker listens
        on another): the next answer naming it, even at a revision already known."""
        if self.data_endpoints.pop(endpoint, None) is not None:
            self._forgotten += 1

    def invalidate(self, journal: str) -> None:
        self._routes.pop(journal, None)

    def route(self, journal: str) -> pb.Route | None:
        known = self._routes.get(journal)
        return None if known is None else known[1]

    def append_endpoint(self, journal: str) -> str:
        """The primary's endpoint, else the default broker (which proxies to the primary)."""
        route = self.route(journal)
        if route is None or route.primary < 0:
            return self.default
        return route.endpoints[route.primary]

    def read_endpoint(self, journal: str) -> str:
        """A replica in our zone, else the primary, else any member, else the default broker."""
        route = self.route(journal)
        if route is None:
            return self.default
        if self.zone is not None:
            for i, m in enumerate(route.members):
                if m.zone == self.zone:
                    return route.endpoints[i]
        if route.primary >= 0:
            return route.endpoints[route.primary]
        return route.endpoints[0]


async def first_response(stream: Any) -> Any:
    """The first response of a server stream, which is then cancelled (a List or a metadata-only Read)."""
    async for resp in stream:
        stream.cancel()
        return resp
    raise TransportError("the broker closed the stream without a response", grpc.StatusCode.UNAVAILABLE, True)


# --- Content: what an append sends ------------------------------------------------------------------------

Content = bytes | bytearray | memoryview | Iterable[bytes] | AsyncIterable[bytes]
"""What an append sends: bytes, or chunks (sync or async). `append` also takes a function returning a
fresh Content, which it calls for each attempt, so that such content is retried like bytes."""


def nbytes(content: bytes | bytearray | memoryview) -> int:
    """Bytes, not items: a memoryview of wider items is longer than its len()."""
    return content.nbytes if isinstance(content, memoryview) else len(content)


async def chunks(content: Content) -> AsyncIterator[bytes]:
    """`content` (bytes, or a sync or async iterable of bytes) in `bytes` of at most CHUNK bytes."""
    if isinstance(content, bytes | bytearray | memoryview):
        parts: Iterable[bytes | bytearray | memoryview] = (content,)
    elif isinstance(content, AsyncIterable):
        async for chunk in content:
            for piece in _split(chunk):
                yield piece
        return
    else:
        parts = content
    for part in parts:
        for piece in _split(part):
            yield piece


def _split(part: bytes | bytearray | memoryview) -> Iterator[bytes]:
    if len(part) <= CHUNK and isinstance(part, bytes):
        if part:
            yield part
        return
    view = memoryview(part)
    for i in range(0, len(view), CHUNK):
        yield bytes(view[i : i + CHUNK])
