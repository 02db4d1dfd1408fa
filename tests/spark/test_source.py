"""The tidings Spark source read in batches: a read committed yields each committed message once, in
journal order, and never a rolled-back or unacknowledged one (DESIGN.md invariants 3 and 7), as the
CLI's `tidings journals read --committed` does over hand-made lines (duplicates, committed, rolled-back
and open transactions) and a Publisher's many; bad options and schemas fail the query in one line."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from tests.spark._support import CASES, NDJSON, P1, P2, P3, P4, cli_committed, error_message, line, ndjson_journal
from tests.support.cluster import create_local_journal
from tidings.client import AppendService, AsyncClient, Client
from tidings.message import Publisher
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, build_uuid, uuid_to_str

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)


async def fill(endpoint: str, journal: str, published: int) -> None:
    async with AsyncClient(endpoint) as c:
        await c.append(journal, CASES)
        service = AppendService(c)
        pub = Publisher(service)
        msgs = [{"id": 100 + i, "name": f"m{i}"} for i in range(published)]
        for at in range(0, len(msgs), 1000):
            await (await pub.publish_committed(journal, *msgs[at : at + 1000]))
        await service.aclose()


def read_df(spark, lc, journal: str, schema: str = "id BIGINT, name STRING", **options: str):
    reader = spark.read.format("tidings").option("broker", lc.endpoints[0]).option("journal", journal)
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.schema(schema).load() if schema else reader.load()


def test_batch_read_committed_equals_the_cli(spark, local_cluster) -> None:
    journal = "spark/committed"
    asyncio.run(create_local_journal(local_cluster, journal, 3, **NDJSON))
    asyncio.run(fill(local_cluster.endpoints[0], journal, 20_000))

    df = read_df(spark, local_cluster, journal, "journal STRING, offset BIGINT, uuid STRING, id BIGINT, name STRING")
    rows = df.orderBy("offset").collect()
    expected = cli_committed(local_cluster.endpoints[1], journal)
    assert [(r.id, r.name, r.uuid) for r in rows] == [(m["id"], m["name"], m["uuid"]) for m in expected]
    assert [r.id for r in rows[:5]] == [1, 7, 2, 3, 6]  # once, committed only, in journal order per producer
    assert len(rows) == 5 + 20_000 and {r.journal for r in rows} == {journal}

    # Read uncommitted: every message as written (the duplicate, the rolled-back and the open one too).
    uncommitted = read_df(spark, local_cluster, journal, "offset BIGINT, id BIGINT", readCommitted="false")
    raw_ids = [r.id for r in uncommitted.orderBy("offset").limit(10).collect()]
    assert raw_ids == [1, 1, 7, 2, 4, 3, None, None, 5, 6]  # (the two ACKs have no id)


def test_metadata_columns_by_option_schema_and_offsets(spark, local_cluster) -> None:
    journal = "spark/offsets"
    asyncio.run(create_local_journal(local_cluster, journal, 1, **NDJSON))
    asyncio.run(fill(local_cluster.endpoints[0], journal, 10))
    df = (
        spark.read.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", journal)
        .option("schema", "id BIGINT")
        .load()
    )
    assert df.columns == ["journal", "offset", "uuid", "producer", "clock", "id", "_corrupt"]
    rows = df.orderBy("offset").collect()
    assert rows[0].producer == P1.hex() and rows[0].clock > 0 and rows[0]._corrupt is None

    # A range [start, end) in byte offsets, as the offset column gives them.
    start, end = rows[2].offset, rows[5].offset
    part = read_df(
        spark,
        local_cluster,
        journal,
        "offset BIGINT, id BIGINT",
        startingOffsets=json.dumps({journal: start}),
        endingOffsets=json.dumps({journal: end}),
    ).collect()
    # From id 2's line to the first published one: P2's transaction and id 6 commit, id 4 rolls back.
    assert sorted(r.id for r in part) == [2, 3, 6]


def test_undecodable_messages_become_corrupt_rows(spark, local_cluster) -> None:
    journal = "spark/corrupt"
    asyncio.run(create_local_journal(local_cluster, journal, 1, **NDJSON))
    bad_type = line(P1, 2, OUTSIDE_TXN, id="not a number", name="x")
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, line(P1, 1, OUTSIDE_TXN, id=1, name="one") + bad_type + b"{not json\n")
        c.append(journal, line(P1, 3, OUTSIDE_TXN, id=3, name="three"))
    rows = read_df(spark, local_cluster, journal, "offset BIGINT, id BIGINT, name STRING, _corrupt STRING")
    got = [(r.id, r.name, r._corrupt) for r in rows.orderBy("offset").collect()]
    assert got == [
        (1, "one", None),
        (None, None, bad_type.decode().rstrip("\n")),
        (None, None, "{not json"),
        (3, "three", None),
    ]


def test_raw_rows_are_the_messages_as_written(spark, local_cluster) -> None:
    journal = "spark/raw"
    ndjson_journal(local_cluster, journal, CASES)
    df = read_df(spark, local_cluster, journal, schema="", format="raw", readCommitted="false")
    assert df.columns == ["journal", "offset", "value"]
    rows = df.orderBy("offset").collect()
    assert b"\n".join(bytes(r.value) for r in rows) + b"\n" == CASES
    assert rows[1].offset == len(CASES.split(b"\n")[0]) + 1


def test_a_selector_reads_every_matching_journal(spark, local_cluster) -> None:
    for name in ("spark/sel-a", "spark/sel-b", "spark/other"):
        labels = {**NDJSON["labels"], "topic": "sel" if "sel" in name else "other"}
        ndjson_journal(local_cluster, name, line(P1, 1, OUTSIDE_TXN, id=1, name=name), labels=labels)
    df = (
        spark.read.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("selector", "topic=sel")
        .option("schema", "name STRING")
        .load()
    )
    assert sorted((r.journal, r.name) for r in df.collect()) == [("spark/sel-a",) * 2, ("spark/sel-b",) * 2]
    assert df.rdd.getNumPartitions() == 2  # a partition per journal


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"journal": "spark/nope"}, "journal 'spark/nope' does not exist"),
        ({"journal": "spark/bad-input", "broker": "127.0.0.1:9"}, "broker 127.0.0.1:9 is unreachable"),
        ({"journal": "spark/bad-input", "startingOffsets": "first"}, "option 'startingOffsets' is 'first'"),
        ({"journal": "spark/bad-input", "format": "avro"}, "option 'format' is 'avro'"),
        ({"journal": "spark/bad-input", "minPartitions": "0"}, "option 'minPartitions' is '0'"),
        ({"journal": "spark/bad-input", "producerHorizon": "soon"}, "option 'producerHorizon' is 'soon'"),
        (
            {"journal": "spark/bad-input", "format": "raw", "readCommitted": "false"},
            "format raw gives the columns journal, offset, value",
        ),
        ({"selector": "=clicks"}, "option 'selector' is not a label selector"),
        ({}, "option 'journal' is missing"),
    ],
)
def test_bad_input_fails_the_query_with_one_line_naming_it(spark, local_cluster, options, says) -> None:
    journal = f"spark/bad-input-{uuid.uuid4().hex[:8]}"  # (one per case: the module shares its cluster)
    asyncio.run(create_local_journal(local_cluster, journal, 1, **NDJSON))
    reader = spark.read.format("tidings").option("broker", local_cluster.endpoints[0])
    for k, v in options.items():
        reader = reader.option(k, journal if v == "spark/bad-input" else v)
    with pytest.raises(Exception) as err:
        reader.schema("id BIGINT").load().collect()
    assert says in str(err.value)


def test_raw_takes_a_schema_of_its_own_columns(spark, local_cluster) -> None:
    """format raw with `.schema()` naming exactly its columns (nullable, as a DDL string gives
    them) reads as without one; a stream says the same as a batch read when they differ."""
    journal = "spark/raw-schema"
    ndjson_journal(local_cluster, journal, line(P1, 1, OUTSIDE_TXN, id=1))
    reader = spark.read.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", journal)
    df = (
        reader.option("format", "raw")
        .option("readCommitted", "false")
        .schema("journal STRING, offset BIGINT, value BINARY")
        .load()
    )
    assert [(r.journal, r.offset) for r in df.collect()] == [(journal, 0)]
    stream = spark.readStream.format("tidings").option("broker", local_cluster.endpoints[0])
    with pytest.raises(Exception) as err:
        stream.option("journal", journal).option("format", "raw").option("readCommitted", "false").schema(
            "value STRING"
        ).load().writeStream.format("memory").queryName("raw_schema").start().processAllAvailable()
    assert "format raw gives the columns journal, offset, value" in str(err.value)


def test_json_without_a_schema_says_how_to_give_one(spark, local_cluster) -> None:
    with pytest.raises(Exception) as err:
        spark.read.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", "x").load()
    assert "format json needs the messages' fields" in str(err.value)


def test_a_metadata_column_of_the_wrong_type_is_refused_in_one_line(spark, local_cluster) -> None:
    """`.schema("offset STRING, ...")` is refused by check_schema in one line naming the column, not
    let through for every task to die with pyarrow's 'ArrowTypeError: Expected bytes, got a 'int'
    object' (building the corrupt batch)."""
    ndjson_journal(local_cluster, "spark/src-meta", line(P1, 1, OUTSIDE_TXN, id=1))
    df = (
        spark.read.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", "spark/src-meta")
        .schema("offset STRING, id BIGINT")
    )
    msg = error_message(lambda: df.load().collect())
    assert "ArrowTypeError" not in msg and "column 'offset'" in msg, msg[:1500]


