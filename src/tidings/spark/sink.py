"""The tidings sink: DataFrames written to journals as messages, exactly once.

Each row becomes one message whose fields are the row's columns (a JSON object per line in an
ndjson journal); the sink adds its UUID. Rows go to the journal named by option `journal`, or,
without it, by each row's `journal` column (not written into the message).

Exactly once, as a consumer shard commits (gazette-exactly-once.txt): a task publishes its rows
*uncommitted* under a producer of its own (a new one per task attempt) and returns its ACK
intents; only the driver's `commit` writes ACKs. A failed or speculative attempt's rows are never
acknowledged, so read-committed readers never see them. For a stream, `commit(messages,
batchId)` first records the batch's intents under `<checkpointLocation>/tidings-sink/<batchId>`
(fsspec: any store Spark's checkpoint can be on; created once and never replaced, and synced on a
local disk so a machine crash cannot keep the ACKs and lose their record), and only then writes them. Spark calls
`commit` again for a batch it re-runs after a crash (its commit log is written after our
commit); a commit that finds intents recorded for its batchId writes those again (ACKs are
idempotent) and ignores the new attempts' producers, whose rows were published again. So a crash
at any point, between the ACK writes and Spark's commit log included, delivers each row once.

Unacknowledged rows (failed attempts, re-runs) stay in the journal as pending messages of
producers that never commit; readers skip them, and forget those producers after the Sequencer's
producer horizon.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import StringType, StructType, TimestampType

from tidings.client import AppendService
from tidings.message import AckIntent, Publisher
from tidings.protocol.status import JournalNotFoundError, TransportError, UsageError
from tidings.spark._read import planning_client, unreachable
from tidings.spark.options import DEFAULT_BROKER, OptionError, Security

log = logging.getLogger(__name__)

ROWS_PER_PUBLISH = 2000  # rows handed to the Publisher at a time
INTENTS_KEPT = 100  # batches whose recorded intents are kept (Spark keeps 100 batches of metadata)


@dataclass(frozen=True)
class SinkOptions:
    broker: str
    journal: str | None  # None: each row's `journal` column
    checkpoint: str | None  # the query's checkpointLocation (streams)
    timestamps: tuple[str, ...] = ()  # top-level TIMESTAMP columns, written as UTC
    security: Security = field(default_factory=Security)

    @classmethod
    def parse(cls, options: Mapping[str, str], schema: StructType, streaming: bool) -> SinkOptions:
        lower = {k.lower(): v for k, v in options.items() if v}
        journal = lower.get("journal")
        if journal is None:
            column = next((f for f in schema.fields if f.name == "journal"), None)
            if column is None or not isinstance(column.dataType, StringType):
                raise OptionError("journal", "is missing and the rows have no string column 'journal': give one")
        checkpoint = lower.get("checkpointlocation")
        if streaming and checkpoint is None:
            raise OptionError("checkpointLocation", "is missing: the exactly-once sink records its ACKs there")
        timestamps = tuple(f.name for f in schema.fields if isinstance(f.dataType, TimestampType))
        security = Security.parse(lambda name: lower.get(name.lower()), "sink")
        return cls(lower.get("broker", DEFAULT_BROKER), journal, checkpoint, timestamps, security)


@dataclass(frozen=True)
class Acks(WriterCommitMessage):
    """A task's ACK intents: what the driver writes to commit its rows."""

    intents: list[tuple[str, bytes]]


def check_target(opts: SinkOptions) -> None:
    """On the driver, before any task runs: the broker answers and the journal (option `journal`)
    exists, or the query fails in one line naming the option (rather than in every task)."""
    with planning_client(opts) as c:  # type: ignore[arg-type]  # (it reads .broker and .security)
        try:
            if opts.journal is None:
                c.list()
            else:
                c.write_head(opts.journal)
        except JournalNotFoundError:
            raise UsageError(
                f"tidings sink: journal {opts.journal!r} does not exist (broker {opts.broker}); check option "
                "'journal', or create it with `tidings journals apply`"
            ) from None
        except TransportError as exc:
            raise unreachable("sink", opts.broker, exc) from None


def publish_rows(opts: SinkOptions, rows: Iterator[Any]) -> Acks:
    """Publish a task's rows uncommitted under a new producer; return the ACK intents that commit them."""
    with opts.security.client(opts.broker, retries=None) as c:  # (a task waits out a broker outage)
        service = AppendService(c.aio)
        pub = Publisher(service)
        pending = []
        try:
            chunk: list[Any] = []
            for row in rows:
                chunk.append(row)
                if len(chunk) >= ROWS_PER_PUBLISH:
                    pending.append(c.run(_publish(pub, opts, chunk)))
                    chunk = []
            if chunk:
                pending.append(c.run(_publish(pub, opts, chunk)))
            for futures in pending:
                c.run(_wait(futures))
            intents = pub.build_ack_intents()
        finally:
            c.run(service.aclose())
    return Acks([(i.journal, i.content) for i in intents])


def _message(row: Any, timestamps: tuple[str, ...]) -> dict[str, Any]:
    """A row as a message. PySpark hands TIMESTAMP values over as naive local times: they are
    written with their UTC offset (RFC 3339), so the source, which reads naive times as UTC, gets
    the same instant back."""
    d: dict[str, Any] = row.asDict(recursive=True)
    for name in timestamps:
        t = d.get(name)
        if t is not None and t.tzinfo is None:
            d[name] = t.astimezone(datetime.UTC)
    return d


