"""The append state machine, one state at a time (Gazette's `broker/append_fsm_test.go`).

Each test builds FSMs against a stub broker (`tests/broker/_stub.py`: an in-memory etcd under the real
KeySpace and Resolver, replicas without daemons, peers whose streams the test reads and answers), runs
one to a state, calls that state's handler, and asserts the next state, the Status and the error. Each
"Case:" is one outgoing transition. The last tests interleave appends deterministically.

Together they hold the FSM to its share of DESIGN.md's invariants: an append acknowledged OK is held by
every replica (1); no offset goes to two appends, and a rolled-back append leaves no byte (2); replicas
validate every proposal and never diverge (4); consistency is advertised only for a synchronized route
(5); and a primary that lost consistency refuses to guess (6).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import REGISTRY

from tests.broker._stub import Hold, Sequencer, StubBroker, settle, wait_for_state
from tests.broker._support import break_pipeline
from tests.support.waiting import wait_until
from tidings.broker.append_fsm import TERMINAL, AppendFSM
from tidings.broker.append_fsm import AppendState as S
from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.fragment.spool import Spool
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

pytestmark = pytest.mark.timeout(30)  # (each test takes milliseconds: a loop that never ends fails fast)

J = "a/journal"
NONE, PARTIAL, FULL = pb.JournalSpec.Suspend.NONE, pb.JournalSpec.Suspend.PARTIAL, pb.JournalSpec.Suspend.FULL
DAY = 24 * 3600


@pytest.fixture
async def broker(tmp_path) -> AsyncIterator[StubBroker]:
    b = await StubBroker(tmp_path).start()
    try:
        yield b
    finally:
        await b.aclose()


async def step(fsm: AppendFSM, state: S) -> S:
    """Call the handler of `state` (the FSM must be in it) and move to the state it returns, as `run_to`
    does, which also gives the pipeline back at a terminal state."""
    assert fsm.state is state, f"the FSM is in {fsm.state}, not {state}"
    fsm.state = await fsm._handlers[state](fsm)
    if fsm.state in TERMINAL:
        await fsm.run_to()
    return fsm.state


def outcome(fsm: AppendFSM) -> tuple[S, str, str | None]:
    return fsm.state, pb.Status.Name(fsm.status), fsm.error


async def commit(fsm: AppendFSM, *chunks: bytes) -> S:
    """From STREAM_CONTENT: stream `chunks`, the commit chunk and end-of-stream; read the acknowledgements."""
    for chunk in chunks:
        await fsm.on_stream_content(pb.AppendRequest(content=chunk))
    await fsm.on_stream_content(pb.AppendRequest())
    await fsm.on_stream_content(None)
    assert fsm.state is S.READ_ACKNOWLEDGEMENTS
    return await fsm.run_to()


async def append(broker: StubBroker, journal: str, *chunks: bytes, **fields) -> AppendFSM:
    fsm = broker.fsm(journal, **fields)
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT, outcome(fsm)
    assert await commit(fsm, *chunks) is S.FINISHED, outcome(fsm)
    return fsm


def labels(**kv: str) -> pb.LabelSet:
    return pb.LabelSet(labels=[pb.Label(name=k, value=v) for k, v in sorted(kv.items())])


def held(spool: Spool) -> tuple[int, int, bytes]:
    """A spool's current fragment and the committed bytes it holds."""
    f = spool.fragment
    content = spool.file.pread(f.content_length, 0) if spool.file is not None else b""
    return f.begin, f.end, content


def touch(spec: pb.JournalSpec) -> None:
    """A spec change that leaves the route alone (the replica's route_changed fires all the same)."""
    spec.max_append_rate += 1


def sha1(data: bytes) -> bytes:
    return hashlib.sha1(data).digest()


def counted(counter: str) -> float:
    """A broker counter's value now (`broker/_metrics.py`: tidings_<counter>_total)."""
    return REGISTRY.get_sample_value(f"tidings_{counter}_total") or 0.0


# -- RESOLVE ---------------------------------------------------------------------------------------


async def test_resolve(broker):
    """RESOLVE: a journal is resolved at (or after) the etcd revision the request names; only its primary
    appends, and a broker that stops being primary gives its pipeline and spool back at once."""
    peer = await broker.add_peer("zone-b", "peer")
    await broker.create_journal(J, [broker, peer])
    await broker.create_journal("other/journal", [peer, broker])
    await broker.create_journal("s/journal", [], replication=1, suspend={"level": "full", "offset": 1024})
    replica = broker.replica(J)

    # Case: the journal does not exist.
    fsm = broker.fsm("does/not/exist")
    assert await step(fsm, S.RESOLVE) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "JOURNAL_NOT_FOUND", None)
    assert fsm.resolved.route.primary == -1

    # Case: we are the primary, and do not own the pipeline yet.
    fsm = broker.fsm(J)
    assert await step(fsm, S.RESOLVE) is S.ACQUIRE_PIPELINE
    assert fsm.resolved.is_primary and fsm.resolved.replica is replica and not fsm.owns_pipeline

    # Case: we re-resolve (after advertising the route) owning the pipeline, still primary: keep it.
    fsm = broker.fsm(J)
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.RESOLVE
    pipeline = fsm.pipeline
    assert await step(fsm, S.RESOLVE) is S.START_PIPELINE
    assert fsm.owns_pipeline and fsm.pipeline is pipeline and fsm.read_through_rev == 0
    fsm.abort()  # (Gazette's returnPipeline: a synchronized pipeline goes back to its slot)

    # Case: the same, but the primary moved to the peer meanwhile: shut the pipeline down and give it back.
    await broker.set_members(J, [broker, peer])  # (fresh assignments: the route is not advertised yet)
    fsm = broker.fsm(J)
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.RESOLVE
    await broker.set_members(J, [peer, broker])
    assert await step(fsm, S.RESOLVE) is S.AWAIT_DESIRED_REPLICAS
    assert not fsm.owns_pipeline and fsm.pipeline is None
    assert replica.tokens_idle() and replica.spool_slot.full()
    await wait_until(lambda: peer.stream.closed, interval=0)  # (its teardown ends the peer's stream)
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.PROXY

    # Case: another broker is primary; we hold a secondary replica.
    fsm = broker.fsm("other/journal")
    assert await step(fsm, S.RESOLVE) is S.AWAIT_DESIRED_REPLICAS
    assert not fsm.resolved.is_primary and fsm.resolved.replica is broker.replica("other/journal")

    # Case: the journal is fully suspended, and the append may not resume it.
    fsm = broker.fsm("s/journal", suspend=pb.AppendRequest.SUSPEND_NO_RESUME)
    assert await step(fsm, S.RESOLVE) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "SUSPENDED", None)

    # Case: the journal is fully suspended: a client's append resumes it where it stopped.
    fsm = broker.fsm("s/journal")
    assert await step(fsm, S.RESOLVE) is S.UPDATE_SUSPEND
    assert fsm.next_suspend == pb.JournalSpec.Suspend(level=NONE, offset=1024)

    # Case: we are primary, but hold no replica of the journal (the broker is stopping).
    await broker.create_journal("c/journal", [broker])
    held_replica = broker.resolver.replicas.pop("c/journal")
    fsm = broker.fsm("c/journal")
    assert await step(fsm, S.RESOLVE) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "NO_JOURNAL_PRIMARY_BROKER", "primary replica is not yet started")
    broker.resolver.replicas["c/journal"] = held_replica

    # Case: the request names a later etcd revision than ours: wait until our KeySpace reaches it, and
    # resolve there (where the peer is primary), not at our stale view (where we are).
    async with broker.etcd.withheld():
        revision = await broker.set_members("c/journal", [peer, broker])
        fsm = broker.fsm("c/journal", header=pb.Header(etcd=pb.Header.Etcd(revision=revision)))
        resolving = asyncio.create_task(step(fsm, S.RESOLVE))
        await settle()
        assert not resolving.done()
    assert await resolving is S.AWAIT_DESIRED_REPLICAS
    assert fsm.resolved.header.etcd.revision >= revision and not fsm.resolved.is_primary
    assert fsm.read_through_rev == 0

    # Case: an append cancelled while it waits to read through gives nothing back: it held nothing.
    fsm = broker.fsm("c/journal", header=pb.Header(etcd=pb.Header.Etcd(revision=broker.etcd.revision + 1)))
    resolving = asyncio.create_task(fsm.run_to(S.STREAM_CONTENT))
    await settle()
    resolving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await resolving
    assert fsm.state is S.RESOLVE and not fsm.owns_pipeline


