"""The pulse: a primary's own zero-byte append of each journal it leads, through the same AppendFSM
as a client's (Gazette's health check). It keeps the pipeline synchronized and the Route's
consistency advertised when no client appends, runs at once when the route changes, and hands the
spool back (shuts its pipeline down) when this broker is no longer the journal's primary. With
`auto_suspend` it also suspends idle journals (Gazette's AutoSuspend).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from tidings.broker.append_fsm import AppendFSM
from tidings.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from tidings.broker.host import Host
    from tidings.broker.replica import Replica

log = logging.getLogger(__name__)

AUTO_SUSPEND_PULSES = 15  # stable pulses (no route change) before an idle journal may be suspended (Gazette's)


async def pulse(broker: Host, replica: Replica) -> None:
    """Pulse `replica`'s journal every pulse interval, and at once when its route changes, until it closes.

    A pulse that overruns its timeout is cancelled, which the FSM survives at any state (it gives
    back what it holds). A pulse never resumes a suspended journal (SUSPEND_NO_RESUME), and a
    suspended journal is pulsed only when its route changes. With `auto_suspend`, a pulse after
    AUTO_SUSPEND_PULSES stable ones (no route change) asks to suspend the journal if it is idle.
    """
    config = broker.config
    stable = 0
    while not replica.closed.is_set():
        changed = replica.route_changed
        auto = config.auto_suspend and stable >= AUTO_SUSPEND_PULSES
        mode = pb.AppendRequest.SUSPEND_IF_FLUSHED if auto else pb.AppendRequest.SUSPEND_NO_RESUME
        try:
            async with asyncio.timeout(max(5.0, config.pulse_interval * 3)):
                await pulse_once(broker, replica, mode)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("journal %s: pulse: %s", replica.journal, exc)
        if replica.spec.suspend.level != pb.JournalSpec.Suspend.NONE:
            await changed.wait()  # suspended: no periodic pulse
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(config.pulse_interval):
                    await changed.wait()
        stable = 0 if changed.is_set() else stable + 1


async def pulse_once(
    broker: Host, replica: Replica, mode: pb.AppendRequest.Suspend = pb.AppendRequest.SUSPEND_NO_RESUME
) -> None:
    """One pulse: a zero-byte append if this broker is the journal's primary, else give its pipeline up."""
    res = await broker.resolver.resolve(replica.journal)
    if res.status != pb.OK or res.replica is not replica:
        return
    if not res.is_primary:
        await replica.tear_down_pipeline()
        return
    messages = iter([pb.AppendRequest(), None])

    async def next_message() -> pb.AppendRequest | None:
        return next(messages)

    req = pb.AppendRequest(journal=replica.journal, do_not_proxy=True, suspend=mode)
    fsm = AppendFSM(broker, req, pulse=True)
    await fsm.run(next_message)
    if fsm.error:
        log.debug("journal %s: pulse ended in %s: %s", replica.journal, fsm.state, fsm.error)
