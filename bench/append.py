#!/usr/bin/env python3
"""Append benchmark against a local cluster (etcd + 3 broker processes on loopback).

Prints one JSON line per measurement (same fields as ../shared/peers/nats/bench_nats.py:
system, replicas, test, payload_bytes, median_us, p99_us, msgs_per_s, mb_per_s) and a table.
MB = 10^6 payload bytes.

First, once, the floor (replicas 0): the same sequential and pipelined 1 KiB loops against a no-op
gRPC server (bench/_floor.py: a child process, grpc.aio on uvloop with the broker's server options,
whose Append only reads its stream and answers OK). `append_floor` and `append_floor_sync` also give
CPU per append of the server process (`server_cpu_us`, /proc utime+stime) and of this client process
(`client_cpu_us`, process_time), both on this machine's shared cores.

  bench/append.py                       # everything: the floor, then R=1 and R=3
  bench/append.py --replicas 3 --seconds 3 --big-mib 256
  bench/append.py --only-floor          # the floor alone, a few seconds, no cluster
  bench/append.py --tls --replicas 3 --no-floor --big-mib 64   # the same on plaintext and mutual TLS + tokens
  bench/append.py --tls-slices 10                               # what TLS and tokens cost, interleaved (~3 min)

`--transport tidings grpc` runs the cluster's measurements once per client transport on the same cluster
(the native data port, then gRPC), each line naming its `transport`; the default is the clients'
default (TIDINGS_TRANSPORT, else tidings).

With `--tls` the cluster's measurements run twice in one run, on a plaintext cluster and then on one
serving mutual TLS (gRPC and the replication port; a CA and certificates made for the run with
trustme) whose brokers verify capability tokens, and the last lines give what TLS + tokens cost
against the issue's budgets: `tls_overhead_pct` of the R=3 pipelined 64 KiB MB/s (at most 15%) and
`tls_extra_median_us` of the R=3 sequential 1 KiB median (at most 100 us).

On this 2-core VM one cluster's figures drift by more than those budgets from one minute to the next,
so `--tls-slices N` measures the cost differently: it starts four R=3 clusters at once (plaintext;
mutual TLS with tokens; TLS alone; tokens alone, each of the last two being real flags), then gives
each in turn a slice (300 sequential 1 KiB appends, 1.5 s of pipelined 64 KiB appends), N times,
alternating the order. Every cluster is measured within seconds of the others, many times; it prints
each configuration's pooled 1 KiB median, median MB/s and CPU per append (all processes), and their
cost against plaintext (`tls_slices_cost`). An idle cluster costs under 1% of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from _ab import main_if_requested
from _common import cpu_seconds, create_journal, emit, primary_endpoint, rss_kib, run
from _floor import floor_server

from tidings.auth import KeyedAuthorizer, KeySet, generate_key
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.tls import TLS, load

KiB, MiB, MB = 1024, 1024 * 1024, 1_000_000
CLIENT_TLS: TLS | None = None  # the run's client TLS (--tls, the second pass)
CLIENT_AUTH: KeyedAuthorizer | None = None  # and its tokens, signed with the brokers' keys
CLIENT_TRANSPORT = "tidings"  # the pass's client transport (--transport)


def client(endpoint: str) -> AsyncClient:
    return AsyncClient(endpoint, tls=CLIENT_TLS, auth=CLIENT_AUTH, transport=CLIENT_TRANSPORT)


def journal(name: str) -> str:
    """A measurement's journal, one per client transport (each pass starts on a journal of its own)."""
    return name if CLIENT_TRANSPORT == "tidings" else f"{name}-{CLIENT_TRANSPORT}"


async def sequential_loop(c: AsyncClient, name: str, body: bytes, count: int) -> list[float]:
    """Seconds per append of `count` appends made one at a time (after 200 not timed), sorted."""
    for _ in range(200):
        await c.append(name, body)
    lat = []
    for _ in range(count):
        t = time.perf_counter()
        await c.append(name, body)
        lat.append(time.perf_counter() - t)
    lat.sort()
    return lat


