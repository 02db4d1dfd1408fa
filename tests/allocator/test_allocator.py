"""The allocator against a real etcd: announced members, a leader converging assignments.

No brokers run here, so the test plays every journal's primary: it writes ``route(journal)`` into
the journal's assignments (``advertise_consistency``) when asked to. An observer checks every
revision for a removal that Invariant 5 forbids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from tests.support.waiting import wait_until
from tidings.allocator import (
    Allocator,
    Announcement,
    Assignment,
    Change,
    MemberConflictError,
    State,
    advertise_consistency,
    announce,
    assign_key,
    item_key,
    member_key,
    parse_assign_key,
    plan,
    routes_equivalent,
)
from tidings.allocator.converge import _transactions
from tidings.cluster.etcd import EtcdProcess
from tidings.keyspace import Etcd, KeySpace, LeaseLostError, decoder, mod_revision_is, put_op
from tidings.protocol import protocol_pb2 as pb

MemberId = tuple[str, str]


def journal_spec(name: str, replication: int) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = 1 << 20
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval_ms = 60_000
    return spec


def broker_spec(mid: MemberId, limit: int = 100, exiting: bool = False) -> pb.BrokerSpec:
    return pb.BrokerSpec(
        id=pb.ProcessId(zone=mid[0], suffix=mid[1]), endpoint=f"{mid[1]}:8080", journal_limit=limit, exiting=exiting
    )


@dataclass
class Node:
    """One would-be broker: its announcement, KeySpace and Allocator."""

    id: MemberId
    etcd: Etcd
    announcement: Announcement
    keyspace: KeySpace
    allocator: Allocator
    closed: bool = False

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.allocator.aclose()
        await self.keyspace.aclose()
        await self.announcement.aclose()
        await self.etcd.aclose()


@dataclass
class Invariant5Checker:
    """Compares consecutive states and records any removal Invariant 5 forbids."""

    ks: KeySpace
    prev: State | None = None
    violations: list[str] = field(default_factory=list)

    def __call__(self) -> None:
        new = State.from_keyspace(self.ks)
        prev, self.prev = self.prev, new
        if prev is None:
            return
        for journal, before in prev.assignments.items():
            after = {a.member for a in new.assignments.get(journal, [])}
            gone = {a.member for a in before} - after
            if not gone or journal not in prev.items:
                continue
            if all(mid not in prev.members or mid not in new.members for mid in gone):
                continue  # the member's lease expired (its leased assignments go in the same revision)
            route = prev.route(journal)
            remaining = sum(routes_equivalent(a.value, route) for a in before if a.member in after)
            r = prev.items[journal].spec.replication
            if not prev.is_consistent(journal) or remaining < r:
                self.violations.append(
                    f"rev {new.revision}: {journal} lost {sorted(gone)}; {remaining} consistent left"
                )


@dataclass
class Cluster:
    root: str
    etcd: Etcd  # the test's own connection
    ks: KeySpace  # the test's own view
    checker: Invariant5Checker
    nodes: list[Node] = field(default_factory=list)
    members: list[Announcement] = field(default_factory=list)  # announced without an Allocator

    async def add_member(self, mid: MemberId, limit: int = 100) -> Announcement:
        """Announce a member whose allocator the test drives itself (``idle_allocator``)."""
        announcement = await announce(self.etcd, self.root, broker_spec(mid, limit), ttl=5)
        self.members.append(announcement)
        await self.ks.wait_for_revision(announcement.create_revision, timeout=5)
        return announcement

    def idle_allocator(self, mid: MemberId) -> Allocator:
        """An Allocator that is never started: the test calls ``plan`` and ``_apply`` at views it chooses."""
        return Allocator(self.etcd, self.ks, self.root, mid)

    async def converge_by_hand(self, allocator: Allocator, rounds: int = 20) -> State:
        """Play the leader round by round (plan, apply, advertise) until nothing is left to change."""
        for _ in range(rounds):
            await self.advertise_all()
            state = self.state()
            changes = plan(state)
            if not changes:
                return state
            ok, rev = await allocator._apply(state, changes)
            assert ok, f"no concurrent writer, yet a transaction failed at revision {rev}"
            await self.ks.wait_for_revision(rev, timeout=5)
        raise AssertionError(f"no fixed point after {rounds} rounds")

    async def add_node(self, mid: MemberId, limit: int = 100) -> Node:
        etcd = await Etcd.connect(self.etcd.endpoint)
        announcement = await announce(etcd, self.root, broker_spec(mid, limit), ttl=5)
        ks = KeySpace(self.root, decoder(self.root))
        await ks.start(etcd)
        allocator = Allocator(etcd, ks, self.root, mid)
        allocator.start()
        node = Node(mid, etcd, announcement, ks, allocator)
        self.nodes.append(node)
        return node

    async def put_item(self, name: str, replication: int) -> int:
        """Write a journal's spec; return once our KeySpace has seen it (plans read the KeySpace)."""
        revision = await self.etcd.put(item_key(self.root, name), journal_spec(name, replication).SerializeToString())
        await self.ks.wait_for_revision(revision, timeout=5)
        return revision

    def state(self) -> State:
        return State.from_keyspace(self.ks)

    async def advertise_all(self) -> None:
        """Play every primary: advertise the current route of each inconsistent journal."""
        state = self.state()
        for journal in state.assignments:
            if journal in state.items and not state.is_consistent(journal):
                ok, rev = await advertise_consistency(self.etcd, state, journal, state.route(journal))
                if ok:
                    await self.ks.wait_for_revision(rev, timeout=5)

    def converged(self) -> bool:
        """Every item is consistent with one primary and R replicas on distinct members, spread over zones.

        Replicas sit on non-exiting members when enough exist; otherwise exiting members keep the
        replicas nobody else can take (Invariant 5).
        """
        state = self.state()
        active = {mid for mid, m in state.members.items() if not m.spec.exiting}
        for name, item in state.items.items():
            r = item.spec.replication
            assigned = state.assignments.get(name, [])
            members = {a.member for a in assigned}
            if len(members) != len(assigned) or [a.slot for a in assigned].count(0) != 1:
                return False
            if not state.is_consistent(name) or not members <= set(state.members):
                return False
            if r <= len(active):
                zones = min(r, len({z for z, _ in active}))
                if len(members) != r or not members <= active or len({z for z, _ in members}) != zones:
                    return False
            elif not active <= members or len(members) != min(r, len(state.members)):
                return False
        if any(name not in state.items for name in state.assignments):
            return False
        return not plan(state)  # (and balanced: the leader has nothing left to move)

    async def settle(self, timeout: float = 15.0) -> State:
        async def done() -> bool:
            await self.advertise_all()
            return self.converged()

        await wait_until(done, timeout=timeout)
        assert self.checker.violations == []
        state = self.state()
        assert_assignments_leased_by_their_members(state)
        return state


