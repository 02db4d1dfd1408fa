"""Review 25: `journals read --committed` with --offset/--end-offset/--max-messages and `journals head`
against a real cluster."""

from __future__ import annotations

import json

from tests.cli.test_cli import run

NDJSON = {"content-type": "application/x-ndjson"}


async def _rows(ep: str, *args: str) -> list[dict]:
    r = await run("journals", "read", "cli/r25", "--committed", "--with-offsets", *args, broker=ep)
    assert r.returncode == 0 and r.stderr == b"", r
    return [json.loads(line) for line in r.stdout.splitlines()]


async def _four(cluster) -> tuple[str, list[int], int]:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("cli/r25", 1, labels=NDJSON)
    for body in (b'{"n": 0}\n{"n": 1}\n', b'{"n": 2, "pad": "' + b"y" * 100 + b'"}\n{"n": 3}\n'):  # (two appends)
        assert (await run("publish", "cli/r25", broker=ep, stdin=body)).returncode == 0
    rows = await _rows(ep)
    assert [row["message"]["n"] for row in rows] == [0, 1, 2, 3], rows
    head = int((await run("journals", "head", "cli/r25", broker=ep)).stdout)
    return ep, [row["offset"] for row in rows], head


async def test_review_25_offsets_and_limits_select_exactly_the_range(cluster) -> None:
    """Held up: every [offset, end-offset) of printed offsets, and every --max-messages 1..5."""
    ep, offsets, head = await _four(cluster)
    bounds = [*offsets, head]
    for i, begin in enumerate(offsets):
        assert [row["offset"] for row in await _rows(ep, "--offset", str(begin))] == offsets[i:]
        for j in range(i + 1, len(bounds)):
            got = await _rows(ep, "--offset", str(begin), "--end-offset", str(bounds[j]))
            assert [row["offset"] for row in got] == offsets[i:j], (begin, bounds[j], got)
    for k in range(1, 6):
        got = await _rows(ep, "--max-messages", str(k), "--offset", str(offsets[1]))
        assert [row["offset"] for row in got] == offsets[1 : 1 + k], (k, got)


async def test_review_25_an_end_offset_inside_a_message_says_it_cut_the_message(cluster) -> None:
    """--end-offset one byte into a message: the range is bytes (as a Spark range is), so the message
    is not printed; stderr called its bytes 'undecodable' ('unexpected end of data'), though they
    are whole in the journal. Now it says --end-offset cut it, and where to end instead."""
    ep, offsets, _head = await _four(cluster)
    r = await run(
        "journals", "read", "cli/r25", "--committed", "--with-offsets",
        "--offset", str(offsets[1]), "--end-offset", str(offsets[2] + 1), broker=ep,
    )  # fmt: skip
    got = [json.loads(line)["offset"] for line in r.stdout.splitlines()]
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 0 and got == offsets[1:2], r
    assert len(lines) == 1 and f"--end-offset {offsets[2] + 1} cuts the message at offset {offsets[2]}" in lines[0], r


async def test_review_25_an_invalid_journal_name_is_a_usage_error(cluster) -> None:
    """main() says a journal name that is invalid exits 2 (a usage error, as a spec field does);
    the broker's INVALID_ARGUMENT for `a//b` exits 1, and only after connecting."""
    ep = cluster.brokers[0].endpoint
    for args in (("journals", "head", "a//b"), ("journals", "read", "a b"), ("journals", "delete", "a//b", "--yes")):
        r = await run(*args, broker=ep)
        lines = r.stderr.decode().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "journal name" in lines[0], (args, r)
