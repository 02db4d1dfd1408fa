"""The tidings data source for PySpark: journals as DataFrames (batch reads, this module).

Planning (`partitions()`, in a Python process of the driver) lists the journals and fixes each
one's range [start, end) from `startingOffsets` / `endingOffsets` (end `latest`: the write head at
planning), so a partition reads the same messages however far the journal grows meanwhile, and
Spark may re-run it. Reading (`read()`, on executors) streams the range through a broker and
yields Arrow RecordBatches; with `readCommitted` (the default) a Sequencer delivers each
committed message once, as `tidings journals read --committed` does, and messages of
transactions still open at the range's end are not delivered.

One partition per journal for now: a transaction may span fragments, and a partition needs the
producer states at its start to deliver it once (see the Spark issue's notes for what comes next).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import msgspec
import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.types import StructType

from tidings.client import Client
from tidings.message import Checkpoint, JournalCheckpoint, ReadCommitted, ReadUncommitted
from tidings.message.framing import NDJSON, Garbage, columns_of, framing_for
from tidings.message.publisher import content_type_of
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.labels import parse_selector
from tidings.protocol.status import TidingsError, TransportError, UsageError
from tidings.spark.options import SourceOptions
from tidings.spark.schema import CORRUPT, METADATA_DDL, RAW_DDL, line_uuids, row_builder

log = logging.getLogger(__name__)
T = TypeVar("T")

ROWS_PER_BATCH = 8192  # rows per RecordBatch handed to Spark
PLANNING_RETRIES = 3  # a driver that cannot reach its broker fails the query soon, naming it


class JournalRange(InputPartition):
    """What one Spark task reads: the messages of journal bytes [begin, end) and how to decode them.

    `producers` (a streaming micro-batch's start) are the journal's producer states at `begin`, as
    a Sequencer checkpoint holds them: the read then starts at the first pending transaction's
    offset, so a transaction whose ACK is in this range is delivered whole, and nothing before
    `begin` is delivered again.
    """

    def __init__(
        self,
        journal: str,
        content_type: str,
        begin: int,
        end: int,
        producers: dict[str, dict[str, int]] | None = None,
    ) -> None:
        super().__init__((journal, begin, end))
        self.journal = journal
        self.content_type = content_type
        self.begin = begin
        self.end = end
        self.producers = producers


def _one_line(fn: Callable[..., T]) -> Callable[..., T]:
    """Spark shows the traceback of a data source's exception; for a user's mistake (a UsageError,
    whose message says what to do) keep it to this frame and the message."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:
            raise UsageError(str(exc)) from None

    return wrapper


class TidingsDataSource(DataSource):
    """`spark.read.format("tidings")`: see the package docstring for the options and columns."""

    @classmethod
    def name(cls) -> str:
        return "tidings"

    @_one_line
    def schema(self) -> str:
        opts = SourceOptions.parse(self.options)
        if opts.format == "raw":
            return RAW_DDL
        if opts.schema is None:
            raise UsageError(
                "tidings source: format json needs the messages' fields: give them with "
                ".schema('id BIGINT, name STRING') (columns journal, offset, uuid, producer, clock and _corrupt "
                "are filled by name) or .option('schema', 'id BIGINT, name STRING')"
            )
        return f"{METADATA_DDL}, {opts.schema}, {CORRUPT} STRING"

    @_one_line
    def reader(self, schema: StructType) -> DataSourceReader:
        return TidingsBatchReader(SourceOptions.parse(self.options), schema)

    @_one_line
    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from tidings.spark.stream import TidingsStreamReader

        return TidingsStreamReader(SourceOptions.parse(self.options), schema)

    @_one_line
    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from tidings.spark.sink import SinkOptions, TidingsWriter

        return TidingsWriter(SinkOptions.parse(self.options, schema, streaming=False))

    @_one_line
    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from tidings.spark.sink import SinkOptions, TidingsStreamWriter

        return TidingsStreamWriter(SinkOptions.parse(self.options, schema, streaming=True))


class TidingsBatchReader(DataSourceReader):
    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.options = options
        self.schema_json = schema.json()
        if options.format == "json":
            row_builder(self.schema_json)  # unsupported column types fail the query here, on the driver

    @_one_line
    def partitions(self) -> list[JournalRange]:
        opts = self.options
        with planning_client(opts.broker) as c:
            journals = resolve_journals(c, opts)
            ranges = []
            for spec in journals:
                begin = offset_for(c, spec.name, opts.starting, "earliest")
                end = offset_for(c, spec.name, opts.ending, "latest")
                ranges.append(JournalRange(spec.name, content_type_of(spec), begin, max(begin, end)))
        return ranges or [JournalRange("", NDJSON, 0, 0)]

    def read(self, partition: JournalRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        return read_partition(self.options, self.schema_json, partition)


def read_partition(opts: SourceOptions, schema_json: str, partition: JournalRange) -> Iterator[pa.RecordBatch]:
    """A task's rows (on an executor): the partition's messages as RecordBatches of the query's schema."""
    if partition.begin >= partition.end:
        return
    with Client(opts.broker) as c:
        if opts.format == "raw":
            yield from _read_raw(c, partition)
        else:
            yield from _read_json(c, partition, opts.read_committed, schema_json)


def planning_client(broker: str) -> Client:
    return Client(broker, retries=PLANNING_RETRIES)


def resolve_journals(c: Client, opts: SourceOptions) -> list[pb.JournalSpec]:
    """The journals to read, by name or selector; an unknown name or an unreachable broker fails with one line."""
    try:
        resp = c.list(parse_selector(opts.selector) if opts.selector else None)
    except TransportError as exc:
        code = exc.code.name if exc.code is not None else "no answer"
        raise UsageError(
            f"tidings source: broker {opts.broker} is unreachable ({code}); check option 'broker'"
        ) from None
    specs = {j.spec.name: j.spec for j in resp.journals}
    if opts.selector:
        chosen = []
        for name in sorted(specs):
            if opts.format == "json" and content_type_of(specs[name]) != NDJSON:
                log.warning("journal %s matches the selector but holds %s messages: format json skips it", name,
                            content_type_of(specs[name]))  # fmt: skip
                continue
            chosen.append(specs[name])
        return chosen
    missing = [j for j in opts.journals if j not in specs]
    if missing:
        raise UsageError(
            f"tidings source: journal {missing[0]!r} does not exist (broker {opts.broker}); "
            "check option 'journal', or create it with `tidings journals apply`"
        )
    chosen = [specs[j] for j in opts.journals]
    for spec in chosen:
        if opts.format == "json" and content_type_of(spec) != NDJSON:
            raise UsageError(
                f"tidings source: journal {spec.name!r} holds {content_type_of(spec)} messages; format json "
                f"reads {NDJSON} journals: use format raw for it"
            )
    return chosen


def offset_for(c: Client, journal: str, offsets: str | dict[str, int], default: str) -> int:
    """A journal's offset for `offsets` (earliest, latest, or a JSON object where -2/-1 mean those)."""
    which: str | int = offsets if isinstance(offsets, str) else offsets.get(journal, default)
    if which in ("earliest", -2):
        return 0
    if which in ("latest", -1):
        return c.write_head(journal)
    assert isinstance(which, int)
    return which


def _read_json(c: Client, part: JournalRange, committed: bool, schema_json: str) -> Iterator[pa.RecordBatch]:
    builder = row_builder(schema_json)
    garbage: list[Garbage] = []

    def on_garbage(_journal: str, g: Garbage) -> None:
        if g.begin >= part.begin:  # (a resumed read re-reads pending transactions before `begin`)
            garbage.append(g)

    options: dict[str, Any] = {
        "end_offsets": {part.journal: part.end},
        "message_type": builder.message_type,  # lines, decoded by the builder once delivered
        "uuids_of": line_uuids,
        "block": False,
        "on_garbage": on_garbage,
    }
    reader: Any
    if not committed:
        reader = ReadUncommitted(c, part.journal, offsets={part.journal: part.begin}, **options)
    elif part.producers is not None:
        start = msgspec.convert({part.journal: {"read_through": part.begin, "producers": part.producers}},
                                dict[str, JournalCheckpoint])  # fmt: skip
        reader = ReadCommitted(c, part.journal, checkpoint=Checkpoint(start), reread_pending=False, **options)
    else:
        reader = ReadCommitted(c, part.journal, offsets={part.journal: part.begin}, **options)

    def corrupt() -> pa.RecordBatch:
        rows = [(part.journal, g.begin, _text_of(c, part.journal, g)) for g in garbage]
        garbage.clear()
        return builder.corrupt(rows)

    pending: list[Any] = []
    for batch in reader.batches():
        pending.extend(batch)
        if garbage or len(pending) >= ROWS_PER_BATCH:
            if pending:
                yield from builder.batches(pending)
                pending = []
            if garbage:
                yield corrupt()
    if pending:
        yield from builder.batches(pending)
    if garbage:  # (a partial message at the range's end is reported after the last batch)
        yield corrupt()


def _text_of(c: Client, journal: str, g: Garbage) -> str:
    """The bytes of an undecodable message, as text for the `_corrupt` column (re-read: a rare path)."""
    try:
        data = c.read_all(journal, g.begin, g.end)
    except TidingsError as exc:
        return f"<unreadable: {exc}> ({g.error})"
    return data.rstrip(b"\n").decode("utf-8", errors="replace")


def _read_raw(c: Client, part: JournalRange) -> Iterator[pa.RecordBatch]:
    """Each message's bytes as written; undecodable ranges are skipped with a warning."""
    framing = framing_for(part.content_type)
    decoder = framing.decoder(msgspec.Raw if part.content_type == NDJSON else None, part.begin)
    offsets: list[int] = []
    values: list[bytes] = []

    def batch() -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {"journal": [part.journal] * len(values), "offset": offsets, "value": values}, schema=_RAW_ARROW
        )

    def take(columns: Any) -> None:
        for g in columns.garbage:
            log.warning("journal %s: skipped undecodable bytes [%d, %d): %s", part.journal, g.begin, g.end, g.error)
        offsets.extend(columns.begins)
        values.extend(bytes(v) for v in columns.values)

    for chunk in c.read(part.journal, part.begin, end_offset=part.end):
        take(decoder.feed_columns(chunk.content, chunk.offset))
        if len(values) >= ROWS_PER_BATCH:
            yield batch()
            offsets, values = [], []
    take(columns_of(decoder.finish()))
    if values:
        yield batch()


_RAW_ARROW = pa.schema(
    [
        pa.field("journal", pa.string(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("value", pa.binary(), nullable=False),
    ]
)