# -- ACQUIRE_PIPELINE ------------------------------------------------------------------------------


async def test_resolutions_are_shared_until_the_keyspace_changes(broker):
    """A journal resolves once per revision (each append resolves it): the same Header until
    etcd changes, then a new one; `advertised` says what comparing each assignment's route says; a
    caller's claims are checked on every resolve, cached or not."""
    from tidings.protocol.claims import Claims
    from tidings.protocol.route import routes_equivalent

    peer = await broker.add_peer("zone-b", "peer")
    await broker.create_journal(J, [broker, peer], labels={"app": "a"})
    resolver = broker.resolver
    first, again = await resolver.resolve(J), await resolver.resolve(J)
    assert again.header is first.header and again.replica is broker.replica(J)
    for res in (first, again):
        assert res.advertised == all(routes_equivalent(a.value, res.route) for a in res.assignments) is False
    other = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="app", value="b")]))
    hidden = await resolver.resolve(J, claims=Claims(cap=0, sel=other))
    assert hidden.status == pb.JOURNAL_NOT_FOUND and hidden.route.primary == -1
    await broker.create_journal("other/journal", [peer, broker])  # (any change under the root)
    later = await resolver.resolve(J)
    assert later.header is not first.header and later.header.etcd.revision > first.header.etcd.revision
    assert routes_equivalent(later.route, first.route)


async def test_acquire_pipeline(broker):
    """ACQUIRE_PIPELINE: one append at a time owns the pipeline's send side; waiting for it gives way to a
    route change, and a token taken as the route changed goes back (STYLE.md, *Ownership tokens*)."""
    await broker.create_journal(J, [broker])
    replica = broker.replica(J)

    # Case: uncontended: the token is the slot's None (no pipeline built yet).
    fsm = broker.fsm()
    await fsm.run_to(S.ACQUIRE_PIPELINE)
    assert await step(fsm, S.ACQUIRE_PIPELINE) is S.START_PIPELINE
    assert fsm.owns_pipeline and fsm.pipeline is None
    fsm.abort()
    assert replica.tokens_idle()

    # Case: the route changed since we resolved: resolve again, although the pipeline is free.
    fsm = broker.fsm()
    await fsm.run_to(S.ACQUIRE_PIPELINE)
    await broker.edit_spec(J, touch)
    assert await step(fsm, S.ACQUIRE_PIPELINE) is S.RESOLVE
    assert (fsm.status, fsm.error, fsm.owns_pipeline) == (pb.OK, None, False)
    assert replica.tokens_idle()

    # Case: another append owns the pipeline, and the route changes while we wait for it.
    owner = broker.fsm()
    await owner.run_to(S.STREAM_CONTENT)
    fsm = broker.fsm()
    await fsm.run_to(S.ACQUIRE_PIPELINE)
    waiting = asyncio.create_task(step(fsm, S.ACQUIRE_PIPELINE))
    await settle()
    assert not waiting.done()
    await broker.edit_spec(J, touch)
    assert await waiting is S.RESOLVE
    assert not fsm.owns_pipeline

    # Case: another append owns the pipeline, and hands it on as soon as its commit proposal is out.
    pipeline = owner.pipeline
    fsm = broker.fsm()
    await fsm.run_to(S.ACQUIRE_PIPELINE)
    waiting = asyncio.create_task(step(fsm, S.ACQUIRE_PIPELINE))
    await settle()
    assert not waiting.done()
    await owner.on_stream_content(pb.AppendRequest(content=b"abc"))
    await owner.on_stream_content(pb.AppendRequest())
    await owner.on_stream_content(None)
    assert owner.state is S.READ_ACKNOWLEDGEMENTS and not owner.owns_pipeline
    assert await waiting is S.START_PIPELINE
    assert fsm.pipeline is pipeline
    assert await owner.run_to() is S.FINISHED
    fsm.abort()

    # Case: the replica closes while we wait.
    owner = broker.fsm()
    await owner.run_to(S.STREAM_CONTENT)
    fsm = broker.fsm()
    await fsm.run_to(S.ACQUIRE_PIPELINE)
    waiting = asyncio.create_task(step(fsm, S.ACQUIRE_PIPELINE))
    await settle()
    closing = asyncio.create_task(replica.aclose())
    assert await waiting is S.RESOLVE
    assert not fsm.owns_pipeline
    owner.abort()  # (nothing sent yet: the pipeline just goes back, and the close takes it)
    await closing


# -- START_PIPELINE, SEND_PIPELINE_SYNC, RECV_PIPELINE_SYNC ------------------------------------------


async def test_start_and_synchronize_pipeline(broker):
    """START_PIPELINE, SEND_PIPELINE_SYNC and RECV_PIPELINE_SYNC's happy path: a pipeline is built for the
    resolved route and used only once every peer agreed to the primary's fragment (invariant 4); a
    synchronized pipeline of the same route is reused as it is, one of another route is torn down."""
    peer = await broker.add_peer("zone-b", "peer", auto=False)
    await broker.create_journal(J, [broker, peer])
    replica = broker.replica(J)

    # Case: no pipeline yet: build one to the route's peers.
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    assert await step(fsm, S.START_PIPELINE) is S.SEND_PIPELINE_SYNC
    assert broker.opened == [fsm.resolved.route] and len(peer.streams) == 1
    assert not fsm.pipeline.synchronized

    # Case: its first sync carries the Header and proposes the spool's fragment, asking for an answer.
    assert await step(fsm, S.SEND_PIPELINE_SYNC) is S.RECV_PIPELINE_SYNC
    req = await peer.stream.request()
    assert req.header == fsm.resolved.header
    assert req.proposal == pb.Fragment(journal=J, begin=0, end=0, sum=EMPTY_SUM, compression_codec=pb.NONE)
    assert req.acknowledge and req.registers == pb.LabelSet()

    # Case: every peer agrees: the pipeline is synchronized, and so is the replica.
    peer.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.UPDATE_ASSIGNMENTS
    assert (fsm.status, fsm.error) == (pb.OK, None)
    assert fsm.pipeline.synchronized and replica.synchronized.is_set()
    pipeline = fsm.pipeline
    fsm.abort()

    # Case: the next append finds the pipeline synchronized at the same route: nothing to send.
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    assert await step(fsm, S.START_PIPELINE) is S.UPDATE_ASSIGNMENTS
    assert fsm.pipeline is pipeline and len(peer.streams) == 1 and peer.stream.pending() == 0
    fsm.abort()

    # Case: the route changed (another peer replaced ours): tear the old pipeline down and build anew.
    other = await broker.add_peer("zone-c", "other", auto=False)
    await broker.set_members(J, [broker, other])
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    assert fsm.pipeline is pipeline
    assert await step(fsm, S.START_PIPELINE) is S.SEND_PIPELINE_SYNC
    assert fsm.pipeline is not pipeline and len(other.streams) == 1
    await wait_until(lambda: peer.stream.closed, interval=0)  # (the old peer rolls back and ends its side)
    fsm.abort()  # (never synchronized: shut down)
    assert replica.tokens_idle() and replica.spool_slot.full()

    # Case: a peer of the route has no endpoint (its member key is gone): too few brokers.
    await broker.set_members(J, [broker, ("zone-d", "gone")])
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    assert await step(fsm, S.START_PIPELINE) is S.ERROR
    assert outcome(fsm) == (
        S.ERROR,
        "INSUFFICIENT_JOURNAL_BROKERS",
        "peer zone-d/gone has no endpoint (its broker is gone)",
    )
    assert replica.tokens_idle()

    # Case: the spool is held (a former primary's replication stream), and the route changes meanwhile.
    await broker.set_members(J, [broker, peer])
    spool = replica.spool_slot.get_nowait()
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    waiting = asyncio.create_task(step(fsm, S.START_PIPELINE))
    await settle()
    assert not waiting.done()
    await broker.edit_spec(J, touch)
    assert await waiting is S.RESOLVE
    assert fsm.owns_pipeline and fsm.pipeline is None  # (the slot stays ours, holding nothing)
    replica.return_spool(spool)
    fsm.abort()
    assert replica.tokens_idle()


