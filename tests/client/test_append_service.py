"""AppendService against real brokers: futures, order, batching, spilling, back-pressure, broker kills."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.support.cluster import create_local_journal
from tests.support.waiting import wait_until
from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import JournalNotFoundError, UsageError


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
        spans = [f.result() for _, f in sent]  # every future resolved, none failed
        # Read blocking up to the last span: the new primary may have rolled past bytes only the other
        # replica held (it persists them at once); a non-blocking read stops at such a hole.
        end = max(s.end for s in spans)
        data = b"".join([ch.content async for ch in c.reader("as/kill", 0, block=True, end_offset=end)])
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


# -- order after a definite failure, dependencies, and the search after a lost answer ---------------


async def _set_flags(c: AsyncClient, name: str, flags: str) -> None:
    """Change a journal's flags (read-only / read-write), guarded by its current mod revision."""
    from tidings.protocol.specs import spec_to_dict

    j = next(j for j in (await c.list()).journals if j.spec.name == name)
    spec = spec_from_dict({**spec_to_dict(j.spec), "flags": flags})
    await c.apply([pb.ApplyRequest.Change(expect_mod_revision=j.mod_revision, upsert=spec)])


async def test_a_batch_that_fails_definitely_stops_every_later_batch_of_its_journal(cluster, tmp_path) -> None:
    """Order: content queued after a batch that was not written must not commit after the hole.

    The first batch's spill file is cut short (a local disk fault): that batch fails definitely,
    and the appends queued behind it fail with an error naming it, instead of committing."""
    from tidings.client import EarlierAppendFailedError

    await cluster.create_journal("as/order", 3)
    async with cluster.client(0) as c:
        svc = AppendService(c, batch_bytes=100 << 10, spill_bytes=64 << 10, spill_dir=str(tmp_path))
        first = svc.append_nowait("as/order", b"a" * (100 << 10))  # spilled; one batch
        second = svc.append_nowait("as/order", b"after the first")  # the next batch
        third = svc.append_nowait("as/order", b"and more")
        q = svc._queues["as/order"]
        assert len(q.ready) == 1 and q.ready[0].file is not None
        q.ready[0].file.truncate(10)  # the disk loses the batch before it is sent
        with pytest.raises(UsageError, match="spilled batch"):
            await first
        for later in (second, third):
            with pytest.raises(EarlierAppendFailedError, match=r"as/order.*batch #1 \(1 appends?, 102400 bytes\)"):
                await later
        assert isinstance(second.exception().__cause__, UsageError)
        assert await c.read_all("as/order") == b"", "nothing after the failed batch was written"
        await svc.aclose()


async def test_a_refused_journal_stays_failed_until_resumed(cluster) -> None:
    """NOT_ALLOWED (a read-only journal): the batch and everything queued behind it fail; later
    appends fail too (the caller may not have seen the error yet) until `resume(journal)`."""
    from tidings.client import EarlierAppendFailedError
    from tidings.protocol.status import NotAllowedError

    await cluster.create_journal("as/ro", 3, flags="read-only")
    async with cluster.client(0) as c:
        svc = AppendService(c, batch_bytes=1)  # one append per batch
        refused = svc.append_nowait("as/ro", b"refused")
        behind = svc.append_nowait("as/ro", b"queued behind it")
        with pytest.raises(NotAllowedError, match="as/ro"):
            await refused
        with pytest.raises(EarlierAppendFailedError, match=r"batch #1 .*NOT_ALLOWED.*resume"):
            await behind
        assert isinstance(svc.failure("as/ro"), NotAllowedError)
        await _set_flags(c, "as/ro", "read-write")

        async def writable() -> bool:
            try:
                await c.append("as/ro", b"probe|")
            except NotAllowedError:
                return False
            return True

        await wait_until(writable, 10)
        later = await svc.append("as/ro", b"made after the failure")
        with pytest.raises(EarlierAppendFailedError, match="NOT_ALLOWED"):
            await later
        assert await c.read_all("as/ro") == b"probe|", "the failed journal took nothing more"
        assert isinstance(svc.resume("as/ro"), NotAllowedError)
        assert svc.failure("as/ro") is None
        resumed = await (await svc.append("as/ro", b"after resume"))
        assert await c.read_all("as/ro") == b"probe|after resume" and resumed.begin == len(b"probe|")
        await svc.aclose()


async def test_a_failed_dependency_fails_its_dependant_without_writing_it(cluster) -> None:
    from tidings.client import DependencyFailedError, EarlierAppendFailedError

    await cluster.create_journal("as/dependant", 3)
    async with cluster.client(0) as c:
        svc = AppendService(c)
        missing = await svc.append("as/no-such-journal", b"messages")
        ack = await svc.append("as/dependant", b"ack", dependencies=[missing])
        with pytest.raises(JournalNotFoundError):
            await missing
        with pytest.raises(DependencyFailedError, match=r"as/dependant.*as/no-such-journal.*JOURNAL_NOT_FOUND"):
            await ack
        later = await svc.append("as/dependant", b"after")
        with pytest.raises(EarlierAppendFailedError):
            await later
        assert await c.read_all("as/dependant") == b"", "the dependant was never written"
        with pytest.raises(UsageError, match="dependencies"):
            await svc.append("as/dependant", b"x", dependencies=[b"not a future"])  # type: ignore[list-item]
        await svc.aclose()


