"""`tidings`: run a local cluster or a broker, and manage journals.

Client commands reach the cluster through `--broker HOST:PORT` (env TIDINGS_BROKER, default
127.0.0.1:8080); any broker will do. Every flag of `broker` and `cluster up` has a TIDINGS_*
environment variable too (named in each command's -h).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from typing import Annotated, NoReturn

import typer
from rich.markup import escape

from tidings.cli._common import PLAIN, err, secured
from tidings.protocol.status import TidingsError, ValidationError

# Each command or group and the module (a room of tidings.cli) that registers it: a command imports
# only its own room (typer reads the signature of every command it builds, at each start).
ROOMS = {
    "broker": "processes",
    "consumer": "shards",
    "publish": "publish",
    "status": "processes",
    "demo": "processes",
    "cluster": "processes",
    "members": "processes",
    "journals": "journals",
    "shards": "shards",
    "target": "logplayer",
    "targets": "logplayer",
    "logplayer": "logplayer",
    "wal": "logplayer",
    "auth": "auth",
}

HELP_ORDER = ("processes", "publish", "shards", "journals", "logplayer", "auth")  # (typer lists commands as registered)


def _version(value: bool) -> None:
    if value:
        from tidings import __version__

        print(f"tidings {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)
    ] = False,
) -> None:
    pass


def application(only: str = "") -> typer.Typer:
    """The `tidings` application: every room's commands, or (`only`, a command or group name) that
    one alone. No command, a misspelt one or an option first get them all, so the help and the
    error list every command."""
    root = typer.Typer(help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False, **PLAIN)
    root.callback()(_root)
    rooms = [ROOMS[only]] if only in ROOMS else HELP_ORDER
    for room in rooms:
        importlib.import_module(f"tidings.cli.{room}").register(root)
    _secure(root)
    if only in ROOMS:
        return _only(root, only)
    return root


UNSECURED = frozenset({"demo", "auth"})  # (no peer to dial: the demo runs its own loopback cluster)
# Servers (their callbacks): no --auth-token (they verify with --auth-keys; a consumer signs its own calls
# with them: a token would expire while it runs; a target calls nobody).
SERVERS = frozenset({"broker", "cluster_up", "consumer", "target_serve"})


def _secure(root: typer.Typer) -> None:
    """Every command that serves or dials takes --tls-cert/--tls-key/--tls-ca, and every client of the
    brokers --auth-token/--auth-token-file (`_common.secured`)."""
    from typer.main import get_command_name

    commands = list(root.registered_commands)
    for g in root.registered_groups:
        if g.name not in UNSECURED and g.typer_instance is not None:
            commands += g.typer_instance.registered_commands
    for c in commands:
        if c.callback is not None and (c.name or get_command_name(c.callback.__name__)) not in UNSECURED:
            c.callback = secured(c.callback, token=c.callback.__name__ not in SERVERS)


def _only(root: typer.Typer, name: str) -> typer.Typer:
    from typer.main import get_command_name

    slim = copy.copy(root)
    slim.registered_groups = [g for g in root.registered_groups if g.name == name]
    slim.registered_commands = [
        c
        for c in root.registered_commands
        if (c.name or get_command_name(c.callback.__name__)) == name  # type: ignore[union-attr]  # (a command has its callback)
    ]
    return slim


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # (the whole application, built at each use; `main` builds only what it runs)
        return application()
    raise AttributeError(name)


# One-shot client commands: once one is done, the process ends without the interpreter's teardown
# (gRPC's shutdown of its threads and channels costs ~0.15 s a call); servers and Spark end as usual.
FAST_EXIT = frozenset({"journals", "publish", "members", "status", "shards", "wal", "targets", "auth"})


def main() -> None:
    """Entry point: run the app, turning TidingsErrors into one clear line and exit code 1 (2 for
    input that is invalid, a usage error: a spec field, a journal name, a flag)."""
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    # gRPC's C core logs each refused TLS handshake on stderr; the command says the cause in its own line
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        application(name)()
    except TidingsError as exc:
        # escape: "[s3]" in "pip install 'tidings[s3]'" is text, not markup; soft_wrap: one line, however long
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        code: int = 2 if isinstance(exc, ValidationError) else 1
    except SystemExit as exc:
        if name not in FAST_EXIT or not isinstance(exc.code, int | None):
            raise
        code = exc.code or 0
    else:
        code = 0
    if name not in FAST_EXIT:
        raise SystemExit(code)
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End the process with `code` once stdout and stderr are written, skipping the teardown."""
    import logging
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # (nobody reads it any more)
            pass
        except (OSError, ValueError):  # (a full disk, EIO: the output is lost, so is the exit code 0)
            code = code or 120  # (what Python's own exit says when its final flush fails)
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
