"""What every `tidings` command shares: its consoles, one-line usage errors, the flags' checks and
shared options, running a coroutine, a client of --broker, YAML files of specs edited in $EDITOR,
stdin read off the event loop, and a server process run in the foreground until signalled."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Protocol, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from tidings.protocol.status import TidingsError

if TYPE_CHECKING:  # (annotations only: the client imports grpc, which no command may at start: tests/cli)
    import threading

    from tidings.auth import Authorizer, KeySet
    from tidings.client import AsyncClient
    from tidings.tls import TLS

T = TypeVar("T")

# Plain help (rich_markup_mode=None): no boxes cut to the terminal, no "<bool>" beside every flag;
# -h as well as --help; shell completion (--install-completion).
PLAIN: dict[str, Any] = {"rich_markup_mode": None, "context_settings": {"help_option_names": ["-h", "--help"]}}


def group(help: str) -> typer.Typer:
    """A command group (`tidings journals ...`): plain help, and its help when called alone."""
    return typer.Typer(help=help, no_args_is_help=True, **PLAIN)


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


def check_endpoint(
    flag: str, optional: bool = False, also: tuple[str, ...] = (), any_port: bool = False, schemes: bool = False
) -> Callable[[str], str]:
    """A flag's check that its value is HOST:PORT ('' too when `optional`, or one of `also`; with
    `schemes`, http:// or https:// before it too), before anything connects (`localhost` alone went to
    port 443, `foo:bar` to a resolver error)."""

    def check(value: str) -> str:
        if (optional and value == "") or value in also:
            return value
        bare = value.removeprefix("https://").removeprefix("http://").rstrip("/") if schemes else value
        host, colon, port = bare.rpartition(":")
        least = 0 if any_port else 1  # (port 0: any free one, printed once serving)
        if not colon or not host or not (port.isascii() and port.isdigit()) or not least <= int(port) < 65536:
            forms = ["HOST:PORT", *(repr(w) for w in (*also, *([""] if optional else [])))]
            said = forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]
            usage(f"{flag} {value!r} is not {said}: give a host and a port from {least} to 65535, e.g. 127.0.0.1:8080")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            usage(f"{flag} {value!r}: an IPv6 address goes in brackets, e.g. [{host}]:{port}")
        return value

    return check


def at_least(flag: str, least: int) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value < least:
            usage(f"{flag} is {value}: give {least} or more")
        return value

    return check


def check_log_level(value: str) -> str:
    if value.upper() not in logging.getLevelNamesMapping():
        usage(f"--log-level (TIDINGS_LOG_LEVEL) {value!r} is not a level: give debug, info, warning or error")
    return value


def check_journal_name(value: str) -> str:
    """A journal argument's name checked before anything connects (a usage error, not a broker's refusal)."""
    from tidings.protocol import validate
    from tidings.protocol.status import ValidationError

    if value:
        try:
            validate.journal_name(value, "journal")
        except ValidationError as exc:
            usage(str(exc))
    return value


JournalArg = Annotated[str, typer.Argument(help="A journal name, e.g. shop/orders.", callback=check_journal_name)]


BrokerOpt = Annotated[
    str,
    typer.Option(
        "--broker",
        envvar="TIDINGS_BROKER",
        help="Any broker, HOST:PORT.",
        callback=check_endpoint("--broker (TIDINGS_BROKER)"),
    ),
]


DEFAULT_BROKER = "127.0.0.1:8080"


MetricsOpt = Annotated[
    str,
    typer.Option(
        envvar="TIDINGS_METRICS",
        help="HOST:PORT serving Prometheus /metrics; auto: --listen's port + 1000; '' off.",
        callback=check_endpoint("--metrics", True, also=("auto",)),
    ),
]


AdvertiseOpt = Annotated[
    str,
    typer.Option(
        envvar="TIDINGS_ADVERTISE",
        help="HOST or HOST:PORT other hosts reach this process at (announced in etcd; '' : --listen's). "
        "Needed when --listen's host is 0.0.0.0 or [::]; an IPv6 literal in brackets.",
    ),
]

MetricsAdvertiseOpt = Annotated[
    str,
    typer.Option(
        envvar="TIDINGS_METRICS_ADVERTISE",
        help="HOST or HOST:PORT others scrape /metrics at, when not --advertise's host and the port it serves "
        "(a mapped port).",
    ),
]


MetricsTLSOpt = Annotated[
    bool,
    typer.Option(
        "--metrics-tls",
        envvar="TIDINGS_METRICS_TLS",
        help="Serve /metrics over TLS with --tls-cert/--tls-key (with --tls-ca: only to scrapers holding a "
        "certificate it signed).",
    ),
]


def check_metrics_tls(who: str, metrics: str, on: bool, tls: TLS | None) -> None:
    """Refuse, in one line and before anything starts, --metrics-tls without a certificate to serve or
    without /metrics served."""
    from tidings.member.serving import metrics_tls

    if on and not metrics:
        usage(f"{who}: --metrics-tls serves /metrics over TLS, but --metrics '' serves none: drop one")
    try:
        metrics_tls(on, tls, who)
    except TidingsError as exc:
        usage(str(exc))


def check_advertised(who: str, metrics: str, **flags: str) -> None:
    """Refuse, in one line and before anything starts, an advertised address (keyword: the flag, `_` for
    `-`) nobody could dial: a wildcard, port 0, or not HOST[:PORT]; or one for /metrics served nowhere."""
    from tidings.member.serving import advertised

    if flags.get("metrics_advertise") and not metrics:
        usage(f"{who}: --metrics-advertise names where /metrics is scraped, but --metrics '' serves none: drop one")
    try:
        for name, value in flags.items():
            if value:
                advertised("0.0.0.0:1", value, who, "--" + name.replace("_", "-"))
    except TidingsError as exc:
        usage(str(exc))


DeadlineOpt = Annotated[
    float,
    typer.Option(
        "--deadline",
        help="Seconds to go on retrying transient failures (a primary just killed, a broker restarting) after "
        "the first one, before giving up.",
        callback=at_least("--deadline", 0),
    ),
]


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    import asyncio

    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)


def broker_client(broker: str, deadline: float = 0.0) -> AsyncClient:
    """A client of `broker` (TLS and token as the command's --tls-* and --auth-token* say): with a
    `deadline`, retrying transient failures for that many seconds."""
    from tidings.client import AsyncClient

    tls, auth = client_tls(), client_auth()
    retries = 1_000_000 if deadline else 8
    return AsyncClient(broker, retries=retries, deadline=deadline, fail_fast=True, tls=tls, auth=auth)


# Keys (servers: `broker`, `cluster up`, `consumer`, `target serve`; `logplayer run` and `auth token` sign
# with them). Secret: no default shown, never echoed (errors name a key's index); the file or the variable
# keep them out of `ps`.
AuthKeysOpt = Annotated[
    str,
    typer.Option(
        "--auth-keys",
        envvar="TIDINGS_AUTH_KEYS",
        show_default=False,
        help="Base64 keys, separated by commas or spaces; the first signs, any verifies (AA== also admits "
        "requests without a token). Prefer the file or the variable: a command line is visible in `ps`.",
    ),
]

AuthKeysFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--auth-keys-file",
        envvar="TIDINGS_AUTH_KEYS_FILE",
        show_default=False,
        help="A file holding the keys (as --auth-keys), e.g. a systemd credential.",
    ),
]


def auth_keys(keys: str, keys_file: Path | None) -> KeySet | None:
    """The keys of --auth-keys or --auth-keys-file (None: neither, auth off); a mistake is a usage line
    naming the flag and the key's index, never a key."""
    from tidings.auth import KeySet

    try:
        return KeySet.from_sources(keys or None, keys_file)
    except TidingsError as mistake:
        usage(str(mistake))


# --tls-cert/--tls-key/--tls-ca: every command that serves or dials has them (`secured`, applied to
# every command by cli/app.py); a server reads them with `server_tls`, a client with `client_tls`.
_TLS_FLAGS: dict[str, Path | None] = {}
_TLS_OPTIONS = {
    "tls_cert": ("--tls-cert", "TIDINGS_TLS_CERT", "This process's certificate (PEM): a server serves TLS with it; "
                 "a client presents it to servers that require one."),
    "tls_key": ("--tls-key", "TIDINGS_TLS_KEY", "The private key of --tls-cert (PEM)."),
    "tls_ca": ("--tls-ca", "TIDINGS_TLS_CA", "CA bundle (PEM) verifying peers; a server given one requires client "
               "certificates it signed (mutual TLS)."),
}  # fmt: skip


# --auth-token/--auth-token-file: every command that dials brokers as a client has them (`secured`
# with `token`); `client_auth` reads them. Secret: no default shown, never echoed. And --transport: how
# the process's clients call brokers (and a LogPlayer its targets), set for every client it makes.
_TOKEN_FLAGS: dict[str, Any] = {}
_TOKEN_OPTIONS: dict[str, Any] = {
    "auth_token": Annotated[
        str | None,
        typer.Option(
            "--auth-token",
            envvar="TIDINGS_AUTH_TOKEN",
            show_default=False,
            help="A token for brokers holding keys (from `tidings auth token`). Prefer the file or the "
            "variable: a command line is visible in `ps`.",
        ),
    ],
    "auth_token_file": Annotated[
        Path | None,
        typer.Option(
            "--auth-token-file",
            envvar="TIDINGS_AUTH_TOKEN_FILE",
            show_default=False,
            help="A file holding the token (as --auth-token).",
        ),
    ],
    "transport": Annotated[
        str | None,
        typer.Option(
            "--transport",
            envvar="TIDINGS_TRANSPORT",
            show_default=False,
            help="How to call brokers (and targets): 'tidings' (the default: their data ports, falling back to "
            "gRPC) or 'grpc'.",
        ),
    ],
}


# --etcd-tls-ca/-cert/-key, --etcd-user, --etcd-password-file: every command with --etcd has them
# (`secured`); `etcd_security` reads them. The password only from a file or TIDINGS_ETCD_PASSWORD.
_ETCD_FLAGS: dict[str, Any] = {}
_ETCD_OPTIONS: dict[str, Any] = {
    name: Annotated[typ, typer.Option(flag, envvar=env, help=help, show_default=False)]
    for name, typ, flag, env, help in (
        ("etcd_tls_ca", Path | None, "--etcd-tls-ca", "TIDINGS_ETCD_TLS_CA", "CA bundle (PEM) verifying etcd: "
         "etcd over TLS (any --etcd-tls-* turns it on)."),
        ("etcd_tls_cert", Path | None, "--etcd-tls-cert", "TIDINGS_ETCD_TLS_CERT", "A client certificate for "
         "etcd's --client-cert-auth (PEM)."),
        ("etcd_tls_key", Path | None, "--etcd-tls-key", "TIDINGS_ETCD_TLS_KEY", "The private key of --etcd-tls-cert."),
        ("etcd_user", str | None, "--etcd-user", "TIDINGS_ETCD_USER", "An etcd user (its password from "
         "TIDINGS_ETCD_PASSWORD or --etcd-password-file)."),
        ("etcd_password_file", Path | None, "--etcd-password-file", "TIDINGS_ETCD_PASSWORD_FILE", "A file holding "
         "the etcd user's password."),
    )
}  # fmt: skip


def _use_transport(transport: str) -> None:
    """--transport: every client this process makes uses it (AsyncClient's default is TIDINGS_TRANSPORT's)."""
    from tidings.client._async import TRANSPORT_VARIABLE, TRANSPORTS

    if transport not in TRANSPORTS:
        usage(f"--transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    os.environ[TRANSPORT_VARIABLE] = transport


def secured(command: Callable[..., T], token: bool = True) -> Callable[..., T]:
    """`command` with the --tls-* options too (their values kept for `client_tls`/`server_tls`), with
    `token` (a client of brokers) --auth-token and --auth-token-file (for `client_auth`), and when it
    takes --etcd, etcd's TLS and user (for `etcd_security`)."""
    import functools
    import inspect

    if getattr(command, "__tidings_secured__", False):
        return command
    tls = {
        name: Annotated[Path | None, typer.Option(flag, envvar=env, help=help, show_default=False)]
        for name, (flag, env, help) in _TLS_OPTIONS.items()
    }
    sig = inspect.signature(command, eval_str=True)
    etcd = _ETCD_OPTIONS if "etcd" in sig.parameters else {}
    extra = {**tls, **(_TOKEN_OPTIONS if token else {}), **etcd}

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> T:
        for name in tls:
            _TLS_FLAGS[name] = kwargs.pop(name)
        for name in _TOKEN_OPTIONS if token else ():
            _TOKEN_FLAGS[name] = kwargs.pop(name)
        if transport := _TOKEN_FLAGS.pop("transport", None):
            _use_transport(transport)
        for name in etcd:
            _ETCD_FLAGS[name] = kwargs.pop(name)
        return command(*args, **kwargs)

    params = [*sig.parameters.values()]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=a) for n, a in extra.items()
    ]
    run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]  # (typer reads it)
    run.__annotations__ = {**command.__annotations__, **extra}
    run.__tidings_secured__ = True  # type: ignore[attr-defined]
    return run


