"""allocator: members, items and assignments in etcd, leader election, the solver, converge.

Brokers coordinate through a distributed allocator to keep journal assignments up to date
(gazette-transactional-appends.txt, *Components*). Each broker announces itself with a leased
member key (``announce``); journals are items; an assignment key places a journal on a member at a
slot, slot 0 being the primary, and its value is the Route the primary last synchronized. The
member with the oldest key leads: its ``Allocator`` runs the pure ``solver`` on every KeySpace
change and applies the difference in guarded etcd transactions (``converge``).

Guarantee (Invariant 5): an assignment is never removed while its journal's Route is not
consistent, or if fewer than R consistent replicas would remain; the allocator over-subscribes
(adds first) and removes later. Assignments live under their member's etcd lease, so a member
whose lease expires takes its assignments with it in the same revision; only assignments of
journals that no longer exist (and lease-less ones of members that are gone) are dropped by the
leader without that check.

One allocator, two uses (``kind``): the same code places consumer shards on consumer processes
under the consumer's own root (``SHARDS``: ShardSpec items wanting a primary and their hot
standbys, ConsumerSpec members, ReplicaStatus assignment values whose STANDBY / PRIMARY codes are
what consistency means there), as it places journals on brokers (``JOURNALS``, the default).
"""

from tidings.allocator.announce import Announcement, MemberConflictError, announce
from tidings.allocator.converge import (
    Allocator,
    AllocatorStats,
    Change,
    advertise_consistency,
    advertise_route,
    plan,
)
from tidings.allocator.decoded import Assignment, Item, Member
from tidings.allocator.keys import AssignKey, assign_key, item_key, member_key, parse_assign_key
from tidings.allocator.kind import JOURNALS, SHARDS, Kind
from tidings.allocator.solver import Current, Slot, SolverItem, SolverMember, solve
from tidings.allocator.state import State, route_of, routes_equivalent

__all__ = [
    "JOURNALS",
    "SHARDS",
    "Allocator",
    "AllocatorStats",
    "Announcement",
    "AssignKey",
    "Assignment",
    "Change",
    "Current",
    "Item",
    "Kind",
    "Member",
    "MemberConflictError",
    "Slot",
    "SolverItem",
    "SolverMember",
    "State",
    "advertise_consistency",
    "advertise_route",
    "announce",
    "assign_key",
    "item_key",
    "member_key",
    "parse_assign_key",
    "plan",
    "route_of",
    "routes_equivalent",
    "solve",
]
