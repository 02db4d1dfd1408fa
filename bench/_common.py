"""What the benchmark scripts share: journals on a LocalCluster, JSON lines, the event loop."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import Any

import uvloop

from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict


def emit(rec: dict, **defaults: Any) -> dict:
    """Print one measurement as a JSON line (the peers' harness uses the same fields)."""
    rec = {"system": "tidings", **defaults, **rec}
    print(json.dumps(rec), flush=True)
    return rec


async def create_journal(
    c: AsyncClient, lc: LocalCluster, name: str, replication: int, labels: dict[str, str] | None = None
) -> None:
    """Create a journal with 256 MiB fragments and return once it takes appends."""
    spec = spec_from_dict(
        {
            "name": name,
            "replication": replication,
            "labels": labels or {},
            "fragment": {"length": "256MiB", "stores": [lc.store_url]},
        }
    )
    await c.apply([pb.ApplyRequest.Change(upsert=spec)])
    await c.append(name, b"")  # a zero-byte barrier: retried until the journal has its primary


async def primary_endpoint(c: AsyncClient, name: str) -> str:
    j = next(j for j in (await c.list()).journals if j.spec.name == name)
    return j.route.endpoints[j.route.primary]


def run(main: Coroutine[Any, Any, None]) -> None:
    uvloop.run(main)
