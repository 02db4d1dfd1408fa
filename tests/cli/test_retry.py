"""`journals append` and `publish` ride out a primary just killed (issue 8, item 11): transient
failures are retried within --deadline, and nothing lands twice; past the deadline, one line.
Brokers are child processes, killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json

from tests.cli.test_cli import tidings
from tests.support.cluster import create_local_journal


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
