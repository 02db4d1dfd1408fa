"""Reading and planning shared by the batch source, the streaming source and the sink.

A task's read of one journal range (`JournalRange`, `read_partition`, on executors), and the
driver's planning: the journals to read, their offsets, and `scan` for producer states at a cut.
What a read delivers and when it waits: see `tidings.spark.source`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from uuid import UUID

import msgspec
import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from tidings.client import Client
from tidings.message import Checkpoint, JournalCheckpoint, ReadCommitted, ReadUncommitted, Sequencer
from tidings.message.framing import NDJSON, Garbage
from tidings.message.publisher import content_type_of
from tidings.message.sequencer import DEFAULT_PRODUCER_HORIZON
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.labels import parse_selector
from tidings.protocol.status import (
    JournalNotFoundError,
    PermissionDeniedError,
    TidingsError,
    TransportError,
    UnauthenticatedError,
    UsageError,
)
from tidings.spark.options import SourceOptions
from tidings.spark.schema import UuidText, line_uuids, raw_schema, row_builder, text_uuid_ints

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


def read_partition(opts: SourceOptions, schema_json: str, partition: JournalRange) -> Iterator[pa.RecordBatch]:
    """A task's rows (on an executor): the partition's messages as RecordBatches of the query's schema."""
    if partition.begin >= partition.end:
        return
    lost = functools.partial(_lost, opts.fail_on_data_loss)
    with opts.security.client(opts.broker, retries=None) as c:  # (a task waits out a broker outage: its range is fixed)
        if not _still_holds(c, opts.fail_on_data_loss, partition):
            return
        if opts.format == "raw":
            yield from _read_raw(c, partition, lost, raw_schema(schema_json))
        else:
            yield from _read_json(c, partition, opts.read_committed, schema_json, lost)


def _still_holds(c: Client, fail: bool, part: JournalRange) -> bool:
    """Whether the journal still reaches the end of a task's range, planned when it did. A reset
    (deleted, created again) leaves the head below it, and a read would wait there for ever for
    bytes that would be another journal's: fail naming it, or skip the range (failOnDataLoss)."""
    try:
        head = c.write_head(part.journal)
    except JournalNotFoundError:
        what = "no longer exists"
    else:
        if head >= part.end:
            return True
        what = f"ends at {head}, before the end of bytes [{part.begin}, {part.end}) this query planned to read"
    if fail:
        raise UsageError(
            f"tidings source: journal {part.journal!r} {what}: it was reset or deleted since the query was "
            "planned; run a batch query again (a stream: start it on a new checkpointLocation), or set "
            "failOnDataLoss=false to skip what it no longer holds"
        )
    log.warning("journal %s %s: skipped (failOnDataLoss=false)", part.journal, what)
    return False


def _lost(fail: bool, journal: str, begin: int, end: int) -> None:
    """A journal has no bytes [begin, end) any more (removed by retention): fail, or skip them (failOnDataLoss)."""
    if fail:
        raise UsageError(
            f"tidings source: journal {journal!r} no longer holds bytes [{begin}, {end}) (removed by retention?), "
            "which this query was to read; set failOnDataLoss=false to skip them"
        )
    log.warning("journal %s no longer holds bytes [%d, %d): skipped (failOnDataLoss=false)", journal, begin, end)