def assert_assignments_leased_by_their_members(state: State) -> None:
    """Every assignment lives under its member's lease, so it goes with the member key (Gazette)."""
    for assigned in state.assignments.values():
        for a in assigned:
            assert a.lease == state.members[a.member].lease != 0, f"{a.key} is not under its member's lease"


@pytest.fixture
async def cluster(etcd: EtcdProcess, etcd_root: str) -> AsyncIterator[Cluster]:
    client = await Etcd.connect(etcd.endpoint)
    ks = KeySpace(etcd_root, decoder(etcd_root))
    checker = Invariant5Checker(ks)
    ks.add_observer(checker)
    await ks.start(client)
    c = Cluster(etcd_root, client, ks, checker)
    try:
        yield c
    finally:
        for node in c.nodes:
            await node.aclose()
        for member in c.members:
            await member.aclose()
        await ks.aclose()
        await client.delete_prefix(etcd_root + "/")
        assert (await client.get_prefix(etcd_root + "/"))[0] == []
        await client.aclose()
    assert checker.violations == []


ZA, ZB, ZC = ("za", "b1"), ("zb", "b2"), ("zc", "b3")


async def three_nodes_and_items(cluster: Cluster) -> None:
    for mid in (ZA, ZB, ZC):
        await cluster.add_node(mid)
    for i, r in enumerate([1, 2, 3, 1, 2, 3]):
        await cluster.put_item(f"journals/j{i}-r{r}", r)


