"""`tidings consumer` (run a consumer process) and `tidings shards ...` (manage a consumer's shards
through any of its processes' Shard service: --consumer HOST:PORT, env TIDINGS_CONSUMER)."""

from __future__ import annotations

import json
import logging
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
    MetricsOpt,
    MetricsTLSOpt,
    at_least,
    auth_keys,
    broker_client,
    check_advertised,
    check_endpoint,
    check_log_level,
    check_metrics_tls,
    client_auth,
    client_tls,
    edit_then_apply,
    editor,
    etcd_security,
    group,
    load_yaml,
    out,
    run_async,
    serve_until_signalled,
    server_tls,
    usage,
)
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import documents, shard_from_dict, shard_to_dict
from tidings.protocol.status import TidingsError, ValidationError

if TYPE_CHECKING:  # (annotations only: a command imports the client, and grpc, once it runs)
    from tidings.consumer.client import ShardClient

shards = group("A consumer's shards (through any of its processes).")


def register(root: typer.Typer) -> None:
    from tidings.cli import shards_recovery  # noqa: F401  (its commands join the `shards` group)

    root.command()(consumer)
    root.add_typer(shards, name="shards")


ConsumerOpt = Annotated[
    str,
    typer.Option(
        "--consumer",
        envvar="TIDINGS_CONSUMER",
        help="Any consumer process of the application, HOST:PORT (its --listen).",
        callback=check_endpoint("--consumer (TIDINGS_CONSUMER)"),
    ),
]
DEFAULT_CONSUMER = "127.0.0.1:9090"
STATUS_NAMES = {v: k for k, v in pb.ReplicaStatus.Code.items()}


def _shard_id(value: str) -> str:
    if value:
        try:
            validate.shard_id(value, "shard")
        except ValidationError as exc:
            usage(str(exc))
    return value


def _shard_client(consumer: str) -> ShardClient:
    from tidings.consumer.client import ShardClient

    return ShardClient(consumer, tls=client_tls(), auth=client_auth())


