"""The allocator that places journals on brokers places consumer shards on consumer processes, under the
consumer's own etcd root (`allocator.kind.SHARDS`). A shard gets a primary and its hot standbys; a
replica's ReplicaStatus, written in its assignment value, gates removals as journal consistency does
(DESIGN.md invariant 5): a replica leaves only once its successor is a STANDBY, so a shard never goes
without a primary. Real etcd; the test plays the consumers (writing each replica's status)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from tests.support.waiting import wait_until
from tidings.allocator import Allocator, Announcement, State, announce
from tidings.allocator.keys import item_key
from tidings.allocator.kind import SHARDS
from tidings.keyspace import Etcd, KeySpace, decoder, put_op
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

STANDBY, PRIMARY, IDLE = pb.ReplicaStatus.STANDBY, pb.ReplicaStatus.PRIMARY, pb.ReplicaStatus.IDLE


def shard(sid: str, hot_standbys: int = 1, **fields: object) -> pb.ShardSpec:
    spec = pb.ShardSpec(
        id=sid,
        sources=[pb.ShardSpec.Source(journal="words/in")],
        recovery_log_prefix="recovery/logs",
        max_txn_duration_ms=1000,
        hot_standbys=hot_standbys,
        **fields,  # type: ignore[arg-type]
    )
    validate.shard_spec(spec)
    return spec


@dataclass
class Consumers:
    root: str
    etcd: Etcd
    ks: KeySpace
    members: dict[tuple[str, str], Announcement] = field(default_factory=dict)
    allocators: list[Allocator] = field(default_factory=list)
    removed_while_unready: list[str] = field(default_factory=list)

    async def join(self, zone: str, suffix: str, limit: int = 100) -> None:
        spec = pb.ConsumerSpec(id=pb.ProcessId(zone=zone, suffix=suffix), endpoint=f"{suffix}:1", shard_limit=limit)
        self.members[(zone, suffix)] = await announce(self.etcd, self.root, spec, ttl=5)
        allocator = Allocator(self.etcd, self.ks, self.root, (zone, suffix), SHARDS)
        allocator.start()
        self.allocators.append(allocator)

    def state(self) -> State:
        return State.from_keyspace(self.ks, SHARDS)

    async def report(self, sid: str, codes: dict[tuple[str, str], int]) -> None:
        """Play the consumers: write each named replica's status into its assignment, keeping its lease."""
        for a in self.state().assignments.get(sid, []):
            if a.member in codes:
                await self.etcd.txn([], [put_op(a.key, pb.ReplicaStatus(code=codes[a.member]).SerializeToString(),
                                                ignore_lease=True)])  # fmt: skip


@pytest.fixture
async def consumers(etcd, etcd_root: str) -> AsyncIterator[Consumers]:
    client = await Etcd.connect(etcd.endpoint)
    ks = KeySpace(etcd_root, decoder(etcd_root, SHARDS))
    await ks.start(client)
    c = Consumers(etcd_root, client, ks)
    try:
        yield c
    finally:
        for allocator in c.allocators:
            await allocator.aclose()
        for member in c.members.values():
            await member.aclose()
        await ks.aclose()
        await client.delete_prefix(etcd_root + "/")
        await client.aclose()


async def test_shards_get_a_primary_and_hot_standbys_and_move_only_once_a_successor_is_ready(consumers) -> None:
    c = consumers
    for zone, suffix in (("za", "c1"), ("zb", "c2"), ("zc", "c3")):
        await c.join(zone, suffix)
    for i in range(3):
        await c.etcd.put(item_key(c.root, f"word-count/part-{i}"), shard(f"word-count/part-{i}").SerializeToString())
    await c.etcd.put(item_key(c.root, "word-count/off"), shard("word-count/off", disable=True).SerializeToString())

    def placed() -> bool:
        st = c.state()
        return all(len(st.assignments.get(f"word-count/part-{i}", [])) == 2 for i in range(3))

    await wait_until(placed, 15)
    st = c.state()
    assert "word-count/off" not in st.assignments  # a disabled shard has no replica
    for sid, assigned in st.assignments.items():
        assert [a.slot for a in assigned] == [0, 1] and len({a.zone for a in assigned}) == 2, (sid, assigned)
        assert all(a.value.code == IDLE for a in assigned)  # (nobody has started them)

    # The primary's consumer begins exiting: its shard gets a new replica, but the old one stays
    # while the new one is not ready (IDLE, then BACKFILL), and goes once it is a STANDBY.
    sid = "word-count/part-0"
    primary, standby = (a.member for a in st.assignments[sid])
    await c.report(sid, {primary: PRIMARY, standby: STANDBY})
    leaving = c.members[primary]
    spec = pb.ConsumerSpec()
    spec.CopyFrom(leaving.spec)
    spec.exiting = True
    await leaving.update(spec)

    await wait_until(lambda: len(c.state().assignments[sid]) == 3, 15)
    newcomer = next(a.member for a in c.state().assignments[sid] if a.member not in (primary, standby))
    await c.report(sid, {newcomer: pb.ReplicaStatus.BACKFILL})
    await wait_until(lambda: c.state().assignments[sid][-1].value.code == pb.ReplicaStatus.BACKFILL, 15)
    assert primary in {a.member for a in c.state().assignments[sid]}  # not removed: nobody could take over
    await c.report(sid, {newcomer: STANDBY})

    def handed_over() -> bool:
        assigned = c.state().assignments[sid]
        return {a.member for a in assigned} == {standby, newcomer} and assigned[0].member == standby

    await wait_until(handed_over, 15)  # the standby leads; the newcomer stands by


