"""Append RPC: validate the first message, run the AppendFSM, map its end state to a response.

This is the only place an FSM's end state becomes an answer: a Status returns as a normal
response with a Header (so clients refresh their Route); a surprise becomes a gRPC error with
the code the FSM chose (UNAVAILABLE for replication failures, ABORTED for a rolled-back append,
INVALID_ARGUMENT for bad input); a client's cancellation rolls back quietly. Non-primary brokers
proxy the stream to the primary.

Every Append RPC ends with a status. A handler that ended in a CancelledError that is not its
own task's cancellation (grpc.aio raises those from calls cancelled under us) would send none and
leave its client waiting forever, so such an error, and any other surprise, becomes UNAVAILABLE
or INTERNAL with a message naming the journal.

Auth: the FSM resolves with the caller's claims (a journal they do not cover is JOURNAL_NOT_FOUND); a
proxied append carries the broker's own token for that journal alone (never the caller's); a stream
still sending once the caller's token expired is rolled back (ABORTED: a retry presents a current
token, or is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import grpc

from tidings.auth import expires_at
from tidings.broker import _metrics as metrics
from tidings.broker.append_fsm import AppendFSM, AppendState
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.labels import name_selector
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import ValidationError
from tidings.tasks import cancelled_under_us

if TYPE_CHECKING:
    from tidings.broker.host import Host

log = logging.getLogger(__name__)


# A proxied call that ended so says the primary (or the connection to it) went away mid-append:
# the outcome is unknown and the client should retry, which UNAVAILABLE tells it.
_PRIMARY_GONE = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})


class ClientStalled(Exception):
    """The client streamed slower than the minimum flow rate; its append is rolled back."""


class TokenExpired(Exception):
    """The client's token expired while it streamed (Gazette ends the RPC at its token's expiry); its
    append is rolled back."""


DRAIN_SECONDS = 2.0  # how long an early answer waits for the client to finish sending
DRAIN_BYTES = 64 << 20  # and how much of its content it reads (and drops) meanwhile


class _ClientStream:
    """The client's messages after the first: validated, policed for flow rate, drained at the end.

    Enforces the minimum flow rate: each message must arrive within `stall_timeout`, and after
    that long the stream must average at least `min_append_rate` bytes per second.
    """

    def __init__(
        self,
        broker: Host,
        context: grpc.aio.ServicerContext,
        throttled: Callable[[], float] = lambda: 0.0,
        expires: float = float("inf"),
    ) -> None:
        self._context = context
        self._cfg = broker.config
        self._expires = expires  # (Unix seconds, leeway included) the client's token expires
        self._throttled = throttled  # seconds the broker held the append back (broker/flow.py): not the client's
        self._started = 0.0  # (the first read: time queued for the pipeline before it is not the client's)
        self.police_rate = True  # (off when proxying: the primary polices, and throttles, the stream)
        self._received = 0
        self.ended = False  # the client half-closed its stream

    async def next_message(self) -> pb.AppendRequest | None:
        """The client's next validated message, None at end-of-stream."""
        cfg = self._cfg
        self._started = self._started or time.monotonic()
        try:
            async with asyncio.timeout(cfg.stall_timeout):
                msg = await self._context.read()
        except TimeoutError:
            raise ClientStalled(f"no content for {cfg.stall_timeout}s") from None
        if msg is grpc.aio.EOF:
            self.ended = True
            return None
        validate.append_content(msg)
        if time.time() > self._expires:
            raise TokenExpired("the token expired during the append: retry with a current one")
        self._received += len(msg.content)
        elapsed = time.monotonic() - self._started - self._throttled()
        if self.police_rate and elapsed > cfg.stall_timeout and self._received / elapsed < cfg.min_append_rate:
            raise ClientStalled(f"{self._received / elapsed:.0f} B/s is below the minimum {cfg.min_append_rate} B/s")
        return cast(pb.AppendRequest, msg)  # (not EOF: a message; grpc.aio is untyped)

    async def drain(self) -> None:
        """Read (and drop) what the client still sends, briefly, before an early answer.

        A client still writing when the answer arrives gets, from grpc.aio, the status of its own
        failed write ("INTERNAL: Internal error from Core") instead of ours; letting it finish
        first delivers the real answer. Bounded in time and bytes.
        """
        if self.ended:
            return
        dropped = 0
        with contextlib.suppress(TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
            async with asyncio.timeout(DRAIN_SECONDS):
                while dropped < DRAIN_BYTES:
                    msg = await self._context.read()
                    if msg is grpc.aio.EOF:
                        self.ended = True
                        return
                    dropped += len(msg.content)


async def serve_append(broker: Host, context: grpc.aio.ServicerContext, claims: Claims) -> pb.AppendResponse:
    """Serve one Append RPC for the holder of `claims`; see the module docstring for how each outcome is
    answered."""
    journal: list[str] = []  # filled with the journal's name once the first message is read
    try:
        return await _serve_append(broker, context, claims, journal)
    except asyncio.CancelledError:
        if not cancelled_under_us():
            raise  # the client went away: there is nobody to answer
        metrics.RPC_STATUS.labels("append", "UNAVAILABLE").inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "append was interrupted inside the broker; retry")
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        log.exception("append to journal %s failed unexpectedly", journal[0] if journal else "?")
        metrics.RPC_STATUS.labels("append", "INTERNAL").inc()
        await context.abort(grpc.StatusCode.INTERNAL, f"append failed inside the broker: {exc!r}")
    raise AssertionError("unreachable")


