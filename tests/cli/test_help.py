"""Help, version and start-up: -h as well as --help on every command, plain help without a "<bool>"
beside each flag or boxes cut at the terminal's width, --version, shell completion listed, and a
start that loads and builds only what the command runs (scripts call the CLI in loops)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidings.cli.app import app


def _tidings(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidings.cli", *args], capture_output=True, text=True, timeout=60)


def _commands() -> list[tuple[str, ...]]:
    import typer.main

    root = typer.main.get_command(app)
    found: list[tuple[str, ...]] = [()]
    for name, cmd in root.commands.items():  # type: ignore[attr-defined]
        found.append((name,))
        found.extend((name, sub) for sub in getattr(cmd, "commands", {}))
    return found


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "tidings")
def test_every_command_has_plain_help_under_h(command: tuple[str, ...]) -> None:
    r = _tidings(*command, "-h")
    assert r.returncode == 0 and r.stdout.startswith("Usage: "), r
    assert "<bool>" not in r.stdout and "╭" not in r.stdout and not r.stderr, r.stdout


def test_version_and_completion() -> None:
    from importlib.metadata import version

    r = _tidings("--version")
    assert r.returncode == 0 and r.stdout == f"tidings {version('tidings')}\n", r
    assert "--install-completion" in _tidings("-h").stdout


@pytest.mark.parametrize("command", [("broker",), ("cluster", "up")], ids=" ".join)
def test_every_flag_of_a_long_running_command_has_help_and_its_variable(command: tuple[str, ...]) -> None:
    """As the README says: `broker` and `cluster up` take every flag from a TIDINGS_* variable too."""
    import typer.main

    cmd = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    for param in cmd.params:
        if param.name in ("help",) or not param.param_type_name == "option":
            continue
        assert param.help, f"{' '.join(command)} --{param.name} has no help text"
        assert str(param.envvar or "").startswith("TIDINGS_"), f"{' '.join(command)} --{param.name} has no variable"


def test_a_command_builds_only_its_own_group() -> None:
    """Typer reads the signature of every command it builds, at each start: `tidings journals ...`
    builds the journals group alone, `tidings status` the one command; no command, a misspelt one or
    an option first builds them all (so the help and the error list every command)."""
    from tidings.cli.app import HELP_ORDER, ROOMS, application

    assert sorted(HELP_ORDER) == sorted(set(ROOMS.values()))  # (the help lists every room's commands)

    journals = application("journals")
    assert [g.name for g in journals.registered_groups] == ["journals"] and not journals.registered_commands
    status = application("status")
    assert not status.registered_groups and [c.callback.__name__ for c in status.registered_commands] == ["status"]
    whole = {g.name for g in app.registered_groups} | {c.callback.__name__ for c in app.registered_commands}
    for first in ("", "jornals", "--help", "-h"):
        built = application(first)
        assert {g.name for g in built.registered_groups} | {
            c.callback.__name__ for c in built.registered_commands
        } == whole
    r = _tidings("jornals", "list")
    assert r.returncode == 2 and "Did you mean 'journals'?" in r.stderr, r


HEAVY = ("grpc", "typer", "asyncio", "yaml", "fsspec", "prometheus_client", "pyspark", "rich")


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()  # (the last: the loaded ones; --version prints its line first)
    return lines[-1].split() if lines else []


def test_start_up_loads_only_what_the_command_uses() -> None:
    """Scripts call the CLI in loops: `--version` loads none of the libraries the commands need, the
    commands' module (all `--help` needs) no gRPC nor asyncio, and the client (`tidings.client`)
    neither the fragment store's (fsspec), metrics, YAML nor Spark.
    (What each costs in seconds: bench/cli_startup.py.)"""
    assert _loaded_after("sys.argv = ['tidings', '--version']\nfrom tidings.cli import main\nmain()") == []
    commands = _loaded_after("from tidings.cli.app import app")  # (what `--help` and a usage error need)
    assert not {"grpc", "asyncio", "yaml", "fsspec", "prometheus_client", "pyspark"} & set(commands), commands
    client = _loaded_after("import tidings.client")
    assert not {"fsspec", "prometheus_client", "yaml", "pyspark", "typer", "rich"} & set(client), client
