"""Resolver: maps a journal to its current Route, spec and local Replica at a KeySpace revision.

It layers on the KeySpace (gazette-transactional-appends.txt, *Components*): on every applied
watch batch it rebuilds the allocator State, creates Replicas for journals newly assigned to
this broker, updates those whose spec or route changed, and closes those no longer assigned.
Disagreements about topology are settled by etcd revision: a request carrying a later revision
than ours first waits for the KeySpace to reach it.

A request's verified claims (`tidings.auth`) are enforced here, so every path (Read, Append,
ListFragments, proxied or not) hides alike: a journal whose labels (with its meta-labels `name` and
`name:prefix`) the claims' selector does not match resolves exactly as a missing one does, status
JOURNAL_NOT_FOUND and a header with no route (Gazette's resolver): nothing of it reaches the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tidings.allocator.decoded import Assignment
from tidings.allocator.state import State
from tidings.broker.replica import Replica
from tidings.keyspace import KeySpace
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Claims, covers
from tidings.protocol.labels import journal_labels
from tidings.protocol.route import routes_equivalent

log = logging.getLogger(__name__)

READ_THROUGH_TIMEOUT = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class Resolution:
    """The outcome of resolving a journal: a status, and if OK, everything needed to serve it. Its header
    (and route and spec) are shared with every other resolution at the same revision: read or copy them,
    never change them in place."""

    status: pb.Status
    header: pb.Header
    spec: pb.JournalSpec | None = None
    replica: Replica | None = None
    # The journal's assignments the route was derived from (at the header's revision): a primary
    # advertises its synchronized route guarded by these, never by a later view (Gazette's).
    assignments: tuple[Assignment, ...] = ()
    advertised: bool = False  # every one of `assignments` carries a route equivalent to the header's

    @property
    def route(self) -> pb.Route:
        return self.header.route

    @property
    def is_primary(self) -> bool:
        r = self.header.route
        return r.primary >= 0 and same_process(r.members[r.primary], self.header.process_id)

    def primary_endpoint(self) -> str | None:
        r = self.header.route
        return r.endpoints[r.primary] if r.primary >= 0 and r.endpoints else None


def same_process(a: pb.ProcessId, b: pb.ProcessId) -> bool:
    return a.zone == b.zone and a.suffix == b.suffix


class Resolver:
    """Keeps `replicas` in step with this broker's assignments and resolves requests; `hid(journal)` is
    told of each journal a request's claims hid (the refusals' log)."""

    def __init__(
        self,
        keyspace: KeySpace,
        process_id: pb.ProcessId,
        new_replica: Callable[[str, pb.JournalSpec, int], Replica],
        pulse: Callable[[Replica], Coroutine[Any, Any, None]],
        hid: Callable[[str], None] = lambda journal: None,
    ) -> None:
        self.keyspace = keyspace
        self.process_id = process_id
        self.new_replica = new_replica
        self.pulse = pulse
        self.hid = hid
        # Per journal, the last (spec, claims) checked and the answer: a writer sends one token (the
        # verifier's cache gives the same Claims object), so its appends check by identity, not by labels.
        self._covered: dict[str, tuple[pb.JournalSpec, Claims, bool]] = {}
        self.replicas: dict[str, Replica] = {}
        # Per journal, its resolution at a revision (cleared with each new State): each append resolves its
        # journal, and a Route, a Header and their comparisons built anew each time were ~15% of a primary's
        # CPU per small append. Shared by the Resolutions given out: nobody mutates a Header or Route.
        self._resolved: dict[str, tuple[int, Resolution]] = {}
        self.state = State.from_keyspace(keyspace)
        self._closing: dict[str, asyncio.Task[None]] = {}  # replicas closing, by journal
        self._closed = False
        keyspace.add_observer(self._on_keyspace_update)
        self._on_keyspace_update()

    def _on_keyspace_update(self) -> None:
        """Atomically with a KeySpace update: rebuild State and reconcile local replicas."""
        if self._closed:
            return
        old = self.state
        self.state = state = State.from_keyspace(self.keyspace)
        self._resolved.clear()
        mine = {a.journal for a in state.assignments_of(self.process_id.zone, self.process_id.suffix)}
        for journal in mine:
            item = state.items.get(journal)
            if item is None:
                continue
            replica = self.replicas.get(journal)
            if replica is None:
                replica = self.new_replica(journal, item.spec, item.create_revision)
                self.replicas[journal] = replica
                replica.start(self.pulse, after=self._closing.get(journal))  # never two on one spool dir
                log.info("journal %s: replica created", journal)
            elif item.spec != replica.spec or not routes_equivalent(old.route(journal), state.route(journal)):
                replica.update(item.spec)
        for journal in [j for j in self._covered if j not in state.items]:
            del self._covered[journal]
        for journal in list(self.replicas):
            if journal not in mine or journal not in state.items:
                replica = self.replicas.pop(journal)
                deleted = journal not in state.items
                task = asyncio.get_running_loop().create_task(
                    _close_after(self._closing.get(journal), replica, deleted), name=f"close:{journal}"
                )
                self._closing[journal] = task
                task.add_done_callback(functools.partial(self._replica_closed, journal))
                log.info("journal %s: replica removed", journal)

    def _replica_closed(self, journal: str, task: asyncio.Task[None]) -> None:
        if self._closing.get(journal) is task:
            del self._closing[journal]

    def header(self, route: pb.Route) -> pb.Header:
        return pb.Header(
            process_id=self.process_id,
            route=route,
            etcd=pb.Header.Etcd(revision=self.keyspace.revision),
        )

    async def resolve(self, journal: str, min_revision: int = 0, claims: Claims | None = None) -> Resolution:
        """Resolve `journal` once the KeySpace has reached `min_revision` (bounded wait), as the holder of
        `claims` may see it (None: the broker's own calls, which see everything)."""
        if min_revision > self.keyspace.revision:
            with contextlib.suppress(TimeoutError):
                await self.keyspace.wait_for_revision(min_revision, timeout=READ_THROUGH_TIMEOUT)
        state = self.state
        item = state.items.get(journal)
        if item is not None and claims is not None and not self.covers(claims, journal, item.spec):
            self.hid(journal)
            item = None  # (exactly as if it did not exist)
        if item is None:
            return Resolution(pb.JOURNAL_NOT_FOUND, self.header(pb.Route(primary=-1)))
        revision = self.keyspace.revision
        cached = self._resolved.get(journal)
        if cached is None or cached[0] != revision:
            route = state.route(journal)
            status = pb.SUSPENDED if item.spec.suspend.level == pb.JournalSpec.Suspend.FULL else pb.OK
            assigned = tuple(state.assignments.get(journal, ()))
            advertised = bool(assigned) and all(routes_equivalent(a.value, route) for a in assigned)
            cached = (revision, Resolution(status, self.header(route), item.spec, None, assigned, advertised))
            self._resolved[journal] = cached
        return dataclasses.replace(cached[1], replica=self.replicas.get(journal))

    def covers(self, claims: Claims, journal: str, spec: pb.JournalSpec) -> bool:
        """Whether `claims` reach the journal with `spec` (its labels and meta-labels)."""
        sel = claims.sel
        if not sel.include.labels and not sel.exclude.labels:
            return True  # (no selector: everything; auth off, a broker's own calls, most tokens)
        last = self._covered.get(journal)
        if last is not None and last[0] is spec and last[1] is claims:
            return last[2]
        covered = covers(claims, journal_labels(journal, spec.labels))
        self._covered[journal] = (spec, claims, covered)
        return covered

    async def aclose(self) -> None:
        """Close every replica (their spools complete and go to the persister); ignore later updates."""
        self._closed = True
        replicas, self.replicas = self.replicas, {}
        await asyncio.gather(*(r.aclose() for r in replicas.values()), *self._closing.values(), return_exceptions=True)


async def _close_after(previous: asyncio.Future[None] | None, replica: Replica, deleted: bool) -> None:
    """Close `replica` once the journal's previous replica here has closed: closes of one spool
    directory form a chain, so the next replica, which waits for the last close, waits for them all."""
    if previous is not None:
        await asyncio.wait([previous])
    await replica.aclose(deleted)
