"""Looking inside in-process brokers (the `cluster` fixture): a journal's primary and peers, what each
replica itself serves, and a pipeline torn down so the next append builds one. The broker tests share them."""

from __future__ import annotations

import asyncio

from tidings.broker.service import Broker
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub


def primary_of(cluster, journal: str) -> Broker:
    route = cluster.route(journal)
    return next(b for b in cluster.brokers if b.process_id == route.members[route.primary])


def peers_of(cluster, journal: str) -> list[Broker]:
    route = cluster.route(journal)
    return [b for b in cluster.brokers if b.process_id != route.members[route.primary]]


async def read_replica(broker: Broker, journal: str) -> bytes:
    """Every committed byte `broker` itself serves (no proxying), from offset 0 to its write head."""
    req = pb.ReadRequest(journal=journal, offset=0, block=False, do_not_proxy=True)
    out = bytearray()
    async for resp in JournalStub(broker.channel(broker.endpoint)).Read(req):
        assert resp.status in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE), pb.Status.Name(resp.status)
        if resp.content:
            assert resp.offset == len(out), "a read must never skip committed bytes"
            out += resp.content
    return bytes(out)


async def assert_replicas_hold(cluster, journal: str, spans: list[tuple[int, int, bytes]]) -> bytes:
    """Every replica serves the same bytes, and every acknowledged span at its reported offsets."""
    views = [await asyncio.wait_for(read_replica(b, journal), 30) for b in cluster.brokers]
    if not views[0] == views[1] == views[2]:
        details = [
            (b.process_id.suffix, len(v), b.resolver.replicas[journal].index.fragments())
            for b, v in zip(cluster.brokers, views, strict=True)
        ]
        raise AssertionError(f"replicas disagree: {details}")
    for begin, end, content in spans:
        assert views[0][begin:end] == content, f"acknowledged [{begin}, {end}) is not there"
    return views[0]


async def break_pipeline(replica) -> None:
    """Shut the primary replica's pipeline down and leave its slot empty: the next append builds and
    synchronizes a new one."""
    pipeline = await replica.pipeline_slot.get()
    if pipeline is not None:
        pipeline.shutdown()
    replica.pipeline_slot.put_nowait(None)
