"""Where every asyncio task of a process waits: a debugging aid behind SIGUSR1 (`kill -USR1 PID`)."""

from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger("tidings.tasks")


def task_stacks() -> list[str]:
    """One line per task of the running loop: its name, then the await chain from outer to inner."""
    lines = []
    for task in asyncio.all_tasks():
        frames = []
        coro = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        lines.append(f"task {task.get_name()}: {' <- '.join(frames)}")
    return lines


def coroutine_stacks(prefix: str = "tidings") -> list[str]:
    """The await chains of every live coroutine of `prefix`'s code that no other Python coroutine awaits.

    This sees what task_stacks cannot: coroutines awaited from compiled code (a grpc.aio servicer method's
    handler runs under Cython frames that hide its await chain from its task).
    """
    import gc
    import types

    coros = [o for o in gc.get_objects() if isinstance(o, types.CoroutineType | types.AsyncGeneratorType)]
    awaited = {id(getattr(c, "cr_await", None) or getattr(c, "ag_await", None)) for c in coros}
    lines = []
    for c in coros:
        frame = getattr(c, "cr_frame", None) or getattr(c, "ag_frame", None)
        if frame is None or id(c) in awaited or f"/{prefix}/" not in frame.f_code.co_filename:
            continue
        frames, cur = [], c
        while cur is not None:
            fr = getattr(cur, "cr_frame", None) or getattr(cur, "ag_frame", None)
            if fr is not None:
                frames.append(f"{fr.f_code.co_filename.rsplit('/', 2)[-1]}:{fr.f_lineno} {fr.f_code.co_name}")
            cur = getattr(cur, "cr_await", None) or getattr(cur, "ag_await", None)
        lines.append("coroutine: " + " <- ".join(frames))
    return lines


def log_task_stacks() -> None:
    for line in task_stacks() + coroutine_stacks():
        log.warning("%s", line)


def dump_tasks_on_sigusr1() -> None:
    """Log every task's await chain when the process gets SIGUSR1 (call from inside the loop)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, log_task_stacks)
