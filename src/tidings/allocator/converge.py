"""Converge: the leader's loop turning solver output into guarded etcd transactions.

Every member runs an Allocator over its own KeySpace, but only the *leader* (the member whose key
is oldest by create revision, ``State.leader()``) acts. On each KeySpace change it builds a State,
runs the pure solver, diffs the result against current assignments (``plan``) and applies the
diff in transactions of at most ``MAX_TXN_OPS`` compares and at most as many operations. A
decision made on a stale view never lands, because each transaction also checks, as Gazette's
allocator does:

- the leader's own member key is unchanged (its *mod* revision): a deposed leader, or one whose
  spec changed since its view (e.g. it began exiting), writes nothing;
- every assignment key it deletes or moves is unchanged (its mod revision), and every key it
  creates does not exist yet;
- for a removal, the journal's item is unchanged (its mod revision, once per journal per
  transaction), so a removal decided at replication R cannot land after R was raised; the
  assignments of a journal that no longer exists are removed only while its item still does not
  exist (create revision 0), so a re-created journal keeps them;
- for an addition, the target member key is unchanged (its mod revision), so an addition decided
  before the member's ``journal_limit`` was lowered (or it began exiting) cannot land.

Leases. A new assignment key is put under its member's etcd lease, and a promotion to slot 0
deletes the old key and puts its value at the new key under the old key's lease, in the same
transaction; ``advertise_consistency`` rewrites values keeping each key's lease. So when a
member's lease expires (or is revoked), etcd deletes its member key and all its assignments in
one revision: no Route is ever derived that names a member without a key (and an endpoint), and
nobody needs to clean up after a dead member. The solver still drops assignments whose member
is gone: that path remains for keys without a lease (written by older code, or by hand), which
the leader deletes like any other removal, guarded by the item.

All changes of one journal share a transaction. After a failed transaction the loop waits for
the next KeySpace revision and recomputes; after a successful one it waits until its KeySpace
has reached the transaction's revision.

``advertise_consistency`` (``advertise_route``) is the broker side of the protocol: a primary that
synchronized a Route writes it into every assignment of the journal, which is what lets the
allocator remove undesired assignments (Invariant 5). The write is guarded by the assignments the
primary resolved its Route from, so a stale view never overwrites a newer primary's values.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from tidings.allocator import keys
from tidings.allocator.decoded import Assignment, MemberId
from tidings.allocator.kind import JOURNALS, Kind
from tidings.allocator.solver import Current, SolverItem, SolverMember, solve
from tidings.allocator.state import State
from tidings.keyspace import (
    Compare,
    Etcd,
    KeySpace,
    RequestOp,
    create_revision_is,
    delete_op,
    mod_revision_is,
    put_op,
)
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError, UsageError

__all__ = [
    "MAX_TXN_OPS",
    "Allocator",
    "AllocatorStats",
    "Change",
    "advertise_consistency",
    "advertise_route",
    "plan",
]

log = logging.getLogger(__name__)

MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 5.0


@dataclass(frozen=True, slots=True, eq=False)
class Change:
    """One assignment change: create a new one, delete one, or move one to another slot.

    Besides the assignment, a change carries the revisions of the keys it was decided on (see the
    module docstring): ``item_revision`` for a delete (the journal item's mod revision, 0 if the
    item did not exist) and, for a create, ``member_revision`` (the member key's mod revision) and
    ``lease`` (the member's lease, under which the new key is put).
    """

    kind: Literal["create", "delete", "promote"]
    journal: str
    member: MemberId
    slot: int  # the new slot (create, promote) or the deleted one
    old: Assignment | None = None  # the assignment deleted or promoted
    item_revision: int = 0
    member_revision: int = 0
    lease: int = 0

    def compares_and_ops(self, root: str) -> tuple[list[Compare], list[RequestOp]]:
        """Guards and operations of this change (see the module docstring)."""
        if self.kind == "create":
            key = keys.assign_key(root, self.journal, *self.member, self.slot)
            member = keys.member_key(root, *self.member)
            return [mod_revision_is(member, self.member_revision), mod_revision_is(key, 0)], [
                put_op(key, b"", lease=self.lease)
            ]
        assert self.old is not None
        guard = [mod_revision_is(self.old.key, self.old.mod_revision)]
        if self.kind == "delete":
            item = keys.item_key(root, self.journal)
            if self.item_revision:
                item_guard = mod_revision_is(item, self.item_revision)
            else:
                item_guard = create_revision_is(item, 0)  # a dead journal's: it must still not exist
            return [item_guard, *guard], [delete_op(self.old.key)]
        key = keys.assign_key(root, self.journal, *self.member, self.slot)
        return [*guard, mod_revision_is(key, 0)], [
            delete_op(self.old.key),
            put_op(key, self.old.value.SerializeToString(), lease=self.old.lease),
        ]

    def __str__(self) -> str:
        who = f"{self.member[0]}#{self.member[1]}"
        if self.kind == "promote":
            assert self.old is not None
            return f"{self.journal}: promote {who} from slot {self.old.slot} to {self.slot}"
        return f"{self.journal}: {self.kind} {who} slot {self.slot}"


def plan(state: State) -> list[Change]:
    """The changes that take ``state`` to the solver's desired assignments (pure)."""
    kind = state.kind
    routes = {j: state.route(j) for j in state.assignments}
    members = [SolverMember(m.id, kind.item_limit(m.spec), kind.exiting(m.spec)) for m in state.members.values()]
    items = [
        SolverItem(name, kind.desired_replication(it.spec), state.is_consistent(name))
        for name, it in state.items.items()
    ]
    current = {
        j: [Current(a.member, a.slot, kind.consistent(a, routes[j], assigned)) for a in assigned]
        for j, assigned in state.assignments.items()
    }
    desired = solve(members, items, current)

    changes: list[Change] = []
    for journal in sorted(set(state.assignments) | set(desired)):
        item = state.items.get(journal)
        item_revision = item.mod_revision if item is not None else 0
        want = {s.member: s.slot for s in desired.get(journal, [])}
        have: set[MemberId] = set()
        for a in state.assignments.get(journal, []):  # by slot: a duplicate member keeps its lowest slot
            if a.member in want and a.member not in have:
                have.add(a.member)
                if want[a.member] != a.slot:
                    changes.append(Change("promote", journal, a.member, want[a.member], a))
            else:
                changes.append(Change("delete", journal, a.member, a.slot, a, item_revision=item_revision))
        for member_id, slot in want.items():
            if member_id not in have:
                member = state.members[member_id]  # the solver adds only on present members
                changes.append(
                    Change("create", journal, member_id, slot, member_revision=member.mod_revision, lease=member.lease)
                )
    return changes


@dataclass(slots=True)
class _Txn:
    """One transaction being built: its changes, and its compares without duplicates."""

    changes: list[Change]
    compares: list[Compare]
    ops: list[RequestOp]
    seen: set[bytes]

    @classmethod
    def new(cls, fixed: list[Compare]) -> _Txn:
        return cls([], list(fixed), [], {c.SerializeToString(deterministic=True) for c in fixed})

    def fresh(self, compares: list[Compare]) -> list[Compare]:
        """Those of ``compares`` this transaction does not check yet (e.g. one item guard per journal)."""
        out: list[Compare] = []
        seen = set(self.seen)
        for c in compares:
            raw = c.SerializeToString(deterministic=True)
            if raw not in seen:
                seen.add(raw)
                out.append(c)
        return out

    def add(self, changes: list[Change], compares: list[Compare], ops: list[RequestOp]) -> None:
        self.changes.extend(changes)
        self.compares.extend(compares)
        self.seen.update(c.SerializeToString(deterministic=True) for c in compares)
        self.ops.extend(ops)


def _transactions(changes: list[Change], root: str, fixed: list[Compare], limit: int) -> Iterator[_Txn]:
    """Group changes into transactions of at most ``limit`` compares (``fixed`` in each) and ``limit``
    ops, never splitting a journal (etcd's --max-txn-ops bounds both)."""
    txn = _Txn.new(fixed)
    i = 0
    while i < len(changes):
        j = i
        while j < len(changes) and changes[j].journal == changes[i].journal:
            j += 1
        group = changes[i:j]
        compares: list[Compare] = []
        ops: list[RequestOp] = []
        for change in group:
            c, o = change.compares_and_ops(root)
            compares.extend(c)
            ops.extend(o)
        new = txn.fresh(compares)
        if txn.changes and (len(txn.compares) + len(new) > limit or len(txn.ops) + len(ops) > limit):
            yield txn
            txn = _Txn.new(fixed)
            new = txn.fresh(compares)
        txn.add(group, new, ops)
        i = j
    if txn.changes:
        yield txn


async def advertise_consistency(etcd: Etcd, state: State, journal: str, route: pb.Route) -> tuple[bool, int]:
    """Write ``route`` into every assignment of ``journal`` in ``state``, guarded by their mod revisions
    (``advertise_route``). When every value already equals ``route`` nothing is written and the
    revision is ``state.revision``.
    """
    assigned = state.assignments.get(journal, [])
    if all(a.value == route for a in assigned):
        return True, state.revision
    return await advertise_route(etcd, assigned, route)


async def advertise_route(etcd: Etcd, assigned: Sequence[Assignment], route: pb.Route) -> tuple[bool, int]:
    """Write ``route`` into each of ``assigned`` (a journal's assignments as one view of etcd had them),
    guarded by the mod revisions of them all (Gazette's ``updateAssignments``).

    Called by a journal's primary once it has synchronized ``route`` with every replica, with the
    assignments it resolved that route from: a primary whose view went stale (the allocator moved the
    journal, or a newer primary advertised its own route since) writes nothing. Values are rewritten
    keeping each key's lease (its member's). Returns (ok, revision), the revision being etcd's at the
    transaction whether it applied or not (re-resolve there: it includes whatever change made it
    fail); (True, 0) when every value already equals ``route`` (nothing to write).
    """
    raw = route.SerializeToString()
    ops = [put_op(a.key, raw, ignore_lease=True) for a in assigned if a.value != route]
    if not ops:
        return True, 0
    return await etcd.txn([mod_revision_is(a.key, a.mod_revision) for a in assigned], ops)


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """Counters for the CLI and /metrics."""

    rounds: int
    transactions: int
    failed_transactions: int
    changes: int


class Allocator:
    """Runs ``plan`` whenever the KeySpace changes and this member leads; see the module docstring.

    Usage::

        allocator = Allocator(etcd, keyspace, root, ("zone-a", "broker-1"))
        allocator.start()             # task "allocator:{root}"
        ...
        await allocator.aclose()
    """

    def __init__(
        self, etcd: Etcd, keyspace: KeySpace, root: str, self_id: tuple[str, str], kind: Kind = JOURNALS
    ) -> None:
        self._etcd = etcd
        self._ks = keyspace
        self.kind = kind  # what it places: journals on brokers, or shards on consumers (`allocator.kind`)
        self.root = root.rstrip("/")
        if keyspace.root != self.root:
            raise UsageError(f"allocator root {self.root!r} differs from its KeySpace's root {keyspace.root!r}")
        self.self_id = self_id
        self._task: asyncio.Task[None] | None = None
        self._rounds = self._txns = self._failed = self._changes = 0

    def statistics(self) -> AllocatorStats:
        return AllocatorStats(self._rounds, self._txns, self._failed, self._changes)

    def start(self) -> None:
        """Run ``run()`` in the named task ``allocator:{root}``."""
        if self._task is not None:
            raise RuntimeError(f"allocator of {self.root!r} is already started")
        self._task = asyncio.create_task(self.run(), name=f"allocator:{self.root}")
        self._task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("allocator of %s died", self.root, exc_info=task.exception())

    async def aclose(self) -> None:
        """Stop the loop. A transaction in flight either landed whole or not at all."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def run(self) -> None:
        """Loop until cancelled: on each KeySpace change, if leader, converge one round."""
        backoff = _BACKOFF_MIN
        while True:
            observed = self._ks.revision
            state = State.from_keyspace(self._ks, self.kind)
            if state.leader() == self.self_id:
                changes = plan(state)
                if changes:
                    self._rounds += 1
                    try:
                        ok, revision = await self._apply(state, changes)
                    except TransportError as err:
                        log.warning("allocator: etcd transaction failed, retrying in %.2fs: %s", backoff, err)
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, _BACKOFF_MAX)
                        continue
                    backoff = _BACKOFF_MIN
                    if ok:
                        await self._ks.wait_for_revision(revision)
                        continue
            await self._ks.wait_for_update(observed)

    async def _apply(self, state: State, changes: list[Change]) -> tuple[bool, int]:
        """Apply ``changes`` in guarded transactions; (False, rev) at the first that fails.

        Every transaction checks that this leader's member key still has the mod revision it had
        in ``state`` (see the module docstring).
        """
        me = state.members[self.self_id]
        leader_guard = mod_revision_is(me.key, me.mod_revision)
        revision = state.revision
        for txn in _transactions(changes, self.root, [leader_guard], MAX_TXN_OPS):
            self._txns += 1
            ok, revision = await self._etcd.txn(txn.compares, txn.ops)
            if not ok:
                self._failed += 1
                log.info(
                    "allocator: transaction of %d changes lost a race at revision %d; recomputing",
                    len(txn.changes),
                    revision,
                )
                return False, revision
            self._changes += len(txn.changes)
            for change in txn.changes:
                log.info("allocator: %s (revision %d)", change, revision)
        return True, revision