async def test_every_journal_gets_r_assignments_across_zones_from_the_leader(cluster: Cluster) -> None:
    await three_nodes_and_items(cluster)
    state = await cluster.settle()
    assert state.leader() == ZA
    for name, item in state.items.items():
        assigned = state.assignments[name]
        assert len(assigned) == item.spec.replication
        assert len({a.zone for a in assigned}) == item.spec.replication
        assert sorted(a.slot for a in assigned)[0] == 0
        route = state.route(name)
        assert route.members[route.primary].zone == next(a.zone for a in assigned if a.slot == 0)
        assert all(ep.endswith(":8080") for ep in route.endpoints)
    # Only the leader wrote assignments.
    assert cluster.nodes[0].allocator.statistics().transactions > 0
    assert all(n.allocator.statistics().transactions == 0 for n in cluster.nodes[1:])

    # Raising and lowering R converges again, never removing a replica too early.
    await cluster.put_item("journals/j0-r1", 3)
    await cluster.put_item("journals/j2-r3", 1)
    state = await cluster.settle()
    assert len(state.assignments["journals/j0-r1"]) == 3 and len(state.assignments["journals/j2-r3"]) == 1

    # A deleted journal loses its assignments.
    # Settle reads the test's own KeySpace: it must have seen the delete first.
    await cluster.ks.wait_for_revision(await cluster.etcd.delete(item_key(cluster.root, "journals/j1-r2")), timeout=5)
    state = await cluster.settle()
    assert "journals/j1-r2" not in state.assignments


async def test_dead_member_assignments_are_reassigned(cluster: Cluster) -> None:
    await three_nodes_and_items(cluster)
    await cluster.add_node(("za", "b4"))
    state = await cluster.settle()
    victim = cluster.nodes[1]
    assert state.assignments_of(*victim.id)

    await victim.aclose()  # revokes its lease: the member key goes at once
    await wait_until(lambda: victim.id not in cluster.state().members, 10)  # settle() must see it gone
    state = await cluster.settle()
    assert victim.id not in state.members
    assert state.assignments_of(*victim.id) == []
    assert all(len(a) == state.items[j].spec.replication for j, a in state.assignments.items())


async def test_exiting_member_sheds_journals_only_once_routes_are_consistent(cluster: Cluster) -> None:
    """Invariant 5: the allocator over-subscribes first and removes only after consistency is advertised."""
    await three_nodes_and_items(cluster)
    await cluster.settle()
    leaving = cluster.nodes[2]
    await leaving.announcement.update(broker_spec(leaving.id, exiting=True))

    def over_subscribed() -> bool:
        state = cluster.state()
        for a in state.assignments_of(*leaving.id):
            r = state.items[a.journal].spec.replication
            if r < 3 and len(state.assignments[a.journal]) != r + 1:
                return False
        return True

    await wait_until(over_subscribed, timeout=10)
    state = cluster.state()
    held = {a.journal for a in state.assignments_of(*leaving.id)}
    assert {j for j in held if state.items[j].spec.replication < 3}, "the exiting member should hold journals"
    assert not any(state.is_consistent(j) for j in held if state.items[j].spec.replication < 3)

    # Nothing moves away until the primaries advertise the new routes.
    await cluster.settle()
    state = cluster.state()
    still = {a.journal for a in state.assignments_of(*leaving.id)}
    # Only journals needing all three members (nowhere else to go) stay on the exiting member.
    assert still == {j for j in held if state.items[j].spec.replication == 3}
    for j in still:
        assert len(state.assignments[j]) == 3


