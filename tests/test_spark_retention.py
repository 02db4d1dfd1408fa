"""Journals retention emptied (review 21): an idle journal whose every fragment was removed keeps
its write head where its next append lands, so a stream that read all of it goes on, and a journal
a selector finds while emptied is read from its next byte, not from 0 as if bytes were lost."""

from __future__ import annotations

import asyncio

from pyspark.sql.streaming.datasource import ReadAllAvailable
from pyspark.sql.types import LongType, StringType, StructField, StructType

from tests.support.waiting import wait_until
from tests.test_spark_source import NDJSON, P1, P4, line, ndjson_journal
from tidings.client import Client
from tidings.fragment.store import store_for
from tidings.message.uuid import OUTSIDE_TXN
from tidings.spark.options import SourceOptions
from tidings.spark.stream import TidingsStreamReader


def emptied_journal(lc, name: str, labels: dict[str, str]) -> int:
    """A journal written (two fragments, persisted) and then emptied by retention; its old end."""
    ndjson_journal(lc, name, labels=labels, fragment={"length": "1KiB", "refresh_interval": "1s"})
    with Client(lc.endpoints[0]) as c:
        for i in (1, 2):  # a fragment each
            end = c.append(name, line(P1, i, OUTSIDE_TXN, id=10 + i, pad="x" * 2000)).end
        store = store_for(lc.store_url)
        asyncio.run(wait_until(lambda: len(store.list(name)) >= 2, 30))

        def emptied() -> bool:
            """Retention removes every fragment of this idle journal, again should the last (an open
            spool, persisted before it rolled) be persisted once more, until brokers list none."""
            for f in store.list(name):
                store.remove(f)
            return not c.fragments(name).fragments

        asyncio.run(wait_until(emptied, 30))
    return end


def test_write_head_of_a_journal_retention_emptied_is_where_its_next_append_lands(local_cluster) -> None:
    """A reader's write head never goes backwards: it was 0 here, while the next append landed at the old end."""
    journal = "spark/emptied-head"
    end = emptied_journal(local_cluster, journal, {})
    with Client(local_cluster.endpoints[0]) as c:
        head = c.write_head(journal)
        landed = c.append(journal, line(P1, 3, OUTSIDE_TXN, id=13)).begin
    assert landed == end
    assert head == landed, f"write_head() said {head}, the next append landed at {landed}"


def reader_of(lc, **options: str) -> TidingsStreamReader:
    columns = (("journal", StringType()), ("offset", LongType()), ("id", LongType()))
    schema = StructType([StructField(n, t) for n, t in columns])
    return TidingsStreamReader(SourceOptions.parse({"broker": lc.endpoints[0], **options}), schema)


def test_a_found_journal_emptied_by_retention_then_written_does_not_fail_as_lost(local_cluster) -> None:
    """The reader's own calls, as Spark makes them: the journal is found while emptied, then
    written; its batch starts at the journal's first byte, not at 0."""
    labels = {**NDJSON["labels"], "topic": "found-emptied"}
    ndjson_journal(local_cluster, "spark/found-emptied-first", line(P4, 1, OUTSIDE_TXN, id=1), labels=labels)
    later = "spark/found-emptied"
    emptied_journal(local_cluster, later, {"topic": "found-emptied"})
    reader = reader_of(local_cluster, selector="topic=found-emptied")
    try:
        start = {"journals": {"spark/found-emptied-first": {"read_through": 0}}}  # (before `later` matched)
        first = reader.latestOffset(start, ReadAllAvailable())  # finds `later`, emptied: nothing to read there
        assert later not in first["journals"]
        with Client(local_cluster.endpoints[0]) as c:
            landed = c.append(later, line(P1, 3, OUTSIDE_TXN, id=13)).begin
        reader._heads.clear()  # (past HEAD_TTL)
        end = reader.latestOffset(first, ReadAllAvailable())
        ranges = [r for r in reader.partitions(first, end) if r.journal == later]
        assert sum(b.num_rows for r in ranges for b in reader.read(r)) == 1  # (failOnDataLoss: the default)
        assert ranges[0].begin == landed, f"{later} planned from {ranges[0].begin}, its first byte is {landed}"
    finally:
        reader.stop()


def test_a_query_that_read_all_of_a_journal_survives_retention_emptying_it(local_cluster) -> None:
    """A stream read a journal to its end; retention then removed every fragment (no byte the query
    had not read). The write head was 0, taken for a reset: the query failed (failOnDataLoss)."""
    journal = "spark/idle-expired"
    end = emptied_journal(local_cluster, journal, {})
    reader = reader_of(local_cluster, journal=journal)
    try:
        start = {"journals": {journal: {"read_through": end}}}  # everything was read
        assert reader.latestOffset(start, ReadAllAvailable()) == start  # nothing new, and nothing lost
    finally:
        reader.stop()
