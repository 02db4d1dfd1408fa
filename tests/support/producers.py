"""The transactional producers (`tests/support/producer.py`) as child processes, restarted after a
SIGKILL from their last checkpoint. TIDINGS_EO_TXNS sets the transactions per producer (default 12)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tidings.cluster import LocalCluster

TXNS = int(os.environ.get("TIDINGS_EO_TXNS", "12"))
PLANS = {0: ["2:mid", "6:checkpointed"], 1: ["3:acked", "7:mid"], 2: ["4:checkpointed"], 3: []}
ROOT = Path(__file__).resolve().parents[2]


class Producer:
    def __init__(self, index: int, lc: LocalCluster, state: Path) -> None:
        self.index, self.lc, self.state = index, lc, state
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.done = False

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tests.support.producer",
            "--broker",
            self.lc.endpoints[-1],
            "--selector",
            "topic=eo",
            "--index",
            str(self.index),
            "--txns",
            str(TXNS),
            "--state",
            str(self.state),
        ]
        for die in PLANS[self.index]:
            cmd += ["--die-at", die]
        self.starts += 1
        log = open(self.state.with_suffix(".log"), "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        log.close()

    def poll(self) -> None:
        """Restart after a SIGKILL; note a clean exit."""
        if self.done or self.proc is None or self.proc.poll() is None:
            return
        out = self.proc.stdout.read() if self.proc.stdout else b""
        assert self.proc.returncode in (0, -signal.SIGKILL), f"producer {self.index} failed; see {self.state}.log"
        if self.proc.returncode == 0:
            assert b"DONE" in out
            self.done = True
        else:
            self.start()

    def next_txn(self) -> int:
        try:
            return json.loads(self.state.read_text())["next_txn"]
        except (OSError, ValueError):
            return 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
