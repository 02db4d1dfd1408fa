"""Exactly-once messages over at-least-once journals (gazette-exactly-once.txt, *Message UUIDs* and *Sequencer*).

Journal appends are at-least-once, so a journal may hold a message twice, and messages of transactions that are
still pending or were rolled back. This package gives messages the means to be read exactly once:

* :mod:`~tidings.message.uuid` - RFC 4122 v1 message UUIDs: a random ProducerID, a strictly monotonic
  :class:`Clock` per producer, and transaction flags (OUTSIDE_TXN, CONTINUE_TXN, ACK_TXN).
* :mod:`~tidings.message.framing` - how messages sit in a journal's bytes, by its ``content-type`` label
  (``application/x-ndjson``, ``application/x-protobuf-fixed``), with incremental decoders that report undecodable
  byte ranges instead of failing; and how a message carries its UUID (:func:`get_uuid`, :func:`set_uuid`).
* :mod:`~tidings.message.sequencer` - the read-committed :class:`Sequencer`: each committed message exactly once,
  in journal order per producer, never a rolled-back one (DESIGN.md invariant 7), with a ring buffer, replays of
  long transactions, and checkpoints to resume from.

* :mod:`~tidings.message.publisher` - the :class:`Publisher`: committed (OUTSIDE_TXN) and transactional (CONTINUE_TXN,
  then ACK intents) publishing through an AppendService, with mappings that pick a journal of a label selector
  by key (modulo, rendezvous hashing) or at random.
* :mod:`~tidings.message.lines` - the :class:`LinePublisher`: lines of JSON objects published as committed
  messages as they come, batched, saying exactly which lines were published when something fails.
* :mod:`~tidings.message.iterators` - :func:`read_uncommitted` and :func:`read_committed` over one or more journals,
  async with an AsyncClient and sync with a Client.

UUIDs, framings and the Sequencer are pure (no I/O) and synchronous; the publisher and iterators drive them
through :mod:`tidings.client`.
"""

from __future__ import annotations

from tidings.message.framing import (
    CONTENT_TYPE_LABEL,
    DEFAULT_MAX_MESSAGE_SIZE,
    FIXED_FRAME_HEADER_LENGTH,
    FIXED_FRAME_WORD,
    NDJSON,
    PROTOBUF_FIXED,
    Columns,
    Decoder,
    Frame,
    Framing,
    Garbage,
    columns_of,
    framing_for,
    get_uuid,
    set_uuid,
    supports_uuid,
    uuid_getter,
    uuid_setter,
)
from tidings.message.iterators import ReadCommitted, ReadUncommitted, read_committed, read_uncommitted
from tidings.message.lines import LinePublisher, line_span
from tidings.message.publisher import (
    AckIntent,
    JournalList,
    Mapping,
    Publisher,
    modulo_mapping,
    new_acknowledgement,
    random_mapping,
    rendezvous_mapping,
)
from tidings.message.sequencer import (
    DEFAULT_PRODUCER_HORIZON,
    DEFAULT_RING_SIZE,
    Checkpoint,
    Envelope,
    JournalCheckpoint,
    ProducerState,
    QueueOutcome,
    Replay,
    ReplayRequiredError,
    Sequencer,
    SequencerStatistics,
)
from tidings.message.uuid import (
    ACK_TXN,
    CONTINUE_TXN,
    OUTSIDE_TXN,
    Clock,
    Flags,
    ProducerID,
    build_uuid,
    clock_from_unix_ns,
    get_clock,
    get_flags,
    get_producer_id,
    new_clock,
    new_producer_id,
    parse,
    unix_ns_from_clock,
    uuid_fields,
    uuid_from_str,
    uuid_to_str,
)

__all__ = [
    "ACK_TXN",
    "AckIntent",
    "CONTENT_TYPE_LABEL",
    "CONTINUE_TXN",
    "Checkpoint",
    "Clock",
    "Columns",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DEFAULT_PRODUCER_HORIZON",
    "DEFAULT_RING_SIZE",
    "Decoder",
    "Envelope",
    "FIXED_FRAME_HEADER_LENGTH",
    "FIXED_FRAME_WORD",
    "Flags",
    "Frame",
    "Framing",
    "Garbage",
    "JournalCheckpoint",
    "JournalList",
    "LinePublisher",
    "Mapping",
    "NDJSON",
    "OUTSIDE_TXN",
    "PROTOBUF_FIXED",
    "ProducerID",
    "ProducerState",
    "Publisher",
    "QueueOutcome",
    "ReadCommitted",
    "ReadUncommitted",
    "Replay",
    "ReplayRequiredError",
    "Sequencer",
    "SequencerStatistics",
    "build_uuid",
    "clock_from_unix_ns",
    "columns_of",
    "framing_for",
    "get_clock",
    "get_flags",
    "get_producer_id",
    "get_uuid",
    "line_span",
    "modulo_mapping",
    "new_acknowledgement",
    "new_clock",
    "new_producer_id",
    "parse",
    "random_mapping",
    "read_committed",
    "read_uncommitted",
    "rendezvous_mapping",
    "set_uuid",
    "supports_uuid",
    "unix_ns_from_clock",
    "uuid_fields",
    "uuid_from_str",
    "uuid_getter",
    "uuid_setter",
    "uuid_to_str",
]
