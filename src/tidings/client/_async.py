"""AsyncClient, Appender and Reader: the asyncio client of the broker's Journal service (grpc.aio).

Cancellation: an `append()` or `Appender` cancelled before its commit chunk is sent is rolled
back by the broker. Once the commit chunk is out the outcome is unknown; retry with an expected
`offset` or registers when that matters. A retried append whose first attempt did commit is
written twice: appends are at-least-once, and message UUIDs (`tidings.message`) de-duplicate.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, ClassVar

import grpc

from tidings.auth.authorizer import Authorizer, CallMetadata, NoAuthorizer
from tidings.client._base import (
    CHUNK,
    DEFINITE_CODES,
    GRPC_OPTIONS,
    AppendResult,
    Content,
    Outage,
    ReadChunk,
    RetryPolicy,
    RouteCache,
    chunks,
    first_append_request,
    first_response,
    nbytes,
    registers_dict,
)
from tidings.client._wire import WireChannel, WireStub
from tidings.fragment.fragment import Fragment
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability
from tidings.protocol.labels import name_selector
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import (
    JournalNotFoundError,
    StatusError,
    SuspendedError,
    TidingsError,
    TransportError,
    UsageError,
    WrongAppendOffsetError,
    for_status,
    map_grpc_error,
)
from tidings.tasks import cancelled_under_us
from tidings.tls import TLS, channel, probe

__all__ = ["Appender", "AsyncClient", "Reader"]

log = logging.getLogger(__name__)

DOWN_FOR = 2.0  # seconds an unreachable endpoint is avoided
DATA_PORT_DOWN_FOR = 30.0  # seconds a broker's failed data port is avoided (its calls go over gRPC meanwhile)
ATTEMPT_TIMEOUT = 30.0  # seconds an append of bytes may wait for its answer (plus one per MiB)
RACES = 8  # races to the head an append_once may lose to other writers in a row before it appends anywhere
APPEND_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Journal'].full_name}/Append"
TRANSPORTS = ("grpc", "tidings")
TRANSPORT_VARIABLE = "TIDINGS_TRANSPORT"  # the default transport of every client in a process (the CLI's too)


class AsyncClient:
    """A client of a tidings cluster, reached through `endpoint` ("host:port", any broker).

    Appends go to the journal's primary and reads to a replica in `zone` once a response has
    told the client the journal's Route; until then the given broker proxies. Transient statuses
    and unreachable brokers are retried with backoff; definite refusals raise their StatusError.

    **Parameters:**
    * `endpoint` - any broker of the cluster.
    * `retries` - how many times one operation is retried before its error is raised; None: for as
      long as it takes (a long-running process's client: see `tidings.client._base`).
    * `zone` - the client's zone, for reads from a nearby replica.
    * `tls` - dial the brokers with TLS (`tidings.tls.load`: their CA, and a certificate if they
      require one); None: plaintext.
    * `auth` - what authorizes each call to brokers holding keys (`tidings.auth`): a token
      (`BearerAuthorizer`) or keys (`KeyedAuthorizer`, which signs each call's claims: `name=<journal>`
      for an append, a read or a fragments listing, a List's selector, everything for an Apply); None:
      no token. A refusal raises `UnauthenticatedError` or `NotAllowedError` (`PermissionDeniedError`),
      never retried.
    * `transport` - "tidings" (the default): calls to a broker whose data port a Route announced go over
      tidings' own framing on that port (`_wire.py`: the same messages, statuses and checks, a third of
      gRPC's cost per call), the others (and any whose data port failed lately) over gRPC; "grpc": every
      call over the brokers' gRPC service, the public, language-neutral interface. None: the
      TIDINGS_TRANSPORT variable's, else "tidings".

    Usage::

        async with AsyncClient("127.0.0.1:8080") as c:
            span = await c.append("shop/orders", b"hello\\n")
            async for chunk in c.reader("shop/orders", block=False):
                ...
    """

    attempt_timeout: ClassVar[float] = ATTEMPT_TIMEOUT  # (an append of bytes waits this, plus a second per MiB)

    def __init__(
        self,
        endpoint: str,
        retries: int | None = 20,
        *,
        zone: str | None = None,
        deadline: float = 0.0,
        fail_fast: bool = False,
        tls: TLS | None = None,
        auth: Authorizer | None = None,
        transport: str | None = None,
    ) -> None:
        if transport is None:
            transport = os.environ.get(TRANSPORT_VARIABLE) or "tidings"
            if transport not in TRANSPORTS:
                raise UsageError(f"{TRANSPORT_VARIABLE}={transport!r} is not one of {', '.join(TRANSPORTS)}: fix it")
        if transport not in TRANSPORTS:
            raise UsageError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        self.endpoint = endpoint
        self.transport = transport
        self._wires: dict[tuple[str, str], WireStub] = {}  # by data endpoint and the broker meant there
        self._data_down: dict[str, float] = {}  # data endpoint -> until when gRPC serves its broker instead
        self.tls = tls
        self.auth: Authorizer = auth if auth is not None else NoAuthorizer()
        self._selectors: dict[str, pb.LabelSelector] = {}  # `name=<journal>`, by journal: built once
        self.retry = RetryPolicy(attempts=retries, deadline=deadline)
        self.fail_fast = fail_fast  # give up at once on an address where no server ever answered
        self.routes = RouteCache(endpoint, zone)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, JournalStub] = {}
        self._appends_whole: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._down: dict[str, float] = {}
        self._answered = False  # some broker has answered this client (a wrong --broker never does)

    # -- plumbing --------------------------------------------------------------------------

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = channel(endpoint, self.tls, GRPC_OPTIONS)
        return ch

    def stub(self, endpoint: str | None = None) -> JournalStub:
        ep = endpoint or self.endpoint
        if data := self._data_port(ep):
            return self._wire(data)  # type: ignore[return-value]  # (called as a JournalStub's methods are)
        stub = self._stubs.get(ep)
        if stub is None:
            stub = self._stubs[ep] = JournalStub(self._channel(ep))  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
        return stub

    def _data_port(self, endpoint: str) -> str:
        """The data port of the broker at `endpoint` to call it on ("": over gRPC): with transport "tidings",
        the one its Route announced, unless that failed under a call lately."""
        if self.transport != "tidings" or not (data := self.routes.data_endpoints.get(endpoint)):
            return ""
        if (until := self._data_down.get(data)) is not None:
            if until > time.monotonic():
                return ""
            del self._data_down[data]
        return data

    def _wire(self, data_endpoint: str) -> WireStub:
        """Calls to the data port `data_endpoint`, of the broker the Routes say is there (a connection
        reaching another, a stale port, is refused and the client goes over gRPC meanwhile)."""
        key = (data_endpoint, self.routes.data_members.get(data_endpoint, ""))
        stub = self._wires.get(key)
        if stub is None:
            for old in [k for k in self._wires if k[0] == data_endpoint]:  # (the port's former broker's)
                self._wires.pop(old).channel.shut()
            stub = self._wires[key] = WireStub(WireChannel(data_endpoint, self.tls, member=key[1]))
        return stub

    def _append_whole(self, endpoint: str) -> grpc.aio.UnaryUnaryMultiCallable:
        """The Append method called as a unary RPC: a whole append in one message.

        The wire is the same as a client stream of one message (the broker's stream-unary
        handler reads it, then end-of-stream), but grpc.aio's unary call costs the client about
        100 µs less CPU than a streaming one, which needs a task to consume its request iterator
        (bench/README.md).
        """
        if data := self._data_port(endpoint):
            return self._wire(data).Append  # (one message: OPEN, CLOSE_SEND)
        mc = self._appends_whole.get(endpoint)
        if mc is None:
            mc = self._appends_whole[endpoint] = self._channel(endpoint).unary_unary(
                APPEND_METHOD,
                request_serializer=pb.AppendRequest.SerializeToString,
                response_deserializer=pb.AppendResponse.FromString,
                _registered_method=True,  # as the generated stub's methods are
            )
        return mc

    def _metadata(self, cap: int, journal: str | None = None, selector: pb.LabelSelector | None = None) -> CallMetadata:
        """The `authorization` metadata of a call needing `cap` over `journal` (or `selector`'s journals;
        neither: all), Gazette's per-call claims. Cheap on the append path: the selector of a journal is
        built once, and a keyed authorizer signs a token only when its cached one is half spent."""
        if journal is not None:
            selector = self._selectors.get(journal)
            if selector is None:
                selector = self._selectors[journal] = name_selector(journal)
        return self.auth.metadata(cap, selector)

    def _pick(self, preferred: str) -> str:
        """`preferred`, unless it failed moments ago: then the configured broker or another known one."""
        now = time.monotonic()
        for ep in (preferred, *self.routes.endpoints):
            if self._down.get(ep, 0) <= now:
                return ep
        return preferred

    def _append_endpoint(self, journal: str) -> str:
        """Where an append to `journal` goes now: its primary, else a broker that proxies."""
        return self._pick(self.routes.append_endpoint(journal))

    def _read_endpoint(self, journal: str) -> str:
        """Where a read of `journal` goes now: a replica (in our zone if any), else a broker that proxies."""
        return self._pick(self.routes.read_endpoint(journal))

    def _failed(self, journal: str, endpoint: str, err: TidingsError) -> None:
        """Forget what an error says is stale: the Route, and for a transport failure the endpoint.

        A `fail_fast` client (the CLI's) that no broker has answered yet raises at once a failure to
        reach one: retrying a journal that moved is right, retrying an address where nothing ever
        answered (a wrong --broker) only makes its user wait. Other clients retry as their policy
        says (a program started beside its brokers waits for them).

        A broker's data port that failed under a call (refused, lost, not serving clients: an older
        broker, an address only brokers reach) is avoided for DATA_PORT_DOWN_FOR, its broker called over
        gRPC meanwhile; the broker itself is not taken for down by it."""
        if isinstance(err, TransportError) and err.data_port:
            log.info("%s's data port %s failed (%s); calling it over gRPC for %.0fs", endpoint, err.data_port,
                     err, DATA_PORT_DOWN_FOR)  # fmt: skip
            self._data_down[err.data_port] = time.monotonic() + DATA_PORT_DOWN_FOR
        elif isinstance(err, TransportError) and err.code == grpc.StatusCode.UNAVAILABLE:
            self._down[endpoint] = time.monotonic() + DOWN_FOR
            # (its data port too: a restarted broker listens on another; gRPC until a Route names it again)
            self.routes.forget_data_port(endpoint)
            if self.fail_fast and err.unreachable and not self._answered:
                # (a TLS mismatch gRPC does not name: the probe does, in the CLI's last act, blocking)
                why = probe(endpoint, self.tls) if "Socket closed" in str(err) else ""
                msg = f"UNAVAILABLE from {endpoint}: it closed the connection at once; {why}" if why else str(err)
                raise TransportError(msg, err.code, unreachable=True) from None
        if getattr(err, "refresh_route", True):
            self.routes.invalidate(journal)

    async def backoff(self, attempt: int) -> None:
        await asyncio.sleep(self.retry.delay(attempt))

    def _retriable(self, err: TidingsError) -> bool:
        """Worth another try: a transient status or transport failure; for a client that retries for
        ever, any transport failure but one saying the request itself is wrong (a broker dying mid-call
        may end it with INTERNAL or UNKNOWN)."""
        if getattr(err, "retriable", False):
            return True
        return self.retry.forever and isinstance(err, TransportError) and err.code not in DEFINITE_CODES

    async def aclose(self) -> None:
        for wire in self._wires.values():
            await wire.channel.close()
        self._wires.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()
        self._appends_whole.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- appends ---------------------------------------------------------------------------

    async def append(
        self,
        journal: str,
        content: Content | Callable[[], Content] = b"",
        *,
        offset: int = 0,
        check_registers: pb.LabelSelector | None = None,
        union_registers: pb.LabelSet | None = None,
        subtract_registers: pb.LabelSet | None = None,
        timeout: float | None = None,
        suspend: pb.AppendRequest.Suspend = pb.AppendRequest.SUSPEND_RESUME,
        retry_unknown: bool = True,
    ) -> AppendResult:
        """Append `content` atomically; returns the committed span.

        Bytes are retried on transient failures; a stream (iterable) cannot be replayed, so its
        append is tried once. `offset` (expected write head), `check_registers`,
        `union_registers` and `subtract_registers` are Gazette's check-and-set expectations;
        `suspend` its suspension control (an append resumes a suspended journal by default; see
        `suspend()`). Without `retry_unknown`, a transport failure (whose outcome is unknown: the
        append may have committed) is raised rather than retried (which may append twice).
        `timeout` bounds each attempt (DEADLINE_EXCEEDED: the outcome is then unknown); for bytes
        it defaults to `ATTEMPT_TIMEOUT` plus a second per MiB, as an answer lost in transport (seen
        with grpc.aio while a broker dies) would otherwise never come. Streams have none by default.
        """
        first = first_append_request(journal, offset, check_registers, union_registers, subtract_registers, suspend)
        return await self._append(first, content, timeout, retry_unknown)

    async def _append(
        self,
        first: pb.AppendRequest,
        content: Content | Callable[[], Content],
        timeout: float | None,
        retry_unknown: bool,
    ) -> AppendResult:
        """`append`'s attempts: the opening message `first` is built."""
        journal = first.journal
        whole = isinstance(content, bytes | bytearray | memoryview)
        replayable = whole or callable(content)
        if timeout is None and isinstance(content, bytes | bytearray | memoryview):  # (`whole`)
            timeout = ATTEMPT_TIMEOUT + nbytes(content) / (1 << 20)
        attempt, failing_since = 0, 0.0
        while True:
            endpoint = self._append_endpoint(journal)
            try:
                return await self._append_once(endpoint, first, content() if callable(content) else content, timeout)
            except (StatusError, TransportError) as exc:
                self._failed(journal, endpoint, exc)
                failing_since = failing_since or time.monotonic()
                if not (replayable and exc.retriable and not self.retry.gives_up(attempt, failing_since)):
                    raise
                if isinstance(exc, TransportError) and not retry_unknown:
                    raise
            await self.backoff(attempt)
            attempt += 1

    async def append_once(
        self,
        journal: str,
        content: Callable[[], Content],
        size: int,
        *,
        offset: int = 0,
        timeout: float | None = None,
    ) -> AppendResult:
        """Append `content` (`size` bytes; a function giving a fresh iteration of them per attempt) into
        the journal once, even when an attempt's answer is lost in transport (`tidings journals append`).

        Each attempt asks for an exact offset (`offset`, else the head a zero-byte append took; an
        explicit 0 asks for an empty journal): an attempt reaching the primary late lands only where
        nothing else did. After a lost answer another zero-byte append tells: head unmoved (the same
        offset again), this content at the attempt's offset (that span is returned), or moved otherwise
        (no attempt at that offset can land any more: the new head, or WrongAppendOffsetError with
        `offset`). Races to the head lost to other writers are tried again at once; after RACES in a
        row, one attempt without an offset, not tried again if its answer is lost (a TidingsError names
        the offsets to read). An offset refused at the head itself is definite (WrongAppendOffsetError).
        Failures are retried within the client's retry policy. (The AppendService finds a lost batch of
        messages by their UUIDs: `_find_committed`.)
        """
        first = first_append_request(journal)
        at = offset or await self._barrier_head(journal)
        attempt, failing_since, raced = 0, 0.0, 0
        while True:
            unfenced = not offset and raced >= RACES and not failing_since
            first.ClearField("offset")
            if not unfenced:
                first.offset = at  # (set even when 0: an empty journal is asked for, not "any")
            try:
                return await self._append(first, content, timeout, retry_unknown=False)
            except WrongAppendOffsetError as exc:
                failure: TidingsError = exc
                if offset and not failing_since:
                    raise  # (the caller's offset is not the head: nothing was sent that could land)
                if not failing_since:  # (nothing of ours is in flight: a race lost, or a definite refusal)
                    moved = await self._barrier_head(journal)
                    if moved == at:
                        raise  # (refused at the head itself)
                    at, raced = moved, raced + 1
                    continue
            except TransportError as exc:
                if not (exc.retriable or exc.code == grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if unfenced:
                    raise TidingsError(f"journal {journal!r}: an append's answer was lost ({exc}) while other writers "
                                       f"kept the head moving: read from offset {at} to check before appending "
                                       "again") from None  # fmt: skip
                failure = exc
            failing_since = failing_since or time.monotonic()
            if self.retry.gives_up(attempt, failing_since):
                raise failure
            await self.backoff(attempt)
            attempt += 1
            now = await self._barrier_head(journal)
            if now == at:
                if isinstance(failure, WrongAppendOffsetError):
                    raise failure  # (refused at the head itself: definite, and nothing of ours landed)
                continue  # (nothing landed: the same offset again)
            if now >= at + size and (sha1 := await self._holds(journal, at, content())):
                return AppendResult(journal, at, at + size, {}, sha1)
            if offset:
                detail = f"the head moved from {at} to {now} meanwhile, and this content is not at {at}"
                raise WrongAppendOffsetError(journal, detail) from failure
            at = now  # (the head moved past `at`: no attempt at `at` can land any more)

    async def _barrier_head(self, journal: str) -> int:
        """The write head as a zero-byte append finds it: through the primary, after every append before."""
        return (await self.append(journal, b"")).end

    async def _holds(self, journal: str, begin: int, content: Content) -> str:
        """The content's SHA1 (hex) if the journal holds exactly it from `begin`, else ""."""
        ours, theirs, size = hashlib.sha1(), hashlib.sha1(), 0
        async for chunk in chunks(content):
            ours.update(chunk)
            size += len(chunk)
        async for part in self.read(journal, begin, end_offset=begin + size):
            theirs.update(part.content)
        return ours.hexdigest() if ours.digest() == theirs.digest() else ""

    async def _append_once(
        self, endpoint: str, first: pb.AppendRequest, content: Content, timeout: float | None = None
    ) -> AppendResult:
        """One Append RPC. Content of at most CHUNK bytes goes as one message with `commit` set, by
        a unary call on the Append method (see `_append_whole`); larger or streamed content as a
        client stream handed to grpc as an iterator (about half the cost of awaiting each write),
        whose empty chunk before end-of-stream commits.

        grpc.aio turns an exception of the request iterator into a cancelled call; such an
        exception (the content source failed) is raised here instead of the CancelledError, and a
        call grpc.aio cancelled on its own becomes a retriable TransportError.
        """
        failed: list[Exception] = []

        async def messages() -> AsyncIterator[pb.AppendRequest]:
            try:
                yield first
                async for chunk in chunks(content):
                    yield pb.AppendRequest(content=chunk)
                yield pb.AppendRequest()
            except Exception as exc:
                failed.append(exc)
                raise

        metadata = self._metadata(Capability.APPEND, first.journal)
        if isinstance(content, bytes | bytearray | memoryview) and nbytes(content) <= CHUNK:
            whole = pb.AppendRequest(content=bytes(content), commit=True)  # the whole append, one message
            whole.MergeFrom(first)
            call = self._append_whole(endpoint)(whole, timeout=timeout, metadata=metadata)
        else:
            call = self.stub(endpoint).Append(messages(), timeout=timeout, metadata=metadata)
        try:
            resp = await call
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, endpoint) from None
        except asyncio.CancelledError:
            call.cancel()
            if not cancelled_under_us():
                raise  # our caller cancelled us
            if failed:
                raise failed[0] from None
            # grpc.aio cancelled the call itself (seen while a broker stops or dies mid-call): a transport
            # failure whose outcome is unknown, not a cancellation of the caller, whose task would die of it.
            raise TransportError(
                f"{endpoint}: the append's call was cancelled in transport", grpc.StatusCode.CANCELLED, retriable=True
            ) from None
        except BaseException:
            call.cancel()
            raise
        return self._append_result(first.journal, resp)

    def _append_result(self, journal: str, resp: pb.AppendResponse) -> AppendResult:
        self._answered = True
        if resp.HasField("header"):
            self.routes.update(journal, resp.header)
        if resp.status != pb.OK:
            raise for_status(resp.status)(journal, header=resp.header)
        return AppendResult(
            journal, resp.commit.begin, resp.commit.end, registers_dict(resp.registers), resp.commit.sum.hex()
        )

    def appender(
        self,
        journal: str,
        *,
        offset: int = 0,
        check_registers: pb.LabelSelector | None = None,
        union_registers: pb.LabelSet | None = None,
        subtract_registers: pb.LabelSet | None = None,
    ) -> Appender:
        """A streaming append to `journal`: `async with client.appender(j) as a: await a.write(...)`."""
        first = first_append_request(journal, offset, check_registers, union_registers, subtract_registers)
        return Appender(self, first)

    # -- reads -----------------------------------------------------------------------------

    def reader(self, journal: str, offset: int = 0, **options: Any) -> Reader:
        """An iterator of committed content of `journal` from `offset` (-1: the write head); `options`
        (block, end_offset, direct, on_jump) as for `Reader`."""
        return Reader(self, journal, offset, **options)

    def read(self, journal: str, offset: int = 0, *, block: bool = False, end_offset: int = 0) -> Reader:
        """Committed content from `offset`: non-blocking reads stop at the write head; blocking
        reads tail until `end_offset` (0: forever)."""
        return self.reader(journal, offset, block=block, end_offset=end_offset)

    async def read_all(self, journal: str, offset: int = 0, end_offset: int = 0) -> bytes:
        """Every committed byte of `journal` from `offset` to the write head (or `end_offset`)."""
        return b"".join([c.content async for c in self.read(journal, offset, end_offset=end_offset)])

    async def write_head(self, journal: str) -> int:
        """The journal's current write head (from a metadata-only read at -1)."""
        return (await self.probe(journal, -1)).write_head

    async def probe(self, journal: str, offset: int) -> pb.ReadResponse:
        """A non-blocking, metadata-only read at `offset` (-1: the write head): status OK with the
        fragment to read it from (`offset` beyond the one asked when the broker skips a gap retention
        left), or OFFSET_NOT_YET_AVAILABLE when nothing there can be read now; and the write head."""
        req = pb.ReadRequest(journal=journal, offset=offset, metadata_only=True)
        resp: pb.ReadResponse = await self._unary(
            journal, lambda stub: first_response(stub.Read(req, metadata=self._metadata(Capability.READ, journal)))
        )
        if resp.status not in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE, pb.SUSPENDED):
            raise for_status(resp.status)(journal, header=resp.header)
        return resp

    # -- journals --------------------------------------------------------------------------

    async def list(self, selector: pb.LabelSelector | None = None) -> pb.ListResponse:
        """Journals (specs, mod revisions and Routes) matching `selector` (all when None)."""
        req = pb.ListRequest(selector=selector)
        resp: pb.ListResponse = await self._unary(
            "", lambda stub: first_response(stub.List(req, metadata=self._metadata(Capability.LIST, selector=selector)))
        )
        self._learn_routes(resp)
        return resp

    async def describe(self, journal: str) -> pb.ListResponse.Journal | None:
        """The journal as List gives it (spec, mod revision, Route), or None if it does not exist."""
        resp = await self.list(name_selector(journal))
        return next((j for j in resp.journals if j.spec.name == journal), None)

    async def spec(self, journal: str) -> pb.JournalSpec:
        """The journal's spec; JournalNotFoundError if it does not exist."""
        found = await self.describe(journal)
        if found is None:
            raise JournalNotFoundError(journal)
        return found.spec

    def _learn_routes(self, resp: pb.ListResponse) -> None:
        for j in resp.journals:
            self.routes.update(j.spec.name, pb.Header(route=j.route, etcd=resp.header.etcd))

    async def watch(self, selector: pb.LabelSelector | None = None) -> AsyncIterator[pb.ListResponse]:
        """The journal list matching `selector`, again after every change; survives broker restarts."""
        attempt, failing_since = 0, 0.0
        outage = Outage("watching the journal list")
        while True:
            endpoint = self._pick(self.endpoint)
            req = pb.ListRequest(selector=selector, watch=True)
            try:
                async for resp in self.stub(endpoint).List(
                    req, metadata=self._metadata(Capability.LIST, selector=selector)
                ):
                    self._answered = True
                    attempt, failing_since = 0, 0.0
                    outage.ok()
                    self._learn_routes(resp)
                    yield resp
            except grpc.RpcError as exc:
                err = map_grpc_error(exc, endpoint)
                self._failed("", endpoint, err)
                failing_since = failing_since or time.monotonic()
                if not (self._retriable(err) and not self.retry.gives_up(attempt, failing_since)):
                    raise err from None
                outage.failed(err)
            await self.backoff(attempt)
            attempt += 1

    async def apply(self, changes: builtins.list[pb.ApplyRequest.Change]) -> pb.ApplyResponse:
        """Create, update or delete journal specs atomically (each guarded by its expected mod revision)."""
        req = pb.ApplyRequest(changes=changes)
        resp: pb.ApplyResponse = await self._unary(
            "", lambda stub: stub.Apply(req, metadata=self._metadata(Capability.APPLY))
        )
        if resp.status != pb.OK:
            raise for_status(resp.status)(", ".join(c.upsert.name or c.delete for c in changes))
        for warning in resp.warnings:  # (e.g. a created journal over an earlier one's fragments)
            log.warning("%s", warning)
        return resp

    async def suspend(self, journal: str, force: bool = False) -> bool:
        """Suspend the journal if it is idle (gazctl's journals suspend): True once it is suspended (now
        or before), False if it holds content not yet persisted, or persisted within its flush interval
        (24 hours without one); `force` suspends it anyway (its replicas persist what they hold). A
        journal holding nothing is suspended fully (no replicas at all), else partially (one
        replica serving reads). Its next append resumes it."""
        mode = pb.AppendRequest.SUSPEND_NOW if force else pb.AppendRequest.SUSPEND_IF_FLUSHED
        try:
            await self.append(journal, b"", suspend=mode)
        except SuspendedError:
            return True
        return False

    async def members(self) -> pb.MembersResponse:
        """The cluster's brokers (their member specs), with the journals each holds and leads."""
        resp: pb.MembersResponse = await self._unary(
            "", lambda stub: stub.ListMembers(pb.MembersRequest(), metadata=self._metadata(Capability.LIST))
        )
        return resp

    async def fragments(self, journal: str) -> pb.FragmentsResponse:
        """The journal's fragments: local spools and persisted files (with their store URLs)."""
        req = pb.FragmentsRequest(journal=journal)
        resp: pb.FragmentsResponse = await self._unary(
            journal, lambda stub: stub.ListFragments(req, metadata=self._metadata(Capability.READ, journal))
        )
        if resp.status != pb.OK:
            raise for_status(resp.status)(journal, header=resp.header)
        return resp

    async def _unary(self, journal: str, call: Callable[[JournalStub], Any]) -> Any:
        """One request/response exchange with any broker, retried while the failure is transient (`call`
        asks for its metadata at each attempt: a keyed authorizer's token stays current)."""
        attempt, failing_since = 0, 0.0
        outage = Outage(f"a request for journal {journal}" if journal else "a request to the brokers")
        while True:
            endpoint = self._read_endpoint(journal) if journal else self._pick(self.endpoint)
            try:
                resp = await call(self.stub(endpoint))
            except grpc.RpcError as exc:
                err = map_grpc_error(exc, endpoint)
                self._failed(journal, endpoint, err)
                failing_since = failing_since or time.monotonic()
                if not (self._retriable(err) and not self.retry.gives_up(attempt, failing_since)):
                    raise err from None
                outage.failed(err)
            else:
                self._answered = True
                status = getattr(resp, "status", pb.OK)
                if journal and resp.HasField("header"):
                    self.routes.update(journal, resp.header)
                failing_since = failing_since or time.monotonic()
                if status == pb.OK or not for_status(status).retriable or self.retry.gives_up(attempt, failing_since):
                    outage.ok()
                    return resp
                outage.failed(for_status(status)(journal, header=resp.header))
                self.routes.invalidate(journal)
            await self.backoff(attempt)
            attempt += 1


class Appender:
    """One streaming append: `write()` chunks, then `commit()`; or `abort()` to roll it back.

    As an async context manager it commits when the block succeeds and rolls back when it
    raises. Content streams to the broker as it is written (nothing is buffered), so a stream is
    not retried; `commit()` raises the refusal (REGISTER_MISMATCH, ...) if the broker refused.
    """

    def __init__(self, client: AsyncClient, first: pb.AppendRequest) -> None:
        self.client = client
        self.journal = first.journal
        self._first = first
        self._call: Any = None
        self._endpoint = ""
        self.result: AppendResult | None = None

    async def __aenter__(self) -> Appender:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            await self.commit()
        else:
            self.abort()

    async def open(self) -> None:
        if self._call is not None:
            raise UsageError(f"appender of {self.journal!r} is already open")
        self._endpoint = self.client._append_endpoint(self.journal)
        metadata = self.client._metadata(Capability.APPEND, self.journal)
        self._call = self.client.stub(self._endpoint).Append(metadata=metadata)
        await self._send(self._first)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Stream `data` (in chunks) as part of this append."""
        if self._call is None:
            await self.open()
        async for chunk in chunks(data):
            await self._send(pb.AppendRequest(content=chunk))

    async def commit(self) -> AppendResult:
        """Send the commit chunk and end the stream; returns the committed span."""
        if self._call is None:
            await self.open()
        await self._send(pb.AppendRequest())
        try:
            await self._call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the broker answered early; its answer follows
        self.result = await self._outcome()
        return self.result

    def abort(self) -> None:
        """Roll the append back (cancel the stream). Safe to call at any time."""
        if self._call is not None and self.result is None:
            self._call.cancel()

    async def _send(self, req: pb.AppendRequest) -> None:
        try:
            await self._call.write(req)
        except (grpc.RpcError, asyncio.InvalidStateError):
            await self._outcome()  # the broker refused or failed early: raise what it said
            raise UsageError(f"append to {self.journal!r} ended before it was committed") from None

    async def _outcome(self) -> AppendResult:
        try:
            resp = await self._call
        except grpc.RpcError as exc:
            err = map_grpc_error(exc, self._endpoint)
            self.client._failed(self.journal, self._endpoint, err)
            raise err from None
        return self.client._append_result(self.journal, resp)


class Reader:
    """Committed content of a journal from an offset, as an async iterator of ReadChunk.

    It survives broker restarts and Route changes: a failed or ended stream is re-opened at the
    next unread offset, against a replica chosen from the newest Route. When the journal skips
    ahead (content removed by retention, or never written), the jump is recorded in `jumps` and
    passed to `on_jump(from, to)`. With `direct`, persisted fragments are read straight from
    their store (fsspec) instead of through the broker.

    **Parameters:**
    * `offset` - where to start; -1 is the write head.
    * `block` - wait for content at the write head (tail the journal); else stop there.
    * `end_offset` - stop here (0: no end).
    """

    def __init__(
        self,
        client: AsyncClient,
        journal: str,
        offset: int = 0,
        *,
        block: bool = True,
        end_offset: int = 0,
        direct: bool = False,
        on_jump: Callable[[int, int], Any] | None = None,
    ) -> None:
        self.client = client
        self.journal = journal
        self.offset = offset
        self.block = block
        self.end_offset = end_offset
        self.direct = direct
        self.on_jump = on_jump
        self.write_head = 0
        self.jumps: list[tuple[int, int]] = []
        self.direct_reads = 0  # fragments read straight from their store
        self._it: AsyncGenerator[ReadChunk, None] | None = None

    def __aiter__(self) -> Reader:
        return self

    async def __anext__(self) -> ReadChunk:
        if self._it is None:
            self._it = self._chunks()
        return await self._it.__anext__()

    async def aclose(self) -> None:
        if self._it is not None:
            await self._it.aclose()

    def _done(self) -> bool:
        return bool(self.end_offset) and self.offset >= self.end_offset

    def _jump_to(self, offset: int) -> None:
        if self.offset >= 0 and offset > self.offset:
            log.info("journal %s: read offset jumps from %d to %d", self.journal, self.offset, offset)
            self.jumps.append((self.offset, offset))
            if self.on_jump is not None:
                self.on_jump(self.offset, offset)
        self.offset = offset

    async def _chunks(self) -> AsyncGenerator[ReadChunk, None]:
        client = self.client
        attempt = suspended = 0
        failing_since = 0.0
        outage = Outage(f"reading journal {self.journal}")
        while not self._done():
            endpoint = client._read_endpoint(self.journal)
            req = pb.ReadRequest(
                journal=self.journal,
                offset=self.offset,
                block=self.block,
                end_offset=self.end_offset,
                metadata_only=self.direct,
            )
            stream = client.stub(endpoint).Read(req, metadata=client._metadata(Capability.READ, self.journal))
            fragment: Fragment | None = None
            suspended_before = suspended
            try:
                async for resp in stream:
                    client._answered = True
                    if resp.status == pb.OK and (failing_since or attempt):  # a replica serves the read again:
                        failing_since, attempt = 0.0, 0  # a later failure is a new one (its own budget and deadline)
                        outage.ok()
                    if resp.HasField("header"):
                        client.routes.update(self.journal, resp.header)
                    if resp.status in (pb.OFFSET_NOT_YET_AVAILABLE, pb.SUSPENDED):
                        self.write_head = resp.write_head  # (a fully suspended journal holds nothing to read)
                        if resp.status == pb.OFFSET_NOT_YET_AVAILABLE or not self.block:
                            return
                        suspended += 1  # blocking: wait, ever less often, for an append to resume it
                        break
                    if resp.status != pb.OK:
                        raise for_status(resp.status)(self.journal, header=resp.header)
                    if resp.write_head:
                        self.write_head = resp.write_head
                    if resp.HasField("fragment"):
                        self._jump_to(resp.offset)
                        fragment = Fragment.from_proto(resp.fragment)
                        continue
                    if resp.content:
                        if resp.offset != self.offset:
                            self._jump_to(resp.offset)
                        self.offset = resp.offset + len(resp.content)
                        attempt = 0
                        yield ReadChunk(resp.offset, resp.content, self.write_head)
                if self.direct and fragment is not None:  # (in the try: the fallback's broker read fails as any)
                    async for chunk in self._from_store_or_broker(endpoint, fragment):
                        attempt = 0
                        yield chunk
                    continue
            except grpc.RpcError as exc:
                err: TidingsError = map_grpc_error(exc, endpoint)
            except StatusError as exc:
                err = exc
            else:
                if not self.block and self.end_offset and self.offset >= self.end_offset:
                    return
                # The broker ended the read before its end (a non-blocking one ends at the head with
                # OFFSET_NOT_YET_AVAILABLE, above): the replica moved, the caller's token expired, or the
                # journal is suspended: re-open it.
                await client.backoff(min(suspended, 5) if suspended > suspended_before else 0)
                continue
            finally:
                stream.cancel()
            client._failed(self.journal, endpoint, err)
            failing_since = failing_since or time.monotonic()
            if not (client._retriable(err) and not client.retry.gives_up(attempt, failing_since)):
                raise err
            outage.failed(err)
            await client.backoff(attempt)
            attempt += 1

    async def _from_store_or_broker(self, endpoint: str, fragment: Fragment) -> AsyncIterator[ReadChunk]:
        """Read the fragment covering our offset: from its store when persisted, else through the broker."""
        until = fragment.end if not self.end_offset else min(fragment.end, self.end_offset)
        if fragment.backing_store:
            try:
                async for chunk in self._read_store(fragment, until):
                    yield chunk
                self.direct_reads += 1
                return
            except Exception as exc:  # no credentials or route to the store here, say: the broker can read it
                log.warning("journal %s: reading fragment %s from its store failed (%s: %s); reading through "
                            "the broker", self.journal, fragment.content_name(), type(exc).__name__, exc)  # fmt: skip
        req = pb.ReadRequest(journal=self.journal, offset=self.offset, end_offset=until)
        stream = self.client.stub(endpoint).Read(req, metadata=self.client._metadata(Capability.READ, self.journal))
        try:
            async for resp in stream:
                if resp.status != pb.OK:
                    return  # gone or not yet there: the caller's loop re-resolves
                if resp.content:
                    if resp.offset != self.offset:
                        self._jump_to(resp.offset)
                    self.offset = resp.offset + len(resp.content)
                    yield ReadChunk(resp.offset, resp.content, self.write_head)
        finally:
            stream.cancel()

    async def _read_store(self, fragment: Fragment, until: int) -> AsyncIterator[ReadChunk]:
        from tidings.fragment.store import store_for  # (fsspec: only for a read straight from the store)

        src = await asyncio.to_thread(store_for(fragment.backing_store).open, fragment)
        try:
            skip = self.offset - fragment.begin
            while skip > 0:
                data = await asyncio.to_thread(src.read, min(CHUNK, skip))
                if not data:
                    raise TransportError(f"fragment {fragment.content_name()} is shorter than its name says")
                skip -= len(data)
            while self.offset < until:
                data = await asyncio.to_thread(src.read, min(CHUNK, until - self.offset))
                if not data:
                    raise TransportError(f"fragment {fragment.content_name()} is shorter than its name says")
                chunk = ReadChunk(self.offset, data, self.write_head)
                self.offset += len(data)
                yield chunk
        finally:
            await asyncio.to_thread(src.close)
