"""Client commands carry their token to brokers holding keys (`--auth-token`, `--auth-token-file`,
TIDINGS_AUTH_TOKEN), and a refusal is one line with exit code 1; `cluster up` hands its keys to its
brokers through their environment, so no key is on a command line `ps` shows."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.cli._support import run, tidings
from tests.support.waiting import wait_until_sync
from tidings.auth import KeySet

KEY = bytes(range(32))
B64 = base64.b64encode(KEY).decode()
OTHER = base64.b64encode(b"o" * 32).decode()
NO_ENV = {
    "TIDINGS_AUTH_KEYS": "",
    "TIDINGS_AUTH_KEYS_FILE": "",
    "TIDINGS_AUTH_TOKEN": "",
    "TIDINGS_AUTH_TOKEN_FILE": "",
}


async def _sign(*args: str, key: str = B64) -> str:
    r = await run("auth", "token", *args, env={**NO_ENV, "TIDINGS_AUTH_KEYS": key})
    assert r.returncode == 0, r
    return r.stdout.decode().strip()


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = [line for line in r.stderr.decode().splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in lines[0], r
    return lines[0]


async def test_client_commands_carry_their_token_and_a_refusal_is_one_line(brokers: Any, tmp_path: Path) -> None:
    tc = await brokers(auth_keys=KeySet.parse(B64))
    await tc.add_broker("zone-a")
    await tc.create_journal("cli-auth/a", 1, labels={"app": "a"})
    endpoint = tc.brokers[0].endpoint
    writer = await _sign("-c", "APPEND,READ", "--selector", "app=a", "--subject", "ci")
    r = await run("journals", "append", "cli-auth/a", "--auth-token", writer, broker=endpoint, stdin=b"hello\n",
                  env=NO_ENV)  # fmt: skip
    assert r.returncode == 0, r
    (tmp_path / "token").write_text(writer + "\n")  # (as `tidings auth token > token` writes it)
    r = await run("journals", "read", "cli-auth/a", "--no-block", "--auth-token-file", str(tmp_path / "token"),
                  broker=endpoint, env=NO_ENV)  # fmt: skip
    assert r.returncode == 0 and r.stdout == b"hello\n", r
    lister = await _sign("-c", "LIST")
    r = await run("journals", "list", broker=endpoint, env={**NO_ENV, "TIDINGS_AUTH_TOKEN": lister})
    assert r.returncode == 0 and b"cli-auth/a" in r.stdout, r

    foreign = await _sign("-c", "ALL", key=OTHER)
    reader = await _sign("-c", "READ")
    said = {}
    for name, token in (("foreign", foreign), ("reader", reader)):
        r = await run(
            "journals", "append", "cli-auth/a", "--auth-token", token, broker=endpoint, stdin=b"no\n", env=NO_ENV
        )
        said[name] = _one_line(r)
    said["none"] = _one_line(await run("journals", "list", broker=endpoint, env=NO_ENV))
    assert said["foreign"].startswith(f"error: UNAUTHENTICATED from {endpoint}: token signature does not verify")
    assert said["reader"] == f"error: NOT_ALLOWED from {endpoint}: token lacks the APPEND capability (it has READ)"
    assert said["none"] == f"error: UNAUTHENTICATED from {endpoint}: no token: pass --auth-token (TIDINGS_AUTH_TOKEN)"
    assert not any(t in line for line in said.values() for t in (writer, foreign, reader))
    async with tc.client() as c:
        assert await c.read_all("cli-auth/a") == b"hello\n"  # (the refused appends wrote nothing)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_cluster_up_gives_its_brokers_the_keys_in_their_environment(tmp_path: Path) -> None:
    from tidings.cluster.etcd import free_port

    keys = tmp_path / "keys"
    keys.write_text(f"{B64}\n")
    port = free_port()
    args = ["cluster", "up", "--brokers", "1", "--port", str(port), "--auth-keys-file", str(keys)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidings.cli", *args, "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **NO_ENV},
    )
    try:
        lines: list[str] = []
        wait_until_sync(lambda: lines.append(proc.stdout.readline()) or "ready" in lines[-1], 60)  # type: ignore[union-attr]
        assert any(line.startswith("auth     on") for line in lines), lines
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        broker = next(int(p) for p in children.stdout.split() if " broker " in _cmdline(int(p)))
        assert B64 not in _cmdline(broker) and str(keys) not in _cmdline(broker)
        assert f"TIDINGS_AUTH_KEYS={B64}".encode() in Path(f"/proc/{broker}/environ").read_bytes().split(b"\0")
        endpoint = f"127.0.0.1:{port}"
        assert "UNAUTHENTICATED" in _one_line(tidings("journals", "list", broker=endpoint, env=NO_ENV))
        token = tidings("auth", "token", "-c", "LIST", "--auth-keys-file", str(keys), env=NO_ENV).stdout.decode()
        r = tidings("journals", "list", "--auth-token", token.strip(), broker=endpoint, env=NO_ENV)
        assert r.returncode == 0, r
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
