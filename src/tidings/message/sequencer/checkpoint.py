"""The Sequencer's checkpoint: per journal, the read-through offset and each producer's state (msgspec
Structs, JSON-serializable); see the package docstring, *Checkpoints*."""

from __future__ import annotations

import msgspec


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
