"""The checkpoint-only scan, :meth:`Sequencer.advance <tidings.message.sequencer.Sequencer.advance>`:
a journal's messages folded into their producers' states without envelopes, ring or deliveries,
message by message here (the scalar fold) or per producer in array operations (the numpy fold,
:mod:`.advance_numpy`, for UUIDs given as a numpy array)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tidings.message.sequencer.partial import _Partial
from tidings.message.uuid import _NODE_MASK, ACK_TXN, CONTINUE_TXN, FLAGS_MASK
from tidings.protocol.status import UsageError

_V1_MASK = (0xF << 76) | (0x3 << 62)  # a UUID's version and variant
_V1_BITS = (1 << 76) | (0b10 << 62)  # v1, RFC 4122


class _AdvancePath:
    """:meth:`advance`, mixed into the Sequencer (:mod:`.ring`), whose state it shares."""

    _emit: _Partial | None
    _head: int
    _ring: list[Any]
    _partials: dict[tuple[str, int], _Partial]
    _offsets: dict[str, int]
    _reread: dict[str, int]

    def advance(self, journal: str, begins: Sequence[int], ends: Sequence[int], uuids: Any) -> None:  # noqa: C901  (one pass per message, inlined for speed: the rules are in rules.py)
        """Account for `journal`'s next messages, [begins[i], ends[i]) with UUID ``uuids[i]`` (its 128-bit
        int; None for none), as :meth:`queue` and :meth:`dequeue` would, delivering none: afterwards
        :meth:`checkpoint` is what it would be had they been read committed. For a planner that wants
        only the checkpoint at an offset (a Spark driver finding each partition's producer states), at a
        fraction of the cost: no envelopes, no ring, a few integer operations per message. `uuids` may
        also be a numpy array of rows (high, low 64 bits) (0, 0 for none): folded per producer in a few
        array operations (:mod:`.advance_numpy`). Not for a Sequencer that queues: pending messages are tracked
        by their first offset only."""
        if self._emit is not None or self._head or self._ring[0] is not None:
            raise UsageError("advance() is for a Sequencer that only advances: this one has queued messages")
        if not len(ends):
            return
        partials, offsets = self._partials, self._offsets
        offsets.setdefault(journal, begins[0])
        reread = self._reread.get(journal, -1)
        if not isinstance(uuids, list):
            from tidings.message.sequencer import advance_numpy  # (numpy: only for callers that have it)

            def partial_of(producer: int, last_ack: int) -> _Partial:
                p = partials.get((journal, producer))
                if p is None:
                    p = partials[(journal, producer)] = _Partial(journal, producer, last_ack)
                return p

            if ends[0] > reread and advance_numpy.fold(journal, begins, uuids, partial_of):
                if reread >= 0:
                    del self._reread[journal]
                offsets[journal] = max(offsets[journal], ends[-1])
                return
            uuids = [(int(h) << 64) | int(lo) for h, lo in uuids.tolist()]
        known: dict[int, _Partial] = {}
        for begin, end, x in zip(begins, ends, uuids, strict=True):
            if x is None or x & _V1_MASK != _V1_BITS:
                continue  # no v1 UUID: delivered at-least-once, no producer state
            clock = ((x >> 64) & 0xFFF) << 52 | ((x >> 80) & 0xFFFF) << 36 | (x >> 96) << 4 | (x >> 58) & 0xF
            if not clock:
                continue
            producer = x & _NODE_MASK
            flags = (x >> 48) & FLAGS_MASK
            p = known.get(producer)
            if p is None:
                p = partials.get((journal, producer))
                if p is None and end > reread:
                    p = partials[(journal, producer)] = _Partial(journal, producer, clock - 1)
                if p is not None:
                    known[producer] = p
            if end <= reread:  # (before a restored read-through: only rebuilds a pending transaction)
                if flags == CONTINUE_TXN and p is not None and 0 <= p.begin <= begin and clock > p.max_clock:
                    p.max_clock = clock
                continue
            assert p is not None  # (found or made above: end > reread)
            if flags == CONTINUE_TXN:
                if clock > p.max_clock:
                    if p.begin == -1:
                        p.begin = begin
                    p.max_clock = clock
            elif flags == ACK_TXN or clock > p.min_clock:  # (an ACK: committed or rolled back; OUTSIDE: delivered)
                p.min_clock = p.max_clock = clock
                p.begin = -1
        if ends[-1] > reread >= 0:
            del self._reread[journal]
        if offsets[journal] < ends[-1]:
            offsets[journal] = ends[-1]
