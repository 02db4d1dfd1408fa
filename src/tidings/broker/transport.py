"""Replication streams: the send / receive / close interface the pipeline and the peer side talk to.

A primary's `Pipeline` holds one `ReplicaStream` per peer; a peer serves a `PeerStream`. Nothing
above this module knows which transport carries the messages (today gRPC's Replicate stream).

Failure semantics are explicit here, once: every way a stream can fail (an RpcError, a call
already finished, a call cancelled under us) surfaces as `StreamError`. grpc.aio cancels a
whole call when a task waiting in its `read()`/`write()` is cancelled, and other tasks then get
`CancelledError` from it; that error is *not* a cancellation of the caller, so it is mapped to
`StreamError` too. Only a cancellation of the calling task itself propagates as CancelledError.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Protocol

import grpc

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub


class StreamError(Exception):
    """A replication stream failed (the peer went away, refused the stream, or the call broke)."""


def cancelled_under_us() -> bool:
    """Whether a CancelledError being handled came from something we awaited, not from our task's cancel()."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class ReplicaStream(Protocol):
    """The primary's end of one peer's replication stream. Sends and receives are each used by
    one task at a time (the pipeline's send-side owner; its receive loop)."""

    endpoint: str

    async def send(self, req: pb.ReplicateRequest) -> None:
        """Send one request; StreamError if the stream is broken."""

    async def recv(self) -> pb.ReplicateResponse | None:
        """The next response, or None when the peer ended the stream cleanly; StreamError on failure."""

    async def close_send(self) -> None:
        """No more requests: the peer rolls back what is uncommitted and ends its side."""

    def abort(self) -> None:
        """Tear the stream down now (idempotent)."""


class PeerStream(Protocol):
    """A peer's end of a primary's replication stream."""

    async def recv(self) -> pb.ReplicateRequest | None:
        """The next request, or None at the primary's end of stream."""

    async def send(self, resp: pb.ReplicateResponse) -> None: ...

    async def fail(self, code: grpc.StatusCode, message: str) -> None:
        """End the stream with an error status (raises, as grpc's abort does)."""


class GrpcReplicaStream:
    """A ReplicaStream over the Journal service's Replicate bidi call."""

    def __init__(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        self.endpoint = endpoint
        self._call = JournalStub(channel).Replicate()

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """Map every way the call can fail under us to StreamError (see the module docstring)."""
        try:
            yield
        except grpc.RpcError as exc:
            raise StreamError(f"peer {self.endpoint}: {exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError as exc:
            raise StreamError(f"peer {self.endpoint}: the stream broke ({exc})") from exc
        except asyncio.CancelledError as exc:
            if not cancelled_under_us():
                raise
            raise StreamError(f"peer {self.endpoint}: the stream was cancelled under us") from exc

    async def send(self, req: pb.ReplicateRequest) -> None:
        with self._failures():
            await self._call.write(req)

    async def recv(self) -> pb.ReplicateResponse | None:
        with self._failures():
            resp = await self._call.read()
        return None if resp is grpc.aio.EOF else resp

    async def close_send(self) -> None:
        with self._failures():
            await self._call.done_writing()

    def abort(self) -> None:
        self._call.cancel()


class FailedStream:
    """A stream that could not be opened (e.g. a peer without an endpoint): every use fails."""

    def __init__(self, endpoint: str, reason: str) -> None:
        self.endpoint = endpoint
        self.reason = reason

    async def send(self, req: pb.ReplicateRequest) -> None:
        raise StreamError(self.reason)

    async def recv(self) -> pb.ReplicateResponse | None:
        raise StreamError(self.reason)

    async def close_send(self) -> None:
        return None

    def abort(self) -> None:
        return None


class GrpcPeerStream:
    """A PeerStream over the server side of a Replicate call."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def recv(self) -> pb.ReplicateRequest | None:
        req = await self._context.read()
        return None if req is grpc.aio.EOF else req

    async def send(self, resp: pb.ReplicateResponse) -> None:
        await self._context.write(resp)

    async def fail(self, code: grpc.StatusCode, message: str) -> None:
        await self._context.abort(code, message)