async def test_a_lone_primary_hands_over_only_to_a_ready_successor(consumers) -> None:
    """A shard with no hot standbys (R = 1) on a consumer that begins exiting: the allocator adds a
    successor, keeps the primary while the successor is IDLE or BACKFILL (DESIGN.md invariant 5), and once
    the successor is a STANDBY hands the shard over so that the successor holds slot 0: the shard always
    has a slot-0 replica, never zero replicas."""
    c = consumers
    seen_without_primary: list[object] = []
    for zone, suffix in (("za", "c1"), ("zb", "c2")):
        await c.join(zone, suffix)
    sid = "solo/part-0"
    await c.etcd.put(item_key(c.root, sid), shard(sid, hot_standbys=0).SerializeToString())
    await wait_until(lambda: len(c.state().assignments.get(sid, [])) == 1, 15)
    (primary,) = (a.member for a in c.state().assignments[sid])
    await c.report(sid, {primary: PRIMARY})
    await wait_until(lambda: c.state().assignments[sid][0].value.code == PRIMARY, 15)

    leaving = c.members[primary]
    spec = pb.ConsumerSpec()
    spec.CopyFrom(leaving.spec)
    spec.exiting = True
    await leaving.update(spec)

    def check() -> list:
        assigned = c.state().assignments.get(sid, [])
        if not any(a.slot == 0 for a in assigned):
            seen_without_primary.append([(a.member, a.slot, a.value.code) for a in assigned])
        return assigned

    await wait_until(lambda: len(check()) == 2, 15)
    newcomer = next(a.member for a in check() if a.member != primary)
    await c.report(sid, {newcomer: pb.ReplicaStatus.BACKFILL})
    await wait_until(lambda: any(a.value.code == pb.ReplicaStatus.BACKFILL for a in check()), 15)
    assert primary in {a.member for a in check()}  # nobody ready to take over yet
    await c.report(sid, {newcomer: STANDBY})

    def handed_over() -> bool:
        assigned = check()
        return [(a.member, a.slot) for a in assigned] == [(newcomer, 0)]

    await wait_until(handed_over, 15)
    assert not seen_without_primary


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"sources": []}, "at least one journal"),
        ({"max_txn_duration_ms": 0}, "max_txn_duration"),
        ({"min_txn_duration_ms": 2000}, "at most max_txn_duration"),
        ({"recovery_log_prefix": ""}, "set recovery_log_prefix"),
        ({"hot_standbys": 9}, "outside 0..8"),
        ({"hint_backups": 17}, "hint_backups: must be 0 to 16"),
        ({"hint_backups": -1}, "hint_backups: must be 0 to 16"),
        ({"id": "a#b"}, "characters outside"),
        ({"labels": pb.LabelSet(labels=[pb.Label(name="id", value="x")])}, "label 'id'"),
    ],
)
def test_invalid_shard_specs_are_refused_in_one_line(fields: dict, says: str) -> None:
    spec = pb.ShardSpec(
        id="s/1",
        sources=[pb.ShardSpec.Source(journal="words/in")],
        recovery_log_prefix="recovery/logs",
        max_txn_duration_ms=1000,
        hot_standbys=1,
    )
    for name, value in fields.items():
        if isinstance(value, list):
            del spec.sources[:]
        elif hasattr(value, "CopyFrom"):
            getattr(spec, name).CopyFrom(value)
        else:
            setattr(spec, name, value)
    with pytest.raises(ValidationError, match=says) as err:
        validate.shard_spec(spec)
    assert "\n" not in str(err.value)
