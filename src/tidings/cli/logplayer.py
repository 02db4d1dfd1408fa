"""`tidings target serve`, `tidings logplayer run`, `tidings wal append` and `tidings targets
status`: a WAL journal delivered to storage shards, exactly once and in order (tidings.logplayer).

Every command that needs the targets reads the same targets.yaml (`--targets`, env
TIDINGS_TARGETS): the target ids, their endpoints, and so the key -> target mapping.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tidings.cli._common import (
    DEFAULT_BROKER,
    AuthKeysFileOpt,
    AuthKeysOpt,
    BrokerOpt,
    JournalArg,
    MetricsOpt,
    MetricsTLSOpt,
    at_least,
    auth_keys,
    broker_client,
    check_endpoint,
    check_log_level,
    check_metrics_tls,
    client_auth,
    client_tls,
    err,
    group,
    out,
    plural,
    run_async,
    serve_until_signalled,
    server_tls,
    usage,
)
from tidings.protocol.status import JournalNotFoundError, TidingsError, UsageError, ValidationError

if TYPE_CHECKING:  # (annotations only: a command imports these, and grpc, once it runs)
    from tidings.client import AsyncClient
    from tidings.logplayer.player import LogPlayer
    from tidings.logplayer.wal import Targets

target = group("Run a LogPlayer target (a storage shard).")
targets_cmd = group("The targets of targets.yaml.")
logplayer = group("Deliver a WAL journal to its targets.")
wal = group("Append transactions to a WAL journal.")


def register(root: typer.Typer) -> None:
    root.add_typer(target, name="target")
    root.add_typer(targets_cmd, name="targets")
    root.add_typer(logplayer, name="logplayer")
    root.add_typer(wal, name="wal")


TargetsOpt = Annotated[
    Path,
    typer.Option("--targets", envvar="TIDINGS_TARGETS", help="targets.yaml: each target's id and endpoint."),
]


def _load_targets(path: Path) -> Targets:
    from tidings.logplayer.wal import Targets

    try:
        return Targets.load(path)
    except (UsageError, ValidationError) as exc:
        usage(str(exc))


@target.command("serve")
def target_serve(
    id: Annotated[str, typer.Option("--id", envvar="TIDINGS_ID", help="The target's id, as in targets.yaml.")],
    db: Annotated[Path, typer.Option(envvar="TIDINGS_DB", help="The target's SQLite file (created if missing).")],
    listen: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_LISTEN",
            help="HOST:PORT of the Target service (port 0: any free one).",
            callback=check_endpoint("--listen", any_port=True),
        ),
    ] = "127.0.0.1:7000",
    data_listen: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_DATA_LISTEN",
            help="HOST:PORT of the data port: the Target service over tidings' own framing, which LogPlayers "
            "deliver over (default: --listen's host, any free port; its GetLastAck answers name the port).",
            callback=check_endpoint("--data-listen", optional=True, any_port=True),
        ),
    ] = "",
    apply: Annotated[
        str, typer.Option(envvar="TIDINGS_APPLY", help="module:function applying an entry (default: key-values).")
    ] = "",
    log_applied: Annotated[
        bool, typer.Option(help="Keep an apply log (table `applied`: index and timestamps of each entry).")
    ] = False,
    metrics: MetricsOpt = "",
    metrics_tls: MetricsTLSOpt = False,
    log_level: Annotated[str, typer.Option(envvar="TIDINGS_LOG_LEVEL", callback=check_log_level)] = "info",
    keys: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Serve a target: apply what a LogPlayer delivers, each batch with its last index in one SQLite
    transaction. Prints `READY HOST:PORT` once it serves; SIGTERM stops it. With --auth-keys every call
    needs a token allowing it on `target=ID` (APPEND to deliver, READ to ask its last index)."""
    from tidings.logplayer.target import TargetServer, load_apply
    from tidings.protocol import validate

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        validate.shard_id(id, "--id")
        fn = load_apply(apply) if apply else None
    except (UsageError, ValidationError) as exc:
        usage(str(exc))
    tls, keyset = server_tls(f"tidings target {id}"), auth_keys(keys, keys_file)
    check_metrics_tls(f"tidings target {id}", metrics, metrics_tls, tls)
    server = TargetServer(id, db, listen, apply=fn, log_applied=log_applied, metrics_listen=metrics or None,
                          metrics_tls=metrics_tls, tls=tls, auth_keys=keyset, data_listen=data_listen)  # fmt: skip
    serve_until_signalled(server.start, f"target {id}", 10.0)


