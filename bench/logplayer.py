#!/usr/bin/env python3
"""LogPlayer benchmark: the paper's Figures 9, 10, 11 and 13 (logplayer-paper.txt, section 6) on this machine.

A LocalCluster (etcd + 3 broker processes on loopback); per configuration new journals (R=3), T
target processes and the deliverer, then a transaction manager (this process) writing --txns
transactions of K mutations of 1 KB with random keys at --rate per second (the first --warmup
left out of the figures). Three designs, alternating per configuration:

- `logplayer`: a WAL journal (`WalWriter`, open loop), `tidings target serve --log-applied` x T and
  `tidings logplayer run`.
- `relay` (the paper's Figure 8, measured in its Figure 11; `bench/_relay.py`): the WAL journal, a
  consumer shard re-publishing each entry's parts to T per-target journals in its transactions,
  and T storage shards (consumer shards, SQLite stores) applying their journal, exactly once.
- `direct` (the design of the paper's Figures 12-13, "Kafka EOS"): no WAL; the transaction manager
  writes each transaction's parts to the per-target journals in a transaction of its own
  (uncommitted messages, then ACKs), one at a time; the same storage shards apply them.

Timestamps as the paper's section 6.1: commit = just before the transaction manager sends the
append, dispatch = as the LogPlayer (or the relay) takes the entry, apply = as the target receives
it. Per (entry, target) part: LogPlayer delay = apply - dispatch, apply delay = apply - commit.
`txn_*` figures: per transaction, applied once its last part is. Once the processes stop, every
target's apply log is checked against what was written (each of its parts once, in order, with
its number of mutations). Prints JSON lines (`logplayer_delay`, `apply_delay`, `cpu`) per
configuration:

  bench/logplayer.py                              # targets and size sweeps, three designs (~20 min)
  bench/logplayer.py --sweep rate --txns 300      # 10-100 transactions per second at 10 targets
  bench/logplayer.py --sweep targets --design logplayer --txns 500
  bench/logplayer.py --plot results/logplayer-2026-11-24b/*.jsonl   # the PNGs, from saved lines
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import apsw
import msgspec
from _ab import main_if_requested
from _common import child_processes, cpu_seconds, create_journal, emit, run
from _relay import Part

from tidings.client import AppendService, AsyncClient
from tidings.cluster import LocalCluster
from tidings.cluster.etcd import free_port
from tidings.logplayer.wal import Target, Targets, WalMutation, WalWriter
from tidings.message import Publisher

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


def send_delay(url: str) -> dict[str, float]:
    """The LogPlayer's own share of its delay (a batch's oldest entry's dispatch to the batch written to the
    target's connection, every batch of the run, warm-up included): median and p99 in ms, interpolated in
    its histogram's buckets (tidings_logplayer_send_delay_seconds, from its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    buckets = [
        (float(s.labels["le"]), s.value)
        for family in text_string_to_metric_families(text)
        if family.name == "tidings_logplayer_send_delay_seconds"
        for s in family.samples
        if s.name.endswith("_bucket")
    ]
    total = max((n for _, n in buckets), default=0)
    out: dict[str, float] = {}
    for name, q in (("sent_median_ms", 0.5), ("sent_p99_ms", 0.99)):
        below, lower = 0.0, 0.0
        for le, n in sorted(buckets):
            if total and n >= q * total:
                share = (q * total - below) / (n - below) if n > below and le != float("inf") else 1.0
                out[name] = round(1e3 * (lower + share * ((le if le != float("inf") else lower) - lower)), 3)
                break
            below, lower = n, le
    return out


def applied(db: Path) -> list[tuple[int, int, int, int, int]]:
    """A target's apply log: (index, mutations, committed_ns, dispatched_ns, received_ns) in apply order."""
    if not db.exists():
        return []
    conn = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return list(conn.execute(
            "SELECT idx, mutations, committed_ns, dispatched_ns, received_ns FROM applied ORDER BY seq"
        ))  # fmt: skip
    except apsw.SQLError:  # (no table yet)
        return []
    finally:
        conn.close()


