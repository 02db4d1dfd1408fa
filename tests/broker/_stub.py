"""A stub broker for driving the AppendFSM one state at a time (STYLE.md, *Tests*; Gazette's
`broker/teststub` and `append_fsm_test.go`), and helpers that force an interleaving.

`StubBroker` is what `AppendFSM` touches of a broker (`broker.host.Host`), with the real parts kept where
they are cheap:

- `etcd`: a `StubEtcd`, an in-memory etcd (revisions, `txn` with compares) whose writes reach the
  broker's KeySpace at once, or only when the test says so (`withheld()`, `deliver()`); a txn can be
  made to fail (`fail_next_txn`) or to stop until released (`hold_txn`).
- `keyspace` and `resolver`: the real `KeySpace` and `Resolver` over it, so routes, statuses,
  read-through and replica updates are the broker's own.
- replicas: real `Replica` objects without daemons (`QuietReplica`): no store listings, no recovery,
  no pulse. The test lists the stores (`create_journal(listed=True)` applies an empty first
  listing; `replica.index.replace_remote([...])`; `refresh_now()` of a store made unusable).
- `open_streams(route)`: a `StubStream` to each peer (a `transport.ReplicaStream`). A peer made with
  `auto=True` answers as a real replica does, through its own real Spool per journal; otherwise each
  request waits for the test (`await stream.request()`, then `stream.respond(...)` or `stream.fail()`).

Nothing here sleeps: waits are on events, with timeouts so a broken test fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_until
from tidings.allocator import keys
from tidings.broker.append_fsm import AppendFSM, AppendState
from tidings.broker.host import BrokerConfig
from tidings.broker.replica import Replica
from tidings.broker.resolver import Resolver
from tidings.broker.transport import FailedStream, ReplicaStream, StreamError
from tidings.fragment.spool import Spool
from tidings.keyspace import KV, Compare, KeySpace, RequestOp, decoder, delete_op, put_op
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import TransportError, ValidationError

ROOT = "/stub"
TIMEOUT = 5.0  # seconds any wait of a test may take before it fails

MemberId = tuple[str, str]


# -- interleaving ------------------------------------------------------------------------------


class Hold:
    """A point where a stub stops until the test lets it go (one use).

    The stub calls `await hold.wait()`; the test awaits `hold.reached()` (something stopped there),
    does what must happen meanwhile, then calls `release()`.
    """

    def __init__(self) -> None:
        self._reached = asyncio.Event()
        self._released = asyncio.Event()

    async def wait(self) -> None:
        self._reached.set()
        await self._released.wait()

    async def reached(self, timeout: float = TIMEOUT) -> None:
        async with asyncio.timeout(timeout):
            await self._reached.wait()

    def release(self) -> None:
        self._released.set()


class Sequencer:
    """Force an order on code in several tasks (trio.testing.Sequencer): ``async with seq(n):`` enters
    once every block of a lower position has exited. Each position is used once."""

    def __init__(self, timeout: float = TIMEOUT) -> None:
        self._exited: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self._used: set[int] = set()
        self._timeout = timeout

    @contextlib.asynccontextmanager
    async def __call__(self, position: int) -> AsyncIterator[None]:
        if position in self._used:
            raise RuntimeError(f"sequence position {position} was already used")
        self._used.add(position)
        if position > 0:
            async with asyncio.timeout(self._timeout):
                await self._exited[position - 1].wait()
        try:
            yield
        finally:
            self._exited[position].set()


async def settle(times: int = 20) -> None:
    """Let every other ready task run a few steps (to show that one stays blocked; never a timed sleep)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def wait_for_state(fsm: AppendFSM, state: AppendState, timeout: float = TIMEOUT) -> None:
    """Wait until an FSM driven by another task is in `state`. Handlers run synchronously from the
    assignment of a state to their first real suspension, so once this returns that task is blocked
    inside the state's handler (or done with it only if it never had to wait)."""
    await wait_until(lambda: fsm.state is state, timeout, interval=0)


# -- etcd --------------------------------------------------------------------------------------

_COMPARE_RESULT = {
    Compare.CompareResult.EQUAL: operator.eq,
    Compare.CompareResult.NOT_EQUAL: operator.ne,
    Compare.CompareResult.GREATER: operator.gt,
    Compare.CompareResult.LESS: operator.lt,
}


