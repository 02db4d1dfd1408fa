"""Key layout of the allocator under a cluster root (DESIGN.md, *etcd layout*).

::

    {root}/members/{zone}#{suffix}                  leased BrokerSpec (a consumer's: ConsumerSpec)
    {root}/items/{journal}                          JournalSpec (a consumer's: ShardSpec, by shard id)
    {root}/assign/{journal}#{zone}#{suffix}#{slot}  Route last synchronized (a shard's: ReplicaStatus)

Journal names contain '/' but never '#', and zones and suffixes contain neither, so '#' splits
an assignment key unambiguously and ``{journal}#`` prefixes exactly one journal's assignments.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AssignKey",
    "assign_key",
    "assign_prefix",
    "item_key",
    "items_prefix",
    "journal_assign_prefix",
    "member_key",
    "members_prefix",
    "parse_assign_key",
    "parse_item_key",
    "parse_member_key",
]


def _root(root: str) -> str:
    return root.rstrip("/")


def members_prefix(root: str) -> str:
    return f"{_root(root)}/members/"


def items_prefix(root: str) -> str:
    return f"{_root(root)}/items/"


def assign_prefix(root: str) -> str:
    return f"{_root(root)}/assign/"


def journal_assign_prefix(root: str, journal: str) -> str:
    """The prefix of exactly this journal's assignments (the '#' ends the name)."""
    return f"{assign_prefix(root)}{journal}#"


def member_key(root: str, zone: str, suffix: str) -> str:
    return f"{members_prefix(root)}{zone}#{suffix}"


def item_key(root: str, journal: str) -> str:
    return f"{items_prefix(root)}{journal}"


def assign_key(root: str, journal: str, zone: str, suffix: str, slot: int) -> str:
    return f"{assign_prefix(root)}{journal}#{zone}#{suffix}#{slot}"


@dataclass(frozen=True, slots=True)
class AssignKey:
    """The parts of an assignment key."""

    journal: str
    zone: str
    suffix: str
    slot: int

    @property
    def member(self) -> tuple[str, str]:
        return (self.zone, self.suffix)


def _rest(prefix: str, key: str) -> str:
    if not key.startswith(prefix):
        raise ValueError(f"key {key!r} is not under {prefix!r}")
    return key[len(prefix) :]


def parse_assign_key(root: str, key: str) -> AssignKey:
    parts = _rest(assign_prefix(root), key).split("#")
    if len(parts) != 4 or not all(parts) or not parts[3].isdigit():
        raise ValueError(f"assignment key {key!r} must end in {{journal}}#{{zone}}#{{suffix}}#{{slot}}")
    return AssignKey(parts[0], parts[1], parts[2], int(parts[3]))


def parse_member_key(root: str, key: str) -> tuple[str, str]:
    parts = _rest(members_prefix(root), key).split("#")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"member key {key!r} must end in {{zone}}#{{suffix}}")
    return parts[0], parts[1]


def parse_item_key(root: str, key: str) -> str:
    journal = _rest(items_prefix(root), key)
    if not journal:
        raise ValueError(f"item key {key!r} names no journal")
    return journal