@contextlib.contextmanager
def logplayer_design(
    broker: str, wal: str, ids: list[str], work: Path
) -> Iterator[tuple[Targets, list[int], int, str]]:
    """T target processes and a LogPlayer process; yields the targets, their PIDs, the player's and its
    /metrics URL."""
    cli = ["-m", "tidings.cli"]
    serve = [[*cli, "target", "serve", "--id", t, "--db", str(work / f"{t}.sqlite"), "--listen", "127.0.0.1:0",
              "--log-applied", *QUIET] for t in ids]  # fmt: skip
    with child_processes(serve, "target", sigterm=True) as started:
        targets = Targets(Target(id=t, endpoint=line.split()[1]) for t, (line, _) in zip(ids, started, strict=True))
        metrics = f"127.0.0.1:{free_port()}"
        path = work / "targets.yaml"
        path.write_text(json.dumps({"targets": [{"id": t.id, "endpoint": t.endpoint} for t in targets.targets]}))
        player = [*cli, "logplayer", "run", "--wal", wal, "--targets", str(path), "--broker", broker,
                  "--state", str(work / "player.state"), "--progress", "0", "--metrics", metrics, *QUIET]  # fmt: skip
        with child_processes([player], "logplayer", sigterm=True) as [(_, pid)]:
            yield targets, [p for _, p in started], pid, f"http://{metrics}/metrics"


@contextlib.contextmanager
def shard_design(
    broker: str, wal: str, ids: list[str], work: Path, journals: dict[str, str], relay: bool
) -> Iterator[tuple[Targets, list[int], int, str]]:
    """T storage-shard processes on per-target journals, and (`relay`) a relay shard process on the WAL;
    yields the targets, the storage shards' PIDs, the relay's (0: none) and "" (no LogPlayer metrics)."""
    script = str(HERE / "_relay.py")
    prefix = journals[ids[0]].rsplit("/", 1)[0]
    shards = [[script, "apply", "--broker", broker, "--source", journals[t], "--db", str(work / f"{t}.sqlite")]
              for t in ids]  # fmt: skip
    targets = Targets(Target(id=t, endpoint="127.0.0.1:1") for t in ids)  # (ids only: the key mapping)
    with child_processes(shards, "storage shard") as started:
        if not relay:
            yield targets, [p for _, p in started], 0, ""
            return
        argv = [script, "relay", "--broker", broker, "--source", wal, "--db", str(work / "relay.sqlite"),
                "--prefix", prefix]  # fmt: skip
        with child_processes([argv], "relay shard") as [(_, pid)]:
            yield targets, [p for _, p in started], pid, ""


def transaction(targets: Targets, kb: int, rng: random.Random) -> tuple[list[dict], dict[str, int]]:
    """kb mutations of 1 KB with random keys, and how many go to each target."""
    txn = [{"key": f"k{rng.randrange(10**9):09d}", "value": VALUE} for _ in range(kb)]
    counts: dict[str, int] = {}
    for m in txn:
        t = targets.target_of(m["key"])
        counts[t] = counts.get(t, 0) + 1
    return txn, counts


async def drive(
    c: AsyncClient, wal: str, targets: Targets, args: argparse.Namespace, kb: int, rate: float, rng: random.Random
) -> tuple[dict[str, list[tuple[int, int]]], int]:
    """Append warmup + txns transactions to the WAL at `rate` (open loop); per target, the (index,
    mutations) of its parts in order, and the first measured index."""
    writer = WalWriter(c, wal, targets)
    parts: dict[str, list[tuple[int, int]]] = {t: [] for t in targets.ids}
    loop = asyncio.get_running_loop()
    pending = []
    t0 = loop.time()
    try:
        for i in range(args.warmup + args.txns):
            wait = t0 + i / rate - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # (open loop: the next transaction's send time)
            txn, counts = transaction(targets, kb, rng)
            pending.append((asyncio.ensure_future(writer.append(txn)), counts))
        async with asyncio.timeout(120):
            for future, counts in pending:
                index = await future
                for t, n in counts.items():
                    parts[t].append((index, n))
            mark = await pending[args.warmup][0]
    finally:
        await writer.aclose()
    return parts, mark


