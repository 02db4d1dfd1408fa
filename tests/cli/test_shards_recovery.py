"""The recovery-log operator surface: GetHints (any consumer process answers from etcd), `tidings shards
hints` (what a player of the log reads), `shards recover` (the log played into a directory, never
appended to, the database one file stdlib sqlite3 opens) and `shards prune` (only fragments no hint set
needs go: afterwards the log still plays from the primary hints and from every backup); and the usual
mistakes answered with one line and exit code 2 (input) or 1 (the shard or its log), no traceback.
Real etcd and brokers; consumers in this process; the commands as child processes."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from prometheus_client import REGISTRY

from tests.cli._support import run
from tests.consumer.test_service import produce, shard
from tests.support.consumers import PRIMARY, STANDBY, WORDS, RecordedCounts, SmallRollovers
from tests.support.waiting import wait_until
from tidings.consumer import replica
from tidings.consumer.client import ShardClient
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.hints import HintKeys, encode, fetch
from tidings.consumer.store_recorded import DATABASE
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import NoRecoveryLogError, ShardNotFoundError

LOG = "wc/log/wc/0"


async def served(cluster, consumers, app=None, log: bool = True, **fields):
    """wc/in/0 and wc/out/0, the recovery log (unless not `log`), and shard wc/0 recorded to it, primary
    on a first consumer (returned)."""
    await cluster.create_journal("wc/in/0", 1)
    await cluster.create_journal("wc/out/0", 1)
    if log:
        await cluster.create_journal(LOG, 1, labels={"content-type": CONTENT_TYPE}, fragment={"length": "8KiB"})
    a = await consumers.add("zone-a", app=app or RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, recovery_log_prefix="wc/log", **fields))])
    if log:
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
    return a


async def synced(consumer) -> None:
    """Until the shard's primary (asked through `consumer`) has committed every word produced."""
    async with ShardClient(consumer.endpoint) as sc:
        await sc.stat("wc/0", {"wc/in/0": await consumer.client.write_head("wc/in/0")})


async def quiescent_hints(consumer) -> pb.FSMHints:
    """The primary's hints once etcd holds what its recorder would write now (no transaction runs)."""
    shard = consumer.replicas["wc/0"].shard
    assert shard is not None and shard.recorder is not None
    keys = HintKeys(consumer.hint_prefix, "wc/0", 0)

    async def stored() -> pb.FSMHints | None:
        expected = await shard.recorder.build_hints()
        held = (await fetch(consumer.etcd, keys, LOG)).primary
        return held if held == expected and held.live_nodes else None

    return await wait_until(stored, 30)


async def shards(consumer, *args: str, broker: str = ""):
    r = await run("shards", *args, broker=broker, env={"TIDINGS_CONSUMER": consumer.endpoint})
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r


