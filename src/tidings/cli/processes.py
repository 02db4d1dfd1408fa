"""`tidings broker`, `cluster up`, `members list`, `status` and `demo`: the cluster's processes,
run in the foreground, and what they say about themselves."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tidings.cli._common import (
    DEFAULT_BROKER,
    AdvertiseOpt,
    AuthKeysFileOpt,
    AuthKeysOpt,
    BrokerOpt,
    MetricsAdvertiseOpt,
    MetricsTLSOpt,
    at_least,
    auth_keys,
    broker_client,
    check_advertised,
    check_endpoint,
    check_log_level,
    check_metrics_tls,
    err,
    etcd_security,
    group,
    out,
    run_async,
    serve_until_signalled,
    server_tls,
    usage,
)
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import desired_replication
from tidings.protocol.status import TidingsError, UsageError

if TYPE_CHECKING:
    from rich.table import Table

    from tidings.client import AsyncClient

cluster = group("Run a local cluster (private etcd + brokers).")
members = group("The cluster's brokers.")


def register(root: typer.Typer) -> None:
    root.command()(broker)
    root.command()(status)
    root.command()(demo)
    root.add_typer(cluster, name="cluster")
    root.add_typer(members, name="members")


def broker(
    etcd: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_ETCD",
            help="etcd endpoint HOST:PORT (https://HOST:PORT: over TLS).",
            callback=check_endpoint("--etcd (TIDINGS_ETCD)", schemes=True),
        ),
    ],
    zone: Annotated[
        str, typer.Option(envvar="TIDINGS_ZONE", help="Failure zone; replicas spread over zones.")
    ] = "local",
    id: Annotated[str, typer.Option("--id", envvar="TIDINGS_ID", help="Broker suffix, unique in its zone.")] = "b0",
    listen: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_LISTEN",
            help="HOST:PORT of the gRPC service.",
            callback=check_endpoint("--listen (TIDINGS_LISTEN)"),
        ),
    ] = ("127.0.0.1:8080"),
    advertise: AdvertiseOpt = "",
    replication_listen: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_REPLICATION_LISTEN",
            help="HOST:PORT for other brokers' replication streams; '' takes --listen's host and any free port "
            "(announced in etcd).",
            callback=check_endpoint("--replication-listen", optional=True),
        ),
    ] = "",
    replication_advertise: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_REPLICATION_ADVERTISE",
            help="HOST or HOST:PORT other brokers dial for replication, when not --advertise's host and the "
            "port it listens on (a mapped port).",
        ),
    ] = "",
    data_dir: Annotated[
        Path, typer.Option(envvar="TIDINGS_DATA_DIR", help="Where spools of journals without stores live.")
    ] = Path("data/broker"),
    root: Annotated[str, typer.Option(envvar="TIDINGS_ROOT", help="etcd key prefix.")] = "/tidings/cluster",
    journal_limit: Annotated[
        int, typer.Option(envvar="TIDINGS_JOURNAL_LIMIT", help="Most journal replicas this broker takes.")
    ] = 1024,
    metrics: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_METRICS",
            help="HOST:PORT serving Prometheus /metrics; auto: --listen's host and port + 1000 (any free port if "
            "taken); '' off. Printed at start and in `tidings members list`.",
            callback=check_endpoint("--metrics", True, also=("auto",)),
        ),
    ] = "auto",
    metrics_advertise: MetricsAdvertiseOpt = "",
    metrics_tls: MetricsTLSOpt = False,
    metrics_journals: Annotated[
        bool,
        typer.Option(
            envvar="TIDINGS_METRICS_JOURNALS",
            help="Per-journal series too (appended and read bytes, commits): one series per journal, so only "
            "where journals are few.",
        ),
    ] = False,
    stall_timeout: Annotated[
        float, typer.Option(envvar="TIDINGS_STALL_TIMEOUT", help="Seconds an append may send nothing before it fails.")
    ] = 10.0,
    min_append_rate: Annotated[
        int, typer.Option(envvar="TIDINGS_MIN_APPEND_RATE", help="Bytes/s below which a slow append is cut off.")
    ] = 16 * 1024,
    max_append_rate: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_MAX_APPEND_RATE",
            min=0,
            help="Bytes/s any journal's appends may take at most on this broker (0: only the spec's "
            "max_append_rate); faster appends wait, none fails.",
        ),
    ] = 0,
    pulse_interval: Annotated[
        float,
        typer.Option(
            envvar="TIDINGS_PULSE_INTERVAL",
            help="Seconds between health-check appends of each journal (route changes check at once).",
        ),
    ] = 60.0,
    lease_ttl: Annotated[
        int, typer.Option(envvar="TIDINGS_LEASE_TTL", help="Seconds etcd keeps this broker's member key without it.")
    ] = 5,
    exit_timeout: Annotated[
        float,
        typer.Option(envvar="TIDINGS_EXIT_TIMEOUT", help="On SIGTERM, seconds to wait for journals to move away."),
    ] = 60.0,
    default_store: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_DEFAULT_STORE",
            help="Fragment store (fsspec URL) of journals whose spec names none; '' keeps them on local disks.",
        ),
    ] = "",
    persist_delay: Annotated[
        float,
        typer.Option(
            envvar="TIDINGS_PERSIST_DELAY",
            help="Seconds a replica waits before persisting a fragment its primary has not (the primary does at once).",
        ),
    ] = 60.0,
    auto_suspend: Annotated[
        bool,
        typer.Option(
            envvar="TIDINGS_AUTO_SUSPEND",
            help="Suspend idle journals (all persisted, the last fragment older than the journal's flush "
            "interval, or 24h): they then cost no pipeline and no pulse; the next append resumes them.",
        ),
    ] = False,
    prune_interval: Annotated[
        float,
        typer.Option(
            envvar="TIDINGS_PRUNE_INTERVAL",
            help="Seconds between retention passes (each journal's primary removes the fragments its "
            "fragment.retention lets go); 0 never (run `journals prune` yourself).",
            callback=at_least("--prune-interval", 0),
        ),
    ] = 300.0,
    log_level: Annotated[
        str, typer.Option(envvar="TIDINGS_LOG_LEVEL", help="debug, info, warning or error.", callback=check_log_level)
    ] = "info",
    keys: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Run one broker in the foreground. Prints `READY HOST:PORT` once it serves (then `METRICS HOST:PORT`
    if it serves /metrics); SIGTERM hands
    its journals to other brokers (at most --exit-timeout seconds), then exits. It exits with 1 if
    its etcd lease is lost (etcd unreachable for longer than --lease-ttl)."""
    from tidings.broker.host import BrokerConfig
    from tidings.broker.malloc import tune_malloc
    from tidings.broker.service import Broker
    from tidings.member.serving import advertised

    try:  # (before anything starts: an address nobody could dial is one line)
        advertised(listen, advertise, "tidings broker")
    except TidingsError as exc:
        usage(str(exc))
    check_advertised(
        "tidings broker", metrics, replication_advertise=replication_advertise, metrics_advertise=metrics_advertise
    )
    tls = server_tls(f"tidings broker {zone}/{id}")
    check_metrics_tls("tidings broker", metrics, metrics_tls, tls)
    keyset = auth_keys(keys, keys_file)  # (with keys every RPC needs a token; without, none is checked)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()
    cfg = BrokerConfig(
        etcd=etcd,
        zone=zone,
        suffix=id,
        listen=listen,
        advertise=advertise,
        replication_listen=replication_listen,
        replication_advertise=replication_advertise,
        data_dir=data_dir,
        root=root,
        journal_limit=journal_limit,
        metrics_listen=metrics or None,
        metrics_advertise=metrics_advertise,
        metrics_tls=metrics_tls,
        metrics_journals=metrics_journals,
        stall_timeout=stall_timeout,
        min_append_rate=min_append_rate,
        max_append_rate=max_append_rate,
        pulse_interval=pulse_interval,
        lease_ttl=lease_ttl,
        exit_timeout=exit_timeout,
        tls=tls,
        **etcd_security(f"tidings broker {zone}/{id}"),
        auth_keys=keyset,
        default_store=default_store,
        persist_delay=persist_delay,
        prune_interval=prune_interval,
        auto_suspend=auto_suspend,
    )

    serve_until_signalled(Broker(cfg).start, f"broker {zone}/{id}", exit_timeout)


