"""The tidings batch source (`spark.read`): a query's journals planned as partitions, read by tasks.

Planning (`partitions()`, in a Python process of the driver) lists the journals and fixes each
one's range [start, end) from `startingOffsets` / `endingOffsets` (end `latest`: the write head at
planning), so a partition reads the same messages however far the journal grows meanwhile, and
Spark may re-run it. Reading (`read()`, on executors) yields Arrow RecordBatches; with
`readCommitted` (the default) a Sequencer delivers each committed message once, as `tidings
journals read --committed` does, and messages of transactions still open at the range's end are
not delivered.

A journal's range is split into partitions of about equal bytes at fragment boundaries: enough
that none holds much more than `bytesPerPartition` (default 128 MiB, as Spark's
`spark.sql.files.maxPartitionBytes`), and at least `minPartitions` (Kafka's name; default 1), as
far as the fragments allow (a fragment is never split). A task
reads persisted fragments straight from their store (fsspec) and only the unpersisted tail
through a broker: the executors move the bytes. Fragments end where appends end, so a split never
cuts a message a publisher wrote (a raw append that ended mid-line keeps its journal unsplit
there: the planner checks the byte before each cut). Read committed, a partition needs the
producer states at its start (a transaction may span partitions; a duplicate may repeat a message
of an earlier one): the driver computes them with one pass over the range that decodes only the
UUIDs (`scan`), reading the fragments from the store too. A partition then delivers what a single
reader delivers between its two states: each committed message once, in the partition of its ACK.
That pass costs the driver about a third of a task's work per byte (bench/README.md); a journal of
one fragment, or read uncommitted, needs none.

Reads wait for every byte of their range: at a hole no broker serves yet (a replica may still be
persisting it) they wait, as Gazette's readers do, and brokers move past a hole only once the
fragment after it is hours old (retention's holes are): that jump fails the task naming the bytes,
or with failOnDataLoss=false is skipped with a warning. So an explicit end past the write head is
cut to it at planning, `earliest` is a journal's first held byte (as Kafka's log start), and a
task first checks that its journal still reaches the end of its range: one reset (deleted and
created again) or deleted since planning fails the task naming it, or is skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader
from pyspark.sql.types import StructType

from tidings.client import Client
from tidings.message import Checkpoint, JournalCheckpoint
from tidings.message.framing import NDJSON
from tidings.message.publisher import content_type_of
from tidings.protocol import protocol_pb2 as pb
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


class TidingsBatchReader(DataSourceReader):
    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.options = options
        self.schema_json = schema.json()
        check_schema(options.format, self.schema_json)  # (a mistake fails the query here, on the driver)

    @_one_line
    def partitions(self) -> list[JournalRange]:
        opts = self.options
        with planning_client(opts) as c:
            ranges = []
            for spec in resolve_journals(c, opts):
                begin = starting_offset(c, opts, spec.name)
                end = offset_for(c, spec.name, opts.ending, "latest")
                if isinstance(opts.ending, dict):  # (past the write head: to it, as tasks wait for every byte)
                    end = min(end, c.write_head(spec.name))
                end = max(begin, end)
                ranges.extend(self._split(c, spec, begin, end))
        return ranges or [JournalRange("", NDJSON, 0, 0)]

    def _split(self, c: Client, spec: pb.JournalSpec, begin: int, end: int) -> list[JournalRange]:
        """A journal's range as partitions of whole fragments, each with the producer states at its start."""
        name, content_type = spec.name, content_type_of(spec)
        parts = max(-(-(end - begin) // self.options.bytes_per_partition), self.options.min_partitions)
        cuts = []
        if content_type == NDJSON and parts > 1:
            cuts = fragment_cuts(c.fragments(name), begin, end, parts)
        if not self.options.read_committed:
            cuts = [at for at in cuts if whole_at(c, name, at)]  # (not a line a raw append cut)
            return [JournalRange(name, content_type, a, b) for a, b in itertools.pairwise([begin, *cuts, end])]
        ranges = []
        state, producers = JournalCheckpoint(begin, {}), None
        for cut in cuts:
            reached = scan(c, True, Checkpoint({name: state}), {name: cut}, {}, horizon=None).journals[name]
            if reached.read_through > state.read_through:  # (cut back to its last whole message)
                ranges.append(JournalRange(name, content_type, state.read_through, reached.read_through, producers))
                state, producers = reached, msgspec.to_builtins(reached.producers)
        ranges.append(JournalRange(name, content_type, state.read_through, end, producers))
        return ranges

    def read(self, partition: JournalRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]  # (our partitions)
        return read_partition(self.options, self.schema_json, partition)


def fragment_cuts(listing: pb.FragmentsResponse, begin: int, end: int, parts: int) -> list[int]:
    """Offsets in (begin, end) where a reader goes from one fragment to the next, chosen to split the
    range into `parts` partitions of about equal bytes (fewer when fragments are too few or too big)."""
    frags = sorted((f.spec.begin, f.spec.end) for f in listing.fragments)
    bounds: list[int] = []
    i, at = 0, begin
    while at < end:
        reach = at
        while i < len(frags) and frags[i][0] <= at:  # the fragment reaching furthest from `at`
            reach = max(reach, frags[i][1])
            i += 1
        if reach == at:  # a gap (removed by retention): the next fragment's start
            if i == len(frags):
                break
            reach = frags[i][0]
        at = reach
        if at < end:
            bounds.append(at)
    parts = min(parts, len(bounds) + 1)  # (a partition holds whole fragments: no more parts than them)
    cuts: list[int] = []
    at = 0
    for k in range(1, parts):  # the boundary nearest each even target, in one pass over them
        target = begin + (end - begin) * k // parts
        while at + 1 < len(bounds) and abs(bounds[at + 1] - target) <= abs(bounds[at] - target):
            at += 1
        if bounds[at] > (cuts[-1] if cuts else begin):
            cuts.append(bounds[at])
    return cuts
