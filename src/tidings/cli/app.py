"""`tidings`: run a local cluster or a broker, and manage journals.

Client commands reach the cluster through `--broker HOST:PORT` (env TIDINGS_BROKER, default
127.0.0.1:8080); any broker will do. Every flag of `broker` and `cluster up` has a TIDINGS_*
environment variable too (named in each command's -h).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import (
    desired_replication,
    documents,
    format_duration,
    given,
    spec_changes,
    spec_from_dict,
    spec_to_dict,
)
from tidings.protocol.status import TidingsError, ValidationError

if TYPE_CHECKING:
    from rich.table import Table

# Plain help (rich_markup_mode=None): no boxes cut to the terminal, no "<bool>" beside every flag;
# -h as well as --help; shell completion (--install-completion).
_PLAIN = {"rich_markup_mode": None, "context_settings": {"help_option_names": ["-h", "--help"]}}
app = typer.Typer(help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False, **_PLAIN)  # type: ignore[arg-type]
journals = typer.Typer(help="Create, list, append to and read journals.", no_args_is_help=True, **_PLAIN)  # type: ignore[arg-type]
cluster = typer.Typer(help="Run a local cluster (private etcd + brokers).", no_args_is_help=True, **_PLAIN)  # type: ignore[arg-type]
members = typer.Typer(help="The cluster's brokers.", no_args_is_help=True, **_PLAIN)  # type: ignore[arg-type]
app.add_typer(journals, name="journals")
app.add_typer(cluster, name="cluster")
app.add_typer(members, name="members")
# Client commands say what went wrong in one line of their own; the library's log records (an
# AppendService's retry advice, say) would add lines naming APIs. `broker` configures logging.
logging.getLogger("tidings").addHandler(logging.NullHandler())
err = Console(stderr=True, soft_wrap=True)  # (a line is not cut at 80 columns when piped)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 100_000)  # (piped: tables not cut at 80)


def usage(message: str) -> NoReturn:
    """A user's mistake in a flag or argument: one line on stderr, exit code 2 (as for any usage error)."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def plural(n: int, noun: str) -> str:
    """'1 message', '2 messages'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def line_span(first: int, last: int) -> str:
    """'stdin line 3', 'stdin lines 1 to 5', or 'no stdin line' for an empty span."""
    if last < first:
        return "no stdin line"
    return f"stdin line {first}" if first == last else f"stdin lines {first} to {last}"


def _endpoint(
    flag: str, optional: bool = False, also: tuple[str, ...] = (), any_port: bool = False
) -> Callable[[str], str]:
    """A flag's check that its value is HOST:PORT ('' too when `optional`, or one of `also`), before
    anything connects (`localhost` alone went to port 443, `foo:bar` to a resolver error)."""

    def check(value: str) -> str:
        if (optional and value == "") or value in also:
            return value
        host, colon, port = value.rpartition(":")
        least = 0 if any_port else 1  # (port 0: any free one, printed once serving)
        if not colon or not host or not (port.isascii() and port.isdigit()) or not least <= int(port) < 65536:
            forms = ["HOST:PORT", *(repr(w) for w in (*also, *([""] if optional else [])))]
            said = forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]
            usage(f"{flag} {value!r} is not {said}: give a host and a port from {least} to 65535, e.g. 127.0.0.1:8080")
        return value

    return check


def _at_least(flag: str, least: int) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value < least:
            usage(f"{flag} is {value}: give {least} or more")
        return value

    return check


def _log_level(value: str) -> str:
    if value.upper() not in logging.getLevelNamesMapping():
        usage(f"--log-level (TIDINGS_LOG_LEVEL) {value!r} is not a level: give debug, info, warning or error")
    return value


def _journal_name(value: str) -> str:
    """A journal argument's name checked before anything connects (a usage error, not a broker's refusal)."""
    from tidings.protocol import validate
    from tidings.protocol.status import ValidationError

    if value:
        try:
            validate.journal_name(value, "journal")
        except ValidationError as exc:
            usage(str(exc))
    return value


JournalArg = Annotated[str, typer.Argument(help="A journal name, e.g. shop/orders.", callback=_journal_name)]
BrokerOpt = Annotated[
    str,
    typer.Option(
        "--broker",
        envvar="TIDINGS_BROKER",
        help="Any broker, HOST:PORT.",
        callback=_endpoint("--broker (TIDINGS_BROKER)"),
    ),
]
DEFAULT_BROKER = "127.0.0.1:8080"
MetricsOpt = Annotated[
    str,
    typer.Option(
        envvar="TIDINGS_METRICS",
        help="HOST:PORT serving Prometheus /metrics; auto: --listen's port + 1000; '' off.",
        callback=_endpoint("--metrics", True, also=("auto",)),
    ),
]


def _version(value: bool) -> None:
    if value:
        from tidings import __version__

        print(f"tidings {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)
    ] = False,
) -> None:
    pass


def main() -> None:
    """Entry point: run the app, turning TidingsErrors into one clear line and exit code 1 (2 for
    input that is invalid, a usage error: a spec field, a journal name, a flag)."""
    try:
        _only(sys.argv[1] if len(sys.argv) > 1 else "")()
    except TidingsError as exc:
        # escape: "[s3]" in "pip install 'tidings[s3]'" is text, not markup; soft_wrap: one line, however long
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise SystemExit(2 if isinstance(exc, ValidationError) else 1) from None


def _only(name: str) -> typer.Typer:
    """The application with only the group or command `name` when one has it (else all of it): typer
    reads the signature of every command it builds, ~0.1 s for all of ours at each start, and a
    script's call runs one. `--help`, a misspelt command and options before the command see them all."""
    from typer.main import get_command_name

    groups = [g for g in app.registered_groups if g.name == name]
    commands = [c for c in app.registered_commands if (c.name or get_command_name(c.callback.__name__)) == name]  # type: ignore[union-attr]
    if not groups and not commands:
        return app
    slim = copy.copy(app)
    slim.registered_groups, slim.registered_commands = groups, commands
    return slim


def _run(coro):
    import asyncio

    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)