async def test_a_batch_waiting_for_dependencies_holds_only_its_own_journal(cluster) -> None:
    """The dependant waits for a journal without quorum (R=4 on three brokers) while other journals,
    and appends queued before it, go on; it commits once its dependency has. The dependency's caller
    cancelling its future changes nothing: the content is still written, and the dependant waits."""
    spec = spec_from_dict({"name": "as/stuck", "replication": 4, "fragment": {"stores": [cluster.store_url]}})
    await cluster.create_journal("as/waits", 3)
    await cluster.create_journal("as/free", 3)
    async with cluster.client(0) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        svc = AppendService(c)
        stuck = await svc.append("as/stuck", b"first")
        before = await svc.append("as/waits", b"before|")
        held = await svc.append("as/waits", b"held", dependencies=[stuck])
        stuck.cancel()
        await before
        await wait_until(lambda: svc.statistics().retries >= 3, 20)
        free = await (await svc.append("as/free", b"free"))
        assert free.end == 4, "an unrelated journal is not held"
        assert not held.done() and await c.read_all("as/waits") == b"before|", "the dependant waits"
        await cluster.add_broker("zone-a")
        assert (await held).begin == len(b"before|")
        assert await c.read_all("as/stuck") == b"first"
        await svc.aclose()


async def _journal_with_a_skipped_span(cluster, name: str) -> None:
    """`name` holds b"abc" at [0, 3), nothing at [3, 100) (skipped by a reset head), and b"0123456789"
    at [100, 110): a read of [0, 110) jumps from 3 to 100."""
    from tests.support.fragments import write_foreign_fragment
    from tidings.protocol.status import IndexHasGreaterOffsetError

    await cluster.create_journal(name, 3)
    async with cluster.client(0) as c:
        await c.append(name, b"abc")
        write_foreign_fragment(cluster, name, 100, b"0123456789", age=7 * 3600)  # old: readers skip to it

        async def refused() -> bool:
            try:
                await c.append(name, b"")
            except IndexHasGreaterOffsetError:
                return True
            return False

        await wait_until(refused, 20)
        assert (await c.append(name, b"", offset=110)).end == 110  # what `journals reset-head` sends


async def test_the_search_for_a_lost_batch_accounts_for_offset_jumps(cluster) -> None:
    """A batch found after a jump is placed at its true offset; bytes on both sides of a jump never
    match; and a window the journal cannot fully show is not taken as "not written"."""
    from tidings.client import AppendOutcomeUnknownError
    from tidings.client._append_service import _Batch, _JournalQueue

    await _journal_with_a_skipped_span(cluster, "as/jump")
    async with cluster.client(0) as c:
        svc = AppendService(c)
        svc.dedup_wait = 1.0  # how long an unreadable span may stay unreadable before the search gives up

        def batch(content: bytes) -> _Batch:
            b = _Batch()
            b.add(content, svc.spill_bytes, None)
            return b

        for low in (0, 3):
            q = _JournalQueue("as/jump")
            q.head = low
            found = await svc._find_committed(q, batch(b"56789"))
            assert found is not None and (found.begin, found.end) == (105, 110), "placed at its true offset"
            assert q.head == 110
        for content in (b"bc01", b"never written"):
            q = _JournalQueue("as/jump")
            q.head = 0
            with pytest.raises(AppendOutcomeUnknownError, match=r"as/jump.*\[3, 100\)"):
                await svc._find_committed(q, batch(content))
        q = _JournalQueue("as/jump")
        q.head = 100  # past the jump: the whole window is readable, so "not found" is an answer
        assert await svc._find_committed(q, batch(b"nope")) is None
        assert q.head == 110


async def test_abort_settles_appends_whose_journal_task_never_ran(cluster) -> None:
    """abort() in the same step as an append (a hook publishes, then fails): the append's future and
    a pending() barrier taken before fail with "stopped", and flush() returns."""
    await cluster.create_journal("svc/abort", 1)
    async with cluster.client() as c:
        svc = AppendService(c)
        fut = svc.append_nowait("svc/abort", b"never sent\n")
        barrier = svc.pending()["svc/abort"]
        await svc.abort()
        with pytest.raises(UsageError, match="stopped"):
            await asyncio.wait_for(fut, 5)
        with pytest.raises(UsageError, match="stopped"):
            await asyncio.wait_for(barrier, 5)
        await asyncio.wait_for(svc.flush(), 5)
        assert svc.statistics().buffered_bytes == 0


async def test_appends_checking_a_register_another_writer_moved_are_refused_and_write_nothing(cluster) -> None:
    """The register fence (DESIGN.md invariant 10, as a recovery log's recorder uses it): once another
    append moved the register the service's appends check, its next batch is refused
    (REGISTER_MISMATCH), the batches behind it fail unwritten, and nothing of theirs lands."""
    from tidings.client import EarlierAppendFailedError
    from tidings.protocol.labels import label_set
    from tidings.protocol.status import RegisterMismatchError

    def fence(author: int) -> pb.LabelSet:
        return label_set({"author": f"{author:08x}"})

    await cluster.create_journal("as/fenced", 3)
    async with cluster.client(0) as c:
        svc = AppendService(c)
        svc.expect("as/fenced", pb.LabelSelector(include=fence(1)))
        await c.append("as/fenced", b"zero\n", union_registers=fence(1))  # author 1 holds the log
        assert (await (await svc.append("as/fenced", b"one\n"))).begin == 5
        await c.append("as/fenced", b"handoff\n", union_registers=fence(2))  # author 2 takes it over
        refused = await svc.append("as/fenced", b"two\n")
        await asyncio.wait([refused])
        later = svc.append_nowait("as/fenced", b"three\n")
        with pytest.raises(RegisterMismatchError):
            await refused
        with pytest.raises(EarlierAppendFailedError):
            await later
        assert await c.read_all("as/fenced") == b"zero\none\nhandoff\n"
        await svc.abort()
