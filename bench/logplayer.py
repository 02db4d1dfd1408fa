#!/usr/bin/env python3
"""LogPlayer benchmark: the paper's Figures 9, 10 and 13 (logplayer-paper.txt, section 6) on this machine.

A LocalCluster (etcd + 3 broker processes on loopback); per configuration a new WAL journal (R=3),
T target processes and the deliverer, then a transaction manager (this process, `WalWriter`)
appending --txns transactions of K mutations of 1 KB with random keys, open loop at --rate per
second (the first --warmup left out of the figures). Two designs:

- `logplayer`: `tidings target serve --log-applied` x T and `tidings logplayer run`.
- `relay` (the paper's Figure 8, from tidings' own parts; `bench/_relay.py`): a consumer shard
  re-publishing each entry's parts to T per-target journals (R=3) in its transactions, and T
  storage shards (consumer shards, SQLite stores) applying their journal, exactly once.

Timestamps as the paper's section 6.1: commit = just before the transaction manager sends the
append, dispatch = as the LogPlayer (or the relay) takes the entry, apply = as the target receives
it. Per (entry, target) part: LogPlayer delay = apply - dispatch, apply delay = apply - commit.
Every target's apply log is also checked against what was appended (each of its parts once, in
order). Prints JSON lines (`logplayer_delay`, `apply_delay`, `cpu`) per configuration:

  bench/logplayer.py                              # both sweeps, both designs (~15 min)
  bench/logplayer.py --sweep targets --design logplayer --txns 500
  bench/logplayer.py --plot results/logplayer-2026-11-24.jsonl   # the PNGs, from saved lines
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import apsw
from _common import child_processes, cpu_seconds, create_journal, emit, run

from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.logplayer.wal import Target, Targets, WalWriter

HERE = Path(__file__).resolve().parent
VALUE = "v" * 1000  # a mutation's value: with its key and framing, 1 KB
QUIET = ["--log-level", "warning"]


def percentiles(values: list[float]) -> dict[str, float]:
    """mean / median / p99 in ms of values in ns."""
    q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    return {
        "mean_ms": round(statistics.fmean(values) / 1e6, 3),
        "median_ms": round(statistics.median(values) / 1e6, 3),
        "p99_ms": round(q[98] / 1e6, 3),
    }


def applied(db: Path) -> list[tuple[int, int, int, int]]:
    """A target's apply log: (index, committed_ns, dispatched_ns, received_ns) in apply order."""
    if not db.exists():
        return []
    conn = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return list(conn.execute("SELECT idx, committed_ns, dispatched_ns, received_ns FROM applied ORDER BY seq"))
    except apsw.SQLError:  # (no table yet)
        return []
    finally:
        conn.close()


@contextlib.contextmanager
def logplayer_design(broker: str, wal: str, ids: list[str], work: Path) -> Iterator[tuple[Targets, list[int], int]]:
    """T target processes and a LogPlayer process; yields the targets, their PIDs and the player's."""
    cli = ["-m", "tidings.cli"]
    serve = [[*cli, "target", "serve", "--id", t, "--db", str(work / f"{t}.sqlite"), "--listen", "127.0.0.1:0",
              "--log-applied", *QUIET] for t in ids]  # fmt: skip
    with child_processes(serve, "target", sigterm=True) as started:
        targets = Targets(Target(id=t, endpoint=line.split()[1]) for t, (line, _) in zip(ids, started, strict=True))
        path = work / "targets.yaml"
        path.write_text(json.dumps({"targets": [{"id": t.id, "endpoint": t.endpoint} for t in targets.targets]}))
        player = [*cli, "logplayer", "run", "--wal", wal, "--targets", str(path), "--broker", broker,
                  "--state", str(work / "player.state"), "--progress", "0", *QUIET]  # fmt: skip
        with child_processes([player], "logplayer", sigterm=True) as [(_, pid)]:
            yield targets, [p for _, p in started], pid


@contextlib.contextmanager
def relay_design(
    broker: str, wal: str, ids: list[str], work: Path, journals: dict[str, str]
) -> Iterator[tuple[Targets, list[int], int]]:
    """T storage-shard processes on per-target journals and a relay shard process on the WAL."""
    script = str(HERE / "_relay.py")
    prefix = journals[ids[0]].rsplit("/", 1)[0]
    shards = [[script, "apply", "--broker", broker, "--source", journals[t], "--db", str(work / f"{t}.sqlite")]
              for t in ids]  # fmt: skip
    with child_processes(shards, "storage shard") as started:
        relay = [script, "relay", "--broker", broker, "--source", wal, "--db", str(work / "relay.sqlite"),
                 "--prefix", prefix]  # fmt: skip
        with child_processes([relay], "relay shard") as [(_, pid)]:
            targets = Targets(Target(id=t, endpoint="127.0.0.1:1") for t in ids)  # (ids only: the key mapping)
            yield targets, [p for _, p in started], pid