async def test_leadership_passes_to_the_next_oldest_member(cluster: Cluster) -> None:
    await three_nodes_and_items(cluster)
    state = await cluster.settle()
    assert state.leader() == ZA
    old_leader = cluster.nodes[0]
    await old_leader.aclose()

    await wait_until(lambda: cluster.state().leader() == ZB, timeout=10)
    await cluster.put_item("journals/new", 2)
    state = await cluster.settle()
    assert len(state.assignments["journals/new"]) == 2
    assert state.assignments_of(*ZA) == []
    assert cluster.nodes[1].allocator.statistics().transactions > 0


async def test_stale_decisions_fail_their_guards(cluster: Cluster) -> None:
    """A write computed on an old revision never lands: it is guarded by mod revisions."""
    await three_nodes_and_items(cluster)
    stale = await cluster.settle()
    journal = "journals/j1-r2"
    a = stale.assignments[journal][0]
    # The assignment changes behind the stale state's back (keeping its lease, as a broker would).
    ok, rev = await cluster.etcd.txn([], [put_op(a.key, b"", ignore_lease=True)])
    assert ok
    await cluster.ks.wait_for_revision(rev, timeout=5)
    ok, _ = await advertise_consistency(cluster.etcd, stale, journal, pb.Route(primary=-1))
    assert not ok
    kv, _ = await cluster.etcd.get(a.key)
    assert kv is not None and kv.value == b""
    await cluster.settle()


async def test_removal_planned_before_a_raised_replication_fails(cluster: Cluster) -> None:
    """Invariant 5: a removal decided at R=1 must not land once R is back to 3 (item mod revision guard)."""
    for mid in (ZA, ZB, ZC):
        await cluster.add_member(mid)
    leader = cluster.idle_allocator(ZA)
    journal = "journals/raised"
    await cluster.ks.wait_for_revision(await cluster.put_item(journal, 3), timeout=5)
    state = await cluster.converge_by_hand(leader)
    assert len(state.assignments[journal]) == 3 and state.is_consistent(journal)

    await cluster.ks.wait_for_revision(await cluster.put_item(journal, 1), timeout=5)
    stale = cluster.state()
    changes = plan(stale)
    assert [c.kind for c in changes] == ["delete", "delete"]

    await cluster.ks.wait_for_revision(await cluster.put_item(journal, 3), timeout=5)  # raised meanwhile
    ok, _ = await leader._apply(stale, changes)
    assert not ok
    assert len(cluster.state().assignments[journal]) == 3

    state = await cluster.converge_by_hand(leader)
    assert len(state.assignments[journal]) == 3


async def test_removal_of_a_deleted_journal_fails_once_it_is_recreated(cluster: Cluster) -> None:
    """Assignments of a journal are dropped as dead only while its item does not exist."""
    await cluster.add_member(ZA)
    await cluster.add_member(ZB)
    leader = cluster.idle_allocator(ZA)
    journal = "journals/reborn"
    await cluster.put_item(journal, 2)
    state = await cluster.converge_by_hand(leader)
    assert len(state.assignments[journal]) == 2

    await cluster.ks.wait_for_revision(await cluster.etcd.delete(item_key(cluster.root, journal)), timeout=5)
    stale = cluster.state()
    changes = plan(stale)
    assert [c.kind for c in changes] == ["delete", "delete"]

    await cluster.ks.wait_for_revision(await cluster.put_item(journal, 2), timeout=5)  # re-created meanwhile
    ok, _ = await leader._apply(stale, changes)
    assert not ok
    assert len(cluster.state().assignments[journal]) == 2


