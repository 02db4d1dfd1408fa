"""The tidings streaming source on a real local Spark against real brokers: each committed message
is delivered once, in the micro-batch of its ACK, across restarts from Spark's checkpoint, journals
a selector finds later and appends that end mid-message (DESIGN.md invariant 7); bad stream options
fail the query in one line naming them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.spark._support import CASES, NDJSON, P1, P2, P4, error_message, line, ndjson_journal
from tests.support.waiting import wait_until_sync
from tidings.client import Client
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)

MINUTE = 60 * 10_000_000 << 4  # a minute of UUID clock: 100 ns ticks, 4 sequence bits


def run_available_now(
    spark, lc, journal: str, checkpoint: str, *, raw: bool = False, **options: str
) -> list[tuple[int, Any]]:
    """One Trigger.AvailableNow run from `checkpoint`: [(batch id, message id, or raw value)] in delivery order."""
    got: list[tuple[int, Any]] = []

    def collect(df, batch_id: int) -> None:
        got.extend((batch_id, bytes(r.value) if raw else r.id) for r in df.orderBy("offset").collect())

    reader = spark.readStream.format("tidings").option("broker", lc.endpoints[0]).option("journal", journal)
    for k, v in options.items():
        reader = reader.option(k, v)
    query = (
        (reader if raw else reader.schema("offset BIGINT, id BIGINT"))
        .load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination(120)
    finally:
        query.stop()
    assert query.exception() is None
    return got


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


def test_a_transaction_across_micro_batches_is_delivered_once_in_the_batch_of_its_ack(
    spark, local_cluster, tmp_path
) -> None:
    journal = "spark/stream-txn"
    ndjson_journal(local_cluster, journal, CASES, replication=3)
    line_size = max(len(x) for x in CASES.split(b"\n")) + 1
    got = run_available_now(spark, local_cluster, journal, str(tmp_path / "cp"), maxBytesPerTrigger=str(line_size))
    assert [i for _, i in got] == [1, 7, 2, 3, 6]
    batches = len(list((tmp_path / "cp" / "offsets").iterdir()))
    assert batches >= len(CASES.split(b"\n")) - 1  # about a line per micro-batch
    batch_of = {i: b for b, i in got}
    # P2's transaction began two lines after id 7 and its ACK came three lines later: delivered whole,
    # in a later batch than id 7's.
    assert batch_of[2] == batch_of[3] >= batch_of[7] + 3

    # A cap below one message: each batch takes one whole message, the deliveries are the same.
    tiny = run_available_now(spark, local_cluster, journal, str(tmp_path / "cp-tiny"), maxBytesPerTrigger="10")
    assert [i for _, i in tiny] == [1, 7, 2, 3, 6]

    # The open transaction of P4 commits later: a restart from the checkpoint delivers it, and nothing again.
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, line(P4, 1, ACK_TXN) + line(P4, 2, OUTSIDE_TXN, id=8, name="eight"))
    again = run_available_now(spark, local_cluster, journal, str(tmp_path / "cp"))
    assert [i for _, i in again] == [5, 8]


def selector_query(spark, lc, topic: str, checkpoint: str):
    """A query over the journals labelled topic=`topic` into memory table `topic`, and its rows' (journal, id)."""
    query = (
        spark.readStream.format("tidings")
        .option("broker", lc.endpoints[0])
        .option("selector", f"topic={topic}")
        .option("schema", "id BIGINT")
        .load()
        .writeStream.format("memory")
        .queryName(topic)
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime="200 milliseconds")
        .start()
    )

    def rows() -> list[tuple[str, int]]:
        return sorted((r.journal, r.id) for r in spark.sql(f"select journal, id from {topic}").collect())

    return query, rows


def test_a_selector_picks_up_a_journal_created_while_the_query_runs(spark, local_cluster, tmp_path) -> None:
    labels = {**NDJSON["labels"], "topic": "live"}
    ndjson_journal(local_cluster, "spark/live-a", line(P4, 1, OUTSIDE_TXN, id=1), labels=labels)
    query, rows = selector_query(spark, local_cluster, "live", str(tmp_path / "cp"))
    try:
        wait_until_sync(lambda: rows() == [("spark/live-a", 1)], 60)
        ndjson_journal(local_cluster, "spark/live-b", line(P4, 1, OUTSIDE_TXN, id=2), labels=labels)
        with Client(local_cluster.endpoints[0]) as c:
            c.append("spark/live-a", line(P4, 2, OUTSIDE_TXN, id=3))
        wait_until_sync(lambda: rows() == [("spark/live-a", 1), ("spark/live-a", 3), ("spark/live-b", 2)], 60)
        assert query.exception() is None
    finally:
        query.stop()