def scan(
    c: Client,
    committed: bool,
    begun: Checkpoint,
    ends: dict[str, int],
    heads: dict[str, int],
    *,
    horizon: float | None = DEFAULT_PRODUCER_HORIZON,
    content_types: dict[str, str] | None = None,
) -> Checkpoint:
    """The journals' states at `ends` (each cut back to its last whole message unless it is the
    write head in `heads` that ends a line), from `begun`'s: the driver reads the bytes between
    (persisted fragments straight from their store) and decodes only the UUIDs; a write head
    counts as a message end only when `whole_at` says so. With `horizon`
    None every producer is kept (a batch read's partitions must deliver what one reader does,
    and one reader never forgets a producer; a stream's checkpoints forget producers quiet for
    `horizon` seconds of their clocks, 24 h by default as Gazette's do). Read uncommitted (format raw), journals of any
    framing (`content_types`; ndjson by default) are cut at their own messages' ends."""
    names = sorted(ends)
    starts = {n: begun.journals.get(n, JournalCheckpoint(0)) for n in names}
    common: dict[str, Any] = {
        "block": True,  # (to the end offset, waiting at a hole a replica may still fill; never past it)
        "on_garbage": _cut_or_garbage,  # (a cut at `ends` splits a message: not worth a warning)
        "direct": True,
    }
    offsets: dict[str, int] = {}
    found: dict[str, JournalCheckpoint] = {}
    types = content_types or {}
    if committed:  # (format json: ndjson journals; the same UUIDs and garbage as the tasks see)
        seq = Sequencer(producer_horizon=horizon, checkpoint=Checkpoint(starts))
        reader = ReadUncommitted(
            c, names, offsets={n: starts[n].read_through for n in names}, end_offsets=ends, message_type=UuidText,
            **common,
        )  # fmt: skip
        c.run(_advance(reader, seq))
        offsets, found = reader.offsets, seq.checkpoint().journals
    else:
        for lines in (True, False):  # (JSON lines as lines; other framings' payloads as bytes)
            group = [n for n in names if (types.get(n, NDJSON) == NDJSON) == lines]
            if group:
                plain = ReadUncommitted(
                    c, group, offsets={n: starts[n].read_through for n in group},
                    end_offsets={n: ends[n] for n in group}, message_type=msgspec.Raw if lines else None,
                    uuids_of=_no_uuids, **common,
                )  # fmt: skip
                for _ in plain.batches():
                    pass
                offsets.update(plain.offsets)
    out = {}
    for n in names:
        whole = offsets[n] >= ends[n] or (ends[n] == heads.get(n) and whole_at(c, n, ends[n], types.get(n)))
        through = ends[n] if whole else offsets[n]
        jc = found.get(n, JournalCheckpoint(0, {}))
        out[n] = JournalCheckpoint(max(through, starts[n].read_through), jc.producers if found else {})
    return Checkpoint(out)


async def _advance(reader: ReadUncommitted, seq: Sequencer) -> None:
    """Read `reader`'s journals (together) and advance `seq` over their messages' UUIDs."""

    async def one(journal: str) -> None:
        async with contextlib.aclosing(reader.columns(journal)) as chunks:
            async for columns in chunks:
                seq.advance(journal, columns.begins, columns.ends, text_uuid_ints(columns.values))

    await asyncio.gather(*map(one, reader.journals))


def whole_at(c: Client, journal: str, offset: int, content_type: str | None = NDJSON) -> bool:
    """Whether `offset` is known to end a whole message: in an ndjson journal, the byte before it is
    a newline. A write head need not be (a raw append may end mid-line or mid-frame, while
    publishers' appends end with their messages), and reading to one that is not would split a
    message in two undecodable halves: a reader waits there for the rest, as Gazette's readers do.
    Other framings cannot tell from one byte (False): only a reader's reach says."""
    return (content_type or NDJSON) == NDJSON and (offset == 0 or c.read_all(journal, offset - 1, offset) == b"\n")


def _no_uuids(values: list[Any]) -> list[UUID | None]:
    """Uncommitted reads of raw rows look at no UUID."""
    return [None] * len(values)


def _cut_or_garbage(journal: str, garbage: Garbage) -> None:
    log.debug("journal %s: bytes [%d, %d) are no whole message here: %s", journal, garbage.begin, garbage.end,
              garbage.error)  # fmt: skip


def unreachable(who: str, broker: str, exc: TransportError) -> UsageError:
    """The one line for a broker a query's driver cannot reach, or that refuses its token (`who`: source
    or sink)."""
    code = exc.code.name if exc.code is not None else "no answer"
    said = str(exc)
    if isinstance(exc, UnauthenticatedError | PermissionDeniedError):  # (it answers: not to this token)
        said = said.replace("pass --auth-token (TIDINGS_AUTH_TOKEN)", "give option 'authToken'")
        return UsageError(f"tidings {who}: broker {broker} refused the query's call: {said}")
    tls = ""
    if "TLS: " in said:
        tls = "; " + said[said.index("TLS: ") :].replace("--tls-ca", "option tlsCa").replace(
            "--tls-cert", "tlsCert"
        ).replace("--tls-key", "tlsKey")
    elif "Socket closed" in said:
        tls = "; it may serve TLS: give options tlsCa (and tlsCert, tlsKey if it wants a client certificate)"
    return UsageError(f"tidings {who}: broker {broker} is unreachable ({code}); check option 'broker'{tls}")