async def test_recv_pipeline_sync(broker):
    """RECV_PIPELINE_SYNC: the primary rolls forward to what a peer holds beyond it (an offset a peer
    committed is never handed out again, invariant 2), re-resolves when a peer knows a later route, and
    refuses to go on with a peer that disagrees otherwise (replicas never diverge, invariant 4)."""
    b = await broker.add_peer("zone-b", "b", auto=False)
    c = await broker.add_peer("zone-c", "c", auto=False)
    await broker.create_journal(J, [broker, b, c])
    replica = broker.replica(J)

    async def sync_proposed() -> AppendFSM:
        fsm = broker.fsm()
        assert await fsm.run_to(S.RECV_PIPELINE_SYNC) is S.RECV_PIPELINE_SYNC
        for p in (b, c):
            assert (await p.stream.request()).acknowledge
        return fsm

    # Case: a peer's fragment ends past ours (it holds commits we never saw): roll forward to its end,
    # taking its registers.
    fsm = await sync_proposed()
    ahead = pb.Fragment(journal=J, begin=567, end=892, sum=sha1(b"?"), compression_codec=pb.NONE)
    b.stream.respond(status=pb.PROPOSAL_MISMATCH, fragment=ahead, registers=labels(reg="x"))
    c.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.SEND_PIPELINE_SYNC
    assert (fsm.roll_to_offset, fsm.registers, fsm.read_through_rev) == (892, labels(reg="x"), 0)
    assert (fsm.status, fsm.error, fsm.pipeline.synchronized) == (pb.OK, None, False)

    # Case: the re-sync proposes an empty fragment there, with those registers (and no Header now).
    assert await step(fsm, S.SEND_PIPELINE_SYNC) is S.RECV_PIPELINE_SYNC
    for p in (b, c):
        req = await p.stream.request()
        assert not req.HasField("header") and req.acknowledge
        assert req.proposal == pb.Fragment(journal=J, begin=892, end=892, sum=EMPTY_SUM, compression_codec=pb.NONE)
        assert req.registers == labels(reg="x")
        p.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.UPDATE_ASSIGNMENTS
    assert (fsm.spool.end, fsm.spool.registers, fsm.roll_to_offset) == (892, labels(reg="x"), 0)
    fsm.abort()

    # Case: a peer's fragment ends at ours but is empty (it rolled there; it cannot extend our fragment):
    # roll to our end. (Our spool holds [892, 897) from a pipeline since gone.)
    await break_pipeline(replica)
    spool = replica.spool_slot.get_nowait()
    spool.apply(pb.ReplicateRequest(content=b"hello", content_delta=0), primary=True)
    spool.apply(pb.ReplicateRequest(proposal=spool.next_fragment().to_proto(), registers=spool.registers), True)
    replica.return_spool(spool)
    fsm = await sync_proposed()
    b.stream.respond(status=pb.PROPOSAL_MISMATCH, fragment=pb.Fragment(journal=J, begin=897, end=897, sum=EMPTY_SUM))
    c.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.SEND_PIPELINE_SYNC
    assert fsm.roll_to_offset == 897
    fsm.abort()  # (mid-sync: the pipeline is shut down, the spool goes back)
    assert replica.tokens_idle() and replica.spool_slot.full()

    # Case: a peer is behind us: an error (never a pipeline with a replica missing committed bytes).
    fsm = await sync_proposed()
    behind = pb.Fragment(journal=J, begin=0, end=500, sum=sha1(b"?"))
    b.stream.respond(status=pb.PROPOSAL_MISMATCH, fragment=behind)
    c.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.ERROR
    assert outcome(fsm) == (
        S.ERROR,
        "OK",
        "synchronizing replicas failed: peer zone-b/b is behind: its fragment ends at 500, ours at 897",
    )
    assert fsm.error_code is grpc.StatusCode.UNAVAILABLE and fsm.pipeline is None
    assert replica.tokens_idle() and replica.spool_slot.full()

    # Case: a peer knows a different route at a later revision: shut down, re-resolve at that revision.
    fsm = await sync_proposed()
    later = pb.Header()
    later.CopyFrom(fsm.pipeline.header)
    later.etcd.revision += 10
    later.route.members[1].suffix = "b2"
    b.stream.respond(status=pb.WRONG_ROUTE, header=later)
    c.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.RESOLVE
    assert (fsm.read_through_rev, fsm.status, fsm.error, fsm.pipeline) == (later.etcd.revision, pb.OK, None, None)
    fsm.abort()
    assert replica.tokens_idle()

    # Case: a peer answers WRONG_ROUTE with our own route (or no later revision): an error.
    fsm = await sync_proposed()
    b.stream.respond(status=pb.WRONG_ROUTE, header=fsm.pipeline.header)
    c.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.ERROR
    revision = fsm.resolved.header.etcd.revision
    assert fsm.error == f"synchronizing replicas failed: peer zone-b/b answered WRONG_ROUTE at revision {revision}"

    # Case: a peer answers any other status: an error.
    fsm = await sync_proposed()
    b.stream.respond(status=pb.OK)
    c.stream.respond(status=pb.NOT_JOURNAL_BROKER)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.ERROR
    assert fsm.error == "synchronizing replicas failed: peer zone-c/c answered NOT_JOURNAL_BROKER"

    # Case: a peer's stream breaks: an error the client may retry.
    fsm = await sync_proposed()
    b.stream.fail("connection reset (stub)")
    c.stream.respond(status=pb.OK)
    assert await step(fsm, S.RECV_PIPELINE_SYNC) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "synchronizing replicas failed: connection reset (stub)")
    assert fsm.error_code is grpc.StatusCode.UNAVAILABLE
    assert replica.tokens_idle()

    # Case: the replica closes while the peers have not answered: stop waiting for them.
    fsm = await sync_proposed()
    waiting = asyncio.create_task(step(fsm, S.RECV_PIPELINE_SYNC))
    await settle()
    assert not waiting.done()
    closing = asyncio.create_task(replica.aclose())
    assert await waiting is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "the journal's replica closed while synchronizing")
    for p in (b, c):
        p.stream.fail()  # (the close ends the streams the shut-down pipeline still reads)
    await closing


# -- UPDATE_ASSIGNMENTS ------------------------------------------------------------------------------