def test_offsets_naming_a_journal_the_query_does_not_read_are_refused(spark, local_cluster) -> None:
    """As Kafka's connector refuses specific offsets for partitions it was not asked to read, a typo
    in startingOffsets is refused naming it, not ignored with the whole journal read from earliest."""
    ndjson_journal(local_cluster, "spark/src-typo", line(P1, 1, OUTSIDE_TXN, id=1))
    r = (
        spark.read.format("tidings")
        .option("broker", local_cluster.endpoints[0])
        .option("journal", "spark/src-typo")
        .option("startingOffsets", json.dumps({"spark/src-tpyo": 5}))
        .schema("id BIGINT")
    )
    msg = error_message(lambda: r.load().collect())
    assert "spark/src-tpyo" in msg


def test_a_typo_in_option_schema_is_reported_at_the_typo(spark, local_cluster) -> None:
    """A typo in option('schema') is reported at the typo, not (the metadata columns' DDL glued before
    the user's and parsed as a table schema) as "Syntax error at or near 'STRING'" at our first column."""
    ndjson_journal(local_cluster, "spark/src-ddl", line(P1, 1, OUTSIDE_TXN, id=1))

    def load(ddl: str) -> None:
        r = spark.read.format("tidings").option("broker", local_cluster.endpoints[0])
        r.option("journal", "spark/src-ddl").option("schema", ddl).load().collect()

    for ddl, says in (("id BIGNT", '"BIGNT"'), ("id BIGINT name STRING", "near 'name'")):
        msg = error_message(lambda ddl=ddl: load(ddl))
        assert says in msg and "near 'STRING'" not in msg, msg[:1500]


