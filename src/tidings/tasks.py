"""Tasks: where each asyncio task waits (on SIGUSR1), whose cancellation a CancelledError is, and
work that must run to its end whatever happens to its caller."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import types
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("tidings.tasks")


def _frame(coro: Any) -> types.FrameType | None:
    return getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)


def _awaits(coro: Any) -> Any:
    return getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)


def await_chain(coro: Any) -> str:
    """`file:line function` of `coro` and of what it awaits, outer to inner."""
    frames = []
    while coro is not None:
        frame = _frame(coro)
        if frame is not None:
            name = frame.f_code.co_filename.rsplit("/", 2)[-1]
            frames.append(f"{name}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = _awaits(coro)
    return " <- ".join(frames)


def task_stacks() -> list[str]:
    """One line per task of the running loop: its name, then its await chain."""
    return [f"task {task.get_name()}: {await_chain(task.get_coro())}" for task in asyncio.all_tasks()]


def coroutine_stacks(prefix: str = "tidings") -> list[str]:
    """The await chains of every live coroutine of `prefix`'s code that no other Python coroutine awaits.

    This sees what task_stacks cannot: coroutines awaited from compiled code (a grpc.aio servicer method's
    handler runs under Cython frames that hide its await chain from its task).
    """
    coros = [o for o in gc.get_objects() if isinstance(o, types.CoroutineType | types.AsyncGeneratorType)]
    awaited = {id(_awaits(c)) for c in coros}
    return [
        f"coroutine: {await_chain(c)}"
        for c in coros
        if (frame := _frame(c)) is not None and id(c) not in awaited and f"/{prefix}/" in frame.f_code.co_filename
    ]


def cancelled_under_us() -> bool:
    """Whether a CancelledError being handled came from something we awaited, not from our task's cancel().

    grpc.aio cancels a whole call when a task waiting in its `read()`/`write()` is cancelled, and other
    tasks then get CancelledError from it: that is a failure of the call, not a cancellation of theirs.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def log_task_stacks() -> None:
    for line in task_stacks() + coroutine_stacks():
        log.warning("%s", line)


def dump_tasks_on_sigusr1() -> None:
    """Log every task's await chain when the process gets SIGUSR1 (call from inside the loop)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, log_task_stacks)


async def to_the_end(work: Awaitable[T]) -> T:
    """Await `work` to its end even if the caller is cancelled meanwhile (CancelledError comes after,
    whatever the work's outcome): a commit or an apply in a worker thread cannot stop half-way, and
    the caller must know it ended before it goes on (to roll back, close, restore, or let the next
    stream in)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        raise