async def test_update_assignments(broker):
    """UPDATE_ASSIGNMENTS: once its pipeline is synchronized, the primary advertises the route in every
    assignment, guarded by their revisions: only then may the allocator count the journal's replicas
    consistent (invariant 5)."""
    peer = await broker.add_peer("zone-b", "peer")
    await broker.create_journal(J, [broker, peer])
    resolver = broker.resolver

    # Case: the assignments do not advertise the route: write it into each, and re-resolve there.
    fsm = broker.fsm()
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    assert not resolver.state.is_consistent(J)
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.RESOLVE
    assert fsm.read_through_rev == broker.etcd.revision
    assert broker.assignment_values(J) == [fsm.resolved.route] * 2
    assert resolver.state.is_consistent(J)

    # Case: resolved there, the assignments advertise the route: nothing to write.
    assert await step(fsm, S.RESOLVE) is S.START_PIPELINE
    assert await step(fsm, S.START_PIPELINE) is S.UPDATE_ASSIGNMENTS
    txns = len(broker.etcd.txns)
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.AWAIT_DESIRED_REPLICAS
    assert len(broker.etcd.txns) == txns
    fsm.abort()

    # Case: an assignment changed in etcd after our view of it: nothing is written; re-resolve past our
    # revision.
    await broker.set_members(J, [broker, peer])  # (the allocator rewrote them: the route is not advertised)
    fsm = broker.fsm()
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    async with broker.etcd.withheld():
        await broker.set_members(J, [broker, peer])
        seen = broker.keyspace.revision
        assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.RESOLVE
        assert fsm.read_through_rev == seen + 1
        assert broker.assignment_values(J) == [pb.Route()] * 2
    fsm.abort()

    # Case: our resolution is stale, and our KeySpace already knows it: since we resolved, the primary moved
    # to the peer, which synchronized and advertised its own route. The write is guarded by the assignments
    # we resolved (Gazette's updateAssignments), so nothing is written over the newer primary's values; we
    # re-resolve at the revision etcd answered (nothing to wait for), where we are not primary.
    await broker.set_members(J, [broker, peer])
    fsm = broker.fsm()
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    await broker.set_members(J, [peer, broker], consistent=True)
    newer = broker.assignment_values(J)
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.RESOLVE
    assert broker.assignment_values(J) == newer and resolver.state.is_consistent(J)
    assert fsm.read_through_rev == broker.keyspace.revision
    assert await step(fsm, S.RESOLVE) is S.AWAIT_DESIRED_REPLICAS
    assert not fsm.resolved.is_primary and not fsm.owns_pipeline
    await broker.set_members(J, [broker, peer])

    # Case: etcd fails: an error the client may retry.
    fsm = broker.fsm()
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    broker.etcd.fail_next_txn()
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.ERROR
    assert outcome(fsm) == (
        S.ERROR,
        "OK",
        "advertising the synchronized route in etcd failed: etcd is unreachable (stub)",
    )
    assert fsm.error_code is grpc.StatusCode.UNAVAILABLE

    # Case: the append is cancelled while its write is in flight: nothing is written, and the synchronized
    # pipeline goes back as it is.
    fsm = broker.fsm()
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    pipeline, writes = fsm.pipeline, broker.etcd.revision
    hold = broker.etcd.hold_txn()
    writing = asyncio.create_task(fsm.run_to(S.AWAIT_DESIRED_REPLICAS))
    await hold.reached()
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert broker.etcd.revision == writes and broker.replica(J).tokens_idle()
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    assert fsm.pipeline is pipeline and pipeline.usable
    fsm.abort()

    # Case: a member joined after we resolved (the allocator rewrote the assignments): our guarded write of
    # the route we synchronized does not apply, and the journal does not read as consistent until its
    # pipeline includes the new member.
    third = await broker.add_peer("zone-c", "third")
    fsm = broker.fsm()
    await fsm.run_to(S.UPDATE_ASSIGNMENTS)
    await broker.set_members(J, [broker, peer, third])
    assert await step(fsm, S.UPDATE_ASSIGNMENTS) is S.RESOLVE
    assert not resolver.state.is_consistent(J)
    assert await fsm.run_to(S.AWAIT_DESIRED_REPLICAS) is S.AWAIT_DESIRED_REPLICAS  # (re-synchronized with all three)
    assert len(third.streams) == 1 and resolver.state.is_consistent(J)
    fsm.abort()


# -- AWAIT_DESIRED_REPLICAS ------------------------------------------------------------------------


async def test_await_desired_replicas(broker):
    """AWAIT_DESIRED_REPLICAS: a primary appends only with exactly the desired replicas: never with fewer
    (invariant 1), nor while the allocator is about to remove one; other brokers proxy to the primary."""
    peer = await broker.add_peer("zone-b", "peer")
    await broker.create_journal(J, [broker])
    await broker.create_journal("remote/journal", [peer, broker])
    await broker.create_journal("too/many", [broker, peer], replication=1)
    await broker.create_journal("too/few", [broker, peer], replication=3)
    await broker.create_journal("no/primary", [broker, peer], primary=False)
    await broker.create_journal("no/replicas", [], replication=2)

    # Case: we are primary, with the desired replicas.
    fsm = broker.fsm(J)
    await fsm.run_to(S.AWAIT_DESIRED_REPLICAS)
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.VALIDATE_PRECONDITIONS
    fsm.abort()

    # Case: another broker is primary: proxy the append to it.
    fsm = broker.fsm("remote/journal")
    await fsm.run_to(S.AWAIT_DESIRED_REPLICAS)
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.PROXY
    assert outcome(fsm) == (S.PROXY, "OK", None)
    assert fsm.resolved.primary_endpoint() == "stub:zone-b/peer"

    # Case: more replicas than desired (the allocator is about to remove one): read through the next revision...
    fsm = broker.fsm("too/many")
    await fsm.run_to(S.AWAIT_DESIRED_REPLICAS)
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.RESOLVE
    assert fsm.read_through_rev == fsm.resolved.header.etcd.revision + 1
    # ... which resolves the route without it once the allocator removed it.
    resolving = asyncio.create_task(step(fsm, S.RESOLVE))
    await settle()
    assert not resolving.done()
    await broker.set_members("too/many", [broker])
    assert await resolving is S.START_PIPELINE
    assert len(fsm.resolved.route.members) == 1
    fsm.abort()

    # Case: fewer replicas than desired.
    fsm = broker.fsm("too/few")
    await fsm.run_to(S.AWAIT_DESIRED_REPLICAS)
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "INSUFFICIENT_JOURNAL_BROKERS", None)

    # Case: the desired replicas, but none is primary.
    fsm = broker.fsm("no/primary")
    assert await fsm.run_to(S.AWAIT_DESIRED_REPLICAS) is S.AWAIT_DESIRED_REPLICAS
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "NO_JOURNAL_PRIMARY_BROKER", None)

    # Case: no replicas at all.
    fsm = broker.fsm("no/replicas")
    assert await fsm.run_to(S.AWAIT_DESIRED_REPLICAS) is S.AWAIT_DESIRED_REPLICAS
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "NO_JOURNAL_PRIMARY_BROKER", None)


# -- VALIDATE_PRECONDITIONS ------------------------------------------------------------------------