def test_a_journal_created_again_below_the_querys_offset_fails_the_query_naming_it(
    spark, local_cluster, tmp_path
) -> None:
    from tidings.protocol import protocol_pb2 as pb

    journal = "spark/recreated"
    ndjson_journal(local_cluster, journal, CASES)
    assert len(run_available_now(spark, local_cluster, journal, str(tmp_path / "cp"))) == 5
    with Client(local_cluster.endpoints[0]) as c:
        rev = next(j.mod_revision for j in c.list().journals if j.spec.name == journal)
        c.apply([pb.ApplyRequest.Change(delete=journal, expect_mod_revision=rev)])
    fresh_store = {"stores": [local_cluster.store_url.rstrip("/") + "/elsewhere/"]}  # (the old one has its fragments)
    ndjson_journal(local_cluster, journal, line(P4, 9, OUTSIDE_TXN, id=9), fragment=fresh_store)
    with pytest.raises(Exception) as err:
        run_available_now(spark, local_cluster, journal, str(tmp_path / "cp"))
    assert f"journal '{journal}' ends at" in str(err.value) and "failOnDataLoss=false" in str(err.value)
    again = run_available_now(spark, local_cluster, journal, str(tmp_path / "cp"), failOnDataLoss="false")
    assert [i for _, i in again] == [9]


def test_a_journal_a_selector_finds_later_starts_at_its_first_held_byte(spark, local_cluster, tmp_path) -> None:
    """A journal that comes to match the selector while the query runs is read from its first held
    byte (as Kafka's newly found partitions start at earliest), not from offset 0: its first
    fragment here was removed by retention, which is no loss to this query (it never had those
    bytes), yet a read from 0 took it for one and failed the query."""
    import asyncio

    from tests.support.waiting import wait_until
    from tidings.fragment.store import store_for
    from tidings.protocol import protocol_pb2 as pb

    later = "spark/found-later"
    ndjson_journal(
        local_cluster, later, labels={"topic": "elsewhere"}, fragment={"length": "1KiB", "refresh_interval": "1s"}
    )
    with Client(local_cluster.endpoints[0]) as c:
        for i in (1, 2):  # a fragment each
            c.append(later, line(P1, i, OUTSIDE_TXN, id=10 + i, pad="x" * 2000))
        store = store_for(local_cluster.store_url)
        asyncio.run(wait_until(lambda: len(store.list(later)) == 2, 30))
        first = min(store.list(later), key=lambda f: f.begin)
        store.remove(first)  # retention removed the oldest

        def forgotten() -> bool:
            return all(f.spec.begin != first.begin for f in c.fragments(later).fragments)

        asyncio.run(wait_until(forgotten, 30))

    labels = {**NDJSON["labels"], "topic": "found"}
    ndjson_journal(local_cluster, "spark/found-first", line(P4, 1, OUTSIDE_TXN, id=1), labels=labels)
    query, rows = selector_query(spark, local_cluster, "found", str(tmp_path / "cp"))
    try:
        wait_until_sync(lambda: rows() == [("spark/found-first", 1)], 60)
        with Client(local_cluster.endpoints[0]) as c:
            listed = next(j for j in c.list().journals if j.spec.name == later)
            spec = listed.spec
            for label in spec.labels.labels:
                if label.name == "topic":
                    label.value = "found"
            c.apply([pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=listed.mod_revision)])
        wait_until_sync(lambda: rows() == [("spark/found-first", 1), (later, 12)], 60)
        assert query.exception() is None
    finally:
        query.stop()


def test_raw_rows_of_a_protobuf_journal_stream_under_max_bytes_per_trigger(spark, local_cluster, tmp_path) -> None:
    """format raw reads journals of any framing; with maxBytesPerTrigger the driver finds each
    batch's end at a whole message of the journal's own framing (Gazette's fixed protobuf frames
    here), so every payload arrives once, whole."""
    import asyncio

    from tests.support.cluster import create_local_journal

    journal = "spark/raw-frames"
    labels = {"content-type": "application/x-protobuf-fixed"}
    asyncio.run(create_local_journal(local_cluster, journal, 1, labels=labels))
    payloads = [bytes([i]) * (10 + i) for i in range(1, 13)]
    frames = b"".join(b"\x66\x33\x93\x36" + len(p).to_bytes(4, "little") + p for p in payloads)
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, frames)
    got = run_available_now(
        spark, local_cluster, journal, str(tmp_path / "cp"), raw=True,
        format="raw", readCommitted="false", maxBytesPerTrigger="40",
    )  # fmt: skip
    assert [value for _, value in got] == payloads
    assert len(list((tmp_path / "cp" / "offsets").iterdir())) > 3  # (several micro-batches)


