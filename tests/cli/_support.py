"""Running the `tidings` command in a child process, as a user does: the helpers the cli tests share."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path


def tidings(
    *args: str, broker: str = "", stdin: bytes = b"", cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"TIDINGS_BROKER": broker} if broker else {}), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tidings.cli", *args], input=stdin, capture_output=True, env=env, cwd=cwd, timeout=60
    )


async def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(tidings, *args, **kw)