async def _serve_append(
    broker: Host, context: grpc.aio.ServicerContext, claims: Claims, journal: list[str]
) -> pb.AppendResponse:
    first = await context.read()
    if first is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "append: empty stream; send the journal first")
    try:
        validate.append_request_first(first)
    except ValidationError as exc:
        metrics.RPC_STATUS.labels("append", "INVALID_ARGUMENT").inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    journal.append(first.journal)
    fsm = AppendFSM(broker, first, claims=claims)
    client = _ClientStream(broker, context, lambda: fsm.throttled, expires_at(claims))
    next_message = client.next_message
    try:
        end = await fsm.run(next_message)
    except ValidationError as exc:
        await client.drain()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    assert fsm.resolved is not None or end is AppendState.ERROR
    header = fsm.resolved.header if fsm.resolved is not None else pb.Header()
    if end is AppendState.PROXY:
        if first.do_not_proxy:
            return _respond("append", pb.AppendResponse(status=pb.NOT_JOURNAL_PRIMARY_BROKER, header=header))
        return await _proxy(broker, fsm, first, client, context, claims)
    if end is AppendState.FINISHED:
        assert fsm.commit is not None
        status = pb.SUSPENDED if fsm.suspended else pb.OK  # (a suspend request: the journal is suspended)
        return _respond(
            "append",
            pb.AppendResponse(status=status, header=header, commit=fsm.commit, registers=fsm.registers),
        )
    await client.drain()  # an early answer: let the client finish writing first
    if fsm.status != pb.OK:
        return _respond("append", pb.AppendResponse(status=fsm.status, header=header, registers=fsm.registers))
    code = fsm.error_code
    metrics.RPC_STATUS.labels("append", code.name).inc()
    if isinstance(fsm.client_error, ValidationError):
        await context.abort(code, f"{fsm.client_error} (the append was rolled back)")
    if code is grpc.StatusCode.UNAVAILABLE:
        await context.abort(code, f"append to {first.journal!r}: {fsm.error}; retry")
    await context.abort(code, f"append to {first.journal!r} rolled back: {fsm.error}")
    raise AssertionError("unreachable")


def _respond(rpc: str, resp: pb.AppendResponse) -> pb.AppendResponse:
    metrics.RPC_STATUS.labels(rpc, pb.Status.Name(resp.status)).inc()
    return resp


async def _proxy(
    broker: Host,
    fsm: AppendFSM,
    first: pb.AppendRequest,
    client: _ClientStream,
    context: grpc.aio.ServicerContext,
    claims: Claims,
) -> pb.AppendResponse:
    """Forward the whole stream to the primary, with our Header so it reads through our revision, and our
    own token for this journal alone, expiring no later than the caller's (Gazette's proxyAppend)."""
    assert fsm.resolved is not None
    endpoint = fsm.resolved.primary_endpoint()
    assert endpoint is not None  # (PROXY: the route has a primary)
    req = pb.AppendRequest()
    req.CopyFrom(first)
    req.header.CopyFrom(fsm.resolved.header)
    req.do_not_proxy = True
    client.police_rate = False
    metadata = broker.authorizer.metadata(Capability.APPEND, name_selector(first.journal), claims.exp)
    call = JournalStub(broker.channel(endpoint)).Append(metadata=metadata)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
    try:
        try:
            await call.write(req)
            while (msg := await client.next_message()) is not None:
                await call.write(msg)
            await call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the primary answered early (a refusal, or it failed): its status follows
        resp = await call
    except grpc.RpcError as exc:
        await client.drain()
        code = exc.code()
        if code in _PRIMARY_GONE:  # e.g. grpc's "Internal error from Core" when the primary dies mid-call
            code = grpc.StatusCode.UNAVAILABLE
        await context.abort(code, f"proxied to the primary {endpoint}: {exc.code().name}: {exc.details()}")
        raise AssertionError("unreachable") from None
    except (ClientStalled, TokenExpired, ValidationError) as exc:
        call.cancel()  # the primary rolls the append back
        await client.drain()
        code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, ValidationError) else grpc.StatusCode.ABORTED
        await context.abort(code, f"append to {first.journal!r} rolled back: {exc}")
        raise AssertionError("unreachable") from None
    except asyncio.CancelledError:
        call.cancel()
        if not cancelled_under_us():
            raise
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"proxied append to the primary {endpoint} was interrupted")
        raise AssertionError("unreachable") from None
    except BaseException:
        call.cancel()
        raise
    if resp.status != pb.OK:
        await client.drain()
    return _respond("append", resp)
