"""`tidings journals head`, `read` and `append --offset` as an operator uses them, against a real
cluster: `read --committed` prints exactly the messages of [--offset, --end-offset), up to
--max-messages (saying so when --end-offset cuts a message), and the head is printed. Offsets or
journal names that make no sense are refused in one line (exit 2), and an append at the wrong offset
names the head and appends nothing; a piped `journals list` table is not cut at 80 columns."""

from __future__ import annotations

import json

from tests.cli._support import run

NDJSON = {"content-type": "application/x-ndjson"}


async def _journal_of_three(cluster) -> str:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("cli/three", 1, labels={"content-type": "application/x-ndjson"})
    r = await run("publish", "cli/three", broker=ep, stdin=b'{"n": 1}\n{"n": 2}\n{"n": 3}\n')
    assert r.returncode == 0, r
    return ep


async def test_head_and_offsets_that_make_no_sense(cluster) -> None:
    ep = await _journal_of_three(cluster)
    head = int((await run("journals", "head", "cli/three", broker=ep)).stdout)
    assert head > 0
    r = await run("journals", "head", "cli/three", "--json", broker=ep)
    assert json.loads(r.stdout) == {"journal": "cli/three", "head": head}
    for args, says in (
        (("--offset", str(head + 1)), f"past the write head {head}"),
        (("--offset", "10", "--end-offset", "5"), "--end-offset 5 is before --offset 10"),
        (("--offset", "-5"), "--offset -5: give 0 or more"),
        (("--max-messages", "2"), "go with --committed"),
    ):
        r = await run("journals", "read", "cli/three", *args, broker=ep)
        lines = r.stderr.decode().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (args, r)
    r = await run("journals", "append", "cli/three", "--offset", "5", broker=ep, stdin=b"x\n")
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and f"is not its write head {head}" in lines[0], r
    assert int((await run("journals", "head", "cli/three", broker=ep)).stdout) == head  # (nothing appended)


async def test_read_committed_honours_offsets_and_limits(cluster) -> None:
    ep = await _journal_of_three(cluster)
    r = await run("journals", "read", "cli/three", "--committed", "--with-offsets", broker=ep)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["message"]["n"] for row in rows] == [1, 2, 3] and rows[0]["offset"] == 0
    second, third = rows[1]["offset"], rows[2]["offset"]
    r = await run("journals", "read", "cli/three", "--committed", "--offset", str(second), broker=ep)
    assert [json.loads(line)["n"] for line in r.stdout.splitlines()] == [2, 3]
    args = ("--committed", "--offset", str(second), "--end-offset", str(third))
    r = await run("journals", "read", "cli/three", *args, broker=ep)
    assert [json.loads(line)["n"] for line in r.stdout.splitlines()] == [2]
    r = await run("journals", "read", "cli/three", "--committed", "--max-messages", "2", broker=ep)
    assert [json.loads(line)["n"] for line in r.stdout.splitlines()] == [1, 2] and r.returncode == 0


async def test_a_piped_table_is_not_cut_at_80_columns(cluster) -> None:
    """Piped, rich tables were cut to 80 columns: a long name or label set came out wrapped or '…'."""
    ep = cluster.brokers[0].endpoint
    name = "cli/a/very/long/journal/name/that/goes/on/and/on/for/quite/a/while"
    await cluster.create_journal(name, 1, labels={"app": "something-long", "team": "another-long-value"})
    r = await run("journals", "list", broker=ep)
    row = next(line for line in r.stdout.decode().splitlines() if name in line)
    assert "app=something-long,team=another-long-value" in row, r.stdout.decode()


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


async def test_offsets_and_limits_select_exactly_the_range(cluster) -> None:
    """Every [offset, end-offset) of printed offsets, and every --max-messages 1..5, selects exactly
    those messages."""
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


async def test_an_end_offset_inside_a_message_says_it_cut_the_message(cluster) -> None:
    """--end-offset one byte into a message: the range is bytes (as a Spark range is), so the message
    is not printed, and stderr says --end-offset cut it and where to end instead (not that its bytes,
    whole in the journal, are 'undecodable')."""
    ep, offsets, _head = await _four(cluster)
    r = await run(
        "journals", "read", "cli/r25", "--committed", "--with-offsets",
        "--offset", str(offsets[1]), "--end-offset", str(offsets[2] + 1), broker=ep,
    )  # fmt: skip
    got = [json.loads(line)["offset"] for line in r.stdout.splitlines()]
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 0 and got == offsets[1:2], r
    assert len(lines) == 1 and f"--end-offset {offsets[2] + 1} cuts the message at offset {offsets[2]}" in lines[0], r


async def test_an_invalid_journal_name_is_a_usage_error(cluster) -> None:
    """A journal name that is invalid exits 2 in one line (a usage error, as a bad spec field does), as
    main() documents, rather than 1 on the broker's INVALID_ARGUMENT after connecting."""
    ep = cluster.brokers[0].endpoint
    for args in (("journals", "head", "a//b"), ("journals", "read", "a b"), ("journals", "delete", "a//b", "--yes")):
        r = await run(*args, broker=ep)
        lines = r.stderr.decode().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "journal name" in lines[0], (args, r)