class StubEtcd:
    """An in-memory etcd: what `KeySpace.load`, the KeySpace's probe and the FSM's transactions call.

    Every write makes one revision. Each attached KeySpace sees it at once (its watch delivering),
    unless delivery is `withheld()`; `deliver()` then brings them up to date. `txns` records every
    transaction asked for.
    """

    def __init__(self) -> None:
        self.revision = 1
        self.kvs: dict[str, KV] = {}
        self.txns: list[tuple[list[Compare], list[RequestOp]]] = []
        self._keyspaces: list[KeySpace] = []
        self._withheld = False
        self._fail_next: Exception | None = None
        self._hold: Hold | None = None

    def attach(self, keyspace: KeySpace) -> None:
        self._keyspaces.append(keyspace)

    async def deliver(self) -> None:
        """Bring every attached KeySpace to the current revision (as its watch would)."""
        for ks in self._keyspaces:
            if ks.revision < self.revision:
                await ks.load(self)  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def withheld(self) -> AsyncIterator[None]:
        """Writes inside the block are not delivered to the KeySpaces until the block exits."""
        self._withheld = True
        try:
            yield
        finally:
            self._withheld = False
            await self.deliver()

    def fail_next_txn(self, exc: Exception | None = None) -> None:
        self._fail_next = exc or TransportError("etcd is unreachable (stub)", retriable=True, unreachable=True)

    def hold_txn(self) -> Hold:
        """The next transaction stops (before it applies) until the returned Hold is released."""
        self._hold = Hold()
        return self._hold

    # -- reads (Etcd's signatures) -------------------------------------------------------------

    async def get_prefix(self, prefix: str, timeout: float = 0) -> tuple[list[KV], int]:
        return [kv for k, kv in sorted(self.kvs.items()) if k.startswith(prefix)], self.revision

    async def prefix_summary(self, prefix: str) -> tuple[int, int, int]:
        kvs = [kv for k, kv in self.kvs.items() if k.startswith(prefix)]
        return len(kvs), max((kv.mod_revision for kv in kvs), default=0), self.revision

    # -- writes --------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes) -> int:
        ok, revision = await self.txn([], [put_op(key, value)])
        assert ok
        return revision

    async def delete(self, key: str) -> int:
        ok, revision = await self.txn([], [delete_op(key)])
        assert ok
        return revision

    async def txn(
        self, compares: Iterable[Compare], success: Iterable[RequestOp], failure: Iterable[RequestOp] = (), **_: Any
    ) -> tuple[bool, int]:
        compares, success = list(compares), list(success)
        self.txns.append((compares, success))
        await asyncio.sleep(0)  # (a round trip: other tasks run meanwhile, as with a real etcd)
        if self._hold is not None:
            hold, self._hold = self._hold, None
            await hold.wait()
        if self._fail_next is not None:
            exc, self._fail_next = self._fail_next, None
            raise exc
        ok = all(self._holds(c) for c in compares)
        ops = success if ok else list(failure)
        if ops:
            self.revision += 1
            for op in ops:
                self._apply(op)
            if not self._withheld:
                await self.deliver()
        return ok, self.revision

    def _holds(self, c: Compare) -> bool:
        kv = self.kvs.get(c.key.decode())
        target = c.target
        if target == Compare.CompareTarget.MOD:
            have, want = (kv.mod_revision if kv else 0), c.mod_revision
        elif target == Compare.CompareTarget.CREATE:
            have, want = (kv.create_revision if kv else 0), c.create_revision
        elif target == Compare.CompareTarget.VALUE:
            if kv is None:
                return False
            have, want = kv.value, c.value
        else:
            raise NotImplementedError(f"stub etcd compares no {Compare.CompareTarget.Name(target)}")
        return _COMPARE_RESULT[c.result](have, want)

    def _apply(self, op: RequestOp) -> None:
        if op.HasField("request_put"):
            put = op.request_put
            key = put.key.decode()
            old = self.kvs.get(key)
            if put.ignore_lease and old is None:
                raise TransportError(f"etcd: ignore_lease put of missing key {key} (stub)")
            lease = old.lease if put.ignore_lease and old is not None else put.lease
            created = old.create_revision if old is not None else self.revision
            self.kvs[key] = KV(key, bytes(put.value), created, self.revision, lease)
        elif op.HasField("request_delete_range"):
            assert not op.request_delete_range.range_end, "the stub deletes single keys"
            self.kvs.pop(op.request_delete_range.key.decode(), None)
        else:
            raise NotImplementedError(f"stub etcd applies no {op}")


# -- replicas ----------------------------------------------------------------------------------


