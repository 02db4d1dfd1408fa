"""An append that fails or is cancelled anywhere (in any state of the append FSM, by its client, by a
peer failing mid-stream or an exception) is all or nothing on every replica, every other append is
answered and stays whole, and the replica's spool and pipeline tokens come back (DESIGN.md invariants 1
and 2).

Real spools, real brokers on loopback gRPC (the `cluster` fixture) and a real etcd.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest

from tests.broker._support import assert_replicas_hold, break_pipeline, peers_of, primary_of, read_replica
from tests.support.waiting import wait_until
from tidings.broker.append_fsm import AppendFSM, AppendState
from tidings.broker.resolver import Resolution
from tidings.client import AsyncClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import InsufficientJournalBrokersError, TransportError

S = AppendState


def tokens_idle(cluster, journal: str) -> bool:
    """The primary's tokens are back (a peer's spool is held by its primary's stream, as it should be)."""
    return primary_of(cluster, journal).resolver.replicas[journal].tokens_idle()


# -- cancellation anywhere, under load ------------------------------------------------------------


class _Load:
    """Appenders running beside the cancellations: each append is unique bytes, answered in time."""

    def __init__(self, cluster, journal: str, appenders: int = 4) -> None:
        self.cluster, self.journal = cluster, journal
        self.spans: list[tuple[int, int, bytes]] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._run(i)) for i in range(appenders)]

    async def _run(self, i: int) -> None:
        async with self.cluster.client(i % 3) as c:
            k = 0
            while not self.stop.is_set():
                body = f"<load {i}.{k}>".encode() * (1 + k % 5)
                k += 1
                try:
                    r = await asyncio.wait_for(c.append(self.journal, body), 30)  # every client gets an answer
                except TransportError:
                    continue  # a pipeline torn down under it: the outcome is unknown, so it is not counted
                self.spans.append((r.begin, r.end, body))

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


def _cancel_at(fsm: AppendFSM, state: AppendState) -> None:
    original = fsm._handlers[state]

    async def cancelling(f: AppendFSM) -> AppendState:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return await original(f)

    fsm._handlers = {**fsm._handlers, state: cancelling}  # (this instance's table alone)


@pytest.mark.parametrize(
    "state",
    [
        S.ACQUIRE_PIPELINE,
        S.START_PIPELINE,
        S.SEND_PIPELINE_SYNC,
        S.RECV_PIPELINE_SYNC,
        S.UPDATE_ASSIGNMENTS,
        S.AWAIT_DESIRED_REPLICAS,
        S.VALIDATE_PRECONDITIONS,
        S.STREAM_CONTENT,
        S.READ_ACKNOWLEDGEMENTS,
    ],
)
async def test_an_append_cancelled_in_any_state_leaves_every_other_append_whole(cluster, state) -> None:
    """Appends cancelled in each FSM state, beside concurrent appenders: every client gets an answer,
    every OK append is on all replicas at its offsets, a cancelled append is all or nothing, and both
    ownership tokens come back."""
    j = "it/cancel"
    await cluster.create_journal(j, 3, fragment={"length": "4KiB"})
    primary = primary_of(cluster, j)
    replica = primary.resolver.replicas[j]
    load = _Load(cluster, j)
    cancelled: list[bytes] = []
    try:
        await wait_until(lambda: len(load.spans) >= 5, 20)
        for n in range(4):
            if state in (S.START_PIPELINE, S.SEND_PIPELINE_SYNC, S.RECV_PIPELINE_SYNC):
                await break_pipeline(replica)  # so the next append builds and synchronizes one
            body = f"<cancelled {state.value} {n}>".encode() * 40
            cancelled.append(body)
            fsm = AppendFSM(primary, pb.AppendRequest(journal=j, do_not_proxy=True))
            chunks = iter([pb.AppendRequest(content=body[:300]), pb.AppendRequest(content=body[300:])])

            async def next_message(fsm=fsm, chunks=chunks) -> pb.AppendRequest | None:
                msg = next(chunks, None)
                if msg is None and state is S.STREAM_CONTENT:
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
                    await asyncio.sleep(0)
                return msg if msg is not None else pb.AppendRequest()

            if state is not S.STREAM_CONTENT:
                _cancel_at(fsm, state)
            task = asyncio.ensure_future(fsm.run(next_message))
            await asyncio.wait([task], timeout=30)
            assert task.done(), f"an append cancelled in {state.value} did not end"
            assert task.cancelled() or task.exception() is None or isinstance(task.exception(), asyncio.CancelledError)
            flowing = len(load.spans) + 5
            await wait_until(lambda flowing=flowing: len(load.spans) >= flowing, 30)  # appends keep flowing
    finally:
        await load.finish()
    await wait_until(lambda: tokens_idle(cluster, j), 20)
    async with cluster.client(0) as c:
        await c.append(j, b"<after>")
    data = await assert_replicas_hold(cluster, j, load.spans)
    for body in cancelled:
        assert data.count(body) <= 1 and (body in data or body[:300] not in data), "a cancelled append is partial"


