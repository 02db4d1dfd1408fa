"""Spool transitions, one at a time, and what `recover()` keeps after a kill: every replica validates every
proposal (DESIGN.md invariant 4), and a restart keeps every commit it answered and nothing past it
(invariants 1 and 2)."""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

import pytest

from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.fragment.spool import HEAD, Spool, SpoolFile, Transition, _read_head, apply_registers, recover
from tidings.fragment.store import store_for
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError


class Recorder:
    def __init__(self) -> None:
        self.commits: list[Fragment] = []
        self.completes: list[tuple[Fragment, bytes]] = []
        self.files: list[SpoolFile] = []
        self.primaries: list[bool] = []
        self.gaps: list[tuple[int, int]] = []

    def spool_commit(self, fragment: Fragment, file: SpoolFile) -> None:
        self.commits.append(fragment)

    def spool_complete(self, fragment: Fragment, file: SpoolFile, primary: bool) -> None:
        with file.reader() as r:
            self.completes.append((fragment, r.read()))
        self.files.append(file)
        self.primaries.append(primary)

    def spool_gap(self, begin: int, end: int) -> None:
        self.gaps.append((begin, end))


def frag(begin: int, end: int, content: bytes = b"", sum_: bytes | None = None) -> Fragment:
    s = sum_ if sum_ is not None else (hashlib.sha1(content).digest() if end > begin else EMPTY_SUM)
    return Fragment(journal="a/j", begin=begin, end=end, sum=s, codec=pb.NONE)


@pytest.fixture
def spool(tmp_path: Path) -> tuple[Spool, Recorder]:
    rec = Recorder()
    return Spool("a/j", tmp_path, rec), rec


def test_content_then_commit_adopts_fragment_and_registers(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"hello ", 0)
    sp.apply_content(b"world", 6)
    regs = labels.label_set({"owner": "x"})
    resp = sp.apply_proposal(frag(0, 11, b"hello world"), regs)
    assert resp.status == pb.OK
    assert sp.fragment == frag(0, 11, b"hello world") and sp.delta == 0 and sp.registers == regs
    assert rec.commits == [frag(0, 11, b"hello world")]


def test_last_chunk_and_its_commit_in_one_request(spool) -> None:
    sp, rec = spool
    sp.apply(pb.ReplicateRequest(content=b"hello ", content_delta=0))
    req = pb.ReplicateRequest(content=b"world", content_delta=6, proposal=frag(0, 11, b"hello world").to_proto())
    assert sp.apply(req).status == pb.OK
    assert sp.fragment == frag(0, 11, b"hello world") and sp.delta == 0
    bad = pb.ReplicateRequest(content=b"!", content_delta=0, proposal=frag(0, 12, b"hello world?").to_proto())
    assert sp.apply(bad).status == pb.PROPOSAL_MISMATCH  # the chunk is held as delta; the proposal is refused
    assert sp.fragment == frag(0, 11, b"hello world") and rec.commits == [frag(0, 11, b"hello world")]


def test_wrong_content_delta_aborts_the_stream(spool) -> None:
    sp, _ = spool
    sp.apply_content(b"abc", 0)
    with pytest.raises(ValidationError, match="expected delta 3"):
        sp.apply_content(b"d", 1)


def test_commit_with_wrong_sha1_is_a_mismatch(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"abc", 0)
    bad = frag(0, 3, sum_=hashlib.sha1(b"abd").digest())
    assert sp.classify(bad) is Transition.MISMATCH
    resp = sp.apply_proposal(bad, pb.LabelSet())
    assert resp.status == pb.PROPOSAL_MISMATCH
    assert Fragment.from_proto(resp.fragment) == frag(0, 0) and rec.commits == []


def test_commit_with_wrong_offset_is_a_mismatch(spool) -> None:
    sp, _ = spool
    sp.apply_content(b"abc", 0)
    assert sp.apply_proposal(frag(0, 4, b"abc"), pb.LabelSet()).status == pb.PROPOSAL_MISMATCH


def test_rollback_discards_uncommitted_content(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"keep", 0)
    sp.apply_proposal(frag(0, 4, b"keep"), pb.LabelSet())
    sp.apply_content(b"drop", 0)
    assert sp.apply_proposal(frag(0, 4, b"keep"), pb.LabelSet()).status == pb.OK  # == current: roll back
    assert sp.delta == 0
    sp.apply_content(b"more", 0)
    assert sp.apply_proposal(frag(0, 8, b"keepmore"), pb.LabelSet()).status == pb.OK
    assert rec.commits[-1] == frag(0, 8, b"keepmore")


