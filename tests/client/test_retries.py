"""How the client's readers and the Shard client treat failures (tidings.client._base, "Retries"):
a reader's failures are counted per outage (a replica serving it again starts a new one, whatever
the time since the last content), a definite failure is raised at once even by a client that
retries for ever, and ShardClient.stat calls only a primary's own "not read through" a timeout.

These run against a scripted gRPC server on loopback playing the broker or consumer (the layer under
test is the client); the real brokers' side is covered in test_outage.py and tests/broker/test_stores.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tidings.client import AsyncClient
from tidings.consumer.client import ShardClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import TransportError


class ScriptedJournal(pb_grpc.JournalServicer):
    """Each Read answers OK (the read is served) and then, per the script, waits and fails with a code."""

    def __init__(self, script: list[tuple[float, grpc.StatusCode]]) -> None:
        self.script = list(script)
        self.reads = 0

    async def Read(self, request, context) -> AsyncIterator[pb.ReadResponse]:
        self.reads += 1
        if not self.script:
            await asyncio.Event().wait()  # (served for ever, nothing new)
        hold, code = self.script.pop(0)
        yield pb.ReadResponse(status=pb.OK, offset=request.offset, write_head=request.offset)
        await asyncio.sleep(hold)  # (the scripted time the read is served before the blip)
        await context.abort(code, "scripted failure")


async def serve(servicer, add) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_reader_with_a_deadline_survives_blips_further_apart_than_it() -> None:
    """Two failures 1.5 s apart, each followed by a replica serving the read again: a client retrying
    for 1 s after a failure must not count the second blip as the same outage (it gave up before)."""
    fake = ScriptedJournal([(0.0, grpc.StatusCode.UNAVAILABLE), (1.5, grpc.StatusCode.UNAVAILABLE)])
    server, endpoint = await serve(fake, pb_grpc.add_JournalServicer_to_server)
    try:
        async with AsyncClient(endpoint, retries=1_000_000, deadline=1.0) as c:
            reader = c.reader("j", 0, block=True)
            task = asyncio.ensure_future(reader.__anext__())
            done, _ = await asyncio.wait([task], timeout=4.0)  # (both blips are over by then)
            assert not done, task.result() if not task.exception() else task.exception()
            assert fake.reads == 3
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await server.stop(0)


@pytest.mark.parametrize("code", [grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INVALID_ARGUMENT])
async def test_a_client_that_retries_for_ever_raises_a_definite_failure_at_once(code) -> None:
    fake = ScriptedJournal([(0.0, code)])
    server, endpoint = await serve(fake, pb_grpc.add_JournalServicer_to_server)
    try:
        async with AsyncClient(endpoint, retries=None) as c:
            with pytest.raises(TransportError) as caught:
                async with asyncio.timeout(10):
                    async for _ in c.reader("j", 0, block=True):
                        pass
            assert caught.value.code == code
            assert fake.reads == 1
    finally:
        await server.stop(0)


class SilentShards(pb_grpc.ShardServicer):
    """A consumer that takes a Stat and never answers it (hung)."""

    async def Stat(self, request, context):
        await asyncio.Event().wait()


async def test_stat_of_a_consumer_that_never_answers_is_not_called_not_read_through() -> None:
    server, endpoint = await serve(SilentShards(), pb_grpc.add_ShardServicer_to_server)
    try:
        async with ShardClient(endpoint, deadline=1.0) as sc:
            with pytest.raises(TransportError) as caught:
                await sc.stat("s/0", {}, timeout=0.5)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await server.stop(0)
