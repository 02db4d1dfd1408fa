"""Wait on a condition with a timeout, instead of sleeping."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_until(cond: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Poll `cond` (sync or async) until it returns a truthy value; return it, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition {getattr(cond, '__name__', cond)!r} not met within {timeout}s")
        await asyncio.sleep(interval)


def wait_until_sync(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition {getattr(cond, '__name__', cond)!r} not met within {timeout}s")
        time.sleep(interval)


def gone(pid: int) -> bool:
    """The process has exited (a zombie awaiting its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True
