"""The Target service alone, over real gRPC and SQLite: opening, fencing, batches that do not
follow, one process per file, an apply function that fails, and a restart that keeps its state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import apsw
import grpc
import pytest

from tidings.broker.transport_rpc import TARGET
from tidings.client._wire import WireChannel, WireStub
from tidings.cluster.etcd import free_port
from tidings.logplayer.target import TargetServer, TargetStore
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import UsageError


def opening(epoch: int, nonce: int = 0, target: str = "t0", wal: str = "w") -> pb.DeliverRequest:
    return pb.DeliverRequest(
        open=pb.DeliverRequest.Open(target=target, player="test", epoch=epoch, nonce=nonce, wal=wal)
    )


def batch(prev: int, *indices: int) -> pb.DeliverRequest:
    return pb.DeliverRequest(
        prev_index=prev,
        entries=[pb.TargetEntry(index=i, mutations=[pb.Mutation(key=f"k{i}", value=b"1")]) for i in indices],
    )


@pytest.fixture(params=["grpc", "tidings"])
async def target(request: pytest.FixtureRequest, tmp_path: Path):
    """A target, and a stub of its Target service over gRPC or over its data port (the same semantics)."""
    server = await TargetServer("t0", tmp_path / "t0.sqlite", f"127.0.0.1:{free_port()}", log_applied=True).start()
    if request.param == "tidings":
        channel = WireChannel(server.data_endpoint, member="t0", service=TARGET)
        stub = WireStub(channel)
    else:
        channel = grpc.aio.insecure_channel(server.endpoint)
        stub = pb_grpc.TargetStub(channel)
    try:
        yield server, stub
    finally:
        await channel.close()
        await server.stop()


async def test_batches_apply_in_order_and_a_gap_or_repeat_is_refused(target) -> None:
    server, stub = target
    call = stub.Deliver()
    await call.write(opening(1))
    assert (await call.read()).last_applied == -1
    await call.write(batch(-1, 10, 20))
    assert (await call.read()).last_applied == 20
    await call.write(batch(20, 30))
    assert (await call.read()).last_applied == 30
    await call.write(batch(20, 40))  # does not follow 30
    refused = await call.read()
    assert refused.status == pb.WRONG_TARGET_INDEX and refused.last_applied == 30
    assert await call.read() is grpc.aio.EOF
    call = stub.Deliver()
    await call.write(opening(1))
    assert (await call.read()).last_applied == 30
    await call.write(batch(30, 40, 40))  # not increasing
    assert (await call.read()).status == pb.WRONG_TARGET_INDEX
    assert server.store.applied_log() and [r[0] for r in server.store.applied_log()] == [10, 20, 30]


async def test_an_older_player_is_fenced_and_a_newer_one_takes_over(target) -> None:
    _server, stub = target
    old = stub.Deliver()
    await old.write(opening(5, nonce=1))
    assert (await old.read()).status == pb.OK
    new = stub.Deliver()
    await new.write(opening(5, nonce=2))  # same epoch, higher nonce: newer
    assert (await new.read()).status == pb.OK
    await old.write(batch(-1, 1))  # the old stream's next batch
    assert (await old.read()).status == pb.TARGET_FENCED
    stale = stub.Deliver()
    await stale.write(opening(4))
    assert (await stale.read()).status == pb.TARGET_FENCED
    await new.write(batch(-1, 1))
    assert (await new.read()).last_applied == 1
    answer = await stub.GetLastAck(pb.LastAckRequest(target="t0"))
    assert (answer.last_applied, answer.epoch) == (1, 5)
    assert (await stub.GetLastAck(pb.LastAckRequest(target="t9"))).status == pb.TARGET_NOT_FOUND
    wrong = stub.Deliver()
    await wrong.write(opening(9, target="t9"))
    assert (await wrong.read()).status == pb.TARGET_NOT_FOUND
    other_wal = stub.Deliver()  # a LogPlayer of another WAL, by mistake: refused, and it fences nobody
    await other_wal.write(opening(9, wal="another/wal"))
    refused = await other_wal.read()
    assert refused.status == pb.TARGET_NOT_FOUND and "applies WAL 'w'" in refused.detail
    assert (await stub.GetLastAck(pb.LastAckRequest())).epoch == 5


async def test_a_restarted_target_keeps_its_index_and_its_fence(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    server = await TargetServer("t0", tmp_path / "t0.sqlite", endpoint).start()
    async with grpc.aio.insecure_channel(endpoint) as channel:
        call = pb_grpc.TargetStub(channel).Deliver()
        await call.write(opening(7))
        await call.read()
        await call.write(batch(-1, 3))
        await call.read()
    await server.stop()
    server = await TargetServer("t0", tmp_path / "t0.sqlite", endpoint).start()
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.TargetStub(channel)
            answer = await stub.GetLastAck(pb.LastAckRequest())
            assert (answer.last_applied, answer.epoch) == (3, 7)
            call = stub.Deliver()
            await call.write(opening(6))
            assert (await call.read()).status == pb.TARGET_FENCED
    finally:
        await server.stop()


def test_one_process_per_target_file(tmp_path: Path) -> None:
    store = TargetStore(tmp_path / "t.sqlite")
    try:
        with pytest.raises(UsageError, match="another process serves the target file"):
            TargetStore(tmp_path / "t.sqlite")
    finally:
        store.close()


def failing_apply(db: apsw.Connection, entry: pb.TargetEntry) -> None:
    db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES ('partial', x'00')")
    if entry.index == 2:
        raise ValueError("cannot apply entry 2")


async def test_an_apply_function_that_fails_applies_nothing_of_its_batch(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    server = await TargetServer("t0", tmp_path / "t0.sqlite", endpoint, apply=failing_apply).start()
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = pb_grpc.TargetStub(channel).Deliver()
            await call.write(opening(1))
            await call.read()
            await call.write(batch(-1, 1, 2))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call.read()
            assert exc.value.code() == grpc.StatusCode.INTERNAL and "cannot apply entry 2" in exc.value.details()
        assert server.store.last_applied == -1
        assert server.store.db.execute("SELECT count(*) FROM kv").fetchone()[0] == 0
    finally:
        await server.stop()


class Gate:
    """An apply function that holds each apply until the test opens the gate."""

    def __init__(self) -> None:
        import threading

        self.started, self.gate = threading.Event(), threading.Event()

    def __call__(self, db: apsw.Connection, entry: pb.TargetEntry) -> None:
        self.started.set()
        assert self.gate.wait(30)
        db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, x'01')", (f"k{entry.index}",))


async def test_a_reopened_stream_waits_for_the_apply_of_a_cancelled_one(tmp_path: Path) -> None:
    """A stream cancelled mid-apply keeps the lock while its thread applies on: the next Open is answered
    only once the apply ended, with the new index, and a resent batch is not applied twice."""
    endpoint, gate = f"127.0.0.1:{free_port()}", Gate()
    server = await TargetServer("t0", tmp_path / "t0.sqlite", endpoint, apply=gate, log_applied=True).start()
    try:
        async with grpc.aio.insecure_channel(endpoint) as ch1, grpc.aio.insecure_channel(endpoint) as ch2:
            old = pb_grpc.TargetStub(ch1).Deliver()
            await old.write(opening(1))
            await old.read()
            await old.write(batch(-1, 1))
            assert await asyncio.to_thread(gate.started.wait, 30)
            old.cancel()  # (the LogPlayer gave the connection up: an ack timeout, say)
            new = pb_grpc.TargetStub(ch2).Deliver()
            await new.write(opening(1))
            answer = asyncio.ensure_future(new.read())
            await asyncio.wait([answer], timeout=1.0)  # (time for a wrong early answer to show)
            gate.gate.set()
            assert (await answer).last_applied == 1  # answered once the apply ended
            await new.write(batch(-1, 1))  # a resend from a stale index is refused
            assert (await new.read()).status == pb.WRONG_TARGET_INDEX
        assert [r[0] for r in server.store.applied_log()] == [1]
    finally:
        gate.gate.set()
        await server.stop()


async def test_a_stream_superseded_by_the_same_player_is_aborted_not_fenced(target) -> None:
    """Two streams of one LogPlayer (a reconnect whose earlier Open arrived late): the
    superseded one must not read TARGET_FENCED, which stops a LogPlayer."""
    _server, stub = target
    first, second = stub.Deliver(), stub.Deliver()
    await second.write(opening(3, nonce=9))
    assert (await second.read()).status == pb.OK
    await first.write(opening(3, nonce=9))  # (the same player's earlier attempt, arriving late)
    assert (await first.read()).status == pb.OK
    await second.write(batch(-1, 1))
    with pytest.raises(grpc.RpcError) as exc:  # (grpc.aio's AioRpcError, or the data port's WireError)
        await second.read()
    assert exc.value.code() == grpc.StatusCode.ABORTED


async def test_first_opens_of_two_wals_at_once_bind_the_target_to_one(target) -> None:
    """The WAL check runs under the lock: of two players of different WALs opening a fresh target
    together, one binds the target to its WAL and the other is refused (it never rebinds it)."""
    server, stub = target

    async def open_(epoch: int, wal: str) -> pb.DeliverResponse:
        call = stub.Deliver()
        await call.write(opening(epoch, wal=wal))
        return await call.read()

    answers = await asyncio.gather(open_(1, "wal/a"), open_(2, "wal/b"))
    assert sorted(a.status for a in answers) == [pb.OK, pb.TARGET_NOT_FOUND]
    bound = "wal/a" if answers[0].status == pb.OK else "wal/b"
    assert server.store.wal == bound