def test_producer_horizon_bounds_the_producers_an_offset_keeps(spark, local_cluster, tmp_path) -> None:
    """A stream's offsets keep the producers heard from within `producerHorizon` of the newest (in
    their clocks' time); 24 h by default. (A sink's journal gains a producer per task attempt.)"""
    hour = 3600 * 10_000_000 << 4  # an hour of UUID clock: 100 ns ticks, 4 sequence bits
    journal = "spark/horizon"
    ndjson_journal(
        local_cluster,
        journal,
        line(P1, 1, OUTSIDE_TXN, id=1) + line(P4, 2 * hour, OUTSIDE_TXN, id=2),
    )

    def producers(checkpoint: str, **options: str) -> set[str]:
        assert [i for _, i in run_available_now(spark, local_cluster, journal, checkpoint, **options)] == [1, 2]
        offsets = tmp_path / checkpoint / "offsets"  # (an absolute `checkpoint`: that path)
        last = max(offsets.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
        return set(json.loads(last.read_text().splitlines()[-1])["journals"][journal]["producers"])

    assert producers(str(tmp_path / "default")) == {P1.hex(), P4.hex()}
    assert producers(str(tmp_path / "short"), producerHorizon="1h") == {P4.hex()}


@pytest.mark.parametrize("horizon", ["1h", None])
def test_a_horizon_longer_than_a_sink_batch_keeps_its_early_tasks_rows(spark, local_cluster, tmp_path, horizon) -> None:
    """A sink task's producer has its transaction open from its first rows until the driver's commit
    writes its ACK; a micro-batch boundary in between must not forget it, or its ACK commits nothing
    (as in Gazette). A horizon must exceed the longest batch (the docs say so; 10m is shorter than
    a batch whose last task starts 11 minutes after its first: skew, a retry, a driver re-running a
    commit). Here one that does (1h), and the 24 h default."""
    journal = f"spark/st-horizon-{horizon}"
    early, late = 1, 1 + 11 * MINUTE
    ndjson_journal(
        local_cluster,
        journal,
        line(P1, early, CONTINUE_TXN, id=1) + line(P2, late, CONTINUE_TXN, id=2),  # two tasks' rows, uncommitted
    )
    cp = str(tmp_path / "cp")
    options = {"producerHorizon": horizon} if horizon else {}
    assert run_available_now(spark, local_cluster, journal, cp, **options) == []  # (nothing committed yet)
    with Client(local_cluster.endpoints[0]) as c:  # the driver's commit: both tasks' ACKs
        c.append(journal, line(P1, early, ACK_TXN) + line(P2, late, ACK_TXN))
    again = run_available_now(spark, local_cluster, journal, cp, **options)
    assert sorted(i for _, i in again) == [1, 2]


def test_a_message_split_across_appends_at_a_micro_batch_end_is_delivered(spark, local_cluster, tmp_path) -> None:
    """A micro-batch ends at the write head, taken as a message boundary; a raw append that ended
    mid-line must not split its message into two corrupt rows (the batch planner guards against
    exactly this)."""
    got = split_across_appends(spark, local_cluster, "spark/st-split", tmp_path)
    assert [i for _, i in got] == [1, 2, 3]


def test_a_raw_stream_waits_for_a_line_a_raw_append_left_unfinished(spark, local_cluster, tmp_path) -> None:
    """Read uncommitted (offsets straight to the write heads, no scan), the same: a line is one row."""
    got = split_across_appends(
        spark, local_cluster, "spark/st-split-raw", tmp_path, format="raw", readCommitted="false"
    )
    assert [json.loads(v)["id"] for _, v in got] == [1, 2, 3]


def test_a_raw_stream_waits_at_a_torn_head_of_an_ndjson_journal_with_a_charset(spark, local_cluster, tmp_path) -> None:
    """framing_for reads 'application/x-ndjson; charset=utf-8' as ndjson (parameters ignored), and so
    must the torn-head guard (and _read_raw and scan): comparing the label to NDJSON exactly turned
    the guard off, and a line split by a raw append that ended mid-line became two rows (or a raw
    read of such a journal died in a TypeError traceback)."""
    labels = {"content-type": "application/x-ndjson; charset=utf-8"}
    got = split_across_appends(
        spark, local_cluster, "spark/st-charset", tmp_path, labels, format="raw", readCommitted="false"
    )
    values = [v for _, v in got]
    assert [json.loads(v)["id"] for v in values] == [1, 2, 3], values


def test_a_raw_stream_waits_at_a_torn_head_of_a_protobuf_journal(spark, local_cluster, tmp_path) -> None:
    """The guard covers fixed protobuf frames as it does ndjson lines: a raw append that ended inside
    a frame (a frame written by two appends) ends a micro-batch mid-frame; unguarded, the first half
    is skipped as garbage, the second half (no magic at its start) too, and the payload is never
    delivered. Gazette's fixed-framing reader waits for the rest of the frame, as its ndjson one does."""
    import asyncio

    from tests.support.cluster import create_local_journal

    journal = "spark/st-torn-frames"
    labels = {"content-type": "application/x-protobuf-fixed"}
    asyncio.run(create_local_journal(local_cluster, journal, 1, labels=labels))
    payloads = [bytes([i]) * (10 + i) for i in range(1, 4)]
    frames = b"".join(b"\x66\x33\x93\x36" + len(p).to_bytes(4, "little") + p for p in payloads)
    cut = len(frames) - 5  # inside the last frame's payload
    cp = str(tmp_path / "cp")
    opts = {"format": "raw", "readCommitted": "false"}
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, frames[:cut])
    first = run_available_now(spark, local_cluster, journal, cp, raw=True, **opts)
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, frames[cut:])
    again = run_available_now(spark, local_cluster, journal, cp, raw=True, **opts)
    assert [v for _, v in first + again] == payloads