def metrics_url(announced: str) -> str:
    """The /metrics URL of a broker's announced metrics endpoint (HOST:PORT, or https://HOST:PORT when it
    serves --metrics-tls)."""
    if not announced:
        return ""
    return f"{announced if '://' in announced else 'http://' + announced}/metrics"


@cluster.command("up")
def cluster_up(
    brokers: Annotated[
        int, typer.Option(envvar="TIDINGS_BROKERS", help="Number of brokers.", callback=at_least("--brokers", 1))
    ] = 3,
    zones: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_ZONES", help="Spread brokers over this many zones.", callback=at_least("--zones", 1)
        ),
    ] = 1,
    data_dir: Annotated[
        Path, typer.Option(envvar="TIDINGS_DATA_DIR", help="etcd's and the brokers' data; kept across restarts.")
    ] = Path("data"),
    port: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_PORT", help="First broker's port; the others follow.", callback=at_least("--port", 1)
        ),
    ] = 8080,
    metrics_port: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_METRICS_PORT",
            help="First broker's /metrics port; the others follow (0: each broker's port + 1000, or any free one).",
            callback=at_least("--metrics-port", 0),
        ),
    ] = 0,
    listen_host: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_LISTEN_HOST",
            help="Where etcd and the brokers listen: 127.0.0.1, ::1, or an address other hosts reach "
            "(0.0.0.0 or :: need --advertise-host).",
        ),
    ] = "127.0.0.1",
    advertise_host: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_ADVERTISE_HOST",
            help="The address etcd and the brokers announce (each broker's --advertise); default: --listen-host.",
        ),
    ] = "",
    metrics_tls: MetricsTLSOpt = False,
    keys: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Private etcd + N brokers on one host (loopback unless --listen-host), in the foreground; Ctrl-C
    stops everything.

    Restarting on the same --data-dir keeps journals and their data. If this process dies (even
    by SIGKILL), its brokers and etcd get SIGTERM and exit."""
    from tidings.cluster import LocalCluster
    from tidings.cluster.etcd import endpoint_of, port_free

    ranges = [(flag, first) for flag, first in (("--port", port), ("--metrics-port", metrics_port)) if first]
    for flag, first in ranges:  # (what the flags say is wrong first: it does not depend on what else runs)
        if first + brokers - 1 > 65535:
            usage(f"{flag} {first}: the {brokers} brokers' ports would pass 65535: give a lower {flag}")
    if metrics_port and not (metrics_port + brokers <= port or port + brokers <= metrics_port):
        usage(f"--metrics-port {metrics_port} overlaps the brokers' ports from --port {port}: give another")
    try:
        lc = LocalCluster(
            brokers=brokers,
            zones=zones,
            data_dir=data_dir,
            port=port,
            metrics_port=metrics_port,
            listen_host=listen_host,
            advertise_host=advertise_host,
        )
    except UsageError as mistake:  # (a wildcard --listen-host without --advertise-host)
        usage(str(mistake))
    for flag, first in ranges:
        for at in range(first, first + brokers):  # (before anything starts: one line, not a broker's death)
            if not port_free(at, lc.listen_host):  # (TIME-WAIT left by a cluster just stopped is no conflict)
                usage(f"{flag} {first}: {endpoint_of(lc.listen_host, at)} is taken or not this host's address: "
                      f"give another {flag} or --listen-host (the brokers use {brokers} ports from it)")  # fmt: skip
    lc.tls = server_tls("tidings cluster up")  # (checked before anything starts; brokers and etcd serve with it)
    check_metrics_tls("tidings cluster up", "auto", metrics_tls, lc.tls)
    if metrics_tls:
        lc.extra.append("--metrics-tls")
    if auth_keys(keys, keys_file) is not None:  # (checked here: a mistake is one line, not N brokers' deaths)
        text = keys or Path(keys_file or "").read_text(encoding="ascii")
        lc.auth_keys = " ".join(text.split())  # (to the brokers' environment: never their command lines)
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        lc.start()
        if lc.cleared:
            out.print(f"cleared {lc.cleared} member keys left by an earlier run", highlight=False)
        out.print(f"etcd     {lc.etcd_endpoint}")
        scheme = "https" if metrics_tls else "http"
        for b in lc.brokers:
            metrics_at = f"  metrics={scheme}://{b.metrics_endpoint}/metrics" if b.metrics_endpoint else ""
            out.print(f"broker   {b.endpoint}  zone={b.zone} id={b.suffix}{metrics_at}", highlight=False)
        out.print(f"store    {lc.store_url}  (for journals without stores)")
        if lc.tls is not None:
            out.print("tls      on, brokers and etcd: clients pass --tls-ca (--tls-cert/--tls-key if they want them)")
        if lc.auth_keys:
            out.print("auth     on: clients pass --auth-token (sign one with `tidings auth token` and these keys)")
        out.print("ready; Ctrl-C stops the cluster", style="bold")
        while not stop and all(b.alive() for b in lc.brokers):
            _pause(lambda: stop)
        for b in lc.brokers:
            if not b.alive():
                assert b.proc is not None
                err.print(
                    f"[red]error:[/red] broker {b.suffix} exited with {b.proc.returncode}; stopping the cluster "
                    f"(see {b.data_dir / 'broker.log'})",
                    highlight=False,
                    soft_wrap=True,
                )
    finally:
        lc.stop()
        out.print("cluster stopped")


def _pause(done: Callable[[], bool]) -> None:
    """Idle up to half a second in the foreground, returning early once `done()`."""
    import time

    t = time.monotonic()
    while not done() and time.monotonic() - t < 0.5:
        time.sleep(0.05)


def _member_rows(resp: pb.MembersResponse) -> list[dict[str, Any]]:
    return [
        {
            "zone": m.spec.id.zone,
            "id": m.spec.id.suffix,
            "endpoint": m.spec.endpoint,
            "journals": m.journals,
            "primaries": m.primaries,
            "journal_limit": m.spec.journal_limit,
            "exiting": m.spec.exiting,
            "metrics": metrics_url(m.spec.metrics_endpoint),
        }
        for m in resp.members
    ]


def _members_table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    t = Table("zone", "id", "endpoint", "journals", "primaries", "exiting", "metrics")
    for r in rows:
        t.add_row(r["zone"], r["id"], r["endpoint"], str(r["journals"]), str(r["primaries"]),
                  "yes" if r["exiting"] else "", r["metrics"])  # fmt: skip
    return t


@members.command("list")
def members_list(broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The brokers of the cluster: zone, id, endpoint, journals held and led, exiting, metrics address."""

    async def go() -> pb.MembersResponse:
        async with broker_client(broker) as c:
            return await c.members()

    rows = _member_rows(run_async(go()))
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        out.print(_members_table(rows))