def test_option_schema_takes_spark_struct_ddl_as_schema_does(spark, local_cluster) -> None:
    """option('schema') takes Spark's own DDL of a struct type (what `df.schema.simpleString()`
    prints, and what `.schema()` and `StructType.fromDDL` accept): it goes inside struct<...>, so
    it is not refused with a parse error pointing into the source's metadata columns."""
    journal = "spark/src-struct-ddl"
    ndjson_journal(local_cluster, journal, line(P1, 1, OUTSIDE_TXN, id=1, name="one"))
    ddl = "struct<id:bigint,name:string>"
    assert spark.createDataFrame([], ddl).schema.simpleString() == ddl  # (what Spark prints and takes)
    r = spark.read.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", journal)
    rows = r.option("schema", ddl).load().select("id", "name").collect()
    assert [(row.id, row.name) for row in rows] == [(1, "one")]


def test_a_value_arrow_refuses_makes_a_corrupt_row_not_a_failed_task(spark, local_cluster) -> None:
    journal = "spark/decimal"
    ndjson_journal(
        local_cluster,
        journal,
        b"".join(line(P1, n, OUTSIDE_TXN, id=n, price=p) for n, p in ((1, 2.5), (2, 1.005), (3, 7))),
    )
    df = read_df(spark, local_cluster, journal, "offset BIGINT, id BIGINT, price DECIMAL(10,2), _corrupt STRING")
    rows = df.orderBy("offset").collect()
    assert [(r.id, None if r.price is None else float(r.price)) for r in rows] == [(1, 2.5), (None, None), (3, 7.0)]
    assert rows[1]._corrupt.startswith('{"id": 2, "price": 1.005,') and rows[0]._corrupt is None  # the line as written


