"""`tidings publish` (and `journals append` from stdin) as a user runs it, against a real cluster: each
stdin line is published once and in order, as it comes, and when publishing stops early (a bad line, a
refused or failed append, Ctrl-C, a killed primary) one line says exactly what was published, so that
resending the rest neither loses nor duplicates a line (read committed yields each committed message
once, DESIGN.md invariant 7, and a new run is a new producer whose copies are new messages). It refuses
up front what it cannot publish once (a line's own "uuid", --key with a journal name, a line lacking
the --key field, an absent journal); --skip-invalid reports bad lines and goes on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from tests.cli._support import run
from tests.support.waiting import wait_until
from tidings.message import read_committed
from tidings.protocol import protocol_pb2 as pb

NDJSON = {"content-type": "application/x-ndjson"}


async def _messages(cluster, journal: str) -> list[dict]:
    async with cluster.client(0) as c:
        return [env.message async for env in read_committed(c, journal, block=False)]


async def _start_publish(cluster, journal: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "TIDINGS_BROKER": cluster.brokers[0].endpoint}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidings.cli", "publish", journal,
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip


async def _stop(p: asyncio.subprocess.Process) -> None:
    if p.returncode is None:
        p.kill()
        await p.wait()


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


async def test_a_bad_line_with_more_input_behind_it_is_one_line(cluster) -> None:
    """A bad first line with 30,000 more behind it (more than the queue's 10,000): the loop ends at the
    bad line while the stdin thread still feeds it, and stderr holds the error line alone (no
    'coroutine Queue.put was never awaited', no thread's 'Event loop is closed' traceback); nothing
    is published."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("lines/bad", 1, labels=NDJSON)
    stdin = b"not json\n" + b'{"n": 1}\n' * 30_000
    r = await run("publish", "lines/bad", broker=ep, stdin=stdin)
    err = r.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert r.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: stdin line 1 is not a JSON object"), err
    assert await _messages(cluster, "lines/bad") == []


async def test_an_append_failing_mid_stream_says_what_was_published(cluster) -> None:
    """Two lines committed, then the journal is deleted and a third line fails: the one `error: ` line
    says the 2 messages were published and names line 3 (so the user resends only line 3), with no
    log line of the AppendService's (naming `resume()`, an API) beside it."""
    await cluster.create_journal("lines/gone", 1, labels=NDJSON)
    p = await _start_publish(cluster, "lines/gone")
    try:
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write(b'{"n": 1}\n{"n": 2}\n')
        await p.stdin.drain()

        async def committed() -> bool:
            return [m["n"] for m in await _messages(cluster, "lines/gone")] == [1, 2]

        await wait_until(committed, 30)
        async with cluster.client(0) as c:
            rev = next(j.mod_revision for j in (await c.list()).journals if j.spec.name == "lines/gone")
            await c.apply([pb.ApplyRequest.Change(delete="lines/gone", expect_mod_revision=rev)])
        p.stdin.write(b'{"n": 3}\n')
        await p.stdin.drain()
        p.stdin.close()
        code = await asyncio.wait_for(p.wait(), 60)
        err = (await p.stderr.read()).decode()
    finally:
        await _stop(p)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "2 messages" in lines[0] and "line 3" in lines[0], err


async def test_ctrl_c_says_what_was_published(cluster) -> None:
    """Ctrl-C exits 130 with one line saying what committed (here: lines 1-2), so that of what
    `tail -f | tidings publish` was fed the user knows what to feed again. (Readers may see the commit
    before the publisher has its answer: then the line says lines 1-2 may have been published.)"""
    await cluster.create_journal("lines/int", 1, labels=NDJSON)
    p = await _start_publish(cluster, "lines/int")
    try:
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write(b'{"n": 1}\n{"n": 2}\n')
        await p.stdin.drain()

        async def committed() -> bool:
            return [m["n"] for m in await _messages(cluster, "lines/int")] == [1, 2]

        await wait_until(committed, 30)
        p.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(p.wait(), 30)
        err = (await p.stderr.read()).decode()
    finally:
        await _stop(p)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and "Traceback" not in err, err
    said = (
        "interrupted: published 2 messages (stdin lines 1 to 2)",
        "interrupted: published 0 messages (no stdin line); stdin lines 1 to 2 were being published and may have been",
    )
    assert len(lines) == 1 and lines[0].startswith(said), err


async def test_partial_long_crlf_lines_each_published_once(cluster) -> None:
    """A 200 KiB line (over the 64 KiB read size), CRLF endings, blank lines and a last line without a
    newline are each published once, in order."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("lines/shapes", 1, labels=NDJSON)
    long = json.dumps({"n": 0, "pad": "x" * 200_000}).encode()
    stdin = long + b"\r\n" + b'{"n": 1}\r\n\r\n\n' + b'{"n": 2}\n' + b'{"n": 3}'
    r = await run("publish", "lines/shapes", broker=ep, stdin=stdin)
    assert r.returncode == 0 and r.stderr == b"published 4 messages to lines/shapes\n", r
    got = await _messages(cluster, "lines/shapes")
    assert [m["n"] for m in got] == [0, 1, 2, 3] and len(got[0]["pad"]) == 200_000


async def test_kill_9_of_the_primary_mid_publish(local_cluster) -> None:
    """A streaming publish (through a broker that is not the primary) while the primary is killed:
    publish must either finish (exit 0, every line read back once by --committed) or stop with one
    line saying what was published; never a traceback, never a line lost that it reported."""
    from tests.support.cluster import create_local_journal
    from tidings.client import AsyncClient

    lc = local_cluster
    await create_local_journal(lc, "lines/kill9", 3, labels=NDJSON)
    async with AsyncClient(lc.endpoints[0]) as c:
        route = next(j.route for j in (await c.list()).journals if j.spec.name == "lines/kill9")
    primary = route.members[route.primary].suffix
    via = next(b for b in lc.brokers if b.suffix != primary)
    victim = next(b for b in lc.brokers if b.suffix == primary)
    env = {**os.environ, "TIDINGS_BROKER": via.endpoint}
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidings.cli", "publish", "lines/kill9",
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip

    async def read_back() -> list[int]:
        r = await run("journals", "read", "lines/kill9", "--committed", broker=via.endpoint)
        return [json.loads(line)["n"] for line in r.stdout.splitlines()]

    try:
        assert p.stdin is not None and p.stderr is not None
        for n in range(200):
            p.stdin.write(b'{"n": %d}\n' % n)
            await p.stdin.drain()
            if n == 99:
                await wait_until(lambda: asyncio.ensure_future(read_back()), 30)  # (some committed)
                victim.kill()
        p.stdin.close()
        code = await asyncio.wait_for(p.wait(), 120)
        err = (await p.stderr.read()).decode()
    finally:
        await _stop(p)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    got = await read_back()
    assert len(got) == len(set(got)), "a line read back twice"
    if code == 0:
        assert lines[0] == "published 200 messages to lines/kill9" and sorted(got) == list(range(200)), (err, got)
    else:
        assert lines[0].startswith("error: "), err


async def test_a_batch_half_committed_across_journals_is_reported_exactly(cluster) -> None:
    """50 lines in one batch to a label selector, spread over flows/rw and flows/ro (read-only,
    NOT_ALLOWED): the lines mapped to flows/rw commit, and the report ("published N messages (stdin
    lines 1 to L)", resend from L+1) counts exactly those, or resending as told would publish them
    twice (a new run is a new producer: read committed keeps both copies)."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("flows/rw", 1, labels={**NDJSON, "app": "r26"})
    await cluster.create_journal("flows/ro", 1, labels={**NDJSON, "app": "r26"}, flags="read-only")
    stdin = b"".join(b'{"n": %d}\n' % n for n in range(1, 51))
    r = await run("publish", "app=r26", "--flush-interval", "5", broker=ep, stdin=stdin)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    committed = [m["n"] for m in await _messages(cluster, "flows/rw")]
    assert committed, "precondition: some lines were mapped to the writable journal"
    # What the report claims was published must be exactly what the journals hold.
    claimed = [m for m in err.split("published ")[1:] if m[:1].isdigit()]
    assert claimed, err
    n_claimed = int(claimed[0].split()[0])
    assert n_claimed == len(committed), (
        f"report says {n_claimed} published, but flows/rw holds {len(committed)} lines "
        f"({committed[:5]}...): resending as told duplicates them. stderr: {err!r}"
    )


async def test_many_lines_split_across_reads_each_once_in_order(cluster) -> None:
    """25,000 lines (over the 10,000 slots, many 64 KiB reads, lines cut between reads), the last
    without a newline, are each published once, in stdin order."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("flows/many", 1, labels=NDJSON)
    stdin = b"\n".join(json.dumps({"n": n, "p": "y" * (n % 97)}).encode() for n in range(25_000))
    r = await run("publish", "flows/many", broker=ep, stdin=stdin)
    assert r.returncode == 0 and r.stderr == b"published 25000 messages to flows/many\n", r.stderr
    got = [m["n"] for m in await _messages(cluster, "flows/many")]
    assert got == list(range(25_000))