def test_roll_completes_fragment_and_starts_empty_one(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), pb.LabelSet())
    assert sp.apply_proposal(frag(10, 10), pb.LabelSet()).status == pb.OK
    assert rec.completes == [(frag(0, 3, b"abc"), b"abc")]
    assert sp.fragment == frag(10, 10) and sp.end == 10
    sp.apply_content(b"xy", 0)
    assert sp.apply_proposal(frag(10, 12, b"xy"), pb.LabelSet()).status == pb.OK


def test_roll_backwards_is_a_mismatch(spool) -> None:
    sp, _ = spool
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), pb.LabelSet())
    assert sp.apply_proposal(frag(2, 2), pb.LabelSet()).status == pb.PROPOSAL_MISMATCH


def test_foreign_journal_is_a_mismatch(spool) -> None:
    sp, _ = spool
    other = Fragment(journal="other", begin=0, end=0, sum=EMPTY_SUM, codec=pb.NONE)
    assert sp.classify(other) is Transition.MISMATCH


def test_registers_subtract_then_union() -> None:
    """Gazette's order: subtract (a name goes when all its values match), then union (union's values win)."""
    cur = labels.label_set([("a", "1"), ("b", "2"), ("c", "3"), ("c", "4")])
    out = apply_registers(cur, labels.label_set({"a": "9", "b": "2"}), labels.label_set([("b", "2"), ("c", "3")]))
    assert labels.pairs(out) == [("a", "9"), ("b", "2"), ("c", "3"), ("c", "4")]  # c's values differ: kept
    assert labels.pairs(apply_registers(cur, pb.LabelSet(), labels.label_set([("c", "3"), ("c", "4")]))) == [
        ("a", "1"),
        ("b", "2"),
    ]


def test_roll_past_content_this_replica_never_got_reports_the_gap(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), pb.LabelSet())
    assert sp.apply_proposal(frag(3, 3), pb.LabelSet()).status == pb.OK  # a roll at our end: no gap
    assert sp.apply_proposal(frag(10, 10), pb.LabelSet()).status == pb.OK  # another replica got [3, 10)
    assert rec.gaps == [(3, 10)]


def test_rollback_requires_equal_registers(spool) -> None:
    """A re-proposal of the current fragment with other registers is a mismatch, not a rollback."""
    sp, _ = spool
    regs = labels.label_set({"owner": "x"})
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), regs)
    sp.apply_content(b"d", 0)
    assert sp.apply_proposal(frag(0, 3, b"abc"), labels.label_set({"owner": "y"})).status == pb.PROPOSAL_MISMATCH
    assert sp.delta == 1
    assert sp.apply_proposal(frag(0, 3, b"abc"), regs).status == pb.OK and sp.delta == 0


def test_a_proposal_beyond_the_spool_rolls_it_forward_and_takes_its_registers(spool) -> None:
    """A new peer catches up: a commit beyond it rolls it to the proposal's end (where it answers a
    mismatch with an empty fragment), and an empty proposal beyond it is adopted with its registers."""
    sp, rec = spool
    regs = labels.label_set({"epoch": "7"})
    resp = sp.apply_proposal(frag(100, 120, b"x" * 20), regs)
    assert resp.status == pb.PROPOSAL_MISMATCH and Fragment.from_proto(resp.fragment) == frag(120, 120)
    assert sp.registers == regs and rec.completes == []
    assert sp.apply_proposal(frag(120, 120), regs).status == pb.OK and sp.end == 120
    # An empty proposal at our end, from a peer that rolled: adopted; content is rolled back first.
    sp.apply_content(b"uncommitted", 0)
    assert sp.apply_proposal(frag(120, 120), regs).status == pb.OK and sp.delta == 0


def test_roll_at_the_end_completes_the_fragment_for_the_primary_flag(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), pb.LabelSet())
    assert sp.apply_proposal(frag(3, 3), pb.LabelSet(), primary=True).status == pb.OK
    assert rec.completes == [(frag(0, 3, b"abc"), b"abc")] and rec.primaries == [True]


def test_completed_file_keeps_its_name_until_persisted_and_readers_keep_reading(spool) -> None:
    """A file is unlinked only when the spool is done with it and a store holds it; an open reader keeps
    reading after that."""
    sp, rec = spool
    sp.apply_content(b"hello", 0)
    sp.apply_proposal(frag(0, 5, b"hello"), pb.LabelSet())
    live = sp.file
    assert live is not None
    live.mark_persisted(5)  # the old primary persisted [0, 5) while this spool still holds it
    assert live.path.exists(), "the live spool file must survive a listing that covers it"
    sp.apply_content(b" world", 0)
    sp.apply_proposal(frag(0, 11, b"hello world"), pb.LabelSet())
    assert live.pread(11, 0) == b"hello world"
    sp.apply_proposal(frag(11, 11), pb.LabelSet())  # roll: [0, 11) completes
    assert live.path.exists(), "[5, 11) is not persisted yet"
    assert live.path.name.endswith(".spool") and rec.files == [live]
    live.mark_persisted(11)
    assert not live.path.exists()
    assert live.pread(11, 0) == b"hello world", "the open descriptor still reads"


