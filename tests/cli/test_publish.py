"""`tidings publish` as a user runs it (issue 8, items 9, 11, 12), against a real cluster: it commits
lines as they come (stdin still open), stops at once on Ctrl-C keeping what it committed, refuses a
line's own "uuid", --key with a journal name, a line lacking the --key field, and with
--skip-invalid reports bad lines and goes on; the README's example reads back without a warning."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from tests.cli.test_cli import run
from tests.support.waiting import wait_until
from tidings.message import read_committed


async def _messages(cluster, journal: str) -> list[dict]:
    async with cluster.client(0) as c:
        return [env.message async for env in read_committed(c, journal, block=False)]


async def test_publish_commits_each_line_as_it_comes_and_stops_at_once_on_ctrl_c(cluster) -> None:
    await cluster.create_journal("cli/tail", 1, labels={"content-type": "application/x-ndjson"})
    env = {**os.environ, "TIDINGS_BROKER": cluster.brokers[0].endpoint}
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidings.cli", "publish", "cli/tail",
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write(b'{"n": 1}\n')  # (and left open, as `tail -f` leaves it)
        await p.stdin.drain()

        async def committed() -> bool:
            return [m["n"] for m in await _messages(cluster, "cli/tail")] == [1]

        await wait_until(committed, 30)
        p.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(p.wait(), 30)
        errors = await p.stderr.read()
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()
    assert code == 130 and b"Traceback" not in errors, (code, errors)
    assert [m["n"] for m in await _messages(cluster, "cli/tail")] == [1]


async def test_publish_refuses_what_it_cannot_publish_once(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("cli/p", 1, labels={"content-type": "application/x-ndjson", "topic": "p"})
    r = await run("publish", "cli/p", "--key", "n", broker=ep, stdin=b'{"n": 1}\n')
    assert r.returncode == 2 and b"drop --key" in r.stderr, r
    r = await run("publish", "cli/p", broker=ep, stdin=b'{"n": 2, "uuid": "mine"}\n')
    assert r.returncode == 1 and b'has its own "uuid" field' in r.stderr, r
    r = await run("publish", "topic=p", "--key", "n", broker=ep, stdin=b'{"n": 3}\n{"m": 4}\n')
    assert r.returncode == 1 and b"stdin line 2 has no 'n' field" in r.stderr, r
    r = await run("publish", "cli/p", "--skip-invalid", broker=ep, stdin=b'{"n": 5}\nnot json\n{"n": 6}\n')
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 0 and lines[0].startswith("skipped stdin line 2 is not a JSON object"), r
    assert lines[1] == "published 2 messages to cli/p", r
    assert [m["n"] for m in await _messages(cluster, "cli/p")] == [3, 5, 6]


async def test_the_readmes_example_reads_back_without_a_warning(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("cli/readme", 1, labels={"content-type": "application/x-ndjson"})
    r = await run("journals", "append", "cli/readme", broker=ep, stdin=b'{"greeting": "hello"}\n')
    assert r.returncode == 0, r
    r = await run("publish", "cli/readme", broker=ep, stdin=b'{"user": "ann"}\n{"user": "bob"}\n')
    r = await run("journals", "read", "cli/readme", "--committed", broker=ep)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and r.stderr == b"", r
    assert [row.get("greeting") or row["user"] for row in rows] == ["hello", "ann", "bob"]


async def test_append_waiting_on_stdin_stops_at_once_on_ctrl_c_and_commits_nothing(cluster) -> None:
    """`journals append` read stdin on its event loop: Ctrl-C did nothing while it waited (a
    terminal, or a pipe nobody writes); now a thread reads, and the append, all or nothing, is dropped."""
    from pathlib import Path

    await cluster.create_journal("cli/ctrl-c", 1)
    env = {**os.environ, "TIDINGS_BROKER": cluster.brokers[0].endpoint}
    read_end, write_end = os.pipe()  # (a pipe, as a shell gives: asyncio's PIPE would be a socket pair)
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidings.cli", "journals", "append", "cli/ctrl-c",
        stdin=read_end, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    os.close(read_end)

    def waiting_on_stdin() -> bool:
        """A thread of it blocked reading the pipe (Linux names the wait in /proc)."""
        assert p.returncode is None, f"append exited before Ctrl-C: {p.returncode}"
        for task in Path(f"/proc/{p.pid}/task").iterdir():
            try:
                if "pipe_read" in (task / "wchan").read_text():
                    return True
            except FileNotFoundError:  # (a thread that ended meanwhile)
                pass
        return False

    try:
        assert p.stderr is not None
        try:
            os.write(write_end, b"half of what was meant ")
        except BrokenPipeError:  # (it exited before reading: say why, not just that the pipe broke)
            await asyncio.wait_for(p.wait(), 10)
            raise AssertionError(f"append exited ({p.returncode}) before reading: {await p.stderr.read()!r}") from None
        await wait_until(waiting_on_stdin, 30)
        p.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(p.wait(), 10)
        errors = await p.stderr.read()
    finally:
        os.close(write_end)
        if p.returncode is None:
            p.kill()
            await p.wait()
    assert code == 130 and b"Traceback" not in errors, (code, errors)
    async with cluster.client(0) as c:
        assert await c.write_head("cli/ctrl-c") == 0


async def test_publish_to_an_absent_journal_says_so_before_reading_stdin(cluster) -> None:
    """An empty stdin published to a misspelt journal said 'published 0 messages' and exited 0."""
    ep = cluster.brokers[0].endpoint
    for stdin in (b"", b'{"n": 1}\n'):
        r = await run("publish", "no/such", broker=ep, stdin=stdin)
        lines = r.stderr.decode().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and "journal 'no/such' does not exist" in lines[0], r