def test_a_line_that_does_not_fit_the_schema_is_corrupt_only_if_committed(spark, local_cluster) -> None:
    """Read committed: a rolled-back or never-acknowledged message is not a row, corrupt or not."""
    journal = "spark/corrupt-committed"
    asyncio.run(create_local_journal(local_cluster, journal, 1, **NDJSON))
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, b"".join([
            line(P2, 1, OUTSIDE_TXN, id=1),
            line(P2, 5, CONTINUE_TXN, id="rolled back, and of the wrong type"),
            line(P2, 3, ACK_TXN),  # rolls back clock 5
            line(P4, 1, CONTINUE_TXN, id="never acknowledged"),
            line(P2, 6, OUTSIDE_TXN, id="committed, of the wrong type"),
        ]))  # fmt: skip
    df = read_df(spark, local_cluster, journal, "offset BIGINT, id BIGINT, _corrupt STRING")
    rows = df.orderBy("offset").collect()
    assert [r.id for r in rows] == [1, None]
    assert '"committed, of the wrong type"' in rows[1]._corrupt


PAD = "p" * 1100  # a line this long fills a 1 KiB fragment: each append below is a fragment of its own
FRAGMENTED = [
    line(P1, 1, OUTSIDE_TXN, id=1, name="one", pad=PAD)
    + line(P3, 2, OUTSIDE_TXN, id=8, name="eight")
    + line(P2, 1, CONTINUE_TXN, id=2, name="two"),
    line(P1, 1, OUTSIDE_TXN, id=1, name="one", pad=PAD)  # a duplicate of a message two partitions back
    + line(P2, 2, CONTINUE_TXN, id=3, name="three")
    + line(P3, 5, CONTINUE_TXN, id=4, name="rolled back"),
    line(P2, 2, ACK_TXN, pad=PAD)  # commits ids 2 and 3, whose messages are in earlier partitions
    + line(P3, 3, ACK_TXN)  # rolls id 4 back
    + line(P4, 1, CONTINUE_TXN, id=5, name="open"),
    line(P1, 2, OUTSIDE_TXN, id=6, name="six", pad=PAD) + line(P2, 2, ACK_TXN),  # a duplicate ACK: nothing
    b'{"id": 7, "name": "seven", "pad": "' + PAD.encode(),  # a raw append that ends mid-line...
    b'", "uuid": "' + uuid_to_str(build_uuid(P1, 3, OUTSIDE_TXN)).encode() + b'"}\n' + PAD.encode() + b"\n",
    line(P4, 1, ACK_TXN, pad=PAD),  # ...so the next fragment starts inside it; then garbage; P4 commits id 5
]


def test_a_journal_of_many_fragments_is_read_in_several_partitions_each_message_once(spark, local_cluster) -> None:
    """Partitions of whole fragments, read from the store: a transaction spanning partitions is
    delivered once, a duplicate in a later partition is not delivered again, and the rows equal a
    single reader's (the CLI's), committed and uncommitted."""
    from tests.support.waiting import wait_until
    from tidings.fragment.store import store_for

    journal = "spark/fragments"
    ndjson_journal(local_cluster, journal, fragment={"length": "1KiB"})
    with Client(local_cluster.endpoints[0]) as c:
        for content in FRAGMENTED:
            c.append(journal, content)
    store = store_for(local_cluster.store_url)
    asyncio.run(wait_until(lambda: len(store.list(journal)) >= len(FRAGMENTED) - 1, 30))

    schema = "offset BIGINT, id BIGINT, name STRING, _corrupt STRING"
    split = read_df(spark, local_cluster, journal, schema, minPartitions="100")
    assert split.rdd.getNumPartitions() >= 5
    rows = split.collect()
    expected = [(m.get("id"), m.get("name")) for m in cli_committed(local_cluster.endpoints[0], journal)]
    assert sorted((r.id, r.name) for r in rows if r._corrupt is None) == sorted(expected)
    assert sorted(r[0] for r in expected) == [1, 2, 3, 5, 6, 7, 8]
    assert [r._corrupt for r in rows if r._corrupt is not None] == [PAD]  # the garbage line, once
    whole = read_df(spark, local_cluster, journal, schema)
    assert whole.rdd.getNumPartitions() == 1
    assert sorted(whole.collect()) == sorted(split.collect())

    # Uncommitted: every message as written, the line cut by an append whole, the garbage once.
    split_raw = read_df(spark, local_cluster, journal, schema, minPartitions="100", readCommitted="false")
    whole_raw = read_df(spark, local_cluster, journal, schema, readCommitted="false")
    assert split_raw.rdd.getNumPartitions() >= 5
    assert sorted(split_raw.collect()) == sorted(whole_raw.collect())
    assert [r.id for r in whole_raw.orderBy("offset").collect()] == [
        1,
        8,
        2,
        1,
        3,
        4,
        None,
        None,
        5,
        6,
        None,
        7,
        None,
        None,
    ]