class RecordingPersister:
    """Stands in for the broker's Persister: records what replicas submit."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, str]] = []

    def submit(self, fragment: Any, file: Any, store: str, delay: float = 0.0) -> None:
        self.submitted.append((fragment, store))


class QuietReplica(Replica):
    """A real Replica (its slots, spool, index, tasks, `update` and `aclose`) that runs no daemons:
    starting only puts its spool in its slot, as recovering an empty data dir would. Store listings
    are the test's to make (`refresh_now()`, `index.replace_remote`)."""

    def start(self, pulse: Callable[[Replica], Coroutine[Any, Any, None]], after: Any = None) -> None:
        if after is None:
            self._release_spool()
        else:  # the journal's previous replica here is still closing (same spool directory): after it
            self.spawn(self._release_after(after), f"start:{self.journal}")

    async def _release_after(self, previous: asyncio.Future) -> None:
        await asyncio.wait([previous])
        self._release_spool()


# -- peers -------------------------------------------------------------------------------------


class StubStream:
    """The primary's end of one replication stream to a `StubPeer` (a `transport.ReplicaStream`).

    `sent` holds every request in order. A manual peer's requests also queue for `request()`, and
    its answers are what the test `respond()`s; an auto peer answers as `replicate_api` does. Ending
    the send side (`close_send`) makes the peer roll back and end its side; `fail()` breaks the stream
    (every later send and receive raises StreamError).
    """

    def __init__(self, peer: StubPeer, endpoint: str) -> None:
        self.peer = peer
        self.endpoint = endpoint
        self.sent: list[pb.ReplicateRequest] = []
        self.closed = False
        self.aborted = False
        self.broken: str | None = None
        self._requests: asyncio.Queue[pb.ReplicateRequest] = asyncio.Queue()
        self._answers: asyncio.Queue[pb.ReplicateResponse | StreamError | None] = asyncio.Queue()
        self._journal = ""
        self._header_sent = False
        self.drain_hold: Hold | None = None  # the next drain() stops here until released

    # -- the primary's side (transport.ReplicaStream) ------------------------------------------

    def send(self, message: bytes) -> None:
        if self.broken is not None or self.aborted:
            raise StreamError(self.broken or "the stream was aborted")
        req = pb.ReplicateRequest.FromString(message)
        if req.HasField("proposal") and not self._journal:
            self._journal = req.proposal.journal
        self.sent.append(req)
        if self.peer.auto:
            self.answer(req)
        else:
            self._requests.put_nowait(req)

    async def drain(self) -> None:
        if self.drain_hold is not None:
            hold, self.drain_hold = self.drain_hold, None
            await hold.wait()
        if self.broken is not None:
            raise StreamError(self.broken)

    async def recv(self) -> pb.ReplicateResponse | None:
        item = await self._answers.get()
        if isinstance(item, StreamError):
            self._answers.put_nowait(item)  # a broken stream stays broken
            raise item
        return item

    def close_send(self) -> None:
        if not self.closed:
            self.closed = True
            self._end()
            self._answers.put_nowait(None)

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self._end()
            self._answers.put_nowait(StreamError("the stream was aborted"))

    def _end(self) -> None:
        if self._journal:
            self.peer.spool(self._journal).rollback()  # a real peer rolls back what is uncommitted

    def answer(self, req: pb.ReplicateRequest) -> None:
        """Apply `req` to the peer's Spool and answer it as `replicate_api` does (what an auto peer does
        with every request; a manual peer's test may do it at the moment it chooses)."""
        spool = self.peer.spool(self._journal)
        try:
            resp = spool.apply(req)
        except ValidationError as exc:
            self.fail(f"peer {self.endpoint}: {exc}")
            return
        if req.acknowledge:
            self.respond(resp)
        elif resp.status != pb.OK:
            self.fail(f"peer {self.endpoint}: an unacknowledged proposal answers {pb.Status.Name(resp.status)}")

    # -- the test's side -----------------------------------------------------------------------

    async def request(self, timeout: float = TIMEOUT) -> pb.ReplicateRequest:
        """The next request the primary sent (a manual peer's)."""
        async with asyncio.timeout(timeout):
            return await self._requests.get()

    def pending(self) -> int:
        """Requests sent and not yet taken by `request()`."""
        return self._requests.qsize()

    def respond(self, resp: pb.ReplicateResponse | None = None, **fields: Any) -> None:
        """Answer the oldest unanswered acknowledged request (the first answer carries our Header)."""
        resp = resp if resp is not None else pb.ReplicateResponse(**fields)
        if not self._header_sent:
            self._header_sent = True
            if not resp.HasField("header") and self.sent and self.sent[0].HasField("header"):
                resp.header.CopyFrom(self.sent[0].header)
        self._answers.put_nowait(resp)

    def end(self) -> None:
        """The peer ends its side of the stream cleanly (it went away)."""
        self._answers.put_nowait(None)

    def fail(self, reason: str = "connection reset (stub)") -> None:
        """The stream breaks (the peer rolls back what is uncommitted, as its stream ends)."""
        if self.broken is None:
            self.broken = reason
            self._end()
            self._answers.put_nowait(StreamError(reason))


