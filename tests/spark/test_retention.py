"""Journals retention emptied: an idle journal whose every fragment was removed keeps its write head
where its next append lands, so a stream that read all of it goes on, cheaply, and a journal a
selector finds while emptied is read from its next byte, not from 0 as if bytes were lost."""

from __future__ import annotations

import asyncio
import json

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable
from pyspark.sql.types import LongType, StringType, StructField, StructType

from tests.spark._support import NDJSON, P1, P4, line, ndjson_journal
from tests.support.waiting import wait_until
from tidings.client import Client
from tidings.fragment.store import store_for
from tidings.message.uuid import OUTSIDE_TXN
from tidings.protocol.status import UsageError
from tidings.spark.options import SourceOptions
from tidings.spark.stream import TidingsStreamReader

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)


def emptied_journal(lc, name: str, labels: dict[str, str]) -> int:
    """A journal written (two fragments, persisted) and then emptied by retention; its old end."""
    ndjson_journal(lc, name, labels=labels, fragment={"length": "1KiB", "refresh_interval": "1s"})
    with Client(lc.endpoints[0]) as c:
        for i in (1, 2):  # a fragment each
            end = c.append(name, line(P1, i, OUTSIDE_TXN, id=10 + i, pad="x" * 2000)).end
        store = store_for(lc.store_url)

        def persisted() -> bool:
            """Both fragments in the store, and the broker's index knows them from there: a local
            entry the broker has not yet seen listed would stay in its index after their removal."""
            return len(store.list(name)) >= 2 and all(e.url for e in c.fragments(name).fragments)

        asyncio.run(wait_until(persisted, 30))

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


def test_trigger_available_now_leaves_a_journal_found_after_its_start_for_the_next_run(local_cluster) -> None:
    """Trigger.AvailableNow reads to the write heads it found at the start (as Kafka's source reads
    the partitions it knew then): a journal the selector finds mid-run waits for the next run, and
    is not taken for a journal reset because it had no head in that list (its first byte is > 0)."""
    labels = {**NDJSON["labels"], "topic": "found-available-now"}
    first = "spark/found-available-now-first"
    ndjson_journal(local_cluster, first, line(P4, 1, OUTSIDE_TXN, id=1), labels=labels)
    reader = reader_of(local_cluster, selector="topic=found-available-now")
    try:
        start = reader.initialOffset()
        reader.prepareForTriggerAvailableNow()
        later = "spark/found-available-now"
        emptied_journal(local_cluster, later, {"topic": "found-available-now"})  # (first held byte > 0)
        reader._specs = (0.0, {})  # (past JOURNALS_TTL)
        end = reader.latestOffset(start, ReadAllAvailable())
        assert set(end["journals"]) == {first}, end
        ranges = reader.partitions(start, end)
        assert [(r.journal, sum(b.num_rows for b in reader.read(r))) for r in ranges] == [(first, 1)]
        assert reader.latestOffset(end, ReadAllAvailable()) == end  # (done: AvailableNow's run ends)
    finally:
        reader.stop()