def _client(broker: str, deadline: float = 0.0):
    """A client of `broker`: with a `deadline`, retrying transient failures for that many seconds."""
    from tidings.client import AsyncClient

    return AsyncClient(broker, retries=1_000_000 if deadline else 8, deadline=deadline, fail_fast=True)


# -- broker and cluster --------------------------------------------------------------------


@app.command()
def broker(
    etcd: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_ETCD", help="etcd endpoint HOST:PORT.", callback=_endpoint("--etcd (TIDINGS_ETCD)")
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
            callback=_endpoint("--listen (TIDINGS_LISTEN)"),
        ),
    ] = ("127.0.0.1:8080"),
    replication_listen: Annotated[
        str,
        typer.Option(
            envvar="TIDINGS_REPLICATION_LISTEN",
            help="HOST:PORT for other brokers' replication streams; '' takes --listen's host and any free port "
            "(announced in etcd).",
            callback=_endpoint("--replication-listen", optional=True),
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
            callback=_endpoint("--metrics", True, also=("auto",)),
        ),
    ] = "auto",
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
            callback=_at_least("--prune-interval", 0),
        ),
    ] = 300.0,
    log_level: Annotated[
        str, typer.Option(envvar="TIDINGS_LOG_LEVEL", help="debug, info, warning or error.", callback=_log_level)
    ] = "info",
) -> None:
    """Run one broker in the foreground. Prints `READY HOST:PORT` once it serves (then `METRICS HOST:PORT`
    if it serves /metrics); SIGTERM hands
    its journals to other brokers (at most --exit-timeout seconds), then exits. It exits with 1 if
    its etcd lease is lost (etcd unreachable for longer than --lease-ttl)."""
    from tidings.broker._malloc import tune_malloc
    from tidings.broker.service import Broker, BrokerConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()
    cfg = BrokerConfig(
        etcd=etcd,
        zone=zone,
        suffix=id,
        listen=listen,
        replication_listen=replication_listen,
        data_dir=data_dir,
        root=root,
        journal_limit=journal_limit,
        metrics_listen=metrics or None,
        metrics_journals=metrics_journals,
        stall_timeout=stall_timeout,
        min_append_rate=min_append_rate,
        pulse_interval=pulse_interval,
        lease_ttl=lease_ttl,
        exit_timeout=exit_timeout,
        default_store=default_store,
        persist_delay=persist_delay,
        prune_interval=prune_interval,
        auto_suspend=auto_suspend,
    )

    serve_until_signalled(Broker(cfg).start, f"broker {zone}/{id}", exit_timeout)


def serve_until_signalled(start: Callable[[], Any], who: str, exit_timeout: float) -> None:
    """Run a server process in the foreground: start it, print `READY HOST:PORT [METRICS HOST:PORT]`,
    stop it gracefully on SIGTERM or SIGINT (exit code 0), or without hand-off once its etcd lease is
    lost (exit code 1). A signal during start (which may wait for a previous process's member key to
    expire) cancels it; start then undoes what it began."""
    import asyncio

    log = logging.getLogger("tidings.cli")

    async def run() -> int:
        from tidings._tasks import dump_tasks_on_sigusr1

        dump_tasks_on_sigusr1()  # `kill -USR1 PID` logs where every task waits
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        signalled = asyncio.ensure_future(stop.wait())
        starting = asyncio.ensure_future(start())
        await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.wait([starting])
            log.info("%s: stopped by a signal before it was ready", who)
            return 0
        try:
            server = starting.result()
        except OSError as exc:
            raise TidingsError(f"{who} could not start: {exc}") from None
        metrics_at = f" METRICS {server.metrics_endpoint}" if server.metrics_endpoint else ""
        print(f"READY {server.endpoint}{metrics_at}", flush=True)
        if server.metrics_endpoint:
            log.info("%s: metrics on http://%s/metrics", who, server.metrics_endpoint)
        announcement = getattr(server, "announcement", None)  # (a server without an etcd lease cannot lose one)
        lost = asyncio.ensure_future(announcement.lost.wait() if announcement is not None else asyncio.Event().wait())
        await asyncio.wait([signalled, lost], return_when=asyncio.FIRST_COMPLETED)
        graceful = not lost.done()
        if not graceful:
            log.error("%s: its etcd lease is lost; stopping without hand-off", who)
        # Every step of stop() is bounded; this is the backstop should one of them still hang.
        watchdog = _exit_unless_stopped_within(exit_timeout + 60, who)
        try:
            await server.stop(graceful=graceful)
        finally:
            watchdog.cancel()
        return 0 if graceful else 1

    code = _run(run())
    if code:
        raise typer.Exit(code)


def _exit_unless_stopped_within(seconds: float, who: str):  # -> threading.Timer
    """Start a timer that ends the process (exit code 2) if a stop has not finished by then.

    A thread, so it fires even if the event loop is stuck.
    """
    import threading

    def fire() -> None:
        logging.getLogger("tidings.cli").error("%s: stop did not finish within %.0fs; exiting now", who, seconds)
        logging.shutdown()
        os._exit(2)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


