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
and spreads load.

Balance (Gazette's allocator balances through its flow network; we move explicitly, and gently).
Only when every item has settled (consistent Route, at most R replicas) and no member is leaving
or over-full, up to ``BALANCE_MOVES`` journals change hands in a round:
- a replica moves from a member holding at least two more than another to that one, keeping zone
  spread: it is marked undesired, so the item gets its new replica there first (R+1) and loses the
  old one once the new Route is consistent (the trim prefers the most loaded holder, even a
  primary when another holder is less loaded: a new member thus receives journals);
- then primaries spread: along the shortest chain of settled journals, each journal's primary
  swaps slots with one of its replicas, taking one primary from a member leading at least two
  more than another to that one (after a rolling restart, primaries sit on the brokers that
  stayed up; this spreads them again). A swap is a Route change like any other: the new primary
  synchronizes its pipeline before it takes appends.
Each move lowers the spread of loads, so rounds reach a fixed point.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["BALANCE_MOVES", "Current", "Slot", "SolverItem", "SolverMember", "solve"]

MemberId = tuple[str, str]  # (zone, suffix)

BALANCE_MOVES = 4
"""Balancing moves (a replica to a less loaded member, or a primary to a member leading fewer)
begun at once; the next ones begin when every item has settled (a consistent Route, at most R
replicas), so a rebalance never has more than these few journals changing hands."""


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

    live = _live(ordered, current, by_id)
    load: Counter[MemberId] = Counter(a.member for assigned in live.values() for a in assigned)
    undesired, on_member = _member_undesired(live, by_id)

    def leaving(mid: MemberId) -> bool:
        m = by_id[mid]
        return m.exiting or m.journal_limit <= 0

    # Balance, gently: once every item has settled, move a few replicas from the most to the least loaded members.
    active = sorted((m for m in by_id.values() if not leaving(m.id)), key=lambda m: m.id)
    settled = all(it.consistent and len(live[it.name]) <= it.replication for it in ordered)
    budget = BALANCE_MOVES if settled and not undesired else 0
    preferred: dict[str, MemberId] = {}  # item -> the member its next replica goes to
    projected = Counter(load)
    while len(preferred) < budget:
        move = _balance_move(active, on_member, live, {it.name: it for it in ordered}, projected, preferred)
        if move is None:
            break
        name, src, dst = move
        undesired.add((name, src))
        preferred[name] = dst
        projected[src] -= 1
        projected[dst] += 1

    # Item-level: trim desired replicas over R, then remove undesired ones where allowed.
    desired: dict[str, list[Current]] = {}
    kept_by_item: dict[str, list[Current]] = {}
    for item in ordered:
        assigned = live[item.name]
        good = [a for a in assigned if (item.name, a.member) not in undesired]
        if len(good) > item.replication:
            zones = Counter(a.member[0] for a in good)
            # The primary stays, unless one replica is extra and its member holds more than another
            # holder's (a balancing move: a lone primary moved through over-subscription).
            one_extra, least = len(good) == item.replication + 1, min(load[a.member] for a in good)
            trim = sorted(
                good,
                key=lambda a: (
                    a.slot == 0 and not (one_extra and load[a.member] > least),
                    -zones[a.member[0]],
                    -load[a.member],
                    -a.slot,
                    a.member,
                ),
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
        adds = _adds(item, kept, desired[item.name], spare, load, preferred.get(item.name))
        out[item.name] = _slots(kept, adds)

    # Primaries spread (same budget): swap primaries along a chain of journals, from a member leading
    # at least two more than another to that one (each journal's primary to one of its replicas).
    # Only of items settled and left as they are (a dead member's assignment being dropped is a change too).
    if budget > len(preferred):
        unchanged = [
            it.name
            for it in ordered
            if it.consistent
            and all(a.consistent for a in current.get(it.name, ()))
            and sorted(out[it.name]) == sorted(Slot(a.member, a.slot) for a in current.get(it.name, ()))
        ]
        _spread_primaries(out, unchanged, {m.id for m in active}, budget - len(preferred))
    return out


def _live(
    ordered: list[SolverItem], current: Mapping[str, Sequence[Current]], by_id: Mapping[MemberId, SolverMember]
) -> dict[str, list[Current]]:
    """Live assignments: on present members, one per member (the lowest slot), by slot."""
    live: dict[str, list[Current]] = {}
    for item in ordered:
        seen: set[MemberId] = set()
        kept: list[Current] = []
        for a in sorted(current.get(item.name, ()), key=lambda a: (a.slot, a.member)):
            if a.member in by_id and a.member not in seen:
                seen.add(a.member)
                kept.append(a)
        live[item.name] = kept
    return live


def _member_undesired(
    live: dict[str, list[Current]], by_id: Mapping[MemberId, SolverMember]
) -> tuple[set[tuple[str, MemberId]], dict[MemberId, list[tuple[str, Current]]]]:
    """Member-level undesired (item, member) pairs: an exiting member's, one without capacity, or an
    over-full member's extras; and what each member holds."""
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
    return undesired, on_member


def _adds(
    item: SolverItem,
    kept: list[Current],
    desired: list[Current],
    spare: list[SolverMember],
    load: Counter[MemberId],
    best: MemberId | None,
) -> list[MemberId]:
    """Members to add the item on, up to its replication, then one more for a zone it lacks; `load`
    counts them. `best`: the balancing move's choice, taken when it can."""
    holders = {a.member for a in kept}
    zones_covered = {a.member[0] for a in desired}
    adds: list[MemberId] = []

    def pick(uncovered_only: bool) -> MemberId | None:
        options = [
            m
            for m in spare
            if m.id not in holders
            and load[m.id] < m.journal_limit
            and (not uncovered_only or m.zone not in zones_covered)
        ]
        if not options:
            return None
        if best is not None and any(m.id == best for m in options):
            return best
        return min(options, key=lambda m: (m.zone in zones_covered, load[m.id], m.id)).id

    for _ in range(item.replication - len(desired)):
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
    return adds


def _spread_primaries(out: dict[str, list[Slot]], names: list[str], active: set[MemberId], budget: int) -> None:
    """Swap primaries of journals `names` (their slots unchanged this round) in `out`, at most `budget`."""
    primaries = Counter(slots[0].member for slots in out.values() if slots)
    swapped: set[str] = set()
    while budget > 0:
        edges: dict[MemberId, list[tuple[str, Slot]]] = {}  # a primary -> (journal, a replica that could lead it)
        for name in names:
            slots = out[name]
            if name not in swapped and slots:
                edges.setdefault(slots[0].member, []).extend((name, sl) for sl in slots[1:] if sl.member in active)
        path = _primary_path(sorted(active), primaries, edges)
        if path is None or len(path) > budget:
            return
        for name, heir in path:
            slots = out[name]
            lead = slots[0]
            rest = [sl for sl in slots[1:] if sl != heir]
            out[name] = sorted([Slot(heir.member, 0), Slot(lead.member, heir.slot), *rest], key=lambda sl: sl.slot)
            primaries[lead.member] -= 1
            primaries[heir.member] += 1
            swapped.add(name)
        budget -= len(path)


def _primary_path(
    members: list[MemberId], primaries: Counter[MemberId], edges: dict[MemberId, list[tuple[str, Slot]]]
) -> list[tuple[str, Slot]] | None:
    """The shortest chain of swaps taking one primary from a member to one leading at least two fewer
    (members in between lead as many as before), from the member leading most; None if there is none."""
    for src in sorted(members, key=lambda mid: (-primaries[mid], mid)):
        paths: dict[MemberId, list[tuple[str, Slot]]] = {src: []}
        queue = [src]
        for at in queue:
            for name, heir in edges.get(at, []):
                if heir.member in paths:
                    continue
                path = [*paths[at], (name, heir)]
                if primaries[heir.member] <= primaries[src] - 2:
                    return path
                paths[heir.member] = path
                queue.append(heir.member)
    return None


def _balance_move(
    active: list[SolverMember],
    on_member: dict[MemberId, list[tuple[str, Current]]],
    live: dict[str, list[Current]],
    items: dict[str, SolverItem],
    load: Counter[MemberId],
    moving: dict[str, MemberId],
) -> tuple[str, MemberId, MemberId] | None:
    """A replica to move from a member to one holding at least two fewer: (item, from, to), or None.

    Only a settled item's replica moves (its Route consistent, exactly R replicas, not already
    moving), a non-primary first (a primary goes only once its successor is synchronized), to a
    member with spare capacity that does not hold the item and keeps its zone spread (same zone
    as the one it leaves, or a zone the item's other replicas do not cover).
    """
    ascending = sorted(active, key=lambda m: (load[m.id], m.id))
    for src in reversed(ascending):
        movable = None  # its settled items, non-primaries first (sorted once per member, not per pair)
        for dst in ascending:
            if load[src.id] - load[dst.id] < 2:
                break
            if load[dst.id] >= dst.journal_limit:
                continue
            if movable is None:
                movable = [
                    name
                    for name, _a in sorted(on_member.get(src.id, []), key=lambda na: (na[1].slot == 0, na[0]))
                    if name not in moving and _settled(items.get(name), live.get(name, []))
                ]
            for name in movable:
                held = live[name]
                others = {h.member for h in held if h.member != src.id}
                if dst.id in others:
                    continue
                if dst.zone != src.zone and dst.zone in {z for z, _ in others}:
                    continue
                return name, src.id, dst.id
    return None


def _settled(item: SolverItem | None, held: list[Current]) -> bool:
    """Its Route consistent, with exactly R replicas: an item a balancing move may take."""
    return item is not None and len(held) == item.replication and item.consistent and all(h.consistent for h in held)


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