async def test_validate_preconditions_offsets(broker):
    """VALIDATE_PRECONDITIONS, offsets: appends land at the journal's furthest known extent. An index
    that knows an offset beyond the synchronized write head means consistency was lost: refuse
    (INDEX_HAS_GREATER_OFFSET) until an operator names the offset (invariant 6); an append naming an
    offset lands exactly there or not at all (invariant 2)."""
    peer = await broker.add_peer("zone-b", "peer")
    await broker.create_journal(J, [broker])
    await broker.create_journal("fresh/journal", [broker, peer])
    replica = broker.replica(J)

    # Case: the spool and the index agree (both empty).
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert (fsm.status, fsm.error, fsm.roll_to_offset) == (pb.OK, None, 0)
    fsm.abort()

    # Case: the store holds fragments past the spool, and the request names no offset: refuse to guess.
    stored = Fragment(J, 0, 456, sha1(b"?"), backing_store="file:///elsewhere/", mod_time=int(time.time()))
    replica.index.replace_remote([stored])
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm) == (
        S.ERROR,
        "INDEX_HAS_GREATER_OFFSET",
        "the fragment index ends at 456, past the synchronized write head 0",
    )

    # Case: the same, but the journal is read-only: a zero-byte transaction barrier goes through.
    writable = broker.spec(J).flags
    await broker.edit_spec(J, lambda spec: setattr(spec, "flags", pb.JournalSpec.O_RDONLY))
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()
    await broker.edit_spec(J, lambda spec: setattr(spec, "flags", writable))

    # Case: the request names another offset than the journal's furthest extent.
    fsm = broker.fsm(offset=455)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "WRONG_APPEND_OFFSET", "the write head is 456, not 455")

    # Case: the request names the index's end (an operator's reset-head): re-synchronize the pipeline there...
    fsm = broker.fsm(offset=456)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.SEND_PIPELINE_SYNC
    assert fsm.roll_to_offset == 456
    # ... where the append then lands.
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT
    assert await commit(fsm, b"abc") is S.FINISHED
    assert (fsm.commit.begin, fsm.commit.end) == (456, 459)

    # Case: the request names the write head: go on.
    fsm = broker.fsm(offset=459)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()

    # Case: an offset of 0 set explicitly asks for an empty journal (a lone writer's attempt at head 0),
    # where an unset one means "any".
    fsm = broker.fsm(offset=0)
    assert fsm.req.HasField("offset")
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "WRONG_APPEND_OFFSET", "the write head is 459, not 0")

    # Case: the spool holds the journal's first known write: the append rolls it first, so it is persisted
    # promptly (a broker recovering later then finds the index dirty rather than a journal that looks new).
    await append(broker, "fresh/journal", b"first")
    fsm = broker.fsm("fresh/journal")
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert fsm.roll_to_offset == 5
    assert await commit(fsm, b"next") is S.FINISHED
    roll, content = peer.stream.sent[-2:]
    assert roll.proposal == pb.Fragment(
        journal="fresh/journal", begin=5, end=5, sum=EMPTY_SUM, compression_codec=pb.NONE
    )
    assert not roll.acknowledge and content.content == b"next"
    assert held(peer.spool("fresh/journal")) == (5, 9, b"next")


async def test_validate_preconditions_registers(broker):
    """VALIDATE_PRECONDITIONS, registers: an append conditioned on the journal's registers commits only if
    they match (a journal without registers matches any condition, as in Gazette)."""
    await broker.create_journal(J, [broker])
    not_matched = pb.LabelSelector(include=labels(some="other"))

    # Case: the journal has no registers: any condition holds.
    fsm = broker.fsm(check_registers=not_matched)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()
    fsm = await append(broker, J, b"x", union_registers=labels(some="register"))
    assert fsm.registers == labels(some="register")

    # Case: the journal's registers do not match.
    fsm = broker.fsm(check_registers=not_matched)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert fsm.registers == labels(some="register")  # (taken from the pipeline's spool)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "REGISTER_MISMATCH", None)

    # Case: they match.
    fsm = broker.fsm(check_registers=pb.LabelSelector(exclude=labels(other="")))
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()


async def test_validate_preconditions_fragment_store(broker, tmp_path):
    """VALIDATE_PRECONDITIONS, stores: the primary appends only once it has listed the journal's fragment
    store, so it knows the journal's furthest extent (invariant 6); a store it cannot list refuses appends."""
    (tmp_path / "blocked").write_bytes(b"a file where the store's directory should be")
    store, blocked = f"file://{tmp_path}/store/", f"file://{tmp_path}/blocked/"
    await broker.create_journal(J, [broker], listed=False, fragment={"stores": [store]})
    await broker.create_journal("b/journal", [broker], listed=False, fragment={"stores": [blocked]})

    # Case: the first listing has not happened, and the route changes while we wait for it.
    fsm = broker.fsm(J)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    waiting = asyncio.create_task(step(fsm, S.VALIDATE_PRECONDITIONS))
    await settle()
    assert not waiting.done()
    await broker.edit_spec(J, touch)
    assert await waiting is S.RESOLVE
    fsm.abort()

    # Case: the first listing completes while we wait: go on.
    fsm = broker.fsm(J)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    waiting = asyncio.create_task(step(fsm, S.VALIDATE_PRECONDITIONS))
    await settle()
    assert not waiting.done()
    await broker.replica(J).refresh_now()
    assert await waiting is S.STREAM_CONTENT
    fsm.abort()

    # Case: the first listing failed: the store is unhealthy.
    with pytest.raises(NotADirectoryError):
        await broker.replica("b/journal").refresh_now()
    fsm = broker.fsm("b/journal")
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm)[:2] == (S.ERROR, "FRAGMENT_STORE_UNHEALTHY")
    assert fsm.error.startswith(f"listing {blocked}: NotADirectoryError")

    # Case: the spec dropped the journal's stores since that listing failed: the same status, naming the
    # store whose listing failed (never an internal error), until a listing (of no store) succeeds.
    await broker.edit_spec("b/journal", lambda spec: spec.fragment.ClearField("stores"))
    assert broker.replica("b/journal").stores == []
    fsm = broker.fsm("b/journal")
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm)[:2] == (S.ERROR, "FRAGMENT_STORE_UNHEALTHY")
    assert fsm.error.startswith(f"listing {blocked}: NotADirectoryError")
    await broker.replica("b/journal").refresh_now()
    fsm = broker.fsm("b/journal")
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()

    # Case: a listing of the journal's primary store fails after the first one succeeded (the store went
    # away): appends are refused while its latest listing failed, so nothing is accepted that cannot be
    # persisted (Gazette's FRAGMENT_STORE_UNHEALTHY for an unhealthy primary store)...
    replica = broker.replica(J)
    (tmp_path / "store").write_bytes(b"a file where the store's directory should be")
    with pytest.raises(NotADirectoryError):
        await replica.refresh_now()
    assert replica.index.first_refresh
    fsm = broker.fsm(J)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm)[:2] == (S.ERROR, "FRAGMENT_STORE_UNHEALTHY")
    assert fsm.error.startswith(f"listing {store}: NotADirectoryError")
    # ... and no longer once a listing succeeds again (the replica's refresh loop retries, with backoff):
    # a transient failure never wedges the journal.
    (tmp_path / "store").unlink()
    await replica.refresh_now()
    fsm = broker.fsm(J)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()

    # Case: after the first listing, only the primary store's health refuses appends: a failed listing of a
    # further store (read from, never persisted to) lets them go on, as in Gazette.
    further = f"file://{tmp_path}/further/"
    await broker.create_journal("c/journal", [broker], fragment={"stores": [store, further]})
    (tmp_path / "further").write_bytes(b"a file where the store's directory should be")
    with pytest.raises(NotADirectoryError):
        await broker.replica("c/journal").refresh_now()
    fsm = broker.fsm("c/journal")
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    fsm.abort()


# -- suspension: VALIDATE_PRECONDITIONS and UPDATE_SUSPEND -------------------------------------------


