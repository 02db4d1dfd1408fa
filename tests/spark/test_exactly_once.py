"""Exactly once through Spark: a streaming job (journals -> Structured Streaming -> the tidings sink)
whose driver is killed -9 again and again (at random points, and right after the sink wrote a
batch's ACKs but before Spark's commit log) while transactional producers write, with duplicates,
abandoned attempts and rolled-back transactions (the producers of tests/message/test_exactly_once.py, also
killed at planned points). The sink journal, read committed, must hold every committed input
message exactly once, and nothing of an abandoned attempt.

TIDINGS_SPARK_KILLS sets how many times the driver is killed at random (default 1, besides the two
planned deaths; each restart costs a Spark driver's start, ~30 s here); TIDINGS_EO_TXNS the
transactions per producer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.cluster import create_local_journal
from tests.support.producer import transaction_size
from tests.support.producers import TXNS, Producer
from tests.support.waiting import wait_until_sync
from tidings.client import Client
from tidings.cluster import LocalCluster
from tidings.message import read_committed

KILLS = int(os.environ.get("TIDINGS_SPARK_KILLS", "1"))
DIE_AFTER_ACKS = "4,9"  # batches after whose ACKs the job kills itself, before Spark's commit log
ROOT = Path(__file__).resolve().parents[2]
SINK = "spark/eo-sink"


class Job:
    """The driver process (and its JVM, in the same process group), killed and started by PID."""

    def __init__(self, lc: LocalCluster, checkpoint: Path, log: Path) -> None:
        self.lc, self.checkpoint, self.log = lc, checkpoint, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "tests.support.spark_job", "--broker", self.lc.endpoints[0],
               "--selector", "topic=eo", "--sink", SINK, "--checkpoint", str(self.checkpoint)]  # fmt: skip
        env = {**os.environ, "TIDINGS_TEST_DIE_AFTER_ACKS": DIE_AFTER_ACKS}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, start_new_session=True, env=env
            )
        self.starts += 1
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().startswith(b"STARTED"), f"the job did not start; see {self.log}"

    def poll(self) -> None:
        """Restart the job after it killed itself as planned."""
        if self.proc is not None and self.proc.poll() is not None:
            assert self.proc.returncode == -signal.SIGKILL, f"the job failed; see {self.log}"
            self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the driver and its JVM
            self.proc.wait()


def sink_head(lc: LocalCluster) -> int:
    with Client(lc.endpoints[0]) as c:
        return c.write_head(SINK)


@pytest.mark.timeout(300 + 60 * KILLS)  # (its waits are bounded by conditions; this only stops a hang)
def test_a_streaming_job_killed_again_and_again_writes_each_committed_message_once(
    spark, local_cluster: LocalCluster, tmp_path: Path
) -> None:
    lc = local_cluster
    labels = {"topic": "eo", "content-type": "application/x-ndjson"}
    for name in ("eo/events-0", "eo/events-1"):
        asyncio.run(create_local_journal(lc, name, labels=labels))
    asyncio.run(create_local_journal(lc, SINK, labels={"content-type": "application/x-ndjson"}))
    rng = random.Random(int(os.environ.get("TIDINGS_CAMPAIGN_SEED", "20261123")))
    producers = [Producer(i, lc, tmp_path / f"producer-{i}.json") for i in range(4)]
    job = Job(lc, tmp_path / "checkpoint", tmp_path / "job.log")
    try:
        for p in producers:
            p.start()
        job.start()

        def sink_reaches(offset: int) -> bool:
            job.poll()
            for p in producers:
                p.poll()  # (restart a producer or the job after a planned death)
            return sink_head(lc) >= offset or all(p.done for p in producers)

        for _ in range(KILLS):  # kill the driver at a random point once the sink moved on since its start
            target = sink_head(lc) + rng.randrange(1, 4000)
            wait_until_sync(lambda target=target: sink_reaches(target), 120, interval=0.01)
            job.kill()
            job.start()
        wait_until_sync(lambda: sink_reaches(1 << 62), 180, interval=0.05)  # (until every producer is done)
        expected = {(p, t, i) for p in range(4) for t in range(TXNS) for i in range(transaction_size(p, t))}

        def delivered() -> list[dict]:
            with Client(lc.endpoints[0]) as c:
                return [env.message for env in read_committed(c, SINK, block=False)]

        def all_delivered() -> bool:
            job.poll()
            return len(delivered()) >= len(expected)

        wait_until_sync(all_delivered, 180, interval=0.5)
    finally:
        job.kill()
        for p in producers:
            p.stop()

    out = delivered()
    seen = Counter((m["p"], m["txn"], m["i"]) for m in out)
    planned = len(list((tmp_path / "checkpoint").glob("died-after-acks-*")))
    assert planned == len(DIE_AFTER_ACKS.split(",")) and job.starts == KILLS + planned + 1
    assert set(seen) == expected, "every committed input message reached the sink"
    assert all(n == 1 for n in seen.values()), "exactly once"
    for m in out:
        committed = json.loads(producers[m["p"]].state.read_text())["committed"]
        assert m["attempt"] == committed[str(m["txn"])], f"a message of an abandoned attempt was delivered: {m}"
