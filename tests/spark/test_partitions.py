"""Batch partitions: a read split into many partitions yields exactly the rows one sequential
ReadCommitted over the same range does (DESIGN.md invariant 7), whatever the cuts separate.

No Spark session: the planner (TidingsBatchReader.partitions) and the task body (read_partition)
are called in-process, as Spark would call them on the driver and the executors.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from tests.spark._support import ndjson_journal
from tests.support.waiting import wait_until
from tidings.client import Client
from tidings.fragment.store import store_for
from tidings.message import ReadCommitted
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, build_uuid, clock_from_unix_ns, uuid_to_str
from tidings.protocol import protocol_pb2 as pb
from tidings.spark._read import read_partition
from tidings.spark.options import SourceOptions
from tidings.spark.source import TidingsBatchReader, fragment_cuts

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)

PA, PB, PC = (bytes([0x0A, 0, 0, 0, 0, n]) for n in (1, 2, 3))
PAD = "p" * 1100  # each append below fills a 1 KiB fragment of its own
DAY_NS = 86_400 * 10**9
T0 = 1_700_000_000 * 10**9


def clock(unix_ns: int) -> int:
    return clock_from_unix_ns(unix_ns)


def line(producer: bytes, at_ns: int, flags: int, **fields: object) -> bytes:
    import json

    return json.dumps({**fields, "uuid": uuid_to_str(build_uuid(producer, clock(at_ns), flags))}).encode() + b"\n"


SCHEMA = StructType(
    [
        StructField("journal", StringType(), False),
        StructField("offset", LongType(), False),
        StructField("uuid", StringType()),
        StructField("id", LongType()),
        StructField("_corrupt", StringType()),
    ]
)


def split_rows(endpoint: str, journal: str, **options: str) -> tuple[int, list[int]]:
    opts = SourceOptions.parse({"broker": endpoint, "journal": journal, **options})
    reader = TidingsBatchReader(opts, SCHEMA)
    parts = reader.partitions()
    ids = []
    for p in parts:
        for batch in read_partition(opts, SCHEMA.json(), p):
            ids.extend(r["id"] for r in batch.to_pylist() if r["_corrupt"] is None)
    return len(parts), sorted(ids)


def single_rows(endpoint: str, journal: str) -> list[int]:
    with Client(endpoint) as c:
        end = c.write_head(journal)
        return sorted(
            env.message.get("id") for env in ReadCommitted(c, journal, block=False, end_offsets={journal: end})
        )


def test_a_cut_prunes_a_producer_that_a_single_reader_keeps(local_cluster) -> None:
    """Producer A opens a transaction (and publishes id 3); producer B publishes a day and a half
    later (by its clock); then A's recovered instance writes its ACK, and a duplicate of id 3 is
    re-appended. A single reader delivers 1, 2, 3 once each; the split read must too."""
    journal = "spark/split-prune"
    ndjson_journal(local_cluster, journal, fragment={"length": "1KiB"})
    appends = [
        line(PA, T0, CONTINUE_TXN, id=1, pad=PAD) + line(PC, T0, OUTSIDE_TXN, id=3),
        line(PB, T0 + 3 * DAY_NS // 2, OUTSIDE_TXN, id=2, pad=PAD),
        line(PA, T0 + 1000, ACK_TXN, pad=PAD) + line(PC, T0, OUTSIDE_TXN, id=3),  # A commits id 1; id 3 again
    ]
    with Client(local_cluster.endpoints[0]) as c:
        for content in appends:
            c.append(journal, content)
    store = store_for(local_cluster.store_url)
    asyncio.run(wait_until(lambda: len(store.list(journal)) >= 2, 30))

    ep = local_cluster.endpoints[0]
    assert single_rows(ep, journal) == [1, 2, 3]
    whole_parts, whole = split_rows(ep, journal)
    assert (whole_parts, whole) == (1, [1, 2, 3])
    parts, split = split_rows(ep, journal, minPartitions="100")
    assert parts >= 3
    assert split == [1, 2, 3]  # (a cut that pruned A gave [2, 3, 3]: id 1 lost, id 3 twice)


def test_a_partition_count_beyond_the_fragments_is_capped_at_them() -> None:
    """bytesPerPartition=128 (meant as MiB) on a 1 GiB journal asks for 8M parts, minPartitions=10**12
    for more: a partition holds whole fragments, so 128 fragments give at most 127 cuts (at once)."""
    size, n = 1 << 30, 128
    listing = pb.FragmentsResponse(
        fragments=[
            pb.FragmentsResponse.Entry(spec=pb.Fragment(begin=i * size // n, end=(i + 1) * size // n)) for i in range(n)
        ]
    )
    for parts in (-(-size // 128), 10**12):
        assert fragment_cuts(listing, 0, size, parts) == [(i + 1) * size // n for i in range(n - 1)]
    assert fragment_cuts(listing, 0, size, 2) == [size // 2]


def _mixed_appends() -> list[bytes]:
    """Appends of ~1 KiB mixing: a 1500-message transaction of P1 over the whole journal (longer
    than the ring), P2 transactions committed and rolled back across appends, P3 outside messages
    re-appended later (duplicates), P4 pending duplicates re-sent after a cut, P5 restarting lower."""
    import random

    rnd = random.Random(7)
    P = [bytes([0x0B, 0, 0, 0, 0, n]) for n in range(6)]
    lines: list[bytes] = []
    nid = iter(range(1, 10**6))
    p1 = 0
    p2 = 0  # P2 clock
    p3_sent: list[bytes] = []
    p4 = 0
    p5 = 1000
    p2_last = 0
    U = 1000  # ns per clock step (clocks tick every 100 ns)
    for step in range(3000):
        r = rnd.random()
        if r < 0.5 and p1 < 1500:
            p1 += 1
            lines.append(line(P[1], T0 + p1 * U, CONTINUE_TXN, id=next(nid)))
        elif r < 0.7:
            p2 += 1
            lines.append(line(P[2], T0 + p2 * U, CONTINUE_TXN, id=next(nid)))
            if rnd.random() < 0.1:
                if rnd.random() < 0.3 and p2_last:  # roll back the open ones: ACK at the last committed clock
                    lines.append(line(P[2], T0 + p2_last * U, ACK_TXN))
                else:
                    lines.append(line(P[2], T0 + p2 * U, ACK_TXN))
                    p2_last = p2
        elif r < 0.8:
            x = line(P[3], T0 + step * U, OUTSIDE_TXN, id=next(nid))
            lines.append(x)
            p3_sent.append(x)
        elif r < 0.85 and p3_sent:
            lines.append(rnd.choice(p3_sent))  # a duplicate, maybe many fragments later
        elif r < 0.92:
            p4 += 1
            x = line(P[4], T0 + p4 * U, CONTINUE_TXN, id=next(nid))
            lines.append(x)
            if rnd.random() < 0.2:
                lines.append(x)
            if rnd.random() < 0.05:
                lines.append(line(P[4], T0 + p4 * U, ACK_TXN))
        else:
            p5 += rnd.choice([5, -3])
            lines.append(line(P[5], T0 + p5 * U, OUTSIDE_TXN, id=next(nid)))
    lines.append(line(P[1], T0 + p1 * U, ACK_TXN))
    return appends_of(lines, 1024)


def appends_of(lines: list[bytes], size: int) -> list[bytes]:
    """Lines grouped into appends of just over `size` bytes each (the last may be smaller)."""
    appends, cur = [], b""
    for x in lines:
        cur += x
        if len(cur) > size:
            appends.append(cur)
            cur = b""
    return [*appends, cur] if cur else appends


def test_a_mixed_journal_split_equals_a_single_reader(local_cluster) -> None:
    journal = "spark/split-mixed"
    ndjson_journal(local_cluster, journal, fragment={"length": "1KiB"})
    appends = _mixed_appends()
    with Client(local_cluster.endpoints[0]) as c:
        for content in appends:
            c.append(journal, content)
    ep = local_cluster.endpoints[0]
    single = single_rows(ep, journal)
    assert len(single) > 1500
    parts, split = split_rows(ep, journal, minPartitions="40")  # (some fragments not yet persisted)
    assert parts >= 10
    assert split == single
    store = store_for(local_cluster.store_url)
    asyncio.run(wait_until(lambda: len(store.list(journal)) >= len(appends) - 2, 60))
    parts, split = split_rows(ep, journal, minPartitions="40")
    assert parts >= 10
    assert split == single


def test_uuid_and_producer_columns_for_mixed_uuid_forms() -> None:
    import msgspec

    from tidings.message.sequencer import Envelope
    from tidings.spark.schema import line_uuids, row_builder

    schema = StructType(
        [
            StructField("journal", StringType(), False),
            StructField("offset", LongType(), False),
            StructField("uuid", StringType()),
            StructField("producer", StringType()),
            StructField("clock", LongType()),
            StructField("id", LongType()),
            StructField("_corrupt", StringType()),
        ]
    )
    u = build_uuid(PA, clock(T0), OUTSIDE_TXN)
    s = uuid_to_str(u)
    forms = [s, s.upper(), s.replace("-", ""), "{" + s + "}", "urn:uuid:" + s, "", None]
    lines = [msgspec.Raw(msgspec.json.encode({"id": i, "uuid": f})) for i, f in enumerate(forms)]
    for chosen in ([0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], list(range(7))):
        ls = [lines[i] for i in chosen]
        envs = [Envelope("j", i, i + 1, uu, ln) for i, (uu, ln) in enumerate(zip(line_uuids(ls), ls, strict=True))]
        rows = pa_rows(row_builder(schema.json()).batches(envs))
        for i, r in zip(chosen, rows, strict=True):
            has = forms[i] not in ("", None)
            assert r["uuid"] == (s if has else None), (chosen, r)
            assert r["producer"] == (PA.hex() if has else None), (chosen, r)
            assert r["clock"] == (clock(T0) if has else None)


def pa_rows(batches) -> list[dict]:
    return [r for b in batches for r in b.to_pylist()]


ODD_PRODUCERS = [bytes([0x0C, 0, 0, 0, 0, n]) for n in range(4)]


def _line(text: str | None, ident: int, odd: bool = False) -> bytes:
    fields: dict = {"id": ident, "pad": "q" * 40}
    if odd:
        fields["uuid"] = text  # (as given: None, "", numbers...)
    elif text is not None:
        fields["uuid"] = text
    return json.dumps(fields).encode() + b"\n"


def _journal_lines(seed: int, odd: float) -> list[bytes]:
    """Lines of four producers' transactions (committed and rolled back) and outside messages, with
    duplicates; `odd` scales how often a UUID is in braces, urn form or upper case (4% at 1.0) and
    how often a line is odd (3% at 1.0: null, "", a number, an invalid text, a v4 UUID, a blank or
    garbage line)."""
    rnd = random.Random(seed)
    clocks = [0, 0, 0, 0]
    acked = [0, 0, 0, 0]
    nid = iter(range(1, 10**6))
    sent: list[bytes] = []
    out: list[bytes] = []

    def text(p: int, clock: int, flags: int) -> str:
        s = uuid_to_str(build_uuid(ODD_PRODUCERS[p], clock_from_unix_ns(T0) + clock, flags))
        r = rnd.random() / odd if odd else 1.0
        if r < 0.01:
            return "{" + s + "}"
        if r < 0.02:
            return "urn:uuid:" + s
        if r < 0.04:
            return s.upper()
        return s

    for _ in range(4000):
        p = rnd.choice([0, 0, 1, 1, 2, 3])
        r = rnd.random()
        if r < 0.45:
            clocks[p] += 1
            x = _line(text(p, clocks[p], CONTINUE_TXN), next(nid))
        elif r < 0.55:
            if rnd.random() < 0.25 and acked[p]:
                x = _line(text(p, acked[p], ACK_TXN), next(nid))  # roll back the open ones
            else:
                x = _line(text(p, clocks[p] or 1, ACK_TXN), next(nid))
                acked[p] = clocks[p]
        elif r < 0.75:
            clocks[p] += 1
            x = _line(text(p, clocks[p], OUTSIDE_TXN), next(nid))
        elif r < 0.85 and sent:
            x = rnd.choice(sent)  # a duplicate, maybe many fragments later
        elif r < 0.85 + 0.03 * odd:
            x = rnd.choice(
                [
                    _line(None, next(nid), odd=True),
                    _line("", next(nid), odd=True),
                    _line(None, next(nid)),
                    _line(uuid_to_str(build_uuid(ODD_PRODUCERS[p], 0, OUTSIDE_TXN)), next(nid)),  # clock 0
                    b'{"id": %d, "uuid": 5}\n' % next(nid),
                    b'{"id": %d, "uuid": "not-a-uuid"}\n' % next(nid),
                    b'{"id": %d, "uuid": "12345678-1234-4234-8234-123456789abc"}\n' % next(nid),  # v4
                    b"\n",
                    b"   \n",
                    b"not json at all\n",
                    b"[1, 2]\n",
                ]
            )
        else:
            continue
        out.append(x)
        sent.append(x)
    for p in range(4):
        out.append(_line(text(p, clocks[p] or 1, ACK_TXN), next(nid)))
    return out


@pytest.mark.parametrize(("seed", "odd"), [(1, 1.0), (2, 0.02), (3, 0.0)])
def test_a_split_read_of_odd_uuids_in_big_chunks_equals_one_reader(local_cluster, seed, odd) -> None:
    """The driver's scan folds canonical UUID texts per producer (`Sequencer.advance`) while the tasks
    decode each message: on content they might decode differently (UUIDs in braces, urn form, upper
    case, null, "", numbers, invalid texts, v4 UUIDs, blank and garbage lines, transactions and
    duplicates spanning the cuts, in chunks big enough to take the fold: few producers per chunk),
    a read in many partitions still equals one sequential reader."""
    journal = f"spark/split-odd-{seed}"
    ndjson_journal(local_cluster, journal, fragment={"length": "16KiB"})
    appends = appends_of(_journal_lines(seed, odd), 6000)
    with Client(local_cluster.endpoints[0]) as c:
        for content in appends:
            c.append(journal, content)
    ep = local_cluster.endpoints[0]
    single = single_rows(ep, journal)
    assert len(single) > 500
    parts, split = split_rows(ep, journal, minPartitions="30")
    assert parts >= 5
    assert split == single
    store = store_for(local_cluster.store_url)
    asyncio.run(wait_until(lambda: len(store.list(journal)) >= 3, 60))
    parts, split = split_rows(ep, journal, minPartitions="30")
    assert split == single