class CpuPerAppend:
    """CPU seconds spent during a measurement by the primary broker, the other brokers (summed) and
    this client process (all threads; /proc and process_time), as microseconds per append: where
    the time of an append goes, on a machine whose cores they all share."""

    def __init__(self, lc, primary: str) -> None:
        self.primary = next(b.pid for b in lc.brokers if b.endpoint == primary)
        self.others = [b.pid for b in lc.brokers if b.pid != self.primary]

    def _sample(self) -> tuple[float, float, float]:
        return cpu_seconds(self.primary), sum(cpu_seconds(p) for p in self.others), time.process_time()

    def __enter__(self) -> CpuPerAppend:
        self.start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = self._sample()

    def fields(self, appends: int) -> dict:
        names = ("primary_cpu_us", "other_brokers_cpu_us", "client_cpu_us")
        return {n: round((e - s) / appends * 1e6) for n, s, e in zip(names, self.start, self.end, strict=True)}


def latency_fields(lat: list[float]) -> dict:
    return {"median_us": round(statistics.median(lat) * 1e6), "p99_us": round(lat[int(len(lat) * 0.99)] * 1e6)}


async def sequential(lc, r: int, size: int, count: int) -> dict:
    name = journal(f"bench/seq-r{r}-{size}")
    async with client(lc.endpoints[0]) as c0:
        await create_journal(c0, lc, name, r)
        ep = await primary_endpoint(c0, name)
    body = os.urandom(size)
    async with client(ep) as c:
        with CpuPerAppend(lc, ep) as cpu:
            lat = await sequential_loop(c, name, body, count)
    return emit(
        {
            "replicas": r,
            "test": "append_sync",
            "transport": CLIENT_TRANSPORT,
            "payload_bytes": size,
            **latency_fields(lat),
            "msgs_per_s": round(len(lat) / sum(lat)),
            "mb_per_s": round(size * len(lat) / sum(lat) / MB, 1),
            "count": count,
            **cpu.fields(count + 200),
        }
    )


async def pipelined_loop(
    c: AsyncClient, name: str, body: bytes, seconds: float, window: int
) -> tuple[int, float, list[float]]:
    """`window` appends in flight for `seconds`: (appends done, seconds elapsed, sorted latencies)."""
    done = 0
    lat: list[float] = []
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await c.append(name, body)
            lat.append(time.perf_counter() - t)
            done += 1

    await asyncio.gather(*(worker() for _ in range(window)))
    elapsed = time.perf_counter() - t0
    lat.sort()
    return done, elapsed, lat


async def pipelined(lc, r: int, size: int, seconds: float, window: int) -> dict:
    name = journal(f"bench/pipe-r{r}-{size}")
    async with client(lc.endpoints[0]) as c0:
        await create_journal(c0, lc, name, r)
        ep = await primary_endpoint(c0, name)
    body = os.urandom(size)
    async with client(ep) as c:
        with CpuPerAppend(lc, ep) as cpu:
            done, elapsed, lat = await pipelined_loop(c, name, body, seconds, window)
    return emit(
        {
            "replicas": r,
            "test": "append_pipelined",
            "transport": CLIENT_TRANSPORT,
            "payload_bytes": size,
            **latency_fields(lat),
            "msgs_per_s": round(done / elapsed),
            "mb_per_s": round(done * size / elapsed / MB, 1),
            "window": window,
            **cpu.fields(done),
        }
    )


async def floor(seconds: float, count: int) -> list[dict]:
    """The same loops against a no-op Append server (bench/_floor.py): what grpc.aio alone allows
    (pipelined at 1 KiB, 64 KiB and 1 MiB with the windows the cluster's loops use; sequential at 1 KiB).

    CPU per append: `server_cpu_us` from /proc utime+stime of the server process (all its
    threads), `client_cpu_us` from process_time of this process (all its threads); for the
    pipelined loop over its timed part, for the sequential one over its 200 warm-up appends
    too (and divided by count + 200). Both share this machine's cores. The pipelined loop starts
    on a channel warmed by 200 appends (pipelined() starts on a new one).
    """
    name = "bench/floor"
    recs = []
    with floor_server() as (ep, pid):
        async with client(ep) as c:
            for size in (KiB, 64 * KiB, MiB):
                window = 64 if size <= 64 * KiB else 16
                body = os.urandom(size)
                for _ in range(200 if size <= 64 * KiB else 20):
                    await c.append(name, body)
                s0, c0 = cpu_seconds(pid), time.process_time()
                done, elapsed, lat = await pipelined_loop(c, name, body, seconds, window)
                s1, c1 = cpu_seconds(pid), time.process_time()
                recs.append(
                    emit(
                        {
                            "replicas": 0,
                            "test": "append_floor",
                            "payload_bytes": size,
                            **latency_fields(lat),
                            "msgs_per_s": round(done / elapsed),
                            "mb_per_s": round(done * size / elapsed / MB, 1),
                            "window": window,
                            "server_cpu_us": round((s1 - s0) / done * 1e6, 1),
                            "client_cpu_us": round((c1 - c0) / done * 1e6, 1),
                        }
                    )
                )
            size = KiB
            body = os.urandom(size)
            s0, c0 = cpu_seconds(pid), time.process_time()
            lat = await sequential_loop(c, name, body, count)
            s1, c1 = cpu_seconds(pid), time.process_time()
            recs.append(
                emit(
                    {
                        "replicas": 0,
                        "test": "append_floor_sync",
                        "payload_bytes": size,
                        **latency_fields(lat),
                        "msgs_per_s": round(len(lat) / sum(lat)),
                        "mb_per_s": round(size * len(lat) / sum(lat) / MB, 1),
                        "count": count,
                        "server_cpu_us": round((s1 - s0) / (count + 200) * 1e6, 1),
                        "client_cpu_us": round((c1 - c0) / (count + 200) * 1e6, 1),
                    }
                )
            )
    return recs


