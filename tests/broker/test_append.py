"""Appends through real brokers at R=3: disjoint spans that tile the journal, checks and sets of offsets
and registers, aborted appends leaving nothing, and every replica validating every proposal
(DESIGN.md invariants 1-4)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random

import grpc
import pytest

from tests.broker._support import break_pipeline, peers_of, primary_of
from tests.support.replicate import replicate_to
from tests.support.waiting import wait_until
from tidings.broker.transport import StreamError
from tidings.client import AsyncClient
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import RegisterMismatchError, TransportError, WrongAppendOffsetError


async def test_concurrent_appenders_get_disjoint_spans_that_tile_the_journal(cluster) -> None:
    """Invariants 1-2: 20 appenders, every span disjoint, no gaps, every byte as written."""
    await cluster.create_journal("it/concurrent", 3, fragment={"length": "16KiB"})
    rng = random.Random(7)
    written: list[tuple[int, int, bytes]] = []

    async def appender(i: int) -> None:
        async with cluster.client(i % 3) as c:  # through every broker: two of three proxy
            for k in range(10):
                body = f"[{i}:{k}]".encode() * rng.randint(1, 300)
                r = await c.append("it/concurrent", body)
                written.append((r.begin, r.end, body))

    await asyncio.gather(*(appender(i) for i in range(20)))
    written.sort()
    assert written[0][0] == 0
    for (b0, e0, body), (b1, _e1, _) in itertools.pairwise(written):
        assert e0 - b0 == len(body) and e0 == b1, "spans must tile the journal without gaps or overlap"
    total = written[-1][1]
    for i in range(3):
        async with cluster.client(i) as c:
            data = await c.read_all("it/concurrent")
        assert len(data) == total
        for b, e, body in written:
            assert data[b:e] == body

    # Every replica built the same fragments; persisted ones verify against their names.
    await _roll_and_persist(cluster, "it/concurrent")
    views = []
    for b in cluster.brokers:
        req = pb.FragmentsRequest(journal="it/concurrent", do_not_proxy=True)
        resp = await JournalStub(b.channel(b.endpoint)).ListFragments(req)
        assert resp.status == pb.OK
        views.append([(f.spec.begin, f.spec.end, f.spec.sum) for f in resp.fragments if f.url])
    assert views[0] and views[0] == views[1] == views[2]
    for f in cluster.brokers[0].resolver.replicas["it/concurrent"].index.fragments():
        frag, _ = f
        if frag.backing_store:
            with store_for(frag.backing_store).open(frag) as fh:
                assert hashlib.sha1(fh.read()).digest() == frag.sum


async def _roll_and_persist(cluster, journal: str) -> None:
    """Wait until every replica's index lists persisted fragments covering all but the spool's tail."""

    async def persisted() -> bool:
        for b in cluster.brokers:
            rep = b.resolver.replicas.get(journal)
            if rep is None:
                return False
            await rep.refresh_now()
            remote_end = max((f.end for f, p in rep.index.fragments() if p is None), default=0)
            if remote_end < rep.index.end_offset - 16 * 1024 - 4096:
                return False
        return True

    await wait_until(persisted, 30)


async def test_wrong_append_offset_and_registers_check_and_set(cluster) -> None:
    """Two writers race on a register: exactly one wins."""
    await cluster.create_journal("it/registers", 3)
    async with cluster.client(0) as c:
        head = (await c.append("it/registers", b"init", union_registers=labels.label_set({"owner": "none"}))).end
        with pytest.raises(WrongAppendOffsetError):
            await c.append("it/registers", b"x", offset=head + 1)
        assert (await c.append("it/registers", b"y", offset=head)).begin == head

    async def claim(who: str) -> str | None:
        async with cluster.client(hash(who) % 3) as c:
            try:
                await c.append(
                    "it/registers",
                    who.encode(),
                    check_registers=labels.parse_selector("owner=none"),
                    union_registers=labels.label_set({"owner": who}),
                )
                return who
            except RegisterMismatchError:
                return None

    winners = [w for w in await asyncio.gather(claim("alice"), claim("bob")) if w]
    assert len(winners) == 1
    async with cluster.client(1) as c:
        r = await c.append("it/registers", b"")  # zero-byte barrier reports the registers
        assert r.registers == {"owner": winners}


async def _raw_append(endpoint: str, journal: str, chunks: list[bytes], commit: bool, cancel: bool = False):
    async with grpc.aio.insecure_channel(endpoint) as ch:
        call = JournalStub(ch).Append()
        await call.write(pb.AppendRequest(journal=journal))
        for chunk in chunks:
            await call.write(pb.AppendRequest(content=chunk))
        if cancel:
            call.cancel()
            return None
        if commit:
            await call.write(pb.AppendRequest())
        await call.done_writing()
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            return exc


async def test_aborted_appends_leave_no_committed_byte(cluster) -> None:
    """Invariant 2/3: cancelled, uncommitted and stalled appends are never readable."""
    await cluster.create_journal("it/aborts", 3)
    primary = cluster.route("it/aborts").primary
    ep = cluster.brokers[primary].endpoint
    async with cluster.client(0) as c:
        first = await c.append("it/aborts", b"A" * 100)
        # 1. the client cancels mid-stream
        await _raw_append(ep, "it/aborts", [b"X" * 5000] * 3, commit=False, cancel=True)
        # 2. end-of-stream without the commit chunk
        resp = await _raw_append(ep, "it/aborts", [b"Y" * 5000], commit=False)
        assert isinstance(resp, grpc.aio.AioRpcError) and resp.code() == grpc.StatusCode.ABORTED
        # 3. a stalled client is cut off
        cluster.brokers[primary].config.stall_timeout = 0.3
        async with grpc.aio.insecure_channel(ep) as ch:
            call = JournalStub(ch).Append()
            await call.write(pb.AppendRequest(journal="it/aborts"))
            await call.write(pb.AppendRequest(content=b"Z" * 1000))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call  # we never send more: the broker gives up on us
            assert exc.value.code() == grpc.StatusCode.ABORTED
        cluster.brokers[primary].config.stall_timeout = 10.0
        after = await c.append("it/aborts", b"B" * 10)
        assert after.begin == first.end, "later appends continue at the right offset"
        for i in range(3):
            async with cluster.client(i) as ci:
                assert await ci.read_all("it/aborts") == b"A" * 100 + b"B" * 10


async def test_peer_refuses_wrong_sha1_and_offset(cluster) -> None:
    """Invariant 4: a primary (here, a rogue one) proposing a wrong SHA1 or offset is refused."""
    await cluster.create_journal("it/mismatch", 3)
    async with cluster.client(0) as c:
        await c.append("it/mismatch", b"hello")
    route = cluster.route("it/mismatch")
    peer_i = (route.primary + 1) % 3
    peer = next(b for b in cluster.brokers if b.process_id == route.members[peer_i])
    header = peer.resolver.header(route)
    # Wait for the pulse to release... the real primary holds the peer's spool; stop its pipeline first.
    primary = next(b for b in cluster.brokers if b.process_id == route.members[route.primary])
    rep = primary.resolver.replicas["it/mismatch"]
    pipeline = await rep.pipeline_slot.get()  # hold the primary's pipeline: no pulse meanwhile
    try:
        if pipeline is not None:
            pipeline.shutdown()  # gives the spool back and ends the peers' streams
        peer_spool_frag = peer.resolver.replicas["it/mismatch"]
        await wait_until(lambda: not peer_spool_frag.spool_slot.empty(), 10)
        current = peer_spool_frag.spool_slot.peek().fragment
        async with replicate_to(peer) as call:
            await call.write(pb.ReplicateRequest(header=header, proposal=current.to_proto(), acknowledge=True))
            assert (await call.read()).status == pb.OK
            await call.write(pb.ReplicateRequest(content=b"evil", content_delta=0))
            wrong_sum = Fragment(
                journal="it/mismatch", begin=current.begin, end=current.end + 4, sum=hashlib.sha1(b"nope").digest()
            )
            await call.write(pb.ReplicateRequest(proposal=wrong_sum.to_proto(), acknowledge=True))
            resp = await call.read()
            assert resp.status == pb.PROPOSAL_MISMATCH
            assert Fragment.from_proto(resp.fragment) == current  # the peer answers with its own view
            # A proposal beyond everything the peer holds would roll it forward (Gazette's rule for a
            # peer catching up); one inside its uncommitted content matches nothing.
            wrong_offset = Fragment(journal="it/mismatch", begin=current.begin, end=current.end + 2, sum=b"\0" * 20)
            await call.write(pb.ReplicateRequest(proposal=wrong_offset.to_proto(), acknowledge=True))
            assert (await call.read()).status == pb.PROPOSAL_MISMATCH
            await call.write(pb.ReplicateRequest(content=b"x", content_delta=99))  # wrong delta: stream aborted
            with pytest.raises(StreamError, match="INVALID_ARGUMENT"):
                await call.read()
    finally:
        rep.pipeline_slot.put_nowait(None)
    async with cluster.client(0) as c:
        more = await c.append("it/mismatch", b" world")
        assert more.begin == 5
        for i in range(3):
            async with cluster.client(i) as ci:
                assert await ci.read_all("it/mismatch") == b"hello world"


async def test_one_message_append_commits_and_content_after_commit_rolls_back(cluster) -> None:
    """The first message may carry the content and `commit`: a whole small append in one message."""
    await cluster.create_journal("it/single", 3)
    ep = cluster.brokers[1].endpoint  # not necessarily the primary: proxied as is

    async def raw(*msgs: pb.AppendRequest) -> pb.AppendResponse | grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(ep) as ch:
            try:
                return await JournalStub(ch).Append(iter(msgs))
            except grpc.aio.AioRpcError as exc:
                return exc

    ok = await raw(pb.AppendRequest(journal="it/single", content=b"hello", commit=True))
    assert ok.status == pb.OK and (ok.commit.begin, ok.commit.end) == (0, 5)
    late = await raw(pb.AppendRequest(journal="it/single", content=b"X", commit=True), pb.AppendRequest(content=b"Y"))
    assert isinstance(late, grpc.aio.AioRpcError) and late.code() == grpc.StatusCode.INVALID_ARGUMENT  # misuse
    unfinished = await raw(pb.AppendRequest(journal="it/single", content=b"Z"))
    assert isinstance(unfinished, grpc.aio.AioRpcError) and unfinished.code() == grpc.StatusCode.ABORTED
    two = await raw(
        pb.AppendRequest(journal="it/single", content=b" wor"), pb.AppendRequest(content=b"ld", commit=True)
    )
    assert two.status == pb.OK and (two.commit.begin, two.commit.end) == (5, 11)
    async with cluster.client(2) as c:
        assert await c.read_all("it/single") == b"hello world"


# -- registers change only with appended bytes ----------------------------------------------------


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


# -- synchronization, un-acknowledged proposals, the commit's SHA1 --------------------------------


async def test_a_divergent_peer_is_not_rolled_past(cluster) -> None:
    """A peer whose fragment ends where ours does but holds other content cannot be made consistent
    by rolling forward (only a peer that is ahead, or rolled to our end, can): the sync fails."""
    j = "it/divergent"
    await cluster.create_journal(j, 3)
    async with cluster.client(0) as c:
        await c.append(j, b"abc")
        await c.append(j, b"def")  # the first fragment rolled: [3, 6) is current everywhere
    primary = primary_of(cluster, j)
    await break_pipeline(primary.resolver.replicas[j])
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
    await break_pipeline(primary.resolver.replicas[j])
    pipeline = await primary.resolver.replicas[j].pipeline_slot.get()  # no pulse meanwhile
    try:
        peer = peers_of(cluster, j)[0]
        peer_replica = peer.resolver.replicas[j]
        await wait_until(lambda: peer_replica.spool_slot.full(), 10)
        current = peer_replica.spool_slot.peek().fragment
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


# -- a journal created again under its name --------------------------------------------------------


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
