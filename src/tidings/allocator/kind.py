"""Kind: what one use of the allocator places where (Gazette's ItemValue, MemberValue, Decoder and
IsConsistentFn). The allocator is one: `JOURNALS` places journals on brokers, `SHARDS` places
consumer shards on consumer processes, each under its own etcd root with the same key layout
(`allocator.keys`), the same solver and the same guarded transactions.

A kind decodes its three values (a member's spec, an item's spec, an assignment's value), says
how many replicas an item wants now and how many items a member takes, and whether an assignment
is *consistent*: ready for the allocator to remove another replica of its item (Invariant 5).
Journals: the assignment advertises the item's current Route (its primary synchronized it).
Shards: the replica is a STANDBY or the PRIMARY (caught up), or failed while the primary failed too
(Gazette's ShardIsConsistent: swapping a failed replica for another loses nothing).
"""

from __future__ import annotations

from typing import Any, Protocol

from tidings.allocator.decoded import Assignment
from tidings.keyspace import decode
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.specs import desired_replication
from tidings.protocol.status import ValidationError

__all__ = ["JOURNALS", "SHARDS", "Journals", "Kind", "Shards"]


class Kind(Protocol):
    """One use of the allocator (see the module docstring)."""

    item: str  # what an item is called in messages: "journal", "shard"
    member: str  # and a member: "broker", "consumer"

    def decode_member(self, rest: str, raw: bytes) -> Any: ...
    def decode_item(self, rest: str, raw: bytes) -> Any: ...
    def decode_assignment(self, rest: str, raw: bytes) -> Any: ...
    def item_name(self, spec: Any) -> str: ...
    def desired_replication(self, spec: Any) -> int: ...
    def item_limit(self, member: Any) -> int: ...
    def exiting(self, member: Any) -> bool: ...
    def consistent(self, assignment: Assignment, route: pb.Route, assigned: list[Assignment]) -> bool: ...


class Journals:
    """Journals on brokers: BrokerSpec members, JournalSpec items, Route assignment values."""

    item = "journal"
    member = "broker"

    def decode_member(self, rest: str, raw: bytes) -> pb.BrokerSpec:
        return decode.decode_member(rest, raw)

    def decode_item(self, rest: str, raw: bytes) -> pb.JournalSpec:
        return decode.decode_item(rest, raw)

    def decode_assignment(self, rest: str, raw: bytes) -> pb.Route:
        return decode.decode_assignment(rest, raw)

    def item_name(self, spec: pb.JournalSpec) -> str:
        return spec.name

    def desired_replication(self, spec: pb.JournalSpec) -> int:
        return desired_replication(spec)

    def item_limit(self, member: pb.BrokerSpec) -> int:
        return member.journal_limit

    def exiting(self, member: pb.BrokerSpec) -> bool:
        return member.exiting

    def consistent(self, assignment: Assignment, route: pb.Route, assigned: list[Assignment]) -> bool:
        from tidings.protocol.route import routes_equivalent

        return routes_equivalent(assignment.value, route)


class Shards:
    """Consumer shards on consumer processes: ConsumerSpec members, ShardSpec items, ReplicaStatus values."""

    item = "shard"
    member = "consumer"

    def decode_member(self, rest: str, raw: bytes) -> pb.ConsumerSpec:
        spec = decode.decode_member(rest, raw, pb.ConsumerSpec)
        validate.consumer_spec(spec, "member")
        return spec

    def decode_item(self, rest: str, raw: bytes) -> pb.ShardSpec:
        spec = pb.ShardSpec()
        try:
            spec.ParseFromString(raw)
        except Exception as err:
            raise ValueError(f"value is not a valid ShardSpec: {err}") from err
        validate.shard_spec(spec, "item")
        if spec.id != rest:
            raise ValueError(f"shard spec id {spec.id!r} does not match its key {rest!r}")
        return spec

    def decode_assignment(self, rest: str, raw: bytes) -> pb.ReplicaStatus:
        return decode.decode_assignment(rest, raw, pb.ReplicaStatus, validate.shard_id, _replica_status)

    def item_name(self, spec: pb.ShardSpec) -> str:
        return spec.id

    def desired_replication(self, spec: pb.ShardSpec) -> int:
        """A primary and its hot standbys; none when disabled (Gazette's ShardSpec.DesiredReplication)."""
        return 0 if spec.disable else 1 + spec.hot_standbys

    def item_limit(self, member: pb.ConsumerSpec) -> int:
        return member.shard_limit

    def exiting(self, member: pb.ConsumerSpec) -> bool:
        return member.exiting

    def consistent(self, assignment: Assignment, route: pb.Route, assigned: list[Assignment]) -> bool:
        code = assignment.value.code
        if code in (pb.ReplicaStatus.STANDBY, pb.ReplicaStatus.PRIMARY):
            return True  # ready to take over
        if code == pb.ReplicaStatus.FAILED:
            return any(a.slot == 0 and a.value.code == pb.ReplicaStatus.FAILED for a in assigned)
        return False  # IDLE or BACKFILL: starting, or reading the recovery log


def _replica_status(status: pb.ReplicaStatus, ctx: str) -> None:
    if status.code not in pb.ReplicaStatus.Code.values():
        raise ValidationError(f"{ctx}.code", f"{status.code} is not a replica status")


JOURNALS = Journals()
SHARDS = Shards()
