"""Member, Item, Assignment: the allocator's keys as read from a KeySpace, each with its decoded value
and the revisions that guard changes to it (Gazette's allocator/decoded.go). Plain records, below
the `kind` that decodes and judges their values and the `state` that gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Assignment", "Item", "Member", "MemberId"]

MemberId = tuple[str, str]  # (zone, suffix)


@dataclass(frozen=True, slots=True, eq=False)
class Member:
    """A live broker: its leased member key and spec.

    ``create_revision`` orders leadership (the oldest key leads); ``mod_revision`` changes with
    every rewrite of the spec and guards the leader's transactions and additions to this member;
    ``lease`` is the member's etcd lease (0 if the key was written without one), under which its
    assignments are created.
    """

    spec: Any  # a BrokerSpec (or a ConsumerSpec): its `id` and `endpoint` make Routes
    create_revision: int
    key: str
    mod_revision: int = 0
    lease: int = 0

    @property
    def id(self) -> MemberId:
        return (self.spec.id.zone, self.spec.id.suffix)


@dataclass(frozen=True, slots=True, eq=False)
class Item:
    """An allocator item: a journal's spec (or a shard's, see `allocator.kind`), by its key's name."""

    spec: Any
    mod_revision: int
    create_revision: int
    name: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class Assignment:
    """A journal assigned to a member at a slot (0 = primary); ``value`` is its last synced Route.

    ``lease`` is the etcd lease the key lives under: its member's, so it goes with the member key
    (0 for a key written without one, which outlives its member until the leader deletes it).
    """

    journal: str
    zone: str
    suffix: str
    slot: int
    value: Any  # the Route last synchronized (for a shard, its ReplicaStatus)
    key: str
    mod_revision: int
    lease: int = 0
    create_revision: int = 0  # (a guard for writes that must stop once this assignment goes)

    @property
    def member(self) -> MemberId:
        return (self.zone, self.suffix)