async def drive_direct(
    c: AsyncClient, journals: dict[str, str], targets: Targets, args: argparse.Namespace, kb: int, rate: float,
    rng: random.Random,
) -> tuple[dict[str, list[tuple[int, int]]], int]:  # fmt: skip
    """The paper's Figure 13 design: the transaction manager writes each transaction's parts straight
    to the per-target journals in one transaction of its own (uncommitted messages, then their ACKs:
    Kafka's transactional producer), one transaction at a time, at `rate` when it keeps up. The
    index of a part is the transaction's number."""
    publisher = Publisher(AppendService(c))
    parts: dict[str, list[tuple[int, int]]] = {t: [] for t in targets.ids}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        for i in range(args.warmup + args.txns):
            wait = t0 + i / rate - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            txn, counts = transaction(targets, kb, rng)
            by_target: dict[str, list[WalMutation]] = {}
            for m in txn:
                by_target.setdefault(targets.target_of(m["key"]), []).append(
                    WalMutation(m["key"], msgspec.Raw(msgspec.json.encode(m["value"])))
                )
            now = time.time_ns()
            for t, mutations in by_target.items():
                await publisher.publish_uncommitted(journals[t], Part(i, mutations, now, now))
            async with asyncio.timeout(60):
                await (await publisher.write_ack_intents(publisher.build_ack_intents()))  # (the commit)
            for t, n in counts.items():
                parts[t].append((i, n))
    finally:
        await publisher.service.aclose()
    return parts, args.warmup


