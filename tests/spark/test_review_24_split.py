"""Review 24: a batch read committed in many partitions (the driver's scan now folds canonical
UUID texts per producer: `Sequencer.advance`) against one sequential reader of the same journal,
on content the scan and the tasks might decode differently: UUIDs in braces, urn form, upper case,
null, "", numbers, invalid texts, v4 UUIDs, blank and garbage lines, transactions and duplicates
spanning the cuts, in chunks big enough to take the fold (few producers per chunk)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tests.spark.test_partitions import T0, appends_of, single_rows, split_rows
from tests.spark.test_source import ndjson_journal
from tests.support.waiting import wait_until
from tidings.client import Client
from tidings.fragment.store import store_for
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, build_uuid, clock_from_unix_ns, uuid_to_str

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)

P = [bytes([0x0C, 0, 0, 0, 0, n]) for n in range(4)]


def _line(text: str | None, ident: int, odd: bool = False) -> bytes:
    fields: dict = {"id": ident, "pad": "q" * 40}
    if odd:
        fields["uuid"] = text  # (as given: None, "", numbers...)
    elif text is not None:
        fields["uuid"] = text
    return json.dumps(fields).encode() + b"\n"


def _journal_lines(seed: int, odd: float) -> list[bytes]:
    rnd = random.Random(seed)
    clocks = [0, 0, 0, 0]
    acked = [0, 0, 0, 0]
    nid = iter(range(1, 10**6))
    sent: list[bytes] = []
    out: list[bytes] = []

    def text(p: int, clock: int, flags: int) -> str:
        s = uuid_to_str(build_uuid(P[p], clock_from_unix_ns(T0) + clock, flags))
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
                    _line(uuid_to_str(build_uuid(P[p], 0, OUTSIDE_TXN)), next(nid)),  # clock 0
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
    journal = f"review24/odd-{seed}"
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
