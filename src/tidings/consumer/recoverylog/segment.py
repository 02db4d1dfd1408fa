"""Segments: contiguous runs of a recovery log written by one author (Gazette's segment.go).

A recorder cannot know where its appends land (only a lower bound of the first offset, and no last
offset), nor that no other writer interleaves with it; a player sees the log as committed and knows
both exactly. A SegmentSet keeps the segments of one history in seq_no order, merging those that
overlap or touch (same author and log), and refuses a segment that contradicts the others: that is
how hints made by different processes are checked against each other before anything is played.
"""

from __future__ import annotations

import bisect
import dataclasses

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

__all__ = ["Segment", "SegmentError", "SegmentSet"]


class SegmentError(ValueError):
    """Segments that cannot belong to one history (a corrupt or mixed-up set of hints)."""


@dataclasses.dataclass(slots=True)
class Segment:
    author: int
    first_seq_no: int
    first_offset: int
    first_checksum: int
    last_seq_no: int
    last_offset: int  # exclusive; 0: unknown (a recorder's)
    log: str

    @classmethod
    def from_proto(cls, s: pb.Segment, implied_log: str = "") -> Segment:
        return cls(
            s.author,
            s.first_seq_no,
            s.first_offset,
            s.first_checksum,
            s.last_seq_no,
            s.last_offset,
            s.log or implied_log,
        )

    def to_proto(self, implied_log: str = "") -> pb.Segment:
        return pb.Segment(
            author=self.author,
            first_seq_no=self.first_seq_no,
            first_offset=self.first_offset,
            first_checksum=self.first_checksum,
            last_seq_no=self.last_seq_no,
            last_offset=self.last_offset,
            log="" if self.log == implied_log else self.log,
        )

    def validate(self) -> None:
        try:
            validate.segment(self.to_proto())
        except ValidationError as exc:
            raise SegmentError(f"invalid segment {self}: {exc}") from None


class SegmentSet:
    """Segments in strictly increasing, non-overlapping seq_no order; within one log, first and last
    offsets increase, and only a suffix of them may have an unknown (0) last offset."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def __len__(self) -> int:
        return len(self.segments)

    def __getitem__(self, i: int) -> Segment:
        return self.segments[i]

    def add(self, segment: Segment) -> None:
        """Add `segment`, merged with the ones it overlaps or continues; SegmentError if it contradicts them."""
        segment.validate()
        s = self.segments
        begin = bisect.bisect_left([x.first_seq_no for x in s], segment.first_seq_no)
        if begin > 0:  # (at most one earlier segment can reduce with it: first_seq_no strictly increases)
            merged = _reduce(s[begin - 1], segment)
            if merged is not None:
                segment, begin = merged, begin - 1
        end = begin
        while end < len(s):
            merged = _reduce(s[end], segment)
            if merged is None:
                break
            segment = merged
            end += 1
        s[begin:end] = [segment]

    def intersect(self, log: str, first_offset: int, last_offset: int) -> list[Segment]:
        """The segments overlapping the log range [first_offset, last_offset) (every segment must be of `log`)."""
        if last_offset < first_offset:
            raise ValueError(f"range [{first_offset}, {last_offset}) is mis-ordered")
        s = self.segments
        if any(x.log != log for x in s):
            raise ValueError(f"intersect over {log!r} of a set holding other logs")
        j = bisect.bisect_left([x.first_offset for x in s], last_offset)
        i = j
        while i > 0 and (s[i - 1].last_offset == 0 or s[i - 1].last_offset > first_offset):
            i -= 1
        return s[i:j]


def _reduce(a: Segment, b: Segment) -> Segment | None:
    """`a` and `b` merged into one segment; None if they are disjoint (or touch across authors or
    logs); SegmentError if they cannot be of one history. Neither is modified."""
    if a.first_seq_no > b.first_seq_no or (a.first_seq_no == b.first_seq_no and a.last_seq_no < b.last_seq_no):
        a, b = b, a
    # Now a starts first (or both start together and a ends last).
    same_log = a.log == b.log
    if a.first_seq_no < b.first_seq_no and same_log and a.first_offset > b.first_offset:
        raise SegmentError(f"expected increasing first offsets: {a} vs {b}")
    if a.first_seq_no < b.first_seq_no and a.last_offset == 0 and b.last_offset != 0:
        raise SegmentError(f"expected the earlier segment to know its last offset too: {a} vs {b}")
    if a.last_offset == 0 and not same_log:
        raise SegmentError(f"a segment of another log cannot follow one with an unknown last offset: {a} vs {b}")
    if same_log and (
        (a.last_seq_no <= b.last_seq_no and 0 != b.last_offset < a.last_offset)
        or (a.last_seq_no >= b.last_seq_no and 0 != a.last_offset < b.last_offset)
    ):
        raise SegmentError(f"expected increasing last offsets: {a} vs {b}")
    if a.first_seq_no == b.first_seq_no and a.first_checksum != b.first_checksum:
        raise SegmentError(f"expected equal first checksums: {a} vs {b}")
    if a.last_seq_no + 1 < b.first_seq_no:
        return None  # disjoint
    if a.last_seq_no + 1 == b.first_seq_no and (a.author != b.author or not same_log):
        return None  # adjacent, but another author's or log's
    if a.author != b.author:
        raise SegmentError(f"overlapping segments of different authors: {a} vs {b}")
    if not same_log:
        raise SegmentError(f"overlapping segments of different logs: {a} vs {b}")
    out = dataclasses.replace(a)
    if a.first_seq_no == b.first_seq_no and a.first_offset < b.first_offset:
        out.first_offset = b.first_offset  # (a lower bound: the tighter one)
    if a.last_seq_no == b.last_seq_no and a.last_offset == 0:
        out.last_offset = b.last_offset
    if a.last_seq_no < b.last_seq_no:
        out.last_seq_no, out.last_offset = b.last_seq_no, b.last_offset
    return out
