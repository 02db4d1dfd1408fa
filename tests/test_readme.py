"""The README works as written: every command block and Python snippet of README.md, run in order as
a newcomer runs them, in a fresh directory (so a fresh `./data`), on a machine where an earlier
cluster left fragments in the folder the examples once named (/tmp/tidings-fragments).

What a test cannot do as a user does is made explicit: the ports (the README's 8080, 9090, 7000
and etcd's PORT become free ones; `cluster up` takes TIDINGS_PORT, the client commands
TIDINGS_BROKER), the servers a user leaves running in a terminal run in the background until
they print READY, `tail -f` reads a finished file, $EDITOR saves unchanged, `journals delete`
has no terminal to ask on (it refuses, as documented, and the journal stays for what follows),
and the `ID` of `shards unassign` is one of the README's shards. Each command must exit 0 (but
that delete) with no traceback, and the ones whose output the README describes must print it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.waiting import wait_until_sync
from tidings.cluster import free_port
from tidings.cluster.etcd import port_free, stop_process

REPO = Path(__file__).resolve().parent.parent
STALE = Path("/tmp/tidings-fragments/examples/hello")  # where examples/journals.yaml once kept fragments

# Commands a user leaves running (in a terminal of their own, or with &): the line they print when ready.
SERVERS = {"cluster up": "ready", "tidings consumer": "READY", "target serve": "READY", "logplayer run": "READY"}


def blocks(readme: str) -> Iterator[tuple[str, str]]:
    """Each fenced block of the README: its language and text."""
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", readme, re.S | re.M):
        yield m.group(1), m.group(2)


def commands(block: str) -> Iterator[str]:
    """A shell block's commands: continuation lines joined, comments (two spaces and #) dropped."""
    text = re.sub(r"\\\s*(#[^\n]*)?\n\s*", " ", block)
    for line in text.splitlines():
        line = re.sub(r"\s{2,}#.*$", "", line).strip()
        if line and not line.startswith("#"):
            yield line


def _free_run(n: int) -> int:
    """The first of `n` consecutive free ports."""
    for _ in range(100):
        first = free_port()
        if all(port_free(first + i) for i in range(n)):
            return first
    raise AssertionError("no free port range")


class Walk:
    """The README's commands run in `cwd`, background servers kept to stop by PID."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.port = _free_run(3)
        self.subs = {
            "127.0.0.1:8080": f"127.0.0.1:{self.port}",
            "127.0.0.1:9090": f"127.0.0.1:{free_port()}",
            "127.0.0.1:7000": f"127.0.0.1:{free_port()}",
            "shards unassign ID": "shards unassign wc/count/0",
            "tail -f app.log": "cat app.log",
        }
        self.env = {
            **os.environ,
            "TIDINGS_PORT": str(self.port),
            "TIDINGS_BROKER": f"127.0.0.1:{self.port}",
            "EDITOR": "true",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("PYSPARK_PYTHON", None)  # (what a newcomer's shell has: Spark would run the PATH's python3)
        self.servers: list[subprocess.Popen[bytes]] = []
        self.ran: list[str] = []

    def substitute(self, text: str) -> str:
        for old, new in self.subs.items():
            text = text.replace(old, new)
        return text

    def sh(self, line: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        line = self.substitute(line)
        self.ran.append(line)
        server = next((ready for cmd, ready in SERVERS.items() if cmd in line), None)
        if server is not None:
            self.serve(line.removesuffix("&").strip(), server)
            return subprocess.CompletedProcess(line, 0, "", "")
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", line],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def serve(self, line: str, ready: str) -> None:
        if "cluster up" in line and any("cluster up" in " ".join(map(str, p.args)) for p in self.servers):
            return  # (the Consumers section starts the cluster the user already has running)
        log = open(self.cwd / f"server-{len(self.servers)}.log", "w+b")
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {line}"], cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        self.servers.append(proc)

        def up() -> bool:
            said = (self.cwd / log.name).read_text(errors="replace")
            assert proc.poll() is None, f"{line!r} exited with {proc.returncode}: {said[-2000:]}"
            return ready in said

        wait_until_sync(up, 90, interval=0.1)
        if "cluster up" in line:
            said = (self.cwd / log.name).read_text()
            self.subs["127.0.0.1:PORT"] = re.search(r"^etcd\s+(\S+)", said, re.M).group(1)  # type: ignore[union-attr]

    def stop(self) -> None:
        for proc in reversed(self.servers):  # (the cluster last: its clients hand off first)
            stop_process(proc, timeout=60)


def _ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.args, r.stdout[-2000:], r.stderr[-3000:])
    return r


@pytest.fixture
def stale_fragments() -> Iterator[None]:
    """An earlier cluster's fragment of examples/hello in the machine-wide folder (left if it was there)."""
    from tidings.fragment.fragment import Fragment
    from tidings.fragment.store import store_for
    from tidings.protocol import protocol_pb2 as pb

    made = [d for d in (STALE, *STALE.parents) if not d.exists()]  # (what to remove after: only ours)
    content = b'{"greeting": "from an earlier cluster"}\n' * 3
    import hashlib
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        f.write(content)
        f.flush()
        frag = Fragment(journal="examples/hello", begin=0, end=len(content), sum=hashlib.sha1(content).digest(),
                        codec=pb.NONE)  # fmt: skip
        store_for("file:///tmp/tidings-fragments/").persist(frag, f.name)
    try:
        yield
    finally:
        if made:
            import shutil

            shutil.rmtree(made[-1], ignore_errors=True)  # (the outermost folder this test created)


