"""`tidings demo` / `make demo`: the main job on embedded defaults."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import uvloop
from rich.console import Console

from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict


def run_demo(data_dir: Path, out: Console) -> None:
    shutil.rmtree(data_dir, ignore_errors=True)
    t0 = time.monotonic()
    with LocalCluster(brokers=3, zones=3, data_dir=data_dir) as lc:
        out.print(f"started etcd at {lc.etcd_endpoint} and 3 brokers: {', '.join(lc.endpoints)}")
        uvloop.run(_exercise(lc, out))
    out.print(f"stopped every process; done in {time.monotonic() - t0:.1f}s")


async def _exercise(lc: LocalCluster, out: Console) -> None:
    spec = spec_from_dict(
        {
            "name": "demo/greetings",
            "replication": 3,
            "labels": {"app": "demo"},
            "fragment": {"length": "1MiB", "compression_codec": "zstd", "stores": [lc.store_url]},
        }
    )
    async with AsyncClient(lc.endpoints[0]) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        out.print("created journal demo/greetings (replication 3, zstd fragments)")
        lines = [f"hello #{i} from tidings\n".encode() for i in range(5)]
        for line in lines:
            r = await c.append("demo/greetings", line)
            out.print(f"appended {len(line)} bytes at [{r.begin}, {r.end})")
        journal = (await c.list()).journals[0]
        members = [f"{m.zone}/{m.suffix}" for m in journal.route.members]
        out.print(f"route: primary {members[journal.route.primary]}, replicas {members}")
        for ep in lc.endpoints:
            async with AsyncClient(ep) as peer:
                data = await peer.read_all("demo/greetings")
            assert data == b"".join(lines), f"read back from {ep} differs"
            out.print(f"read {len(data)} bytes back through {ep}: identical")
        out.print(data.decode().rstrip())