async def big_append(lc, r: int, mib: int) -> dict:
    """One append of `mib` MiB streamed in 256 KiB chunks; sample every broker's RSS meanwhile."""
    name = journal(f"bench/big-r{r}")
    async with client(lc.endpoints[0]) as c0:
        await create_journal(c0, lc, name, r)
        ep = await primary_endpoint(c0, name)
    pids = [b.pid for b in lc.brokers if b.alive()]
    before = {p: rss_kib(p) for p in pids}
    peak = dict(before)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            for p in pids:
                peak[p] = max(peak[p], rss_kib(p))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    chunk = os.urandom(256 * KiB)

    async def gen():
        for _ in range(mib * 4):
            yield chunk

    t0 = time.perf_counter()
    async with client(ep) as c:
        res = await c.append(name, gen())
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    growth = max(peak[p] - before[p] for p in pids)
    return emit(
        {
            "replicas": r,
            "test": "append_single_large",
            "transport": CLIENT_TRANSPORT,
            "payload_bytes": res.end - res.begin,
            "mb_per_s": round((res.end - res.begin) / elapsed / MB, 1),
            "seconds": round(elapsed, 2),
            "broker_rss_growth_mib": round(growth / 1024, 1),
            "broker_rss_peak_mib": round(max(peak.values()) / 1024, 1),
        }
    )


def table(recs: list[dict]) -> None:
    head = f"{'R':>2} {'tls':>3} {'client':>7} {'test':<22} {'payload':>9} {'median_us':>10} {'p99_us':>8}"
    print(f"\n{head} {'msg/s':>8} {'MB/s':>7}")
    for x in recs:
        print(
            f"{x['replicas']:>2} {'yes' if x.get('tls') else '':>3} {x.get('transport', ''):>7} {x['test']:<22} "
            f"{x['payload_bytes']:>9} "
            f"{x.get('median_us', ''):>10} "
            f"{x.get('p99_us', ''):>8} {x.get('msgs_per_s', ''):>8} {x.get('mb_per_s', ''):>7}"
        )


