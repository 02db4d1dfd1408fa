"""RecordedSQLiteStore (consumer/store_recorded.py) against real brokers: a committed transaction is in
the recovery log when its commit returns, so another process plays the store back, byte for byte,
with its checkpoint and the application's changes (DESIGN.md invariant 8 without a shared disk); a
zombie primary whose log a newer primary took over commits nothing more (invariant 10)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from tests.consumer._support import COUNTS, add
from tests.support.stores import checkpoint
from tidings.client import AppendService, AsyncClient
from tidings.consumer import FenceError
from tidings.consumer.recoverylog import player
from tidings.consumer.recoverylog.fsm import FSM
from tidings.consumer.recoverylog.ops import Decoded, OpReader, new_author
from tidings.consumer.recoverylog.player import Player
from tidings.consumer.recoverylog.recorder import Recorder
from tidings.consumer.store_recorded import DATABASE, JSONFileStore, RecordedSQLiteStore
from tidings.protocol import protocol_pb2 as pb

LOG = "recovery/wc-0"
HORIZON_TXNS = int(os.environ.get("TIDINGS_HORIZON_TXNS", "1500"))  # (the 10,000: ~1 min here)


async def primary(c: AsyncClient, dir: Path, hints: pb.FSMHints | None = None, **options) -> RecordedSQLiteStore:
    """A new primary: play the log into `dir`, take it over, open the store there."""
    player = Player(c, hints or pb.FSMHints(log=LOG), dir)
    author = new_author()
    player.inject_handoff(author)
    played = await player.play()
    recorder = Recorder(AppendService(c), LOG, played.fsm, author, played.write_head)
    return RecordedSQLiteStore(recorder, dir, schema=options.pop("schema", [COUNTS]), **options)


async def play(c: AsyncClient, dir: Path) -> Path:
    player = Player(c, pb.FSMHints(log=LOG), dir)
    player.finish_at_write_head()
    await player.play()
    return dir


def rows(dir: Path) -> dict[str, int]:
    """The counts as a plain SQLite (the stdlib's) reads the played files."""
    db = sqlite3.connect(dir / DATABASE)
    try:
        return dict(db.execute("SELECT word, n FROM counts ORDER BY word").fetchall())
    finally:
        db.close()


@pytest.fixture
async def log(cluster) -> None:
    await cluster.create_journal(LOG, 3, labels={"content-type": "application/x-recoverylog"})


async def test_a_committed_transaction_plays_back_in_another_directory(cluster, log, tmp_path) -> None:
    async with cluster.client() as c:
        a = await primary(c, tmp_path / "a")
        assert await a.restore_checkpoint("wc/0") == pb.Checkpoint()
        for word in ("hello", "hello", "world"):
            await add(a, word)
        await a.start_commit("wc/0", checkpoint(100))
        await add(a, "uncommitted")  # (a transaction in progress is not part of any playback)
        b = await play(c, tmp_path / "b")
        for name in ("store.db", "store.db-wal"):
            assert (b / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name
        a.destroy()
        assert not (tmp_path / "a").exists(), "a destroyed store's directory no longer matches the log: gone"
        assert rows(b) == {"hello": 2, "world": 1}

        again = await primary(c, tmp_path / "c")  # the next primary
        assert await again.restore_checkpoint("wc/0") == checkpoint(100)
        await add(again, "more")
        await again.start_commit("wc/0", checkpoint(200))
        again.destroy()
        assert rows(await play(c, tmp_path / "d")) == {"hello": 2, "more": 1, "world": 1}


async def test_many_transactions_and_wal_resets_play_back(cluster, log, tmp_path) -> None:
    async with cluster.client() as c:
        a = await primary(c, tmp_path / "a")
        await a.restore_checkpoint("wc/0")
        a.db.execute("PRAGMA wal_autocheckpoint=16")  # (pages: checkpoints, and WAL resets, every few commits)
        for i in range(300):
            for j in range(20):
                await add(a, f"w{(i * 7 + j) % 500}")
            await a.start_commit("wc/0", checkpoint(i + 1))
        expected = dict(a.db.execute("SELECT word, n FROM counts").fetchall())
        a.destroy()
        wal_files = [
            d for d in OpReader(0).feed(await c.read_all(LOG))
            if isinstance(d, Decoded) and d.op.create.path == "store.db-wal"
        ]  # fmt: skip
        assert len(wal_files) > 2, "the WAL was reset (checkpointed and emptied) more than once"
        b = await primary(c, tmp_path / "b")
        assert await b.restore_checkpoint("wc/0") == checkpoint(300)
        assert dict(b.db.execute("SELECT word, n FROM counts").fetchall()) == expected
        assert b.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        b.destroy()


async def test_a_zombie_primary_commits_nothing_after_a_newer_one_took_the_log(cluster, log, tmp_path) -> None:
    async with cluster.client() as c:
        zombie = await primary(c, tmp_path / "zombie")
        await zombie.restore_checkpoint("wc/0")
        await add(zombie, "before")
        await zombie.start_commit("wc/0", checkpoint(10))
        newer = await primary(c, tmp_path / "newer")  # plays the log and hands it off to itself
        assert await newer.restore_checkpoint("wc/0") == checkpoint(10)
        await add(zombie, "zombie")
        with pytest.raises(FenceError, match="newer primary took the log over"):
            await zombie.start_commit("wc/0", checkpoint(20))
        await add(newer, "newer")
        await newer.start_commit("wc/0", checkpoint(30))
        zombie.destroy()
        newer.destroy()
        assert rows(await play(c, tmp_path / "played")) == {"before": 1, "newer": 1}


def within_one_append(ops: list[Decoded], k: int) -> bool:
    """A cut before ops[k] falls inside ops the recorder appends together (a rename: unlink, link,
    unlink; a create over a file: unlink, create), which no log ends between."""
    kind, before = ops[k].op.WhichOneof("op"), ops[k - 1].op.WhichOneof("op")
    return kind == "link" or (kind == "unlink" and before == "link") or (kind == "create" and before == "unlink")


def play_prefix(ops: list[Decoded], dir: Path) -> None:
    """The directory the first `ops` of the log make (a log cut there: a crash, or a zombie's last op)."""
    fsm, files = FSM(pb.FSMHints(log=LOG)), {}
    player._prepare(dir)
    for d in ops:
        fsm.apply(d.op, d.payload, d.data, d.first_offset, d.last_offset, LOG)
        player._reenact(dir, files, [player._action(fsm, d)])
    player._make_live(dir, fsm, files)


async def test_every_prefix_of_the_log_is_a_database_sqlite_recovers(cluster, log, tmp_path) -> None:
    """Recording files in the order they were written makes any cut of the log a state the disk could
    have had at a crash: SQLite opens it consistent, holding the last transaction committed before the
    cut or the one in flight, never a torn one."""
    async with cluster.client() as c:
        a = await primary(c, tmp_path / "a", rollover_min_bytes=32 << 10)  # (rollovers among the cuts too)
        await a.restore_checkpoint("wc/0")
        a.db.execute("PRAGMA wal_autocheckpoint=4")
        await add(a, "n")
        await a.start_commit("wc/0", checkpoint(1))
        start = await c.write_head(LOG)
        for i in range(2, 14):
            await add(a, "n")
            a.transaction().execute("INSERT INTO counts VALUES (?, 1)", (f"pad{i}" + "x" * 3000,))
            await a.start_commit("wc/0", checkpoint(i))
        rollovers = a.rollovers
        a.destroy()
        ops = [d for d in OpReader(0).feed(await c.read_all(LOG)) if isinstance(d, Decoded)]
    assert rollovers >= 1
    cuts = [k for k, d in enumerate(ops) if d.first_offset >= start and not within_one_append(ops, k)] + [len(ops)]
    seen = set()
    for k in cuts:
        dir = tmp_path / f"cut-{k}"
        play_prefix(ops[:k], dir)
        db = sqlite3.connect(dir / DATABASE)
        try:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",), k
            (n,) = db.execute("SELECT n FROM counts WHERE word = 'n'").fetchone()
        finally:
            db.close()
        seen.add(n)
    assert seen == set(range(1, 14)), "each cut holds a whole transaction's state, and every one is reached"


async def json_primary(c: AsyncClient, dir: Path, hints: pb.FSMHints | None = None) -> JSONFileStore:
    player = Player(c, hints or pb.FSMHints(log=LOG), dir)
    author = new_author()
    player.inject_handoff(author)
    played = await player.play()
    return JSONFileStore(Recorder(AppendService(c), LOG, played.fsm, author, played.write_head), dir)


async def test_a_json_document_store_plays_back_its_last_document_only(cluster, log, tmp_path) -> None:
    async with cluster.client() as c:
        a = await json_primary(c, tmp_path / "a")
        assert await a.restore_checkpoint("wc/0") == pb.Checkpoint() and a.state == {}
        for i in range(1, 51):
            a.state = {"count": i, "padding": "x" * 10_000}
            await a.start_commit("wc/0", checkpoint(i))
        hints = await a.recorder.build_hints()
        log_size = await c.write_head(LOG)
        b = await json_primary(c, tmp_path / "b", hints)
        assert await b.restore_checkpoint("wc/0") == checkpoint(50)
        assert b.state == {"count": 50, "padding": "x" * 10_000}
        b.state["count"] = 51
        with pytest.raises(FenceError):  # (a's log was taken over by b)
            await a.start_commit("wc/0", checkpoint(99))
        await b.start_commit("wc/0", checkpoint(51))
        player = Player(c, pb.FSMHints(log=LOG), tmp_path / "c")
        player.finish_at_write_head()
        await player.play()
    assert (tmp_path / "c" / "state.json").read_bytes() == (tmp_path / "b" / "state.json").read_bytes()
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["state.json"]
    (node,) = hints.live_nodes  # the last document: its ops begin after the 49 others
    assert log_size > 50 * 10_000 and node.segments[0].first_offset > log_size - 2 * 10_100


async def test_playback_reads_at_most_a_multiple_of_the_live_database(cluster, log, tmp_path) -> None:
    """However many times rows are rewritten, playing the store back from its hints reads at most
    rollover_ratio x its size (plus rollover_min_bytes and the transaction in flight), never its history."""
    async with cluster.client() as c:
        a = await primary(c, tmp_path / "a", rollover_min_bytes=64 << 10)
        await a.restore_checkpoint("wc/0")
        for i in range(HORIZON_TXNS):
            await a.begin()  # (as the shard does before a transaction's first message)
            for j in range(10):
                a.transaction().execute(
                    "INSERT INTO counts VALUES (?, 1) ON CONFLICT (word) DO UPDATE SET n = n + 1",
                    (f"w{(i * 13 + j) % 300}" + "x" * 200,),
                )
            await a.start_commit("wc/0", checkpoint(i + 1))
        hints = await a.recorder.build_hints()
        live = sum(p.stat().st_size for p in (tmp_path / "a").iterdir() if p.is_file())
        history = await c.write_head(LOG)
        expected = dict(a.db.execute("SELECT word, n FROM counts").fetchall())
        assert a.rollovers >= 3
        a.destroy()
        player = Player(c, hints, tmp_path / "b")
        player.finish_at_write_head()
        await player.play()
        b = RecordedSQLiteStore(
            Recorder(AppendService(c), LOG, FSM(hints), 1, 0), tmp_path / "b", schema=[COUNTS]
        )  # (read only: nothing here is recorded again)
        assert dict(b.db.execute("SELECT word, n FROM counts").fetchall()) == expected
        b._recording = False
        b.destroy()
    read = player.statistics().bytes_read
    assert read <= 2 * live + (64 << 10) + (64 << 10), (read, live, history)
    assert history > 10 * read, "the log's history is many times what playback read"


async def test_a_rollover_copes_with_any_characters_in_its_directory(cluster, log, tmp_path) -> None:
    """Shard ids (and so store directories) may hold %, # or quotes: the rollover's copy goes where it must."""
    async with cluster.client() as c:
        small_wal = [COUNTS, "PRAGMA wal_autocheckpoint=8"]  # (pages: the WAL restarts, so history passes size)
        a = await primary(c, tmp_path / "wc%41#it's", rollover_min_bytes=16 << 10, schema=small_wal)
        await a.restore_checkpoint("wc/0")
        for i in range(40):
            await add(a, f"w{i % 3}" + "x" * 2000)  # (the same rows again and again: history, not size)
            await a.start_commit("wc/0", checkpoint(i + 1))
        assert a.rollovers >= 1 and sorted(p.name for p in (tmp_path / "wc%41#it's").iterdir())[0] == DATABASE
        a.destroy()
        b = await primary(c, tmp_path / "b")
        assert await b.restore_checkpoint("wc/0") == checkpoint(40)
        assert sorted(n for (n,) in b.db.execute("SELECT n FROM counts").fetchall()) == [13, 13, 14]
        b.destroy()
    assert not list(tmp_path.rglob("store.db*")), "nothing written outside the stores, nothing left behind"


async def test_playback_from_a_recorders_hints_reads_no_byte_twice(cluster, log, tmp_path) -> None:
    """Hinted segments a few ops apart (a handoff's no-op between two primaries' ops, say) are read up
    to, not sought: a seek would drop what the read had fetched ahead and fetch it again."""
    async with cluster.client() as c:
        hints = None
        for primaries in ("a", "b"):
            store = await primary(c, tmp_path / primaries, hints)
            await store.restore_checkpoint("wc/0")
            for i in range(150):
                await add(store, f"w{i % 50}" + "x" * 300)
                await store.start_commit("wc/0", checkpoint(i + 1))
            hints = await store.recorder.build_hints()
            expected = dict(store.db.execute("SELECT word, n FROM counts").fetchall())
            store.destroy()
        head = await c.write_head(LOG)
        player = Player(c, hints, tmp_path / "c")
        player.finish_at_write_head()
        await player.play()
    assert player.statistics().bytes_read <= head, (player.statistics(), head)
    assert rows(tmp_path / "c") == expected
