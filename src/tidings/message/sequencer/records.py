"""What the Sequencer takes and hands back, besides checkpoints: the :class:`Envelope` of a message read,
the :class:`Replay` of a range to re-read, :class:`QueueOutcome`, :class:`SequencerStatistics`, the
:class:`ReplayRequiredError`, and the defaults of its parameters."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

import msgspec

from tidings.protocol.status import UsageError

DEFAULT_RING_SIZE: Final = 1024
DEFAULT_PRODUCER_HORIZON: Final = 24 * 3600.0
"""Seconds of producer clock time after which a quiet producer is forgotten (see the package docstring)."""


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