def test_recover_keeps_what_was_committed_and_nothing_past_it(tmp_path: Path) -> None:
    """A restarted broker recovers completed and current content up to the committed end recorded in
    HEAD, drops the uncommitted tail, and resumes there with the registers of that point (whether the
    journal kept those commits is checked later, by `broker.recovery`)."""
    r1, r2 = labels.label_set({"writer": "w1"}), labels.label_set({"writer": "w2"})
    sp = Spool("a/j", tmp_path, Recorder())
    sp.apply_content(b"first", 0)
    sp.apply_proposal(frag(0, 5, b"first"), r1)
    sp.apply_proposal(frag(5, 5), r1)  # completed, not persisted
    sp.apply_content(b"second", 0)
    sp.apply_proposal(frag(5, 11, b"second"), r1)
    sp.apply_content(b"third", 0)
    sp.apply_proposal(frag(5, 16, b"secondthird"), r2)  # committed here, never acknowledged
    sp.flush_head()  # as a peer does before answering the commit
    sp.apply_content(b"uncommitted tail", 0)
    del sp  # a kill -9: nothing is closed

    got = recover("a/j", tmp_path)
    assert [(f, fl.pread(100, 0)) for f, fl in got.fragments] == [
        (frag(0, 5, b"first"), b"first"),
        (frag(5, 16, b"secondthird"), b"secondthird"),
    ]
    assert got.end == 16 and got.registers == r2
    fresh = Spool("a/j", tmp_path, Recorder())
    fresh.resume(got.end, got.registers, got.codec)
    assert fresh.end == 16 and fresh.fragment.content_length == 0 and fresh.registers == r2
    again = recover("a/j", tmp_path)
    assert again.end == 16 and len(again.fragments) == 2, "recovery is repeatable"


def test_a_peer_recovers_every_commit_it_answered_whatever_the_primary_told_it(tmp_path: Path) -> None:
    """An acknowledged append survives its replicas' deaths, at the spool: a peer answers a commit, the
    primary tells the client OK, and both die before the primary's next request could tell the peer the
    acknowledged end. The peer's HEAD must still cover the commit (it is written before the answer), so a
    restart resumes past it: the append is neither lost nor its offsets handed out again (DESIGN.md
    invariants 1 and 2)."""
    directory = tmp_path / "peer"
    sp = Spool("j", directory)
    _peer_commit(sp, b"acked by all")  # [0, 12), told to a client by the primary
    del sp  # kill -9
    got = recover("j", directory)
    assert got.end == 12
    assert [(f.begin, f.end, fl.pread(100, 0)) for f, fl in got.fragments] == [(0, 12, b"acked by all")]


def test_a_head_written_before_committed_end_existed_recovers_to_its_acknowledged_end(tmp_path: Path) -> None:
    """A data dir from an earlier version: HEAD holds only the acknowledged end and its registers."""
    r1 = labels.label_set({"writer": "w1"})
    sp = Spool("a/j", tmp_path, Recorder())
    sp.apply(pb.ReplicateRequest(content=b"abcdef", content_delta=0, proposal=frag(0, 6, b"abcdef").to_proto()))
    old = pb.SpoolHead(acknowledged_end=3, registers=r1).SerializeToString()
    (tmp_path / HEAD).write_bytes(struct.pack("<II", zlib.crc32(old), len(old)) + old)
    got = recover("a/j", tmp_path)
    assert got.end == 3 and got.registers == r1
    assert [(f.begin, f.end, fl.pread(10, 0)) for f, fl in got.fragments] == [(0, 3, b"abc")]


def test_recover_forgets_an_earlier_journal_of_the_same_name(tmp_path: Path) -> None:
    sp = Spool("a/j", tmp_path, Recorder())
    sp.journal_revision = 7
    sp.apply_content(b"old", 0)
    sp.apply_proposal(frag(0, 3, b"old"), labels.label_set({"owner": "old"}))
    sp.flush_head()
    got = recover("a/j", tmp_path, journal_revision=9)  # deleted and created again since
    assert got.end == 0 and got.fragments == [] and list(tmp_path.iterdir()) == []


def test_recover_drops_damaged_files_and_head(tmp_path: Path) -> None:
    sp = Spool("a/j", tmp_path, Recorder())
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), pb.LabelSet())
    sp.apply_proposal(frag(3, 3), pb.LabelSet())
    sp.flush_head()
    completed = next(p for p in tmp_path.iterdir() if p.name.endswith(".spool"))
    completed.write_bytes(b"abX")  # corrupted
    assert recover("a/j", tmp_path).fragments == []
    (tmp_path / HEAD).write_bytes(b"\x00garbage")
    got = recover("a/j", tmp_path)
    assert got.fragments == [] and got.end == 0
    assert not completed.exists()


