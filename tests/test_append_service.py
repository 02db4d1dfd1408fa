"""AppendService against real brokers: futures, order, batching, spilling, back-pressure, broker kills."""

from __future__ import annotations

import asyncio
import random

import pytest

from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import JournalNotFoundError, UsageError

from .support.cluster import create_local_journal
from .support.waiting import wait_until


async def test_every_future_resolves_with_its_own_span_in_append_order(cluster) -> None:
    await cluster.create_journal("as/a", 3)
    await cluster.create_journal("as/b", 3)
    async with cluster.client(1) as c:
        svc = AppendService(c, batch_bytes=4096)
        sent: list[tuple[str, bytes, asyncio.Future]] = []
        for i in range(400):
            journal = "as/a" if i % 3 else "as/b"
            body = f"<{i}:{'x' * random.randint(0, 40)}>".encode()
            sent.append((journal, body, await svc.append(journal, body)))
        await svc.aclose()
        stats = svc.statistics()
        assert stats.appends == 400 and stats.buffered_bytes == 0
        assert stats.batches < 100, "appends made while an RPC is in flight ride together"
        data = {j: await c.read_all(j) for j in ("as/a", "as/b")}
    ends = {"as/a": 0, "as/b": 0}
    for journal, body, fut in sent:
        span = fut.result()
        assert data[journal][span.begin : span.end] == body
        assert span.begin == ends[journal], "appends to one journal commit in call order, back to back"
        ends[journal] = span.end
    assert ends == {j: len(d) for j, d in data.items()}


async def test_large_batches_spill_to_disk_and_read_back(cluster, tmp_path) -> None:
    await cluster.create_journal("as/spill", 3)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    async with cluster.client(0) as c:
        svc = AppendService(c, batch_bytes=1 << 20, spill_bytes=64 << 10, spill_dir=str(spill_dir))
        bodies = [bytes([i % 251]) * 50_000 for i in range(30)]
        futs = [await svc.append("as/spill", b) for b in bodies]
        await svc.aclose()
        assert svc.statistics().spilled_batches >= 1
        assert list(spill_dir.iterdir()) == [], "spill files are removed once committed"
        data = await c.read_all("as/spill")
    assert data == b"".join(bodies)
    assert [f.result().begin for f in futs] == [i * 50_000 for i in range(30)]


async def test_full_buffer_makes_append_wait_until_a_batch_commits(cluster) -> None:
    # Replication 4 on three brokers: INSUFFICIENT_JOURNAL_BROKERS (retried) until a 4th broker joins.
    spec = spec_from_dict({"name": "as/wait", "replication": 4, "fragment": {"stores": [cluster.store_url]}})
    async with cluster.client(0) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        svc = AppendService(c, buffer_bytes=1000)
        first = await svc.append("as/wait", b"a" * 800)
        second = asyncio.create_task(svc.append("as/wait", b"b" * 800))
        await wait_until(lambda: svc.statistics().retries >= 2, 20)
        assert not second.done() and not first.done(), "no room in the buffer until the first batch commits"
        await cluster.add_broker("zone-a")
        assert (await first).end == 800
        assert (await (await second)).end == 1600
        await svc.aclose()


async def test_definite_refusal_fails_the_futures_and_the_service_goes_on(cluster) -> None:
    await cluster.create_journal("as/ok", 3)
    async with cluster.client(0) as c:
        svc = AppendService(c)
        bad = await svc.append("as/missing", b"x")
        good = await svc.append("as/ok", b"y")
        with pytest.raises(JournalNotFoundError, match="as/missing"):
            await bad
        assert (await good).end == 1
        await svc.aclose()
        with pytest.raises(UsageError, match="closed"):
            await svc.append("as/ok", b"z")


async def test_broker_kill_every_future_resolves_and_each_batch_is_written_once(local_cluster: LocalCluster) -> None:
    lc = local_cluster
    await create_local_journal(lc, "as/kill")
    async with AsyncClient(lc.endpoints[1]) as c:
        svc = AppendService(c, batch_bytes=32 << 10, buffer_bytes=256 << 10)  # back-pressure paces the producer
        sent: list[tuple[bytes, asyncio.Future]] = []
        stop = asyncio.Event()

        async def produce() -> None:
            i = 0
            while not stop.is_set():
                body = f"[{i:06d}:{'z' * random.randint(10, 400)}]".encode()
                sent.append((body, await svc.append("as/kill", body)))
                i += 1

        producer = asyncio.create_task(produce())
        try:
            await wait_until(lambda: sum(f.done() for _, f in sent) >= 500, 30)
            route = next(j.route for j in (await c.list()).journals if j.spec.name == "as/kill")
            victim = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
            victim.kill()  # SIGKILL of the primary, mid-stream
            done_at_kill = sum(f.done() for _, f in sent)
            await wait_until(lambda: sum(f.done() for _, f in sent) >= done_at_kill + 500, 60)
        finally:
            stop.set()
            await producer
        await asyncio.wait_for(svc.aclose(), 60)
        data = await c.read_all("as/kill")
    spans = [f.result() for _, f in sent]  # every future resolved, none failed
    for (body, _), span in zip(sent, spans, strict=True):
        assert data[span.begin : span.end] == body
    assert [s.begin for s in spans] == sorted(s.begin for s in spans)
    assert len(data) == sum(len(b) for b, _ in sent), "the journal holds each append once"


async def test_a_failed_append_that_did_commit_is_found_not_written_again(cluster) -> None:
    """The search behind the broker-kill test, driven directly: an attempt whose answer was lost."""
    from tidings.client._append_service import _Batch, _JournalQueue

    await cluster.create_journal("as/find", 3)
    async with cluster.client(0) as c:
        svc = AppendService(c)
        q = _JournalQueue("as/find")
        q.head = (await c.append("as/find", b"ours-before|")).end
        await c.append("as/find", b"<someone else>")
        batch = _Batch()
        batch.add(b"the lost answer", svc.spill_bytes, None)
        landed = await c.append("as/find", b"the lost answer")  # committed; pretend the response never came
        found = await svc._find_committed(q, batch)
        assert found is not None and (found.begin, found.end) == (landed.begin, landed.end)
        assert q.head == landed.end
        other = _Batch()
        other.add(b"never written", svc.spill_bytes, None)
        assert await svc._find_committed(q, other) is None
        assert q.head == landed.end, "not found: the next attempt can only land at or after the head"
