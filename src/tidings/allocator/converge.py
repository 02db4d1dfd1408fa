"""Converge: the leader's loop turning solver output into guarded etcd transactions.

Every member runs an Allocator over its own KeySpace, but only the *leader* (the member whose key
is oldest, ``State.leader()``) acts. On each KeySpace change it builds a State, runs the pure
solver, diffs the result against current assignments (``plan``) and applies the diff in
transactions of at most ``MAX_TXN_OPS`` operations. Each transaction is guarded by the leader's
own member key create revision (a deposed leader's writes fail) and by the mod revision of every
assignment key it deletes or rewrites (mod revision 0 for keys it creates), so a decision made on
a stale view never lands. A promotion to slot 0 deletes the old key and puts the new one, with the
same value, in the same transaction; all changes of one journal share a transaction. After a
failed transaction the loop waits for the next KeySpace revision and recomputes; after a
successful one it waits until its KeySpace has reached the transaction's revision.

``advertise_consistency`` is the broker side of the protocol: a primary that synchronized a Route
writes it into every assignment of the journal, which is what lets the allocator remove
undesired assignments (Invariant 5).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from tidings.allocator import keys
from tidings.allocator.solver import Current, SolverItem, SolverMember, solve
from tidings.allocator.state import Assignment, MemberId, State, routes_equivalent
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

__all__ = ["MAX_TXN_OPS", "Allocator", "AllocatorStats", "Change", "advertise_consistency", "plan"]

log = logging.getLogger(__name__)

MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 5.0


@dataclass(frozen=True, slots=True, eq=False)
class Change:
    """One assignment change: create a new one, delete one, or move one to another slot."""

    kind: Literal["create", "delete", "promote"]
    journal: str
    member: MemberId
    slot: int  # the new slot (create, promote) or the deleted one
    old: Assignment | None = None  # the assignment deleted or promoted

    def compares_and_ops(self, root: str) -> tuple[list[Compare], list[RequestOp]]:
        """Guards and operations of this change (see the module docstring)."""
        if self.kind == "create":
            key = keys.assign_key(root, self.journal, *self.member, self.slot)
            return [mod_revision_is(key, 0)], [put_op(key, b"")]
        assert self.old is not None
        guard = [mod_revision_is(self.old.key, self.old.mod_revision)]
        if self.kind == "delete":
            return guard, [delete_op(self.old.key)]
        key = keys.assign_key(root, self.journal, *self.member, self.slot)
        return [*guard, mod_revision_is(key, 0)], [
            delete_op(self.old.key),
            put_op(key, self.old.value.SerializeToString()),
        ]

    def __str__(self) -> str:
        who = f"{self.member[0]}#{self.member[1]}"
        if self.kind == "promote":
            assert self.old is not None
            return f"journal {self.journal}: promote {who} from slot {self.old.slot} to {self.slot}"
        return f"journal {self.journal}: {self.kind} {who} slot {self.slot}"


def plan(state: State) -> list[Change]:
    """The changes that take ``state`` to the solver's desired assignments (pure)."""
    routes = {j: state.route(j) for j in state.assignments}
    members = [SolverMember(m.id, m.spec.journal_limit, m.spec.exiting) for m in state.members.values()]
    items = [SolverItem(name, it.spec.replication, state.is_consistent(name)) for name, it in state.items.items()]
    current = {
        j: [Current(a.member, a.slot, routes_equivalent(a.value, routes[j])) for a in assigned]
        for j, assigned in state.assignments.items()
    }
    desired = solve(members, items, current)

    changes: list[Change] = []
    for journal in sorted(set(state.assignments) | set(desired)):
        want = {s.member: s.slot for s in desired.get(journal, [])}
        have: set[MemberId] = set()
        for a in state.assignments.get(journal, []):  # by slot: a duplicate member keeps its lowest slot
            if a.member in want and a.member not in have:
                have.add(a.member)
                if want[a.member] != a.slot:
                    changes.append(Change("promote", journal, a.member, want[a.member], a))
            else:
                changes.append(Change("delete", journal, a.member, a.slot, a))
        for member, slot in want.items():
            if member not in have:
                changes.append(Change("create", journal, member, slot))
    return changes


def _batches(changes: list[Change], root: str, limit: int) -> Iterator[list[Change]]:
    """Group changes into transactions of at most ``limit`` ops, never splitting a journal."""
    batch: list[Change] = []
    ops = 0
    i = 0
    while i < len(changes):
        j = i
        while j < len(changes) and changes[j].journal == changes[i].journal:
            j += 1
        group = changes[i:j]
        n = sum(len(c.compares_and_ops(root)[1]) for c in group)
        if batch and ops + n > limit:
            yield batch
            batch, ops = [], 0
        batch.extend(group)
        ops += n
        i = j
    if batch:
        yield batch


async def advertise_consistency(etcd: Etcd, state: State, journal: str, route: pb.Route) -> tuple[bool, int]:
    """Write ``route`` into every assignment of ``journal``, guarded by their mod revisions.

    Called by a journal's primary once it has synchronized ``route`` with every replica. Returns
    (ok, revision): not ok if any assignment changed since ``state`` (re-resolve at the new
    revision). When every value already equals ``route`` nothing is written and the revision is
    ``state.revision``.
    """
    assigned = state.assignments.get(journal, [])
    raw = route.SerializeToString()
    ops = [put_op(a.key, raw) for a in assigned if a.value != route]
    if not ops:
        return True, state.revision
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

    def __init__(self, etcd: Etcd, keyspace: KeySpace, root: str, self_id: tuple[str, str]) -> None:
        self._etcd = etcd
        self._ks = keyspace
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
            state = State.from_keyspace(self._ks)
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
        """Apply ``changes`` in guarded transactions; (False, rev) at the first that fails."""
        me = state.members[self.self_id]
        leader_guard = create_revision_is(me.key, me.create_revision)
        revision = state.revision
        for batch in _batches(changes, self.root, MAX_TXN_OPS):
            compares: list[Compare] = [leader_guard]
            ops: list[RequestOp] = []
            for change in batch:
                c, o = change.compares_and_ops(self.root)
                compares.extend(c)
                ops.extend(o)
            self._txns += 1
            ok, revision = await self._etcd.txn(compares, ops)
            if not ok:
                self._failed += 1
                log.info(
                    "allocator: transaction of %d changes lost a race at revision %d; recomputing", len(batch), revision
                )
                return False, revision
            self._changes += len(batch)
            for change in batch:
                log.info("allocator: %s (revision %d)", change, revision)
        return True, revision