def test_line_uuids_reads_every_form_a_reader_accepts() -> None:
    """The fast path (msgspec's own UUIDs) and the forms it refuses give the UUIDs every reader gives."""
    from uuid import UUID

    from tidings.spark.schema import line_uuids

    u = UUID("abcdef01-1234-1234-8234-123456789abc")
    forms = [f'"{u}"', f'"{str(u).upper()}"', f'"{u.hex}"', f'"{{{u}}}"', f'"urn:uuid:{u}"']
    lines = [f'{{"id": 1, "uuid": {form}}}'.encode() for form in forms]
    assert line_uuids(lines[:3]) == [u, u, u]
    assert line_uuids(lines) == [u] * len(forms)
    assert line_uuids([b'{"uuid": ""}', b'{"id": 2}', b'{"uuid": null}', lines[0]]) == [None, None, None, u]
    with pytest.raises(ValueError):
        line_uuids([lines[0], b'{"uuid": "not a uuid"}'])
    with pytest.raises(ValueError):
        line_uuids([b'{"uuid": 7}'])


@pytest.mark.parametrize(("schema", "column"), [("id BIGINT NOT NULL", "id"), ("s STRUCT<a: INT NOT NULL>", "s.a")])
def test_a_not_null_message_column_is_refused_naming_it(spark, local_cluster, schema, column) -> None:
    """A message may lack a field or not decode, so its columns must take null (Spark trusts the declared schema)."""
    journal = f"spark/not-null-{column}"  # (one per case: the module shares its cluster)
    ndjson_journal(local_cluster, journal, line(P1, 1, OUTSIDE_TXN, id=1))
    with pytest.raises(Exception) as err:
        read_df(spark, local_cluster, journal, f"journal STRING NOT NULL, {schema}").collect()
    assert f"column {column!r} is declared NOT NULL" in str(err.value)


def test_bytes_removed_by_retention_fail_the_read_or_are_skipped(spark, local_cluster) -> None:
    """failOnDataLoss: bytes gone from the middle of a range fail the query (naming them), or are
    skipped with false; bytes gone from the journal's start are not a loss (earliest is its first
    byte). Brokers move past a hole only once the fragment after it is hours old (a younger hole may
    still fill): the one here is, as retention's are."""
    import os
    import time
    from pathlib import Path

    from tests.support.waiting import wait_until
    from tidings.fragment.store import store_for

    journal = "spark/retention"
    ndjson_journal(local_cluster, journal, fragment={"length": "1KiB", "refresh_interval": "1s"})
    with Client(local_cluster.endpoints[0]) as c:
        for i in range(1, 5):  # a fragment each
            c.append(journal, line(P1, i, OUTSIDE_TXN, id=i, pad=PAD))
        store = store_for(local_cluster.store_url)
        asyncio.run(wait_until(lambda: len(store.list(journal)) == 4, 30))
        frags = sorted(store.list(journal), key=lambda f: f.begin)
        store.remove(frags[0])  # retention, as it goes: the oldest
        store.remove(frags[2])  # and a gap in the middle, before a fragment persisted a day ago
        day_ago = time.time() - 86400
        os.utime(Path(store.url(frags[3]).removeprefix("file://")), (day_ago, day_ago))

        def forgotten() -> bool:  # (brokers drop their local copies once the store lists them, then relist)
            held = {(f.spec.begin, f.spec.end): f.spec.mod_time for f in c.fragments(journal).fragments}
            gone = {(frags[0].begin, frags[0].end), (frags[2].begin, frags[2].end)}
            return not gone & held.keys() and 0 < held.get((frags[3].begin, frags[3].end), 0) < day_ago + 60

        asyncio.run(wait_until(forgotten, 30))
    with pytest.raises(Exception) as err:
        read_df(spark, local_cluster, journal, "id BIGINT").collect()
    assert f"journal {journal!r} no longer holds bytes [{frags[2].begin}, {frags[2].end})" in str(err.value)
    rows = read_df(spark, local_cluster, journal, "id BIGINT", failOnDataLoss="false").collect()
    assert sorted(r.id for r in rows) == [2, 4]
    raw = read_df(spark, local_cluster, journal, "", format="raw", readCommitted="false", failOnDataLoss="false")
    assert sorted(json.loads(r.value)["id"] for r in raw.collect()) == [2, 4]
    with pytest.raises(Exception) as err:
        read_df(spark, local_cluster, journal, "", format="raw", readCommitted="false").collect()
    assert f"no longer holds bytes [{frags[2].begin}, {frags[2].end})" in str(err.value)