async def test_addition_planned_before_a_lowered_journal_limit_fails(cluster: Cluster) -> None:
    """An assignment decided while a member had room must not land once its limit drops (member guard)."""
    await cluster.add_member(ZA)
    zb = await cluster.add_member(ZB)
    leader = cluster.idle_allocator(ZA)
    journal = "journals/limited"
    await cluster.ks.wait_for_revision(await cluster.put_item(journal, 2), timeout=5)
    stale = cluster.state()
    changes = plan(stale)
    assert {(c.kind, c.member) for c in changes} == {("create", ZA), ("create", ZB)}

    await zb.update(broker_spec(ZB, limit=0))  # lowered meanwhile
    ok, _ = await leader._apply(stale, changes)
    assert not ok
    assert journal not in cluster.state().assignments

    state = await cluster.converge_by_hand(leader)
    assert [a.member for a in state.assignments[journal]] == [ZA]


async def test_leader_whose_member_key_changed_cannot_apply_an_older_plan(cluster: Cluster) -> None:
    """The leader guard is its member key's mod revision: a rewrite of that key (e.g. exiting) fences old plans."""
    za = await cluster.add_member(ZA, limit=0)
    await cluster.add_member(ZB)
    leader = cluster.idle_allocator(ZA)
    journal = "journals/fenced"
    await cluster.ks.wait_for_revision(await cluster.put_item(journal, 1), timeout=5)
    stale = cluster.state()
    changes = plan(stale)
    assert [(c.kind, c.member) for c in changes] == [("create", ZB)]  # nothing names the leader's own key

    await za.update(broker_spec(ZA, limit=0, exiting=True))
    ok, _ = await leader._apply(stale, changes)
    assert not ok
    assert journal not in cluster.state().assignments

    # Leadership is still the oldest member by create revision; at the new view its plan lands.
    assert cluster.state().leader() == ZA
    state = await cluster.converge_by_hand(leader)
    assert [a.member for a in state.assignments[journal]] == [ZB]


async def test_lost_member_lease_removes_its_key_and_assignments_in_one_revision(cluster: Cluster) -> None:
    """Assignments live under their member's lease: no revision shows a Route naming a member without a key."""
    await cluster.add_member(ZA)
    zb = await cluster.add_member(ZB)
    leader = cluster.idle_allocator(ZA)
    await cluster.put_item("journals/leased-0", 1)
    await cluster.converge_by_hand(leader)  # ZA is now the more loaded member ...
    await cluster.put_item("journals/leased-1", 2)
    state = await cluster.converge_by_hand(leader)  # ... so ZB becomes leased-1's primary
    assert_assignments_leased_by_their_members(state)
    held = state.assignments_of(*ZB)
    assert [(a.journal, a.slot) for a in held] == [("journals/leased-1", 0)]

    events = []
    async with cluster.etcd.watch(cluster.root + "/", state.revision + 1) as watch:
        await cluster.etcd.revoke_lease(zb.lease_id)  # as etcd does when the lease expires
        async for batch in watch:
            events.extend(batch.events)
            if any(e.kv.key == member_key(cluster.root, *ZB) for e in events):
                break
    gone = {e.kv.key: e.kv.mod_revision for e in events if e.type == "delete"}
    assert set(gone) == {member_key(cluster.root, *ZB), *(a.key for a in held)}
    assert len(set(gone.values())) == 1
    await cluster.ks.wait_for_revision(max(gone.values()), timeout=5)  # plans read the test's KeySpace

    # ZA takes over as primary where ZB was: the promoted key keeps ZA's lease.
    state = await cluster.converge_by_hand(leader)
    assert all([a.member for a in assigned] == [ZA] for assigned in state.assignments.values())
    assert_assignments_leased_by_their_members(state)


