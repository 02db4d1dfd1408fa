"""Helpers of the Spark tests: ndjson journals of hand-made lines (UUIDs built per case), the CLI's
committed read to check against, and the one-line error a failing Spark call gives."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.support.cluster import create_local_journal
from tidings.client import Client
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, build_uuid, uuid_to_str

NDJSON = {"labels": {"content-type": "application/x-ndjson"}}
P1, P2, P3, P4 = (bytes([0x01, 0, 0, 0, 0, n]) for n in (1, 2, 3, 4))


def ndjson_journal(lc, name: str, content: bytes = b"", replication: int = 1, **fields) -> None:
    """Create an ndjson journal on the cluster (extra `labels` merged in) and append `content` to it."""
    labels = {**NDJSON["labels"], **fields.pop("labels", {})}
    asyncio.run(create_local_journal(lc, name, replication, labels=labels, **fields))
    if content:
        with Client(lc.endpoints[0]) as c:
            c.append(name, content)


def line(producer: bytes, clock: int, flags: int, **fields: object) -> bytes:
    return json.dumps({**fields, "uuid": uuid_to_str(build_uuid(producer, clock, flags))}).encode() + b"\n"


CASES = b"".join(
    [
        line(P1, 1, OUTSIDE_TXN, id=1, name="one"),
        line(P1, 1, OUTSIDE_TXN, id=1, name="one"),  # a duplicate: delivered once
        line(P3, 2, OUTSIDE_TXN, id=7, name="seven"),
        line(P2, 1, CONTINUE_TXN, id=2, name="two"),
        line(P3, 5, CONTINUE_TXN, id=4, name="rolled back"),
        line(P2, 2, CONTINUE_TXN, id=3, name="three"),
        line(P2, 2, ACK_TXN),  # commits ids 2 and 3
        line(P3, 3, ACK_TXN),  # P3 restarted from its checkpoint (clock 3): id 4 rolls back
        line(P4, 1, CONTINUE_TXN, id=5, name="open"),  # never acknowledged: not delivered
        line(P1, 2, OUTSIDE_TXN, id=6, name="six"),
    ]
)


def cli_committed(endpoint: str, journal: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "tidings.cli", "journals", "read", journal, "--committed", "--broker", endpoint],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(x) for x in out.splitlines()]


def error_message(fn) -> str:
    """What `fn()` fails with (it must fail)."""
    with pytest.raises(Exception) as err:
        fn()
    return str(err.value)