def planning_client(opts: SourceOptions) -> Client:
    """A client of the query's broker for the driver (the sink's options have the same two fields)."""
    return opts.security.client(opts.broker, retries=PLANNING_RETRIES)


def resolve_journals(c: Client, opts: SourceOptions) -> list[pb.JournalSpec]:
    """The journals to read, by name or selector; an unknown name or an unreachable broker fails with one line."""
    try:
        resp = c.list(parse_selector(opts.selector) if opts.selector else None)
    except TransportError as exc:
        raise unreachable("source", opts.broker, exc) from None
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
    if which in ("earliest", -2):  # the first byte it holds (retention may have removed earlier ones), as Kafka's
        return first_held(c, journal, c.write_head(journal))  # (the head first: an append after it is never skipped)
    if which in ("latest", -1):
        return c.write_head(journal)
    assert isinstance(which, int)
    return which


def first_held(c: Client, journal: str, head: int) -> int:
    """The first byte `journal` holds, or `head` (its next byte) when retention left none."""
    return min((f.spec.begin for f in c.fragments(journal).fragments), default=head)


def starting_offset(c: Client, opts: SourceOptions, journal: str) -> int:
    """`offset_for` startingOffsets, refusing an offset past the journal's write head (a mistake:
    a read would wait there for bytes that may never come). An offset below the first byte the
    journal holds (retention removed the ones before) is lost data, as an out-of-range offset is
    to Kafka's source: it fails the query, or starts at that byte (failOnDataLoss=false)."""
    offsets = opts.starting
    at = offset_for(c, journal, offsets, "earliest")
    if not isinstance(offsets, dict) or journal not in offsets:
        return at
    if at > (head := c.write_head(journal)):
        raise UsageError(
            f"tidings source: option 'startingOffsets' gives journal {journal!r} offset {at}, past its write head "
            f"{head}: give an offset at or below it, or earliest / latest"
        )
    if at < (first := first_held(c, journal, head)):
        if opts.fail_on_data_loss:
            raise UsageError(
                f"tidings source: option 'startingOffsets' gives journal {journal!r} offset {at}, but it holds bytes "
                f"from {first} on (retention removed earlier ones): start at {first} or earliest, or set "
                "failOnDataLoss=false to start at its first byte"
            )
        log.warning("journal %s holds no bytes [%d, %d) (removed by retention): starting at %d "
                    "(failOnDataLoss=false)", journal, at, first, first)  # fmt: skip
        return first
    return at


def _read_json(
    c: Client, part: JournalRange, committed: bool, schema_json: str, lost: Callable[[str, int, int], None]
) -> Iterator[pa.RecordBatch]:
    builder = row_builder(schema_json)
    garbage: list[Garbage] = []

    def on_garbage(_journal: str, g: Garbage) -> None:
        if g.begin >= part.begin:  # (a resumed read re-reads pending transactions before `begin`)
            garbage.append(g)

    options: dict[str, Any] = {
        "end_offsets": {part.journal: part.end},
        "message_type": builder.message_type,  # lines, decoded by the builder once delivered
        "uuids_of": line_uuids,
        "block": True,  # (to the end offset, waiting at a hole a replica may still fill; never past it)
        "on_garbage": on_garbage,
        "direct": True,
        "on_jump": lost,
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


def _read_raw(
    c: Client, part: JournalRange, lost: Callable[[str, int, int], None], schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """Each message's bytes as written (no UUIDs looked at); undecodable ranges are skipped with a warning."""
    reader = ReadUncommitted(
        c,
        part.journal,
        offsets={part.journal: part.begin},
        end_offsets={part.journal: part.end},
        message_type=msgspec.Raw if part.content_type == NDJSON else None,  # (a line; a frame's payload)
        uuids_of=_no_uuids,
        block=True,
        direct=True,
        on_jump=lost,
    )
    for envs in reader.batches():
        for at in range(0, len(envs), ROWS_PER_BATCH):
            rows = envs[at : at + ROWS_PER_BATCH]
            values = [bytes(e.message) for e in rows]
            yield pa.RecordBatch.from_pydict(
                {"journal": [part.journal] * len(rows), "offset": [e.begin for e in rows], "value": values},
                schema=schema,
            )
