"""What the examples share: `tidings consumer` children serving an example's application, the
arguments that find a cluster, and waiting for a verifier to be satisfied."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def arguments(doc: str, prefix: str) -> argparse.ArgumentParser:
    """The arguments every example takes (the cluster, the journals' prefix and partitions)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--etcd", default=os.environ.get("TIDINGS_ETCD", ""), help="the cluster's etcd HOST:PORT")
    ap.add_argument(
        "--broker",
        default=os.environ.get("TIDINGS_BROKER", ""),
        help="a broker HOST:PORT (default: one of those the cluster announces in --etcd)",
    )
    ap.add_argument(
        "--cluster-root", default="/tidings/cluster", help="the brokers' root in etcd (`cluster up`'s by default)"
    )
    ap.add_argument(  # (unique: two runs in one second, as the README's, must not share journals)
        "--prefix",
        default=f"examples/{prefix}-{int(time.time())}-{secrets.token_hex(2)}",
        help="of the journals and shards (new: a run's journals are its own)",
    )
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--replication", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=2, help="consumer processes to run the shards")
    ap.add_argument("--seed", type=int, default=1)
    return ap


def parse(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, the cluster found: --etcd is needed; the brokers are those it announces."""
    import asyncio

    from tidings.cluster import broker_endpoints

    args = ap.parse_args()
    if not args.etcd:
        ap.error("give --etcd HOST:PORT (the `etcd` line `tidings cluster up` prints)")
    if not args.broker:
        try:
            found = asyncio.run(broker_endpoints(args.etcd, args.cluster_root))
        except Exception as exc:
            ap.error(f"--etcd {args.etcd}: {exc}")
        if not found:
            ap.error(f"no broker announces itself in etcd {args.etcd} under {args.cluster_root}: give --broker")
        args.broker = found[0]
    return args


def start_consumer(
    app: str,
    etcd: str,
    broker: str,
    root: str,
    data_dir: Path,
    suffix: str,
    zone: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """A `tidings consumer` child serving `app` (module:factory); returns it and its Shard service endpoint."""
    cmd = [sys.executable, "-m", "tidings.cli", "consumer", "--app", app, "--etcd", etcd,
           "--broker", broker, "--root", root, "--data-dir", str(data_dir), "--id", suffix, "--zone", zone,
           "--listen", "127.0.0.1:0", "--metrics", "", "--lease-ttl", "2", "--exit-timeout", "20"]  # fmt: skip
    log_path = data_dir.parent / f"{suffix}.log"
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise SystemExit(f"consumer {suffix} did not start (see {log_path})")
    return proc, line.split()[1]


class Running(list[str]):
    """The Shard service endpoints of running consumer children (their processes in `procs`)."""

    def __init__(self) -> None:
        super().__init__()
        self.procs: list[subprocess.Popen] = []

    def kill(self, i: int) -> None:
        """kill -9 the i-th consumer (as a lost host): its endpoint leaves the list."""
        proc = self.procs.pop(i)
        del self[i]
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def consumers(
    app: str, args: argparse.Namespace, name: str, env: dict[str, str] | None = None, own_dirs: bool = False
) -> Iterator[Running]:
    """`args.consumers` consumer children serving `app` under a root of their own; yields their Shard
    service endpoints, and stops them (SIGTERM: they hand off and exit; SIGKILL after 30 s) on exit.
    They share one --data-dir (a host's), unless `own_dirs` (recorded stores: no shared disk)."""
    work = Path(tempfile.mkdtemp(prefix=f"tidings-{name}-"))
    root = f"/tidings/consumers/{args.prefix.replace('/', '-')}"
    running = Running()
    procs = running.procs
    try:
        for i in range(args.consumers):
            data_dir = work / (f"{name}{i}-data" if own_dirs else "shards")
            proc, endpoint = start_consumer(app, args.etcd, args.broker, root, data_dir, f"{name}{i}", "local", env)
            procs.append(proc)
            running.append(endpoint)
        yield running
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"consumers stopped (logs and stores in {work})")


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Call `check` every half second until it says done (it raises SystemExit on a violation)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not done within {timeout:g}s")
        time.sleep(0.5)


async def create(broker: str, consumer: str, journals: list, shards: list) -> None:
    """Create the journals and shards (specs). A journal that exists already is refused (SystemExit): an
    earlier run's messages in it would be consumed again, and its verifier count them."""
    from tidings.client import AsyncClient
    from tidings.consumer.client import ShardClient
    from tidings.protocol import protocol_pb2 as pb

    async with AsyncClient(broker) as c:
        have = {j.spec.name for j in (await c.list()).journals}
        if taken := sorted(s.name for s in journals if s.name in have):
            raise SystemExit(f"journal {taken[0]} exists already (an earlier run's): give a new --prefix")
        await c.apply([pb.ApplyRequest.Change(upsert=s) for s in journals])
    async with ShardClient(consumer) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=s) for s in shards])


async def failures(consumer: str, prefix: str) -> list[str]:
    """What FAILED shards under `prefix` say (a shard fails on a broken invariant: no point waiting)."""
    from tidings.consumer.client import ShardClient
    from tidings.protocol import protocol_pb2 as pb

    async with ShardClient(consumer) as sc:
        shards = (await sc.list()).shards
    return [
        f"{s.spec.id}: {'; '.join(st.errors)}"
        for s in shards
        if s.spec.id.startswith(prefix)
        for st in s.status
        if st.code == pb.ReplicaStatus.FAILED
    ]
