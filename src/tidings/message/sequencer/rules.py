"""The reference: the Sequencer's rules (the package docstring) as a table, over a list of messages.

No ring, no replays, no checkpoints, no speed: per (journal, producer) the last ACK's clock and the
pending CONTINUE_TXN messages in a list, and one table of rules. It says what read-committed means,
and the fast paths are tested against it (tests/message/test_sequencer_rules.py): the ring path
(:meth:`Sequencer.queue`, :meth:`Sequencer.step`, replays), the batch path (:meth:`Sequencer.sequence`)
and both folds of :meth:`Sequencer.advance` must deliver what :func:`sequence` delivers, and their
checkpoints hold the states it ends with. Not for production: it keeps every pending message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, uuid_fields

__all__ = ["Message", "RULES", "Rules", "State", "message_of", "sequence"]


class Message(NamedTuple):
    """A message read: its journal and offset, and its UUID's producer, clock and flags (producer None: no
    v1 UUID). `ref` is the caller's (an Envelope, say), handed back with the message when it is delivered."""

    journal: str
    offset: int
    producer: int | None
    clock: int = 0
    flags: int = 0
    ref: Any = None


def message_of(journal: str, offset: int, uuid: Any, ref: Any = None) -> Message:
    """The Message of a UUID (a :class:`uuid.UUID`, its 128-bit int, or None). Absent, nil, not version 1
    of the RFC 4122 variant, or with a zero clock: no v1 UUID (producer None)."""
    i = getattr(uuid, "int", uuid)
    fields = None if i is None else uuid_fields(i)
    if fields is None or fields[1] == 0:
        return Message(journal, offset, None, ref=ref)
    producer, clock, flags = fields
    return Message(journal, offset, producer, clock, flags, ref)


@dataclass
class _Producer:
    """A (journal, producer)'s state: the last ACK's clock and the pending messages, in journal order."""

    last_ack: int
    pending: list[Message] = field(default_factory=list)

    def largest_pending(self) -> int:
        return max([self.last_ack, *(m.clock for m in self.pending)])


def _drop(p: _Producer, m: Message) -> list[Message]:
    return []


def _pend(p: _Producer, m: Message) -> list[Message]:
    p.pending.append(m)
    return []


def _commit(p: _Producer, m: Message) -> list[Message]:
    committed = [c for c in p.pending if c.clock <= m.clock]  # the rest: rolled back
    p.pending, p.last_ack = [], m.clock
    return committed


def _roll_back(p: _Producer, m: Message) -> list[Message]:
    p.pending, p.last_ack = [], m.clock
    return []


def _deliver(p: _Producer, m: Message) -> list[Message]:
    p.pending, p.last_ack = [], m.clock  # (pending messages of the producer are dropped)
    return [m]


Rule = tuple[str, Callable[[_Producer, int], bool], Callable[[_Producer, Message], list[Message]]]

RULES: Final[tuple[Rule, ...]] = (
    # kind of message, test of (state, clock): the first row that matches applies its action.
    ("continue", lambda p, clock: clock <= p.last_ack, _drop),  # a duplicate
    ("continue", lambda p, clock: clock <= p.largest_pending(), _drop),  # a duplicate
    ("continue", lambda p, clock: True, _pend),
    ("ack", lambda p, clock: clock > p.last_ack, _commit),  # pending with clocks <= its own; the rest rolled back
    ("ack", lambda p, clock: True, _roll_back),  # == last_ack, or below: last_ack goes back
    ("outside", lambda p, clock: clock <= p.last_ack, _drop),  # a duplicate
    ("outside", lambda p, clock: True, _deliver),
)
"""The rules per (journal, producer); "outside" is OUTSIDE_TXN and any flags but CONTINUE_TXN and ACK_TXN.
An ACK_TXN is never delivered; a message without a v1 UUID always is (at once, touching no state)."""


class State(NamedTuple):
    """A (journal, producer)'s state after the messages so far, as a checkpoint holds it: the last ACK's
    clock, the first pending message's offset (or -1), and the largest clock of the last ACK and the pending."""

    last_ack: int
    begin: int
    newest: int


class Rules:
    """The rules applied message by message (:func:`sequence` over a whole list)."""

    def __init__(self) -> None:
        self._producers: dict[tuple[str, int], _Producer] = {}

    def apply(self, m: Message) -> list[Message]:
        """The messages that `m`, read next, makes committed, in delivery order."""
        if m.producer is None:
            return [m]
        p = self._producers.setdefault((m.journal, m.producer), _Producer(last_ack=m.clock - 1))
        kind = "continue" if m.flags == CONTINUE_TXN else "ack" if m.flags == ACK_TXN else "outside"
        for rule_kind, test, action in RULES:
            if rule_kind == kind and test(p, m.clock):
                return action(p, m)
        raise AssertionError("every kind has a last row that always matches")

    def states(self) -> dict[tuple[str, int], State]:
        """Each (journal, producer)'s state."""
        return {
            key: State(p.last_ack, p.pending[0].offset if p.pending else -1, p.largest_pending())
            for key, p in self._producers.items()
        }


def sequence(messages: Iterable[Message]) -> tuple[list[Message], dict[tuple[str, int], State]]:
    """The messages committed, in delivery order, and each (journal, producer)'s state after them all."""
    rules = Rules()
    delivered = [d for m in messages for d in rules.apply(m)]
    return delivered, rules.states()
