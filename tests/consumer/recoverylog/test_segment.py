"""Segments of a recovery log (consumer/recoverylog/segment.py): a SegmentSet merges the segments of
one history in any order they arrive, and refuses any that contradicts it (another author or log over
the same ops, offsets that go backwards, different checksums for one op), so hints from different
processes are checked against each other before anything is played. Cases from Gazette's
segment_test.go."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tidings.consumer.recoverylog.segment import Segment, SegmentError, SegmentSet, _reduce
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

A, B = "log/A", "log/B"


def seg(author: int, first: int, last: int, first_offset: int, last_offset: int = 0, log: str = A, checksum: int = 0):
    return Segment(author, first, first_offset, checksum, last, last_offset, log)


def model() -> list[Segment]:
    return [seg(0xA, 5, 10, 500, 1001), seg(0xB, 11, 11, 1100, 1101), seg(0xB, 13, 15, 1300, 1501)]


def a_set(segments: list[Segment]) -> SegmentSet:
    s = SegmentSet()
    s.segments = [dataclasses.replace(x) for x in segments]
    return s


def add_in_every_order(base: list[Segment], more: list[Segment]) -> list[Segment]:
    """Add `more` to a set of `base` in every order: each must give the same set, which is returned."""
    results = []
    for order in itertools.permutations(more):
        s = a_set(base)
        for x in order:
            s.add(dataclasses.replace(x))
        results.append(s.segments)
    assert all(r == results[0] for r in results), results
    return results[0]


MODEL = seg(0xFEFE, 10, 10, 0, 1, checksum=0xABAB)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        pytest.param({"author": 0}, "author", id="author zero"),
        pytest.param({"first_seq_no": 0}, "first_seq_no", id="seq zero"),
        pytest.param({"first_seq_no": -1}, "first_seq_no", id="seq negative"),
        pytest.param({"first_offset": -1}, "first_offset", id="offset negative"),
        pytest.param({"last_seq_no": 9}, "last_seq_no", id="last before first"),
        pytest.param({"first_offset": 100, "last_offset": 99}, "last_offset", id="last offset before first"),
        pytest.param({"log": ""}, "log", id="no log"),
    ],
)
def test_a_segment_that_cannot_be_is_refused_naming_its_field(change: dict, error: str) -> None:
    MODEL.validate()
    with pytest.raises(SegmentError, match=error):
        dataclasses.replace(MODEL, **change).validate()
    dataclasses.replace(MODEL, last_offset=0).validate()  # (a recorder's: last offset unknown)


def test_hints_may_not_repeat_their_log_in_a_segment() -> None:
    hints = pb.FSMHints(log=A, live_nodes=[pb.FnodeSegments(fnode=10, segments=[MODEL.to_proto(A)])])
    validate.fsm_hints(hints)
    hints.live_nodes[0].segments[0].log = A
    with pytest.raises(ValidationError, match=r"segments\[0\]\.log: repeats the hints' log"):
        validate.fsm_hints(hints)


@pytest.mark.parametrize(
    ("a", "b", "expect"),
    [
        pytest.param(
            seg(1, 2, 7, 200, 700, checksum=0x22), seg(1, 4, 9, 400, 901, checksum=0x44),
            seg(1, 2, 9, 200, 901, checksum=0x22), id="overlap",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 4, 9, 100, 901, checksum=0x44),
            "increasing first offsets", id="overlap, first offset goes back",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 4, 9, 400, 700, checksum=0x44),
            "increasing last offsets", id="overlap, last offset goes back",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 0, checksum=0x22), seg(1, 4, 9, 400, 901, checksum=0x44),
            "earlier segment to know its last offset", id="overlap, earlier one's last offset unknown",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(2, 4, 9, 400, 901, checksum=0x44),
            "different authors", id="overlap, two authors",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 4, 9, 400, 901, B, checksum=0x44),
            "different logs", id="overlap, two logs",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 3, 6, 300, 0, checksum=0x33),
            seg(1, 2, 7, 200, 701, checksum=0x22), id="covered",
        ),
        pytest.param(seg(1, 2, 4, 200, 401, checksum=0x22), seg(1, 6, 7, 600, checksum=0x66), None, id="disjoint"),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 4, 7, 400, 0, checksum=0x44),
            seg(1, 2, 7, 200, 701, checksum=0x22), id="equal right, a known last offset kept",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 4, 7, 400, 702, checksum=0x44),
            "increasing last offsets", id="equal right, last offsets differ",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 2, 9, 210, 901, checksum=0x22),
            seg(1, 2, 9, 210, 901, checksum=0x22), id="equal left, the tighter first offset",
        ),
        pytest.param(
            seg(1, 2, 7, 200, 701, checksum=0x22), seg(1, 2, 9, 210, 901, checksum=0xBAD),
            "equal first checksums", id="equal left, checksums differ",
        ),
        pytest.param(
            seg(1, 2, 7, 190, 701, checksum=0x22), seg(1, 2, 7, 200, 0, checksum=0x22),
            seg(1, 2, 7, 200, 701, checksum=0x22), id="identity",
        ),
        pytest.param(
            seg(1, 2, 4, 200, 401, checksum=0x22), seg(1, 5, 7, 500, 701, checksum=0x55),
            seg(1, 2, 7, 200, 701, checksum=0x22), id="adjacent",
        ),
        pytest.param(
            seg(1, 2, 4, 200, 401, checksum=0x22), seg(2, 5, 7, 500, 701, checksum=0x55), None,
            id="adjacent, two authors",
        ),
        pytest.param(
            seg(1, 2, 4, 200, 401, checksum=0x22), seg(1, 5, 7, 500, 701, B, checksum=0x55), None,
            id="adjacent, two logs",
        ),
        pytest.param(
            seg(1, 2, 4, 200, 0, checksum=0x22), seg(1, 5, 7, 500, 0, B, checksum=0x55),
            "another log cannot follow one with an unknown last offset", id="adjacent, two logs, last offset unknown",
        ),
    ],
)  # fmt: skip
def test_two_segments_reduce_to_one_or_are_refused_whatever_their_order(a, b, expect) -> None:
    for x, y in ((a, b), (b, a)):
        if isinstance(expect, str):
            with pytest.raises(SegmentError, match=expect):
                _reduce(x, y)
        else:
            assert _reduce(x, y) == expect


def test_a_set_built_in_any_order_is_the_same_set() -> None:
    assert add_in_every_order([], model()) == model()


def test_segments_between_others_are_inserted() -> None:
    more = [
        seg(0xF, 1, 4, 100, 401),
        seg(0xF, 12, 12, 1200, 1201),
        seg(0xF, 16, 18, 1600, 1801),
        seg(0xF, 19, 20, 20, 21, B),
    ]
    assert add_in_every_order(model(), more) == [
        seg(0xF, 1, 4, 100, 401),
        seg(0xA, 5, 10, 500, 1001),
        seg(0xB, 11, 11, 1100, 1101),
        seg(0xF, 12, 12, 1200, 1201),
        seg(0xB, 13, 15, 1300, 1501),
        seg(0xF, 16, 18, 1600, 1801),
        seg(0xF, 19, 20, 20, 21, B),
    ]


def test_overlapping_segments_merge() -> None:
    more = [seg(0xA, 1, 4, 100, 401), seg(0xB, 12, 12, 1200, 1201), seg(0xB, 16, 18, 1600)]
    assert add_in_every_order(model(), more) == [seg(0xA, 1, 10, 100, 1001), seg(0xB, 11, 18, 1100)]


def test_covered_segments_change_nothing() -> None:
    more = [seg(0xA, 5, 9, 500), seg(0xA, 6, 10, 600), seg(0xB, 11, 11, 1100), seg(0xB, 13, 14, 1300)]
    assert add_in_every_order(model(), more) == model()


def test_ops_one_at_a_time_extend_their_segment() -> None:
    more = [
        seg(0xB, 16, 16, 1600, 1601),
        seg(0xB, 17, 17, 1700, 1701),
        seg(0xB, 18, 18, 1800, 1801),
        seg(0xC, 19, 19, 1900),
        seg(0xC, 20, 20, 2000),
    ]
    assert add_in_every_order(model(), more) == [
        seg(0xA, 5, 10, 500, 1001),
        seg(0xB, 11, 11, 1100, 1101),
        seg(0xB, 13, 18, 1300, 1801),
        seg(0xC, 19, 20, 1900),
    ]


@pytest.mark.parametrize(
    ("segment", "error"),
    [
        pytest.param(seg(0xC, 4, 5, 400, 501), "different authors", id="over a's ops, another author"),
        pytest.param(seg(0xA, 10, 11, 1000, 1101), "different authors", id="across two authors (a)"),
        pytest.param(seg(0xB, 10, 11, 1000, 1101), "different authors", id="across two authors (b)"),
        pytest.param(seg(0xC, 15, 15, 1500, 1501), "different authors", id="over b's last op, another author"),
        pytest.param(seg(0xA, 4, 5, 400, 501, "wrong"), "different logs", id="another log"),
        pytest.param(seg(0xB, 12, 12, 1200, 0), "earlier segment to know its last offset", id="unknown last offset"),
        pytest.param(seg(0xB, 12, 12, 1050, 1200), "increasing first offsets", id="first offset goes back"),
        pytest.param(seg(0xA, 3, 3, 300, 1050), "increasing last offsets", id="last offset goes back"),
    ],
)
def test_a_segment_contradicting_the_set_is_refused_and_changes_nothing(segment: Segment, error: str) -> None:
    s = a_set(model())
    with pytest.raises(SegmentError, match=error):
        s.add(segment)
    assert s.segments == model()


@pytest.mark.parametrize(
    ("first", "last", "expect"),
    [
        (0, 100000, slice(0, 3)),
        (0, 500, slice(0, 0)),
        (0, 501, slice(0, 1)),
        (1000, 1001, slice(0, 1)),
        (1000, 1100, slice(0, 1)),
        (1000, 1101, slice(0, 2)),
        (1000, 1300, slice(0, 2)),
        (1000, 1301, slice(0, 3)),
        (1000, 100000, slice(0, 3)),
        (1001, 1001, slice(1, 1)),
        (1001, 1100, slice(1, 1)),
        (1001, 1101, slice(1, 2)),
        (1100, 1101, slice(1, 2)),
        (1101, 1101, slice(2, 2)),
        (1101, 1300, slice(2, 2)),
        (1101, 1301, slice(2, 3)),
        (1300, 1301, slice(2, 3)),
        (1300, 100000, slice(2, 3)),
        (1500, 100000, slice(2, 3)),
        (1501, 100000, slice(3, 3)),
        (10000, 100000, slice(3, 3)),
    ],
)
def test_the_segments_a_log_range_overlaps(first: int, last: int, expect: slice) -> None:
    assert a_set(model()).intersect(A, first, last) == model()[expect]