def consumer(
    app_ref: Annotated[
        str,
        typer.Option("--app", envvar="TIDINGS_APP", help="The application: module:factory (called with no arguments)."),
    ],
    etcd: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_ETCD",
            help="etcd endpoint HOST:PORT (https://HOST:PORT: over TLS).",
            callback=check_endpoint("--etcd", schemes=True),
        ),
    ],
    broker: BrokerOpt = DEFAULT_BROKER,
    zone: Annotated[str, typer.Option(envvar="TIDINGS_ZONE", help="Failure zone.")] = "local",
    id: Annotated[str, typer.Option("--id", envvar="TIDINGS_ID", help="Process suffix, unique in its zone.")] = "c0",
    listen: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_LISTEN",
            help="HOST:PORT of the Shard service (port 0: any free one).",
            callback=check_endpoint("--listen", any_port=True),
        ),
    ] = DEFAULT_CONSUMER,
    advertise: AdvertiseOpt = "",
    root: Annotated[
        str, typer.Option(envvar="TIDINGS_ROOT", help="etcd key prefix of this application's shards.")
    ] = "/tidings/consumers/default",
    data_dir: Annotated[
        Path,
        typer.Option(
            envvar="TIDINGS_DATA_DIR",
            help="Shards' local files (SQLite stores): every process of the application must reach the same one.",
        ),
    ] = Path("data/consumer"),
    shard_limit: Annotated[
        int, typer.Option(envvar="TIDINGS_SHARD_LIMIT", help="Most shard replicas this process takes.")
    ] = 1024,
    metrics: MetricsOpt = "auto",
    metrics_advertise: MetricsAdvertiseOpt = "",
    metrics_tls: MetricsTLSOpt = False,
    lease_ttl: Annotated[int, typer.Option(envvar="TIDINGS_LEASE_TTL", callback=at_least("--lease-ttl", 1))] = 5,
    exit_timeout: Annotated[
        float, typer.Option(envvar="TIDINGS_EXIT_TIMEOUT", help="On SIGTERM, seconds to wait for shards to move away.")
    ] = 60.0,
    log_level: Annotated[str, typer.Option(envvar="TIDINGS_LOG_LEVEL", callback=check_log_level)] = "info",
    keys: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Run a consumer process in the foreground: it serves the shards the allocator gives it. Prints
    `READY HOST:PORT` once it serves (then `METRICS HOST:PORT`); SIGTERM hands its shards to other
    processes (at most --exit-timeout seconds), then exits; exit code 1 if its etcd lease is lost.
    With --auth-keys it checks a token on every Shard call and signs its own calls to the brokers."""
    from tidings.consumer.service import Consumer, ConsumerConfig, load_app
    from tidings.member.serving import advertised

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    who = f"tidings consumer {zone}/{id}"
    tls, etcd_access = server_tls(who), etcd_security(who)  # (the flags' mistakes first: before the app loads)
    keyset = auth_keys(keys, keys_file)
    check_advertised("tidings consumer", metrics, metrics_advertise=metrics_advertise)
    check_metrics_tls("tidings consumer", metrics, metrics_tls, tls)
    try:
        advertised(listen, advertise, "tidings consumer")  # (an address nobody could dial: one line, first)
        application = load_app(app_ref)
    except TidingsError as exc:
        usage(str(exc))
    cfg = ConsumerConfig(
        etcd=etcd,
        broker=broker,
        app=application,
        zone=zone,
        suffix=id,
        listen=listen,
        advertise=advertise,
        root=root,
        data_dir=data_dir,
        shard_limit=shard_limit,
        lease_ttl=lease_ttl,
        metrics_listen=metrics or None,
        metrics_advertise=metrics_advertise,
        metrics_tls=metrics_tls,
        exit_timeout=exit_timeout,
        tls=tls,
        **etcd_access,
        auth_keys=keyset,
    )

    serve_until_signalled(Consumer(cfg).start, f"consumer {zone}/{id}", exit_timeout)


# -- shards --------------------------------------------------------------------------------------


@shards.command("apply")
def shards_apply(
    file: Path,
    consumer: ConsumerOpt = DEFAULT_CONSUMER,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would change; change nothing.")] = False,
) -> None:
    """Create, update or delete shards from a YAML file (fields and defaults: docs/shards.md); prints
    per shard what changed: created, updated (the fields, old -> new), deleted, unchanged."""
    _apply_file(file, consumer, dry_run)


def _apply_file(file: Path, consumer: str, dry_run: bool = False) -> None:
    loaded = load_yaml(file, "shard", "docs/shards.md")
    docs = documents(loaded, "shard")
    specs = [(d, shard_from_dict(d, f"{file.name}[{i}]")) for i, d in enumerate(docs)]
    ids = [spec.id for _d, spec in specs]
    if dup := next((n for n in ids if ids.count(n) > 1), None):
        usage(f"{file} names shard {dup!r} more than once: give each shard once")

    async def go() -> None:
        async with _shard_client(consumer) as sc:
            current = {s.spec.id: s for s in (await sc.list()).shards}
            changes, report = [], []
            for d, spec in specs:
                cur = current.get(spec.id)
                rev = d["revision"] if "revision" in d else (cur.mod_revision if cur is not None else 0)
                if d.get("delete"):
                    if cur is None:
                        raise TidingsError(f"{file}: shard {spec.id!r} does not exist: there is nothing to delete")
                    changes.append(pb.ShardApplyRequest.Change(delete=spec.id, expect_mod_revision=rev))
                    report.append(f"deleted {spec.id}")
                elif cur is None:
                    changes.append(pb.ShardApplyRequest.Change(upsert=spec, expect_mod_revision=rev))
                    report.append(f"created {spec.id}")
                elif cur.spec == spec:
                    report.append(f"unchanged {spec.id}")
                else:
                    old, new = shard_to_dict(cur.spec), shard_to_dict(spec)
                    changed = "; ".join(f"{k} {old[k]!r} -> {new[k]!r}" for k in new if old.get(k) != new[k])
                    changes.append(pb.ShardApplyRequest.Change(upsert=spec, expect_mod_revision=rev))
                    report.append(f"updated {spec.id}: {changed}")
            if changes and not dry_run:
                await sc.apply(changes)
            for line in report:
                out.print(line, highlight=False, soft_wrap=True)
            if dry_run:
                out.print("dry run: nothing applied", style="bold")

    run_async(go())


async def _listed(consumer: str, broker: str, selector: str, progress: bool) -> list[dict[str, Any]]:
    """Shards as `list` shows them: spec, revision, primary, statuses and (`progress`) the primary's
    read-through offsets and the lag behind each source's write head."""
    from tidings.consumer.recovery import recovery_log

    rows = []
    async with _shard_client(consumer) as sc:
        resp = await sc.list(labels.parse_selector(selector) if selector else None)
        heads: dict[str, int] = {}
        if progress and resp.shards:
            logs = {recovery_log(s.spec) for s in resp.shards if s.spec.recovery_log_prefix}
            async with broker_client(broker) as c:
                for journal in sorted({src.journal for s in resp.shards for src in s.spec.sources} | logs):
                    try:
                        heads[journal] = await c.write_head(journal)
                    except TidingsError:
                        pass  # (a deleted source: its shard says FAILED)
        for s in resp.shards:
            members = [f"{m.zone}/{m.suffix}" for m in s.route.members]
            statuses = {m: STATUS_NAMES.get(st.code, str(st.code)) for m, st in zip(members, s.status, strict=True)}
            errors = [e for st in s.status for e in st.errors]
            row = {**shard_to_dict(s.spec), "revision": s.mod_revision}
            primary = members[s.route.primary] if s.route.primary >= 0 else ""
            row |= {"primary": primary, "status": statuses, "errors": errors}
            if progress:
                through: dict[str, int] = {}
                if primary and statuses.get(primary) == "PRIMARY":
                    try:
                        through = dict((await sc.stat(s.spec.id, timeout=5.0)).read_through)
                    except (TidingsError, TimeoutError):
                        pass
                row["read_through"] = through
                row["lag"] = {j: max(0, heads[j] - through.get(j, 0)) for j in through if j in heads}
                if s.spec.recovery_log_prefix:
                    row["recovery_log_lag"] = await _log_lags(sc, s, heads.get(recovery_log(s.spec)))
            rows.append(row)
    return rows


