"""Recovery hints in etcd (consumer/recoverylog/hints.py), against a real etcd: a new primary's
recovered hints rotate into the backups newest first and become the primary hints; a primary that
lost its assignment writes none; hints of another log, or describing no history, are refused naming
their key; a player takes the primary hints, else the first backup, else plays from the start."""

from __future__ import annotations

import pytest

from tidings.consumer.recoverylog.fsm import HintsError
from tidings.consumer.recoverylog.hints import (
    HintKeys,
    decode,
    encode,
    fetch,
    pick_first,
    store_recorded,
    store_recovered,
)
from tidings.keyspace.etcd import create_revision_is
from tidings.protocol import protocol_pb2 as pb

LOG = "recovery/wc-0"


def hints(last_seq_no: int, log: str = LOG) -> pb.FSMHints:
    seg = pb.Segment(author=7, first_seq_no=1, last_seq_no=last_seq_no, first_offset=0)
    return pb.FSMHints(log=log, live_nodes=[pb.FnodeSegments(fnode=1, segments=[seg])])


async def test_recovered_hints_rotate_into_the_backups_newest_first(etcd_client, etcd_root) -> None:
    client = etcd_client
    keys = HintKeys(f"{etcd_root}/hints", "wc/0", backups=2)
    assignment = f"{etcd_root}/assign/wc/0"
    rev = await client.put(assignment, b"primary")
    guard = create_revision_is(assignment, rev)
    assert pick_first(await fetch(client, keys, LOG), LOG) == pb.FSMHints(log=LOG)  # (none yet: the whole log)

    assert await store_recovered(client, keys, hints(1), guard)
    assert await store_recorded(client, keys, hints(2), guard)
    got = await fetch(client, keys, LOG)
    assert (got.primary, got.backups) == (hints(2), [hints(1), None])

    assert await store_recovered(client, keys, hints(3), guard)  # a new primary's
    got = await fetch(client, keys, LOG)
    assert (got.primary, got.backups) == (hints(3), [hints(3), hints(1)])
    assert pick_first(got, LOG) == hints(3)

    await client.delete(keys.primary)  # (lost, say): the first backup plays
    assert pick_first(await fetch(client, keys, LOG), LOG) == hints(3)


async def test_a_primary_that_lost_its_assignment_writes_no_hints(etcd_client, etcd_root) -> None:
    client = etcd_client
    keys = HintKeys(f"{etcd_root}/hints", "wc/0", backups=1)
    assignment = f"{etcd_root}/assign/wc/0"
    old = create_revision_is(assignment, await client.put(assignment, b"primary"))
    await client.delete(assignment)
    await client.put(assignment, b"another process's")  # (re-created: another assignment)
    assert not await store_recorded(client, keys, hints(5), old)
    assert not await store_recovered(client, keys, hints(5), old)
    got = await fetch(client, keys, LOG)
    assert (got.primary, got.backups) == (None, [None])


async def test_hints_are_json_or_binary_and_unusable_ones_name_their_key(etcd_client, etcd_root) -> None:
    client = etcd_client
    keys = HintKeys(f"{etcd_root}/hints", "wc/0", backups=1)
    await client.put(keys.primary, encode(hints(4)))
    await client.put(keys.backup(0), hints(3).SerializeToString())
    got = await fetch(client, keys, LOG)
    assert (got.primary, got.backups) == (hints(4), [hints(3)])
    assert encode(hints(4)).startswith(b"{")

    with pytest.raises(HintsError, match=r"\.primary are of recovery log 'other/log', not the shard's"):
        decode(encode(hints(4, "other/log")), keys.primary, LOG)
    bad = hints(4)
    bad.live_nodes[0].fnode = 2  # (its segment starts at seq_no 1: no such history)
    await client.put(keys.primary, encode(bad))
    got = await fetch(client, keys, LOG)
    assert pick_first(got, LOG) == hints(3)  # (an unusable primary set: the backup plays, with a warning)
    assert "fnode 2" in str(got.errors[keys.primary])
    await client.put(keys.backup(0), b"\x0a\xff garbage")
    with pytest.raises(HintsError, match=r"hints at .*wc/0\.primary are unusable: fnode 2"):
        pick_first(await fetch(client, keys, LOG), LOG)  # (only unusable sets: never the log from its start)
    with pytest.raises(HintsError, match="unusable"):
        decode(b"{not json", keys.primary, LOG)
    with pytest.raises(HintsError, match=r"backup\.0 are unusable"):
        decode(b"\x0a\xff garbage", keys.backup(0), LOG)
