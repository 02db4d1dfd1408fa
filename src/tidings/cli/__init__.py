"""The `tidings` command (typer + rich). Errors print one line: what, status, next step."""

from tidings.cli.app import app, main

__all__ = ["app", "main"]
