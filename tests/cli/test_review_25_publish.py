"""Review 25: `tidings publish` against a real cluster, when it stops before stdin ends (a bad line,
a failed append, Ctrl-C): the user must get one line saying how far it got, so that resending
the rest neither loses nor duplicates lines (a new run is a new producer: read-committed readers
do not drop its copies of lines the last run committed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from tests.cli.test_cli import run
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


async def test_review_25_a_bad_line_with_more_input_behind_it_is_one_line(cluster) -> None:
    """The loop ends at the bad line while the stdin thread still feeds it (30,000 lines, more than
    the queue's 10,000): at loop close 'coroutine Queue.put was never awaited' and, at times, the
    thread's 'RuntimeError: Event loop is closed' traceback reach stderr beside the error line."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r25/bad", 1, labels=NDJSON)
    stdin = b"not json\n" + b'{"n": 1}\n' * 30_000
    r = await run("publish", "r25/bad", broker=ep, stdin=stdin)
    err = r.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert r.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: stdin line 1 is not a JSON object"), err
    assert await _messages(cluster, "r25/bad") == []


async def test_review_25_an_append_failing_mid_stream_says_what_was_published(cluster) -> None:
    """Two lines committed, then the journal is deleted and a third line fails: the user saw the
    AppendService's log line (naming `resume()`, an API) and an error line, but not that lines 1-2
    were published, so cannot resend only line 3."""
    await cluster.create_journal("r25/gone", 1, labels=NDJSON)
    p = await _start_publish(cluster, "r25/gone")
    try:
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write(b'{"n": 1}\n{"n": 2}\n')
        await p.stdin.drain()

        async def committed() -> bool:
            return [m["n"] for m in await _messages(cluster, "r25/gone")] == [1, 2]

        await wait_until(committed, 30)
        async with cluster.client(0) as c:
            rev = next(j.mod_revision for j in (await c.list()).journals if j.spec.name == "r25/gone")
            await c.apply([pb.ApplyRequest.Change(delete="r25/gone", expect_mod_revision=rev)])
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


async def test_review_25_ctrl_c_says_what_was_published(cluster) -> None:
    """Ctrl-C exits 130 with an empty stderr: of what `tail -f | tidings publish` was fed, the user
    cannot tell what committed (here: lines 1-2) and what to feed again."""
    await cluster.create_journal("r25/int", 1, labels=NDJSON)
    p = await _start_publish(cluster, "r25/int")
    try:
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write(b'{"n": 1}\n{"n": 2}\n')
        await p.stdin.drain()

        async def committed() -> bool:
            return [m["n"] for m in await _messages(cluster, "r25/int")] == [1, 2]

        await wait_until(committed, 30)
        p.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(p.wait(), 30)
        err = (await p.stderr.read()).decode()
    finally:
        await _stop(p)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and "Traceback" not in err, err
    assert len(lines) == 1 and "2 messages" in lines[0], err


async def test_review_25_partial_long_crlf_lines_each_published_once(cluster) -> None:
    """Held up: a 200 KiB line (over the 64 KiB read size), CRLF endings, blank lines and a last line
    without a newline are each published once, in order."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r25/shapes", 1, labels=NDJSON)
    long = json.dumps({"n": 0, "pad": "x" * 200_000}).encode()
    stdin = long + b"\r\n" + b'{"n": 1}\r\n\r\n\n' + b'{"n": 2}\n' + b'{"n": 3}'
    r = await run("publish", "r25/shapes", broker=ep, stdin=stdin)
    assert r.returncode == 0 and r.stderr == b"published 4 messages to r25/shapes\n", r
    got = await _messages(cluster, "r25/shapes")
    assert [m["n"] for m in got] == [0, 1, 2, 3] and len(got[0]["pad"]) == 200_000


async def test_review_25_kill_9_of_the_primary_mid_publish(local_cluster) -> None:
    """A streaming publish (through a broker that is not the primary) while the primary is killed:
    publish must either finish (exit 0, every line read back once by --committed) or stop with one
    line saying what was published; never a traceback, never a line lost that it reported."""
    from tests.support.cluster import create_local_journal
    from tidings.client import AsyncClient

    lc = local_cluster
    await create_local_journal(lc, "r25/kill9", 3, labels=NDJSON)
    async with AsyncClient(lc.endpoints[0]) as c:
        route = next(j.route for j in (await c.list()).journals if j.spec.name == "r25/kill9")
    primary = route.members[route.primary].suffix
    via = next(b for b in lc.brokers if b.suffix != primary)
    victim = next(b for b in lc.brokers if b.suffix == primary)
    env = {**os.environ, "TIDINGS_BROKER": via.endpoint}
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidings.cli", "publish", "r25/kill9",
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip

    async def read_back() -> list[int]:
        r = await run("journals", "read", "r25/kill9", "--committed", broker=via.endpoint)
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
        assert lines[0] == "published 200 messages to r25/kill9" and sorted(got) == list(range(200)), (err, got)
    else:
        assert lines[0].startswith("error: "), err
