"""Pipeline: the primary's long-lived Replicate streams to every peer of a Route.

The pipeline owns the primary's Spool for its life and is itself owned by one AppendFSM at a
time (the replica's `pipeline_slot`). Ownership is split into a *send* side and a *receive*
side so appends run full duplex (gazette-transactional-appends.txt, *stateReadAcknowledgements*):
an append that has sent its commit proposal takes a place in the `barrier()` queue, gives the
send side back, and reads its acknowledgements only once its predecessor has read its own.
Acknowledgements therefore come back in the order proposals went out.

Send errors are kept per peer and reported when acknowledgements are gathered, where the
receive error says more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from tidings.fragment.spool import Spool
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub

log = logging.getLogger(__name__)


class PipelineError(Exception):
    """A peer stream failed or answered out of protocol; the pipeline must be rebuilt."""


class Pipeline:
    """Replicate streams to the Route's peers, plus the primary's own Spool."""

    def __init__(self, header: pb.Header, spool: Spool, channels: dict[str, grpc.aio.Channel]) -> None:
        self.header = header
        self.spool = spool
        self.route = header.route
        self.broken: str | None = None
        me = header.process_id
        self.peers: list[tuple[pb.ProcessId, str]] = [
            (m, header.route.endpoints[i])
            for i, m in enumerate(header.route.members)
            if (m.zone, m.suffix) != (me.zone, me.suffix)
        ]
        self.calls = [JournalStub(channels[ep]).Replicate() for _m, ep in self.peers]
        self._send_errors: list[BaseException | None] = [None] * len(self.calls)
        self._last_read: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_read.set_result(None)

    async def scatter(self, req: pb.ReplicateRequest) -> None:
        """Send `req` to every peer whose stream has not failed; remember failures."""
        for i, call in enumerate(self.calls):
            if self._send_errors[i] is not None:
                continue
            try:
                await call.write(req)
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:
                self._send_errors[i] = exc
                self.broken = f"send to {self.peers[i][1]} failed: {exc}"

    async def gather(self) -> list[pb.ReplicateResponse]:
        """Read one response from each peer (in route order); raise PipelineError on any failure."""
        out: list[pb.ReplicateResponse] = []
        for i, call in enumerate(self.calls):
            endpoint = self.peers[i][1]
            try:
                resp = await call.read()
            except grpc.RpcError as exc:
                self.broken = f"peer {endpoint}: {exc.code().name}: {exc.details()}"
                raise PipelineError(self.broken) from exc
            if resp is grpc.aio.EOF:
                send_err = self._send_errors[i]
                self.broken = f"peer {endpoint} closed its stream" + (f" ({send_err})" if send_err else "")
                raise PipelineError(self.broken)
            out.append(resp)
        return out

    async def gather_ok(self) -> None:
        """Read one acknowledgement per peer; every one must be OK."""
        for resp in await self.gather():
            if resp.status != pb.OK:
                self.broken = f"peer refused a proposal: {pb.Status.Name(resp.status)}"
                raise PipelineError(self.broken)

    def barrier(self) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        """Take the next place in the acknowledgement order.

        Returns (wait_for, close_after): await `wait_for` before reading acknowledgements, and
        set `close_after` (in a finally) once done, which lets the next append read its own.
        """
        wait_for = self._last_read
        close_after: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_read = close_after
        return wait_for, close_after

    async def close(self) -> Spool:
        """Wait for in-flight readers, end every stream, and hand back the Spool."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._last_read), 10)
        for call in self.calls:
            with contextlib.suppress(Exception):
                await call.done_writing()
        for call in self.calls:
            call.cancel()
        self.spool.rollback()
        return self.spool
