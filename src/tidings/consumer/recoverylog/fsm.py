"""The FSM of a recovery log (Gazette's fsm.go): applies recorded operations in order, checking each
one's sequence number, checksum and author, and tracks the live files (fnodes), their links and the
log segments holding their operations, from which it builds hints.

Only a linear, consistent history applies: an op with the wrong sequence number or checksum (a
duplicate from a retried append, an op of a recorder that lost a race with a handoff) changes
nothing. Built from hints, the FSM follows exactly the history the hints describe: it expects each
hinted segment's author, jumps over log ranges no live file needs, and steps over operations of
files that are gone by the hints' point in time (FnodeNotTrackedError: applied, but the player
writes nothing).
"""

from __future__ import annotations

import dataclasses

from tidings.consumer.recoverylog.ops import checksum
from tidings.consumer.recoverylog.segment import Segment, SegmentError, SegmentSet
from tidings.protocol import protocol_pb2 as pb

__all__ = [
    "FSM",
    "ChecksumMismatchError",
    "ExpectedHintedFnodeError",
    "FSMError",
    "FnodeNotTrackedError",
    "HintsError",
    "LinkExistsError",
    "NoSuchLinkError",
    "NotHintedAuthorError",
    "WrongSeqNoError",
]


class FSMError(Exception):
    """An operation the FSM refuses (nothing changed), or, for FnodeNotTrackedError, steps over."""


class WrongSeqNoError(FSMError):
    pass


class ChecksumMismatchError(FSMError):
    pass


class NotHintedAuthorError(FSMError):
    """An op by another author than the next hinted segment's: a dead branch of the log's history."""


class FnodeNotTrackedError(FSMError):
    """An op of a file the hints say is gone: the FSM steps over it, the player writes nothing."""


class ExpectedHintedFnodeError(FSMError):
    """An op other than a Create at the sequence number where a hinted fnode is created."""


class LinkExistsError(FSMError):
    pass


class NoSuchLinkError(FSMError):
    pass


class HintsError(ValueError):
    """Hints that describe no possible history (not an FSM's)."""


@dataclasses.dataclass(slots=True)
class _Node:
    links: set[str]
    segments: list[Segment]