async def test_suspend_partially_and_resume(broker):
    """VALIDATE_PRECONDITIONS and UPDATE_SUSPEND: a journal with content suspends partially (one replica,
    its last fragment rolled so it persists); a pulse never resumes it, a client's append does, and
    suspension changes are written guarded by the spec's revision."""
    await broker.create_journal(J, [broker])
    await append(broker, J, b"hello")

    # Case: SUSPEND_NOW with content not yet persisted: suspend partially at the write head, rolling the spool.
    fsm = broker.fsm(suspend=pb.AppendRequest.SUSPEND_NOW)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    assert fsm.next_suspend == pb.JournalSpec.Suspend(level=PARTIAL, offset=5)
    assert fsm.roll_to_offset == 5

    # Case: the suspension is written into the spec; re-resolve at that revision...
    assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
    assert fsm.read_through_rev == broker.etcd.revision
    assert broker.spec(J).suspend == pb.JournalSpec.Suspend(level=PARTIAL, offset=5)
    # ... and the append commits zero bytes through the one replica, rolling the spool; answered SUSPENDED.
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT
    assert fsm.suspended
    assert await commit(fsm) is S.FINISHED
    assert fsm.pipeline.spool.fragment.begin == 5

    # Case: SUSPEND_KEEP (reset-head of a partially suspended journal): neither resume nor fail.
    fsm = broker.fsm(suspend=pb.AppendRequest.SUSPEND_KEEP, offset=5)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert (fsm.suspended, fsm.next_suspend, fsm.status) == (False, None, pb.OK)
    fsm.abort()

    # Case: SUSPEND_NO_RESUME (a pulse): the journal is suspended.
    fsm = broker.fsm(suspend=pb.AppendRequest.SUSPEND_NO_RESUME, pulse=True)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "SUSPENDED", None)

    # Case: SUSPEND_IF_FLUSHED, partially suspended already, content in the index: nothing to change.
    fsm = broker.fsm(suspend=pb.AppendRequest.SUSPEND_IF_FLUSHED)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert fsm.suspended and fsm.next_suspend is None
    fsm.abort()

    # Case: the suspension changed since our view of the spec: nothing is written; re-resolve past it.
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    async with broker.etcd.withheld():
        await broker.edit_spec(J, touch)
        seen = broker.keyspace.revision
        assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
        assert fsm.read_through_rev == seen + 1
        assert broker.spec(J).suspend.level == PARTIAL
    fsm.abort()

    # Case: etcd fails while writing the suspension: an error the client may retry.
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    broker.etcd.fail_next_txn()
    assert await step(fsm, S.UPDATE_SUSPEND) is S.ERROR
    assert outcome(fsm) == (
        S.ERROR,
        "OK",
        "updating the journal's suspension in etcd failed: etcd is unreachable (stub)",
    )

    # Case: a client's append (SUSPEND_RESUME) resumes the journal: the suspension is cleared, and it lands.
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    assert fsm.next_suspend is None
    assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
    assert not broker.spec(J).HasField("suspend")
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT
    assert await commit(fsm, b"again") is S.FINISHED
    assert (fsm.commit.begin, fsm.commit.end, fsm.suspended) == (5, 10, False)


async def test_suspend_fully_and_resume(broker):
    """VALIDATE_PRECONDITIONS, UPDATE_SUSPEND, AWAIT_DESIRED_REPLICAS: a journal that surely holds nothing
    suspends fully (no replicas); anything it may hold keeps it from that. The append that resumes it
    waits for its replicas to come back rather than failing."""
    await broker.create_journal(J, [broker])
    await broker.create_journal("idle/journal", [broker])
    await broker.create_journal("recovering/journal", [broker])

    # Case: SUSPEND_IF_FLUSHED of a journal with recovered content still being checked: not fully, and
    # (its index holding nothing persisted) not partially either.
    recovering = broker.replica("recovering/journal")
    recovering.unverified.append((Fragment("recovering/journal", 0, 3, sha1(b"abc")), None))
    fsm = broker.fsm("recovering/journal", suspend=pb.AppendRequest.SUSPEND_IF_FLUSHED)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert (fsm.next_suspend, fsm.suspended) == (None, False)
    fsm.abort()

    # Case: SUSPEND_IF_FLUSHED of a journal whose last fragment is only in the spool: not idle, nothing to do.
    await append(broker, "idle/journal", b"abc")
    fsm = broker.fsm("idle/journal", suspend=pb.AppendRequest.SUSPEND_IF_FLUSHED)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert (fsm.next_suspend, fsm.suspended) == (None, False)
    fsm.abort()

    # Case: SUSPEND_IF_FLUSHED of a journal whose last fragment was persisted longer ago than its flush
    # interval (24 hours without one): idle, suspend partially.
    persisted = Fragment(
        "idle/journal", 0, 3, sha1(b"abc"), backing_store="file:///s/", mod_time=int(time.time()) - 2 * DAY
    )
    broker.replica("idle/journal").index.replace_remote([persisted])
    fsm = broker.fsm("idle/journal", suspend=pb.AppendRequest.SUSPEND_IF_FLUSHED)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    assert fsm.next_suspend == pb.JournalSpec.Suspend(level=PARTIAL, offset=3)
    fsm.abort()

    # Case: SUSPEND_IF_FLUSHED of a journal that holds nothing: suspend it fully at its write head...
    fsm = broker.fsm(J, suspend=pb.AppendRequest.SUSPEND_IF_FLUSHED, pulse=True)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    assert fsm.next_suspend == pb.JournalSpec.Suspend(level=FULL, offset=0)
    # ... which, written, makes the journal SUSPENDED.
    assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
    assert await step(fsm, S.RESOLVE) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "SUSPENDED", None)
    assert broker.replica(J).tokens_idle()

    # Case: the allocator removed its replicas; a client's append resumes it...
    await broker.set_members(J, [])
    fsm = broker.fsm(J)
    assert await step(fsm, S.RESOLVE) is S.UPDATE_SUSPEND
    assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
    assert not broker.spec(J).HasField("suspend")
    assert await step(fsm, S.RESOLVE) is S.AWAIT_DESIRED_REPLICAS
    # ... and, with no replica yet, waits for the allocator to bring them back rather than failing.
    assert await step(fsm, S.AWAIT_DESIRED_REPLICAS) is S.RESOLVE
    assert fsm.read_through_rev == fsm.resolved.header.etcd.revision + 1
    resolving = asyncio.create_task(step(fsm, S.RESOLVE))
    await settle()
    assert not resolving.done()
    await broker.set_members(J, [broker])
    assert await resolving is S.ACQUIRE_PIPELINE
    await broker.replica(J).refresh_now()
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT
    assert await commit(fsm, b"awake") is S.FINISHED

    # Case: the journal was deleted while we meant to write its suspension: resolve again, and find it gone.
    fsm = broker.fsm(J, suspend=pb.AppendRequest.SUSPEND_NOW)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    replica = broker.replica(J)
    await broker.delete_journal(J)
    assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
    assert await step(fsm, S.RESOLVE) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "JOURNAL_NOT_FOUND", None)
    assert not fsm.owns_pipeline
    await wait_until(lambda: replica.end_at_close is not None, interval=0)  # (its close got the tokens back)


async def test_resume_offset(broker):
    """VALIDATE_PRECONDITIONS, the resume offset (`spec.suspend.offset` with no suspension, where the
    journal's last brokers stopped): a spool behind it rolls forward to it (no offset below it is handed
    out again, invariant 2); the first client append past it clears it, a pulse at exactly it does not."""
    await broker.create_journal(J, [broker], suspend={"level": "none", "offset": 1024})

    # Case: the spool is behind the resume offset: re-synchronize there.
    fsm = broker.fsm(suspend=pb.AppendRequest.SUSPEND_NO_RESUME, pulse=True)
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.SEND_PIPELINE_SYNC
    assert fsm.roll_to_offset == 1024

    # Case: a pulse at exactly the offset leaves it (brokers stopping together record it while the primary pulses).
    assert await fsm.run_to(S.VALIDATE_PRECONDITIONS) is S.VALIDATE_PRECONDITIONS
    assert fsm.spool.end == 1024
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.STREAM_CONTENT
    assert await commit(fsm) is S.FINISHED
    assert broker.spec(J).suspend == pb.JournalSpec.Suspend(level=NONE, offset=1024)

    # Case: a client's append clears it before it lands past it.
    fsm = broker.fsm()
    await fsm.run_to(S.VALIDATE_PRECONDITIONS)
    assert await step(fsm, S.VALIDATE_PRECONDITIONS) is S.UPDATE_SUSPEND
    assert fsm.next_suspend is None
    assert await step(fsm, S.UPDATE_SUSPEND) is S.RESOLVE
    assert not broker.spec(J).HasField("suspend")
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT
    assert await commit(fsm, b"abc") is S.FINISHED
    assert (fsm.commit.begin, fsm.commit.end) == (1024, 1027)


