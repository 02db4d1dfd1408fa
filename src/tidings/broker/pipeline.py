"""Pipeline: the primary's long-lived replication streams to every peer of a Route.

The pipeline owns the primary's Spool for its life. Its *send side* is owned by one AppendFSM at a
time (the replica's `pipeline_slot`); its *receive side* is owned by the pipeline itself: a
receive task reads the peers' acknowledgements in the order the acknowledged proposals went out
and hands each set to the future `scatter()` returned for it
(gazette-transactional-appends.txt, *stateReadAcknowledgements*). An append therefore gives the
send side back as soon as its commit proposal is out (full duplex), and an append that is
cancelled while it waits can never leave its acknowledgements to be read by the next one: they
are consumed for it, in order, whatever happens to it. This is Gazette's barrier, with the
reading moved out of the request's task (Gazette's pipeline I/O runs under the replica's
context, never the request's).

Errors are kept per peer, as Gazette's `sendErrs`/`recvErrs`: a peer whose send or receive failed
is not used again, every later acknowledgement reports the failure, and `broken` says why. The
next owner of a broken (or never synchronized) pipeline shuts it down and builds a new one.

`shutdown()` is synchronous for its caller: the primary's Spool is rolled back and returned to
the replica at once (so no path can leak it), and the streams are drained and closed by a
teardown task of the replica's (`spawn`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tidings.broker import _metrics as metrics
from tidings.broker.frames import StreamError
from tidings.broker.transport import ReplicaStream
from tidings.fragment.spool import Spool
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.route import routes_equivalent

log = logging.getLogger(__name__)

TEARDOWN_TIMEOUT = 10.0  # seconds a shutdown waits for peers to answer and end their streams


class PipelineError(Exception):
    """The pipeline cannot be used (shut down, or broken); it must be rebuilt."""


@dataclass(frozen=True, slots=True)
class Acknowledgements:
    """The peers' answers to one acknowledged request, in route order (None where a peer failed),
    and the first failure of the pipeline so far (None if every peer is well)."""

    responses: list[pb.ReplicateResponse | None]
    error: str | None


class Pipeline:
    """Replication streams to the Route's peers, plus the primary's own Spool."""

    def __init__(
        self,
        header: pb.Header,
        spool: Spool,
        streams: list[ReplicaStream],
        return_spool: Callable[[Spool], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
    ) -> None:
        self.header = header
        self.route = header.route
        self._serves: pb.Route | None = None  # the last route found equivalent to ours (`serves`)
        self.spool = spool
        self.streams = streams
        self.synchronized = False  # set by the FSM once every peer agreed to a sync proposal
        self.broken: str | None = None
        self._return_spool = return_spool
        self._spawn = spawn
        self._send_errs: list[str | None] = [None] * len(streams)
        self._recv_errs: list[str | None] = [None] * len(streams)
        # (answers' future, every answer must be OK, the end its proposal commits or -1)
        self._expected: collections.deque[tuple[asyncio.Future[Acknowledgements], bool, int]] = collections.deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._receiver = asyncio.get_running_loop().create_task(
            self._receive_loop(), name=f"pipeline-acks:{spool.journal}"
        )
        self._receiver.add_done_callback(self._receiver_done)
        metrics.PIPELINES.inc()

    def __repr__(self) -> str:
        return f"Pipeline({self.spool.journal!r}, peers={[s.endpoint for s in self.streams]}, broken={self.broken!r})"

    @property
    def usable(self) -> bool:
        return self.synchronized and self.broken is None and not self._closing

    def serves(self, route: pb.Route) -> bool:
        """Whether this pipeline was built for `route`'s members and primary (endpoints aside). The last
        route found so is remembered: resolutions are shared until the keyspace changes, so an append
        usually asks about the very object the last one did (Routes are never changed in place)."""
        if route is self._serves:
            return True
        if routes_equivalent(self.route, route):
            self._serves = route
            return True
        return False

    def send_error(self) -> str | None:
        """The first send failure to any peer, if any."""
        return next((e for e in self._send_errs if e is not None), None)

    # -- send side (owned by one FSM at a time) ----------------------------------------------

    async def scatter(
        self, req: pb.ReplicateRequest, require_ok: bool = False
    ) -> asyncio.Future[Acknowledgements] | None:
        """Apply `req` to our own spool and send it to every peer that has not failed.

        An acknowledged request returns the future of the peers' answers, registered before
        anything is sent, so answers are matched to requests in send order whatever happens to
        the caller. With `require_ok` a peer answering other than OK is failed (its spool no
        longer matches ours). A send failure is kept for that peer (the receive side says more).

        The request is written to every peer's stream at once, without awaiting (never a commit on
        a subset of peers because a client went away); only then does the caller wait for the
        streams' buffers to drain, and a cancellation there just stops it waiting. That is
        `send_nowait` then `drain`, for a caller that must hold the future before it waits.
        """
        fut = self.send_nowait(req, require_ok)
        await self.drain()
        return fut

    def send_nowait(
        self, req: pb.ReplicateRequest, require_ok: bool = False
    ) -> asyncio.Future[Acknowledgements] | None:
        """`scatter` without the wait for the streams' buffers to drain (`drain()` next): once it
        returns, `req` is applied to our spool and written to every peer that has not failed."""
        if self._closing:
            raise PipelineError("the pipeline was shut down")
        resp = self.spool.apply(req, primary=True)
        if resp.status != pb.OK:  # proposals are derived from this very spool: a bug if it happens
            self.broken = f"the primary's own spool refused a proposal: {pb.Status.Name(resp.status)}"
            raise PipelineError(self.broken)
        fut: asyncio.Future[Acknowledgements] | None = None
        if req.acknowledge:
            fut = asyncio.get_running_loop().create_future()
            self._expected.append((fut, require_ok, req.proposal.end if req.HasField("proposal") else -1))
            self._wake.set()
        self._send_all(req)
        return fut

    def _send_all(self, req: pb.ReplicateRequest) -> None:
        message = req.SerializeToString()
        for i, stream in enumerate(self.streams):
            if self._send_errs[i] is None:
                try:
                    stream.send(message)
                except StreamError as exc:
                    self._fail_send(i, exc)

    async def drain(self) -> None:
        """Wait for the streams' buffers to drain (a peer whose send fails is failed)."""
        for i, stream in enumerate(self.streams):
            if self._send_errs[i] is None:
                try:
                    await stream.drain()
                except StreamError as exc:
                    self._fail_send(i, exc)

    def _fail_send(self, i: int, exc: StreamError) -> None:
        self._send_errs[i] = str(exc)
        self.broken = self.broken or f"send failed: {exc}"

    def shutdown(self) -> None:
        """Give the spool back (rolled back) now, and drain and close the streams in a teardown task.

        Called by the send-side owner; idempotent. Acknowledgements already expected are still
        read (or failed) in order.
        """
        if self._closing:
            return
        self._closing = True
        metrics.PIPELINES.dec()
        self.broken = self.broken or "shut down"
        self.spool.rollback()
        self._return_spool(self.spool)
        self._wake.set()
        task = self._spawn(self._teardown(), f"pipeline-teardown:{self.spool.journal}")
        task.add_done_callback(lambda _: self._finish())  # even if cancelled before its first step

    # -- receive side (owned by the pipeline) --------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            while not self._expected:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            fut, must_be_ok, proposed_end = self._expected[0]
            responses: list[pb.ReplicateResponse | None] = []
            for i, stream in enumerate(self.streams):
                if self._recv_errs[i] is not None:
                    responses.append(None)
                    continue
                try:
                    resp = await stream.recv()
                except StreamError as exc:
                    self._recv_errs[i] = str(exc)
                    responses.append(None)
                    continue
                if resp is None:
                    send_err = self._send_errs[i]
                    why = f" ({send_err})" if send_err else ""
                    self._recv_errs[i] = f"peer {stream.endpoint} ended its stream unexpectedly{why}"
                elif must_be_ok and resp.status != pb.OK:
                    self._recv_errs[i] = f"peer {stream.endpoint} refused a proposal: {pb.Status.Name(resp.status)}"
                responses.append(resp)
            self._expected.popleft()
            error = next((e for e in self._recv_errs if e is not None), None) or self.send_error()
            if error is not None and (self.broken is None or self.broken == "shut down"):
                self.broken = error
            if error is None and proposed_end >= 0 and all(r is not None and r.status == pb.OK for r in responses):
                self.spool.flush_head()  # our own commit is recorded before anyone hears OK
            if not fut.done():
                fut.set_result(Acknowledgements(responses, error))

    def _receiver_done(self, task: asyncio.Task[None]) -> None:
        """A receive loop that died of a bug fails every waiting append rather than leaving it hanging."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("journal %s: pipeline receive loop failed", self.spool.journal, exc_info=task.exception())
        self.broken = self.broken or f"receive loop failed: {task.exception()!r}"
        while self._expected:
            fut, _, _ = self._expected.popleft()
            if not fut.done():
                fut.set_result(Acknowledgements([], self.broken))

    async def _teardown(self) -> None:
        try:
            async with asyncio.timeout(TEARDOWN_TIMEOUT):
                await asyncio.shield(self._receiver)  # every expected acknowledgement is read (or failed)
                for i, stream in enumerate(self.streams):
                    if self._send_errs[i] is None:
                        stream.close_send()
                await self.drain()
                for i, stream in enumerate(self.streams):  # each peer now ends its stream (Gazette's gatherEOF)
                    if self._recv_errs[i] is None and self._send_errs[i] is None:
                        try:
                            if await stream.recv() is not None:
                                log.warning(
                                    "journal %s: peer %s answered after end of stream",
                                    self.spool.journal,
                                    stream.endpoint,
                                )
                        except StreamError:
                            pass
        except TimeoutError:
            log.warning(
                "journal %s: peers did not end their streams within %.0fs; cancelling them",
                self.spool.journal,
                TEARDOWN_TIMEOUT,
            )
        finally:
            self._finish()

    def _finish(self) -> None:
        """Abort the streams and fail what still waits (idempotent)."""
        self._receiver.cancel()
        for stream in self.streams:
            stream.abort()
        while self._expected:
            fut, _, _ = self._expected.popleft()
            if not fut.done():
                fut.set_result(Acknowledgements([], self.broken or "pipeline shut down"))
