#!/usr/bin/env python3
"""Append quotas: a journal limited by `max_append_rate` takes about its rate while a neighbour on the
same brokers keeps its own.

A LocalCluster (etcd + 3 brokers, R=3). For --seconds, one writer appends 64 KiB chunks as fast as it
can to `bench/limited` (max_append_rate --rate) and another to `bench/free` (no limit); then the free
journal alone for as long. Prints JSON lines:

  quota_limited   bytes/s the limited journal took (aim: --rate, plus its one-second burst)
  quota_free      bytes/s of the free journal beside it, and alone (aim: about the same)

  bench/quota.py --rate 1048576 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from _common import emit, run

from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict

CHUNK = bytes(range(256)) * 256  # 64 KiB


async def writer(c: AsyncClient, journal: str, until: float) -> int:
    written = 0
    while time.monotonic() < until:
        await c.append(journal, CHUNK)
        written += len(CHUNK)
    return written


async def bench(lc: LocalCluster, args: argparse.Namespace) -> None:
    async with AsyncClient(lc.brokers[0].endpoint) as c:
        specs = [
            spec_from_dict({"name": "bench/limited", "replication": 3, "max_append_rate": args.rate}),
            spec_from_dict({"name": "bench/free", "replication": 3}),
        ]
        await c.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
        for s in specs:
            await c.append(s.name, b"")  # (a zero-byte barrier: the journal takes appends)
        t0 = time.monotonic()
        limited, free = await asyncio.gather(
            writer(c, "bench/limited", t0 + args.seconds), writer(c, "bench/free", t0 + args.seconds)
        )
        took = time.monotonic() - t0
        t1 = time.monotonic()
        alone = await writer(c, "bench/free", t1 + args.seconds)
        alone_took = time.monotonic() - t1
    emit({"test": "quota_limited", "limit_bytes_per_s": args.rate, "bytes_per_s": round(limited / took),
          "seconds": round(took, 2)})  # fmt: skip
    emit({"test": "quota_free", "beside_limited_bytes_per_s": round(free / took),
          "alone_bytes_per_s": round(alone / alone_took)})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=1 << 20, help="bytes/s of the limited journal")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidings-bench-quota-") as work:
        lc = LocalCluster(brokers=3, zones=3, data_dir=work)
        try:
            lc.start()
            run(bench(lc, args))
        finally:
            lc.stop()


if __name__ == "__main__":
    main()
