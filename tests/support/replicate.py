"""A rogue primary's replication stream to a broker, over the real transport (tests of the peer side)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from tidings.broker.transport import Dialer, MuxReplicaStream
from tidings.protocol import protocol_pb2 as pb


class RawReplicate:
    """write / read, as a gRPC bidi call's, over one replication stream."""

    def __init__(self, stream: MuxReplicaStream) -> None:
        self.stream = stream

    async def write(self, req: pb.ReplicateRequest) -> None:
        self.stream.send(req.SerializeToString())
        await self.stream.drain()

    async def read(self) -> pb.ReplicateResponse | None:
        return await self.stream.recv()


@contextlib.asynccontextmanager
async def replicate_to(broker) -> AsyncIterator[RawReplicate]:
    dialer = Dialer()
    stream = dialer.open(broker.replication.endpoint)
    try:
        yield RawReplicate(stream)
    finally:
        stream.abort()
        await dialer.aclose()
