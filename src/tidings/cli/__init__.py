"""The `tidings` command (typer + rich). Errors print one line: what, status, next step.

`main` answers `--version` before importing the commands (scripts call it in loops); the
commands and the Typer application are in `tidings.cli.app` (`tidings.cli.app.app`)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from importlib.metadata import version

        print(f"tidings {version('tidings')}")
        return
    from tidings.cli.app import main as run

    run()