def one_line_error(r, code: int, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == code, (r.returncode, r.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


def counts_in(db: Path) -> dict[str, int]:
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return dict(conn.execute("SELECT word, n FROM counts").fetchall())
    finally:
        conn.close()


async def test_get_hints_answers_every_slot_from_etcd(cluster, consumers, etcd_client) -> None:
    a = await served(cluster, consumers, hint_backups=2)
    keys = HintKeys(a.hint_prefix, "wc/0", 2)

    async def recovered_stored() -> bool:
        return (await fetch(etcd_client, keys, LOG)).primary is not None

    await wait_until(recovered_stored, 10)
    # The primary stored its recovered hints (of an empty log) as primary and backup.0; backup.1 is unset.
    # A foreign value at backup.1 is reported as unusable, naming why.
    await etcd_client.put(keys.backup(1), encode(pb.FSMHints(log="wc/log/other")))
    held = await fetch(etcd_client, keys, LOG)
    assert held.primary is not None and held.backups[0] is not None

    async with ShardClient(a.endpoint) as sc:
        resp = await sc.get_hints("wc/0")
        assert (resp.log, resp.primary_hints.key, resp.primary_hints.hints) == (LOG, keys.primary, held.primary)
        assert [(r.key, r.hints if r.HasField("hints") else None) for r in resp.backup_hints] == [
            (keys.backup(0), held.backups[0]),
            (keys.backup(1), None),
        ]
        assert "'wc/log/other', not the shard's 'wc/log/wc/0'" in resp.backup_hints[1].error
        with pytest.raises(ShardNotFoundError, match="no shard 'wc/9'"):
            await sc.get_hints("wc/9")
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(1))])  # (no recovery log)
        with pytest.raises(NoRecoveryLogError, match="'wc/1' has no recovery log"):
            await sc.get_hints("wc/1")
    async with grpc.aio.insecure_channel(a.endpoint) as channel:
        stub = pb_grpc.ShardStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetHints(pb.GetHintsRequest(shard="/bad"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "get_hints.shard" in refused.value.details()


async def test_hints_shows_what_the_primary_stored_and_recover_plays_it_without_appending(
    cluster, consumers, monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(replica, "HINT_INTERVAL", 0.2)  # (the recorder's own hints, not only the recovered ones)
    a = await served(cluster, consumers, hint_backups=2)
    words = [WORDS[i % len(WORDS)] for i in range(0, 300, 2)] + WORDS * 10
    await produce(cluster, "wc/in/0", words)
    await synced(a)
    primary = await quiescent_hints(a)
    keys = HintKeys(a.hint_prefix, "wc/0", 2)
    held = await fetch(a.etcd, keys, LOG)
    assert held.backups == [pb.FSMHints(log=LOG), None]  # (recovered from an empty log; one slot unwritten)

    r = await shards(a, "hints", "wc/0", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert (row["shard"], row["log"], row["primary"]["error"]) == ("wc/0", LOG, None)
    assert json_format.ParseDict(row["primary"]["hints"], pb.FSMHints()) == primary
    assert row["primary"]["live_files"] == len(primary.live_nodes) > 0
    assert [b["hints"] and json_format.ParseDict(b["hints"], pb.FSMHints()) for b in row["backups"]] == held.backups
    r = await shards(a, "hints", "wc/0")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"shard wc/0: recovery log {LOG}"
    assert lines[1].startswith(f"primary ({a.hint_prefix}/wc/0.primary): {len(primary.live_nodes)} live files")
    assert [ln.split(":")[0] for ln in lines[2:-2]] == [f"  fnode {n.fnode}" for n in primary.live_nodes]
    assert lines[-2] == f"backup.0 ({keys.backup(0)}): no live files: a player reads the whole log, from offset 0"
    assert lines[-1] == f"backup.1 ({keys.backup(1)}): none"

    async with cluster.client() as c:
        head = await c.write_head(LOG)
        broker = cluster.brokers[0].endpoint
        r = await shards(a, "recover", "wc/0", "--dir", str(tmp_path / "played"), broker=broker)
        assert r.returncode == 0, r.stderr
        assert f"played recovery log {LOG} into {tmp_path / 'played'} from the primary hints" in r.stdout
        assert sorted(p.name for p in (tmp_path / "played").iterdir()) == [DATABASE]  # (one file: no WAL)
        assert counts_in(tmp_path / "played" / DATABASE) == Counter(words)
        # From the backup (the hints the primary recovered with: none, an empty log), the whole log plays.
        r = await shards(a, "recover", "wc/0", "--hints", "backup.0", "--raw", "--dir", str(tmp_path / "backup0"),
                         broker=broker)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "from the backup.0 hints" in r.stdout
        assert counts_in(tmp_path / "backup0" / DATABASE) == Counter(words)
        assert await c.write_head(LOG) == head  # recover appends nothing
    d = str(tmp_path / "backup1")
    one_line_error(await shards(a, "recover", "wc/0", "--hints", "backup.1", "--dir", d, broker=broker), 1,
                   f"there are no backup.1 hints ({keys.backup(1)} holds none)")  # fmt: skip
    one_line_error(await shards(a, "recover", "wc/0", "--hints", "backup.2", "--dir", d, broker=broker), 1,
                   "no backup.2 hint slot", "keeps 2 backups")  # fmt: skip
    assert not (tmp_path / "backup1").exists()

    # Prune needs every slot: with backup.0 holding live files but backup.1 unwritten, the log is skipped.
    await a.etcd.put(keys.backup(0), encode(primary))
    r = await shards(a, "prune", broker=broker)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{LOG} (shard wc/0): skipped: shard wc/0 has no backup.1 hints yet ({keys.backup(1)})\n"


def spans(fragments: list[Fragment]) -> set[tuple[int, int]]:
    return {(f.begin, f.end) for f in fragments}


async def persisted_but_the_head(cluster) -> list[Fragment]:
    """The log's fragments once all but the one at its write head are persisted (an unpersisted one no
    hint needs would make prune refuse the log)."""

    async def listed() -> list[Fragment] | None:
        async with cluster.client() as c:
            frags = [Fragment.from_proto(e.spec) for e in (await c.fragments(LOG)).fragments]
        last = max(f.end for f in frags)
        return frags if all(f.backing_store and f.mod_time > 0 for f in frags if f.end != last) else None

    return await wait_until(listed, 30)


async def test_prune_removes_only_what_no_hint_set_needs(cluster, consumers, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(replica, "HINT_INTERVAL", 0.2)
    a = await served(cluster, consumers, SmallRollovers(), hot_standbys=1, hint_backups=2)
    b = await consumers.add("zone-b", app=SmallRollovers())
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY, "zone-b/c1": STANDBY}, 30)
    words = [WORDS[(i * 5) % len(WORDS)] for i in range(1200)]
    store = store_for(cluster.store_url)
    broker = cluster.brokers[0].endpoint

    # Rollovers under A, then a hand-off to B: B's recovered hints are backup.0; backup.1 is not yet
    # written, so the log is not pruned (a player may still fall back on a set that is missing).
    await produce(cluster, "wc/in/0", words[:400])
    await synced(a)
    c = await consumers.add("zone-c", app=SmallRollovers())  # (the next standby: a hand-off waits for one)
    await a.stop(graceful=True)
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-b/c1": PRIMARY, "zone-c/c2": STANDBY}, 30)
    await persisted_but_the_head(cluster)
    before = spans(store.list(LOG))
    r = await shards(b, "prune", "--json", broker=broker)
    assert r.returncode == 0, r.stderr
    (row,) = map(json.loads, r.stdout.splitlines())
    assert (row["log"], row["shards"], row["pruned"]) == (LOG, ["wc/0"], 0), row
    assert row["skipped"] == "shard wc/0: its backup.1 hints have no live files", row  # (A's, of an empty log)
    assert spans(store.list(LOG)) >= before  # (nothing removed; the head's fragment may have been persisted since)

    # More rollovers under B, a hand-off to C: backups differ (backup.0 C's, backup.1 B's); more under C.
    await produce(cluster, "wc/in/0", words[400:800])
    await synced(b)
    await consumers.add("zone-a", app=SmallRollovers())
    await b.stop(graceful=True)
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-c/c2": PRIMARY, "zone-a/c3": STANDBY}, 30)
    await produce(cluster, "wc/in/0", words[800:])
    await synced(c)
    await quiescent_hints(c)
    listed = await persisted_but_the_head(cluster)
    held = await fetch(c.etcd, HintKeys(c.hint_prefix, "wc/0", 2), LOG)
    assert held.primary is not None and None not in held.backups and held.backups[0] != held.backups[1]

    before = spans(store.list(LOG))
    r = await shards(c, "prune", "--dry-run", broker=broker)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{LOG} (shard wc/0): would remove "), r.stdout
    assert spans(store.list(LOG)) >= before  # a dry run removes nothing
    r = await shards(c, "prune", "--json", broker=broker)
    assert r.returncode == 0, r.stderr
    (row,) = map(json.loads, r.stdout.splitlines())
    assert row["skipped"] is None and row["failed"] == [], row
    assert (row["fragments"], row["bytes"]) == (len(listed), sum(f.content_length for f in listed)), row
    assert row["pruned"] > 0, row  # (rollovers moved every hint set past the log's first fragments)
    gone = before - spans(store.list(LOG))
    assert len(gone) == row["pruned"] and sum(e - b for b, e in gone) == row["pruned_bytes"], (gone, row)
    # Nothing any hint set needs went: each of them still plays the log, to the same counts.
    for slot in ("primary", "backup.0", "backup.1"):
        d = tmp_path / f"played-{slot}"
        r = await shards(c, "recover", "wc/0", "--hints", slot, "--dir", str(d), broker=broker)
        assert r.returncode == 0, (slot, r.stderr)
        assert counts_in(d / DATABASE) == Counter(words), slot
    # And a second prune finds nothing more to remove.
    r = await shards(c, "prune", "--json", broker=broker)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pruned"] == 0, r.stdout


async def test_mistakes_answer_with_one_line(cluster, consumers, tmp_path) -> None:
    a = await served(cluster, consumers, log=False)  # (wc/0's recovery log journal is missing)
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(1))])  # (no recovery log)
    broker = cluster.brokers[0].endpoint
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")

    # Input: exit code 2, before anything connects.
    d = str(tmp_path / "d")
    one_line_error(await shards(a, "hints", "/wc"), 2, "ID", "'/wc'")
    one_line_error(await shards(a, "recover", "wc/0", "--dir", str(full)), 2, f"--dir {full} is not empty")
    one_line_error(await shards(a, "recover", "wc/0", "--dir", str(full / "x")), 2, "not a directory")
    one_line_error(await shards(a, "recover", "wc/0", "--hints", "secondary", "--dir", d), 2,
                   "--hints 'secondary' is not primary or backup.N")  # fmt: skip
    assert (full / "x").read_text() == "x"

    # The shard or its log: exit code 1.
    one_line_error(await shards(a, "hints", "wc/9"), 1, "SHARD_NOT_FOUND", "no shard 'wc/9'")
    one_line_error(await shards(a, "recover", "wc/9", "--dir", d, broker=broker), 1, "SHARD_NOT_FOUND")
    one_line_error(await shards(a, "hints", "wc/1"), 1, "NO_RECOVERY_LOG", "'wc/1' has no recovery log")
    one_line_error(await shards(a, "recover", "wc/1", "--dir", d, broker=broker), 1, "NO_RECOVERY_LOG")
    one_line_error(await shards(a, "recover", "wc/0", "--dir", d, broker=broker), 1,
                   f"its recovery log '{LOG}' does not exist")  # fmt: skip
    assert not (tmp_path / "d").exists()
    one_line_error(await shards(a, "prune", "--selector", "id=wc/8", broker=broker), 1, "no shard matches")
    r = await shards(a, "prune", "--selector", "id=wc/1", broker=broker)
    assert (r.returncode, r.stdout) == (0, "none of the 1 shards matched has a recovery log: nothing to prune\n"), r
    r = await shards(a, "prune", broker=broker)  # (wc/0 has no hints at all: its primary never recovered)
    assert (r.returncode, r.stdout) == (0, f"{LOG} (shard wc/0): skipped: shard wc/0 has no primary hints yet "
                                           f"({a.hint_prefix}/wc/0.primary)\n"), r  # fmt: skip