# -- STREAM_CONTENT, READ_ACKNOWLEDGEMENTS -------------------------------------------------------------


async def test_stream_content_and_read_acknowledgements(broker):
    """STREAM_CONTENT and READ_ACKNOWLEDGEMENTS: an append is acknowledged OK only once every replica
    committed it (invariant 1); any failure before its commit proposal rolls it back on every replica,
    leaving no byte (invariant 2); bad input is refused as such, and a failed peer fails the append."""
    b = await broker.add_peer("zone-b", "b")
    c = await broker.add_peer("zone-c", "c")
    await broker.create_journal(J, [broker, b, c], fragment={"length": 1024})
    await broker.create_journal("ro/journal", [broker], flags="read-only")
    ours: list[Spool] = []  # (the primary's one spool, whichever pipeline holds it)

    def replicas() -> list[tuple[int, int, bytes]]:
        return [held(s) for s in (ours[0], b.spool(J), c.spool(J))]

    # Case: content, then the commit chunk, then end-of-stream: the last chunk travels with the commit
    # proposal, one request per peer; once every peer acknowledges, the append is FINISHED.
    foo, bar = b"f" * 600, b"b" * 600
    fsm = broker.fsm(union_registers=labels(owner="a"))
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=foo))
    assert fsm.state is S.STREAM_CONTENT and b.stream.sent[-1].content == b""  # (held for the next message)
    await fsm.on_stream_content(pb.AppendRequest(content=bar))
    await fsm.on_stream_content(pb.AppendRequest())
    await fsm.on_stream_content(None)
    assert fsm.state is S.READ_ACKNOWLEDGEMENTS and not fsm.owns_pipeline
    last = b.stream.sent[-1]
    assert (last.content, last.content_delta, last.acknowledge) == (bar, 600, True)
    assert last.proposal == pb.Fragment(journal=J, begin=0, end=1200, sum=sha1(foo + bar), compression_codec=pb.NONE)
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.FINISHED
    ours.append(fsm.pipeline.spool)
    assert fsm.commit == pb.Fragment(journal=J, begin=0, end=1200, sum=sha1(foo + bar), compression_codec=pb.NONE)
    assert fsm.registers == labels(owner="a") == b.spool(J).registers == c.spool(J).registers
    assert replicas() == [(0, 1200, foo + bar)] * 3

    # Case: the fragment is past its target length: the next append rolls it first (no acknowledgement asked).
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    assert await commit(fsm, b"baz") is S.FINISHED
    roll = b.stream.sent[-2]
    assert roll.proposal.begin == roll.proposal.end == 1200 and not roll.acknowledge
    assert replicas() == [(1200, 1203, b"baz")] * 3

    # Case: the client's stream fails: roll back everywhere; the client sees ABORTED.
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"lost"))
    await fsm.on_stream_content(pb.AppendRequest(content=b"more"))
    await fsm.on_stream_content(ConnectionResetError("the client went away"))
    assert fsm.state is S.READ_ACKNOWLEDGEMENTS
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "the client went away")
    assert fsm.error_code is grpc.StatusCode.ABORTED
    assert replicas() == [(1200, 1203, b"baz")] * 3 and b.spool(J).delta == c.spool(J).delta == 0

    # Case: the client ends its stream without the commit chunk: roll back.
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"lost"))
    await fsm.on_stream_content(None)
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "client closed the stream without committing")

    # Case: content after the commit chunk: roll back; the client sent bad input.
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"lost"))
    await fsm.on_stream_content(pb.AppendRequest())
    await fsm.on_stream_content(pb.AppendRequest(content=b"late"))
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "content after the commit chunk")
    assert fsm.error_code is grpc.StatusCode.INVALID_ARGUMENT

    # Case: a register change without a byte to carry it: roll back; bad input.
    fsm = broker.fsm(union_registers=labels(owner="b"))
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest())
    await fsm.on_stream_content(None)
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "a register change needs at least one appended byte")
    assert fsm.error_code is grpc.StatusCode.INVALID_ARGUMENT

    # Case: an append that controls suspension carries content: roll back; bad input.
    fsm = broker.fsm(suspend=pb.AppendRequest.SUSPEND_KEEP)
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"data"))
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert isinstance(fsm.client_error, ValidationError)
    assert fsm.error_code is grpc.StatusCode.INVALID_ARGUMENT and fsm.status == pb.OK

    # Case: content to a read-only journal: NOT_ALLOWED (a status, not an error).
    fsm = broker.fsm("ro/journal")
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"data"))
    assert fsm.state is S.READ_ACKNOWLEDGEMENTS
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "NOT_ALLOWED", None)
    assert replicas() == [(1200, 1203, b"baz")] * 3

    # Case: a peer's stream breaks while content streams: roll back at once (never a commit on a subset of
    # the replicas); the broken pipeline is shut down and the next append builds a new one.
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"lost"))
    c.stream.fail("connection reset (stub)")
    await fsm.on_stream_content(pb.AppendRequest(content=b"more"))
    assert fsm.state is S.READ_ACKNOWLEDGEMENTS
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "replication failed: connection reset (stub)")
    assert (held(b.spool(J)), held(c.spool(J))) == ((1200, 1203, b"baz"), (1200, 1203, b"baz"))
    assert broker.replica(J).tokens_idle() and broker.replica(J).spool_slot.full()
    fsm = broker.fsm()
    await fsm.run_to(S.START_PIPELINE)
    assert await step(fsm, S.START_PIPELINE) is S.SEND_PIPELINE_SYNC
    assert await fsm.run_to(S.STREAM_CONTENT) is S.STREAM_CONTENT
    assert await commit(fsm, b"qux") is S.FINISHED
    assert replicas() == [(1200, 1206, b"bazqux")] * 3

    # Case: a peer refuses the commit proposal: the append fails (its outcome is uncertain: retry it).
    c.auto = False
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"odd"))
    await fsm.on_stream_content(pb.AppendRequest())
    await fsm.on_stream_content(None)
    await c.stream.request()
    c.stream.respond(status=pb.PROPOSAL_MISMATCH, fragment=pb.Fragment(journal=J, begin=1200, end=1206, sum=sha1(b"?")))
    assert await step(fsm, S.READ_ACKNOWLEDGEMENTS) is S.ERROR
    assert outcome(fsm) == (S.ERROR, "OK", "replication failed: peer zone-c/c refused a proposal: PROPOSAL_MISMATCH")
    assert fsm.error_code is grpc.StatusCode.UNAVAILABLE and fsm.commit is None


# -- interleavings ---------------------------------------------------------------------------------


async def test_append_waiting_for_the_pipeline_lands_after_the_streaming_one(broker):
    """Two Append RPCs at once (`AppendFSM.run`, as append_api drives it): the second waits for the pipeline
    while the first streams, then lands right after it; no offset goes to both (invariant 2), and every
    replica holds both (invariant 1)."""
    b = await broker.add_peer("zone-b", "b")
    c = await broker.add_peer("zone-c", "c")
    await broker.create_journal(J, [broker, b, c])
    seq = Sequencer()

    async def first_client() -> AsyncIterator[pb.AppendRequest | None]:
        yield pb.AppendRequest(content=b"aaa")
        async with seq(1):  # (the second append is waiting for the pipeline by now)
            yield pb.AppendRequest(content=b"AAA")
        yield pb.AppendRequest()
        yield None

    async def second_client() -> AsyncIterator[pb.AppendRequest | None]:
        yield pb.AppendRequest(content=b"bbb")
        yield pb.AppendRequest()
        yield None

    first, second = broker.fsm(), broker.fsm()
    first_done = asyncio.create_task(first.run(first_client().__anext__))
    async with seq(0):
        await wait_for_state(first, S.STREAM_CONTENT)
        second_done = asyncio.create_task(second.run(second_client().__anext__))
        await wait_for_state(second, S.ACQUIRE_PIPELINE)
    assert await first_done is S.FINISHED
    assert await second_done is S.FINISHED
    assert (first.commit.begin, first.commit.end) == (0, 6)
    assert (second.commit.begin, second.commit.end) == (6, 9)
    # (the second rolled the journal's first write, [0, 6), out of the spools before its own)
    assert held(b.spool(J)) == held(c.spool(J)) == held(second.pipeline.spool) == (6, 9, b"bbb")


