"""Review 22: defects found in the Spark source and sink, each test failing before its fix."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.spark.test_source import NDJSON, P1, line, ndjson_journal
from tests.spark.test_stream import run_available_now
from tests.support.cluster import create_local_journal
from tidings.client import Client
from tidings.message.uuid import OUTSIDE_TXN

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)


def _message(fn) -> str:
    with pytest.raises(Exception) as err:
        fn()
    return str(err.value)


def test_sink_unknown_journal_or_broker_fails_with_one_line_naming_it(spark, local_cluster) -> None:
    """The source checks its journal and broker on the driver and fails in one line naming the
    option; the sink finds out in every task, deep in the Publisher (a 30-line traceback of
    client internals, hints for the CLI's --broker flag), after a retry cycle per task."""
    asyncio.run(create_local_journal(local_cluster, "spark/r22-out", 1, **NDJSON))
    df = spark.createDataFrame([(1, "a")], "id BIGINT, name STRING")

    def write(**opts: str) -> None:
        w = df.write.format("tidings").mode("append").option("broker", local_cluster.endpoints[0])
        for k, v in opts.items():
            w = w.option(k, v)
        w.save()

    for opts, names in (
        ({"journal": "spark/r22-nope"}, "spark/r22-nope"),
        ({"journal": "spark/r22-out", "broker": "127.0.0.1:9"}, "127.0.0.1:9"),
    ):
        msg = _message(lambda opts=opts: write(**opts))
        assert names in msg
        assert msg.count('File "') <= 1, f"a traceback reaches the user:\n{msg[:1500]}"
        assert "option '" in msg, f"the error does not name the option to fix:\n{msg[:1500]}"


def test_overwrite_mode_is_refused_not_silently_appended(spark, local_cluster) -> None:
    """`mode("overwrite")` cannot truncate a journal; Kafka's sink refuses it. Here it appends."""
    asyncio.run(create_local_journal(local_cluster, "spark/r22-ow", 1, **NDJSON))
    df = spark.createDataFrame([(1,)], "id BIGINT")
    w = df.write.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", "spark/r22-ow")
    msg = _message(lambda: w.mode("overwrite").save())
    assert "overwrite" in msg.lower()


def test_a_metadata_column_of_the_wrong_type_is_refused_in_one_line(spark, local_cluster) -> None:
    """`.schema("offset STRING, ...")`: check_schema lets it through; every task then dies with
    pyarrow's 'ArrowTypeError: Expected bytes, got a 'int' object' (building the corrupt batch)."""
    ndjson_journal(local_cluster, "spark/r22-meta", line(P1, 1, OUTSIDE_TXN, id=1))
    df = (
        spark.read.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", "spark/r22-meta")
        .schema("offset STRING, id BIGINT")
    )
    msg = _message(lambda: df.load().collect())
    assert "ArrowTypeError" not in msg and "column 'offset'" in msg, msg[:1500]


def test_a_stream_starting_offset_past_the_head_names_starting_offsets(spark, local_cluster, tmp_path) -> None:
    """A startingOffsets beyond the write head (a user's mistake) is reported as the journal having
    been 'reset or created again', advising failOnDataLoss=false; it should name the option."""
    ndjson_journal(local_cluster, "spark/r22-start", line(P1, 1, OUTSIDE_TXN, id=1))
    msg = _message(
        lambda: run_available_now(
            spark, local_cluster, "spark/r22-start", str(tmp_path / "cp"),
            startingOffsets=json.dumps({"spark/r22-start": 10**9}),
        )
    )  # fmt: skip
    assert "startingOffsets" in msg and "reset or created again" not in msg, msg[:1500]


def test_offsets_naming_a_journal_the_query_does_not_read_are_refused(spark, local_cluster) -> None:
    """Kafka's connector refuses specific offsets for partitions it was not asked to read; here a
    typo in startingOffsets is ignored and the whole journal is read from earliest."""
    ndjson_journal(local_cluster, "spark/r22-typo", line(P1, 1, OUTSIDE_TXN, id=1))
    r = (
        spark.read.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", "spark/r22-typo")
        .option("startingOffsets", json.dumps({"spark/r22-tpyo": 5}))
        .schema("id BIGINT")
    )
    msg = _message(lambda: r.load().collect())
    assert "spark/r22-tpyo" in msg


def test_a_message_split_across_appends_at_a_micro_batch_end_is_delivered(spark, local_cluster, tmp_path) -> None:
    """A micro-batch ends at the write head, taken as a message boundary; a raw append that ended
    mid-line (the batch planner guards against exactly this) splits the message into two corrupt rows."""
    got = split_across_appends(spark, local_cluster, "spark/r22-split", tmp_path)
    assert [i for _, i in got] == [1, 2, 3]


def split_across_appends(spark, lc, journal: str, tmp_path, labels: dict | None = None, **options: str) -> list:
    """Two Trigger.AvailableNow runs over an ndjson journal whose first append ends 10 bytes into
    message 2 and whose second append finishes it and adds message 3: the rows of both runs."""
    second = line(P1, 2, OUTSIDE_TXN, id=2)
    ndjson_journal(lc, journal, line(P1, 1, OUTSIDE_TXN, id=1) + second[:10], **({"labels": labels} if labels else {}))
    cp, raw = str(tmp_path / "cp"), options.get("format") == "raw"
    first = run_available_now(spark, lc, journal, cp, raw=raw, **options)
    with Client(lc.endpoints[0]) as c:
        c.append(journal, second[10:] + line(P1, 3, OUTSIDE_TXN, id=3))
    return first + run_available_now(spark, lc, journal, cp, raw=raw, **options)


def test_a_raw_stream_waits_for_a_line_a_raw_append_left_unfinished(spark, local_cluster, tmp_path) -> None:
    """Read uncommitted (offsets straight to the write heads, no scan), the same: a line is one row."""
    got = split_across_appends(
        spark, local_cluster, "spark/r22-split-raw", tmp_path, format="raw", readCommitted="false"
    )
    assert [json.loads(v)["id"] for _, v in got] == [1, 2, 3]


def test_a_typo_in_option_schema_is_reported_at_the_typo(spark, local_cluster) -> None:
    """The metadata columns' DDL was glued before the user's and parsed as a table schema; a typo
    was then reported as "Syntax error at or near 'STRING'" at our first column, not the user's."""
    ndjson_journal(local_cluster, "spark/r22-ddl", line(P1, 1, OUTSIDE_TXN, id=1))

    def load(ddl: str) -> None:
        r = spark.read.format("tidings").option("broker", local_cluster.endpoints[0])
        r.option("journal", "spark/r22-ddl").option("schema", ddl).load().collect()

    for ddl, says in (("id BIGNT", '"BIGNT"'), ("id BIGINT name STRING", "near 'name'")):
        msg = _message(lambda ddl=ddl: load(ddl))
        assert says in msg and "near 'STRING'" not in msg, msg[:1500]


def test_a_stream_refuses_ending_offsets_instead_of_ignoring_them(spark, local_cluster, tmp_path) -> None:
    """`endingOffsets` on readStream was silently ignored: the stream read on past it. Kafka's
    source refuses it for streams; so does ours, pointing at Trigger.AvailableNow (from the
    reader's first call: PySpark's stream runner buries an error raised in streamReader())."""
    ndjson_journal(local_cluster, "spark/r22-end", line(P1, 1, OUTSIDE_TXN, id=1))
    msg = _message(
        lambda: run_available_now(
            spark, local_cluster, "spark/r22-end", str(tmp_path / "cp"),
            endingOffsets=json.dumps({"spark/r22-end": 0}),
        )
    )  # fmt: skip
    assert "endingOffsets" in msg and "availableNow" in msg, msg[:1500]
    assert "UnboundLocalError" not in msg, msg[:1500]  # (PySpark's runner on an error in streamReader())


def test_a_stream_with_a_wrong_metadata_column_type_fails_with_our_line(spark, local_cluster, tmp_path) -> None:
    """check_schema's refusal, raised in streamReader(), reached the user inside PySpark's own
    UnboundLocalError and two tracebacks."""
    ndjson_journal(local_cluster, "spark/r22-stream-meta", line(P1, 1, OUTSIDE_TXN, id=1))
    df = (
        spark.readStream.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", "spark/r22-stream-meta")
        .schema("offset STRING, id BIGINT")
        .load()
    )
    msg = stream_error(df, tmp_path)
    assert "column 'offset'" in msg and "UnboundLocalError" not in msg, msg[:1500]


def stream_error(df, tmp_path) -> str:
    """What a streaming query over `df` fails with (a noop sink; it must fail within a minute)."""
    query = df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "cp")).start()
    try:
        query.awaitTermination(60)
    except Exception:
        pass  # (the failure is read below, from the query)
    finally:
        query.stop()
    return str(query.exception())
