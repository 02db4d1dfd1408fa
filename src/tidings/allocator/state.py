"""State: the allocator's typed view of a KeySpace at one revision (members, items, assignments).

Cheap to build (one pass over the mirrored keys), so it is rebuilt on every change rather than
maintained incrementally. Routes are derived here: a journal's Route is the set of its
assignments' members sorted by (zone, suffix), with the slot-0 member as primary; a journal is
*consistent* when every assignment's value (the Route its primary last synchronized) is
equivalent to that Route, which is how brokers advertise consistency to the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidings.allocator import keys
from tidings.allocator.decoded import Assignment, Item, Member, MemberId
from tidings.allocator.kind import JOURNALS, Kind
from tidings.keyspace import KeySpace, delete_op
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.route import routes_equivalent

__all__ = ["State", "route_of", "routes_equivalent"]


def route_of(assignments: list[Assignment], members: dict[MemberId, Member]) -> pb.Route:
    """The Route of a journal's assignments: members sorted, slot-0 member as primary (-1 if none)."""
    ids = sorted({a.member for a in assignments})
    primary_member = next((a.member for a in assignments if a.slot == 0), None)
    route = pb.Route(primary=ids.index(primary_member) if primary_member is not None else -1)
    for zone, suffix in ids:
        route.members.add(zone=zone, suffix=suffix)
        member = members.get((zone, suffix))
        route.endpoints.append(member.spec.endpoint if member is not None else "")
        route.data_endpoints.append(getattr(member.spec, "replication_endpoint", "") if member is not None else "")
    return route


@dataclass(slots=True)
class State:
    """Members, items and assignments under ``root`` at ``revision``."""

    root: str
    revision: int
    members: dict[MemberId, Member] = field(default_factory=dict)
    items: dict[str, Item] = field(default_factory=dict)
    assignments: dict[str, list[Assignment]] = field(default_factory=dict)  # sorted by slot
    kind: Kind = JOURNALS

    @classmethod
    def from_keyspace(cls, ks: KeySpace, kind: Kind = JOURNALS) -> State:
        """Build from a KeySpace whose decoder decodes `kind`'s values (invalid keys are already skipped)."""
        root = ks.root
        state = cls(root=root, revision=ks.revision, kind=kind)
        for kv in ks.prefixed(keys.members_prefix(root)):
            member = Member(kv.decoded, kv.create_revision, kv.key, kv.mod_revision, kv.lease)
            state.members[member.id] = member
        for kv in ks.prefixed(keys.items_prefix(root)):
            item = Item(kv.decoded, kv.mod_revision, kv.create_revision, keys.parse_item_key(root, kv.key))
            state.items[item.name] = item
        for kv in ks.prefixed(keys.assign_prefix(root)):
            ak = keys.parse_assign_key(root, kv.key)
            state.assignments.setdefault(ak.journal, []).append(
                Assignment(
                    ak.journal,
                    ak.zone,
                    ak.suffix,
                    ak.slot,
                    kv.decoded,
                    kv.key,
                    kv.mod_revision,
                    kv.lease,
                    kv.create_revision,
                )
            )
        for assignments in state.assignments.values():
            assignments.sort(key=lambda a: (a.slot, a.member))
        return state

    def leader(self) -> MemberId | None:
        """The member with the oldest key (smallest create revision): the one that allocates.

        Its transactions are guarded by its key's *mod* revision (``converge``), so a leader whose
        spec changed since its view (e.g. it began exiting) replans before writing.
        """
        if not self.members:
            return None
        return min(self.members.values(), key=lambda m: (m.create_revision, m.id)).id

    def delete_ops(self, root: str, item: str) -> list[Any]:
        """etcd ops deleting `item` and its assignments: an Apply's delete, of a journal or a shard."""
        return [delete_op(keys.item_key(root, item)), *(delete_op(a.key) for a in self.assignments.get(item, []))]

    def route(self, journal: str) -> pb.Route:
        return route_of(self.assignments.get(journal, []), self.members)

    def is_consistent(self, journal: str) -> bool:
        """Every assignment of the item is consistent (`Kind.consistent`): for a journal, it advertises
        a Route equivalent to the current one. An item without assignments is trivially consistent."""
        route, assigned = self.route(journal), self.assignments.get(journal, [])
        return all(self.kind.consistent(a, route, assigned) for a in assigned)

    def assignments_of(self, zone: str, suffix: str) -> list[Assignment]:
        """The member's assignments, by journal then slot."""
        return [
            a
            for journal in sorted(self.assignments)
            for a in self.assignments[journal]
            if a.zone == zone and a.suffix == suffix
        ]
