"""`journals append` and `publish` ride out a primary just killed (child brokers, SIGKILL) or an answer
lost in transport: transient failures are retried within --deadline, and the content lands once (no
acknowledged append lost, no offset handed out twice: DESIGN.md invariants 1 and 2, as a client sees
them); past the deadline, one line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import tidings.broker.service as service
from tests.cli._support import tidings
from tests.support.cluster import create_local_journal
from tidings.broker.append_api import serve_append


def _kill_primary(lc, journal: str) -> str:
    r = tidings("journals", "list", "--json", "--selector", f"name={journal}", broker=lc.endpoints[0])
    primary = json.loads(r.stdout)["primary"]
    victim = next(b for b in lc.brokers if f"{b.zone}/{b.suffix}" == primary)
    victim.kill()
    return victim.suffix


def test_append_and_publish_ride_out_a_killed_primary(local_cluster, tmp_path) -> None:
    lc = local_cluster
    asyncio.run(create_local_journal(lc, "retry/raw", 3))
    asyncio.run(create_local_journal(lc, "retry/msgs", 2, labels={"content-type": "application/x-ndjson"}))
    content = tmp_path / "content"
    content.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))

    killed = _kill_primary(lc, "retry/raw")
    survivor = next(b.endpoint for b in lc.brokers if b.suffix != killed)
    r = tidings("journals", "append", "retry/raw", "--file", str(content), "--deadline", "60", broker=survivor)
    assert r.returncode == 0, r
    span = json.loads(r.stdout)
    assert span["end"] - span["begin"] == len(content.read_bytes())
    assert tidings("journals", "read", "retry/raw", broker=survivor).stdout == content.read_bytes()  # once

    _kill_primary(lc, "retry/msgs")  # (two of four brokers left: enough for its two replicas)
    survivor = next(b.endpoint for b in lc.brokers if b.alive())
    lines = b"".join(b'{"n": %d}\n' % i for i in range(200))
    r = tidings("publish", "retry/msgs", "--deadline", "60", broker=survivor, stdin=lines)
    assert r.returncode == 0, r
    got = tidings("journals", "read", "retry/msgs", "--committed", broker=survivor).stdout.splitlines()
    assert [json.loads(line)["n"] for line in got] == list(range(200))


def test_past_the_deadline_a_failure_is_one_line(local_cluster) -> None:
    from tidings.cluster import free_port

    nobody = f"127.0.0.1:{free_port()}"
    r = tidings("journals", "append", "retry/none", "--deadline", "1", broker=nobody, stdin=b"x\n")
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "UNAVAILABLE" in lines[0] and "Traceback" not in lines[0], r
    r = tidings("publish", "retry/none", "--deadline", "1", broker=nobody, stdin=b'{"n": 1}\n')
    assert r.returncode == 1 and "Traceback" not in r.stderr.decode(), r


async def test_journals_append_gives_up_or_checks_when_an_answer_is_lost(cluster, monkeypatch, tmp_path) -> None:
    """The broker commits the content attempt and then never answers (as a frozen connection without
    keep-alive would): `journals append` does not wait for ever (its content attempt, callable content
    and so not `whole`, gets no per-attempt timeout from `AsyncClient.append`), but within --deadline
    finds its content committed and reports it, appended once."""
    await cluster.create_journal("retry/lost", 3)
    await cluster.wait_consistent("retry/lost", 3)
    swallowed = []

    async def lossy(broker, context, claims):
        resp = await serve_append(broker, context, claims)
        if resp is not None and resp.commit.end > resp.commit.begin and not swallowed:
            swallowed.append(resp.commit)
            await asyncio.Event().wait()  # committed, but the answer never comes
        return resp

    monkeypatch.setattr(service, "serve_append", lossy)
    f = tmp_path / "content"
    f.write_bytes(b"x" * 1000)
    env = {**os.environ, "TIDINGS_BROKER": cluster.brokers[0].endpoint}
    cmd = [sys.executable, "-m", "tidings.cli", "journals", "append", "retry/lost"]
    cmd += ["--file", str(f), "--deadline", "5"]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 45)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"`journals append --deadline 5` still waiting after 45s (commit {swallowed})") from None
    assert swallowed, "the lossy hook never fired"
    assert proc.returncode == 0, err
    assert json.loads(out)["begin"] == swallowed[0].begin  # it found its content, appended once