def test_a_stream_at_bytes_retention_removed_waits_without_holding_up_its_other_journals(local_cluster) -> None:
    """Retention removed every byte of `gone` from the stream's offset to its write head: a read
    there waits for bytes (as Gazette's readers do), and latestOffset did, for ever, holding up the
    query's other journals. Now `gone` waits alone; once written, the lost bytes are reported by the
    tasks (failOnDataLoss) or skipped."""
    labels = NDJSON["labels"]
    ndjson_journal(local_cluster, "spark/live", line(P4, 1, OUTSIDE_TXN, id=1), labels=labels)
    gone = "spark/gone"
    end = emptied_journal(local_cluster, gone, labels)
    start = {"journals": {"spark/live": {"read_through": 0}, gone: {"read_through": 0}}}
    for committed in ("true", "false"):
        reader = reader_of(local_cluster, journal=f"spark/live,{gone}", readCommitted=committed)
        try:
            first = reader.latestOffset(start, ReadAllAvailable())
            assert first["journals"][gone]["read_through"] == 0 and first["journals"]["spark/live"]["read_through"] > 0
        finally:
            reader.stop()
    with Client(local_cluster.endpoints[0]) as c:
        c.append(gone, line(P1, 3, OUTSIDE_TXN, id=13))
    for fail, rows in (("true", None), ("false", 1)):
        reader = reader_of(local_cluster, journal=gone, failOnDataLoss=fail)
        try:
            only = {"journals": {gone: {"read_through": 0}}}

            def moved(reader: TidingsStreamReader = reader, only: dict = only) -> dict | None:
                """The batch once the replica asked reads on from 0 (its new fragment persisted and listed)."""
                reader._heads.clear()
                end = reader.latestOffset(only, ReadAllAvailable())
                return end if end != only else None

            ranges = reader.partitions(only, asyncio.run(wait_until(moved, 30)))
            if rows is None:
                with pytest.raises(UsageError, match=rf"no longer holds bytes \[0, {end}\)"):
                    [b for r in ranges for b in reader.read(r)]
            else:
                assert sum(b.num_rows for r in ranges for b in reader.read(r)) == rows
        finally:
            reader.stop()


def test_starting_offsets_below_what_retention_left_fail_or_start_at_the_first_byte(spark, local_cluster) -> None:
    """startingOffsets {journal: 0} on a journal retention emptied: the task's read waited for ever
    at 0. Now an offset below the first held byte is lost data, as an out-of-range offset is to
    Kafka's source: the query fails naming the option, or starts at that byte (failOnDataLoss=false)."""
    gone = "spark/gone-batch"
    end = emptied_journal(local_cluster, gone, NDJSON["labels"])

    def count(**opts: str) -> int:
        r = spark.read.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", gone)
        for k, v in {"startingOffsets": json.dumps({gone: 0}), **opts}.items():
            r = r.option(k, v)
        return r.schema("id BIGINT").load().count()

    with pytest.raises(Exception) as err:
        count()
    msg = str(err.value)
    assert "startingOffsets" in msg and f"from {end} on" in msg and msg.count('File "') <= 1, msg[:1500]
    assert count(failOnDataLoss="false") == 0
    with Client(local_cluster.endpoints[0]) as c:
        c.append(gone, line(P1, 3, OUTSIDE_TXN, id=13))
    assert count(failOnDataLoss="false") == 1


def test_an_idle_query_with_a_journal_retention_emptied_asks_no_more_than_its_cached_heads(
    local_cluster, monkeypatch
) -> None:
    """latestOffset runs about every 13 ms while idle; write heads are asked for at most every
    HEAD_TTL per journal so an idle query costs little, and a journal whose bytes at the query's
    offset retention removed (it waits, `_readable`) is probed no more often: uncached, it cost an
    RPC per poll per such journal for as long as it waits (hours, until its next bytes are
    persisted), and on a broker whose index has a hole below the head, a store listing each time
    (read_api). The reader's clock is frozen here, so the counts do not depend on this machine's speed."""
    from tidings.spark import stream  # (its clock frozen below)

    gone = "spark/ret-gone"
    emptied_journal(local_cluster, gone, {})
    now = [1000.0]
    monkeypatch.setattr(stream.time, "monotonic", lambda: now[0])
    reader = reader_of(local_cluster, journal=gone)
    calls = {"probe": 0, "write_head": 0}
    try:
        aio = reader.client.aio
        for name in calls:
            real = getattr(aio, name)

            async def counted(*args, _real=real, _name=name):
                calls[_name] += _name != "probe" or args[-1] >= 0  # (write_head probes at -1)
                return await _real(*args)

            setattr(aio, name, counted)
        start = {"journals": {gone: {"read_through": 0}}}
        for _ in range(40):
            assert reader.latestOffset(start, ReadAllAvailable()) == start  # (waiting: nothing to read)
        assert calls == {"probe": 1, "write_head": 1}, calls
        now[0] += stream.WAIT_RECHECK  # (then asked again, in case its next bytes came)
        assert reader.latestOffset(start, ReadAllAvailable()) == start
        assert calls == {"probe": 2, "write_head": 2}, calls
    finally:
        reader.stop()