async def test_unleased_assignment_of_a_gone_member_is_removed(cluster: Cluster) -> None:
    """Assignments written without a lease (older code) outlive their member; the leader deletes them."""
    await cluster.add_member(ZA)
    leader = cluster.idle_allocator(ZA)
    journal = "journals/legacy"
    await cluster.put_item(journal, 1)
    await cluster.converge_by_hand(leader)
    orphan = assign_key(cluster.root, journal, "zq", "gone", 1)
    await cluster.ks.wait_for_revision(await cluster.etcd.put(orphan, b""), timeout=5)

    state = await cluster.converge_by_hand(leader)
    assert [a.member for a in state.assignments[journal]] == [ZA]
    assert (await cluster.etcd.get(orphan))[0] is None


async def test_announce_refuses_a_live_duplicate_and_reports_a_lost_lease(cluster: Cluster) -> None:
    first = await announce(cluster.etcd, cluster.root, broker_spec(ZA), ttl=2)
    try:
        with pytest.raises(MemberConflictError, match="za#b1"):
            await announce(cluster.etcd, cluster.root, broker_spec(ZA), ttl=5)
        kv, _ = await cluster.etcd.get(member_key(cluster.root, *ZA))
        assert kv is not None and kv.lease == first.lease_id

        await first.update(broker_spec(ZA, exiting=True))
        kv, _ = await cluster.etcd.get(member_key(cluster.root, *ZA))
        assert kv is not None and pb.BrokerSpec.FromString(kv.value).exiting and kv.lease == first.lease_id

        await cluster.etcd.revoke_lease(first.lease_id)  # as if etcd expired it
        await wait_until(first.lost.is_set, timeout=10)
        with pytest.raises(LeaseLostError):
            await first.update(broker_spec(ZA))
    finally:
        await first.aclose()
    second = await announce(cluster.etcd, cluster.root, broker_spec(ZA), ttl=5)
    await second.aclose()
    assert (await cluster.etcd.get(member_key(cluster.root, *ZA)))[0] is None


def test_transactions_stay_within_etcd_limits_and_check_each_guard_once() -> None:
    """etcd's --max-txn-ops bounds compares as well as ops; shared guards (item, member) are checked once."""
    gone, target = ("zb", "b2"), ("za", "b1")

    def held(journal: str, slot: int) -> Assignment:
        return Assignment(journal, *gone, slot, pb.Route(), assign_key("/r", journal, *gone, slot), 7, lease=9)

    changes = []
    for i in range(40):
        journal = f"j/{i:02d}"
        changes += [
            Change("delete", journal, gone, 1, held(journal, 1), item_revision=5),
            Change("delete", journal, gone, 2, held(journal, 2), item_revision=5),
            Change("create", journal, target, 3, member_revision=4, lease=8),
        ]
    leader_guard = mod_revision_is(member_key("/r", *target), 4)  # the leader adds to itself
    txns = list(_transactions(changes, "/r", [leader_guard], 20))
    assert [c for t in txns for c in t.changes] == changes
    for t in txns:
        assert len(t.compares) <= 20 and len(t.ops) <= 20
        assert t.compares[0] == leader_guard
        raw = [c.SerializeToString() for c in t.compares]
        assert len(raw) == len(set(raw))
        journals = {c.journal for c in t.changes}
        assert len([c for c in t.compares if c.key.startswith(b"/r/items/")]) == len(journals)
        assert len([c for c in t.compares if c.key == member_key("/r", *target).encode()]) == 1
        # Deletes are guarded by the item's mod revision; creates go under the member's lease.
        assert all(c.mod_revision == 5 for c in t.compares if c.key.startswith(b"/r/items/"))
        assert {op.request_put.lease for op in t.ops if op.HasField("request_put")} == {8}


def test_key_layout_round_trips() -> None:
    key = assign_key("/root", "a/b/c", "zone-1", "broker.7", 12)
    assert key == "/root/assign/a/b/c#zone-1#broker.7#12"
    parsed = parse_assign_key("/root", key)
    assert (parsed.journal, parsed.member, parsed.slot) == ("a/b/c", ("zone-1", "broker.7"), 12)
    with pytest.raises(ValueError):
        parse_assign_key("/root", "/root/assign/a/b#z#s")