def test_an_ending_offset_past_the_write_head_reads_to_it(spark, local_cluster) -> None:
    """Tasks wait for every byte of their range, so planning caps an explicit end at the
    write head (rather than a task waiting for bytes nobody wrote, or calling them lost)."""
    journal = "spark/past-head"
    ndjson_journal(local_cluster, journal, CASES)
    rows = read_df(spark, local_cluster, journal, "id BIGINT", endingOffsets=json.dumps({journal: 10**12}))
    assert sorted(r.id for r in rows.collect()) == [1, 2, 3, 6, 7]


def test_a_task_whose_journal_was_reset_below_its_range_fails_or_skips_instead_of_waiting(
    spark, local_cluster, caplog
) -> None:
    """A journal deleted and created again (or gone) between planning and a task: the task's range
    ends past the new write head. A read waits at the head for bytes that would be another
    journal's, for ever; instead the task fails naming it (failOnDataLoss) or skips the range."""
    import logging
    import threading

    from pyspark.sql.types import StructType

    from tidings.spark._read import JournalRange, read_partition
    from tidings.spark.options import SourceOptions
    from tidings.spark.schema import METADATA_DDL

    journal = "spark/reset-under-task"
    ndjson_journal(local_cluster, journal, line(P1, 1, OUTSIDE_TXN, id=1))
    with Client(local_cluster.endpoints[0]) as c:
        planned = JournalRange(journal, NDJSON["labels"]["content-type"], 0, c.write_head(journal) + 500)
        gone = JournalRange("spark/never-was", NDJSON["labels"]["content-type"], 0, 100)
    schema_json = StructType.fromDDL(f"{METADATA_DDL}, id BIGINT, _corrupt STRING").json()

    def read(part: JournalRange, **options: str) -> list | BaseException:
        opts = SourceOptions.parse({"broker": local_cluster.endpoints[0], "journal": part.journal, **options})
        result: list = []

        def run() -> None:
            try:
                result.extend(b.num_rows for b in read_partition(opts, schema_json, part))
            except BaseException as exc:  # (handed to the test)
                result.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the task waited for bytes the journal no longer has"
        return result[-1] if result and isinstance(result[-1], BaseException) else result

    err = read(planned)
    assert isinstance(err, Exception) and f"journal {journal!r} ends at" in str(err), err
    assert "failOnDataLoss=false" in str(err)
    err = read(gone)
    assert isinstance(err, Exception) and "journal 'spark/never-was' no longer exists" in str(err), err
    with caplog.at_level(logging.WARNING):
        assert sum(read(planned, failOnDataLoss="false")) == 0
        assert read(gone, failOnDataLoss="false") == []
    assert f"journal {journal} ends at" in caplog.text


def test_a_delivered_message_without_a_v1_uuid_keeps_its_fields_and_has_no_clock() -> None:
    """A message whose UUID is not v1 is delivered at-least-once; it has no clock (null),
    and its row keeps its fields (the clock of a v4 UUID's bits overflowed int64: a corrupt row)."""
    import uuid

    import msgspec
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from tidings.message import Envelope
    from tidings.message.uuid import build_uuid, get_clock
    from tidings.spark.schema import RowBuilder

    schema = StructType([StructField(n, t) for n, t in (("clock", LongType()), ("id", LongType()),
                                                         ("_corrupt", StringType()))])  # fmt: skip
    v1 = build_uuid(P1, 12345, OUTSIDE_TXN)
    cases = [uuid.UUID("f47ac10b-58cc-4a72-a567-0e02b2c3d479"), uuid.UUID(int=0), v1, uuid.uuid4()]
    envs = []
    for i, u in enumerate(cases):
        text = json.dumps({"id": i, "uuid": str(u)}).encode()
        envs.append(Envelope("j", i * 100, i * 100 + len(text) + 1, u, msgspec.Raw(text)))
    rows = [r for b in RowBuilder(schema).batches(envs) for r in b.to_pylist()]
    assert rows == [
        {"clock": None, "id": 0, "_corrupt": None},
        {"clock": None, "id": 1, "_corrupt": None},
        {"clock": get_clock(v1), "id": 2, "_corrupt": None},
        {"clock": None, "id": 3, "_corrupt": None},
    ]