class StubPeer:
    """Another broker: a member key in etcd, and the streams primaries open to it.

    `auto` peers answer as a real replica does, applying each request to their own Spool of the
    journal (`spool(journal)`, which the test may set up first); manual ones wait for the test.
    """

    def __init__(self, zone: str, suffix: str, directory: Path, auto: bool) -> None:
        self.member: MemberId = (zone, suffix)
        self.auto = auto
        self.streams: list[StubStream] = []
        self._directory = directory
        self._spools: dict[str, Spool] = {}

    @property
    def stream(self) -> StubStream:
        """The latest stream opened to this peer."""
        assert self.streams, f"no stream was opened to {self.member}"
        return self.streams[-1]

    def open(self, endpoint: str) -> StubStream:
        stream = StubStream(self, endpoint)
        self.streams.append(stream)
        return stream

    def spool(self, journal: str) -> Spool:
        spool = self._spools.get(journal)
        if spool is None:
            spool = self._spools[journal] = Spool(journal, self._directory / journal.replace("/", "%2F"))
        return spool

    def abort_all(self) -> None:
        for s in self.streams:
            s.abort()


# -- the broker --------------------------------------------------------------------------------


def _member_of(m: MemberId | StubPeer | StubBroker) -> MemberId:
    return m if isinstance(m, tuple) else m.member


