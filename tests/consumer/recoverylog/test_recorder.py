"""The Recorder (consumer/recoverylog/recorder.py) against real brokers: what it records is in the log,
in order, whole, and any FSM reading the log back reaches the recorder's own state; `barrier()`
returns only once everything recorded is committed; and once a newer author's handoff took the log
over, nothing more of this recorder lands (DESIGN.md invariant 10) and it is told it is fenced."""

from __future__ import annotations

import asyncio

import pytest

from tidings.client import AppendResult, AppendService
from tidings.consumer.recoverylog.fsm import FSM, FnodeNotTrackedError
from tidings.consumer.recoverylog.ops import MAX_WRITE_OP, Decoded, OpReader, encode, fence, new_author
from tidings.consumer.recoverylog.recorder import APPEND_BYTES, Recorder, RecorderError, RecorderFencedError
from tidings.protocol import protocol_pb2 as pb

LOG = "recovery/shard-0"


async def a_log(cluster) -> None:
    await cluster.create_journal(LOG, 3, labels={"content-type": "application/x-recoverylog"})


async def handoff(c, fsm: FSM, author: int) -> int:
    """What a player does to take the log over: a no-op sequenced after `fsm`, appended with the author's
    register (a register change needs bytes), and applied; the log's write head after it."""
    op = pb.RecordedOp(seq_no=fsm.next_seq_no, checksum=fsm.next_checksum, author=author)
    frame = encode(op)
    result = await c.append(LOG, frame, union_registers=fence(author))
    fsm.apply(op, op.SerializeToString(), b"", result.begin, result.end, LOG)
    return result.end


def played(content: bytes) -> tuple[FSM, list[Decoded]]:
    """The log's operations, applied to a fresh FSM as a player does (every one must apply)."""
    fsm = FSM(pb.FSMHints(log=LOG))
    ops = [d for d in OpReader(0).feed(content)]
    assert all(isinstance(d, Decoded) for d in ops), ops
    for d in ops:
        assert isinstance(d, Decoded)
        try:
            fsm.apply(d.op, d.payload, d.data, d.first_offset, d.last_offset, LOG)
        except FnodeNotTrackedError:
            pass
    return fsm, ops  # type: ignore[return-value]