async def test_list_shows_each_replicas_recovery_log_lag(cluster, consumers) -> None:
    """`shards list` asks every replica how far it has played (Stat any_replica) and the broker for the
    log's head: once input stops, the primary and its hot standby are 0 bytes behind. Metrics count the
    recorded and played bytes of the log."""
    sample = REGISTRY.get_sample_value
    recorded_before = sample("tidings_recoverylog_recorded_bytes_total", {"log": LOG}) or 0
    handoffs_before = sample("tidings_recoverylog_handoff_seconds_count") or 0
    a = await served(cluster, consumers, hot_standbys=1)
    b = await consumers.add("zone-b", app=RecordedCounts())
    await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY, "zone-b/c1": STANDBY}, 30)
    await produce(cluster, "wc/in/0", WORDS * 10)
    async with ShardClient(a.endpoint) as sc, cluster.client() as c:
        await sc.stat("wc/0", {"wc/in/0": await c.write_head("wc/in/0")})
        head = await c.write_head(LOG)
        # Stat(any_replica) answers for this process's replica, whatever its slot, at once.
        standby = await sc.replica_stat("wc/0", b.endpoint)
        assert standby.status == pb.OK and standby.recovery_log.journal == LOG and not standby.read_through
        primary = await sc.replica_stat("wc/0", a.endpoint)
        assert primary.recovery_log.offset == head and primary.read_through["wc/in/0"] > 0
    await wait_until(lambda: b.replicas["wc/0"].recovery.offset == head, 30)  # (the standby tails the log)
    async with grpc.aio.insecure_channel(b.endpoint) as channel:  # (any_replica never waits: read_through refused)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.ShardStub(channel).Stat(pb.StatRequest(shard="wc/0", any_replica=True, read_through={"x": 1}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "any_replica" in refused.value.details()

    r = await shards(a, "list", "--json", broker=cluster.brokers[0].endpoint)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert row["recovery_log_lag"] == {"zone-a/c0": 0, "zone-b/c1": 0}, row
    r = await shards(a, "list", broker=cluster.brokers[0].endpoint)
    assert r.returncode == 0 and "recovery log lag" in r.stdout and "zone-b/c1:0" in r.stdout, r.stdout

    recorder = a.replicas["wc/0"].shard.recorder
    recorded = sample("tidings_recoverylog_recorded_bytes_total", {"log": LOG}) - recorded_before
    assert recorded == recorder.statistics().bytes > 0
    assert sample("tidings_recoverylog_played_bytes_total", {"log": LOG}) > 0
    assert sample("tidings_recoverylog_hints_written_total", {"kind": "recovered"}) >= 1
    assert sample("tidings_recoverylog_handoff_seconds_count") == handoffs_before + 1
    assert sample("tidings_recoverylog_playback_seconds_count") >= 2  # (the primary's and the standby's)
    await wait_until(lambda: sample("tidings_recoverylog_lag_bytes", {"shard": "wc/0"}) is not None, 30)