async def drive(
    c: AsyncClient, wal: str, targets: Targets, args: argparse.Namespace, kb: int, rate: float, rng: random.Random
) -> tuple[dict[str, list[int]], int]:
    """Append warmup + txns transactions at `rate`; per target, the indices of its parts in order, and
    the first measured index."""
    writer = WalWriter(c, wal, targets)
    parts: dict[str, list[int]] = {t: [] for t in targets.ids}
    loop = asyncio.get_running_loop()
    pending = []
    t0 = loop.time()
    for i in range(args.warmup + args.txns):
        wait = t0 + i / rate - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)  # (open loop: the next transaction's send time)
        txn = [{"key": f"k{rng.randrange(10**9):09d}", "value": VALUE} for _ in range(kb)]
        pending.append((asyncio.ensure_future(writer.append(txn)), {targets.target_of(m["key"]) for m in txn}))
    for future, to in pending:
        index = await future
        for t in to:
            parts[t].append(index)
    mark = await pending[args.warmup][0]
    await writer.aclose()
    return parts, mark


async def one(
    lc: LocalCluster, args: argparse.Namespace, design: str, n: int, kb: int, rate: float, work: Path, sweep: str
) -> list[dict]:
    """One configuration: n targets, transactions of kb mutations at `rate`; its JSON lines."""
    broker = lc.brokers[0].endpoint
    name = f"bench/lp-{design}-{n}t-{kb}kb-{rate:g}ps-{int(time.time())}"
    work = work / name.rsplit("/", 1)[1]
    work.mkdir(parents=True)
    ids = [f"t{i:02d}" for i in range(n)]
    rng = random.Random(args.seed)
    async with AsyncClient(broker) as c:
        await create_journal(c, lc, f"{name}/wal", args.replication)
        journals = {t: f"{name}/to/{t}" for t in ids}
        if design == "relay":
            for j in journals.values():
                await create_journal(c, lc, j, args.replication)
        setup = logplayer_design if design == "logplayer" else relay_design
        extra = (journals,) if design == "relay" else ()
        with setup(broker, f"{name}/wal", ids, work, *extra) as (targets, target_pids, player_pid):
            pids = [player_pid, *target_pids]
            cpu0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
            expected, mark = await drive(c, f"{name}/wal", targets, args, kb, rate, rng)
            deadline = time.monotonic() + max(60.0, 5 * args.txns / rate)
            logs: dict[str, list] = {}
            while True:
                logs = {t: await asyncio.to_thread(applied, work / f"{t}.sqlite") for t in ids}
                if all(len(logs[t]) >= len(expected[t]) for t in ids) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)  # (polling the targets' files for their apply logs)
            cpu = [cpu_seconds(p) - before for p, before in zip(pids, cpu0, strict=True)]
            took = time.monotonic() - t0
    for t in ids:
        got = [r[0] for r in logs[t]]
        if got != expected[t]:
            raise SystemExit(f"{design}: target {t} applied {len(got)} parts, expected each of {len(expected[t])} "
                             f"once in order: not exactly once ({n} targets, {kb} KB, {rate:g}/s)")  # fmt: skip
    rows = [r for t in ids for r in logs[t] if r[0] >= mark]
    common = {"sweep": sweep, "design": design, "targets": n, "txn_kb": kb, "rate": rate, "txns": args.txns,
              "parts": len(rows)}  # fmt: skip
    by_entry: dict[int, list[int]] = {}
    for r in rows:
        by_entry.setdefault(r[0], []).append(r[3] - r[2])
    fan = {  # an entry's first and last part to arrive: what fanning out to its targets costs
        "first_part_median_ms": round(statistics.median(min(d) for d in by_entry.values()) / 1e6, 3),
        "last_part_median_ms": round(statistics.median(max(d) for d in by_entry.values()) / 1e6, 3),
    }
    use = {"seconds": round(took, 1), "player_cpu_pct": round(100 * cpu[0] / took, 1),
           "targets_cpu_pct": round(100 * sum(cpu[1:]) / took, 1)}  # fmt: skip
    return [
        emit({"test": "logplayer_delay", **common, **percentiles([r[3] - r[2] for r in rows]), **fan}),
        emit({"test": "apply_delay", **common, **percentiles([r[3] - r[1] for r in rows])}),
        emit({"test": "cpu", **common, **use}),
    ]


