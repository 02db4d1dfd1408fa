"""`tidings shards ...` as a user runs it: against child broker processes and a `tidings consumer` child
serving examples.wordcount. Apply (dry run, then for real), list (table, --json, --selector, --yaml),
edit through $EDITOR, unassign (--failed, --dry-run), delete through YAML; and the usual mistakes (a
missing file, a shard that does not exist, an unreachable consumer) answer with one line and a non-zero
exit, no traceback."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from examples._consumers import create, start_consumer
from examples.wordcount import journal_specs, publish_lines

from tests.support.waiting import wait_until_sync
from tidings.cluster import LocalCluster

SHARDS = """\
shards:
  - id: cl/split/0
    sources: [cl/lines/part-0]
    labels: {stage: split, prefix: cl, parts: "1"}
  - id: cl/count/0
    sources: [cl/words/part-0]
    labels: {stage: count, prefix: cl, parts: "1"}
"""


def shards(
    *args: str, consumer: str, broker: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "TIDINGS_CONSUMER": consumer, **({"TIDINGS_BROKER": broker} if broker else {}), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tidings.cli", "shards", *args], capture_output=True, text=True, env=env, timeout=60
    )


def one_line_error(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == code, (r.returncode, r.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


@pytest.fixture
def served(local_cluster: LocalCluster, etcd_root: str, tmp_path: Path):
    """The word-count journals on the child brokers and one consumer child; yields (consumer, broker)."""
    broker = local_cluster.brokers[0].endpoint
    assert local_cluster.etcd_endpoint is not None
    (tmp_path / "c").mkdir()
    proc, endpoint = start_consumer("examples.wordcount:WordCount", local_cluster.etcd_endpoint, broker,
                                    etcd_root + "-consumer", tmp_path / "c" / "shards", "c0", "local")  # fmt: skip
    try:
        asyncio.run(create(broker, endpoint, journal_specs("cl", 1, 1), []))
        yield endpoint, broker
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def listed(consumer: str, broker: str, *args: str) -> dict[str, dict]:
    r = shards("list", "--json", *args, consumer=consumer, broker=broker)
    assert r.returncode == 0, r.stderr
    return {row["id"]: row for row in map(json.loads, r.stdout.splitlines())}


def test_shards_commands_as_a_user_runs_them(served, tmp_path: Path) -> None:
    consumer, broker = served
    f = tmp_path / "shards.yaml"
    f.write_text(SHARDS)

    r = shards("apply", str(f), "--dry-run", consumer=consumer)
    assert r.returncode == 0 and "created cl/split/0" in r.stdout and "dry run: nothing applied" in r.stdout, r
    assert listed(consumer, broker) == {}
    r = shards("apply", str(f), consumer=consumer)
    assert r.returncode == 0 and "created cl/split/0" in r.stdout and "created cl/count/0" in r.stdout, r
    assert "unchanged cl/count/0" in shards("apply", str(f), consumer=consumer).stdout

    asyncio.run(publish_lines(broker, "cl", 1, 100, seed=3))

    def caught_up() -> dict[str, dict] | None:
        rows = listed(consumer, broker)
        done = all(
            row["status"] == {"local/c0": "PRIMARY"} and row["read_through"] and not any(row["lag"].values())
            for row in rows.values()
        )
        return rows if len(rows) == 2 and done else None

    rows = wait_until_sync(caught_up, 60, interval=0.2)
    assert rows["cl/count/0"]["primary"] == "local/c0" and rows["cl/count/0"]["read_through"]["cl/words/part-0"] > 0

    table = shards("list", consumer=consumer, broker=broker)
    assert table.returncode == 0 and "cl/split/0" in table.stdout and "local/c0:PRIMARY" in table.stdout, table
    assert set(listed(consumer, broker, "--selector", "stage=count")) == {"cl/count/0"}
    as_yaml = shards("list", "--yaml", consumer=consumer)
    assert as_yaml.returncode == 0 and "max_txn_duration: 1s" in as_yaml.stdout and "status" not in as_yaml.stdout

    edit = tmp_path / "edit.sh"  # an $EDITOR that changes the transaction's longest duration
    edit.write_text("#!/bin/sh\nsed -i 's/max_txn_duration: 1s/max_txn_duration: 2s/' \"$1\"\n")
    edit.chmod(0o755)
    r = shards("edit", "cl/count/0", consumer=consumer, env={"EDITOR": shlex.quote(str(edit)), "VISUAL": ""})
    assert r.returncode == 0 and "updated cl/count/0: max_txn_duration '1s' -> '2s'" in r.stdout, r
    assert listed(consumer, broker)["cl/count/0"]["max_txn_duration"] == "2s"

    assert "nothing to unassign" in shards("unassign", "cl/count/0", "--failed", consumer=consumer).stdout
    assert "would unassign cl/count/0" in shards("unassign", "cl/count/0", "--dry-run", consumer=consumer).stdout

    f.write_text("shards:\n  - id: cl/split/0\n    delete: true\n")
    r = shards("apply", str(f), consumer=consumer)
    assert r.returncode == 0 and "deleted cl/split/0" in r.stdout, r
    assert set(listed(consumer, broker)) == {"cl/count/0"}

    # The usual mistakes: one line each, no traceback.
    one_line_error(shards("apply", str(f), consumer=consumer), 1, "cl/split/0", "does not exist")
    one_line_error(shards("apply", str(tmp_path / "missing.yaml"), consumer=consumer), 2, "missing.yaml")
    one_line_error(shards("edit", "cl/nope", consumer=consumer, env={"EDITOR": "true"}), 1, "cl/nope")
    one_line_error(shards("list", consumer="127.0.0.1:1"), 1, "127.0.0.1:1")


def test_shards_commands_say_when_no_consumer_answers(etcd) -> None:
    """After the consumers stop (or given a wrong --consumer), one line says no consumer answers
    there; etcd's port (gRPC, but no Shard service) is named as not a consumer."""
    from tidings.cluster import free_port

    nobody = f"127.0.0.1:{free_port()}"
    one_line_error(shards("list", consumer=nobody), 1, f"no consumer answers at {nobody}")
    one_line_error(shards("list", consumer=etcd.endpoint), 1, f"{etcd.endpoint} is not a tidings consumer")