async def test_what_is_recorded_plays_back_to_the_recorders_state(cluster) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        service = AppendService(c)
        author, fsm = new_author(), FSM(pb.FSMHints(log=LOG))
        rec = Recorder(service, LOG, fsm, author, write_head=await handoff(c, fsm, author))
        db = rec.create("store.db")
        big = bytes(range(256)) * (MAX_WRITE_OP // 256 * 2 + 3)  # (three operations' worth)
        rec.write_at(db, big, 0)
        rec.truncate(db, 4096)
        wal = rec.create("store.db-wal")
        rec.write_at(wal, b"frame", 0)
        nxt = rec.create("store.db.next")
        rec.write_at(nxt, b"vacuumed", 0)
        rec.rename("store.db.next", "store.db")  # (replaces the old file: it is gone)
        rec.unlink("store.db-wal")
        await rec.barrier()
        content = await c.read_all(LOG)
        fsm, ops = played(content)
        await service.aclose()
    writes = [d for d in ops if d.op.HasField("write")]
    assert b"".join(d.data for d in writes[:3]) == big and all(len(d.data) <= MAX_WRITE_OP for d in writes)
    assert {d.op.author for d in ops} == {author} and not ops[0].op.WhichOneof("op")  # (the handoff's no-op)
    assert fsm.links == rec.fsm.links == {"store.db": nxt}
    assert (fsm.next_seq_no, fsm.next_checksum) == (rec.fsm.next_seq_no, rec.fsm.next_checksum)
    assert (rec.statistics().bytes, rec.statistics().write_head) == (len(content) - ops[1].first_offset, len(content))
    # The player's hints are exact; the recorder's carry lower bounds of the same segments.
    exact, approx = fsm.build_hints(LOG), await rec.build_hints()
    assert [n.fnode for n in exact.live_nodes] == [n.fnode for n in approx.live_nodes] == [nxt]
    for e, a in zip(exact.live_nodes[0].segments, approx.live_nodes[0].segments, strict=True):
        assert (e.author, e.first_seq_no, e.last_seq_no, e.first_checksum) == (
            a.author, a.first_seq_no, a.last_seq_no, a.first_checksum
        )  # fmt: skip
        assert a.first_offset <= e.first_offset and a.last_offset == 0 < e.last_offset


async def test_a_recorder_fenced_by_a_handoff_lands_nothing_more(cluster) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        zombie_author, new = new_author(), new_author()
        fsm = FSM(pb.FSMHints(log=LOG))
        service = AppendService(c)
        zombie = Recorder(service, LOG, fsm, zombie_author, write_head=await handoff(c, fsm, zombie_author))
        zombie.write_at(zombie.create("store.db"), b"before", 0)
        await zombie.barrier()
        before = await c.read_all(LOG)
        newer = FSM(pb.FSMHints(log=LOG))
        for d in OpReader(0).feed(before):
            assert isinstance(d, Decoded)
            newer.apply(d.op, d.payload, d.data, d.first_offset, d.last_offset, LOG)
        head = await handoff(c, newer, new)
        zombie.write_at(zombie.fnode("store.db") or 0, b"after the handoff", 6)
        with pytest.raises(RecorderFencedError, match="newer primary took the log over"):
            await zombie.barrier()
        zombie.write_at(zombie.fnode("store.db") or 0, b"and again", 23)
        with pytest.raises(RecorderFencedError):
            await zombie.barrier()
        content = await c.read_all(LOG)
        (after,) = OpReader(len(before)).feed(content[len(before) :])  # only the newer primary's handoff
        assert content.startswith(before) and isinstance(after, Decoded)
        assert (after.op.author, after.op.WhichOneof("op"), after.last_offset) == (new, None, len(content))
        assert (await c.write_head(LOG)) == head
        await service.abort()


async def test_recording_what_never_happened_is_a_bug_not_a_record(cluster) -> None:
    await a_log(cluster)
    async with cluster.client() as c:
        service = AppendService(c)
        rec = Recorder(service, LOG, FSM(pb.FSMHints(log=LOG)), new_author(), write_head=0)
        with pytest.raises(RecorderError, match="never saw"):
            rec.unlink("nope")
        with pytest.raises(RecorderError, match="never saw"):
            rec.rename("nope", "other")
        with pytest.raises(RecorderError, match="fnode 12345, which is not live"):
            rec.link(12345, "x")
        db = rec.create("store.db")
        with pytest.raises(RecorderError, match="cannot record"):
            rec.link(db, "store.db")  # (the path exists)
        assert (rec.fsm.next_seq_no, rec.fsm.links) == (2, {"store.db": db}), "a refused op is not sequenced"
        await rec.barrier()
        fsm, _ = played(await c.read_all(LOG))
        assert fsm.links == {"store.db": db}
        await service.aclose()


class Batches:
    """What a recorder hands its AppendService, batch by batch (the layer under test is the recorder's
    batching; landing them is the AppendService's, tested with real brokers above)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.end = 0

    def expect(self, journal: str, check_registers: pb.LabelSelector) -> None:
        pass

    def append_nowait(self, journal: str, content: bytes) -> asyncio.Future[AppendResult]:
        self.sent.append(bytes(content))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(AppendResult(journal, self.end, self.end + len(content), {}, ""))
        self.end += len(content)
        return fut


async def test_a_rename_is_handed_over_in_one_batch_wherever_the_threshold_falls() -> None:
    """A log cut between a rename's ops (a crash, a fence) would leave neither file: the recorder hands
    a rename's ops (and a create over an existing file) over in one batch, wherever its threshold falls."""
    for size in range(APPEND_BYTES - 400, APPEND_BYTES + 4, 3):
        batches = Batches()
        rec = Recorder(batches, LOG, FSM(pb.FSMHints(log=LOG)), 7, write_head=0)  # type: ignore[arg-type]
        rec.write_at(rec.create("state.json"), b"old", 0)
        for _ in range(2):
            rec.write_at(rec.create("next.json"), b"x" * size, 0)
            rec.rename("next.json", "state.json")
        await rec.barrier()
        for content in batches.sent:
            ops = [d.op.WhichOneof("op") for d in OpReader(0).feed(content) if isinstance(d, Decoded)]
            for i, kind in enumerate(ops):
                if kind == "link":  # a rename: unlink state.json, link next.json's fnode, unlink next.json
                    assert ops[i - 1 : i + 2] == ["unlink", "link", "unlink"], (size, ops)
        assert len(batches.sent) > 1