@logplayer.command("run")
def logplayer_run(
    wal_journal: Annotated[str, typer.Option("--wal", envvar="TIDINGS_WAL", help="The WAL journal.")],
    targets: TargetsOpt = Path("targets.yaml"),
    broker: BrokerOpt = DEFAULT_BROKER,
    state: Annotated[
        Path | None,
        typer.Option(envvar="TIDINGS_STATE", help="The state file (default: data/logplayer/<wal>.state)."),
    ] = None,
    max_batch: Annotated[int, typer.Option(callback=at_least("--max-batch", 1), help="Entries per batch.")] = 256,
    dummy_every: Annotated[
        int, typer.Option(help="Send idle targets a dummy entry every this many entries (0: never).")
    ] = 1000,
    checkpoint_every: Annotated[
        int,
        typer.Option(
            callback=at_least("--checkpoint-every", 1),
            help="Entries between the main stream's read checkpoints (where a restart or a recovery resumes).",
        ),
    ] = 1000,
    ack_timeout: Annotated[
        float, typer.Option(help="Seconds without an acknowledgement before a target counts as down.")
    ] = 5.0,
    progress: Annotated[float, typer.Option(help="Seconds between progress lines on stderr (0: none).")] = 5.0,
    metrics: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_METRICS",
            help="HOST:PORT serving Prometheus /metrics; '' off.",
            callback=check_endpoint("--metrics", True),
        ),
    ] = "",
    metrics_tls: MetricsTLSOpt = False,
    log_level: Annotated[str, typer.Option(envvar="TIDINGS_LOG_LEVEL", callback=check_log_level)] = "info",
    keys: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Deliver the WAL journal to every target of targets.yaml, in order, exactly once, until SIGTERM.
    Prints `READY` once the main stream started, then progress lines (current index, targets up,
    the most lagging target). Exit code 1 if a newer LogPlayer fences this one. Its calls to brokers and
    targets carry --auth-token (LIST, READ on the WAL; APPEND, READ on every target: no selector), or with
    --auth-keys a token it signs per call (never expiring while it runs)."""
    import asyncio
    import signal

    from tidings.logplayer.player import LogPlayer
    from tidings.member.serving import serve_metrics, stop_metrics
    from tidings.protocol import validate

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        validate.journal_name(wal_journal, "--wal")
    except ValidationError as exc:
        usage(str(exc))
    declared = _load_targets(targets)
    state_path = state or Path("data/logplayer") / (wal_journal.replace("/", "_") + ".state")
    tls = client_tls()  # (the brokers' and the targets')
    check_metrics_tls("tidings logplayer run", metrics, metrics_tls, tls)
    auth = client_auth(auth_keys(keys, keys_file), sub=f"logplayer {wal_journal}")  # (the brokers' and targets')

    async def go() -> None:
        from tidings.client import AsyncClient

        server = None
        if metrics:
            host, port = metrics.rsplit(":", 1)
            server, at = serve_metrics(metrics, host, int(port), "logplayer", tls if metrics_tls else None)
            err.print(f"metrics on {'https' if metrics_tls else 'http'}://{at}/metrics", highlight=False)
        # (a wrong --broker or WAL fails here, within 30 s: a server process may start beside its brokers)
        async with AsyncClient(broker, retries=1_000_000, deadline=30.0, tls=tls, auth=auth) as probe:
            await probe.write_head(wal_journal)
        async with AsyncClient(broker, retries=None, tls=tls, auth=auth) as client:  # (it waits out broker outages)
            player = LogPlayer(client, wal_journal, declared, state_path=state_path, max_batch=max_batch,
                               dummy_every=dummy_every, ack_timeout=ack_timeout,
                               checkpoint_every=checkpoint_every)  # fmt: skip
            running = asyncio.ensure_future(player.run())
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            stopping = asyncio.ensure_future(stop.wait())
            ready = asyncio.ensure_future(player.ready.wait())
            await asyncio.wait([running, ready, stopping], return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                print("READY", flush=True)
            reporter = asyncio.ensure_future(_progress(player, progress))
            try:
                await asyncio.wait([running, stopping], return_when=asyncio.FIRST_COMPLETED)
            finally:
                reporter.cancel()
                ready.cancel()
                if not running.done():
                    running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                stop_metrics(server)
            if not stopping.done():
                running.result()  # (what ended it: fenced, a target the WAL names and the file does not)

    run_async(go())


async def _progress(player: LogPlayer, every: float) -> None:
    import asyncio

    if every <= 0:
        return
    said, quiet = "", 0.0
    while True:
        await asyncio.sleep(every)  # (a periodic report)
        quiet += every
        st = player.status()
        ts = st["targets"]
        up = sum(1 for t in ts.values() if t["up"])
        worst = max(ts, key=lambda t: ts[t]["lag"])
        w = ts[worst]
        why = f"  {w['error']}" if w["error"] else ""
        behind = f"most behind: {worst} ({w['lag']} WAL bytes, queue {w['state']}){why}"
        line = f"index {st['current_index']}  targets up {up}/{len(ts)}  {behind}"
        if line != said or quiet >= 60:  # (a line when something changed, and one a minute)
            err.print(line, highlight=False)
            said, quiet = line, 0.0


@wal.command("append")
def wal_append(
    journal: JournalArg,
    targets: TargetsOpt = Path("targets.yaml"),
    broker: BrokerOpt = DEFAULT_BROKER,
) -> None:
    """Append transactions read from stdin, one JSON per line: a list of mutations
    ({"key": K, "value": JSON} or {"key": K, "delete": true}), or {"mutations": [...], "uuid": U}
    to retry a transaction with the UUID an earlier attempt printed (applied once either way).
    Prints {"index": I, "uuid": U} per transaction as the WAL commits it."""
    import msgspec

    declared = _load_targets(targets)

    async def go() -> None:
        from tidings.logplayer.wal import WalWriter

        async with broker_client(broker, 30.0) as client:
            if await client.describe(journal) is None:
                raise TidingsError(f"journal {journal!r} does not exist: nothing was appended; create it with "
                                   "`tidings journals apply` (README: LogPlayer)")  # fmt: skip
            writer = WalWriter(client, journal, declared)
            appended = 0
            try:
                for n, line in enumerate(sys.stdin, 1):
                    if not line.strip():
                        continue
                    before = f" ({plural(appended, 'transaction')} before it appended)" if appended else ""
                    shape = 'give a JSON list of mutations, or {"mutations": [...], "uuid": "..."}'
                    try:
                        doc = msgspec.json.decode(line)
                        if isinstance(doc, dict):
                            doc = [doc.get("mutations"), doc.get("uuid", "")]
                        elif isinstance(doc, list):
                            doc = [doc, ""]
                        else:
                            kind = {bool: "true/false", int: "number", float: "number", str: "string"}.get(type(doc))
                            raise TypeError(f"a JSON {kind or 'null'}, not a transaction")
                        mutations, uuid = doc
                        if not isinstance(mutations, list) or not isinstance(uuid, str):
                            raise TypeError('"mutations" must be a list, "uuid" a string')
                        entry = writer.prepare(mutations, uuid)
                    except ValidationError as exc:  # (a bad line, read after others were appended: exit 1)
                        raise TidingsError(f"stdin line {n}: {exc}{before}") from None
                    except (msgspec.DecodeError, TypeError) as exc:
                        raise TidingsError(f"stdin line {n}: {exc}: {shape}{before}") from None
                    try:
                        index = await writer.append(entry)
                    except JournalNotFoundError:  # (deleted meanwhile: refused, so not appended)
                        raise TidingsError(f"stdin line {n}: journal {journal!r} does not exist: it was not "
                                           f"appended{before}") from None  # fmt: skip
                    except TidingsError as exc:  # (whether it landed is unknown: its UUID makes a retry safe)
                        raise TidingsError(
                            f"stdin line {n}: {exc}; whether it was appended is unknown: append it again as "
                            f'{{"mutations": ..., "uuid": "{entry.uuid}"}} (applied once either way){before}'
                        ) from None
                    appended += 1
                    print(json.dumps({"index": index, "uuid": entry.uuid}), flush=True)
            finally:
                await writer.aclose()

    run_async(go())


def _or_unknown(value: object) -> str:
    return "unknown" if value is None else str(value)


PENDING_SCAN = 4 << 20  # WAL bytes `targets status --wal` reads past a target's last entry


@targets_cmd.command("status")
def targets_status(
    targets: TargetsOpt = Path("targets.yaml"),
    wal_journal: Annotated[
        str,
        typer.Option(
            "--wal",
            envvar="TIDINGS_WAL",
            help="Also show each target's WAL bytes pending: from the first entry meant for it that it has not "
            "applied, to the WAL's head (0: it applied all meant for it).",
        ),
    ] = "",
    broker: BrokerOpt = DEFAULT_BROKER,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per target.")] = False,
) -> None:
    """Each target's last applied index and the newest LogPlayer epoch it accepted (GetLastAck)."""
    from tidings.logplayer.player import last_acks
    from tidings.protocol import protocol_pb2 as pb

    declared = _load_targets(targets)

    async def pending(client: AsyncClient, target: str, applied: int, head: int) -> int | None:
        """WAL bytes from the first entry after `applied` that holds a part for `target` to the head:
        0 when none does (it has everything meant for it). Scans at most PENDING_SCAN bytes, then
        counts from where it stopped; None if the entry at `applied` is gone (retention)."""
        from tidings.logplayer.wal import WalEntry
        from tidings.message.iterators import ReadUncommitted

        start = max(applied, 0)
        reader = ReadUncommitted(client, wal_journal, offsets={wal_journal: start}, end_offsets={wal_journal: head},
                                 message_type=WalEntry, block=False, on_garbage=lambda *_: None)  # fmt: skip
        first = applied >= 0  # (the entry it applied last comes first, unless retention removed it)
        async for env in reader:
            if first:
                if env.begin != applied:
                    return None
                first = False
                continue
            if env.message.parts.get(target) or env.begin - start > PENDING_SCAN:
                return head - env.begin
        return None if first else 0

    async def go() -> tuple[dict[str, pb.LastAckResponse | str], int | None, dict[str, int | None]]:
        answers = await last_acks(declared, tls=client_tls(), auth=client_auth())
        head: int | None = None
        after: dict[str, int | None] = {}
        if wal_journal:
            async with broker_client(broker) as client:
                head = await client.write_head(wal_journal)
                for t in declared.targets:
                    a = answers[t.id]
                    if isinstance(a, pb.LastAckResponse) and a.status == pb.OK:  # (-1: nothing applied yet)
                        after[t.id] = await pending(client, t.id, a.last_applied, head)
        return answers, head, after

    answers, head, after = run_async(go())
    rows = []
    for t in declared.targets:
        a = answers[t.id]
        row: dict[str, Any]
        if isinstance(a, pb.LastAckResponse) and a.status == pb.OK:
            row = {"id": t.id, "endpoint": t.endpoint, "up": True, "last_applied": a.last_applied, "epoch": a.epoch}
        else:
            why = a if isinstance(a, str) else f"{pb.Status.Name(a.status)}: {a.detail}"
            row = {"id": t.id, "endpoint": t.endpoint, "up": False, "error": why}
        if t.id in after:  # (None: what it applied last is gone from the WAL, so unknown)
            row["pending_bytes"] = after[t.id]
        rows.append(row)
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        from rich.table import Table

        table = Table(
            "target", "endpoint", "up", "last applied", "epoch", *(["pending WAL bytes"] if head is not None else [])
        )
        for row in rows:
            extra = [_or_unknown(row.get("pending_bytes", ""))] if head is not None else []
            if row["up"]:
                table.add_row(row["id"], row["endpoint"], "yes", str(row["last_applied"]), str(row["epoch"]), *extra)
            else:
                table.add_row(row["id"], row["endpoint"], "no: " + row["error"], "", "", *extra)
        out.print(table)
    if not all(r["up"] for r in rows):
        raise typer.Exit(1)
