"""The LogPlayer's commands as a user runs them against a real cluster: `wal append` (transactions
from stdin, a retry by UUID applied once, bad lines, an append that fails) and `targets status`
(a target up, one down, the WAL bytes pending for a target). One clear line and exit code 1
or 2 on a mistake, never a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from tests.cli._support import run
from tests.support.waiting import wait_until
from tidings.cluster.etcd import free_port
from tidings.logplayer.player import LogPlayer
from tidings.logplayer.target import TargetServer
from tidings.logplayer.wal import Targets, WalEntry
from tidings.message.iterators import ReadCommitted
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict, spec_to_dict

WAL = "cli/wal"


def targets_file(tmp_path: Path, endpoints: list[str]) -> str:
    f = tmp_path / "targets.yaml"
    f.write_text("targets:\n" + "".join(f"  - id: t{i}\n    endpoint: {e}\n" for i, e in enumerate(endpoints)))
    return str(f)


async def committed_entries(cluster) -> list[WalEntry]:
    async with cluster.client() as c:
        return [env.message async for env in ReadCommitted(c, WAL, message_type=WalEntry, block=False)]


async def test_wal_append_prints_each_index_and_a_retry_by_uuid_is_applied_once(cluster, tmp_path: Path) -> None:
    await cluster.create_journal(WAL)
    ep = cluster.brokers[0].endpoint
    targets = targets_file(tmp_path, [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    stdin = b'[{"key": "a", "value": 1}]\n\n[{"key": "b", "value": {"x": [2]}}, {"key": "c", "delete": true}]\n'
    r = await run("wal", "append", WAL, "--targets", targets, broker=ep, stdin=stdin)
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(out) == 2 and out[0]["index"] == 0 < out[1]["index"] and out[0]["uuid"] != out[1]["uuid"]
    # A retry of both (a crash before the answers, say), from another process: applied once.
    retry = b"".join(
        json.dumps({"mutations": m, "uuid": o["uuid"]}).encode() + b"\n"
        for m, o in zip([[{"key": "a", "value": 1}], [{"key": "b", "value": {"x": [2]}}]], out, strict=True)
    )
    r = await run("wal", "append", WAL, "--targets", targets, broker=ep, stdin=retry)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["uuid"] for line in r.stdout.splitlines()] == [o["uuid"] for o in out]
    entries = await committed_entries(cluster)
    assert [e.uuid for e in entries] == [o["uuid"] for o in out]
    assert sum(len(ms) for ms in entries[1].parts.values()) == 2


async def test_wal_append_bad_lines_say_which_and_what_went_before(cluster, tmp_path: Path) -> None:
    """A bad stdin line stops `wal append` with one line naming it, the expected shape and what was
    appended before it; exit code 1, as `publish` gives a bad line (2 is for flags and arguments,
    refused before anything connects). A mutation setting nothing (no value, no delete) is refused."""
    await cluster.create_journal(WAL)
    ep = cluster.brokers[0].endpoint
    targets = targets_file(tmp_path, ["127.0.0.1:7000"])
    shape = 'give a JSON list of mutations, or {"mutations": [...], "uuid": "..."}'
    cases = [
        (b'[{"key": "a", "value": 1}]\nnot json\n', "stdin line 2", "(1 transaction before it appended)"),
        (b"[]\n", "stdin line 1", "at least one mutation"),
        (b'[{"value": 1}]\n', "stdin line 1", "mutation 0"),
        (b'[{"key": "a"}]\n', "stdin line 1", "mutation 0: neither 'value' nor 'delete': true: give"),
        (b'[{"key": "a", "value": 1, "delete": true}]\n', "stdin line 1", "mutation 0: both 'value' and"),
        (b'{"mutations": [{"key": "a", "delete": true}], "uuid": "nope"}\n', "stdin line 1", "uuid 'nope'"),
        (b'{"uuid": "x"}\n', "stdin line 1", shape),
        (b"42\n", "stdin line 1", f"a JSON number, not a transaction: {shape}"),
    ]
    for stdin, where, what in cases:
        r = await run("wal", "append", WAL, "--targets", targets, broker=ep, stdin=stdin)
        err = r.stderr.decode()
        assert r.returncode == 1, (stdin, err)
        assert where in err and what in err and "Traceback" not in err, (stdin, err)
        assert len(err.strip().splitlines()) == 1, err
    r = await run("wal", "append", "wal/absent", "--targets", targets, broker=ep, stdin=b'[{"key": "a", "value": 1}]\n')
    err = r.stderr.decode()
    assert r.returncode == 1 and "journal 'wal/absent' does not exist: nothing was appended" in err, err
    assert "unknown" not in err and len(err.strip().splitlines()) == 1, err
    r = await run("wal", "append", WAL, "--targets", str(tmp_path / "nope.yaml"), broker=ep, stdin=b"[]\n")
    assert r.returncode == 2 and "nope.yaml" in r.stderr.decode()


async def test_an_append_that_fails_names_the_uuid_to_retry_with(cluster, tmp_path: Path) -> None:
    await cluster.create_journal(WAL, flags="read-only")
    ep = cluster.brokers[0].endpoint
    targets = targets_file(tmp_path, ["127.0.0.1:7000"])
    r = await run("wal", "append", WAL, "--targets", targets, broker=ep, stdin=b'[{"key": "a", "value": 1}]\n')
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "stdin line 1" in err and "append it again as" in err
    retry = err[err.index("{") : err.rindex("}") + 1].replace("...", '[{"key": "a", "value": 1}]')
    uuid = json.loads(retry)["uuid"]
    # The user makes the journal writable and retries as told: applied once.
    async with cluster.client() as c:
        j = next(j for j in (await c.list()).journals if j.spec.name == WAL)
        writable = spec_from_dict({**spec_to_dict(j.spec), "flags": "read-write"})
        await c.apply([pb.ApplyRequest.Change(expect_mod_revision=j.mod_revision, upsert=writable)])

    async def retried() -> bool:  # (until every broker has the new flags: a refused retry appended nothing)
        r = await run("wal", "append", WAL, "--targets", targets, broker=ep, stdin=retry.encode() + b"\n")
        return r.returncode == 0

    await wait_until(retried, 30)
    assert await retried()  # (and once more: still applied once)
    assert [e.uuid for e in await committed_entries(cluster)] == [uuid]


async def test_targets_status_shows_each_target_and_fails_when_one_is_down(cluster, tmp_path: Path) -> None:
    await cluster.create_journal(WAL)
    ep = cluster.brokers[0].endpoint
    up, down = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    targets = targets_file(tmp_path, [up, down])
    server = await TargetServer("t0", tmp_path / "t0.sqlite", up).start()
    try:
        r = await run("wal", "append", WAL, "--targets", targets, broker=ep, stdin=b'[{"key": "a", "value": 1}]\n')
        assert r.returncode == 0, r.stderr
        r = await run("targets", "status", "--targets", targets, "--wal", WAL, "--json", broker=ep)
        assert r.returncode == 1, r.stderr
        rows = {row["id"]: row for row in map(json.loads, r.stdout.splitlines())}
        async with cluster.client() as c:
            head = await c.write_head(WAL)
        (entry,) = await committed_entries(cluster)
        pending = head if "t0" in entry.parts else 0  # (from the entry meant for t0, if it is)
        assert rows["t0"]["up"] and rows["t0"]["last_applied"] == -1 and rows["t0"]["pending_bytes"] == pending
        assert not rows["t1"]["up"] and rows["t1"]["error"]
        r = await run("targets", "status", "--targets", targets, broker=ep)
        table = r.stdout.decode()
        assert r.returncode == 1 and "t0" in table and "yes" in table and "no:" in table, table

        # Every entry applied (a LogPlayer over t0 alone): nothing pending.
        only_up = targets_file(tmp_path, [up])
        for _ in range(2):
            r = await run("wal", "append", WAL, "--targets", only_up, broker=ep, stdin=b'[{"key": "b", "value": 2}]\n')
            assert r.returncode == 0, r.stderr
        async with cluster.client() as client:
            player = LogPlayer(client, WAL, Targets.load(only_up), state_path=tmp_path / "p.state")
            task = asyncio.create_task(player.run())
            try:

                async def caught_up() -> bool:
                    r = await run("targets", "status", "--targets", only_up, "--wal", WAL, "--json", broker=ep)
                    row = json.loads(r.stdout)
                    return r.returncode == 0 and row["last_applied"] > 0 and row["pending_bytes"] == 0

                await wait_until(caught_up, 30)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        await server.stop()
