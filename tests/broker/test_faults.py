"""Faults with brokers as child processes (kill -9 of the primary, a frozen peer, joins and SIGTERM leaves
under load) lose no acknowledged append, leave no append waiting without end, and keep journals at R
replicas as brokers join and leave (DESIGN.md invariants 1 and 5)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import signal

import grpc

from tests.support.cluster import create_local_journal
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import TidingsError


async def _route(endpoint: str, name: str) -> pb.Route:
    async with AsyncClient(endpoint) as c:
        return next(j.route for j in (await c.list()).journals if j.spec.name == name)


async def test_kill_9_of_the_primary_loses_no_acknowledged_append(local_cluster: LocalCluster) -> None:
    """Invariants 1-2: every append that returned OK reads back at its offsets after the primary dies."""
    lc = local_cluster
    await create_local_journal(lc, "faults/kill9")
    acked: list[tuple[int, int, bytes]] = []
    stop = asyncio.Event()

    async def writer(i: int) -> None:
        n = 0
        while not stop.is_set():
            body = f"<{i}:{n}>".encode() * random.randint(1, 50)
            n += 1
            for ep in lc.endpoints:
                try:
                    async with AsyncClient(ep, retries=3) as c:
                        r = await c.append("faults/kill9", body)
                    acked.append((r.begin, r.end, body))
                    break
                except TidingsError:
                    continue

    writers = [asyncio.create_task(writer(i)) for i in range(4)]
    try:
        await wait_until(lambda: len(acked) >= 30, 30)
        route = await _route(lc.endpoints[0], "faults/kill9")
        victim = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
        victim.kill()  # SIGKILL
        before = len(acked)
        await wait_until(lambda: len(acked) >= before + 30, 60)  # appends continue after reassignment
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)

    acked.sort()
    async with AsyncClient(lc.endpoints[0]) as c:
        data = await c.read_all("faults/kill9")
    for b, e, body in acked:
        assert data[b:e] == body, f"acknowledged append at [{b},{e}) changed"
    for (_b0, e0, _), (b1, _e1, _) in itertools.pairwise(acked):
        assert e0 <= b1, "no offset holds two different appends"


async def test_join_and_sigterm_leave_under_load_keep_replication(local_cluster: LocalCluster) -> None:
    """Invariant 5: a broker joins, another leaves by SIGTERM; appends keep succeeding, R holds."""
    lc = local_cluster
    await create_local_journal(lc, "faults/churn")
    errors: list[str] = []
    acked: list[tuple[int, int, bytes]] = []
    stop = asyncio.Event()
    settled = asyncio.Event()
    min_members: list[int] = []

    async def writer(i: int) -> None:
        n = 0
        while not stop.is_set():
            body = f"<{i}:{n}>".encode()
            n += 1
            try:
                async with AsyncClient(lc.endpoints[0], retries=30) as c:
                    r = await c.append("faults/churn", body)
                acked.append((r.begin, r.end, body))
            except TidingsError as exc:
                if settled.is_set():
                    errors.append(str(exc))

    async def watcher() -> None:
        """Observe every route change through a List watch on a broker that stays."""
        async with grpc.aio.insecure_channel(lc.endpoints[0]) as ch:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                async for resp in JournalStub(ch).List(pb.ListRequest(watch=True)):
                    for j in resp.journals:
                        if j.spec.name == "faults/churn":
                            min_members.append(len(j.route.members))

    tasks = [asyncio.create_task(writer(i)) for i in range(3)] + [asyncio.create_task(watcher())]
    try:
        await wait_until(lambda: len(acked) >= 20, 30)
        await asyncio.to_thread(lc.add_broker)
        leaving = lc.brokers[1]
        await asyncio.to_thread(leaving.terminate, 60)
        assert leaving.proc is not None and leaving.proc.returncode == 0

        async def route_settled() -> bool:
            route = await _route(lc.endpoints[0], "faults/churn")
            return len(route.members) == 3 and all(m.suffix != leaving.suffix for m in route.members)

        await wait_until(route_settled, 60)
        settled.set()
        before = len(acked)
        await wait_until(lambda: len(acked) >= before + 20, 30)
    finally:
        stop.set()
        tasks[-1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert errors == []
    assert min(min_members) >= 3, "the journal never fell below R members"
    async with AsyncClient(lc.endpoints[0]) as c:
        data = await c.read_all("faults/churn")
    for b, e, body in acked:
        assert data[b:e] == body


async def test_a_frozen_peer_fails_the_pipeline_and_appends_go_on_without_it(local_cluster: LocalCluster) -> None:
    """A peer stopped by SIGSTOP keeps its sockets open (the kernel answers for it) but never replies.
    Its etcd lease expires, the allocator replaces it, the primary tears down the pipeline that waits
    on it: the appends in flight get a status and later ones succeed. No append waits without end.
    (A connection that goes silent while the peer's lease lives, a partition between brokers only,
    is dropped by the transport's keep-alive: tests/broker/test_transport.py.)"""
    lc = local_cluster
    await create_local_journal(lc, "faults/frozen")
    route = await _route(lc.endpoints[0], "faults/frozen")
    primary = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
    peer = next(b for b in lc.brokers if b.suffix in {m.suffix for m in route.members} and b is not primary)
    acked: list[tuple[int, int, bytes]] = []
    stop = asyncio.Event()

    async def writer(i: int) -> None:
        n = 0
        async with AsyncClient(primary.endpoint, retries=30) as c:
            while not stop.is_set():
                body = f"<{i}:{n}>".encode()
                n += 1
                with contextlib.suppress(TidingsError):
                    r = await asyncio.wait_for(c.append("faults/frozen", body), 60)  # a hang fails the test
                    acked.append((r.begin, r.end, body))

    writers = [asyncio.create_task(writer(i)) for i in range(3)]
    assert peer.proc is not None
    try:
        await wait_until(lambda: len(acked) >= 20, 30)
        peer.proc.send_signal(signal.SIGSTOP)
        before = len(acked)
        await wait_until(lambda: len(acked) >= before + 20, 60)
        now = await _route(lc.endpoints[0], "faults/frozen")
        assert peer.suffix not in {m.suffix for m in now.members}
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        stop.set()
        for result in await asyncio.gather(*writers, return_exceptions=True):
            assert not isinstance(result, BaseException), result
    async with AsyncClient(primary.endpoint) as c:
        data = await c.read_all("faults/frozen")
    for begin, end, body in acked:
        assert data[begin:end] == body