async def test_clients_that_give_up_at_any_moment_never_disturb_the_others(cluster) -> None:
    """Cancellation from outside: raw Append calls cancelled by their clients at random moments (before
    their first chunk, mid-stream, after the commit chunk) beside ordinary appenders, through the
    primary and through proxies. Every other client gets its answer and every OK append holds."""
    j = "it/client-cancel"
    await cluster.create_journal(j, 3, fragment={"length": "8KiB"})
    load = _Load(cluster, j)
    rng = random.Random(11)

    async def quitter(i: int) -> None:
        broker = cluster.brokers[i % 3]
        for k in range(15):
            call = JournalStub(broker.channel(broker.endpoint)).Append()
            await call.write(pb.AppendRequest(journal=j))
            for _ in range(rng.randint(0, 3)):
                await call.write(pb.AppendRequest(content=f"<quit {i}.{k}>".encode() * 20))
                await asyncio.sleep(rng.random() * 0.005)
            if rng.random() < 0.5:
                await call.write(pb.AppendRequest())  # the commit chunk: cancelled at the last moment
            call.cancel()

    try:
        await asyncio.wait_for(asyncio.gather(*(quitter(i) for i in range(6))), 60)
        await wait_until(lambda: len(load.spans) >= 40, 30)
    finally:
        await load.finish()
    await wait_until(lambda: tokens_idle(cluster, j), 20)
    await assert_replicas_hold(cluster, j, load.spans)


# -- a failing peer or build: nothing committed where the append failed, no token leaked ------------


async def test_a_peer_failing_mid_append_rolls_the_append_back_everywhere(cluster) -> None:
    j = "it/peer-fails"
    await cluster.create_journal(j, 3)
    async with cluster.client(0) as c:
        await c.append(j, b"before|")
    primary = primary_of(cluster, j)
    victim = peers_of(cluster, j)[0]
    survivor = peers_of(cluster, j)[1]
    slot = primary.resolver.replicas[j].pipeline_slot
    await wait_until(lambda: slot.full() and slot.peek() is not None, 10)
    pipeline = slot.peek()  # the synchronized pipeline our append will take
    call = JournalStub(primary.channel(primary.endpoint)).Append()
    await call.write(pb.AppendRequest(journal=j))
    await call.write(pb.AppendRequest(content=b"doomed-1|"))
    await call.write(pb.AppendRequest(content=b"doomed-2|"))  # the first chunk went to every peer
    await victim.stop(graceful=False)
    # The primary's stream to the stopped peer has ended: its next send fails.
    await wait_until(lambda: any(s.ended for s in pipeline.streams), 20)
    try:
        for k in range(3):
            await call.write(pb.AppendRequest(content=f"doomed-{k + 3}|".encode()))
        await call.write(pb.AppendRequest())
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the primary answered early: it rolled the append back as soon as a send failed
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call
    assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    for b in (primary, survivor):
        data = await read_replica(b, j)
        assert b"doomed" not in data, f"{b.process_id.suffix} committed an append a peer never got"