def test_a_live_spool_keeps_its_bytes_whatever_recover_does_elsewhere(tmp_path: Path) -> None:
    """The replica never runs `recover()` on a directory whose spool is live (a new replica waits for the
    old one's close); were it to, the live spool's committed bytes must still read back (it reads through
    its own descriptor)."""
    sp = Spool("a/j", tmp_path)
    sp.apply(pb.ReplicateRequest(content=b"0123456789", content_delta=0))
    sp.apply_proposal(sp.next_fragment(), pb.LabelSet())
    sp.flush_head()
    sp.apply(pb.ReplicateRequest(content=b"abcde", content_delta=0))
    sp.apply(pb.ReplicateRequest(content=b"fgh", content_delta=5))
    assert sp.apply_proposal(sp.next_fragment(), pb.LabelSet()).status == pb.OK
    assert sp.file is not None and sp.file.pread(18, 0) == b"0123456789abcdefgh"


# -- a journal assigned back to this broker while its previous replica's upload waits ------------


def _peer_commit(spool: Spool, content: bytes) -> None:
    """A peer's view of one append: its content, then the primary's commit proposal, recorded in HEAD
    before the answer (as `serve_replicate` does)."""
    spool.apply(pb.ReplicateRequest(content=content, content_delta=0))
    proposal = spool.next_fragment()
    resp = spool.apply(pb.ReplicateRequest(proposal=proposal.to_proto(), registers=pb.LabelSet(), acknowledge=True))
    spool.flush_head()
    assert resp.status == pb.OK


def test_recovering_a_reassigned_journal_leaves_the_earlier_replicas_pending_persist_intact(tmp_path) -> None:
    """A peer's replica closes (the journal moved away) with its HEAD one acknowledgement behind its
    completed fragment, which goes to the persister with the replica delay. The journal comes back to
    this broker before that upload: the new replica's `recover()` cuts that very file (same inode) to
    the HEAD's offset, so the pending upload of [0, 10) can never match its fragment again."""
    directory = tmp_path / "spools" / "j"
    spool = Spool("j", directory)
    _peer_commit(spool, b"acked")  # [0, 5)
    _peer_commit(spool, b"later")  # [5, 10): the primary acknowledged it; this peer never heard so
    held = spool.file
    assert held is not None
    spool.close()  # the replica closes: the completed fragment is submitted with the replica delay
    fragment = Fragment(journal="j", begin=0, end=10, sum=hashlib.sha1(b"ackedlater").digest(), codec=pb.NONE)

    recover("j", directory)  # the journal is assigned here again: a new replica recovers the same dir

    store = store_for(f"file://{tmp_path / 'store'}/")
    with held.reader() as raw:
        store.persist(fragment, raw)  # what the persister does when the delay ends
    assert store.exists(fragment)


def test_a_late_acknowledgement_to_a_closed_spool_is_recorded_and_holds_no_descriptor(tmp_path: Path) -> None:
    """A replica closes its spool while its pipeline's teardown still reads acknowledgements: one that
    arrives then is (or is about to be) told to a client, so HEAD covers it (close flushes); no descriptor
    stays open.
    (The journal's next replica on this broker recovers only after that teardown.)"""
    directory = tmp_path / "spools" / "j"
    sp = Spool("j", directory)
    sp.apply(pb.ReplicateRequest(content=b"hello", content_delta=0))
    sp.apply_proposal(sp.next_fragment(), pb.LabelSet(), primary=True)  # the primary's commit, not yet flushed
    sp.close()
    assert _read_head(directory / HEAD, "j").committed_end == 5
    sp.flush_head()  # the late acknowledgement
    assert sp._head_fd is None


def test_a_file_unlinked_while_it_is_recovered_is_skipped_not_recreated(tmp_path: Path, monkeypatch) -> None:
    """An earlier replica's upload may finish, and unlink its file, while a new replica recovers the
    directory: recovery skips the file (the store has it) instead of failing, or re-creating it
    empty, which would then be served and uploaded as zeros."""
    from tidings.fragment import spool as spool_module

    directory = tmp_path / "spools" / "j"
    sp = Spool("j", directory)
    _peer_commit(sp, b"hello")
    sp.close()
    real = spool_module._sha1_of

    def sha1_then_unlinked(path: Path, length: int) -> bytes | None:
        digest = real(path, length)
        path.unlink()
        return digest

    monkeypatch.setattr(spool_module, "_sha1_of", sha1_then_unlinked)
    rec = recover("j", directory)
    assert rec.fragments == []
    assert not any(p.name.endswith(".spool") for p in directory.iterdir())
