"""The Player (consumer/recoverylog/player.py) against real brokers: a recorded directory plays back byte
for byte into an empty one; with hints it reads only the segments live files need; as a hot standby
it follows the log and, handed the log off, fences the old recorder so nothing of it lands after the
handoff (DESIGN.md invariant 10), injecting again when a late op of the old recorder wins the race;
a hole where hints need content fails playback; a cancelled playback leaves no directory."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.support.waiting import wait_until
from tidings.client import AppendService, AsyncClient
from tidings.consumer.recoverylog.fsm import FSM
from tidings.consumer.recoverylog.ops import encode, new_author
from tidings.consumer.recoverylog.player import PlaybackError, Player, PlayerState
from tidings.consumer.recoverylog.recorder import Recorder, RecorderFencedError
from tidings.protocol import protocol_pb2 as pb

LOG = "recovery/shard-0"


class RecordedDir:
    """A directory whose file operations are done on disk and recorded, as a recorded store does."""

    def __init__(self, dir: Path, recorder: Recorder) -> None:
        self.dir, self.rec = dir, recorder
        dir.mkdir(parents=True, exist_ok=True)

    def write(self, path: str, data: bytes, offset: int = 0) -> None:
        fnode = self.rec.fnode(path)
        flags = os.O_WRONLY | os.O_CREAT
        if fnode is None:
            fnode = self.rec.create(path)
        (self.dir / path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / path, flags, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        self.rec.write_at(fnode, data, offset)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(self.dir / path, size)
        fnode = self.rec.fnode(path)
        assert fnode is not None
        self.rec.truncate(fnode, size)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.dir / src, self.dir / dst)
        self.rec.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(self.dir / path)
        self.rec.unlink(path)


def files(dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dir)): p.read_bytes() for p in sorted(dir.rglob("*")) if p.is_file()}


async def take_over(c: AsyncClient, hints: pb.FSMHints, dir: Path) -> tuple[Recorder, AppendService, Player]:
    """What a new primary does: play the log, hand it off to a new author, record on."""
    player = Player(c, hints, dir)
    author = new_author()
    player.inject_handoff(author)
    played = await player.play()
    service = AppendService(c)
    return Recorder(service, LOG, played.fsm, author, played.write_head), service, player


async def a_log(cluster) -> None:
    await cluster.create_journal(LOG, 3, labels={"content-type": "application/x-recoverylog"})


async def test_a_recorded_directory_plays_back_byte_for_byte(cluster, tmp_path) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        rec, service, _ = await take_over(c, pb.FSMHints(log=LOG), tmp_path / "a")
        a = RecordedDir(tmp_path / "a", rec)
        a.write("store.db", os.urandom(3 << 20))  # (several write ops)
        a.write("store.db", b"page two", 4096)
        a.write("store.db-wal", b"frames")
        a.write("sub/dir/file", b"nested")
        a.truncate("store.db", 10_000)
        a.write("tmp", b"scratch")
        a.rename("tmp", "store.db")  # (replaces it)
        a.unlink("store.db-wal")
        await rec.barrier()
        player = Player(c, pb.FSMHints(log=LOG), tmp_path / "b")
        player.finish_at_write_head()
        played = await player.play()
        await service.aclose()
    assert files(tmp_path / "b") == files(tmp_path / "a") == {"store.db": b"scratch", "sub/dir/file": b"nested"}
    assert not (tmp_path / "b" / ".fnodes").exists()
    assert played.write_head == rec.statistics().write_head > 3 << 20


async def test_with_hints_only_the_segments_live_files_need_are_read(cluster, tmp_path) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        rec, service, _ = await take_over(c, pb.FSMHints(log=LOG), tmp_path / "a")
        a = RecordedDir(tmp_path / "a", rec)
        a.write("old.db", os.urandom(2 << 20))  # dead by the time of the hints
        a.unlink("old.db")
        await rec.barrier()  # (as a store's commit does: the recorder learns where the log's head is)
        a.write("store.db", b"live")
        hints = await rec.build_hints()
        a.write("store.db", b"LIVE")  # (after the hints: read from where they end)
        await rec.barrier()
        log_size = await c.write_head(LOG)
        player = Player(c, hints, tmp_path / "b")
        player.finish_at_write_head()
        await player.play()
        await service.aclose()
    assert files(tmp_path / "b") == files(tmp_path / "a") == {"store.db": b"LIVE"}
    assert player.statistics().bytes_read < log_size - (2 << 20), "the dead file's two MiB were not read"


async def test_a_hot_standby_follows_the_log_and_its_handoff_fences_the_old_recorder(cluster, tmp_path) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        rec, service, _ = await take_over(c, pb.FSMHints(log=LOG), tmp_path / "a")
        a = RecordedDir(tmp_path / "a", rec)
        a.write("store.db", b"one")
        await rec.barrier()
        standby = Player(c, pb.FSMHints(log=LOG), tmp_path / "b")
        playing = asyncio.ensure_future(standby.play())
        await asyncio.wait_for(standby.tailing.wait(), 30)
        a.write("store.db", b"two", 3)  # written while the standby tails
        await rec.barrier()
        await wait_until(lambda: standby.statistics().applied >= rec.statistics().ops, 30)
        assert standby.state is PlayerState.TAIL
        author = new_author()
        standby.inject_handoff(author)
        played = await asyncio.wait_for(playing, 30)
        head = await c.write_head(LOG)
        a.write("store.db", b"zombie", 6)  # the old primary goes on: nothing of it may land
        with pytest.raises(RecorderFencedError):
            await rec.barrier()
        assert await c.write_head(LOG) == head
        new = Recorder(AppendService(c), LOG, played.fsm, author, played.write_head)
        new.write_at(new.fnode("store.db") or 0, b"three", 6)
        await new.barrier()
        after = Player(c, pb.FSMHints(log=LOG), tmp_path / "c")
        after.finish_at_write_head()
        await after.play()
        await service.abort()
    assert files(tmp_path / "b") == {"store.db": b"onetwo"}
    assert files(tmp_path / "c") == {"store.db": b"onetwothree"}, "the zombie's write is in no playback"


async def test_a_handoff_that_loses_the_race_to_a_late_op_is_injected_again(cluster, tmp_path, monkeypatch) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        rec, service, _ = await take_over(c, pb.FSMHints(log=LOG), tmp_path / "a")
        a = RecordedDir(tmp_path / "a", rec)
        a.write("store.db", b"one")
        await rec.barrier()
        player = Player(c, pb.FSMHints(log=LOG), tmp_path / "b")
        author = new_author()
        player.inject_handoff(author)
        append, injected = c.append, []

        async def late_op_first(journal, content=b"", **kw):
            if kw.get("union_registers") is not None and not injected:
                injected.append(content)
                a.write("store.db", b"late", 3)  # the old recorder's op lands between our read and our no-op
                await rec.barrier()
            return await append(journal, content, **kw)

        monkeypatch.setattr(c, "append", late_op_first)
        played = await player.play()
        await service.abort()
    assert injected and played.fsm.links == {"store.db": played.fsm.links["store.db"]}
    assert files(tmp_path / "b") == {"store.db": b"onelate"}, "the late op was played, then our second no-op won"
    assert player.statistics().skipped >= 1  # (our first no-op, out of sequence)


async def test_hints_past_the_logs_write_head_are_data_loss(cluster, tmp_path) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        await c.append(LOG, encode(pb.RecordedOp(seq_no=1, author=1, create=pb.RecordedOp.Create(path="x"))))
        seg = pb.Segment(author=1, first_seq_no=1, last_seq_no=1, first_offset=10_000)
        hints = pb.FSMHints(log=LOG, live_nodes=[pb.FnodeSegments(fnode=1, segments=[seg])])
        player = Player(c, hints, tmp_path / "b")
        player.finish_at_write_head()
        with pytest.raises(PlaybackError, match="possible data loss"):
            await player.play()
    assert not (tmp_path / "b").exists()


async def test_a_cancelled_playback_leaves_no_directory(cluster, tmp_path) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        await c.append(LOG, encode(pb.RecordedOp(seq_no=1, author=1, create=pb.RecordedOp.Create(path="x"))))
        player = Player(c, pb.FSMHints(log=LOG), tmp_path / "b")
        playing = asyncio.ensure_future(player.play())
        await asyncio.wait_for(player.tailing.wait(), 30)
        assert (tmp_path / "b" / ".fnodes" / "1").exists()
        playing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await playing
    assert not (tmp_path / "b").exists()


def test_a_handoff_author_must_be_an_author() -> None:
    player = Player(None, pb.FSMHints(log=LOG), Path("/nonexistent"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-zero"):
        player.inject_handoff(0)
    player.finish_at_write_head()
    with pytest.raises(RuntimeError, match="already"):
        player.inject_handoff(5)


async def test_an_fsm_author_fence_is_set_by_the_handoff(cluster, tmp_path) -> None:
    """The handoff's no-op carries the new author's register: a recorder of another author is refused."""
    await a_log(cluster)
    async with cluster.client() as c:
        rec, service, _ = await take_over(c, pb.FSMHints(log=LOG), tmp_path / "a")
        other = Recorder(AppendService(c), LOG, FSM(pb.FSMHints(log=LOG)), new_author(), write_head=0)
        other.create("x")
        with pytest.raises(RecorderFencedError):
            await other.barrier()
        rec.create("y")
        await rec.barrier()  # (the handed-off author records on)
        await service.aclose()


async def test_tailing_is_set_whenever_the_head_is_reached(cluster, tmp_path) -> None:
    """Also by a playback asked to finish before it started (a primary's own recovery): anything
    waiting for the replica to be caught up does not wait for ever."""
    await a_log(cluster)
    async with cluster.client() as c:
        await c.append(LOG, encode(pb.RecordedOp(seq_no=1, author=1, create=pb.RecordedOp.Create(path="x"))))
        player = Player(c, pb.FSMHints(log=LOG), tmp_path / "b")
        player.finish_at_write_head()
        await player.play()
    assert player.tailing.is_set()


async def test_a_log_whose_first_operations_are_gone_is_data_loss_not_an_empty_store(cluster, tmp_path) -> None:
    """Without hints the whole log is read: an op found where an earlier one was expected (the log's
    start removed, say) fails playback, instead of playing a store without them."""
    await a_log(cluster)
    async with cluster.client() as c:
        await c.append(LOG, encode(pb.RecordedOp(seq_no=5, author=1, create=pb.RecordedOp.Create(path="x"))))
        player = Player(c, pb.FSMHints(log=LOG), tmp_path / "b")
        player.finish_at_write_head()
        with pytest.raises(PlaybackError, match="op 5 at offset 0 where op 1 was expected"):
            await player.play()
    assert not (tmp_path / "b").exists()