class FSM:
    """Expects op `next_seq_no` with `next_checksum`; `nodes` are the live fnodes, `links` their paths."""

    def __init__(self, hints: pb.FSMHints) -> None:
        if not hints.log:
            raise HintsError("hints name no log")
        fnodes, segments = _live_log_segments(hints)
        self.next_seq_no = 1
        self.next_checksum = 0
        self.last_log = hints.log
        self.nodes: dict[int, _Node] = {}
        self.links: dict[str, int] = {}
        self._hinted_fnodes = fnodes  # in order: created within the hinted segments
        self._hinted_segments = list(segments)  # in order: the history to follow
        if segments:
            self.next_seq_no, self.next_checksum = segments[0].first_seq_no, segments[0].first_checksum

    @property
    def has_remaining_hints(self) -> bool:
        return bool(self._hinted_segments or self._hinted_fnodes)

    @property
    def hinted_segments(self) -> tuple[Segment, ...]:
        """The hinted segments not yet read through, in order."""
        return tuple(self._hinted_segments)

    @property
    def next_hinted_segment(self) -> Segment | None:
        return self._hinted_segments[0] if self._hinted_segments else None

    def apply(
        self,
        op: pb.RecordedOp,
        payload: bytes,
        data: bytes | memoryview = b"",
        first_offset: int = 0,
        last_offset: int = 0,
        log: str = "",
    ) -> None:
        """Apply `op` (its message bytes `payload`, a Write's `data`), read from `log` at [first_offset,
        last_offset) (a recorder passes a lower bound and 0). Raises an FSMError if it does not apply:
        then nothing changed, except for FnodeNotTrackedError, raised after the FSM stepped."""
        log = log or self.last_log
        hinted = self._hinted_segments
        if hinted and hinted[0].author != op.author:
            raise NotHintedAuthorError(
                f"op {op.seq_no} is by author {op.author:08x}, the hints' next by {hinted[0].author:08x}"
            )
        if op.seq_no != self.next_seq_no:
            raise WrongSeqNoError(f"op {op.seq_no}, expected {self.next_seq_no}")
        if op.checksum != self.next_checksum:
            raise ChecksumMismatchError(
                f"op {op.seq_no} has checksum {op.checksum:08x}, expected {self.next_checksum:08x}"
            )
        at = _At(op.seq_no, op.author, op.checksum, first_offset, last_offset, log)
        kind = op.WhichOneof("op")
        skipped: FnodeNotTrackedError | None = None
        try:
            if kind == "create":
                self._create(op.create.path, at)
            elif self._hinted_fnodes and self._hinted_fnodes[0] == op.seq_no:
                raise ExpectedHintedFnodeError(f"op {op.seq_no} is a {kind or 'no-op'}; the hints create a file there")
            elif kind == "link":
                self._link(op.link.fnode, op.link.path, at)
            elif kind == "unlink":
                self._unlink(op.unlink.fnode, op.unlink.path, at)
            elif kind == "write":
                self._touch(op.write.fnode, at)
            elif kind == "truncate":
                self._touch(op.truncate.fnode, at)
        except FnodeNotTrackedError as exc:
            skipped = exc
        self.next_seq_no += 1
        self.next_checksum = checksum(self.next_checksum, payload, data)
        self.last_log = log
        if hinted and hinted[0].last_seq_no < self.next_seq_no:
            hinted.pop(0)  # this segment is done: the next hinted one (skipping dead log between)
            if hinted:
                self.next_seq_no, self.next_checksum = hinted[0].first_seq_no, hinted[0].first_checksum
        if skipped is not None:
            raise skipped

    def _create(self, path: str, at: _At) -> None:
        if path in self.links:
            raise LinkExistsError(f"op {at.seq_no} creates {path!r}, which exists")
        fnode = at.seq_no
        if self._hinted_fnodes:
            if self._hinted_fnodes[0] != fnode:
                raise FnodeNotTrackedError(f"op {at.seq_no} creates {path!r}, gone by the hints' time")
            self._hinted_fnodes.pop(0)
        self.nodes[fnode] = _Node({path}, [at.segment()])
        self.links[path] = fnode

    def _link(self, fnode: int, path: str, at: _At) -> None:
        if path in self.links:
            raise LinkExistsError(f"op {at.seq_no} links {path!r}, which exists")
        node = self._node(fnode, at)
        node.links.add(path)
        self.links[path] = fnode
        _extend(node.segments, at)

    def _unlink(self, fnode: int, path: str, at: _At) -> None:
        node = self._node(fnode, at)
        if path not in node.links:
            raise NoSuchLinkError(f"op {at.seq_no} unlinks {path!r}, not a link of fnode {fnode}")
        del self.links[path]
        node.links.discard(path)
        _extend(node.segments, at)
        if not node.links:
            del self.nodes[fnode]

    def _touch(self, fnode: int, at: _At) -> None:
        _extend(self._node(fnode, at).segments, at)

    def _node(self, fnode: int, at: _At) -> _Node:
        node = self.nodes.get(fnode)
        if node is None:
            raise FnodeNotTrackedError(f"op {at.seq_no} is of fnode {fnode}, not live")
        return node

    def build_hints(self, log: str) -> pb.FSMHints:
        """Hints from which a new FSM (and player) rebuilds this one's live files, reading `log`."""
        hints = pb.FSMHints(log=log)
        for fnode in sorted(self.nodes):
            hints.live_nodes.append(
                pb.FnodeSegments(fnode=fnode, segments=[s.to_proto(log) for s in self.nodes[fnode].segments])
            )
        return hints


@dataclasses.dataclass(slots=True)
class _At:
    """Where an op was: what a segment is extended with."""

    seq_no: int
    author: int
    checksum: int
    first_offset: int
    last_offset: int
    log: str

    def segment(self) -> Segment:
        return Segment(
            self.author, self.seq_no, self.first_offset, self.checksum, self.seq_no, self.last_offset, self.log
        )


def _extend(segments: list[Segment], at: _At) -> None:
    last = segments[-1] if segments else None
    if last is not None and last.author == at.author and last.log == at.log:
        last.last_seq_no, last.last_offset = at.seq_no, at.last_offset
    else:
        segments.append(at.segment())


def _live_log_segments(hints: pb.FSMHints) -> tuple[list[int], list[Segment]]:
    """The hinted fnodes in order, and the segments of the log that hold them (Gazette's LiveLogSegments)."""
    fnodes: list[int] = []
    segments = SegmentSet()
    for node in hints.live_nodes:
        if not node.segments or node.segments[0].first_seq_no != node.fnode:
            raise HintsError(f"fnode {node.fnode}: its first segment must start at its creation (seq_no {node.fnode})")
        if fnodes and fnodes[-1] >= node.fnode:
            raise HintsError(f"fnodes out of order: {fnodes[-1]} then {node.fnode}")
        fnodes.append(node.fnode)
        for s in node.segments:
            try:
                segments.add(Segment.from_proto(s, hints.log))
            except SegmentError as exc:
                raise HintsError(f"fnode {node.fnode}: {exc}") from None
    if segments and segments[-1].log != hints.log:
        raise HintsError(f"the hints' log {hints.log!r} is not their last segment's {segments[-1].log!r}")
    return fnodes, segments.segments
