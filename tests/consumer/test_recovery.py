"""A shard's recovery on a process (consumer/recovery.py), against real etcd and brokers: a standby plays
the log and tails it; promoted, it hands the log off and records on, and a zombie's store commits
nothing more (DESIGN.md invariant 10); hints rotated after the restore make the next playback read
only the live part; a missing or mislabelled log fails the shard naming the journal and the fix; an etcd
out of reach while the hints are read is waited out, not a failure."""

from __future__ import annotations

import asyncio

import pytest

from tests.consumer._support import COUNTS, add
from tests.support.stores import checkpoint
from tests.support.tcp_gate import TcpGate
from tests.support.waiting import wait_until
from tidings.consumer import FenceError
from tidings.consumer.recovery import CONTENT_TYPE, Recovery, RecoveryError
from tidings.consumer.store_recorded import RecordedSQLiteStore
from tidings.keyspace.etcd import Etcd, create_revision_is
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict

SPEC = shard_from_dict({"id": "wc/0", "sources": ["in/words"], "recovery_log_prefix": "recovery", "hint_backups": 2})


async def primary_of(recovery: Recovery) -> RecordedSQLiteStore:
    return RecordedSQLiteStore(await recovery.complete(), recovery.dir, schema=[COUNTS])


async def test_a_standby_tails_and_takes_over_from_a_fenced_primary(cluster, etcd_client, etcd_root, tmp_path):
    await cluster.create_journal("recovery/wc/0", 3, labels={"content-type": CONTENT_TYPE})
    guard_key = f"{etcd_root}/assign/wc/0"
    guard = create_revision_is(guard_key, await etcd_client.put(guard_key, b""))
    async with cluster.client() as c:
        first = Recovery(c, etcd_client, SPEC, tmp_path / "first", f"{etcd_root}.hints")
        a = await primary_of(first)
        await a.restore_checkpoint("wc/0")
        await first.store_recovered(guard)
        await add(a, "one")
        await a.start_commit("wc/0", checkpoint(1))

        standby = Recovery(c, etcd_client, SPEC, tmp_path / "standby", f"{etcd_root}.hints")
        standby.start()
        await asyncio.wait_for(standby.tailing.wait(), 30)
        await add(a, "two")
        await a.start_commit("wc/0", checkpoint(2))
        player = standby.player
        assert player is not None
        recorded = a.recorder.statistics().ops + 1  # (and first's handoff)
        await wait_until(lambda: player.statistics().applied >= recorded, 30)  # it plays what is recorded, live
        b = await primary_of(standby)  # promoted: hands the log off
        assert await b.restore_checkpoint("wc/0") == checkpoint(2)
        assert dict(b.db.execute("SELECT word, n FROM counts").fetchall()) == {"one": 1, "two": 1}
        await standby.store_recovered(guard)
        await add(a, "zombie")
        with pytest.raises(FenceError):
            await a.start_commit("wc/0", checkpoint(3))
        await add(b, "three")
        await b.start_commit("wc/0", checkpoint(3))
        a.destroy()
        b.destroy()

        third = Recovery(c, etcd_client, SPEC, tmp_path / "third", f"{etcd_root}.hints")
        t = await primary_of(third)
        assert await t.restore_checkpoint("wc/0") == checkpoint(3)
        assert dict(t.db.execute("SELECT word, n FROM counts").fetchall()) == {"one": 1, "two": 1, "three": 1}
        t.destroy()
        await first.aclose()
        await standby.aclose()
        await third.aclose()
    assert not (tmp_path / "first").exists() and not (tmp_path / "standby").exists()


@pytest.mark.parametrize("labels", [None, {"content-type": "application/x-ndjson"}])
async def test_a_missing_or_foreign_log_fails_naming_the_journal(cluster, etcd_client, etcd_root, tmp_path, labels):
    if labels is not None:
        await cluster.create_journal("recovery/wc/0", 1, labels=labels)
    async with cluster.client() as c:
        recovery = Recovery(c, etcd_client, SPEC, tmp_path / "r", f"{etcd_root}.hints")
        with pytest.raises(RecoveryError, match=r"'recovery/wc/0'"):
            await recovery.complete()
        assert isinstance(recovery.failed, RecoveryError)
        await recovery.aclose()


def test_a_shard_without_a_log_has_no_recovery(tmp_path) -> None:
    with pytest.raises(ValueError, match="no recovery log"):
        Recovery(None, None, pb.ShardSpec(id="x"), tmp_path, "/h")  # type: ignore[arg-type]


async def test_hints_are_read_again_while_etcd_is_out_of_reach(cluster, etcd, etcd_root, tmp_path, caplog) -> None:
    await cluster.create_journal("recovery/wc/0", 3, labels={"content-type": CONTENT_TYPE})
    gate = await TcpGate(etcd.endpoint).open()
    through_gate = await Etcd.connect(gate.endpoint)
    try:
        await gate.shut()
        async with cluster.client() as c:
            standby = Recovery(c, through_gate, SPEC, tmp_path / "standby", f"{etcd_root}.hints")
            standby.start()
            await wait_until(lambda: "reading its recovery hints failed" in caplog.text, 30)
            assert standby.task is not None and not standby.task.done()  # (waiting: not failed)
            await gate.open()
            await asyncio.wait_for(standby.tailing.wait(), 60)
            assert standby.failed is None
            await standby.aclose()
    finally:
        await through_gate.aclose()
        await gate.shut()
