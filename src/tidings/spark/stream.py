"""The tidings streaming source: journals as Structured Streaming inputs, exactly once.

An offset is a Sequencer checkpoint: per journal its read-through offset and its producers' states
(`{"journals": {name: {"read_through": n, "producers": {id: {"last_ack": c, "begin": o}}}}}`).
`latestOffset` (on the driver) finds the next end, then runs a Sequencer from the start offset's
states over the new bytes, decoding only the UUIDs, to get the producer states at that end. A
task then reads its journal from the start's states to the end and delivers exactly what a single
reader would between those two checkpoints: a transaction whose messages and ACK fall in
different micro-batches is delivered once, in the batch of its ACK; a batch Spark replays after a
crash reads the same (start, end) and yields the same rows. Both read from the start's
read-through offset and re-read an earlier transaction's messages only when its ACK arrives (as
Gazette's readers do), so a transaction that never commits (a failed sink task's, say) costs
nothing. The cost: the driver reads each new byte once more, decoding only the UUIDs.

`latestOffset` is polled about every 10 ms when idle: write heads are asked for at most every
HEAD_TTL seconds per journal and the journal list (for a selector) every JOURNALS_TTL, so an idle
query costs little. A journal found after the query's start (created, or relabelled to match) is
read from its first held byte, as Kafka reads a new partition from earliest: bytes retention
removed before the query knew the journal are no loss to it. The offset of the batch that first
reads it records where it began (`begins`), so a replay of that batch reads the same bytes.

`maxBytesPerTrigger` caps a batch's new bytes over all journals (split evenly; at least one whole
message each); Trigger.AvailableNow reads up to the write heads it found when the query started,
of the journals it knew then (one found later waits for the next run, as a Kafka partition does).

`producerHorizon` (default 24h, Gazette's): an offset keeps a producer's state until the producer
has been quiet that long in its own clock time, to drop a late duplicate of its messages. A
forgotten producer's open transaction is forgotten too (as in Gazette), so its later ACK commits
nothing: the horizon must exceed the longest time from a transaction's first message to its ACK.
A journal written by the tidings sink gains a producer per task attempt; a query reading one can
keep its offsets smaller with a shorter horizon (`2h`, say) only if no sink batch, from its first
task's rows to its ACKs (a driver's recovery included), takes that long.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from tidings.client import Client
from tidings.message import Checkpoint, JournalCheckpoint
from tidings.message.publisher import content_type_of
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import UsageError
from tidings.spark._read import (
    JournalRange,
    _one_line,
    offset_for,
    planning_client,
    read_partition,
    resolve_journals,
    scan,
    starting_offset,
    whole_at,
)
from tidings.spark.options import SourceOptions
from tidings.spark.schema import check_schema

log = logging.getLogger(__name__)

BEGINS = "begins"  # an offset's journals first found in its batch, and where they begin
HEAD_TTL = 0.1  # seconds a journal's write head is reused by latestOffset
JOURNALS_TTL = 1.0  # seconds the journal list is reused
WAIT_RECHECK = 1.0  # seconds before a journal with no bytes at its offset is asked again (head unmoved)


class TidingsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: SourceOptions | Mapping[str, str], schema: StructType) -> None:
        """`options` as given to Spark (or parsed): a mistake in them or in the schema is raised by
        Spark's first call to the reader (see `_usable`)."""
        self.schema_json = schema.json()
        self._refused: str | None = None
        self.options: SourceOptions  # (unset in a refused reader: every call of Spark's raises first)
        try:
            if not isinstance(options, SourceOptions):
                if any(k.lower() == "endingoffsets" for k in options):
                    raise UsageError(  # (as Kafka's source: a stream has no end)
                        "tidings source: option 'endingOffsets' is for batch reads (spark.read); a stream reads on "
                        "as journals grow: drop it, or use .trigger(availableNow=True) to stop at what is there now"
                    )
                options = SourceOptions.parse(options)
            self.options = options
            check_schema(options.format, self.schema_json)
        except UsageError as exc:
            self._refused = str(exc)
        self._client: Client | None = None
        self._specs: tuple[float, dict[str, pb.JournalSpec]] = (0.0, {})
        self._heads: dict[str, tuple[float, int]] = {}
        self._target: dict[str, int] | None = None  # Trigger.AvailableNow's write heads
        self._found: dict[str, int] = {}  # journals found after the start: their first held byte then
        self._waiting: dict[str, tuple[int, int, float]] = {}  # no bytes at (offset, head), found when

    # -- the driver's cluster view (cached: latestOffset runs every few ms) -------------------

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = planning_client(self.options)
        return self._client

    def _journals(self) -> dict[str, pb.JournalSpec]:
        at, specs = self._specs
        if time.monotonic() - at > JOURNALS_TTL or not specs:
            specs = {s.name: s for s in resolve_journals(self.client, self.options)}
            self._specs = (time.monotonic(), specs)
        return specs

    def _head(self, journal: str) -> int:
        at, head = self._heads.get(journal, (0.0, 0))
        if time.monotonic() - at > HEAD_TTL:
            head = self.client.write_head(journal)
            self._heads[journal] = (time.monotonic(), head)
        return head

    def _usable(self) -> None:
        """Raise a mistake found when the reader was made (options, schema): raised there, PySpark 4.3's
        stream runner fails on its own error (UnboundLocalError) and shows both tracebacks, not our line."""
        if self._refused is not None:
            raise UsageError(self._refused)

    # -- Spark's calls ----------------------------------------------------------------------------

    @_one_line
    def initialOffset(self) -> dict[str, Any]:
        self._usable()
        journals = {}
        for name in self._journals():
            journals[name] = {"read_through": starting_offset(self.client, self.options, name)}
        return _offset(Checkpoint(msgspec.convert(journals, dict[str, JournalCheckpoint])))

    @_one_line
    def getDefaultReadLimit(self) -> ReadLimit:
        self._usable()
        n = self.options.max_bytes_per_trigger
        return ReadMaxBytes(n) if n else ReadAllAvailable()

    @_one_line
    def prepareForTriggerAvailableNow(self) -> None:
        self._usable()
        self._target = {name: self.client.write_head(name) for name in self._journals()}

    def _earliest(self, journal: str) -> int:
        """Where a journal found after the query's start begins: its first held byte when first seen."""
        if journal not in self._found:
            self._found[journal] = offset_for(self.client, journal, "earliest", "earliest")
        return self._found[journal]

    @_one_line
    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        self._usable()
        begun = _checkpoint(start)
        found = {
            n: self._earliest(n)
            for n in self._journals()
            if n not in begun.journals and (self._target is None or n in self._target)
        }
        if found:
            begun = Checkpoint({**begun.journals, **{n: JournalCheckpoint(at, {}) for n, at in found.items()}})
        heads = {}
        for name in self._journals():
            if self._target is not None and name not in self._target:
                continue  # (AvailableNow: found after the run's start, left for the next run, as Kafka's)
            head = self._head(name) if self._target is None else self._target[name]
            if head < _read_through(begun, name):
                begun = self._lost(begun, name, head)
            if head > _read_through(begun, name):
                heads[name] = head
        readable = self._readable({n: _read_through(begun, n) for n in heads}, heads)
        heads = {n: h for n, h in heads.items() if n in readable}
        if not heads:
            return start
        begins = {n: at for n, at in found.items() if n in heads}  # (partitions() reads them from there)
        cap = limit.max_bytes // len(heads) if isinstance(limit, ReadMaxBytes) else None
        specs = self._journals()
        types = {n: content_type_of(specs[n]) for n in heads if n in specs}
        if (
            cap is None
            and not self.options.read_committed
            and all(whole_at(self.client, n, h, types.get(n)) for n, h in heads.items())
        ):  # plain offsets: up to the heads, no scan
            journals = {n: jc for n, jc in begun.journals.items() if n not in found or n in heads}
            journals.update({n: JournalCheckpoint(h, {}) for n, h in heads.items()})
            return _offset(Checkpoint(journals), begins)
        ends = {n: h if cap is None else min(h, _read_through(begun, n) + max(cap, 1)) for n, h in heads.items()}
        scan_to = functools.partial(
            scan, self.client, self.options.read_committed, begun, content_types=types,
            horizon=self.options.producer_horizon,
        )  # fmt: skip
        reached = scan_to(ends, heads)
        while stuck := [n for n in heads if reached.journals[n].read_through == _read_through(begun, n)]:
            for n in stuck:  # a message longer than the cap: widen until it is whole
                if ends[n] == heads[n]:  # (no whole message yet: one still being appended ends at the head)
                    del heads[n], ends[n]
                    continue
                rt = _read_through(begun, n)
                ends[n] = min(heads[n], rt + 2 * (ends[n] - rt))
            if not heads:
                return start
            reached = scan_to(ends, heads)
        journals = {n: jc for n, jc in begun.journals.items() if n not in found or n in heads}
        journals.update({n: reached.journals[n] for n in heads})
        return _offset(Checkpoint(journals), {n: at for n, at in begins.items() if n in heads})

    def _readable(self, offsets: dict[str, int], heads: dict[str, int]) -> set[str]:
        """The journals whose read from their offset gets bytes now (perhaps past a gap retention left,
        which the tasks report as lost), asked all at once. Not one whose every byte from there to the
        write head retention removed, nothing written since: a read would wait for the next bytes, as
        Gazette's readers do (they may also be a fragment on its way to the store), and so does that
        journal, without holding up the query's other journals. A journal found so is asked again
        when its head moves or WAIT_RECHECK seconds on, not at every poll."""
        now = time.monotonic()
        ask = {}
        for n, at in offsets.items():
            was = self._waiting.get(n)
            if was is None or was[:2] != (at, heads[n]) or now - was[2] >= WAIT_RECHECK:
                ask[n] = at
        if not ask:
            return set()
        aio = self.client.aio

        async def probe_all() -> list[pb.ReadResponse]:
            return await asyncio.gather(*(aio.probe(n, at) for n, at in ask.items()))

        readable = set()
        for (journal, offset), resp in zip(ask.items(), self.client.run(probe_all()), strict=True):
            if resp.status == pb.OK:
                readable.add(journal)
                self._waiting.pop(journal, None)
                continue
            if journal not in self._waiting:
                log.warning("journal %s holds no bytes at offset %d, below its write head (removed by retention?): "
                            "waiting for them, or for its next bytes", journal, offset)  # fmt: skip
            self._waiting[journal] = (offset, heads[journal], now)
        return readable

    def _lost(self, begun: Checkpoint, journal: str, head: int) -> Checkpoint:
        """A write head below our offset: the journal was reset or deleted and created again."""
        was = _read_through(begun, journal)
        if self.options.fail_on_data_loss:
            raise UsageError(
                f"tidings source: journal {journal!r} ends at {head}, before this query's offset {was}: it was "
                "reset or created again, and what it held after that may be lost; start the query on a new "
                "checkpointLocation, or set failOnDataLoss=false to go on from its beginning"
            )
        log.warning("journal %s ends at %d, before this query's offset %d: reading it from its beginning", journal,
                    head, was)  # fmt: skip
        journals = dict(begun.journals)
        journals[journal] = JournalCheckpoint(0, {})
        return Checkpoint(journals)

    @_one_line
    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[JournalRange]:
        self._usable()  # (a restart re-plans its last batch before asking for offsets)
        begun, reached = _checkpoint(start), _checkpoint(end)
        begins = end.get(BEGINS, {})
        specs = self._journals()
        ranges = []
        for name, jc in sorted(reached.journals.items()):
            was = begun.journals.get(name) or JournalCheckpoint(begins.get(name, 0), {})
            if jc.read_through < was.read_through:  # latestOffset found the journal reset (failOnDataLoss=false)
                was = JournalCheckpoint(0, {})
            if jc.read_through <= was.read_through:
                continue
            spec = specs.get(name) or self._spec_by_name(name)  # (a selector may no longer match it: read it)
            if spec is None:
                if self.options.fail_on_data_loss:
                    raise UsageError(
                        f"tidings source: journal {name!r} was deleted before its messages up to offset "
                        f"{jc.read_through} were read; set failOnDataLoss=false to go on without them"
                    )
                log.warning("journal %s was deleted before [%d, %d) was read: skipped", name, was.read_through,
                            jc.read_through)  # fmt: skip
                continue
            producers = msgspec.to_builtins(was.producers) if self.options.read_committed else None
            ranges.append(JournalRange(name, content_type_of(spec), was.read_through, jc.read_through, producers))
        return ranges

    def _spec_by_name(self, name: str) -> pb.JournalSpec | None:
        found = self.client.describe(name)
        return found.spec if found is not None else None

    def read(self, partition: JournalRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]  # (our partitions)
        return read_partition(self.options, self.schema_json, partition)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing to clean up: offsets live in Spark's checkpoint, the bytes in the journals

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _checkpoint(offset: dict[str, Any]) -> Checkpoint:
    return msgspec.convert(offset, Checkpoint)


def _offset(cp: Checkpoint, begins: dict[str, int] | None = None) -> dict[str, Any]:
    """Spark's offset: the checkpoint, and where journals first found in this batch begin (BEGINS)."""
    offset: dict[str, Any] = msgspec.to_builtins(cp)
    if begins:
        offset[BEGINS] = begins
    return offset


def _read_through(cp: Checkpoint, journal: str) -> int:
    jc = cp.journals.get(journal)
    return 0 if jc is None else jc.read_through
