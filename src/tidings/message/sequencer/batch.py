"""The batch path, :meth:`Sequencer.sequence <tidings.message.sequencer.Sequencer.sequence>`: a run of
envelopes queued and dequeued in one call, with OUTSIDE_TXN messages that commit themselves delivered
inline (one mask test on the UUID) and every other message handed to the ring path."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tidings.message.sequencer.partial import _Partial
from tidings.message.sequencer.records import _OUTSIDE_COMMIT, Envelope, QueueOutcome, Replay
from tidings.message.uuid import _NODE_MASK, FLAGS_MASK, OUTSIDE_TXN, uuid_fields
from tidings.protocol.status import UsageError

_OUTSIDE_MASK = (0xF << 76) | (0x3 << 62) | (FLAGS_MASK << 48)  # a UUID's version, variant and flags
_OUTSIDE_BITS = (1 << 76) | (0b10 << 62) | (OUTSIDE_TXN << 48)  # v1, RFC 4122, OUTSIDE_TXN


class _BatchPath:
    """:meth:`sequence`, mixed into the Sequencer (:mod:`.ring`), whose state it shares."""

    _emit: _Partial | None
    _partials: dict[tuple[str, int], _Partial]
    _offsets: dict[str, int]
    _reread: dict[str, int]
    _delivered: int
    _outcomes: Counter[QueueOutcome]
    last_outcome: QueueOutcome | None

    if TYPE_CHECKING:

        def _queue(self, env: Envelope, fields: tuple[int, int, int] | None) -> Replay | None: ...

        def step(self) -> Envelope | None: ...

    def sequence(self, envs: Sequence[Envelope], start: int, out: list[Envelope]) -> int:
        """Queue ``envs[start:]`` and append every envelope they commit to `out`: :meth:`queue` then
        :meth:`dequeue` for each, with OUTSIDE_TXN messages that commit themselves handled inline (the
        batch form for readers; per-message work is what limits them).

        Stops after an envelope whose commit needs a replay and returns the index after it: the caller
        passes the range in :attr:`pending_replay` to :meth:`replay`, drains :meth:`dequeue` into `out`,
        and calls again from there. Returns ``len(envs)`` when all were queued.
        """
        if self._emit is not None:
            raise UsageError("committed messages remain to dequeue: drain dequeue() before queueing more")
        partials, offsets, queue, step = self._partials, self._offsets, self._queue, self.step
        append = out.append
        # The inline path, per message: a v1 UUID flagged OUTSIDE_TXN (one mask test on its 128 bits)
        # of a producer known in this journal with nothing pending. `known` caches the producers'
        # states for `journal` (a _Partial stays the same object while this call runs), and the
        # read-through offset is written once per stretch of inline deliveries (`through`).
        # A journal still being re-read up to its restored read-through offset (`_reread`) takes the
        # slow path (`inline` is False for it); the others are not held back by it.
        journal: str | None = None
        known: dict[int, _Partial] = {}
        reread = self._reread
        inline = False
        through = -1
        delivered = 0
        i, n = start, len(envs)
        try:
            while i < n:
                env = envs[i]
                i += 1
                u = env.uuid
                if u is not None:
                    x = u.int
                    if x & _OUTSIDE_MASK == _OUTSIDE_BITS:
                        if env.journal is not journal and env.journal != journal:
                            if through >= 0:
                                offsets[journal] = max(offsets[journal], through)  # type: ignore[index]  # (through >= 0: journal set)
                                through = -1
                            journal = env.journal
                            known = {}
                            inline = journal not in reread
                        if inline:
                            producer = x & _NODE_MASK
                            p = known.get(producer)
                            if p is None and journal in offsets:
                                p = partials.get((journal, producer))
                                if p is not None:
                                    known[producer] = p
                            if p is not None and p.begin == -1:
                                clock = (
                                    ((x >> 64) & 0xFFF) << 52
                                    | ((x >> 80) & 0xFFFF) << 36
                                    | (x >> 96) << 4
                                    | (x >> 58) & 0xF
                                )
                                if clock > p.min_clock:  # committed by itself: delivered
                                    p.min_clock = p.max_clock = clock
                                    through = env.end
                                    delivered += 1
                                    append(env)
                                    continue
                if through >= 0:  # (queue() reads the offsets)
                    offsets[journal] = max(offsets[journal], through)  # type: ignore[index]  # (through >= 0: journal set)
                    through = -1
                fields = None if u is None else uuid_fields(u.int)
                if queue(env, fields) is not None:
                    return i
                while (committed := step()) is not None:
                    append(committed)
                if not inline and journal is not None:
                    inline = journal not in reread  # (the slow path may have passed its read-through offset)
            return i
        finally:
            if through >= 0:
                offsets[journal] = max(offsets[journal], through)  # type: ignore[index]  # (through >= 0: journal set)
            if delivered:
                self._delivered += delivered
                self._outcomes[_OUTSIDE_COMMIT] += delivered
                self.last_outcome = _OUTSIDE_COMMIT