async def test_a_route_naming_a_peer_without_endpoint_fails_cleanly_and_leaks_nothing(cluster, monkeypatch) -> None:
    j = "it/no-endpoint"
    await cluster.create_journal(j, 3)
    primary = primary_of(cluster, j)
    replica = primary.resolver.replicas[j]
    await break_pipeline(replica)
    real = primary.resolver.resolve

    async def resolve_without_a_peer_endpoint(journal: str, min_revision: int = 0, claims=None) -> Resolution:
        res = await real(journal, min_revision, claims)
        if journal != j:
            return res
        header = pb.Header()
        header.CopyFrom(res.header)
        peer = next(i for i in range(len(header.route.members)) if i != header.route.primary)
        header.route.endpoints[peer] = ""  # its member key expired before its assignments went
        return dataclasses.replace(res, header=header)

    monkeypatch.setattr(primary.resolver, "resolve", resolve_without_a_peer_endpoint)
    async with AsyncClient(primary.endpoint, retries=0) as c:
        with pytest.raises(InsufficientJournalBrokersError):
            await asyncio.wait_for(c.append(j, b"x"), 30)
    assert replica.tokens_idle(), "the spool and pipeline tokens are back"
    monkeypatch.setattr(primary.resolver, "resolve", real)
    async with AsyncClient(primary.endpoint) as c:
        r = await asyncio.wait_for(c.append(j, b"works"), 30)
    assert r.end - r.begin == 5


async def test_a_failure_while_building_the_pipeline_gives_the_spool_back(cluster, monkeypatch) -> None:
    """A token taken is returned on every path, even an unexpected exception."""
    j = "it/build-fails"
    await cluster.create_journal(j, 3)
    primary = primary_of(cluster, j)
    replica = primary.resolver.replicas[j]
    await break_pipeline(replica)

    def broken(route: pb.Route):
        raise RuntimeError("cannot open streams")

    monkeypatch.setattr(primary, "open_streams", broken)
    fsm = AppendFSM(primary, pb.AppendRequest(journal=j, do_not_proxy=True))
    with pytest.raises(RuntimeError, match="cannot open streams"):
        await fsm.run_to(S.STREAM_CONTENT)
    assert replica.tokens_idle()
    monkeypatch.undo()
    async with cluster.client(0) as c:
        assert (await asyncio.wait_for(c.append(j, b"ok"), 30)).end > 0


async def test_a_replica_closed_right_after_an_abort_gets_its_pipeline_token_back(cluster) -> None:
    """A roll-back task cancelled before its first step (the replica closes in the same loop turn)
    still returns the pipeline token: the close does not hang."""

    j = "it/abort-then-close"
    await cluster.create_journal(j, 3)
    replica = primary_of(cluster, j).resolver.replicas[j]
    pipeline = await replica.pipeline_slot.get()
    if pipeline is None:
        await asyncio.wait_for(_synchronize(cluster, j), 30)
        pipeline = await replica.pipeline_slot.get()
    assert pipeline is not None
    replica.roll_back_abandoned(pipeline)  # what abort() does for an append cancelled mid-stream
    await asyncio.wait_for(replica.aclose(), 30)


async def _synchronize(cluster, journal: str) -> None:
    async with cluster.client(0) as c:
        await c.append(journal, b"")


async def test_nobody_takes_the_spool_before_the_replica_recovered_it(tmp_path) -> None:
    """An append that reached a brand-new replica before its start task ran once took the spool first;
    recovery then waited for it forever and so did the append (its first store listing never came)."""
    from tidings.broker.replica import Replica
    from tidings.fragment.persister import Persister

    persister = Persister(lambda f, x: None)
    replica = Replica("it/fresh", pb.JournalSpec(name="it/fresh"), tmp_path, persister)
    assert replica.spool_slot.empty(), "the spool enters its slot only once recovered"
    idle = asyncio.Event()

    async def pulse(r) -> None:
        await idle.wait()

    replica.start(pulse)
    await wait_until(lambda: replica.spool_slot.full() and replica.index.first_refresh, 10)
    await replica.aclose()
    closed_early = Replica("it/fresh", pb.JournalSpec(name="it/fresh"), tmp_path, persister)
    await asyncio.wait_for(closed_early.aclose(), 10)  # closed before it ever started: no hang
