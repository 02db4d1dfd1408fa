"""A (journal, producer)'s sequencing state (Gazette's partial sequence): what the ring path, the batch
path and :meth:`Sequencer.advance` read and update."""

from __future__ import annotations


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