def test_a_stream_starting_offset_past_the_head_names_starting_offsets(spark, local_cluster, tmp_path) -> None:
    """A startingOffsets beyond the write head (a user's mistake) is reported naming the option, not
    as the journal having been 'reset or created again' (which advises failOnDataLoss=false)."""
    ndjson_journal(local_cluster, "spark/st-start", line(P1, 1, OUTSIDE_TXN, id=1))
    msg = error_message(
        lambda: run_available_now(
            spark, local_cluster, "spark/st-start", str(tmp_path / "cp"),
            startingOffsets=json.dumps({"spark/st-start": 10**9}),
        )
    )  # fmt: skip
    assert "startingOffsets" in msg and "reset or created again" not in msg, msg[:1500]


def test_a_stream_refuses_ending_offsets_instead_of_ignoring_them(spark, local_cluster, tmp_path) -> None:
    """`endingOffsets` on readStream is refused, as Kafka's source refuses it for streams, pointing
    at Trigger.AvailableNow, not silently ignored with the stream reading on past it (refused from
    the reader's first call: PySpark's stream runner buries an error raised in streamReader())."""
    ndjson_journal(local_cluster, "spark/st-end", line(P1, 1, OUTSIDE_TXN, id=1))
    msg = error_message(
        lambda: run_available_now(
            spark, local_cluster, "spark/st-end", str(tmp_path / "cp"),
            endingOffsets=json.dumps({"spark/st-end": 0}),
        )
    )  # fmt: skip
    assert "endingOffsets" in msg and "availableNow" in msg, msg[:1500]
    assert "UnboundLocalError" not in msg, msg[:1500]  # (PySpark's runner on an error in streamReader())


def test_a_stream_with_a_wrong_metadata_column_type_fails_with_our_line(spark, local_cluster, tmp_path) -> None:
    """check_schema's refusal reaches the user as our one line, not raised in streamReader() where
    PySpark's own UnboundLocalError and two tracebacks wrap it."""
    ndjson_journal(local_cluster, "spark/st-stream-meta", line(P1, 1, OUTSIDE_TXN, id=1))
    df = (
        spark.readStream.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", "spark/st-stream-meta")
        .schema("offset STRING, id BIGINT")
        .load()
    )
    msg = stream_error(df, tmp_path)
    assert "column 'offset'" in msg and "UnboundLocalError" not in msg, msg[:1500]


@pytest.mark.parametrize(
    ("option", "value"),
    [("maxBytesPerTrigger", "lots"), ("producerHorizon", "forever"), ("failOnDataLoss", "maybe")],
)
def test_a_bad_stream_option_with_an_explicit_schema_fails_with_our_one_line(
    spark, local_cluster, tmp_path, option, value
) -> None:
    """A bad stream option fails with our one line naming it when .schema() is given too: Spark then
    never calls DataSource.schema() (which parses the options under _one_line); the options are
    first parsed in streamReader(), and an OptionError raised there would reach the user inside
    PySpark 4.3's stream runner's UnboundLocalError with two tracebacks -- the very failure
    `_usable` defers check_schema's and endingOffsets' errors to avoid."""
    journal = f"spark/st-opt-{option}"  # (one per case: the module shares its cluster)
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
