"""A shard replica with a recovery log (consumer/replica.py) through each turn of its life: a
primary-to-be asked to stop while it plays never hands the log off nor serves; a demoted primary
says BACKFILL at once (no ready standby until it has played the log afresh), and one whose log can no
longer be played is FAILED (not left in BACKFILL for ever); a primary-to-be demoted
before it served says how far its playback is (STANDBY once caught up), so the allocator can count
on it; a standby whose shard's log or hints change plays the new ones; a primary fenced off its log
stops quietly when etcd says its assignment went (its successor's handoff: no FAILED standby), and
takes the log back when etcd says it is still its own (a late handoff of a stalled replica).

The test gives the replica its assignments (the allocator's own moves are tests/allocator's); etcd,
brokers, the log and its playback are real."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.consumer.test_service import produce
from tests.support.consumers import FAILED, PRIMARY, STANDBY, RecordedCounts
from tests.support.waiting import wait_until
from tidings.allocator.decoded import Assignment
from tidings.consumer import replica as replica_module
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.ops import new_author
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.replica import ShardReplica
from tidings.consumer.service import Consumer
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict

BACKFILL = pb.ReplicaStatus.BACKFILL
LOG = "wc/log/wc/0"
SPEC = shard_from_dict(
    {"id": "wc/0", "sources": ["wc/in/0"], "max_txn_duration": "200ms", "recovery_log_prefix": "wc/log"}
)


class _Revisions:
    async def wait_for_revision(self, revision: int, timeout: float | None = None) -> None:
        return None


@dataclasses.dataclass
class Host:
    """What a ShardReplica uses of its consumer process: real clients, its own directories."""

    client: Any
    etcd: Any
    app: Any
    recovered_dir: Path
    hint_prefix: str
    config: Any
    keyspace: Any = dataclasses.field(default_factory=_Revisions)


@pytest.fixture
async def host(cluster, etcd_client, etcd_root, tmp_path):
    await cluster.create_journal("wc/in/0", 1)
    await cluster.create_journal("wc/out/0", 1)
    await cluster.create_journal(LOG, 3, labels={"content-type": CONTENT_TYPE})
    async with cluster.client() as c:
        yield Host(
            c, etcd_client, RecordedCounts(), tmp_path / "recovered", f"{etcd_root}.hints",
            SimpleNamespace(data_dir=tmp_path),
        )  # fmt: skip


def assigned(slot: int) -> Assignment:
    """This process's assignment of wc/0 at `slot`. Its key is no one's (mod revision -1): the replica's
    status writes fail their guard and change nothing; `replica.status` is what it says."""
    return Assignment("wc/0", "zone-a", "c0", slot, pb.ReplicaStatus(), "/nowhere/wc/0", -1, 0, 1)


def replica_of(host: Host, predecessor: asyncio.Task[None] | None = None) -> ShardReplica:
    return ShardReplica(cast(Consumer, host), "wc/0", predecessor)


@pytest.fixture
def said(monkeypatch) -> list[int]:
    """Every status a replica sets, in order."""
    codes: list[int] = []
    set_status = ShardReplica._set_status

    def spy(self: ShardReplica, code: Any, error: str = "") -> None:
        codes.append(code)
        set_status(self, code, error)

    monkeypatch.setattr(ShardReplica, "_set_status", spy)
    return codes


async def write_head(host: Host) -> int:
    return await host.client.write_head(LOG)


@pytest.mark.parametrize("how", ["demoted", "closed"])
async def test_a_primary_to_be_stopped_while_it_plays_never_hands_the_log_off(host, said, monkeypatch, how) -> None:
    monkeypatch.setattr(replica_module, "STOP_TIMEOUT", 120.0)  # (it must stop at once, not by timing out)
    reached, gate = asyncio.Event(), asyncio.Event()
    read_to_head = Player._on_read_to_head

    async def held(self: Player) -> Any:  # (playback held just before it reads to the head and hands off)
        reached.set()
        await gate.wait()
        return await read_to_head(self)

    monkeypatch.setattr(Player, "_on_read_to_head", held)
    replica = replica_of(host)
    try:
        replica.update(SPEC, assigned(0))
        await asyncio.wait_for(reached.wait(), 30)
        primary, recovery = replica._primary, replica.recovery
        assert primary is not None and recovery is not None
        closing = asyncio.ensure_future(replica.aclose()) if how == "closed" else None
        if how == "demoted":
            replica.update(SPEC, assigned(1))
        await wait_until(primary.done, 30)  # (without waiting for the playback it no longer needs)
        gate.set()
        if closing is not None:
            await closing
        assert recovery.task is not None and recovery.task.cancelled()
        assert not recovery.dir.exists()
        if how == "demoted":  # (it plays the log afresh, a standby)
            await wait_until(lambda: replica.status.code == STANDBY, 30)
        assert await write_head(host) == 0  # no handoff landed
        assert PRIMARY not in said
        assert replica.shard is None or replica.shard.recorder is None
    finally:
        await replica.aclose()


async def test_a_demoted_primary_whose_log_is_gone_is_failed_naming_it(host, said) -> None:
    replica = replica_of(host)
    try:
        replica.update(SPEC, assigned(0))
        await wait_until(lambda: replica.status.code == PRIMARY, 30)
        revision = {j.spec.name: j.mod_revision for j in (await host.client.list()).journals}[LOG]
        await host.client.apply([pb.ApplyRequest.Change(delete=LOG, expect_mod_revision=revision)])
        replica.update(SPEC, assigned(1))  # demoted: it must play the log afresh, which is gone
        await wait_until(lambda: replica.status.code == FAILED, 30)
        assert LOG in replica.status.errors[0] and "does not exist" in replica.status.errors[0]
        assert said[-2:] == [BACKFILL, FAILED]
    finally:
        await replica.aclose()


async def test_a_primary_to_be_demoted_before_it_served_says_how_far_it_played(host, said) -> None:
    previous = asyncio.Event()  # (this shard's earlier replica here, still closing: the primary waits for it)
    predecessor = asyncio.ensure_future(previous.wait())
    replica = replica_of(host, cast(asyncio.Task[None], predecessor))
    try:
        replica.update(SPEC, assigned(0))
        recovery = replica.recovery
        assert recovery is not None
        await asyncio.wait_for(recovery.tailing.wait(), 30)
        assert replica.status.code == BACKFILL  # (caught up, but to be primary: no standby to count on)
        replica.update(SPEC, assigned(1))
        previous.set()
        await wait_until(lambda: replica.status.code == STANDBY, 30)
        assert replica.recovery is recovery  # (its playback kept: it never handed the log off)
        assert PRIMARY not in said and await write_head(host) == 0
    finally:
        await replica.aclose()


@pytest.mark.parametrize("change", ["log", "hints"])
async def test_a_standby_plays_the_shards_new_log_or_hints(host, cluster, etcd_root, change) -> None:
    replica = replica_of(host)
    try:
        replica.update(SPEC, assigned(1))
        await wait_until(lambda: replica.status.code == STANDBY, 30)
        first = replica.recovery
        assert first is not None
        spec = pb.ShardSpec()
        spec.CopyFrom(SPEC)
        if change == "log":
            await cluster.create_journal("wc/log2/wc/0", 3, labels={"content-type": CONTENT_TYPE})
            spec.recovery_log_prefix = "wc/log2"
        else:
            spec.hint_prefix = f"{etcd_root}.other-hints"
        replica.update(spec, assigned(1))
        now = replica.recovery
        assert now is not None and now is not first
        assert now.log == ("wc/log2/wc/0" if change == "log" else LOG)
        assert now.keys.prefix == (spec.hint_prefix or host.hint_prefix)
        await wait_until(lambda: first.task is not None and first.task.done() and not first.dir.exists(), 30)
        await asyncio.wait_for(now.tailing.wait(), 30)
        await wait_until(lambda: replica.status.code == STANDBY, 30)
    finally:
        await replica.aclose()


async def test_a_demoted_primary_says_backfill_at_once_until_it_played_afresh(host, said) -> None:
    replica = replica_of(host)
    try:
        replica.update(SPEC, assigned(0))
        await wait_until(lambda: replica.status.code == PRIMARY, 30)
        replica.update(SPEC, assigned(1))
        assert replica.status.code == BACKFILL  # (not PRIMARY while it stops: the allocator counts on no one)
        await wait_until(lambda: replica.status.code == STANDBY, 30)
        assert said[said.index(PRIMARY) + 1 :] == [BACKFILL, BACKFILL, STANDBY]  # (and its fresh playback's)
    finally:
        await replica.aclose()


@pytest.mark.parametrize("still_assigned", [False, True])
async def test_a_primary_fenced_off_its_log_stops_or_takes_it_back(
    host, said, cluster, etcd_client, etcd_root, tmp_path, caplog, still_assigned
) -> None:
    caplog.set_level(logging.INFO, logger="tidings.consumer.replica")
    key = f"{etcd_root}-assignments/wc/0"  # (this test's own: outside the brokers' root)
    revision = await etcd_client.put(key, b"")
    if not still_assigned:
        await etcd_client.delete(key)  # (its successor's promotion deleted it; this process has not seen it yet)
    replica = replica_of(host)
    try:
        replica.update(SPEC, Assignment("wc/0", "zone-a", "c0", 0, pb.ReplicaStatus(), key, -1, 0, revision))
        await wait_until(lambda: replica.status.code == PRIMARY, 30)
        first = replica._primary
        other = Player(host.client, pb.FSMHints(log=LOG), tmp_path / "other")  # (a handoff the log cannot tell apart)
        other.inject_handoff(new_author())
        await other.play()
        await produce(cluster, "wc/in/0", ["apple"])  # (the primary's next commit is fenced)
        assert first is not None
        await wait_until(first.done, 30)
        if still_assigned:
            await wait_until(lambda: "taking its log over again" in caplog.text, 30)
            await wait_until(lambda: replica._primary is not first and replica.status.code == PRIMARY, 30)
            await wait_until(lambda: replica.shard is not None and replica.shard.read_through.get("wc/in/0", 0) > 0, 30)
        else:
            assert "fenced off its recovery log by its successor" in caplog.text
            assert FAILED not in said and replica.status.code == PRIMARY  # (until the update demoting it says)
    finally:
        await replica.aclose()