def _tls(who: str, server: bool) -> TLS | None:
    from tidings.tls import load

    try:
        return load(_TLS_FLAGS.get("tls_cert"), _TLS_FLAGS.get("tls_key"), _TLS_FLAGS.get("tls_ca"), who, server)
    except TidingsError as mistake:
        usage(str(mistake))


def etcd_security(who: str) -> dict[str, Any]:
    """`Etcd.connect`'s tls, user and password from a server command's --etcd-* flags (one usage line
    for a mistake: a half certificate pair, an unreadable file, a password without a user)."""
    from tidings.tls import load

    flags = _ETCD_FLAGS
    try:
        tls = load(flags.get("etcd_tls_cert"), flags.get("etcd_tls_key"), flags.get("etcd_tls_ca"), who, False)
    except TidingsError as mistake:
        usage(str(mistake).replace("--tls-", "--etcd-tls-"))
    user = flags.get("etcd_user") or ""
    path = flags.get("etcd_password_file")
    password = os.environ.get("TIDINGS_ETCD_PASSWORD", "")
    if path is not None:
        try:
            password = Path(path).read_text().rstrip("\n")
        except OSError as err:
            usage(f"{who}: cannot read --etcd-password-file {path} ({err.strerror or err})")
    if password and not user:
        usage(f"{who}: an etcd password is given but no --etcd-user (TIDINGS_ETCD_USER): give the user too")
    if user and not password:
        usage(f"{who}: --etcd-user {user} needs its password: set TIDINGS_ETCD_PASSWORD or give --etcd-password-file")
    return {"etcd_tls": tls, "etcd_user": user, "etcd_password": password}