def refused_appends(spec: pb.JournalSpec, probe: pb.ReadResponse) -> bool:
    """Whether the journal refuses appends now with INDEX_HAS_GREATER_OFFSET, from a write-head probe:
    its fragment index ends past its replicas' spool (which a suspended journal's resume offset moves)."""
    if spec.flags == pb.JournalSpec.O_RDONLY or probe.status == pb.SUSPENDED or not probe.HasField("spool_end"):
        return False  # (no spool_end: the replica is not synchronized yet, or the broker predates it)
    return max(probe.spool_end, spec.suspend.offset) < probe.write_head


STATUS_CONCURRENCY = 16  # journals asked about at once by `tidings status`


async def _journal_status(c: AsyncClient, j: pb.ListResponse.Journal) -> dict[str, Any]:
    """One journal's line of `tidings status`: its route, heads and size, and what is wrong with it."""
    spec, route = j.spec, j.route
    names = [f"{m.zone}/{m.suffix}" for m in route.members]
    row: dict[str, Any] = {
        "name": spec.name,
        "replication": spec.replication,
        "primary": names[route.primary] if route.primary >= 0 else "",
        "replicas": names,
        "consistent": j.consistent,
        "head": None,
        "persisted_head": None,
        "first_byte": None,
        "size": None,
        "problems": [],
    }
    problems = row["problems"]
    level = spec.suspend.level
    row["suspended"] = pb.JournalSpec.Suspend.Level.Name(level).lower() if level else ""
    if level == pb.JournalSpec.Suspend.FULL:  # (no replicas, nothing held: its next append lands at its offset)
        return row | {"head": spec.suspend.offset, "persisted_head": spec.suspend.offset, "size": 0}
    desired = desired_replication(spec)
    if route.primary < 0:
        problems.append("no primary")
    if len(names) < desired:
        problems.append(f"under-replicated: {len(names)} of {desired} replicas")
    if not j.consistent:
        problems.append("route not yet synchronized by its primary")
    if route.primary < 0:
        return row
    try:
        probe = await c.probe(spec.name, -1)
        frags = [e.spec for e in (await c.fragments(spec.name)).fragments]
    except TidingsError as exc:
        problems.append(str(exc))
        return row
    head = probe.write_head
    if j.consistent and refused_appends(spec, probe):
        problems.append(
            f"appends refused: its fragments end at {head}, past the replicas' write head {probe.spool_end} (an "
            f"earlier journal's fragments in its store, or every replica lost): `tidings journals reset-head "
            f"{spec.name}` appends after them, or delete them from the store"
        )
    first = min((f.begin for f in frags), default=head)
    row |= {
        "head": head,
        "persisted_head": max((f.end for f in frags if f.backing_store), default=0),
        "first_byte": first,
        "size": head - first,
    }
    return row


