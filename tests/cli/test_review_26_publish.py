"""Review 26: `tidings publish` to a label selector, when one batch goes to several journals and one
journal refuses its append: the report ("published N messages (stdin lines 1 to L)", resend from
L+1) must match what the journals hold, or resending duplicates lines."""

from __future__ import annotations

import json

from tests.cli.test_cli import run
from tidings.message import read_committed

NDJSON = {"content-type": "application/x-ndjson"}


async def _messages(cluster, journal: str) -> list[dict]:
    async with cluster.client(0) as c:
        return [env.message async for env in read_committed(c, journal, block=False)]


async def test_review_26_a_batch_half_committed_across_journals_is_reported_exactly(cluster) -> None:
    """50 lines in one batch, spread over r26/rw and r26/ro (read-only, NOT_ALLOWED): the lines mapped
    to r26/rw commit, yet the error says 0 were published and to resend from line 1, which
    publishes them twice (a new run is a new producer: read committed keeps both copies)."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r26/rw", 1, labels={**NDJSON, "app": "r26"})
    await cluster.create_journal("r26/ro", 1, labels={**NDJSON, "app": "r26"}, flags="read-only")
    stdin = b"".join(b'{"n": %d}\n' % n for n in range(1, 51))
    r = await run("publish", "app=r26", "--flush-interval", "5", broker=ep, stdin=stdin)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    committed = [m["n"] for m in await _messages(cluster, "r26/rw")]
    assert committed, "precondition: some lines were mapped to the writable journal"
    # What the report claims was published must be exactly what the journals hold.
    claimed = [m for m in err.split("published ")[1:] if m[:1].isdigit()]
    assert claimed, err
    n_claimed = int(claimed[0].split()[0])
    assert n_claimed == len(committed), (
        f"report says {n_claimed} published, but r26/rw holds {len(committed)} lines "
        f"({committed[:5]}...): resending as told duplicates them. stderr: {err!r}"
    )


async def test_review_26_many_lines_split_across_reads_each_once_in_order(cluster) -> None:
    """Held up (if it passes): 25,000 lines (over the 10,000 slots, many 64 KiB reads, lines cut
    between reads), the last without a newline, each published once, in stdin order."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r26/many", 1, labels=NDJSON)
    stdin = b"\n".join(json.dumps({"n": n, "p": "y" * (n % 97)}).encode() for n in range(25_000))
    r = await run("publish", "r26/many", broker=ep, stdin=stdin)
    assert r.returncode == 0 and r.stderr == b"published 25000 messages to r26/many\n", r.stderr
    got = [m["n"] for m in await _messages(cluster, "r26/many")]
    assert got == list(range(25_000))
