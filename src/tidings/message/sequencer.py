"""Sequencer: turns read-uncommitted messages into read-committed ones (gazette-exactly-once.txt, *Message UUIDs*).

A journal holds duplicates (appends are at-least-once), messages of transactions still pending, and messages of
transactions rolled back. The Sequencer is fed the :class:`Envelope` of every message in journal read order and
hands back each committed message exactly once, in journal order per producer, never a rolled-back one
(DESIGN.md invariant 7). It is pure and synchronous (no I/O, no clock, no threads; not thread-safe): the caller
reads journals.

Rules, per (journal, producer), as in Gazette's ``message/sequencer.go``. The state is ``last_ack`` (the clock of
the producer's last acknowledgement) and ``begin`` (offset of its first pending CONTINUE_TXN message, or -1):

* A message with a clock <= ``last_ack`` is a duplicate and is dropped (ACK_TXN: see below).
* OUTSIDE_TXN commits itself: it is delivered at once and becomes the new ``last_ack``. Pending CONTINUE_TXN
  messages of the same producer are dropped (Gazette's treatment of mixing the two; logged).
* CONTINUE_TXN is pending. One whose clock is not above the producer's largest pending clock is a duplicate.
* ACK_TXN with a clock above ``last_ack`` commits the pending messages with clocks <= its own, in journal order,
  and rolls back those with larger clocks (an aborted transaction). An ACK_TXN with clock == ``last_ack`` rolls back
  every pending message; one below ``last_ack`` does too and resets ``last_ack`` to its clock: an upstream
  checkpoint went backwards, so exactly-once weakens to at-least-once until the producer catches up (logged).
  ACK_TXN messages themselves are never delivered: they carry no application data.
* A message without a v1 UUID (absent, nil, another version, or a zero clock) is delivered at once:
  at-least-once, as for types that opt out of UUIDs.

Committed messages are dequeued as soon as their ACK is read, even when other producers' transactions are still
pending: no head-of-line blocking. Pending messages live in a ring buffer of ``ring_size`` envelopes. When a
committed transaction is no longer wholly in the ring, :meth:`Sequencer.queue` returns a :class:`Replay` naming the
journal range to re-read: [the first pending message, the first one still in the ring) -- at most the ACK's offset.
The caller reads that range and passes the envelopes to :meth:`Sequencer.replay`; only then does it dequeue::

    for env in read_uncommitted(journal):
        replay = seq.queue(env)
        if replay is not None:
            seq.replay(read_uncommitted(replay.journal, replay.begin, replay.end))
        for committed in seq.dequeue():
            handle(committed)

(:meth:`Sequencer.feed` does the first three steps.) A message returned by :meth:`Sequencer.step` (or yielded by
:meth:`Sequencer.dequeue`) counts as delivered from then on, including for a checkpoint taken before the next step.

**Checkpoints.** :meth:`Sequencer.checkpoint` returns a :class:`Checkpoint` (a msgspec Struct; ``to_json()``) with,
per journal, the read-through offset (every message before it was queued and is accounted for; a transaction still
being dequeued keeps its ACK beyond it, so a restore reads that ACK again) and each producer's ``{last_ack, begin}``.
:meth:`Sequencer.restore` resumes from it: re-read each journal from :meth:`Checkpoint.resume_offset` =
min(read-through, producers' ``begin``) and exactly the messages not yet delivered come out. Messages before the
read-through offset only rebuild pending transactions (they were queued before), so old ACKs and duplicates there
change nothing. Re-reading from the read-through offset alone also works, as in Gazette: pending transactions that
began earlier are then replayed on demand.

**Producer horizon.** Every producer ever seen costs a little state, so a checkpoint (or :meth:`Sequencer.prune`)
forgets producers that went quiet, as Gazette does: a producer is dropped when its newest clock is older than the
newest ``last_ack`` of any producer in the same journal minus ``producer_horizon`` seconds. The horizon is measured
in producer clock time (the UUID timestamps), not in wall time or offsets, so it is deterministic for a journal.
Dropping a producer forgets its pending transaction (which also stops it pinning the resume offset); a duplicate of
its messages read later would be delivered again, so pick a horizon well beyond the longest retry or transaction.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

import msgspec

from tidings.message.uuid import _NODE_MASK, ACK_TXN, CONTINUE_TXN, FLAGS_MASK, OUTSIDE_TXN, uuid_fields
from tidings.protocol.status import UsageError, ValidationError

__all__ = [
    "Checkpoint",
    "DEFAULT_PRODUCER_HORIZON",
    "DEFAULT_RING_SIZE",
    "Envelope",
    "JournalCheckpoint",
    "ProducerState",
    "QueueOutcome",
    "Replay",
    "ReplayRequiredError",
    "Sequencer",
    "SequencerStatistics",
]

log = logging.getLogger(__name__)

DEFAULT_RING_SIZE: Final = 1024
DEFAULT_PRODUCER_HORIZON: Final = 24 * 3600.0
"""Seconds of producer clock time after which a quiet producer is forgotten (see the module docstring)."""


class Envelope(msgspec.Struct, frozen=True, gc=False):
    """A message read from `journal` at byte range [begin, end), with its UUID (None: no UUID).

    Not tracked by Python's cyclic garbage collector (``gc=False``): readers make one per message,
    and tracked objects make every collection slower. An Envelope must not be part of a reference
    cycle (its message should not refer back to it).
    """

    journal: str
    begin: int
    end: int
    uuid: UUID | None
    message: Any


class Replay(msgspec.Struct, frozen=True):
    """A journal range [begin, end) the caller must re-read and pass to :meth:`Sequencer.replay`."""

    journal: str
    begin: int
    end: int


class ProducerState(msgspec.Struct, frozen=True):
    """A producer's state in one journal: the clock of its last ACK, its first pending offset or -1,
    and the newest clock seen of it (for the producer horizon; -1 in older checkpoints: last_ack)."""

    last_ack: int
    begin: int = -1
    newest: int = -1


class JournalCheckpoint(msgspec.Struct):
    """A journal's read-through offset and its producers' states, keyed by ProducerID in hex (12 digits)."""

    read_through: int
    producers: dict[str, ProducerState] = {}

    def resume_offset(self) -> int:
        """Where to re-read this journal from after a restore: min(read-through, pending producers' begin)."""
        begins = [p.begin for p in self.producers.values() if p.begin >= 0]
        return min([self.read_through, *begins])


class Checkpoint(msgspec.Struct):
    """What a Sequencer needs to resume without loss or duplicates; JSON-serializable (``to_json``)."""

    journals: dict[str, JournalCheckpoint] = {}

    def resume_offset(self, journal: str) -> int:
        """Where to re-read `journal` from after a restore (0 for a journal the checkpoint does not know)."""
        jc = self.journals.get(journal)
        return 0 if jc is None else jc.resume_offset()

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Checkpoint:
        return msgspec.json.decode(data, type=cls)


class QueueOutcome(enum.Enum):
    """What :meth:`Sequencer.queue` decided about an envelope (Gazette's QueueOutcome, plus tidings' own)."""

    OUTSIDE_ALREADY_ACKED = "outsideAlreadyAcked"
    OUTSIDE_COMMIT = "outsideCommit"
    CONTINUE_ALREADY_ACKED = "continueAlreadyAcked"
    CONTINUE_TXN_CLOCK_LARGER = "continueTxnClockLarger"
    CONTINUE_BEGIN_SPAN = "continueBeginSpan"
    CONTINUE_EXTEND_SPAN = "continueExtendSpan"
    ACK_ROLLBACK = "ackRollback"
    ACK_EMPTY = "ackEmpty"
    ACK_COMMIT_RING = "ackCommitRing"
    ACK_COMMIT_REPLAY = "ackCommitReplay"
    NO_UUID_COMMIT = "noUuidCommit"
    """No v1 UUID: delivered at once (at-least-once)."""
    REREAD_PENDING = "rereadPending"
    """Before a restored read-through offset: rebuilds a pending transaction."""
    REREAD_IGNORED = "rereadIgnored"
    """Before a restored read-through offset: already accounted for by the checkpoint."""

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own
    # __hash__ is Python code, and outcomes are counted for every message queued).
    __hash__ = object.__hash__


_OUTSIDE_COMMIT = QueueOutcome.OUTSIDE_COMMIT
_OUTSIDE_MASK = (0xF << 76) | (0x3 << 62) | (FLAGS_MASK << 48)  # a UUID's version, variant and flags
_OUTSIDE_BITS = (1 << 76) | (0b10 << 62) | (OUTSIDE_TXN << 48)  # v1, RFC 4122, OUTSIDE_TXN
_V1_MASK = (0xF << 76) | (0x3 << 62)  # a UUID's version and variant
_V1_BITS = (1 << 76) | (0b10 << 62)  # v1, RFC 4122


class ReplayRequiredError(UsageError):
    """:meth:`Sequencer.dequeue` was called before the range in `.replay` was passed to :meth:`Sequencer.replay`."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        super().__init__(
            f"journal {replay.journal}: a committed transaction left the ring; re-read [{replay.begin}, {replay.end}) "
            "and pass the envelopes to Sequencer.replay() before dequeuing (or raise ring_size)"
        )


@dataclass(frozen=True)
class SequencerStatistics:
    """Counters since the Sequencer was made: queue outcomes by name, deliveries, replays."""

    outcomes: Mapping[str, int]
    delivered: int
    replays: int
    replayed_envelopes: int
    producers: int
    ring_size: int


class _Partial:
    """A (journal, producer)'s sequencing state; ring_start..ring_stop link its pending envelopes in the ring."""

    __slots__ = ("begin", "journal", "max_clock", "min_clock", "producer", "restored", "ring_start", "ring_stop")

    def __init__(self, journal: str, producer: int, last_ack: int, begin: int = -1, restored: int = -1) -> None:
        self.journal = journal
        self.producer = producer
        self.min_clock = last_ack  # exclusive lower bound: the last acknowledged (or delivered) clock
        self.max_clock = last_ack  # inclusive upper bound: the largest pending clock, or the committing ACK's
        self.begin = begin
        self.restored = restored  # the newest clock a checkpoint knew (its pending messages may not be re-read)
        self.ring_start = -1
        self.ring_stop = -1

    @property
    def newest(self) -> int:
        """The newest clock seen of this producer: what the producer horizon judges it by."""
        return max(self.max_clock, self.restored)

    def reset(self, last_ack: int) -> None:
        self.min_clock = self.max_clock = last_ack
        self.begin = self.ring_start = self.ring_stop = -1


_Candidate = tuple[Envelope, int]  # an envelope and its clock


class Sequencer:
    """Sequences read-uncommitted envelopes into read-committed ones; see the module docstring.

    **Parameters:**

    * **ring_size** - how many pending envelopes to keep; a transaction longer than the ring is replayed.
    * **producer_horizon** - seconds of producer clock time before a quiet producer is forgotten; None: never.
    * **checkpoint** - resume from this checkpoint (same as :meth:`restore`).
    """

    def __init__(
        self,
        ring_size: int = DEFAULT_RING_SIZE,
        *,
        producer_horizon: float | None = DEFAULT_PRODUCER_HORIZON,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        if ring_size < 1:
            raise ValueError(f"ring_size must be at least 1, got {ring_size}")
        if producer_horizon is not None and producer_horizon <= 0:
            raise ValueError(f"producer_horizon must be positive seconds or None, got {producer_horizon}")
        self.ring_size = ring_size
        self.producer_horizon = producer_horizon
        self._ring: list[tuple[Envelope, _Partial, int] | None] = [None] * ring_size
        self._next: list[int] = [-1] * ring_size
        self._head = 0
        self._partials: dict[tuple[str, int], _Partial] = {}
        self._offsets: dict[str, int] = {}  # read-through offset per journal
        self._reread: dict[str, int] = {}  # restored read-through offsets not yet passed
        # Sequences begun or extended since clear_pending (Gazette's), by the generation they last were.
        self._pending: dict[tuple[str, int], int] = {}
        self.generation = 0  # the caller's count of its reads, if it keeps one (see pending_generation)
        # Dequeue state: the partial being emitted, the end offset of its committing envelope, the largest clock
        # considered so far, the next candidate, and the replay (requested range, supplied iterator).
        self._emit: _Partial | None = None
        self._emit_end = 0
        self._seen_max = 0
        self._lookahead: _Candidate | None = None
        self._fast: _Candidate | None = None  # an OUTSIDE_TXN envelope queued on the fast path
        self._need_replay: Replay | None = None
        self._replay_range: Replay | None = None
        self._replay_it: Iterator[Envelope] | None = None
        self.last_outcome: QueueOutcome | None = None
        self._outcomes: Counter[QueueOutcome] = Counter()
        self._delivered = 0
        self._replays = 0
        self._replayed = 0
        if checkpoint is not None:
            self._restore(checkpoint)

    @classmethod
    def restore(
        cls,
        checkpoint: Checkpoint,
        ring_size: int = DEFAULT_RING_SIZE,
        *,
        producer_horizon: float | None = DEFAULT_PRODUCER_HORIZON,
    ) -> Sequencer:
        """A Sequencer resuming from `checkpoint`; re-read each journal from ``checkpoint.resume_offset(journal)``."""
        return cls(ring_size, producer_horizon=producer_horizon, checkpoint=checkpoint)

    def _restore(self, checkpoint: Checkpoint) -> None:
        for journal, jc in checkpoint.journals.items():
            self._offsets[journal] = jc.read_through
            self._reread[journal] = jc.read_through
            for hex_id, state in jc.producers.items():
                try:
                    producer = int(hex_id, 16)
                except ValueError:
                    producer = -1
                if len(hex_id) != 12 or producer < 0:
                    raise ValidationError(f"journals.{journal}.producers", f"{hex_id!r} is not a 12-digit hex id")
                self._partials[(journal, producer)] = _Partial(
                    journal, producer, state.last_ack, state.begin, state.newest
                )

    # --- Queueing ----------------------------------------------------------------------------------------------

    @property
    def dequeuing(self) -> bool:
        """True while committed messages remain to dequeue (and :meth:`queue` must wait)."""
        return self._emit is not None

    @property
    def has_pending(self) -> bool:
        """A transaction begun or extended since :meth:`clear_pending` awaits its ACK (Gazette's HasPending):
        assuming a live producer, more is coming, and a consumer transaction may wait for it."""
        return bool(self._pending)

    def clear_pending(self) -> None:
        """Forget the pending transactions seen so far (a consumer transaction closed without their ACKs:
        the next one need not wait for them either)."""
        self._pending.clear()

    def pending_generation(self) -> int:
        """The newest `generation` in which a transaction still awaiting its ACK was begun or extended
        (-1: none). A caller that reads ahead of what it consumes numbers its reads in `generation`:
        a consumer transaction that began after read G then waits for an ACK only if this is above G
        (has_pending and clear_pending are the same question for a caller that does not read ahead)."""
        return max(self._pending.values(), default=-1)

    @property
    def pending_replay(self) -> Replay | None:
        """The range that must be passed to :meth:`replay` before dequeuing, if any."""
        return self._need_replay

    def queue(self, env: Envelope) -> Replay | None:
        """Apply the next read-uncommitted envelope; return the range to replay if its commit needs one.

        Raises UsageError while committed messages remain to dequeue.
        """
        if self._emit is not None:
            raise UsageError("committed messages remain to dequeue: drain dequeue() before queueing more")
        u = env.uuid
        return self._queue(env, None if u is None else uuid_fields(u.int))

    def _queue(self, env: Envelope, fields: tuple[int, int, int] | None) -> Replay | None:
        """`queue` of an envelope whose UUID fields (or None) are already unpacked."""
        journal = env.journal
        offsets = self._offsets
        if journal not in offsets:
            offsets[journal] = env.begin  # nothing before the first envelope read was queued
        u = env.uuid
        if self._reread:
            read_through = self._reread.get(journal)
            if read_through is not None:
                if env.end <= read_through:
                    return self._queue_reread(env, fields)
                del self._reread[journal]
        if fields is None or fields[1] == 0:
            if u is not None and u.int:
                log.debug("journal %s offset %d: not a v1 UUID (%s); delivering at-least-once", journal, env.begin, u)
            transient = _Partial(journal, -1, 0)
            transient.max_clock = 1
            return self._commit(QueueOutcome.NO_UUID_COMMIT, transient, env, (env, 1))
        producer, clock, flags = fields
        key = (journal, producer)
        p = self._partials.get(key)
        if p is None:
            p = self._partials[key] = _Partial(journal, producer, clock - 1)

        if flags == CONTINUE_TXN:
            if clock <= p.min_clock:
                outcome = QueueOutcome.CONTINUE_ALREADY_ACKED
            elif clock <= p.max_clock:
                outcome = QueueOutcome.CONTINUE_TXN_CLOCK_LARGER
            else:
                if p.begin == -1:
                    p.begin = env.begin
                    outcome = QueueOutcome.CONTINUE_BEGIN_SPAN
                else:
                    outcome = QueueOutcome.CONTINUE_EXTEND_SPAN
                self._add_at_head(env, p, clock)
                p.max_clock = clock
                self._pending[key] = self.generation
        elif flags == ACK_TXN:
            self._pending.pop(key, None)
            if clock <= p.min_clock:
                if clock < p.min_clock:
                    log.warning(
                        "journal %s offset %d: ACK_TXN of producer %012x has clock %d below its last ACK %d: "
                        "an upstream checkpoint went backwards (loss of exactly-once)",
                        journal, env.begin, producer, clock, p.min_clock,
                    )  # fmt: skip
                p.reset(clock)
                outcome = QueueOutcome.ACK_ROLLBACK
            elif p.begin == -1:
                p.reset(clock)
                outcome = QueueOutcome.ACK_EMPTY
            else:
                p.max_clock = clock
                first = -1 if p.ring_start == -1 else self._ring[p.ring_start][0].begin
                if first == p.begin:
                    return self._commit(QueueOutcome.ACK_COMMIT_RING, p, env, None)
                replay = Replay(journal, p.begin, env.begin if first == -1 else first)
                return self._commit(QueueOutcome.ACK_COMMIT_REPLAY, p, env, None, replay)
        else:
            if flags != OUTSIDE_TXN:
                log.warning("journal %s offset %d: unexpected UUID flags %#x; handled as OUTSIDE_TXN", journal,
                            env.begin, flags)  # fmt: skip
            if clock <= p.min_clock:
                outcome = QueueOutcome.OUTSIDE_ALREADY_ACKED
            elif p.begin == -1 and self._replay_it is None:
                # The common case, on a fast path: a message that commits itself, nothing pending.
                self._emit = p
                self._emit_end = env.end
                self._fast = (env, clock)
                self._outcomes[_OUTSIDE_COMMIT] += 1
                self.last_outcome = _OUTSIDE_COMMIT
                return None
            else:
                if p.begin != -1:
                    log.warning(
                        "journal %s offset %d: OUTSIDE_TXN of producer %012x after its pending CONTINUE_TXN messages "
                        "(mixed committed and transactional publishing?); the pending messages are dropped",
                        journal, env.begin, producer,
                    )  # fmt: skip
                p.max_clock = clock
                p.ring_start = p.ring_stop = -1
                self._pending.pop(key, None)
                return self._commit(QueueOutcome.OUTSIDE_COMMIT, p, env, (env, clock))
        offsets[journal] = env.end
        self._outcomes[outcome] += 1
        self.last_outcome = outcome
        return None

    def _queue_reread(self, env: Envelope, fields: tuple[int, int, int] | None) -> None:
        """An envelope before the restored read-through offset: only rebuild pending transactions from it."""
        outcome = QueueOutcome.REREAD_IGNORED
        if fields is not None and fields[2] == CONTINUE_TXN:
            producer, clock, _ = fields
            p = self._partials.get((env.journal, producer))
            if p is not None and p.begin != -1 and env.begin >= p.begin and clock > p.max_clock:
                self._add_at_head(env, p, clock)
                p.max_clock = clock
                outcome = QueueOutcome.REREAD_PENDING
        self._outcomes[outcome] += 1
        self.last_outcome = outcome

    def _commit(
        self,
        outcome: QueueOutcome,
        p: _Partial,
        env: Envelope,
        first: _Candidate | None,
        replay: Replay | None = None,
    ) -> Replay | None:
        """Start dequeuing `p`'s committed messages (through p.max_clock), committed by `env`."""
        self._emit = p
        self._emit_end = env.end
        self._seen_max = p.min_clock
        self._lookahead = first
        self._need_replay = self._replay_range = replay
        if replay is not None:
            self._replays += 1
        self._outcomes[outcome] += 1
        self.last_outcome = outcome
        return replay

    def _add_at_head(self, env: Envelope, p: _Partial, clock: int) -> None:
        """Store a pending envelope at the ring's head, evicting the oldest one there."""
        ring, nxt, head = self._ring, self._next, self._head
        old = ring[head]
        if old is not None:
            owner = old[1]
            if owner.ring_start == head:  # evicting the owner's oldest pending envelope
                if owner.ring_start == owner.ring_stop:
                    owner.ring_start = owner.ring_stop = -1
                else:
                    owner.ring_start = nxt[head]
        ring[head] = (env, p, clock)
        nxt[head] = -1
        if p.ring_stop == -1:
            p.ring_start = head
        else:
            nxt[p.ring_stop] = head
        p.ring_stop = head
        self._head = head + 1 if head + 1 < self.ring_size else 0

    # --- Dequeueing --------------------------------------------------------------------------------------------

    def replay(self, envelopes: Iterable[Envelope]) -> None:
        """Supply the envelopes of the range :meth:`queue` returned, read again from the journal, in order.

        They are consumed lazily by :meth:`step`; reading stops at the range's end, so a longer iterable is fine.
        May be called again (with a fresh read of the range) if the previous iterable failed.
        """
        if self._emit is None or self._replay_range is None:
            raise UsageError("no replay was requested: call replay() only after queue() returned a Replay")
        self._replay_it = iter(envelopes)
        self._need_replay = None

    def step(self) -> Envelope | None:
        """The next committed envelope (delivered from now on), or None when the committed sequence is done."""
        p = self._emit
        if p is None:
            return None
        fast = self._fast
        if fast is not None:  # an OUTSIDE_TXN message (see queue)
            env, clock = fast
            self._fast = None
            self._emit = None
            self._deliver_outside(p, env, clock)
            return env
        if self._need_replay is not None:
            raise ReplayRequiredError(self._need_replay)
        cur = self._lookahead
        if cur is None:
            cur = self._next_candidate(p)
            if cur is None:
                self._finish(p)
                return None
        nxt = self._next_candidate(p)
        self._lookahead = nxt
        if nxt is None:
            self._finish(p)
        else:
            # A checkpoint taken now resumes after `cur`, at the next committed message of the sequence.
            p.min_clock = cur[1]
            p.begin = nxt[0].begin
        self._delivered += 1
        return cur[0]

    def dequeue(self) -> Iterator[Envelope]:
        """Yield every committed envelope made ready by the last :meth:`queue`; exhaust it before queueing again."""
        step = self.step
        while (env := step()) is not None:
            yield env

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
                                offsets[journal] = max(offsets[journal], through)  # type: ignore[index]
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
                    offsets[journal] = max(offsets[journal], through)  # type: ignore[index]
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
                offsets[journal] = max(offsets[journal], through)  # type: ignore[index]
            if delivered:
                self._delivered += delivered
                self._outcomes[_OUTSIDE_COMMIT] += delivered
                self.last_outcome = _OUTSIDE_COMMIT

    def advance(self, journal: str, begins: Sequence[int], ends: Sequence[int], uuids: Any) -> None:
        """Account for `journal`'s next messages, [begins[i], ends[i]) with UUID ``uuids[i]`` (its 128-bit
        int; None for none), as :meth:`queue` and :meth:`dequeue` would, delivering none: afterwards
        :meth:`checkpoint` is what it would be had they been read committed. For a planner that wants
        only the checkpoint at an offset (a Spark driver finding each partition's producer states), at a
        fraction of the cost: no envelopes, no ring, a few integer operations per message. `uuids` may
        also be a numpy array of rows (high, low 64 bits) (0, 0 for none): folded per producer in a few
        array operations (``_advance``). Not for a Sequencer that queues: pending messages are tracked
        by their first offset only."""
        if self._emit is not None or self._head or self._ring[0] is not None:
            raise UsageError("advance() is for a Sequencer that only advances: this one has queued messages")
        if not len(ends):
            return
        partials, offsets = self._partials, self._offsets
        offsets.setdefault(journal, begins[0])
        reread = self._reread.get(journal, -1)
        if not isinstance(uuids, list):
            from tidings.message import _advance  # (numpy: only for callers that have it)

            def partial_of(producer: int, last_ack: int) -> _Partial:
                p = partials.get((journal, producer))
                if p is None:
                    p = partials[(journal, producer)] = _Partial(journal, producer, last_ack)
                return p

            if ends[0] > reread and _advance.fold(journal, begins, uuids, partial_of):
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

    def _deliver_outside(self, p: _Partial, env: Envelope, clock: int) -> None:
        """An OUTSIDE_TXN message is delivered: its clock is its producer's last ACK, and the
        read-through offset passes it."""
        p.min_clock = p.max_clock = clock
        if self._offsets.get(env.journal, -1) < env.end:
            self._offsets[env.journal] = env.end
        self._delivered += 1

    def feed(self, env: Envelope, reread: Callable[[Replay], Iterable[Envelope]]) -> Iterator[Envelope]:
        """Queue `env`, satisfy a replay with ``reread(range)``, and return :meth:`dequeue` (exhaust it)."""
        replay = self.queue(env)
        if replay is not None:
            self.replay(reread(replay))
        return self.dequeue()

    def _next_candidate(self, p: _Partial) -> _Candidate | None:
        """The next envelope of `p`'s committed sequence: from the replay first, then from the ring."""
        while True:
            it = self._replay_it
            if it is not None:
                env = next(it, None)
                if env is None:
                    self._replay_it = None
                    continue
                expect = self._replay_range
                assert expect is not None
                if env.journal != expect.journal or env.begin < expect.begin:
                    raise UsageError(
                        f"replay read journal {env.journal} at offset {env.begin}, but the requested range is "
                        f"journal {expect.journal} [{expect.begin}, {expect.end})"
                    )
                if env.begin >= expect.end:
                    self._replay_it = None
                    continue
                self._replayed += 1
                u = env.uuid
                fields = None if u is None else uuid_fields(u.int)
                if fields is None or fields[0] != p.producer or fields[2] != CONTINUE_TXN:
                    continue  # another producer's message, or not part of a transaction
                clock = fields[1]
            else:
                head = p.ring_start
                if head == -1:
                    return None
                env, _, clock = self._ring[head]
                p.ring_start = self._next[head]
            # Mirror live queueing: a CONTINUE_TXN counts only if its clock is above every earlier one.
            if clock <= self._seen_max:
                continue
            self._seen_max = clock
            if clock > p.max_clock:
                continue  # rolled back: beyond the ACK's clock
            return env, clock

    def _finish(self, p: _Partial) -> None:
        """The committed sequence is delivered: the ACK's clock becomes last_ack and the read-through offset moves."""
        p.reset(p.max_clock)
        journal = p.journal
        if self._offsets.get(journal, -1) < self._emit_end:
            self._offsets[journal] = self._emit_end
        self._emit = None
        self._lookahead = None
        self._need_replay = self._replay_range = None
        self._replay_it = None

    # --- Checkpoints -------------------------------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """Prune quiet producers, then snapshot read-through offsets and producer states (see the module docstring).

        May be taken at any time, also between two :meth:`step` calls.
        """
        self.prune()
        journals = {journal: JournalCheckpoint(offset, {}) for journal, offset in self._offsets.items()}
        for (journal, producer), p in self._partials.items():
            jc = journals.setdefault(journal, JournalCheckpoint(0, {}))  # (every queued journal has an offset)
            newest = p.newest  # (recorded only when it says more than last_ack)
            jc.producers[f"{producer:012x}"] = ProducerState(
                p.min_clock, p.begin, -1 if newest == p.min_clock else newest
            )
        return Checkpoint(journals)

    def prune(self) -> int:
        """Forget producers quiet for longer than ``producer_horizon`` (in clock time); return how many."""
        if self.producer_horizon is None or not self._partials:
            return 0
        horizon = int(self.producer_horizon * 10_000_000) << 4  # seconds -> 100 ns units -> clock units
        newest: dict[str, int] = {}
        for p in self._partials.values():
            if p.min_clock > newest.get(p.journal, 0):
                newest[p.journal] = p.min_clock
        stale = [
            key
            for key, p in self._partials.items()
            if p is not self._emit and p.newest < newest.get(p.journal, 0) - horizon
        ]
        for key in stale:
            del self._partials[key]
            self._pending.pop(key, None)  # (forgotten: nothing to wait for)
        return len(stale)

    def statistics(self) -> SequencerStatistics:
        """Counters for metrics and the CLI: queue outcomes, deliveries, replays, tracked producers."""
        return SequencerStatistics(
            outcomes={o.name: n for o, n in self._outcomes.items()},
            delivered=self._delivered,
            replays=self._replays,
            replayed_envelopes=self._replayed,
            producers=len(self._partials),
            ring_size=self.ring_size,
        )
