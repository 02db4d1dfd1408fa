"""Review 25: users' mistakes that still reach a traceback (or pass silently) through the `tidings`
command, refused (as test_cli_mistakes.py's are) before anything connects: one line on stderr,
`error: ...`, exit code 2, nothing started. No cluster is needed: nothing listens at TIDINGS_BROKER."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SPECS = {
    # a fragment that is not a mapping: TypeError "'list' object is not a mapping"
    "fragment-list.yaml": "name: a/b\nfragment: [1]\n",
    # labels that are not a mapping: AttributeError "'list' object has no attribute 'items'"
    "labels-list.yaml": "name: a/b\nlabels: [app, shop]\n",
    # YAML's .nan and .inf as durations: ValueError / OverflowError from int()
    "nan.yaml": "name: a/b\nfragment: {refresh_interval: .nan}\n",
    "inf.yaml": "name: a/b\nfragment: {retention: .inf}\n",
}

MISTAKES = [
    pytest.param(("journals", "apply", "{tmp}/fragment-list.yaml"), "fragment", id="fragment-not-a-mapping"),
    pytest.param(("journals", "apply", "{tmp}/labels-list.yaml"), "labels", id="labels-not-a-mapping"),
    pytest.param(("journals", "apply", "{tmp}/nan.yaml"), "refresh_interval", id="duration-nan"),
    pytest.param(("journals", "apply", "{tmp}/inf.yaml"), "retention", id="duration-inf"),
    # a spec file that is not UTF-8 (Latin-1 from an old editor): UnicodeDecodeError
    pytest.param(("journals", "apply", "{tmp}/latin1.yaml"), "latin1.yaml", id="file-not-utf8"),
    # a port of digits str.isdigit() accepts and int() does not: ValueError in the --broker check
    pytest.param(("journals", "list", "--broker", "127.0.0.1:\u00b2"), "is not HOST:PORT", id="broker-superscript"),
    # cluster up's port probe binds past 65535: OverflowError "bind(): port must be 0-65535"
    pytest.param(("cluster", "up", "--brokers", "2", "--port", "65535"), "--port", id="ports-past-65535"),
    pytest.param(("cluster", "up", "--port", "70000"), "--port", id="port-70000"),
    # a negative flush interval is taken silently (it acts as 0: one append per line)
    pytest.param(("publish", "a/b", "--flush-interval", "-1"), "--flush-interval", id="flush-interval-negative"),
]


@pytest.mark.parametrize(("args", "says"), MISTAKES)
def test_review_25_a_mistake_is_one_line_and_exit_code_2(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    for name, text in SPECS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.yaml").write_bytes("name: a/b\nlabels: {owner: Ren\u00e9}\n".encode("latin-1"))
    args = tuple(a.format(tmp=tmp_path) for a in args)
    r = subprocess.run(
        [sys.executable, "-m", "tidings.cli", *args],
        input=b'{"n": 1}\n',
        capture_output=True,
        env={**os.environ, "TIDINGS_BROKER": "127.0.0.1:1"},  # (nothing listens there: never reached)
        cwd=tmp_path,
        timeout=60,
    )
    err = r.stderr.decode(errors="replace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert r.returncode == 2, (r.returncode, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not (tmp_path / "data").exists()  # (cluster up refused before it made anything)
