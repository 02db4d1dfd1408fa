"""Review 24: the Spark stream source (defects found in review, each test failing first)."""

from __future__ import annotations

import pytest

from tests.spark.test_review_22 import stream_error
from tests.spark.test_source import P1, line, ndjson_journal
from tidings.message.uuid import OUTSIDE_TXN

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)


@pytest.mark.parametrize(
    ("option", "value"),
    [("maxBytesPerTrigger", "lots"), ("producerHorizon", "forever"), ("failOnDataLoss", "maybe")],
)
def test_a_bad_stream_option_with_an_explicit_schema_fails_with_our_one_line(
    spark, local_cluster, tmp_path, option, value
) -> None:
    """With .schema() given, Spark never calls DataSource.schema() (which parses the options under
    _one_line); the options are first parsed in streamReader(), and an OptionError raised there
    reaches the user inside PySpark 4.3's stream runner's UnboundLocalError with two tracebacks --
    the very failure `_usable` defers check_schema's and endingOffsets' errors to avoid."""
    journal = f"spark/r24-opt-{option}"  # (one per case: the module shares its cluster)
    ndjson_journal(local_cluster, journal, line(P1, 1, OUTSIDE_TXN, id=1))
    df = (
        spark.readStream.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", journal)
        .option(option, value)
        .schema("id BIGINT")
        .load()
    )
    msg = stream_error(df, tmp_path)
    assert option in msg and "UnboundLocalError" not in msg, msg[:2000]
    ours = [ln for ln in msg.splitlines() if 'File "' in ln and "pyspark" not in ln]
    assert len(ours) <= 1, msg[:2000]  # (PySpark's stream runner adds its own frames to any error)


def test_an_idle_query_with_a_journal_retention_emptied_asks_no_more_than_its_cached_heads(
    local_cluster, monkeypatch
) -> None:
    """latestOffset runs about every 13 ms while idle; write heads are asked for at most every
    HEAD_TTL per journal so an idle query costs little. A journal whose bytes at the query's offset
    retention removed (it waits, `_readable`) was probed on every call, uncached: an RPC per poll per
    such journal for as long as it waits (hours, until its next bytes are persisted), and on a
    broker whose index has a hole below the head, a store listing each time (read_api). The
    reader's clock is frozen here, so the counts do not depend on this machine's speed."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from tests.spark.test_retention import emptied_journal, reader_of
    from tidings.spark import stream

    gone = "spark/r24-gone"
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
