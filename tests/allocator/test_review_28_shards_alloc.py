"""Review 28: a shard with no hot standbys (R = 1) on a consumer that begins exiting: the allocator
adds a successor, keeps the primary while the successor is IDLE or BACKFILL (Invariant 5), and
once the successor is a STANDBY hands the shard over so that the successor holds slot 0: the shard
always has a slot-0 replica, never zero replicas."""

from __future__ import annotations

from tests.allocator.test_allocator_shards import PRIMARY, STANDBY, consumers, shard  # noqa: F401 (a fixture)
from tests.support.waiting import wait_until
from tidings.allocator.keys import item_key
from tidings.protocol import protocol_pb2 as pb


async def test_a_lone_primary_hands_over_only_to_a_ready_successor(consumers) -> None:  # noqa: F811
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