@cluster.command("up")
def cluster_up(
    brokers: Annotated[
        int, typer.Option(envvar="TIDINGS_BROKERS", help="Number of brokers.", callback=_at_least("--brokers", 1))
    ] = 3,
    zones: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_ZONES", help="Spread brokers over this many zones.", callback=_at_least("--zones", 1)
        ),
    ] = 1,
    data_dir: Annotated[
        Path, typer.Option(envvar="TIDINGS_DATA_DIR", help="etcd's and the brokers' data; kept across restarts.")
    ] = Path("data"),
    port: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_PORT", help="First broker's port; the others follow.", callback=_at_least("--port", 1)
        ),
    ] = 8080,
    metrics_port: Annotated[
        int,
        typer.Option(
            envvar="TIDINGS_METRICS_PORT",
            help="First broker's /metrics port; the others follow (0: each broker's port + 1000, or any free one).",
            callback=_at_least("--metrics-port", 0),
        ),
    ] = 0,
) -> None:
    """Private etcd + N brokers on loopback, in the foreground; Ctrl-C stops everything.

    Restarting on the same --data-dir keeps journals and their data. If this process dies (even
    by SIGKILL), its brokers and etcd get SIGTERM and exit."""
    from tidings.cluster import LocalCluster
    from tidings.cluster.etcd import port_free

    ranges = [(flag, first) for flag, first in (("--port", port), ("--metrics-port", metrics_port)) if first]
    for flag, first in ranges:  # (what the flags say is wrong first: it does not depend on what else runs)
        if first + brokers - 1 > 65535:
            usage(f"{flag} {first}: the {brokers} brokers' ports would pass 65535: give a lower {flag}")
    if metrics_port and not (metrics_port + brokers <= port or port + brokers <= metrics_port):
        usage(f"--metrics-port {metrics_port} overlaps the brokers' ports from --port {port}: give another")
    for flag, first in ranges:
        for at in range(first, first + brokers):  # (before anything starts: one line, not a broker's death)
            if not port_free(at):  # (TIME-WAIT left by a cluster just stopped is no conflict)
                usage(f"{flag} {first}: 127.0.0.1:{at} is taken (another process listens there): give another "
                      f"{flag} (the brokers use {brokers} ports from it)")  # fmt: skip
    lc = LocalCluster(brokers=brokers, zones=zones, data_dir=data_dir, port=port, metrics_port=metrics_port)
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
        for b in lc.brokers:
            metrics_at = f"  metrics=http://{b.metrics_endpoint}/metrics" if b.metrics_endpoint else ""
            out.print(f"broker   {b.endpoint}  zone={b.zone} id={b.suffix}{metrics_at}", highlight=False)
        out.print(f"store    {lc.store_url}  (for journals without stores)")
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


def _pause(done) -> None:
    """Idle up to half a second in the foreground, returning early once `done()`."""
    import time

    t = time.monotonic()
    while not done() and time.monotonic() - t < 0.5:
        time.sleep(0.05)


# -- journals ------------------------------------------------------------------------------


@journals.command("apply")
def journals_apply(
    file: Path,
    broker: BrokerOpt = DEFAULT_BROKER,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would change; change nothing.")] = False,
) -> None:
    """Create, update or delete journals from a YAML file (every field, with its default: docs/specs.md);
    prints per journal what changed: created, updated (the fields, old -> new), deleted, unchanged."""
    _apply_file(file, broker, dry_run)


def load_yaml(file: Path, what: str, doc: str) -> Any:
    """A YAML file of specs (`what`: "journal", "shard"), its every mistake one usage line."""
    import yaml

    try:
        with file.open() as f:  # (a stream: YAML's errors then name the file, not "<unicode string>")
            loaded = yaml.safe_load(f)
    except OSError as exc:
        usage(f"cannot read {file}: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        usage(f"{file} is not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8")
    except yaml.YAMLError as exc:
        usage(f"{file} is not valid YAML: {' '.join(str(exc).split())}")
    if loaded is None:
        usage(f"{file} is empty: give a {what} spec, a list of them, or {what}s: [...] (see {doc})")
    return loaded


def editor(command: str) -> str:
    """The user's editor ($VISUAL, $EDITOR, else vi on a terminal), checked before anything connects."""
    chosen = os.environ.get("VISUAL") or os.environ.get("EDITOR") or ""
    if not chosen:
        if not sys.stdin.isatty():
            usage(f"{command} needs $EDITOR (or $VISUAL) when no terminal can run vi")
        chosen = "vi"
    return chosen


def edit_then_apply(text: str, editor: str, apply: Callable[[Path], None], again: str) -> None:
    """Open `text` in `editor` and `apply` the file it is saved to, if changed; a failed apply keeps
    the file and says so (`again`: the command that applies it)."""
    import shlex
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix="tidings-edit-", suffix=".yaml", delete=False) as f:
        f.write(text)
    path = Path(f.name)
    try:
        code = subprocess.call([*shlex.split(editor), str(path)])
    except (OSError, ValueError) as exc:  # (not found, not runnable, unbalanced quotes)
        path.unlink()
        usage(f"cannot run the editor {editor!r} ({exc}): set $EDITOR (or $VISUAL) to one, e.g. EDITOR=nano")
    if code != 0:
        raise TidingsError(f"{editor} exited with {code}: nothing applied (your edit is in {path})")
    if path.read_text() == text:
        path.unlink()
        out.print("no changes")
        return
    try:
        apply(path)
    except (TidingsError, typer.Exit):
        err.print(f"your edit is in {path}: fix it, then `{again} {path}`", highlight=False, soft_wrap=True)
        raise
    path.unlink()


def _apply_file(file: Path, broker: str, dry_run: bool = False) -> None:
    docs = documents(load_yaml(file, "journal", "docs/specs.md"))
    specs = [(d, spec_from_dict(d, f"{file.name}[{i}]")) for i, d in enumerate(docs)]
    names = [spec.name for _d, spec in specs]
    if dup := next((n for n in names if names.count(n) > 1), None):
        usage(f"{file} names journal {dup!r} more than once: give each journal once")
    _check_stores(file, specs)

    async def go() -> None:
        async with _client(broker) as c:
            current = {j.spec.name: j for j in (await c.list()).journals}
            changes, report = _plan(file, specs, current)
            warnings: list[str] = []
            if changes and not dry_run:
                warnings = list((await c.apply(changes)).warnings)  # (all or nothing: one etcd transaction)
            for line in report:
                out.print(line, highlight=False, soft_wrap=True)
            for w in warnings:
                err.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False, soft_wrap=True)
            if dry_run:
                out.print("dry run: nothing applied", style="bold")

    _run(go())