def client_tls() -> TLS | None:
    """The TLS a client command dials with (None: plaintext); a mistake in the flags is a usage line."""
    return _tls("tidings", server=False)


def server_tls(who: str) -> TLS | None:
    """The TLS a server command (`who`) serves and dials with (None: plaintext)."""
    return _tls(who, server=True)


def client_auth(keys: KeySet | None = None, sub: str = "") -> Authorizer | None:
    """What authorizes a client command's calls: `keys` (a command taking --auth-keys, e.g. `logplayer
    run`: it signs a token per call, as `sub`), else its --auth-token (or --auth-token-file) as a bearer
    token, None without either; a mistake in the flags (keys and a token both: which would it use?) is a
    usage line (never showing the token)."""
    from tidings.auth import BearerAuthorizer, KeyedAuthorizer

    token, path = _TOKEN_FLAGS.get("auth_token"), _TOKEN_FLAGS.get("auth_token_file")
    if keys is not None:
        if token or path:
            given = "--auth-token-file" if path else "--auth-token (TIDINGS_AUTH_TOKEN)"
            usage(f"--auth-keys and {given} are both given: give one (keys sign a fresh token per call)")
        return KeyedAuthorizer(keys, sub=sub)
    if token and path:
        usage("--auth-token and --auth-token-file are both given: give one")
    if path:
        try:
            token = path.read_text(encoding="ascii")
        except UnicodeDecodeError:
            usage(f"--auth-token-file {path} is not text: give the file `tidings auth token` wrote")
        except OSError as exc:
            usage(f"--auth-token-file {path} cannot be read: {exc.strerror or exc}")
        flag = f"--auth-token-file {path}"
    else:
        flag = "--auth-token (TIDINGS_AUTH_TOKEN)"
    if not token and not path:
        return None  # (an empty --auth-token, or TIDINGS_AUTH_TOKEN set empty: none)
    try:
        return BearerAuthorizer(token or "")
    except TidingsError:
        usage(f"{flag} is empty or has spaces: give what `tidings auth token` printed")


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


class Stdin:
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


class Server(Protocol):
    """What `serve_until_signalled` runs: a broker, a consumer, a target (its `start` gives it)."""

    endpoint: str
    metrics_endpoint: str
    metrics_scheme: str  # http, or https with --metrics-tls

    async def stop(self, graceful: bool = True) -> None: ...


def serve_until_signalled(start: Callable[[], Awaitable[Server]], who: str, exit_timeout: float) -> None:
    """Run a server process in the foreground: start it, print `READY HOST:PORT [METRICS HOST:PORT]`,
    stop it gracefully on SIGTERM or SIGINT (exit code 0), or without hand-off once its etcd lease is
    lost (exit code 1). A signal during start (which may wait for a previous process's member key to
    expire) cancels it; start then undoes what it began."""
    import asyncio

    log = logging.getLogger("tidings.cli")

    async def run() -> int:
        from tidings.tasks import dump_tasks_on_sigusr1

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
            log.info("%s: metrics on %s://%s/metrics", who, server.metrics_scheme, server.metrics_endpoint)
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

    code = run_async(run())
    if code:
        raise typer.Exit(code)


def _exit_unless_stopped_within(seconds: float, who: str) -> threading.Timer:
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