async def _log_lags(sc: ShardClient, s: pb.ShardListResponse.Shard, head: int | None) -> dict[str, int]:
    """Each replica's recovery-log lag: the log's write head less what it played (or recorded) through."""
    lags: dict[str, int] = {}
    if head is None:
        return lags
    for m, endpoint in zip(s.route.members, s.route.endpoints, strict=False):
        try:
            stat = await sc.replica_stat(s.spec.id, endpoint)
        except (TidingsError, TimeoutError):
            continue  # (gone meanwhile: the next list shows it)
        if stat.status == pb.OK and stat.recovery_log.journal:
            lags[f"{m.zone}/{m.suffix}"] = max(0, head - stat.recovery_log.offset)
    return lags


@shards.command("list")
def shards_list(
    consumer: ConsumerOpt = DEFAULT_CONSUMER,
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Label selector, e.g. app=wc (id=ID selects one).")] = "",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    as_yaml: Annotated[bool, typer.Option("--yaml", help="Specs only, as `shards apply` reads them.")] = False,
) -> None:
    """List shards: status of each replica, the primary, read-through offsets and lag in bytes behind
    each source's write head (asked of the primary, and of --broker), and for a shard with a recovery
    log each replica's lag in bytes behind the log's write head."""
    rows = run_async(_listed(consumer, broker, selector, progress=not as_yaml))
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    if as_yaml:
        keep = [{k: v for k, v in r.items() if k not in ("primary", "status", "errors")} for r in rows]
        import yaml

        print(yaml.safe_dump({"shards": keep}, sort_keys=False))
        return
    from rich.table import Table

    t = Table("id", "status", "primary", "read through", "lag", "recovery log lag", "sources")
    for r in rows:
        status = " ".join(f"{m}:{s}" for m, s in r["status"].items()) or "unassigned"
        if r["errors"]:
            status += " (" + "; ".join(r["errors"]) + ")"
        t.add_row(
            r["id"],
            status,
            r["primary"],
            " ".join(f"{j}@{o}" for j, o in r["read_through"].items()),
            str(sum(r["lag"].values())) if r["lag"] else "",
            " ".join(f"{m}:{n}" for m, n in r.get("recovery_log_lag", {}).items()),
            " ".join(s if isinstance(s, str) else s["journal"] for s in r["sources"]),
        )
    out.print(t)


@shards.command("unassign")
def shards_unassign(
    ids: Annotated[list[str], typer.Argument(help="Shard ids.", callback=lambda v: [_shard_id(i) for i in v])],
    consumer: ConsumerOpt = DEFAULT_CONSUMER,
    failed: Annotated[bool, typer.Option("--failed", help="Only shards whose primary FAILED.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say which would be; change nothing.")] = False,
) -> None:
    """Remove shards' assignments so the allocator assigns them afresh (after mending a FAILED one)."""

    async def go() -> list[str]:
        async with _shard_client(consumer) as sc:
            return await sc.unassign(ids, only_failed=failed, dry_run=dry_run)

    done = run_async(go())
    verb = "would unassign" if dry_run else "unassigned"
    out.print(f"{verb} {' '.join(done)}" if done else "nothing to unassign", highlight=False)


@shards.command("edit")
def shards_edit(
    id: Annotated[str, typer.Argument(help="The shard to edit (or --selector).", callback=_shard_id)] = "",
    consumer: ConsumerOpt = DEFAULT_CONSUMER,
    selector: Annotated[str, typer.Option(help="Edit every shard it matches, e.g. app=wc.")] = "",
) -> None:
    """Open shard specs in $VISUAL or $EDITOR (as `list --yaml` prints them) and apply what you change,
    each at the revision it was read at (gazctl's edit); a failed apply keeps your edit in a file."""
    if bool(id) == bool(selector):
        usage("give a shard ID or --selector S (one of them)")
    chosen = editor("shards edit")
    rows = run_async(_listed(consumer, "", f"id={id}" if id else selector, progress=False))
    if not rows:
        raise TidingsError(f"no shard matches {id or selector!r} (see `tidings shards list`)")
    keep = [{k: v for k, v in r.items() if k not in ("primary", "status", "errors")} for r in rows]
    import yaml

    text = yaml.safe_dump({"shards": keep}, sort_keys=False)
    edit_then_apply(text, chosen, lambda path: _apply_file(path, consumer), "tidings shards apply")
