"""A target's link: its health checker, and per connection one writer and one reader task
(logplayer-paper.txt, sections 2.4 and 2.5.2; the asyncio form of Algorithm 4).

The paper drives every stream from one gRPC completion queue and its consumer thread: a write's
completion releases the stream's next write, a read's completion is an acknowledgement. Here each
connection has a *writer* task (at most one write in flight: it sends the next batch once the
previous write completed) and a *reader* task (each acknowledgement erases the batches up to it
and advances the target's last_ack); both run on the LogPlayer's one event loop, so queue and
dispatcher operations stay synchronous, as the model's coarse granularity assumes.

`TargetLink.run` is the target's health checker: connect, open the stream (the target answers
with its last applied index *before* the queue begins recovery: an older stream's batch in
flight cannot be applied after that answer), then hand the returning target to the LogPlayer
(`on_open`: recovery stream or straight back to normal), and watch. A failed connection, a
refused batch, an acknowledgement naming no batch sent (a target answering a wrong index is not
trusted), a stream that ends, or no acknowledgement within `ack_timeout` while batches wait (a
stopped target: SIGSTOP keeps its TCP connection up) fails the link: its tasks are cancelled
before the queue is suspended, so no task of a dead connection touches the queue again, and the
link reconnects with backoff. TARGET_FENCED stops the LogPlayer (a newer one holds the target).
Each connection's stream carries a token from `auth` (APPEND on `target=<id>`): a keyed authorizer signs
a current one at each reconnection, so a stream the target ends at its token's expiry comes back.

With `transport` "tidings" (the client's default) a connection is the target's data port (tidings'
framing: `broker/transport_rpc.py`'s TARGET service; the same messages, fencing and statuses, a
fraction of gRPC's cost per batch), learned from its GetLastAck answer (the LogPlayer's start asks
every target; a link that has none asks again over gRPC before connecting); a data port that fails
(refused, lost, another target's) is avoided for DATA_PORT_DOWN_FOR and the link delivers over gRPC
meanwhile. Either way one connection, one writer and one reader per link, as the model checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from tidings.auth.authorizer import Authorizer, NoAuthorizer
from tidings.broker.transport_rpc import TARGET
from tidings.client._wire import WireCall, WireChannel, WireError, WireStub
from tidings.logplayer.dispatcher import Dispatcher
from tidings.logplayer.target_queue import QueueState, TargetQueue
from tidings.logplayer.wal import Target
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.claims import Capability
from tidings.protocol.labels import name_selector
from tidings.protocol.status import TargetFencedError, TidingsError, for_status
from tidings.tls import TLS
from tidings.tls import channel as tls_channel

__all__ = ["CHANNEL_OPTIONS", "MAX_BATCH_BYTES", "MESSAGE_OPTIONS", "LinkFailed", "TargetLink"]

log = logging.getLogger(__name__)

# A WAL entry is at most 64 MiB (the framing's limit): a batch of one, with its protobuf framing,
# fits in a message; a batch of several is bounded by MAX_BATCH_BYTES. Targets accept as much.
MAX_MESSAGE = 80 << 20
MAX_BATCH_BYTES = 4 << 20
MESSAGE_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    *MESSAGE_OPTIONS,
]


# The LogPlayer's own share of its delay: a batch's oldest entry's dispatch to the batch written to the target's
# connection (what follows, until the target reads it, is the network's and the target host's); once a batch,
# not per entry, so a large batch costs one observation. Fine buckets: tenths of milliseconds matter here.
SEND_DELAY = Histogram(
    "tidings_logplayer_send_delay_seconds",
    "From the dispatch of a batch's oldest entry to the batch's write to a target's connection",
    ["wal"],
    buckets=(5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 0.025, 0.1, 1),
)

DATA_PORT_DOWN_FOR = 30.0  # seconds a target's failed data port is avoided (gRPC meanwhile)


class LinkFailed(TidingsError):
    """This connection to the target is done for; the link reconnects."""


class TargetLink:
    """One target's connection, health checker, writer and reader; see the module docstring."""

    def __init__(
        self,
        target: Target,
        dispatcher: Dispatcher,
        on_open: Callable[[TargetLink, int], None],
        open_request: pb.DeliverRequest,
        *,
        max_batch: int = 256,
        ack_timeout: float = 5.0,
        backoff: tuple[float, float] = (0.05, 2.0),
        tls: TLS | None = None,
        auth: Authorizer | None = None,
        transport: str = "tidings",
        data_endpoint: str = "",
    ) -> None:
        self.target = target
        self.transport = transport
        self.data_endpoint = data_endpoint  # the target's data port ("": not known, or avoided)
        self._data_down_until = 0.0
        self.tls = tls
        self.auth: Authorizer = auth if auth is not None else NoAuthorizer()
        self._selector = name_selector(target.id, "target")  # (what its token covers)
        self.id = target.id
        self.dispatcher = dispatcher
        self.queue: TargetQueue = dispatcher.queues[target.id]
        self.on_open = on_open
        self.open_request = open_request
        self._send_delay = SEND_DELAY.labels(open_request.open.wal)
        self.max_batch = max_batch
        self.ack_timeout = ack_timeout
        self.backoff = backoff
        self.wake = asyncio.Event()  # set when the queue got something to send
        self.room = asyncio.Event()  # set when the writer took entries (a recovery waiting for room)
        self.opened = asyncio.Event()  # set once the target answered an Open (the first time)
        self.up = False
        self.sent = -1  # the last index written on this connection (the next batch's prev_index)
        self.last_progress = 0.0  # monotonic: the last acknowledgement, or the first write after none waited
        self.last_error = ""
        self._doomed = ""  # why the LogPlayer gave this connection up (fail_soon)

    async def run(self) -> None:
        """Connect, deliver, and reconnect after each failure, for ever (TargetFencedError ends it)."""
        delay = self.backoff[0]
        while True:
            try:
                await self._connection()
            except WireError as exc:
                self.last_error = _describe(exc)
                if exc.data_port:
                    log.info("target %s: its data port %s failed (%s); delivering over gRPC for %.0fs", self.id,
                             exc.data_port, self.last_error, DATA_PORT_DOWN_FOR)  # fmt: skip
                    self.data_endpoint, self._data_down_until = "", time.monotonic() + DATA_PORT_DOWN_FOR
            except (LinkFailed, grpc.aio.AioRpcError, asyncio.InvalidStateError, OSError, TimeoutError) as exc:
                self.last_error = _describe(exc)
            except TargetFencedError:
                self._fail()
                raise
            except TidingsError as exc:  # TARGET_NOT_FOUND, say: a misconfiguration, said and retried
                self.last_error = str(exc)
            except BaseException:
                self._fail()
                raise
            was_up = self.up
            self._fail()
            if was_up:
                delay = self.backoff[0]
                log.warning("target %s at %s failed: %s; reconnecting", self.id, self.target.endpoint, self.last_error)
            elif delay < self.backoff[1] <= delay * 2:
                log.warning("target %s at %s is down: %s; still trying", self.id, self.target.endpoint, self.last_error)
            await asyncio.sleep(delay)  # the health checker's backoff, not a synchronisation
            delay = min(delay * 2, self.backoff[1])

    def fail_soon(self, why: str) -> None:
        """Give the connection up from outside (a queue too long, a recovery that failed): the queue
        is suspended now, and the writer ends the connection."""
        if self.queue.state is not QueueState.SUSPENDED:
            self.queue.suspend()
        self._doomed = why
        self.wake.set()

    def _fail(self) -> None:
        if self.queue.state is not QueueState.SUSPENDED:
            self.queue.suspend()
        self.up = False
        self.room.set()  # (a recovery waiting for room sees its term go stale)

    @contextlib.asynccontextmanager
    async def _deliver_call(self) -> AsyncIterator[Any]:
        """A Deliver call on this connection: over the target's data port when there is one to use (asked
        for over gRPC when not known), else over gRPC."""
        metadata = self.auth.metadata(Capability.APPEND, self._selector)  # (a current token per connection)
        wanted = self.transport == "tidings" and time.monotonic() >= self._data_down_until
        if wanted and not self.data_endpoint:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                self.data_endpoint = await self._ask_data_endpoint()
        if wanted and self.data_endpoint:
            channel = WireChannel(self.data_endpoint, self.tls, member=self.id, service=TARGET)
            try:
                yield WireStub(channel).Deliver(metadata=metadata)
            finally:
                await channel.close()
            return
        async with tls_channel(self.target.endpoint, self.tls, CHANNEL_OPTIONS) as grpc_channel:
            yield pb_grpc.TargetStub(grpc_channel).Deliver(metadata=metadata)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped

    async def _ask_data_endpoint(self) -> str:
        """The target's data port, from a GetLastAck over gRPC ("": it has none)."""
        async with tls_channel(self.target.endpoint, self.tls, CHANNEL_OPTIONS) as channel:
            metadata = self.auth.metadata(Capability.READ, self._selector)
            req = pb.LastAckRequest(target=self.id)
            stub = pb_grpc.TargetStub(channel)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
            resp: pb.LastAckResponse = await stub.GetLastAck(req, timeout=self.ack_timeout, metadata=metadata)
        return data_endpoint(self.target.endpoint, resp)

    async def _connection(self) -> None:
        async with self._deliver_call() as call:
            try:
                try:
                    await asyncio.wait_for(self._open(call), self.ack_timeout)
                except TimeoutError:
                    if isinstance(call, WireCall) and not call.reached():  # (a data port dropped by a firewall, say)
                        why = f"{self.data_endpoint}: no tidings data port answered within {self.ack_timeout:g}s"
                        raise WireError(grpc.StatusCode.UNAVAILABLE, why, self.data_endpoint) from None
                    raise
                tasks = [
                    asyncio.create_task(self._write(call), name=f"write:{self.id}"),
                    asyncio.create_task(self._read(call), name=f"read:{self.id}"),
                    asyncio.create_task(self._watch(), name=f"watch:{self.id}"),
                ]
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                for task in done:
                    task.result()  # (raises what failed the connection)
                raise LinkFailed("the stream ended")
            finally:
                call.cancel()

    async def _open(self, call: grpc.aio.StreamStreamCall) -> None:
        await call.write(self.open_request)
        resp = await call.read()
        if resp is grpc.aio.EOF:
            raise LinkFailed("the target closed the stream before answering Open")
        if resp.status != pb.OK:
            raise self._refusal(resp)
        self.sent = resp.last_applied
        self._doomed = ""
        self.up = True
        self.last_progress = time.monotonic()
        self.opened.set()
        log.info("target %s at %s: stream open, last applied %d", self.id, self.target.endpoint, resp.last_applied)
        self.on_open(self, resp.last_applied)  # (synchronously: no dispatch between the answer and recovery)

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        queue, wake = self.queue, self.wake
        while True:
            if self._doomed:
                raise LinkFailed(self._doomed)
            batch = queue.next_batch(self.max_batch, MAX_BATCH_BYTES)
            if not batch:
                wake.clear()
                await wake.wait()
                continue
            self.room.set()
            if not queue.popped:
                self.last_progress = time.monotonic()
            queue.pop_batch()
            req = pb.DeliverRequest(
                prev_index=self.sent,
                entries=[
                    pb.TargetEntry(
                        index=e.index, mutations=e.mutations, committed_ns=e.committed_ns, dispatched_ns=e.dispatched_ns
                    )
                    for e in batch
                ],
            )
            self.sent = batch[-1].index
            try:
                await call.write(req)
            except asyncio.InvalidStateError:  # (the target ended the stream: say why, as the reader would)
                raise LinkFailed(f"{(await call.code()).name}: {await call.details()}") from None
            if oldest := next((e.dispatched_ns for e in batch if e.dispatched_ns), 0):  # (a dummy entry has none)
                self._send_delay.observe((time.time_ns() - oldest) / 1e9)  # (once a batch: its longest wait)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        queue, acknowledged = self.queue, self.dispatcher.acknowledged
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                raise LinkFailed("the target ended the stream")
            if resp.status != pb.OK:
                raise self._refusal(resp)
            if not queue.erase(resp.last_applied):
                if self._doomed:
                    raise LinkFailed(self._doomed)
                raise LinkFailed(f"acknowledged index {resp.last_applied}, which ends no batch sent: not trusted")
            acknowledged(self.id, resp.last_applied)
            self.last_progress = time.monotonic()

    def _refusal(self, resp: pb.DeliverResponse) -> Exception:
        try:
            return for_status(resp.status)("", f"target {self.id}: {resp.detail}")
        except KeyError:  # (a status of another version: the connection fails, the link retries)
            return LinkFailed(f"answered status {resp.status}, which this LogPlayer does not know: {resp.detail}")

    async def _watch(self) -> None:
        """No acknowledgement for `ack_timeout` while batches wait for one: the target is stopped or stuck."""
        while True:
            await asyncio.sleep(self.ack_timeout / 4)  # (a periodic health check)
            if self._doomed:  # (fail_soon while the writer waits on a write the target does not take)
                raise LinkFailed(self._doomed)
            if self.queue.popped and time.monotonic() - self.last_progress > self.ack_timeout:
                raise LinkFailed(f"no acknowledgement for {self.ack_timeout:g}s")


def data_endpoint(endpoint: str, answer: pb.LastAckResponse) -> str:
    """The data port a target's GetLastAck `answer` names, on the host of the `endpoint` it came from."""
    if answer.status != pb.OK or not answer.data_port:
        return ""
    return f"{endpoint.rpartition(':')[0]}:{answer.data_port}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError | WireError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "no answer to Open in time"
    return str(exc) or type(exc).__name__