def status(broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One screen: the brokers, each journal with its primary, replicas, synchronization, write head,
    persisted head and size held, and anything unhealthy (it exits 0 either way: see `problems`)."""
    import asyncio

    async def go() -> tuple[pb.MembersResponse, list[dict[str, Any]]]:
        async with broker_client(broker) as c:
            member_resp, listed = await asyncio.gather(c.members(), c.list())
            limit = asyncio.Semaphore(STATUS_CONCURRENCY)

            async def one(j: pb.ListResponse.Journal) -> dict[str, Any]:
                async with limit:
                    return await _journal_status(c, j)

            return member_resp, list(await asyncio.gather(*(one(j) for j in listed.journals)))

    member_resp, rows = run_async(go())
    member_rows = _member_rows(member_resp)
    problems = [f"broker {m['zone']}/{m['id']} is exiting" for m in member_rows if m["exiting"]]
    problems += [f"journal {r['name']}: {p}" for r in rows for p in r["problems"]]
    if as_json:
        print(json.dumps({"members": member_rows, "journals": rows, "problems": problems}))
        return
    out.print(f"members ({len(member_rows)})", style="bold")
    out.print(_members_table(member_rows))
    from rich.table import Table

    t = Table("journal", "R", "primary", "replicas", "synced", "suspended", "head", "persisted", "size", "problems")
    for r in rows:
        shown = ["" if r[k] is None else str(r[k]) for k in ("head", "persisted_head", "size")]
        t.add_row(r["name"], str(r["replication"]), r["primary"], " ".join(r["replicas"]),
                  "yes" if r["consistent"] else "no", r["suspended"], *shown, "; ".join(r["problems"]))  # fmt: skip
    out.print(f"journals ({len(rows)})", style="bold")
    out.print(t)
    if problems:
        out.print(f"{len(problems)} problem{'s' if len(problems) > 1 else ''}:", style="bold red")
        for p in problems:
            out.print(f"  {p}", highlight=False)
    else:
        out.print("healthy", style="bold green")


def demo(
    data_dir: Annotated[Path, typer.Option(envvar="TIDINGS_DATA_DIR")] = Path("data/demo"),
) -> None:
    """The pipeline: etcd + 3 brokers, transactional producers, a Spark streaming aggregation written exactly
    once to a journal and a table, checked against what was committed; then stops everything."""
    from tidings.cli.demo import run_demo

    run_demo(data_dir, out)
