"""The assignment solver: pure, no I/O; desired (member, slot) assignments for every item.

Algorithm. Assignments on members that are gone (their leased key expired), duplicates of a
member within an item, and assignments of items that no longer exist are dropped outright.
Each remaining assignment is *desired* or *undesired*: undesired if its member is exiting or has
``journal_limit`` 0, if it is one of an over-full member's extras (highest slot first, so
primaries go last), or if the item has more than R desired replicas (trimming non-primaries
first, from the most represented zone, then the most loaded member). Undesired assignments
are removed only while the item's Route is consistent and at least R consistent assignments
remain afterwards (Invariant 5); otherwise they stay, and the item is over-subscribed until its
primary synchronizes the new Route. Items with fewer than R desired replicas then get new ones,
always allowed: among non-exiting members with spare capacity that do not already hold the item,
a zone the item does not cover first, then the least loaded member, then the member id. When an
item's desired replicas cover fewer than R zones and another zone has a candidate, one extra
replica is added there (R+1), so that a later round, once the Route is consistent again, trims
the over-represented zone. Slot 0 (primary) stays with its member unless that assignment is
removed; an item left without slot 0 promotes its surviving assignment with the lowest slot,
consistent ones first; new assignments take slots after the largest one. Items are handled in
name order and members' loads are updated as the solver goes, so the result is deterministic
and spreads load; nothing that is allowed to stay is moved, keeping churn low.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Current", "Slot", "SolverItem", "SolverMember", "solve"]

MemberId = tuple[str, str]  # (zone, suffix)


@dataclass(frozen=True, slots=True)
class SolverMember:
    """A live member: at most ``journal_limit`` assignments; ``exiting`` members shed them all."""

    id: MemberId
    journal_limit: int
    exiting: bool = False

    @property
    def zone(self) -> str:
        return self.id[0]


@dataclass(frozen=True, slots=True)
class SolverItem:
    """An item wanting ``replication`` replicas; ``consistent``: its current Route is consistent."""

    name: str
    replication: int
    consistent: bool = True


@dataclass(frozen=True, slots=True)
class Current:
    """A current assignment; ``consistent``: its value is equivalent to the item's current Route."""

    member: MemberId
    slot: int
    consistent: bool = True


class Slot(NamedTuple):
    """A desired assignment."""

    member: MemberId
    slot: int


def solve(
    members: Iterable[SolverMember],
    items: Iterable[SolverItem],
    current: Mapping[str, Sequence[Current]],
) -> dict[str, list[Slot]]:
    """The desired assignments of every item (sorted by slot); items absent here have none."""
    by_id = {m.id: m for m in members}
    ordered = sorted(items, key=lambda it: it.name)

    # Live assignments: on present members, one per member (the lowest slot), by slot.
    live: dict[str, list[Current]] = {}
    for item in ordered:
        seen: set[MemberId] = set()
        kept: list[Current] = []
        for a in sorted(current.get(item.name, ()), key=lambda a: (a.slot, a.member)):
            if a.member in by_id and a.member not in seen:
                seen.add(a.member)
                kept.append(a)
        live[item.name] = kept
    load: Counter[MemberId] = Counter(a.member for assigned in live.values() for a in assigned)

    # Member-level undesired: exiting, no capacity, or an over-full member's extras.
    undesired: set[tuple[str, MemberId]] = set()
    on_member: dict[MemberId, list[tuple[str, Current]]] = {}
    for name, assigned in live.items():
        for a in assigned:
            on_member.setdefault(a.member, []).append((name, a))
    for mid, held in on_member.items():
        m = by_id[mid]
        if m.exiting or m.journal_limit <= 0:
            undesired.update((name, mid) for name, _ in held)
        elif len(held) > m.journal_limit:
            held_desc = sorted(held, key=lambda na: (na[1].slot, na[0]), reverse=True)
            undesired.update((name, mid) for name, _ in held_desc[: len(held) - m.journal_limit])

    def leaving(mid: MemberId) -> bool:
        m = by_id[mid]
        return m.exiting or m.journal_limit <= 0

    # Item-level: trim desired replicas over R, then remove undesired ones where allowed.
    desired: dict[str, list[Current]] = {}
    kept_by_item: dict[str, list[Current]] = {}
    for item in ordered:
        assigned = live[item.name]
        good = [a for a in assigned if (item.name, a.member) not in undesired]
        if len(good) > item.replication:
            zones = Counter(a.member[0] for a in good)
            trim = sorted(
                good,
                key=lambda a: (a.slot == 0, -zones[a.member[0]], -load[a.member], -a.slot, a.member),
            )[: len(good) - item.replication]
            undesired.update((item.name, a.member) for a in trim)
            good = [a for a in good if a not in trim]
        desired[item.name] = good

        kept = list(assigned)
        if item.consistent:
            remaining = sum(a.consistent for a in assigned)
            zones = Counter(a.member[0] for a in assigned)
            candidates = sorted(
                (a for a in assigned if (item.name, a.member) in undesired),
                key=lambda a: (not leaving(a.member), -zones[a.member[0]], -load[a.member], -a.slot, a.member),
            )
            for a in candidates:
                if remaining - a.consistent >= item.replication:
                    remaining -= a.consistent
                    kept.remove(a)
                    load[a.member] -= 1
        kept_by_item[item.name] = kept

    # Adds, then zone spread, on members with spare capacity.
    spare = [m for m in by_id.values() if not m.exiting and m.journal_limit > 0]
    out: dict[str, list[Slot]] = {}
    for item in ordered:
        kept = kept_by_item[item.name]
        holders = {a.member for a in kept}
        zones_covered = {a.member[0] for a in desired[item.name]}
        adds: list[MemberId] = []

        def pick(
            uncovered_only: bool, holders: set[MemberId] = holders, zones_covered: set[str] = zones_covered
        ) -> MemberId | None:
            options = [
                m
                for m in spare
                if m.id not in holders
                and load[m.id] < m.journal_limit
                and (not uncovered_only or m.zone not in zones_covered)
            ]
            if not options:
                return None
            return min(options, key=lambda m: (m.zone in zones_covered, load[m.id], m.id)).id

        for _ in range(item.replication - len(desired[item.name])):
            mid = pick(False)
            if mid is None:
                break
            adds.append(mid)
            holders.add(mid)
            zones_covered.add(mid[0])
            load[mid] += 1
        if item.replication >= 2 and len(zones_covered) < item.replication:
            mid = pick(True)
            if mid is not None:
                adds.append(mid)
                load[mid] += 1

        out[item.name] = _slots(kept, adds)
    return out


def _slots(kept: list[Current], adds: list[MemberId]) -> list[Slot]:
    """Keep slots, promote a primary if slot 0 is gone, and number new assignments after the largest."""
    slots = {a.member: a.slot for a in kept}
    if kept and 0 not in slots.values():
        heir = min(kept, key=lambda a: (not a.consistent, a.slot, a.member))
        slots[heir.member] = 0
    next_slot = max(slots.values(), default=-1) + 1
    for mid in adds:
        slots[mid] = next_slot
        next_slot += 1
    return sorted((Slot(mid, slot) for mid, slot in slots.items()), key=lambda s: s.slot)
