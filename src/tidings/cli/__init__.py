"""The `tidings` command (typer + rich). Errors print one line: what, status, next step.

`main` answers `--version` before importing the commands (scripts call it in loops); the
Typer application is assembled in `tidings.cli.app` from its rooms (`journals`, `publish`, `processes`,
`shards`, `logplayer`; shared flags and helpers in `_common`), each command importing only its own."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from tidings import __version__

        print(f"tidings {__version__}")
        return
    from tidings.cli.app import main as run

    run()