async def one(
    lc: LocalCluster, args: argparse.Namespace, design: str, n: int, kb: int, rate: float, work: Path, sweep: str
) -> list[dict]:
    """One configuration: n targets, transactions of kb mutations at `rate`; its JSON lines."""
    broker = lc.brokers[0].endpoint
    name = f"bench/lp-{design}-{n}t-{kb}kb-{rate:g}ps-{time.time_ns()}"
    work = work / name.rsplit("/", 1)[1]
    work.mkdir(parents=True)
    ids = [f"t{i:02d}" for i in range(n)]
    rng = random.Random(args.seed)
    async with AsyncClient(broker) as c:
        await create_journal(c, lc, f"{name}/wal", args.replication)
        journals = {t: f"{name}/to/{t}" for t in ids}
        if design != "logplayer":
            for j in journals.values():
                await create_journal(c, lc, j, args.replication)
        if design == "logplayer":
            setup = logplayer_design(broker, f"{name}/wal", ids, work)
        else:
            setup = shard_design(broker, f"{name}/wal", ids, work, journals, relay=design == "relay")
        with setup as (targets, target_pids, player_pid, metrics_url):
            pids = [p for p in (player_pid, *target_pids) if p]
            cpu0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
            if design == "direct":
                expected, mark = await drive_direct(c, journals, targets, args, kb, rate, rng)
            else:
                expected, mark = await drive(c, f"{name}/wal", targets, args, kb, rate, rng)
            deadline = time.monotonic() + max(60.0, 5 * args.txns / rate)
            while True:
                logs = {t: await asyncio.to_thread(applied, work / f"{t}.sqlite") for t in ids}
                if all(len(logs[t]) >= len(expected[t]) for t in ids) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)  # (polling the targets' files for their apply logs)
            cpu = [cpu_seconds(p) - before for p, before in zip(pids, cpu0, strict=True)]
            sent = await asyncio.to_thread(send_delay, metrics_url) if metrics_url else {}
            took = time.monotonic() - t0
    # Once every process stopped, the apply logs are final: each part once, in order, whole.
    logs = {t: applied(work / f"{t}.sqlite") for t in ids}
    for t in ids:
        got = [(r[0], r[1]) for r in logs[t]]
        if got != expected[t]:
            raise SystemExit(f"{design}: target {t} applied {len(got)} parts, expected each of {len(expected[t])} "
                             f"once in order: not exactly once ({n} targets, {kb} KB, {rate:g}/s)")  # fmt: skip
    rows = [r for t in ids for r in logs[t] if r[0] >= mark]
    if any(r[3] == 0 for r in rows):
        raise SystemExit(f"{design}: parts without a dispatch time")
    common = {"sweep": sweep, "design": design, "targets": n, "txn_kb": kb, "rate": rate, "txns": args.txns,
              "warmup": args.warmup, "replication": args.replication, "seed": args.seed,
              "parts": len(rows)}  # fmt: skip
    by_entry: dict[int, list[tuple[int, int]]] = {}
    for r in rows:
        by_entry.setdefault(r[0], []).append((r[4] - r[3], r[4] - r[2]))
    fan = {  # an entry's first and last part to arrive: what fanning out to its targets costs
        "first_part_median_ms": round(statistics.median(min(d)[0] for d in by_entry.values()) / 1e6, 3),
        "last_part_median_ms": round(statistics.median(max(d)[0] for d in by_entry.values()) / 1e6, 3),
    }
    whole = percentiles([max(a for _, a in d) for d in by_entry.values()])  # (applied with its last part)
    use = {"seconds": round(took, 1), "player_cpu_pct": round(100 * cpu[0] / took, 1) if player_pid else 0.0,
           "targets_cpu_pct": round(100 * sum(cpu[1 if player_pid else 0:]) / took, 1)}  # fmt: skip
    per_txn = {f"txn_{k}": v for k, v in whole.items()}
    return [
        emit({"test": "logplayer_delay", **common, **percentiles([r[4] - r[3] for r in rows]), **fan, **sent}),
        emit({"test": "apply_delay", **common, **percentiles([r[4] - r[2] for r in rows]), **per_txn}),
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
    for n, kb, rate in configs:  # (the designs alternate: each configuration's runs see the same cluster)
        for design in args.design:
            out += await one(lc, args, design, n, kb, rate, work, "rate" if args.sweep == "rate" else "targets/size")
    return out


def plot(paths: list[str], outdir: Path) -> None:
    """Figures 9 and 10 (LogPlayer), and the designs compared (11, 13), as PNGs from saved JSON lines."""
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
        designs = (("logplayer", "LogPlayer", "C0"), ("relay", "relay shard (Fig. 8)", "C3"),
                   ("direct", "direct transactions (Fig. 13)", "C2"))  # fmt: skip
        for design, name, color in designs:
            rs = series("apply_delay", design, by, fixed)
            for stat, style in (("txn_mean_ms", "-"), ("txn_p99_ms", "--")):
                ax.plot([r[by] for r in rs], [r.get(stat, 0) for r in rs], style, marker="o", color=color,
                        label=f"{name} {stat[4:-3]}")  # fmt: skip
        title = f"apply delay per transaction by {label.split(' (')[0]}"
        ax.set(xlabel=label, ylabel="ms", yscale="log", title=title)
        ax.legend(fontsize="x-small")
        ax.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(outdir / "logplayer-designs.png", dpi=90)


def main() -> None:
    main_if_requested("logplayer.py")  # (--ab REF: this tree against REF, interleaved; bench/_ab.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", default="logplayer,relay,direct", type=lambda s: s.split(","))
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
    if not set(args.design) <= {"logplayer", "relay", "direct"}:
        ap.error("--design: some of logplayer, relay, direct (comma-separated)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # (stopped like Ctrl-C: the children too)
    with tempfile.TemporaryDirectory(prefix="tidings-bench-logplayer-") as tmp:
        lc = LocalCluster(brokers=3, zones=3, data_dir=tmp)
        try:
            lc.start()
            run(bench(lc, args, Path(tmp)))
        finally:
            lc.stop()


if __name__ == "__main__":
    main()