class StubBroker:
    """What the AppendFSM touches of a Broker (see the module docstring).

    Usage::

        broker = await StubBroker(tmp_path).start()
        peer = await broker.add_peer("zone-b", "peer")
        await broker.create_journal("a/journal", [broker, peer])
        fsm = broker.fsm("a/journal")
        ...
        await broker.aclose()
    """

    def __init__(self, data_dir: Path, zone: str = "zone-a", suffix: str = "primary") -> None:
        self.data_dir = data_dir
        self.config = BrokerConfig(etcd="stub", zone=zone, suffix=suffix, data_dir=data_dir / suffix, root=ROOT)
        self.process_id = pb.ProcessId(zone=zone, suffix=suffix)
        self.member: MemberId = (zone, suffix)
        self.etcd = StubEtcd()
        self.keyspace = KeySpace(ROOT, decoder(ROOT))
        self.etcd.attach(self.keyspace)
        self.persister = RecordingPersister()
        self.resolver = Resolver(self.keyspace, self.process_id, self._new_replica, _no_pulse)
        self.peers: dict[MemberId, StubPeer] = {}
        self.opened: list[pb.Route] = []  # every route open_streams was asked for

    async def start(self) -> StubBroker:
        await self.put_member(self.member)
        return self

    async def aclose(self) -> None:
        """Abort every peer stream (pipelines waiting on a stub peer finish at once), then close
        the replicas as a stopping broker does."""
        for peer in self.peers.values():
            peer.abort_all()
        async with asyncio.timeout(TIMEOUT):
            await self.resolver.aclose()

    # -- topology --------------------------------------------------------------------------------

    async def put_member(self, member: MemberId) -> int:
        zone, suffix = member
        spec = pb.BrokerSpec(id=pb.ProcessId(zone=zone, suffix=suffix), endpoint=f"stub:{zone}/{suffix}")
        return await self.etcd.put(keys.member_key(ROOT, zone, suffix), spec.SerializeToString())

    async def add_peer(self, zone: str, suffix: str, *, auto: bool = True) -> StubPeer:
        """A peer broker: its member key (so routes carry its endpoint) and its stub streams."""
        peer = self.peers[(zone, suffix)] = StubPeer(zone, suffix, self.data_dir / f"peer-{suffix}", auto)
        await self.put_member(peer.member)
        return peer

    async def put_spec(self, spec: pb.JournalSpec) -> int:
        return await self.etcd.put(keys.item_key(ROOT, spec.name), spec.SerializeToString())

    async def delete_journal(self, name: str) -> int:
        """Delete the journal's spec (its assignments stay, as until the allocator removes them)."""
        return await self.etcd.delete(keys.item_key(ROOT, name))

    def spec(self, journal: str) -> pb.JournalSpec:
        """The journal's spec as etcd holds it now (delivered or not)."""
        kv = self.etcd.kvs[keys.item_key(ROOT, journal)]
        return pb.JournalSpec.FromString(kv.value)

    async def edit_spec(self, journal: str, edit: Callable[[pb.JournalSpec], None]) -> int:
        """Rewrite the journal's spec with `edit` applied (as `tidings journals apply` would)."""
        spec = self.spec(journal)
        edit(spec)
        return await self.put_spec(spec)

    def assignment_values(self, journal: str) -> list[pb.Route]:
        """The Route each assignment of the journal advertises in etcd now (slot order)."""
        prefix = keys.journal_assign_prefix(ROOT, journal)
        kvs = sorted(
            (kv for k, kv in self.etcd.kvs.items() if k.startswith(prefix)),
            key=lambda kv: keys.parse_assign_key(ROOT, kv.key).slot,
        )
        return [pb.Route.FromString(kv.value) for kv in kvs]

    async def create_journal(
        self,
        name: str,
        members: list[MemberId | StubPeer | StubBroker],
        *,
        replication: int | None = None,
        consistent: bool = False,
        listed: bool = True,
        primary: bool = True,
        **fields: Any,
    ) -> pb.JournalSpec:
        """Write the journal's spec and its assignments in one transaction: the first of `members` is
        the primary (slot 0) unless `primary` is False (no slot 0: a journal without a primary).
        `consistent`: the assignments already advertise the route. `listed`: our replica (if we are
        a member) has had its first, empty, store listing."""
        spec = spec_from_dict({"name": name, "replication": replication or len(members), **fields})
        ops = [put_op(keys.item_key(ROOT, name), spec.SerializeToString())]
        ops += self._assignment_ops(name, members, consistent, primary)
        ok, _ = await self.etcd.txn([], ops)
        assert ok
        if listed and self.member in [_member_of(m) for m in members]:
            await self.replica(name).refresh_now()
        return spec

    async def set_members(
        self,
        name: str,
        members: list[MemberId | StubPeer | StubBroker],
        *,
        consistent: bool = False,
        primary: bool = True,
    ) -> int:
        """Replace the journal's assignments (as the allocator would, in one transaction)."""
        prefix = keys.journal_assign_prefix(ROOT, name)
        ops = [delete_op(k) for k in self.etcd.kvs if k.startswith(prefix)]
        ops += self._assignment_ops(name, members, consistent, primary)
        ok, revision = await self.etcd.txn([], ops)
        assert ok
        return revision

    def _assignment_ops(
        self, name: str, members: list[MemberId | StubPeer | StubBroker], consistent: bool, primary: bool
    ) -> list[RequestOp]:
        ids = [_member_of(m) for m in members]
        route = pb.Route(primary=sorted(ids).index(ids[0]) if primary and ids else -1)
        for zone, suffix in sorted(ids):
            route.members.add(zone=zone, suffix=suffix)
        value = route.SerializeToString() if consistent else b""
        first_slot = 0 if primary else 1
        return [
            put_op(keys.assign_key(ROOT, name, zone, suffix, slot), value)
            for slot, (zone, suffix) in enumerate(ids, start=first_slot)
        ]

    # -- what the FSM uses -----------------------------------------------------------------------

    def open_streams(self, route: pb.Route) -> list[ReplicaStream]:
        self.opened.append(route)
        streams: list[ReplicaStream] = []
        for i, m in enumerate(route.members):
            if i == route.primary:
                continue
            peer = self.peers.get((m.zone, m.suffix))
            if peer is None:
                streams.append(FailedStream(f"{m.zone}/{m.suffix}", "no such peer (stub)"))
            else:
                streams.append(peer.open(f"{m.zone}/{m.suffix}"))
        return streams

    def _new_replica(self, journal: str, spec: pb.JournalSpec, revision: int) -> Replica:
        return QuietReplica(journal, spec, self.data_dir / "replicas", self.persister, journal_revision=revision)  # type: ignore[arg-type]

    # -- conveniences ----------------------------------------------------------------------------

    def replica(self, journal: str) -> Replica:
        return self.resolver.replicas[journal]

    def fsm(self, journal: str = "a/journal", *, pulse: bool = False, **fields: Any) -> AppendFSM:
        return AppendFSM(self, pb.AppendRequest(journal=journal, **fields), pulse=pulse)  # type: ignore[arg-type]


async def _no_pulse(replica: Replica) -> None:
    return None