def test_every_readme_block_runs_as_written(tmp_path: Path, stale_fragments: None) -> None:
    readme = (REPO / "README.md").read_text()
    cwd = tmp_path / "newcomer"
    cwd.mkdir()
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    (cwd / "examples").symlink_to(REPO / "examples")
    (cwd / "app.log").write_text('{"user": "cat"}\nnot json\n')
    walk = Walk(cwd)
    prose = re.search(r"`(targets: \[\{id: shard-0, endpoint: 127.0.0.1:7000\}), \.\.\.\]`", readme)
    assert prose, "the README's targets.yaml"
    (cwd / "targets.yaml").write_text(walk.substitute(prose.group(1)) + "]\n")  # (its first target: one serves)
    try:
        found = list(blocks(readme))
        assert [lang for lang, _ in found].count("python") >= 2, "the README's Python snippets"
        for lang, text in found:
            if lang == "python":
                script = cwd / "snippet.py"
                script.write_text(walk.substitute(text))
                r = _ok(walk.sh(f".venv/bin/python {script.name}", timeout=600))
                if "tidings.spark" in text:  # the rows Spark read, committed: ann and bob once each
                    assert re.search(r"\|\s*examples/hello\s*\|\s*\d+\s*\|\s*ann\s*\|", r.stdout), r.stdout
                    assert r.stdout.count("| ann") == 1 and r.stdout.count("| bob") == 1, r.stdout
                else:
                    assert "{'n': 1, 'uuid'" in r.stdout and "{'n': 2, 'uuid'" in r.stdout, r.stdout
                continue
            for line in commands(text):
                if line.startswith("make "):
                    continue  # (the two commands: `make test` runs this very test; tests/cli/test_cli.py runs the demo)
                _check(walk, line)
    finally:
        walk.stop()


def _check(walk: Walk, line: str) -> None:
    """Run one README command and check what the README says it does."""
    if "journals delete" in line:
        r = walk.sh(line)
        assert r.returncode == 2 and "needs --yes" in r.stderr, r  # (asks first: no terminal here)
        return
    if "journals read wc/counts" in line:  # (the shards count the line as it comes: read until they did)

        def counted() -> bool:
            r = _ok(walk.sh(line))
            seen = [json.loads(m) for m in r.stdout.splitlines()]
            return {"word": "be", "n": 2} in [{"word": m["word"], "n": m["n"]} for m in seen]

        wait_until_sync(counted, 60, interval=0.5)
        return
    r = _ok(walk.sh(line))
    if "journals apply examples/journals.yaml" in line:
        assert r.stdout == "created examples/hello\n" and r.stderr == "", r  # (no earlier cluster's fragments)
    elif line.endswith("journals append examples/hello"):
        assert json.loads(r.stdout)["begin"] == 0, r.stdout
    elif line.endswith("journals read examples/hello"):
        assert r.stdout == '{"greeting": "hello"}\n', r.stdout
    elif "cat app.log" in line:
        assert "skipped stdin line 2" in r.stderr and "published 1 message" in r.stderr, r.stderr
    elif line.endswith("journals read examples/hello --committed"):
        assert [json.loads(m).get("user") for m in r.stdout.splitlines()] == [None, "ann", "bob", "cat"], r.stdout
    elif "apply specs.yaml" in line:
        assert "unchanged examples/hello" in r.stdout, r.stdout
    elif "journals edit" in line:
        assert r.stdout == "no changes\n", r.stdout
    elif "targets status" in line:
        assert "shard-0" in r.stdout and "yes" in r.stdout, r.stdout
    elif line.endswith("tidings status"):
        assert "healthy" in r.stdout, r.stdout
    elif "-m examples.wordcount" in line:
        assert "counted exactly once" in r.stdout, r.stdout
    elif "-m examples.stream_sum" in line:
        assert "summed exactly once" in r.stdout, r.stdout