def _plan(
    file: Path, specs: list[tuple[dict, pb.JournalSpec]], current: dict[str, pb.ListResponse.Journal]
) -> tuple[list[pb.ApplyRequest.Change], list[str]]:
    """The changes a file asks of the journals in etcd, and a line per journal saying what each does."""
    changes, report = [], []
    for d, spec in specs:
        name, cur = spec.name, current.get(spec.name)
        if "revision" in d:
            rev = d["revision"]  # (a whole number: spec_from_dict checked it)
            if cur is None and rev:
                raise TidingsError(
                    f"{file}: journal {name!r} does not exist, but the file expects it at revision {rev}: "
                    "drop `revision` to create it"
                )
        else:
            rev = cur.mod_revision if cur is not None else 0
        if d.get("delete"):
            if cur is None:
                raise TidingsError(f"{file}: journal {name!r} does not exist: there is nothing to delete")
            changes.append(pb.ApplyRequest.Change(delete=name, expect_mod_revision=rev))
            report.append(f"deleted {name}")
            continue
        if cur is None:
            changes.append(pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=rev))
            report.append(f"created {name}")
            continue
        if not given(d, "suspend") and cur.spec.HasField("suspend"):
            spec.suspend.CopyFrom(cur.spec.suspend)  # (brokers set it: a file that omits it keeps it)
        changed = spec_changes(cur.spec, spec)
        if not changed:
            report.append(f"unchanged {name}")
            continue
        changes.append(pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=rev))
        report.append(f"updated {name}: " + "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()))
        if reset := [k for k in changed if not given(d, k)]:
            err.print(
                f"[yellow]warning:[/yellow] {escape(name)}: {escape(str(file))} omits {', '.join(reset)}, which "
                "return to their defaults (a spec replaces the whole spec; give them to keep them)",
                highlight=False,
                soft_wrap=True,
            )
    return changes, report


def _check_stores(file: Path, specs: list[tuple[dict, pb.JournalSpec]]) -> None:
    """Refuse, before sending anything, a store this machine cannot load (its fsspec backend is missing).

    The brokers check again on Apply; checking here too means `journals read`, which reads persisted
    fragments straight from the store, will work from this machine as well.
    """
    from tidings.fragment.store import check_store_url

    for i, (d, spec) in enumerate(specs):
        if not d.get("delete"):
            for j, url in enumerate(spec.fragment.stores):
                check_store_url(url, f"{file.name}[{i}].fragment.stores[{j}]")


@journals.command("delete")
def journals_delete(
    journal: JournalArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
) -> None:
    """Delete a journal's spec, at the revision it has now (its brokers then drop it). Its fragments
    stay in its stores: a journal created again under the name finds them, and its first append
    fails with INDEX_HAS_GREATER_OFFSET until `tidings journals reset-head NAME` (as in Gazette)."""

    async def lookup() -> pb.ListResponse.Journal | None:
        async with _client(broker) as c:
            resp = await c.list(labels.parse_selector(f"name={journal}"))
            return next((j for j in resp.journals if j.spec.name == journal), None)

    found = _run(lookup())
    if found is None:
        raise TidingsError(f"journal {journal!r} does not exist: nothing to delete (see `tidings journals list`)")
    if not yes:
        if not sys.stdin.isatty():
            usage(f"deleting journal {journal!r} needs --yes when no terminal can confirm it")
        typer.confirm(f"Delete journal {journal!r} (revision {found.mod_revision})?", abort=True)

    async def delete() -> None:
        async with _client(broker) as c:
            await c.apply([pb.ApplyRequest.Change(delete=journal, expect_mod_revision=found.mod_revision)])

    _run(delete())
    out.print(f"deleted {journal}", highlight=False)


@journals.command("edit")
def journals_edit(
    name: Annotated[str, typer.Argument(help="The journal to edit (or --selector).", callback=_journal_name)] = "",
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Edit every journal it matches, e.g. app=shop.")] = "",
) -> None:
    """Open journal specs in $VISUAL or $EDITOR (as `list --yaml` prints them) and apply what you
    change, each at the revision it was read at (gazctl's edit): a spec changed meanwhile fails the
    whole apply, and your edit is kept in a file to apply again."""
    if bool(name) == bool(selector):
        usage("give a journal NAME or --selector S (one of them)")
    chosen = editor("journals edit")
    wanted = f"name={name}" if name else selector

    async def go() -> pb.ListResponse:
        async with _client(broker) as c:
            return await c.list(labels.parse_selector(wanted))

    rows = _rows(_run(go()), routes=False)
    if not rows:
        raise TidingsError(f"no journal matches {name or selector!r} (see `tidings journals list`)")
    import yaml

    text = yaml.safe_dump({"journals": rows}, sort_keys=False)
    edit_then_apply(text, chosen, lambda path: _apply_file(path, broker), "tidings journals apply")


def _rows(resp: pb.ListResponse, routes: bool = True) -> list[dict]:
    """Journals as `list` prints them: each spec, its revision, and (`routes`) its primary and replicas."""
    rows = []
    for j in resp.journals:
        row = {**spec_to_dict(j.spec), "revision": j.mod_revision}
        if routes:
            members = [f"{m.zone}/{m.suffix}" for m in j.route.members]
            row |= {"primary": members[j.route.primary] if j.route.primary >= 0 else "", "replicas": members}
        rows.append(row)
    return rows


@journals.command("list")
def journals_list(
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Label selector, e.g. app=shop,!tmp")] = "",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    as_yaml: Annotated[bool, typer.Option("--yaml")] = False,
) -> None:
    """List journals with their routes."""

    async def go() -> pb.ListResponse:
        async with _client(broker) as c:
            return await c.list(labels.parse_selector(selector) if selector else None)

    rows = _rows(_run(go()))
    if as_json:
        for row in rows:
            print(json.dumps(row))
    elif as_yaml:
        import yaml

        print(yaml.safe_dump({"journals": rows}, sort_keys=False))
    else:
        from rich.table import Table

        t = Table("name", "R", "primary", "replicas", "labels", "revision")
        for row in rows:
            values = row["labels"].items()
            lbls = ",".join(f"{k}={one}" for k, v in values for one in (v if isinstance(v, list) else [v]))
            t.add_row(
                row["name"],
                str(row["replication"]),
                row["primary"],
                " ".join(row["replicas"]),
                lbls,
                str(row["revision"]),
            )
        out.print(t)


DeadlineOpt = Annotated[
    float,
    typer.Option(
        "--deadline",
        help="Seconds to go on retrying transient failures (a primary just killed, a broker restarting) after "
        "the first one, before giving up.",
        callback=_at_least("--deadline", 0),
    ),
]


@journals.command("append")
def journals_append(
    journal: JournalArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    file: Annotated[Path | None, typer.Option(help="Read content from FILE instead of stdin.")] = None,
    offset: Annotated[int, typer.Option(help="Expected write head (0: any).")] = 0,
    deadline: DeadlineOpt = 30.0,
) -> None:
    """Append stdin (or --file) atomically; print the committed span as JSON. Transient failures are
    retried for up to --deadline seconds, never twice into the journal: a zero-byte append first
    takes the write head, and after an answer lost in transport (or not come within the deadline)
    another one tells whether the content landed there."""
    if file is not None and not file.is_file():
        usage(f"--file {str(file)!r} is not a file: give the path of a file to append, or pipe to stdin")

    async def go():
        import grpc

        from tidings.client import AppendResult
        from tidings.client._async import ATTEMPT_TIMEOUT
        from tidings.protocol.status import TransportError, WrongAppendOffsetError

        src = _Content.of_file(file) if file else await _Content.of_stdin()
        # An attempt whose answer does not come is a failure too: within the deadline, and a second per MiB.
        wait = (min(ATTEMPT_TIMEOUT, max(deadline, 2.0)) if deadline else ATTEMPT_TIMEOUT) + src.size / (1 << 20)
        async with _client(broker, deadline) as c:
            head = (await c.append(journal, b"")).end  # (a barrier: where the append lands, with no other writer)
            attempt, failing_since = 0, 0.0
            while True:
                try:  # (refusals, which leave nothing written, are retried by the client until the deadline)
                    return await c.append(journal, src.chunks, offset=offset, retry_unknown=False, timeout=wait)
                except WrongAppendOffsetError:
                    raise TidingsError(
                        f"journal {journal!r}: --offset {offset} is not its write head {await c.write_head(journal)}: "
                        "nothing was appended; append at that --offset, or 0 for wherever the head is"
                    ) from None
                except TransportError as exc:  # the answer was lost: did it commit?
                    failing_since = failing_since or time.monotonic()
                    lost = exc.retriable or exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
                    if not lost or c.retry.gives_up(attempt, failing_since):
                        raise
                    await c.backoff(attempt)
                    attempt += 1
                    now = (await c.append(journal, b"")).end
                    if now == head:
                        continue  # nothing landed: try again
                    if now == head + src.size and (sha1 := await src.sum_at(c, journal, head)):
                        return AppendResult(journal, head, now, {}, sha1)
                    raise TidingsError(
                        f"journal {journal!r}: an attempt's answer was lost ({exc}) and the journal moved from "
                        f"{head} to {now} meanwhile: whether the content landed is unknown; check with `tidings "
                        f"journals read {journal} --offset {head}` before appending it again"
                    ) from None

    print(json.dumps(_run(go()).to_json()))


class _Content:
    """What `journals append` sends: a file it reads again for each attempt, from `start`, `size` bytes
    (stdin from a pipe or a terminal is first kept in a temporary file, read by a thread so that
    Ctrl-C stops it at once; nothing is appended before stdin ends, as an append is all or nothing).
    Not the AppendService, which finds a lost batch the same way: it takes content as bytes in
    memory, and a file to append may be larger than memory."""

    def __init__(self, fd: int, start: int, size: int, keep: Any = None) -> None:
        self.fd, self.start, self.size, self._keep = fd, start, size, keep

    @classmethod
    def of_file(cls, path: Path) -> _Content:
        f = open(path, "rb")
        return cls(f.fileno(), 0, os.fstat(f.fileno()).st_size, f)

    @classmethod
    async def of_stdin(cls) -> _Content:
        import asyncio
        import stat
        import tempfile

        fd = sys.stdin.fileno()
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):  # `< file`: read it in place
            start = os.lseek(fd, 0, os.SEEK_CUR)
            return cls(fd, start, info.st_size - start)
        spool = tempfile.TemporaryFile(prefix="tidings-append-")
        stdin, size = _Stdin(lines=False, slots=64), 0
        try:
            while (chunk := await stdin.get()) is not None:
                await asyncio.to_thread(spool.write, chunk)
                size += len(chunk)
        finally:
            stdin.stop()
        spool.flush()
        return cls(spool.fileno(), 0, size, spool)

    def chunks(self):  # -> Iterator[bytes]: a fresh read of the content, for one attempt
        at, end = self.start, self.start + self.size
        while at < end:
            chunk = os.pread(self.fd, min(256 * 1024, end - at), at)
            if not chunk:
                raise TidingsError(f"the content to append shrank while it was read ({at - self.start} of {self.size} "
                                   "bytes): nothing was appended")  # fmt: skip
            at += len(chunk)
            yield chunk

    async def sum_at(self, c, journal: str, begin: int) -> str:
        """The content's SHA1 (hex) if the journal holds exactly it at [begin, begin + size), else ""."""
        import hashlib

        ours, theirs = hashlib.sha1(), hashlib.sha1()
        for chunk in self.chunks():
            ours.update(chunk)
        async for chunk in c.read(journal, begin, end_offset=begin + self.size):
            theirs.update(chunk.content)
        return ours.hexdigest() if ours.digest() == theirs.digest() else ""