async def test_next_append_streams_while_acknowledgements_are_pending(broker):
    """Full duplex: an append hands the pipeline on once its commit proposal is out, and the next one
    streams and commits before the first is acknowledged; acknowledgements are read in order, so neither
    is told OK before every replica holds it (invariant 1), and their spans are disjoint (invariant 2)."""
    b = await broker.add_peer("zone-b", "b")
    await broker.create_journal(J, [broker, b])
    first = broker.fsm()
    await first.run_to(S.STREAM_CONTENT)
    second = broker.fsm()
    acquiring = asyncio.create_task(second.run_to(S.STREAM_CONTENT))
    await wait_for_state(second, S.ACQUIRE_PIPELINE)

    b.auto = False  # (from here the test answers for the peer, when it chooses)
    await first.on_stream_content(pb.AppendRequest(content=b"one"))
    await first.on_stream_content(pb.AppendRequest())
    await first.on_stream_content(None)
    assert await acquiring is S.STREAM_CONTENT
    assert second.spool.end == 3  # (the primary's spool applied the first commit already)
    await second.on_stream_content(pb.AppendRequest(content=b"two"))
    await second.on_stream_content(pb.AppendRequest())
    await second.on_stream_content(None)

    reading_first = asyncio.create_task(first.run_to())
    reading_second = asyncio.create_task(second.run_to())
    await settle()
    assert not reading_first.done() and not reading_second.done()
    b.stream.answer(await b.stream.request())  # the first commit
    assert await reading_first is S.FINISHED
    await settle()
    assert not reading_second.done()
    while b.stream.pending():  # the second append's roll (the journal's first write, see above) and commit
        b.stream.answer(await b.stream.request())
    assert await reading_second is S.FINISHED
    assert [(f.commit.begin, f.commit.end) for f in (first, second)] == [(0, 3), (3, 6)]
    assert held(b.spool(J)) == held(second.spool) == (3, 6, b"two")


async def test_cancelled_append_leaves_no_byte(broker):
    """An append cancelled (its client gone) after some content went to the peers is rolled back on every
    replica from a task of the replica's, keeping the pipeline; the next append lands where it began
    (invariant 2)."""
    b = await broker.add_peer("zone-b", "b")
    await broker.create_journal(J, [broker, b])
    replica = broker.replica(J)
    await append(broker, J, b"kept")
    gone = asyncio.Event()

    async def client() -> AsyncIterator[pb.AppendRequest | None]:
        yield pb.AppendRequest(content=b"lost")
        yield pb.AppendRequest(content=b"more")  # (forwards "lost" to the peers)
        await gone.wait()
        yield None

    fsm = broker.fsm()
    running = asyncio.create_task(fsm.run(client().__anext__))
    await wait_for_state(fsm, S.STREAM_CONTENT)
    await wait_until(lambda: b.spool(J).delta == 4, interval=0)  # ("lost" reached the peer)
    pipeline = fsm.pipeline
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert not fsm.owns_pipeline

    nxt = await append(broker, J, b"next")
    assert nxt.pipeline is pipeline  # (kept: the roll-back went through it)
    assert (nxt.commit.begin, nxt.commit.end) == (4, 8)
    assert held(b.spool(J)) == held(pipeline.spool) == (4, 8, b"next")
    assert replica.tokens_idle()


async def test_append_cancelled_after_its_commit_went_out_is_everywhere_or_nowhere(broker):
    """An append cancelled while its commit proposal drains to the peers: the proposal was written to every
    peer at once, so it commits on all replicas or none, never on a subset (invariants 1 and 2); the next
    append lands after it."""
    b = await broker.add_peer("zone-b", "b")
    c = await broker.add_peer("zone-c", "c")
    await broker.create_journal(J, [broker, b, c])
    hold = Hold()
    commits, appended, rollbacks = counted("commits"), counted("appended_bytes"), counted("rollbacks")

    async def client() -> AsyncIterator[pb.AppendRequest | None]:
        yield pb.AppendRequest(content=b"abc")
        yield pb.AppendRequest()
        b.stream.drain_hold = hold  # (the commit proposal's drain stops here)
        yield None

    fsm = broker.fsm()
    running = asyncio.create_task(fsm.run(client().__anext__))
    await hold.reached()
    pipeline = fsm.pipeline
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    replica = broker.replica(J)
    await wait_until(replica.tokens_idle, interval=0)
    assert held(b.spool(J)) == held(c.spool(J)) == held(pipeline.spool) == (0, 3, b"abc")

    # Case: it is counted as what it was: a commit once every peer acknowledged it, never a roll-back
    # (tidings_commits_total, tidings_rollbacks_total).
    await wait_until(lambda: counted("commits") == commits + 1, interval=0)
    assert counted("appended_bytes") == appended + 3

    nxt = await append(broker, J, b"def")
    assert (nxt.commit.begin, nxt.commit.end) == (3, 6)
    assert held(b.spool(J)) == held(c.spool(J)) == held(nxt.pipeline.spool) == (3, 6, b"def")
    assert (counted("commits"), counted("rollbacks")) == (commits + 2, rollbacks)

    # Case: an append cancelled later, while it waits for its acknowledgements, is counted a commit too once
    # they come (every peer holds it).
    b.auto = False
    fsm = broker.fsm()
    await fsm.run_to(S.STREAM_CONTENT)
    await fsm.on_stream_content(pb.AppendRequest(content=b"ghi"))
    await fsm.on_stream_content(pb.AppendRequest())
    await fsm.on_stream_content(None)
    reading = asyncio.create_task(fsm.run_to())
    await settle()
    assert not reading.done()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    while b.stream.pending():
        b.stream.answer(await b.stream.request())
    await wait_until(lambda: counted("commits") == commits + 3, interval=0)
    assert held(b.spool(J)) == held(c.spool(J)) == (3, 9, b"defghi")
    assert counted("rollbacks") == rollbacks


async def test_append_cancelled_while_synchronizing_leaves_a_pipeline_to_rebuild(broker):
    """An append cancelled while the pipeline synchronizes (its state uncertain) shuts the pipeline down and
    gives back both tokens at once; the next append builds a new pipeline (STYLE.md, *Ownership tokens*)."""
    b = await broker.add_peer("zone-b", "b", auto=False)
    await broker.create_journal(J, [broker, b])
    replica = broker.replica(J)

    fsm = broker.fsm()
    running = asyncio.create_task(fsm.run_to(S.STREAM_CONTENT))
    await wait_for_state(fsm, S.RECV_PIPELINE_SYNC)
    assert (await b.stream.request()).HasField("header")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert replica.tokens_idle() and replica.spool_slot.full()
    b.stream.respond(status=pb.OK)  # (a late answer, read by the shut-down pipeline)

    b.auto = True
    nxt = await append(broker, J, b"fresh")
    assert len(b.streams) == 2
    await wait_until(lambda: b.streams[0].closed, interval=0)
    assert (nxt.commit.begin, nxt.commit.end) == (0, 5)
