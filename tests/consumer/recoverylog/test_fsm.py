"""The recovery log's FSM (consumer/recoverylog/fsm.py): only a linear, consistent history applies.
An op out of sequence, with a wrong checksum (also over its write data) or by an author the hints do
not expect changes nothing; an op of a file gone by the hints' time is stepped over; and hints built
by one FSM let a new one rebuild exactly its live files from the hinted segments alone, skipping
dead branches of the log. Cases after Gazette's fsm_test.go."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest

from tidings.consumer.recoverylog.fsm import (
    FSM,
    ChecksumMismatchError,
    ExpectedHintedFnodeError,
    FnodeNotTrackedError,
    HintsError,
    LinkExistsError,
    NoSuchLinkError,
    NotHintedAuthorError,
    WrongSeqNoError,
)
from tidings.consumer.recoverylog.ops import checksum, encode
from tidings.protocol import protocol_pb2 as pb

LOG = "shards/recovery/a"


@dataclass
class Entry:
    op: pb.RecordedOp
    payload: bytes
    data: bytes
    first: int
    last: int


@dataclass
class History:
    """A log as a recorder writes it: each op sequenced after the last one, its checksum chained, at
    increasing offsets. `fork()` gives a second writer starting at the same point (a race)."""

    next_seq_no: int = 1
    next_checksum: int = 0
    offset: int = 0
    entries: list[Entry] = field(default_factory=list)

    def op(self, author: int, data: bytes = b"", **kind: object) -> Entry:
        op = pb.RecordedOp(seq_no=self.next_seq_no, checksum=self.next_checksum, author=author, **kind)  # type: ignore[arg-type]
        payload = op.SerializeToString()
        size = len(encode(op, data))
        entry = Entry(op, payload, data, self.offset, self.offset + size)
        self.next_seq_no += 1
        self.next_checksum = checksum(self.next_checksum, payload, data)
        self.offset += size
        self.entries.append(entry)
        return entry

    def create(self, author: int, path: str) -> Entry:
        return self.op(author, create=pb.RecordedOp.Create(path=path))

    def link(self, author: int, fnode: int, path: str) -> Entry:
        return self.op(author, link=pb.RecordedOp.Link(fnode=fnode, path=path))

    def unlink(self, author: int, fnode: int, path: str) -> Entry:
        return self.op(author, unlink=pb.RecordedOp.Link(fnode=fnode, path=path))

    def write(self, author: int, fnode: int, data: bytes, at: int = 0) -> Entry:
        return self.op(author, data, write=pb.RecordedOp.Write(fnode=fnode, offset=at, length=len(data)))

    def noop(self, author: int) -> Entry:
        return self.op(author)

    def fork(self) -> History:
        return History(self.next_seq_no, self.next_checksum, self.offset, [])


def apply(fsm: FSM, e: Entry) -> None:
    fsm.apply(e.op, e.payload, e.data, e.first, e.last, LOG)


def state(fsm: FSM) -> tuple:
    return fsm.next_seq_no, fsm.next_checksum, copy.deepcopy(fsm.nodes), dict(fsm.links)


def test_a_fresh_log_applies_from_op_one() -> None:
    h = History()
    fsm = FSM(pb.FSMHints(log=LOG))
    apply(fsm, h.create(100, "store.db"))
    apply(fsm, h.link(100, 1, "store.db-link"))
    assert (fsm.next_seq_no, fsm.next_checksum, fsm.last_log) == (3, h.next_checksum, LOG)
    assert fsm.links == {"store.db": 1, "store.db-link": 1}


@pytest.mark.parametrize(
    ("mangle", "error"),
    [
        pytest.param(lambda op: setattr(op, "seq_no", op.seq_no + 1), WrongSeqNoError, id="a later seq_no"),
        pytest.param(lambda op: setattr(op, "seq_no", op.seq_no - 1), WrongSeqNoError, id="a duplicate"),
        pytest.param(lambda op: setattr(op, "checksum", op.checksum ^ 1), ChecksumMismatchError, id="checksum"),
    ],
)
def test_an_op_out_of_sequence_changes_nothing(mangle, error) -> None:
    h = History()
    fsm = FSM(pb.FSMHints(log=LOG))
    apply(fsm, h.create(100, "a"))
    e = h.write(100, 1, b"page")
    before = state(fsm)
    bad = copy.deepcopy(e.op)
    mangle(bad)
    with pytest.raises(error):
        fsm.apply(bad, bad.SerializeToString(), e.data, e.first, e.last, LOG)
    assert state(fsm) == before
    apply(fsm, e)  # (the right op still applies)


def test_the_checksum_chain_covers_write_data() -> None:
    h = History()
    fsm = FSM(pb.FSMHints(log=LOG))
    apply(fsm, h.create(100, "a"))
    e = h.write(100, 1, b"page")
    nxt = h.write(100, 1, b"more", 4)
    fsm.apply(e.op, e.payload, b"pagf", e.first, e.last, LOG)  # a corrupted byte of data
    with pytest.raises(ChecksumMismatchError):
        apply(fsm, nxt)


def test_links_and_unlinks() -> None:
    h = History()
    fsm = FSM(pb.FSMHints(log=LOG))
    apply(fsm, h.create(100, "a"))
    apply(fsm, h.create(100, "b"))
    before = state(fsm)
    for bad, error in [
        (h.fork().create(100, "a"), LinkExistsError),
        (h.fork().link(100, 2, "a"), LinkExistsError),
        (h.fork().unlink(100, 2, "nope"), NoSuchLinkError),
        (h.fork().unlink(100, 1, "b"), NoSuchLinkError),  # (b is fnode 2's)
    ]:
        with pytest.raises(error):
            apply(fsm, bad)
        assert state(fsm) == before
    # An op of a file the FSM does not know steps the FSM (it applied; nothing to play).
    with pytest.raises(FnodeNotTrackedError):
        apply(fsm, h.unlink(100, 15, "x"))
    assert fsm.next_seq_no == 4
    apply(fsm, h.link(200, 2, "b2"))  # (another author: a new segment of fnode 2)
    apply(fsm, h.unlink(200, 2, "b"))
    assert fsm.links == {"a": 1, "b2": 2}
    assert [(s.author, s.first_seq_no, s.last_seq_no) for s in fsm.nodes[2].segments] == [(100, 2, 2), (200, 4, 5)]
    apply(fsm, h.unlink(200, 2, "b2"))  # the last link: the file is gone
    assert set(fsm.nodes) == {1} and fsm.links == {"a": 1}
    assert [n.fnode for n in fsm.build_hints(LOG).live_nodes] == [1]


def build_a_history_with_a_dead_branch() -> tuple[History, list[Entry]]:
    """Author 1 writes two files and deletes one; a zombie (author 9) races with author 2's handoff and
    loses (its ops are mis-sequenced after the handoff's); author 2 writes on. Returns the log and the
    ops in log order, dead branch included."""
    h = History()
    log = [h.create(1, "old.db"), h.write(1, 1, b"x" * 10), h.create(1, "store.db"), h.write(1, 3, b"y" * 20)]
    log.append(h.unlink(1, 1, "old.db"))
    zombie = h.fork()
    log.append(h.noop(2))  # the handoff
    log.append(zombie.write(9, 3, b"z" * 5))  # lands after it: the same seq_no, another history
    log.append(h.write(2, 3, b"w" * 7, 20))
    log.append(h.create(2, "store.db-wal"))
    log.append(h.write(2, 9 - 1, b"v" * 3))  # (the WAL is fnode 8: seq_no of its create)
    return h, log


def replay(fsm: FSM, log: list[Entry]) -> list[str]:
    """Apply the log as a player does: a refused op is skipped, and named."""
    outcomes = []
    for e in log:
        try:
            apply(fsm, e)
            outcomes.append("applied")
        except FnodeNotTrackedError:
            outcomes.append("stepped")
        except (WrongSeqNoError, NotHintedAuthorError, ChecksumMismatchError) as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


def test_hints_rebuild_the_live_files_from_their_segments_only() -> None:
    _, log = build_a_history_with_a_dead_branch()
    full = FSM(pb.FSMHints(log=LOG))
    assert replay(full, log) == ["applied"] * 6 + ["WrongSeqNoError"] + ["applied"] * 3
    hints = full.build_hints(LOG)
    assert [n.fnode for n in hints.live_nodes] == [3, 8]

    hinted = FSM(hints)
    assert (hinted.next_seq_no, hinted.has_remaining_hints) == (3, True)  # (ops 1-2 are of a deleted file)
    outcomes = replay(hinted, log)
    assert outcomes[:2] == ["WrongSeqNoError"] * 2  # never needed: a player seeks past them
    # Ops 5-6 (the unlink of a deleted file, the handoff) are in no live file's segment: the FSM jumps from op
    # 4 to op 7, so they and the zombie's op are another history than the hinted one.
    assert (
        outcomes[2:]
        == ["applied", "applied", "NotHintedAuthorError", "WrongSeqNoError", "NotHintedAuthorError"] + ["applied"] * 3
    )
    assert not hinted.has_remaining_hints
    assert hinted.links == full.links and hinted.nodes.keys() == full.nodes.keys()
    assert hinted.build_hints(LOG) == hints


def test_a_dead_branch_between_hinted_segments_is_jumped_over() -> None:
    h = History()
    h.create(1, "a")
    mid = [h.write(2, 1, b"dead") for _ in range(3)]  # (author 2's ops of fnode 1: not hinted below)
    h.write(1, 1, b"live")
    hints = pb.FSMHints(
        log=LOG,
        live_nodes=[
            pb.FnodeSegments(
                fnode=1,
                segments=[
                    pb.Segment(author=1, first_seq_no=1, last_seq_no=1, first_checksum=0, first_offset=0),
                    pb.Segment(
                        author=1, first_seq_no=5, last_seq_no=5, first_checksum=h.entries[4].op.checksum,
                        first_offset=h.entries[4].first,
                    ),
                ],
            )
        ],
    )  # fmt: skip
    fsm = FSM(hints)
    apply(fsm, h.entries[0])
    assert (fsm.next_seq_no, fsm.next_checksum) == (5, h.entries[4].op.checksum)  # jumped over 2-4
    with pytest.raises(NotHintedAuthorError):
        apply(fsm, mid[0])
    apply(fsm, h.entries[4])
    assert not fsm.has_remaining_hints


def test_an_op_where_the_hints_create_a_file_must_be_that_create() -> None:
    h = History()
    h.create(100, "a")
    h.write(100, 1, b"x")
    h.create(100, "b")
    hints = FSM(pb.FSMHints(log=LOG))
    for e in h.entries:
        apply(hints, e)
    fsm = FSM(hints.build_hints(LOG))
    apply(fsm, h.entries[0])
    apply(fsm, h.entries[1])
    other = h.fork()
    other.next_seq_no, other.next_checksum = 3, h.entries[2].op.checksum
    with pytest.raises(ExpectedHintedFnodeError):
        apply(fsm, other.write(100, 1, b"not a create"))
    apply(fsm, h.entries[2])


def pseg(author: int, first: int, last: int, first_offset: int = 0, last_offset: int = 0, log: str = "") -> pb.Segment:
    return pb.Segment(
        author=author, first_seq_no=first, last_seq_no=last, first_offset=first_offset, last_offset=last_offset, log=log
    )


def node(fnode: int, *segments: pb.Segment) -> pb.FnodeSegments:
    return pb.FnodeSegments(fnode=fnode, segments=list(segments))


@pytest.mark.parametrize(
    ("hints", "error"),
    [
        pytest.param(pb.FSMHints(), "no log", id="no log"),
        pytest.param(
            pb.FSMHints(log=LOG, live_nodes=[node(13, pseg(1, 14, 14))]),
            "must start at its creation", id="fnode is not its first seq_no",
        ),
        pytest.param(
            pb.FSMHints(log=LOG, live_nodes=[node(4, pseg(1, 4, 4)), node(2, pseg(1, 2, 2))]),
            "out of order", id="fnodes out of order",
        ),
        pytest.param(
            pb.FSMHints(log=LOG, live_nodes=[node(2, pseg(1, 2, 7, 200, 700)), node(4, pseg(3, 4, 9, 400, 901))]),
            "different authors", id="segments of two authors overlap",
        ),
        pytest.param(
            pb.FSMHints(log=LOG, live_nodes=[node(2, pseg(1, 2, 2, log="other/log"))]),
            "is not their last segment's", id="the last segment is of another log",
        ),
    ],
)  # fmt: skip
def test_hints_that_describe_no_history_are_refused(hints: pb.FSMHints, error: str) -> None:
    with pytest.raises(HintsError, match=error):
        FSM(hints)


def test_a_file_created_within_the_hinted_segments_but_gone_by_the_hints_is_stepped_over() -> None:
    h = History()
    h.create(1, "store.db")
    h.create(1, "tmp")  # (between two hinted files: deleted before the hints were built)
    h.create(1, "store.db-wal")
    h.write(1, 1, b"page")
    h.unlink(1, 2, "tmp")
    full = FSM(pb.FSMHints(log=LOG))
    for e in h.entries:
        apply(full, e)
    hinted = FSM(full.build_hints(LOG))
    assert replay(hinted, h.entries) == ["applied", "stepped", "applied", "applied", "stepped"]
    assert hinted.links == full.links == {"store.db": 1, "store.db-wal": 3} and not hinted.has_remaining_hints
