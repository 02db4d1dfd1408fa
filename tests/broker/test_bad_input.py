"""Bad input at every RPC gets a clear status and the broker keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.replicate import replicate_to
from tidings.broker.transport import StreamError
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import JournalNotFoundError, ValidationError


@pytest.fixture
async def ready(cluster):
    await cluster.create_journal("it/bad", 3)
    return cluster


async def _still_serving(cluster) -> None:
    async with cluster.client(0) as c:
        r = await c.append("it/bad", b"ok")
        assert r.end - r.begin == 2


async def _append_raw(endpoint: str, msgs: list[pb.AppendRequest]) -> grpc.aio.AioRpcError | pb.AppendResponse:
    async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = JournalStub(ch).Append()
        try:
            for m in msgs:
                await call.write(m)
            await call.done_writing()
            return await call
        except grpc.aio.AioRpcError as exc:
            return exc


@pytest.mark.parametrize(
    "msgs,needle",
    [
        pytest.param([pb.AppendRequest(journal="a//b")], "empty segment", id="invalid-name"),
        pytest.param([pb.AppendRequest(journal="../etc")], "'..'", id="dotdot-name"),
        pytest.param([pb.AppendRequest(journal="it/bad", offset=-5)], "offset", id="negative-offset"),
        pytest.param(
            [pb.AppendRequest(journal="it/bad", content=b"x" * (validate.MAX_CHUNK + 1))],
            "exceeds",
            id="oversized-first",
        ),
        pytest.param(
            [pb.AppendRequest(journal="it/bad"), pb.AppendRequest(content=b"x" * (validate.MAX_CHUNK + 1))],
            "exceeds",
            id="oversized-chunk",
        ),
        pytest.param(
            [pb.AppendRequest(journal="it/bad"), pb.AppendRequest(journal="it/bad", content=b"x")],
            "only the first message",
            id="metadata-twice",
        ),
    ],
)
async def test_append_bad_input_is_invalid_argument(ready, msgs, needle) -> None:
    resp = await _append_raw(ready.brokers[0].endpoint, msgs)
    assert isinstance(resp, grpc.aio.AioRpcError)
    assert resp.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in resp.details()
    await _still_serving(ready)


async def test_unknown_journal_is_a_status(ready) -> None:
    async with ready.client(1) as c:
        with pytest.raises(JournalNotFoundError, match="no/such"):
            await c.append("no/such", b"x")
        with pytest.raises(JournalNotFoundError):
            await c.read_all("no/such")
    await _still_serving(ready)


@pytest.mark.parametrize(
    "req",
    [
        pytest.param(pb.ReadRequest(journal="it/bad", offset=-7), id="negative-offset"),
        pytest.param(pb.ReadRequest(journal="it/bad", offset=(1 << 63) - 1), id="huge-offset"),
        pytest.param(pb.ReadRequest(journal="it/bad", offset=10, end_offset=5), id="end-before-offset"),
        pytest.param(pb.ReadRequest(journal=""), id="empty-name"),
    ],
)
async def test_read_bad_input_is_invalid_argument(ready, req) -> None:
    async with grpc.aio.insecure_channel(ready.brokers[0].endpoint) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in JournalStub(ch).Read(req):
                pass
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await _still_serving(ready)


async def test_apply_invalid_spec_is_invalid_argument(ready) -> None:
    bad = pb.JournalSpec(name="x/y", replication=9)
    async with grpc.aio.insecure_channel(ready.brokers[0].endpoint) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await JournalStub(ch).Apply(pb.ApplyRequest(changes=[pb.ApplyRequest.Change(upsert=bad)]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "replication" in exc.value.details()
    with pytest.raises(ValidationError):
        validate.journal_spec(bad)
    await _still_serving(ready)


async def test_replicate_garbage_is_refused(ready) -> None:
    async with replicate_to(ready.brokers[0]) as call:
        await call.write(pb.ReplicateRequest(content=b"junk", content_delta=-1))
        with pytest.raises(StreamError, match="INVALID_ARGUMENT"):
            await call.read()
    await _still_serving(ready)


@pytest.mark.parametrize("port_of", ["grpc", "replication"])
async def test_garbage_bytes_on_the_port(ready, port_of: str) -> None:
    b = ready.brokers[0]
    host, port = (b.endpoint if port_of == "grpc" else b.replication.endpoint).rsplit(":", 1)
    junks = [b"GET / HTTP/1.1\r\n\r\n", b"\x00\xff" * 4096, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xde" * 100]
    for junk in junks:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(junk)
        await writer.drain()
        await reader.read(1024)  # the broker answers or closes; either way it must not fall over
        writer.close()
    await _still_serving(ready)
