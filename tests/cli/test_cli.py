"""The `tidings` command end to end: journals apply/list/append/read/fragments, publish, `cluster up` and
the demo; appends refused after INDEX_HAS_GREATER_OFFSET until reset-head (DESIGN.md invariant 6); and
bad input or a wrong --broker prints one clear line and exits non-zero, without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli._support import run, tidings


async def test_apply_list_append_read_fragments(cluster, spec_file: Path) -> None:
    ep = cluster.brokers[1].endpoint
    r = await run("journals", "apply", str(spec_file), broker=ep)
    assert r.returncode == 0, r.stderr
    await cluster.wait_consistent("cli/hello", 3)
    r = await run("journals", "list", "--json", "--selector", "app=cli", broker=ep)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["name"] for row in rows] == ["cli/hello"] and len(rows[0]["replicas"]) == 3
    r = await run("journals", "append", "cli/hello", broker=ep, stdin=b"one\n")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["begin"] == 0 and json.loads(r.stdout)["end"] == 4
    r = await run("journals", "append", "cli/hello", broker=ep, stdin=b"two\n")
    assert json.loads(r.stdout)["begin"] == 4
    r = await run("journals", "read", "cli/hello", broker=cluster.brokers[2].endpoint)
    assert r.returncode == 0 and r.stdout == b"one\ntwo\n"
    r = await run("journals", "read", "cli/hello", "--offset", "4", "--end-offset", "7", broker=ep)
    assert r.stdout == b"two"
    r = await run("journals", "fragments", "cli/hello", "--json", broker=ep)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["begin"] == 0


@pytest.mark.parametrize(
    "args,needle",
    [
        pytest.param(("journals", "append", "no/such"), "JOURNAL_NOT_FOUND", id="unknown-journal"),
        pytest.param(("journals", "read", "a//b"), "empty segment", id="invalid-name"),
        pytest.param(("journals", "read", "cli/hello", "--offset", "-9"), "offset", id="bad-offset"),
    ],
)
async def test_bad_input_prints_one_clear_line(cluster, spec_file: Path, args, needle) -> None:
    await run("journals", "apply", str(spec_file), broker=cluster.brokers[0].endpoint)
    r = await run(*args, broker=cluster.brokers[0].endpoint)
    err = r.stderr.decode()
    assert r.returncode != 0 and needle in err and "Traceback" not in err


async def test_invalid_spec_file_is_named(cluster, tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: x/y\nreplication: 7\n")
    r = await run("journals", "apply", str(f), broker=cluster.brokers[0].endpoint)
    err = r.stderr.decode()
    assert r.returncode == 2 and "replication" in err and "Traceback" not in err  # (a usage error)


def test_unreachable_cluster_says_what_to_do(tmp_path: Path) -> None:
    """A --broker where nothing ever answered fails at once, append and publish included (they retry a
    broker that answered before, for --deadline seconds: a journal that moved is worth it, a wrong
    address is not): given --deadline 600, each fails within the 60 s `tidings` allows it."""
    from tidings.cluster import free_port

    nobody = f"127.0.0.1:{free_port()}"
    for args, stdin in (
        (("journals", "list"), b""),
        (("journals", "append", "a/b", "--deadline", "600"), b"x"),
        (("publish", "a/b", "--deadline", "600"), b"{}\n"),
    ):
        r = tidings(*args, broker=nobody, stdin=stdin)
        err = r.stderr.decode()
        assert r.returncode == 1 and "UNAVAILABLE" in err and "cluster up" in err and err.count("\n") == 1, (args, err)


def test_a_broker_address_that_is_not_a_broker_says_what_it_is(etcd) -> None:
    """--broker naming etcd (gRPC, but no Journal service) or a web port (HTTP/1) says so in one line."""
    import http.server
    import threading

    r = tidings("journals", "append", "a/b", broker=etcd.endpoint, stdin=b"x")
    err = r.stderr.decode()
    assert r.returncode == 1 and f"{etcd.endpoint} is not a tidings broker (an etcd endpoint?)" in err, err
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        at = f"127.0.0.1:{web.server_port}"
        for args, stdin in ((("journals", "list"), b""), (("publish", "a/b"), b"{}\n")):
            r = tidings(*args, broker=at, stdin=stdin)
            err = r.stderr.decode()
            assert r.returncode == 1 and f"{at} does not speak gRPC" in err and err.count("\n") == 1, err
    finally:
        web.shutdown()
        web.server_close()


async def test_reset_head_after_index_has_greater_offset(cluster, spec_file: Path) -> None:
    from tests.support.fragments import write_foreign_fragment

    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    await cluster.wait_consistent("cli/hello", 3)
    await run("journals", "append", "cli/hello", broker=ep, stdin=b"abc")
    write_foreign_fragment(cluster, "cli/hello", 50, b"0123456789", codec="gzip")

    async def refused() -> bool:
        r = await run("journals", "append", "cli/hello", broker=ep, stdin=b"x")
        return r.returncode == 1 and b"INDEX_HAS_GREATER_OFFSET" in r.stderr and b"reset-head" in r.stderr

    from tests.support.waiting import wait_until

    await wait_until(refused, 30, interval=0.2)
    r = await run("journals", "reset-head", "cli/hello", broker=ep)
    assert r.returncode == 0 and json.loads(r.stdout)["write_head"] == 60
    r = await run("journals", "append", "cli/hello", broker=ep, stdin=b"xyz")
    assert json.loads(r.stdout)["begin"] == 60


async def test_a_journal_created_over_an_earlier_ones_fragments_is_named_by_apply_and_status(
    cluster, spec_file: Path
) -> None:
    """A new journal whose store already holds fragments (an earlier journal of the name: another
    cluster, or one deleted) refuses appends until reset-head: apply warns at once, and `status` lists
    it with what to do until the reset-head, instead of saying "healthy"."""
    from tests.support.fragments import write_foreign_fragment

    ep = cluster.brokers[0].endpoint
    write_foreign_fragment(cluster, "cli/hello", 0, b"an earlier cluster's line\n", codec="gzip")
    r = await run("journals", "apply", str(spec_file), broker=ep)
    warned = r.stderr.decode()
    assert r.returncode == 0 and r.stdout == b"created cli/hello\n", r
    assert warned.startswith("warning: journal cli/hello: its store") and warned.count("\n") == 1, warned
    assert "fragments to offset 26" in warned and "tidings journals reset-head cli/hello" in warned, warned
    await cluster.wait_consistent("cli/hello", 3)

    async def status() -> dict:
        r = await run("status", "--json", broker=ep)
        assert r.returncode == 0, r
        return json.loads(r.stdout)

    from tests.support.waiting import wait_until

    async def named() -> bool:
        return any("appends refused" in p and "reset-head cli/hello" in p for p in (await status())["problems"])

    await wait_until(named, 30, interval=0.2)
    r = await run("status", broker=ep)
    assert b"appends refused" in r.stdout and b"healthy" not in r.stdout, r
    r = await run("journals", "reset-head", "cli/hello", broker=ep)
    assert r.returncode == 0 and json.loads(r.stdout)["write_head"] == 26

    async def healthy() -> bool:
        return (await status())["problems"] == []

    await wait_until(healthy, 30, interval=0.2)
    r = await run("journals", "apply", str(spec_file), broker=ep)
    assert r.returncode == 0 and r.stdout == b"unchanged cli/hello\n" and r.stderr == b"", r


async def test_publish_json_lines_and_read_them_committed(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    for i in range(2):
        await cluster.create_journal(f"cli/clicks-{i}", 3, labels={"topic": "clicks"})
    lines = b"".join(b'{"user": "u%d", "n": %d}\n' % (i % 7, i) for i in range(50))
    r = await run("publish", "topic=clicks", "--key", "user", broker=ep, stdin=lines + b"\n")
    assert r.returncode == 0, r.stderr
    assert b"published 50 messages to cli/clicks-0, cli/clicks-1" in r.stderr
    got = []
    for i in range(2):
        r = await run("journals", "read", f"cli/clicks-{i}", "--committed", broker=ep)
        assert r.returncode == 0, r.stderr
        msgs = [json.loads(line) for line in r.stdout.splitlines()]
        assert len({m["user"] for m in msgs} & {m["user"] for m in got}) == 0, "a key maps to one journal"
        got.extend(msgs)
    assert sorted(m["n"] for m in got) == list(range(50))
    assert all(len(m["uuid"]) == 36 for m in got)


async def test_publish_bad_line_names_it_and_keeps_what_came_before(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("cli/pub", 3)
    r = await run("publish", "cli/pub", broker=ep, stdin=b'{"n": 1}\n{"n": 2}\nnot json\n{"n": 4}\n')
    assert r.returncode == 1
    assert b"stdin line 3 is not a JSON object" in r.stderr and b"Traceback" not in r.stderr
    assert b"the 2 messages before it were published" in r.stderr
    r = await run("journals", "read", "cli/pub", "--committed", broker=ep)
    assert [json.loads(line)["n"] for line in r.stdout.splitlines()] == [1, 2]
    r = await run("publish", "topic=none", broker=ep, stdin=b'{"n": 1}\n')
    assert r.returncode == 1 and b"no journal matches the selector 'topic=none'" in r.stderr
    r = await run("publish", "cli/pub", broker=ep, stdin=b'{"n": 5}\n')  # (counted in English)
    assert r.returncode == 0 and r.stderr == b"published 1 message to cli/pub\n", r
    r = await run("publish", "cli/pub", broker=ep, stdin=b'{"n": 6}\n[]\n')
    assert r.returncode == 1 and b"; the message before it was published, nothing after it" in r.stderr, r


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_cluster_up_serves_then_sigterm_leaves_nothing_running(tmp_path: Path) -> None:
    import signal

    from tests.support.waiting import wait_until_sync
    from tidings.cluster.etcd import free_port

    port = free_port()
    env = {**os.environ, "TIDINGS_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidings.cli", "cluster", "up", "--brokers", "2", "--zones", "2", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        lines: list[str] = []
        wait_until_sync(lambda: lines.append(proc.stdout.readline()) or "ready" in lines[-1], 60)  # type: ignore[union-attr]
        brokers = [line.split()[1] for line in lines if line.startswith("broker")]
        assert brokers == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
        children = _children(proc.pid)
        assert len(children) == 3, "etcd and two brokers"
        r = tidings("journals", "list", "--json", broker=brokers[1])
        assert r.returncode == 0, r.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_up_on_ipv6_loopback_announces_bracketed_endpoints_and_serves(tmp_path: Path) -> None:
    """`cluster up --listen-host ::1`: etcd and every broker listen there and announce `[::1]:PORT`;
    a journal replicated between them takes an append and reads it back through either broker."""
    import signal

    from tests.support.waiting import wait_until_sync
    from tidings.cluster.etcd import free_port

    port = free_port("::1")
    args = ["cluster", "up", "--brokers", "2", "--port", str(port), "--listen-host", "::1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidings.cli", *args, "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines: list[str] = []
        wait_until_sync(lambda: lines.append(proc.stdout.readline()) or "ready" in lines[-1], 60)  # type: ignore[union-attr]
        brokers = [line.split()[1] for line in lines if line.startswith("broker")]
        assert brokers == [f"[::1]:{port}", f"[::1]:{port + 1}"], lines
        assert next(line.split()[1] for line in lines if line.startswith("etcd")).startswith("[::1]:"), lines
        spec = tmp_path / "v6.yaml"
        spec.write_text("name: v6/j\nreplication: 2\n")
        assert tidings("journals", "apply", str(spec), broker=brokers[0]).returncode == 0
        r = tidings("journals", "append", "v6/j", broker=brokers[1], stdin=b"over ::1\n")
        assert r.returncode == 0, r.stderr
        r = tidings("journals", "read", "v6/j", "--no-block", broker=brokers[0])
        assert r.returncode == 0 and r.stdout == b"over ::1\n", r
        listed = tidings("members", "list", "--json", broker=brokers[0]).stdout
        members = [json.loads(line) for line in listed.splitlines()]
        assert all(m["endpoint"].startswith("[::1]:") for m in members) and len(members) == 2, members
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_runs_the_pipeline_and_checks_it(tmp_path: Path) -> None:
    """`make demo`'s command, shortened: producers, Spark streaming, the sink, the exact check."""
    env = {**os.environ, "TIDINGS_DEMO_TXNS": "10", "TIDINGS_DEMO_PACE": "0.05"}
    r = subprocess.run(
        [sys.executable, "-m", "tidings.cli", "demo", "--data-dir", str(tmp_path / "demo")],
        capture_output=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout.decode()[-3000:] + r.stderr.decode()[-3000:]
    assert b"exactly once" in r.stdout and b"stopped Spark, the brokers and etcd" in r.stdout