async def bench(lc: LocalCluster, args: argparse.Namespace, work: Path) -> list[dict]:
    configs: list[tuple[int, int, float]] = []  # (targets, KB, rate)
    if args.sweep in ("targets", "both"):
        configs += [(n, 10, args.rate) for n in args.targets]
    if args.sweep in ("size", "both"):
        configs += [(20, kb, args.rate) for kb in args.sizes if (20, kb, args.rate) not in configs]
    if args.sweep == "rate":
        configs += [(10, 10, r) for r in args.rates]
    out = []
    for design in args.design:
        for n, kb, rate in configs:
            out += await one(lc, args, design, n, kb, rate, work, "rate" if args.sweep == "rate" else "targets/size")
    return out


def plot(paths: list[str], outdir: Path) -> None:
    """Figures 9, 10 and 13 as PNGs from saved JSON lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.startswith("{")]

    def series(test: str, design: str, by: str, fixed: dict) -> list[dict]:
        rs = [r for r in recs if r.get("test") == test and r.get("design") == design
              and r.get("sweep", "targets/size") == fixed.get("sweep", "targets/size")
              and all(r.get(k) == v for k, v in fixed.items() if k != "sweep")]  # fmt: skip
        return sorted(rs, key=lambda r: r[by])

    sweeps = [("targets", {"txn_kb": 10}, "targets"), ("txn_kb", {"targets": 20}, "transaction size (KB)")]
    rates = ("rate", {"sweep": "rate"}, "transactions per second (10 targets, 10 KB)")
    for fig, (by, fixed, label) in zip(("fig9", "fig10"), sweeps, strict=True):
        f, axes = plt.subplots(1, 2, figsize=(10, 4))
        panels = (("logplayer_delay", "LogPlayer delay"), ("apply_delay", "apply delay"))
        for ax, (test, title) in zip(axes, panels, strict=True):
            rs = series(test, "logplayer", by, fixed)
            for stat in ("mean_ms", "median_ms", "p99_ms"):
                ax.plot([r[by] for r in rs], [r[stat] for r in rs], marker="o", label=stat.replace("_ms", ""))
            ax.set(xlabel=label, ylabel="ms", title=title)
            ax.legend()
            ax.grid(alpha=0.3)
        f.tight_layout()
        f.savefig(outdir / f"logplayer-{fig}.png", dpi=90)
    f, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (by, fixed, label) in zip(axes, [*sweeps, rates], strict=True):
        for design, name, color in (("logplayer", "LogPlayer", "C0"), ("relay", "relay shard", "C3")):
            rs = series("apply_delay", design, by, fixed)
            for stat, style in (("mean_ms", "-"), ("p99_ms", "--")):
                ax.plot([r[by] for r in rs], [r[stat] for r in rs], style, marker="o", color=color,
                        label=f"{name} {stat.replace('_ms', '')}")  # fmt: skip
        ax.set(xlabel=label, ylabel="apply delay, ms", yscale="log", title=f"apply delay by {label.split(' (')[0]}")
        ax.legend()
        ax.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(outdir / "logplayer-fig13.png", dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", default="logplayer,relay", type=lambda s: s.split(","))
    ap.add_argument("--sweep", choices=["targets", "size", "both", "rate"], default="both",
                    help="targets: 2-20 at 10 KB; size: 1-10 KB at 20 targets; rate: --rates, 10 targets")  # fmt: skip
    ap.add_argument("--targets", default="2,5,10,15,20", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--sizes", default="1,2,5,10", type=lambda s: [int(x) for x in s.split(",")],
                    help="transaction sizes in KB (mutations of 1 KB) at 20 targets")  # fmt: skip
    ap.add_argument("--txns", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rate", type=float, default=100.0, help="transactions per second (open loop)")
    ap.add_argument("--rates", default="10,25,50,100", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--replication", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", nargs="*", help="draw the PNGs into bench/ from these JSON-lines files, and exit")
    args = ap.parse_args()
    if args.plot is not None:
        plot(args.plot, HERE)
        return
    if not set(args.design) <= {"logplayer", "relay"}:
        ap.error("--design: logplayer, relay or both (comma-separated)")
    with tempfile.TemporaryDirectory(prefix="tidings-bench-logplayer-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp)
        try:
            lc.start()
            run(bench(lc, args, Path(tmp)))
        finally:
            lc.stop()


if __name__ == "__main__":
    main()
