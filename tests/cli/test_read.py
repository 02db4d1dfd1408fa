"""`tidings journals head`, `read` and `append --offset` as an operator uses them (issue 8, item 5),
against a real cluster: the head printed; offsets that make no sense refused in one line (exit 2);
an append at the wrong offset names the head; read --committed honours --offset, --end-offset,
--with-offsets and --max-messages."""

from __future__ import annotations

import json

from tests.cli.test_cli import run


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
