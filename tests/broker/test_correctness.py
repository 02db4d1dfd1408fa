"""Broker correctness scenarios (the broker-correctness issue, items 1-10 and 13), on real brokers.

Each test drives the real code (real spools, real brokers on loopback gRPC, a real etcd) into a
scenario that once lost an acknowledged append, paired acknowledgements with the wrong append,
skipped committed bytes, leaked an ownership token or answered wrongly, and checks the
guarantee (DESIGN.md invariants 1-4 and 6).
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import grpc
import pytest

from tests.support.fragments import write_foreign_fragment
from tests.support.replicate import replicate_to
from tests.support.waiting import wait_until
from tidings.broker.append_fsm import AppendFSM, AppendState
from tidings.broker.resolver import Resolution
from tidings.broker.service import Broker
from tidings.broker.transport import StreamError
from tidings.client import AsyncClient
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import FragmentStoreUnhealthyError, InsufficientJournalBrokersError, TransportError

S = AppendState


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


def tokens_idle(cluster, journal: str) -> bool:
    """The primary's tokens are back (a peer's spool is held by its primary's stream, as it should be)."""
    return primary_of(cluster, journal).resolver.replicas[journal].tokens_idle()


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


# -- item 1: a store refresh never deletes a live spool file -----------------------------------


async def test_a_listing_that_covers_the_live_spool_never_deletes_it(cluster) -> None:
    """The old primary of an idle journal persists [b, e) while the new primary and its peers still
    hold [b, e) as their current spool fragment. Their next listing covers it: the spool files must
    survive, appends resume into them, reads of them work, and the next roll loses nothing."""
    j = "it/live-spool"
    await cluster.create_journal(j, 3, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        first = await c.append(j, b"first")
        second = await c.append(j, b"hello")  # the first fragment rolled: [5, 10) is the live spool fragment
        assert (second.begin, second.end) == (5, 10)
        write_foreign_fragment(cluster, j, 5, b"hello")  # what the old primary persists as it leaves
        for b in cluster.brokers:
            await b.resolver.replicas[j].refresh_now()
        for b in cluster.brokers:
            live = b.resolver.replicas[j]
            spool = (
                live.spool_slot._queue[0]
                if live.spool_slot.full()
                else primary_of(cluster, j).resolver.replicas[j].pipeline_slot._queue[0].spool
            )  # type: ignore[attr-defined]
            if spool.file is not None:
                assert spool.file.path.exists(), f"{b.process_id.suffix}: the live spool file was deleted"
        third = await c.append(j, b" world")
        assert third.begin == 10
        big = await c.append(j, b"x" * 2000)  # past the fragment length: the next append rolls
        last = await c.append(j, b"!")
        spans = [
            (first.begin, first.end, b"first"),
            (5, 10, b"hello"),
            (10, 16, b" world"),
            (big.begin, big.end, b"x" * 2000),
            (last.begin, last.end, b"!"),
        ]
        await assert_replicas_hold(cluster, j, spans)

        async def stored() -> bool:
            return max((f.end for f in store_for(cluster.store_url).list(j)), default=0) >= big.end

        await wait_until(stored, 20)
        assert await c.read_all(j) == b"firsthello world" + b"x" * 2000 + b"!"


# -- item 2: cancellation anywhere, under load ---------------------------------------------------


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

    async def cancelling() -> AppendState:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return await original()

    fsm._handlers[state] = cancelling


async def _break_pipeline(replica) -> None:
    pipeline = await replica.pipeline_slot.get()
    if pipeline is not None:
        pipeline.shutdown()
    replica.pipeline_slot.put_nowait(None)


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
    """Item 2: appends cancelled in each FSM state, beside concurrent appenders: every client gets an
    answer, every OK append is on all replicas at its offsets, a cancelled append is all or nothing,
    and both ownership tokens come back (item 13)."""
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
                await _break_pipeline(replica)  # so the next append builds and synchronizes one
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
    """Item 2, from outside: raw Append calls cancelled by their clients at random moments (before
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


# -- item 4: INDEX_HAS_GREATER_OFFSET is never bypassed, and the first fragment rolls early --------


async def test_the_first_fragment_is_persisted_at_the_next_append(cluster) -> None:
    """Item 4: the spool holding the journal's first write rolls at the next append, so the store
    shows the journal was written (a recovering broker cannot take it for a new one)."""
    j = "it/first-roll"
    await cluster.create_journal(j, 3, fragment={"length": "64MiB"})
    async with cluster.client(0) as c:
        await c.append(j, b"first write")
        await c.append(j, b"second")

    def persisted() -> bool:
        return any(f.begin == 0 and f.end == 11 for f in store_for(cluster.store_url).list(j))

    await wait_until(persisted, 20)


# -- item 5: a peer failing mid-append never leaves the append committed on the others -----------


async def test_a_peer_failing_mid_append_rolls_the_append_back_everywhere(cluster) -> None:
    j = "it/peer-fails"
    await cluster.create_journal(j, 3)
    async with cluster.client(0) as c:
        await c.append(j, b"before|")
    primary = primary_of(cluster, j)
    victim = peers_of(cluster, j)[0]
    survivor = peers_of(cluster, j)[1]
    slot = primary.resolver.replicas[j].pipeline_slot
    await wait_until(lambda: slot.full() and slot._queue[0] is not None, 10)  # type: ignore[attr-defined]
    pipeline = slot._queue[0]  # type: ignore[attr-defined]  # the synchronized pipeline our append will take
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


# -- item 6: a peer without an endpoint never leaks the spool ----------------------------------


async def test_a_route_naming_a_peer_without_endpoint_fails_cleanly_and_leaks_nothing(cluster, monkeypatch) -> None:
    j = "it/no-endpoint"
    await cluster.create_journal(j, 3)
    primary = primary_of(cluster, j)
    replica = primary.resolver.replicas[j]
    await _break_pipeline(replica)
    real = primary.resolver.resolve

    async def resolve_without_a_peer_endpoint(journal: str, min_revision: int = 0) -> Resolution:
        res = await real(journal, min_revision)
        if journal != j:
            return res
        header = pb.Header()
        header.CopyFrom(res.header)
        peer = next(i for i in range(len(header.route.members)) if i != header.route.primary)
        header.route.endpoints[peer] = ""  # its member key expired before its assignments went
        return Resolution(res.status, header, res.spec, res.replica)

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
    """Item 13: a token taken is returned on every path, even an unexpected exception."""
    j = "it/build-fails"
    await cluster.create_journal(j, 3)
    primary = primary_of(cluster, j)
    replica = primary.resolver.replicas[j]
    await _break_pipeline(replica)

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


# -- item 7: registers change only with appended bytes ------------------------------------------


async def test_a_zero_byte_append_that_changes_registers_is_refused(cluster) -> None:
    j = "it/empty-registers"
    await cluster.create_journal(j, 3)
    async with cluster.client(0) as c:
        await c.append(j, b"x", union_registers=labels.label_set({"fence": "1"}))
        with pytest.raises(TransportError, match="at least one appended byte"):
            await c.append(j, b"", union_registers=labels.label_set({"fence": "2"}))
        with pytest.raises(TransportError, match="at least one appended byte"):
            await c.append(j, b"", subtract_registers=labels.label_set({"fence": "1"}))
        barrier = await c.append(j, b"")  # a plain zero-byte barrier is fine
        assert barrier.registers == {"fence": ["1"]}


# -- item 8: synchronization, un-acknowledged proposals, the commit's SHA1 ------------------------


async def test_a_divergent_peer_is_not_rolled_past(cluster) -> None:
    """A peer whose fragment ends where ours does but holds other content cannot be made consistent
    by rolling forward (only a peer that is ahead, or rolled to our end, can): the sync fails."""
    j = "it/divergent"
    await cluster.create_journal(j, 3)
    async with cluster.client(0) as c:
        await c.append(j, b"abc")
        await c.append(j, b"def")  # the first fragment rolled: [3, 6) is current everywhere
    primary = primary_of(cluster, j)
    await _break_pipeline(primary.resolver.replicas[j])
    peer = peers_of(cluster, j)[0].resolver.replicas[j]
    spool = await peer.spool_slot.get()
    try:
        cur = spool.fragment
        spool.fragment = Fragment(j, cur.begin, cur.end, hashlib.sha1(b"XYZ").digest(), cur.codec)
    finally:
        peer.spool_slot.put_nowait(spool)
    async with AsyncClient(primary.endpoint, retries=0) as c:
        with pytest.raises(TransportError, match="synchroniz"):
            await asyncio.wait_for(c.append(j, b"ghi"), 60)


async def test_an_unacknowledged_proposal_that_does_not_apply_ends_the_stream(cluster) -> None:
    """Answering it would pair the answer with the primary's next proposal."""
    j = "it/unacked"
    await cluster.create_journal(j, 3)
    async with cluster.client(0) as c:
        await c.append(j, b"hello")
    route = cluster.route(j)
    primary = primary_of(cluster, j)
    await _break_pipeline(primary.resolver.replicas[j])
    pipeline = await primary.resolver.replicas[j].pipeline_slot.get()  # no pulse meanwhile
    try:
        peer = peers_of(cluster, j)[0]
        peer_replica = peer.resolver.replicas[j]
        await wait_until(lambda: peer_replica.spool_slot.full(), 10)
        current = peer_replica.spool_slot._queue[0].fragment  # type: ignore[attr-defined]
        async with replicate_to(peer) as call:
            header = peer.resolver.header(route)
            await call.write(pb.ReplicateRequest(header=header, proposal=current.to_proto(), acknowledge=True))
            assert (await call.read()).status == pb.OK
            behind = Fragment(j, 0, 1, hashlib.sha1(b"h").digest())
            await call.write(pb.ReplicateRequest(proposal=behind.to_proto(), acknowledge=False))
            with pytest.raises(StreamError, match="FAILED_PRECONDITION"):
                await call.read()
    finally:
        primary.resolver.replicas[j].pipeline_slot.put_nowait(pipeline)


async def test_the_commit_carries_the_sha1_of_the_appended_content(cluster) -> None:
    j = "it/commit-sum"
    await cluster.create_journal(j, 3)
    async with cluster.client(1) as c:
        r = await c.append(j, b"checksummed content")
    assert r.sum == hashlib.sha1(b"checksummed content").hexdigest()


# -- item 10: only the primary persists at once ---------------------------------------------------


async def test_only_the_primary_uploads_a_fragment(cluster) -> None:
    j = "it/one-upload"
    await cluster.create_journal(j, 3, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        for k in range(6):
            await c.append(j, bytes([65 + k]) * 1500)  # each append past 1 KiB rolls the fragment
    store = store_for(cluster.store_url)
    await wait_until(lambda: len(store.list(j)) >= 5, 20)
    primary = primary_of(cluster, j)
    # (its statistics count an upload once the upload's thread returns, a moment after the file appears)
    await wait_until(lambda: primary.persister.statistics().uploaded >= 5, 20)
    for peer in peers_of(cluster, j):
        assert peer.persister.statistics().uploaded == 0, "a replica uploaded what the primary already had"
        assert peer.persister.statistics().queued >= 5, "replicas keep theirs for later, in case"


# -- item 16 (run time): a store that cannot be listed answers with a status ---------------------


async def test_an_unusable_store_answers_fragment_store_unhealthy(cluster, tmp_path) -> None:
    """A store listing that fails (here a file:// store whose root is a plain file) answers appends and
    reads with FRAGMENT_STORE_UNHEALTHY instead of leaving them waiting forever."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"in the way")
    j = "it/bad-store"
    spec_store = f"file://{blocker}/"
    await cluster.create_journal(j, 3, fragment={"stores": [spec_store]})
    async with AsyncClient(cluster.brokers[0].endpoint, retries=0) as c:
        with pytest.raises(FragmentStoreUnhealthyError):
            await asyncio.wait_for(c.append(j, b"x"), 30)


# -- the review's scenarios ------------------------------------------------------------------


async def test_a_recreated_journal_starts_fresh(cluster) -> None:
    """A journal deleted and created again under its name inherits neither offsets nor registers from
    the brokers' spools (its old fragments stay in the old store, as in Gazette; this one uses another)."""
    j = "it/recreated"
    await cluster.create_journal(j, 3)
    async with AsyncClient(cluster.brokers[0].endpoint) as c:
        for i in range(3):
            await c.append(j, f"old-{i}\n".encode() * 10, union_registers=labels.label_set({"owner": "old"}))
        item = next(x for x in (await c.list()).journals if x.spec.name == j)
        resp = await c.apply([pb.ApplyRequest.Change(delete=j, expect_mod_revision=item.mod_revision)])
        assert resp.status == pb.OK
        await wait_until(lambda: all(j not in b.resolver.replicas for b in cluster.brokers), 30)
        await cluster.create_journal(j, 3, fragment={"stores": [f"file://{cluster.data_dir / 'other-store'}/"]})
        r = await c.append(j, b"new journal, first record\n")
    assert (r.begin, r.registers) == (0, {})


async def test_a_replica_closed_right_after_an_abort_gets_its_pipeline_token_back(cluster) -> None:
    """A roll-back task cancelled before its first step (the replica closes in the same loop turn)
    still returns the pipeline token: the close does not hang."""
    from tidings.broker.append_fsm import _roll_back_abandoned

    j = "it/abort-then-close"
    await cluster.create_journal(j, 3)
    replica = primary_of(cluster, j).resolver.replicas[j]
    pipeline = await replica.pipeline_slot.get()
    if pipeline is None:
        await asyncio.wait_for(_synchronize(cluster, j), 30)
        pipeline = await replica.pipeline_slot.get()
    assert pipeline is not None
    _roll_back_abandoned(replica, pipeline)  # what abort() does for an append cancelled mid-stream
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


# -- review 2: every replica's HEAD covers an append before its client hears OK ----------------------


async def test_every_replica_records_an_append_before_its_client_hears_ok(etcd, etcd_root, tmp_path) -> None:
    """A replica recovers on its own no further than its HEAD. A peer records each commit there before
    it answers it, and the primary before it tells the client, so when the last append of a burst (no
    append, no pulse following) returns OK, every replica's HEAD already covers it."""
    from tests.support.cluster import TestCluster
    from tidings.broker.replica import spool_directory
    from tidings.fragment.spool import HEAD, _read_head

    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, pulse_interval=600.0)  # no pulse to carry it
    try:
        for zone in ("zone-a", "zone-b", "zone-c"):
            await tc.add_broker(zone)
        j = "it/ack-note"
        await tc.create_journal(j, 3)
        async with tc.client(0) as c:
            await c.append(j, b"first ")
            last = await c.append(j, b"and the last of the burst")
        for broker in tc.brokers:
            h = _read_head(spool_directory(broker.config.data_dir, j) / HEAD, j)
            assert h is not None and h.committed_end == last.end, f"{broker.config.suffix}: {h}"
    finally:
        await tc.stop()
