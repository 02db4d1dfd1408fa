"""The wheel installs and runs as an operator gets it (docs/design/production.md §3.14, docs/deploy.md):
`pip wheel . --no-deps` builds it with its package data (the .proto files, py.typed, Spark's lookup
module, the `tidings` entry point); a fresh virtualenv installs it with its dependencies from the
package index by deploy/Containerfile's own command; and from outside the source tree the installed
`tidings` prints its version and help, runs `cluster up` with one broker, creates a journal, appends
to it and reads it back, and stops on SIGTERM leaving nothing running.

The dependencies come from the package index (pip's cache makes a rerun take well under a minute):
where pip reports the index unreachable, the test is skipped saying so; any other pip failure fails.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.waiting import gone, wait_until_sync
from tidings.cluster import free_port
from tidings.cluster.etcd import die_with_parent, stop_process

REPO = Path(__file__).resolve().parent.parent

# deploy/Containerfile's install step, word for word (tests/test_deploy.py checks the file has it):
# the wheel and its S3 extra, the dependencies from the package index.
INSTALL = 'pip install "${wheel}[s3]"'

# What pip prints when it cannot reach the package index (urllib3's and the resolver's words); only these
# make the test a skip.
UNREACHABLE = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "No route to host",
    "Connection timed out",
    "Read timed out",
    "ProxyError",
)


def install_argv(pip: Path, wheel: Path) -> list[str]:
    """INSTALL for `wheel`, run by the virtualenv's `pip`."""
    words = shlex.split(INSTALL.replace("${wheel}", str(wheel)))
    assert words[0] == "pip"
    return [str(pip), *words[1:]]


def _pip(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a pip command; skip the test if pip could not reach the package index, fail on anything else."""
    r = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if r.returncode != 0:
        said = r.stdout + r.stderr
        cause = next((u for u in UNREACHABLE if u in said), None)
        if cause is not None:
            what = next((a for a in argv if a in ("wheel", "install", "download")), "pip")
            pytest.skip(f"`pip {what}` could not reach the package index for the dependencies ({cause})")
        pytest.fail(f"`{' '.join(argv)}` exited {r.returncode}:\n{said[-4000:]}")
    return r


def _clean_env() -> dict[str, str]:
    """This process's environment without what would let the installed command see the source tree or this
    virtualenv (PYTHONPATH, VIRTUAL_ENV, the user's site), nor a tidings setting of the developer's; pip's
    configuration and cache stay as the user has them."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TIDINGS_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(900)
def test_the_wheel_installs_in_a_fresh_virtualenv_and_its_command_runs_a_cluster(tmp_path: Path) -> None:
    # The source tree copied, so that building leaves nothing in the repository (setuptools writes build/
    # and an .egg-info beside the sources); the copy holds what pyproject.toml names.
    source = tmp_path / "source"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    elsewhere = tmp_path / "elsewhere"  # (where every installed command runs: no src/ there)
    elsewhere.mkdir()
    env = _clean_env()

    dist = tmp_path / "dist"
    _pip([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(dist)], source, env, timeout=240)
    (wheel,) = dist.glob("tidings-*.whl")
    version = wheel.name.split("-")[1]
    names = set(zipfile.ZipFile(wheel).namelist())
    protos = {str(p.relative_to(REPO / "src")) for p in (REPO / "src" / "tidings").rglob("*.proto")}
    assert protos and protos <= names, f"the wheel lacks {sorted(protos - names)}"
    assert "tidings/py.typed" in names and "pyspark_tidings/__init__.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "tidings = tidings.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=120)
    _pip(install_argv(venv / "bin" / "pip", wheel), elsewhere, env, timeout=420)
    python, tidings = venv / "bin" / "python", venv / "bin" / "tidings"

    def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        r = subprocess.run([str(tidings), *args], cwd=elsewhere, env=env, input=stdin, capture_output=True, timeout=60)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, (args, r.stdout[-2000:], r.stderr[-3000:])
        return r

    where = subprocess.run(
        [str(python), "-c", "import tidings; print(tidings.__file__)"], cwd=elsewhere, env=env, capture_output=True,
        text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(venv), f"the virtualenv imports tidings from {where}"
    assert run("--version").stdout.decode() == f"tidings {version}\n"
    said = run("--help").stdout.decode()
    assert all(re.search(rf"^\s+{c}\s", said, re.M) for c in ("broker", "cluster", "journals", "auth")), said

    port = free_port()
    broker = f"127.0.0.1:{port}"
    log = tmp_path / "cluster.log"
    argv, preexec = die_with_parent(
        [str(tidings), "cluster", "up", "--brokers", "1", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=elsewhere, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=preexec,
        )  # fmt: skip
    children: list[int] = []
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"cluster up exited with {proc.returncode}: {log.read_text()[-3000:]}"
            return "ready" in log.read_text()

        wait_until_sync(ready, 90, interval=0.1)
        children = _children(proc.pid)
        assert len(children) == 2, f"etcd and one broker: {children}"
        spec = elsewhere / "hello.yaml"
        spec.write_text("name: wheel/hello\nreplication: 1\n")
        assert run("journals", "apply", str(spec), "--broker", broker).stdout == b"created wheel/hello\n"
        appended = json.loads(run("journals", "append", "wheel/hello", "--broker", broker, stdin=b"installed\n").stdout)
        assert (appended["begin"], appended["end"]) == (0, 10), appended
        assert run("journals", "read", "wheel/hello", "--no-block", "--broker", broker).stdout == b"installed\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        wait_until_sync(lambda: all(gone(pid) for pid in children), 30, interval=0.1)
    finally:
        stop_process(proc, timeout=60)  # (SIGTERM, then SIGKILL: only if the test failed before its own stop)
        for pid in children:  # (the cluster's etcd and broker, by the PIDs we saw; normally gone already)
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