@journals.command("read")
def journals_read(
    journal: JournalArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    offset: Annotated[int, typer.Option(help="Start offset; -1 is the write head.")] = 0,
    block: Annotated[bool, typer.Option(help="Wait for and tail new content.")] = False,
    end_offset: Annotated[int, typer.Option(help="Stop at this offset (0: none).")] = 0,
    committed: Annotated[
        bool, typer.Option(help="Decode messages and print each committed one once, as a JSON line.")
    ] = False,
    with_offsets: Annotated[
        bool, typer.Option(help='With --committed: print {"offset": N, "message": ...} per message.')
    ] = False,
    max_messages: Annotated[int, typer.Option(help="With --committed: stop after this many (0: no limit).")] = 0,
) -> None:
    """Write the journal's committed bytes to stdout (or, with --committed, its committed messages)
    from --offset to --end-offset (the write head unless --block)."""
    if offset < -1:
        usage(f"--offset {offset}: give 0 or more, or -1 for the write head")
    if end_offset < 0:
        usage(f"--end-offset {end_offset}: give 0 or more (0 for none)")
    if 0 < end_offset < offset:
        usage(f"--end-offset {end_offset} is before --offset {offset}: give one after it, or 0 for none")
    if max_messages < 0:
        usage(f"--max-messages {max_messages}: give 0 or more (0 for no limit)")
    if (with_offsets or max_messages) and not committed:
        usage("--with-offsets and --max-messages go with --committed")

    def jumped(j: str, begin: int, end: int) -> None:
        err.print(f"{j} holds no bytes [{begin}, {end}) any more (removed by retention?): reading on at {end}",
                  highlight=False)  # fmt: skip

    async def raw(c) -> None:
        on_jump = functools.partial(jumped, journal)
        async for chunk in c.reader(journal, offset, block=block, end_offset=end_offset, on_jump=on_jump):
            sys.stdout.buffer.write(chunk.content)

    async def messages(c, head: int) -> None:
        import msgspec

        from tidings.message import read_committed

        def garbage(j: str, g) -> None:
            if 0 < end_offset <= g.end:  # (the range is bytes: a message it ends inside is cut, not bad)
                err.print(f"--end-offset {end_offset} cuts the message at offset {g.begin}: not printed; end the "
                          "range at a message's end (the next one's offset)", highlight=False)  # fmt: skip
                return
            err.print(f"skipped undecodable bytes of {j} at [{g.begin}, {g.end}): {g.error}", highlight=False)

        encode, n = msgspec.json.Encoder().encode, 0
        start = offset if offset >= 0 else head
        reader = read_committed(
            c,
            journal,
            block=block,
            on_garbage=garbage,
            on_jump=jumped,
            offsets={journal: start},
            end_offsets={journal: end_offset},
        )
        async for env in reader:
            line = {"offset": env.begin, "message": env.message} if with_offsets else env.message
            sys.stdout.buffer.write(encode(line) + b"\n")
            n += 1
            if n == max_messages:
                break

    async def go() -> None:
        async with _client(broker) as c:
            head = await c.write_head(journal) if offset < 0 or not block else 0
            if not block and offset > head:
                usage(f"--offset {offset} is past the write head {head} of {journal!r}: give one at or below it, "
                      "or --block to wait for it")  # fmt: skip
            await (messages(c, head) if committed else raw(c))
        sys.stdout.buffer.flush()

    try:
        _run(go())
    except BrokenPipeError:
        os._exit(0)