async def _publish(pub: Publisher, opts: SinkOptions, rows: list[Any]) -> list[Any]:
    journal, timestamps = opts.journal, opts.timestamps
    if journal is not None:
        return [await pub.publish_uncommitted(journal, *(_message(r, timestamps) for r in rows))]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        d = _message(r, timestamps)
        target = d.pop("journal")
        if not target:
            raise OptionError("journal", "column holds an empty journal name in a row; every row needs one")
        groups.setdefault(target, []).append(d)
    return [await pub.publish_uncommitted(j, *msgs) for j, msgs in groups.items()]


async def _wait(futures: list[Any]) -> None:
    for f in futures:
        await f


def write_acks(opts: SinkOptions, intents: list[tuple[str, bytes]]) -> None:
    """Append the ACKs (retried on transient failures: an ACK written twice commits nothing twice)."""
    if not intents:
        return
    with opts.security.client(opts.broker) as c:

        async def write() -> None:
            service = AppendService(c.aio)
            try:
                pub = Publisher(service)
                await (await pub.write_ack_intents([AckIntent(j, content) for j, content in intents]))
            finally:
                await service.aclose()

        c.run(write())


def _intents_of(messages: list[WriterCommitMessage | None]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for m in messages:
        if isinstance(m, Acks):
            out.extend(m.intents)
    return out


class TidingsWriter(DataSourceWriter):
    """`df.write.format("tidings")`: rows published by the tasks, acknowledged once the job commits.

    Without a checkpoint nothing records the ACKs: a driver killed while writing them may leave some
    tasks' rows committed and others not, and a re-run writes every row again (README)."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> Acks:
        return publish_rows(self.options, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        write_acks(self.options, _intents_of(messages))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning("write to tidings aborted: its rows stay unacknowledged (never read committed)")


class TidingsStreamWriter(DataSourceStreamWriter):
    """`writeStream.format("tidings")`: see the module docstring for how a batch commits once."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> Acks:
        return publish_rows(self.options, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        assert self.options.checkpoint is not None
        write_acks(self.options, record_intents(self.options.checkpoint, batchId, _intents_of(messages)))
        fs, root = fsspec.core.url_to_fs(self.options.checkpoint.rstrip("/") + "/tidings-sink")
        for old in fs.glob(f"{root}/*.json"):
            name = old.rsplit("/", 1)[-1].removesuffix(".json")
            if name.isdigit() and int(name) < batchId - INTENTS_KEPT:
                fs.rm(old)
        for tmp in fs.glob(f"{root}/.*.tmp"):  # (left by a crash while recording an earlier batch)
            name = tmp.rsplit("/", 1)[-1].split(".")[1]
            if name.isdigit() and int(name) < batchId:
                fs.rm(tmp)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("batch %d aborted: its rows stay unacknowledged (never read committed)", batchId)


def record_intents(checkpoint: str, batch_id: int, mine: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The ACK intents to write for a batch: those recorded for it under `checkpoint` by an earlier
    commit (Spark re-runs a batch after a crash), else `mine`, recorded first. A record is created
    once and never replaced (two racing commits write the same ACKs), and on a local disk it is
    synced before any ACK is written: a machine crash must not lose the record of ACKs it outlives."""
    fs, root = fsspec.core.url_to_fs(checkpoint.rstrip("/") + "/tidings-sink")
    path = f"{root}/{batch_id}.json"
    if not fs.exists(path):
        fs.makedirs(root, exist_ok=True)
        _create_once(fs, root, path, json.dumps([(j, content.hex()) for j, content in mine]).encode())
    with fs.open(path, "rb") as f:
        recorded = [(j, bytes.fromhex(h)) for j, h in json.load(f)]
    if recorded != mine:
        log.info("batch %d: ACKs recorded by an earlier commit are written again", batch_id)
    return recorded


def _create_once(fs: Any, root: str, path: str, data: bytes) -> None:
    """Create `path` holding `data`, whole, unless it exists. A local file is written and synced
    under a private name, then linked in (which fails if the name exists; renamed after a last
    existence check where there are no hard links) and its directory synced. Elsewhere the file
    system's exclusive creation (mode "xb": S3's conditional write, If-None-Match) refuses an
    existing record; a file system without it gets a file that appears whole at close, after a last
    existence check, where two commits racing could both record (Spark runs one query per
    checkpoint, so only a driver thought dead and its successor could)."""
    if isinstance(fs, LocalFileSystem):
        _create_local(root, path, data)
        return
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
        return
    except FileExistsError:
        return
    except Exception as exc:  # (no exclusive creation here: an S3-compatible store refusing If-None-Match, say)
        log.warning("%s: exclusive creation refused (%s); recording %s after an existence check",
                    type(fs).__name__, exc, path)  # fmt: skip
    tmp = _tmp_name(root, path)
    with fs.open(tmp, "wb") as f:
        f.write(data)
    if not fs.exists(path):
        fs.mv(tmp, path)
    else:
        fs.rm(tmp)


def _tmp_name(root: str, path: str) -> str:
    return f"{root}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"


def _create_local(root: str, path: str, data: bytes) -> None:
    tmp = _tmp_name(root, path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # (a file system without hard links: FUSE mounts such as /dbfs, SMB, exFAT)
        if not os.path.exists(path):
            os.rename(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