async def cluster_runs(args, tls_files: dict[str, str] | None) -> list[dict]:
    """The cluster's measurements, on a plaintext cluster or (`tls_files`) one serving mutual TLS whose
    brokers verify tokens (a client signing its own, as a long-running service does)."""
    global CLIENT_TLS, CLIENT_AUTH, CLIENT_TRANSPORT
    recs: list[dict] = []
    keys = generate_key() if tls_files else ""
    CLIENT_AUTH = KeyedAuthorizer(KeySet.parse(keys), sub="bench") if keys else None
    with tempfile.TemporaryDirectory(prefix="tidings-bench-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp, auth_keys=keys)
        lc.extra = ["--log-level", "warning"]
        if tls_files is not None:
            lc.extra += [arg for flag, path in tls_files.items() for arg in (flag, path)]
        CLIENT_TLS = load(*tls_files.values(), "bench", server=False) if tls_files else None
        with lc:
            for transport in args.transport:
                CLIENT_TRANSPORT = transport
                for r in args.replicas:
                    recs.append(await sequential(lc, r, KiB, args.count))
                    for size in (KiB, 64 * KiB, MiB):
                        window = 64 if size <= 64 * KiB else 16
                        recs.append(await pipelined(lc, r, size, args.seconds, window))
                    recs.append(await big_append(lc, r, args.big_mib))
    for rec in recs:
        rec["tls"] = tls_files is not None
    return recs


def make_certs(d: str) -> dict[str, str]:
    """A CA and one certificate for 127.0.0.1 in `d`, as the flags' files."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(f"{d}/ca.pem")
    cert.cert_chain_pems[0].write_to_path(f"{d}/cert.pem")
    cert.private_key_pem.write_to_path(f"{d}/key.pem")
    return {"--tls-cert": f"{d}/cert.pem", "--tls-key": f"{d}/key.pem", "--tls-ca": f"{d}/ca.pem"}


def tls_costs(plain: list[dict], tls: list[dict]) -> dict:
    """What TLS + tokens cost in one round: the budgets' two figures, and the CPU of all the
    processes per R=3 64 KiB append (less at the mercy of the two cores' scheduling than MB/s)."""

    def pick(recs: list[dict], test: str, size: int, key: str = "") -> Any:
        rec = next((x for x in recs if x["replicas"] == 3 and x["test"] == test and x["payload_bytes"] == size
                    and x["transport"] == recs[0]["transport"]), None)  # fmt: skip
        return rec if rec is None or not key else rec.get(key)

    p64, t64 = pick(plain, "append_pipelined", 64 * KiB), pick(tls, "append_pipelined", 64 * KiB)
    p1, t1 = pick(plain, "append_sync", KiB, "median_us"), pick(tls, "append_sync", KiB, "median_us")

    def cpu(rec: dict | None) -> int | None:
        return None if rec is None else rec["primary_cpu_us"] + rec["other_brokers_cpu_us"] + rec["client_cpu_us"]

    return {
        "tls_overhead_pct": round((1 - t64["mb_per_s"] / p64["mb_per_s"]) * 100, 1) if p64 and t64 else None,
        "tls_extra_median_us": round(t1 - p1) if p1 and t1 else None,
        "plain_cpu_us_per_64k": cpu(p64),
        "tls_cpu_us_per_64k": cpu(t64),
    }


async def main_async(args) -> None:
    if args.tls_slices:
        await tls_slices(args.tls_slices)
        return
    recs = []
    if not args.no_floor:
        recs.extend(await floor(args.seconds, args.count))
    if args.only_floor:
        table(recs)
        return
    plain = await cluster_runs(args, None)
    recs.extend(plain)
    if args.tls:
        with tempfile.TemporaryDirectory(prefix="tidings-bench-certs-") as certs:
            secured = await cluster_runs(args, make_certs(certs))
        recs.extend(secured)
    table(recs)
    if args.tls:
        cost = emit({"test": "tls_cost", "replicas": 3, "payload_bytes": 64 * KiB, **tls_costs(plain, secured)})
        print(
            f"\nTLS + tokens: {cost.get('tls_overhead_pct')}% of R=3 64 KiB MB/s, "
            f"+{cost.get('tls_extra_median_us')} us R=3 1 KiB median (one run: compare --tls-slices)"
        )


SLICE_CONFIGS = {"plaintext": (False, False), "tls+tokens": (True, True), "tls": (True, False), "tokens": (False, True)}


async def tls_slices(slices: int) -> None:
    """The four configurations of SLICE_CONFIGS up at once, measured in turn, `slices` times."""
    with contextlib.ExitStack() as stack:
        up: dict[str, tuple[Any, TLS | None, KeyedAuthorizer | None, str, str]] = {}
        for name, (tls_on, tokens_on) in SLICE_CONFIGS.items():
            keys = generate_key() if tokens_on else ""
            auth = KeyedAuthorizer(KeySet.parse(keys), sub="bench") if keys else None
            data = stack.enter_context(tempfile.TemporaryDirectory(prefix="tidings-bench-"))
            lc = LocalCluster(brokers=3, zones=3, data_dir=data, auth_keys=keys)
            lc.extra = ["--log-level", "warning"]
            tls = None
            if tls_on:
                files = make_certs(stack.enter_context(tempfile.TemporaryDirectory(prefix="tidings-bench-certs-")))
                lc.extra += [arg for flag, path in files.items() for arg in (flag, path)]
                tls = load(*files.values(), "bench", server=False)
            stack.enter_context(lc)
            async with AsyncClient(lc.endpoints[0], tls=tls, auth=auth) as c0:
                for journal in ("bench/slice-seq", "bench/slice-pipe"):
                    await create_journal(c0, lc, journal, 3)
                seq_ep, pipe_ep = [await primary_endpoint(c0, j) for j in ("bench/slice-seq", "bench/slice-pipe")]
            up[name] = (lc, tls, auth, seq_ep, pipe_ep)
        lat: dict[str, list[float]] = {n: [] for n in up}
        mbs: dict[str, list[float]] = {n: [] for n in up}
        cpu1: dict[str, list[int]] = {n: [] for n in up}
        cpu64: dict[str, list[int]] = {n: [] for n in up}
        small, big = os.urandom(KiB), os.urandom(64 * KiB)
        for i in range(slices):
            for name in list(up) if i % 2 == 0 else list(up)[::-1]:
                lc, tls, auth, seq_ep, pipe_ep = up[name]
                async with AsyncClient(seq_ep, tls=tls, auth=auth) as c:
                    for _ in range(50):
                        await c.append("bench/slice-seq", small)
                    with CpuPerAppend(lc, seq_ep) as cpu:
                        for _ in range(300):
                            t = time.perf_counter()
                            await c.append("bench/slice-seq", small)
                            lat[name].append(time.perf_counter() - t)
                    cpu1[name].append(sum(cpu.fields(300).values()))
                async with AsyncClient(pipe_ep, tls=tls, auth=auth) as c:
                    for _ in range(20):
                        await c.append("bench/slice-pipe", big)
                    with CpuPerAppend(lc, pipe_ep) as cpu:
                        done, elapsed, _ = await pipelined_loop(c, "bench/slice-pipe", big, 1.5, 64)
                    mbs[name].append(done * 64 * KiB / elapsed / MB)
                    cpu64[name].append(sum(cpu.fields(done).values()))
    base = "plaintext"
    rows = {
        n: {
            "seq_1k_median_us": round(statistics.median(lat[n]) * 1e6),
            "pipelined_64k_mb_per_s": round(statistics.median(mbs[n]), 1),
            "cpu_us_per_1k_append": round(statistics.median(cpu1[n])),
            "cpu_us_per_64k_append": round(statistics.median(cpu64[n])),
        }
        for n in up
    }
    mb = {n: row["pipelined_64k_mb_per_s"] for n, row in rows.items()}
    transport = os.environ.get("TIDINGS_TRANSPORT") or "tidings"  # (the clients' default; bench/README.md)
    for n, row in rows.items():
        emit({"test": "tls_slices", "config": n, "transport": transport, "replicas": 3, "slices": slices, **row})
    for n in list(up)[1:]:
        emit(
            {
                "test": "tls_slices_cost",
                "config": n,
                "mb_cost_pct": round((1 - mb[n] / mb[base]) * 100, 1),
                "mb_cost_pct_median_of_slices": round(
                    statistics.median(1 - t / p for p, t in zip(mbs[base], mbs[n], strict=True)) * 100, 1
                ),
                "transport": transport,
                "seq_extra_us": rows[n]["seq_1k_median_us"] - rows[base]["seq_1k_median_us"],
                "budget": "tls+tokens: at most 15% of R=3 64 KiB MB/s, at most +100 us of the R=3 1 KiB median",
            }
        )


def main() -> None:
    main_if_requested("append.py")  # (--ab REF: this tree against REF, interleaved; bench/_ab.py)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    p.add_argument("--count", type=int, default=2000, help="sequential appends timed")
    p.add_argument("--seconds", type=float, default=5.0, help="per pipelined measurement")
    p.add_argument("--big-mib", type=int, default=1024, help="size of the single large append")
    p.add_argument("--no-floor", action="store_true", help="skip the no-op server measurements")
    p.add_argument("--only-floor", action="store_true", help="only the no-op server measurements (no cluster)")
    p.add_argument("--tls", action="store_true", help="the cluster's measurements again over mutual TLS, and the cost")
    p.add_argument(
        "--transport",
        nargs="+",
        choices=["tidings", "grpc"],
        default=[os.environ.get("TIDINGS_TRANSPORT") or "tidings"],
        help="the client transports to measure, in turn, on the same cluster",
    )
    p.add_argument(
        "--tls-slices", type=int, default=0, help="TLS and tokens' cost, four clusters measured in turn N times"
    )
    args = p.parse_args()
    if args.no_floor and args.only_floor:
        p.error("--no-floor and --only-floor exclude each other; pass one of them")
    run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
