"""Spool transitions, one at a time (Invariant 4: every replica validates every proposal)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.fragment.spool import Spool, Transition, apply_registers
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError


class Recorder:
    def __init__(self) -> None:
        self.commits: list[Fragment] = []
        self.completes: list[tuple[Fragment, bytes]] = []
        self.gaps: list[tuple[int, int]] = []

    def spool_commit(self, fragment: Fragment, path: str) -> None:
        self.commits.append(fragment)

    def spool_complete(self, fragment: Fragment, path: str) -> None:
        self.completes.append((fragment, Path(path).read_bytes()))

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


def test_registers_union_then_subtract() -> None:
    cur = labels.label_set({"a": "1", "b": "2"})
    out = apply_registers(cur, labels.label_set({"a": "9"}), labels.label_set({"b": ""}))
    assert labels.pairs(out) == [("a", "9")]


def test_roll_past_content_this_replica_never_got_reports_the_gap(spool) -> None:
    sp, rec = spool
    sp.apply_content(b"abc", 0)
    sp.apply_proposal(frag(0, 3, b"abc"), pb.LabelSet())
    assert sp.apply_proposal(frag(3, 3), pb.LabelSet()).status == pb.OK  # a roll at our end: no gap
    assert sp.apply_proposal(frag(10, 10), pb.LabelSet()).status == pb.OK  # another replica got [3, 10)
    assert rec.gaps == [(3, 10)]