@journals.command("suspend")
def journals_suspend(
    name: Annotated[str, typer.Argument(help="The journal to suspend (or --selector).", callback=_journal_name)] = "",
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Suspend every journal it matches, e.g. app=shop.")] = "",
    force: Annotated[
        bool, typer.Option("--force", help="Suspend even journals with content not yet persisted, or recent.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Suspend idle journals (gazctl's journals suspend): one holding nothing keeps no replica at all,
    others one replica serving reads; either costs no pipeline and no pulse. A journal is idle when
    everything it holds is persisted and its last fragment is older than its flush interval (24h
    without one); --force suspends it anyway. Its next append resumes it."""
    if bool(name) == bool(selector):
        usage("give a journal NAME or --selector S (one of them)")

    async def go() -> None:
        async with _client(broker) as c:
            listed = await c.list(labels.parse_selector(selector or f"name={name}"))
            if not listed.journals:
                what = f"journal {name!r} does not exist" if name else f"no journal matches --selector {selector!r}"
                raise TidingsError(f"{what} (see `tidings journals list`)")
            for j in listed.journals:
                done = await c.suspend(j.spec.name, force)
                level = ""
                if done:
                    after = await c.list(labels.parse_selector(f"name={j.spec.name}"))
                    spec = next((k.spec for k in after.journals if k.spec.name == j.spec.name), j.spec)
                    level = pb.JournalSpec.Suspend.Level.Name(spec.suspend.level).lower()
                if as_json:
                    print(json.dumps({"journal": j.spec.name, "suspended": done, "level": level}), flush=True)
                elif done:
                    print(f"{j.spec.name}: suspended ({level})", flush=True)
                else:
                    print(f"{j.spec.name}: not suspended: it holds content not yet persisted, or persisted within "
                          "its flush interval (--force to suspend it anyway)", flush=True)  # fmt: skip

    _run(go())


@journals.command("prune")
def journals_prune(
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Prune the journals it matches, e.g. app=shop (default: all).")] = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Remove the persisted fragments each journal's fragment.retention lets go (gazctl's prune), from
    its stores, reached from here. Only the oldest go, in offset order, so a journal never gets a hole
    in its middle: it starts later, and readers of a removed offset jump to its first byte. Brokers do
    this themselves every --prune-interval."""
    import asyncio

    from tidings.fragment import retention
    from tidings.fragment.fragment import Fragment

    async def go() -> None:
        async with _client(broker) as c:
            resp = await c.list(labels.parse_selector(selector) if selector else None)
            if not resp.journals:
                raise TidingsError(f"no journal matches --selector {selector!r} (see `tidings journals list`)")
            now = time.time()
            for j in resp.journals:
                name, retention_ms = j.spec.name, j.spec.fragment.retention_ms
                listed = await c.fragments(name)
                held = [Fragment.from_proto(e.spec) for e in listed.fragments]
                plan = retention.plan(name, held, retention_ms / 1000, now)
                if plan.aged and not dry_run:
                    try:
                        await asyncio.to_thread(retention.remove, plan.aged)
                    except Exception as exc:
                        raise TidingsError(f"removing fragments of {name!r} from its store failed: {exc}") from None
                row = {"journal": name, "retention": format_duration(retention_ms), "removed": len(plan.aged),
                       "removed_bytes": plan.aged_bytes, "kept": len(plan.kept), "kept_bytes": plan.kept_bytes,
                       "begin": plan.begin, "dry_run": dry_run}  # fmt: skip
                print(json.dumps(row) if as_json else _prune_line(row), flush=True)

    _run(go())


def _prune_line(row: dict) -> str:
    name, kept = row["journal"], f"kept {row['kept']} ({row['kept_bytes']} bytes)"
    if row["retention"] == "0s":
        return f"{name}: retention 0s (keep for ever): {kept}"
    verb = "would remove" if row["dry_run"] else "removed"
    return (f"{name}: {verb} {row['removed']} fragments ({row['removed_bytes']} bytes) older than "
            f"{row['retention']}; {kept}; it starts at offset {row['begin']}")  # fmt: skip


@journals.command("head")
def journals_head(
    journal: JournalArg, broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Print the journal's write head: the offset its next append lands at."""

    async def go() -> int:
        async with _client(broker) as c:
            return await c.write_head(journal)

    head = _run(go())
    print(json.dumps({"journal": journal, "head": head}) if as_json else head)


@app.command()
def publish(
    target: Annotated[str, typer.Argument(help="A journal name, or a label selector such as topic=clicks.")],
    broker: BrokerOpt = DEFAULT_BROKER,
    key: Annotated[
        str, typer.Option(help="With a selector: pick each message's journal by this field (rendezvous hashing).")
    ] = "",
    skip_invalid: Annotated[
        bool, typer.Option(help="Report a line that is no JSON object (or lacks --key) and go on, instead of stopping.")
    ] = False,
    flush_interval: Annotated[
        float,
        typer.Option(
            help="Seconds a line may wait for others to share its append (at most 1000 a batch).",
            callback=_at_least("--flush-interval", 0),
        ),
    ] = 0.05,
    retry_deadline: DeadlineOpt = 30.0,
) -> None:
    """Publish JSON lines from stdin as committed messages (each gets a sequencing UUID), as they
    come: `tail -f log | tidings publish j` commits each line within about --flush-interval. A line
    that already has a "uuid" field is refused: the publisher sets every message's UUID. Transient
    failures are retried for up to --deadline seconds (each batch lands once: after an answer lost
    in transport the journal is searched for it before a retry)."""
    import asyncio

    import msgspec

    from tidings.client import AppendService
    from tidings.message import JournalList, Mapping, Publisher, random_mapping, rendezvous_mapping

    is_selector = "=" in target or target.startswith("!")
    if not is_selector:
        _journal_name(target)
    if key and not is_selector:
        usage(f"--key picks a journal among those a selector matches; {target!r} names one journal: drop --key")
    decode = msgspec.json.Decoder(dict).decode

    def check(lineno: int, line: bytes) -> dict:
        """A line's message, or ValueError saying what is wrong with it."""
        try:
            msg = decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"stdin line {lineno} is not a JSON object ({exc})") from None
        if "uuid" in msg:
            raise ValueError(f'stdin line {lineno} has its own "uuid" field: the publisher sets it; rename the field')
        if key and key not in msg:
            raise ValueError(f"stdin line {lineno} has no {key!r} field (--key) to pick its journal by")
        return msg

    done = {"sent": 0, "through": 0, "flight": 0}  # messages published, the stdin line they reach, a batch's last

    def so_far() -> str:
        said = f"published {plural(done['sent'], 'message')} ({line_span(1, done['through'])})"
        if done["flight"]:  # (interrupted while a batch's appends were out: they may commit yet)
            said += f"; {line_span(done['through'] + 1, done['flight'])} were being published and may have been"
        return said

    async def go() -> tuple[int, set[str], str]:
        lines = _Stdin()
        async with _client(broker, retry_deadline) as c:
            if not is_selector and not (await c.list(labels.parse_selector(f"name={target}"))).journals:
                raise TidingsError(f"journal {target!r} does not exist: nothing was published; check the name with "
                                   "`tidings journals list`, or create it with `tidings journals apply`")  # fmt: skip
            journals = await JournalList(c, target).start() if is_selector else None
            mapping: Mapping | str = target
            if journals is not None:
                if not journals.names:
                    raise TidingsError(f"no journal matches the selector {target!r}; see `tidings journals list`")
                mapping = rendezvous_mapping(journals, lambda m: str(m.get(key))) if key else random_mapping(journals)
            pub = Publisher(AppendService(c), journals=journals)
            sent, written, bad, lineno, more = 0, set(), "", 0, True

            async def publish_batch(batch: list[dict], first: int, last: int) -> int:
                """Publish a batch, an append per journal (each all or nothing); on a failure, say
                exactly which journals' messages of stdin lines `first`..`last` were published."""
                groups: dict[str, list[dict]] = {}
                for msg in batch:
                    groups.setdefault(mapping if isinstance(mapping, str) else mapping(msg), []).append(msg)
                futures = [await pub.publish_committed(name, *msgs) for name, msgs in groups.items()]
                outcomes = await asyncio.gather(*futures, return_exceptions=True)
                failed = {n: o for n, o in zip(groups, outcomes, strict=True) if isinstance(o, BaseException)}
                ok = [n for n in groups if n not in failed]
                written.update(ok)
                if not failed:
                    return len(batch)
                exc = next(iter(failed.values()))
                if not isinstance(exc, TidingsError):
                    raise exc
                of_ok = sum(len(groups[n]) for n in ok)
                span = line_span(first, last)
                partly = f", and {of_ok} of {span} (those for {', '.join(ok)})" if ok else ""
                raise TidingsError(
                    f"{exc}; published {plural(done['sent'] + of_ok, 'message')} ({line_span(1, first - 1)}{partly}); "
                    f"not published: {span} for {', '.join(failed)}, and every line after {last}"
                )

            try:
                while more and not bad:
                    batch: list[dict] = []
                    deadline = None
                    while len(batch) < 1000:
                        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                        try:
                            line = await asyncio.wait_for(lines.get(), timeout)
                        except TimeoutError:
                            break
                        if line is None:
                            more = False
                            break
                        lineno += 1
                        if not line.strip():
                            continue
                        try:
                            batch.append(check(lineno, line))
                        except ValueError as exc:
                            if not skip_invalid:
                                bad = str(exc)
                                break
                            err.print(f"skipped {exc}", highlight=False)
                        deadline = deadline or time.monotonic() + flush_interval
                    if batch:  # (committed before the next batch is read: a line is never held longer)
                        last = lineno - bool(bad)
                        done["flight"] = last
                        sent += await publish_batch(batch, done["through"] + 1, last)
                        done.update(sent=sent, through=last, flight=0)
            finally:
                lines.stop()
                if journals is not None:
                    await journals.aclose()
            return sent, written, bad

    try:
        sent, written, bad = _run(go())
    except KeyboardInterrupt:
        err.print(f"interrupted: {so_far()}", highlight=False)
        raise typer.Exit(130) from None
    if bad:
        before = f"the {plural(sent, 'message')} before it were" if sent != 1 else "the message before it was"
        raise TidingsError(f"{bad}; {before} published, nothing after it")
    err.print(f"published {plural(sent, 'message')} to {', '.join(sorted(written)) or 'no journal'}", highlight=False)


class _Stdin:
    """stdin as a reader thread gets it, a line (or with `lines` False a read of up to 64 KiB) per
    `get()`, None at its end: the event loop never waits on a terminal or a pipe, so Ctrl-C stops a
    command at once. The thread (a daemon) hands items over with call_soon_threadsafe, at most
    `slots` waiting, and gives up quietly once `stop()`ped or the loop is gone."""

    def __init__(self, lines: bool = True, slots: int = 10_000) -> None:
        import asyncio
        import threading

        self.lines = lines
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.slots = threading.Semaphore(slots)
        self.stopped = threading.Event()
        threading.Thread(target=self._pump, name="stdin", daemon=True).start()

    async def get(self) -> bytes | None:
        item = await self.queue.get()
        self.slots.release()
        return item

    def stop(self) -> None:
        self.stopped.set()

    def _put(self, item: bytes | None) -> bool:
        while not self.slots.acquire(timeout=0.1):
            if self.stopped.is_set():
                return False
        if self.stopped.is_set():
            return False
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # (the loop is closed: the command is over)
            return False
        return True

    def _pump(self) -> None:  # (os.read: no lock of sys.stdin's held by a thread still reading at exit)
        fd, rest = sys.stdin.fileno(), b""
        while chunk := os.read(fd, 1 << 16):
            if not self.lines:
                if not self._put(chunk):
                    return
                continue
            *whole, rest = (rest + chunk).split(b"\n")
            for line in whole:
                if not self._put(line + b"\n"):
                    return
        if rest and not self._put(rest):
            return
        self._put(None)


@journals.command("fragments")
def journals_fragments(
    journal: JournalArg, broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """List the journal's fragments (local spools and persisted files)."""
    from tidings.fragment.fragment import Fragment

    async def go() -> pb.FragmentsResponse:
        async with _client(broker) as c:
            return await c.fragments(journal)

    resp = _run(go())
    from rich.table import Table

    t = Table("begin", "end", "sha1", "store", "url")
    for e in resp.fragments:
        f = Fragment.from_proto(e.spec)
        row = {"begin": f.begin, "end": f.end, "sum": f.sum.hex(), "store": f.backing_store, "url": e.url}
        if as_json:
            print(json.dumps(row))
        else:
            t.add_row(str(f.begin), str(f.end), f.sum.hex()[:12], f.backing_store or "(local)", e.url)
    if not as_json:
        out.print(t)


@journals.command("reset-head")
def journals_reset_head(journal: JournalArg, broker: BrokerOpt = DEFAULT_BROKER) -> None:
    """Confirm that every earlier broker is gone: let appends continue at the fragment index's end.

    Needed after INDEX_HAS_GREATER_OFFSET. It issues a zero-byte append whose expected offset is
    the largest offset of the journal's fragment index."""

    async def go():
        async with _client(broker) as c:
            frags = await c.fragments(journal)
            end = max((e.spec.end for e in frags.fragments), default=0)
            return await c.append(journal, b"", offset=end) if end else None

    result = _run(go())
    print(json.dumps({"journal": journal, "write_head": result.end if result else 0}))


# -- members and status --------------------------------------------------------------------


def _member_rows(resp: pb.MembersResponse) -> list[dict]:
    return [
        {
            "zone": m.spec.id.zone,
            "id": m.spec.id.suffix,
            "endpoint": m.spec.endpoint,
            "journals": m.journals,
            "primaries": m.primaries,
            "journal_limit": m.spec.journal_limit,
            "exiting": m.spec.exiting,
            "metrics": f"http://{m.spec.metrics_endpoint}/metrics" if m.spec.metrics_endpoint else "",
        }
        for m in resp.members
    ]


def _members_table(rows: list[dict]) -> Table:
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
        async with _client(broker) as c:
            return await c.members()

    rows = _member_rows(_run(go()))
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


async def _journal_status(c, j: pb.ListResponse.Journal) -> dict:
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


@app.command()
def status(broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One screen: the brokers, each journal with its primary, replicas, synchronization, write head,
    persisted head and size held, and anything unhealthy (it exits 0 either way: see `problems`)."""
    import asyncio

    async def go() -> tuple[pb.MembersResponse, list[dict]]:
        async with _client(broker) as c:
            member_resp, listed = await asyncio.gather(c.members(), c.list())
            limit = asyncio.Semaphore(STATUS_CONCURRENCY)

            async def one(j: pb.ListResponse.Journal) -> dict:
                async with limit:
                    return await _journal_status(c, j)

            return member_resp, list(await asyncio.gather(*(one(j) for j in listed.journals)))

    member_resp, rows = _run(go())
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


@app.command()
def demo(
    data_dir: Annotated[Path, typer.Option(envvar="TIDINGS_DATA_DIR")] = Path("data/demo"),
) -> None:
    """The pipeline: etcd + 3 brokers, transactional producers, a Spark streaming aggregation written exactly
    once to a journal and a table, checked against what was committed; then stops everything."""
    from tidings.cli.demo import run_demo

    run_demo(data_dir, out)


from tidings.cli import logplayer as _logplayer  # noqa: E402,F401  (registers `target`, `targets`, `wal`, `logplayer`)
from tidings.cli import shards as _shards  # noqa: E402,F401  (registers `consumer` and `shards`)

if __name__ == "__main__":
    main()
